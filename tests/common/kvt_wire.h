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

#endif
