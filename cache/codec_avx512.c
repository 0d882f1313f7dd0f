/*
 * codec_avx512.c — AVX-512 (F/BW/VL/DQ) + F16C kernels for the uniform
 * INT8/INT4/INT2 codecs with f16 parameters (compiled with the Makefile's
 * AVX-512 flags; called only after kvr_isa_best() reported AVX512).
 *
 * They write exactly the scalar reference's bytes (codec.c), computing the
 * same values by other routes:
 *
 *   - Group ranges: 16 groups at a time. Per-token rows reduce each group to
 *     one vector of partial minima/maxima, then a 4-level shuffle tree turns
 *     16 such vectors into one vector of 16 groups' lo (and hi); KIVI key
 *     tiles are vectorised across channels, so a strip of 16 channels has
 *     its lo/hi after a vertical min/max over the G tokens, no reduction.
 *   - Parameters of the 16 groups at once (gparams16). m: the largest f16
 *     <= lo is exactly vcvtps2ph with rounding toward -inf (lo is normalised
 *     to +0 first, as the reference does, so -0 never appears). s: the
 *     coverage check m + L*s >= hi is EXACT in double when m and s are f16
 *     (L*s has <= 19 significant bits, and both terms are multiples of 2^-24
 *     below 2^25), so the reference's s is the smallest positive f16 with
 *     that check true. We start from (hi - m)/L in float rounded UP to f16
 *     and step up while the check fails, then down while the next lower f16
 *     still passes, in vectors; the fixed point is unique, hence the
 *     reference's bits. Typically one check each way.
 *   - Quantize: q = clamp(cvtps_epi32((x - m) * inv), 0, L): the same float
 *     subtract and multiply, RNE like rintf.
 *   - Decode (tiles): y = (float)q * s + m, multiply then add (no FMA).
 *
 * f32 parameters (not the default) and bf16 tiles are delegated to the AVX2
 * kernels; a row's short last group goes to the scalar kernel.
 *
 * KIVI tiles: a strip of 16 channels produces "packed vectors" PV[k], k
 * counting the packed bytes of a channel's group (lane = channel), with the
 * chunk packing of codec.h applied vertically (INT4: PV[16c+j] =
 * q[32c+j] | q[32c+j+16] << 4, ...); a 16x16 dword transpose turns 16 PVs
 * into 16 channels' 16 consecutive bytes. Decoding runs it backwards.
 */
#include "cache/codec.h"

#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
#include "cache/codec_avx2_inl.h"
#include "cache/codec_avx512_inl.h"

/* bits of 65504.0f: |x| <= 65504 (and not NaN) iff (bits & 0x7fffffff) <= it. */
#define F16_LIMIT_BITS 0x477FE000u

/* ---- loads with the range check ----------------------------------------- */

/* The same for 16 channels of one token row (masked: lanes >= cc read 0). */
AI __m512 ld16m(const void *src, size_t i, __mmask16 k, int h, __m512i *acc)
{
    if (h) {
        __m256i r = _mm256_maskz_loadu_epi16(k, (const uint16_t *)src + i);
        *acc = _mm512_max_epu16(*acc, _mm512_zextsi256_si512(
                   _mm256_and_si256(r, _mm256_set1_epi16(0x7fff))));
        return _mm512_cvtph_ps(r);
    }
    __m512 v = _mm512_maskz_loadu_ps(k, (const float *)src + i);
    *acc = _mm512_max_epu32(*acc, _mm512_and_si512(_mm512_castps_si512(v),
                                                   _mm512_set1_epi32(0x7fffffff)));
    return v;
}

/* ld16q with a mask (lanes not in k read 0). */
AI __m512 ld16qm(const void *src, size_t i, __mmask16 k, int h)
{
    if (h) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)src + i));
    return _mm512_maskz_loadu_ps(k, (const float *)src + i);
}

AI int acc_bad(__m512i acc, int h)
{
    if (h) {
        /* 16-bit lanes; the upper half of acc only ever held zeros. */
        return _mm512_cmpgt_epu16_mask(acc, _mm512_set1_epi16(0x7bff)) != 0;
    }
    return _mm512_cmpgt_epu32_mask(acc, _mm512_set1_epi32((int)F16_LIMIT_BITS)) != 0;
}

/* ---- parameters of 16 groups -------------------------------------------- */

/* m + L*s >= hi in double, per lane (exact for f16 m and s, see above). */
AI __mmask16 covers16(__m512 m, __m512 s, __m512 hi, __m512d vL)
{
    __m512d m0 = _mm512_cvtps_pd(_mm512_castps512_ps256(m));
    __m512d m1 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(m, 1));
    __m512d s0 = _mm512_cvtps_pd(_mm512_castps512_ps256(s));
    __m512d s1 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(s, 1));
    __m512d h0 = _mm512_cvtps_pd(_mm512_castps512_ps256(hi));
    __m512d h1 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(hi, 1));
    __mmask8 c0 = _mm512_cmp_pd_mask(_mm512_add_pd(m0, _mm512_mul_pd(vL, s0)), h0, _CMP_GE_OQ);
    __mmask8 c1 = _mm512_cmp_pd_mask(_mm512_add_pd(m1, _mm512_mul_pd(vL, s1)), h1, _CMP_GE_OQ);
    return (__mmask16)((unsigned)c0 | (unsigned)c1 << 8);
}

typedef struct gp16 {
    __m512  m, inv, s;
    __m512i hdr;        /* per lane: s bits | m bits << 16 (the stored 4 bytes, LE) */
} gp16;

/* kvr_codec_gparams_compute for 16 groups, f16 parameters. */
AI void gparams16(gp16 *p, __m512 lo, __m512 hi, unsigned bits)
{
    const __m512 z = _mm512_setzero_ps();
    const __m256i one = _mm256_set1_epi16(1);
    const __m512d vL = _mm512_set1_pd((double)((1u << bits) - 1));
    const float rL = bits == 8 ? 1.0f / 255.0f : bits == 4 ? 1.0f / 15.0f : 1.0f / 3.0f;
    lo = _mm512_add_ps(lo, z);
    hi = _mm512_add_ps(hi, z);
    __m256i mh = _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 m = _mm512_cvtph_ps(mh);
    __mmask16 act = _mm512_cmp_ps_mask(hi, m, _CMP_GT_OQ);
    __m512 d = _mm512_mul_ps(_mm512_sub_ps(hi, m), _mm512_set1_ps(rL));
    __m256i sh = _mm512_cvtps_ph(d, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
    sh = _mm256_maskz_max_epu16(act, sh, one);
    for (;;) {
        __mmask16 up = act & (__mmask16)~covers16(m, _mm512_cvtph_ps(sh), hi, vL);
        if (!up) break;
        sh = _mm256_mask_add_epi16(sh, up, sh, one);
    }
    for (;;) {
        __mmask16 cand = act & _mm256_cmpgt_epu16_mask(sh, one);
        if (!cand) break;
        __m256i lower = _mm256_sub_epi16(sh, one);
        __mmask16 dn = cand & covers16(m, _mm512_cvtph_ps(lower), hi, vL);
        if (!dn) break;
        sh = _mm256_mask_sub_epi16(sh, dn, sh, one);
    }
    p->m = m;
    p->s = _mm512_cvtph_ps(sh);
    p->inv = _mm512_maskz_div_ps(act, _mm512_set1_ps(1.0f), p->s);
    p->hdr = _mm512_or_si512(_mm512_cvtepu16_epi32(sh),
                             _mm512_slli_epi32(_mm512_cvtepu16_epi32(mh), 16));
}

/* ---- 16 vectors -> one vector of 16 reductions --------------------------- */

/* r[j] holds partial minima (or maxima) of group j; returns lane j = group j. */
#define RED16(NAME, OP)                                                                   \
    AI __m512 NAME(const __m512 r[16])                                                    \
    {                                                                                     \
        __m512 a[8], b[4], c[2];                                                          \
        for (int i = 0; i < 8; i++)                                                       \
            a[i] = OP(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x44),                 \
                      _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xEE));                \
        for (int i = 0; i < 4; i++)                                                       \
            b[i] = OP(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),                 \
                      _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));                \
        for (int i = 0; i < 2; i++)                                                       \
            c[i] = OP(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)), \
                      _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));\
        __m512 d = OP(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),             \
                      _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));            \
        /* lane 4k + j now holds group k + 4j */                                          \
        const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14,     \
                                              3, 7, 11, 15);                              \
        return _mm512_permutexvar_ps(idx, d);                                             \
    }
RED16(red16_min, _mm512_min_ps)
RED16(red16_max, _mm512_max_ps)

/* ---- rows --------------------------------------------------------------- */

AI __m512i quant16(__m512 x, __m512 vm, __m512 vinv, __m512i vL)
{
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(x, vm), vinv));
    return _mm512_min_epi32(_mm512_max_epi32(q, _mm512_setzero_si512()), vL);
}

/* quant16 for the values of a row's own group (every x in [lo, hi] of the
 * group): the clamp never acts, so it is left out. x >= lo >= m makes
 * x - m >= 0, and inv >= 0. Above: the coverage check makes hi - m <= L*s
 * in reals, and L*s (19 significant bits) is a float, so fl(x - m) <=
 * fl(hi - m) <= L*s; with inv = fl(1/s) <= (1 + 2^-24)/s the product
 * rounds to at most L * (1 + 2^-24)^2 < L + 1/2 (L <= 255), which rounds
 * to at most L. An inactive group (s = 0) has inv = 0: q = 0. */
AI __m512i quant16_own(__m512 x, __m512 vm, __m512 vinv)
{
    return _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(x, vm), vinv));
}

/* The 16 values at src[i] quantized; with M, the values they decode to
 * (y = q * s + m, multiply then add, as every decoder computes them) are
 * measured against them into L's lanes ln*16 .. ln*16 + 15 at once (src a
 * row's start, i = ln*16 mod 64; ln a constant where it is called, so the
 * lane's choice folds away). */
AI __m512i quant16m(const void *src, size_t i, __m512 vm, __m512 vinv, int h, const int M,
                    mlanes *L, const int ln, __m512 vs)
{
    __m512 x = ld16q(src, i, h);
    __m512i q = quant16_own(x, vm, vinv);
    if (M)
        mlanes_acc(L, (size_t)ln * 16, x,
                   _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), vs), vm));
    return q;
}

/* Quantizes and packs one full group (params already chosen; vs the
 * group's scale, for the measure when M). A group of 64 or more starts on
 * lane 0 and its 32-value chunks take lanes 0-31, 32-63 in turn; a group
 * of 32 takes the half its place in the row gives. */
AI void quant_group(uint8_t *qs, const void *src, size_t base, uint32_t G, unsigned bits,
                    __m512 vm, __m512 vinv, int h, const int M, mlanes *L, __m512 vs)
{
    const size_t nc = G / 32;
#define QM(I, LN) quant16m(src, I, vm, vinv, h, M, L, LN, vs)
/* chunk C (32 values) of the group, its lanes from LN */
#define CHUNK(C, LN)                                                                        \
    do {                                                                                    \
        __m512i q0 = QM(base + 32 * (C), LN), q1 = QM(base + 32 * (C) + 16, (LN) + 1);      \
        if (bits == 8) {                                                                    \
            _mm_storeu_si128((__m128i *)(qs + 32 * (C)), _mm512_cvtepi32_epi8(q0));         \
            _mm_storeu_si128((__m128i *)(qs + 32 * (C) + 16), _mm512_cvtepi32_epi8(q1));    \
        } else if (bits == 4) {                                                             \
            _mm_storeu_si128((__m128i *)(qs + 16 * (C)),                                    \
                             _mm512_cvtepi32_epi8(_mm512_or_si512(q0, _mm512_slli_epi32(q1, 4)))); \
        } else {   /* INT2, a group of 32: the chunk alone */                               \
            __m512i p0 = _mm512_or_si512(q0, _mm512_slli_epi32(q1, 4));                     \
            __m512i hi = _mm512_shuffle_i32x4(p0, p0, 0xEE);                                \
            _mm_storel_epi64((__m128i *)(qs + 8 * (C)),                                     \
                             _mm512_cvtepi32_epi8(_mm512_or_si512(p0, _mm512_slli_epi32(hi, 2)))); \
        }                                                                                   \
    } while (0)
    /* only groups that are never measured (96, 160, ..) have an odd count
     * of chunks past one: a measured group is a power of two */
    size_t c = 0;
    if (nc == 1) {
        if (M && (base & 32)) CHUNK(0, 2);
        else                  CHUNK(0, 0);
        return;
    }
    for (; c + 2 <= nc; c += 2) {
        if (bits != 2) {
            CHUNK(c, 0);
            CHUNK(c + 1, 2);
            continue;
        }
        __m512i a0 = QM(base + 32 * c, 0), a1 = QM(base + 32 * c + 16, 1);
        __m512i a2 = QM(base + 32 * c + 32, 2), a3 = QM(base + 32 * c + 48, 3);
        __m512i p0 = _mm512_or_si512(a0, _mm512_slli_epi32(a1, 4));
        __m512i p1 = _mm512_or_si512(a2, _mm512_slli_epi32(a3, 4));
        __m512i lo = _mm512_shuffle_i32x4(p0, p1, 0x44), hi = _mm512_shuffle_i32x4(p0, p1, 0xEE);
        _mm_storeu_si128((__m128i *)(qs + 8 * c),
                         _mm512_cvtepi32_epi8(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 2))));
    }
    if (c < nc)
        CHUNK(c, 0);
#undef CHUNK
#undef QM
}

/* Full groups of n values, 16 at a time; returns the groups done or -1 on
 * a bad value. With M, src..src+n is one row whose groups are all full (G
 * divides n), measured as it is quantized: its e and q go to *pe, *pq, and
 * *wide says the row is to be measured wide instead (err_finish16). */
AI long enc_rows(uint8_t *dst, const void *src, size_t n, const unsigned bits, const uint32_t G,
                 const int h, const int M, double *pe, double *pq, bool *wide)
{
    const size_t gb = 4 + (size_t)G * bits / 8, ng = n / G, nv = G / 16;
    __m512i acc = _mm512_setzero_si512();
    mlanes L = MLANES_ZERO;
    __m512d E[8], Q[8];   /* set by the first flush */
    int first_ = 1;
    for (size_t g0 = 0; g0 < ng; g0 += 16) {
        size_t k = ng - g0 < 16 ? ng - g0 : 16;
        __m512 mn[16], mx[16];
        for (size_t j = 0; j < k; j++) {
            size_t base = (g0 + j) * G;
            __m512 v = ld16(src, base, h, &acc), a = v, b = v;
            for (size_t i = 1; i < nv; i++) {
                v = ld16(src, base + 16 * i, h, &acc);
                a = _mm512_min_ps(a, v);
                b = _mm512_max_ps(b, v);
            }
            mn[j] = a;
            mx[j] = b;
        }
        if (acc_bad(acc, h)) return -1;
        for (size_t j = k; j < 16; j++) {   /* padding lanes: any finite range */
            mn[j] = _mm512_setzero_ps();
            mx[j] = _mm512_setzero_ps();
        }
        gp16 p;
        gparams16(&p, red16_min(mn), red16_max(mx), bits);
        float vm[16], vinv[16], vs[16];
        uint32_t hdr[16];
        _mm512_storeu_ps(vm, p.m);
        _mm512_storeu_ps(vinv, p.inv);
        _mm512_storeu_ps(vs, p.s);
        _mm512_storeu_si512(hdr, p.hdr);
        for (size_t j = 0; j < k; j++) {
            uint8_t *o = dst + (g0 + j) * gb;
            memcpy(o, &hdr[j], 4);
            quant_group(o + 4, src, (g0 + j) * G, G, bits, _mm512_set1_ps(vm[j]),
                        _mm512_set1_ps(vinv[j]), h, M, &L, _mm512_set1_ps(vs[j]));
            /* a block of the measure ends on a group's end (G divides it) */
            size_t end = (g0 + j + 1) * G;
            if (M && (end % KVR_ERR_BLOCK == 0 || end == n)) {
                ERR_FLUSH_ALL(L);
                L = MLANES_ZERO;
                first_ = 0;
            }
        }
    }
    if (M)
        *wide = !err_finish16(E, Q, pe, pq);
    return (long)ng;
}

/* One loop per (bits, input) and a constant group for the default 64: the
 * group's loops unroll and the bit width's branches fold away. */
AI long enc_rows_any(uint8_t *dst, const void *src, size_t n, unsigned bits, uint32_t G,
                     const int h)
{
#define ER(B)                                                                           \
    return G == 64 ? enc_rows(dst, src, n, B, 64, h, 0, NULL, NULL, NULL)                \
                   : enc_rows(dst, src, n, B, G, h, 0, NULL, NULL, NULL)
    if (bits == 8) ER(8);
    if (bits == 4) ER(4);
    ER(2);
#undef ER
}

/* A row: its full groups (f16 parameters), then its short last group with
 * the scalar kernel; f32 parameters: the AVX2 kernel (h: f16 input). */
AI int enc_row(uint8_t *dst, const void *src, size_t n, unsigned bits, uint32_t group,
               kvr_codec_params params, const int h)
{
    if (params != KVR_CODEC_PARAMS_F16)
        return h ? kvr_codec_kernels_avx2.enc_f16(dst, src, n, bits, group, params)
                 : kvr_codec_kernels_avx2.enc_f32(dst, src, n, bits, group, params);
    long ng = enc_rows_any(dst, src, n, bits, group, h);
    if (ng < 0) return -1;
    size_t i = (size_t)ng * group;
    if (i == n) return 0;
    dst += (size_t)ng * (4 + group * bits / 8);
    return h ? kvr_codec_kernels_scalar.enc_f16(dst, (const uint16_t *)src + i, n - i, bits,
                                                group, params)
             : kvr_codec_kernels_scalar.enc_f32(dst, (const float *)src + i, n - i, bits,
                                                group, params);
}

static int x5_enc_f32(uint8_t *dst, const float *src, size_t n, unsigned bits,
                      uint32_t group, kvr_codec_params params)
{
    return enc_row(dst, src, n, bits, group, params, 0);
}

static int x5_enc_f16(uint8_t *dst, const uint16_t *src, size_t n, unsigned bits,
                      uint32_t group, kvr_codec_params params)
{
    return enc_row(dst, src, n, bits, group, params, 1);
}

/* ---- KIVI tiles --------------------------------------------------------- */

/* 16x16 dword transpose in registers. */
AI void tr16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i]     = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
        __m512i u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        __m512i u2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        __m512i u3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        t[j]      = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[4 + j]  = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        t[8 + j]  = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Encodes a strip of cc <= 16 channels starting at channel c0. */
AI int tile_enc_strip(uint8_t *dst, const void *src, size_t c0, size_t cc, size_t ld, size_t G,
                      unsigned bits, int h)
{
    const size_t gb = 4 + G * bits / 8, nbytes = G * bits / 8;
    const __mmask16 km = cc >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cc) - 1);
    __m512i acc = _mm512_setzero_si512();
    __m512 lo = ld16m(src, c0, km, h, &acc), hi = lo;
    for (size_t t = 1; t < G; t++) {
        __m512 v = ld16m(src, t * ld + c0, km, h, &acc);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    if (acc_bad(acc, h)) return -1;
    gp16 p;
    gparams16(&p, lo, hi, bits);
    uint32_t hdr[16];
    _mm512_storeu_si512(hdr, p.hdr);
    for (size_t j = 0; j < cc; j++) memcpy(dst + (c0 + j) * gb, &hdr[j], 4);
    const __m512i vL = _mm512_set1_epi32((1 << bits) - 1);
#define QT(t) quant16(ld16qm(src, (size_t)(t) * ld + c0, km, h), p.m, p.inv, vL)
    for (size_t blk = 0; blk * 16 < nbytes; blk++) {
        __m512i pv[16];
        size_t w = nbytes - blk * 16 < 16 ? 8 : 16;   /* bytes per channel in this block */
        if (bits == 8) {
            for (int j = 0; j < 16; j++) pv[j] = QT(16 * blk + (size_t)j);
        } else if (bits == 4) {
            for (int j = 0; j < 16; j++)
                pv[j] = _mm512_or_si512(QT(32 * blk + (size_t)j),
                                        _mm512_slli_epi32(QT(32 * blk + 16 + (size_t)j), 4));
        } else {
            for (size_t half = 0; half < 2; half++) {
                size_t t0 = 64 * blk + 32 * half;
                for (size_t j = 0; j < 8; j++) {
                    if (half && w == 8) {
                        pv[8 + j] = _mm512_setzero_si512();
                        continue;
                    }
                    __m512i a = _mm512_or_si512(QT(t0 + j), _mm512_slli_epi32(QT(t0 + j + 8), 2));
                    __m512i b = _mm512_or_si512(_mm512_slli_epi32(QT(t0 + j + 16), 4),
                                                _mm512_slli_epi32(QT(t0 + j + 24), 6));
                    pv[8 * half + j] = _mm512_or_si512(a, b);
                }
            }
        }
        tr16(pv);
        for (size_t j = 0; j < cc; j++) {
            __m128i b = _mm512_cvtepi32_epi8(pv[j]);
            uint8_t *o = dst + (c0 + j) * gb + 4 + 16 * blk;
            if (w == 16) _mm_storeu_si128((__m128i *)o, b);
            else _mm_storel_epi64((__m128i *)o, b);
        }
    }
#undef QT
    return 0;
}

static int x5_tile_enc(uint8_t *dst, const void *src, kvr_dtype t, size_t n_ch, size_t ld,
                       size_t G, unsigned bits, kvr_codec_params params)
{
    if (params != KVR_CODEC_PARAMS_F16 || (t != KVR_DTYPE_F16 && t != KVR_DTYPE_F32))
        return 1;
    int h = t == KVR_DTYPE_F16;
    for (size_t c0 = 0; c0 < n_ch; c0 += 16) {
        size_t cc = n_ch - c0 < 16 ? n_ch - c0 : 16;
        int rc = h ? tile_enc_strip(dst, src, c0, cc, ld, G, bits, 1)
                   : tile_enc_strip(dst, src, c0, cc, ld, G, bits, 0);
        if (rc) return rc;
    }
    return 0;
}

/* st16 of the lanes in k. */
AI void st16m(void *dst, size_t i, __mmask16 k, __m512 y, int h)
{
    if (h) _mm256_mask_storeu_epi16((uint16_t *)dst + i, k, to_f16_clamped(y));
    else   _mm512_mask_storeu_ps((float *)dst + i, k, y);
}

AI void tile_dec_strip(void *dst, size_t ld, const uint8_t *src, size_t c0, size_t cc, size_t G,
                       unsigned bits, int h)
{
    const size_t gb = 4 + G * bits / 8, nbytes = G * bits / 8;
    const __mmask16 km = cc >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cc) - 1);
    uint32_t hdr[16] = { 0 };
    for (size_t j = 0; j < cc; j++) memcpy(&hdr[j], src + (c0 + j) * gb, 4);
    __m512i hv = _mm512_loadu_si512(hdr);
    const __m512 s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hv));
    const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hv, 16)));
#define DT(t, q) st16m(dst, (size_t)(t) * ld + c0, km, \
                       _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), s), m), h)
    for (size_t blk = 0; blk * 16 < nbytes; blk++) {
        __m512i pv[16];
        size_t w = nbytes - blk * 16 < 16 ? 8 : 16;
        for (size_t j = 0; j < 16; j++) {
            if (j >= cc) {
                pv[j] = _mm512_setzero_si512();
                continue;
            }
            const uint8_t *in = src + (c0 + j) * gb + 4 + 16 * blk;
            __m128i b = w == 16 ? _mm_loadu_si128((const __m128i *)in)
                                : _mm_loadl_epi64((const __m128i *)in);
            pv[j] = _mm512_cvtepu8_epi32(b);
        }
        tr16(pv);
        if (bits == 8) {
            for (size_t j = 0; j < 16; j++) DT(16 * blk + j, pv[j]);
        } else if (bits == 4) {
            const __m512i m4 = _mm512_set1_epi32(15);
            for (size_t j = 0; j < 16; j++) {
                DT(32 * blk + j, _mm512_and_si512(pv[j], m4));
                DT(32 * blk + 16 + j, _mm512_srli_epi32(pv[j], 4));
            }
        } else {
            const __m512i m2 = _mm512_set1_epi32(3);
            for (size_t half = 0; half < (w == 16 ? 2u : 1u); half++) {
                size_t t0 = 64 * blk + 32 * half;
                for (size_t j = 0; j < 8; j++) {
                    __m512i v = pv[8 * half + j];
                    DT(t0 + j, _mm512_and_si512(v, m2));
                    DT(t0 + j + 8, _mm512_and_si512(_mm512_srli_epi32(v, 2), m2));
                    DT(t0 + j + 16, _mm512_and_si512(_mm512_srli_epi32(v, 4), m2));
                    DT(t0 + j + 24, _mm512_srli_epi32(v, 6));
                }
            }
        }
    }
#undef DT
}

static int x5_tile_dec(void *dst, kvr_dtype t, size_t ld, const uint8_t *src, size_t n_ch,
                       size_t G, unsigned bits, kvr_codec_params params)
{
    if (params != KVR_CODEC_PARAMS_F16 || (t != KVR_DTYPE_F16 && t != KVR_DTYPE_F32))
        return 1;
    for (size_t c0 = 0; c0 < n_ch; c0 += 16) {
        size_t cc = n_ch - c0 < 16 ? n_ch - c0 : 16;
        if (t == KVR_DTYPE_F16) tile_dec_strip(dst, ld, src, c0, cc, G, bits, 1);
        else tile_dec_strip(dst, ld, src, c0, cc, G, bits, 0);
    }
    return 0;
}

/* Row decoding, f16 parameters: a group's 32-quant chunks become two
 * vectors of 16 (unpack_chunk, as the AVX2 kernel unpacks them),
 * y = (float)q * s + m as a multiply then an add, f16 output clamped
 * to +-65504 and rounded to nearest even: the scalar reference's values.
 * f32 parameters and a row's short last group: the AVX2 / scalar kernels. */
AI size_t dec_rows16(void *dst, const uint8_t *src, size_t n, const unsigned bits,
                     const uint32_t G, const int h, const int nt)
{
    const size_t gb = 4 + (size_t)G * bits / 8;
    size_t i = 0;
    for (; i + G <= n; i += G, src += gb) {
        uint16_t sh, mh;
        memcpy(&sh, src, 2);
        memcpy(&mh, src + 2, 2);
        const __m512 vs = _mm512_set1_ps(_cvtsh_ss(sh)), vm = _mm512_set1_ps(_cvtsh_ss(mh));
        const uint8_t *qs = src + 4;
        for (size_t c = 0; c < G / 32; c++) {
            __m128i Q0, Q1;
            unpack_chunk(qs, c, bits, &Q0, &Q1);
            __m512 y0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(Q0)), vs), vm);
            __m512 y1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(Q1)), vs), vm);
            if (nt) {
                st32_nt(dst, i + 32 * c, y0, y1, h);
            } else {
                st16(dst, i + 32 * c, y0, h);
                st16(dst, i + 32 * c + 16, y1, h);
            }
        }
    }
    return i;
}

/* One loop per (bits, output), and a constant group for the default 64. */
AI size_t dec_rows_any(void *dst, const uint8_t *src, size_t n, unsigned bits, uint32_t G,
                       const int h, const int nt)
{
#define DR(B) return G == 64 ? dec_rows16(dst, src, n, B, 64, h, nt) \
                             : dec_rows16(dst, src, n, B, G, h, nt)
    if (bits == 8) DR(8);
    if (bits == 4) DR(4);
    DR(2);
#undef DR
}

/* Elements [i, n) of a row (its short last group) with the scalar kernel. */
static void dec_tail(void *dst, const uint8_t *src, size_t i, size_t n, unsigned bits,
                     uint32_t group, kvr_codec_params params, int h)
{
    src += i / group * (4 + group * bits / 8);
    if (h) kvr_codec_kernels_scalar.dec_f16((uint16_t *)dst + i, src, n - i, bits, group, params);
    else   kvr_codec_kernels_scalar.dec_f32((float *)dst + i, src, n - i, bits, group, params);
}

/* A row (h: f16 output); f32 parameters: the AVX2 kernel. */
AI void dec_row(void *dst, const uint8_t *src, size_t n, unsigned bits, uint32_t group,
                kvr_codec_params params, const int h)
{
    if (params != KVR_CODEC_PARAMS_F16) {
        if (h) kvr_codec_kernels_avx2.dec_f16(dst, src, n, bits, group, params);
        else   kvr_codec_kernels_avx2.dec_f32(dst, src, n, bits, group, params);
        return;
    }
    size_t i = dec_rows_any(dst, src, n, bits, group, h, 0);
    if (i < n) dec_tail(dst, src, i, n, bits, group, params, h);
}

static void x5_dec_f32(float *dst, const uint8_t *src, size_t n, unsigned bits,
                       uint32_t group, kvr_codec_params params)
{
    dec_row(dst, src, n, bits, group, params, 0);
}

static void x5_dec_f16(uint16_t *dst, const uint8_t *src, size_t n, unsigned bits,
                       uint32_t group, kvr_codec_params params)
{
    dec_row(dst, src, n, bits, group, params, 1);
}

/* dec_f32 / dec_f16 with non-temporal stores (codec.h: dec_nt): dst on 64
 * bytes; the row's short last group, if any, with ordinary stores; fenced. */
static bool x5_dec_nt(void *dst, kvr_dtype dt, const uint8_t *src, size_t n, unsigned bits,
                      uint32_t group, kvr_codec_params params)
{
    if (params != KVR_CODEC_PARAMS_F16 || (uintptr_t)dst % 64 ||
        (dt != KVR_DTYPE_F16 && dt != KVR_DTYPE_F32))
        return false;
    const int h = dt == KVR_DTYPE_F16;
    size_t i = h ? dec_rows_any(dst, src, n, bits, group, 1, 1)
                 : dec_rows_any(dst, src, n, bits, group, 0, 1);
    _mm_sfence();
    if (i < n) dec_tail(dst, src, i, n, bits, group, params, h);
    return true;
}

static void x5_tile_gather(float *buf, const void *src, kvr_dtype t, size_t G, size_t ld,
                           size_t cc)
{
    kvr_codec_kernels_avx2.tile_gather(buf, src, t, G, ld, cc);
}

static void x5_tile_scatter(void *dst, kvr_dtype t, size_t ld, const float *buf, size_t G,
                            size_t cc)
{
    kvr_codec_kernels_avx2.tile_scatter(dst, t, ld, buf, G, cc);
}

static inline void x5_err_row(const void *ref, const float *dec, size_t len, double *pe,
                              double *pq, int h)
{
    __m512d E[8], Q[8];   /* set by the first flush */
    float rt[KVR_ERR_LANES], dt[KVR_ERR_LANES];
    for (size_t b = 0; b < len; b += KVR_ERR_BLOCK) {
        const int first_ = b == 0;
        size_t end = len - b < KVR_ERR_BLOCK ? len : b + KVR_ERR_BLOCK;
        size_t full = b + (end - b) / KVR_ERR_LANES * KVR_ERR_LANES, rest = end - full;
        mlanes L = MLANES_ZERO;
        for (size_t k = b; k < full; k += KVR_ERR_LANES) {
            ERR_ACC(err_ref16(ref, k, h), _mm512_loadu_ps(dec + k), L.e0, L.q0);
            ERR_ACC(err_ref16(ref, k + 16, h), _mm512_loadu_ps(dec + k + 16), L.e1, L.q1);
            ERR_ACC(err_ref16(ref, k + 32, h), _mm512_loadu_ps(dec + k + 32), L.e2, L.q2);
            ERR_ACC(err_ref16(ref, k + 48, h), _mm512_loadu_ps(dec + k + 48), L.e3, L.q3);
        }
        if (rest) {
            for (size_t j = 0; j < KVR_ERR_LANES; j++) {
                rt[j] = j >= rest ? 0.0f
                        : h ? kvr_f16_to_f32(((const uint16_t *)ref)[full + j])
                            : ((const float *)ref)[full + j];
                dt[j] = j >= rest ? 0.0f : dec[full + j];
            }
            ERR_ACC(_mm512_loadu_ps(rt), _mm512_loadu_ps(dt), L.e0, L.q0);
            ERR_ACC(_mm512_loadu_ps(rt + 16), _mm512_loadu_ps(dt + 16), L.e1, L.q1);
            ERR_ACC(_mm512_loadu_ps(rt + 32), _mm512_loadu_ps(dt + 32), L.e2, L.q2);
            ERR_ACC(_mm512_loadu_ps(rt + 48), _mm512_loadu_ps(dt + 48), L.e3, L.q3);
        }
        ERR_FLUSH_ALL(L);
    }
    if (!err_finish16(E, Q, pe, pq))
        kvr_codec_err_row_wide(ref, h, dec, len, pe, pq);
}

/* kvr_codec_encode_measured: rows encoded as enc_f32 / enc_f16 encode
 * them (the same bytes), each measured as it is quantized (enc_rows with
 * M). 0, or -1 at a bad value. */
AI int enc_err_rows(uint8_t *dst, const void *src, size_t n_rows, size_t len,
                    const unsigned bits, const uint32_t G, const int h, double *e, double *q,
                    bool *wide)
{
    const size_t rb = len / G * (4 + (size_t)G * bits / 8), es = h ? 2 : 4;
    for (size_t i = 0; i < n_rows; i++)
        if (enc_rows(dst + i * rb, (const char *)src + i * len * es, len, bits, G, h, 1, &e[i],
                     &q[i], &wide[i]) < 0)
            return -1;
    return 0;
}

/* One loop per bit width and input, and a constant group for the default
 * 64. */
static int x5_enc_err_rows(uint8_t *dst, const void *src, int h, size_t n_rows, size_t len,
                           unsigned bits, uint32_t G, double *e, double *q, bool *wide)
{
#define EH(B, GG) return h ? enc_err_rows(dst, src, n_rows, len, B, GG, 1, e, q, wide)      \
                           : enc_err_rows(dst, src, n_rows, len, B, GG, 0, e, q, wide)
#define EE(B) do {                                                                     \
        if (G == 64) EH(B, 64);                                                        \
        EH(B, G);                                                                      \
    } while (0)
    if (bits == 8) EE(8);
    if (bits == 4) EE(4);
    EE(2);
#undef EE
#undef EH
}

static void x5_err_rows(const float *ref, const float *dec, size_t n_rows, size_t len,
                        double *e, double *q)
{
    for (size_t i = 0; i < n_rows; i++)
        x5_err_row(ref + i * len, dec + i * len, len, &e[i], &q[i], 0);
}

static void x5_err_rows_h(const uint16_t *ref, const float *dec, size_t n_rows, size_t len,
                          double *e, double *q)
{
    for (size_t i = 0; i < n_rows; i++)
        x5_err_row(ref + i * len, dec + i * len, len, &e[i], &q[i], 1);
}

const kvr_codec_kernels kvr_codec_kernels_avx512 = {
    .enc_f32 = x5_enc_f32, .enc_f16 = x5_enc_f16,
    .dec_f32 = x5_dec_f32, .dec_f16 = x5_dec_f16, .dec_nt = x5_dec_nt,
    .tile_gather = x5_tile_gather, .tile_scatter = x5_tile_scatter,
    .tile_enc = x5_tile_enc, .tile_dec = x5_tile_dec,
    .ggml_enc = kvr_codec_ggml_enc_avx512, .ggml_dec = kvr_codec_ggml_dec_avx512,
    .ggml_dec_nt = kvr_codec_ggml_dec_nt_avx512, .ggml_enc_err = kvr_codec_ggml_enc_err_avx512,
    .err_rows = x5_err_rows, .err_rows_h = x5_err_rows_h, .enc_err_rows = x5_enc_err_rows,
};
