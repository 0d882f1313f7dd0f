/*
 * test_proto_frame.c — the frame header codec: round trip, every refusal
 * (magic, version, header_len, flags, lengths), truncation as the caller sees
 * it, and a guard-page test: the header is mapped so that its last byte is
 * the last byte of a readable page, with PROT_NONE after it, so any read
 * past 24 bytes faults at once.
 */
#include <criterion/criterion.h>

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "proto/frame.h"
#include "base/error.h"

static const kvr_frame_limits LIM = { .max_msg_len = 1u << 20,
                                      .max_payload_len = 1ull << 32 };

Test(proto_frame, round_trip)
{
    uint8_t b[KVR_FRAME_HEADER_SIZE];
    const uint32_t msgs[] = { 0, 1, 4, 1000, 1u << 20 };
    const uint64_t pays[] = { 0, 1, 65536, 1ull << 32 };
    for (size_t i = 0; i < sizeof msgs / sizeof msgs[0]; i++) {
        for (size_t j = 0; j < sizeof pays / sizeof pays[0]; j++) {
            kvr_frame_header_encode(b, msgs[i], pays[j]);
            kvr_frame_header h;
            cr_assert_eq(kvr_frame_header_decode(b, &h, &LIM), 0);
            cr_assert_eq(h.magic, KVR_FRAME_MAGIC);
            cr_assert_eq(h.version, KVR_FRAME_VERSION);
            cr_assert_eq(h.header_len, KVR_FRAME_HEADER_SIZE);
            cr_assert_eq(h.msg_len, msgs[i]);
            cr_assert_eq(h.flags, 0);
            cr_assert_eq(h.payload_len, pays[j]);
        }
    }
}

Test(proto_frame, exact_byte_layout)
{
    uint8_t b[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(b, 0x01020304u, 0x1122334455667788ull);
    const uint8_t want[24] = { 'K', 'V', 'R', 'P', 1, 0, 24, 0, 4, 3, 2, 1, 0, 0, 0, 0,
                               0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11 };
    cr_assert_arr_eq(b, want, 24);
}

Test(proto_frame, no_limits_when_null)
{
    uint8_t b[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(b, UINT32_MAX, UINT64_MAX);
    kvr_frame_header h;
    cr_assert_eq(kvr_frame_header_decode(b, &h, NULL), 0);
    cr_assert_eq(h.msg_len, UINT32_MAX);
    cr_assert_eq(h.payload_len, UINT64_MAX);
}

Test(proto_frame, wrong_magic)
{
    uint8_t b[KVR_FRAME_HEADER_SIZE];
    for (int i = 0; i < 4; i++) {
        kvr_frame_header_encode(b, 4, 0);
        b[i] ^= 0x20;
        cr_assert_eq(kvr_frame_header_decode(b, NULL, &LIM), KVR_EBADFRAME);
    }
    memcpy(b, "GET / HTTP/1.1\r\nHost: x\r\n", 24);
    cr_assert_eq(kvr_frame_header_decode(b, NULL, &LIM), KVR_EBADFRAME);
}

/* A valid header (4 bytes of message, no payload) with byte off set to
 * val is refused as a bad frame. */
static void byte_refused(size_t off, uint8_t val)
{
    uint8_t b[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(b, 4, 0);
    b[off] = val;
    cr_assert_eq(kvr_frame_header_decode(b, NULL, &LIM), KVR_EBADFRAME, "byte %zu = %#x", off,
                 (unsigned)val);
}

Test(proto_frame, wrong_version)
{
    byte_refused(4, 2);
    byte_refused(5, 1);   /* version 257 */
    byte_refused(4, 0);
}

Test(proto_frame, wrong_header_len_and_flags)
{
    byte_refused(6, 32);
    byte_refused(15, 0x80);
}

Test(proto_frame, oversize)
{
    uint8_t b[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(b, LIM.max_msg_len, LIM.max_payload_len);
    cr_assert_eq(kvr_frame_header_decode(b, NULL, &LIM), 0);
    kvr_frame_header_encode(b, LIM.max_msg_len + 1, 0);
    cr_assert_eq(kvr_frame_header_decode(b, NULL, &LIM), KVR_ETOOLARGE);
    kvr_frame_header_encode(b, 0, LIM.max_payload_len + 1);
    cr_assert_eq(kvr_frame_header_decode(b, NULL, &LIM), KVR_ETOOLARGE);
    kvr_frame_header_encode(b, UINT32_MAX, UINT64_MAX);
    cr_assert_eq(kvr_frame_header_decode(b, NULL, &LIM), KVR_ETOOLARGE);
    /* The header check comes first: garbage is a bad frame, not too large. */
    b[0] = 'X';
    cr_assert_eq(kvr_frame_header_decode(b, NULL, &LIM), KVR_EBADFRAME);
}

/* A truncated header is the caller's business (it waits for 24 bytes); what
 * the codec guarantees is that a header padded with zeros after a
 * truncation point is refused rather than mis-read. */
Test(proto_frame, truncated)
{
    uint8_t full[KVR_FRAME_HEADER_SIZE];
    kvr_frame_header_encode(full, 4, 8);
    for (size_t cut = 0; cut < 7; cut++) {
        uint8_t b[KVR_FRAME_HEADER_SIZE] = { 0 };
        memcpy(b, full, cut);
        cr_assert_eq(kvr_frame_header_decode(b, NULL, &LIM), KVR_EBADFRAME, "cut at %zu", cut);
    }
}

Test(proto_frame, guard_page)
{
    long ps = sysconf(_SC_PAGESIZE);
    uint8_t *m = mmap(NULL, (size_t)ps * 2, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(m, MAP_FAILED);
    cr_assert_eq(mprotect(m + ps, (size_t)ps, PROT_NONE), 0);
    uint8_t *hdr = m + ps - KVR_FRAME_HEADER_SIZE;
    kvr_frame_header_encode(hdr, 77, 99);
    kvr_frame_header h;
    cr_assert_eq(kvr_frame_header_decode(hdr, &h, &LIM), 0);
    cr_assert_eq(h.msg_len, 77);
    cr_assert_eq(h.payload_len, 99);
    hdr[0] = 0;
    cr_assert_eq(kvr_frame_header_decode(hdr, &h, &LIM), KVR_EBADFRAME);
    kvr_frame_header_encode(hdr, UINT32_MAX, 0);
    cr_assert_eq(kvr_frame_header_decode(hdr, &h, &LIM), KVR_ETOOLARGE);
    /* Encode also stays inside its 24 bytes. */
    kvr_frame_header_encode(hdr, 1, 2);
    munmap(m, (size_t)ps * 2);
}
