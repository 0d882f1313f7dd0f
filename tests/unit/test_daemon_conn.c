/*
 * test_daemon_conn.c — connection state machine paths that need the daemon
 * in-process (a socketpair adopted with kvr_daemon_adopt_fd, the loop run
 * with kvr_daemon_run_nowait): here, a reply write that fails at once.
 * Memory is checked through kvr_mem_allocated, which protobuf-c's and
 * libuv's allocations go through too.
 */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "daemon/daemon_internal.h"
#include "tests/common/kvt_wire.h"
#include "tests/common/kvt_inproc.h"

static void sleep_ms(int ms)
{
    struct timespec ts = { 0, (long)ms * 1000000L };
    nanosleep(&ts, NULL);
}

static void spin(kvr_daemon *d, int n)
{
    for (int i = 0; i < n; i++) {
        kvr_daemon_run_nowait(d);
        sleep_ms(1);
    }
}

static kvr_daemon *start(void)
{
    signal(SIGPIPE, SIG_IGN);
    kvr_daemon_init_allocator();
    kvr_daemon_config cfg;
    kvt_inproc_config(&cfg);
    kvr_daemon *d = NULL;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_daemon_create(&d, &cfg, &err), 0, "%s", err.msg);
    return d;
}

/* Connects a socketpair; returns the client end. */
static int adopt(kvr_daemon *d)
{
    int sv[2];
    cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    cr_assert_eq(kvr_daemon_adopt_fd(d, sv[0]), 0);
    spin(d, 3);
    return sv[1];
}

static void wait_closed(kvr_daemon *d)
{
    for (int i = 0; i < 2000 && kvr_daemon_connections(d) > 0; i++)
        spin(d, 1);
    cr_assert_eq(kvr_daemon_connections(d), 0, "the connection was not closed");
    spin(d, 3);
}

/* A put refused before its payload (unknown model) has the payload drained,
 * then its error reply written; if that write fails at once the connection
 * closes while BUSY. The request must still be freed (it leaked). */
Test(daemon_conn, drained_refusal_whose_reply_write_fails_frees_the_request, .timeout = 60)
{
    kvr_daemon *d = start();
    /* Warm up: the loop's per-fd tables grow once and stay. */
    int w = adopt(d);
    close(w);
    wait_closed(d);
    size_t base = kvr_mem_allocated();

    int fd = adopt(d);
    uint32_t tok[1] = { 1 };
    Kvrope__Put p = KVROPE__PUT__INIT;
    p.context_id = "c";
    p.model = "no-such-model";
    p.n_tokens = 1;
    p.tokens = tok;
    Kvrope__Request q = kvt_put_request(5, &p);
    uint8_t buf[512], payload[64] = { 0 };
    size_t n = kvrope__request__pack(&q, buf + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(buf, (uint32_t)n, sizeof payload);
    cr_assert_eq(write(fd, buf, KVR_FRAME_HEADER_SIZE + n), (ssize_t)(KVR_FRAME_HEADER_SIZE + n));
    spin(d, 10);                        /* refused: now draining */
    kvr__conn_test_write_failures = 1;   /* the pending reply's write fails */
    cr_assert_eq(write(fd, payload, sizeof payload), (ssize_t)sizeof payload);
    wait_closed(d);
    cr_assert_eq(kvr__conn_test_write_failures, 0, "the reply was never written");
    close(fd);
    spin(d, 3);
    cr_assert_eq(kvr_mem_allocated(), base, "%zu bytes leaked",
                 kvr_mem_allocated() - base);
    kvr_daemon_destroy(d);
}
