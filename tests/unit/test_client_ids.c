/*
 * test_client_ids.c — libkvrope matches each response to its request by id.
 * A scripted fake daemon (a forked child on a Unix socket) answers with
 * chosen ids and statuses: id 0 is the daemon's "before I knew the id"
 * error, so it may answer any request only with a non-OK status.
 */
#include <criterion/criterion.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/kvrope.h"
#include "kvrope.pb-c.h"
#include "proto/frame.h"

static int read_all(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n > 0) {
        ssize_t k = read(fd, b, n);
        if (k <= 0)
            return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Child: accepts one connection, answers one request with (id, status). */
static pid_t fake_daemon(const char *path, uint64_t id, Kvrope__Status status)
{
    int ls = socket(AF_UNIX, SOCK_STREAM, 0);
    cr_assert_geq(ls, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    unlink(path);
    cr_assert_eq(bind(ls, (struct sockaddr *)&sa, sizeof sa), 0);
    cr_assert_eq(listen(ls, 1), 0);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid > 0) {
        close(ls);
        return pid;
    }
    alarm(20);
    int fd = accept(ls, NULL, NULL);
    uint8_t h[KVR_FRAME_HEADER_SIZE], m[4096];
    kvr_frame_header fh;
    if (fd < 0 || read_all(fd, h, sizeof h) < 0 || kvr_frame_header_decode(h, &fh, NULL) != 0 ||
        fh.msg_len > sizeof m || read_all(fd, m, fh.msg_len) < 0)
        _exit(1);
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    Kvrope__Pong pong = KVROPE__PONG__INIT;
    r.id = id;
    r.status = status;
    if (status == KVROPE__STATUS__OK) {
        pong.server = "fake";
        pong.protocol = 1;
        r.body_case = KVROPE__RESPONSE__BODY_PONG;
        r.pong = &pong;
    } else {
        r.message = "bad frame";
    }
    uint8_t out[512];
    size_t n = kvrope__response__pack(&r, out + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(out, (uint32_t)n, 0);
    if (write(fd, out, KVR_FRAME_HEADER_SIZE + n) < 0)
        _exit(1);
    char b;
    (void)!read(fd, &b, 1);     /* until the client closes */
    _exit(0);
}

static int ping_fake(uint64_t id, Kvrope__Status status)
{
    char dir[] = "/tmp/kvr-ids-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[128], addr[140];
    snprintf(path, sizeof path, "%s/s.sock", dir);
    snprintf(addr, sizeof addr, "unix:%s", path);
    pid_t pid = fake_daemon(path, id, status);
    kvr_client *c = NULL;
    cr_assert_eq(kvr_client_connect(&c, addr, NULL), 0, "%s", kvr_client_last_error(NULL));
    int rc = kvr_client_ping(c, NULL);
    kvr_client_close(c);
    waitpid(pid, NULL, 0);
    unlink(path);
    rmdir(dir);
    return rc;
}

Test(client_ids, ok_reply_with_id_0_is_not_an_answer)
{
    signal(SIGPIPE, SIG_IGN);
    int rc = ping_fake(0, KVROPE__STATUS__OK);
    cr_assert_eq(rc, KVR_EPROTO, "an OK reply with id 0 was taken as the answer (rc %d)",
                 rc);
}

Test(client_ids, error_reply_with_id_0_answers)
{
    signal(SIGPIPE, SIG_IGN);
    int rc = ping_fake(0, KVROPE__STATUS__E_BAD_FRAME);
    cr_assert_eq(rc, KVR_EBADFRAME, "rc %d", rc);
}

Test(client_ids, reply_with_its_own_id_answers)
{
    signal(SIGPIPE, SIG_IGN);
    cr_assert_eq(ping_fake(1, KVROPE__STATUS__OK), 0);   /* the first request's id is 1 */
    cr_assert_eq(ping_fake(7, KVROPE__STATUS__OK), KVR_EPROTO);
}

Test(client_ids, version_macros_and_functions_agree)
{
    cr_assert_eq(kvr_version(), (unsigned)KVR_VERSION_HEX);
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", KVR_VERSION_MAJOR, KVR_VERSION_MINOR,
             KVR_VERSION_PATCH);
    cr_assert_str_eq(kvr_version_string(), want);
    cr_assert_eq(kvr_version() >> 16, (unsigned)KVR_VERSION_MAJOR);
}
