/*
 * conn.c — one client connection: the frame state machine, reads straight
 * into the right memory, ordered replies, and closing rules. It moves bytes
 * only: a complete message goes to kvr__dispatch_frame, a payload is read
 * into the iovecs dispatch gives (kvr__conn_read_payload), and replies come
 * back as packed buffers plus payload iovecs (kvr__conn_write). What a
 * request means, and the store transactions behind it, are dispatch.c's.
 *
 *   HDR --24 bytes--> MSG --msg_len bytes--> BUSY (kvr__dispatch_frame)
 *   BUSY --kvr__conn_read_payload--> PAYLOAD --payload_len bytes--> BUSY
 *   BUSY --error, payload <= max_drain--> DRAIN --> reply --> HDR
 *   BUSY --kvr__conn_request_done--> HDR
 *   any --protocol error--> reply, shutdown(write), LINGER --> close
 *
 * Invariants:
 *  - At a frame boundary (HDR) a read takes up to KVR_INBUF_SIZE bytes
 *    into c->inbuf: a small request arrives whole in one recvmsg (and a
 *    short read tells libuv the socket is empty: no EAGAIN read), a put's
 *    header, message and first payload bytes too. feed_inbuf hands those
 *    bytes to the states as reads would have, in order; any other read
 *    (MSG past the inbuf, PAYLOAD, DRAIN, LINGER) gets no more room than
 *    its state needs, so it never crosses a frame boundary. Read-ahead
 *    bytes of later frames wait in the inbuf while a request runs and are
 *    fed once it is done (update_reading), before the socket is read again.
 *  - fds (SCM_RIGHTS) belong to the frame whose bytes they were sent with,
 *    and only a RegisterRegion takes one (docs/protocol.md). The kernel
 *    ends a read after the write that carried fds, so they come with the
 *    read holding that write's bytes: a read bounded to the current frame
 *    (MSG, PAYLOAD) gives them to it; a read at a frame boundary (into the
 *    inbuf) to a RegisterRegion among its frames, else to its last frame
 *    (kvr__conn_frames_ahead, dispatch.c). fds on a frame that takes none
 *    (a ping, a put's payload bytes) are refused: all pending fds closed,
 *    E_BAD_REQUEST, the connection closed (an open put/edit aborted), at
 *    once, never parked for a later frame (refuse_fds). At most
 *    KVR_MAX_PENDING_FDS wait for one frame; more close the connection
 *    the same way, so a peer cannot hoard descriptors.
 *  - The message buffer grows with the bytes that arrived (at most doubling,
 *    plus 64 KiB), never to the size a peer declared.
 *  - A payload is read straight into the iovecs dispatch hands over (a
 *    put's are block memory when no conversion is needed).
 *  - Nothing is read while a request is processed (BUSY: alloc_cb offers
 *    no room), so requests on one connection are handled strictly in
 *    order; nor while more than max_conn_buffer bytes of replies wait to be
 *    written (back pressure: reading is stopped). Entering BUSY leaves the
 *    read watcher armed (a lazy stop): most requests are answered before
 *    the next frame arrives, and stopping and restarting the watcher costs
 *    two epoll_ctl per request; bytes that do arrive while BUSY stop it.
 *  - No peer holds daemon resources by stalling: mid-frame (a partial
 *    header, MSG, PAYLOAD, DRAIN) and with replies queued, a connection
 *    that makes no progress for --io-timeout is closed (an open put or edit
 *    is aborted, leases are released); one that owes Auth is closed after
 *    --auth-timeout whatever it does. An idle connection between frames
 *    costs nothing and is kept. And a frame must arrive whole within
 *    --io-timeout plus its size at --min-rate (frame_deadline_ms): bytes
 *    that trickle in fast enough to beat --io-timeout do not keep a
 *    reservation or a context lock forever.
 *  - Message buffers of all connections together stay under
 *    d->msg_buffer_limit (--max-msg-buffers): one that would pass it is
 *    refused (E_LIMIT, closed) before the memory is taken.
 */
#include "base/clock.h"
#include "daemon/daemon_internal.h"
#include "proto/check.h"

#include <assert.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

typedef struct write_req {
    uv_write_t req;
    kvr_conn  *c;
    uint8_t   *buf;        /* header + message, kvr_mem (NULL: payload only) */
    size_t     total;      /* bytes queued (buf + payload) */
    kvr_write_cb cb;      /* told when the write completes */
    void      *arg;
} write_req;

/* The loop's time (ms, CLOCK_MONOTONIC as kvr_clock_mono_ms, taken once per loop
 * iteration when epoll returns): what the per-read and per-write stall
 * clocks (read_ms, write_ms, frame_ms) need, whose limits are seconds,
 * without a clock_gettime for each read and write of every request. Never
 * ahead of kvr_clock_mono_ms, so now - these stays >= 0 in the sweep. */
static inline uint64_t loop_ms(const kvr_conn *c)
{
    return uv_now(&c->d->loop);
}

/* Frees c's message buffer, and its share of the daemon's budget. */
static void msg_release(kvr_conn *c)
{
    c->d->msg_buffered -= c->msg_cap;
    kvr_mem_free(c->msg);
    c->msg = NULL;
    c->msg_cap = 0;
}

static void conn_unref(kvr_conn *c)
{
    assert(c->refs > 0);
    if (--c->refs > 0)
        return;
    assert(c->closing && c->writes_pending == 0 && c->req == NULL && c->n_cork == 0);
    kvr_mem_free(c->req_spare);
    kvr_mem_free(c->inbuf);
    msg_release(c);
    kvr_mem_free(c->pending);
    kvr_mem_free(c);
}

static void update_reading(kvr_conn *c);
static void next_frame(kvr_conn *c);
static bool check_fds(kvr_conn *c);
static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);
static void payload_read_direct(kvr_conn *c);
static void feed_inbuf(kvr_conn *c);
static bool wants_input(const kvr_conn *c);

int kvr__conn_test_write_failures;

/* A frame carries at most one fd (register_region's memfd); this many may
 * wait for the frame they came with, a few reads' worth. A peer sending
 * more (a byte per sendmsg, each with 253 fds, took the daemon
 * to its descriptor limit) is refused. */
#define KVR_MAX_PENDING_FDS 4

static void on_close(uv_handle_t *h)
{
    kvr_conn *c = h->data;
    kvr_daemon *d = c->d;
    /* libuv has called back every write by now; a request still open is in
     * work, a stream or a held reply, each of which holds a reference. */
    assert(c->closing && c->writes_pending == 0);
    kvr_list_remove(&c->link);
    d->n_conns--;
    if (!c->authed)
        d->n_unauth--;
    kvr_log(KVR_LOG_DEBUG, "connection %p closed", (void *)c);
    conn_unref(c);
}

void kvr__conn_close(kvr_conn *c)
{
    if (c->closing)
        return;
    /* What is held goes out first (as it would have without the cork). */
    kvr__conn_cork_flush(c);
    if (c->closing)
        return;     /* that write failed and closed it */
    c->closing = true;
    if (c->read_fd >= 0)
        close(c->read_fd);
    c->read_fd = -1;
    /* A request reading its payload is aborted: the context stays as it was. */
    kvr__dispatch_conn_closing(c);
    kvr__shm_conn_closed(c);
    uv_close(&c->h.handle, on_close);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    kvr_conn *c = req->data;
    kvr_mem_free(req);
    if (status < 0 && !c->closing)
        kvr__conn_close(c);
    conn_unref(c);
}

/* The reply has been written: shut our write side and read (and discard)
 * what the peer still sends for a bounded time, so the peer receives the
 * error reply instead of a reset. */
static void start_linger(kvr_conn *c)
{
    if (c->closing)
        return;
    c->st = KVR_CONN_LINGER;
    c->linger_left = KVR_LINGER_BYTES;
    c->linger_deadline_ms = kvr_clock_mono_ms() + KVR_LINGER_MS;
    uv_shutdown_t *sr = kvr_mem_malloc(sizeof *sr);
    if (!sr || uv_shutdown(sr, &c->h.stream, on_shutdown) < 0) {
        kvr_mem_free(sr);
        kvr__conn_close(c);
        return;
    }
    sr->data = c;
    c->refs++;
    update_reading(c);
}

static void maybe_finish_close(kvr_conn *c)
{
    if (c->close_after_write && c->n_cork)
        kvr__conn_cork_flush(c);
    if (c->close_after_write && c->writes_pending == 0 && !c->closing &&
        c->st != KVR_CONN_LINGER) {
        if (c->linger)
            start_linger(c);
        else
            kvr__conn_close(c);
    }
}

static void on_write(uv_write_t *req, int status)
{
    write_req *w = (write_req *)req;
    kvr_conn *c = w->c;
    assert(c->writes_pending > 0 && c->out_queued >= w->total);
    kvr_mem_free(w->buf);
    c->writes_pending--;
    c->write_ms = loop_ms(c);
    c->write_q = c->closing ? 0 : uv_stream_get_write_queue_size(&c->h.stream);
    c->out_queued -= w->total;
    if (status == 0)
        c->d->bytes_out += w->total;
    kvr_write_cb cb = w->cb;
    void *arg = w->arg;
    kvr_mem_free(w);
    if (!c->closing) {
        if (status < 0) {
            kvr_log(KVR_LOG_DEBUG, "write failed: %s", uv_strerror(status));
            kvr__conn_close(c);
        } else {
            maybe_finish_close(c);
            update_reading(c);
        }
    }
    if (cb)
        cb(arg, status);
    conn_unref(c);
}

/* Drops the first n bytes of bufs[0..*k) (written already). */
static uv_buf_t *bufs_advance(uv_buf_t *bufs, size_t *k, size_t n)
{
    while (*k > 0 && n >= bufs->len) {
        n -= bufs->len;
        bufs++;
        (*k)--;
    }
    if (*k > 0) {
        bufs->base += n;
        bufs->len -= n;
    }
    return bufs;
}

int kvr__conn_write(kvr_conn *c, uint8_t *buf, size_t len, const struct iovec *iov,
                    size_t niov, size_t payload_len, kvr_write_cb cb, void *arg)
{
    return kvr__conn_write_ex(c, buf, len, iov, niov, payload_len, cb, arg, false);
}

/* bufs[0..k) for buf (len bytes, may be NULL) then the non-empty iovecs:
 * small when it fits, else allocated (*heap). NULL: out of memory. */
static uv_buf_t *bufs_build(uv_buf_t *small, size_t nsmall, uint8_t *buf, size_t len,
                            const struct iovec *iov, size_t niov, size_t *k, bool *heap)
{
    uv_buf_t *bufs = small;
    *heap = false;
    if (1 + niov > nsmall) {
        if (!(bufs = kvr_mem_malloc((1 + niov) * sizeof *bufs)))
            return NULL;
        *heap = true;
    }
    *k = 0;
    if (buf)
        bufs[(*k)++] = uv_buf_init((char *)buf, (unsigned)len);
    for (size_t i = 0; i < niov; i++) {
        if (iov[i].iov_len == 0)
            continue;
        bufs[*k].base = iov[i].iov_base;
        bufs[*k].len = iov[i].iov_len;
        (*k)++;
    }
    return bufs;
}

/* Queues bufs (total bytes; buf is freed when done) with uv_write; cb runs
 * when it completes. On failure the connection is closed, buf freed and
 * KVR_EIO returned (cb never runs). */
static int queue_write(kvr_conn *c, uint8_t *buf, const uv_buf_t *bufs, size_t k,
                       size_t total, kvr_write_cb cb, void *arg)
{
    write_req *w = kvr_mem_calloc(1, sizeof *w);
    if (!w) {
        kvr_mem_free(buf);
        kvr__conn_close(c);
        return KVR_EIO;
    }
    w->c = c;
    w->buf = buf;
    w->total = total;
    w->cb = cb;
    w->arg = arg;
    int rc = kvr__conn_test_write_failures > 0 ? (kvr__conn_test_write_failures--, UV_EPIPE)
             : uv_write(&w->req, &c->h.stream, bufs, (unsigned)k, on_write);
    if (rc < 0) {
        kvr_mem_free(buf);
        kvr_mem_free(w);
        kvr__conn_close(c);
        return KVR_EIO;
    }
    c->refs++;
    if (c->writes_pending++ == 0) {
        c->write_ms = loop_ms(c);
        c->write_q = uv_stream_get_write_queue_size(&c->h.stream);
    }
    c->out_queued += total;
    return 0;
}

/* Can a write go out at once (uv_try_write): nothing of ours or libuv's
 * queued ahead of it. */
static bool can_try_write(kvr_conn *c, size_t total)
{
    return c->writes_pending == 0 && !c->close_after_write &&
           kvr__conn_test_write_failures <= 0 && total <= (1u << 30) &&
           uv_stream_get_write_queue_size(&c->h.stream) == 0;
}

/* ---- corked replies --------------------------------------------------------
 * Replies made while a read callback runs (requests answered at once) are
 * held in c->cork and written together when the loop's I/O phase is over
 * (cork_check, a uv_check handle), or before any other write: pipelined
 * requests (a put with its deferred deletes) get all their answers in one
 * write, so the peer wakes once per batch instead of once per answer. */

static void cork_check_cb(uv_check_t *h);

static void cork_entry_done(kvr_conn *c, kvr_cork *e, int status)
{
    kvr_mem_free(e->buf);
    e->buf = NULL;
    if (e->cb)
        e->cb(e->arg, status);
    (void)c;
}

void kvr__conn_cork_flush(kvr_conn *c)
{
    size_t n = c->n_cork;
    if (n == 0)
        return;
    c->n_cork = 0;
    if (c->cork_prev)
        *c->cork_prev = c->cork_next;
    if (c->cork_next)
        c->cork_next->cork_prev = c->cork_prev;
    c->cork_next = NULL;
    c->cork_prev = NULL;
    kvr_cork ents[KVR_CORK_MAX];
    memcpy(ents, c->cork, n * sizeof ents[0]);
    size_t total = 0, nb = 0;
    for (size_t i = 0; i < n; i++) {
        total += ents[i].total;
        nb += 1 + ents[i].niov;
        c->out_queued -= ents[i].total;
    }
    size_t done = 0;
    if (!c->closing && can_try_write(c, total)) {
        uv_buf_t small[64];
        uv_buf_t *all = small;
        bool heap = nb > sizeof small / sizeof small[0];
        if (heap && !(all = kvr_mem_malloc(nb * sizeof *all)))
            heap = false, all = NULL;
        if (all) {
            size_t k = 0;
            for (size_t i = 0; i < n; i++) {
                if (ents[i].buf)
                    all[k++] = uv_buf_init((char *)ents[i].buf, (unsigned)ents[i].len);
                for (size_t j = 0; j < ents[i].niov; j++)
                    if (ents[i].iov[j].iov_len)
                        all[k++] = uv_buf_init(ents[i].iov[j].iov_base,
                                               (unsigned)ents[i].iov[j].iov_len);
            }
            int w = k > 1024 ? 0 : uv_try_write(&c->h.stream, all, (unsigned)k);
            if (w > 0) {
                done = (size_t)w;
                c->d->bytes_out += done;
                c->write_ms = loop_ms(c);
            }
            if (heap)
                kvr_mem_free(all);
        }
    }
    for (size_t i = 0; i < n; i++) {
        kvr_cork *e = &ents[i];
        if (c->closing) {
            cork_entry_done(c, e, UV_ECANCELED);
            continue;
        }
        if (done >= e->total) {   /* written by the try above */
            done -= e->total;
            cork_entry_done(c, e, 0);
            continue;
        }
        uv_buf_t small[18];
        size_t k;
        bool heap;
        uv_buf_t *bufs = bufs_build(small, sizeof small / sizeof small[0], e->buf, e->len,
                                    e->iov, e->niov, &k, &heap);
        if (!bufs) {
            kvr__conn_close(c);
            cork_entry_done(c, e, UV_ENOMEM);
            continue;
        }
        uv_buf_t *wb = bufs_advance(bufs, &k, done);
        if (queue_write(c, e->buf, wb, k, e->total - done, e->cb, e->arg) < 0 && e->cb)
            e->cb(e->arg, UV_EPIPE);
        done = 0;
        if (heap)
            kvr_mem_free(bufs);
    }
}

static void cork_check_cb(uv_check_t *h)
{
    kvr_daemon *d = h->data;
    while (d->corked) {
        /* As at the end of read_cb: a flush written at once resumes a
         * reading that back pressure stopped (its corks are flushed by
         * update_reading itself: the loop ends). */
        kvr_conn *c = d->corked;
        kvr__conn_ref(c);
        kvr__conn_cork_flush(c);
        update_reading(c);
        kvr__conn_unref(c);
    }
}

int kvr__conn_write_ex(kvr_conn *c, uint8_t *buf, size_t len, const struct iovec *iov,
                       size_t niov, size_t payload_len, kvr_write_cb cb, void *arg,
                       bool sync_ok)
{
    if (c->closing) {
        kvr_mem_free(buf);
        return KVR_EIO;
    }
    size_t total = len + payload_len;
    kvr_daemon *d = c->d;
    /* Made inside a read callback: held until the I/O phase is over. */
    if (c->in_read && d->has_cork_check && (cb == NULL || sync_ok) && !c->close_after_write &&
        c->n_cork < KVR_CORK_MAX && kvr__conn_test_write_failures <= 0) {
        c->cork[c->n_cork++] = (kvr_cork){ .buf = buf, .len = len, .iov = iov, .niov = niov,
                                            .total = total, .cb = cb, .arg = arg };
        c->out_queued += total;
        if (!c->cork_prev) {
            c->cork_next = d->corked;
            if (d->corked)
                d->corked->cork_prev = &c->cork_next;
            d->corked = c;
            c->cork_prev = &d->corked;
        }
        return 0;
    }
    kvr__conn_cork_flush(c);    /* what was corked goes first */
    if (c->closing) {
        kvr_mem_free(buf);
        return KVR_EIO;
    }
    uv_buf_t small[18];
    size_t k;
    bool heap;
    uv_buf_t *bufs = bufs_build(small, sizeof small / sizeof small[0], buf, len, iov, niov, &k,
                                &heap);
    if (!bufs) {
        kvr_mem_free(buf);
        return KVR_ENOMEM;
    }
    /* Fast path: nothing queued before it, so write now (uv_try_write). A
     * reply written in full needs no write request, no callback in a later
     * loop iteration and no POLLOUT bookkeeping (libuv re-arms epoll with
     * an epoll_ctl each time its write queue drains). Not for a reply after
     * which the connection closes (its callback drives the close), and a
     * callback can only be skipped when the caller said so (sync_ok: then
     * 1 says "written, cb not called"). */
    uv_buf_t *wb = bufs;
    size_t nw = k;
    if ((cb == NULL || sync_ok) && can_try_write(c, total)) {
        int n = uv_try_write(&c->h.stream, bufs, (unsigned)k);
        if (n > 0) {
            d->bytes_out += (uint64_t)n;
            c->write_ms = loop_ms(c);
            if ((size_t)n == total) {
                if (heap)
                    kvr_mem_free(bufs);
                kvr_mem_free(buf);
                return cb ? 1 : 0;
            }
            wb = bufs_advance(bufs, &nw, (size_t)n);
            total -= (size_t)n;
        }
        /* EAGAIN or an error: uv_write queues it, or reports the error. */
    }
    int rc = queue_write(c, buf, wb, nw, total, cb, arg);
    if (heap)
        kvr_mem_free(bufs);   /* libuv copied the array */
    return rc;
}

/* The cork's uv_check handle, started with the first connection. */
static void cork_init(kvr_daemon *d)
{
    if (d->has_cork_check || d->cork_check_failed)
        return;
    if (uv_check_init(&d->loop, &d->cork_check) < 0 ||
        uv_check_start(&d->cork_check, cork_check_cb) < 0) {
        d->cork_check_failed = true;   /* replies are then written at once */
        return;
    }
    d->cork_check.data = d;
    uv_unref((uv_handle_t *)&d->cork_check);
    d->has_cork_check = true;
}

void kvr__conn_ref(kvr_conn *c)
{
    c->refs++;
}

void kvr__conn_unref(kvr_conn *c)
{
    conn_unref(c);
}

void kvr__conn_fail(kvr_conn *c, uint64_t id, int code, const char *msg)
{
    kvr_log(KVR_LOG_INFO, "closing connection after error %s: %s",
            kvr_error_name(code), msg ? msg : kvr_strerror(code));
    c->d->n_errors++;
    if (c->closing)
        return;
    size_t len;
    uint8_t *buf = kvr__pack_error(id, code, msg, &len);
    if (!buf) {
        kvr__conn_close(c);
        return;
    }
    c->linger = true;
    c->close_after_write = true;
    if (kvr__conn_write(c, buf, len, NULL, 0, 0, NULL, NULL) == 0) {
        c->st = KVR_CONN_BUSY;
        update_reading(c);
    }
}

/* The frame is done with: read the next header (or close, when stopping). */
static void next_frame(kvr_conn *c)
{
    if (c->closing || c->close_after_write)
        return;
    c->st = KVR_CONN_HDR;
    c->hdr_have = 0;
    c->msg_have = 0;
    if (c->d->stopping) {
        c->close_after_write = true;
        kvr__conn_cork_flush(c);
        if (c->closing)
            return;
        if (c->writes_pending == 0)
            kvr__conn_close(c);
        return;
    }
    update_reading(c);
}

void kvr__conn_request_done(kvr_conn *c)
{
    assert(c->req == NULL);
    if (c->st == KVR_CONN_DRAIN)
        return;     /* the drain reads on and then calls next_frame */
    assert(c->closing || c->st == KVR_CONN_BUSY);
    next_frame(c);
}

void kvr__conn_reply_error(kvr_conn *c, uint64_t id, int code, const char *msg)
{
    const char *text = msg && msg[0] ? msg : kvr_strerror(code);
    bool drain = c->payload_unread && !c->closing;
    if (drain && c->fh.payload_len > c->d->cfg.max_drain) {
        char m[600];
        snprintf(m, sizeof m, "%s (payload of %llu bytes not drained: closing)",
                 text, (unsigned long long)c->fh.payload_len);
        kvr__conn_fail(c, id, code, m);
        return;
    }
    c->d->n_errors++;
    size_t len;
    uint8_t *buf = kvr__pack_error(id, code, text, &len);
    if (!buf) {
        kvr__conn_close(c);
        return;
    }
    if (!drain) {
        kvr__conn_write(c, buf, len, NULL, 0, 0, NULL, NULL);
        return;
    }
    /* The reply goes out once the payload is read and discarded. */
    assert(c->st == KVR_CONN_BUSY && c->pending == NULL);
    c->pending = buf;
    c->pending_len = len;
    c->drain_left = c->fh.payload_len;
    c->payload_unread = false;
    c->st = KVR_CONN_DRAIN;
    update_reading(c);
}

static void update_reading(kvr_conn *c)
{
    if (c->closing)
        return;
    /* Frames read ahead wait in the inbuf while a request runs: fed now
     * that this one is done (a top-level call: no read callback or feed on
     * the stack), their replies corked like a read callback's. A loop: a
     * feed stopped by back pressure whose replies the flush then wrote at
     * once (no write callback follows to resume it) goes on with the rest.
     * Every turn feeds at least one byte (or closes). */
    while (c->in_pos < c->in_len && !c->feeding && !c->in_read && wants_input(c) &&
           (c->st == KVR_CONN_LINGER || c->out_queued <= c->d->cfg.max_conn_buffer)) {
        kvr__conn_ref(c);
        /* These bytes reach the frame machine now: a frame starting here
         * is timed from now (frame_ms, --min-rate), not from the read that
         * brought them while an earlier request ran. */
        c->read_ms = loop_ms(c);
        c->in_read = true;
        feed_inbuf(c);
        c->in_read = false;
        c->drained = false;   /* no libuv read follows this feed to skip */
        kvr__conn_cork_flush(c);
        kvr__conn_unref(c);   /* the handle's reference remains */
        if (c->closing)
            return;
    }
    bool want;
    switch (c->st) {
    case KVR_CONN_HDR:
    case KVR_CONN_MSG:
    case KVR_CONN_PAYLOAD:
    case KVR_CONN_DRAIN:
        want = !c->close_after_write && c->out_queued <= c->d->cfg.max_conn_buffer;
        break;
    case KVR_CONN_LINGER:
        want = true;
        break;
    default:
        want = false;
        break;
    }
    /* Lazy stop (BUSY only): a request answered at once leaves the watcher
     * armed, so the next frame is read without touching epoll (stopping and
     * restarting it cost two epoll_ctl per request). If bytes come while
     * BUSY, alloc_cb offers no room and read_cb stops reading then. */
    if (!want && c->reading && c->st == KVR_CONN_BUSY && !c->close_after_write &&
        c->out_queued <= c->d->cfg.max_conn_buffer)
        return;
    if (want == c->reading)
        return;
    if (want) {
        if (uv_read_start(&c->h.stream, alloc_cb, read_cb) < 0) {
            kvr__conn_close(c);
            return;
        }
        c->read_ms = loop_ms(c);   /* the stall clock starts now */
    } else {
        uv_read_stop(&c->h.stream);
    }
    c->reading = want;
}

void kvr__conn_quiet(kvr_conn *c)
{
    if (c->reading || c->closing)
        return;
    if (uv_read_start(&c->h.stream, alloc_cb, read_cb) == 0)
        uv_read_stop(&c->h.stream);
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
    if (c->drained && c->in_read == false && !c->feeding) {
        /* Our own read just found the socket empty: libuv's would only say
         * EAGAIN (read_cb ends the batch on this UV_ENOBUFS). */
        c->drained = false;
        c->drain_skip = true;
        return;
    }
    switch (c->st) {
    case KVR_CONN_HDR:
        if (c->in_pos < c->in_len && !c->feeding)
            break;    /* read-ahead comes first: nothing from the socket (read_cb) */
        /* The header with what follows it, into the inbuf (feed_inbuf). */
        if (c->in_pos == c->in_len && !c->feeding &&
            (c->inbuf || (c->inbuf = kvr_mem_malloc(KVR_INBUF_SIZE)))) {
            c->in_pos = c->in_len = 0;
            buf->base = (char *)c->inbuf;
            buf->len = KVR_INBUF_SIZE;
            break;
        }
        buf->base = (char *)c->hdr + c->hdr_have;
        buf->len = KVR_FRAME_HEADER_SIZE - c->hdr_have;
        break;
    case KVR_CONN_MSG: {
        size_t want = c->fh.msg_len - c->msg_have;
        if (c->msg_cap == c->msg_have) {
            /* Grow with what has arrived: at most double, plus 64 KiB. */
            size_t ncap = c->msg_have + (c->msg_have > 65536 ? c->msg_have : 65536);
            if (ncap > c->fh.msg_len)
                ncap = c->fh.msg_len;
            kvr_daemon *d = c->d;
            if (d->msg_buffered + (ncap - c->msg_cap) > d->msg_buffer_limit) {
                c->msg_over_limit = true;
                return;   /* UV_ENOBUFS in read_cb: E_LIMIT */
            }
            uint8_t *m = kvr_mem_realloc(c->msg, ncap);
            if (!m)
                return;   /* UV_ENOBUFS in read_cb */
            d->msg_buffered += ncap - c->msg_cap;
            c->msg = m;
            c->msg_cap = ncap;
        }
        size_t room = c->msg_cap - c->msg_have;
        buf->base = (char *)c->msg + c->msg_have;
        buf->len = room < want ? room : want;
        break;
    }
    case KVR_CONN_PAYLOAD:
        skip_empty_iov(c);
        if (c->iov_i < c->niov) {
            buf->base = (char *)c->iov[c->iov_i].iov_base + c->iov_off;
            buf->len = c->iov[c->iov_i].iov_len - c->iov_off;
            /* A small payload in several iovecs (a put's blocks, layer by
             * layer): one read into the scratch and a scatter, instead of
             * one read per iovec. Never past the payload's end. */
            if (c->niov - c->iov_i > 1 && c->payload_left <= KVR_SCRATCH_SIZE &&
                c->payload_left > buf->len) {
                buf->base = (char *)c->d->scratch;
                buf->len = (size_t)c->payload_left;
            }
        }
        break;
    case KVR_CONN_DRAIN:
        buf->base = (char *)c->d->scratch;
        buf->len = c->drain_left < KVR_SCRATCH_SIZE ? (size_t)c->drain_left
                                                     : KVR_SCRATCH_SIZE;
        break;
    case KVR_CONN_LINGER:
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
        kvr__conn_fail(c, 0, KVR_EBADFRAME,
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
        kvr__conn_fail(c, 0, KVR_ETOOLARGE, m);
        return;
    }
    if (!c->authed && (c->fh.msg_len > KVR_UNAUTH_MAX_MSG || c->fh.payload_len > 0)) {
        /* Refused from the header alone: nothing is buffered or unpacked. */
        char m[200];
        snprintf(m, sizeof m, "authentication required: a frame before Auth may carry at "
                 "most %u message bytes and no payload (msg_len %u, payload_len %llu)",
                 KVR_UNAUTH_MAX_MSG, c->fh.msg_len, (unsigned long long)c->fh.payload_len);
        kvr__conn_fail(c, 0, KVR_EUNAUTH, m);
        return;
    }
    c->msg_have = 0;
    c->st = KVR_CONN_MSG;
    /* Deadline of the whole frame: the --io-timeout grace plus its bytes at
     * --min-rate. */
    const kvr_daemon_config *cfg = &c->d->cfg;
    c->frame_deadline_ms = 0;
    if (cfg->min_rate) {
        uint64_t bytes = KVR_FRAME_HEADER_SIZE + (uint64_t)c->fh.msg_len + c->fh.payload_len;
        uint64_t grace = (cfg->io_timeout ? cfg->io_timeout : 30) * 1000ull;
        c->frame_deadline_ms = c->frame_ms + grace + bytes / cfg->min_rate * 1000u +
                               bytes % cfg->min_rate * 1000u / cfg->min_rate;
    }
}

static void on_message(kvr_conn *c)
{
    assert(c->req == NULL && c->msg_have == c->fh.msg_len);
    c->st = KVR_CONN_BUSY;
    update_reading(c);
    static const uint8_t empty[1] = { 0 };
    c->payload_unread = c->fh.payload_len > 0;
    c->d->n_requests++;
    /* c stays allocated through the call: a close frees it in a later
     * loop iteration (on_close). */
    kvr__dispatch_frame(c, &c->fh, c->fh.msg_len ? c->msg : empty);
    /* Keep a small buffer for the next frame; give big ones back. */
    if (c->msg_cap > 65536)
        msg_release(c);
    c->msg_have = 0;
}

/* Bytes read into the scratch (alloc_cb's small-payload read) go to the
 * iovecs they stand for; then payload_advance. */
static void payload_scatter(kvr_conn *c, const uint8_t *src, size_t n)
{
    size_t i = c->iov_i, off = c->iov_off;
    while (n > 0 && i < c->niov) {
        size_t room = c->iov[i].iov_len - off, k = n < room ? n : room;
        memcpy((uint8_t *)c->iov[i].iov_base + off, src, k);
        src += k;
        n -= k;
        off += k;
        if (off == c->iov[i].iov_len) {
            i++;
            off = 0;
        }
    }
}

static void payload_advance(kvr_conn *c, size_t n)
{
    c->payload_left -= n;
    while (n > 0 && c->iov_i < c->niov) {
        size_t room = c->iov[c->iov_i].iov_len - c->iov_off;
        size_t k = n < room ? n : room;
        c->iov_off += k;
        n -= k;
        skip_empty_iov(c);
    }
    assert(n == 0);   /* alloc_cb never offers room past the payload */
    skip_empty_iov(c);
    if (c->iov_i >= c->niov) {
        c->st = KVR_CONN_BUSY;
        update_reading(c);
        kvr__dispatch_payload_done(c);
    }
}

static void read_cb_body(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);
static void on_bytes(kvr_conn *c, size_t n, const uv_buf_t *buf);

static bool wants_input(const kvr_conn *c)
{
    switch (c->st) {
    case KVR_CONN_HDR:
    case KVR_CONN_MSG:
    case KVR_CONN_PAYLOAD:
    case KVR_CONN_DRAIN:
    case KVR_CONN_LINGER:
        return true;
    default:
        return false;
    }
}

/* Feeds the inbuf's bytes to the frame machine, as reads of the socket
 * would have: header and message into c->hdr and c->msg, payload bytes
 * straight into the request's iovecs, drained and lingering bytes dropped.
 * Stops at a request still in progress (BUSY: the rest waits for
 * update_reading once it is done), at back pressure, or when the inbuf is
 * empty; a payload still owed then is read straight from the socket. One
 * loop, not a recursion: a request answered at once ends with next_frame,
 * which only sets the state, and the loop goes on with the next frame. */
static void feed_inbuf(kvr_conn *c)
{
    assert(!c->feeding);
    c->feeding = true;
    while (!c->closing && c->in_pos < c->in_len && wants_input(c) &&
           (c->st == KVR_CONN_LINGER || c->out_queued <= c->d->cfg.max_conn_buffer)) {
        size_t avail = c->in_len - c->in_pos;
        const uint8_t *src = c->inbuf + c->in_pos;
        if (c->st == KVR_CONN_PAYLOAD) {
            size_t k = avail < c->payload_left ? avail : (size_t)c->payload_left;
            skip_empty_iov(c);
            c->in_pos += k;
            payload_scatter(c, src, k);
            payload_advance(c, k);
            continue;
        }
        uv_buf_t b;
        alloc_cb(&c->h.handle, 0, &b);    /* never the inbuf itself while feeding */
        if (b.len == 0) {
            read_cb_body(&c->h.stream, UV_ENOBUFS, &b);   /* MSG: over the limit, or OOM */
            break;
        }
        size_t k = avail < b.len ? avail : b.len;
        if (b.base != (char *)c->d->scratch)   /* drained and lingering bytes are dropped */
            memcpy(b.base, src, k);
        c->in_pos += k;
        on_bytes(c, k, &b);
    }
    c->feeding = false;
    if (c->in_pos == c->in_len)
        c->in_pos = c->in_len = 0;
    if (c->st == KVR_CONN_PAYLOAD && c->in_len == 0 && !c->closing)
        payload_read_direct(c);   /* the rest of the payload, all iovecs at once */
}

/* Replies made while it runs are corked (kvr__conn_write_ex). */
static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    kvr_conn *c = s->data;
    kvr__conn_ref(c);
    c->in_read = true;
    /* fds first: bytes that came with refused ones are not used. */
    if (nread > 0 && !c->is_tcp && check_fds(c))
        c->d->bytes_in += (uint64_t)nread;
    else
        read_cb_body(s, nread, buf);
    if (c->in_pos < c->in_len && !c->closing && wants_input(c)) {
        feed_inbuf(c);    /* the request that stopped the feed ended meanwhile */
        update_reading(c);
    }
    c->in_read = false;
    /* This connection's batch is over when libuv stops reading it: EAGAIN
     * (nread 0), a short read, an error or no room (lazy stop). Its answers
     * go out now, not after every other connection's (cork_check_cb only
     * catches what is left, e.g. after libuv's 32 reads in a row). */
    if (c->closing || nread <= 0 || (size_t)nread < buf->len) {
        c->drained = false;   /* libuv ends the batch itself */
        kvr__conn_cork_flush(c);
        /* Reading stopped for back pressure (with frames maybe left in
         * the inbuf) while the flush wrote the replies at once: no write
         * callback will resume it, so this does. */
        update_reading(c);
    }
    conn_unref(c);
}

static void read_cb_body(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    kvr_conn *c = s->data;
    if (c->closing)
        return;
    if (nread == 0)
        return;
    if (nread < 0) {
        if (nread == UV_ENOBUFS && c->drain_skip) {
            c->drain_skip = false;   /* alloc_cb's skip: the batch is over */
            return;
        }
        if (c->st == KVR_CONN_BUSY ||
            (nread == UV_ENOBUFS && c->st == KVR_CONN_HDR && c->in_pos < c->in_len)) {
            /* Bytes (UV_ENOBUFS: alloc_cb offered no room), an EOF or an
             * error while a request is in progress (update_reading's lazy
             * stop): stop now and see them once the request is answered, as
             * if reading had been stopped all along (a peer that shut its
             * write side still gets its reply). */
            uv_read_stop(&c->h.stream);
            c->reading = false;
            return;
        }
        if (nread == UV_ENOBUFS && c->st == KVR_CONN_MSG && c->msg_over_limit) {
            c->d->n_msg_limited++;
            char m[200];
            snprintf(m, sizeof m, "unfinished messages of all connections are at "
                     "--max-msg-buffers (%llu bytes): this one (%u bytes) is refused",
                     (unsigned long long)c->d->msg_buffer_limit, c->fh.msg_len);
            kvr__conn_fail(c, 0, KVR_ELIMIT, m);
            return;
        }
        if (nread == UV_ENOBUFS && c->st == KVR_CONN_MSG) {
            kvr__conn_fail(c, 0, KVR_ENOMEM, "out of memory buffering the message");
            return;
        }
        if (nread != UV_EOF)
            kvr_log(KVR_LOG_DEBUG, "read: %s", uv_strerror((int)nread));
        else if (c->st != KVR_CONN_HDR || c->hdr_have != 0)
            kvr_log(KVR_LOG_DEBUG, "client closed mid-frame (state %d)", (int)c->st);
        kvr__conn_close(c);
        return;
    }
    size_t n = (size_t)nread;
    c->d->bytes_in += n;
    c->read_ms = loop_ms(c);
    if (buf->base == (char *)c->inbuf && c->inbuf) {
        assert(c->st == KVR_CONN_HDR && c->in_len == 0);
        c->in_pos = 0;
        c->in_len = n;
        feed_inbuf(c);
        return;
    }
    on_bytes(c, n, buf);
}

/* n bytes of the current state's arrived in buf (from the socket, or fed
 * from the inbuf). */
static void on_bytes(kvr_conn *c, size_t n, const uv_buf_t *buf)
{
    switch (c->st) {
    case KVR_CONN_HDR:
        assert(c->hdr_have + n <= KVR_FRAME_HEADER_SIZE);   /* alloc_cb's bound */
        if (c->hdr_have == 0)
            c->frame_ms = c->read_ms;
        c->hdr_have += n;
        if (c->hdr_have == KVR_FRAME_HEADER_SIZE) {
            on_header(c);
            if (c->st == KVR_CONN_MSG && c->fh.msg_len == 0)
                on_message(c);
        }
        break;
    case KVR_CONN_MSG:
        assert(c->msg_have + n <= c->fh.msg_len);
        c->msg_have += n;
        if (c->msg_have == c->fh.msg_len)
            on_message(c);
        break;
    case KVR_CONN_PAYLOAD:
        if (buf->base == (char *)c->d->scratch)
            payload_scatter(c, c->d->scratch, n);
        payload_advance(c, n);
        if (n == buf->len && c->in_len == 0)
            payload_read_direct(c);   /* the rest, all iovecs at once */
        break;
    case KVR_CONN_DRAIN:
        assert(n <= c->drain_left && c->pending);
        c->drain_left -= n;
        if (c->drain_left == 0) {
            uint8_t *p = c->pending;
            size_t len = c->pending_len;
            c->pending = NULL;
            c->st = KVR_CONN_BUSY;
            if (kvr__conn_write(c, p, len, NULL, 0, 0, NULL, NULL) == 0)
                next_frame(c);
        }
        break;
    case KVR_CONN_LINGER:
        if (n >= c->linger_left) {
            kvr__conn_close(c);
            return;
        }
        c->linger_left -= n;
        break;
    default:
        break;
    }
}

/* fds came where no frame takes them, or too many: every pending one is
 * closed, the peer gets E_BAD_REQUEST (id 0) and the connection closes. A
 * put or edit reading its payload is aborted first, as a close would. */
static void refuse_fds(kvr_conn *c, const char *why)
{
    kvr__shm_drop_fds(c);
    if (c->read_fd >= 0)
        close(c->read_fd);
    c->read_fd = -1;
    if (c->closing || c->close_after_write)
        return;
    if (c->st == KVR_CONN_PAYLOAD) {
        c->st = KVR_CONN_BUSY;
        kvr__dispatch_conn_closing(c);    /* ends it (E_IO): nothing kept */
        if (c->closing)
            return;
    }
    kvr__conn_fail(c, 0, KVR_EBADREQUEST, why);
}

/* A libuv read of a Unix connection is in, its bytes not yet used: fds
 * queued with it wait for the frame dispatch gives them to, unless they
 * came with a payload's bytes (a PAYLOAD read never passes the payload's
 * end) or too many wait. True: refused (the bytes are not to be used). A
 * drained or lingering frame's fds are closed. */
static bool check_fds(kvr_conn *c)
{
    if (c->closing)
        return false;
    int n = uv_pipe_pending_count(&c->h.pipe);
    if (n == 0)
        return false;
    if (c->st == KVR_CONN_DRAIN || c->st == KVR_CONN_LINGER || c->close_after_write) {
        kvr__shm_drop_fds(c);
        return false;
    }
    if (c->st == KVR_CONN_PAYLOAD) {
        refuse_fds(c, "file descriptors came with a payload's bytes: only a register_region "
                   "frame carries one (SCM_RIGHTS on its bytes)");
        return true;
    }
    if (n > KVR_MAX_PENDING_FDS) {
        char m[200];
        snprintf(m, sizeof m, "%d file descriptors arrived for one frame: a frame carries at "
                 "most one (register_region's memfd), at most %d may wait", n,
                 KVR_MAX_PENDING_FDS);
        refuse_fds(c, m);
        return true;
    }
    return false;
}

/* Reads what the socket holds of the payload straight into its iovecs, as
 * many as 64 of them in one recvmsg (libuv's read takes one buffer: a
 * payload over eight block iovecs cost eight reads, or one read into the
 * scratch and a copy), and, when those are the payload's last iovecs,
 * what follows it into the (empty) inbuf: the next frames (a put's
 * deferred deletes) come with the payload's end, without a read of their
 * own. An fd that comes with it is kept for the frame it belongs to
 * (kvr__conn_take_fd). EAGAIN, EOF and errors are left for libuv's next
 * read to find. */
static void payload_read_direct(kvr_conn *c)
{
    uv_os_fd_t fd;
    if (uv_fileno(&c->h.handle, &fd) != 0)
        return;
    while (c->st == KVR_CONN_PAYLOAD && !c->closing && !c->close_after_write &&
           c->out_queued <= c->d->cfg.max_conn_buffer) {
        struct iovec v[65];
        size_t k = 0, want = 0, off = c->iov_off, i = c->iov_i;
        for (; i < c->niov && k < 64; i++, off = 0) {
            if (c->iov[i].iov_len == off)
                continue;
            v[k].iov_base = (uint8_t *)c->iov[i].iov_base + off;
            v[k].iov_len = c->iov[i].iov_len - off;
            want += v[k].iov_len;
            k++;
        }
        if (k == 0)
            return;
        bool ahead = i == c->niov && c->in_len == 0 &&
                     (c->inbuf || (c->inbuf = kvr_mem_malloc(KVR_INBUF_SIZE)));
        if (ahead) {
            v[k].iov_base = c->inbuf;
            v[k++].iov_len = KVR_INBUF_SIZE;
        }
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(4 * sizeof(int))];
        } cm;
        struct msghdr mh = { .msg_iov = v, .msg_iovlen = k };
        if (!c->is_tcp) {
            mh.msg_control = cm.b;
            mh.msg_controllen = sizeof cm.b;
        }
        ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN && c->in_read)
            c->drained = true;
        if (n <= 0)
            return;
        /* fds: kept (one) for a frame read ahead with them; on this
         * payload's bytes alone (the read ended within it), refused. */
        bool ahead_fd = ahead && (size_t)n > want, fds = false;
        for (struct cmsghdr *h = mh.msg_controllen ? CMSG_FIRSTHDR(&mh) : NULL; h;
             h = CMSG_NXTHDR(&mh, h)) {
            if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS)
                continue;
            size_t nfd = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t j = 0; j < nfd; j++) {
                int f;
                memcpy(&f, CMSG_DATA(h) + j * sizeof(int), sizeof f);
                fds = true;
                if (ahead_fd && c->read_fd < 0)
                    c->read_fd = f;
                else
                    close(f);
            }
        }
        if ((fds || (mh.msg_flags & MSG_CTRUNC)) && !ahead_fd) {
            c->d->bytes_in += (uint64_t)n;
            refuse_fds(c, "file descriptors came with a payload's bytes: only a "
                       "register_region frame carries one (SCM_RIGHTS on its bytes)");
            return;
        }
        c->d->bytes_in += (uint64_t)n;
        c->read_ms = loop_ms(c);
        size_t got = (size_t)n < want ? (size_t)n : want;
        if (ahead && (size_t)n > want) {
            c->in_pos = 0;
            c->in_len = (size_t)n - want;   /* fed once this frame is done */
        }
        if (c->in_read && (size_t)n < want + (ahead ? KVR_INBUF_SIZE : 0))
            c->drained = true;      /* the socket is empty for now */
        payload_advance(c, got);   /* the last byte: dispatch, maybe the answer */
        if (got < want)
            return;
    }
}

int kvr__conn_take_fd(kvr_conn *c)
{
    int fd = kvr__shm_take_fd(c), mine = c->read_fd;
    c->read_fd = -1;
    if (fd < 0)
        return mine;
    if (mine >= 0)
        close(mine);
    return fd;
}

bool kvr__conn_frames_ahead(const kvr_conn *c)
{
    return c->in_len - c->in_pos > c->fh.payload_len;
}

void kvr__conn_read_payload(kvr_conn *c, const struct iovec *iov, size_t niov)
{
    assert(c->st == KVR_CONN_BUSY && !c->closing);
    c->iov = iov;
    c->niov = niov;
    c->iov_i = 0;
    c->iov_off = 0;
    c->payload_left = 0;
    for (size_t i = 0; i < niov; i++)
        c->payload_left += iov[i].iov_len;
    c->payload_unread = false;
    c->st = KVR_CONN_PAYLOAD;
    skip_empty_iov(c);
    if (c->iov_i >= c->niov) {
        c->st = KVR_CONN_BUSY;
        kvr__dispatch_payload_done(c);
        return;
    }
    update_reading(c);
    if (c->closing || c->st != KVR_CONN_PAYLOAD)
        return;
    if (c->in_pos < c->in_len) {
        /* Its first bytes are in the inbuf: the feed on the stack goes on
         * with them (or one starts here). */
        if (!c->feeding) {
            if (!c->in_read)
                c->read_ms = loop_ms(c);   /* fed now (update_reading) */
            feed_inbuf(c);
        }
        return;
    }
    payload_read_direct(c);
}

/* ---- lifecycle ----------------------------------------------------------- */

void kvr__conn_start(kvr_daemon *d, kvr_conn *c, bool is_tcp)
{
    cork_init(d);
    c->d = d;
    c->read_fd = -1;
    c->refs = 1;
    c->is_tcp = is_tcp;
    kvr_list_init(&c->regions);
    c->authed = !is_tcp || d->token == NULL;
    if (!c->authed) {
        d->n_unauth++;
        c->auth_deadline_ms = kvr_clock_mono_ms() + (uint64_t)d->cfg.auth_timeout * 1000u;
    }
    c->h.handle.data = c;
    kvr_list_insert_head(&d->conns, &c->link);
    d->n_conns++;
    d->n_conn_total++;
    c->st = KVR_CONN_HDR;
    update_reading(c);
}

void kvr__conn_stop(kvr_conn *c)
{
    if (c->closing)
        return;
    kvr__conn_cork_flush(c);
    if (c->closing)
        return;
    if (c->st == KVR_CONN_HDR && c->hdr_have == 0) {
        if (c->writes_pending == 0) {
            kvr__conn_close(c);
            return;
        }
        c->close_after_write = true;
        update_reading(c);
    }
    /* Let the request in flight finish; request_done closes it. */
}

void kvr__conn_set_authed(kvr_conn *c)
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
    case KVR_CONN_HDR:
        return c->hdr_have > 0;
    case KVR_CONN_MSG:
    case KVR_CONN_PAYLOAD:
    case KVR_CONN_DRAIN:
        return true;
    default:
        return false;
    }
}

void kvr__conn_sweep(kvr_conn *c, uint64_t now_ms, bool force)
{
    if (c->closing)
        return;
    if (force || (c->st == KVR_CONN_LINGER && now_ms >= c->linger_deadline_ms)) {
        kvr__conn_close(c);
        return;
    }
    if (c->st == KVR_CONN_LINGER)
        return;
    const kvr_daemon_config *cfg = &c->d->cfg;
    if (!c->authed && cfg->auth_timeout && now_ms >= c->auth_deadline_ms) {
        kvr_log(KVR_LOG_INFO, "closing a connection that did not authenticate within "
                "--auth-timeout %u s", cfg->auth_timeout);
        kvr__conn_close(c);
        return;
    }
    if (c->reading && mid_frame(c) && c->st != KVR_CONN_HDR && c->frame_deadline_ms &&
        now_ms >= c->frame_deadline_ms) {
        c->d->n_slow_closed++;
        kvr_log(KVR_LOG_INFO, "closing a connection whose frame (%llu bytes) did not arrive "
                "within --io-timeout plus its size at --min-rate %llu B/s (state %d)%s",
                (unsigned long long)(KVR_FRAME_HEADER_SIZE + (uint64_t)c->fh.msg_len +
                                     c->fh.payload_len),
                (unsigned long long)cfg->min_rate, (int)c->st,
                c->st == KVR_CONN_PAYLOAD ? ": its put/edit is aborted" : "");
        kvr__conn_close(c);
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
            kvr__conn_close(c);
            return;
        }
    }
    /* Reading stopped for back pressure is the write side's business. */
    if (c->reading && mid_frame(c) && now_ms - c->read_ms >= limit) {
        kvr_log(KVR_LOG_INFO, "closing a connection stalled mid-frame (state %d) for "
                "--io-timeout %u s%s", (int)c->st, cfg->io_timeout,
                c->st == KVR_CONN_PAYLOAD ? ": its put/edit is aborted" : "");
        kvr__conn_close(c);
    }
}
