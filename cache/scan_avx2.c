/*
 * scan_avx2.c — AVX2 test for a NaN or infinity anywhere in a buffer of
 * f32, f16 or bf16 values (all exponent bits set), 32 bytes a step. Built
 * with AVX2 flags; called only after the CPU was checked (quant.c). Only
 * answers "is there one": the caller's scalar pass finds which.
 */
#include <immintrin.h>

#include "cache/quant.h"

bool kvr_any_nonfinite_avx2(const void *p, kvr_dtype dt, size_t n)
{
    const uint8_t *b = p;
    size_t bytes = n * kvr_dtype_size(dt), i = 0;
    __m256i acc = _mm256_setzero_si256();
    if (dt == KVR_DTYPE_F32) {
        const __m256i m = _mm256_set1_epi32(0x7f800000);
        for (; i + 128 <= bytes; i += 128) {
            __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + i)), m);
            __m256i c = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + i + 32)), m);
            __m256i d = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + i + 64)), m);
            __m256i e = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + i + 96)), m);
            acc = _mm256_or_si256(acc, _mm256_or_si256(
                      _mm256_or_si256(_mm256_cmpeq_epi32(a, m), _mm256_cmpeq_epi32(c, m)),
                      _mm256_or_si256(_mm256_cmpeq_epi32(d, m), _mm256_cmpeq_epi32(e, m))));
        }
        if (!_mm256_testz_si256(acc, acc)) return true;
        const uint32_t *u = (const uint32_t *)(b + i);
        for (size_t k = 0; k < (bytes - i) / 4; k++)
            if ((u[k] & 0x7f800000u) == 0x7f800000u) return true;
        return false;
    }
    const uint16_t mk = dt == KVR_DTYPE_F16 ? 0x7c00u : 0x7f80u;
    const __m256i m = _mm256_set1_epi16((short)mk);
    for (; i + 128 <= bytes; i += 128) {
        __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + i)), m);
        __m256i c = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + i + 32)), m);
        __m256i d = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + i + 64)), m);
        __m256i e = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(b + i + 96)), m);
        acc = _mm256_or_si256(acc, _mm256_or_si256(
                  _mm256_or_si256(_mm256_cmpeq_epi16(a, m), _mm256_cmpeq_epi16(c, m)),
                  _mm256_or_si256(_mm256_cmpeq_epi16(d, m), _mm256_cmpeq_epi16(e, m))));
    }
    if (!_mm256_testz_si256(acc, acc)) return true;
    const uint16_t *h = (const uint16_t *)(b + i);
    for (size_t k = 0; k < (bytes - i) / 2; k++)
        if ((h[k] & mk) == mk) return true;
    return false;
}
