/*
 * kvt_bench_put.h — what the benchmarks that put into a store share: the
 * payload of an f16 put. Apart from kvt_bench.h because it needs cache/
 * (a bench or test that only times things need not link it). Compiled into
 * libtestcommon.a (tests/common/kvt_bench_put.c), which needs no Criterion.
 */
#ifndef KVR_TESTS_KVT_BENCH_PUT_H
#define KVR_TESTS_KVT_BENCH_PUT_H

#include "cache/cache.h"

/* Fills the payload of put x (an f16 context) with small normal f16 values
 * (0x3000 + a pattern: no denormal, infinity or NaN to slow a kernel). */
void kvt_put_fill_f16(kvr_put *x);

#endif
