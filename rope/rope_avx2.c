/*
 * rope_avx2.c — AVX2 + FMA + F16C rows kernel and conversions. Built with
 * those flags for this file only; called only when cpuid says the CPU has
 * them (rope.c).
 *
 * 8 floats per vector; the remainder of a row runs through the scalar
 * element conversions with fmaf (a single vfmadd here), so every element is
 * computed exactly as the scalar reference computes it (rope_internal.h):
 *   NEOX rot=8 --> [ccccssss]: o0 = fmsub(x0, c, x1*s), o1 = fmadd(x1, c, x0*s)
 *   GPTJ rot=8 --> [cscscscs]: o = fmadd(x, c', swap_pairs(x) * s'), s' = [-s, s]
 */
#include <immintrin.h>
#include <string.h>

#include "rope/rope_internal.h"

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

AI void st(void *p, size_t i, kvr_dtype t, __m256 v)
{
    if (t == KVR_DTYPE_F32) { _mm256_storeu_ps((float *)p + i, v); return; }
    __m128i h = t == KVR_DTYPE_F16 ? _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                   : to_bf16(v);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

AI void conv_span(void *dst, kvr_dtype dt, const void *src, kvr_dtype st_, size_t i0, size_t i1)
{
    size_t i = i0;
    for (; i + 8 <= i1; i += 8) st(dst, i, dt, ld(src, i, st_));
    for (; i < i1; i++) rope_store1(dst, dt, i, rope_load1(src, st_, i));
}

AI void rows_t(void *dst, const kvr_dtype dt, const void *src, const kvr_dtype st_,
               size_t n_heads, int head_dim, int rot, const int gptj,
               const float *c, const float *s)
{
    size_t hd = (size_t)head_dim, r = (size_t)rot;
    for (size_t h = 0; h < n_heads; h++) {
        size_t b = h * hd;
        if (gptj) {
            size_t j = 0;
            for (; j + 8 <= r; j += 8) {
                __m256 x = ld(src, b + j, st_);
                __m256 sw = _mm256_permute_ps(x, 0xB1);
                __m256 o = _mm256_fmadd_ps(x, _mm256_loadu_ps(c + j),
                                           _mm256_mul_ps(sw, _mm256_loadu_ps(s + j)));
                st(dst, b + j, dt, o);
            }
            for (; j < r; j += 2) {
                float x0 = rope_load1(src, st_, b + j), x1 = rope_load1(src, st_, b + j + 1);
                rope_store1(dst, dt, b + j, fmaf(x0, c[j], x1 * s[j]));
                rope_store1(dst, dt, b + j + 1, fmaf(x1, c[j + 1], x0 * s[j + 1]));
            }
        } else {
            size_t half = r / 2, i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 x0 = ld(src, b + i, st_), x1 = ld(src, b + i + half, st_);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                __m256 o0 = _mm256_fmsub_ps(x0, cv, _mm256_mul_ps(x1, sv));
                __m256 o1 = _mm256_fmadd_ps(x1, cv, _mm256_mul_ps(x0, sv));
                st(dst, b + i, dt, o0);
                st(dst, b + i + half, dt, o1);
            }
            for (; i < half; i++) {
                float x0 = rope_load1(src, st_, b + i), x1 = rope_load1(src, st_, b + i + half);
                rope_store1(dst, dt, b + i, fmaf(x0, c[i], -(x1 * s[i])));
                rope_store1(dst, dt, b + i + half, fmaf(x1, c[i], x0 * s[i]));
            }
        }
        if (r < hd) {
            if (dt == st_) {
                if (dst != src)
                    memcpy((char *)dst + (b + r) * kvr_dtype_size(dt),
                           (const char *)src + (b + r) * kvr_dtype_size(st_),
                           (hd - r) * kvr_dtype_size(dt));
            } else {
                conv_span(dst, dt, src, st_, b + r, b + hd);
            }
        }
    }
}

#define ROWS_CASE(S, D)                                                              \
    if (st == S && dt == D) {                                                        \
        if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s);           \
        else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s);           \
        return;                                                                      \
    }

void kvr__rope_rows_avx2(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                    size_t n_heads, int head_dim, int rot, int gptj,
                    const float *c, const float *s)
{
    ROWS_CASE(KVR_DTYPE_F32, KVR_DTYPE_F32)
    ROWS_CASE(KVR_DTYPE_F32, KVR_DTYPE_F16)
    ROWS_CASE(KVR_DTYPE_F32, KVR_DTYPE_BF16)
    ROWS_CASE(KVR_DTYPE_F16, KVR_DTYPE_F32)
    ROWS_CASE(KVR_DTYPE_F16, KVR_DTYPE_F16)
    ROWS_CASE(KVR_DTYPE_F16, KVR_DTYPE_BF16)
    ROWS_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F32)
    ROWS_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F16)
    ROWS_CASE(KVR_DTYPE_BF16, KVR_DTYPE_BF16)
}

#define CONV_CASE(S, D) \
    if (st == S && dt == D) { conv_span(dst, D, src, S, 0, n); return; }

void kvr__rope_convert_avx2(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n)
{
    if (dt == st) {
        if (dst != src) memmove(dst, src, n * kvr_dtype_size(st));
        return;
    }
    CONV_CASE(KVR_DTYPE_F32, KVR_DTYPE_F16)
    CONV_CASE(KVR_DTYPE_F32, KVR_DTYPE_BF16)
    CONV_CASE(KVR_DTYPE_F16, KVR_DTYPE_F32)
    CONV_CASE(KVR_DTYPE_F16, KVR_DTYPE_BF16)
    CONV_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F32)
    CONV_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F16)
}
