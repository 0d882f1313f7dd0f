/*
 * dispatch.c — turns one decoded kvrope.Request into store calls and one
 * kvrope.Response. Runs on the loop thread; heavy parts (put conversion,
 * get rotation) are handed to the threadpool through kvr_conn_queue_work
 * and come back in kvr_dispatch_after_work.
 *
 * Every path ends in exactly one reply followed by kvr_conn_request_done,
 * or in closing the connection. Store errors map to Status with kvr_error_status.
 */
#include "daemon/daemon_internal.h"
#include "daemon/remote.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
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
    return kvr_error_status(code);   /* rope/error.h: local codes -> E_INTERNAL */
}

static bool dtype_ok(int t)
{
    return t == KVROPE__DTYPE__F32 || t == KVROPE__DTYPE__F16 || t == KVROPE__DTYPE__BF16;
}

static void reply_ok(kvr_conn *c, Kvrope__Response *r)
{
    r->id = c->req->id;
    r->status = KVROPE__STATUS__OK;
    if (kvr_persist_reply(c, r))
        return;     /* persist.c: sent once the change is on disk */
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
    p->model_type = UNCONST(char *, rc->model_type);
    if (!isnan(rc->local_theta)) {
        p->has_local_theta = 1;
        p->local_theta = rc->local_theta;
    }
    if (rc->n_layer_kinds > 0 && rc->n_layer_kinds <= KVR_ROPE_MAX_LAYERS) {
        p->has_layer_kinds = 1;
        p->layer_kinds.len = (size_t)rc->n_layer_kinds;
        p->layer_kinds.data = UNCONST(uint8_t *, rc->layer_kind);
    }
    if (rc->scaling == KVR_ROPE_SCALING_YARN && !rc->yarn_truncate) {
        p->has_yarn_truncate = 1;
        p->yarn_truncate = 0;
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
    /* Longrope's factor is derived (max / original positions) when the
     * config does not state it: report the one the engine uses. */
    if (m->rope && m->engine && m->rope->scaling == KVR_ROPE_SCALING_LONGROPE &&
        isnan(m->rope->factor)) {
        rp->has_factor = 1;
        rp->factor = kvr_rope_factor(m->engine);
    }
    o->rope = rp;
    o->has_n_contexts = 1;
    o->n_contexts = m->n_contexts;
    o->codec = UNCONST(char *, m->codec);
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
    o->has_n_pending = 1;
    o->n_pending = i->n_pending;
    o->has_n_protected = 1;
    o->n_protected = i->n_protected;
    o->codec = UNCONST(char *, i->codec);
    o->has_n_window = 1;
    o->n_window = i->n_window;
    o->has_kv_bytes = 1;
    o->kv_bytes = i->kv_bytes;
    o->has_bytes_saved = 1;
    o->bytes_saved = i->bytes_saved;
    o->has_bits_per_value = 1;
    o->bits_per_value = i->bits_per_value;
    o->has_rel_rms_k = 1;
    o->rel_rms_k = i->rel_rms_k;
    o->has_rel_rms_v = 1;
    o->rel_rms_v = i->rel_rms_v;
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
        /* From here on it counts against --max-connections. */
        kvr_conn_set_authed(c);
        if (d->n_conns - d->n_unauth > d->cfg.max_connections) {
            d->n_conn_refused++;
            kvr_conn_fail(c, c->req->id, KVR_ELIMIT, "too many connections (--max-connections)");
            return;
        }
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
            return KVR_EINVAL;
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
        return KVR_EINVAL;
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
    kvr_error rerr = { 0 };
    char *err = rerr.msg;
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
                                            &rerr);
        if (rc2 < 0) {
            kvr_mem_free(rc);
            reply_errf(c, KVR_ECONFIG, "config_json refused: %s", err[0] ? err : "invalid");
            return;
        }
        /* Explicit RoPE fields override what config_json says. */
        if (m->rope && rope_from_pb(m->rope, rc, err, sizeof rerr.msg) < 0) {
            kvr_mem_free(rc);
            reply_errf(c, KVR_ECONFIG, "%s", err);
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
        if (rope_from_pb(m->rope, rc, err, sizeof rerr.msg) < 0) {
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
    if (m->has_n_layers || m->has_n_kv_heads || m->has_head_dim || !m->config_json || m->rope) {
        if (rc->num_heads <= 0)
            rc->num_heads = rc->num_kv_heads;
        if (kvr_rope_config_validate(rc, &rerr) < 0) {
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
        .codec = m->codec && m->codec[0] ? m->codec : NULL,   /* checked by the store */
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

/* Group names and offsets of LayoutPutOptions, as kvr_put_params wants
 * them; the names point into the request. */
#define MAX_GROUP_ARGS 64

/* Put.codec: a bad spec is E_INVALID (the store's message) whatever the
 * mode; on an existing context (append/upsert) it must be the context's
 * codec, since a context's codec is fixed at create. Replies on failure. */
static int put_codec_check(kvr_conn *c, const Kvrope__Put *p)
{
    char canon[KVR_CODEC_NAME_MAX];
    kvr_error e = { 0 };
    int rc = kvr_store_codec_check(c->d->store, p->model, p->codec, canon, &e);
    if (rc < 0) {
        if (rc == KVR_ENOMODEL)
            reply_errf(c, rc, "unknown model '%s'", p->model);
        else
            reply_err(c, rc, &e);
        return rc;
    }
    kvr_ctx_info ci;
    if (p->mode != KVROPE__PUT_MODE__CREATE &&
        kvr_store_stat(c->d->store, p->context_id, &ci, NULL) == 0 &&
        strcmp(ci.codec, canon) != 0) {
        reply_errf(c, KVR_EINVAL, "put: context '%s' is stored as %s, not %s (a context's "
                   "codec is chosen when it is created)", p->context_id, ci.codec, canon);
        return KVR_EINVAL;
    }
    return 0;
}

/* Starts a put (Put, or the Put inside a GroupAppend with `group` set). */
static void start_put(kvr_conn *c, const Kvrope__Put *p, const char *group,
                      const Kvrope__LayoutPutOptions *lo)
{
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
        .group = group,
        .persist = p->has_persist && p->persist,
        .codec = p->codec && p->codec[0] ? p->codec : NULL,
    };
    if (pp.codec && put_codec_check(c, p) < 0)
        return;
    if (((p->has_share && p->share) || (p->has_share_sync && p->share_sync)) &&
        !c->d->remote) {
        reply_errf(c, KVR_EUNSUPPORTED, "put.share: this kvroped has no shared tier (start it "
                   "with --remote-tier redis://HOST:PORT); nothing was stored");
        return;
    }
    if (lo) {
        if (lo->n_groups > MAX_GROUP_ARGS) {
            reply_errf(c, KVR_EINVAL, "put: %zu groups (limit %d)", lo->n_groups,
                       KVR_MAX_GROUPS);
            return;
        }
        if (lo->n_group_offsets && lo->n_group_offsets != lo->n_groups) {
            reply_errf(c, KVR_EBADREQUEST, "put: %zu group offsets for %zu groups",
                       lo->n_group_offsets, lo->n_groups);
            return;
        }
        pp.prefix_ctx = lo->prefix_context && lo->prefix_context[0] ? lo->prefix_context : NULL;
        pp.groups = UNCONST(const char *const *, lo->groups);
        pp.n_groups = lo->n_groups;
        pp.group_offsets = lo->n_group_offsets ? lo->group_offsets : NULL;
    }
    if (p->has_protect_first) {
        /* Part of the put (checked at begin, applied at commit after
         * retention), so a put is never stored and then refused. */
        pp.has_protect_first = true;
        pp.protect_first = p->protect_first > SIZE_MAX ? SIZE_MAX : (size_t)p->protect_first;
    }
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
    /* The store checks the declared length before it reserves (and maybe
     * evicts) anything: a put refused for its length changes nothing. */
    pp.has_payload_bytes = true;
    pp.payload_bytes = (size_t)c->fh.payload_len;
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

static void do_put(kvr_conn *c)
{
    const Kvrope__Put *p = c->req->put;
    start_put(c, p, NULL, p->layout);
}

static void do_group_append(kvr_conn *c)
{
    const Kvrope__GroupAppend *g = c->req->group_append;
    if (!g->group || !g->group[0]) {
        reply_errf(c, KVR_EBADREQUEST, "group_append: missing group");
        return;
    }
    if (g->put->n_positions || g->put->has_pos_start) {
        reply_errf(c, KVR_EBADREQUEST,
                   "group_append: positions come from the group's cursor; give none");
        return;
    }
    start_put(c, g->put, g->group, g->options ? g->options : g->put->layout);
}

void kvr_dispatch_payload_done(kvr_conn *c)
{
    int kind = c->edit ? KVR_WORK_EDIT : KVR_WORK_PUT;
    if (c->edit ? kvr_edit_needs_work(c->edit) : kvr_put_needs_work(c->put)) {
        kvr_conn_queue_work(c, kind);
        return;
    }
    c->work_kind = kind;
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
    bool ga = c->req->body_case == KVROPE__REQUEST__BODY_GROUP_APPEND;
    const Kvrope__Put *pq = ga ? c->req->group_append->put : c->req->put;
    bool share_sync = pq->has_share_sync && pq->share_sync;
    bool share = share_sync || (pq->has_share && pq->share) || c->d->cfg.share_all;
    Kvrope__PutResult pr = KVROPE__PUT_RESULT__INIT;
    pr.n_tokens = res.n_tokens;
    pr.first_index = res.first_index;
    pr.first_pos = res.first_pos;
    pr.last_pos = res.last_pos;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    if (ga) {
        r.body_case = KVROPE__RESPONSE__BODY_GROUP_APPEND;
        r.group_append = &pr;
    } else {
        r.body_case = KVROPE__RESPONSE__BODY_PUT;
        r.put = &pr;
    }
    if (share && c->d->remote) {
        /* Published after the local commit: the cluster can only ever
         * lack what is here, never hold what is not. A synchronous share
         * of a non-persistent put holds its reply until it is published;
         * a persistent one waits for the disk (persist.c) and publishes
         * asynchronously. */
        bool persistent = c->d->cfg.persist_all || (pq->has_persist && pq->persist);
        const char *id = pq->context_id;
        if (share_sync && !persistent) {
            r.id = c->req->id;
            r.status = KVROPE__STATUS__OK;
            size_t n = kvrope__response__get_packed_size(&r);
            uint8_t *buf = kvr_mem_malloc(KVR_FRAME_HEADER_SIZE + n);
            if (!buf) {
                reply_errf(c, KVR_ENOMEM, "stored locally, not shared: out of memory");
                return;
            }
            kvrope__response__pack(&r, buf + KVR_FRAME_HEADER_SIZE);
            kvr_frame_header_encode(buf, (uint32_t)n, 0);
            e = (kvr_error){ 0 };
            rc = kvr_remote_publish(c->d->remote, id, c, buf, KVR_FRAME_HEADER_SIZE + n, &e);
            if (rc < 0) {
                kvr_mem_free(buf);
                reply_errf(c, rc, "stored locally, not shared: %s", e.msg);
            }
            return;
        }
        e = (kvr_error){ 0 };
        if (kvr_remote_publish(c->d->remote, id, NULL, NULL, 0, &e) < 0)
            kvr_log(KVR_LOG_WARN, "'%s' stored locally, not shared: %s", id, e.msg);
    }
    reply_ok(c, &r);
}

/* ---- edits (PIE) ---------------------------------------------------------- */

/* Resolves the shape fields of an Edit/Refresh: as given, else the model's
 * (the context's model, or the one named). */
static int edit_shape(kvr_conn *c, const char *ctx_id, const char *model, bool has_l,
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
        int rc = kvr_store_stat(c->d->store, ctx_id, &ci, e);
        if (rc < 0)
            return rc;
        snprintf(name, sizeof name, "%s", ci.model);
    }
    kvr_model_info mi;
    if (kvr_store_model_find(c->d->store, name, &mi) < 0)
        return kvr_error_set(e, KVR_ENOMODEL, "unknown model '%s'", name);
    if (!has_l)
        *nl = mi.n_layers;
    if (!has_h)
        *nh = mi.n_kv_heads;
    if (!has_d)
        *hd = mi.head_dim;
    return 0;
}

/* Copies the wire ops into store ops (tokens borrowed from the request). */
static int edit_ops(kvr_conn *c, Kvrope__EditOp **in, size_t n, kvr_edit_op **out)
{
    *out = NULL;
    if (n == 0)
        return 0;
    kvr_edit_op *ops = kvr_mem_calloc(n, sizeof *ops);
    if (!ops) {
        reply_errf(c, KVR_ENOMEM, "out of memory for %zu edit ops", n);
        return KVR_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        if (in[i]->start > SIZE_MAX || in[i]->end > SIZE_MAX) {
            kvr_mem_free(ops);
            reply_errf(c, KVR_ERANGE, "edit op %zu: range out of bounds", i);
            return KVR_ERANGE;
        }
        ops[i] = (kvr_edit_op){ .start = (size_t)in[i]->start, .end = (size_t)in[i]->end,
                                .n_tokens = in[i]->n_tokens, .tokens = in[i]->tokens };
    }
    *out = ops;
    return 0;
}

static void reply_edit(kvr_conn *c, const kvr_edit_result *res, const kvr_edit_span *spans,
                       size_t n_spans, uint64_t payload_bytes)
{
    Kvrope__EditSpan *sp = n_spans ? kvr_mem_calloc(n_spans, sizeof *sp) : NULL;
    Kvrope__EditSpan **pp = n_spans ? kvr_mem_calloc(n_spans, sizeof *pp) : NULL;
    if (n_spans && (!sp || !pp)) {
        kvr_mem_free(sp);
        kvr_mem_free(pp);
        reply_errf(c, KVR_ENOMEM, "out of memory for the edit result");
        return;
    }
    for (size_t i = 0; i < n_spans; i++) {
        kvrope__edit_span__init(&sp[i]);
        sp[i].index = spans[i].index;
        sp[i].first_pos = spans[i].first_pos;
        sp[i].shift = spans[i].shift;
        pp[i] = &sp[i];
    }
    Kvrope__EditResult er = KVROPE__EDIT_RESULT__INIT;
    er.context_length = res->n_tokens;
    er.n_new = res->n_new;
    er.n_removed = res->n_removed;
    er.first_change = res->first_change;
    er.n_approximate = res->n_approx;
    er.n_pending = res->n_pending;
    er.n_spans = n_spans;
    er.spans = pp;
    er.has_payload_bytes = 1;
    er.payload_bytes = payload_bytes;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_EDIT;
    r.edit = &er;
    reply_ok(c, &r);
    kvr_mem_free(sp);
    kvr_mem_free(pp);
}

/* Edit and Refresh: begin validates (nothing changes on refusal; a refused
 * request's payload is drained), the payload goes straight into the
 * transaction's iovecs, then work (threadpool) and commit (finish_edit). */
static void after_edit_begin(kvr_conn *c, int rc, const kvr_error *e)
{
    if (rc < 0) {
        c->edit = NULL;
        reply_err(c, rc, e);
        return;
    }
    size_t want = kvr_edit_payload_size(c->edit);
    if ((uint64_t)want != c->fh.payload_len) {   /* the store checked; be sure */
        kvr_edit_abort(c->edit);
        c->edit = NULL;
        reply_errf(c, KVR_EPAYLOAD, "payload_len %llu, but the new tokens' KV is %zu bytes",
                   (unsigned long long)c->fh.payload_len, want);
        return;
    }
    kvr_conn_begin_payload(c);
}

static void do_edit(kvr_conn *c)
{
    const Kvrope__Edit *q = c->req->edit;
    bool with_kv = q->has_with_kv && q->with_kv;
    if (with_kv && !dtype_ok(q->dtype)) {
        reply_errf(c, KVR_EBADREQUEST, "edit.dtype: unknown value %d", (int)q->dtype);
        return;
    }
    if (!with_kv && c->fh.payload_len) {
        reply_errf(c, KVR_EPAYLOAD, "edit without with_kv takes no payload (payload_len %llu)",
                   (unsigned long long)c->fh.payload_len);
        return;
    }
    if (c->fh.payload_len > SIZE_MAX) {
        reply_errf(c, KVR_ETOOLARGE, "edit: payload too large");
        return;
    }
    kvr_edit_params ep = {
        .ctx_id = q->context_id,
        .model = q->model,
        .fingerprint = q->has_fingerprint ? q->fingerprint : 0,
        .n_ops = q->n_ops,
        .with_kv = with_kv,
        .n_layers = q->n_layers,
        .n_kv_heads = q->n_kv_heads,
        .head_dim = q->head_dim,
        .dtype = (kvr_dtype)q->dtype,
        .payload_bytes = (size_t)c->fh.payload_len,
    };
    kvr_error e = { 0 };
    int rc = 0;
    if (with_kv)
        rc = edit_shape(c, q->context_id, q->model, q->has_n_layers, &ep.n_layers,
                        q->has_n_kv_heads, &ep.n_kv_heads, q->has_head_dim, &ep.head_dim, &e);
    if (rc < 0) {
        reply_err(c, rc, &e);
        return;
    }
    kvr_edit_op *ops;
    if (edit_ops(c, q->ops, q->n_ops, &ops) < 0)
        return;
    ep.ops = ops;
    rc = kvr_store_edit_begin(c->d->store, &ep, &c->edit, &e);
    kvr_mem_free(ops);
    after_edit_begin(c, rc, &e);
}

static void do_refresh(kvr_conn *c)
{
    const Kvrope__Refresh *q = c->req->refresh;
    if (!dtype_ok(q->dtype)) {
        reply_errf(c, KVR_EBADREQUEST, "refresh.dtype: unknown value %d", (int)q->dtype);
        return;
    }
    if (q->start > SIZE_MAX || (q->has_end && q->end > SIZE_MAX) ||
        c->fh.payload_len > SIZE_MAX) {
        reply_errf(c, KVR_ERANGE, "refresh: range out of bounds");
        return;
    }
    kvr_refresh_params rp = {
        .ctx_id = q->context_id,
        .model = q->model,
        .fingerprint = q->has_fingerprint ? q->fingerprint : 0,
        .start = (size_t)q->start,
        .end = q->has_end ? (size_t)q->end : SIZE_MAX,
        .n_layers = q->n_layers,
        .n_kv_heads = q->n_kv_heads,
        .head_dim = q->head_dim,
        .dtype = (kvr_dtype)q->dtype,
        .payload_bytes = (size_t)c->fh.payload_len,
    };
    kvr_error e = { 0 };
    int rc = edit_shape(c, q->context_id, q->model, q->has_n_layers, &rp.n_layers,
                        q->has_n_kv_heads, &rp.n_kv_heads, q->has_head_dim, &rp.head_dim, &e);
    if (rc < 0) {
        reply_err(c, rc, &e);
        return;
    }
    rc = kvr_store_refresh_begin(c->d->store, &rp, &c->edit, &e);
    after_edit_begin(c, rc, &e);
}

static void do_edit_plan(kvr_conn *c)
{
    const Kvrope__EditPlan *q = c->req->edit_plan;
    kvr_edit_params ep = {
        .ctx_id = q->context_id,
        .model = q->model,
        .fingerprint = q->has_fingerprint ? q->fingerprint : 0,
        .n_ops = q->n_ops,
    };
    kvr_edit_op *ops;
    if (edit_ops(c, q->ops, q->n_ops, &ops) < 0)
        return;
    ep.ops = ops;
    kvr_edit_span *spans = q->n_ops ? kvr_mem_calloc(q->n_ops, sizeof *spans) : NULL;
    if (q->n_ops && !spans) {
        kvr_mem_free(ops);
        reply_errf(c, KVR_ENOMEM, "out of memory for %zu edit spans", q->n_ops);
        return;
    }
    kvr_edit_result res;
    kvr_error e = { 0 };
    int rc = kvr_store_edit_plan(c->d->store, &ep, spans, &res, &e);
    kvr_mem_free(ops);
    if (rc < 0) {
        kvr_mem_free(spans);
        reply_err(c, rc, &e);
        return;
    }
    /* What the edit with KV will have to send, in the model's dtype. */
    uint64_t bytes = 0;
    kvr_ctx_info ci;
    kvr_model_info mi;
    if (kvr_store_stat(c->d->store, q->context_id, &ci, NULL) == 0 &&
        kvr_store_model_find(c->d->store, ci.model, &mi) == 0)
        bytes = (uint64_t)mi.n_layers * 2u * res.n_new * mi.n_kv_heads * mi.head_dim *
                kvr_dtype_size(mi.dtype);
    reply_edit(c, &res, spans, q->n_ops, bytes);
    kvr_mem_free(spans);
}

static void finish_edit(kvr_conn *c)
{
    kvr_edit *t = c->edit;
    c->edit = NULL;
    if (c->work_rc < 0) {
        kvr_edit_abort(t);
        reply_err(c, c->work_rc, &c->work_err);
        return;
    }
    size_t n = c->req->body_case == KVROPE__REQUEST__BODY_EDIT ? c->req->edit->n_ops : 1;
    kvr_edit_span *spans = kvr_mem_calloc(n ? n : 1, sizeof *spans);
    if (!spans) {
        kvr_edit_abort(t);
        reply_errf(c, KVR_ENOMEM, "out of memory for %zu edit spans", n);
        return;
    }
    kvr_edit_result res;
    kvr_error e = { 0 };
    int rc = kvr_edit_commit(t, spans, &res, &e);
    if (rc < 0) {
        kvr_mem_free(spans);
        reply_err(c, rc, &e);
        return;
    }
    reply_edit(c, &res, spans, n, res.payload_bytes);
    kvr_mem_free(spans);
}

static void finish_get_as(kvr_conn *c, int kind, bool stream);

/* Starts a get (kind 2) or the get half of a match (kind 3). A large one
 * that needs work is streamed (kvr_conn_send_stream): its status is decided
 * here, by begin, before any of its payload exists. */
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
        if (kvr_get_payload_size(c->get) > KVR_STREAM_MIN_BYTES &&
            kvr_get_get_info(c->get)->n_layers > 1) {
            c->work_rc = 0;
            finish_get_as(c, kind, true);
            return;
        }
        kvr_conn_queue_work(c, kind);
        return;
    }
    c->work_kind = kind;
    c->work_rc = 0;
    kvr_dispatch_after_work(c);
    c->work_kind = 0;
}

/* A local miss that the shared tier may answer: queue its fetch (true) or
 * answer from what is local (false). */
static bool ask_remote(kvr_conn *c, kvr_rjob *j)
{
    if (!j)
        return false;
    c->rjob = j;
    kvr_conn_queue_work(c, KVR_WORK_REMOTE);
    return true;
}

static void do_get(kvr_conn *c)
{
    const Kvrope__Get *g = c->req->get;
    if (c->d->remote && !c->remote_tried &&
        kvr_store_stat(c->d->store, g->context_id, &(kvr_ctx_info){ 0 }, NULL) == KVR_ENOCTX &&
        ask_remote(c, kvr_remote_job_get(c->d->remote, g->context_id)))
        return;
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
        .raw = g->has_raw && g->raw,
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
    if (c->d->remote && !c->remote_tried && mr.length < m->n_tokens &&
        ask_remote(c, kvr_remote_job_prefix(c->d->remote, m->model, m->tokens, m->n_tokens,
                                            mr.length)))
        return;
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

/* One side of a canonical codec spec ("int4/g128/c", "q4_0", "f16") as
 * RawLayout wants it: the codec without "/c", per channel or not, group. */
static void raw_side(const char *side, size_t len, char *out, size_t cap, bool *chan,
                     uint32_t *group)
{
    *chan = len > 2 && side[len - 2] == '/' && side[len - 1] == 'c';
    if (*chan)
        len -= 2;
    snprintf(out, cap, "%.*s", (int)len, side);
    const char *g = strstr(out, "/g");
    if (g)
        *group = (uint32_t)strtoul(g + 2, NULL, 10);
    else if (out[0] == 'q')
        *group = 32;    /* ggml blocks */
    else
        *group = 1;     /* plain */
}

/* RawLayout of a raw get from its canonical codec "k=K,v=V,r=R" and the
 * byte counts; the strings live in buf (3 x 64 bytes). */
static void raw_layout(const kvr_get_info *gi, Kvrope__RawLayout *rl, char buf[3][64])
{
    kvrope__raw_layout__init(rl);
    snprintf(buf[0], 64, "%s", gi->codec);
    rl->codec = buf[0];
    rl->k_codec = buf[1];
    rl->v_codec = buf[2];
    buf[1][0] = buf[2][0] = '\0';
    const char *k = strstr(gi->codec, "k="), *v = strstr(gi->codec, ",v="),
               *r = strstr(gi->codec, ",r=");
    bool kc = false, vc = false;
    uint32_t kg = 1, vg = 1;
    if (k && v) {
        raw_side(k + 2, (size_t)(v - k - 2), buf[1], 64, &kc, &kg);
        size_t vl = r ? (size_t)(r - v - 3) : strlen(v + 3);
        raw_side(v + 3, vl, buf[2], 64, &vc, &vg);
    }
    rl->has_k_per_channel = 1;
    rl->k_per_channel = kc;
    rl->has_k_group = rl->has_v_group = 1;
    rl->k_group = kg;
    rl->v_group = vg;
    rl->k_bytes = gi->k_bytes;
    rl->v_bytes = gi->v_bytes;
    size_t n = gi->n_tokens;
    size_t ku = kc && kg ? (n + kg - 1) / kg : n;
    rl->has_k_unit_bytes = rl->has_v_unit_bytes = 1;
    rl->k_unit_bytes = ku ? gi->k_bytes / ku : 0;
    rl->v_unit_bytes = n ? gi->v_bytes / n : 0;
    if (r) {
        rl->has_window = 1;
        rl->window = (uint32_t)strtoul(r + 3, NULL, 10);
    }
}

/* Sends the KV reply of a finished get / match+get; the payload is written
 * straight from the get's iovecs and the get ends in the write callback.
 * stream: the get's work has not been done; it is done chunk by chunk as
 * the payload is written (kvr_conn_send_stream). */
static void finish_get_as(kvr_conn *c, int kind, bool stream)
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
    Kvrope__RawLayout rl;
    char rl_buf[3][64];
    if (gi->raw && !meta_only) {
        raw_layout(gi, &rl, rl_buf);
        kv.raw = &rl;
    }
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
    if (stream) {
        kvr_conn_send_stream(c, &r, t, payload);
        return;
    }
    kvr_conn_send(c, &r, t, payload, false);
    kvr_conn_request_done(c);
}

static void finish_get(kvr_conn *c, int kind)
{
    finish_get_as(c, kind, false);
}

/* ---- position layouts: assemble (APE), groups (GPE), retention ---------- */

static void do_assemble(kvr_conn *c)
{
    const Kvrope__Assemble *q = c->req->assemble;
    if (!dtype_ok(q->dtype)) {
        reply_errf(c, KVR_EBADREQUEST, "assemble.dtype: unknown value %d", (int)q->dtype);
        return;
    }
    if ((int)q->layout < 0 || (int)q->layout > KVROPE__LAYOUT__EXPLICIT) {
        reply_errf(c, KVR_EBADREQUEST, "assemble.layout: unknown value %d", (int)q->layout);
        return;
    }
    if (q->layout == KVROPE__LAYOUT__EXPLICIT && q->n_starts != q->n_documents) {
        reply_errf(c, KVR_EBADREQUEST, "assemble: explicit layout with %zu starts for %zu "
                   "documents", q->n_starts, q->n_documents);
        return;
    }
    if (q->layout != KVROPE__LAYOUT__EXPLICIT && q->n_starts) {
        reply_errf(c, KVR_EBADREQUEST, "assemble: starts are for the explicit layout only");
        return;
    }
    if ((q->has_temperature && !(q->temperature > 0.0 && isfinite(q->temperature))) ||
        (q->has_scale && !(q->scale > 0.0 && isfinite(q->scale)))) {
        reply_errf(c, KVR_EINVAL, "assemble: temperature and scale must be positive numbers");
        return;
    }
    bool meta = q->has_meta_only && q->meta_only;
    kvr_assemble_params ap = {
        .prefix = q->prefix,
        .docs = UNCONST(const char *const *, q->documents),
        .n_docs = q->n_documents,
        .layout = (kvr_layout_kind)q->layout,
        .starts = q->n_starts ? q->starts : NULL,
        .dtype = (kvr_dtype)q->dtype,
        .layers = q->n_layers ? q->layers : NULL,
        .n_layers_sel = q->n_layers,
        .temperature = q->has_temperature ? q->temperature : 0.0,
        .scale = q->has_scale ? q->scale : 0.0,
        .fold_temperature = q->has_fold_temperature && q->fold_temperature,
        .meta_only = meta,
    };
    kvr_error e = { 0 };
    int rc = kvr_store_assemble_begin(c->d->store, &ap, &c->as, &e);
    if (rc < 0) {
        c->as = NULL;
        reply_err(c, rc, &e);
        return;
    }
    if (!meta && kvr_assemble_needs_work(c->as)) {
        kvr_conn_queue_work(c, KVR_WORK_ASSEMBLE);
        return;
    }
    c->work_kind = KVR_WORK_ASSEMBLE;
    c->work_rc = 0;
    kvr_dispatch_after_work(c);
    c->work_kind = 0;
}

static void finish_assemble(kvr_conn *c)
{
    kvr_assemble *t = c->as;
    c->as = NULL;
    if (c->work_rc < 0) {
        kvr_assemble_end(t);
        reply_err(c, c->work_rc, &c->work_err);
        return;
    }
    const Kvrope__Assemble *q = c->req->assemble;
    const kvr_assemble_info *ai = kvr_assemble_get_info(t);
    bool meta = q->has_meta_only && q->meta_only;
    size_t payload = meta ? 0 : kvr_assemble_payload_size(t);
    size_t ns = ai->n_segments;
    Kvrope__Segment *sg = kvr_mem_calloc(ns ? ns : 1, sizeof *sg);
    Kvrope__Segment **sp = kvr_mem_calloc(ns ? ns : 1, sizeof *sp);
    if (!sg || !sp) {
        kvr_mem_free(sg);
        kvr_mem_free(sp);
        kvr_assemble_end(t);
        reply_errf(c, KVR_ENOMEM, "out of memory for the segment table");
        return;
    }
    for (size_t i = 0; i < ns; i++) {
        const kvr_segment *x = &ai->segments[i];
        kvrope__segment__init(&sg[i]);
        sg[i].kind = (Kvrope__SegmentKind)x->kind;
        sg[i].start = x->start;
        sg[i].token_count = x->n_tokens;
        sg[i].pos_first = x->pos_first;
        sg[i].pos_last = x->pos_last;
        if (x->ctx_id[0])
            sg[i].context_id = UNCONST(char *, x->ctx_id);
        if (x->kind == KVR_SEGMENT_DOCUMENT) {
            sg[i].has_doc_index = 1;
            sg[i].doc_index = x->doc_index;
        }
        sg[i].temperature = x->temperature;
        sg[i].scale = x->scale;
        sp[i] = &sg[i];
    }
    Kvrope__KVResult kv = KVROPE__KVRESULT__INIT;
    kv.context_id = q->prefix;
    kv.model = UNCONST(char *, ai->model.name);
    kv.start = 0;
    kv.token_count = ai->n_tokens;
    kv.dtype = (Kvrope__DType)ai->dtype;
    kv.n_kv_heads = ai->model.n_kv_heads;
    kv.head_dim = ai->model.head_dim;
    kv.n_layers = ai->n_layers;
    kv.layers = UNCONST(uint32_t *, ai->layers);
    kv.n_tokens = ai->n_tokens;
    kv.tokens = UNCONST(uint32_t *, ai->tokens);
    kv.n_positions = ai->positions ? ai->n_tokens : 0;
    kv.positions = UNCONST(int64_t *, ai->positions);
    kv.n_flags = ai->flags ? ai->n_tokens : 0;
    kv.flags = UNCONST(uint32_t *, ai->flags);
    Kvrope__AssembleResult ar = KVROPE__ASSEMBLE_RESULT__INIT;
    ar.kv = &kv;
    ar.n_segments = ns;
    ar.segments = sp;
    ar.query_pos = ai->query_pos;
    ar.temperature = ai->temperature;
    ar.scale = ai->scale;
    ar.has_temperature_folded = 1;
    ar.temperature_folded = ai->temperature_folded;
    ar.prefix_len = ai->prefix_len;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.id = c->req->id;
    r.status = KVROPE__STATUS__OK;
    r.body_case = KVROPE__RESPONSE__BODY_ASSEMBLE;
    r.assemble = &ar;
    /* Packed before t can end (the message points into its metadata). */
    kvr_conn_send_assemble(c, &r, t, payload);
    kvr_mem_free(sg);
    kvr_mem_free(sp);
    kvr_conn_request_done(c);
}

/* Replies with the context's LayoutInfo (layout_stat, set_group_offset,
 * set_retention). */
static void reply_layout(kvr_conn *c, const char *id)
{
    kvr_layout_info *li = kvr_mem_malloc(sizeof *li);
    if (!li) {
        reply_errf(c, KVR_ENOMEM, "out of memory");
        return;
    }
    kvr_error e = { 0 };
    int rc = kvr_store_layout_stat(c->d->store, id, li, &e);
    if (rc < 0) {
        kvr_mem_free(li);
        reply_err(c, rc, &e);
        return;
    }
    Kvrope__GroupInfo gi[KVR_MAX_GROUPS];
    Kvrope__GroupInfo *gp[KVR_MAX_GROUPS];
    size_t ng = li->n_groups < KVR_MAX_GROUPS ? li->n_groups : KVR_MAX_GROUPS;
    for (size_t i = 0; i < ng; i++) {
        kvrope__group_info__init(&gi[i]);
        gi[i].name = li->groups[i].name;
        gi[i].id = li->groups[i].id;
        gi[i].offset = li->groups[i].offset;
        gi[i].cursor = li->groups[i].cursor;
        gi[i].token_count = li->groups[i].n_tokens;
        gp[i] = &gi[i];
    }
    Kvrope__LayoutInfo lo = KVROPE__LAYOUT_INFO__INIT;
    lo.context_id = UNCONST(char *, id);
    if (li->has_prefix) {
        lo.prefix_context = li->prefix_ctx;
        lo.has_prefix_fingerprint = 1;
        lo.prefix_fingerprint = li->prefix_fingerprint;
        lo.has_prefix_len = 1;
        lo.prefix_len = li->prefix_len;
        lo.has_prefix_hash = 1;
        lo.prefix_hash = li->prefix_hash;
    }
    lo.n_groups = ng;
    lo.groups = gp;
    lo.has_retention = 1;
    lo.retention = li->has_retention;
    if (li->has_retention) {
        lo.has_sinks = lo.has_window = 1;
        lo.sinks = li->sinks;
        lo.window = li->window;
    }
    lo.has_dropped = 1;
    lo.dropped = li->n_dropped;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.body_case = KVROPE__RESPONSE__BODY_LAYOUT;
    r.layout = &lo;
    reply_ok(c, &r);
    kvr_mem_free(li);
}

static void do_set_group_offset(kvr_conn *c)
{
    const Kvrope__SetGroupOffset *q = c->req->set_group_offset;
    kvr_error e = { 0 };
    int rc = kvr_store_set_group_offset(c->d->store, q->context_id, q->group, q->offset, &e);
    if (rc < 0) {
        reply_err(c, rc, &e);
        return;
    }
    reply_layout(c, q->context_id);
}

static void do_set_retention(kvr_conn *c)
{
    const Kvrope__SetRetention *q = c->req->set_retention;
    bool off = q->has_off && q->off;
    if (!off && (q->sinks > SIZE_MAX || q->window > SIZE_MAX)) {
        reply_errf(c, KVR_EINVAL, "set_retention: sinks/window out of range");
        return;
    }
    kvr_retention rt = { .sinks = (size_t)q->sinks, .window = (size_t)q->window, .off = off };
    kvr_error e = { 0 };
    int rc = kvr_store_set_retention(c->d->store, q->context_id, &rt, &e);
    if (rc < 0) {
        reply_err(c, rc, &e);
        return;
    }
    reply_layout(c, q->context_id);
}

void kvr_dispatch_after_work(kvr_conn *c)
{
    switch (c->work_kind) {
    case KVR_WORK_PUT:      finish_put(c); break;
    case KVR_WORK_EDIT:     finish_edit(c); break;
    case KVR_WORK_ASSEMBLE: finish_assemble(c); break;
    case KVR_WORK_REMOTE:   kvr_dispatch_remote_done(c); break;
    default:                finish_get(c, c->work_kind); break;
    }
}

void kvr_dispatch_remote_done(kvr_conn *c)
{
    kvr_rjob *j = c->rjob;
    c->rjob = NULL;
    if (kvr_remote_job_land(j) == 1) {
        /* The manifest is here and the local put is open: now its blocks,
         * straight into that put's memory. */
        c->rjob = j;
        kvr_conn_queue_work(c, KVR_WORK_REMOTE);
        return;
    }
    kvr_remote_job_free(j);     /* a miss leaves the store as it was */
    c->remote_tried = true;
    /* Answer as if it had been local all along (or as the miss it is). */
    if (c->req->body_case == KVROPE__REQUEST__BODY_GET)
        do_get(c);
    else
        do_match(c);
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
    [30 - 10] = "edit", [31 - 10] = "refresh", [32 - 10] = "edit_plan",
    [40 - 10] = "assemble", [41 - 10] = "group_append", [42 - 10] = "set_group_offset",
    [43 - 10] = "set_retention", [44 - 10] = "layout_stat",
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
        { "quant_contexts", (double)s.n_quant_contexts },
        { "quant_bytes_saved", (double)s.quant_bytes_saved },
        { "quant_bits_per_value", s.quant_bits_per_value },
        { "connections", (double)d->n_conns },
        { "connections_total", (double)d->n_conn_total },
        { "connections_refused", (double)d->n_conn_refused },
        { "requests_total", (double)d->n_requests },
        { "errors_total", (double)d->n_errors },
        { "bytes_in", (double)d->bytes_in },
        { "bytes_out", (double)d->bytes_out },
        { "streamed_replies", (double)d->n_streamed },
        { "streams_aborted", (double)d->n_stream_aborted },
    };
    enum { NF = sizeof fixed / sizeof fixed[0], N = NF + KVR_N_VERBS, ND = 72 };
    Kvrope__Metric ms[N + ND];
    Kvrope__Metric *ptrs[N + ND];
    char names[KVR_N_VERBS][40];
    size_t nm = 0;
    for (size_t i = 0; i < N; i++) {
        if (i >= NF && !VERB_NAMES[i - NF])
            continue;   /* an unused body case */
        kvrope__metric__init(&ms[nm]);
        ptrs[nm] = &ms[nm];
        if (i < NF) {
            ms[nm].name = UNCONST(char *, fixed[i].name);
            ms[nm].value = fixed[i].v;
        } else {
            size_t k = i - NF;
            snprintf(names[k], sizeof names[k], "requests_%s", VERB_NAMES[k]);
            ms[nm].name = names[k];
            ms[nm].value = (double)d->per_verb[k];
        }
        nm++;
    }
    /* Disk tier (persist.c): per-tier bytes/blocks, hit rates, recovery. */
    const char *dn[ND];
    double dv[ND];
    size_t nd = kvr_persist_metrics(d, dn, dv, ND);
    if (d->remote)
        nd += kvr_remote_metrics(d->remote, dn + nd, dv + nd, ND - nd);
    for (size_t i = 0; i < nd; i++, nm++) {
        kvrope__metric__init(&ms[nm]);
        ptrs[nm] = &ms[nm];
        ms[nm].name = UNCONST(char *, dn[i]);
        ms[nm].value = dv[i];
    }
    Kvrope__StatsResult sr = KVROPE__STATS_RESULT__INIT;
    sr.n_metrics = nm;
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
    const char *verb = bc >= 10 && bc < 10 + KVR_N_VERBS ? VERB_NAMES[bc - 10] : NULL;
    if (verb)
        d->per_verb[bc - 10]++;
    kvr_log(KVR_LOG_DEBUG, "request id %llu: %s, msg %u bytes, payload %llu bytes",
            (unsigned long long)q->id, verb ? verb : "(none)",
            c->fh.msg_len, (unsigned long long)c->fh.payload_len);
    c->remote_tried = false;

    if (!c->authed) {
        if (q->body_case == KVROPE__REQUEST__BODY_AUTH && !c->payload_unread) {
            do_auth(c);
            return;
        }
        kvr_conn_fail(c, q->id, KVR_EUNAUTH,
                      "authentication required: send Auth with the token first");
        return;
    }
    if (c->payload_unread && q->body_case != KVROPE__REQUEST__BODY_PUT &&
        q->body_case != KVROPE__REQUEST__BODY_EDIT &&
        q->body_case != KVROPE__REQUEST__BODY_REFRESH &&
        q->body_case != KVROPE__REQUEST__BODY_GROUP_APPEND) {
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
    case KVROPE__REQUEST__BODY_EDIT: do_edit(c); break;
    case KVROPE__REQUEST__BODY_REFRESH: do_refresh(c); break;
    case KVROPE__REQUEST__BODY_EDIT_PLAN: do_edit_plan(c); break;
    case KVROPE__REQUEST__BODY_ASSEMBLE: do_assemble(c); break;
    case KVROPE__REQUEST__BODY_GROUP_APPEND: do_group_append(c); break;
    case KVROPE__REQUEST__BODY_SET_GROUP_OFFSET: do_set_group_offset(c); break;
    case KVROPE__REQUEST__BODY_SET_RETENTION: do_set_retention(c); break;
    case KVROPE__REQUEST__BODY_LAYOUT_STAT:
        reply_layout(c, q->layout_stat->context_id);
        break;
    default:
        reply_errf(c, KVR_EBADREQUEST, "request %llu has no body (or an unknown verb)",
                   (unsigned long long)q->id);
        break;
    }
}
