/*
 * test_daemon_convert.c — daemon/convert.c alone: wire messages to store
 * parameters (what each refuses, and with which code and message), store
 * results to wire messages (every field, and through a pack/unpack round
 * trip), the allocating conversions' memory, and response framing. No
 * daemon, no store, no socket.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "daemon/convert.h"
#include "proto/frame.h"

static kvr_error err;

/* ---- status and frames -------------------------------------------------- */

Test(daemon_convert, status_of_maps_codes_and_refuses_the_rest)
{
    cr_assert_eq(kvr__status_of(0), KVROPE__STATUS__OK);
    cr_assert_eq(kvr__status_of(KVR_ENOCTX), KVROPE__STATUS__E_UNKNOWN_CONTEXT);
    cr_assert_eq(kvr__status_of(KVR_EPREFIX), KVROPE__STATUS__E_PREFIX);
    cr_assert_eq(kvr__status_of(KVR_EIO), KVROPE__STATUS__E_IO);
    cr_assert_eq(kvr__status_of(KVR_ESYS), KVROPE__STATUS__E_INTERNAL, "local codes never travel");
    cr_assert_eq(kvr__status_of(-7), KVROPE__STATUS__E_INTERNAL, "not a KVR_E* code");
    cr_assert_eq(kvr__status_of(-100000), KVROPE__STATUS__E_INTERNAL);
    cr_assert_eq(kvr__status_of(5), KVROPE__STATUS__E_INTERNAL);
}

static Kvrope__Response *unframe(const uint8_t *buf, size_t len, uint64_t *payload_len)
{
    kvr_frame_header fh;
    cr_assert_eq(kvr_frame_header_decode(buf, &fh, NULL), 0);
    cr_assert_eq(KVR_FRAME_HEADER_SIZE + fh.msg_len, len);
    *payload_len = fh.payload_len;
    Kvrope__Response *r = kvrope__response__unpack(NULL, fh.msg_len,
                                                   buf + KVR_FRAME_HEADER_SIZE);
    cr_assert(r);
    return r;
}

/* r packed into a frame and decoded again (free with ..._free_unpacked). */
static Kvrope__Response *through_the_wire(const Kvrope__Response *r)
{
    size_t len;
    uint8_t *buf = kvr__pack_response(r, 0, &len);
    cr_assert(buf);
    uint64_t pl;
    Kvrope__Response *u = unframe(buf, len, &pl);
    kvr_mem_free(buf);
    return u;
}

Test(daemon_convert, pack_response_frames_message_and_announces_payload)
{
    Kvrope__Pong p = KVROPE__PONG__INIT;
    p.server = "x";
    p.protocol = 1;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.id = 42;
    r.body_case = KVROPE__RESPONSE__BODY_PONG;
    r.pong = &p;
    size_t len = 0;
    uint8_t *buf = kvr__pack_response(&r, 12345, &len);
    cr_assert(buf);
    uint64_t pl;
    Kvrope__Response *u = unframe(buf, len, &pl);
    cr_assert_eq(pl, 12345);
    cr_assert_eq(u->id, 42);
    cr_assert_eq(u->body_case, KVROPE__RESPONSE__BODY_PONG);
    cr_assert_str_eq(u->pong->server, "x");
    kvrope__response__free_unpacked(u, NULL);
    kvr_mem_free(buf);
}

Test(daemon_convert, pack_error_uses_strerror_and_truncates)
{
    size_t len;
    uint8_t *buf = kvr__pack_error(7, KVR_ENOCTX, NULL, &len);
    uint64_t pl;
    Kvrope__Response *u = unframe(buf, len, &pl);
    cr_assert_eq(pl, 0);
    cr_assert_eq(u->id, 7);
    cr_assert_eq(u->status, KVROPE__STATUS__E_UNKNOWN_CONTEXT);
    cr_assert_str_eq(u->message, kvr_strerror(KVR_ENOCTX));
    kvrope__response__free_unpacked(u, NULL);
    kvr_mem_free(buf);

    char big[2000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    buf = kvr__pack_error(0, KVR_EINVAL, big, &len);
    u = unframe(buf, len, &pl);
    cr_assert_eq(strlen(u->message), KVR_ERR_MAX - 1);
    kvrope__response__free_unpacked(u, NULL);
    kvr_mem_free(buf);
}

/* ---- rope and models ---------------------------------------------------- */

Test(daemon_convert, rope_round_trips_through_the_wire)
{
    kvr_rope_config a;
    kvr_rope_config_init(&a);
    a.head_dim = a.rotary_dim = 64;
    a.style = KVR_ROPE_GPTJ;
    a.theta = 500000.0;
    a.scaling = KVR_ROPE_SCALING_YARN;
    a.factor = 4.0;
    a.original_max_position_embeddings = 4096;
    a.beta_fast = 32.0;
    a.beta_slow = 1.0;
    a.mscale = 0.707;
    a.attention_factor = 1.5;
    a.max_position_embeddings = 16384;
    Kvrope__RopeParams p;
    kvr__pb_rope(&a, &p);
    cr_assert(p.has_style && p.style == KVROPE__ROPE_STYLE__GPTJ);
    cr_assert(p.has_factor && p.factor == 4.0);
    cr_assert(p.has_attention_factor && p.has_mscale);
    cr_assert(!p.has_low_freq_factor, "llama3 fields only for llama3");
    /* Through bytes, as a client would see it. */
    uint8_t buf[1024];
    size_t n = kvrope__rope_params__pack(&p, buf);
    Kvrope__RopeParams *q = kvrope__rope_params__unpack(NULL, n, buf);
    cr_assert(q);
    kvr_rope_config b;
    kvr_rope_config_init(&b);
    b.head_dim = 64;
    cr_assert_eq(kvr__rope_from_pb(q, &b, &err), 0);
    cr_assert_eq(b.style, a.style);
    cr_assert_eq(b.theta, a.theta);
    cr_assert_eq(b.rotary_dim, a.rotary_dim);
    cr_assert_eq(b.scaling, a.scaling);
    cr_assert_eq(b.factor, a.factor);
    cr_assert_eq(b.original_max_position_embeddings, a.original_max_position_embeddings);
    cr_assert_eq(b.beta_fast, a.beta_fast);
    cr_assert_eq(b.beta_slow, a.beta_slow);
    cr_assert_eq(b.mscale, a.mscale);
    cr_assert_eq(b.attention_factor, a.attention_factor);
    cr_assert_eq(b.max_position_embeddings, a.max_position_embeddings);
    kvrope__rope_params__free_unpacked(q, NULL);
}

Test(daemon_convert, rope_reports_per_layer_kinds_and_model_type)
{
    kvr_rope_config a;
    kvr_rope_config_init(&a);
    snprintf(a.model_type, sizeof a.model_type, "gemma3_text");
    a.local_theta = 10000.0;
    a.n_layer_kinds = 3;
    a.layer_kind[0] = 1;
    a.layer_kind[1] = 0;
    a.layer_kind[2] = 2;
    Kvrope__RopeParams p;
    kvr__pb_rope(&a, &p);
    cr_assert_str_eq(p.model_type, "gemma3_text");
    cr_assert(p.has_local_theta && p.local_theta == 10000.0);
    cr_assert(p.has_layer_kinds && p.layer_kinds.len == 3);
    cr_assert_eq(p.layer_kinds.data[2], 2);
    cr_assert(!p.has_yarn_truncate, "only reported when yarn does not truncate");
    a.n_layer_kinds = 0;
    kvr__pb_rope(&a, &p);
    cr_assert(!p.has_layer_kinds);
}

Test(daemon_convert, rope_from_pb_refuses_bad_scaling_and_long_factor_lists)
{
    kvr_rope_config rc;
    kvr_rope_config_init(&rc);
    Kvrope__RopeParams p = KVROPE__ROPE_PARAMS__INIT;
    p.has_scaling = 1;
    p.scaling = (Kvrope__RopeScaling)99;
    cr_assert_eq(kvr__rope_from_pb(&p, &rc, &err), KVR_ECONFIG);
    cr_assert_str_eq(err.msg, "rope.scaling: unknown value 99");
    p.has_scaling = 0;
    double f[KVR_ROPE_MAX_HEAD_DIM / 2 + 1] = { 0 };
    p.n_short_factor = KVR_ROPE_MAX_HEAD_DIM / 2 + 1;
    p.short_factor = f;
    cr_assert_eq(kvr__rope_from_pb(&p, &rc, &err), KVR_ECONFIG);
    cr_assert(strstr(err.msg, "more than"), "%s", err.msg);
    cr_assert_eq(kvr__rope_from_pb(NULL, &rc, &err), 0);
}

Test(daemon_convert, model_desc_from_shape_fields)
{
    Kvrope__RegisterModel m = KVROPE__REGISTER_MODEL__INIT;
    m.name = "tiny";
    m.has_n_layers = m.has_n_kv_heads = m.has_head_dim = 1;
    m.n_layers = 2;
    m.n_kv_heads = 4;
    m.head_dim = 64;
    m.dtype = KVROPE__DTYPE__F16;
    m.style = "gptj";
    m.codec = "k4v2";
    kvr_model_desc d = { 0 };
    cr_assert_eq(kvr__model_desc_from_pb(&m, &d, &err), 0, "%s", err.msg);
    cr_assert_str_eq(d.name, "tiny");
    cr_assert_eq(d.n_layers, 2);
    cr_assert_eq(d.n_kv_heads, 4);
    cr_assert_eq(d.head_dim, 64);
    cr_assert_eq(d.dtype, KVR_DTYPE_F16);
    cr_assert_eq(d.rope.style, KVR_ROPE_GPTJ);
    cr_assert_eq(d.rope.rotary_dim, 64);
    cr_assert_eq(d.rope.num_heads, 4);
    cr_assert_str_eq(d.codec, "k4v2");
    m.codec = "";
    cr_assert_eq(kvr__model_desc_from_pb(&m, &d, &err), 0);
    cr_assert_null(d.codec);
}

Test(daemon_convert, model_desc_refusals_name_the_field)
{
    Kvrope__RegisterModel m = KVROPE__REGISTER_MODEL__INIT;
    m.name = "x";
    m.dtype = KVROPE__DTYPE__F32;
    kvr_model_desc d = { 0 };
    cr_assert_eq(kvr__model_desc_from_pb(&m, &d, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "register_model needs config_json, or n_layers, n_kv_heads and head_dim");
    m.style = "rotary";
    cr_assert_eq(kvr__model_desc_from_pb(&m, &d, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "register_model.style must be \"neox\" or \"gptj\", not \"rotary\"");
    m.style = NULL;
    m.dtype = (Kvrope__DType)9;
    cr_assert_eq(kvr__model_desc_from_pb(&m, &d, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "register_model.dtype: unknown value 9");
    m.dtype = KVROPE__DTYPE__F32;
    m.config_json = "{ not json";
    cr_assert_eq(kvr__model_desc_from_pb(&m, &d, &err), KVR_ECONFIG);
    cr_assert(!strncmp(err.msg, "config_json refused: ", 21), "%s", err.msg);
    m.config_json = NULL;
    m.has_n_layers = m.has_n_kv_heads = m.has_head_dim = 1;
    m.n_layers = 1;
    m.n_kv_heads = 1;
    m.head_dim = 7;      /* odd: the rope configuration refuses it */
    cr_assert_eq(kvr__model_desc_from_pb(&m, &d, &err), KVR_ECONFIG);
    cr_assert(!strncmp(err.msg, "rope configuration refused: ", 28), "%s", err.msg);
}

Test(daemon_convert, model_info_to_pb)
{
    kvr_rope_config rc;
    kvr_rope_config_init(&rc);
    kvr_model_info mi = { .name = "m", .n_layers = 3, .n_kv_heads = 2, .head_dim = 16,
                          .dtype = KVR_DTYPE_BF16, .fingerprint = 0xabcdef, .rope = &rc,
                          .n_contexts = 5, .codec = "bf16" };
    Kvrope__ModelInfo o;
    Kvrope__RopeParams rp;
    kvr__pb_model(&mi, &o, &rp);
    cr_assert_str_eq(o.name, "m");
    cr_assert_eq(o.n_layers, 3);
    cr_assert_eq(o.n_kv_heads, 2);
    cr_assert_eq(o.head_dim, 16);
    cr_assert_eq(o.dtype, KVROPE__DTYPE__BF16);
    cr_assert_eq(o.fingerprint, 0xabcdef);
    cr_assert(o.has_n_contexts && o.n_contexts == 5);
    cr_assert_str_eq(o.codec, "bf16");
    cr_assert_eq(o.rope, &rp);
    cr_assert(rp.has_theta && rp.theta == 10000.0);
    cr_assert(!rp.has_factor, "no factor without scaling");
}

/* ---- put ---------------------------------------------------------------- */

Test(daemon_convert, put_params_map_every_field)
{
    uint32_t tok[3] = { 1, 2, 3 };
    int64_t pos[3] = { 10, 11, 12 };
    Kvrope__Put p = KVROPE__PUT__INIT;
    p.context_id = "c";
    p.model = "m";
    p.mode = KVROPE__PUT_MODE__UPSERT;
    p.has_fingerprint = 1;
    p.fingerprint = 99;
    p.n_layers = 2;
    p.n_kv_heads = 3;
    p.head_dim = 8;
    p.dtype = KVROPE__DTYPE__BF16;
    p.n_tokens = 3;
    p.tokens = tok;
    p.n_positions = 3;
    p.positions = pos;
    p.has_pin = p.pin = 1;
    p.has_persist = p.persist = 1;
    p.codec = "int8";
    p.has_protect_first = 1;
    p.protect_first = 2;
    kvr_put_params pp;
    cr_assert_eq(kvr__put_params_from_pb(&p, "g", 777, &pp, &err), 0, "%s", err.msg);
    cr_assert_str_eq(pp.ctx_id, "c");
    cr_assert_str_eq(pp.model, "m");
    cr_assert_eq(pp.mode, KVR_PUT_UPSERT);
    cr_assert_eq(pp.fingerprint, 99);
    cr_assert_eq(pp.n_layers, 2);
    cr_assert_eq(pp.n_kv_heads, 3);
    cr_assert_eq(pp.head_dim, 8);
    cr_assert_eq(pp.dtype, KVR_DTYPE_BF16);
    cr_assert_eq(pp.n_tokens, 3);
    cr_assert_eq(pp.tokens, tok);
    cr_assert_eq(pp.positions, pos);
    cr_assert(pp.pin && pp.persist);
    cr_assert_str_eq(pp.group, "g");
    cr_assert_str_eq(pp.codec, "int8");
    cr_assert(pp.has_payload_bytes && pp.payload_bytes == 777);
    cr_assert(pp.has_protect_first && pp.protect_first == 2);
    cr_assert_null(pp.groups);
    p.has_fingerprint = 0;
    p.n_positions = 0;
    p.codec = "";
    p.has_protect_first = 0;
    cr_assert_eq(kvr__put_params_from_pb(&p, NULL, 0, &pp, &err), 0);
    cr_assert_eq(pp.fingerprint, 0);
    cr_assert_null(pp.positions);
    cr_assert_null(pp.codec);
    cr_assert_null(pp.group);
    cr_assert(!pp.has_protect_first);
}

Test(daemon_convert, put_params_refusals)
{
    Kvrope__Put p = KVROPE__PUT__INIT;
    p.context_id = "c";
    p.model = "m";
    p.dtype = (Kvrope__DType)7;
    kvr_put_params pp;
    cr_assert_eq(kvr__put_params_from_pb(&p, NULL, 0, &pp, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "put.dtype: unknown value 7");
    p.dtype = KVROPE__DTYPE__F16;
    p.mode = (Kvrope__PutMode)4;   /* 3 is REPLACE */
    cr_assert_eq(kvr__put_params_from_pb(&p, NULL, 0, &pp, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "put.mode: unknown value 4");
    p.mode = KVROPE__PUT_MODE__REPLACE;
    cr_assert_eq(kvr__put_params_from_pb(&p, NULL, 0, &pp, &err), 0, "%s", err.msg);
    cr_assert_eq(pp.mode, KVR_PUT_REPLACE);
    p.mode = KVROPE__PUT_MODE__CREATE;
    uint32_t tok[3] = { 0 };
    int64_t pos[2] = { 0 };
    p.n_tokens = 3;
    p.tokens = tok;
    p.n_positions = 2;
    p.positions = pos;
    cr_assert_eq(kvr__put_params_from_pb(&p, NULL, 0, &pp, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "put: 2 positions for 3 tokens");
    p.n_tokens = 2;
    p.has_pos_start = 1;
    cr_assert_eq(kvr__put_params_from_pb(&p, NULL, 0, &pp, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "put: give pos_start or positions, not both");
}

Test(daemon_convert, put_layout_options)
{
    kvr_put_params pp = { 0 };
    cr_assert_eq(kvr__put_layout_from_pb(NULL, &pp, &err), 0);
    char *names[2] = { "a", "b" };
    int64_t offs[2] = { 0, 100 };
    Kvrope__LayoutPutOptions lo = KVROPE__LAYOUT_PUT_OPTIONS__INIT;
    lo.prefix_context = "sys";
    lo.n_groups = 2;
    lo.groups = names;
    lo.n_group_offsets = 2;
    lo.group_offsets = offs;
    cr_assert_eq(kvr__put_layout_from_pb(&lo, &pp, &err), 0);
    cr_assert_str_eq(pp.prefix_ctx, "sys");
    cr_assert_eq(pp.n_groups, 2);
    cr_assert_str_eq(pp.groups[1], "b");
    cr_assert_eq(pp.group_offsets, offs);
    lo.n_group_offsets = 1;
    cr_assert_eq(kvr__put_layout_from_pb(&lo, &pp, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "put: 1 group offsets for 2 groups");
    lo.n_groups = 65;
    cr_assert_eq(kvr__put_layout_from_pb(&lo, &pp, &err), KVR_EINVAL);
    cr_assert_str_eq(err.msg, "put: 65 groups (limit 16)");
    lo.n_groups = 0;
    lo.n_group_offsets = 0;
    lo.prefix_context = "";
    cr_assert_eq(kvr__put_layout_from_pb(&lo, &pp, &err), 0);
    cr_assert_null(pp.prefix_ctx);
    cr_assert_null(pp.group_offsets);
}

Test(daemon_convert, put_result_to_pb)
{
    kvr_put_result res = { .n_tokens = 10, .first_index = 4, .first_pos = 100, .last_pos = 105 };
    Kvrope__PutResult o;
    kvr__pb_put_result(&res, &o);
    cr_assert_eq(o.n_tokens, 10);
    cr_assert_eq(o.first_index, 4);
    cr_assert_eq(o.first_pos, 100);
    cr_assert_eq(o.last_pos, 105);
}

/* ---- get, assemble -------------------------------------------------------- */

Test(daemon_convert, get_params)
{
    uint32_t layers[2] = { 0, 3 };
    int64_t pos[4] = { 0 };
    Kvrope__Get g = KVROPE__GET__INIT;
    g.context_id = "c";
    g.start = 2;
    g.dtype = KVROPE__DTYPE__F32;
    g.n_layers = 2;
    g.layers = layers;
    kvr_get_params gp;
    cr_assert_eq(kvr__get_params_from_pb(&g, &gp, &err), 0);
    cr_assert_str_eq(gp.ctx_id, "c");
    cr_assert_eq(gp.start, 2);
    cr_assert_eq(gp.end, SIZE_MAX, "no end: to the end");
    cr_assert_eq(gp.layers, layers);
    cr_assert_eq(gp.n_layers_sel, 2);
    cr_assert_null(gp.positions);
    cr_assert(!gp.meta_only && !gp.raw);
    g.has_end = 1;
    g.end = 6;
    g.n_positions = 4;
    g.positions = pos;
    g.has_meta_only = g.meta_only = 1;
    g.has_raw = g.raw = 1;
    cr_assert_eq(kvr__get_params_from_pb(&g, &gp, &err), 0);
    cr_assert_eq(gp.end, 6);
    cr_assert_eq(gp.positions, pos);
    cr_assert(gp.meta_only && gp.raw);
    g.dtype = (Kvrope__DType)5;
    cr_assert_eq(kvr__get_params_from_pb(&g, &gp, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "get.dtype: unknown value 5");
}

Test(daemon_convert, assemble_params_and_refusals)
{
    char *docs[2] = { "d1", "d2" };
    int64_t starts[2] = { 10, 20 };
    Kvrope__Assemble q = KVROPE__ASSEMBLE__INIT;
    q.prefix = "sys";
    q.n_documents = 2;
    q.documents = docs;
    q.layout = KVROPE__LAYOUT__EXPLICIT;
    q.n_starts = 2;
    q.starts = starts;
    q.dtype = KVROPE__DTYPE__F16;
    q.has_temperature = 1;
    q.temperature = 0.5;
    q.has_fold_temperature = q.fold_temperature = 1;
    kvr_assemble_params ap;
    cr_assert_eq(kvr__assemble_params_from_pb(&q, &ap, &err), 0, "%s", err.msg);
    cr_assert_str_eq(ap.prefix, "sys");
    cr_assert_eq(ap.n_docs, 2);
    cr_assert_str_eq(ap.docs[1], "d2");
    cr_assert_eq(ap.layout, KVR_LAYOUT_EXPLICIT);
    cr_assert_eq(ap.starts, starts);
    cr_assert_eq(ap.temperature, 0.5);
    cr_assert_eq(ap.scale, 0.0, "absent: the store's default");
    cr_assert(ap.fold_temperature && !ap.meta_only);
    q.n_starts = 1;
    cr_assert_eq(kvr__assemble_params_from_pb(&q, &ap, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "assemble: explicit layout with 1 starts for 2 documents");
    q.layout = KVROPE__LAYOUT__PARALLEL;
    cr_assert_eq(kvr__assemble_params_from_pb(&q, &ap, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "assemble: starts are for the explicit layout only");
    q.n_starts = 0;
    q.temperature = (double)NAN;
    cr_assert_eq(kvr__assemble_params_from_pb(&q, &ap, &err), KVR_EINVAL);
    q.temperature = 1.0;
    q.has_scale = 1;
    q.scale = 0.0;
    cr_assert_eq(kvr__assemble_params_from_pb(&q, &ap, &err), KVR_EINVAL);
    cr_assert_str_eq(err.msg, "assemble: temperature and scale must be positive numbers");
    q.has_scale = 0;
    q.layout = (Kvrope__Layout)9;
    cr_assert_eq(kvr__assemble_params_from_pb(&q, &ap, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "assemble.layout: unknown value 9");
}

static kvr_model_info model_info(void)
{
    kvr_model_info m = { .name = "m", .n_layers = 4, .n_kv_heads = 2, .head_dim = 8,
                         .dtype = KVR_DTYPE_F16 };
    return m;
}

Test(daemon_convert, kv_of_get_fills_every_field)
{
    uint32_t layers[2] = { 1, 3 }, tokens[3] = { 7, 8, 9 }, flags[3] = { 0, 1, 0 };
    int64_t pos[3] = { 5, 6, 7 };
    int32_t groups[3] = { 0, 0, 1 };
    kvr_get_info gi = { .model = model_info(), .start = 5, .n_tokens = 3,
                        .dtype = KVR_DTYPE_F32, .n_layers = 2, .layers = layers,
                        .tokens = tokens, .positions = pos, .flags = flags, .groups = groups };
    Kvrope__KVResult kv;
    Kvrope__RawLayout rl;
    char buf[3][64];
    kvr__pb_kv_of_get(&gi, "ctx", false, &kv, &rl, buf);
    cr_assert_str_eq(kv.context_id, "ctx");
    cr_assert_str_eq(kv.model, "m");
    cr_assert_eq(kv.start, 5);
    cr_assert_eq(kv.token_count, 3);
    cr_assert_eq(kv.dtype, KVROPE__DTYPE__F32);
    cr_assert_eq(kv.n_kv_heads, 2);
    cr_assert_eq(kv.head_dim, 8);
    cr_assert_eq(kv.n_layers, 2);
    cr_assert_eq(kv.layers[1], 3);
    cr_assert_eq(kv.n_tokens, 3);
    cr_assert_eq(kv.tokens[2], 9);
    cr_assert_eq(kv.n_positions, 3);
    cr_assert_eq(kv.positions[0], 5);
    cr_assert_eq(kv.n_flags, 3);
    cr_assert_eq(kv.n_groups, 3);
    cr_assert_eq(kv.groups[2], 1);
    cr_assert_null(kv.raw);
    gi.positions = NULL;
    gi.flags = NULL;
    gi.groups = NULL;
    kvr__pb_kv_of_get(&gi, "ctx", false, &kv, &rl, buf);
    cr_assert_eq(kv.n_positions, 0);
    cr_assert_eq(kv.n_flags, 0);
    cr_assert_eq(kv.n_groups, 0);
}

Test(daemon_convert, raw_layout_parses_the_canonical_codec)
{
    kvr_get_info gi = { .model = model_info(), .n_tokens = 300, .raw = true,
                        .codec = "k=int4/g128/c,v=int2/g64,r=128",
                        .k_bytes = 3 * 1000, .v_bytes = 300 * 10 };
    Kvrope__KVResult kv;
    Kvrope__RawLayout rl;
    char buf[3][64];
    kvr__pb_kv_of_get(&gi, "c", false, &kv, &rl, buf);
    cr_assert_eq(kv.raw, &rl);
    cr_assert_str_eq(rl.codec, "k=int4/g128/c,v=int2/g64,r=128");
    cr_assert_str_eq(rl.k_codec, "int4/g128");
    cr_assert_str_eq(rl.v_codec, "int2/g64");
    cr_assert(rl.has_k_per_channel && rl.k_per_channel);
    cr_assert_eq(rl.k_group, 128);
    cr_assert_eq(rl.v_group, 64);
    cr_assert(rl.has_window && rl.window == 128);
    cr_assert_eq(rl.k_bytes, 3000);
    cr_assert_eq(rl.k_unit_bytes, 1000, "300 tokens = 3 tiles of 128");
    cr_assert_eq(rl.v_unit_bytes, 10);

    snprintf(gi.codec, sizeof gi.codec, "k=q4_0,v=q8_0,r=0");
    kvr__pb_raw_layout(&gi, &rl, buf);
    cr_assert_str_eq(rl.k_codec, "q4_0");
    cr_assert(!rl.k_per_channel);
    cr_assert_eq(rl.k_group, 32);
    cr_assert_eq(rl.v_group, 32);
    cr_assert_eq(rl.k_unit_bytes, 10, "per token");

    kvr__pb_kv_of_get(&gi, "c", true, &kv, &rl, buf);
    cr_assert_null(kv.raw, "meta_only: no RawLayout");
}

Test(daemon_convert, assemble_result_segments_and_memory)
{
    size_t base = kvr_mem_allocated();
    uint32_t tokens[6] = { 1, 2, 3, 4, 5, 6 }, layers[4] = { 0, 1, 2, 3 };
    kvr_segment seg[3] = {
        { .kind = KVR_SEGMENT_PREFIX, .start = 0, .n_tokens = 2, .pos_first = 0, .pos_last = 1,
          .ctx_id = "sys", .temperature = 1, .scale = 1 },
        { .kind = KVR_SEGMENT_DOCUMENT, .start = 2, .n_tokens = 4, .pos_first = 2,
          .pos_last = 5, .doc_index = 0, .ctx_id = "d", .temperature = 0.9, .scale = 0.8 },
        { .kind = KVR_SEGMENT_QUERY, .start = 6, .n_tokens = 0, .pos_first = 6, .pos_last = 5,
          .temperature = 1, .scale = 1 },
    };
    kvr_assemble_info ai = { .model = model_info(), .n_tokens = 6, .dtype = KVR_DTYPE_F16,
                             .n_layers = 4, .layers = layers, .tokens = tokens, .segments = seg, .n_segments = 3,
                             .query_pos = 6, .temperature = 0.9, .scale = 0.8,
                             .temperature_folded = true, .prefix_len = 2 };
    Kvrope__AssembleResult ar;
    Kvrope__KVResult kv;
    cr_assert_eq(kvr__pb_assemble_result(&ai, "sys", &ar, &kv), 0);
    cr_assert_eq(ar.kv, &kv);
    cr_assert_str_eq(kv.context_id, "sys");
    cr_assert_eq(kv.token_count, 6);
    cr_assert_eq(kv.n_positions, 0);
    cr_assert_eq(ar.n_segments, 3);
    cr_assert_str_eq(ar.segments[0]->context_id, "sys");
    cr_assert(!ar.segments[0]->has_doc_index);
    cr_assert(ar.segments[1]->has_doc_index && ar.segments[1]->doc_index == 0);
    cr_assert_eq(ar.segments[1]->kind, KVROPE__SEGMENT_KIND__SEGMENT_DOCUMENT);
    cr_assert_eq(ar.segments[1]->temperature, 0.9);
    cr_assert_null(ar.segments[2]->context_id, "the query has no context");
    cr_assert_eq(ar.segments[2]->pos_last, 5);
    cr_assert_eq(ar.query_pos, 6);
    cr_assert(ar.has_temperature_folded && ar.temperature_folded);
    cr_assert_eq(ar.prefix_len, 2);
    /* It packs as a valid message. */
    Kvrope__Response *u = through_the_wire(&(Kvrope__Response){
        .base = PROTOBUF_C_MESSAGE_INIT(&kvrope__response__descriptor),
        .body_case = KVROPE__RESPONSE__BODY_ASSEMBLE,
        .assemble = &ar });
    cr_assert_eq(u->assemble->n_segments, 3);
    cr_assert_str_eq(u->assemble->segments[1]->context_id, "d");
    kvrope__response__free_unpacked(u, NULL);
    kvr__pb_assemble_result_free(&ar);
    cr_assert_eq(kvr_mem_allocated(), base);
}

/* ---- edits ---------------------------------------------------------------- */

Test(daemon_convert, edit_and_refresh_params)
{
    Kvrope__Edit q = KVROPE__EDIT__INIT;
    q.context_id = "c";
    q.model = "m";
    q.dtype = KVROPE__DTYPE__F16;
    kvr_edit_params ep;
    cr_assert_eq(kvr__edit_params_from_pb(&q, 10, &ep, &err), KVR_EPAYLOAD);
    cr_assert_str_eq(err.msg, "edit without with_kv takes no payload (payload_len 10)");
    q.has_with_kv = q.with_kv = 1;
    q.n_layers = 2;
    cr_assert_eq(kvr__edit_params_from_pb(&q, 10, &ep, &err), 0);
    cr_assert(ep.with_kv);
    cr_assert_eq(ep.payload_bytes, 10);
    cr_assert_eq(ep.n_layers, 2);
    cr_assert_str_eq(ep.ctx_id, "c");
    q.dtype = (Kvrope__DType)4;
    cr_assert_eq(kvr__edit_params_from_pb(&q, 10, &ep, &err), KVR_EBADREQUEST);
    cr_assert_str_eq(err.msg, "edit.dtype: unknown value 4");

    Kvrope__Refresh f = KVROPE__REFRESH__INIT;
    f.context_id = "c";
    f.start = 3;
    f.dtype = KVROPE__DTYPE__BF16;
    kvr_refresh_params rp;
    cr_assert_eq(kvr__refresh_params_from_pb(&f, 64, &rp, &err), 0);
    cr_assert_eq(rp.start, 3);
    cr_assert_eq(rp.end, SIZE_MAX);
    cr_assert_eq(rp.dtype, KVR_DTYPE_BF16);
    cr_assert_eq(rp.payload_bytes, 64);
    f.has_end = 1;
    f.end = 9;
    cr_assert_eq(kvr__refresh_params_from_pb(&f, 64, &rp, &err), 0);
    cr_assert_eq(rp.end, 9);
}

Test(daemon_convert, edit_ops_copy_ranges_and_borrow_tokens)
{
    size_t base = kvr_mem_allocated();
    uint32_t t0[2] = { 5, 6 };
    Kvrope__EditOp a = KVROPE__EDIT_OP__INIT, b = KVROPE__EDIT_OP__INIT;
    a.start = 1;
    a.end = 3;
    a.n_tokens = 2;
    a.tokens = t0;
    b.start = 7;
    b.end = 7;
    Kvrope__EditOp *in[2] = { &a, &b };
    kvr_edit_op *ops;
    cr_assert_eq(kvr__edit_ops_from_pb(in, 2, &ops, &err), 0);
    cr_assert_eq(ops[0].start, 1);
    cr_assert_eq(ops[0].end, 3);
    cr_assert_eq(ops[0].n_tokens, 2);
    cr_assert_eq(ops[0].tokens, t0);
    cr_assert_eq(ops[1].start, 7);
    cr_assert_eq(ops[1].n_tokens, 0);
    kvr_mem_free(ops);
    cr_assert_eq(kvr__edit_ops_from_pb(in, 0, &ops, &err), 0);
    cr_assert_null(ops);
    cr_assert_eq(kvr_mem_allocated(), base);
}

Test(daemon_convert, edit_result_with_spans)
{
    size_t base = kvr_mem_allocated();
    kvr_edit_result res = { .n_tokens = 20, .n_new = 3, .n_removed = 1, .first_change = 4,
                            .n_approx = 16, .n_pending = 3 };
    kvr_edit_span spans[2] = { { .index = 4, .first_pos = 4, .shift = 2 },
                               { .index = 10, .first_pos = 12, .shift = -1 } };
    Kvrope__EditResult er;
    cr_assert_eq(kvr__pb_edit_result(&res, spans, 2, 4096, &er), 0);
    cr_assert_eq(er.context_length, 20);
    cr_assert_eq(er.n_new, 3);
    cr_assert_eq(er.n_removed, 1);
    cr_assert_eq(er.first_change, 4);
    cr_assert_eq(er.n_approximate, 16);
    cr_assert_eq(er.n_pending, 3);
    cr_assert(er.has_payload_bytes && er.payload_bytes == 4096);
    cr_assert_eq(er.n_spans, 2);
    cr_assert_eq(er.spans[1]->index, 10);
    cr_assert_eq(er.spans[1]->first_pos, 12);
    cr_assert_eq(er.spans[1]->shift, -1);
    kvr__pb_edit_result_free(&er);
    cr_assert_eq(kvr__pb_edit_result(&res, NULL, 0, 0, &er), 0);
    cr_assert_eq(er.n_spans, 0);
    kvr__pb_edit_result_free(&er);
    cr_assert_eq(kvr_mem_allocated(), base);
}

Test(daemon_convert, ranges_refuse_what_size_t_cannot_hold)
{
    size_t s, e;
    cr_assert_eq(kvr__range_from_pb("shift", 2, 9, &s, &e, &err), 0);
    cr_assert_eq(s, 2);
    cr_assert_eq(e, 9);
#if SIZE_MAX < UINT64_MAX
    cr_assert_eq(kvr__range_from_pb("keep", UINT64_MAX, 1, &s, &e, &err), KVR_ERANGE);
    cr_assert_str_eq(err.msg, "keep: range out of bounds");
#endif
}

/* ---- contexts, lists, layouts ------------------------------------------------ */

static kvr_ctx_info ctx_info(const char *id)
{
    kvr_ctx_info i = { .n_tokens = 100, .n_blocks = 2, .n_shared_blocks = 1, .n_approx = 3,
                       .bytes = 4096, .pinned = true, .busy = true, .pos_min = 0,
                       .pos_max = 99, .created_ms = 1, .accessed_ms = 2,
                       .n_evicted_tokens = 4, .n_pending = 5, .n_protected = 6,
                       .n_window = 7, .kv_bytes = 8, .bytes_saved = 9,
                       .bits_per_value = 4.5, .rel_rms_k = 0.01, .rel_rms_v = 0.02 };
    snprintf(i.id, sizeof i.id, "%s", id);
    snprintf(i.model, sizeof i.model, "m");
    snprintf(i.codec, sizeof i.codec, "k4v2");
    return i;
}

Test(daemon_convert, context_info_round_trips)
{
    kvr_ctx_info i = ctx_info("c1");
    Kvrope__ContextInfo o;
    kvr__pb_context(&i, &o);
    uint8_t buf[1024];
    size_t n = kvrope__context_info__pack(&o, buf);
    Kvrope__ContextInfo *u = kvrope__context_info__unpack(NULL, n, buf);
    cr_assert(u);
    cr_assert_str_eq(u->id, "c1");
    cr_assert_str_eq(u->model, "m");
    cr_assert_eq(u->n_tokens, 100);
    cr_assert_eq(u->n_blocks, 2);
    cr_assert_eq(u->n_shared_blocks, 1);
    cr_assert_eq(u->n_approximate, 3);
    cr_assert_eq(u->bytes, 4096);
    cr_assert(u->pinned);
    cr_assert_eq(u->pos_max, 99);
    cr_assert_eq(u->created_ms, 1);
    cr_assert_eq(u->accessed_ms, 2);
    cr_assert(u->has_n_evicted_tokens && u->n_evicted_tokens == 4);
    cr_assert(u->has_busy && u->busy);
    cr_assert(u->has_n_pending && u->n_pending == 5);
    cr_assert(u->has_n_protected && u->n_protected == 6);
    cr_assert_str_eq(u->codec, "k4v2");
    cr_assert(u->has_n_window && u->n_window == 7);
    cr_assert(u->has_kv_bytes && u->kv_bytes == 8);
    cr_assert(u->has_bytes_saved && u->bytes_saved == 9);
    cr_assert(u->has_bits_per_value && u->bits_per_value == 4.5);
    cr_assert(u->has_rel_rms_k && u->rel_rms_k == 0.01);
    cr_assert(u->has_rel_rms_v && u->rel_rms_v == 0.02);
    kvrope__context_info__free_unpacked(u, NULL);
}

Test(daemon_convert, lists_allocate_once_and_free_all)
{
    size_t base = kvr_mem_allocated();
    kvr_ctx_info infos[3] = { ctx_info("a"), ctx_info("b"), ctx_info("c") };
    Kvrope__ContextList cl;
    cr_assert_eq(kvr__pb_context_list(infos, 3, &cl), 0);
    cr_assert_eq(cl.n_contexts, 3);
    cr_assert_str_eq(cl.contexts[2]->id, "c");
    cr_assert_str_eq(cl.contexts[0]->id, "a");
    kvr__pb_context_list_free(&cl);
    cr_assert_eq(kvr__pb_context_list(NULL, 0, &cl), 0);
    cr_assert_eq(cl.n_contexts, 0);
    kvr__pb_context_list_free(&cl);

    kvr_rope_config rc;
    kvr_rope_config_init(&rc);
    kvr_model_info mi[2] = { model_info(), model_info() };
    mi[0].rope = mi[1].rope = &rc;
    snprintf(mi[1].name, sizeof mi[1].name, "other");
    Kvrope__ModelList ml;
    cr_assert_eq(kvr__pb_model_list(mi, 2, &ml), 0);
    cr_assert_eq(ml.n_models, 2);
    cr_assert_str_eq(ml.models[1]->name, "other");
    cr_assert(ml.models[1]->rope && ml.models[1]->rope != ml.models[0]->rope);
    Kvrope__Response *u = through_the_wire(&(Kvrope__Response){
        .base = PROTOBUF_C_MESSAGE_INIT(&kvrope__response__descriptor),
        .body_case = KVROPE__RESPONSE__BODY_MODELS,
        .models = &ml });
    cr_assert_eq(u->models->n_models, 2);
    cr_assert_eq(u->models->models[1]->rope->theta, 10000.0);
    kvrope__response__free_unpacked(u, NULL);
    kvr__pb_model_list_free(&ml);
    cr_assert_eq(kvr__pb_model_list(NULL, 0, &ml), 0);
    kvr__pb_model_list_free(&ml);
    cr_assert_eq(kvr_mem_allocated(), base);
}

Test(daemon_convert, layout_info)
{
    kvr_layout_info li = { .has_prefix = true, .prefix_ctx = "sys", .prefix_fingerprint = 11,
                           .prefix_len = 12, .prefix_hash = 13, .n_groups = 2,
                           .has_retention = true, .sinks = 4, .window = 64,
                           .n_dropped = 100 };
    snprintf(li.groups[0].name, sizeof li.groups[0].name, "src");
    li.groups[1] = (kvr_group_info){ .name = "tgt", .id = 1, .offset = 1000, .cursor = 5,
                                     .n_tokens = 3 };
    Kvrope__GroupInfo gi[KVR_MAX_GROUPS];
    Kvrope__GroupInfo *gp[KVR_MAX_GROUPS];
    Kvrope__LayoutInfo o;
    kvr__pb_layout(&li, "c", &o, gi, gp);
    cr_assert_str_eq(o.context_id, "c");
    cr_assert_str_eq(o.prefix_context, "sys");
    cr_assert(o.has_prefix_fingerprint && o.prefix_fingerprint == 11);
    cr_assert(o.has_prefix_len && o.prefix_len == 12);
    cr_assert(o.has_prefix_hash && o.prefix_hash == 13);
    cr_assert_eq(o.n_groups, 2);
    cr_assert_str_eq(o.groups[1]->name, "tgt");
    cr_assert_eq(o.groups[1]->offset, 1000);
    cr_assert_eq(o.groups[1]->cursor, 5);
    cr_assert_eq(o.groups[1]->token_count, 3);
    cr_assert(o.has_retention && o.retention);
    cr_assert(o.has_sinks && o.sinks == 4);
    cr_assert(o.has_window && o.window == 64);
    cr_assert(o.has_dropped && o.dropped == 100);
    li.has_prefix = false;
    li.has_retention = false;
    kvr__pb_layout(&li, "c", &o, gi, gp);
    cr_assert_null(o.prefix_context);
    cr_assert(!o.has_prefix_len);
    cr_assert(o.has_retention && !o.retention);
    cr_assert(!o.has_sinks);
}

/* kvr__pack_response's fast path (a successful reply: id, status, one body)
 * writes exactly the bytes protobuf-c's generic packer writes. */
static void same_as_protobuf_c(const Kvrope__Response *r, uint64_t payload_len)
{
    size_t len = 0;
    uint8_t *got = kvr__pack_response(r, payload_len, &len);
    cr_assert_not_null(got);
    size_t n = kvrope__response__get_packed_size(r);
    uint8_t *want = malloc(n ? n : 1);
    cr_assert_eq(kvrope__response__pack(r, want), n);
    cr_assert_eq(len, KVR_FRAME_HEADER_SIZE + n, "body case %d: %zu bytes, protobuf-c %zu",
                 (int)r->body_case, len - KVR_FRAME_HEADER_SIZE, n);
    cr_assert(memcmp(got + KVR_FRAME_HEADER_SIZE, want, n) == 0, "body case %d differs",
              (int)r->body_case);
    kvr_frame_header fh;
    kvr_frame_limits lim = { .max_msg_len = UINT32_MAX, .max_payload_len = UINT64_MAX };
    cr_assert_eq(kvr_frame_header_decode(got, &fh, &lim), 0);
    cr_assert_eq(fh.msg_len, n);
    cr_assert_eq(fh.payload_len, payload_len);
    Kvrope__Response *back = kvrope__response__unpack(NULL, n, got + KVR_FRAME_HEADER_SIZE);
    cr_assert_not_null(back);
    cr_assert_eq(back->id, r->id);
    cr_assert_eq(back->body_case, r->body_case);
    kvrope__response__free_unpacked(back, NULL);
    free(want);
    kvr_mem_free(got);
}

Test(daemon_convert, fast_response_packing_matches_protobuf_c)
{
    const uint64_t ids[] = { 0, 1, 127, 128, 300, 1ull << 35, UINT64_MAX };
    for (size_t k = 0; k < sizeof ids / sizeof ids[0]; k++) {
        Kvrope__PutResult pr = KVROPE__PUT_RESULT__INIT;
        pr.n_tokens = 4 + k * 1000;
        pr.first_pos = -(int64_t)k * 77;
        pr.last_pos = (int64_t)k << 40;
        Kvrope__Response r = KVROPE__RESPONSE__INIT;
        r.id = ids[k];
        r.body_case = KVROPE__RESPONSE__BODY_PUT;
        r.put = &pr;
        same_as_protobuf_c(&r, 0);
        r.body_case = KVROPE__RESPONSE__BODY_GROUP_APPEND;
        r.group_append = &pr;
        same_as_protobuf_c(&r, 0);

        /* A KVResult with every repeated field, negatives and big values. */
        size_t nt = k * 37 + 1;
        uint32_t *tok = malloc(nt * sizeof *tok), *fl = malloc(nt * sizeof *fl),
                 layers[3] = { 0, 5, 300 };
        int64_t *pos = malloc(nt * sizeof *pos);
        int32_t *grp = malloc(nt * sizeof *grp);
        for (size_t i = 0; i < nt; i++) {
            tok[i] = (uint32_t)(i * 2654435761u);
            pos[i] = (int64_t)i * (k % 2 ? -1000003 : 1) + (int64_t)k;
            fl[i] = (uint32_t)(i % 8);
            grp[i] = (int32_t)(i % 3) - 1;
        }
        Kvrope__KVResult kv = KVROPE__KVRESULT__INIT;
        kv.context_id = (char *)"ctx";
        kv.model = (char *)"model";
        kv.start = k;
        kv.token_count = nt;
        kv.dtype = KVROPE__DTYPE__BF16;
        kv.n_kv_heads = 8;
        kv.head_dim = 128;
        kv.n_layers = 3;
        kv.layers = layers;
        kv.n_tokens = nt;
        kv.tokens = tok;
        kv.n_positions = nt;
        kv.positions = pos;
        kv.n_flags = nt;
        kv.flags = fl;
        kv.n_groups = nt;
        kv.groups = grp;
        r.body_case = KVROPE__RESPONSE__BODY_KV;
        r.kv = &kv;
        same_as_protobuf_c(&r, 65536 + k);
        Kvrope__MatchResult mr = KVROPE__MATCH_RESULT__INIT;
        mr.length = nt;
        mr.context_id = (char *)"ctx";
        mr.kv = k % 2 ? &kv : NULL;
        r.body_case = KVROPE__RESPONSE__BODY_MATCH;
        r.match = &mr;
        same_as_protobuf_c(&r, k % 2 ? 65536 : 0);
        free(tok);
        free(fl);
        free(pos);
        free(grp);
    }
    Kvrope__Pong pong = KVROPE__PONG__INIT;
    pong.server = (char *)"kvroped 0.3.0";
    pong.protocol = 1;
    Kvrope__Response r = KVROPE__RESPONSE__INIT;
    r.id = 9;
    r.body_case = KVROPE__RESPONSE__BODY_PONG;
    r.pong = &pong;
    same_as_protobuf_c(&r, 0);
    Kvrope__ContextInfo ci = KVROPE__CONTEXT_INFO__INIT;
    ci.id = (char *)"c";
    ci.model = (char *)"m";
    r.body_case = KVROPE__RESPONSE__BODY_CONTEXT;
    r.context = &ci;
    same_as_protobuf_c(&r, 0);
    /* Not the fast path's (message set, a status other than OK, no body):
     * still what protobuf-c writes. */
    r.status = KVROPE__STATUS__E_BUSY;
    r.message = (char *)"busy";
    same_as_protobuf_c(&r, 0);
    r.message = NULL;
    same_as_protobuf_c(&r, 0);
    r.body_case = KVROPE__RESPONSE__BODY__NOT_SET;
    same_as_protobuf_c(&r, 0);
}
