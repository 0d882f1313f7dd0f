/*
 * frame.c — the 24-byte frame header (layout in frame.h). Encoding and
 * decoding go byte by byte in little-endian order, so the codec is
 * independent of host endianness and alignment, and decode never touches a
 * byte past offset 23. Lengths are checked against the limits here, before
 * the caller allocates anything for them.
 */
#include "proto/frame.h"

#include <string.h>

#include "kvrope.pb-c.h"
#include "base/error.h"
#include "base/types.h"

/* The error space (base/error.h) and the wire's Status enum are one list:
 * every wire code's number is its Status value, so the daemon sends
 * kvr_error_status(code) and a client maps Status s back with
 * KVR_E_FROM_STATUS(s). A renumbered or renamed Status fails to build here. */
#define STATUS_MATCHES(name, n, wire, text)                                      \
    _Static_assert((n) == KVROPE__STATUS__##wire &&                              \
                   KVR_E##name == KVR_E_FROM_STATUS(KVROPE__STATUS__##wire),     \
                   "KVR_E" #name " is not Status " #wire);
KVR_ERRORS_WIRE(STATUS_MATCHES)
#undef STATUS_MATCHES
_Static_assert(KVROPE__STATUS__OK == 0 && KVR_E_FROM_STATUS(KVROPE__STATUS__OK) == KVR_OK,
               "OK is 0 on both sides");

/* The shared vocabulary (base/types.h) has the wire's values, so the client
 * and the daemon copy modes, layouts and segment kinds without a table. */
_Static_assert((int)KVR_PUT_CREATE == KVROPE__PUT_MODE__CREATE &&
               (int)KVR_PUT_APPEND == KVROPE__PUT_MODE__APPEND &&
               (int)KVR_PUT_UPSERT == KVROPE__PUT_MODE__UPSERT &&
               (int)KVR_PUT_REPLACE == KVROPE__PUT_MODE__REPLACE, "put modes");
_Static_assert((int)KVR_LAYOUT_PARALLEL == KVROPE__LAYOUT__PARALLEL &&
               (int)KVR_LAYOUT_SEQUENTIAL == KVROPE__LAYOUT__SEQUENTIAL &&
               (int)KVR_LAYOUT_EXPLICIT == KVROPE__LAYOUT__EXPLICIT, "assemble layouts");
_Static_assert((int)KVR_SEGMENT_PREFIX == KVROPE__SEGMENT_KIND__SEGMENT_PREFIX &&
               (int)KVR_SEGMENT_DOCUMENT == KVROPE__SEGMENT_KIND__SEGMENT_DOCUMENT &&
               (int)KVR_SEGMENT_QUERY == KVROPE__SEGMENT_KIND__SEGMENT_QUERY, "segment kinds");

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

void kvr_frame_header_encode(uint8_t out[KVR_FRAME_HEADER_SIZE],
                             uint32_t msg_len, uint64_t payload_len)
{
    put_u32(out + 0, KVR_FRAME_MAGIC);
    put_u16(out + 4, (uint16_t)KVR_FRAME_VERSION);
    put_u16(out + 6, (uint16_t)KVR_FRAME_HEADER_SIZE);
    put_u32(out + 8, msg_len);
    put_u32(out + 12, 0);
    put_u64(out + 16, payload_len);
}

int kvr_frame_header_decode(const uint8_t in[KVR_FRAME_HEADER_SIZE],
                            kvr_frame_header *h, const kvr_frame_limits *lim)
{
    kvr_frame_header t;
    t.magic = get_u32(in + 0);
    t.version = get_u16(in + 4);
    t.header_len = get_u16(in + 6);
    t.msg_len = get_u32(in + 8);
    t.flags = get_u32(in + 12);
    t.payload_len = get_u64(in + 16);
    if (h)
        *h = t;
    if (t.magic != KVR_FRAME_MAGIC || t.version != KVR_FRAME_VERSION ||
        t.header_len != KVR_FRAME_HEADER_SIZE || t.flags != 0)
        return KVR_EBADFRAME;
    if (lim) {
        if (t.msg_len > lim->max_msg_len || t.payload_len > lim->max_payload_len)
            return KVR_ETOOLARGE;
    }
    return 0;
}
