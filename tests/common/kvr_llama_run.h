/*
 * kvr_llama_run.h — running build/kvrope-llama from the llama tests and
 * benches, and finding this repository's checkout (for scripts/ and its git
 * history). Header-only (static functions), like the other tests/common
 * helpers.
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
static inline const char *kvr_repo_root(void)
{
    static char root[1024];
    char p[1200];
    snprintf(root, sizeof root, "%s", testd_build_dir());
    for (int up = 0; up < 4; up++) {
        snprintf(p, sizeof p, "%s/scripts/edit-history.py", root);
        if (access(p, R_OK) == 0)
            return root;
        strncat(root, "/..", sizeof root - strlen(root) - 1);
    }
    return ".";
}

/* Starts build/kvrope-llama with args (NULL-ended, at most 62), its stdout
 * on the returned pipe end; *pid the child (killed with the test, and after
 * 300 s). */
static inline int kvr_llama_spawn(const char *const *args, pid_t *pid)
{
    char bin[512];
    snprintf(bin, sizeof bin, "%s/kvrope-llama", testd_build_dir());
    const char *argv[64];
    argv[0] = bin;
    testd_argv_end(argv, 1, 64, args);
    return testd_spawn_stdout(argv, 300, pid);
}

/* Reads fd to its end into out (NUL-terminated, cut at cap) and closes it. */
static inline void kvr_llama_drain(int fd, char *out, size_t cap)
{
    testd_drain(fd, out, cap);
}

/* Runs kvrope-llama with args to its end, stdout into out; its exit status
 * (-1 if a signal ended it). */
static inline int kvr_llama_run(char *out, size_t cap, const char *const *args)
{
    pid_t pid;
    int fd = kvr_llama_spawn(args, &pid);
    if (fd < 0)
        return -1;
    kvr_llama_drain(fd, out, cap);
    return testd_wait_exit(pid);
}

#endif /* KVR_LLAMA_RUN_H */
