/*
 * test_rope_props.c — properties of the engine that hold for any input:
 * identities of reposition, norm preservation (a re-applied YaRN magnitude
 * would break it), reposition == apply(remove), SIMD == scalar to within one
 * ulp of the output format for every dtype pair and ISA, large positions
 * against a long-double computation, length-dependent tables (dynamic NTK,
 * longrope) against a direct computation, thread-count independence, and the
 * element conversions.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>

#include "rope/rope.h"
#include "rope/rope_internal.h"
#include "tests/common/kvt_vectors.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void)            /* [-1, 1) */
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1p-52 - 1.0;
}

static void fill(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) x[i] = (float)(urand() * 2.0);
}

static kvr_rope *make(int head_dim, int rot, kvr_rope_style style, double theta,
                      kvr_rope_scaling sc, double factor)
{
    kvr_rope_config c;
    kvr_rope_config_init(&c);
    c.head_dim = head_dim;
    c.rotary_dim = rot;
    c.style = style;
    c.theta = theta;
    c.scaling = sc;
    c.factor = factor;
    c.max_position_embeddings = 4096;
    if (sc == KVR_ROPE_SCALING_YARN) c.original_max_position_embeddings = 4096;
    if (sc == KVR_ROPE_SCALING_LLAMA3) {
        c.original_max_position_embeddings = 8192;
        c.low_freq_factor = 1.0;
        c.high_freq_factor = 4.0;
    }
    kvr_rope *r = kvt_rope_new(&c);
    return r;
}

static double row_norm(const float *x, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
    return sqrt(s);
}

/* Row by row (rows of D), got is within tol times the norm of norm_of's
 * row of ref. */
static void rows_close(const float *got, const float *ref, const float *norm_of, size_t rows,
                       size_t D, double tol, const char *what)
{
    for (size_t row = 0; row < rows; row++) {
        double nrm = row_norm(norm_of + row * D, D);
        for (size_t j = 0; j < D; j++)
            cr_assert_leq(fabs((double)got[row * D + j] - (double)ref[row * D + j]), tol * nrm,
                          "%s: row %zu dim %zu", what, row, j);
    }
}

/* An engine and T x H rows of D random floats (x) with two position
 * arrays (a, b) for the caller to fill. */
typedef struct fixture {
    kvr_rope *r;
    size_t T, H, D, n;
    float *x;
    int64_t *a, *b;
} fixture;

static void fx_init(fixture *f, kvr_rope *r, size_t T, size_t H, size_t D)
{
    *f = (fixture){ .r = r, .T = T, .H = H, .D = D, .n = T * H * D };
    f->x = malloc(f->n * 4);
    f->a = malloc(T * 8);
    f->b = malloc(T * 8);
    cr_assert(f->x && f->a && f->b);
    fill(f->x, f->n);
}

static void fx_free(fixture *f)
{
    free(f->x);
    free(f->a);
    free(f->b);
    kvr_rope_destroy(f->r);
}

Test(rope_props, reposition_zero_is_identity)
{
    kvr_rope_style styles[] = { KVR_ROPE_NEOX, KVR_ROPE_GPTJ };
    for (int s = 0; s < 2; s++) {
        kvr_rope *r = make(128, 96, styles[s], 10000, KVR_ROPE_SCALING_YARN, 4.0);
        size_t T = 70, H = 3, n = T * H * 128;
        float *x = malloc(n * 4), *y = malloc(n * 4);
        int64_t *p = malloc(T * 8);
        fill(x, n);
        for (size_t t = 0; t < T; t++) p[t] = (int64_t)(t * 7) - 100;
        cr_assert_eq(kvr_rope_reposition(r, y, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, p, p, NULL), 0);
        cr_assert_eq(memcmp(x, y, n * 4), 0, "reposition by 0 changed the data");
        free(x); free(y); free(p);
        kvr_rope_destroy(r);
    }
}

Test(rope_props, reposition_there_and_back)
{
    fixture f;
    fx_init(&f, make(128, 128, KVR_ROPE_NEOX, 500000, KVR_ROPE_SCALING_LLAMA3, 8.0), 100, 2, 128);
    kvr_rope *r = f.r;
    size_t T = f.T, H = f.H, D = f.D, n = f.n;
    float *x = f.x, *y = malloc(n * 4), *z = malloc(n * 4);
    int64_t *a = f.a, *b = f.b;
    for (size_t t = 0; t < T; t++) { a[t] = (int64_t)t * 3; b[t] = a[t] + (t < 50 ? 1000 : -77); }
    kvr_rope_reposition(r, y, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, a, b, NULL);
    kvr_rope_reposition(r, z, KVR_DTYPE_F32, y, KVR_DTYPE_F32, T, H, b, a, NULL);
    rows_close(z, x, x, T * H, D, 4e-7, "there and back");
    /* and in f16: there and back stays within two f16 roundings */
    uint16_t *h = malloc(n * 2);
    kvr_convert(h, KVR_DTYPE_F16, x, KVR_DTYPE_F32, n);
    kvr_convert(y, KVR_DTYPE_F32, h, KVR_DTYPE_F16, n);
    kvr_rope_reposition(r, h, KVR_DTYPE_F16, h, KVR_DTYPE_F16, T, H, a, b, NULL);
    kvr_rope_reposition(r, h, KVR_DTYPE_F16, h, KVR_DTYPE_F16, T, H, b, a, NULL);
    kvr_convert(z, KVR_DTYPE_F32, h, KVR_DTYPE_F16, n);
    rows_close(z, y, y, T * H, D, 4 * 0x1p-11, "there and back in f16");
    free(h); free(y); free(z);
    fx_free(&f);
}

Test(rope_props, reposition_preserves_norm_yarn)
{
    fixture f;
    fx_init(&f, make(64, 64, KVR_ROPE_GPTJ, 10000, KVR_ROPE_SCALING_YARN, 16.0), 64, 4, 64);
    float *k = malloc(f.n * 4), *k2 = malloc(f.n * 4);
    for (size_t t = 0; t < f.T; t++) {
        f.a[t] = (int64_t)t;
        f.b[t] = (int64_t)t + 12345;
    }
    kvr_rope_apply(f.r, k, KVR_DTYPE_F32, f.x, KVR_DTYPE_F32, f.T, f.H, f.a, NULL);
    kvr_rope_reposition(f.r, k2, KVR_DTYPE_F32, k, KVR_DTYPE_F32, f.T, f.H, f.a, f.b, NULL);
    double ms = 0.1 * log(16.0) + 1.0;
    for (size_t row = 0; row < f.T * f.H; row++) {
        double n0 = row_norm(f.x + row * f.D, f.D), n1 = row_norm(k + row * f.D, f.D),
               n2 = row_norm(k2 + row * f.D, f.D);
        cr_assert_float_eq(n1 / n0, ms, 1e-5, "apply must scale by attention_factor");
        cr_assert_float_eq(n2 / n1, 1.0, 1e-5, "reposition must not touch the magnitude");
    }
    free(k); free(k2);
    fx_free(&f);
}

Test(rope_props, reposition_equals_apply_of_remove)
{
    kvr_rope_scaling scs[] = { KVR_ROPE_SCALING_DEFAULT, KVR_ROPE_SCALING_LINEAR,
                               KVR_ROPE_SCALING_YARN, KVR_ROPE_SCALING_LLAMA3 };
    for (int s = 0; s < 4; s++) {
        fixture f;
        fx_init(&f, make(128, 128, s % 2 ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX, 10000, scs[s], 4.0),
                90, 2, 128);
        kvr_rope *r = f.r;
        size_t T = f.T, H = f.H, D = f.D, n = f.n;
        float *k = f.x, *u = malloc(n * 4), *ref = malloc(n * 4), *got = malloc(n * 4);
        int64_t *a = f.a, *b = f.b;
        for (size_t t = 0; t < T; t++) {
            a[t] = (int64_t)(urand() * 5000.0) + 5000;
            b[t] = t % 3 == 0 ? a[t] : (int64_t)(urand() * 5000.0) + 5000; /* repeated, negative */
        }
        kvr_rope_remove(r, u, KVR_DTYPE_F32, k, KVR_DTYPE_F32, T, H, a, NULL);
        kvr_rope_apply(r, ref, KVR_DTYPE_F32, u, KVR_DTYPE_F32, T, H, b, NULL);
        kvr_rope_reposition(r, got, KVR_DTYPE_F32, k, KVR_DTYPE_F32, T, H, a, b, NULL);
        char what[32];
        snprintf(what, sizeof what, "scaling %d", s);
        rows_close(got, ref, k, T * H, D, 1e-6, what);
        free(u); free(ref); free(got);
        fx_free(&f);
    }
}

/* ---- SIMD vs scalar --------------------------------------------------------- */

static double ulp_of(double mag, kvr_dtype t)
{
    int e;
    if (mag == 0.0) mag = 1e-30;
    frexp(mag, &e);                     /* mag in [2^(e-1), 2^e) */
    int mbits = t == KVR_DTYPE_F32 ? 23 : t == KVR_DTYPE_F16 ? 10 : 7;
    if (t == KVR_DTYPE_F16 && e - 1 < -14) e = -13;   /* subnormal spacing */
    return ldexp(1.0, e - 1 - mbits);
}

static void simd_vs_scalar(int hd, int rot, kvr_rope_style style, int op)
{
    kvr_rope *r = make(hd, rot, style, 10000, KVR_ROPE_SCALING_YARN, 4.0);
    size_t T = 67, H = 3, n = T * H * (size_t)hd;
    float *x = malloc(n * 4);
    fill(x, n);
    int64_t *a = malloc(T * 8), *b = malloc(T * 8);
    for (size_t t = 0; t < T; t++) {
        a[t] = t < 40 ? (int64_t)t : (int64_t)(urand() * 1e5);
        b[t] = t < 20 ? a[t] + 17 : a[t] - 1000 - (int64_t)t;
    }
    kvr_dtype ts[] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
    kvr_isa isas[] = { KVR_ISA_AVX2, KVR_ISA_AVX512 };
    void *in = malloc(n * 4), *o_ref = malloc(n * 4), *o = malloc(n * 4);
    float *fr = malloc(n * 4), *fo = malloc(n * 4);
    for (int si = 0; si < 3; si++) for (int di = 0; di < 3; di++) {
        kvr_convert(in, ts[si], x, KVR_DTYPE_F32, n);
        for (int k = 0; k < 3; k++) {
            kvr_isa isa = k == 0 ? KVR_ISA_SCALAR : isas[k - 1];
            if (isa > kvr_isa_best()) continue;
            kvr_rope_opts opt = { .isa = isa, .n_threads = 1 };
            void *dst = k == 0 ? o_ref : o;
            int rc = op == 0 ? kvr_rope_apply(r, dst, ts[di], in, ts[si], T, H, a, &opt)
                   : op == 1 ? kvr_rope_remove(r, dst, ts[di], in, ts[si], T, H, a, &opt)
                   : kvr_rope_reposition(r, dst, ts[di], in, ts[si], T, H, a, b, &opt);
            cr_assert_eq(rc, 0);
            if (k == 0) { kvr_convert(fr, KVR_DTYPE_F32, o_ref, ts[di], n); continue; }
            kvr_convert(fo, KVR_DTYPE_F32, o, ts[di], n);
            for (size_t e = 0; e < n; e++) {
                double d = fabs((double)fo[e] - (double)fr[e]);
                cr_assert_leq(d, ulp_of(fabs((double)fr[e]), ts[di]),
                              "%s %s->%s op %d hd %d rot %d style %d: element %zu %g vs %g",
                              kvr_isa_name(isa), kvr_dtype_name(ts[si]), kvr_dtype_name(ts[di]),
                              op, hd, rot, (int)style, e, (double)fo[e], (double)fr[e]);
            }
        }
    }
    free(in); free(o_ref); free(o); free(fr); free(fo); free(x); free(a); free(b);
    kvr_rope_destroy(r);
}

Test(rope_props, simd_equals_scalar)
{
    cr_log_info("best ISA: %s", kvr_isa_name(kvr_isa_best()));
    int shapes[][2] = { { 128, 128 }, { 128, 64 }, { 80, 80 }, { 40, 24 }, { 256, 64 }, { 6, 2 } };
    for (int s = 0; s < 6; s++)
        for (int st = 0; st < 2; st++)
            for (int op = 0; op < 3; op++)
                simd_vs_scalar(shapes[s][0], shapes[s][1], st ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX, op);
}

/* The per-token sin/cos tables of every ISA are the scalar reference's bits:
 * angles of every size (the fast reduction, the libm fallback beyond it, NaN
 * free), both forms (a*f1 and a*f1 + b*f2), every table length 1..67 (the
 * vector tails). */
Test(rope_props, sincos_tables_bit_identical_across_isas)
{
    double f1[KVR_ROPE_MAX_HEAD_DIM / 2], f2[KVR_ROPE_MAX_HEAD_DIM / 2];
    double s0[KVR_ROPE_MAX_HEAD_DIM / 2], c0[KVR_ROPE_MAX_HEAD_DIM / 2];
    double s1[KVR_ROPE_MAX_HEAD_DIM / 2], c1[KVR_ROPE_MAX_HEAD_DIM / 2];
    int n_all = KVR_ROPE_MAX_HEAD_DIM / 2;
    for (int i = 0; i < n_all; i++) {
        f1[i] = 1.0 / pow(10000.0, (double)(2 * i) / 128.0);
        f2[i] = -f1[i] * (1.0 + 0.25 * (double)(i % 3));
    }
    rope_sincos_fn fns[] = { kvr__rope_sincos_avx2, kvr__rope_sincos_avx512 };
    kvr_isa isas[] = { KVR_ISA_AVX2, KVR_ISA_AVX512 };
    long checked = 0;
    for (int k = 0; k < 2; k++) {
        if (isas[k] > kvr_isa_best()) continue;
        for (int trial = 0; trial < 3000; trial++) {
            int n = trial < 67 ? trial + 1 : (trial % 7 == 0 ? n_all : 64);
            double mag = trial % 5 == 0 ? 1e7 : trial % 5 == 1 ? 1e3 : 1e6;
            double a = floor((urand() + 1.0) * mag) * (trial & 1 ? -1.0 : 1.0);
            double b = floor((urand() + 1.0) * mag);
            const double *g = trial % 3 == 0 ? NULL : f2;
            kvr__rope_sincos_scalar(a, f1, b, g, n, s0, c0);
            fns[k](a, f1, b, g, n, s1, c1);
            cr_assert(!memcmp(s0, s1, sizeof(double) * (size_t)n) &&
                      !memcmp(c0, c1, sizeof(double) * (size_t)n),
                      "%s: a %.17g b %.17g n %d f2 %d", kvr_isa_name(isas[k]), a, b, n, g != NULL);
            checked++;
            /* and their float forms, both layouts, a magnitude or none */
            rope_tofloat_fn tf[] = { kvr__rope_tofloat_avx2, kvr__rope_tofloat_avx512 };
            float fc0[KVR_ROPE_MAX_HEAD_DIM], fs0[KVR_ROPE_MAX_HEAD_DIM];
            float fc1[KVR_ROPE_MAX_HEAD_DIM], fs1[KVR_ROPE_MAX_HEAD_DIM];
            double m = trial & 2 ? 1.0 : 1.0 / 1.1;
            int gptj = (trial >> 2) & 1, w = gptj ? 2 * n : n;
            kvr__rope_tofloat_scalar(c0, s0, n, m, gptj, fc0, fs0);
            tf[k](c0, s0, n, m, gptj, fc1, fs1);
            cr_assert(!memcmp(fc0, fc1, sizeof(float) * (size_t)w) &&
                      !memcmp(fs0, fs1, sizeof(float) * (size_t)w),
                      "%s tofloat n %d gptj %d", kvr_isa_name(isas[k]), n, gptj);
            if (isas[k] == KVR_ISA_AVX512) {
                /* the fused table: both forms at once, the same bits */
                kvr__rope_table_avx512(a, f1, b, g, n, m, gptj, s1, c1, fs1, fc1);
                cr_assert(!memcmp(s0, s1, sizeof(double) * (size_t)n) &&
                          !memcmp(c0, c1, sizeof(double) * (size_t)n) &&
                          !memcmp(fc0, fc1, sizeof(float) * (size_t)w) &&
                          !memcmp(fs0, fs1, sizeof(float) * (size_t)w),
                          "fused table n %d gptj %d a %.17g", n, gptj, a);
            }
        }
    }
    cr_log_info("%ld tables compared", checked);
}

/* Reposition with a different delta per token: every ISA's output bytes are
 * the scalar path's, for each dtype. */
Test(rope_props, distinct_deltas_bit_identical_across_isas)
{
    kvr_rope *r = make(128, 128, KVR_ROPE_NEOX, 500000, KVR_ROPE_SCALING_DEFAULT, 1.0);
    size_t T = 301, H = 4, n = T * H * 128;
    float *x = malloc(n * 4);
    fill(x, n);
    int64_t *from = malloc(T * 8), *to = malloc(T * 8);
    for (size_t t = 0; t < T; t++) {
        from[t] = (int64_t)t;
        to[t] = (int64_t)((urand() + 1.0) * (t % 11 == 0 ? 3e6 : 5e5));
    }
    kvr_dtype ts[] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
    void *in = malloc(n * 4), *ref = malloc(n * 4), *o = malloc(n * 4);
    for (int d = 0; d < 3; d++) {
        size_t bytes = n * kvr_dtype_size(ts[d]);
        kvr_convert(in, ts[d], x, KVR_DTYPE_F32, n);
        kvr_rope_opts so = { .isa = KVR_ISA_SCALAR, .n_threads = 1 };
        cr_assert_eq(kvr_rope_reposition(r, ref, ts[d], in, ts[d], T, H, from, to, &so), 0);
        kvr_isa isas[] = { KVR_ISA_AVX2, KVR_ISA_AVX512 };
        for (int k = 0; k < 2; k++) {
            if (isas[k] > kvr_isa_best()) continue;
            kvr_rope_opts vo = { .isa = isas[k], .n_threads = 2 };
            cr_assert_eq(kvr_rope_reposition(r, o, ts[d], in, ts[d], T, H, from, to, &vo), 0);
            cr_assert(!memcmp(ref, o, bytes), "%s %s", kvr_isa_name(isas[k]), kvr_dtype_name(ts[d]));
        }
    }
    free(x); free(from); free(to); free(in); free(ref); free(o);
    kvr_rope_destroy(r);
}

/* Contiguous positions and runs of one delta (the recurrence and the
 * repeated table): every ISA and every thread count gives the scalar
 * single-thread bytes, for apply, remove and reposition, at positions where
 * the recurrence's last bits matter (large, 1e5..1e6). */
Test(rope_props, runs_bit_identical_across_isas_and_threads)
{
    fixture f;
    fx_init(&f, make(128, 128, KVR_ROPE_NEOX, 500000, KVR_ROPE_SCALING_YARN, 4.0), 1000, 2, 128);
    kvr_rope *r = f.r;
    size_t T = f.T, H = f.H, n = f.n;
    float *x = f.x;
    int64_t *from = f.a, *to = f.b;
    for (size_t t = 0; t < T; t++) {
        from[t] = 100000 + (int64_t)t * 7;
        to[t] = t < 333 ? from[t] + 250000 : t < 700 ? from[t] - 3 : 900000 + (int64_t)(t / 5);
    }
    kvr_dtype ts[] = { KVR_DTYPE_F32, KVR_DTYPE_F16 };
    void *in = malloc(n * 4), *ref = malloc(n * 4), *o = malloc(n * 4);
    long compared = 0;
    for (int d = 0; d < 2; d++)
        for (int op = 0; op < 3; op++) {
            size_t bytes = n * kvr_dtype_size(ts[d]);
            kvr_convert(in, ts[d], x, KVR_DTYPE_F32, n);
            kvr_rope_opts so = { .isa = KVR_ISA_SCALAR, .n_threads = 1 };
            int rc = op == 0 ? kvr_rope_apply(r, ref, ts[d], in, ts[d], T, H, to, &so)
                   : op == 1 ? kvr_rope_remove(r, ref, ts[d], in, ts[d], T, H, from, &so)
                   : kvr_rope_reposition(r, ref, ts[d], in, ts[d], T, H, from, to, &so);
            cr_assert_eq(rc, 0);
            kvr_isa isas[] = { KVR_ISA_SCALAR, KVR_ISA_AVX2, KVR_ISA_AVX512 };
            for (int k = 0; k < 3; k++)
                for (int nt = 1; nt <= 3; nt++) {
                    if (isas[k] > kvr_isa_best() || (k == 0 && nt == 1)) continue;
                    kvr_rope_opts vo = { .isa = isas[k], .n_threads = nt };
                    rc = op == 0 ? kvr_rope_apply(r, o, ts[d], in, ts[d], T, H, to, &vo)
                       : op == 1 ? kvr_rope_remove(r, o, ts[d], in, ts[d], T, H, from, &vo)
                       : kvr_rope_reposition(r, o, ts[d], in, ts[d], T, H, from, to, &vo);
                    cr_assert_eq(rc, 0);
                    cr_assert(!memcmp(ref, o, bytes), "%s threads %d op %d %s",
                              kvr_isa_name(isas[k]), nt, op, kvr_dtype_name(ts[d]));
                    compared++;
                }
        }
    cr_assert_gt(compared, 0);
    free(in); free(ref); free(o);
    fx_free(&f);
}

/* kvr_rope_apply_src (rows on demand) writes kvr_rope_apply's bytes for
 * the same f32 source, every ISA and output type, NEOX / GPT-J / partial
 * rotary, contiguous and scattered positions; both streamed
 * (kvr_rope_opts.stream) too, aligned or not. */
typedef struct src_rows { const float *x; size_t row; size_t next; int bad; } src_rows;
static const float *rows_of(void *ud, size_t t)
{
    src_rows *s = ud;
    if (t != s->next) s->bad = 1;   /* asked in token order */
    s->next = t + 1;
    return s->x + t * s->row;
}

Test(rope_props, apply_src_equals_apply)
{
    int shapes[][2] = { { 128, 128 }, { 128, 64 }, { 80, 80 }, { 6, 2 } };
    for (int sh = 0; sh < 4; sh++)
        for (int st = 0; st < 2; st++) {
            kvr_rope *r = make(shapes[sh][0], shapes[sh][1], st ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX,
                               500000, KVR_ROPE_SCALING_YARN, 4.0);
            size_t T = 131, H = 3, row = H * (size_t)shapes[sh][0], n = T * row;
            float *x = malloc(n * 4);
            fill(x, n);
            int64_t *pos = malloc(T * 8);
            for (size_t t = 0; t < T; t++)
                pos[t] = t < 70 ? 1000 + (int64_t)t : (int64_t)(urand() * 1e5);
            void *ref = malloc(n * 4), *o = malloc(n * 4);
            void *oa = aligned_alloc(64, (n * 4 + 32 + 63) / 64 * 64);
            kvr_dtype ts[] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
            kvr_isa isas[] = { KVR_ISA_SCALAR, KVR_ISA_AVX2, KVR_ISA_AVX512 };
            for (int d = 0; d < 3; d++)
                for (int k = 0; k < 3; k++) {
                    if (isas[k] > kvr_isa_best()) continue;
                    kvr_rope_opts op = { .isa = isas[k] };
                    cr_assert_eq(kvr_rope_apply(r, ref, ts[d], x, KVR_DTYPE_F32, T, H, pos, &op), 0);
                    src_rows sr = { x, row, 0, 0 };
                    cr_assert_eq(kvr_rope_apply_src(r, o, ts[d], rows_of, &sr, T, H, pos, &op), 0);
                    cr_assert(!sr.bad && sr.next == T);
                    cr_assert(!memcmp(ref, o, n * kvr_dtype_size(ts[d])), "shape %d style %d %s %s",
                              sh, st, kvr_isa_name(isas[k]), kvr_dtype_name(ts[d]));
                    /* streamed (non-temporal stores where the ISA and the
                     * alignment allow): the same bytes, into a buffer on 64
                     * bytes and one 32 bytes off */
                    for (size_t off = 0; off <= 32; off += 32) {
                        kvr_rope_opts so = op;
                        so.stream = true;
                        uint8_t *ob = (uint8_t *)oa + off;
                        memset(ob, 0xEE, n * 4);
                        cr_assert_eq(kvr_rope_apply(r, ob, ts[d], x, KVR_DTYPE_F32, T, H, pos, &so), 0);
                        cr_assert(!memcmp(ref, ob, n * kvr_dtype_size(ts[d])), "stream apply shape %d "
                                  "style %d %s %s off %zu", sh, st, kvr_isa_name(isas[k]),
                                  kvr_dtype_name(ts[d]), off);
                        memset(ob, 0xEE, n * 4);
                        src_rows sr2 = { x, row, 0, 0 };
                        cr_assert_eq(kvr_rope_apply_src(r, ob, ts[d], rows_of, &sr2, T, H, pos, &so), 0);
                        cr_assert(!memcmp(ref, ob, n * kvr_dtype_size(ts[d])), "stream apply_src "
                                  "shape %d style %d %s %s off %zu", sh, st, kvr_isa_name(isas[k]),
                                  kvr_dtype_name(ts[d]), off);
                    }
                }
            free(x); free(pos); free(ref); free(o); free(oa);
            kvr_rope_destroy(r);
        }
}

/* ---- precision at large positions ------------------------------------------ */

Test(rope_props, theta_1e6_large_positions_long_double)
{
    kvr_rope_style styles[] = { KVR_ROPE_NEOX, KVR_ROPE_GPTJ };
    for (int s = 0; s < 2; s++) {
        kvr_rope *r = make(128, 128, styles[s], 1e6, KVR_ROPE_SCALING_DEFAULT, 1.0);
        size_t T = 200, H = 2, D = 128, n = T * H * D;
        float *x = malloc(n * 4), *y = malloc(n * 4), *z = malloc(n * 4);
        int64_t *p = malloc(T * 8), *q = malloc(T * 8);
        fill(x, n);
        for (size_t t = 0; t < T; t++) {
            /* contiguous runs (the recurrence path) and scattered positions */
            p[t] = t < 100 ? 999900 + (int64_t)t : (int64_t)((urand() + 1.0) * 500000.0);
            q[t] = t < 100 ? (int64_t)t : p[t] - 777777;
        }
        kvr_rope_apply(r, y, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, p, NULL);
        /* reposition to far away positions, also exercised against long double */
        kvr_rope_reposition(r, z, KVR_DTYPE_F32, y, KVR_DTYPE_F32, T, H, p, q, NULL);
        for (size_t t = 0; t < T; t++) for (size_t h = 0; h < H; h++) {
            const float *xr = x + (t * H + h) * D;
            long double nrm = (long double)row_norm(xr, D);
            for (int i = 0; i < 64; i++) {
                long double f = powl(1e6L, -(long double)(2 * i) / 128.0L);
                size_t i0 = styles[s] == KVR_ROPE_GPTJ ? (size_t)(2 * i) : (size_t)i;
                size_t i1 = styles[s] == KVR_ROPE_GPTJ ? (size_t)(2 * i + 1) : (size_t)i + 64;
                long double th = (long double)p[t] * f, th2 = (long double)q[t] * f;
                long double x0 = (long double)xr[i0], x1 = (long double)xr[i1];
                long double e0 = x0 * cosl(th) - x1 * sinl(th), e1 = x0 * sinl(th) + x1 * cosl(th);
                long double g0 = x0 * cosl(th2) - x1 * sinl(th2), g1 = x0 * sinl(th2) + x1 * cosl(th2);
                const float *yr = y + (t * H + h) * D, *zr = z + (t * H + h) * D;
                cr_assert_leq(fabsl((long double)yr[i0] - e0), 1e-5L * nrm, "t %zu i %d", t, i);
                cr_assert_leq(fabsl((long double)yr[i1] - e1), 1e-5L * nrm, "t %zu i %d", t, i);
                cr_assert_leq(fabsl((long double)zr[i0] - g0), 1e-5L * nrm, "t %zu i %d", t, i);
                cr_assert_leq(fabsl((long double)zr[i1] - g1), 1e-5L * nrm, "t %zu i %d", t, i);
            }
        }
        free(x); free(y); free(z); free(p); free(q);
        kvr_rope_destroy(r);
    }
}

/* ---- length-dependent tables ----------------------------------------------- */

/* Direct computation of HF's tables, written independently of the engine. */
static void direct_inv_freq(const kvr_rope_config *c, int64_t seq_len, long double *f)
{
    int dim = c->rotary_dim;
    long double base = (long double)c->theta;
    int64_t orig = c->original_max_position_embeddings ? c->original_max_position_embeddings
                                                       : c->max_position_embeddings;
    if (c->scaling == KVR_ROPE_SCALING_DYNAMIC) {
        long double L = (long double)(seq_len > orig ? seq_len : orig);
        long double fac = (long double)c->factor;
        base *= powl(fac * L / (long double)orig - (fac - 1), (long double)dim / (dim - 2));
    }
    for (int i = 0; i < dim / 2; i++) {
        f[i] = 1.0L / powl(base, (long double)(2 * i) / dim);
        if (c->scaling == KVR_ROPE_SCALING_LONGROPE)
            f[i] /= (long double)(seq_len > orig ? c->long_factor[i] : c->short_factor[i]);
    }
}

static void check_len_dependent(const kvr_rope_config *c, long double mscale)
{
    kvr_rope *r = kvt_rope_new(c);
    cr_assert(!kvr_rope_config_composes(c));
    size_t T = 40, H = 2, D = (size_t)c->head_dim, n = T * H * D;
    int rot = c->rotary_dim;
    float *x = malloc(n * 4), *k = malloc(n * 4), *k2 = malloc(n * 4), *u = malloc(n * 4),
          *k3 = malloc(n * 4);
    int64_t *a = malloc(T * 8), *b = malloc(T * 8);
    fill(x, n);
    for (size_t t = 0; t < T; t++) { a[t] = (int64_t)t * 50; b[t] = (int64_t)t * 50 + 9000; }
    int64_t lens[][2] = { { 0, 0 }, { 0, 20000 }, { 20000, 0 }, { 9000, 30000 }, { 3000, 4000 } };
    for (int li = 0; li < 5; li++) {
        kvr_rope_opts o = { .seq_len_from = lens[li][0], .seq_len_to = lens[li][1] };
        /* k = apply(x, a) with the 'from' table */
        kvr_rope_opts oa = { .seq_len_to = lens[li][0] };
        kvr_rope_apply(r, k, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, a, &oa);
        kvr_rope_reposition(r, k2, KVR_DTYPE_F32, k, KVR_DTYPE_F32, T, H, a, b, &o);
        /* the same through remove (old table) + apply (new table) */
        kvr_rope_remove(r, u, KVR_DTYPE_F32, k, KVR_DTYPE_F32, T, H, a, &o);
        kvr_rope_apply(r, k3, KVR_DTYPE_F32, u, KVR_DTYPE_F32, T, H, b, &o);
        long double f_to[512];
        direct_inv_freq(c, lens[li][1], f_to);
        for (size_t t = 0; t < T; t++) for (size_t h = 0; h < H; h++) {
            size_t off = (t * H + h) * D;
            long double nrm = (long double)row_norm(x + off, D);
            for (int i = 0; i < rot / 2; i++) {
                size_t i0 = (size_t)i, i1 = (size_t)(i + rot / 2);
                long double th = (long double)b[t] * f_to[i];
                long double x0 = (long double)x[off + i0], x1 = (long double)x[off + i1];
                long double e0 = mscale * (x0 * cosl(th) - x1 * sinl(th));
                long double e1 = mscale * (x0 * sinl(th) + x1 * cosl(th));
                cr_assert_leq(fabsl((long double)k2[off + i0] - e0), 2e-6L * nrm, "lens %d t %zu i %d", li, t, i);
                cr_assert_leq(fabsl((long double)k2[off + i1] - e1), 2e-6L * nrm, "lens %d t %zu i %d", li, t, i);
                cr_assert_leq(fabsl((long double)k3[off + i0] - e0), 2e-6L * nrm);
                cr_assert_leq(fabsl((long double)k3[off + i1] - e1), 2e-6L * nrm);
            }
            for (size_t j = (size_t)rot; j < D; j++) cr_assert_eq(k2[off + j], x[off + j]);
        }
    }
    free(x); free(k); free(k2); free(u); free(k3); free(a); free(b);
    kvr_rope_destroy(r);
}

Test(rope_props, dynamic_ntk_tables_by_length)
{
    kvr_rope_config c;
    kvr_rope_config_init(&c);
    c.head_dim = 128; c.rotary_dim = 96; c.theta = 10000;
    c.scaling = KVR_ROPE_SCALING_DYNAMIC; c.factor = 2.0; c.max_position_embeddings = 4096;
    check_len_dependent(&c, 1.0L);
}

Test(rope_props, longrope_tables_by_length)
{
    kvr_rope_config c;
    kvr_rope_config_init(&c);
    c.head_dim = 64; c.rotary_dim = 64; c.theta = 10000;
    c.scaling = KVR_ROPE_SCALING_LONGROPE; c.factor = (double)NAN;
    c.max_position_embeddings = 131072; c.original_max_position_embeddings = 4096;
    c.n_short_factor = c.n_long_factor = 32;
    for (int i = 0; i < 32; i++) { c.short_factor[i] = 1.0 + 0.01 * i; c.long_factor[i] = 1.0 + 1.5 * i; }
    long double ms = sqrtl(1.0L + logl(32.0L) / logl(4096.0L));
    check_len_dependent(&c, ms);
}

/* ---- misc engine behaviour ---------------------------------------------------- */

Test(rope_props, threads_and_in_place_are_bit_identical)
{
    kvr_rope *r = make(128, 128, KVR_ROPE_NEOX, 10000, KVR_ROPE_SCALING_YARN, 4.0);
    size_t T = 1000, H = 4, D = 128, n = T * H * D;
    float *x = malloc(n * 4), *y1 = malloc(n * 4), *y2 = malloc(n * 4);
    int64_t *a = malloc(T * 8), *b = malloc(T * 8);
    fill(x, n);
    for (size_t t = 0; t < T; t++) { a[t] = (int64_t)t; b[t] = t < 300 ? (int64_t)t : (int64_t)t + 55; }
    kvr_rope_opts o1 = { .n_threads = 1 }, o3 = { .n_threads = 3 };
    kvr_rope_apply(r, y1, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, a, &o1);
    kvr_rope_apply(r, y2, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, a, &o3);
    cr_assert_eq(memcmp(y1, y2, n * 4), 0);
    kvr_rope_reposition(r, y1, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, a, b, &o1);
    memcpy(y2, x, n * 4);
    kvr_rope_reposition(r, y2, KVR_DTYPE_F32, y2, KVR_DTYPE_F32, T, H, a, b, &o3);
    cr_assert_eq(memcmp(y1, y2, n * 4), 0, "in place / threaded differs");
    free(x); free(y1); free(y2); free(a); free(b);
    kvr_rope_destroy(r);
}

Test(rope_props, bad_arguments)
{
    kvr_rope *r = make(64, 64, KVR_ROPE_NEOX, 10000, KVR_ROPE_SCALING_DEFAULT, 1.0);
    float x[64];
    int64_t p = 0;
    cr_assert_eq(kvr_rope_apply(r, NULL, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, 1, &p, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_rope_apply(r, x, (kvr_dtype)7, x, KVR_DTYPE_F32, 1, 1, &p, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_rope_reposition(r, x, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, 1, &p, NULL, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_rope_apply(r, x, KVR_DTYPE_F16, x, KVR_DTYPE_F32, 1, 1, &p, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_rope_apply(r, NULL, KVR_DTYPE_F32, NULL, KVR_DTYPE_F32, 0, 1, NULL, NULL), 0);
    /* extreme positions: to - from overflows int64 and must still work */
    int64_t f = INT64_MIN + 5, t = INT64_MAX - 5;
    for (int i = 0; i < 64; i++) x[i] = 1.0f;
    cr_assert_eq(kvr_rope_reposition(r, x, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, 1, &f, &t, NULL), 0);
    for (int i = 0; i < 64; i++) cr_assert(isfinite(x[i]));
    kvr_rope_destroy(r);
    kvr_rope_destroy(NULL);
}

/* ---- conversions -------------------------------------------------------------- */

Test(rope_props, f16_bf16_scalar_conversions)
{
    cr_assert_eq(kvr_f32_to_f16(1.0f), 0x3c00);
    cr_assert_eq(kvr_f32_to_f16(-2.0f), 0xc000);
    cr_assert_eq(kvr_f32_to_f16(65504.0f), 0x7bff);
    cr_assert_eq(kvr_f32_to_f16(65520.0f), 0x7c00);          /* rounds to inf */
    cr_assert_eq(kvr_f32_to_f16(INFINITY), 0x7c00);
    cr_assert_eq(kvr_f32_to_f16(-INFINITY), 0xfc00);
    cr_assert(isnan(kvr_f16_to_f32(kvr_f32_to_f16(NAN))));
    cr_assert_eq(kvr_f32_to_f16(0x1p-24f), 0x0001);          /* smallest subnormal */
    cr_assert_eq(kvr_f32_to_f16(0x1p-25f), 0x0000);          /* tie to even */
    cr_assert_eq(kvr_f32_to_f16(0x1.8p-24f), 0x0002);        /* tie to even, up */
    cr_assert_eq(kvr_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);   /* tie to even, down */
    cr_assert_eq(kvr_f32_to_f16(1.0f + 0x3p-11f), 0x3c02);   /* tie to even, up */
    cr_assert_eq(kvr_f32_to_bf16(1.0f), 0x3f80);
    cr_assert_eq(kvr_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);   /* tie to even */
    cr_assert_eq(kvr_f32_to_bf16(1.0f + 0x3p-8f), 0x3f82);
    cr_assert_eq(kvr_f32_to_bf16(INFINITY), 0x7f80);
    cr_assert(isnan(kvr_bf16_to_f32(kvr_f32_to_bf16(NAN))));
    cr_assert_eq(kvr_f32_to_bf16(3.4e38f), 0x7f80);          /* overflow rounds to inf */
    /* every f16 round-trips exactly; every value converts like the SIMD path */
    static float f[65536], g[65536];
    static uint16_t h[65536], h2[65536];
    for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    kvr_convert(f, KVR_DTYPE_F32, h, KVR_DTYPE_F16, 65536);
    for (uint32_t i = 0; i < 65536; i++) {
        float s = kvr_f16_to_f32((uint16_t)i);
        if (isnan(s)) { cr_assert(isnan(f[i])); continue; }
        cr_assert_eq(memcmp(&s, &f[i], 4), 0, "f16 %04x", i);
        cr_assert_eq(kvr_f32_to_f16(s), (uint16_t)i, "f16 %04x round trip", i);
    }
    for (uint32_t i = 0; i < 65536; i++) {
        uint32_t bits = (uint32_t)(rng = rng * 6364136223846793005ull + 1442695040888963407ull) ;
        bits = (uint32_t)(rng >> 32);
        memcpy(&g[i], &bits, 4);
        if (i < 1000) g[i] = (float)(urand() * 70000.0);
    }
    kvr_convert(h, KVR_DTYPE_F16, g, KVR_DTYPE_F32, 65536);
    kvr_convert(h2, KVR_DTYPE_BF16, g, KVR_DTYPE_F32, 65536);
    for (uint32_t i = 0; i < 65536; i++) {
        if (isnan(g[i])) {
            cr_assert(isnan(kvr_f16_to_f32(h[i])));
            cr_assert(isnan(kvr_bf16_to_f32(h2[i])));
            continue;
        }
        cr_assert_eq(h[i], kvr_f32_to_f16(g[i]), "f32 %a -> f16", (double)g[i]);
        cr_assert_eq(h2[i], kvr_f32_to_bf16(g[i]), "f32 %a -> bf16", (double)g[i]);
        double d = fabs((double)kvr_f16_to_f32(h[i]) - (double)g[i]);
        if (fabs((double)g[i]) < 65504.0)
            cr_assert_leq(d, ulp_of(fabs((double)g[i]), KVR_DTYPE_F16) / 2 + 1e-30);
    }
    /* f16 <-> bf16 in place */
    for (uint32_t i = 0; i < 1000; i++) h[i] = kvr_f32_to_f16((float)(urand() * 100.0));
    memcpy(h2, h, 2000);
    kvr_convert(h2, KVR_DTYPE_BF16, h2, KVR_DTYPE_F16, 1000);
    for (uint32_t i = 0; i < 1000; i++)
        cr_assert_eq(h2[i], kvr_f32_to_bf16(kvr_f16_to_f32(h[i])));
}

Test(rope_props, dtype_names)
{
    kvr_dtype t;
    cr_assert_eq(kvr_dtype_parse("bf16", &t), 0);
    cr_assert_eq(t, KVR_DTYPE_BF16);
    cr_assert_eq(kvr_dtype_parse("f8", &t), KVR_EINVAL);
    cr_assert_str_eq(kvr_dtype_name(KVR_DTYPE_F16), "f16");
    cr_assert_eq(kvr_dtype_size(KVR_DTYPE_F32), 4);
    cr_assert_str_eq(kvr_isa_name(KVR_ISA_AVX512), "avx512");
}

/* kvr_rope_reposition_delta with opts.stream (non-temporal stores where the
 * ISA and alignment allow) writes the bytes the plain stores write: every
 * dtype pair, both pairings, full and partial rotary, scaled or not, an
 * aligned and a misaligned destination, 1 and 2 threads. */
Test(rope_props, streamed_delta_rotation_is_bit_identical)
{
    const int hd = 128;
    const size_t n = 300, heads = 3, nel = n * heads * (size_t)hd;
    kvr_dtype ts[] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
    float *x = malloc(nel * 4);
    fill(x, nel);
    void *src = malloc(nel * 4);
    uint8_t *ref = aligned_alloc(64, nel * 4 + 128), *got = aligned_alloc(64, nel * 4 + 128);
    long compared = 0;
    for (int style = 0; style < 2; style++)
        for (int rot = hd / 2; rot <= hd; rot += hd / 2) {
            kvr_rope *r = make(hd, rot, style ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX, 10000.0,
                               KVR_ROPE_SCALING_DEFAULT, 1.0);
            for (int si = 0; si < 3; si++)
                for (int di = 0; di < 3; di++) {
                    kvr_convert(src, ts[si], x, KVR_DTYPE_F32, nel);
                    size_t bytes = nel * kvr_dtype_size(ts[di]);
                    for (int sc = 0; sc < 2; sc++)
                        for (size_t off = 0; off <= 32; off += 32)
                            for (int nt = 1; nt <= 2; nt++) {
                                float k = sc ? 0.7f : 1.0f;
                                kvr_rope_opts po = { .n_threads = nt };
                                kvr_rope_opts so = { .n_threads = nt, .stream = true };
                                memset(ref, 0x5a, bytes + 64);
                                memset(got, 0x5a, bytes + 64);
                                cr_assert_eq(kvr_rope_reposition_delta(r, ref + off, ts[di], src,
                                                                       ts[si], n, heads, 12345,
                                                                       k, &po), 0);
                                cr_assert_eq(kvr_rope_reposition_delta(r, got + off, ts[di], src,
                                                                       ts[si], n, heads, 12345,
                                                                       k, &so), 0);
                                cr_assert(!memcmp(ref, got, bytes + 64),
                                          "style %d rot %d %s->%s scale %g off %zu nt %d", style,
                                          rot, kvr_dtype_name(ts[si]), kvr_dtype_name(ts[di]),
                                          (double)k, off, nt);
                                compared++;
                            }
                }
            kvr_rope_destroy(r);
        }
    cr_log_info("%ld streamed rotations compared", compared);
    free(x);
    free(src);
    free(ref);
    free(got);
}

/* kvr_copy_stream is memcpy: every length around the vector and line sizes
 * and every alignment of both ends, nothing written outside. */
Test(rope_props, copy_stream_is_memcpy)
{
    size_t cap = 70000;
    uint8_t *src = malloc(cap + 128), *a = malloc(cap + 256), *b = malloc(cap + 256);
    for (size_t i = 0; i < cap + 128; i++)
        src[i] = (uint8_t)(i * 131u + 7u);
    size_t lens[] = { 0, 1, 63, 64, 65, 255, 256, 1023, 1024, 1025, 4096, 4097, 65536 + 13 };
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++)
        for (size_t doff = 0; doff < 70; doff += 23)
            for (size_t soff = 0; soff < 70; soff += 17) {
                size_t n = lens[li];
                memset(a, 0xC3, cap + 256);
                memset(b, 0xC3, cap + 256);
                memcpy(a + 64 + doff, src + soff, n);
                kvr_copy_stream(b + 64 + doff, src + soff, n);
                cr_assert(!memcmp(a, b, cap + 256), "n %zu doff %zu soff %zu", n, doff, soff);
            }
    free(src);
    free(a);
    free(b);
}

/* The fast float tables (fused multiply-adds, refused where a float could
 * round differently) are the reference's floats whenever they are used:
 * hundreds of thousands of tables over several frequency sets (theta 1e4,
 * 5e5, 1e6, llama3 and linear scaled, head dims 64..256), integer angles up
 * to the fast range in both forms, every length 1..67, both layouts. */
Test(rope_props, fast_float_tables_equal_the_reference)
{
    if (kvr_isa_best() < KVR_ISA_AVX512) {
        cr_log_info("no AVX-512: nothing to compare");
        return;
    }
    struct { double theta; int hd; kvr_rope_scaling sc; double factor; } cfgs[] = {
        { 10000.0, 128, KVR_ROPE_SCALING_DEFAULT, 1.0 },
        { 500000.0, 128, KVR_ROPE_SCALING_LLAMA3, 8.0 },
        { 1000000.0, 64, KVR_ROPE_SCALING_DEFAULT, 1.0 },
        { 10000.0, 256, KVR_ROPE_SCALING_LINEAR, 4.0 },
        { 10000.0, 80, KVR_ROPE_SCALING_DEFAULT, 1.0 },
    };
    long used = 0, refused = 0;
    for (size_t ci = 0; ci < sizeof cfgs / sizeof *cfgs; ci++) {
        kvr_rope *r = make(cfgs[ci].hd, cfgs[ci].hd, KVR_ROPE_NEOX, cfgs[ci].theta,
                           cfgs[ci].sc, cfgs[ci].factor);
        int np = r->npairs;
        double f1[KVR_ROPE_MAX_HEAD_DIM / 2], f2[KVR_ROPE_MAX_HEAD_DIM / 2];
        memcpy(f1, r->inv_freq, sizeof(double) * (size_t)np);
        for (int i = 0; i < np; i++) f2[i] = -f1[i] * (1.0 + 0.125 * (double)(i % 5));
        for (int trial = 0; trial < 80000; trial++) {
            int n = trial % 97 < 67 ? trial % 97 + 1 : np;
            if (n > np) n = np;
            double mag = trial % 4 == 0 ? 1e6 : trial % 4 == 1 ? 3e4 : trial % 4 == 2 ? 300.0 : 1.5e6;
            double a = floor(urand() * mag);
            double b = floor((urand() + 1.0) * 0.5 * mag);
            const double *g = trial % 3 == 0 ? f2 : NULL;
            int gptj = (trial >> 3) & 1, w = gptj ? 2 * n : n;
            double s0[KVR_ROPE_MAX_HEAD_DIM / 2], c0[KVR_ROPE_MAX_HEAD_DIM / 2];
            float fc0[KVR_ROPE_MAX_HEAD_DIM], fs0[KVR_ROPE_MAX_HEAD_DIM];
            float fc1[KVR_ROPE_MAX_HEAD_DIM], fs1[KVR_ROPE_MAX_HEAD_DIM];
            kvr__rope_sincos_scalar(a, f1, b, g, n, s0, c0);
            kvr__rope_tofloat_scalar(c0, s0, n, 1.0, gptj, fc0, fs0);
            if (!kvr__rope_table_fast_avx512(a, f1, b, g, n, gptj, fs1, fc1)) {
                refused++;
                continue;
            }
            used++;
            cr_assert(!memcmp(fc0, fc1, sizeof(float) * (size_t)w) &&
                      !memcmp(fs0, fs1, sizeof(float) * (size_t)w),
                      "cfg %zu a %.17g b %.17g n %d f2 %d gptj %d", ci, a, b, n, g != NULL, gptj);
        }
        kvr_rope_destroy(r);
    }
    cr_log_info("%ld fast tables equal the reference, %ld refused", used, refused);
    cr_assert_gt(used, refused * 10, "the fast table is refused too often");
}

/* Reposition with deltas that differ token by token (the fast tables), then
 * repeat, then advance by a constant step (the recurrence from the
 * reference doubles the fast tables skip), and again: every ISA and thread
 * count gives the scalar path's bytes. */
Test(rope_props, fast_tables_then_steps_bit_identical)
{
    const int hd = 128;
    const size_t n = 700, heads = 2, nel = n * heads * (size_t)hd;
    kvr_rope *r = make(hd, hd, KVR_ROPE_NEOX, 500000.0, KVR_ROPE_SCALING_DEFAULT, 1.0);
    int64_t *from = malloc(n * sizeof *from), *to = malloc(n * sizeof *to);
    for (size_t t = 0; t < n; t++) {
        from[t] = (int64_t)t;
        size_t ph = t % 100;
        to[t] = ph < 40 ? (int64_t)(urand() * 9e5) + 1000000   /* distinct */
              : ph < 55 ? 4242                                 /* repeats */
              : (int64_t)(t * 3 + 17);                         /* steps of 2 */
    }
    float *x = malloc(nel * 4);
    fill(x, nel);
    kvr_dtype ts[] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
    void *src = malloc(nel * 4), *ref = malloc(nel * 4), *o = malloc(nel * 4);
    for (int d = 0; d < 3; d++) {
        kvr_convert(src, ts[d], x, KVR_DTYPE_F32, nel);
        kvr_rope_opts so = { .isa = KVR_ISA_SCALAR, .n_threads = 1 };
        cr_assert_eq(kvr_rope_reposition(r, ref, ts[d], src, ts[d], n, heads, from, to, &so), 0);
        kvr_isa isas[] = { KVR_ISA_AVX2, KVR_ISA_AVX512 };
        for (int k = 0; k < 2; k++)
            for (int nt = 1; nt <= 3; nt++) {
                if (isas[k] > kvr_isa_best()) continue;
                kvr_rope_opts vo = { .isa = isas[k], .n_threads = nt };
                cr_assert_eq(kvr_rope_reposition(r, o, ts[d], src, ts[d], n, heads, from, to,
                                                 &vo), 0);
                cr_assert(!memcmp(ref, o, nel * kvr_dtype_size(ts[d])), "%s %s %d threads",
                          kvr_isa_name(isas[k]), kvr_dtype_name(ts[d]), nt);
            }
    }
    free(from); free(to); free(x); free(src); free(ref); free(o);
    kvr_rope_destroy(r);
}
