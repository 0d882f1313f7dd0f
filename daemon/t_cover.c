/*
 * t_cover.c — the Cover verb (docs/reuse.md): the cached runs that make up
 * a prompt, wherever they sit in it, and with Cover.get their K/V placed
 * for the prompt in one reply (or in the client's shared memory).
 *
 * The verb reads the message, asks the store for the cover
 * (kvr_store_cover) and, with get, opens the placed read
 * (kvr_store_cover_get_begin: an assemble transaction, so the request is
 * staged, worked, copied into a region and sent exactly as an assemble's,
 * kvr__work_assemble doing the work); then it fills the CoverResult.
 * kvr__do_cover / kvr__finish_cover hold the request (dispatch.h).
 *
 * Invariants: a kvr__cover owns the cover result the reply's runs point
 * into, and the CoverResult built from it; it lives from begin until the
 * reply is packed (or the request fails) and is freed exactly once.
 * Nothing stored changes (a cover only reads; the contexts it uses become
 * recently used).
 */
#include <stdint.h>
#include <string.h>

#include "daemon/dispatch.h"

#define UNCONST(T, p) ((T)(uintptr_t)(p))

struct kvr__cover {
    kvr_cover_result       res;
    bool                   get, meta;
    Kvrope__CoverResult    out;
    Kvrope__KVResult       kv;
    Kvrope__AssembleResult ar;      /* kvr__pb_assemble_result's, for kv */
    Kvrope__CoverRun      *runs;
    Kvrope__CoverRun     **run_ptrs;
};

static int params_from_pb(const Kvrope__Cover *q, kvr_cover_params *p, kvr_error *e)
{
    if (!kvr__dtype_ok(q->dtype))
        return kvr_error_set(e, KVR_EBADREQUEST, "cover.dtype: unknown value %d",
                             (int)q->dtype);
    if (q->has_min_run && q->min_run == 0)
        return kvr_error_set(e, KVR_EINVAL, "cover: min_run 0 (a run must be at least one "
                             "token; leave it unset for %u)", KVR_COVER_MIN_RUN);
    *p = (kvr_cover_params){
        .model = q->model,
        .tokens = q->tokens,
        .n_tokens = q->n_tokens,
        .min_run = q->has_min_run ? q->min_run : KVR_COVER_MIN_RUN,
        .pos_base = q->has_pos_base ? q->pos_base : 0,
        .dtype = (kvr_dtype)q->dtype,
        .layers = q->n_layers ? q->layers : NULL,
        .n_layers_sel = q->n_layers,
        .meta_only = q->has_meta_only && q->meta_only,
    };
    return 0;
}

int kvr__cover_begin(kvr_store *s, const Kvrope__Cover *q, void *dst, size_t dst_cap,
                     kvr__cover **out, kvr_assemble **as, kvr_error *e)
{
    *out = NULL;
    *as = NULL;
    kvr_cover_params p;
    int rc = params_from_pb(q, &p, e);
    if (rc < 0)
        return rc;
    kvr__cover *cv = kvr_mem_calloc(1, sizeof *cv);
    if (!cv)
        return kvr_error_set(e, KVR_ENOMEM, "out of memory for a cover");
    cv->get = q->has_get && q->get;
    cv->meta = !cv->get || p.meta_only;
    if ((rc = kvr_store_cover(s, &p, &cv->res, e)) < 0) {
        kvr_mem_free(cv);
        return rc;
    }
    if (cv->get) {
        if (!p.meta_only) {     /* produced straight into the region */
            p.dst = dst;
            p.dst_cap = dst_cap;
        }
        if ((rc = kvr_store_cover_get_begin(s, &p, &cv->res, as, e)) < 0) {
            kvr__cover_free(cv);
            return rc;
        }
    }
    *out = cv;
    return 0;
}

bool kvr__cover_meta(const kvr__cover *cv)
{
    return cv->meta;
}

int kvr__cover_result(kvr__cover *cv, const kvr_assemble *as, Kvrope__CoverResult **out)
{
    const kvr_cover_result *res = &cv->res;
    size_t n = res->n_pieces;
    kvrope__cover_result__init(&cv->out);
    cv->runs = kvr_mem_malloc((n ? n : 1) * sizeof *cv->runs);
    cv->run_ptrs = kvr_mem_malloc((n ? n : 1) * sizeof *cv->run_ptrs);
    if (!cv->runs || !cv->run_ptrs)
        return KVR_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        const kvr_cover_piece *pc = &res->pieces[i];
        Kvrope__CoverRun *r = &cv->runs[i];
        kvrope__cover_run__init(r);
        r->prompt_offset = pc->prompt_off;
        r->context_id = UNCONST(char *, pc->ctx_id);
        r->context_offset = pc->ctx_off;
        r->token_count = pc->n_tokens;
        r->n_approximate = pc->n_approx;
        r->exact = pc->exact;
        if (as) {
            r->has_stream_offset = 1;
            r->stream_offset = pc->stream_off;
        }
        cv->run_ptrs[i] = r;
    }
    Kvrope__CoverResult *o = &cv->out;
    o->prompt_length = res->n_prompt;
    o->covered = res->n_covered;
    o->n_runs = n;
    o->runs = cv->run_ptrs;
    o->has_lookups = o->has_hits = o->has_rejected = o->has_truncated = 1;
    o->lookups = res->n_lookups;
    o->hits = res->n_hits;
    o->rejected = res->n_rejected;
    o->truncated = res->truncated;
    if (as) {
        if (kvr__pb_assemble_result(kvr_assemble_get_info(as), "", &cv->ar, &cv->kv) < 0)
            return KVR_ENOMEM;
        o->kv = &cv->kv;
    }
    *out = o;
    return 0;
}

void kvr__cover_free(kvr__cover *cv)
{
    if (!cv)
        return;
    kvr__pb_assemble_result_free(&cv->ar);
    kvr_mem_free(cv->runs);
    kvr_mem_free(cv->run_ptrs);
    kvr_cover_result_free(&cv->res);
    kvr_mem_free(cv);
}

/* ---- the request ------------------------------------------------------- */

/* Cover: the runs, and with get their placed K/V, which goes out as an
 * assemble's does (r->as). */
void kvr__do_cover(kvr_request *r)
{
    kvr_error e = { 0 };
    int rc = kvr__cover_begin(r->d->store, r->msg->cover, r->shm ? r->shm_p : NULL,
                              r->shm_len, &r->cover, &r->as, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    r->meta = kvr__cover_meta(r->cover);
    kvr__assemble_run(r, "placed");
}

void kvr__finish_cover(kvr_request *r)
{
    kvr_assemble *t = r->as;
    kvr__cover *cv = r->cover;
    r->as = NULL;
    r->cover = NULL;
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    resp.body_case = KVROPE__RESPONSE__BODY_COVER;
    if (r->work_rc < 0 || kvr__cover_result(cv, t, &resp.cover) < 0) {
        kvr_assemble_end(t);
        kvr__cover_free(cv);
        if (r->work_rc < 0)
            kvr__reply_err(r, r->work_rc, &r->work_err);
        else
            kvr__reply_errf(r, KVR_ENOMEM, "out of memory for the cover's runs");
        return;
    }
    size_t payload = r->meta ? 0 : kvr_assemble_payload_size(t);
    kvr__send_assembled(r, &resp, t, payload);
    kvr__cover_free(cv);
}
