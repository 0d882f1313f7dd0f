/*
 * test_int_load.c — the daemon under load: 16 client threads doing
 * put/get/match with verification, and eviction under a small memory cap
 * (the cap is never exceeded by more than one block; pinned data survives).
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>

#include "tests/common/kvr_testd.h"
#include "tests/common/kvt_daemon.h"

static kvr_testd D;

static void teardown(void) { testd_stop(&D); }

/* ---- 16 concurrent clients ---------------------------------------------- */

#define N_THREADS 16
#define N_ROUNDS  12

static atomic_int failures;
static char first_failure[512];
static pthread_mutex_t fail_mu = PTHREAD_MUTEX_INITIALIZER;

static void fail(int t, int round, const char *what, int code, kvr_client *c)
{
    atomic_fetch_add(&failures, 1);
    pthread_mutex_lock(&fail_mu);
    if (!first_failure[0])
        snprintf(first_failure, sizeof first_failure, "thread %d round %d: %s: %d %s", t, round,
                 what, code, c ? kvr_client_last_error(c) : "");
    pthread_mutex_unlock(&fail_mu);
}

static void *worker(void *arg)
{
    int t = (int)(intptr_t)arg;
    kvr_client *c = testd_connect(&D);
    if (!c) {
        fail(t, -1, "connect", 0, NULL);
        return NULL;
    }
    for (int round = 0; round < N_ROUNDS; round++) {
        char ctx[64];
        snprintf(ctx, sizeof ctx, "t%d-r%d", t, round);
        uint32_t seed = (uint32_t)(t * 1000 + round);
        uint32_t base = (uint32_t)(t * 1000000 + round * 10000);
        size_t n = 40 + (size_t)((t * 7 + round * 13) % 90);
        int r = testd_put(c, ctx, "m", KVR_DTYPE_F16, seed, base, 0, n);
        if (r) {
            fail(t, round, "put", r, c);
            continue;
        }
        size_t len;
        void *want = testd_payload(seed, T_LAYERS, 0, n, KVR_DTYPE_F16, &len);
        kvr_kv kv;
        kvr_get_args g = { .ctx_id = ctx, .dtype = KVR_DTYPE_F16 };
        r = kvr_client_get(c, &g, &kv);
        if (r || kv.payload_len != len || memcmp(kv.payload, want, len) != 0 ||
            kv.tokens[0] != base)
            fail(t, round, "get", r, c);
        kvr_kv_release(&kv);

        uint32_t *q = testd_tokens(base, n + 5);
        q[n] = 7;   /* diverges after n */
        kvr_match_args m = { .model = "m", .tokens = q, .n_tokens = n + 5, .get = (round & 1),
                             .dtype = KVR_DTYPE_F16 };
        kvr_match_res mr;
        r = kvr_client_match(c, &m, &mr);
        if (r || mr.length != n || strcmp(mr.ctx_id, ctx) != 0)
            fail(t, round, "match", r, c);
        else if (m.get && (!mr.has_kv || mr.kv.payload_len != len ||
                           memcmp(mr.kv.payload, want, len) != 0))
            fail(t, round, "match+get", r, c);
        kvr_kv_release(&mr.kv);
        free(q);
        free(want);
        if (round % 3 == 2 && (r = kvr_client_delete(c, ctx)) != 0)
            fail(t, round, "delete", r, c);
    }
    kvr_client_close(c);
    return NULL;
}

Test(int_load, sixteen_clients, .fini = teardown, .timeout = 300)
{
    kvr_client *c = kvt_daemon_up_model(&D, NULL, "m", KVR_DTYPE_F16);
    pthread_t th[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i), 0);
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(th[i], NULL);
    cr_assert_eq(atomic_load(&failures), 0, "%d failures; first: %s", atomic_load(&failures),
                 first_failure);
    kvr_context *xs;
    size_t n;
    cr_assert_eq(kvr_client_list(c, NULL, &xs, &n), 0);
    cr_assert_eq(n, (size_t)N_THREADS * (N_ROUNDS - N_ROUNDS / 3));
    kvr_client_free(xs);
    kvr_client_close(c);
}

/* ---- eviction under a cap ------------------------------------------------ */

Test(int_load, eviction_under_small_cap, .fini = teardown, .timeout = 300)
{
    const char *args[] = { "--max-memory", "8M", "--block-tokens", "32", NULL };
    kvr_client *c = kvt_daemon_up_model(&D, args, "m", KVR_DTYPE_F32);
    /* One block: 32 tokens of all layers, K and V, f32. */
    const double block = (double)kvr_payload_size(T_LAYERS, 32, T_HEADS, T_DIM, KVR_DTYPE_F32);
    double cap = testd_metric(c, "mem_cap_bytes");
    cr_assert_float_eq(cap, 8.0 * 1024 * 1024, 1.0);

    /* A pinned context must survive everything. */
    cr_assert_eq(testd_put(c, "pinned", "m", KVR_DTYPE_F32, 99, 5000000, 0, 256), 0);
    cr_assert_eq(kvr_client_pin(c, "pinned", true), 0);

    /* ~24 MiB of puts through an 8 MiB cap. */
    const size_t n = 1024;   /* 384 KiB each at f32 */
    int refused = 0;
    for (int i = 0; i < 64; i++) {
        char ctx[32];
        snprintf(ctx, sizeof ctx, "c%02d", i);
        int r = testd_put(c, ctx, "m", KVR_DTYPE_F32, (uint32_t)i, (uint32_t)i * 10000, 0, n);
        if (r == KVR_ENOMEM)
            refused++;
        else
            cr_assert_eq(r, 0, "put %s: %s", ctx, kvr_client_last_error(c));
        double now = testd_metric(c, "mem_allocated_bytes");
        cr_assert_leq(now, cap + block, "after put %d: allocated %.0f over cap %.0f + block %.0f", i, now, cap,
                      block);
    }
    double peak = testd_metric(c, "mem_peak_bytes");
    cr_assert_leq(peak, cap + block, "peak %.0f over cap %.0f + block %.0f", peak, cap, block);
    cr_assert_gt(testd_metric(c, "evicted_blocks"), 0);
    cr_assert_lt(refused, 64, "every put was refused");

    /* The most recent context is intact, the pinned one too. */
    size_t len;
    void *want = testd_payload(63, T_LAYERS, 0, n, KVR_DTYPE_F32, &len);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = "c63", .dtype = KVR_DTYPE_F32 };
    cr_assert_eq(kvr_client_get(c, &g, &kv), 0, "%s", kvr_client_last_error(c));
    cr_assert_eq(kv.payload_len, len);
    cr_assert(memcmp(kv.payload, want, len) == 0);
    kvr_kv_release(&kv);
    free(want);
    want = testd_payload(99, T_LAYERS, 0, 256, KVR_DTYPE_F32, &len);
    g.ctx_id = "pinned";
    cr_assert_eq(kvr_client_get(c, &g, &kv), 0, "%s", kvr_client_last_error(c));
    cr_assert(memcmp(kv.payload, want, len) == 0);
    kvr_kv_release(&kv);
    free(want);
    /* The oldest was evicted (whole, or its tail). */
    kvr_context x;
    int r = kvr_client_stat(c, "c00", &x);
    cr_assert(r == KVR_ENOCTX || (r == 0 && x.n_tokens < n), "c00 survived whole");
    kvr_client_close(c);
}

/* ---- the block cache (cache/block.h) ------------------------------------- */

static void get_equals(kvr_client *c, const char *id, uint32_t seed, size_t n)
{
    size_t len;
    void *want = testd_payload(seed, T_LAYERS, 0, n, KVR_DTYPE_F32, &len);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = id, .dtype = KVR_DTYPE_F32 };
    cr_assert_eq(kvr_client_get(c, &g, &kv), 0, "%s", kvr_client_last_error(c));
    cr_assert_eq(kv.payload_len, len);
    cr_assert(memcmp(kv.payload, want, len) == 0, "%s (seed %u) differs", id, seed);
    kvr_kv_release(&kv);
    free(want);
}

/* Freed blocks stay in the daemon's cache (block_cache_bytes, inside
 * mem_allocated, outside block_bytes), puts that reuse them read back
 * exactly, and the idle purge gives them back. */
Test(int_load, block_cache_metric_reuse_and_idle_purge, .fini = teardown, .timeout = 120)
{
    /* The idle purge runs only when asked (--idle-purge: issue 32). */
    const char *args[] = { "--block-tokens", "32", "--idle-purge", "1", NULL };
    kvr_client *c = kvt_daemon_up_model(&D, args, "m", KVR_DTYPE_F32);
    cr_assert_eq(testd_metric(c, "block_cache_bytes"), 0);
    cr_assert_eq(testd_put(c, "a", "m", KVR_DTYPE_F32, 1, 100, 0, 96), 0);   /* 3 blocks */
    double bb = testd_metric(c, "block_bytes");
    cr_assert_gt(bb, 0);
    cr_assert_eq(kvr_client_delete(c, "a"), 0);
    cr_assert_eq(testd_metric(c, "block_bytes"), 0);
    cr_assert_eq(testd_metric(c, "block_cache_bytes"), bb);
    cr_assert_geq(testd_metric(c, "mem_allocated_bytes"), bb);
    /* Puts into reused blocks (fewer tokens than their previous owner). */
    for (uint32_t i = 0; i < 6; i++) {
        size_t len, n = 40 + i;
        void *pl = testd_payload(10 + i, T_LAYERS, 0, n, KVR_DTYPE_F32, &len);
        uint32_t *tok = testd_tokens(200, n);
        kvr_put_args a = { .mode = KVR_PUT_REPLACE, .ctx_id = "b", .model = "m",
                           .dtype = KVR_DTYPE_F32, .tokens = tok, .n_tokens = n,
                           .n_layers = T_LAYERS, .n_kv_heads = T_HEADS, .head_dim = T_DIM,
                           .payload = pl, .payload_len = len };
        cr_assert_eq(kvr_client_put(c, &a, NULL), 0, "%s", kvr_client_last_error(c));
        free(pl);
        free(tok);
        get_equals(c, "b", 10 + i, 40 + i);
    }
    cr_assert_eq(kvr_client_delete(c, "b"), 0);
    cr_assert_gt(testd_metric(c, "block_cache_bytes"), 0);
    /* No request for a while: the idle purge empties the cache. */
    double left = -1;
    for (int tries = 0; tries < 10 && left != 0; tries++) {
        kvt_sleep_ms(3000);
        left = testd_metric(c, "block_cache_bytes");
    }
    cr_assert_eq(left, 0, "the idle purge left %.0f bytes in the block cache", left);
    cr_assert_eq(testd_metric(c, "block_bytes"), 0);
    kvr_client_close(c);
}
