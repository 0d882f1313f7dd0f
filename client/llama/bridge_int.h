/*
 * bridge_int.h — private to the bridge's files (client/llama/bridge*.c):
 * error messages, little-endian access, ggml element codecs and the
 * Walsh-Hadamard transform shared by the state codec and the client side.
 */
#ifndef KVR_LLAMA_BRIDGE_INT_H
#define KVR_LLAMA_BRIDGE_INT_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "client/llama/kvrope_llama.h"

#define KVR_BR_HIDDEN __attribute__((visibility("hidden")))

/* Writes the message into err (if any) and returns code. */
KVR_BR_HIDDEN int kvr__br_fail(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static inline uint32_t kvr__br_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t kvr__br_rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void kvr__br_wr32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void kvr__br_wr64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* ggml block geometry of a type: values per block and bytes per block. */
KVR_BR_HIDDEN void kvr__br_type_geom(kvr_llama_type t, uint32_t *blck, uint32_t *bytes);
/* Bytes of a row of n values (0 if n is not a multiple of the block). */
KVR_BR_HIDDEN uint64_t kvr__br_row_bytes(kvr_llama_type t, uint64_t n);

/* Rows of n values of type t <-> f32 (n a multiple of the block). Encoding
 * is ggml's reference quantizer; f16/bf16 round to nearest even. */
KVR_BR_HIDDEN void kvr__br_row_to_f32(kvr_llama_type t, float *dst, const uint8_t *src, size_t n);
KVR_BR_HIDDEN void kvr__br_row_from_f32(kvr_llama_type t, uint8_t *dst, const float *src, size_t n);

/* Hadamard block length for K / V rows of a quantized type (0 = none):
 * K: largest power of two >= 64 dividing head_dim; V: 64 when head_dim % 64
 * == 0. Plain types and no_attn_rot give 0. */
KVR_BR_HIDDEN uint32_t kvr__br_rot_k(kvr_llama_type t, uint32_t head_dim, bool no_attn_rot);
KVR_BR_HIDDEN uint32_t kvr__br_rot_v(kvr_llama_type t, uint32_t head_dim, bool no_attn_rot);
/* In place: each consecutive block of nrot values of x[0..n) becomes H . x,
 * computed as ggml's CPU FWHT does (scale first, then butterflies of
 * growing length, float). */
KVR_BR_HIDDEN void kvr__br_fwht(float *x, size_t n, uint32_t nrot);

#endif
