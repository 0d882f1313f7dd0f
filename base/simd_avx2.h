/*
 * simd_avx2.h — AVX2 + F16C loads and stores of 8 elements of any kvr_dtype
 * (f16 through vcvtph2ps / vcvtps2ph, bf16 by integer shifts with
 * round-to-nearest-even and NaN kept), and a span converted with them, the
 * tail through base/half.h: the same bits as the scalar conversion. Included
 * only by files built with AVX2 flags (*_avx2.c): base/convert_avx2.c and
 * rope/rope_avx2.c's rows kernel. Header only (static inline).
 */
#ifndef KVR_BASE_SIMD_AVX2_H
#define KVR_BASE_SIMD_AVX2_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/half.h"

#define AI static inline __attribute__((always_inline))

AI __m256 ld(const void *p, size_t i, kvr_dtype t)
{
    if (t == KVR_DTYPE_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (t == KVR_DTYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AI __m128i to_bf16(__m256 v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, q, _mm256_castps_si256(nan));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* v as 8 values of the 16-bit type t (f16 or bf16). */
AI __m128i to_16bit(__m256 v, kvr_dtype t)
{
    return t == KVR_DTYPE_F16 ? _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                              : to_bf16(v);
}

AI void st(void *p, size_t i, kvr_dtype t, __m256 v)
{
    if (t == KVR_DTYPE_F32) { _mm256_storeu_ps((float *)p + i, v); return; }
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_16bit(v, t));
}

AI void conv_span(void *dst, kvr_dtype dt, const void *src, kvr_dtype st_, size_t i0, size_t i1)
{
    size_t i = i0;
    for (; i + 8 <= i1; i += 8) st(dst, i, dt, ld(src, i, st_));
    for (; i < i1; i++) kvr__store1(dst, dt, i, kvr__load1(src, st_, i));
}

#endif /* KVR_BASE_SIMD_AVX2_H */
