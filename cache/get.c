/*
 * get.c — the get transaction: read a token range of a context, in any
 * dtype, at its logical positions or at requested ones, optionally a subset
 * of layers.
 *
 * get_begin (loop thread) copies the metadata and leases the blocks; from
 * then on the transaction reads only leased slots below each block's `used`,
 * which never change, so get_work may run on any thread while the store
 * changes around it (even deleting the context).
 *
 * Payload: layer-major, for each selected layer K then V, [n][H][D] in the
 * output dtype. K is zero-copy (iovecs into block memory, one per
 * contiguous run) when every run is a plain block of the output dtype and
 * every target position equals the stored-at one; V is zero-copy run by run,
 * for each run in a plain block of the output dtype (so a quantized run, or
 * one in another dtype, does not cost the others their zero-copy). Everything
 * else is produced by get_work into a staging buffer: K with one
 * kvr_rope_reposition call per run (stored-at -> target, converting in the
 * same pass), V with kvr_convert (or dequantized).
 *
 *   staging, per selected layer:  [ K: n rows (if K is staged) | V rows of
 *   the staged runs only, in run order ]   (vst bytes of V per layer)
 */
#include <string.h>

#include "cache/parallel.h"
#include "cache/store_internal.h"

typedef struct get_seg {
    kvr_block *b;            /* leased */
    const kvr_block *rd;     /* what work and the iovecs read: b, or its
                                disk-tier reload view (tier.c) */
    uint32_t   first, count;
    size_t     tok;          /* index of its first token in the result */
    bool       same_pos;     /* targets equal stored-at for every token */
    bool       zc_v;         /* V goes out zero-copy from the block */
    size_t     v_off;        /* else: its V's offset in the layer's V staging */
} get_seg;

struct kvr_get {
    kvr_store    *s;
    kvr_model    *m;
    kvr_get_info  info;
    uint32_t     *layers, *tokens, *flags;
    int64_t      *targets, *from;
    int32_t      *groups;
    get_seg      *segs;
    size_t        n_segs;
    bool          zc_k, worked;
    size_t        vst;       /* bytes of staged V per layer (0: all zero-copy) */
    size_t        qscratch;  /* floats of scratch a layer needs (quantized segs) */
    uint8_t      *staging;
    size_t        part;      /* bytes of one layer's K (or V) */
    size_t        payload;
    struct iovec *iov;
    size_t        n_iov;
    tier_reload  *rl;        /* spilled blocks of the range, loaded by work */
    kvr_rope_opts ro;        /* dynamic NTK / longrope: the tables' lengths */
};

static void get_free(kvr_get *t)
{
    for (size_t i = 0; i < t->n_segs; i++) {
        kvr_block *b = t->segs[i].b;
        b->holds--;
        if (--b->leases == 0)
            t->s->n_leased_blocks--;
        block_unref(t->s, b);
    }
    /* After the leases: a block only the reload still references was
     * deleted meanwhile (its buffer is freed, not installed). */
    tier_reload_end(t->s, t->rl);
    kvr_mem_free(t->segs);
    kvr_mem_free(t->layers);
    kvr_mem_free(t->tokens);
    kvr_mem_free(t->flags);
    kvr_mem_free(t->targets);
    kvr_mem_free(t->from);
    kvr_mem_free(t->groups);
    kvr_mem_free(t->staging);
    kvr_mem_free(t->iov);
    kvr_mem_free(t);
}

/* Start in the staging buffer of layer li's K (kv 0) or staged V (kv 1). */
static uint8_t *stage_at(const kvr_get *t, size_t li, int kv)
{
    size_t kst = t->zc_k ? 0 : t->part;
    size_t off = li * (kst + t->vst);
    if (kv == 1)
        off += kst;
    return t->staging + off;
}

/* Raw get (docs/quantized.md): the encoded rows/tiles as stored, zero-copy.
 * Only quantized blocks; KIVI key tiles must line up with the range (every
 * segment starts on a tile boundary and all but the last hold whole tiles),
 * so token i of the range is row i % G of tile i / G. */
static int raw_begin(kvr_get *t, const kvr_ctx *c, size_t nl, kvr_error *err)
{
    const kvr_model *m = t->m;
    if (!c->codec.quant)
        return kvr_error_set(err, KVR_EUNSUPPORTED, "raw get of context '%s': its codec "
                             "%s is not quantized (get it in a dtype)", c->id,
                             c->codec.name);
    size_t kb = 0, vb = 0;
    for (size_t g = 0; g < t->n_segs; g++) {
        const get_seg *sg = &t->segs[g];
        if (!sg->rd->quant)
            return kvr_error_set(err, KVR_EUNSUPPORTED,
                                 "raw get of context '%s': tokens [%zu, %zu) are in the "
                                 "full-precision window (get them with raw = false)", c->id,
                                 t->info.start + sg->tok, t->info.start + sg->tok + sg->count);
        uint32_t G = QH(sg->rd)->ktile;
        if (sg->first % G || (g + 1 < t->n_segs && sg->count % G))
            return kvr_error_set(err, KVR_EUNSUPPORTED,
                                 "raw get of context '%s': tokens from %zu do not line up "
                                 "with its %u-token key tiles (edited or a partial range)",
                                 c->id, t->info.start + sg->tok, G);
        kb += G > 1 ? (sg->count + G - 1) / G * QH(sg->rd)->krow : sg->count * QH(sg->rd)->krow;
        vb += sg->count * QH(sg->rd)->vrow;
    }
    t->info.raw = true;
    t->info.k_bytes = kb;
    t->info.v_bytes = vb;
    t->payload = (kb + vb) * nl;
    t->iov = kvr_mem_malloc((2 * t->n_segs + 1) * nl * sizeof *t->iov);
    if (!t->iov)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory for a raw get");
    size_t v = 0;
    for (size_t li = 0; li < nl; li++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t g = 0; g < t->n_segs; g++) {
                const get_seg *sg = &t->segs[g];
                uint32_t G = QH(sg->rd)->ktile;
                size_t len = kv ? sg->count * QH(sg->rd)->vrow
                           : G > 1 ? (sg->count + G - 1) / G * QH(sg->rd)->krow
                                   : sg->count * QH(sg->rd)->krow;
                t->iov[v++] = (struct iovec){ block_kv(sg->rd, m, t->layers[li], kv, sg->first),
                                              len };
            }
    t->n_iov = v;
    return 0;
}

/* The sequence lengths of a context's RoPE tables (see get_begin):
 * requested targets -> max target + 1; else the context's logical length. */
static void ctx_rope_lens(const kvr_ctx *c, const int64_t *targets, size_t n, bool requested,
                          kvr_rope_opts *ro)
{
    int64_t smax = -1, lmax = -1;
    for (size_t i = 0; i < c->n_ext; i++) {
        const kvr_extent *e = &c->ext[i];
        for (uint32_t j = 0; j < e->count; j++) {
            int64_t sp = e->block->stored_pos[e->first + j], lp;
            if (sp > smax)
                smax = sp;
            if (!__builtin_add_overflow(sp, e->pos_delta, &lp) && lp > lmax)
                lmax = lp;
        }
    }
    int64_t tl = kvr_rope_default_seq_len(targets, n);
    ro->seq_len_from = smax + 1;
    ro->seq_len_to = requested || tl > lmax + 1 ? tl : lmax + 1;
}

int kvr_store_get_begin(kvr_store *s, const kvr_get_params *p, kvr_get **out,
                        kvr_error *err)
{
    int rc;
    if (!p || !out)
        return kvr_error_set(err, KVR_EBADREQUEST, "get: missing parameters");
    kvr_ctx *c = NULL;
    if ((rc = ctx_find_live(s, p->ctx_id, &c, err)) != 0)
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
    if (p->layers && p->n_layers_sel == 0)
        return kvr_error_set(err, KVR_EINVAL, "empty layer selection");
    size_t nl = p->layers ? p->n_layers_sel : m->n_layers;
    if (p->layers && (rc = layers_check(m, p->layers, nl, err)) != 0)
        return rc;

    kvr_get *t = kvr_mem_calloc(1, sizeof *t);
    if (!t)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory starting a get");
    t->s = s;
    t->m = m;
    size_t cnt = n ? n : 1;
    t->layers = kvr_mem_malloc(nl * sizeof *t->layers);
    t->tokens = kvr_mem_malloc(cnt * sizeof *t->tokens);
    t->flags = kvr_mem_malloc(cnt * sizeof *t->flags);
    t->targets = kvr_mem_malloc(cnt * sizeof *t->targets);
    t->from = kvr_mem_malloc(cnt * sizeof *t->from);
    t->groups = kvr_mem_malloc(cnt * sizeof *t->groups);
    /* Upper bound on segments: extents overlapping the range. */
    t->segs = kvr_mem_malloc((c->n_ext ? c->n_ext : 1) * sizeof *t->segs);
    if (!t->layers || !t->tokens || !t->flags || !t->targets || !t->from ||
        !t->groups || !t->segs) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for a get of %zu tokens", n);
        goto fail;
    }
    for (size_t i = 0; i < nl; i++)
        t->layers[i] = p->layers ? p->layers[i] : (uint32_t)i;

    /* Walk the extents overlapping [start, end). */
    size_t k = 0, tok = 0;
    bool all_same = true;
    for (size_t i = 0; i < c->n_ext && k < end; i++) {
        const kvr_extent *e = &c->ext[i];
        size_t lo = k, hi = k + e->count;
        k = hi;
        if (hi <= start)
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
        bool same = true;
        for (uint32_t j = a; j < z; j++, tok++) {
            uint32_t slot = e->first + j;
            int64_t sp = e->block->stored_pos[slot];
            t->tokens[tok] = e->block->tokens[slot];
            t->groups[tok] = e->block->groups[slot];
            t->flags[tok] = e->flags;
            t->from[tok] = sp;
            t->targets[tok] = p->positions ? p->positions[tok] : sp + e->pos_delta;
            if (t->targets[tok] != sp)
                same = false;
        }
        all_same = all_same && same;
        if (p->meta_only)
            continue;
        get_seg *prev = t->n_segs ? &t->segs[t->n_segs - 1] : NULL;
        if (prev && prev->b == e->block && prev->first + prev->count == e->first + a) {
            prev->count += z - a;
            prev->same_pos = prev->same_pos && same;
            continue;
        }
        get_seg *g = &t->segs[t->n_segs++];
        *g = (get_seg){ .b = e->block, .first = e->first + a, .count = z - a,
                        .tok = tok - (z - a), .same_pos = same };
        g->rd = g->b;
        block_ref(g->b);
        g->b->holds++;
        if (g->b->leases++ == 0)
            s->n_leased_blocks++;
    }

    /* Disk tier: spilled blocks of the range get memory now (the leases
     * keep them) and are read by work, off the loop thread, with the rest
     * of the context as a bounded prefetch (tier.c). Everything below
     * reads a spilled block through its reload view. */
    if (s->tier && !p->meta_only && t->n_segs) {
        kvr_block **bs = kvr_mem_malloc(t->n_segs * sizeof *bs);
        if (!bs) {
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for a get of %zu tokens", n);
            goto fail;
        }
        for (size_t g = 0; g < t->n_segs; g++)
            bs[g] = t->segs[g].b;
        rc = tier_reload_begin(s, bs, t->n_segs, c, &t->rl, err);
        kvr_mem_free(bs);
        if (rc != 0)
            goto fail;
        for (size_t g = 0; g < t->n_segs; g++)
            t->segs[g].rd = tier_reload_view(t->rl, t->segs[g].b);
    }

    for (size_t g = 0; g < t->n_segs; g++)
        if (t->segs[g].rd->quant) {
            size_t need = (t->segs[g].count + QH(t->segs[g].rd)->ktile) *
                          (size_t)m->n_kv_heads * m->head_dim;
            if (need > t->qscratch)
                t->qscratch = need;
        }
    /* Dynamic NTK / longrope: the frequencies depend on the sequence length,
     * so the context knows its length. Its keys are taken as rotated with the
     * table of the positions they are stored at (max stored-at + 1, what
     * transformers uses for a forward over them), and they are read with the
     * table of the requested targets (max + 1), or of the context's logical
     * length when none are requested. Where the two tables differ, every key
     * is re-rotated (removed with the old table, applied with the new), moved
     * or not. */
    if (!p->meta_only && !p->raw && !kvr_rope_config_composes(&m->rope_cfg)) {
        ctx_rope_lens(c, t->targets, n, p->positions != NULL, &t->ro);
        if (!kvr_rope_same_table(m->engine, t->ro.seq_len_from, t->ro.seq_len_to)) {
            all_same = false;
            for (size_t g = 0; g < t->n_segs; g++)
                t->segs[g].same_pos = false;
        }
    }
    kvr_get_info *info = &t->info;
    model_fill_info(m, &info->model);
    info->start = start;
    info->n_tokens = n;
    info->dtype = p->dtype;
    info->n_layers = p->meta_only ? 0 : nl;
    info->layers = t->layers;
    info->tokens = t->tokens;
    info->positions = t->targets;
    info->flags = t->flags;
    info->groups = t->groups;
    memcpy(info->codec, c->codec.name, sizeof info->codec);

    if (!p->meta_only && p->raw && n > 0) {
        rc = raw_begin(t, c, nl, err);
        if (rc != 0)
            goto fail;
        lru_touch(s, c);
        s->n_gets++;
        *out = t;
        return 0;
    }

    if (!p->meta_only && n > 0) {
        size_t row = (size_t)m->n_kv_heads * m->head_dim;
        t->part = n * row * osize;
        t->payload = t->part * 2u * nl;
        size_t rowb = row * osize;
        bool all_zc = true;
        t->vst = 0;
        for (size_t g = 0; g < t->n_segs; g++) {
            get_seg *sg = &t->segs[g];
            sg->zc_v = sg->rd->dtype == p->dtype && !sg->rd->quant;
            all_zc = all_zc && sg->zc_v;
            if (!sg->zc_v) {
                sg->v_off = t->vst;
                t->vst += sg->count * rowb;
            }
        }
        t->zc_k = all_zc && all_same;
        size_t per_layer = (t->zc_k ? t->n_segs : 1) + t->n_segs;
        t->iov = kvr_mem_malloc(per_layer * nl * sizeof *t->iov);
        if (!t->iov) {
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for a get of %zu tokens", n);
            goto fail;
        }
        size_t stage = ((t->zc_k ? 0 : t->part) + t->vst) * nl;
        if (stage) {
            /* Eviction must not take the context being read from under us. */
            bool was_busy = c->busy;
            c->busy = true;
            rc = store_reserve_request(s, stage, "get", err);
            c->busy = was_busy;
            if (rc != 0)
                goto fail;
            t->staging = kvr_mem_aligned(KVR_BLOCK_ALIGN, stage);
            if (!t->staging) {
                rc = kvr_error_set(err, KVR_ENOMEM,
                                   "out of memory for a %zu-byte get buffer", stage);
                goto fail;
            }
        }
        size_t v = 0;
        for (size_t li = 0; li < nl; li++) {
            if (!t->zc_k) {
                t->iov[v++] = (struct iovec){ stage_at(t, li, 0), t->part };
            } else {
                for (size_t g = 0; g < t->n_segs; g++)
                    t->iov[v++] = (struct iovec){
                        block_kv(t->segs[g].rd, m, t->layers[li], 0, t->segs[g].first),
                        t->segs[g].count * rowb };
            }
            /* V: block memory for zero-copy runs; staged runs are laid out
             * back to back, so consecutive ones share one iovec. */
            for (size_t g = 0; g < t->n_segs; g++) {
                const get_seg *sg = &t->segs[g];
                size_t len = sg->count * rowb;
                if (sg->zc_v) {
                    t->iov[v++] = (struct iovec){
                        block_kv(sg->rd, m, t->layers[li], 1, sg->first), len };
                } else if (g > 0 && !t->segs[g - 1].zc_v) {
                    t->iov[v - 1].iov_len += len;
                } else {
                    t->iov[v++] = (struct iovec){ stage_at(t, li, 1) + sg->v_off, len };
                }
            }
        }
        t->n_iov = v;
    }
    lru_touch(s, c);
    s->n_gets++;
    *out = t;
    return 0;

fail:
    get_free(t);
    return rc;
}

const kvr_get_info *kvr_get_get_info(const kvr_get *t)
{
    return &t->info;
}

bool kvr_get_needs_work(const kvr_get *t)
{
    return (t->staging != NULL || tier_reload_pending(t->rl)) && !t->worked;
}

/* Disk tier: reads the spilled blocks of the range (one batched load, any
 * thread; idempotent). Every work entry point calls it first. */
static int get_load(kvr_get *t, kvr_error *err)
{
    return t->rl ? tier_reload_work(t->rl, err) : 0;
}

/* One layer of the response: keys re-rotated (or converted) into the staging
 * buffer, values converted unless they go out zero-copy. Layers touch
 * disjoint parts of the staging buffer, so they run on any thread. */
static int get_work_layer(void *ud, size_t li)
{
    kvr_get *t = ud;
    const kvr_model *m = t->m;
    size_t row = (size_t)m->n_kv_heads * m->head_dim;
    size_t rowb = row * kvr_dtype_size(t->info.dtype);
    kvr_dtype odt = t->info.dtype;
    uint32_t l = t->layers[li];
    float *scratch = NULL;
    if (t->qscratch && !(scratch = kvr_mem_malloc(t->qscratch * sizeof *scratch)))
        return KVR_ENOMEM;
    /* block_read_side serves every kind of block: plain keys re-rotated from
     * stored-at (or converted where the positions agree), quantized pre-RoPE
     * keys dequantized and rotated to their targets, values converted or
     * dequantized. A quantized segment never goes out zero-copy. */
    for (size_t g = 0; g < t->n_segs; g++) {
        const get_seg *sg = &t->segs[g];
        int rc = 0;
        if (!t->zc_k)
            rc = block_read_side(m, sg->rd, l, 0, sg->first, sg->count,
                                 stage_at(t, li, 0) + sg->tok * rowb, odt,
                                 sg->same_pos ? NULL : t->from + sg->tok,
                                 t->targets + sg->tok, scratch, &t->ro);
        if (rc == 0 && !sg->zc_v)
            rc = block_read_side(m, sg->rd, l, 1, sg->first, sg->count,
                                 stage_at(t, li, 1) + sg->v_off, odt, NULL, NULL, scratch,
                                 NULL);
        if (rc != 0) {
            kvr_mem_free(scratch);
            return rc;
        }
    }
    kvr_mem_free(scratch);
    return 0;
}

int kvr_get_work(kvr_get *t, kvr_error *err)
{
    if (t->worked)
        return 0;
    int rc = get_load(t, err);
    if (rc != 0)
        return rc;
    if (!t->staging) {
        t->worked = true;
        return 0;
    }
    /* Large responses split their layers across threads: re-rotation is
     * compute-bound enough that one core cannot keep up with the socket. */
    rc = par_for(t->info.n_layers, par_threads_for(t->payload), get_work_layer, t);
    if (rc == KVR_ENOMEM)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory dequantizing");
    if (rc != 0)
        return kvr_error_set(err, KVR_EINTERNAL, "re-rotating keys failed (%d)", rc);
    t->worked = true;
    return 0;
}

size_t kvr_get_payload_size(const kvr_get *t)
{
    return t->payload;
}

void kvr_get_payload_iov(const kvr_get *t, const struct iovec **iov, size_t *n)
{
    *iov = t->iov;
    *n = t->n_iov;
}

/* ---- layer ranges (streaming) ------------------------------------------- */

typedef struct get_range {
    kvr_get *t;
    size_t   l0;
} get_range;

static int get_work_layer_in(void *ud, size_t i)
{
    const get_range *r = ud;
    return get_work_layer(r->t, r->l0 + i);
}

int kvr_get_work_layers(kvr_get *t, size_t l0, size_t l1, kvr_error *err)
{
    size_t nl = t->info.n_layers;
    if (l0 > l1 || l1 > nl)
        return kvr_error_set(err, KVR_EINVAL, "layer range [%zu, %zu) of a %zu-layer get",
                             l0, l1, nl);
    if (t->worked)
        return 0;
    int rc = get_load(t, err);
    if (rc != 0)
        return rc;
    if (!t->staging || l0 == l1)
        return 0;
    get_range r = { t, l0 };
    rc = par_for(l1 - l0, par_threads_for(t->payload / nl * (l1 - l0)), get_work_layer_in, &r);
    if (rc == KVR_ENOMEM)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory dequantizing");
    if (rc != 0)
        return kvr_error_set(err, KVR_EINTERNAL, "re-rotating keys failed (%d)", rc);
    return 0;
}

/* No iovec of a get spans two layers, and every layer has the same number
 * of them (one layout per segment); the walk is the fallback should that
 * ever change. */
static size_t get_iov_at(const kvr_get *t, size_t li)
{
    size_t nl = t->info.n_layers, per = t->payload / nl;
    if (li == 0)
        return 0;
    if (li >= nl)
        return t->n_iov;
    if (t->n_iov % nl == 0) {
        size_t k = t->n_iov / nl, sum = 0;
        for (size_t i = 0; i < k; i++)
            sum += t->iov[i].iov_len;
        if (sum == per)
            return li * k;
    }
    size_t want = li * per, have = 0, i = 0;
    while (i < t->n_iov && have < want)
        have += t->iov[i++].iov_len;
    return i;
}

void kvr_get_payload_iov_layers(const kvr_get *t, size_t l0, size_t l1,
                                const struct iovec **iov, size_t *n)
{
    size_t nl = t->info.n_layers;
    *iov = t->iov;
    *n = 0;
    if (!t->iov || nl == 0 || l0 >= l1 || l1 > nl)
        return;
    size_t a = get_iov_at(t, l0), b = get_iov_at(t, l1);
    *iov = t->iov + a;
    *n = b - a;
}

void kvr_get_end(kvr_get *t)
{
    if (t)
        get_free(t);
}
