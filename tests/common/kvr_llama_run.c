/*
 * kvr_llama_run.c — tests/common/kvr_llama_run.h: running build/kvrope-llama.
 * Compiled once into libtestcommon.a.
 */
#include "tests/common/kvr_llama_run.h"

const char *kvr_repo_root(void)
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

int kvr_llama_spawn(const char *const *args, pid_t *pid)
{
    char bin[512];
    snprintf(bin, sizeof bin, "%s/kvrope-llama", testd_build_dir());
    const char *argv[64];
    argv[0] = bin;
    testd_argv_end(argv, 1, 64, args);
    return testd_spawn_stdout(argv, 300, pid);
}

void kvr_llama_drain(int fd, char *out, size_t cap)
{
    testd_drain(fd, out, cap);
}

int kvr_llama_run(char *out, size_t cap, const char *const *args)
{
    pid_t pid;
    int fd = kvr_llama_spawn(args, &pid);
    if (fd < 0)
        return -1;
    kvr_llama_drain(fd, out, cap);
    return testd_wait_exit(pid);
}

void kvr_llama_json_argv(const char **argv, const char *model, const char *sock,
                         const char *threads, const char *const *args)
{
    const char *head[] = { "--model", model, "--socket", sock, "--threads", threads, "--json" };
    int n = 0;
    for (; n < 7; n++)
        argv[n] = head[n];
    testd_argv_end(argv, n, 63, args);
}
