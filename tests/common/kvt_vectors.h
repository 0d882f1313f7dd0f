/*
 * kvt_vectors.h — reading the ggml RoPE vectors' manifest
 * ($KVR_VECTORS/rope/manifest.json) and turning one of its cases into the
 * kvr_rope_config a model with those parameters would ship; a rope made
 * from a config, asserted. Compiled into
 * libtestcommon.a (tests/common/kvt_vectors.c; needs rope/ and cJSON).
 */
#ifndef KVR_TESTS_KVT_VECTORS_H
#define KVR_TESTS_KVT_VECTORS_H

#include <cjson/cJSON.h>

#include "rope/rope.h"

/* The parsed manifest (asserted readable; the caller cJSON_Deletes it). Its
 * cases: cJSON_GetObjectItem(m, "cases"). */
cJSON *kvt_rope_manifest(void);

/* Case c's config.json (head_dim, rotary_dim, rope_theta, rope_scaling;
 * num_attention_heads = n_heads) through kvr_rope_config_from_json with the
 * case's style, asserted to be accepted. */
void kvt_rope_case_config(const cJSON *c, double n_heads, kvr_rope_config *out);

/* kvr_rope_create of c, asserted to succeed (the rope; kvr_rope_destroy). */
kvr_rope *kvt_rope_new(const kvr_rope_config *c);

#endif
