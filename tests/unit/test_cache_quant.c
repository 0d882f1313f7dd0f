/*
 * test_cache_quant.c — quantized KV at rest in the store (issue 6).
 *
 * Every token i has a deterministic pre-RoPE key E[l][i] (a few outlier
 * channels) and value V[l][i]; puts send K = rope(E, pos) in f32. For
 * quantized codecs the store un-rotates in f32 and quantizes, so the raw
 * get's bytes decode (codec.h) to Q = dequantize(quantize(E')) where
 * E' = rope_remove(K, pos) — checked within half a quantization step of E'
 * per element — and the dequantized get equals rope(Q, target) within one
 * rounding, before and after shifts, edits and forks.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "cache/codec.h"
#include "tests/common/kvt_codec.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_store.h"

#define L 2
#define H 2
#define D 64
#define ROW (H * D)

static kvr_store *S;
static const kvr_rope *ENG;

static void setup(void)
{
    kvr_model_info mi;
    S = kvt_store_with_model(NULL, L, H, D, KVR_DTYPE_F32, &mi);
    ENG = mi.engine;
}

static void teardown(void)
{
    kvr_store_destroy(S);
}

TestSuite(quant, .init = setup, .fini = teardown);

static float pre_val(int l, int kv, size_t tok, size_t j)
{
    uint32_t h = (uint32_t)(l * 7919 + kv * 104729) ^ (uint32_t)(tok * 2654435761u) ^
                 (uint32_t)(j * 40503u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    float x = (float)(h % 20001u) / 10000.0f - 1.0f;
    if (j % 37 == 5)
        x *= 8.0f;                      /* outlier channels */
    return x;
}

/* Payload [l][kv][n][ROW] f32 for tokens t0.. at positions pos0.. */
static float *payload(size_t t0, size_t n, int64_t pos0)
{
    float *p = malloc((size_t)L * 2 * n * ROW * sizeof *p);
    int64_t *pos = malloc(n * sizeof *pos);
    float *e = malloc(n * ROW * sizeof *e);
    for (size_t i = 0; i < n; i++)
        pos[i] = pos0 + (int64_t)i;
    for (int l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            float *dst = p + ((size_t)l * 2 + (size_t)kv) * n * ROW;
            for (size_t i = 0; i < n; i++)
                for (size_t j = 0; j < ROW; j++)
                    e[i * ROW + j] = pre_val(l, kv, t0 + i, j);
            if (kv == 0)
                kvr_rope_apply(ENG, dst, KVR_DTYPE_F32, e, KVR_DTYPE_F32, n, H, pos, NULL);
            else
                memcpy(dst, e, n * ROW * sizeof *e);
        }
    free(pos);
    free(e);
    return p;
}

/* The f32 put into id of n tokens t0.. at positions pos0..; the tokens
 * are malloc'd (the caller frees p->tokens). */
static kvr_put_params put_params(const char *id, kvr_put_mode mode, const char *codec, size_t t0,
                                 size_t n, int64_t pos0)
{
    uint32_t *tok = malloc(n * sizeof *tok);
    cr_assert_not_null(tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = (uint32_t)(t0 + i);
    return (kvr_put_params){ .ctx_id = id, .model = "m", .mode = mode, .n_layers = L,
                             .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32,
                             .n_tokens = n, .tokens = tok, .codec = codec,
                             .has_pos_start = true, .pos_start = pos0 };
}

static int put_raw(const char *id, kvr_put_mode mode, const char *codec, size_t t0, size_t n,
                   int64_t pos0, const float *pl, kvr_error *e)
{
    kvr_put_params p = put_params(id, mode, codec, t0, n, pos0);
    size_t bytes = (size_t)L * 2 * n * ROW * sizeof(float);
    kvt_src src = { pl, bytes, 0 };
    int rc = kvt_put_try(S, &p, kvt_fill_src, &src, NULL, e);
    free((void *)(uintptr_t)p.tokens);
    if (rc == 0)
        cr_assert_eq(src.off, bytes);
    return rc;
}

static int put(const char *id, kvr_put_mode mode, const char *codec, size_t t0, size_t n,
               int64_t pos0, kvr_error *e)
{
    float *pl = payload(t0, n, pos0);
    int rc = put_raw(id, mode, codec, t0, n, pos0, pl, e);
    free(pl);
    return rc;
}

/* src's bytes into the buffers of iov[0..niov), in order. */
static void scatter(const struct iovec *iov, size_t niov, const void *src)
{
    size_t off = 0;
    for (size_t i = 0; i < niov; i++) {
        memcpy(iov[i].iov_base, (const uint8_t *)src + off, iov[i].iov_len);
        off += iov[i].iov_len;
    }
}

/* An append to id of n tokens from t0 (at position t0) with channel ch of
 * token tok of layer l's K (kv 0) or V (1) set to bad (nan or inf):
 * refused as KVR_EINVAL with both m1 and m2 in the message. */
static void append_bad_refused(const char *id, size_t t0, size_t n, size_t l, size_t kv,
                               size_t tok, size_t ch, float bad, const char *m1, const char *m2)
{
    kvr_error e = { 0 };
    float *pl = payload(t0, n, (int64_t)t0);
    pl[(l * 2 + kv) * n * ROW + tok * ROW + ch] = bad;
    int rc = put_raw(id, KVR_PUT_APPEND, NULL, t0, n, (int64_t)t0, pl, &e);
    cr_assert_eq(rc, KVR_EINVAL);
    cr_assert(strstr(e.msg, m1) && strstr(e.msg, m2), "%s", e.msg);
    free(pl);
}

/* A create of n tokens of id from token 0 at position 0, asserted. */
static void create_ok(const char *id, const char *codec, size_t n)
{
    kvr_error e = { 0 };
    cr_assert_eq(put(id, KVR_PUT_CREATE, codec, 0, n, 0, &e), 0, "%s", e.msg);
}

static uint8_t *get(const char *id, bool raw, size_t start, size_t end, const int64_t *pos,
                    size_t *bytes, kvr_get_info *info_out, int *rc_out)
{
    kvr_get_params p = { .ctx_id = id, .start = start, .end = end, .dtype = KVR_DTYPE_F32,
                         .raw = raw, .positions = pos };
    kvr_get *g = NULL;
    kvr_error e = { 0 };
    int rc = 0;
    size_t n;
    uint8_t *out = kvt_get_payload_try(S, &p, &n, &g, &rc, &e);
    if (rc_out)
        *rc_out = rc;
    if (rc) {
        cr_assert(rc_out, "get: %s", e.msg);
        return NULL;
    }
    if (info_out) {
        *info_out = *kvr_get_get_info(g);
        info_out->positions = NULL;   /* not valid after end */
    }
    kvr_get_end(g);
    *bytes = n;
    return out;
}

/* Decodes a raw get of n tokens into pre-RoPE [l][kv][n][ROW] f32, checking
 * the half-step bound against the store's exact input E' for uniform
 * codecs. */
static float *decode_raw(const uint8_t *raw, size_t n, const kvr_codec *kc,
                         const kvr_codec *vc, const float *ref_pre)
{
    float *out = malloc((size_t)L * 2 * n * ROW * sizeof *out);
    uint32_t G = kc->axis == KVR_CODEC_AXIS_CHANNEL ? kvr_codec_group(kc) : 1;
    size_t krow = G > 1 ? kvr_codec_tile_bytes(kc, ROW) : kvr_codec_row_bytes(kc, ROW);
    size_t vrow = kvr_codec_row_bytes(vc, ROW);
    size_t kb = G > 1 ? (n + G - 1) / G * krow : n * krow;
    const uint8_t *p = raw;
    float *tile = malloc((size_t)(G > 1 ? G : 1) * ROW * sizeof *tile);
    for (int l = 0; l < L; l++) {
        float *k = out + (size_t)l * 2 * n * ROW, *v = k + n * ROW;
        const float *rk = ref_pre + (size_t)l * 2 * n * ROW, *rv = rk + n * ROW;
        for (size_t i = 0; i < n; i += G) {
            if (G > 1) {
                const uint8_t *tb = p + i / G * krow;
                kvr_codec_decode_tile(kc, tile, KVR_DTYPE_F32, ROW, tb, ROW);
                size_t m = n - i < G ? n - i : G;
                memcpy(k + i * ROW, tile, m * ROW * sizeof *tile);
                for (size_t ch = 0; ch < ROW; ch++) {
                    float s, mn;
                    kvr_codec_group_params(kc, tb, (size_t)G * ROW, ch, &s, &mn);
                    for (size_t t = 0; t < m; t++) {
                        float x = rk[(i + t) * ROW + ch], y = k[(i + t) * ROW + ch];
                        cr_assert_leq(fabsf(x - y), s / 2 + 1e-5f * (fabsf(x) + 1),
                                      "K tile l%d tok %zu ch %zu: %g vs %g (s %g)", l,
                                      i + t, ch, (double)x, (double)y, (double)s);
                    }
                }
            } else {
                kvr_codec_decode(kc, k + i * ROW, KVR_DTYPE_F32, p + i * krow, ROW);
            }
        }
        p += kb;
        for (size_t i = 0; i < n; i++)
            kvr_codec_decode(vc, v + i * ROW, KVR_DTYPE_F32, p + i * vrow, ROW);
        /* Half-step bound for uniform per-token rows. */
        for (int kv = 0; kv < 2; kv++) {
            const kvr_codec *c = kv ? vc : kc;
            if (!kvr_codec_is_uniform(c->type) || (kv == 0 && G > 1))
                continue;
            size_t rb = kv ? vrow : krow, grp = kvr_codec_group(c);
            const uint8_t *base = kv ? p : p - kb;
            const float *ref = kv ? rv : rk, *dec = kv ? v : k;
            for (size_t i = 0; i < n; i++)
                for (size_t j = 0; j < ROW; j++) {
                    float s, mn;
                    kvr_codec_group_params(c, base + i * rb, ROW, j / grp, &s, &mn);
                    float x = ref[i * ROW + j], y = dec[i * ROW + j];
                    cr_assert_leq(fabsf(x - y), s / 2 + 1e-5f * (fabsf(x) + 1),
                                  "%c l%d tok %zu j %zu: %g vs %g (s %g)", kv ? 'V' : 'K',
                                  l, i, j, (double)x, (double)y, (double)s);
                }
        }
        p += n * vrow;
    }
    free(tile);
    return out;
}

/* E' (what the store quantizes): keys un-rotated from the payload in f32. */
static float *pre_rope_ref(size_t t0, size_t n, int64_t pos0)
{
    float *pl = payload(t0, n, pos0);
    int64_t *pos = malloc(n * sizeof *pos);
    for (size_t i = 0; i < n; i++)
        pos[i] = pos0 + (int64_t)i;
    for (int l = 0; l < L; l++) {
        float *k = pl + (size_t)l * 2 * n * ROW;
        float *tmp = malloc(n * ROW * sizeof *tmp);
        kvr_rope_remove(ENG, tmp, KVR_DTYPE_F32, k, KVR_DTYPE_F32, n, H, pos, NULL);
        memcpy(k, tmp, n * ROW * sizeof *tmp);
        free(tmp);
    }
    free(pos);
    return pl;
}

/* got, n rows of layer l's K (kv 0) or V (1), must equal src's rows
 * rotated to pos (K) or as they are (V) within 1e-5 relative; exp is
 * scratch of n rows. */
static void check_rows(const float *got, const float *src, float *exp, size_t n,
                       const int64_t *pos, int l, int kv, const char *what)
{
    if (kv == 0)
        kvr_rope_apply(ENG, exp, KVR_DTYPE_F32, src, KVR_DTYPE_F32, n, H, pos, NULL);
    else
        memcpy(exp, src, n * ROW * sizeof *exp);
    for (size_t i = 0; i < n * ROW; i++)
        cr_assert_leq(fabsf(got[i] - exp[i]), 1e-5f * (fabsf(exp[i]) + 1),
                      "%s l%d kv%d elem %zu: %g vs %g", what, l, kv, i, (double)got[i],
                      (double)exp[i]);
}

/* get (f32, at pos or logical) must equal rope(Q, pos) / Q values. */
static void check_get(const char *id, const float *q, size_t qn, const size_t *map, size_t n,
                      const int64_t *pos)
{
    size_t bytes;
    uint8_t *g = get(id, false, 0, SIZE_MAX, NULL, &bytes, NULL, NULL);
    cr_assert_eq(bytes, (size_t)L * 2 * n * ROW * sizeof(float));
    const float *gf = (const float *)(const void *)g;
    char what[160];
    snprintf(what, sizeof what, "%s n%zu", id, n);
    float *src = malloc(n * ROW * sizeof *src), *exp = malloc(n * ROW * sizeof *exp);
    for (int l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            const float *qs = q + ((size_t)l * 2 + (size_t)kv) * qn * ROW;
            for (size_t i = 0; i < n; i++)
                memcpy(src + i * ROW, qs + map[i] * ROW, ROW * sizeof *src);
            check_rows(gf + ((size_t)l * 2 + (size_t)kv) * n * ROW, src, exp, n, pos, l,
                       kv, what);
        }
    free(src);
    free(exp);
    free(g);
}

static void round_trip(const char *spec, const kvr_codec *kc, const kvr_codec *vc)
{
    kvr_error e = { 0 };
    const size_t n = 320;
    cr_assert_eq(put("c", KVR_PUT_CREATE, spec, 0, n, 5, &e), 0, "%s: %s", spec, e.msg);
    float *ref = pre_rope_ref(0, n, 5);
    size_t bytes;
    kvr_get_info gi;
    uint8_t *raw = get("c", true, 0, SIZE_MAX, NULL, &bytes, &gi, NULL);
    cr_assert(gi.raw);
    cr_assert_eq(bytes, (gi.k_bytes + gi.v_bytes) * L);
    float *q = decode_raw(raw, n, kc, vc, ref);
    size_t *map = malloc(n * sizeof *map);
    int64_t *pos = malloc(n * sizeof *pos);
    for (size_t i = 0; i < n; i++) {
        map[i] = i;
        pos[i] = 5 + (int64_t)i;
    }
    check_get("c", q, n, map, n, pos);
    /* Shift: metadata only, keys rotated exactly at the new positions. */
    cr_assert_eq(kvr_store_shift(S, "c", 100, n, 1000, &e), 0, "%s", e.msg);
    for (size_t i = 100; i < n; i++)
        pos[i] += 1000;
    check_get("c", q, n, map, n, pos);
    /* Edit: delete [10, 30), the rest moves back 20 positions. */
    kvr_edit_op op = { .start = 10, .end = 30 };
    kvr_edit_params ep = { .ctx_id = "c", .ops = &op, .n_ops = 1 };
    kvr_edit *et = NULL;
    cr_assert_eq(kvr_store_edit_begin(S, &ep, &et, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_edit_commit(et, NULL, NULL, &e), 0, "%s", e.msg);
    size_t m2 = 0;
    for (size_t i = 0; i < n; i++) {
        if (i >= 10 && i < 30)
            continue;
        map[m2] = i;
        pos[m2] = pos[i] - (i >= 30 ? 20 : 0);
        m2++;
    }
    check_get("c", q, n, map, m2, pos);
    /* Fork and append: the original is untouched (copy-on-write). */
    cr_assert_eq(kvr_store_fork(S, "c", "f", &e), 0, "%s", e.msg);
    cr_assert_eq(put("f", KVR_PUT_APPEND, NULL, 1000, 200, 2000, &e), 0, "%s", e.msg);
    check_get("c", q, n, map, m2, pos);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(S, "c", &ci, &e), 0);
    cr_assert_gt(ci.bytes_saved, 0);
    cr_assert_lt(ci.bits_per_value, 16.0);
    cr_assert_gt(ci.rel_rms_k, 0.0);
    /* int2 on data with 8x outlier channels is coarse; the per-element
     * half-step bound above is the real check. */
    cr_assert_lt(ci.rel_rms_k, 1.5, "%g", ci.rel_rms_k);
    cr_assert_lt(ci.rel_rms_v, 1.5, "%g", ci.rel_rms_v);
    free(map);
    free(pos);
    free(q);
    free(raw);
    free(ref);
}

static kvr_codec cod(kvr_codec_type t, uint32_t g, kvr_codec_axis ax)
{
    kvr_codec c = { .type = t, .group = g, .axis = ax };
    return c;
}

Test(quant, int8_round_trip)
{
    kvr_codec c = cod(KVR_CODEC_INT8, 64, 0);
    round_trip("int8", &c, &c);
}

Test(quant, int4_g32_round_trip)
{
    kvr_codec c = cod(KVR_CODEC_INT4, 32, 0);
    round_trip("int4/g32", &c, &c);
}

Test(quant, int2_round_trip)
{
    kvr_codec c = cod(KVR_CODEC_INT2, 64, 0);
    round_trip("int2", &c, &c);
}

Test(quant, ggml_round_trips)
{
    const char *names[] = { "q8_0", "q4_0", "q4_1", "q5_0" };
    kvr_codec_type ty[] = { KVR_CODEC_Q8_0, KVR_CODEC_Q4_0, KVR_CODEC_Q4_1, KVR_CODEC_Q5_0 };
    for (int i = 0; i < 4; i++) {
        kvr_error e = { 0 };
        kvr_codec c = cod(ty[i], 0, 0);
        round_trip(names[i], &c, &c);
        kvr_store_delete(S, "c", &e);
        kvr_store_delete(S, "f", &e);
    }
}

Test(quant, kivi_tiles_no_window)
{
    kvr_codec k = cod(KVR_CODEC_INT4, 64, KVR_CODEC_AXIS_CHANNEL);
    kvr_codec v = cod(KVR_CODEC_INT2, 128, 0);
    /* 320 = 5 tiles of 64: all quantized with r=0. */
    round_trip("k=int4/g64/c,v=int2/g128,r=0", &k, &v);
}

Test(quant, k4v2_pair_mixed)
{
    kvr_codec k = cod(KVR_CODEC_INT4, 64, 0);
    kvr_codec v = cod(KVR_CODEC_INT2, 64, 0);
    round_trip("k=int4,v=int2", &k, &v);
}

Test(quant, window_fills_and_flushes)
{
    kvr_error e = { 0 };
    kvr_codec_pair pair = { .k = cod(KVR_CODEC_INT4, 32, KVR_CODEC_AXIS_CHANNEL),
                            .v = cod(KVR_CODEC_INT2, 32, 0), .window = 64 };
    size_t n = 0;
    create_ok("w", "kivi:k4v2:g32:r64", 1);
    n = 1;
    size_t steps[] = { 1, 1, 5, 30, 40, 1, 1, 64, 3, 100, 1, 7 };
    for (size_t s = 0; s < sizeof steps / sizeof *steps; s++) {
        cr_assert_eq(put("w", KVR_PUT_APPEND, NULL, n, steps[s], (int64_t)n, &e), 0, "%s",
                     e.msg);
        n += steps[s];
        kvr_ctx_info ci;
        cr_assert_eq(kvr_store_stat(S, "w", &ci, &e), 0);
        size_t kq, vq;
        kvr_kivi_split(&pair, n, &kq, &vq);
        cr_assert_eq(ci.n_tokens, n);
        cr_assert_eq(ci.n_window, n - kq, "n %zu: window %zu, expected %zu", n, ci.n_window,
                     n - kq);
    }
    /* Data: quantized part decodes within a step; window part exact. */
    size_t bytes;
    uint8_t *g = get("w", false, 0, SIZE_MAX, NULL, &bytes, NULL, NULL);
    float *pl = payload(0, n, 0);
    const float *gf = (const float *)(const void *)g;
    size_t kq, vq;
    kvr_kivi_split(&pair, n, &kq, &vq);
    for (int l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            const float *a = gf + ((size_t)l * 2 + (size_t)kv) * n * ROW;
            const float *b = pl + ((size_t)l * 2 + (size_t)kv) * n * ROW;
            for (size_t i = kq * ROW; i < n * ROW; i++)
                cr_assert_eq(a[i], b[i], "window elem %zu", i);
            double err = 0, ss = 0;
            for (size_t i = 0; i < kq * ROW; i++) {
                double x = (double)a[i] - (double)b[i];
                err += x * x;
                ss += (double)b[i] * (double)b[i];
            }
            cr_assert_lt(sqrt(err / ss), kv ? 0.6 : 0.2);
        }
    /* Raw: the window refuses, the quantized part works. */
    int rc;
    cr_assert_null(get("w", true, 0, SIZE_MAX, NULL, &bytes, NULL, &rc));
    cr_assert_eq(rc, KVR_EUNSUPPORTED);
    free(get("w", true, 0, kq, NULL, &bytes, NULL, NULL));
    free(g);
    free(pl);
}

Test(quant, nan_inf_refused_context_unchanged)
{
    kvr_error e = { 0 };
    create_ok("n", "int4", 64);
    size_t b0;
    uint8_t *before = get("n", false, 0, SIZE_MAX, NULL, &b0, NULL, NULL);
    append_bad_refused("n", 64, 10, 1, 1, 5, 3, NAN, "layer 1", "token 5");
    append_bad_refused("n", 64, 10, 0, 0, 2, 0, INFINITY, "layer 0", "token 2");
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(S, "n", &ci, &e), 0);
    cr_assert_eq(ci.n_tokens, 64);
    size_t b1;
    uint8_t *after = get("n", false, 0, SIZE_MAX, NULL, &b1, NULL, NULL);
    cr_assert_eq(b0, b1);
    cr_assert_eq(memcmp(before, after, b0), 0);
    free(before);
    free(after);
}

Test(quant, degenerate_groups)
{
    kvr_error e = { 0 };
    float *pl = calloc((size_t)L * 2 * 64 * ROW, sizeof *pl);
    for (size_t i = 0; i < 64 * ROW; i++)
        pl[64 * ROW + i] = 0.75f;          /* layer 0 V constant; keys zero */
    cr_assert_eq(put_raw("z", KVR_PUT_CREATE, "int2", 0, 64, 0, pl, &e), 0, "%s", e.msg);
    size_t b;
    float *g = (float *)(void *)get("z", false, 0, SIZE_MAX, NULL, &b, NULL, NULL);
    for (size_t i = 0; i < (size_t)L * 2 * 64 * ROW; i++)
        cr_assert_eq(g[i], pl[i], "elem %zu: %g vs %g", i, (double)g[i], (double)pl[i]);
    free(g);
    free(pl);
}

Test(quant, bad_specs)
{
    kvr_error e = { 0 };
    char out[KVR_CODEC_NAME_MAX];
    cr_assert_eq(kvr_store_codec_check(S, "m", "k4v2", out, &e), 0, "%s", e.msg);
    cr_assert_str_eq(out, "k=int4/g128/c,v=int2/g256,r=128");
    cr_assert_eq(kvr_store_codec_check(S, "m", "kivi:k4v2:g32:r64", out, &e), 0);
    cr_assert_str_eq(out, "k=int4/g32/c,v=int2/g32,r=64");
    cr_assert_eq(kvr_store_codec_check(S, "m", "f16", out, &e), 0);
    cr_assert_str_eq(out, "f16");
    cr_assert_eq(kvr_store_codec_check(S, "m", "int5", out, &e), KVR_EINVAL);
    cr_assert_eq(kvr_store_codec_check(S, "m", "k=int4,v=int2/c", out, &e), KVR_EINVAL);
    cr_assert_eq(put("x", KVR_PUT_CREATE, "int4/g48", 0, 4, 0, &e), KVR_EINVAL);
    cr_assert_eq(kvr_store_stat(S, "x", NULL, &e), KVR_ENOCTX);
}

/* The default K4V2 in the Llama-3-8B shape: >= 5x smaller than f16,
 * scales and per-token metadata included (window excluded: steady state). */
Test(quant, k4v2_ratio_llama_shape)
{
    kvr_error e = { 0 };
    kvr_model_desc d = { .name = "llama", .n_layers = 32, .n_kv_heads = 8, .head_dim = 128,
                         .dtype = KVR_DTYPE_F16, .codec = "k4v2" };
    kvr_rope_config_init(&d.rope);
    d.rope.theta = 500000.0;
    kvr_model_info mi;
    cr_assert_eq(kvr_store_model_register(S, &d, &mi, &e), 0, "%s", e.msg);
    cr_assert_str_eq(mi.codec, "k=int4/g128/c,v=int2/g256,r=128");
    kvr_codec_pair p = { .k = cod(KVR_CODEC_INT4, 128, KVR_CODEC_AXIS_CHANNEL),
                         .v = cod(KVR_CODEC_INT2, 256, 0) };
    double q = kvr_codec_pair_bytes_per_token(&p, 32, 8, 128) + 16;   /* + metadata */
    double f16 = 32.0 * 2 * 8 * 128 * 2 + 16;
    cr_assert_geq(f16 / q, 5.0, "ratio %.3f", f16 / q);
}

/* Assemble moves pre-RoPE quantized keys to the layout's positions: the
 * stream equals rope(Q, layout position) for prefix and document. */
Test(quant, assemble_explicit_positions)
{
    kvr_error e = { 0 };
    const size_t P = 16, N = 40;
    create_ok("p", "int8", P);
    float *pl = payload(500, N, (int64_t)P);
    uint32_t tok[40];
    for (size_t i = 0; i < N; i++)
        tok[i] = (uint32_t)(500 + i);
    kvr_put_params pp = { .ctx_id = "d", .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                          .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32,
                          .n_tokens = N, .tokens = tok, .codec = "int8", .prefix_ctx = "p" };
    kvr_put *t = NULL;
    cr_assert_eq(kvr_store_put_begin(S, &pp, &t, &e), 0, "%s", e.msg);
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(t, &iov, &niov);
    scatter(iov, niov, pl);
    cr_assert_eq(kvr_put_work(t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_put_commit(t, NULL, &e), 0, "%s", e.msg);
    free(pl);
    kvr_codec c = cod(KVR_CODEC_INT8, 64, 0);
    size_t b;
    uint8_t *rp = get("p", true, 0, SIZE_MAX, NULL, &b, NULL, NULL);
    uint8_t *rd = get("d", true, 0, SIZE_MAX, NULL, &b, NULL, NULL);
    float *refp = pre_rope_ref(0, P, 0), *refd = pre_rope_ref(500, N, (int64_t)P);
    float *qp = decode_raw(rp, P, &c, &c, refp), *qd = decode_raw(rd, N, &c, &c, refd);
    const char *docs[] = { "d" };
    int64_t starts[] = { 1000 };
    kvr_assemble_params ap = { .prefix = "p", .docs = docs, .n_docs = 1,
                               .layout = KVR_LAYOUT_EXPLICIT, .starts = starts,
                               .dtype = KVR_DTYPE_F32 };
    kvr_assemble *a = NULL;
    cr_assert_eq(kvr_store_assemble_begin(S, &ap, &a, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_assemble_work(a, &e), 0, "%s", e.msg);
    kvr_assemble_payload_iov(a, &iov, &niov);
    size_t tot = kvr_assemble_payload_size(a);
    cr_assert_eq(tot, (size_t)L * 2 * (P + N) * ROW * sizeof(float));
    float *got = malloc(tot);
    kvt_gather(got, iov, niov);
    kvr_assemble_end(a);
    size_t n = P + N;
    int64_t pos[56];
    float *src = malloc(n * ROW * sizeof *src), *exp = malloc(n * ROW * sizeof *exp);
    for (size_t i = 0; i < n; i++)
        pos[i] = i < P ? (int64_t)i : 1000 + (int64_t)(i - P);
    for (int l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            memcpy(src, qp + ((size_t)l * 2 + (size_t)kv) * P * ROW, P * ROW * sizeof *src);
            memcpy(src + P * ROW, qd + ((size_t)l * 2 + (size_t)kv) * N * ROW,
                   N * ROW * sizeof *src);
            check_rows(got + ((size_t)l * 2 + (size_t)kv) * n * ROW, src, exp, n, pos, l,
                       kv, "assemble");
        }
    free(src);
    free(exp);
    free(got);
    free(qp);
    free(qd);
    free(refp);
    free(refd);
    free(rp);
    free(rd);
}

/* An edit with KV into a quantized context: new tokens join the window
 * (exact), the next put's flush quantizes them. */
Test(quant, edit_with_kv_then_flush)
{
    kvr_error e = { 0 };
    create_ok("e", "int8", 64);
    kvr_edit_op op = { .start = 10, .end = 10, .n_tokens = 4,
                       .tokens = (const uint32_t[]){ 900, 901, 902, 903 } };
    kvr_edit_params ep = { .ctx_id = "e", .ops = &op, .n_ops = 1, .with_kv = true,
                           .n_layers = L, .n_kv_heads = H, .head_dim = D,
                           .dtype = KVR_DTYPE_F32,
                           .payload_bytes = (size_t)L * 2 * 4 * ROW * sizeof(float) };
    kvr_edit *t = NULL;
    cr_assert_eq(kvr_store_edit_begin(S, &ep, &t, &e), 0, "%s", e.msg);
    float *pl = payload(900, 4, 10);
    const struct iovec *iov;
    size_t niov;
    kvr_edit_payload_iov(t, &iov, &niov);
    scatter(iov, niov, pl);
    cr_assert_eq(kvr_edit_work(t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_edit_commit(t, NULL, NULL, &e), 0, "%s", e.msg);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(S, "e", &ci, &e), 0);
    cr_assert_eq(ci.n_window, 4);
    cr_assert_eq(put("e", KVR_PUT_APPEND, NULL, 64, 8, 200, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_stat(S, "e", &ci, &e), 0);
    cr_assert_eq(ci.n_window, 0);
    cr_assert_eq(ci.n_tokens, 76);
    /* The inserted tokens, now quantized, still read back at their positions. */
    size_t b;
    float *g = (float *)(void *)get("e", false, 10, 14, NULL, &b, NULL, NULL);
    for (size_t i = 0; i < 4 * ROW; i++)
        cr_assert_leq(fabsf(g[i] - pl[i]), 0.05f * (fabsf(pl[i]) + 1), "elem %zu", i);
    free(g);
    free(pl);
}

/* A get over quantized runs and full-precision window runs: the window's V
 * still goes out zero-copy (it was staged for the whole request as soon as
 * one run was quantized), and the bytes are those of separate gets. */
Test(quant, window_v_zero_copy_in_a_mixed_get)
{
    create_ok("z", "kivi:k4v2:g32:r64", 300);
    kvr_error e = { 0 };
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(S, "z", &ci, &e), 0);
    cr_assert_gt(ci.n_window, 0);
    cr_assert_lt(ci.n_window, 300);
    size_t w0 = 300 - ci.n_window;
    /* Window alone: V is zero-copy; note where its first row lives. */
    kvr_get_params p = { .ctx_id = "z", .start = w0, .end = 300, .dtype = KVR_DTYPE_F32 };
    kvr_get *gw = NULL;
    cr_assert_eq(kvr_store_get_begin(S, &p, &gw, &e), 0, "%s", e.msg);
    const struct iovec *iov;
    size_t niov;
    kvr_get_payload_iov(gw, &iov, &niov);
    size_t part = ci.n_window * ROW * sizeof(float), off = 0;
    const void *wv = NULL;
    for (size_t i = 0; i < niov && !wv; i++) {
        if (off == part)                /* layer 0's V starts here */
            wv = iov[i].iov_base;
        off += iov[i].iov_len;
    }
    cr_assert_not_null(wv);
    /* Everything: some iovec of it points at that same block memory. */
    p.start = 0;
    p.end = SIZE_MAX;
    kvr_get *ga = NULL;
    cr_assert_eq(kvr_store_get_begin(S, &p, &ga, &e), 0, "%s", e.msg);
    if (kvr_get_needs_work(ga))
        cr_assert_eq(kvr_get_work(ga, &e), 0, "%s", e.msg);
    kvr_get_payload_iov(ga, &iov, &niov);
    bool shared = false;
    for (size_t i = 0; i < niov; i++)
        shared = shared || iov[i].iov_base == wv;
    cr_assert(shared, "the window's V was staged, not sent from its blocks");
    kvr_get_end(gw);
    kvr_get_end(ga);
    /* Contents: the whole equals the quantized part followed by the window. */
    size_t ba, bq, bw;
    uint8_t *all = get("z", false, 0, SIZE_MAX, NULL, &ba, NULL, NULL);
    uint8_t *q = get("z", false, 0, w0, NULL, &bq, NULL, NULL);
    uint8_t *w = get("z", false, w0, 300, NULL, &bw, NULL, NULL);
    cr_assert_eq(ba, bq + bw);
    size_t pq = w0 * ROW * sizeof(float), pw = part;
    for (size_t s = 0; s < (size_t)L * 2; s++) {
        cr_assert(memcmp(all + s * (pq + pw), q + s * pq, pq) == 0, "side %zu: quantized", s);
        cr_assert(memcmp(all + s * (pq + pw) + pq, w + s * pw, pw) == 0, "side %zu: window", s);
    }
    free(all);
    free(q);
    free(w);
}

/* A model's default codec is not in its fingerprint, but re-registering the
 * name with another codec is refused rather than silently ignored; the same
 * codec (any spelling) or none at all is the idempotent re-register. */
Test(quant, reregister_with_other_codec_refused)
{
    kvr_error e = { 0 };
    kvr_model_desc d = { .name = "rereg", .n_layers = 2, .n_kv_heads = 2, .head_dim = 64,
                         .dtype = KVR_DTYPE_F16, .codec = "k4v2" };
    kvr_rope_config_init(&d.rope);
    cr_assert_eq(kvr_store_model_register(S, &d, NULL, &e), 0, "%s", e.msg);
    d.codec = "k=int4/g128/c,v=int2/g256,r=128";       /* the canonical spelling */
    cr_assert_eq(kvr_store_model_register(S, &d, NULL, &e), 0, "%s", e.msg);
    d.codec = NULL;
    cr_assert_eq(kvr_store_model_register(S, &d, NULL, &e), 0, "%s", e.msg);
    d.codec = "int8";
    cr_assert_eq(kvr_store_model_register(S, &d, NULL, &e), KVR_EEXIST);
    cr_assert(strstr(e.msg, "default codec") != NULL, "%s", e.msg);
    kvr_model_info mi;
    cr_assert_eq(kvr_store_model_find(S, "rereg", &mi), 0);
    cr_assert_str_eq(mi.codec, "k=int4/g128/c,v=int2/g256,r=128");
}

/* ---- the error measure -----------------------------------------------------
 * rel_rms_k / rel_rms_v are the store's definition, recomputed here from the
 * codec API: per row (per tile for per-channel keys) e ~ sum (dec - ref)^2 and
 * q ~ sum ref^2 as codec.h defines them (kvt_err_row_def), added to the
 * totals in row order, layer after layer (keys: the f32 pre-RoPE keys of
 * kvr_rope_remove; a partial last tile is padded with its last token and
 * measured over its real tokens). The stat must be these exact doubles,
 * whichever kernels or threads the store used. */
static void ref_err(const kvr_codec *c, const float *x, size_t n, bool tile, double *sse,
                    double *ss)
{
    kvr_codec sc = *c;
    sc.isa = KVR_ISA_SCALAR;
    if (!tile) {
        size_t rb = kvr_codec_row_bytes(&sc, ROW);
        uint8_t *b = malloc(rb);
        float *d = malloc(ROW * sizeof *d);
        for (size_t i = 0; i < n; i++) {
            const float *r = x + i * ROW;
            cr_assert_eq(kvr_codec_encode(&sc, b, r, KVR_DTYPE_F32, ROW, NULL), 0);
            kvr_codec_decode(&sc, d, KVR_DTYPE_F32, b, ROW);
            double e, q;
            kvt_err_row_def(r, d, ROW, &e, &q);
            *sse += e;
            *ss += q;
        }
        free(b);
        free(d);
        return;
    }
    size_t G = kvr_codec_group(&sc), tb = kvr_codec_tile_bytes(&sc, ROW);
    uint8_t *b = malloc(tb);
    float *in = malloc(G * ROW * sizeof *in), *d = malloc(G * ROW * sizeof *d);
    for (size_t t0 = 0; t0 < n; t0 += G) {
        size_t k = n - t0 < G ? n - t0 : G;
        for (size_t t = 0; t < G; t++)
            memcpy(in + t * ROW, x + (t0 + (t < k ? t : k - 1)) * ROW, ROW * sizeof *in);
        cr_assert_eq(kvr_codec_encode_tile(&sc, b, in, KVR_DTYPE_F32, ROW, ROW, NULL), 0);
        kvr_codec_decode_tile(&sc, d, KVR_DTYPE_F32, ROW, b, ROW);
        double e, q;
        kvt_err_row_def(in, d, k * ROW, &e, &q);
        *sse += e;
        *ss += q;
    }
    free(b);
    free(in);
    free(d);
}

static void check_err(const char *spec, const kvr_codec *kc, const kvr_codec *vc, size_t n)
{
    kvr_error e = { 0 };
    float *pl = payload(0, n, 7);
    cr_assert_eq(put_raw("err", KVR_PUT_CREATE, spec, 0, n, 7, pl, &e), 0, "%s: %s", spec, e.msg);
    double sse[2] = { 0, 0 }, ss[2] = { 0, 0 };
    int64_t *pos = malloc(n * sizeof *pos);
    float *x = malloc(n * ROW * sizeof *x);
    for (size_t i = 0; i < n; i++)
        pos[i] = 7 + (int64_t)i;
    kvr_rope_opts ro = { .n_threads = 1 };
    /* r=0: everything is quantized, for tiled keys in whole tiles (values
     * follow the keys' boundary; the rest stays in the window) */
    bool tile = kc->axis == KVR_CODEC_AXIS_CHANNEL;
    size_t nq = tile ? n / kvr_codec_group(kc) * kvr_codec_group(kc) : n;
    for (int l = 0; l < L && nq; l++) {
        const float *k = pl + (size_t)l * 2 * n * ROW, *v = k + n * ROW;
        cr_assert_eq(kvr_rope_remove(ENG, x, KVR_DTYPE_F32, k, KVR_DTYPE_F32, nq, H, pos, &ro), 0);
        ref_err(kc, x, nq, tile, &sse[0], &ss[0]);
        ref_err(vc, v, nq, false, &sse[1], &ss[1]);
    }
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(S, "err", &ci, &e), 0);
    double rk = ss[0] > 0 ? sqrt(sse[0] / ss[0]) : 0, rv = ss[1] > 0 ? sqrt(sse[1] / ss[1]) : 0;
    cr_assert(ci.rel_rms_k == rk && ci.rel_rms_v == rv, "%s n %zu: K %.17g vs %.17g, V %.17g vs %.17g",
              spec, n, ci.rel_rms_k, rk, ci.rel_rms_v, rv);
    cr_assert_eq(kvr_store_delete(S, "err", &e), 0);
    free(pos);
    free(x);
    free(pl);
}

Test(quant, error_measure_is_the_reference_sums)
{
    kvr_codec i8 = cod(KVR_CODEC_INT8, 64, 0), i4 = cod(KVR_CODEC_INT4, 32, 0);
    kvr_codec i2 = cod(KVR_CODEC_INT2, 64, 0), q8 = cod(KVR_CODEC_Q8_0, 0, 0);
    kvr_codec q41 = cod(KVR_CODEC_Q4_1, 0, 0), q50 = cod(KVR_CODEC_Q5_0, 0, 0);
    kvr_codec kc = cod(KVR_CODEC_INT4, 64, KVR_CODEC_AXIS_CHANNEL);
    kvr_codec v2 = cod(KVR_CODEC_INT2, 128, 0);
    /* 1 row, a batch and a bit, odd counts; 1100 tokens take the threaded path */
    size_t ns[] = { 1, 70, 203, 1100 };
    for (size_t i = 0; i < 4; i++) {
        check_err("int8", &i8, &i8, ns[i]);
        check_err("k=int4/g32,v=int2,r=0", &i4, &i2, ns[i]);
        check_err("q8_0", &q8, &q8, ns[i]);
        check_err("k=q4_1,v=q5_0,r=0", &q41, &q50, ns[i]);
        check_err("k=int4/g64/c,v=int2/g128,r=0", &kc, &v2, ns[i]);
    }
}

/* A nan in a later layer side is reported even when an earlier side also
 * holds a value the codec refuses (the sides scan their own payload in
 * parallel; the message names the first nan or inf of the whole payload,
 * as one scan before any side would), sequential and threaded puts alike;
 * without a nan the range error names its layer. */
Test(quant, nan_reported_before_a_range_error)
{
    size_t ns[] = { 10, 1100 };
    for (int k = 0; k < 2; k++) {
        kvr_error e = { 0 };
        size_t n = ns[k];
        float *pl = payload(0, n, 0);
        pl[((size_t)0 * 2 + 1) * n * ROW + 1 * ROW + 4] = 1e6f;    /* layer 0 V: out of range */
        pl[((size_t)1 * 2 + 0) * n * ROW + 7 * ROW + 9] = NAN;     /* layer 1 K, token 7 */
        int rc = put_raw("r", KVR_PUT_CREATE, "int8", 0, n, 0, pl, &e);
        cr_assert_eq(rc, KVR_EINVAL);
        cr_assert(strstr(e.msg, "layer 1") && strstr(e.msg, "token 7") && strstr(e.msg, "nan"),
                  "n %zu: %s", n, e.msg);
        pl[((size_t)1 * 2 + 0) * n * ROW + 7 * ROW + 9] = 0;
        rc = put_raw("r", KVR_PUT_CREATE, "int8", 0, n, 0, pl, &e);
        cr_assert_eq(rc, KVR_EINVAL);
        cr_assert(strstr(e.msg, "V of layer 0") && strstr(e.msg, "outside the range"),
                  "n %zu: %s", n, e.msg);
        cr_assert_eq(kvr_store_stat(S, "r", &(kvr_ctx_info){ 0 }, &e), KVR_ENOCTX);
        free(pl);
    }
}

/* A nan bound for the full-precision window (not quantized by this put) is
 * refused too, with the same message; one in a token quantized now as well. */
Test(quant, nan_in_window_tokens_refused)
{
    kvr_error e = { 0 };
    const char *spec = "k=int4/g64/c,v=int2,r=128";
    create_ok("w", spec, 100);
    append_bad_refused("w", 100, 10, 1, 1, 4, 1, INFINITY, "V of layer 1, token 4", "nan or inf");
    /* 200 more: the first tokens flush into tiles, a nan among them */
    append_bad_refused("w", 100, 200, 0, 0, 3, 2, NAN, "K of layer 0, token 3", "nan or inf");
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(S, "w", &ci, &e), 0);
    cr_assert_eq(ci.n_tokens, 100);
}

/* kvr_put_work_from (the payload read from the caller's memory, no staging
 * copy) stores what filling the iovecs and kvr_put_work store: the same
 * encoded bytes, the same values back, the same error sums, for plain,
 * converted and quantized contexts, a window and appends; a wrong length
 * and a nan are refused with nothing stored. */
static int put_from(const char *id, kvr_put_mode mode, const char *codec, size_t t0, size_t n,
                    int64_t pos0, const float *pl, size_t len, kvr_error *e)
{
    kvr_put_params p = put_params(id, mode, codec, t0, n, pos0);
    p.work_from = true;
    kvr_put *t = NULL;
    int rc = kvr_store_put_begin(S, &p, &t, e);
    free((void *)(uintptr_t)p.tokens);
    if (rc)
        return rc;
    if ((rc = kvr_put_work_from(t, pl, len, e)) != 0) {
        kvr_put_abort(t);
        return rc;
    }
    return kvr_put_commit(t, NULL, e);
}

Test(quant, work_from_same_as_iovecs)
{
    static const char *const specs[] = { "f32", "f16", "int8", "int4/g32", "int2", "q8_0",
                                         "q4_1", "q5_0", "k4v2", "kivi:k4v2:g32:r16",
                                         "k=int4/g64/c,v=int2,r=0", "k=q4_0,v=int8,r=8" };
    size_t ns[] = { 100, 37 };   /* a create, then an append (window flushes) */
    for (size_t s = 0; s < sizeof specs / sizeof *specs; s++) {
        kvr_error e = { 0 };
        size_t t0 = 0;
        for (int k = 0; k < 2; k++) {
            size_t n = ns[k];
            float *pl = payload(t0, n, (int64_t)t0);
            size_t len = (size_t)L * 2 * n * ROW * sizeof *pl;
            kvr_put_mode mode = k ? KVR_PUT_APPEND : KVR_PUT_CREATE;
            const char *c = k ? NULL : specs[s];
            cr_assert_eq(put_raw("a", mode, c, t0, n, (int64_t)t0, pl, &e), 0, "%s", e.msg);
            cr_assert_eq(put_from("b", mode, c, t0, n, (int64_t)t0, pl, len, &e), 0, "%s",
                         e.msg);
            free(pl);
            t0 += n;
        }
        kvr_ctx_info ca, cb;
        cr_assert_eq(kvr_store_stat(S, "a", &ca, &e), 0);
        cr_assert_eq(kvr_store_stat(S, "b", &cb, &e), 0);
        cr_assert_eq(ca.n_tokens, cb.n_tokens);
        cr_assert_eq(ca.kv_bytes, cb.kv_bytes);
        cr_assert(memcmp(&ca.rel_rms_k, &cb.rel_rms_k, sizeof ca.rel_rms_k) == 0 &&
                  memcmp(&ca.rel_rms_v, &cb.rel_rms_v, sizeof ca.rel_rms_v) == 0, "%s",
                  specs[s]);
        for (int raw = 0; raw < 2; raw++) {
            if (raw && specs[s][0] == 'f')
                continue;   /* plain contexts have no raw form */
            /* raw: the quantized tokens (a window's are refused alike) */
            size_t na = 0, nb = 0;
            int ra, rb;
            size_t end = raw ? 32 : SIZE_MAX;
            uint8_t *a = get("a", raw, 0, end, NULL, &na, NULL, &ra);
            uint8_t *b = get("b", raw, 0, end, NULL, &nb, NULL, &rb);
            cr_assert_eq(ra, rb, "%s", specs[s]);
            cr_assert_eq(na, nb);
            cr_assert(ra == 0 || (raw && strcmp(specs[s], "k4v2") == 0), "%s", specs[s]);
            cr_assert(ra != 0 || memcmp(a, b, na) == 0, "%s raw %d", specs[s], raw);
            free(a);
            free(b);
        }
        kvr_store_delete(S, "a", &e);
        kvr_store_delete(S, "b", &e);
    }
    /* A wrong length: refused, nothing stored. */
    kvr_error e = { 0 };
    float *pl = payload(0, 10, 0);
    size_t len = (size_t)L * 2 * 10 * ROW * sizeof *pl;
    cr_assert_eq(put_from("c", KVR_PUT_CREATE, "int8", 0, 10, 0, pl, len - 4, &e), KVR_EPAYLOAD);
    cr_assert_eq(kvr_store_stat(S, "c", &(kvr_ctx_info){ 0 }, &e), KVR_ENOCTX);
    cr_assert_eq(put_from("c", KVR_PUT_CREATE, "f32", 0, 10, 0, pl, len + 4, &e), KVR_EPAYLOAD);
    cr_assert_eq(kvr_store_stat(S, "c", &(kvr_ctx_info){ 0 }, &e), KVR_ENOCTX);
    /* A nan: the message put_work gives. */
    pl[((size_t)1 * 2 + 0) * 10 * ROW + 7 * ROW + 9] = NAN;
    cr_assert_eq(put_from("c", KVR_PUT_CREATE, "int8", 0, 10, 0, pl, len, &e), KVR_EINVAL);
    cr_assert(strstr(e.msg, "layer 1") && strstr(e.msg, "token 7") && strstr(e.msg, "nan"),
              "%s", e.msg);
    cr_assert_eq(kvr_store_stat(S, "c", &(kvr_ctx_info){ 0 }, &e), KVR_ENOCTX);
    /* A commit after a failed kvr_put_work_from fails too (it never reads
     * the staging the payload did not go to), and stores nothing. */
    uint32_t tok[10] = { 0 };
    kvr_put_params p = { .ctx_id = "c", .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32,
                         .n_tokens = 10, .tokens = tok, .codec = "int8" };
    kvr_put *t = NULL;
    cr_assert_eq(kvr_store_put_begin(S, &p, &t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_put_work_from(t, pl, len, &e), KVR_EINVAL);
    cr_assert_eq(kvr_put_work_from(t, pl, len, &e), KVR_EINVAL);
    cr_assert_neq(kvr_put_commit(t, NULL, &e), 0);
    cr_assert_eq(kvr_store_stat(S, "c", &(kvr_ctx_info){ 0 }, &e), KVR_ENOCTX);
    free(pl);
}

/* An f16 payload is encoded and measured where it lies (values: no f32
 * copy): the same codes, error sums and values back as an f32 payload of
 * the same (f16-exact) values, for every codec family, with and without
 * old window tokens flushed by the put. */
static int put_dt(const char *id, kvr_put_mode mode, const char *codec, size_t t0, size_t n,
                  const void *pl, kvr_dtype dt, kvr_error *e)
{
    uint32_t *tok = malloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = (uint32_t)(t0 + i);
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = mode, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = dt, .n_tokens = n,
                         .tokens = tok, .codec = codec, .has_pos_start = true,
                         .pos_start = (int64_t)t0, .work_from = true };
    kvr_put *t = NULL;
    int rc = kvr_store_put_begin(S, &p, &t, e);
    free(tok);
    if (rc)
        return rc;
    if ((rc = kvr_put_work_from(t, pl, kvr_put_payload_size(t), e)) != 0) {
        kvr_put_abort(t);
        return rc;
    }
    return kvr_put_commit(t, NULL, e);
}

Test(quant, f16_payload_same_as_f32_of_its_values)
{
    static const char *const specs[] = { "int8", "int4/g32", "int2", "q8_0", "q4_0", "q4_1",
                                         "q5_0", "k=int4/g64/c,v=int2,r=0",
                                         "k=int8,v=q4_1,r=8" };
    size_t ns[] = { 70, 41 };
    for (size_t s = 0; s < sizeof specs / sizeof *specs; s++) {
        kvr_error e = { 0 };
        size_t t0 = 0;
        for (int k = 0; k < 2; k++) {
            size_t n = ns[k], m = (size_t)L * 2 * n * ROW;
            float *pl = payload(t0, n, (int64_t)t0);
            uint16_t *ph = malloc(m * sizeof *ph);
            kvr_convert(ph, KVR_DTYPE_F16, pl, KVR_DTYPE_F32, m);
            kvr_convert(pl, KVR_DTYPE_F32, ph, KVR_DTYPE_F16, m);   /* f16-exact values */
            kvr_put_mode mode = k ? KVR_PUT_APPEND : KVR_PUT_CREATE;
            const char *c = k ? NULL : specs[s];
            cr_assert_eq(put_dt("a", mode, c, t0, n, pl, KVR_DTYPE_F32, &e), 0, "%s", e.msg);
            cr_assert_eq(put_dt("b", mode, c, t0, n, ph, KVR_DTYPE_F16, &e), 0, "%s", e.msg);
            free(pl);
            free(ph);
            t0 += n;
        }
        kvr_ctx_info ca, cb;
        cr_assert_eq(kvr_store_stat(S, "a", &ca, &e), 0);
        cr_assert_eq(kvr_store_stat(S, "b", &cb, &e), 0);
        cr_assert(ca.rel_rms_k > 0 && ca.rel_rms_v > 0, "%s", specs[s]);
        cr_assert(memcmp(&ca.rel_rms_k, &cb.rel_rms_k, sizeof ca.rel_rms_k) == 0 &&
                  memcmp(&ca.rel_rms_v, &cb.rel_rms_v, sizeof ca.rel_rms_v) == 0,
                  "%s: %.17g %.17g vs %.17g %.17g", specs[s], ca.rel_rms_k, ca.rel_rms_v,
                  cb.rel_rms_k, cb.rel_rms_v);
        for (int raw = 0; raw < 2; raw++) {
            size_t na = 0, nb = 0;
            uint8_t *a = get("a", raw, 0, raw ? 32 : SIZE_MAX, NULL, &na, NULL, NULL);
            uint8_t *b = get("b", raw, 0, raw ? 32 : SIZE_MAX, NULL, &nb, NULL, NULL);
            cr_assert_eq(na, nb);
            cr_assert(memcmp(a, b, na) == 0, "%s raw %d", specs[s], raw);
            free(a);
            free(b);
        }
        kvr_store_delete(S, "a", &e);
        kvr_store_delete(S, "b", &e);
    }
}
