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
/* The rows kernel with every result multiplied by k in f32 before it is
 * stored (passed-through dims too): the bits of rope_rows_* into f32, a
 * multiply and a conversion, in one pass. AVX-512 only; other ISAs get the
 * same bits through a per-head f32 row (rope.c). */
typedef void (*rope_rows_scaled_fn)(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                                    size_t n_heads, int head_dim, int rot, int gptj,
                                    const float *c, const float *s, float k);
void rope_rows_scaled_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s, float k);
/* rope_rows_avx512 / rope_rows_scaled_avx512 (scaled) with non-temporal
 * stores: the same bits, no read of the destination lines. false (nothing
 * written) when dst or the row layout is not aligned for them. Fence with
 * rope_stream_fence_avx512 before the data is handed on. */
bool rope_rows_stream_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s, bool scaled, float k);
void rope_stream_fence_avx512(void);
/* n (a multiple of 64) bytes to a 64-byte aligned dst with non-temporal
 * stores, fenced (kvr_copy_stream). */
void rope_copy_stream_avx512(void *dst, const void *src, size_t n);
/* dst = src * k element-wise in f32, rounded once (kvr_convert_scaled). */
void rope_convert_scaled_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                                size_t n, float k);

/* The per-token sin/cos table: s[i], c[i] = sin, cos(a * f1[i] + b * f2[i])
 * for i < n (f2 may be NULL), bit for bit the same on every ISA. */
typedef void (*rope_sincos_fn)(double a, const double *f1, double b, const double *f2, int n,
                               double *s, double *c);
void rope_sincos_scalar(double a, const double *f1, double b, const double *f2, int n,
                        double *s, double *c);
void rope_sincos_avx2(double a, const double *f1, double b, const double *f2, int n,
                      double *s, double *c);
void rope_sincos_avx512(double a, const double *f1, double b, const double *f2, int n,
                        double *s, double *c);

/* The float tables handed to a rows kernel (layout above) from a double
 * table: fc = (float)(c * m), fs = (float)(s * m), bit for bit on every ISA. */
typedef void (*rope_tofloat_fn)(const double *c, const double *s, int n, double m, int gptj,
                                float *fc, float *fs);
void rope_tofloat_scalar(const double *c, const double *s, int n, double m, int gptj,
                         float *fc, float *fs);
void rope_tofloat_avx2(const double *c, const double *s, int n, double m, int gptj,
                       float *fc, float *fs);
void rope_tofloat_avx512(const double *c, const double *s, int n, double m, int gptj,
                         float *fc, float *fs);

/* One step of the angle-addition recurrence over a table of n pairs:
 * c' = c*stc - s*sts, s' = s*stc + c*sts, each product and sum rounded on
 * its own (no fused multiply-add), so every ISA advances the same bits. */
typedef void (*rope_step_fn)(const double *stc, const double *sts, int n, double *c, double *s);
void rope_step_scalar(const double *stc, const double *sts, int n, double *c, double *s);
void rope_step_avx2(const double *stc, const double *sts, int n, double *c, double *s);
void rope_step_avx512(const double *stc, const double *sts, int n, double *c, double *s);

/* Both at once, for a table computed afresh (bit for bit sincos then
 * tofloat); NULL for the ISAs that do not fuse them. */
typedef void (*rope_table_fn)(double a, const double *f1, double b, const double *f2, int n,
                              double m, int gptj, double *s, double *c, float *fs, float *fc);
void rope_table_avx512(double a, const double *f1, double b, const double *f2, int n, double m,
                       int gptj, double *s, double *c, float *fs, float *fc);

/* The float tables of rope_table_avx512 (fs, fc only) through fused
 * multiply-adds, or false when any of its floats could differ from the
 * reference's (then fs / fc hold garbage and the caller makes the
 * reference table): the same bits whenever it returns true. */
typedef bool (*rope_table_fast_fn)(double a, const double *f1, double b, const double *f2,
                                   int n, int gptj, float *fs, float *fc);
bool rope_table_fast_avx512(double a, const double *f1, double b, const double *f2, int n,
                            int gptj, float *fs, float *fc);

/* Its constants: angles below ROPE_FAST_MAX (2^20 * pi/2 and a margin) are
 * reduced by pi/2 in three 33-bit pieces (fdlibm's medium case) and go
 * through fdlibm's __kernel_sin / __kernel_cos polynomials; larger ones (and
 * NaN) go to libm's sincos. */
#define ROPE_FAST_MAX 1.6e6
#define ROPE_PIO2_1 1.57079632673412561417e+00
#define ROPE_PIO2_2 6.07710050630396597660e-11
#define ROPE_PIO2_3 2.02226624879595063154e-21
#define ROPE_S1 -1.66666666666666324348e-01
#define ROPE_S2  8.33333333332248946124e-03
#define ROPE_S3 -1.98412698298579493134e-04
#define ROPE_S4  2.75573137070700676789e-06
#define ROPE_S5 -2.50507602534068634195e-08
#define ROPE_S6  1.58969099521155010221e-10
#define ROPE_C1  4.16666666666666019037e-02
#define ROPE_C2 -1.38888888888741095749e-03
#define ROPE_C3  2.48015872894767294178e-05
#define ROPE_C4 -2.75573143513906633035e-07
#define ROPE_C5  2.08757232129817482790e-09
#define ROPE_C6 -1.13596475577881948265e-11

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
