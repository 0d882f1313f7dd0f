/*
 * kvt_llama.h — what the tests of the llama.cpp bridge (client/llama/
 * kvrope_llama.h) share, with or without libllama: a context's state
 * exported through the bridge, asserted to succeed. Compiled once into
 * libtestcommon.a (tests/common/kvt_llama.c); failures are Criterion
 * assertions in the calling test.
 */
#ifndef KVR_TESTS_KVT_LLAMA_H
#define KVR_TESTS_KVT_LLAMA_H

#include <stddef.h>

#include "client/llama/kvrope_llama.h"

/* kvr_llama_state_export of ctx for model m with o (asserted to succeed):
 * the state (*len bytes; the caller frees it). */
unsigned char *kvt_llama_export(kvr_client *c, const char *ctx, const kvr_llama_model *m,
                                const kvr_llama_export_opts *o, size_t *len);

#endif
