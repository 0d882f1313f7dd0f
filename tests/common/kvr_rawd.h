/*
 * kvr_rawd.h — a real kvroped ($KVR_BUILD/kvroped, else ./build/kvroped) on a
 * temporary socket, spoken to in raw frames built with the generated
 * protobuf-c code (no client library): start / wait / stop, exact reads and
 * writes, one request and its reply, the tiny model, its payloads and puts. Shared by
 * the raw-wire tests (test_daemon_wire.c, test_daemon_readahead.c); each
 * includes it once and uses setup / teardown as its suite's init / fini.
 * Every socket has a receive timeout and every daemon is killed at
 * teardown, so a hang fails a test instead of stalling the run. Compiled
 * once into libtestcommon.a (kvr_rawd.c; D, the one daemon, lives there).
 */
#ifndef KVR_RAWD_H
#define KVR_RAWD_H

#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvrope.pb-c.h"
#include "proto/frame.h"
#include "tests/common/kvt_io.h"

typedef struct daemon_proc {
    pid_t pid;
    char dir[64];
    char sock[100];
    char log[128];
} daemon_proc;

extern daemon_proc D;

const char *kvroped_path(void);

/* Starts kvroped with --socket D.sock plus extra args (NULL-terminated). */
pid_t start_daemon_args(const char *sock, const char *const *extra);

int connect_unix(const char *path);

/* Waits (bounded) until the daemon accepts connections. */
void wait_ready(const char *sock, pid_t pid);

void start_daemon(const char *const *extra);

void setup(void);

void dump_log(void);

/* SIGTERM, then a bounded wait: kvroped must exit 0 (under sanitizers a
 * leak or an error report makes the exit status nonzero). */
void stop_daemon_clean(void);

void teardown(void);

/* ---- raw frames ------------------------------------------------------------- */

/* 1 = all read, 0 = EOF at once, -1 = error / short. */
int read_all(int fd, void *p, size_t n);

void send_req(int fd, Kvrope__Request *r, const void *payload, uint64_t plen);

/* Reads one response; *payload (malloc) gets its payload if any. */
Kvrope__Response *recv_resp(int fd, uint8_t **payload, uint64_t *plen);

void expect_eof(int fd);

Kvrope__Status ping(int fd, uint64_t id);

/* A small model: 2 layers, 2 KV heads, head_dim 8, f16. */
enum { NL = 2, NH = 2, HD = 8 };

void register_model(int fd);

size_t payload_bytes(size_t ntok);

void fill_payload(uint16_t *p, size_t ntok, unsigned seed);

void make_put(Kvrope__Request *q, Kvrope__Put *p, const char *ctx, uint32_t *tokens,
              size_t ntok, Kvrope__PutMode mode);

/* A malloc'd f16 payload of ntok tokens (fill_payload with seed), its size
 * in *pb; the caller frees it. */
uint16_t *new_payload(size_t ntok, unsigned seed, size_t *pb);

/* Puts n tokens (payload pay, pb bytes) into ctx with mode: asserted OK. */
void put_ok(int fd, const char *ctx, uint32_t *toks, size_t n,
            Kvrope__PutMode mode, const void *pay, size_t pb);

#endif /* KVR_RAWD_H */
