/*
 * cli_rope.c — `kvrope rope apply|remove|reposition`: the RoPE engine on raw
 * little-endian files, without a daemon.
 *
 *   kvrope rope apply      --config config.json --tokens N --heads H --in X --pos P --out K
 *   kvrope rope remove     ... --in K --pos P --out X
 *   kvrope rope reposition ... --in K --from-pos P_OLD --pos P_NEW --out K2
 *
 * Data files are [tokens][heads][head_dim] in --dtype (f32|f16|bf16; output in
 * --out-dtype, default the input's); position files are int32 (or int64 with
 * --pos-dtype i64), one per token. --layer L picks layer L's RoPE for models
 * that mix it per layer (Gemma 3 sliding layers, Llama 4 NoPE layers).
 * Dynamic NTK / longrope tables depend on the sequence length: --seq-len
 * (the table rotated into; default max(--pos) + 1, what transformers uses
 * for a forward over those positions) and --from-seq-len (the table the keys
 * were rotated with; default max(--from-pos) + 1 for reposition, --seq-len
 * for remove). Exit status: 0 done, 2 bad arguments
 * (usage on stderr), 1 configuration refused, I/O error or a file whose size
 * does not match tokens * heads * head_dim.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <inttypes.h>

#include "client/cli/cli_rope.h"
#include "rope/rope.h"

static const char cli_rope_usage[] =
"usage: kvrope rope apply|remove|reposition --config config.json [--style neox|gptj]\n"
"                   --tokens N --heads H [--dtype f32|f16|bf16] [--out-dtype f32|f16|bf16]\n"
"                   --in FILE --pos FILE [--pos-dtype i32|i64] [--from-pos FILE] --out FILE\n"
"                   [--layer L] [--seq-len N] [--from-seq-len N]\n"
"  apply       rotate un-rotated keys to --pos\n"
"  remove      un-rotate keys stored at --pos\n"
"  reposition  move keys from --from-pos to --pos (a pure rotation; dynamic NTK /\n"
"              longrope: removed with the old table, applied with the new)\n"
"  files are raw little-endian [tokens][heads][head_dim]; positions int32 (or int64)\n"
"  --layer L        the RoPE of layer L (per-layer models: Gemma 3, Llama 4, Cohere 2)\n"
"  --seq-len N      dynamic NTK / longrope: the sequence length of the table rotated\n"
"                   into (default max(--pos) + 1, as transformers for those positions)\n"
"  --from-seq-len N the table the keys were rotated with (reposition: default\n"
"                   max(--from-pos) + 1; remove: default --seq-len, else max(--pos) + 1)\n";

static int usage(const char *why)
{
    if (why) fprintf(stderr, "kvrope rope: %s\n", why);
    fputs(cli_rope_usage, stderr);
    return 2;
}

static int parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v == 0 || v > (1ull << 40)) return -1;
    *out = (size_t)v;
    return 0;
}

/* Reads a whole file that must be exactly `want` bytes. */
static void *read_exact(const char *path, size_t want, const char *what)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvrope rope: %s %s: %s\n", what, path, strerror(errno));
        return NULL;
    }
    void *buf = NULL;
    if (fseek(f, 0, SEEK_END) != 0) goto io;
    long sz = ftell(f);
    if (sz < 0) goto io;
    if ((unsigned long long)sz != (unsigned long long)want) {
        fprintf(stderr, "kvrope rope: %s %s: %ld bytes, expected %zu\n", what, path, sz, want);
        fclose(f);
        return NULL;
    }
    if (fseek(f, 0, SEEK_SET) != 0) goto io;
    buf = malloc(want ? want : 1);
    if (!buf) {
        fprintf(stderr, "kvrope rope: %s %s: out of memory (%zu bytes)\n", what, path, want);
        fclose(f);
        return NULL;
    }
    if (fread(buf, 1, want, f) != want) goto io;
    fclose(f);
    return buf;
io:
    fprintf(stderr, "kvrope rope: %s %s: read error\n", what, path);
    free(buf);
    fclose(f);
    return NULL;
}

static int64_t *read_pos(const char *path, size_t n, int wide, const char *what)
{
    unsigned char *raw = read_exact(path, n * (wide ? 8u : 4u), what);
    if (!raw) return NULL;
    int64_t *p = malloc(n * sizeof *p);
    if (!p) { free(raw); fprintf(stderr, "kvrope rope: out of memory\n"); return NULL; }
    for (size_t i = 0; i < n; i++) {
        if (wide) {
            uint64_t u = 0;
            for (int b = 7; b >= 0; b--) u = (u << 8) | raw[i * 8 + (size_t)b];
            memcpy(&p[i], &u, 8);
        } else {
            uint32_t u = (uint32_t)raw[i * 4] | (uint32_t)raw[i * 4 + 1] << 8 |
                         (uint32_t)raw[i * 4 + 2] << 16 | (uint32_t)raw[i * 4 + 3] << 24;
            int32_t s;
            memcpy(&s, &u, 4);
            p[i] = s;
        }
    }
    free(raw);
    return p;
}

int kvr_cli_rope_main(int argc, char **argv)
{
    enum { APPLY, REMOVE, REPOSITION } verb;
    if (argc < 2) return usage("missing verb");
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fputs(cli_rope_usage, stdout);
        return 0;
    }
    if (!strcmp(argv[1], "apply")) verb = APPLY;
    else if (!strcmp(argv[1], "remove")) verb = REMOVE;
    else if (!strcmp(argv[1], "reposition")) verb = REPOSITION;
    else return usage("unknown verb (apply, remove or reposition)");

    const char *config = NULL, *style = NULL, *in = NULL, *pos = NULL, *from = NULL, *out = NULL;
    const char *dtype_s = "f32", *out_dtype_s = NULL, *pos_dtype = "i32";
    const char *tokens_s = NULL, *heads_s = NULL;
    const char *layer_s = NULL, *seq_s = NULL, *from_seq_s = NULL;
    /* Every option takes a value: its name, and where the value goes. */
    static const char *const names[] = { "--config", "--style", "--tokens", "--heads",
                                         "--dtype", "--out-dtype", "--in", "--pos",
                                         "--pos-dtype", "--from-pos", "--out", "--layer",
                                         "--seq-len", "--from-seq-len" };
    const char **const slots[] = { &config, &style, &tokens_s, &heads_s, &dtype_s,
                                   &out_dtype_s, &in, &pos, &pos_dtype, &from, &out,
                                   &layer_s, &seq_s, &from_seq_s };
    _Static_assert(sizeof names / sizeof *names == sizeof slots / sizeof *slots,
                   "one slot per option");
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        const char **slot = NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {   /* kvrope rope apply --help */
            fputs(cli_rope_usage, stdout);
            return 0;
        }
        for (size_t k = 0; k < sizeof names / sizeof *names && !slot; k++)
            if (!strcmp(a, names[k]))
                slot = slots[k];
        if (!slot) {
            fprintf(stderr, "kvrope rope: unknown option '%s'\n", a);
            return usage(NULL);
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvrope rope: option %s needs a value\n", a);
            return usage(NULL);
        }
        *slot = argv[++i];
    }
    if (!config) return usage("--config is required");
    if (!in) return usage("--in is required");
    if (!out) return usage("--out is required");
    if (!pos) return usage("--pos is required");
    if (verb == REPOSITION && !from) return usage("reposition needs --from-pos");
    if (verb != REPOSITION && from) return usage("--from-pos is only for reposition");
    size_t tokens, heads;
    if (!tokens_s || parse_size(tokens_s, &tokens)) return usage("--tokens must be a positive integer");
    if (!heads_s || parse_size(heads_s, &heads)) return usage("--heads must be a positive integer");
    kvr_dtype dt_in, dt_out;
    if (kvr_dtype_parse(dtype_s, &dt_in)) return usage("--dtype must be f32, f16 or bf16");
    dt_out = dt_in;
    if (out_dtype_s && kvr_dtype_parse(out_dtype_s, &dt_out))
        return usage("--out-dtype must be f32, f16 or bf16");
    int wide;
    if (!strcmp(pos_dtype, "i32")) wide = 0;
    else if (!strcmp(pos_dtype, "i64")) wide = 1;
    else return usage("--pos-dtype must be i32 or i64");
    if (style && strcmp(style, "neox") && strcmp(style, "gptj"))
        return usage("--style must be neox or gptj");
    size_t layer = 0, seq = 0, from_seq = 0;
    if (layer_s && strcmp(layer_s, "0") && parse_size(layer_s, &layer))
        return usage("--layer must be a layer index (0, 1, ...)");
    if (seq_s && parse_size(seq_s, &seq)) return usage("--seq-len must be a positive integer");
    if (from_seq_s && parse_size(from_seq_s, &from_seq))
        return usage("--from-seq-len must be a positive integer");
    if (from_seq_s && verb == APPLY) return usage("--from-seq-len is for remove and reposition");

    kvr_rope_config cfg;
    kvr_error err = { 0 };
    if (kvr_rope_config_from_file(&cfg, config, style, &err) != 0) {
        fprintf(stderr, "kvrope rope: %s: %s\n", config, err.msg);
        return 1;
    }
    size_t n_el;
    if (__builtin_mul_overflow(tokens, heads, &n_el) ||
        __builtin_mul_overflow(n_el, (size_t)cfg.head_dim, &n_el) || n_el > ((size_t)1 << 36)) {
        fprintf(stderr, "kvrope rope: tokens * heads * head_dim is too large\n");
        return 1;
    }
    int rc = 1;
    kvr_rope *r = NULL;
    void *src = NULL, *dst = NULL;
    int64_t *p = NULL, *pf = NULL;
    FILE *fo = NULL;
    if (kvr_rope_create(&r, &cfg, &err) != 0) {
        fprintf(stderr, "kvrope rope: %s: %s\n", config, err.msg);
        goto done;
    }
    if (layer_s && cfg.num_layers > 0 && layer >= (size_t)cfg.num_layers) {
        fprintf(stderr, "kvrope rope: --layer %zu: %s has %d layers\n", layer, config,
                (int)cfg.num_layers);
        goto done;
    }
    const kvr_rope *lr = kvr_rope_layer(r, (uint32_t)layer);
    src = read_exact(in, n_el * kvr_dtype_size(dt_in), "--in");
    if (!src) goto done;
    p = read_pos(pos, tokens, wide, "--pos");
    if (!p) goto done;
    if (verb == REPOSITION && !(pf = read_pos(from, tokens, wide, "--from-pos"))) goto done;
    dst = malloc(n_el * kvr_dtype_size(dt_out));
    if (!dst) { fprintf(stderr, "kvrope rope: out of memory\n"); goto done; }
    /* The tables' sequence lengths (dynamic NTK / longrope; others ignore
     * them): what transformers would use for a forward over the positions
     * given, unless stated. */
    kvr_rope_opts ro = { 0 };
    ro.seq_len_to = seq ? (int64_t)seq : kvr_rope_default_seq_len(p, tokens);
    if (from_seq)
        ro.seq_len_from = (int64_t)from_seq;
    else if (verb == REPOSITION)
        ro.seq_len_from = kvr_rope_default_seq_len(pf, tokens);
    else
        ro.seq_len_from = ro.seq_len_to;
    int e = verb == APPLY ? kvr_rope_apply(lr, dst, dt_out, src, dt_in, tokens, heads, p, &ro)
          : verb == REMOVE ? kvr_rope_remove(lr, dst, dt_out, src, dt_in, tokens, heads, p, &ro)
          : kvr_rope_reposition(lr, dst, dt_out, src, dt_in, tokens, heads, pf, p, &ro);
    if (e) { fprintf(stderr, "kvrope rope: %s\n", kvr_strerror(e)); goto done; }
    fo = fopen(out, "wb");
    if (!fo) { fprintf(stderr, "kvrope rope: --out %s: %s\n", out, strerror(errno)); goto done; }
    size_t ob = n_el * kvr_dtype_size(dt_out);
    if (fwrite(dst, 1, ob, fo) != ob) {
        fprintf(stderr, "kvrope rope: --out %s: write error\n", out);
        goto done;
    }
    if (fclose(fo) != 0) {
        fo = NULL;
        fprintf(stderr, "kvrope rope: --out %s: %s\n", out, strerror(errno));
        goto done;
    }
    fo = NULL;
    rc = 0;
done:
    if (fo) fclose(fo);
    free(dst);
    free(pf);
    free(p);
    free(src);
    kvr_rope_destroy(r);
    return rc;
}
