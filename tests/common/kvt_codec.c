/*
 * kvt_codec.c — tests/common/kvt_codec.h: the streamed-decode check.
 */
#include "tests/common/kvt_codec.h"

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
