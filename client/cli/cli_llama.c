/*
 * cli_llama.c — `kvrope llama import|export`: llama.cpp sequence states in
 * and out of kvrope contexts through the bridge (client/llama/kvrope_llama.h).
 *
 *   kvrope llama import CTX STATE_FILE --gguf MODEL.gguf [--model NAME]
 *   kvrope llama export CTX -o STATE_FILE --gguf MODEL.gguf [--pos-start N]
 *                       [--type-k T] [--type-v T]
 *
 * Both register the GGUF's profile under NAME (default: the profile's name,
 * kvr_llama_model_default_name) before they act, so a fresh daemon needs no
 * other step. STATE_FILE's form (llama_state_seq_get_data bytes or a
 * llama_state_seq_save_file file) is detected by its magic. Dispatched by
 * main.c next to the other command files; no daemon state is touched before
 * every argument and file has been checked.
 */
#include "client/cli/cli.h"
#include "client/llama/kvrope_llama.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char kvr__cli_llama_help[] =
"  llama import CTX STATE_FILE --gguf MODEL.gguf [--model NAME]\n"
"                                     a llama.cpp sequence state (the bytes of\n"
"                                     llama_state_seq_get_data, or a file of\n"
"                                     llama_state_seq_save_file: told by its magic)\n"
"                                     into context CTX: tokens, positions, K, V.\n"
"                                     Registers the GGUF's profile as NAME (default\n"
"                                     <general.name>-<fingerprint>). Also: --append\n"
"                                     / --replace, --tokens-file F (raw states carry\n"
"                                     no ids), --codec C, --persist, --no-attn-rot\n"
"  llama export CTX -o STATE_FILE --gguf MODEL.gguf [--pos-start N] [--type-k T]\n"
"               [--type-v T]          CTX as a state llama_state_seq_set_data takes:\n"
"                                     keys re-rotated to N, N+1, .. (default: their\n"
"                                     positions), K/V in the destination context's\n"
"                                     types (f32 f16 bf16 q8_0 q4_0 q4_1 q5_0; default\n"
"                                     f16), V in the layout the context was imported\n"
"                                     with (transposed if its state was: flash\n"
"                                     attention off; else not), or as --v-trans /\n"
"                                     --no-v-trans say. Also: --start/--end, --session\n"
"                                     (the save_file form, with tokens), --seq-id S,\n"
"                                     --model NAME\n";

bool kvr__cli_llama_command(const char *cmd) { return cmd && !strcmp(cmd, "llama"); }

bool kvr__cli_llama_option_takes_value(const char *n)
{
    static const char *const v[] = { "gguf", "type-k", "type-v", "seq-id", NULL };
    return kvr__cli_in_list(v, n);
}

bool kvr__cli_llama_option_is_flag(const char *n)
{
    static const char *const v[] = { "append", "replace", "session", "v-trans", "no-v-trans",
                                     "no-attn-rot", NULL };
    return kvr__cli_in_list(v, n);
}

static int fail(const cli_args *a, int code, const char *msg)
{
    fprintf(stderr, "kvrope: llama: %s (%s)\n", msg, kvr_error_name(code));
    kvr__cli_error_json(a, code, msg);
    if (code == KVR_ENOCTX || code == KVR_ENOMODEL) return CLI_NOTFOUND;
    return CLI_ERR;
}

static bool parse_i64(const char *s, int64_t *out)
{
    char *e;
    errno = 0;
    long long v = strtoll(s, &e, 10);
    if (errno || e == s || *e) return false;
    *out = v;
    return true;
}

/* Reads the profile and registers it; name_out gets the name used. */
static int load_model(kvr_client *c, const cli_args *a, kvr_llama_model *m, char *name_out,
                      size_t cap)
{
    const char *path = kvr__cli_opt(a, "gguf");
    if (!path) return kvr__cli_usage_err("llama %s: --gguf MODEL.gguf is required", a->pos[0]);
    char err[512];
    int rc = kvr_llama_gguf_read(path, m, err, sizeof err);
    if (rc) return fail(a, rc, err);
    const char *name = kvr__cli_opt(a, "model");
    if (name) snprintf(name_out, cap, "%s", name);
    else kvr_llama_model_default_name(m, name_out, cap);
    rc = kvr_llama_model_register(c, m, name_out, NULL, err, sizeof err);
    if (rc) return fail(a, rc, err);
    return CLI_OK;
}

static void fp_hex(char *buf, size_t cap, uint64_t fp)
{
    snprintf(buf, cap, "%016llx", (unsigned long long)fp);
}

static int cmd_import(kvr_client *c, const cli_args *a)
{
    if (a->npos != 3) return kvr__cli_usage_err("usage: kvrope llama import CTX STATE_FILE --gguf MODEL.gguf [--model NAME]");
    const char *ctx = a->pos[1], *file = a->pos[2];
    if (kvr__cli_flag(a, "append") && kvr__cli_flag(a, "replace"))
        return kvr__cli_usage_err("llama import: --append and --replace exclude each other");
    kvr_llama_import_opts o;
    memset(&o, 0, sizeof o);
    o.mode = kvr__cli_flag(a, "append") ? KVR_LLAMA_IMPORT_APPEND
           : kvr__cli_flag(a, "replace") ? KVR_LLAMA_IMPORT_REPLACE : KVR_LLAMA_IMPORT_CREATE;
    o.codec = kvr__cli_opt(a, "codec");
    o.no_attn_rot = kvr__cli_flag(a, "no-attn-rot");
    o.persist = kvr__cli_flag(a, "persist");
    uint32_t *toks = NULL;
    const char *tf = kvr__cli_opt(a, "tokens-file"), *tl = kvr__cli_opt(a, "tokens");
    char err[512];
    if (tf || tl) {
        long n = tf ? kvr__cli_read_tokens_file(tf, &toks, err, sizeof err) : kvr__cli_parse_u32_list(tl, &toks);
        if (n < 0) return kvr__cli_usage_err("llama import: bad tokens%s%s", tf ? ": " : "", tf ? err : "");
        o.tokens = toks;
        o.n_tokens = (size_t)n;
    }
    cli_mapped sf;
    if (kvr__cli_map_file(file, &sf, err, sizeof err) < 0) {
        free(toks);
        return fail(a, KVR_ESYS, err);
    }
    kvr_llama_model m;
    char name[KVR_ID_MAX + 1];
    int rc = load_model(c, a, &m, name, sizeof name);
    if (rc) {
        kvr__cli_unmap(&sf);
        free(toks);
        return rc;
    }
    o.model = name;
    kvr_llama_import_info info;
    int r = kvr_llama_state_import(c, ctx, sf.base, sf.len, &m, &o, &info, err, sizeof err);
    kvr__cli_unmap(&sf);
    if (r && !toks && strstr(err, "carries no token ids")) {
        /* The bridge speaks of its options; the user has flags. */
        size_t l = strlen(err);
        snprintf(err + l, sizeof err - l, ": give them with --tokens-file F (text ids, *.bin "
                 "u32 LE or *.npy) or --tokens 1,2,3, or import the session form "
                 "(llama_state_seq_save_file), which carries them");
    }
    free(toks);
    if (r) return fail(a, r, err);
    char fp[32];
    fp_hex(fp, sizeof fp, m.fingerprint);
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "context", ctx);
        cJSON_AddStringToObject(j, "model", info.model);
        cJSON_AddStringToObject(j, "arch", m.arch);
        cJSON_AddStringToObject(j, "profile_fingerprint", fp);
        cJSON_AddStringToObject(j, "form", info.form == KVR_LLAMA_FORM_SESSION ? "session" : "raw");
        cJSON_AddNumberToObject(j, "seq_id", info.seq_id);
        cJSON_AddNumberToObject(j, "cells", info.n_cells);
        cJSON_AddNumberToObject(j, "imported", info.n_taken);
        cJSON_AddNumberToObject(j, "pos_first", info.pos_first);
        cJSON_AddNumberToObject(j, "pos_last", info.pos_last);
        cJSON_AddStringToObject(j, "type_k", kvr_llama_type_name(info.type_k));
        cJSON_AddStringToObject(j, "type_v", kvr_llama_type_name(info.type_v));
        cJSON_AddBoolToObject(j, "v_trans", info.v_trans);
        cJSON_AddBoolToObject(j, "k_hadamard", info.k_hadamard);
        cJSON_AddBoolToObject(j, "v_hadamard", info.v_hadamard);
        cJSON_AddStringToObject(j, "codec", info.codec);
        cJSON_AddNumberToObject(j, "n_tokens", (double)info.ctx_tokens);
        cJSON_AddNumberToObject(j, "state_bytes", (double)info.state_bytes);
        cJSON_AddNumberToObject(j, "payload_bytes", (double)info.payload_bytes);
        kvr__cli_print_json(j);
    } else if (!a->quiet) {
        printf("imported %u of %u cells (positions %d..%d, K %s%s, V %s%s%s) from %s into %s "
               "(model %s, codec %s): %llu tokens\n",
               info.n_taken, info.n_cells, info.pos_first, info.pos_last,
               kvr_llama_type_name(info.type_k), info.k_hadamard ? " +Hadamard" : "",
               kvr_llama_type_name(info.type_v), info.v_hadamard ? " +Hadamard" : "",
               info.v_trans ? ", transposed" : "",
               info.form == KVR_LLAMA_FORM_SESSION ? "a session file" : "a raw state", ctx,
               info.model, info.codec, (unsigned long long)info.ctx_tokens);
        if (info.v_trans)
            printf("the state had V transposed (flash attention off): recorded, so `kvrope "
                   "llama export %s` writes V transposed unless --no-v-trans\n", ctx);
    }
    return CLI_OK;
}

static int cmd_export(kvr_client *c, const cli_args *a)
{
    if (a->npos != 2) return kvr__cli_usage_err("usage: kvrope llama export CTX -o STATE_FILE --gguf MODEL.gguf [--pos-start N] [--type-k T] [--type-v T]");
    const char *ctx = a->pos[1], *out = kvr__cli_opt(a, "output");
    if (!out) return kvr__cli_usage_err("llama export: -o STATE_FILE is required");
    kvr_llama_export_opts o;
    memset(&o, 0, sizeof o);
    const char *s;
    int64_t v;
    if ((s = kvr__cli_opt(a, "pos-start"))) {
        if (!parse_i64(s, &v)) return kvr__cli_usage_err("llama export: bad --pos-start '%s'", s);
        o.has_pos_start = true;
        o.pos_start = v;
    }
    if ((s = kvr__cli_opt(a, "start"))) {
        if (!parse_i64(s, &v) || v < 0) return kvr__cli_usage_err("llama export: bad --start '%s'", s);
        o.start = (uint64_t)v;
    }
    if ((s = kvr__cli_opt(a, "end"))) {
        if (!parse_i64(s, &v) || v <= 0) return kvr__cli_usage_err("llama export: bad --end '%s'", s);
        o.end = (uint64_t)v;
    }
    if ((s = kvr__cli_opt(a, "type-k")) && kvr_llama_type_parse(s, &o.type_k))
        return kvr__cli_usage_err("llama export: unknown --type-k '%s' (f32 f16 bf16 q8_0 q4_0 q4_1 q5_0)", s);
    if ((s = kvr__cli_opt(a, "type-v")) && kvr_llama_type_parse(s, &o.type_v))
        return kvr__cli_usage_err("llama export: unknown --type-v '%s' (f32 f16 bf16 q8_0 q4_0 q4_1 q5_0)", s);
    if ((s = kvr__cli_opt(a, "seq-id"))) {
        if (!parse_i64(s, &v) || v < 0 || v > INT32_MAX) return kvr__cli_usage_err("llama export: bad --seq-id '%s'", s);
        o.seq_id = (int32_t)v;
    }
    if (kvr__cli_flag(a, "v-trans") && kvr__cli_flag(a, "no-v-trans"))
        return kvr__cli_usage_err("llama export: --v-trans and --no-v-trans exclude each other");
    o.v_trans = kvr__cli_flag(a, "v-trans");
    o.v_trans_auto = !o.v_trans && !kvr__cli_flag(a, "no-v-trans");
    o.no_attn_rot = kvr__cli_flag(a, "no-attn-rot");
    o.form = kvr__cli_flag(a, "session") ? KVR_LLAMA_FORM_SESSION : KVR_LLAMA_FORM_RAW;
    kvr_llama_model m;
    char name[KVR_ID_MAX + 1];
    int rc = load_model(c, a, &m, name, sizeof name);
    if (rc) return rc;
    o.model = name;
    void *st;
    size_t len;
    kvr_llama_export_info info;
    char err[512];
    int r = kvr_llama_state_export(c, ctx, &m, &o, &st, &len, &info, err, sizeof err);
    if (r) return fail(a, r, err);
    struct iovec iov = { st, len };
    r = kvr__cli_write_iov(out, &iov, 1, err, sizeof err);
    kvr_llama_free(st);
    if (r < 0) return fail(a, KVR_ESYS, err);
    if (a->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "context", ctx);
        cJSON_AddStringToObject(j, "model", name);
        cJSON_AddStringToObject(j, "output", out);
        cJSON_AddStringToObject(j, "form", o.form == KVR_LLAMA_FORM_SESSION ? "session" : "raw");
        cJSON_AddNumberToObject(j, "cells", (double)info.n_cells);
        cJSON_AddNumberToObject(j, "pos_first", (double)info.pos_first);
        cJSON_AddNumberToObject(j, "pos_last", (double)info.pos_last);
        cJSON_AddStringToObject(j, "type_k", kvr_llama_type_name(info.type_k));
        cJSON_AddStringToObject(j, "type_v", kvr_llama_type_name(info.type_v));
        cJSON_AddBoolToObject(j, "v_trans", info.v_trans);
        cJSON_AddStringToObject(j, "v_trans_from", o.v_trans_auto ? "context" : "option");
        cJSON_AddNumberToObject(j, "approximate", (double)info.approx_tokens);
        cJSON_AddNumberToObject(j, "state_bytes", (double)info.state_bytes);
        cJSON_AddNumberToObject(j, "payload_bytes", (double)info.payload_bytes);
        kvr__cli_print_json(j);
    } else if (!a->quiet) {
        const char *why = !o.v_trans_auto ? "as asked"
                        : info.v_trans ? "as the context was imported; --no-v-trans for on"
                                       : "the context was not imported transposed; --v-trans "
                                         "for off";
        printf("exported %llu cells of %s (positions %lld..%lld, K %s, V %s) to %s: %llu bytes%s\n"
               "V layout written: %s (%s)\n",
               (unsigned long long)info.n_cells, ctx, (long long)info.pos_first,
               (long long)info.pos_last, kvr_llama_type_name(info.type_k),
               kvr_llama_type_name(info.type_v), out, (unsigned long long)info.state_bytes,
               info.approx_tokens ? " (some tokens approximate: edited since)" : "",
               info.v_trans ? "v_trans 1, V transposed, for a context with flash attention off"
                            : "v_trans 0, for a context with flash attention on",
               why);
    }
    return CLI_OK;
}

int kvr__cli_llama_run(kvr_client *c, const cli_args *a)
{
    if (a->npos < 1) return kvr__cli_usage_err("usage: kvrope llama import|export ... (kvrope --help)");
    if (!strcmp(a->pos[0], "import")) return cmd_import(c, a);
    if (!strcmp(a->pos[0], "export")) return cmd_export(c, a);
    return kvr__cli_usage_err("llama: unknown subcommand '%s' (import, export)", a->pos[0]);
}
