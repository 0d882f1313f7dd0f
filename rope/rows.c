/*
 * rows.c — the scalar reference "rows" kernel: rotates the n_heads rows of
 * one token with the token's cos/sin table (layout: rope_internal.h). It is
 * the reference every SIMD rows kernel is tested against; they evaluate the
 * same float expressions in the same order, so agreement is exact, not
 * approximate.
 */
#include <math.h>

#include "rope/rope_internal.h"

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
        for (size_t j = 0; j < hd; j++) x[j] = kvr__load1(src, st, base + j);
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
        for (size_t j = 0; j < hd; j++) kvr__store1(dst, dt, base + j, y[j]);
    }
}
