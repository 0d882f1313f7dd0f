/*
 * simd_span_inl.h — the width-generic part of the SIMD conversions: a span
 * copied or converted with whichever of base/simd_avx2.h / simd_avx512.h
 * the including file took (their conv_span), and the list of the nine
 * (source, destination) type pairs a kernel specialises. Include after one
 * of those headers, from the *_avx2.c / *_avx512.c files that use them
 * (base/convert_avx*.c, rope/rope_avx*.c): each compiles it with its own
 * ISA flags. Header only (static inline).
 */
#ifndef KVR_BASE_SIMD_SPAN_INL_H
#define KVR_BASE_SIMD_SPAN_INL_H

#include <string.h>

#include "base/base_internal.h"

/* X(src, dst) for every pair of element types: the equal ones (a copy) and
 * the six converted ones. */
#define SIMD_DTYPE_PAIRS_ALL(X)                                              \
    X(KVR_DTYPE_F32, KVR_DTYPE_F32) X(KVR_DTYPE_F16, KVR_DTYPE_F16)          \
    X(KVR_DTYPE_BF16, KVR_DTYPE_BF16) KVR__DTYPE_PAIRS_CONVERTED(X)

/* Elements [i0, i1) of src (type st) to dst (type dt): moved bytes for
 * equal types (nothing to do in place), else conv_span with the pair of
 * types as constants, so that its loads and stores specialise (where the
 * caller's types are constants already, the choice folds away). */
AI void copy_span(void *dst, kvr_dtype dt, const void *src, kvr_dtype st_, size_t i0, size_t i1)
{
    if (dt == st_) {
        size_t es = kvr_dtype_size(dt);
        if (dst != src)
            memmove((char *)dst + i0 * es, (const char *)src + i0 * es, (i1 - i0) * es);
        return;
    }
#define COPY_SPAN_CASE(S, D) \
    if (st_ == S && dt == D) { conv_span(dst, D, src, S, i0, i1); return; }
    KVR__DTYPE_PAIRS_CONVERTED(COPY_SPAN_CASE)
#undef COPY_SPAN_CASE
}

#endif /* KVR_BASE_SIMD_SPAN_INL_H */
