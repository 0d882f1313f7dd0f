/*
 * t_edit.c — PIE edits: edit (ops on a context's tokens, with the new
 * tokens' K/V as payload or without: then they are pending until a
 * refresh), refresh (K/V for pending tokens), edit_plan (what an edit
 * would do, without doing it).
 *
 * Invariants: begin validates the whole edit and nothing changes on a
 * refusal (a refused request's payload is drained); the payload goes
 * straight into the transaction; commit is on the loop thread.
 */
#include "daemon/dispatch.h"

int kvr__work_edit(kvr_request *r, kvr_error *e)     { return kvr_edit_work(r->edit, e); }

/* ---- edits (PIE) ------------------------------------------------------------- */

/* Resolves the shape fields of an Edit/Refresh: as given, else the model's
 * (the context's model, or the one named). */
static int edit_shape(kvr_request *r, const char *ctx_id, const char *model, bool has_l,
                      uint32_t *nl, bool has_h, uint32_t *nh, bool has_d, uint32_t *hd,
                      kvr_error *e)
{
    if (has_l && has_h && has_d)
        return 0;
    char name[KVR_ID_MAX + 1];
    if (model && model[0]) {
        snprintf(name, sizeof name, "%s", model);
    } else {
        kvr_ctx_info ci;
        int rc = kvr_store_stat(r->d->store, ctx_id, &ci, e);
        if (rc < 0)
            return rc;
        snprintf(name, sizeof name, "%s", ci.model);
    }
    kvr_model_info mi;
    if (kvr_store_model_find(r->d->store, name, &mi) < 0)
        return kvr_error_set(e, KVR_ENOMODEL, "unknown model '%s'", name);
    if (!has_l)
        *nl = mi.n_layers;
    if (!has_h)
        *nh = mi.n_kv_heads;
    if (!has_d)
        *hd = mi.head_dim;
    return 0;
}

static void reply_edit(kvr_request *r, const kvr_edit_result *res, const kvr_edit_span *spans,
                       size_t n_spans, uint64_t payload_bytes)
{
    Kvrope__EditResult er;
    if (kvr__pb_edit_result(res, spans, n_spans, payload_bytes, &er) < 0) {
        kvr__reply_errf(r, KVR_ENOMEM, "out of memory for the edit result");
        return;
    }
    REPLY_BODY(r, EDIT, edit, &er);
    kvr__pb_edit_result_free(&er);
}

/* Edit and Refresh: begin validates (nothing changes on refusal; a refused
 * request's payload is drained), the payload goes straight into the
 * transaction's iovecs, then work (threadpool) and commit (kvr__finish_edit). */
static void after_edit_begin(kvr_request *r, int rc, const kvr_error *e)
{
    if (rc < 0) {
        r->edit = NULL;
        kvr__reply_err(r, rc, e);
        return;
    }
    size_t want = kvr_edit_payload_size(r->edit);
    if ((uint64_t)want != r->payload_len) {   /* the store checked; be sure */
        kvr__release_txn(r);
        kvr__reply_errf(r, KVR_EPAYLOAD, "payload_len %llu, but the new tokens' KV is %zu bytes",
                   (unsigned long long)r->payload_len, want);
        return;
    }
    kvr__read_payload(r);
}

void kvr__do_edit(kvr_request *r)
{
    const Kvrope__Edit *q = r->msg->edit;
    kvr_error err = { 0 };
    kvr_edit_params ep;
    int rc = kvr__edit_params_from_pb(q, r->payload_len, &ep, &err);
    if (rc < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    kvr_error e = { 0 };
    if (ep.with_kv)
        rc = edit_shape(r, q->context_id, q->model, q->has_n_layers, &ep.n_layers,
                        q->has_n_kv_heads, &ep.n_kv_heads, q->has_head_dim, &ep.head_dim, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    kvr_edit_op *ops;
    if ((rc = kvr__edit_ops_from_pb(q->ops, q->n_ops, &ops, &err)) < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    ep.ops = ops;
    rc = kvr_store_edit_begin(r->d->store, &ep, &r->edit, &e);
    kvr_mem_free(ops);
    after_edit_begin(r, rc, &e);
}

void kvr__do_refresh(kvr_request *r)
{
    const Kvrope__Refresh *q = r->msg->refresh;
    kvr_error err = { 0 };
    kvr_refresh_params rp;
    int rc = kvr__refresh_params_from_pb(q, r->payload_len, &rp, &err);
    if (rc < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    kvr_error e = { 0 };
    rc = edit_shape(r, q->context_id, q->model, q->has_n_layers, &rp.n_layers,
                    q->has_n_kv_heads, &rp.n_kv_heads, q->has_head_dim, &rp.head_dim, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    rc = kvr_store_refresh_begin(r->d->store, &rp, &r->edit, &e);
    after_edit_begin(r, rc, &e);
}

void kvr__do_edit_plan(kvr_request *r)
{
    const Kvrope__EditPlan *q = r->msg->edit_plan;
    kvr_edit_params ep = {
        .ctx_id = q->context_id,
        .model = q->model,
        .fingerprint = q->has_fingerprint ? q->fingerprint : 0,
        .n_ops = q->n_ops,
        .expect = { .set = q->has_expect_length && q->has_expect_hash,
                    .n_tokens = q->expect_length, .hash = q->expect_hash },
    };
    kvr_error err = { 0 };
    kvr_edit_op *ops;
    int rc = kvr__edit_ops_from_pb(q->ops, q->n_ops, &ops, &err);
    if (rc < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    ep.ops = ops;
    kvr_edit_span *spans = q->n_ops ? kvr_mem_calloc(q->n_ops, sizeof *spans) : NULL;
    if (q->n_ops && !spans) {
        kvr_mem_free(ops);
        kvr__reply_errf(r, KVR_ENOMEM, "out of memory for %zu edit spans", q->n_ops);
        return;
    }
    kvr_edit_result res;
    kvr_error e = { 0 };
    rc = kvr_store_edit_plan(r->d->store, &ep, spans, &res, &e);
    kvr_mem_free(ops);
    if (rc < 0) {
        kvr_mem_free(spans);
        kvr__reply_err(r, rc, &e);
        return;
    }
    /* What the edit with KV will have to send, in the model's dtype. */
    uint64_t bytes = 0;
    kvr_ctx_info ci;
    kvr_model_info mi;
    if (kvr_store_stat(r->d->store, q->context_id, &ci, NULL) == 0 &&
        kvr_store_model_find(r->d->store, ci.model, &mi) == 0)
        bytes = (uint64_t)mi.n_layers * 2u * res.n_new * mi.n_kv_heads * mi.head_dim *
                kvr_dtype_size(mi.dtype);
    reply_edit(r, &res, spans, q->n_ops, bytes);
    kvr_mem_free(spans);
}

void kvr__finish_edit(kvr_request *r)
{
    if (kvr__work_failed(r))
        return;
    kvr_edit *t = r->edit;
    r->edit = NULL;
    size_t n = r->verb->body == KVROPE__REQUEST__BODY_EDIT ? r->msg->edit->n_ops : 1;
    kvr_edit_span *spans = kvr_mem_calloc(n ? n : 1, sizeof *spans);
    if (!spans) {
        kvr_edit_abort(t);
        kvr__reply_errf(r, KVR_ENOMEM, "out of memory for %zu edit spans", n);
        return;
    }
    kvr_edit_result res;
    kvr_error e = { 0 };
    int rc = kvr_edit_commit(t, spans, &res, &e);
    if (rc < 0) {
        kvr_mem_free(spans);
        kvr__reply_err(r, rc, &e);
        return;
    }
    reply_edit(r, &res, spans, n, res.payload_bytes);
    kvr_mem_free(spans);
}

