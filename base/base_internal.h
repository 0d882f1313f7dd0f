/*
 * base_internal.h — private to the project (hidden in libkvrope.so): the
 * per-ISA kernels behind kvr_convert / kvr_convert_scaled / kvr_copy_stream
 * (base/convert*.c) and the resolution of a wanted kernel set (base/cpu.c),
 * which rope/'s and cache/'s kernel choices use too.
 */
#ifndef KVR_BASE_INTERNAL_H
#define KVR_BASE_INTERNAL_H

#include <stddef.h>

#include "base/cpu.h"
#include "base/dtype.h"

#pragma GCC visibility push(hidden)

/* X(src, dst) for the six pairs of different element types: the cases a
 * conversion kernel specialises (equal types are a memmove). */
#define KVR__DTYPE_PAIRS_CONVERTED(X)                                          \
    X(KVR_DTYPE_F32, KVR_DTYPE_F16)  X(KVR_DTYPE_F32, KVR_DTYPE_BF16)         \
    X(KVR_DTYPE_F16, KVR_DTYPE_F32)  X(KVR_DTYPE_F16, KVR_DTYPE_BF16)         \
    X(KVR_DTYPE_BF16, KVR_DTYPE_F32) X(KVR_DTYPE_BF16, KVR_DTYPE_F16)

/* Resolves AUTO and refuses (falls back from) ISAs the CPU lacks. */
kvr_isa kvr__isa_resolve(kvr_isa want);

/* n elements from st to dt; dst == src only for equal element sizes. */
void kvr__convert_scalar(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n);
void kvr__convert_avx2(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n);
void kvr__convert_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n);
/* dst = src * k element-wise in f32, rounded once (kvr_convert_scaled). */
void kvr__convert_scaled_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                                size_t n, float k);
/* n (a multiple of 64) bytes to a 64-byte aligned dst with non-temporal
 * stores, fenced (kvr_copy_stream). */
void kvr__copy_stream_avx512(void *dst, const void *src, size_t n);

#pragma GCC visibility pop

#endif /* KVR_BASE_INTERNAL_H */
