/*
 * convert.c — bulk element conversion (base/dtype.h): kvr_convert /
 * kvr_convert_scaled / kvr_copy_stream with their run-time choice of kernel
 * (base/cpu.h), and the scalar reference conversion. The SIMD kernels
 * (convert_avx2.c, convert_avx512.c) convert every element exactly as the
 * scalar one does (base/half.h's rounding), so the choice never changes a
 * bit.
 */
#include <string.h>

#include "base/dtype.h"
#include "base/half.h"
#include "base/base_internal.h"

void kvr__convert_scalar(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n)
{
    if (dt == st) {
        if (dst != src) memmove(dst, src, n * kvr_dtype_size(st));
        return;
    }
    /* Equal element sizes (f16 <-> bf16) may be done in place: each element
     * is read before it is written. */
    for (size_t i = 0; i < n; i++)
        kvr__store1(dst, dt, i, kvr__load1(src, st, i));
}

void kvr_convert(void *dst, kvr_dtype dst_type, const void *src, kvr_dtype src_type, size_t n)
{
    if (n == 0 || !dst || !src) return;
    if (kvr_dtype_size(dst_type) == 0 || kvr_dtype_size(src_type) == 0) return;
    switch (kvr__isa_resolve(KVR_ISA_AUTO)) {
    case KVR_ISA_AVX512: kvr__convert_avx512(dst, dst_type, src, src_type, n); break;
    case KVR_ISA_AVX2:   kvr__convert_avx2(dst, dst_type, src, src_type, n); break;
    default:             kvr__convert_scalar(dst, dst_type, src, src_type, n); break;
    }
}

void kvr_copy_stream(void *dst, const void *src, size_t n)
{
    if (n == 0)
        return;
    /* below a few lines the fence costs more than it saves */
    if (n < 1024 || kvr__isa_resolve(KVR_ISA_AUTO) != KVR_ISA_AVX512) {
        memcpy(dst, src, n);
        return;
    }
    size_t head = (64 - (uintptr_t)dst % 64) % 64, body = (n - head) / 64 * 64;
    memcpy(dst, src, head);
    kvr__copy_stream_avx512((char *)dst + head, (const char *)src + head, body);
    memcpy((char *)dst + head + body, (const char *)src + head + body, n - head - body);
}

void kvr_convert_scaled(void *dst, kvr_dtype dst_type, const void *src, kvr_dtype src_type,
                        size_t n, float scale)
{
    if (n == 0 || !dst || !src) return;
    size_t ssz = kvr_dtype_size(src_type), dsz = kvr_dtype_size(dst_type);
    if (ssz == 0 || dsz == 0) return;
    if (kvr__isa_resolve(KVR_ISA_AUTO) == KVR_ISA_AVX512) {
        kvr__convert_scaled_avx512(dst, dst_type, src, src_type, n, scale);
        return;
    }
    /* Through an f32 piece in L1: the same operations, in pieces. */
    float f[1024];
    for (size_t i = 0; i < n; i += 1024) {
        size_t k = n - i < 1024 ? n - i : 1024;
        kvr_convert(f, KVR_DTYPE_F32, (const char *)src + i * ssz, src_type, k);
        for (size_t q = 0; q < k; q++)
            f[q] *= scale;
        kvr_convert((char *)dst + i * dsz, dst_type, f, KVR_DTYPE_F32, k);
    }
}
