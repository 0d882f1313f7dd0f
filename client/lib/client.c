/*
 * client.c — libkvrope's connection: addressing, frames, the request /
 * response exchange and the payload paths.
 *
 * Invariants:
 *  - One request is in flight per handle; every call reads its response
 *    completely (message and payload) before it returns, so the stream is
 *    always at a frame boundary between calls. A call that cannot keep that
 *    promise (system error, peer hang-up, undecodable frame) closes the
 *    socket, and the handle then fails every call with KVR_ECLOSED.
 *  - Payloads are never copied on the way out (sendmsg over the caller's
 *    iovecs) and on the way in are received straight into the destination,
 *    except for the bytes that happened to arrive with the message in the
 *    small read-ahead buffer.
 *  - Lengths from the wire are checked before they size anything: the
 *    message grows as its bytes arrive, and a payload must equal what its
 *    message describes.
 */
#include "client/lib/client_int.h"

#include <assert.h>
#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/iov.h"
#include "proto/frame.h"

#define RBUF_SIZE        (64u * 1024u)
#define MAX_MSG_LEN      (256u * 1024u * 1024u)
#define DIRECT_ALLOC_MAX ((size_t)64 << 20)

static _Thread_local char connect_err[512];

/* ---- errors (the codes and their tables: base/error.h) ---------------- */

int kvr__fail(kvr_client *c, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return code;
}

/* A failure after which the stream position is unknown: close the socket. */
static int fatal(kvr_client *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fatal(kvr_client *c, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    if (c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
    c->rpos = c->rlen = 0;
    c->pre_len = 0;
    c->dlen = 0;            /* deferred requests die with the connection */
    c->n_deferred = 0;
    return code;
}

const char *kvr_client_last_error(const kvr_client *c)
{
    return c ? c->err : connect_err;
}

void kvr_client_free(void *p) { free(p); }

#define STR_(x) #x
#define STR(x) STR_(x)
unsigned kvr_version(void) { return KVR_VERSION_HEX; }
const char *kvr_version_string(void)
{
    return STR(KVR_VERSION_MAJOR) "." STR(KVR_VERSION_MINOR) "." STR(KVR_VERSION_PATCH);
}

void kvr_client_set_progress(kvr_client *c, kvr_progress_fn fn, void *ud)
{
    c->progress = fn;
    c->progress_ud = ud;
}

size_t kvr_payload_size(uint32_t n_layers, size_t n_tokens, uint32_t n_kv_heads,
                        uint32_t head_dim, kvr_dtype dtype)
{
    size_t ds = kvr_dtype_size(dtype), r = ds;
    if (ds == 0)
        return 0;
    if (__builtin_mul_overflow(r, (size_t)n_layers, &r) ||
        __builtin_mul_overflow(r, (size_t)2, &r) ||
        __builtin_mul_overflow(r, n_tokens, &r) ||
        __builtin_mul_overflow(r, (size_t)n_kv_heads, &r) ||
        __builtin_mul_overflow(r, (size_t)head_dim, &r))
        return 0;
    return r;
}

/* ---- connecting --------------------------------------------------------- */

static int set_connect_err(int code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int set_connect_err(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(connect_err, sizeof connect_err, fmt, ap);
    va_end(ap);
    return code;
}

static void tune_socket(int fd, int timeout_ms)
{
    int sz = 4 << 20;
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    if (timeout_ms > 0) {
        struct timeval tv = { .tv_sec = timeout_ms / 1000,
                              .tv_usec = (timeout_ms % 1000) * 1000 };
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
}

static int connect_unix(const char *path, int *fd_out)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    size_t len = strlen(path);
    if (len == 0 || len >= sizeof sa.sun_path)
        return set_connect_err(KVR_EINVAL, "socket path too long or empty: %s", path);
    memcpy(sa.sun_path, path, len + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return set_connect_err(KVR_ESYS, "socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        int e = errno;
        close(fd);
        return set_connect_err(KVR_ESYS, "cannot connect to %s: %s", path, strerror(e));
    }
    *fd_out = fd;
    return 0;
}

static int connect_tcp(const char *hostport, int *fd_out)
{
    char host[256];
    const char *port;
    if (hostport[0] == '[') {
        const char *rb = strchr(hostport, ']');
        if (!rb || rb[1] != ':' || (size_t)(rb - hostport - 1) >= sizeof host)
            return set_connect_err(KVR_EINVAL, "bad address: %s", hostport);
        memcpy(host, hostport + 1, (size_t)(rb - hostport - 1));
        host[rb - hostport - 1] = 0;
        port = rb + 2;
    } else {
        const char *colon = strrchr(hostport, ':');
        if (!colon || (size_t)(colon - hostport) >= sizeof host)
            return set_connect_err(KVR_EINVAL, "bad address (want HOST:PORT): %s", hostport);
        memcpy(host, hostport, (size_t)(colon - hostport));
        host[colon - hostport] = 0;
        port = colon + 1;
    }
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM };
    struct addrinfo *res = NULL;
    int g = getaddrinfo(host[0] ? host : "127.0.0.1", port, &hints, &res);
    if (g != 0)
        return set_connect_err(KVR_ESYS, "cannot resolve %s: %s", hostport, gai_strerror(g));
    int fd = -1, e = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            e = errno;
            continue;
        }
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
            break;
        e = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return set_connect_err(KVR_ESYS, "cannot connect to %s: %s", hostport, strerror(e));
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    *fd_out = fd;
    return 0;
}

int kvr_client_connect(kvr_client **out, const char *addr, const kvr_client_opts *opts)
{
    *out = NULL;
    connect_err[0] = 0;
    char def[300];
    if (!addr) {   /* $KVROPE_SOCKET, else the daemon's (and make run's) default */
        const char *env = getenv("KVROPE_SOCKET"), *xdg = getenv("XDG_RUNTIME_DIR");
        if (env && *env)
            snprintf(def, sizeof def, "%s", env);
        else if (xdg && *xdg)
            snprintf(def, sizeof def, "%s/kvrope/kvroped.sock", xdg);
        else if (geteuid() == 0)
            snprintf(def, sizeof def, "/run/kvrope/kvroped.sock");
        else
            snprintf(def, sizeof def, "/tmp/kvrope-%u/kvroped.sock", (unsigned)getuid());
        addr = def;
        if (!strchr(addr, '/') && strncmp(addr, "unix:", 5) && strncmp(addr, "tcp:", 4))
            return set_connect_err(KVR_EINVAL, "KVROPE_SOCKET=%s is not a socket path", addr);
    }
    if (!*addr)
        return set_connect_err(KVR_EINVAL, "no address given");
    int fd = -1, r;
    if (strncmp(addr, "unix:", 5) == 0)
        r = connect_unix(addr + 5, &fd);
    else if (strncmp(addr, "tcp:", 4) == 0)
        r = connect_tcp(addr + 4, &fd);
    else if (strchr(addr, '/'))
        r = connect_unix(addr, &fd);
    else
        r = connect_tcp(addr, &fd);
    if (r < 0)
        return r;
    tune_socket(fd, opts ? opts->timeout_ms : 0);

    kvr_client *c = calloc(1, sizeof *c);
    uint8_t *rbuf = malloc(RBUF_SIZE);
    if (!c || !rbuf) {
        free(c);
        free(rbuf);
        close(fd);
        return set_connect_err(KVR_ENOMEM, "out of memory");
    }
    c->fd = fd;
    c->timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : 0;
    c->send_fd = -1;
    c->rbuf = rbuf;
    c->rcap = RBUF_SIZE;
    c->next_id = 1;

    if (opts && opts->token) {
        size_t tl = opts->token_len ? opts->token_len : strlen(opts->token);
        Kvrope__Auth auth = KVROPE__AUTH__INIT;
        auth.token.data = (uint8_t *)(uintptr_t)opts->token;
        auth.token.len = tl;
        KVR_REQUEST(req, AUTH, auth, &auth);
        Kvrope__Response *resp = NULL;
        r = kvr__call(c, &req, NULL, 0, 0, &resp, NULL);
        if (resp)
            kvrope__response__free_unpacked(resp, NULL);
        if (r < 0) {
            set_connect_err(r, "authentication failed: %s", c->err);
            kvr_client_close(c);
            return r;
        }
    }
    *out = c;
    return 0;
}

void kvr_client_close(kvr_client *c)
{
    if (!c)
        return;
    if (c->fd >= 0)
        close(c->fd);
    kvr__shm_free_all(c);
    free(c->rbuf);
    free(c->wbuf);
    free(c->dbuf);
    free(c);
}

/* ---- sending ------------------------------------------------------------ */

static int send_all(kvr_client *c, struct iovec *iov, size_t n, size_t head_bytes,
                    uint64_t payload_len)
{
    size_t i = 0;
    uint64_t sent = 0;
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } cm;
    while (i < n) {
        struct msghdr mh = { .msg_iov = iov + i,
                             .msg_iovlen = n - i > IOV_MAX ? IOV_MAX : n - i };
        if (c->send_fd >= 0 && sent == 0) {
            /* The fd rides on the frame's first bytes (RegisterRegion). */
            memset(&cm, 0, sizeof cm);
            mh.msg_control = cm.buf;
            mh.msg_controllen = sizeof cm.buf;
            struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
            h->cmsg_level = SOL_SOCKET;
            h->cmsg_type = SCM_RIGHTS;
            h->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(h), &c->send_fd, sizeof(int));
        }
        ssize_t w = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        sent += (uint64_t)w;
        kvr_iov_advance(iov, n, &i, (size_t)w);
        if (c->progress && payload_len > 0 && sent > head_bytes)
            c->progress(c->progress_ud, sent - head_bytes, payload_len);
    }
    c->just_sent = true;
    return 0;
}

/* ---- receiving ---------------------------------------------------------- */

/* Waiting for the answer sleeps in poll(POLLIN), not in a blocking recv:
 * on a Unix socket every skb the daemon consumes from our request wakes
 * whoever sleeps on our socket (unix_write_space), and a recv sleeper takes
 * each such wake-up (two context switches for nothing), while poll's
 * waiter ignores wake-ups that are not for POLLIN. */
static int wait_readable(kvr_client *c);

static int recv_some(kvr_client *c, void *dst, size_t cap, size_t *got)
{
    int flags = MSG_DONTWAIT;
    if (c->just_sent) {
        /* Right after a request its answer is not there yet: a recv would
         * only say EAGAIN. */
        c->just_sent = false;
        int w = wait_readable(c);
        if (w < 0)
            return w;
        if (w > 0)
            flags = 0;
    }
    for (;;) {
        ssize_t r = recv(c->fd, dst, cap, flags);
        if (r > 0) {
            *got = (size_t)r;
            return 0;
        }
        if (r == 0)
            return fatal(c, KVR_ECLOSED, "connection closed by the daemon");
        if (errno == EINTR)
            continue;
        if ((errno == EAGAIN || errno == EWOULDBLOCK) && flags) {
            int w = wait_readable(c);
            if (w < 0)
                return w;
            /* Readable, an error or a hang-up: recv says which (a blocking
             * one when poll itself failed). */
            flags = w > 0 ? 0 : MSG_DONTWAIT;
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return fatal(c, KVR_ESYS, "receive timed out");
        return fatal(c, KVR_ESYS, "recv: %s", strerror(errno));
    }
}

/* Reads exactly n bytes into dst: first what the read-ahead buffer holds,
 * then large remainders straight from the socket. `on_chunk` (may be NULL)
 * is told of every advance. */
typedef void (*chunk_fn)(kvr_client *c, void *ud, size_t done);

static int recv_exact(kvr_client *c, void *dst, size_t n, chunk_fn on_chunk, void *ud)
{
    uint8_t *p = dst;
    size_t done = 0;
    if (c->pre_len && n) {   /* payload bytes received ahead, in the caller's buffer */
        size_t k = c->pre_len < n ? c->pre_len : n;
        if (p && p != c->pre)
            memmove(p, c->pre, k);
        c->pre += k;
        c->pre_len -= k;
        done = k;
        if (on_chunk)
            on_chunk(c, ud, done);
        if (done == n)
            return 0;
    }
    assert(c->rpos <= c->rlen && c->rlen <= c->rcap);   /* read-ahead window */
    size_t have = c->rlen - c->rpos;
    if (have && done < n) {
        size_t k = have < n - done ? have : n - done;
        if (p)
            memcpy(p + done, c->rbuf + c->rpos, k);
        c->rpos += k;
        done += k;
        if (c->rpos == c->rlen)
            c->rpos = c->rlen = 0;
        if (on_chunk && k)
            on_chunk(c, ud, done);
    }
    while (done < n) {
        size_t want = n - done, got;
        int r;
        if (p && want >= c->rcap / 2) {
            r = recv_some(c, p + done, want, &got);
            if (r < 0)
                return r;
            done += got;
        } else {
            r = recv_some(c, c->rbuf, c->rcap, &got);
            if (r < 0)
                return r;
            size_t k = got < want ? got : want;
            if (p)
                memcpy(p + done, c->rbuf, k);
            done += k;
            c->rpos = k;
            c->rlen = got;
            if (c->rpos == c->rlen)
                c->rpos = c->rlen = 0;
        }
        if (on_chunk)
            on_chunk(c, ud, done);
    }
    return 0;
}

int kvr__drain(kvr_client *c, uint64_t n)
{
    while (n > 0) {
        size_t k = n > (uint64_t)SIZE_MAX ? SIZE_MAX : (size_t)n;
        int r = recv_exact(c, NULL, k, NULL, NULL);
        if (r < 0)
            return r;
        n -= k;
    }
    return 0;
}

/* Reads one response frame's header and message; the payload stays on the
 * socket (*payload_len bytes). */
void kvr__place_next(kvr_client *c, void *dst, size_t cap)
{
    c->rx_dst = dst;
    c->rx_cap = cap;
}

/* Sleeps until the socket is readable (or has an error or hang-up, which
 * the next recv reports): 0, 1 when poll itself failed (a blocking recv
 * then says why), or the handle is closed on a timeout. */
static int wait_readable(kvr_client *c)
{
    for (;;) {
        struct pollfd pf = { .fd = c->fd, .events = POLLIN };
        int pr = poll(&pf, 1, c->timeout_ms > 0 ? c->timeout_ms : -1);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr == 0)
            return fatal(c, KVR_ESYS, "receive timed out");
        return pr < 0;
    }
}

/* The first read of a placed answer: its header, message and first
 * payload bytes, into the (empty) read-ahead buffer. */
#define PLACED_FIRST_READ 4096u

/* The placed receive, with nothing read ahead: the answer's first bytes
 * are read into the read-ahead buffer (one recv: header, message and the
 * start of the payload); if its payload fits the caller's buffer, the
 * header and message go to buf (malloc'd, *buf_out) and the payload bytes
 * that came with them to the caller's buffer (the rest is read straight
 * there by recv_exact). 1 done (*h filled), 0 not possible here (what was
 * read stays in the read-ahead buffer: the plain path goes on from it), or
 * a negative code (the handle is closed). */
static int recv_placed(kvr_client *c, kvr_frame_header *h, const kvr_frame_limits *lim,
                       uint8_t **buf_out)
{
    assert(c->rpos == c->rlen && c->pre_len == 0 && c->rcap >= PLACED_FIRST_READ);
    c->rpos = c->rlen = 0;
    size_t n = 0;
    while (n < KVR_FRAME_HEADER_SIZE) {
        size_t got;
        int r = recv_some(c, c->rbuf + n, PLACED_FIRST_READ - n, &got);
        if (r < 0)
            return r;
        n += got;
    }
    c->rlen = n;   /* until placed below, the plain path's */
    if (kvr_frame_header_decode(c->rbuf, h, lim) != 0)
        return 0;   /* the plain path reads it (and reports what is wrong) */
    if (h->payload_len == 0 || h->payload_len > c->rx_cap || h->msg_len > c->rcap / 2)
        return 0;
    size_t hm = KVR_FRAME_HEADER_SIZE + h->msg_len, pl = (size_t)h->payload_len;
    while (n < hm) {   /* a message longer than the first read: the rest of it */
        size_t got;
        int r = recv_some(c, c->rbuf + n, hm - n, &got);
        if (r < 0)
            return r;
        n += got;
        c->rlen = n;
    }
    uint8_t *buf = malloc(hm);
    if (!buf)
        return 0;
    memcpy(buf, c->rbuf, hm);
    size_t extra = n - hm, placed = extra < pl ? extra : pl;
    memcpy(c->rx_dst, c->rbuf + hm, placed);
    /* Bytes past the payload (answers of deferred requests) stay read ahead. */
    c->rpos = hm + placed;
    if (c->rpos == c->rlen)
        c->rpos = c->rlen = 0;
    c->pre = c->rx_dst;
    c->pre_len = placed;
    *buf_out = buf;
    return 1;
}

/* Decodes a response message of len bytes at msg (inside buf, which is
 * freed here) answering request id: *out, 0; or the connection's fatal
 * error. id 0 answers any request only as an error: the daemon uses it for
 * a protocol-level failure before it knew the request's id. */
static int decode_answer(kvr_client *c, uint64_t id, uint8_t *buf, const uint8_t *msg,
                         size_t len, Kvrope__Response **out)
{
    Kvrope__Response *resp = kvrope__response__unpack(NULL, len, msg);
    free(buf);
    if (!resp)
        return fatal(c, KVR_EPROTO, "undecodable response message");
    if (resp->id != id && (resp->id != 0 || resp->status == KVROPE__STATUS__OK)) {
        unsigned long long got = (unsigned long long)resp->id;
        kvrope__response__free_unpacked(resp, NULL);
        return fatal(c, KVR_EPROTO, "response id %llu does not answer request %llu",
                     got, (unsigned long long)id);
    }
    *out = resp;
    return 0;
}

static int recv_response(kvr_client *c, uint64_t id, Kvrope__Response **out,
                         uint64_t *payload_len)
{
    kvr_frame_limits plim = { .max_msg_len = MAX_MSG_LEN, .max_payload_len = UINT64_MAX };
    uint8_t *placed_buf = NULL;
    kvr_frame_header ph;
    if (c->rx_dst && c->rpos == c->rlen && c->pre_len == 0) {
        int pr = recv_placed(c, &ph, &plim, &placed_buf);
        c->rx_dst = NULL;
        if (pr < 0)
            return pr;
        if (pr == 1) {
            int dr = decode_answer(c, id, placed_buf, placed_buf + KVR_FRAME_HEADER_SIZE,
                                   ph.msg_len, out);
            if (dr == 0)
                *payload_len = ph.payload_len;
            return dr;
        }
    }
    c->rx_dst = NULL;
    uint8_t hb[KVR_FRAME_HEADER_SIZE];
    int r = recv_exact(c, hb, sizeof hb, NULL, NULL);
    if (r < 0)
        return r;
    kvr_frame_header h;
    kvr_frame_limits lim = { .max_msg_len = MAX_MSG_LEN, .max_payload_len = UINT64_MAX };
    if (kvr_frame_header_decode(hb, &h, &lim) != 0)
        return fatal(c, KVR_EPROTO, "bad frame header from the daemon");
    /* The message buffer grows as bytes arrive, never to a declared size. */
    size_t cap = h.msg_len < RBUF_SIZE ? (h.msg_len ? h.msg_len : 1) : RBUF_SIZE, len = 0;
    uint8_t *buf = malloc(cap);
    if (!buf)
        return fatal(c, KVR_ENOMEM, "out of memory");
    while (len < h.msg_len) {
        if (len == cap) {
            size_t ncap = cap * 2 > h.msg_len ? h.msg_len : cap * 2;
            uint8_t *nb = realloc(buf, ncap);
            if (!nb) {
                free(buf);
                return fatal(c, KVR_ENOMEM, "out of memory");
            }
            buf = nb;
            cap = ncap;
        }
        r = recv_exact(c, buf + len, cap - len, NULL, NULL);
        if (r < 0) {
            free(buf);
            return r;
        }
        len = cap;
    }
    r = decode_answer(c, id, buf, buf, len, out);
    if (r == 0)
        *payload_len = h.payload_len;
    return r;
}

/* ---- deferred requests (pipelining) ------------------------------------ */

/* Reads the answers of the n deferred requests just sent (ids c->did[0..n)).
 * A failure is counted, never returned (*first_fail gets the first one's
 * code); only a connection error is (the handle is closed then). */
static int read_deferred(kvr_client *c, size_t n, int *first_fail)
{
    for (size_t i = 0; i < n; i++) {
        Kvrope__Response *resp = NULL;
        uint64_t pl = 0;
        int r = recv_response(c, c->did[i], &resp, &pl);
        if (r < 0)
            return r;
        int st = (int)resp->status;
        if (st != KVROPE__STATUS__OK && st != KVROPE__STATUS__E_UNKNOWN_CONTEXT) {
            int code = kvr_error_from_status(st);
            c->defer_failures++;
            snprintf(c->defer_err, sizeof c->defer_err, "%s",
                     resp->message && *resp->message ? resp->message : kvr_strerror(code));
            if (first_fail && *first_fail == 0)
                *first_fail = code;
        }
        kvrope__response__free_unpacked(resp, NULL);
        if (pl && (r = kvr__drain(c, pl)) < 0)
            return r;
    }
    return 0;
}

int kvr__defer(kvr_client *c, Kvrope__Request *req)
{
    if (c->fd < 0)
        return kvr__fail(c, KVR_ECLOSED, "connection is closed");
    if (c->n_deferred == KVR_DEFER_MAX) {
        int r = kvr_client_flush(c);
        if (r < 0 && c->fd < 0)
            return r;
        c->err[0] = 0;   /* a failed delete is counted, not this call's error */
    }
    req->id = c->next_id++;
    size_t mlen = kvrope__request__get_packed_size(req);
    size_t need = KVR_FRAME_HEADER_SIZE + mlen;
    if (c->dlen + need > c->dcap) {
        size_t ncap = c->dcap ? c->dcap * 2 : 1024;
        while (ncap < c->dlen + need)
            ncap *= 2;
        uint8_t *nb = realloc(c->dbuf, ncap);
        if (!nb)
            return kvr__fail(c, KVR_ENOMEM, "out of memory");
        c->dbuf = nb;
        c->dcap = ncap;
    }
    kvr_frame_header_encode(c->dbuf + c->dlen, (uint32_t)mlen, 0);
    kvrope__request__pack(req, c->dbuf + c->dlen + KVR_FRAME_HEADER_SIZE);
    c->dlen += need;
    c->did[c->n_deferred++] = req->id;
    return 0;
}

int kvr_client_flush(kvr_client *c)
{
    c->err[0] = 0;
    if (c->fd < 0)
        return kvr__fail(c, KVR_ECLOSED, "connection is closed");
    size_t n = c->n_deferred;
    if (n == 0)
        return 0;
    struct iovec iov = { c->dbuf, c->dlen };
    int sr = send_all(c, &iov, 1, c->dlen, 0);
    c->dlen = 0;
    c->n_deferred = 0;
    if (sr < 0) {
        if (sr == -EPIPE || sr == -ECONNRESET)
            return fatal(c, KVR_ECLOSED, "connection closed by the daemon (%s)",
                         strerror(-sr));
        return fatal(c, KVR_ESYS, "send: %s", strerror(-sr));
    }
    int first = 0;
    int r = read_deferred(c, n, &first);
    if (r < 0)
        return r;
    if (first < 0)
        return kvr__fail(c, first, "%s", c->defer_err);
    return 0;
}

uint64_t kvr_client_deferred_failures(const kvr_client *c, char *msg, size_t cap)
{
    if (msg && cap)
        snprintf(msg, cap, "%s", c->defer_err);
    return c->defer_failures;
}

int kvr__call(kvr_client *c, Kvrope__Request *req, const struct iovec *piov, size_t piovcnt,
              uint64_t payload_len, Kvrope__Response **out, uint64_t *resp_payload)
{
    *out = NULL;
    if (resp_payload)
        *resp_payload = 0;
    c->err[0] = 0;
    c->shm_got = false;
    uint8_t *rx = c->rx_dst;    /* kvr__place_next: for this call's own answer */
    c->rx_dst = NULL;
    Kvrope__ShmSlice sl = KVROPE__SHM_SLICE__INIT;
    if (c->shm_next) {   /* the payload is in a region: none on the socket */
        c->shm_next = false;
        sl.region = c->shm_at.region;
        sl.offset = c->shm_at.offset;
        sl.length = c->shm_at.length;
        req->shm = &sl;
        piovcnt = 0;
        payload_len = 0;
    }
    if (c->fd < 0)
        return kvr__fail(c, KVR_ECLOSED, "connection is closed");
    /* A descriptor rides on the first bytes of a write: deferred frames
     * must not go ahead of the frame it belongs to. */
    bool defer_after = resp_payload == NULL || c->send_fd >= 0;
    if (c->n_deferred && c->send_fd >= 0 && resp_payload) {
        int fr = kvr_client_flush(c);
        if (fr < 0 && c->fd < 0)
            return fr;
        c->err[0] = 0;
    }
    /* Between calls the stream is at a frame boundary: whatever is left in
     * the read-ahead belongs to no request yet (the daemon sends nothing
     * unasked but id-0 errors). */
    assert(c->rpos <= c->rlen && c->rlen <= c->rcap);
    /* The placement was consumed above (one-shot); the deferred frames fit
     * their buffer and their id table. */
    assert(!c->shm_next);
    assert(c->n_deferred <= KVR_DEFER_MAX && c->dlen <= c->dcap);
    assert(c->n_regions <= c->cap_regions);
    req->id = c->next_id++;
    size_t mlen = kvrope__request__get_packed_size(req);
    if (mlen > MAX_MSG_LEN)
        return kvr__fail(c, KVR_ETOOLARGE, "request message of %zu bytes is too large", mlen);
    size_t need = KVR_FRAME_HEADER_SIZE + mlen;
    if (need > c->wcap) {
        uint8_t *nb = realloc(c->wbuf, need);
        if (!nb)
            return kvr__fail(c, KVR_ENOMEM, "out of memory");
        c->wbuf = nb;
        c->wcap = need;
    }
    kvr_frame_header_encode(c->wbuf, (uint32_t)mlen, payload_len);
    kvrope__request__pack(req, c->wbuf + KVR_FRAME_HEADER_SIZE);

    struct iovec stack_iov[16], *iov = stack_iov;
    if (piovcnt + 2 > 16) {
        iov = malloc((piovcnt + 2) * sizeof *iov);
        if (!iov)
            return kvr__fail(c, KVR_ENOMEM, "out of memory");
    }
    /* Pipelined: the deferred frames go in the same write, after this
     * request when its answer has no payload (so both answers are usually
     * read in one recv, after one wake-up), else before it (its payload is
     * left on the socket for the caller, and nothing may follow it). */
    size_t n = 0, deferred = c->n_deferred, head = need;
    if (deferred && !defer_after) {
        iov[n].iov_base = c->dbuf;
        iov[n++].iov_len = c->dlen;
        head += c->dlen;
    }
    iov[n].iov_base = c->wbuf;
    iov[n++].iov_len = need;
    for (size_t i = 0; i < piovcnt; i++)
        if (piov[i].iov_len)
            iov[n++] = piov[i];
    if (deferred && defer_after) {
        iov[n].iov_base = c->dbuf;
        iov[n++].iov_len = c->dlen;
    }
    int sr = send_all(c, iov, n, head, payload_len);
    if (sr == 0 && deferred) {
        c->dlen = 0;
        c->n_deferred = 0;
    }
    if (sr == 0 && deferred && !defer_after) {
        int dr = read_deferred(c, deferred, NULL);
        if (dr < 0) {
            if (iov != stack_iov)
                free(iov);
            req->shm = NULL;
            return dr;
        }
    }
    req->shm = NULL;
    if (iov != stack_iov)
        free(iov);
    if (sr < 0) {
        /* The daemon may have answered (and hung up) before taking the whole
         * payload: its answer says more than EPIPE does. */
        int e = -sr;
        Kvrope__Response *resp = NULL;
        uint64_t pl = 0;
        if ((e == EPIPE || e == ECONNRESET) && recv_response(c, req->id, &resp, &pl) == 0 &&
            resp->status != KVROPE__STATUS__OK) {
            int code = kvr_error_from_status((int)resp->status);
            fatal(c, code, "%s", resp->message ? resp->message : kvr_strerror(code));
            kvrope__response__free_unpacked(resp, NULL);
            return code;
        }
        if (resp)
            kvrope__response__free_unpacked(resp, NULL);
        if (e == EAGAIN || e == EWOULDBLOCK)
            return fatal(c, KVR_ESYS, "send timed out");
        if (e == EPIPE || e == ECONNRESET)
            return fatal(c, KVR_ECLOSED, "connection closed by the daemon (%s)", strerror(e));
        return fatal(c, KVR_ESYS, "send: %s", strerror(e));
    }

    Kvrope__Response *resp = NULL;
    uint64_t pl = 0;
    c->rx_dst = rx;
    int r = recv_response(c, req->id, &resp, &pl);
    if (r < 0)
        return r;
    if (deferred && defer_after) {   /* their answers follow this one's */
        if (pl && (r = kvr__drain(c, pl)) < 0) {   /* none expected: defer_after */
            kvrope__response__free_unpacked(resp, NULL);
            return r;
        }
        pl = 0;
        if ((r = read_deferred(c, deferred, NULL)) < 0) {
            kvrope__response__free_unpacked(resp, NULL);
            return r;
        }
    }
    if (resp->status != KVROPE__STATUS__OK) {
        int code = kvr_error_from_status((int)resp->status);
        kvr__fail(c, code, "%s", resp->message && *resp->message ? resp->message
                                                              : kvr_strerror(code));
        kvrope__response__free_unpacked(resp, NULL);
        if (pl && (r = kvr__drain(c, pl)) < 0)
            return r;
        return code;
    }
    if (resp->shm) {
        c->shm_got = true;
        c->shm_res.region = resp->shm->region;
        c->shm_res.offset = resp->shm->offset;
        c->shm_res.length = resp->shm->length;
    }
    if (resp_payload)
        *resp_payload = pl;
    else if (pl && (r = kvr__drain(c, pl)) < 0) {
        kvrope__response__free_unpacked(resp, NULL);
        return r;
    }
    *out = resp;
    return 0;
}

/* ---- payload reception -------------------------------------------------- */

typedef struct layer_track {
    uint8_t        *base;
    size_t          layer_bytes;   /* K + V of one layer */
    size_t          next;          /* next layer index to announce */
    size_t          n_layers;
    const uint32_t *layers;
    kvr_layer_fn    fn;
    void           *ud;
    uint64_t        base_done;     /* bytes received before this chunk run */
    uint64_t        total;
} layer_track;

static void on_payload_chunk(kvr_client *c, void *ud, size_t done)
{
    layer_track *t = ud;
    uint64_t all = t->base_done + done;
    if (c->progress)
        c->progress(c->progress_ud, all, t->total);
    if (t->fn && t->layer_bytes) {
        while (t->next < t->n_layers && all >= (uint64_t)(t->next + 1) * t->layer_bytes) {
            uint8_t *k = t->base + t->next * t->layer_bytes;
            size_t half = t->layer_bytes / 2;
            t->fn(t->ud, (uint32_t)t->next, t->layers ? t->layers[t->next] : (uint32_t)t->next,
                  k, k + half, half);
            t->next++;
        }
    }
}

int kvr__recv_payload(kvr_client *c, uint64_t pl, kvr_kv *kv, void *dst, size_t dst_cap,
                      kvr_layer_fn fn, void *ud)
{
    if (pl > SIZE_MAX)
        return fatal(c, KVR_EPROTO, "payload too large for this process");
    size_t n = (size_t)pl;
    size_t layer_bytes = kv->n_layers ? n / kv->n_layers : 0;
    layer_track t = { .layer_bytes = layer_bytes, .n_layers = kv->n_layers,
                      .layers = kv->layers, .fn = fn, .ud = ud, .total = pl };
    if (dst) {
        if (dst_cap < n) {
            int r = kvr__drain(c, pl);
            if (r < 0)
                return r;
            return kvr__fail(c, KVR_EBUFFER, "payload of %zu bytes does not fit the "
                             "%zu-byte buffer", n, dst_cap);
        }
        t.base = dst;
        int r = recv_exact(c, dst, n, on_payload_chunk, &t);
        if (r < 0)
            return r;
        kv->payload = dst;
        kv->payload_len = n;
        kv->payload_owned = false;
        return 0;
    }
    /* Library buffer: allocate what the (already cross-checked) metadata
     * describes, but beyond DIRECT_ALLOC_MAX grow only as bytes arrive. */
    size_t cap = n < DIRECT_ALLOC_MAX ? n : DIRECT_ALLOC_MAX;
    uint8_t *buf = malloc(cap ? cap : 1);
    if (!buf) {
        int r = kvr__drain(c, pl);
        return r < 0 ? r : kvr__fail(c, KVR_ENOMEM, "cannot allocate %zu bytes", n);
    }
    size_t done = 0;
    for (;;) {
        t.base = buf;
        t.base_done = done;
        int r = recv_exact(c, buf + done, cap - done, on_payload_chunk, &t);
        if (r < 0) {
            free(buf);
            return r;
        }
        done = cap;
        if (done == n)
            break;
        size_t ncap = cap > n / 2 ? n : cap * 2;
        uint8_t *nb = realloc(buf, ncap);
        if (!nb) {
            free(buf);
            r = kvr__drain(c, pl - done);
            return r < 0 ? r : kvr__fail(c, KVR_ENOMEM, "cannot allocate %zu bytes", n);
        }
        buf = nb;
        cap = ncap;
    }
    kv->payload = buf;
    kv->payload_len = n;
    kv->payload_owned = true;
    return 0;
}

/* ---- ping --------------------------------------------------------------- */

int kvr_client_ping(kvr_client *c, kvr_pong *out)
{
    Kvrope__Ping ping = KVROPE__PING__INIT;
    KVR_REQUEST(req, PING, ping, &ping);
    Kvrope__Response *resp;
    int r = kvr__call(c, &req, NULL, 0, 0, &resp, NULL);
    if (r < 0)
        return r;
    if (resp->body_case != KVROPE__RESPONSE__BODY_PONG) {
        kvrope__response__free_unpacked(resp, NULL);
        return kvr__fail(c, KVR_EPROTO, "ping: unexpected response body");
    }
    if (out) {
        snprintf(out->server, sizeof out->server, "%s",
                 resp->pong->server ? resp->pong->server : "");
        out->protocol = resp->pong->protocol;
    }
    kvrope__response__free_unpacked(resp, NULL);
    return 0;
}
