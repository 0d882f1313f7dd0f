/*
 * kvt_bench.h — what the benchmarks share: the goal line every bench prints
 * (scripts/run-bench.sh annotates it by its ending, "(met)" or "(not met)";
 * the Python benches print the same line, tests/bench/bench_serve.py's
 * goal()), a monotonic clock in seconds, sizes read from the environment
 * and a cheap random stream. Compiled into libtestcommon.a
 * (tests/common/kvt_bench.c), which needs no Criterion: benches link it too.
 */
#ifndef KVR_TESTS_KVT_BENCH_H
#define KVR_TESTS_KVT_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/config.h"

/* One line on stdout: "goal: ", fmt formatted, then " (met)" or
 * " (not met)" and a newline. */
void kvt_goal(bool met, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

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

/* The disk benches' baseline: a plain file written and read in 4 MiB
 * requests, as dd would. */
typedef struct kvt_plain {
    char     path[600];
    int      fd;
    uint8_t *buf;      /* chunk bytes, 4 KiB aligned, 0x5A */
    size_t   chunk;
} kvt_plain;

/* dir/plain.dat created with O_DIRECT (without if the filesystem refuses
 * it) and the buffer. 0, or -1 if either failed. */
int kvt_plain_open(kvt_plain *p, const char *dir);

/* GB/s of one sequential pass over [0, total) of the file: pwrite and then
 * fdatasync (write), or pread. */
double kvt_plain_pass(kvt_plain *p, size_t total, int write);

/* Closes the file (it stays) and frees the buffer. */
void kvt_plain_close(kvt_plain *p);

/* The disk tier's two goals against the plain passes of the same bytes:
 * spill (ratio spill) >= 0.8x the plain write + fdatasync, reload >= 0.8x
 * the plain read. spill_what and reload_what say what was measured (e.g.
 * "layer, io_uring"), how how the plain passes were timed ("" or e.g.
 * " (side by side)"). */
void kvt_plain_goals(const char *spill_what, const char *reload_what, const char *how,
                     double spill, double reload);

#endif
