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

void kvr__do_auth(kvr_request *r)
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
            kvr__conn_fail(c, r->id, KVR_EUNAUTH, "authentication failed: wrong token");
            kvr__request_end(r, KVR_EUNAUTH);
            return;
        }
        /* From here on it counts against --max-connections. */
        kvr__conn_set_authed(c);
        if (d->n_conns - d->n_unauth > d->cfg.max_connections) {
            d->n_conn_refused++;
            kvr__conn_fail(c, r->id, KVR_ELIMIT, "too many connections (--max-connections)");
            kvr__request_end(r, KVR_ELIMIT);
            return;
        }
    }
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    kvr__reply_ok(r, &resp);
}

void kvr__do_ping(kvr_request *r)
{
    Kvrope__Pong p = KVROPE__PONG__INIT;
    char server[64];
    snprintf(server, sizeof server, "kvroped %s", KVR_DAEMON_VERSION);
    p.server = server;
    p.protocol = KVR_PROTOCOL_VERSION;
    REPLY_BODY(r, PONG, pong, &p);
}


/* Every figure by name, from the snapshot /metrics renders (metrics.c). */
void kvr__do_stats(kvr_request *r)
{
    kvr_metric_list l;
    kvr_error e = { 0 };
    int rc = kvr__metrics_list(r->d, &l, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    Kvrope__Metric *ms = kvr_mem_calloc(l.n ? l.n : 1, sizeof *ms);
    Kvrope__Metric **ptrs = kvr_mem_calloc(l.n ? l.n : 1, sizeof *ptrs);
    if (!ms || !ptrs) {
        kvr_mem_free(ms);
        kvr_mem_free(ptrs);
        kvr__metrics_list_free(&l);
        kvr__reply_error(r, KVR_ENOMEM, "out of memory for the stats");
        return;
    }
    for (size_t i = 0; i < l.n; i++) {
        kvrope__metric__init(&ms[i]);
        ms[i].name = UNCONST(char *, l.names[i]);
        ms[i].value = l.values[i];
        ptrs[i] = &ms[i];
    }
    Kvrope__StatsResult sr = KVROPE__STATS_RESULT__INIT;
    sr.n_metrics = l.n;
    sr.metrics = ptrs;
    REPLY_BODY(r, STATS, stats, &sr);
    kvr_mem_free(ms);
    kvr_mem_free(ptrs);
    kvr__metrics_list_free(&l);
}


/* ---- shared-memory regions (shm.c) ---------------------------------------------- */

static void reply_region(kvr_request *r, uint32_t id, uint64_t size)
{
    Kvrope__RegionInfo ri = KVROPE__REGION_INFO__INIT;
    ri.region = id;
    ri.size = size;
    ri.n_regions = r->c->n_regions;
    ri.bytes = r->c->region_bytes;
    REPLY_BODY(r, REGION, region, &ri);
}

void kvr__do_register_region(kvr_request *r)
{
    kvr_region *g;
    kvr_error e = { 0 };
    int rc = kvr__shm_register(r->c, r->fd, r->msg->register_region->size, &g, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    kvr_log(KVR_LOG_DEBUG, "region %u registered: %zu bytes", g->id, g->size);
    reply_region(r, g->id, g->size);
}

void kvr__do_release_region(kvr_request *r)
{
    uint32_t id = r->msg->release_region->region;
    kvr_error e = { 0 };
    int rc = kvr__shm_release(r->c, id, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    reply_region(r, id, 0);
}

