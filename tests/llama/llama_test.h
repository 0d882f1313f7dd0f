/*
 * llama_test.h — helpers for the tests that run the real
 * libllama (llama.cpp v0.5.0 from the npm cache, client/llama/llama.mk):
 * quiet logging, models written by scripts/gen-gguf.py into a temporary
 * directory, a context with chosen cache types, decoding at explicit
 * positions, sequence states, and the f16 / ggml-block comparisons the
 * bridge tests use. Compiled once (tests/llama/llama_test.c) into
 * libtestllama.a, which the llama tests and benches link.
 */
#ifndef KVR_LLAMA_TEST_H
#define KVR_LLAMA_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <llama.h>

void lt_quiet_log(enum ggml_log_level level, const char *text, void *ud);

void lt_engine_init(void);

/* Writes a model with gen-gguf.py `args` into dir/name; returns 0 or -1. */
int lt_gen_model(char *path, size_t cap, const char *dir, const char *name,
                 const char *args);

typedef struct lt_lm {
    struct llama_model   *model;
    struct llama_context *ctx;
    const struct llama_vocab *vocab;
    int n_vocab;
} lt_lm;

/* fa: 1 = flash attention on (v_trans 0), 0 = off (v_trans 1). */
int lt_open(lt_lm *lm, const char *path, int type_k, int type_v, int fa, int n_ctx);

void lt_close(lt_lm *lm);

/* Deterministic token ids in [3, n_vocab) (bytes of a text). */
void lt_tokens(llama_token *t, int n, unsigned seed);

/* Decodes n tokens at positions pos0.. in sequence 0; the logits of the last
 * one into logits (n_vocab floats) when non-NULL. Returns llama_decode's. */
int lt_decode(lt_lm *lm, const llama_token *t, int n, int pos0, float *logits);

unsigned char *lt_state(lt_lm *lm, size_t *len);

float lt_h2f(uint16_t h);

/* One f16 ulp at magnitude x. */
double lt_ulp16(double x);

double lt_max_abs(const float *a, int n);

double lt_max_diff(const float *a, const float *b, int n);

#endif
