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
#include <stdint.h>
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

/* Connects r to the Redis socket and, when set, stores key = val (len
 * bytes) for the gets to come. 0, or -1 if either failed. */
int resp_prepare(resp *r, const char *sock, int set, const char *key, const void *val,
                 size_t len);

struct kvr_client;

/* ---- kvroped's side ------------------------------------------------------ */

/* After the put of "p<job>-<slice>-<ops>", the deferred delete of the one
 * keep puts back, so that a timed put loop holds keep contexts at most.
 * 0, or what the delete returned. */
int bench_drop_old(struct kvr_client *c, int job, int slice, long ops, long keep);

/* ---- the two peers: kvroped and redis-server ---------------------------- */

/* Both servers of a socket benchmark in one temporary directory. */
typedef struct bench_peers {
    char  dir[64], kvsock[128], rsock[128], kvlog[128], rlog[128], bin[512], addr[160];
    pid_t kvpid, rpid;
    int   have_redis;   /* 0: redis-server did not start (its columns absent) */
} bench_peers;

/* Makes dir (tmpl, e.g. "/tmp/kvr-bench-XXXXXX"), starts $KVR_BUILD/kvroped
 * (--max-memory 4G) and redis-server (no persistence) there, waits for both
 * (5 s each) and registers model "bench" (f16, the given shape, default
 * rope) on kvroped. 0; -1 after printing why (messages start with name) and
 * stopping both if kvroped did not come up. */
int bench_peers_start(bench_peers *b, const char *name, const char *tmpl, uint32_t layers,
                      uint32_t heads, uint32_t dim);

/* Stops both and removes the directory and what the servers left in it. */
void bench_peers_stop(bench_peers *b);

#endif /* KVR_BENCH_REDIS_H */
