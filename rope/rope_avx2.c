/*
 * rope_avx2.c — AVX2 + FMA + F16C rows kernel (its loads, stores and
 * conversions are base/simd_avx2.h's, shared with base/convert_avx2.c). Built with
 * those flags for this file only; called only when cpuid says the CPU has
 * them (rope.c).
 *
 * 8 floats per vector; the remainder of a row runs through the scalar
 * element conversions with fmaf (a single vfmadd here), so every element is
 * computed exactly as the scalar reference computes it (rope_internal.h):
 *   NEOX rot=8 --> [ccccssss]: o0 = fmsub(x0, c, x1*s), o1 = fmadd(x1, c, x0*s)
 *   GPTJ rot=8 --> [cscscscs]: o = fmadd(x, c', swap_pairs(x) * s'), s' = [-s, s]
 */
#include <immintrin.h>

#include "rope/rope_internal.h"
#include "base/simd_avx2.h"
#include "base/simd_span_inl.h"

AI void rows_t(void *dst, const kvr_dtype dt, const void *src, const kvr_dtype st_,
               size_t n_heads, int head_dim, int rot, const int gptj,
               const float *c, const float *s)
{
    size_t hd = (size_t)head_dim, r = (size_t)rot;
    for (size_t h = 0; h < n_heads; h++) {
        size_t b = h * hd;
        if (gptj) {
            size_t j = 0;
            for (; j + 8 <= r; j += 8) {
                __m256 x = ld(src, b + j, st_);
                __m256 sw = _mm256_permute_ps(x, 0xB1);
                __m256 o = _mm256_fmadd_ps(x, _mm256_loadu_ps(c + j),
                                           _mm256_mul_ps(sw, _mm256_loadu_ps(s + j)));
                st(dst, b + j, dt, o);
            }
            for (; j < r; j += 2) {
                float x0 = kvr__load1(src, st_, b + j), x1 = kvr__load1(src, st_, b + j + 1);
                kvr__store1(dst, dt, b + j, fmaf(x0, c[j], x1 * s[j]));
                kvr__store1(dst, dt, b + j + 1, fmaf(x1, c[j + 1], x0 * s[j + 1]));
            }
        } else {
            size_t half = r / 2, i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 x0 = ld(src, b + i, st_), x1 = ld(src, b + i + half, st_);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                __m256 o0 = _mm256_fmsub_ps(x0, cv, _mm256_mul_ps(x1, sv));
                __m256 o1 = _mm256_fmadd_ps(x1, cv, _mm256_mul_ps(x0, sv));
                st(dst, b + i, dt, o0);
                st(dst, b + i + half, dt, o1);
            }
            for (; i < half; i++) {
                float x0 = kvr__load1(src, st_, b + i), x1 = kvr__load1(src, st_, b + i + half);
                kvr__store1(dst, dt, b + i, fmaf(x0, c[i], -(x1 * s[i])));
                kvr__store1(dst, dt, b + i + half, fmaf(x1, c[i], x0 * s[i]));
            }
        }
        if (r < hd)
            copy_span(dst, dt, src, st_, b + r, b + hd);   /* the dims not rotated */
    }
}

#define ROWS_CASE(S, D)                                                              \
    if (st == S && dt == D) {                                                        \
        if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s);           \
        else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s);           \
        return;                                                                      \
    }

void kvr__rope_rows_avx2(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                    size_t n_heads, int head_dim, int rot, int gptj,
                    const float *c, const float *s)
{
    SIMD_DTYPE_PAIRS_ALL(ROWS_CASE)
}
