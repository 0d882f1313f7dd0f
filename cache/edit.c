/*
 * edit.c — PIE edits (replace / insert / delete token ranges, atomically),
 * refresh of a range's KV, and protected sink tokens.
 *
 * An edit never copies or rotates an old token: the context's extent array
 * is rebuilt with the old tokens' pieces (split at the edit points) carrying
 * a new pos_delta, and the new tokens' KV sits in fresh blocks written by
 * the transaction. get then rotates each key once from its stored form, so
 * a thousand edits leave the error of one rounding. The cost of a commit is
 * O(extents + ops + new tokens), independent of the suffix length.
 *
 * Invariants:
 *  - begin validates everything against the context, which stays busy
 *    until commit/abort (no other writer, no eviction), so commit cannot
 *    meet a surprise; its only failure (allocating the new extent array)
 *    comes before anything changes. Refusals leave the context as it was.
 *  - New-token and refreshed KV always go into blocks that only this
 *    transaction references (never into a block shared with a fork or
 *    leased by a get); their slots become visible (used) at commit.
 *  - Old tokens at or after the first edit point get KVR_TOKEN_APPROX and
 *    age by one edit (KVR_TOKEN_AGE); new tokens sent without KV get
 *    KVR_TOKEN_PENDING; refresh clears all three. A new op's tokens or a
 *    refreshed range whose KV saw approximate tokens before it (the request
 *    says so: kvr_edit_op.approx, kvr_refresh_params.approx) are stored
 *    KVR_TOKEN_APPROX with age 0: "exact" always means "what a full encode
 *    of the current sequence gives".
 *  - Prefix index: the exact tree is truncated at the first edit point and
 *    extended by the new exact tokens only (walks compressed edges). The
 *    full-sequence tree is truncated at the first edit point; when the
 *    suffix to re-insert is longer than the new tokens (+64), the context is
 *    marked stale instead and re-inserted by the next include_approx match
 *    (store.c, kvr_ctx_index_extend). A stale tree entry is a true prefix: it can
 *    under-report, never lie.
 *  - Overflow checks are O(extents): every block caches the bounds of its
 *    stored-at positions (slots below `used` never change); only when the
 *    bounds alone cannot exclude an overflow are the piece's tokens checked.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/txn.h"

typedef struct eop {
    size_t  start, end, n;   /* old range, new token count */
    size_t  tok;             /* offset of its new tokens in request order */
    size_t  req;             /* index in the request */
    size_t  index;           /* index of its first new token after the edit */
    int64_t first_pos;       /* position of its first new token */
    int64_t shift;           /* position/index change of old tokens after it */
    const uint32_t *tokens;  /* borrowed from the params (begin/plan only) */
    bool    approx;          /* its new tokens are stored APPROX (age 0) */
} eop;

struct kvr_edit {
    kvr_store    *s;
    kvr_ctx      *c;
    kvr_model    *m;
    bool          refresh, with_kv;
    kvr_dtype     pdt;
    eop          *ops;       /* sorted by start */
    size_t        n_ops, n_new, n_removed;
    kvr_brun     *runs;      /* fresh blocks, slots [0, count) */
    size_t        n_runs;
    kvr_wpay      w;         /* the new tokens' payload (none without KV) */
};

/* ---- helpers ------------------------------------------------------------- */

/* True if every token of slots [a, z) of e still has a representable
 * position after its delta grows by `shift`. */
static bool piece_shift_ok(const kvr_extent *e, uint32_t a, uint32_t z, int64_t shift)
{
    int64_t d, x;
    if (__builtin_add_overflow(e->pos_delta, shift, &d))
        return false;
    int64_t lo, hi;
    kvr_block_pos_bounds(e->block, &lo, &hi);
    if (!__builtin_add_overflow(lo, d, &x) && !__builtin_add_overflow(hi, d, &x))
        return true;
    for (uint32_t j = a; j < z; j++)
        if (__builtin_add_overflow(e->block->stored_pos[e->first + j], d, &x))
            return false;
    return true;
}

static int cmp_eop(const void *a, const void *b)
{
    const eop *x = a, *y = b;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    return x->req < y->req ? -1 : x->req > y->req;
}

/* The context an edit or refresh writes: live, of the model the request
 * names (if any), not being written. */
static int edit_target(kvr_store *s, const char *id, const char *model, uint64_t fp,
                       const kvr_expect *ex, kvr_ctx **out, kvr_error *err)
{
    int rc = kvr_store_ctx_live(s, id, out, err);
    if (rc != 0)
        return rc;
    const kvr_ctx *c = *out;
    if (model && model[0] && strcmp(model, c->model->name) != 0)
        return kvr_error_set(err, KVR_EFINGERPRINT,
                             "context '%s' belongs to model '%s', not '%s'", c->id,
                             c->model->name, model);
    if (fp && fp != c->model->fingerprint)
        return kvr_error_set(err, KVR_EFINGERPRINT,
                             "fingerprint %016llx does not match model '%s' (%016llx)",
                             (unsigned long long)fp, c->model->name,
                             (unsigned long long)c->model->fingerprint);
    if (c->busy)
        return kvr_error_set(err, KVR_EBUSY, "context '%s' is being written", c->id);
    if (ex && ex->set) {
        uint64_t h = KVR_TOKENS_HASH_INIT;
        for (size_t i = 0; i < c->n_ext && ex->n_tokens == c->n_tokens; i++) {
            const kvr_extent *e = &c->ext[i];
            h = kvr_tokens_hash(h, e->block->tokens + e->first, e->count);
        }
        if (ex->n_tokens != c->n_tokens || h != ex->hash)
            return kvr_error_set(err, KVR_EBUSY, "context '%s' changed since the request "
                                 "was planned (another writer's edit landed first)", c->id);
    }
    return 0;
}

/* Shape and payload size of n tokens' KV; 0 or ESHAPE/EPAYLOAD/ETOOLARGE. */
static int check_payload(const kvr_model *m, uint32_t nl, uint32_t nh, uint32_t hd,
                         kvr_dtype dt, size_t n, size_t declared, size_t *payload,
                         kvr_error *err)
{
    if (nl != m->n_layers || nh != m->n_kv_heads || hd != m->head_dim)
        return kvr_error_set(err, KVR_ESHAPE,
                             "shape %ux%ux%u (layers x kv_heads x head_dim) does not "
                             "match model '%s' (%ux%ux%u)", nl, nh, hd, m->name,
                             m->n_layers, m->n_kv_heads, m->head_dim);
    size_t es = kvr_dtype_size(dt), b;
    if (es == 0)
        return kvr_error_set(err, KVR_ESHAPE, "unknown payload dtype %d", (int)dt);
    if (__builtin_mul_overflow((size_t)m->n_kv_heads * m->head_dim, es, &b) ||
        __builtin_mul_overflow(b, n, &b) ||
        __builtin_mul_overflow(b, 2u * (size_t)m->n_layers, &b))
        return kvr_error_set(err, KVR_ETOOLARGE, "payload size overflows");
    if (declared != b)
        return kvr_error_set(err, KVR_EPAYLOAD,
                             "payload of %zu bytes for %zu tokens: expected %zu "
                             "(%u layers x K,V x %zu tokens x %u heads x %u dims x %s)",
                             declared, n, b, m->n_layers, n, m->n_kv_heads, m->head_dim,
                             kvr_dtype_name(dt));
    *payload = b;
    return 0;
}

/* Validates an edit against its context and computes every op's placement.
 * On success *ops (sorted by start, kvr_mem_malloc'ed) is the caller's. */
static int edit_prepare(kvr_store *s, const kvr_edit_params *p, kvr_ctx **cout,
                        eop **ops_out, size_t *n_new_out, size_t *n_rem_out,
                        size_t *payload, kvr_error *err)
{
    int rc;
    kvr_ctx *c = NULL;
    if (!p)
        return kvr_error_set(err, KVR_EBADREQUEST, "edit: missing parameters");
    if ((rc = edit_target(s, p->ctx_id, p->model, p->fingerprint, &p->expect, &c, err)) != 0)
        return rc;
    if (p->n_ops == 0 || !p->ops)
        return kvr_error_set(err, KVR_EBADREQUEST, "edit of '%s' with no ops", c->id);
    if (p->n_ops > KVR_MAX_PUT_TOKENS)
        return kvr_error_set(err, KVR_ETOOLARGE, "edit of %zu ops (limit %u)", p->n_ops,
                             KVR_MAX_PUT_TOKENS);
    size_t n = c->n_tokens, n_new = 0, n_rem = 0;
    for (size_t j = 0; j < p->n_ops; j++) {
        const kvr_edit_op *o = &p->ops[j];
        if (o->start > o->end || o->end > n)
            return kvr_error_set(err, KVR_ERANGE,
                                 "edit op %zu: range [%zu, %zu) is outside context '%s' "
                                 "of %zu tokens", j, o->start, o->end, c->id, n);
        if (o->n_tokens && !o->tokens)
            return kvr_error_set(err, KVR_EBADREQUEST, "edit op %zu: tokens missing", j);
        if (o->start == o->end && o->n_tokens == 0)
            return kvr_error_set(err, KVR_EINVAL,
                                 "edit op %zu: empty range and no tokens changes nothing", j);
        if (o->n_tokens > KVR_MAX_PUT_TOKENS || (n_new += o->n_tokens) > KVR_MAX_PUT_TOKENS)
            return kvr_error_set(err, KVR_ETOOLARGE, "edit of more than %u new tokens",
                                 KVR_MAX_PUT_TOKENS);
        n_rem += o->end - o->start;
    }
    if (p->with_kv) {
        if ((rc = check_payload(c->model, p->n_layers, p->n_kv_heads, p->head_dim, p->dtype,
                                n_new, p->payload_bytes, payload, err)) != 0)
            return rc;
    } else {
        *payload = 0;
    }
    eop *ops = kvr_mem_malloc(p->n_ops * sizeof *ops);
    if (!ops)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory for %zu edit ops", p->n_ops);
    size_t tok = 0;
    for (size_t j = 0; j < p->n_ops; j++) {
        ops[j] = (eop){ .start = p->ops[j].start, .end = p->ops[j].end,
                        .n = p->ops[j].n_tokens, .tok = tok, .req = j,
                        .tokens = p->ops[j].tokens, .approx = p->ops[j].approx };
        tok += p->ops[j].n_tokens;
    }
    qsort(ops, p->n_ops, sizeof *ops, cmp_eop);
    for (size_t j = 1; j < p->n_ops; j++) {
        if (ops[j].start == ops[j - 1].start || ops[j - 1].end > ops[j].start) {
            rc = kvr_error_set(err, KVR_EINVAL,
                               "edit ops [%zu, %zu) and [%zu, %zu) overlap (ops may not "
                               "share a start index)", ops[j - 1].start, ops[j - 1].end,
                               ops[j].start, ops[j].end);
            goto fail;
        }
    }
    size_t np = c->n_protected < n ? c->n_protected : n;
    if (ops[0].start < np) {
        rc = kvr_error_set(err, KVR_EPROTECTED,
                           "edit at [%zu, %zu) touches the protected first %zu tokens of '%s'",
                           ops[0].start, ops[0].end, np, c->id);
        goto fail;
    }
    /* Placement and overflow checks: one pass over the extents. */
    size_t ci = 0, ck = 0, wi = 0, wk = 0;
    int64_t shift = 0, last = n ? kvr_ctx_last_pos(c) : -1;
    for (size_t j = 0; j < p->n_ops; j++) {
        eop *o = &ops[j];
        int64_t base;
        if (o->start < n)
            base = kvr_ctx_pos_at(c, &ci, &ck, o->start);
        else if (n == 0)
            base = 0;
        else if (__builtin_add_overflow(last, 1, &base))
            goto overflow;
        int64_t tmp;
        if (__builtin_add_overflow(base, shift, &o->first_pos) ||
            (o->n && __builtin_add_overflow(o->first_pos, (int64_t)(o->n - 1), &tmp)))
            goto overflow;
        o->index = (size_t)((int64_t)o->start + shift);
        shift += (int64_t)o->n - (int64_t)(o->end - o->start);
        o->shift = shift;
        /* Old tokens from o->end to the next op (or the end) move by shift. */
        size_t to = j + 1 < p->n_ops ? ops[j + 1].start : n;
        if (shift == 0 || o->end >= to)
            continue;
        kvr_ctx_seek(c, &wi, &wk, o->end);
        for (size_t i = wi, k = wk; i < c->n_ext && k < to; k += c->ext[i].count, i++) {
            const kvr_extent *e = &c->ext[i];
            uint32_t a = (uint32_t)(o->end > k ? o->end - k : 0);
            uint32_t z = (uint32_t)((k + e->count < to ? k + e->count : to) - k);
            if (!piece_shift_ok(e, a, z, shift))
                goto overflow;
        }
    }
    *cout = c;
    *ops_out = ops;
    *n_new_out = n_new;
    *n_rem_out = n_rem;
    return 0;

overflow:
    rc = kvr_error_set(err, KVR_EINVAL, "edit of '%s' would move positions beyond int64",
                       c->id);
fail:
    kvr_mem_free(ops);
    return rc;
}

static void fill_spans(const eop *ops, size_t n_ops, kvr_edit_span *spans)
{
    if (!spans)
        return;
    for (size_t j = 0; j < n_ops; j++)
        spans[ops[j].req] = (kvr_edit_span){ ops[j].index, ops[j].first_pos, ops[j].shift };
}

int kvr_store_edit_plan(kvr_store *s, const kvr_edit_params *p, kvr_edit_span *spans,
                        kvr_edit_result *res, kvr_error *err)
{
    kvr_ctx *c;
    eop *ops;
    size_t n_new, n_rem, payload;
    int rc = edit_prepare(s, p, &c, &ops, &n_new, &n_rem, &payload, err);
    if (rc != 0)
        return rc;
    fill_spans(ops, p->n_ops, spans);
    if (res) {
        size_t n = c->n_tokens, first = ops[0].start;
        memset(res, 0, sizeof *res);
        res->n_tokens = n - n_rem + n_new;
        res->n_new = n_new;
        res->n_removed = n_rem;
        res->first_change = first;
        res->n_approx = kvr_ctx_count_flag(c, 0, first, KVR_TOKEN_APPROX) + (n - first) -
                        (n_rem);
        for (size_t j = 0; j < p->n_ops; j++)      /* new tokens stored APPROX */
            res->n_approx += ops[j].approx ? ops[j].n : 0;
        /* Kept old tokens stay pending; new ones are pending without KV. */
        size_t pend = kvr_ctx_count_flag(c, 0, n, KVR_TOKEN_PENDING);
        for (size_t j = 0; j < p->n_ops; j++)
            pend -= kvr_ctx_count_flag(c, ops[j].start, ops[j].end, KVR_TOKEN_PENDING);
        res->n_pending = pend + (p->with_kv ? 0 : n_new);
        res->payload_bytes = payload;
    }
    kvr_mem_free(ops);
    return 0;
}

/* ---- transactions ---------------------------------------------------------- */

static void txn_free(kvr_edit *t)
{
    for (size_t i = 0; i < t->n_runs; i++)
        kvr_block_unref(&t->s->pool, t->runs[i].b);
    kvr_mem_free(t->runs);
    kvr_mem_free(t->ops);
    kvr_wpay_free(&t->w);
    kvr_mem_free(t);
}

/* Reserves memory and allocates blocks for t->n_new tokens, plus payload
 * iovecs (zero-copy when the payload dtype is the storage dtype). The
 * context must already be busy. */
static int txn_alloc(kvr_edit *t, size_t payload, kvr_error *err)
{
    kvr_store *s = t->s;
    kvr_model *m = t->m;
    kvr_ctx *c = t->c;
    size_t n_blocks = (t->n_new + s->B - 1) / s->B;
    /* Full blocks of B, and a last one sized to the tokens it holds (an
     * editor's keystroke inserts a few tokens: a whole block each would
     * hold a cap's worth of memory for them). */
    uint32_t last = (uint32_t)(t->n_new % s->B);
    size_t bb = (n_blocks - (last ? 1 : 0)) * kvr_store_block_alloc(s, c, false, 0) +
                (last ? kvr_store_block_alloc(s, c, false, last) : 0);
    /* Quantized contexts: new tokens join the full-precision window (plain
     * blocks in the window dtype) and are quantized by a later put's flush;
     * their payload is staged so work can refuse nan/inf first. */
    bool zero_copy = t->pdt == c->dtype && !c->codec.quant;
    size_t n_iov = !payload ? 0 : zero_copy ? 2u * m->n_layers * n_blocks : 1;
    size_t need = bb + n_blocks * (sizeof(kvr_block) + 64) + (zero_copy ? 0 : payload) +
                  n_iov * sizeof(struct iovec) + n_blocks * sizeof(kvr_brun) +
                  (c->n_ext + 3 * t->n_ops + n_blocks + 1) * sizeof(kvr_extent);
    int rc = kvr_store_reserve_request(s, need, t->refresh ? "refresh" : "edit", err);
    if (rc != 0)
        return rc;
    t->w.p.bytes = payload;
    if (n_blocks && !(t->runs = kvr_mem_calloc(n_blocks, sizeof *t->runs)))
        goto nomem;
    size_t left = t->n_new;
    while (left) {
        uint32_t k = left < s->B ? (uint32_t)left : s->B;
        kvr_block *b = kvr_store_block_new_for(s, c, false, 0, k);
        if (!b)
            goto nomem;
        t->runs[t->n_runs++] = (kvr_brun){ b, 0, k };
        left -= k;
    }
    if (payload && kvr_wpay_init(&t->w, t->runs, t->n_runs, m->n_layers, payload,
                                 zero_copy, true) != 0)
        goto nomem;
    return 0;

nomem:
    return kvr_error_set(err, KVR_ENOMEM, "out of memory preparing blocks for %zu tokens",
                         t->n_new);
}

/* Slot of new token g (request order). */
static kvr_block *new_slot(const kvr_edit *t, size_t g, uint32_t *slot)
{
    *slot = (uint32_t)(g % t->s->B);
    return t->runs[g / t->s->B].b;
}

int kvr_store_edit_begin(kvr_store *s, const kvr_edit_params *p, kvr_edit **out,
                         kvr_error *err)
{
    int rc;
    if (!out)
        return kvr_error_set(err, KVR_EBADREQUEST, "edit: missing parameters");
    kvr_ctx *c;
    eop *ops;
    size_t n_new, n_rem, payload;
    if ((rc = edit_prepare(s, p, &c, &ops, &n_new, &n_rem, &payload, err)) != 0)
        return rc;
    kvr_edit *t = kvr_mem_calloc(1, sizeof *t);
    if (!t) {
        kvr_mem_free(ops);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory starting an edit");
    }
    t->s = s;
    t->c = c;
    t->m = c->model;
    t->ops = ops;
    t->n_ops = p->n_ops;
    t->n_new = n_new;
    t->n_removed = n_rem;
    t->with_kv = p->with_kv;
    t->pdt = p->with_kv ? p->dtype : c->dtype;
    c->busy = true;
    if ((rc = txn_alloc(t, payload, err)) != 0)
        goto fail;
    /* Metadata into the (still invisible) slots. */
    for (size_t j = 0; j < t->n_ops; j++) {
        const eop *o = &ops[j];
        for (size_t q = 0; q < o->n; q++) {
            uint32_t slot;
            kvr_block *b = new_slot(t, o->tok + q, &slot);
            kvr_block_set_meta(b, slot, o->tokens[q], o->first_pos + (int64_t)q, 0);
        }
        t->ops[j].tokens = NULL;     /* borrowed from p: not valid after begin */
    }
    *out = t;
    return 0;

fail:
    c->busy = false;
    txn_free(t);
    return rc;
}

int kvr_store_refresh_begin(kvr_store *s, const kvr_refresh_params *p, kvr_edit **out,
                            kvr_error *err)
{
    int rc;
    kvr_ctx *c = NULL;
    if (!p || !out)
        return kvr_error_set(err, KVR_EBADREQUEST, "refresh: missing parameters");
    if ((rc = edit_target(s, p->ctx_id, p->model, p->fingerprint, &p->expect, &c, err)) != 0)
        return rc;
    size_t start = p->start, end = p->end == SIZE_MAX ? c->n_tokens : p->end;
    if (start >= end || end > c->n_tokens)
        return kvr_error_set(err, KVR_ERANGE,
                             "refresh range [%zu, %zu) is empty or outside context '%s' "
                             "of %zu tokens", start, end, c->id, c->n_tokens);
    size_t n = end - start, payload;
    if (n > KVR_MAX_PUT_TOKENS)
        return kvr_error_set(err, KVR_ETOOLARGE, "refresh of %zu tokens (limit %u)", n,
                             KVR_MAX_PUT_TOKENS);
    if ((rc = check_payload(c->model, p->n_layers, p->n_kv_heads, p->head_dim, p->dtype,
                            n, p->payload_bytes, &payload, err)) != 0)
        return rc;
    kvr_edit *t = kvr_mem_calloc(1, sizeof *t);
    eop *op = kvr_mem_calloc(1, sizeof *op);
    if (!t || !op) {
        kvr_mem_free(t);
        kvr_mem_free(op);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory starting a refresh");
    }
    size_t ci = 0, ck = 0;
    *op = (eop){ .start = start, .end = end, .n = n, .index = start,
                 .first_pos = kvr_ctx_pos_at(c, &ci, &ck, start), .approx = p->approx };
    t->s = s;
    t->c = c;
    t->m = c->model;
    t->ops = op;
    t->n_ops = 1;
    t->n_new = n;
    t->n_removed = n;
    t->refresh = t->with_kv = true;
    t->pdt = p->dtype;
    c->busy = true;
    if ((rc = txn_alloc(t, payload, err)) != 0) {
        c->busy = false;
        txn_free(t);
        return rc;
    }
    /* Same ids and groups; stored at the current logical positions. */
    size_t g = 0;
    kvr_ctx_seek(c, &ci, &ck, start);
    for (size_t i = ci, k = ck; i < c->n_ext && k < end; k += c->ext[i].count, i++) {
        const kvr_extent *e = &c->ext[i];
        uint32_t a = (uint32_t)(start > k ? start - k : 0);
        uint32_t z = (uint32_t)((k + e->count < end ? k + e->count : end) - k);
        for (uint32_t j = a; j < z; j++, g++) {
            uint32_t slot, from = e->first + j;
            kvr_block *b = new_slot(t, g, &slot);
            kvr_block_set_meta(b, slot, e->block->tokens[from], kvr_ext_pos(e, j),
                               e->block->groups[from]);
        }
    }
    *out = t;
    return 0;
}

KVR_WRITE_TXN_API(kvr_edit, kvr_edit)

int kvr_edit_work(kvr_edit *t, kvr_error *err)
{
    if (!t->w.work || t->w.worked)
        return 0;
    const kvr_model *m = t->m;
    size_t row = kvr_model_row(m);
    uint32_t bl;
    int bkv;
    size_t btok;
    if (t->c->codec.quant &&
        kvr_quant_find_nonfinite(t->w.staging, t->pdt, m->n_layers, t->n_new, row, &bl, &bkv, &btok))
        return kvr_error_set(err, KVR_EINVAL, "%s of '%s': %s of layer %u, new token %zu "
                             "is nan or inf; nothing was changed",
                             t->refresh ? "refresh" : "edit", t->c->id, bkv ? "V" : "K", bl,
                             btok);
    const uint8_t *src = t->w.staging;
    for (uint32_t l = 0; l < m->n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            src = kvr_brun_fill(t->runs, t->n_runs, l, kv, src, t->pdt);
    t->w.worked = true;
    return 0;
}

/* ---- commit ----------------------------------------------------------------- */

typedef struct ebuild {
    kvr_extent *ext;
    size_t      n;
} ebuild;

static void emit(ebuild *o, kvr_block *b, uint32_t first, uint32_t count, int64_t delta,
                 uint32_t flags)
{
    if (count > 0 && !kvr_ext_append(o->ext, &o->n, (kvr_extent){ b, first, count, delta,
                                                                   flags }))
        kvr_block_ref(b);
}

/* An old token's flags after an edit point moved past it: approximate, one
 * edit older (KVR_TOKEN_AGE, saturating at 255). add 0: unchanged. */
static uint32_t aged(uint32_t f, uint32_t add)
{
    if (!(add & KVR_TOKEN_APPROX))
        return f | add;
    uint32_t age = KVR_TOKEN_AGE(f);
    if (age < 255)
        age++;
    return (f & ~KVR_TOKEN_AGE_MASK) | add | (age << KVR_TOKEN_AGE_SHIFT);
}

static void emit_old(ebuild *o, const kvr_ctx *c, size_t *ci, size_t *ck, size_t from,
                     size_t to, int64_t shift, uint32_t add_flags)
{
    if (from >= to)
        return;
    kvr_ctx_seek(c, ci, ck, from);
    for (size_t i = *ci, k = *ck; i < c->n_ext && k < to; k += c->ext[i].count, i++) {
        const kvr_extent *e = &c->ext[i];
        uint32_t a = (uint32_t)(from > k ? from - k : 0);
        uint32_t z = (uint32_t)((k + e->count < to ? k + e->count : to) - k);
        emit(o, e->block, e->first + a, z - a, e->pos_delta + shift,
             aged(e->flags, add_flags));
    }
}

int kvr_edit_commit(kvr_edit *t, kvr_edit_span *spans, kvr_edit_result *res, kvr_error *err)
{
    int rc;
    kvr_store *s = t->s;
    kvr_ctx *c = t->c;
    if (t->w.work && !t->w.worked && (rc = kvr_edit_work(t, err)) != 0)
        goto fail;
    size_t cap = c->n_ext + 3 * t->n_ops + t->n_runs + 1;
    ebuild o = { kvr_mem_malloc(cap * sizeof(kvr_extent)), 0 };
    if (!o.ext) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory committing an edit of '%s'",
                           c->id);
        goto fail;
    }
    /* Slots become visible before any extent points at them. */
    for (size_t r = 0; r < t->n_runs; r++)
        kvr_block_commit(t->runs[r].b, t->runs[r].count);

    size_t ci = 0, ck = 0, pos = 0, n_old = c->n_tokens;
    int64_t shift = 0;
    uint32_t add = 0;
    uint32_t new_flags = t->with_kv ? 0 : KVR_TOKEN_PENDING;
    for (size_t j = 0; j < t->n_ops; j++) {
        const eop *op = &t->ops[j];
        emit_old(&o, c, &ci, &ck, pos, op->start, shift, add);
        for (size_t q = 0; q < op->n;) {
            uint32_t slot;
            kvr_block *b = new_slot(t, op->tok + q, &slot);
            uint32_t cnt = s->B - slot;
            if (cnt > op->n - q)
                cnt = (uint32_t)(op->n - q);
            emit(&o, b, slot, cnt, 0, new_flags | (op->approx ? KVR_TOKEN_APPROX : 0u));
            q += cnt;
        }
        shift = op->shift;
        pos = op->end;
        if (!t->refresh)
            add = KVR_TOKEN_APPROX;
    }
    emit_old(&o, c, &ci, &ck, pos, n_old, shift, add);

    /* Swap in the new extents; the old array's references go. */
    size_t old_exact = c->n_exact, first = t->ops[0].start;
    kvr_ctx_replace_extents(&s->pool, c, o.ext, o.n, cap);
    assert(c->n_tokens == n_old - t->n_removed + t->n_new);
    if (!t->refresh)
        kvr_grain_note(c, first);     /* resynced by the next cover */
    size_t exact = c->n_exact;

    /* Index. Failures leave c under-reported (a true prefix), never wrong. */
    /* A refresh can shorten the exact prefix too (a range stored APPROX). */
    size_t keep0 = t->refresh ? (old_exact < exact ? old_exact : exact)
                              : (old_exact < first ? old_exact : first);
    kvr_ctx_index_truncate(c, 0, keep0);
    if (!kvr_ctx_index_extend(c, 0, exact))
        kvr_ctx_index_truncate(c, 0, keep0);
    if (!t->refresh) {
        kvr_ctx_index_truncate(c, 1, first);
        if (!c->idx_stale && c->n_tokens - c->idx[1].len <= t->n_new + 64) {
            if (!kvr_ctx_index_extend(c, 1, c->n_tokens))
                kvr_ctx_stale_set(c);
        } else {
            kvr_ctx_stale_set(c);
        }
    }
    kvr_ctx_check(c);

    c->busy = false;
    kvr_store_touch(s, c);
    fill_spans(t->ops, t->n_ops, spans);
    if (res) {
        memset(res, 0, sizeof *res);
        res->n_tokens = c->n_tokens;
        res->n_new = t->refresh ? 0 : t->n_new;
        res->n_removed = t->refresh ? 0 : t->n_removed;
        res->first_change = first;
        res->n_approx = kvr_ctx_count_flag(c, 0, c->n_tokens, KVR_TOKEN_APPROX);
        res->n_pending = kvr_ctx_count_flag(c, 0, c->n_tokens, KVR_TOKEN_PENDING);
        res->payload_bytes = t->w.p.bytes;
    }
    txn_free(t);
    return 0;

fail:
    kvr_edit_abort(t);
    return rc;
}

void kvr_edit_abort(kvr_edit *t)
{
    if (!t)
        return;
    t->c->busy = false;
    txn_free(t);
}

/* ---- protected sinks ------------------------------------------------------------ */

int kvr_store_protect(kvr_store *s, const char *ctx_id, size_t n, kvr_error *err)
{
    kvr_ctx *c = NULL;
    int rc = kvr_store_ctx_writable(s, ctx_id, &c, err);
    if (rc != 0)
        return rc;
    if (n > c->n_tokens)
        return kvr_error_set(err, KVR_ERANGE,
                             "cannot protect %zu tokens of context '%s' of %zu", n, c->id,
                             c->n_tokens);
    c->n_protected = n;
    return 0;
}
