/*
 * test_codec_ggml.c — ggml's q8_0 / q4_0 / q4_1 / q5_0 blocks, bit for bit
 * against the reference vectors in shared/vectors/ggml-quant (produced by
 * ggml's quantize_row_*_ref and dequantize_row_*). The vector directory is
 * $KVR_VECTORS, else ../shared/vectors relative to the repository root (found
 * from the working directory or from the test binary's path).
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

static void check_case(const struct qcase *qc)
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
    kvr_codec c = { .type = qc->type };
    size_t rb = kvr_codec_row_bytes(&c, n);
    cr_assert_eq(rb, nblk);
    cr_assert_eq(rb, n / 32 * qc->block);

    uint8_t *enc = malloc(rb);
    size_t bad = 0;
    cr_assert_eq(kvr_codec_encode(&c, enc, x, KVR_DTYPE_F32, n, &bad), 0);
    for (size_t b = 0; b < n / 32; b++)
        cr_assert_eq(memcmp(enc + b * qc->block, ref + b * qc->block, qc->block), 0,
                     "%s: block %zu differs from ggml", qc->name, b);

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

Test(codec_ggml, q8_0_bit_exact) { check_case(&cases[0]); }
Test(codec_ggml, q4_0_bit_exact) { check_case(&cases[1]); }
Test(codec_ggml, q4_1_bit_exact) { check_case(&cases[2]); }
Test(codec_ggml, q5_0_bit_exact) { check_case(&cases[3]); }

Test(codec_ggml, refusals)
{
    float x[64];
    uint8_t enc[128];
    for (int i = 0; i < 64; i++) x[i] = (float)i - 30.0f;
    for (size_t k = 0; k < 4; k++) {
        kvr_codec c = { .type = cases[k].type };
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
