/*
 * codec_avx2_inl.h — inline AVX2 + F16C pieces shared by the uniform
 * (codec_avx2.c) and ggml (codec_ggml_avx2.c) kernels: 8-value loads and
 * stores of f32 or f16 data, horizontal min / max, and the unpacking of a
 * uniform codec's 32-quant chunk (SSE2 only; codec_avx512.c's row decoder
 * unpacks with it too). Include only from *_avx2.c / *_avx512.c files
 * (built with those ISA flags) after cache/codec.h and <immintrin.h>, with
 * AI defined as always-inline.
 */
#ifndef KVR_CACHE_CODEC_AVX2_INL_H
#define KVR_CACHE_CODEC_AVX2_INL_H

/* 8 values at src[i] as f32 (h: f16 data, converted exactly by F16C). */
AI __m256 ld8(const void *src, size_t i, int h)
{
    if (h) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
    return _mm256_loadu_ps((const float *)src + i);
}

/* 8 values as f32 (or f16: clamped to +-65504, rounded to nearest even) at
 * dst[i]. y second in max / min: they return it when it is a NaN (a block
 * with a NaN scale), which then converts as kvr_f32_to_f16 does. */
AI void st8(void *dst, size_t i, __m256 y, int h)
{
    if (h) {
        const __m256 lim = _mm256_set1_ps(KVR_CODEC_F16_LIMIT);
        y = _mm256_min_ps(lim, _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), lim), y));
        _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                         _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        _mm256_storeu_ps((float *)dst + i, y);
    }
}

AI float hmin8(__m256 v)
{
    __m128 a = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_min_ps(a, _mm_movehl_ps(a, a));
    a = _mm_min_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

AI float hmax8(__m256 v)
{
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

/* Chunk c of a group's packed quants qs (codec.h's chunk packing for bits)
 * as one byte a quant, in element order: quants 0-15 in *q0, 16-31 in *q1.
 *   INT8: the bytes; INT4: low nibbles, then high nibbles;
 *   INT2: bit pairs 0-1 | 2-3, then 4-5 | 6-7 (of the chunk's 8 bytes). */
AI void unpack_chunk(const uint8_t *qs, size_t c, unsigned bits, __m128i *q0, __m128i *q1)
{
    if (bits == 8) {
        *q0 = _mm_loadu_si128((const __m128i *)(qs + 32 * c));
        *q1 = _mm_loadu_si128((const __m128i *)(qs + 32 * c + 16));
    } else if (bits == 4) {
        const __m128i m4 = _mm_set1_epi8(0x0F);
        __m128i b = _mm_loadu_si128((const __m128i *)(qs + 16 * c));
        *q0 = _mm_and_si128(b, m4);
        *q1 = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    } else {
        const __m128i m2 = _mm_set1_epi8(0x03);
        __m128i b = _mm_loadl_epi64((const __m128i *)(qs + 8 * c));
        *q0 = _mm_and_si128(_mm_unpacklo_epi64(b, _mm_srli_epi16(b, 2)), m2);
        *q1 = _mm_and_si128(_mm_unpacklo_epi64(_mm_srli_epi16(b, 4), _mm_srli_epi16(b, 6)), m2);
    }
}

#endif /* KVR_CACHE_CODEC_AVX2_INL_H */
