/*
 * test_int_quant.c — quantized KV at rest end to end (issue 6): codecs on
 * the wire through a real kvroped, libkvrope and the CLI.
 *
 * Every token t has a deterministic pre-RoPE key E[l][t] (a few 8x outlier
 * channels) and value V[l][t]; puts send K = rope(E, pos) in f32. The daemon
 * un-rotates in f32 (E' = rope_remove(K, pos)) and quantizes. Here, with the
 * kernels of cache/codec.h: the raw get's bytes decode to Q with
 * |Q - dequantize(quantize(E'))| within half a quantization step (and, for
 * uniform codecs, |Q - E'| within half the stored step), and the dequantized
 * f32 get equals rope(Q, position) within one rounding; window tokens come
 * back exact. Then: edits keep keys exact at their new positions, nan in a
 * payload is refused naming layer and token with the context unchanged, bad
 * specs are E_INVALID, stat/stats report the codec figures, and the CLI's
 * --codec / stat --json / get --raw.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "tests/common/kvt_daemon.h"
#include "tests/common/kvt_bench.h"
#include "cache/codec.h"

#define QL 2
#define QH 2
#define QD 64
#define ROW (QH * QD)
#define N 320
#define POS0 5

static kvr_testd D;
static kvr_client *C;
static kvr_rope *R;

static void setup(void)
{
    C = kvt_daemon_up(&D, NULL);
    kvr_model m;
    R = kvt_register_model(C, "q", QL, QH, QD, KVR_DTYPE_F32, &m);
    cr_assert_str_eq(m.codec, "f32");
}

static void teardown(void)
{
    kvt_daemon_down(&D, &C, &R);
}

TestSuite(int_quant, .init = setup, .fini = teardown, .timeout = 240);

/* ---- data ---------------------------------------------------------------- */

static float pre_val(uint32_t id, int l, int kv, size_t j)
{
    float x = testd_val(id, (uint32_t)l, (uint32_t)kv, 0, (uint32_t)(j / QD),
                        (uint32_t)(j % QD));
    if (j % 37 == 5)
        x *= 8.0f;   /* outlier channels */
    return x;
}

/* Layer-major f32 payload [l][kv][n][ROW] of tokens ids[i] at pos[i]. */
static float *make_kv(const uint32_t *ids, const int64_t *pos, size_t n)
{
    float *p = malloc((size_t)QL * 2 * n * ROW * sizeof *p);
    float *e = malloc((n ? n : 1) * ROW * sizeof *e);
    for (int l = 0; l < QL; l++)
        for (int kv = 0; kv < 2; kv++) {
            float *dst = p + ((size_t)l * 2 + (size_t)kv) * n * ROW;
            for (size_t i = 0; i < n; i++)
                for (size_t j = 0; j < ROW; j++)
                    e[i * ROW + j] = pre_val(ids[i], l, kv, j);
            if (kv == 0)
                cr_assert_eq(kvr_rope_apply(R, dst, KVR_DTYPE_F32, e, KVR_DTYPE_F32, n, QH,
                                            pos, NULL), 0);
            else
                memcpy(dst, e, n * ROW * sizeof *e);
        }
    free(e);
    return p;
}

static uint32_t *ids_from(uint32_t base, size_t n)
{
    return testd_tokens(base, n);
}

static int64_t *pos_from(int64_t p0, size_t n)
{
    int64_t *p = malloc((n ? n : 1) * sizeof *p);
    for (size_t i = 0; i < n; i++)
        p[i] = p0 + (int64_t)i;
    return p;
}

/* A raw get (g->raw set): the result and its layout (kv->raw). */
static int get_raw(const kvr_get_args *g, kvr_kv *kv, kvr_raw_layout *rl)
{
    int r = kvr_client_get(C, g, kv);
    *rl = kv->raw;
    return r;
}

static int put_kv(const char *ctx, const char *model, kvr_put_mode mode, const char *codec,
                  const uint32_t *ids, const int64_t *pos, size_t n, const float *pl)
{
    kvr_put_args a = { .ctx_id = ctx, .model = model, .mode = mode, .dtype = KVR_DTYPE_F32,
                       .tokens = ids, .n_tokens = n, .positions = pos,
                       .n_layers = QL, .n_kv_heads = QH, .head_dim = QD, .payload = pl,
                       .payload_len = (size_t)QL * 2 * n * ROW * sizeof(float),
                       .codec = codec };
    return kvr_client_put(C, &a, NULL);
}

/* A context of N tokens (ids base..) at positions POS0.. with `codec`;
 * returns its payload (the caller frees). */
static float *put_ctx(const char *ctx, const char *codec, uint32_t base)
{
    uint32_t *ids = ids_from(base, N);
    int64_t *pos = pos_from(POS0, N);
    float *pl = make_kv(ids, pos, N);
    int r = put_kv(ctx, "q", KVR_PUT_CREATE, codec, ids, pos, N, pl);
    cr_assert_eq(r, 0, "put %s codec %s: %s", ctx, codec, kvr_client_last_error(C));
    free(ids);
    free(pos);
    return pl;
}

/* E' of a payload: keys un-rotated in f32 (what the daemon quantizes). */
static float *pre_rope(const float *pl, const int64_t *pos, size_t n)
{
    size_t sz = (size_t)QL * 2 * n * ROW;
    float *o = malloc(sz * sizeof *o);
    memcpy(o, pl, sz * sizeof *o);
    for (int l = 0; l < QL; l++) {
        float *k = o + (size_t)l * 2 * n * ROW;
        cr_assert_eq(kvr_rope_remove(R, k, KVR_DTYPE_F32, pl + (size_t)l * 2 * n * ROW,
                                     KVR_DTYPE_F32, n, QH, pos, NULL), 0);
    }
    return o;
}

static float *get_f32(const char *ctx, size_t *n_out, int64_t **pos_out)
{
    kvr_get_args g = { .ctx_id = ctx, .dtype = KVR_DTYPE_F32 };
    kvr_kv kv;
    int r = kvr_client_get(C, &g, &kv);
    cr_assert_eq(r, 0, "get %s: %s", ctx, kvr_client_last_error(C));
    cr_assert_eq(kv.payload_len, (size_t)QL * 2 * kv.n_tokens * ROW * sizeof(float));
    float *o = malloc(kv.payload_len ? kv.payload_len : 1);
    memcpy(o, kv.payload, kv.payload_len);
    *n_out = kv.n_tokens;
    if (pos_out) {
        *pos_out = malloc((kv.n_tokens ? kv.n_tokens : 1) * sizeof(int64_t));
        memcpy(*pos_out, kv.positions, kv.n_tokens * sizeof(int64_t));
    }
    kvr_kv_release(&kv);
    return o;
}

/* ---- codec reference (cache/codec.h) ------------------------------------- */

static float f16f(const uint8_t *p)
{
    uint16_t u;
    memcpy(&u, p, 2);
    float f;
    kvr_convert(&f, KVR_DTYPE_F32, &u, KVR_DTYPE_F16, 1);
    return f;
}

/* Quantization step of element j of an encoded row (n values). */
static float row_step(const kvr_codec *c, const uint8_t *row, size_t n, size_t j)
{
    if (kvr_codec_is_uniform(c->type)) {
        float s, m;
        cr_assert_eq(kvr_codec_group_params(c, row, n, j / kvr_codec_group(c), &s, &m), 0);
        return s;
    }
    if (kvr_codec_is_ggml(c->type))
        return fabsf(f16f(row + j / 32 * kvr_codec_row_bytes(c, 32)));
    return 0.0f;   /* plain side */
}

static float plain_tol(const kvr_codec *c, float x)
{
    float a = fabsf(x) + 1e-3f;
    return c->type == KVR_CODEC_F16 ? a * 1e-3f : c->type == KVR_CODEC_BF16 ? a * 8e-3f
                                                                           : a * 1e-6f;
}

/* Decodes a raw payload of n tokens into Q [l][kv][n][ROW] and checks it
 * against dequantize(quantize(E')) computed here (half a step) and, for
 * uniform codecs, against E' itself (half the stored step). */
static float *check_raw(const void *raw, const kvr_raw_layout *rl, size_t n, const float *pre)
{
    kvr_codec kc, vc;
    cr_assert_eq(kvr_codec_parse(rl->k_codec, &kc), 0, "k_codec '%s'", rl->k_codec);
    cr_assert_eq(kvr_codec_parse(rl->v_codec, &vc), 0, "v_codec '%s'", rl->v_codec);
    if (rl->k_per_channel)
        kc.axis = KVR_CODEC_AXIS_CHANNEL;
    uint32_t G = rl->k_per_channel ? kvr_codec_group(&kc) : 1;
    cr_assert_eq(rl->k_group, kvr_codec_group(&kc));
    cr_assert_eq(rl->v_group, kvr_codec_group(&vc));
    size_t ku = G > 1 ? kvr_codec_tile_bytes(&kc, ROW) : kvr_codec_row_bytes(&kc, ROW);
    size_t vu = kvr_codec_row_bytes(&vc, ROW);
    cr_assert_eq(rl->k_unit_bytes, ku, "%s: K unit %llu vs %zu", rl->codec,
                 (unsigned long long)rl->k_unit_bytes, ku);
    cr_assert_eq(rl->v_unit_bytes, vu);
    cr_assert(n % G == 0, "%s: quantized range %zu not in whole %u-token tiles", rl->codec,
              n, G);
    cr_assert_eq(rl->k_bytes, (uint64_t)(n / G * ku));
    cr_assert_eq(rl->v_bytes, (uint64_t)(n * vu));
    float *q = malloc((size_t)QL * 2 * n * ROW * sizeof *q);
    uint8_t *enc = malloc(ku > vu ? ku : vu);
    float *loc = malloc((size_t)G * ROW * sizeof *loc);
    const uint8_t *p = raw;
    for (int l = 0; l < QL; l++) {
        for (int kv = 0; kv < 2; kv++) {
            const kvr_codec *c = kv ? &vc : &kc;
            uint32_t g = kv ? 1 : G;
            size_t ub = kv ? vu : ku, nv = (size_t)g * ROW;
            float *dq = q + ((size_t)l * 2 + (size_t)kv) * n * ROW;
            const float *ref = pre + ((size_t)l * 2 + (size_t)kv) * n * ROW;
            for (size_t i = 0; i < n; i += g, p += ub) {
                size_t bad = 0;
                if (g > 1) {
                    cr_assert_eq(kvr_codec_decode_tile(c, dq + i * ROW, KVR_DTYPE_F32, ROW, p,
                                                       ROW), 0);
                    cr_assert_eq(kvr_codec_encode_tile(c, enc, ref + i * ROW, KVR_DTYPE_F32,
                                                       ROW, ROW, &bad), 0);
                    cr_assert_eq(kvr_codec_decode_tile(c, loc, KVR_DTYPE_F32, ROW, enc, ROW),
                                 0);
                } else {
                    cr_assert_eq(kvr_codec_decode(c, dq + i * ROW, KVR_DTYPE_F32, p, ROW), 0);
                    cr_assert_eq(kvr_codec_encode(c, enc, ref + i * ROW, KVR_DTYPE_F32, ROW,
                                                  &bad), 0);
                    cr_assert_eq(kvr_codec_decode(c, loc, KVR_DTYPE_F32, enc, ROW), 0);
                }
                for (size_t t = 0; t < g; t++)
                    for (size_t j = 0; j < ROW; j++) {
                        /* Tiles: group = channel j, element t; rows: element j. */
                        float s;
                        if (g > 1) {   /* per-channel tiles are uniform */
                            float mn;
                            cr_assert_eq(kvr_codec_group_params(c, p, nv, j, &s, &mn), 0);
                        } else {
                            s = row_step(c, p, ROW, j);
                        }
                        float x = ref[(i + t) * ROW + j], y = dq[(i + t) * ROW + j],
                              z = loc[t * ROW + j];
                        float eps = 1e-5f * (fabsf(x) + 1.0f);
                        if (s == 0.0f)
                            eps += plain_tol(c, x);
                        cr_assert_leq(fabsf(y - z), s / 2 + eps,
                                      "%s %c l%d tok %zu j %zu: daemon %g, local %g (step %g)",
                                      rl->codec, kv ? 'V' : 'K', l, i + t, j, (double)y,
                                      (double)z, (double)s);
                        if (kvr_codec_is_uniform(c->type))
                            cr_assert_leq(fabsf(y - x), s / 2 + eps,
                                          "%s %c l%d tok %zu j %zu: %g vs E' %g (step %g)",
                                          rl->codec, kv ? 'V' : 'K', l, i + t, j, (double)y,
                                          (double)x, (double)s);
                    }
            }
        }
    }
    cr_assert_eq((size_t)(p - (const uint8_t *)raw), (size_t)QL * (rl->k_bytes + rl->v_bytes));
    free(enc);
    free(loc);
    return q;
}

/* Expected f32 get of token i: K = rope(src K_i, pos) (src pre-RoPE), V. */
static void expect_token(const float *src, size_t sn, size_t si, int64_t pos, float *k_out,
                         float *v_out, int l)
{
    const float *k = src + (size_t)l * 2 * sn * ROW + si * ROW;
    const float *v = k + sn * ROW;
    cr_assert_eq(kvr_rope_apply(R, k_out, KVR_DTYPE_F32, k, KVR_DTYPE_F32, 1, QH, &pos, NULL),
                 0);
    memcpy(v_out, v, ROW * sizeof *v_out);
}

static void cmp_row(const float *got, const float *exp, float rel, const char *what, size_t i)
{
    for (size_t j = 0; j < ROW; j++)
        cr_assert_leq(fabsf(got[j] - exp[j]), rel * (fabsf(exp[j]) + 1.0f),
                      "%s token %zu elem %zu: %g vs %g", what, i, j, (double)got[j],
                      (double)exp[j]);
}

/* ---- round trips -------------------------------------------------------- */

/* The first nq of the n token rows of each layer's K and V in x
 * ([l][kv][n][ROW]), as [l][kv][nq][ROW] (malloc'd). */
static float *first_rows(const float *x, size_t n, size_t nq)
{
    float *out = malloc((size_t)QL * 2 * nq * ROW * sizeof *out);
    cr_assert_not_null(out);
    for (int l = 0; l < QL; l++)
        for (int kvi = 0; kvi < 2; kvi++)
            memcpy(out + ((size_t)l * 2 + (size_t)kvi) * nq * ROW,
                   x + ((size_t)l * 2 + (size_t)kvi) * n * ROW, nq * ROW * sizeof *out);
    return out;
}

static void round_trip(const char *spec, int idx)
{
    char id[32];
    snprintf(id, sizeof id, "rt%d", idx);
    float *pl = put_ctx(id, spec, 1000u * (uint32_t)idx);
    int64_t *pos = pos_from(POS0, N);
    float *pre = pre_rope(pl, pos, N);
    kvr_context x;
    cr_assert_eq(kvr_client_stat(C, id, &x), 0, "%s", kvr_client_last_error(C));
    const kvr_context cc = x;
    cr_assert_eq(x.n_tokens, N);
    size_t n;
    float *g = get_f32(id, &n, NULL);
    cr_assert_eq(n, N);
    kvr_get_args ga = { .ctx_id = id, .end = 0, .raw = true };
    kvr_kv kv;
    kvr_raw_layout rl;
    float k[ROW], v[ROW];
    if (!cc.quantized) {
        /* Plain: the stored dtype's rounding only. */
        kvr_codec pc;
        cr_assert_eq(kvr_codec_parse(cc.codec, &pc), 0, "%s", cc.codec);
        cr_assert_eq(cc.bytes_saved, 0);
        for (int l = 0; l < QL; l++)
            for (int kvi = 0; kvi < 2; kvi++)
                for (size_t i = 0; i < N * ROW; i++) {
                    size_t o = ((size_t)l * 2 + (size_t)kvi) * N * ROW + i;
                    cr_assert_leq(fabsf(g[o] - pl[o]), plain_tol(&pc, pl[o]) * 4,
                                  "%s: elem %zu %g vs %g", spec, o, (double)g[o],
                                  (double)pl[o]);
                }
        int r = get_raw(&ga, &kv, &rl);
        cr_assert_eq(r, KVR_EUNSUPPORTED, "%s: raw get of a plain context: %d", spec, r);
        goto out;
    }
    cr_assert(strncmp(cc.codec, "k=", 2) == 0, "%s -> %s", spec, cc.codec);
    cr_assert_gt(cc.bits_per_value, 0.0);
    cr_assert_lt(cc.bits_per_value, 32.0, "%s: %g bits/value", spec, cc.bits_per_value);
    cr_assert_gt(cc.bytes_saved, 0);
    cr_assert_gt(cc.kv_bytes, 0);
    cr_assert_gt(cc.rel_rms_k, 0.0);
    cr_assert_lt(cc.rel_rms_k, 1.5, "%s: %g", spec, cc.rel_rms_k);
    cr_assert_lt(cc.rel_rms_v, 1.5, "%s: %g", spec, cc.rel_rms_v);
    size_t nq = N - (size_t)cc.n_window;
    cr_assert_gt(nq, 0, "%s: nothing quantized (window %llu)", spec,
                 (unsigned long long)cc.n_window);
    ga.end = nq;
    int r = get_raw(&ga, &kv, &rl);
    cr_assert_eq(r, 0, "%s: raw get: %s", spec, kvr_client_last_error(C));
    cr_assert(rl.raw);
    cr_assert_str_eq(rl.codec, cc.codec);
    cr_assert_eq(kv.n_tokens, nq);
    cr_assert_eq(kv.payload_len, (size_t)QL * (rl.k_bytes + rl.v_bytes));
    for (size_t i = 0; i < nq; i++)
        cr_assert_eq(kv.positions[i], pos[i]);
    cr_assert_eq(kvr_kv_raw_v(&kv, 1),
                 (const uint8_t *)kv.payload + rl.k_bytes * 2 + rl.v_bytes);
    /* pre-RoPE reference of just the quantized range, [l][kv][nq][ROW] */
    float *preq = first_rows(pre, N, nq);
    float *q = check_raw(kv.payload, &rl, nq, preq);
    kvr_kv_release(&kv);
    /* The dequantized get: rope(Q, pos) for the quantized range, the input
     * for the window. */
    for (int l = 0; l < QL; l++)
        for (size_t i = 0; i < N; i++) {
            const float *gk = g + (size_t)l * 2 * N * ROW + i * ROW, *gv = gk + (size_t)N * ROW;
            if (i < nq) {
                expect_token(q, nq, i, pos[i], k, v, l);
            } else {
                memcpy(k, pl + (size_t)l * 2 * N * ROW + i * ROW, sizeof k);
                memcpy(v, pl + ((size_t)l * 2 + 1) * N * ROW + i * ROW, sizeof v);
            }
            cmp_row(gk, k, 1e-5f, spec, i);
            cmp_row(gv, v, 1e-6f, spec, i);
        }
    free(preq);
    free(q);
out:
    free(g);
    free(pre);
    free(pos);
    free(pl);
}

static const char *const SPECS[] = {
    "f32", "f16", "bf16", "int8", "int4", "int2", "q8_0", "q4_0", "q4_1", "q5_0", "k4v2",
    "quant", "kivi:k4v2", "kivi:k2v2:g64:r32", "int4/g32", "k=int8/c,v=q4_0,r=64",
};

Test(int_quant, round_trip_every_codec)
{
    for (size_t i = 0; i < sizeof SPECS / sizeof SPECS[0]; i++)
        round_trip(SPECS[i], (int)i);
    cr_assert_geq(testd_metric(C, "quant_contexts"), 10.0);
    cr_assert_gt(testd_metric(C, "quant_bytes_saved"), 0.0);
    double bpv = testd_metric(C, "quant_bits_per_value");
    cr_assert(bpv > 0.0 && bpv < 32.0, "%g", bpv);
}

/* ---- model default, bad specs ------------------------------------------- */

Test(int_quant, model_default_codec_and_bad_specs)
{
    kvr_rope_config rc = kvt_rope_config(QD, 0);
    kvr_model_params p = { .name = "qd", .n_layers = QL, .n_kv_heads = QH, .head_dim = QD,
                           .dtype = KVR_DTYPE_F32, .rope = &rc };
    kvr_model mx;
    p.codec = "k4v2";
    cr_assert_eq(kvr_client_model_register(C, &p, &mx), 0, "%s", kvr_client_last_error(C));
    cr_assert_str_eq(mx.codec, "k=int4/g128/c,v=int2/g256,r=128");
    kvr_model *ms;

    size_t nm;
    cr_assert_eq(kvr_client_model_list(C, &ms, &nm), 0);
    bool seen = false;
    for (size_t i = 0; i < nm; i++)
        if (!strcmp(ms[i].name, "qd")) {
            cr_assert_str_eq(ms[i].codec, mx.codec);
            seen = true;
        } else if (!strcmp(ms[i].name, "q")) {
            cr_assert_str_eq(ms[i].codec, "f32");
        }
    cr_assert(seen);
    kvr_client_free(ms);
    /* A context of qd without a codec takes the model's. */
    uint32_t *ids = ids_from(1, 200);
    int64_t *pos = pos_from(0, 200);
    float *pl = make_kv(ids, pos, 200);
    cr_assert_eq(put_kv("dflt", "qd", KVR_PUT_CREATE, NULL, ids, pos, 200, pl), 0, "%s",
                 kvr_client_last_error(C));
    kvr_context cc;
    cr_assert_eq(kvr_client_stat(C, "dflt", &cc), 0);
    cr_assert_str_eq(cc.codec, mx.codec);
    cr_assert(cc.quantized);
    cr_assert_eq(cc.n_window, 200);   /* 200 - 128 < one 128-token tile */

    /* Bad specs: E_INVALID with the store's explanation, nothing created. */
    const char *bad[] = { "int3", "k4v3", "int4/g48", "kivi:k4", "k=int4,v=int4/c", "x" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int r = put_kv("bad", "q", KVR_PUT_CREATE, bad[i], ids, pos, 200, pl);
        cr_assert_eq(r, KVR_EINVAL, "spec '%s': %d", bad[i], r);
        cr_assert(strstr(kvr_client_last_error(C), "codec"), "%s",
                  kvr_client_last_error(C));
        cr_assert_eq(kvr_client_stat(C, "bad", NULL), KVR_ENOCTX);
    }
    p.name = "qbad";
    p.codec = "int5";
    cr_assert_eq(kvr_client_model_register(C, &p, NULL), KVR_EINVAL);
    cr_assert(strstr(kvr_client_last_error(C), "bad codec spec"), "%s",
              kvr_client_last_error(C));
    cr_assert_eq(kvr_client_model_get(C, "qbad", &(kvr_model){ 0 }), KVR_ENOMODEL);
    /* Append with another codec than the context's: refused, unchanged. */
    int64_t p2 = 200;
    int r = put_kv("dflt", "qd", KVR_PUT_APPEND, "int8", ids, &p2, 1, pl);
    cr_assert_eq(r, KVR_EINVAL, "%d %s", r, kvr_client_last_error(C));
    /* ...and with its own codec (any spelling): fine. */
    kvr_put_args a = { .ctx_id = "dflt", .model = "qd", .mode = KVR_PUT_APPEND,
                       .dtype = KVR_DTYPE_F32, .tokens = ids, .n_tokens = 1,
                       .n_layers = QL, .n_kv_heads = QH, .head_dim = QD };
    float *one = make_kv(ids, &p2, 1);
    a.payload = one;
    a.payload_len = (size_t)QL * 2 * ROW * sizeof(float);
    a.codec = "quant";
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
    free(one);
    free(ids);
    free(pos);
    free(pl);
}

/* ---- nan / inf ------------------------------------------------------------ */

Test(int_quant, nan_refused_context_unchanged)
{
    float *pl = put_ctx("nan", "int8", 50000);
    free(pl);
    size_t n0;
    float *before = get_f32("nan", &n0, NULL);
    kvr_context cc0;
    cr_assert_eq(kvr_client_stat(C, "nan", &cc0), 0);
    uint32_t *ids = ids_from(60000, 10);
    int64_t *pos = pos_from(POS0 + N, 10);
    float *add = make_kv(ids, pos, 10);
    /* V of layer 1, token 5 of the put */
    add[((size_t)1 * 2 + 1) * 10 * ROW + 5 * ROW + 7] = NAN;
    int r = put_kv("nan", "q", KVR_PUT_APPEND, NULL, ids, pos, 10, add);
    cr_assert_eq(r, KVR_EINVAL, "%d", r);
    const char *m = kvr_client_last_error(C);
    cr_assert(strstr(m, "layer 1") && strstr(m, "token 5"), "message: %s", m);
    size_t n1;
    float *after = get_f32("nan", &n1, NULL);
    cr_assert_eq(n1, n0);
    cr_assert_eq(memcmp(before, after, (size_t)QL * 2 * n0 * ROW * sizeof(float)), 0);
    kvr_context cc1;
    cr_assert_eq(kvr_client_stat(C, "nan", &cc1), 0);
    cr_assert_eq(cc1.kv_bytes, cc0.kv_bytes);
    cr_assert_eq(cc1.rel_rms_k, cc0.rel_rms_k);
    /* inf in K of layer 0, token 2, on create: nothing is created. */
    add[((size_t)1 * 2 + 1) * 10 * ROW + 5 * ROW + 7] = 0.5f;
    add[2 * ROW + 3] = INFINITY;
    r = put_kv("nan2", "q", KVR_PUT_CREATE, "k4v2", ids, pos, 10, add);
    cr_assert_eq(r, KVR_EINVAL, "%d", r);
    m = kvr_client_last_error(C);
    cr_assert(strstr(m, "layer 0") && strstr(m, "token 2"), "message: %s", m);
    cr_assert_eq(kvr_client_stat(C, "nan2", NULL), KVR_ENOCTX);
    /* The connection is fine and the clean put goes through. */
    add[2 * ROW + 3] = 0.25f;
    cr_assert_eq(put_kv("nan", "q", KVR_PUT_APPEND, NULL, ids, pos, 10, add), 0, "%s",
                 kvr_client_last_error(C));
    free(before);
    free(after);
    free(ids);
    free(pos);
    free(add);
}

/* ---- edits on a quantized context ---------------------------------------- */

static void edit_on(const char *spec, const char *id)
{
    float *pl = put_ctx(id, spec, 70000);
    int64_t *pos = pos_from(POS0, N);
    kvr_context cc;
    cr_assert_eq(kvr_client_stat(C, id, &cc), 0);
    size_t nq = N - (size_t)cc.n_window;
    /* Q of the quantized range, from the raw bytes. */
    kvr_get_args ga = { .ctx_id = id, .end = nq, .raw = true };
    kvr_kv kv;
    kvr_raw_layout rl;
    cr_assert_eq(get_raw(&ga, &kv, &rl), 0, "%s", kvr_client_last_error(C));
    float *pre = pre_rope(pl, pos, N);
    float *preq = first_rows(pre, N, nq);
    float *q = check_raw(kv.payload, &rl, nq, preq);
    kvr_kv_release(&kv);
    /* Delete [10, 30), insert 3 new tokens before old index 100. */
    uint32_t nid[3] = { 90001, 90002, 90003 };
    kvr_edit_range ops[2] = { { .start = 10, .end = 30 },
                              { .start = 100, .end = 100, .tokens = nid, .n_tokens = 3 } };
    kvr_edit_args ea = { .ctx_id = id, .ops = ops, .n_ops = 2 };
    kvr_edit_res er;
    cr_assert_eq(kvr_client_edit_plan(C, &ea, &er), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(er.n_spans, 2);
    int64_t npos[3];
    for (int i = 0; i < 3; i++)
        npos[i] = er.spans[1].first_pos + i;
    size_t ins_at = (size_t)er.spans[1].index;
    kvr_client_free(er.spans);
    float *nkv = make_kv(nid, npos, 3);
    ea.with_kv = true;
    ea.dtype = KVR_DTYPE_F32;
    ea.payload = nkv;
    ea.payload_len = (size_t)QL * 2 * 3 * ROW * sizeof(float);
    cr_assert_eq(kvr_client_edit(C, &ea, &er), 0, "%s", kvr_client_last_error(C));
    kvr_client_free(er.spans);
    size_t n;
    int64_t *gp;
    float *g = get_f32(id, &n, &gp);
    cr_assert_eq(n, N - 20 + 3);
    cr_assert_eq(ins_at, 80);
    float k[ROW], v[ROW];
    for (size_t i = 0; i < n; i++) {
        /* old index of token i, or a new token */
        bool is_new = i >= 80 && i < 83;
        size_t old = i < 10 ? i : i < 80 ? i + 20 : i - 3 + 20;
        int64_t want = is_new ? npos[i - 80] : old < 10 ? POS0 + (int64_t)old
                       : old < 100 ? POS0 + (int64_t)old - 20 : POS0 + (int64_t)old - 17;
        cr_assert_eq(gp[i], want, "%s token %zu: position %lld, want %lld", spec, i,
                     (long long)gp[i], (long long)want);
        for (int l = 0; l < QL; l++) {
            const float *gk = g + (size_t)l * 2 * n * ROW + i * ROW, *gv = gk + n * ROW;
            float tol = 1e-5f;
            if (is_new) {
                memcpy(k, nkv + (size_t)l * 2 * 3 * ROW + (i - 80) * ROW, sizeof k);
                memcpy(v, nkv + ((size_t)l * 2 + 1) * 3 * ROW + (i - 80) * ROW, sizeof v);
            } else if (old < nq) {
                expect_token(q, nq, old, want, k, v, l);   /* exact at the new position */
            } else {
                expect_token(pre, N, old, want, k, v, l);  /* window: re-rotated */
                tol = 1e-4f;
            }
            cmp_row(gk, k, tol, spec, i);
            cmp_row(gv, v, 1e-6f, spec, i);
        }
    }
    free(g);
    free(gp);
    free(nkv);
    free(q);
    free(preq);
    free(pre);
    free(pos);
    free(pl);
}

Test(int_quant, edit_keeps_keys_exact)
{
    edit_on("k4v2", "ed1");
    edit_on("int4", "ed2");
    edit_on("q4_0", "ed3");
}

/* ---- CLI ----------------------------------------------------------------- */

Test(int_quant, cli_codec_put_stat_get_raw)
{
    char out[16384];
    const char *add[] = { "models", "add", "qc", "--layers", "2", "--heads", "2", "--head-dim",
                          "64", "--dtype", "f32", "--codec", "kivi:k4v2:g64:r64", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, add), 0, "%s", out);
    cr_assert(strstr(out, "codec=k=int4/g64/c,v=int2/g64,r=64"), "%s", out);
    const char *bad[] = { "models", "add", "qx", "--layers", "2", "--heads", "2", "--head-dim",
                          "64", "--codec", "int7", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, bad), 1);

    const size_t n = 128;
    uint32_t *ids = ids_from(0, n);
    int64_t *pos = pos_from(0, n);
    float *pl = make_kv(ids, pos, n);
    char file[400], rawf[400], tokfile[400];
    snprintf(file, sizeof file, "%s/kv.bin", D.dir);
    snprintf(rawf, sizeof rawf, "%s/raw.bin", D.dir);
    snprintf(tokfile, sizeof tokfile, "%s/tokens.txt", D.dir);
    FILE *f = fopen(file, "wb");
    cr_assert_not_null(f);
    fwrite(pl, sizeof(float), (size_t)QL * 2 * n * ROW, f);
    fclose(f);
    f = fopen(tokfile, "w");
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%u\n", ids[i]);
    fclose(f);
    const char *put[] = { "put", "cli1", file, "--model", "q", "--mode", "create",
                          "--tokens-file", tokfile, "--codec", "int4", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, put), 0, "%s", out);
    const char *badput[] = { "put", "cli2", file, "--model", "q", "--mode", "create",
                             "--tokens-file", tokfile, "--codec", "int4/g33", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, badput), 1);
    const char *jstat[] = { "--json", "stat", "cli1", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, jstat), 0, "%s", out);
    cr_assert(strstr(out, "\"k=int4/g64,v=int4/g64,r=0\""), "%s", out);
    cr_assert(strstr(out, "\"bits_per_value\""), "%s", out);
    cr_assert(strstr(out, "\"rel_rms_k\""), "%s", out);
    cr_assert(strstr(out, "\"quantized\":\ttrue"), "%s", out);
    const char *hstat[] = { "stat", "cli1", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, hstat), 0, "%s", out);
    cr_assert(strstr(out, "codec:        k=int4/g64,v=int4/g64,r=0"), "%s", out);
    cr_assert(strstr(out, "bits/value"), "%s", out);
    const char *get[] = { "--json", "get", "cli1", "-o", rawf, "--raw", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, get), 0, "%s", out);
    cr_assert(strstr(out, "\"k_codec\":\t\"int4/g64\""), "%s", out);
    struct stat sb;
    cr_assert_eq(stat(rawf, &sb), 0);
    kvr_codec c4 = { .type = KVR_CODEC_INT4 };
    cr_assert_eq((size_t)sb.st_size, (size_t)QL * 2 * n * kvr_codec_row_bytes(&c4, ROW));
    const char *stats[] = { "stats", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, stats), 0, "%s", out);
    cr_assert(strstr(out, "quant_contexts") && strstr(out, "quant_bits_per_value"), "%s", out);
    free(ids);
    free(pos);
    free(pl);
    unlink(file);
    unlink(rawf);
    unlink(tokfile);
}
