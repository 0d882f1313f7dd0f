/*
 * kvt_bench.h — what the benchmarks share: a monotonic clock in seconds,
 * sizes read from the environment and a cheap random stream. Compiled into libtestcommon.a
 * (tests/common/kvt_bench.c), which needs no Criterion: benches link it too.
 */
#ifndef KVR_TESTS_KVT_BENCH_H
#define KVR_TESTS_KVT_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "base/config.h"

/* CLOCK_MONOTONIC in seconds. */
double kvt_now_s(void);

/* One xorshift64 step of *state (13, 7, 17; never 0 from a state that is
 * not): the new state. */
uint64_t kvt_xorshift(uint64_t *state);

/* $name as a whole number, or dflt when unset or empty. */
size_t kvt_env_size(const char *name, size_t dflt);

/* $name as a whole number (dflt when unset or empty) brought into [lo, hi]:
 * a round count, a size in MiB. */
int kvt_env_int(const char *name, int dflt, int lo, int hi);

/* kvr_rope_config_init's defaults with head_dim = rotary_dim = dim (full
 * rotation) and, if heads > 0, num_kv_heads = heads. */
kvr_rope_config kvt_rope_config(uint32_t dim, uint32_t heads);

/* KL(softmax(a) || softmax(b)) in nats over n logits (one next-token
 * distribution against another; 0 when they are the same). */
double kvt_kl_logits(const float *a, const float *b, size_t n);

/* The disk benches' baseline file: dir/plain.dat (its path into path, cap
 * bytes) created with O_DIRECT, or without if the filesystem refuses it.
 * The descriptor, or -1. */
int kvt_plain_open(const char *dir, char *path, size_t cap);

/* GB/s of one sequential pass over [0, total) of fd in chunk-byte requests
 * from / into buf: pwrite and then fdatasync (write), or pread. */
double kvt_plain_pass(int fd, uint8_t *buf, size_t chunk, size_t total, int write);

#endif
