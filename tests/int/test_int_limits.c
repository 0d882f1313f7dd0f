/*
 * test_int_limits.c — what a client can make kvroped hold stays bounded
 * (issue 12), through a real daemon:
 *  - a trickling sender: a frame must arrive within --io-timeout plus its
 *    size at --min-rate, so a put whose payload trickles in (fast enough to
 *    beat --io-timeout) is aborted and its connection closed; the context
 *    it locked (E_BUSY meanwhile) is free again and its reservation gone;
 *    a put at a normal rate is not affected;
 *  - unfinished messages of all connections are bounded by
 *    --max-msg-buffers: the connection that would pass it gets E_LIMIT and
 *    is closed, the daemon keeps serving, and the budget comes back;
 *  - models: --max-models (E_LIMIT), remove_model (E_BUSY while a context
 *    uses it, E_UNKNOWN_MODEL when absent), through libkvrope and the CLI;
 *  - contexts: --max-contexts counts creates and forks (E_LIMIT).
 * Nothing here asserts a duration: waits poll for the outcome, bounded.
 */
#include <criterion/criterion.h>

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "kvrope.pb-c.h"
#include "proto/frame.h"
#include "tests/common/kvr_testd.h"
#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_io.h"
#include "tests/common/kvt_wire.h"

static int raw_connect(const kvr_testd *d)
{
    return kvt_unix_connect(d->sock, 0);
}

/* Waits (up to ms) for the daemon to close fd; returns 1 if it did. Any
 * response bytes are read and, if one is a whole frame, *status gets its
 * status (else -1). */
static int wait_closed(int fd, int ms, int *status)
{
    uint8_t buf[4096];
    size_t have = 0;
    if (status)
        *status = -1;
    for (int waited = 0; waited < ms; waited += 50) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        if (poll(&p, 1, 50) <= 0)
            continue;
        ssize_t k = recv(fd, buf + have, sizeof buf - have, 0);
        if (k > 0) {
            have += (size_t)k;
            kvr_frame_header h;
            if (status && have >= KVR_FRAME_HEADER_SIZE &&
                kvr_frame_header_decode(buf, &h, NULL) == 0 &&
                have >= KVR_FRAME_HEADER_SIZE + h.msg_len) {
                Kvrope__Response *r = kvrope__response__unpack(NULL, h.msg_len,
                                                                buf + KVR_FRAME_HEADER_SIZE);
                if (r) {
                    *status = (int)r->status;
                    kvrope__response__free_unpacked(r, NULL);
                }
            }
            if (have == sizeof buf)
                have = 0;
            continue;
        }
        if (k == 0 || (k < 0 && errno == ECONNRESET))
            return 1;
    }
    return 0;
}

/* A put frame (header + message) for n_tok tokens appended to ctx. */
static uint8_t *put_frame(const char *ctx, size_t n_tok, size_t *len, uint64_t *plen)
{
    uint32_t *tok = testd_tokens(5000, n_tok);
    Kvrope__Put p = KVROPE__PUT__INIT;
    p.context_id = (char *)(uintptr_t)ctx;
    p.model = "m";
    p.has_mode = 1;
    p.mode = KVROPE__PUT_MODE__APPEND;
    p.has_dtype = 1;
    p.dtype = KVROPE__DTYPE__F16;
    p.n_tokens = n_tok;
    p.tokens = tok;
    Kvrope__Request q = kvt_put_request(7, &p);
    size_t m = kvrope__request__get_packed_size(&q);
    uint8_t *b = malloc(KVR_FRAME_HEADER_SIZE + m);
    kvrope__request__pack(&q, b + KVR_FRAME_HEADER_SIZE);
    *plen = kvr_payload_size(T_LAYERS, n_tok, T_HEADS, T_DIM, KVR_DTYPE_F16);
    kvr_frame_header_encode(b, (uint32_t)m, *plen);
    *len = KVR_FRAME_HEADER_SIZE + m;
    free(tok);
    return b;
}

Test(int_limits, trickled_put_is_aborted_and_frees_its_context, .timeout = 120)
{
    kvr_testd d;
    const char *args[] = { "--io-timeout", "2", "--min-rate", "64K", "--max-memory", "64M",
                           NULL };
    kvr_client *c = kvt_daemon_up_model(&d, args, "m", KVR_DTYPE_F16);
    cr_assert_eq(testd_put(c, "x", "m", KVR_DTYPE_F16, 1, 0, 0, 10), 0);

    /* A put at a normal rate of the same size is not cut. */
    cr_assert_eq(testd_put(c, "y", "m", KVR_DTYPE_F16, 2, 0, 0, 400), 0, "%s",
                 kvr_client_last_error(c));

    int fd = raw_connect(&d);
    size_t flen;
    uint64_t plen;
    uint8_t *fr = put_frame("x", 400, &flen, &plen);    /* ~150 KB: ~2.4 s at 64K/s + 2 s */
    cr_assert_eq(kvt_write_all(fd, fr, flen), 0);
    free(fr);
    /* Wait until the daemon has opened the put (x busy), without touching x. */
    kvr_context st;
    for (int i = 0; i < 400; i++) {
        cr_assert_eq(kvr_client_stat(c, "x", &st), 0);
        if (st.busy)
            break;
        kvt_sleep_ms(10);
    }
    cr_assert(st.busy, "the put was not opened");
    uint8_t chunk[256] = { 0 };
    int busy_seen = 0, closed = 0;
    uint64_t sent = 0;
    for (int i = 0; i < 400 && !closed; i++) {
        if (sent + sizeof chunk < plen && kvt_write_all(fd, chunk, sizeof chunk) == 0)
            sent += sizeof chunk;
        if (i % 4 == 0) {
            int r = kvr_client_delete(c, "x");
            if (r == KVR_EBUSY)
                busy_seen++;
            else
                cr_assert_eq(r, 0, "delete of x: %s", kvr_client_last_error(c));
            if (r == 0)
                break;     /* the daemon let go of x: the trickler was cut */
        }
        closed = wait_closed(fd, 250, NULL);
    }
    cr_assert_gt(busy_seen, 0, "the trickled put held x (E_BUSY) for a while");
    cr_assert(sent < plen, "the payload was never completed");
    if (!closed)
        closed = wait_closed(fd, 20000, NULL);
    cr_assert(closed, "a trickling sender must be cut off (--min-rate)");
    close(fd);
    /* x is free: a delete (or the one above) went through. */
    int r = kvr_client_delete(c, "x");
    cr_assert(r == 0 || r == KVR_ENOCTX, "%d: %s", r, kvr_client_last_error(c));
    cr_assert_geq(testd_metric(c, "slow_frames_closed"), 1.0);
    kvt_daemon_down(&d, &c, NULL);
}

Test(int_limits, message_buffers_are_bounded, .timeout = 120)
{
    kvr_testd d;
    const char *args[] = { "--max-frame", "128K", "--max-msg-buffers", "256K",
                           "--max-memory", "64M", NULL };
    cr_assert_eq(testd_start(&d, args), 0);
    kvr_client *c = testd_connect(&d);
    cr_assert_eq(testd_metric(c, "msg_buffer_limit_bytes"), 262144.0);
    enum { N = 6 };
    int fds[N];
    static uint8_t junk[120 * 1024];
    for (int i = 0; i < N; i++) {
        fds[i] = raw_connect(&d);
        uint8_t h[KVR_FRAME_HEADER_SIZE];
        kvr_frame_header_encode(h, (uint32_t)sizeof junk + 1000, 0);   /* never finished */
        cr_assert_eq(kvt_write_all(fds[i], h, sizeof h), 0);
        (void)kvt_write_all(fds[i], junk, sizeof junk);
    }
    int limited = 0;
    for (int i = 0; i < N; i++) {
        int st;
        if (wait_closed(fds[i], 500, &st)) {
            cr_assert_eq(st, KVROPE__STATUS__E_LIMIT, "connection %d closed with status %d",
                         i, st);
            limited++;
        }
    }
    cr_assert_geq(limited, N - 2, "at most two 120 KiB messages fit in 256 KiB");
    cr_assert_geq(testd_metric(c, "msg_buffer_refused"), (double)limited);
    cr_assert_leq(testd_metric(c, "msg_buffered_bytes"), 262144.0);
    /* The daemon serves others meanwhile. */
    cr_assert_eq(testd_register(c, "m", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_put(c, "a", "m", KVR_DTYPE_F16, 1, 0, 0, 50), 0, "%s",
                 kvr_client_last_error(c));
    for (int i = 0; i < N; i++)
        close(fds[i]);
    /* What stays is this client's own small buffer, kept between frames. */
    double left = 1e9;
    for (int i = 0; i < 200 && left > 65536; i++) {
        kvt_sleep_ms(20);
        left = testd_metric(c, "msg_buffered_bytes");
    }
    cr_assert_leq(left, 65536.0, "closed connections give their buffers back (%g left)", left);
    kvt_daemon_down(&d, &c, NULL);
}

Test(int_limits, models_limit_and_removal, .timeout = 120)
{
    kvr_testd d;
    const char *args[] = { "--max-models", "3", NULL };
    kvr_client *c = kvt_daemon_up_model(&d, args, "m1", KVR_DTYPE_F16);
    cr_assert_eq(testd_register(c, "m2", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_register(c, "m3", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_register(c, "m4", KVR_DTYPE_F16, NULL), KVR_ELIMIT);
    cr_assert(strstr(kvr_client_last_error(c), "max-models"), "%s", kvr_client_last_error(c));
    cr_assert_eq(testd_register(c, "m3", KVR_DTYPE_F16, NULL), 0, "re-registering is not new");
    cr_assert_eq(kvr_client_model_remove(c, "m3"), 0, "%s", kvr_client_last_error(c));
    cr_assert_eq(kvr_client_model_remove(c, "m3"), KVR_ENOMODEL);
    cr_assert_eq(testd_register(c, "m4", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_put(c, "ctx", "m1", KVR_DTYPE_F16, 1, 0, 0, 10), 0);
    cr_assert_eq(kvr_client_model_remove(c, "m1"), KVR_EBUSY);
    cr_assert(strstr(kvr_client_last_error(c), "1 context"), "%s", kvr_client_last_error(c));
    char out[4096];
    const char *rm[] = { "models", "rm", "m2", NULL };
    cr_assert_eq(testd_cli(&d, out, sizeof out, rm), 0, "%s", out);
    cr_assert_eq(kvr_client_delete(c, "ctx"), 0);
    cr_assert_eq(kvr_client_model_remove(c, "m1"), 0, "%s", kvr_client_last_error(c));
    kvr_model *ms;
    size_t n;
    cr_assert_eq(kvr_client_model_list(c, &ms, &n), 0);
    cr_assert_eq(n, 1);
    cr_assert_str_eq(ms[0].name, "m4");
    kvr_client_free(ms);
    cr_assert_eq(testd_put(c, "ctx2", "m1", KVR_DTYPE_F16, 1, 0, 0, 10), KVR_ENOMODEL);
    kvt_daemon_down(&d, &c, NULL);
}

Test(int_limits, contexts_limit_counts_forks, .timeout = 120)
{
    kvr_testd d;
    const char *args[] = { "--max-contexts", "4", NULL };
    kvr_client *c = kvt_daemon_up_model(&d, args, "m", KVR_DTYPE_F16);
    cr_assert_eq(testd_put(c, "a", "m", KVR_DTYPE_F16, 1, 0, 0, 1), 0);
    cr_assert_eq(kvr_client_fork(c, "a", "b"), 0);
    cr_assert_eq(kvr_client_fork(c, "a", "c"), 0);
    cr_assert_eq(testd_put(c, "d", "m", KVR_DTYPE_F16, 1, 0, 0, 1), 0);
    cr_assert_eq(kvr_client_fork(c, "a", "e"), KVR_ELIMIT);
    cr_assert(strstr(kvr_client_last_error(c), "max-contexts"), "%s", kvr_client_last_error(c));
    cr_assert_eq(testd_put(c, "f", "m", KVR_DTYPE_F16, 1, 0, 0, 1), KVR_ELIMIT);
    cr_assert_eq(testd_put(c, "a", "m", KVR_DTYPE_F16, 2, 1, 1, 3), 0, "appending is not new");
    cr_assert_eq(kvr_client_ping(c, NULL), 0, "E_LIMIT keeps the connection");
    cr_assert_eq(kvr_client_delete(c, "b"), 0);
    cr_assert_eq(kvr_client_fork(c, "a", "e"), 0);
    cr_assert_eq(testd_metric(c, "contexts"), 4.0);
    kvt_daemon_down(&d, &c, NULL);
}
