/*
 * t_kv.c — the verbs that carry K/V: put and group_append (payload in),
 * get and match (payload out; a large get that needs work is streamed by
 * stream.c), assemble (APE documents after a prefix).
 *
 * Invariants: a put's payload goes straight into the transaction's
 * iovecs and is checked on the daemon's copy; a get's status is decided
 * by begin, before any payload exists; staging is reserved on the loop
 * thread before anything is sent; a shared put is published only after
 * its local commit.
 */
#include "daemon/dispatch.h"

int kvr__work_put(kvr_request *r, kvr_error *e)      { return kvr_put_work(r->put, e); }
int kvr__work_get(kvr_request *r, kvr_error *e)      { return kvr_get_work(r->get, e); }
int kvr__work_assemble(kvr_request *r, kvr_error *e) { return kvr_assemble_work(r->as, e); }

static void end_get_cb(void *arg, int status)
{
    (void)status;
    kvr_get_end(arg);
}

void kvr__end_assemble_cb(void *arg, int status)
{
    (void)status;
    kvr_assemble_end(arg);
}


/* ---- put and group append ------------------------------------------------------ */

/* Put.codec: a bad spec is E_INVALID (the store's message) whatever the
 * mode; on an existing context (append/upsert) it must be the context's
 * codec, since a context's codec is fixed at create (a replace creates a
 * new context: any codec). Replies on failure. */
static int put_codec_check(kvr_request *r, const Kvrope__Put *p)
{
    char canon[KVR_CODEC_NAME_MAX];
    kvr_error e = { 0 };
    int rc = kvr_store_codec_check(r->d->store, p->model, p->codec, canon, &e);
    if (rc < 0) {
        if (rc == KVR_ENOMODEL)
            kvr__reply_errf(r, rc, "unknown model '%s'", p->model);
        else
            kvr__reply_err(r, rc, &e);
        return rc;
    }
    kvr_ctx_info ci;
    if (p->mode != KVROPE__PUT_MODE__CREATE && p->mode != KVROPE__PUT_MODE__REPLACE &&
        kvr_store_stat(r->d->store, p->context_id, &ci, NULL) == 0 &&
        strcmp(ci.codec, canon) != 0) {
        kvr__reply_errf(r, KVR_EINVAL, "put: context '%s' is stored as %s, not %s (a context's "
                   "codec is chosen when it is created)", p->context_id, ci.codec, canon);
        return KVR_EINVAL;
    }
    return 0;
}

/* Starts a put (Put, or the Put inside a GroupAppend with `group` set):
 * begin, then the payload into its iovecs, then work and finish_put. */
static void start_put(kvr_request *r, const Kvrope__Put *p, const char *group,
                      const Kvrope__LayoutPutOptions *lo)
{
    kvr_error err = { 0 };
    kvr_put_params pp;
    int rc = kvr__put_params_from_pb(p, group, r->payload_len, &pp, &err);
    if (rc < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    if (pp.codec && put_codec_check(r, p) < 0)
        return;
    if (((p->has_share && p->share) || (p->has_share_sync && p->share_sync)) && !r->d->remote) {
        kvr__reply_errf(r, KVR_EUNSUPPORTED, "put.share: this kvroped has no shared tier (start it "
                   "with --remote-tier redis://HOST:PORT); nothing was stored");
        return;
    }
    if ((rc = kvr__put_layout_from_pb(lo, &pp, &err)) < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    if (!p->has_n_layers || !p->has_n_kv_heads || !p->has_head_dim) {
        uint32_t ml, mh, md;
        if (kvr_store_model_shape(r->d->store, p->model, &ml, &mh, &md) < 0) {
            kvr__reply_errf(r, KVR_ENOMODEL, "unknown model '%s'", p->model);
            return;
        }
        if (!p->has_n_layers)
            pp.n_layers = ml;
        if (!p->has_n_kv_heads)
            pp.n_kv_heads = mh;
        if (!p->has_head_dim)
            pp.head_dim = md;
    }
    kvr_error e = { 0 };
    rc = kvr_store_put_begin(r->d->store, &pp, &r->put, &e);
    if (rc < 0) {
        r->put = NULL;
        kvr__reply_err(r, rc, &e);
        return;
    }
    size_t want = kvr_put_payload_size(r->put);
    if ((uint64_t)want != r->payload_len) {
        kvr__release_txn(r);
        kvr__reply_errf(r, KVR_EPAYLOAD,
                   "put: payload_len %llu, but %zu layers x 2 x %zu tokens x %u heads x %u dims "
                   "x %zu bytes = %zu",
                   (unsigned long long)r->payload_len, (size_t)pp.n_layers, pp.n_tokens,
                   pp.n_kv_heads, pp.head_dim, kvr_dtype_size(pp.dtype), want);
        return;
    }
    kvr__read_payload(r);
}

void kvr__do_put(kvr_request *r)
{
    const Kvrope__Put *p = r->msg->put;
    start_put(r, p, NULL, p->layout);
}

void kvr__do_group_append(kvr_request *r)
{
    const Kvrope__GroupAppend *g = r->msg->group_append;
    if (!g->group || !g->group[0]) {
        kvr__reply_errf(r, KVR_EBADREQUEST, "group_append: missing group");
        return;
    }
    if (g->put->n_positions || g->put->has_pos_start) {
        kvr__reply_errf(r, KVR_EBADREQUEST,
                   "group_append: positions come from the group's cursor; give none");
        return;
    }
    start_put(r, g->put, g->group, g->options ? g->options : g->put->layout);
}

void kvr__finish_put(kvr_request *r)
{
    if (kvr__work_failed(r))
        return;
    kvr_put *t = r->put;
    r->put = NULL;
    kvr_put_result res;
    kvr_error e = { 0 };
    int rc = kvr_put_commit(t, &res, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    Kvrope__PutResult pr;
    kvr__pb_put_result(&res, &pr);
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    bool ga = r->verb->body == KVROPE__REQUEST__BODY_GROUP_APPEND;
    if (ga) {
        resp.body_case = KVROPE__RESPONSE__BODY_GROUP_APPEND;
        resp.group_append = &pr;
    } else {
        resp.body_case = KVROPE__RESPONSE__BODY_PUT;
        resp.put = &pr;
    }
    const Kvrope__Put *pq = ga ? r->msg->group_append->put : r->msg->put;
    bool share_sync = pq->has_share_sync && pq->share_sync;
    if (r->d->remote && (share_sync || (pq->has_share && pq->share) || r->d->cfg.share_all)) {
        /* Published after the local commit: the cluster can only ever lack
         * what is here, never hold what is not. A synchronous share of a
         * non-persistent put holds its reply until it is published; a
         * persistent one waits for the disk and publishes asynchronously. */
        bool persistent = r->d->cfg.persist_all || (pq->has_persist && pq->persist);
        if (share_sync && !persistent) {
            kvr__reply_shared(r, &resp, pq->context_id);
            return;
        }
        e = (kvr_error){ 0 };
        if (kvr__remote_publish(r->d->remote, pq->context_id, NULL, NULL, &e) < 0)
            kvr_log(KVR_LOG_WARN, "'%s' stored locally, not shared: %s", pq->context_id, e.msg);
    }
    kvr__reply_ok(r, &resp);
}


/* ---- get and match ----------------------------------------------------------- */

static void send_get(kvr_request *r, bool stream);

/* Starts a get, or the get half of a match. A large one that needs work is
 * streamed (stream.c): its status is decided here, by begin, before any of
 * its payload exists. */
static void start_get(kvr_request *r, const kvr_get_params *gp0)
{
    kvr_get_params g = *gp0;
    const kvr_get_params *gp = &g;
    if (r->shm && !g.meta_only) {   /* produced straight into the region */
        g.dst = r->shm_p;
        g.dst_cap = r->shm_len;
    }
    kvr_error e = { 0 };
    int rc = kvr_store_get_begin(r->d->store, gp, &r->get, &e);
    if (rc < 0) {
        r->get = NULL;
        kvr__reply_err(r, rc, &e);
        return;
    }
    bool work = !gp->meta_only && kvr_get_needs_work(r->get);
    r->meta = gp->meta_only;
    if (r->shm) {
        size_t need = gp->meta_only ? 0 : kvr_get_payload_size(r->get);
        if (need > r->shm_len) {
            kvr__release_txn(r);
            kvr__reply_errf(r, KVR_ERANGE, "shm: the payload is %zu bytes, the region slice "
                       "holds %zu", need, r->shm_len);
            return;
        }
        /* A read the store placed in the region stages nothing (a no-op);
         * one it could not place is staged here, on the loop thread, for
         * shm_copy_out's copy. */
        if (work && (rc = kvr_get_stage(r->get, &e)) < 0) {
            kvr__release_txn(r);
            kvr__reply_err(r, rc, &e);
            return;
        }
        kvr__run(r, work);   /* no stream: the worker writes the region */
        return;
    }
    /* The staging, reserved only now that it is known how the payload goes
     * out: a ring of chunks for a stream, else the whole buffer
     * the iovecs point into; refused before anything is sent. */
    bool stream = work && kvr_get_payload_size(r->get) > KVR_STREAM_MIN_BYTES &&
                  kvr_get_get_info(r->get)->n_layers > 1;
    if (work && (rc = stream ? kvr__stream_stage(r->get, &e) : kvr_get_stage(r->get, &e)) < 0) {
        kvr__release_txn(r);
        kvr__reply_err(r, rc, &e);
        return;
    }
    if (stream) {
        r->work_rc = 0;
        send_get(r, true);
        return;
    }
    kvr__run(r, work);
}

void kvr__do_get(kvr_request *r)
{
    const Kvrope__Get *g = r->msg->get;
    kvr_error err = { 0 };
    kvr_get_params gp;
    int rc = kvr__get_params_from_pb(g, &gp, &err);
    if (rc < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    if (g->n_positions) {
        kvr_ctx_info ci;
        kvr_error e = { 0 };
        rc = kvr_store_stat(r->d->store, g->context_id, &ci, &e);
        if (rc < 0) {
            kvr__reply_err(r, rc, &e);
            return;
        }
        size_t real_end = gp.end == SIZE_MAX ? ci.n_tokens : gp.end;
        if (gp.start > real_end || real_end > ci.n_tokens) {
            kvr__reply_errf(r, KVR_ERANGE, "get: range [%zu, %zu) outside the context's %zu tokens",
                       gp.start, real_end, ci.n_tokens);
            return;
        }
        if (g->n_positions != real_end - gp.start) {
            kvr__reply_errf(r, KVR_EBADREQUEST, "get: %zu positions for a range of %zu tokens",
                       g->n_positions, real_end - gp.start);
            return;
        }
    }
    start_get(r, &gp);
}

void kvr__do_match(kvr_request *r)
{
    const Kvrope__Match *m = r->msg->match;
    if (!kvr__dtype_ok(m->dtype)) {
        kvr__reply_errf(r, KVR_EBADREQUEST, "match.dtype: unknown value %d", (int)m->dtype);
        return;
    }
    kvr_match_result mr;
    kvr_error e = { 0 };
    int rc = kvr_store_match(r->d->store, m->model, m->tokens, m->n_tokens,
                             m->has_include_approximate && m->include_approximate, &mr, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    r->match_len = mr.length;
    snprintf(r->match_ctx, sizeof r->match_ctx, "%s", mr.ctx_id);
    if (m->has_get && m->get && mr.length > 0) {
        kvr_get_params gp = {
            .ctx_id = r->match_ctx,
            .start = 0,
            .end = mr.length,
            .dtype = (kvr_dtype)m->dtype,
            .layers = m->n_layers ? m->layers : NULL,
            .n_layers_sel = m->n_layers,
        };
        start_get(r, &gp);
        return;
    }
    Kvrope__MatchResult res = KVROPE__MATCH_RESULT__INIT;
    res.length = mr.length;
    if (mr.length > 0)
        res.context_id = r->match_ctx;
    REPLY_BODY(r, MATCH, match, &res);
}

/* Sends the KV reply of a finished get / match+get; the payload is written
 * straight from the get's iovecs and the get ends in the write callback.
 * stream: the get's work has not been done; it is done chunk by chunk as
 * the payload is written (stream.c). */
static void send_get(kvr_request *r, bool stream)
{
    if (kvr__work_failed(r))
        return;
    kvr_get *t = r->get;
    r->get = NULL;
    bool is_get = r->verb->body == KVROPE__REQUEST__BODY_GET;
    const kvr_get_info *gi = kvr_get_get_info(t);
    bool meta_only = is_get && r->msg->get->has_meta_only && r->msg->get->meta_only;
    size_t payload = meta_only ? 0 : kvr_get_payload_size(t);
    Kvrope__KVResult kv;
    Kvrope__RawLayout rl;
    char rl_buf[3][64];
    kvr__pb_kv_of_get(gi, is_get ? r->msg->get->context_id : r->match_ctx, meta_only, &kv,
                      &rl, rl_buf);
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    Kvrope__MatchResult mr = KVROPE__MATCH_RESULT__INIT;
    if (is_get) {
        resp.body_case = KVROPE__RESPONSE__BODY_KV;
        resp.kv = &kv;
    } else {
        mr.length = r->match_len;
        mr.context_id = r->match_ctx;
        mr.kv = &kv;
        resp.body_case = KVROPE__RESPONSE__BODY_MATCH;
        resp.match = &mr;
    }
    if (r->shm) {   /* the payload is in the client's region already */
        kvr__send_shm_ok(r, &resp, payload);
        kvr_get_end(t);
        return;
    }
    if (!stream) {
        const struct iovec *iov = NULL;
        size_t niov = 0;
        if (payload > 0)
            kvr_get_payload_iov(t, &iov, &niov);
        kvr__send_ok(r, &resp, iov, niov, payload, end_get_cb, t);
        return;
    }
    resp.id = r->id;
    resp.status = KVROPE__STATUS__OK;
    size_t len;
    uint8_t *buf = kvr__pack_response(&resp, payload, &len);
    if (buf) {
        /* The message is packed: the request's fields are no longer needed. */
        kvr__msg_free(r);
        r->bytes_out += len + payload;
        r->phase = RQ_STREAM;
        if (kvr__stream_start(r, r->c, t, buf, len, payload) == 0)
            return;     /* stream.c ends r */
        r->phase = RQ_RUN;
        kvr_mem_free(buf);
    }
    kvr_get_end(t);
    kvr__reply_errf(r, KVR_ENOMEM, "out of memory starting a streamed reply");
}

void kvr__finish_get(kvr_request *r)
{
    send_get(r, false);
}


/* ---- position layouts: assemble (APE), groups (GPE), retention ---------- */

void kvr__do_assemble(kvr_request *r)
{
    kvr_error err = { 0 };
    kvr_assemble_params ap;
    int rc = kvr__assemble_params_from_pb(r->msg->assemble, &ap, &err);
    if (rc < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    kvr_error e = { 0 };
    if (r->shm && !ap.meta_only) {   /* produced straight into the region */
        ap.dst = r->shm_p;
        ap.dst_cap = r->shm_len;
    }
    rc = kvr_store_assemble_begin(r->d->store, &ap, &r->as, &e);
    if (rc < 0) {
        r->as = NULL;
        kvr__reply_err(r, rc, &e);
        return;
    }
    r->meta = ap.meta_only;
    kvr__assemble_run(r, "assembled");
}

void kvr__assemble_run(kvr_request *r, const char *what)
{
    size_t need = r->meta ? 0 : kvr_assemble_payload_size(r->as);
    if (r->shm && need > r->shm_len) {
        kvr__release_txn(r);
        kvr__reply_errf(r, KVR_ERANGE, "shm: the %s payload is %zu bytes, the region slice "
                        "holds %zu", what, need, r->shm_len);
        return;
    }
    bool work = !r->meta && kvr_assemble_needs_work(r->as);
    /* The staging the iovecs need, reserved now on the loop thread (an
     * assembly placed in a region needs none: a no-op then). */
    kvr_error e = { 0 };
    int rc;
    if (work && (rc = kvr_assemble_stage(r->as, &e)) < 0) {
        kvr__release_txn(r);
        kvr__reply_err(r, rc, &e);
        return;
    }
    kvr__run(r, work);
}

void kvr__finish_assemble(kvr_request *r)
{
    if (kvr__work_failed(r))
        return;
    kvr_assemble *t = r->as;
    r->as = NULL;
    const Kvrope__Assemble *q = r->msg->assemble;
    bool meta = q->has_meta_only && q->meta_only;
    size_t payload = meta ? 0 : kvr_assemble_payload_size(t);
    Kvrope__AssembleResult ar;
    Kvrope__KVResult kv;
    if (kvr__pb_assemble_result(kvr_assemble_get_info(t), q->prefix, &ar, &kv) < 0) {
        kvr_assemble_end(t);
        kvr__reply_errf(r, KVR_ENOMEM, "out of memory for the segment table");
        return;
    }
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_ASSEMBLE;
    resp.assemble = &ar;
    kvr__send_assembled(r, &resp, t, payload);
    kvr__pb_assemble_result_free(&ar);
}

void kvr__send_shm_ok(kvr_request *r, Kvrope__Response *resp, size_t payload)
{
    Kvrope__ShmSlice sl = KVROPE__SHM_SLICE__INIT;
    sl.region = r->shm->id;
    sl.offset = (uint64_t)(r->shm_p - r->shm->base);
    sl.length = payload;
    resp->shm = &sl;
    kvr__send_ok(r, resp, NULL, 0, 0, NULL, NULL);
    resp->shm = NULL;
}

void kvr__send_assembled(kvr_request *r, Kvrope__Response *resp, kvr_assemble *t,
                         size_t payload)
{
    if (r->shm && t) {
        kvr__send_shm_ok(r, resp, payload);
        kvr_assemble_end(t);
        return;
    }
    const struct iovec *iov = NULL;
    size_t niov = 0;
    if (payload > 0)
        kvr_assemble_payload_iov(t, &iov, &niov);
    kvr__send_ok(r, resp, iov, niov, payload, t ? kvr__end_assemble_cb : NULL, t);
}

