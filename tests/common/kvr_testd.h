/*
 * kvr_testd.h — helpers for the integration tests (compiled once
 * into libtestcommon.a, tests/common/kvr_testd.c): start a real
 * kvroped on a socket in a fresh temporary directory, wait until it answers,
 * run the kvrope CLI against it, and stop it at teardown. Binaries come from
 * $KVR_BUILD (an absolute build directory; ./build when unset).
 *
 * Safety nets: the daemon gets PR_SET_PDEATHSIG so a crashed test never
 * leaves it running, its log goes to DIR/kvroped.log (printed on a failed
 * start), and every wait is bounded.
 *
 * Also here: the small test model, deterministic K/V data that can be
 * regenerated for any token range, and payload comparison helpers.
 */
#ifndef KVR_TESTD_H
#define KVR_TESTD_H

#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/kvrope.h"
#include "tests/common/kvt_io.h"

typedef struct kvr_testd {
    pid_t pid;
    char  dir[256];
    char  sock[320];
    char  log[320];
    char  addr[340];
} kvr_testd;

const char *testd_build_dir(void);

void testd_print_log(const kvr_testd *d);

/* argv[0..3): bin --socket sock; returns 3, the next index. */
int testd_argv_begin(const char **argv, const char *bin, const char *sock);

/* Appends more (NULL-ended, may be NULL) to argv from index n while fewer
 * than cap - 1 are taken, then the NULL that ends argv (cap entries). */
void testd_argv_end(const char **argv, int n, int cap, const char *const *more);

/* Starts kvroped with --socket DIR/kvroped.sock plus `extra` (NULL-ended,
 * may be NULL). Returns 0 once a ping succeeds, -1 after printing why. */
int testd_start(kvr_testd *d, const char *const *extra);

/* True while the daemon process is alive. */
int testd_alive(kvr_testd *d);

/* SIGTERM, then SIGKILL after 10 s; removes the directory. Returns the
 * daemon's exit status (or -1 if it had to be killed). */
int testd_stop(kvr_testd *d);

kvr_client *testd_connect(const kvr_testd *d);

/* Starts argv[0] with argv (NULL-ended), its stdout on the returned pipe
 * end (-1 if it could not start); *pid the child, killed with the test and
 * after limit_s seconds. */
int testd_spawn_stdout(const char *const *argv, unsigned limit_s, pid_t *pid);

/* Reads fd to its end into out (NUL-terminated, cut at cap; out may be
 * NULL: discarded) and closes it. */
void testd_drain(int fd, char *out, size_t cap);

/* The exit status of child pid, once it ends (-1 if a signal ended it). */
int testd_wait_exit(pid_t pid);

/* Runs build/kvrope --socket SOCK args... with a 60 s limit, stdout into out
 * (NUL-terminated, truncated to cap-1), stderr into the test's stderr.
 * Returns the exit status, or -1. */
int testd_cli(const kvr_testd *d, char *out, size_t cap, const char *const *args);

/* ---- the test model and data ------------------------------------------- */
#define T_LAYERS 3
#define T_HEADS  2
#define T_DIM    16

/* Registers `name`: T_LAYERS x T_HEADS x T_DIM, NeoX, theta 10000, dtype. */
int testd_register(kvr_client *c, const char *name, kvr_dtype dtype, kvr_model *out);

/* A deterministic value in [-1, 1) for (seed, layer, k|v, token, head, dim):
 * any token range of a context can be regenerated for verification. */
float testd_val(uint32_t seed, uint32_t l, uint32_t kv, uint64_t t, uint32_t h,
                uint32_t d);

/* Fills a layer-major payload for tokens [t0, t0+n) of `layers` (NULL =
 * 0..nl-1) in dtype. buf must hold kvr_payload_size(nl, n, ...). */
void testd_fill(void *buf, uint32_t seed, const uint32_t *layers, uint32_t nl,
                uint64_t t0, size_t n, uint32_t heads, uint32_t dim, kvr_dtype dt);

void *testd_payload(uint32_t seed, uint32_t nl, uint64_t t0, size_t n,
                    kvr_dtype dt, size_t *len);

uint32_t *testd_tokens(uint32_t base, size_t n);

/* Puts n tokens (ids base.., payload of stream seed at positions from t0,
 * a->dtype) with the rest of *a as the caller set it (tokens and payload
 * filled in here). */
int testd_put_with(kvr_client *c, kvr_put_args *a, uint32_t seed, uint32_t base, uint64_t t0,
                   size_t n);

/* Puts n tokens (ids base.., data seed, positions from t0) into ctx. */
int testd_put(kvr_client *c, const char *ctx, const char *model, kvr_dtype dt,
              uint32_t seed, uint32_t base, uint64_t t0, size_t n);

double testd_metric(kvr_client *c, const char *name);

/* ---- KV that follows its tokens (keys rotated at their positions) ------- */
/* A payload (all T_LAYERS layers) whose keys are rope(E_K[token], pos) and
 * values E_V[token], E from testd_val seeded by the token id: the KV of any
 * token at any position can be made again, so a read that moved keys can be
 * checked (R: the model's rope). NULL on failure; free it. */
void *testd_rope_kv(const kvr_rope *R, kvr_dtype dt, const uint32_t *tok,
                    const int64_t *pos, size_t n, size_t *len);

/* kv's payload against testd_rope_kv of its own tokens and positions: keys
 * within one rounding of the dtype (1/1024 for f16, relative to 1), values
 * bit for bit. 0, or -1 with what differs in msg. */
int testd_rope_kv_check(const kvr_rope *R, const kvr_kv *kv, const void *payload,
                        char *msg, size_t cap);

#endif /* KVR_TESTD_H */
