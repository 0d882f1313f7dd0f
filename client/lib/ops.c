/*
 * ops.c — libkvrope's verbs: each builds one Request, exchanges it
 * (client.c) and turns the Response into the public structs of kvrope.h.
 * Nothing here keeps pointers into a Response past the call: every string
 * and array handed to the caller is copied into storage the caller owns.
 */
#include "client/lib/client_int.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* protobuf-c fields are `char *` even for data it only reads. */
static char *unconst(const char *s) { return (char *)(uintptr_t)s; }

/* The shapes every verb repeats, in one place each.
 * SET_IF: an optional proto2 field, sent when v is non-zero (kvrope.h's
 * "0 = unset/default"); SET_FLAG: a proto2 bool sent only when true;
 * SET_SHAPE: a payload's shape (0 = the model's) and dtype (put, edit,
 * refresh); REQUEST: declares `req`, a Request whose one body is `field`. */
#define SET_IF(msg, field, v)                                                   \
    do {                                                                        \
        if (v) {                                                                \
            (msg).has_##field = 1;                                              \
            (msg).field = (v);                                                  \
        }                                                                       \
    } while (0)
#define SET_FLAG(msg, field, b)                                                 \
    do {                                                                        \
        if (b) {                                                                \
            (msg).has_##field = 1;                                              \
            (msg).field = 1;                                                    \
        }                                                                       \
    } while (0)
#define SET_SHAPE(msg, a)                                                       \
    do {                                                                        \
        SET_IF(msg, n_layers, (a)->n_layers);                                   \
        SET_IF(msg, n_kv_heads, (a)->n_kv_heads);                               \
        SET_IF(msg, head_dim, (a)->head_dim);                                   \
        (msg).has_dtype = 1;                                                    \
        (msg).dtype = (Kvrope__DType)(a)->dtype;                                \
    } while (0)

static void copy_str(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

static int bad_body(kvr_client *c, Kvrope__Response *resp, const char *what)
{
    kvrope__response__free_unpacked(resp, NULL);
    return kvr__fail(c, KVR_EPROTO, "%s: unexpected response body", what);
}

static int check_id(kvr_client *c, const char *what, const char *id)
{
    if (!id || !*id)
        return kvr__fail(c, KVR_EINVAL, "%s: missing id", what);
    if (strlen(id) > KVR_ID_MAX)
        return kvr__fail(c, KVR_EINVAL, "%s: id longer than %d bytes", what, KVR_ID_MAX);
    return 0;
}

/* The part of a call before its message: its result (out_len bytes at out,
 * if any) zeroed, the last error cleared, the id checked. */
static int call_begin(kvr_client *c, void *out, size_t out_len, const char *what, const char *id)
{
    if (out)
        memset(out, 0, out_len);
    c->err[0] = 0;
    return check_id(c, what, id);
}

/* Sends req (no payload) and reads the response: 0 with *out (the caller's,
 * kvrope__response__free_unpacked) of body `body`, else the error. */
static int call_expect(kvr_client *c, Kvrope__Request *req, Kvrope__Response__BodyCase body,
                       const char *what, Kvrope__Response **out)
{
    int r = kvr__call(c, req, NULL, 0, 0, out, NULL);
    if (r < 0)
        return r;
    if ((*out)->body_case != body)
        return bad_body(c, *out, what);
    return 0;
}

/* A response of the wrong body whose payload (pl bytes) is not taken: the
 * payload drained, the response freed, the error KVR_EPROTO (or the drain's). */
static int bad_kv_body(kvr_client *c, Kvrope__Response *resp, uint64_t pl, const char *what)
{
    int r = kvr__drain(c, pl);
    if (r < 0) {
        kvrope__response__free_unpacked(resp, NULL);
        return r;
    }
    return bad_body(c, resp, what);
}

/* Sends req, whose answer may carry a K/V payload: placed straight at dst
 * when dst is given and no shared-memory slice is set for it. 0 with *out
 * (the caller's) of body `body` and *pl, the payload bytes the caller takes
 * (take_kv) or drains; else the error. */
static int call_kv(kvr_client *c, Kvrope__Request *req, void *dst, size_t dst_cap,
                   Kvrope__Response__BodyCase body, const char *what, Kvrope__Response **out,
                   uint64_t *pl)
{
    if (dst && !c->shm_next)   /* the payload may land there at once */
        kvr__place_next(c, dst, dst_cap);
    int r = kvr__call(c, req, NULL, 0, 0, out, pl);
    if (r < 0)
        return r;
    return (*out)->body_case == body ? 0 : bad_kv_body(c, *out, *pl, what);
}

/* A verb that answers with a list (models, contexts, metrics): the body
 * expected, the item count, the size of one public struct and how to fill it. */
typedef struct list_kind {
    Kvrope__Response__BodyCase body;
    const char                *what;
    size_t                     elem;
    size_t (*count)(const Kvrope__Response *resp);
    void   (*fill)(void *dst, const Kvrope__Response *resp, size_t i);
} list_kind;

/* Sends req and copies the list into one calloc'ed array (the caller's:
 * kvr_client_free) of *n entries, stored through out, the caller's T ** for
 * lk's element type T (a pointer's bytes, copied: no void ** punning); on
 * failure that pointer is NULL and *n 0. */
static int list_call(kvr_client *c, Kvrope__Request *req, const list_kind *lk, void *out,
                     size_t *n)
{
    void *a = NULL;
    memcpy(out, &a, sizeof a);
    *n = 0;
    Kvrope__Response *resp;
    int r = call_expect(c, req, lk->body, lk->what, &resp);
    if (r < 0)
        return r;
    size_t k = lk->count(resp);
    uint8_t *arr = calloc(k ? k : 1, lk->elem);
    if (arr)
        for (size_t i = 0; i < k; i++)
            lk->fill(arr + i * lk->elem, resp, i);
    kvrope__response__free_unpacked(resp, NULL);
    if (!arr)
        return kvr__fail(c, KVR_ENOMEM, "out of memory");
    a = arr;
    memcpy(out, &a, sizeof a);
    *n = k;
    return 0;
}

/* The payload of a put/edit/refresh as one iovec list: the caller's buffer
 * (in w->one) or its iovecs, not both; w->len is the total. */
typedef struct wire_payload {
    struct iovec        one;
    const struct iovec *iov;
    size_t              iovcnt;
    uint64_t            len;
} wire_payload;

static int payload_iov(kvr_client *c, const char *what, const void *payload, size_t plen,
                       const struct iovec *in, size_t incnt, wire_payload *w)
{
    w->iov = in;
    w->iovcnt = incnt;
    w->len = 0;
    if (payload && in)
        return kvr__fail(c, KVR_EINVAL, "%s: give either payload or iov, not both", what);
    if (payload) {
        w->one.iov_base = (void *)(uintptr_t)payload;
        w->one.iov_len = plen;
        w->iov = &w->one;
        w->iovcnt = 1;
    }
    for (size_t i = 0; i < w->iovcnt; i++)
        w->len += w->iov[i].iov_len;
    return 0;
}

static int simple_call(kvr_client *c, Kvrope__Request *req)
{
    Kvrope__Response *resp;
    int r = kvr__call(c, req, NULL, 0, 0, &resp, NULL);
    if (r < 0)
        return r;
    kvrope__response__free_unpacked(resp, NULL);
    return 0;
}

/* A verb about the one object id names, whose answer is only a status: the
 * id checked (as `what`) before req, already built, is sent. */
static int id_call(kvr_client *c, const char *what, const char *id, Kvrope__Request *req)
{
    int r = check_id(c, what, id);
    return r < 0 ? r : simple_call(c, req);
}

/* ---- models ------------------------------------------------------------- */

static void rope_from_wire(kvr_rope_config *cfg, const Kvrope__RopeParams *p)
{
    kvr_rope_config_init(cfg);
    if (!p)
        return;
#define GET_IF(field) if (p->has_##field) cfg->field = p->field
    cfg->style = p->style == KVROPE__ROPE_STYLE__GPTJ ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX;
    GET_IF(theta);
    if (p->has_rotary_dim)
        cfg->rotary_dim = (int32_t)p->rotary_dim;
    cfg->scaling = (kvr_rope_scaling)p->scaling;
    GET_IF(factor);
    GET_IF(original_max_position_embeddings);
    GET_IF(beta_fast);
    GET_IF(beta_slow);
    GET_IF(attention_factor);
    GET_IF(mscale);
    GET_IF(mscale_all_dim);
    GET_IF(low_freq_factor);
    GET_IF(high_freq_factor);
    GET_IF(max_position_embeddings);
#undef GET_IF
    size_t maxf = KVR_ROPE_MAX_HEAD_DIM / 2;
    cfg->n_short_factor = (int32_t)(p->n_short_factor < maxf ? p->n_short_factor : maxf);
    for (int32_t i = 0; i < cfg->n_short_factor; i++)
        cfg->short_factor[i] = p->short_factor[i];
    cfg->n_long_factor = (int32_t)(p->n_long_factor < maxf ? p->n_long_factor : maxf);
    for (int32_t i = 0; i < cfg->n_long_factor; i++)
        cfg->long_factor[i] = p->long_factor[i];
    if (p->model_type)
        snprintf(cfg->model_type, sizeof cfg->model_type, "%s", p->model_type);
    if (p->has_local_theta)
        cfg->local_theta = p->local_theta;
    if (p->has_layer_kinds && p->layer_kinds.len <= KVR_ROPE_MAX_LAYERS) {
        cfg->n_layer_kinds = (int32_t)p->layer_kinds.len;
        memcpy(cfg->layer_kind, p->layer_kinds.data, p->layer_kinds.len);
    }
    if (p->has_yarn_truncate)
        cfg->yarn_truncate = p->yarn_truncate ? 1 : 0;
}

/* Fills p from cfg; the factor arrays are borrowed from cfg. */
static void rope_to_wire(Kvrope__RopeParams *p, const kvr_rope_config *cfg)
{
    p->has_style = 1;
    p->style = cfg->style == KVR_ROPE_GPTJ ? KVROPE__ROPE_STYLE__GPTJ : KVROPE__ROPE_STYLE__NEOX;
    p->has_theta = 1;
    p->theta = cfg->theta;
    if (cfg->rotary_dim > 0) {
        p->has_rotary_dim = 1;
        p->rotary_dim = (uint32_t)cfg->rotary_dim;
    }
    p->has_scaling = 1;
    p->scaling = (Kvrope__RopeScaling)cfg->scaling;
    if (cfg->scaling != KVR_ROPE_SCALING_DEFAULT && !isnan(cfg->factor)) {
        p->has_factor = 1;
        p->factor = cfg->factor;
    }
#define OPT_D(field)                                 \
    if (!isnan(cfg->field)) {                        \
        p->has_##field = 1;                          \
        p->field = cfg->field;                       \
    }
    if (cfg->scaling == KVR_ROPE_SCALING_YARN) {
        OPT_D(beta_fast);
        OPT_D(beta_slow);
        OPT_D(mscale);
        OPT_D(mscale_all_dim);
    }
    if (cfg->scaling == KVR_ROPE_SCALING_YARN || cfg->scaling == KVR_ROPE_SCALING_LONGROPE) {
        OPT_D(attention_factor);
    }
    if (cfg->scaling == KVR_ROPE_SCALING_LLAMA3) {
        OPT_D(low_freq_factor);
        OPT_D(high_freq_factor);
    }
#undef OPT_D
    if (cfg->original_max_position_embeddings > 0) {
        p->has_original_max_position_embeddings = 1;
        p->original_max_position_embeddings = cfg->original_max_position_embeddings;
    }
    if (cfg->max_position_embeddings > 0) {
        p->has_max_position_embeddings = 1;
        p->max_position_embeddings = cfg->max_position_embeddings;
    }
    if (cfg->n_short_factor > 0) {
        p->n_short_factor = (size_t)cfg->n_short_factor;
        p->short_factor = (double *)(uintptr_t)cfg->short_factor;
    }
    if (cfg->n_long_factor > 0) {
        p->n_long_factor = (size_t)cfg->n_long_factor;
        p->long_factor = (double *)(uintptr_t)cfg->long_factor;
    }
}

static void model_from_wire(kvr_model *m, const Kvrope__ModelInfo *mi)
{
    memset(m, 0, sizeof *m);
    copy_str(m->name, sizeof m->name, mi->name);
    m->n_layers = mi->n_layers;
    m->n_kv_heads = mi->n_kv_heads;
    m->head_dim = mi->head_dim;
    m->dtype = (kvr_dtype)mi->dtype;
    m->fingerprint = mi->fingerprint;
    m->n_contexts = mi->has_n_contexts ? mi->n_contexts : 0;
    rope_from_wire(&m->rope, mi->rope);
    m->rope.num_layers = (int32_t)mi->n_layers;
    m->rope.num_kv_heads = (int32_t)mi->n_kv_heads;
    m->rope.head_dim = (int32_t)mi->head_dim;
    if (m->rope.rotary_dim <= 0)
        m->rope.rotary_dim = (int32_t)mi->head_dim;
    copy_str(m->codec, sizeof m->codec, mi->codec ? mi->codec : kvr_dtype_name(m->dtype));
}

int kvr_client_model_register(kvr_client *c, const kvr_model_params *p, kvr_model *out)
{
    int r = check_id(c, "register model", p ? p->name : NULL);
    if (r < 0)
        return r;
    Kvrope__RegisterModel rm = KVROPE__REGISTER_MODEL__INIT;
    Kvrope__RopeParams rp = KVROPE__ROPE_PARAMS__INIT;
    char *json = NULL;
    rm.name = unconst(p->name);
    if (p->config_json) {
        size_t len = p->config_json_len ? p->config_json_len : strlen(p->config_json);
        if (memchr(p->config_json, 0, len))
            return kvr__fail(c, KVR_EINVAL, "register model: config_json holds a NUL byte");
        json = malloc(len + 1);   /* protobuf strings are NUL-terminated */
        if (!json)
            return kvr__fail(c, KVR_ENOMEM, "out of memory");
        memcpy(json, p->config_json, len);
        json[len] = 0;
        rm.config_json = json;
    } else if (p->rope) {
        rope_to_wire(&rp, p->rope);
        rm.rope = &rp;
    }
    if (p->style)
        rm.style = unconst(p->style);
    SET_IF(rm, n_layers, p->n_layers);
    SET_IF(rm, n_kv_heads, p->n_kv_heads);
    SET_IF(rm, head_dim, p->head_dim);
    rm.has_dtype = 1;
    rm.dtype = (Kvrope__DType)p->dtype;
    if (p->codec && p->codec[0])
        rm.codec = unconst(p->codec);
    KVR_REQUEST(req, REGISTER_MODEL, register_model, &rm);
    Kvrope__Response *resp;
    r = kvr__call(c, &req, NULL, 0, 0, &resp, NULL);
    free(json);
    if (r < 0)
        return r;
    if (resp->body_case != KVROPE__RESPONSE__BODY_MODEL)
        return bad_body(c, resp, "register model");
    if (out)
        model_from_wire(out, resp->model);
    kvrope__response__free_unpacked(resp, NULL);
    return 0;
}

int kvr_client_model_register_json(kvr_client *c, const char *name, const char *json,
                                   const char *style, kvr_dtype dtype, kvr_model *out)
{
    kvr_model_params p = { .name = name, .config_json = json, .style = style, .dtype = dtype };
    if (!json)
        return kvr__fail(c, KVR_EINVAL, "register model: no config text");
    return kvr_client_model_register(c, &p, out);
}

int kvr_client_model_register_file(kvr_client *c, const char *name, const char *config_path,
                                   const char *style, kvr_dtype dtype, kvr_model *out)
{
    c->err[0] = 0;
    FILE *f = fopen(config_path, "rb");
    if (!f)
        return kvr__fail(c, KVR_ESYS, "%s: %s", config_path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t k = fread(buf + len, 1, cap - len, f);
        len += k;
        if (len < cap)
            break;
        if (cap >= ((size_t)64 << 20)) {
            free(buf);
            fclose(f);
            return kvr__fail(c, KVR_ETOOLARGE, "%s: larger than 64 MiB", config_path);
        }
        char *nb = realloc(buf, cap * 2);
        if (!nb) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = nb;
        cap *= 2;
    }
    int ioerr = ferror(f);
    fclose(f);
    if (!buf)
        return kvr__fail(c, KVR_ENOMEM, "out of memory");
    if (ioerr) {
        free(buf);
        return kvr__fail(c, KVR_ESYS, "%s: read error", config_path);
    }
    kvr_model_params p = { .name = name, .config_json = buf, .config_json_len = len,
                           .style = style, .dtype = dtype };
    int r = len ? kvr_client_model_register(c, &p, out)
                : kvr__fail(c, KVR_EINVAL, "%s: empty file", config_path);
    free(buf);
    return r;
}

static size_t count_models(const Kvrope__Response *resp) { return resp->models->n_models; }
static void fill_model(void *dst, const Kvrope__Response *resp, size_t i)
{
    model_from_wire(dst, resp->models->models[i]);
}
static const list_kind MODEL_LIST = { KVROPE__RESPONSE__BODY_MODELS, "list models",
                                      sizeof(kvr_model), count_models, fill_model };

int kvr_client_model_list(kvr_client *c, kvr_model **out, size_t *n)
{
    Kvrope__ListModels lm = KVROPE__LIST_MODELS__INIT;
    KVR_REQUEST(req, LIST_MODELS, list_models, &lm);
    return list_call(c, &req, &MODEL_LIST, out, n);
}

int kvr_client_model_get(kvr_client *c, const char *name, kvr_model *out)
{
    kvr_model *arr;
    size_t n;
    int r = kvr_client_model_list(c, &arr, &n);
    if (r < 0)
        return r;
    for (size_t i = 0; i < n; i++)
        if (strcmp(arr[i].name, name) == 0) {
            *out = arr[i];
            free(arr);
            return 0;
        }
    free(arr);
    return kvr__fail(c, KVR_ENOMODEL, "unknown model '%s'", name);
}

/* ---- put ---------------------------------------------------------------- */

static int put_common(kvr_client *c, const kvr_put_args *a, const char *group,
                      kvr_put_res *out);

int kvr_client_put(kvr_client *c, const kvr_put_args *a, kvr_put_res *out)
{
    return put_common(c, a, NULL, out);
}

int kvr_client_group_append(kvr_client *c, const kvr_put_args *a, const char *group,
                            kvr_put_res *out)
{
    int r = check_id(c, "group append: group", group);
    if (r < 0)
        return r;
    if (a->positions || a->has_pos_start)
        return kvr__fail(c, KVR_EINVAL, "group append: positions come from the group");
    return put_common(c, a, group, out);
}

/* A put, or (group set) a group append wrapping the same Put. */
static int put_common(kvr_client *c, const kvr_put_args *a, const char *group,
                      kvr_put_res *out)
{
    c->err[0] = 0;
    int r = check_id(c, "put", a->ctx_id);
    if (r < 0 || (r = check_id(c, "put model", a->model)) < 0)
        return r;
    if (a->n_tokens && !a->tokens)
        return kvr__fail(c, KVR_EINVAL, "put: tokens missing");
    if (a->mode != KVR_PUT_CREATE && a->mode != KVR_PUT_APPEND && a->mode != KVR_PUT_UPSERT &&
        a->mode != KVR_PUT_REPLACE)
        return kvr__fail(c, KVR_EINVAL, "put: unknown mode %d", (int)a->mode);
    wire_payload w;
    if ((r = payload_iov(c, "put", a->payload, a->payload_len, a->iov, a->iovcnt, &w)) < 0)
        return r;
    uint64_t plen = w.len;
    if (c->shm_next)   /* the payload is in a region (kvr_client_put_shm) */
        plen = c->shm_at.length;
    if (a->n_layers && a->n_kv_heads && a->head_dim) {
        size_t want = kvr_payload_size(a->n_layers, a->n_tokens, a->n_kv_heads, a->head_dim,
                                       a->dtype);
        if (want != plen)
            return kvr__fail(c, KVR_EPAYLOAD, "put: payload is %llu bytes, the shape needs "
                             "%zu", (unsigned long long)plen, want);
    }

    Kvrope__Put put = KVROPE__PUT__INIT;
    put.context_id = unconst(a->ctx_id);
    put.model = unconst(a->model);
    put.has_mode = 1;
    put.mode = (Kvrope__PutMode)a->mode;   /* same values (proto/frame.c) */
    SET_IF(put, fingerprint, a->fingerprint);
    SET_SHAPE(put, a);
    put.n_tokens = a->n_tokens;
    put.tokens = (uint32_t *)(uintptr_t)a->tokens;
    if (a->positions) {
        put.n_positions = a->n_tokens;
        put.positions = (int64_t *)(uintptr_t)a->positions;
    } else if (a->has_pos_start) {
        put.has_pos_start = 1;
        put.pos_start = a->pos_start;
    }
    SET_FLAG(put, pin, a->pin);
    Kvrope__LayoutPutOptions lo = KVROPE__LAYOUT_PUT_OPTIONS__INIT;
    if (a->has_protect || a->protect_first) {
        put.has_protect_first = 1;
        put.protect_first = a->protect_first;
    }
    if (a->n_groups && !a->groups)
        return kvr__fail(c, KVR_EINVAL, "put: group names missing");
    if (a->prefix_ctx || a->n_groups) {
        lo.prefix_context = unconst(a->prefix_ctx);
        lo.n_groups = a->n_groups;
        lo.groups = (char **)(uintptr_t)a->groups;
        if (a->group_offsets) {
            lo.n_group_offsets = a->n_groups;
            lo.group_offsets = (int64_t *)(uintptr_t)a->group_offsets;
        }
        put.layout = &lo;
    }
    if (a->codec && a->codec[0])
        put.codec = unconst(a->codec);
    SET_FLAG(put, persist, a->persist);
    SET_FLAG(put, v_trans, a->v_trans);
    SET_FLAG(put, share, a->share || a->share_sync);
    SET_FLAG(put, share_sync, a->share_sync);
    Kvrope__Request req = KVROPE__REQUEST__INIT;
    Kvrope__GroupAppend ga = KVROPE__GROUP_APPEND__INIT;
    if (group) {
        ga.put = &put;
        ga.group = unconst(group);
        if (put.layout) {
            ga.options = put.layout;
            put.layout = NULL;
        }
        req.body_case = KVROPE__REQUEST__BODY_GROUP_APPEND;
        req.group_append = &ga;
    } else {
        req.body_case = KVROPE__REQUEST__BODY_PUT;
        req.put = &put;
    }
    Kvrope__Response *resp;
    r = kvr__call(c, &req, w.iov, w.iovcnt, w.len, &resp, NULL);
    if (r < 0)
        return r;
    const Kvrope__PutResult *pr = group ? resp->group_append : resp->put;
    if (resp->body_case != (group ? KVROPE__RESPONSE__BODY_GROUP_APPEND
                                  : KVROPE__RESPONSE__BODY_PUT))
        return bad_body(c, resp, group ? "group append" : "put");
    if (out) {
        out->n_tokens = pr->n_tokens;
        out->first_index = pr->first_index;
        out->first_pos = pr->first_pos;
        out->last_pos = pr->last_pos;
    }
    kvrope__response__free_unpacked(resp, NULL);
    return 0;
}

/* ---- get / match -------------------------------------------------------- */

void kvr_kv_release(kvr_kv *kv)
{
    if (!kv)
        return;
    free(kv->meta_);
    if (kv->payload_owned)
        free(kv->payload);
    memset(kv, 0, sizeof *kv);
}

static size_t layer_half(const kvr_kv *kv)
{
    return kvr_payload_size(1, kv->n_tokens, kv->n_kv_heads, kv->head_dim, kv->dtype) / 2;
}

const void *kvr_kv_k(const kvr_kv *kv, size_t i)
{
    if (!kv->payload || i >= kv->n_layers)
        return NULL;
    return (const uint8_t *)kv->payload + i * 2 * layer_half(kv);
}

const void *kvr_kv_v(const kvr_kv *kv, size_t i)
{
    if (!kv->payload || i >= kv->n_layers)
        return NULL;
    return (const uint8_t *)kv->payload + (i * 2 + 1) * layer_half(kv);
}

/* Copies a KVResult's metadata into kv (one block), cross-checks the
 * payload length against the shapes, then receives the payload. */
static int take_kv(kvr_client *c, const Kvrope__KVResult *r, uint64_t pl, kvr_kv *kv,
                   bool meta_only, void *dst, size_t dst_cap, kvr_layer_fn fn, void *ud)
{
    memset(kv, 0, sizeof *kv);
    size_t n = r->n_tokens;
    int rc;
    if (r->token_count != n || (r->n_positions && r->n_positions != n) ||
        (r->n_flags && r->n_flags != n) || (r->n_groups && r->n_groups != n) ||
        kvr_dtype_size((kvr_dtype)r->dtype) == 0) {
        rc = kvr__fail(c, KVR_EPROTO, "inconsistent KV metadata from the daemon");
        goto drain;
    }
    size_t want = meta_only ? 0 : kvr_payload_size((uint32_t)r->n_layers, n, r->n_kv_heads,
                                                   r->head_dim, (kvr_dtype)r->dtype);
    if (r->raw && !meta_only) {   /* encoded: the layout's byte counts */
        want = (size_t)(r->n_layers * (r->raw->k_bytes + r->raw->v_bytes));
        fn = NULL;                /* K and V halves differ: no per-layer callback */
    }
    /* Shared memory: the daemon wrote the payload into the region. */
    bool in_shm = c->shm_got;
    uint64_t epl = pl;
    if (in_shm) {
        if (pl) {
            rc = kvr__fail(c, KVR_EPROTO, "a payload both in shared memory and on the socket");
            goto drain;
        }
        epl = c->shm_res.length;
    }
    if ((uint64_t)want != epl) {
        rc = kvr__fail(c, KVR_EPROTO, "payload of %llu bytes, the shapes say %zu",
                       (unsigned long long)epl, want);
        goto drain;
    }
    void *shm_p = NULL;
    if (in_shm && epl && !(shm_p = kvr__shm_ptr(c, &c->shm_res))) {
        rc = kvr__fail(c, KVR_EPROTO, "the daemon answered with a slice outside the region");
        goto drain;
    }
    size_t bytes = n * (sizeof(int64_t) + 3 * sizeof(uint32_t)) + r->n_layers * sizeof(uint32_t);
    uint8_t *blk = calloc(1, bytes ? bytes : 1);
    if (!blk) {
        rc = kvr__fail(c, KVR_ENOMEM, "out of memory");
        goto drain;
    }
    kv->meta_ = blk;
    kv->positions = (int64_t *)(void *)blk;
    kv->tokens = (uint32_t *)(void *)(blk + n * sizeof(int64_t));
    kv->flags = kv->tokens + n;
    kv->groups = (int32_t *)(void *)(kv->flags + n);
    kv->layers = (uint32_t *)(void *)(kv->groups + n);
    if (n) {
        memcpy(kv->tokens, r->tokens, n * sizeof *kv->tokens);
        if (r->n_positions)
            memcpy(kv->positions, r->positions, n * sizeof *kv->positions);
        if (r->n_flags)
            memcpy(kv->flags, r->flags, n * sizeof *kv->flags);
        if (r->n_groups)
            memcpy(kv->groups, r->groups, n * sizeof *kv->groups);
    }
    if (r->n_layers)
        memcpy(kv->layers, r->layers, r->n_layers * sizeof *kv->layers);
    copy_str(kv->ctx_id, sizeof kv->ctx_id, r->context_id);
    copy_str(kv->model, sizeof kv->model, r->model);
    kv->start = r->start;
    kv->n_tokens = n;
    kv->dtype = (kvr_dtype)r->dtype;
    kv->n_kv_heads = r->n_kv_heads;
    kv->head_dim = r->head_dim;
    kv->n_layers = r->n_layers;
    if (shm_p) {   /* a view of the region: the caller's memory, not owned */
        kv->payload = shm_p;
        kv->payload_len = (size_t)epl;
        kv->payload_owned = false;
        size_t half = kv->n_layers ? (size_t)epl / kv->n_layers / 2 : 0;
        for (size_t i = 0; fn && i < kv->n_layers; i++)
            fn(ud, (uint32_t)i, kv->layers[i], (uint8_t *)shm_p + 2 * i * half,
               (uint8_t *)shm_p + (2 * i + 1) * half, half);
        if (c->progress)
            c->progress(c->progress_ud, epl, epl);
    } else if (pl) {
        rc = kvr__recv_payload(c, pl, kv, dst, dst_cap, fn, ud);
        if (rc < 0) {
            kvr_kv_release(kv);
            return rc;
        }
    }
    return 0;
drain:
    if (pl) {
        int d = kvr__drain(c, pl);
        if (d < 0)
            return d;
    }
    return rc;
}

static void raw_from_wire(kvr_raw_layout *l, const Kvrope__RawLayout *w)
{
    memset(l, 0, sizeof *l);
    if (!w)
        return;
    l->raw = true;
    copy_str(l->codec, sizeof l->codec, w->codec);
    copy_str(l->k_codec, sizeof l->k_codec, w->k_codec);
    copy_str(l->v_codec, sizeof l->v_codec, w->v_codec);
    l->k_per_channel = w->has_k_per_channel && w->k_per_channel;
    l->k_group = w->has_k_group ? w->k_group : 0;
    l->v_group = w->has_v_group ? w->v_group : 0;
    l->window = w->has_window ? w->window : 0;
    l->k_bytes = w->k_bytes;
    l->v_bytes = w->v_bytes;
    l->k_unit_bytes = w->has_k_unit_bytes ? w->k_unit_bytes : 0;
    l->v_unit_bytes = w->has_v_unit_bytes ? w->v_unit_bytes : 0;
}

const void *kvr_kv_raw_k(const kvr_kv *kv, size_t i)
{
    const kvr_raw_layout *l = &kv->raw;
    if (!kv->payload || !l->raw || i >= kv->n_layers)
        return NULL;
    return (const uint8_t *)kv->payload + i * (l->k_bytes + l->v_bytes);
}

const void *kvr_kv_raw_v(const kvr_kv *kv, size_t i)
{
    const kvr_raw_layout *l = &kv->raw;
    if (!kv->payload || !l->raw || i >= kv->n_layers)
        return NULL;
    return (const uint8_t *)kv->payload + i * (l->k_bytes + l->v_bytes) + l->k_bytes;
}

int kvr_client_get(kvr_client *c, const kvr_get_args *a, kvr_kv *out)
{
    int r = call_begin(c, out, sizeof *out, "get", a->ctx_id);
    if (r < 0)
        return r;
    Kvrope__Get g = KVROPE__GET__INIT;
    g.context_id = unconst(a->ctx_id);
    g.has_start = 1;
    g.start = a->start;
    SET_IF(g, end, a->end);
    g.has_dtype = 1;
    g.dtype = (Kvrope__DType)a->dtype;
    if (a->positions) {
        g.n_positions = a->n_positions;
        g.positions = (int64_t *)(uintptr_t)a->positions;
    }
    if (a->layers) {
        g.n_layers = a->n_layers;
        g.layers = (uint32_t *)(uintptr_t)a->layers;
    }
    SET_FLAG(g, meta_only, a->meta_only);
    SET_FLAG(g, raw, a->raw);
    KVR_REQUEST(req, GET, get, &g);
    Kvrope__Response *resp;
    uint64_t pl;
    r = call_kv(c, &req, a->meta_only ? NULL : a->dst, a->dst_cap, KVROPE__RESPONSE__BODY_KV,
                "get", &resp, &pl);
    if (r < 0)
        return r;
    r = take_kv(c, resp->kv, pl, out, a->meta_only, a->dst, a->dst_cap, a->on_layer,
                a->on_layer_ud);
    if (r == 0)
        raw_from_wire(&out->raw, resp->kv->raw);
    kvrope__response__free_unpacked(resp, NULL);
    return r;
}

int kvr_client_match(kvr_client *c, const kvr_match_args *a, kvr_match_res *out)
{
    int r = call_begin(c, out, sizeof *out, "match model", a->model);
    if (r < 0)
        return r;
    Kvrope__Match m = KVROPE__MATCH__INIT;
    m.model = unconst(a->model);
    m.n_tokens = a->n_tokens;
    m.tokens = (uint32_t *)(uintptr_t)a->tokens;
    SET_FLAG(m, include_approximate, a->include_approximate);
    if (a->get) {
        m.has_get = 1;
        m.get = 1;
        m.has_dtype = 1;
        m.dtype = (Kvrope__DType)a->dtype;
        if (a->layers) {
            m.n_layers = a->n_layers;
            m.layers = (uint32_t *)(uintptr_t)a->layers;
        }
    }
    KVR_REQUEST(req, MATCH, match, &m);
    Kvrope__Response *resp;
    uint64_t pl;
    r = call_kv(c, &req, a->get ? a->dst : NULL, a->dst_cap, KVROPE__RESPONSE__BODY_MATCH,
                "match", &resp, &pl);
    if (r < 0)
        return r;
    out->length = resp->match->length;
    copy_str(out->ctx_id, sizeof out->ctx_id, resp->match->context_id);
    if (resp->match->kv) {
        r = take_kv(c, resp->match->kv, pl, &out->kv, false, a->dst, a->dst_cap, NULL, NULL);
        out->has_kv = r == 0;
    } else if (pl) {
        r = kvr__drain(c, pl);
    }
    kvrope__response__free_unpacked(resp, NULL);
    return r;
}

/* ---- context management ------------------------------------------------- */

int kvr_client_model_remove(kvr_client *c, const char *name)
{
    Kvrope__RemoveModel rm = KVROPE__REMOVE_MODEL__INIT;
    rm.name = unconst(name);
    KVR_REQUEST(req, REMOVE_MODEL, remove_model, &rm);
    return id_call(c, "remove model", name, &req);
}

/* A delete now, or (deferred) queued to go out ahead of the next call's
 * frame, its failure counted then (kvr__defer). */
static int delete_call(kvr_client *c, const char *ctx_id, bool deferred)
{
    c->err[0] = 0;
    int r = check_id(c, "delete", ctx_id);
    if (r < 0)
        return r;
    Kvrope__Delete d = KVROPE__DELETE__INIT;
    d.context_id = unconst(ctx_id);
    KVR_REQUEST(req, DELETE, delete_, &d);
    return deferred ? kvr__defer(c, &req) : simple_call(c, &req);
}

int kvr_client_delete(kvr_client *c, const char *ctx_id)
{
    return delete_call(c, ctx_id, false);
}

int kvr_client_delete_deferred(kvr_client *c, const char *ctx_id)
{
    return delete_call(c, ctx_id, true);
}

static void ctx_from_wire(kvr_context *o, const Kvrope__ContextInfo *ci);

int kvr_client_stat(kvr_client *c, const char *ctx_id, kvr_context *out)
{
    int r = check_id(c, "stat", ctx_id);
    if (r < 0)
        return r;
    Kvrope__Stat s = KVROPE__STAT__INIT;
    s.context_id = unconst(ctx_id);
    KVR_REQUEST(req, STAT, stat, &s);
    Kvrope__Response *resp;
    r = call_expect(c, &req, KVROPE__RESPONSE__BODY_CONTEXT, "stat", &resp);
    if (r < 0)
        return r;
    if (out)
        ctx_from_wire(out, resp->context);
    kvrope__response__free_unpacked(resp, NULL);
    return 0;
}

static void ctx_from_wire(kvr_context *o, const Kvrope__ContextInfo *ci)
{
    memset(o, 0, sizeof *o);
    copy_str(o->id, sizeof o->id, ci->id);
    copy_str(o->model, sizeof o->model, ci->model);
    o->n_tokens = ci->n_tokens;
    o->n_blocks = ci->n_blocks;
    o->n_shared_blocks = ci->n_shared_blocks;
    o->n_approximate = ci->n_approximate;
    o->bytes = ci->bytes;
    o->pinned = ci->pinned;
    o->busy = ci->has_busy && ci->busy;
    o->pos_min = ci->pos_min;
    o->pos_max = ci->pos_max;
    o->created_ms = ci->created_ms;
    o->accessed_ms = ci->accessed_ms;
    o->n_evicted_tokens = ci->has_n_evicted_tokens ? ci->n_evicted_tokens : 0;
    o->n_pending = ci->has_n_pending ? ci->n_pending : 0;
    o->n_protected = ci->has_n_protected ? ci->n_protected : 0;
    copy_str(o->codec, sizeof o->codec, ci->codec);
    o->quantized = ci->codec && strncmp(ci->codec, "k=", 2) == 0;
    o->n_window = ci->has_n_window ? ci->n_window : 0;
    o->kv_bytes = ci->has_kv_bytes ? ci->kv_bytes : 0;
    o->bytes_saved = ci->has_bytes_saved ? ci->bytes_saved : 0;
    o->bits_per_value = ci->has_bits_per_value ? ci->bits_per_value : 0.0;
    o->rel_rms_k = ci->has_rel_rms_k ? ci->rel_rms_k : 0.0;
    o->rel_rms_v = ci->has_rel_rms_v ? ci->rel_rms_v : 0.0;
    o->v_trans = ci->has_v_trans && ci->v_trans;
}

static size_t count_contexts(const Kvrope__Response *resp) { return resp->contexts->n_contexts; }
static void fill_context(void *dst, const Kvrope__Response *resp, size_t i)
{
    ctx_from_wire(dst, resp->contexts->contexts[i]);
}
static const list_kind CONTEXT_LIST = { KVROPE__RESPONSE__BODY_CONTEXTS, "list",
                                        sizeof(kvr_context), count_contexts, fill_context };

int kvr_client_list(kvr_client *c, const char *model, kvr_context **out, size_t *n)
{
    c->err[0] = 0;
    Kvrope__List l = KVROPE__LIST__INIT;
    l.model = model ? unconst(model) : NULL;
    KVR_REQUEST(req, LIST, list, &l);
    return list_call(c, &req, &CONTEXT_LIST, out, n);
}

int kvr_client_pin(kvr_client *c, const char *ctx_id, bool pin)
{
    Kvrope__Pin p = KVROPE__PIN__INIT;
    p.context_id = unconst(ctx_id);
    p.has_pin = 1;
    p.pin = pin;
    KVR_REQUEST(req, PIN, pin, &p);
    return id_call(c, "pin", ctx_id, &req);
}

int kvr_client_fork(kvr_client *c, const char *src, const char *dst)
{
    int r = check_id(c, "fork source", src);
    if (r < 0 || (r = check_id(c, "fork destination", dst)) < 0)
        return r;
    Kvrope__Fork f = KVROPE__FORK__INIT;
    f.src = unconst(src);
    f.dst = unconst(dst);
    KVR_REQUEST(req, FORK, fork, &f);
    return simple_call(c, &req);
}

int kvr_client_shift(kvr_client *c, const char *ctx_id, uint64_t start, uint64_t end,
                     int64_t delta)
{
    Kvrope__Shift s = KVROPE__SHIFT__INIT;
    s.context_id = unconst(ctx_id);
    s.start = start;
    s.end = end;
    s.delta = delta;
    KVR_REQUEST(req, SHIFT, shift, &s);
    return id_call(c, "shift", ctx_id, &req);
}

int kvr_client_keep(kvr_client *c, const char *ctx_id, uint64_t start, uint64_t end)
{
    Kvrope__Keep k = KVROPE__KEEP__INIT;
    k.context_id = unconst(ctx_id);
    k.start = start;
    k.end = end;
    KVR_REQUEST(req, KEEP, keep, &k);
    return id_call(c, "keep", ctx_id, &req);
}

/* ---- statistics --------------------------------------------------------- */

static size_t count_metrics(const Kvrope__Response *resp) { return resp->stats->n_metrics; }
static void fill_metric(void *dst, const Kvrope__Response *resp, size_t i)
{
    kvr_metric *m = dst;
    copy_str(m->name, sizeof m->name, resp->stats->metrics[i]->name);
    m->value = resp->stats->metrics[i]->value;
}
static const list_kind METRIC_LIST = { KVROPE__RESPONSE__BODY_STATS, "stats",
                                       sizeof(kvr_metric), count_metrics, fill_metric };

int kvr_client_stats(kvr_client *c, kvr_metric **out, size_t *n)
{
    Kvrope__Stats s = KVROPE__STATS__INIT;
    KVR_REQUEST(req, STATS, stats, &s);
    return list_call(c, &req, &METRIC_LIST, out, n);
}

bool kvr_metric_find(const kvr_metric *m, size_t n, const char *name, double *value)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(m[i].name, name) == 0) {
            if (value)
                *value = m[i].value;
            return true;
        }
    return false;
}

/* ---- edits (PIE) -------------------------------------------------------- */

/* EditResult -> kvr_edit_res (spans copied into one malloc'ed array). */
static int take_edit(kvr_client *c, Kvrope__Response *resp, const char *what,
                     kvr_edit_res *out)
{
    if (resp->body_case != KVROPE__RESPONSE__BODY_EDIT)
        return bad_body(c, resp, what);
    const Kvrope__EditResult *er = resp->edit;
    if (out) {
        memset(out, 0, sizeof *out);
        out->n_tokens = er->context_length;
        out->n_new = er->n_new;
        out->n_removed = er->n_removed;
        out->first_change = er->first_change;
        out->n_approximate = er->n_approximate;
        out->n_pending = er->n_pending;
        out->payload_bytes = er->has_payload_bytes ? er->payload_bytes : 0;
        if (er->n_spans) {
            out->spans = calloc(er->n_spans, sizeof *out->spans);
            if (!out->spans) {
                kvrope__response__free_unpacked(resp, NULL);
                return kvr__fail(c, KVR_ENOMEM, "out of memory");
            }
            for (size_t i = 0; i < er->n_spans; i++) {
                out->spans[i].index = er->spans[i]->index;
                out->spans[i].first_pos = er->spans[i]->first_pos;
                out->spans[i].shift = er->spans[i]->shift;
            }
            out->n_spans = er->n_spans;
        }
    }
    kvrope__response__free_unpacked(resp, NULL);
    return 0;
}

/* Wire ops of a, in a calloc'ed array of EditOp and of pointers. */
static int edit_ops(kvr_client *c, const kvr_edit_args *a, Kvrope__EditOp **ops,
                    Kvrope__EditOp ***ptrs)
{
    *ops = NULL;
    *ptrs = NULL;
    if (a->n_ops && !a->ops)
        return kvr__fail(c, KVR_EINVAL, "edit: ops missing");
    if (a->n_ops == 0)
        return kvr__fail(c, KVR_EINVAL, "edit: no ops");
    *ops = calloc(a->n_ops, sizeof **ops);
    *ptrs = calloc(a->n_ops, sizeof **ptrs);
    if (!*ops || !*ptrs) {
        free(*ops);
        free(*ptrs);
        return kvr__fail(c, KVR_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < a->n_ops; i++) {
        if (a->ops[i].n_tokens && !a->ops[i].tokens) {
            free(*ops);
            free(*ptrs);
            return kvr__fail(c, KVR_EINVAL, "edit op %zu: tokens missing", i);
        }
        kvrope__edit_op__init(&(*ops)[i]);
        (*ops)[i].start = a->ops[i].start;
        (*ops)[i].end = a->ops[i].end;
        (*ops)[i].n_tokens = a->ops[i].n_tokens;
        if (a->ops[i].approx)
            (*ops)[i].has_approx = (*ops)[i].approx = 1;
        (*ops)[i].tokens = (uint32_t *)(uintptr_t)a->ops[i].tokens;
        (*ptrs)[i] = &(*ops)[i];
    }
    return 0;
}


/* Edit and EditPlan carry the same target fields. */
#define SET_EDIT_TARGET(msg, a, ptrs)                                           \
    do {                                                                        \
        (msg).context_id = unconst((a)->ctx_id);                                \
        (msg).n_ops = (a)->n_ops;                                               \
        (msg).ops = (ptrs);                                                     \
        (msg).model = unconst((a)->model);                                      \
        SET_IF(msg, fingerprint, (a)->fingerprint);                             \
        if ((a)->expect) {                                                      \
            (msg).has_expect_length = (msg).has_expect_hash = 1;                \
            (msg).expect_length = (a)->expect_n_tokens;                         \
            (msg).expect_hash = (a)->expect_hash;                               \
        }                                                                       \
    } while (0)

/* An edit, or (plan) the plan of one: same ops and target; only an edit
 * carries KV. */
static int edit_call(kvr_client *c, const kvr_edit_args *a, bool plan, kvr_edit_res *out)
{
    const char *what = plan ? "edit plan" : "edit";
    int r = call_begin(c, out, sizeof *out, what, a->ctx_id);
    if (r < 0)
        return r;
    wire_payload w = { .len = 0 };
    if (!plan) {
        if ((r = payload_iov(c, what, a->payload, a->payload_len, a->iov, a->iovcnt, &w)) < 0)
            return r;
        if (!a->with_kv && w.len)
            return kvr__fail(c, KVR_EINVAL, "edit: a payload needs with_kv");
    }
    Kvrope__EditOp *ops;
    Kvrope__EditOp **ptrs;
    if ((r = edit_ops(c, a, &ops, &ptrs)) < 0)
        return r;
    Kvrope__Edit e = KVROPE__EDIT__INIT;
    Kvrope__EditPlan ep = KVROPE__EDIT_PLAN__INIT;
    Kvrope__Request req = KVROPE__REQUEST__INIT;
    if (plan) {
        SET_EDIT_TARGET(ep, a, ptrs);
        req.body_case = KVROPE__REQUEST__BODY_EDIT_PLAN;
        req.edit_plan = &ep;
    } else {
        SET_EDIT_TARGET(e, a, ptrs);
        if (a->with_kv) {
            SET_FLAG(e, with_kv, true);
            SET_SHAPE(e, a);
        }
        req.body_case = KVROPE__REQUEST__BODY_EDIT;
        req.edit = &e;
    }
    Kvrope__Response *resp;
    r = kvr__call(c, &req, w.iov, w.iovcnt, w.len, &resp, NULL);
    free(ops);
    free(ptrs);
    if (r < 0)
        return r;
    return take_edit(c, resp, what, out);
}

int kvr_client_edit(kvr_client *c, const kvr_edit_args *a, kvr_edit_res *out)
{
    return edit_call(c, a, false, out);
}

int kvr_client_edit_plan(kvr_client *c, const kvr_edit_args *a, kvr_edit_res *out)
{
    return edit_call(c, a, true, out);
}

int kvr_client_refresh(kvr_client *c, const kvr_refresh_args *a, kvr_edit_res *out)
{
    int r = call_begin(c, out, sizeof *out, "refresh", a->ctx_id);
    if (r < 0)
        return r;
    wire_payload w;
    if ((r = payload_iov(c, "refresh", a->payload, a->payload_len, a->iov, a->iovcnt, &w)) < 0)
        return r;
    Kvrope__Refresh f = KVROPE__REFRESH__INIT;
    f.context_id = unconst(a->ctx_id);
    f.start = a->start;
    SET_IF(f, end, a->end);
    f.model = unconst(a->model);
    SET_IF(f, fingerprint, a->fingerprint);
    SET_SHAPE(f, a);
    if (a->approx)
        f.has_approx = f.approx = 1;
    if (a->expect) {
        f.has_expect_length = f.has_expect_hash = 1;
        f.expect_length = a->expect_n_tokens;
        f.expect_hash = a->expect_hash;
    }
    KVR_REQUEST(req, REFRESH, refresh, &f);
    Kvrope__Response *resp;
    r = kvr__call(c, &req, w.iov, w.iovcnt, w.len, &resp, NULL);
    if (r < 0)
        return r;
    return take_edit(c, resp, "refresh", out);
}

/* ---- position layouts ---------------------------------------------------- */

void kvr_assemble_release(kvr_assemble_res *r)
{
    if (!r)
        return;
    kvr_kv_release(&r->kv);
    free(r->segments);
    memset(r, 0, sizeof *r);
}

int kvr_client_assemble(kvr_client *c, const kvr_assemble_args *a, kvr_assemble_res *out)
{
    int r = call_begin(c, out, sizeof *out, "assemble prefix", a->prefix);
    if (r < 0)
        return r;
    if (a->n_docs && !a->docs)
        return kvr__fail(c, KVR_EINVAL, "assemble: documents missing");
    for (size_t i = 0; i < a->n_docs; i++)
        if ((r = check_id(c, "assemble document", a->docs[i])) < 0)
            return r;
    Kvrope__Assemble m = KVROPE__ASSEMBLE__INIT;
    m.prefix = unconst(a->prefix);
    m.n_documents = a->n_docs;
    m.documents = (char **)(uintptr_t)a->docs;
    m.has_layout = 1;
    m.layout = (Kvrope__Layout)a->layout;
    if (a->layout == KVR_LAYOUT_EXPLICIT) {
        if (!a->starts)
            return kvr__fail(c, KVR_EINVAL, "assemble: explicit layout needs starts");
        m.n_starts = a->n_docs;
        m.starts = (int64_t *)(uintptr_t)a->starts;
    }
    m.has_dtype = 1;
    m.dtype = (Kvrope__DType)a->dtype;
    if (a->layers) {
        m.n_layers = a->n_layers;
        m.layers = (uint32_t *)(uintptr_t)a->layers;
    }
    if (a->temperature > 0) {
        m.has_temperature = 1;
        m.temperature = a->temperature;
    }
    if (a->scale > 0) {
        m.has_scale = 1;
        m.scale = a->scale;
    }
    SET_FLAG(m, fold_temperature, a->fold_temperature);
    SET_FLAG(m, meta_only, a->meta_only);
    KVR_REQUEST(req, ASSEMBLE, assemble, &m);
    Kvrope__Response *resp;
    uint64_t pl;
    r = call_kv(c, &req, NULL, 0, KVROPE__RESPONSE__BODY_ASSEMBLE, "assemble", &resp, &pl);
    if (r < 0)
        return r;
    if (!resp->assemble->kv)
        return bad_kv_body(c, resp, pl, "assemble");
    const Kvrope__AssembleResult *ar = resp->assemble;
    size_t ns = ar->n_segments;
    out->segments = calloc(ns ? ns : 1, sizeof *out->segments);
    if (!out->segments) {
        r = kvr__drain(c, pl);
        kvrope__response__free_unpacked(resp, NULL);
        return r < 0 ? r : kvr__fail(c, KVR_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < ns; i++) {
        const Kvrope__Segment *g = ar->segments[i];
        kvr_segment_res *o = &out->segments[i];
        o->kind = (kvr_segment_kind)g->kind;
        o->start = g->start;
        o->n_tokens = g->token_count;
        o->pos_first = g->pos_first;
        o->pos_last = g->pos_last;
        o->doc_index = g->has_doc_index ? g->doc_index : 0;
        copy_str(o->ctx_id, sizeof o->ctx_id, g->context_id);
        o->temperature = g->temperature;
        o->scale = g->scale;
    }
    out->n_segments = ns;
    out->query_pos = ar->query_pos;
    out->temperature = ar->temperature;
    out->scale = ar->scale;
    out->temperature_folded = ar->has_temperature_folded && ar->temperature_folded;
    out->prefix_len = ar->prefix_len;
    r = take_kv(c, ar->kv, pl, &out->kv, a->meta_only, a->dst, a->dst_cap, NULL, NULL);
    kvrope__response__free_unpacked(resp, NULL);
    if (r < 0) {
        free(out->segments);
        memset(out, 0, sizeof *out);
    }
    return r;
}

static int layout_call(kvr_client *c, Kvrope__Request *req, const char *what,
                       kvr_layout_res *out)
{
    Kvrope__Response *resp;
    int r = kvr__call(c, req, NULL, 0, 0, &resp, NULL);
    if (r < 0)
        return r;
    if (resp->body_case != KVROPE__RESPONSE__BODY_LAYOUT)
        return bad_body(c, resp, what);
    if (out) {
        const Kvrope__LayoutInfo *li = resp->layout;
        memset(out, 0, sizeof *out);
        copy_str(out->prefix_ctx, sizeof out->prefix_ctx, li->prefix_context);
        out->has_prefix = li->prefix_context != NULL;
        out->prefix_len = li->has_prefix_len ? li->prefix_len : 0;
        size_t ng = li->n_groups < KVR_MAX_GROUPS ? li->n_groups : KVR_MAX_GROUPS;
        for (size_t i = 0; i < ng; i++) {
            copy_str(out->groups[i].name, sizeof out->groups[i].name, li->groups[i]->name);
            out->groups[i].id = li->groups[i]->id;
            out->groups[i].offset = li->groups[i]->offset;
            out->groups[i].cursor = li->groups[i]->cursor;
            out->groups[i].n_tokens = li->groups[i]->token_count;
        }
        out->n_groups = ng;
        out->retention = li->has_retention && li->retention;
        out->sinks = li->has_sinks ? li->sinks : 0;
        out->window = li->has_window ? li->window : 0;
        out->n_dropped = li->has_dropped ? li->dropped : 0;
        out->v_trans = li->has_v_trans && li->v_trans;
    }
    kvrope__response__free_unpacked(resp, NULL);
    return 0;
}

int kvr_client_layout_stat(kvr_client *c, const char *ctx_id, kvr_layout_res *out)
{
    int r = check_id(c, "layout stat", ctx_id);
    if (r < 0)
        return r;
    Kvrope__LayoutStat m = KVROPE__LAYOUT_STAT__INIT;
    m.context_id = unconst(ctx_id);
    KVR_REQUEST(req, LAYOUT_STAT, layout_stat, &m);
    return layout_call(c, &req, "layout stat", out);
}

int kvr_client_set_group_offset(kvr_client *c, const char *ctx_id, const char *group,
                                int64_t offset, kvr_layout_res *out)
{
    int r = check_id(c, "set group offset", ctx_id);
    if (r < 0 || (r = check_id(c, "set group offset: group", group)) < 0)
        return r;
    Kvrope__SetGroupOffset m = KVROPE__SET_GROUP_OFFSET__INIT;
    m.context_id = unconst(ctx_id);
    m.group = unconst(group);
    m.offset = offset;
    KVR_REQUEST(req, SET_GROUP_OFFSET, set_group_offset, &m);
    return layout_call(c, &req, "set group offset", out);
}

int kvr_client_set_retention(kvr_client *c, const char *ctx_id, uint64_t sinks,
                             uint64_t window, bool off, kvr_layout_res *out)
{
    int r = check_id(c, "set retention", ctx_id);
    if (r < 0)
        return r;
    Kvrope__SetRetention m = KVROPE__SET_RETENTION__INIT;
    m.context_id = unconst(ctx_id);
    if (off) {
        m.has_off = 1;
        m.off = 1;
    } else {
        m.has_sinks = m.has_window = 1;
        m.sinks = sinks;
        m.window = window;
    }
    KVR_REQUEST(req, SET_RETENTION, set_retention, &m);
    return layout_call(c, &req, "set retention", out);
}

/* ---- cover ----------------------------------------------------------------- */

void kvr_cover_release(kvr_cover_res *r)
{
    if (!r)
        return;
    kvr_kv_release(&r->kv);
    free(r->runs);
    free(r->gaps);
    memset(r, 0, sizeof *r);
}

/* The runs (their ids in the same allocation, after them) and the gaps
 * between them, from the reply. */
static int cover_from_wire(kvr_client *c, const Kvrope__CoverResult *w, kvr_cover_res *out)
{
    size_t n = w->n_runs, ids = 0;
    for (size_t i = 0; i < n; i++)
        ids += strlen(w->runs[i]->context_id) + 1;
    out->runs = malloc(n * sizeof *out->runs + ids + 1);
    out->gaps = malloc((n + 1) * sizeof *out->gaps);
    if (!out->runs || !out->gaps)
        return kvr__fail(c, KVR_ENOMEM, "cover: out of memory for %zu runs", n);
    char *s = (char *)(out->runs + n);
    uint64_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const Kvrope__CoverRun *x = w->runs[i];
        if (x->prompt_offset < at || x->token_count > w->prompt_length ||
            x->prompt_offset > w->prompt_length - x->token_count)
            return kvr__fail(c, KVR_EPROTO, "cover: run %zu out of order or past the prompt",
                             i);
        if (x->prompt_offset > at)
            out->gaps[out->n_gaps++] = (kvr_cover_gap){ at, x->prompt_offset - at };
        size_t len = strlen(x->context_id) + 1;
        memcpy(s, x->context_id, len);
        out->runs[i] = (kvr_cover_run){
            .prompt_off = x->prompt_offset, .ctx_id = s, .ctx_off = x->context_offset,
            .n_tokens = x->token_count, .n_approx = x->n_approximate, .exact = x->exact,
            .stream_off = x->has_stream_offset ? x->stream_offset : 0,
        };
        s += len;
        at = x->prompt_offset + x->token_count;
    }
    if (at < w->prompt_length)
        out->gaps[out->n_gaps++] = (kvr_cover_gap){ at, w->prompt_length - at };
    out->n_runs = n;
    out->n_prompt = w->prompt_length;
    out->n_covered = w->covered;
    return 0;
}

static int cover_call(kvr_client *c, const kvr_cover_args *a, bool get, kvr_cover_res *out)
{
    int r = call_begin(c, out, sizeof *out, "cover model", a->model);
    if (r < 0)
        return r;
    if (a->n_tokens && !a->tokens)
        return kvr__fail(c, KVR_EINVAL, "cover: tokens missing");
    Kvrope__Cover m = KVROPE__COVER__INIT;
    m.model = unconst(a->model);
    m.n_tokens = a->n_tokens;
    m.tokens = (uint32_t *)(uintptr_t)a->tokens;
    SET_IF(m, min_run, a->min_run);
    if (get) {
        m.has_get = m.get = 1;
        SET_IF(m, pos_base, a->pos_base);
        m.has_dtype = 1;
        m.dtype = (Kvrope__DType)a->dtype;
        if (a->layers) {
            m.n_layers = a->n_layers;
            m.layers = (uint32_t *)(uintptr_t)a->layers;
        }
        SET_FLAG(m, meta_only, a->meta_only);
    }
    KVR_REQUEST(req, COVER, cover, &m);
    Kvrope__Response *resp;
    uint64_t pl;
    r = call_kv(c, &req, get && !a->meta_only ? a->dst : NULL, a->dst_cap,
                KVROPE__RESPONSE__BODY_COVER, "cover", &resp, &pl);
    if (r < 0)
        return r;
    if (get && !resp->cover->kv)
        return bad_kv_body(c, resp, pl, "cover");
    r = cover_from_wire(c, resp->cover, out);
    if (r == 0 && get) {
        r = take_kv(c, resp->cover->kv, pl, &out->kv, a->meta_only, a->dst, a->dst_cap, NULL,
                    NULL);
        out->has_kv = r == 0;
    } else if (pl) {
        int d = kvr__drain(c, pl);
        r = r < 0 ? r : d;
    }
    kvrope__response__free_unpacked(resp, NULL);
    if (r < 0)
        kvr_cover_release(out);
    return r;
}

int kvr_client_cover(kvr_client *c, const kvr_cover_args *a, kvr_cover_res *out)
{
    return cover_call(c, a, false, out);
}

int kvr_client_cover_get(kvr_client *c, const kvr_cover_args *a, kvr_cover_res *out)
{
    return cover_call(c, a, true, out);
}
