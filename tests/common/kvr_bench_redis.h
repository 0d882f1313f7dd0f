/*
 * kvr_bench_redis.h — what the socket benchmarks share (kvr_bench_redis.c, in
 * libtestcommon.a, which benches link without Criterion): a clock, spawning and stopping the peer
 * processes (kvroped, redis-server), and a minimal blocking RESP client for
 * the Redis baseline (SET / GET of binary values over a Unix socket).
 */
#ifndef KVR_BENCH_REDIS_H
#define KVR_BENCH_REDIS_H

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/common/kvt_bench.h"
#include "tests/common/kvt_io.h"

pid_t bench_spawn(const char *const *argv, const char *log);

void bench_stop(pid_t pid);

/* ---- minimal RESP client ------------------------------------------------ */

typedef struct resp {
    int     fd;
    char    buf[65536];
    size_t  pos, len;
} resp;

int resp_connect(resp *r, const char *path);

int resp_fill(resp *r);

/* Reads one line (without CRLF) into line. */
int resp_line(resp *r, char *line, size_t cap);

int resp_read(resp *r, void *dst, size_t n);

int resp_writev(int fd, struct iovec *iov, int n);

int resp_set(resp *r, const char *key, const void *val, size_t len);

int resp_get(resp *r, const char *key, void *dst, size_t cap);

#endif /* KVR_BENCH_REDIS_H */
