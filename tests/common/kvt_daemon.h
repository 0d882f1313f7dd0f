/*
 * kvt_daemon.h — the integration tests' fixture around kvr_testd.h: a
 * kvroped started and a client connected in one call, a model registered
 * with a RoPE engine of its config, the teardown in reverse, and the tiny
 * test model's reference K/V (keys rotated to given positions). Compiled
 * into libtestcommon.a (tests/common/kvt_daemon.c); failures are Criterion
 * assertions in the calling test.
 */
#ifndef KVR_TESTS_KVT_DAEMON_H
#define KVR_TESTS_KVT_DAEMON_H

#include "tests/common/kvr_testd.h"

/* Starts kvroped (testd_start with extra, NULL-ended, may be NULL) and
 * returns a client connected to it. */
kvr_client *kvt_daemon_up(kvr_testd *d, const char *const *extra);

/* kvt_daemon_up, then the test model registered on the client as name in
 * dtype (testd_register, asserted). */
kvr_client *kvt_daemon_up_model(kvr_testd *d, const char *const *extra, const char *name,
                                kvr_dtype dtype);

/* Destroys *r and closes *c (each if set; both left NULL; either pointer may
 * be NULL), then stops the daemon: testd_stop's result. */
int kvt_daemon_down(kvr_testd *d, kvr_client **c, kvr_rope **r);

/* A Criterion suite's fixture: a daemon, a client, and tiny-model "tiny"
 * in f16 with its RoPE engine, set up and torn down around each test by
 *   TestSuite(name, .init = kvt_tiny_suite_init, .fini = kvt_tiny_suite_fini)
 * (a test file names them as it likes: #define D kvt_suite_d ...). */
extern kvr_testd   kvt_suite_d;
extern kvr_client *kvt_suite_c;
extern kvr_rope   *kvt_suite_r;
void kvt_tiny_suite_init(void);
void kvt_tiny_suite_fini(void);

/* A RoPE engine for m's config (the caller destroys it). */
kvr_rope *kvt_model_rope(const kvr_model *m);

/* Registers tiny-model `name` in dt (testd_register) and returns a RoPE
 * engine for it; its description in *out if not NULL. */
kvr_rope *kvt_register_tiny(kvr_client *c, const char *name, kvr_dtype dt, kvr_model *out);

/* Registers model `name` of that shape and dtype with NeoX RoPE, theta
 * 10000, over the whole head, and returns a RoPE engine for it; its
 * description in *out if not NULL. */
kvr_rope *kvt_register_model(kvr_client *c, const char *name, uint32_t n_layers,
                             uint32_t n_kv_heads, uint32_t head_dim, kvr_dtype dt,
                             kvr_model *out);

/* The tiny model's K (or V, kv 1) row of token id at layer: testd_val of
 * (id, layer, kv, 0, head, dim), T_HEADS x T_DIM floats into out. */
void kvt_tiny_embed(uint32_t id, uint32_t layer, uint32_t kv, float *out);

/* Layer-major K|V of tokens tok in dt for the tiny model, keys rotated by r
 * to positions pos (malloc'd, *len bytes). */
void *kvt_tiny_kv(const kvr_rope *r, const uint32_t *tok, const int64_t *pos, size_t n,
                  kvr_dtype dt, size_t *len);

/* out (a command's --json output) parsed, asserted to be JSON; the caller
 * deletes it. */
struct cJSON *kvt_json_out(const char *out);

/* testd_cli of the arguments given inline (NULL added), stdout into out (an
 * array): #define CLI(...) KVT_CLI(&D, OUT, __VA_ARGS__). */
#define KVT_CLI(d, out, ...) testd_cli(d, out, sizeof out, (const char *const[]){ __VA_ARGS__, NULL })

#endif
