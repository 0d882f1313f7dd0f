/*
 * t_ctx.c — the verbs that manage contexts without moving K/V: list, stat,
 * delete, pin, fork, shift, keep, and the position-layout verbs
 * (layout_stat, set_group_offset, set_retention) that answer with a
 * context's layout.
 *
 * Invariants: each is one store call on the loop thread; a refused call
 * changes nothing; a change replies with the context's state after it,
 * through kvr__reply_ok or REPLY_BODY (held for the record of a persistent
 * context).
 */
#include "daemon/dispatch.h"

/* Replies with the context's ContextInfo (pin, fork, shift, keep, stat). */
void kvr__reply_ctx(kvr_request *r, const char *id)
{
    kvr_ctx_info info;
    kvr_error e = { 0 };
    int rc = kvr_store_stat(r->d->store, id, &info, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    Kvrope__ContextInfo ci;
    kvr__pb_context(&info, &ci);
    REPLY_BODY(r, CONTEXT, context, &ci);
}

/* A store call's outcome: the error, else ContextInfo of ctx_for_info, or
 * an empty OK. */
void kvr__reply_simple(kvr_request *r, int rc, const kvr_error *e, const char *ctx_for_info)
{
    if (rc < 0) {
        kvr__reply_err(r, rc, e);
        return;
    }
    if (ctx_for_info) {
        kvr__reply_ctx(r, ctx_for_info);
        return;
    }
    Kvrope__Response resp = KVROPE__RESPONSE__INIT;
    kvr__reply_ok(r, &resp);
}


void kvr__do_list(kvr_request *r)
{
    const Kvrope__List *l = r->msg->list;
    kvr_ctx_info *infos = NULL;
    size_t n = 0;
    kvr_error e = { 0 };
    int rc = kvr_store_list(r->d->store, l->model && l->model[0] ? l->model : NULL, &infos,
                            &n, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    Kvrope__ContextList cl;
    if (kvr__pb_context_list(infos, n, &cl) < 0) {
        kvr_mem_free(infos);
        kvr__reply_errf(r, KVR_ENOMEM, "out of memory listing contexts");
        return;
    }
    REPLY_BODY(r, CONTEXTS, contexts, &cl);
    kvr__pb_context_list_free(&cl);
    kvr_mem_free(infos);
}

void kvr__do_stat(kvr_request *r)
{
    kvr__reply_ctx(r, r->msg->stat->context_id);
}


void kvr__do_delete(kvr_request *r)
{
    kvr_error e = { 0 };
    int rc = kvr_store_delete(r->d->store, r->msg->delete_->context_id, &e);
    kvr__reply_simple(r, rc, &e, NULL);
}

void kvr__do_pin(kvr_request *r)
{
    const Kvrope__Pin *q = r->msg->pin;
    kvr_error e = { 0 };
    int rc = kvr_store_pin(r->d->store, q->context_id, q->pin, &e);
    kvr__reply_simple(r, rc, &e, q->context_id);
}

void kvr__do_fork(kvr_request *r)
{
    const Kvrope__Fork *q = r->msg->fork;
    kvr_error e = { 0 };
    int rc = kvr_store_fork(r->d->store, q->src, q->dst, &e);
    kvr__reply_simple(r, rc, &e, q->dst);
}

/* Shift (delta given) and Keep (delta NULL): a token range of context id,
 * then its ContextInfo. */
static void range_op(kvr_request *r, const char *verb, const char *id, uint64_t start,
                     uint64_t end, const int64_t *delta)
{
    kvr_error err = { 0 };
    size_t s, t;
    int rc = kvr__range_from_pb(verb, start, end, &s, &t, &err);
    if (rc < 0) {
        kvr__reply_err(r, rc, &err);
        return;
    }
    kvr_error e = { 0 };
    rc = delta ? kvr_store_shift(r->d->store, id, s, t, *delta, &e)
               : kvr_store_keep(r->d->store, id, s, t, &e);
    kvr__reply_simple(r, rc, &e, id);
}

void kvr__do_shift(kvr_request *r)
{
    const Kvrope__Shift *q = r->msg->shift;
    range_op(r, "shift", q->context_id, q->start, q->end, &q->delta);
}

void kvr__do_keep(kvr_request *r)
{
    const Kvrope__Keep *q = r->msg->keep;
    range_op(r, "keep", q->context_id, q->start, q->end, NULL);
}


/* Replies with the context's LayoutInfo (layout_stat, set_group_offset,
 * set_retention). */
static void reply_layout(kvr_request *r, const char *id)
{
    kvr_layout_info *li = kvr_mem_malloc(sizeof *li);
    if (!li) {
        kvr__reply_errf(r, KVR_ENOMEM, "out of memory");
        return;
    }
    kvr_error e = { 0 };
    int rc = kvr_store_layout_stat(r->d->store, id, li, &e);
    if (rc < 0) {
        kvr_mem_free(li);
        kvr__reply_err(r, rc, &e);
        return;
    }
    Kvrope__GroupInfo gi[KVR_MAX_GROUPS];
    Kvrope__GroupInfo *gp[KVR_MAX_GROUPS];
    Kvrope__LayoutInfo lo;
    kvr__pb_layout(li, id, &lo, gi, gp);
    REPLY_BODY(r, LAYOUT, layout, &lo);
    kvr_mem_free(li);
}

void kvr__do_layout_stat(kvr_request *r)
{
    reply_layout(r, r->msg->layout_stat->context_id);
}

void kvr__do_set_group_offset(kvr_request *r)
{
    const Kvrope__SetGroupOffset *q = r->msg->set_group_offset;
    kvr_error e = { 0 };
    int rc = kvr_store_set_group_offset(r->d->store, q->context_id, q->group, q->offset, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    reply_layout(r, q->context_id);
}

void kvr__do_set_retention(kvr_request *r)
{
    const Kvrope__SetRetention *q = r->msg->set_retention;
    bool off = q->has_off && q->off;
    if (!off && (q->sinks > SIZE_MAX || q->window > SIZE_MAX)) {
        kvr__reply_errf(r, KVR_EINVAL, "set_retention: sinks/window out of range");
        return;
    }
    kvr_retention rt = { .sinks = (size_t)q->sinks, .window = (size_t)q->window, .off = off };
    kvr_error e = { 0 };
    int rc = kvr_store_set_retention(r->d->store, q->context_id, &rt, &e);
    if (rc < 0) {
        kvr__reply_err(r, rc, &e);
        return;
    }
    reply_layout(r, q->context_id);
}

