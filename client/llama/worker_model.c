/*
 * worker_model.c — the kvrope model a GGUF file's KV lives under: the
 * bridge's profile of the file (kvr_llama_gguf_read: shape, RoPE pairing,
 * base, rotary dims, linear / YaRN scaling, a fingerprint of the weights)
 * registered under the bridge's default name (kvr_llama_model_register), so
 * the worker, `kvrope llama import/export --gguf` and every other process on
 * the same file agree on the model, and another model's contexts are never
 * matched. The profile also sets llama.cpp's RoPE context parameters where
 * its loader skips a GGUF key (kvr_llama_model_context_params).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

#include "client/llama/kvrope_llama.h"
#include "client/llama/worker.h"

int kvr__wk_profile(kvr__wk_env *e, const char *gguf)
{
    kvr_llama_model *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(e->err, sizeof e->err, "out of memory");
        return KVR_ENOMEM;
    }
    char err[512] = "";
    int r = kvr_llama_gguf_read(gguf, m, err, sizeof err);
    if (r < 0) {
        free(m);
        snprintf(e->err, sizeof e->err, "model %s: %s", gguf, err);
        return r;
    }
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e->lm);
    if (m->n_layers != in->n_layer || m->n_kv_heads != in->n_head_kv ||
        m->head_dim != in->head_dim) {
        snprintf(e->err, sizeof e->err, "model %s: the GGUF profile (%u layers, %u KV heads x "
                 "%u) is not what llama.cpp loaded (%u x %u x %u)", gguf, m->n_layers,
                 m->n_kv_heads, m->head_dim, in->n_layer, in->n_head_kv, in->head_dim);
        free(m);
        return KVR_EINVAL;
    }
    e->profile = m;
    kvr__wk_lm_set_profile(e->lm, m);
    return 0;
}

int kvr__wk_register(kvr__wk_env *e, const char *gguf)
{
    if (!e->profile) {
        int r = kvr__wk_profile(e, gguf);
        if (r < 0)
            return r;
    }
    kvr_llama_model_default_name(e->profile, e->model, sizeof e->model);
    kvr_model out;
    char err[512] = "";
    int r = kvr_llama_model_register(e->kc, e->profile, NULL, &out, err, sizeof err);
    if (r < 0) {
        e->kv_code = r;
        snprintf(e->err, sizeof e->err, "%s", err);
        return r;
    }
    e->fingerprint = out.fingerprint;
    return 0;
}
