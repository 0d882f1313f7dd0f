/*
 * sincos_simd_inl.h — the vector bodies shared by sincos_avx2.c (4 doubles
 * a vector) and sincos_avx512.c (8): the sin/cos kernel before its
 * quadrant (Cody-Waite reduction by pi/2 in three pieces, fdlibm's kernel
 * polynomials) and the table step of kvr__rope_step_scalar.
 *
 * Invariant: unless asked for the fused variant, every lane performs exactly
 * the scalar reference's double operations in its order, each one
 * IEEE-rounded: plain multiplies, adds and subtracts, and both files are
 * built with -ffp-contract=off, so none becomes a fused multiply-add.
 *
 * Include from those files only, after defining for the file's width:
 *   VD                     the vector of doubles (__m256d, __m512d)
 *   VD_W                   its lanes
 *   VD_SET1, VD_ADD, VD_SUB, VD_MUL, VD_FMADD, VD_FNMADD, VD_LOADU, VD_STOREU
 *                          the _pd intrinsics of that width
 * The quadrant (which result is the sine, and the signs) is each file's
 * own: it takes different instructions at each width.
 */
#ifndef KVR_ROPE_SINCOS_SIMD_INL_H
#define KVR_ROPE_SINCOS_SIMD_INL_H

/* sin and cos of the remainder r = x - k * pi/2 in *sr and *cr; returns
 * the rounded quotient k plus 0x1.8p52, whose low bits are k's (the
 * quadrant). fused (a constant): every c + a*b and c - a*b is one fused
 * multiply-add instead, for sincos_avx512.c's fast float table only: half
 * the operations, results within a few ulps of the reference's, not equal
 * (see there). */
static inline __attribute__((always_inline)) VD sincos_kernel(VD x, VD *sr, VD *cr,
                                                              const int fused)
{
#define C(v) VD_SET1(v)
#define MA(a, b, c) (fused ? VD_FMADD((a), (b), (c)) : VD_ADD((c), VD_MUL((a), (b))))   /* c + a*b */
#define MS(a, b, c) (fused ? VD_FNMADD((a), (b), (c)) : VD_SUB((c), VD_MUL((a), (b))))  /* c - a*b */
    const VD shift = C(0x1.8p52);
    VD kk = MA(x, C(M_2_PI), shift);
    VD k = VD_SUB(kk, shift);
    VD r = MS(k, C(ROPE_PIO2_1), x);
    r = MS(k, C(ROPE_PIO2_2), r);
    r = MS(k, C(ROPE_PIO2_3), r);
    VD z = VD_MUL(r, r);
    VD ps = MA(z, C(ROPE_S6), C(ROPE_S5));
    ps = MA(z, ps, C(ROPE_S4));
    ps = MA(z, ps, C(ROPE_S3));
    ps = MA(z, ps, C(ROPE_S2));
    ps = MA(z, ps, C(ROPE_S1));
    *sr = MA(VD_MUL(r, z), ps, r);
    VD pc = MA(z, C(ROPE_C6), C(ROPE_C5));
    pc = MA(z, pc, C(ROPE_C4));
    pc = MA(z, pc, C(ROPE_C3));
    pc = MA(z, pc, C(ROPE_C2));
    pc = MA(z, pc, C(ROPE_C1));
    *cr = MA(VD_MUL(z, z), pc, MS(C(0.5), z, C(1.0)));
#undef MS
#undef MA
#undef C
    return kk;
}

/* kvr__rope_step_scalar, VD_W pairs at a time (the same products and sums). */
static inline void rope_step(const double *stc, const double *sts, int n, double *c, double *s)
{
    int i = 0;
    for (; i + VD_W <= n; i += VD_W) {
        VD c0 = VD_LOADU(c + i), s0 = VD_LOADU(s + i), a = VD_LOADU(stc + i), b = VD_LOADU(sts + i);
        VD_STOREU(c + i, VD_SUB(VD_MUL(c0, a), VD_MUL(s0, b)));
        VD_STOREU(s + i, VD_ADD(VD_MUL(s0, a), VD_MUL(c0, b)));
    }
    for (; i < n; i++) {
        double c0 = c[i], s0 = s[i];
        c[i] = c0 * stc[i] - s0 * sts[i];
        s[i] = s0 * stc[i] + c0 * sts[i];
    }
}

#endif /* KVR_ROPE_SINCOS_SIMD_INL_H */
