/*
 * cache_stream.h — helpers the store-level tests share (test_cache_tier,
 * test_cache_tier_async, test_cache_partial, test_int_disk): a
 * deterministic K/V stream (token t of stream `seed` always has the same
 * values, whatever the split into puts), a put of a range of it as f32,
 * a get of a whole context (payload, tokens, positions, flags) to compare
 * byte for byte (removing a test's directory: kvt.h's kvt_rmrf).
 * Compiled once into libtestcommon.a (tests/common/cache_stream.c).
 */
#ifndef KVR_TESTS_CACHE_STREAM_H
#define KVR_TESTS_CACHE_STREAM_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"

/* Value j of K (kv 0) or V of layer l, token t of stream `seed`. */
float kvt_val(uint32_t seed, int l, int kv, size_t t, size_t j);

/* A put of tokens [first, first + n) of stream `seed` (token ids
 * seed * 1000 + index) into context id of model "m" of that shape. */
typedef struct kvt_range {
    const char  *id, *codec, *prefix;
    uint32_t     seed, n_layers, n_heads, head_dim;
    size_t       first, n;
    kvr_put_mode mode;
    bool         persist;
} kvt_range;

/* 0 or the store's error (in *e; the put aborted). */
int kvt_stream_put(kvr_store *s, const kvt_range *a, kvr_error *e);


/* The whole context as f32, then its tokens, positions and flags (*len
 * bytes, the caller frees); NULL (the reason in *e) if the get failed. */
uint8_t *kvt_get_all(kvr_store *s, const char *id, size_t *len, kvr_error *e);
/* The K/V payload alone, in dtype dt ([layer][K|V][token][row]). */
uint8_t *kvt_get_kv(kvr_store *s, const char *id, kvr_dtype dt, size_t *len, kvr_error *e);

#endif /* KVR_TESTS_CACHE_STREAM_H */
