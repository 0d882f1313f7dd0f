/*
 * assemble.c — the assemble transaction (APE): one prefix context plus an
 * ordered list of document contexts, laid out in parallel, sequentially or
 * at explicit starts, returned as one KV stream with a segment table.
 *
 * assemble_begin (loop thread) checks every document's APE record against
 * the prefix as it is now, computes the layout, copies the metadata and
 * leases the blocks; from then on the transaction reads only leased slots
 * below each block's `used`, which never change, so assemble_work may run
 * on any thread while the store changes around it.
 *
 * Payload: layer-major, for each selected layer K then V of every stream
 * token (prefix tokens, then each document's), [n][H][D] in the output
 * dtype. Per run (a contiguous slot range of one block): K is zero-copy
 * when the dtype matches, every target position equals the stored-at one
 * and no temperature is folded in; otherwise work writes it into a staging
 * buffer with one kvr_rope_reposition call per run (stored-at -> layout
 * position, converting in the same pass) and, for documents with
 * fold_temperature, multiplies it by 1/T in f32 before the final rounding.
 * V is zero-copy when the dtype matches, else converted.
 *
 * Flags: a document token is KVR_TOKEN_APPROX when it keeps the flag from
 * its context, or when the layout moves it away from its logical position
 * (its KV was computed at another place relative to the prefix: sequential
 * documents after the first, explicit starts other than P).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/parallel.h"
#include "cache/store_internal.h"

typedef struct asm_run {
    kvr_block *b;            /* leased */
    const kvr_block *rd;     /* what work and the iovecs read: b, or its
                                disk-tier reload view (tier.c) */
    uint32_t   first, count;
    size_t     tok;          /* index of its first token in the stream */
    bool       same;         /* targets equal stored-at for every token */
    bool       fold;         /* document keys to be divided by T */
    bool       k_zc;
    size_t     kst_off;      /* offset in one layer's K staging (if !k_zc) */
} asm_run;

struct kvr_assemble {
    kvr_store         *s;
    kvr_model         *m;
    kvr_assemble_info  info;
    uint32_t          *layers, *tokens, *flags;
    int64_t           *targets, *from;
    kvr_segment       *segs;
    asm_run           *runs;
    size_t             n_runs, max_run;
    bool               zc_v, worked;
    size_t             kst, vst;     /* staging bytes per layer: K runs, V */
    uint8_t           *staging;
    size_t             payload;
    struct iovec      *iov;
    size_t             n_iov;
    tier_reload       *rl;           /* spilled blocks, loaded by work */
};

static void asm_free(kvr_assemble *t)
{
    for (size_t i = 0; i < t->n_runs; i++) {
        kvr_block *b = t->runs[i].b;
        b->holds--;
        if (--b->leases == 0)
            t->s->n_leased_blocks--;
        block_unref(t->s, b);
    }
    tier_reload_end(t->s, t->rl);     /* after the leases (see get.c) */
    kvr_mem_free(t->runs);
    kvr_mem_free(t->layers);
    kvr_mem_free(t->tokens);
    kvr_mem_free(t->flags);
    kvr_mem_free(t->targets);
    kvr_mem_free(t->from);
    kvr_mem_free(t->segs);
    kvr_mem_free(t->staging);
    kvr_mem_free(t->iov);
    kvr_mem_free(t);
}

/* Checks that document d was encoded against prefix pc as it is now. */
static int check_doc(const kvr_ctx *pc, uint64_t phash, const kvr_ctx *d, size_t i,
                     kvr_error *err)
{
    const char *pid;
    uint64_t fp, hash;
    size_t len;
    if (d->model != pc->model)
        return kvr_error_set(err, KVR_EFINGERPRINT,
                             "document %zu '%s' belongs to model '%s', the prefix '%s' "
                             "to '%s'", i, d->id, d->model->name, pc->id, pc->model->name);
    if (!layout_ape_record(d, &pid, &fp, &len, &hash))
        return kvr_error_set(err, KVR_EPREFIX,
                             "document %zu '%s' was not encoded against a prefix (create "
                             "it with prefix_ctx '%s')", i, d->id, pc->id);
    if (strcmp(pid, pc->id) != 0)
        return kvr_error_set(err, KVR_EPREFIX,
                             "document %zu '%s' was encoded against prefix '%s', not '%s'",
                             i, d->id, pid, pc->id);
    if (fp != pc->model->fingerprint)
        return kvr_error_set(err, KVR_EFINGERPRINT,
                             "document %zu '%s' was encoded with model fingerprint "
                             "%016llx, the prefix's model has %016llx", i, d->id,
                             (unsigned long long)fp,
                             (unsigned long long)pc->model->fingerprint);
    if (len != pc->n_tokens || hash != phash)
        return kvr_error_set(err, KVR_EPREFIX,
                             "prefix '%s' changed since document %zu '%s' was encoded "
                             "after it (%zu tokens then, %zu now%s): re-encode the "
                             "document", pc->id, i, d->id, len, pc->n_tokens,
                             len == pc->n_tokens ? ", token ids differ" : "");
    return 0;
}

static bool bad_factor(double x)
{
    return !(x > 0.0) || !isfinite(x) || x > 1e6 || x < 1e-6;
}

static int cmp_ptr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)*(const kvr_ctx *const *)a;
    uintptr_t y = (uintptr_t)*(const kvr_ctx *const *)b;
    return x < y ? -1 : x > y;
}

/* A document may appear once: the same one many times would stage (and
 * evict for) its KV as often, for a stream no model needs. Unknown ids are
 * left to the caller's lookup. */
static int docs_unique(const kvr_store *s, const kvr_assemble_params *p, kvr_error *err)
{
    if (p->n_docs < 2)
        return 0;
    const kvr_ctx **v = kvr_mem_malloc(p->n_docs * sizeof *v);
    if (!v)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory checking the documents");
    size_t n = 0;
    for (size_t i = 0; i < p->n_docs; i++) {
        const kvr_ctx *d = ctx_find(s, p->docs[i]);
        if (d)
            v[n++] = d;
    }
    qsort(v, n, sizeof *v, cmp_ptr);
    int rc = 0;
    for (size_t i = 1; i < n && rc == 0; i++)
        if (v[i] == v[i - 1])
            rc = kvr_error_set(err, KVR_EINVAL, "document '%s' is listed twice", v[i]->id);
    kvr_mem_free(v);
    return rc;
}

int kvr_store_assemble_begin(kvr_store *s, const kvr_assemble_params *p,
                             kvr_assemble **out, kvr_error *err)
{
    int rc;
    if (!p || !out)
        return kvr_error_set(err, KVR_EBADREQUEST, "assemble: missing parameters");
    if (p->n_docs == 0 || !p->docs)
        return kvr_error_set(err, KVR_EBADREQUEST, "assemble: no documents");
    if (p->n_docs > KVR_ASSEMBLE_MAX_DOCS)
        return kvr_error_set(err, KVR_ELIMIT, "assemble of %zu documents (limit %d)",
                             p->n_docs, KVR_ASSEMBLE_MAX_DOCS);
    if (p->layout != KVR_LAYOUT_PARALLEL && p->layout != KVR_LAYOUT_SEQUENTIAL &&
        p->layout != KVR_LAYOUT_EXPLICIT)
        return kvr_error_set(err, KVR_EBADREQUEST, "unknown layout %d", (int)p->layout);
    if (p->layout == KVR_LAYOUT_EXPLICIT && !p->starts)
        return kvr_error_set(err, KVR_EBADREQUEST,
                             "explicit layout needs one start position per document");
    double T = p->temperature == 0.0 ? KVR_APE_TEMPERATURE : p->temperature;
    double S = p->scale == 0.0 ? KVR_APE_SCALE : p->scale;
    if (bad_factor(T) || bad_factor(S))
        return kvr_error_set(err, KVR_EINVAL,
                             "APE temperature %g and scale %g must be finite, in [1e-6, 1e6]",
                             T, S);
    size_t osize = kvr_dtype_size(p->dtype);
    if (!p->meta_only && osize == 0)
        return kvr_error_set(err, KVR_EINVAL, "unknown output dtype %d", (int)p->dtype);

    kvr_ctx *pc = NULL;
    if ((rc = ctx_find_live(s, p->prefix, &pc, err)) != 0)
        return kvr_error_set(err, rc, "prefix context '%s' not found",
                             p->prefix ? p->prefix : "");
    kvr_model *m = pc->model;
    if (p->layers && p->n_layers_sel == 0)
        return kvr_error_set(err, KVR_EINVAL, "empty layer selection");
    size_t nl = p->layers ? p->n_layers_sel : m->n_layers;
    if (p->layers && (rc = layers_check(m, p->layers, nl, err)) != 0)
        return rc;
    if ((rc = docs_unique(s, p, err)) != 0)
        return rc;
    uint64_t phash;
    if ((rc = layout_ctx_hash(pc, &phash, err)) != 0)
        return rc;

    /* Resolve and check the documents, and lay them out. */
    size_t P = pc->n_tokens, N = P, n_ext = pc->n_ext;
    int64_t qpos = (int64_t)P, cur = (int64_t)P;
    for (size_t i = 0; i < p->n_docs; i++) {
        kvr_ctx *d = NULL;
        if ((rc = ctx_find_live(s, p->docs[i], &d, err)) != 0)
            return kvr_error_set(err, rc, "document %zu '%s' not found", i,
                                 p->docs[i] ? p->docs[i] : "");
        if ((rc = check_doc(pc, phash, d, i, err)) != 0)
            return rc;
        if (__builtin_add_overflow(N, d->n_tokens, &N) ||
            __builtin_add_overflow(n_ext, d->n_ext, &n_ext))
            return kvr_error_set(err, KVR_ETOOLARGE, "assemble size overflows");
        int64_t start = p->layout == KVR_LAYOUT_PARALLEL ? (int64_t)P :
                        p->layout == KVR_LAYOUT_SEQUENTIAL ? cur : p->starts[i];
        int64_t end;
        if (start < 0 || __builtin_add_overflow(start, (int64_t)d->n_tokens, &end))
            return kvr_error_set(err, KVR_EINVAL,
                                 "document %zu '%s': start %lld for %zu tokens is negative "
                                 "or overflows int64", i, d->id, (long long)start,
                                 d->n_tokens);
        cur = end;
        if (end > qpos)
            qpos = end;
    }
    if (N > (size_t)1 << 32)
        return kvr_error_set(err, KVR_ETOOLARGE, "assemble of %zu tokens", N);

    kvr_assemble *t = kvr_mem_calloc(1, sizeof *t);
    if (!t)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory starting an assemble");
    t->s = s;
    t->m = m;
    size_t cnt = N ? N : 1;
    size_t n_segs = p->n_docs + 2;
    t->layers = kvr_mem_malloc(nl * sizeof *t->layers);
    t->tokens = kvr_mem_malloc(cnt * sizeof *t->tokens);
    t->flags = kvr_mem_malloc(cnt * sizeof *t->flags);
    t->targets = kvr_mem_malloc(cnt * sizeof *t->targets);
    t->from = kvr_mem_malloc(cnt * sizeof *t->from);
    t->segs = kvr_mem_calloc(n_segs, sizeof *t->segs);
    t->runs = kvr_mem_malloc((n_ext ? n_ext : 1) * sizeof *t->runs);
    if (!t->layers || !t->tokens || !t->flags || !t->targets || !t->from || !t->segs ||
        !t->runs) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for an assemble of %zu tokens", N);
        goto fail;
    }
    for (size_t i = 0; i < nl; i++)
        t->layers[i] = p->layers ? p->layers[i] : (uint32_t)i;

    /* Walk the prefix then every document, extent by extent. */
    size_t tok = 0;
    bool all_same = true;
    cur = (int64_t)P;
    for (size_t src = 0; src <= p->n_docs; src++) {
        const kvr_ctx *c = src == 0 ? pc : ctx_find(s, p->docs[src - 1]);
        bool doc = src > 0;
        int64_t start = !doc ? 0 : p->layout == KVR_LAYOUT_PARALLEL ? (int64_t)P :
                        p->layout == KVR_LAYOUT_SEQUENTIAL ? cur : p->starts[src - 1];
        cur = start + (int64_t)c->n_tokens;
        kvr_segment *sg = &t->segs[src];
        sg->kind = doc ? KVR_SEGMENT_DOCUMENT : KVR_SEGMENT_PREFIX;
        sg->start = tok;
        sg->n_tokens = c->n_tokens;
        sg->pos_first = start;
        sg->pos_last = start + (int64_t)c->n_tokens - 1;
        sg->doc_index = doc ? (uint32_t)(src - 1) : 0;
        memcpy(sg->ctx_id, c->id, c->id_len + 1);
        sg->temperature = doc ? T : 1.0;
        sg->scale = doc ? S : 1.0;
        bool fold = doc && p->fold_temperature;
        int64_t target = start;
        for (size_t i = 0; i < c->n_ext; i++) {
            const kvr_extent *e = &c->ext[i];
            if (!p->meta_only && (e->flags & KVR_TOKEN_PENDING)) {
                rc = kvr_error_set(err, KVR_EPENDING,
                                   "%s '%s' has tokens without KV (edited without KV; "
                                   "refresh them first)", doc ? "document" : "prefix",
                                   c->id);
                goto fail;
            }
            bool same = true;
            size_t tok0 = tok;
            for (uint32_t j = 0; j < e->count; j++, tok++, target++) {
                uint32_t slot = e->first + j;
                int64_t sp = e->block->stored_pos[slot];
                t->tokens[tok] = e->block->tokens[slot];
                t->from[tok] = sp;
                t->targets[tok] = target;
                t->flags[tok] = e->flags;
                if (doc && target != sp + e->pos_delta)
                    t->flags[tok] |= KVR_TOKEN_APPROX;
                if (target != sp)
                    same = false;
            }
            all_same = all_same && same;
            if (p->meta_only)
                continue;
            asm_run *prev = t->n_runs ? &t->runs[t->n_runs - 1] : NULL;
            if (prev && prev->b == e->block && prev->first + prev->count == e->first &&
                prev->fold == fold && prev->tok + prev->count == tok0) {
                prev->count += e->count;
                prev->same = prev->same && same;
                continue;
            }
            asm_run *r = &t->runs[t->n_runs++];
            *r = (asm_run){ .b = e->block, .first = e->first, .count = e->count,
                            .tok = tok0, .same = same, .fold = fold };
            r->rd = r->b;
            block_ref(r->b);
            r->b->holds++;
            if (r->b->leases++ == 0)
                s->n_leased_blocks++;
        }
    }
    kvr_segment *q = &t->segs[p->n_docs + 1];
    q->kind = KVR_SEGMENT_QUERY;
    q->start = N;
    q->pos_first = qpos;
    q->pos_last = qpos - 1;
    q->temperature = q->scale = 1.0;

    if (!p->meta_only && !all_same && !kvr_rope_config_composes(&m->rope_cfg)) {
        rc = kvr_error_set(err, KVR_EUNSUPPORTED,
                           "model '%s' uses length-dependent RoPE scaling (dynamic NTK / "
                           "longrope): assemble cannot move its documents' keys (each "
                           "context has its own table length); get each context at the "
                           "positions wanted instead", m->name);
        goto fail;
    }

    kvr_assemble_info *info = &t->info;
    model_fill_info(m, &info->model);
    info->layout = p->layout;
    info->n_tokens = N;
    info->dtype = p->dtype;
    info->n_layers = p->meta_only ? 0 : nl;
    info->layers = t->layers;
    info->tokens = t->tokens;
    info->positions = t->targets;
    info->flags = t->flags;
    info->segments = t->segs;
    info->n_segments = n_segs;
    info->query_pos = qpos;
    info->temperature = T;
    info->scale = S;
    info->temperature_folded = p->fold_temperature;
    info->prefix_len = P;

    /* Touch the contexts now: nothing below looks at them again, so the
     * eviction store_reserve may do cannot pull them from under us (the
     * leases keep their blocks). */
    lru_touch(s, pc);
    for (size_t i = 0; i < p->n_docs; i++)
        lru_touch(s, ctx_find(s, p->docs[i]));

    /* Disk tier: spilled blocks get memory now (the leases keep them) and
     * are read by work, off the loop thread (tier.c); everything below
     * reads a spilled block through its reload view. */
    if (s->tier && !p->meta_only && t->n_runs) {
        kvr_block **bs = kvr_mem_malloc(t->n_runs * sizeof *bs);
        if (!bs) {
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory assembling");
            goto fail;
        }
        for (size_t i = 0; i < t->n_runs; i++)
            bs[i] = t->runs[i].b;
        rc = tier_reload_begin(s, bs, t->n_runs, NULL, &t->rl, err);
        kvr_mem_free(bs);
        if (rc != 0)
            goto fail;
        for (size_t i = 0; i < t->n_runs; i++)
            t->runs[i].rd = tier_reload_view(t->rl, t->runs[i].b);
    }

    if (!p->meta_only && N > 0) {
        size_t row = (size_t)m->n_kv_heads * m->head_dim, rowb = row * osize;
        t->zc_v = true;
        for (size_t i = 0; i < t->n_runs; i++) {
            asm_run *r = &t->runs[i];
            if (r->rd->dtype != p->dtype || r->rd->quant)
                t->zc_v = false;
            r->k_zc = r->rd->dtype == p->dtype && r->same && !r->fold && !r->rd->quant;
            if (!r->k_zc) {
                r->kst_off = t->kst;
                t->kst += r->count * rowb;
            }
            size_t span = r->count + (r->rd->quant ? QH(r->rd)->ktile : 0);
            if (span > t->max_run)
                t->max_run = span;
        }
        t->vst = t->zc_v ? 0 : N * rowb;
        t->payload = N * rowb * 2u * nl;
        size_t per_layer = 2 * t->n_runs;
        t->iov = kvr_mem_malloc(per_layer * nl * sizeof *t->iov);
        if (!t->iov) {
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for an assemble of %zu "
                               "tokens", N);
            goto fail;
        }
        size_t stage = (t->kst + t->vst) * nl;
        if (stage) {
            if ((rc = store_reserve_request(s, stage, "assemble", err)) != 0)
                goto fail;
            t->staging = kvr_mem_aligned(KVR_BLOCK_ALIGN, stage);
            if (!t->staging) {
                rc = kvr_error_set(err, KVR_ENOMEM,
                                   "out of memory for a %zu-byte assemble buffer", stage);
                goto fail;
            }
        }
        size_t v = 0;
        for (size_t li = 0; li < nl; li++) {
            uint8_t *base = t->staging ? t->staging + li * (t->kst + t->vst) : NULL;
            for (size_t i = 0; i < t->n_runs; i++) {
                const asm_run *r = &t->runs[i];
                uint8_t *ptr = r->k_zc ? block_kv(r->rd, m, t->layers[li], 0, r->first)
                                       : base + r->kst_off;
                size_t len = r->count * rowb;
                if (v && (uint8_t *)t->iov[v - 1].iov_base + t->iov[v - 1].iov_len == ptr)
                    t->iov[v - 1].iov_len += len;
                else
                    t->iov[v++] = (struct iovec){ ptr, len };
            }
            if (!t->zc_v) {
                t->iov[v++] = (struct iovec){ base + t->kst, t->vst };
                continue;
            }
            for (size_t i = 0; i < t->n_runs; i++) {
                const asm_run *r = &t->runs[i];
                t->iov[v++] = (struct iovec){ block_kv(r->rd, m, t->layers[li], 1, r->first),
                                              r->count * rowb };
            }
        }
        t->n_iov = v;
    }
    s->n_gets++;
    *out = t;
    return 0;

fail:
    asm_free(t);
    return rc;
}

const kvr_assemble_info *kvr_assemble_get_info(const kvr_assemble *t)
{
    return &t->info;
}

bool kvr_assemble_needs_work(const kvr_assemble *t)
{
    return (t->staging != NULL || tier_reload_pending(t->rl)) && !t->worked;
}

/* One layer of the assembled stream (any thread; layers write disjoint parts
 * of the staging buffer). Folding the temperature into a non-f32 output goes
 * through a per-call f32 scratch so k / T is rounded once. */
static int assemble_work_layer(void *ud, size_t li)
{
    kvr_assemble *t = ud;
    const kvr_model *m = t->m;
    size_t row = (size_t)m->n_kv_heads * m->head_dim;
    kvr_dtype odt = t->info.dtype;
    size_t rowb = row * kvr_dtype_size(odt);
    float inv_t = (float)(1.0 / t->info.temperature);
    float *scratch = NULL;
    int rc = 0;
    uint32_t l = t->layers[li];
    uint8_t *base = t->staging + li * (t->kst + t->vst);
    for (size_t i = 0; i < t->n_runs && rc == 0; i++) {
        const asm_run *r = &t->runs[i];
        if (!r->k_zc) {
            uint8_t *dst = base + r->kst_off;
            bool via = r->fold && odt != KVR_DTYPE_F32;
            if ((via || r->rd->quant) && !scratch &&
                !(scratch = kvr_mem_malloc(2 * t->max_run * row * sizeof *scratch))) {
                rc = KVR_ENOMEM;
                break;
            }
            void *kd = via ? (void *)scratch : (void *)dst;
            kvr_dtype kdt = via ? KVR_DTYPE_F32 : odt;
            size_t ne = r->count * row;
            /* Any block (quant.c): plain keys re-rotated or converted,
             * quantized pre-RoPE keys dequantized and rotated to the layout's
             * positions; the scratch's tail is the f32 staging that needs. */
            float *qs = scratch ? scratch + (via ? ne : 0) : NULL;
            if ((rc = block_read_side(m, r->rd, l, 0, r->first, r->count, kd, kdt,
                                      r->same ? NULL : t->from + r->tok, t->targets + r->tok,
                                      qs, NULL)) != 0)
                break;
            if (r->fold) {
                float *f = kd;
                for (size_t k = 0; k < ne; k++)
                    f[k] *= inv_t;
                if (via)
                    kvr_convert(dst, odt, scratch, KVR_DTYPE_F32, ne);
            }
        }
        if (rc == 0 && !t->zc_v)
            rc = block_read_side(m, r->rd, l, 1, r->first, r->count,
                                 base + t->kst + r->tok * rowb, odt, NULL, NULL, NULL, NULL);
    }
    kvr_mem_free(scratch);
    return rc;
}

int kvr_assemble_work(kvr_assemble *t, kvr_error *err)
{
    if (t->worked)
        return 0;
    /* Disk tier: one batched load of the spilled blocks first. */
    int rc = t->rl ? tier_reload_work(t->rl, err) : 0;
    if (rc != 0)
        return rc;
    if (!t->staging) {
        t->worked = true;
        return 0;
    }
    rc = par_for(t->info.n_layers, par_threads_for(t->payload), assemble_work_layer, t);
    if (rc == KVR_ENOMEM)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory folding the temperature");
    if (rc != 0)
        return kvr_error_set(err, KVR_EINTERNAL, "re-rotating keys failed (%d)", rc);
    t->worked = true;
    return 0;
}

size_t kvr_assemble_payload_size(const kvr_assemble *t)
{
    return t->payload;
}

void kvr_assemble_payload_iov(const kvr_assemble *t, const struct iovec **iov, size_t *n)
{
    *iov = t->iov;
    *n = t->n_iov;
}

void kvr_assemble_end(kvr_assemble *t)
{
    if (t)
        asm_free(t);
}
