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
#include "base/le.h"
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

void kvr_frame_header_encode(uint8_t out[KVR_FRAME_HEADER_SIZE],
                             uint32_t msg_len, uint64_t payload_len)
{
    kvr_le32_put(out + 0, KVR_FRAME_MAGIC);
    kvr_le16_put(out + 4, (uint16_t)KVR_FRAME_VERSION);
    kvr_le16_put(out + 6, (uint16_t)KVR_FRAME_HEADER_SIZE);
    kvr_le32_put(out + 8, msg_len);
    kvr_le32_put(out + 12, 0);
    kvr_le64_put(out + 16, payload_len);
}

int kvr_frame_header_decode(const uint8_t in[KVR_FRAME_HEADER_SIZE],
                            kvr_frame_header *h, const kvr_frame_limits *lim)
{
    kvr_frame_header t;
    t.magic = kvr_le32_get(in + 0);
    t.version = kvr_le16_get(in + 4);
    t.header_len = kvr_le16_get(in + 6);
    t.msg_len = kvr_le32_get(in + 8);
    t.flags = kvr_le32_get(in + 12);
    t.payload_len = kvr_le64_get(in + 16);
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
