/*
 * rope_avx512.c — AVX-512 (F/BW/VL/DQ) rows kernels (their loads, stores and
 * conversions are base/simd_avx512.h's, shared with base/convert_avx512.c). Built
 * with AVX-512 flags for this file only; called only when cpuid says the CPU
 * has them (rope.c).
 *
 * 16 floats per vector. f16 goes through vcvtph2ps/vcvtps2ph (exact and
 * round-to-nearest-even, as the scalar conversion), bf16 through integer
 * shifts with the same round-to-nearest-even rule as the scalar. Tails use
 * masked loads and stores, so there is no scalar remainder loop, and the
 * arithmetic is the scalar reference's (see rope_internal.h):
 *   NEOX rot=8 --> [ccccssss]: o0 = fmsub(x0, c, x1*s), o1 = fmadd(x1, c, x0*s)
 *   GPTJ rot=8 --> [cscscscs]: o = fmadd(x, c', swap_pairs(x) * s'), s' = [-s, s]
 */
#include <immintrin.h>

#include "rope/rope_internal.h"
#include "base/simd_avx512.h"
#include "base/simd_span_inl.h"

#define SC(v) (sc ? _mm512_mul_ps((v), kv) : (v))

AI void rows_t(void *dst, const kvr_dtype dt, const void *src, const kvr_dtype st_,
               size_t n_heads, int head_dim, int rot, const int gptj,
               const float *c, const float *s, const int sc, float k, const int nt)
{
    size_t hd = (size_t)head_dim, r = (size_t)rot;
    const __m512 kv = _mm512_set1_ps(k);
    for (size_t h = 0; h < n_heads; h++) {
        size_t b = h * hd;
        if (nt) {
            /* streamed rows come from memory, not cache: ask for the rows
             * a few heads ahead (a hint; reads nothing itself) */
            /* (the element size inline: st_ is a constant here, and a
             * call per line cost a third of the streamed rows' time) */
            const size_t ssz = st_ == KVR_DTYPE_F32 ? 4 : 2;
            uintptr_t ahead = (uintptr_t)src + (b + 4 * hd) * ssz;   /* may be past the end */
            for (size_t o = 0; o < hd * ssz; o += 64)
                _mm_prefetch((const char *)(ahead + o), _MM_HINT_T0);
        }
        if (nt && dt != KVR_DTYPE_F32) {
            /* 16-bit results streamed a whole 64-byte line at a time (two
             * vectors' worth; kvr__rope_rows_stream_avx512 checked the spans are
             * multiples of 32 elements): the same values as below */
            if (gptj) {
                for (size_t j = 0; j < r; j += 32) {
                    __m512 x = ld(src, b + j, st_), y = ld(src, b + j + 16, st_);
                    __m512 xs = _mm512_permute_ps(x, 0xB1), ys = _mm512_permute_ps(y, 0xB1);
                    __m512 ox = SC(_mm512_fmadd_ps(x, _mm512_loadu_ps(c + j),
                                                   _mm512_mul_ps(xs, _mm512_loadu_ps(s + j))));
                    __m512 oy = SC(_mm512_fmadd_ps(y, _mm512_loadu_ps(c + j + 16),
                                                   _mm512_mul_ps(ys, _mm512_loadu_ps(s + j + 16))));
                    st_line(dst, b + j, dt, ox, oy);
                }
            } else {
                size_t half = r / 2;
                for (size_t i = 0; i < half; i += 32) {
                    __m512 x0 = ld(src, b + i, st_), x1 = ld(src, b + i + half, st_);
                    __m512 y0 = ld(src, b + i + 16, st_), y1 = ld(src, b + i + 16 + half, st_);
                    __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
                    __m512 cw = _mm512_loadu_ps(c + i + 16), sw = _mm512_loadu_ps(s + i + 16);
                    __m512 a0 = SC(_mm512_fmsub_ps(x0, cv, _mm512_mul_ps(x1, sv)));
                    __m512 a1 = SC(_mm512_fmadd_ps(x1, cv, _mm512_mul_ps(x0, sv)));
                    __m512 b0 = SC(_mm512_fmsub_ps(y0, cw, _mm512_mul_ps(y1, sw)));
                    __m512 b1 = SC(_mm512_fmadd_ps(y1, cw, _mm512_mul_ps(y0, sw)));
                    st_line(dst, b + i, dt, a0, b0);
                    st_line(dst, b + i + half, dt, a1, b1);
                }
            }
        } else if (gptj) {
            size_t j = 0;
            for (; j + 16 <= r; j += 16) {
                __m512 x = ld(src, b + j, st_);
                __m512 sw = _mm512_permute_ps(x, 0xB1);
                __m512 o = _mm512_fmadd_ps(x, _mm512_loadu_ps(c + j),
                                           _mm512_mul_ps(sw, _mm512_loadu_ps(s + j)));
                ST(nt, dst, b + j, dt, SC(o));
            }
            if (j < r) {
                __mmask16 m = tailmask(r - j);
                __m512 x = ldm(src, b + j, st_, m);
                __m512 sw = _mm512_permute_ps(x, 0xB1);
                __m512 o = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, c + j),
                                           _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(m, s + j)));
                stm(dst, b + j, dt, SC(o), m);
            }
        } else {
            size_t half = r / 2, i = 0;
            for (; i + 16 <= half; i += 16) {
                __m512 x0 = ld(src, b + i, st_), x1 = ld(src, b + i + half, st_);
                __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
                __m512 o0 = _mm512_fmsub_ps(x0, cv, _mm512_mul_ps(x1, sv));
                __m512 o1 = _mm512_fmadd_ps(x1, cv, _mm512_mul_ps(x0, sv));
                ST(nt, dst, b + i, dt, SC(o0));
                ST(nt, dst, b + i + half, dt, SC(o1));
            }
            if (i < half) {
                __mmask16 m = tailmask(half - i);
                __m512 x0 = ldm(src, b + i, st_, m), x1 = ldm(src, b + i + half, st_, m);
                __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
                __m512 o0 = _mm512_fmsub_ps(x0, cv, _mm512_mul_ps(x1, sv));
                __m512 o1 = _mm512_fmadd_ps(x1, cv, _mm512_mul_ps(x0, sv));
                stm(dst, b + i, dt, SC(o0), m);
                stm(dst, b + i + half, dt, SC(o1), m);
            }
        }
        /* the dims not rotated */
        if (r < hd && sc)
            conv_span_scaled(dst, dt, src, st_, b + r, b + hd, kv);
        else if (r < hd)
            copy_span(dst, dt, src, st_, b + r, b + hd);
    }
}

#define ROWS_CASE(S, D)                                                              \
    if (st == S && dt == D) {                                                        \
        if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s, 0, 1.0f, 0);  \
        else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s, 0, 1.0f, 0);  \
        return;                                                                      \
    }

#define ROWS_SCALED_CASE(S, D)                                                       \
    if (st == S && dt == D) {                                                        \
        if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s, 1, k, 0);     \
        else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s, 1, k, 0);     \
        return;                                                                      \
    }

void kvr__rope_rows_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                      size_t n_heads, int head_dim, int rot, int gptj,
                      const float *c, const float *s)
{
    SIMD_DTYPE_PAIRS_ALL(ROWS_CASE)
}

void kvr__rope_rows_scaled_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s, float k)
{
    SIMD_DTYPE_PAIRS_ALL(ROWS_SCALED_CASE)
}

#define ROWS_STREAM_CASE(S, D)                                                            \
    if (st == S && dt == D) {                                                             \
        if (scaled) {                                                                     \
            if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s, 1, k, 1);   \
            else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s, 1, k, 1);   \
        } else {                                                                          \
            if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s, 0, 1.0f, 1); \
            else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s, 0, 1.0f, 1); \
        }                                                                                 \
        return true;                                                                      \
    }

/* kvr__rope_rows_avx512 (scaled: kvr__rope_rows_scaled_avx512) with non-temporal
 * stores of the full vectors: the same values. Only where every full
 * vector's address is aligned (dst on 64 bytes, head rows and rotary
 * halves whole vectors); false, nothing done, otherwise. The caller
 * fences (_mm_sfence via kvr__rope_stream_fence_avx512) before the data is
 * handed on. */
bool kvr__rope_rows_stream_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s, bool scaled, float k)
{
    size_t vb = 64, esz = kvr_dtype_size(dt);   /* 16-bit: two vectors a line */
    size_t part = gptj ? (size_t)rot : (size_t)rot / 2;   /* the full-vector spans */
    if (((uintptr_t)dst % 64) || ((size_t)head_dim * esz) % vb || (part * esz) % vb)
        return false;
    SIMD_DTYPE_PAIRS_ALL(ROWS_STREAM_CASE)
    return false;
}

void kvr__rope_stream_fence_avx512(void) { _mm_sfence(); }
