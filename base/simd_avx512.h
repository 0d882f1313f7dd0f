/*
 * simd_avx512.h — AVX-512 (F/BW/VL/DQ) loads and stores of 16 elements of
 * any kvr_dtype, masked for tails and non-temporal for streams (f16 through
 * vcvtph2ps / vcvtps2ph, bf16 by integer shifts with round-to-nearest-even
 * and NaN kept), and spans converted (and scaled) with them: the same bits
 * as the scalar conversion. Included only by files built with AVX-512 flags
 * (*_avx512.c): base/convert_avx512.c and rope/rope_avx512.c's rows kernels.
 * Header only (static inline).
 */
#ifndef KVR_BASE_SIMD_AVX512_H
#define KVR_BASE_SIMD_AVX512_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/half.h"

#define AI static inline __attribute__((always_inline))

AI __m512 ld(const void *p, size_t i, kvr_dtype t)
{
    if (t == KVR_DTYPE_F32) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (t == KVR_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI __m512 ldm(const void *p, size_t i, kvr_dtype t, __mmask16 m)
{
    if (t == KVR_DTYPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    if (t == KVR_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI __m256i to_bf16(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, nan, q);
    return _mm512_cvtepi32_epi16(r);
}

/* v as 16 values of the 16-bit type t (f16 or bf16). */
AI __m256i to_16bit(__m512 v, kvr_dtype t)
{
    return t == KVR_DTYPE_F16 ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                              : to_bf16(v);
}

AI void st(void *p, size_t i, kvr_dtype t, __m512 v)
{
    if (t == KVR_DTYPE_F32) { _mm512_storeu_ps((float *)p + i, v); return; }
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), to_16bit(v, t));
}

AI void stm(void *p, size_t i, kvr_dtype t, __m512 v, __mmask16 m)
{
    if (t == KVR_DTYPE_F32) { _mm512_mask_storeu_ps((float *)p + i, m, v); return; }
    _mm256_mask_storeu_epi16((uint16_t *)p + i, m, to_16bit(v, t));
}

/* st() with a non-temporal store (dst aligned to the vector: the caller
 * checks). */
AI void st_nt(void *p, size_t i, kvr_dtype t, __m512 v)
{
    if (t == KVR_DTYPE_F32) { _mm512_stream_ps((float *)p + i, v); return; }
    _mm256_stream_si256((__m256i *)((uint16_t *)p + i), to_16bit(v, t));
}

/* Two vectors of 16-bit results, elements [i, i + 32), in one
 * non-temporal 64-byte store (p + i aligned to 64 bytes). */
AI void st_line(void *p, size_t i, kvr_dtype t, __m512 v0, __m512 v1)
{
    _mm512_stream_si512((__m512i *)((uint16_t *)p + i),
                        _mm512_inserti64x4(_mm512_castsi256_si512(to_16bit(v0, t)),
                                           to_16bit(v1, t), 1));
}

#define ST(nt, p, i, t, v) do { if (nt) st_nt(p, i, t, v); else st(p, i, t, v); } while (0)

AI __mmask16 tailmask(size_t n) { return (__mmask16)((1u << n) - 1u); }

AI void conv_span(void *dst, kvr_dtype dt, const void *src, kvr_dtype st_, size_t i0, size_t i1)
{
    size_t i = i0;
    for (; i + 16 <= i1; i += 16) st(dst, i, dt, ld(src, i, st_));
    if (i < i1) {
        __mmask16 m = tailmask(i1 - i);
        stm(dst, i, dt, ldm(src, i, st_, m), m);
    }
}

AI void conv_span_scaled(void *dst, kvr_dtype dt, const void *src, kvr_dtype st_, size_t i0,
                         size_t i1, __m512 kv)
{
    size_t i = i0;
    for (; i + 16 <= i1; i += 16) st(dst, i, dt, _mm512_mul_ps(ld(src, i, st_), kv));
    if (i < i1) {
        __mmask16 m = tailmask(i1 - i);
        stm(dst, i, dt, _mm512_mul_ps(ldm(src, i, st_, m), kv), m);
    }
}

/* sc: every result is multiplied by k in f32 before its store (rounded
 * once), the passed-through dims too: the bits of the unscaled kernel into
 * f32, a multiply and a conversion. */

#endif /* KVR_BASE_SIMD_AVX512_H */
