/*
 * test_cache_store.c — the store's put/get/shift/keep/fork/delete paths:
 * bit-exact round trips, conversions, re-rotation against rope/, copy-on-
 * write, leases, error codes, aborts and memory accounting; put REPLACE
 * (the swap at commit, readers, refusals and aborts that keep the old one).
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include <stdio.h>
#include <unistd.h>

#ifdef KVR_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#include "cache/cache.h"
#include "tests/common/kvt_store.h"

#define L 3
#define H 2
#define D 8

static kvr_store *mk_store(size_t cap, uint32_t B)
{
    kvr_store_config c = { .max_memory = cap, .block_tokens = B };
    return kvt_store_new(&c);
}

static void mk_model(kvr_store *s, const char *name, kvr_dtype dt, kvr_model_info *out)
{
    kvr_model_desc d = kvt_model_desc(name, L, H, D, dt);
    kvt_model_add(s, &d, out);
}

/* Payload in wire order for tokens [t0, t0+n) of a context seeded `seed`. */
static void *make_payload(uint32_t seed, uint64_t t0, size_t n, kvr_dtype dt, size_t *bytes)
{
    return kvt_kv_payload(seed, L, H, D, t0, n, dt, bytes);
}

static int do_put(kvr_store *s, const char *id, const char *model, kvr_put_mode mode,
                  uint32_t seed, uint64_t t0, size_t n, const uint32_t *tokens,
                  kvr_dtype dt, kvr_error *e)
{
    kvr_put_params p = { .ctx_id = id, .model = model, .mode = mode, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = dt, .n_tokens = n,
                         .tokens = tokens };
    size_t bytes;
    void *pl = make_payload(seed, t0, n, dt, &bytes);
    kvt_src src = { pl, bytes, 0 };
    int rc = kvt_put_try(s, &p, kvt_fill_src, &src, NULL, e);
    if (rc == 0)
        cr_assert_eq(src.off, bytes);
    free(pl);
    return rc;
}

static uint32_t *seq_tokens(uint32_t base, size_t n)
{
    uint32_t *t = malloc(n * sizeof *t);
    for (size_t i = 0; i < n; i++)
        t[i] = base + (uint32_t)i;
    return t;
}

/* A store of blocks of B tokens with model "m" (model_dt) and context id:
 * n tokens 0.. (in *tok if tok is not NULL, the caller frees them) of
 * seed's values, put as put_dt. */
static kvr_store *store_with_ctx(uint32_t B, kvr_dtype model_dt, const char *id, uint32_t seed,
                                 size_t n, kvr_dtype put_dt, uint32_t **tok)
{
    kvr_store *s = mk_store(0, B);
    mk_model(s, "m", model_dt, NULL);
    kvr_error e = { 0 };
    uint32_t *t = seq_tokens(0, n);
    cr_assert_eq(do_put(s, id, "m", KVR_PUT_CREATE, seed, 0, n, t, put_dt, &e), 0, "%s", e.msg);
    if (tok)
        *tok = t;
    else
        free(t);
    return s;
}

/* Puts pieces of sizes[0..n) tokens (tokens and values continuing) into
 * "c" of model "m", f16: the first creates it, the rest append. The total. */
static size_t put_pieces(kvr_store *s, uint32_t seed, const size_t *sizes, size_t n)
{
    kvr_error e = { 0 };
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t *tok = seq_tokens((uint32_t)total, sizes[i]);
        cr_assert_eq(do_put(s, "c", "m", i ? KVR_PUT_APPEND : KVR_PUT_CREATE, seed, total,
                            sizes[i], tok, KVR_DTYPE_F16, &e), 0, "%s", e.msg);
        free(tok);
        total += sizes[i];
    }
    return total;
}

/* A get's payload, read through its iovecs, is the n bytes of want. */
static void check_iov(kvr_get *g, const uint8_t *want, size_t n)
{
    const struct iovec *iov;
    size_t niov, off = 0;
    kvr_get_payload_iov(g, &iov, &niov);
    for (size_t i = 0; i < niov; i++) {
        cr_assert(memcmp(iov[i].iov_base, want + off, iov[i].iov_len) == 0);
        off += iov[i].iov_len;
    }
    cr_assert_eq(off, n);
}

/* vidx[i] = start + i for i < n. */
static void seq_vidx(uint64_t *vidx, size_t n, uint64_t start)
{
    for (size_t i = 0; i < n; i++)
        vidx[i] = start + i;
}

/* Gathers a get's payload into one malloc'ed buffer. */
static uint8_t *do_get(kvr_store *s, const kvr_get_params *p, size_t *bytes,
                       kvr_get **keep_open)
{
    return kvt_get_payload(s, p, bytes, keep_open);
}

/* Expected payload of tokens [start, end) for the given layers, where token
 * i of the context has value index vidx[i]. */
static void *expect_payload(uint32_t seed, const uint64_t *vidx, size_t n,
                            const uint32_t *layers, size_t nl, kvr_dtype dt, size_t *bytes)
{
    size_t es = kvr_dtype_size(dt), cnt = nl * 2 * n * H * D, k = 0;
    float *f = malloc(cnt * sizeof *f);
    for (size_t li = 0; li < nl; li++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t t = 0; t < n; t++)
                for (uint32_t h = 0; h < H; h++)
                    for (uint32_t d = 0; d < D; d++)
                        f[k++] = kvt_kv_value(seed, layers[li], kv, vidx[t], h, d);
    void *out = malloc(cnt * es);
    kvr_convert(out, dt, f, KVR_DTYPE_F32, cnt);
    free(f);
    *bytes = cnt * es;
    return out;
}

static const uint32_t ALL[L] = { 0, 1, 2 };

static void check_range(kvr_store *s, const char *id, uint32_t seed, size_t start,
                        size_t end, kvr_dtype dt, const uint32_t *layers, size_t nl)
{
    kvr_get_params p = { .ctx_id = id, .start = start, .end = end, .dtype = dt,
                         .layers = layers, .n_layers_sel = layers ? nl : 0 };
    size_t got_n, exp_n;
    uint8_t *got = do_get(s, &p, &got_n, NULL);
    uint64_t *vidx = malloc((end - start + 1) * sizeof *vidx);
    seq_vidx(vidx, end - start, start);
    void *exp = expect_payload(seed, vidx, end - start, layers ? layers : ALL,
                               layers ? nl : L, dt, &exp_n);
    cr_assert_eq(got_n, exp_n);
    cr_assert(memcmp(got, exp, exp_n) == 0, "payload of [%zu,%zu) differs", start, end);
    free(got);
    free(exp);
    free(vidx);
}

static void roundtrip(kvr_dtype dt)
{
    kvr_store *s = mk_store(0, 16);
    mk_model(s, "m", dt, NULL);
    uint32_t *tok = seq_tokens(100, 50);
    kvr_error e = { 0 };
    cr_assert_eq(do_put(s, "c", "m", KVR_PUT_CREATE, 7, 0, 50, tok, dt, &e), 0, "%s", e.msg);
    check_range(s, "c", 7, 0, 50, dt, NULL, 0);
    /* Zero-copy on both sides: the get needs no work. */
    kvr_get_params p = { .ctx_id = "c", .end = SIZE_MAX, .dtype = dt };
    kvr_get *g;
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0);
    cr_assert_not(kvr_get_needs_work(g));
    const kvr_get_info *gi = kvr_get_get_info(g);
    cr_assert_eq(gi->n_tokens, 50);
    for (size_t i = 0; i < 50; i++) {
        cr_assert_eq(gi->tokens[i], 100 + i);
        cr_assert_eq(gi->positions[i], (int64_t)i);
        cr_assert_eq(gi->flags[i], 0);
    }
    kvr_get_end(g);
    free(tok);
    kvr_store_destroy(s);
}

Test(cache_store, roundtrip_f32) { roundtrip(KVR_DTYPE_F32); }
Test(cache_store, roundtrip_f16) { roundtrip(KVR_DTYPE_F16); }
Test(cache_store, roundtrip_bf16) { roundtrip(KVR_DTYPE_BF16); }

Test(cache_store, appends_ranges_layers)
{
    kvr_store *s = mk_store(0, 16);
    mk_model(s, "m", KVR_DTYPE_F16, NULL);
    kvr_error e = { 0 };
    const size_t sizes[] = { 5, 11, 16, 1, 33, 7 };
    size_t total = put_pieces(s, 3, sizes, 6);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "c", &ci, &e), 0);
    cr_assert_eq(ci.n_tokens, total);
    cr_assert_eq(ci.n_blocks, (total + 15) / 16);   /* tail slots were filled */
    cr_assert_eq(ci.pos_min, 0);
    cr_assert_eq(ci.pos_max, (int64_t)total - 1);
    size_t ranges[][2] = { { 0, 73 }, { 3, 4 }, { 15, 17 }, { 16, 32 }, { 20, 60 }, { 72, 73 },
                           { 10, 10 } };
    for (size_t r = 0; r < 7; r++)
        check_range(s, "c", 3, ranges[r][0], ranges[r][1], KVR_DTYPE_F16, NULL, 0);
    uint32_t sel[] = { 2, 0 };
    check_range(s, "c", 3, 5, 40, KVR_DTYPE_F16, sel, 2);
    uint32_t one[] = { 1 };
    check_range(s, "c", 3, 0, 73, KVR_DTYPE_F16, one, 1);
    /* Conversion on get. */
    check_range(s, "c", 3, 5, 40, KVR_DTYPE_F32, sel, 2);
    check_range(s, "c", 0 + 3, 0, 73, KVR_DTYPE_BF16, NULL, 0);
    /* Out of range. */
    kvr_get *g;
    kvr_get_params p = { .ctx_id = "c", .start = 10, .end = 74, .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), KVR_ERANGE);
    p = (kvr_get_params){ .ctx_id = "c", .start = 10, .end = 5, .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), KVR_ERANGE);
    uint32_t bad[] = { 3 };
    p = (kvr_get_params){ .ctx_id = "c", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16,
                          .layers = bad, .n_layers_sel = 1 };
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), KVR_ERANGE);
    int64_t pos[3] = { 1, 2, 3 };
    p = (kvr_get_params){ .ctx_id = "c", .start = 0, .end = 4, .dtype = KVR_DTYPE_F16,
                          .positions = pos, .n_positions = 3 };
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), KVR_EINVAL);
    kvr_store_destroy(s);
}

Test(cache_store, put_conversion)
{
    uint32_t *tok;
    kvr_store *s = store_with_ctx(8, KVR_DTYPE_BF16, "c", 9, 20, KVR_DTYPE_F32, &tok);
    kvr_error e = { 0 };
    cr_assert_eq(do_put(s, "c", "m", KVR_PUT_APPEND, 9, 20, 5, tok, KVR_DTYPE_F16, &e), 0);
    check_range(s, "c", 9, 0, 25, KVR_DTYPE_BF16, NULL, 0);
    check_range(s, "c", 9, 0, 25, KVR_DTYPE_F32, NULL, 0);
    free(tok);
    kvr_store_destroy(s);
}

/* Expected K at target positions: kvr_rope_reposition of the stored keys. */
static void check_rotated(kvr_store *s, const char *id, uint32_t seed, size_t start, size_t end,
                          const int64_t *stored, const int64_t *target, bool pass_positions,
                          kvr_dtype sdt, kvr_dtype odt)
{
    kvr_model_info mi;
    cr_assert_eq(kvr_store_model_find(s, "m", &mi), 0);
    size_t n = end - start;
    kvr_get_params p = { .ctx_id = id, .start = start, .end = end, .dtype = odt,
                         .positions = pass_positions ? target : NULL };
    size_t got_n;
    kvr_get *g;
    uint8_t *got = do_get(s, &p, &got_n, &g);
    const kvr_get_info *gi = kvr_get_get_info(g);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(gi->positions[i], target[i]);
    kvr_get_end(g);
    uint64_t *vidx = malloc(n * sizeof *vidx);
    seq_vidx(vidx, n, start);
    size_t sn, on;
    uint8_t *stored_kv = expect_payload(seed, vidx, n, ALL, L, sdt, &sn);
    uint8_t *exp = expect_payload(seed, vidx, n, ALL, L, odt, &on);
    size_t sp = n * H * D * kvr_dtype_size(sdt), op = n * H * D * kvr_dtype_size(odt);
    for (uint32_t l = 0; l < L; l++)
        cr_assert_eq(kvr_rope_reposition(mi.engine, exp + 2 * l * op, odt,
                                         stored_kv + 2 * l * sp, sdt, n, H, stored, target,
                                         NULL), 0);
    cr_assert_eq(got_n, on);
    cr_assert(memcmp(got, exp, on) == 0, "rotated keys differ");
    free(got);
    free(exp);
    free(stored_kv);
    free(vidx);
}

Test(cache_store, get_at_positions_and_shift)
{
    uint32_t *tok;
    kvr_store *s = store_with_ctx(8, KVR_DTYPE_F32, "c", 5, 30, KVR_DTYPE_F32, &tok);
    kvr_error e = { 0 };
    int64_t stored[30], target[30];
    for (int i = 0; i < 30; i++) {
        stored[i] = i;
        target[i] = (i * 7) % 13 + 1000;
    }
    check_rotated(s, "c", 5, 0, 30, stored, target, true, KVR_DTYPE_F32, KVR_DTYPE_F32);
    check_rotated(s, "c", 5, 0, 30, stored, target, true, KVR_DTYPE_F32, KVR_DTYPE_F16);
    check_rotated(s, "c", 5, 4, 17, stored + 4, target + 4, true, KVR_DTYPE_F32,
                  KVR_DTYPE_BF16);
    /* Shift [10, 20) by +100 and [25, 30) by -3: keys re-rotated on read. */
    cr_assert_eq(kvr_store_shift(s, "c", 10, 20, 100, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_shift(s, "c", 25, SIZE_MAX, -3, &e), 0, "%s", e.msg);
    for (int i = 0; i < 30; i++)
        target[i] = i + (i >= 10 && i < 20 ? 100 : 0) + (i >= 25 ? -3 : 0);
    check_rotated(s, "c", 5, 0, 30, stored, target, false, KVR_DTYPE_F32, KVR_DTYPE_F32);
    check_rotated(s, "c", 5, 12, 27, stored + 12, target + 12, false, KVR_DTYPE_F32,
                  KVR_DTYPE_F16);
    /* V is untouched by shifts, and unshifted ranges are still bit-exact. */
    check_range(s, "c", 5, 0, 10, KVR_DTYPE_F32, NULL, 0);
    /* Shifting back restores stored positions: bit-exact again. */
    cr_assert_eq(kvr_store_shift(s, "c", 10, 20, -100, &e), 0);
    cr_assert_eq(kvr_store_shift(s, "c", 25, 30, 3, &e), 0);
    check_range(s, "c", 5, 0, 30, KVR_DTYPE_F32, NULL, 0);
    /* Overflow is refused and changes nothing. */
    cr_assert_eq(kvr_store_shift(s, "c", 0, 5, INT64_MAX, &e), KVR_EINVAL);
    check_range(s, "c", 5, 0, 30, KVR_DTYPE_F32, NULL, 0);
    cr_assert_eq(kvr_store_shift(s, "c", 0, 31, 1, &e), KVR_ERANGE);
    /* Append after a shift continues from the last logical position. */
    cr_assert_eq(kvr_store_shift(s, "c", 0, 30, 50, &e), 0);
    kvr_put_params pp = { .ctx_id = "c", .model = "m", .mode = KVR_PUT_APPEND, .n_layers = L,
                          .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32,
                          .n_tokens = 2, .tokens = tok };
    kvr_put *t;
    cr_assert_eq(kvr_store_put_begin(s, &pp, &t, &e), 0);
    kvr_put_result res;
    cr_assert_eq(kvr_put_commit(t, &res, &e), 0);
    cr_assert_eq(res.first_pos, 80);
    cr_assert_eq(res.last_pos, 81);
    cr_assert_eq(res.first_index, 30);
    cr_assert_eq(res.n_tokens, 32);
    free(tok);
    kvr_store_destroy(s);
}

Test(cache_store, keep)
{
    kvr_store *s = store_with_ctx(8, KVR_DTYPE_F16, "c", 2, 40, KVR_DTYPE_F16, NULL);
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_keep(s, "c", 5, 30, &e), 0);
    kvr_get_params p = { .ctx_id = "c", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    kvr_get *g;
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0);
    const kvr_get_info *gi = kvr_get_get_info(g);
    cr_assert_eq(gi->n_tokens, 25);
    for (size_t i = 0; i < 25; i++) {
        cr_assert_eq(gi->tokens[i], 5 + i);
        cr_assert_eq(gi->positions[i], (int64_t)(5 + i));
    }
    kvr_get_end(g);
    uint64_t vidx[25];
    seq_vidx(vidx, 25, 5);
    size_t gn, en;
    uint8_t *got = do_get(s, &p, &gn, NULL);
    void *exp = expect_payload(2, vidx, 25, ALL, L, KVR_DTYPE_F16, &en);
    cr_assert_eq(gn, en);
    cr_assert(memcmp(got, exp, en) == 0);
    free(got);
    free(exp);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "c", &ci, &e), 0);
    cr_assert_eq(ci.n_blocks, 4);     /* blocks 0..3 hold tokens 5..29 */
    cr_assert_eq(kvr_store_keep(s, "c", 0, 26, &e), KVR_ERANGE);
    kvr_store_destroy(s);
}

Test(cache_store, fork_cow)
{
    size_t base = kvr_mem_allocated();
    uint32_t *tok;
    kvr_store *s = store_with_ctx(8, KVR_DTYPE_F16, "a", 1, 20, KVR_DTYPE_F16, &tok);
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_fork(s, "a", "b", &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_fork(s, "a", "b", &e), KVR_EEXIST);
    cr_assert_eq(kvr_store_fork(s, "zz", "y", &e), KVR_ENOCTX);
    kvr_ctx_info ia, ib;
    cr_assert_eq(kvr_store_stat(s, "a", &ia, &e), 0);
    cr_assert_eq(kvr_store_stat(s, "b", &ib, &e), 0);
    cr_assert_eq(ia.n_shared_blocks, 3);
    cr_assert_eq(ib.n_shared_blocks, 3);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_blocks, 3);
    size_t gn;
    kvr_get_params p = { .ctx_id = "a", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    uint8_t *before = do_get(s, &p, &gn, NULL);
    /* Append to the fork with other data: the original's bytes don't change,
     * and the shared tail block (4 free slots) is not written. */
    cr_assert_eq(do_put(s, "b", "m", KVR_PUT_APPEND, 99, 20, 6, tok, KVR_DTYPE_F16, &e), 0);
    cr_assert_eq(do_put(s, "a", "m", KVR_PUT_APPEND, 1, 20, 3, tok, KVR_DTYPE_F16, &e), 0);
    size_t gn2;
    p.end = 20;
    uint8_t *after = do_get(s, &p, &gn2, NULL);
    cr_assert_eq(gn, gn2);
    cr_assert(memcmp(before, after, gn) == 0);
    check_range(s, "a", 1, 0, 23, KVR_DTYPE_F16, NULL, 0);
    check_range(s, "b", 1, 0, 20, KVR_DTYPE_F16, NULL, 0);
    check_range(s, "b", 99, 20, 26, KVR_DTYPE_F16, NULL, 0);
    cr_assert_eq(kvr_store_stat(s, "a", &ia, &e), 0);
    cr_assert_eq(ia.n_tokens, 23);
    cr_assert_eq(ia.n_shared_blocks, 3);
    cr_assert_eq(ia.n_blocks, 4);
    /* Deleting one side unshares. */
    cr_assert_eq(kvr_store_delete(s, "a", &e), 0);
    cr_assert_eq(kvr_store_stat(s, "b", &ib, &e), 0);
    cr_assert_eq(ib.n_shared_blocks, 0);
    check_range(s, "b", 1, 0, 20, KVR_DTYPE_F16, NULL, 0);
    free(before);
    free(after);
    free(tok);
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

Test(cache_store, delete_while_leased)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = store_with_ctx(8, KVR_DTYPE_F32, "c", 4, 20, KVR_DTYPE_F32, NULL);
    kvr_error e = { 0 };
    kvr_get_params p = { .ctx_id = "c", .end = SIZE_MAX, .dtype = KVR_DTYPE_F32 };
    kvr_get *g;
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_leased_blocks, 3);
    size_t held = kvr_mem_allocated();
    cr_assert_eq(kvr_store_delete(s, "c", &e), 0);
    cr_assert_eq(kvr_store_delete(s, "c", &e), KVR_ENOCTX);
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_blocks, 3);                 /* still held by the lease */
    cr_assert_geq(kvr_mem_allocated() + 4096, held - 4096);
    /* Data still readable. */
    size_t bytes;
    uint8_t *exp = make_payload(4, 0, 20, KVR_DTYPE_F32, &bytes);
    check_iov(g, exp, bytes);
    free(exp);
    kvr_get_end(g);
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_blocks, 0);
    cr_assert_eq(st.n_leased_blocks, 0);
    cr_assert_eq(st.block_bytes, 0);
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

Test(cache_store, errors)
{
    kvr_store *s = mk_store(0, 8);
    kvr_model_info mi;
    mk_model(s, "m", KVR_DTYPE_F16, &mi);
    mk_model(s, "m", KVR_DTYPE_F16, NULL);        /* idempotent */
    kvr_error e = { 0 };
    kvr_model_desc d = { .name = "m", .n_layers = L, .n_kv_heads = H, .head_dim = D,
                         .dtype = KVR_DTYPE_F32 };
    kvr_rope_config_init(&d.rope);
    cr_assert_eq(kvr_store_model_register(s, &d, NULL, &e), KVR_EEXIST);
    d.name = "bad";
    d.dtype = KVR_DTYPE_F16;
    d.rope.head_dim = 16;
    cr_assert_eq(kvr_store_model_register(s, &d, NULL, &e), KVR_ESHAPE);
    d.rope.head_dim = D;
    d.rope.rotary_dim = 3;
    cr_assert_eq(kvr_store_model_register(s, &d, NULL, &e), KVR_ECONFIG);
    cr_assert(strlen(e.msg) > 0);
    cr_assert_eq(kvr_store_model_find(s, "nope", NULL), KVR_ENOMODEL);
    cr_assert_eq(kvr_store_model_list(s, &mi, 1), 1);

    uint32_t tok[4] = { 1, 2, 3, 4 };
    kvr_put_params p = { .ctx_id = "c", .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F16,
                         .n_tokens = 4, .tokens = tok, .fingerprint = mi.fingerprint };
    kvr_put *t, *t2;
    kvr_put_params q = p;
    q.fingerprint = mi.fingerprint ^ 1;
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_EFINGERPRINT);
    q = p;
    q.n_kv_heads = H + 1;
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_ESHAPE);
    q = p;
    q.head_dim = 4;
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_ESHAPE);
    q = p;
    q.dtype = (kvr_dtype)9;
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_ESHAPE);
    q = p;
    q.model = "nope";
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_ENOMODEL);
    q = p;
    q.mode = KVR_PUT_APPEND;
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_ENOCTX);
    q = p;
    q.n_tokens = 0;
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_EBADREQUEST);
    q = p;
    q.ctx_id = "";
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_EBADREQUEST);
    char longid[300];
    memset(longid, 'x', 299);
    longid[299] = 0;
    q.ctx_id = longid;
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_EBADREQUEST);
    q = p;
    q.has_pos_start = true;
    q.pos_start = INT64_MAX - 2;
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), KVR_EINVAL);

    /* Busy: a pending create is invisible to readers, refused to writers. */
    cr_assert_eq(kvr_store_put_begin(s, &p, &t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_put_begin(s, &p, &t2, &e), KVR_EBUSY);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "c", &ci, &e), KVR_ENOCTX);
    kvr_put_abort(t);
    cr_assert_eq(kvr_store_stat(s, "c", &ci, &e), KVR_ENOCTX);
    cr_assert_eq(kvr_store_put_begin(s, &p, &t, &e), 0);
    cr_assert_eq(kvr_put_commit(t, NULL, &e), 0);
    cr_assert_eq(kvr_store_put_begin(s, &p, &t, &e), KVR_EEXIST);
    q = p;
    q.mode = KVR_PUT_UPSERT;
    cr_assert_eq(kvr_store_put_begin(s, &q, &t, &e), 0);
    cr_assert_eq(kvr_store_put_begin(s, &q, &t2, &e), KVR_EBUSY);
    cr_assert_eq(kvr_store_delete(s, "c", &e), KVR_EBUSY);
    cr_assert_eq(kvr_store_stat(s, "c", &ci, &e), 0);
    cr_assert(ci.busy);
    cr_assert_eq(ci.n_tokens, 4);
    kvr_put_abort(t);
    cr_assert_eq(kvr_store_get_begin(s, &(kvr_get_params){ .ctx_id = "x" }, &(kvr_get *){ 0 },
                                     &e), KVR_ENOCTX);
    cr_assert_eq(kvr_store_pin(s, "x", true, &e), KVR_ENOCTX);
    cr_assert_eq(kvr_store_shift(s, "x", 0, 1, 1, &e), KVR_ENOCTX);
    cr_assert_eq(kvr_store_keep(s, "x", 0, 1, &e), KVR_ENOCTX);
    kvr_match_result mr;
    cr_assert_eq(kvr_store_match(s, "nope", tok, 4, false, &mr, &e), KVR_ENOMODEL);
    cr_assert_str_eq(kvr_error_name(KVR_ENOCTX), "KVR_ENOCTX");
    cr_assert_str_eq(kvr_strerror(1), "unknown error");
    kvr_store_destroy(s);
}

Test(cache_store, abort_leaves_context_identical)
{
    uint32_t *tok;
    kvr_store *s = store_with_ctx(8, KVR_DTYPE_F16, "c", 6, 13, KVR_DTYPE_F16, &tok);
    kvr_error e = { 0 };
    size_t n1, n2;
    kvr_get_params gp = { .ctx_id = "c", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    uint8_t *before = do_get(s, &gp, &n1, NULL);
    kvr_ctx_info i1, i2;
    cr_assert_eq(kvr_store_stat(s, "c", &i1, &e), 0);
    kvr_store_stats st1, st2;
    kvr_store_get_stats(s, &st1);
    size_t mem1 = kvr_mem_allocated();
    for (int dt = 0; dt < 2; dt++) {
        kvr_put_params p = { .ctx_id = "c", .model = "m", .mode = KVR_PUT_APPEND,
                             .n_layers = L, .n_kv_heads = H, .head_dim = D,
                             .dtype = dt ? KVR_DTYPE_F32 : KVR_DTYPE_F16, .n_tokens = 12,
                             .tokens = tok };
        kvr_put *t;
        cr_assert_eq(kvr_store_put_begin(s, &p, &t, &e), 0);
        const struct iovec *iov;
        size_t niov;
        kvr_put_payload_iov(t, &iov, &niov);
        for (size_t i = 0; i < niov; i++)
            memset(iov[i].iov_base, 0x5a, iov[i].iov_len);
        if (kvr_put_needs_work(t))
            kvr_put_work(t, &e);
        kvr_put_abort(t);
    }
    uint8_t *after = do_get(s, &gp, &n2, NULL);
    cr_assert_eq(n1, n2);
    cr_assert(memcmp(before, after, n1) == 0);
    cr_assert_eq(kvr_store_stat(s, "c", &i2, &e), 0);
    cr_assert_eq(i1.n_tokens, i2.n_tokens);
    cr_assert_eq(i1.n_blocks, i2.n_blocks);
    cr_assert_not(i2.busy);
    kvr_store_get_stats(s, &st2);
    cr_assert_eq(st1.n_blocks, st2.n_blocks);
    cr_assert_eq(kvr_mem_allocated(), mem1);
    /* And a later append works and sees the tail. */
    cr_assert_eq(do_put(s, "c", "m", KVR_PUT_APPEND, 6, 13, 5, tok, KVR_DTYPE_F16, &e), 0);
    check_range(s, "c", 6, 0, 18, KVR_DTYPE_F16, NULL, 0);
    free(before);
    free(after);
    free(tok);
    kvr_store_destroy(s);
}

Test(cache_store, list_pin_stats_and_baseline)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = mk_store(0, 0);
    mk_model(s, "m", KVR_DTYPE_F16, NULL);
    mk_model(s, "n", KVR_DTYPE_F32, NULL);
    kvr_error e = { 0 };
    uint32_t *tok = seq_tokens(0, 100);
    const char *ids[] = { "delta", "alpha", "charlie", "bravo" };
    for (int i = 0; i < 4; i++)
        cr_assert_eq(do_put(s, ids[i], i % 2 ? "n" : "m", KVR_PUT_UPSERT, (uint32_t)i, 0,
                            10 + (size_t)i * 30, tok, KVR_DTYPE_F16, &e), 0, "%s", e.msg);
    kvr_ctx_info *li;
    size_t n;
    cr_assert_eq(kvr_store_list(s, NULL, &li, &n, &e), 0);
    cr_assert_eq(n, 4);
    cr_assert_str_eq(li[0].id, "alpha");
    cr_assert_str_eq(li[3].id, "delta");
    cr_assert_eq(li[0].n_tokens, 40);
    kvr_mem_free(li);
    cr_assert_eq(kvr_store_list(s, "n", &li, &n, &e), 0);
    cr_assert_eq(n, 2);
    cr_assert_str_eq(li[0].id, "alpha");
    cr_assert_str_eq(li[1].id, "bravo");
    kvr_mem_free(li);
    cr_assert_eq(kvr_store_list(s, "zz", &li, &n, &e), KVR_ENOMODEL);
    cr_assert_eq(kvr_store_pin(s, "alpha", true, &e), 0);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "alpha", &ci, &e), 0);
    cr_assert(ci.pinned);
    cr_assert_eq(ci.bytes > 0, 1);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_contexts, 4);
    cr_assert_eq(st.n_models, 2);
    cr_assert_eq(st.n_tokens, 10 + 40 + 70 + 100);
    cr_assert_eq(st.n_puts, 4);
    kvr_model_info mi;
    cr_assert_eq(kvr_store_model_find(s, "m", &mi), 0);
    cr_assert_eq(mi.n_contexts, 2);
    free(tok);
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

/* Dynamic NTK: a moved key is read with the table of the context's length
 * (the same table here: every length is within max_position_embeddings, so
 * the move is the plain delta rotation; test_cache_rope_layers crosses it). */
Test(cache_store, non_composing_rope_moves_with_its_length)
{
    kvr_store *s = mk_store(0, 8);
    kvr_model_desc d = { .name = "m", .n_layers = L, .n_kv_heads = H, .head_dim = D,
                         .dtype = KVR_DTYPE_F32 };
    kvr_rope_config_init(&d.rope);
    d.rope.scaling = KVR_ROPE_SCALING_DYNAMIC;
    d.rope.factor = 2.0;
    d.rope.max_position_embeddings = 2048;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_model_register(s, &d, NULL, &e), 0, "%s", e.msg);
    uint32_t *tok = seq_tokens(0, 10);
    cr_assert_eq(do_put(s, "c", "m", KVR_PUT_CREATE, 1, 0, 10, tok, KVR_DTYPE_F32, &e), 0);
    check_range(s, "c", 1, 0, 10, KVR_DTYPE_F16, NULL, 0);   /* same positions: fine */
    cr_assert_eq(kvr_store_shift(s, "c", 0, 10, 4, &e), 0);
    kvr_get_params p = { .ctx_id = "c", .end = SIZE_MAX, .dtype = KVR_DTYPE_F32 };
    kvr_get *g;
    size_t got_n, exp_n;
    uint8_t *got = do_get(s, &p, &got_n, NULL);
    uint64_t vidx[10];
    seq_vidx(vidx, 10, 0);
    float *exp = expect_payload(1, vidx, 10, ALL, L, KVR_DTYPE_F32, &exp_n);
    cr_assert_eq(got_n, exp_n);
    kvr_rope_config rc = d.rope;
    rc.head_dim = rc.rotary_dim = D;
    kvr_rope *r;
    cr_assert_eq(kvr_rope_create(&r, &rc, NULL), 0);
    int64_t from[10], to[10];
    for (int i = 0; i < 10; i++) {
        from[i] = i;
        to[i] = i + 4;
    }
    kvr_rope_opts ro = { .seq_len_from = 10, .seq_len_to = 14 };
    for (uint32_t l = 0; l < L; l++) {
        float *k = exp + (size_t)l * 2 * 10 * H * D;
        cr_assert_eq(kvr_rope_reposition(r, k, KVR_DTYPE_F32, k, KVR_DTYPE_F32, 10, H, from, to,
                                         &ro), 0);
    }
    cr_assert(memcmp(got, exp, exp_n) == 0, "moved dynamic-NTK keys differ from the engine's");
    kvr_rope_destroy(r);
    free(got);
    free(exp);
    p.meta_only = true;
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0);
    cr_assert_eq(kvr_get_get_info(g)->positions[0], 4);
    cr_assert_eq(kvr_get_payload_size(g), 0);
    kvr_get_end(g);
    free(tok);
    kvr_store_destroy(s);
}

/* ---- put REPLACE: a new context takes an existing id's place at commit ---- */

/* put_begin + payload of a put (no commit): the open transaction. */
static kvr_put *open_put(kvr_store *s, const char *id, const char *model, kvr_put_mode mode,
                         uint32_t seed, size_t n, const uint32_t *tokens, kvr_error *e)
{
    kvr_put_params p = { .ctx_id = id, .model = model, .mode = mode, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F16,
                         .n_tokens = n, .tokens = tokens };
    kvr_put *t = NULL;
    if (kvr_store_put_begin(s, &p, &t, e) != 0)
        return NULL;
    size_t bytes, off = 0, niov;
    uint8_t *pl = make_payload(seed, 0, n, KVR_DTYPE_F16, &bytes);
    const struct iovec *iov;
    kvr_put_payload_iov(t, &iov, &niov);
    for (size_t i = 0; i < niov; i++) {
        memcpy(iov[i].iov_base, pl + off, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    free(pl);
    return t;
}

static size_t n_contexts(const kvr_store *s)
{
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    return st.n_contexts;
}

static size_t match_len(kvr_store *s, const uint32_t *tok, size_t n, char *who)
{
    kvr_match_result r;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_match(s, "m", tok, n, false, &r, &e), 0, "%s", e.msg);
    if (who)
        strcpy(who, r.ctx_id);
    return r.length;
}

Test(cache_store, replace_missing_id_creates)
{
    kvr_store *s = mk_store(0, 16);
    mk_model(s, "m", KVR_DTYPE_F16, NULL);
    uint32_t *tok = seq_tokens(500, 20);
    kvr_error e = { 0 };
    cr_assert_eq(do_put(s, "r", "m", KVR_PUT_REPLACE, 4, 0, 20, tok, KVR_DTYPE_F16, &e), 0,
                 "%s", e.msg);
    cr_assert_eq(n_contexts(s), 1);
    check_range(s, "r", 4, 0, 20, KVR_DTYPE_F16, NULL, 0);
    cr_assert_eq(match_len(s, tok, 20, NULL), 20);
    free(tok);
    kvr_store_destroy(s);
}

Test(cache_store, replace_swaps_at_commit)
{
    kvr_store *s = mk_store(0, 16);
    mk_model(s, "m", KVR_DTYPE_F16, NULL);
    uint32_t *a = seq_tokens(1000, 40), *b = seq_tokens(2000, 24);
    kvr_error e = { 0 };
    cr_assert_eq(do_put(s, "x", "m", KVR_PUT_CREATE, 1, 0, 40, a, KVR_DTYPE_F16, &e), 0);
    cr_assert_eq(kvr_store_pin(s, "x", true, &e), 0);
    /* A reader holds the old context's blocks across the replace. */
    kvr_get_params gp = { .ctx_id = "x", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    kvr_get *reader = NULL;
    size_t rn;
    uint8_t *before = do_get(s, &gp, &rn, &reader);
    kvr_put *t = open_put(s, "x", "m", KVR_PUT_REPLACE, 2, 24, b, &e);
    cr_assert_not_null(t, "%s", e.msg);
    /* Until commit: the old context is what everyone sees, and it is busy
     * for writers; the new one is counted nowhere. */
    cr_assert_eq(n_contexts(s), 1);
    check_range(s, "x", 1, 0, 40, KVR_DTYPE_F16, NULL, 0);
    cr_assert_eq(match_len(s, a, 40, NULL), 40);
    cr_assert_eq(match_len(s, b, 24, NULL), 0);
    cr_assert_eq(do_put(s, "x", "m", KVR_PUT_UPSERT, 1, 40, 2, a, KVR_DTYPE_F16, &e), KVR_EBUSY);
    cr_assert_eq(kvr_store_delete(s, "x", &e), KVR_EBUSY);
    cr_assert_eq(do_put(s, "x", "m", KVR_PUT_REPLACE, 3, 0, 2, a, KVR_DTYPE_F16, &e), KVR_EBUSY);
    kvr_put_result res;
    cr_assert_eq(kvr_put_commit(t, &res, &e), 0, "%s", e.msg);
    cr_assert_eq(res.n_tokens, 24);
    cr_assert_eq(res.first_index, 0);
    cr_assert_eq(res.first_pos, 0);
    cr_assert_eq(n_contexts(s), 1);
    check_range(s, "x", 2, 0, 24, KVR_DTYPE_F16, NULL, 0);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "x", &ci, &e), 0);
    cr_assert_eq(ci.n_tokens, 24);
    cr_assert_not(ci.pinned);            /* nothing of the old one carries over */
    char who[KVR_ID_MAX + 1];
    cr_assert_eq(match_len(s, a, 40, NULL), 0);   /* the old tokens left the index */
    cr_assert_eq(match_len(s, b, 24, who), 24);
    cr_assert_str_eq(who, "x");
    /* The reader still has the old bytes; they go with its end. */
    check_iov(reader, before, rn);
    kvr_get_end(reader);
    free(before);
    /* The new context is an ordinary one: appendable, deletable. */
    cr_assert_eq(do_put(s, "x", "m", KVR_PUT_APPEND, 2, 24, 3, b, KVR_DTYPE_F16, &e), 0);
    cr_assert_eq(kvr_store_delete(s, "x", &e), 0);
    cr_assert_eq(n_contexts(s), 0);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_eq(st.n_blocks, 0);
    cr_assert_eq(st.n_leased_blocks, 0);
    free(a);
    free(b);
    kvr_store_destroy(s);
}

Test(cache_store, replace_refused_or_aborted_keeps_the_old)
{
    kvr_store_config cfg = { .block_tokens = 16, .max_contexts = 2 };
    kvr_store *s = NULL;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_create(&s, &cfg, &e), 0);
    mk_model(s, "m", KVR_DTYPE_F16, NULL);
    mk_model(s, "other", KVR_DTYPE_F16, NULL);
    uint32_t *a = seq_tokens(10, 30), *b = seq_tokens(90, 8);
    cr_assert_eq(do_put(s, "x", "m", KVR_PUT_CREATE, 5, 0, 30, a, KVR_DTYPE_F16, &e), 0);
    /* Another model's, another shape: refused, the old one as it was. */
    cr_assert_eq(do_put(s, "x", "other", KVR_PUT_REPLACE, 6, 0, 8, b, KVR_DTYPE_F16, &e),
                 KVR_EFINGERPRINT);
    kvr_put_params bad = { .ctx_id = "x", .model = "m", .mode = KVR_PUT_REPLACE,
                           .n_layers = L, .n_kv_heads = H + 1, .head_dim = D,
                           .dtype = KVR_DTYPE_F16, .n_tokens = 8, .tokens = b };
    kvr_put *t = NULL;
    cr_assert_eq(kvr_store_put_begin(s, &bad, &t, &e), KVR_ESHAPE);
    bad.n_kv_heads = H;
    bad.has_payload_bytes = true;
    bad.payload_bytes = 7;
    cr_assert_eq(kvr_store_put_begin(s, &bad, &t, &e), KVR_EPAYLOAD);
    bad.has_payload_bytes = false;
    bad.prefix_ctx = "x";
    cr_assert_eq(kvr_store_put_begin(s, &bad, &t, &e), KVR_EINVAL);
    check_range(s, "x", 5, 0, 30, KVR_DTYPE_F16, NULL, 0);
    /* Aborted with its payload in: the old one stays, writable again. */
    t = open_put(s, "x", "m", KVR_PUT_REPLACE, 6, 8, b, &e);
    cr_assert_not_null(t, "%s", e.msg);
    kvr_put_abort(t);
    check_range(s, "x", 5, 0, 30, KVR_DTYPE_F16, NULL, 0);
    cr_assert_eq(match_len(s, a, 30, NULL), 30);
    cr_assert_eq(match_len(s, b, 8, NULL), 0);
    /* The old one being written: E_BUSY, both puts' contexts intact. */
    kvr_put *w = open_put(s, "x", "m", KVR_PUT_APPEND, 5, 2, a, &e);
    cr_assert_not_null(w, "%s", e.msg);
    cr_assert_eq(do_put(s, "x", "m", KVR_PUT_REPLACE, 6, 0, 8, b, KVR_DTYPE_F16, &e), KVR_EBUSY);
    kvr_put_abort(w);
    /* A replace adds no context: not held to max_contexts. */
    cr_assert_eq(do_put(s, "y", "m", KVR_PUT_CREATE, 7, 0, 4, b, KVR_DTYPE_F16, &e), 0);
    cr_assert_eq(do_put(s, "z", "m", KVR_PUT_REPLACE, 7, 0, 4, b, KVR_DTYPE_F16, &e), KVR_ELIMIT);
    cr_assert_eq(do_put(s, "x", "m", KVR_PUT_REPLACE, 6, 0, 8, b, KVR_DTYPE_F16, &e), 0,
                 "%s", e.msg);
    check_range(s, "x", 6, 0, 8, KVR_DTYPE_F16, NULL, 0);
    cr_assert_eq(n_contexts(s), 2);
    free(a);
    free(b);
    kvr_store_destroy(s);
}

/* Block-sized allocations (kvr_mem_aligned at the blocks' alignment, over
 * and under mem.c's HUGE_MIN, where it aligns to 2 MiB for THP): accounted
 * at their usable size, which is what kvr_mem_size_class predicts under
 * jemalloc (the store reserves a block's memory with it) and at most that
 * under libc, and every byte writable. */
Test(cache_store, block_allocations_accounted)
{
    const size_t sizes[] = { 4096, 511u << 10, 512u << 10, (1u << 20) + 1024, 5u << 20,
                             (8u << 20) + 2048 };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t base = kvr_mem_allocated(), n = sizes[i];
        uint8_t *p = kvr_mem_aligned(64, n);
        cr_assert_not_null(p);
        cr_assert_eq((uintptr_t)p % 64, 0);
        size_t got = kvr_mem_allocated() - base;
        cr_assert_geq(got, n);
        cr_assert_leq(got, kvr_mem_size_class(n), "%zu: holds %zu, size class %zu", n, got,
                      kvr_mem_size_class(n));
#ifdef KVR_JEMALLOC
        cr_assert_eq(got, kvr_mem_size_class(n));
#endif
        memset(p, 0xa5, n);
        kvr_mem_free(p);
        cr_assert_eq(kvr_mem_allocated(), base);
    }
}

/* What is accounted is what is resident. jemalloc (cache-oblivious, as
 * Debian builds it) maps a large allocation (16 KiB and up) with a page
 * more than its usable size and, unless asked for page alignment, starts
 * it at a random cache line of that page, which is then resident too:
 * kvr_mem_aligned asks for page alignment (blocks hold their size class),
 * a large kvr_mem_malloc counts the page. Written end to end, 512 of each
 * grow the resident set by no more than the accounting grew. */
static size_t rss_now(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long size = 0, res = 0;
    cr_assert_not_null(f);
    cr_assert_eq(fscanf(f, "%lu %lu", &size, &res), 2);
    fclose(f);
    return (size_t)res * (size_t)sysconf(_SC_PAGESIZE);
}

Test(cache_store, accounted_is_what_is_resident)
{
    enum { N = 512 };
    static uint8_t *p[N];
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (int way = 0; way < 2; way++) {
        size_t n = 16384;
#ifdef KVR_JEMALLOC
        (void)mallctl("thread.tcache.flush", NULL, NULL, NULL, 0);
        (void)mallctl("arena.4096.purge", NULL, NULL, NULL, 0);   /* all arenas */
#endif
        size_t base = kvr_mem_allocated(), rss0 = rss_now();
        for (int i = 0; i < N; i++) {
            p[i] = way ? kvr_mem_malloc(n) : kvr_mem_aligned(64, n);
            cr_assert_not_null(p[i]);
            memset(p[i], i, n);
            size_t held = kvr_mem_held(p[i]);
            cr_assert_geq(held, n);
#ifdef KVR_JEMALLOC
            if (!way)
                cr_assert_eq((uintptr_t)p[i] % page, 0, "a large block is page-aligned");
            cr_assert_eq(held, kvr_mem_size_class(n) + ((uintptr_t)p[i] % page ? page : 0),
                         "%s of %zu at %p: %zu held", way ? "malloc" : "aligned", n,
                         (void *)p[i], held);
#endif
        }
        size_t acct = kvr_mem_allocated() - base, rss1 = rss_now();
        size_t rss = rss1 > rss0 ? rss1 - rss0 : 0;
#ifdef KVR_JEMALLOC   /* sanitizer builds: libc's heap and ASan's shadow */
        cr_assert_leq(rss, acct + acct / 50 + (256u << 10), "%s: %d allocations of %zu bytes "
                      "written: resident set +%zu, accounted +%zu", way ? "malloc" : "aligned",
                      N, n, rss, acct);
#else
        (void)rss;
        (void)acct;
        (void)page;
#endif
        for (int i = 0; i < N; i++)
            kvr_mem_free(p[i]);
        cr_assert_eq(kvr_mem_allocated(), base);
    }
}

/* Large blocks (3 layers x 2 heads x 8 dims f16 at 4096 tokens a block:
 * 832 KiB), whole and partial (a put's tail, filled by appends): bit-exact
 * round trips, and memory back to where it was. */
Test(cache_store, large_blocks_roundtrip)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = mk_store(0, 4096);
    mk_model(s, "m", KVR_DTYPE_F16, NULL);
    kvr_error e = { 0 };
    const size_t sizes[] = { 4096 + 100, 4000, 8192 + 3 };
    size_t total = put_pieces(s, 5, sizes, 3);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(s, "c", &ci, &e), 0);
    cr_assert_eq(ci.n_blocks, (total + 4095) / 4096);
    size_t ranges[][2] = { { 0, 16391 }, { 4090, 4200 }, { 8190, 8200 }, { 16000, 16391 } };
    for (size_t r = 0; r < 4; r++)
        check_range(s, "c", 5, ranges[r][0], ranges[r][1], KVR_DTYPE_F16, NULL, 0);
    check_range(s, "c", 5, 100, 9000, KVR_DTYPE_F32, NULL, 0);
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    /* Every token's K/V (3 layers) and metadata is accounted; the full
     * blocks' K/V at its size class (an exact 768 KiB: the metadata is its
     * own allocation), and the partial last block no more than its size
     * class over what its tokens need. */
    size_t tok_bytes = 3 * 2 * 16 * 2 + 16, kvb = 4096u * 3 * 2 * 16 * 2;
    cr_assert_geq(st.block_bytes, total * tok_bytes);
    (void)kvb;
#ifdef KVR_JEMALLOC
    cr_assert_eq(kvr_mem_size_class(kvb), kvb);
    cr_assert_geq(st.block_bytes, (total / 4096) * kvr_mem_size_class(kvb));
#endif
    cr_assert_leq(st.block_bytes, (double)total * tok_bytes * 1.3 + 64 * 1024);
    cr_assert_eq(kvr_store_delete(s, "c", &e), 0, "%s", e.msg);
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}
