/*
 * half.h — the scalar f16 / bf16 <-> f32 conversions of one value, inline, so
 * that every kernel's tail (rope/, cache/) and the exported kvr_f16_to_f32
 * family (base/dtype.c) compute exactly the same bits. f16: round to nearest
 * even as F16C's vcvtps2ph with imm 0; inf stays inf, NaN stays NaN (quiet,
 * top payload bits kept). bf16: round to nearest even; NaN stays NaN.
 * kvr__load1 / kvr__store1: one element of a typed buffer, through them.
 * Header only, private to the project (not installed).
 */
#ifndef KVR_BASE_HALF_H
#define KVR_BASE_HALF_H

#include <stdint.h>
#include <string.h>

#include "base/dtype.h"

static inline uint32_t kvr__f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kvr__bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float kvr__h2f(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f)                        /* inf / nan */
        return kvr__bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return kvr__bits_f32(sign);
        /* subnormal: value = man * 2^-24, exact in float */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    return kvr__bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* Round to nearest even, as F16C's vcvtps2ph with imm 0 does; NaN keeps the
 * top payload bits and becomes quiet. */
static inline uint16_t kvr__f2h(float f)
{
    uint32_t u = kvr__f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) {
        if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    }
    if (a >= 0x477ff000u)                   /* rounds to >= 65536: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {                  /* below the f16 normal range */
        if (a < 0x33000000u) return (uint16_t)sign;   /* < 2^-25: to zero */
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;          /* 14..24 */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

static inline float kvr__b2f(uint16_t h) { return kvr__bits_f32((uint32_t)h << 16); }

static inline uint16_t kvr__f2b(float f)
{
    uint32_t u = kvr__f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of a buffer of type t, widened to float / stored from float. */
static inline float kvr__load1(const void *p, kvr_dtype t, size_t i)
{
    switch (t) {
    case KVR_DTYPE_F16:  return kvr__h2f(((const uint16_t *)p)[i]);
    case KVR_DTYPE_BF16: return kvr__b2f(((const uint16_t *)p)[i]);
    default:             return ((const float *)p)[i];
    }
}

static inline void kvr__store1(void *p, kvr_dtype t, size_t i, float v)
{
    switch (t) {
    case KVR_DTYPE_F16:  ((uint16_t *)p)[i] = kvr__f2h(v); break;
    case KVR_DTYPE_BF16: ((uint16_t *)p)[i] = kvr__f2b(v); break;
    default:             ((float *)p)[i] = v; break;
    }
}

#endif /* KVR_BASE_HALF_H */
