/*
 * kvr_llama_bench.c — tests/common/kvr_llama_bench.h: the llama.cpp benchmarks' model and worker runs.
 * Compiled once into libtestcommon.a.
 */
#include "tests/common/kvr_llama_bench.h"

double llb_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int llb_ensure_model(char *path, size_t cap)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/llama-models", testd_build_dir());
    mkdir(dir, 0755);
    snprintf(path, cap, "%s/bench-l16-w2048-kv8-f16.gguf", dir);
    struct stat sb;
    if (stat(path, &sb) == 0 && sb.st_size > 1000000)
        return 0;
    printf("generating the benchmark model (0.7 B parameters, f16) into %s ...\n", path);
    fflush(stdout);
    char cmd[4096];
    double t0 = llb_now_ms();
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s -o '%s.tmp' --arch llama --layers 16 "
             "--width 2048 --heads 32 --kv-heads 8 --ffn 5632 --dtype f16 --seed 1 --ctx 4096 "
             "&& mv '%s.tmp' '%s'", KVR_LLAMA_GEN_GGUF, path, path, path);
    if (system(cmd) != 0) {
        fprintf(stderr, "benchmark model generation failed\n");
        return -1;
    }
    printf("  done in %.0f s\n", (llb_now_ms() - t0) / 1e3);
    return 0;
}

cJSON *llb_worker(const char *sock, const char *model, const char *const *args)
{
    char cmd[8192];
    size_t o = (size_t)snprintf(cmd, sizeof cmd, "%s/kvrope-llama --model '%s' --socket '%s' "
                                "--threads " LLB_THREADS " --json", testd_build_dir(), model,
                                sock);
    for (int i = 0; args[i]; i++)
        o += (size_t)snprintf(cmd + o, sizeof cmd - o, " '%s'", args[i]);
    FILE *f = popen(cmd, "r");
    if (!f)
        return NULL;
    static char out[1 << 20];
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    int st = pclose(f);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "%s failed: %s\n", cmd, out);
        return NULL;
    }
    cJSON *j = cJSON_Parse(out);
    if (!j)
        fprintf(stderr, "not JSON: %s\n", out);
    return j;
}

double llb_jnum(const cJSON *j, const char *group, const char *key)
{
    const cJSON *g = group ? cJSON_GetObjectItemCaseSensitive(j, group) : j;
    const cJSON *v = g ? cJSON_GetObjectItemCaseSensitive(g, key) : NULL;
    return cJSON_IsNumber(v) ? v->valuedouble : (double)NAN;
}

int llb_begin(char *model, size_t cap, kvr_testd *d)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (llb_ensure_model(model, cap) < 0)
        return -1;
    return testd_start(d, NULL);
}
