/*
 * check.c — walks an encoded protobuf message with its descriptor and
 * reports a `string` field that holds a NUL byte (see check.h).
 *
 * Invariants: reads only within [buf, buf + len); recursion is bounded
 * (MAX_DEPTH nested messages), so a hostile nesting cannot exhaust the
 * stack; it allocates nothing.
 */
#include "proto/check.h"

#include <string.h>

#define MAX_DEPTH 32

/* Reads a varint at *p (< end); 0 on success. */
static int varint(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    for (unsigned shift = 0; shift < 64; shift += 7) {
        if (*p >= end)
            return -1;
        uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

static const char *walk(const ProtobufCMessageDescriptor *desc, const uint8_t *p,
                        const uint8_t *end, int depth)
{
    if (depth > MAX_DEPTH)
        return NULL;
    while (p < end) {
        uint64_t key, v;
        if (varint(&p, end, &key) != 0)
            return NULL;
        unsigned wt = (unsigned)(key & 7);
        uint64_t num = key >> 3;
        switch (wt) {
        case 0:
            if (varint(&p, end, &v) != 0)
                return NULL;
            break;
        case 1:
            if ((size_t)(end - p) < 8)
                return NULL;
            p += 8;
            break;
        case 5:
            if ((size_t)(end - p) < 4)
                return NULL;
            p += 4;
            break;
        case 2: {
            if (varint(&p, end, &v) != 0 || v > (uint64_t)(end - p))
                return NULL;
            const ProtobufCFieldDescriptor *f =
                num <= UINT32_MAX && desc
                    ? protobuf_c_message_descriptor_get_field(desc, (unsigned)num)
                    : NULL;
            if (f && f->type == PROTOBUF_C_TYPE_STRING && memchr(p, 0, (size_t)v))
                return f->name;
            if (f && f->type == PROTOBUF_C_TYPE_MESSAGE) {
                const char *r = walk(f->descriptor, p, p + v, depth + 1);
                if (r)
                    return r;
            }
            p += v;
            break;
        }
        default:        /* groups (3, 4) and invalid wire types */
            return NULL;
        }
    }
    return NULL;
}

const char *kvr_proto_find_nul_string(const ProtobufCMessageDescriptor *desc,
                                      const uint8_t *buf, size_t len)
{
    if (!buf || !len)
        return NULL;
    return walk(desc, buf, buf + len, 0);
}
