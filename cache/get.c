/*
 * get.c — the get transaction: read a token range of a context, in any
 * dtype, at its logical positions or at requested ones, optionally a subset
 * of layers, or raw (quantized blocks as stored).
 *
 * A get is the read plan (read.h) over one range of one context: begin
 * (loop thread) checks the request, adds the extents overlapping the range
 * (copying the metadata and leasing the blocks), lets the disk tier reload
 * spilled ones and plans the staging of what cannot go out zero-copy
 * (reserved only once the caller says how the payload goes out: read.h);
 * from then on the
 * transaction reads only leased slots below each block's `used`, which
 * never change, so work may run on any thread while the store changes
 * around it (even deleting the context). Streaming responses work and send
 * the payload layer range by layer range.
 */
#include <string.h>

#include "cache/read.h"

struct kvr_get {
    kvr_read     r;
    kvr_get_info info;
};

static void get_free(kvr_get *t)
{
    kvr_read_free(&t->r);
    kvr_mem_free(t);
}

int kvr_store_get_begin(kvr_store *s, const kvr_get_params *p, kvr_get **out,
                        kvr_error *err)
{
    int rc;
    if (!p || !out)
        return kvr_error_set(err, KVR_EBADREQUEST, "get: missing parameters");
    kvr_ctx *c = NULL;
    if ((rc = kvr_store_ctx_live(s, p->ctx_id, &c, err)) != 0)
        return rc;
    kvr_model *m = c->model;
    size_t start = p->start, end = p->end == SIZE_MAX ? c->n_tokens : p->end;
    if (start > end || end > c->n_tokens)
        return kvr_error_set(err, KVR_ERANGE,
                             "token range [%zu, %zu) is outside context '%s' of %zu tokens",
                             p->start, end, c->id, c->n_tokens);
    size_t n = end - start;
    if (p->positions && p->n_positions && p->n_positions != n)
        return kvr_error_set(err, KVR_EINVAL, "%zu target positions for %zu tokens",
                             p->n_positions, n);
    size_t osize = kvr_dtype_size(p->dtype);
    if (!p->meta_only && osize == 0)
        return kvr_error_set(err, KVR_EINVAL, "unknown output dtype %d", (int)p->dtype);
    size_t nl;
    if ((rc = kvr_layers_check(m, p->layers, p->n_layers_sel, &nl, err)) != 0)
        return rc;

    kvr_get *t = kvr_mem_calloc(1, sizeof *t);
    if (!t)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory starting a get");
    kvr_read *r = &t->r;
    /* Upper bound on runs: extents overlapping the range. */
    if (kvr_read_init(r, s, m, p->layers, nl, n, c->n_ext, true, p->meta_only,
                      p->dtype) != 0) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for a get of %zu tokens", n);
        goto fail;
    }

    /* Walk the extents overlapping [start, end). */
    size_t k = 0;
    for (size_t i = 0; i < c->n_ext && k < end; i++) {
        const kvr_extent *e = &c->ext[i];
        size_t lo = k, hi = k + e->count;
        k = hi;
        if (hi <= start || start == end)
            continue;
        uint32_t a = (uint32_t)(lo < start ? start - lo : 0);
        uint32_t z = (uint32_t)((hi > end ? end : hi) - lo);
        if (!p->meta_only && (e->flags & KVR_TOKEN_PENDING)) {
            rc = kvr_error_set(err, KVR_EPENDING,
                               "tokens [%zu, %zu) of context '%s' have no KV yet (edited "
                               "without KV; refresh them first, or get meta_only)",
                               lo + a, lo + z, c->id);
            goto fail;
        }
        kvr_read_add(r, e, a, z, p->positions, NULL, false, false);
    }

    /* Disk tier: spilled blocks of the range get memory now (the leases
     * keep them) and are read by work, off the loop thread, with the rest
     * of the context as a bounded prefetch. */
    if ((rc = kvr_read_reload(r, c, err)) != 0)
        goto fail;
    /* Length-dependent RoPE: the context knows its length (read.c). */
    if (!p->raw)
        kvr_read_rope_lens(r, c, p->positions != NULL);
    kvr_get_info *info = &t->info;
    KVR_READ_INFO(info, r);
    info->start = start;
    info->groups = r->groups;
    memcpy(info->codec, c->codec.name, sizeof info->codec);

    r->dst = p->raw ? NULL : p->dst;   /* raw: the stored bytes, zero-copy */
    r->dst_cap = p->dst_cap;
    if (!p->meta_only && p->raw && n > 0) {
        if (!c->codec.quant) {
            rc = kvr_error_set(err, KVR_EUNSUPPORTED, "raw get of context '%s': its codec "
                               "%s is not quantized (get it in a dtype)", c->id,
                               c->codec.name);
            goto fail;
        }
        if ((rc = kvr_read_stage_raw(r, c->id, start, &info->k_bytes, &info->v_bytes,
                                     err)) != 0)
            goto fail;
        info->raw = true;
    } else if ((rc = kvr_read_stage(r, c, "get", err)) != 0) {
        goto fail;
    }
    kvr_store_touch(s, c);
    s->n_gets++;
    *out = t;
    return 0;

fail:
    get_free(t);
    return rc;
}

KVR_READ_TXN_API(kvr_get, kvr_get_info, kvr_get, "out of memory dequantizing")

int kvr_get_work_layers(kvr_get *t, size_t l0, size_t l1, kvr_error *err)
{
    size_t nl = t->info.n_layers;
    if (l0 > l1 || l1 > nl)
        return kvr_error_set(err, KVR_EINVAL, "layer range [%zu, %zu) of a %zu-layer get",
                             l0, l1, nl);
    return kvr_read_work(&t->r, l0, l1, "out of memory dequantizing", err);
}

int kvr_get_stage_ring(kvr_get *t, size_t per, size_t slots, kvr_error *err)
{
    return kvr_read_stage_ring(&t->r, per, slots, err);
}

int kvr_get_stage_pieces(kvr_get *t, size_t piece_bytes, size_t slots, size_t *n_pieces,
                         kvr_error *err)
{
    return kvr_read_stage_pieces(&t->r, piece_bytes, slots, n_pieces, err);
}

size_t kvr_get_staged_layer_bytes(const kvr_get *t)
{
    return t->r.stage_need && t->r.nl ? t->r.stage_need / t->r.nl : 0;
}

size_t kvr_get_n_pieces(const kvr_get *t)
{
    return t->r.n_pieces;
}

int kvr_get_work_piece(kvr_get *t, size_t k, kvr_error *err)
{
    return kvr_read_work_piece(&t->r, k, "out of memory dequantizing", err);
}

void kvr_get_payload_iov_piece(const kvr_get *t, size_t k, const struct iovec **iov,
                               size_t *n, size_t *bytes)
{
    kvr_read_iov_piece(&t->r, k, iov, n, bytes);
}

int kvr_get_copy_into(kvr_get *t, void *dst, size_t size, kvr_error *err)
{
    return kvr_read_work_into(&t->r, dst, size, "get", "out of memory dequantizing", err);
}

void kvr_get_payload_iov_layers(const kvr_get *t, size_t l0, size_t l1,
                                const struct iovec **iov, size_t *n)
{
    kvr_read_iov_layers(&t->r, l0, l1, iov, n);
}

void kvr_get_end(kvr_get *t)
{
    if (t)
        get_free(t);
}
