/*
 * dtype.h — the element types of every K/V buffer the project handles
 * (f32, f16, bf16): their names and sizes and the scalar conversions of one
 * value (round to nearest even; inf and nan survive). Part of the installed
 * API (through rope/rope.h and client/kvrope.h).
 *
 * The bulk conversions (kvr_convert, kvr_convert_scaled) pick SIMD kernels at
 * run time and share those kernels' load/store code with the RoPE rows
 * kernels, so they are declared in rope/rope.h and live in rope/convert.c;
 * base/half.h holds the inline scalar forms every kernel's tail uses.
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

#ifdef __cplusplus
}
#endif
#endif /* KVR_BASE_DTYPE_H */
