/*
 * test_int_errors.c — every bad input gets its own code, a message, and the
 * daemon (and the same connection, where the protocol allows) carries on
 * with nothing stored lost; plus RoPE correctness of gets at new positions
 * and after shifts, checked against rope/ applied locally.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt_bench.h"

static kvr_testd D;
static kvr_client *C;

static void setup(void)
{
    C = kvt_daemon_up(&D, NULL);
    cr_assert_eq(testd_register(C, "m", KVR_DTYPE_F16, NULL), 0);
    cr_assert_eq(testd_put(C, "keep", "m", KVR_DTYPE_F16, 3, 0, 0, 64), 0);
}

static void teardown(void)
{
    kvt_daemon_down(&D, &C, NULL);
}

TestSuite(int_errors, .init = setup, .fini = teardown, .timeout = 120);

/* After an error: the connection still works and "keep" is intact. */
static void still_fine(void)
{
    cr_assert_eq(kvr_client_ping(C, NULL), 0, "connection unusable: %s", kvr_client_last_error(C));
    kvr_context x;
    cr_assert_eq(kvr_client_stat(C, "keep", &x), 0);
    cr_assert_eq(x.n_tokens, 64);
    cr_assert(testd_alive(&D));
}

static int put_with(const char *ctx, const char *model, kvr_put_mode mode, uint32_t layers,
                    uint32_t heads, uint32_t dim, kvr_dtype dt, size_t n, long len_delta,
                    uint64_t fp)
{
    size_t len = kvr_payload_size(layers, n, heads, dim, dt);
    size_t real = (size_t)((long)len + len_delta);
    void *pl = calloc(1, real + 1);
    uint32_t *tok = testd_tokens(0, n);
    /* Shape fields left to the daemon when they would make the client's own
     * length check fire: the daemon must be the one refusing. */
    kvr_put_args a = { .ctx_id = ctx, .model = model, .mode = mode, .dtype = dt, .tokens = tok,
                       .n_tokens = n, .n_layers = len_delta ? 0 : layers,
                       .n_kv_heads = len_delta ? 0 : heads, .head_dim = len_delta ? 0 : dim,
                       .payload = pl, .payload_len = real, .fingerprint = fp };
    int r = kvr_client_put(C, &a, NULL);
    free(pl);
    free(tok);
    return r;
}

Test(int_errors, unknown_model_and_context)
{
    cr_assert_eq(put_with("x", "ghost", KVR_PUT_UPSERT, T_LAYERS, T_HEADS, T_DIM,
                          KVR_DTYPE_F16, 4, 0, 0), KVR_ENOMODEL);
    cr_assert(strlen(kvr_client_last_error(C)) > 0);
    still_fine();
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "nope", .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), KVR_ENOCTX);
    still_fine();
    cr_assert_eq(kvr_client_shift(C, "nope", 0, 1, 1), KVR_ENOCTX);
    cr_assert_eq(kvr_client_keep(C, "nope", 0, 1), KVR_ENOCTX);
    cr_assert_eq(kvr_client_pin(C, "nope", true), KVR_ENOCTX);
    cr_assert_eq(put_with("nope", "m", KVR_PUT_APPEND, T_LAYERS, T_HEADS, T_DIM,
                          KVR_DTYPE_F16, 4, 0, 0), KVR_ENOCTX);
    still_fine();
}

Test(int_errors, shape_and_dtype_mismatch)
{
    cr_assert_eq(put_with("x", "m", KVR_PUT_UPSERT, T_LAYERS + 1, T_HEADS, T_DIM,
                          KVR_DTYPE_F16, 4, 0, 0), KVR_ESHAPE);
    still_fine();
    cr_assert_eq(put_with("x", "m", KVR_PUT_UPSERT, T_LAYERS, T_HEADS, T_DIM * 2,
                          KVR_DTYPE_F16, 4, 0, 0), KVR_ESHAPE);
    still_fine();
    /* Appending in a different dtype than the context holds is allowed to
     * convert or refuse, but a bad dtype number never passes. */
    kvr_context x;
    cr_assert_eq(kvr_client_stat(C, "x", &x), KVR_ENOCTX, "a refused put created 'x'");
}

Test(int_errors, payload_length_mismatch)
{
    cr_assert_eq(put_with("x", "m", KVR_PUT_UPSERT, T_LAYERS, T_HEADS, T_DIM, KVR_DTYPE_F16,
                          8, -2, 0), KVR_EPAYLOAD);
    still_fine();
    cr_assert_eq(put_with("x", "m", KVR_PUT_UPSERT, T_LAYERS, T_HEADS, T_DIM, KVR_DTYPE_F16,
                          8, 64, 0), KVR_EPAYLOAD);
    still_fine();
    /* The client refuses a length it can see is wrong, without a round trip. */
    size_t len = kvr_payload_size(T_LAYERS, 8, T_HEADS, T_DIM, KVR_DTYPE_F16);
    uint32_t tok[8] = { 0 };
    char *pl = calloc(1, len);
    kvr_put_args a = { .mode = KVR_PUT_UPSERT, .ctx_id = "x", .model = "m", .dtype = KVR_DTYPE_F16, .tokens = tok,
                       .n_tokens = 8, .n_layers = T_LAYERS, .n_kv_heads = T_HEADS,
                       .head_dim = T_DIM, .payload = pl, .payload_len = len - 1 };
    cr_assert_eq(kvr_client_put(C, &a, NULL), KVR_EPAYLOAD);
    free(pl);
    still_fine();
}

Test(int_errors, range_out_of_bounds)
{
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "keep", .dtype = KVR_DTYPE_F16, .start = 10, .end = 65 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), KVR_ERANGE);
    still_fine();
    g.start = 100;
    g.end = 0;
    cr_assert_eq(kvr_client_get(C, &g, &kv), KVR_ERANGE);
    still_fine();
    uint32_t layers[] = { 0, T_LAYERS };
    g = (kvr_get_args){ .ctx_id = "keep", .dtype = KVR_DTYPE_F16, .layers = layers,
                        .n_layers = 2 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), KVR_ERANGE);
    still_fine();
    cr_assert_eq(kvr_client_shift(C, "keep", 10, 70, 5), KVR_ERANGE);
    cr_assert_eq(kvr_client_keep(C, "keep", 0, 65), KVR_ERANGE);
    still_fine();
}

Test(int_errors, duplicate_and_fingerprint)
{
    cr_assert_eq(put_with("keep", "m", KVR_PUT_CREATE, T_LAYERS, T_HEADS, T_DIM,
                          KVR_DTYPE_F16, 4, 0, 0), KVR_EEXIST);
    still_fine();
    kvr_model m;
    cr_assert_eq(kvr_client_model_get(C, "m", &m), 0);
    cr_assert_eq(put_with("fp", "m", KVR_PUT_UPSERT, T_LAYERS, T_HEADS, T_DIM, KVR_DTYPE_F16,
                          4, 0, m.fingerprint ^ 1), KVR_EFINGERPRINT);
    still_fine();
    cr_assert_eq(put_with("fp", "m", KVR_PUT_UPSERT, T_LAYERS, T_HEADS, T_DIM, KVR_DTYPE_F16,
                          4, 0, m.fingerprint), 0, "%s", kvr_client_last_error(C));
    /* A model name re-registered with other parameters. */
    kvr_rope_config rc;
    kvr_rope_config_init(&rc);
    rc.theta = 12345.0;
    kvr_model_params p = { .name = "m", .n_layers = T_LAYERS, .n_kv_heads = T_HEADS,
                           .head_dim = T_DIM, .dtype = KVR_DTYPE_F16, .rope = &rc };
    cr_assert_eq(kvr_client_model_register(C, &p, NULL), KVR_EEXIST);
    still_fine();
}

Test(int_errors, bad_config_and_arguments)
{
    cr_assert_eq(kvr_client_model_register_json(C, "bad", "{\"rope_theta\": -1, "
                                                "\"num_hidden_layers\": 2, \"hidden_size\": 64,"
                                                "\"num_attention_heads\": 4}", NULL,
                                                KVR_DTYPE_F16, NULL), KVR_ECONFIG);
    still_fine();
    cr_assert_eq(kvr_client_model_register_json(C, "bad", "not json", NULL, KVR_DTYPE_F16, NULL),
                 KVR_ECONFIG);
    still_fine();
    /* Client-side refusals need no daemon round trip. */
    char big[300];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    cr_assert_eq(kvr_client_delete(C, big), KVR_EINVAL);
    cr_assert_eq(kvr_client_delete(C, ""), KVR_EINVAL);
    still_fine();
    /* Wrong count of target positions. */
    int64_t pos[3] = { 1, 2, 3 };
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "keep", .dtype = KVR_DTYPE_F16, .positions = pos,
                       .n_positions = 3 };
    int r = kvr_client_get(C, &g, &kv);
    cr_assert(r == KVR_EBADREQUEST || r == KVR_ERANGE || r == KVR_EINVAL, "got %d", r);
    still_fine();
}

Test(int_errors, connect_failures)
{
    kvr_client *c;
    cr_assert_eq(kvr_client_connect(&c, "/nonexistent/dir/sock", NULL), KVR_ESYS);
    cr_assert_null(c);
    cr_assert(strlen(kvr_client_last_error(NULL)) > 0);
    cr_assert_eq(kvr_client_connect(&c, "nocolon", NULL), KVR_EINVAL);
    cr_assert_str_eq(kvr_error_name(KVR_ENOCTX), "KVR_ENOCTX");
    cr_assert_str_eq(kvr_strerror(KVR_ENOCTX), "unknown context");
    still_fine();
}

/* ---- rotation correctness ----------------------------------------------- */

static kvr_rope *local_rope(void)
{
    kvr_rope_config rc = kvt_rope_config(T_DIM, T_HEADS);
    kvr_rope *r = NULL;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_rope_create(&r, &rc, &err), 0, "%s", err.msg);
    return r;
}

/* Expected payload for tokens [t0, t0+n) of seed, stored at positions
 * from[], returned at to[]: keys re-rotated locally, values as stored. */
static float *expected(uint32_t seed, uint64_t t0, size_t n, const int64_t *from,
                       const int64_t *to)
{
    size_t len;
    float *w = testd_payload(seed, T_LAYERS, t0, n, KVR_DTYPE_F32, &len);
    kvr_rope *r = local_rope();
    size_t slab = n * T_HEADS * T_DIM;
    for (int l = 0; l < T_LAYERS; l++) {
        float *k = w + (size_t)l * 2 * slab;
        cr_assert_eq(kvr_rope_reposition(r, k, KVR_DTYPE_F32, k, KVR_DTYPE_F32, n, T_HEADS, from,
                                         to, NULL), 0);
    }
    kvr_rope_destroy(r);
    return w;
}

static void assert_close(const float *got, const float *want, size_t n, double tol)
{
    for (size_t i = 0; i < n; i++)
        cr_assert(fabs((double)got[i] - (double)want[i]) <= tol, "element %zu: %g vs %g", i,
                  (double)got[i], (double)want[i]);
}

Test(int_errors, get_at_new_positions_matches_local_rope)
{
    cr_assert_eq(testd_register(C, "f", KVR_DTYPE_F32, NULL), 0);
    const size_t n = 100;
    cr_assert_eq(testd_put(C, "r", "f", KVR_DTYPE_F32, 21, 0, 0, n), 0);
    int64_t from[100], to[100];
    for (size_t i = 0; i < n; i++) {
        from[i] = (int64_t)i;
        to[i] = (int64_t)(i * 7 % 13) + 5000 - (int64_t)i;   /* scattered, some repeats */
    }
    float *want = expected(21, 0, n, from, to);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "r", .dtype = KVR_DTYPE_F32, .positions = to,
                       .n_positions = n };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(kv.positions[i], to[i]);
    assert_close(kv.payload, want, kv.payload_len / 4, 2e-5);
    kvr_kv_release(&kv);
    free(want);
}

Test(int_errors, shift_rerotates_on_read)
{
    cr_assert_eq(testd_register(C, "f", KVR_DTYPE_F32, NULL), 0);
    const size_t n = 80;
    cr_assert_eq(testd_put(C, "r", "f", KVR_DTYPE_F32, 22, 0, 0, n), 0);
    /* Two shifts of the suffix compose: +300 then -100 = +200. */
    cr_assert_eq(kvr_client_shift(C, "r", 30, 80, 300), 0);
    cr_assert_eq(kvr_client_shift(C, "r", 30, 80, -100), 0);
    int64_t from[80], to[80];
    for (size_t i = 0; i < n; i++) {
        from[i] = (int64_t)i;
        to[i] = (int64_t)i + (i >= 30 ? 200 : 0);
    }
    float *want = expected(22, 0, n, from, to);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "r", .dtype = KVR_DTYPE_F32 };
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(kv.positions[i], to[i]);
    assert_close(kv.payload, want, kv.payload_len / 4, 2e-5);
    kvr_kv_release(&kv);
    /* keep the shifted part; it still reads at its shifted positions. */
    cr_assert_eq(kvr_client_keep(C, "r", 30, 80), 0);
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0);
    cr_assert_eq(kv.n_tokens, 50);
    cr_assert_eq(kv.positions[0], 230);
    float *want2 = expected(22, 30, 50, from + 30, to + 30);
    assert_close(kv.payload, want2, kv.payload_len / 4, 2e-5);
    kvr_kv_release(&kv);
    free(want);
    free(want2);
}
