/*
 * config.h — a model's configuration as Hugging Face config.json states it:
 * the shape (layers, heads, head_dim) and everything that determines the
 * rotary embedding (theta, rotary dim, scaling type and its parameters,
 * pairing style, per-layer kinds), parsed and validated with messages that
 * name the offending field (base/config.c). The RoPE engine (rope/rope.h)
 * is built from it; the store fingerprints models by its canonical text.
 * Part of the installed API (through rope/rope.h).
 */
#ifndef KVR_BASE_CONFIG_H
#define KVR_BASE_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "base/error.h"

#ifdef __cplusplus
extern "C" {
#endif

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

#ifdef __cplusplus
}
#endif
#endif /* KVR_BASE_CONFIG_H */
