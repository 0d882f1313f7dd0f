/*
 * rope_internal.h — private to rope/: the engine struct, the scalar element
 * conversions shared by every kernel, and the per-ISA kernel tables.
 *
 * The split of work: rope.c turns positions into per-token cos/sin tables
 * (double precision angles, converted to float once per token), and a "rows"
 * kernel rotates the n_heads rows of one token with that table. Every ISA's
 * rows kernel evaluates exactly the same float expressions
 *     o0 = fma(x0, c, -(x1 * s))      o1 = fma(x1, c, x0 * s)
 * so the SIMD kernels agree with the scalar reference bit for bit.
 *
 * Table layout handed to a rows kernel (rot = rotary_dim):
 *   NEOX: c[i], s[i] for i < rot/2; pair (i, i + rot/2).
 *   GPTJ: c[j], s[j] for j < rot, expanded: c[2i] = c[2i+1] = cos_i,
 *         s[2i] = -sin_i, s[2i+1] = +sin_i; pair (2i, 2i+1).
 */
#ifndef KVR_ROPE_INTERNAL_H
#define KVR_ROPE_INTERNAL_H

#include <string.h>
#include <math.h>
#include "rope/rope.h"

/* Private to rope/: hidden in shared objects (libkvrope.so exports kvr_* only). */
#pragma GCC visibility push(hidden)


struct kvr_rope {
    kvr_rope_config cfg;
    int     head_dim;
    int     rot;
    int     npairs;
    double  mscale;                 /* magnitude applied by apply */
    int64_t orig_max;               /* effective original_max_position_embeddings */
    double  factor_eff;             /* effective factor (longrope: max/orig) */
    double  inv_freq[KVR_ROPE_MAX_HEAD_DIM / 2]; /* table for seq_len 0 */
    struct kvr_rope *local, *none;  /* per-layer engines (owned), or NULL */
};

/* Frequency table for a sequence length (dynamic / longrope depend on it;
 * the others ignore it). */
void rope_inv_freq(const kvr_rope *r, int64_t seq_len, double *out);

typedef void (*rope_rows_fn)(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s);
typedef void (*rope_convert_fn)(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                                size_t n);

void rope_rows_scalar(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                      size_t n_heads, int head_dim, int rot, int gptj,
                      const float *c, const float *s);
void rope_convert_scalar(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n);

void rope_rows_avx2(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                    size_t n_heads, int head_dim, int rot, int gptj,
                    const float *c, const float *s);
void rope_convert_avx2(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n);
void rope_rows_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                      size_t n_heads, int head_dim, int rot, int gptj,
                      const float *c, const float *s);
void rope_convert_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n);

/* Resolves AUTO and refuses (falls back from) ISAs the CPU lacks. */
kvr_isa rope_isa_resolve(kvr_isa want);

/* ---- scalar conversions (inline so every kernel's tail uses the same) ---- */

static inline uint32_t rope_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float rope_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float rope_h2f(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f)                        /* inf / nan */
        return rope_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return rope_bits_f32(sign);
        /* subnormal: value = man * 2^-24, exact in float */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    return rope_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* Round to nearest even, as F16C's vcvtps2ph with imm 0 does; NaN keeps the
 * top payload bits and becomes quiet. */
static inline uint16_t rope_f2h(float f)
{
    uint32_t u = rope_f32_bits(f);
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

static inline float rope_b2f(uint16_t h) { return rope_bits_f32((uint32_t)h << 16); }

static inline uint16_t rope_f2b(float f)
{
    uint32_t u = rope_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float rope_load1(const void *p, kvr_dtype t, size_t i)
{
    switch (t) {
    case KVR_DTYPE_F16:  return rope_h2f(((const uint16_t *)p)[i]);
    case KVR_DTYPE_BF16: return rope_b2f(((const uint16_t *)p)[i]);
    default:             return ((const float *)p)[i];
    }
}

static inline void rope_store1(void *p, kvr_dtype t, size_t i, float v)
{
    switch (t) {
    case KVR_DTYPE_F16:  ((uint16_t *)p)[i] = rope_f2h(v); break;
    case KVR_DTYPE_BF16: ((uint16_t *)p)[i] = rope_f2b(v); break;
    default:             ((float *)p)[i] = v; break;
    }
}

#pragma GCC visibility pop

#endif /* KVR_ROPE_INTERNAL_H */
