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
 * libm's sincos element by element, as the scalar path does. The
 * reduction, the polynomials and the table step are rope/sincos_simd_inl.h's
 * (shared with sincos_avx512.c); the quadrant is applied here.
 */
#include <immintrin.h>
#include <math.h>

#include "rope/rope_internal.h"

#define W 4

#define VD        __m256d
#define VD_W      W
#define VD_SET1   _mm256_set1_pd
#define VD_ADD    _mm256_add_pd
#define VD_SUB    _mm256_sub_pd
#define VD_MUL    _mm256_mul_pd
#define VD_FMADD  _mm256_fmadd_pd
#define VD_FNMADD _mm256_fnmadd_pd
#define VD_LOADU  _mm256_loadu_pd
#define VD_STOREU _mm256_storeu_pd
#include "rope/sincos_simd_inl.h"

static inline __m256d sincos4(__m256d x, __m256d *cp)
{
    __m256d sr, cr;
    __m256i kb = _mm256_castpd_si256(sincos_kernel(x, &sr, &cr, 0));
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

void kvr__rope_step_avx2(const double *stc, const double *sts, int n, double *c, double *s)
{
    rope_step(stc, sts, n, c, s);
}
