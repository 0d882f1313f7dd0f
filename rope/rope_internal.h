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
#include "base/half.h"
#include "base/base_internal.h"

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
void kvr__rope_inv_freq(const kvr_rope *r, int64_t seq_len, double *out);

typedef void (*rope_rows_fn)(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s);

void kvr__rope_rows_scalar(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                      size_t n_heads, int head_dim, int rot, int gptj,
                      const float *c, const float *s);

void kvr__rope_rows_avx2(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                    size_t n_heads, int head_dim, int rot, int gptj,
                    const float *c, const float *s);
void kvr__rope_rows_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                      size_t n_heads, int head_dim, int rot, int gptj,
                      const float *c, const float *s);
/* The rows kernel with every result multiplied by k in f32 before it is
 * stored (passed-through dims too): the bits of rope_rows_* into f32, a
 * multiply and a conversion, in one pass. AVX-512 only; other ISAs get the
 * same bits through a per-head f32 row (rope.c). */
typedef void (*rope_rows_scaled_fn)(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                                    size_t n_heads, int head_dim, int rot, int gptj,
                                    const float *c, const float *s, float k);
void kvr__rope_rows_scaled_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s, float k);
/* kvr__rope_rows_avx512 / kvr__rope_rows_scaled_avx512 (scaled) with non-temporal
 * stores: the same bits, no read of the destination lines. false (nothing
 * written) when dst or the row layout is not aligned for them. Fence with
 * kvr__rope_stream_fence_avx512 before the data is handed on. */
bool kvr__rope_rows_stream_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s, bool scaled, float k);
void kvr__rope_stream_fence_avx512(void);
/* The per-token sin/cos table: s[i], c[i] = sin, cos(a * f1[i] + b * f2[i])
 * for i < n (f2 may be NULL), bit for bit the same on every ISA. */
typedef void (*rope_sincos_fn)(double a, const double *f1, double b, const double *f2, int n,
                               double *s, double *c);
void kvr__rope_sincos_scalar(double a, const double *f1, double b, const double *f2, int n,
                        double *s, double *c);
void kvr__rope_sincos_avx2(double a, const double *f1, double b, const double *f2, int n,
                      double *s, double *c);
void kvr__rope_sincos_avx512(double a, const double *f1, double b, const double *f2, int n,
                        double *s, double *c);

/* The float tables handed to a rows kernel (layout above) from a double
 * table: fc = (float)(c * m), fs = (float)(s * m), bit for bit on every ISA. */
typedef void (*rope_tofloat_fn)(const double *c, const double *s, int n, double m, int gptj,
                                float *fc, float *fs);
void kvr__rope_tofloat_scalar(const double *c, const double *s, int n, double m, int gptj,
                         float *fc, float *fs);
void kvr__rope_tofloat_avx2(const double *c, const double *s, int n, double m, int gptj,
                       float *fc, float *fs);
void kvr__rope_tofloat_avx512(const double *c, const double *s, int n, double m, int gptj,
                         float *fc, float *fs);

/* One step of the angle-addition recurrence over a table of n pairs:
 * c' = c*stc - s*sts, s' = s*stc + c*sts, each product and sum rounded on
 * its own (no fused multiply-add), so every ISA advances the same bits. */
typedef void (*rope_step_fn)(const double *stc, const double *sts, int n, double *c, double *s);
void kvr__rope_step_scalar(const double *stc, const double *sts, int n, double *c, double *s);
void kvr__rope_step_avx2(const double *stc, const double *sts, int n, double *c, double *s);
void kvr__rope_step_avx512(const double *stc, const double *sts, int n, double *c, double *s);

/* Both at once, for a table computed afresh (bit for bit sincos then
 * tofloat); NULL for the ISAs that do not fuse them. */
typedef void (*rope_table_fn)(double a, const double *f1, double b, const double *f2, int n,
                              double m, int gptj, double *s, double *c, float *fs, float *fc);
void kvr__rope_table_avx512(double a, const double *f1, double b, const double *f2, int n, double m,
                       int gptj, double *s, double *c, float *fs, float *fc);

/* The float tables of kvr__rope_table_avx512 (fs, fc only) through fused
 * multiply-adds, or false when any of its floats could differ from the
 * reference's (then fs / fc hold garbage and the caller makes the
 * reference table): the same bits whenever it returns true. */
typedef bool (*rope_table_fast_fn)(double a, const double *f1, double b, const double *f2,
                                   int n, int gptj, float *fs, float *fc);
bool kvr__rope_table_fast_avx512(double a, const double *f1, double b, const double *f2, int n,
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


#pragma GCC visibility pop

#endif /* KVR_ROPE_INTERNAL_H */
