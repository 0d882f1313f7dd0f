/*
 * cli_layout.c — the `kvrope` commands of the position layouts
 * (docs/protocol.md "Position layouts", docs/ape.md): `assemble` (APE: a
 * prefix and documents into one KV stream with its segment table), `group
 * append` / `group offset` (GPE), `retain` (StreamingLLM sinks + window),
 * put's --prefix-ctx / --group / --groups, and the layout part of `stat`.
 *
 * Same conventions as cli_cmd.c: human output or one JSON document with
 * --json, errors on stderr (and as {"error": ...} with --json), exit codes
 * of cli.h. Everything here goes through libkvrope; nothing is computed
 * locally but the file layout.
 *
 * The assemble .safetensors file is a `get` file (k, v, tokens, positions,
 * flags, groups; k/v layer-major [layers][tokens][heads][head_dim]) plus
 *   segments    I64 [n_segments][6]: kind (0 prefix, 1 document, 2 query),
 *               start, n_tokens, pos_first, pos_last, doc_index (-1 if not
 *               a document)
 *   segment_ts  F64 [n_segments][2]: APE temperature T, scale S
 * and metadata (all strings, as safetensors wants): kind "assemble",
 * layout, prefix, documents (JSON array), query_pos, prefix_len,
 * temperature, scale, temperature_folded ("true"/"false") and segments (the
 * same table as JSON, as printed by --json).
 */
#include "client/cli/cli.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char kvr__cli_layout_help[] =
"  put CTX FILE ... --prefix-ctx PREFIX\n"
"                                     APE document: FILE's KV was encoded after\n"
"                                     context PREFIX (recorded: id, model, length P,\n"
"                                     token hash); positions default to P, P+1, ..\n"
"  put CTX FILE ... --group NAME [--groups A,B[:PHI],..]\n"
"                                     GPE: the tokens join group NAME and take its\n"
"                                     next positions PHI + cursor, .. (no --positions\n"
"                                     or --pos-start; positions in FILE are ignored).\n"
"                                     --groups creates CTX with these groups, ids in\n"
"                                     that order, offset PHI (default 0) each\n"
"  group append CTX GROUP FILE [put options]\n"
"                                     the same as put CTX FILE --group GROUP\n"
"  group offset CTX GROUP PHI         set GROUP's offset: its tokens (and its next\n"
"                                     positions) move to PHI + k; others untouched\n"
"  retain CTX [--sinks S] --window W  keep the first S (default 0) and the last W\n"
"                                     tokens, now and after every put; the window's\n"
"                                     positions continue right after the sinks\n"
"  retain CTX --off                   remove the policy\n"
"  stat CTX                           also shows the layout: APE prefix, groups\n"
"                                     (offset, cursor, tokens), retention policy\n"
"  assemble PREFIX DOC... (-o FILE | --meta) [--layout parallel|sequential|explicit]\n"
"        [--starts S1,S2,..] [--temperature T] [--scale S] [--fold-temperature]\n"
"        [--dtype D] [--layers 0,1,..]\n"
"                                     one KV stream: PREFIX's tokens, then each DOC's\n"
"                                     (documents put with --prefix-ctx PREFIX), keys\n"
"                                     rotated to the layout's positions. parallel\n"
"                                     (default): every DOC at P..P+L-1, query at\n"
"                                     P + max L; sequential: back to back from P\n"
"                                     (moved tokens approximate); --starts (implies\n"
"                                     explicit): DOC i at S_i. T, S: APE temperature\n"
"                                     and scale of the documents (default 0.9, 0.9);\n"
"                                     --fold-temperature returns document keys as k/T.\n"
"                                     Prints the segment table (kind, context, token\n"
"                                     range, positions, T, S) and the query position\n"
"                                     (docs/protocol.md \"Position layouts\", docs/ape.md).\n";

const char kvr__cli_layout_help_file[] =
"                                     FILE *.safetensors: as get (k, v, tokens,\n"
"                                     positions, flags, groups) plus tensors\n"
"                                     segments I64 [n][6] = kind (0 prefix, 1 document,\n"
"                                     2 query), start, n_tokens, pos_first, pos_last,\n"
"                                     doc_index (-1 if not a document), and\n"
"                                     segment_ts F64 [n][2] = T, S; metadata (strings):\n"
"                                     kind=assemble, layout, prefix, documents,\n"
"                                     query_pos, prefix_len, temperature, scale,\n"
"                                     temperature_folded, segments (JSON, as --json).\n"
"                                     Other FILE (- = stdout): raw layer-major payload.\n";

/* ---- output helpers (as cli_cmd.c's) ------------------------------------ */

/* A positive finite number, or -1. */
static int parse_pos_double(const char *v, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !(x > 0.0) || x > 1e300)
        return -1;
    *out = x;
    return 0;
}

/* ---- options and dispatch ----------------------------------------------- */

static const char *const commands[] = { "assemble", "group", "retain", NULL };

bool kvr__cli_layout_command(const char *cmd)
{
    return kvr__cli_in_list(commands, cmd);
}

bool kvr__cli_layout_option_takes_value(const char *name)
{
    static const char *const v[] = { "layout", "starts", "temperature", "scale", "prefix-ctx",
                                     "group", "groups", "sinks", "window", NULL };
    return kvr__cli_in_list(v, name);
}

bool kvr__cli_layout_option_is_flag(const char *name)
{
    return !strcmp(name, "fold-temperature") || !strcmp(name, "off");
}

/* ---- layout info (stat, group offset, retain) --------------------------- */

static cJSON *layout_json(const kvr_layout_res *l)
{
    cJSON *j = cJSON_CreateObject();
    if (l->has_prefix) {
        cJSON *p = cJSON_AddObjectToObject(j, "prefix");
        cJSON_AddStringToObject(p, "context_id", l->prefix_ctx);
        cJSON_AddNumberToObject(p, "prefix_len", (double)l->prefix_len);
    } else {
        cJSON_AddNullToObject(j, "prefix");
    }
    cJSON *g = cJSON_AddArrayToObject(j, "groups");
    for (size_t i = 0; i < l->n_groups; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", l->groups[i].name);
        cJSON_AddNumberToObject(o, "id", l->groups[i].id);
        cJSON_AddNumberToObject(o, "offset", (double)l->groups[i].offset);
        cJSON_AddNumberToObject(o, "cursor", (double)l->groups[i].cursor);
        cJSON_AddNumberToObject(o, "n_tokens", (double)l->groups[i].n_tokens);
        cJSON_AddItemToArray(g, o);
    }
    if (l->retention) {
        cJSON *r = cJSON_AddObjectToObject(j, "retention");
        cJSON_AddNumberToObject(r, "sinks", (double)l->sinks);
        cJSON_AddNumberToObject(r, "window", (double)l->window);
        cJSON_AddNumberToObject(r, "n_dropped", (double)l->n_dropped);
    } else {
        cJSON_AddNullToObject(j, "retention");
    }
    return j;
}

/* In the "label:        value" style of `kvrope stat`. With all = false
 * only what the context has; with all = true "none"/"off" lines too. */
static void layout_print(const kvr_layout_res *l, bool all)
{
    if (l->has_prefix)
        printf("prefix:       %s (P = %" PRIu64 " tokens)\n", l->prefix_ctx, l->prefix_len);
    else if (all)
        printf("prefix:       none\n");
    for (size_t i = 0; i < l->n_groups; i++)
        printf("%s %-12s id %d, offset %" PRId64 ", cursor %" PRIu64 ", %" PRIu64
               " tokens\n", i ? "             " : "groups:      ", l->groups[i].name,
               (int)l->groups[i].id, l->groups[i].offset, l->groups[i].cursor,
               l->groups[i].n_tokens);
    if (!l->n_groups && all)
        printf("groups:       none\n");
    if (l->retention)
        printf("retention:    sinks %" PRIu64 ", window %" PRIu64 " (%" PRIu64
               " tokens dropped so far)\n", l->sinks, l->window, l->n_dropped);
    else if (all)
        printf("retention:    off\n");
}

void kvr__cli_layout_stat_json(kvr_client *c, const char *ctx, struct cJSON *j)
{
    kvr_layout_res l;
    if (kvr_client_layout_stat(c, ctx, &l) == 0)
        cJSON_AddItemToObject(j, "layout", layout_json(&l));
}

void kvr__cli_layout_stat_print(kvr_client *c, const char *ctx)
{
    kvr_layout_res l;
    if (kvr_client_layout_stat(c, ctx, &l) == 0)
        layout_print(&l, false);
}

static int layout_done(const cli_args *a, const char *ctx, const char *what,
                       const kvr_layout_res *l)
{
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddBoolToObject(j, "ok", 1);
        cJSON_AddStringToObject(j, "op", what);
        cJSON_AddStringToObject(j, "context_id", ctx);
        cJSON_AddItemToObject(j, "layout", layout_json(l));
        kvr__cli_print_json(j);
    } else if (!a->quiet) {
        printf("%s: %s\n", ctx, what);
        layout_print(l, true);
    }
    return CLI_OK;
}

/* ---- put options -------------------------------------------------------- */

/* "A,B:100,C:-5" into lay's names and offsets; returns the count or -1. */
static long parse_groups(const char *s, cli_put_layout *lay, bool *any_offset)
{
    size_t n = 0;
    *any_offset = false;
    const char *p = s;
    for (;;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (n == KVR_MAX_GROUPS) {
            kvr__cli_usage_err("--groups: at most %d groups", KVR_MAX_GROUPS);
            return -1;
        }
        const char *colon = memchr(p, ':', len);
        size_t nl = colon ? (size_t)(colon - p) : len;
        if (nl == 0 || nl >= sizeof lay->name_buf[0]) {
            kvr__cli_usage_err("--groups: group names are 1..%zu bytes (NAME or NAME:PHI, "
                      "comma-separated)", sizeof lay->name_buf[0] - 1);
            return -1;
        }
        memcpy(lay->name_buf[n], p, nl);
        lay->name_buf[n][nl] = 0;
        lay->names[n] = lay->name_buf[n];
        lay->offsets[n] = 0;
        if (colon) {
            char num[32];
            size_t ml = len - nl - 1;
            if (ml == 0 || ml >= sizeof num) {
                kvr__cli_usage_err("--groups: want NAME:PHI with an integer PHI");
                return -1;
            }
            memcpy(num, colon + 1, ml);
            num[ml] = 0;
            if (kvr__cli_parse_i64(num, &lay->offsets[n]) < 0) {
                kvr__cli_usage_err("--groups: '%s' is not an integer offset", num);
                return -1;
            }
            *any_offset = true;
        }
        n++;
        if (!end)
            break;
        p = end + 1;
    }
    return (long)n;
}

int kvr__cli_put_layout_opts(const cli_args *a, kvr_put_args *p, cli_put_layout *lay)
{
    memset(lay, 0, sizeof *lay);
    const char *prefix = kvr__cli_opt(a, "prefix-ctx"), *groups = kvr__cli_opt(a, "groups");
    lay->group = kvr__cli_opt(a, "group");
    if (prefix) {
        if (!*prefix)
            return kvr__cli_usage_err("--prefix-ctx: want a context id");
        p->prefix_ctx = prefix;
    }
    if (groups && !lay->group)
        return kvr__cli_usage_err("--groups creates a grouped context: name the group these tokens "
                         "join with --group NAME");
    if (lay->group) {
        if (!*lay->group)
            return kvr__cli_usage_err("--group: want a group name");
        if (kvr__cli_opt(a, "positions") || kvr__cli_opt(a, "pos-start"))
            return kvr__cli_usage_err("--group: the group gives the positions (drop --positions / "
                             "--pos-start)");
        p->positions = NULL;   /* e.g. from the file: the group decides */
        p->has_pos_start = false;
    }
    if (groups) {
        bool any_offset;
        long n = parse_groups(groups, lay, &any_offset);
        if (n < 0)
            return CLI_USAGE;
        p->groups = lay->names;
        p->n_groups = (size_t)n;
        p->group_offsets = any_offset ? lay->offsets : NULL;
    }
    return CLI_OK;
}

/* ---- group -------------------------------------------------------------- */

static int cmd_group(kvr_client *c, const cli_args *a)
{
    const char *sub = a->npos > 0 ? a->pos[0] : "";
    if (!strcmp(sub, "append")) {
        if (a->npos != 4)
            return kvr__cli_usage_err("usage: kvrope group append CONTEXT GROUP FILE [put options]");
        if (kvr__cli_opt(a, "group"))
            return kvr__cli_usage_err("group append: the group is the GROUP argument (drop --group)");
        if (a->nopt == CLI_MAX_OPTS)
            return kvr__cli_usage_err("too many options");
        /* It is a put with --group: same files, options and output. */
        cli_args p = *a;
        p.cmd = "put";
        p.npos = 2;
        p.pos[0] = a->pos[1];
        p.pos[1] = a->pos[3];
        p.opt_name[p.nopt] = "group";
        p.opt_val[p.nopt++] = a->pos[2];
        return kvr__cli_run(c, &p);
    }
    if (!strcmp(sub, "offset")) {
        int64_t phi;
        if (a->npos != 4 || kvr__cli_parse_i64(a->pos[3], &phi) < 0)
            return kvr__cli_usage_err("usage: kvrope group offset CONTEXT GROUP PHI (an integer)");
        kvr_layout_res l;
        int r = kvr_client_set_group_offset(c, a->pos[1], a->pos[2], phi, &l);
        if (r < 0)
            return kvr__cli_fail(a, c, r, "group offset");
        char what[128];
        snprintf(what, sizeof what, "group %s offset %" PRId64, a->pos[2], phi);
        return layout_done(a, a->pos[1], what, &l);
    }
    return kvr__cli_usage_err("usage: kvrope group append CONTEXT GROUP FILE | group offset CONTEXT "
                     "GROUP PHI");
}

/* ---- retain ------------------------------------------------------------- */

static int cmd_retain(kvr_client *c, const cli_args *a)
{
    const char *sv = kvr__cli_opt(a, "sinks"), *wv = kvr__cli_opt(a, "window");
    bool off = kvr__cli_flag(a, "off");
    if (a->npos != 1 || (off && (sv || wv)) || (!off && !wv))
        return kvr__cli_usage_err("usage: kvrope retain CONTEXT [--sinks S] --window W | "
                         "retain CONTEXT --off");
    uint64_t sinks = 0, window = 0;
    if ((sv && kvr__cli_parse_u64(sv, &sinks) < 0) || (wv && kvr__cli_parse_u64(wv, &window) < 0))
        return kvr__cli_usage_err("--sinks/--window: want token counts");
    kvr_layout_res l;
    int r = kvr_client_set_retention(c, a->pos[0], sinks, window, off, &l);
    if (r < 0)
        return kvr__cli_fail(a, c, r, "retain");
    return layout_done(a, a->pos[0], off ? "retention off" : "retention set", &l);
}

/* ---- assemble ----------------------------------------------------------- */

/* The names the output gives segment kinds, and layouts (--layout takes
 * the same). */
static const char *const SEG_KINDS[] = {
    [KVR_SEGMENT_PREFIX] = "prefix", [KVR_SEGMENT_DOCUMENT] = "document",
    [KVR_SEGMENT_QUERY] = "query",
};
static const char *const LAYOUTS[] = {
    [KVR_LAYOUT_PARALLEL] = "parallel", [KVR_LAYOUT_SEQUENTIAL] = "sequential",
    [KVR_LAYOUT_EXPLICIT] = "explicit",
};

static const char *seg_kind(kvr_segment_kind k)
{
    return kvr__cli_enum_name(SEG_KINDS, CLI_COUNT(SEG_KINDS), (int)k);
}

static const char *layout_name(kvr_layout_kind l)
{
    return kvr__cli_enum_name(LAYOUTS, CLI_COUNT(LAYOUTS), (int)l);
}

static cJSON *segments_json(const kvr_assemble_res *r)
{
    cJSON *arr = cJSON_CreateArray();
    for (size_t i = 0; i < r->n_segments; i++) {
        const kvr_segment_res *s = &r->segments[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "kind", seg_kind(s->kind));
        if (s->kind == KVR_SEGMENT_QUERY)
            cJSON_AddNullToObject(o, "context_id");
        else
            cJSON_AddStringToObject(o, "context_id", s->ctx_id);
        if (s->kind == KVR_SEGMENT_DOCUMENT)
            cJSON_AddNumberToObject(o, "doc_index", s->doc_index);
        cJSON_AddNumberToObject(o, "start", (double)s->start);
        cJSON_AddNumberToObject(o, "end", (double)(s->start + s->n_tokens));
        cJSON_AddNumberToObject(o, "n_tokens", (double)s->n_tokens);
        cJSON_AddNumberToObject(o, "pos_first", (double)s->pos_first);
        cJSON_AddNumberToObject(o, "pos_last", (double)s->pos_last);
        cJSON_AddNumberToObject(o, "temperature", s->temperature);
        cJSON_AddNumberToObject(o, "scale", s->scale);
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

static cJSON *assemble_json(const cli_args *a, kvr_layout_kind lay,
                            const kvr_assemble_res *r, const char *file)
{
    const kvr_kv *kv = &r->kv;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "prefix", a->pos[0]);
    cJSON *d = cJSON_AddArrayToObject(j, "documents");
    for (int i = 1; i < a->npos; i++)
        cJSON_AddItemToArray(d, cJSON_CreateString(a->pos[i]));
    cJSON_AddStringToObject(j, "layout", layout_name(lay));
    cJSON_AddStringToObject(j, "model", kv->model);
    cJSON_AddNumberToObject(j, "n_tokens", (double)kv->n_tokens);
    kvr__cli_kv_shape_json(j, kv);
    cJSON_AddNumberToObject(j, "prefix_len", (double)r->prefix_len);
    cJSON_AddNumberToObject(j, "query_pos", (double)r->query_pos);
    cJSON_AddNumberToObject(j, "temperature", r->temperature);
    cJSON_AddNumberToObject(j, "scale", r->scale);
    cJSON_AddBoolToObject(j, "temperature_folded", r->temperature_folded);
    cJSON_AddItemToObject(j, "segments", segments_json(r));
    kvr__cli_kv_rows_json(j, kv, file);
    return j;
}

static void assemble_print(FILE *o, const cli_args *a, kvr_layout_kind lay,
                           const kvr_assemble_res *r, const char *file)
{
    const kvr_kv *kv = &r->kv;
    fprintf(o, "%s + %d document%s (%s): %" PRIu64 " tokens of %s", a->pos[0], a->npos - 1,
            a->npos == 2 ? "" : "s", layout_name(lay), kv->n_tokens, kv->model);
    if (kv->n_layers)   /* none with --meta */
        fprintf(o, ", %zu layers, %s", kv->n_layers, kvr_dtype_name(kv->dtype));
    if (file)
        fprintf(o, ", %zu bytes -> %s", kv->payload_len, file);
    fprintf(o, "\n  %-9s %-20s %-16s %-18s %-8s %s\n", "KIND", "CONTEXT", "TOKENS",
            "POSITIONS", "T", "S");
    for (size_t i = 0; i < r->n_segments; i++) {
        const kvr_segment_res *s = &r->segments[i];
        char range[48], pos[48];
        snprintf(range, sizeof range, "[%" PRIu64 ", %" PRIu64 ")", s->start,
                 s->start + s->n_tokens);
        if (s->kind == KVR_SEGMENT_QUERY || s->n_tokens == 0)
            snprintf(pos, sizeof pos, "%" PRId64 "..", s->pos_first);
        else
            snprintf(pos, sizeof pos, "%" PRId64 "..%" PRId64, s->pos_first, s->pos_last);
        fprintf(o, "  %-9s %-20s %-16s %-18s %-8g %g\n", seg_kind(s->kind),
                s->kind == KVR_SEGMENT_QUERY ? "-" : s->ctx_id, range, pos, s->temperature,
                s->scale);
    }
    fprintf(o, "query starts at position %" PRId64 " (prefix %" PRIu64 " tokens; T = %g, "
            "S = %g; temperature %s)\n", r->query_pos, r->prefix_len, r->temperature,
            r->scale, r->temperature_folded ? "folded into the document keys (k / T)"
                                            : "not folded");
}

/* The .safetensors file: the stream plus the segment table (header comment). */
static int assemble_write_st(const char *path, const cli_args *a, kvr_layout_kind lay,
                             const kvr_assemble_res *r, char *err, size_t errlen)
{
    size_t ns = r->n_segments;
    int64_t *seg = malloc((ns ? ns : 1) * 6 * sizeof *seg);
    double *ts = malloc((ns ? ns : 1) * 2 * sizeof *ts);
    cJSON *docs = cJSON_CreateArray(), *segs = segments_json(r);
    char *docs_s = NULL, *segs_s = NULL;
    int rc = -1;
    for (int i = 1; docs && i < a->npos; i++)
        cJSON_AddItemToArray(docs, cJSON_CreateString(a->pos[i]));
    if (docs)
        docs_s = cJSON_PrintUnformatted(docs);
    if (segs)
        segs_s = cJSON_PrintUnformatted(segs);
    if (!seg || !ts || !docs_s || !segs_s) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < ns; i++) {
        const kvr_segment_res *s = &r->segments[i];
        int64_t row[6] = { (int64_t)s->kind, (int64_t)s->start, (int64_t)s->n_tokens,
                           s->pos_first, s->pos_last,
                           s->kind == KVR_SEGMENT_DOCUMENT ? (int64_t)s->doc_index : -1 };
        memcpy(seg + 6 * i, row, sizeof row);
        ts[2 * i] = s->temperature;
        ts[2 * i + 1] = s->scale;
    }
    char qpos[32], plen[32], temp[40], scale[40];
    snprintf(qpos, sizeof qpos, "%" PRId64, r->query_pos);
    snprintf(plen, sizeof plen, "%" PRIu64, r->prefix_len);
    snprintf(temp, sizeof temp, "%.17g", r->temperature);
    snprintf(scale, sizeof scale, "%.17g", r->scale);
    const char *meta[] = { "kind", "assemble", "layout", layout_name(lay), "prefix", a->pos[0],
                           "documents", docs_s, "query_pos", qpos, "prefix_len", plen,
                           "temperature", temp, "scale", scale, "temperature_folded",
                           r->temperature_folded ? "true" : "false", "segments", segs_s };
    cli_st_extra ex[2] = {
        { .name = "segments", .dtype = "I64", .shape = { ns, 6 }, .ndim = 2, .data = seg,
          .bytes = ns * 6 * sizeof *seg },
        { .name = "segment_ts", .dtype = "F64", .shape = { ns, 2 }, .ndim = 2, .data = ts,
          .bytes = ns * 2 * sizeof *ts },
    };
    rc = kvr__cli_st_write_ex(path, &r->kv, meta, sizeof meta / sizeof meta[0] / 2, ex, 2, err,
                         errlen);
out:
    free(seg);
    free(ts);
    free(docs_s);
    free(segs_s);
    cJSON_Delete(docs);
    cJSON_Delete(segs);
    return rc;
}

static int cmd_assemble(kvr_client *c, const cli_args *a)
{
    if (a->npos < 2)
        return kvr__cli_usage_err("usage: kvrope assemble PREFIX DOC... (-o FILE | --meta) [options]");
    const char *out = kvr__cli_opt(a, "output"), *lv = kvr__cli_opt(a, "layout");
    const char *sv = kvr__cli_opt(a, "starts"), *ls = kvr__cli_opt(a, "layers");
    bool meta = kvr__cli_flag(a, "meta");
    if (!out && !meta)
        return kvr__cli_usage_err("assemble: give -o FILE (.safetensors or raw), or --meta");
    bool to_stdout = out && !meta && !strcmp(out, "-");
    if (to_stdout && a->json)
        return kvr__cli_usage_err("assemble: --json and -o - both want stdout");
    size_t n_docs = (size_t)a->npos - 1;
    kvr_assemble_args g = { .prefix = a->pos[0], .docs = a->pos + 1, .n_docs = n_docs,
                            .layout = KVR_LAYOUT_PARALLEL, .meta_only = meta,
                            .fold_temperature = kvr__cli_flag(a, "fold-temperature") };
    if (lv) {
        int v = kvr__cli_enum_parse(LAYOUTS, CLI_COUNT(LAYOUTS), lv);
        if (v < 0)
            return kvr__cli_usage_err("--layout: want parallel, sequential or explicit");
        g.layout = (kvr_layout_kind)v;
        if (sv && g.layout != KVR_LAYOUT_EXPLICIT)
            return kvr__cli_usage_err("--starts goes with --layout explicit");
        if (!sv && g.layout == KVR_LAYOUT_EXPLICIT)
            return kvr__cli_usage_err("--layout explicit needs --starts S1,S2,.. (one per document)");
    } else if (sv) {
        g.layout = KVR_LAYOUT_EXPLICIT;
    }
    const char *tv = kvr__cli_opt(a, "temperature"), *scv = kvr__cli_opt(a, "scale");
    if (tv && parse_pos_double(tv, &g.temperature) < 0)
        return kvr__cli_usage_err("--temperature: want a positive number");
    if (scv && parse_pos_double(scv, &g.scale) < 0)
        return kvr__cli_usage_err("--scale: want a positive number");
    const char *dv = kvr__cli_opt(a, "dtype");
    if (dv && kvr_dtype_parse(dv, &g.dtype) != 0)
        return kvr__cli_usage_err("--dtype: want f32, f16 or bf16");
    int64_t *starts = NULL;
    uint32_t *layers = NULL;
    if (sv) {
        long n = kvr__cli_parse_i64_list(sv, &starts);
        if (n < 0)
            return kvr__cli_usage_err("--starts: want comma-separated integers");
        if ((size_t)n != n_docs) {
            free(starts);
            return kvr__cli_usage_err("--starts: %ld values for %zu documents (want one each)", n,
                             n_docs);
        }
        g.starts = starts;
    }
    int r, rc = kvr__cli_opt_layers(ls, &layers, &g.n_layers);
    if (rc != CLI_OK) {
        free(starts);
        return rc;
    }
    g.layers = layers;
    if (!dv) {   /* default: the model's native dtype */
        kvr_context x;
        kvr_model m;
        if ((r = kvr__cli_ctx_model(c, g.prefix, &x, &m)) < 0) {
            rc = kvr__cli_fail(a, c, r, "assemble");
            goto out;
        }
        g.dtype = m.dtype;
    }
    kvr_assemble_res res;
    kvr__cli_progress_begin(c, "assemble");
    r = kvr_client_assemble(c, &g, &res);
    kvr__cli_progress_end();
    if (r < 0) {
        rc = kvr__cli_fail(a, c, r, "assemble");
        goto out;
    }
    rc = CLI_OK;
    const char *file = meta ? NULL : out;
    if (file) {
        char err[400];
        int w;
        if (kvr__cli_has_suffix(file, ".safetensors")) {
            w = assemble_write_st(file, a, g.layout, &res, err, sizeof err);
        } else {
            struct iovec iov = { res.kv.payload, res.kv.payload_len };
            w = kvr__cli_write_iov(file, &iov, 1, err, sizeof err);
        }
        if (w < 0)
            rc = kvr__cli_io_err(a, err);
    }
    if (rc == CLI_OK) {
        if (a->json)
            kvr__cli_print_json(assemble_json(a, g.layout, &res, file));
        else if (!a->quiet)
            assemble_print(to_stdout ? stderr : stdout, a, g.layout, &res, file);
    }
    kvr_assemble_release(&res);
out:
    free(starts);
    free(layers);
    return rc;
}

int kvr__cli_layout_run(kvr_client *c, const cli_args *a)
{
    const char *k = a->cmd;
    if (!strcmp(k, "assemble")) return cmd_assemble(c, a);
    if (!strcmp(k, "group"))    return cmd_group(c, a);
    if (!strcmp(k, "retain"))   return cmd_retain(c, a);
    return kvr__cli_usage_err("unknown command '%s'", k);
}
