/*
 * kvt_bench.h — what the benchmarks share: a monotonic clock in seconds and
 * sizes read from the environment. Compiled into libtestcommon.a
 * (tests/common/kvt_bench.c), which needs no Criterion: benches link it too.
 */
#ifndef KVR_TESTS_KVT_BENCH_H
#define KVR_TESTS_KVT_BENCH_H

#include <stddef.h>

/* CLOCK_MONOTONIC in seconds. */
double kvt_now_s(void);

/* $name as a whole number, or dflt when unset or empty. */
size_t kvt_env_size(const char *name, size_t dflt);

#endif
