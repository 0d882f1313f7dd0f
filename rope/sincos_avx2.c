/*
 * sincos_avx2.c — the per-token sin/cos table of rope.c (kvr__rope_sincos_scalar)
 * four doubles at a time with AVX2.
 *
 * Invariant: every lane performs exactly the scalar reference's double
 * operations in the same order (Cody-Waite reduction by pi/2 in three pieces,
 * fdlibm's kernel polynomials, the quadrant from the low bits of the rounded
 * quotient), each one IEEE-rounded: no fused multiply-add (the Makefile
 * builds this file with -ffp-contract=off), so the table is bit for bit the
 * scalar one. Tables with an angle at or beyond FAST_MAX (or NaN) go to
 * libm's sincos element by element, as the scalar path does.
 */
#include <immintrin.h>
#include <math.h>

#include "rope/rope_internal.h"

#define W 4

static inline __m256d sincos4(__m256d x, __m256d *cp)
{
    const __m256d shift = _mm256_set1_pd(0x1.8p52);
    __m256d kk = _mm256_add_pd(_mm256_mul_pd(x, _mm256_set1_pd(M_2_PI)), shift);
    __m256d k = _mm256_sub_pd(kk, shift);
    __m256i kb = _mm256_castpd_si256(kk);
    __m256d r = _mm256_sub_pd(x, _mm256_mul_pd(k, _mm256_set1_pd(ROPE_PIO2_1)));
    r = _mm256_sub_pd(r, _mm256_mul_pd(k, _mm256_set1_pd(ROPE_PIO2_2)));
    r = _mm256_sub_pd(r, _mm256_mul_pd(k, _mm256_set1_pd(ROPE_PIO2_3)));
    __m256d z = _mm256_mul_pd(r, r);
#define C(v) _mm256_set1_pd(v)
#define MA(a, b, c) _mm256_add_pd((c), _mm256_mul_pd((a), (b)))   /* c + a*b, two roundings */
    __m256d ps = MA(z, C(ROPE_S6), C(ROPE_S5));
    ps = MA(z, ps, C(ROPE_S4));
    ps = MA(z, ps, C(ROPE_S3));
    ps = MA(z, ps, C(ROPE_S2));
    ps = MA(z, ps, C(ROPE_S1));
    __m256d sr = _mm256_add_pd(r, _mm256_mul_pd(_mm256_mul_pd(r, z), ps));
    __m256d pc = MA(z, C(ROPE_C6), C(ROPE_C5));
    pc = MA(z, pc, C(ROPE_C4));
    pc = MA(z, pc, C(ROPE_C3));
    pc = MA(z, pc, C(ROPE_C2));
    pc = MA(z, pc, C(ROPE_C1));
    __m256d cr = _mm256_add_pd(_mm256_sub_pd(C(1.0), _mm256_mul_pd(C(0.5), z)),
                               _mm256_mul_pd(_mm256_mul_pd(z, z), pc));
#undef MA
#undef C
    __m256i one = _mm256_set1_epi64x(1), two = _mm256_set1_epi64x(2);
    __m256d odd = _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(kb, one), one));
    __m256d s = _mm256_blendv_pd(sr, cr, odd), c = _mm256_blendv_pd(cr, sr, odd);
    /* c negated in quadrants 1 and 2 ((q + 1) & 2), s in 2 and 3 (q & 2) */
    __m256i nc = _mm256_slli_epi64(_mm256_and_si256(_mm256_add_epi64(kb, one), two), 62);
    __m256i ns = _mm256_slli_epi64(_mm256_and_si256(kb, two), 62);
    *cp = _mm256_xor_pd(c, _mm256_castsi256_pd(nc));
    return _mm256_xor_pd(s, _mm256_castsi256_pd(ns));
}

void kvr__rope_sincos_avx2(double a, const double *f1, double b, const double *f2, int n,
                      double *s, double *c)
{
    double ang[KVR_ROPE_MAX_HEAD_DIM / 2 + W];
    const __m256d va = _mm256_set1_pd(a), vb = _mm256_set1_pd(b);
    const __m256d lim = _mm256_set1_pd(ROPE_FAST_MAX);
    const __m256d absm = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffll));
    __m256d ok = _mm256_castsi256_pd(_mm256_set1_epi64x(-1));
    int i = 0;
    for (; i + W <= n; i += W) {
        __m256d x = _mm256_mul_pd(va, _mm256_loadu_pd(f1 + i));
        if (f2) x = _mm256_add_pd(x, _mm256_mul_pd(vb, _mm256_loadu_pd(f2 + i)));
        ok = _mm256_and_pd(ok, _mm256_cmp_pd(_mm256_and_pd(x, absm), lim, _CMP_LT_OQ));
        _mm256_storeu_pd(ang + i, x);
    }
    for (; i < n; i++) {
        double x = f2 ? a * f1[i] + b * f2[i] : a * f1[i];
        if (!(fabs(x) < ROPE_FAST_MAX)) ok = _mm256_setzero_pd();
        ang[i] = x;
    }
    if (_mm256_movemask_pd(ok) != 0xf) {
        for (i = 0; i < n; i++) sincos(ang[i], &s[i], &c[i]);
        return;
    }
    for (i = n; i < ((n + W - 1) / W) * W; i++) ang[i] = 0.0;
    for (i = 0; i + W <= n; i += W) {
        __m256d cv, sv = sincos4(_mm256_loadu_pd(ang + i), &cv);
        _mm256_storeu_pd(s + i, sv);
        _mm256_storeu_pd(c + i, cv);
    }
    if (i < n) {
        double ts[W], tc[W];
        __m256d cv, sv = sincos4(_mm256_loadu_pd(ang + i), &cv);
        _mm256_storeu_pd(ts, sv);
        _mm256_storeu_pd(tc, cv);
        for (int k = 0; i < n; i++, k++) { s[i] = ts[k]; c[i] = tc[k]; }
    }
}

void kvr__rope_tofloat_avx2(const double *c, const double *s, int n, double m, int gptj,
                       float *fc, float *fs)
{
    const __m256d vm = _mm256_set1_pd(m);
    const __m128 neg_even = _mm_castsi128_ps(_mm_set_epi32(0, (int)0x80000000u, 0, (int)0x80000000u));
    int i = 0;
    for (; i + W <= n; i += W) {
        __m128 cf = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_loadu_pd(c + i), vm));
        __m128 sf = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_loadu_pd(s + i), vm));
        if (gptj) {
            _mm_storeu_ps(fc + 2 * i, _mm_unpacklo_ps(cf, cf));
            _mm_storeu_ps(fc + 2 * i + 4, _mm_unpackhi_ps(cf, cf));
            _mm_storeu_ps(fs + 2 * i, _mm_xor_ps(_mm_unpacklo_ps(sf, sf), neg_even));
            _mm_storeu_ps(fs + 2 * i + 4, _mm_xor_ps(_mm_unpackhi_ps(sf, sf), neg_even));
        } else {
            _mm_storeu_ps(fc + i, cf);
            _mm_storeu_ps(fs + i, sf);
        }
    }
    for (; i < n; i++) {
        float cv = (float)(c[i] * m), sv = (float)(s[i] * m);
        if (gptj) {
            fc[2 * i] = cv; fc[2 * i + 1] = cv;
            fs[2 * i] = -sv; fs[2 * i + 1] = sv;
        } else {
            fc[i] = cv;
            fs[i] = sv;
        }
    }
}

/* kvr__rope_step_scalar, 4 pairs at a time (the same products and sums). */
void kvr__rope_step_avx2(const double *stc, const double *sts, int n, double *c, double *s)
{
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256d c0 = _mm256_loadu_pd(c + i), s0 = _mm256_loadu_pd(s + i), a = _mm256_loadu_pd(stc + i), b = _mm256_loadu_pd(sts + i);
        _mm256_storeu_pd(c + i, _mm256_sub_pd(_mm256_mul_pd(c0, a), _mm256_mul_pd(s0, b)));
        _mm256_storeu_pd(s + i, _mm256_add_pd(_mm256_mul_pd(s0, a), _mm256_mul_pd(c0, b)));
    }
    for (; i < n; i++) {
        double c0 = c[i], s0 = s[i];
        c[i] = c0 * stc[i] - s0 * sts[i];
        s[i] = s0 * stc[i] + c0 * sts[i];
    }
}
