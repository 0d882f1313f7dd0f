/*
 * conn.c — one client connection: the frame state machine, reads straight
 * into the right memory, ordered replies, and closing rules.
 *
 *   HDR --24 bytes--> MSG --msg_len bytes--> BUSY (dispatch)
 *   BUSY --put accepted--> PAYLOAD --payload_len bytes--> BUSY (work, commit)
 *   BUSY --refused, payload <= max_drain--> DRAIN --> reply --> HDR
 *   BUSY --reply queued--> HDR
 *   any --protocol error--> reply, shutdown(write), LINGER --> close
 *
 * Invariants:
 *  - alloc_cb never hands libuv more room than the current state needs, so
 *    a read never crosses a frame boundary and nothing has to be stashed.
 *  - The message buffer grows with the bytes that arrived (at most doubling,
 *    plus 64 KiB), never to the size a peer declared.
 *  - A put's payload is read straight into the iovecs kvr_put_payload_iov
 *    gives (block memory when no conversion is needed).
 *  - Reading is stopped while a request is processed (BUSY), so requests on
 *    one connection are handled strictly in order, and while more than
 *    max_conn_buffer bytes of replies wait to be written (back pressure).
 *  - No peer holds daemon resources by stalling: mid-frame (a partial
 *    header, MSG, PAYLOAD, DRAIN) and with replies queued, a connection
 *    that makes no progress for --io-timeout is closed (an open put or edit
 *    is aborted, leases are released); one that owes Auth is closed after
 *    --auth-timeout whatever it does. An idle connection between frames
 *    costs nothing and is kept.
 */
#include "daemon/daemon_internal.h"
#include "daemon/remote.h"

#include <errno.h>
#include <string.h>
#include <time.h>

typedef struct write_req {
    uv_write_t req;
    kvr_conn  *c;
    uint8_t   *buf;        /* header + message, kvr_mem */
    size_t     total;      /* bytes queued (buf + payload) */
    kvr_get   *get;        /* released when the write completes */
    kvr_assemble *as;      /* likewise */
    kvr_stream *stream;    /* a chunk of a streamed reply (see below) */
} write_req;

uint64_t kvr_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void conn_unref(kvr_conn *c)
{
    if (--c->refs > 0)
        return;
    kvr_mem_free(c->msg);
    kvr_mem_free(c->pending);
    kvr_mem_free(c);
}

static void update_reading(kvr_conn *c);
static void stream_write_done(kvr_stream *s);
static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

int kvr_conn_test_write_failures;

static void on_close(uv_handle_t *h)
{
    kvr_conn *c = h->data;
    kvr_daemon *d = c->d;
    /* A request still held with no work queued would never be freed
     * (kvr_conn_close keeps it while BUSY, for the dispatch code still on
     * the stack; that code has returned by now). Work in flight frees it in
     * after_work_cb. */
    if (c->req && c->work_kind == 0) {
        kvrope__request__free_unpacked(c->req, &kvr_pb_allocator);
        c->req = NULL;
    }
    if (c->prev)
        c->prev->next = c->next;
    else
        d->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    d->n_conns--;
    if (!c->authed)
        d->n_unauth--;
    kvr_log(KVR_LOG_DEBUG, "connection %p closed", (void *)c);
    conn_unref(c);
}

void kvr_conn_close(kvr_conn *c)
{
    if (c->closing)
        return;
    c->closing = true;
    if (c->put && c->st == CONN_PAYLOAD) {
        /* Client went away mid-payload: the context stays as it was. */
        kvr_log(KVR_LOG_INFO, "client closed during a put payload: put aborted");
        kvr_put_abort(c->put);
        c->put = NULL;
    }
    if (c->edit && c->st == CONN_PAYLOAD) {
        kvr_log(KVR_LOG_INFO, "client closed during an edit payload: edit aborted");
        kvr_edit_abort(c->edit);
        c->edit = NULL;
    }
    if (c->req && c->st != CONN_BUSY) {
        kvrope__request__free_unpacked(c->req, &kvr_pb_allocator);
        c->req = NULL;
    }
    uv_close(&c->h.handle, on_close);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    kvr_conn *c = req->data;
    kvr_mem_free(req);
    if (status < 0 && !c->closing)
        kvr_conn_close(c);
    conn_unref(c);
}

/* The reply has been written: shut our write side and read (and discard)
 * what the peer still sends for a bounded time, so the peer receives the
 * error reply instead of a reset. */
static void start_linger(kvr_conn *c)
{
    if (c->closing)
        return;
    c->st = CONN_LINGER;
    c->linger_left = KVR_LINGER_BYTES;
    c->linger_deadline_ms = kvr_now_ms() + KVR_LINGER_MS;
    uv_shutdown_t *sr = kvr_mem_malloc(sizeof *sr);
    if (!sr || uv_shutdown(sr, &c->h.stream, on_shutdown) < 0) {
        kvr_mem_free(sr);
        kvr_conn_close(c);
        return;
    }
    sr->data = c;
    c->refs++;
    update_reading(c);
}

static void maybe_finish_close(kvr_conn *c)
{
    if (c->close_after_write && c->writes_pending == 0 && !c->closing &&
        c->st != CONN_LINGER) {
        if (c->linger)
            start_linger(c);
        else
            kvr_conn_close(c);
    }
}

static void on_write(uv_write_t *req, int status)
{
    write_req *w = (write_req *)req;
    kvr_conn *c = w->c;
    if (w->get)
        kvr_get_end(w->get);
    if (w->as)
        kvr_assemble_end(w->as);
    kvr_mem_free(w->buf);
    c->writes_pending--;
    c->write_ms = kvr_now_ms();
    c->write_q = c->closing ? 0 : uv_stream_get_write_queue_size(&c->h.stream);
    c->out_queued -= w->total;
    if (status == 0)
        c->d->bytes_out += w->total;
    kvr_stream *st = w->stream;
    kvr_mem_free(w);
    if (!c->closing) {
        if (status < 0) {
            kvr_log(KVR_LOG_DEBUG, "write failed: %s", uv_strerror(status));
            kvr_conn_close(c);
        } else {
            maybe_finish_close(c);
            update_reading(c);
        }
    }
    if (st)
        stream_write_done(st);
    conn_unref(c);
}

/* The payload source of a reply: a get or an assemble (at most one),
 * released when its write completes; or a chunk of a streamed reply (the
 * given iovecs; the stream is told when the write completes). */
typedef struct out_payload {
    kvr_get      *get;
    kvr_assemble *as;
    kvr_stream   *stream;
    const struct iovec *iov;
    size_t        niov;
} out_payload;

static void release_payload(out_payload *p)
{
    if (p->get)
        kvr_get_end(p->get);
    if (p->as)
        kvr_assemble_end(p->as);
    p->get = NULL;
    p->as = NULL;
}

/* Queues buf (owned, header+message; NULL for a stream chunk) plus the
 * payload's iovecs. */
static int queue_write(kvr_conn *c, uint8_t *buf, size_t len, out_payload *src,
                       size_t payload_len)
{
    out_payload none = { 0 };
    if (!src)
        src = &none;
    write_req *w = kvr_mem_calloc(1, sizeof *w);
    if (!w) {
        kvr_mem_free(buf);
        release_payload(src);
        return KVR_ENOMEM;
    }
    const struct iovec *iov = NULL;
    size_t niov = 0;
    if (src->stream) {
        iov = src->iov;
        niov = src->niov;
    } else if (src->get && payload_len > 0)
        kvr_get_payload_iov(src->get, &iov, &niov);
    else if (src->as && payload_len > 0)
        kvr_assemble_payload_iov(src->as, &iov, &niov);
    uv_buf_t small[8];
    uv_buf_t *bufs = small;
    size_t nb = 1 + niov;
    if (nb > sizeof small / sizeof small[0]) {
        bufs = kvr_mem_malloc(nb * sizeof *bufs);
        if (!bufs) {
            kvr_mem_free(w);
            kvr_mem_free(buf);
            release_payload(src);
            return KVR_ENOMEM;
        }
    }
    size_t k = 0;
    if (buf)
        bufs[k++] = uv_buf_init((char *)buf, (unsigned)len);
    for (size_t i = 0; i < niov; i++) {
        if (iov[i].iov_len == 0)
            continue;
        bufs[k].base = iov[i].iov_base;
        bufs[k].len = iov[i].iov_len;
        k++;
    }
    w->c = c;
    w->buf = buf;
    w->total = len + payload_len;
    w->get = src->get;
    w->as = src->as;
    w->stream = src->stream;
    int rc = kvr_conn_test_write_failures > 0 ? (kvr_conn_test_write_failures--, UV_EPIPE)
             : uv_write(&w->req, &c->h.stream, bufs, (unsigned)k, on_write);
    if (bufs != small)
        kvr_mem_free(bufs);   /* libuv copied the array */
    if (rc < 0) {
        kvr_mem_free(buf);
        release_payload(src);
        kvr_mem_free(w);
        kvr_conn_close(c);
        return KVR_EIO;
    }
    c->refs++;
    if (c->writes_pending++ == 0) {
        c->write_ms = kvr_now_ms();
        c->write_q = uv_stream_get_write_queue_size(&c->h.stream);
    }
    c->out_queued += w->total;
    return 0;
}

/* Packs header + message into one kvr_mem buffer. */
static uint8_t *pack_response(const Kvrope__Response *r, size_t payload_len, size_t *len)
{
    size_t n = kvrope__response__get_packed_size(r);
    if (n > UINT32_MAX || n > SIZE_MAX - KVR_FRAME_HEADER_SIZE)
        return NULL;
    uint8_t *buf = kvr_mem_malloc(KVR_FRAME_HEADER_SIZE + n);
    if (!buf)
        return NULL;
    kvrope__response__pack(r, buf + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(buf, (uint32_t)n, payload_len);
    *len = KVR_FRAME_HEADER_SIZE + n;
    return buf;
}

static uint8_t *pack_error(uint64_t id, int code, const char *msg, size_t *len)
{
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    char text[512];
    snprintf(text, sizeof text, "%s", msg ? msg : kvr_strerror(code));
    r.id = id;
    r.status = (Kvrope__Status)kvr_status_of(code);
    r.message = text;
    return pack_response(&r, 0, len);
}

static int send_reply(kvr_conn *c, const Kvrope__Response *r, out_payload *src,
                      size_t payload_len, bool close_after)
{
    if (r->status != KVROPE__STATUS__OK)
        c->d->n_errors++;
    if (c->closing) {
        release_payload(src);
        return 0;
    }
    size_t len;
    uint8_t *buf = pack_response(r, payload_len, &len);
    if (!buf) {
        release_payload(src);
        /* Fall back to a small error reply; if even that fails, close. */
        buf = pack_error(r->id, KVR_ENOMEM, "out of memory packing the response", &len);
        if (!buf) {
            kvr_conn_close(c);
            return KVR_ENOMEM;
        }
        payload_len = 0;
    }
    if (close_after)
        c->close_after_write = true;
    int rc = queue_write(c, buf, len, src, payload_len);
    if (rc == 0 && close_after) {
        c->st = CONN_BUSY;
        update_reading(c);
    }
    return rc;
}

int kvr_conn_send(kvr_conn *c, const Kvrope__Response *r, kvr_get *get,
                  size_t payload_len, bool close_after)
{
    out_payload src = { .get = get };
    return send_reply(c, r, &src, payload_len, close_after);
}

int kvr_conn_send_packed(kvr_conn *c, uint8_t *buf, size_t len)
{
    if (c->closing) {
        kvr_mem_free(buf);
        return 0;
    }
    out_payload src = { 0 };
    return queue_write(c, buf, len, &src, 0);
}

void kvr_conn_ref(kvr_conn *c)
{
    c->refs++;
}

void kvr_conn_unref(kvr_conn *c)
{
    conn_unref(c);
}

int kvr_conn_send_assemble(kvr_conn *c, const Kvrope__Response *r, kvr_assemble *as,
                           size_t payload_len)
{
    out_payload src = { .as = as };
    return send_reply(c, r, &src, payload_len, false);
}

/* ---- streamed replies ----------------------------------------------------
 *
 * Chunk k (layers [k*per, (k+1)*per) of the payload) is worked in job slot
 * k % KVR_STREAM_WINDOW and written as soon as it and every chunk before it
 * are: writes go out in order. A slot is free again once its chunk's write
 * is queued. New work is queued only while fewer than KVR_STREAM_WINDOW
 * chunk writes wait on the socket, so a slow reader holds back the work (and
 * the --io-timeout write clock sees it as a stalled reply); chunk 0 runs
 * alone (kvr_get_work_layers' first call does the one-time preparation).
 * The stream ends when nothing is queued any more: after the last write
 * (then the request is done), or after a failure or a close once the work
 * and the writes in flight have come back. Each queued job and write holds
 * a reference on the connection, so it outlives the stream.
 */
enum { SLOT_FREE = 0, SLOT_QUEUED, SLOT_READY };

static void stream_pump(kvr_stream *s);

typedef struct stream_job {
    uv_work_t   w;
    kvr_stream *s;
    size_t      chunk;
    int         state;       /* SLOT_* */
    int         rc;
    kvr_error   err;
} stream_job;

struct kvr_stream {
    kvr_conn  *c;
    kvr_get   *get;
    size_t     n_layers, per, n_chunks, layer_bytes;
    size_t     next_queue, next_write;   /* chunks queued for work / written */
    int        jobs, writes;             /* in flight */
    bool       first_done;               /* chunk 0's work came back */
    bool       failed;
    stream_job job[KVR_STREAM_WINDOW];
};

static void stream_range(const kvr_stream *s, size_t chunk, size_t *l0, size_t *l1)
{
    *l0 = chunk * s->per;
    *l1 = *l0 + s->per < s->n_layers ? *l0 + s->per : s->n_layers;
}

static void stream_work_cb(uv_work_t *w)
{
    stream_job *j = w->data;
    size_t l0, l1;
    stream_range(j->s, j->chunk, &l0, &l1);
    memset(&j->err, 0, sizeof j->err);
    j->rc = kvr_get_work_layers(j->s->get, l0, l1, &j->err);
}

static void stream_fail(kvr_stream *s, const char *why)
{
    kvr_conn *c = s->c;
    if (!s->failed)
        kvr_log(KVR_LOG_ERROR, "streamed reply failed after its header was sent: %s "
                "(closing the connection)", why);
    s->failed = true;
    if (!c->closing)
        kvr_conn_close(c);
}

static void stream_after_work_cb(uv_work_t *w, int status)
{
    stream_job *j = w->data;
    kvr_stream *s = j->s;
    kvr_conn *c = s->c;
    s->jobs--;
    if (status < 0 && j->rc == 0) {
        j->rc = KVR_EINTERNAL;
        kvr_error_set(&j->err, KVR_EINTERNAL, "work cancelled");
    }
    j->state = SLOT_READY;
    if (j->chunk == 0)
        s->first_done = true;
    if (j->rc != 0)
        stream_fail(s, j->err.msg[0] ? j->err.msg : kvr_strerror(j->rc));
    stream_pump(s);
    conn_unref(c);
}

static void stream_finish(kvr_stream *s)
{
    kvr_conn *c = s->c;
    bool ok = !s->failed && !c->closing && s->next_write == s->n_chunks;
    if (!ok)
        c->d->n_stream_aborted++;
    kvr_get_end(s->get);
    c->stream = NULL;
    kvr_mem_free(s);
    if (ok)
        kvr_conn_request_done(c);
}

/* Writes what is ready, in order; queues work while the window allows;
 * ends the stream when nothing is left in flight. May free s. */
static void stream_pump(kvr_stream *s)
{
    kvr_conn *c = s->c;
    while (!c->closing && !s->failed && s->next_write < s->n_chunks) {
        stream_job *j = &s->job[s->next_write % KVR_STREAM_WINDOW];
        if (j->state != SLOT_READY || j->chunk != s->next_write)
            break;
        size_t l0, l1;
        stream_range(s, s->next_write, &l0, &l1);
        out_payload src = { .stream = s };
        kvr_get_payload_iov_layers(s->get, l0, l1, &src.iov, &src.niov);
        j->state = SLOT_FREE;
        s->next_write++;
        if (queue_write(c, NULL, 0, &src, (l1 - l0) * s->layer_bytes) != 0) {
            stream_fail(s, "the payload write could not be queued");
            break;
        }
        s->writes++;
    }
    while (!c->closing && !s->failed && s->next_queue < s->n_chunks &&
           s->writes < KVR_STREAM_WINDOW && (s->next_queue == 0 || s->first_done)) {
        stream_job *j = &s->job[s->next_queue % KVR_STREAM_WINDOW];
        if (j->state != SLOT_FREE)
            break;
        j->s = s;
        j->chunk = s->next_queue;
        j->rc = 0;
        j->w.data = j;
        if (uv_queue_work(&c->d->loop, &j->w, stream_work_cb, stream_after_work_cb) < 0) {
            stream_fail(s, "the work could not be queued");
            break;
        }
        j->state = SLOT_QUEUED;
        c->refs++;
        s->jobs++;
        s->next_queue++;
    }
    if (s->jobs > 0 || s->writes > 0)
        return;
    if (!c->closing && !s->failed && s->next_write < s->n_chunks)
        stream_fail(s, "the stream stalled");   /* cannot happen; never hang */
    stream_finish(s);
}

static void stream_write_done(kvr_stream *s)
{
    s->writes--;
    stream_pump(s);
}

void kvr_conn_send_stream(kvr_conn *c, const Kvrope__Response *r, kvr_get *get,
                          size_t payload_len)
{
    if (c->closing) {
        kvr_get_end(get);
        return;
    }
    size_t nl = kvr_get_get_info(get)->n_layers;
    kvr_stream *s = kvr_mem_calloc(1, sizeof *s);
    size_t len = 0;
    uint8_t *buf = s ? pack_response(r, payload_len, &len) : NULL;
    if (!buf || nl == 0) {
        kvr_mem_free(s);
        kvr_mem_free(buf);
        kvr_get_end(get);
        kvr_conn_reply_error(c, KVR_ENOMEM, "out of memory starting a streamed reply");
        return;
    }
    s->c = c;
    s->get = get;
    s->n_layers = nl;
    s->layer_bytes = payload_len / nl;
    s->per = s->layer_bytes ? KVR_STREAM_CHUNK_BYTES / s->layer_bytes : nl;
    if (s->per == 0)
        s->per = 1;
    s->n_chunks = (nl + s->per - 1) / s->per;
    c->stream = s;
    c->d->n_streamed++;
    /* The message is packed: the request is no longer needed. */
    if (c->req) {
        kvrope__request__free_unpacked(c->req, &kvr_pb_allocator);
        c->req = NULL;
    }
    if (queue_write(c, buf, len, NULL, 0) != 0) {
        stream_fail(s, "the header write could not be queued");
        stream_finish(s);
        return;
    }
    stream_pump(s);
}

void kvr_conn_fail(kvr_conn *c, uint64_t id, int code, const char *msg)
{
    kvr_log(KVR_LOG_INFO, "closing connection after error %s: %s",
            kvr_error_name(code), msg ? msg : kvr_strerror(code));
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    char text[512];
    snprintf(text, sizeof text, "%s", msg ? msg : kvr_strerror(code));
    r.id = id;
    r.status = (Kvrope__Status)kvr_status_of(code);
    r.message = text;
    if (c->req) {
        kvrope__request__free_unpacked(c->req, &kvr_pb_allocator);
        c->req = NULL;
    }
    c->linger = true;
    kvr_conn_send(c, &r, NULL, 0, true);
}

void kvr_conn_request_done(kvr_conn *c)
{
    if (c->req) {
        kvrope__request__free_unpacked(c->req, &kvr_pb_allocator);
        c->req = NULL;
    }
    if (c->closing || c->close_after_write)
        return;
    c->st = CONN_HDR;
    c->hdr_have = 0;
    c->msg_have = 0;
    if (c->d->stopping) {
        c->close_after_write = true;
        if (c->writes_pending == 0)
            kvr_conn_close(c);
        return;
    }
    update_reading(c);
}

void kvr_conn_reply_error(kvr_conn *c, int code, const char *msg)
{
    uint64_t id = c->req ? c->req->id : 0;
    const char *text = msg && msg[0] ? msg : kvr_strerror(code);
    if (c->payload_unread) {
        if (c->fh.payload_len > c->d->cfg.max_drain) {
            char m[600];
            snprintf(m, sizeof m, "%s (payload of %llu bytes not drained: closing)",
                     text, (unsigned long long)c->fh.payload_len);
            kvr_conn_fail(c, id, code, m);
            return;
        }
        size_t len;
        uint8_t *buf = pack_error(id, code, text, &len);
        if (!buf) {
            kvr_conn_close(c);
            return;
        }
        c->d->n_errors++;
        kvr_mem_free(c->pending);
        c->pending = buf;
        c->pending_len = len;
        c->drain_left = c->fh.payload_len;
        c->payload_unread = false;
        c->st = CONN_DRAIN;
        update_reading(c);
        return;
    }
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    char t[600];
    snprintf(t, sizeof t, "%s", text);
    r.id = id;
    r.status = (Kvrope__Status)kvr_status_of(code);
    r.message = t;
    kvr_conn_send(c, &r, NULL, 0, false);
    kvr_conn_request_done(c);
}

static void update_reading(kvr_conn *c)
{
    if (c->closing)
        return;
    bool want;
    switch (c->st) {
    case CONN_HDR:
    case CONN_MSG:
    case CONN_PAYLOAD:
    case CONN_DRAIN:
        want = !c->close_after_write && c->out_queued <= c->d->cfg.max_conn_buffer;
        break;
    case CONN_LINGER:
        want = true;
        break;
    default:
        want = false;
        break;
    }
    if (want == c->reading)
        return;
    if (want) {
        if (uv_read_start(&c->h.stream, alloc_cb, read_cb) < 0) {
            kvr_conn_close(c);
            return;
        }
        c->read_ms = kvr_now_ms();   /* the stall clock starts now */
    } else {
        uv_read_stop(&c->h.stream);
    }
    c->reading = want;
}

/* ---- reading ------------------------------------------------------------ */

static void skip_empty_iov(kvr_conn *c)
{
    while (c->iov_i < c->niov && c->iov_off >= c->iov[c->iov_i].iov_len) {
        c->iov_i++;
        c->iov_off = 0;
    }
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    kvr_conn *c = h->data;
    (void)suggested;
    buf->base = NULL;
    buf->len = 0;
    switch (c->st) {
    case CONN_HDR:
        buf->base = (char *)c->hdr + c->hdr_have;
        buf->len = KVR_FRAME_HEADER_SIZE - c->hdr_have;
        break;
    case CONN_MSG: {
        size_t want = c->fh.msg_len - c->msg_have;
        if (c->msg_cap == c->msg_have) {
            /* Grow with what has arrived: at most double, plus 64 KiB. */
            size_t ncap = c->msg_have + (c->msg_have > 65536 ? c->msg_have : 65536);
            if (ncap > c->fh.msg_len)
                ncap = c->fh.msg_len;
            uint8_t *m = kvr_mem_realloc(c->msg, ncap);
            if (!m)
                return;   /* UV_ENOBUFS in read_cb */
            c->msg = m;
            c->msg_cap = ncap;
        }
        size_t room = c->msg_cap - c->msg_have;
        buf->base = (char *)c->msg + c->msg_have;
        buf->len = room < want ? room : want;
        break;
    }
    case CONN_PAYLOAD:
        skip_empty_iov(c);
        if (c->iov_i < c->niov) {
            buf->base = (char *)c->iov[c->iov_i].iov_base + c->iov_off;
            buf->len = c->iov[c->iov_i].iov_len - c->iov_off;
        }
        break;
    case CONN_DRAIN:
        buf->base = (char *)c->d->scratch;
        buf->len = c->drain_left < KVR_SCRATCH_SIZE ? (size_t)c->drain_left
                                                     : KVR_SCRATCH_SIZE;
        break;
    case CONN_LINGER:
        buf->base = (char *)c->d->scratch;
        buf->len = KVR_SCRATCH_SIZE;
        break;
    default:
        break;
    }
}

static void on_header(kvr_conn *c)
{
    int rc = kvr_frame_header_decode(c->hdr, &c->fh, &c->d->limits);
    if (rc == KVR_EBADFRAME) {
        kvr_conn_fail(c, 0, KVR_EBADFRAME,
                      "bad frame header (wrong magic, version, header_len or flags)");
        return;
    }
    if (rc == KVR_ETOOLARGE) {
        char m[200];
        snprintf(m, sizeof m,
                 "frame over the limits: msg_len %u (max %u), payload_len %llu (max %llu)",
                 c->fh.msg_len, c->d->limits.max_msg_len,
                 (unsigned long long)c->fh.payload_len,
                 (unsigned long long)c->d->limits.max_payload_len);
        kvr_conn_fail(c, 0, KVR_ETOOLARGE, m);
        return;
    }
    if (!c->authed && (c->fh.msg_len > KVR_UNAUTH_MAX_MSG || c->fh.payload_len > 0)) {
        /* Refused from the header alone: nothing is buffered or unpacked. */
        char m[200];
        snprintf(m, sizeof m, "authentication required: a frame before Auth may carry at "
                 "most %u message bytes and no payload (msg_len %u, payload_len %llu)",
                 KVR_UNAUTH_MAX_MSG, c->fh.msg_len, (unsigned long long)c->fh.payload_len);
        kvr_conn_fail(c, 0, KVR_EUNAUTH, m);
        return;
    }
    c->msg_have = 0;
    c->st = CONN_MSG;
}

static void on_message(kvr_conn *c)
{
    c->st = CONN_BUSY;
    update_reading(c);
    static const uint8_t empty[1] = { 0 };
    Kvrope__Request *req = kvrope__request__unpack(
        &kvr_pb_allocator, c->fh.msg_len, c->fh.msg_len ? c->msg : empty);
    /* Keep a small buffer for the next frame; give big ones back. */
    if (c->msg_cap > 65536) {
        kvr_mem_free(c->msg);
        c->msg = NULL;
        c->msg_cap = 0;
    }
    c->msg_have = 0;
    if (!req) {
        kvr_conn_fail(c, 0, KVR_EBADFRAME, "message does not decode as a kvrope.Request");
        return;
    }
    c->req = req;
    c->payload_unread = c->fh.payload_len > 0;
    c->work_kind = 0;
    c->d->n_requests++;
    kvr_dispatch(c);
}

static void payload_advance(kvr_conn *c, size_t n)
{
    while (n > 0 && c->iov_i < c->niov) {
        size_t room = c->iov[c->iov_i].iov_len - c->iov_off;
        size_t k = n < room ? n : room;
        c->iov_off += k;
        n -= k;
        skip_empty_iov(c);
    }
    skip_empty_iov(c);
    if (c->iov_i >= c->niov) {
        c->st = CONN_BUSY;
        update_reading(c);
        kvr_dispatch_payload_done(c);
    }
}

static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    kvr_conn *c = s->data;
    (void)buf;
    if (c->closing)
        return;
    if (nread == 0)
        return;
    if (nread < 0) {
        if (nread == UV_ENOBUFS && c->st == CONN_MSG) {
            kvr_conn_fail(c, 0, KVR_ENOMEM, "out of memory buffering the message");
            return;
        }
        if (nread != UV_EOF)
            kvr_log(KVR_LOG_DEBUG, "read: %s", uv_strerror((int)nread));
        else if (c->st != CONN_HDR || c->hdr_have != 0)
            kvr_log(KVR_LOG_DEBUG, "client closed mid-frame (state %d)", (int)c->st);
        kvr_conn_close(c);
        return;
    }
    size_t n = (size_t)nread;
    c->d->bytes_in += n;
    c->read_ms = kvr_now_ms();
    switch (c->st) {
    case CONN_HDR:
        c->hdr_have += n;
        if (c->hdr_have == KVR_FRAME_HEADER_SIZE) {
            on_header(c);
            if (c->st == CONN_MSG && c->fh.msg_len == 0)
                on_message(c);
        }
        break;
    case CONN_MSG:
        c->msg_have += n;
        if (c->msg_have == c->fh.msg_len)
            on_message(c);
        break;
    case CONN_PAYLOAD:
        payload_advance(c, n);
        break;
    case CONN_DRAIN:
        c->drain_left -= n;
        if (c->drain_left == 0) {
            uint8_t *p = c->pending;
            size_t len = c->pending_len;
            c->pending = NULL;
            c->st = CONN_BUSY;
            if (queue_write(c, p, len, NULL, 0) == 0)
                kvr_conn_request_done(c);
        }
        break;
    case CONN_LINGER:
        if (n >= c->linger_left) {
            kvr_conn_close(c);
            return;
        }
        c->linger_left -= n;
        break;
    default:
        break;
    }
}

void kvr_conn_begin_payload(kvr_conn *c)
{
    if (c->edit)
        kvr_edit_payload_iov(c->edit, &c->iov, &c->niov);
    else
        kvr_put_payload_iov(c->put, &c->iov, &c->niov);
    c->iov_i = 0;
    c->iov_off = 0;
    c->payload_unread = false;
    c->st = CONN_PAYLOAD;
    skip_empty_iov(c);
    if (c->iov_i >= c->niov) {
        c->st = CONN_BUSY;
        kvr_dispatch_payload_done(c);
        return;
    }
    update_reading(c);
}

/* ---- threadpool ---------------------------------------------------------- */

static void work_cb(uv_work_t *w)
{
    kvr_conn *c = w->data;
    memset(&c->work_err, 0, sizeof c->work_err);
    switch (c->work_kind) {
    case KVR_WORK_PUT:
        c->work_rc = kvr_put_work(c->put, &c->work_err);
        break;
    case KVR_WORK_EDIT:
        c->work_rc = kvr_edit_work(c->edit, &c->work_err);
        break;
    case KVR_WORK_ASSEMBLE:
        c->work_rc = kvr_assemble_work(c->as, &c->work_err);
        break;
    case KVR_WORK_REMOTE:
        kvr_remote_job_work(c->rjob);
        c->work_rc = 0;
        break;
    default:
        c->work_rc = kvr_get_work(c->get, &c->work_err);
        break;
    }
}

static void after_work_cb(uv_work_t *w, int status)
{
    kvr_conn *c = w->data;
    if (status < 0 && c->work_rc == 0) {
        c->work_rc = KVR_EINTERNAL;
        kvr_error_set(&c->work_err, KVR_EINTERNAL, "work cancelled");
    }
    if (c->closing) {
        /* Nobody to answer: nothing acknowledged, so nothing kept. */
        if (c->work_kind == KVR_WORK_PUT && c->put) {
            kvr_put_abort(c->put);
            c->put = NULL;
        } else if (c->work_kind == KVR_WORK_EDIT && c->edit) {
            kvr_edit_abort(c->edit);
            c->edit = NULL;
        } else if (c->work_kind == KVR_WORK_ASSEMBLE && c->as) {
            kvr_assemble_end(c->as);
            c->as = NULL;
        } else if (c->work_kind == KVR_WORK_REMOTE) {
            kvr_remote_job_free(c->rjob);
            c->rjob = NULL;
        } else if (c->get) {
            kvr_get_end(c->get);
            c->get = NULL;
        }
        if (c->req) {
            kvrope__request__free_unpacked(c->req, &kvr_pb_allocator);
            c->req = NULL;
        }
    } else {
        c->work_requeued = false;
        kvr_dispatch_after_work(c);
    }
    /* A job may queue its next step from its completion (the remote
     * tier's fetch by id): that one keeps its kind. */
    if (!c->work_requeued)
        c->work_kind = 0;
    c->work_requeued = false;
    conn_unref(c);
}

void kvr_conn_queue_work(kvr_conn *c, int kind)
{
    c->work_kind = kind;
    c->work_requeued = true;
    c->work.data = c;
    c->work_rc = 0;
    int rc = uv_queue_work(&c->d->loop, &c->work, work_cb, after_work_cb);
    if (rc < 0) {
        /* Run it here rather than fail the request. */
        work_cb(&c->work);
        c->refs++;
        after_work_cb(&c->work, 0);
        return;
    }
    c->refs++;
}

/* ---- lifecycle ----------------------------------------------------------- */

void kvr_conn_start(kvr_daemon *d, kvr_conn *c, bool is_tcp)
{
    c->d = d;
    c->refs = 1;
    c->is_tcp = is_tcp;
    c->authed = !is_tcp || d->token == NULL;
    if (!c->authed) {
        d->n_unauth++;
        c->auth_deadline_ms = kvr_now_ms() + (uint64_t)d->cfg.auth_timeout * 1000u;
    }
    c->h.handle.data = c;
    c->next = d->conns;
    if (d->conns)
        d->conns->prev = c;
    d->conns = c;
    d->n_conns++;
    d->n_conn_total++;
    c->st = CONN_HDR;
    update_reading(c);
}

void kvr_conn_stop(kvr_conn *c)
{
    if (c->closing)
        return;
    if (c->st == CONN_HDR && c->hdr_have == 0) {
        if (c->writes_pending == 0) {
            kvr_conn_close(c);
            return;
        }
        c->close_after_write = true;
        update_reading(c);
    }
    /* Let the request in flight finish; request_done closes it. */
}

void kvr_conn_set_authed(kvr_conn *c)
{
    if (c->authed)
        return;
    c->authed = true;
    c->d->n_unauth--;
}

/* True while the peer owes us bytes of a frame it has started. */
static bool mid_frame(const kvr_conn *c)
{
    switch (c->st) {
    case CONN_HDR:
        return c->hdr_have > 0;
    case CONN_MSG:
    case CONN_PAYLOAD:
    case CONN_DRAIN:
        return true;
    default:
        return false;
    }
}

void kvr_conn_sweep(kvr_conn *c, uint64_t now_ms, bool force)
{
    if (c->closing)
        return;
    if (force || (c->st == CONN_LINGER && now_ms >= c->linger_deadline_ms)) {
        kvr_conn_close(c);
        return;
    }
    if (c->st == CONN_LINGER)
        return;
    const kvr_daemon_config *cfg = &c->d->cfg;
    if (!c->authed && cfg->auth_timeout && now_ms >= c->auth_deadline_ms) {
        kvr_log(KVR_LOG_INFO, "closing a connection that did not authenticate within "
                "--auth-timeout %u s", cfg->auth_timeout);
        kvr_conn_close(c);
        return;
    }
    if (!cfg->io_timeout)
        return;
    uint64_t limit = (uint64_t)cfg->io_timeout * 1000u;
    if (c->writes_pending > 0) {
        /* Progress = libuv's queue of unwritten bytes shrank. */
        size_t q = uv_stream_get_write_queue_size(&c->h.stream);
        if (q < c->write_q)
            c->write_ms = now_ms;
        c->write_q = q;
        if (now_ms - c->write_ms >= limit) {
            kvr_log(KVR_LOG_INFO, "closing a connection that read none of its replies "
                    "for --io-timeout %u s (%llu bytes queued)", cfg->io_timeout,
                    (unsigned long long)c->out_queued);
            kvr_conn_close(c);
            return;
        }
    }
    /* Reading stopped for back pressure is the write side's business. */
    if (c->reading && mid_frame(c) && now_ms - c->read_ms >= limit) {
        kvr_log(KVR_LOG_INFO, "closing a connection stalled mid-frame (state %d) for "
                "--io-timeout %u s%s", (int)c->st, cfg->io_timeout,
                c->st == CONN_PAYLOAD ? ": its put/edit is aborted" : "");
        kvr_conn_close(c);
    }
}
