/*
 * t_model.c — the model verbs: register_model (a model's shape, dtype,
 * RoPE and default codec), list_models, remove_model.
 *
 * Invariants: a model's description is checked whole (convert.c) before
 * the store sees it; nothing is registered on a refusal.
 */
#include "daemon/dispatch.h"

void kvr__do_register_model(kvr_request *r)
{
    kvr_model_desc desc = { 0 };
    kvr_error err = { 0 };
    int rc = kvr__model_desc_from_pb(r->msg->register_model, &desc, &err);
    if (rc < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    kvr_model_info info;
    kvr_error e = { 0 };
    rc = kvr_store_model_register(r->d->store, &desc, &info, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    kvr_log(KVR_LOG_INFO, "model %s registered: %u layers, %u kv heads, head_dim %u",
            info.name, info.n_layers, info.n_kv_heads, info.head_dim);
    Kvrope__ModelInfo mi;
    Kvrope__RopeParams rp;
    kvr__pb_model(&info, &mi, &rp);
    REPLY_BODY(r, MODEL, model, &mi);
}

void kvr__do_list_models(kvr_request *r)
{
    size_t n = kvr_store_model_list(r->d->store, NULL, 0);
    kvr_model_info *infos = n ? kvr_mem_calloc(n, sizeof *infos) : NULL;
    Kvrope__ModelList ml;
    if (infos) {
        size_t got = kvr_store_model_list(r->d->store, infos, n);
        if (got < n)
            n = got;
    }
    if ((n && !infos) || kvr__pb_model_list(infos, n, &ml) < 0) {
        kvr_mem_free(infos);
        kvr__reply_errf(r, KVR_ENOMEM, "out of memory listing models");
        return;
    }
    REPLY_BODY(r, MODELS, models, &ml);
    kvr__pb_model_list_free(&ml);
    kvr_mem_free(infos);
}


void kvr__do_remove_model(kvr_request *r)
{
    kvr_error e = { 0 };
    int rc = kvr_store_model_remove(r->d->store, r->msg->remove_model->name, &e);
    kvr__reply_simple(r, rc, &e, NULL);
}

