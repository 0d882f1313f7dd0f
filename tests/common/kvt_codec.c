/*
 * kvt_codec.c — tests/common/kvt_codec.h: the streamed-decode check.
 */
#include "tests/common/kvt_codec.h"

#include <math.h>

#include <criterion/criterion.h>
#include <string.h>

#include "tests/common/kvt.h"

void kvt_decode_stream_check(const kvr_codec *c, const void *src, size_t len, const float *y0,
                             const uint16_t *h0, uint8_t *buf, size_t cap, const char *what)
{
    cr_assert_geq(cap, len * 4 + 17);
    for (size_t off = 0; off <= 16; off += 16)
        for (int f16 = 0; f16 < 2; f16++) {
            const void *out = buf + off;
            memset(buf, 0xa5, cap);
            cr_assert_eq(kvr_codec_decode_stream(c, buf + off, f16 ? KVR_DTYPE_F16 : KVR_DTYPE_F32,
                                                 src, len), 0);
            for (size_t i = 0; i < len; i++)
                cr_assert(f16 ? kvt_same_f16(h0[i], ((const uint16_t *)out)[i])
                              : kvt_same_f32(y0[i], ((const float *)out)[i]),
                          "stream %s off %zu %s elem %zu", what, off, f16 ? "f16" : "f32", i);
            cr_assert_eq(buf[off + len * (f16 ? 2 : 4)], 0xa5, "wrote past the row");
        }
}

/* The error measure's definition (codec.h), written out here on its own:
 * 64 float lanes (element k to lane k % 64), each adding t*t and r*r in
 * element order from 0 in every block of 1024 elements, then added to its
 * double; the doubles added as a tree (lane l + w onto lane l, w = 32 .. 1);
 * a row whose sums are not finite or whose q is under 2^-60 is one double
 * chain instead (products and sums rounded one at a time). */
void kvt_err_row_def(const float *r, const float *d, size_t len, double *pe, double *pq)
{
    double E[64] = { 0 }, Q[64] = { 0 };
    for (size_t b = 0; b < len; b += 1024) {
        float fe[64] = { 0 }, fq[64] = { 0 };
        for (size_t k = b; k < len && k < b + 1024; k++) {
            float t = d[k] - r[k];
            float t2 = t * t, r2 = r[k] * r[k];
            fe[k % 64] = fe[k % 64] + t2;
            fq[k % 64] = fq[k % 64] + r2;
        }
        for (int l = 0; l < 64; l++) {
            E[l] += (double)fe[l];
            Q[l] += (double)fq[l];
        }
    }
    for (int w = 32; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) {
            E[l] += E[l + w];
            Q[l] += Q[l + w];
        }
    if (isfinite(E[0]) && isfinite(Q[0]) && Q[0] >= 0x1p-60) {
        *pe = E[0];
        *pq = Q[0];
        return;
    }
    double e = 0, q = 0;
    for (size_t k = 0; k < len; k++) {
        double a = (double)d[k] - (double)r[k];
        double a2 = a * a, r2 = (double)r[k] * (double)r[k];
        e += a2;
        q += r2;
    }
    *pe = e;
    *pq = q;
}
