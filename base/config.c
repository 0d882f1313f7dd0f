/*
 * config.c — RoPE configurations as Hugging Face config.json states them:
 * parsing (cJSON), validation with messages that name the offending field,
 * and a canonical text of the rotation-relevant fields for fingerprints.
 *
 * The parser keeps values as the file states them (the effective values HF
 * derives, such as longrope's factor = max_position_embeddings /
 * original_max_position_embeddings, are derived by the engine), so the
 * canonical text changes exactly when the rotation could.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <math.h>
#include <stdarg.h>
#include <cjson/cJSON.h>

#include "base/config.h"

/* A refused configuration: KVR_EINVAL with a message naming the field. */
static int fail(kvr_error *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static int fail(kvr_error *err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvr_error_vset(err, KVR_EINVAL, fmt, ap);
    va_end(ap);
    return KVR_EINVAL;
}

void kvr_rope_config_init(kvr_rope_config *cfg)
{
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->style = KVR_ROPE_NEOX;
    cfg->theta = 10000.0;
    cfg->scaling = KVR_ROPE_SCALING_DEFAULT;
    cfg->factor = 1.0;
    cfg->beta_fast = 32.0;
    cfg->beta_slow = 1.0;
    cfg->attention_factor = (double)NAN;
    cfg->mscale = (double)NAN;
    cfg->mscale_all_dim = (double)NAN;
    cfg->low_freq_factor = (double)NAN;
    cfg->high_freq_factor = (double)NAN;
    cfg->yarn_truncate = 1;
    cfg->local_theta = (double)NAN;
}

kvr_rope_layer_kind kvr_rope_config_layer_kind(const kvr_rope_config *cfg, uint32_t layer)
{
    if (!cfg || cfg->n_layer_kinds <= 0 || layer >= (uint32_t)cfg->n_layer_kinds ||
        layer >= KVR_ROPE_MAX_LAYERS)
        return KVR_ROPE_LAYER_GLOBAL;
    return (kvr_rope_layer_kind)cfg->layer_kind[layer];
}

static const char *scaling_name(kvr_rope_scaling s)
{
    switch (s) {
    case KVR_ROPE_SCALING_DEFAULT:  return "default";
    case KVR_ROPE_SCALING_LINEAR:   return "linear";
    case KVR_ROPE_SCALING_DYNAMIC:  return "dynamic";
    case KVR_ROPE_SCALING_YARN:     return "yarn";
    case KVR_ROPE_SCALING_LONGROPE: return "longrope";
    case KVR_ROPE_SCALING_LLAMA3:   return "llama3";
    }
    return "unknown";
}

static bool uses_factor(kvr_rope_scaling s)
{
    return s == KVR_ROPE_SCALING_LINEAR || s == KVR_ROPE_SCALING_DYNAMIC ||
           s == KVR_ROPE_SCALING_YARN || s == KVR_ROPE_SCALING_LLAMA3;
}

int kvr_rope_config_validate(const kvr_rope_config *cfg, kvr_error *err)
{
    if (!cfg) return fail(err, "config: NULL");
    if (cfg->head_dim <= 0 || cfg->head_dim > KVR_ROPE_MAX_HEAD_DIM)
        return fail(err, "head_dim: %d is out of range (1..%d)",
                    (int)cfg->head_dim, KVR_ROPE_MAX_HEAD_DIM);
    if (cfg->rotary_dim <= 0)
        return fail(err, "rotary_dim: %d must be positive", (int)cfg->rotary_dim);
    if (cfg->rotary_dim % 2)
        return fail(err, "rotary_dim: %d is odd (rotation pairs dimensions)",
                    (int)cfg->rotary_dim);
    if (cfg->rotary_dim > cfg->head_dim)
        return fail(err, "rotary_dim: %d is larger than head_dim %d",
                    (int)cfg->rotary_dim, (int)cfg->head_dim);
    if (cfg->style != KVR_ROPE_NEOX && cfg->style != KVR_ROPE_GPTJ)
        return fail(err, "style: unknown pairing style %d", (int)cfg->style);
    if (!(cfg->theta > 0.0) || !isfinite(cfg->theta))
        return fail(err, "rope_theta: %g must be > 0", cfg->theta);
    if ((int)cfg->scaling < 0 || (int)cfg->scaling > KVR_ROPE_SCALING_LLAMA3)
        return fail(err, "rope_scaling.rope_type: unknown rope type %d", (int)cfg->scaling);

    if (cfg->n_layer_kinds < 0 || cfg->n_layer_kinds > KVR_ROPE_MAX_LAYERS)
        return fail(err, "layer_types: %d layers, kvrope keeps a per-layer RoPE map "
                    "for at most %d", (int)cfg->n_layer_kinds, KVR_ROPE_MAX_LAYERS);
    if (cfg->n_layer_kinds > 0 && cfg->num_layers > 0 && cfg->n_layer_kinds != cfg->num_layers)
        return fail(err, "layer_types: %d entries for num_hidden_layers %d",
                    (int)cfg->n_layer_kinds, (int)cfg->num_layers);
    for (int32_t l = 0; l < cfg->n_layer_kinds; l++) {
        if (cfg->layer_kind[l] > KVR_ROPE_LAYER_NONE)
            return fail(err, "layer_types[%d]: unknown layer kind %d", (int)l,
                        (int)cfg->layer_kind[l]);
        if (cfg->layer_kind[l] == KVR_ROPE_LAYER_LOCAL &&
            (!(cfg->local_theta > 0.0) || !isfinite(cfg->local_theta)))
            return fail(err, "rope_local_base_freq: %g must be > 0 (layer %d is a "
                        "sliding layer with its own base)", cfg->local_theta, (int)l);
    }
    kvr_rope_scaling s = cfg->scaling;
    const char *sn = scaling_name(s);
    if (uses_factor(s)) {
        if (isnan(cfg->factor))
            return fail(err, "rope_scaling.factor: required for rope type %s", sn);
        if (!(cfg->factor > 0.0) || !isfinite(cfg->factor))
            return fail(err, "rope_scaling.factor: %g must be > 0", cfg->factor);
    }
    if (s == KVR_ROPE_SCALING_LONGROPE && !isnan(cfg->factor) && !(cfg->factor > 0.0))
        return fail(err, "rope_scaling.factor: %g must be > 0", cfg->factor);
    if (cfg->original_max_position_embeddings < 0)
        return fail(err, "original_max_position_embeddings: must not be negative");
    if (cfg->max_position_embeddings < 0)
        return fail(err, "max_position_embeddings: must not be negative");
    int64_t orig = cfg->original_max_position_embeddings ? cfg->original_max_position_embeddings
                                                         : cfg->max_position_embeddings;
    switch (s) {
    case KVR_ROPE_SCALING_DYNAMIC:
        if (orig <= 0)
            return fail(err, "max_position_embeddings: required for rope type dynamic");
        if (cfg->rotary_dim <= 2)
            return fail(err, "rotary_dim: dynamic NTK needs rotary_dim > 2");
        break;
    case KVR_ROPE_SCALING_YARN:
        if (orig <= 0)
            return fail(err, "rope_scaling.original_max_position_embeddings: required "
                        "for rope type yarn (or max_position_embeddings)");
        if (!isfinite(cfg->beta_fast) || !isfinite(cfg->beta_slow) ||
            !(cfg->beta_fast > 0.0) || !(cfg->beta_slow > 0.0))
            return fail(err, "rope_scaling.beta_fast/beta_slow: must be > 0");
        if (!isnan(cfg->attention_factor) && !(cfg->attention_factor > 0.0))
            return fail(err, "rope_scaling.attention_factor: %g must be > 0",
                        cfg->attention_factor);
        break;
    case KVR_ROPE_SCALING_LLAMA3:
        if (cfg->original_max_position_embeddings <= 0)
            return fail(err, "rope_scaling.original_max_position_embeddings: required "
                        "for rope type llama3");
        if (isnan(cfg->low_freq_factor))
            return fail(err, "rope_scaling.low_freq_factor: required for rope type llama3");
        if (isnan(cfg->high_freq_factor))
            return fail(err, "rope_scaling.high_freq_factor: required for rope type llama3");
        if (!(cfg->low_freq_factor > 0.0))
            return fail(err, "rope_scaling.low_freq_factor: %g must be > 0",
                        cfg->low_freq_factor);
        if (!(cfg->high_freq_factor > cfg->low_freq_factor))
            return fail(err, "rope_scaling.high_freq_factor: %g must be larger than "
                        "low_freq_factor %g", cfg->high_freq_factor, cfg->low_freq_factor);
        break;
    case KVR_ROPE_SCALING_LONGROPE: {
        int want = cfg->rotary_dim / 2;
        if (cfg->n_short_factor <= 0)
            return fail(err, "rope_scaling.short_factor: required for rope type longrope");
        if (cfg->n_long_factor <= 0)
            return fail(err, "rope_scaling.long_factor: required for rope type longrope");
        if (cfg->n_short_factor != want)
            return fail(err, "rope_scaling.short_factor: has %d entries, expected "
                        "rotary_dim/2 = %d", (int)cfg->n_short_factor, want);
        if (cfg->n_long_factor != want)
            return fail(err, "rope_scaling.long_factor: has %d entries, expected "
                        "rotary_dim/2 = %d", (int)cfg->n_long_factor, want);
        for (int i = 0; i < want; i++) {
            if (!(cfg->short_factor[i] > 0.0) || !isfinite(cfg->short_factor[i]))
                return fail(err, "rope_scaling.short_factor[%d]: %g must be > 0",
                            i, cfg->short_factor[i]);
            if (!(cfg->long_factor[i] > 0.0) || !isfinite(cfg->long_factor[i]))
                return fail(err, "rope_scaling.long_factor[%d]: %g must be > 0",
                            i, cfg->long_factor[i]);
        }
        if (orig <= 0)
            return fail(err, "original_max_position_embeddings: required for rope "
                        "type longrope (or max_position_embeddings)");
        if (!isnan(cfg->attention_factor) && !(cfg->attention_factor > 0.0))
            return fail(err, "rope_scaling.attention_factor: %g must be > 0",
                        cfg->attention_factor);
        break;
    }
    default:
        break;
    }
    return 0;
}

bool kvr_rope_config_composes(const kvr_rope_config *cfg)
{
    return cfg && cfg->scaling != KVR_ROPE_SCALING_DYNAMIC &&
           cfg->scaling != KVR_ROPE_SCALING_LONGROPE;
}

/* ---- canonical text ------------------------------------------------------ */

typedef struct sbuf { char *p; size_t cap, len; } sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *at = b->len < b->cap ? b->p + b->len : NULL;
    size_t room = b->len < b->cap ? b->cap - b->len : 0;
    int n = vsnprintf(at, room, fmt, ap);
    va_end(ap);
    if (n > 0) b->len += (size_t)n;
}

static void sb_double(sbuf *b, const char *key, double v)
{
    if (isnan(v)) sb_printf(b, "%s=unset;", key);
    else sb_printf(b, "%s=%.17g;", key, v == 0.0 ? 0.0 : v);
}

size_t kvr_rope_config_canonical(const kvr_rope_config *cfg, char *buf, size_t cap)
{
    sbuf b = { buf, cap, 0 };
    if (buf && cap) buf[0] = '\0';
    if (!cfg) return 0;
    kvr_rope_scaling s = cfg->scaling;
    sb_printf(&b, "kvr-rope-v1;style=%s;head_dim=%d;rotary_dim=%d;",
              cfg->style == KVR_ROPE_GPTJ ? "gptj" : "neox",
              (int)cfg->head_dim, (int)cfg->rotary_dim);
    sb_double(&b, "theta", cfg->theta);
    sb_printf(&b, "scaling=%s;", scaling_name(s));
    if (s != KVR_ROPE_SCALING_DEFAULT) sb_double(&b, "factor", cfg->factor);
    if (s == KVR_ROPE_SCALING_YARN || s == KVR_ROPE_SCALING_LLAMA3 ||
        s == KVR_ROPE_SCALING_DYNAMIC || s == KVR_ROPE_SCALING_LONGROPE) {
        sb_printf(&b, "original_max_position_embeddings=%lld;",
                  (long long)cfg->original_max_position_embeddings);
    }
    if (s == KVR_ROPE_SCALING_DYNAMIC || s == KVR_ROPE_SCALING_LONGROPE ||
        (s == KVR_ROPE_SCALING_YARN && cfg->original_max_position_embeddings == 0))
        sb_printf(&b, "max_position_embeddings=%lld;", (long long)cfg->max_position_embeddings);
    if (s == KVR_ROPE_SCALING_YARN) {
        sb_double(&b, "beta_fast", cfg->beta_fast);
        sb_double(&b, "beta_slow", cfg->beta_slow);
        sb_double(&b, "mscale", cfg->mscale);
        sb_double(&b, "mscale_all_dim", cfg->mscale_all_dim);
    }
    if (s == KVR_ROPE_SCALING_YARN || s == KVR_ROPE_SCALING_LONGROPE)
        sb_double(&b, "attention_factor", cfg->attention_factor);
    if (s == KVR_ROPE_SCALING_LLAMA3) {
        sb_double(&b, "low_freq_factor", cfg->low_freq_factor);
        sb_double(&b, "high_freq_factor", cfg->high_freq_factor);
    }
    if (s == KVR_ROPE_SCALING_YARN && !cfg->yarn_truncate)
        sb_printf(&b, "truncate=0;");
    /* The per-layer map, when some layer differs from the config's RoPE
     * (a map of all-GLOBAL layers rotates exactly as no map). */
    bool mixed = false;
    for (int32_t l = 0; l < cfg->n_layer_kinds && l < KVR_ROPE_MAX_LAYERS; l++)
        mixed |= cfg->layer_kind[l] != KVR_ROPE_LAYER_GLOBAL;
    if (mixed) {
        sb_printf(&b, "layers=");
        for (int32_t l = 0; l < cfg->n_layer_kinds && l < KVR_ROPE_MAX_LAYERS; l++)
            sb_printf(&b, "%c", "GLN"[cfg->layer_kind[l] <= 2 ? cfg->layer_kind[l] : 0]);
        sb_printf(&b, ";");
        sb_double(&b, "local_theta", cfg->local_theta);
    }
    if (s == KVR_ROPE_SCALING_LONGROPE) {
        sb_printf(&b, "short_factor=[");
        for (int i = 0; i < cfg->n_short_factor && i < KVR_ROPE_MAX_HEAD_DIM / 2; i++)
            sb_printf(&b, "%s%.17g", i ? "," : "", cfg->short_factor[i]);
        sb_printf(&b, "];long_factor=[");
        for (int i = 0; i < cfg->n_long_factor && i < KVR_ROPE_MAX_HEAD_DIM / 2; i++)
            sb_printf(&b, "%s%.17g", i ? "," : "", cfg->long_factor[i]);
        sb_printf(&b, "];");
    }
    return b.len;
}

/* ---- JSON ------------------------------------------------------------------ */

static const cJSON *get(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

/* First present of several aliases. */
static const cJSON *get_any(const cJSON *o, const char *const *keys, const char **which)
{
    for (; *keys; keys++) {
        const cJSON *v = get(o, *keys);
        if (v) { if (which) *which = *keys; return v; }
    }
    return NULL;
}

static int read_num(const cJSON *v, const char *name, double *out, kvr_error *err)
{
    if (!cJSON_IsNumber(v))
        return fail(err, "%s: expected a number", name);
    *out = v->valuedouble;
    return 0;
}

static int read_int(const cJSON *v, const char *name, int64_t lo, int64_t hi, int64_t *out,
                    kvr_error *err)
{
    if (!cJSON_IsNumber(v))
        return fail(err, "%s: expected an integer", name);
    double d = v->valuedouble;
    if (d != floor(d) || d < (double)lo || d > (double)hi)
        return fail(err, "%s: %g is not an integer in range", name, d);
    *out = (int64_t)d;
    return 0;
}

static int read_list(const cJSON *v, const char *name, double *out, int32_t *n,
                     kvr_error *err)
{
    if (!cJSON_IsArray(v))
        return fail(err, "%s: expected a list of numbers", name);
    int cnt = cJSON_GetArraySize(v);
    if (cnt > KVR_ROPE_MAX_HEAD_DIM / 2)
        return fail(err, "%s: has %d entries, more than head_dim/2 can be", name, cnt);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsNumber(e))
            return fail(err, "%s[%d]: expected a number", name, i);
        out[i++] = e->valuedouble;
    }
    *n = cnt;
    return 0;
}

static bool interleaved_model(const char *mt)
{
    static const char *const names[] = {
        "gptj", "gpt-j", "codegen", "chatglm", "glm", "glm4", "cohere", "cohere2",
        "llama4", "llama4_text", NULL
    };
    for (int i = 0; names[i]; i++)
        if (!strcmp(mt, names[i])) return true;
    return false;
}

/* Per-layer RoPE as transformers builds it for the models that mix it:
 *   gemma3 / gemma3_text: sliding layers rotate with rope_local_base_freq
 *     (default 10000) and no scaling (Gemma3's rotary_emb_local);
 *   cohere2: sliding layers rotate, full-attention layers have no RoPE;
 *   llama4 / llama4_text: no_rope_layers[l] == 0 (default: every
 *     no_rope_layer_interval-th layer, 4) have no RoPE.
 * Layer types come from layer_types, else from sliding_window_pattern
 * (layer l is sliding unless (l + 1) % pattern == 0). Other models (gpt-oss,
 * Qwen, Mistral ...) use one RoPE for sliding and full layers alike. */
static int layer_map(kvr_rope_config *cfg, const cJSON *o, const cJSON *rs_local,
                     kvr_error *err)
{
    const char *mt = cfg->model_type;
    bool gemma3 = !strcmp(mt, "gemma3") || !strcmp(mt, "gemma3_text");
    bool cohere2 = !strcmp(mt, "cohere2");
    bool llama4 = !strcmp(mt, "llama4") || !strcmp(mt, "llama4_text");
    if (!gemma3 && !cohere2 && !llama4 && !rs_local)
        return 0;
    int32_t nl = cfg->num_layers;
    if (nl <= 0)
        return fail(err, "num_hidden_layers: required for the per-layer RoPE of "
                    "model type %s", mt[0] ? mt : "(v5 per-layer rope_parameters)");
    if (nl > KVR_ROPE_MAX_LAYERS)
        return fail(err, "num_hidden_layers: %d layers, kvrope keeps a per-layer "
                    "RoPE map for at most %d", (int)nl, KVR_ROPE_MAX_LAYERS);
    const cJSON *v;
    double dv = 0.0;
    cfg->n_layer_kinds = nl;
    memset(cfg->layer_kind, KVR_ROPE_LAYER_GLOBAL, sizeof cfg->layer_kind);
    if (llama4) {
        if ((v = get(o, "no_rope_layers"))) {
            if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != nl)
                return fail(err, "no_rope_layers: expected a list of %d 0/1 entries "
                            "(one per layer)", (int)nl);
            int i = 0;
            const cJSON *e;
            cJSON_ArrayForEach(e, v) {
                if (!cJSON_IsNumber(e) && !cJSON_IsBool(e))
                    return fail(err, "no_rope_layers[%d]: expected 0 or 1", i);
                bool use = cJSON_IsBool(e) ? cJSON_IsTrue(e) : e->valuedouble != 0.0;
                cfg->layer_kind[i++] = use ? KVR_ROPE_LAYER_GLOBAL : KVR_ROPE_LAYER_NONE;
            }
        } else {
            int64_t every = 4;
            if ((v = get(o, "no_rope_layer_interval")) &&
                read_int(v, "no_rope_layer_interval", 1, INT32_MAX, &every, err))
                return KVR_EINVAL;
            for (int32_t l = 0; l < nl; l++)
                if ((l + 1) % every == 0) cfg->layer_kind[l] = KVR_ROPE_LAYER_NONE;
        }
        return 0;
    }
    /* sliding / full per layer */
    uint8_t sliding_kind = gemma3 || rs_local ? KVR_ROPE_LAYER_LOCAL : KVR_ROPE_LAYER_GLOBAL;
    uint8_t full_kind = cohere2 ? KVR_ROPE_LAYER_NONE : KVR_ROPE_LAYER_GLOBAL;
    if (sliding_kind == KVR_ROPE_LAYER_LOCAL) {
        cfg->local_theta = 10000.0;
        if ((v = get(o, "rope_local_base_freq")) &&
            read_num(v, "rope_local_base_freq", &cfg->local_theta, err))
            return KVR_EINVAL;
        if (rs_local) {
            if (!cJSON_IsObject(rs_local))
                return fail(err, "rope_parameters.sliding_attention: expected an object");
            const cJSON *t = get(rs_local, "rope_type");
            if (!t) t = get(rs_local, "type");
            if (t && (!cJSON_IsString(t) || strcmp(t->valuestring, "default")))
                return fail(err, "rope_parameters.sliding_attention.rope_type: only "
                            "'default' is supported for sliding layers");
            if ((v = get(rs_local, "rope_theta")) &&
                read_num(v, "rope_parameters.sliding_attention.rope_theta", &cfg->local_theta,
                         err))
                return KVR_EINVAL;
        }
    }
    if ((v = get(o, "layer_types"))) {
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != nl)
            return fail(err, "layer_types: expected a list of %d layer types", (int)nl);
        int i = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            if (!cJSON_IsString(e))
                return fail(err, "layer_types[%d]: expected a string", i);
            if (!strcmp(e->valuestring, "sliding_attention"))
                cfg->layer_kind[i] = sliding_kind;
            else if (!strcmp(e->valuestring, "full_attention"))
                cfg->layer_kind[i] = full_kind;
            else
                return fail(err, "layer_types[%d]: unknown layer type '%s' (expected "
                            "sliding_attention or full_attention)", i, e->valuestring);
            i++;
        }
        return 0;
    }
    int64_t pattern = cohere2 ? 4 : 6;
    if ((v = get(o, "sliding_window_pattern"))) {
        if (read_num(v, "sliding_window_pattern", &dv, err)) return KVR_EINVAL;
        if (dv != floor(dv) || dv < 1 || dv > INT32_MAX)
            return fail(err, "sliding_window_pattern: %g must be a positive integer", dv);
        pattern = (int64_t)dv;
    }
    for (int32_t l = 0; l < nl; l++)
        cfg->layer_kind[l] = (l + 1) % pattern ? sliding_kind : full_kind;
    return 0;
}

int kvr_rope_config_from_json(kvr_rope_config *cfg, const char *json, size_t len,
                              const char *style_override, kvr_error *err)
{
    if (!cfg || (!json && len)) return fail(err, "config: NULL argument");
    kvr_rope_config_init(cfg);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) return fail(err, "config.json: not valid JSON");
    int rc = KVR_EINVAL;
    int64_t iv;
    double dv = 0.0;
    const char *which = NULL;
    const cJSON *v;

    if (!cJSON_IsObject(root)) { rc = fail(err, "config.json: not a JSON object"); goto out; }

    /* A composite config (vision-language models, transformers'
     * get_text_config()): the text model's fields are in text_config. */
    const cJSON *o = root;
    if ((v = get(o, "text_config"))) {
        if (!cJSON_IsObject(v)) { rc = fail(err, "text_config: expected an object"); goto out; }
        o = v;
    }
    if ((v = get(o, "model_type")) || (v = get(root, "model_type"))) {
        if (!cJSON_IsString(v)) { rc = fail(err, "model_type: expected a string"); goto out; }
        snprintf(cfg->model_type, sizeof cfg->model_type, "%s", v->valuestring);
    }
    const char *mt = cfg->model_type;

    /* Multi-head latent attention caches something else than per-head K/V. */
    if ((v = get(o, "kv_lora_rank"))) {
        rc = fail(err, "kv_lora_rank: %g: DeepSeek MLA caches a compressed latent "
                  "plus one shared rotary key k_pe (qk_rope_head_dim) per token, not "
                  "per-head K/V: not supported", cJSON_IsNumber(v) ? v->valuedouble : 0.0);
        goto out;
    }
    if ((v = get(o, "qk_rope_head_dim"))) {
        rc = fail(err, "qk_rope_head_dim: %g: heads split into rotated and "
                  "unrotated parts (MLA style) are not per-head K/V: not supported",
                  cJSON_IsNumber(v) ? v->valuedouble : 0.0);
        goto out;
    }

    static const char *const k_layers[] = { "num_hidden_layers", "n_layer", "num_layers", NULL };
    static const char *const k_heads[] = { "num_attention_heads", "n_head", NULL };
    static const char *const k_hidden[] = { "hidden_size", "n_embd", "d_model", NULL };
    static const char *const k_kv[] = { "num_key_value_heads", "multi_query_group_num", NULL };
    static const char *const k_maxpos[] = { "max_position_embeddings", "n_positions",
                                            "seq_length", NULL };
    static const char *const k_theta[] = { "rope_theta", "rotary_emb_base", NULL };
    static const char *const k_prf[] = { "partial_rotary_factor", "rotary_pct", NULL };

    if ((v = get_any(o, k_layers, &which))) {
        if (read_int(v, which, 0, INT32_MAX, &iv, err)) goto out;
        cfg->num_layers = (int32_t)iv;
    }
    int64_t hidden = 0;
    if ((v = get_any(o, k_heads, &which))) {
        if (read_int(v, which, 0, INT32_MAX, &iv, err)) goto out;
        cfg->num_heads = (int32_t)iv;
    }
    if ((v = get_any(o, k_hidden, &which))) {
        if (read_int(v, which, 0, INT32_MAX, &hidden, err)) goto out;
    }
    cfg->num_kv_heads = cfg->num_heads;
    /* ChatGLM: multi_query_group_num counts KV heads only with
     * multi_query_attention. */
    const cJSON *mqa = get(o, "multi_query_attention");
    if (mqa && cJSON_IsFalse(mqa) && !get(o, "num_key_value_heads")) {
        /* every head has its own K/V */
    } else if ((v = get_any(o, k_kv, &which))) {
        if (read_int(v, which, 1, INT32_MAX, &iv, err)) goto out;
        cfg->num_kv_heads = (int32_t)iv;
    }
    const cJSON *kvc = get(o, "kv_channels");   /* ChatGLM's head dim */
    if ((v = get(o, "head_dim")) || (v = kvc)) {
        const char *hn = v == kvc ? "kv_channels" : "head_dim";
        if (read_int(v, hn, 1, INT32_MAX, &iv, err)) goto out;
        cfg->head_dim = iv > INT32_MAX ? INT32_MAX : (int32_t)iv;
    } else if (hidden > 0 && cfg->num_heads > 0) {
        if (hidden % cfg->num_heads) {
            rc = fail(err, "head_dim: hidden_size %lld is not a multiple of "
                      "num_attention_heads %d", (long long)hidden, (int)cfg->num_heads);
            goto out;
        }
        cfg->head_dim = (int32_t)(hidden / cfg->num_heads);
    } else {
        rc = fail(err, "head_dim: absent, and hidden_size/num_attention_heads "
                  "cannot give it");
        goto out;
    }
    if ((v = get_any(o, k_maxpos, &which))) {
        if (read_int(v, which, 0, INT64_MAX / 2, &iv, err)) goto out;
        cfg->max_position_embeddings = iv;
    }
    if ((v = get_any(o, k_theta, &which))) {
        if (read_num(v, which, &cfg->theta, err)) goto out;
    }

    /* rotary_dim: explicit, else head_dim * partial_rotary_factor (HF int()). */
    cfg->rotary_dim = cfg->head_dim;
    if ((v = get(o, "rotary_dim"))) {
        if (read_int(v, "rotary_dim", INT32_MIN, INT32_MAX, &iv, err)) goto out;
        cfg->rotary_dim = (int32_t)iv;
    } else if ((v = get_any(o, k_prf, &which))) {
        if (read_num(v, which, &dv, err)) goto out;
        if (!(dv > 0.0) || dv > 1.0) {
            rc = fail(err, "%s: %g must be in (0, 1]", which, dv);
            goto out;
        }
        cfg->rotary_dim = (int32_t)((double)cfg->head_dim * dv);
    }
    /* ChatGLM (modeling_chatglm.py): RotaryEmbedding(rotary_dim // 2) with
     * rotary_dim = kv_channels, so only the first kv_channels/2 dims of a
     * head rotate, interleaved, base 10000 * rope_ratio. */
    if (!strncmp(mt, "chatglm", 7)) {
        if (!get(o, "rotary_dim"))
            cfg->rotary_dim = cfg->head_dim / 2;
        if ((v = get(o, "rope_ratio"))) {
            if (read_num(v, "rope_ratio", &dv, err)) goto out;
            if (!(dv > 0.0)) { rc = fail(err, "rope_ratio: %g must be > 0", dv); goto out; }
            cfg->theta *= dv;
        }
    }

    /* rope_scaling (or transformers v5's rope_parameters, which also carries
     * rope_theta). */
    const cJSON *rs = get(o, "rope_scaling");
    const cJSON *rs_local = NULL;    /* v5 per layer type: sliding layers' parameters */
    const char *rsn = "rope_scaling";
    if (!rs && (rs = get(o, "rope_parameters"))) {
        rsn = "rope_parameters";
        const cJSON *full = get(rs, "full_attention");
        if (full) {
            rs_local = get(rs, "sliding_attention");
            rs = full;
            rsn = "rope_parameters.full_attention";
        }
        if ((v = get(rs, "rope_theta")) && read_num(v, "rope_parameters.rope_theta",
                                                    &cfg->theta, err))
            goto out;
    }
    if (rs) {
        if (!cJSON_IsObject(rs)) { rc = fail(err, "%s: expected an object", rsn); goto out; }
        const cJSON *t = get(rs, "rope_type");
        const char *tkey = "rope_type";
        if (!t) { t = get(rs, "type"); tkey = "type"; }
        const char *tn = "default";
        if (t) {
            if (!cJSON_IsString(t)) { rc = fail(err, "%s.%s: expected a string", rsn, tkey); goto out; }
            tn = t->valuestring;
        }
        if (!strcmp(tn, "default")) cfg->scaling = KVR_ROPE_SCALING_DEFAULT;
        else if (!strcmp(tn, "linear")) cfg->scaling = KVR_ROPE_SCALING_LINEAR;
        else if (!strcmp(tn, "dynamic")) cfg->scaling = KVR_ROPE_SCALING_DYNAMIC;
        else if (!strcmp(tn, "yarn")) cfg->scaling = KVR_ROPE_SCALING_YARN;
        else if (!strcmp(tn, "longrope") || !strcmp(tn, "su")) cfg->scaling = KVR_ROPE_SCALING_LONGROPE;
        else if (!strcmp(tn, "llama3")) cfg->scaling = KVR_ROPE_SCALING_LLAMA3;
        else { rc = fail(err, "%s.%s: unknown rope type '%s'", rsn, tkey, tn); goto out; }

        char name[96];
#define RS_NUM(key, dst) do {                                                    \
            if ((v = get(rs, key))) {                                            \
                snprintf(name, sizeof name, "%s.%s", rsn, key);                 \
                if (read_num(v, name, &(dst), err)) goto out;            \
            }                                                                    \
        } while (0)
        if (cfg->scaling != KVR_ROPE_SCALING_DEFAULT) {
            bool has_factor = get(rs, "factor") != NULL;
            cfg->factor = (double)NAN;
            RS_NUM("factor", cfg->factor);
            if (!has_factor && uses_factor(cfg->scaling)) {
                rc = fail(err, "%s.factor: required for rope type %s", rsn, tn);
                goto out;
            }
        }
        RS_NUM("beta_fast", cfg->beta_fast);
        RS_NUM("beta_slow", cfg->beta_slow);
        RS_NUM("attention_factor", cfg->attention_factor);
        RS_NUM("mscale", cfg->mscale);
        RS_NUM("mscale_all_dim", cfg->mscale_all_dim);
        RS_NUM("low_freq_factor", cfg->low_freq_factor);
        RS_NUM("high_freq_factor", cfg->high_freq_factor);
#undef RS_NUM
        if ((v = get(rs, "truncate"))) {
            if (!cJSON_IsBool(v)) { rc = fail(err, "%s.truncate: expected true or false", rsn); goto out; }
            cfg->yarn_truncate = cJSON_IsTrue(v) ? 1 : 0;
        }
        if ((v = get(rs, "original_max_position_embeddings"))) {
            snprintf(name, sizeof name, "%s.original_max_position_embeddings", rsn);
            if (read_int(v, name, 1, INT64_MAX / 2, &iv, err)) goto out;
            cfg->original_max_position_embeddings = iv;
        }
        if (cfg->scaling == KVR_ROPE_SCALING_LONGROPE) {
            if (!(v = get(rs, "short_factor"))) {
                rc = fail(err, "%s.short_factor: required for rope type longrope", rsn);
                goto out;
            }
            if (read_list(v, "rope_scaling.short_factor", cfg->short_factor,
                          &cfg->n_short_factor, err)) goto out;
            if (!(v = get(rs, "long_factor"))) {
                rc = fail(err, "%s.long_factor: required for rope type longrope", rsn);
                goto out;
            }
            if (read_list(v, "rope_scaling.long_factor", cfg->long_factor,
                          &cfg->n_long_factor, err)) goto out;
            /* Phi-3 states original_max_position_embeddings at top level. */
            if (!cfg->original_max_position_embeddings &&
                (v = get(o, "original_max_position_embeddings"))) {
                if (read_int(v, "original_max_position_embeddings", 1, INT64_MAX / 2, &iv,
                             err)) goto out;
                cfg->original_max_position_embeddings = iv;
            }
        }
    }

    if ((rc = layer_map(cfg, o, rs_local, err)) != 0)
        goto out;
    rc = KVR_EINVAL;

    /* Pairing style. */
    if (style_override && *style_override) {
        if (!strcasecmp(style_override, "neox")) cfg->style = KVR_ROPE_NEOX;
        else if (!strcasecmp(style_override, "gptj")) cfg->style = KVR_ROPE_GPTJ;
        else { rc = fail(err, "style: '%s' is neither neox nor gptj", style_override); goto out; }
    } else {
        cfg->style = interleaved_model(cfg->model_type) ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX;
    }

    rc = kvr_rope_config_validate(cfg, err);
out:
    cJSON_Delete(root);
    return rc;
}

int kvr_rope_config_from_file(kvr_rope_config *cfg, const char *path,
                              const char *style_override, kvr_error *err)
{
    if (!cfg || !path) return fail(err, "config: NULL argument");
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvr_error_sys(err, KVR_EIO, errno, "%s", path);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    int rc = 0;
    if (!buf) { fclose(f); return kvr_error_set(err, KVR_ENOMEM, "%s: out of memory", path); }
    for (;;) {
        if (len == cap) {
            if (cap >= ((size_t)64 << 20)) {
                rc = fail(err, "%s: larger than 64 MiB, not a config.json", path);
                goto out;
            }
            char *nb = realloc(buf, cap * 2);
            if (!nb) { rc = kvr_error_set(err, KVR_ENOMEM, "%s: out of memory", path); goto out; }
            buf = nb;
            cap *= 2;
        }
        size_t n = fread(buf + len, 1, cap - len, f);
        len += n;
        if (n == 0) {
            if (ferror(f)) { rc = kvr_error_set(err, KVR_EIO, "%s: read error", path); goto out; }
            break;
        }
    }
    rc = kvr_rope_config_from_json(cfg, buf, len, style_override, err);
out:
    free(buf);
    fclose(f);
    return rc;
}
