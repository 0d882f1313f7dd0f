/*
 * test_cache_block_cache.c — the store's cache of freed blocks
 * (kvr_store_config.block_cache, cache/block.h): accounting stays exact
 * (cached blocks out of block bytes and n_blocks, in mem_allocated, and
 * everything back at trim and destroy), a reused block gives the same data
 * as a fresh one (plain and quantized, fewer tokens than its previous
 * owner, appends into its free slots), it stays bounded (KVR_BLOCK_CACHE_N,
 * max_memory / 16), and it is dropped at the memory cap before anything is
 * evicted, while eviction itself never fills it.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "cache/block.h"
#include "tests/common/kvt_store.h"

#define L 3
#define H 2
#define D 8
#define B 16

static kvr_store *mk_store(size_t cap, size_t cache)
{
    kvr_store_config c = { .max_memory = cap, .block_tokens = B, .block_cache = cache };
    return kvt_store_new(&c);
}

static void mk_model(kvr_store *s, const char *name, const char *codec)
{
    kvr_model_desc d = kvt_model_desc(name, L, H, D, KVR_DTYPE_F16);
    d.codec = codec;
    kvt_model_add(s, &d, NULL);
}

/* A put of tokens [t0, t0+n) of a context seeded `seed` (f16 payload). */
static int put(kvr_store *s, const char *id, const char *model, kvr_put_mode mode,
               uint32_t seed, uint64_t t0, size_t n)
{
    uint32_t *tok = malloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = (uint32_t)(t0 + i + 7);
    kvr_put_params p = { .ctx_id = id, .model = model, .mode = mode, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F16,
                         .n_tokens = n, .tokens = tok };
    size_t bytes;
    void *pl = kvt_kv_payload(seed, L, H, D, t0, n, KVR_DTYPE_F16, &bytes);
    kvt_src src = { pl, bytes, 0 };
    kvr_error e = { 0 };
    int rc = kvt_put_try(s, &p, kvt_fill_src, &src, NULL, &e);
    if (rc == 0)
        cr_assert_eq(src.off, bytes);
    free(pl);
    free(tok);
    return rc;
}

/* The whole context as f32 (malloc'ed), its size in *n. */
static uint8_t *get_all(kvr_store *s, const char *id, size_t *n)
{
    kvr_get_params p = { .ctx_id = id, .start = 0, .end = SIZE_MAX, .dtype = KVR_DTYPE_F32 };
    return kvt_get_payload(s, &p, n, NULL);
}

static kvr_store_stats stats(const kvr_store *s)
{
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    return st;
}

static void del(kvr_store *s, const char *id)
{
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_delete(s, id, &e), 0, "%s", e.msg);
}

static bool exists(kvr_store *s, const char *id)
{
    kvr_ctx_info ci;
    kvr_error e = { 0 };
    return kvr_store_stat(s, id, &ci, &e) == 0;
}

/* Without a cache (the default) nothing is kept; with one, freed blocks
 * move from block bytes to cache bytes, mem_allocated counts them, a put
 * takes them back, and trim / destroy give every byte back. */
Test(block_cache, accounting_exact)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s0 = mk_store(0, 0);
    mk_model(s0, "m", NULL);
    size_t empty0 = kvr_mem_allocated();
    cr_assert_eq(put(s0, "a", "m", KVR_PUT_CREATE, 1, 0, 3 * B), 0);
    del(s0, "a");
    size_t left0 = kvr_mem_allocated() - empty0;   /* what a delete leaves without a cache */
    cr_assert_eq(stats(s0).block_cache_bytes, 0);
    cr_assert_eq(stats(s0).n_block_cache, 0);
    kvr_store_destroy(s0);
    cr_assert_eq(kvr_mem_allocated(), base);

    kvr_store *s = mk_store(0, 1u << 20);
    mk_model(s, "m", NULL);
    size_t empty = kvr_mem_allocated();
    cr_assert_eq(put(s, "a", "m", KVR_PUT_CREATE, 1, 0, 3 * B), 0);   /* 3 blocks */
    kvr_store_stats st = stats(s);
    cr_assert_eq(st.n_blocks, 3);
    size_t bb = st.block_bytes / 3;
    cr_assert_eq(st.block_bytes, 3 * bb);
    size_t with_a = kvr_mem_allocated();
    del(s, "a");
    st = stats(s);
    cr_assert_eq(st.n_blocks, 0);
    cr_assert_eq(st.block_bytes, 0);
    cr_assert_eq(st.n_block_cache, 3);
    cr_assert_eq(st.block_cache_bytes, 3 * bb);
    cr_assert_eq(st.mem_allocated, kvr_mem_allocated());
    size_t after_del = kvr_mem_allocated();
    cr_assert_eq(after_del - empty, left0 + 3 * bb, "the cached blocks stay allocated, and "
                 "only they: %zu vs %zu + %zu", after_del - empty, left0, 3 * bb);
    /* A put of two blocks takes two cached blocks: no new block memory.
     * (Whole blocks: a context's last partial block is sized to its tokens,
     * a geometry of its own.) */
    cr_assert_eq(put(s, "b", "m", KVR_PUT_CREATE, 2, 0, 2 * B), 0);
    st = stats(s);
    cr_assert_eq(st.n_blocks, 2);
    cr_assert_eq(st.block_bytes, 2 * bb);
    cr_assert_eq(st.n_block_cache, 1);
    cr_assert_eq(st.block_cache_bytes, bb);
    cr_assert_leq(kvr_mem_allocated(), with_a);
    /* REPLACE in a loop: memory steady, one block moving through the cache. */
    cr_assert_eq(put(s, "b", "m", KVR_PUT_REPLACE, 3, 0, 2 * B), 0);
    size_t steady = kvr_mem_allocated();
    for (uint32_t i = 0; i < 20; i++) {
        cr_assert_eq(put(s, "b", "m", KVR_PUT_REPLACE, 4 + i, 0, 2 * B), 0);
        cr_assert_eq(kvr_mem_allocated(), steady, "put %u", i);
        st = stats(s);
        cr_assert_eq(st.n_blocks, 2);
        cr_assert_eq(st.block_bytes + st.block_cache_bytes, 4 * bb);   /* old + new */
    }
    size_t cached = stats(s).block_cache_bytes;
    cr_assert_eq(kvr_store_trim(s), cached);
    cr_assert_eq(stats(s).block_cache_bytes, 0);
    cr_assert_eq(kvr_mem_allocated(), steady - cached);
    del(s, "b");
    cr_assert_eq(stats(s).block_cache_bytes, 2 * bb);
    kvr_store_destroy(s);   /* with blocks in the cache */
    cr_assert_eq(kvr_mem_allocated(), base);
}

/* A reused block (its previous owner's bytes still in it) reads back
 * exactly what a fresh block does: fewer tokens than the owner had, appends
 * into the free slots, plain and quantized (a quantized block's unwritten
 * bytes are zeroed again for the new fill). */
static void reuse_same_data(const char *codec)
{
    kvr_store *fresh = mk_store(0, 0), *s = mk_store(0, 1u << 20);
    mk_model(fresh, "m", codec);
    mk_model(s, "m", codec);
    /* Fill the cache with blocks full of another context's data. */
    cr_assert_eq(put(s, "old", "m", KVR_PUT_CREATE, 99, 0, 4 * B), 0);
    del(s, "old");
    cr_assert_eq(stats(s).n_block_cache, 4);
    /* (A context's last block is sized to its tokens, so only full
     * blocks come from the cache: the first put takes one.) */
    const size_t sizes[] = { B + 5, B + 3, 1 };
    uint64_t t0 = 0;
    for (int i = 0; i < 3; i++) {
        kvr_put_mode m = i ? KVR_PUT_APPEND : KVR_PUT_CREATE;
        cr_assert_eq(put(fresh, "c", "m", m, 7, t0, sizes[i]), 0);
        cr_assert_eq(put(s, "c", "m", m, 7, t0, sizes[i]), 0);
        t0 += sizes[i];
        size_t n0, n1;
        uint8_t *a = get_all(fresh, "c", &n0), *b = get_all(s, "c", &n1);
        cr_assert_eq(n0, n1);
        cr_assert(memcmp(a, b, n0) == 0, "%s: step %d: a reused block reads differently",
                  codec ? codec : "plain", i);
        free(a);
        free(b);
    }
    cr_assert_lt(stats(s).n_block_cache, 4, "the puts took cached blocks");
    /* A whole REPLACE cycle through the cache, compared again. */
    for (uint32_t k = 0; k < 5; k++) {
        cr_assert_eq(put(fresh, "r", "m", KVR_PUT_REPLACE, 20 + k, 0, 2 * B + k), 0);
        cr_assert_eq(put(s, "r", "m", KVR_PUT_REPLACE, 20 + k, 0, 2 * B + k), 0);
        size_t n0, n1;
        uint8_t *a = get_all(fresh, "r", &n0), *b = get_all(s, "r", &n1);
        cr_assert_eq(n0, n1);
        cr_assert(memcmp(a, b, n0) == 0, "%s: replace %u differs", codec ? codec : "plain", k);
        free(a);
        free(b);
    }
    kvr_store_destroy(fresh);
    kvr_store_destroy(s);
}

Test(block_cache, reuse_plain) { reuse_same_data(NULL); }
Test(block_cache, reuse_quantized_k4v2) { reuse_same_data("k4v2"); }
Test(block_cache, reuse_quantized_int8) { reuse_same_data("int8"); }

/* At most KVR_BLOCK_CACHE_N blocks and block_cache bytes, never over a
 * sixteenth of the memory cap. */
Test(block_cache, bounded)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = mk_store(0, 1u << 20);
    mk_model(s, "m", NULL);
    cr_assert_eq(put(s, "a", "m", KVR_PUT_CREATE, 1, 0, 20 * B), 0);
    del(s, "a");
    cr_assert_eq(stats(s).n_block_cache, KVR_BLOCK_CACHE_N);
    kvr_store_destroy(s);

    s = mk_store(0, 1);   /* under one block's bytes: nothing fits */
    mk_model(s, "m", NULL);
    cr_assert_eq(put(s, "a", "m", KVR_PUT_CREATE, 1, 0, 3 * B), 0);
    del(s, "a");
    cr_assert_eq(stats(s).n_block_cache, 0);
    kvr_store_destroy(s);

    size_t cap = kvr_mem_allocated() + (1u << 20);
    s = mk_store(cap, 1u << 30);
    mk_model(s, "m", NULL);
    cr_assert_eq(put(s, "a", "m", KVR_PUT_CREATE, 1, 0, 20 * B), 0);
    del(s, "a");
    kvr_store_stats st = stats(s);
    cr_assert_leq(st.block_cache_bytes, cap / 16);
    cr_assert_gt(st.n_block_cache, 0);
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

/* At the memory cap the cache goes before anything stored is evicted, and
 * what eviction frees goes back to the allocator, not into the cache. */
Test(block_cache, dropped_under_memory_pressure)
{
    size_t base = kvr_mem_allocated();
    size_t cap = base + (256u << 10);
    kvr_store *s = mk_store(cap, 1u << 20);
    mk_model(s, "m", NULL);
    char id[32];
    int n = 0;
    for (; n < 1000 && stats(s).n_evicted_blocks == 0; n++) {
        snprintf(id, sizeof id, "f%d", n);
        cr_assert_eq(put(s, id, "m", KVR_PUT_CREATE, (uint32_t)n, 0, B), 0);
        cr_assert_leq(kvr_mem_allocated(), cap);
    }
    cr_assert_gt(stats(s).n_evicted_blocks, 0, "the cap was reached");
    cr_assert_eq(stats(s).n_block_cache, 0, "eviction does not fill the cache");
    /* More puts at the cap: each evicts, none caches. */
    for (int k = 0; k < 5; k++, n++) {
        snprintf(id, sizeof id, "f%d", n);
        cr_assert_eq(put(s, id, "m", KVR_PUT_CREATE, (uint32_t)n, 0, B), 0);
        cr_assert_eq(stats(s).n_block_cache, 0);
        cr_assert_leq(kvr_mem_allocated(), cap);
    }
    /* Deleting the three newest caches their blocks... */
    for (int k = 1; k <= 3; k++) {
        snprintf(id, sizeof id, "f%d", n - k);
        del(s, id);
    }
    kvr_store_stats st = stats(s);
    cr_assert_eq(st.n_block_cache, 3);
    size_t evicted = st.n_evicted_blocks;
    /* ...and the next put at the cap (two blocks: more than the headroom
     * the deletes left) drops them instead of evicting. */
    snprintf(id, sizeof id, "f%d", n - 4);
    cr_assert(exists(s, id));
    cr_assert_eq(put(s, "new", "m", KVR_PUT_CREATE, 5, 0, 2 * B), 0);
    st = stats(s);
    cr_assert_eq(st.n_evicted_blocks, evicted, "nothing stored was evicted");
    cr_assert_eq(st.n_block_cache, 0);
    cr_assert(exists(s, id));
    cr_assert_leq(kvr_mem_allocated(), cap);
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

/* kvr_brun_iov's per-run path (up to 8 plain runs) gives the iovecs
 * kvr_block_kv gives, in the payload's order (layer, K then V, run). */
Test(block_cache, brun_iov_matches_block_kv)
{
    kvr_block_pool pool = { 0 };
    kvr_block_geom g;
    kvr_block_geom_plain(&g, B, L, H * D, KVR_DTYPE_F16);
    kvr_block *bs[10];
    for (int i = 0; i < 10; i++)
        cr_assert_not_null(bs[i] = kvr_block_create(&pool, &g, NULL, 0, NULL, 0));
    for (size_t n = 1; n <= 10; n++) {
        kvr_brun runs[10];
        for (size_t r = 0; r < n; r++)
            runs[r] = (kvr_brun){ .b = bs[r], .first = (uint32_t)(r % 5),
                                  .count = (uint32_t)(B - r % 5 - r % 3) };
        struct iovec iov[2 * L * 10];
        size_t k = kvr_brun_iov(runs, n, L, iov), j = 0;
        cr_assert_eq(k, 2 * L * n);
        for (uint32_t l = 0; l < L; l++)
            for (int kv = 0; kv < 2; kv++)
                for (size_t r = 0; r < n; r++, j++) {
                    cr_assert_eq(iov[j].iov_base, kvr_block_kv(bs[r], l, kv, runs[r].first),
                                 "n %zu: iovec %zu", n, j);
                    cr_assert_eq(iov[j].iov_len, (size_t)runs[r].count * H * D * 2);
                }
    }
    for (int i = 0; i < 10; i++)
        kvr_block_unref(&pool, bs[i]);
    cr_assert_eq(pool.n_blocks, 0);
    cr_assert_eq(pool.bytes, 0);
}
