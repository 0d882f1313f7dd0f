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
 * A replace-put (KVR_PUT_REPLACE of an existing id) builds a new context
 * beside the old one: the new one is in no map until commit (spare), the
 * old one stays readable and is busy for writers (and never evicted) until
 * commit swaps them in one step (kvr_store_ctx_replace); abort frees the
 * new one and leaves the old one as it was.
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
#include <stdatomic.h>
#include <string.h>

#include "cache/layout.h"
#include "cache/parallel.h"
#include "cache/txn.h"

struct kvr_put {
    kvr_store    *s;
    kvr_ctx      *c;
    kvr_model    *m;
    bool          created, tail, pin, persist;
    kvr_block    *grown;        /* the last block, grown from grown_cap (undone on abort) */
    uint32_t      grown_cap;
    bool          has_protect;  /* protect_first given: n_protected at commit */
    bool          raw;          /* the fl_new tokens arrive encoded (raw bytes first) */
    bool          quant;        /* quantized context (below); beside the other flags:
                                   the struct stays in its 256-byte size class */
    bool          from;         /* the payload went to kvr_put_work_from, not the
                                   staging: no later work may read the staging */
    size_t        protect;
    kvr_dtype     pdt;          /* payload dtype */
    size_t        n;
    uint32_t     *tokens;       /* copy, for the prefix index */
    int64_t       first_pos, last_pos;
    kvr_brun     *runs;
    size_t        n_runs;
    kvr_wpay      w;            /* the payload: into runs, or staged */
    kvr_layout_put lp;          /* groups / APE record / retention (layout.c) */
    /* Quantized contexts (quant.c): the first fl_old window tokens of the
     * context and the first fl_new tokens of this put go into quantized
     * slots qruns (in that order); the rest of the put goes to window runs. */
    kvr_brun     *qruns, *wsrc;     /* destinations; old window sources (ref'd) */
    size_t        n_qruns, n_wsrc, fl_old, fl_new;
    int64_t      *qpos;             /* stored-at positions of the flushed tokens */
    double        sse[2], ss[2];
    /* kvr_put_work_from: the caller's payload, read in place of the staging
     * buffer during that call (NULL otherwise). */
    const uint8_t *src;
};

/* Where the work reads the payload from: the caller's memory during
 * kvr_put_work_from, else the staging buffer the iovecs filled. */
static const uint8_t *pay_base(const kvr_put *t)
{
    return t->src ? t->src : t->w.staging;
}

/* The context a replace-put replaces: the id's entry in the map while the
 * put's own new context (spare) is in none; NULL for any other put. It
 * cannot go away meanwhile: it is busy, so writers, deletes and eviction
 * leave it alone. */
static kvr_ctx *replaced(const kvr_put *t)
{
    if (!t->created)
        return NULL;
    kvr_ctx *o = kvr_store_ctx_find(t->s, t->c->id);
    return o != t->c ? o : NULL;
}

/* Undoes a created context: the pending one leaves the map; a replace-put's
 * spare is freed and the context it would have replaced is writable again. */
static void created_drop(kvr_put *t)
{
    kvr_ctx *old = replaced(t);
    if (old) {
        old->busy = false;
        kvr_ctx_free(&t->s->pool, t->c);
    } else {
        kvr_store_ctx_destroy(t->s, t->c);
    }
}

static void txn_free(kvr_put *t)
{
    kvr_store *s = t->s;
    for (size_t i = 0; i < t->n_runs; i++) {
        if (!t->runs[i].b)
            continue;
        if (i == 0 && t->tail)
            kvr_block_unhold(&s->pool, t->runs[i].b);
        else
            kvr_block_unref(&s->pool, t->runs[i].b);
    }
    for (size_t i = 0; i < t->n_qruns; i++)
        kvr_block_unref(&s->pool, t->qruns[i].b);
    for (size_t i = 0; i < t->n_wsrc; i++)
        kvr_block_unhold(&s->pool, t->wsrc[i].b);   /* held: eviction must not spill it */
    /* An aborted put gives a grown last block its old size back (its
     * committed slots are untouched); should that fail, it stays larger. */
    if (t->grown)
        (void)kvr_block_resize(&s->pool, t->grown, t->m->n_layers, t->grown_cap);
    kvr_mem_free(t->qruns);
    kvr_mem_free(t->wsrc);
    kvr_mem_free(t->qpos);
    kvr_mem_free(t->runs);
    kvr_wpay_free(&t->w);
    kvr_mem_free(t->tokens);
    kvr_layout_put_free(&t->lp);
    kvr_mem_free(t);
}

static int mul_ok(size_t *out, size_t a, size_t b)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* ---- quantized contexts (quant.c) ----------------------------------------
 *
 * Window: after the put the context has n' tokens; window tokens (in plain
 * blocks) with index < n' - window are due for quantization, taken in
 * context order (old ones first, then the put's own) and, for a KIVI K
 * codec, in whole tiles of G (so between window and window + G - 1 recent
 * tokens stay in full precision, exactly kvr_kivi_split's count for keys;
 * values follow the keys' boundary). Quantized slots go to the tail of the
 * context's last quantized block when it is exclusively owned and ends on
 * a tile boundary, then to fresh blocks.
 */
static bool same_codec(const kvr_block *b, const kvr_qspec *q)
{
    return b->quant && !memcmp(&KVR_QH(b)->kc, &q->pair.k, sizeof KVR_QH(b)->kc) &&
           !memcmp(&KVR_QH(b)->vc, &q->pair.v, sizeof KVR_QH(b)->vc);
}

/* Last quantized block of c, if put may append to it. */
static kvr_block *quant_tail(const kvr_ctx *c)
{
    for (size_t i = c->n_ext; i-- > 0;) {
        const kvr_extent *e = &c->ext[i];
        if (!e->block->quant)
            continue;
        kvr_block *b = e->block;
        if (kvr_block_exclusive(b) && e->first + e->count == b->used && b->used < b->cap &&
            b->used % KVR_QH(b)->ktile == 0 && same_codec(b, &c->codec) && !b->spilled)
            return b;
        return NULL;
    }
    return NULL;
}

static int plan_quant(kvr_put *t, const kvr_put_params *p, size_t *need, kvr_error *err)
{
    kvr_store *s = t->s;
    kvr_ctx *c = t->c;
    const kvr_qspec *q = &c->codec;
    size_t n0 = c->n_tokens, n1 = n0 + t->n, R = q->pair.window;
    size_t lim = n1 > R ? n1 - R : 0, cand_old = 0, k = 0;
    for (size_t i = 0; i < c->n_ext && k < lim; k += c->ext[i].count, i++)
        if (!c->ext[i].block->quant) {
            size_t hi = k + c->ext[i].count < lim ? k + c->ext[i].count : lim;
            cand_old += hi - k;
        }
    size_t cand_new = lim > n0 ? lim - n0 : 0, G = kvr_qspec_ktile(q);
    size_t f = (cand_old + cand_new) / G * G;
    if (p->raw) {
        /* As many quantized tokens as the sender has (its window may be
         * longer than ours would be: the next put flushes it). */
        if (n0 != 0 || p->raw_tokens > t->n || p->raw_tokens % G)
            return kvr_error_set(err, KVR_EINVAL, "raw put: %zu encoded tokens of %zu (a "
                                 "multiple of the %zu-token key tile, into a new context)",
                                 p->raw_tokens, t->n, G);
        f = p->raw_tokens;
    }
    t->fl_old = f < cand_old ? f : cand_old;
    t->fl_new = f - t->fl_old;
    kvr_block *qt = f ? quant_tail(c) : NULL;
    size_t qfree = qt ? qt->cap - qt->used : 0;
    if (qfree > f)
        qfree = f;
    uint32_t cap = kvr_qspec_block_cap(q, s->B);
    size_t nb = (f - qfree + cap - 1) / cap;
    size_t row = (size_t)t->m->n_kv_heads * t->m->head_dim;
    *need = nb * (kvr_mem_size_class(kvr_store_block_bytes(s, c, true)) +
                  kvr_mem_size_class(sizeof(kvr_block))) +
            (nb + 1 + c->n_ext) * sizeof(kvr_brun) + f * sizeof(int64_t) +
            (f + 2u * G) * row * sizeof(float) +
            (c->n_ext + c->n_ext + 2 * nb + 8) * sizeof(kvr_extent);
    return 0;
}

static int alloc_quant(kvr_put *t, const kvr_put_params *p, kvr_error *err)
{
    kvr_store *s = t->s;
    kvr_ctx *c = t->c;
    size_t f = t->fl_old + t->fl_new;
    if (f == 0)
        return 0;
    uint32_t cap = kvr_qspec_block_cap(&c->codec, s->B);
    kvr_block *qt = quant_tail(c);
    size_t qfree = qt ? qt->cap - qt->used : 0;
    if (qfree > f)
        qfree = f;
    size_t nq = (qt ? 1 : 0) + (f - qfree + cap - 1) / cap;
    t->qruns = kvr_mem_calloc(nq, sizeof *t->qruns);
    t->wsrc = kvr_mem_calloc(c->n_ext + 1, sizeof *t->wsrc);
    t->qpos = kvr_mem_malloc(f * sizeof *t->qpos);
    if (!t->qruns || !t->wsrc || !t->qpos)
        goto nomem;
    size_t left = f;
    if (qt) {
        kvr_block_ref(qt);
        t->qruns[t->n_qruns++] = (kvr_brun){ qt, qt->used, (uint32_t)qfree };
        left -= qfree;
    }
    while (left) {
        uint32_t k = left < cap ? (uint32_t)left : cap;
        /* put_work encodes every slot of [0, k) (all layers, K and V)
         * before the block is visible to anyone else. A last partial one
         * is sized to its tiles. */
        kvr_block *b = kvr_store_block_new_for(s, c, true, k, k);
        if (!b)
            goto nomem;
        t->qruns[t->n_qruns++] = (kvr_brun){ b, 0, k };
        left -= k;
    }
    /* Old window sources, in context order. */
    size_t want = t->fl_old;
    for (size_t i = 0; i < c->n_ext && want; i++) {
        const kvr_extent *e = &c->ext[i];
        if (e->block->quant)
            continue;
        uint32_t k = e->count < want ? e->count : (uint32_t)want;
        kvr_block_hold(e->block);
        t->wsrc[t->n_wsrc++] = (kvr_brun){ e->block, e->first, k };
        want -= k;
    }
    /* put_work re-encodes these window tokens: their data must be in
     * memory (disk tier: reloaded here, on the loop thread). */
    for (size_t i = 0; i < t->n_wsrc; i++) {
        if (!t->wsrc[i].b->spilled)
            continue;
        kvr_block **bs = kvr_mem_malloc(t->n_wsrc * sizeof *bs);
        if (!bs)
            goto nomem;
        for (size_t j = 0; j < t->n_wsrc; j++)
            bs[j] = t->wsrc[j].b;
        int frc = kvr_store_fault_in(s, bs, t->n_wsrc, err);
        kvr_mem_free(bs);
        if (frc != 0)
            return frc;
        break;
    }
    /* Metadata of the quantized slots. */
    size_t r = 0, off = 0, g = 0;
    for (size_t i = 0; i < t->n_wsrc; i++)
        for (uint32_t j = 0; j < t->wsrc[i].count; j++, g++) {
            const kvr_block *src = t->wsrc[i].b;
            kvr_block *b = t->qruns[r].b;
            uint32_t sl = t->qruns[r].first + (uint32_t)off, from = t->wsrc[i].first + j;
            t->qpos[g] = src->stored_pos[from];
            kvr_block_set_meta(b, sl, src->tokens[from], t->qpos[g], src->groups[from]);
            if (++off == t->qruns[r].count) {
                r++;
                off = 0;
            }
        }
    for (size_t j = 0; j < t->fl_new; j++, g++) {
        kvr_block *b = t->qruns[r].b;
        uint32_t sl = t->qruns[r].first + (uint32_t)off;
        t->qpos[g] = p->positions ? p->positions[j] : t->first_pos + (int64_t)j;
        kvr_block_set_meta(b, sl, p->tokens[j], t->qpos[g], t->lp.group);
        if (++off == t->qruns[r].count) {
            r++;
            off = 0;
        }
    }
    return 0;

nomem:
    return kvr_error_set(err, KVR_ENOMEM, "out of memory preparing quantized blocks for "
                         "%zu tokens", f);
}

/* Work of a quantized put: refuse non-finite input, un-rotate and quantize
 * the flushed tokens, convert the window's. */
/* One (layer, kv) side of a quantized put's work: the flushed tokens (old
 * window tokens, then the put's first fl_new) gathered as f32 (keys
 * un-rotated), encoded, and the rest of the put copied into window runs.
 * Sides touch disjoint block bytes, so they run in parallel; each records
 * its error sums (replayed in order by work_quant) and its own failure. */
typedef struct qside {
    int    rc;        /* 0, or the failure of this side */
    int    stage;     /* 1 un-rotating keys failed, 2 the codec refused a value,
                         3 its payload holds a nan or inf */
} qside;

typedef struct qwork {
    kvr_put        *t;
    size_t          row, psize, part, f;
    unsigned        n_slots;
    bool            scan;              /* sides scan their payload (AVX2) */
    float         **x, **scratch;      /* per slot */
    atomic_uint     busy;              /* bit per slot */
    qside          *side;              /* 2 * n_layers */
    kvr_qacc       *acc;               /* 2 * n_layers */
    kvr_rope_opts   ro;
} qwork;

static unsigned slot_take(qwork *w)
{
    for (;;) {
        unsigned cur = atomic_load(&w->busy);
        for (unsigned i = 0; i < w->n_slots; i++)
            if (!(cur & (1u << i)) &&
                atomic_compare_exchange_weak(&w->busy, &cur, cur | (1u << i)))
                return i;
    }
}

static int quant_side(void *ud, size_t item)
{
    qwork *w = ud;
    kvr_put *t = w->t;
    const kvr_model *m = t->m;
    uint32_t l = (uint32_t)(item / 2);
    int kv = (int)(item % 2);
    size_t row = w->row, f = w->f;
    const uint8_t *pay = pay_base(t) + item * w->part;
    int rc = 0;
    /* Non-finite input in this side's part of the payload: the tokens
     * quantized now are refused by their codec (every encoder checks what
     * it reads, and un-rotation keeps a nan or inf non-finite), the ones
     * for the window are scanned here (one vector pass); either way
     * work_quant then names the first bad value of the whole payload. */
    if (w->scan && t->n > t->fl_new &&
        kvr_any_nonfinite_avx2(pay + t->fl_new * row * w->psize, t->pdt,
                               (t->n - t->fl_new) * row)) {
        w->side[item].stage = 3;
        w->side[item].rc = KVR_EINVAL;
        return KVR_EINVAL;
    }
    /* Values of this put alone (no old window tokens) in f32 or f16 are
     * encoded and measured where they lie in the payload: no f32 copy. */
    bool direct = kv && t->fl_old == 0 && (t->pdt == KVR_DTYPE_F16 || t->pdt == KVR_DTYPE_F32);
    if (f && direct) {
        unsigned sl = slot_take(w);
        rc = kvr_quant_encode_side(t->qruns, t->n_qruns, l, kv, pay, t->pdt, w->scratch[sl],
                                   &w->acc[item]);
        if (rc != 0)
            w->side[item].stage = 2;
        atomic_fetch_and(&w->busy, ~(1u << sl));
    } else if (f) {
        unsigned sl = slot_take(w);
        float *x = w->x[sl];
        size_t g = 0;
        for (size_t i = 0; i < t->n_wsrc && rc == 0; i++) {
            const kvr_brun *ws = &t->wsrc[i];
            const uint8_t *src = kvr_block_kv(ws->b, l, kv, ws->first);
            if (kv)
                kvr_convert(x + g * row, KVR_DTYPE_F32, src, ws->b->dtype, ws->count * row);
            else
                rc = kvr_rope_remove(kvr_rope_layer(m->engine, l), x + g * row, KVR_DTYPE_F32,
                                     src, ws->b->dtype, ws->count, m->n_kv_heads, t->qpos + g,
                                     &w->ro);
            g += ws->count;
        }
        if (t->fl_new && rc == 0) {
            if (kv)
                kvr_convert(x + g * row, KVR_DTYPE_F32, pay, t->pdt, t->fl_new * row);
            else
                rc = kvr_rope_remove(kvr_rope_layer(m->engine, l), x + g * row, KVR_DTYPE_F32,
                                     pay, t->pdt, t->fl_new, m->n_kv_heads, t->qpos + g, &w->ro);
        }
        if (rc != 0) {
            w->side[item].stage = 1;
        } else {
            rc = kvr_quant_encode_side(t->qruns, t->n_qruns, l, kv, x, KVR_DTYPE_F32,
                                       w->scratch[sl], &w->acc[item]);
            if (rc != 0)
                w->side[item].stage = 2;
        }
        atomic_fetch_and(&w->busy, ~(1u << sl));
    }
    if (rc == 0)
        kvr_brun_fill(t->runs, t->n_runs, l, kv, pay + t->fl_new * row * w->psize, t->pdt);
    w->side[item].rc = rc;
    return rc;
}

static int work_quant(kvr_put *t, kvr_error *err)
{
    const kvr_model *m = t->m;
    size_t row = (size_t)m->n_kv_heads * m->head_dim, psize = kvr_dtype_size(t->pdt);
    uint32_t bl;
    int bkv;
    size_t btok;
    /* Without AVX2 the whole payload is scanned first; with it each side
     * scans its own part on its thread, and only a failure scans it all
     * (below), so the error names the same first bad value either way. */
    bool scan = kvr_isa_best() != KVR_ISA_SCALAR;
    if (!scan &&
        kvr_quant_find_nonfinite(pay_base(t), t->pdt, m->n_layers, t->n, row, &bl, &bkv, &btok))
        goto nonfinite;
    size_t f = t->fl_old + t->fl_new, n_items = 2u * m->n_layers;
    size_t G = kvr_qspec_ktile(&t->c->codec);
    /* Threads by the bytes the sides read and write; each thread holds one
     * slot of f tokens of f32 (x) and two K tiles (scratch): bounded by
     * the request, not by the context. */
    unsigned nt = par_threads_for(n_items * (f * row * 4 + t->n * row * psize));
    if (nt > n_items) nt = (unsigned)n_items;
    if (nt > 8) nt = 8;
    qwork w = { .t = t, .row = row, .psize = psize, .part = t->n * row * psize, .f = f,
                .n_slots = f ? nt : 0, .scan = scan, .ro = { .n_threads = 1 } };
    atomic_init(&w.busy, 0u);
    size_t rec_cap = f + t->n_qruns + 1;
    bool par = nt > 1;
    w.side = kvr_mem_calloc(n_items, sizeof *w.side);
    w.acc = kvr_mem_calloc(n_items, sizeof *w.acc);
    w.x = kvr_mem_calloc(nt, sizeof *w.x);
    w.scratch = kvr_mem_calloc(nt, sizeof *w.scratch);
    double *rec = par && f ? kvr_mem_malloc(n_items * rec_cap * 2 * sizeof *rec) : NULL;
    int rc = 0;
    if (!w.side || !w.acc || !w.x || !w.scratch || (par && f && !rec))
        rc = KVR_ENOMEM;
    for (unsigned i = 0; i < w.n_slots && rc == 0 && w.x && w.scratch; i++) {
        w.x[i] = kvr_mem_malloc(f * row * sizeof(float));
        w.scratch[i] = kvr_mem_malloc(2u * G * row * sizeof(float));
        if (!w.x[i] || !w.scratch[i])
            rc = KVR_ENOMEM;
    }
    if (rc != 0) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory quantizing %zu tokens", f);
    } else {
        for (size_t i = 0; i < n_items; i++) {
            int kv = (int)(i % 2);
            w.acc[i] = par ? (kvr_qacc){ .rec = rec + i * rec_cap * 2, .cap = rec_cap }
                           : (kvr_qacc){ .sse = &t->sse[kv], .ss = &t->ss[kv] };
        }
        if (par) {
            par_for(n_items, nt, quant_side, &w);
        } else {
            for (size_t i = 0; i < n_items; i++)
                if (quant_side(&w, i) != 0)
                    break;
        }
        /* A failure: a nan or inf anywhere in the payload is reported first,
         * as a scan of the whole payload before any side would have. */
        bool failed = false;
        for (size_t i = 0; i < n_items && !failed; i++)
            failed = w.side[i].rc != 0;
        if (failed && scan &&
            kvr_quant_find_nonfinite(pay_base(t), t->pdt, m->n_layers, t->n, row, &bl, &bkv,
                                     &btok))
            rc = 1;
        /* The first side that failed, as the sequential loop would stop at
         * (every side before it ran: sides are handed out in order). */
        for (size_t i = 0; i < n_items && rc == 0; i++) {
            if (w.side[i].rc != 0) {
                uint32_t l = (uint32_t)(i / 2);
                int kv = (int)(i % 2);
                if (w.side[i].stage == 1)
                    rc = kvr_error_set(err, KVR_EINTERNAL, "un-rotating keys failed (%d)",
                                       w.side[i].rc);
                else
                    rc = kvr_error_set(err, w.side[i].rc, "put into '%s': %s of layer %u is "
                                       "outside the range of codec %s", t->c->id,
                                       kv ? "V" : "K", l, t->c->codec.name);
                break;
            }
            if (par)
                kvr_qacc_replay(&w.acc[i], &t->sse[i % 2], &t->ss[i % 2]);
        }
    }
    for (unsigned i = 0; i < nt; i++) {
        if (w.x)
            kvr_mem_free(w.x[i]);
        if (w.scratch)
            kvr_mem_free(w.scratch[i]);
    }
    kvr_mem_free(w.x);
    kvr_mem_free(w.scratch);
    kvr_mem_free(w.side);
    kvr_mem_free(w.acc);
    kvr_mem_free(rec);
    if (rc == 1)
        goto nonfinite;
    if (rc == 0)
        t->w.worked = true;
    return rc;

nonfinite:
    return kvr_error_set(err, KVR_EINVAL,
                         "put into '%s': %s of layer %u, token %zu of the put "
                         "(position %lld) is nan or inf; nothing was stored",
                         t->c->id, bkv ? "V" : "K", bl, btok,
                         (long long)(t->first_pos + (int64_t)btok));
}

/* Bytes of the encoded part of a raw put's payload (as a raw get lays out
 * fl_new tokens in whole K tiles). */
static size_t raw_bytes(const kvr_qspec *q, size_t row, size_t n, uint32_t n_layers)
{
    size_t G = kvr_qspec_ktile(q);
    size_t kb = G > 1 ? n / G * kvr_codec_tile_bytes(&q->pair.k, row)
                      : n * kvr_codec_row_bytes(&q->pair.k, row);
    return (kb + n * kvr_codec_row_bytes(&q->pair.v, row)) * n_layers;
}

/* Work of a raw put: the encoded part copied into the quantized slots as
 * it is (runs of whole K tiles: fresh blocks, cap a multiple of the tile),
 * the window converted from the rest; no quantization error is measured
 * (the sender's is not known here). */
static int work_raw(kvr_put *t, kvr_error *err)
{
    const kvr_model *m = t->m;
    size_t row = (size_t)m->n_kv_heads * m->head_dim, psize = kvr_dtype_size(t->pdt);
    size_t nw = t->n - t->fl_new;
    const uint8_t *win = pay_base(t) + raw_bytes(&t->c->codec, row, t->fl_new, m->n_layers);
    uint32_t bl;
    int bkv;
    size_t btok;
    if (nw && kvr_quant_find_nonfinite(win, t->pdt, m->n_layers, nw, row, &bl, &bkv, &btok))
        return kvr_error_set(err, KVR_EINVAL, "raw put into '%s': %s of layer %u, window "
                             "token %zu is nan or inf; nothing was stored", t->c->id,
                             bkv ? "V" : "K", bl, btok);
    const uint8_t *src = pay_base(t);
    for (uint32_t l = 0; l < m->n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t r = 0; r < t->n_qruns; r++) {
                const kvr_brun *q = &t->qruns[r];
                const kvr_qhdr *h = KVR_QH(q->b);
                size_t len = kv ? q->count * h->vrow
                           : h->ktile > 1 ? q->count / h->ktile * h->krow : q->count * h->krow;
                memcpy(kvr_block_kv(q->b, l, kv, q->first), src, len);
                src += len;
            }
    for (uint32_t l = 0; l < m->n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            kvr_brun_fill(t->runs, t->n_runs, l, kv,
                          win + (2 * (size_t)l + (size_t)kv) * nw * row * psize, t->pdt);
    t->w.worked = true;
    return 0;
}

/* Appends e (carrying one reference) to a, merging with the last extent. */
static void ext_push(kvr_store *s, kvr_extent *a, size_t *n, kvr_extent e)
{
    if (kvr_ext_append(a, n, e))
        kvr_block_unref(&s->pool, e.block);
}

typedef struct qcursor {
    size_t r, off;
} qcursor;

static void emit_quant(kvr_put *t, kvr_extent *a, size_t *n, qcursor *cur, size_t count,
                       int64_t delta, uint32_t flags)
{
    while (count) {
        kvr_brun *q = &t->qruns[cur->r];
        size_t k = q->count - cur->off < count ? q->count - cur->off : count;
        kvr_block_ref(q->b);
        ext_push(t->s, a, n, (kvr_extent){ q->b, q->first + (uint32_t)cur->off,
                                           (uint32_t)k, delta, flags });
        count -= k;
        if ((cur->off += k) == q->count) {
            cur->r++;
            cur->off = 0;
        }
    }
}

/* Commit's splice for a quantized put (after the index succeeded): a new
 * extent array; cannot fail (allocated before). */
static void commit_quant(kvr_put *t, kvr_extent *a, size_t cap)
{
    kvr_store *s = t->s;
    kvr_ctx *c = t->c;
    size_t n = 0, left = t->fl_old;
    qcursor cur = { 0, 0 };
    for (size_t i = 0; i < c->n_ext; i++) {
        kvr_extent e = c->ext[i];
        if (e.block->quant || left == 0) {
            kvr_block_ref(e.block);
            ext_push(s, a, &n, e);
            continue;
        }
        uint32_t k = e.count < left ? e.count : (uint32_t)left;
        emit_quant(t, a, &n, &cur, k, e.pos_delta, e.flags);
        left -= k;
        if (k < e.count) {
            kvr_block_ref(e.block);
            ext_push(s, a, &n, (kvr_extent){ e.block, e.first + k, e.count - k,
                                             e.pos_delta, e.flags });
        }
    }
    emit_quant(t, a, &n, &cur, t->fl_new, 0, 0);
    for (size_t r = 0; r < t->n_runs; r++) {
        kvr_brun *run = &t->runs[r];
        if (r == 0 && t->tail)
            kvr_block_hold_to_ref(run->b);
        kvr_block_commit(run->b, run->first + run->count);
        ext_push(s, a, &n, (kvr_extent){ run->b, run->first, run->count, 0, 0 });
        run->b = NULL;
    }
    for (size_t r = 0; r < t->n_qruns; r++)
        kvr_block_commit(t->qruns[r].b, t->qruns[r].first + t->qruns[r].count);
    /* The old array's references go (the pieces kept took their own). */
    kvr_ctx_replace_extents(&s->pool, c, a, n, cap);
    for (int kv = 0; kv < 2; kv++) {
        c->q_sse[kv] += t->sse[kv];
        c->q_ss[kv] += t->ss[kv];
    }
}

int kvr_store_put_begin(kvr_store *s, const kvr_put_params *p, kvr_put **out,
                        kvr_error *err)
{
    int rc;
    if (!p || !out)
        return kvr_error_set(err, KVR_EBADREQUEST, "put: missing parameters");
    if ((rc = kvr_ctx_id_check(p->ctx_id, err)) != 0)
        return rc;
    kvr_model *m = kvr_store_model(s, p->model);
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
    if (p->mode != KVR_PUT_CREATE && p->mode != KVR_PUT_APPEND && p->mode != KVR_PUT_UPSERT &&
        p->mode != KVR_PUT_REPLACE)
        return kvr_error_set(err, KVR_EBADREQUEST, "unknown put mode %d", (int)p->mode);
    if (p->n_tokens == 0 || !p->tokens)
        return kvr_error_set(err, KVR_EBADREQUEST, "put of no tokens");
    if (p->persist && !s->tier)
        return kvr_error_set(err, KVR_EUNSUPPORTED, "persist: this daemon has no disk "
                             "tier (start it with --disk-dir)");
    if (p->n_tokens > KVR_MAX_PUT_TOKENS)
        return kvr_error_set(err, KVR_ETOOLARGE, "put of %zu tokens (limit %u)",
                             p->n_tokens, KVR_MAX_PUT_TOKENS);
    size_t n = p->n_tokens, payload, row = (size_t)m->n_kv_heads * m->head_dim;
    if (!mul_ok(&payload, row, psize) || !mul_ok(&payload, payload, n) ||
        !mul_ok(&payload, payload, 2u * (size_t)m->n_layers))
        return kvr_error_set(err, KVR_ETOOLARGE, "put payload size overflows");
    if (p->raw && (p->mode != KVR_PUT_CREATE || p->positions == NULL))
        return kvr_error_set(err, KVR_EBADREQUEST, "raw put: create only, with positions");
    if (!p->raw && p->has_payload_bytes && p->payload_bytes != payload)
        return kvr_error_set(err, KVR_EPAYLOAD,
                             "put: payload_len %zu, but %u layers x 2 x %zu tokens x %u heads "
                             "x %u dims x %zu bytes = %zu", p->payload_bytes, m->n_layers, n,
                             m->n_kv_heads, m->head_dim, psize, payload);

    kvr_ctx *c = kvr_store_ctx_find(s, p->ctx_id);
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
    /* REPLACE of an existing context: from here on a create, of a spare
     * that takes the old one's place at commit. */
    kvr_ctx *old_c = NULL;
    if (c && p->mode == KVR_PUT_REPLACE) {
        if (p->prefix_ctx && strcmp(p->prefix_ctx, p->ctx_id) == 0)
            return kvr_error_set(err, KVR_EINVAL, "put: '%s' cannot replace itself with a "
                                 "context encoded after it (prefix_context)", p->ctx_id);
        old_c = c;
        c = NULL;
    }

    if (p->has_protect_first && p->protect_first > (c ? c->n_tokens : 0) + n)
        return kvr_error_set(err, KVR_ERANGE, "put: protect_first %zu is beyond the %zu "
                             "tokens the context will hold", p->protect_first,
                             (c ? c->n_tokens : 0) + n);

    /* Groups and the APE prefix record (layout.c). */
    kvr_layout_put lp;
    if ((rc = kvr_layout_put_begin(s, c, m, p, &lp, err)) != 0)
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
        if (__builtin_add_overflow(kvr_ctx_last_pos(c), 1, &first)) {
            kvr_layout_put_free(&lp);
            return kvr_error_set(err, KVR_EINVAL, "next position overflows int64");
        }
    } else {
        first = 0;
    }
    int64_t last;
    if (p->positions)
        last = p->positions[n - 1];
    else if (__builtin_add_overflow(first, (int64_t)(n - 1), &last)) {
        kvr_layout_put_free(&lp);
        return kvr_error_set(err, KVR_EINVAL,
                             "positions from %lld for %zu tokens overflow int64",
                             (long long)first, n);
    }

    kvr_put *t = kvr_mem_calloc(1, sizeof *t);
    if (!t) {
        kvr_layout_put_free(&lp);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory starting a put");
    }
    *t = (kvr_put){ .s = s, .m = m, .lp = lp, .pdt = p->dtype, .n = n, .pin = p->pin,
                    .persist = p->persist, .has_protect = p->has_protect_first,
                    .protect = p->protect_first, .first_pos = first, .last_pos = last };
    if (!c) {
        /* A replace adds no context: it is not held to --max-contexts. */
        if (!old_c && (rc = kvr_store_ctx_limit(s, p->ctx_id, err)) != 0)
            goto fail_txn;
        c = old_c ? kvr_store_ctx_spare(s, m, p->ctx_id) : kvr_store_ctx_new(s, m, p->ctx_id);
        if (!c) {
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory creating '%s'", p->ctx_id);
            goto fail_txn;
        }
        t->c = c;
        t->created = true;
        if (old_c)
            old_c->busy = true;
        if (p->codec && p->codec[0] &&
            (rc = kvr_model_codec(m, p->codec, &c->codec, err)) != 0)
            goto fail_ctx_early;
        c->dtype = c->codec.dtype;
    }
    t->c = c;
    c->busy = true;
    t->quant = c->codec.quant;
    t->raw = p->raw;
    if (t->raw && !t->quant) {
        rc = kvr_error_set(err, KVR_EINVAL, "raw put: '%s' is not quantized (codec %s)",
                           p->ctx_id, c->codec.name);
        goto fail_ctx;
    }

    /* Plan: tail slots of an exclusively owned last block, then new blocks.
     * A last block sized to its tokens (store.c's block_geom) grows as
     * tokens arrive: to what this put needs, at least doubling (appends of
     * a few tokens copy it O(log B) times per block), never over B; only
     * in memory and unheld (a disk copy, whose image has the old cap, is
     * dropped first: the append would outdate it anyway), and not in
     * quantized contexts (their window churns anyway). */
    kvr_block *tail = NULL;
    uint32_t tail_free = 0, grow = 0;
    if (c->n_ext) {
        kvr_extent *e = &c->ext[c->n_ext - 1];
        kvr_block *b = e->block;
        if (kvr_block_exclusive(b) && e->first + e->count == b->used && b->used < s->B &&
            b->dtype == c->dtype && !b->quant && !b->spilled &&
            (b->used < b->cap || (b->cap < s->B && !t->quant))) {
            tail = b;
            tail_free = tail->cap - tail->used;
            if (tail_free < n && b->cap < s->B && !t->quant) {
                size_t want = b->used + n < s->B ? b->used + n : s->B;
                if (want < 2u * (size_t)b->cap)
                    want = 2u * (size_t)b->cap < s->B ? 2u * b->cap : s->B;
                grow = kvr_store_block_fit(s, c, (uint32_t)want);
                tail_free = grow - tail->used;
            }
            if (tail_free > n)
                tail_free = (uint32_t)n;
        }
    }
    size_t qneed = 0;
    if (t->quant) {
        if ((rc = plan_quant(t, p, &qneed, err)) != 0)
            goto fail_ctx;
        size_t nw = n - t->fl_new;     /* tokens for the window */
        if (tail_free > nw)
            tail_free = (uint32_t)nw;
        if (nw == 0)
            tail = NULL;
    }
    size_t nwin = n - t->fl_new;
    if (t->raw) {
        /* The payload: the encoded part as a raw get lays it out (whole
         * tiles, t->fl_new a multiple of the tile), then the window. */
        payload = raw_bytes(&c->codec, row, t->fl_new, m->n_layers) +
                  2u * (size_t)m->n_layers * nwin * row * psize;
        if (p->has_payload_bytes && p->payload_bytes != payload) {
            rc = kvr_error_set(err, KVR_EPAYLOAD, "raw put: payload_len %zu, expected %zu "
                               "(%zu encoded tokens, %zu in the window)", p->payload_bytes,
                               payload, t->fl_new, nwin);
            goto fail_ctx;
        }
    }
    size_t n_new = (nwin - tail_free + s->B - 1) / s->B;
    uint32_t lastk = (uint32_t)((nwin - tail_free) % s->B);    /* 0: full */
    bool zero_copy = p->dtype == c->dtype && !t->quant;
    size_t n_runs = n_new + (tail ? 1 : 0);
    size_t n_iov = zero_copy ? 2u * m->n_layers * n_runs : 1;
    /* Reserve what the allocator will really hold (its size classes), not
     * what is requested: jemalloc rounds a 25 KiB block up to 28 KiB. */
    size_t bnew = n_new ? (n_new - (lastk ? 1 : 0)) * kvr_store_block_alloc(s, c, false, 0) +
                          (lastk ? kvr_store_block_alloc(s, c, false, lastk) : 0) : 0;
    if (grow)
        bnew += kvr_store_block_alloc(s, c, false, grow);
    size_t need = bnew +
                  (zero_copy || p->work_from ? 0 : kvr_mem_size_class(payload)) +
                  n_iov * sizeof(struct iovec) + n * sizeof(uint32_t) +
                  n_runs * sizeof(kvr_brun) + qneed + kvr_grain_need(c, n);
    if ((rc = kvr_store_reserve_for(s, m, need, "put", err)) != 0)
        goto fail_ctx;
    if (grow) {
        uint32_t cap0 = tail->cap;
        if (tail->disk && s->hooks)
            s->hooks->drop_copy(s, tail);
        if (kvr_block_resize(&s->pool, tail, m->n_layers, grow) != 0) {
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory growing the last block of "
                               "'%s'", p->ctx_id);
            goto fail_ctx;
        }
        t->grown = tail;
        t->grown_cap = cap0;
    }
    if (t->quant && (rc = alloc_quant(t, p, err)) != 0)
        goto fail_ctx;

    t->runs = kvr_mem_calloc(n_runs ? n_runs : 1, sizeof *t->runs);
    t->tokens = kvr_mem_malloc(n * sizeof *t->tokens);
    if (!t->runs || !t->tokens) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory preparing a put of %zu tokens", n);
        goto fail_ctx;
    }
    memcpy(t->tokens, p->tokens, n * sizeof *t->tokens);
    size_t left = nwin;
    if (tail) {
        kvr_block_hold(tail);
        t->tail = true;
        t->runs[0] = (kvr_brun){ tail, tail->used, tail_free };
        t->n_runs = 1;
        left -= tail_free;
    }
    while (left) {
        uint32_t k = left < s->B ? (uint32_t)left : s->B;
        kvr_block *b = kvr_store_block_new_for(s, c, false, 0, k);
        if (!b) {
            rc = kvr_error_set(err, KVR_ENOMEM,
                               "out of memory allocating blocks for %zu tokens", n);
            goto fail_ctx;
        }
        t->runs[t->n_runs++] = (kvr_brun){ b, 0, k };
        left -= k;
    }
    /* Metadata into the (still invisible) slots. */
    size_t tok = t->fl_new;
    for (size_t r = 0; r < t->n_runs; r++) {
        kvr_brun *run = &t->runs[r];
        for (uint32_t j = 0; j < run->count; j++, tok++) {
            kvr_block_set_meta(run->b, run->first + j, p->tokens[tok],
                               p->positions ? p->positions[tok] : first + (int64_t)tok,
                               t->lp.group);
        }
    }
    if (kvr_wpay_init(&t->w, t->runs, t->n_runs, m->n_layers, payload, zero_copy,
                      !p->work_from) != 0) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory for the %zu-byte payload of a put",
                           payload);
        goto fail_ctx;
    }
    *out = t;
    return 0;

fail_ctx:
    if (t->created)
        created_drop(t);
    else
        c->busy = false;
    goto fail_txn;
fail_ctx_early:
    created_drop(t);
fail_txn:
    txn_free(t);
    return rc;
}

KVR_WRITE_TXN_API(kvr_put, kvr_put)

int kvr_put_work(kvr_put *t, kvr_error *err)
{
    if (!t->w.work || t->w.worked)
        return 0;
    if (t->from && !t->src)
        return kvr_error_set(err, KVR_EINVAL, "put: its payload was given to "
                             "kvr_put_work_from, whose work failed (abort the put)");
    if (!t->src && !t->w.staging)
        return kvr_error_set(err, KVR_EINVAL, "put: begun with work_from, its payload was "
                             "never given to kvr_put_work_from (abort the put)");
    if (t->raw)
        return work_raw(t, err);
    if (t->quant)
        return work_quant(t, err);
    const uint8_t *src = pay_base(t);
    for (uint32_t l = 0; l < t->m->n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            src = kvr_brun_fill(t->runs, t->n_runs, l, kv, src, t->pdt);
    t->w.worked = true;
    return 0;
}

/* The caller's memory is read as the staging would be, more than once
 * (scan, then copy; encode, then measure): private memory only, never a
 * region a client can write meanwhile (cache.h). */
int kvr_put_work_from(kvr_put *t, const void *payload, size_t len, kvr_error *err)
{
    if (len != t->w.p.bytes)
        return kvr_error_set(err, KVR_EPAYLOAD, "put: a payload of %zu bytes, expected %zu",
                             len, t->w.p.bytes);
    if (!t->w.work) {
        /* Stored as it is: the iovecs point into the blocks. */
        const uint8_t *p = payload;
        for (size_t i = 0; i < t->w.p.n_iov; i++) {
            memcpy(t->w.p.iov[i].iov_base, p, t->w.p.iov[i].iov_len);
            p += t->w.p.iov[i].iov_len;
        }
        return 0;
    }
    if (t->w.worked)
        return 0;
    if (t->from)
        return kvr_error_set(err, KVR_EINVAL, "put: kvr_put_work_from failed already "
                             "(abort the put)");
    t->from = true;
    t->src = payload;
    int rc = kvr_put_work(t, err);
    t->src = NULL;
    return rc;
}

int kvr_put_commit(kvr_put *t, kvr_put_result *res, kvr_error *err)
{
    int rc;
    kvr_store *s = t->s;
    kvr_ctx *c = t->c;
    if (t->w.work && !t->w.worked && (rc = kvr_put_work(t, err)) != 0)
        goto fail;
    kvr_extent *qext = NULL;
    size_t qcap = c->n_ext + 2 * t->n_wsrc + t->n_qruns + t->n_runs + 4;
    if (t->quant && !(qext = kvr_mem_malloc(qcap * sizeof *qext))) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory committing a put to '%s'", c->id);
        goto fail;
    }
    if (!t->quant && kvr_ctx_ext_reserve(c, t->n_runs) != 0) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory committing a put to '%s'", c->id);
        goto fail;
    }
    /* Index first: it is the only step that can fail. A tree is appended
     * to only where it holds all of c (an allocation failure in
     * kvr_ctx_index_rebuild or an edit can leave c dropped or a true prefix
     * there): appending at a shorter node would index a sequence c does not
     * have. Such a tree is resynced below, after the tokens are in. */
    bool exact = c->n_exact == c->n_tokens;
    bool in0 = exact && c->idx[0].len == c->n_exact;
    bool in1 = !c->idx_stale && c->idx[1].len == c->n_tokens;
    bool resync = (exact && !in0) || (!c->idx_stale && !in1);
    if (in1 && (rc = kvr_ctx_index_append(c, 1, t->tokens, t->n)) != 0) {
        kvr_error_set(err, rc, "out of memory indexing '%s'", c->id);
        kvr_mem_free(qext);
        goto fail;
    }
    if (in0 && (rc = kvr_ctx_index_append(c, 0, t->tokens, t->n)) != 0) {
        kvr_ctx_index_truncate(c, 1, c->n_tokens);   /* no-op when stale */
        kvr_error_set(err, rc, "out of memory indexing '%s'", c->id);
        kvr_mem_free(qext);
        goto fail;
    }
    size_t first_index = c->n_tokens, old_exact = c->n_exact;
    if (t->quant)
        commit_quant(t, qext, qcap);
    for (size_t r = 0; r < t->n_runs && !t->quant; r++) {
        kvr_brun *run = &t->runs[r];
        if (r == 0 && t->tail)
            kvr_block_hold_to_ref(run->b);
        kvr_block_commit(run->b, run->first + run->count);
        kvr_ctx_push(&s->pool, c, (kvr_extent){ run->b, run->first, run->count, 0, 0 });
        run->b = NULL;                  /* the reference now belongs to c */
    }
    assert(c->n_tokens == first_index + t->n);
    kvr_grain_append(c, first_index, t->tokens, t->n);
    c->n_exact = exact ? c->n_tokens : old_exact;
    if (resync)
        kvr_ctx_index_rebuild(c, c->n_tokens);   /* best effort; never lies */
    kvr_ctx_check(c);
    if (t->created) {
        kvr_ctx *old = replaced(t);
        if (old)
            kvr_store_ctx_replace(s, old, c);
        else
            kvr_store_ctx_commit(s, c);
    }
    c->busy = false;
    /* Group cursor, created layout, retention (may drop tokens and move the
     * window's positions by `moved`). */
    int64_t moved = kvr_layout_put_commit(s, c, &t->lp, t->n);
    /* After retention, which may have left fewer tokens than asked for. */
    if (t->has_protect)
        c->n_protected = t->protect < c->n_tokens ? t->protect : c->n_tokens;
    if (first_index + t->n > c->n_tokens)
        first_index = c->n_tokens > t->n ? c->n_tokens - t->n : 0;
    if (t->pin)
        c->pinned = true;
    if (s->tier && (t->persist || (t->created && s->persist_all)))
        c->persist = true;
    if (!t->created)
        kvr_store_touch(s, c);   /* a created one was, by kvr_store_ctx_commit */
    s->n_puts++;
    if (res) {
        res->n_tokens = c->n_tokens;
        res->first_index = first_index;
        res->first_pos = t->first_pos + moved;
        res->last_pos = t->last_pos + moved;
    }
    t->tail = false;
    t->grown = NULL;
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
        created_drop(t);
    else
        t->c->busy = false;
    txn_free(t);
}
