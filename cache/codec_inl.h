/*
 * codec_inl.h — small helpers shared by the scalar codecs (codec.c) and
 * their SIMD kernels (codec_avx2.c, codec_ggml_avx2.c, codec_ggml_avx512.c):
 * the neighbouring f16 values, the size of a ggml block (little-endian
 * fields: base/le.h). Plain C (no ISA flags); include after cache/codec.h. Header
 * only (static inline; the block size always inlined, so that a kernel's
 * folds to a constant where its type is one).
 */
#ifndef KVR_CACHE_CODEC_INL_H
#define KVR_CACHE_CODEC_INL_H

#include <stddef.h>
#include <stdint.h>

#include "base/le.h"       /* kvr_le16_get / _put: the blocks' f16 fields */


/* Next f16 towards +inf / -inf (finite inputs only). */
static inline uint16_t f16_up(uint16_t h)
{
    if (h == 0x8000 || h == 0x0000) return 0x0001;
    return (h & 0x8000) ? (uint16_t)(h - 1) : (uint16_t)(h + 1);
}
static inline uint16_t f16_down(uint16_t h)
{
    if (h == 0x8000 || h == 0x0000) return 0x8001;
    return (h & 0x8000) ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
}

/* Bytes of one block of 32 values of the ggml codec t (codec.h's layouts). */
static inline __attribute__((always_inline)) size_t ggml_block_bytes(kvr_codec_type t)
{
    switch (t) {
    case KVR_CODEC_Q8_0: return 34;
    case KVR_CODEC_Q4_0: return 18;
    case KVR_CODEC_Q4_1: return 20;
    default:             return 22;
    }
}

#endif /* KVR_CACHE_CODEC_INL_H */
