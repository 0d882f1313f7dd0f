/*
 * sincos_avx512.c — the per-token sin/cos table of rope.c (kvr__rope_sincos_scalar)
 * eight doubles at a time with AVX-512 (F/DQ).
 *
 * Invariant: every lane performs exactly the scalar reference's double
 * operations in the same order (Cody-Waite reduction by pi/2 in three pieces,
 * fdlibm's kernel polynomials, the quadrant from the low bits of the rounded
 * quotient), each one IEEE-rounded: no fused multiply-add (the Makefile
 * builds this file with -ffp-contract=off), so the table is bit for bit the
 * scalar one. Tables with an angle at or beyond FAST_MAX (or NaN) go to
 * libm's sincos element by element, as the scalar path does. The
 * reduction, the polynomials and the table step are rope/sincos_simd_inl.h's
 * (shared with sincos_avx2.c); the quadrant is applied here.
 *
 * The one exception, kvr__rope_table_fast_avx512, uses fused multiply-adds for
 * float tables only, and refuses every table whose floats could differ from
 * the reference's (see there).
 */
#include <immintrin.h>
#include <math.h>

#include "rope/rope_internal.h"

#define W 8
#define AI static inline __attribute__((always_inline))

#define VD        __m512d
#define VD_W      W
#define VD_SET1   _mm512_set1_pd
#define VD_ADD    _mm512_add_pd
#define VD_SUB    _mm512_sub_pd
#define VD_MUL    _mm512_mul_pd
#define VD_FMADD  _mm512_fmadd_pd
#define VD_FNMADD _mm512_fnmadd_pd
#define VD_LOADU  _mm512_loadu_pd
#define VD_STOREU _mm512_storeu_pd
#include "rope/sincos_simd_inl.h"

/* The lanes of a group of 8 pairs with left pairs left in the table. */
AI __mmask8 lanes8(int left)
{
    return left >= W ? (__mmask8)0xff : (__mmask8)((1u << left) - 1u);
}

/* sin x (returned) and cos x (*cp) from the remainder's sin sr and cos cr
 * and kk, the quotient's bits (sincos_kernel's): swapped in odd quadrants;
 * c negated in quadrants 1 and 2 ((q + 1) & 2), s in 2 and 3 (q & 2): bit 1
 * shifted to the sign bit, then x ^ (bits & sign) in one ternary logic op
 * (0x78 = A ^ (B & C)); only the sign bit changes. */
AI __m512d quadrant8(__m512d kk, __m512d sr, __m512d cr, __m512d *cp)
{
    __m512i kb = _mm512_castpd_si512(kk);
    __m512i one = _mm512_set1_epi64(1), sign = _mm512_set1_epi64((long long)0x8000000000000000ull);
    __mmask8 odd = _mm512_test_epi64_mask(kb, one);
    __m512d s = _mm512_mask_blend_pd(odd, sr, cr), c = _mm512_mask_blend_pd(odd, cr, sr);
    __m512i nc = _mm512_slli_epi64(_mm512_add_epi64(kb, one), 62);
    __m512i ns = _mm512_slli_epi64(kb, 62);
    *cp = _mm512_castsi512_pd(_mm512_ternarylogic_epi64(_mm512_castpd_si512(c), nc, sign, 0x78));
    return _mm512_castsi512_pd(_mm512_ternarylogic_epi64(_mm512_castpd_si512(s), ns, sign, 0x78));
}

static inline __m512d sincos8(__m512d x, __m512d *cp)
{
    __m512d sr, cr, kk = sincos_kernel(x, &sr, &cr, 0);
    return quadrant8(kk, sr, cr, cp);
}

/* The angles a * f1 + b * f2 (f2 may be NULL) of the group of 8 pairs at
 * i (k8: its lanes; the others 0). */
AI __m512d angle8(__m512d va, const double *f1, __m512d vb, const double *f2, int i,
                  __mmask8 k8)
{
    __m512d x = _mm512_mul_pd(va, _mm512_maskz_loadu_pd(k8, f1 + i));
    if (f2) x = _mm512_add_pd(x, _mm512_mul_pd(vb, _mm512_maskz_loadu_pd(k8, f2 + i)));
    return x;
}

/* The float tables' entries of the group of 8 pairs at i, cf and sf (k8:
 * its lanes, full when all 8): NEOX one float each, GPTJ each twice, the
 * sine negated in the even places (the layouts of rope_internal.h). k8
 * all ones stores plainly (masked stores cost more). */
AI void store_float8(__m256 cf, __m256 sf, int i, __mmask8 k8, bool full, int gptj,
                     float *fc, float *fs)
{
    if (gptj) {
        const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512 neg_even = _mm512_castsi512_ps(_mm512_set_epi32(
            0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u,
            0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u));
        __m512 cd = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(cf));
        __m512 sd = _mm512_xor_ps(_mm512_permutexvar_ps(dup, _mm512_castps256_ps512(sf)), neg_even);
        if (full) {
            _mm512_storeu_ps(fc + 2 * i, cd);
            _mm512_storeu_ps(fs + 2 * i, sd);
        } else {
            unsigned r = (unsigned)__builtin_popcount(k8);   /* k8 = the low r lanes */
            __mmask16 k16 = (__mmask16)((1u << (2 * r)) - 1u);
            _mm512_mask_storeu_ps(fc + 2 * i, k16, cd);
            _mm512_mask_storeu_ps(fs + 2 * i, k16, sd);
        }
    } else if (full) {
        _mm256_storeu_ps(fc + i, cf);
        _mm256_storeu_ps(fs + i, sf);
    } else {
        _mm256_mask_storeu_ps(fc + i, k8, cf);
        _mm256_mask_storeu_ps(fs + i, k8, sf);
    }
}

void kvr__rope_sincos_avx512(double a, const double *f1, double b, const double *f2, int n,
                        double *s, double *c)
{
    double ang[KVR_ROPE_MAX_HEAD_DIM / 2 + W];
    const __m512d va = _mm512_set1_pd(a), vb = _mm512_set1_pd(b);
    const __m512d lim = _mm512_set1_pd(ROPE_FAST_MAX);
    __mmask8 bad = 0;
    int i = 0;
    for (; i < n; i += W) {
        __mmask8 m = lanes8(n - i);
        __m512d x = angle8(va, f1, vb, f2, i, m);
        bad |= (__mmask8)(m & ~_mm512_cmp_pd_mask(_mm512_abs_pd(x), lim, _CMP_LT_OQ));
        _mm512_storeu_pd(ang + i, x);
    }
    if (bad) {
        for (i = 0; i < n; i++) sincos(ang[i], &s[i], &c[i]);
        return;
    }
    for (i = 0; i < n; i += W) {
        __mmask8 m = lanes8(n - i);
        __m512d cv, sv = sincos8(_mm512_loadu_pd(ang + i), &cv);
        _mm512_mask_storeu_pd(s + i, m, sv);
        _mm512_mask_storeu_pd(c + i, m, cv);
    }
}

void kvr__rope_tofloat_avx512(const double *c, const double *s, int n, double m, int gptj,
                         float *fc, float *fs)
{
    const __m512d vm = _mm512_set1_pd(m);
    for (int i = 0; i < n; i += W) {
        __mmask8 m8 = lanes8(n - i);
        __m256 cf = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_maskz_loadu_pd(m8, c + i), vm));
        __m256 sf = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_maskz_loadu_pd(m8, s + i), vm));
        store_float8(cf, sf, i, m8, m8 == (__mmask8)0xff, gptj, fc, fs);
    }
}

/* One group of 8 pairs from i of kvr__rope_table_avx512: the table's doubles,
 * then the float tables (times m unless m is 1, where the product is the
 * value itself). k8 all ones stores plainly (masked stores cost more). */
AI void table8(__m512d x, int i, __mmask8 k8, __m512d vm, bool unit, int gptj,
                          double *s, double *c, float *fs, float *fc)
{
    __m512d cv, sv = sincos8(x, &cv);
    bool full = k8 == (__mmask8)0xff;
    if (full) {
        _mm512_storeu_pd(s + i, sv);
        _mm512_storeu_pd(c + i, cv);
    } else {
        _mm512_mask_storeu_pd(s + i, k8, sv);
        _mm512_mask_storeu_pd(c + i, k8, cv);
    }
    if (!unit) {
        cv = _mm512_mul_pd(cv, vm);
        sv = _mm512_mul_pd(sv, vm);
    }
    store_float8(_mm512_cvtpd_ps(cv), _mm512_cvtpd_ps(sv), i, k8, full, gptj, fc, fs);
}

/* kvr__rope_sincos_avx512 then kvr__rope_tofloat_avx512 in one pass over the lanes
 * (the same operations, so the same bits), for tables computed afresh. The
 * angles are checked first, then made again (the same products) 64 at a
 * time, in registers, fully unrolled. */
void kvr__rope_table_avx512(double a, const double *f1, double b, const double *f2, int n, double m,
                       int gptj, double *s, double *c, float *fs, float *fc)
{
    const __m512d va = _mm512_set1_pd(a), vb = _mm512_set1_pd(b);
    const __m512d lim = _mm512_set1_pd(ROPE_FAST_MAX);
    __mmask8 bad = 0;
    int ng = (n + W - 1) / W;
    for (int g = 0; g < ng; g++) {
        int i = g * W;
        __mmask8 k8 = lanes8(n - i);
        __m512d x = angle8(va, f1, vb, f2, i, k8);
        bad |= (__mmask8)(k8 & ~_mm512_cmp_pd_mask(_mm512_abs_pd(x), lim, _CMP_LT_OQ));
    }
    if (bad) {
        double ang[KVR_ROPE_MAX_HEAD_DIM / 2 + W];
        for (int g = 0; g < ng; g++) {
            int i = g * W;
            __mmask8 k8 = lanes8(n - i);
            _mm512_storeu_pd(ang + i, angle8(va, f1, vb, f2, i, k8));
        }
        for (int i = 0; i < n; i++) sincos(ang[i], &s[i], &c[i]);
        kvr__rope_tofloat_avx512(c, s, n, m, gptj, fc, fs);
        return;
    }
    const __m512d vm = _mm512_set1_pd(m);
    bool unit = m == 1.0;
    int g = 0;
    for (; g + 8 <= n / W; g += 8) {
        __m512d x[8];
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++)
            x[q] = angle8(va, f1, vb, f2, (g + q) * W, 0xff);
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++)
            table8(x[q], (g + q) * W, 0xff, vm, unit, gptj, s, c, fs, fc);
    }
    for (; g < ng; g++) {
        int i = g * W;
        __mmask8 k8 = lanes8(n - i);
        table8(angle8(va, f1, vb, f2, i, k8), i, k8, vm, unit, gptj, s, c, fs, fc);
    }
}

/* ---- the fast float table ------------------------------------------------
 * The same reduction and polynomials as sincos8 with fused multiply-adds
 * (half the operations), so its doubles y' are within a few ulps of the
 * reference's y, not equal. Its float tables are the reference's all the
 * same wherever rounding y' to float cannot round differently from y: every
 * value whose bits below the float's mantissa (the low 29 of the double's)
 * are further than FAST_TOL units from the half-way pattern, i.e. y' is
 * more than FAST_TOL ulps from every point where the float rounding
 * changes, while |y' - y| stays within a few ulps. Why: with the quotient
 * k below 2^20 every product k * PIO2_i is exact (33-bit pieces), so the
 * fused reduction steps round exactly as the reference's: the same r. The
 * quotient itself may round the other way when x * 2/pi is within an ulp of
 * a half-integer; that only swaps in the other polynomial at |r| near pi/4.
 * Both polynomial evaluations are then within an ulp or two of the same
 * value (relative, also for tiny r: sin = r + r * z * ps), their
 * correction terms being under a third of it. A table with any value
 * nearer than FAST_TOL, or with an angle for libm, is refused whole (the
 * caller makes the reference one);
 * tests compare millions of tables with the reference. */
#define FAST_TOL 1024

static inline __m512d sincos8_fma(__m512d x, __m512d *cp)
{
    __m512d sr, cr, kk = sincos_kernel(x, &sr, &cr, 1);
    return quadrant8(kk, sr, cr, cp);
}

/* Lanes of v whose low 29 bits lie within FAST_TOL of 2^28 (a float
 * rounding boundary's neighbourhood). */
static inline __mmask8 near_half(__m512d v)
{
    const __m512i low = _mm512_set1_epi64((1ll << 29) - 1);
    const __m512i shift = _mm512_set1_epi64((1ll << 28) - FAST_TOL);
    const __m512i width = _mm512_set1_epi64(2 * FAST_TOL);
    __m512i d = _mm512_sub_epi64(_mm512_and_si512(_mm512_castpd_si512(v), low), shift);
    return _mm512_cmplt_epu64_mask(d, width);
}

/* One group of 8 pairs from i (k8: its lanes) of the fast table; its
 * refusals in the returned mask. */
AI __mmask8 fast8(__m512d va, const double *f1, __m512d vb, const double *f2, int i, __mmask8 k8,
                  bool full, int gptj, float *fs, float *fc)
{
    const __m512d lim = _mm512_set1_pd(ROPE_FAST_MAX);
    /* the reference's angle: the same rounded products and sum */
    __m512d x = full ? _mm512_mul_pd(va, _mm512_loadu_pd(f1 + i)) : angle8(va, f1, vb, NULL, i, k8);
    if (f2) {
        __m512d y = full ? _mm512_loadu_pd(f2 + i) : _mm512_maskz_loadu_pd(k8, f2 + i);
        x = _mm512_add_pd(x, _mm512_mul_pd(vb, y));
    }
    __mmask8 bad = (__mmask8)~_mm512_cmp_pd_mask(_mm512_abs_pd(x), lim, _CMP_LT_OQ);
    __m512d cv, sv = sincos8_fma(x, &cv);
    bad = (__mmask8)(k8 & (bad | near_half(sv) | near_half(cv)));
    store_float8(_mm512_cvtpd_ps(cv), _mm512_cvtpd_ps(sv), i, k8, full, gptj, fc, fs);
    return bad;
}

bool kvr__rope_table_fast_avx512(double a, const double *f1, double b, const double *f2, int n,
                            int gptj, float *fs, float *fc)
{
    const __m512d va = _mm512_set1_pd(a), vb = _mm512_set1_pd(b);
    __mmask8 bad = 0;
    int full = n / W, g = 0;
    if (!f2 && !gptj) {
        /* the common case, unrolled by 4 without the branches */
        for (; g + 4 <= full; g += 4) {
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++)
                bad |= fast8(va, f1, vb, NULL, (g + q) * W, 0xff, true, 0, fs, fc);
        }
    }
    for (; g < full; g++)
        bad |= fast8(va, f1, vb, f2, g * W, 0xff, true, gptj, fs, fc);
    if (g * W < n)
        bad |= fast8(va, f1, vb, f2, g * W, (__mmask8)((1u << (n - g * W)) - 1u), false, gptj,
                     fs, fc);
    return bad == 0;
}

void kvr__rope_step_avx512(const double *stc, const double *sts, int n, double *c, double *s)
{
    rope_step(stc, sts, n, c, s);
}
