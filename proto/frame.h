/*
 * frame.h — kvrope's frame codec: the fixed header that precedes every
 * protobuf message and its raw payload, and the limits checked before any
 * byte of a frame is buffered. Shared by the daemon and libkvrope; no libuv.
 *
 *   offset size  field
 *   0      4     magic        "KVRP" (0x4B 0x56 0x52 0x50)
 *   4      2     version      1 (little-endian)
 *   6      2     header_len   24: size of this fixed header
 *   8      4     msg_len      bytes of the protobuf message that follows
 *   12     4     flags        0 (reserved; nonzero is refused)
 *   16     8     payload_len  bytes of raw tensor payload after the message
 *
 * All integers little-endian. A frame is header | message | payload.
 */
#ifndef KVR_FRAME_H
#define KVR_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "base/error.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVR_FRAME_MAGIC        0x5052564Bu   /* "KVRP" read as LE u32 */
#define KVR_FRAME_VERSION      1u
#define KVR_FRAME_HEADER_SIZE  24u
#define KVR_PROTOCOL_VERSION   1u

typedef struct kvr_frame_header {
    uint32_t magic;
    uint16_t version;
    uint16_t header_len;
    uint32_t msg_len;
    uint32_t flags;
    uint64_t payload_len;
} kvr_frame_header;

typedef struct kvr_frame_limits {
    uint32_t max_msg_len;       /* default 1 MiB */
    uint64_t max_payload_len;   /* default: the memory cap */
} kvr_frame_limits;

/* The daemon's and libkvrope's, not part of libkvrope's ABI. */
#pragma GCC visibility push(hidden)

/* Writes the 24-byte header. */
void kvr_frame_header_encode(uint8_t out[KVR_FRAME_HEADER_SIZE],
                             uint32_t msg_len, uint64_t payload_len);

/* Parses and checks a header: magic, version, header_len, flags, then the
 * lengths against lim (NULL = no length limits). Returns 0, KVR_EBADFRAME
 * for a header that is not ours, or KVR_ETOOLARGE for lengths over
 * the limits. Never reads past 24 bytes. */
int kvr_frame_header_decode(const uint8_t in[KVR_FRAME_HEADER_SIZE],
                            kvr_frame_header *h, const kvr_frame_limits *lim);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif /* KVR_FRAME_H */
