/*
 * ggml_quants.h — ggml's legacy quantized blocks, bit for bit as ggml's
 * reference quantizers (ggml-quants.c: quantize_row_q8_0_ref and friends)
 * write and read them: one home for the store's codecs (cache/codec.c, whose
 * SIMD kernels are tested against these) and the llama.cpp bridge
 * (client/llama/bridge_state.c), which exchange llama.cpp caches.
 *
 * A block holds 32 values; d and m are IEEE f16, little endian:
 *   Q8_0 34 B: d, int8 qs[32]                              y = qs[j]*d
 *   Q4_0 18 B: d, qs[16] = q[j] | q[j+16] << 4             y = (q - 8)*d
 *   Q4_1 20 B: d, m, qs[16] (as Q4_0)                      y = q*d + m
 *   Q5_0 22 B: d, u32 qh (bit j: the fifth bit of q[j]), qs[16] (as Q4_0)
 *                                                           y = (q - 16)*d
 * The type values are ggml's (enum ggml_type), so a state's type field maps
 * directly.
 */
#ifndef KVR_BASE_GGML_QUANTS_H
#define KVR_BASE_GGML_QUANTS_H

#include <stddef.h>
#include <stdint.h>

/* Not installed: hidden in shared objects (libkvrope.so exports its
 * installed headers' functions only), linked statically across rooms. */
#pragma GCC visibility push(hidden)

#define KVR_GGML_QK 32          /* values per block */

typedef enum kvr_ggml_qtype {
    KVR_GGML_Q4_0 = 2,
    KVR_GGML_Q4_1 = 3,
    KVR_GGML_Q5_0 = 6,
    KVR_GGML_Q8_0 = 8,
} kvr_ggml_qtype;

/* Bytes of one block (34, 18, 20, 22); 0 for any other value. */
size_t kvr_ggml_block_bytes(kvr_ggml_qtype t);

/* Encodes the 32 values x into one block at y, as ggml does. Returns 0, or
 * -1 when d (or Q4_1's m) does not fit an f16 (the block is written all the
 * same, with an infinite scale) or t is not a block type. x must be finite
 * for the result to be ggml's (callers check, or accept ggml's behaviour). */
int kvr_ggml_block_enc(kvr_ggml_qtype t, uint8_t *y, const float *x);

/* Decodes one block at x into 32 floats at y (nothing for other types). */
void kvr_ggml_block_dec(kvr_ggml_qtype t, float *y, const uint8_t *x);

#pragma GCC visibility pop

#endif /* KVR_BASE_GGML_QUANTS_H */
