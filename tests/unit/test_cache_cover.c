/*
 * test_cache_cover.c — covers at store level (cache/grain.c, cache/cover.c):
 * the grain index kept in step through every path that changes a context's
 * tokens (put, append, fork, edit, shift, keep, retention, delete,
 * eviction, spill and reload, recovery after a restart; kvr_grain_check
 * after each), covers
 * of prompts built from cached contexts' chunks shuffled behind a new
 * header, forced hash collisions refused by the token check, bad input
 * refused with nothing stored changed, and the placed get: every piece's
 * keys equal the scalar reference rotation of the stored keys to their
 * place in the prompt, values bit for bit, flags approximate at seams.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/cache.h"
#include "cache/store.h"
#include "tests/common/kvt.h"

#define L 2
#define H 2
#define D 16
#define ROW (H * D)

static char DIR_[64];

static kvr_store *open_store(size_t cap, bool tier)
{
    kvr_store *s = NULL;
    kvr_error e = { 0 };
    kvr_store_config cfg = { .block_tokens = 16, .max_memory = cap };
    cr_assert_eq(kvr_store_create(&s, &cfg, &e), 0, "%s", e.msg);
    if (tier) {
        kvr_tier_config tc = { .dir = DIR_ };
        cr_assert_eq(kvr_store_tier_open(s, &tc, NULL, NULL, NULL, &e), 0, "%s", e.msg);
    }
    if (kvr_store_model_find(s, "m", NULL) != 0) {
        kvr_model_desc d = { .name = "m", .n_layers = L, .n_kv_heads = H, .head_dim = D,
                             .dtype = KVR_DTYPE_F32 };
        kvr_rope_config_init(&d.rope);
        cr_assert_eq(kvr_store_model_register(s, &d, NULL, &e), 0, "%s", e.msg);
    }
    return s;
}

/* The value a test stores for (token index i of a put seeded `seed`,
 * layer l, K or V, channel j): distinct everywhere. */
static float val(uint32_t seed, size_t i, uint32_t l, int kv, size_t j)
{
    return (float)sin((double)(seed * 7919u + i * 131u + l * 17u + (size_t)kv * 5u) +
                      (double)j * 0.37);
}

static void fill_payload(const kvr_put *t, uint32_t seed, size_t n)
{
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(t, &iov, &niov);
    size_t total = 0;
    for (size_t i = 0; i < niov; i++)
        total += iov[i].iov_len;
    cr_assert_eq(total, (size_t)L * 2 * n * ROW * sizeof(float));
    float *all = malloc(total);
    size_t k = 0;
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t i = 0; i < n; i++)
                for (size_t j = 0; j < ROW; j++)
                    all[k++] = val(seed, i, l, kv, j);
    size_t at = 0;
    for (size_t i = 0; i < niov; i++) {
        memcpy(iov[i].iov_base, (char *)all + at, iov[i].iov_len);
        at += iov[i].iov_len;
    }
    free(all);
}

static int put_ex(kvr_store *s, const char *id, kvr_put_mode mode, const uint32_t *tok,
                  size_t n, uint32_t seed, bool persist, kvr_error *e)
{
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = mode, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32,
                         .n_tokens = n, .tokens = tok, .persist = persist };
    kvr_put *t;
    int rc = kvr_store_put_begin(s, &p, &t, e);
    if (rc != 0)
        return rc;
    fill_payload(t, seed, n);
    return kvr_put_commit(t, NULL, e);
}

static void put(kvr_store *s, const char *id, kvr_put_mode mode, const uint32_t *tok, size_t n,
                uint32_t seed)
{
    kvr_error e = { 0 };
    cr_assert_eq(put_ex(s, id, mode, tok, n, seed, false, &e), 0, "put %s: %s", id, e.msg);
}

/* Replaces [start, end) of id by tok[0..n) without KV (pending tokens). */
static void edit_pending(kvr_store *s, const char *id, size_t start, size_t end,
                         const uint32_t *tok, size_t n)
{
    kvr_edit_op op = { .start = start, .end = end, .n_tokens = n, .tokens = tok };
    kvr_edit_params ep = { .ctx_id = id, .ops = &op, .n_ops = 1 };
    kvr_edit *t;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_edit_begin(s, &ep, &t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_edit_commit(t, NULL, NULL, &e), 0, "%s", e.msg);
}

/* Frees a cover result, then its store. */
static void destroy_with(kvr_store *s, kvr_cover_result *r)
{
    kvr_cover_result_free(r);
    kvr_store_destroy(s);
}

static void check_index(kvr_store *s)
{
    kvr_error e = { 0 };
    cr_assert_eq(kvr_grain_check(s, &e), 0, "grain index: %s", e.msg);
}

/* Tokens of a context, for checking pieces. */
static uint32_t *ctx_tokens(kvr_store *s, const char *id, size_t *n)
{
    kvr_get_params gp = { .ctx_id = id, .end = SIZE_MAX, .meta_only = true,
                          .dtype = KVR_DTYPE_F32 };
    kvr_get *g;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_get_begin(s, &gp, &g, &e), 0, "%s", e.msg);
    const kvr_get_info *gi = kvr_get_get_info(g);
    uint32_t *t = malloc((gi->n_tokens ? gi->n_tokens : 1) * sizeof *t);
    memcpy(t, gi->tokens, gi->n_tokens * sizeof *t);
    *n = gi->n_tokens;
    kvr_get_end(g);
    return t;
}

/* Covers q and checks every piece against the context it names: in range,
 * the same tokens, pieces in order and apart, covered count right. */
static void cover(kvr_store *s, const uint32_t *q, size_t n, size_t min_run,
                  kvr_cover_result *res)
{
    kvr_cover_params p = { .model = "m", .tokens = q, .n_tokens = n, .min_run = min_run };
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_cover(s, &p, res, &e), 0, "%s", e.msg);
    size_t end = 0, covered = 0;
    for (size_t i = 0; i < res->n_pieces; i++) {
        const kvr_cover_piece *pc = &res->pieces[i];
        cr_assert_geq(pc->prompt_off, end, "piece %zu overlaps the one before", i);
        cr_assert_geq(pc->n_tokens, min_run);
        cr_assert_eq(pc->stream_off, covered);
        size_t cn;
        uint32_t *ct = ctx_tokens(s, pc->ctx_id, &cn);
        cr_assert_leq(pc->ctx_off + pc->n_tokens, cn);
        cr_assert_eq(memcmp(ct + pc->ctx_off, q + pc->prompt_off, pc->n_tokens * 4), 0,
                     "piece %zu from '%s' does not hold the prompt's tokens", i, pc->ctx_id);
        free(ct);
        end = pc->prompt_off + pc->n_tokens;
        covered += pc->n_tokens;
    }
    cr_assert_eq(res->n_covered, covered);
}

/* cover (min_run 16) that must find n_pieces pieces covering n_covered. */
static void cover_expect(kvr_store *s, const uint32_t *q, size_t n, size_t n_pieces,
                         size_t n_covered, kvr_cover_result *res)
{
    cover(s, q, n, 16, res);
    cr_assert_eq(res->n_pieces, n_pieces, "%zu pieces", res->n_pieces);
    cr_assert_eq(res->n_covered, n_covered);
}

static const kvr_cover_piece *piece_at(const kvr_cover_result *r, size_t prompt_off)
{
    for (size_t i = 0; i < r->n_pieces; i++)
        if (r->pieces[i].prompt_off == prompt_off)
            return &r->pieces[i];
    return NULL;
}

/* n distinct-ish ids from [base, base + 100000). */
static void seq(uint32_t *t, size_t n, uint32_t base, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        t[i] = base + (x >> 8) % 100000u;
    }
}

/* A prompt q: head new tokens (seq seed head_seed), then x[0..xn), then
 * y[0..yn). */
static void prompt3(uint32_t *q, size_t head, uint32_t head_seed, const uint32_t *x, size_t xn,
                    const uint32_t *y, size_t yn)
{
    seq(q, head, 9000000, head_seed);
    memcpy(q + head, x, xn * 4);
    memcpy(q + head + xn, y, yn * 4);
}

/* Context id: seq(t, n, base, seq_seed), put with values of put_seed. */
static void put_seq(kvr_store *s, const char *id, uint32_t *t, size_t n, uint32_t base,
                    uint32_t seq_seed, uint32_t put_seed)
{
    seq(t, n, base, seq_seed);
    put(s, id, KVR_PUT_CREATE, t, n, put_seed);
}

/* ---- a prompt of shuffled chunks behind a new header ---------------------- */

Test(cache_cover, shuffled_chunks_behind_a_header)
{
    kvr_store *s = open_store(0, false);
    uint32_t a[200], b[200], c[200];
    put_seq(s, "a", a, 200, 1000000, 1, 1);
    put_seq(s, "b", b, 200, 2000000, 2, 2);
    put_seq(s, "c", c, 200, 3000000, 3, 3);
    check_index(s);
    /* header(37) C[50..150) A[0..120) B[30..200) tail(10) */
    uint32_t q[37 + 100 + 120 + 170 + 10];
    size_t n = 0;
    seq(q, 37, 9000000, 9);
    n = 37;
    memcpy(q + n, c + 50, 100 * 4), n += 100;
    memcpy(q + n, a, 120 * 4), n += 120;
    memcpy(q + n, b + 30, 170 * 4), n += 170;
    seq(q + n, 10, 9100000, 10), n += 10;
    kvr_cover_result r;
    cover(s, q, n, 16, &r);
    cr_assert_eq(r.n_pieces, 3, "%zu pieces", r.n_pieces);
    const kvr_cover_piece *pc = piece_at(&r, 37), *pa = piece_at(&r, 137),
                          *pb = piece_at(&r, 257);
    cr_assert(pc && pa && pb);
    cr_assert_str_eq(pc->ctx_id, "c");
    cr_assert_eq(pc->ctx_off, 50);
    cr_assert_eq(pc->n_tokens, 100);
    cr_assert_str_eq(pa->ctx_id, "a");
    cr_assert_eq(pa->ctx_off, 0);
    cr_assert_eq(pa->n_tokens, 120);
    cr_assert_str_eq(pb->ctx_id, "b");
    cr_assert_eq(pb->ctx_off, 30);
    cr_assert_eq(pb->n_tokens, 170);
    cr_assert(!pa->exact && !pb->exact && !pc->exact, "nothing is at its own place");
    cr_assert_eq(r.n_covered, 390);
    cr_assert_eq(r.n_rejected, 0);
    kvr_cover_result_free(&r);

    /* A's own start opens the prompt: that piece is exact, and a min_run
     * above a chunk's length leaves it out. */
    memcpy(q, a, 64 * 4);
    memcpy(q + 64, c, 40 * 4);
    cover(s, q, 104, 16, &r);
    cr_assert_eq(r.n_pieces, 2);
    cr_assert(r.pieces[0].exact && !r.pieces[1].exact);
    cr_assert_eq(r.pieces[1].prompt_off, 64);
    kvr_cover_result_free(&r);
    cover(s, q, 104, 50, &r);
    cr_assert_eq(r.n_pieces, 1);
    cr_assert_eq(r.pieces[0].n_tokens, 64);
    kvr_cover_result_free(&r);
    /* Shorter than a grain: nothing to find. */
    cover(s, q, 15, 1, &r);
    cr_assert_eq(r.n_pieces, 0);
    destroy_with(s, &r);
}

/* A chunk that appears twice in the prompt is used twice; a run that
 * starts mid-grain in its context (offset 7) is found by its aligned
 * grains and extended left to the start of the agreement. */
Test(cache_cover, unaligned_and_repeated)
{
    kvr_store *s = open_store(0, false);
    uint32_t a[300];
    put_seq(s, "a", a, 300, 1000000, 4, 4);
    uint32_t q[5 + 60 + 3 + 60];
    seq(q, 5, 9000000, 1);
    memcpy(q + 5, a + 7, 60 * 4);
    seq(q + 65, 3, 9100000, 2);
    memcpy(q + 68, a + 7, 60 * 4);
    kvr_cover_result r;
    cover(s, q, 128, 16, &r);
    cr_assert_eq(r.n_pieces, 2);
    cr_assert_eq(r.pieces[0].prompt_off, 5);
    cr_assert_eq(r.pieces[0].ctx_off, 7);
    cr_assert_eq(r.pieces[0].n_tokens, 60);
    cr_assert_eq(r.pieces[1].prompt_off, 68);
    cr_assert_eq(r.pieces[1].ctx_off, 7);
    destroy_with(s, &r);
}

/* ---- the index through every path that changes tokens ---------------------- */

static size_t covered_of(kvr_store *s, const uint32_t *q, size_t n)
{
    kvr_cover_result r;
    cover(s, q, n, 16, &r);
    size_t c = r.n_covered;
    kvr_cover_result_free(&r);
    return c;
}

Test(cache_cover, index_follows_every_change)
{
    kvr_store *s = open_store(0, false);
    kvr_error e = { 0 };
    uint32_t a[256], x[64];
    seq(a, 256, 1000000, 5);
    seq(x, 64, 5000000, 6);
    /* create in pieces: appends of odd sizes straddle grains */
    put(s, "a", KVR_PUT_CREATE, a, 5, 1);
    put(s, "a", KVR_PUT_APPEND, a + 5, 30, 2);
    put(s, "a", KVR_PUT_APPEND, a + 35, 221, 3);
    check_index(s);
    cr_assert_eq(covered_of(s, a + 40, 100), 100);

    /* fork: the copy is found too (and the index stays exact) */
    cr_assert_eq(kvr_store_fork(s, "a", "f", &e), 0, "%s", e.msg);
    cr_assert_eq(covered_of(s, a, 256), 256);
    check_index(s);
    cr_assert_eq(kvr_store_delete(s, "a", &e), 0);
    check_index(s);
    cr_assert_eq(covered_of(s, a, 256), 256, "the fork still holds them");

    /* edit: replace [100, 110) of f by x[0..10): the old tokens there are
     * no longer found, the new ones are, in their new neighbourhood */
    edit_pending(s, "f", 100, 110, x, 10);
    uint32_t q[120];
    memcpy(q, a + 60, 40 * 4);
    memcpy(q + 40, x, 10 * 4);
    memcpy(q + 50, a + 110, 70 * 4);
    kvr_cover_result r;
    cover(s, q, 120, 16, &r);   /* the edited-in tokens have no KV: gaps */
    check_index(s);
    cr_assert_eq(r.n_pieces, 2);
    cr_assert_eq(r.pieces[0].n_tokens, 40);
    cr_assert_eq(r.pieces[1].prompt_off, 50);
    cr_assert_eq(r.pieces[1].n_approx, 70, "after the edit point: approximate");
    kvr_cover_result_free(&r);
    cr_assert_eq(covered_of(s, a + 90, 20), 0, "the old tokens at 100..110 are gone");

    /* shift: positions only, the index is unchanged */
    cr_assert_eq(kvr_store_shift(s, "f", 0, 50, 1000, &e), 0, "%s", e.msg);
    check_index(s);
    /* keep: only [120, 200) stays */
    cr_assert_eq(kvr_store_keep(s, "f", 120, 200, &e), 0, "%s", e.msg);
    check_index(s);
    cr_assert_eq(covered_of(s, a + 60, 40), 0);
    cr_assert_eq(covered_of(s, a + 120, 80), 80);
    /* delete: nothing left */
    cr_assert_eq(kvr_store_delete(s, "f", &e), 0);
    check_index(s);
    cr_assert_eq(covered_of(s, a + 120, 80), 0);

    /* retention (sinks + window) drops the middle at each put */
    put(s, "w", KVR_PUT_CREATE, a, 64, 7);
    kvr_retention ret = { .sinks = 16, .window = 64 };
    cr_assert_eq(kvr_store_set_retention(s, "w", &ret, &e), 0, "%s", e.msg);
    put(s, "w", KVR_PUT_APPEND, a + 64, 100, 8);
    check_index(s);
    cr_assert_eq(covered_of(s, a + 100, 64), 64);
    cr_assert_eq(covered_of(s, a + 40, 40), 0, "dropped by the window");

    /* replace: the old sequence leaves the index with the old context */
    put(s, "w", KVR_PUT_REPLACE, x, 64, 9);
    check_index(s);
    cr_assert_eq(covered_of(s, a + 100, 64), 0);
    cr_assert_eq(covered_of(s, x, 64), 64);
    kvr_store_destroy(s);
}

Test(cache_cover, eviction_takes_grains_with_it)
{
    /* A cap that holds about three of the contexts: the oldest go. */
    size_t per = (size_t)L * 2 * 256 * ROW * 4;
    kvr_store *s = open_store(kvr_mem_allocated() + per * 3 + ((size_t)512 << 10), false);
    uint32_t t[8][256];
    kvr_error e = { 0 };
    for (uint32_t i = 0; i < 8; i++) {
        char id[8];
        snprintf(id, sizeof id, "c%u", i);
        seq(t[i], 256, 1000000 * (i + 1), i);
        int rc = put_ex(s, id, KVR_PUT_CREATE, t[i], 256, i, false, &e);
        cr_assert_eq(rc, 0, "%s", e.msg);
        check_index(s);
    }
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_gt(st.n_evicted_blocks, 0, "the cap evicted nothing");
    for (uint32_t i = 0; i < 8; i++) {
        char id[8];
        snprintf(id, sizeof id, "c%u", i);
        kvr_ctx_info ci;
        size_t have = kvr_store_stat(s, id, &ci, NULL) == 0 ? ci.n_tokens : 0;
        size_t got = covered_of(s, t[i], 256);    /* pieces checked inside */
        cr_assert_leq(got, have, "c%u: %zu covered, %zu held", i, got, have);
        if (have >= 16)     /* eviction leaves a prefix: found whole */
            cr_assert_eq(got, have, "c%u: %zu covered of %zu held", i, got, have);
    }
    kvr_store_destroy(s);
}

Test(cache_cover, restart_recovers_the_index)
{
    kvt_tmpdir(DIR_, sizeof DIR_, "kvr-cover");
    kvr_store *s = open_store(0, true);
    kvr_error e = { 0 };
    uint32_t a[200], b[100];
    seq(a, 200, 1000000, 11);
    seq(b, 100, 2000000, 12);
    cr_assert_eq(put_ex(s, "a", KVR_PUT_CREATE, a, 200, 1, true, &e), 0, "%s", e.msg);
    cr_assert_eq(put_ex(s, "b", KVR_PUT_CREATE, b, 100, 2, true, &e), 0, "%s", e.msg);
    cr_assert_geq(kvr_store_persist(s, "a", NULL, NULL, &e), 0);
    cr_assert_geq(kvr_store_persist(s, "b", NULL, NULL, &e), 0);
    kvr_store_persist_flush(s);
    kvr_store_destroy(s);

    s = open_store(0, true);
    check_index(s);
    uint32_t q[150];
    prompt3(q, 20, 1, b + 10, 60, a + 100, 70);
    kvr_cover_result r;
    cover_expect(s, q, 150, 2, 130, &r);
    destroy_with(s, &r);
    kvt_rmrf(DIR_);
    cr_assert_neq(access(DIR_, F_OK), 0, "%s was not removed", DIR_);
}

/* Spilled blocks keep their token ids: a cover still finds them, and its
 * placed get reloads their K/V from the disk tier, bit for bit. */
Test(cache_cover, spilled_contexts_are_found_and_reloaded)
{
    kvt_tmpdir(DIR_, sizeof DIR_, "kvr-cover");
    kvr_store *s = open_store(0, true);
    uint32_t a[160], b[160];
    put_seq(s, "a", a, 160, 1000000, 71, 1);
    put_seq(s, "b", b, 160, 2000000, 72, 2);
    kvr_error e = { 0 };
    cr_assert_gt(kvr_store_tier_evict(s, SIZE_MAX, &e), 0, "%s", e.msg);
    kvr_tier_stats ts;
    kvr_store_tier_stats(s, &ts);
    cr_assert_gt(ts.spilled_blocks, 0);
    check_index(s);
    uint32_t q[150];
    prompt3(q, 10, 1, b + 40, 70, a + 90, 70);
    kvr_cover_result r;
    cover_expect(s, q, 150, 2, 140, &r);
    kvr_cover_params p = { .model = "m", .tokens = q, .n_tokens = 150, .min_run = 16,
                           .dtype = KVR_DTYPE_F32 };
    kvr_assemble *t;
    cr_assert_eq(kvr_store_cover_get_begin(s, &p, &r, &t, &e), 0, "%s", e.msg);
    size_t bytes = kvr_assemble_payload_size(t), N = r.n_covered;
    float *got = malloc(bytes);
    cr_assert_eq(kvr_assemble_copy_into(t, got, bytes, &e), 0, "%s", e.msg);
    for (size_t pi = 0; pi < r.n_pieces; pi++) {
        const kvr_cover_piece *pc = &r.pieces[pi];
        uint32_t seed = strcmp(pc->ctx_id, "a") == 0 ? 1 : 2;
        for (size_t j = 0; j < pc->n_tokens; j++)
            for (uint32_t l = 0; l < L; l++)
                for (size_t c = 0; c < ROW; c++)
                    cr_assert_eq(got[((size_t)l * 2 * N + N + pc->stream_off + j) * ROW + c],
                                 val(seed, pc->ctx_off + j, l, 1, c), "values reloaded");
    }
    free(got);
    kvr_assemble_end(t);
    kvr_store_tier_stats(s, &ts);
    cr_assert(ts.n_reloads > 0 || ts.reads_disk > 0, "the get did not read the disk "
              "(%llu reloads, %llu disk reads)", (unsigned long long)ts.n_reloads,
              (unsigned long long)ts.reads_disk);
    destroy_with(s, &r);
    kvt_rmrf(DIR_);
    cr_assert_neq(access(DIR_, F_OK), 0, "%s was not removed", DIR_);
}

/* A run at prompt offset 0 from its context's offset 0 is exact only when
 * the context's KV was computed from its own first token on, at
 * consecutive positions (a uniform shift is fine). */
Test(cache_cover, exact_needs_the_context_encoded_from_its_start)
{
    kvr_store *s = open_store(0, false);
    kvr_error e = { 0 };
    uint32_t pre[32], d[64];
    seq(d, 64, 2000000, 82);
    put_seq(s, "pre", pre, 32, 1000000, 81, 1);
    kvr_put_params p = { .ctx_id = "doc", .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32,
                         .n_tokens = 64, .tokens = d, .prefix_ctx = "pre" };
    kvr_put *t;
    cr_assert_eq(kvr_store_put_begin(s, &p, &t, &e), 0, "%s", e.msg);
    fill_payload(t, 2, 64);
    cr_assert_eq(kvr_put_commit(t, NULL, &e), 0, "%s", e.msg);
    kvr_cover_result r;
    cover(s, d, 64, 16, &r);          /* an APE document: encoded after "pre" */
    cr_assert_eq(r.n_pieces, 1);
    cr_assert_not(r.pieces[0].exact);
    kvr_cover_result_free(&r);
    cover(s, pre, 32, 16, &r);        /* the prefix itself is */
    cr_assert(r.pieces[0].exact);
    kvr_cover_result_free(&r);
    cr_assert_eq(kvr_store_shift(s, "pre", 0, SIZE_MAX, 50, &e), 0, "%s", e.msg);
    cover(s, pre, 32, 16, &r);        /* shifted whole: still */
    cr_assert(r.pieces[0].exact);
    kvr_cover_result_free(&r);
    cr_assert_eq(kvr_store_shift(s, "pre", 20, SIZE_MAX, 3, &e), 0, "%s", e.msg);
    cover(s, pre, 32, 16, &r);        /* a gap in its positions: not */
    cr_assert_not(r.pieces[0].exact);
    destroy_with(s, &r);
}

/* ---- hashes are hints --------------------------------------------------------- */

/* With every hash cut to 2 bits, nearly every lookup meets grains of other
 * content: each is refused by the token check and the cover is the same. */
Test(cache_cover, collisions_are_refused)
{
    kvr_grain_test_mask = 0x3;
    kvr_store *s = open_store(0, false);
    uint32_t a[64], b[64];
    put_seq(s, "a", a, 64, 1000000, 21, 1);
    put_seq(s, "b", b, 64, 2000000, 22, 2);
    check_index(s);
    uint32_t q[100];
    prompt3(q, 20, 3, b + 8, 40, a + 16, 40);
    kvr_cover_result r;
    cover(s, q, 100, 16, &r);
    cr_assert_gt(r.n_rejected, 0, "no collision was met");
    cr_assert_eq(r.n_pieces, 2);
    cr_assert_str_eq(r.pieces[0].ctx_id, "b");
    cr_assert_eq(r.pieces[0].ctx_off, 8);
    cr_assert_str_eq(r.pieces[1].ctx_id, "a");
    cr_assert_eq(r.pieces[1].ctx_off, 16);
    kvr_cover_result_free(&r);
    /* A prompt of nothing cached: every hit refused, nothing covered. */
    seq(q, 100, 7000000, 4);
    cover(s, q, 100, 16, &r);
    cr_assert_eq(r.n_covered, 0);
    cr_assert_eq(r.n_rejected, r.n_hits);
    destroy_with(s, &r);
    kvr_grain_test_mask = ~0ull;
}

/* ---- allocation failures ------------------------------------------------------- */

/* Every allocation of an append, a fork and a cover made to fail in turn
 * (kvr_mem_fault_set): the index stays a true account (kvr_grain_check) and
 * may lag, never lie; the first cover with memory again finds everything. */
Test(cache_cover, allocation_failures_never_make_the_index_lie)
{
    uint32_t a[200];
    seq(a, 200, 1000000, 91);
    if (!kvr_mem_fault_set(0, false))
        cr_skip_test("allocation faults are compiled out (KVR_NO_FAULT_INJECT)");
    for (uint64_t n = 1; n < 400; n++) {
        kvr_store *s = open_store(0, false);
        put(s, "a", KVR_PUT_CREATE, a, 100, 1);
        kvr_error e = { 0 };
        kvr_mem_fault_set(n, false);
        int rc = put_ex(s, "a", KVR_PUT_APPEND, a + 100, 100, 2, false, &e);
        if (rc == 0)
            rc = kvr_store_fork(s, "a", "b", &e);
        kvr_cover_params p = { .model = "m", .tokens = a, .n_tokens = 200, .min_run = 16 };
        kvr_cover_result r;
        int rc2 = rc == 0 ? kvr_store_cover(s, &p, &r, &e) : -1;
        uint64_t failed = kvr_mem_fault_failed();
        kvr_mem_fault_set(0, false);
        if (rc2 == 0)
            kvr_cover_result_free(&r);
        check_index(s);
        kvr_ctx_info ci;
        cr_assert_eq(kvr_store_stat(s, "a", &ci, NULL), 0);
        cover(s, a, ci.n_tokens, 16, &r);       /* checks every piece */
        cr_assert_eq(r.n_covered, ci.n_tokens, "n=%llu: %zu of %zu covered",
                     (unsigned long long)n, r.n_covered, ci.n_tokens);
        kvr_cover_result_free(&r);
        check_index(s);
        kvr_store_destroy(s);
        if (!failed)
            break;      /* the whole path ran without reaching allocation n */
        cr_assert_lt(n, 399, "the path never ran to its end");
    }
}

/* ---- bad input ----------------------------------------------------------------- */

Test(cache_cover, bad_input_is_refused_and_changes_nothing)
{
    kvr_store *s = open_store(0, false);
    uint32_t a[64];
    put_seq(s, "a", a, 64, 1000000, 31, 1);
    kvr_store_stats before, after;
    kvr_store_get_stats(s, &before);
    uint32_t *huge = calloc(KVR_COVER_MAX_TOKENS + 1, sizeof *huge);
    struct {
        kvr_cover_params p;
        int rc;
        const char *msg;
    } cases[] = {
        { { .model = "nope", .tokens = a, .n_tokens = 64, .min_run = 16 }, KVR_ENOMODEL, "no model" },
        { { .model = NULL, .tokens = a, .n_tokens = 64, .min_run = 16 }, KVR_ENOMODEL, "no model" },
        { { .model = "m", .tokens = a, .n_tokens = 0, .min_run = 16 }, KVR_EINVAL, "empty" },
        { { .model = "m", .tokens = NULL, .n_tokens = 4, .min_run = 16 }, KVR_EBADREQUEST, "missing" },
        { { .model = "m", .tokens = huge, .n_tokens = KVR_COVER_MAX_TOKENS + 1, .min_run = 16 },
          KVR_ETOOLARGE, "over the limit" },
        { { .model = "m", .tokens = a, .n_tokens = 64, .min_run = 0 }, KVR_EINVAL, "min_run" },
        { { .model = "m", .tokens = a, .n_tokens = 64, .min_run = KVR_COVER_MAX_TOKENS + 1 },
          KVR_EINVAL, "min_run" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvr_cover_result r;
        kvr_error e = { 0 };
        int rc = kvr_store_cover(s, &cases[i].p, &r, &e);
        cr_assert_eq(rc, cases[i].rc, "case %zu: %d (%s)", i, rc, e.msg);
        cr_assert(strstr(e.msg, cases[i].msg), "case %zu: '%s'", i, e.msg);
        cr_assert_eq(r.n_pieces, 0);
        cr_assert_null(r.pieces);
        kvr_assemble *t = NULL;
        cr_assert_eq(kvr_store_cover_get_begin(s, &cases[i].p, &r, &t, &e), cases[i].rc);
        cr_assert_null(t);
    }
    /* The largest prompt allowed works (all gap: nothing cached there). */
    kvr_cover_params p = { .model = "m", .tokens = huge, .n_tokens = KVR_COVER_MAX_TOKENS,
                           .min_run = 16 };
    kvr_cover_result r;
    cr_assert_eq(kvr_store_cover(s, &p, &r, NULL), 0);
    cr_assert_eq(r.n_covered, 0);
    kvr_cover_result_free(&r);
    free(huge);
    kvr_store_get_stats(s, &after);
    cr_assert_eq(after.n_contexts, before.n_contexts);
    cr_assert_eq(after.n_tokens, before.n_tokens);
    check_index(s);
    cr_assert_eq(covered_of(s, a, 64), 64);
    kvr_store_destroy(s);
}

/* A get of a cover computed before the context changed is refused. */
Test(cache_cover, stale_cover_get_is_refused)
{
    kvr_store *s = open_store(0, false);
    uint32_t a[64], x[64];
    seq(x, 64, 3000000, 42);
    put_seq(s, "a", a, 64, 1000000, 41, 1);
    kvr_cover_params p = { .model = "m", .tokens = a, .n_tokens = 64, .min_run = 16,
                           .dtype = KVR_DTYPE_F32 };
    kvr_cover_result r;
    cr_assert_eq(kvr_store_cover(s, &p, &r, NULL), 0);
    put(s, "a", KVR_PUT_REPLACE, x, 64, 2);
    kvr_assemble *t = NULL;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_cover_get_begin(s, &p, &r, &t, &e), KVR_EBUSY, "%s", e.msg);
    cr_assert_null(t);
    destroy_with(s, &r);
}

/* ---- the placed get ---------------------------------------------------------- */

Test(cache_cover, placed_get_is_the_exact_rotation)
{
    kvr_store *s = open_store(0, false);
    uint32_t a[200], b[200];
    seq(b, 200, 2000000, 52);
    put_seq(s, "a", a, 200, 1000000, 51, 1);
    put(s, "b", KVR_PUT_CREATE, b, 100, 2);
    put(s, "b", KVR_PUT_APPEND, b + 100, 100, 3);   /* stored at 100.. */
    /* prompt: A[0..80) (exact) gap(9) B[120..200) gap(5) A[30..90) */
    uint32_t q[80 + 9 + 80 + 5 + 60];
    memcpy(q, a, 80 * 4);
    seq(q + 80, 9, 9000000, 5);
    memcpy(q + 89, b + 120, 80 * 4);
    seq(q + 169, 5, 9100000, 6);
    memcpy(q + 174, a + 30, 60 * 4);
    size_t n = 234;
    const int64_t base = 7;
    kvr_cover_params p = { .model = "m", .tokens = q, .n_tokens = n, .min_run = 16,
                           .pos_base = base, .dtype = KVR_DTYPE_F32 };
    kvr_cover_result r;
    cover(s, q, n, 16, &r);
    cr_assert_eq(r.n_pieces, 3);
    kvr_error e = { 0 };
    kvr_assemble *t;
    cr_assert_eq(kvr_store_cover_get_begin(s, &p, &r, &t, &e), 0, "%s", e.msg);
    const kvr_assemble_info *ai = kvr_assemble_get_info(t);
    cr_assert_eq(ai->n_tokens, r.n_covered);
    cr_assert_eq(ai->n_segments, 4);
    cr_assert_eq(ai->query_pos, base + (int64_t)n);
    size_t bytes = kvr_assemble_payload_size(t);
    cr_assert_eq(bytes, (size_t)L * 2 * r.n_covered * ROW * 4);
    float *got = malloc(bytes);
    cr_assert_eq(kvr_assemble_copy_into(t, got, bytes, &e), 0, "%s", e.msg);

    kvr_rope *rope;
    kvr_rope_config rc;
    kvr_rope_config_init(&rc);
    rc.head_dim = D;
    rc.rotary_dim = D;
    cr_assert_eq(kvr_rope_create(&rope, &rc, NULL), 0);
    kvr_rope_opts ro = { .isa = KVR_ISA_SCALAR };
    size_t N = r.n_covered;
    for (size_t pi = 0; pi < r.n_pieces; pi++) {
        const kvr_cover_piece *pc = &r.pieces[pi];
        bool from_b = strcmp(pc->ctx_id, "b") == 0;
        for (size_t j = 0; j < pc->n_tokens; j++) {
            size_t si = pc->stream_off + j, ci = pc->ctx_off + j;
            int64_t to = base + (int64_t)(pc->prompt_off + j), from = (int64_t)ci;
            cr_assert_eq(ai->tokens[si], q[pc->prompt_off + j]);
            cr_assert_eq(ai->positions[si], to);
            cr_assert_eq((ai->flags[si] & KVR_TOKEN_APPROX) != 0, !pc->exact,
                         "piece %zu token %zu: flags %#x", pi, j, ai->flags[si]);
            /* which put stored token ci of b: the first 100 or the append */
            uint32_t seed = !from_b ? 1 : ci < 100 ? 2 : 3;
            size_t pi_i = from_b && ci >= 100 ? ci - 100 : ci;
            for (uint32_t l = 0; l < L; l++) {
                float src[ROW], want[ROW];
                for (size_t c = 0; c < ROW; c++)
                    src[c] = val(seed, pi_i, l, 0, c);
                cr_assert_eq(kvr_rope_reposition(rope, want, KVR_DTYPE_F32, src,
                                                 KVR_DTYPE_F32, 1, H, &from, &to, &ro), 0);
                const float *k = got + ((size_t)l * 2 * N + si) * ROW;
                const float *v = got + ((size_t)l * 2 * N + N + si) * ROW;
                for (size_t c = 0; c < ROW; c++) {
                    cr_assert(fabsf(k[c] - want[c]) <= 1e-5f,
                              "piece %zu token %zu layer %u K[%zu]: %g, want %g", pi, j, l,
                              c, (double)k[c], (double)want[c]);
                    cr_assert_eq(v[c], val(seed, pi_i, l, 1, c), "V must be bit for bit");
                }
            }
        }
    }
    kvr_rope_destroy(rope);
    free(got);
    kvr_assemble_end(t);
    /* meta_only: the same metadata, no payload */
    p.meta_only = true;
    cr_assert_eq(kvr_store_cover_get_begin(s, &p, &r, &t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_assemble_get_info(t)->n_tokens, N);
    kvr_assemble_end(t);
    destroy_with(s, &r);
}

/* Tokens edited in without KV are never placed; the cover goes around them. */
Test(cache_cover, pending_tokens_are_gaps)
{
    kvr_store *s = open_store(0, false);
    uint32_t a[128];
    put_seq(s, "a", a, 128, 1000000, 61, 1);
    uint32_t same[4] = { a[60], a[61], a[62], a[63] };
    edit_pending(s, "a", 60, 64, same, 4);
    kvr_error e = { 0 };
    kvr_cover_result r;
    cover(s, a, 128, 16, &r);
    check_index(s);
    cr_assert_eq(r.n_pieces, 2);
    cr_assert_eq(r.pieces[0].n_tokens, 60);
    cr_assert(r.pieces[0].exact);
    cr_assert_eq(r.pieces[1].prompt_off, 64);
    cr_assert(!r.pieces[1].exact);
    kvr_cover_params p = { .model = "m", .tokens = a, .n_tokens = 128, .min_run = 16,
                           .dtype = KVR_DTYPE_F16 };
    kvr_assemble *g;
    cr_assert_eq(kvr_store_cover_get_begin(s, &p, &r, &g, &e), 0, "%s", e.msg);
    kvr_assemble_end(g);
    destroy_with(s, &r);
}
