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
    int n = 0;
    argv[n++] = bin;
    for (int i = 0; args[i] && n < 63; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    int pfd[2];
    if (pipe(pfd) != 0)
        return -1;
    *pid = fork();
    if (*pid < 0)
        return -1;
    if (*pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        alarm(300);
        dup2(pfd[1], 1);
        close(pfd[0]);
        close(pfd[1]);
        execv(bin, (char *const *)(uintptr_t)argv);
        _exit(127);
    }
    close(pfd[1]);
    return pfd[0];
}

/* Reads fd to its end into out (NUL-terminated, cut at cap) and closes it. */
static inline void kvr_llama_drain(int fd, char *out, size_t cap)
{
    size_t len = 0;
    for (;;) {
        char tmp[4096];
        ssize_t r = read(fd, tmp, sizeof tmp);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        for (ssize_t i = 0; i < r; i++)
            if (len + 1 < cap)
                out[len++] = tmp[i];
    }
    if (cap)
        out[len] = 0;
    close(fd);
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
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st))
        return -1;
    return WEXITSTATUS(st);
}

#endif /* KVR_LLAMA_RUN_H */
