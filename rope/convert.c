/*
 * convert.c — bulk element conversion: kvr_convert / kvr_convert_scaled /
 * kvr_copy_stream with their run-time choice of kernel (the SIMD kernels live
 * beside the rows kernels in rope_avx2.c / rope_avx512.c and share their
 * load/store code), and the scalar reference "rows" kernel that rotates the
 * heads of one token. The element types themselves are base/dtype.[ch].
 *
 * The scalar kernel is the reference every SIMD kernel is tested against; it
 * evaluates the same float expressions in the same order (see
 * rope_internal.h), so agreement is exact, not approximate.
 */
#include <errno.h>
#include <string.h>
#include <strings.h>
#include <math.h>

#include "rope/rope_internal.h"

void kvr__rope_convert_scalar(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n)
{
    if (dt == st) {
        if (dst != src) memmove(dst, src, n * kvr_dtype_size(st));
        return;
    }
    /* Equal element sizes (f16 <-> bf16) may be done in place: each element
     * is read before it is written. */
    for (size_t i = 0; i < n; i++)
        rope_store1(dst, dt, i, rope_load1(src, st, i));
}

void kvr_convert(void *dst, kvr_dtype dst_type, const void *src, kvr_dtype src_type, size_t n)
{
    if (n == 0 || !dst || !src) return;
    if (kvr_dtype_size(dst_type) == 0 || kvr_dtype_size(src_type) == 0) return;
    switch (kvr__rope_isa_resolve(KVR_ISA_AUTO)) {
    case KVR_ISA_AVX512: kvr__rope_convert_avx512(dst, dst_type, src, src_type, n); break;
    case KVR_ISA_AVX2:   kvr__rope_convert_avx2(dst, dst_type, src, src_type, n); break;
    default:             kvr__rope_convert_scalar(dst, dst_type, src, src_type, n); break;
    }
}

void kvr_copy_stream(void *dst, const void *src, size_t n)
{
    if (n == 0)
        return;
    /* below a few lines the fence costs more than it saves */
    if (n < 1024 || kvr__rope_isa_resolve(KVR_ISA_AUTO) != KVR_ISA_AVX512) {
        memcpy(dst, src, n);
        return;
    }
    size_t head = (64 - (uintptr_t)dst % 64) % 64, body = (n - head) / 64 * 64;
    memcpy(dst, src, head);
    kvr__rope_copy_stream_avx512((char *)dst + head, (const char *)src + head, body);
    memcpy((char *)dst + head + body, (const char *)src + head + body, n - head - body);
}

void kvr_convert_scaled(void *dst, kvr_dtype dst_type, const void *src, kvr_dtype src_type,
                        size_t n, float scale)
{
    if (n == 0 || !dst || !src) return;
    size_t ssz = kvr_dtype_size(src_type), dsz = kvr_dtype_size(dst_type);
    if (ssz == 0 || dsz == 0) return;
    if (kvr__rope_isa_resolve(KVR_ISA_AUTO) == KVR_ISA_AVX512) {
        kvr__rope_convert_scaled_avx512(dst, dst_type, src, src_type, n, scale);
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

/* One token: n_heads rows of head_dim elements. Each row is widened into a
 * float scratch row first, which also makes dst == src safe. */
void kvr__rope_rows_scalar(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                      size_t n_heads, int head_dim, int rot, int gptj,
                      const float *c, const float *s)
{
    float x[KVR_ROPE_MAX_HEAD_DIM];
    float y[KVR_ROPE_MAX_HEAD_DIM];
    size_t hd = (size_t)head_dim;
    for (size_t h = 0; h < n_heads; h++) {
        size_t base = h * hd;
        for (size_t j = 0; j < hd; j++) x[j] = rope_load1(src, st, base + j);
        if (gptj) {
            for (int j = 0; j < rot; j += 2) {
                float x0 = x[j], x1 = x[j + 1];
                /* same association as the SIMD form fma(x, c, swap(x) * s) */
                y[j]     = fmaf(x0, c[j], x1 * s[j]);
                y[j + 1] = fmaf(x1, c[j + 1], x0 * s[j + 1]);
            }
        } else {
            int half = rot / 2;
            for (int i = 0; i < half; i++) {
                float x0 = x[i], x1 = x[i + half];
                y[i]        = fmaf(x0, c[i], -(x1 * s[i]));
                y[i + half] = fmaf(x1, c[i], x0 * s[i]);
            }
        }
        for (size_t j = (size_t)rot; j < hd; j++) y[j] = x[j];
        for (size_t j = 0; j < hd; j++) rope_store1(dst, dt, base + j, y[j]);
    }
}
