/*
 * le.h — fixed-width integers in byte buffers, least significant byte first,
 * whatever the host: the disk extent format (cache/disk.c), the wire frame
 * header (proto/frame.c), the codecs' block fields (cache/codec*.c, ggml's
 * blocks in base/ggml_quants.c) and the files kvrope-llama reads all store
 * them so. Byte by byte, so any alignment is fine; compilers turn each into
 * one load or store on a little-endian host. Header only (static inline).
 *
 * Not for llama.cpp's sequence state, which is in the host's order by
 * llama.cpp's own design (client/llama/bridge_state.c reads it with memcpy).
 */
#ifndef KVR_BASE_LE_H
#define KVR_BASE_LE_H

#include <stdint.h>

static inline uint16_t kvr_le16_get(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline void kvr_le16_put(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline uint32_t kvr_le32_get(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void kvr_le32_put(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t kvr_le64_get(const uint8_t *p)
{
    return (uint64_t)kvr_le32_get(p) | (uint64_t)kvr_le32_get(p + 4) << 32;
}

static inline void kvr_le64_put(uint8_t *p, uint64_t v)
{
    kvr_le32_put(p, (uint32_t)v);
    kvr_le32_put(p + 4, (uint32_t)(v >> 32));
}

#endif
