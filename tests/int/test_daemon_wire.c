/*
 * test_daemon_wire.c — starts a real kvroped ($KVR_BUILD/kvroped, else
 * ./build/kvroped) on a temporary socket and speaks raw frames to it, built
 * with the generated protobuf-c code (no client library). Every socket has a
 * receive timeout and every daemon is killed at teardown, so a hang fails a
 * test instead of stalling the run. Nothing here measures time.
 */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* ---- tests ---------------------------------------------------------------------- */

TestSuite(daemon_wire, .init = setup, .fini = teardown, .timeout = 120);

/* Writes len bytes of frame to fd, expects one response with status st,
 * then the daemon's close, and closes fd. */
static void refused_then_closed(int fd, const void *frame, size_t len, Kvrope__Status st)
{
    cr_assert_eq(kvt_write_all(fd, frame, len), 0);
    Kvrope__Response *r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->status, st, "status %d, want %d", r->status, st);
    kvrope__response__free_unpacked(r, NULL);
    expect_eof(fd);
    close(fd);
}

/* Closes fd, stops the daemon (it must exit cleanly). */
static void close_and_stop(int fd)
{
    close(fd);
    stop_daemon_clean();
}

/* The daemon still answers a ping on fd: close it, stop the daemon (it
 * must exit cleanly). */
static void answers_then_stop(int fd, uint64_t id)
{
    cr_assert_eq(ping(fd, id), KVROPE__STATUS__OK);
    close_and_stop(fd);
}

/* A frame header alone, announcing msg_len bytes of message and plen of
 * payload, refused with st and then closed (refused_then_closed). */
static void header_refused(int fd, uint32_t msg_len, uint64_t plen, Kvrope__Status st)
{
    uint8_t h[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(h, msg_len, plen);
    refused_then_closed(fd, h, sizeof h, st);
}

/* Starts the daemon with extra args; a connection to it. */
static int start_and_connect(const char *const *extra)
{
    start_daemon(extra);
    return connect_unix(D.sock);
}

/* Sends q (with plen bytes of payload) and reads its reply. */
static Kvrope__Response *request(int fd, Kvrope__Request *q, const void *payload, uint64_t plen,
                                 uint8_t **got, uint64_t *glen)
{
    send_req(fd, q, payload, plen);
    return recv_resp(fd, got, glen);
}

/* The status of q's reply (sent with plen bytes of payload). */
static Kvrope__Status request_status(int fd, Kvrope__Request *q, const void *payload, uint64_t plen)
{
    Kvrope__Response *r = request(fd, q, payload, plen, NULL, NULL);
    Kvrope__Status st = r->status;
    kvrope__response__free_unpacked(r, NULL);
    return st;
}

/* A Stat of ctx (request id 301), asserted OK; the caller frees the reply. */
static Kvrope__Response *stat_ok(int fd, const char *ctx)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__Stat s = KVROPE__STAT__INIT;
    s.context_id = (char *)(uintptr_t)ctx;
    q.id = 301;
    q.body_case = KVROPE__REQUEST__BODY_STAT;
    q.stat = &s;
    Kvrope__Response *r = request(fd, &q, NULL, 0, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__OK);
    return r;
}

Test(daemon_wire, ping_and_pipelining)
{
    int fd = start_and_connect(NULL);
    cr_assert_geq(fd, 0);
    cr_assert_eq(ping(fd, 1), KVROPE__STATUS__OK);
    /* Three requests in one write; three responses, in order. */
    uint8_t all[1024];
    size_t off = 0;
    for (uint64_t id = 10; id < 13; id++) {
        Kvrope__Request q = KVROPE__REQUEST__INIT;
        Kvrope__Ping p = KVROPE__PING__INIT;
        q.id = id;
        q.body_case = KVROPE__REQUEST__BODY_PING;
        q.ping = &p;
        size_t n = kvrope__request__pack(&q, all + off + KVR_FRAME_HEADER_SIZE);
        kvr_frame_header_encode(all + off, (uint32_t)n, 0);
        off += KVR_FRAME_HEADER_SIZE + n;
    }
    cr_assert_eq(kvt_write_all(fd, all, off), 0);
    for (uint64_t id = 10; id < 13; id++) {
        Kvrope__Response *r = recv_resp(fd, NULL, NULL);
        cr_assert_eq(r->id, id);
        cr_assert_eq(r->status, KVROPE__STATUS__OK);
        kvrope__response__free_unpacked(r, NULL);
    }
    close_and_stop(fd);
}

/* Makes q (request id) a get of ctx through g, both initialised. */
static void make_get(Kvrope__Request *q, Kvrope__Get *g, const char *ctx, uint64_t id)
{
    kvrope__request__init(q);
    kvrope__get__init(g);
    g->context_id = (char *)(uintptr_t)ctx;
    q->id = id;
    q->body_case = KVROPE__REQUEST__BODY_GET;
    q->get = g;
}

/* Appends one frame (request q, then payload) to buf at *off. */
static void frame_into(uint8_t *buf, size_t cap, size_t *off, Kvrope__Request *q,
                       const void *payload, size_t plen)
{
    size_t n = kvrope__request__get_packed_size(q);
    cr_assert_leq(*off + KVR_FRAME_HEADER_SIZE + n + plen, cap);
    kvrope__request__pack(q, buf + *off + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(buf + *off, (uint32_t)n, plen);
    *off += KVR_FRAME_HEADER_SIZE + n;
    if (plen)
        memcpy(buf + *off, payload, plen);
    *off += plen;
}

/* Many requests in one write, more than the daemon holds back before
 * writing (its cork), mixing ones answered at once, ones with a payload in
 * (f16 puts straight into blocks, f32 puts converted on the threadpool),
 * gets with a payload out and errors; then the write side is shut: every
 * answer comes, in order, with the right data, then EOF. */
Test(daemon_wire, pipelined_batch_answered_in_order_after_half_close)
{
    int fd = start_and_connect(NULL);
    register_model(fd);
    enum { T = 5, ROUNDS = 12 };
    uint32_t toks[T] = { 1, 2, 3, 4, 5 };
    size_t n16 = payload_bytes(T), n32 = n16 * 2;
    uint16_t *p16 = malloc(n16);
    fill_payload(p16, T, 9);
    float *p32 = malloc(n32);
    for (size_t i = 0; i < n32 / 4; i++)
        p32[i] = 1.0f + (float)(i % 512) / 512.0f;
    size_t cap = ROUNDS * (n16 + n32 + 2048), off = 0;
    uint8_t *all = malloc(cap);
    uint64_t id = 1000;
    for (int k = 0; k < ROUNDS; k++) {
        char ctx[2][32];
        snprintf(ctx[0], sizeof ctx[0], "h%d", k);
        snprintf(ctx[1], sizeof ctx[1], "f%d", k);
        Kvrope__Request q;
        Kvrope__Put p;
        make_put(&q, &p, ctx[0], toks, T, KVROPE__PUT_MODE__CREATE);
        q.id = id++;
        frame_into(all, cap, &off, &q, p16, n16);
        make_put(&q, &p, ctx[1], toks, T, KVROPE__PUT_MODE__CREATE);
        p.dtype = KVROPE__DTYPE__F32;
        q.id = id++;
        frame_into(all, cap, &off, &q, p32, n32);
        Kvrope__Get g;
        make_get(&q, &g, ctx[0], id++);
        frame_into(all, cap, &off, &q, NULL, 0);
        g.context_id = "nope";
        q.id = id++;
        frame_into(all, cap, &off, &q, NULL, 0);
        Kvrope__Delete dl = KVROPE__DELETE__INIT;
        dl.context_id = ctx[1];
        kvrope__request__init(&q);
        q.id = id++;
        q.body_case = KVROPE__REQUEST__BODY_DELETE;
        q.delete_ = &dl;
        frame_into(all, cap, &off, &q, NULL, 0);
    }
    cr_assert_eq(kvt_write_all(fd, all, off), 0);
    cr_assert_eq(shutdown(fd, SHUT_WR), 0);
    id = 1000;
    for (int k = 0; k < ROUNDS; k++) {
        for (int j = 0; j < 5; j++, id++) {
            uint8_t *got = NULL;
            uint64_t glen = 0;
            Kvrope__Response *r = recv_resp(fd, &got, &glen);
            cr_assert_eq(r->id, id, "answer %llu where %llu was due", (unsigned long long)r->id,
                         (unsigned long long)id);
            if (j == 3) {
                cr_assert_eq(r->status, KVROPE__STATUS__E_UNKNOWN_CONTEXT);
            } else {
                cr_assert_eq(r->status, KVROPE__STATUS__OK, "request %d: %s", j, r->message);
            }
            if (j == 2) {
                cr_assert_eq(glen, n16);
                cr_assert_arr_eq(got, p16, n16);
            } else {
                cr_assert_eq(glen, 0);
            }
            free(got);
            kvrope__response__free_unpacked(r, NULL);
        }
    }
    expect_eof(fd);
    close(fd);
    free(all);
    free(p16);
    free(p32);
    stop_daemon_clean();
}

Test(daemon_wire, socket_mode_0600)
{
    start_daemon(NULL);
    struct stat st;
    cr_assert_eq(stat(D.sock, &st), 0);
    cr_assert(S_ISSOCK(st.st_mode));
    cr_assert_eq(st.st_mode & 0777, 0600, "mode %o", st.st_mode & 0777);
    stop_daemon_clean();
}

/* A stop sent the moment the socket file appears (before the daemon is
 * fully up) is a clean stop, never a death by signal: the daemon keeps the
 * stop signals blocked from before it binds until its handlers are in. */
Test(daemon_wire, sigterm_at_the_first_sight_of_the_socket_is_a_clean_stop)
{
    for (int round = 0; round < 10; round++) {
        unlink(D.sock);
        D.pid = start_daemon_args(D.sock, NULL);
        struct stat st;
        int i = 0;
        while (stat(D.sock, &st) != 0 && i++ < 2000)
            usleep(500);
        cr_assert_eq(stat(D.sock, &st), 0, "round %d: no socket (see %s)", round, D.log);
        stop_daemon_clean();
    }
}

Test(daemon_wire, garbage_closes_only_that_connection)
{
    start_daemon(NULL);
    int good = connect_unix(D.sock);
    cr_assert_eq(ping(good, 1), KVROPE__STATUS__OK);

    int bad = connect_unix(D.sock);
    const char junk[] = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\nmore garbage here";
    cr_assert_eq(kvt_write_all(bad, junk, sizeof junk), 0);
    Kvrope__Response *r = recv_resp(bad, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__E_BAD_FRAME);
    cr_assert_not_null(r->message);
    cr_assert_eq(r->id, 0);
    kvrope__response__free_unpacked(r, NULL);
    expect_eof(bad);
    close(bad);

    /* Wrong version on another connection: same. */
    int bad2 = connect_unix(D.sock);
    uint8_t h[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(h, 0, 0);
    h[4] = 9;
    refused_then_closed(bad2, h, sizeof h, KVROPE__STATUS__E_BAD_FRAME);

    /* A valid header with an undecodable message. */
    int bad3 = connect_unix(D.sock);
    uint8_t f[KVR_FRAME_HEADER_SIZE + 4];
    kvr_frame_header_encode(f, 4, 0);
    memcpy(f + KVR_FRAME_HEADER_SIZE, "\xff\xff\xff\xff", 4);
    refused_then_closed(bad3, f, sizeof f, KVROPE__STATUS__E_BAD_FRAME);

    answers_then_stop(good, 2);
}

Test(daemon_wire, oversize_frame)
{
    const char *extra[] = { "--max-frame", "4096", NULL };
    int fd = start_and_connect(extra);
    header_refused(fd, 4097, 0, KVROPE__STATUS__E_TOO_LARGE);

    /* A payload over the memory cap: refused before anything is read. */
    fd = connect_unix(D.sock);
    header_refused(fd, 2, 1ull << 40, KVROPE__STATUS__E_TOO_LARGE);

    fd = connect_unix(D.sock);
    answers_then_stop(fd, 3);
}

Test(daemon_wire, truncated_frames_then_disconnect)
{
    int fd = start_and_connect(NULL);
    uint8_t h[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(h, 100, 0);
    cr_assert_eq(kvt_write_all(fd, h, 10), 0);          /* half a header */
    close(fd);
    fd = connect_unix(D.sock);
    cr_assert_eq(kvt_write_all(fd, h, sizeof h), 0);    /* header, no message */
    cr_assert_eq(kvt_write_all(fd, "\x08\x01", 2), 0);
    close(fd);
    fd = connect_unix(D.sock);
    answers_then_stop(fd, 5);
}

static Kvrope__Response *get_all(int fd, const char *ctx, uint8_t **payload, uint64_t *plen)
{
    Kvrope__Request q;
    Kvrope__Get g;
    make_get(&q, &g, ctx, 200);
    g.has_dtype = 1;
    g.dtype = KVROPE__DTYPE__F16;
    return request(fd, &q, NULL, 0, payload, plen);
}

Test(daemon_wire, put_get_and_disconnect_mid_payload)
{
    int fd = start_and_connect(NULL);
    register_model(fd);

    uint32_t toks[4] = { 11, 12, 13, 14 };
    size_t pb;
    uint16_t *pay = new_payload(4, 1, &pb);
    Kvrope__Request q;
    Kvrope__Put p;
    make_put(&q, &p, "ctx-a", toks, 4, KVROPE__PUT_MODE__CREATE);
    Kvrope__Response *r = request(fd, &q, pay, pb, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "put: %s", r->message);
    cr_assert_eq(r->body_case, KVROPE__RESPONSE__BODY_PUT);
    cr_assert_eq(r->put->n_tokens, 4);
    kvrope__response__free_unpacked(r, NULL);

    /* Same id again with CREATE: E_EXISTS, payload drained, connection usable. */
    cr_assert_eq(request_status(fd, &q, pay, pb), KVROPE__STATUS__E_EXISTS);
    /* Wrong payload length: E_PAYLOAD_LENGTH, drained. */
    make_put(&q, &p, "ctx-b", toks, 4, KVROPE__PUT_MODE__CREATE);
    cr_assert_eq(request_status(fd, &q, pay, pb - 2), KVROPE__STATUS__E_PAYLOAD_LENGTH);
    /* Unknown model: E_UNKNOWN_MODEL. */
    make_put(&q, &p, "ctx-c", toks, 4, KVROPE__PUT_MODE__CREATE);
    p.model = "nope";
    cr_assert_eq(request_status(fd, &q, pay, pb), KVROPE__STATUS__E_UNKNOWN_MODEL);
    cr_assert_eq(ping(fd, 9), KVROPE__STATUS__OK);

    /* Round trip. */
    uint8_t *got;
    uint64_t glen;
    r = get_all(fd, "ctx-a", &got, &glen);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "get: %s", r->message);
    cr_assert_eq(r->body_case, KVROPE__RESPONSE__BODY_KV);
    cr_assert_eq(r->kv->token_count, 4);
    cr_assert_eq(r->kv->n_tokens, 4);
    cr_assert_eq(r->kv->tokens[3], 14);
    cr_assert_eq(glen, pb);
    cr_assert_arr_eq(got, pay, pb);
    free(got);
    kvrope__response__free_unpacked(r, NULL);

    /* Append on another connection, which dies halfway through the payload. */
    int fd2 = connect_unix(D.sock);
    uint32_t more[4] = { 15, 16, 17, 18 };
    uint16_t *pay2 = malloc(pb);
    fill_payload(pay2, 4, 99);
    make_put(&q, &p, "ctx-a", more, 4, KVROPE__PUT_MODE__APPEND);
    send_req(fd2, &q, pay2, pb / 2);
    close(fd2);

    /* Unknown context while we are at it. */
    r = get_all(fd, "missing", NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__E_UNKNOWN_CONTEXT);
    kvrope__response__free_unpacked(r, NULL);

    /* The stored data is intact (the aborted append left nothing). */
    for (int i = 0; i < 200; i++) {
        r = get_all(fd, "ctx-a", &got, &glen);
        cr_assert_eq(r->status, KVROPE__STATUS__OK, "get: %s", r->message);
        cr_assert_eq(r->kv->token_count, 4);
        cr_assert_eq(glen, pb);
        cr_assert_arr_eq(got, pay, pb);
        free(got);
        kvrope__response__free_unpacked(r, NULL);
        /* And the context is writable again (not left busy). */
        make_put(&q, &p, "ctx-a", more, 4, KVROPE__PUT_MODE__APPEND);
        Kvrope__Status st = request_status(fd, &q, pay2, pb);
        if (st == KVROPE__STATUS__OK)
            break;
        cr_assert_eq(st, KVROPE__STATUS__E_BUSY);   /* abort not seen yet */
        kvt_sleep_ms(10);
    }
    r = get_all(fd, "ctx-a", &got, &glen);
    cr_assert_eq(r->kv->token_count, 8);
    /* Layer 0's K starts with the first four tokens as first stored. */
    cr_assert_arr_eq(got, pay, (size_t)4 * NH * HD * 2);
    free(got);
    kvrope__response__free_unpacked(r, NULL);
    free(pay);
    free(pay2);
    close_and_stop(fd);
}

Test(daemon_wire, match_stat_list_stats)
{
    int fd = start_and_connect(NULL);
    register_model(fd);
    uint32_t toks[3] = { 1, 2, 3 };
    size_t pb;
    uint16_t *pay = new_payload(3, 5, &pb);
    put_ok(fd, "doc", toks, 3, KVROPE__PUT_MODE__UPSERT, pay, pb);
    Kvrope__Request q;

    Kvrope__Match m = KVROPE__MATCH__INIT;
    uint32_t query[5] = { 1, 2, 3, 9, 9 };
    m.model = "tiny";
    m.n_tokens = 5;
    m.tokens = query;
    m.has_get = 1;
    m.get = 1;
    kvrope__request__init(&q);
    q.id = 300;
    q.body_case = KVROPE__REQUEST__BODY_MATCH;
    q.match = &m;
    uint8_t *got;
    uint64_t glen;
    Kvrope__Response *r = request(fd, &q, NULL, 0, &got, &glen);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "%s", r->message);
    cr_assert_eq(r->match->length, 3);
    cr_assert_str_eq(r->match->context_id, "doc");
    cr_assert_not_null(r->match->kv);
    cr_assert_eq(glen, pb);
    cr_assert_arr_eq(got, pay, pb);
    free(got);
    kvrope__response__free_unpacked(r, NULL);

    r = stat_ok(fd, "doc");
    cr_assert_eq(r->context->n_tokens, 3);
    kvrope__response__free_unpacked(r, NULL);

    Kvrope__Stats st = KVROPE__STATS__INIT;
    kvrope__request__init(&q);
    q.id = 302;
    q.body_case = KVROPE__REQUEST__BODY_STATS;
    q.stats = &st;
    r = request(fd, &q, NULL, 0, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__OK);
    bool found = false;
    for (size_t i = 0; i < r->stats->n_metrics; i++)
        if (!strcmp(r->stats->metrics[i]->name, "requests_put")) {
            found = true;
            cr_assert_eq(r->stats->metrics[i]->value, 1.0);
        }
    cr_assert(found);
    kvrope__response__free_unpacked(r, NULL);

    /* A payload on a verb that takes none: E_BAD_REQUEST, drained. */
    kvrope__request__init(&q);
    q.id = 303;
    q.body_case = KVROPE__REQUEST__BODY_STATS;
    q.stats = &st;
    cr_assert_eq(request_status(fd, &q, "abcdefgh", 8), KVROPE__STATUS__E_BAD_REQUEST);
    cr_assert_eq(ping(fd, 304), KVROPE__STATUS__OK);
    free(pay);
    close_and_stop(fd);
}

static int connect_tcp(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        return -1;
    }
    struct timeval tv = { 10, 0 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static Kvrope__Status auth(int fd, const char *tok)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__Auth a = KVROPE__AUTH__INIT;
    a.token.data = (uint8_t *)(uintptr_t)tok;
    a.token.len = strlen(tok);
    q.id = 1;
    q.body_case = KVROPE__REQUEST__BODY_AUTH;
    q.auth = &a;
    return request_status(fd, &q, NULL, 0);
}

static int tcp_connect_retry(int port)
{
    int fd = -1;
    for (int i = 0; i < 500 && fd < 0; i++) {
        fd = connect_tcp(port);
        if (fd < 0)
            kvt_sleep_ms(10);
    }
    cr_assert_geq(fd, 0);
    return fd;
}

static int start_tcp_daemon_with_token(const char *const *more)
{
    static char tokpath[128], listen[64];
    snprintf(tokpath, sizeof tokpath, "%s/token", D.dir);
    FILE *f = fopen(tokpath, "w");
    fputs("s3cret-token\n", f);
    fclose(f);
    cr_assert_eq(chmod(tokpath, 0600), 0);   /* a token others can read is refused */
    int port = kvt_free_tcp_port();
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    const char *extra[24] = { "--listen", listen, "--auth-token-file", tokpath };
    int n = 4;
    for (int i = 0; more && more[i] && n < 23; i++)
        extra[n++] = more[i];
    extra[n] = NULL;
    start_daemon(extra);
    return port;
}

Test(daemon_wire, tcp_auth_required)
{
    int port = start_tcp_daemon_with_token(NULL);
    int fd = tcp_connect_retry(port);
    cr_assert_eq(ping(fd, 1), KVROPE__STATUS__E_UNAUTHENTICATED);
    expect_eof(fd);
    close(fd);

    fd = connect_tcp(port);
    cr_assert_eq(auth(fd, "wrong"), KVROPE__STATUS__E_UNAUTHENTICATED);
    expect_eof(fd);
    close(fd);

    fd = connect_tcp(port);
    cr_assert_eq(auth(fd, "s3cret-token"), KVROPE__STATUS__OK);
    cr_assert_eq(ping(fd, 2), KVROPE__STATUS__OK);
    close(fd);

    /* Unix-socket clients need no auth. */
    fd = connect_unix(D.sock);
    answers_then_stop(fd, 3);
}

Test(daemon_wire, non_loopback_needs_token)
{
    const char *argv[] = { kvroped_path(), "--socket", D.sock, "--listen", "0.0.0.0:1", NULL };
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        dup2(fd, 2);
        execv(argv[0], (char *const *)(uintptr_t)argv);
        _exit(127);
    }
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 127);
}

Test(daemon_wire, sigterm_removes_socket_and_live_socket_is_kept)
{
    start_daemon(NULL);
    /* A second daemon on the same live socket refuses to start. */
    pid_t p2 = start_daemon_args(D.sock, NULL);
    int st;
    cr_assert_eq(waitpid(p2, &st, 0), p2);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0);
    int fd = connect_unix(D.sock);
    cr_assert_eq(ping(fd, 1), KVROPE__STATUS__OK);
    close(fd);

    cr_assert_eq(kill(D.pid, SIGTERM), 0);
    cr_assert_eq(waitpid(D.pid, &st, 0), D.pid);
    D.pid = 0;
    cr_assert(WIFEXITED(st), "kvroped did not exit normally");
    cr_assert_eq(WEXITSTATUS(st), 0);
    struct stat sb;
    cr_assert_eq(stat(D.sock, &sb), -1, "socket file still there");
}

Test(daemon_wire, stale_socket_is_replaced)
{
    /* Leave a socket file nobody listens on. */
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", D.sock);
    cr_assert_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
    close(s);
    int fd = start_and_connect(NULL);
    answers_then_stop(fd, 1);
}

/* An f32 put into an f16 model converts on the threadpool; an f32 get
 * converts back. Values 1 + k/1024 are exact in f16, so the round trip is
 * exact. Re-rotating to the same positions is the identity (within f16). */
Test(daemon_wire, put_f32_converts_off_loop)
{
    int fd = start_and_connect(NULL);
    register_model(fd);
    enum { T = 40 };
    uint32_t toks[T];
    for (int i = 0; i < T; i++)
        toks[i] = (uint32_t)(1000 + i);
    size_t n = (size_t)NL * 2 * T * NH * HD;
    float *pay = malloc(n * sizeof *pay);
    for (size_t i = 0; i < n; i++)
        pay[i] = 1.0f + (float)(i % 1024) / 1024.0f;
    Kvrope__Request q;
    Kvrope__Put p;
    make_put(&q, &p, "f32", toks, T, KVROPE__PUT_MODE__CREATE);
    p.dtype = KVROPE__DTYPE__F32;
    Kvrope__Response *r = request(fd, &q, pay, n * sizeof *pay, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "put: %s", r->message);
    cr_assert_eq(r->put->n_tokens, T);
    kvrope__response__free_unpacked(r, NULL);

    Kvrope__Get g;
    make_get(&q, &g, "f32", 400);
    g.has_dtype = 1;
    g.dtype = KVROPE__DTYPE__F32;
    uint8_t *got;
    uint64_t glen;
    r = request(fd, &q, NULL, 0, &got, &glen);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "get: %s", r->message);
    cr_assert_eq(glen, n * sizeof(float));
    cr_assert_arr_eq(got, pay, n * sizeof(float));
    free(got);
    kvrope__response__free_unpacked(r, NULL);

    /* A layer subset and an explicit range: only those bytes come back. */
    uint32_t layers[1] = { 1 };
    g.n_layers = 1;
    g.layers = layers;
    g.has_start = g.has_end = 1;
    g.start = 4;
    g.end = 6;
    r = request(fd, &q, NULL, 0, &got, &glen);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "get: %s", r->message);
    cr_assert_eq(r->kv->token_count, 2);
    cr_assert_eq(r->kv->tokens[0], 1004);
    cr_assert_eq(glen, (size_t)2 * 2 * NH * HD * sizeof(float));
    free(got);
    kvrope__response__free_unpacked(r, NULL);

    /* Out of range: E_RANGE; the connection goes on. */
    g.start = 10;
    g.end = 1000;
    r = request(fd, &q, NULL, 0, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__E_RANGE, "status %d: %s", r->status, r->message);
    kvrope__response__free_unpacked(r, NULL);
    cr_assert_eq(ping(fd, 401), KVROPE__STATUS__OK);
    free(pay);
    close_and_stop(fd);
}

/* ---- timeouts and connection limits -------------------------------------------- */

/* One metric of a Stats reply (-1 if absent). */
static double stat_metric(int fd, const char *name)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__Stats st = KVROPE__STATS__INIT;
    q.id = 900;
    q.body_case = KVROPE__REQUEST__BODY_STATS;
    q.stats = &st;
    Kvrope__Response *r = request(fd, &q, NULL, 0, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__OK);
    double v = -1;
    for (size_t i = 0; i < r->stats->n_metrics; i++)
        if (!strcmp(r->stats->metrics[i]->name, name))
            v = r->stats->metrics[i]->value;
    kvrope__response__free_unpacked(r, NULL);
    return v;
}

/* A client that sends a put's header, message and half its payload, then
 * stalls with the connection open: after --io-timeout the put is aborted
 * and the connection closed, so the context is writable again and holds
 * exactly what it held before. */
Test(daemon_wire, stalled_put_is_aborted_after_io_timeout)
{
    const char *extra[] = { "--io-timeout", "1", NULL };
    int fd = start_and_connect(extra);
    register_model(fd);
    uint32_t toks[4] = { 11, 12, 13, 14 }, more[4] = { 15, 16, 17, 18 };
    size_t pb = payload_bytes(4);
    uint16_t *pay = malloc(pb), *pay2 = malloc(pb);
    fill_payload(pay, 4, 1);
    fill_payload(pay2, 4, 99);
    put_ok(fd, "ctx-a", toks, 4, KVROPE__PUT_MODE__CREATE, pay, pb);
    Kvrope__Request q;
    Kvrope__Put p;
    Kvrope__Response *r;

    int stall = connect_unix(D.sock);
    make_put(&q, &p, "ctx-a", more, 4, KVROPE__PUT_MODE__APPEND);
    send_req(stall, &q, NULL, pb);               /* declares pb bytes ... */
    cr_assert_eq(kvt_write_all(stall, pay2, pb / 2), 0);   /* ... sends half */
    /* Wait (via Stat's busy flag, which changes nothing) until the stalled
     * put holds the context. */
    bool busy = false;
    for (int i = 0; i < 1000 && !busy; i++) {
        r = stat_ok(fd, "ctx-a");
        busy = r->context->busy;
        kvrope__response__free_unpacked(r, NULL);
        if (!busy)
            kvt_sleep_ms(5);
    }
    cr_assert(busy, "the stalled put never held the context");
    /* Others get E_BUSY until the put is aborted. */
    Kvrope__Status st = KVROPE__STATUS__E_BUSY;
    for (int i = 0; i < 1000 && st == KVROPE__STATUS__E_BUSY; i++) {
        make_put(&q, &p, "ctx-a", more, 4, KVROPE__PUT_MODE__APPEND);
        st = request_status(fd, &q, pay2, pb);
        if (st == KVROPE__STATUS__E_BUSY)
            kvt_sleep_ms(10);
    }
    cr_assert_eq(st, KVROPE__STATUS__OK, "context still busy after the stalled put");
    expect_eof(stall);
    close(stall);

    /* The stalled put left nothing: 4 + the 4 appended here. */
    uint8_t *got;
    uint64_t glen;
    r = get_all(fd, "ctx-a", &got, &glen);
    cr_assert_eq(r->status, KVROPE__STATUS__OK);
    cr_assert_eq(r->kv->token_count, 8);
    cr_assert_eq(r->kv->tokens[4], 15);
    cr_assert_arr_eq(got, pay, (size_t)4 * NH * HD * 2);
    cr_assert_arr_eq(got + (size_t)4 * NH * HD * 2, pay2, (size_t)4 * NH * HD * 2);
    free(got);
    kvrope__response__free_unpacked(r, NULL);
    free(pay);
    free(pay2);
    close_and_stop(fd);
}

/* Half a header, then nothing: closed after --io-timeout. An idle
 * connection between frames is kept however long it waits. */
Test(daemon_wire, partial_header_times_out_idle_is_kept)
{
    const char *extra[] = { "--io-timeout", "1", NULL };
    start_daemon(extra);
    int idle = connect_unix(D.sock);
    cr_assert_eq(ping(idle, 1), KVROPE__STATUS__OK);
    int fd = connect_unix(D.sock);
    uint8_t h[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(h, 100, 0);
    cr_assert_eq(kvt_write_all(fd, h, 10), 0);
    expect_eof(fd);
    close(fd);
    answers_then_stop(idle, 2);
}

/* A TCP client that connects and never authenticates is closed after
 * --auth-timeout, whether it sends nothing or dribbles a frame. */
Test(daemon_wire, unauthenticated_tcp_client_times_out)
{
    const char *more[] = { "--auth-timeout", "1", "--io-timeout", "0", NULL };
    int port = start_tcp_daemon_with_token(more);
    int fd = tcp_connect_retry(port);
    expect_eof(fd);
    close(fd);
    fd = connect_tcp(port);
    uint8_t h[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(h, 100, 0);
    cr_assert_eq(kvt_write_all(fd, h, 5), 0);
    kvt_sleep_ms(300);
    (void)!write(fd, h + 5, 5);
    expect_eof(fd);
    close(fd);
    /* An authenticated one is kept. */
    fd = connect_tcp(port);
    cr_assert_eq(auth(fd, "s3cret-token"), KVROPE__STATUS__OK);
    kvt_sleep_ms(1500);
    answers_then_stop(fd, 2);
}

/* A Unix connection that a ping shows admitted (retrying while the
 * daemon still counts connections closed a moment ago). */
static int unix_conn_admitted(void)
{
    for (int i = 0; i < 500; i++) {
        int fd = connect_unix(D.sock);
        cr_assert_geq(fd, 0);
        Kvrope__Request q = KVROPE__REQUEST__INIT;
        Kvrope__Ping p = KVROPE__PING__INIT;
        q.id = 77;
        q.body_case = KVROPE__REQUEST__BODY_PING;
        q.ping = &p;
        Kvrope__Status st = request_status(fd, &q, NULL, 0);
        if (st == KVROPE__STATUS__OK)
            return fd;
        cr_assert_eq(st, KVROPE__STATUS__E_LIMIT);
        close(fd);
        kvt_sleep_ms(10);
    }
    cr_assert_fail("no Unix connection admitted");
    return -1;
}

/* Unauthenticated TCP connections have their own limit: they cannot use
 * up --max-connections, which Unix clients (and authenticated ones) share. */
Test(daemon_wire, unauthenticated_connection_limit)
{
    const char *more[] = { "--max-unauth-connections", "2", "--max-connections", "2", NULL };
    int port = start_tcp_daemon_with_token(more);
    int a = tcp_connect_retry(port);
    int b = connect_tcp(port);
    int c = connect_tcp(port);
    cr_assert_geq(b, 0);
    cr_assert_geq(c, 0);
    Kvrope__Response *r = recv_resp(c, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__E_LIMIT, "status %d", r->status);
    cr_assert_not_null(strstr(r->message, "unauthenticated"));
    kvrope__response__free_unpacked(r, NULL);
    expect_eof(c);
    close(c);

    /* Local workers still get in, up to --max-connections (once the
     * daemon has seen wait_ready's probe connections close). */
    int u1 = unix_conn_admitted(), u2 = unix_conn_admitted();
    int u3 = connect_unix(D.sock);
    r = recv_resp(u3, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__E_LIMIT);
    kvrope__response__free_unpacked(r, NULL);
    close(u3);

    /* Authenticating moves a connection into --max-connections: full. */
    cr_assert_eq(auth(a, "s3cret-token"), KVROPE__STATUS__E_LIMIT);
    expect_eof(a);
    close(a);
    close(u2);
    /* Once a slot is free (the close is seen asynchronously), b gets in. */
    Kvrope__Status st = KVROPE__STATUS__E_LIMIT;
    for (int i = 0; i < 500 && st == KVROPE__STATUS__E_LIMIT; i++) {
        if (b < 0)
            b = tcp_connect_retry(port);
        st = auth(b, "s3cret-token");
        if (st == KVROPE__STATUS__E_LIMIT) {
            close(b);
            b = -1;
            kvt_sleep_ms(10);
        }
    }
    cr_assert_eq(st, KVROPE__STATUS__OK);
    cr_assert_eq(ping(b, 3), KVROPE__STATUS__OK);
    close(b);
    close(u1);
    stop_daemon_clean();
}

/* A client that asks for gets and never reads the replies: once no reply
 * byte has drained for --io-timeout the connection is closed, releasing
 * its leases and staging. */
Test(daemon_wire, unread_replies_time_out)
{
    const char *extra[] = { "--io-timeout", "1", "--max-conn-buffer", "4096", NULL };
    int fd = start_and_connect(extra);
    register_model(fd);
    enum { T = 4096 };
    uint32_t *toks = malloc(T * sizeof *toks);
    for (uint32_t i = 0; i < T; i++)
        toks[i] = i;
    size_t pb;
    uint16_t *pay = new_payload(T, 3, &pb);
    put_ok(fd, "big", toks, T, KVROPE__PUT_MODE__CREATE, pay, pb);
    Kvrope__Request q;

    int slow = connect_unix(D.sock);
    /* 40 replies of 512 KiB: more than the daemon's socket send buffer (4 MiB,
     * doubled by the kernel) holds, so some reply must stay queued. */
    for (int i = 0; i < 40; i++) {
        Kvrope__Get g;
        make_get(&q, &g, "big", 500 + (uint64_t)i);
        g.has_dtype = 1;
        g.dtype = KVROPE__DTYPE__F32;
        send_req(slow, &q, NULL, 0);
    }
    double n = 2;
    for (int i = 0; i < 1000 && n > 1; i++) {
        n = stat_metric(fd, "connections");
        if (n > 1)
            kvt_sleep_ms(10);
    }
    cr_assert_eq(n, 1, "the connection that reads nothing is still open");
    close(slow);
    free(toks);
    free(pay);
    close_and_stop(fd);
}

/* Before Auth a frame may carry a few KiB of message and no payload: a
 * larger one is refused from its header alone (the daemon neither waits
 * for nor buffers the rest) and the connection closed. */
Test(daemon_wire, large_frame_before_auth_is_refused)
{
    int port = start_tcp_daemon_with_token(NULL);
    int fd = tcp_connect_retry(port);
    header_refused(fd, 512u << 10, 0, KVROPE__STATUS__E_UNAUTHENTICATED);   /* under --max-frame */

    fd = connect_tcp(port);
    /* a payload before Auth */
    header_refused(fd, 8, 1u << 20, KVROPE__STATUS__E_UNAUTHENTICATED);

    /* After Auth the usual limits apply. */
    fd = connect_tcp(port);
    cr_assert_eq(auth(fd, "s3cret-token"), KVROPE__STATUS__OK);
    answers_then_stop(fd, 2);
}

/* With a small memory cap the message limit drops below --max-frame, so
 * one message's unpacked form (~20x) stays under a quarter of the cap. */
Test(daemon_wire, message_limit_follows_memory_cap)
{
    const char *extra[] = { "--max-memory", "1M", NULL };
    int fd = start_and_connect(extra);
    header_refused(fd, 64u << 10, 0, KVROPE__STATUS__E_TOO_LARGE);   /* under --max-frame 1M */
    fd = connect_unix(D.sock);
    answers_then_stop(fd, 1);
}
