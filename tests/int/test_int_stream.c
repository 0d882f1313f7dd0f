/*
 * test_int_stream.c — streamed get replies end to end through a real
 * kvroped and libkvrope: a large get whose keys must be re-rotated goes out
 * layer chunk by layer chunk while the daemon is still rotating (see
 * docs/protocol.md). Checked here: the bytes equal the single-shot result
 * (computed locally with kvr_rope_reposition), the per-layer callback fires
 * in order, match+get streams too, a client that disconnects mid-stream
 * leaves the daemon healthy (and, under `make check`, leak-free: the daemon
 * must exit 0 under ASan/LSan), unedited zero-copy gets do not stream, and
 * a streamed get near --max-memory reserves only its staging ring (issue
 * 15: no eviction, no refusal for the whole payload it never stages).
 * And a put REPLACE of a context another client is streaming (the reader
 * gets the old context whole, later gets the new one) or writing (E_BUSY,
 * then through once the writer's put is aborted).
 *
 * Shape: 32 layers x 8 KV heads x 128 dims, f16, 300 tokens (1.2 MiB a
 * layer, 37.5 MiB in all: several 8 MiB chunks).
 */
#include <criterion/criterion.h>

#include <sys/socket.h>
#include <sys/un.h>

#include "kvrope.pb-c.h"
#include "proto/frame.h"
#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_io.h"
#include "tests/common/kvt_bench.h"
#include "tests/common/kvt_wire.h"

#define NL 32
#define NH 8
#define ND 128
#define NT 300
#define SHIFT 1000

static kvr_testd D;
static kvr_client *C;
static kvr_rope *R;
static void *PL;        /* what was put: K at positions 0..NT-1 */
static size_t PL_LEN;
static uint32_t TOK[NT];

static const char *const *EXTRA;   /* the daemon's extra options */

static void setup(void)
{
    C = kvt_daemon_up(&D, EXTRA);
    R = kvt_register_model(C, "big", NL, NH, ND, KVR_DTYPE_F16, NULL);
    PL_LEN = kvr_payload_size(NL, NT, NH, ND, KVR_DTYPE_F16);
    PL = malloc(PL_LEN);
    cr_assert_not_null(PL);
    testd_fill(PL, 7, NULL, NL, 0, NT, NH, ND, KVR_DTYPE_F16);
    for (uint32_t i = 0; i < NT; i++)
        TOK[i] = 100 + i;
}

static void teardown(void)
{
    free(PL);
    PL = NULL;
    /* Exit status 0: under ASan/LSan, nothing leaked. */
    cr_expect_eq(kvt_daemon_down(&D, &C, &R), 0, "the daemon did not exit cleanly");
}

TestSuite(int_stream, .init = setup, .fini = teardown, .timeout = 240);

static void put_ctx(const char *ctx)
{
    kvr_put_args a = { .mode = KVR_PUT_UPSERT, .ctx_id = ctx, .model = "big", .dtype = KVR_DTYPE_F16, .tokens = TOK,
                       .n_tokens = NT, .has_pos_start = true, .pos_start = 0,
                       .payload = PL, .payload_len = PL_LEN };
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
}

/* The single-shot result of a get of the whole context after every token
 * moved by +SHIFT: K re-rotated from i to i + SHIFT, V as stored. */
static uint8_t *expected_shifted(void)
{
    uint8_t *want = malloc(PL_LEN);
    cr_assert_not_null(want);
    int64_t from[NT], to[NT];
    for (size_t i = 0; i < NT; i++) {
        from[i] = (int64_t)i;
        to[i] = (int64_t)i + SHIFT;
    }
    size_t half = (size_t)NT * NH * ND * 2;
    const uint8_t *src = PL;
    for (size_t l = 0; l < NL; l++) {
        cr_assert_eq(kvr_rope_reposition(R, want + l * 2 * half, KVR_DTYPE_F16,
                                         src + l * 2 * half, KVR_DTYPE_F16, NT, NH, from, to,
                                         NULL), 0);
        memcpy(want + l * 2 * half + half, src + l * 2 * half + half, half);
    }
    return want;
}

typedef struct layer_log {
    uint32_t n;
    uint32_t index[NL], layer[NL];
    size_t   bytes;
    int      bad_ptr;
    const uint8_t *base;
} layer_log;

static void on_layer(void *ud, uint32_t index, uint32_t layer, const void *k, const void *v,
                     size_t bytes_each)
{
    layer_log *g = ud;
    if (g->n < NL) {
        g->index[g->n] = index;
        g->layer[g->n] = layer;
    }
    g->n++;
    g->bytes = bytes_each;
    /* K and V of payload layer `index`, in the destination buffer. */
    if (g->base && ((const uint8_t *)k != g->base + (size_t)index * 2 * bytes_each ||
                    (const uint8_t *)v != (const uint8_t *)k + bytes_each))
        g->bad_ptr++;
}

static void check_layers(const layer_log *g)
{
    cr_assert_eq(g->n, NL, "%u layer callbacks", g->n);
    for (uint32_t i = 0; i < NL; i++) {
        cr_assert_eq(g->index[i], i, "callback %u had index %u", i, g->index[i]);
        cr_assert_eq(g->layer[i], i, "callback %u had layer %u", i, g->layer[i]);
    }
    cr_assert_eq(g->bytes, (size_t)NT * NH * ND * 2);
    cr_assert_eq(g->bad_ptr, 0, "a callback pointed outside its layer");
}

static void assert_same(const uint8_t *got, const uint8_t *want, size_t len)
{
    size_t half = (size_t)NT * NH * ND * 2;
    for (size_t off = 0; off < len; off += half)
        cr_assert(memcmp(got + off, want + off, half) == 0, "layer %zu %s differs",
                  off / (2 * half), (off / half) % 2 ? "V" : "K");
}

static kvr_kv get_all(const char *ctx, void *dst, layer_log *g)
{
    kvr_get_args a = { .ctx_id = ctx, .dtype = KVR_DTYPE_F16, .dst = dst,
                       .dst_cap = dst ? PL_LEN : 0, .on_layer = on_layer, .on_layer_ud = g };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &a, &kv), 0, "get: %s", kvr_client_last_error(C));
    cr_assert_eq(kv.payload_len, PL_LEN);
    cr_assert_eq(kv.n_tokens, NT);
    return kv;
}

Test(int_stream, shifted_get_streams_and_matches_the_single_shot_result)
{
    put_ctx("s");
    cr_assert_eq(kvr_client_shift(C, "s", 0, NT, SHIFT), 0, "%s", kvr_client_last_error(C));
    uint8_t *want = expected_shifted();
    double streamed0 = testd_metric(C, "streamed_replies");
    cr_assert_geq(streamed0, 0, "no streamed_replies metric");
    for (int rep = 0; rep < 3; rep++) {
        void *dst = malloc(PL_LEN);
        layer_log g = { .base = dst };
        kvr_kv kv = get_all("s", dst, &g);
        for (size_t i = 0; i < NT; i++)
            cr_assert_eq(kv.positions[i], (int64_t)i + SHIFT);
        assert_same(kv.payload, want, PL_LEN);
        check_layers(&g);
        kvr_kv_release(&kv);
        free(dst);
    }
    /* Into a library-owned buffer too. */
    layer_log g = { 0 };
    kvr_kv kv = get_all("s", NULL, &g);
    assert_same(kv.payload, want, PL_LEN);
    check_layers(&g);
    kvr_kv_release(&kv);
    cr_assert_eq(testd_metric(C, "streamed_replies"), streamed0 + 4);
    cr_assert_eq(testd_metric(C, "streams_aborted"), 0);
    /* A small re-rotated get (one layer: 1.2 MiB) still goes out whole. */
    uint32_t one = 5;
    kvr_get_args a = { .ctx_id = "s", .dtype = KVR_DTYPE_F16, .layers = &one, .n_layers = 1 };
    cr_assert_eq(kvr_client_get(C, &a, &kv), 0, "%s", kvr_client_last_error(C));
    size_t lb = PL_LEN / NL;
    cr_assert_eq(kv.payload_len, lb);
    cr_assert(memcmp(kv.payload, want + 5 * lb, lb) == 0);
    kvr_kv_release(&kv);
    cr_assert_eq(testd_metric(C, "streamed_replies"), streamed0 + 4);
    free(want);
}

Test(int_stream, match_with_get_streams_too)
{
    put_ctx("m");
    cr_assert_eq(kvr_client_shift(C, "m", 0, NT, SHIFT), 0, "%s", kvr_client_last_error(C));
    uint8_t *want = expected_shifted();
    double streamed0 = testd_metric(C, "streamed_replies");
    kvr_match_args ma = { .model = "big", .tokens = TOK, .n_tokens = NT, .get = true,
                          .include_approximate = true,
                          .dtype = KVR_DTYPE_F16 };
    kvr_match_res mr;
    cr_assert_eq(kvr_client_match(C, &ma, &mr), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(mr.length, NT);
    cr_assert_eq(mr.kv.payload_len, PL_LEN);
    assert_same(mr.kv.payload, want, PL_LEN);
    kvr_kv_release(&mr.kv);
    cr_assert_eq(testd_metric(C, "streamed_replies"), streamed0 + 1);
    free(want);
}

Test(int_stream, unedited_get_is_zero_copy_and_not_streamed)
{
    put_ctx("u");
    double streamed0 = testd_metric(C, "streamed_replies");
    void *dst = malloc(PL_LEN);
    layer_log g = { .base = dst };
    kvr_kv kv = get_all("u", dst, &g);
    cr_assert(memcmp(kv.payload, PL, PL_LEN) == 0, "unedited payload differs");
    check_layers(&g);
    kvr_kv_release(&kv);
    free(dst);
    cr_assert_eq(testd_metric(C, "streamed_replies"), streamed0);
}

/* ---- a client that goes away mid-stream --------------------------------- */

static int raw_connect(void)
{
    return kvt_unix_connect(D.sock, 0);
}

static void send_all(int fd, const uint8_t *p, size_t n)
{
    cr_assert_eq(kvt_write_all(fd, p, n), 0);
}

/* Sends rq framed on fd, announcing payload_len bytes of payload to follow
 * (which the caller sends, or not). */
static void send_request(int fd, const Kvrope__Request *rq, uint64_t payload_len)
{
    size_t n = kvrope__request__get_packed_size(rq);
    uint8_t *buf = malloc(KVR_FRAME_HEADER_SIZE + n);
    cr_assert_not_null(buf);
    kvrope__request__pack(rq, buf + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(buf, (uint32_t)n, payload_len);
    send_all(fd, buf, KVR_FRAME_HEADER_SIZE + n);
    free(buf);
}

/* Opens a raw connection and sends a get (f16, request id 1) of the whole
 * of ctx on it; returns the descriptor, the reply unread. */
static int raw_get(const char *ctx)
{
    int fd = raw_connect();
    Kvrope__Get g = KVROPE__GET__INIT;
    g.context_id = (char *)(uintptr_t)ctx;
    g.dtype = KVROPE__DTYPE__F16;
    Kvrope__Request rq = KVROPE__REQUEST__INIT;
    rq.id = 1;
    rq.body_case = KVROPE__REQUEST__BODY_GET;
    rq.get = &g;
    send_request(fd, &rq, 0);
    return fd;
}

/* Sends a get of the whole context, reads `read_bytes` of the reply, closes. */
static void get_and_leave(const char *ctx, size_t read_bytes)
{
    int fd = raw_get(ctx);
    static uint8_t sink[1 << 16];
    size_t got = 0;
    while (got < read_bytes) {
        size_t want = read_bytes - got < sizeof sink ? read_bytes - got : sizeof sink;
        ssize_t r = read(fd, sink, want);
        cr_assert_gt(r, 0, "the reply ended after %zu bytes", got);
        got += (size_t)r;
    }
    close(fd);
}

Test(int_stream, client_leaving_mid_stream_leaves_the_daemon_healthy)
{
    put_ctx("d");
    cr_assert_eq(kvr_client_shift(C, "d", 0, NT, SHIFT), 0, "%s", kvr_client_last_error(C));
    double leased0 = testd_metric(C, "leased_blocks");
    /* Leave after the header, after part of the first chunk, and deep in.
     * Each cut leaves at least 20 MiB of the 37.5 MiB reply unread: more
     * than the daemon's socket can hold (SO_SNDBUF 4 MiB, which the kernel
     * doubles), so every one of these streams is cut short, never finished
     * into the buffer before the close arrives (a cut at 30 MiB could be). */
    const size_t cut[] = { 1, 100u << 10, 12u << 20, PL_LEN - (20u << 20) };
    cr_assert_gt(PL_LEN, 30u << 20);
    for (size_t i = 0; i < sizeof cut / sizeof *cut; i++)
        get_and_leave("d", cut[i]);
    /* Another client is served at once; the streams wind down. */
    cr_assert_eq(kvr_client_ping(C, NULL), 0, "%s", kvr_client_last_error(C));
    double aborted = 0;
    for (int i = 0; i < 500; i++) {
        aborted = testd_metric(C, "streams_aborted");
        if (aborted >= 4 && testd_metric(C, "leased_blocks") == leased0 &&
            testd_metric(C, "connections") == 1)
            break;
        kvt_sleep_ms(10);
    }
    cr_assert_eq(aborted, 4, "streams_aborted %g", aborted);
    cr_assert_eq(testd_metric(C, "leased_blocks"), leased0, "leases were not released");
    cr_assert_eq(testd_metric(C, "connections"), 1);
    /* And a full streamed get still works. */
    uint8_t *want = expected_shifted();
    layer_log g = { 0 };
    kvr_kv kv = get_all("d", NULL, &g);
    assert_same(kv.payload, want, PL_LEN);
    check_layers(&g);
    kvr_kv_release(&kv);
    free(want);
    cr_assert(testd_alive(&D));
}

/* ---- put REPLACE of a context another client is reading or writing ------ */

static void recv_all(int fd, uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        cr_assert_gt(r, 0, "the reply ended with %zu bytes to go", n);
        p += r;
        n -= (size_t)r;
    }
}

static int put_n(const char *ctx, kvr_put_mode mode, const void *pl, size_t len,
                 uint32_t n_layers, size_t n_tokens)
{
    kvr_put_args a = { .mode = mode, .ctx_id = ctx, .model = "big", .dtype = KVR_DTYPE_F16,
                       .tokens = TOK, .n_tokens = n_tokens, .has_pos_start = true, .pos_start = 0,
                       .payload = pl, .payload_len = len, .n_layers = n_layers,
                       .n_kv_heads = n_layers ? NH : 0, .head_dim = n_layers ? ND : 0 };
    return kvr_client_put(C, &a, NULL);
}

static int put_mode(const char *ctx, kvr_put_mode mode, const void *pl, size_t len,
                    uint32_t n_layers)
{
    return put_n(ctx, mode, pl, len, n_layers, NT);
}

Test(int_stream, replace_while_another_client_streams_or_writes_it)
{
    put_ctx("rp");
    cr_assert_eq(kvr_client_shift(C, "rp", 0, NT, SHIFT), 0, "%s", kvr_client_last_error(C));
    uint8_t *want_old = expected_shifted();
    /* A reader that stops after 100 KiB of its streamed reply: the stream
     * stalls with its leases held. */
    int fd = raw_get("rp");
    uint8_t hdr[KVR_FRAME_HEADER_SIZE];
    recv_all(fd, hdr, sizeof hdr);
    uint32_t msg_len;
    uint64_t pay_len;
    memcpy(&msg_len, hdr + 8, 4);
    memcpy(&pay_len, hdr + 16, 8);
    cr_assert_eq(pay_len, PL_LEN);
    uint8_t *msg = malloc(msg_len ? msg_len : 1), *got = malloc(PL_LEN);
    cr_assert(msg && got);
    recv_all(fd, msg, msg_len);
    free(msg);
    recv_all(fd, got, 100u << 10);
    /* The replacement: other KV under the same id, while the read is open. */
    uint8_t *pl2 = malloc(PL_LEN);
    cr_assert_not_null(pl2);
    testd_fill(pl2, 9, NULL, NL, 0, NT, NH, ND, KVR_DTYPE_F16);
    /* Refused ones first: the old context stays as it was. */
    int rc;
    /* (payloads under --max-drain: drained, the connection stays) */
    cr_assert_eq(put_mode("rp", KVR_PUT_REPLACE, pl2, PL_LEN / NL, 1), KVR_ESHAPE);
    rc = put_mode("rp", KVR_PUT_REPLACE, pl2, PL_LEN / NL, 0);
    cr_assert_eq(rc, KVR_EPAYLOAD, "%d %s", rc, kvr_client_last_error(C));
    kvr_context ci;
    cr_assert_eq(kvr_client_stat(C, "rp", &ci), 0);
    cr_assert_eq(ci.pos_min, SHIFT);
    cr_assert_eq(put_mode("rp", KVR_PUT_REPLACE, pl2, PL_LEN, 0), 0, "%s",
                 kvr_client_last_error(C));
    cr_assert_eq(kvr_client_stat(C, "rp", &ci), 0);
    cr_assert_eq(ci.pos_min, 0);                  /* the new one, at its own positions */
    kvr_get_args ga = { .ctx_id = "rp", .dtype = KVR_DTYPE_F16 };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &ga, &kv), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(kv.payload_len, PL_LEN);
    cr_assert(memcmp(kv.payload, pl2, PL_LEN) == 0, "the replacement's bytes differ");
    kvr_kv_release(&kv);
    /* The reader gets the whole old context, as it was when it asked. */
    recv_all(fd, got + (100u << 10), PL_LEN - (100u << 10));
    assert_same(got, want_old, PL_LEN);
    close(fd);
    free(got);
    free(want_old);

    /* A writer with its payload half sent holds the context busy: a replace
     * is E_BUSY; once the writer leaves (its put aborted), it goes through. */
    fd = raw_connect();
    Kvrope__Put p = KVROPE__PUT__INIT;
    p.context_id = (char *)"rp";
    p.model = (char *)"big";
    p.has_mode = true;
    p.mode = KVROPE__PUT_MODE__APPEND;
    p.n_tokens = NT;
    p.tokens = TOK;
    Kvrope__Request rq = kvt_put_request(2, &p);
    send_request(fd, &rq, PL_LEN);
    send_all(fd, pl2, 4096);
    /* (64 tokens, 8 MiB: under --max-drain, so the refusal keeps C open) */
    size_t small = kvr_payload_size(NL, 64, NH, ND, KVR_DTYPE_F16);
    rc = KVR_EBUSY;
    for (int i = 0; i < 500 && rc == KVR_EBUSY; i++) {
        /* Until the daemon has read the writer's frame, the replace may win;
         * once the writer holds it, E_BUSY. */
        rc = put_n("rp", KVR_PUT_REPLACE, PL, small, 0, 64);
        if (rc == 0) {
            kvt_sleep_ms(10);
            rc = KVR_EBUSY;
            continue;
        }
        break;
    }
    cr_assert_eq(rc, KVR_EBUSY, "%s", kvr_client_last_error(C));
    close(fd);
    rc = KVR_EBUSY;
    for (int i = 0; i < 500 && rc == KVR_EBUSY; i++) {
        rc = put_n("rp", KVR_PUT_REPLACE, PL, small, 0, 64);
        if (rc == KVR_EBUSY)
            kvt_sleep_ms(10);
    }
    cr_assert_eq(rc, 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(kvr_client_stat(C, "rp", &ci), 0);
    cr_assert_eq(ci.n_tokens, 64);
    cr_assert_eq(testd_metric(C, "contexts"), 1);
    free(pl2);
    cr_assert(testd_alive(&D));
}

/* ---- in pieces ------------------------------------------------------------ */

/* Wide layers: 4 x 32 heads x 128 dims, 1000 tokens: 16 MiB a layer, its
 * keys 8 MiB. A ring of whole-layer chunks would stage 24 MiB, so the
 * stream goes in pieces of about 2 MiB (kvr_get_stage_pieces): the same
 * bytes as the single-shot result. */
Test(int_stream, wide_layers_stream_in_pieces)
{
    enum { WL = 4, WH = 32, WT = 1000 };
    kvr_rope_config rc = kvt_rope_config(ND, 0);
    kvr_model_params mp = { .name = "wide", .n_layers = WL, .n_kv_heads = WH, .head_dim = ND,
                            .dtype = KVR_DTYPE_F16, .rope = &rc };
    cr_assert_eq(kvr_client_model_register(C, &mp, NULL), 0, "%s", kvr_client_last_error(C));
    size_t len = kvr_payload_size(WL, WT, WH, ND, KVR_DTYPE_F16), half = len / WL / 2;
    uint8_t *pl = malloc(len), *want = malloc(len);
    cr_assert(pl && want);
    testd_fill(pl, 11, NULL, WL, 0, WT, WH, ND, KVR_DTYPE_F16);
    uint32_t *tok = malloc(WT * sizeof *tok);
    for (uint32_t i = 0; i < WT; i++)
        tok[i] = 7 + i;
    kvr_put_args a = { .mode = KVR_PUT_UPSERT, .ctx_id = "w", .model = "wide",
                       .dtype = KVR_DTYPE_F16, .tokens = tok, .n_tokens = WT,
                       .has_pos_start = true, .pos_start = 0, .payload = pl, .payload_len = len };
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
    /* the first 100 tokens stay (zero-copy keys), the rest move */
    cr_assert_eq(kvr_client_shift(C, "w", 100, WT, SHIFT), 0, "%s", kvr_client_last_error(C));
    int64_t *from = malloc(WT * sizeof *from), *to = malloc(WT * sizeof *to);
    for (size_t i = 0; i < WT; i++) {
        from[i] = (int64_t)i;
        to[i] = (int64_t)i + (i >= 100 ? SHIFT : 0);
    }
    for (size_t l = 0; l < WL; l++) {
        cr_assert_eq(kvr_rope_reposition(R, want + l * 2 * half, KVR_DTYPE_F16,
                                         pl + l * 2 * half, KVR_DTYPE_F16, WT, WH, from, to,
                                         NULL), 0);
        memcpy(want + l * 2 * half + half, pl + l * 2 * half + half, half);
    }
    double streamed0 = testd_metric(C, "streamed_replies");
    for (int rep = 0; rep < 2; rep++) {
        kvr_get_args ga = { .ctx_id = "w", .dtype = KVR_DTYPE_F16 };
        kvr_kv kv;
        cr_assert_eq(kvr_client_get(C, &ga, &kv), 0, "get: %s", kvr_client_last_error(C));
        cr_assert_eq(kv.payload_len, len);
        for (size_t off = 0; off < len; off += half)
            cr_assert(memcmp((const uint8_t *)kv.payload + off, want + off, half) == 0,
                      "layer %zu %s differs", off / (2 * half), (off / half) % 2 ? "V" : "K");
        kvr_kv_release(&kv);
    }
    cr_assert_eq(testd_metric(C, "streamed_replies"), streamed0 + 2);
    cr_assert_eq(testd_metric(C, "streams_aborted"), 0);
    free(from);
    free(to);
    free(tok);
    free(pl);
    free(want);
}

/* ---- near the memory cap ------------------------------------------------- */

static const char *const CAP_ARGS[] = { "--max-memory", "96M", NULL };

static void setup_cap(void)
{
    EXTRA = CAP_ARGS;
    setup();
    EXTRA = NULL;
}

/* Tokens [t0, t0 + n) of PL put (appended) to ctx: each put under a
 * quarter of the cap. */
static void put_piece(const char *ctx, size_t t0, size_t n)
{
    size_t half = (size_t)NT * NH * ND * 2, row = (size_t)NH * ND * 2;
    size_t len = kvr_payload_size(NL, n, NH, ND, KVR_DTYPE_F16);
    uint8_t *p = malloc(len), *o = p;
    cr_assert_not_null(p);
    for (size_t l = 0; l < NL; l++)
        for (int kv = 0; kv < 2; kv++) {
            memcpy(o, (const uint8_t *)PL + (2 * l + (size_t)kv) * half + t0 * row, n * row);
            o += n * row;
        }
    kvr_put_args a = { .mode = KVR_PUT_UPSERT, .ctx_id = ctx, .model = "big",
                       .dtype = KVR_DTYPE_F16, .tokens = TOK + t0, .n_tokens = n,
                       .has_pos_start = true, .pos_start = (int64_t)t0, .payload = p,
                       .payload_len = len };
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
    free(p);
}

/* 96 MiB cap: a request may use 24 MiB. The shifted context (37.5 MiB) and
 * a cold one (half of it) fit with room for the stream's ring (3 chunks of
 * 6 layers: 21 MiB), not for a whole-payload staging (37.5 MiB, over what
 * one request may use: it was refused, or made room by evicting). */
Test(int_stream_cap, streamed_get_near_the_cap_reserves_only_its_ring, .init = setup_cap,
     .fini = teardown, .timeout = 240)
{
    for (size_t t0 = 0; t0 < NT; t0 += 75)
        put_piece("s", t0, 75);
    for (size_t t0 = 0; t0 < NT / 2; t0 += 75)
        put_piece("cold", t0, 75);
    cr_assert_eq(kvr_client_shift(C, "s", 0, NT, SHIFT), 0, "%s", kvr_client_last_error(C));
    uint8_t *want = expected_shifted();
    double ev0 = testd_metric(C, "evicted_blocks"), st0 = testd_metric(C, "streamed_replies");
    cr_assert_geq(ev0, 0, "no evicted_blocks metric");
    for (int rep = 0; rep < 2; rep++) {
        void *dst = malloc(PL_LEN);
        layer_log g = { .base = dst };
        kvr_kv kv = get_all("s", dst, &g);
        assert_same(kv.payload, want, PL_LEN);
        check_layers(&g);
        kvr_kv_release(&kv);
        free(dst);
    }
    cr_assert_eq(testd_metric(C, "streamed_replies"), st0 + 2);
    cr_assert_eq(testd_metric(C, "evicted_blocks"), ev0, "the streamed get evicted blocks");
    kvr_context cs;
    cr_assert_eq(kvr_client_stat(C, "cold", &cs), 0, "cold: %s", kvr_client_last_error(C));
    cr_assert_eq(cs.n_tokens, NT / 2);
    cr_assert_eq(cs.n_evicted_tokens, 0);
    free(want);
}
