/*
 * kvrope_llama.h — the llama.cpp bridge of libkvrope: model profiles read from
 * GGUF files, and llama.cpp sequence states (llama_state_seq_get_data bytes,
 * or llama_state_seq_save_file files) imported into kvrope contexts and
 * exported from them. Plain C; it needs neither libllama nor its headers
 * (it knows the state format of llama.cpp v0.5.0, the release the build pins).
 *
 * Two layers:
 *  - pure, in memory, no daemon (tests, fuzzing, tools): kvr_llama_gguf_parse,
 *    kvr_llama_state_parse / _decode (state bytes -> kvrope's layer-major
 *    payload) and kvr_llama_state_encode (payload -> state bytes);
 *  - through a kvr_client: kvr_llama_model_register, kvr_llama_state_import,
 *    kvr_llama_state_export.
 *
 * Keys. llama.cpp stores keys after RoPE, at their cells' positions, paired
 * as the model's rope type says: NORM (arch llama: dims (2i, 2i+1), kvrope's
 * KVR_ROPE_GPTJ style) or NEOX (qwen2, ...: dims (i, i + rot/2), KVR_ROPE_NEOX).
 * A quantized K cache (q8_0, q4_0, q4_1, q5_0) with head_dim a multiple of 64
 * holds quant(H . RoPE(k)), H the orthonormal Walsh-Hadamard matrix of the
 * largest power of two (>= 64) dividing head_dim, applied per head; a quantized
 * V cache holds quant(H64 . v) per 64 values when head_dim is a multiple of 64
 * (llama.cpp's attn_rot_k / attn_rot_v; LLAMA_ATTN_ROT_DISABLE=1 switches both
 * off: say so with no_attn_rot). Decoding undoes H exactly as ggml's CPU FWHT
 * computes it (same operations, same order, float), encoding redoes it.
 * Import puts keys rotated at the cell positions (as kvrope's put expects);
 * the daemon keeps them so (plain codecs, stored-at = the cell position) or
 * removes the rotation before quantizing (quantized codecs). Export gets them
 * re-rotated by the daemon to the positions asked for: a pure rotation by
 * (new - stored-at), once, YaRN magnitude untouched.
 *
 * Exactness. f32/f16/bf16 states import into a context of the same plain
 * codec by default, so the stored bytes are the state's bytes, and an export
 * at the same positions and types gives back the same bytes (a context
 * restored from it computes bit-identical logits). Quantized states import as
 * f32 (the exact dequantized, Hadamard-undone values) unless a codec is asked.
 *
 * Errors: 0 or a negative KVR_E* code (rope/error.h): KVR_EINVAL
 * (malformed input: truncated, oversized, inconsistent), KVR_EUNSUPPORTED
 * (well-formed but not supported: ggml type, several streams, a cell in several
 * sequences, per-cell M-RoPE data, a GGUF that is not a supported model),
 * KVR_ESHAPE (state and model disagree), KVR_ENOMODEL / _NOCTX /
 * _EXIST / ... from the daemon, KVR_ENOMEM, KVR_ESYS (file I/O). Every
 * function that can fail writes a message naming what is wrong into
 * `err` (errlen bytes, always NUL-terminated; err may be NULL). A refused
 * import changes nothing stored: everything is parsed and checked before the
 * one request that stores.
 *
 * Threading: no global state; functions are reentrant. Client functions use
 * the handle as kvrope.h says (one call at a time per handle).
 */
#ifndef KVR_KVROPE_LLAMA_H
#define KVR_KVROPE_LLAMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "client/kvrope.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- types ---------------------------------------------------------------- */

/* Cache element types. 0 is "the default" (f16, llama.cpp's default cache
 * type) so that zeroed option structs mean llama.cpp's defaults. */
typedef enum kvr_llama_type {
    KVR_LLAMA_TYPE_DEFAULT = 0,
    KVR_LLAMA_F32  = 1,
    KVR_LLAMA_F16  = 2,
    KVR_LLAMA_BF16 = 3,
    KVR_LLAMA_Q8_0 = 4,
    KVR_LLAMA_Q4_0 = 5,
    KVR_LLAMA_Q4_1 = 6,
    KVR_LLAMA_Q5_0 = 7,
} kvr_llama_type;

/* ggml_type numbers (GGML_TYPE_F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3,
 * Q5_0 = 6, Q8_0 = 8, BF16 = 30) <-> kvr_llama_type. from_ggml returns
 * KVR_LLAMA_TYPE_DEFAULT for a type not listed; to_ggml maps DEFAULT to F16. */
kvr_llama_type kvr_llama_type_from_ggml(int ggml_type);
int            kvr_llama_type_to_ggml(kvr_llama_type t);
const char    *kvr_llama_type_name(kvr_llama_type t);      /* "f16", "q8_0", ...; DEFAULT: "f16" */
int            kvr_llama_type_parse(const char *s, kvr_llama_type *out); /* 0 or KVR_EINVAL */
bool           kvr_llama_type_is_quantized(kvr_llama_type t);

/* llama_rope_type values. */
#define KVR_LLAMA_ROPE_NORM 0   /* pairs (2i, 2i+1): arch llama (KVR_ROPE_GPTJ) */
#define KVR_LLAMA_ROPE_NEOX 2   /* pairs (i, i + rot/2): qwen2, ... (KVR_ROPE_NEOX) */

/* ---- model profiles (GGUF) ------------------------------------------------ */
#define KVR_LLAMA_ARCH_MAX 64

typedef struct kvr_llama_model {
    char     arch[KVR_LLAMA_ARCH_MAX];  /* general.architecture */
    char     name[KVR_ID_MAX + 1];    /* general.name ("" if absent) */
    uint32_t n_layers;                  /* <arch>.block_count */
    uint32_t n_embd;                    /* <arch>.embedding_length */
    uint32_t n_heads;                   /* <arch>.attention.head_count */
    uint32_t n_kv_heads;                /* <arch>.attention.head_count_kv (default n_heads) */
    uint32_t head_dim;                  /* attention.key_length (default n_embd / n_heads);
                                           value_length must equal it */
    uint32_t rotary_dim;                /* rope.dimension_count (default head_dim) */
    uint32_t n_ctx_train;               /* <arch>.context_length */
    uint32_t n_vocab;                   /* tokenizer.ggml.tokens entries (0 if absent) */
    int      rope_type;                 /* KVR_LLAMA_ROPE_NORM / _NEOX (llama_model_rope_type) */
    double   rope_base;                 /* rope.freq_base (default 10000) */
    kvr_rope_scaling scaling;           /* DEFAULT (none), LINEAR or YARN */
    double   factor;                    /* rope.scaling.factor (1 if none) */
    uint32_t orig_ctx;                  /* rope.scaling.original_context_length (default n_ctx_train) */
    /* YaRN as llama.cpp computes it (keys read when present, llama.cpp's
     * defaults otherwise). llama.cpp v0.5.0 does not read the yarn_beta_* /
     * yarn_ext_factor keys for every architecture: a worker passes these to
     * llama_context_params (kvr_llama_model_context_params below). */
    double   yarn_beta_fast;            /* default 32 */
    double   yarn_beta_slow;            /* default 1 */
    double   yarn_ext_factor;           /* default 1 for YaRN, 0 otherwise; kvrope requires 1 or 0 */
    double   yarn_log_mul;              /* rope.scaling.yarn_log_multiplier (0 = unset) */
    double   rope_attn_factor;          /* rope.scaling.attn_factor (default 1) */
    double   mscale;                    /* the magnitude llama.cpp's RoPE multiplies keys by
                                           (YaRN: (0.1 ln f + 1) * attn_factor, or the
                                           log-multiplier form; else 1) */
    kvr_rope_config rope;               /* kvrope's RoPE configuration of all the above
                                           (style, theta, scaling, attention_factor = mscale) */
    uint64_t fingerprint;               /* of this profile: metadata, tensor table and a sample
                                           of the weights (two seeds differ) */
} kvr_llama_model;

/* Reads a model profile from a GGUF v2/v3 file (mmap; only the metadata, the
 * tensor table and a few KiB of tensor data are touched) or from bytes in
 * memory (the same parser; len is the whole file). Refuses, naming the cause:
 * not GGUF (magic), an unknown version, truncated or huge declared lengths
 * (strings, arrays, counts beyond the bytes present), a GGUF without the
 * architecture's hyperparameters (a vocabulary or adapter file: "not a
 * model"), M-RoPE (rope.dimension_sections), per-layer head counts, key and
 * value lengths that differ, odd or oversized rotary dims, scaling types other
 * than none/linear/yarn, yarn_ext_factor other than 1. */
int kvr_llama_gguf_read(const char *path, kvr_llama_model *out, char *err, size_t errlen);
int kvr_llama_gguf_parse(const void *buf, size_t len, kvr_llama_model *out, char *err,
                         size_t errlen);

/* The default kvrope model name of a profile: "<general.name or arch>-<12 hex
 * digits of the fingerprint>", so that models with other weights get other
 * names. Writes at most cap bytes (NUL included); returns buf. */
char *kvr_llama_model_default_name(const kvr_llama_model *m, char *buf, size_t cap);

/* Registers the profile in the daemon under `name` (NULL = the default name):
 * its shape, RoPE configuration and dtype f16 (the model's default codec; each
 * import picks the context's codec). Registering again identically is fine; a
 * name taken by another profile is KVR_EEXIST. out may be NULL. */
int kvr_llama_model_register(kvr_client *c, const kvr_llama_model *m, const char *name,
                             kvr_model *out, char *err, size_t errlen);

/* ---- parsed states (pure) ------------------------------------------------- */
#define KVR_LLAMA_STATE_MAGIC   0xaf143cd8u   /* llama_state_seq_get_data */
#define KVR_LLAMA_SESSION_MAGIC 0x67677371u   /* 'ggsq', llama_state_seq_save_file */
#define KVR_LLAMA_SESSION_VERSION 3u

typedef enum kvr_llama_form {
    KVR_LLAMA_FORM_RAW     = 0,   /* u32 magic, i32 seq_id, then the memory state */
    KVR_LLAMA_FORM_SESSION = 1,   /* u32 'ggsq', u32 version 3, u32 n, i32 tokens[n], memory state */
} kvr_llama_form;

/* A parsed sequence state. Arrays are owned by the struct; K/V data pointers
 * borrow the parsed bytes (keep them alive while using the struct). */
typedef struct kvr_llama_state {
    kvr_llama_form  form;
    int32_t         seq_id;       /* raw form: the header's; session form: the cells' */
    uint32_t        n_tokens;     /* session form: tokens in the file (else 0) */
    int32_t        *tokens;       /* n_tokens ids (NULL if none) */
    uint32_t        n_cells;      /* cells of the one stream (0: empty sequence) */
    int32_t        *pos;          /* n_cells positions, in cell order */
    uint32_t        n_layers;
    bool            v_trans;
    kvr_llama_type  type_k, type_v;
    uint32_t        n_embd_k, n_embd_v;   /* values per cell and layer (n_kv_heads * head_dim) */
    uint64_t        row_k, row_v;         /* bytes per cell row (v_trans: per element for V) */
    const uint8_t **k;            /* n_layers: [n_cells][row_k] */
    const uint8_t **v;            /* n_layers: v_trans 0: [n_cells][row_v];
                                     v_trans 1: [n_embd_v][n_cells] elements */
    size_t          bytes;        /* bytes consumed (== the input length) */
} kvr_llama_state;

/* Parses a state of either form (detected by the magic). With m, the shape is
 * checked against the model (layers, K/V values per cell): KVR_ESHAPE
 * naming both. Refuses truncated input, trailing bytes, declared sizes beyond
 * the input, unknown or mixed ggml types, row sizes that disagree with the
 * type, several streams, a cell in more than one sequence (or another sequence
 * than the rest), per-cell extra data (M-RoPE), quantized V with v_trans 1.
 * On success *out is the caller's (kvr_llama_state_free). */
int  kvr_llama_state_parse(const void *buf, size_t len, const kvr_llama_model *m,
                           kvr_llama_state **out, char *err, size_t errlen);
void kvr_llama_state_free(kvr_llama_state *st);        /* NULL is a no-op */

/* Bytes of kvrope's layer-major payload for n cells (kvr_payload_size). */
size_t kvr_llama_payload_size(const kvr_llama_model *m, size_t n_cells, kvr_dtype dtype);

/* Cells [c0, c1) of st as kvrope's payload (layer-major; per layer K then V,
 * [n][n_kv_heads][head_dim] of dtype) into dst (cap bytes). Keys stay rotated
 * at their cell positions; quantized rows are dequantized and the Hadamard
 * transform undone (no_attn_rot: the state was made without it). When the
 * state's type equals dtype the bytes are copied unchanged. */
int kvr_llama_state_decode(const kvr_llama_state *st, const kvr_llama_model *m, uint32_t c0,
                           uint32_t c1, bool no_attn_rot, kvr_dtype dtype, void *dst,
                           size_t cap, char *err, size_t errlen);

typedef struct kvr_llama_encode_args {
    uint32_t        n_cells;
    const int32_t  *pos;          /* n_cells cell positions */
    const int32_t  *tokens;       /* session form: n_cells token ids (NULL: 0 tokens) */
    const void     *payload;      /* kvrope layer-major payload of the cells, keys
                                     rotated at pos (see decode) */
    kvr_dtype       dtype;        /* of the payload */
    kvr_llama_type  type_k, type_v;   /* DEFAULT = f16 */
    bool            v_trans;      /* 1: flash attention off in the destination */
    bool            no_attn_rot;  /* destination made with LLAMA_ATTN_ROT_DISABLE=1 */
    kvr_llama_form  form;
    int32_t         seq_id;       /* raw form header; every cell's sequence */
} kvr_llama_encode_args;

/* Builds a state (the raw form is what llama_state_seq_set_data takes, the
 * session form what llama_state_seq_load_file reads). *out is malloc'd, the
 * caller's (free or kvr_llama_free). f32/f16/bf16 conversions round to
 * nearest even; quantization is ggml's reference quantizer (bit for bit). */
int kvr_llama_state_encode(const kvr_llama_model *m, const kvr_llama_encode_args *a,
                           void **out, size_t *len, char *err, size_t errlen);
/* The same into the caller's buffer (cap bytes; KVR_EBUFFER if smaller
 * than kvr_llama_state_size): no allocation of the state, so a worker can
 * reuse one buffer. */
int kvr_llama_state_encode_to(const kvr_llama_model *m, const kvr_llama_encode_args *a,
                              void *dst, size_t cap, size_t *len, char *err, size_t errlen);
size_t kvr_llama_state_size(const kvr_llama_model *m, const kvr_llama_encode_args *a);

void kvr_llama_free(void *p);                           /* free() of this library's buffers */

/* ---- through the daemon --------------------------------------------------- */

typedef enum kvr_llama_import_mode {
    KVR_LLAMA_IMPORT_CREATE  = 0,  /* a new context (KVR_EEXIST if it exists) */
    KVR_LLAMA_IMPORT_REPLACE = 1,  /* create, or replace the context at once (a put
                                      REPLACE: readers see the old one until the new
                                      one is whole; a refused import leaves the old
                                      one); another model's context of that id is
                                      deleted first, then created */
    KVR_LLAMA_IMPORT_APPEND  = 2,  /* append the cells taken (the context must exist) */
    KVR_LLAMA_IMPORT_REFRESH = 3,  /* overwrite the KV of context tokens [ctx_start,
                                      ctx_start + n) (after an edit; their positions
                                      must equal the cells'); clears approximate /
                                      pending flags there */
} kvr_llama_import_mode;

typedef struct kvr_llama_import_opts {
    const char           *model;      /* kvrope model name (NULL = the default name) */
    kvr_llama_import_mode mode;
    uint32_t              cell_start; /* first cell taken */
    uint32_t              cell_end;   /* one past the last; 0 = all */
    /* Token ids of the cells taken, in cell order. Required for the raw form;
     * for the session form NULL = the file's tokens [cell_start, cell_end)
     * (the file must hold one token per cell). Ignored by REFRESH. */
    const uint32_t       *tokens;
    size_t                n_tokens;
    uint64_t              ctx_start;  /* REFRESH: first context token index */
    const char           *codec;      /* create: NULL = same as the state's type for
                                         f32/f16/bf16, "f32" for quantized states */
    bool                  persist;    /* create: persistent context (--disk-dir) */
    bool                  no_attn_rot;
} kvr_llama_import_opts;

typedef struct kvr_llama_import_info {
    kvr_llama_form form;
    int32_t        seq_id;
    uint32_t       n_cells;           /* in the state */
    uint32_t       n_taken;           /* stored */
    kvr_llama_type type_k, type_v;
    bool           v_trans;
    bool           k_hadamard, v_hadamard;  /* undone on the way in */
    int32_t        pos_first, pos_last;     /* of the cells taken */
    uint64_t       ctx_tokens;        /* context length after the import */
    uint64_t       state_bytes;       /* bytes of the state */
    uint64_t       payload_bytes;     /* bytes sent to the daemon */
    char           codec[KVR_CODEC_NAME_MAX];    /* the context's codec */
    char           model[KVR_ID_MAX + 1];
} kvr_llama_import_info;

/* Imports the state (len bytes, either form) into context ctx. The model
 * must be registered (kvr_llama_model_register) under opts->model; an
 * existing context (APPEND, REFRESH) must belong to that model, else
 * KVR_EFINGERPRINT naming both models. opts and info may be NULL (CREATE,
 * all cells, default name, session tokens). */
int kvr_llama_state_import(kvr_client *c, const char *ctx, const void *state, size_t len,
                           const kvr_llama_model *m, const kvr_llama_import_opts *opts,
                           kvr_llama_import_info *info, char *err, size_t errlen);

typedef struct kvr_llama_export_opts {
    const char     *model;        /* NULL = the default name; the context must belong to it */
    uint64_t        start, end;   /* context token range; end 0 = to the end */
    bool            has_pos_start;/* cells at pos_start, pos_start + 1, ...; else the
                                     tokens' current positions */
    int64_t         pos_start;
    kvr_llama_type  type_k, type_v;   /* the destination context's (DEFAULT = f16) */
    bool            v_trans;      /* destination with flash attention off */
    bool            no_attn_rot;
    int32_t         seq_id;       /* written in the raw header and the cells */
    kvr_llama_form  form;         /* RAW (set_data) or SESSION (load_file, with tokens) */
    /* Optional buffers the caller keeps between exports (no allocation and no
     * page faults per call): the state is written into dst (dst_cap bytes;
     * KVR_EBUFFER if too small) and *state = dst; the daemon's payload is
     * received into scratch (scratch_cap bytes) when it is large enough. */
    void           *dst;
    size_t          dst_cap;
    void           *scratch;
    size_t          scratch_cap;
    bool            v_trans_auto; /* instead of v_trans: the layout the context was
                                     imported with (an import records the state's
                                     v_trans: kvr_context.v_trans), for a caller
                                     that does not know the destination */
} kvr_llama_export_opts;

typedef struct kvr_llama_export_info {
    uint64_t       n_cells;
    int64_t        pos_first, pos_last;
    kvr_llama_type type_k, type_v;
    uint64_t       approx_tokens;  /* tokens flagged approximate (edited since) */
    uint64_t       payload_bytes;  /* bytes fetched from the daemon */
    uint64_t       state_bytes;
    bool           v_trans;        /* the V layout written (1: transposed) */
    bool           v_trans_recorded;  /* the context's import record said transposed */
} kvr_llama_export_info;

/* Exports tokens [start, end) of ctx, all layers, as a state: keys re-rotated
 * by the daemon to the positions asked, converted to the destination types
 * (Hadamard included). A range holding pending tokens is KVR_EPENDING;
 * positions beyond int32 are KVR_ERANGE. *state is malloc'd (kvr_llama_free),
 * or opts->dst when given (not to be freed).
 * opts and info may be NULL. */
int kvr_llama_state_export(kvr_client *c, const char *ctx, const kvr_llama_model *m,
                           const kvr_llama_export_opts *opts, void **state, size_t *len,
                           kvr_llama_export_info *info, char *err, size_t errlen);

/* ---- llama.cpp context parameters from a profile ---------------------------- */
/* Only where llama.h is included first: sets the RoPE fields of a
 * llama_context_params to the profile's, so that llama.cpp computes what the
 * profile (and so kvrope) says even where its loader skips a GGUF key. */
#if defined(LLAMA_H)
static inline void kvr_llama_model_context_params(const kvr_llama_model *m,
                                                  struct llama_context_params *p)
{
    if (m->scaling == KVR_ROPE_SCALING_YARN) {
        p->rope_scaling_type = LLAMA_ROPE_SCALING_TYPE_YARN;
        p->yarn_beta_fast = (float)m->yarn_beta_fast;
        p->yarn_beta_slow = (float)m->yarn_beta_slow;
        p->yarn_ext_factor = (float)m->yarn_ext_factor;
        p->yarn_orig_ctx = m->orig_ctx;
    }
}
#endif

#ifdef __cplusplus
}
#endif
#endif /* KVR_KVROPE_LLAMA_H */
