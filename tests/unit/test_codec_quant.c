/*
 * test_codec_quant.c — the uniform group codecs (INT8/INT4/INT2), KIVI key
 * tiles and window bookkeeping, plain codecs, sizes, refusals, and SIMD ==
 * scalar byte for byte. Links cache/codec*.c and rope/ only.
 *
 * The error bound checked everywhere is codec.h's: |y - x| <= s/2 against the
 * STORED scale s, plus float slack. Slack: encoding rounds (x - m) and the
 * product with 1/s (each <= 2^-24 relative), decoding rounds q*s and the sum
 * with m; in total fewer than 8 ulps of |x| + |m| + L*s, so 2^-20 of that sum
 * is a safe and still tiny allowance (1e-6 relative).
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <float.h>

#include "cache/codec.h"
#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_codec.h"

/* ---- data --------------------------------------------------------------- */

static uint64_t rng_state;
static uint64_t rng_next(void)
{
    uint64_t x = rng_state;
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    rng_state = x;
    return x * 0x2545F4914F6CDD1DULL;
}
static double rng_unit(void) { return (double)(rng_next() >> 11) * 0x1p-53; }
static double rng_gauss(void)
{
    double u = rng_unit(), v = rng_unit();
    if (u < 1e-300) u = 1e-300;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* Gaussian rows of `row` channels; channels 3, 17 and 100 (mod row) are
 * outlier channels, 20x larger and offset, as K activations have. */
static void gen(float *x, size_t n, size_t row, uint64_t seed)
{
    rng_state = seed * 0x9E3779B97F4A7C15ULL + 1;
    for (size_t i = 0; i < n; i++) {
        size_t ch = i % row;
        double g = rng_gauss();
        if (ch == 3 || ch == 17 || ch == 100) g = g * 20.0 + 5.0;
        x[i] = (float)g;
    }
}

static const kvr_codec_type uni_types[] = { KVR_CODEC_INT8, KVR_CODEC_INT4, KVR_CODEC_INT2 };

/* Checks the half-step bound of every element of a decoded row. */
static void check_bound(const kvr_codec *c, const float *x, const float *y,
                        const void *enc, size_t n)
{
    uint32_t G = kvr_codec_group(c);
    float L = (float)((1u << kvr_codec_value_bits(c->type)) - 1);
    for (size_t g = 0; g * G < n; g++) {
        float s, m;
        cr_assert_eq(kvr_codec_group_params(c, enc, n, g, &s, &m), 0);
        size_t e = (g + 1) * G < n ? (g + 1) * G : n;
        float lo = x[g * G], hi = x[g * G];
        for (size_t i = g * G; i < e; i++) {
            double slack = 0x1p-20 * ((double)fabsf(x[i]) + fabs((double)m) + (double)L * (double)s);
            double err = fabs((double)y[i] - (double)x[i]);
            cr_assert(err <= 0.5 * (double)s + slack,
                      "%s g%u p%d n=%zu i=%zu: x=%.9g y=%.9g err=%.3g step=%.3g",
                      kvr_codec_type_name(c->type), G, (int)c->params, n, i,
                      (double)x[i], (double)y[i], err, (double)s);
            if (x[i] < lo) lo = x[i];
            if (x[i] > hi) hi = x[i];
        }
        /* The stored parameters are tight, not just safe: m is within an
         * f16 ulp below lo and s is (hi - m)/L rounded up by < 2^-9. */
        cr_assert(m <= lo);
        cr_assert((double)m + (double)L * (double)s >= (double)hi);
        cr_assert((double)s <= ((double)hi - (double)m) / (double)L * (1.0 + 0x1p-9) + 0x1p-24,
                  "scale %.9g too large for range [%.9g, %.9g]", (double)s, (double)m, (double)hi);
    }
}

static void roundtrip_bound(const kvr_codec *c, const float *x, size_t n)
{
    size_t nb = kvr_codec_row_bytes(c, n);
    cr_assert(nb > 0);
    uint8_t *enc = malloc(nb);
    float *y = malloc(n * sizeof *y);
    uint16_t *xh = malloc(n * 2), *yh = malloc(n * 2);
    size_t bad = 12345;
    cr_assert_eq(kvr_codec_encode(c, enc, x, KVR_DTYPE_F32, n, &bad), 0);
    cr_assert_eq(bad, 12345, "bad index touched on success");
    cr_assert_eq(kvr_codec_decode(c, y, KVR_DTYPE_F32, enc, n), 0);
    check_bound(c, x, y, enc, n);

    /* f16 input: the bound holds against the f16 values; f16 output is the
     * f32 output rounded. */
    float *xf = malloc(n * sizeof *xf);
    bool fits = true;
    for (size_t i = 0; i < n; i++) fits = fits && fabsf(x[i]) <= 65504.0f;
    if (!fits) n = 0;   /* not representable as f16 input: skip that half */
    for (size_t i = 0; i < n; i++) { xh[i] = kvr_f32_to_f16(x[i]); xf[i] = kvr_f16_to_f32(xh[i]); }
    if (n) {
        cr_assert_eq(kvr_codec_encode(c, enc, xh, KVR_DTYPE_F16, n, NULL), 0);
        cr_assert_eq(kvr_codec_decode(c, y, KVR_DTYPE_F32, enc, n), 0);
        check_bound(c, xf, y, enc, n);
    }
    cr_assert_eq(kvr_codec_decode(c, yh, KVR_DTYPE_F16, enc, n), 0);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(yh[i], kvr_f32_to_f16(y[i]), "f16 output at %zu", i);
    free(xf); free(xh); free(yh); free(y); free(enc);
}

/* ---- bounds ------------------------------------------------------------- */

Test(codec_uniform, half_step_gaussian_outliers)
{
    const size_t lens[] = { 8 * 128 * 4, 8 * 128 * 4 + 45, 1, 31, 33 };
    const uint32_t groups[] = { 32, 64, 128, 256 };
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++) {
        size_t n = lens[li];
        float *x = malloc(n * sizeof *x);
        gen(x, n, 1024, 7 + li);
        for (size_t t = 0; t < 3; t++)
            for (size_t gi = 0; gi < 4; gi++)
                for (int p = 0; p < 2; p++)
                    for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
                        kvr_codec c = { .type = uni_types[t], .group = groups[gi],
                                        .params = (kvr_codec_params)p, .isa = (kvr_isa)isa };
                        roundtrip_bound(&c, x, n);
                    }
        free(x);
    }
}

Test(codec_uniform, half_step_hard_ranges)
{
    /* Large offsets, tiny spreads, subnormal-f16 magnitudes, the f16 edge. */
    const float base[] = { 1000.0f, -3.3e4f, 1e-6f, -7e-5f, 0.1f, 65000.0f, -65504.0f };
    const float spread[] = { 1e-3f, 2.0f, 3e-8f, 1e-5f, 1e-7f, 504.0f, 1.0f };
    float x[256];
    for (size_t k = 0; k < sizeof base / sizeof *base; k++) {
        rng_state = 99 + k;
        for (int i = 0; i < 256; i++) x[i] = base[k] + spread[k] * (float)rng_unit();
        x[0] = base[k];
        for (size_t t = 0; t < 3; t++)
            for (int p = 0; p < 2; p++) {
                kvr_codec c = { .type = uni_types[t], .group = 64, .params = (kvr_codec_params)p };
                roundtrip_bound(&c, x, 256);
            }
    }
}

Test(codec_uniform, constant_group_exact)
{
    const float consts[] = { 0.375f, -1234.5f, 1.0f, -0.0f, 65504.0f, 6e-8f };
    float x[200], y[200];
    uint8_t enc[1024];
    for (size_t k = 0; k < sizeof consts / sizeof *consts; k++)
        for (size_t t = 0; t < 3; t++)
            for (int p = 0; p < 2; p++) {
                float cval = kvr_f16_to_f32(kvr_f32_to_f16(consts[k])); /* f16-representable */
                for (int i = 0; i < 200; i++) x[i] = cval;
                kvr_codec c = { .type = uni_types[t], .group = 32, .params = (kvr_codec_params)p };
                cr_assert_eq(kvr_codec_encode(&c, enc, x, KVR_DTYPE_F32, 200, NULL), 0);
                cr_assert_eq(kvr_codec_decode(&c, y, KVR_DTYPE_F32, enc, 200), 0);
                float s, m;
                cr_assert_eq(kvr_codec_group_params(&c, enc, 200, 3, &s, &m), 0);
                cr_assert_eq(s, 0.0f);
                for (int i = 0; i < 200; i++) cr_assert_eq(y[i], cval, "%g -> %g", (double)cval, (double)y[i]);
            }
    /* With f32 parameters any finite constant is exact. */
    for (int i = 0; i < 64; i++) x[i] = 0.1f;
    kvr_codec c = { .type = KVR_CODEC_INT2, .params = KVR_CODEC_PARAMS_F32 };
    cr_assert_eq(kvr_codec_encode(&c, enc, x, KVR_DTYPE_F32, 64, NULL), 0);
    cr_assert_eq(kvr_codec_decode(&c, y, KVR_DTYPE_F32, enc, 64), 0);
    for (int i = 0; i < 64; i++) cr_assert_eq(y[i], 0.1f);
}

Test(codec_uniform, zeros_are_zeros)
{
    float x[300] = { 0 }, y[300];
    uint16_t yh[300];
    uint8_t enc[2048];
    for (size_t t = 0; t < 3; t++)
        for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
            kvr_codec c = { .type = uni_types[t], .isa = (kvr_isa)isa };
            cr_assert_eq(kvr_codec_encode(&c, enc, x, KVR_DTYPE_F32, 300, NULL), 0);
            cr_assert_eq(kvr_codec_decode(&c, y, KVR_DTYPE_F32, enc, 300), 0);
            cr_assert_eq(kvr_codec_decode(&c, yh, KVR_DTYPE_F16, enc, 300), 0);
            for (int i = 0; i < 300; i++) {
                cr_assert_eq(y[i], 0.0f);
                cr_assert_eq(yh[i] & 0x7FFF, 0);
            }
        }
}

Test(codec_uniform, mixed_signed_zeros_same_bytes)
{
    /* min/max kernels may see -0 or +0 first; the bytes must not depend on it. */
    float a[64], b[64];
    for (int i = 0; i < 64; i++) { a[i] = (i & 1) ? -0.0f : 0.0f; b[i] = (i & 1) ? 0.0f : -0.0f; }
    a[5] = b[5] = 2.0f;
    uint8_t ea[64], eb[64], es[64];
    kvr_codec c = { .type = KVR_CODEC_INT4 };
    kvr_codec cs = { .type = KVR_CODEC_INT4, .isa = KVR_ISA_SCALAR };
    size_t nb = kvr_codec_row_bytes(&c, 64);
    cr_assert_eq(kvr_codec_encode(&c, ea, a, KVR_DTYPE_F32, 64, NULL), 0);
    cr_assert_eq(kvr_codec_encode(&c, eb, b, KVR_DTYPE_F32, 64, NULL), 0);
    cr_assert_eq(kvr_codec_encode(&cs, es, a, KVR_DTYPE_F32, 64, NULL), 0);
    cr_assert_eq(memcmp(ea, eb, nb), 0);
    cr_assert_eq(memcmp(ea, es, nb), 0);
}

/* ---- refusals ----------------------------------------------------------- */

static void expect_refused(const kvr_codec *c, const void *x, kvr_dtype t, size_t n, size_t idx)
{
    static uint8_t enc[1 << 16];
    size_t bad = (size_t)-1;
    int rc = kvr_codec_encode(c, enc, x, t, n, &bad);
    cr_assert_eq(rc, KVR_EINVAL, "%s: rc %d", kvr_codec_type_name(c->type), rc);
    cr_assert_eq(bad, idx, "%s isa %d: bad %zu expected %zu", kvr_codec_type_name(c->type),
                 (int)c->isa, bad, idx);
}

Test(codec_uniform, nonfinite_refused_with_index)
{
    enum { N = 1024 };
    static float x[N];
    static uint16_t xh[N], xb[N];
    const float badv[] = { NAN, INFINITY, -INFINITY };
    const size_t where[] = { 0, 77, 1000, N - 1 };
    for (size_t bi = 0; bi < 3; bi++)
        for (size_t wi = 0; wi < 4; wi++) {
            gen(x, N, 128, 3);
            x[where[wi]] = badv[bi];
            if (wi == 1) x[900] = NAN;  /* a later bad value: still report the first */
            for (size_t i = 0; i < N; i++) { xh[i] = kvr_f32_to_f16(x[i]); xb[i] = kvr_f32_to_bf16(x[i]); }
            for (int ty = 0; ty < KVR_CODEC_TYPE_COUNT_; ty++)
                for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
                    kvr_codec c = { .type = (kvr_codec_type)ty, .isa = (kvr_isa)isa };
                    expect_refused(&c, x, KVR_DTYPE_F32, N, where[wi]);
                    expect_refused(&c, xh, KVR_DTYPE_F16, N, where[wi]);
                    expect_refused(&c, xb, KVR_DTYPE_BF16, N, where[wi]);
                }
        }
}

Test(codec_uniform, f16_param_range_refused)
{
    float x[128];
    gen(x, 128, 128, 5);
    x[70] = 70000.0f;
    kvr_codec c16 = { .type = KVR_CODEC_INT4 };
    expect_refused(&c16, x, KVR_DTYPE_F32, 128, 70);
    c16.isa = KVR_ISA_SCALAR;
    expect_refused(&c16, x, KVR_DTYPE_F32, 128, 70);
    kvr_codec f16 = { .type = KVR_CODEC_F16 };
    expect_refused(&f16, x, KVR_DTYPE_F32, 128, 70);
    /* f32 parameters take it, within half a step. */
    kvr_codec c32 = { .type = KVR_CODEC_INT4, .params = KVR_CODEC_PARAMS_F32 };
    roundtrip_bound(&c32, x, 128);
}

/* ---- SIMD == scalar ----------------------------------------------------- */

Test(codec_simd, same_bytes_as_scalar)
{
    const size_t lens[] = { 1, 7, 8, 31, 32, 33, 63, 64, 65, 100, 255, 256, 257, 1000, 4099 };
    const uint32_t groups[] = { 32, 64, 96, 128, 256 };
    enum { NMAX = 4099 };
    static float x[NMAX], y1[NMAX], y2[NMAX];
    static uint16_t xh[NMAX], h1[NMAX], h2[NMAX];
    static uint8_t e1[NMAX * 2], e2[NMAX * 2];
    for (int seed = 0; seed < 3; seed++) {
        gen(x, NMAX, 96 + (size_t)seed, 100 + (uint64_t)seed);
        /* constant stretches and signed zeros */
        for (int i = 200; i < 264; i++) x[i] = 0.5f;
        for (int i = 300; i < 364; i++) x[i] = (i & 1) ? -0.0f : 0.0f;
        for (size_t i = 0; i < NMAX; i++) xh[i] = kvr_f32_to_f16(x[i]);
        for (size_t li = 0; li < sizeof lens / sizeof *lens; li++)
            for (size_t gi = 0; gi < 5; gi++)
                for (size_t t = 0; t < 3; t++)
                    for (int p = 0; p < 2; p++) {
                        size_t n = lens[li];
                        kvr_codec cs = { .type = uni_types[t], .group = groups[gi],
                                         .params = (kvr_codec_params)p, .isa = KVR_ISA_SCALAR };
                        size_t nb = kvr_codec_row_bytes(&cs, n);
                        for (int isa = KVR_ISA_AVX2; isa <= KVR_ISA_AVX512; isa++)
                        for (int in16 = 0; in16 < 2; in16++) {
                            kvr_codec cv = cs;
                            cv.isa = (kvr_isa)isa;
                            const void *src = in16 ? (const void *)xh : (const void *)x;
                            kvr_dtype st = in16 ? KVR_DTYPE_F16 : KVR_DTYPE_F32;
                            memset(e1, 0xAA, nb + 8);
                            memset(e2, 0x55, nb + 8);
                            cr_assert_eq(kvr_codec_encode(&cs, e1, src, st, n, NULL), 0);
                            cr_assert_eq(kvr_codec_encode(&cv, e2, src, st, n, NULL), 0);
                            cr_assert_eq(memcmp(e1, e2, nb), 0, "%s g%u p%d n=%zu in16=%d",
                                         kvr_codec_type_name(cs.type), groups[gi], p, n, in16);
                            cr_assert_eq(e1[nb], 0xAA, "scalar wrote past row_bytes");
                            cr_assert_eq(e2[nb], 0x55, "simd wrote past row_bytes");
                            cr_assert_eq(kvr_codec_decode(&cs, y1, KVR_DTYPE_F32, e1, n), 0);
                            cr_assert_eq(kvr_codec_decode(&cv, y2, KVR_DTYPE_F32, e1, n), 0);
                            cr_assert_eq(memcmp(y1, y2, n * 4), 0);
                            cr_assert_eq(kvr_codec_decode(&cs, h1, KVR_DTYPE_F16, e1, n), 0);
                            cr_assert_eq(kvr_codec_decode(&cv, h2, KVR_DTYPE_F16, e1, n), 0);
                            cr_assert_eq(memcmp(h1, h2, n * 2), 0);
                            cr_assert_eq(kvr_codec_decode(&cv, h2, KVR_DTYPE_BF16, e1, n), 0);
                            for (size_t i = 0; i < n; i++) cr_assert_eq(h2[i], kvr_f32_to_bf16(y1[i]));
                        }
                    }
    }
}

Test(codec_simd, same_bytes_hard_ranges)
{
    /* Offsets, tiny spreads and f16-subnormal magnitudes exercise the
     * parameter search (the AVX2 path starts it from a different guess). */
    enum { N = 64 * 40 };
    static float x[N];
    static uint8_t e1[N * 2], e2[N * 2];
    rng_state = 4242;
    for (size_t g = 0; g < N / 64; g++) {
        double base = (rng_unit() - 0.5) * pow(10.0, (double)(g % 9) - 4.0) * 6.0;
        double spread = pow(10.0, -(double)(g % 9)) * rng_unit();
        for (size_t i = 0; i < 64; i++) x[g * 64 + i] = (float)(base + spread * rng_gauss());
    }
    for (size_t t = 0; t < 3; t++)
        for (int p = 0; p < 2; p++) {
            kvr_codec cs = { .type = uni_types[t], .params = (kvr_codec_params)p, .isa = KVR_ISA_SCALAR };
            for (int isa = KVR_ISA_AVX2; isa <= KVR_ISA_AVX512; isa++) {
                kvr_codec cv = cs;
                cv.isa = (kvr_isa)isa;
                cr_assert_eq(kvr_codec_encode(&cs, e1, x, KVR_DTYPE_F32, N, NULL), 0);
                cr_assert_eq(kvr_codec_encode(&cv, e2, x, KVR_DTYPE_F32, N, NULL), 0);
                cr_assert_eq(memcmp(e1, e2, kvr_codec_row_bytes(&cs, N)), 0, "%s p%d isa %d",
                             kvr_codec_type_name(cs.type), p, isa);
                roundtrip_bound(&cv, x, N);
            }
        }
}

Test(codec_simd, tiles_same_as_scalar)
{
    enum { G = 64, NCH = 8 * 5 + 3, LD = 48 };
    static float x[G * LD], y1[G * LD], y2[G * LD];
    static uint16_t xh[G * LD], h1[G * LD], h2[G * LD];
    static uint8_t e1[1 << 16], e2[1 << 16];
    gen(x, G * LD, LD, 77);
    for (size_t i = 0; i < G * LD; i++) xh[i] = kvr_f32_to_f16(x[i]);
    for (size_t t = 0; t < 3; t++)
        for (int in16 = 0; in16 < 2; in16++) {
            kvr_codec cs = { .type = uni_types[t], .group = G, .axis = KVR_CODEC_AXIS_CHANNEL,
                             .isa = KVR_ISA_SCALAR };
            kvr_codec cv = cs;
            cv.isa = KVR_ISA_AUTO;
            const void *src = in16 ? (const void *)xh : (const void *)x;
            kvr_dtype st = in16 ? KVR_DTYPE_F16 : KVR_DTYPE_F32;
            size_t tb = kvr_codec_tile_bytes(&cs, NCH);
            cr_assert_eq(kvr_codec_encode_tile(&cs, e1, src, st, NCH, LD, NULL), 0);
            cr_assert_eq(kvr_codec_encode_tile(&cv, e2, src, st, NCH, LD, NULL), 0);
            cr_assert_eq(memcmp(e1, e2, tb), 0);
            memset(y1, 0, sizeof y1); memset(y2, 0, sizeof y2);
            cr_assert_eq(kvr_codec_decode_tile(&cs, y1, KVR_DTYPE_F32, LD, e1, NCH), 0);
            cr_assert_eq(kvr_codec_decode_tile(&cv, y2, KVR_DTYPE_F32, LD, e1, NCH), 0);
            cr_assert_eq(memcmp(y1, y2, sizeof y1), 0);
            memset(h1, 0, sizeof h1); memset(h2, 0, sizeof h2);
            cr_assert_eq(kvr_codec_decode_tile(&cs, h1, KVR_DTYPE_F16, LD, e1, NCH), 0);
            cr_assert_eq(kvr_codec_decode_tile(&cv, h2, KVR_DTYPE_F16, LD, e1, NCH), 0);
            cr_assert_eq(memcmp(h1, h2, sizeof h1), 0);
        }
}

/* Hard data for the parameter search: each group (row) or channel (tile)
 * gets its own offset and spread over 12 decades, including f16-subnormal
 * magnitudes, constants, signed zeros and the f16 range edge. */
static float hard_value(size_t grp, size_t i)
{
    switch (grp % 11) {
    case 0:  return 0.5f;                                        /* constant */
    case 1:  return (i & 1) ? -0.0f : 0.0f;                      /* signed zeros */
    case 2:  return (float)(6e-8 * (double)(i % 7));             /* f16 subnormals */
    case 3:  return -65504.0f + (float)(i % 3) * 32.0f;          /* f16 edge */
    case 4:  return 65504.0f - (float)(i % 5) * 16.0f;
    default: break;
    }
    double base = (rng_unit() - 0.5) * pow(10.0, (double)(grp % 9) - 4.0) * 6.0;
    double spread = pow(10.0, -(double)(grp % 13)) * rng_unit();
    double v = base + spread * rng_gauss();
    if (v > 65504.0) v = 65504.0;
    if (v < -65504.0) v = -65504.0;
    return (float)v;
}

Test(codec_simd, rows_hard_ranges_all_groups)
{
    const uint32_t groups[] = { 32, 64, 96, 128, 160, 192, 224, 256 };
    enum { NMAX = 256 * 21 + 77 };
    static float x[NMAX];
    static uint16_t xh[NMAX];
    static uint8_t e1[NMAX * 2], e2[NMAX * 2];
    for (size_t gi = 0; gi < sizeof groups / sizeof *groups; gi++) {
        uint32_t G = groups[gi];
        rng_state = 1000 + gi;
        for (size_t i = 0; i < NMAX; i++) x[i] = hard_value(i / G * 7 + i / 37 % 2, i);
        for (size_t i = 0; i < NMAX; i++) xh[i] = kvr_f32_to_f16(x[i]);
        const size_t lens[] = { (size_t)G * 17, (size_t)G * 16 + 5, (size_t)G * 33 % NMAX, NMAX };
        for (size_t li = 0; li < 4; li++)
            for (size_t t = 0; t < 3; t++)
                for (int p = 0; p < 2; p++)
                    for (int in16 = 0; in16 < 2; in16++) {
                        size_t n = lens[li];
                        kvr_codec cs = { .type = uni_types[t], .group = G,
                                         .params = (kvr_codec_params)p, .isa = KVR_ISA_SCALAR };
                        kvr_codec cv = cs;
                        cv.isa = KVR_ISA_AVX512;
                        const void *src = in16 ? (const void *)xh : (const void *)x;
                        kvr_dtype st = in16 ? KVR_DTYPE_F16 : KVR_DTYPE_F32;
                        size_t nb = kvr_codec_row_bytes(&cs, n);
                        memset(e1, 0xAA, nb + 8);
                        memset(e2, 0x55, nb + 8);
                        cr_assert_eq(kvr_codec_encode(&cs, e1, src, st, n, NULL), 0);
                        cr_assert_eq(kvr_codec_encode(&cv, e2, src, st, n, NULL), 0);
                        cr_assert_eq(memcmp(e1, e2, nb), 0, "%s g%u p%d n=%zu in16=%d",
                                     kvr_codec_type_name(cs.type), G, p, n, in16);
                        cr_assert_eq(e2[nb], 0x55, "simd wrote past row_bytes");
                    }
    }
}

/* Tiles: every group size, odd channel counts (partial 16-channel strips),
 * ld > n_ch, f16/f32 in, f32/f16/bf16 out, both parameter types, every
 * SIMD ISA against the scalar reference; hard per-channel ranges. */
Test(codec_simd, tiles_all_shapes_same_as_scalar)
{
    const uint32_t groups[] = { 32, 64, 96, 128, 160, 256 };
    const size_t nchs[] = { 1, 5, 15, 16, 17, 33, 43, 136 };
    enum { LDX = 150, GMAX = 256 };
    static float x[GMAX * LDX], y1[GMAX * LDX], y2[GMAX * LDX];
    static uint16_t xh[GMAX * LDX], h1[GMAX * LDX], h2[GMAX * LDX];
    static uint8_t e1[1 << 18], e2[1 << 18];
    for (size_t gi = 0; gi < sizeof groups / sizeof *groups; gi++)
        for (size_t ni = 0; ni < sizeof nchs / sizeof *nchs; ni++) {
            uint32_t G = groups[gi];
            size_t nch = nchs[ni], ld = nch + (ni % 3) * 7;
            rng_state = 77 + gi * 31 + ni;
            for (size_t tk = 0; tk < G; tk++)
                for (size_t ch = 0; ch < ld; ch++)
                    x[tk * ld + ch] = ni % 2 ? hard_value(ch, tk) : (float)rng_gauss();
            for (size_t i = 0; i < (size_t)G * ld; i++) xh[i] = kvr_f32_to_f16(x[i]);
            for (size_t t = 0; t < 3; t++)
                for (int p = 0; p < 2; p++)
                    for (int in16 = 0; in16 < 2; in16++) {
                        kvr_codec cs = { .type = uni_types[t], .group = G,
                                         .axis = KVR_CODEC_AXIS_CHANNEL,
                                         .params = (kvr_codec_params)p, .isa = KVR_ISA_SCALAR };
                        const void *src = in16 ? (const void *)xh : (const void *)x;
                        kvr_dtype st = in16 ? KVR_DTYPE_F16 : KVR_DTYPE_F32;
                        size_t tb = kvr_codec_tile_bytes(&cs, nch);
                        memset(e1, 0xAA, tb + 8);
                        cr_assert_eq(kvr_codec_encode_tile(&cs, e1, src, st, nch, ld, NULL), 0);
                        for (int isa = KVR_ISA_AVX2; isa <= KVR_ISA_AVX512; isa++) {
                            kvr_codec cv = cs;
                            cv.isa = (kvr_isa)isa;
                            memset(e2, 0x55, tb + 8);
                            cr_assert_eq(kvr_codec_encode_tile(&cv, e2, src, st, nch, ld, NULL), 0);
                            cr_assert_eq(memcmp(e1, e2, tb), 0, "%s g%u p%d nch=%zu in16=%d isa %d",
                                         kvr_codec_type_name(cs.type), G, p, nch, in16, isa);
                            cr_assert_eq(e2[tb], 0x55, "simd wrote past tile_bytes");
                            for (kvr_dtype od = KVR_DTYPE_F32; od <= KVR_DTYPE_BF16;
                                 od = (kvr_dtype)(od + 1)) {
                                size_t es = kvr_dtype_size(od);
                                void *a = es == 4 ? (void *)y1 : (void *)h1;
                                void *b = es == 4 ? (void *)y2 : (void *)h2;
                                memset(a, 0x3C, (size_t)G * ld * es);
                                memset(b, 0x3C, (size_t)G * ld * es);
                                cr_assert_eq(kvr_codec_decode_tile(&cs, a, od, ld, e1, nch), 0);
                                cr_assert_eq(kvr_codec_decode_tile(&cv, b, od, ld, e1, nch), 0);
                                cr_assert_eq(memcmp(a, b, (size_t)G * ld * es), 0,
                                             "decode %s g%u p%d nch=%zu dt %d isa %d",
                                             kvr_codec_type_name(cs.type), G, p, nch, (int)od, isa);
                            }
                        }
                    }
        }
}

Test(codec_simd, tile_refusals_same_index)
{
    enum { G = 128, NCH = 40, LD = 40 };
    static float x[G * LD];
    static uint16_t xh[G * LD];
    static uint8_t enc[1 << 16];
    const size_t where[] = { 0, 17, 5 * NCH + 39, 100 * NCH + 16, G * NCH - 1 };
    const float badv[] = { NAN, INFINITY, -INFINITY, 70000.0f };
    for (size_t wi = 0; wi < 5; wi++)
        for (size_t bi = 0; bi < 4; bi++) {
            gen(x, G * LD, LD, 5 + wi);
            x[where[wi]] = badv[bi];
            if (wi == 1) x[where[4]] = NAN;   /* a later one: the first is reported */
            for (size_t i = 0; i < G * LD; i++) xh[i] = kvr_f32_to_f16(x[i]);
            for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++)
                for (int in16 = 0; in16 < 2; in16++) {
                    if (in16 && bi == 3) continue;   /* 70000 is inf in f16: same as bi 1 */
                    kvr_codec c = { .type = KVR_CODEC_INT4, .group = G,
                                    .axis = KVR_CODEC_AXIS_CHANNEL, .isa = (kvr_isa)isa };
                    size_t bad = (size_t)-1;
                    cr_assert_eq(kvr_codec_encode_tile(&c, enc, in16 ? (const void *)xh
                                                                     : (const void *)x,
                                                       in16 ? KVR_DTYPE_F16 : KVR_DTYPE_F32,
                                                       NCH, LD, &bad), KVR_EINVAL);
                    cr_assert_eq(bad, where[wi], "isa %d in16 %d: bad %zu expected %zu",
                                 isa, in16, bad, where[wi]);
                }
        }
}

/* ---- KIVI --------------------------------------------------------------- */

Test(codec_kivi, key_tile_per_channel)
{
    enum { NCH = 136, LD = 140 };
    const uint32_t groups[] = { 32, 64 };
    for (size_t gi = 0; gi < 2; gi++)
        for (size_t t = 0; t < 3; t++)
            for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
                uint32_t G = groups[gi];
                kvr_codec c = { .type = uni_types[t], .group = G, .axis = KVR_CODEC_AXIS_CHANNEL,
                                .isa = (kvr_isa)isa };
                float *x = malloc((size_t)G * LD * 4), *y = malloc((size_t)G * LD * 4);
                float *col = malloc((size_t)NCH * G * 4), *ycol = malloc((size_t)NCH * G * 4);
                gen(x, (size_t)G * LD, LD, 11 + t);
                size_t tb = kvr_codec_tile_bytes(&c, NCH);
                cr_assert_eq(tb, kvr_codec_row_bytes(&c, (size_t)NCH * G));
                uint8_t *enc = malloc(tb), *ref = malloc(tb);
                cr_assert_eq(kvr_codec_encode_tile(&c, enc, x, KVR_DTYPE_F32, NCH, LD, NULL), 0);
                /* Same bytes as encoding each channel's G tokens as a row. */
                for (size_t ch = 0; ch < NCH; ch++)
                    for (size_t tk = 0; tk < G; tk++) col[ch * G + tk] = x[tk * LD + ch];
                cr_assert_eq(kvr_codec_encode(&c, ref, col, KVR_DTYPE_F32, (size_t)NCH * G, NULL), 0);
                cr_assert_eq(memcmp(enc, ref, tb), 0);
                for (size_t i = 0; i < (size_t)G * LD; i++) y[i] = -777.0f;
                cr_assert_eq(kvr_codec_decode_tile(&c, y, KVR_DTYPE_F32, LD, enc, NCH), 0);
                for (size_t ch = 0; ch < NCH; ch++)
                    for (size_t tk = 0; tk < G; tk++) ycol[ch * G + tk] = y[tk * LD + ch];
                check_bound(&c, col, ycol, enc, (size_t)NCH * G);
                for (size_t tk = 0; tk < G; tk++)
                    for (size_t ch = NCH; ch < LD; ch++) cr_assert_eq(y[tk * LD + ch], -777.0f);
                /* f16 in, f16 out */
                uint16_t *xh = malloc((size_t)G * LD * 2), *yh = malloc((size_t)G * LD * 2);
                for (size_t i = 0; i < (size_t)G * LD; i++) xh[i] = kvr_f32_to_f16(x[i]);
                cr_assert_eq(kvr_codec_encode_tile(&c, enc, xh, KVR_DTYPE_F16, NCH, LD, NULL), 0);
                cr_assert_eq(kvr_codec_decode_tile(&c, y, KVR_DTYPE_F32, LD, enc, NCH), 0);
                cr_assert_eq(kvr_codec_decode_tile(&c, yh, KVR_DTYPE_F16, LD, enc, NCH), 0);
                for (size_t tk = 0; tk < G; tk++)
                    for (size_t ch = 0; ch < NCH; ch++)
                        cr_assert_eq(yh[tk * LD + ch], kvr_f32_to_f16(y[tk * LD + ch]));
                /* A bad value is reported token-major within the tile. */
                x[5 * LD + 9] = NAN;
                size_t bad = 0;
                cr_assert_eq(kvr_codec_encode_tile(&c, enc, x, KVR_DTYPE_F32, NCH, LD, &bad), KVR_EINVAL);
                cr_assert_eq(bad, (size_t)5 * NCH + 9);
                free(x); free(y); free(col); free(ycol); free(enc); free(ref); free(xh); free(yh);
            }
}

Test(codec_kivi, value_rows_per_token)
{
    /* Values: each token's [8 heads][128] row, groups of G channels. */
    enum { T = 40, C = 8 * 128 };
    static float x[T * C];
    gen(x, T * C, C, 21);
    kvr_codec_pair p = kvr_codec_pair_default();
    cr_assert_eq(kvr_codec_pair_validate(&p), 0);
    for (int tk = 0; tk < T; tk++) roundtrip_bound(&p.v, x + tk * C, C);
}

Test(codec_kivi, window_split_counts)
{
    kvr_codec_pair p = kvr_codec_pair_default();   /* K int4/ch, V int2, window 128 */
    p.k.group = 64;                                /* tiles of 64 tokens */
    size_t k, v, prev_k = 0;
    size_t flushes = 0;
    for (size_t n = 0; n <= 1000; n++) {
        kvr_kivi_split(&p, n, &k, &v);
        cr_assert_eq(v, n > 128 ? n - 128 : 0);
        cr_assert_eq(k % 64, 0);
        cr_assert(k <= v);
        if (n >= 128) {
            cr_assert(n - k >= 128 && n - k < 128 + 64, "n=%zu k=%zu", n, k);
        } else {
            cr_assert_eq(k, 0);
        }
        if (k != prev_k) {
            /* a key tile is finalised exactly when window + G*j tokens exist */
            cr_assert_eq(k - prev_k, 64);
            cr_assert_eq((n - 128) % 64, 0, "flush at n=%zu", n);
            flushes++;
        }
        prev_k = k;
    }
    cr_assert_eq(flushes, (1000 - 128) / 64);
    kvr_kivi_split(&p, 192, &k, &v);
    cr_assert_eq(k, 64); cr_assert_eq(v, 64);
    kvr_kivi_split(&p, 191, &k, &v);
    cr_assert_eq(k, 0); cr_assert_eq(v, 63);

    p.window = 0;
    kvr_kivi_split(&p, 100, &k, &v);
    cr_assert_eq(k, 64); cr_assert_eq(v, 100);
    p.k.axis = KVR_CODEC_AXIS_TOKEN;
    p.window = 16;
    kvr_kivi_split(&p, 100, &k, &v);
    cr_assert_eq(k, 84); cr_assert_eq(v, 84);
    p.k.type = KVR_CODEC_F16;
    p.k.axis = KVR_CODEC_AXIS_TOKEN;
    kvr_kivi_split(&p, 100, &k, &v);
    cr_assert_eq(k, 100);
}

/* ---- descriptors, sizes, plain codecs ----------------------------------- */

Test(codec_desc, sizes_and_bits)
{
    kvr_codec c = { .type = KVR_CODEC_INT4 };            /* group 64 */
    cr_assert_eq(kvr_codec_row_bytes(&c, 128), 2 * 4 + 64);
    cr_assert_float_eq(kvr_codec_bits_per_value(&c, 0), 4.5, 1e-12);
    c.group = 32;
    cr_assert_float_eq(kvr_codec_bits_per_value(&c, 0), 5.0, 1e-12);
    c.type = KVR_CODEC_INT2;
    cr_assert_eq(kvr_codec_row_bytes(&c, 33), 2 * 4 + 2 * 8);   /* short group, padded chunk */
    c.params = KVR_CODEC_PARAMS_F32;
    cr_assert_float_eq(kvr_codec_bits_per_value(&c, 0), 4.0, 1e-12);
    kvr_codec q = { .type = KVR_CODEC_Q4_0 };
    cr_assert_eq(kvr_codec_row_bytes(&q, 64), 36);
    cr_assert_eq(kvr_codec_row_bytes(&q, 65), 0);
    cr_assert_float_eq(kvr_codec_bits_per_value(&q, 0), 4.5, 1e-12);
    kvr_codec h = { .type = KVR_CODEC_BF16 };
    cr_assert_eq(kvr_codec_row_bytes(&h, 10), 20);

    kvr_codec_pair p = kvr_codec_pair_default();   /* K g128 tiles, V g256: the 5x line */
    double bpt = kvr_codec_pair_bytes_per_token(&p, 32, 8, 128);
    cr_assert_float_eq(bpt, 32.0 * 8 * 128 * (4.25 + 2.125) / 8.0, 1e-9);
    cr_assert_geq(32.0 * 8 * 128 * 2 * 2 / bpt, 5.0);

    kvr_codec bad = { .type = KVR_CODEC_INT4, .group = 48 };
    cr_assert_eq(kvr_codec_validate(&bad), KVR_EINVAL);
    bad.group = 512;
    cr_assert_eq(kvr_codec_validate(&bad), KVR_EINVAL);
    kvr_codec ch = { .type = KVR_CODEC_Q8_0, .axis = KVR_CODEC_AXIS_CHANNEL };
    cr_assert_eq(kvr_codec_validate(&ch), KVR_EUNSUPPORTED);
    cr_assert_eq(kvr_codec_tile_bytes(&q, 4), 0);
}

Test(codec_desc, parse_names)
{
    kvr_codec c;
    cr_assert_eq(kvr_codec_parse("int4/g32", &c), 0);
    cr_assert_eq(c.type, KVR_CODEC_INT4);
    cr_assert_eq(c.group, 32);
    cr_assert_eq(kvr_codec_parse("q5_0", &c), 0);
    cr_assert_eq(c.type, KVR_CODEC_Q5_0);
    cr_assert_eq(kvr_codec_parse("q5_0/g64", &c), KVR_EINVAL);
    cr_assert_eq(kvr_codec_parse("int3", &c), KVR_EINVAL);
    cr_assert_eq(kvr_codec_parse("int2/g40", &c), KVR_EINVAL);
    for (int t = 0; t < KVR_CODEC_TYPE_COUNT_; t++) {
        cr_assert_eq(kvr_codec_parse(kvr_codec_type_name((kvr_codec_type)t), &c), 0);
        cr_assert_eq((int)c.type, t);
    }
}

Test(codec_desc, plain_codecs_roundtrip)
{
    enum { N = 333 };
    float x[N], y[N];
    uint8_t enc[N * 4];
    gen(x, N, 64, 9);
    kvr_codec c32 = { .type = KVR_CODEC_F32 }, c16 = { .type = KVR_CODEC_F16 },
              cb = { .type = KVR_CODEC_BF16 };
    cr_assert_eq(kvr_codec_encode(&c32, enc, x, KVR_DTYPE_F32, N, NULL), 0);
    cr_assert_eq(kvr_codec_decode(&c32, y, KVR_DTYPE_F32, enc, N), 0);
    cr_assert_eq(memcmp(x, y, sizeof x), 0);
    cr_assert_eq(kvr_codec_encode(&c16, enc, x, KVR_DTYPE_F32, N, NULL), 0);
    cr_assert_eq(kvr_codec_decode(&c16, y, KVR_DTYPE_F32, enc, N), 0);
    for (int i = 0; i < N; i++) cr_assert_eq(y[i], kvr_f16_to_f32(kvr_f32_to_f16(x[i])));
    cr_assert_eq(kvr_codec_encode(&cb, enc, x, KVR_DTYPE_F32, N, NULL), 0);
    cr_assert_eq(kvr_codec_decode(&cb, y, KVR_DTYPE_F32, enc, N), 0);
    for (int i = 0; i < N; i++) cr_assert_eq(y[i], kvr_bf16_to_f32(kvr_f32_to_bf16(x[i])));
}

Test(codec_desc, rel_rms)
{
    float a[4] = { 1, 2, 3, 4 }, b[4] = { 1, 2, 3, 5 }, z[4] = { 0 };
    cr_assert_float_eq(kvr_codec_rel_rms(a, a, KVR_DTYPE_F32, 4), 0.0, 0);
    cr_assert_float_eq(kvr_codec_rel_rms(a, b, KVR_DTYPE_F32, 4), sqrt(1.0 / 30.0), 1e-12);
    cr_assert(isinf(kvr_codec_rel_rms(z, a, KVR_DTYPE_F32, 4)));
    cr_assert_float_eq(kvr_codec_rel_rms(z, z, KVR_DTYPE_F32, 4), 0.0, 0);
}

Test(codec_desc, bad_arguments)
{
    float x[32] = { 0 };
    uint8_t enc[64];
    kvr_codec c = { .type = KVR_CODEC_INT4 };
    cr_assert_eq(kvr_codec_encode(&c, enc, x, (kvr_dtype)7, 32, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_codec_encode(&c, NULL, x, KVR_DTYPE_F32, 32, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_codec_encode(&c, enc, x, KVR_DTYPE_F32, 0, NULL), 0);
    kvr_codec q = { .type = KVR_CODEC_Q8_0 };
    cr_assert_eq(kvr_codec_encode(&q, enc, x, KVR_DTYPE_F32, 31, NULL), KVR_EUNSUPPORTED);
    cr_assert_eq(kvr_codec_encode_tile(&q, enc, x, KVR_DTYPE_F32, 1, 1, NULL), KVR_EUNSUPPORTED);
}

/* n <= 64 rows of len: every ISA's kvr_codec_err_rows gives the doubles of
 * the definition, bit for bit. Returns the number of ISAs checked. */
static long check_err_rows(const float *ref, const float *dec, size_t n, size_t len, int set)
{
    double e0[64], q0[64], e1[64], q1[64];
    cr_assert_leq(n, 64);
    for (size_t i = 0; i < n; i++)
        kvt_err_row_def(ref + i * len, dec + i * len, len, &e0[i], &q0[i]);
    long checked = 0;
    for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
        memset(e1, 0xff, sizeof e1);
        memset(q1, 0xff, sizeof q1);
        kvr_codec_err_rows((kvr_isa)isa, ref, dec, n, len, e1, q1);
        cr_assert(!memcmp(e0, e1, n * sizeof *e0) && !memcmp(q0, q1, n * sizeof *q0),
                  "isa %d set %d rows %zu len %zu: e %.17g vs %.17g", isa, set, n, len, e1[0],
                  e0[0]);
        checked++;
    }
    return checked;
}

/* The error measure kernel: every ISA returns the doubles of the
 * definition, for lengths around the 16-element vectors, the 64 lanes and
 * the 1024-element blocks, and values of very different sizes (so the order
 * of additions shows in the last bits). */
Test(codec_simd, err_rows_same_doubles_as_one_chain_per_row)
{
    size_t rows[] = { 1, 3, 7, 8, 9, 15, 16, 17, 24, 31, 40, 64 };
    size_t lens[] = { 1, 5, 8, 13, 64, 100, 1024, 1025, 2100 };
    float *ref = malloc(64 * 2100 * sizeof *ref), *dec = malloc(64 * 2100 * sizeof *dec);
    long checked = 0;
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++)
        for (size_t ri = 0; ri < sizeof rows / sizeof *rows; ri++) {
            size_t n = rows[ri], len = lens[li];
            rng_state = 77 + li * 131 + ri;
            for (size_t i = 0; i < n * len; i++) {
                double sc = (i % 11 == 3) ? 3e4 : (i % 7 == 1) ? 1e-6 : 1.0;
                ref[i] = (float)(rng_gauss() * sc);
                dec[i] = ref[i] + (float)(rng_gauss() * sc * 0.01);
            }
            checked += check_err_rows(ref, dec, n, len, -1);
        }
    cr_log_info("best ISA %s, %ld cases", kvr_isa_name(kvr_isa_best()), checked);
    free(ref);
    free(dec);
}

/* The same with edge values: subnormals, the smallest normal, FLT_MAX,
 * signed zeros, huge and tiny differences (float sums reaching inf and q
 * under 2^-60: the rows measured in double instead). */
Test(codec_simd, err_rows_edge_values_same_doubles)
{
    static const float vals[] = { 0.0f, -0.0f, 1.4e-45f, -1.4e-45f, 1.17549435e-38f,
                                  -5.9e-39f, 3.4028235e38f, -3.4028235e38f, 1e30f, -1e-30f,
                                  1.0f, -1.0000001f, 65504.0f, 6.1e-5f, 3e-8f, 1e19f };
    /* and values of moderate size whose differences need more than 26
     * significant bits, so a fused e + d*d would show in the last bits */
    static const float mid[] = { 1.0f, 3e-8f, -0.7f, 1e-9f, 2.5f, -1.3e-7f, 0.33333334f,
                                 -5e-9f, 1.7f, 7e-10f, -2.2f, 4e-8f, 0.9f, -3e-9f, 1.1f, 0.0f };
    /* values whose float squares stay finite, subnormals among them (the
     * float lanes measure these rows), and values so small that q stays
     * under 2^-60 (measured in double) */
    static const float small[] = { 0.0f, -0.0f, 1.4e-45f, -1.4e-45f, 1.17549435e-38f,
                                   -5.9e-39f, 1e-30f, -1e-30f, 3e-8f, 6.1e-5f, 1.0f,
                                   65504.0f, -1.0000001f, 1e-25f, 2e-21f, 7.0f };
    static const float tiny[] = { 0.0f, -0.0f, 1.4e-45f, -1.4e-45f, 1.17549435e-38f,
                                  -5.9e-39f, 1e-30f, -1e-30f, 3e-21f, -1e-25f, 1e-35f,
                                  -2e-22f, 5e-23f, 1e-24f, -7e-26f, 4e-21f };
    const float *sets[] = { vals, mid, small, tiny };
    size_t nv = sizeof vals / sizeof *vals;
    size_t rows[] = { 8, 13, 16, 24 };
    size_t lens[] = { 16, 48, 1024, 1100 };
    float *ref = malloc(24 * 1100 * sizeof *ref), *dec = malloc(24 * 1100 * sizeof *dec);
    for (int set = 0; set < 4; set++)
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++)
        for (size_t ri = 0; ri < sizeof rows / sizeof *rows; ri++) {
            size_t n = rows[ri], len = lens[li];
            const float *vs = sets[set];
            rng_state = 991 + li * 17 + ri + (uint64_t)set * 1000;
            for (size_t i = 0; i < n * len; i++) {
                ref[i] = vs[(size_t)((uint32_t)(rng_next() >> 32) % nv)];
                uint32_t k = (uint32_t)(rng_next() >> 32) % 4;
                dec[i] = k == 0 ? ref[i] : k == 1 ? vs[(size_t)((uint32_t)(rng_next() >> 32) % nv)]
                       : k == 2 ? ref[i] * 1.0009765625f : nextafterf(ref[i], 0.0f);
            }
            check_err_rows(ref, dec, n, len, set);
        }
    free(ref);
    free(dec);
}

/* Decoding arbitrary bytes (rows as a raw put may land them: any f16
 * parameters, zeros, subnormals, the largest, infinities, NaNs; any codes):
 * every SIMD row decoder writes the scalar decoder's f32 and f16 bytes, at
 * lengths around the kernels' batches. A NaN is matched by a NaN: which
 * payload a sum of two NaNs keeps follows the operand order the compiler
 * picked for a commutative add (it differs between -O1 and -O2 builds of the
 * scalar code), so NaN payloads are not part of the contract.
 * kvr_codec_decode_stream writes the same values, aligned or not. */
Test(codec_simd, decode_random_bytes_equals_scalar)
{
    static const uint16_t specials[] = { 0x0000, 0x8000, 0x0001, 0x83ff, 0x0400, 0x3c00,
                                         0xbc00, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00,
                                         0x7c01, 0xfe00, 0x5800, 0x1234 };
    static const kvr_codec_type types[] = { KVR_CODEC_INT8, KVR_CODEC_INT4, KVR_CODEC_INT2 };
    size_t n = 4096 + 64 * 3;
    uint8_t *src = malloc(n * 2 + 4096);
    float *y0 = malloc(n * 4), *y1 = malloc(n * 4);
    uint16_t *h0 = malloc(n * 2), *h1 = malloc(n * 2);
    uint8_t *ba = aligned_alloc(64, n * 4 + 64);
    rng_state = 4242;
    for (size_t t = 0; t < 3; t++)
        for (uint32_t g = 32; g <= 128; g *= 2) {
            kvr_codec sc = { .type = types[t], .group = g, .isa = KVR_ISA_SCALAR };
            size_t lens[] = { g, 2 * g, 16 * g + g, n / g * g };
            size_t gb = 4 + g * (t == 0 ? 8 : t == 1 ? 4 : 2) / 8;
            for (size_t li = 0; li < 4; li++) {
                size_t len = lens[li], ng = len / g;
                for (size_t i = 0; i < ng * gb; i++)
                    src[i] = (uint8_t)(rng_next() >> 40);
                for (size_t q = 0; q < ng; q += 2) {   /* special m, s in half the groups */
                    uint16_t m = specials[(q / 2) % 16], s = specials[(q / 2 + 7) % 16];
                    memcpy(src + q * gb, &m, 2);
                    memcpy(src + q * gb + 2, &s, 2);
                }
                cr_assert_eq(kvr_codec_row_bytes(&sc, len), ng * gb);
                cr_assert_eq(kvr_codec_decode(&sc, y0, KVR_DTYPE_F32, src, len), 0);
                cr_assert_eq(kvr_codec_decode(&sc, h0, KVR_DTYPE_F16, src, len), 0);
                for (int isa = KVR_ISA_AVX2; isa <= KVR_ISA_AVX512; isa++) {
                    if ((kvr_isa)isa > kvr_isa_best()) continue;
                    kvr_codec vc = sc;
                    vc.isa = (kvr_isa)isa;
                    memset(y1, 0xa5, len * 4);
                    memset(h1, 0xa5, len * 2);
                    cr_assert_eq(kvr_codec_decode(&vc, y1, KVR_DTYPE_F32, src, len), 0);
                    cr_assert_eq(kvr_codec_decode(&vc, h1, KVR_DTYPE_F16, src, len), 0);
                    for (size_t i = 0; i < len; i++) {
                        cr_assert(kvt_same_f32(y0[i], y1[i]), "type %zu g %u isa %d f32 %zu: "
                                  "%a vs %a", t, g, isa, i, (double)y1[i], (double)y0[i]);
                        cr_assert(kvt_same_f16(h0[i], h1[i]), "type %zu g %u isa %d f16 %zu: "
                                  "%04x vs %04x", t, g, isa, i, h1[i], h0[i]);
                    }
                    /* streamed (non-temporal stores where dst is on 64
                     * bytes, else ordinary ones): the same values */
                    char what[64];
                    snprintf(what, sizeof what, "type %zu g %u isa %d", t, g, isa);
                    kvt_decode_stream_check(&vc, src, len, y0, h0, ba, n * 4 + 64, what);
                }
            }
        }
    free(src);
    free(y0);
    free(y1);
    free(h0);
    free(h1);
    free(ba);
}

/* kvr_codec_encode_measured (encode and measure in one pass): the bytes of
 * kvr_codec_encode (and none past them), and the doubles of the rows
 * decoded and measured by the definition, for every int codec, groups
 * 32..256, f32 and f16 input, lengths one group to several blocks, 5 rows
 * and 70 (past a batch of 64), Gaussian rows, rows that the float lanes
 * cannot measure (tiny values: measured wide) and hard ranges (constant
 * groups, signed zeros, f16 subnormals, +-65504). A value the codec refuses,
 * in a row past the first batch too, gets kvr_codec_encode's error and
 * index. 1 only where no kernel runs it: another ISA, a group that is not a
 * power of two, a length the group does not divide. */
Test(codec_simd, encode_measured_same_bytes_and_doubles_as_encode_decode_measure)
{
    static const kvr_codec_type types[] = { KVR_CODEC_INT8, KVR_CODEC_INT4, KVR_CODEC_INT2 };
    size_t nmax = 70, lmax = 2304;
    float *ref = malloc(nmax * lmax * sizeof *ref), *dec = malloc(lmax * sizeof *dec);
    float *scratch = malloc(lmax * sizeof *scratch);
    uint16_t *rh = malloc(nmax * lmax * sizeof *rh);
    float *rf = malloc(nmax * lmax * sizeof *rf);
    uint8_t *enc = malloc(nmax * lmax * 2), *enc1 = malloc(nmax * lmax * 2 + 8);
    double *e0 = malloc(nmax * sizeof *e0), *q0 = malloc(nmax * sizeof *q0);
    double *e1 = malloc(nmax * sizeof *e1), *q1 = malloc(nmax * sizeof *q1);
    long ran = 0, refused = 0;
    for (size_t t = 0; t < 3; t++)
        for (uint32_t g = 32; g <= 256; g *= 2)
            for (int scale = 0; scale < 5; scale++)
                for (size_t len = g; len <= lmax; len += (len < 1024 ? 3 * g : 1280))
                    for (size_t nr = 5; nr <= nmax; nr += nmax - 5) {
                        if (len % g || (nr > 5 && len > 256)) continue;
                        rng_state = 31337 + t * 101 + g + (uint64_t)scale * 7 + len + nr;
                        double sc = scale == 1 ? 1e-22 : scale == 2 ? 5e3 : 1.0;
                        for (size_t i = 0; i < nr * len; i++) {
                            float v = scale == 4 ? hard_value(i / g * 7 + i / 37 % 2, i)
                                                 : (float)(rng_gauss() * sc);
                            rh[i] = kvr_f32_to_f16(scale == 1 ? 0.0f : v);
                            rf[i] = kvr_f16_to_f32(rh[i]);
                            ref[i] = v;
                        }
                        /* a value no codec takes, in one of the last rows */
                        size_t bad_at = len * (nr - 3) + 17 * g % len;   /* row nr - 3 */
                        if (scale == 3) {
                            ref[bad_at] = 1e6f;
                            rh[bad_at] = 0x7c00;   /* +inf */
                            rf[bad_at] = kvr_f16_to_f32(rh[bad_at]);
                        }
                        kvr_codec sc0 = { .type = types[t], .group = g, .isa = KVR_ISA_SCALAR };
                        size_t rb = kvr_codec_row_bytes(&sc0, len);
                        for (int hh = 0; hh < 2; hh++) {
                            const float *r32 = hh ? rf : ref;
                            const void *in = hh ? (const void *)rh : ref;
                            kvr_dtype it = hh ? KVR_DTYPE_F16 : KVR_DTYPE_F32;
                            size_t bad0 = SIZE_MAX, bad1 = SIZE_MAX;
                            int rc0 = kvr_codec_encode(&sc0, enc, in, it, nr * len, &bad0);
                            cr_assert_eq(rc0 != 0, scale == 3);
                            for (size_t i = 0; i < nr && rc0 == 0; i++) {
                                kvr_codec_decode(&sc0, dec, KVR_DTYPE_F32, enc + i * rb, len);
                                kvt_err_row_def(r32 + i * len, dec, len, &e0[i], &q0[i]);
                            }
                            for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
                                kvr_codec vc = sc0;
                                vc.isa = (kvr_isa)isa;
                                memset(e1, 0xff, nr * sizeof *e1);
                                memset(q1, 0xff, nr * sizeof *q1);
                                memset(enc1, 0xa5, nr * rb + 8);
                                int rc = kvr_codec_encode_measured(&vc, enc1, in, it, nr, len,
                                                                   scratch, e1, q1, &bad1);
                                if (rc == 1) {
                                    cr_assert(isa != KVR_ISA_AVX512 ||
                                                  kvr_isa_best() < KVR_ISA_AVX512,
                                              "the AVX-512 kernel refused type %zu g %u", t, g);
                                    continue;
                                }
                                if (scale == 3) {
                                    cr_assert_eq(rc, rc0);
                                    cr_assert_eq(bad1, bad0, "bad at %zu named %zu, encode %zu",
                                                 bad_at, bad1, bad0);
                                    refused++;
                                    continue;
                                }
                                ran++;
                                cr_assert_eq(rc, 0);
                                cr_assert(!memcmp(enc, enc1, nr * rb),
                                          "type %zu g %u len %zu f16 %d isa %d: other bytes", t,
                                          g, len, hh, isa);
                                cr_assert_eq(enc1[nr * rb], 0xa5, "wrote past the rows");
                                for (size_t i = 0; i < nr; i++)
                                    cr_assert(e0[i] == e1[i] && q0[i] == q1[i],
                                              "type %zu g %u len %zu scale %d f16 %d isa %d row "
                                              "%zu: e %.17g vs %.17g, q %.17g vs %.17g", t, g,
                                              len, scale, hh, isa, i, e1[i], e0[i], q1[i], q0[i]);
                            }
                        }
                    }
    cr_log_info("best ISA %s: %ld encoded and measured in one pass, %ld refused",
                kvr_isa_name(kvr_isa_best()), ran, refused);
    if (kvr_isa_best() >= KVR_ISA_AVX512)
        cr_assert(ran > 0 && refused > 0);
    /* not done in one pass: a group that is not a power of two, a length
     * the group does not divide, bf16 input */
    static const struct { uint32_t g; size_t len; kvr_dtype dt; } no[] = {
        { 96, 960, KVR_DTYPE_F32 }, { 160, 1280, KVR_DTYPE_F16 }, { 64, 1000, KVR_DTYPE_F32 },
        { 64, 1024, KVR_DTYPE_BF16 },
    };
    for (size_t i = 0; i < sizeof no / sizeof *no; i++) {
        kvr_codec vc = { .type = KVR_CODEC_INT4, .group = no[i].g };
        cr_assert_eq(kvr_codec_encode_measured(&vc, enc1, rh, no[i].dt, 2, no[i].len, scratch,
                                               e1, q1, NULL), 1, "case %zu", i);
    }
    free(ref);
    free(dec);
    free(scratch);
    free(rh);
    free(rf);
    free(enc);
    free(enc1);
    free(e0);
    free(q0);
    free(e1);
    free(q1);
}

/* The error measure with f16 reference rows (a put measures an f16 payload
 * straight from it): every ISA returns the doubles of the f32 path on the
 * rows' exact conversion, for any finite f16 (subnormals, zeros, the
 * largest) and decoded values near or far from them. */
Test(codec_simd, err_rows_f16_same_doubles_as_f32)
{
    size_t rows[] = { 1, 7, 8, 9, 16, 17, 24 };
    size_t lens[] = { 1, 13, 16, 100, 1024, 1100, 2100 };
    uint16_t *rh = malloc(24 * 2100 * sizeof *rh);
    float *ref = malloc(24 * 2100 * sizeof *ref), *dec = malloc(24 * 2100 * sizeof *dec);
    double e0[24], q0[24], e1[24], q1[24];
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++)
        for (size_t ri = 0; ri < sizeof rows / sizeof *rows; ri++) {
            size_t n = rows[ri], len = lens[li];
            rng_state = 5150 + li * 31 + ri;
            for (size_t i = 0; i < n * len; i++) {
                uint16_t h = (uint16_t)(rng_next() >> 48);
                if ((h & 0x7c00) == 0x7c00) h &= 0xfbff;   /* finite: 0x7c00 exponent off */
                if (i % 29 == 3) h = (uint16_t)(h & 0x83ff);   /* subnormals */
                if (i % 31 == 5) h = 0x7bff;
                rh[i] = h;
                ref[i] = kvr_f16_to_f32(h);
                uint32_t k = (uint32_t)(rng_next() >> 32) % 3;
                dec[i] = k == 0 ? ref[i] : k == 1 ? ref[i] * 1.0078125f + 3e-8f
                                                   : (float)rng_gauss();
            }
            if (ri % 3 == 1)   /* a row of signed zeros: q = 0, measured wide */
                for (size_t i = 0; i < len; i++) {
                    rh[i] = i % 2 ? 0x8000 : 0;
                    ref[i] = kvr_f16_to_f32(rh[i]);
                }
            kvr_codec_err_rows(KVR_ISA_SCALAR, ref, dec, n, len, e0, q0);
            for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
                memset(e1, 0xff, sizeof e1);
                memset(q1, 0xff, sizeof q1);
                kvr_codec_err_rows_f16((kvr_isa)isa, rh, dec, n, len, e1, q1);
                cr_assert(!memcmp(e0, e1, n * sizeof *e0) && !memcmp(q0, q1, n * sizeof *q0),
                          "isa %d rows %zu len %zu", isa, n, len);
            }
        }
    free(rh);
    free(ref);
    free(dec);
}
