/*
 * kvt_codec.h — checks the codec tests (test_codec_quant.c,
 * test_codec_ggml.c) share. Compiled into libtestcommon.a
 * (tests/common/kvt_codec.c; needs cache/'s codec objects, which those
 * tests link); failures are Criterion assertions in the calling test.
 */
#ifndef KVR_TESTS_KVT_CODEC_H
#define KVR_TESTS_KVT_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "cache/codec.h"

/* kvr_codec_decode_stream of len values of the encoded row src with *c,
 * into buf (64-byte aligned, at least len * 4 + 17 bytes) at offset 0
 * (non-temporal stores) and 16 (ordinary ones), as f32 and as f16: the
 * values are y0's (f32) and h0's (f16), bit for bit (a NaN matching any
 * NaN), and the byte after the row is untouched. `what` names the case in
 * failures. */
void kvt_decode_stream_check(const kvr_codec *c, const void *src, size_t len, const float *y0,
                             const uint16_t *h0, uint8_t *buf, size_t cap, const char *what);

/* The store's error measure of one row of len values (codec.h,
 * kvr_codec_err_rows), written out on its own from its definition: what
 * every ISA's kernel and the store's rel_rms must reproduce bit for bit. */
void kvt_err_row_def(const float *ref, const float *dec, size_t len, double *e, double *q);

#endif
