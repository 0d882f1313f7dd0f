/*
 * kvr_llama_run.h — running build/kvrope-llama from the llama tests and
 * benches, and finding this repository's checkout (for scripts/ and its git
 * history). Compiled once into libtestcommon.a (kvr_llama_run.c).
 */
#ifndef KVR_LLAMA_RUN_H
#define KVR_LLAMA_RUN_H

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/common/kvr_testd.h"

/* The checkout: the first of $KVR_BUILD and its parents that holds
 * scripts/edit-history.py ("." if none does). */
const char *kvr_repo_root(void);

/* Starts build/kvrope-llama with args (NULL-ended, at most 62), its stdout
 * on the returned pipe end; *pid the child (killed with the test, and after
 * 300 s). */
int kvr_llama_spawn(const char *const *args, pid_t *pid);

/* Reads fd to its end into out (NUL-terminated, cut at cap) and closes it. */
void kvr_llama_drain(int fd, char *out, size_t cap);

/* Runs kvrope-llama with args to its end, stdout into out; its exit status
 * (-1 if a signal ended it). */
int kvr_llama_run(char *out, size_t cap, const char *const *args);

/* argv (64 entries) for a worker command against a test daemon: --model
 * model --socket sock --threads threads --json, then args (NULL-ended; at
 * most 62 in all) and the NULL that ends it. */
void kvr_llama_json_argv(const char **argv, const char *model, const char *sock,
                         const char *threads, const char *const *args);

#endif /* KVR_LLAMA_RUN_H */
