/*
 * kvt_store.h — the store-with-a-model fixture the cache/ tests share: a
 * store made from a config, a model description with the default RoPE
 * (NEOX, theta 10000) over the whole head, its registration, and a put of
 * deterministic f16 values. Compiled into libtestcommon.a
 * (tests/common/kvt_store.c); failures are Criterion assertions in the
 * calling test, so a fixture that cannot be built fails that test.
 */
#ifndef KVR_TESTS_KVT_STORE_H
#define KVR_TESTS_KVT_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cache.h"

/* A store made from *cfg (NULL: every default). */
kvr_store *kvt_store_new(const kvr_store_config *cfg);

/* Model `name` of that shape and native dtype: kvr_rope_config_init's RoPE
 * (NEOX, theta 10000) rotating all head_dim dimensions, no default codec. */
kvr_model_desc kvt_model_desc(const char *name, uint32_t n_layers, uint32_t n_kv_heads,
                              uint32_t head_dim, kvr_dtype dtype);

/* Registers *d in s (its info in *out if not NULL). */
void kvt_model_add(kvr_store *s, const kvr_model_desc *d, kvr_model_info *out);

/* A store made from *cfg (NULL: defaults) with model "m" of that shape and
 * dtype (kvt_model_desc), its info in *out if not NULL. */
kvr_store *kvt_store_with_model(const kvr_store_config *cfg, uint32_t n_layers,
                                uint32_t n_kv_heads, uint32_t head_dim, kvr_dtype dtype,
                                kvr_model_info *out);

/* A kvr_tier_log_fn printing "tier: msg" to stderr. */
void kvt_tier_log(void *arg, int level, const char *msg);

/* A store made from *cfg with, if tc is not NULL, the disk tier *tc opened
 * (logging through kvt_tier_log if log; its recovery in *rec if not NULL),
 * and model "m" of that shape and dtype (kvt_model_desc) registered unless
 * the tier brought it back. */
kvr_store *kvt_store_open(const kvr_store_config *cfg, const kvr_tier_config *tc, bool log,
                          kvr_tier_recovery *rec, uint32_t n_layers, uint32_t n_kv_heads,
                          uint32_t head_dim, kvr_dtype dtype);

/* Sets the shape of put *p: context id of model "m", n_layers x
 * n_kv_heads x head_dim in dtype, the n tokens (borrowed, not copied).
 * The other fields are left as they are. */
void kvt_put_shape(kvr_put_params *p, const char *id, uint32_t n_layers, uint32_t n_kv_heads,
                   uint32_t head_dim, kvr_dtype dtype, const uint32_t *tokens, size_t n);

/* Fills one payload iovec of bytes bytes at p (arg: the caller's state;
 * iovecs come in payload order). */
typedef void (*kvt_fill_fn)(void *arg, void *p, size_t bytes);

/* A put of *p: begin, each payload iovec through fill, the work if it
 * needs any, commit (its result in *res if not NULL). 0, or the first
 * step's error (in *e if not NULL; a begun put is aborted). */
int kvt_put_try(kvr_store *s, const kvr_put_params *p, kvt_fill_fn fill, void *arg,
                kvr_put_result *res, kvr_error *e);

/* kvt_put_try, asserted to succeed. */
void kvt_put(kvr_store *s, const kvr_put_params *p, kvt_fill_fn fill, void *arg);

/* Likewise an edit (no spans or result asked for). */
void kvt_edit(kvr_store *s, const kvr_edit_params *p, kvt_fill_fn fill, void *arg);

/* A source the payload is copied from, in order (kvt_fill_src): off is how
 * much has been copied, so a test can check the put took all len bytes. */
typedef struct kvt_src {
    const void *p;
    size_t      len, off;
} kvt_src;

/* A kvt_fill_fn copying the next bytes of the kvt_src at arg (asserting
 * it has them). */
void kvt_fill_src(void *arg, void *p, size_t bytes);

/* A value exactly representable in f32, f16 and bf16 (so every dtype holds
 * the same one): element d of head h, token t, K (kv 0) or V of layer l of
 * the context seeded `seed`. */
float kvt_kv_value(uint32_t seed, uint32_t l, int kv, uint64_t t, uint32_t h, uint32_t d);

/* Payload in wire order (layer, K then V, token, head, element) of tokens
 * [t0, t0 + n) of the context seeded `seed` (kvt_kv_value), in dtype dt
 * (malloc'd, *bytes long; the caller frees it). */
void *kvt_kv_payload(uint32_t seed, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim,
                     uint64_t t0, size_t n, kvr_dtype dt, size_t *bytes);

/* A get of *p, worked if it needs it (asserted), its payload gathered into
 * one malloc'd buffer (*n bytes); the get is ended, or handed to
 * *keep_open if that is not NULL. NULL if the get could not begin: its
 * error in *rc and *e (each if not NULL). */
uint8_t *kvt_get_payload_try(kvr_store *s, const kvr_get_params *p, size_t *n,
                             kvr_get **keep_open, int *rc, kvr_error *e);

/* kvt_get_payload_try, asserted to begin. */
uint8_t *kvt_get_payload(kvr_store *s, const kvr_get_params *p, size_t *n, kvr_get **keep_open);

/* A kvt_fill_fn writing the byte *(const uint8_t *)arg everywhere. */
void kvt_fill_memset(void *arg, void *p, size_t bytes);

/* An edit of context id (that shape, f16) replacing tokens [start, end)
 * by the n new tokens, whose K/V bytes are all `byte`. */
void kvt_edit_replace(kvr_store *s, const char *id, uint32_t n_layers, uint32_t n_kv_heads,
                      uint32_t head_dim, size_t start, size_t end, const uint32_t *tokens,
                      size_t n, uint8_t byte);

/* A put into context id of model "m" (that shape, f16) of n tokens (ids
 * i * 7 + 1 + seed) with f16 values of an LCG stream from 99 + seed in
 * [-1.5, 1.5), with codec (NULL: the model's or the context's). */
void kvt_put_f16(kvr_store *s, const char *id, const char *codec, kvr_put_mode mode,
                 uint32_t seed, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim,
                 size_t n);

/* For tests of the prefix index, where only tokens matter: a store of
 * 4-token blocks with model "m" of one layer and one head of 2 dims (f16),
 * and a put of n tokens into it whose K/V are all zero (0 or the error). */
kvr_store *kvt_index_store(void);
int kvt_index_put(kvr_store *s, const char *id, kvr_put_mode mode, const uint32_t *tok,
                  size_t n);

#endif
