/*
 * test_int_harden.c — issue 12's edge cases through a real kvroped:
 *  - context ids (and every other string) with an embedded NUL are refused
 *    with E_BAD_REQUEST, never cut short and aliased to another id; the
 *    connection stays usable and nothing stored changes (raw frames: the C
 *    client cannot even express such an id);
 *  - end = 2^64-1 means "to the end" in get, shift and keep;
 *  - an assemble of more than KVR_ASSEMBLE_MAX_DOCS documents gets E_LIMIT
 *    and the connection stays open, as docs/protocol.md says.
 */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "kvrope.pb-c.h"
#include "proto/check.h"
#include "proto/frame.h"
#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt.h"

static kvr_testd D;
static kvr_client *C;

static void setup(void)
{
    C = kvt_daemon_up(&D, NULL);
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
}

static void teardown(void)
{
    kvt_daemon_down(&D, &C, NULL);
}

TestSuite(int_harden, .init = setup, .fini = teardown, .timeout = 120);

/* ---- raw frames ------------------------------------------------------------ */

static int raw_connect(void)
{
    return kvt_unix_connect(D.sock, 20);
}

static void write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR)
            continue;
        cr_assert_gt(k, 0, "send: %s", strerror(errno));
        b += k;
        n -= (size_t)k;
    }
}

static void read_all(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n > 0) {
        ssize_t k = read(fd, b, n);
        if (k < 0 && errno == EINTR)
            continue;
        cr_assert_gt(k, 0, "read: %s", k ? strerror(errno) : "EOF");
        b += k;
        n -= (size_t)k;
    }
}

/* A request of that id and body (the body's pointer is the caller's). */
static Kvrope__Request request(uint64_t id, Kvrope__Request__BodyCase body)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    q.id = id;
    q.body_case = body;
    return q;
}

/* Packs r, then, where the bytes of the string `marked` (a field value of
 * r) appear in the message, turns its '\x01' bytes into NULs: the field
 * arrives with a real NUL (pack itself stops at one). Sends it with `plen`
 * payload bytes of zeros. */
static void send_with_nul(int fd, Kvrope__Request *r, const char *marked, uint64_t plen)
{
    size_t n = kvrope__request__get_packed_size(r);
    uint8_t *buf = malloc(KVR_FRAME_HEADER_SIZE + n);
    kvrope__request__pack(r, buf + KVR_FRAME_HEADER_SIZE);
    uint8_t *m = buf + KVR_FRAME_HEADER_SIZE;
    uint8_t *at = memmem(m, n, marked, strlen(marked));
    cr_assert_not_null(at);
    int swapped = 0;
    for (size_t i = 0; i < strlen(marked); i++)
        if (at[i] == 1) {
            at[i] = 0;
            swapped++;
        }
    cr_assert_gt(swapped, 0);
    cr_assert_not_null(kvr_proto_find_nul_string(&kvrope__request__descriptor, m, n));
    kvr_frame_header_encode(buf, (uint32_t)n, plen);
    write_all(fd, buf, KVR_FRAME_HEADER_SIZE + n);
    free(buf);
    if (plen) {
        void *z = calloc(1, (size_t)plen);
        write_all(fd, z, (size_t)plen);
        free(z);
    }
}

static Kvrope__Response *recv_resp(int fd)
{
    uint8_t h[KVR_FRAME_HEADER_SIZE];
    read_all(fd, h, sizeof h);
    kvr_frame_header fh;
    cr_assert_eq(kvr_frame_header_decode(h, &fh, NULL), 0);
    uint8_t *m = malloc(fh.msg_len + 1);
    if (fh.msg_len)
        read_all(fd, m, fh.msg_len);
    Kvrope__Response *r = kvrope__response__unpack(NULL, fh.msg_len, m);
    free(m);
    cr_assert_not_null(r);
    cr_assert_eq(fh.payload_len, 0);
    return r;
}

static void expect_status(int fd, uint64_t id, Kvrope__Status st, const char *what)
{
    Kvrope__Response *r = recv_resp(fd);
    cr_assert_eq(r->id, id, "%s: response id", what);
    cr_assert_eq(r->status, st, "%s: status %d (%s), wanted %d", what, r->status,
                 r->message ? r->message : "", st);
    if (st != KVROPE__STATUS__OK)
        cr_assert(r->message && strstr(r->message, "NUL"), "%s: message '%s'", what,
                  r->message ? r->message : "");
    kvrope__response__free_unpacked(r, NULL);
}

/* q (its field `field` holding a 0x01 that send_with_nul turns into a NUL,
 * plen bytes of payload after it) is refused as a bad request, answered
 * under q's id. */
static void nul_refused(int fd, Kvrope__Request *q, const char *field, size_t plen,
                        const char *what)
{
    send_with_nul(fd, q, field, plen);
    expect_status(fd, q->id, KVROPE__STATUS__E_BAD_REQUEST, what);
}

static void raw_ping(int fd, uint64_t id)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__Ping p = KVROPE__PING__INIT;
    q.id = id;
    q.body_case = KVROPE__REQUEST__BODY_PING;
    q.ping = &p;
    size_t n = kvrope__request__get_packed_size(&q);
    uint8_t buf[64];
    kvrope__request__pack(&q, buf + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(buf, (uint32_t)n, 0);
    write_all(fd, buf, KVR_FRAME_HEADER_SIZE + n);
    Kvrope__Response *r = recv_resp(fd);
    cr_assert_eq(r->id, id);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "the connection must stay usable");
    kvrope__response__free_unpacked(r, NULL);
}

static uint64_t n_tokens(const char *id)
{
    kvr_context x;
    int r = kvr_client_stat(C, id, &x);
    return r == 0 ? x.n_tokens : (uint64_t)-1;
}

/* ---- NUL in ids ------------------------------------------------------------ */

Test(int_harden, nul_in_ids_is_refused_never_aliased)
{
    cr_assert_eq(testd_put(C, "alice", "m", KVR_DTYPE_F16, 1, 0, 0, 10), 0);
    cr_assert_eq(testd_put(C, "bob", "m", KVR_DTYPE_F16, 2, 0, 0, 7), 0);
    int fd = raw_connect();

    /* delete "alice\0x" must not delete "alice". */
    Kvrope__Request q = request(11, KVROPE__REQUEST__BODY_DELETE);
    Kvrope__Delete del = KVROPE__DELETE__INIT;
    del.context_id = "alice\x01x";
    q.delete_ = &del;
    nul_refused(fd, &q, del.context_id, 0, "delete");
    cr_assert_eq(n_tokens("alice"), 10, "delete of alice\\0x touched alice");

    /* fork into "bob\0y" must not overwrite or alias "bob". */
    Kvrope__Request q2 = request(12, KVROPE__REQUEST__BODY_FORK);
    Kvrope__Fork fk = KVROPE__FORK__INIT;
    fk.src = "alice";
    fk.dst = "b\x01";
    q2.fork = &fk;
    nul_refused(fd, &q2, fk.dst, 0, "fork");
    cr_assert_eq(n_tokens("b"), (uint64_t)-1, "fork created a context cut at the NUL");

    /* keep on "alice\0": a NUL at the very end is still refused. */
    Kvrope__Request q3 = request(13, KVROPE__REQUEST__BODY_KEEP);
    Kvrope__Keep kp = KVROPE__KEEP__INIT;
    kp.context_id = "alice\x01";
    kp.start = 0;
    kp.end = 1;
    q3.keep = &kp;
    nul_refused(fd, &q3, kp.context_id, 0, "keep");
    cr_assert_eq(n_tokens("alice"), 10);

    /* A put with a payload: refused, payload drained, connection usable. */
    size_t plen;
    void *pl = testd_payload(3, T_LAYERS, 0, 5, KVR_DTYPE_F16, &plen);
    free(pl);
    uint32_t toks[5] = { 1, 2, 3, 4, 5 };
    Kvrope__Request q4 = request(14, KVROPE__REQUEST__BODY_PUT);
    Kvrope__Put put = KVROPE__PUT__INIT;
    put.context_id = "bob\x01z";
    put.model = "m";
    put.n_tokens = 5;
    put.tokens = toks;
    put.has_dtype = 1;
    put.dtype = KVROPE__DTYPE__F16;
    q4.put = &put;
    nul_refused(fd, &q4, put.context_id, plen, "put");
    cr_assert_eq(n_tokens("bob"), 7, "put to bob\\0z changed bob");

    /* A model name with a NUL (register_model) is refused too. */
    Kvrope__Request q5 = request(15, KVROPE__REQUEST__BODY_REGISTER_MODEL);
    Kvrope__RegisterModel rm = KVROPE__REGISTER_MODEL__INIT;
    rm.name = "m\x01" "2";
    rm.has_n_layers = rm.has_n_kv_heads = rm.has_head_dim = 1;
    rm.n_layers = T_LAYERS;
    rm.n_kv_heads = T_HEADS;
    rm.head_dim = T_DIM;
    q5.register_model = &rm;
    nul_refused(fd, &q5, rm.name, 0, "register_model");

    raw_ping(fd, 16);
    close(fd);
    cr_assert_eq(n_tokens("alice"), 10);
    cr_assert_eq(n_tokens("bob"), 7);
    kvr_context *list;
    size_t n;
    cr_assert_eq(kvr_client_list(C, NULL, &list, &n), 0);
    cr_assert_eq(n, 2, "only alice and bob exist");
    kvr_client_free(list);
}

/* The walker itself: nested messages, a NUL in bytes (not a string) is fine,
 * and truncated input stops the walk without reading past the end. */
Test(int_harden, nul_walker)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    Kvrope__Auth au = KVROPE__AUTH__INIT;
    uint8_t tok[3] = { 'a', 0, 'b' };
    q.id = 1;
    q.body_case = KVROPE__REQUEST__BODY_AUTH;
    au.token.data = tok;
    au.token.len = 3;
    q.auth = &au;
    uint8_t buf[64];
    size_t n = kvrope__request__pack(&q, buf);
    cr_assert_null(kvr_proto_find_nul_string(&kvrope__request__descriptor, buf, n),
                   "a NUL in a bytes field is data");
    Kvrope__Delete del = KVROPE__DELETE__INIT;
    del.context_id = "ab\x01";
    q.body_case = KVROPE__REQUEST__BODY_DELETE;
    q.delete_ = &del;
    n = kvrope__request__pack(&q, buf);
    buf[n - 1] = 0;
    const char *f = kvr_proto_find_nul_string(&kvrope__request__descriptor, buf, n);
    cr_assert(f && !strcmp(f, "context_id"), "%s", f ? f : "(null)");
    for (size_t k = 0; k < n - 1; k++)
        cr_assert_null(kvr_proto_find_nul_string(&kvrope__request__descriptor, buf, k));
}

/* ---- end = 2^64-1 ----------------------------------------------------------- */

Test(int_harden, end_max_means_to_the_end)
{
    cr_assert_eq(testd_put(C, "c", "m", KVR_DTYPE_F16, 5, 0, 0, 50), 0);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "c", .dtype = KVR_DTYPE_F16, .start = 10, .end = UINT64_MAX,
                       .meta_only = true };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(kv.n_tokens, 40);
    kvr_kv_release(&kv);
    g.end = 51;
    cr_assert_eq(kvr_client_get(C, &g, &kv), KVR_ERANGE);
    cr_assert_eq(kvr_client_shift(C, "c", 20, UINT64_MAX, 100), 0, "%s",
                 kvr_client_last_error(C));
    g.end = 0;
    g.start = 0;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert_eq(kv.positions[19], 19);
    cr_assert_eq(kv.positions[20], 120);
    cr_assert_eq(kv.positions[49], 149);
    kvr_kv_release(&kv);
    cr_assert_eq(kvr_client_shift(C, "c", 0, UINT64_MAX - 1, 1), KVR_ERANGE);
    cr_assert_eq(kvr_client_keep(C, "c", 30, UINT64_MAX), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(n_tokens("c"), 20);
}

/* ---- assemble over the document limit ------------------------------------- */

Test(int_harden, assemble_over_doc_limit_keeps_connection)
{
    cr_assert_eq(testd_put(C, "p", "m", KVR_DTYPE_F16, 1, 0, 0, 4), 0);
    enum { N = 4097 };
    const char **docs = malloc(N * sizeof *docs);
    char (*names)[16] = malloc(N * sizeof *names);
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "d%d", i);
        docs[i] = names[i];
    }
    kvr_assemble_args a = { .prefix = "p", .docs = docs, .n_docs = N,
                            .layout = KVR_LAYOUT_PARALLEL, .dtype = KVR_DTYPE_F16,
                            .meta_only = true };
    kvr_assemble_res res;
    int r = kvr_client_assemble(C, &a, &res);
    cr_assert_eq(r, KVR_ELIMIT, "%d: %s", r, kvr_client_last_error(C));
    cr_assert_eq(kvr_client_ping(C, NULL), 0, "E_LIMIT on assemble leaves the connection open");
    cr_assert_eq(n_tokens("p"), 4);
    free(docs);
    free(names);
}
