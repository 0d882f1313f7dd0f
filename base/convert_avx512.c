/*
 * convert_avx512.c — kvr_convert's and kvr_convert_scaled's AVX-512 kernels
 * and kvr_copy_stream's non-temporal copy (base/convert.c chooses them when
 * cpuid says the CPU has AVX-512; built with those flags for this file only):
 * 16 elements a step with base/simd_avx512.h, masked tails, bit for bit the
 * scalar conversion (and its multiply, for the scaled one).
 */
#include "base/simd_avx512.h"
#include "base/simd_span_inl.h"

void kvr__copy_stream_avx512(void *dst, const void *src, size_t n)
{
    char *d = dst;
    const char *s = src;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
        __m512i c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
        _mm512_stream_si512((__m512i *)(d + i), a);
        _mm512_stream_si512((__m512i *)(d + i + 64), b);
        _mm512_stream_si512((__m512i *)(d + i + 128), c);
        _mm512_stream_si512((__m512i *)(d + i + 192), e);
    }
    for (; i < n; i += 64)
        _mm512_stream_si512((__m512i *)(d + i), _mm512_loadu_si512(s + i));
    _mm_sfence();
}

void kvr__convert_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n)
{
    copy_span(dst, dt, src, st, 0, n);
}

#define CONV_SCALED_CASE(S, D) \
    if (st == S && dt == D) { conv_span_scaled(dst, D, src, S, 0, n, kv); return; }

void kvr__convert_scaled_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                                size_t n, float k)
{
    const __m512 kv = _mm512_set1_ps(k);
    SIMD_DTYPE_PAIRS_ALL(CONV_SCALED_CASE)
}
