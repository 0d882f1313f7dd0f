/*
 * cli.h — private to client/cli: what the `kvrope` subcommands share
 * (parsed options, output helpers, tensor files). Not part of libkvrope.
 */
#ifndef KVR_CLI_H
#define KVR_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "client/kvrope.h"

/* Exit codes, documented in `kvrope --help`. */
enum {
    CLI_OK       = 0,
    CLI_ERR      = 1,   /* the daemon refused the request, or an I/O error */
    CLI_USAGE    = 2,
    CLI_NOTFOUND = 3,   /* unknown context or model; match found no prefix */
    CLI_CONNECT  = 4,   /* cannot reach the daemon */
};

/* Parsed command line: global options plus the subcommand's. Option values
 * point into argv (borrowed for the process lifetime). */
#define CLI_MAX_OPTS 32
#define CLI_MAX_POS  128   /* assemble PREFIX DOC...: room for many documents */
typedef struct cli_args {
    const char *socket, *connect, *token_file;
    bool        json, quiet;
    const char *cmd;
    int         npos;
    const char *pos[CLI_MAX_POS];
    int         nopt;
    const char *opt_name[CLI_MAX_OPTS];   /* without the dashes */
    const char *opt_val[CLI_MAX_OPTS];    /* NULL for a flag */
} cli_args;

const char *kvr__cli_opt(const cli_args *a, const char *name);      /* value or NULL */
bool        kvr__cli_flag(const cli_args *a, const char *name);

/* Subcommands (cli_cmd.c): return the exit code. */
int kvr__cli_run(kvr_client *c, const cli_args *a);
/* Whether a subcommand exists, and which options take a value. */
bool kvr__cli_known_command(const char *cmd);
bool kvr__cli_option_takes_value(const char *name);

/* Writes a KV result to `out` by extension (.safetensors, .npy, else raw
 * layer-major; "-" = stdout). CLI_OK or the exit code after printing why. */
int kvr__cli_write_kv(const cli_args *a, const kvr_kv *kv, const char *out);

/* Maps a libkvrope code to an exit code, printing the error. */
int kvr__cli_fail(const cli_args *a, kvr_client *c, int code, const char *what);
/* Context ctx (*x) and its model (*m): 0, or the libkvrope code. */
int kvr__cli_ctx_model(kvr_client *c, const char *ctx, kvr_context *x, kvr_model *m);
/* With --json: prints {"error": {code, name, message}} on stdout. */
void kvr__cli_error_json(const cli_args *a, int code, const char *msg);

/* Progress bar on stderr (only when it is a terminal). */
void kvr__cli_progress_begin(kvr_client *c, const char *label);
void kvr__cli_progress_end(void);

/* ---- tensor files (cli_files.c) ----------------------------------------- */
typedef struct cli_mapped {
    void  *base;
    size_t len;
    bool   mapped;   /* munmap, else free */
} cli_mapped;

/* How the file readers and parsers fail: the reason written into err
 * (errlen bytes), -1 returned. */
int  kvr__cli_errf(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int  kvr__cli_map_file(const char *path, cli_mapped *m, char *err, size_t errlen);
void kvr__cli_unmap(cli_mapped *m);

/* A safetensors file with KV tensors k, v [layers][tokens][heads][dim] and
 * optionally tokens, positions. Arrays are owned by the struct. */
typedef struct cli_st_kv {
    cli_mapped   file;
    kvr_dtype    dtype;
    uint32_t     n_layers, n_heads, head_dim;
    size_t       n_tokens;
    const uint8_t *k, *v;       /* into file */
    uint32_t    *tokens;        /* NULL if absent */
    int64_t     *positions;     /* NULL if absent */
    char         model[KVR_ID_MAX + 1];  /* from __metadata__, "" if absent */
} cli_st_kv;

int  kvr__cli_st_read(const char *path, cli_st_kv *st, char *err, size_t errlen);
void kvr__cli_st_free(cli_st_kv *st);

/* Writes kv (payload required) as safetensors: k, v, tokens, positions,
 * flags, groups; metadata names the model and context. */
int kvr__cli_st_write(const char *path, const kvr_kv *kv, char *err, size_t errlen);

/* One more tensor for kvr__cli_st_write_ex (data borrowed for the call). */
typedef struct cli_st_extra {
    const char *name;
    const char *dtype;      /* safetensors dtype name: "I64", "F64", ... */
    size_t      shape[4];
    int         ndim;
    const void *data;
    size_t      bytes;
} cli_st_extra;

/* kvr__cli_st_write plus n_meta metadata entries (extra_meta holds key, value,
 * key, value, ... strings) and n_extra tensors after the standard ones. */
int kvr__cli_st_write_ex(const char *path, const kvr_kv *kv, const char *const *extra_meta,
                    size_t n_meta, const cli_st_extra *extra, size_t n_extra, char *err,
                    size_t errlen);

/* A NumPy .npy file (docs/formats.md): little-endian, C order. data points
 * into the file (or the parsed buffer). */
#define CLI_NPY_MAX_DIMS 8
typedef struct cli_npy {
    cli_mapped     file;                    /* empty after kvr__cli_npy_parse */
    char           descr[8];                /* "<f4", "<f2", "<i4", "<u4", "<i8", ... */
    size_t         elem;                    /* bytes per element */
    int            ndim;
    size_t         shape[CLI_NPY_MAX_DIMS];
    size_t         count;                   /* elements */
    const uint8_t *data;
    size_t         data_len;
} cli_npy;

int  kvr__cli_npy_parse(const void *buf, size_t len, cli_npy *n, char *err, size_t errlen);
int  kvr__cli_npy_read(const char *path, cli_npy *n, char *err, size_t errlen);
void kvr__cli_npy_free(cli_npy *n);
/* A KV array [layers, 2, tokens, kv_heads, head_dim] of float32/float16:
 * exactly kvrope's layer-major payload. 0, or -1 with err naming path. */
int  kvr__cli_npy_kv_shape(const cli_npy *n, const char *path, kvr_dtype *dt, uint32_t *layers,
                      size_t *tokens, uint32_t *heads, uint32_t *dim, char *err, size_t errlen);
/* Writes an .npy (version 1) of descr and shape whose data are the iovecs. */
int  kvr__cli_npy_write(const char *path, const char *descr, const size_t *shape, int ndim,
                   struct iovec *iov, size_t n_iov, char *err, size_t errlen);

/* Writes a buffer / iovecs to path ("-" = stdout). */
int kvr__cli_write_iov(const char *path, struct iovec *iov, size_t n, char *err, size_t errlen);

bool kvr__cli_has_suffix(const char *s, const char *suffix);
/* Whether s is one of the strings of the NULL-terminated v. */
bool kvr__cli_in_list(const char *const *v, const char *s);
/* An enum's names as a designated-initialiser table of n entries (names[v]
 * for value v): the name of v ("?" outside the table or at a gap in it),
 * and the value named s (-1 if none). */
const char *kvr__cli_enum_name(const char *const *names, size_t n, int v);
int         kvr__cli_enum_parse(const char *const *names, size_t n, const char *s);
#define CLI_COUNT(a) (sizeof (a) / sizeof (a)[0])

/* Parses "1,2,3" (also spaces, brackets: a JSON array works) into a new
 * array (free). Returns count or -1. */
long kvr__cli_parse_u32_list(const char *s, uint32_t **out);
/* The --layers value ls (comma-separated layer indexes; NULL: not given,
 * nothing set) into *layers (malloc'd: the caller frees) and *n: CLI_OK, or
 * the usage error's exit code. */
int  kvr__cli_opt_layers(const char *ls, uint32_t **layers, size_t *n);
long kvr__cli_parse_i64_list(const char *s, int64_t **out);
/* Tokens from a file: *.bin = little-endian u32, *.npy = a 1-D integer
 * array, else text as above. */
long kvr__cli_read_tokens_file(const char *path, uint32_t **out, char *err, size_t errlen);

/* The prompt of --tokens 1,2,3 or --tokens-file F (new array, free; *n -1
 * when neither was given and !required). CLI_OK or the exit code, printed. */
int kvr__cli_load_tokens(const cli_args *a, uint32_t **tok, long *n, bool required);

/* ---- position layouts (cli_layout.c) ------------------------------------ */
struct cJSON;

/* The `kvrope --help` section of the layout commands (two strings: each
 * stays under the compiler's string-literal limit). */
extern const char kvr__cli_layout_help[];
extern const char kvr__cli_layout_help_file[];

/* assemble, group, retain: known/dispatched by main.c next to kvr__cli_run. */
bool kvr__cli_layout_command(const char *cmd);
int  kvr__cli_layout_run(kvr_client *c, const cli_args *a);
bool kvr__cli_layout_option_takes_value(const char *name);
bool kvr__cli_layout_option_is_flag(const char *name);

/* put's layout options: --prefix-ctx P (APE document), --group NAME and
 * --groups A,B[:PHI] (GPE). Fills po and, for a group put, clears p's
 * positions (the group gives them) and sets lay->group: the caller then
 * uses kvr_client_group_append. Returns CLI_OK or CLI_USAGE (printed). */
typedef struct cli_put_layout {
    const char *group;                              /* NULL: a plain put */
    char        name_buf[KVR_MAX_GROUPS][KVR_GROUP_NAME_MAX + 1];
    const char *names[KVR_MAX_GROUPS];
    int64_t     offsets[KVR_MAX_GROUPS];
} cli_put_layout;
int kvr__cli_put_layout_opts(const cli_args *a, kvr_put_args *p, cli_put_layout *lay);

/* stat: the context's layout (APE prefix, groups, retention) added to its
 * JSON object as "layout", or printed as more "label: value" lines. A
 * failed layout_stat adds / prints nothing. */
void kvr__cli_layout_stat_json(kvr_client *c, const char *ctx, struct cJSON *j);
void kvr__cli_layout_stat_print(kvr_client *c, const char *ctx);


/* ---- payloads from a model (cli_payload.c) ----------------------------- */
extern const char kvr__cli_payload_help[];
bool kvr__cli_payload_command(const char *cmd);
int  kvr__cli_payload_run(kvr_client *c, const cli_args *a);
bool kvr__cli_payload_option_takes_value(const char *name);

/* ---- llama.cpp states (cli_llama.c) ------------------------------------ */
extern const char kvr__cli_llama_help[];
bool kvr__cli_llama_command(const char *cmd);
int  kvr__cli_llama_run(kvr_client *c, const cli_args *a);
bool kvr__cli_llama_option_takes_value(const char *name);
bool kvr__cli_llama_option_is_flag(const char *name);

/* ---- covers (cli_cover.c) ----------------------------------------------- */
extern const char kvr__cli_cover_help[];
bool kvr__cli_cover_command(const char *cmd);
int  kvr__cli_cover_run(kvr_client *c, const cli_args *a);
bool kvr__cli_cover_option_takes_value(const char *name);

/* Shared by the command files (cli_cmd.c defines them). */
void kvr__cli_print_json(struct cJSON *j);         /* prints and frees j */
/* A KV result's JSON: its dtype, n_kv_heads, head_dim and layers; its
 * tokens, positions, flags, payload_bytes and the file it went to (if any). */
void kvr__cli_kv_shape_json(struct cJSON *j, const kvr_kv *kv);
void kvr__cli_kv_rows_json(struct cJSON *j, const kvr_kv *kv, const char *file);
int  kvr__cli_usage_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int  kvr__cli_io_err(const cli_args *a, const char *msg);
int  kvr__cli_parse_u64(const char *v, uint64_t *out);   /* 0, or -1 if not a u64 */
int  kvr__cli_parse_i64(const char *v, int64_t *out);    /* 0, or -1 if not an i64 */

#endif
