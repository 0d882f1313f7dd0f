/*
 * dispatch.c — turns one decoded kvrope.Request into store calls and one
 * kvrope.Response. Runs on the loop thread; heavy parts (put conversion,
 * get rotation) are handed to the threadpool through kvr_conn_queue_work
 * and come back in kvr_dispatch_after_work.
 *
 * Every path ends in exactly one reply followed by kvr_conn_request_done,
 * or in closing the connection. Store errors map to Status as -code.
 */
#include "daemon/daemon_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <string.h>

/* The generated structs take non-const pointers; the data is only read. */
#define UNCONST(T, p) ((T)(uintptr_t)(p))

static void *pb_alloc(void *ud, size_t n)
{
    (void)ud;
    return kvr_mem_malloc(n ? n : 1);
}

static void pb_free(void *ud, void *p)
{
    (void)ud;
    kvr_mem_free(p);
}

ProtobufCAllocator kvr_pb_allocator = { pb_alloc, pb_free, NULL };

int kvr_status_of(int code)
{
    if (code == 0)
        return KVROPE__STATUS__OK;
    if (code < 0 && -code < KVR_E_COUNT_)
        return -code;
    return KVROPE__STATUS__E_INTERNAL;
}

static bool dtype_ok(int t)
{
    return t == KVROPE__DTYPE__F32 || t == KVROPE__DTYPE__F16 || t == KVROPE__DTYPE__BF16;
}

static void reply_ok(kvr_conn *c, Kvrope__Response *r)
{
    r->id = c->req->id;
    r->status = KVROPE__STATUS__OK;
    kvr_conn_send(c, r, NULL, 0, false);
    kvr_conn_request_done(c);
}

static void reply_err(kvr_conn *c, int code, const kvr_error *e)
{
    kvr_conn_reply_error(c, code, e && e->msg[0] ? e->msg : NULL);
}

static void reply_errf(kvr_conn *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void reply_errf(kvr_conn *c, int code, const char *fmt, ...)
{
    char m[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    kvr_conn_reply_error(c, code, m);
}

/* ---- conversions ---------------------------------------------------------- */

static void rope_to_pb(const kvr_rope_config *rc, Kvrope__RopeParams *p)
{
    kvrope__rope_params__init(p);
    p->has_style = 1;
    p->style = rc->style == KVR_ROPE_GPTJ ? KVROPE__ROPE_STYLE__GPTJ : KVROPE__ROPE_STYLE__NEOX;
    p->has_theta = 1;
    p->theta = rc->theta;
    p->has_rotary_dim = 1;
    p->rotary_dim = (uint32_t)rc->rotary_dim;
    p->has_scaling = 1;
    p->scaling = (Kvrope__RopeScaling)rc->scaling;
#define OPT_D(field)                             \
    if (!isnan(rc->field)) {                     \
        p->has_##field = 1;                      \
        p->field = rc->field;                    \
    }
    if (rc->scaling != KVR_ROPE_SCALING_DEFAULT) {
        OPT_D(factor)
    }
    if (rc->original_max_position_embeddings > 0) {
        p->has_original_max_position_embeddings = 1;
        p->original_max_position_embeddings = rc->original_max_position_embeddings;
    }
    if (rc->scaling == KVR_ROPE_SCALING_YARN) {
        OPT_D(beta_fast)
        OPT_D(beta_slow)
        OPT_D(mscale)
        OPT_D(mscale_all_dim)
    }
    if (rc->scaling == KVR_ROPE_SCALING_YARN || rc->scaling == KVR_ROPE_SCALING_LONGROPE) {
        OPT_D(attention_factor)
    }
    if (rc->scaling == KVR_ROPE_SCALING_LLAMA3) {
        OPT_D(low_freq_factor)
        OPT_D(high_freq_factor)
    }
#undef OPT_D
    if (rc->n_short_factor > 0) {
        p->n_short_factor = (size_t)rc->n_short_factor;
        p->short_factor = UNCONST(double *, rc->short_factor);
    }
    if (rc->n_long_factor > 0) {
        p->n_long_factor = (size_t)rc->n_long_factor;
        p->long_factor = UNCONST(double *, rc->long_factor);
    }
    if (rc->max_position_embeddings > 0) {
        p->has_max_position_embeddings = 1;
        p->max_position_embeddings = rc->max_position_embeddings;
    }
}

static void model_to_pb(const kvr_model_info *m, Kvrope__ModelInfo *o, Kvrope__RopeParams *rp)
{
    kvrope__model_info__init(o);
    o->name = UNCONST(char *, m->name);
    o->n_layers = m->n_layers;
    o->n_kv_heads = m->n_kv_heads;
    o->head_dim = m->head_dim;
    o->dtype = (Kvrope__DType)m->dtype;
    o->fingerprint = m->fingerprint;
    rope_to_pb(m->rope, rp);
    o->rope = rp;
    o->has_n_contexts = 1;
    o->n_contexts = m->n_contexts;
}

static void ctx_to_pb(const kvr_ctx_info *i, Kvrope__ContextInfo *o)
{
    kvrope__context_info__init(o);
    o->id = UNCONST(char *, i->id);
    o->model = UNCONST(char *, i->model);
    o->n_tokens = i->n_tokens;
    o->n_blocks = i->n_blocks;
    o->n_shared_blocks = i->n_shared_blocks;
    o->n_approximate = i->n_approx;
    o->bytes = i->bytes;
    o->pinned = i->pinned;
    o->pos_min = i->pos_min;
    o->pos_max = i->pos_max;
    o->created_ms = i->created_ms;
    o->accessed_ms = i->accessed_ms;
    o->has_n_evicted_tokens = 1;
    o->n_evicted_tokens = i->n_evicted_tokens;
    o->has_busy = 1;
    o->busy = i->busy;
}

/* Replies with the context's ContextInfo (pin, fork, shift, keep, stat). */
static void reply_ctx(kvr_conn *c, const char *id)
{
    kvr_ctx_info info;
    kvr_error e = { 0 };
    int rc = kvr_store_stat(c->d->store, id, &info, &e);
    if (rc < 0) {
        reply_err(c, rc, &e);
        return;
    }
    Kvrope__ContextInfo ci;
    ctx_to_pb(&info, &ci);
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_CONTEXT;
    r.context = &ci;
    reply_ok(c, &r);
}

/* ---- verbs ------------------------------------------------------------------ */

static void do_auth(kvr_conn *c)
{
    kvr_daemon *d = c->d;
    const ProtobufCBinaryData *t = &c->req->auth->token;
    if (d->token && c->is_tcp) {
        /* Constant time in the token's content: every byte of the
         * configured token is looked at whatever the input is. */
        unsigned diff = t->len != d->token_len;
        for (size_t i = 0; i < d->token_len; i++) {
            uint8_t x = i < t->len ? t->data[i] : 0;
            diff |= (unsigned)(x ^ d->token[i]);
        }
        if (diff) {
            kvr_conn_fail(c, c->req->id, KVR_EUNAUTH, "authentication failed: wrong token");
            return;
        }
        c->authed = true;
    }
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    reply_ok(c, &r);
}

static void do_ping(kvr_conn *c)
{
    Kvrope__Pong p = KVROPE__PONG__INIT;
    char server[64];
    snprintf(server, sizeof server, "kvroped %s", KVR_DAEMON_VERSION);
    p.server = server;
    p.protocol = KVR_PROTOCOL_VERSION;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_PONG;
    r.pong = &p;
    reply_ok(c, &r);
}

static int rope_from_pb(const Kvrope__RopeParams *p, kvr_rope_config *rc, char *err, size_t errlen)
{
    if (!p)
        return 0;
    if (p->has_style)
        rc->style = p->style == KVROPE__ROPE_STYLE__GPTJ ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX;
    if (p->has_theta)
        rc->theta = p->theta;
    if (p->has_rotary_dim)
        rc->rotary_dim = (int32_t)p->rotary_dim;
    if (p->has_scaling) {
        if ((int)p->scaling < 0 || (int)p->scaling > KVR_ROPE_SCALING_LLAMA3) {
            snprintf(err, errlen, "rope.scaling: unknown value %d", (int)p->scaling);
            return -EINVAL;
        }
        rc->scaling = (kvr_rope_scaling)p->scaling;
    }
#define SET(field) if (p->has_##field) rc->field = p->field;
    SET(factor)
    SET(original_max_position_embeddings)
    SET(beta_fast)
    SET(beta_slow)
    SET(attention_factor)
    SET(mscale)
    SET(mscale_all_dim)
    SET(low_freq_factor)
    SET(high_freq_factor)
    SET(max_position_embeddings)
#undef SET
    const size_t maxf = KVR_ROPE_MAX_HEAD_DIM / 2;
    if (p->n_short_factor > maxf || p->n_long_factor > maxf) {
        snprintf(err, errlen, "rope.short_factor/long_factor: more than %zu entries", maxf);
        return -EINVAL;
    }
    if (p->n_short_factor) {
        memcpy(rc->short_factor, p->short_factor, p->n_short_factor * sizeof(double));
        rc->n_short_factor = (int32_t)p->n_short_factor;
    }
    if (p->n_long_factor) {
        memcpy(rc->long_factor, p->long_factor, p->n_long_factor * sizeof(double));
        rc->n_long_factor = (int32_t)p->n_long_factor;
    }
    return 0;
}

static void do_register_model(kvr_conn *c)
{
    const Kvrope__RegisterModel *m = c->req->register_model;
    kvr_rope_config *rc = kvr_mem_malloc(sizeof *rc);
    if (!rc) {
        reply_errf(c, KVR_ENOMEM, "out of memory");
        return;
    }
    char err[256] = "";
    const char *style = m->style;
    if (style && strcmp(style, "neox") && strcmp(style, "gptj")) {
        kvr_mem_free(rc);
        reply_errf(c, KVR_EBADREQUEST, "register_model.style must be \"neox\" or \"gptj\", not \"%s\"",
                   style);
        return;
    }
    if (!dtype_ok(m->dtype)) {
        kvr_mem_free(rc);
        reply_errf(c, KVR_EBADREQUEST, "register_model.dtype: unknown value %d", (int)m->dtype);
        return;
    }
    if (m->config_json) {
        int rc2 = kvr_rope_config_from_json(rc, m->config_json, strlen(m->config_json), style,
                                            err, sizeof err);
        if (rc2 < 0) {
            kvr_mem_free(rc);
            reply_errf(c, KVR_ECONFIG, "config_json refused: %s", err[0] ? err : "invalid");
            return;
        }
    } else {
        if (!m->has_n_layers || !m->has_n_kv_heads || !m->has_head_dim) {
            kvr_mem_free(rc);
            reply_errf(c, KVR_EBADREQUEST,
                       "register_model needs config_json, or n_layers, n_kv_heads and head_dim");
            return;
        }
        kvr_rope_config_init(rc);
        rc->head_dim = (int32_t)m->head_dim;
        rc->rotary_dim = (int32_t)m->head_dim;
        if (rope_from_pb(m->rope, rc, err, sizeof err) < 0) {
            kvr_mem_free(rc);
            reply_errf(c, KVR_ECONFIG, "%s", err);
            return;
        }
        if (style)
            rc->style = !strcmp(style, "gptj") ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX;
    }
    if (m->has_n_layers)
        rc->num_layers = (int32_t)m->n_layers;
    if (m->has_n_kv_heads)
        rc->num_kv_heads = (int32_t)m->n_kv_heads;
    if (m->has_head_dim && (int32_t)m->head_dim != rc->head_dim) {
        if (rc->rotary_dim == rc->head_dim)
            rc->rotary_dim = (int32_t)m->head_dim;
        rc->head_dim = (int32_t)m->head_dim;
    }
    if (m->has_n_layers || m->has_n_kv_heads || m->has_head_dim || !m->config_json) {
        if (rc->num_heads <= 0)
            rc->num_heads = rc->num_kv_heads;
        if (kvr_rope_config_validate(rc, err, sizeof err) < 0) {
            kvr_mem_free(rc);
            reply_errf(c, KVR_ECONFIG, "rope configuration refused: %s", err);
            return;
        }
    }
    if (rc->num_layers <= 0 || rc->num_kv_heads <= 0 || rc->head_dim <= 0) {
        int nl = rc->num_layers, nh = rc->num_kv_heads, hd = rc->head_dim;
        kvr_mem_free(rc);
        reply_errf(c, KVR_EBADREQUEST,
                   "model shape incomplete: n_layers %d, n_kv_heads %d, head_dim %d", nl, nh, hd);
        return;
    }
    kvr_model_desc desc = {
        .name = m->name,
        .n_layers = (uint32_t)rc->num_layers,
        .n_kv_heads = (uint32_t)rc->num_kv_heads,
        .head_dim = (uint32_t)rc->head_dim,
        .dtype = (kvr_dtype)m->dtype,
        .rope = *rc,
    };
    kvr_mem_free(rc);
    kvr_model_info info;
    kvr_error e = { 0 };
    int rc3 = kvr_store_model_register(c->d->store, &desc, &info, &e);
    if (rc3 < 0) {
        reply_err(c, rc3, &e);
        return;
    }
    kvr_log(KVR_LOG_INFO, "model %s registered: %u layers, %u kv heads, head_dim %u",
            info.name, info.n_layers, info.n_kv_heads, info.head_dim);
    Kvrope__ModelInfo mi;
    Kvrope__RopeParams rp;
    model_to_pb(&info, &mi, &rp);
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_MODEL;
    r.model = &mi;
    reply_ok(c, &r);
}

static void do_list_models(kvr_conn *c)
{
    size_t n = kvr_store_model_list(c->d->store, NULL, 0);
    kvr_model_info *infos = NULL;
    Kvrope__ModelInfo *mis = NULL, **ptrs = NULL;
    Kvrope__RopeParams *rps = NULL;
    if (n) {
        infos = kvr_mem_calloc(n, sizeof *infos);
        mis = kvr_mem_calloc(n, sizeof *mis);
        ptrs = kvr_mem_calloc(n, sizeof *ptrs);
        rps = kvr_mem_calloc(n, sizeof *rps);
        if (!infos || !mis || !ptrs || !rps) {
            kvr_mem_free(infos);
            kvr_mem_free(mis);
            kvr_mem_free(ptrs);
            kvr_mem_free(rps);
            reply_errf(c, KVR_ENOMEM, "out of memory listing models");
            return;
        }
        size_t got = kvr_store_model_list(c->d->store, infos, n);
        if (got < n)
            n = got;
        for (size_t i = 0; i < n; i++) {
            model_to_pb(&infos[i], &mis[i], &rps[i]);
            ptrs[i] = &mis[i];
        }
    }
    Kvrope__ModelList ml = KVROPE__MODEL_LIST__INIT;
    ml.n_models = n;
    ml.models = ptrs;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_MODELS;
    r.models = &ml;
    reply_ok(c, &r);
    kvr_mem_free(infos);
    kvr_mem_free(mis);
    kvr_mem_free(ptrs);
    kvr_mem_free(rps);
}

static void do_put(kvr_conn *c)
{
    const Kvrope__Put *p = c->req->put;
    if (!dtype_ok(p->dtype)) {
        reply_errf(c, KVR_EBADREQUEST, "put.dtype: unknown value %d", (int)p->dtype);
        return;
    }
    if ((int)p->mode < 0 || (int)p->mode > KVROPE__PUT_MODE__UPSERT) {
        reply_errf(c, KVR_EBADREQUEST, "put.mode: unknown value %d", (int)p->mode);
        return;
    }
    if (p->n_positions && p->n_positions != p->n_tokens) {
        reply_errf(c, KVR_EBADREQUEST, "put: %zu positions for %zu tokens", p->n_positions,
                   p->n_tokens);
        return;
    }
    if (p->n_positions && p->has_pos_start) {
        reply_errf(c, KVR_EBADREQUEST, "put: give pos_start or positions, not both");
        return;
    }
    kvr_put_params pp = {
        .ctx_id = p->context_id,
        .model = p->model,
        .mode = (kvr_put_mode)p->mode,
        .fingerprint = p->has_fingerprint ? p->fingerprint : 0,
        .n_layers = p->n_layers,
        .n_kv_heads = p->n_kv_heads,
        .head_dim = p->head_dim,
        .dtype = (kvr_dtype)p->dtype,
        .n_tokens = p->n_tokens,
        .tokens = p->tokens,
        .positions = p->n_positions ? p->positions : NULL,
        .has_pos_start = p->has_pos_start,
        .pos_start = p->pos_start,
        .pin = p->has_pin && p->pin,
    };
    if (!p->has_n_layers || !p->has_n_kv_heads || !p->has_head_dim) {
        kvr_model_info mi;
        if (kvr_store_model_find(c->d->store, p->model, &mi) < 0) {
            reply_errf(c, KVR_ENOMODEL, "unknown model '%s'", p->model);
            return;
        }
        if (!p->has_n_layers)
            pp.n_layers = mi.n_layers;
        if (!p->has_n_kv_heads)
            pp.n_kv_heads = mi.n_kv_heads;
        if (!p->has_head_dim)
            pp.head_dim = mi.head_dim;
    }
    kvr_error e = { 0 };
    int rc = kvr_store_put_begin(c->d->store, &pp, &c->put, &e);
    if (rc < 0) {
        c->put = NULL;
        reply_err(c, rc, &e);
        return;
    }
    size_t want = kvr_put_payload_size(c->put);
    if ((uint64_t)want != c->fh.payload_len) {
        kvr_put_abort(c->put);
        c->put = NULL;
        reply_errf(c, KVR_EPAYLOAD,
                   "put: payload_len %llu, but %zu layers x 2 x %zu tokens x %u heads x %u dims "
                   "x %zu bytes = %zu",
                   (unsigned long long)c->fh.payload_len, (size_t)pp.n_layers, pp.n_tokens,
                   pp.n_kv_heads, pp.head_dim, kvr_dtype_size(pp.dtype), want);
        return;
    }
    kvr_conn_begin_payload(c);
}

void kvr_dispatch_payload_done(kvr_conn *c)
{
    if (kvr_put_needs_work(c->put)) {
        kvr_conn_queue_work(c, 1);
        return;
    }
    c->work_kind = 1;
    c->work_rc = 0;
    kvr_dispatch_after_work(c);
    c->work_kind = 0;
}

static void finish_put(kvr_conn *c)
{
    kvr_put *t = c->put;
    c->put = NULL;
    if (c->work_rc < 0) {
        kvr_put_abort(t);
        reply_err(c, c->work_rc, &c->work_err);
        return;
    }
    kvr_put_result res;
    kvr_error e = { 0 };
    int rc = kvr_put_commit(t, &res, &e);
    if (rc < 0) {
        reply_err(c, rc, &e);
        return;
    }
    Kvrope__PutResult pr = KVROPE__PUT_RESULT__INIT;
    pr.n_tokens = res.n_tokens;
    pr.first_index = res.first_index;
    pr.first_pos = res.first_pos;
    pr.last_pos = res.last_pos;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_PUT;
    r.put = &pr;
    reply_ok(c, &r);
}

/* Starts a get (kind 2) or the get half of a match (kind 3). */
static void start_get(kvr_conn *c, const kvr_get_params *gp, int kind)
{
    kvr_error e = { 0 };
    int rc = kvr_store_get_begin(c->d->store, gp, &c->get, &e);
    if (rc < 0) {
        c->get = NULL;
        reply_err(c, rc, &e);
        return;
    }
    if (!gp->meta_only && kvr_get_needs_work(c->get)) {
        kvr_conn_queue_work(c, kind);
        return;
    }
    c->work_kind = kind;
    c->work_rc = 0;
    kvr_dispatch_after_work(c);
    c->work_kind = 0;
}

static void do_get(kvr_conn *c)
{
    const Kvrope__Get *g = c->req->get;
    if (!dtype_ok(g->dtype)) {
        reply_errf(c, KVR_EBADREQUEST, "get.dtype: unknown value %d", (int)g->dtype);
        return;
    }
    size_t start = (size_t)g->start;
    size_t end = g->has_end ? (size_t)g->end : SIZE_MAX;
    if (g->start > SIZE_MAX || (g->has_end && g->end > SIZE_MAX)) {
        reply_errf(c, KVR_ERANGE, "get: range out of bounds");
        return;
    }
    if (g->n_positions) {
        kvr_ctx_info ci;
        kvr_error e = { 0 };
        int rc = kvr_store_stat(c->d->store, g->context_id, &ci, &e);
        if (rc < 0) {
            reply_err(c, rc, &e);
            return;
        }
        size_t real_end = end == SIZE_MAX ? ci.n_tokens : end;
        if (start > real_end || real_end > ci.n_tokens) {
            reply_errf(c, KVR_ERANGE, "get: range [%zu, %zu) outside the context's %zu tokens",
                       start, real_end, ci.n_tokens);
            return;
        }
        if (g->n_positions != real_end - start) {
            reply_errf(c, KVR_EBADREQUEST, "get: %zu positions for a range of %zu tokens",
                       g->n_positions, real_end - start);
            return;
        }
    }
    kvr_get_params gp = {
        .ctx_id = g->context_id,
        .start = start,
        .end = end,
        .dtype = (kvr_dtype)g->dtype,
        .positions = g->n_positions ? g->positions : NULL,
        .layers = g->n_layers ? g->layers : NULL,
        .n_layers_sel = g->n_layers,
        .meta_only = g->has_meta_only && g->meta_only,
    };
    start_get(c, &gp, 2);
}

static void do_match(kvr_conn *c)
{
    const Kvrope__Match *m = c->req->match;
    if (!dtype_ok(m->dtype)) {
        reply_errf(c, KVR_EBADREQUEST, "match.dtype: unknown value %d", (int)m->dtype);
        return;
    }
    kvr_match_result mr;
    kvr_error e = { 0 };
    int rc = kvr_store_match(c->d->store, m->model, m->tokens, m->n_tokens,
                             m->has_include_approximate && m->include_approximate, &mr, &e);
    if (rc < 0) {
        reply_err(c, rc, &e);
        return;
    }
    c->match_len = mr.length;
    snprintf(c->match_ctx, sizeof c->match_ctx, "%s", mr.ctx_id);
    if (m->has_get && m->get && mr.length > 0) {
        kvr_get_params gp = {
            .ctx_id = c->match_ctx,
            .start = 0,
            .end = mr.length,
            .dtype = (kvr_dtype)m->dtype,
            .layers = m->n_layers ? m->layers : NULL,
            .n_layers_sel = m->n_layers,
        };
        start_get(c, &gp, 3);
        return;
    }
    Kvrope__MatchResult res = KVROPE__MATCH_RESULT__INIT;
    res.length = mr.length;
    if (mr.length > 0)
        res.context_id = c->match_ctx;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_MATCH;
    r.match = &res;
    reply_ok(c, &r);
}

/* Sends the KV reply of a finished get / match+get; the payload is written
 * straight from the get's iovecs and the get ends in the write callback. */
static void finish_get(kvr_conn *c, int kind)
{
    kvr_get *t = c->get;
    c->get = NULL;
    if (c->work_rc < 0) {
        kvr_get_end(t);
        reply_err(c, c->work_rc, &c->work_err);
        return;
    }
    const kvr_get_info *gi = kvr_get_get_info(t);
    bool meta_only = kind == 2 && c->req->get->has_meta_only && c->req->get->meta_only;
    size_t payload = meta_only ? 0 : kvr_get_payload_size(t);
    Kvrope__KVResult kv = KVROPE__KVRESULT__INIT;
    kv.context_id = kind == 2 ? c->req->get->context_id : c->match_ctx;
    kv.model = UNCONST(char *, gi->model.name);
    kv.start = gi->start;
    kv.token_count = gi->n_tokens;
    kv.dtype = (Kvrope__DType)gi->dtype;
    kv.n_kv_heads = gi->model.n_kv_heads;
    kv.head_dim = gi->model.head_dim;
    kv.n_layers = gi->n_layers;
    kv.layers = UNCONST(uint32_t *, gi->layers);
    kv.n_tokens = gi->n_tokens;
    kv.tokens = UNCONST(uint32_t *, gi->tokens);
    kv.n_positions = gi->positions ? gi->n_tokens : 0;
    kv.positions = UNCONST(int64_t *, gi->positions);
    kv.n_flags = gi->flags ? gi->n_tokens : 0;
    kv.flags = UNCONST(uint32_t *, gi->flags);
    kv.n_groups = gi->groups ? gi->n_tokens : 0;
    kv.groups = UNCONST(int32_t *, gi->groups);
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    Kvrope__MatchResult mr = KVROPE__MATCH_RESULT__INIT;
    r.id = c->req->id;
    r.status = KVROPE__STATUS__OK;
    if (kind == 2) {
        r.body_case = KVROPE__RESPONSE__BODY_KV;
        r.kv = &kv;
    } else {
        mr.length = c->match_len;
        mr.context_id = c->match_ctx;
        mr.kv = &kv;
        r.body_case = KVROPE__RESPONSE__BODY_MATCH;
        r.match = &mr;
    }
    /* The message points into t's metadata: pack before t can end. */
    kvr_conn_send(c, &r, t, payload, false);
    kvr_conn_request_done(c);
}

void kvr_dispatch_after_work(kvr_conn *c)
{
    if (c->work_kind == 1)
        finish_put(c);
    else
        finish_get(c, c->work_kind);
}

static void do_list(kvr_conn *c)
{
    const Kvrope__List *l = c->req->list;
    kvr_ctx_info *infos = NULL;
    size_t n = 0;
    kvr_error e = { 0 };
    int rc = kvr_store_list(c->d->store, l->model && l->model[0] ? l->model : NULL, &infos, &n,
                            &e);
    if (rc < 0) {
        reply_err(c, rc, &e);
        return;
    }
    Kvrope__ContextInfo *cis = n ? kvr_mem_calloc(n, sizeof *cis) : NULL;
    Kvrope__ContextInfo **ptrs = n ? kvr_mem_calloc(n, sizeof *ptrs) : NULL;
    if (n && (!cis || !ptrs)) {
        kvr_mem_free(cis);
        kvr_mem_free(ptrs);
        kvr_mem_free(infos);
        reply_errf(c, KVR_ENOMEM, "out of memory listing contexts");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        ctx_to_pb(&infos[i], &cis[i]);
        ptrs[i] = &cis[i];
    }
    Kvrope__ContextList cl = KVROPE__CONTEXT_LIST__INIT;
    cl.n_contexts = n;
    cl.contexts = ptrs;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_CONTEXTS;
    r.contexts = &cl;
    reply_ok(c, &r);
    kvr_mem_free(cis);
    kvr_mem_free(ptrs);
    kvr_mem_free(infos);
}

static void do_simple(kvr_conn *c, int rc, const kvr_error *e, const char *ctx_for_info)
{
    if (rc < 0) {
        reply_err(c, rc, e);
        return;
    }
    if (ctx_for_info) {
        reply_ctx(c, ctx_for_info);
        return;
    }
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    reply_ok(c, &r);
}

static const char *VERB_NAMES[KVR_N_VERBS] = {
    "auth", "ping", "register_model", "list_models", "put", "get", "match", "delete",
    "list", "stat", "pin", "fork", "shift", "keep", "stats",
};

static void do_stats(kvr_conn *c)
{
    kvr_daemon *d = c->d;
    kvr_store_stats s;
    kvr_store_get_stats(d->store, &s);
    struct { const char *name; double v; } fixed[] = {
        { "uptime_seconds", (double)(kvr_now_ms() - d->start_ms) / 1000.0 },
        { "mem_allocated_bytes", (double)s.mem_allocated },
        { "mem_peak_bytes", (double)s.mem_peak },
        { "mem_cap_bytes", (double)s.mem_cap },
        { "block_bytes", (double)s.block_bytes },
        { "models", (double)s.n_models },
        { "contexts", (double)s.n_contexts },
        { "blocks", (double)s.n_blocks },
        { "tokens", (double)s.n_tokens },
        { "leased_blocks", (double)s.n_leased_blocks },
        { "evicted_blocks", (double)s.n_evicted_blocks },
        { "evicted_bytes", (double)s.n_evicted_bytes },
        { "refused_nomem", (double)s.n_refused_nomem },
        { "store_puts", (double)s.n_puts },
        { "store_gets", (double)s.n_gets },
        { "store_matches", (double)s.n_matches },
        { "store_match_hits", (double)s.n_match_hits },
        { "connections", (double)d->n_conns },
        { "connections_total", (double)d->n_conn_total },
        { "connections_refused", (double)d->n_conn_refused },
        { "requests_total", (double)d->n_requests },
        { "errors_total", (double)d->n_errors },
        { "bytes_in", (double)d->bytes_in },
        { "bytes_out", (double)d->bytes_out },
    };
    enum { NF = sizeof fixed / sizeof fixed[0], N = NF + KVR_N_VERBS };
    Kvrope__Metric ms[N];
    Kvrope__Metric *ptrs[N];
    char names[KVR_N_VERBS][40];
    for (size_t i = 0; i < N; i++) {
        kvrope__metric__init(&ms[i]);
        ptrs[i] = &ms[i];
        if (i < NF) {
            ms[i].name = UNCONST(char *, fixed[i].name);
            ms[i].value = fixed[i].v;
        } else {
            size_t k = i - NF;
            snprintf(names[k], sizeof names[k], "requests_%s", VERB_NAMES[k]);
            ms[i].name = names[k];
            ms[i].value = (double)d->per_verb[k];
        }
    }
    Kvrope__StatsResult sr = KVROPE__STATS_RESULT__INIT;
    sr.n_metrics = N;
    sr.metrics = ptrs;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_STATS;
    r.stats = &sr;
    reply_ok(c, &r);
}

void kvr_dispatch(kvr_conn *c)
{
    Kvrope__Request *q = c->req;
    kvr_daemon *d = c->d;
    int bc = (int)q->body_case;
    if (bc >= 10 && bc < 10 + KVR_N_VERBS)
        d->per_verb[bc - 10]++;
    kvr_log(KVR_LOG_DEBUG, "request id %llu: %s, msg %u bytes, payload %llu bytes",
            (unsigned long long)q->id,
            bc >= 10 && bc < 10 + KVR_N_VERBS ? VERB_NAMES[bc - 10] : "(none)",
            c->fh.msg_len, (unsigned long long)c->fh.payload_len);

    if (!c->authed) {
        if (q->body_case == KVROPE__REQUEST__BODY_AUTH && !c->payload_unread) {
            do_auth(c);
            return;
        }
        kvr_conn_fail(c, q->id, KVR_EUNAUTH,
                      "authentication required: send Auth with the token first");
        return;
    }
    if (c->payload_unread && q->body_case != KVROPE__REQUEST__BODY_PUT) {
        reply_errf(c, KVR_EBADREQUEST, "this request takes no payload (payload_len %llu)",
                   (unsigned long long)c->fh.payload_len);
        return;
    }
    kvr_error e = { 0 };
    int rc;
    switch (q->body_case) {
    case KVROPE__REQUEST__BODY_AUTH: do_auth(c); break;
    case KVROPE__REQUEST__BODY_PING: do_ping(c); break;
    case KVROPE__REQUEST__BODY_REGISTER_MODEL: do_register_model(c); break;
    case KVROPE__REQUEST__BODY_LIST_MODELS: do_list_models(c); break;
    case KVROPE__REQUEST__BODY_PUT: do_put(c); break;
    case KVROPE__REQUEST__BODY_GET: do_get(c); break;
    case KVROPE__REQUEST__BODY_MATCH: do_match(c); break;
    case KVROPE__REQUEST__BODY_DELETE:
        rc = kvr_store_delete(d->store, q->delete_->context_id, &e);
        do_simple(c, rc, &e, NULL);
        break;
    case KVROPE__REQUEST__BODY_LIST: do_list(c); break;
    case KVROPE__REQUEST__BODY_STAT: reply_ctx(c, q->stat->context_id); break;
    case KVROPE__REQUEST__BODY_PIN:
        rc = kvr_store_pin(d->store, q->pin->context_id, q->pin->pin, &e);
        do_simple(c, rc, &e, q->pin->context_id);
        break;
    case KVROPE__REQUEST__BODY_FORK:
        rc = kvr_store_fork(d->store, q->fork->src, q->fork->dst, &e);
        do_simple(c, rc, &e, q->fork->dst);
        break;
    case KVROPE__REQUEST__BODY_SHIFT:
        if (q->shift->start > SIZE_MAX || q->shift->end > SIZE_MAX) {
            reply_errf(c, KVR_ERANGE, "shift: range out of bounds");
            break;
        }
        rc = kvr_store_shift(d->store, q->shift->context_id, (size_t)q->shift->start,
                             (size_t)q->shift->end, q->shift->delta, &e);
        do_simple(c, rc, &e, q->shift->context_id);
        break;
    case KVROPE__REQUEST__BODY_KEEP:
        if (q->keep->start > SIZE_MAX || q->keep->end > SIZE_MAX) {
            reply_errf(c, KVR_ERANGE, "keep: range out of bounds");
            break;
        }
        rc = kvr_store_keep(d->store, q->keep->context_id, (size_t)q->keep->start,
                            (size_t)q->keep->end, &e);
        do_simple(c, rc, &e, q->keep->context_id);
        break;
    case KVROPE__REQUEST__BODY_STATS: do_stats(c); break;
    default:
        reply_errf(c, KVR_EBADREQUEST, "request %llu has no body (or an unknown verb)",
                   (unsigned long long)q->id);
        break;
    }
}
