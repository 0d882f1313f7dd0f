/*
 * test_cache_evict.c — the memory cap: LRU tail eviction, pins, leases,
 * KVR_ENOMEM without harm, and accounting back to the baseline.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt_store.h"

#define L 2
#define H 2
#define D 8
#define B 8

static void fill(uint8_t *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(seed * 31u + i * 7u);
}

/* A kvt_fill_fn: fill() of each iovec with the seed at arg. */
static void fill_seed(void *arg, void *p, size_t bytes)
{
    fill(p, bytes, *(const uint32_t *)arg);
}

/* A store of blocks of B tokens, capped at max_memory (0: none), with the
 * f16 model "m". */
static kvr_store *store_with_model(size_t max_memory)
{
    kvr_store_config c = { .block_tokens = B, .max_memory = max_memory };
    return kvt_store_with_model(&c, L, H, D, KVR_DTYPE_F16, NULL);
}

/* Destroys s: the memory accounted is back to base. */
static void destroy_all_freed(kvr_store *s, size_t base)
{
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

static kvr_store *setup(size_t extra_blocks, size_t *block_bytes)
{
    kvr_store *s = store_with_model(0);
    size_t with_model = kvr_mem_allocated();
    /* Measure a block: one context of one full block (a shorter context's
     * last block holds only what its tokens need). */
    size_t before = kvr_mem_allocated();
    uint32_t t[B] = { 0 };
    kvr_put_params p = { .ctx_id = "probe", .model = "m", .n_layers = L, .n_kv_heads = H,
                         .head_dim = D, .dtype = KVR_DTYPE_F16, .n_tokens = B, .tokens = t };
    kvr_put *tx;
    cr_assert_eq(kvr_store_put_begin(s, &p, &tx, NULL), 0);
    cr_assert_eq(kvr_put_commit(tx, NULL, NULL), 0);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    *block_bytes = st.block_bytes;
    size_t ctx_bytes = kvr_mem_allocated() - before;
    cr_assert_eq(kvr_store_delete(s, "probe", NULL), 0);
    /* Cap: current use + room for `extra_blocks` blocks and some metadata. */
    kvr_store_destroy(s);
    /* (4.5 KiB of slack: the allocations of libc malloc in sanitizer builds
     * carry a few more bytes than jemalloc's size classes; 1 KiB more for
     * the content index of covers, grain.h: a copy of each context's token
     * ids and the model's grain table, which the 8-token probe does not
     * show.) */
    return store_with_model(with_model + 4608 + 1024 + extra_blocks * *block_bytes + ctx_bytes);
}

static int put(kvr_store *s, const char *id, uint32_t seed, size_t n, kvr_error *e)
{
    uint32_t *tok = malloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = seed * 1000u + (uint32_t)i;
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = KVR_PUT_UPSERT, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F16,
                         .n_tokens = n, .tokens = tok };
    int rc = kvt_put_try(s, &p, fill_seed, &seed, NULL, e);
    free(tok);
    return rc;
}

/* Checks that ctx `id` (put with one put of `n` tokens and `seed`) still
 * holds its first `n` tokens intact. */
static void check_intact(kvr_store *s, const char *id, uint32_t seed, size_t n)
{
    kvr_get_params p = { .ctx_id = id, .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    kvr_get *g;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0, "%s: %s", id, e.msg);
    cr_assert_eq(kvr_get_get_info(g)->n_tokens, n);
    const struct iovec *iov;
    size_t niov, off = 0, total = kvr_get_payload_size(g);
    kvr_get_payload_iov(g, &iov, &niov);
    uint8_t *exp = malloc(total);
    fill(exp, total, seed);
    for (size_t i = 0; i < niov; i++) {
        cr_assert(memcmp(iov[i].iov_base, exp + off, iov[i].iov_len) == 0);
        off += iov[i].iov_len;
    }
    free(exp);
    kvr_get_end(g);
}

Test(cache_evict, lru_tail_eviction_under_cap)
{
    size_t base = kvr_mem_allocated(), bb;
    kvr_store *s = setup(10, &bb);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    size_t cap = st.mem_cap;
    kvr_error e = { 0 };
    char id[16];
    cr_assert_eq(put(s, "pinned", 99, 2 * B, &e), 0);
    cr_assert_eq(kvr_store_pin(s, "pinned", true, &e), 0);
    for (uint32_t i = 0; i < 30; i++) {
        snprintf(id, sizeof id, "c%u", i);
        cr_assert_eq(put(s, id, i, 2 * B, &e), 0, "%s", e.msg);
        cr_assert_leq(kvr_mem_allocated(), cap + bb, "cap exceeded by more than a block");
        if (i == 2) {
            /* Touch c0: it becomes most recently used. */
            check_intact(s, "c0", 0, 2 * B);
        }
    }
    kvr_store_get_stats(s, &st);
    cr_assert_gt(st.n_evicted_blocks, 0);
    check_intact(s, "pinned", 99, 2 * B);
    check_intact(s, "c29", 29, 2 * B);
    /* c1 (least recently used early) is gone; a partially evicted context
     * keeps its head, and the match still finds that head. */
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "c1", &ci, &e), KVR_ENOCTX);
    kvr_ctx_info *li;
    size_t n;
    cr_assert_eq(kvr_store_list(s, NULL, &li, &n, &e), 0);
    bool saw_partial = false;
    for (size_t i = 0; i < n; i++) {
        if (li[i].n_evicted_tokens) {
            saw_partial = true;
            cr_assert_eq(li[i].n_tokens, B);
            uint32_t seed = (uint32_t)atoi(li[i].id + 1);
            uint32_t q[2 * B];
            for (uint32_t k = 0; k < 2 * B; k++)
                q[k] = seed * 1000u + k;
            kvr_match_result mr;
            cr_assert_eq(kvr_store_match(s, "m", q, 2 * B, false, &mr, &e), 0);
            cr_assert_eq(mr.length, B);
            cr_assert_str_eq(mr.ctx_id, li[i].id);
        }
    }
    kvr_mem_free(li);
    (void)saw_partial;   /* depends on sizes; covered when it happens */
    destroy_all_freed(s, base);
}

/* A match hit keeps its context off the eviction tail as a get does: the
 * hit only marks it (store.c: no LRU links written on the match's path),
 * and the eviction that reaches it moves it to the head and takes the next
 * one. Contexts matched by no one go in the order they were used. */
Test(cache_evict, a_match_hit_keeps_its_context_like_a_get)
{
    size_t base = kvr_mem_allocated(), bb;
    kvr_store *s = setup(10, &bb);
    kvr_error e = { 0 };
    char id[16];
    for (uint32_t i = 0; i < 4; i++) {
        snprintf(id, sizeof id, "c%u", i);
        cr_assert_eq(put(s, id, i, 2 * B, &e), 0, "%s", e.msg);
    }
    uint32_t q[2 * B];
    for (uint32_t k = 0; k < 2 * B; k++)
        q[k] = 0 * 1000u + k;                  /* c0's tokens: the oldest context */
    kvr_match_result mr;
    cr_assert_eq(kvr_store_match(s, "m", q, 2 * B, false, &mr, &e), 0, "%s", e.msg);
    cr_assert_eq(mr.length, 2 * B);
    cr_assert_str_eq(mr.ctx_id, "c0");
    kvr_store_stats st0, st;
    kvr_store_get_stats(s, &st0);
    for (uint32_t i = 4; i < 7; i++) {
        snprintf(id, sizeof id, "c%u", i);
        cr_assert_eq(put(s, id, i, 2 * B, &e), 0, "%s", e.msg);
    }
    kvr_store_get_stats(s, &st);
    cr_assert_gt(st.n_evicted_blocks, st0.n_evicted_blocks, "the puts evicted nothing");
    check_intact(s, "c0", 0, 2 * B);           /* matched: kept whole */
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "c1", &ci, &e), KVR_ENOCTX, "c1 (used least recently) "
                 "should have gone first");
    check_intact(s, "c6", 6, 2 * B);
    /* Marked once, moved once: every context still here is read now, so
     * c0, used by nothing since its move, is the least recently used. */
    for (uint32_t i = 2; i < 7; i++) {
        snprintf(id, sizeof id, "c%u", i);
        kvr_get_params gp = { .ctx_id = id, .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
        kvr_get *g;
        if (kvr_store_get_begin(s, &gp, &g, &e) == 0)
            kvr_get_end(g);
    }
    cr_assert_eq(put(s, "c7", 7, 2 * B, &e), 0, "%s", e.msg);
    cr_assert_eq(put(s, "c8", 8, 2 * B, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_stat(s, "c0", &ci, &e), KVR_ENOCTX, "c0 was moved once for its "
                 "match and used by nothing since: it goes before the contexts read after it");
    destroy_all_freed(s, base);
}

/* The only context, matched (so marked) and at the head of the LRU list:
 * eviction still finds it (a second chance has nowhere to move it), and
 * the put that needs its room succeeds. */
Test(cache_evict, a_matched_head_is_still_a_victim)
{
    size_t base = kvr_mem_allocated(), bb;
    kvr_store *s = setup(2, &bb);
    kvr_error e = { 0 };
    cr_assert_eq(put(s, "a", 1, 2 * B, &e), 0, "%s", e.msg);
    uint32_t q[2 * B];
    for (uint32_t k = 0; k < 2 * B; k++)
        q[k] = 1 * 1000u + k;
    kvr_match_result mr;
    cr_assert_eq(kvr_store_match(s, "m", q, 2 * B, false, &mr, &e), 0, "%s", e.msg);
    cr_assert_str_eq(mr.ctx_id, "a");
    cr_assert_eq(put(s, "b", 2, 2 * B, &e), 0, "%s", e.msg);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_refused_nomem, 0);
    check_intact(s, "b", 2, 2 * B);
    destroy_all_freed(s, base);
}

Test(cache_evict, enomem_when_all_pinned_harms_nothing)
{
    size_t base = kvr_mem_allocated(), bb;
    kvr_store *s = setup(6, &bb);
    kvr_error e = { 0 };
    cr_assert_eq(put(s, "a", 1, 2 * B, &e), 0);
    cr_assert_eq(put(s, "b", 2, 2 * B, &e), 0);
    cr_assert_eq(kvr_store_pin(s, "a", true, &e), 0);
    cr_assert_eq(kvr_store_pin(s, "b", true, &e), 0);
    size_t mem = kvr_mem_allocated();
    int rc = put(s, "c", 3, 6 * B, &e);
    cr_assert_eq(rc, KVR_ENOMEM, "rc %d", rc);
    cr_assert(strstr(e.msg, "cap") != NULL, "%s", e.msg);
    cr_assert_eq(kvr_mem_allocated(), mem);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "c", &ci, &e), KVR_ENOCTX);
    check_intact(s, "a", 1, 2 * B);
    check_intact(s, "b", 2, 2 * B);
    /* Too large for the cap at all (so over what one request may use):
     * refused, nothing evicted. */
    cr_assert_eq(kvr_store_pin(s, "b", false, &e), 0);
    cr_assert_eq(put(s, "d", 4, 100 * B, &e), KVR_ETOOLARGE);
    check_intact(s, "b", 2, 2 * B);
    /* Unpinned b is evicted to make room for a fitting put. */
    cr_assert_eq(put(s, "c", 3, 4 * B, &e), 0, "%s", e.msg);
    check_intact(s, "a", 1, 2 * B);
    check_intact(s, "c", 3, 4 * B);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_geq(st.n_refused_nomem, 1);
    destroy_all_freed(s, base);
}

/* One request may reserve at most a quarter of the cap (4 MiB at least):
 * a larger put, edit or refresh is KVR_ETOOLARGE before anything is
 * evicted, so one request cannot empty the cache before sending a byte. */
Test(cache_evict, one_request_uses_at_most_a_quarter_of_the_cap)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = store_with_model(base + (64u << 20));
    kvr_error e = { 0 };
    size_t tok_bytes = 2u * L * H * D * 2;           /* K and V, f16 */
    size_t chunk = (4u << 20) / tok_bytes;          /* ~4 MiB per context */
    char id[16];
    for (int i = 0; i < 10; i++) {
        snprintf(id, sizeof id, "v%d", i);
        cr_assert_eq(put(s, id, (uint32_t)i + 1, chunk, &e), 0, "%s", e.msg);
    }
    kvr_store_stats st0, st1;
    kvr_store_get_stats(s, &st0);
    /* 20 MiB: over a quarter of the cap, though the cache could make room. */
    int rc = put(s, "big", 99, 5 * chunk, &e);
    cr_assert_eq(rc, KVR_ETOOLARGE, "rc %d: %s", rc, e.msg);
    cr_assert(strstr(e.msg, "quarter") != NULL, "%s", e.msg);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "big", &ci, NULL), KVR_ENOCTX);
    /* An edit inserting as many tokens: the same. */
    uint32_t *many = calloc(5 * chunk, sizeof *many);
    kvr_edit_op op = { 0, 0, 5 * chunk, many, false };
    kvr_edit_params ep = { .ctx_id = "v0", .ops = &op, .n_ops = 1, .with_kv = true,
                           .n_layers = L, .n_kv_heads = H, .head_dim = D,
                           .dtype = KVR_DTYPE_F16, .payload_bytes = 5 * chunk * tok_bytes };
    kvr_edit *et = NULL;
    rc = kvr_store_edit_begin(s, &ep, &et, &e);
    cr_assert_eq(rc, KVR_ETOOLARGE, "edit rc %d: %s", rc, e.msg);
    free(many);
    kvr_store_get_stats(s, &st1);
    cr_assert_eq(st1.n_evicted_blocks, st0.n_evicted_blocks, "a refused request evicted");
    for (int i = 0; i < 10; i++) {
        snprintf(id, sizeof id, "v%d", i);
        check_intact(s, id, (uint32_t)i + 1, chunk);
    }
    /* 8 MiB of payload (~12 MiB with block overhead) is allowed, evicting
     * the oldest to make room. */
    cr_assert_eq(put(s, "big", 99, 2 * chunk, &e), 0, "%s", e.msg);
    check_intact(s, "big", 99, 2 * chunk);
    destroy_all_freed(s, base);
}

Test(cache_evict, leased_blocks_survive_eviction)
{
    kvr_error e = { 0 };
    size_t base = kvr_mem_allocated(), bb;
    kvr_store *s = setup(6, &bb);
    cr_assert_eq(put(s, "old", 1, 2 * B, &e), 0);
    kvr_get_params p = { .ctx_id = "old", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    kvr_get *g;
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0);
    cr_assert_eq(put(s, "new", 2, 3 * B, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_pin(s, "new", true, &e), 0);
    /* old's blocks are leased: evicting old would free nothing, so there is
     * no room for another 5 blocks. */
    cr_assert_eq(put(s, "new2", 3, 5 * B, &e), KVR_ENOMEM);
    const struct iovec *iov;
    size_t niov, off = 0, total = kvr_get_payload_size(g);
    kvr_get_payload_iov(g, &iov, &niov);
    uint8_t *exp = malloc(total);
    fill(exp, total, 1);
    for (size_t i = 0; i < niov; i++) {
        cr_assert(memcmp(iov[i].iov_base, exp + off, iov[i].iov_len) == 0);
        off += iov[i].iov_len;
    }
    free(exp);
    kvr_get_end(g);
    cr_assert_eq(put(s, "new2", 3, 5 * B, &e), 0, "%s", e.msg);
    check_intact(s, "new", 2, 3 * B);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "old", &ci, &e), KVR_ENOCTX);
    destroy_all_freed(s, base);
}

/* A put whose declared payload length does not match its shape is refused
 * before anything is reserved: nothing is evicted (review finding: a client
 * could empty the cache with a put it never meant to send). */
Test(cache_evict, refused_length_evicts_nothing)
{
    size_t bb;
    kvr_store *s = setup(4, &bb);
    kvr_error e = { 0 };
    cr_assert_eq(put(s, "victim", 1, 4 * B, &e), 0, "%s", e.msg);
    size_t n = 64 * B;   /* would need every block the cap has, and more */
    uint32_t *tok = calloc(n, sizeof *tok);
    kvr_put_params p = { .ctx_id = "big", .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F16,
                         .n_tokens = n, .tokens = tok, .has_payload_bytes = true,
                         .payload_bytes = 0 };
    kvr_put *tx = NULL;
    cr_assert_eq(kvr_store_put_begin(s, &p, &tx, &e), KVR_EPAYLOAD);
    cr_assert_null(tx);
    cr_assert(strstr(e.msg, "payload_len 0") != NULL, "%s", e.msg);
    check_intact(s, "victim", 1, 4 * B);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "victim", &ci, NULL), 0);
    cr_assert_eq(ci.n_evicted_tokens, 0);
    cr_assert_eq(kvr_store_stat(s, "big", &ci, NULL), KVR_ENOCTX);
    free(tok);
    kvr_store_destroy(s);
}

/* Reads cannot evict the cache: a get's layer selection may not repeat a
 * layer (it multiplied staging up to 64x), and a get's staging is held to
 * the per-request limit (a quarter of the cap, 4 MiB at least) instead of
 * evicting whatever it takes. */
Test(cache_evict, reads_cannot_evict_the_cache)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = store_with_model(base + (32u << 20));
    kvr_error e = { 0 };
    for (int i = 0; i < 4; i++)            /* 40000 tokens: 5 MiB of f16 K/V */
        cr_assert_eq(put(s, "big", 7, 10000, &e), 0, "%s", e.msg);
    /* Others fill the cap to ~26 MiB (with block overhead). */
    char id[16];
    for (int i = 0; i < 5; i++) {
        snprintf(id, sizeof id, "o%d", i);
        cr_assert_eq(put(s, id, 8 + (uint32_t)i, 20000, &e), 0, "%s", e.msg);
    }
    kvr_store_stats st0, st1;
    kvr_store_get_stats(s, &st0);

    uint32_t dup[4] = { 0, 1, 0, 1 };
    kvr_get_params p = { .ctx_id = "big", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16,
                         .layers = dup, .n_layers_sel = 4 };
    kvr_get *g = NULL;
    int rc = kvr_store_get_begin(s, &p, &g, &e);
    cr_assert_eq(rc, KVR_EINVAL, "rc %d: %s", rc, e.msg);
    cr_assert(strstr(e.msg, "twice") != NULL, "%s", e.msg);
    uint32_t many[64 * L] = { 0 };
    p.layers = many;
    p.n_layers_sel = 64 * L;
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), KVR_EINVAL);
    uint32_t one[1] = { 1 };
    p.layers = one;
    p.n_layers_sel = 1;
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0, "%s", e.msg);
    kvr_get_end(g);

    /* All of it as f32: 10 MiB of staging, over the 8 MiB one request may
     * use; reserving it would evict other contexts. Begin reserves no
     * staging (issue 15); staging it for the iovecs is refused, and so is
     * work that would stage it, and the get is still whole to end. */
    p.layers = NULL;
    p.n_layers_sel = 0;
    p.dtype = KVR_DTYPE_F32;
    rc = kvr_store_get_begin(s, &p, &g, &e);
    cr_assert_eq(rc, 0, "rc %d: %s", rc, e.msg);
    cr_assert(kvr_get_needs_work(g));
    rc = kvr_get_stage(g, &e);
    cr_assert_eq(rc, KVR_ETOOLARGE, "rc %d: %s", rc, e.msg);
    rc = kvr_get_work(g, &e);
    cr_assert_eq(rc, KVR_ETOOLARGE, "rc %d: %s", rc, e.msg);
    kvr_get_end(g);
    kvr_store_get_stats(s, &st1);
    cr_assert_eq(st1.n_evicted_blocks, st0.n_evicted_blocks);
    cr_assert_eq(st1.n_leased_blocks, 0);
    for (int i = 0; i < 5; i++) {
        snprintf(id, sizeof id, "o%d", i);
        check_intact(s, id, 8 + (uint32_t)i, 20000);
    }
    /* A range of it is fine. */
    p.end = 10000;
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0, "%s", e.msg);
    kvr_get_end(g);
    destroy_all_freed(s, base);
}
