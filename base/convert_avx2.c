/*
 * convert_avx2.c — kvr_convert's AVX2 + F16C kernel (base/convert.c chooses
 * it when cpuid says the CPU has them; built with those flags for this file
 * only): 8 elements a step with base/simd_avx2.h, the tail element by
 * element, bit for bit the scalar conversion.
 */
#include <string.h>

#include "base/simd_avx2.h"
#include "base/base_internal.h"

#define CONV_CASE(S, D) \
    if (st == S && dt == D) { conv_span(dst, D, src, S, 0, n); return; }

void kvr__convert_avx2(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n)
{
    if (dt == st) {
        if (dst != src) memmove(dst, src, n * kvr_dtype_size(st));
        return;
    }
    KVR__DTYPE_PAIRS_CONVERTED(CONV_CASE)
}
