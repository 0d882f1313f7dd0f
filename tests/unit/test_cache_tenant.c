/*
 * test_cache_tenant.c — many tenants (issue 32): a bound per model
 * (kvr_store_config.max_memory_per_model) keeps one model's flood of puts
 * from evicting another model's hot prefixes. Two tenants, one flooding:
 * with the bound the other's hot set stays (and still matches), the
 * flooder evicts only its own least recently used contexts, and the
 * per-model figures (bytes, evictions, matches and hits, refusals) say so;
 * without it the flood takes the hot set (why the bound exists). A write
 * over the bound by itself is refused with nothing evicted.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt_store.h"

#define L 4
#define H 4
#define D 64
#define B 64
#define CTX_TOK 128                      /* 512 KiB of f16 K/V a context */
#define CTX_BYTES ((size_t)CTX_TOK * 2 * L * H * D * 2)

static kvr_store *mk(size_t cap, size_t bound)
{
    kvr_store *s;
    kvr_error e = { 0 };
    kvr_store_config c = { .max_memory = cap, .block_tokens = B,
                           .max_memory_per_model = bound };
    cr_assert_eq(kvr_store_create(&s, &c, &e), 0, "%s", e.msg);
    const char *names[] = { "hot", "flood" };
    for (int i = 0; i < 2; i++) {
        kvr_model_desc d = { .name = names[i], .n_layers = L, .n_kv_heads = H,
                             .head_dim = D, .dtype = KVR_DTYPE_F16 };
        kvr_rope_config_init(&d.rope);
        cr_assert_eq(kvr_store_model_register(s, &d, NULL, &e), 0, "%s", e.msg);
    }
    return s;
}

static uint32_t *toks(uint32_t seed, size_t n)
{
    uint32_t *t = malloc(n * sizeof *t);
    for (size_t i = 0; i < n; i++)
        t[i] = seed * 10000u + (uint32_t)i;
    return t;
}

static int put(kvr_store *s, const char *model, const char *id, uint32_t seed, size_t n,
               kvr_error *e)
{
    uint32_t *t = toks(seed, n);
    kvr_put_params p = { .ctx_id = id, .model = model, .n_layers = L, .n_kv_heads = H,
                         .head_dim = D, .dtype = KVR_DTYPE_F16, .n_tokens = n, .tokens = t };
    uint8_t byte = (uint8_t)(seed & 0x7f);
    int rc = kvt_put_try(s, &p, kvt_fill_memset, &byte, NULL, e);
    free(t);
    return rc;
}

static size_t match(kvr_store *s, const char *model, uint32_t seed)
{
    uint32_t *t = toks(seed, CTX_TOK);
    kvr_match_result r;
    cr_assert_eq(kvr_store_match(s, model, t, CTX_TOK, false, &r, NULL), 0);
    free(t);
    return r.length;
}

static kvr_model_info info(kvr_store *s, const char *model)
{
    kvr_model_info mi;
    cr_assert_eq(kvr_store_model_find(s, model, &mi), 0);
    return mi;
}

/* Eight hot contexts, then 100 contexts of flood (50 MiB into a 16 MiB
 * cap), the hot set matched now and then as a live tenant would. */
static void run(kvr_store *s, size_t *hot_left)
{
    kvr_error e = { 0 };
    for (uint32_t i = 0; i < 8; i++) {
        char id[16];
        snprintf(id, sizeof id, "hot%u", i);
        cr_assert_eq(put(s, "hot", id, i + 1, CTX_TOK, &e), 0, "%s", e.msg);
    }
    for (uint32_t i = 0; i < 100; i++) {
        char id[16];
        snprintf(id, sizeof id, "f%u", i);
        cr_assert_eq(put(s, "flood", id, 1000 + i, CTX_TOK, &e), 0, "%s", e.msg);
        if (i % 10 == 0)
            (void)match(s, "hot", 1 + i / 10 % 8);
    }
    *hot_left = 0;
    for (uint32_t i = 0; i < 8; i++)
        *hot_left += match(s, "hot", i + 1) == CTX_TOK;
}

Test(tenant, flood_keeps_to_its_bound)
{
    kvr_store *s = mk(16u << 20, 6u << 20);
    size_t hot_left;
    run(s, &hot_left);
    cr_assert_eq(hot_left, 8, "the flood evicted %zu of the hot set", 8 - hot_left);
    kvr_model_info h = info(s, "hot"), f = info(s, "flood");
    cr_assert_eq(h.n_evicted_blocks, 0);
    cr_assert_gt(f.n_evicted_blocks, 0);
    cr_assert_leq(f.bytes, 6u << 20, "%zu", f.bytes);
    cr_assert_geq(h.bytes, 8 * CTX_BYTES);
    cr_assert_geq(h.n_match_hits, 8 + 10);
    cr_assert_eq(h.n_matches, h.n_match_hits);
    /* The flooder's newest contexts are there, its oldest are gone. */
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "f99", &ci, NULL), 0);
    cr_assert_neq(kvr_store_stat(s, "f0", &ci, NULL), 0);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_evicted_blocks, f.n_evicted_blocks);
    kvr_store_destroy(s);
}

/* Without the bound the same flood takes the hot set: global LRU. */
Test(tenant, without_a_bound_the_flood_takes_the_hot_set)
{
    kvr_store *s = mk(16u << 20, 0);
    size_t hot_left;
    run(s, &hot_left);
    cr_assert_lt(hot_left, 8);
    cr_assert_gt(info(s, "hot").n_evicted_blocks, 0);
    kvr_store_destroy(s);
}

/* A write over the bound by itself: refused, nothing evicted; one the
 * model's own contexts cannot make room for (pinned): refused, counted. */
Test(tenant, over_the_bound_refused)
{
    kvr_store *s = mk(64u << 20, 2u << 20);
    kvr_error e = { 0 };
    cr_assert_eq(put(s, "flood", "a", 1, CTX_TOK, &e), 0, "%s", e.msg);
    cr_assert_eq(put(s, "flood", "big", 2, 8 * CTX_TOK, &e), KVR_ETOOLARGE);
    cr_assert(strstr(e.msg, "max-memory-per-model"), "%s", e.msg);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "a", &ci, NULL), 0);
    cr_assert_eq(kvr_store_pin(s, "a", true, &e), 0, "%s", e.msg);
    cr_assert_eq(put(s, "flood", "b", 3, CTX_TOK, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_pin(s, "b", true, &e), 0, "%s", e.msg);
    cr_assert_eq(put(s, "flood", "c", 4, CTX_TOK, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_pin(s, "c", true, &e), 0, "%s", e.msg);
    cr_assert_eq(put(s, "flood", "d", 5, CTX_TOK, &e), KVR_ENOMEM);
    cr_assert(strstr(e.msg, "bound"), "%s", e.msg);
    cr_assert_eq(info(s, "flood").n_refused_bound, 2);
    /* The other model is not bounded by this one's use. */
    cr_assert_eq(put(s, "hot", "h", 6, CTX_TOK, &e), 0, "%s", e.msg);
    kvr_store_destroy(s);
}
