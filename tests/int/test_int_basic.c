/*
 * test_int_basic.c — end to end through a real kvroped and libkvrope:
 * models, bit-exact put/get round trips in every dtype, iovec puts, layer
 * subsets, caller buffers, streaming callbacks, match (+get), fork and
 * copy-on-write, shift/keep metadata, pin, list/stat/delete, stats.
 */
#include <criterion/criterion.h>

#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt_wire.h"

static kvr_testd D;
static kvr_client *C;

static void setup(void)
{
    C = kvt_daemon_up(&D, NULL);
}

static void teardown(void)
{
    kvt_daemon_down(&D, &C, NULL);
}

TestSuite(int_basic, .init = setup, .fini = teardown, .timeout = 120);

Test(int_basic, ping_and_models)
{
    kvr_pong p;
    cr_assert_eq(kvr_client_ping(C, &p), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(p.protocol, 1);
    cr_assert(strstr(p.server, "kvroped") != NULL, "server '%s'", p.server);

    kvr_model m;
    cr_assert_eq(testd_register(C, "tiny", KVR_DTYPE_F16, &m), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(m.n_layers, T_LAYERS);
    cr_assert_eq(m.n_kv_heads, T_HEADS);
    cr_assert_eq(m.head_dim, T_DIM);
    cr_assert_eq(m.dtype, KVR_DTYPE_F16);
    cr_assert_neq(m.fingerprint, 0);
    /* Registering the same again is fine and yields the same fingerprint. */
    kvr_model m2;
    cr_assert_eq(testd_register(C, "tiny", KVR_DTYPE_F16, &m2), 0);
    cr_assert_eq(m2.fingerprint, m.fingerprint);

    const char *cfg = "{\"model_type\":\"llama\",\"num_hidden_layers\":4,"
                      "\"num_attention_heads\":8,\"num_key_value_heads\":2,"
                      "\"hidden_size\":256,\"rope_theta\":500000.0,"
                      "\"max_position_embeddings\":8192}";
    kvr_model m3;
    cr_assert_eq(kvr_client_model_register_json(C, "llamaish", cfg, NULL, KVR_DTYPE_BF16, &m3), 0,
                 "%s", kvr_client_last_error(C));
    cr_assert_eq(m3.n_layers, 4);
    cr_assert_eq(m3.n_kv_heads, 2);
    cr_assert_eq(m3.head_dim, 32);
    cr_assert_float_eq(m3.rope.theta, 500000.0, 1e-6);
    cr_assert_eq(m3.rope.style, KVR_ROPE_NEOX);

    kvr_model *ms;
    size_t n;
    cr_assert_eq(kvr_client_model_list(C, &ms, &n), 0);
    cr_assert_eq(n, 2);
    kvr_client_free(ms);
    kvr_model g;
    cr_assert_eq(kvr_client_model_get(C, "llamaish", &g), 0);
    cr_assert_eq(g.fingerprint, m3.fingerprint);
    cr_assert_eq(kvr_client_model_get(C, "nope", &g), KVR_ENOMODEL);
}

static void roundtrip(kvr_dtype dt, const char *model)
{
    cr_assert_eq(testd_register(C, model, dt, NULL), 0, "%s", kvr_client_last_error(C));
    const size_t n = 200;   /* several blocks */
    size_t len;
    void *pl = testd_payload(7, T_LAYERS, 0, n, dt, &len);
    cr_assert_eq(testd_put(C, "ctx", model, dt, 7, 1000, 0, n), 0, "%s", kvr_client_last_error(C));

    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "ctx", .dtype = dt };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(kv.n_tokens, n);
    cr_assert_eq(kv.n_layers, T_LAYERS);
    cr_assert_eq(kv.payload_len, len);
    cr_assert(kv.payload_owned);
    cr_assert(memcmp(kv.payload, pl, len) == 0, "payload differs (%s)", kvr_dtype_name(dt));
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(kv.tokens[i], 1000 + i);
        cr_assert_eq(kv.positions[i], (int64_t)i);
        cr_assert_eq(kv.flags[i], 0);
    }
    kvr_kv_release(&kv);

    /* A sub-range into a caller buffer: bytes equal that range's data. */
    size_t sl;
    void *sub = testd_payload(7, T_LAYERS, 50, 70, dt, &sl);
    void *buf = malloc(sl);
    g.start = 50;
    g.end = 120;
    g.dst = buf;
    g.dst_cap = sl;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(kv.payload, buf);
    cr_assert_not(kv.payload_owned);
    cr_assert_eq(kv.start, 50);
    cr_assert_eq(kv.n_tokens, 70);
    cr_assert(memcmp(buf, sub, sl) == 0);
    kvr_kv_release(&kv);
    free(buf);
    free(sub);
    free(pl);
}

Test(int_basic, roundtrip_f32) { roundtrip(KVR_DTYPE_F32, "m32"); }
Test(int_basic, roundtrip_f16) { roundtrip(KVR_DTYPE_F16, "m16"); }
Test(int_basic, roundtrip_bf16) { roundtrip(KVR_DTYPE_BF16, "mbf16"); }

Test(int_basic, iovec_put_equals_contiguous)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    const size_t n = 33;
    size_t len;
    uint8_t *pl = testd_payload(3, T_LAYERS, 0, n, KVR_DTYPE_F16, &len);
    /* Split into K and V pieces per layer, plus an odd split inside one. */
    size_t half = len / T_LAYERS / 2;
    struct iovec iov[2 * T_LAYERS + 1];
    size_t k = 0;
    for (int l = 0; l < T_LAYERS; l++) {
        uint8_t *kp = pl + (size_t)l * 2 * half;
        if (l == 1) {
            iov[k++] = (struct iovec){ kp, 7 };
            iov[k++] = (struct iovec){ kp + 7, half - 7 };
        } else {
            iov[k++] = (struct iovec){ kp, half };
        }
        iov[k++] = (struct iovec){ kp + half, half };
    }
    uint32_t *tok = testd_tokens(5, n);
    kvr_put_args a = { .mode = KVR_PUT_UPSERT, .ctx_id = "iov", .model = "m", .dtype = KVR_DTYPE_F16, .tokens = tok,
                       .n_tokens = n, .iov = iov, .iovcnt = k };
    kvr_put_res res;
    cr_assert_eq(kvr_client_put(C, &a, &res), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(res.n_tokens, n);
    cr_assert_eq(res.first_index, 0);
    cr_assert_eq(res.first_pos, 0);
    cr_assert_eq(res.last_pos, (int64_t)n - 1);

    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "iov", .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert(memcmp(kv.payload, pl, len) == 0);
    kvr_kv_release(&kv);
    free(tok);
    free(pl);
}

Test(int_basic, append_and_layer_subset)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F32, NULL), 0);
    cr_assert_eq(testd_put(C, "a", "m", KVR_DTYPE_F32, 9, 0, 0, 40), 0);
    /* Append continues positions and data index 40.. */
    size_t len;
    void *pl = testd_payload(9, T_LAYERS, 40, 30, KVR_DTYPE_F32, &len);
    uint32_t *tok = testd_tokens(40, 30);
    kvr_put_args a = { .ctx_id = "a", .model = "m", .mode = KVR_PUT_APPEND,
                       .dtype = KVR_DTYPE_F32, .tokens = tok, .n_tokens = 30, .payload = pl,
                       .payload_len = len };
    kvr_put_res res;
    cr_assert_eq(kvr_client_put(C, &a, &res), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(res.n_tokens, 70);
    cr_assert_eq(res.first_index, 40);
    cr_assert_eq(res.first_pos, 40);
    free(pl);
    free(tok);

    uint32_t layers[] = { 2, 0 };
    size_t sl;
    float *want = malloc(kvr_payload_size(2, 70, T_HEADS, T_DIM, KVR_DTYPE_F32));
    testd_fill(want, 9, layers, 2, 0, 70, T_HEADS, T_DIM, KVR_DTYPE_F32);
    sl = kvr_payload_size(2, 70, T_HEADS, T_DIM, KVR_DTYPE_F32);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "a", .dtype = KVR_DTYPE_F32, .layers = layers, .n_layers = 2 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(kv.n_layers, 2);
    cr_assert_eq(kv.layers[0], 2);
    cr_assert_eq(kv.layers[1], 0);
    cr_assert_eq(kv.payload_len, sl);
    cr_assert(memcmp(kv.payload, want, sl) == 0);
    /* kvr_kv_k/v address the layers. */
    cr_assert_eq((const uint8_t *)kvr_kv_v(&kv, 1) - (const uint8_t *)kv.payload,
                 (ptrdiff_t)(3 * sl / 4));
    kvr_kv_release(&kv);
    free(want);
}

typedef struct layer_log {
    int      calls;
    uint32_t ids[8];
} layer_log;

static void on_layer(void *ud, uint32_t index, uint32_t layer, const void *k, const void *v,
                     size_t bytes)
{
    layer_log *lg = ud;
    cr_assert_eq(index, (uint32_t)lg->calls);
    cr_assert_eq((const uint8_t *)v - (const uint8_t *)k, (ptrdiff_t)bytes);
    lg->ids[lg->calls++] = layer;
}

Test(int_basic, buffer_too_small_and_streaming)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_put(C, "s", "m", KVR_DTYPE_F16, 1, 0, 0, 100), 0);
    size_t len = kvr_payload_size(T_LAYERS, 100, T_HEADS, T_DIM, KVR_DTYPE_F16);
    char *buf = malloc(len);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "s", .dtype = KVR_DTYPE_F16, .dst = buf, .dst_cap = len - 1 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), KVR_EBUFFER);
    cr_assert_null(kv.payload);
    /* The connection is still in step. */
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
    layer_log lg = { 0 };
    g.dst_cap = len;
    g.on_layer = on_layer;
    g.on_layer_ud = &lg;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert_eq(lg.calls, T_LAYERS);
    for (int i = 0; i < T_LAYERS; i++)
        cr_assert_eq(lg.ids[i], (uint32_t)i);
    kvr_kv_release(&kv);
    /* meta_only: no payload, metadata intact. */
    g = (kvr_get_args){ .ctx_id = "s", .dtype = KVR_DTYPE_F16, .meta_only = true, .start = 10,
                        .end = 20 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert_eq(kv.n_tokens, 10);
    cr_assert_eq(kv.payload_len, 0);
    cr_assert_eq(kv.tokens[0], 10);
    kvr_kv_release(&kv);
    free(buf);
}

/* A get into the caller's buffer reads its answer's first few KiB at once
 * (header, message, first payload bytes): small payloads that come whole
 * with the message, answers whose message (tokens and positions) is longer
 * than that first read, and a get right after a pipelined one: bytes exact,
 * nothing written past the payload, the connection in step. */
Test(int_basic, placed_get_of_every_size)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    const size_t sizes[] = { 1, 7, 20, 100, 1500, 5000 };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        char id[16];
        snprintf(id, sizeof id, "pg%zu", i);
        size_t n = sizes[i], len;
        cr_assert_eq(testd_put(C, id, "m", KVR_DTYPE_F16, (uint32_t)(40 + i), 70000, 0, n), 0,
                     "%s", kvr_client_last_error(C));
        void *want = testd_payload((uint32_t)(40 + i), T_LAYERS, 0, n, KVR_DTYPE_F16, &len);
        uint8_t *dst = malloc(len + 16);
        for (int rep = 0; rep < 3; rep++) {
            memset(dst, 0xa5, len + 16);
            if (rep == 2)
                cr_assert_eq(kvr_client_delete_deferred(C, "never-was"), 0);
            kvr_kv kv;
            kvr_get_args g = { .ctx_id = id, .dtype = KVR_DTYPE_F16, .dst = dst,
                               .dst_cap = len + 16 };
            cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
            cr_assert_eq(kv.payload, dst);
            cr_assert_eq(kv.payload_len, len);
            cr_assert_eq(kv.n_tokens, n);
            cr_assert_eq(kv.tokens[n - 1], 70000 + (uint32_t)n - 1);
            cr_assert_eq(memcmp(dst, want, len), 0, "%zu tokens", n);
            cr_assert_eq(dst[len], 0xa5, "nothing written past the payload");
            kvr_kv_release(&kv);
        }
        free(dst);
        free(want);
    }
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
    cr_assert_eq(kvr_client_deferred_failures(C, NULL, 0), 0);
}

Test(int_basic, match_overlapping_prompts)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    /* doc A: tokens 100..199; doc B shares the first 60 then diverges. */
    cr_assert_eq(testd_put(C, "A", "m", KVR_DTYPE_F16, 1, 100, 0, 100), 0);
    size_t len;
    void *pl = testd_payload(2, T_LAYERS, 0, 80, KVR_DTYPE_F16, &len);
    uint32_t tb[80];
    for (int i = 0; i < 80; i++)
        tb[i] = i < 60 ? 100 + (uint32_t)i : 5000 + (uint32_t)i;
    kvr_put_args a = { .mode = KVR_PUT_UPSERT, .ctx_id = "B", .model = "m", .dtype = KVR_DTYPE_F16, .tokens = tb,
                       .n_tokens = 80, .payload = pl, .payload_len = len };
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0);
    free(pl);

    uint32_t q[150];
    kvr_match_res r;
    /* Query = A's first 120 ... only 100 exist: match 100 in A. */
    for (int i = 0; i < 150; i++)
        q[i] = 100 + (uint32_t)i;
    kvr_match_args m = { .model = "m", .tokens = q, .n_tokens = 150 };
    cr_assert_eq(kvr_client_match(C, &m, &r), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(r.length, 100);
    cr_assert_str_eq(r.ctx_id, "A");
    cr_assert_not(r.has_kv);
    /* Query follows B for 70 tokens: 70 in B. */
    for (int i = 0; i < 70; i++)
        q[i] = tb[i];
    q[70] = 1;
    m.n_tokens = 71;
    cr_assert_eq(kvr_client_match(C, &m, &r), 0);
    cr_assert_eq(r.length, 70);
    cr_assert_str_eq(r.ctx_id, "B");
    /* Shared part only: 60, either context. */
    q[60] = 42;
    cr_assert_eq(kvr_client_match(C, &m, &r), 0);
    cr_assert_eq(r.length, 60);
    /* Nothing in common. */
    q[0] = 7;
    cr_assert_eq(kvr_client_match(C, &m, &r), 0);
    cr_assert_eq(r.length, 0);
    /* Another model sees nothing; an unknown one is an error. */
    cr_assert_eq(testd_register(C, "other", KVR_DTYPE_F16, NULL), 0);
    for (int i = 0; i < 50; i++)
        q[i] = 100 + (uint32_t)i;
    m.model = "other";
    m.n_tokens = 50;
    cr_assert_eq(kvr_client_match(C, &m, &r), 0);
    cr_assert_eq(r.length, 0);
    m.model = "ghost";
    cr_assert_eq(kvr_client_match(C, &m, &r), KVR_ENOMODEL);
}

Test(int_basic, match_with_get_one_round_trip)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_BF16, NULL), 0);
    cr_assert_eq(testd_put(C, "doc", "m", KVR_DTYPE_BF16, 4, 300, 0, 90), 0);
    uint32_t q[120];
    for (int i = 0; i < 120; i++)
        q[i] = i < 75 ? 300 + (uint32_t)i : 9;
    double before = testd_metric(C, "requests_total");
    kvr_match_res r;
    kvr_match_args m = { .model = "m", .tokens = q, .n_tokens = 120, .get = true,
                         .dtype = KVR_DTYPE_BF16 };
    cr_assert_eq(kvr_client_match(C, &m, &r), 0, "%s", kvr_client_last_error(C));
    double after = testd_metric(C, "requests_total");
    cr_assert_eq(r.length, 75);
    cr_assert(r.has_kv);
    cr_assert_eq(r.kv.n_tokens, 75);
    cr_assert_eq(r.kv.start, 0);
    size_t len;
    void *want = testd_payload(4, T_LAYERS, 0, 75, KVR_DTYPE_BF16, &len);
    cr_assert_eq(r.kv.payload_len, len);
    cr_assert(memcmp(r.kv.payload, want, len) == 0);
    free(want);
    kvr_kv_release(&r.kv);
    /* match+get was one request (the stats call itself is the second). */
    if (before >= 0 && after >= 0)
        cr_assert_eq(after - before, 2.0);
}

Test(int_basic, fork_copy_on_write)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_put(C, "src", "m", KVR_DTYPE_F16, 11, 0, 0, 150), 0);
    cr_assert_eq(kvr_client_fork(C, "src", "dst"), 0, "%s", kvr_client_last_error(C));
    kvr_context s, d;
    cr_assert_eq(kvr_client_stat(C, "dst", &d), 0);
    cr_assert_eq(d.n_tokens, 150);
    cr_assert_gt(d.n_shared_blocks, 0, "fork should share blocks");
    /* Appending to dst does not change src. */
    cr_assert_eq(testd_put(C, "dst", "m", KVR_DTYPE_F16, 12, 900, 150, 20), 0);
    cr_assert_eq(kvr_client_stat(C, "src", &s), 0);
    cr_assert_eq(s.n_tokens, 150);
    cr_assert_eq(kvr_client_stat(C, "dst", &d), 0);
    cr_assert_eq(d.n_tokens, 170);
    /* Deleting src leaves dst whole. */
    cr_assert_eq(kvr_client_delete(C, "src"), 0);
    size_t len;
    void *want = testd_payload(11, T_LAYERS, 0, 150, KVR_DTYPE_F16, &len);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "dst", .dtype = KVR_DTYPE_F16, .end = 150 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert(memcmp(kv.payload, want, len) == 0);
    kvr_kv_release(&kv);
    free(want);
    cr_assert_eq(kvr_client_fork(C, "dst", "dst"), KVR_EEXIST);
    cr_assert_eq(kvr_client_fork(C, "src", "x"), KVR_ENOCTX);
}

Test(int_basic, shift_keep_metadata)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F32, NULL), 0);
    cr_assert_eq(testd_put(C, "c", "m", KVR_DTYPE_F32, 5, 0, 0, 100), 0);
    cr_assert_eq(kvr_client_shift(C, "c", 50, 100, 1000), 0, "%s", kvr_client_last_error(C));
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "c", .dtype = KVR_DTYPE_F32, .meta_only = true };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert_eq(kv.positions[49], 49);
    cr_assert_eq(kv.positions[50], 1050);
    cr_assert_eq(kv.positions[99], 1099);
    kvr_kv_release(&kv);
    cr_assert_eq(kvr_client_keep(C, "c", 40, 60), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert_eq(kv.n_tokens, 20);
    cr_assert_eq(kv.tokens[0], 40);
    cr_assert_eq(kv.positions[0], 40);
    cr_assert_eq(kv.positions[10], 1050);
    kvr_kv_release(&kv);
    kvr_context x;
    cr_assert_eq(kvr_client_stat(C, "c", &x), 0);
    cr_assert_eq(x.n_tokens, 20);
    cr_assert_eq(x.pos_min, 40);
    cr_assert_eq(x.pos_max, 1059);
}

Test(int_basic, list_stat_pin_delete_stats)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_register(C, "n", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_put(C, "b", "m", KVR_DTYPE_F16, 1, 0, 0, 10), 0);
    cr_assert_eq(testd_put(C, "a", "m", KVR_DTYPE_F16, 1, 0, 0, 10), 0);
    cr_assert_eq(testd_put(C, "z", "n", KVR_DTYPE_F16, 1, 0, 0, 10), 0);
    kvr_context *xs;
    size_t n;
    cr_assert_eq(kvr_client_list(C, NULL, &xs, &n), 0);
    cr_assert_eq(n, 3);
    cr_assert_str_eq(xs[0].id, "a");
    cr_assert_str_eq(xs[1].id, "b");
    kvr_client_free(xs);
    cr_assert_eq(kvr_client_list(C, "n", &xs, &n), 0);
    cr_assert_eq(n, 1);
    cr_assert_str_eq(xs[0].id, "z");
    kvr_client_free(xs);

    kvr_context x;
    cr_assert_eq(kvr_client_pin(C, "a", true), 0);
    cr_assert_eq(kvr_client_stat(C, "a", &x), 0);
    cr_assert(x.pinned);
    cr_assert_eq(kvr_client_pin(C, "a", false), 0);
    cr_assert_eq(kvr_client_stat(C, "a", &x), 0);
    cr_assert_not(x.pinned);
    cr_assert_eq(x.n_tokens, 10);
    cr_assert_gt(x.bytes, 0);

    cr_assert_eq(kvr_client_delete(C, "a"), 0);
    cr_assert_eq(kvr_client_stat(C, "a", &x), KVR_ENOCTX);
    cr_assert(strlen(kvr_client_last_error(C)) > 0);
    cr_assert_eq(kvr_client_delete(C, "a"), KVR_ENOCTX);

    kvr_metric *ms;
    cr_assert_eq(kvr_client_stats(C, &ms, &n), 0);
    double v;
    cr_assert(kvr_metric_find(ms, n, "contexts", &v));
    cr_assert_float_eq(v, 2.0, 1e-9);
    cr_assert(kvr_metric_find(ms, n, "models", &v));
    cr_assert_float_eq(v, 2.0, 1e-9);
    cr_assert(kvr_metric_find(ms, n, "mem_cap_bytes", &v));
    kvr_client_free(ms);
}

Test(int_basic, deferred_deletes_ride_with_the_next_call)
{
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    for (int i = 0; i < 4; i++) {
        char id[16];
        snprintf(id, sizeof id, "d%d", i);
        cr_assert_eq(testd_put(C, id, "m", KVR_DTYPE_F16, (uint32_t)i, 0, 0, 10), 0);
    }
    double reqs0 = testd_metric(C, "requests_delete");
    /* Queued, not sent: d0 is still there for another connection. */
    cr_assert_eq(kvr_client_delete_deferred(C, "d0"), 0);
    cr_assert_eq(kvr_client_delete_deferred(C, "never-was"), 0);   /* gone counts as done */
    cr_assert_eq(kvr_client_delete_deferred(C, ""), KVR_EINVAL);
    kvr_client *o = testd_connect(&D);
    cr_assert_not_null(o);
    kvr_context x;
    cr_assert_eq(kvr_client_stat(o, "d0", &x), 0);
    /* They ride with the next call (a put: after it, in the same write) and
     * are answered before it returns. */
    cr_assert_eq(testd_put(C, "d4", "m", KVR_DTYPE_F16, 4, 0, 0, 10), 0,
                 "%s", kvr_client_last_error(C));
    cr_assert_eq(kvr_client_stat(o, "d0", &x), KVR_ENOCTX);
    cr_assert_eq(kvr_client_stat(o, "d4", &x), 0);
    cr_assert_eq(kvr_client_deferred_failures(C, NULL, 0), 0);
    cr_assert_float_eq(testd_metric(C, "requests_delete") - reqs0, 2.0, 1e-9);

    /* Before a call whose answer has a payload (a get): its data is intact. */
    cr_assert_eq(kvr_client_delete_deferred(C, "d1"), 0);
    size_t len;
    void *want = testd_payload(2, T_LAYERS, 0, 10, KVR_DTYPE_F16, &len);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "d2", .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(kv.payload_len, len);
    cr_assert_eq(memcmp(kv.payload, want, len), 0);
    kvr_kv_release(&kv);
    free(want);
    cr_assert_eq(kvr_client_stat(o, "d1", &x), KVR_ENOCTX);
    /* ... and into a caller's buffer (received there with the message), a
     * deferred delete ahead of it, many times: bytes exact, still in step. */
    want = testd_payload(2, T_LAYERS, 0, 10, KVR_DTYPE_F16, &len);
    uint8_t *dst = malloc(len + 64);
    for (int i = 0; i < 50; i++) {
        memset(dst, 0xee, len + 64);
        cr_assert_eq(kvr_client_delete_deferred(C, "never-was"), 0);
        kvr_get_args gd = { .ctx_id = "d2", .dtype = KVR_DTYPE_F16, .dst = dst,
                            .dst_cap = len + 64 };
        cr_assert_eq(kvr_client_get(C, &gd, &kv), 0, "%s", kvr_client_last_error(C));
        cr_assert_eq(kv.payload, dst);
        cr_assert_eq(kv.payload_len, len);
        cr_assert_eq(memcmp(dst, want, len), 0);
        cr_assert_eq(dst[len], 0xee, "nothing written past the payload");
        kvr_kv_release(&kv);
        cr_assert_eq(kvr_client_ping(C, NULL), 0);
    }
    free(dst);
    free(want);

    /* A deferred failure is counted and kept; it does not fail the call it
     * rode with. d3 is busy while a put into it waits for its payload. */
    int raw = kvt_wire_open_put(D.sock, "d3", "m", KVROPE__PUT_MODE__APPEND,
                                kvr_payload_size(T_LAYERS, 1, T_HEADS, T_DIM, KVR_DTYPE_F16));
    cr_assert_geq(raw, 0);
    /* Until it is busy (a put meanwhile only appends to d3). */
    for (int i = 0; i < 200 && testd_put(o, "d3", "m", KVR_DTYPE_F16, 3, 0, 0, 1) != KVR_EBUSY;
         i++)
        kvt_sleep_ms(10);
    cr_assert_eq(kvr_client_delete_deferred(C, "d3"), 0);
    kvr_pong pong;
    cr_assert_eq(kvr_client_ping(C, &pong), 0, "%s", kvr_client_last_error(C));
    char msg[256];
    cr_assert_eq(kvr_client_deferred_failures(C, msg, sizeof msg), 1);
    cr_assert(strstr(msg, "d3") != NULL, "message '%s'", msg);
    /* kvr_client_flush sends what waits and returns the first failure. */
    cr_assert_eq(kvr_client_flush(C), 0);   /* nothing waits */
    cr_assert_eq(kvr_client_delete_deferred(C, "d3"), 0);
    cr_assert_eq(kvr_client_flush(C), KVR_EBUSY);
    cr_assert_eq(kvr_client_deferred_failures(C, NULL, 0), 2);
    close(raw);   /* its put is aborted: d3 is as it was */
    for (int i = 0; i < 200 && kvr_client_delete_deferred(C, "d3") == 0 &&
                    kvr_client_flush(C) == KVR_EBUSY; i++)
        kvt_sleep_ms(10);
    cr_assert_eq(kvr_client_stat(o, "d3", &x), KVR_ENOCTX);

    /* More than KVR_DEFER_MAX: the queue is flushed on its own. */
    for (int i = 0; i < KVR_DEFER_MAX + 5; i++)
        cr_assert_eq(kvr_client_delete_deferred(C, "d4"), 0);
    cr_assert_eq(kvr_client_flush(C), 0);
    cr_assert_eq(kvr_client_stat(o, "d4", &x), KVR_ENOCTX);
    kvr_client_close(o);
}
