/*
 * convert.c — protobuf <-> store conversions and response packing (see
 * convert.h for the conventions). Nothing here touches a connection, the
 * loop or the store: dispatch.c does the calls, this file only translates.
 *
 * Invariants: a message filled here borrows from the store struct it was
 * filled from, never the other way round, so the store struct must outlive
 * the packing; every array this file allocates is one kvr_mem block that
 * the matching _free releases (the pointer array first, the messages after
 * it: protobuf-c wants repeated messages as an array of pointers).
 */
#include "daemon/convert.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/frame.h"

/* The generated structs take non-const pointers; the data is only read. */
#define UNCONST(T, p) ((T)(uintptr_t)(p))
/* Sets an optional scalar field of a generated message. */
#define OPT(o, field, value) ((o)->has_##field = 1, (o)->field = (value))

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

ProtobufCAllocator kvr__pb_allocator = { pb_alloc, pb_free, NULL };

int kvr__status_of(int code)
{
    return kvr_error_status(code);   /* rope/error.h: local codes -> E_INTERNAL */
}

/* n messages of type T and the pointers to them in one allocation: returns
 * the pointer array (each message initialised), NULL if out of memory. */
#define DEFINE_PB_VEC(T, name, init)                                         \
    static T **name(size_t n)                                                \
    {                                                                        \
        if (n > (SIZE_MAX - 1) / (sizeof(T *) + sizeof(T)))                  \
            return NULL;                                                     \
        T **p = kvr_mem_malloc(n ? n * (sizeof(T *) + sizeof(T)) : 1);       \
        if (!p)                                                              \
            return NULL;                                                     \
        T *e = (T *)(void *)(p + n);                                         \
        for (size_t i = 0; i < n; i++) {                                     \
            init(&e[i]);                                                     \
            p[i] = &e[i];                                                    \
        }                                                                    \
        return p;                                                            \
    }
DEFINE_PB_VEC(Kvrope__ModelInfo, model_vec, kvrope__model_info__init)
DEFINE_PB_VEC(Kvrope__ContextInfo, context_vec, kvrope__context_info__init)
DEFINE_PB_VEC(Kvrope__EditSpan, span_vec, kvrope__edit_span__init)
DEFINE_PB_VEC(Kvrope__Segment, segment_vec, kvrope__segment__init)

/* ---- wire -> store -------------------------------------------------------- */

bool kvr__dtype_ok(int t)
{
    return t == KVROPE__DTYPE__F32 || t == KVROPE__DTYPE__F16 || t == KVROPE__DTYPE__BF16;
}

int kvr__rope_from_pb(const Kvrope__RopeParams *p, kvr_rope_config *rc, kvr_error *err)
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
        if ((int)p->scaling < 0 || (int)p->scaling > KVR_ROPE_SCALING_LLAMA3)
            return kvr_error_set(err, KVR_ECONFIG, "rope.scaling: unknown value %d",
                                 (int)p->scaling);
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
    if (p->n_short_factor > maxf || p->n_long_factor > maxf)
        return kvr_error_set(err, KVR_ECONFIG,
                             "rope.short_factor/long_factor: more than %zu entries", maxf);
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

int kvr__model_desc_from_pb(const Kvrope__RegisterModel *m, kvr_model_desc *out,
                            kvr_error *err)
{
    kvr_rope_config *rc = &out->rope;
    kvr_error why = { 0 };
    const char *style = m->style;
    if (style && strcmp(style, "neox") && strcmp(style, "gptj"))
        return kvr_error_set(err, KVR_EBADREQUEST, "register_model.style must be \"neox\" "
                             "or \"gptj\", not \"%s\"", style);
    if (!kvr__dtype_ok(m->dtype))
        return kvr_error_set(err, KVR_EBADREQUEST, "register_model.dtype: unknown value %d",
                             (int)m->dtype);
    if (m->config_json) {
        if (kvr_rope_config_from_json(rc, m->config_json, strlen(m->config_json), style,
                                      &why) < 0)
            return kvr_error_set(err, KVR_ECONFIG, "config_json refused: %s",
                                 why.msg[0] ? why.msg : "invalid");
        /* Explicit RoPE fields override what config_json says. */
        int r = kvr__rope_from_pb(m->rope, rc, err);
        if (r < 0)
            return r;
    } else {
        if (!m->has_n_layers || !m->has_n_kv_heads || !m->has_head_dim)
            return kvr_error_set(err, KVR_EBADREQUEST,
                                 "register_model needs config_json, or n_layers, "
                                 "n_kv_heads and head_dim");
        kvr_rope_config_init(rc);
        rc->head_dim = (int32_t)m->head_dim;
        rc->rotary_dim = (int32_t)m->head_dim;
        int r = kvr__rope_from_pb(m->rope, rc, err);
        if (r < 0)
            return r;
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
        if (kvr_rope_config_validate(rc, &why) < 0)
            return kvr_error_set(err, KVR_ECONFIG, "rope configuration refused: %s", why.msg);
    }
    if (rc->num_layers <= 0 || rc->num_kv_heads <= 0 || rc->head_dim <= 0)
        return kvr_error_set(err, KVR_EBADREQUEST,
                             "model shape incomplete: n_layers %d, n_kv_heads %d, head_dim %d",
                             rc->num_layers, rc->num_kv_heads, rc->head_dim);
    out->name = m->name;
    out->n_layers = (uint32_t)rc->num_layers;
    out->n_kv_heads = (uint32_t)rc->num_kv_heads;
    out->head_dim = (uint32_t)rc->head_dim;
    out->dtype = (kvr_dtype)m->dtype;
    out->codec = m->codec && m->codec[0] ? m->codec : NULL;   /* checked by the store */
    return 0;
}

int kvr__put_params_from_pb(const Kvrope__Put *p, const char *group, uint64_t payload_len,
                            kvr_put_params *out, kvr_error *err)
{
    if (!kvr__dtype_ok(p->dtype))
        return kvr_error_set(err, KVR_EBADREQUEST, "put.dtype: unknown value %d", (int)p->dtype);
    if ((int)p->mode < 0 || (int)p->mode > KVROPE__PUT_MODE__REPLACE)
        return kvr_error_set(err, KVR_EBADREQUEST, "put.mode: unknown value %d", (int)p->mode);
    if (p->n_positions && p->n_positions != p->n_tokens)
        return kvr_error_set(err, KVR_EBADREQUEST, "put: %zu positions for %zu tokens",
                             p->n_positions, p->n_tokens);
    if (p->n_positions && p->has_pos_start)
        return kvr_error_set(err, KVR_EBADREQUEST, "put: give pos_start or positions, not both");
    *out = (kvr_put_params){
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
        .v_trans = p->has_v_trans && p->v_trans,
        .codec = p->codec && p->codec[0] ? p->codec : NULL,
        /* The store checks the declared length before it reserves (and
         * maybe evicts) anything: a put refused for its length changes
         * nothing. */
        .has_payload_bytes = true,
        .payload_bytes = (size_t)payload_len,
    };
    if (p->has_protect_first) {
        /* Part of the put (checked at begin, applied at commit after
         * retention), so a put is never stored and then refused. */
        out->has_protect_first = true;
        out->protect_first = p->protect_first > SIZE_MAX ? SIZE_MAX : (size_t)p->protect_first;
    }
    return 0;
}

/* Group names and offsets of LayoutPutOptions, as kvr_put_params wants
 * them; the names point into the request. */
#define MAX_GROUP_ARGS 64

int kvr__put_layout_from_pb(const Kvrope__LayoutPutOptions *lo, kvr_put_params *out,
                            kvr_error *err)
{
    if (!lo)
        return 0;
    if (lo->n_groups > MAX_GROUP_ARGS)
        return kvr_error_set(err, KVR_EINVAL, "put: %zu groups (limit %d)", lo->n_groups,
                             KVR_MAX_GROUPS);
    if (lo->n_group_offsets && lo->n_group_offsets != lo->n_groups)
        return kvr_error_set(err, KVR_EBADREQUEST, "put: %zu group offsets for %zu groups",
                             lo->n_group_offsets, lo->n_groups);
    out->prefix_ctx = lo->prefix_context && lo->prefix_context[0] ? lo->prefix_context : NULL;
    out->groups = UNCONST(const char *const *, lo->groups);
    out->n_groups = lo->n_groups;
    out->group_offsets = lo->n_group_offsets ? lo->group_offsets : NULL;
    return 0;
}

int kvr__get_params_from_pb(const Kvrope__Get *g, kvr_get_params *out, kvr_error *err)
{
    if (!kvr__dtype_ok(g->dtype))
        return kvr_error_set(err, KVR_EBADREQUEST, "get.dtype: unknown value %d", (int)g->dtype);
    if (g->start > SIZE_MAX || (g->has_end && g->end > SIZE_MAX))
        return kvr_error_set(err, KVR_ERANGE, "get: range out of bounds");
    *out = (kvr_get_params){
        .ctx_id = g->context_id,
        .start = (size_t)g->start,
        .end = g->has_end ? (size_t)g->end : SIZE_MAX,
        .dtype = (kvr_dtype)g->dtype,
        .positions = g->n_positions ? g->positions : NULL,
        .layers = g->n_layers ? g->layers : NULL,
        .n_layers_sel = g->n_layers,
        .meta_only = g->has_meta_only && g->meta_only,
        .raw = g->has_raw && g->raw,
    };
    return 0;
}

int kvr__assemble_params_from_pb(const Kvrope__Assemble *q, kvr_assemble_params *out,
                                 kvr_error *err)
{
    if (!kvr__dtype_ok(q->dtype))
        return kvr_error_set(err, KVR_EBADREQUEST, "assemble.dtype: unknown value %d",
                             (int)q->dtype);
    if ((int)q->layout < 0 || (int)q->layout > KVROPE__LAYOUT__EXPLICIT)
        return kvr_error_set(err, KVR_EBADREQUEST, "assemble.layout: unknown value %d",
                             (int)q->layout);
    if (q->layout == KVROPE__LAYOUT__EXPLICIT && q->n_starts != q->n_documents)
        return kvr_error_set(err, KVR_EBADREQUEST, "assemble: explicit layout with %zu starts "
                             "for %zu documents", q->n_starts, q->n_documents);
    if (q->layout != KVROPE__LAYOUT__EXPLICIT && q->n_starts)
        return kvr_error_set(err, KVR_EBADREQUEST,
                             "assemble: starts are for the explicit layout only");
    if ((q->has_temperature && !(q->temperature > 0.0 && isfinite(q->temperature))) ||
        (q->has_scale && !(q->scale > 0.0 && isfinite(q->scale))))
        return kvr_error_set(err, KVR_EINVAL,
                             "assemble: temperature and scale must be positive numbers");
    *out = (kvr_assemble_params){
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
        .meta_only = q->has_meta_only && q->meta_only,
    };
    return 0;
}

/* The fields Edit and Refresh share, in a designated initialiser. */
#define EDIT_SHAPE_FIELDS(q, payload_len)                                    \
    .ctx_id = (q)->context_id, .model = (q)->model,                          \
    .fingerprint = (q)->has_fingerprint ? (q)->fingerprint : 0,              \
    .n_layers = (q)->n_layers, .n_kv_heads = (q)->n_kv_heads,                \
    .head_dim = (q)->head_dim, .dtype = (kvr_dtype)(q)->dtype,               \
    .payload_bytes = (size_t)(payload_len),                                  \
    .expect = { .set = (q)->has_expect_length && (q)->has_expect_hash,       \
                .n_tokens = (q)->expect_length, .hash = (q)->expect_hash }

int kvr__edit_params_from_pb(const Kvrope__Edit *q, uint64_t payload_len,
                             kvr_edit_params *out, kvr_error *err)
{
    bool with_kv = q->has_with_kv && q->with_kv;
    if (with_kv && !kvr__dtype_ok(q->dtype))
        return kvr_error_set(err, KVR_EBADREQUEST, "edit.dtype: unknown value %d", (int)q->dtype);
    if (!with_kv && payload_len)
        return kvr_error_set(err, KVR_EPAYLOAD,
                             "edit without with_kv takes no payload (payload_len %llu)",
                             (unsigned long long)payload_len);
    if (payload_len > SIZE_MAX)
        return kvr_error_set(err, KVR_ETOOLARGE, "edit: payload too large");
    *out = (kvr_edit_params){
        EDIT_SHAPE_FIELDS(q, payload_len),
        .n_ops = q->n_ops,
        .with_kv = with_kv,
    };
    return 0;
}

int kvr__refresh_params_from_pb(const Kvrope__Refresh *q, uint64_t payload_len,
                                kvr_refresh_params *out, kvr_error *err)
{
    if (!kvr__dtype_ok(q->dtype))
        return kvr_error_set(err, KVR_EBADREQUEST, "refresh.dtype: unknown value %d",
                             (int)q->dtype);
    if (q->start > SIZE_MAX || (q->has_end && q->end > SIZE_MAX) || payload_len > SIZE_MAX)
        return kvr_error_set(err, KVR_ERANGE, "refresh: range out of bounds");
    *out = (kvr_refresh_params){
        EDIT_SHAPE_FIELDS(q, payload_len),
        .start = (size_t)q->start,
        .end = q->has_end ? (size_t)q->end : SIZE_MAX,
        .approx = q->has_approx && q->approx,
    };
    return 0;
}

int kvr__edit_ops_from_pb(Kvrope__EditOp *const *in, size_t n, kvr_edit_op **out,
                          kvr_error *err)
{
    *out = NULL;
    if (n == 0)
        return 0;
    kvr_edit_op *ops = kvr_mem_calloc(n, sizeof *ops);
    if (!ops)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory for %zu edit ops", n);
    for (size_t i = 0; i < n; i++) {
        if (in[i]->start > SIZE_MAX || in[i]->end > SIZE_MAX) {
            kvr_mem_free(ops);
            return kvr_error_set(err, KVR_ERANGE, "edit op %zu: range out of bounds", i);
        }
        ops[i] = (kvr_edit_op){ .start = (size_t)in[i]->start, .end = (size_t)in[i]->end,
                                .n_tokens = in[i]->n_tokens, .tokens = in[i]->tokens,
                                .approx = in[i]->has_approx && in[i]->approx };
    }
    *out = ops;
    return 0;
}

int kvr__range_from_pb(const char *verb, uint64_t start, uint64_t end, size_t *s, size_t *e,
                       kvr_error *err)
{
    if (start > SIZE_MAX || end > SIZE_MAX)
        return kvr_error_set(err, KVR_ERANGE, "%s: range out of bounds", verb);
    *s = (size_t)start;
    *e = (size_t)end;
    return 0;
}

/* ---- store -> wire -------------------------------------------------------- */

void kvr__pb_rope(const kvr_rope_config *rc, Kvrope__RopeParams *p)
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
    if (!isnan(rc->local_theta))
        OPT(p, local_theta, rc->local_theta);
    if (rc->n_layer_kinds > 0 && rc->n_layer_kinds <= KVR_ROPE_MAX_LAYERS) {
        p->has_layer_kinds = 1;
        p->layer_kinds.len = (size_t)rc->n_layer_kinds;
        p->layer_kinds.data = UNCONST(uint8_t *, rc->layer_kind);
    }
    if (rc->scaling == KVR_ROPE_SCALING_YARN && !rc->yarn_truncate)
        OPT(p, yarn_truncate, 0);
}

void kvr__pb_model(const kvr_model_info *m, Kvrope__ModelInfo *o, Kvrope__RopeParams *rp)
{
    kvrope__model_info__init(o);
    o->name = UNCONST(char *, m->name);
    o->n_layers = m->n_layers;
    o->n_kv_heads = m->n_kv_heads;
    o->head_dim = m->head_dim;
    o->dtype = (Kvrope__DType)m->dtype;
    o->fingerprint = m->fingerprint;
    kvr__pb_rope(m->rope, rp);
    /* Longrope's factor is derived (max / original positions) when the
     * config does not state it: report the one the engine uses. */
    if (m->rope && m->engine && m->rope->scaling == KVR_ROPE_SCALING_LONGROPE &&
        isnan(m->rope->factor))
        OPT(rp, factor, kvr_rope_factor(m->engine));
    o->rope = rp;
    o->has_n_contexts = 1;
    o->n_contexts = m->n_contexts;
    o->codec = UNCONST(char *, m->codec);
}

void kvr__pb_context(const kvr_ctx_info *i, Kvrope__ContextInfo *o)
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
    o->codec = UNCONST(char *, i->codec);
    OPT(o, n_evicted_tokens, i->n_evicted_tokens);
    OPT(o, busy, i->busy);
    OPT(o, n_pending, i->n_pending);
    OPT(o, n_protected, i->n_protected);
    OPT(o, n_window, i->n_window);
    OPT(o, kv_bytes, i->kv_bytes);
    OPT(o, bytes_saved, i->bytes_saved);
    OPT(o, bits_per_value, i->bits_per_value);
    OPT(o, rel_rms_k, i->rel_rms_k);
    OPT(o, rel_rms_v, i->rel_rms_v);
    if (i->v_trans)
        OPT(o, v_trans, true);
}

void kvr__pb_put_result(const kvr_put_result *res, Kvrope__PutResult *o)
{
    kvrope__put_result__init(o);
    o->n_tokens = res->n_tokens;
    o->first_index = res->first_index;
    o->first_pos = res->first_pos;
    o->last_pos = res->last_pos;
}

int kvr__pb_model_list(const kvr_model_info *infos, size_t n, Kvrope__ModelList *o)
{
    kvrope__model_list__init(o);
    if (n == 0)
        return 0;
    /* The RopeParams are one plain array: models[0]->rope is its start. */
    Kvrope__ModelInfo **mp = model_vec(n);
    Kvrope__RopeParams *rp = kvr_mem_calloc(n, sizeof *rp);
    if (!mp || !rp) {
        kvr_mem_free(mp);
        kvr_mem_free(rp);
        return KVR_ENOMEM;
    }
    for (size_t i = 0; i < n; i++)
        kvr__pb_model(&infos[i], mp[i], &rp[i]);
    o->n_models = n;
    o->models = mp;
    return 0;
}

void kvr__pb_model_list_free(Kvrope__ModelList *o)
{
    if (o->n_models)
        kvr_mem_free(o->models[0]->rope);
    kvr_mem_free(o->models);
    o->models = NULL;
    o->n_models = 0;
}

int kvr__pb_context_list(const kvr_ctx_info *infos, size_t n, Kvrope__ContextList *o)
{
    kvrope__context_list__init(o);
    if (n == 0)
        return 0;
    Kvrope__ContextInfo **cp = context_vec(n);
    if (!cp)
        return KVR_ENOMEM;
    for (size_t i = 0; i < n; i++)
        kvr__pb_context(&infos[i], cp[i]);
    o->n_contexts = n;
    o->contexts = cp;
    return 0;
}

void kvr__pb_context_list_free(Kvrope__ContextList *o)
{
    kvr_mem_free(o->contexts);
    o->contexts = NULL;
    o->n_contexts = 0;
}

int kvr__pb_edit_result(const kvr_edit_result *res, const kvr_edit_span *spans, size_t n,
                        uint64_t payload_bytes, Kvrope__EditResult *o)
{
    kvrope__edit_result__init(o);
    Kvrope__EditSpan **sp = n ? span_vec(n) : NULL;
    if (n && !sp)
        return KVR_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        sp[i]->index = spans[i].index;
        sp[i]->first_pos = spans[i].first_pos;
        sp[i]->shift = spans[i].shift;
    }
    o->context_length = res->n_tokens;
    o->n_new = res->n_new;
    o->n_removed = res->n_removed;
    o->first_change = res->first_change;
    o->n_approximate = res->n_approx;
    o->n_pending = res->n_pending;
    o->n_spans = n;
    o->spans = sp;
    OPT(o, payload_bytes, payload_bytes);
    return 0;
}

void kvr__pb_edit_result_free(Kvrope__EditResult *o)
{
    kvr_mem_free(o->spans);
    o->spans = NULL;
    o->n_spans = 0;
}

/* The fields a get's and an assemble's KVResult share. */
typedef struct kv_source {
    const kvr_model_info *model;
    size_t          start, n_tokens, n_layers;
    kvr_dtype       dtype;
    const uint32_t *layers, *tokens, *flags;
    const int64_t  *positions;
} kv_source;

static void kv_result(const kv_source *s, const char *ctx_id, Kvrope__KVResult *o)
{
    kvrope__kvresult__init(o);
    o->context_id = UNCONST(char *, ctx_id);
    o->model = UNCONST(char *, s->model->name);
    o->start = s->start;
    o->token_count = s->n_tokens;
    o->dtype = (Kvrope__DType)s->dtype;
    o->n_kv_heads = s->model->n_kv_heads;
    o->head_dim = s->model->head_dim;
    o->n_layers = s->n_layers;
    o->layers = UNCONST(uint32_t *, s->layers);
    o->n_tokens = s->n_tokens;
    o->tokens = UNCONST(uint32_t *, s->tokens);
    o->n_positions = s->positions ? s->n_tokens : 0;
    o->positions = UNCONST(int64_t *, s->positions);
    o->n_flags = s->flags ? s->n_tokens : 0;
    o->flags = UNCONST(uint32_t *, s->flags);
}

void kvr__pb_kv_of_get(const kvr_get_info *gi, const char *ctx_id, bool meta_only,
                       Kvrope__KVResult *o, Kvrope__RawLayout *rl, char buf[3][64])
{
    kv_source s = {
        .model = &gi->model, .start = gi->start, .n_tokens = gi->n_tokens,
        .n_layers = gi->n_layers, .dtype = gi->dtype, .layers = gi->layers,
        .tokens = gi->tokens, .flags = gi->flags, .positions = gi->positions,
    };
    kv_result(&s, ctx_id, o);
    o->n_groups = gi->groups ? gi->n_tokens : 0;
    o->groups = UNCONST(int32_t *, gi->groups);
    if (gi->raw && !meta_only) {
        kvr__pb_raw_layout(gi, rl, buf);
        o->raw = rl;
    }
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

void kvr__pb_raw_layout(const kvr_get_info *gi, Kvrope__RawLayout *rl, char buf[3][64])
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
    OPT(rl, k_per_channel, kc);
    OPT(rl, k_group, kg);
    OPT(rl, v_group, vg);
    rl->k_bytes = gi->k_bytes;
    rl->v_bytes = gi->v_bytes;
    size_t n = gi->n_tokens;
    size_t ku = kc && kg ? (n + kg - 1) / kg : n;
    OPT(rl, k_unit_bytes, ku ? gi->k_bytes / ku : 0);
    OPT(rl, v_unit_bytes, n ? gi->v_bytes / n : 0);
    if (r)
        OPT(rl, window, (uint32_t)strtoul(r + 3, NULL, 10));
}

int kvr__pb_assemble_result(const kvr_assemble_info *ai, const char *prefix,
                            Kvrope__AssembleResult *o, Kvrope__KVResult *kv)
{
    kvrope__assemble_result__init(o);
    size_t ns = ai->n_segments;
    Kvrope__Segment **sp = segment_vec(ns);
    if (!sp)
        return KVR_ENOMEM;
    for (size_t i = 0; i < ns; i++) {
        const kvr_segment *x = &ai->segments[i];
        Kvrope__Segment *g = sp[i];
        g->kind = (Kvrope__SegmentKind)x->kind;
        g->start = x->start;
        g->token_count = x->n_tokens;
        g->pos_first = x->pos_first;
        g->pos_last = x->pos_last;
        if (x->ctx_id[0])
            g->context_id = UNCONST(char *, x->ctx_id);
        if (x->kind == KVR_SEGMENT_DOCUMENT)
            OPT(g, doc_index, x->doc_index);
        g->temperature = x->temperature;
        g->scale = x->scale;
    }
    kv_source s = {
        .model = &ai->model, .start = 0, .n_tokens = ai->n_tokens,
        .n_layers = ai->n_layers, .dtype = ai->dtype, .layers = ai->layers,
        .tokens = ai->tokens, .flags = ai->flags, .positions = ai->positions,
    };
    kv_result(&s, prefix, kv);
    o->kv = kv;
    o->n_segments = ns;
    o->segments = sp;
    o->query_pos = ai->query_pos;
    o->temperature = ai->temperature;
    o->scale = ai->scale;
    OPT(o, temperature_folded, ai->temperature_folded);
    o->prefix_len = ai->prefix_len;
    return 0;
}

void kvr__pb_assemble_result_free(Kvrope__AssembleResult *o)
{
    kvr_mem_free(o->segments);
    o->segments = NULL;
    o->n_segments = 0;
}

void kvr__pb_layout(const kvr_layout_info *li, const char *id, Kvrope__LayoutInfo *o,
                    Kvrope__GroupInfo gi[KVR_MAX_GROUPS], Kvrope__GroupInfo *gp[KVR_MAX_GROUPS])
{
    size_t ng = li->n_groups < KVR_MAX_GROUPS ? li->n_groups : KVR_MAX_GROUPS;
    for (size_t i = 0; i < ng; i++) {
        kvrope__group_info__init(&gi[i]);
        gi[i].name = UNCONST(char *, li->groups[i].name);
        gi[i].id = li->groups[i].id;
        gi[i].offset = li->groups[i].offset;
        gi[i].cursor = li->groups[i].cursor;
        gi[i].token_count = li->groups[i].n_tokens;
        gp[i] = &gi[i];
    }
    kvrope__layout_info__init(o);
    o->context_id = UNCONST(char *, id);
    if (li->has_prefix) {
        o->prefix_context = UNCONST(char *, li->prefix_ctx);
        OPT(o, prefix_fingerprint, li->prefix_fingerprint);
        OPT(o, prefix_len, li->prefix_len);
        OPT(o, prefix_hash, li->prefix_hash);
    }
    o->n_groups = ng;
    o->groups = gp;
    OPT(o, retention, li->has_retention);
    if (li->has_retention) {
        OPT(o, sinks, li->sinks);
        OPT(o, window, li->window);
    }
    OPT(o, dropped, li->n_dropped);
    if (li->v_trans)
        OPT(o, v_trans, true);
}

/* ---- frames ----------------------------------------------------------------- */

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    for (; v >= 0x80; v >>= 7)
        n++;
    return n;
}

static uint8_t *varint_put(uint8_t *p, uint64_t v)
{
    for (; v >= 0x80; v >>= 7)
        *p++ = (uint8_t)(v | 0x80);
    *p++ = (uint8_t)v;
    return p;
}

/* The body message of r, NULL if none. */
static const ProtobufCMessage *response_body(const Kvrope__Response *r)
{
    switch (r->body_case) {
    case KVROPE__RESPONSE__BODY_PONG:         return &r->pong->base;
    case KVROPE__RESPONSE__BODY_MODEL:        return &r->model->base;
    case KVROPE__RESPONSE__BODY_MODELS:       return &r->models->base;
    case KVROPE__RESPONSE__BODY_PUT:          return &r->put->base;
    case KVROPE__RESPONSE__BODY_KV:           return &r->kv->base;
    case KVROPE__RESPONSE__BODY_MATCH:        return &r->match->base;
    case KVROPE__RESPONSE__BODY_CONTEXT:      return &r->context->base;
    case KVROPE__RESPONSE__BODY_CONTEXTS:     return &r->contexts->base;
    case KVROPE__RESPONSE__BODY_STATS:        return &r->stats->base;
    case KVROPE__RESPONSE__BODY_EDIT:         return &r->edit->base;
    case KVROPE__RESPONSE__BODY_ASSEMBLE:     return &r->assemble->base;
    case KVROPE__RESPONSE__BODY_GROUP_APPEND: return &r->group_append->base;
    case KVROPE__RESPONSE__BODY_LAYOUT:       return &r->layout->base;
    case KVROPE__RESPONSE__BODY_REGION:       return &r->region->base;
    default:                                  return NULL;
    }
}

/* A successful reply (id, status, one body; no message, no shm): the bytes
 * protobuf-c writes for it (fields in number order: id, status, then the
 * body as a length-delimited field of its number), without walking
 * Response's descriptor field by field (a third of a 64 KiB get's packing;
 * test_daemon_convert compares the two byte for byte). NULL: not such a
 * reply, or no memory (*len 0). */
static uint8_t *pack_response_fast(const Kvrope__Response *r, uint64_t payload_len, size_t *len)
{
    *len = 0;
    const ProtobufCMessage *body = response_body(r);
    if (r->message || r->shm || !body)
        return NULL;
    uint64_t st = (uint64_t)(int64_t)(int32_t)r->status;   /* an enum is an int32 varint */
    uint64_t tag = (uint64_t)r->body_case << 3 | 2u;
    size_t bl = protobuf_c_message_get_packed_size(body);
    size_t n = 1 + varint_len(r->id) + 1 + varint_len(st) + varint_len(tag) + varint_len(bl) + bl;
    if (n > UINT32_MAX)
        return NULL;
    uint8_t *buf = kvr_mem_malloc(KVR_FRAME_HEADER_SIZE + n);
    if (!buf)
        return NULL;
    uint8_t *p = buf + KVR_FRAME_HEADER_SIZE;
    *p++ = 1u << 3;                 /* id: field 1, varint */
    p = varint_put(p, r->id);
    *p++ = 2u << 3;                 /* status: field 2, varint */
    p = varint_put(p, st);
    p = varint_put(p, tag);
    p = varint_put(p, bl);
    p += protobuf_c_message_pack(body, p);
    if ((size_t)(p - buf) != KVR_FRAME_HEADER_SIZE + n) {
        kvr_mem_free(buf);
        return NULL;
    }
    kvr_frame_header_encode(buf, (uint32_t)n, payload_len);
    *len = KVR_FRAME_HEADER_SIZE + n;
    return buf;
}

uint8_t *kvr__pack_response(const Kvrope__Response *r, uint64_t payload_len, size_t *len)
{
    uint8_t *fast = pack_response_fast(r, payload_len, len);
    if (fast)
        return fast;
    size_t n = kvrope__response__get_packed_size(r);
    if (n > UINT32_MAX || n > SIZE_MAX - KVR_FRAME_HEADER_SIZE)
        return NULL;
    uint8_t *buf = kvr_mem_malloc(KVR_FRAME_HEADER_SIZE + n);
    if (!buf)
        return NULL;
    kvrope__response__pack(r, buf + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(buf, (uint32_t)n, payload_len);
    *len = KVR_FRAME_HEADER_SIZE + n;
    return buf;
}

uint8_t *kvr__pack_error(uint64_t id, int code, const char *msg, size_t *len)
{
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    char text[KVR_ERR_MAX];
    snprintf(text, sizeof text, "%s", msg ? msg : kvr_strerror(code));
    r.id = id;
    r.status = (Kvrope__Status)kvr__status_of(code);
    r.message = text;
    return kvr__pack_response(&r, 0, len);
}
