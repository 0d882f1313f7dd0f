/*
 * read.c — the read plan under get and assemble (read.h has the payload
 * layout and the invariants): the stream's metadata, leases, the disk
 * tier's reloads, zero-copy decisions, staging and iovecs, and the
 * per-layer work that fills the staging on any thread.
 */
#include <stdio.h>
#include <string.h>

#include "cache/parallel.h"
#include "cache/read.h"

int kvr_read_init(kvr_read *r, kvr_store *s, kvr_model *m, const uint32_t *layers,
                  size_t nl, size_t n, size_t max_runs, bool groups, bool meta_only,
                  kvr_dtype odt)
{
    *r = (kvr_read){ .s = s, .m = m, .odt = odt, .meta_only = meta_only, .all_same = true,
                     .n = n, .nl = nl, .cap_runs = max_runs ? max_runs : 1,
                     .owner = pthread_self() };
    size_t cnt = n ? n : 1;
    r->layers = kvr_mem_malloc((nl ? nl : 1) * sizeof *r->layers);
    r->tokens = kvr_mem_malloc(cnt * sizeof *r->tokens);
    r->flags = kvr_mem_malloc(cnt * sizeof *r->flags);
    r->targets = kvr_mem_malloc(cnt * sizeof *r->targets);
    r->from = kvr_mem_malloc(cnt * sizeof *r->from);
    r->groups = groups ? kvr_mem_malloc(cnt * sizeof *r->groups) : NULL;
    r->runs = kvr_mem_malloc(r->cap_runs * sizeof *r->runs);
    if (!r->layers || !r->tokens || !r->flags || !r->targets || !r->from ||
        (groups && !r->groups) || !r->runs)
        return KVR_ENOMEM;
    for (size_t i = 0; i < nl; i++)
        r->layers[i] = layers ? layers[i] : (uint32_t)i;
    return 0;
}

void kvr_read_add(kvr_read *r, const kvr_extent *e, uint32_t a, uint32_t z,
                  const int64_t *targets, int64_t *next, bool mark_moved, bool fold)
{
    assert(a < z && z <= e->count && r->n_added + (z - a) <= r->n);
    size_t tok0 = r->n_added;
    bool same = true;
    for (uint32_t j = a; j < z; j++) {
        size_t i = r->n_added++;
        uint32_t slot = e->first + j;
        int64_t sp = e->block->stored_pos[slot], logical = sp + e->pos_delta;
        r->tokens[i] = e->block->tokens[slot];
        if (r->groups)
            r->groups[i] = e->block->groups[slot];
        r->flags[i] = e->flags;
        r->from[i] = sp;
        r->targets[i] = targets ? targets[i] : next ? (*next)++ : logical;
        if (mark_moved && r->targets[i] != logical)
            r->flags[i] |= KVR_TOKEN_APPROX;
        if (r->targets[i] != sp)
            same = false;
    }
    r->all_same = r->all_same && same;
    if (r->meta_only)
        return;
    kvr_read_run *prev = r->n_runs ? &r->runs[r->n_runs - 1] : NULL;
    if (prev && prev->b == e->block && prev->first + prev->count == e->first + a &&
        prev->fold == fold && prev->tok + prev->count == tok0) {
        prev->count += z - a;
        prev->same = prev->same && same;
        return;
    }
    assert(r->n_runs < r->cap_runs);
    kvr_read_run *run = &r->runs[r->n_runs++];
    *run = (kvr_read_run){ .b = e->block, .rd = e->block, .first = e->first + a,
                           .count = z - a, .tok = tok0, .same = same, .fold = fold };
    kvr_block_lease(&r->s->pool, run->b);
}

int kvr_read_reload(kvr_read *r, kvr_ctx *pf, kvr_error *err)
{
    if (!r->s->hooks || r->meta_only || r->n_runs == 0)
        return 0;
    kvr_block **bs = kvr_mem_malloc(r->n_runs * sizeof *bs);
    if (!bs)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory reloading %zu blocks",
                             r->n_runs);
    for (size_t i = 0; i < r->n_runs; i++)
        bs[i] = r->runs[i].b;
    int rc = kvr_store_reload_begin(r->s, bs, r->n_runs, pf, &r->rl, err);
    kvr_mem_free(bs);
    if (rc != 0)
        return rc;
    for (size_t i = 0; i < r->n_runs; i++)
        r->runs[i].rd = kvr_store_reload_view(r->s, r->rl, r->runs[i].b);
    return 0;
}

int kvr_read_check_rope(const kvr_read *r, kvr_error *err)
{
    if (r->meta_only || r->all_same || kvr_rope_config_composes(&r->m->rope_cfg))
        return 0;
    return kvr_error_set(err, KVR_EUNSUPPORTED,
                         "model '%s' uses length-dependent RoPE scaling (dynamic NTK / "
                         "longrope): assemble cannot move its documents' keys (each "
                         "context has its own table length); get each context at the "
                         "positions wanted instead", r->m->name);
}

/* Dynamic NTK / longrope: the frequencies depend on the sequence length,
 * so the context knows its length. Its keys are taken as rotated with the
 * table of the positions they are stored at (max stored-at + 1, what
 * transformers uses for a forward over them), and they are read with the
 * table of the requested targets (max + 1), or of the context's logical
 * length when none are requested. Where the two tables differ, every key
 * is re-rotated (removed with the old table, applied with the new), moved
 * or not. */
void kvr_read_rope_lens(kvr_read *r, const kvr_ctx *c, bool requested)
{
    if (r->meta_only || kvr_rope_config_composes(&r->m->rope_cfg))
        return;
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
    int64_t tl = kvr_rope_default_seq_len(r->targets, r->n);
    r->ro.seq_len_from = smax + 1;
    r->ro.seq_len_to = requested || tl > lmax + 1 ? tl : lmax + 1;
    if (!kvr_rope_same_table(r->m->engine, r->ro.seq_len_from, r->ro.seq_len_to)) {
        r->all_same = false;
        for (size_t g = 0; g < r->n_runs; g++)
            r->runs[g].same = false;
    }
}

/* Appends an iovec, joining it to the previous one of the same layer when
 * they touch. */
static void iov_push(kvr_read *r, size_t layer_first, uint8_t *p, size_t len)
{
    struct iovec *last = r->out.n_iov > layer_first ? &r->out.iov[r->out.n_iov - 1] : NULL;
    if (last && (uint8_t *)last->iov_base + last->iov_len == p) {
        last->iov_len += len;
        return;
    }
    r->out.iov[r->out.n_iov++] = (struct iovec){ p, len };
}

/* Folded runs are worked this many tokens at a time (layer_to); a multiple
 * of the rotation's reseed interval (32). */
#define FOLD_PIECE 64
/* ... and runs that are only converted (no rotation, so no reseed interval
 * to respect) in pieces that stay in L1 */
#define FOLD_PIECE_SAME 8

/* Whether a staged run's keys go in one pass (kvr_read_run.one_pass): a
 * plain block whose keys are folded where the positions agree, or move by
 * one delta (target - stored-at, the same for every token, as after an
 * edit or for one document of an assemble) under RoPE that composes. The
 * general path (kvr_block_read_side, per-token positions, f32 scratch for
 * the fold) keeps everything else: quantized blocks, deltas that differ,
 * length-dependent RoPE. */
static bool run_one_pass(const kvr_read *r, const kvr_read_run *run, int64_t *delta)
{
    if (run->rd->quant)
        return false;
    if (run->same)
        return run->fold;
    if (!kvr_rope_config_composes(&r->m->rope_cfg))
        return false;
    const int64_t *to = r->targets + run->tok, *from = r->from + run->tok;
    int64_t d;
    if (__builtin_sub_overflow(to[0], from[0], &d))
        return false;
    for (uint32_t i = 1; i < run->count; i++) {
        int64_t di;
        if (__builtin_sub_overflow(to[i], from[i], &di) || di != d)
            return false;
    }
    *delta = d;
    return true;
}

/* Layer li's staging: its own part of the buffer, or with a ring
 * (kvr_read_stage_ring) the part of its chunk's slot. */
static uint8_t *stage_base(const kvr_read *r, size_t li)
{
    size_t at = li;
    if (r->ring_slots)
        at = (li / r->ring_per) % r->ring_slots * r->ring_per + li % r->ring_per;
    return r->staging + at * (r->kst + r->vst);
}

/* The iovecs: block memory for zero-copy runs, the staging for the rest. */
static void stage_iov(kvr_read *r)
{
    size_t rowb = kvr_model_row(r->m) * kvr_dtype_size(r->odt);
    for (size_t li = 0; li < r->nl; li++) {
        uint8_t *base = r->staging ? stage_base(r, li) : NULL;
        uint32_t l = r->layers[li];
        size_t v0 = r->out.n_iov;
        for (size_t i = 0; i < r->n_runs; i++) {
            const kvr_read_run *run = &r->runs[i];
            iov_push(r, v0, run->k_zc ? kvr_block_kv(run->rd, l, 0, run->first)
                                      : base + run->k_off, run->count * rowb);
        }
        for (size_t i = 0; i < r->n_runs; i++) {
            const kvr_read_run *run = &r->runs[i];
            iov_push(r, v0, run->v_zc ? kvr_block_kv(run->rd, l, 1, run->first)
                                      : base + r->kst + run->v_off, run->count * rowb);
        }
    }
}

int kvr_read_stage(kvr_read *r, kvr_ctx *keep, const char *what, kvr_error *err)
{
    if (r->meta_only || r->n == 0)
        return 0;
    const kvr_model *m = r->m;
    size_t row = kvr_model_row(m), rowb = row * kvr_dtype_size(r->odt);
    for (size_t i = 0; i < r->n_runs; i++) {
        kvr_read_run *run = &r->runs[i];
        /* A destination of the caller's: every run is produced into it
         * (plain runs by a copy), so K of all runs then V of all runs is
         * the wire's layer layout. */
        bool plain = run->rd->dtype == r->odt && !run->rd->quant && !r->dst;
        run->v_zc = plain;
        run->k_zc = plain && run->same && !run->fold;
        size_t need = 0;
        run->one_pass = !run->k_zc && run_one_pass(r, run, &run->delta);
        if (run->one_pass) {
            run->k_off = r->kst;   /* straight into the staging: no scratch */
            r->kst += run->count * rowb;
        } else if (!run->k_zc) {
            run->k_off = r->kst;
            r->kst += run->count * rowb;
            /* f32 keys before 1/T, a piece at a time (layer_to) */
            size_t pc = run->fold && run->count > FOLD_PIECE ? FOLD_PIECE : run->count;
            if (run->fold && r->odt != KVR_DTYPE_F32)
                need += pc * row;
            /* quantized keys: kvr_block_read_side decodes a key tile or at
             * most 64 rows at a time */
            if (run->rd->quant)
                need += ((pc < 64 ? pc : 64) + KVR_QH(run->rd)->ktile) * row;
        }
        if (!run->v_zc) {
            run->v_off = r->vst;
            r->vst += run->count * rowb;
        }
        if (need > r->scratch)
            r->scratch = need;
    }
    r->out.bytes = r->n * rowb * 2u * r->nl;
    r->out.iov = kvr_mem_malloc(2 * r->n_runs * r->nl * sizeof *r->out.iov);
    if (!r->out.iov)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory for a %s of %zu tokens", what,
                             r->n);
    size_t stage = (r->kst + r->vst) * r->nl;
    r->what = what;
    if (r->dst) {
        if (stage > r->dst_cap)
            return kvr_error_set(err, KVR_ERANGE, "a %s of %zu bytes does not fit the "
                                 "%zu-byte destination", what, stage, r->dst_cap);
        r->staging = stage ? r->dst : NULL;
        stage_iov(r);
        return 0;
    }
    /* Lazy: reserved and allocated once the caller says how the payload
     * goes out (kvr_read_stage_now / _ring); kvr_read_work_into never. */
    r->stage_need = stage;
    if (keep)
        snprintf(r->keep_id, sizeof r->keep_id, "%s", keep->id);
    if (!stage)
        stage_iov(r);
    return 0;
}

/* Reserves `bytes` of staging as the read's request, its context (if any)
 * kept busy meanwhile so eviction spares it. */
static int stage_reserve(kvr_read *r, size_t bytes, kvr_error *err)
{
    kvr_ctx *keep = r->keep_id[0] ? kvr_store_ctx_find(r->s, r->keep_id) : NULL;
    bool was_busy = keep ? keep->busy : false;
    if (keep)
        keep->busy = true;
    int rc = kvr_store_reserve_request(r->s, bytes, r->what, err);
    if (keep)
        keep->busy = was_busy;
    return rc;
}

static bool stage_pending(const kvr_read *r)
{
    return r->stage_need && !r->staging;
}

int kvr_read_stage_now(kvr_read *r, kvr_error *err)
{
    if (!stage_pending(r))
        return 0;
    int rc = stage_reserve(r, r->stage_need, err);
    if (rc != 0)
        return rc;
    r->staging = kvr_mem_aligned(KVR_BLOCK_ALIGN, r->stage_need);
    if (!r->staging)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory for a %zu-byte %s buffer",
                             r->stage_need, r->what);
    r->out.n_iov = 0;
    stage_iov(r);
    return 0;
}

int kvr_read_stage_ring(kvr_read *r, size_t per, size_t slots, kvr_error *err)
{
    if (!stage_pending(r))
        return 0;
    if (r->worked || per == 0 || slots == 0 || per >= r->nl ||
        slots >= (r->nl + per - 1) / per)
        return kvr_read_stage_now(r, err);   /* the ring would not be smaller */
    size_t bytes = slots * per * (r->kst + r->vst);
    int rc = stage_reserve(r, bytes, err);
    if (rc != 0)
        return rc;
    uint8_t *ring = kvr_mem_staging(bytes);
    if (!ring)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory for a %zu-byte %s staging "
                             "ring", bytes, r->what);
    r->staging = ring;
    r->ring_per = per;
    r->ring_slots = slots;
    r->out.n_iov = 0;
    stage_iov(r);
    return 0;
}

/* ---- a streamed read in pieces ------------------------------------------------ */

/* Whether every staged run is produced row by row, the same bits however
 * its tokens are split: keys of plain blocks in one pass (one delta, or a
 * conversion with 1/T) or converted where they stay, values of plain
 * blocks converted. */
static bool pieces_ok(const kvr_read *r)
{
    for (size_t i = 0; i < r->n_runs; i++) {
        const kvr_read_run *run = &r->runs[i];
        if (run->rd->quant && (!run->k_zc || !run->v_zc))
            return false;
        /* keys: one pass, or converted where they stay (no rotation) */
        if (!run->k_zc && !run->one_pass && !(run->same && !run->fold))
            return false;
    }
    return true;
}

static bool side_staged(const kvr_read *r, int kv)
{
    for (size_t i = 0; i < r->n_runs; i++)
        if (!(kv ? r->runs[i].v_zc : r->runs[i].k_zc))
            return true;
    return false;
}

static uint8_t *piece_slot(const kvr_read *r, size_t k)
{
    size_t rowb = kvr_model_row(r->m) * kvr_dtype_size(r->odt);
    return r->staging + k % r->ring_slots * r->piece_tok * rowb;
}

/* Piece k's iovecs (its runs in order, neighbours that touch joined). */
static void piece_iov(kvr_read *r, size_t k, size_t *at)
{
    kvr_read_piece *pc = &r->pieces[k];
    size_t rowb = kvr_model_row(r->m) * kvr_dtype_size(r->odt);
    uint32_t l = r->layers[pc->li];
    uint8_t *slot = pc->work ? piece_slot(r, k) : NULL;
    pc->iov0 = *at;
    pc->n_iov = 0;
    pc->bytes = (pc->b - pc->a) * rowb;
    for (size_t i = 0; i < r->n_runs; i++) {
        const kvr_read_run *run = &r->runs[i];
        size_t s = run->tok > pc->a ? run->tok : pc->a;
        size_t e = run->tok + run->count < pc->b ? run->tok + run->count : pc->b;
        if (s >= e)
            continue;
        bool zc = pc->kv ? run->v_zc : run->k_zc;
        uint8_t *p = zc ? (uint8_t *)kvr_block_kv(run->rd, l, pc->kv, run->first) +
                              (s - run->tok) * rowb
                        : slot + (s - pc->a) * rowb;
        size_t len = (e - s) * rowb;
        struct iovec *last = pc->n_iov ? &r->piov[*at - 1] : NULL;
        if (last && (uint8_t *)last->iov_base + last->iov_len == p) {
            last->iov_len += len;
            continue;
        }
        r->piov[(*at)++] = (struct iovec){ p, len };
        pc->n_iov++;
    }
}

int kvr_read_stage_pieces(kvr_read *r, size_t piece_bytes, size_t slots, size_t *n_pieces,
                          kvr_error *err)
{
    *n_pieces = 0;
    if (!stage_pending(r) || r->worked || slots == 0 || !pieces_ok(r))
        return 0;
    size_t rowb = kvr_model_row(r->m) * kvr_dtype_size(r->odt);
    size_t P = piece_bytes / rowb ? piece_bytes / rowb : 1;
    if (P > r->n)
        P = r->n;
    bool st[2] = { side_staged(r, 0), side_staged(r, 1) };
    /* A side straight from block memory stays one piece: one large write
     * (splitting it too measured no better: more writes, more wake-ups). */
    size_t per_layer = (st[0] ? (r->n + P - 1) / P : 1) + (st[1] ? (r->n + P - 1) / P : 1);
    size_t np = per_layer * r->nl;
    if (slots > np)
        slots = np;
    size_t bytes = slots * P * rowb;
    if (bytes >= r->stage_need)
        return 0;   /* no smaller than the whole staging: the usual paths */
    size_t niov = np + 2 * r->nl * r->n_runs;
    kvr_read_piece *pcs = kvr_mem_calloc(np, sizeof *pcs);
    struct iovec *iov = kvr_mem_malloc(niov * sizeof *iov);
    if (!pcs || !iov) {
        kvr_mem_free(pcs);
        kvr_mem_free(iov);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory planning a %s of %zu tokens",
                             r->what, r->n);
    }
    int rc = stage_reserve(r, bytes, err);
    uint8_t *ring = rc == 0 ? kvr_mem_staging(bytes) : NULL;
    if (!ring) {
        kvr_mem_free(pcs);
        kvr_mem_free(iov);
        return rc ? rc : kvr_error_set(err, KVR_ENOMEM, "out of memory for a %zu-byte %s "
                                       "staging ring", bytes, r->what);
    }
    r->staging = ring;
    r->ring_slots = slots;
    r->piece_tok = P;
    r->pieces = pcs;
    r->piov = iov;
    size_t k = 0, at = 0;
    for (size_t li = 0; li < r->nl; li++)
        for (int kv = 0; kv < 2; kv++) {
            size_t step = st[kv] ? P : r->n;
            for (size_t a = 0; a < r->n; a += step, k++) {
                pcs[k] = (kvr_read_piece){ .li = (uint32_t)li, .kv = (uint8_t)kv,
                                           .work = st[kv], .a = a,
                                           .b = a + step < r->n ? a + step : r->n };
                piece_iov(r, k, &at);
            }
        }
    assert(k == np && at <= niov);
    r->n_pieces = np;
    r->out.n_iov = 0;   /* the whole payload's iovecs: not with pieces */
    *n_pieces = np;
    return 0;
}

int kvr_read_work_piece(kvr_read *r, size_t k, const char *nomem, kvr_error *err)
{
    if (k >= r->n_pieces)
        return kvr_error_set(err, KVR_EINVAL, "piece %zu of a %zu-piece %s", k, r->n_pieces,
                             r->what);
    int rc = kvr_store_reload_work(r->s, r->rl, err);
    if (rc != 0)
        return rc;
    const kvr_read_piece *pc = &r->pieces[k];
    if (!pc->work)
        return 0;
    const kvr_model *m = r->m;
    size_t rowb = kvr_model_row(m) * kvr_dtype_size(r->odt);
    uint32_t l = r->layers[pc->li];
    uint8_t *slot = piece_slot(r, k);
    for (size_t i = 0; i < r->n_runs && rc == 0; i++) {
        const kvr_read_run *run = &r->runs[i];
        size_t s = run->tok > pc->a ? run->tok : pc->a;
        size_t e = run->tok + run->count < pc->b ? run->tok + run->count : pc->b;
        if (s >= e || (pc->kv ? run->v_zc : run->k_zc))
            continue;
        uint32_t from = run->first + (uint32_t)(s - run->tok), cnt = (uint32_t)(e - s);
        uint8_t *d = slot + (s - pc->a) * rowb;
        const kvr_block *b = run->rd;
        if (pc->kv) {
            rc = kvr_block_read_side(m->engine, m->n_kv_heads, b, l, 1, from, cnt, d, r->odt,
                                     NULL, NULL, NULL, NULL);
            continue;
        }
        if (!run->one_pass) {   /* converted where they stay: as layer_to */
            rc = kvr_block_read_side(kvr_rope_layer(m->engine, l), m->n_kv_heads, b, l, 0,
                                     from, cnt, d, r->odt, NULL,
                                     r->targets + run->tok + (s - run->tok), NULL, &r->ro);
            continue;
        }
        /* keys_one_pass on rows [from, from + cnt): each row's bits depend
         * only on its own input and the run's one delta */
        const void *src = kvr_block_kv(b, l, 0, from);
        float sc = run->fold ? r->inv_t : 1.0f;
        if (run->same) {
            kvr_convert_scaled(d, r->odt, src, b->dtype, cnt * kvr_model_row(m), sc);
        } else {
            kvr_rope_opts o = r->ro;
            o.stream = false;   /* read back by the write at once: keep it in cache */
            rc = kvr_rope_reposition_delta(kvr_rope_layer(m->engine, l), d, r->odt, src,
                                           b->dtype, cnt, m->n_kv_heads, run->delta, sc, &o);
        }
    }
    if (rc == KVR_ENOMEM)
        return kvr_error_set(err, KVR_ENOMEM, "%s", nomem);
    if (rc != 0)
        return kvr_error_set(err, KVR_EINTERNAL, "re-rotating keys failed (%d)", rc);
    return 0;
}

void kvr_read_iov_piece(const kvr_read *r, size_t k, const struct iovec **iov, size_t *n,
                        size_t *bytes)
{
    if (k >= r->n_pieces) {
        *iov = NULL;
        *n = 0;
        *bytes = 0;
        return;
    }
    *iov = r->piov + r->pieces[k].iov0;
    *n = r->pieces[k].n_iov;
    *bytes = r->pieces[k].bytes;
}

int kvr_read_stage_raw(kvr_read *r, const char *ctx_id, size_t start, size_t *kbytes,
                       size_t *vbytes, kvr_error *err)
{
    size_t kb = 0, vb = 0;
    for (size_t g = 0; g < r->n_runs; g++) {
        const kvr_read_run *run = &r->runs[g];
        if (!run->rd->quant)
            return kvr_error_set(err, KVR_EUNSUPPORTED,
                                 "raw get of context '%s': tokens [%zu, %zu) are in the "
                                 "full-precision window (get them with raw = false)", ctx_id,
                                 start + run->tok, start + run->tok + run->count);
        const kvr_qhdr *h = KVR_QH(run->rd);
        uint32_t G = h->ktile;
        if (run->first % G || (g + 1 < r->n_runs && run->count % G))
            return kvr_error_set(err, KVR_EUNSUPPORTED,
                                 "raw get of context '%s': tokens from %zu do not line up "
                                 "with its %u-token key tiles (edited or a partial range)",
                                 ctx_id, start + run->tok, G);
        kb += G > 1 ? (run->count + G - 1) / G * h->krow : run->count * h->krow;
        vb += run->count * h->vrow;
    }
    *kbytes = kb;
    *vbytes = vb;
    r->out.bytes = (kb + vb) * r->nl;
    r->out.iov = kvr_mem_malloc((2 * r->n_runs + 1) * r->nl * sizeof *r->out.iov);
    if (!r->out.iov)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory for a raw get");
    for (size_t li = 0; li < r->nl; li++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t g = 0; g < r->n_runs; g++) {
                const kvr_read_run *run = &r->runs[g];
                const kvr_qhdr *h = KVR_QH(run->rd);
                uint32_t G = h->ktile;
                size_t len = kv ? run->count * h->vrow
                           : G > 1 ? (run->count + G - 1) / G * h->krow
                                   : run->count * h->krow;
                r->out.iov[r->out.n_iov++] = (struct iovec){
                    kvr_block_kv(run->rd, r->layers[li], kv, run->first), len };
            }
    return 0;
}

bool kvr_read_needs_work(const kvr_read *r)
{
    return (r->stage_need || r->staging != NULL || kvr_store_reload_pending(r->s, r->rl)) &&
           !r->worked;
}

/* One layer of the stream (any thread; layers write disjoint parts of the
 * staging). Every kind of block reads through kvr_block_read_side: plain
 * keys re-rotated from stored-at (or converted where the positions agree),
 * quantized pre-RoPE keys dequantized and rotated to their targets, values
 * converted or dequantized. Folding the temperature into a non-f32 output
 * goes through f32 scratch so k / T is rounded once. */
/* out == NULL: layer li's staging (zero-copy runs are left to the iovecs).
 * Else out is layer li's bytes of the payload in wire order (K of every run,
 * then V of every run): staged runs are computed there, zero-copy ones
 * copied. */
/* Payloads at least this large go into a caller's buffer with
 * non-temporal stores (kvr_copy_stream, kvr_rope_opts.stream): past a
 * last-level cache nothing of it is read back soon, and not reading every
 * destination line before writing it saves a third of the memory traffic.
 * The same bytes either way. */
#define STREAM_MIN_BYTES ((size_t)32 << 20)

static void copy_out(void *dst, const void *src, size_t n, bool stream)
{
    if (stream)
        kvr_copy_stream(dst, src, n);
    else
        memcpy(dst, src, n);
}

/* A one_pass run's keys of layer l into dst: one read of the block, one
 * write of dst, the rotation's table made once per run; the bits of the
 * general path (rope.h: kvr_convert_scaled, kvr_rope_reposition_delta). */
static int keys_one_pass(const kvr_read *r, const kvr_read_run *run, uint32_t l, uint8_t *dst,
                         bool stream)
{
    const kvr_model *m = r->m;
    const kvr_block *b = run->rd;
    const void *src = kvr_block_kv(b, l, 0, run->first);
    float k = run->fold ? r->inv_t : 1.0f;
    if (run->same) {
        kvr_convert_scaled(dst, r->odt, src, b->dtype, run->count * kvr_model_row(m), k);
        return 0;
    }
    kvr_rope_opts o = r->ro;
    o.stream = stream;
    return kvr_rope_reposition_delta(kvr_rope_layer(m->engine, l), dst, r->odt, src, b->dtype,
                                     run->count, m->n_kv_heads, run->delta, k, &o);
}

static int layer_to(kvr_read *r, size_t li, uint8_t *out)
{
    const kvr_model *m = r->m;
    size_t row = kvr_model_row(m);
    kvr_dtype odt = r->odt;
    size_t rowb = row * kvr_dtype_size(odt);
    uint32_t l = r->layers[li];
    uint8_t *base = out ? NULL : stage_base(r, li);
    bool stream = out && r->out.bytes >= STREAM_MIN_BYTES;
    float *scratch = NULL;
    if (r->scratch && !(scratch = kvr_mem_malloc(r->scratch * sizeof *scratch)))
        return KVR_ENOMEM;
    int rc = 0;
    size_t at = 0;   /* out: tokens of the runs before this one */
    for (size_t i = 0; i < r->n_runs && rc == 0; i++) {
        const kvr_read_run *run = &r->runs[i];
        uint8_t *ko = out ? out + at * rowb : NULL;
        uint8_t *vo = out ? out + (r->n + at) * rowb : NULL;
        at += run->count;
        if (out && run->k_zc)
            copy_out(ko, kvr_block_kv(run->rd, l, 0, run->first), run->count * rowb, stream);
        if (out && run->v_zc)
            copy_out(vo, kvr_block_kv(run->rd, l, 1, run->first), run->count * rowb, stream);
        /* A quantized block's keys and values decoded into a caller's
         * buffer stream too (kvr_block_read_side; folded keys are read
         * back for the scale, so not those). */
        kvr_rope_opts qo = r->ro, vo_opts = r->ro;
        qo.stream = stream && run->rd->quant && !run->fold;
        vo_opts.stream = stream && run->rd->quant;
        if (run->one_pass) {
            rc = keys_one_pass(r, run, l, out ? ko : base + run->k_off, stream);
        } else if (!run->k_zc) {
            uint8_t *dst = out ? ko : base + run->k_off;
            bool via = run->fold && odt != KVR_DTYPE_F32;
            /* Folded runs go a piece at a time, so the f32 keys are still in
             * cache when they are scaled and converted. Rotated pieces start
             * on multiples of 32 tokens, where the rotation reseeds its
             * tables anyway: the same bits as one call. */
            size_t piece = !run->fold ? run->count : run->same ? FOLD_PIECE_SAME : FOLD_PIECE;
            for (size_t p0 = 0; p0 < run->count && rc == 0; p0 += piece) {
                size_t pc = run->count - p0 < piece ? run->count - p0 : piece;
                size_t ne = pc * row;
                void *kd = via ? (void *)scratch : (void *)(dst + p0 * rowb);
                float *qs = scratch ? scratch + (via ? ne : 0) : NULL;
                /* the layer's own RoPE (per-layer models: sliding / NoPE layers) */
                rc = kvr_block_read_side(kvr_rope_layer(m->engine, l), m->n_kv_heads, run->rd,
                                         l, 0, run->first + (uint32_t)p0, (uint32_t)pc, kd,
                                         via ? KVR_DTYPE_F32 : odt,
                                         run->same ? NULL : r->from + run->tok + p0,
                                         r->targets + run->tok + p0, qs, &qo);
                if (rc == 0 && run->fold) {
                    float *f = kd, inv_t = r->inv_t;   /* a local: f cannot alias it */
                    size_t k = 0;
                    /* fixed-width steps the compiler turns into vector
                     * multiplies (element-wise: the same products) */
                    for (; k + 16 <= ne; k += 16)
                        for (size_t q = 0; q < 16; q++)
                            f[k + q] *= inv_t;
                    for (; k < ne; k++)
                        f[k] *= inv_t;
                    if (via)
                        kvr_convert(dst + p0 * rowb, odt, scratch, KVR_DTYPE_F32, ne);
                }
            }
        }
        if (rc == 0 && !run->v_zc)
            rc = kvr_block_read_side(m->engine, m->n_kv_heads, run->rd, l, 1, run->first,
                                     run->count, out ? vo : base + r->kst + run->v_off, odt,
                                     NULL, NULL, NULL, vo_opts.stream ? &vo_opts : NULL);
    }
    kvr_mem_free(scratch);
    return rc;
}

static int work_layer(void *ud, size_t li)
{
    return layer_to(ud, li, NULL);
}

typedef struct into_job {
    kvr_read *r;
    uint8_t  *dst;
} into_job;

static int work_layer_into(void *ud, size_t li)
{
    const into_job *j = ud;
    return layer_to(j->r, li, j->dst + li * (j->r->out.bytes / j->r->nl));
}

static size_t iov_at(const kvr_read *r, size_t li);

/* Layer li's iovecs into its part of the payload (any thread). */
static int copy_layer_into(void *ud, size_t li)
{
    const into_job *j = ud;
    const kvr_read *r = j->r;
    uint8_t *o = j->dst + li * (r->out.bytes / r->nl);
    bool stream = r->out.bytes >= STREAM_MIN_BYTES;
    for (size_t i = iov_at(r, li), e = iov_at(r, li + 1); i < e; i++) {
        copy_out(o, r->out.iov[i].iov_base, r->out.iov[i].iov_len, stream);
        o += r->out.iov[i].iov_len;
    }
    return 0;
}

int kvr_read_work_into(kvr_read *r, void *dst, size_t size, const char *what,
                       const char *nomem, kvr_error *err)
{
    if (size != r->out.bytes || (size && !dst))
        return kvr_error_set(err, KVR_EINVAL, "%s into a %zu-byte buffer: the payload is "
                             "%zu bytes", what, size, r->out.bytes);
    if (size == 0)
        return 0;
    int rc = kvr_store_reload_work(r->s, r->rl, err);
    if (rc != 0)
        return rc;
    into_job j = { r, dst };
    if ((!r->staging && !r->stage_need) || r->worked) {
        /* Nothing to compute (zero-copy or raw), or already in the staging:
         * the iovecs' bytes, in order, layer by layer on the pool as the
         * worked path splits them (no iovec spans two layers). */
        if (r->nl <= 1 || r->out.bytes % r->nl != 0) {
            uint8_t *o = dst;
            for (size_t i = 0; i < r->out.n_iov; i++) {
                copy_out(o, r->out.iov[i].iov_base, r->out.iov[i].iov_len,
                         r->out.bytes >= STREAM_MIN_BYTES);
                o += r->out.iov[i].iov_len;
            }
            return 0;
        }
        return kvr__par_for(r->nl, kvr__par_threads_for(r->out.bytes), copy_layer_into, &j);
    }
    rc = kvr__par_for(r->nl, kvr__par_threads_for(r->out.bytes), work_layer_into, &j);
    if (rc == KVR_ENOMEM)
        return kvr_error_set(err, KVR_ENOMEM, "%s", nomem);
    if (rc != 0)
        return kvr_error_set(err, KVR_EINTERNAL, "re-rotating keys failed (%d)", rc);
    return 0;
}

typedef struct layer_range {
    kvr_read *r;
    size_t    l0;
} layer_range;

static int work_layer_in(void *ud, size_t i)
{
    const layer_range *lr = ud;
    return work_layer(lr->r, lr->l0 + i);
}

int kvr_read_work(kvr_read *r, size_t l0, size_t l1, const char *nomem, kvr_error *err)
{
    assert(l0 <= l1 && l1 <= r->nl);
    if (r->worked)
        return 0;
    /* Disk tier: one batched load of the spilled blocks first (idempotent). */
    int rc = kvr_store_reload_work(r->s, r->rl, err);
    if (rc != 0)
        return rc;
    if (r->n_pieces)
        return kvr_error_set(err, KVR_EINTERNAL, "a %s staged in pieces is worked piece by "
                             "piece", r->what);
    if (stage_pending(r)) {
        /* Nobody said how the payload goes out: the whole staging, which
         * only the store's thread may reserve. */
        if (!pthread_equal(r->owner, pthread_self()))
            return kvr_error_set(err, KVR_EINTERNAL, "the staging of this %s must be reserved on "
                                 "the store's thread before work (stage it first)", r->what);
        if ((rc = kvr_read_stage_now(r, err)) != 0)
            return rc;
    }
    bool all = l0 == 0 && l1 == r->nl;
    if (r->ring_slots && l1 - l0 > r->ring_per * r->ring_slots)
        return kvr_error_set(err, KVR_EINTERNAL, "layers [%zu, %zu) do not fit the staging "
                             "ring (%zu layers)", l0, l1, r->ring_per * r->ring_slots);
    if (r->staging && l0 < l1) {
        /* Large reads split their layers across threads: re-rotation is
         * compute-bound enough that one core cannot keep up with a socket. */
        layer_range lr = { r, l0 };
        size_t bytes = all ? r->out.bytes : r->out.bytes / r->nl * (l1 - l0);
        rc = kvr__par_for(l1 - l0, kvr__par_threads_for(bytes), work_layer_in, &lr);
        if (rc == KVR_ENOMEM)
            return kvr_error_set(err, KVR_ENOMEM, "%s", nomem);
        if (rc != 0)
            return kvr_error_set(err, KVR_EINTERNAL, "re-rotating keys failed (%d)", rc);
    }
    if (all)
        r->worked = true;
    return 0;
}

/* First iovec of layer li. No iovec spans two layers, and every layer has
 * the same number of them (one layout per run); the walk is the fallback
 * should that ever change. */
static size_t iov_at(const kvr_read *r, size_t li)
{
    size_t nl = r->nl, per = r->out.bytes / nl;
    if (li == 0)
        return 0;
    if (li >= nl)
        return r->out.n_iov;
    if (r->out.n_iov % nl == 0) {
        size_t k = r->out.n_iov / nl, sum = 0;
        for (size_t i = 0; i < k; i++)
            sum += r->out.iov[i].iov_len;
        if (sum == per)
            return li * k;
    }
    size_t want = li * per, have = 0, i = 0;
    while (i < r->out.n_iov && have < want)
        have += r->out.iov[i++].iov_len;
    return i;
}

void kvr_read_iov_layers(const kvr_read *r, size_t l0, size_t l1, const struct iovec **iov,
                         size_t *n)
{
    *iov = r->out.iov;
    *n = 0;
    if (!r->out.iov || r->nl == 0 || l0 >= l1 || l1 > r->nl)
        return;
    size_t a = iov_at(r, l0), b = iov_at(r, l1);
    *iov = r->out.iov + a;
    *n = b - a;
}

void kvr_read_free(kvr_read *r)
{
    for (size_t i = 0; i < r->n_runs; i++)
        kvr_block_unlease(&r->s->pool, r->runs[i].b);
    /* After the leases: a block only the reload still references was
     * deleted meanwhile (its buffer is freed, not installed). */
    kvr_store_reload_end(r->s, r->rl);
    kvr_mem_free(r->runs);
    kvr_mem_free(r->layers);
    kvr_mem_free(r->tokens);
    kvr_mem_free(r->flags);
    kvr_mem_free(r->targets);
    kvr_mem_free(r->from);
    kvr_mem_free(r->groups);
    kvr_mem_free(r->pieces);
    kvr_mem_free(r->piov);
    if (r->ring_slots)
        kvr_mem_staging_free(r->staging);
    else if (r->staging != r->dst)
        kvr_mem_free(r->staging);
    kvr_mem_free(r->out.iov);
    memset(r, 0, sizeof *r);
}
