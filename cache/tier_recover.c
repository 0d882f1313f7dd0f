/*
 * tier_recover.c — opening the disk tier (kvr_store_tier_open, tier.h):
 * the log is replayed into the table of latest records, then models and
 * contexts are rebuilt in the store from it (blocks shared between
 * contexts become one block again); records that fail their checks are
 * quarantined, and a context whose newest record was lost is restored
 * from its previous one with every token flagged stale (and logged again,
 * so the mark survives the next restart). A recovery that met junk ends
 * with a checkpoint.
 *
 * Blocks come back spilled: recovery reads of each block only its
 * metadata (token ids, positions, groups: what the indexes need) and a
 * quantized block's header, with the extent's trailer in the same request
 * (kvr_disk_claim_peek_n), and checks them against the checksums the CTX
 * record carries (tier.h: REC_MCRC_TAG); the K/V stays on disk until a
 * read reloads it, and that load checks the extent's checksum over all of
 * it. So the check of a block's K/V is deferred to its first use: a block
 * whose K/V is corrupt fails the read that needs it with KVR_EIO ("failed
 * its checksum"), every time, and nothing else (the context's other
 * blocks, other contexts, its metadata: match still finds it, get refuses
 * it, never serving it partly). Records written before the checksums
 * (and blocks in v1 segments) are read whole as before: K/V and metadata,
 * checksum verified, then built in memory while under the cap.
 * (10^6 tokens of 256 B: 0.3-0.9 s from a cold page cache, 3.4-5.0 s
 * read whole, on the development VM; bench_scale prints both side by
 * side, and the first get of every context after it: the deferred reads.)
 *
 * Invariants: recovery runs before any context exists, on the opening
 * thread; a context whose metadata or extents cannot be read, or whose
 * metadata fails its checksum, is dropped (counted and reported), never
 * served partly; on failure every context rebuilt so far goes and the
 * directory is left as it was.
 */
#include "base/clock.h"
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

/* ---- recovery --------------------------------------------------------------------------------- */

/* Stale marks. A corrupt record in the middle of the log may have been a
 * context's newest acknowledged state: serving the record before it would
 * roll the context back silently. When the corrupt record's head (version 2:
 * name + crc32c(name)) is intact, the loss is attributed to that id;
 * otherwise to every context whose latest good record came before it. A
 * context so affected that still has an older record is restored from it
 * with every token flagged KVR_TOKEN_STALE | KVR_TOKEN_APPROX (the mark is
 * logged with its next record, so it survives restarts); one with no older
 * record is reported lost. Both are reported by id. A torn tail (a last
 * record that runs past the end of the file) was never acknowledged and
 * marks nothing. */
#define RECOV_MAX_LOST 64

typedef struct recov {
    kvr_store *s;
    kvr_tier  *t;
    uint64_t   bad;
    uint64_t   unattributed_at;   /* table's n_put at the last unattributed loss */
    size_t     n_lost;
    struct { char name[KVR_ID_MAX + 1]; } lost[RECOV_MAX_LOST];
} recov;

static void on_record(void *arg, kvr_disk *d, const kvr_disk_record *r)
{
    (void)d;
    recov *rv = arg;
    char name[KVR_ID_MAX + 1];
    if ((r->type != REC_MODEL && r->type != REC_CTX && r->type != REC_DELETE) ||
        !kvr_tier_rec_name(r->payload, r->len, name)) {
        rv->bad++;
        kvr_tier_log(rv->t, KVR_TIER_LOG_WARN, "disk: record seq %" PRIu64 " (type %u, %zu bytes) "
             "is not one kvroped wrote: skipped", r->seq, r->type, r->len);
        return;
    }
    kvr_tier_tab_apply(&rv->t->tab, r->type, r->payload, r->len);
    /* A later good record of a name supersedes a loss seen before it. */
    for (size_t i = 0; i < rv->n_lost;)
        if (!strcmp(rv->lost[i].name, name))
            rv->lost[i] = rv->lost[--rv->n_lost];
        else
            i++;
}

/* Which context a corrupt region [offset, offset+bytes) of the log held. */
static void attribute_loss(recov *rv, const char *file, uint64_t offset, uint64_t bytes)
{
    kvr_tier *t = rv->t;
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", t->dir, file);
    uint8_t h[24 + 4 + 4 + KVR_ID_MAX + 4];
    size_t want = bytes < sizeof h ? (size_t)bytes : sizeof h;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    memset(&st, 0, sizeof st);
    ssize_t got = -1;
    if (fd >= 0 && fstat(fd, &st) == 0)
        got = pread(fd, h, want, (off_t)offset);
    if (fd >= 0)
        close(fd);
    if (got < 0) {
        rv->unattributed_at = t->tab.n_put;
        return;
    }
    uint32_t len = got >= 24 ? (uint32_t)h[20] | (uint32_t)h[21] << 8 |
                                   (uint32_t)h[22] << 16 | (uint32_t)h[23] << 24
                             : UINT32_MAX;
    /* The tail: a record that is not all there was never acknowledged. */
    if (offset + bytes >= (uint64_t)st.st_size && (got < 24 || 24ull + len > bytes))
        return;
    uint32_t type = got >= 20 ? (uint32_t)h[16] | (uint32_t)h[17] << 8 |
                                    (uint32_t)h[18] << 16 | (uint32_t)h[19] << 24
                              : 0;
    char name[KVR_ID_MAX + 1];
    rbuf b = { h + 24, got > 24 ? (size_t)got - 24 : 0, 0, false };
    if (got > 24 && h[24] == 2)
        r_head(&b, name, sizeof name);
    else
        b.bad = true;
    bool whole = 24ull + len == bytes;     /* the region is exactly that record */
    if (b.bad || !name[0] || (type != REC_CTX && type != REC_DELETE) || !whole ||
        rv->n_lost == RECOV_MAX_LOST) {
        if (!b.bad && name[0] && type == REC_MODEL && whole)
            kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: a record of model '%s' was lost: the model "
                 "is restored from its previous record", name);
        else
            rv->unattributed_at = t->tab.n_put;
        return;
    }
    snprintf(rv->lost[rv->n_lost++].name, sizeof rv->lost[0].name, "%s", name);
}

static void on_corrupt(void *arg, const char *file, uint64_t offset, uint64_t bytes,
                       const char *reason)
{
    recov *rv = arg;
    kvr_tier_log(rv->t, KVR_TIER_LOG_WARN, "disk: %s offset %" PRIu64 ": %" PRIu64 " bytes "
         "quarantined: %s", file, offset, bytes, reason);
    attribute_loss(rv, file, offset, bytes);
}

/* After the replay: which contexts of the table lost a newer state. */
static void mark_stale(recov *rv)
{
    kvr_tier *t = rv->t;
    for (size_t i = 0; i < rv->n_lost; i++) {
        trec *hit = NULL, *r;
        kvr_tier_tab_foreach(r, &t->tab)
            if (r->type == REC_CTX && !strcmp(r->name, rv->lost[i].name))
                hit = r;
        bool dup = false;         /* lost twice: report once */
        for (size_t k = i + 1; k < rv->n_lost; k++)
            dup |= !strcmp(rv->lost[k].name, rv->lost[i].name);
        if (dup)
            continue;
        if (hit) {
            hit->stale = true;
        } else {
            t->rec.lost_contexts++;
            kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': its newest record failed its "
                 "checksum and no older one exists: the context is lost", rv->lost[i].name);
        }
    }
    trec *r;
    if (rv->unattributed_at)
        kvr_tier_tab_foreach(r, &t->tab)
            if (r->type == REC_CTX && r->order <= rv->unattributed_at)
                r->stale = true;
}

static int recover_model(kvr_store *s, kvr_tier *t, const trec *r)
{
    rbuf b = { r->p, r->len, 0, false };
    char name[KVR_ID_MAX + 1], codec[KVR_CODEC_NAME_MAX];
    kvr_model_desc d;
    memset(&d, 0, sizeof d);
    r_head(&b, name, sizeof name);
    d.name = name;
    d.n_layers = r_u32(&b);
    d.n_kv_heads = r_u32(&b);
    d.head_dim = r_u32(&b);
    d.dtype = (kvr_dtype)r_u32(&b);
    r_str(&b, codec, sizeof codec);
    d.codec = codec;
    uint32_t rs = r_u32(&b);
    size_t head = offsetof(kvr_rope_config, short_factor);
    const void *rope = rs == sizeof d.rope ? r_raw(&b, head) : NULL;
    if (rope) {
        memcpy(&d.rope, rope, head);
        int32_t ns = d.rope.n_short_factor, nl = d.rope.n_long_factor;
        if (ns < 0 || ns > KVR_ROPE_MAX_HEAD_DIM / 2 || nl < 0 ||
            nl > KVR_ROPE_MAX_HEAD_DIM / 2) {
            b.bad = true;
        } else {
            const void *sf = r_raw(&b, (size_t)ns * sizeof(double));
            const void *lf = r_raw(&b, (size_t)nl * sizeof(double));
            if (sf && ns)
                memcpy(d.rope.short_factor, sf, (size_t)ns * sizeof(double));
            if (lf && nl)
                memcpy(d.rope.long_factor, lf, (size_t)nl * sizeof(double));
        }
    }
    uint64_t fp = r_u64(&b);
    if (b.bad || !rope) {
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: model record '%s' is unreadable: skipped", name);
        return KVR_EINVAL;
    }
    kvr_model_info mi;
    kvr_error e;
    int rc = kvr_store_model_register(s, &d, &mi, &e);
    if (rc != 0) {
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: model '%s' not restored: %s", name, e.msg);
        return rc;
    }
    if (mi.fingerprint != fp) {
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: model '%s' restored with fingerprint %016" PRIx64
             " but its record says %016" PRIx64, name, mi.fingerprint, fp);
        return KVR_EFINGERPRINT;
    }
    kvr_model *m = kvr_store_model(s, name);
    if (m && !kvr_tier_model_logged(t, m))
        kvr_tier_model_log_mark(t, m);
    t->rec.models++;
    return 0;
}

typedef struct rblk {
    kvr_disk_handle h;
    uint32_t used, cap, dtype, quant;
    kvr_block *b;        /* shared (already recovered) or new */
    bool fresh;          /* claimed here, no block yet */
    bool built;          /* block built here (holds our reference) */
    uint32_t mcrc;       /* its metadata's checksum (the record's, tier.h) */
    uint8_t *meta, *qh;  /* peeked: its metadata, its quantized header */
} rblk;

/* Claims the blocks ch[0..nc) (rb[ci[k]]) reading only their metadata and
 * quantized headers (kvr_disk_claim_peek_n), checks those against the
 * record's checksums and builds each block spilled: its K/V stays on disk
 * until a read reloads it, and that load checks the whole extent. 0; or
 * KVR_EUNSUPPORTED with nothing claimed (a v1 segment: the caller reads
 * the blocks whole); or an error, logged (the caller drops the context;
 * what was claimed is marked fresh or built, as recover_ctx frees it). */
static int recover_spilled(kvr_store *s, kvr_tier *t, kvr_model *m, const char *id, rblk *rb,
                           const kvr_disk_handle *ch, const uint32_t *ci, size_t nc,
                           hmap *blocks)
{
    kvr_disk_peek *pk = kvr_mem_calloc(nc, sizeof *pk);
    int rc = pk ? 0 : KVR_ENOMEM;
    for (size_t k = 0; k < nc && rc == 0; k++) {
        rblk *x = &rb[ci[k]];
        size_t ml = (size_t)x->cap * KVR_BLOCK_META_SLOT;
        x->meta = kvr_mem_aligned(KVR_BLOCK_ALIGN, ml);
        x->qh = x->quant ? kvr_mem_aligned(KVR_BLOCK_ALIGN, KVR_QHDR_BYTES) : NULL;
        if (!x->meta || (x->quant && !x->qh))
            rc = KVR_ENOMEM;
        pk[k] = (kvr_disk_peek){ x->qh, x->qh ? KVR_QHDR_BYTES : 0, x->meta, ml };
    }
    if (rc) {
        kvr_mem_free(pk);
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': out of memory: dropped", id);
        return rc;
    }
    size_t got = 0;
    kvr_error e;
    rc = kvr_disk_claim_peek_n(t->d, ch, pk, nc, &got, &e);
    kvr_mem_free(pk);
    if (rc == KVR_EUNSUPPORTED && got == 0)
        return rc;
    if (rc != 0)
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': block %u: %s: dropped", id,
             ci[got], e.msg);
    for (size_t k = 0; k < got; k++)
        rb[ci[k]].fresh = true;
    for (size_t k = 0; k < got && rc == 0; k++) {
        rblk *x = &rb[ci[k]];
        if (kvr_tier_meta_crc(x->qh, x->meta, x->cap, x->used) != x->mcrc) {
            kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': block %u (seg %" PRIu32
                 " off %" PRIu64 "): its metadata failed its checksum: dropped", id, ci[k],
                 x->h.seg, x->h.off);
            return KVR_EIO;
        }
        /* The block is made as a reload's source would be, then its
         * buffers swapped for the spilled state's (header, metadata):
         * block.c's constructor adopts a whole image only, so two
         * placeholders stand for it until the swap frees them. */
        kvr_block_geom g = { .cap = x->cap, .row = kvr_model_row(m), .n_layers = m->n_layers,
                             .dtype = (kvr_dtype)x->dtype, .quant = x->quant != 0,
                             .tenant = m->tenant };
        size_t kv_len = x->h.len - (size_t)x->cap * KVR_BLOCK_META_SLOT;
        uint8_t *p0 = kvr_mem_malloc(1), *p1 = kvr_mem_malloc(1);
        kvr_block *blk = p0 && p1 ? kvr_block_create(&s->pool, &g, p0, kv_len, p1, x->used)
                                  : NULL;
        kvr_block_disk *bd = blk ? kvr_mem_malloc(sizeof *bd) : NULL;
        if (!bd) {
            if (blk)
                kvr_block_unref(&s->pool, blk);    /* frees p0, p1 */
            else {
                kvr_mem_free(p0);
                kvr_mem_free(p1);
            }
            kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': out of memory: dropped", id);
            return KVR_ENOMEM;
        }
        kvr_block_set_data(&s->pool, blk, x->qh, x->meta, true);
        x->qh = x->meta = NULL;
        bd->h = x->h;
        bd->used = blk->used;
        blk->disk = bd;
        x->b = blk;
        x->fresh = false;     /* owned by the block now (freed with it) */
        x->built = true;
        t->rec.blocks++;
        t->rec.bytes += x->h.len;
        kvr_tier_hmap_add(blocks, hkey(&x->h), (int64_t)(uintptr_t)blk);
    }
    return rc;
}

/* Rebuilds one context from its record; on failure nothing of it stays. */
static int recover_ctx(kvr_store *s, kvr_tier *t, hmap *blocks, const trec *r)
{
    rbuf b = { r->p, r->len, 0, false };
    char id[KVR_ID_MAX + 1], model[KVR_ID_MAX + 1], codec[KVR_CODEC_NAME_MAX];
    r_head(&b, id, sizeof id);
    r_str(&b, model, sizeof model);
    uint64_t fp = r_u64(&b);
    r_str(&b, codec, sizeof codec);
    uint32_t dtype = r_u32(&b), flags = r_u32(&b);
    uint64_t created = r_u64(&b), nprot = r_u64(&b), ntok = r_u64(&b);
    double qs[4];
    for (int i = 0; i < 4; i++)
        qs[i] = r_f64(&b);
    uint32_t lb = r_u32(&b);
    const void *blob = lb ? r_raw(&b, lb) : NULL;
    if (lb > kvr_layout_blob_size())     /* shorter: an older record */
        b.bad = true;
    uint32_t nb = r_u32(&b);
    if (b.bad || nb > r->len / (KVR_DISK_HANDLE_BYTES + 16)) {
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context record '%s' is unreadable: dropped", id);
        return KVR_EINVAL;
    }
    kvr_model *m = kvr_store_model(s, model);
    if (!m || m->fingerprint != fp) {
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': model '%s' %s: dropped", id, model,
             m ? "has another fingerprint" : "was not restored");
        return KVR_ENOMODEL;
    }
    rblk *rb = kvr_mem_calloc(nb ? nb : 1, sizeof *rb);
    if (!rb)
        return KVR_ENOMEM;
    int rc = 0;
    for (uint32_t i = 0; i < nb && !b.bad; i++) {
        const uint8_t *hb = r_raw(&b, KVR_DISK_HANDLE_BYTES);
        if (hb)
            kvr_disk_handle_decode(hb, &rb[i].h);
        rb[i].used = r_u32(&b);
        rb[i].cap = r_u32(&b);
        rb[i].dtype = r_u32(&b);
        rb[i].quant = r_u32(&b);
        if (rb[i].used > rb[i].cap || rb[i].cap == 0 || rb[i].cap > (1u << 20) ||
            (size_t)rb[i].cap * 16u + (rb[i].quant ? KVR_QHDR_BYTES : 0) > rb[i].h.len ||
            kvr_dtype_size((kvr_dtype)rb[i].dtype) == 0)
            b.bad = true;
    }
    uint32_t ne = r_u32(&b);
    if (b.bad || ne > r->len / 24) {
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context record '%s' is unreadable: dropped", id);
        kvr_mem_free(rb);
        return KVR_EINVAL;
    }
    /* The blocks' metadata checksums after the extents (tier.h): with
     * them the blocks come back spilled, their K/V not read. */
    rbuf mb = b;
    r_raw(&mb, (size_t)ne * 24u);
    bool lazy = !mb.bad && mb.len - mb.off >= 4u + (size_t)nb * 4u &&
                r_u32(&mb) == REC_MCRC_TAG;
    for (uint32_t i = 0; i < nb && lazy; i++)
        rb[i].mcrc = r_u32(&mb);
    if (getenv("KVR_TIER_RECOVER_EAGER"))    /* tests and bench_scale: the whole read */
        lazy = false;
    /* Claim and load the blocks not already recovered for another context. */
    /* (The headers are read in batches: one small read per block in turn
     * made recovery of 10^6 tokens take 12 s.) */
    kvr_disk_handle *ch = kvr_mem_calloc(nb ? nb : 1, sizeof *ch);
    uint32_t *ci = kvr_mem_calloc(nb ? nb : 1, sizeof *ci);
    size_t nc = 0;
    if (!ch || !ci) {
        rc = KVR_ENOMEM;
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': out of memory: dropped", id);
    }
    for (uint32_t i = 0; i < nb && rc == 0; i++) {
        hnode *n = kvr_tier_hmap_find(blocks, hkey(&rb[i].h));
        if (n) {
            rb[i].b = (kvr_block *)(uintptr_t)n->val;
            continue;
        }
        ci[nc] = i;
        ch[nc++] = rb[i].h;
    }
    if (rc == 0 && nc && lazy &&
        (rc = recover_spilled(s, t, m, id, rb, ch, ci, nc, blocks)) == KVR_EUNSUPPORTED)
        rc = 0;    /* v1 extents: read whole below */
    else if (lazy)
        nc = 0;
    if (rc == 0 && nc) {
        size_t got = 0;
        kvr_error e;
        if ((rc = kvr_disk_claim_n(t->d, ch, nc, &got, &e)) != 0)
            kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': block %u: %s: dropped", id,
                 ci[got], e.msg);
        for (size_t k = 0; k < got; k++)
            rb[ci[k]].fresh = true;
    }
    kvr_mem_free(ch);
    kvr_mem_free(ci);
    /* Read the new blocks back in chunks (checksums verified), building
     * each; over the memory cap a block keeps only its metadata (it is on
     * disk already: no I/O), so recovery needs memory for one chunk. */
    void **bufs = kvr_mem_calloc(nb ? nb : 1, sizeof *bufs);
    void **metas = kvr_mem_calloc(nb ? nb : 1, sizeof *metas);
    kvr_disk_dst *dst = kvr_mem_calloc(nb ? nb : 1, sizeof *dst);
    kvr_disk_handle *hs = kvr_mem_calloc(nb ? nb : 1, sizeof *hs);
    uint32_t *which = kvr_mem_calloc(nb ? nb : 1, sizeof *which);
    int *st = kvr_mem_calloc(nb ? nb : 1, sizeof *st);
    if (rc == 0 && (!bufs || !metas || !dst || !hs || !st || !which))
        rc = KVR_ENOMEM;
    size_t chunk_max = 64u << 20;
    if (s->cfg.max_memory && s->cfg.max_memory / 4 < chunk_max)
        chunk_max = s->cfg.max_memory / 4;
    uint32_t i0 = 0;
    while (i0 < nb && !rb[i0].fresh)   /* none left to read: built spilled or shared */
        i0++;
    while (i0 < nb && rc == 0) {
        size_t k = 0, bytes = 0;
        uint32_t i = i0;
        for (; i < nb; i++) {
            if (!rb[i].fresh)
                continue;
            if (k && bytes + rb[i].h.len > chunk_max)
                break;
            /* The image: K/V, then the metadata, into the block's data
             * and tail, cut as the block cuts it (block.h). */
            size_t ml = (size_t)rb[i].cap * KVR_BLOCK_META_SLOT;
            size_t hdr = rb[i].quant ? KVR_QHDR_BYTES : 0;
            if (rb[i].h.len <= ml + hdr) {
                rc = KVR_EINVAL;
                kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': block %u of %u bytes cannot "
                     "hold %u slots: dropped", id, i, rb[i].h.len, rb[i].cap);
                break;
            }
            size_t head = kvr_block_split(rb[i].quant != 0, rb[i].h.len - ml, m->n_layers,
                                          rb[i].cap);
            bufs[k] = kvr_mem_aligned(KVR_BLOCK_ALIGN, head);
            metas[k] = kvr_mem_aligned(KVR_BLOCK_ALIGN, rb[i].h.len - head);
            dst[k] = (kvr_disk_dst){ bufs[k], head, metas[k] };
            if (!bufs[k] || !metas[k]) {
                k++;
                rc = KVR_ENOMEM;
                kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': out of memory reading it "
                     "back: dropped", id);
                break;
            }
            bytes += rb[i].h.len;
            which[k] = i;
            hs[k++] = rb[i].h;
        }
        i0 = i;
        kvr_error e;
        if (rc == 0 && k && kvr_disk_load_split(t->d, hs, dst, k, st, &e) != 0) {
            rc = KVR_EIO;
            kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': reading its blocks failed (%s): "
                 "dropped", id, e.msg);
        }
        for (size_t q = 0; q < k && rc == 0; q++) {
            uint32_t bi = which[q];
            /* The block adopts the loaded data (a quantized header in it)
             * and metadata; its one reference is this function's until the
             * extents take theirs. */
            kvr_block_geom g = { .cap = rb[bi].cap, .row = kvr_model_row(m),
                                 .n_layers = m->n_layers,
                                 .dtype = (kvr_dtype)rb[bi].dtype,
                                 .quant = rb[bi].quant != 0, .tenant = m->tenant };
            size_t kv_len = rb[bi].h.len - (size_t)rb[bi].cap * KVR_BLOCK_META_SLOT;
            kvr_block *blk = kvr_block_create(&s->pool, &g, bufs[q], kv_len, metas[q],
                                              rb[bi].used);
            if (!blk) {
                rc = KVR_ENOMEM;
                break;
            }
            bufs[q] = NULL;
            metas[q] = NULL;
            blk->disk = kvr_mem_malloc(sizeof *blk->disk);
            if (!blk->disk) {
                kvr_block_unref(&s->pool, blk);
                rc = KVR_ENOMEM;
                break;
            }
            blk->disk->h = rb[bi].h;
            blk->disk->used = blk->used;
            rb[bi].b = blk;
            rb[bi].fresh = false;     /* owned by the block now (freed with it) */
            rb[bi].built = true;
            t->rec.blocks++;
            t->rec.bytes += rb[bi].h.len;
            kvr_tier_hmap_add(blocks, hkey(&rb[bi].h), (int64_t)(uintptr_t)blk);
            if (s->cfg.max_memory && kvr_mem_allocated() > s->cfg.max_memory)
                kvr_tier_make_spilled(s, blk);
        }
        for (size_t q = 0; q < k; q++) {
            kvr_mem_free(bufs[q]);
            kvr_mem_free(metas[q]);
            bufs[q] = NULL;
            metas[q] = NULL;
        }
        /* Room for the next chunk: spill least recently used blocks. */
        if (rc == 0 && s->cfg.max_memory)
            kvr_store_reserve(s, chunk_max, NULL);
    }
    kvr_mem_free(which);
    kvr_ctx *c = NULL;
    if (rc == 0 && (kvr_store_ctx_find(s, id) || kvr_ctx_id_check(id, NULL) != 0))
        rc = KVR_EEXIST;
    if (rc == 0 && !(c = kvr_store_ctx_new(s, m, id)))
        rc = KVR_ENOMEM;
    if (rc == 0 && codec[0] && kvr_model_codec(m, codec, &c->codec, NULL) != 0)
        rc = KVR_EINVAL;
    if (rc == 0 && kvr_ctx_ext_reserve(c, ne ? ne : 1) != 0)
        rc = KVR_ENOMEM;
    kvr_error le = { 0 };
    if (rc == 0 && blob && (rc = kvr_layout_blob_set(c, blob, lb, &le)) != 0)
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': its layout is refused (%s): dropped",
             id, le.msg);
    for (uint32_t i = 0; i < ne && rc == 0; i++) {
        uint32_t bi = r_u32(&b), first = r_u32(&b), count = r_u32(&b), fl = r_u32(&b);
        int64_t delta = (int64_t)r_u64(&b);
        if (b.bad || bi >= nb || count == 0 || first > rb[bi].used ||
            count > rb[bi].used - first) {
            rc = KVR_EINVAL;
            break;
        }
        kvr_block_ref(rb[bi].b);
        if (r->stale)
            fl |= KVR_TOKEN_STALE | KVR_TOKEN_APPROX;
        kvr_ctx_push(&s->pool, c, (kvr_extent){ rb[bi].b, first, count, delta, fl });
    }
    size_t total = c ? c->n_tokens : 0;
    if (rc == 0 && total != ntok)
        rc = KVR_EINVAL;
    if (rc == 0) {
        c->dtype = (kvr_dtype)dtype;
        c->pinned = flags & 1u;
        c->created_ms = created;
        c->n_protected = nprot;
        c->q_sse[0] = qs[0];
        c->q_sse[1] = qs[1];
        c->q_ss[0] = qs[2];
        c->q_ss[1] = qs[3];
        c->persist = true;
        kvr_store_ctx_commit(s, c);
        kvr_ctx_index_rebuild(c, 0);
        t->rec.contexts++;
        t->rec.tokens += total;
    } else if (c) {
        kvr_store_ctx_destroy(s, c);
    }
    if (rc != 0 && rc != KVR_ENOMEM && rc != KVR_EIO && rc != KVR_EEXIST)
        kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context record '%s' is inconsistent: dropped", id);
    /* Drop this function's reference of the blocks it built (the extents
     * hold theirs); claims of blocks never built are given back. */
    for (uint32_t i = 0; i < nb; i++) {
        if (rb[i].fresh) {
            kvr_disk_free(t->d, &rb[i].h, NULL);
        } else if (rb[i].built) {
            if (kvr_block_exclusive(rb[i].b))
                kvr_tier_hmap_add(blocks, hkey(&rb[i].h), -(int64_t)(uintptr_t)rb[i].b);
            kvr_block_unref(&s->pool, rb[i].b);
        }
    }
    for (size_t i = 0; bufs && i < nb; i++)
        kvr_mem_free(bufs[i]);
    for (size_t i = 0; metas && i < nb; i++)
        kvr_mem_free(metas[i]);
    kvr_mem_free(bufs);
    kvr_mem_free(metas);
    kvr_mem_free(dst);
    kvr_mem_free(hs);
    kvr_mem_free(st);
    for (uint32_t i = 0; i < nb; i++) {
        kvr_mem_free(rb[i].meta);
        kvr_mem_free(rb[i].qh);
    }
    kvr_mem_free(rb);
    return rc;
}



int kvr_store_tier_open(kvr_store *s, const kvr_tier_config *cfg, kvr_tier_log_fn log,
                        void *arg, kvr_tier_recovery *out, kvr_error *err)
{
    if (s->tier)
        return kvr_error_set(err, KVR_EINVAL, "the store already has a disk tier");
    if (!cfg || !cfg->dir || !cfg->dir[0])
        return kvr_error_set(err, KVR_EINVAL, "disk tier: no directory");
    if (s->n_ctx)
        return kvr_error_set(err, KVR_EINVAL, "disk tier: open it before any context exists");
    double t0 = kvr_clock_mono_msf();
    /* From now on blocks may carry a disk copy: its release is ours. */
    s->pool.on_release = kvr_tier_on_block_release;
    s->pool.release_arg = s;
    kvr_tier *t = kvr_mem_calloc(1, sizeof *t);
    if (!t)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory opening the disk tier");
    kvr_list_init(&t->queue);
    kvr_tier_tab_init(&t->tab);
    t->cfg = *cfg;
    snprintf(t->dir, sizeof t->dir, "%s", cfg->dir);
    t->cfg.dir = t->dir;
    t->log = log;
    t->log_arg = arg;
    kvr_disk_config dc = {
        .dir = t->dir,
        .max_bytes = cfg->max_bytes,
        .engine = cfg->engine == 1 ? KVR_DISK_ENGINE_URING
                : cfg->engine == 2 ? KVR_DISK_ENGINE_POSIX : KVR_DISK_ENGINE_AUTO,
        .checkpoint_bytes = cfg->checkpoint_bytes,
    };
    int rc = kvr_disk_open(&t->d, &dc, err);
    if (rc != 0) {
        kvr_mem_free(t);
        return rc;
    }
    recov rv = { .s = s, .t = t };
    kvr_disk_recovery dr;
    memset(&dr, 0, sizeof dr);
    if ((rc = kvr_disk_recover(t->d, on_record, on_corrupt, &rv, &dr, err)) != 0)
        goto fail;
    mark_stale(&rv);
    /* Models, then contexts (blocks shared between contexts: one block). */
    trec *r;
    kvr_tier_tab_foreach(r, &t->tab)
        if (r->type == REC_MODEL)
            recover_model(s, t, r);
    /* Eviction during recovery spills (blocks are on disk: no I/O). */
    s->tier = t;
    s->hooks = &kvr_tier_disk_hooks;
    s->persist_all = t->cfg.persist_all;
    hmap blocks = { 0 };
    for (kvr_list *n = t->tab.recs.next, *nx; n != &t->tab.recs; n = nx) {
        nx = n->next;
        r = kvr_list_entry(n, trec, link);
        if (r->type != REC_CTX)
            continue;
        if (recover_ctx(s, t, &blocks, r) != 0) {
            t->rec.dropped_contexts++;
            kvr_tier_tab_drop(&t->tab, r);
            continue;
        }
        if (r->stale) {
            t->rec.stale_contexts++;
            kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': a newer record of it may have been "
                 "lost (corrupt log record): restored from its previous state, every token "
                 "flagged stale", r->name);
        }
    }
    kvr_tier_hmap_free(&blocks);
    if ((rc = kvr_disk_recover_done(t->d, err)) != 0) {
        s->tier = NULL;
        s->hooks = NULL;
        goto fail_store;
    }
    /* Tests only (hidden): KVR_DISK_FAULT="ops:nth:errno:count" injects
     * I/O faults (disk.h kvr_disk_fault_set; ops 1 write, 2 fsync, 4 read). */
    const char *fault = getenv("KVR_DISK_FAULT");
    if (fault && *fault) {
        unsigned ops = 0;
        unsigned long long nth = 0, count = 0;
        int en = 0;
        if (sscanf(fault, "%u:%llu:%d:%llu", &ops, &nth, &en, &count) == 4)
            kvr_disk_fault_set(t->d, ops, nth, en, count);
    }
    /* Compact the log when it carried junk (dropped contexts, corrupt or
     * superseded records). */
    if (rv.bad || dr.quarantined || dr.torn_bytes || t->rec.dropped_contexts ||
        kvr_disk_log_wants_checkpoint(t->d)) {
        kvr_error ce;
        if (kvr_disk_checkpoint(t->d, kvr_tier_snapshot_cb, &t->tab, &ce) == 0)
            t->n_checkpoints++;
        else
            kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: checkpoint after recovery failed: %s", ce.msg);
    }
    kvr_tier_pending_sweep(s);
    /* Log the stale contexts again, marks included, so that the mark
     * survives the next restart (the checkpoint above kept their old
     * records, which do not carry it). */
    if (t->rec.stale_contexts) {
        kvr_tier_tab_foreach(r, &t->tab) {
            kvr_error pe;
            if (r->type == REC_CTX && r->stale && kvr_store_persist(s, r->name, NULL, NULL,
                                                                     &pe) < 0)
                kvr_tier_log(t, KVR_TIER_LOG_WARN, "disk: context '%s': logging its stale mark "
                     "failed: %s", r->name, pe.msg);
        }
        kvr_store_persist_flush(s);
    }
    t->rec.records = dr.records;
    t->rec.quarantined = dr.quarantined + rv.bad;
    t->rec.torn_bytes = dr.torn_bytes;
    t->rec.ms = kvr_clock_mono_msf() - t0;
    t->rec.at_ms = kvr_store_now_ms();
    if (out)
        *out = t->rec;
    return 0;

fail_store:
    /* Contexts rebuilt so far go; the directory stays as it is. */
    for (size_t i = 0; i < s->n_buckets; i++)
        while (s->buckets[i])
            kvr_store_ctx_destroy(s, s->buckets[i]);
fail:
    kvr_tier_tab_free(&t->tab);
    kvr_disk_close(t->d);
    kvr_mem_free(t->logged);
    kvr_mem_free(t);
    s->tier = NULL;
    s->hooks = NULL;
    return rc;
}
