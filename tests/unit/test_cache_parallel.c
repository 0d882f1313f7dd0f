/*
 * test_cache_parallel.c — the fork/join helper behind large gets, and a get
 * big enough to be split across threads: its keys must equal a single-
 * threaded re-rotation of the stored data, layer by layer.
 */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "cache/parallel.h"

static atomic_int hits[1000];

static int mark(void *ud, size_t i)
{
    (void)ud;
    atomic_fetch_add(&hits[i], 1);
    return 0;
}

static int fail_at_7(void *ud, size_t i)
{
    (void)ud;
    return i == 7 ? -42 : 0;
}

Test(parallel, every_index_once)
{
    for (unsigned th = 1; th <= 8; th++) {
        for (size_t i = 0; i < 1000; i++)
            atomic_store(&hits[i], 0);
        cr_assert_eq(kvr__par_for(1000, th, mark, NULL), 0);
        for (size_t i = 0; i < 1000; i++)
            cr_assert_eq(atomic_load(&hits[i]), 1, "index %zu with %u threads", i, th);
    }
    cr_assert_eq(kvr__par_for(0, 4, mark, NULL), 0);
}

Test(parallel, first_error_returned)
{
    cr_assert_eq(kvr__par_for(100, 3, fail_at_7, NULL), -42);
    cr_assert_eq(kvr__par_threads_for(1024), 1u);
}

#define NL 8
#define NH 8
#define ND 128
#define NT 300   /* 8 layers x 2 x 300 x 8 x 128 x 2 B = 9.4 MiB: threaded */

Test(parallel, large_get_rotation_matches_reference)
{
    kvr_store *s = NULL;
    kvr_error e = { 0 };
    kvr_store_config sc = { .block_tokens = 64 };
    cr_assert_eq(kvr_store_create(&s, &sc, &e), 0, "%s", e.msg);
    kvr_model_desc d = { .name = "m", .n_layers = NL, .n_kv_heads = NH, .head_dim = ND,
                         .dtype = KVR_DTYPE_F16 };
    kvr_rope_config_init(&d.rope);
    d.rope.head_dim = ND;
    d.rope.rotary_dim = ND;
    kvr_model_info mi;
    cr_assert_eq(kvr_store_model_register(s, &d, &mi, &e), 0, "%s", e.msg);

    uint32_t *tok = malloc(NT * sizeof *tok);
    for (size_t i = 0; i < NT; i++)
        tok[i] = (uint32_t)i;
    kvr_put_params p = { .ctx_id = "c", .model = "m", .mode = KVR_PUT_CREATE,
                         .n_layers = NL, .n_kv_heads = NH, .head_dim = ND,
                         .dtype = KVR_DTYPE_F16, .n_tokens = NT, .tokens = tok };
    kvr_put *pt = NULL;
    cr_assert_eq(kvr_store_put_begin(s, &p, &pt, &e), 0, "%s", e.msg);
    size_t bytes = kvr_put_payload_size(pt);
    uint16_t *src = malloc(bytes);
    srand(7);
    for (size_t i = 0; i < bytes / 2; i++)
        src[i] = kvr_f32_to_f16((float)(rand() % 2001 - 1000) / 256.0f);
    const struct iovec *iov;
    size_t niov, off = 0;
    kvr_put_payload_iov(pt, &iov, &niov);
    for (size_t i = 0; i < niov; i++) {
        memcpy(iov[i].iov_base, (uint8_t *)src + off, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    if (kvr_put_needs_work(pt))
        cr_assert_eq(kvr_put_work(pt, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_put_commit(pt, NULL, &e), 0, "%s", e.msg);

    /* Shift everything after token 10 by +1000, as an edit near the start would. */
    cr_assert_eq(kvr_store_shift(s, "c", 10, NT, 1000, &e), 0, "%s", e.msg);
    cr_assert_geq(kvr__par_threads_for(bytes), 1u);

    kvr_get_params gp = { .ctx_id = "c", .start = 0, .end = SIZE_MAX,
                          .dtype = KVR_DTYPE_F16 };
    kvr_get *g = NULL;
    cr_assert_eq(kvr_store_get_begin(s, &gp, &g, &e), 0, "%s", e.msg);
    cr_assert(kvr_get_needs_work(g));
    cr_assert_eq(kvr_get_work(g, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_get_payload_size(g), bytes);
    uint8_t *got = malloc(bytes);
    off = 0;
    kvr_get_payload_iov(g, &iov, &niov);
    for (size_t i = 0; i < niov; i++) {
        memcpy(got + off, iov[i].iov_base, iov[i].iov_len);
        off += iov[i].iov_len;
    }

    int64_t *from = malloc(NT * sizeof *from), *to = malloc(NT * sizeof *to);
    for (size_t i = 0; i < NT; i++) {
        from[i] = (int64_t)i;
        to[i] = (int64_t)i + (i >= 10 ? 1000 : 0);
    }
    size_t slab = (size_t)NT * NH * ND * 2;
    uint16_t *want = malloc(slab);
    for (size_t l = 0; l < NL; l++) {
        const uint8_t *k = (const uint8_t *)src + l * 2 * slab;
        cr_assert_eq(kvr_rope_reposition(mi.engine, want, KVR_DTYPE_F16, k, KVR_DTYPE_F16,
                                         NT, NH, from, to, NULL), 0);
        cr_assert_eq(memcmp(got + l * 2 * slab, want, slab), 0, "keys of layer %zu", l);
        cr_assert_eq(memcmp(got + l * 2 * slab + slab, k + slab, slab), 0,
                     "values of layer %zu", l);
    }
    kvr_get_end(g);
    free(want);
    free(from);
    free(to);
    free(got);
    free(src);
    free(tok);
    kvr_store_destroy(s);
}
