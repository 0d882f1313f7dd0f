/*
 * tier.c — the disk tier on top of the storage layer (disk.h): spilling
 * evicted blocks, reloading them, and persistence of contexts marked
 * persistent (a log of full-metadata records, recovered at start). This
 * file holds the tier's life (the hooks it installs, close, destroy,
 * stats), the blocks' spill state, eviction and reloads; records and
 * persistence are in tier_persist.c, recovery (and open) in
 * tier_recover.c, what they share in tier.h.
 *
 * Where the I/O happens (the store is single-threaded on the loop thread):
 *  - Spill at eviction: synchronous, on the loop thread, inside
 *    kvr_store_reserve; one batch per step (tier_evict: the LRU blocks
 *    worth what the request still needs, at most 64 blocks / 64 MiB, one
 *    kvr_disk_spill that the layer writes as large O_DIRECT pieces with
 *    its queue kept busy), so bounded by the request's size. A block that already has a
 *    valid disk copy (a persistent context's, or one reloaded since) is
 *    dropped from memory without any I/O.
 *  - Reload for get / assemble: off the loop thread (the reload hooks, store.h). Begin
 *    (loop) leases the blocks as before, reserves memory for the spilled
 *    ones (kvr_store_reserve: evicts/spills others; KVR_ENOMEM if impossible),
 *    allocates their buffers, and builds a "view" per block (its fields
 *    with data in the new buffer) that the transaction's iovecs and work
 *    read: so the response is zero-copy from the new buffer. A get also
 *    prefetches the context's other spilled blocks, but only into memory
 *    that fits under the cap without evicting, and at most
 *    TIER_PREFETCH_MAX bytes (a bounded look-ahead). The transaction's
 *    work (worker thread) does one batched kvr_disk_load of them all, then
 *    the usual rotation/conversion; it touches no store map. End (loop)
 *    installs each loaded buffer into its block, unless the block was
 *    reloaded meanwhile by another request (that copy stays, this one is
 *    freed) or deleted (only the reload's reference is left: freed). A load
 *    failure (checksum mismatch: quarantined by the layer; EIO) fails that
 *    request with KVR_EIO; the block stays spilled, nothing else changes.
 *  - Reload for a quantized put (window blocks its work re-encodes):
 *    still synchronous on the loop thread in put begin (kvr_store_fault_in: the
 *    same begin/work/end run in place). Rare (only window blocks old enough
 *    to be spilled while their context is being appended to) and bounded
 *    by the put's flush size.
 *  - Persistence: off the loop thread. kvr_store_persist (loop, after the
 *    commit) encodes the record and leases the blocks that have no valid
 *    disk copy yet; the daemon runs kvr_persist_batch_work on a worker
 *    (spill the leased blocks, then kvr_disk_log_append, which syncs the
 *    data before the record: the layer's ordering), and the response is
 *    sent from the done() callback of kvr_persist_batch_end (loop) only
 *    when the append returned 0. One batch is in flight at a time (group
 *    commit: a batch takes every queued record, one fsync), so records are
 *    on disk in commit order.
 *
 * Records (payloads of disk.h log records, little-endian, version 1):
 *   MODEL  (1): name, shape, dtype, default codec, kvr_rope_config bytes,
 *               fingerprint (checked on recovery).
 *   CTX    (2): the whole metadata of one persistent context: id, model,
 *               fingerprint, codec, dtype, pinned, created, protected
 *               count, quantization error sums, layout blob, its blocks
 *               (disk handle, used, cap, dtype, quant, metadata offset) and
 *               its extents (block index, first, count, flags, pos_delta),
 *               then its blocks' metadata checksums (tier.h REC_MCRC_TAG:
 *               recovery reads and checks a block's metadata, not its K/V).
 *               Token ids, stored-at positions and groups are in the
 *               blocks' data. The latest CTX record of an id is its state.
 *   DELETE (3): id.
 *  A full record per change is O(context) bytes per operation (about 40
 *  bytes per 64-token block); simple and self-healing after a failed
 *  write, and checkpoints keep the log at O(live state). Delta records
 *  would be cheaper for long contexts.
 *
 * Disk space. A block owns one reference of its handle. When a block goes
 * (or gets a newer copy), the old handle is freed only when no latest
 * record (the table below) points at it; until then it waits in `pending`.
 * So a crash at any instant finds every handle of the durable records.
 * The table (latest MODEL/CTX record per name) is owned by whoever runs
 * the batch: the worker while a batch is in flight (it applies the
 * records after a successful append and writes checkpoints from it), the
 * loop thread otherwise.
 *
 * Failures. ELIMIT/EIO at eviction: drop as before (never a persistent
 * context's block: those always have a disk copy). A failed batch fails
 * its requests with KVR_EIO; memory keeps the change (like a crash, the
 * disk may or may not have it) and the next record of the context writes
 * its whole state again.
 *
 * Next: the quantized put's reloads in its work, eviction spills on a
 * worker (the loop waits for the batch today), delta records.
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

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

hnode *kvr_tier_hmap_find(const hmap *m, uint64_t key)
{
    if (!m->nb)
        return NULL;
    for (hnode *n = m->b[mix64(key) & (m->nb - 1)]; n; n = n->next)
        if (n->key == key)
            return n;
    return NULL;
}

static int hmap_grow(hmap *m)
{
    size_t nb = m->nb ? m->nb * 2 : 64;
    hnode **b = kvr_mem_calloc(nb, sizeof *b);
    if (!b)
        return KVR_ENOMEM;
    for (size_t i = 0; i < m->nb; i++)
        for (hnode *n = m->b[i], *nx; n; n = nx) {
            nx = n->next;
            size_t k = mix64(n->key) & (nb - 1);
            n->next = b[k];
            b[k] = n;
        }
    kvr_mem_free(m->b);
    m->b = b;
    m->nb = nb;
    return 0;
}

/* Adds delta to key's value (creating it at 0); removes it at 0. */
int kvr_tier_hmap_add(hmap *m, uint64_t key, int64_t delta)
{
    hnode *n = kvr_tier_hmap_find(m, key);
    if (!n) {
        if (m->n >= m->nb && hmap_grow(m) != 0)
            return KVR_ENOMEM;
        n = kvr_mem_calloc(1, sizeof *n);
        if (!n)
            return KVR_ENOMEM;
        n->key = key;
        size_t k = mix64(key) & (m->nb - 1);
        n->next = m->b[k];
        m->b[k] = n;
        m->n++;
    }
    n->val = (uint64_t)((int64_t)n->val + delta);
    if (n->val == 0) {
        hnode **pp = &m->b[mix64(key) & (m->nb - 1)];
        while (*pp != n)
            pp = &(*pp)->next;
        *pp = n->next;
        kvr_mem_free(n);
        m->n--;
    }
    return 0;
}

void kvr_tier_hmap_free(hmap *m)
{
    for (size_t i = 0; i < m->nb; i++)
        for (hnode *n = m->b[i], *nx; n; n = nx) {
            nx = n->next;
            kvr_mem_free(n);
        }
    kvr_mem_free(m->b);
    memset(m, 0, sizeof *m);
}

void kvr_tier_log(kvr_tier *t, int level, const char *fmt, ...)
{
    if (!t->log)
        return;
    char m[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    t->log(t->log_arg, level, m);
}

/* ---- blocks: spill state --------------------------------------------------------- */

/* Drops b's K/V bytes from memory (it has a valid disk copy); its
 * metadata (its own allocation) stays, and a quantized block's header. */
int kvr_tier_make_spilled(kvr_store *s, kvr_block *b)
{
    /* Only an unheld block with a valid disk copy goes. */
    assert(!b->spilled && b->holds == 0 && b->disk && b->disk->used == b->used);
    uint8_t *m = NULL, *mt = kvr_mem_aligned(KVR_BLOCK_ALIGN, kvr_block_meta_len(b));
    if (b->quant && (m = kvr_mem_aligned(KVR_BLOCK_ALIGN, KVR_QHDR_BYTES)) != NULL)
        memcpy(m, b->data, KVR_QHDR_BYTES);
    if (!mt || (b->quant && !m)) {
        kvr_mem_free(m);
        kvr_mem_free(mt);
        return KVR_ENOMEM;
    }
    memcpy(mt, b->stored_pos, kvr_block_meta_len(b));
    kvr_block_set_data(&s->pool, b, m, mt, true);
    return 0;
}

/* What a spilled block's reload allocates: its data and tail as size
 * classes. */
static size_t spilled_len(const kvr_block *b)
{
    assert(b->disk->h.len == kvr_block_data_len(b));
    return kvr_mem_size_class(b->head_len) + kvr_mem_size_class(kvr_block_tail_len(b));
}

/* The two parts of a block's image (data, then tail: the later layers and
 * the metadata), to spill. */
kvr_disk_buf kvr_tier_image_buf(const kvr_block *b)
{
    return (kvr_disk_buf){ .data = b->data, .len = b->head_len, .tail = b->tail,
                           .tail_len = kvr_block_tail_len(b) };
}

/* Installs freshly loaded data and tail into a spilled block. */
static void install_data(kvr_store *s, kvr_block *b, uint8_t *buf, uint8_t *tbuf)
{
    assert(b->spilled && b->disk);
    kvr_block_set_data(&s->pool, b, buf, tbuf, false);
}

/* A handle this store no longer needs: freed now if no durable record
 * points at it and no batch is in flight, else later. */
static void release_handle(kvr_store *s, const kvr_disk_handle *h)
{
    kvr_tier *t = s->tier;
    if (!t->in_flight && !kvr_tier_hmap_find(&t->tab.refs, hkey(h))) {
        kvr_disk_free(t->d, h, NULL);
        return;
    }
    if (t->n_pending == t->cap_pending) {
        size_t cap = t->cap_pending ? t->cap_pending * 2 : 64;
        kvr_disk_handle *p = kvr_mem_realloc(t->pending, cap * sizeof *p);
        if (!p)
            return;    /* leaked until the next restart reclaims it */
        t->pending = p;
        t->cap_pending = cap;
    }
    t->pending[t->n_pending++] = *h;
}

void kvr_tier_pending_sweep(kvr_store *s)
{
    kvr_tier *t = s->tier;
    if (t->in_flight)
        return;
    size_t w = 0;
    for (size_t i = 0; i < t->n_pending; i++) {
        if (kvr_tier_hmap_find(&t->tab.refs, hkey(&t->pending[i])))
            t->pending[w++] = t->pending[i];
        else
            kvr_disk_free(t->d, &t->pending[i], NULL);
    }
    t->n_pending = w;
}

/* The block pool's release hook: a block's last reference goes. Its disk
 * copy is released (deferred while a persisted record may still point at
 * it). Stays installed after the tier closes (then it only frees). */
void kvr_tier_on_block_release(void *arg, kvr_block *b)
{
    kvr_store *s = arg;
    if (!b->disk)
        return;
    if (s->tier && !s->tier->closing)
        release_handle(s, &b->disk->h);
    kvr_mem_free(b->disk);
    b->disk = NULL;
}

/* Gives b the disk copy h (releasing an older one). */
int kvr_tier_set_copy(kvr_store *s, kvr_block *b, const kvr_disk_handle *h, uint32_t used)
{
    if (!b->disk) {
        b->disk = kvr_mem_malloc(sizeof *b->disk);
        if (!b->disk)
            return KVR_ENOMEM;
    } else {
        release_handle(s, &b->disk->h);
    }
    b->disk->h = *h;
    b->disk->used = used;
    return 0;
}

static void drop_copy(kvr_store *s, kvr_block *b)
{
    assert(!b->spilled);
    if (!b->disk)
        return;
    release_handle(s, &b->disk->h);   /* deferred while a record points at it */
    kvr_mem_free(b->disk);
    b->disk = NULL;
}

/* A persistent context leaves the store: remembered for the DELETE record. */
static void on_ctx_gone(kvr_store *s, kvr_ctx *c)
{
    kvr_tier *t = s->tier;
    if (!t || t->closing || !c->persist || c->pending)
        return;
    if (t->n_deleted == t->cap_deleted) {
        size_t cap = t->cap_deleted ? t->cap_deleted * 2 : 16;
        char **p = kvr_mem_realloc(t->deleted, cap * sizeof *p);
        if (!p)
            return;
        t->deleted = p;
        t->cap_deleted = cap;
    }
    char *id = kvr_mem_malloc(c->id_len + 1);
    if (!id)
        return;
    memcpy(id, c->id, c->id_len + 1);
    t->deleted[t->n_deleted++] = id;
}

/* ---- eviction ----------------------------------------------------------------------- */

static bool evictable(const kvr_ctx *c)
{
    return !c->pinned && !c->busy && !c->pending;
}

static bool spillable(const kvr_block *b)
{
    return !b->spilled && b->holds == 0 && b->used > 0;
}

static size_t tier_freeable(kvr_store *s)
{
    if (!s->tier)
        return 0;
    uint32_t ep = ++s->epoch;
    size_t total = 0;
    for (kvr_ctx *c = kvr_lru_first(s); c; c = kvr_lru_next(s, c)) {
        if (!evictable(c))
            continue;
        for (size_t i = 0; i < c->n_ext; i++) {
            kvr_block *b = c->ext[i].block;
            if (b->mark == ep)
                continue;
            b->mark = ep;
            if (spillable(b))
                total += b->bytes > kvr_block_spilled_bytes(b)
                             ? b->bytes - kvr_block_spilled_bytes(b) : 0;
        }
    }
    return total;
}

/* The most one eviction step writes in one batch (one kvr_disk_spill: the
 * layer coalesces the blocks into large writes and keeps its queue full). */
#define TIER_SPILL_BATCH_BYTES ((size_t)64 << 20)
#define TIER_SPILL_BATCH_MAX   64

/* One eviction step: the least recently used unheld blocks, from the LRU
 * tail (a context's last blocks first), until about `want` bytes of memory
 * would be freed (at least one block, at most a batch). Blocks with a
 * valid disk copy go without I/O; the others are written in one batch
 * (all or nothing). 1 freed memory, 0 nothing to spill, or KVR_E*. */
static int tier_evict(kvr_store *s, size_t want)
{
    kvr_tier *t = s->tier;
    if (!t)
        return 0;
    kvr_block *bs[TIER_SPILL_BATCH_MAX];
    kvr_disk_buf bufs[TIER_SPILL_BATCH_MAX];
    size_t n = 0, nio = 0, freed = 0, io_bytes = 0;
    uint32_t ep = ++s->epoch;
    for (kvr_ctx *c = kvr_lru_victim(s, NULL); c && n < TIER_SPILL_BATCH_MAX;
         c = kvr_lru_victim(s, c)) {
        if (!evictable(c))
            continue;
        for (size_t i = c->n_ext; i-- > 0 && n < TIER_SPILL_BATCH_MAX;) {
            kvr_block *b = c->ext[i].block;
            if (!spillable(b) || b->mark == ep)
                continue;
            bool io = !(b->disk && b->disk->used == b->used);
            size_t len = kvr_block_data_len(b);
            if (io && nio > 0 && io_bytes + len > TIER_SPILL_BATCH_BYTES)
                goto collected;
            b->mark = ep;
            bs[n++] = b;
            if (io) {
                bufs[nio++] = kvr_tier_image_buf(b);
                io_bytes += len;
            }
            size_t sp = kvr_block_spilled_bytes(b);
            freed += b->bytes > sp ? b->bytes - sp : 0;
            if (freed >= want)
                goto collected;
        }
    }
collected:
    if (n == 0)
        return 0;
    kvr_disk_handle hs[TIER_SPILL_BATCH_MAX];
    int io_rc = 0;
    if (nio) {
        kvr_error e;
        io_rc = kvr_disk_spill(t->d, bufs, nio, hs, false, &e);
        if (io_rc != 0)
            t->n_spill_refused++;   /* none of the batch's writes count */
    }
    /* The blocks that needed no I/O go even when the batch was refused. */
    int rc = 0;
    size_t k = 0, done = 0;
    for (size_t i = 0; i < n; i++) {
        kvr_block *b = bs[i];
        if (!(b->disk && b->disk->used == b->used)) {
            if (io_rc != 0)
                continue;
            const kvr_disk_handle *h = &hs[k++];
            if (rc != 0 || kvr_tier_set_copy(s, b, h, b->used) != 0) {
                kvr_disk_free(t->d, h, NULL);
                rc = KVR_ENOMEM;
                continue;
            }
            t->n_spills++;
            t->spill_bytes += h->len;
        }
        if (rc != 0)
            continue;
        if (kvr_tier_make_spilled(s, b) != 0)
            rc = KVR_ENOMEM;
        else
            done++;
    }
    return done > 0 ? 1 : io_rc != 0 ? io_rc : rc;
}

int64_t kvr_store_tier_evict(kvr_store *s, size_t bytes, kvr_error *err)
{
    if (!s->tier)
        return kvr_error_set(err, KVR_EUNSUPPORTED, "no disk tier");
    size_t before = s->pool.bytes, freed = 0;
    while (freed < bytes) {
        int rc = tier_evict(s, bytes - freed);
        if (rc < 0)
            return kvr_error_set(err, rc, "spilling failed");
        if (rc == 0)
            break;
        freed = before - s->pool.bytes;
    }
    int rc = kvr_disk_sync(s->tier->d, err);
    return rc < 0 ? rc : (int64_t)freed;
}

/* ---- reload ------------------------------------------------------------------------- */

/* One block a transaction reloads: begin (loop) takes a reference and
 * allocates buf; work (any thread) reads the disk copy into buf; end (loop)
 * installs buf into the block or frees it. `view` is a copy of the block's
 * fields with its data in buf: what the transaction's work reads (and its
 * iovecs point at), so the block itself is not touched off the loop. */
typedef struct rl_ent {
    kvr_block      *b;
    kvr_block       view;
    uint8_t        *buf, *tbuf;  /* its data and tail */
    kvr_disk_handle h;
    int             st;
    bool            needed;      /* read by the request (else a prefetch) */
} rl_ent;

struct kvr_reload {
    kvr_disk  *d;
    rl_ent    *e;                /* sorted by block address (reload_view) */
    size_t     n;
    bool       loaded;           /* work ran */
    int        rc;               /* its result (the request's blocks only) */
    kvr_error  err;
};

/* The most a get prefetches beyond its own blocks: a bounded look-ahead. */
#define TIER_PREFETCH_MAX ((size_t)64 << 20)

static int rl_cmp(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const rl_ent *)a)->b, y = (uintptr_t)((const rl_ent *)b)->b;
    return x < y ? -1 : x > y;
}

static void rl_free(kvr_store *s, kvr_reload *r)
{
    for (size_t i = 0; i < r->n; i++) {
        kvr_mem_free(r->e[i].buf);
        kvr_mem_free(r->e[i].tbuf);
        kvr_block_unref(&s->pool, r->e[i].b);
    }
    kvr_mem_free(r->e);
    kvr_mem_free(r);
}

static int reload_begin(kvr_store *s, kvr_block *const *bs, size_t n, kvr_ctx *pf,
                        kvr_reload **out, kvr_error *err)
{
    kvr_tier *t = s->tier;
    *out = NULL;
    if (!t)
        return 0;
    size_t need = 0;
    for (size_t i = 0; i < n; i++)
        if (bs[i]->spilled)
            need++;
    if (need == 0) {
        t->reads_mem++;
        return 0;
    }
    t->reads_disk++;
    size_t cap = need + (pf ? pf->n_ext : 0);
    kvr_reload *r = kvr_mem_calloc(1, sizeof *r);
    if (!r || !(r->e = kvr_mem_calloc(cap, sizeof *r->e))) {
        kvr_mem_free(r);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory reloading blocks");
    }
    r->d = t->d;
    /* Memory for the request's blocks, evicting (spilling) others: the
     * callers hold these blocks, and the context being read is made busy,
     * so the eviction cannot take them. */
    uint32_t ep = ++s->epoch;
    size_t bytes = 0;
    for (size_t i = 0; i < n; i++)
        if (bs[i]->spilled && bs[i]->mark != ep) {
            assert(bs[i]->holds > 0 && bs[i]->disk);   /* held by the caller */
            bs[i]->mark = ep;
            kvr_block_ref(bs[i]);
            r->e[r->n++] = (rl_ent){ .b = bs[i], .needed = true };
            bytes += spilled_len(bs[i]);
        }
    bool was_busy = pf ? pf->busy : false;
    if (pf)
        pf->busy = true;
    int rc = kvr_store_reserve(s, bytes, err);
    for (size_t i = 0; i < r->n && rc == 0; i++)
        if (!(r->e[i].buf = kvr_mem_aligned(KVR_BLOCK_ALIGN, r->e[i].b->head_len)) ||
            !(r->e[i].tbuf = kvr_mem_aligned(KVR_BLOCK_ALIGN, kvr_block_tail_len(r->e[i].b))))
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory reloading a block");
    /* Prefetch: the context's other spilled blocks, while they fit under
     * the cap without evicting anything, up to TIER_PREFETCH_MAX bytes.
     * (kvr_store_reserve used the marks: mark the request's blocks again.) */
    ep = ++s->epoch;
    for (size_t i = 0; i < r->n; i++)
        r->e[i].b->mark = ep;
    size_t pbytes = 0;
    for (size_t i = 0; rc == 0 && pf && i < pf->n_ext && r->n < cap; i++) {
        kvr_block *b = pf->ext[i].block;
        if (!b->spilled || b->mark == ep)
            continue;
        size_t sc = spilled_len(b);
        if (pbytes + sc > TIER_PREFETCH_MAX ||
            (s->cfg.max_memory && kvr_mem_allocated() + sc > s->cfg.max_memory))
            break;
        uint8_t *buf = kvr_mem_aligned(KVR_BLOCK_ALIGN, b->head_len);
        uint8_t *tbuf = kvr_mem_aligned(KVR_BLOCK_ALIGN, kvr_block_tail_len(b));
        if (!buf || !tbuf) {
            kvr_mem_free(buf);
            kvr_mem_free(tbuf);
            break;
        }
        b->mark = ep;
        kvr_block_ref(b);
        pbytes += sc;
        r->e[r->n++] = (rl_ent){ .b = b, .buf = buf, .tbuf = tbuf };
    }
    if (pf)
        pf->busy = was_busy;
    if (rc != 0) {
        rl_free(s, r);
        return rc;
    }
    for (size_t i = 0; i < r->n; i++) {
        rl_ent *x = &r->e[i];
        x->h = x->b->disk->h;
        /* The view is readable at begin: its quantized header and its
         * metadata (kept in memory while spilled) go in now; the load
         * rewrites the same bytes. */
        if (x->b->quant)
            memcpy(x->buf, x->b->data, KVR_QHDR_BYTES);
        memcpy(x->tbuf + (x->b->kv_len - x->b->head_len), x->b->stored_pos,
               kvr_block_meta_len(x->b));
        kvr_block_view(x->b, &x->view, x->buf, x->tbuf);
        x->st = KVR_EIO;      /* not loaded yet */
    }
    qsort(r->e, r->n, sizeof *r->e, rl_cmp);
    *out = r;
    return 0;
}

static const kvr_block *reload_view(const kvr_reload *r, const kvr_block *b)
{
    if (!r || !b->spilled)
        return b;
    size_t lo = 0, hi = r->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r->e[mid].b == b)
            return &r->e[mid].view;
        if ((uintptr_t)r->e[mid].b < (uintptr_t)b)
            lo = mid + 1;
        else
            hi = mid;
    }
    return b;
}

static bool reload_pending(const kvr_reload *r)
{
    return r && !r->loaded;
}

/* Worker thread: one batched load. Touches only r (and the thread-safe
 * disk layer), never the store. */
static int reload_work(kvr_reload *r, kvr_error *err)
{
    if (!r)
        return 0;
    if (!r->loaded) {
        kvr_disk_handle *hs = kvr_mem_malloc(r->n * sizeof *hs);
        kvr_disk_dst *bufs = kvr_mem_malloc(r->n * sizeof *bufs);
        int *st = kvr_mem_malloc(r->n * sizeof *st);
        r->rc = 0;
        if (!hs || !bufs || !st) {
            r->rc = kvr_error_set(&r->err, KVR_ENOMEM, "out of memory reloading blocks");
        } else {
            for (size_t i = 0; i < r->n; i++) {
                hs[i] = r->e[i].h;
                bufs[i] = (kvr_disk_dst){ r->e[i].buf, r->e[i].view.head_len, r->e[i].tbuf };
            }
            kvr_error le = { 0 };
            kvr_disk_load_split(r->d, hs, bufs, r->n, st, &le);
            for (size_t i = 0; i < r->n; i++) {
                r->e[i].st = st[i];
                if (st[i] != 0 && r->e[i].needed && r->rc == 0)
                    r->rc = kvr_error_set(&r->err, KVR_EIO,
                                          "reading a spilled block back failed (seg %" PRIu32
                                          " off %" PRIu64 "): %s", hs[i].seg, hs[i].off,
                                          le.msg[0] ? le.msg : "I/O error");
            }
        }
        kvr_mem_free(hs);
        kvr_mem_free(bufs);
        kvr_mem_free(st);
        r->loaded = true;
    }
    if (r->rc != 0 && err)
        *err = r->err;
    return r->rc;
}

static void reload_end(kvr_store *s, kvr_reload *r)
{
    if (!r)
        return;
    kvr_tier *t = s->tier;
    for (size_t i = 0; i < r->n; i++) {
        rl_ent *x = &r->e[i];
        if (!r->loaded || x->st != 0)
            continue;     /* failed (the layer quarantined it) or never read */
        if (t) {
            t->n_reloads++;
            t->reload_bytes += x->h.len;
        }
        /* Install unless another request did meanwhile (keep that one) or
         * the block was deleted meanwhile (only this reference is left):
         * then the buffer is freed below. */
        if (t && x->b->spilled && !kvr_block_exclusive(x->b) && x->b->disk &&
            x->b->disk->h.seg == x->h.seg && x->b->disk->h.off == x->h.off) {
            install_data(s, x->b, x->buf, x->tbuf);
            x->buf = NULL;
            x->tbuf = NULL;
        }
    }
    rl_free(s, r);
}



static void tier_destroy(kvr_store *s)
{
    kvr_tier *t = s->tier;
    if (!t)
        return;
    t->closing = true;
    for (kvr_list *n; (n = kvr_list_first(&t->queue));) {
        kvr_list_remove(n);
        pjob *j = kvr_list_entry(n, pjob, link);
        if (j->done) {
            kvr_error e;
            kvr_error_set(&e, KVR_EIO, "the store closed before the record was written");
            j->done(j->arg, KVR_EIO, &e);
        }
        kvr_tier_job_free(s, j);
    }
}

static void tier_close(kvr_store *s)
{
    kvr_tier *t = s->tier;
    if (!t)
        return;
    kvr_tier_tab_free(&t->tab);
    kvr_disk_close(t->d);
    for (size_t i = 0; i < t->n_deleted; i++)
        kvr_mem_free(t->deleted[i]);
    kvr_mem_free(t->deleted);
    kvr_mem_free(t->pending);
    kvr_mem_free(t->logged);
    kvr_mem_free(t);
    s->tier = NULL;
    s->hooks = NULL;
}

const char *kvr_store_tier_engine(const kvr_store *s)
{
    return s->tier ? kvr_disk_engine_name(s->tier->d) : NULL;
}

const char *kvr_store_tier_engine_note(const kvr_store *s)
{
    return s->tier ? kvr_disk_engine_note(s->tier->d) : "";
}

void kvr_store_tier_stats(const kvr_store *s, kvr_tier_stats *out)
{
    memset(out, 0, sizeof *out);
    kvr_tier *t = s->tier;
    out->mem_blocks = s->pool.n_blocks;
    out->mem_bytes = s->pool.bytes;
    if (!t)
        return;
    out->enabled = true;
    kvr_disk_stats ds;
    kvr_disk_get_stats(t->d, &ds);
    out->engine = ds.engine;
    out->disk_blocks = ds.data_blocks;
    out->disk_bytes = ds.data_bytes;
    out->disk_log_bytes = ds.log_bytes;
    out->disk_max_bytes = ds.max_bytes;
    out->quarantined = ds.n_quarantined + t->rec.quarantined;
    out->failed = ds.failed;
    out->n_spills = t->n_spills;
    out->spill_bytes = t->spill_bytes;
    out->n_reloads = t->n_reloads;
    out->reload_bytes = t->reload_bytes;
    out->n_spill_refused = t->n_spill_refused;
    out->reads_mem = t->reads_mem;
    out->reads_disk = t->reads_disk;
    out->n_persist_records = t->n_records;
    out->n_persist_errors = t->n_errors;
    out->n_checkpoints = ds.n_checkpoints;
    out->recovery = t->rec;
    /* Resident vs spilled: one pass over the contexts' blocks. */
    uint32_t ep = ++((kvr_store *)(uintptr_t)s)->epoch;
    size_t spilled = 0, spilled_bytes = 0;
    for (kvr_ctx *c = kvr_lru_first(s); c; c = kvr_lru_next(s, c)) {
        if (c->persist)
            out->persistent_contexts++;
        for (size_t i = 0; i < c->n_ext; i++) {
            kvr_block *b = c->ext[i].block;
            if (b->mark == ep)
                continue;
            b->mark = ep;
            if (b->spilled) {
                spilled++;
                spilled_bytes += b->bytes;
            }
        }
    }
    out->spilled_blocks = spilled;
    out->mem_blocks = s->pool.n_blocks - (spilled < s->pool.n_blocks ? spilled : s->pool.n_blocks);
    out->mem_bytes = s->pool.bytes - (spilled_bytes < s->pool.bytes ? spilled_bytes
                                                                     : s->pool.bytes);
}

const kvr_tier_hooks kvr_tier_disk_hooks = {
    .ctx_gone = on_ctx_gone,
    .freeable = tier_freeable,
    .evict = tier_evict,
    .reload_begin = reload_begin,
    .reload_view = reload_view,
    .reload_pending = reload_pending,
    .reload_work = reload_work,
    .reload_end = reload_end,
    .drop_copy = drop_copy,
    .model_persisted = kvr_tier_model_persisted,
    .destroy = tier_destroy,
    .close = tier_close,
};
