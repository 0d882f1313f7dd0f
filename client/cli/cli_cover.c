/*
 * cli_cover.c — `kvrope cover`: which cached runs make up a prompt, found
 * anywhere in it (docs/reuse.md), printed as runs and gaps; with --get the
 * runs' K/V placed for the prompt (keys re-rotated to --pos-base + prompt
 * offset) written to -o FILE.
 *
 *   kvrope cover --model M (--tokens 1,2,3 | --tokens-file F) [--min-run N]
 *                [--get -o FILE [--pos-base P] [--dtype D] [--layers 0,1,..]]
 *
 * Same conventions as cli_cmd.c: human output or one JSON document with
 * --json, errors on stderr, exit codes of cli.h (3 when nothing is cached).
 * The .safetensors file of --get is a `get` file (k, v, tokens, positions,
 * flags, groups) plus a tensor runs I64 [n][6] = prompt_off, ctx_off,
 * n_tokens, n_approx, exact (0/1), stream_off, and metadata (strings): kind
 * "cover", model, prompt_tokens, runs (JSON, as --json prints them).
 */
#include "client/cli/cli.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char kvr__cli_cover_help[] =
"  cover --model M (--tokens .. | --tokens-file F) [--min-run N]\n"
"        [--get -o FILE [--pos-base P] [--dtype D] [--layers 0,1,..]]\n"
"                                     the cached runs that make up the prompt, found\n"
"                                     at any offset of it (not only as a prefix;\n"
"                                     verified token by token): each run's prompt\n"
"                                     range, context and its range there, tokens\n"
"                                     already approximate, whether it is exact (at its\n"
"                                     own place after the same text); then the gaps\n"
"                                     the engine computes. --min-run: the shortest run\n"
"                                     placed (default 16). --get: the runs' K/V in one\n"
"                                     stream (prompt order, keys re-rotated to P +\n"
"                                     prompt offset, P default 0; tokens of runs not\n"
"                                     exact flagged approximate) to FILE: .safetensors\n"
"                                     (as get, plus runs I64 [n][6] = prompt_off,\n"
"                                     ctx_off, n_tokens, n_approx, exact, stream_off;\n"
"                                     metadata kind=cover, model, prompt_tokens, runs),\n"
"                                     .npy, or raw (- = stdout). Exit 3: nothing cached\n"
"                                     (docs/reuse.md)\n";

bool kvr__cli_cover_command(const char *cmd)
{
    return !strcmp(cmd, "cover");
}

bool kvr__cli_cover_option_takes_value(const char *name)
{
    return !strcmp(name, "min-run") || !strcmp(name, "pos-base");
}

static cJSON *runs_json(const kvr_cover_res *r, bool get)
{
    cJSON *arr = cJSON_CreateArray();
    for (size_t i = 0; arr && i < r->n_runs; i++) {
        const kvr_cover_run *x = &r->runs[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "prompt_start", (double)x->prompt_off);
        cJSON_AddNumberToObject(o, "prompt_end", (double)(x->prompt_off + x->n_tokens));
        cJSON_AddStringToObject(o, "context_id", x->ctx_id);
        cJSON_AddNumberToObject(o, "context_start", (double)x->ctx_off);
        cJSON_AddNumberToObject(o, "n_tokens", (double)x->n_tokens);
        cJSON_AddNumberToObject(o, "n_approximate", (double)x->n_approx);
        cJSON_AddBoolToObject(o, "exact", x->exact);
        if (get)
            cJSON_AddNumberToObject(o, "stream_start", (double)x->stream_off);
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

static cJSON *cover_json(const char *model, const kvr_cover_res *r, const char *file)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "model", model);
    cJSON_AddNumberToObject(j, "prompt_tokens", (double)r->n_prompt);
    cJSON_AddNumberToObject(j, "covered", (double)r->n_covered);
    cJSON_AddItemToObject(j, "runs", runs_json(r, r->has_kv));
    cJSON *g = cJSON_AddArrayToObject(j, "gaps");
    for (size_t i = 0; i < r->n_gaps; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "start", (double)r->gaps[i].prompt_off);
        cJSON_AddNumberToObject(o, "end", (double)(r->gaps[i].prompt_off + r->gaps[i].n_tokens));
        cJSON_AddItemToArray(g, o);
    }
    if (r->has_kv) {
        cJSON *k = cJSON_AddObjectToObject(j, "kv");
        cJSON_AddNumberToObject(k, "n_tokens", (double)r->kv.n_tokens);
        cJSON_AddStringToObject(k, "dtype", kvr_dtype_name(r->kv.dtype));
        cJSON_AddNumberToObject(k, "n_layers", (double)r->kv.n_layers);
        cJSON_AddNumberToObject(k, "payload_bytes", (double)r->kv.payload_len);
        if (file)
            cJSON_AddStringToObject(k, "file", file);
    }
    return j;
}

static void cover_print(FILE *o, const char *model, const kvr_cover_res *r, const char *file)
{
    double share = r->n_prompt ? 100.0 * (double)r->n_covered / (double)r->n_prompt : 0;
    fprintf(o, "cover of %" PRIu64 " tokens (model %s): %zu run%s, %" PRIu64 " tokens cached "
            "(%.1f%%), %zu gap%s\n", r->n_prompt, model, r->n_runs, r->n_runs == 1 ? "" : "s",
            r->n_covered, share, r->n_gaps, r->n_gaps == 1 ? "" : "s");
    if (r->n_runs)
        fprintf(o, "  %-18s %-24s %-18s %-8s %s\n", "PROMPT", "CONTEXT", "IN CONTEXT",
                "APPROX", "EXACT");
    for (size_t i = 0; i < r->n_runs; i++) {
        const kvr_cover_run *x = &r->runs[i];
        char pr[48], cr[48];
        snprintf(pr, sizeof pr, "[%" PRIu64 ", %" PRIu64 ")", x->prompt_off,
                 x->prompt_off + x->n_tokens);
        snprintf(cr, sizeof cr, "[%" PRIu64 ", %" PRIu64 ")", x->ctx_off,
                 x->ctx_off + x->n_tokens);
        fprintf(o, "  %-18s %-24s %-18s %-8" PRIu64 " %s\n", pr, x->ctx_id, cr, x->n_approx,
                x->exact ? "yes" : "no");
    }
    for (size_t i = 0; i < r->n_gaps; i++)
        fprintf(o, "  gap [%" PRIu64 ", %" PRIu64 ")\n", r->gaps[i].prompt_off,
                r->gaps[i].prompt_off + r->gaps[i].n_tokens);
    if (r->has_kv && file)
        fprintf(o, "K/V of %" PRIu64 " placed tokens (%s, %zu layers), %zu bytes -> %s\n",
                r->kv.n_tokens, kvr_dtype_name(r->kv.dtype), r->kv.n_layers,
                r->kv.payload_len, file);
}

/* The .safetensors file (header comment). */
static int cover_write_st(const char *path, const char *model, const kvr_cover_res *r,
                          char *err, size_t errlen)
{
    size_t n = r->n_runs;
    int64_t *t = malloc((n ? n : 1) * 6 * sizeof *t);
    cJSON *runs = runs_json(r, true);
    char *runs_s = runs ? cJSON_PrintUnformatted(runs) : NULL;
    int rc = -1;
    if (!t || !runs_s) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const kvr_cover_run *x = &r->runs[i];
        int64_t row[6] = { (int64_t)x->prompt_off, (int64_t)x->ctx_off, (int64_t)x->n_tokens,
                           (int64_t)x->n_approx, x->exact, (int64_t)x->stream_off };
        memcpy(t + 6 * i, row, sizeof row);
    }
    char np[32];
    snprintf(np, sizeof np, "%" PRIu64, r->n_prompt);
    const char *meta[] = { "kind", "cover", "model", model, "prompt_tokens", np,
                           "runs", runs_s };
    cli_st_extra ex = { .name = "runs", .dtype = "I64", .shape = { n, 6 }, .ndim = 2,
                        .data = t, .bytes = n * 6 * sizeof *t };
    rc = kvr__cli_st_write_ex(path, &r->kv, meta, sizeof meta / sizeof meta[0] / 2, &ex, 1, err,
                         errlen);
out:
    free(t);
    free(runs_s);
    cJSON_Delete(runs);
    return rc;
}

static int cmd_cover(kvr_client *c, const cli_args *a)
{
    const char *model = kvr__cli_opt(a, "model"), *out = kvr__cli_opt(a, "output");
    if (!model || a->npos != 0)
        return kvr__cli_usage_err("usage: kvrope cover --model M (--tokens 1,2,3 | --tokens-file F) "
                             "[--min-run N] [--get -o FILE]");
    bool get = kvr__cli_flag(a, "get") || out != NULL;
    if (get && !out)
        return kvr__cli_usage_err("cover --get needs -o FILE");
    if (get && a->json && !strcmp(out, "-"))
        return kvr__cli_usage_err("cover: --json and -o - both want stdout");
    kvr_cover_args g = { .model = model, .dtype = KVR_DTYPE_F16 };
    const char *mv = kvr__cli_opt(a, "min-run"), *pv = kvr__cli_opt(a, "pos-base");
    const char *dv = kvr__cli_opt(a, "dtype"), *ls = kvr__cli_opt(a, "layers");
    uint64_t mr;
    if (mv && (kvr__cli_parse_u64(mv, &mr) < 0 || mr == 0 || mr > KVR_COVER_MAX_TOKENS))
        return kvr__cli_usage_err("--min-run: want 1..%u", KVR_COVER_MAX_TOKENS);
    if (mv)
        g.min_run = (uint32_t)mr;
    if ((pv || dv || ls) && !get)
        return kvr__cli_usage_err("--pos-base, --dtype and --layers go with --get -o FILE");
    if (pv && (kvr__cli_parse_i64(pv, &g.pos_base) < 0 || g.pos_base < 0))
        return kvr__cli_usage_err("--pos-base: want a position >= 0");
    if (dv && kvr_dtype_parse(dv, &g.dtype) != 0)
        return kvr__cli_usage_err("--dtype: want f32, f16 or bf16");
    uint32_t *tok = NULL, *layers = NULL;
    long n;
    int rc = kvr__cli_load_tokens(a, &tok, &n, true);
    if (rc != CLI_OK)
        return rc;
    g.tokens = tok;
    g.n_tokens = (size_t)n;
    if ((rc = kvr__cli_opt_layers(ls, &layers, &g.n_layers)) != CLI_OK) {
        free(tok);
        return rc;
    }
    g.layers = layers;
    int r;
    if (get && !dv) {   /* default: the model's native dtype */
        kvr_model m;
        if ((r = kvr_client_model_get(c, model, &m)) < 0) {
            rc = kvr__cli_fail(a, c, r, "cover");
            goto out;
        }
        g.dtype = m.dtype;
    }
    kvr_cover_res res;
    kvr__cli_progress_begin(c, "cover");
    r = get ? kvr_client_cover_get(c, &g, &res) : kvr_client_cover(c, &g, &res);
    kvr__cli_progress_end();
    if (r < 0) {
        rc = kvr__cli_fail(a, c, r, "cover");
        goto out;
    }
    rc = CLI_OK;
    if (res.has_kv) {
        char err[400];
        if (kvr__cli_has_suffix(out, ".safetensors")) {
            if (cover_write_st(out, model, &res, err, sizeof err) < 0)
                rc = kvr__cli_io_err(a, err);
        } else {
            rc = kvr__cli_write_kv(a, &res.kv, out);
        }
    }
    if (rc == CLI_OK) {
        if (a->json)
            kvr__cli_print_json(cover_json(model, &res, get ? out : NULL));
        else if (!a->quiet)
            cover_print(get && !strcmp(out, "-") ? stderr : stdout, model, &res,
                        get ? out : NULL);
        if (res.n_runs == 0)
            rc = CLI_NOTFOUND;
    }
    kvr_cover_release(&res);
out:
    free(tok);
    free(layers);
    return rc;
}

int kvr__cli_cover_run(kvr_client *c, const cli_args *a)
{
    return cmd_cover(c, a);
}
