/*
 * cli_cmd.c — the `kvrope` subcommands that talk to kvroped. Each prints a
 * human-readable result, or one JSON document on stdout with --json, and
 * returns an exit code (cli.h). Errors go to stderr; with --json they are
 * also printed to stdout as {"error": {...}} so scripts see one document.
 */
#include "base/clock.h"
#include "client/cli/cli.h"
#include "client/cli/cli_parse.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- output helpers ----------------------------------------------------- */

void kvr__cli_print_json(struct cJSON *j)
{
    char *s = cJSON_Print(j);
    if (s) {
        fputs(s, stdout);
        fputc('\n', stdout);
        free(s);
    }
    cJSON_Delete(j);
}

int kvr__cli_io_err(const cli_args *a, const char *msg)
{
    fprintf(stderr, "kvrope: %s\n", msg);
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON *e = cJSON_AddObjectToObject(j, "error");
        cJSON_AddStringToObject(e, "name", "io");
        cJSON_AddStringToObject(e, "message", msg);
        kvr__cli_print_json(j);
    }
    return CLI_ERR;
}

void kvr__cli_error_json(const cli_args *a, int code, const char *msg)
{
    if (!a->json)
        return;
    cJSON *j = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(j, "error");
    cJSON_AddNumberToObject(e, "code", code);
    cJSON_AddStringToObject(e, "name", kvr_error_name(code));
    cJSON_AddStringToObject(e, "message", msg);
    kvr__cli_print_json(j);
}

int kvr__cli_fail(const cli_args *a, kvr_client *c, int code, const char *what)
{
    const char *msg = kvr_client_last_error(c);
    if (!msg || !*msg)
        msg = kvr_strerror(code);
    fprintf(stderr, "kvrope: %s: %s (%s)\n", what, msg, kvr_error_name(code));
    kvr__cli_error_json(a, code, msg);
    if (code == KVR_ENOCTX || code == KVR_ENOMODEL)
        return CLI_NOTFOUND;
    if (code == KVR_EINVAL && c == NULL)
        return CLI_USAGE;
    return CLI_ERR;
}

static void human_bytes(char *buf, size_t cap, double b)
{
    const char *u[] = { "B", "KiB", "MiB", "GiB", "TiB" };
    int i = 0;
    while (b >= 1024.0 && i < 4) {
        b /= 1024.0;
        i++;
    }
    snprintf(buf, cap, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

/* ---- progress bar ------------------------------------------------------- */

static struct {
    bool            active, drawn;
    const char     *label;
    double          t0, last;       /* kvr_clock_mono_msf */
} prog;

static void on_progress(void *ud, uint64_t done, uint64_t total)
{
    (void)ud;
    if (!prog.active || total == 0)
        return;
    double now = kvr_clock_mono_msf();
    double el = (now - prog.t0) / 1e3;
    /* Only transfers that take more than a moment get a bar, redrawn at 10 Hz. */
    if (el < 0.3 || (prog.drawn && now - prog.last < 100 && done < total))
        return;
    prog.last = now;
    prog.drawn = true;
    int width = 30, fill = (int)((double)done / (double)total * width);
    char bar[64], rate[32], tot[32];
    for (int i = 0; i < width; i++)
        bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
    bar[width] = 0;
    human_bytes(rate, sizeof rate, el > 0 ? (double)done / el : 0);
    human_bytes(tot, sizeof tot, (double)total);
    fprintf(stderr, "\r%s [%s] %3d%% of %s  %s/s ", prog.label, bar,
            (int)((double)done * 100.0 / (double)total), tot, rate);
    fflush(stderr);
}

void kvr__cli_progress_begin(kvr_client *c, const char *label)
{
    if (!isatty(2))
        return;
    prog.active = true;
    prog.drawn = false;
    prog.label = label;
    prog.t0 = kvr_clock_mono_msf();
    kvr_client_set_progress(c, on_progress, NULL);
}

void kvr__cli_progress_end(void)
{
    if (prog.drawn)
        fputc('\n', stderr);
    prog.active = prog.drawn = false;
}

/* ---- option helpers ----------------------------------------------------- */

static int opt_u64(const cli_args *a, const char *name, uint64_t *out, bool *present)
{
    const char *v = kvr__cli_opt(a, name);
    if (present)
        *present = v != NULL;
    return v ? kvr__cli_parse_u64(v, out) : 0;
}

static int opt_i64(const cli_args *a, const char *name, int64_t *out, bool *present)
{
    const char *v = kvr__cli_opt(a, name);
    if (present)
        *present = v != NULL;
    return v ? kvr__cli_parse_i64(v, out) : 0;
}

int kvr__cli_parse_i64(const char *v, int64_t *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 0);
    if (errno || end == v || *end)
        return -1;
    *out = x;
    return 0;
}

int kvr__cli_parse_u64(const char *v, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno || end == v || *end || v[0] == '-')
        return -1;
    *out = x;
    return 0;
}

static int opt_dtype(const cli_args *a, kvr_dtype *out, bool *present)
{
    const char *v = kvr__cli_opt(a, "dtype");
    *present = v != NULL;
    if (!v)
        return 0;
    return kvr_dtype_parse(v, out) == 0 ? 0 : -1;
}

/* ---- JSON of the public structs ---------------------------------------- */

static const char *style_name(kvr_rope_style s) { return s == KVR_ROPE_GPTJ ? "gptj" : "neox"; }

static const char *scaling_name(kvr_rope_scaling s)
{
    static const char *n[] = { "default", "linear", "dynamic", "yarn", "longrope", "llama3" };
    return (unsigned)s < 6 ? n[s] : "?";
}

static cJSON *model_json(const kvr_model *m)
{
    cJSON *j = cJSON_CreateObject();
    char fp[32];
    snprintf(fp, sizeof fp, "%016" PRIx64, m->fingerprint);
    cJSON_AddStringToObject(j, "name", m->name);
    cJSON_AddNumberToObject(j, "n_layers", m->n_layers);
    cJSON_AddNumberToObject(j, "n_kv_heads", m->n_kv_heads);
    cJSON_AddNumberToObject(j, "head_dim", m->head_dim);
    cJSON_AddStringToObject(j, "dtype", kvr_dtype_name(m->dtype));
    cJSON_AddStringToObject(j, "fingerprint", fp);
    cJSON_AddNumberToObject(j, "n_contexts", (double)m->n_contexts);
    cJSON_AddStringToObject(j, "codec", m->codec);
    cJSON *r = cJSON_AddObjectToObject(j, "rope");
    cJSON_AddStringToObject(r, "style", style_name(m->rope.style));
    cJSON_AddNumberToObject(r, "theta", m->rope.theta);
    cJSON_AddNumberToObject(r, "rotary_dim", m->rope.rotary_dim);
    cJSON_AddStringToObject(r, "scaling", scaling_name(m->rope.scaling));
    if (m->rope.scaling != KVR_ROPE_SCALING_DEFAULT)
        cJSON_AddNumberToObject(r, "factor", m->rope.factor);
    cJSON_AddStringToObject(r, "model_type", m->rope.model_type);
    if (m->rope.n_layer_kinds > 0) {
        /* per-layer RoPE: "global", "local" (base local_theta) or "none" */
        static const char *const kinds[] = { "global", "local", "none" };
        cJSON *ls = cJSON_AddArrayToObject(r, "layers");
        for (int32_t l = 0; l < m->rope.n_layer_kinds && l < KVR_ROPE_MAX_LAYERS; l++)
            cJSON_AddItemToArray(ls, cJSON_CreateString(
                m->rope.layer_kind[l] <= 2 ? kinds[m->rope.layer_kind[l]] : "?"));
        if (!isnan(m->rope.local_theta))
            cJSON_AddNumberToObject(r, "local_theta", m->rope.local_theta);
    }
    return j;
}

void kvr__cli_kv_shape_json(cJSON *j, const kvr_kv *kv)
{
    cJSON_AddStringToObject(j, "dtype", kvr_dtype_name(kv->dtype));
    cJSON_AddNumberToObject(j, "n_kv_heads", kv->n_kv_heads);
    cJSON_AddNumberToObject(j, "head_dim", kv->head_dim);
    cJSON *ls = cJSON_AddArrayToObject(j, "layers");
    for (size_t i = 0; i < kv->n_layers; i++)
        cJSON_AddItemToArray(ls, cJSON_CreateNumber(kv->layers[i]));
}

void kvr__cli_kv_rows_json(cJSON *j, const kvr_kv *kv, const char *file)
{
    cJSON *t = cJSON_AddArrayToObject(j, "tokens");
    cJSON *p = cJSON_AddArrayToObject(j, "positions");
    cJSON *f = cJSON_AddArrayToObject(j, "flags");
    for (size_t i = 0; i < kv->n_tokens; i++) {
        cJSON_AddItemToArray(t, cJSON_CreateNumber(kv->tokens[i]));
        cJSON_AddItemToArray(p, cJSON_CreateNumber((double)kv->positions[i]));
        cJSON_AddItemToArray(f, cJSON_CreateNumber(kv->flags[i]));
    }
    cJSON_AddNumberToObject(j, "payload_bytes", (double)kv->payload_len);
    if (file)
        cJSON_AddStringToObject(j, "file", file);
}

int kvr__cli_ctx_model(kvr_client *c, const char *ctx, kvr_context *x, kvr_model *m)
{
    int r = kvr_client_stat(c, ctx, x);
    return r < 0 ? r : kvr_client_model_get(c, x->model, m);
}

static cJSON *ctx_json(const kvr_context *x)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", x->id);
    cJSON_AddStringToObject(j, "model", x->model);
    cJSON_AddNumberToObject(j, "n_tokens", (double)x->n_tokens);
    cJSON_AddNumberToObject(j, "n_blocks", (double)x->n_blocks);
    cJSON_AddNumberToObject(j, "n_shared_blocks", (double)x->n_shared_blocks);
    cJSON_AddNumberToObject(j, "n_approximate", (double)x->n_approximate);
    cJSON_AddNumberToObject(j, "bytes", (double)x->bytes);
    cJSON_AddBoolToObject(j, "pinned", x->pinned);
    cJSON_AddBoolToObject(j, "busy", x->busy);
    cJSON_AddNumberToObject(j, "pos_min", (double)x->pos_min);
    cJSON_AddNumberToObject(j, "pos_max", (double)x->pos_max);
    cJSON_AddNumberToObject(j, "created_ms", (double)x->created_ms);
    cJSON_AddNumberToObject(j, "accessed_ms", (double)x->accessed_ms);
    cJSON_AddNumberToObject(j, "n_evicted_tokens", (double)x->n_evicted_tokens);
    return j;
}

static cJSON *kv_json(const kvr_kv *kv, const char *file)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "context_id", kv->ctx_id);
    cJSON_AddStringToObject(j, "model", kv->model);
    cJSON_AddNumberToObject(j, "start", (double)kv->start);
    cJSON_AddNumberToObject(j, "n_tokens", (double)kv->n_tokens);
    kvr__cli_kv_shape_json(j, kv);
    kvr__cli_kv_rows_json(j, kv, file);
    return j;
}

/* ---- commands ----------------------------------------------------------- */

static int cmd_ping(kvr_client *c, const cli_args *a)
{
    kvr_pong p;
    double t0 = kvr_clock_mono_msf();
    int r = kvr_client_ping(c, &p);
    double ms = kvr_clock_mono_msf() - t0;
    if (r < 0)
        return kvr__cli_fail(a, c, r, "ping");
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "server", p.server);
        cJSON_AddNumberToObject(j, "protocol", p.protocol);
        cJSON_AddNumberToObject(j, "rtt_ms", ms);
        kvr__cli_print_json(j);
    } else {
        printf("%s, protocol %u, %.3f ms\n", p.server, p.protocol, ms);
    }
    return CLI_OK;
}

static int cmd_stats(kvr_client *c, const cli_args *a)
{
    kvr_metric *m;
    size_t n;
    int r = kvr_client_stats(c, &m, &n);
    if (r < 0)
        return kvr__cli_fail(a, c, r, "stats");
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        for (size_t i = 0; i < n; i++)
            cJSON_AddNumberToObject(j, m[i].name, m[i].value);
        kvr__cli_print_json(j);
    } else {
        for (size_t i = 0; i < n; i++) {
            char hb[32] = "";
            if (strstr(m[i].name, "bytes"))
                human_bytes(hb, sizeof hb, m[i].value);
            printf("%-28s %.15g%s%s%s\n", m[i].name, m[i].value, hb[0] ? "  (" : "", hb,
                   hb[0] ? ")" : "");
        }
    }
    kvr_client_free(m);
    return CLI_OK;
}

static void print_model(const kvr_model *m)
{
    printf("%-20s layers=%u kv_heads=%u head_dim=%u dtype=%s rope=%s/%s theta=%g rot=%d "
           "contexts=%" PRIu64 " fp=%016" PRIx64 "%s%s\n",
           m->name, m->n_layers, m->n_kv_heads, m->head_dim, kvr_dtype_name(m->dtype),
           style_name(m->rope.style), scaling_name(m->rope.scaling), m->rope.theta,
           m->rope.rotary_dim, m->n_contexts, m->fingerprint, " codec=", m->codec);
}

/* Explicit --theta / --rotary-dim override what a config.json says (as the
 * protocol's explicit fields do): written into the text the daemon parses,
 * in the object transformers reads the text model from (text_config for a
 * composite config), and into rope_parameters when it carries rope_theta
 * (transformers v5). Returns a malloc'ed text, or NULL (out of memory, or
 * not a JSON object: then the daemon reports the config as it is). */
static char *config_overrides(const char *json, size_t len, const char *theta,
                              const char *rot)
{
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return NULL;
    }
    cJSON *o = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    if (!cJSON_IsObject(o))
        o = root;
    if (theta) {
        double th = strtod(theta, NULL);
        cJSON_DeleteItemFromObjectCaseSensitive(o, "rope_theta");
        cJSON_DeleteItemFromObjectCaseSensitive(o, "rotary_emb_base");
        cJSON_AddNumberToObject(o, "rope_theta", th);
        cJSON *rp = cJSON_GetObjectItemCaseSensitive(o, "rope_parameters");
        if (cJSON_IsObject(rp)) {
            cJSON *full = cJSON_GetObjectItemCaseSensitive(rp, "full_attention");
            if (cJSON_IsObject(full))
                rp = full;
            cJSON_DeleteItemFromObjectCaseSensitive(rp, "rope_theta");
            cJSON_AddNumberToObject(rp, "rope_theta", th);
        }
    }
    if (rot) {
        cJSON_DeleteItemFromObjectCaseSensitive(o, "rotary_dim");
        cJSON_AddNumberToObject(o, "rotary_dim", strtod(rot, NULL));
    }
    char *out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

static int cmd_models(kvr_client *c, const cli_args *a)
{
    const char *sub = a->npos > 0 ? a->pos[0] : "list";
    if (strcmp(sub, "add") == 0) {
        if (a->npos != 2)
            return kvr__cli_usage_err("usage: kvrope models add NAME --config config.json");
        kvr_dtype dt = KVR_DTYPE_F16;
        bool has_dt;
        if (opt_dtype(a, &dt, &has_dt) < 0)
            return kvr__cli_usage_err("--dtype: want f32, f16 or bf16");
        const char *cfg = kvr__cli_opt(a, "config"), *style = kvr__cli_opt(a, "style");
        if (style && strcmp(style, "neox") && strcmp(style, "gptj"))
            return kvr__cli_usage_err("--style: want neox or gptj");
        uint64_t L = 0, H = 0, D = 0;
        double theta = 10000.0;
        const char *th = kvr__cli_opt(a, "theta");
        if (opt_u64(a, "layers", &L, NULL) < 0 || opt_u64(a, "heads", &H, NULL) < 0 ||
            opt_u64(a, "head-dim", &D, NULL) < 0 || L > UINT32_MAX || H > UINT32_MAX ||
            D > UINT32_MAX)
            return kvr__cli_usage_err("--layers/--heads/--head-dim: want positive integers");
        if (th && (theta = strtod(th, NULL)) <= 0)
            return kvr__cli_usage_err("--theta: want a positive number");
        if (!cfg && !(L && H && D))
            return kvr__cli_usage_err("models add: give --config FILE, or --layers, --heads and "
                             "--head-dim");
        kvr_model m;
        const char *codec = kvr__cli_opt(a, "codec");
        int r;
        const char *rot_s = kvr__cli_opt(a, "rotary-dim");
        if (cfg && !L && !H && !D && !codec && !th && !rot_s) {
            r = kvr_client_model_register_file(c, a->pos[1], cfg, style, dt, &m);
        } else {
            kvr_rope_config rc;
            kvr_rope_config_init(&rc);
            rc.theta = theta;
            rc.style = style && !strcmp(style, "gptj") ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX;
            uint64_t rot = 0;
            if (opt_u64(a, "rotary-dim", &rot, NULL) < 0)
                return kvr__cli_usage_err("--rotary-dim: want an integer");
            rc.rotary_dim = (int32_t)rot;
            char *json = NULL;
            if (cfg) {
                cli_mapped mf;
                char err[256];
                if (kvr__cli_map_file(cfg, &mf, err, sizeof err) < 0)
                    return kvr__cli_io_err(a, err);
                if (th || rot_s)
                    json = config_overrides(mf.base ? mf.base : "", mf.len, th, rot_s);
                if (!json && (json = malloc(mf.len + 1))) {
                    memcpy(json, mf.base, mf.len);
                    json[mf.len] = 0;
                }
                kvr__cli_unmap(&mf);
            }
            kvr_model_params p = { .name = a->pos[1], .config_json = json, .style = style,
                                   .n_layers = (uint32_t)L, .n_kv_heads = (uint32_t)H,
                                   .head_dim = (uint32_t)D, .dtype = dt,
                                   .rope = json ? NULL : &rc, .codec = codec };
            if (cfg && !json)
                return kvr__cli_io_err(a, "out of memory");
            r = kvr_client_model_register(c, &p, &m);
            free(json);
        }
        if (r < 0)
            return kvr__cli_fail(a, c, r, "models add");
        if (a->json)
            kvr__cli_print_json(model_json(&m));
        else
            print_model(&m);
        return CLI_OK;
    }
    if (!strcmp(sub, "rm") || !strcmp(sub, "remove")) {
        if (a->npos != 2)
            return kvr__cli_usage_err("usage: kvrope models rm NAME");
        int r = kvr_client_model_remove(c, a->pos[1]);
        if (r < 0)
            return kvr__cli_fail(a, c, r, "models rm");
        if (a->json) {
            cJSON *j = cJSON_CreateObject();
            cJSON_AddStringToObject(j, "removed", a->pos[1]);
            kvr__cli_print_json(j);
        } else if (!a->quiet) {
            printf("removed model %s\n", a->pos[1]);
        }
        return CLI_OK;
    }
    if (strcmp(sub, "list") && strcmp(sub, "ls"))
        return kvr__cli_usage_err("models: unknown subcommand '%s' (list, add, rm)", sub);
    kvr_model *ms;
    size_t n;
    int r = kvr_client_model_list(c, &ms, &n);
    if (r < 0)
        return kvr__cli_fail(a, c, r, "models");
    if (a->json) {
        cJSON *arr = cJSON_CreateArray();
        for (size_t i = 0; i < n; i++)
            cJSON_AddItemToArray(arr, model_json(&ms[i]));
        kvr__cli_print_json(arr);
    } else {
        if (n == 0)
            printf("(no models)\n");
        for (size_t i = 0; i < n; i++)
            print_model(&ms[i]);
    }
    kvr_client_free(ms);
    return CLI_OK;
}

static void print_ctx_row(const kvr_context *x)
{
    char b[32];
    human_bytes(b, sizeof b, (double)x->bytes);
    printf("%-24s %-16s %8" PRIu64 " %8" PRId64 "..%-8" PRId64 " %10s %s%s\n", x->id, x->model,
           x->n_tokens, x->pos_min, x->pos_max, b, x->pinned ? "pinned" : "",
           x->n_shared_blocks ? " shared" : "");
}

static int cmd_ls(kvr_client *c, const cli_args *a)
{
    kvr_context *xs;
    size_t n;
    int r = kvr_client_list(c, kvr__cli_opt(a, "model"), &xs, &n);
    if (r < 0)
        return kvr__cli_fail(a, c, r, "ls");
    if (a->json) {
        cJSON *arr = cJSON_CreateArray();
        for (size_t i = 0; i < n; i++)
            cJSON_AddItemToArray(arr, ctx_json(&xs[i]));
        kvr__cli_print_json(arr);
    } else {
        printf("%-24s %-16s %8s %18s %10s\n", "ID", "MODEL", "TOKENS", "POSITIONS", "BYTES");
        for (size_t i = 0; i < n; i++)
            print_ctx_row(&xs[i]);
    }
    kvr_client_free(xs);
    return CLI_OK;
}

static int cmd_stat(kvr_client *c, const cli_args *a)
{
    if (a->npos != 1)
        return kvr__cli_usage_err("usage: kvrope stat CONTEXT");
    kvr_context x;
    int r = kvr_client_stat(c, a->pos[0], &x);
    const kvr_context *cc = &x;
    if (r < 0)
        return kvr__cli_fail(a, c, r, "stat");
    if (a->json) {
        cJSON *j = ctx_json(&x);
        cJSON_AddStringToObject(j, "codec", cc->codec);
        cJSON_AddBoolToObject(j, "quantized", cc->quantized);
        cJSON_AddNumberToObject(j, "n_window", (double)cc->n_window);
        cJSON_AddNumberToObject(j, "kv_bytes", (double)cc->kv_bytes);
        cJSON_AddNumberToObject(j, "bytes_saved", (double)cc->bytes_saved);
        cJSON_AddNumberToObject(j, "bits_per_value", cc->bits_per_value);
        cJSON_AddNumberToObject(j, "rel_rms_k", cc->rel_rms_k);
        cJSON_AddNumberToObject(j, "rel_rms_v", cc->rel_rms_v);
        cJSON_AddBoolToObject(j, "v_trans", cc->v_trans);
        kvr__cli_layout_stat_json(c, a->pos[0], j);
        kvr__cli_print_json(j);
    } else {
        char b[32];
        human_bytes(b, sizeof b, (double)x.bytes);
        printf("id:           %s\nmodel:        %s\ntokens:       %" PRIu64
               "\npositions:    %" PRId64 "..%" PRId64 "\nblocks:       %" PRIu64
               " (%" PRIu64 " shared)\napproximate:  %" PRIu64 "\nbytes:        %s\n"
               "pinned:       %s\nevicted:      %" PRIu64 " tokens\n",
               x.id, x.model, x.n_tokens, x.pos_min, x.pos_max, x.n_blocks, x.n_shared_blocks,
               x.n_approximate, b, x.pinned ? "yes" : "no", x.n_evicted_tokens);
        char kb[32], sb[32];
        human_bytes(kb, sizeof kb, (double)cc->kv_bytes);
        human_bytes(sb, sizeof sb, (double)cc->bytes_saved);
        printf("codec:        %s\n", cc->codec);
        if (cc->quantized)
            printf("window:       %" PRIu64 " tokens in full precision\n"
                   "kv bytes:     %s (%.3f bits/value), %s saved\n"
                   "rel. RMS:     K %.4g, V %.4g\n",
                   cc->n_window, kb, cc->bits_per_value, sb, cc->rel_rms_k, cc->rel_rms_v);
        if (cc->v_trans)
            printf("V layout:     imported transposed (flash attention off): llama export "
                   "writes v_trans 1\n");
        kvr__cli_layout_stat_print(c, a->pos[0]);
    }
    return CLI_OK;
}

int kvr__cli_load_tokens(const cli_args *a, uint32_t **tok, long *n, bool required)
{
    const char *tl = kvr__cli_opt(a, "tokens"), *tf = kvr__cli_opt(a, "tokens-file");
    *tok = NULL;
    *n = -1;
    if (tl && tf)
        return kvr__cli_usage_err("give --tokens or --tokens-file, not both");
    if (tl) {
        *n = kvr__cli_parse_u32_list(tl, tok);
        if (*n < 0)
            return kvr__cli_usage_err("--tokens: want comma-separated unsigned integers");
    } else if (tf) {
        char err[300];
        *n = kvr__cli_read_tokens_file(tf, tok, err, sizeof err);
        if (*n < 0) {
            fprintf(stderr, "kvrope: %s\n", err);
            return CLI_ERR;
        }
    } else if (required) {
        return kvr__cli_usage_err("--tokens or --tokens-file is required");
    }
    return CLI_OK;
}

static int cmd_put(kvr_client *c, const cli_args *a)
{
    if (a->npos != 2)
        return kvr__cli_usage_err("usage: kvrope put CONTEXT FILE --model M [options]");
    const char *ctx = a->pos[0], *file = a->pos[1];
    bool st_file = kvr__cli_has_suffix(file, ".safetensors");
    kvr_put_args p = { .ctx_id = ctx, .model = kvr__cli_opt(a, "model"), .mode = KVR_PUT_UPSERT };
    const char *mode = kvr__cli_opt(a, "mode");
    if (mode) {
        if (!strcmp(mode, "create")) p.mode = KVR_PUT_CREATE;
        else if (!strcmp(mode, "append")) p.mode = KVR_PUT_APPEND;
        else if (!strcmp(mode, "upsert")) p.mode = KVR_PUT_UPSERT;
        else if (!strcmp(mode, "replace")) p.mode = KVR_PUT_REPLACE;
        else return kvr__cli_usage_err("--mode: want create, append, upsert or replace");
    }
    p.pin = kvr__cli_flag(a, "pin");
    bool has_protect;
    if (opt_u64(a, "protect", &p.protect_first, &has_protect) < 0)
        return kvr__cli_usage_err("--protect: want a token count");
    p.has_protect = has_protect;
    p.codec = kvr__cli_opt(a, "codec");   /* create: storage codec (docs/quantized.md) */
    const char *fp = kvr__cli_opt(a, "fingerprint");
    if (fp) {
        char *end;
        p.fingerprint = strtoull(fp, &end, 16);
        if (*end || end == fp)
            return kvr__cli_usage_err("--fingerprint: want hex digits");
    }
    bool has_dt;
    kvr_dtype dt = KVR_DTYPE_F16;
    if (opt_dtype(a, &dt, &has_dt) < 0)
        return kvr__cli_usage_err("--dtype: want f32, f16 or bf16");
    uint64_t L = 0, H = 0, D = 0;
    if (opt_u64(a, "layers", &L, NULL) < 0 || opt_u64(a, "heads", &H, NULL) < 0 ||
        opt_u64(a, "head-dim", &D, NULL) < 0 || L > UINT32_MAX || H > UINT32_MAX ||
        D > UINT32_MAX)
        return kvr__cli_usage_err("--layers/--heads/--head-dim: want integers");
    if (opt_i64(a, "pos-start", &p.pos_start, &p.has_pos_start) < 0)
        return kvr__cli_usage_err("--pos-start: want an integer");
    int64_t *positions = NULL;
    const char *pl = kvr__cli_opt(a, "positions");
    long npos = pl ? kvr__cli_parse_i64_list(pl, &positions) : -1;
    if (pl && npos < 0)
        return kvr__cli_usage_err("--positions: want comma-separated integers");
    uint32_t *tokens = NULL;
    long ntok;
    int rc = kvr__cli_load_tokens(a, &tokens, &ntok, !st_file);
    if (rc != CLI_OK) {
        free(positions);
        return rc;
    }
    char err[400];
    cli_st_kv st = { 0 };
    cli_mapped raw = { 0 };
    cli_npy npy = { 0 };
    struct iovec *iov = NULL;
    kvr_model m;
    int r;
    rc = CLI_OK;
    if (st_file) {
        if (kvr__cli_st_read(file, &st, err, sizeof err) < 0) {
            rc = kvr__cli_io_err(a, err);
            goto out;
        }
        if (!p.model && st.model[0])
            p.model = st.model;
        if (ntok < 0) {
            if (!st.tokens) {
                rc = kvr__cli_usage_err("%s has no 'tokens' tensor: give --tokens", file);
                goto out;
            }
            ntok = (long)st.n_tokens;
            tokens = st.tokens;
            st.tokens = NULL;
        }
        if ((size_t)ntok != st.n_tokens) {
            rc = kvr__cli_usage_err("token count does not match the tensors in %s", file);
            goto out;
        }
        if (!positions && !p.has_pos_start && st.positions) {
            positions = st.positions;
            npos = ntok;
            st.positions = NULL;
        }
        if (has_dt && dt != st.dtype) {
            rc = kvr__cli_usage_err("--dtype differs from the tensors' dtype in %s", file);
            goto out;
        }
        p.dtype = st.dtype;
        p.n_layers = st.n_layers;
        p.n_kv_heads = st.n_heads;
        p.head_dim = st.head_dim;
        iov = malloc((2 * (size_t)st.n_layers + 1) * sizeof *iov);
        if (!iov) {
            rc = kvr__cli_io_err(a, "out of memory");
            goto out;
        }
        size_t slab = kvr_payload_size(1, st.n_tokens, st.n_heads, st.head_dim, st.dtype) / 2;
        for (uint32_t l = 0; l < st.n_layers; l++) {
            iov[2 * l] = (struct iovec){ (void *)(uintptr_t)(st.k + l * slab), slab };
            iov[2 * l + 1] = (struct iovec){ (void *)(uintptr_t)(st.v + l * slab), slab };
        }
        p.iov = iov;
        p.iovcnt = 2 * (size_t)st.n_layers;
    } else if (kvr__cli_has_suffix(file, ".npy")) {
        /* [layers, 2, tokens, heads, dim]: the raw payload with its shape. */
        uint32_t nl, nh, nd;
        size_t nt;
        kvr_dtype ndt;
        if (kvr__cli_npy_read(file, &npy, err, sizeof err) < 0 ||
            kvr__cli_npy_kv_shape(&npy, file, &ndt, &nl, &nt, &nh, &nd, err, sizeof err) < 0) {
            rc = kvr__cli_io_err(a, err);
            goto out;
        }
        if (nt != (size_t)ntok) {
            rc = kvr__cli_usage_err("%s holds %zu tokens, --tokens gives %ld", file, nt, ntok);
            goto out;
        }
        if (has_dt && dt != ndt) {
            rc = kvr__cli_usage_err("--dtype differs from the array's dtype in %s", file);
            goto out;
        }
        p.dtype = ndt;
        p.n_layers = nl;
        p.n_kv_heads = nh;
        p.head_dim = nd;
        p.payload = npy.data ? (const void *)npy.data : "";
        p.payload_len = npy.data_len;
    } else {
        if (kvr__cli_map_file(file, &raw, err, sizeof err) < 0) {
            rc = kvr__cli_io_err(a, err);
            goto out;
        }
        if (!p.model) {
            rc = kvr__cli_usage_err("put: --model is required");
            goto out;
        }
        if (!(L && H && D) || !has_dt) {   /* the rest of the shape from the model */
            r = kvr_client_model_get(c, p.model, &m);
            if (r < 0) {
                rc = kvr__cli_fail(a, c, r, "put");
                goto out;
            }
            if (!L) L = m.n_layers;
            if (!H) H = m.n_kv_heads;
            if (!D) D = m.head_dim;
            if (!has_dt) dt = m.dtype;
        }
        p.dtype = dt;
        p.n_layers = (uint32_t)L;
        p.n_kv_heads = (uint32_t)H;
        p.head_dim = (uint32_t)D;
        p.payload = raw.base ? raw.base : "";
        p.payload_len = raw.len;
        size_t want = kvr_payload_size(p.n_layers, (size_t)ntok, p.n_kv_heads, p.head_dim, dt);
        if (want != raw.len) {
            snprintf(err, sizeof err, "%s: %zu bytes, but %ld tokens x %u layers x %u heads x "
                     "%u dims x K,V in %s need %zu", file, raw.len, ntok, p.n_layers,
                     p.n_kv_heads, p.head_dim, kvr_dtype_name(dt), want);
            rc = kvr__cli_io_err(a, err);
            goto out;
        }
    }
    if (!p.model) {
        rc = kvr__cli_usage_err("put: --model is required");
        goto out;
    }
    if (positions && npos != ntok) {
        rc = kvr__cli_usage_err("--positions: need one per token");
        goto out;
    }
    p.tokens = tokens;
    p.n_tokens = (size_t)ntok;
    p.positions = positions;
    cli_put_layout lay;   /* --prefix-ctx, --group, --groups (cli_layout.c) */
    rc = kvr__cli_put_layout_opts(a, &p, &lay);
    if (rc != CLI_OK)
        goto out;
    kvr_put_res res;
    kvr__cli_progress_begin(c, "put");
    p.persist = kvr__cli_flag(a, "persist");
    p.share = kvr__cli_flag(a, "share");
    p.share_sync = kvr__cli_flag(a, "share-sync");
    if (kvr__cli_flag(a, "shm")) {
        /* The payload through a memfd region instead of the socket. */
        uint64_t len = p.payload_len;
        for (size_t i = 0; p.iov && i < p.iovcnt; i++)
            len += p.iov[i].iov_len;
        uint32_t id;
        void *base;
        r = kvr_client_region_create(c, len ? (size_t)len : 1, &id, &base);
        if (r < 0) {
            kvr__cli_progress_end();
            rc = kvr__cli_fail(a, c, r, "put --shm");
            goto out;
        }
        uint8_t *d = base;
        if (p.payload)
            memcpy(d, p.payload, p.payload_len);
        for (size_t i = 0; p.iov && i < p.iovcnt; i++) {
            memcpy(d, p.iov[i].iov_base, p.iov[i].iov_len);
            d += p.iov[i].iov_len;
        }
        kvr_shm at = { id, 0, len };
        kvr_client_shm_next(c, &at);
    }
    r = lay.group ? kvr_client_group_append(c, &p, lay.group, &res)
                  : kvr_client_put(c, &p, &res);
    kvr__cli_progress_end();
    if (r < 0) {
        rc = kvr__cli_fail(a, c, r, "put");
        goto out;
    }
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "context_id", ctx);
        cJSON_AddNumberToObject(j, "n_tokens", (double)res.n_tokens);
        cJSON_AddNumberToObject(j, "first_index", (double)res.first_index);
        cJSON_AddNumberToObject(j, "first_pos", (double)res.first_pos);
        cJSON_AddNumberToObject(j, "last_pos", (double)res.last_pos);
        if (has_protect)
            cJSON_AddNumberToObject(j, "protected", (double)p.protect_first);
        kvr__cli_print_json(j);
    } else if (!a->quiet) {
        printf("%s: put %ld tokens at positions %" PRId64 "..%" PRId64 ", length now %" PRIu64
               "\n", ctx, ntok, res.first_pos, res.last_pos, res.n_tokens);
    }
out:
    free(iov);
    free(tokens);
    free(positions);
    kvr__cli_st_free(&st);
    kvr__cli_unmap(&raw);
    kvr__cli_npy_free(&npy);
    return rc;
}

/* Writes a get/match result to `out` by extension, or reports meta only. */
int kvr__cli_write_kv(const cli_args *a, const kvr_kv *kv, const char *out)
{
    char err[400];
    if (out) {
        int w;
        if (kvr__cli_has_suffix(out, ".safetensors")) {
            w = kvr__cli_st_write(out, kv, err, sizeof err);
        } else if (kvr__cli_has_suffix(out, ".npy")) {
            if (kv->dtype != KVR_DTYPE_F32 && kv->dtype != KVR_DTYPE_F16)
                return kvr__cli_usage_err(".npy has no %s: give --dtype f32 or f16, or write "
                                     ".safetensors", kvr_dtype_name(kv->dtype));
            size_t shape[5] = { kv->n_layers, 2, (size_t)kv->n_tokens, kv->n_kv_heads,
                                kv->head_dim };
            struct iovec iov = { kv->payload, kv->payload_len };
            w = kvr__cli_npy_write(out, kv->dtype == KVR_DTYPE_F32 ? "<f4" : "<f2", shape, 5, &iov,
                              1, err, sizeof err);
        } else {
            struct iovec iov = { kv->payload, kv->payload_len };
            w = kvr__cli_write_iov(out, &iov, 1, err, sizeof err);
        }
        if (w < 0)
            return kvr__cli_io_err(a, err);
    }
    return CLI_OK;
}

static int cmd_get(kvr_client *c, const cli_args *a)
{
    if (a->npos != 1)
        return kvr__cli_usage_err("usage: kvrope get CONTEXT -o FILE [options]");
    const char *out = kvr__cli_opt(a, "output");
    bool meta = kvr__cli_flag(a, "meta");
    if (!out && !meta)
        return kvr__cli_usage_err("get: give -o FILE (.safetensors or raw), or --meta");
    bool to_stdout = out && !strcmp(out, "-");
    if (to_stdout && a->json)
        return kvr__cli_usage_err("get: --json and -o - both want stdout");
    bool raw = kvr__cli_flag(a, "raw");
    if (raw && (kvr__cli_opt(a, "positions") || kvr__cli_opt(a, "pos-start") || kvr__cli_opt(a, "dtype")))
        return kvr__cli_usage_err("get --raw: the stored bytes, keys pre-RoPE: no --dtype/--positions");
    if (raw && out && kvr__cli_has_suffix(out, ".safetensors"))
        return kvr__cli_usage_err("get --raw: write a raw file (.safetensors holds float tensors)");
    kvr_get_args g = { .ctx_id = a->pos[0], .meta_only = meta, .raw = raw };
    bool has_dt;
    if (opt_dtype(a, &g.dtype, &has_dt) < 0)
        return kvr__cli_usage_err("--dtype: want f32, f16 or bf16");
    bool has_end;
    if (opt_u64(a, "start", &g.start, NULL) < 0 || opt_u64(a, "end", &g.end, &has_end) < 0)
        return kvr__cli_usage_err("--start/--end: want token indexes");
    if (has_end && g.end <= g.start)
        return kvr__cli_usage_err("--end must be greater than --start");
    int r;
    if (!has_dt && !raw) {   /* default: the model's native dtype */
        kvr_context x;
        kvr_model m;
        if ((r = kvr__cli_ctx_model(c, g.ctx_id, &x, &m)) < 0)
            return kvr__cli_fail(a, c, r, "get");
        g.dtype = m.dtype;
    }
    int64_t *pos = NULL;
    uint32_t *layers = NULL;
    const char *ps = kvr__cli_opt(a, "positions"), *ls = kvr__cli_opt(a, "layers");
    bool has_ps;
    int64_t pstart = 0;
    if (opt_i64(a, "pos-start", &pstart, &has_ps) < 0)
        return kvr__cli_usage_err("--pos-start: want an integer");
    if (ps && has_ps)
        return kvr__cli_usage_err("give --positions or --pos-start, not both");
    if (ps) {
        long n = kvr__cli_parse_i64_list(ps, &pos);
        if (n < 0)
            return kvr__cli_usage_err("--positions: want comma-separated integers");
        g.positions = pos;
        g.n_positions = (size_t)n;
    } else if (has_ps) {   /* contiguous target positions: need the range length */
        kvr_context x;
        r = kvr_client_stat(c, g.ctx_id, &x);
        if (r < 0)
            return kvr__cli_fail(a, c, r, "get");
        uint64_t end = has_end ? g.end : x.n_tokens;
        size_t n = end > g.start ? (size_t)(end - g.start) : 0;
        pos = malloc((n ? n : 1) * sizeof *pos);
        if (!pos)
            return kvr__cli_io_err(a, "out of memory");
        for (size_t i = 0; i < n; i++)
            pos[i] = pstart + (int64_t)i;
        g.positions = pos;
        g.n_positions = n;
    }
    int lr = kvr__cli_opt_layers(ls, &layers, &g.n_layers);
    if (lr != CLI_OK) {
        free(pos);
        return lr;
    }
    g.layers = layers;
    kvr_kv kv;
    if (kvr__cli_flag(a, "shm") && !meta) {
        /* The daemon writes the KV into a memfd region of ours: size it
         * from the context's length and the model's shape. */
        kvr_context x;
        kvr_model m;
        if ((r = kvr__cli_ctx_model(c, g.ctx_id, &x, &m)) < 0) {
            free(pos);
            free(layers);
            return kvr__cli_fail(a, c, r, "get --shm");
        }
        uint64_t end = g.end ? g.end : x.n_tokens;
        size_t n = end > g.start ? (size_t)(end - g.start) : 0;
        size_t sz = kvr_payload_size(g.layers ? (uint32_t)g.n_layers : m.n_layers, n,
                                     m.n_kv_heads, m.head_dim,
                                     raw ? KVR_DTYPE_F32 : g.dtype);   /* raw: at most this */
        uint32_t id;
        r = kvr_client_region_create(c, sz ? sz : 1, &id, NULL);
        if (r < 0) {
            free(pos);
            free(layers);
            return kvr__cli_fail(a, c, r, "get --shm");
        }
        kvr_shm at = { id, 0, sz };
        kvr_client_shm_next(c, &at);
    }
    kvr__cli_progress_begin(c, "get");
    r = kvr_client_get(c, &g, &kv);
    const kvr_raw_layout *rl = &kv.raw;
    kvr__cli_progress_end();
    free(pos);
    free(layers);
    if (r < 0)
        return kvr__cli_fail(a, c, r, "get");
    int rc = meta ? CLI_OK : kvr__cli_write_kv(a, &kv, out);
    if (rc == CLI_OK) {
        if (a->json) {
            cJSON *j = kv_json(&kv, meta ? NULL : out);
            if (rl->raw) {
                cJSON *o = cJSON_AddObjectToObject(j, "raw");
                cJSON_AddStringToObject(o, "codec", rl->codec);
                cJSON_AddStringToObject(o, "k_codec", rl->k_codec);
                cJSON_AddStringToObject(o, "v_codec", rl->v_codec);
                cJSON_AddBoolToObject(o, "k_per_channel", rl->k_per_channel);
                cJSON_AddNumberToObject(o, "k_group", rl->k_group);
                cJSON_AddNumberToObject(o, "v_group", rl->v_group);
                cJSON_AddNumberToObject(o, "window", rl->window);
                cJSON_AddNumberToObject(o, "k_bytes", (double)rl->k_bytes);
                cJSON_AddNumberToObject(o, "v_bytes", (double)rl->v_bytes);
                cJSON_AddNumberToObject(o, "k_unit_bytes", (double)rl->k_unit_bytes);
                cJSON_AddNumberToObject(o, "v_unit_bytes", (double)rl->v_unit_bytes);
            }
            kvr__cli_print_json(j);
        } else if (rl->raw && !a->quiet) {
            FILE *o = to_stdout ? stderr : stdout;
            fprintf(o, "%s: %" PRIu64 " tokens [%" PRIu64 ", %" PRIu64 ") raw %s: per layer K "
                    "%" PRIu64 " B (%s%s, %" PRIu64 " B per %s) then V %" PRIu64 " B (%s, %"
                    PRIu64 " B per row), %zu layers, %zu bytes -> %s\n",
                    kv.ctx_id, kv.n_tokens, kv.start, kv.start + kv.n_tokens, rl->codec,
                    rl->k_bytes, rl->k_codec, rl->k_per_channel ? " per channel" : "",
                    rl->k_unit_bytes, rl->k_per_channel ? "tile" : "row", rl->v_bytes, rl->v_codec,
                    rl->v_unit_bytes, kv.n_layers, kv.payload_len, out ? out : "-");
        } else if (!a->quiet) {
            FILE *o = to_stdout ? stderr : stdout;
            fprintf(o, "%s: %" PRIu64 " tokens [%" PRIu64 ", %" PRIu64 ") of %s, %zu layers, %s",
                    kv.ctx_id, kv.n_tokens, kv.start, kv.start + kv.n_tokens, kv.model,
                    kv.n_layers, kvr_dtype_name(kv.dtype));
            if (kv.n_tokens)
                fprintf(o, ", positions %" PRId64 "..%" PRId64, kv.positions[0],
                        kv.positions[kv.n_tokens - 1]);
            if (!meta)
                fprintf(o, ", %zu bytes -> %s", kv.payload_len, out);
            fputc('\n', o);
        }
    }
    kvr_kv_release(&kv);
    return rc;
}

static int cmd_match(kvr_client *c, const cli_args *a)
{
    const char *model = kvr__cli_opt(a, "model"), *out = kvr__cli_opt(a, "output");
    if (!model || a->npos != 0)
        return kvr__cli_usage_err("usage: kvrope match --model M (--tokens 1,2,3 | --tokens-file F) "
                         "[--get -o FILE]");
    uint32_t *tok;
    long n;
    int rc = kvr__cli_load_tokens(a, &tok, &n, true);
    if (rc != CLI_OK)
        return rc;
    kvr_match_args m = { .model = model, .tokens = tok, .n_tokens = (size_t)n,
                         .include_approximate = kvr__cli_flag(a, "approx"),
                         .get = kvr__cli_flag(a, "get") || out != NULL, .dtype = KVR_DTYPE_F16 };
    bool has_dt;
    if (opt_dtype(a, &m.dtype, &has_dt) < 0) {
        free(tok);
        return kvr__cli_usage_err("--dtype: want f32, f16 or bf16");
    }
    if (m.get && !has_dt) {
        kvr_model mi;
        int r = kvr_client_model_get(c, model, &mi);
        if (r < 0) {
            free(tok);
            return kvr__cli_fail(a, c, r, "match");
        }
        m.dtype = mi.dtype;
    }
    if (m.get && !out) {
        free(tok);
        return kvr__cli_usage_err("match --get needs -o FILE");
    }
    kvr_match_res res;
    kvr__cli_progress_begin(c, "match");
    int r = kvr_client_match(c, &m, &res);
    kvr__cli_progress_end();
    free(tok);
    if (r < 0)
        return kvr__cli_fail(a, c, r, "match");
    rc = CLI_OK;
    if (res.has_kv)
        rc = kvr__cli_write_kv(a, &res.kv, out);
    if (rc == CLI_OK) {
        if (a->json) {
            cJSON *j = cJSON_CreateObject();
            cJSON_AddNumberToObject(j, "length", (double)res.length);
            cJSON_AddNumberToObject(j, "query_tokens", (double)n);
            cJSON_AddStringToObject(j, "context_id", res.ctx_id);
            if (res.has_kv)
                cJSON_AddItemToObject(j, "kv", kv_json(&res.kv, out));
            kvr__cli_print_json(j);
        } else if (!a->quiet) {
            if (res.length)
                printf("%" PRIu64 " of %ld tokens cached in %s%s%s\n", res.length, n, res.ctx_id,
                       res.has_kv ? ", KV -> " : "", res.has_kv ? out : "");
            else
                printf("no cached prefix (0 of %ld tokens)\n", n);
        }
        if (res.length == 0)
            rc = CLI_NOTFOUND;
    }
    kvr_kv_release(&res.kv);
    return rc;
}

static int simple_done(const cli_args *a, const char *what, const char *id)
{
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddBoolToObject(j, "ok", 1);
        cJSON_AddStringToObject(j, "op", what);
        cJSON_AddStringToObject(j, "context_id", id);
        kvr__cli_print_json(j);
    } else if (!a->quiet) {
        printf("%s: %s\n", id, what);
    }
    return CLI_OK;
}

static int cmd_rm(kvr_client *c, const cli_args *a)
{
    if (a->npos < 1)
        return kvr__cli_usage_err("usage: kvrope rm CONTEXT...");
    int rc = CLI_OK;
    for (int i = 0; i < a->npos; i++) {
        int r = kvr_client_delete(c, a->pos[i]);
        if (r < 0)
            rc = kvr__cli_fail(a, c, r, a->pos[i]);
        else if (!a->json && !a->quiet)
            printf("%s: deleted\n", a->pos[i]);
    }
    if (a->json && rc == CLI_OK) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddBoolToObject(j, "ok", 1);
        cJSON_AddNumberToObject(j, "deleted", a->npos);
        kvr__cli_print_json(j);
    }
    return rc;
}

static int cmd_pin(kvr_client *c, const cli_args *a, bool pin)
{
    if (a->npos != 1)
        return kvr__cli_usage_err(pin ? "usage: kvrope pin CONTEXT" : "usage: kvrope unpin CONTEXT");
    int r = kvr_client_pin(c, a->pos[0], pin);
    if (r < 0)
        return kvr__cli_fail(a, c, r, pin ? "pin" : "unpin");
    return simple_done(a, pin ? "pinned" : "unpinned", a->pos[0]);
}

static int cmd_fork(kvr_client *c, const cli_args *a)
{
    if (a->npos != 2)
        return kvr__cli_usage_err("usage: kvrope fork SRC DST");
    int r = kvr_client_fork(c, a->pos[0], a->pos[1]);
    if (r < 0)
        return kvr__cli_fail(a, c, r, "fork");
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddBoolToObject(j, "ok", 1);
        cJSON_AddStringToObject(j, "src", a->pos[0]);
        cJSON_AddStringToObject(j, "dst", a->pos[1]);
        kvr__cli_print_json(j);
    } else if (!a->quiet) {
        printf("%s -> %s: forked (copy-on-write)\n", a->pos[0], a->pos[1]);
    }
    return CLI_OK;
}

static int cmd_shift_keep(kvr_client *c, const cli_args *a, bool shift)
{
    uint64_t start, end;
    int64_t delta = 0;
    char *e = NULL;
    if (a->npos != (shift ? 4 : 3) || kvr__cli_parse_u64(a->pos[1], &start) < 0 ||
        kvr__cli_parse_u64(a->pos[2], &end) < 0 ||
        (shift && (errno = 0, delta = strtoll(a->pos[3], &e, 0), errno || *e || e == a->pos[3])))
        return kvr__cli_usage_err(shift ? "usage: kvrope shift CONTEXT START END DELTA"
                               : "usage: kvrope keep CONTEXT START END");
    int r = shift ? kvr_client_shift(c, a->pos[0], start, end, delta)
                  : kvr_client_keep(c, a->pos[0], start, end);
    if (r < 0)
        return kvr__cli_fail(a, c, r, shift ? "shift" : "keep");
    return simple_done(a, shift ? "shifted" : "kept", a->pos[0]);
}

/* ---- edit / refresh ----------------------------------------------------- */

/* The KV of `n` tokens for an edit or refresh, from FILE: *.safetensors (k, v
 * [layers][tokens][heads][dim]; gives shape and dtype) or raw layer-major
 * bytes in --dtype (default: the model's). Fills the args' shape, dtype and
 * payload (iovecs into the file, kept in st/raw until the caller frees). */
typedef struct kv_src {
    cli_st_kv     st;
    cli_mapped    raw;
    cli_npy       npy;
    struct iovec *iov;
    size_t        iovcnt;
    const void   *payload;
    size_t        payload_len;
    kvr_dtype     dtype;
    uint32_t      n_layers, n_heads, head_dim;
} kv_src;

static void kv_src_free(kv_src *k)
{
    free(k->iov);
    kvr__cli_st_free(&k->st);
    kvr__cli_unmap(&k->raw);
    kvr__cli_npy_free(&k->npy);
    memset(k, 0, sizeof *k);
}

static int kv_src_load(kvr_client *c, const cli_args *a, const char *ctx, const char *file,
                       size_t n, kv_src *k)
{
    char err[400];
    memset(k, 0, sizeof *k);
    bool has_dt;
    kvr_dtype dt = KVR_DTYPE_F16;
    if (opt_dtype(a, &dt, &has_dt) < 0)
        return kvr__cli_usage_err("--dtype: want f32, f16 or bf16");
    if (kvr__cli_has_suffix(file, ".safetensors")) {
        if (kvr__cli_st_read(file, &k->st, err, sizeof err) < 0)
            return kvr__cli_io_err(a, err);
        if (k->st.n_tokens != n) {
            snprintf(err, sizeof err, "%s holds %zu tokens, the request needs %zu", file,
                     k->st.n_tokens, n);
            return kvr__cli_io_err(a, err);
        }
        if (has_dt && dt != k->st.dtype)
            return kvr__cli_usage_err("--dtype differs from the tensors' dtype in %s", file);
        k->dtype = k->st.dtype;
        k->n_layers = k->st.n_layers;
        k->n_heads = k->st.n_heads;
        k->head_dim = k->st.head_dim;
        k->iov = malloc((2 * (size_t)k->n_layers + 1) * sizeof *k->iov);
        if (!k->iov)
            return kvr__cli_io_err(a, "out of memory");
        size_t slab = kvr_payload_size(1, n, k->n_heads, k->head_dim, k->dtype) / 2;
        for (uint32_t l = 0; l < k->n_layers; l++) {
            k->iov[2 * l] = (struct iovec){ (void *)(uintptr_t)(k->st.k + l * slab), slab };
            k->iov[2 * l + 1] = (struct iovec){ (void *)(uintptr_t)(k->st.v + l * slab), slab };
        }
        k->iovcnt = 2 * (size_t)k->n_layers;
        return CLI_OK;
    }
    if (kvr__cli_has_suffix(file, ".npy")) {
        size_t nt;
        if (kvr__cli_npy_read(file, &k->npy, err, sizeof err) < 0 ||
            kvr__cli_npy_kv_shape(&k->npy, file, &k->dtype, &k->n_layers, &nt, &k->n_heads,
                             &k->head_dim, err, sizeof err) < 0)
            return kvr__cli_io_err(a, err);
        if (nt != n) {
            snprintf(err, sizeof err, "%s holds %zu tokens, the request needs %zu", file, nt, n);
            return kvr__cli_io_err(a, err);
        }
        if (has_dt && dt != k->dtype)
            return kvr__cli_usage_err("--dtype differs from the array's dtype in %s", file);
        k->payload = k->npy.data ? (const void *)k->npy.data : "";
        k->payload_len = k->npy.data_len;
        return CLI_OK;
    }
    if (kvr__cli_map_file(file, &k->raw, err, sizeof err) < 0)
        return kvr__cli_io_err(a, err);
    kvr_context x;
    kvr_model m;
    int r = kvr__cli_ctx_model(c, ctx, &x, &m);
    if (r < 0)
        return kvr__cli_fail(a, c, r, "edit");
    k->dtype = has_dt ? dt : m.dtype;
    k->n_layers = m.n_layers;
    k->n_heads = m.n_kv_heads;
    k->head_dim = m.head_dim;
    k->payload = k->raw.base ? k->raw.base : "";
    k->payload_len = k->raw.len;
    size_t want = kvr_payload_size(k->n_layers, n, k->n_heads, k->head_dim, k->dtype);
    if (want != k->raw.len) {
        snprintf(err, sizeof err, "%s: %zu bytes, but %zu tokens x %u layers x %u heads x "
                 "%u dims x K,V in %s need %zu", file, k->raw.len, n, k->n_layers,
                 k->n_heads, k->head_dim, kvr_dtype_name(k->dtype), want);
        return kvr__cli_io_err(a, err);
    }
    return CLI_OK;
}

/* Reads the --ops JSON file (kvr__cli_edit_ops_parse). */
static int load_ops(const cli_args *a, const char *path, kvr_edit_range **out, size_t *n,
                    uint32_t **tokbuf, size_t *n_new)
{
    char err[400];
    cli_mapped m;
    *out = NULL;
    *tokbuf = NULL;
    *n = *n_new = 0;
    if (kvr__cli_map_file(path, &m, err, sizeof err) < 0)
        return kvr__cli_io_err(a, err);
    int rc = kvr__cli_edit_ops_parse(m.base, m.len, out, n, tokbuf, n_new, err, sizeof err);
    kvr__cli_unmap(&m);
    if (rc == -2)
        return kvr__cli_io_err(a, "out of memory");
    if (rc < 0)
        return kvr__cli_usage_err("%s: %s", path, err);
    return CLI_OK;
}

static void print_edit(const cli_args *a, const char *ctx, const char *what,
                       const kvr_edit_res *r)
{
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "context_id", ctx);
        cJSON_AddStringToObject(j, "op", what);
        cJSON_AddNumberToObject(j, "n_tokens", (double)r->n_tokens);
        cJSON_AddNumberToObject(j, "n_new", (double)r->n_new);
        cJSON_AddNumberToObject(j, "n_removed", (double)r->n_removed);
        cJSON_AddNumberToObject(j, "first_change", (double)r->first_change);
        cJSON_AddNumberToObject(j, "n_approximate", (double)r->n_approximate);
        cJSON_AddNumberToObject(j, "n_pending", (double)r->n_pending);
        cJSON_AddNumberToObject(j, "payload_bytes", (double)r->payload_bytes);
        cJSON *sp = cJSON_AddArrayToObject(j, "spans");
        for (size_t i = 0; i < r->n_spans; i++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "index", (double)r->spans[i].index);
            cJSON_AddNumberToObject(o, "first_pos", (double)r->spans[i].first_pos);
            cJSON_AddNumberToObject(o, "shift", (double)r->spans[i].shift);
            cJSON_AddItemToArray(sp, o);
        }
        kvr__cli_print_json(j);
        return;
    }
    if (a->quiet)
        return;
    printf("%s: %s: %" PRIu64 " new, %" PRIu64 " removed, length %" PRIu64 ", first change at %"
           PRIu64 ", %" PRIu64 " approximate, %" PRIu64 " pending, %" PRIu64 " KV bytes\n", ctx,
           what, r->n_new, r->n_removed, r->n_tokens, r->first_change, r->n_approximate,
           r->n_pending, r->payload_bytes);
    for (size_t i = 0; i < r->n_spans; i++)
        printf("  op %zu: new tokens at index %" PRIu64 ", positions from %" PRId64
               ", later tokens shift by %+" PRId64 "\n", i, r->spans[i].index,
               r->spans[i].first_pos, r->spans[i].shift);
}

static int cmd_edit(kvr_client *c, const cli_args *a)
{
    const char *ops_path = kvr__cli_opt(a, "ops"), *kvf = kvr__cli_opt(a, "kv");
    bool plan = kvr__cli_flag(a, "plan");
    if (a->npos != 1 || !ops_path)
        return kvr__cli_usage_err("usage: kvrope edit CONTEXT --ops ops.json [--kv FILE [--dtype D]] "
                         "[--plan]");
    if (plan && kvf)
        return kvr__cli_usage_err("edit: --plan sends no KV (drop --kv)");
    const char *ctx = a->pos[0];
    kvr_edit_range *ops;
    size_t n_ops, n_new;
    uint32_t *tb;
    int rc = load_ops(a, ops_path, &ops, &n_ops, &tb, &n_new);
    if (rc != CLI_OK)
        return rc;
    kvr_edit_args e = { .ctx_id = ctx, .ops = ops, .n_ops = n_ops, .model = kvr__cli_opt(a, "model") };
    kv_src k;
    memset(&k, 0, sizeof k);
    kvr_edit_res res;
    int r;
    if (plan) {
        r = kvr_client_edit_plan(c, &e, &res);
    } else {
        if (kvf) {
            rc = kv_src_load(c, a, ctx, kvf, n_new, &k);
            if (rc != CLI_OK)
                goto out;
            e.with_kv = true;
            e.dtype = k.dtype;
            e.n_layers = k.n_layers;
            e.n_kv_heads = k.n_heads;
            e.head_dim = k.head_dim;
            e.payload = k.payload;
            e.payload_len = k.payload_len;
            e.iov = k.iov;
            e.iovcnt = k.iovcnt;
        }
        kvr__cli_progress_begin(c, "edit");
        r = kvr_client_edit(c, &e, &res);
        kvr__cli_progress_end();
    }
    if (r < 0) {
        rc = kvr__cli_fail(a, c, r, plan ? "edit --plan" : "edit");
        goto out;
    }
    print_edit(a, ctx, plan ? "plan" : "edited", &res);
    kvr_client_free(res.spans);
    rc = CLI_OK;
out:
    kv_src_free(&k);
    free(ops);
    free(tb);
    return rc;
}

static int cmd_refresh(kvr_client *c, const cli_args *a)
{
    uint64_t start, end;
    if (a->npos != 4 || kvr__cli_parse_u64(a->pos[1], &start) < 0 ||
        kvr__cli_parse_u64(a->pos[2], &end) < 0 || end <= start)
        return kvr__cli_usage_err("usage: kvrope refresh CONTEXT START END FILE (END > START)");
    const char *ctx = a->pos[0];
    kv_src k;
    int rc = kv_src_load(c, a, ctx, a->pos[3], (size_t)(end - start), &k);
    if (rc != CLI_OK) {
        kv_src_free(&k);
        return rc;
    }
    kvr_refresh_args f = { .ctx_id = ctx, .start = start, .end = end,
                           .model = kvr__cli_opt(a, "model"), .dtype = k.dtype,
                           .n_layers = k.n_layers, .n_kv_heads = k.n_heads,
                           .head_dim = k.head_dim, .payload = k.payload,
                           .payload_len = k.payload_len, .iov = k.iov, .iovcnt = k.iovcnt };
    kvr_edit_res res;
    kvr__cli_progress_begin(c, "refresh");
    int r = kvr_client_refresh(c, &f, &res);
    kvr__cli_progress_end();
    kv_src_free(&k);
    if (r < 0)
        return kvr__cli_fail(a, c, r, "refresh");
    print_edit(a, ctx, "refreshed", &res);
    kvr_client_free(res.spans);
    return CLI_OK;
}

static const char *const commands[] = { "ping", "stats", "models", "ls", "list", "stat",
                                        "put", "get", "match", "rm", "pin", "unpin",
                                        "fork", "shift", "keep", "edit", "refresh", NULL };

bool kvr__cli_known_command(const char *cmd)
{
    return kvr__cli_in_list(commands, cmd);
}

bool kvr__cli_option_takes_value(const char *n)
{
    static const char *const v[] = { "socket", "connect", "token-file", "model", "config",
                                     "style", "dtype", "tokens", "tokens-file", "pos-start",
                                     "positions", "layers", "heads", "head-dim", "mode",
                                     "fingerprint", "start", "end", "output", "theta",
                                     "rotary-dim", "timeout", "protect", "ops", "kv",
                                     "codec", NULL };
    return kvr__cli_in_list(v, n);
}

int kvr__cli_run(kvr_client *c, const cli_args *a)
{
    const char *k = a->cmd;
    if (!strcmp(k, "ping"))   return cmd_ping(c, a);
    if (!strcmp(k, "stats"))  return cmd_stats(c, a);
    if (!strcmp(k, "models")) return cmd_models(c, a);
    if (!strcmp(k, "ls") || !strcmp(k, "list")) return cmd_ls(c, a);
    if (!strcmp(k, "stat"))   return cmd_stat(c, a);
    if (!strcmp(k, "put"))    return cmd_put(c, a);
    if (!strcmp(k, "get"))    return cmd_get(c, a);
    if (!strcmp(k, "match"))  return cmd_match(c, a);
    if (!strcmp(k, "rm"))     return cmd_rm(c, a);
    if (!strcmp(k, "pin"))    return cmd_pin(c, a, true);
    if (!strcmp(k, "unpin"))  return cmd_pin(c, a, false);
    if (!strcmp(k, "fork"))   return cmd_fork(c, a);
    if (!strcmp(k, "shift"))  return cmd_shift_keep(c, a, true);
    if (!strcmp(k, "keep"))   return cmd_shift_keep(c, a, false);
    if (!strcmp(k, "edit"))   return cmd_edit(c, a);
    if (!strcmp(k, "refresh")) return cmd_refresh(c, a);
    return kvr__cli_usage_err("unknown command '%s'", k);
}
