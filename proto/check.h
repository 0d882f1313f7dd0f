/*
 * check.h — checks on a protobuf message's encoded bytes that protobuf-c's
 * unpacked form cannot express. protobuf-c hands `string` fields to C as
 * NUL-terminated char *, so a string with an embedded NUL ("alice\0x")
 * would silently become its prefix ("alice"): a context id would alias
 * another. The daemon refuses such a message instead, by walking the bytes
 * with the message's descriptor. Shared by the daemon and the fuzz targets;
 * no libuv.
 */
#ifndef KVR_PROTO_CHECK_H
#define KVR_PROTO_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Internal to the daemon (and tests): not part of libkvrope's ABI. */
#pragma GCC visibility push(hidden)

/* Returns the name of the first `string` field (at any depth of nested
 * messages) of the encoded message `buf[0..len)` of type `desc` that holds a
 * NUL byte, or NULL when there is none. The name is borrowed from the
 * descriptor (static). Bytes that do not parse as protobuf stop the walk
 * (NULL): decoding them is protobuf-c's job, which refuses them. */
const char *kvr_proto_find_nul_string(const ProtobufCMessageDescriptor *desc,
                                      const uint8_t *buf, size_t len);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* KVR_PROTO_CHECK_H */
