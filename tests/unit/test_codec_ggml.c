/*
 * test_codec_ggml.c — ggml's q8_0 / q4_0 / q4_1 / q5_0 blocks, bit for bit
 * against the reference vectors in shared/vectors/ggml-quant (produced by
 * ggml's quantize_row_*_ref and dequantize_row_*). The vector directory is
 * $KVR_VECTORS, else ../shared/vectors relative to the repository root (found
 * from the working directory or from the test binary's path). Every ISA's
 * kernels (scalar, AVX2, AVX-512 where the CPU has them) are checked against
 * the vectors, and the SIMD kernels against the scalar reference byte for
 * byte on random and adversarial blocks.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <limits.h>

#include "cache/codec.h"
#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_codec.h"

static char vec_dir[PATH_MAX + 64];

static int dir_has_input(const char *d)
{
    char p[PATH_MAX + 256];
    snprintf(p, sizeof p, "%s/ggml-quant/input.f32", d);
    return access(p, R_OK) == 0;
}

static const char *vectors(void)
{
    if (vec_dir[0]) return vec_dir;
    const char *env = getenv("KVR_VECTORS");
    if (env && *env) {
        snprintf(vec_dir, sizeof vec_dir, "%s", env);
        return vec_dir;
    }
    if (dir_has_input("../shared/vectors")) {
        snprintf(vec_dir, sizeof vec_dir, "../shared/vectors");
        return vec_dir;
    }
    /* Walk up from the binary (build/[check/]tests/x) to a directory with a
     * Makefile: that is the repository root. */
    char exe[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len > 0) {
        exe[len] = 0;
        char *slash;
        while ((slash = strrchr(exe, '/')) != NULL && slash != exe) {
            *slash = 0;
            char mk[PATH_MAX + 16];
            snprintf(mk, sizeof mk, "%s/Makefile", exe);
            if (access(mk, R_OK) == 0) {
                snprintf(vec_dir, sizeof vec_dir, "%s/../shared/vectors", exe);
                return vec_dir;
            }
        }
    }
    snprintf(vec_dir, sizeof vec_dir, "../shared/vectors");
    return vec_dir;
}

static void *load(const char *name, size_t *size)
{
    char p[PATH_MAX + 256];
    snprintf(p, sizeof p, "%s/ggml-quant/%s", vectors(), name);
    FILE *f = fopen(p, "rb");
    cr_assert_not_null(f, "cannot open %s (set KVR_VECTORS)", p);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc((size_t)n);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *size = (size_t)n;
    return buf;
}

struct qcase { kvr_codec_type type; const char *name; size_t block; double rms; };
static const struct qcase cases[] = {
    { KVR_CODEC_Q8_0, "q8_0", 34, 0.0039 },
    { KVR_CODEC_Q4_0, "q4_0", 18, 0.0700 },
    { KVR_CODEC_Q4_1, "q4_1", 20, 0.0601 },
    { KVR_CODEC_Q5_0, "q5_0", 22, 0.0374 },
};

static void check_case_isa(const struct qcase *qc, kvr_isa isa)
{
    size_t nin, nblk, ndq;
    float *x = load("input.f32", &nin);
    char name[64];
    snprintf(name, sizeof name, "%s.blocks", qc->name);
    uint8_t *ref = load(name, &nblk);
    snprintf(name, sizeof name, "%s.dequant.f32", qc->name);
    float *dq = load(name, &ndq);
    size_t n = nin / 4;
    cr_assert_eq(n, 4096);
    kvr_codec c = { .type = qc->type, .isa = isa };
    size_t rb = kvr_codec_row_bytes(&c, n);
    cr_assert_eq(rb, nblk);
    cr_assert_eq(rb, n / 32 * qc->block);

    uint8_t *enc = malloc(rb);
    size_t bad = 0;
    cr_assert_eq(kvr_codec_encode(&c, enc, x, KVR_DTYPE_F32, n, &bad), 0);
    for (size_t b = 0; b < n / 32; b++)
        cr_assert_eq(memcmp(enc + b * qc->block, ref + b * qc->block, qc->block), 0,
                     "%s %s: block %zu differs from ggml", qc->name, kvr_isa_name(isa), b);

    float *y = malloc(n * 4);
    cr_assert_eq(kvr_codec_decode(&c, y, KVR_DTYPE_F32, ref, n), 0);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(memcmp(&y[i], &dq[i], 4), 0, "%s: dequant %zu: %.9g vs ggml %.9g",
                     qc->name, i, (double)y[i], (double)dq[i]);

    double rms = kvr_codec_rel_rms(x, y, KVR_DTYPE_F32, n);
    cr_assert(fabs(rms - qc->rms) < 0.00051, "%s rel rms %.5f vs ggml %.4f", qc->name, rms, qc->rms);

    /* f16 output is the f32 output rounded; bf16 likewise. */
    uint16_t *yh = malloc(n * 2);
    cr_assert_eq(kvr_codec_decode(&c, yh, KVR_DTYPE_F16, ref, n), 0);
    for (size_t i = 0; i < n; i++) {
        float v = dq[i] > 65504.0f ? 65504.0f : dq[i] < -65504.0f ? -65504.0f : dq[i];
        cr_assert_eq(yh[i], kvr_f32_to_f16(v));
    }
    cr_assert_eq(kvr_codec_decode(&c, yh, KVR_DTYPE_BF16, ref, n), 0);
    for (size_t i = 0; i < n; i++) cr_assert_eq(yh[i], kvr_f32_to_bf16(dq[i]));

    /* f16 input encodes exactly like its f32 widening. */
    float *xw = malloc(n * 4);
    uint8_t *enc2 = malloc(rb);
    for (size_t i = 0; i < n; i++) { yh[i] = kvr_f32_to_f16(x[i]); xw[i] = kvr_f16_to_f32(yh[i]); }
    cr_assert_eq(kvr_codec_encode(&c, enc, yh, KVR_DTYPE_F16, n, NULL), 0);
    cr_assert_eq(kvr_codec_encode(&c, enc2, xw, KVR_DTYPE_F32, n, NULL), 0);
    cr_assert_eq(memcmp(enc, enc2, rb), 0);

    free(x); free(ref); free(dq); free(enc); free(y); free(yh); free(xw); free(enc2);
}

static void check_case(const struct qcase *qc)
{
    kvr_isa isas[] = { KVR_ISA_SCALAR, KVR_ISA_AVX2, KVR_ISA_AVX512 };
    for (int i = 0; i < 3; i++)
        if (isas[i] == KVR_ISA_SCALAR || isas[i] <= kvr_isa_best()) check_case_isa(qc, isas[i]);
}

Test(codec_ggml, q8_0_bit_exact) { check_case(&cases[0]); }
Test(codec_ggml, q4_0_bit_exact) { check_case(&cases[1]); }
Test(codec_ggml, q4_1_bit_exact) { check_case(&cases[2]); }
Test(codec_ggml, q5_0_bit_exact) { check_case(&cases[3]); }

Test(codec_ggml, refusals)
{
    float x[64];
    uint8_t enc[128];
    for (int i = 0; i < 64; i++) x[i] = (float)i - 30.0f;
    for (size_t k = 0; k < 12; k++) {
        kvr_isa isa = k < 4 ? KVR_ISA_SCALAR : k < 8 ? KVR_ISA_AVX2 : KVR_ISA_AVX512;
        if (isa > kvr_isa_best()) continue;
        kvr_codec c = { .type = cases[k % 4].type, .isa = isa };
        cr_assert_eq(kvr_codec_encode(&c, enc, x, KVR_DTYPE_F32, 48, NULL), KVR_EUNSUPPORTED);
        cr_assert_eq(kvr_codec_decode(&c, x, KVR_DTYPE_F32, enc, 48), KVR_EUNSUPPORTED);
        x[40] = NAN;
        size_t bad = 0;
        cr_assert_eq(kvr_codec_encode(&c, enc, x, KVR_DTYPE_F32, 64, &bad), KVR_EINVAL);
        cr_assert_eq(bad, 40);
        x[40] = 1e30f;   /* d would overflow f16 */
        bad = 0;
        cr_assert_eq(kvr_codec_encode(&c, enc, x, KVR_DTYPE_F32, 64, &bad), KVR_EINVAL);
        cr_assert_eq(bad, 40);
        x[40] = 10.0f;
    }
    /* A NaN or infinity at every position of a row long enough for the
     * batched kernels (three batches of eight blocks, the AVX-512 encoder's
     * parameters computed one batch ahead, and a tail), f32 and f16 input. */
    enum { NB = 26 * 32 };
    static float xs[NB];
    static uint16_t xh[NB];
    static uint8_t out[NB * 2];
    for (size_t i = 0; i < NB; i++) xs[i] = (float)((int)(i * 37 % 101) - 50) * 0.01f;
    for (size_t k = 0; k < 12; k++) {
        kvr_isa isa = k < 4 ? KVR_ISA_SCALAR : k < 8 ? KVR_ISA_AVX2 : KVR_ISA_AVX512;
        if (isa > kvr_isa_best()) continue;
        kvr_codec c = { .type = cases[k % 4].type, .isa = isa };
        for (size_t pos = 0; pos < NB; pos++) {
            float keep = xs[pos];
            xs[pos] = pos % 3 == 0 ? NAN : pos % 3 == 1 ? INFINITY : -INFINITY;
            for (size_t i = 0; i < NB; i++) xh[i] = kvr_f32_to_f16(xs[i]);
            size_t bad = 0;
            cr_assert_eq(kvr_codec_encode(&c, out, xs, KVR_DTYPE_F32, NB, &bad), KVR_EINVAL,
                         "%s %s pos %zu", cases[k % 4].name, kvr_isa_name(isa), pos);
            cr_assert_eq(bad, pos);
            bad = 0;
            cr_assert_eq(kvr_codec_encode(&c, out, xh, KVR_DTYPE_F16, NB, &bad), KVR_EINVAL,
                         "%s %s f16 pos %zu", cases[k % 4].name, kvr_isa_name(isa), pos);
            cr_assert_eq(bad, pos);
            xs[pos] = keep;
        }
    }
}

Test(codec_ggml, zeros_and_sign_rule)
{
    /* All zeros: d = 0, id = 0, quants at the zero point; decode to zeros. */
    float z[32] = { 0 }, y[32];
    uint8_t enc[34];
    for (size_t k = 0; k < 4; k++) {
        kvr_codec c = { .type = cases[k].type };
        cr_assert_eq(kvr_codec_encode(&c, enc, z, KVR_DTYPE_F32, 32, NULL), 0);
        cr_assert_eq((enc[0] | enc[1] << 8) & 0x7FFF, 0);  /* q4_0/q5_0: d = 0 / -8 = -0 */
        cr_assert_eq(kvr_codec_decode(&c, y, KVR_DTYPE_F32, enc, 32), 0);
        for (int i = 0; i < 32; i++) cr_assert_eq(y[i], 0.0f);
    }
    /* q4_0: the value of largest magnitude keeps its sign in d = max / -8, so
     * it maps exactly to quant 0 whatever its sign, and its negation (the
     * other end of the range) is clamped at quant 15, i.e. 7/8 of it. */
    float x[32];
    for (int i = 0; i < 32; i++) x[i] = 0.25f * (float)(i % 5) - 0.5f;
    kvr_codec q4 = { .type = KVR_CODEC_Q4_0 };
    for (int sgn = -1; sgn <= 1; sgn += 2) {
        x[7] = 8.0f * (float)sgn;
        x[8] = -8.0f * (float)sgn;
        cr_assert_eq(kvr_codec_encode(&q4, enc, x, KVR_DTYPE_F32, 32, NULL), 0);
        cr_assert_eq(kvr_f16_to_f32((uint16_t)(enc[0] | enc[1] << 8)), -(float)sgn);
        cr_assert_eq(enc[2 + 7] & 15, 0);
        cr_assert_eq(enc[2 + 8] & 15, 15);
        cr_assert_eq(kvr_codec_decode(&q4, y, KVR_DTYPE_F32, enc, 32), 0);
        cr_assert_eq(y[7], 8.0f * (float)sgn);
        cr_assert_eq(y[8], -7.0f * (float)sgn);
    }
}

/* ---- SIMD == scalar, byte for byte ---------------------------------------- */

static uint64_t rng = 0x2545f4914f6cdd1dull;
static double urand(void)            /* [0, 1) */
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1p-53;
}

/* n values of the blocks at e decode to the same bytes with sc (scalar)
 * and vc, as f32 (y0, y1) and as f16 (h0, h1). */
static void decode_same(const kvr_codec *sc, const kvr_codec *vc, const uint8_t *e, size_t n,
                        float *y0, float *y1, uint16_t *h0, uint16_t *h1, const char *name,
                        const char *what)
{
    cr_assert_eq(kvr_codec_decode(sc, y0, KVR_DTYPE_F32, e, n), 0);
    cr_assert_eq(kvr_codec_decode(vc, y1, KVR_DTYPE_F32, e, n), 0);
    cr_assert_eq(memcmp(y0, y1, n * 4), 0, "%s %s f32", name, what);
    cr_assert_eq(kvr_codec_decode(sc, h0, KVR_DTYPE_F16, e, n), 0);
    cr_assert_eq(kvr_codec_decode(vc, h1, KVR_DTYPE_F16, e, n), 0);
    cr_assert_eq(memcmp(h0, h1, n * 2), 0, "%s %s f16", name, what);
}

/* Block b of 32 values, of a kind chosen by b: random at several scales,
 * constants, zeros of both signs, ties in magnitude of both signs, a zero as
 * min or max, values near the f16 limit of d, small quants' halfway points. */
static void adversarial_block(float *x, size_t b)
{
    double scale = b % 3 == 0 ? 1.0 : b % 3 == 1 ? 1e-3 : 300.0;
    for (int j = 0; j < 32; j++) x[j] = (float)((urand() * 2.0 - 1.0) * scale);
    switch (b % 14) {
    case 1: for (int j = 0; j < 32; j++) x[j] = 0.0f; break;
    case 2: for (int j = 0; j < 32; j++) x[j] = j % 3 ? -0.0f : 0.0f; break;
    case 3: for (int j = 0; j < 32; j++) x[j] = 1.5f; break;
    case 4: x[3] = 7.0f; x[20] = -7.0f; x[9] = -7.0f; break;          /* ties */
    case 5: x[5] = -9.0f; x[30] = 9.0f; break;
    case 6: for (int j = 0; j < 32; j++) x[j] = fabsf(x[j]); x[11] = 0.0f; break;   /* min 0 */
    case 7: for (int j = 0; j < 32; j++) x[j] = -fabsf(x[j]); x[2] = -0.0f; x[17] = 0.0f; break;
    case 8: for (int j = 0; j < 32; j++) x[j] = (float)(j - 16) * 0.5f; break;  /* halfway */
    case 9: for (int j = 0; j < 32; j++) x[j] = (float)(j % 9) * 0.125f - 0.5f; break;
    case 10: x[0] = 65000.0f; x[1] = -64000.0f; break;                    /* near the f16 range */
    case 11: for (int j = 0; j < 32; j++) x[j] = (float)(urand() * 2.0 - 1.0) * 1e-6f; break;
    case 12: for (int j = 0; j < 32; j++) x[j] = (float)((int)(urand() * 17.0) - 8) * 0.75f; break;
    case 13:   /* amax 127: q8_0's id is 1, so its roundf sees exact halfway points */
        x[0] = 127.0f;
        for (int j = 1; j < 32; j++) {
            float hw = (float)((int)(urand() * 126.0)) + 0.5f;
            hw = j % 3 == 0 ? hw : j % 3 == 1 ? nextafterf(hw, 0.0f) : nextafterf(hw, 200.0f);
            x[j] = j & 4 ? -hw : hw;
        }
        break;
    default: break;
    }
}

Test(codec_ggml, simd_equals_scalar)
{
    size_t nb = 2600, n = nb * 32;
    float *x = malloc(n * 4);
    uint16_t *xh = malloc(n * 2);
    for (size_t b = 0; b < nb; b++) adversarial_block(x + b * 32, b);
    for (size_t i = 0; i < n; i++) xh[i] = kvr_f32_to_f16(x[i]);
    uint8_t *e0 = malloc(n * 2), *e1 = malloc(n * 2);
    float *y0 = malloc(n * 4), *y1 = malloc(n * 4);
    uint16_t *h0 = malloc(n * 2), *h1 = malloc(n * 2);
    kvr_isa isas[] = { KVR_ISA_AVX2, KVR_ISA_AVX512 };
    int compared = 0;
    for (int k = 0; k < 4; k++) {
        kvr_codec sc = { .type = cases[k].type, .isa = KVR_ISA_SCALAR };
        size_t rb = kvr_codec_row_bytes(&sc, n);
        for (int ii = 0; ii < 2; ii++) {
            if (isas[ii] > kvr_isa_best()) continue;
            kvr_codec vc = { .type = cases[k].type, .isa = isas[ii] };
            for (int h = 0; h < 2; h++) {
                const void *src = h ? (const void *)xh : (const void *)x;
                kvr_dtype st = h ? KVR_DTYPE_F16 : KVR_DTYPE_F32;
                int r0 = kvr_codec_encode(&sc, e0, src, st, n, NULL);
                int r1 = kvr_codec_encode(&vc, e1, src, st, n, NULL);
                cr_assert_eq(r0, 0, "%s", cases[k].name);
                cr_assert_eq(r1, 0, "%s", cases[k].name);
                for (size_t b = 0; b < nb; b++)
                    cr_assert_eq(memcmp(e0 + b * cases[k].block, e1 + b * cases[k].block,
                                        cases[k].block), 0, "%s %s %s: block %zu (kind %zu)",
                                 cases[k].name, kvr_isa_name(isas[ii]), h ? "f16" : "f32", b, b % 14);
                decode_same(&sc, &vc, e0, n, y0, y1, h0, h1, cases[k].name, "decode");
                compared++;
            }
            /* random bytes decode the same too (any block is decodable) */
            for (size_t i = 0; i < rb; i++) e0[i] = (uint8_t)(urand() * 256.0);
            for (size_t b = 0; b < nb; b++) {          /* keep d, m finite */
                e0[b * cases[k].block + 1] &= 0x3B;
                if (cases[k].type == KVR_CODEC_Q4_1) e0[b * cases[k].block + 3] &= 0xBB;
            }
            decode_same(&sc, &vc, e0, n, y0, y1, h0, h1, cases[k].name,
                        "decode of random blocks");
        }
    }
    cr_log_info("%d encode/decode comparisons of %zu blocks", compared, nb);
    free(x); free(xh); free(e0); free(e1); free(y0); free(y1); free(h0); free(h1);
}

/* Decoding arbitrary bytes (any f16 scale and min: zeros, subnormals, the
 * largest, infinities, NaNs; any quants): every SIMD decoder writes the
 * scalar decoder's f32 and f16 bytes, at lengths around its batches; a NaN
 * is matched by a NaN (the payload a sum of two NaNs keeps is the compiler's
 * operand order, which differs between builds of the scalar code);
 * kvr_codec_decode_stream writes the same values, aligned or not. */
Test(codec_ggml, decode_random_bytes_simd_equals_scalar)
{
    static const uint16_t scales[] = { 0x0000, 0x8000, 0x0001, 0x83ff, 0x0400, 0x3c00,
                                       0xbc00, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00,
                                       0x7c01, 0xfe00, 0x5800, 0x1234 };
    size_t nb = 777, n = nb * 32;
    uint8_t *src = malloc(nb * 34);
    float *y0 = malloc(n * 4), *y1 = malloc(n * 4);
    uint16_t *h0 = malloc(n * 2), *h1 = malloc(n * 2);
    uint8_t *ba = aligned_alloc(64, n * 4 + 64);
    uint64_t st = 0x9e3779b97f4a7c15ull;
    for (int k = 0; k < 4; k++) {
        size_t bb = cases[k].block;
        for (size_t i = 0; i < nb * bb; i++) {
            st ^= st << 13; st ^= st >> 7; st ^= st << 17;
            src[i] = (uint8_t)(st >> 24);
        }
        /* half the blocks get a special scale (and Q4_1 min) */
        for (size_t b = 0; b < nb; b += 2) {
            uint16_t d = scales[(b / 2) % 16], m = scales[(b / 2 + 5) % 16];
            src[b * bb] = (uint8_t)d;
            src[b * bb + 1] = (uint8_t)(d >> 8);
            if (cases[k].type == KVR_CODEC_Q4_1) {
                src[b * bb + 2] = (uint8_t)m;
                src[b * bb + 3] = (uint8_t)(m >> 8);
            }
        }
        size_t lens[] = { 32, 64, 96, 256, 288, n };
        kvr_codec sc = { .type = cases[k].type, .isa = KVR_ISA_SCALAR };
        for (int isa = KVR_ISA_AVX2; isa <= KVR_ISA_AVX512; isa++) {
            if ((kvr_isa)isa > kvr_isa_best()) continue;
            kvr_codec vc = { .type = cases[k].type, .isa = (kvr_isa)isa };
            for (size_t li = 0; li < sizeof lens / sizeof *lens; li++) {
                size_t len = lens[li];
                memset(y1, 0xa5, len * 4);
                memset(h1, 0xa5, len * 2);
                cr_assert_eq(kvr_codec_decode(&sc, y0, KVR_DTYPE_F32, src, len), 0);
                cr_assert_eq(kvr_codec_decode(&vc, y1, KVR_DTYPE_F32, src, len), 0);
                for (size_t i = 0; i < len; i++)
                    cr_assert(kvt_same_f32(y0[i], y1[i]), "%s %s f32 elem %zu: %a vs %a",
                              cases[k].name, kvr_isa_name((kvr_isa)isa), i, (double)y1[i],
                              (double)y0[i]);
                cr_assert_eq(kvr_codec_decode(&sc, h0, KVR_DTYPE_F16, src, len), 0);
                cr_assert_eq(kvr_codec_decode(&vc, h1, KVR_DTYPE_F16, src, len), 0);
                for (size_t i = 0; i < len; i++)
                    cr_assert(kvt_same_f16(h0[i], h1[i]), "%s %s f16 elem %zu: %04x vs %04x",
                              cases[k].name, kvr_isa_name((kvr_isa)isa), i, h1[i], h0[i]);
                /* streamed (non-temporal stores where dst is on 64 bytes,
                 * else ordinary ones): the same values */
                char what[64];
                snprintf(what, sizeof what, "%s %s", cases[k].name, kvr_isa_name((kvr_isa)isa));
                kvt_decode_stream_check(&vc, src, len, y0, h0, ba, n * 4 + 64, what);
            }
        }
    }
    free(src); free(y0); free(y1); free(h0); free(h1); free(ba);
}

/* kvr_codec_encode_measured for the ggml codecs: the bytes of the scalar
 * encoder, and for each row the doubles of its blocks decoded and measured
 * by the definition (kvt_err_row_def), on the adversarial blocks (blocks
 * the SIMD encoder leaves to the scalar one included), f32 and f16 input,
 * rows of one block to past two blocks of the measure, more than 64 rows;
 * a value no codec takes, in the last row (past the first batch of 64 in
 * the 70-row case), gets kvr_codec_encode's error and index; no byte past
 * the rows is written. 1 only where no kernel does it. */
Test(codec_ggml, encode_measured_same_bytes_and_doubles)
{
    static const size_t lens[] = { 32, 96, 256, 288, 1024, 1056, 2080 };
    static const size_t rows[] = { 1, 3, 5, 70 };
    size_t nmax = 70 * 2080;
    float *x = malloc(nmax * 4), *dec = malloc(2080 * 4), *scratch = malloc(2080 * 4);
    uint16_t *xh = malloc(nmax * 2);
    float *xf = malloc(nmax * 4);
    uint8_t *e0 = malloc(nmax * 2), *e1 = malloc(nmax * 2 + 8);
    long ran = 0, refused = 0;
    for (size_t nb = 0; nb < nmax / 32; nb++) adversarial_block(x + nb * 32, nb * 7 + 3);
    for (size_t i = 0; i < nmax; i++) {
        xh[i] = kvr_f32_to_f16(x[i]);
        xf[i] = kvr_f16_to_f32(xh[i]);
    }
    for (int k = 0; k < 4; k++)
        for (size_t li = 0; li < sizeof lens / sizeof *lens; li++)
            for (size_t ri = 0; ri < sizeof rows / sizeof *rows; ri++)
                for (int h = 0; h < 2; h++)
                    for (int bad = 0; bad < 2; bad++) {
                        size_t len = lens[li], nr = rows[ri], n = nr * len;
                        if (n > nmax || (nr == 70 && len > 256)) continue;
                        size_t at = (len * (nr - 1) + 37) % n;   /* the last row */
                        float keep = x[at];
                        uint16_t keeph = xh[at];
                        if (bad) {
                            x[at] = NAN;
                            xh[at] = 0x7e00;
                        }
                        const void *src = h ? (const void *)xh : (const void *)x;
                        const float *r32 = h ? xf : x;
                        kvr_dtype st = h ? KVR_DTYPE_F16 : KVR_DTYPE_F32;
                        kvr_codec sc = { .type = cases[k].type, .isa = KVR_ISA_SCALAR };
                        size_t rb = kvr_codec_row_bytes(&sc, len), b0 = SIZE_MAX, b1 = SIZE_MAX;
                        int rc0 = kvr_codec_encode(&sc, e0, src, st, n, &b0);
                        cr_assert_eq(rc0 != 0, bad);
                        double q0[70], s0[70], q1[70], s1[70];
                        for (size_t r = 0; r < nr && !bad; r++) {
                            kvr_codec_decode(&sc, dec, KVR_DTYPE_F32, e0 + r * rb, len);
                            kvt_err_row_def(r32 + r * len, dec, len, &s0[r], &q0[r]);
                        }
                        for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
                            kvr_codec vc = { .type = cases[k].type, .isa = (kvr_isa)isa };
                            memset(e1, 0xa5, nr * rb + 8);
                            int rc = kvr_codec_encode_measured(&vc, e1, src, st, nr, len,
                                                               scratch, s1, q1, &b1);
                            if (rc == 1) {
                                cr_assert(isa != KVR_ISA_AVX512 || kvr_isa_best() < KVR_ISA_AVX512,
                                          "%s: the AVX-512 kernel refused", cases[k].name);
                                continue;
                            }
                            if (bad) {
                                cr_assert_eq(rc, rc0);
                                cr_assert_eq(b1, b0, "%s: bad at %zu named %zu, encode %zu",
                                             cases[k].name, at, b1, b0);
                                refused++;
                                continue;
                            }
                            ran++;
                            cr_assert_eq(rc, 0);
                            cr_assert(!memcmp(e0, e1, nr * rb), "%s len %zu rows %zu f16 %d: "
                                      "other bytes", cases[k].name, len, nr, h);
                            cr_assert_eq(e1[nr * rb], 0xa5, "wrote past the rows");
                            cr_assert(!memcmp(s0, s1, nr * sizeof *s0) &&
                                      !memcmp(q0, q1, nr * sizeof *q0),
                                      "%s len %zu rows %zu f16 %d: e %.17g vs %.17g, q %.17g vs "
                                      "%.17g", cases[k].name, len, nr, h, s1[0], s0[0], q1[0],
                                      q0[0]);
                        }
                        x[at] = keep;
                        xh[at] = keeph;
                    }
    cr_log_info("best ISA %s: %ld encoded and measured in one pass, %ld refused",
                kvr_isa_name(kvr_isa_best()), ran, refused);
    if (kvr_isa_best() >= KVR_ISA_AVX512)
        cr_assert(ran > 0 && refused > 0);
    free(x); free(dec); free(scratch); free(xh); free(xf); free(e0); free(e1);
}
