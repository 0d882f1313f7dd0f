/*
 * codec_avx512_inl.h — inline AVX-512 loads and stores shared by the
 * uniform (codec_avx512.c) and ggml (codec_ggml_avx512.c) kernels. Include
 * only from *_avx512.c files (built with the AVX-512 flags) after
 * cache/codec.h and <immintrin.h>, with AI defined as always-inline.
 */
#ifndef KVR_CACHE_CODEC_AVX512_INL_H
#define KVR_CACHE_CODEC_AVX512_INL_H

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

#endif
