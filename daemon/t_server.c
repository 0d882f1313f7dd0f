/*
 * t_server.c — the verbs about the server and the connection rather than
 * any context: auth (the token, compared in constant time; then the
 * connection counts against --max-connections), ping, stats (every figure
 * the daemon keeps, by name), and shared-memory regions (shm.c).
 *
 * Invariants: auth is the one verb an unauthenticated connection may send
 * (V_OPEN); a failed auth closes the connection; stats reads the store and
 * the daemon's counters on the loop thread.
 */
#include "daemon/dispatch.h"

void kvr__do_auth(kvrd_request *r)
{
    kvr_daemon *d = r->d;
    kvr_conn *c = r->c;
    const ProtobufCBinaryData *t = &r->msg->auth->token;
    if (d->token && c->is_tcp) {
        /* Constant time in the token's content: every byte of the
         * configured token is looked at whatever the input is. */
        unsigned diff = t->len != d->token_len;
        for (size_t i = 0; i < d->token_len; i++) {
            uint8_t x = i < t->len ? t->data[i] : 0;
            diff |= (unsigned)(x ^ d->token[i]);
        }
        if (diff) {
            kvr_conn_fail(c, r->id, KVR_EUNAUTH, "authentication failed: wrong token");
            kvrd_request_end(r, KVR_EUNAUTH);
            return;
        }
        /* From here on it counts against --max-connections. */
        kvr_conn_set_authed(c);
        if (d->n_conns - d->n_unauth > d->cfg.max_connections) {
            d->n_conn_refused++;
            kvr_conn_fail(c, r->id, KVR_ELIMIT, "too many connections (--max-connections)");
            kvrd_request_end(r, KVR_ELIMIT);
            return;
        }
    }
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    kvr__reply_ok(r, &resp);
}

void kvr__do_ping(kvrd_request *r)
{
    Kvrope__Pong p = KVROPE__PONG__INIT;
    char server[64];
    snprintf(server, sizeof server, "kvroped %s", KVR_DAEMON_VERSION);
    p.server = server;
    p.protocol = KVR_PROTOCOL_VERSION;
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_PONG;
    resp.pong = &p;
    kvr__reply_ok(r, &resp);
}


void kvr__do_stats(kvrd_request *r)
{
    kvr_daemon *d = r->d;
    kvr_store_stats s;
    kvr_store_get_stats(d->store, &s);
    struct { const char *name; double v; } fixed[] = {
        { "uptime_seconds", (double)(kvr_now_ms() - d->start_ms) / 1000.0 },
        { "mem_allocated_bytes", (double)s.mem_allocated },
        { "mem_peak_bytes", (double)s.mem_peak },
        { "mem_cap_bytes", (double)s.mem_cap },
        { "block_bytes", (double)s.block_bytes },
        { "kv_held_bytes", (double)s.kv_held_bytes },
        { "block_cache_bytes", (double)s.block_cache_bytes },
        { "models", (double)s.n_models },
        { "contexts", (double)s.n_contexts },
        { "blocks", (double)s.n_blocks },
        { "tokens", (double)s.n_tokens },
        { "leased_blocks", (double)s.n_leased_blocks },
        { "evicted_blocks", (double)s.n_evicted_blocks },
        { "evicted_bytes", (double)s.n_evicted_bytes },
        { "refused_nomem", (double)s.n_refused_nomem },
        { "store_puts", (double)s.n_puts },
        { "store_gets", (double)s.n_gets },
        { "store_matches", (double)s.n_matches },
        { "store_match_hits", (double)s.n_match_hits },
        { "quant_contexts", (double)s.n_quant_contexts },
        { "quant_bytes_saved", (double)s.quant_bytes_saved },
        { "quant_bits_per_value", s.quant_bits_per_value },
        { "connections", (double)d->n_conns },
        { "connections_total", (double)d->n_conn_total },
        { "connections_refused", (double)d->n_conn_refused },
        { "requests_total", (double)d->n_requests },
        { "errors_total", (double)d->n_errors },
        { "bytes_in", (double)d->bytes_in },
        { "bytes_out", (double)d->bytes_out },
        { "streamed_replies", (double)d->n_streamed },
        { "streams_aborted", (double)d->n_stream_aborted },
        { "msg_buffered_bytes", (double)d->msg_buffered },
        { "msg_buffer_limit_bytes", (double)d->msg_buffer_limit },
        { "msg_buffer_refused", (double)d->n_msg_limited },
        { "slow_frames_closed", (double)d->n_slow_closed },
    };
    enum { NF = sizeof fixed / sizeof fixed[0], ND = 72, NT = 6 };
    char names[KVR_N_VERBS][40];
    const char *dn[ND];
    double dv[ND];
    /* Disk tier (persist.c): per-tier bytes/blocks, hit rates, recovery. */
    size_t nd = kvr_persist_metrics(d, dn, dv, ND);
    if (d->remote)
        nd += kvr_remote_metrics(d->remote, dn + nd, dv + nd, ND - nd);
    /* Per model, as a tenant of the cap (--max-memory-per-model): its
     * bytes, evictions, prefix matches and hits, writes refused at its
     * bound: model_<name>_<figure>. */
    size_t n_models = kvr_store_model_list(d->store, NULL, 0);
    kvr_model_info *mi = n_models ? kvr_mem_calloc(n_models, sizeof *mi) : NULL;
    size_t nt = mi ? NT * kvr_store_model_list(d->store, mi, n_models) : 0;
    if (nt > NT * n_models)
        nt = NT * n_models;
    size_t N = NF + KVR_N_VERBS + nd + nt;
    Kvrope__Metric *ms = kvr_mem_calloc(N, sizeof *ms);
    Kvrope__Metric **ptrs = kvr_mem_calloc(N, sizeof *ptrs);
    char (*tn)[KVR_ID_MAX + 32] = nt ? kvr_mem_calloc(nt, sizeof *tn) : NULL;
    if (!ms || !ptrs || (nt && !tn)) {
        kvr_mem_free(mi);
        kvr_mem_free(ms);
        kvr_mem_free(ptrs);
        kvr_mem_free(tn);
        kvr__reply_error(r, KVR_ENOMEM, "out of memory for the stats");
        return;
    }
    size_t nm = 0;
    for (size_t i = 0; i < NF + KVR_N_VERBS + nd; i++, nm++) {
        kvrope__metric__init(&ms[nm]);
        ptrs[nm] = &ms[nm];
        if (i < NF) {
            ms[nm].name = UNCONST(char *, fixed[i].name);
            ms[nm].value = fixed[i].v;
        } else if (i < NF + KVR_N_VERBS) {
            size_t k = i - NF;
            snprintf(names[k], sizeof names[k], "requests_%s", kvrd_verb_name(k));
            ms[nm].name = names[k];
            ms[nm].value = (double)d->per_verb[k];
        } else {
            ms[nm].name = UNCONST(char *, dn[i - NF - KVR_N_VERBS]);
            ms[nm].value = dv[i - NF - KVR_N_VERBS];
        }
    }
    for (size_t k = 0; k < nt; k++, nm++) {
        const kvr_model_info *m = &mi[k / NT];
        static const char *const fig[NT] = { "bytes", "evicted_blocks", "evicted_bytes",
                                             "matches", "match_hits", "refused_bound" };
        double v[NT] = { (double)m->bytes, (double)m->n_evicted_blocks,
                         (double)m->n_evicted_bytes, (double)m->n_matches,
                         (double)m->n_match_hits, (double)m->n_refused_bound };
        snprintf(tn[k], sizeof tn[k], "model_%s_%s", m->name, fig[k % NT]);
        kvrope__metric__init(&ms[nm]);
        ptrs[nm] = &ms[nm];
        ms[nm].name = tn[k];
        ms[nm].value = v[k % NT];
    }
    Kvrope__StatsResult sr = KVROPE__STATS_RESULT__INIT;
    sr.n_metrics = nm;
    sr.metrics = ptrs;
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_STATS;
    resp.stats = &sr;
    kvr__reply_ok(r, &resp);
    kvr_mem_free(mi);
    kvr_mem_free(ms);
    kvr_mem_free(ptrs);
    kvr_mem_free(tn);
}


/* ---- shared-memory regions (shm.c) ---------------------------------------------- */

static void reply_region(kvrd_request *r, uint32_t id, uint64_t size)
{
    Kvrope__RegionInfo ri = KVROPE__REGION_INFO__INIT;
    ri.region = id;
    ri.size = size;
    ri.n_regions = r->c->n_regions;
    ri.bytes = r->c->region_bytes;
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_REGION;
    resp.region = &ri;
    kvr__reply_ok(r, &resp);
}

void kvr__do_register_region(kvrd_request *r)
{
    kvrd_region *g;
    kvr_error e = { 0 };
    int rc = kvrd_shm_register(r->c, r->fd, r->msg->register_region->size, &g, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    kvr_log(KVR_LOG_DEBUG, "region %u registered: %zu bytes", g->id, g->size);
    reply_region(r, g->id, g->size);
}

void kvr__do_release_region(kvrd_request *r)
{
    uint32_t id = r->msg->release_region->region;
    kvr_error e = { 0 };
    int rc = kvrd_shm_release(r->c, id, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    reply_region(r, id, 0);
}

