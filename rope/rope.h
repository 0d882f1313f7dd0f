/*
 * rope.h — kvrope's positional engine: element types, RoPE configurations
 * read from Hugging Face config.json, and the kernels that apply, remove and
 * re-position rotary embeddings on [tokens][heads][head_dim] buffers.
 *
 * This is the whole public API of rope/. It has no dependency on libuv and
 * none on the rest of kvrope; cache/, daemon/ and client/ build on it.
 *
 * Conventions (the project's, base/error.h): functions return 0 on success
 * and a negative KVR_E* code on failure (KVR_EINVAL for a bad argument or
 * configuration, KVR_ENOMEM, KVR_EIO for a file that cannot be read).
 * Functions that can refuse a configuration take a `kvr_error *` (may be
 * NULL) and write a message naming the offending field there.
 *
 * Invariants the kernels keep:
 *  - Angles p * inv_freq[i] are computed in double precision.
 *  - Dimensions at index >= rotary_dim pass through unchanged (converted only).
 *  - reposition(k, from, to) is a pure rotation by (to - from): the YaRN
 *    magnitude factor (attention_factor) is multiplied in by apply, divided out
 *    by remove, and never touched by reposition, so norms are preserved.
 *  - In-place operation (dst == src with the same dtype) is allowed.
 */
#ifndef KVR_ROPE_H
#define KVR_ROPE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "base/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element types ------------------------------------------------------ */

typedef enum kvr_dtype {
    KVR_DTYPE_F32  = 0,
    KVR_DTYPE_F16  = 1,   /* IEEE binary16 */
    KVR_DTYPE_BF16 = 2,   /* bfloat16, round-to-nearest-even from f32 */
} kvr_dtype;

size_t      kvr_dtype_size(kvr_dtype t);            /* 4, 2, 2; 0 if unknown */
const char *kvr_dtype_name(kvr_dtype t);            /* "f32", "f16", "bf16" */
int         kvr_dtype_parse(const char *s, kvr_dtype *out); /* 0 or KVR_EINVAL */

float    kvr_f16_to_f32(uint16_t h);
uint16_t kvr_f32_to_f16(float f);                   /* RNE, inf/nan kept */
float    kvr_bf16_to_f32(uint16_t h);
uint16_t kvr_f32_to_bf16(float f);                  /* RNE, nan stays nan */

/* Converts n elements; dst and src may be the same buffer only when the
 * element sizes are equal. Uses F16C/AVX-512 where the CPU has them. */
void kvr_convert(void *dst, kvr_dtype dst_type,
                 const void *src, kvr_dtype src_type, size_t n);

/* dst = src * scale element-wise: each element widened to f32, multiplied
 * in f32 and rounded once to dst_type; the same bits as kvr_convert to
 * f32, a multiply and kvr_convert back, in one pass. dst != src. */
void kvr_convert_scaled(void *dst, kvr_dtype dst_type,
                        const void *src, kvr_dtype src_type, size_t n, float scale);

/* memcpy of n bytes (no overlap) that nothing reads back soon, e.g. a whole
 * context into a caller's buffer: with non-temporal stores where the CPU
 * has AVX-512 (no read of each destination line before it is written),
 * plain memcpy for the unaligned ends and elsewhere; fenced before it
 * returns. */
void kvr_copy_stream(void *dst, const void *src, size_t n);

/* ---- configuration ------------------------------------------------------ */

typedef enum kvr_rope_style {
    KVR_ROPE_NEOX = 0,  /* half-split pairs (i, i + rot/2): HF rotate_half,
                           ggml GGML_ROPE_TYPE_NEOX.  rot=8 --> [ccccssss] */
    KVR_ROPE_GPTJ = 1,  /* interleaved pairs (2i, 2i+1): GPT-J, ggml
                           GGML_ROPE_TYPE_NORMAL.     rot=8 --> [cscscscs] */
} kvr_rope_style;

typedef enum kvr_rope_scaling {
    KVR_ROPE_SCALING_DEFAULT  = 0,
    KVR_ROPE_SCALING_LINEAR   = 1,
    KVR_ROPE_SCALING_DYNAMIC  = 2,  /* dynamic NTK: frequencies depend on length */
    KVR_ROPE_SCALING_YARN     = 3,
    KVR_ROPE_SCALING_LONGROPE = 4,  /* short/long factors depend on length */
    KVR_ROPE_SCALING_LLAMA3   = 5,
} kvr_rope_scaling;

#define KVR_ROPE_MAX_HEAD_DIM 1024
#define KVR_ROPE_MAX_LAYERS   1024   /* longest per-layer map a config may state */

/* What a layer does with positions, for models that mix RoPE per layer. */
typedef enum kvr_rope_layer_kind {
    KVR_ROPE_LAYER_GLOBAL = 0,  /* the config's own RoPE (theta, scaling, ...) */
    KVR_ROPE_LAYER_LOCAL  = 1,  /* sliding-window layers with their own base and
                                   no scaling: Gemma 3's rope_local_base_freq */
    KVR_ROPE_LAYER_NONE   = 2,  /* no RoPE at all (Llama 4 NoPE layers, Cohere 2
                                   global layers): keys pass through */
} kvr_rope_layer_kind;

/* Everything that determines the rotation, as HF config.json states it.
 * Fields that a config leaves unset hold the HF defaults after parsing;
 * doubles documented as "NaN = unset" keep NaN so that the HF rule for the
 * default applies (e.g. YaRN attention_factor = 0.1*ln(factor)+1). */
typedef struct kvr_rope_config {
    /* shape (not part of the rotation, but read from the same file) */
    int32_t  num_layers;           /* num_hidden_layers, 0 if absent */
    int32_t  num_heads;            /* num_attention_heads */
    int32_t  num_kv_heads;         /* num_key_value_heads, default num_heads */
    int32_t  head_dim;             /* head_dim or hidden_size/num_attention_heads */
    int32_t  rotary_dim;           /* rotary_dim, or head_dim*partial_rotary_factor */
    int64_t  max_position_embeddings;
    char     model_type[32];       /* "llama", "gptj", ... ("" if absent) */

    kvr_rope_style   style;
    double           theta;        /* rope_theta, default 10000 */
    kvr_rope_scaling scaling;
    double   factor;               /* linear/dynamic/yarn/longrope/llama3 */
    int64_t  original_max_position_embeddings; /* 0 = unset */
    double   beta_fast, beta_slow;              /* yarn: default 32, 1 */
    double   attention_factor;                  /* yarn/longrope: NaN = unset */
    double   mscale, mscale_all_dim;            /* yarn (DeepSeek): NaN = unset */
    double   low_freq_factor, high_freq_factor; /* llama3 */
    int32_t  yarn_truncate;                     /* yarn: 1 (HF default) floors/ceils
                                                   the correction range, 0 not (gpt-oss) */
    /* Per-layer RoPE. n_layer_kinds is 0 when every layer uses the config
     * above; else it equals num_layers and layer_kind[l] says what layer l
     * does (kvr_rope_layer_kind). local_theta is the base of LOCAL layers
     * (NaN when there are none). */
    double   local_theta;
    int32_t  n_layer_kinds;
    uint8_t  layer_kind[KVR_ROPE_MAX_LAYERS];
    int32_t  n_short_factor, n_long_factor;     /* longrope: must be rotary_dim/2 */
    double   short_factor[KVR_ROPE_MAX_HEAD_DIM / 2];
    double   long_factor[KVR_ROPE_MAX_HEAD_DIM / 2];
} kvr_rope_config;

/* Fills `cfg` with defaults: NeoX, theta 10000, no scaling, sizes 0, one
 * RoPE for every layer. */
void kvr_rope_config_init(kvr_rope_config *cfg);

/* Parses the text of an HF config.json (len bytes, not necessarily
 * NUL-terminated). `style_override` is NULL, "neox" or "gptj"; without it the
 * style follows model_type (gptj, codegen, chatglm, llama4, ... are
 * interleaved). Validates the result (kvr_rope_config_validate).
 * As transformers reads them: a composite config (text_config) is read from
 * its text_config; transformers v5's rope_parameters (also per layer type);
 * ChatGLM's kv_channels (rotary over kv_channels/2, base 10000*rope_ratio);
 * per-layer RoPE of Gemma 3 (sliding layers: rope_local_base_freq), Llama 4
 * (no_rope_layers) and Cohere 2 (global layers without RoPE), from
 * layer_types or sliding_window_pattern. Refused with the field named: MLA
 * models (kv_lora_rank: DeepSeek-V2/V3 cache a latent, not per-head K/V). */
int kvr_rope_config_from_json(kvr_rope_config *cfg, const char *json, size_t len,
                              const char *style_override, kvr_error *err);
int kvr_rope_config_from_file(kvr_rope_config *cfg, const char *path,
                              const char *style_override, kvr_error *err);

/* Refuses, naming the field: unknown rope type, missing required parameter,
 * theta <= 0, rotary dim odd or > head_dim, factor <= 0, short/long factor
 * lists of the wrong length, head_dim out of range. */
int kvr_rope_config_validate(const kvr_rope_config *cfg, kvr_error *err);

/* Serialises the rotation-relevant fields canonically (for fingerprints and
 * the wire). Writes at most cap bytes, returns the length needed. */
size_t kvr_rope_config_canonical(const kvr_rope_config *cfg, char *buf, size_t cap);

/* True if rotation by a delta composes for this configuration (default,
 * linear, yarn, llama3). Dynamic NTK and longrope do not. */
bool kvr_rope_config_composes(const kvr_rope_config *cfg);

/* The kind of layer `layer` (KVR_ROPE_LAYER_GLOBAL when the config has no
 * per-layer map or the layer is past it). */
kvr_rope_layer_kind kvr_rope_config_layer_kind(const kvr_rope_config *cfg, uint32_t layer);

/* The sequence length transformers would use for a forward over these
 * positions (max + 1, at least 1): the default seq_len of a dynamic NTK /
 * longrope table. */
int64_t kvr_rope_default_seq_len(const int64_t *pos, size_t n);

/* ---- engine ------------------------------------------------------------- */

typedef struct kvr_rope kvr_rope;   /* immutable after create; thread-safe */

/* Builds the frequency tables. The caller owns *out (kvr_rope_destroy). */
int  kvr_rope_create(kvr_rope **out, const kvr_rope_config *cfg, kvr_error *err);
void kvr_rope_destroy(kvr_rope *r);                 /* NULL is a no-op */
const kvr_rope_config *kvr_rope_get_config(const kvr_rope *r);

/* The engine of one layer: r itself for GLOBAL layers (and for configs
 * without a per-layer map), else an engine owned by r for that layer's kind
 * (LOCAL: local_theta, no scaling; NONE: no rotation, kernels only convert).
 * Never NULL for a non-NULL r. */
const kvr_rope *kvr_rope_layer(const kvr_rope *r, uint32_t layer);

/* Effective values the engine derived (what model info reports): the factor
 * (longrope: max/original positions when both are given) and the magnitude
 * applied with the rotation (YaRN / longrope attention factor, else 1). */
double kvr_rope_factor(const kvr_rope *r);
double kvr_rope_attention_scale(const kvr_rope *r);

/* True if the frequency tables for the two sequence lengths are the same
 * (always for composing types; dynamic NTK: both within the original
 * length; longrope: both on the same side of it). */
bool kvr_rope_same_table(const kvr_rope *r, int64_t seq_len_a, int64_t seq_len_b);

typedef enum kvr_isa {
    KVR_ISA_AUTO   = 0,   /* best the CPU supports */
    KVR_ISA_SCALAR = 1,   /* the reference */
    KVR_ISA_AVX2   = 2,   /* AVX2 + FMA + F16C */
    KVR_ISA_AVX512 = 3,
} kvr_isa;

/* Per-call options; pass NULL for the defaults (all zero). */
typedef struct kvr_rope_opts {
    int     n_threads;      /* 0 = 1 thread for small buffers, more for large */
    kvr_isa isa;            /* force a kernel (tests, bench); AUTO by default */
    /* Dynamic NTK / longrope only: the sequence length whose frequency table
     * the key was written with (seq_len_from) and the one to rotate into
     * (seq_len_to). 0 = the table for lengths within
     * original_max_position_embeddings. For composing types these are
     * ignored. reposition with different tables removes with the old table
     * and applies with the new one (never a delta rotation). apply rotates
     * with the seq_len_to table, remove un-rotates with the seq_len_from
     * table. Tables equal for both lengths (e.g. both within the original
     * length) make reposition the plain delta rotation. Dynamic NTK:
     * base = theta * (factor*L/orig - (factor-1))^(rot/(rot-2)), L =
     * max(seq_len, orig); longrope: long_factor when seq_len > orig, else
     * short_factor (its attention factor is the same for both, so it cancels
     * in reposition). */
    int64_t seq_len_from;
    int64_t seq_len_to;
    /* The output is large and not read again soon (a whole context into a
     * caller's buffer): kvr_rope_reposition_delta, kvr_rope_apply,
     * kvr_rope_apply_src and kvr_rope_remove may write it with
     * non-temporal stores where the ISA and dst's alignment allow (no read
     * of each destination line before its write). The same bits; stores
     * are fenced before the call returns. */
    bool    stream;
} kvr_rope_opts;

kvr_isa     kvr_isa_best(void);                     /* what AUTO resolves to */
const char *kvr_isa_name(kvr_isa isa);

/* Buffers are [n_tokens][n_heads][head_dim] contiguous, head_dim from the
 * config. pos / from / to have n_tokens entries, any int64 values
 * (non-contiguous, repeated, negative deltas are all fine).
 * apply:      dst = R(pos) x * mscale                (x un-rotated)
 * remove:     dst = R(-pos) k / mscale               (k rotated at pos)
 * reposition: dst = R(to - from) k                   (pure rotation)
 * Returns KVR_EINVAL for a bad dtype or a NULL buffer with n_tokens > 0. */
int kvr_rope_apply(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                   const void *src, kvr_dtype src_type,
                   size_t n_tokens, size_t n_heads, const int64_t *pos,
                   const kvr_rope_opts *opts);
/* apply, with the f32 source rows produced on demand: src(ud, t) returns
 * token t's n_heads * head_dim values (valid until the next call), asked
 * for in token order on the calling thread (opts->n_threads is ignored).
 * The rotation is kvr_rope_apply's on the same values, to the bit; a
 * dequantizing reader decodes a few rows into cache-sized scratch instead
 * of the whole source. */
typedef const float *(*kvr_rope_src_fn)(void *ud, size_t t);
int kvr_rope_apply_src(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                       kvr_rope_src_fn src, void *ud, size_t n_tokens, size_t n_heads,
                       const int64_t *pos, const kvr_rope_opts *opts);
int kvr_rope_remove(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                    const void *src, kvr_dtype src_type,
                    size_t n_tokens, size_t n_heads, const int64_t *pos,
                    const kvr_rope_opts *opts);
int kvr_rope_reposition(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                        const void *src, kvr_dtype src_type,
                        size_t n_tokens, size_t n_heads,
                        const int64_t *from, const int64_t *to,
                        const kvr_rope_opts *opts);

/* reposition by one delta for every token (to - from = delta), each result
 * multiplied by `scale` in f32 before it is rounded to dst_type (APE's
 * temperature folded into the keys), in one pass: the per-token table is
 * computed once per call (per thread's share) and reused for every token.
 * The same bits as kvr_rope_reposition with those positions into f32,
 * times scale, kvr_convert to dst_type; with scale 1 exactly
 * kvr_rope_reposition. For RoPE that composes, or tables of the two
 * lengths in opts that are the same; KVR_EINVAL otherwise (and for what
 * reposition refuses). dst != src unless the dtypes are equal and scale
 * is 1. */
int kvr_rope_reposition_delta(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                              const void *src, kvr_dtype src_type,
                              size_t n_tokens, size_t n_heads, int64_t delta, float scale,
                              const kvr_rope_opts *opts);

/* ---- worker pool --------------------------------------------------------- */
/* One persistent pool of threads for every parallel loop of the project
 * (rotation here, conversion and codecs in the store): threads are created
 * once, not per call. Thread-safe; loops may be started from any number of
 * threads at once and may nest (an item may run a loop of its own) without
 * deadlock: the calling thread always works on its own loop and never waits
 * for an index nobody has claimed. */
typedef struct kvr_pool kvr_pool;

#define KVR_POOL_MAX_WORKERS 64

/* A pool of n_workers threads (0: callers run their loops alone); at most
 * KVR_POOL_MAX_WORKERS. 0 or KVR_ENOMEM; the caller owns *out. */
int  kvr_pool_create(kvr_pool **out, unsigned n_workers);
/* Joins the workers and frees the pool; no loop may be running on it.
 * NULL is a no-op. */
void kvr_pool_destroy(kvr_pool *p);
/* The process's pool, created on first use with one worker per online CPU
 * besides the caller, its workers joined at exit. Borrowed; never NULL
 * unless it could not be allocated (then loops run on the caller). */
kvr_pool *kvr_pool_default(void);
/* Threads a loop on p can use: its workers allowed to help (below) plus
 * the caller. */
unsigned kvr_pool_threads(const kvr_pool *p);
/* At most n_workers of p's workers help loops at any one time, whatever the
 * number of loops running (the callers' threads always work on their own
 * loops); the rest sleep. Starts at all of them. A process that shares its
 * cores with other work caps the pool so; benchmarks measure 1..N threads
 * with it. Results never depend on it. NULL is a no-op. */
void kvr_pool_set_active(kvr_pool *p, unsigned n_workers);

/* Calls fn(ud, i) for every i in [0, n), each exactly once, on at most
 * max_threads threads (the caller's included; p NULL = kvr_pool_default()).
 * After the first non-zero return no further index is handed out, and that
 * value is returned (0 if every call succeeded). Returns once every call
 * has returned. */
int kvr_pool_for(kvr_pool *p, size_t n, unsigned max_threads,
                 int (*fn)(void *ud, size_t i), void *ud);

#ifdef __cplusplus
}
#endif
#endif /* KVR_ROPE_H */
