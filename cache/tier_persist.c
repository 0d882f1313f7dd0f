/*
 * tier_persist.c — the disk tier's records and persistence (tier.h;
 * the format and the I/O schedule are described at the top of tier.c):
 * encoding MODEL / CTX / DELETE records, the table of latest records (what
 * a checkpoint writes and what keeps disk handles alive), and the
 * persistence queue: kvr_store_persist (loop thread, after a commit)
 * encodes a context's whole state and leases its blocks without a valid
 * disk copy; kvr_persist_batch_work (a worker) spills them and appends
 * the records with one fsync; kvr_persist_batch_end (loop) installs the
 * copies and calls the done()s.
 *
 * Invariants: one batch is in flight at a time, so records reach the disk
 * in the order they were queued; a record's blocks are on disk before the
 * record (the layer syncs data first); the table changes only after a
 * successful append; a failed batch fails its requests with KVR_EIO and
 * memory keeps the change (the next record writes the whole state again).
 */
#include <inttypes.h>
#include <stddef.h>
#include <malloc.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/tier.h"

static void w_raw(wbuf *w, const void *v, size_t n)
{
    if (w->oom)
        return;
    if (w->len + n > w->cap) {
        size_t cap = w->cap ? w->cap : 256;
        while (cap < w->len + n)
            cap *= 2;
        uint8_t *p = kvr_mem_realloc(w->p, cap);
        if (!p) {
            w->oom = true;
            return;
        }
        w->p = p;
        w->cap = cap;
    }
    memcpy(w->p + w->len, v, n);
    w->len += n;
}
static void w_u32(wbuf *w, uint32_t v) { w_raw(w, &v, 4); }
static void w_u64(wbuf *w, uint64_t v) { w_raw(w, &v, 8); }
static void w_f64(wbuf *w, double v) { w_raw(w, &v, 8); }
static void w_str(wbuf *w, const char *s)
{
    size_t n = strlen(s);
    w_u32(w, (uint32_t)n);
    w_raw(w, s, n);
}
/* The head of every record: version, name, crc32c(name). */
static void w_head(wbuf *w, const char *name)
{
    w_u32(w, REC_VERSION);
    w_str(w, name);
    w_u32(w, kvr_crc32c(0, name, strlen(name)));
}

/* ---- records --------------------------------------------------------------------------- */

static void enc_model(wbuf *w, const kvr_model *m)
{
    w_head(w, m->name);
    w_u32(w, m->n_layers);
    w_u32(w, m->n_kv_heads);
    w_u32(w, m->head_dim);
    w_u32(w, (uint32_t)m->dtype);
    w_str(w, m->codec.name);
    /* The config up to its factor lists, then the lists' used entries
     * (the full struct is mostly unused longrope arrays). */
    const kvr_rope_config *rc = &m->rope_cfg;
    size_t head = offsetof(kvr_rope_config, short_factor);
    w_u32(w, (uint32_t)sizeof *rc);
    w_raw(w, rc, head);
    int32_t ns = rc->n_short_factor, nl = rc->n_long_factor;
    if (ns < 0 || ns > KVR_ROPE_MAX_HEAD_DIM / 2)
        ns = 0;
    if (nl < 0 || nl > KVR_ROPE_MAX_HEAD_DIM / 2)
        nl = 0;
    w_raw(w, rc->short_factor, (size_t)ns * sizeof(double));
    w_raw(w, rc->long_factor, (size_t)nl * sizeof(double));
    w_u64(w, m->fingerprint);
}

/* The next of c's blocks from extent *i on that is not marked ep yet (it
 * is marked now), or NULL: each block once, in first-use order. */
static kvr_block *next_unmarked(const kvr_ctx *c, size_t *i, uint32_t ep)
{
    for (; *i < c->n_ext; (*i)++) {
        kvr_block *b = c->ext[*i].block;
        if (b->mark != ep) {
            b->mark = ep;
            (*i)++;
            return b;
        }
    }
    return NULL;
}

/* Encodes c's state. Blocks without a valid disk copy get a zero handle
 * and an entry in *sp (leased) so the batch writes and patches them. */
static int enc_ctx(kvr_store *s, kvr_ctx *c, pjob *j)
{
    wbuf *w = &j->rec;
    w_head(w, c->id);
    w_str(w, c->model->name);
    w_u64(w, c->model->fingerprint);
    w_str(w, c->codec.name);
    w_u32(w, (uint32_t)c->dtype);
    w_u32(w, c->pinned ? 1u : 0u);
    w_u64(w, c->created_ms);
    w_u64(w, c->n_protected);
    w_u64(w, c->n_tokens);
    w_f64(w, c->q_sse[0]);
    w_f64(w, c->q_sse[1]);
    w_f64(w, c->q_ss[0]);
    w_f64(w, c->q_ss[1]);
    size_t lb = kvr_layout_blob_size();
    uint8_t *blob = kvr_mem_malloc(lb);
    if (!blob)
        return KVR_ENOMEM;
    if (kvr_layout_blob_get(c, blob)) {
        w_u32(w, (uint32_t)lb);
        w_raw(w, blob, lb);
    } else {
        w_u32(w, 0);
    }
    kvr_mem_free(blob);
    /* Unique blocks, in first-use order. */
    uint32_t ep = ++s->epoch;
    uint32_t nb = 0;
    kvr_block *b;
    for (size_t i = 0; (b = next_unmarked(c, &i, ep)) != NULL;)
        b->mcount = nb++;
    j->sp = kvr_mem_calloc(nb ? nb : 1, sizeof *j->sp);
    if (!j->sp)
        return KVR_ENOMEM;
    w_u32(w, nb);
    ep = ++s->epoch;
    for (size_t i = 0; (b = next_unmarked(c, &i, ep)) != NULL;) {
        uint8_t hb[KVR_DISK_HANDLE_BYTES];
        memset(hb, 0, sizeof hb);
        if (b->disk && b->disk->used == b->used) {
            kvr_disk_handle_encode(&b->disk->h, hb);
        } else {
            kvr_block_hold(b);
            j->sp[j->n_sp++] = (pspill){ b, kvr_tier_image_buf(b), b->used, w->len };
        }
        w_raw(w, hb, sizeof hb);
        w_u32(w, b->used);
        w_u32(w, b->cap);
        w_u32(w, (uint32_t)b->dtype);
        w_u32(w, b->quant ? 1u : 0u);
    }
    /* b->mcount still holds the index from the first pass (the second
     * pass did not touch it). */
    w_u32(w, (uint32_t)c->n_ext);
    for (size_t i = 0; i < c->n_ext; i++) {
        const kvr_extent *e = &c->ext[i];
        w_u32(w, e->block->mcount);
        w_u32(w, e->first);
        w_u32(w, e->count);
        w_u32(w, e->flags);
        w_u64(w, (uint64_t)e->pos_delta);
    }
    /* The blocks' metadata checksums, in the same order (tier.h). */
    w_u32(w, REC_MCRC_TAG);
    ep = ++s->epoch;
    for (size_t i = 0; (b = next_unmarked(c, &i, ep)) != NULL;)
        w_u32(w, kvr_tier_meta_crc(b->quant ? b->data : NULL, b->stored_pos, b->cap, b->used));
    return w->oom ? KVR_ENOMEM : 0;
}

/* Handles a CTX record points at (for the table's refs). */
static int ctx_rec_handles(const uint8_t *p, size_t len, kvr_disk_handle **out, size_t *n)
{
    rbuf r = { p, len, 0, false };
    char tmp[KVR_ID_MAX + 1];
    char codec[KVR_CODEC_NAME_MAX];
    r_head(&r, tmp, sizeof tmp);
    if (r.bad)
        return KVR_EINVAL;
    r_str(&r, tmp, sizeof tmp);
    r_u64(&r);
    r_str(&r, codec, sizeof codec);
    r_raw(&r, 4 + 4 + 8 + 8 + 8 + 32);
    uint32_t lb = r_u32(&r);
    r_raw(&r, lb);
    uint32_t nb = r_u32(&r);
    if (r.bad || nb > len / (KVR_DISK_HANDLE_BYTES + 16))
        return KVR_EINVAL;
    kvr_disk_handle *h = kvr_mem_malloc((nb ? nb : 1) * sizeof *h);
    if (!h)
        return KVR_ENOMEM;
    for (uint32_t i = 0; i < nb; i++) {
        const uint8_t *hb = r_raw(&r, KVR_DISK_HANDLE_BYTES);
        r_raw(&r, 16);
        if (r.bad)
            break;
        kvr_disk_handle_decode(hb, &h[i]);
    }
    if (r.bad) {
        kvr_mem_free(h);
        return KVR_EINVAL;
    }
    *out = h;
    *n = nb;
    return 0;
}

/* ---- table ----------------------------------------------------------------------------------- */

void kvr_tier_tab_init(table *tb)
{
    memset(tb, 0, sizeof *tb);
    kvr_list_init(&tb->recs);
}

void kvr_tier_tab_drop(table *tb, trec *r)
{
    kvr_tier_tab_refs(tb, r, -1);
    kvr_list_remove(&r->link);
    if (r->type == REC_CTX)
        tb->n_ctx--;
    kvr_mem_free(r->p);
    kvr_mem_free(r);
}

void kvr_tier_tab_refs(table *tb, const trec *r, int delta)
{
    if (r->type != REC_CTX)
        return;
    kvr_disk_handle *h = NULL;
    size_t n = 0;
    if (ctx_rec_handles(r->p, r->len, &h, &n) != 0)
        return;
    for (size_t i = 0; i < n; i++)
        kvr_tier_hmap_add(&tb->refs, hkey(&h[i]), delta);
    kvr_mem_free(h);
}

static void tab_remove(table *tb, uint32_t type, const char *name)
{
    trec *r;
    kvr_tier_tab_foreach(r, tb) {
        if (r->type == type && strcmp(r->name, name) == 0) {
            kvr_tier_tab_drop(tb, r);
            return;
        }
    }
}

/* Takes a copy of p. Models go before contexts (a checkpoint replays in
 * order); the table is a list: O(records) per update, fine for the
 * numbers of persistent contexts a daemon holds (a hash is the upgrade). */
static int tab_put(table *tb, uint32_t type, const char *name, const void *p, size_t len)
{
    trec *r = kvr_mem_calloc(1, sizeof *r);
    uint8_t *copy = kvr_mem_malloc(len ? len : 1);
    if (!r || !copy) {
        kvr_mem_free(r);
        kvr_mem_free(copy);
        return KVR_ENOMEM;
    }
    memcpy(copy, p, len);
    r->type = type;
    snprintf(r->name, sizeof r->name, "%s", name);
    r->p = copy;
    r->len = len;
    r->order = ++tb->n_put;
    tab_remove(tb, type, name);
    kvr_tier_tab_refs(tb, r, +1);
    if (type == REC_MODEL) {
        kvr_list_insert_head(&tb->recs, &r->link);
    } else {
        kvr_list *at = tb->recs.next;      /* before the first context */
        while (at != &tb->recs && kvr_list_entry(at, trec, link)->type == REC_MODEL)
            at = at->next;
        kvr_list_insert_before(at, &r->link);
        tb->n_ctx++;
    }
    return 0;
}

void kvr_tier_tab_free(table *tb)
{
    if (tb->recs.next) {                   /* initialised (kvr_tier_tab_init) */
        kvr_list *n;
        while ((n = kvr_list_first(&tb->recs))) {
            trec *r = kvr_list_entry(n, trec, link);
            kvr_list_remove(n);
            kvr_mem_free(r->p);
            kvr_mem_free(r);
        }
    }
    kvr_tier_hmap_free(&tb->refs);
    kvr_tier_tab_init(tb);
}

/* Name of a record (its id / model name), from the payload. */
bool kvr_tier_rec_name(const void *p, size_t len, char *out)
{
    rbuf r = { p, len, 0, false };
    r_head(&r, out, KVR_ID_MAX + 1);
    return !r.bad && out[0];
}

void kvr_tier_tab_apply(table *tb, uint32_t type, const void *p, size_t len)
{
    char name[KVR_ID_MAX + 1];
    if (!kvr_tier_rec_name(p, len, name))
        return;
    if (type == REC_DELETE)
        tab_remove(tb, REC_CTX, name);
    else
        tab_put(tb, type, name, p, len);
}

int kvr_tier_snapshot_cb(void *arg, kvr_disk_cp *cp)
{
    table *tb = arg;
    trec *r;
    kvr_tier_tab_foreach(r, tb) {
        int rc = kvr_disk_cp_add(cp, r->type, r->p, r->len);
        if (rc == 0 && r->type == REC_MODEL)    /* twice, as appended */
            rc = kvr_disk_cp_add(cp, r->type, r->p, r->len);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* ---- persistence: queue, batches ----------------------------------------------------------- */

bool kvr_tier_model_logged(kvr_tier *t, const kvr_model *m)
{
    for (size_t i = 0; i < t->n_logged; i++)
        if (t->logged[i] == m)
            return true;
    return false;
}

bool kvr_tier_model_persisted(const kvr_store *s, const kvr_model *m)
{
    return s->tier && kvr_tier_model_logged(s->tier, m);
}

static void model_unlog(kvr_tier *t, const kvr_model *m)
{
    for (size_t i = 0; i < t->n_logged; i++)
        if (t->logged[i] == m) {
            t->logged[i] = t->logged[--t->n_logged];
            return;
        }
}

int kvr_tier_model_log_mark(kvr_tier *t, kvr_model *m)
{
    if (t->n_logged == t->cap_logged) {
        size_t cap = t->cap_logged ? t->cap_logged * 2 : 8;
        kvr_model **p = kvr_mem_realloc(t->logged, cap * sizeof *p);
        if (!p)
            return KVR_ENOMEM;
        t->logged = p;
        t->cap_logged = cap;
    }
    t->logged[t->n_logged++] = m;
    return 0;
}

void kvr_tier_job_free(kvr_store *s, pjob *j)
{
    for (size_t i = 0; i < j->n_sp; i++)
        kvr_block_unhold(&s->pool, j->sp[i].b);
    kvr_mem_free(j->sp);
    kvr_mem_free(j->rec.p);
    kvr_mem_free(j);
}

bool kvr_store_ctx_persistent(const kvr_store *s, const char *ctx_id)
{
    kvr_ctx *c = kvr_store_ctx_find(s, ctx_id);
    return s->tier && c && !c->pending && c->persist;
}

int kvr_store_persist(kvr_store *s, const char *ctx_id, kvr_persist_done_fn done, void *arg,
                      kvr_error *err)
{
    kvr_tier *t = s->tier;
    if (!t || !ctx_id)
        return 0;
    kvr_ctx *c = kvr_store_ctx_find(s, ctx_id);
    size_t di = SIZE_MAX;
    for (size_t i = 0; i < t->n_deleted; i++)
        if (strcmp(t->deleted[i], ctx_id) == 0)
            di = i;
    bool live = c && !c->pending && c->persist;
    if (!live && di == SIZE_MAX)
        return 0;
    pjob *mj = NULL, *j = kvr_mem_calloc(1, sizeof *j);
    if (!j)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory logging '%s'", ctx_id);
    snprintf(j->name, sizeof j->name, "%s", ctx_id);
    j->done = done;
    j->arg = arg;
    int rc = 0;
    if (di != SIZE_MAX && !live) {
        /* Deleted (and not re-created as a persistent context since). */
        j->type = REC_DELETE;
        w_head(&j->rec, ctx_id);
        if (j->rec.oom)
            rc = KVR_ENOMEM;
    } else {
        j->type = REC_CTX;
        if (!kvr_tier_model_logged(t, c->model)) {
            mj = kvr_mem_calloc(1, sizeof *mj);
            if (!mj) {
                rc = KVR_ENOMEM;
            } else {
                mj->type = REC_MODEL;
                snprintf(mj->name, sizeof mj->name, "%s", c->model->name);
                mj->model = c->model;
                enc_model(&mj->rec, c->model);
                if (mj->rec.oom || kvr_tier_model_log_mark(t, c->model) != 0)
                    rc = KVR_ENOMEM;
            }
        }
        if (rc == 0)
            rc = enc_ctx(s, c, j);
        if (rc == 0 && j->rec.len > KVR_DISK_MAX_RECORD)
            rc = kvr_error_set(err, KVR_ETOOLARGE, "context '%s': its record of %zu bytes "
                               "is over the log's limit", ctx_id, j->rec.len);
    }
    if (rc != 0) {
        if (mj && mj->model)
            model_unlog(t, mj->model);
        if (mj)
            kvr_tier_job_free(s, mj);
        kvr_tier_job_free(s, j);
        if (rc == KVR_ENOMEM)
            kvr_error_set(err, rc, "out of memory logging '%s'", ctx_id);
        return rc;
    }
    if (di != SIZE_MAX) {
        kvr_mem_free(t->deleted[di]);
        t->deleted[di] = t->deleted[--t->n_deleted];
    }
    if (mj)
        kvr_list_insert_tail(&t->queue, &mj->link);
    kvr_list_insert_tail(&t->queue, &j->link);
    return 1;
}

kvr_persist_batch *kvr_store_persist_take(kvr_store *s)
{
    kvr_tier *t = s->tier;
    if (!t || t->in_flight || kvr_list_empty(&t->queue))
        return NULL;
    kvr_persist_batch *b = kvr_mem_calloc(1, sizeof *b);
    if (!b)
        return NULL;
    b->s = s;
    kvr_list_init(&b->jobs);
    kvr_list_move_tail(&b->jobs, &t->queue);
    tier_jobs_foreach(j, &b->jobs)
        b->n_jobs++;
    t->in_flight = true;
    return b;
}

void kvr_persist_batch_work(kvr_persist_batch *b)
{
    kvr_tier *t = b->s->tier;
    size_t total = 0;
    tier_jobs_foreach(j, &b->jobs)
        total += j->n_sp;
    b->u = kvr_mem_calloc(total ? total : 1, sizeof *b->u);
    b->hs = kvr_mem_calloc(total ? total : 1, sizeof *b->hs);
    kvr_disk_buf *bufs = kvr_mem_calloc(total ? total : 1, sizeof *bufs);
    /* MODEL records go twice: every context of the model needs it. */
    kvr_disk_rec_in *recs = kvr_mem_calloc(b->n_jobs ? 2 * b->n_jobs : 1, sizeof *recs);
    size_t *idx = kvr_mem_calloc(total ? total : 1, sizeof *idx);
    hmap seen = { 0 };
    if (!b->u || !b->hs || !bufs || !recs || !idx) {
        b->rc = kvr_error_set(&b->err, KVR_ENOMEM, "out of memory writing records");
        goto out;
    }
    /* Unique blocks of the batch (a fork's blocks can be in two records). */
    size_t k = 0;
    tier_jobs_foreach(j, &b->jobs)
        for (size_t i = 0; i < j->n_sp; i++) {
            uint64_t key = (uint64_t)(uintptr_t)j->sp[i].b;
            hnode *n = kvr_tier_hmap_find(&seen, key);
            if (n && b->u[n->val - 1]->used == j->sp[i].used) {
                idx[k++] = (size_t)n->val - 1;
                continue;
            }
            if (!n && kvr_tier_hmap_add(&seen, key, (int64_t)b->n_u + 1) != 0) {
                b->rc = kvr_error_set(&b->err, KVR_ENOMEM, "out of memory writing records");
                goto out;
            }
            idx[k++] = b->n_u;
            bufs[b->n_u] = j->sp[i].img;
            b->u[b->n_u++] = &j->sp[i];
        }
    if (b->n_u) {
        b->rc = kvr_disk_spill(t->d, bufs, b->n_u, b->hs, false, &b->err);
        if (b->rc != 0)
            goto out;
        b->spilled = true;
    }
    k = 0;
    size_t r = 0;
    tier_jobs_foreach(j, &b->jobs) {
        for (size_t i = 0; i < j->n_sp; i++)
            kvr_disk_handle_encode(&b->hs[idx[k++]], j->rec.p + j->sp[i].off);
        recs[r] = (kvr_disk_rec_in){ j->type, j->rec.p, j->rec.len };
        if (j->type == REC_MODEL) {
            r++;
            recs[r] = recs[r - 1];
        }
        r++;
    }
    b->rc = kvr_disk_log_append(t->d, recs, r, NULL, &b->err);
    if (b->rc != 0)
        goto out;
    tier_jobs_foreach(j, &b->jobs)
        kvr_tier_tab_apply(&t->tab, j->type, j->rec.p, j->rec.len);
    if (kvr_disk_log_wants_checkpoint(t->d)) {
        kvr_error ce;
        if (kvr_disk_checkpoint(t->d, kvr_tier_snapshot_cb, &t->tab, &ce) == 0)
            b->checkpointed = true;
    }
out:
    kvr_tier_hmap_free(&seen);
    kvr_mem_free(bufs);
    kvr_mem_free(recs);
    kvr_mem_free(idx);
}

void kvr_persist_batch_end(kvr_persist_batch *b)
{
    kvr_store *s = b->s;
    kvr_tier *t = s->tier;
    t->in_flight = false;
    if (b->spilled) {
        for (size_t i = 0; i < b->n_u; i++) {
            kvr_block *blk = b->u[i]->b;
            if (kvr_tier_set_copy(s, blk, &b->hs[i], b->u[i]->used) != 0)
                kvr_disk_free(t->d, &b->hs[i], NULL);
        }
    }
    if (b->checkpointed)
        t->n_checkpoints++;
    for (kvr_list *n; (n = kvr_list_first(&b->jobs));) {
        kvr_list_remove(n);
        pjob *j = kvr_list_entry(n, pjob, link);
        if (b->rc == 0) {
            t->n_records++;
        } else if (j->model) {
            model_unlog(t, j->model);
        }
        if (j->done) {
            kvr_error e = b->err;
            if (b->rc != 0 && b->rc != KVR_ENOMEM) {
                char m[sizeof e.msg];
                snprintf(m, sizeof m, "%s", b->err.msg);
                kvr_error_set(&e, KVR_EIO, "not durable: the disk write failed (%.200s); the "
                              "change is in memory but may be lost on restart", m);
            }
            j->done(j->arg, b->rc == 0 ? 0 : b->rc == KVR_ENOMEM ? KVR_ENOMEM : KVR_EIO, &e);
        }
        kvr_tier_job_free(s, j);
    }
    if (b->rc != 0)
        t->n_errors++;
    kvr_tier_pending_sweep(s);
    kvr_mem_free(b->u);
    kvr_mem_free(b->hs);
    kvr_mem_free(b);
}

void kvr_store_persist_flush(kvr_store *s)
{
    kvr_persist_batch *b;
    while ((b = kvr_store_persist_take(s)) != NULL) {
        kvr_persist_batch_work(b);
        kvr_persist_batch_end(b);
    }
}

