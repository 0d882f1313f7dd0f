/*
 * test_cache_partial.c — a context's last block holds what its tokens need
 * (store.c's block_geom, put.c's growth): sized at the put that creates it,
 * grown as appends arrive (at least doubling, never over B), shrunk back
 * when a put is aborted; and such blocks behave as any other through
 * forks, edits, spills, reloads and restarts, plain and quantized (group
 * codecs and KIVI tiles whose last block is partial). Every check compares
 * a context built piecewise with one built by a single put, byte for byte,
 * and the store's accounting with the K/V its tokens need. A shape whose
 * layers do not add up to a size class (36 layers: Qwen2.5-3B's) has its
 * blocks cut in two allocations; the same checks hold for it.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_store.h"
#include "tests/common/cache_stream.h"

/* 4 KiB of f16 K/V per token: a 64-token block is 256 KiB, exactly a size
 * class, and a partial one of k tokens k * 4 KiB (a size class up to a few
 * percent). */
static uint32_t L = 4, H = 4, D = 64;   /* the model's shape (one per test) */
#define ROW (H * D)
#define B 64
#define TOK_KV ((size_t)2 * L * ROW * 2)

static char DIR_[256];

static kvr_store *open_store(size_t cap, bool tier)
{
    kvr_store_config cfg = { .max_memory = cap, .block_tokens = B };
    kvr_tier_config tc = { .dir = DIR_, .engine = 0 };
    return kvt_store_open(&cfg, tier ? &tc : NULL, false, NULL, L, H, D, KVR_DTYPE_F16);
}

/* Tokens [first, first + n) of the stream `seed` (the same values whatever
 * the split into puts), appended (or created). */
static int put_range(kvr_store *s, const char *id, const char *codec, uint32_t seed,
                     size_t first, size_t n, bool persist)
{
    kvr_error e = { 0 };
    kvt_range a = { .id = id, .codec = codec, .seed = seed, .n_layers = L, .n_heads = H,
                  .head_dim = D, .first = first, .n = n,
                  .mode = first ? KVR_PUT_APPEND : KVR_PUT_CREATE, .persist = persist };
    int rc = kvt_stream_put(s, &a, &e);
    cr_assert_eq(rc, 0, "put %s [%zu, +%zu): %s", id, first, n, e.msg);
    if (persist)
        cr_assert_geq(kvr_store_persist(s, id, NULL, NULL, &e), 0, "%s", e.msg);
    return rc;
}

static uint8_t *get_all(kvr_store *s, const char *id, size_t *len)
{
    kvr_error e = { 0 };
    uint8_t *g = kvt_get_all(s, id, len, &e);
    cr_assert_not_null(g, "get %s: %s", id, e.msg);
    return g;
}

static void same_ctx(kvr_store *s, const char *a, kvr_store *s2, const char *b, const char *what)
{
    size_t na, nb;
    uint8_t *x = get_all(s, a, &na), *y = get_all(s2, b, &nb);
    cr_assert_eq(na, nb, "%s: %zu vs %zu bytes", what, na, nb);
    cr_assert(memcmp(x, y, na) == 0, "%s: %s and %s differ", what, a, b);
    free(x);
    free(y);
}

static kvr_store_stats stats(const kvr_store *s)
{
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    return st;
}

/* The whole get of id is the nw bytes of want (codec and what name it in
 * failures). */
static void same_bytes(kvr_store *s, const char *id, const uint8_t *want, size_t nw,
                       const char *codec, const char *what)
{
    size_t n;
    uint8_t *g = get_all(s, id, &n);
    cr_assert_eq(n, nw, "codec '%s': %s length", codec, what);
    cr_assert(memcmp(g, want, n) == 0, "codec '%s': %s bytes differ", codec, what);
    free(g);
}

/* A 200-token context is three full blocks and one sized to its 8 tokens:
 * what is accounted is within a few percent of the K/V its tokens need. */
Test(partial, last_block_sized_at_the_put)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = open_store(0, false);
    put_range(s, "c", "", 1, 0, 200, false);
    kvr_store_stats st = stats(s);
    cr_assert_eq(st.n_blocks, 4);
    cr_assert_eq(st.kv_held_bytes, 200 * TOK_KV);
    /* Full blocks exactly 256 KiB; the last 32 KiB (8 tokens); metadata
     * and structs: a few hundred bytes each. */
    cr_assert_leq(st.block_bytes, 200 * TOK_KV + 4 * 2048, "%zu", st.block_bytes);
    cr_assert_geq((double)st.kv_held_bytes / (double)st.block_bytes, 0.97);
    /* Lengths 1 .. 3B+7: always within 3%. */
    for (size_t n = 1; n <= 3 * B + 7; n += 5) {
        char id[16];
        snprintf(id, sizeof id, "n%zu", n);
        put_range(s, id, "", 2, 0, n, false);
    }
    st = stats(s);
    cr_assert_geq((double)st.kv_held_bytes / (double)st.block_bytes, 0.97, "%zu / %zu",
                  st.kv_held_bytes, st.block_bytes);
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

/* Appends of 1, 2, 3, ... tokens grow the last block (a fresh block never
 * starts before the last one is full, so a context holds ceil(n / B)
 * blocks); every state reads exactly as a context put at once. */
Test(partial, appends_grow_the_last_block)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = open_store(0, false);
    size_t n = 0;
    for (size_t k = 1; n + k <= 4 * B + 9; k++) {
        put_range(s, "g", "", 3, n, k, false);
        n += k;
        put_range(s, "ref", "", 3, 0, n, false);
        same_ctx(s, "g", s, "ref", "appended vs whole");
        kvr_ctx_info ci;
        cr_assert_eq(kvr_store_stat(s, "g", &ci, NULL), 0);
        cr_assert_eq(ci.n_blocks, (n + B - 1) / B, "%zu tokens in %zu blocks", n, ci.n_blocks);
        cr_assert_eq(kvr_store_delete(s, "ref", NULL), 0);
    }
    /* Doubling: the last block is at most twice what its tokens need. */
    kvr_store_stats st = stats(s);
    cr_assert_leq(st.block_bytes, 2 * n * TOK_KV);
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

/* An aborted append leaves the context and the memory as they were, even
 * when it had grown the last block. */
Test(partial, aborted_append_shrinks_back)
{
    kvr_store *s = open_store(0, false);
    put_range(s, "c", "", 4, 0, 5, false);
    size_t n0, n1, mem = kvr_mem_allocated(), bytes = stats(s).block_bytes;
    uint8_t *before = get_all(s, "c", &n0);
    uint32_t tok[40] = { 0 };
    kvr_put_params pp = { .ctx_id = "c", .model = "m", .mode = KVR_PUT_APPEND,
                          .n_layers = L, .n_kv_heads = H, .head_dim = D,
                          .dtype = KVR_DTYPE_F16, .n_tokens = 40, .tokens = tok };
    kvr_put *t;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_put_begin(s, &pp, &t, &e), 0, "%s", e.msg);
    cr_assert_gt(stats(s).block_bytes, bytes, "the begin grew the block");
    kvr_put_abort(t);
    cr_assert_eq(stats(s).block_bytes, bytes);
    cr_assert_eq(kvr_mem_allocated(), mem);
    uint8_t *after = get_all(s, "c", &n1);
    cr_assert_eq(n0, n1);
    cr_assert(memcmp(before, after, n0) == 0);
    free(before);
    free(after);
    kvr_store_destroy(s);
}

/* A fork shares the partial last block: neither side grows it (copy on
 * write); appends to both, and a delete inside it, read as their
 * references do. */
Test(partial, forks_and_edits_of_a_partial_block)
{
    kvr_store *s = open_store(0, false);
    kvr_error e = { 0 };
    put_range(s, "a", "", 5, 0, B + 10, false);
    cr_assert_eq(kvr_store_fork(s, "a", "b", &e), 0, "%s", e.msg);
    put_range(s, "a", "", 5, B + 10, 7, false);
    put_range(s, "b", "", 5, B + 10, 30, false);
    put_range(s, "ra", "", 5, 0, B + 17, false);
    put_range(s, "rb", "", 5, 0, B + 40, false);
    same_ctx(s, "a", s, "ra", "fork source after its append");
    same_ctx(s, "b", s, "rb", "fork after its append");
    /* Delete tokens inside the last (partial) block of both. */
    kvr_edit_op op = { .start = B + 3, .end = B + 6, .n_tokens = 0 };
    const char *ids[] = { "b", "rb" };
    for (int i = 0; i < 2; i++) {
        kvr_edit_params p = { .ctx_id = ids[i], .ops = &op, .n_ops = 1 };
        kvr_edit *t;
        cr_assert_eq(kvr_store_edit_begin(s, &p, &t, &e), 0, "%s", e.msg);
        cr_assert_eq(kvr_edit_commit(t, NULL, NULL, &e), 0, "%s", e.msg);
    }
    same_ctx(s, "b", s, "rb", "after a delete in the partial block");
    put_range(s, "b", "", 6, 0 + 1000, 3, false);   /* a different stream: tokens differ */
    put_range(s, "rb", "", 6, 0 + 1000, 3, false);
    same_ctx(s, "b", s, "rb", "append after the edit");
    same_ctx(s, "a", s, "ra", "fork source untouched");
    kvr_store_destroy(s);
}

/* The K/V payload alone, in the store's f16 ([layer][K|V][token][row]). */
static uint8_t *get_kv_f16(kvr_store *s, const char *id, size_t *len)
{
    kvr_error e = { 0 };
    uint8_t *g = kvt_get_kv(s, id, KVR_DTYPE_F16, len, &e);
    cr_assert_not_null(g, "get %s: %s", id, e.msg);
    return g;
}

/* An editor's keystrokes: 20 edits in a row, each inserting 3 tokens with
 * their K/V somewhere in a 200-token context. Each edit's new tokens get a
 * block sized to them (not a whole B-token block), so what is accounted
 * stays within a few percent of the K/V the tokens need; the context reads
 * back the inserted values where they went and the old ones around them. */
Test(partial, edit_inserts_sized_to_their_tokens)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = open_store(0, false);
    kvr_error e = { 0 };
    put_range(s, "c", "", 7, 0, 200, false);
    size_t n = 200;
    const size_t row_b = (size_t)ROW * 2, K = 3;
    for (int i = 0; i < 20; i++) {
        size_t at = (size_t)(i * 37 + 11) % n;
        uint32_t tok[3] = { 5000u + (uint32_t)i, 6000u + (uint32_t)i, 7000u + (uint32_t)i };
        kvr_edit_op op = { .start = at, .end = at, .n_tokens = K, .tokens = tok };
        kvr_edit_params p = { .ctx_id = "c", .ops = &op, .n_ops = 1, .with_kv = true,
                              .n_layers = L, .n_kv_heads = H, .head_dim = D,
                              .dtype = KVR_DTYPE_F16, .payload_bytes = 2 * L * K * row_b };
        size_t before_n;
        uint8_t *before = get_kv_f16(s, "c", &before_n);
        kvr_edit *t;
        cr_assert_eq(kvr_store_edit_begin(s, &p, &t, &e), 0, "edit %d: %s", i, e.msg);
        const struct iovec *iov;
        size_t niov, w = 0;
        kvr_edit_payload_iov(t, &iov, &niov);
        for (size_t k = 0; k < niov; k++)   /* every payload byte: (edit, offset) */
            for (size_t b = 0; b < iov[k].iov_len; b++, w++)
                ((uint8_t *)iov[k].iov_base)[b] = (uint8_t)(i * 7 + (int)(w % 61));
        if (kvr_edit_needs_work(t))
            cr_assert_eq(kvr_edit_work(t, &e), 0, "%s", e.msg);
        cr_assert_eq(kvr_edit_commit(t, NULL, NULL, &e), 0, "edit %d: %s", i, e.msg);
        n += K;
        /* The get is laid out [layer][K|V][token][row]: old rows around
         * the insert are where they were, shifted by K past it (the keys
         * after it re-rotated, so only values are compared byte for
         * byte); the values of the new rows are the payload's. */
        size_t after_n;
        uint8_t *after = get_kv_f16(s, "c", &after_n);
        cr_assert_eq(after_n, before_n + 2 * L * K * row_b);
        size_t old_t = n - K;
        for (uint32_t l = 0; l < L; l++) {
            const uint8_t *vb = before + ((size_t)l * 2 + 1) * old_t * row_b;
            const uint8_t *va = after + ((size_t)l * 2 + 1) * n * row_b;
            cr_assert(memcmp(va, vb, at * row_b) == 0, "edit %d layer %u: values before", i, l);
            cr_assert(memcmp(va + (at + K) * row_b, vb + at * row_b, (old_t - at) * row_b) == 0,
                      "edit %d layer %u: values after the insert", i, l);
            size_t voff = ((size_t)l * 2 + 1) * K * row_b;   /* payload: [layer][K|V][tok] */
            for (size_t b = 0; b < K * row_b; b++)
                cr_assert_eq(va[at * row_b + b], (uint8_t)(i * 7 + (int)((voff + b) % 61)),
                             "edit %d layer %u: inserted value byte %zu", i, l, b);
        }
        free(before);
        free(after);
    }
    kvr_store_stats st = stats(s);
    cr_assert_eq(st.n_tokens, 260);
    cr_assert_eq(st.kv_held_bytes, 260 * TOK_KV);
    /* 20 inserted blocks of 3 tokens (12 KiB each, and their metadata) and
     * the split 200: a whole 64-token block per keystroke would be 5 MiB. */
    cr_assert_geq((double)st.kv_held_bytes / (double)st.block_bytes, 0.9, "%zu / %zu",
                  st.kv_held_bytes, st.block_bytes);
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

/* Partial blocks of every kind go to disk and come back exactly: spilled
 * under a small cap and reloaded, appended to after the reload (a block
 * with a disk copy is not grown: a new one follows), and recovered by a
 * restart. Plain, group codecs, KIVI tiles (32-token tiles in 64-token
 * blocks: a one-tile last quantized block), k4v2. */
static const char *CODECS[] = { "", "int4/g32", "kivi:k4v2:g32:r32", "k4v2", "q8_0" };
#define N_CODECS (sizeof CODECS / sizeof CODECS[0])

Test(partial, spill_reload_restart)
{
    kvt_tmpdir(DIR_, sizeof DIR_, "kvr-partial");
    kvr_store *s = open_store(3u << 20, true);
    uint8_t *want[N_CODECS];
    size_t nw[N_CODECS], lens[N_CODECS];
    for (size_t c = 0; c < N_CODECS; c++) {
        char id[16];
        snprintf(id, sizeof id, "p%zu", c);
        /* Piecewise, ending inside a block (and inside a tile). */
        size_t n = 0, steps[] = { 70, 1, 45, 3, 17 };
        for (size_t k = 0; k < 5; k++) {
            put_range(s, id, CODECS[c], 10 + (uint32_t)c, n, steps[k], true);
            n += steps[k];
        }
        lens[c] = n;
        kvr_store_persist_flush(s);
        want[c] = get_all(s, id, &nw[c]);
    }
    /* Push them all out of memory. */
    for (int i = 0; i < 12; i++) {
        char id[16];
        snprintf(id, sizeof id, "x%d", i);
        put_range(s, id, "", 100 + (uint32_t)i, 0, 3 * B + 5, false);
    }
    kvr_tier_stats ts;
    kvr_store_tier_stats(s, &ts);
    cr_assert_gt(ts.spilled_blocks, 0);
    for (size_t c = 0; c < N_CODECS; c++) {
        char id[16];
        snprintf(id, sizeof id, "p%zu", c);
        same_bytes(s, id, want[c], nw[c], CODECS[c], "reloaded");
        /* Append after the reload, then check against a fresh whole put of
         * the same stream and codec (plain: bit-exact; quantized: the same
         * tile boundaries, so the same bytes too). */
        put_range(s, id, CODECS[c], 10 + (uint32_t)c, lens[c], 20, true);
        lens[c] += 20;
        kvr_store_persist_flush(s);
        free(want[c]);
        want[c] = get_all(s, id, &nw[c]);
    }
    kvr_store_destroy(s);
    kvr_tier_recovery rec;
    kvr_store *r;
    kvr_error e = { 0 };
    kvr_store_config cfg = { .block_tokens = B };
    cr_assert_eq(kvr_store_create(&r, &cfg, &e), 0);
    kvr_tier_config tc = { .dir = DIR_, .engine = 0 };
    cr_assert_eq(kvr_store_tier_open(r, &tc, NULL, NULL, &rec, &e), 0, "%s", e.msg);
    cr_assert_eq(rec.contexts, N_CODECS);
    cr_assert_eq(rec.quarantined, 0);
    for (size_t c = 0; c < N_CODECS; c++) {
        char id[16];
        snprintf(id, sizeof id, "p%zu", c);
        same_bytes(r, id, want[c], nw[c], CODECS[c], "recovered");
        free(want[c]);
    }
    kvr_store_destroy(r);
    kvt_rmrf(DIR_);
}

/* Quantized contexts: the last quantized block holds its tiles only (a
 * one-tile block when one tile was flushed). Two puts and one put hold the
 * same tokens (their bytes differ within the codec's error: the second put
 * quantizes the first one's window from its f16 copy). */
Test(partial, quantized_last_block_sized_to_its_tiles)
{
    kvr_store *s = open_store(0, false);
    put_range(s, "q", "kivi:k4v2:g32:r32", 20, 0, 100, false);
    put_range(s, "w", "kivi:k4v2:g32:r32", 20, 0, 60, false);
    put_range(s, "w", "kivi:k4v2:g32:r32", 20, 60, 40, false);
    kvr_ctx_info a, b;
    cr_assert_eq(kvr_store_stat(s, "q", &a, NULL), 0);
    cr_assert_eq(kvr_store_stat(s, "w", &b, NULL), 0);
    cr_assert_eq(a.n_tokens, 100);
    cr_assert_eq(b.n_tokens, 100);
    /* 64 quantized tokens: one block of two 32-token tiles; 36 in the
     * window: one plain block sized to them. */
    cr_assert_eq(a.n_blocks, 2, "%zu blocks", a.n_blocks);
    size_t na, nb;
    uint8_t *x = get_all(s, "q", &na), *y = get_all(s, "w", &nb);
    size_t meta = 100 * (4 + 8 + 4);
    cr_assert_eq(na, nb);
    cr_assert(memcmp(x + na - meta, y + nb - meta, meta) == 0, "tokens / positions differ");
    free(x);
    free(y);
    put_range(s, "one", "kivi:k4v2:g32:r32", 21, 0, 64 + 32 + 5, false);
    cr_assert_eq(kvr_store_stat(s, "one", &a, NULL), 0);
    cr_assert_eq(a.n_blocks, 2, "%zu blocks", a.n_blocks);
    kvr_store_stats st = stats(s);
    cr_assert_geq((double)st.kv_held_bytes / (double)st.block_bytes, 0.85, "%zu / %zu",
                  st.kv_held_bytes, st.block_bytes);
    kvr_store_destroy(s);
}

/* Qwen2.5-3B's shape: 36 layers of 64 KiB a 64-token block, cut into 2 MiB
 * and 256 KiB (+ metadata). Sized, grown, spilled, reloaded and recovered
 * as any block, and the cap holds K/V. */
Test(partial, blocks_cut_in_two)
{
    L = 36;
    H = 2;
    D = 128;
    kvt_tmpdir(DIR_, sizeof DIR_, "kvr-partial");
    kvr_store *s = open_store(96u << 20, true);
    put_range(s, "whole", "", 30, 0, 3 * B + 10, true);
    kvr_store_stats st = stats(s);
    cr_assert_geq((double)st.kv_held_bytes / (double)st.block_bytes, 0.97, "%zu / %zu",
                  st.kv_held_bytes, st.block_bytes);
    size_t n = 0;
    for (size_t k = 1; n + k <= 2 * B + 3; k += 3) {
        put_range(s, "grown", "", 30, n, k, true);
        n += k;
    }
    put_range(s, "ref", "", 30, 0, n, false);
    same_ctx(s, "grown", s, "ref", "grown in two parts");
    kvr_store_persist_flush(s);
    size_t n0, n1;
    uint8_t *w0 = get_all(s, "whole", &n0), *w1 = get_all(s, "grown", &n1);
    for (int i = 0; i < 24; i++) {
        char id[16];
        snprintf(id, sizeof id, "x%d", i);
        put_range(s, id, "", 40 + (uint32_t)i, 0, 2 * B, false);
    }
    kvr_tier_stats ts;
    kvr_store_tier_stats(s, &ts);
    cr_assert_gt(ts.spilled_blocks, 0);
    size_t m0, m1;
    uint8_t *g0 = get_all(s, "whole", &m0), *g1 = get_all(s, "grown", &m1);
    cr_assert(m0 == n0 && memcmp(g0, w0, n0) == 0, "reloaded 'whole' differs");
    cr_assert(m1 == n1 && memcmp(g1, w1, n1) == 0, "reloaded 'grown' differs");
    free(g0);
    free(g1);
    kvr_store_destroy(s);
    kvr_store *r = open_store(0, true);
    g0 = get_all(r, "whole", &m0);
    g1 = get_all(r, "grown", &m1);
    cr_assert(m0 == n0 && memcmp(g0, w0, n0) == 0, "recovered 'whole' differs");
    cr_assert(m1 == n1 && memcmp(g1, w1, n1) == 0, "recovered 'grown' differs");
    /* (A grown last block keeps up to its doubling's slack: measure the
     * context put at once.) */
    cr_assert_eq(kvr_store_delete(r, "grown", NULL), 0);
    st = stats(r);
    cr_assert_geq((double)st.kv_held_bytes / (double)st.block_bytes, 0.97, "%zu / %zu",
                  st.kv_held_bytes, st.block_bytes);
    free(g0);
    free(g1);
    free(w0);
    free(w1);
    kvr_store_destroy(r);
    kvt_rmrf(DIR_);
}
