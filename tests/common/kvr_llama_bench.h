/*
 * kvr_llama_bench.h — what the llama.cpp benchmarks (tests/llama/bench_*.c)
 * share: the 0.7 B benchmark model (written once by scripts/gen-gguf.py into
 * $KVR_BUILD/llama-models/ and reused), running build/kvrope-llama with
 * --json against a test daemon, and reading numbers out of its reports.
 * Compiled once into libtestcommon.a (kvr_llama_bench.c, built with the
 * llama flags for KVR_LLAMA_GEN_GGUF).
 */
#ifndef KVR_LLAMA_BENCH_H
#define KVR_LLAMA_BENCH_H

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

#include "tests/common/kvr_testd.h"

#define LLB_THREADS "2"

double llb_now_ms(void);

/* The 0.7 B model of a realistic CPU shape (16 layers, width 2048, 32 heads,
 * 8 KV heads, head_dim 64, ffn 5632, f16, context 4096) into path. */
int llb_ensure_model(char *path, size_t cap);

/* Runs kvrope-llama --json against the daemon at sock; its report, or NULL
 * after printing why. */
cJSON *llb_worker(const char *sock, const char *model, const char *const *args);

double llb_jnum(const cJSON *j, const char *group, const char *key);

/* A benchmark's start: stdout line-buffered, the model (llb_ensure_model)
 * into model, and a test daemon d started. 0, or -1 after printing why. */
int llb_begin(char *model, size_t cap, kvr_testd *d);

#endif /* KVR_LLAMA_BENCH_H */
