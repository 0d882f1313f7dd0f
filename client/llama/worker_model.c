/*
 * worker_model.c — the kvrope model a GGUF file's KV lives under, as the
 * worker registers it: shape (layers, KV heads, head_dim), f16, and the RoPE
 * of the architecture (llama: NORM pairs (2i, 2i+1) = kvrope's GPTJ style;
 * qwen2 and the other NEOX architectures: half-split) with base, rotary
 * dims and linear scaling from the GGUF metadata. The name is derived from
 * those facts, so every worker (and process) on the same model file agrees
 * on it, and another model's contexts are never matched.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

#include "client/llama/worker.h"

static double meta_num(const struct llama_model *m, const char *arch, const char *key,
                       double dflt)
{
    char k[128], v[64];
    snprintf(k, sizeof k, "%s.%s", arch, key);
    if (llama_model_meta_val_str(m, k, v, sizeof v) <= 0)
        return dflt;
    char *end;
    double d = strtod(v, &end);
    return end == v ? dflt : d;
}

static bool meta_str(const struct llama_model *m, const char *arch, const char *key, char *out,
                     size_t cap)
{
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, key);
    return llama_model_meta_val_str(m, k, out, cap) > 0;
}

int kvr_wk_register(kvr_wk_env *e, const char *gguf)
{
    (void)gguf;
    const kvr_wk_lm_info *in = kvr_wk_lm_info_get(e->lm);
    const struct llama_model *m = kvr_wk_lm_model(e->lm);
    kvr_rope_config rc;
    kvr_rope_config_init(&rc);
    rc.head_dim = (int32_t)in->head_dim;
    rc.num_layers = (int32_t)in->n_layer;
    rc.num_heads = (int32_t)in->n_head;
    rc.num_kv_heads = (int32_t)in->n_head_kv;
    rc.rotary_dim = (int32_t)meta_num(m, in->arch, "rope.dimension_count", in->head_dim);
    rc.theta = meta_num(m, in->arch, "rope.freq_base", 10000.0);
    enum llama_rope_type rt = llama_model_rope_type(m);
    if (rt == LLAMA_ROPE_TYPE_NORM)
        rc.style = KVR_ROPE_GPTJ;
    else if (rt == LLAMA_ROPE_TYPE_NEOX)
        rc.style = KVR_ROPE_NEOX;
    else {
        snprintf(e->err, sizeof e->err, "architecture %s: rope type %d is not supported "
                 "(NORM and NEOX are)", in->arch, (int)rt);
        return -EINVAL;
    }
    char st[32] = "";
    meta_str(m, in->arch, "rope.scaling.type", st, sizeof st);
    if (st[0] && strcmp(st, "none") != 0) {
        if (strcmp(st, "linear") == 0) {
            rc.scaling = KVR_ROPE_SCALING_LINEAR;
            rc.factor = meta_num(m, in->arch, "rope.scaling.factor", 1.0);
        } else if (strcmp(st, "yarn") == 0) {
            rc.scaling = KVR_ROPE_SCALING_YARN;
            rc.factor = meta_num(m, in->arch, "rope.scaling.factor", 1.0);
            rc.original_max_position_embeddings =
                (int64_t)meta_num(m, in->arch, "rope.scaling.original_context_length", 0);
            rc.beta_fast = meta_num(m, in->arch, "rope.scaling.yarn_beta_fast", 32.0);
            rc.beta_slow = meta_num(m, in->arch, "rope.scaling.yarn_beta_slow", 1.0);
        } else {
            snprintf(e->err, sizeof e->err, "architecture %s: rope scaling \"%s\" is not "
                     "supported by the worker", in->arch, st);
            return -EINVAL;
        }
    }
    char err[256] = "";
    if (kvr_rope_config_validate(&rc, err, sizeof err) < 0) {
        snprintf(e->err, sizeof e->err, "the model's RoPE: %s", err);
        return -EINVAL;
    }
    /* Name: the architecture and a hash of everything the KV depends on. */
    char canon[4096];
    size_t cl = kvr_rope_config_canonical(&rc, canon, sizeof canon);
    if (cl >= sizeof canon)
        cl = sizeof canon - 1;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < cl; i++)
        h = (h ^ (unsigned char)canon[i]) * 1099511628211ull;
    uint32_t shape[3] = { in->n_layer, in->n_head_kv, in->head_dim };
    for (size_t i = 0; i < sizeof shape; i++)
        h = (h ^ ((const unsigned char *)shape)[i]) * 1099511628211ull;
    snprintf(e->model, sizeof e->model, "gguf-%s-%016llx", in->arch, (unsigned long long)h);
    kvr_model_params p = { .name = e->model, .n_layers = in->n_layer,
                           .n_kv_heads = in->n_head_kv, .head_dim = in->head_dim,
                           .dtype = KVR_DTYPE_F16, .rope = &rc };
    kvr_model out;
    int r = kvr_client_model_register(e->kc, &p, &out);
    if (r < 0) {
        e->kv_code = r;
        snprintf(e->err, sizeof e->err, "registering model %s in kvrope: %s", e->model,
                 kvr_client_last_error(e->kc));
        return r;
    }
    e->fingerprint = out.fingerprint;
    return 0;
}
