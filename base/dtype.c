/*
 * dtype.c — element types (base/dtype.h): names, sizes, parsing, and the
 * scalar f16 / bf16 conversions of one value, which are base/half.h's inline
 * forms (the same bits every SIMD kernel's tail computes).
 */
#include <string.h>
#include <strings.h>

#include "base/dtype.h"
#include "base/error.h"
#include "base/half.h"

size_t kvr_dtype_size(kvr_dtype t)
{
    switch (t) {
    case KVR_DTYPE_F32:  return 4;
    case KVR_DTYPE_F16:  return 2;
    case KVR_DTYPE_BF16: return 2;
    }
    return 0;
}

const char *kvr_dtype_name(kvr_dtype t)
{
    switch (t) {
    case KVR_DTYPE_F32:  return "f32";
    case KVR_DTYPE_F16:  return "f16";
    case KVR_DTYPE_BF16: return "bf16";
    }
    return "unknown";
}

int kvr_dtype_parse(const char *s, kvr_dtype *out)
{
    if (!s || !out) return KVR_EINVAL;
    if (!strcasecmp(s, "f32") || !strcasecmp(s, "float32")) { *out = KVR_DTYPE_F32; return 0; }
    if (!strcasecmp(s, "f16") || !strcasecmp(s, "float16")) { *out = KVR_DTYPE_F16; return 0; }
    if (!strcasecmp(s, "bf16") || !strcasecmp(s, "bfloat16")) { *out = KVR_DTYPE_BF16; return 0; }
    return KVR_EINVAL;
}

float    kvr_f16_to_f32(uint16_t h)  { return kvr__h2f(h); }
uint16_t kvr_f32_to_f16(float f)     { return kvr__f2h(f); }
float    kvr_bf16_to_f32(uint16_t h) { return kvr__b2f(h); }
uint16_t kvr_f32_to_bf16(float f)    { return kvr__f2b(f); }
