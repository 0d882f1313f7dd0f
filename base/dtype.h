/*
 * dtype.h — the element types of every K/V buffer the project handles
 * (f32, f16, bf16): their names and sizes and the scalar conversions of one
 * value (round to nearest even; inf and nan survive). Part of the installed
 * API (through rope/rope.h and client/kvrope.h).
 *
 * The bulk conversions (kvr_convert, kvr_convert_scaled, kvr_copy_stream)
 * pick SIMD kernels at run time (base/convert*.c, base/cpu.h); base/half.h
 * holds the inline one-value forms every kernel's tail uses, and
 * base/simd_avx2.h / base/simd_avx512.h the vector loads and stores the
 * conversion kernels share with the RoPE rows kernels.
 */
#ifndef KVR_BASE_DTYPE_H
#define KVR_BASE_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element types ------------------------------------------------------ */

typedef enum kvr_dtype {
    KVR_DTYPE_F32  = 0,
    KVR_DTYPE_F16  = 1,   /* IEEE binary16 */
    KVR_DTYPE_BF16 = 2,   /* bfloat16, round-to-nearest-even from f32 */
} kvr_dtype;

size_t      kvr_dtype_size(kvr_dtype t);            /* 4, 2, 2; 0 if unknown */
const char *kvr_dtype_name(kvr_dtype t);            /* "f32", "f16", "bf16" */
int         kvr_dtype_parse(const char *s, kvr_dtype *out); /* 0 or KVR_EINVAL */

float    kvr_f16_to_f32(uint16_t h);
uint16_t kvr_f32_to_f16(float f);                   /* RNE, inf/nan kept */
float    kvr_bf16_to_f32(uint16_t h);
uint16_t kvr_f32_to_bf16(float f);                  /* RNE, nan stays nan */

/* ---- bulk conversion (base/convert.c; SIMD chosen at run time) ---------- */

/* Converts n elements; dst and src may be the same buffer only when the
 * element sizes are equal. Uses F16C/AVX-512 where the CPU has them. */
void kvr_convert(void *dst, kvr_dtype dst_type,
                 const void *src, kvr_dtype src_type, size_t n);

/* dst = src * scale element-wise: each element widened to f32, multiplied
 * in f32 and rounded once to dst_type; the same bits as kvr_convert to
 * f32, a multiply and kvr_convert back, in one pass. dst != src. */
void kvr_convert_scaled(void *dst, kvr_dtype dst_type,
                        const void *src, kvr_dtype src_type, size_t n, float scale);

/* memcpy of n bytes (no overlap) that nothing reads back soon, e.g. a whole
 * context into a caller's buffer: with non-temporal stores where the CPU
 * has AVX-512 (no read of each destination line before it is written),
 * plain memcpy for the unaligned ends and elsewhere; fenced before it
 * returns. */
void kvr_copy_stream(void *dst, const void *src, size_t n);

/* The sequence length transformers would use for a forward over these
 * positions (max + 1, at least 1): the default seq_len of a dynamic NTK /
 * longrope table. */
int64_t kvr_rope_default_seq_len(const int64_t *pos, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* KVR_BASE_DTYPE_H */
