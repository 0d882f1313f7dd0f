/*
 * test_llama_worker.c — build/kvrope-llama end to end: a real kvroped on a
 * temporary socket, models written by scripts/gen-gguf.py, the worker run
 * as a separate process with --json for every flow (so every cache hit
 * crosses a process boundary), plus its token diff on its own.
 *
 * What is asserted is behaviour (what was reused, computed and stored; that
 * a cached run's tokens equal an uncached run's; that --check compares with
 * a full encode and reports finite figures), never timings.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "client/llama/worker.h"
#include "tests/common/kvr_llama_run.h"
#include "tests/common/kvr_testd.h"

/* The worker's parts come from build/lib/libworker.a (client/llama/llama.mk). */

/* ---- fixtures ------------------------------------------------------------ */
static kvr_testd D;
static char dir[256], model[320];

static void gen_model(const char *path, const char *args)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s -o %s %s", KVR_LLAMA_GEN_GGUF, path, args);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

static void setup(void)
{
    cr_assert_eq(testd_start(&D, NULL), 0, "kvroped starts");
    snprintf(dir, sizeof dir, "%s", D.dir);
    snprintf(model, sizeof model, "%s/m.gguf", dir);
    gen_model(model, "--arch llama --layers 2 --width 128 --heads 4 --kv-heads 2 --seed 7");
}

static void teardown(void)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -f %s/*.gguf %s/*.txt", dir, dir);
    if (system(cmd)) {
    }
    testd_stop(&D);
}

/* llama_worker: the worker's flows, each against its own daemon and model;
 * llama_worker_parts (at the end): its parts on their own, no fixture. */
TestSuite(llama_worker, .init = setup, .fini = teardown, .timeout = 600);

static void write_file(const char *name, const char *text, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

/* Runs build/kvrope-llama with args (NULL-ended), stdout into out. Returns
 * the exit status. */
static int worker(char *out, size_t cap, const char *const *args)
{
    int rc = kvr_llama_run(out, cap, args);
    cr_assert_geq(rc, 0, "kvrope-llama died: %s", out);
    return rc;
}

static char outbuf[1 << 20];

/* Runs a command that must succeed with --json and returns its object. */
static cJSON *run_json(const char *const *args)
{
    const char *argv[64];
    kvr_llama_json_argv(argv, model, D.sock, "2", args);
    int rc = worker(outbuf, sizeof outbuf, argv);
    cr_assert_eq(rc, 0, "kvrope-llama %s exits 0 (got %d): %s", args[0], rc, outbuf);
    cJSON *j = cJSON_Parse(outbuf);
    cr_assert_not_null(j, "JSON output: %s", outbuf);
    return j;
}

static double num(const cJSON *j, const char *group, const char *key)
{
    const cJSON *g = group ? cJSON_GetObjectItemCaseSensitive(j, group) : j;
    const cJSON *v = g ? cJSON_GetObjectItemCaseSensitive(g, key) : NULL;
    cr_assert(cJSON_IsNumber(v) || cJSON_IsBool(v), "field %s%s%s in the report", group ? group : "",
              group ? "." : "", key);
    return cJSON_IsBool(v) ? (cJSON_IsTrue(v) ? 1 : 0) : v->valuedouble;
}

static const char *str(const cJSON *j, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    cr_assert(cJSON_IsString(v), "field %s", key);
    return v->valuestring;
}

static bool same_tokens(const cJSON *a, const cJSON *b)
{
    const cJSON *ta = cJSON_GetObjectItemCaseSensitive(a, "tokens");
    const cJSON *tb = cJSON_GetObjectItemCaseSensitive(b, "tokens");
    if (cJSON_GetArraySize(ta) != cJSON_GetArraySize(tb) || cJSON_GetArraySize(ta) == 0)
        return false;
    for (int i = 0; i < cJSON_GetArraySize(ta); i++)
        if (cJSON_GetArrayItem(ta, i)->valueint != cJSON_GetArrayItem(tb, i)->valueint)
            return false;
    return true;
}

/* Some few hundred bytes of C (one token per byte with the generated vocab). */
static const char *SRC =
    "/* ring buffer */\n"
    "struct ring { unsigned head, tail, cap; int *buf; };\n"
    "static int ring_push(struct ring *r, int v)\n"
    "{\n"
    "    if (r->head - r->tail == r->cap)\n"
    "        return -1;\n"
    "    r->buf[r->head++ % r->cap] = v;\n"
    "    return 0;\n"
    "}\n"
    "static int ring_pop(struct ring *r, int *v)\n"
    "{\n"
    "    if (r->head == r->tail)\n"
    "        return -1;\n"
    "    *v = r->buf[r->tail++ % r->cap];\n"
    "    return 0;\n"
    "}\n"
    "static unsigned ring_len(const struct ring *r) { return r->head - r->tail; }\n";

static size_t n_contexts(void)
{
    kvr_client *c = testd_connect(&D);
    cr_assert_not_null(c);
    kvr_context *l;
    size_t n;
    cr_assert_eq(kvr_client_list(c, NULL, &l, &n), 0);
    kvr_client_free(l);
    kvr_client_close(c);
    return n;
}

/* ---- complete ------------------------------------------------------------ */
Test(llama_worker, complete_reuses_the_cached_prefix)
{
    char p[512], p2[512];
    write_file("p.txt", SRC, p, sizeof p);
    size_t n = strlen(SRC) + 1;   /* + BOS */
    const char *a[] = { "complete", "--prompt-file", p, "--n", "12", NULL };
    cJSON *cold = run_json(a);
    cr_expect_eq(num(cold, NULL, "prompt_tokens"), (double)n);
    cr_expect_eq(num(cold, NULL, "reused_tokens"), 0);
    cr_expect_eq(num(cold, NULL, "computed_tokens"), (double)n);
    cr_expect_eq(num(cold, NULL, "stored_tokens"), (double)(n + 11), "prompt + 11 decoded tokens");
    cr_expect_str_eq(str(cold, "store"), "created");

    /* Another process: everything but the last prompt token comes from kvrope. */
    cJSON *warm = run_json(a);
    cr_expect_eq(num(warm, NULL, "cached_tokens"), (double)n);
    cr_expect_eq(num(warm, NULL, "reused_tokens"), (double)(n - 1));
    cr_expect_eq(num(warm, NULL, "computed_tokens"), 1);
    cr_expect_eq(num(warm, NULL, "stored_tokens"), 0, "nothing new to store");
    cr_expect_str_eq(str(warm, "reused_from"), str(cold, "stored_in"));

    const char *b[] = { "complete", "--prompt-file", p, "--n", "12", "--no-cache", NULL };
    cJSON *plain = run_json(b);
    cr_expect_eq(num(plain, NULL, "reused_tokens"), 0);
    cr_expect(same_tokens(warm, plain), "cached run = uncached run: %s",
              cJSON_PrintUnformatted(cJSON_GetObjectItem(warm, "tokens")));
    cr_expect(same_tokens(cold, plain), "first run = uncached run");

    /* A prompt that continues the first: the whole first one is reused and
     * the new tokens are appended to the same context. */
    char longer[2048];
    snprintf(longer, sizeof longer, "%sstatic void ring_clear(struct ring *r) { r->tail = r->head; }\n",
             SRC);
    write_file("p2.txt", longer, p2, sizeof p2);
    const char *c2[] = { "complete", "--prompt-file", p2, "--n", "4", NULL };
    cJSON *more = run_json(c2);
    cr_expect_eq(num(more, NULL, "reused_tokens"), (double)n, "the first prompt is a prefix");
    cr_expect_eq(num(more, NULL, "computed_tokens"), (double)(strlen(longer) + 1 - n));
    cr_expect_str_eq(str(more, "store"), "forked+appended",
                     "diverges from the stored completion: forked at the common prefix");
    cJSON *again = run_json(c2);
    cr_expect_eq(num(again, NULL, "reused_tokens"), (double)strlen(longer));
    cr_expect(same_tokens(more, again));
    cJSON_Delete(cold);
    cJSON_Delete(warm);
    cJSON_Delete(plain);
    cJSON_Delete(more);
    cJSON_Delete(again);
}

/* ---- edit ---------------------------------------------------------------- */
/* An edit of old (a file of SRC) that appends a line: asserted to be exact
 * (nothing approximate; the next token and logits a full encode's, up to
 * llama.cpp's batch rounding) on the model `what`; its JSON (delete it). */
static cJSON *edit_append_is_exact(const char *old, const char *what)
{
    char appended[4096], app[512];
    snprintf(appended, sizeof appended, "%s/* end */\n", SRC);
    write_file("app.txt", appended, app, sizeof app);
    const char *a[] = { "edit", "--old", old, "--new", app, "--check", "--n", "4", NULL };
    cJSON *j = run_json(a);
    cr_expect_eq(num(j, NULL, "approximate_tokens"), 0, "%s: an append approximates nothing",
                 what);
    cr_expect_eq(num(j, "check", "next_token_agrees"), 1, "%s: next token as a full encode's",
                 what);
    cr_expect_lt(num(j, "check", "logit_max_abs_err"), 0.05, "%s: logits as a full encode's",
                 what);
    return j;
}

Test(llama_worker, edit_decodes_only_the_new_tokens)
{
    char o[512], nw[512];
    write_file("old.txt", SRC, o, sizeof o);
    /* One line inserted in the middle, one word changed further down. */
    char edited[4096];
    const char *cut = strstr(SRC, "static int ring_pop");
    snprintf(edited, sizeof edited, "%.*s/* pop the oldest */\n%s", (int)(cut - SRC), SRC, cut);
    char *w = strstr(edited, "ring_len");
    cr_assert_not_null(w);
    memcpy(w, "ring_cap", 8);
    write_file("new.txt", edited, nw, sizeof nw);
    size_t nb = strlen(edited) + 1;

    const char *a[] = { "edit", "--old", o, "--new", nw, "--refresh", "4", "--check", "--n", "6",
                        NULL };
    cJSON *j = run_json(a);
    cr_expect_eq(num(j, NULL, "old_computed_tokens"), (double)strlen(SRC) + 1,
                 "the old file was not cached: encoded once");
    cr_expect_eq(num(j, NULL, "edit_ops"), 2, "%s", outbuf);
    double ins = num(j, NULL, "inserted_tokens"), ref = num(j, NULL, "refreshed_tokens");
    cr_expect_eq(ins - num(j, NULL, "removed_tokens"), 21, "net: the new line");
    cr_expect(ins >= 21 + 3 && ins <= 21 + 3 + 16, "the new line and the changed letters, and "
              "at most a few equal tokens between merged hunks: %g", ins);
    cr_expect_eq(ref, 8, "4 after each of the two edit points");
    double comp = num(j, NULL, "computed_tokens"), reused = num(j, NULL, "reused_tokens");
    cr_expect(comp == ins + ref || comp == ins + ref + 1, "only new, refreshed (and the last) "
              "tokens are decoded: %g", comp);
    cr_expect_eq(comp + reused, (double)nb);
    cr_expect_eq(num(j, NULL, "new_tokens"), (double)nb);
    cr_expect_eq(num(j, NULL, "pending_tokens"), 0, "the new tokens' KV went with the edit");
    cr_expect_gt(num(j, NULL, "approximate_tokens"), 0, "the suffix is approximate (PIE)");
    double err = num(j, "check", "logit_rms_err"), rms = num(j, "check", "logit_rms");
    cr_expect(isfinite(err) && isfinite(rms) && rms > 0 && err < rms,
              "edit logits close to a full re-encode: rms err %g, logit rms %g", err, rms);
    cr_expect(isfinite(num(j, "check", "logit_max_abs_err")));
    cr_expect(num(j, "check", "full_ms") > 0);

    /* Again: the old file is cached now, the edited one lands in the same place. */
    cJSON *j2 = run_json(a);
    cr_expect_eq(num(j2, NULL, "old_computed_tokens"), 0);
    cr_expect_str_eq(str(j2, "old_store"), "cached");
    cr_expect_str_eq(str(j2, "context"), str(j, "context"));
    cr_expect(same_tokens(j, j2));

    /* An edit at the very end changes nothing before it: nothing is
     * approximate and the next token is exactly what a full encode gives
     * (up to llama.cpp's batch rounding). */
    cJSON *j3 = edit_append_is_exact(o, "llama");
    cr_expect_eq(num(j3, NULL, "edit_ops"), 1);
    cr_expect_eq(num(j3, NULL, "inserted_tokens"), 10);
    cr_expect_eq(num(j3, NULL, "computed_tokens"), 10);
    cJSON_Delete(j);
    cJSON_Delete(j2);
    cJSON_Delete(j3);
}

/* ---- NEOX pairing (qwen2) ----------------------------------------------- */
Test(llama_worker, qwen2_neox_complete_and_edit)
{
    snprintf(model, sizeof model, "%s/q.gguf", dir);
    gen_model(model, "--arch qwen2 --layers 2 --width 128 --heads 2 --kv-heads 1 --qkv-bias "
                     "--dtype f16 --seed 3");
    char p[512], mid[512];
    write_file("p.txt", SRC, p, sizeof p);
    const char *a[] = { "complete", "--prompt-file", p, "--n", "8", NULL };
    cJSON *cold = run_json(a), *warm = run_json(a);
    const char *b[] = { "complete", "--prompt-file", p, "--n", "8", "--no-cache", NULL };
    cJSON *plain = run_json(b);
    cr_expect_eq(num(warm, NULL, "reused_tokens"), (double)strlen(SRC));
    cr_expect(same_tokens(warm, plain) && same_tokens(cold, plain));
    /* Appending at the end: exact. */
    cJSON *j = edit_append_is_exact(p, "qwen2");
    /* A line removed in the middle: the suffix moves back (keys re-rotated
     * by kvrope in NEOX pairs); close to a full re-encode. */
    char removed[4096];
    const char *l = strstr(SRC, "    r->buf[r->head++");
    const char *e = strchr(l, '\n') + 1;
    snprintf(removed, sizeof removed, "%.*s%s", (int)(l - SRC), SRC, e);
    write_file("mid.txt", removed, mid, sizeof mid);
    const char *d[] = { "edit", "--old", p, "--new", mid, "--refresh", "8", "--check", "--n", "4",
                        NULL };
    cJSON *k = run_json(d);
    cr_expect_eq(num(k, NULL, "removed_tokens") - num(k, NULL, "inserted_tokens"),
                 (double)(e - l));
    cr_expect_gt(num(k, NULL, "approximate_tokens"), 0);
    double err = num(k, "check", "logit_rms_err"), rms = num(k, "check", "logit_rms");
    cr_expect(isfinite(err) && rms > 0 && err < rms, "rms err %g vs logit rms %g", err, rms);
    cJSON_Delete(cold);
    cJSON_Delete(warm);
    cJSON_Delete(plain);
    cJSON_Delete(j);
    cJSON_Delete(k);
}

/* ---- rag ----------------------------------------------------------------- */
Test(llama_worker, rag_encodes_each_document_once)
{
    char pre[512], d1[512], d2[512], d3[512], q[512];
    write_file("pre.txt", "You answer questions about C code using the snippets below.\n", pre,
               sizeof pre);
    write_file("d1.txt", SRC, d1, sizeof d1);
    write_file("d2.txt", "int add(int a, int b) { return a + b; }\nint sub(int a, int b) "
               "{ return a - b; }\n", d2, sizeof d2);
    write_file("d3.txt", "#define MAX(a, b) ((a) > (b) ? (a) : (b))\n", d3, sizeof d3);
    write_file("q.txt", "Question: what does ring_pop return when empty?\nAnswer:", q, sizeof q);
    const char *layouts[] = { "parallel", "sequential (the default)" };
    for (int li = 0; li < 2; li++) {
        const char *a[] = { "rag", "--prefix", pre, "--doc", d1, d2, "--doc", d3, "--query", q,
                            "--check", "--n", "4", "--layout", "parallel", NULL };
        if (li == 1)
            a[13] = NULL;   /* no --layout: sequential */
        cJSON *j = run_json(a);
        cr_expect_eq(num(j, NULL, "documents"), 3);
        cr_expect_eq(num(j, NULL, "documents_cached"), li == 0 ? 0 : 3,
                     "%s: documents are encoded once, then reused", layouts[li]);
        double nq = num(j, NULL, "query_tokens");
        if (li == 1)
            cr_expect_eq(num(j, NULL, "computed_tokens"), nq, "only the query is computed");
        double np = num(j, NULL, "prefix_tokens"), nd = num(j, NULL, "document_tokens");
        cr_expect_eq(num(j, NULL, "stream_tokens"), np + nd);
        double qpos = num(j, NULL, "query_pos");
        if (li == 0)
            cr_expect_eq(qpos, np + (double)strlen(SRC), "parallel: after the longest document");
        else
            cr_expect_eq(qpos, np + nd, "sequential: after all documents");
        double err = num(j, "check", "logit_rms_err"), rms = num(j, "check", "logit_rms");
        cr_expect(isfinite(err) && rms > 0 && isfinite(num(j, "check", "logit_max_abs_err")),
                  "check figures are finite");
        cJSON_Delete(j);
    }
}

/* ---- ppl ----------------------------------------------------------------- */
Test(llama_worker, ppl_prints_bits_per_byte)
{
    char f[512];
    write_file("t.txt", SRC, f, sizeof f);
    const char *a[] = { "--model", model, "--threads", "2", "ppl", f, NULL };
    cr_assert_eq(worker(outbuf, sizeof outbuf, a), 0, "%s", outbuf);
    const char *line = strstr(outbuf, "bits/byte: ");
    cr_assert_not_null(line, "%s", outbuf);
    double bpb = strtod(line + 11, NULL);
    cr_expect(isfinite(bpb) && bpb > 0 && bpb < 64, "bits/byte %g", bpb);
    const char *b[] = { "ppl", f, NULL };
    cJSON *j = run_json(b);
    cr_expect_eq(num(j, NULL, "bytes"), (double)strlen(SRC), "every byte is predicted (BOS first)");
    cr_expect(fabs(num(j, NULL, "bits_per_byte") - bpb) < 0.001);
    cJSON_Delete(j);
}

/* ---- errors -------------------------------------------------------------- */
Test(llama_worker, bad_inputs_are_clear_errors)
{
    char p[512], notgguf[512], missing[512];
    write_file("p.txt", SRC, p, sizeof p);
    write_file("bad.gguf", "this is not a model\n", notgguf, sizeof notgguf);
    snprintf(missing, sizeof missing, "%s/nope.gguf", dir);
    size_t before = n_contexts();
    struct { const char *args[16]; int rc; const char *msg; } cases[] = {
        { { "--model", missing, "--socket", D.sock, "complete", "--prompt-file", p, NULL }, 3,
          "nope.gguf" },
        { { "--model", notgguf, "--socket", D.sock, "complete", "--prompt-file", p, NULL }, 1,
          "not a GGUF" },
        { { "--model", model, "--socket", D.sock, "complete", "--prompt-file", missing, NULL }, 3,
          "prompt file" },
        { { "--model", model, "--socket", "/nonexistent/kv.sock", "complete", "--prompt-file", p,
            NULL }, 4, "cannot connect" },
        { { "--model", model, "--socket", D.sock, "edit", "--old", p, "--new", missing, NULL }, 3,
          "new file" },
        { { "--model", model, "--socket", D.sock, "rag", "--prefix", p, "--doc", missing,
            "--query", p, NULL }, 3, "document" },
        { { "--model", model, "ppl", missing, NULL }, 3, "file" },
        { { "--model", model, "complete", "--n", "x", NULL }, 2, "" },
        { { "--model", model, "frobnicate", NULL }, 2, "" },
        { { "complete", "--prompt-file", p, NULL }, 2, "" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        /* stderr carries the message: capture it through a shell redirect. */
        char cmd[4096], err[4096] = "";
        size_t o = (size_t)snprintf(cmd, sizeof cmd, "%s/kvrope-llama", testd_build_dir());
        for (int k = 0; cases[i].args[k]; k++)
            o += (size_t)snprintf(cmd + o, sizeof cmd - o, " '%s'", cases[i].args[k]);
        snprintf(cmd + o, sizeof cmd - o, " 2>&1 >/dev/null");
        FILE *f = popen(cmd, "r");
        cr_assert_not_null(f);
        size_t n = fread(err, 1, sizeof err - 1, f);
        err[n] = 0;
        int st = pclose(f);
        cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == cases[i].rc, "case %zu: exit %d, want %d: %s",
                  i, WIFEXITED(st) ? WEXITSTATUS(st) : -1, cases[i].rc, err);
        cr_expect(strstr(err, cases[i].msg) != NULL, "case %zu names %s: %s", i, cases[i].msg,
                  err);
        cr_expect(strstr(err, "kvrope-llama") != NULL, "case %zu: %s", i, err);
    }
    cr_expect_eq(n_contexts(), before, "no failed run stored anything");
    /* --json failures are JSON too. */
    const char *a[] = { "--model", notgguf, "--socket", D.sock, "--json", "complete",
                        "--prompt-file", p, NULL };
    cr_expect_eq(worker(outbuf, sizeof outbuf, a), 1);
    cJSON *j = cJSON_Parse(outbuf);
    cr_assert_not_null(j, "%s", outbuf);
    cr_expect(strstr(str(j, "error"), "not a GGUF") != NULL);
    cJSON_Delete(j);
}

/* ---- the diff on its own ------------------------------------------------- */
static void apply_hunks(const int32_t *a, size_t na, const int32_t *b, const kvr__wk_hunk *h,
                        size_t nh, int32_t *out, size_t *no)
{
    size_t o = 0, j = 0;
    for (size_t i = 0; i < nh; i++) {
        cr_assert(h[i].a0 >= j && h[i].a1 >= h[i].a0 && h[i].a1 <= na, "hunks sorted, in range");
        cr_assert(i == 0 || h[i].a0 > h[i - 1].a1 || h[i].b0 > h[i - 1].b1,
                  "hunks separated by an equal token");
        while (j < h[i].a0)
            out[o++] = a[j++];
        for (size_t k = h[i].b0; k < h[i].b1; k++)
            out[o++] = b[k];
        j = h[i].a1;
    }
    while (j < na)
        out[o++] = a[j++];
    *no = o;
}

Test(llama_worker_parts, diff_rebuilds_the_new_sequence)
{
    uint64_t x = 12345;
    for (int trial = 0; trial < 300; trial++) {
        int32_t a[300], b[400], out[800];
        size_t na = 1 + (size_t)(trial * 7 % 250), nb = 0;
        for (size_t i = 0; i < na; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            a[i] = (int32_t)(x >> 60);            /* a small alphabet: many matches */
        }
        /* b = a with a few random edits. */
        for (size_t i = 0; i < na && nb < 380; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            unsigned r = (unsigned)(x >> 56) % 40;
            if (r == 0)
                continue;                          /* delete */
            if (r == 1)
                b[nb++] = 99;                      /* insert */
            b[nb++] = r == 2 ? 77 : a[i];          /* replace / keep */
        }
        kvr__wk_hunk *h;
        size_t nh, no;
        cr_assert_eq(kvr__wk_diff(a, na, b, nb, trial % 3 ? 2048 : 4, &h, &nh), 0);
        apply_hunks(a, na, b, h, nh, out, &no);
        cr_assert_eq(no, nb, "trial %d: length", trial);
        cr_assert_eq(memcmp(out, b, nb * sizeof *b), 0, "trial %d: content", trial);
        /* Merged hunks still rebuild b, and keep min_gap equal tokens apart. */
        kvr__wk_hunk *hm = malloc((nh ? nh : 1) * sizeof *hm);
        if (nh)
            memcpy(hm, h, nh * sizeof *hm);
        size_t nm = nh;
        kvr__wk_hunks_merge(hm, &nm, 8);
        cr_assert_leq(nm, nh);
        for (size_t i = 1; i < nm; i++)
            cr_assert_geq(hm[i].a0 - hm[i - 1].a1, 8);
        apply_hunks(a, na, b, hm, nm, out, &no);
        cr_assert(no == nb && memcmp(out, b, nb * sizeof *b) == 0, "trial %d: merged", trial);
        free(hm);
        size_t changed = 0;
        for (size_t i = 0; i < nh; i++)
            changed += (h[i].a1 - h[i].a0) + (h[i].b1 - h[i].b0);
        if (trial % 3)
            cr_assert_leq(changed, 4 * na / 40 + 40, "trial %d: minimal-ish (%zu)", trial, changed);
        free(h);
    }
    kvr__wk_hunk *h;
    size_t nh;
    int32_t s[] = { 1, 2, 3 };
    cr_assert_eq(kvr__wk_diff(s, 3, s, 3, 16, &h, &nh), 0);
    cr_assert_eq(nh, 0);
    free(h);
    int32_t t[] = { 1, 2, 9, 3 };
    cr_assert_eq(kvr__wk_diff(s, 3, t, 4, 16, &h, &nh), 0);
    cr_assert_eq(nh, 1);
    cr_assert(h[0].a0 == 2 && h[0].a1 == 2 && h[0].b0 == 2 && h[0].b1 == 3, "an insert at 2");
    free(h);
}

/* ---- the state codec on its own ------------------------------------------ */
Test(llama_worker_parts, state_build_parse_gather_round_trip)
{
    for (int vt = 0; vt < 2; vt++) {
        const uint32_t nl = 3, ne = 8, n = 5;
        uint16_t pl[3 * 2 * 5 * 8];
        for (size_t i = 0; i < sizeof pl / sizeof pl[0]; i++)
            pl[i] = (uint16_t)(i * 31 + 7);
        int64_t pos[5] = { 0, 1, 7, 7, 3 };
        kvr__wk_sbuild b;
        cr_assert_eq(kvr__wk_sbuild_init(&b, n, nl, KVR_WK_GGML_F16, ne, vt), 0);
        cr_assert_eq(kvr__wk_sbuild_add(&b, pl, n, 0, 2, pos), 0);
        cr_assert_eq(kvr__wk_sbuild_add(&b, pl, n, 2, 5, pos + 2), 0);
        cr_assert_neq(kvr__wk_sbuild_add(&b, pl, n, 0, 1, pos), 0, "full");
        kvr__wk_state st;
        char err[256];
        cr_assert_eq(kvr__wk_state_parse(&st, b.buf, b.len, err, sizeof err), 0, "%s", err);
        cr_assert_eq(st.n_cells, n);
        cr_assert_eq(st.v_trans, vt);
        cr_assert_eq(st.pos[2], 7);
        uint32_t cells[5] = { 0, 1, 2, 3, 4 };
        uint16_t back[sizeof pl / sizeof pl[0]];
        kvr__wk_state_gather(&st, cells, n, back);
        cr_assert_eq(memcmp(back, pl, sizeof pl), 0, "v_trans %d round trip", vt);
        kvr__wk_state_free(&st);
        /* Truncated and trailing bytes are refused. */
        cr_assert_neq(kvr__wk_state_parse(&st, b.buf, b.len - 1, err, sizeof err), 0);
        cr_assert(strstr(err, "truncated") != NULL, "%s", err);
        uint8_t *big = malloc(b.len + 1);
        memcpy(big, b.buf, b.len);
        big[b.len] = 0;
        cr_assert_neq(kvr__wk_state_parse(&st, big, b.len + 1, err, sizeof err), 0);
        cr_assert(strstr(err, "after the end") != NULL, "%s", err);
        big[0] ^= 1;
        cr_assert_neq(kvr__wk_state_parse(&st, big, b.len, err, sizeof err), 0);
        free(big);
        kvr__wk_sbuild_free(&b);
    }
}
