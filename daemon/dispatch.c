/*
 * dispatch.c — turns one decoded kvrope.Request into store calls and one
 * kvrope.Response: a request's life, from its frame to its end (the verbs
 * themselves are in t_*.c, grouped as dispatch.h lists). Runs on the loop thread; heavy parts (put conversion,
 * get rotation, assembly) go to the threadpool through run() and come back
 * in the verb's finish handler.
 *
 * Everything a verb is lives in one row of VERBS: its name (stats), its
 * body case, whether it takes a payload, returns one, may run before Auth,
 * which context it changes (persistence: the reply waits for that
 * context's record), and its handlers: start (loop thread), work (any
 * thread, optional) and finish (loop thread, after work).
 *
 * A request (kvr_request) is created here from a complete frame and is
 * dispatch's alone: conn.c moves its bytes and never looks inside it. Its
 * phases:
 *
 *   RUN --begin needs the payload--> PAYLOAD --payload in--> RUN
 *   RUN --run(needs work)--> WORK --threadpool done--> RUN (finish)
 *   RUN --reply to a change of a persistent context--> PERSIST --> RUN
 *   RUN --large get that needs work--> STREAM (stream.c)
 *   RUN --a miss the shared tier took--> WORK (fetch) --landed--> RUN (start again)
 *   RUN --a miss of what another request's fetch is landing--> WAIT
 *       --that fetch ended--> WORK (a no-op hop) --> RUN (start again)
 *
 * Invariants: every path ends in exactly one kvr__request_end (after the
 * reply was handed to conn.c, or when the connection closed under it);
 * when it ends the request holds no store transaction and no reply; at
 * most one of put / edit / get / as is open. Store errors map to Status
 * with kvr_error_status (kvr__status_of).
 */
#include "daemon/dispatch.h"
#include "proto/check.h"

#include <pthread.h>
#include <unistd.h>

/* protobuf-c's allocator for a request's message: bump allocation in
 * r->arena, kvr_mem_malloc past it; a free of arena memory is a no-op (the
 * whole arena goes with the request). */
static void *pb_arena_alloc(void *ud, size_t n)
{
    kvr_request *r = ud;
    size_t k = (n + 15) & ~(size_t)15;
    if (n > 0 && k <= sizeof r->arena - r->arena_used) {
        void *p = r->arena + r->arena_used;
        r->arena_used += k;
        return p;
    }
    r->arena_heap++;
    return kvr_mem_malloc(n ? n : 1);
}

static void pb_arena_free(void *ud, void *p)
{
    kvr_request *r = ud;
    if ((uint8_t *)p >= r->arena && (uint8_t *)p < r->arena + sizeof r->arena)
        return;
    kvr_mem_free(p);
}

/* Frees a request's unpacked message. When every allocation of it is in
 * the arena there is nothing to free: the walk over its descriptor that
 * free_unpacked does (~800 instructions for a put) is skipped. */
void kvr__msg_free(kvr_request *r)
{
    if (r->msg && r->arena_heap)
        kvrope__request__free_unpacked(r->msg, &r->pb);
    r->msg = NULL;
}

static const kvr_verb VERBS[KVR_N_VERBS];

static void fetch_end(kvr_request *r);

/* ---- ending a request ------------------------------------------------------ */

void kvr__release_txn(kvr_request *r)
{
    if (r->put)
        kvr_put_abort(r->put);
    if (r->edit)
        kvr_edit_abort(r->edit);
    fetch_end(r);   /* aborts the put a fetch may hold open */
    kvr_get_end(r->get);
    kvr_assemble_end(r->as);
    kvr__cover_free(r->cover);
    r->cover = NULL;
    r->put = NULL;
    r->edit = NULL;
    r->get = NULL;
    r->as = NULL;
}

bool kvr__work_failed(kvr_request *r)
{
    if (r->work_rc >= 0)
        return false;
    kvr__release_txn(r);
    kvr__reply_err(r, r->work_rc, &r->work_err);
    return true;
}

void kvr__request_end(kvr_request *r, int status)
{
    kvr_conn *c = r->c;
    assert(c->req == r);
    assert(r->phase == RQ_RUN || r->phase == RQ_STREAM);
    assert(!r->put && !r->edit && !r->get && !r->as && !r->cover && !r->held);
    fetch_end(r);   /* taken by a probe the verb went past */
    if (c->d->fetch_req == r)
        c->d->fetch_req = NULL;
    /* Every request passes here exactly once, whatever its path: this is
     * where per-request figures go. A metrics hook is one call here:
     * verb r->verb (NULL: none), status (KVR_E*, 0 OK; a request whose
     * connection closed under it ends with KVR_EIO), latency
     * uv_hrtime() - r->start_ns, bytes in KVR_FRAME_HEADER_SIZE +
     * r->msg_len + r->payload_len, bytes out r->bytes_out. */
    kvr__metrics_observe(c->d->metrics, r->verb ? (int)(r->verb - VERBS) : -1, kvr_error_status(status),
                        r->payload_len, r->bytes_out,
                        (double)(uv_hrtime() - r->start_ns) / 1e9);
    if (kvr_log_get_level() <= KVR_LOG_DEBUG)
        kvr_log(KVR_LOG_DEBUG, "request id %llu: %s -> %s in %.3f ms, %llu bytes out",
                (unsigned long long)r->id, r->verb ? r->verb->name : "(none)",
                status ? kvr_error_name(status) : "OK",
                (double)(uv_hrtime() - r->start_ns) / 1e6, (unsigned long long)r->bytes_out);
    kvr__msg_free(r);
    kvr__region_unref(r->shm);      /* work on it is over: unmapped if released */
    r->shm = NULL;
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
    c->req = NULL;
    /* Kept for the connection's next request (freed with the connection):
     * one allocation per connection, not one per request. */
    if (!c->req_spare)
        c->req_spare = r;
    else
        kvr_mem_free(r);
    kvr__conn_request_done(c);
}

/* ---- replies ------------------------------------------------------------------ */

static bool fetch_park(kvr_request *r);

void kvr__reply_error(kvr_request *r, int code, const char *msg)
{
    assert(r->phase == RQ_RUN && code < 0);
    if (code == KVR_EFETCH) {
        if (fetch_park(r))
            return;     /* the verb starts again once the fetch landed */
        code = KVR_ENOCTX;
    }
    kvr__conn_reply_error(r->c, r->id, code, msg);
    kvr__request_end(r, code);
}

void kvr__reply_err(kvr_request *r, int code, const kvr_error *e)
{
    kvr__reply_error(r, code, e && e->msg[0] ? e->msg : NULL);
}

void kvr__reply_errf(kvr_request *r, int code, const char *fmt, ...)
{
    char m[KVR_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    kvr__reply_error(r, code, m);
}

/* Sends resp (status OK) and then payload_len bytes from iov; done(arg)
 * releases the payload's source once written (at once if it cannot be).
 * Ends the request. */
void kvr__send_ok(kvr_request *r, Kvrope__Response *resp, const struct iovec *iov,
                    size_t niov, size_t payload_len, kvr_write_cb done, void *arg)
{
    assert(payload_len == 0 || (r->verb->flags & V_PAYLOAD_OUT));
    resp->id = r->id;
    resp->status = KVROPE__STATUS__OK;
    size_t len;
    /* The message may point into the payload source: pack before done. */
    uint8_t *buf = kvr__pack_response(resp, payload_len, &len);
    if (!buf) {
        if (done)
            done(arg, KVR_ENOMEM);
        kvr__reply_error(r, KVR_ENOMEM, "out of memory packing the response");
        return;
    }
    r->bytes_out += len + payload_len;
    /* Written in full at once (1): the source is released here. */
    int wr = kvr__conn_write_ex(r->c, buf, len, iov, niov, payload_len, done, arg, true);
    if (wr == 1)
        done(arg, 0);
    else if (wr != 0 && done)
        done(arg, KVR_EIO);
    kvr__request_end(r, 0);
}

/* An OK reply packed and held (phase PERSIST, a reference on the
 * connection) until a wait ends: true, or false after answering ENOMEM
 * with oom_msg. */
static bool reply_hold(kvr_request *r, Kvrope__Response *resp, const char *oom_msg)
{
    resp->id = r->id;
    resp->status = KVROPE__STATUS__OK;
    size_t len;
    uint8_t *buf = kvr__pack_response(resp, 0, &len);
    if (!buf) {
        kvr__reply_error(r, KVR_ENOMEM, oom_msg);
        return false;
    }
    r->held = buf;
    r->held_len = len;
    r->phase = RQ_PERSIST;
    kvr__conn_ref(r->c);
    return true;
}

/* The wait did not start after all: the held reply back (the caller's), the
 * phase RUN again, the connection's reference dropped (the handle's is still
 * there). */
static uint8_t *reply_unhold(kvr_request *r)
{
    uint8_t *buf = r->held;
    r->phase = RQ_RUN;
    r->held = NULL;
    kvr__conn_unref(r->c);
    return buf;
}

/* The reply to a change of a persistent context: held until its record is
 * on disk (kvr__request_persisted), or sent now if the context is not. */
static void reply_durable(kvr_request *r, Kvrope__Response *resp, const char *ctx_id)
{
    if (!reply_hold(r, resp, "out of memory holding a reply"))
        return;
    kvr_conn *c = r->c;
    size_t len = r->held_len;
    kvr_error e = { 0 };
    int rc = kvr__persist_defer(r->d, ctx_id, r, &e);
    if (rc > 0)
        return;     /* r may be gone already */
    uint8_t *buf = reply_unhold(r);
    if (rc == 0) {
        r->bytes_out += len;
        kvr__conn_write(c, buf, len, NULL, 0, 0, NULL, NULL);
        kvr__request_end(r, 0);
        return;
    }
    kvr_mem_free(buf);
    char m[400];
    snprintf(m, sizeof m, "not durable: %s (the change is in memory only)",
             e.msg[0] ? e.msg : kvr_strerror(rc));
    kvr__reply_error(r, rc == KVR_ENOMEM ? rc : KVR_EIO, m);
}

/* The end of a held reply's wait (phase PERSIST): the reply goes out when rc
 * is 0, and r ends quietly when its connection is closing; false: rc is a
 * failure on an open connection, the held reply is gone, and the caller
 * answers with the error. */
static bool held_reply_end(kvr_request *r, int rc)
{
    kvr_conn *c = r->c;
    assert(r->phase == RQ_PERSIST && r->held);
    r->phase = RQ_RUN;
    uint8_t *buf = r->held;
    r->held = NULL;
    if (c->closing) {
        kvr_mem_free(buf);
        kvr__request_end(r, rc ? rc : KVR_EIO);
        return true;
    }
    if (rc == 0) {
        r->bytes_out += r->held_len;
        kvr__conn_write(c, buf, r->held_len, NULL, 0, 0, NULL, NULL);
        kvr__request_end(r, 0);
        return true;
    }
    kvr_mem_free(buf);
    return false;
}

void kvr__request_persisted(void *arg, int rc, const kvr_error *e)
{
    kvr_request *r = arg;
    kvr_conn *c = r->c;   /* r may end here: the connection's reference goes after */
    if (!held_reply_end(r, rc)) {
        kvr_log(KVR_LOG_WARN, "persistence failed: %s", e && e->msg[0] ? e->msg : "");
        kvr__reply_err(r, rc, e);
    }
    kvr__conn_unref(c);
}

/* A reply with no payload: through persistence when the verb changes a
 * context and there is a disk tier. */
void kvr__reply_ok(kvr_request *r, Kvrope__Response *resp)
{
    if (r->verb->changes && kvr_store_tier_engine(r->d->store)) {
        reply_durable(r, resp, r->verb->changes(r->msg));
        return;
    }
    kvr__send_ok(r, resp, NULL, 0, 0, NULL, NULL);
}

/* ---- the shared tier (remote_pub.c) ----------------------------------------- */

/* A synchronous share: the reply waits (phase PERSIST, the held reply)
 * until the publication is done; then it is sent, or "stored locally, not
 * shared: ..." instead. */
static void shared_done(void *arg, int rc, const char *msg)
{
    kvr_request *r = arg;
    kvr_conn *c = r->c;
    if (!held_reply_end(r, rc)) {
        kvr__reply_errf(r, rc == KVR_ENOMEM ? rc : KVR_EIO, "stored locally, not shared: %s",
                   msg ? msg : kvr_strerror(rc));
    }
    kvr__conn_unref(c);
}

void kvr__reply_shared(kvr_request *r, Kvrope__Response *resp, const char *ctx_id)
{
    if (!reply_hold(r, resp, "stored locally, not shared: out of memory"))
        return;
    kvr_error e = { 0 };
    if (kvr__remote_publish(r->d->remote, ctx_id, shared_done, r, &e) == 0)
        return;     /* shared_done answers */
    kvr_mem_free(reply_unhold(r));
    kvr__reply_errf(r, e.code ? e.code : KVR_EIO, "stored locally, not shared: %s", e.msg);
}

/* ---- the shared tier under the store: fetches on a miss -------------------- */

/* The store asks the shared tier on a miss through its miss hooks
 * (kvr_store_miss_hooks, cache.h), as it asks the disk tier through its
 * tier hooks: every verb that names a context (kvr_store_ctx_live) or
 * matches a prefix sees published contexts the same way, with no code of
 * its own. A hook takes a miss only for the request whose verb is starting
 * (d->fetch_req, armed by start_verb) and that has not given up on the
 * tier: the request gets the fetch job, the store call fails with
 * KVR_EFETCH changing nothing, and reply_error parks the request instead
 * of answering (fetch_park): the job runs on the threadpool (slow network
 * I/O, never on the loop), lands on the loop as an ordinary put
 * (remote_fetch.c), and the verb starts again from the top. A verb that names
 * several missing contexts (an assembly) fetches them one round each, up
 * to FETCH_ROUNDS; a miss in the cluster or a prefix fetch ends the asking,
 * so the verb then answers from what is local. */
#define FETCH_ROUNDS 16

static void start_verb(kvr_request *r)
{
    kvr_daemon *d = r->d;
    kvr_request *prev = d->fetch_req;
    d->fetch_req = d->remote && !r->remote_tried ? r : NULL;
    r->verb->start(r);
    d->fetch_req = prev == r ? NULL : prev;
}

static bool take_fetch(kvr_daemon *d, kvr_rjob *j)
{
    if (!j)
        return false;
    kvr_request *r = d->fetch_req;
    fetch_end(r);
    r->rjob = j;
    return true;
}

static bool on_ctx_miss(void *arg, const char *id)
{
    kvr_daemon *d = arg;
    return d->fetch_req && take_fetch(d, kvr__remote_job_get(d->remote, id));
}

static bool on_prefix_miss(void *arg, const char *model, const uint32_t *tokens, size_t n,
                           size_t local)
{
    kvr_daemon *d = arg;
    return d->fetch_req &&
           take_fetch(d, kvr__remote_job_prefix(d->remote, model, tokens, n, local));
}

void kvr__dispatch_tier_install(kvr_daemon *d)
{
    if (d->remote)
        kvr_store_set_miss_hooks(d->store,
                                 &(kvr_store_miss_hooks){ on_ctx_miss, on_prefix_miss, d });
}

static void fetch_queue(kvr_request *r);

/* ---- two requests, one context: the second waits for the first's fetch -- */

/* A request that misses a context another request's fetch is landing (its
 * local put is open, so the store would answer "being written" to a second
 * put of it) parks on d->fetch_waiters (phase WAIT, a reference on its
 * connection) instead of fetching it again. When that fetch ends, landed
 * or not (fetch_end), each of its waiters starts its verb again from a
 * threadpool callback, on a stack of its own (fetch_end runs inside other
 * requests' handlers): it finds the context local, or misses and fetches
 * it itself. A fetch ends by its deadline, so a wait does too; a waiter
 * counts as a fetch round (FETCH_ROUNDS). */
static void wait_park(kvr_request *r)
{
    snprintf(r->wait_id, sizeof r->wait_id, "%s", kvr__remote_job_id(r->rjob));
    kvr__remote_job_free(r->rjob);
    r->rjob = NULL;
    if (++r->n_fetches >= FETCH_ROUNDS)
        r->remote_tried = true;
    kvr_log(KVR_LOG_DEBUG, "request id %llu: waits for another request's fetch of '%s'",
            (unsigned long long)r->id, r->wait_id);
    r->phase = RQ_WAIT;
    kvr__conn_ref(r->c);
    kvr_list_insert_tail(&r->d->fetch_waiters, &r->wait_link);
}

static void wait_work_cb(uv_work_t *w)
{
    (void)w;
}

/* Back on the loop after r's threadpool work: phase RUN; r's connection,
 * which the queued work still holds a reference on (the caller drops it
 * once r is handled). The wait and fetch works are never cancelled. */
static kvr_conn *work_back(uv_work_t *w, kvr_request **out)
{
    kvr_request *r = w->data;
    assert(r->phase == RQ_WORK);
    r->phase = RQ_RUN;
    *out = r;
    return r->c;
}

static void wait_after_cb(uv_work_t *w, int status)
{
    (void)status;
    kvr_request *r;
    kvr_conn *c = work_back(w, &r);
    if (c->closing)
        kvr__request_end(r, KVR_EIO);
    else
        start_verb(r);
    kvr__conn_unref(c);   /* wait_park's */
}

/* The fetch of ctx_id that held its put open ended: its waiters start
 * again. */
static void waiters_wake(kvr_daemon *d, const char *ctx_id)
{
    kvr_list *n = kvr_list_first(&d->fetch_waiters);
    while (n) {
        kvr_list *next = kvr_list_next(&d->fetch_waiters, n);
        kvr_request *w = kvr_list_entry(n, kvr_request, wait_link);
        if (strcmp(w->wait_id, ctx_id) == 0) {
            kvr_list_remove(n);
            w->phase = RQ_WORK;
            w->work.data = w;
            if (uv_queue_work(&d->loop, &w->work, wait_work_cb, wait_after_cb) < 0)
                wait_after_cb(&w->work, 0);     /* rather than leave it waiting */
        }
        n = next;
    }
}

/* Frees r's fetch job; was_open: it held its put open until now (it may
 * still: then freeing it aborts the put), so the requests waiting for that
 * context start again. */
static void fetch_free(kvr_request *r, bool was_open)
{
    kvr_rjob *j = r->rjob;
    r->rjob = NULL;
    if (!j)
        return;
    char id[KVR_ID_MAX + 1];
    was_open = was_open || kvr__remote_job_open(j);
    snprintf(id, sizeof id, "%s", kvr__remote_job_id(j));
    kvr__remote_job_free(j);
    if (was_open)
        waiters_wake(r->d, id);
}

static void fetch_end(kvr_request *r)
{
    fetch_free(r, false);
}

static void fetch_work_cb(uv_work_t *w)
{
    kvr_request *r = w->data;
    kvr__remote_job_work(r->rjob);
}

/* After a fetch: land it (a local put), maybe fetch again (a get by id:
 * the blocks, straight into the put opened for them), then start the verb
 * again, as if what landed had been local all along (or as the miss it
 * is). */
static void fetch_done(kvr_request *r)
{
    kvr_rjob *j = r->rjob;
    bool was_open = kvr__remote_job_open(j);
    int rc = kvr__remote_job_land(j);
    if (rc == 1) {
        fetch_queue(r);
        return;
    }
    if (rc == KVR_RT_WAIT) {
        wait_park(r);
        return;
    }
    bool prefix = !kvr__remote_job_by_id(j);
    fetch_free(r, was_open);   /* landed or not: its waiters start again */
    if (rc < 0 || prefix || ++r->n_fetches >= FETCH_ROUNDS)
        r->remote_tried = true;
    start_verb(r);
}

static void fetch_after_cb(uv_work_t *w, int status)
{
    (void)status;
    kvr_request *r;
    kvr_conn *c = work_back(w, &r);
    if (c->closing) {
        kvr__release_txn(r);
        kvr__request_end(r, KVR_EIO);
    } else {
        fetch_done(r);
    }
    kvr__conn_unref(c);
}

static void fetch_queue(kvr_request *r)
{
    r->phase = RQ_WORK;
    r->work.data = r;
    kvr__conn_ref(r->c);
    if (uv_queue_work(&r->d->loop, &r->work, fetch_work_cb, fetch_after_cb) < 0) {
        fetch_work_cb(&r->work);          /* rather than fail the request */
        fetch_after_cb(&r->work, 0);
    }
}

/* A verb failed with KVR_EFETCH: park the request on its fetch (true), or
 * false when there is none to park on (the verb had a transaction open: it
 * cannot start again; the miss is answered as one). */
static bool fetch_park(kvr_request *r)
{
    if (!r->rjob || r->put || r->edit || r->get || r->as) {
        kvr_log(KVR_LOG_WARN, "request id %llu: a %s missed in the store with no fetch to "
                "wait for: answered as a miss", (unsigned long long)r->id,
                r->verb ? r->verb->name : "(none)");
        return false;
    }
    if (r->d->fetch_req == r)
        r->d->fetch_req = NULL;
    if (kvr__remote_job_by_id(r->rjob) &&
        kvr__remote_landing(r->d->remote, kvr__remote_job_id(r->rjob))) {
        wait_park(r);     /* another request's fetch of it is landing */
        return true;
    }
    fetch_queue(r);
    return true;
}

/* ---- shared memory: payloads in the client's region ------------------------ */

/* Copies iov to dst, skipping what the store already produced in place
 * (kvr_get_params.dst: the iovecs then point into the region itself). */
static uint8_t *copy_iov_to(uint8_t *dst, const struct iovec *iov, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (iov[i].iov_base != dst)
            memcpy(dst, iov[i].iov_base, iov[i].iov_len);
        dst += iov[i].iov_len;
    }
    return dst;
}

/* Put / edit: copy the region's bytes into the transaction's iovecs first;
 * every check (nan/inf, conversion) then runs on the daemon's copy, so a
 * client changing its bytes meanwhile can only change what it stores.
 * (Never kvr_put_work_from on the region: it reads values more than once,
 * a check and then a use: cache.h.) */
typedef struct copy_in {
    const struct iovec *iov;
    size_t              n;
    const uint8_t      *src;
    size_t              total, chunk;
    bool                stream;   /* past the cache: streaming stores */
} copy_in;

/* Bytes [i * chunk, (i + 1) * chunk) of the payload, from the region into
 * the iovecs that cover them. */
static int copy_in_chunk(void *ud, size_t i)
{
    const copy_in *ci = ud;
    size_t lo = i * ci->chunk, hi = lo + ci->chunk < ci->total ? lo + ci->chunk : ci->total;
    size_t at = 0;
    for (size_t k = 0; k < ci->n && at < hi; k++) {
        size_t len = ci->iov[k].iov_len, a = at > lo ? at : lo, z = at + len < hi ? at + len : hi;
        if (a < z && ci->stream)
            kvr_mem_copy_stream((uint8_t *)ci->iov[k].iov_base + (a - at), ci->src + a, z - a);
        else if (a < z)
            memcpy((uint8_t *)ci->iov[k].iov_base + (a - at), ci->src + a, z - a);
        at += len;
    }
    return 0;
}

#define SHM_COPY_CHUNK ((size_t)4 << 20)
#define SHM_STREAM_MIN ((size_t)16 << 20)

static void shm_copy_in(kvr_request *r)
{
    copy_in ci = { .src = r->shm_p, .chunk = SHM_COPY_CHUNK };
    if (r->edit)
        kvr_edit_payload_iov(r->edit, &ci.iov, &ci.n);
    else
        kvr_put_payload_iov(r->put, &ci.iov, &ci.n);
    for (size_t i = 0; i < ci.n; i++)
        ci.total += ci.iov[i].iov_len;
    size_t chunks = (ci.total + ci.chunk - 1) / ci.chunk;
    /* Past the last-level cache, the destination's lines would be read in
     * only to be overwritten (kvr_mem_copy_stream): block memory is not
     * read again soon; a converted put's staging is, but by then a copy
     * that large is out of the cache either way. */
    ci.stream = ci.total >= SHM_STREAM_MIN;
    /* Large payloads: the copy is split over the worker pool's threads
     * (one core's memcpy does not saturate memory bandwidth). */
    if (chunks > 1)
        (void)kvr_pool_for(NULL, chunks, 8, copy_in_chunk, &ci);
    else if (chunks)
        copy_in_chunk(&ci, 0);
}

/* Get / match+get / assemble: the work (rotation, conversion,
 * dequantization) and the copy into the region, on this worker thread.
 * Normally the store produces straight into the region (start_get gives it
 * as kvr_get_params.dst: no staging, work split over the pool's threads)
 * and there is nothing left to copy. Raw gets, and any read the store did
 * not place, are copied here: a get that needs work layer by layer, so
 * each layer is copied while it is still in cache. */
static int shm_copy_out(kvr_request *r, kvr_error *e)
{
    const struct iovec *iov;
    size_t n;
    int rc;
    if (r->meta)
        return 0;
    if (r->get) {
        size_t nl = kvr_get_get_info(r->get)->n_layers;
        kvr_get_payload_iov(r->get, &iov, &n);
        bool placed = n > 0 && iov[0].iov_base == (void *)r->shm_p;
        if (r->needs_work && nl > 1 && !placed) {
            uint8_t *d = r->shm_p;
            for (size_t l = 0; l < nl; l++) {
                if ((rc = kvr_get_work_layers(r->get, l, l + 1, e)) < 0)
                    return rc;
                kvr_get_payload_iov_layers(r->get, l, l + 1, &iov, &n);
                d = copy_iov_to(d, iov, n);
            }
            return 0;
        }
        if (r->needs_work && (rc = kvr_get_work(r->get, e)) < 0)
            return rc;
        kvr_get_payload_iov(r->get, &iov, &n);
    } else {
        if (r->needs_work && (rc = kvr_assemble_work(r->as, e)) < 0)
            return rc;
        kvr_assemble_payload_iov(r->as, &iov, &n);
    }
    copy_iov_to(r->shm_p, iov, n);
    return 0;
}

/* ---- the threadpool: one way to run a transaction's work ----------------- */

static void work_cb(uv_work_t *w)
{
    kvr_request *r = w->data;
    memset(&r->work_err, 0, sizeof r->work_err);
    int rc = 0;
    if (r->shm && (r->verb->flags & V_PAYLOAD_OUT)) {
        rc = shm_copy_out(r, &r->work_err);
    } else {
        if (r->shm)
            shm_copy_in(r);
        if (r->needs_work)
            rc = r->verb->work(r, &r->work_err);
    }
    r->work_rc = rc;
}

static void after_work_cb(uv_work_t *w, int status)
{
    kvr_request *r;
    kvr_conn *c = work_back(w, &r);
    if (status < 0 && r->work_rc == 0) {
        r->work_rc = KVR_EINTERNAL;
        kvr_error_set(&r->work_err, KVR_EINTERNAL, "work cancelled");
    }
    if (c->closing) {
        /* Nobody to answer: nothing acknowledged, so nothing kept. */
        kvr__release_txn(r);
        kvr__request_end(r, KVR_EIO);
    } else {
        r->verb->finish(r);
    }
    kvr__conn_unref(c);
}

/* A region copy with nothing else to do (a plain shm get or put) of up to
 * this many bytes runs on the loop thread: the hop to the threadpool and
 * back (two thread switches and a wake-up of the loop: tens of
 * microseconds on a loaded machine) costs more than the copy, and the loop
 * is held no longer than about that. Rotation, conversion and codec work
 * always go to the threadpool. */
#define KVR_INLINE_COPY_MAX ((size_t)1 << 20)

static size_t work_bytes(const kvr_request *r)
{
    if (r->put || r->edit)
        return (size_t)r->payload_len;
    if (r->get)
        return r->meta ? 0 : kvr_get_payload_size(r->get);
    if (r->as)
        return r->meta ? 0 : kvr_assemble_payload_size(r->as);
    return SIZE_MAX;
}

/* The one "queue the work or finish inline" path: the verb's work on the
 * threadpool when the transaction needs it (here, if the pool refuses, or
 * for a small region copy: KVR_INLINE_COPY_MAX), then its finish on the
 * loop thread;
 * finish at once when it needs none. */
void kvr__run(kvr_request *r, bool needs_work)
{
    assert(r->phase == RQ_RUN && r->verb->finish);
    /* Past its lookups: what it calls now does not ask the shared tier. */
    if (r->d->fetch_req == r)
        r->d->fetch_req = NULL;
    fetch_end(r);
    r->work_rc = 0;
    r->needs_work = needs_work;
    if (!needs_work && !r->shm) {
        r->verb->finish(r);
        return;
    }
    assert(r->verb->work);
    r->phase = RQ_WORK;
    r->work.data = r;
    kvr__conn_ref(r->c);
    bool small = !needs_work && work_bytes(r) <= KVR_INLINE_COPY_MAX;
    if (small || uv_queue_work(&r->d->loop, &r->work, work_cb, after_work_cb) < 0) {
        work_cb(&r->work);          /* rather than fail the request */
        after_work_cb(&r->work, 0);
    }
}



/* ---- payloads ------------------------------------------------------------------- */

/* The open put's (or edit's) payload is read into its iovecs; then
 * kvr__dispatch_payload_done. */
void kvr__read_payload(kvr_request *r)
{
    if (r->c->closing) {
        kvr__release_txn(r);
        kvr__request_end(r, KVR_EIO);
        return;
    }
    if (r->shm) {   /* copied from the region by the worker (shm_copy_in) */
        kvr__run(r, r->edit ? kvr_edit_needs_work(r->edit) : kvr_put_needs_work(r->put));
        return;
    }
    const struct iovec *iov;
    size_t n;
    if (r->edit)
        kvr_edit_payload_iov(r->edit, &iov, &n);
    else
        kvr_put_payload_iov(r->put, &iov, &n);
    r->phase = RQ_PAYLOAD;
    kvr__conn_read_payload(r->c, iov, n);
}

void kvr__dispatch_payload_done(kvr_conn *c)
{
    kvr_request *r = c->req;
    assert(r && r->phase == RQ_PAYLOAD && (r->put || r->edit));
    r->phase = RQ_RUN;
    kvr__run(r, r->edit ? kvr_edit_needs_work(r->edit) : kvr_put_needs_work(r->put));
}

void kvr__dispatch_conn_closing(kvr_conn *c)
{
    kvr_request *r = c->req;
    if (!r || r->phase != RQ_PAYLOAD)
        return;     /* RUN: its handler is on the stack; the others come back */
    kvr_log(KVR_LOG_INFO, "client closed during %s payload: %s aborted",
            r->put ? "a put" : "an edit", r->put ? "put" : "edit");
    kvr__release_txn(r);
    r->phase = RQ_RUN;
    kvr__request_end(r, KVR_EIO);
}


/* ---- the verb table ------------------------------------------------------------ */

/* Which context a change request changes (persistence). */
#define CHANGES(verb, expr) \
    static const char *changes_##verb(const Kvrope__Request *q) { return (expr); }
CHANGES(put, q->put->context_id)
CHANGES(group_append, q->group_append->put->context_id)
CHANGES(edit, q->edit->context_id)
CHANGES(refresh, q->refresh->context_id)
CHANGES(delete, q->delete_->context_id)
CHANGES(pin, q->pin->context_id)
CHANGES(fork, q->fork->dst)
CHANGES(shift, q->shift->context_id)
CHANGES(keep, q->keep->context_id)
CHANGES(set_group_offset, q->set_group_offset->context_id)
CHANGES(set_retention, q->set_retention->context_id)
#undef CHANGES

/* name, BODY case, flags, changes, work, finish; start is do_<name>. The
 * one list of verbs: the order of the requests_<verb> figures in stats and
 * the verb="<name>" series of /metrics (metrics.c takes its names from
 * kvr__verb_name and its index from here). */
#define VERB(n, B, fl, ch, wk, fin) \
    { #n, KVROPE__REQUEST__BODY_##B, (fl), kvr__do_##n, (ch), (wk), (fin) }
static const kvr_verb VERBS[KVR_N_VERBS] = {
    VERB(auth,             AUTH,             V_OPEN,        NULL, NULL, NULL),
    VERB(ping,             PING,             0,             NULL, NULL, NULL),
    VERB(register_model,   REGISTER_MODEL,   0,             NULL, NULL, NULL),
    VERB(list_models,      LIST_MODELS,      0,             NULL, NULL, NULL),
    VERB(put,              PUT,              V_PAYLOAD_IN,  changes_put, kvr__work_put, kvr__finish_put),
    VERB(get,              GET,              V_PAYLOAD_OUT, NULL, kvr__work_get, kvr__finish_get),
    VERB(match,            MATCH,            V_PAYLOAD_OUT, NULL, kvr__work_get, kvr__finish_get),
    VERB(delete,           DELETE,           0,             changes_delete, NULL, NULL),
    VERB(list,             LIST,             0,             NULL, NULL, NULL),
    VERB(stat,             STAT,             0,             NULL, NULL, NULL),
    VERB(pin,              PIN,              0,             changes_pin, NULL, NULL),
    VERB(fork,             FORK,             0,             changes_fork, NULL, NULL),
    VERB(shift,            SHIFT,            0,             changes_shift, NULL, NULL),
    VERB(keep,             KEEP,             0,             changes_keep, NULL, NULL),
    VERB(stats,            STATS,            0,             NULL, NULL, NULL),
    VERB(edit,             EDIT,             V_PAYLOAD_IN,  changes_edit, kvr__work_edit, kvr__finish_edit),
    VERB(refresh,          REFRESH,          V_PAYLOAD_IN,  changes_refresh, kvr__work_edit,
         kvr__finish_edit),
    VERB(edit_plan,        EDIT_PLAN,        0,             NULL, NULL, NULL),
    VERB(assemble,         ASSEMBLE,         V_PAYLOAD_OUT, NULL, kvr__work_assemble,
         kvr__finish_assemble),
    VERB(group_append,     GROUP_APPEND,     V_PAYLOAD_IN,  changes_group_append, kvr__work_put,
         kvr__finish_put),
    VERB(set_group_offset, SET_GROUP_OFFSET, 0,             changes_set_group_offset, NULL,
         NULL),
    VERB(set_retention,    SET_RETENTION,    0,             changes_set_retention, NULL, NULL),
    VERB(layout_stat,      LAYOUT_STAT,      0,             NULL, NULL, NULL),
    VERB(register_region,  REGISTER_REGION,  0,             NULL, NULL, NULL),
    VERB(release_region,   RELEASE_REGION,   0,             NULL, NULL, NULL),
    VERB(remove_model,     REMOVE_MODEL,     0,             NULL, NULL, NULL),
    VERB(cover,            COVER,            V_PAYLOAD_OUT, NULL, kvr__work_assemble,
         kvr__finish_cover),
};
#undef VERB

const char *kvr__verb_name(size_t i)
{
    return i < KVR_N_VERBS ? VERBS[i].name : NULL;
}

/* Body case -> 1 + index in VERBS (0: none), built once from the table. */
#define MAX_BODY_CASE 72
static uint8_t verb_of_body[MAX_BODY_CASE];
static pthread_once_t verb_index_once = PTHREAD_ONCE_INIT;

static void build_verb_index(void)
{
    for (size_t i = 0; i < KVR_N_VERBS; i++) {
        assert(VERBS[i].body > 0 && VERBS[i].body < MAX_BODY_CASE);
        verb_of_body[VERBS[i].body] = (uint8_t)(i + 1);
    }
}

static const kvr_verb *find_verb(Kvrope__Request__BodyCase body)
{
    pthread_once(&verb_index_once, build_verb_index);
    unsigned b = (unsigned)body;
    return b < MAX_BODY_CASE && verb_of_body[b] ? &VERBS[verb_of_body[b] - 1] : NULL;
}

/* ---- a frame comes in -------------------------------------------------------- */

void kvr__dispatch_frame(kvr_conn *c, const kvr_frame_header *fh, const uint8_t *msg)
{
    assert(c->req == NULL && c->st == KVR_CONN_BUSY);
    kvr_daemon *d = c->d;
    kvr_request *r = c->req_spare;
    c->req_spare = NULL;
    if (r)
        memset(r, 0, offsetof(kvr_request, work));   /* the rest is set before use */
    else
        r = kvr_mem_calloc(1, sizeof *r);
    if (!r) {
        kvr__conn_fail(c, 0, KVR_ENOMEM, "out of memory for the request");
        return;
    }
    r->pb = (ProtobufCAllocator){ pb_arena_alloc, pb_arena_free, r };
    r->arena_used = 0;
    r->arena_heap = 0;
    Kvrope__Request *q = kvrope__request__unpack(&r->pb, fh->msg_len, msg);
    if (!q) {
        c->req_spare = r;
        kvr__conn_fail(c, 0, KVR_EBADFRAME, "message does not decode as a kvrope.Request");
        return;
    }
    r->c = c;
    r->d = d;
    r->msg = q;
    r->id = q->id;
    r->msg_len = fh->msg_len;
    r->payload_len = fh->payload_len;
    r->start_ns = uv_hrtime();
    r->verb = find_verb(q->body_case);
    /* fds never pile up on the handle: a RegisterRegion takes those that
     * came with it; another frame takes them when no later frame was read
     * with it (else they could be a later RegisterRegion's, read with it:
     * kvr__conn_frames_ahead), and refuses them (conn.c). */
    bool region = r->verb && r->verb->body == KVROPE__REQUEST__BODY_REGISTER_REGION;
    r->fd = region || !kvr__conn_frames_ahead(c) ? kvr__conn_take_fd(c) : -1;
    c->req = r;
    if (r->fd >= 0 && !region) {
        close(r->fd);
        r->fd = -1;
        char m[200];
        snprintf(m, sizeof m, "a file descriptor came with this %s frame: only a "
                 "register_region frame carries one (SCM_RIGHTS on its bytes)",
                 r->verb ? r->verb->name : "unknown");
        kvr__conn_fail(c, q->id, KVR_EBADREQUEST, m);
        kvr__request_end(r, KVR_EBADREQUEST);
        return;
    }
    const kvr_verb *v = r->verb;
    if (v)
        d->per_verb[v - VERBS]++;
    kvr_log(KVR_LOG_DEBUG, "request id %llu: %s, msg %u bytes, payload %llu bytes",
            (unsigned long long)q->id, v ? v->name : "(none)", fh->msg_len,
            (unsigned long long)fh->payload_len);

    if (!c->authed) {
        if (v && (v->flags & V_OPEN) && r->payload_len == 0) {
            start_verb(r);
            return;
        }
        kvr__conn_fail(c, q->id, KVR_EUNAUTH,
                      "authentication required: send Auth with the token first");
        kvr__request_end(r, KVR_EUNAUTH);
        return;
    }
    /* Ids are byte strings: one with a NUL would reach C cut short. */
    const char *nul = kvr_proto_find_nul_string(&kvrope__request__descriptor, msg, fh->msg_len);
    if (nul) {
        kvr__reply_errf(r, KVR_EBADREQUEST, "field '%s' holds a NUL byte: ids, names and other "
                   "strings may not contain NUL", nul);
        return;
    }
    if (r->payload_len && !(v && (v->flags & V_PAYLOAD_IN))) {
        kvr__reply_errf(r, KVR_EBADREQUEST, "this request takes no payload (payload_len %llu)",
                   (unsigned long long)r->payload_len);
        return;
    }
    if (!v) {
        kvr__reply_errf(r, KVR_EBADREQUEST, "request %llu has no body (or an unknown verb)",
                   (unsigned long long)q->id);
        return;
    }
    if (q->shm) {
        if (!(v->flags & (V_PAYLOAD_IN | V_PAYLOAD_OUT))) {
            kvr__reply_errf(r, KVR_EBADREQUEST, "shm: a %s request has no payload to place",
                       v->name);
            return;
        }
        if (r->payload_len) {
            kvr__reply_errf(r, KVR_EBADREQUEST, "shm: the payload is in the region; the frame "
                       "may not carry one too (payload_len %llu)",
                       (unsigned long long)r->payload_len);
            return;
        }
        kvr_error e = { 0 };
        int rc = kvr__shm_slice(c, q->shm->region, q->shm->offset, q->shm->length, &r->shm,
                                &r->shm_p, &e);
        if (rc < 0) {
            kvr__reply_err(r, rc, &e);
            return;
        }
        if (q->shm->length > SIZE_MAX) {
            kvr__reply_errf(r, KVR_ERANGE, "shm: length out of range");
            return;
        }
        r->shm_len = (size_t)q->shm->length;
        if (v->flags & V_PAYLOAD_IN)
            r->payload_len = q->shm->length;   /* what the put/edit declares */
    }
    start_verb(r);
}

