/*
 * put.c — the put transaction: create or append tokens with their K/V.
 *
 * put_begin validates everything, marks the context busy, reserves memory
 * under the cap and prepares destination runs: the free tail slots of the
 * context's last block when that block is exclusively owned (refcount 1),
 * then fresh blocks. Token ids and stored-at positions are written into the
 * destination slots at once; those slots lie beyond every block's `used`,
 * so no reader sees them until commit.
 *
 * Invariants:
 *  - Until commit the context's extents, length and index entries are
 *    untouched, so abort restores it exactly (a create-put's pending
 *    context is removed altogether).
 *  - The txn holds one reference on every destination block; commit hands
 *    it to the new extent (or drops it when the extent is merged).
 *  - Payload iovecs point straight into block memory when the payload dtype
 *    is the storage dtype; otherwise into a staging buffer that put_work
 *    converts (kvr_convert) into the blocks.
 */
#include <string.h>

#include "cache/store_internal.h"

typedef struct put_run {
    kvr_block *b;
    uint32_t   first, count;
} put_run;

struct kvr_put {
    kvr_store    *s;
    kvr_ctx      *c;
    kvr_model    *m;
    bool          created, tail, pin, worked;
    kvr_dtype     pdt;          /* payload dtype */
    size_t        n;
    uint32_t     *tokens;       /* copy, for the prefix index */
    int64_t       first_pos, last_pos;
    put_run      *runs;
    size_t        n_runs;
    uint8_t      *staging;
    size_t        payload;
    struct iovec *iov;
    size_t        n_iov;
    layout_put    lp;           /* groups / APE record / retention (layout.c) */
};

static void txn_free(kvr_put *t)
{
    kvr_store *s = t->s;
    for (size_t i = 0; i < t->n_runs; i++) {
        if (!t->runs[i].b)
            continue;
        if (i == 0 && t->tail)
            t->runs[i].b->holds--;
        block_unref(s, t->runs[i].b);
    }
    kvr_mem_free(t->runs);
    kvr_mem_free(t->staging);
    kvr_mem_free(t->iov);
    kvr_mem_free(t->tokens);
    layout_put_free(&t->lp);
    kvr_mem_free(t);
}

static int mul_ok(size_t *out, size_t a, size_t b)
{
    return !__builtin_mul_overflow(a, b, out);
}

int kvr_store_put_begin(kvr_store *s, const kvr_put_params *p, kvr_put **out,
                        kvr_error *err)
{
    int rc;
    if (!p || !out)
        return kvr_error_set(err, KVR_EBADREQUEST, "put: missing parameters");
    if ((rc = ctx_id_check(p->ctx_id, err)) != 0)
        return rc;
    kvr_model *m = model_find(s, p->model);
    if (!m)
        return kvr_error_set(err, KVR_ENOMODEL, "no model '%s'", p->model ? p->model : "");
    if (p->fingerprint && p->fingerprint != m->fingerprint)
        return kvr_error_set(err, KVR_EFINGERPRINT,
                             "fingerprint %016llx does not match model '%s' (%016llx)",
                             (unsigned long long)p->fingerprint, m->name,
                             (unsigned long long)m->fingerprint);
    if (p->n_layers != m->n_layers || p->n_kv_heads != m->n_kv_heads ||
        p->head_dim != m->head_dim)
        return kvr_error_set(err, KVR_ESHAPE,
                             "shape %ux%ux%u (layers x kv_heads x head_dim) does not "
                             "match model '%s' (%ux%ux%u)", p->n_layers, p->n_kv_heads,
                             p->head_dim, m->name, m->n_layers, m->n_kv_heads, m->head_dim);
    size_t psize = kvr_dtype_size(p->dtype);
    if (psize == 0)
        return kvr_error_set(err, KVR_ESHAPE, "unknown payload dtype %d", (int)p->dtype);
    if (p->mode != KVR_PUT_CREATE && p->mode != KVR_PUT_APPEND && p->mode != KVR_PUT_UPSERT)
        return kvr_error_set(err, KVR_EBADREQUEST, "unknown put mode %d", (int)p->mode);
    if (p->n_tokens == 0 || !p->tokens)
        return kvr_error_set(err, KVR_EBADREQUEST, "put of no tokens");
    if (p->n_tokens > KVR_MAX_PUT_TOKENS)
        return kvr_error_set(err, KVR_ETOOLARGE, "put of %zu tokens (limit %u)",
                             p->n_tokens, KVR_MAX_PUT_TOKENS);
    size_t n = p->n_tokens, payload, row = (size_t)m->n_kv_heads * m->head_dim;
    if (!mul_ok(&payload, row, psize) || !mul_ok(&payload, payload, n) ||
        !mul_ok(&payload, payload, 2u * (size_t)m->n_layers))
        return kvr_error_set(err, KVR_ETOOLARGE, "put payload size overflows");

    kvr_ctx *c = ctx_find(s, p->ctx_id);
    if (c && c->busy)
        return kvr_error_set(err, KVR_EBUSY, "context '%s' is being written", p->ctx_id);
    if (c && p->mode == KVR_PUT_CREATE)
        return kvr_error_set(err, KVR_EEXIST, "context '%s' already exists", p->ctx_id);
    if (!c && p->mode == KVR_PUT_APPEND)
        return kvr_error_set(err, KVR_ENOCTX, "no context '%s' to append to", p->ctx_id);
    if (c && c->model != m)
        return kvr_error_set(err, KVR_EFINGERPRINT,
                             "context '%s' belongs to model '%s', not '%s'", p->ctx_id,
                             c->model->name, m->name);

    /* Groups and the APE prefix record (layout.c). */
    layout_put lp;
    if ((rc = layout_put_begin(s, c, m, p, &lp, err)) != 0)
        return rc;

    /* Positions: explicit, or contiguous from pos_start / after the last. */
    int64_t first;
    if (p->positions) {
        first = p->positions[0];
    } else if (p->has_pos_start) {
        first = p->pos_start;
    } else if (lp.has_first) {
        first = lp.first;
    } else if (c && c->n_tokens) {
        if (__builtin_add_overflow(ctx_last_pos(c), 1, &first)) {
            layout_put_free(&lp);
            return kvr_error_set(err, KVR_EINVAL, "next position overflows int64");
        }
    } else {
        first = 0;
    }
    int64_t last;
    if (p->positions)
        last = p->positions[n - 1];
    else if (__builtin_add_overflow(first, (int64_t)(n - 1), &last)) {
        layout_put_free(&lp);
        return kvr_error_set(err, KVR_EINVAL,
                             "positions from %lld for %zu tokens overflow int64",
                             (long long)first, n);
    }

    kvr_put *t = kvr_mem_calloc(1, sizeof *t);
    if (!t) {
        layout_put_free(&lp);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory starting a put");
    }
    t->lp = lp;
    t->s = s;
    t->m = m;
    t->pdt = p->dtype;
    t->n = n;
    t->pin = p->pin;
    t->payload = payload;
    t->first_pos = first;
    t->last_pos = last;
    if (!c) {
        if (!(c = ctx_new(s, m, p->ctx_id))) {
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory creating '%s'", p->ctx_id);
            goto fail_txn;
        }
        t->created = true;
    }
    t->c = c;
    c->busy = true;

    /* Plan: tail slots of an exclusively owned last block, then new blocks. */
    kvr_block *tail = NULL;
    uint32_t tail_free = 0;
    if (c->n_ext) {
        kvr_extent *e = &c->ext[c->n_ext - 1];
        if (e->block->refcount == 1 && e->first + e->count == e->block->used &&
            e->block->used < e->block->cap && e->block->dtype == c->dtype) {
            tail = e->block;
            tail_free = tail->cap - tail->used;
            if (tail_free > n)
                tail_free = (uint32_t)n;
        }
    }
    size_t n_new = (n - tail_free + s->B - 1) / s->B;
    size_t bb = block_data_bytes(s, m, c->dtype);
    bool zero_copy = p->dtype == c->dtype;
    size_t n_runs = n_new + (tail ? 1 : 0);
    size_t n_iov = zero_copy ? 2u * m->n_layers * n_runs : 1;
    /* Reserve what the allocator will really hold (its size classes), not
     * what is requested: jemalloc rounds a 25 KiB block up to 28 KiB. */
    size_t need = n_new * (kvr_mem_size_class(bb) + kvr_mem_size_class(sizeof(kvr_block))) +
                  (zero_copy ? 0 : kvr_mem_size_class(payload)) +
                  n_iov * sizeof(struct iovec) + n * sizeof(uint32_t) +
                  n_runs * sizeof(put_run);
    if ((rc = store_reserve(s, need, err)) != 0)
        goto fail_ctx;

    t->runs = kvr_mem_calloc(n_runs, sizeof *t->runs);
    t->tokens = kvr_mem_malloc(n * sizeof *t->tokens);
    t->iov = kvr_mem_malloc(n_iov * sizeof *t->iov);
    if (!t->runs || !t->tokens || !t->iov) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory preparing a put of %zu tokens", n);
        goto fail_ctx;
    }
    memcpy(t->tokens, p->tokens, n * sizeof *t->tokens);
    size_t left = n;
    if (tail) {
        block_ref(tail);
        tail->holds++;
        t->tail = true;
        t->runs[0] = (put_run){ tail, tail->used, tail_free };
        t->n_runs = 1;
        left -= tail_free;
    }
    while (left) {
        kvr_block *b = block_new(s, m, c->dtype);
        if (!b) {
            rc = kvr_error_set(err, KVR_ENOMEM,
                               "out of memory allocating blocks for %zu tokens", n);
            goto fail_ctx;
        }
        uint32_t k = left < s->B ? (uint32_t)left : s->B;
        t->runs[t->n_runs++] = (put_run){ b, 0, k };
        left -= k;
    }
    /* Metadata into the (still invisible) slots. */
    size_t tok = 0;
    for (size_t r = 0; r < t->n_runs; r++) {
        put_run *run = &t->runs[r];
        for (uint32_t j = 0; j < run->count; j++, tok++) {
            run->b->tokens[run->first + j] = p->tokens[tok];
            run->b->stored_pos[run->first + j] =
                p->positions ? p->positions[tok] : first + (int64_t)tok;
            run->b->groups[run->first + j] = t->lp.group;
        }
    }
    if (zero_copy) {
        size_t rowb = row * psize, k = 0;
        for (uint32_t l = 0; l < m->n_layers; l++)
            for (int kv = 0; kv < 2; kv++)
                for (size_t r = 0; r < t->n_runs; r++)
                    t->iov[k++] = (struct iovec){
                        block_kv(t->runs[r].b, m, l, kv, t->runs[r].first),
                        t->runs[r].count * rowb };
        t->n_iov = k;
    } else {
        t->staging = kvr_mem_aligned(KVR_BLOCK_ALIGN, payload);
        if (!t->staging) {
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for a %zu-byte staging buffer",
                               payload);
            goto fail_ctx;
        }
        t->iov[0] = (struct iovec){ t->staging, payload };
        t->n_iov = 1;
    }
    *out = t;
    return 0;

fail_ctx:
    if (t->created)
        ctx_destroy(s, c);
    else
        c->busy = false;
fail_txn:
    txn_free(t);
    return rc;
}

size_t kvr_put_payload_size(const kvr_put *t)
{
    return t->payload;
}

void kvr_put_payload_iov(const kvr_put *t, const struct iovec **iov, size_t *n)
{
    *iov = t->iov;
    *n = t->n_iov;
}

bool kvr_put_needs_work(const kvr_put *t)
{
    return t->staging != NULL && !t->worked;
}

int kvr_put_work(kvr_put *t, kvr_error *err)
{
    (void)err;
    if (!t->staging || t->worked)
        return 0;
    const kvr_model *m = t->m;
    size_t row = (size_t)m->n_kv_heads * m->head_dim;
    const uint8_t *src = t->staging;
    size_t psize = kvr_dtype_size(t->pdt);
    for (uint32_t l = 0; l < m->n_layers; l++) {
        for (int kv = 0; kv < 2; kv++) {
            for (size_t r = 0; r < t->n_runs; r++) {
                const put_run *run = &t->runs[r];
                kvr_convert(block_kv(run->b, m, l, kv, run->first), run->b->dtype,
                            src, t->pdt, run->count * row);
                src += run->count * row * psize;
            }
        }
    }
    t->worked = true;
    return 0;
}

int kvr_put_commit(kvr_put *t, kvr_put_result *res, kvr_error *err)
{
    int rc;
    kvr_store *s = t->s;
    kvr_ctx *c = t->c;
    kvr_model *m = t->m;
    if (t->staging && !t->worked && (rc = kvr_put_work(t, err)) != 0)
        goto fail;
    if (ctx_ext_reserve(c, t->n_runs) != 0) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory committing a put to '%s'", c->id);
        goto fail;
    }
    /* Index first: it is the only step that can fail. */
    bool exact = c->n_exact == c->n_tokens;
    if (!c->idx_stale && (rc = ptree_append(&m->tree[1], c, t->tokens, t->n)) != 0) {
        kvr_error_set(err, rc, "out of memory indexing '%s'", c->id);
        goto fail;
    }
    if (exact && (rc = ptree_append(&m->tree[0], c, t->tokens, t->n)) != 0) {
        ptree_truncate(&m->tree[1], c, c->n_tokens);   /* no-op when stale */
        kvr_error_set(err, rc, "out of memory indexing '%s'", c->id);
        goto fail;
    }
    size_t first_index = c->n_tokens;
    for (size_t r = 0; r < t->n_runs; r++) {
        put_run *run = &t->runs[r];
        kvr_extent *last = c->n_ext ? &c->ext[c->n_ext - 1] : NULL;
        if (r == 0 && t->tail)
            run->b->holds--;
        if (last && last->block == run->b && last->first + last->count == run->first &&
            last->pos_delta == 0 && last->flags == 0) {
            last->count += run->count;
            block_unref(s, run->b);     /* the extent already holds one */
        } else {
            c->ext[c->n_ext++] = (kvr_extent){ run->b, run->first, run->count, 0, 0 };
        }
        run->b->used = run->first + run->count;
        run->b = NULL;                  /* the reference now belongs to c */
    }
    c->n_tokens += t->n;
    if (exact)
        c->n_exact = c->n_tokens;
    if (t->created) {
        c->pending = false;
        m->n_contexts++;
    }
    c->busy = false;
    /* Group cursor, created layout, retention (may drop tokens and move the
     * window's positions by `moved`). */
    int64_t moved = layout_put_commit(s, c, &t->lp, t->n);
    if (first_index + t->n > c->n_tokens)
        first_index = c->n_tokens > t->n ? c->n_tokens - t->n : 0;
    if (t->pin)
        c->pinned = true;
    lru_touch(s, c);
    s->n_puts++;
    if (res) {
        res->n_tokens = c->n_tokens;
        res->first_index = first_index;
        res->first_pos = t->first_pos + moved;
        res->last_pos = t->last_pos + moved;
    }
    t->tail = false;
    txn_free(t);
    return 0;

fail:
    kvr_put_abort(t);
    return rc;
}

void kvr_put_abort(kvr_put *t)
{
    if (!t)
        return;
    if (t->created)
        ctx_destroy(t->s, t->c);
    else
        t->c->busy = false;
    txn_free(t);
}
