/*
 * test_llama_score.c — `kvrope-llama score` against llama.cpp itself: a
 * model written by scripts/gen-gguf.py, the worker run as a separate process
 * (no daemon), the reference computed in this process with libllama.
 *
 *  - no KV: the rows equal a plain full llama_decode's logits;
 *  - KV.bin made from llama.cpp's own state after T[0..m) (the worker's state
 *    parser and gather): in-cache rows (from 1) and continuation rows equal
 *    the plain full forward's; generation from inside, at and after the
 *    cache equals plain greedy generation; --stop-token stops after it;
 *  - every malformed or mismatched input is refused with exit 1 and a
 *    message, and no logits file appears.
 * Tolerances are on max |diff| / max |logit| over all rows (each test prints
 * what it saw).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <llama.h>

#include "client/llama/worker.h"
#include "tests/common/kvr_testd.h"

/* The worker's parts come from build/lib/libworker.a (client/llama/llama.mk). */

#define TOL 1e-4

static char dir[256], model[320];
static struct llama_model *M;
static int NV, NL, NKV, HD;
/* Every test's token, KV and logits files (in dir). */
static char tp[400], kp[400], lp[400];

static void quiet(enum ggml_log_level level, const char *text, void *ud)
{
    (void)ud;
    if (level == GGML_LOG_LEVEL_ERROR)
        fputs(text, stderr);
}

static void path(char *p, size_t cap, const char *name) { snprintf(p, cap, "%s/%s", dir, name); }

/* Writes dir/name with scripts/gen-gguf.py (args: the shape) and loads it as
 * M, with its dimensions. */
static void load_model(const char *name, const char *args)
{
    path(model, sizeof model, name);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s -o %s %s", KVR_LLAMA_GEN_GGUF, model, args);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    M = llama_model_load_from_file(model, llama_model_default_params());
    cr_assert_not_null(M);
    NV = llama_vocab_n_tokens(llama_model_get_vocab(M));
    NL = llama_model_n_layer(M);
    NKV = llama_model_n_head_kv(M);
    HD = llama_model_n_embd(M) / llama_model_n_head(M);
}

static void setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/kvr-score-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    path(tp, sizeof tp, "t.bin");
    path(kp, sizeof kp, "kv.bin");
    path(lp, sizeof lp, "l.bin");
    llama_log_set(quiet, NULL);
    ggml_backend_load_all_from_path(KVR_LLAMA_LIBDIR);
    llama_backend_init();
    load_model("m.gguf", "--arch llama --layers 2 --width 128 --heads 4 --kv-heads 2 --seed 7");
}

static void teardown(void)
{
    if (M)
        llama_model_free(M);
    M = NULL;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) {
    }
}

TestSuite(llama_score, .init = setup, .fini = teardown, .timeout = 600);

/* A context as the worker makes them: f16 K and V, flash attention on. */
static struct llama_context *ctx_new(int n_ctx)
{
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n_ctx;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.type_k = cp.type_v = GGML_TYPE_F16;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    struct llama_context *c = llama_init_from_model(M, cp);
    cr_assert_not_null(c);
    return c;
}

/* Decodes t[0..n) at 0.. in seq 0; all rows' logits into out (n x NV) when
 * out, else only the last row's into last. */
static void decode(struct llama_context *c, const int32_t *t, int n, int pos0, float *out,
                   float *last)
{
    for (int i0 = 0; i0 < n; i0 += 512) {      /* the context's n_batch */
        int cnt = n - i0 < 512 ? n - i0 : 512;
        struct llama_batch b = llama_batch_init(cnt, 0, 1);
        for (int i = 0; i < cnt; i++) {
            b.token[i] = t[i0 + i];
            b.pos[i] = pos0 + i0 + i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = out || i0 + i == n - 1;
        }
        b.n_tokens = cnt;
        cr_assert_eq(llama_decode(c, b), 0);
        llama_batch_free(b);
        if (out)
            for (int i = 0; i < cnt; i++)
                memcpy(out + (size_t)(i0 + i) * NV, llama_get_logits_ith(c, i), (size_t)NV * 4);
        if (last && i0 + cnt == n)
            memcpy(last, llama_get_logits_ith(c, cnt - 1), (size_t)NV * 4);
    }
}

static int32_t argmax(const float *x)
{
    int32_t b = 0;
    for (int i = 1; i < NV; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* Plain greedy: T[0..I] decoded in one batch, then n tokens one by one. */
static void plain_greedy(const int32_t *T, int I, int n, int32_t *out)
{
    struct llama_context *c = ctx_new(512);
    float *l = malloc((size_t)NV * 4);
    decode(c, T, I + 1, 0, NULL, l);
    for (int k = 0; k < n; k++) {
        out[k] = argmax(l);
        if (k + 1 < n)
            decode(c, &out[k], 1, I + 1 + k, NULL, l);
    }
    free(l);
    llama_free(c);
}

static void tokens(int32_t *t, int n, unsigned seed)
{
    unsigned x = seed * 2654435761u + 12345u;
    t[0] = 1;     /* BOS */
    for (int i = 1; i < n; i++) {
        x = x * 1103515245u + 12345u;
        t[i] = (int32_t)(3 + (x >> 16) % 256);
    }
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(fwrite(p, 1, n, f), n);
    fclose(f);
}

static void *read_bytes(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = malloc((size_t)sz + 1);
    cr_assert_eq(fread(p, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    *n = (size_t)sz;
    return p;
}

/* KV.bin bytes: header, positions, payload (layer-major, K then V). */
typedef struct kvfile {
    uint8_t *b;
    size_t   len;
} kvfile;

static kvfile kv_make(uint32_t nl, uint32_t m, uint32_t nkv, uint32_t hd, uint32_t dtype,
                      const int64_t *pos, const void *payload, size_t payload_len)
{
    kvfile k;
    k.len = 32 + 8 * (size_t)m + payload_len;
    k.b = calloc(1, k.len);
    memcpy(k.b, "KVRKV1\0\0", 8);
    uint32_t h[6] = { nl, m, nkv, hd, dtype, 0 };
    memcpy(k.b + 8, h, sizeof h);
    memcpy(k.b + 32, pos, 8 * (size_t)m);
    memcpy(k.b + 32 + 8 * (size_t)m, payload, payload_len);
    return k;
}

/* llama.cpp's own KV of T[0..m) at positions pos0.., as KV.bin (f16). */
static kvfile kv_of_llama(const int32_t *T, int m, int pos0)
{
    struct llama_context *c = ctx_new(512);
    decode(c, T, m, pos0, NULL, NULL);
    size_t n = llama_state_seq_get_size(c, 0);
    uint8_t *st = malloc(n);
    cr_assert_eq(llama_state_seq_get_data(c, st, n, 0), n);
    llama_free(c);
    kvr__wk_state s;
    char err[256];
    cr_assert_eq(kvr__wk_state_parse(&s, st, n, err, sizeof err), 0, "%s", err);
    cr_assert_eq(s.n_cells, (uint32_t)m);
    cr_assert_eq(s.type, KVR_WK_GGML_F16);
    cr_assert_eq(s.n_embd, (uint32_t)(NKV * HD));
    uint32_t *cells = malloc((size_t)m * sizeof *cells);
    int64_t *pos = malloc((size_t)m * sizeof *pos);
    for (int i = 0; i < m; i++) {
        long cc = kvr__wk_state_find(&s, pos0 + i);
        cr_assert_geq(cc, 0);
        cells[i] = (uint32_t)cc;
        pos[i] = pos0 + i;
    }
    size_t pl_len = (size_t)NL * 2 * (size_t)m * (size_t)(NKV * HD) * 2;
    void *pl = malloc(pl_len);
    kvr__wk_state_gather(&s, cells, (size_t)m, pl);
    kvfile k = kv_make((uint32_t)NL, (uint32_t)m, (uint32_t)NKV, (uint32_t)HD, 1, pos, pl, pl_len);
    kvr__wk_state_free(&s);
    free(st);
    free(cells);
    free(pos);
    free(pl);
    return k;
}

/* The tokens T (n of them) into tp and llama.cpp's KV of the first m
 * (positions from 0) into kp: the inputs of a score; the KV file (free
 * its b). */
static kvfile score_inputs(const int32_t *T, int n, int m)
{
    write_bytes(tp, T, (size_t)n * sizeof *T);
    kvfile k = kv_of_llama(T, m, 0);
    write_bytes(kp, k.b, k.len);
    return k;
}

/* llama.cpp's logits of all n tokens of T decoded in one context from
 * position 0 (n x NV floats; free it). */
static float *full_logits(const int32_t *T, int n)
{
    float *ref = malloc((size_t)n * NV * 4);
    struct llama_context *c = ctx_new(512);
    decode(c, T, n, 0, ref, NULL);
    llama_free(c);
    return ref;
}

static char out_s[1 << 20], err_s[1 << 16];

/* Runs kvrope-llama --model M --threads 1 [--json] args...; stdout and stderr
 * into out_s / err_s; the exit status. */
static int run(bool json, const char *const *args)
{
    char cmd[8192];
    size_t o = (size_t)snprintf(cmd, sizeof cmd, "%s/kvrope-llama --model '%s' --threads 1%s",
                                testd_build_dir(), model, json ? " --json" : "");
    for (int i = 0; args[i]; i++)
        o += (size_t)snprintf(cmd + o, sizeof cmd - o, " '%s'", args[i]);
    snprintf(cmd + o, sizeof cmd - o, " >'%s/out' 2>'%s/err'", dir, dir);
    int st = system(cmd);
    char p[400];
    size_t n;
    snprintf(p, sizeof p, "%s/out", dir);
    char *b = read_bytes(p, &n);
    n = n < sizeof out_s - 1 ? n : sizeof out_s - 1;
    memcpy(out_s, b, n);
    out_s[n] = 0;
    free(b);
    snprintf(p, sizeof p, "%s/err", dir);
    b = read_bytes(p, &n);
    n = n < sizeof err_s - 1 ? n : sizeof err_s - 1;
    memcpy(err_s, b, n);
    err_s[n] = 0;
    free(b);
    cr_assert(WIFEXITED(st), "kvrope-llama died: %s", err_s);
    return WEXITSTATUS(st);
}

static cJSON *run_ok(const char *const *args)
{
    int rc = run(true, args);
    cr_assert_eq(rc, 0, "exit %d: %s %s", rc, out_s, err_s);
    cJSON *j = cJSON_Parse(out_s);
    cr_assert_not_null(j, "%s", out_s);
    return j;
}

static double num(const cJSON *j, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, k);
    cr_assert(cJSON_IsNumber(v), "field %s: %s", k, out_s);
    return v->valuedouble;
}

/* max |a - b| / max |b| over n floats. */
static double rel_err(const float *a, const float *b, size_t n)
{
    double d = 0, mx = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - (double)b[i]);
        d = e > d ? e : d;
        mx = fabs((double)b[i]) > mx ? fabs((double)b[i]) : mx;
    }
    return mx > 0 ? d / mx : d;
}

/* ---- (1) no KV = a plain full decode ------------------------------------ */
Test(llama_score, no_kv_equals_a_full_decode)
{
    enum { N = 700 };       /* two decodes of 512 and 188 on both sides */
    int32_t T[N];
    tokens(T, N, 11);
    write_bytes(tp, T, sizeof T);
    const char *a[] = { "score", "--tokens", tp, "--from", "0", "--logits-out", lp, NULL };
    cJSON *j = run_ok(a);
    cr_expect_str_eq(cJSON_GetObjectItem(j, "command")->valuestring, "score");
    cr_expect_eq(num(j, "n_tokens"), N);
    cr_expect_eq(num(j, "n_cached"), 0);
    cr_expect_eq(num(j, "from"), 0);
    cr_expect_eq(num(j, "n_scored"), N - 1);
    cr_expect_eq(num(j, "n_vocab"), NV);
    cr_expect_str_eq(cJSON_GetObjectItem(j, "logits")->valuestring, lp);
    cr_expect_eq(cJSON_GetArraySize(cJSON_GetObjectItem(j, "generated")), 0);
    size_t n;
    float *L = read_bytes(lp, &n);
    cr_assert_eq(n, (size_t)(N - 1) * NV * 4, "N-1 rows of n_vocab floats");
    float *ref = malloc((size_t)N * NV * 4);
    struct llama_context *c = ctx_new(1024);
    decode(c, T, N, 0, ref, NULL);
    llama_free(c);
    double e = rel_err(L, ref, (size_t)(N - 1) * NV);
    fprintf(stderr, "score (1) no KV vs full decode: max rel err %.3g\n", e);
    cr_expect_leq(e, TOL, "rel err %g", e);
    /* A row does not depend on how many tokens follow: the rows of a short
     * prefix (one padded decode) are the long run's, bit for bit. */
    enum { S = 30 };
    write_bytes(tp, T, S * 4);
    const char *sh[] = { "score", "--tokens", tp, "--logits-out", lp, NULL };
    cJSON *js = run_ok(sh);
    cr_expect_eq(num(js, "n_scored"), S - 1);
    float *Ls = read_bytes(lp, &n);
    cr_assert_eq(n, (size_t)(S - 1) * NV * 4);
    double es = rel_err(Ls, L, (size_t)(S - 1) * NV);
    fprintf(stderr, "score (1) %d-token prefix vs the %d-token run: max rel err %.3g\n", S, N, es);
    cr_expect_eq(es, 0, "rel err %g", es);
    free(Ls);
    cJSON_Delete(js);
    write_bytes(tp, T, sizeof T);
    /* Default F with no KV is 0 as well; plain output names the rows. */
    const char *b[] = { "score", "--tokens", tp, NULL };
    cr_assert_eq(run(false, b), 0, "%s", err_s);
    cr_expect(strstr(out_s, "699 rows") != NULL, "%s", out_s);
    free(L);
    free(ref);
    cJSON_Delete(j);
}

/* ---- (2) KV from llama.cpp: in-cache and continuation rows --------------- */
Test(llama_score, kv_from_llama_reproduces_the_full_forward)
{
    enum { N = 300, m = 200 };   /* 199 in-cache rows: two decodes of queries */
    int32_t T[N];
    tokens(T, N, 5);
    char lp2[400];
    path(lp2, sizeof lp2, "l2.bin");
    kvfile k = score_inputs(T, N, m);
    float *ref = full_logits(T, N);

    const char *a[] = { "score", "--tokens", tp, "--kv", kp, "--from", "1", "--logits-out", lp,
                        NULL };
    cJSON *j = run_ok(a);
    cr_expect_eq(num(j, "n_cached"), m);
    cr_expect_eq(num(j, "from"), 1);
    cr_expect_eq(num(j, "n_scored"), N - 2);
    cr_expect_eq(num(j, "next_pos"), m);
    size_t n;
    float *L = read_bytes(lp, &n);
    cr_assert_eq(n, (size_t)(N - 2) * NV * 4);
    double e_in = rel_err(L, ref + NV, (size_t)(m - 1) * NV);
    double e_cont = rel_err(L + (size_t)(m - 1) * NV, ref + (size_t)m * NV, (size_t)(N - 1 - m) * NV);
    fprintf(stderr, "score (2) KV from llama.cpp, from 1: in-cache rows max rel err %.3g, "
            "continuation rows %.3g\n", e_in, e_cont);
    cr_expect_leq(e_in, TOL, "in-cache rows: rel err %g", e_in);
    cr_expect_leq(e_cont, TOL, "continuation rows: rel err %g", e_cont);
    /* Row by row: the in-cache row i is T[i]'s own logits, not a neighbour's. */
    for (int i = 1; i < m; i += 17)
        cr_expect_leq(rel_err(L + (size_t)(i - 1) * NV, ref + (size_t)i * NV, (size_t)NV), TOL,
                      "row %d", i);

    /* --exact: every row the full forward's, bit for bit. */
    const char *ax[] = { "score", "--tokens", tp, "--kv", kp, "--from", "1", "--logits-out", lp,
                         "--exact", NULL };
    cJSON *jx = run_ok(ax);
    cr_expect_eq(num(jx, "n_scored"), N - 2);
    float *LX = read_bytes(lp, &n);
    cr_assert_eq(n, (size_t)(N - 2) * NV * 4);
    double ex = rel_err(LX, ref + NV, (size_t)(N - 2) * NV);
    fprintf(stderr, "score (2) --exact, from 1: max rel err %.3g\n", ex);
    cr_expect_eq(ex, 0, "rel err %g", ex);
    free(LX);
    cJSON_Delete(jx);

    /* Default F = m: the continuation only. */
    const char *b[] = { "score", "--tokens", tp, "--kv", kp, "--logits-out", lp2, NULL };
    cJSON *j2 = run_ok(b);
    cr_expect_eq(num(j2, "from"), m);
    cr_expect_eq(num(j2, "n_scored"), N - 1 - m);
    float *L2 = read_bytes(lp2, &n);
    cr_assert_eq(n, (size_t)(N - 1 - m) * NV * 4);
    double e2 = rel_err(L2, ref + (size_t)m * NV, (size_t)(N - 1 - m) * NV);
    fprintf(stderr, "score (2) continuation only: max rel err %.3g\n", e2);
    cr_expect_leq(e2, TOL, "rel err %g", e2);

    /* Positions need not start at 0: the same tokens encoded at 1000.. */
    kvfile k2 = kv_of_llama(T, m, 1000);
    write_bytes(kp, k2.b, k2.len);
    float *ref2 = malloc((size_t)N * NV * 4);
    struct llama_context *c = ctx_new(512);
    decode(c, T, N, 1000, ref2, NULL);
    llama_free(c);
    cJSON *j3 = run_ok(a);
    cr_expect_eq(num(j3, "next_pos"), 1000 + m);
    float *L3 = read_bytes(lp, &n);
    double e3 = rel_err(L3, ref2 + NV, (size_t)(N - 2) * NV);
    fprintf(stderr, "score (2) at positions 1000..: max rel err %.3g\n", e3);
    cr_expect_leq(e3, TOL, "rel err %g", e3);
    free(k.b);
    free(k2.b);
    free(L);
    free(L2);
    free(L3);
    free(ref);
    free(ref2);
    cJSON_Delete(j);
    cJSON_Delete(j2);
    cJSON_Delete(j3);
}

/* The same on a NEOX model (qwen2, biases, f16 weights). */
Test(llama_score, qwen2_kv_reproduces_the_full_forward)
{
    llama_model_free(M);
    M = NULL;
    load_model("q.gguf", "--arch qwen2 --layers 2 --width 128 --heads 2 --kv-heads 1 --qkv-bias "
               "--dtype f16 --seed 3");
    enum { N = 140, m = 90 };
    int32_t T[N];
    tokens(T, N, 8);
    kvfile k = score_inputs(T, N, m);
    float *ref = full_logits(T, N);
    const char *a[] = { "score", "--tokens", tp, "--kv", kp, "--from", "1", "--logits-out", lp,
                        NULL };
    cJSON *j = run_ok(a);
    cr_expect_eq(num(j, "n_scored"), N - 2);
    size_t n;
    float *L = read_bytes(lp, &n);
    cr_assert_eq(n, (size_t)(N - 2) * NV * 4);
    double e_in = rel_err(L, ref + NV, (size_t)(m - 1) * NV);
    double e_cont = rel_err(L + (size_t)(m - 1) * NV, ref + (size_t)m * NV,
                            (size_t)(N - 1 - m) * NV);
    fprintf(stderr, "score qwen2: in-cache rows max rel err %.3g, continuation rows %.3g\n",
            e_in, e_cont);
    /* f16 weights round the activations to f16 before each product, which
     * turns the ~1e-7 of a query sitting in another cell into ~1e-4. */
    cr_expect_leq(e_in, 1e-3, "in-cache rows: rel err %g", e_in);
    cr_expect_leq(e_cont, TOL, "continuation rows: rel err %g", e_cont);
    /* --exact puts each query where the full forward has it: bit for bit,
     * with a generation from inside the cache on top. */
    const char *ax[] = { "score", "--tokens", tp, "--kv", kp, "--from", "1", "--logits-out", lp,
                         "--exact", "--generate", "50:6", NULL };
    cJSON *jx = run_ok(ax);
    float *LX = read_bytes(lp, &n);
    cr_assert_eq(n, (size_t)(N - 2) * NV * 4);
    double ex = rel_err(LX, ref + NV, (size_t)(N - 2) * NV);
    fprintf(stderr, "score qwen2 --exact, from 1: max rel err %.3g\n", ex);
    cr_expect_eq(ex, 0, "rel err %g", ex);
    int32_t g[6];
    plain_greedy(T, 50, 6, g);
    cJSON *gx = cJSON_GetArrayItem(cJSON_GetObjectItem(jx, "generated"), 0);
    cr_assert_eq(cJSON_GetArraySize(gx), 6);
    for (int i = 0; i < 6; i++)
        cr_expect_eq(cJSON_GetArrayItem(gx, i)->valueint, g[i], "token %d", i);
    free(LX);
    cJSON_Delete(jx);
    free(L);
    free(ref);
    free(k.b);
    cJSON_Delete(j);
}

/* ---- (3) generation from a cache = plain greedy ------------------------- */
Test(llama_score, generate_from_a_cache_is_plain_greedy)
{
    enum { N = 120, m = 80, G = 12 };
    int32_t T[N];
    tokens(T, N, 9);
    kvfile k = score_inputs(T, N, m);
    const int at[] = { 40, m - 1, m, 100, N - 1 };
    enum { NA = sizeof at / sizeof at[0] };
    char spec[256];
    size_t o = 0;
    for (int i = 0; i < NA; i++)
        o += (size_t)snprintf(spec + o, sizeof spec - o, "%s%d:%d", i ? "," : "", at[i], G);
    const char *a[] = { "score", "--tokens", tp, "--kv", kp, "--generate", spec, NULL };
    cJSON *j = run_ok(a);
    cJSON *gen = cJSON_GetObjectItem(j, "generated");
    cr_assert_eq(cJSON_GetArraySize(gen), NA, "%s", out_s);
    int32_t ref[NA][G];
    for (int i = 0; i < NA; i++) {
        plain_greedy(T, at[i], G, ref[i]);
        cJSON *g = cJSON_GetArrayItem(gen, i);
        cr_assert_eq(cJSON_GetArraySize(g), G);
        int same = 0;
        while (same < G && cJSON_GetArrayItem(g, same)->valueint == ref[i][same])
            same++;
        fprintf(stderr, "score (3) generate from %d: %d of %d tokens as plain greedy\n", at[i],
                same, G);
        cr_expect_eq(same, G, "from %d: %d of %d agree", at[i], same, G);
    }
    /* --stop-token: stops right after the first occurrence. */
    int32_t stop = ref[2][5];
    int want = 0;
    while (ref[2][want] != stop)
        want++;
    want++;
    char sp[64], st[32];
    snprintf(sp, sizeof sp, "%d:%d", at[2], G);
    snprintf(st, sizeof st, "%d", stop);
    const char *b[] = { "score", "--tokens", tp, "--kv", kp, "--generate", sp, "--stop-token", st,
                        NULL };
    cJSON *j2 = run_ok(b);
    cJSON *g2 = cJSON_GetArrayItem(cJSON_GetObjectItem(j2, "generated"), 0);
    cr_expect_eq(cJSON_GetArraySize(g2), want, "%s", out_s);
    cr_expect_eq(cJSON_GetArrayItem(g2, want - 1)->valueint, stop);
    free(k.b);
    cJSON_Delete(j);
    cJSON_Delete(j2);
}

/* ---- gaps and other dtypes ------------------------------------------------ */
static float h2f(uint16_t h)
{
    uint32_t sg = (uint32_t)(h >> 15) << 31, ex = (h >> 10) & 31, mt = h & 1023, f;
    if (ex == 0) {
        float v = (float)mt * 5.9604644775390625e-8f;
        return sg ? -v : v;
    }
    f = ex == 31 ? sg | 0x7f800000u | (mt << 13) : sg | ((ex + 112) << 23) | (mt << 13);
    float v;
    memcpy(&v, &f, 4);
    return v;
}

/* Cached positions with a gap: in-cache row i (cells 0..i-1 visible; --exact,
 * so T[i] sits in cell i) equals, bit for bit, the continuation row of a
 * cache holding exactly cells 0..i-1 with T[i] at positions[i]; right after
 * the gap that needs P > max + 1, elsewhere it is llama.cpp's plain decode.
 * Batched in-cache rows agree to float rounding. (The keys are not rotated
 * for these positions: this checks which cells each row sees, not RoPE.) */
Test(llama_score, position_gaps_see_the_right_cells)
{
    enum { N = 90, m = 70, GAP = 10 };
    int32_t T[N];
    tokens(T, N, 21);
    char tp2[400], kp2[400], lp2[400];
    path(tp2, sizeof tp2, "t2.bin");
    path(kp2, sizeof kp2, "kv2.bin");
    path(lp2, sizeof lp2, "l2.bin");
    write_bytes(tp, T, sizeof T);
    kvfile k = kv_of_llama(T, m, 0);
    int64_t *pos = (int64_t *)(void *)(k.b + 32);
    for (int i = 30; i < m; i++)
        pos[i] += GAP;                       /* 0..29, 40..79 */
    write_bytes(kp, k.b, k.len);
    const char *a[] = { "score", "--tokens", tp, "--kv", kp, "--from", "0", "--logits-out", lp,
                        "--exact", NULL };
    cJSON *j = run_ok(a);
    cr_expect_eq(num(j, "next_pos"), 80);
    size_t n;
    float *L = read_bytes(lp, &n);
    cr_assert_eq(n, (size_t)(N - 1) * NV * 4);
    const char *ab[] = { "score", "--tokens", tp, "--kv", kp, "--from", "0", "--logits-out",
                         lp2, NULL };
    cJSON *jb = run_ok(ab);
    float *LB = read_bytes(lp2, &n);
    double eb = rel_err(LB, L, (size_t)(N - 1) * NV);
    fprintf(stderr, "score gaps: batched vs --exact rows: max rel err %.3g\n", eb);
    cr_expect_leq(eb, TOL, "rel err %g", eb);
    free(LB);
    cJSON_Delete(jb);
    size_t row = (size_t)NKV * HD * 2;
    const int rows[] = { 30, 35, 69 };
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        int i = rows[r];
        /* A cache of cells 0..i-1 only, T[0..i+2), --from i --next-pos positions[i]. */
        size_t pl = (size_t)NL * 2 * (size_t)i * row;
        uint8_t *p = malloc(pl);
        const uint8_t *src = k.b + 32 + 8 * (size_t)m;
        for (int l = 0; l < 2 * NL; l++)
            memcpy(p + (size_t)l * i * row, src + (size_t)l * m * row, (size_t)i * row);
        kvfile k2 = kv_make((uint32_t)NL, (uint32_t)i, (uint32_t)NKV, (uint32_t)HD, 1, pos, p, pl);
        write_bytes(kp2, k2.b, k2.len);
        write_bytes(tp2, T, (size_t)(i + 2) * 4);
        char np[32];
        snprintf(np, sizeof np, "%lld", (long long)pos[i]);
        const char *b[] = { "score", "--tokens", tp2, "--kv", kp2, "--next-pos", np,
                            "--logits-out", lp2, NULL };
        cJSON *j2 = run_ok(b);
        cr_expect_eq(num(j2, "n_scored"), 1);
        float *L2 = read_bytes(lp2, &n);
        cr_assert_eq(n, (size_t)NV * 4);
        double e = rel_err(L + (size_t)i * NV, L2, (size_t)NV);
        fprintf(stderr, "score gaps: in-cache row %d vs a cache of its %d cells: rel err %.3g\n",
                i, i, e);
        cr_expect_eq(e, 0, "row %d: rel err %g", i, e);
        free(L2);
        free(p);
        free(k2.b);
        cJSON_Delete(j2);
    }
    /* A continuation P past max + 1 is accepted too. */
    const char *c[] = { "score", "--tokens", tp, "--kv", kp, "--next-pos", "500", NULL };
    cJSON *j3 = run_ok(c);
    cr_expect_eq(num(j3, "next_pos"), 500);
    cr_expect_eq(num(j3, "n_scored"), N - 1 - m);
    free(L);
    free(k.b);
    cJSON_Delete(j);
    cJSON_Delete(j3);
}

/* f32 and bf16 files run in a cache of that type. With flash attention
 * llama.cpp casts f32 K and V to f16 for the attention (llama-graph.cpp), so
 * an f32 file holding llama.cpp's f16 values gives the f16 run's rows (0 seen);
 * bf16 rounds the values and takes the other attention kernel (~2e-3). */
Test(llama_score, f32_and_bf16_caches)
{
    enum { N = 100, m = 70 };
    int32_t T[N];
    tokens(T, N, 4);
    char lp16[400];
    path(lp16, sizeof lp16, "l16.bin");
    kvfile k = score_inputs(T, N, m);
    const char *a16[] = { "score", "--tokens", tp, "--kv", kp, "--from", "1", "--logits-out",
                          lp16, NULL };
    cJSON *j = run_ok(a16);
    cr_expect_str_eq(cJSON_GetObjectItem(j, "cache_type")->valuestring, "f16");
    cJSON_Delete(j);
    size_t n;
    float *L16 = read_bytes(lp16, &n);
    size_t ne = (size_t)NL * 2 * m * NKV * HD;
    const uint16_t *h = (const uint16_t *)(const void *)(k.b + 32 + 8 * (size_t)m);
    for (int dt = 0; dt <= 2; dt += 2) {
        size_t el = dt == 0 ? 4 : 2;
        uint8_t *p = malloc(ne * el);
        for (size_t i = 0; i < ne; i++) {
            float v = h2f(h[i]);
            if (dt == 0) {
                memcpy(p + 4 * i, &v, 4);
            } else {
                uint32_t u;
                memcpy(&u, &v, 4);
                uint16_t b = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
                memcpy(p + 2 * i, &b, 2);
            }
        }
        kvfile w = kv_make((uint32_t)NL, m, (uint32_t)NKV, (uint32_t)HD, (uint32_t)dt,
                           (const int64_t *)(const void *)(k.b + 32), p, ne * el);
        write_bytes(kp, w.b, w.len);
        const char *a[] = { "score", "--tokens", tp, "--kv", kp, "--from", "1", "--logits-out",
                            lp, NULL };
        j = run_ok(a);
        cr_expect_str_eq(cJSON_GetObjectItem(j, "cache_type")->valuestring,
                         dt == 0 ? "f32" : "bf16");
        float *L = read_bytes(lp, &n);
        cr_assert_eq(n, (size_t)(N - 2) * NV * 4);
        double e = rel_err(L, L16, (size_t)(N - 2) * NV);
        fprintf(stderr, "score %s cache vs f16: max rel err %.3g\n", dt == 0 ? "f32" : "bf16", e);
        cr_expect_leq(e, dt == 0 ? TOL : 0.05, "rel err %g", e);
        free(L);
        free(p);
        free(w.b);
        cJSON_Delete(j);
    }
    free(L16);
    free(k.b);
}

/* ---- (4) refusals ------------------------------------------------------- */
/* args refused: exit 1, a message naming msg, no logits file at lp. */
static void expect_refused(const char *const *args, const char *msg)
{
    int rc = run(false, args);
    cr_expect_eq(rc, 1, "exit %d for '%s': %s", rc, msg, err_s);
    cr_expect(strstr(err_s, msg) != NULL, "message names '%s': %s", msg, err_s);
    struct stat sb;
    cr_expect(stat(lp, &sb) != 0, "no logits file after a refusal (%s)", msg);
}

Test(llama_score, bad_inputs_are_refused)
{
    enum { N = 40, m = 20 };
    int32_t T[N];
    tokens(T, N, 3);
    char bp[400];
    path(bp, sizeof bp, "bad.bin");
    write_bytes(tp, T, sizeof T);
    size_t row = (size_t)NKV * HD * 2, pl_len = (size_t)NL * 2 * m * row;
    uint8_t *pl = calloc(1, pl_len);
    int64_t pos[m];
    for (int i = 0; i < m; i++)
        pos[i] = i;
    const char *a[] = { "score", "--tokens", tp, "--kv", kp, "--from", "1", "--logits-out", lp,
                        NULL };
    const char *dflt[] = { "score", "--tokens", tp, "--kv", kp, "--logits-out", lp, NULL };

    /* The good file first: it is accepted. */
    kvfile k = kv_make((uint32_t)NL, m, (uint32_t)NKV, (uint32_t)HD, 1, pos, pl, pl_len);
    write_bytes(kp, k.b, k.len);
    cr_assert_eq(run(false, a), 0, "%s", err_s);
    unlink(lp);

    k.b[0] = 'X';
    write_bytes(kp, k.b, k.len);
    expect_refused(a, "magic");
    k.b[0] = 'K';
    write_bytes(kp, k.b, k.len - 1);
    expect_refused(a, "truncated");
    write_bytes(kp, k.b, 20);
    expect_refused(a, "truncated");
    uint8_t *big = calloc(1, k.len + 3);
    memcpy(big, k.b, k.len);
    write_bytes(kp, big, k.len + 3);
    expect_refused(a, "3 trailing bytes");
    free(big);
    free(k.b);

    struct { uint32_t nl, nkv, hd, dt; const char *msg; } shapes[] = {
        { (uint32_t)NL + 1, (uint32_t)NKV, (uint32_t)HD, 1, "layers" },
        { (uint32_t)NL, (uint32_t)NKV * 2, (uint32_t)HD / 2, 1, "KV heads" },
        { (uint32_t)NL, (uint32_t)NKV, (uint32_t)HD * 2, 1, "head_dim" },
        { (uint32_t)NL, (uint32_t)NKV, (uint32_t)HD, 7, "dtype" },
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        size_t len = (size_t)shapes[i].nl * 2 * m * shapes[i].nkv * shapes[i].hd * 2;
        uint8_t *p = calloc(1, len);
        kvfile w = kv_make(shapes[i].nl, m, shapes[i].nkv, shapes[i].hd, shapes[i].dt, pos, p,
                           len);
        write_bytes(kp, w.b, w.len);
        expect_refused(a, shapes[i].msg);
        free(w.b);
        free(p);
    }
    /* A huge token count in a small file. */
    k = kv_make((uint32_t)NL, m, (uint32_t)NKV, (uint32_t)HD, 1, pos, pl, pl_len);
    uint32_t huge = 0xffffffffu;
    memcpy(k.b + 12, &huge, 4);
    write_bytes(kp, k.b, k.len);
    expect_refused(a, "truncated");
    /* Negative position. */
    memcpy(k.b + 12, &(uint32_t){ m }, 4);
    int64_t neg = -5;
    memcpy(k.b + 32 + 8 * 3, &neg, 8);
    write_bytes(kp, k.b, k.len);
    expect_refused(a, "out of range");
    free(k.b);

    /* Positions not strictly increasing: refused for in-cache scoring,
     * fine for the continuation (an APE layout repeats positions). */
    int64_t ape[m];
    for (int i = 0; i < m; i++)
        ape[i] = i < 10 ? i : i - 5;
    k = kv_make((uint32_t)NL, m, (uint32_t)NKV, (uint32_t)HD, 1, ape, pl, pl_len);
    write_bytes(kp, k.b, k.len);
    expect_refused(a, "strictly increasing");
    cJSON *j = run_ok(dflt);
    cr_expect_eq(num(j, "next_pos"), 15, "max position + 1");
    cr_expect_eq(num(j, "n_scored"), N - 1 - m);
    cJSON_Delete(j);
    unlink(lp);
    const char *g[] = { "score", "--tokens", tp, "--kv", kp, "--generate", "5:3", NULL };
    expect_refused(g, "strictly increasing");
    free(k.b);

    /* More cached tokens than tokens. */
    int32_t few[10];
    tokens(few, 10, 3);
    write_bytes(bp, few, sizeof few);
    k = kv_make((uint32_t)NL, m, (uint32_t)NKV, (uint32_t)HD, 1, pos, pl, pl_len);
    write_bytes(kp, k.b, k.len);
    const char *c[] = { "score", "--tokens", bp, "--kv", kp, "--logits-out", lp, NULL };
    expect_refused(c, "more than");
    free(k.b);

    /* Token files: an id past the vocabulary, a partial id, none at all. */
    int32_t badt[N];
    memcpy(badt, T, sizeof T);
    badt[7] = NV;
    write_bytes(bp, badt, sizeof badt);
    const char *d[] = { "score", "--tokens", bp, "--logits-out", lp, NULL };
    expect_refused(d, "vocabulary");
    badt[7] = -1;
    write_bytes(bp, badt, sizeof badt);
    expect_refused(d, "vocabulary");
    write_bytes(bp, T, 10);
    expect_refused(d, "whole number");
    write_bytes(bp, T, 0);
    expect_refused(d, "no tokens");

    /* Options out of range. */
    const char *e1[] = { "score", "--tokens", tp, "--from", "41", NULL };
    expect_refused(e1, "--from");
    const char *e2[] = { "score", "--tokens", tp, "--generate", "40:3", NULL };
    expect_refused(e2, "past the last token");
    char sv[32];
    snprintf(sv, sizeof sv, "%d", NV);
    const char *e3[] = { "score", "--tokens", tp, "--generate", "3:3", "--stop-token", sv, NULL };
    expect_refused(e3, "vocabulary");
    /* Usage and missing files: the worker's other exit codes. */
    const char *u[] = { "score", NULL };
    cr_expect_eq(run(false, u), 2);
    const char *u2[] = { "score", "--tokens", tp, "--generate", "3", NULL };
    cr_expect_eq(run(false, u2), 2);
    char missing[400];
    path(missing, sizeof missing, "nope.bin");
    const char *f1[] = { "score", "--tokens", tp, "--kv", missing, NULL };
    cr_expect_eq(run(false, f1), 3);
    cr_expect(strstr(err_s, "KV file") != NULL, "%s", err_s);
    /* --json failures are JSON. */
    write_bytes(bp, T, 10);
    cr_expect_eq(run(true, d), 1);
    cJSON *je = cJSON_Parse(out_s);
    cr_assert_not_null(je, "%s", out_s);
    cr_expect(strstr(cJSON_GetObjectItem(je, "error")->valuestring, "whole number") != NULL);
    cJSON_Delete(je);
    free(pl);
}

/* --kv-out: the KV llama.cpp computed for the appended tokens, as a KV.bin:
 * byte for byte what llama.cpp's own state holds for them, with no cache
 * and after a cache (there: the appended rows of a full decode's state).
 * Refused when nothing follows the cache. */
Test(llama_score, kv_out_is_llamas_own_kv)
{
    enum { N = 160, m = 100 };
    int32_t T[N];
    tokens(T, N, 11);
    char op[400];
    path(op, sizeof op, "kvo.bin");
    /* No cache: the KV of T[0..m) equals kv_of_llama's. */
    write_bytes(tp, T, (size_t)m * 4);
    const char *a[] = { "score", "--tokens", tp, "--kv-out", op, NULL };
    cJSON *j = run_ok(a);
    size_t n;
    uint8_t *got = read_bytes(op, &n);
    kvfile want = kv_of_llama(T, m, 0);
    cr_assert_eq(n, want.len);
    cr_expect_eq(memcmp(got, want.b, n), 0, "--kv-out differs from llama.cpp's state");
    free(got);
    cJSON_Delete(j);
    /* After a cache of T[0..m): the KV of T[m..N) at positions m.., the
     * rows llama.cpp's state of a full decode of T holds for them. */
    write_bytes(kp, want.b, want.len);
    write_bytes(tp, T, sizeof T);
    const char *b[] = { "score", "--tokens", tp, "--kv", kp, "--kv-out", op, NULL };
    j = run_ok(b);
    got = read_bytes(op, &n);
    kvfile whole = kv_of_llama(T, N, 0);
    size_t row = (size_t)(NKV * HD) * 2;
    cr_assert_eq(n, 32 + 8 * (size_t)(N - m) + (size_t)NL * 2 * (N - m) * row);
    const int64_t *pos = (const int64_t *)(got + 32);
    for (int i = 0; i < N - m; i++)
        cr_expect_eq(pos[i], m + i);
    const uint8_t *pw = whole.b + 32 + 8 * (size_t)N, *pg = got + 32 + 8 * (size_t)(N - m);
    for (int l = 0; l < 2 * NL; l++)        /* layer l/2, K (even) or V (odd) */
        cr_expect_eq(memcmp(pg + (size_t)l * (N - m) * row, pw + ((size_t)l * N + m) * row,
                            (size_t)(N - m) * row), 0, "layer side %d", l);
    free(got);
    cJSON_Delete(j);
    /* Nothing after the cache: refused, no file. */
    write_bytes(tp, T, (size_t)m * 4);
    unlink(op);
    const char *c[] = { "score", "--tokens", tp, "--kv", kp, "--kv-out", op, NULL };
    cr_expect_eq(run(false, c), 1);
    cr_expect(strstr(err_s, "no tokens after the cache") != NULL, "%s", err_s);
    cr_expect_eq(access(op, F_OK), -1);
    free(want.b);
    free(whole.b);
}
