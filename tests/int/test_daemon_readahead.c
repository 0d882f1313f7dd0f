/*
 * test_daemon_readahead.c — the daemon's read-ahead socket path (conn.c:
 * a header read with up to 4 KiB after it, frames fed from that buffer, a
 * put's last payload read taking what follows, descriptors attributed to
 * the frames of their read), attacked over a raw Unix socket against a real
 * kvroped: pipelined mixes of requests written in every chunking (one byte
 * at a time, random sizes, whole), under a tiny --max-conn-buffer so back
 * pressure stops the feed mid-buffer, stray descriptors on every kind of
 * frame, and one connection flooding pipelined frames beside another.
 * Every reply is checked (id, status, payload). Nothing here measures time:
 * a hang fails on the sockets' receive timeout.
 */
#include <criterion/criterion.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvrope.pb-c.h"
#include "proto/frame.h"

#include "tests/common/kvr_rawd.h"
#include "tests/common/kvt.h"

/* ---- a pipelined script and its expected replies ---------------------------- */

typedef struct expect {
    uint64_t id;
    int status;          /* -1: any error (not OK) */
    const void *payload; /* checked when non-NULL */
    size_t plen;
} expect;

typedef struct script {
    uint8_t *buf;
    size_t len, cap;
    expect *ex;
    size_t n_ex, cap_ex;
    uint64_t id;
} script;

static void sc_frame(script *s, Kvrope__Request *q, const void *payload, size_t plen,
                     int status, const void *want, size_t wlen)
{
    q->id = s->id++;
    size_t n = kvrope__request__get_packed_size(q);
    size_t need = s->len + KVR_FRAME_HEADER_SIZE + n + plen;
    if (need > s->cap) {
        s->cap = need * 2;
        s->buf = realloc(s->buf, s->cap);
        cr_assert_not_null(s->buf);
    }
    kvrope__request__pack(q, s->buf + s->len + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(s->buf + s->len, (uint32_t)n, plen);
    s->len += KVR_FRAME_HEADER_SIZE + n;
    if (plen)
        memcpy(s->buf + s->len, payload, plen);
    s->len += plen;
    if (s->n_ex == s->cap_ex) {
        s->cap_ex = s->cap_ex ? s->cap_ex * 2 : 64;
        s->ex = realloc(s->ex, s->cap_ex * sizeof *s->ex);
        cr_assert_not_null(s->ex);
    }
    s->ex[s->n_ex++] = (expect){ q->id, status, want, wlen };
}

static void sc_ping(script *s)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__Ping p = KVROPE__PING__INIT;
    q.body_case = KVROPE__REQUEST__BODY_PING;
    q.ping = &p;
    sc_frame(s, &q, NULL, 0, KVROPE__STATUS__OK, NULL, 0);
}

static void sc_get(script *s, const char *ctx, int status, const void *want, size_t wlen)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__Get g = KVROPE__GET__INIT;
    g.context_id = (char *)(uintptr_t)ctx;
    g.has_dtype = 1;
    g.dtype = KVROPE__DTYPE__F16;
    q.body_case = KVROPE__REQUEST__BODY_GET;
    q.get = &g;
    sc_frame(s, &q, NULL, 0, status, want, wlen);
}

static void sc_delete(script *s, const char *ctx)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__Delete dl = KVROPE__DELETE__INIT;
    dl.context_id = (char *)(uintptr_t)ctx;
    q.body_case = KVROPE__REQUEST__BODY_DELETE;
    q.delete_ = &dl;
    sc_frame(s, &q, NULL, 0, KVROPE__STATUS__OK, NULL, 0);
}

static uint32_t TOKS[128];

static void sc_put(script *s, const char *ctx, const char *model, Kvrope__DType dt,
                   const void *payload, size_t ntok, int status)
{
    Kvrope__Request q;
    Kvrope__Put p;
    make_put(&q, &p, ctx, TOKS, ntok, KVROPE__PUT_MODE__CREATE);
    p.model = (char *)(uintptr_t)model;
    p.dtype = dt;
    size_t plen = payload_bytes(ntok) * (dt == KVROPE__DTYPE__F32 ? 2 : 1);
    sc_frame(s, &q, payload, plen, status, NULL, 0);
}

static void sc_free(script *s)
{
    free(s->buf);
    free(s->ex);
    memset(s, 0, sizeof *s);
}

/* Small (one request and a put in the read-ahead), big (a payload past the
 * read-ahead) and f32 (converted on the threadpool: the feed stops at a
 * request still running) puts, gets with a payload out, errors answered at
 * once, an error whose payload is drained, pings and deletes. */
enum { TS = 5, TB = 100 };
static uint16_t *P16S, *P16B;
static float *P32;

static void payloads(void)
{
    for (size_t i = 0; i < 128; i++)
        TOKS[i] = (uint32_t)(i + 1);
    P16S = malloc(payload_bytes(TS));
    P16B = malloc(payload_bytes(TB));
    fill_payload(P16S, TS, 3);
    fill_payload(P16B, TB, 11);
    size_t n32 = payload_bytes(TS) * 2 / 4;
    P32 = malloc(n32 * 4);
    for (size_t i = 0; i < n32; i++)
        P32[i] = 1.0f + (float)(i % 256) / 256.0f;
}

static void build_mix(script *s, int rounds, unsigned tag)
{
    for (int k = 0; k < rounds; k++) {
        char a[32], b[32], f[32];
        snprintf(a, sizeof a, "s%u_%d", tag, k);
        snprintf(b, sizeof b, "b%u_%d", tag, k);
        snprintf(f, sizeof f, "f%u_%d", tag, k);
        sc_put(s, a, "tiny", KVROPE__DTYPE__F16, P16S, TS, KVROPE__STATUS__OK);
        sc_ping(s);
        sc_get(s, a, KVROPE__STATUS__OK, P16S, payload_bytes(TS));
        sc_put(s, b, "tiny", KVROPE__DTYPE__F16, P16B, TB, KVROPE__STATUS__OK);
        sc_get(s, b, KVROPE__STATUS__OK, P16B, payload_bytes(TB));
        sc_put(s, f, "tiny", KVROPE__DTYPE__F32, P32, TS, KVROPE__STATUS__OK);
        sc_ping(s);
        sc_get(s, "nope", KVROPE__STATUS__E_UNKNOWN_CONTEXT, NULL, 0);
        /* refused before its payload is read: the payload is drained */
        sc_put(s, "x", "no-such-model", KVROPE__DTYPE__F16, P16B, TB, -1);
        sc_get(s, f, KVROPE__STATUS__OK, NULL, 0);
        sc_delete(s, f);
        sc_delete(s, a);
        sc_delete(s, b);
        sc_ping(s);
    }
}

/* ---- a writer thread: the script in chunks of a given shape ------------------ */

typedef struct writer {
    int fd;
    const uint8_t *buf;
    size_t len;
    int mode;           /* 0: one byte at a time, 1: 1..64, 2: 1..9000, 3: whole */
    unsigned seed;
    int rc;
} writer;

static void *writer_main(void *arg)
{
    writer *w = arg;
    size_t off = 0;
    unsigned r = w->seed;
    w->rc = 0;
    while (off < w->len) {
        size_t k;
        r = r * 1103515245u + 12345u;
        switch (w->mode) {
        case 0:
            k = 1;
            break;
        case 1:
            k = 1 + (r >> 16) % 64;
            break;
        case 2:
            k = 1 + (r >> 8) % 9000;
            break;
        default:
            k = w->len - off;
            break;
        }
        if (k > w->len - off)
            k = w->len - off;
        if (kvt_write_all(w->fd, w->buf + off, k) != 0) {
            w->rc = -1;
            return NULL;
        }
        off += k;
        if ((r >> 4) % 8 == 0)
            sched_yield();   /* let the daemon read what is there: more splits */
    }
    return NULL;
}

static void check_replies(int fd, const script *s)
{
    for (size_t i = 0; i < s->n_ex; i++) {
        const expect *e = &s->ex[i];
        uint8_t *got = NULL;
        uint64_t glen = 0;
        Kvrope__Response *r = recv_resp(fd, &got, &glen);
        cr_assert_eq(r->id, e->id, "reply %zu: id %llu where %llu was due (status %d: %s)", i,
                     (unsigned long long)r->id, (unsigned long long)e->id, (int)r->status,
                     r->message);
        if (e->status < 0)
            cr_assert_neq(r->status, KVROPE__STATUS__OK, "reply %zu should be an error", i);
        else
            cr_assert_eq((int)r->status, e->status, "reply %zu (id %llu): status %d: %s", i,
                         (unsigned long long)e->id, (int)r->status, r->message);
        if (e->payload) {
            cr_assert_eq(glen, e->plen, "reply %zu: %llu payload bytes, %zu due", i,
                         (unsigned long long)glen, e->plen);
            cr_assert_arr_eq(got, e->payload, e->plen, "reply %zu: payload differs", i);
        }
        free(got);
        kvrope__response__free_unpacked(r, NULL);
    }
}

static void run_chunked(int fd, int mode, unsigned seed, int rounds)
{
    script s = { 0 };
    s.id = 1000;
    build_mix(&s, rounds, seed);
    writer w = { .fd = fd, .buf = s.buf, .len = s.len, .mode = mode, .seed = seed };
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, writer_main, &w), 0);
    check_replies(fd, &s);
    pthread_join(th, NULL);
    cr_assert_eq(w.rc, 0, "the writer failed");
    sc_free(&s);
}

TestSuite(daemon_readahead, .init = setup, .fini = teardown, .timeout = 240);

/* Every chunking of the same pipelined mix: one byte at a time (a header
 * split at every byte, a message split, a payload split), random small and
 * large chunks (several frames and a partial one in one read), and the whole
 * script in one write; each on its own connection, then the write side
 * shut: EOF after the last reply. */
Test(daemon_readahead, pipelined_mix_in_every_chunking)
{
    payloads();
    start_daemon(NULL);
    for (int mode = 0; mode < 4; mode++) {
        for (unsigned seed = 1; seed <= (mode == 0 || mode == 3 ? 1u : 3u); seed++) {
            int fd = connect_unix(D.sock);
            cr_assert_geq(fd, 0);
            register_model(fd);
            run_chunked(fd, mode, seed * 10 + (unsigned)mode, mode == 0 ? 2 : 4);
            cr_assert_eq(shutdown(fd, SHUT_WR), 0);
            expect_eof(fd);
            close(fd);
        }
    }
    stop_daemon_clean();
}

/* The same under back pressure: --max-conn-buffer 4 KiB is less than one
 * get's reply, so the feed stops after every get with frames left in the
 * read-ahead, and must go on once the reply is out, however it went out
 * (written at once or by a write callback). */
Test(daemon_readahead, pipelined_mix_under_back_pressure)
{
    payloads();
    const char *extra[] = { "--max-conn-buffer", "4096", NULL };
    start_daemon(extra);
    for (int mode = 1; mode < 4; mode++) {
        int fd = connect_unix(D.sock);
        cr_assert_geq(fd, 0);
        register_model(fd);
        run_chunked(fd, mode, 77u + (unsigned)mode, 4);
        cr_assert_eq(shutdown(fd, SHUT_WR), 0);
        expect_eof(fd);
        close(fd);
    }
    stop_daemon_clean();
}

/* ---- fairness: a flood of pipelined frames beside a quiet connection -------- */

typedef struct flood {
    int fd;
    atomic_bool stop;
    size_t sent;
    atomic_size_t answered;
} flood;

static void *flood_writer(void *arg)
{
    flood *f = arg;
    script s = { 0 };
    s.id = 1;
    for (int i = 0; i < 256; i++)
        sc_ping(&s);
    while (!atomic_load(&f->stop)) {
        if (kvt_write_all(f->fd, s.buf, s.len) != 0)
            break;
        f->sent += s.n_ex;
    }
    sc_free(&s);
    shutdown(f->fd, SHUT_WR);
    return NULL;
}

static void *flood_reader(void *arg)
{
    flood *f = arg;
    uint8_t b[65536];
    for (;;) {
        ssize_t k = read(f->fd, b, sizeof b);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        atomic_fetch_add(&f->answered, (size_t)k);
    }
    return NULL;
}

/* Waits up to 10 s for the flood's answers to pass `above` bytes. */
static bool flood_answered_past(flood *f, size_t above)
{
    for (int i = 0; i < 10000; i++) {
        if (atomic_load(&f->answered) > above)
            return true;
        usleep(1000);
    }
    return false;
}

/* One connection writes pipelined pings as fast as it can (the daemon's
 * read-ahead always has frames left); another connection's requests are
 * still answered, each within the socket's receive timeout. The quiet
 * connection starts only once the flood is being answered (else its 200 pings
 * can all be done before the flood's thread has run), and the flood is still
 * answered after them. */
Test(daemon_readahead, a_flood_of_pipelined_frames_starves_no_other_connection)
{
    start_daemon(NULL);
    flood f = { .fd = connect_unix(D.sock) };
    cr_assert_geq(f.fd, 0);
    atomic_init(&f.stop, false);
    pthread_t tw, tr;
    cr_assert_eq(pthread_create(&tr, NULL, flood_reader, &f), 0);
    cr_assert_eq(pthread_create(&tw, NULL, flood_writer, &f), 0);
    cr_assert(flood_answered_past(&f, 0), "the flood was never answered");
    int fd = connect_unix(D.sock);
    cr_assert_geq(fd, 0);
    for (uint64_t i = 0; i < 200; i++)
        cr_assert_eq(ping(fd, 5000 + i), KVROPE__STATUS__OK);
    size_t mid = atomic_load(&f.answered);
    cr_assert(flood_answered_past(&f, mid), "the flood stopped being answered");
    atomic_store(&f.stop, true);
    pthread_join(tw, NULL);
    pthread_join(tr, NULL);
    close(f.fd);
    close(fd);
    stop_daemon_clean();
}

/* ---- descriptors: strays on every kind of read, none kept --------------------- */

/* Writes buf[0..len) with nfd copies of fd attached (SCM_RIGHTS). */
static void send_fds(int fd, const void *buf, size_t len, int pass, int nfd)
{
    cr_assert_eq(kvt_send_fds(fd, buf, len, pass, nfd), (ssize_t)len);
}

static void wait_fds_at_most(int limit)
{
    for (int i = 0; i < 200 && kvt_count_fds(D.pid) > limit; i++)
        kvt_sleep_ms(20);
}

/* Reads c until the daemon closes it (10 s at most); true when it did and
 * what came before the close says why (an error about descriptors). */
static bool refused_then_closed(int c)
{
    struct timeval tv = { 10, 0 };
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    static char buf[1 << 16];
    size_t n = 0;
    for (;;) {
        ssize_t r = read(c, buf + n, sizeof buf - 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r == 0 && memmem(buf, n, "descriptor", 10) != NULL;
        n += (size_t)r;
        if (n == sizeof buf - 1)
            n = 0;
    }
}

/* c was refused and closed (refused_then_closed) in round `round` of the
 * case `what`: closes c and frees its script. */
static void closed_after_fds(int c, script *s, int round, const char *what)
{
    cr_assert(refused_then_closed(c), "round %d: %s", round, what);
    close(c);
    sc_free(s);
}

/* A hostile peer attaches descriptors to a ping, to a put's header (its
 * payload past the read-ahead), to a put's payload bytes alone, to the
 * bytes after a put's payload, several at once (the daemon's rule,
 * daemon/conn.c: a frame other than register_region takes none): each such
 * connection gets an error saying why and is closed, a put it carried
 * stores nothing, the daemon holds no descriptor more than before, and
 * every other connection carries on. Then two RegisterRegions in one write
 * with one descriptor: the first has it, the second is refused. */
Test(daemon_readahead, stray_descriptors_on_every_kind_of_read)
{
    payloads();
    const char *extra[] = { "--max-regions", "4", "--max-region-bytes", "64M", NULL };
    start_daemon(extra);
    int fd = connect_unix(D.sock);
    cr_assert_geq(fd, 0);
    register_model(fd);
    cr_assert_eq(ping(fd, 1), KVROPE__STATUS__OK);
    int before = kvt_count_fds(D.pid);
    int mfd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    cr_assert_geq(mfd, 0);
    cr_assert_eq(ftruncate(mfd, 4096), 0);
    cr_assert_eq(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    for (int round = 0; round < 4; round++) {
        script s = { 0 };
        /* 1. several fds on a lone ping */
        int c = connect_unix(D.sock);
        s.id = 100;
        sc_ping(&s);
        send_fds(c, s.buf, s.len, mfd, 8);
        closed_after_fds(c, &s, round, "fds on a ping");
        /* 2. on a put's header; its payload is past the read-ahead */
        c = connect_unix(D.sock);
        s.id = 200;
        sc_put(&s, "big", "tiny", KVROPE__DTYPE__F16, P16B, TB, KVROPE__STATUS__OK);
        send_fds(c, s.buf, 64, mfd, 2);
        if (kvt_write_all(c, s.buf + 64, s.len - 64) != 0) {
        }
        closed_after_fds(c, &s, round, "fds on a put's header");
        /* 3. on the payload bytes alone, with a ping after it in the same write */
        c = connect_unix(D.sock);
        s.id = 300;
        sc_put(&s, "big", "tiny", KVROPE__DTYPE__F16, P16B, TB, KVROPE__STATUS__OK);
        size_t cut = s.len - payload_bytes(TB) + 100;
        sc_ping(&s);
        cr_assert_eq(kvt_write_all(c, s.buf, cut), 0);
        kvt_sleep_ms(5);   /* likelier that the daemon is reading the payload now */
        send_fds(c, s.buf + cut, s.len - cut, mfd, 3);
        closed_after_fds(c, &s, round, "fds on a payload");
        /* Neither put stored anything. */
        s.id = 350;
        sc_get(&s, "big", KVROPE__STATUS__E_UNKNOWN_CONTEXT, NULL, 0);
        cr_assert_eq(kvt_write_all(fd, s.buf, s.len), 0);
        check_replies(fd, &s);
        sc_free(&s);
        /* 4. on the bytes after a put's payload: a ping and a get */
        c = connect_unix(D.sock);
        s.id = 400;
        sc_put(&s, "big4", "tiny", KVROPE__DTYPE__F16, P16B, TB, KVROPE__STATUS__OK);
        cut = s.len;
        sc_ping(&s);
        sc_get(&s, "big4", KVROPE__STATUS__OK, P16B, payload_bytes(TB));
        cr_assert_eq(kvt_write_all(c, s.buf, cut), 0);
        send_fds(c, s.buf + cut, s.len - cut, mfd, 1);
        closed_after_fds(c, &s, round, "fds after a payload");
        s.id = 500;
        sc_delete(&s, "big4");
        cr_assert_eq(kvt_write_all(fd, s.buf, s.len), 0);
        uint8_t *got = NULL;
        uint64_t glen = 0;
        Kvrope__Response *r = recv_resp(fd, &got, &glen);   /* stored or not: racy */
        free(got);
        kvrope__response__free_unpacked(r, NULL);
        sc_free(&s);
        cr_assert_eq(ping(fd, 3), KVROPE__STATUS__OK, "the other connection carries on");
        wait_fds_at_most(before);
        cr_assert_leq(kvt_count_fds(D.pid), before, "round %d: the daemon kept descriptors: %d -> %d",
                      round, before, kvt_count_fds(D.pid));
    }
    /* 5. two RegisterRegions in one write, one fd: the first has it, the
     *    second is refused; both answered */
    {
        script s = { 0 };
        s.id = 600;
        Kvrope__Request q = KVROPE__REQUEST__INIT;
        Kvrope__RegisterRegion rr = KVROPE__REGISTER_REGION__INIT;
        rr.size = 4096;
        q.body_case = KVROPE__REQUEST__BODY_REGISTER_REGION;
        q.register_region = &rr;
        sc_frame(&s, &q, NULL, 0, KVROPE__STATUS__OK, NULL, 0);
        sc_frame(&s, &q, NULL, 0, -1, NULL, 0);
        sc_ping(&s);
        send_fds(fd, s.buf, s.len, mfd, 1);
        check_replies(fd, &s);
        sc_free(&s);
    }
    close(mfd);
    cr_assert_eq(ping(fd, 2), KVROPE__STATUS__OK);
    close(fd);
    wait_fds_at_most(before - 1);
    cr_assert_leq(kvt_count_fds(D.pid), before - 1, "after the close: %d -> %d", before,
                  kvt_count_fds(D.pid));
    stop_daemon_clean();
}

/* ---- timing of a frame that waited in the read-ahead -------------------------- */

/* A frame's --min-rate deadline runs from when the daemon takes it up: a
 * put whose header waited in the read-ahead behind replies the client was
 * slow to read (back pressure: 32 pipelined gets of 512 KiB, more than the
 * socket holds, and --max-conn-buffer 4 KiB) is not timed from the read
 * that brought its bytes, seconds earlier. Here the client reads the
 * replies 3 s late (under --io-timeout 4: they are progressing), then
 * sends the rest of the put 2 s later: within its deadline counted from
 * when the put was taken up (4 s), past it counted from the read (5 s). */
Test(daemon_readahead, a_frame_read_ahead_is_timed_from_when_it_is_taken_up)
{
    payloads();
    const char *extra[] = { "--io-timeout", "4", "--min-rate", "1G", "--max-conn-buffer",
                            "4096", NULL };
    start_daemon(extra);
    int fd = connect_unix(D.sock);
    cr_assert_geq(fd, 0);
    register_model(fd);
    enum { NB = 8192, NG = 32 };
    uint32_t *tok = malloc(NB * sizeof *tok);
    for (uint32_t i = 0; i < NB; i++)
        tok[i] = i + 1;
    uint16_t *big = malloc(payload_bytes(NB));
    fill_payload(big, NB, 5);
    Kvrope__Request q;
    Kvrope__Put p;
    make_put(&q, &p, "big", tok, NB, KVROPE__PUT_MODE__CREATE);
    send_req(fd, &q, big, payload_bytes(NB));
    Kvrope__Response *r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "%s", r->message);
    kvrope__response__free_unpacked(r, NULL);

    script s = { 0 };
    s.id = 10;
    for (int i = 0; i < NG; i++)
        sc_get(&s, "big", KVROPE__STATUS__OK, big, payload_bytes(NB));
    sc_put(&s, "p2", "tiny", KVROPE__DTYPE__F16, P16S, TS, KVROPE__STATUS__OK);
    size_t cut = s.len - payload_bytes(TS) + 100;
    cr_assert_lt(cut, 4096);   /* one read-ahead holds it all */
    cr_assert_eq(kvt_write_all(fd, s.buf, cut), 0);
    kvt_sleep_ms(3000);
    for (int i = 0; i < NG; i++) {
        uint8_t *got = NULL;
        uint64_t glen = 0;
        r = recv_resp(fd, &got, &glen);
        cr_assert_eq(r->id, 10 + (uint64_t)i);
        cr_assert_eq(r->status, KVROPE__STATUS__OK, "%s", r->message);
        cr_assert_eq(glen, payload_bytes(NB));
        cr_assert_arr_eq(got, big, glen);
        free(got);
        kvrope__response__free_unpacked(r, NULL);
    }
    kvt_sleep_ms(2000);
    cr_assert_eq(kvt_write_all(fd, s.buf + cut, s.len - cut), 0, "the put was cut off");
    r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->id, 10 + NG);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "%s", r->message);
    kvrope__response__free_unpacked(r, NULL);
    sc_free(&s);
    free(big);
    free(tok);
    close(fd);
    stop_daemon_clean();
}
