/*
 * bench_llama.c — kvrope as llama.cpp's KV cache, on a model of a realistic
 * CPU shape (16 layers, width 2048, 32 heads, 8 KV heads, head_dim 64, ffn
 * 5632, f16 weights: 0.7 B parameters, written once by scripts/gen-gguf.py
 * into $KVR_BUILD/llama-models/ and reused), so that prefill is compute-bound.
 *
 *  1. Time to first token on a 2,048-token prompt: build/kvrope-llama
 *     complete, cold (full prefill) and then warm in fresh processes (match +
 *     fetch + set_data + one decode). Goal: warm >= 50x faster.
 *  2. A one-line edit in the middle of that 2,048-token file:
 *     kvrope-llama edit (fetch with keys re-rotated, set_data, decode of the
 *     new tokens, the last token for its logits) against a full re-prefill of
 *     the new file in the same process (--check), goal >= 10x; and against
 *     llama.cpp's own path in this process (the old file's KV in its cache:
 *     seq_rm of the old line, seq_add of the suffix, decode of the new line,
 *     the last token again for the next-token logits), goal: no slower.
 *
 * Timings come from the worker's --json reports and from this process; each
 * figure is the median of three runs (edits: five, the two paths interleaved
 * so that both see the same load). Never asserted: `make bench` prints.
 */
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
#include "tests/common/kvr_llama_bench.h"
#include "tests/common/kvr_testd.h"
#include "tests/common/kvt_bench.h"

/* The worker's parts come from build/lib/libworker.a (client/llama/llama.mk). */

#define N_PROMPT 2048
#define THREADS  "2"

static kvr_testd D;


static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(const double *x, int n)
{
    double v[16];
    for (int i = 0; i < n && i < 16; i++)
        v[i] = x[i];
    qsort(v, (size_t)n, sizeof v[0], cmp_d);
    return v[n / 2];
}

static double median3(double a, double b, double c)
{
    double v[3] = { a, b, c };
    qsort(v, 3, sizeof v[0], cmp_d);
    return v[1];
}



static const char *jstr(const cJSON *j, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return cJSON_IsString(v) ? v->valuestring : "";
}


/* A 2,047-byte C file (2,048 tokens with BOS) from the project's own sources. */
static int write_prompt(const char *path, char *text, size_t *len)
{
    const char *srcs[] = { "cache/store.c", "cache/layout.c", "daemon/conn.c", "rope/rope.c" };
    size_t n = 0;
    for (size_t i = 0; i < 4 && n < N_PROMPT - 1; i++) {
        FILE *f = fopen(srcs[i], "rb");
        if (!f)
            continue;
        n += fread(text + n, 1, N_PROMPT - 1 - n, f);
        fclose(f);
    }
    for (; n < N_PROMPT - 1; n++)
        text[n] = "int x;\n"[n % 7];
    text[n] = 0;
    *len = n;
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(text, 1, n, f) != n) {
        if (f)
            fclose(f);
        return -1;
    }
    return fclose(f);
}

/* The old file with one line inserted at the first line break past the middle. */
static size_t edit_text(const char *old, size_t n, char *out, size_t *at, size_t *ins)
{
    const char *line = "    kvr_debug_check(store, \"after the split\");\n";
    const char *mid = memchr(old + n / 2, '\n', n - n / 2);
    size_t cut = mid ? (size_t)(mid - old) + 1 : n / 2;
    memcpy(out, old, cut);
    memcpy(out + cut, line, strlen(line));
    memcpy(out + cut + strlen(line), old + cut, n - cut);
    *at = cut;
    *ins = strlen(line);
    return n + strlen(line);
}

static void quiet_log(enum ggml_log_level level, const char *text, void *ud)
{
    (void)ud;
    if (level == GGML_LOG_LEVEL_ERROR)
        fputs(text, stderr);
}

/* llama.cpp's own edit path in this process: the old file's KV in the
 * cache (set from kvrope, untimed), then seq_rm + seq_add + decode of the
 * new line (through seq 1: llama.cpp decodes a sequence only after its last
 * position) + the last token again for the next-token logits. */
typedef struct own {
    struct llama_model   *m;
    struct llama_context *lc;
    struct llama_batch    b;
    kvr__wk_sbuild         sb;       /* the old file's state */
    int32_t              *tok;      /* the new file's tokens */
    int32_t               n_tok, p, n_ins;
    bool                  ok;
} own;

static int own_setup(own *o, const char *model, const char *ctx, size_t n_old, const char *neu,
                     size_t n_new, size_t at, size_t ins)
{
    memset(o, 0, sizeof *o);
    llama_log_set(quiet_log, NULL);
    ggml_backend_load_all_from_path(KVR_LLAMA_LIBDIR);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.load_mode = LLAMA_LOAD_MODE_NONE;      /* as the worker loads it */
    if (!(o->m = llama_model_load_from_file(model, mp)))
        return -1;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_seq_max = 2;
    cp.kv_unified = true;
    cp.n_threads = cp.n_threads_batch = atoi(THREADS);
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.no_perf = true;
    if (!(o->lc = llama_init_from_model(o->m, cp)))
        return -1;
    const struct llama_vocab *voc = llama_model_get_vocab(o->m);
    o->tok = malloc((n_new + 8) * sizeof *o->tok);
    o->n_tok = llama_tokenize(voc, neu, (int32_t)n_new, o->tok, (int32_t)n_new + 8, true, false);
    /* One token per byte plus BOS: the new line is tokens [at+1, at+1+ins). */
    o->p = (int32_t)at + 1;
    o->n_ins = (int32_t)ins;
    o->b = llama_batch_init(512, 0, 2);
    kvr_client *c = testd_connect(&D);
    kvr_kv kv;
    kvr_get_args g = { .ctx_id = ctx, .dtype = KVR_DTYPE_F16 };
    int r = -1;
    if (c && o->n_tok == (int)n_new + 1 && kvr_client_get(c, &g, &kv) == 0) {
        if (kv.n_tokens == n_old + 1 &&
            kvr__wk_sbuild_init(&o->sb, (uint32_t)kv.n_tokens, (uint32_t)kv.n_layers,
                               KVR_WK_GGML_F16, kv.n_kv_heads * kv.head_dim, false) == 0 &&
            kvr__wk_sbuild_add(&o->sb, kv.payload, kv.n_tokens, 0, kv.n_tokens, kv.positions) == 0)
            r = 0;
        kvr_kv_release(&kv);
    }
    kvr_client_close(c);
    /* A throw-away decode, as the worker does. */
    if (r == 0) {
        struct llama_batch b1 = llama_batch_get_one(o->tok, 1);
        r = llama_decode(o->lc, b1) == 0 ? 0 : -1;
    }
    o->ok = r == 0;
    return r;
}

static double own_run(own *o)
{
    if (!o->ok)
        return (double)NAN;
    llama_memory_t mem = llama_get_memory(o->lc);
    llama_memory_clear(mem, true);
    if (llama_state_seq_set_data(o->lc, o->sb.buf, o->sb.len, 0) == 0)
        return (double)NAN;
    struct llama_batch *b = &o->b;
    int32_t p = o->p, n_ins = o->n_ins, n_tok = o->n_tok;
    double t0 = llb_now_ms();
    /* An insertion: nothing removed; the suffix moves by +ins. */
    llama_memory_seq_rm(mem, 0, p, p);
    llama_memory_seq_add(mem, 0, p, -1, n_ins);
    llama_memory_seq_cp(mem, 0, 1, 0, p);
    b->n_tokens = n_ins;
    for (int i = 0; i < n_ins; i++) {
        b->token[i] = o->tok[p + i];
        b->pos[i] = p + i;
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = 1;
        b->logits[i] = 0;
    }
    if (llama_decode(o->lc, *b) != 0)
        return (double)NAN;
    llama_memory_seq_cp(mem, 1, 0, p, p + n_ins);
    llama_memory_seq_rm(mem, 1, -1, -1);
    llama_memory_seq_rm(mem, 0, n_tok - 1, -1);
    b->n_tokens = 1;
    b->token[0] = o->tok[n_tok - 1];
    b->pos[0] = n_tok - 1;
    b->seq_id[0][0] = 0;
    b->logits[0] = 1;
    if (llama_decode(o->lc, *b) != 0)
        return (double)NAN;
    return llama_get_logits_ith(o->lc, 0) ? llb_now_ms() - t0 : (double)NAN;
}

static void own_free(own *o)
{
    if (o->lc) {
        llama_batch_free(o->b);
        llama_free(o->lc);
    }
    if (o->m)
        llama_model_free(o->m);
    kvr__wk_sbuild_free(&o->sb);
    free(o->tok);
}

static void goal(const char *what, double v, double target)
{
    kvt_goal(isfinite(v) && v >= target, "%s >= %gx: %.2fx", what, target, v);
}

int main(void)
{
    char model[1024];
    if (llb_begin(model, sizeof model, &D) < 0)
        return 1;
    int rc = 1;
    char p_old[400], p_new[400];
    snprintf(p_old, sizeof p_old, "%s/old.c", D.dir);
    snprintf(p_new, sizeof p_new, "%s/new.c", D.dir);
    static char old[N_PROMPT + 8], neu[N_PROMPT + 256];
    size_t n_old, at, ins;
    if (write_prompt(p_old, old, &n_old) < 0)
        goto out;
    size_t n_new = edit_text(old, n_old, neu, &at, &ins);
    FILE *f = fopen(p_new, "wb");
    if (!f || fwrite(neu, 1, n_new, f) != n_new) {
        if (f)
            fclose(f);
        goto out;
    }
    fclose(f);

    printf("## llama.cpp with kvrope as its KV cache (16 layers, width 2048, 32 heads / 8 KV "
           "heads, f16; %s threads; 2,048-token prompt; 32 KiB of KV per token)\n\n", THREADS);
    /* 1. Time to first token. */
    const char *cold_a[] = { "complete", "--prompt-file", p_old, "--n", "1", NULL };
    cJSON *cold = llb_worker(D.sock, model, cold_a);
    if (!cold)
        goto out;
    double t_prefill = llb_jnum(cold, "timings_ms", "prefill");
    char ctx[KVR_ID_MAX + 1];
    snprintf(ctx, sizeof ctx, "%s", jstr(cold, "stored_in"));
    double hit[3], fetch[3], load[3], dec[3], pf[3];
    for (int i = 0; i < 3; i++) {
        cJSON *w = llb_worker(D.sock, model, cold_a);
        if (!w)
            goto out;
        hit[i] = llb_jnum(w, "timings_ms", "first_token");
        fetch[i] = llb_jnum(w, "timings_ms", "fetch");
        load[i] = llb_jnum(w, "timings_ms", "load");
        dec[i] = llb_jnum(w, "timings_ms", "prefill");
        pf[i] = llb_jnum(w, "timings_ms", "prefault");
        if (llb_jnum(w, NULL, "reused_tokens") != N_PROMPT - 1)
            fprintf(stderr, "bench_llama: warm run reused %g tokens\n",
                    llb_jnum(w, NULL, "reused_tokens"));
        cJSON_Delete(w);
    }
    double t_hit = median3(hit[0], hit[1], hit[2]);
    printf("| time to first token, 2,048 tokens | ms |\n|---|---|\n");
    printf("| full prefill (llama.cpp, cold worker) | %.0f |\n", t_prefill);
    printf("| kvrope hit: match + fetch + set_data + 1 decode | %.1f |\n", t_hit);
    printf("| of which fetch (64 MiB over the socket) / set_data / decode | %.1f / %.1f / %.1f |\n",
           median3(fetch[0], fetch[1], fetch[2]), median3(load[0], load[1], load[2]),
           median3(dec[0], dec[1], dec[2]));
    printf("| before it, in a fresh worker process: first touch of its 128 MiB of buffers "
           "(prefault, untimed above; runs: %.0f %.0f %.0f) | %.1f |\n\n", pf[0], pf[1], pf[2],
           median3(pf[0], pf[1], pf[2]));

    /* 2. A one-line edit in the middle: the worker's path and llama.cpp's
     * own, interleaved so that both see the same load on a shared machine. */
    own ow;
    if (own_setup(&ow, model, ctx, n_old, neu, n_new, at, ins) < 0)
        fprintf(stderr, "bench_llama: llama.cpp own-path setup failed\n");
    enum { PAIRS = 5 };
    double ed[PAIRS], edc[PAIRS], edt[PAIRS], ownt[PAIRS], full = (double)NAN;
    double ph[PAIRS][6];      /* fetch, load, decode, last token, the rest, prefault */
    double agree = (double)NAN, err = (double)NAN;
    for (int i = 0; i < PAIRS; i++) {
        const char *a1[] = { "edit", "--old", p_old, "--new", p_new, "--n", "1",
                             i == 0 ? "--check" : NULL, NULL };
        cJSON *e = llb_worker(D.sock, model, a1);
        if (!e)
            goto out;
        ed[i] = llb_jnum(e, "timings_ms", "first_token");
        edt[i] = llb_jnum(e, "timings_ms", "edit_total");
        ph[i][0] = llb_jnum(e, "timings_ms", "fetch");
        ph[i][1] = llb_jnum(e, "timings_ms", "load");
        ph[i][2] = llb_jnum(e, "timings_ms", "decode");
        ph[i][3] = llb_jnum(e, "timings_ms", "last_token");
        ph[i][4] = ed[i] - ph[i][0] - ph[i][1] - ph[i][2] - ph[i][3];
        ph[i][5] = llb_jnum(e, "timings_ms", "prefault");
        edc[i] = ed[i] + ph[i][5];
        if (i == 0) {
            full = llb_jnum(e, "check", "full_ms");
            const cJSON *chk = cJSON_GetObjectItemCaseSensitive(e, "check");
            agree = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(chk, "next_token_agrees"));
            err = llb_jnum(e, "check", "logit_max_abs_err");
            printf("edit: %g op(s), %g tokens inserted, %g decoded, %g reused from kvrope, "
                   "%g approximate\n", llb_jnum(e, NULL, "edit_ops"), llb_jnum(e, NULL, "inserted_tokens"),
                   llb_jnum(e, NULL, "computed_tokens"), llb_jnum(e, NULL, "reused_tokens"),
                   llb_jnum(e, NULL, "approximate_tokens"));
        }
        cJSON_Delete(e);
        ownt[i] = own_run(&ow);
    }
    own_free(&ow);
    printf("runs (kvrope-llama edit / llama.cpp own path, ms):");
    for (int i = 0; i < PAIRS; i++)
        printf(" %.0f/%.0f", ed[i], ownt[i]);
    printf("\nkvrope-llama edit phases (ms: fetch / set_data / decode new / last token / rest; "
           "before it, prefault of its fresh buffers):");
    for (int i = 0; i < PAIRS; i++)
        printf(" %.0f/%.0f/%.0f/%.0f/%.0f; %.0f", ph[i][0], ph[i][1], ph[i][2], ph[i][3], ph[i][4],
               ph[i][5]);
    printf("\n");
    double t_edit = median(ed, PAIRS), t_edit_all = median(edt, PAIRS);
    double t_own = median(ownt, PAIRS), t_edit_cold = median(edc, PAIRS);
    printf("\n| one-line edit (%zu bytes inserted at byte %zu of 2,047), to the next token | ms | "
           "vs kvrope-llama edit |\n|---|---|---|\n", ins, at);
    printf("| kvrope-llama edit (fetch re-rotated + set_data + decode new + last token) | %.0f | 1.0x |\n",
           t_edit);
    printf("| ... in a fresh process: + first touch of its 128 MiB of buffers (prefault) | %.0f | "
           "%.2fx |\n", t_edit_cold, t_edit_cold / t_edit);
    printf("| ... and storing the new KV back (edit with KV) | %.0f | %.2fx |\n", t_edit_all,
           t_edit_all / t_edit);
    printf("| full re-prefill of the new file | %.0f | %.1fx |\n", full, full / t_edit);
    printf("| llama.cpp in-process: seq_rm + seq_add + decode new + last token | %.0f | %.2fx |\n\n",
           t_own, t_own / t_edit);
    printf("edit check: next token %s a full re-encode's, max logit error %.4g\n\n",
           agree == 1 ? "agrees with" : "differs from", err);

    goal("time to first token: kvrope hit vs full prefill", t_prefill / t_hit, 50);
    goal("one-line edit: kvrope-llama edit vs full re-prefill", full / t_edit, 10);
    goal("one-line edit: kvrope-llama edit vs llama.cpp's own seq_rm+seq_add+decode "
         "(to the next token; 1x = no slower)", t_own / t_edit, 1);
    printf("(llama.cpp's path runs in this warm process, its KV memory faulted in by an untimed "
           "set_data; the worker's figure above excludes its buffers' first touch likewise; with "
           "it, a fresh worker process: %.2fx)\n", t_own / t_edit_cold);
    rc = 0;
    cJSON_Delete(cold);
out:
    unlink(p_old);
    unlink(p_new);
    testd_stop(&D);
    return rc;
}
