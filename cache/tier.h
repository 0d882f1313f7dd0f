/*
 * tier.h — what the three files of the disk tier share (private to
 * tier.c, tier_persist.c and tier_recover.c; the store sees the tier only
 * through the kvr_tier_hooks table, store.h):
 *
 *   tier.c          the tier's life (close, destroy, stats), blocks' spill
 *                   state, eviction (spills) and reloads: the hooks;
 *   tier_persist.c  records (encoding), the table of latest records, the
 *                   persistence queue and its batches (group commit);
 *   tier_recover.c  opening the tier: replaying the log into the store,
 *                   stale marks, the checkpoint after a dirty recovery.
 *
 * Invariants: the table (latest MODEL/CTX record per name) is owned by
 * whoever runs the batch (a worker while one is in flight, the loop thread
 * otherwise); a block owns one reference of its disk handle, and a handle
 * is freed only when no latest record points at it (`pending` until then),
 * so a crash at any instant finds every handle of the durable records.
 */
#ifndef KVR_CACHE_TIER_H
#define KVR_CACHE_TIER_H

#include <stdarg.h>
#include <string.h>

#include "base/list.h"
#include "cache/disk.h"
#include "cache/layout.h"

#pragma GCC visibility push(hidden)

enum { REC_MODEL = 1, REC_CTX = 2, REC_DELETE = 3 };
/* Version 2 adds crc32c(name) right after the name at the head of every
 * record, so that a record whose checksum fails can still be attributed to
 * its context when its head is intact (recovery's stale marks); version 1
 * records are still read. */
#define REC_VERSION 2u
/* A CTX record ends with its blocks' metadata checksums (kvrope from
 * issue 32 on; older records end after their extents, and older readers
 * ignore what follows them): REC_MCRC_TAG, then a u32 per block in the
 * record's block order, kvr_tier_meta_crc of it. Recovery reads a block's
 * metadata (and a quantized block's header) from its extent without its
 * K/V and checks them against these; the K/V is checked when a load reads
 * the whole extent (the extent's own checksum). A record without them has
 * its blocks read whole at recovery. */
#define REC_MCRC_TAG 0x4352434Du      /* "MCRC" */

/* crc32c of a block's quantized header (qhdr: KVR_QHDR_BYTES, NULL for a
 * plain block) and of its committed slots' metadata: stored_pos, tokens
 * and groups of slots [0, used) of the metadata at meta (cap slots, laid
 * out as block.h says). Slots below used never change, so the checksum of
 * a block's record holds for every copy of it. */
static inline uint32_t kvr_tier_meta_crc(const void *qhdr, const void *meta, uint32_t cap,
                                         uint32_t used)
{
    const uint8_t *m = meta;
    uint32_t c = qhdr ? kvr_crc32c(0, qhdr, KVR_QHDR_BYTES) : 0;
    c = kvr_crc32c(c, m, (size_t)used * 8u);
    c = kvr_crc32c(c, m + (size_t)cap * 8u, (size_t)used * 4u);
    return kvr_crc32c(c, m + (size_t)cap * 12u, (size_t)used * 4u);
}

/* ---- small maps (tier.c) ------------------------------------------------------ */

/* ---- small maps ------------------------------------------------------------ */

typedef struct hnode {
    uint64_t      key;
    uint64_t      val;
    struct hnode *next;
} hnode;

typedef struct hmap {
    hnode **b;
    size_t  nb, n;
} hmap;

hnode *kvr_tier_hmap_find(const hmap *m, uint64_t key);
/* Adds delta to key's value (a new key starts at 0): 0, or -1 out of memory. */
int    kvr_tier_hmap_add(hmap *m, uint64_t key, int64_t delta);
void   kvr_tier_hmap_free(hmap *m);

static inline uint64_t hkey(const kvr_disk_handle *h)
{
    return ((uint64_t)h->seg << 40) ^ (h->off >> 12);
}

/* ---- the table of latest records ------------------------------------------- */

typedef struct trec {
    uint32_t      type;          /* REC_MODEL or REC_CTX */
    char          name[KVR_ID_MAX + 1];
    uint8_t      *p;
    size_t        len;
    uint64_t      order;         /* tab_put count when it was put (recovery) */
    bool          stale;         /* recovery: a newer record of it was lost */
    kvr_list      link;          /* on table.recs */
} trec;

typedef struct table {
    kvr_list recs;               /* trec.link: models first (the newest first), then ctxs
                                    (the newest first among them); kvr_tier_tab_init */
    size_t n_ctx;
    hmap   refs;                 /* handle key -> references from CTX records */
    uint64_t n_put;
} table;

/* ---- byte writer / reader ---------------------------------------------------- */

typedef struct wbuf {
    uint8_t *p;
    size_t   len, cap;
    bool     oom;
} wbuf;

typedef struct rbuf {
    const uint8_t *p;
    size_t         len, off;
    bool           bad;
} rbuf;


static inline const void *r_raw(rbuf *r, size_t n)
{
    if (r->bad || n > r->len - r->off) {
        r->bad = true;
        return NULL;
    }
    const void *v = r->p + r->off;
    r->off += n;
    return v;
}
/* Reads n bytes into v (left as it is, zero, when the record is short). */
static inline void r_val(rbuf *r, void *v, size_t n)
{
    const void *p = r_raw(r, n);
    if (p)
        memcpy(v, p, n);
}
static inline uint32_t r_u32(rbuf *r) { uint32_t v = 0; r_val(r, &v, 4); return v; }
static inline uint64_t r_u64(rbuf *r) { uint64_t v = 0; r_val(r, &v, 8); return v; }
static inline double r_f64(rbuf *r) { double v = 0; r_val(r, &v, 8); return v; }
static inline void r_str(rbuf *r, char *out, size_t cap)
{
    uint32_t n = r_u32(r);
    const void *p = n < cap ? r_raw(r, n) : NULL;
    if (!p) {
        r->bad = true;
        out[0] = '\0';
        return;
    }
    memcpy(out, p, n);
    out[n] = '\0';
}
/* Reads a record head (version 1: no name checksum). */
static inline void r_head(rbuf *r, char *name, size_t cap)
{
    uint32_t v = r_u32(r);
    if (v != 1 && v != 2) {
        r->bad = true;
        name[0] = '\0';
        return;
    }
    r_str(r, name, cap);
    if (v == 2 && r_u32(r) != kvr_crc32c(0, name, strlen(name)))
        r->bad = true;
}

/* ---- jobs and batches ---------------------------------------------------------- */

/* for (pjob *j = first job of list h; j; j = next): no removal inside. */
#define tier_jobs_foreach(j, h) \
    for (pjob *j = kvr_list_entry((h)->next, pjob, link); &j->link != (h); \
         j = kvr_list_entry(j->link.next, pjob, link))

typedef struct pspill {
    kvr_block      *b;           /* leased (ref + hold) until the batch ends */
    kvr_disk_buf    img;         /* its two parts */
    uint32_t        used;        /* b->used when the record was made */
    size_t          off;         /* where its handle goes in the record */
} pspill;

typedef struct pjob {
    kvr_list       link;         /* on the tier's queue, then its batch's jobs */
    uint32_t       type;
    char           name[KVR_ID_MAX + 1];
    wbuf           rec;
    pspill        *sp;
    size_t         n_sp;
    kvr_model     *model;        /* REC_MODEL: marked logged (undone on failure) */
    kvr_persist_done_fn done;
    void          *arg;
} pjob;

struct kvr_persist_batch {
    kvr_store     *s;
    kvr_list       jobs;         /* pjob.link, in queue order */
    size_t         n_jobs;
    int            rc;
    kvr_error      err;
    /* unique blocks to spill, and their handles */
    pspill       **u;
    kvr_disk_handle *hs;
    size_t         n_u;
    bool           spilled;
    bool           checkpointed;
};

typedef struct kvr_tier {
    kvr_disk        *d;
    kvr_tier_config  cfg;
    char             dir[1024];
    bool             closing;
    table            tab;
    kvr_model      **logged;     /* models whose MODEL record is queued/durable */
    size_t           n_logged, cap_logged;
    kvr_list         queue;      /* pjob.link: records waiting for a batch, oldest first */
    bool             in_flight;
    kvr_disk_handle *pending;    /* handles waiting for no record to point at them */
    size_t           n_pending, cap_pending;
    char           **deleted;    /* persistent ids destroyed, not logged yet */
    size_t           n_deleted, cap_deleted;
    kvr_tier_log_fn  log;
    void            *log_arg;
    uint64_t         n_spills, spill_bytes, n_reloads, reload_bytes, n_spill_refused;
    uint64_t         reads_mem, reads_disk;
    uint64_t         n_records, n_errors, n_checkpoints;
    kvr_tier_recovery rec;
} kvr_tier;

void kvr_tier_log(kvr_tier *t, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- blocks' spill state (tier.c) ----------------------------------------------- */
/* A block's disk copy: h is a live handle the block owns one reference
 * of; it is a valid copy iff used == the block's used (slots below `used`
 * never change). A spilled block always has a valid copy. */
typedef struct kvr_block_disk {
    kvr_disk_handle h;
    uint32_t        used;
} kvr_block_disk;

/* The block pool's release hook (installed at open): a block that goes
 * gives its disk handle back. */
void kvr_tier_on_block_release(void *arg, kvr_block *b);
/* b's data is on disk only now (its disk copy is valid): frees its memory. */
int  kvr_tier_make_spilled(kvr_store *s, kvr_block *b);
/* The two parts of b's image as the disk layer writes them. */
kvr_disk_buf kvr_tier_image_buf(const kvr_block *b);
/* b's disk copy is h now (of `used` slots): 0, or KVR_ENOMEM. */
int  kvr_tier_set_copy(kvr_store *s, kvr_block *b, const kvr_disk_handle *h, uint32_t used);
/* Frees the pending handles no latest record points at any more. */
void kvr_tier_pending_sweep(kvr_store *s);
/* The table the tier installs at open (tier.c). */
extern const kvr_tier_hooks kvr_tier_disk_hooks;

/* ---- records, table, persistence (tier_persist.c) ------------------------------ */
void kvr_tier_tab_apply(table *tb, uint32_t type, const void *p, size_t len);
void kvr_tier_tab_free(table *tb);
void kvr_tier_tab_refs(table *tb, const trec *r, int delta);
void kvr_tier_tab_init(table *tb);
/* Takes r off tb and frees it (its references, the context count). */
void kvr_tier_tab_drop(table *tb, trec *r);
/* The records of tb in order (r: trec *; no removal inside). */
#define kvr_tier_tab_foreach(r, tb) \
    for (kvr_list *r##_n_ = (tb)->recs.next; \
         r##_n_ != &(tb)->recs && ((r) = kvr_list_entry(r##_n_, trec, link), 1); r##_n_ = r##_n_->next)
/* The name at the head of record p (false: unreadable). */
bool kvr_tier_rec_name(const void *p, size_t len, char *out);
bool kvr_tier_model_logged(kvr_tier *t, const kvr_model *m);
int  kvr_tier_model_log_mark(kvr_tier *t, kvr_model *m);
bool kvr_tier_model_persisted(const kvr_store *s, const kvr_model *m);
/* kvr_disk_checkpoint's callback: writes every latest record of the table. */
int  kvr_tier_snapshot_cb(void *arg, kvr_disk_cp *cp);
void kvr_tier_job_free(kvr_store *s, pjob *j);

#pragma GCC visibility pop

#endif /* KVR_CACHE_TIER_H */
