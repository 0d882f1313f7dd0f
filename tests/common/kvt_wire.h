/*
 * kvt_wire.h — building requests of the wire protocol (proto/kvrope.proto,
 * generated protobuf-c) for the tests that speak it without the client
 * library. Compiled once into libtestcommon.a (tests/common/kvt_wire.c).
 */
#ifndef KVR_TESTS_KVT_WIRE_H
#define KVR_TESTS_KVT_WIRE_H

#include <stdint.h>

#include "kvrope.pb-c.h"

/* A request of id whose body is put p (p stays the caller's). */
Kvrope__Request kvt_put_request(uint64_t id, Kvrope__Put *p);

/* Connects to the Unix socket at sock and writes request q's frame, its
 * header announcing `payload` bytes to follow, none of which are sent: the
 * connected socket (the caller reads and closes it), or -1. */
int kvt_wire_send_raw(const char *sock, const Kvrope__Request *q, uint64_t payload);

/* A put (mode) of one token of ctx under model on a raw connection, its
 * `payload` bytes announced and never sent: the put stays open until the
 * socket closes. The socket, or -1. */
int kvt_wire_open_put(const char *sock, const char *ctx, const char *model,
                      Kvrope__PutMode mode, uint64_t payload);

#endif
