/*
 * bridge.c — the llama.cpp bridge through a kvr_client: registering a GGUF
 * profile as a kvrope model, importing a sequence state into a context and
 * exporting a context as a state (client/llama/kvrope_llama.h).
 *
 * Invariants: an import parses and checks everything (state, shape, model,
 * context, tokens, positions) before the single request that stores, so a
 * refusal changes nothing (REPLACE deletes the old context only after every
 * check passed). Float states of one type are sent straight from the state's
 * bytes (an iovec per layer side: no copy); other states are decoded once.
 * Keys travel rotated at their cell positions; the daemon's put decides how
 * to keep them (plain: as they are, stored-at = cell position; quantized
 * codecs: rotation removed first).
 */
#include "client/llama/bridge_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/uio.h>

static const char *model_name(const kvr_llama_model *m, const char *name, char *buf, size_t cap)
{
    if (name && name[0]) return name;
    return kvr_llama_model_default_name(m, buf, cap);
}

int kvr_llama_model_register(kvr_client *c, const kvr_llama_model *m, const char *name,
                             kvr_model *out, char *err, size_t errlen)
{
    if (!c || !m) return kvr__br_fail(err, errlen, KVR_EINVAL, "no client or model");
    char nb[KVR_ID_MAX + 1];
    kvr_model_params p;
    memset(&p, 0, sizeof p);
    p.name = model_name(m, name, nb, sizeof nb);
    p.style = m->rope.style == KVR_ROPE_GPTJ ? "gptj" : "neox";
    p.n_layers = m->n_layers;
    p.n_kv_heads = m->n_kv_heads;
    p.head_dim = m->head_dim;
    p.dtype = KVR_DTYPE_F16;
    p.rope = &m->rope;
    int rc = kvr_client_model_register(c, &p, out);
    if (rc)
        return kvr__br_fail(err, errlen, rc, "registering model '%s': %s", p.name,
                           kvr_client_last_error(c));
    return 0;
}

/* The daemon's model must be the profile's: same shape and RoPE. */
static int check_model(kvr_client *c, const kvr_llama_model *m, const char *name, char *err,
                       size_t errlen)
{
    kvr_model km;
    int rc = kvr_client_model_get(c, name, &km);
    if (rc == KVR_ENOMODEL)
        return kvr__br_fail(err, errlen, rc,
                           "model '%s' is not registered (kvr_llama_model_register / --gguf)", name);
    if (rc) return kvr__br_fail(err, errlen, rc, "model '%s': %s", name, kvr_client_last_error(c));
    char a[1024], b[1024];
    kvr_rope_config mine = m->rope, theirs = km.rope;
    size_t la = kvr_rope_config_canonical(&mine, a, sizeof a);
    size_t lb = kvr_rope_config_canonical(&theirs, b, sizeof b);
    if (km.n_layers != m->n_layers || km.n_kv_heads != m->n_kv_heads ||
        km.head_dim != m->head_dim || la != lb || memcmp(a, b, la < sizeof a ? la : sizeof a))
        return kvr__br_fail(err, errlen, KVR_EFINGERPRINT,
                           "model '%s' in the daemon (%u layers, %u KV heads x %u) is not the GGUF "
                           "profile's (%u x %u x %u, %s RoPE)", name, km.n_layers, km.n_kv_heads,
                           km.head_dim, m->n_layers, m->n_kv_heads, m->head_dim, m->arch);
    return 0;
}

/* The context must belong to model `name`. */
static int check_ctx(kvr_client *c, const char *ctx, const char *name, kvr_context *info,
                     char *err, size_t errlen)
{
    int rc = kvr_client_stat(c, ctx, info);
    if (rc) return kvr__br_fail(err, errlen, rc, "context '%s': %s", ctx, kvr_client_last_error(c));
    if (strcmp(info->model, name) != 0)
        return kvr__br_fail(err, errlen, KVR_EFINGERPRINT,
                           "context '%s' was made by model '%s', not '%s'", ctx, info->model, name);
    return 0;
}

static kvr_dtype plain_of(kvr_llama_type t)
{
    switch (t) {
    case KVR_LLAMA_F32:  return KVR_DTYPE_F32;
    case KVR_LLAMA_BF16: return KVR_DTYPE_BF16;
    default:             return KVR_DTYPE_F16;
    }
}

int kvr_llama_state_import(kvr_client *c, const char *ctx, const void *state, size_t len,
                           const kvr_llama_model *m, const kvr_llama_import_opts *opts,
                           kvr_llama_import_info *info, char *err, size_t errlen)
{
    static const kvr_llama_import_opts dflt;
    if (!opts) opts = &dflt;
    if (info) memset(info, 0, sizeof *info);
    if (!c || !ctx || !m) return kvr__br_fail(err, errlen, KVR_EINVAL, "no client, context or model");
    if (opts->mode > KVR_LLAMA_IMPORT_REFRESH)
        return kvr__br_fail(err, errlen, KVR_EINVAL, "unknown import mode %d", (int)opts->mode);
    kvr_llama_state *st;
    int rc = kvr_llama_state_parse(state, len, m, &st, err, errlen);
    if (rc) return rc;
    char nb[KVR_ID_MAX + 1];
    const char *name = model_name(m, opts->model, nb, sizeof nb);
    uint32_t c0 = opts->cell_start, c1 = opts->cell_end ? opts->cell_end : st->n_cells;
    uint32_t *toks = NULL;
    int64_t *pos = NULL;
    void *buf = NULL;
    struct iovec *iov = NULL;
    if (c0 > c1 || c1 > st->n_cells) {
        rc = kvr__br_fail(err, errlen, KVR_ERANGE, "cells [%u, %u) outside the state's %u cells",
                         c0, c1, st->n_cells);
        goto out;
    }
    uint32_t n = c1 - c0;
    if (n == 0) {
        rc = kvr__br_fail(err, errlen, KVR_EINVAL, "no cells to import (the state holds %u)",
                         st->n_cells);
        goto out;
    }
    /* tokens */
    if (opts->mode != KVR_LLAMA_IMPORT_REFRESH) {
        toks = malloc((size_t)n * sizeof *toks);
        if (!toks) { rc = kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory"); goto out; }
        if (opts->tokens) {
            if (opts->n_tokens != n) {
                rc = kvr__br_fail(err, errlen, KVR_EINVAL,
                                 "%zu tokens given for the %u cells taken", opts->n_tokens, n);
                goto out;
            }
            memcpy(toks, opts->tokens, (size_t)n * sizeof *toks);
        } else if (st->form == KVR_LLAMA_FORM_SESSION) {
            if (st->n_tokens != st->n_cells) {
                rc = kvr__br_fail(err, errlen, KVR_EINVAL,
                                 "the session file holds %u tokens for %u cells: pass the tokens",
                                 st->n_tokens, st->n_cells);
                goto out;
            }
            for (uint32_t i = 0; i < n; i++) toks[i] = (uint32_t)st->tokens[c0 + i];
        } else {
            rc = kvr__br_fail(err, errlen, KVR_EINVAL,
                             "a raw sequence state carries no token ids: pass the %u tokens", n);
            goto out;
        }
    }
    pos = malloc((size_t)n * sizeof *pos);
    if (!pos) { rc = kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory"); goto out; }
    for (uint32_t i = 0; i < n; i++) pos[i] = st->pos[c0 + i];

    if ((rc = check_model(c, m, name, err, errlen)) != 0) goto out;
    kvr_context ci;
    bool exists = false;
    if (opts->mode == KVR_LLAMA_IMPORT_APPEND || opts->mode == KVR_LLAMA_IMPORT_REFRESH) {
        if ((rc = check_ctx(c, ctx, name, &ci, err, errlen)) != 0) goto out;
        exists = true;
    } else {
        rc = kvr_client_stat(c, ctx, &ci);
        if (rc == 0) {
            if (opts->mode == KVR_LLAMA_IMPORT_CREATE) {
                rc = kvr__br_fail(err, errlen, KVR_EEXIST, "context '%s' exists", ctx);
                goto out;
            }
            exists = true;
        } else if (rc != KVR_ENOCTX) {
            rc = kvr__br_fail(err, errlen, rc, "context '%s': %s", ctx, kvr_client_last_error(c));
            goto out;
        }
    }

    /* payload: straight from the state when possible */
    bool same_float = st->type_k == st->type_v && !kvr_llama_type_is_quantized(st->type_k);
    kvr_dtype dt = same_float ? plain_of(st->type_k) : KVR_DTYPE_F32;
    size_t plen = kvr_llama_payload_size(m, n, dt);
    size_t iovcnt = 0;
    if (same_float && !st->v_trans) {
        iov = calloc((size_t)st->n_layers * 2, sizeof *iov);
        if (!iov) { rc = kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory"); goto out; }
        for (uint32_t l = 0; l < st->n_layers; l++) {
            iov[2 * l].iov_base = (void *)(uintptr_t)(st->k[l] + (size_t)c0 * st->row_k);
            iov[2 * l].iov_len = (size_t)n * st->row_k;
            iov[2 * l + 1].iov_base = (void *)(uintptr_t)(st->v[l] + (size_t)c0 * st->row_v);
            iov[2 * l + 1].iov_len = (size_t)n * st->row_v;
        }
        iovcnt = (size_t)st->n_layers * 2;
    } else {
        buf = malloc(plen ? plen : 1);
        if (!buf) { rc = kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory (%zu bytes)", plen); goto out; }
        if ((rc = kvr_llama_state_decode(st, m, c0, c1, opts->no_attn_rot, dt, buf, plen, err,
                                         errlen)) != 0)
            goto out;
    }
    const char *codec = opts->codec && opts->codec[0] ? opts->codec : kvr_dtype_name(dt);

    uint64_t ctx_len = 0;
    if (opts->mode == KVR_LLAMA_IMPORT_REFRESH) {
        uint64_t s0 = opts->ctx_start;
        if (s0 > ci.n_tokens || n > ci.n_tokens - s0) {
            rc = kvr__br_fail(err, errlen, KVR_ERANGE,
                             "refresh of tokens [%llu, %llu) outside context '%s' (%llu tokens)",
                             (unsigned long long)s0, (unsigned long long)(s0 + n), ctx,
                             (unsigned long long)ci.n_tokens);
            goto out;
        }
        kvr_kv meta;
        kvr_get_args ga = { .ctx_id = ctx, .start = s0, .end = s0 + n, .dtype = KVR_DTYPE_F16,
                            .meta_only = true };
        if ((rc = kvr_client_get(c, &ga, &meta)) != 0) {
            rc = kvr__br_fail(err, errlen, rc, "context '%s': %s", ctx, kvr_client_last_error(c));
            goto out;
        }
        for (uint32_t i = 0; i < n && rc == 0; i++)
            if (meta.positions[i] != pos[i])
                rc = kvr__br_fail(err, errlen, KVR_ERANGE,
                                 "cell %u is at position %lld, context token %llu at %lld: the "
                                 "keys would be rotated for the wrong position", c0 + i,
                                 (long long)pos[i], (unsigned long long)(s0 + i),
                                 (long long)meta.positions[i]);
        kvr_kv_release(&meta);
        if (rc) goto out;
        kvr_refresh_args ra = { .ctx_id = ctx, .start = s0, .end = s0 + n, .model = name,
                                .dtype = dt, .payload = iov ? NULL : buf,
                                .payload_len = iov ? 0 : plen, .iov = iov, .iovcnt = iovcnt };
        kvr_edit_res er;
        if ((rc = kvr_client_refresh(c, &ra, &er)) != 0) {
            rc = kvr__br_fail(err, errlen, rc, "refresh of '%s': %s", ctx, kvr_client_last_error(c));
            goto out;
        }
        ctx_len = er.n_tokens;
        kvr_client_free(er.spans);
    } else {
        bool replace = opts->mode == KVR_LLAMA_IMPORT_REPLACE;
        kvr_put_args pa = {
            .ctx_id = ctx, .model = name,
            .mode = replace ? KVR_PUT_REPLACE : exists ? KVR_PUT_APPEND : KVR_PUT_CREATE,
            .dtype = dt, .tokens = toks, .n_tokens = n, .positions = pos,
            .payload = iov ? NULL : buf, .payload_len = iov ? 0 : plen, .iov = iov,
            .iovcnt = iovcnt, .codec = exists && !replace ? NULL : codec,
            .persist = opts->persist,
            .v_trans = st->v_trans,   /* recorded on create: export's default */
        };
        kvr_put_res pr;
        rc = kvr_client_put(c, &pa, &pr);
        if (rc == KVR_EFINGERPRINT && replace) {
            /* The id holds another model's context, which a put never turns
             * into this model's: delete it, then create (not atomic). */
            rc = kvr_client_delete(c, ctx);
            if (rc && rc != KVR_ENOCTX) {
                rc = kvr__br_fail(err, errlen, rc, "replacing '%s': %s", ctx, kvr_client_last_error(c));
                goto out;
            }
            pa.mode = KVR_PUT_CREATE;
            rc = kvr_client_put(c, &pa, &pr);
        }
        if (rc) {
            rc = kvr__br_fail(err, errlen, rc, "storing into '%s': %s", ctx, kvr_client_last_error(c));
            goto out;
        }
        ctx_len = pr.n_tokens;
    }
    if (info) {
        info->form = st->form;
        info->seq_id = st->seq_id;
        info->n_cells = st->n_cells;
        info->n_taken = n;
        info->type_k = st->type_k;
        info->type_v = st->type_v;
        info->v_trans = st->v_trans;
        info->k_hadamard = kvr__br_rot_k(st->type_k, m->head_dim, opts->no_attn_rot) != 0;
        info->v_hadamard = kvr__br_rot_v(st->type_v, m->head_dim, opts->no_attn_rot) != 0;
        info->pos_first = st->pos[c0];
        info->pos_last = st->pos[c1 - 1];
        info->ctx_tokens = ctx_len;
        info->state_bytes = len;
        info->payload_bytes = plen;
        kvr_context cc;
        if (kvr_client_stat(c, ctx, &cc) == 0)
            snprintf(info->codec, sizeof info->codec, "%s", cc.codec);
        else
            snprintf(info->codec, sizeof info->codec, "%s", codec);
        snprintf(info->model, sizeof info->model, "%s", name);
    }
    rc = 0;
out:
    free(toks);
    free(pos);
    free(buf);
    free(iov);
    kvr_llama_state_free(st);
    return rc;
}

int kvr_llama_state_export(kvr_client *c, const char *ctx, const kvr_llama_model *m,
                           const kvr_llama_export_opts *opts, void **state, size_t *len,
                           kvr_llama_export_info *info, char *err, size_t errlen)
{
    static const kvr_llama_export_opts dflt;
    if (!opts) opts = &dflt;
    if (info) memset(info, 0, sizeof *info);
    if (state) *state = NULL;
    if (len) *len = 0;
    if (!c || !ctx || !m || !state || !len)
        return kvr__br_fail(err, errlen, KVR_EINVAL, "no client, context, model or output");
    char nb[KVR_ID_MAX + 1];
    const char *name = model_name(m, opts->model, nb, sizeof nb);
    kvr_llama_type tk = opts->type_k ? opts->type_k : KVR_LLAMA_F16;
    kvr_llama_type tv = opts->type_v ? opts->type_v : KVR_LLAMA_F16;
    if (kvr_llama_type_to_ggml(tk) < 0 || kvr_llama_type_to_ggml(tv) < 0)
        return kvr__br_fail(err, errlen, KVR_EINVAL, "unknown destination K/V type");
    if (!opts->v_trans_auto && opts->v_trans && kvr_llama_type_is_quantized(tv))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "quantized V (%s) needs v_trans 0 (flash attention)", kvr_llama_type_name(tv));
    uint32_t nval = m->n_kv_heads * m->head_dim;
    if (!kvr__br_row_bytes(tk, nval) || !kvr__br_row_bytes(tv, nval))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "%u values per cell is not a multiple of 32 (quantized types)", nval);
    int rc = check_model(c, m, name, err, errlen);
    if (rc) return rc;
    kvr_context ci;
    if ((rc = check_ctx(c, ctx, name, &ci, err, errlen)) != 0) return rc;
    bool v_trans = opts->v_trans_auto ? ci.v_trans : opts->v_trans;
    if (opts->v_trans_auto && v_trans && kvr_llama_type_is_quantized(tv))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "'%s' was imported from a state with V transposed (flash attention "
                           "off), and quantized V (%s) needs v_trans 0 (flash attention on): "
                           "choose the layout (--no-v-trans) or an f16/f32/bf16 V", ctx,
                           kvr_llama_type_name(tv));
    uint64_t s0 = opts->start, s1 = opts->end ? opts->end : ci.n_tokens;
    if (s0 >= s1 || s1 > ci.n_tokens)
        return kvr__br_fail(err, errlen, KVR_ERANGE, "tokens [%llu, %llu) outside '%s' (%llu tokens)",
                           (unsigned long long)s0, (unsigned long long)s1, ctx,
                           (unsigned long long)ci.n_tokens);
    uint64_t n = s1 - s0;
    if (n > UINT32_MAX) return kvr__br_fail(err, errlen, KVR_ERANGE, "too many tokens");
    int64_t *want = NULL;
    if (opts->has_pos_start) {
        if (opts->pos_start < 0 || opts->pos_start > (int64_t)INT32_MAX - (int64_t)n + 1)
            return kvr__br_fail(err, errlen, KVR_ERANGE,
                               "positions %lld.. do not fit llama.cpp's int32 positions",
                               (long long)opts->pos_start);
        want = malloc((size_t)n * sizeof *want);
        if (!want) return kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory");
        for (uint64_t i = 0; i < n; i++) want[i] = opts->pos_start + (int64_t)i;
    }
    bool same_float = tk == tv && !kvr_llama_type_is_quantized(tk);
    kvr_dtype dt = same_float ? plain_of(tk) : KVR_DTYPE_F32;
    kvr_get_args ga;
    memset(&ga, 0, sizeof ga);
    ga.ctx_id = ctx;
    ga.start = s0;
    ga.end = s1;
    ga.dtype = dt;
    ga.positions = want;
    ga.n_positions = want ? (size_t)n : 0;
    size_t need = kvr_llama_payload_size(m, (size_t)n, dt);
    if (opts->scratch && opts->scratch_cap >= need) {
        ga.dst = opts->scratch;
        ga.dst_cap = opts->scratch_cap;
    }
    kvr_kv kv;
    rc = kvr_client_get(c, &ga, &kv);
    free(want);
    if (rc) return kvr__br_fail(err, errlen, rc, "reading '%s': %s", ctx, kvr_client_last_error(c));
    int32_t *pos = malloc((size_t)n * sizeof *pos);
    int32_t *toks = malloc((size_t)n * sizeof *toks);
    if (!pos || !toks) { rc = kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory"); goto out; }
    uint64_t approx = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (kv.positions[i] < 0 || kv.positions[i] > INT32_MAX) {
            rc = kvr__br_fail(err, errlen, KVR_ERANGE,
                             "token %llu is at position %lld, outside llama.cpp's 0..2^31-1: pass "
                             "a pos_start", (unsigned long long)(s0 + i), (long long)kv.positions[i]);
            goto out;
        }
        if (kv.tokens[i] > INT32_MAX) {
            rc = kvr__br_fail(err, errlen, KVR_ERANGE, "token id %u does not fit llama_token",
                             kv.tokens[i]);
            goto out;
        }
        pos[i] = (int32_t)kv.positions[i];
        toks[i] = (int32_t)kv.tokens[i];
        if (kv.flags && (kv.flags[i] & KVR_TOKEN_APPROX)) approx++;
    }
    kvr_llama_encode_args ea;
    memset(&ea, 0, sizeof ea);
    ea.n_cells = (uint32_t)n;
    ea.pos = pos;
    ea.tokens = opts->form == KVR_LLAMA_FORM_SESSION ? toks : NULL;
    ea.payload = kv.payload;
    ea.dtype = dt;
    ea.type_k = tk;
    ea.type_v = tv;
    ea.v_trans = v_trans;
    ea.no_attn_rot = opts->no_attn_rot;
    ea.form = opts->form;
    ea.seq_id = opts->seq_id;
    if (kv.payload_len != kvr_llama_payload_size(m, (size_t)n, dt)) {
        rc = kvr__br_fail(err, errlen, KVR_EPROTO, "the daemon sent %zu payload bytes, %zu expected",
                         kv.payload_len, kvr_llama_payload_size(m, (size_t)n, dt));
        goto out;
    }
    if (opts->dst) {
        if ((rc = kvr_llama_state_encode_to(m, &ea, opts->dst, opts->dst_cap, len, err, errlen)) != 0)
            goto out;
        *state = opts->dst;
    } else if ((rc = kvr_llama_state_encode(m, &ea, state, len, err, errlen)) != 0) {
        goto out;
    }
    if (info) {
        info->n_cells = n;
        info->pos_first = pos[0];
        info->pos_last = pos[n - 1];
        info->type_k = tk;
        info->type_v = tv;
        info->v_trans = v_trans;
        info->v_trans_recorded = ci.v_trans;
        info->approx_tokens = approx;
        info->payload_bytes = kv.payload_len;
        info->state_bytes = *len;
    }
out:
    free(pos);
    free(toks);
    kvr_kv_release(&kv);
    return rc;
}
