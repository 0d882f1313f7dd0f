/*
 * codec_avx512_inl.h — inline AVX-512 loads and stores shared by the
 * uniform (codec_avx512.c) and ggml (codec_ggml_avx512.c) kernels. Include
 * only from *_avx512.c files (built with the AVX-512 flags) after
 * cache/codec.h and <immintrin.h>, with AI defined as always-inline.
 */
#ifndef KVR_CACHE_CODEC_AVX512_INL_H
#define KVR_CACHE_CODEC_AVX512_INL_H

/* A row's doubles E, Q are set by its first flush (ERR_FLUSH with first_);
 * gcc -O3 cannot see it and calls them maybe uninitialized (in every file
 * that includes this one, from here on). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

/* 16 values at src[i] as f32; folds the magnitude bits into *acc (f16
 * input: the f16 bits & 0x7fff, in 16-bit lanes; f32: the f32 bits &
 * 0x7fffffff, in 32-bit lanes) for one unsigned max check at the end. */
AI __m512 ld16(const void *src, size_t i, int h, __m512i *acc)
{
    if (h) {
        __m256i r = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i));
        *acc = _mm512_max_epu16(*acc, _mm512_zextsi256_si512(
                   _mm256_and_si256(r, _mm256_set1_epi16(0x7fff))));
        return _mm512_cvtph_ps(r);
    }
    __m512 v = _mm512_loadu_ps((const float *)src + i);
    *acc = _mm512_max_epu32(*acc, _mm512_and_si512(_mm512_castps_si512(v),
                                                   _mm512_set1_epi32(0x7fffffff)));
    return v;
}

/* ld16 without the check (a second pass over data already checked). */
AI __m512 ld16q(const void *src, size_t i, int h)
{
    if (h) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i)));
    return _mm512_loadu_ps((const float *)src + i);
}

/* 16 values as f16 as the scalar decoder stores them: clamped to +-65504,
 * rounded to nearest even. y second in max / min: they return it when it
 * is a NaN, which then converts as the scalar kvr_f32_to_f16 does (quiet,
 * payload kept). */
AI __m256i to_f16_clamped(__m512 y)
{
    const __m512 lim = _mm512_set1_ps(KVR_CODEC_F16_LIMIT);
    y = _mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), y));
    return _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* 16 values as f32 (or f16: to_f16_clamped) at dst[i]. */
AI void st16(void *dst, size_t i, __m512 y, int h)
{
    if (h) _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i), to_f16_clamped(y));
    else   _mm512_storeu_ps((float *)dst + i, y);
}

/* Two vectors, elements [i, i + 32), with non-temporal stores (dst + i on
 * 64 bytes: f16 one whole line, f32 two): the values st16 stores. */
AI void st32_nt(void *dst, size_t i, __m512 y0, __m512 y1, int h)
{
    if (h) {
        _mm512_stream_si512((__m512i *)((uint16_t *)dst + i),
                            _mm512_inserti64x4(_mm512_castsi256_si512(to_f16_clamped(y0)),
                                               to_f16_clamped(y1), 1));
    } else {
        _mm512_stream_ps((float *)dst + i, y0);
        _mm512_stream_ps((float *)dst + i + 16, y1);
    }
}

/* ---- the error measure's lanes (codec.h: kvr_codec_err_rows) ------------
 * ERR_FLUSH and ERR_FLUSH_ALL expect the row's doubles in E[8], Q[8] and a
 * flag first_ (the first block of the row) in scope. */

/* The error measure in its lanes' order (codec_avx2.c's err_row, one pass
 * a block: the 64 lanes are four vectors of 16 floats). */
#define ERR_ACC(RV, DV, EA, QA)                                                \
    do {                                                                       \
        __m512 r_ = (RV), t_ = _mm512_sub_ps((DV), r_);                        \
        EA = _mm512_add_ps(EA, _mm512_mul_ps(t_, t_));                         \
        QA = _mm512_add_ps(QA, _mm512_mul_ps(r_, r_));                         \
    } while (0)

AI __m512 err_ref16(const void *a, size_t k, int h)
{
    if (h) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)a + k)));
    return _mm512_loadu_ps((const float *)a + k);
}

/* Lanes 16j..16j+15 of the doubles (vectors D[2j], D[2j+1]) += v's floats;
 * the first block's set them (0 + x is x: the doubles start from zero
 * without a store of zeros). */
#define ERR_FLUSH(D, J, V)                                                     \
    do {                                                                       \
        __m512d lo_ = _mm512_cvtps_pd(_mm512_castps512_ps256(V));             \
        __m512d hi_ = _mm512_cvtps_pd(_mm512_extractf32x8_ps(V, 1));          \
        D[2 * (J)] = first_ ? lo_ : _mm512_add_pd(D[2 * (J)], lo_);            \
        D[2 * (J) + 1] = first_ ? hi_ : _mm512_add_pd(D[2 * (J) + 1], hi_);    \
    } while (0)

/* A row's 64 float lanes of e and of q: lane l in vector l / 16. */
typedef struct mlanes {
    __m512 e0, e1, e2, e3, q0, q1, q2, q3;
} mlanes;

#define MLANES_ZERO ((mlanes){ _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), \
                               _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), \
                               _mm512_setzero_ps(), _mm512_setzero_ps() })

/* The 16 values at a row's element k (a multiple of 16), reference r and
 * decoded d, into their lanes. */
AI void mlanes_acc(mlanes *L, size_t k, __m512 r, __m512 d)
{
    switch ((k >> 4) & 3) {
    case 0: ERR_ACC(r, d, L->e0, L->q0); break;
    case 1: ERR_ACC(r, d, L->e1, L->q1); break;
    case 2: ERR_ACC(r, d, L->e2, L->q2); break;
    default: ERR_ACC(r, d, L->e3, L->q3); break;
    }
}

/* A block's float lanes L into their doubles E, Q. */
#define ERR_FLUSH_ALL(L)                                                       \
    do {                                                                       \
        ERR_FLUSH(E, 0, (L).e0);                                               \
        ERR_FLUSH(E, 1, (L).e1);                                               \
        ERR_FLUSH(E, 2, (L).e2);                                               \
        ERR_FLUSH(E, 3, (L).e3);                                               \
        ERR_FLUSH(Q, 0, (L).q0);                                               \
        ERR_FLUSH(Q, 1, (L).q1);                                               \
        ERR_FLUSH(Q, 2, (L).q2);                                               \
        ERR_FLUSH(Q, 3, (L).q3);                                               \
    } while (0)

/* kvr_codec_err_finish's tree on lanes held as eight vectors of eight
 * (lane l in D[l / 8]): + 32 lanes, + 16, + 8 as whole vectors, then + 4,
 * + 2, + 1 inside the first. */
AI double err_tree(__m512d *D)
{
    for (int j = 0; j < 4; j++) D[j] = _mm512_add_pd(D[j], D[j + 4]);
    for (int j = 0; j < 2; j++) D[j] = _mm512_add_pd(D[j], D[j + 2]);
    __m512d v = _mm512_add_pd(D[0], D[1]);
    __m256d h = _mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
    __m128d p = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
    return _mm_cvtsd_f64(_mm_add_sd(p, _mm_unpackhi_pd(p, p)));
}

/* A row's e and q from its lanes' doubles (kvr_codec_err_finish's tree and
 * test); false: it is to be measured wide. */
AI bool err_finish16(__m512d *E, __m512d *Q, double *pe, double *pq)
{
    double se = err_tree(E), sq = err_tree(Q);
    *pe = se;
    *pq = sq;
    return kvr_codec_err_ok(se, sq);
}

#endif
