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
 * libm's sincos element by element, as the scalar path does.
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

static inline __m512d sincos8(__m512d x, __m512d *cp)
{
    const __m512d shift = _mm512_set1_pd(0x1.8p52);
    __m512d kk = _mm512_add_pd(_mm512_mul_pd(x, _mm512_set1_pd(M_2_PI)), shift);
    __m512d k = _mm512_sub_pd(kk, shift);
    __m512i kb = _mm512_castpd_si512(kk);
    __m512d r = _mm512_sub_pd(x, _mm512_mul_pd(k, _mm512_set1_pd(ROPE_PIO2_1)));
    r = _mm512_sub_pd(r, _mm512_mul_pd(k, _mm512_set1_pd(ROPE_PIO2_2)));
    r = _mm512_sub_pd(r, _mm512_mul_pd(k, _mm512_set1_pd(ROPE_PIO2_3)));
    __m512d z = _mm512_mul_pd(r, r);
#define C(v) _mm512_set1_pd(v)
#define MA(a, b, c) _mm512_add_pd((c), _mm512_mul_pd((a), (b)))   /* c + a*b, two roundings */
    __m512d ps = MA(z, C(ROPE_S6), C(ROPE_S5));
    ps = MA(z, ps, C(ROPE_S4));
    ps = MA(z, ps, C(ROPE_S3));
    ps = MA(z, ps, C(ROPE_S2));
    ps = MA(z, ps, C(ROPE_S1));
    __m512d sr = _mm512_add_pd(r, _mm512_mul_pd(_mm512_mul_pd(r, z), ps));
    __m512d pc = MA(z, C(ROPE_C6), C(ROPE_C5));
    pc = MA(z, pc, C(ROPE_C4));
    pc = MA(z, pc, C(ROPE_C3));
    pc = MA(z, pc, C(ROPE_C2));
    pc = MA(z, pc, C(ROPE_C1));
    __m512d cr = _mm512_add_pd(_mm512_sub_pd(C(1.0), _mm512_mul_pd(C(0.5), z)),
                               _mm512_mul_pd(_mm512_mul_pd(z, z), pc));
#undef MA
#undef C
    __m512i one = _mm512_set1_epi64(1), sign = _mm512_set1_epi64((long long)0x8000000000000000ull);
    __mmask8 odd = _mm512_test_epi64_mask(kb, one);
    __m512d s = _mm512_mask_blend_pd(odd, sr, cr), c = _mm512_mask_blend_pd(odd, cr, sr);
    /* c negated in quadrants 1 and 2 ((q + 1) & 2), s in 2 and 3 (q & 2):
     * bit 1 shifted to the sign bit, then x ^ (bits & sign) in one ternary
     * logic op (0x78 = A ^ (B & C)); only the sign bit changes */
    __m512i nc = _mm512_slli_epi64(_mm512_add_epi64(kb, one), 62);
    __m512i ns = _mm512_slli_epi64(kb, 62);
    *cp = _mm512_castsi512_pd(_mm512_ternarylogic_epi64(_mm512_castpd_si512(c), nc, sign, 0x78));
    return _mm512_castsi512_pd(_mm512_ternarylogic_epi64(_mm512_castpd_si512(s), ns, sign, 0x78));
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
        __mmask8 m = n - i >= W ? (__mmask8)0xff : (__mmask8)((1u << (n - i)) - 1u);
        __m512d x = _mm512_mul_pd(va, _mm512_maskz_loadu_pd(m, f1 + i));
        if (f2) x = _mm512_add_pd(x, _mm512_mul_pd(vb, _mm512_maskz_loadu_pd(m, f2 + i)));
        bad |= (__mmask8)(m & ~_mm512_cmp_pd_mask(_mm512_abs_pd(x), lim, _CMP_LT_OQ));
        _mm512_storeu_pd(ang + i, x);
    }
    if (bad) {
        for (i = 0; i < n; i++) sincos(ang[i], &s[i], &c[i]);
        return;
    }
    for (i = 0; i < n; i += W) {
        __mmask8 m = n - i >= W ? (__mmask8)0xff : (__mmask8)((1u << (n - i)) - 1u);
        __m512d cv, sv = sincos8(_mm512_loadu_pd(ang + i), &cv);
        _mm512_mask_storeu_pd(s + i, m, sv);
        _mm512_mask_storeu_pd(c + i, m, cv);
    }
}

void kvr__rope_tofloat_avx512(const double *c, const double *s, int n, double m, int gptj,
                         float *fc, float *fs)
{
    const __m512d vm = _mm512_set1_pd(m);
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512 neg_even = _mm512_castsi512_ps(_mm512_set_epi32(
        0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u,
        0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u));
    for (int i = 0; i < n; i += W) {
        __mmask8 m8 = n - i >= W ? (__mmask8)0xff : (__mmask8)((1u << (n - i)) - 1u);
        __m256 cf = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_maskz_loadu_pd(m8, c + i), vm));
        __m256 sf = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_maskz_loadu_pd(m8, s + i), vm));
        if (gptj) {
            __mmask16 m16 = n - i >= W ? (__mmask16)0xffff
                                       : (__mmask16)((1u << (2 * (n - i))) - 1u);
            __m512 cd = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(cf));
            __m512 sd = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(sf));
            _mm512_mask_storeu_ps(fc + 2 * i, m16, cd);
            _mm512_mask_storeu_ps(fs + 2 * i, m16, _mm512_xor_ps(sd, neg_even));
        } else {
            _mm256_mask_storeu_ps(fc + i, m8, cf);
            _mm256_mask_storeu_ps(fs + i, m8, sf);
        }
    }
}

/* One group of 8 pairs from i of kvr__rope_table_avx512: the table's doubles,
 * then the float tables (times m unless m is 1, where the product is the
 * value itself). k8 all ones stores plainly (masked stores cost more). */
AI void table8(__m512d x, int i, __mmask8 k8, __m512d vm, bool unit, int gptj,
                          double *s, double *c, float *fs, float *fc)
{
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512 neg_even = _mm512_castsi512_ps(_mm512_set_epi32(
        0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u,
        0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u));
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
    __m256 cf = _mm512_cvtpd_ps(cv), sf = _mm512_cvtpd_ps(sv);
    if (gptj) {
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

AI __m512d angle8(__m512d va, const double *f1, __m512d vb, const double *f2, int i,
                  __mmask8 k8)
{
    __m512d x = _mm512_mul_pd(va, _mm512_maskz_loadu_pd(k8, f1 + i));
    if (f2) x = _mm512_add_pd(x, _mm512_mul_pd(vb, _mm512_maskz_loadu_pd(k8, f2 + i)));
    return x;
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
        __mmask8 k8 = n - i >= W ? (__mmask8)0xff : (__mmask8)((1u << (n - i)) - 1u);
        __m512d x = angle8(va, f1, vb, f2, i, k8);
        bad |= (__mmask8)(k8 & ~_mm512_cmp_pd_mask(_mm512_abs_pd(x), lim, _CMP_LT_OQ));
    }
    if (bad) {
        double ang[KVR_ROPE_MAX_HEAD_DIM / 2 + W];
        for (int g = 0; g < ng; g++) {
            int i = g * W;
            __mmask8 k8 = n - i >= W ? (__mmask8)0xff : (__mmask8)((1u << (n - i)) - 1u);
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
        __mmask8 k8 = n - i >= W ? (__mmask8)0xff : (__mmask8)((1u << (n - i)) - 1u);
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
#define C(v) _mm512_set1_pd(v)
    const __m512d shift = C(0x1.8p52);
    __m512d kk = _mm512_fmadd_pd(x, C(M_2_PI), shift);
    __m512d k = _mm512_sub_pd(kk, shift);
    __m512i kb = _mm512_castpd_si512(kk);
    __m512d r = _mm512_fnmadd_pd(k, C(ROPE_PIO2_1), x);
    r = _mm512_fnmadd_pd(k, C(ROPE_PIO2_2), r);
    r = _mm512_fnmadd_pd(k, C(ROPE_PIO2_3), r);
    __m512d z = _mm512_mul_pd(r, r);
    __m512d ps = _mm512_fmadd_pd(z, C(ROPE_S6), C(ROPE_S5));
    ps = _mm512_fmadd_pd(z, ps, C(ROPE_S4));
    ps = _mm512_fmadd_pd(z, ps, C(ROPE_S3));
    ps = _mm512_fmadd_pd(z, ps, C(ROPE_S2));
    ps = _mm512_fmadd_pd(z, ps, C(ROPE_S1));
    __m512d sr = _mm512_fmadd_pd(_mm512_mul_pd(r, z), ps, r);
    __m512d pc = _mm512_fmadd_pd(z, C(ROPE_C6), C(ROPE_C5));
    pc = _mm512_fmadd_pd(z, pc, C(ROPE_C4));
    pc = _mm512_fmadd_pd(z, pc, C(ROPE_C3));
    pc = _mm512_fmadd_pd(z, pc, C(ROPE_C2));
    pc = _mm512_fmadd_pd(z, pc, C(ROPE_C1));
    __m512d cr = _mm512_fmadd_pd(_mm512_mul_pd(z, z), pc, _mm512_fnmadd_pd(C(0.5), z, C(1.0)));
#undef C
    __m512i one = _mm512_set1_epi64(1), sign = _mm512_set1_epi64((long long)0x8000000000000000ull);
    __mmask8 odd = _mm512_test_epi64_mask(kb, one);
    __m512d s = _mm512_mask_blend_pd(odd, sr, cr), c = _mm512_mask_blend_pd(odd, cr, sr);
    __m512i nc = _mm512_slli_epi64(_mm512_add_epi64(kb, one), 62);
    __m512i ns = _mm512_slli_epi64(kb, 62);
    *cp = _mm512_castsi512_pd(_mm512_ternarylogic_epi64(_mm512_castpd_si512(c), nc, sign, 0x78));
    return _mm512_castsi512_pd(_mm512_ternarylogic_epi64(_mm512_castpd_si512(s), ns, sign, 0x78));
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
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512 neg_even = _mm512_castsi512_ps(_mm512_set_epi32(
        0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u,
        0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u, 0, (int)0x80000000u));
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
    __m256 cf = _mm512_cvtpd_ps(cv), sf = _mm512_cvtpd_ps(sv);
    if (gptj) {
        __m512 cd = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(cf));
        __m512 sd = _mm512_xor_ps(_mm512_permutexvar_ps(dup, _mm512_castps256_ps512(sf)), neg_even);
        if (full) {
            _mm512_storeu_ps(fc + 2 * i, cd);
            _mm512_storeu_ps(fs + 2 * i, sd);
        } else {
            __mmask16 k16 = (__mmask16)((1u << (2 * (unsigned)__builtin_popcount(k8))) - 1u);
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

/* kvr__rope_step_scalar, 8 pairs at a time (the same products and sums). */
void kvr__rope_step_avx512(const double *stc, const double *sts, int n, double *c, double *s)
{
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512d c0 = _mm512_loadu_pd(c + i), s0 = _mm512_loadu_pd(s + i), a = _mm512_loadu_pd(stc + i), b = _mm512_loadu_pd(sts + i);
        _mm512_storeu_pd(c + i, _mm512_sub_pd(_mm512_mul_pd(c0, a), _mm512_mul_pd(s0, b)));
        _mm512_storeu_pd(s + i, _mm512_add_pd(_mm512_mul_pd(s0, a), _mm512_mul_pd(c0, b)));
    }
    for (; i < n; i++) {
        double c0 = c[i], s0 = s[i];
        c[i] = c0 * stc[i] - s0 * sts[i];
        s[i] = s0 * stc[i] + c0 * sts[i];
    }
}
