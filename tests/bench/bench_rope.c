/*
 * bench_rope.c — reposition throughput (GB/s of key data) on 8192 tokens x 8
 * heads x 128 dims, in f32, f16 and bf16, with 1 and 2 threads, beside memcpy
 * of the same buffer and ggml's ggml_rope_ext (the CPU library shipped in the
 * npm package @node-llama-cpp/linux-x64, dlopen'ed from $KVR_GGML_DIR) on the
 * same data with the same thread count, all measured in this run. Prints
 * ratios; nothing is asserted.
 *
 * Two position patterns: "runs" (an edit shifts suffixes: deltas constant in
 * a few long runs, the common case) and "distinct" (every token a different
 * random delta, the worst case for the sin/cos cache).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rope/rope.h"
#include "tests/common/kvt_bench.h"

#define T_TOK 8192
#define N_HEAD 8
#define HD 128
#define REPS 15

/* ---- memcpy, threaded the same way ------------------------------------- */

typedef struct cpy { char *d; const char *s; size_t n; } cpy;
static void *cpy_main(void *a) { cpy *c = a; memcpy(c->d, c->s, c->n); return NULL; }

static void par_memcpy(void *d, const void *s, size_t n, int nt)
{
    if (nt <= 1) { memcpy(d, s, n); return; }
    pthread_t th[8];
    cpy c[8];
    for (int i = 0; i < nt; i++) {
        size_t a = n * (size_t)i / (size_t)nt, b = n * (size_t)(i + 1) / (size_t)nt;
        c[i] = (cpy){ (char *)d + a, (const char *)s + a, b - a };
    }
    for (int i = 1; i < nt; i++) pthread_create(&th[i], NULL, cpy_main, &c[i]);
    cpy_main(&c[0]);
    for (int i = 1; i < nt; i++) pthread_join(th[i], NULL);
}

/* ---- the ggml peer --------------------------------------------------------- */

struct ggml_init_params { size_t mem_size; void *mem_buffer; bool no_alloc; };
struct ggml_context;
struct ggml_tensor;
struct ggml_cgraph;
enum { GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_I32 = 26 };
enum { GGML_ROPE_TYPE_NEOX = 2 };

typedef struct ggml_api {
    bool ok;
    char variant[64];
    struct ggml_context *(*init)(struct ggml_init_params);
    void (*free_)(struct ggml_context *);
    struct ggml_tensor *(*new_tensor_1d)(struct ggml_context *, int, int64_t);
    struct ggml_tensor *(*new_tensor_3d)(struct ggml_context *, int, int64_t, int64_t, int64_t);
    void *(*get_data)(const struct ggml_tensor *);
    struct ggml_tensor *(*rope_ext)(struct ggml_context *, struct ggml_tensor *, struct ggml_tensor *,
                                    struct ggml_tensor *, int, int, int, float, float, float,
                                    float, float, float);
    struct ggml_cgraph *(*new_graph)(struct ggml_context *);
    void (*build_forward_expand)(struct ggml_cgraph *, struct ggml_tensor *);
    int (*compute_with_ctx)(struct ggml_context *, struct ggml_cgraph *, int);
    void (*cpu_init)(void);
} ggml_api;

#define SYM(lib, dst, name) do {                                     \
        void *p_ = dlsym(lib, name);                                 \
        if (!p_) { fprintf(stderr, "ggml peer: no %s\n", name); return false; } \
        memcpy(&(dst), &p_, sizeof p_);                              \
    } while (0)

static bool ggml_load(ggml_api *g)
{
    memset(g, 0, sizeof *g);
    const char *dir = getenv("KVR_GGML_DIR");
    if (!dir || !*dir) {
        fprintf(stderr, "ggml peer: KVR_GGML_DIR not set\n");
        return false;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/libggml-base.so", dir);
    void *base = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!base) { fprintf(stderr, "ggml peer: %s\n", dlerror()); return false; }
    /* The CPU variant that scores best on this machine (each variant exports
     * ggml_backend_score, 0 when the CPU lacks its instructions). */
    static const char *const variants[] = {
        "sapphirerapids", "zen4", "cooperlake", "icelake", "cascadelake", "cannonlake",
        "skylakex", "alderlake", "haswell", "sandybridge", "ivybridge", "piledriver",
        "sse42", "x64", NULL
    };
    void *cpu = NULL;
    int best = 0;
    for (int i = 0; variants[i]; i++) {
        snprintf(path, sizeof path, "%s/libggml-cpu-%s.so", dir, variants[i]);
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) continue;
        int (*score)(void) = NULL;
        void *p = dlsym(h, "ggml_backend_score");
        memcpy(&score, &p, sizeof p);
        int s = score ? score() : 1;
        if (s > best) {
            if (cpu) dlclose(cpu);
            cpu = h;
            best = s;
            snprintf(g->variant, sizeof g->variant, "%s", variants[i]);
        } else {
            dlclose(h);
        }
    }
    if (!cpu) { fprintf(stderr, "ggml peer: no usable libggml-cpu-*.so in %s\n", dir); return false; }
    SYM(base, g->init, "ggml_init");
    SYM(base, g->free_, "ggml_free");
    SYM(base, g->new_tensor_1d, "ggml_new_tensor_1d");
    SYM(base, g->new_tensor_3d, "ggml_new_tensor_3d");
    SYM(base, g->get_data, "ggml_get_data");
    SYM(base, g->rope_ext, "ggml_rope_ext");
    SYM(base, g->new_graph, "ggml_new_graph");
    SYM(base, g->build_forward_expand, "ggml_build_forward_expand");
    SYM(cpu, g->compute_with_ctx, "ggml_graph_compute_with_ctx");
    void *p = dlsym(cpu, "ggml_cpu_init");
    if (p) memcpy(&g->cpu_init, &p, sizeof p);
    if (g->cpu_init) g->cpu_init();
    g->ok = true;
    return true;
}

/* ggml_rope_ext (NeoX, theta 10000) of the same keys by per-token deltas, the
 * way llama.cpp's K-shift re-positions a cache. Returns the best time. */
static double ggml_time(const ggml_api *g, int f16, const void *keys, const int64_t *delta, int nt)
{
    size_t es = f16 ? 2 : 4, bytes = (size_t)T_TOK * N_HEAD * HD * es;
    struct ggml_init_params ip = { 2 * bytes + ((size_t)64 << 20), NULL, false };
    struct ggml_context *ctx = g->init(ip);
    if (!ctx) return -1;
    struct ggml_tensor *k = g->new_tensor_3d(ctx, f16 ? GGML_TYPE_F16 : GGML_TYPE_F32, HD, N_HEAD, T_TOK);
    struct ggml_tensor *pos = g->new_tensor_1d(ctx, GGML_TYPE_I32, T_TOK);
    memcpy(g->get_data(k), keys, bytes);
    int32_t *pp = g->get_data(pos);
    for (int t = 0; t < T_TOK; t++) pp[t] = (int32_t)delta[t];
    struct ggml_tensor *out = g->rope_ext(ctx, k, pos, NULL, HD, GGML_ROPE_TYPE_NEOX, 0,
                                          10000.0f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f);
    struct ggml_cgraph *gf = g->new_graph(ctx);
    g->build_forward_expand(gf, out);
    double best = 1e30;
    for (int r = 0; r < REPS; r++) {
        double t0 = kvt_now_s();
        g->compute_with_ctx(ctx, gf, nt);
        double dt = kvt_now_s() - t0;
        if (dt < best) best = dt;
    }
    g->free_(ctx);
    return best;
}

/* ---- main ------------------------------------------------------------------ */

typedef struct row {
    const char *dtype, *pattern;
    int threads;
    double kvr, mcp, ggml;   /* GB/s; ggml < 0 when absent */
} row;

int main(void)
{
    kvr_rope_config cfg = kvt_rope_config(HD, N_HEAD);
    kvr_rope *r = NULL;
    if (kvr_rope_create(&r, &cfg, NULL)) { fprintf(stderr, "create failed\n"); return 1; }

    size_t nel = (size_t)T_TOK * N_HEAD * HD;
    float *x = malloc(nel * 4);
    void *src = malloc(nel * 4), *dst = malloc(nel * 4);
    int64_t *from = malloc(T_TOK * 8), *to_runs = malloc(T_TOK * 8), *to_rand = malloc(T_TOK * 8);
    int64_t *d_runs = malloc(T_TOK * 8), *d_rand = malloc(T_TOK * 8);
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < nel; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        x[i] = (float)((double)(s >> 11) * 0x1p-53 * 2.0 - 1.0);
    }
    for (int t = 0; t < T_TOK; t++) {
        from[t] = t;
        /* three edits: +5 after token 1000, -12 more after 3000, +40 after 6000 */
        int64_t d = (t >= 1000 ? 5 : 0) + (t >= 3000 ? -12 : 0) + (t >= 6000 ? 40 : 0);
        to_runs[t] = t + d;
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        to_rand[t] = (int64_t)(s % 1000000);
        d_runs[t] = to_runs[t] - from[t];
        d_rand[t] = to_rand[t] - from[t];
    }
    ggml_api g;
    bool have_ggml = ggml_load(&g);
    printf("kvrope rope bench: %d tokens x %d heads x %d dims, isa %s; ggml peer: %s%s\n",
           T_TOK, N_HEAD, HD, kvr_isa_name(kvr_isa_best()),
           have_ggml ? "libggml-cpu-" : "not loaded", have_ggml ? g.variant : "");

    kvr_dtype types[] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
    row rows[32];
    int nrows = 0;
    for (int ti = 0; ti < 3; ti++) {
        kvr_dtype dt = types[ti];
        size_t bytes = nel * kvr_dtype_size(dt);
        kvr_convert(src, dt, x, KVR_DTYPE_F32, nel);
        for (int nt = 1; nt <= 2; nt++) {
            double mbest = 1e30;
            for (int k = 0; k < REPS; k++) {
                double t0 = kvt_now_s();
                par_memcpy(dst, src, bytes, nt);
                double d = kvt_now_s() - t0;
                if (d < mbest) mbest = d;
            }
            for (int pat = 0; pat < 2; pat++) {
                const int64_t *to = pat ? to_rand : to_runs;
                kvr_rope_opts o = { .n_threads = nt };
                double best = 1e30;
                /* memcpy interleaved with the kernel, best of each: both
                 * see the same load on a shared machine */
                for (int k = 0; k < REPS; k++) {
                    double t0 = kvt_now_s();
                    kvr_rope_reposition(r, dst, dt, src, dt, T_TOK, N_HEAD, from, to, &o);
                    double d = kvt_now_s() - t0;
                    if (d < best) best = d;
                    t0 = kvt_now_s();
                    par_memcpy(dst, src, bytes, nt);
                    d = kvt_now_s() - t0;
                    if (d < mbest) mbest = d;
                }
                double gt = -1;
                if (have_ggml && dt != KVR_DTYPE_BF16)
                    gt = ggml_time(&g, dt == KVR_DTYPE_F16, src, pat ? d_rand : d_runs, nt);
                row *rw = &rows[nrows++];
                rw->dtype = kvr_dtype_name(dt);
                rw->pattern = pat ? "distinct" : "runs";
                rw->threads = nt;
                rw->kvr = (double)bytes / best * 1e-9;
                rw->mcp = (double)bytes / mbest * 1e-9;
                rw->ggml = gt > 0 ? (double)bytes / gt * 1e-9 : -1;
                printf("  %-4s %-8s %d thr: kvrope %6.2f GB/s  memcpy %6.2f GB/s (x%.2f)",
                       rw->dtype, rw->pattern, nt, rw->kvr, rw->mcp, rw->kvr / rw->mcp);
                if (rw->ggml > 0) printf("  ggml %6.2f GB/s (kvrope x%.2f)", rw->ggml, rw->kvr / rw->ggml);
                printf("\n");
            }
        }
    }
    printf("\n| dtype | deltas | threads | kvrope GB/s | memcpy GB/s | kvrope/memcpy | ggml GB/s | kvrope/ggml |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nrows; i++) {
        row *rw = &rows[i];
        printf("| %s | %s | %d | %.2f | %.2f | %.2f |", rw->dtype, rw->pattern, rw->threads,
               rw->kvr, rw->mcp, rw->kvr / rw->mcp);
        if (rw->ggml > 0) printf(" %.2f | %.2f |\n", rw->ggml, rw->kvr / rw->ggml);
        else printf(" n/a | n/a |\n");
    }
    if (!have_ggml) printf("\n(ggml peer could not be loaded; only memcpy ratios)\n");
    /* the goals, on the single-thread rows */
    printf("\n");
    for (int i = 0; i < nrows; i++) {
        row *rw = &rows[i];
        if (rw->threads != 1) continue;
        double m = rw->kvr / rw->mcp, gr = rw->ggml > 0 ? rw->kvr / rw->ggml : -1;
        bool f16 = !strcmp(rw->dtype, "f16"), f32 = !strcmp(rw->dtype, "f32");
        bool runs = !strcmp(rw->pattern, "runs");
        if (f16 && runs) {
            kvt_goal(m >= 0.6, "f16 reposition, deltas in runs, >= 0.6x memcpy: %.2fx", m);
            if (gr > 0)
                kvt_goal(gr >= 5.0, "f16 reposition, deltas in runs, >= 5x ggml: %.1fx", gr);
            else
                kvt_goal(false, "f16 reposition, deltas in runs, >= 5x ggml: no ggml peer");
        }
        if (f32 && runs) {
            if (gr > 0)
                kvt_goal(gr >= 1.5, "f32 reposition, deltas in runs, >= 1.5x ggml: %.1fx", gr);
            else
                kvt_goal(false, "f32 reposition, deltas in runs, >= 1.5x ggml: no ggml peer");
        }
        if (f16 && !runs)
            kvt_goal(m >= 0.5, "f16 reposition, a different delta per token, >= 0.5x memcpy: %.2fx",
                     m);
    }
    free(x); free(src); free(dst); free(from); free(to_runs); free(to_rand);
    free(d_runs); free(d_rand);
    kvr_rope_destroy(r);
    return 0;
}
