/*
 * scan_avx2.c — AVX2 test for a NaN or infinity anywhere in a buffer of
 * f32, f16 or bf16 values (all exponent bits set), 32 bytes a step. Built
 * with AVX2 flags; called only after the CPU was checked (quant.c). Only
 * answers "is there one": the caller's scalar pass finds which.
 */
#include <immintrin.h>

#include "cache/quant.h"

/* Lanes of v (32-bit for w == 4, else 16-bit) with every bit of m set. */
static inline __attribute__((always_inline)) __m256i all_set(__m256i v, __m256i m, int w)
{
    v = _mm256_and_si256(v, m);
    return w == 4 ? _mm256_cmpeq_epi32(v, m) : _mm256_cmpeq_epi16(v, m);
}

/* Whether a lane of width w in b[0, *done) has every bit of m set, 128
 * bytes a step: *done is the bytes looked at (the rest, under 128, is the
 * caller's). */
static inline __attribute__((always_inline)) bool any_all_set(const uint8_t *b, size_t bytes,
                                                              __m256i m, int w, size_t *done)
{
    __m256i acc = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 128 <= bytes; i += 128) {
        __m256i a = all_set(_mm256_loadu_si256((const __m256i *)(b + i)), m, w);
        __m256i c = all_set(_mm256_loadu_si256((const __m256i *)(b + i + 32)), m, w);
        __m256i d = all_set(_mm256_loadu_si256((const __m256i *)(b + i + 64)), m, w);
        __m256i e = all_set(_mm256_loadu_si256((const __m256i *)(b + i + 96)), m, w);
        acc = _mm256_or_si256(acc, _mm256_or_si256(_mm256_or_si256(a, c), _mm256_or_si256(d, e)));
    }
    *done = i;
    return !_mm256_testz_si256(acc, acc);
}

bool kvr_any_nonfinite_avx2(const void *p, kvr_dtype dt, size_t n)
{
    const uint8_t *b = p;
    size_t bytes = n * kvr_dtype_size(dt), i;
    if (dt == KVR_DTYPE_F32) {
        if (any_all_set(b, bytes, _mm256_set1_epi32(0x7f800000), 4, &i)) return true;
        const uint32_t *u = (const uint32_t *)(b + i);
        for (size_t k = 0; k < (bytes - i) / 4; k++)
            if ((u[k] & 0x7f800000u) == 0x7f800000u) return true;
        return false;
    }
    const uint16_t mk = dt == KVR_DTYPE_F16 ? 0x7c00u : 0x7f80u;
    if (any_all_set(b, bytes, _mm256_set1_epi16((short)mk), 2, &i)) return true;
    const uint16_t *h = (const uint16_t *)(b + i);
    for (size_t k = 0; k < (bytes - i) / 2; k++)
        if ((h[k] & mk) == mk) return true;
    return false;
}
