/*
 * convert_avx2.c — kvr_convert's AVX2 + F16C kernel (base/convert.c chooses
 * it when cpuid says the CPU has them; built with those flags for this file
 * only): 8 elements a step with base/simd_avx2.h (through simd_span_inl.h,
 * as convert_avx512.c), the tail element by element, bit for bit the scalar
 * conversion.
 */
#include "base/simd_avx2.h"
#include "base/simd_span_inl.h"

void kvr__convert_avx2(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n)
{
    copy_span(dst, dt, src, st, 0, n);
}
