/*
 * dispatch.c — turns one decoded kvrope.Request into store calls and one
 * kvrope.Response. Runs on the loop thread; heavy parts (put conversion,
 * get rotation, assembly) go to the threadpool through run() and come back
 * in the verb's finish handler.
 *
 * Everything a verb is lives in one row of VERBS: its name (stats), its
 * body case, whether it takes a payload, returns one, may run before Auth,
 * which context it changes (persistence: the reply waits for that
 * context's record), and its handlers: start (loop thread), work (any
 * thread, optional) and finish (loop thread, after work).
 *
 * A request (kvrd_request) is created here from a complete frame and is
 * dispatch's alone: conn.c moves its bytes and never looks inside it. Its
 * phases:
 *
 *   RUN --begin needs the payload--> PAYLOAD --payload in--> RUN
 *   RUN --run(needs work)--> WORK --threadpool done--> RUN (finish)
 *   RUN --reply to a change of a persistent context--> PERSIST --> RUN
 *   RUN --large get that needs work--> STREAM (stream.c)
 *
 * Invariants: every path ends in exactly one kvrd_request_end (after the
 * reply was handed to conn.c, or when the connection closed under it);
 * when it ends the request holds no store transaction and no reply; at
 * most one of put / edit / get / as is open. Store errors map to Status
 * with kvr_error_status (kvr_status_of).
 */
#include "daemon/daemon_internal.h"
#include "daemon/remote.h"
#include "proto/check.h"

#include <assert.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* The generated structs take non-const pointers; the data is only read. */
#define UNCONST(T, p) ((T)(uintptr_t)(p))

/* Bytes of a request's inline arena for its unpacked message: a put's
 * Request, Put, ids and a few hundred tokens fit. */
#define KVRD_PB_ARENA 2048

typedef enum rq_phase {
    RQ_RUN = 0,     /* in a handler on the loop thread */
    RQ_PAYLOAD,     /* conn.c reads the payload into the transaction */
    RQ_WORK,        /* the threadpool works on the transaction */
    RQ_PERSIST,     /* the reply is held until the record is on disk */
    RQ_STREAM,      /* stream.c owns the get and ends the request */
} rq_phase;

enum {
    V_PAYLOAD_IN  = 1u << 0,   /* takes a payload (else one is E_BAD_REQUEST) */
    V_PAYLOAD_OUT = 1u << 1,   /* may answer with a payload */
    V_OPEN        = 1u << 2,   /* allowed before Auth */
};

typedef struct kvrd_verb {
    const char *name;                    /* "put"; stats: requests_<name> */
    Kvrope__Request__BodyCase body;
    unsigned    flags;                   /* V_* */
    void      (*start)(kvrd_request *r);
    /* The context a successful request changes (its reply then waits for
     * the record when the context is persistent); NULL: changes none. */
    const char *(*changes)(const Kvrope__Request *q);
    /* Threadpool part (any thread; NULL: none) and the loop-thread part
     * after it (or instead of it when the transaction needs no work). */
    int       (*work)(kvrd_request *r, kvr_error *e);
    void      (*finish)(kvrd_request *r);
} kvrd_verb;

struct kvrd_request {
    kvr_conn        *c;
    kvr_daemon      *d;
    const kvrd_verb *verb;          /* NULL: no body, or a verb we do not know */
    Kvrope__Request *msg;           /* freed early by a stream (packed by then) */
    uint64_t         id;
    uint64_t         msg_len, payload_len;   /* of its frame */
    uint64_t         start_ns;      /* uv_hrtime() when the message arrived */
    uint64_t         bytes_out;     /* reply bytes handed to conn.c */
    rq_phase         phase;
    /* the store transaction (at most one) */
    kvr_put         *put;
    kvr_edit        *edit;
    kvr_get         *get;
    kvr_assemble    *as;
    kvrd_cover      *cover;         /* cover: its runs (t_cover.c); as: its get */
    /* PERSIST: the packed reply */
    uint8_t         *held;
    size_t           held_len;
    /* Request.shm (shm.c): the payload's place instead of the socket; the
     * region is referenced until the request ends. */
    kvrd_region     *shm;
    uint8_t         *shm_p;
    size_t           shm_len;
    bool             meta;          /* get/assemble: meta_only (no payload) */
    bool             needs_work;    /* run(): the verb's work is to be done */
    int              fd;            /* came with the frame (-1 none); closed at the end */
    /* shared tier (remote.c): this get/match's fetch job, and whether the
     * request already asked the cluster (then it answers from what landed) */
    struct kvr_rjob *rjob;
    bool             remote_tried;
    /* From here on each field is set before it is read, so a reused
     * request is cleared only up to `work`. */
    /* threadpool job */
    uv_work_t        work;
    int              work_rc;
    kvr_error        work_err;
    /* match: what matched (the get half reads it) */
    uint64_t         match_len;
    char             match_ctx[KVR_ID_MAX + 1];
    /* The unpacked message's first bytes (pb_arena_*): a request's message
     * is a few small allocations (the Request, its body, ids, tokens), made
     * here instead of one malloc + free each; what does not fit is
     * allocated. Reset for each request (with the struct: see req_spare). */
    ProtobufCAllocator pb;
    size_t           arena_used;
    size_t           arena_heap;   /* allocations that did not fit (kvr_mem_malloc) */
    _Alignas(16) uint8_t arena[KVRD_PB_ARENA];
};

/* protobuf-c's allocator for a request's message: bump allocation in
 * r->arena, kvr_mem_malloc past it; a free of arena memory is a no-op (the
 * whole arena goes with the request). */
static void *pb_arena_alloc(void *ud, size_t n)
{
    kvrd_request *r = ud;
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
    kvrd_request *r = ud;
    if ((uint8_t *)p >= r->arena && (uint8_t *)p < r->arena + sizeof r->arena)
        return;
    kvr_mem_free(p);
}

/* Frees a request's unpacked message. When every allocation of it is in
 * the arena there is nothing to free: the walk over its descriptor that
 * free_unpacked does (~800 instructions for a put) is skipped. */
static void msg_free(kvrd_request *r)
{
    if (r->msg && r->arena_heap)
        kvrope__request__free_unpacked(r->msg, &r->pb);
    r->msg = NULL;
}

static const kvrd_verb VERBS[KVR_N_VERBS];

/* ---- ending a request ------------------------------------------------------ */

static void release_txn(kvrd_request *r)
{
    if (r->put)
        kvr_put_abort(r->put);
    if (r->edit)
        kvr_edit_abort(r->edit);
    kvr_remote_job_free(r->rjob);   /* aborts the put a fetch may hold open */
    r->rjob = NULL;
    kvr_get_end(r->get);
    kvr_assemble_end(r->as);
    kvrd_cover_free(r->cover);
    r->cover = NULL;
    r->put = NULL;
    r->edit = NULL;
    r->get = NULL;
    r->as = NULL;
}

void kvrd_request_end(kvrd_request *r, int status)
{
    kvr_conn *c = r->c;
    assert(c->req == r);
    assert(r->phase == RQ_RUN || r->phase == RQ_STREAM);
    assert(!r->put && !r->edit && !r->get && !r->as && !r->cover && !r->held);
    /* Every request passes here exactly once, whatever its path: this is
     * where per-request figures go. A metrics hook is one call here:
     * verb r->verb (NULL: none), status (KVR_E*, 0 OK; a request whose
     * connection closed under it ends with KVR_EIO), latency
     * uv_hrtime() - r->start_ns, bytes in KVR_FRAME_HEADER_SIZE +
     * r->msg_len + r->payload_len, bytes out r->bytes_out. */
    kvr_metrics_observe(c->d->metrics, r->verb ? (int)(r->verb - VERBS) : -1, kvr_error_status(status),
                        r->payload_len, r->bytes_out,
                        (double)(uv_hrtime() - r->start_ns) / 1e9);
    if (kvr_log_get_level() <= KVR_LOG_DEBUG)
        kvr_log(KVR_LOG_DEBUG, "request id %llu: %s -> %s in %.3f ms, %llu bytes out",
                (unsigned long long)r->id, r->verb ? r->verb->name : "(none)",
                status ? kvr_error_name(status) : "OK",
                (double)(uv_hrtime() - r->start_ns) / 1e6, (unsigned long long)r->bytes_out);
    msg_free(r);
    kvrd_region_unref(r->shm);      /* work on it is over: unmapped if released */
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
    kvrd_conn_request_done(c);
}

/* ---- replies ------------------------------------------------------------------ */

static void reply_error(kvrd_request *r, int code, const char *msg)
{
    assert(r->phase == RQ_RUN && code < 0);
    kvrd_conn_reply_error(r->c, r->id, code, msg);
    kvrd_request_end(r, code);
}

static void reply_err(kvrd_request *r, int code, const kvr_error *e)
{
    reply_error(r, code, e && e->msg[0] ? e->msg : NULL);
}

static void reply_errf(kvrd_request *r, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void reply_errf(kvrd_request *r, int code, const char *fmt, ...)
{
    char m[KVRD_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    reply_error(r, code, m);
}

/* Sends resp (status OK) and then payload_len bytes from iov; done(arg)
 * releases the payload's source once written (at once if it cannot be).
 * Ends the request. */
static void send_ok(kvrd_request *r, Kvrope__Response *resp, const struct iovec *iov,
                    size_t niov, size_t payload_len, kvrd_write_cb done, void *arg)
{
    assert(payload_len == 0 || (r->verb->flags & V_PAYLOAD_OUT));
    resp->id = r->id;
    resp->status = KVROPE__STATUS__OK;
    size_t len;
    /* The message may point into the payload source: pack before done. */
    uint8_t *buf = kvrd_pack_response(resp, payload_len, &len);
    if (!buf) {
        if (done)
            done(arg, KVR_ENOMEM);
        reply_error(r, KVR_ENOMEM, "out of memory packing the response");
        return;
    }
    r->bytes_out += len + payload_len;
    /* Written in full at once (1): the source is released here. */
    int wr = kvrd_conn_write_ex(r->c, buf, len, iov, niov, payload_len, done, arg, true);
    if (wr == 1)
        done(arg, 0);
    else if (wr != 0 && done)
        done(arg, KVR_EIO);
    kvrd_request_end(r, 0);
}

/* The reply to a change of a persistent context: held until its record is
 * on disk (kvrd_request_persisted), or sent now if the context is not. */
static void reply_durable(kvrd_request *r, Kvrope__Response *resp, const char *ctx_id)
{
    resp->id = r->id;
    resp->status = KVROPE__STATUS__OK;
    size_t len;
    uint8_t *buf = kvrd_pack_response(resp, 0, &len);
    if (!buf) {
        reply_error(r, KVR_ENOMEM, "out of memory holding a reply");
        return;
    }
    kvr_conn *c = r->c;
    r->held = buf;
    r->held_len = len;
    r->phase = RQ_PERSIST;
    kvr_conn_ref(c);
    kvr_error e = { 0 };
    int rc = kvrd_persist_defer(r->d, ctx_id, r, &e);
    if (rc > 0)
        return;     /* r may be gone already */
    r->phase = RQ_RUN;
    r->held = NULL;
    kvr_conn_unref(c);      /* the handle's reference is still there */
    if (rc == 0) {
        r->bytes_out += len;
        kvrd_conn_write(c, buf, len, NULL, 0, 0, NULL, NULL);
        kvrd_request_end(r, 0);
        return;
    }
    kvr_mem_free(buf);
    char m[400];
    snprintf(m, sizeof m, "not durable: %s (the change is in memory only)",
             e.msg[0] ? e.msg : kvr_strerror(rc));
    reply_error(r, rc == KVR_ENOMEM ? rc : KVR_EIO, m);
}

void kvrd_request_persisted(void *arg, int rc, const kvr_error *e)
{
    kvrd_request *r = arg;
    kvr_conn *c = r->c;
    assert(r->phase == RQ_PERSIST && r->held);
    r->phase = RQ_RUN;
    uint8_t *buf = r->held;
    r->held = NULL;
    if (c->closing) {
        kvr_mem_free(buf);
        kvrd_request_end(r, rc ? rc : KVR_EIO);
    } else if (rc == 0) {
        r->bytes_out += r->held_len;
        kvrd_conn_write(c, buf, r->held_len, NULL, 0, 0, NULL, NULL);
        kvrd_request_end(r, 0);
    } else {
        kvr_mem_free(buf);
        kvr_log(KVR_LOG_WARN, "persistence failed: %s", e && e->msg[0] ? e->msg : "");
        reply_err(r, rc, e);
    }
    kvr_conn_unref(c);
}

/* A reply with no payload: through persistence when the verb changes a
 * context and there is a disk tier. */
static void reply_ok(kvrd_request *r, Kvrope__Response *resp)
{
    if (r->verb->changes && kvr_store_tier_engine(r->d->store)) {
        reply_durable(r, resp, r->verb->changes(r->msg));
        return;
    }
    send_ok(r, resp, NULL, 0, 0, NULL, NULL);
}

/* ---- the shared tier (remote.c) ------------------------------------------- */

/* A synchronous share: the reply waits (phase PERSIST, the held reply)
 * until the publication is done; then it is sent, or "stored locally, not
 * shared: ..." instead. */
static void shared_done(void *arg, int rc, const char *msg)
{
    kvrd_request *r = arg;
    kvr_conn *c = r->c;
    assert(r->phase == RQ_PERSIST && r->held);
    r->phase = RQ_RUN;
    uint8_t *buf = r->held;
    r->held = NULL;
    if (c->closing) {
        kvr_mem_free(buf);
        kvrd_request_end(r, rc ? rc : KVR_EIO);
    } else if (rc == 0) {
        r->bytes_out += r->held_len;
        kvrd_conn_write(c, buf, r->held_len, NULL, 0, 0, NULL, NULL);
        kvrd_request_end(r, 0);
    } else {
        kvr_mem_free(buf);
        reply_errf(r, rc == KVR_ENOMEM ? rc : KVR_EIO, "stored locally, not shared: %s",
                   msg ? msg : kvr_strerror(rc));
    }
    kvr_conn_unref(c);
}

static void reply_shared(kvrd_request *r, Kvrope__Response *resp, const char *ctx_id)
{
    resp->id = r->id;
    resp->status = KVROPE__STATUS__OK;
    size_t len;
    uint8_t *buf = kvrd_pack_response(resp, 0, &len);
    if (!buf) {
        reply_error(r, KVR_ENOMEM, "stored locally, not shared: out of memory");
        return;
    }
    r->held = buf;
    r->held_len = len;
    r->phase = RQ_PERSIST;
    kvr_conn_ref(r->c);
    kvr_error e = { 0 };
    if (kvr_remote_publish(r->d->remote, ctx_id, shared_done, r, &e) == 0)
        return;     /* shared_done answers */
    r->phase = RQ_RUN;
    r->held = NULL;
    kvr_mem_free(buf);
    kvr_conn_unref(r->c);
    reply_errf(r, e.code ? e.code : KVR_EIO, "stored locally, not shared: %s", e.msg);
}

static void do_get(kvrd_request *r);
static void do_match(kvrd_request *r);
static void remote_queue(kvrd_request *r);

static void remote_work_cb(uv_work_t *w)
{
    kvrd_request *r = w->data;
    kvr_remote_job_work(r->rjob);
}

/* After a fetch: land it (a local put), maybe fetch again (a get by id:
 * the blocks, straight into the put opened for them), then answer as if
 * it had been local all along (or as the miss it is). */
static void remote_done(kvrd_request *r)
{
    kvr_rjob *j = r->rjob;
    r->rjob = NULL;
    if (kvr_remote_job_land(j) == 1) {
        r->rjob = j;
        remote_queue(r);
        return;
    }
    kvr_remote_job_free(j);
    r->remote_tried = true;
    if (r->verb->body == KVROPE__REQUEST__BODY_GET)
        do_get(r);
    else
        do_match(r);
}

static void remote_after_cb(uv_work_t *w, int status)
{
    (void)status;     /* never cancelled */
    kvrd_request *r = w->data;
    kvr_conn *c = r->c;
    assert(r->phase == RQ_WORK);
    r->phase = RQ_RUN;
    if (c->closing) {
        release_txn(r);
        kvrd_request_end(r, KVR_EIO);
    } else {
        remote_done(r);
    }
    kvr_conn_unref(c);
}

static void remote_queue(kvrd_request *r)
{
    r->phase = RQ_WORK;
    r->work.data = r;
    kvr_conn_ref(r->c);
    if (uv_queue_work(&r->d->loop, &r->work, remote_work_cb, remote_after_cb) < 0) {
        remote_work_cb(&r->work);          /* rather than fail the request */
        remote_after_cb(&r->work, 0);
    }
}

/* A local miss the shared tier may answer: queue its fetch (true), or
 * answer from what is local (false). */
static bool ask_remote(kvrd_request *r, kvr_rjob *j)
{
    if (!j)
        return false;
    r->rjob = j;
    remote_queue(r);
    return true;
}

/* ---- the threadpool: one way to run a transaction's work ----------------- */

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

static void shm_copy_in(kvrd_request *r)
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
static int shm_copy_out(kvrd_request *r, kvr_error *e)
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

static void work_cb(uv_work_t *w)
{
    kvrd_request *r = w->data;
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
    kvrd_request *r = w->data;
    kvr_conn *c = r->c;
    assert(r->phase == RQ_WORK);
    r->phase = RQ_RUN;
    if (status < 0 && r->work_rc == 0) {
        r->work_rc = KVR_EINTERNAL;
        kvr_error_set(&r->work_err, KVR_EINTERNAL, "work cancelled");
    }
    if (c->closing) {
        /* Nobody to answer: nothing acknowledged, so nothing kept. */
        release_txn(r);
        kvrd_request_end(r, KVR_EIO);
    } else {
        r->verb->finish(r);
    }
    kvr_conn_unref(c);
}

/* A region copy with nothing else to do (a plain shm get or put) of up to
 * this many bytes runs on the loop thread: the hop to the threadpool and
 * back (two thread switches and a wake-up of the loop: tens of
 * microseconds on a loaded machine) costs more than the copy, and the loop
 * is held no longer than about that. Rotation, conversion and codec work
 * always go to the threadpool. */
#define KVRD_INLINE_COPY_MAX ((size_t)1 << 20)

static size_t work_bytes(const kvrd_request *r)
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
 * for a small region copy: KVRD_INLINE_COPY_MAX), then its finish on the
 * loop thread;
 * finish at once when it needs none. */
static void run(kvrd_request *r, bool needs_work)
{
    assert(r->phase == RQ_RUN && r->verb->finish);
    r->work_rc = 0;
    r->needs_work = needs_work;
    if (!needs_work && !r->shm) {
        r->verb->finish(r);
        return;
    }
    assert(r->verb->work);
    r->phase = RQ_WORK;
    r->work.data = r;
    kvr_conn_ref(r->c);
    bool small = !needs_work && work_bytes(r) <= KVRD_INLINE_COPY_MAX;
    if (small || uv_queue_work(&r->d->loop, &r->work, work_cb, after_work_cb) < 0) {
        work_cb(&r->work);          /* rather than fail the request */
        after_work_cb(&r->work, 0);
    }
}

static int work_put(kvrd_request *r, kvr_error *e)      { return kvr_put_work(r->put, e); }
static int work_edit(kvrd_request *r, kvr_error *e)     { return kvr_edit_work(r->edit, e); }
static int work_get(kvrd_request *r, kvr_error *e)      { return kvr_get_work(r->get, e); }
static int work_assemble(kvrd_request *r, kvr_error *e) { return kvr_assemble_work(r->as, e); }

static void end_get_cb(void *arg, int status)
{
    (void)status;
    kvr_get_end(arg);
}

static void end_assemble_cb(void *arg, int status)
{
    (void)status;
    kvr_assemble_end(arg);
}

/* ---- payloads ------------------------------------------------------------------- */

/* The open put's (or edit's) payload is read into its iovecs; then
 * kvrd_dispatch_payload_done. */
static void read_payload(kvrd_request *r)
{
    if (r->c->closing) {
        release_txn(r);
        kvrd_request_end(r, KVR_EIO);
        return;
    }
    if (r->shm) {   /* copied from the region by the worker (shm_copy_in) */
        run(r, r->edit ? kvr_edit_needs_work(r->edit) : kvr_put_needs_work(r->put));
        return;
    }
    const struct iovec *iov;
    size_t n;
    if (r->edit)
        kvr_edit_payload_iov(r->edit, &iov, &n);
    else
        kvr_put_payload_iov(r->put, &iov, &n);
    r->phase = RQ_PAYLOAD;
    kvrd_conn_read_payload(r->c, iov, n);
}

void kvrd_dispatch_payload_done(kvr_conn *c)
{
    kvrd_request *r = c->req;
    assert(r && r->phase == RQ_PAYLOAD && (r->put || r->edit));
    r->phase = RQ_RUN;
    run(r, r->edit ? kvr_edit_needs_work(r->edit) : kvr_put_needs_work(r->put));
}

void kvrd_dispatch_conn_closing(kvr_conn *c)
{
    kvrd_request *r = c->req;
    if (!r || r->phase != RQ_PAYLOAD)
        return;     /* RUN: its handler is on the stack; the others come back */
    kvr_log(KVR_LOG_INFO, "client closed during %s payload: %s aborted",
            r->put ? "a put" : "an edit", r->put ? "put" : "edit");
    release_txn(r);
    r->phase = RQ_RUN;
    kvrd_request_end(r, KVR_EIO);
}

/* ---- verbs: the simple ones ---------------------------------------------------- */

/* Replies with the context's ContextInfo (pin, fork, shift, keep, stat). */
static void reply_ctx(kvrd_request *r, const char *id)
{
    kvr_ctx_info info;
    kvr_error e = { 0 };
    int rc = kvr_store_stat(r->d->store, id, &info, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    Kvrope__ContextInfo ci;
    kvrd_pb_context(&info, &ci);
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_CONTEXT;
    resp.context = &ci;
    reply_ok(r, &resp);
}

/* A store call's outcome: the error, else ContextInfo of ctx_for_info, or
 * an empty OK. */
static void reply_simple(kvrd_request *r, int rc, const kvr_error *e, const char *ctx_for_info)
{
    if (rc < 0) {
        reply_err(r, rc, e);
        return;
    }
    if (ctx_for_info) {
        reply_ctx(r, ctx_for_info);
        return;
    }
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    reply_ok(r, &resp);
}

static void do_auth(kvrd_request *r)
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
    reply_ok(r, &resp);
}

static void do_ping(kvrd_request *r)
{
    Kvrope__Pong p = KVROPE__PONG__INIT;
    char server[64];
    snprintf(server, sizeof server, "kvroped %s", KVR_DAEMON_VERSION);
    p.server = server;
    p.protocol = KVR_PROTOCOL_VERSION;
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_PONG;
    resp.pong = &p;
    reply_ok(r, &resp);
}

static void do_register_model(kvrd_request *r)
{
    kvr_model_desc desc = { 0 };
    kvr_error err = { 0 };
    int rc = kvrd_model_desc_from_pb(r->msg->register_model, &desc, &err);
    if (rc < 0) {
        reply_err(r, rc, &err);
        return;
    }
    kvr_model_info info;
    kvr_error e = { 0 };
    rc = kvr_store_model_register(r->d->store, &desc, &info, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    kvr_log(KVR_LOG_INFO, "model %s registered: %u layers, %u kv heads, head_dim %u",
            info.name, info.n_layers, info.n_kv_heads, info.head_dim);
    Kvrope__ModelInfo mi;
    Kvrope__RopeParams rp;
    kvrd_pb_model(&info, &mi, &rp);
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_MODEL;
    resp.model = &mi;
    reply_ok(r, &resp);
}

static void do_list_models(kvrd_request *r)
{
    size_t n = kvr_store_model_list(r->d->store, NULL, 0);
    kvr_model_info *infos = n ? kvr_mem_calloc(n, sizeof *infos) : NULL;
    Kvrope__ModelList ml;
    if (infos) {
        size_t got = kvr_store_model_list(r->d->store, infos, n);
        if (got < n)
            n = got;
    }
    if ((n && !infos) || kvrd_pb_model_list(infos, n, &ml) < 0) {
        kvr_mem_free(infos);
        reply_errf(r, KVR_ENOMEM, "out of memory listing models");
        return;
    }
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_MODELS;
    resp.models = &ml;
    reply_ok(r, &resp);
    kvrd_pb_model_list_free(&ml);
    kvr_mem_free(infos);
}

static void do_list(kvrd_request *r)
{
    const Kvrope__List *l = r->msg->list;
    kvr_ctx_info *infos = NULL;
    size_t n = 0;
    kvr_error e = { 0 };
    int rc = kvr_store_list(r->d->store, l->model && l->model[0] ? l->model : NULL, &infos,
                            &n, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    Kvrope__ContextList cl;
    if (kvrd_pb_context_list(infos, n, &cl) < 0) {
        kvr_mem_free(infos);
        reply_errf(r, KVR_ENOMEM, "out of memory listing contexts");
        return;
    }
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_CONTEXTS;
    resp.contexts = &cl;
    reply_ok(r, &resp);
    kvrd_pb_context_list_free(&cl);
    kvr_mem_free(infos);
}

static void do_stat(kvrd_request *r)
{
    reply_ctx(r, r->msg->stat->context_id);
}

static void do_remove_model(kvrd_request *r)
{
    kvr_error e = { 0 };
    int rc = kvr_store_model_remove(r->d->store, r->msg->remove_model->name, &e);
    reply_simple(r, rc, &e, NULL);
}

static void do_delete(kvrd_request *r)
{
    kvr_error e = { 0 };
    int rc = kvr_store_delete(r->d->store, r->msg->delete_->context_id, &e);
    reply_simple(r, rc, &e, NULL);
}

static void do_pin(kvrd_request *r)
{
    const Kvrope__Pin *q = r->msg->pin;
    kvr_error e = { 0 };
    int rc = kvr_store_pin(r->d->store, q->context_id, q->pin, &e);
    reply_simple(r, rc, &e, q->context_id);
}

static void do_fork(kvrd_request *r)
{
    const Kvrope__Fork *q = r->msg->fork;
    kvr_error e = { 0 };
    int rc = kvr_store_fork(r->d->store, q->src, q->dst, &e);
    reply_simple(r, rc, &e, q->dst);
}

/* Shift (delta given) and Keep (delta NULL): a token range of context id,
 * then its ContextInfo. */
static void range_op(kvrd_request *r, const char *verb, const char *id, uint64_t start,
                     uint64_t end, const int64_t *delta)
{
    kvr_error err = { 0 };
    size_t s, t;
    int rc = kvrd_range_from_pb(verb, start, end, &s, &t, &err);
    if (rc < 0) {
        reply_err(r, rc, &err);
        return;
    }
    kvr_error e = { 0 };
    rc = delta ? kvr_store_shift(r->d->store, id, s, t, *delta, &e)
               : kvr_store_keep(r->d->store, id, s, t, &e);
    reply_simple(r, rc, &e, id);
}

static void do_shift(kvrd_request *r)
{
    const Kvrope__Shift *q = r->msg->shift;
    range_op(r, "shift", q->context_id, q->start, q->end, &q->delta);
}

static void do_keep(kvrd_request *r)
{
    const Kvrope__Keep *q = r->msg->keep;
    range_op(r, "keep", q->context_id, q->start, q->end, NULL);
}

static void do_stats(kvrd_request *r)
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
        reply_error(r, KVR_ENOMEM, "out of memory for the stats");
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
            snprintf(names[k], sizeof names[k], "requests_%s", VERBS[k].name);
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
    reply_ok(r, &resp);
    kvr_mem_free(mi);
    kvr_mem_free(ms);
    kvr_mem_free(ptrs);
    kvr_mem_free(tn);
}

/* ---- put and group append ------------------------------------------------------ */

/* Put.codec: a bad spec is E_INVALID (the store's message) whatever the
 * mode; on an existing context (append/upsert) it must be the context's
 * codec, since a context's codec is fixed at create (a replace creates a
 * new context: any codec). Replies on failure. */
static int put_codec_check(kvrd_request *r, const Kvrope__Put *p)
{
    char canon[KVR_CODEC_NAME_MAX];
    kvr_error e = { 0 };
    int rc = kvr_store_codec_check(r->d->store, p->model, p->codec, canon, &e);
    if (rc < 0) {
        if (rc == KVR_ENOMODEL)
            reply_errf(r, rc, "unknown model '%s'", p->model);
        else
            reply_err(r, rc, &e);
        return rc;
    }
    kvr_ctx_info ci;
    if (p->mode != KVROPE__PUT_MODE__CREATE && p->mode != KVROPE__PUT_MODE__REPLACE &&
        kvr_store_stat(r->d->store, p->context_id, &ci, NULL) == 0 &&
        strcmp(ci.codec, canon) != 0) {
        reply_errf(r, KVR_EINVAL, "put: context '%s' is stored as %s, not %s (a context's "
                   "codec is chosen when it is created)", p->context_id, ci.codec, canon);
        return KVR_EINVAL;
    }
    return 0;
}

/* Starts a put (Put, or the Put inside a GroupAppend with `group` set):
 * begin, then the payload into its iovecs, then work and finish_put. */
static void start_put(kvrd_request *r, const Kvrope__Put *p, const char *group,
                      const Kvrope__LayoutPutOptions *lo)
{
    kvr_error err = { 0 };
    kvr_put_params pp;
    int rc = kvrd_put_params_from_pb(p, group, r->payload_len, &pp, &err);
    if (rc < 0) {
        reply_err(r, rc, &err);
        return;
    }
    if (pp.codec && put_codec_check(r, p) < 0)
        return;
    if (((p->has_share && p->share) || (p->has_share_sync && p->share_sync)) && !r->d->remote) {
        reply_errf(r, KVR_EUNSUPPORTED, "put.share: this kvroped has no shared tier (start it "
                   "with --remote-tier redis://HOST:PORT); nothing was stored");
        return;
    }
    if ((rc = kvrd_put_layout_from_pb(lo, &pp, &err)) < 0) {
        reply_err(r, rc, &err);
        return;
    }
    if (!p->has_n_layers || !p->has_n_kv_heads || !p->has_head_dim) {
        uint32_t ml, mh, md;
        if (kvr_store_model_shape(r->d->store, p->model, &ml, &mh, &md) < 0) {
            reply_errf(r, KVR_ENOMODEL, "unknown model '%s'", p->model);
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
        reply_err(r, rc, &e);
        return;
    }
    size_t want = kvr_put_payload_size(r->put);
    if ((uint64_t)want != r->payload_len) {
        release_txn(r);
        reply_errf(r, KVR_EPAYLOAD,
                   "put: payload_len %llu, but %zu layers x 2 x %zu tokens x %u heads x %u dims "
                   "x %zu bytes = %zu",
                   (unsigned long long)r->payload_len, (size_t)pp.n_layers, pp.n_tokens,
                   pp.n_kv_heads, pp.head_dim, kvr_dtype_size(pp.dtype), want);
        return;
    }
    read_payload(r);
}

static void do_put(kvrd_request *r)
{
    const Kvrope__Put *p = r->msg->put;
    start_put(r, p, NULL, p->layout);
}

static void do_group_append(kvrd_request *r)
{
    const Kvrope__GroupAppend *g = r->msg->group_append;
    if (!g->group || !g->group[0]) {
        reply_errf(r, KVR_EBADREQUEST, "group_append: missing group");
        return;
    }
    if (g->put->n_positions || g->put->has_pos_start) {
        reply_errf(r, KVR_EBADREQUEST,
                   "group_append: positions come from the group's cursor; give none");
        return;
    }
    start_put(r, g->put, g->group, g->options ? g->options : g->put->layout);
}

static void finish_put(kvrd_request *r)
{
    kvr_put *t = r->put;
    r->put = NULL;
    if (r->work_rc < 0) {
        kvr_put_abort(t);
        reply_err(r, r->work_rc, &r->work_err);
        return;
    }
    kvr_put_result res;
    kvr_error e = { 0 };
    int rc = kvr_put_commit(t, &res, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    Kvrope__PutResult pr;
    kvrd_pb_put_result(&res, &pr);
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
            reply_shared(r, &resp, pq->context_id);
            return;
        }
        e = (kvr_error){ 0 };
        if (kvr_remote_publish(r->d->remote, pq->context_id, NULL, NULL, &e) < 0)
            kvr_log(KVR_LOG_WARN, "'%s' stored locally, not shared: %s", pq->context_id, e.msg);
    }
    reply_ok(r, &resp);
}

/* ---- edits (PIE) ------------------------------------------------------------- */

/* Resolves the shape fields of an Edit/Refresh: as given, else the model's
 * (the context's model, or the one named). */
static int edit_shape(kvrd_request *r, const char *ctx_id, const char *model, bool has_l,
                      uint32_t *nl, bool has_h, uint32_t *nh, bool has_d, uint32_t *hd,
                      kvr_error *e)
{
    if (has_l && has_h && has_d)
        return 0;
    char name[KVR_ID_MAX + 1];
    if (model && model[0]) {
        snprintf(name, sizeof name, "%s", model);
    } else {
        kvr_ctx_info ci;
        int rc = kvr_store_stat(r->d->store, ctx_id, &ci, e);
        if (rc < 0)
            return rc;
        snprintf(name, sizeof name, "%s", ci.model);
    }
    kvr_model_info mi;
    if (kvr_store_model_find(r->d->store, name, &mi) < 0)
        return kvr_error_set(e, KVR_ENOMODEL, "unknown model '%s'", name);
    if (!has_l)
        *nl = mi.n_layers;
    if (!has_h)
        *nh = mi.n_kv_heads;
    if (!has_d)
        *hd = mi.head_dim;
    return 0;
}

static void reply_edit(kvrd_request *r, const kvr_edit_result *res, const kvr_edit_span *spans,
                       size_t n_spans, uint64_t payload_bytes)
{
    Kvrope__EditResult er;
    if (kvrd_pb_edit_result(res, spans, n_spans, payload_bytes, &er) < 0) {
        reply_errf(r, KVR_ENOMEM, "out of memory for the edit result");
        return;
    }
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_EDIT;
    resp.edit = &er;
    reply_ok(r, &resp);
    kvrd_pb_edit_result_free(&er);
}

/* Edit and Refresh: begin validates (nothing changes on refusal; a refused
 * request's payload is drained), the payload goes straight into the
 * transaction's iovecs, then work (threadpool) and commit (finish_edit). */
static void after_edit_begin(kvrd_request *r, int rc, const kvr_error *e)
{
    if (rc < 0) {
        r->edit = NULL;
        reply_err(r, rc, e);
        return;
    }
    size_t want = kvr_edit_payload_size(r->edit);
    if ((uint64_t)want != r->payload_len) {   /* the store checked; be sure */
        release_txn(r);
        reply_errf(r, KVR_EPAYLOAD, "payload_len %llu, but the new tokens' KV is %zu bytes",
                   (unsigned long long)r->payload_len, want);
        return;
    }
    read_payload(r);
}

static void do_edit(kvrd_request *r)
{
    const Kvrope__Edit *q = r->msg->edit;
    kvr_error err = { 0 };
    kvr_edit_params ep;
    int rc = kvrd_edit_params_from_pb(q, r->payload_len, &ep, &err);
    if (rc < 0) {
        reply_err(r, rc, &err);
        return;
    }
    kvr_error e = { 0 };
    if (ep.with_kv)
        rc = edit_shape(r, q->context_id, q->model, q->has_n_layers, &ep.n_layers,
                        q->has_n_kv_heads, &ep.n_kv_heads, q->has_head_dim, &ep.head_dim, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    kvr_edit_op *ops;
    if ((rc = kvrd_edit_ops_from_pb(q->ops, q->n_ops, &ops, &err)) < 0) {
        reply_err(r, rc, &err);
        return;
    }
    ep.ops = ops;
    rc = kvr_store_edit_begin(r->d->store, &ep, &r->edit, &e);
    kvr_mem_free(ops);
    after_edit_begin(r, rc, &e);
}

static void do_refresh(kvrd_request *r)
{
    const Kvrope__Refresh *q = r->msg->refresh;
    kvr_error err = { 0 };
    kvr_refresh_params rp;
    int rc = kvrd_refresh_params_from_pb(q, r->payload_len, &rp, &err);
    if (rc < 0) {
        reply_err(r, rc, &err);
        return;
    }
    kvr_error e = { 0 };
    rc = edit_shape(r, q->context_id, q->model, q->has_n_layers, &rp.n_layers,
                    q->has_n_kv_heads, &rp.n_kv_heads, q->has_head_dim, &rp.head_dim, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    rc = kvr_store_refresh_begin(r->d->store, &rp, &r->edit, &e);
    after_edit_begin(r, rc, &e);
}

static void do_edit_plan(kvrd_request *r)
{
    const Kvrope__EditPlan *q = r->msg->edit_plan;
    kvr_edit_params ep = {
        .ctx_id = q->context_id,
        .model = q->model,
        .fingerprint = q->has_fingerprint ? q->fingerprint : 0,
        .n_ops = q->n_ops,
        .expect = { .set = q->has_expect_length && q->has_expect_hash,
                    .n_tokens = q->expect_length, .hash = q->expect_hash },
    };
    kvr_error err = { 0 };
    kvr_edit_op *ops;
    int rc = kvrd_edit_ops_from_pb(q->ops, q->n_ops, &ops, &err);
    if (rc < 0) {
        reply_err(r, rc, &err);
        return;
    }
    ep.ops = ops;
    kvr_edit_span *spans = q->n_ops ? kvr_mem_calloc(q->n_ops, sizeof *spans) : NULL;
    if (q->n_ops && !spans) {
        kvr_mem_free(ops);
        reply_errf(r, KVR_ENOMEM, "out of memory for %zu edit spans", q->n_ops);
        return;
    }
    kvr_edit_result res;
    kvr_error e = { 0 };
    rc = kvr_store_edit_plan(r->d->store, &ep, spans, &res, &e);
    kvr_mem_free(ops);
    if (rc < 0) {
        kvr_mem_free(spans);
        reply_err(r, rc, &e);
        return;
    }
    /* What the edit with KV will have to send, in the model's dtype. */
    uint64_t bytes = 0;
    kvr_ctx_info ci;
    kvr_model_info mi;
    if (kvr_store_stat(r->d->store, q->context_id, &ci, NULL) == 0 &&
        kvr_store_model_find(r->d->store, ci.model, &mi) == 0)
        bytes = (uint64_t)mi.n_layers * 2u * res.n_new * mi.n_kv_heads * mi.head_dim *
                kvr_dtype_size(mi.dtype);
    reply_edit(r, &res, spans, q->n_ops, bytes);
    kvr_mem_free(spans);
}

static void finish_edit(kvrd_request *r)
{
    kvr_edit *t = r->edit;
    r->edit = NULL;
    if (r->work_rc < 0) {
        kvr_edit_abort(t);
        reply_err(r, r->work_rc, &r->work_err);
        return;
    }
    size_t n = r->verb->body == KVROPE__REQUEST__BODY_EDIT ? r->msg->edit->n_ops : 1;
    kvr_edit_span *spans = kvr_mem_calloc(n ? n : 1, sizeof *spans);
    if (!spans) {
        kvr_edit_abort(t);
        reply_errf(r, KVR_ENOMEM, "out of memory for %zu edit spans", n);
        return;
    }
    kvr_edit_result res;
    kvr_error e = { 0 };
    int rc = kvr_edit_commit(t, spans, &res, &e);
    if (rc < 0) {
        kvr_mem_free(spans);
        reply_err(r, rc, &e);
        return;
    }
    reply_edit(r, &res, spans, n, res.payload_bytes);
    kvr_mem_free(spans);
}

/* ---- get and match ----------------------------------------------------------- */

static void send_get(kvrd_request *r, bool stream);

/* Starts a get, or the get half of a match. A large one that needs work is
 * streamed (stream.c): its status is decided here, by begin, before any of
 * its payload exists. */
static void start_get(kvrd_request *r, const kvr_get_params *gp0)
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
        reply_err(r, rc, &e);
        return;
    }
    bool work = !gp->meta_only && kvr_get_needs_work(r->get);
    r->meta = gp->meta_only;
    if (r->shm) {
        size_t need = gp->meta_only ? 0 : kvr_get_payload_size(r->get);
        if (need > r->shm_len) {
            release_txn(r);
            reply_errf(r, KVR_ERANGE, "shm: the payload is %zu bytes, the region slice "
                       "holds %zu", need, r->shm_len);
            return;
        }
        /* A read the store placed in the region stages nothing (a no-op);
         * one it could not place is staged here, on the loop thread, for
         * shm_copy_out's copy. */
        if (work && (rc = kvr_get_stage(r->get, &e)) < 0) {
            release_txn(r);
            reply_err(r, rc, &e);
            return;
        }
        run(r, work);   /* no stream: the worker writes the region */
        return;
    }
    /* The staging, reserved only now that it is known how the payload goes
     * out (issue 15): a ring of chunks for a stream, else the whole buffer
     * the iovecs point into; refused before anything is sent. */
    bool stream = work && kvr_get_payload_size(r->get) > KVR_STREAM_MIN_BYTES &&
                  kvr_get_get_info(r->get)->n_layers > 1;
    if (work && (rc = stream ? kvrd_stream_stage(r->get, &e) : kvr_get_stage(r->get, &e)) < 0) {
        release_txn(r);
        reply_err(r, rc, &e);
        return;
    }
    if (stream) {
        r->work_rc = 0;
        send_get(r, true);
        return;
    }
    run(r, work);
}

static void do_get(kvrd_request *r)
{
    const Kvrope__Get *g = r->msg->get;
    if (r->d->remote && !r->remote_tried &&
        kvr_store_stat(r->d->store, g->context_id, &(kvr_ctx_info){ 0 }, NULL) == KVR_ENOCTX &&
        ask_remote(r, kvr_remote_job_get(r->d->remote, g->context_id)))
        return;
    kvr_error err = { 0 };
    kvr_get_params gp;
    int rc = kvrd_get_params_from_pb(g, &gp, &err);
    if (rc < 0) {
        reply_err(r, rc, &err);
        return;
    }
    if (g->n_positions) {
        kvr_ctx_info ci;
        kvr_error e = { 0 };
        rc = kvr_store_stat(r->d->store, g->context_id, &ci, &e);
        if (rc < 0) {
            reply_err(r, rc, &e);
            return;
        }
        size_t real_end = gp.end == SIZE_MAX ? ci.n_tokens : gp.end;
        if (gp.start > real_end || real_end > ci.n_tokens) {
            reply_errf(r, KVR_ERANGE, "get: range [%zu, %zu) outside the context's %zu tokens",
                       gp.start, real_end, ci.n_tokens);
            return;
        }
        if (g->n_positions != real_end - gp.start) {
            reply_errf(r, KVR_EBADREQUEST, "get: %zu positions for a range of %zu tokens",
                       g->n_positions, real_end - gp.start);
            return;
        }
    }
    start_get(r, &gp);
}

static void do_match(kvrd_request *r)
{
    const Kvrope__Match *m = r->msg->match;
    if (!kvrd_dtype_ok(m->dtype)) {
        reply_errf(r, KVR_EBADREQUEST, "match.dtype: unknown value %d", (int)m->dtype);
        return;
    }
    kvr_match_result mr;
    kvr_error e = { 0 };
    int rc = kvr_store_match(r->d->store, m->model, m->tokens, m->n_tokens,
                             m->has_include_approximate && m->include_approximate, &mr, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    if (r->d->remote && !r->remote_tried && mr.length < m->n_tokens &&
        ask_remote(r, kvr_remote_job_prefix(r->d->remote, m->model, m->tokens, m->n_tokens,
                                            mr.length)))
        return;
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
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_MATCH;
    resp.match = &res;
    reply_ok(r, &resp);
}

/* Sends the KV reply of a finished get / match+get; the payload is written
 * straight from the get's iovecs and the get ends in the write callback.
 * stream: the get's work has not been done; it is done chunk by chunk as
 * the payload is written (stream.c). */
static void send_get(kvrd_request *r, bool stream)
{
    kvr_get *t = r->get;
    r->get = NULL;
    if (r->work_rc < 0) {
        kvr_get_end(t);
        reply_err(r, r->work_rc, &r->work_err);
        return;
    }
    bool is_get = r->verb->body == KVROPE__REQUEST__BODY_GET;
    const kvr_get_info *gi = kvr_get_get_info(t);
    bool meta_only = is_get && r->msg->get->has_meta_only && r->msg->get->meta_only;
    size_t payload = meta_only ? 0 : kvr_get_payload_size(t);
    Kvrope__KVResult kv;
    Kvrope__RawLayout rl;
    char rl_buf[3][64];
    kvrd_pb_kv_of_get(gi, is_get ? r->msg->get->context_id : r->match_ctx, meta_only, &kv,
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
    Kvrope__ShmSlice sl = KVROPE__SHM_SLICE__INIT;
    if (r->shm) {   /* the payload is in the client's region already */
        sl.region = r->shm->id;
        sl.offset = (uint64_t)(r->shm_p - r->shm->base);
        sl.length = payload;
        resp.shm = &sl;
        send_ok(r, &resp, NULL, 0, 0, NULL, NULL);
        kvr_get_end(t);
        return;
    }
    if (!stream) {
        const struct iovec *iov = NULL;
        size_t niov = 0;
        if (payload > 0)
            kvr_get_payload_iov(t, &iov, &niov);
        send_ok(r, &resp, iov, niov, payload, end_get_cb, t);
        return;
    }
    resp.id = r->id;
    resp.status = KVROPE__STATUS__OK;
    size_t len;
    uint8_t *buf = kvrd_pack_response(&resp, payload, &len);
    if (buf) {
        /* The message is packed: the request's fields are no longer needed. */
        msg_free(r);
        r->bytes_out += len + payload;
        r->phase = RQ_STREAM;
        if (kvrd_stream_start(r, r->c, t, buf, len, payload) == 0)
            return;     /* stream.c ends r */
        r->phase = RQ_RUN;
        kvr_mem_free(buf);
    }
    kvr_get_end(t);
    reply_errf(r, KVR_ENOMEM, "out of memory starting a streamed reply");
}

static void finish_get(kvrd_request *r)
{
    send_get(r, false);
}

/* ---- position layouts: assemble (APE), groups (GPE), retention ---------- */

static void do_assemble(kvrd_request *r)
{
    kvr_error err = { 0 };
    kvr_assemble_params ap;
    int rc = kvrd_assemble_params_from_pb(r->msg->assemble, &ap, &err);
    if (rc < 0) {
        reply_err(r, rc, &err);
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
        reply_err(r, rc, &e);
        return;
    }
    r->meta = ap.meta_only;
    size_t need = ap.meta_only ? 0 : kvr_assemble_payload_size(r->as);
    if (r->shm && need > r->shm_len) {
        release_txn(r);
        reply_errf(r, KVR_ERANGE, "shm: the assembled payload is %zu bytes, the region slice "
                   "holds %zu", need, r->shm_len);
        return;
    }
    bool work = !ap.meta_only && kvr_assemble_needs_work(r->as);
    /* The staging the iovecs need, reserved now on the loop thread (an
     * assembly placed in a region needs none: a no-op then). */
    if (work && (rc = kvr_assemble_stage(r->as, &e)) < 0) {
        release_txn(r);
        reply_err(r, rc, &e);
        return;
    }
    run(r, work);
}

static void finish_assemble(kvrd_request *r)
{
    kvr_assemble *t = r->as;
    r->as = NULL;
    if (r->work_rc < 0) {
        kvr_assemble_end(t);
        reply_err(r, r->work_rc, &r->work_err);
        return;
    }
    const Kvrope__Assemble *q = r->msg->assemble;
    bool meta = q->has_meta_only && q->meta_only;
    size_t payload = meta ? 0 : kvr_assemble_payload_size(t);
    Kvrope__AssembleResult ar;
    Kvrope__KVResult kv;
    if (kvrd_pb_assemble_result(kvr_assemble_get_info(t), q->prefix, &ar, &kv) < 0) {
        kvr_assemble_end(t);
        reply_errf(r, KVR_ENOMEM, "out of memory for the segment table");
        return;
    }
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_ASSEMBLE;
    resp.assemble = &ar;
    Kvrope__ShmSlice sl = KVROPE__SHM_SLICE__INIT;
    if (r->shm) {
        sl.region = r->shm->id;
        sl.offset = (uint64_t)(r->shm_p - r->shm->base);
        sl.length = payload;
        resp.shm = &sl;
        send_ok(r, &resp, NULL, 0, 0, NULL, NULL);
        kvr_assemble_end(t);
        kvrd_pb_assemble_result_free(&ar);
        return;
    }
    const struct iovec *iov = NULL;
    size_t niov = 0;
    if (payload > 0)
        kvr_assemble_payload_iov(t, &iov, &niov);
    send_ok(r, &resp, iov, niov, payload, end_assemble_cb, t);
    kvrd_pb_assemble_result_free(&ar);
}

/* Cover (t_cover.c): the runs, and with get their placed K/V, which goes
 * out as an assemble's does (r->as). */
static void do_cover(kvrd_request *r)
{
    kvr_error e = { 0 };
    int rc = kvrd_cover_begin(r->d->store, r->msg->cover, r->shm ? r->shm_p : NULL,
                              r->shm_len, &r->cover, &r->as, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    r->meta = kvrd_cover_meta(r->cover);
    size_t need = r->meta ? 0 : kvr_assemble_payload_size(r->as);
    if (r->shm && need > r->shm_len) {
        release_txn(r);
        reply_errf(r, KVR_ERANGE, "shm: the placed payload is %zu bytes, the region slice "
                   "holds %zu", need, r->shm_len);
        return;
    }
    bool work = !r->meta && kvr_assemble_needs_work(r->as);
    if (work && (rc = kvr_assemble_stage(r->as, &e)) < 0) {
        release_txn(r);
        reply_err(r, rc, &e);
        return;
    }
    run(r, work);
}

static void finish_cover(kvrd_request *r)
{
    kvr_assemble *t = r->as;
    kvrd_cover *cv = r->cover;
    r->as = NULL;
    r->cover = NULL;
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_COVER;
    if (r->work_rc < 0 || kvrd_cover_result(cv, t, &resp.cover) < 0) {
        kvr_assemble_end(t);
        kvrd_cover_free(cv);
        if (r->work_rc < 0)
            reply_err(r, r->work_rc, &r->work_err);
        else
            reply_errf(r, KVR_ENOMEM, "out of memory for the cover's runs");
        return;
    }
    size_t payload = r->meta ? 0 : kvr_assemble_payload_size(t);
    Kvrope__ShmSlice sl = KVROPE__SHM_SLICE__INIT;
    const struct iovec *iov = NULL;
    size_t niov = 0;
    if (r->shm && t) {
        sl.region = r->shm->id;
        sl.offset = (uint64_t)(r->shm_p - r->shm->base);
        sl.length = payload;
        resp.shm = &sl;
        send_ok(r, &resp, NULL, 0, 0, NULL, NULL);
        kvr_assemble_end(t);
    } else {
        if (payload > 0)
            kvr_assemble_payload_iov(t, &iov, &niov);
        send_ok(r, &resp, iov, niov, payload, t ? end_assemble_cb : NULL, t);
    }
    kvrd_cover_free(cv);
}

/* Replies with the context's LayoutInfo (layout_stat, set_group_offset,
 * set_retention). */
static void reply_layout(kvrd_request *r, const char *id)
{
    kvr_layout_info *li = kvr_mem_malloc(sizeof *li);
    if (!li) {
        reply_errf(r, KVR_ENOMEM, "out of memory");
        return;
    }
    kvr_error e = { 0 };
    int rc = kvr_store_layout_stat(r->d->store, id, li, &e);
    if (rc < 0) {
        kvr_mem_free(li);
        reply_err(r, rc, &e);
        return;
    }
    Kvrope__GroupInfo gi[KVR_MAX_GROUPS];
    Kvrope__GroupInfo *gp[KVR_MAX_GROUPS];
    Kvrope__LayoutInfo lo;
    kvrd_pb_layout(li, id, &lo, gi, gp);
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_LAYOUT;
    resp.layout = &lo;
    reply_ok(r, &resp);
    kvr_mem_free(li);
}

static void do_layout_stat(kvrd_request *r)
{
    reply_layout(r, r->msg->layout_stat->context_id);
}

static void do_set_group_offset(kvrd_request *r)
{
    const Kvrope__SetGroupOffset *q = r->msg->set_group_offset;
    kvr_error e = { 0 };
    int rc = kvr_store_set_group_offset(r->d->store, q->context_id, q->group, q->offset, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    reply_layout(r, q->context_id);
}

static void do_set_retention(kvrd_request *r)
{
    const Kvrope__SetRetention *q = r->msg->set_retention;
    bool off = q->has_off && q->off;
    if (!off && (q->sinks > SIZE_MAX || q->window > SIZE_MAX)) {
        reply_errf(r, KVR_EINVAL, "set_retention: sinks/window out of range");
        return;
    }
    kvr_retention rt = { .sinks = (size_t)q->sinks, .window = (size_t)q->window, .off = off };
    kvr_error e = { 0 };
    int rc = kvr_store_set_retention(r->d->store, q->context_id, &rt, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    reply_layout(r, q->context_id);
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
    reply_ok(r, &resp);
}

static void do_register_region(kvrd_request *r)
{
    kvrd_region *g;
    kvr_error e = { 0 };
    int rc = kvrd_shm_register(r->c, r->fd, r->msg->register_region->size, &g, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    kvr_log(KVR_LOG_DEBUG, "region %u registered: %zu bytes", g->id, g->size);
    reply_region(r, g->id, g->size);
}

static void do_release_region(kvrd_request *r)
{
    uint32_t id = r->msg->release_region->region;
    kvr_error e = { 0 };
    int rc = kvrd_shm_release(r->c, id, &e);
    if (rc < 0) {
        reply_err(r, rc, &e);
        return;
    }
    reply_region(r, id, 0);
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
 * kvrd_verb_name and its index from here). */
#define VERB(n, B, fl, ch, wk, fin) \
    { #n, KVROPE__REQUEST__BODY_##B, (fl), do_##n, (ch), (wk), (fin) }
static const kvrd_verb VERBS[KVR_N_VERBS] = {
    VERB(auth,             AUTH,             V_OPEN,        NULL, NULL, NULL),
    VERB(ping,             PING,             0,             NULL, NULL, NULL),
    VERB(register_model,   REGISTER_MODEL,   0,             NULL, NULL, NULL),
    VERB(list_models,      LIST_MODELS,      0,             NULL, NULL, NULL),
    VERB(put,              PUT,              V_PAYLOAD_IN,  changes_put, work_put, finish_put),
    VERB(get,              GET,              V_PAYLOAD_OUT, NULL, work_get, finish_get),
    VERB(match,            MATCH,            V_PAYLOAD_OUT, NULL, work_get, finish_get),
    VERB(delete,           DELETE,           0,             changes_delete, NULL, NULL),
    VERB(list,             LIST,             0,             NULL, NULL, NULL),
    VERB(stat,             STAT,             0,             NULL, NULL, NULL),
    VERB(pin,              PIN,              0,             changes_pin, NULL, NULL),
    VERB(fork,             FORK,             0,             changes_fork, NULL, NULL),
    VERB(shift,            SHIFT,            0,             changes_shift, NULL, NULL),
    VERB(keep,             KEEP,             0,             changes_keep, NULL, NULL),
    VERB(stats,            STATS,            0,             NULL, NULL, NULL),
    VERB(edit,             EDIT,             V_PAYLOAD_IN,  changes_edit, work_edit, finish_edit),
    VERB(refresh,          REFRESH,          V_PAYLOAD_IN,  changes_refresh, work_edit,
         finish_edit),
    VERB(edit_plan,        EDIT_PLAN,        0,             NULL, NULL, NULL),
    VERB(assemble,         ASSEMBLE,         V_PAYLOAD_OUT, NULL, work_assemble,
         finish_assemble),
    VERB(group_append,     GROUP_APPEND,     V_PAYLOAD_IN,  changes_group_append, work_put,
         finish_put),
    VERB(set_group_offset, SET_GROUP_OFFSET, 0,             changes_set_group_offset, NULL,
         NULL),
    VERB(set_retention,    SET_RETENTION,    0,             changes_set_retention, NULL, NULL),
    VERB(layout_stat,      LAYOUT_STAT,      0,             NULL, NULL, NULL),
    VERB(register_region,  REGISTER_REGION,  0,             NULL, NULL, NULL),
    VERB(release_region,   RELEASE_REGION,   0,             NULL, NULL, NULL),
    VERB(remove_model,     REMOVE_MODEL,     0,             NULL, NULL, NULL),
    VERB(cover,            COVER,            V_PAYLOAD_OUT, NULL, work_assemble, finish_cover),
};
#undef VERB

const char *kvrd_verb_name(size_t i)
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

static const kvrd_verb *find_verb(Kvrope__Request__BodyCase body)
{
    pthread_once(&verb_index_once, build_verb_index);
    unsigned b = (unsigned)body;
    return b < MAX_BODY_CASE && verb_of_body[b] ? &VERBS[verb_of_body[b] - 1] : NULL;
}

/* ---- a frame comes in -------------------------------------------------------- */

void kvrd_dispatch_frame(kvr_conn *c, const kvr_frame_header *fh, const uint8_t *msg)
{
    assert(c->req == NULL && c->st == KVRD_CONN_BUSY);
    kvr_daemon *d = c->d;
    kvrd_request *r = c->req_spare;
    c->req_spare = NULL;
    if (r)
        memset(r, 0, offsetof(kvrd_request, work));   /* the rest is set before use */
    else
        r = kvr_mem_calloc(1, sizeof *r);
    if (!r) {
        kvr_conn_fail(c, 0, KVR_ENOMEM, "out of memory for the request");
        return;
    }
    r->pb = (ProtobufCAllocator){ pb_arena_alloc, pb_arena_free, r };
    r->arena_used = 0;
    r->arena_heap = 0;
    Kvrope__Request *q = kvrope__request__unpack(&r->pb, fh->msg_len, msg);
    if (!q) {
        c->req_spare = r;
        kvr_conn_fail(c, 0, KVR_EBADFRAME, "message does not decode as a kvrope.Request");
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
     * kvrd_conn_frames_ahead), and refuses them (conn.c). */
    bool region = r->verb && r->verb->body == KVROPE__REQUEST__BODY_REGISTER_REGION;
    r->fd = region || !kvrd_conn_frames_ahead(c) ? kvrd_conn_take_fd(c) : -1;
    c->req = r;
    if (r->fd >= 0 && !region) {
        close(r->fd);
        r->fd = -1;
        char m[200];
        snprintf(m, sizeof m, "a file descriptor came with this %s frame: only a "
                 "register_region frame carries one (SCM_RIGHTS on its bytes)",
                 r->verb ? r->verb->name : "unknown");
        kvr_conn_fail(c, q->id, KVR_EBADREQUEST, m);
        kvrd_request_end(r, KVR_EBADREQUEST);
        return;
    }
    const kvrd_verb *v = r->verb;
    if (v)
        d->per_verb[v - VERBS]++;
    kvr_log(KVR_LOG_DEBUG, "request id %llu: %s, msg %u bytes, payload %llu bytes",
            (unsigned long long)q->id, v ? v->name : "(none)", fh->msg_len,
            (unsigned long long)fh->payload_len);

    if (!c->authed) {
        if (v && (v->flags & V_OPEN) && r->payload_len == 0) {
            v->start(r);
            return;
        }
        kvr_conn_fail(c, q->id, KVR_EUNAUTH,
                      "authentication required: send Auth with the token first");
        kvrd_request_end(r, KVR_EUNAUTH);
        return;
    }
    /* Ids are byte strings: one with a NUL would reach C cut short. */
    const char *nul = kvr_proto_find_nul_string(&kvrope__request__descriptor, msg, fh->msg_len);
    if (nul) {
        reply_errf(r, KVR_EBADREQUEST, "field '%s' holds a NUL byte: ids, names and other "
                   "strings may not contain NUL", nul);
        return;
    }
    if (r->payload_len && !(v && (v->flags & V_PAYLOAD_IN))) {
        reply_errf(r, KVR_EBADREQUEST, "this request takes no payload (payload_len %llu)",
                   (unsigned long long)r->payload_len);
        return;
    }
    if (!v) {
        reply_errf(r, KVR_EBADREQUEST, "request %llu has no body (or an unknown verb)",
                   (unsigned long long)q->id);
        return;
    }
    if (q->shm) {
        if (!(v->flags & (V_PAYLOAD_IN | V_PAYLOAD_OUT))) {
            reply_errf(r, KVR_EBADREQUEST, "shm: a %s request has no payload to place",
                       v->name);
            return;
        }
        if (r->payload_len) {
            reply_errf(r, KVR_EBADREQUEST, "shm: the payload is in the region; the frame "
                       "may not carry one too (payload_len %llu)",
                       (unsigned long long)r->payload_len);
            return;
        }
        kvr_error e = { 0 };
        int rc = kvrd_shm_slice(c, q->shm->region, q->shm->offset, q->shm->length, &r->shm,
                                &r->shm_p, &e);
        if (rc < 0) {
            reply_err(r, rc, &e);
            return;
        }
        if (q->shm->length > SIZE_MAX) {
            reply_errf(r, KVR_ERANGE, "shm: length out of range");
            return;
        }
        r->shm_len = (size_t)q->shm->length;
        if (v->flags & V_PAYLOAD_IN)
            r->payload_len = q->shm->length;   /* what the put/edit declares */
    }
    v->start(r);
}
