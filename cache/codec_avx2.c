/*
 * codec_avx2.c — AVX2/FMA/F16C kernels for the uniform INT8/INT4/INT2 codecs
 * (compiled with -mavx2 -mfma -mf16c; called only after the CPU was checked).
 *
 * They must write exactly the bytes of the scalar reference in codec.c, so
 * they use the same operations in the same order: min/max (the -0/+0
 * ambiguity is removed in kvr_codec_gparams_compute), parameters from the
 * shared scalar function, q = cvtps_epi32((x - m) * inv) (RNE, like rintf),
 * y = q*s + m as a separate multiply and add (never an FMA, which would round
 * once instead of twice). A row's short last group goes to the scalar kernel.
 *
 * Chunk packing (32 quants, see codec.h), after the four vectors of eight
 * 32-bit quants are narrowed to bytes B[0..31] in order:
 *   INT4: lo128 | hi128 << 4             -> byte j = B[j] | B[j+16] << 4
 *   INT2: a = lo128 | hi128 << 4, then a[0..7] | a[8..15] << 2
 */
#include "cache/codec.h"

#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
#include "cache/codec_inl.h"
#include "cache/codec_avx2_inl.h"

/* kvr_codec_scale_covers, inlined (the same double expression). */
AI int covers(float m, float s, float hi, double L)
{
    return (double)m + L * (double)s >= (double)hi;
}

/* kvr_codec_gparams_compute for f16 parameters with F16C conversions and a
 * float first guess; the result is the same unique (m, s) pair. */
AI void gparams(kvr_codec_gparams *gp, float lo, float hi, unsigned bits,
                kvr_codec_params params)
{
    if (params == KVR_CODEC_PARAMS_F32) {
        kvr_codec_gparams_compute(gp, lo, hi, bits, params);
        return;
    }
    lo = lo + 0.0f;
    hi = hi + 0.0f;
    uint16_t mh = _cvtss_sh(lo, _MM_FROUND_TO_NEAREST_INT);
    if (_cvtsh_ss(mh) > lo) mh = f16_down(mh);
    float m = _cvtsh_ss(mh);
    uint16_t sh = 0;
    if (hi > m) {
        const double L = (double)((1u << bits) - 1);
        const float rL = bits == 8 ? 1.0f / 255.0f : bits == 4 ? 1.0f / 15.0f : 1.0f / 3.0f;
        sh = _cvtss_sh((hi - m) * rL, _MM_FROUND_TO_NEAREST_INT);   /* a guess */
        if (sh == 0) sh = 1;
        while (!covers(m, _cvtsh_ss(sh), hi, L)) sh = f16_up(sh);
        while (sh > 1 && covers(m, _cvtsh_ss((uint16_t)(sh - 1)), hi, L)) sh--;
    }
    gp->m = m;
    gp->s = _cvtsh_ss(sh);
    gp->m_bits = mh;
    gp->s_bits = sh;
    gp->inv = gp->s > 0.0f ? 1.0f / gp->s : 0.0f;
}

/* One full group of G values at src[i0..]; returns bytes written or 0 if a
 * value is non-finite or beyond the parameters' range. */
AI size_t enc_group(uint8_t *dst, const void *src, size_t i0, uint32_t G, unsigned bits,
                    kvr_codec_params params, int h)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 lim = _mm256_set1_ps(params == KVR_CODEC_PARAMS_F32 ? KVR_CODEC_F32_LIMIT
                                                                     : KVR_CODEC_F16_LIMIT);
    __m256 v = ld8(src, i0, h);
    __m256 vmin = v, vmax = v;
    __m256 ok = _mm256_cmp_ps(_mm256_and_ps(v, absmask), lim, _CMP_LE_OQ);
    for (size_t i = 8; i < G; i += 8) {
        v = ld8(src, i0 + i, h);
        vmin = _mm256_min_ps(vmin, v);
        vmax = _mm256_max_ps(vmax, v);
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(v, absmask), lim, _CMP_LE_OQ));
    }
    if (_mm256_movemask_ps(ok) != 0xFF) return 0;

    kvr_codec_gparams gp;
    gparams(&gp, hmin8(vmin), hmax8(vmax), bits, params);
    size_t pb;
    if (params == KVR_CODEC_PARAMS_F32) {
        memcpy(dst, &gp.s_bits, 4);
        memcpy(dst + 4, &gp.m_bits, 4);
        pb = 8;
    } else {
        uint16_t sh = (uint16_t)gp.s_bits, mh = (uint16_t)gp.m_bits;
        memcpy(dst, &sh, 2);
        memcpy(dst + 2, &mh, 2);
        pb = 4;
    }
    uint8_t *qs = dst + pb;
    const __m256 vm = _mm256_set1_ps(gp.m), vinv = _mm256_set1_ps(gp.inv);
    const __m256i zero = _mm256_setzero_si256();
    const __m256i vL = _mm256_set1_epi32((1 << bits) - 1);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (size_t c = 0; c < G / 32; c++) {
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            __m256 x = ld8(src, i0 + 32 * c + 8 * (size_t)k, h);
            __m256 t = _mm256_mul_ps(_mm256_sub_ps(x, vm), vinv);
            __m256i qi = _mm256_cvtps_epi32(t);
            q[k] = _mm256_min_epi32(_mm256_max_epi32(qi, zero), vL);
        }
        __m256i a = _mm256_packs_epi32(q[0], q[1]);
        __m256i b = _mm256_packs_epi32(q[2], q[3]);
        __m256i B = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b), perm);
        if (bits == 8) {
            _mm256_storeu_si256((__m256i *)(qs + 32 * c), B);
        } else {
            __m128i lo = _mm256_castsi256_si128(B), hi = _mm256_extracti128_si256(B, 1);
            __m128i p = _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
            if (bits == 4) {
                _mm_storeu_si128((__m128i *)(qs + 16 * c), p);
            } else {
                __m128i r = _mm_or_si128(p, _mm_slli_epi16(_mm_srli_si128(p, 8), 2));
                _mm_storel_epi64((__m128i *)(qs + 8 * c), r);
            }
        }
    }
    return pb + G / 32 * 4 * bits;
}

AI size_t dec_group(void *dst, size_t i0, const uint8_t *src, uint32_t G, unsigned bits,
                    kvr_codec_params params, int h)
{
    float s, m;
    size_t pb;
    if (params == KVR_CODEC_PARAMS_F32) {
        memcpy(&s, src, 4);
        memcpy(&m, src + 4, 4);
        pb = 8;
    } else {
        uint16_t sh, mh;
        memcpy(&sh, src, 2);
        memcpy(&mh, src + 2, 2);
        s = _cvtsh_ss(sh);
        m = _cvtsh_ss(mh);
        pb = 4;
    }
    const uint8_t *qs = src + pb;
    const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
    for (size_t c = 0; c < G / 32; c++) {
        __m128i Q0, Q1;
        unpack_chunk(qs, c, bits, &Q0, &Q1);
        __m256i q0 = _mm256_cvtepu8_epi32(Q0), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(Q0, 8));
        __m256i q2 = _mm256_cvtepu8_epi32(Q1), q3 = _mm256_cvtepu8_epi32(_mm_srli_si128(Q1, 8));
        size_t o = i0 + 32 * c;
        st8(dst, o + 0,  _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q0), vs), vm), h);
        st8(dst, o + 8,  _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q1), vs), vm), h);
        st8(dst, o + 16, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q2), vs), vm), h);
        st8(dst, o + 24, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q3), vs), vm), h);
    }
    return pb + G / 32 * 4 * bits;
}

/* The full groups of a row, then its short last group with the scalar
 * kernel (h: f16 input). */
AI int enc_row(uint8_t *dst, const void *src, size_t n, unsigned bits, uint32_t group,
               kvr_codec_params params, const int h)
{
    size_t i = 0;
    for (; i + group <= n; i += group) {
        size_t w = enc_group(dst, src, i, group, bits, params, h);
        if (!w) return -1;
        dst += w;
    }
    if (i == n) return 0;
    if (h) return kvr_codec_kernels_scalar.enc_f16(dst, (const uint16_t *)src + i, n - i, bits,
                                                   group, params);
    return kvr_codec_kernels_scalar.enc_f32(dst, (const float *)src + i, n - i, bits, group, params);
}

static int av_enc_f32(uint8_t *dst, const float *src, size_t n, unsigned bits,
                      uint32_t group, kvr_codec_params params)
{
    return enc_row(dst, src, n, bits, group, params, 0);
}

static int av_enc_f16(uint8_t *dst, const uint16_t *src, size_t n, unsigned bits,
                      uint32_t group, kvr_codec_params params)
{
    return enc_row(dst, src, n, bits, group, params, 1);
}

/* Full groups of a row: one loop per (bits, parameter type, output), so the
 * per-chunk branches of dec_group fold away (f16 parameters, the default,
 * also with a constant group of 64). */
AI size_t dec_groups(void *dst, const uint8_t **srcp, size_t n, unsigned bits, uint32_t group,
                     kvr_codec_params params, int h)
{
    size_t i = 0;
    const uint8_t *src = *srcp;
    if (params == KVR_CODEC_PARAMS_F16 && group == 64)
        for (; i + 64 <= n; i += 64) src += dec_group(dst, i, src, 64, bits, KVR_CODEC_PARAMS_F16, h);
    else
        for (; i + group <= n; i += group) src += dec_group(dst, i, src, group, bits, params, h);
    *srcp = src;
    return i;
}

#define DEC_SPECIALISE(H)                                                                   \
    switch (bits) {                                                                         \
    case 8:                                                                                 \
        i = params == KVR_CODEC_PARAMS_F16 ? dec_groups(dst, &src, n, 8, group, KVR_CODEC_PARAMS_F16, H) \
                                           : dec_groups(dst, &src, n, 8, group, params, H); \
        break;                                                                              \
    case 4:                                                                                 \
        i = params == KVR_CODEC_PARAMS_F16 ? dec_groups(dst, &src, n, 4, group, KVR_CODEC_PARAMS_F16, H) \
                                           : dec_groups(dst, &src, n, 4, group, params, H); \
        break;                                                                              \
    default:                                                                                \
        i = params == KVR_CODEC_PARAMS_F16 ? dec_groups(dst, &src, n, 2, group, KVR_CODEC_PARAMS_F16, H) \
                                           : dec_groups(dst, &src, n, 2, group, params, H); \
        break;                                                                              \
    }

static void av_dec_f32(float *dst, const uint8_t *src, size_t n, unsigned bits,
                       uint32_t group, kvr_codec_params params)
{
    size_t i;
    DEC_SPECIALISE(0)
    if (i < n) kvr_codec_kernels_scalar.dec_f32(dst + i, src, n - i, bits, group, params);
}

static void av_dec_f16(uint16_t *dst, const uint8_t *src, size_t n, unsigned bits,
                       uint32_t group, kvr_codec_params params)
{
    size_t i;
    DEC_SPECIALISE(1)
    if (i < n) kvr_codec_kernels_scalar.dec_f16(dst + i, src, n - i, bits, group, params);
}
#undef DEC_SPECIALISE

/* 8x8 transpose of r[0..7] in registers. */
AI void tr8(__m256 r[8])
{
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

AI void gather(float *buf, const void *src, size_t G, size_t ld, int h)
{
    for (size_t t = 0; t < G; t += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = ld8(src, (t + (size_t)i) * ld, h);
        tr8(r);
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(buf + (size_t)j * G + t, r[j]);
    }
}

AI void scatter(void *dst, size_t ld, const float *buf, size_t G, int h)
{
    for (size_t t = 0; t < G; t += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(buf + (size_t)j * G + t);
        tr8(r);
        for (int i = 0; i < 8; i++) st8(dst, (t + (size_t)i) * ld, r[i], h);
    }
}

static void av_tile_gather(float *buf, const void *src, kvr_dtype t, size_t G,
                           size_t ld, size_t cc)
{
    if (cc == 8 && G % 8 == 0 && t == KVR_DTYPE_F32) gather(buf, src, G, ld, 0);
    else if (cc == 8 && G % 8 == 0 && t == KVR_DTYPE_F16) gather(buf, src, G, ld, 1);
    else kvr_codec_kernels_scalar.tile_gather(buf, src, t, G, ld, cc);
}

static void av_tile_scatter(void *dst, kvr_dtype t, size_t ld, const float *buf,
                            size_t G, size_t cc)
{
    if (cc == 8 && G % 8 == 0 && t == KVR_DTYPE_F32) scatter(dst, ld, buf, G, 0);
    else if (cc == 8 && G % 8 == 0 && t == KVR_DTYPE_F16) scatter(dst, ld, buf, G, 1);
    else kvr_codec_kernels_scalar.tile_scatter(dst, t, ld, buf, G, cc);
}

/* The error measure (kvr_codec_err_rows) in its lanes' order: each block
 * of 1024 elements in two passes, lanes 0-31 then lanes 32-63 of every
 * 64-element group (four float accumulators for e, four for q: eight
 * independent chains, no shuffles), each lane's floats added to its double
 * at the block's end. A block's last, partial group is copied into
 * zero-filled lanes first (a zero adds +0: nothing). */
#define ERR_ACC(RV, DV, EA, QA)                                                \
    do {                                                                       \
        __m256 r_ = (RV), t_ = _mm256_sub_ps((DV), r_);                        \
        EA = _mm256_add_ps(EA, _mm256_mul_ps(t_, t_));                         \
        QA = _mm256_add_ps(QA, _mm256_mul_ps(r_, r_));                         \
    } while (0)

AI __m256 err_ref8(const void *a, size_t k, int h)
{
    if (h) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)a + k)));
    return _mm256_loadu_ps((const float *)a + k);
}

/* Lanes l..l+7 of the doubles D += the floats of v. */
AI void err_flush8(double *D, size_t l, __m256 v)
{
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    _mm256_storeu_pd(D + l, _mm256_add_pd(_mm256_loadu_pd(D + l), lo));
    _mm256_storeu_pd(D + l + 4, _mm256_add_pd(_mm256_loadu_pd(D + l + 4), hi));
}

AI void err_row(const void *ref, const float *dec, size_t len, double *pe, double *pq, int h)
{
    double E[KVR_ERR_LANES] = { 0 }, Q[KVR_ERR_LANES] = { 0 };
    float rt[KVR_ERR_LANES], dt[KVR_ERR_LANES];
    for (size_t b = 0; b < len; b += KVR_ERR_BLOCK) {
        size_t end = len - b < KVR_ERR_BLOCK ? len : b + KVR_ERR_BLOCK;
        size_t full = b + (end - b) / KVR_ERR_LANES * KVR_ERR_LANES, rest = end - full;
        for (size_t j = 0; j < rest; j++) {
            rt[j] = h ? kvr_f16_to_f32(((const uint16_t *)ref)[full + j])
                      : ((const float *)ref)[full + j];
            dt[j] = dec[full + j];
        }
        for (size_t j = rest; rest && j < KVR_ERR_LANES; j++)
            rt[j] = dt[j] = 0.0f;
        for (size_t half = 0; half < KVR_ERR_LANES; half += 32) {
            __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0;
            __m256 q0 = e0, q1 = e0, q2 = e0, q3 = e0;
            for (size_t g = b; g < full; g += KVR_ERR_LANES) {
                size_t k = g + half;
                ERR_ACC(err_ref8(ref, k, h), _mm256_loadu_ps(dec + k), e0, q0);
                ERR_ACC(err_ref8(ref, k + 8, h), _mm256_loadu_ps(dec + k + 8), e1, q1);
                ERR_ACC(err_ref8(ref, k + 16, h), _mm256_loadu_ps(dec + k + 16), e2, q2);
                ERR_ACC(err_ref8(ref, k + 24, h), _mm256_loadu_ps(dec + k + 24), e3, q3);
            }
            if (rest) {
                ERR_ACC(_mm256_loadu_ps(rt + half), _mm256_loadu_ps(dt + half), e0, q0);
                ERR_ACC(_mm256_loadu_ps(rt + half + 8), _mm256_loadu_ps(dt + half + 8), e1, q1);
                ERR_ACC(_mm256_loadu_ps(rt + half + 16), _mm256_loadu_ps(dt + half + 16), e2, q2);
                ERR_ACC(_mm256_loadu_ps(rt + half + 24), _mm256_loadu_ps(dt + half + 24), e3, q3);
            }
            err_flush8(E, half, e0);
            err_flush8(E, half + 8, e1);
            err_flush8(E, half + 16, e2);
            err_flush8(E, half + 24, e3);
            err_flush8(Q, half, q0);
            err_flush8(Q, half + 8, q1);
            err_flush8(Q, half + 16, q2);
            err_flush8(Q, half + 24, q3);
        }
    }
    if (!kvr_codec_err_finish(E, Q, pe, pq))
        kvr_codec_err_row_wide(ref, h, dec, len, pe, pq);
}
#undef ERR_ACC

AI void err_rows(const void *ref, const float *dec, size_t n_rows, size_t len, double *e,
                 double *q, const int h)
{
    size_t es = h ? 2 : 4;
    for (size_t i = 0; i < n_rows; i++)
        err_row((const char *)ref + i * len * es, dec + i * len, len, &e[i], &q[i], h);
}

static void av_err_rows(const float *ref, const float *dec, size_t n_rows, size_t len,
                        double *e, double *q)
{
    err_rows(ref, dec, n_rows, len, e, q, 0);
}

static void av_err_rows_h(const uint16_t *ref, const float *dec, size_t n_rows, size_t len,
                          double *e, double *q)
{
    err_rows(ref, dec, n_rows, len, e, q, 1);
}

const kvr_codec_kernels kvr_codec_kernels_avx2 = {
    .enc_f32 = av_enc_f32, .enc_f16 = av_enc_f16,
    .dec_f32 = av_dec_f32, .dec_f16 = av_dec_f16,
    .tile_gather = av_tile_gather, .tile_scatter = av_tile_scatter,
    .ggml_enc = kvr_codec_ggml_enc_avx2, .ggml_dec = kvr_codec_ggml_dec_avx2,
    .err_rows = av_err_rows, .err_rows_h = av_err_rows_h,
};
