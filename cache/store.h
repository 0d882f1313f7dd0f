/*
 * store.h — the store layer (private to cache/; store.c): the model
 * registry, the context map and LRU list, memory reservation under the cap
 * with eviction, and the hooks through which the disk tier observes it.
 * Above contexts and blocks; the transactions (put, edit, layout, the read
 * plan under get and assemble) are above it.
 *
 * The disk tier is not called from here or below: kvr_store_tier_open
 * (tier.c) installs a kvr_tier_hooks table and the block pool's release
 * hook, as SQLite's pager takes callbacks rather than calling the btree.
 * Without a tier every hook wrapper below is a no-op.
 */
#ifndef KVR_CACHE_STORE_H
#define KVR_CACHE_STORE_H

#include "cache/ctx.h"

#pragma GCC visibility push(hidden)

#define KVR_DEFAULT_BLOCK_TOKENS 64u
#define KVR_MAX_PUT_TOKENS (1u << 24)
/* The most one request (a put, edit, refresh, or a get's / assemble's
 * staging) may reserve: a quarter of the cap, but at least
 * KVR_REQUEST_FLOOR (or the whole cap if smaller). SIZE_MAX without a cap. */
#define KVR_REQUEST_FLOOR ((size_t)4 << 20)

struct kvr_tier;
/* A transaction's reload of spilled blocks (tier.c). */
typedef struct kvr_reload kvr_reload;

/* What the disk tier does for the layers below it; see tier.c. */
typedef struct kvr_tier_hooks {
    /* A persistent context leaves the store (remembered for its DELETE). */
    void   (*ctx_gone)(kvr_store *s, kvr_ctx *c);
    /* Bytes that spilling every resident unheld block would give back. */
    size_t (*freeable)(kvr_store *s);
    /* Spills least recently used blocks, about `want` bytes of memory in
     * one batch (at least one block): 1 freed memory, 0 nothing to spill,
     * or KVR_E*. */
    int    (*evict)(kvr_store *s, size_t want);
    /* Reloads of spilled blocks: see kvr_store_reload_begin below. */
    int    (*reload_begin)(kvr_store *s, kvr_block *const *bs, size_t n, kvr_ctx *pf,
                           kvr_reload **out, kvr_error *err);
    const kvr_block *(*reload_view)(const kvr_reload *r, const kvr_block *b);
    bool   (*reload_pending)(const kvr_reload *r);
    int    (*reload_work)(kvr_reload *r, kvr_error *err);
    void   (*reload_end)(kvr_store *s, kvr_reload *r);
    /* Forgets an in-memory block's disk copy (a put is about to give it
     * another cap: the image would no longer match). */
    void   (*drop_copy)(kvr_store *s, kvr_block *b);
    /* Whether m has a record in the log (it would come back at a restart). */
    bool   (*model_persisted)(const kvr_store *s, const kvr_model *m);
    /* kvr_store_destroy: before the contexts go / after. */
    void   (*destroy)(kvr_store *s);
    void   (*close)(kvr_store *s);
} kvr_tier_hooks;

struct kvr_store {
    kvr_store_config cfg;
    uint32_t     B;
    kvr_model  **models;
    size_t       n_models, cap_models;
    kvr_ctx    **buckets;
    size_t       n_buckets, n_ctx;   /* n_ctx includes pending */
    kvr_list     lru;                /* kvr_ctx.lru, most recent first */
    kvr_block_pool pool;
    uint64_t     n_evicted_blocks, n_evicted_bytes;
    uint64_t     n_puts, n_gets, n_matches, n_match_hits, n_refused_nomem;
    uint32_t     epoch;
    uint64_t     tenants_used;       /* bit t: a model counts as tenant t (1..63) */
    kvr_store_miss_hooks  miss;      /* a tier above (cache.h); zeroed: none */
    struct kvr_tier      *tier;      /* tier.c: NULL = memory only */
    const kvr_tier_hooks *hooks;     /* set with tier */
    bool         persist_all;        /* tier: every new context is persistent */
};

/* The LRU list, most recently used first: the first / last context, the one
 * after (less recent) / before (more recent) c; NULL past the ends. */
static inline kvr_ctx *kvr_lru_first(const kvr_store *s)
{
    kvr_list *n = kvr_list_first(&s->lru);
    return n ? kvr_list_entry(n, kvr_ctx, lru) : NULL;
}
static inline kvr_ctx *kvr_lru_last(const kvr_store *s)
{
    kvr_list *n = kvr_list_last(&s->lru);
    return n ? kvr_list_entry(n, kvr_ctx, lru) : NULL;
}
static inline kvr_ctx *kvr_lru_next(const kvr_store *s, const kvr_ctx *c)
{
    kvr_list *n = kvr_list_next(&s->lru, &c->lru);
    return n ? kvr_list_entry(n, kvr_ctx, lru) : NULL;
}
static inline kvr_ctx *kvr_lru_prev(const kvr_store *s, const kvr_ctx *c)
{
    kvr_list *n = kvr_list_prev(&s->lru, &c->lru);
    return n ? kvr_list_entry(n, kvr_ctx, lru) : NULL;
}
/* For a walk from the cold end looking for victims: the least recently
 * used context (c NULL), or the next one after c towards the head. A
 * context a match marked (kvr_ctx.matched) is unmarked and moved to the
 * head on the way instead of being returned, unless it is the head
 * already (store.c: a second chance). */
kvr_ctx *kvr_lru_victim(kvr_store *s, kvr_ctx *c);

uint64_t   kvr_store_now_ms(void);
uint64_t   kvr_fnv1a(const void *p, size_t n, uint64_t h);
#define KVR_FNV_INIT 14695981039346656037ull

/* ---- contexts ----------------------------------------------------------- */
/* Any context by id, pending ones included. */
kvr_ctx   *kvr_store_ctx_find(const kvr_store *s, const char *id);
/* Committed (non-pending) context by id: 0, or EBADREQUEST / ENOCTX, or
 * KVR_EFETCH when the id is not in the map at all and the miss hooks took
 * it (every verb that names a context looks it up here: the one place a
 * tier above the store is asked). */
int        kvr_store_ctx_live(const kvr_store *s, const char *id, kvr_ctx **out,
                              kvr_error *err);
int        kvr_ctx_id_check(const char *id, kvr_error *err);
/* A committed context no transaction is writing: 0, or as kvr_store_ctx_live,
 * or KVR_EBUSY. */
int        kvr_store_ctx_writable(kvr_store *s, const char *id, kvr_ctx **out,
                                  kvr_error *err);
/* kvr_store_ctx_writable, then the token range [start, *end) of it
 * (*end SIZE_MAX: to the end) or KVR_ERANGE. */
int        kvr_store_ctx_range(kvr_store *s, const char *id, size_t start, size_t *end,
                               kvr_ctx **out, kvr_error *err);
/* kvr_store_reserve_request for a write of model m's: first within the
 * model's bound (cfg.max_memory_per_model), evicting m's own least
 * recently used contexts, never another model's; then the cap. */
int kvr_store_reserve_for(kvr_store *s, kvr_model *m, size_t need, const char *what,
                          kvr_error *err);

/* 0, or KVR_ELIMIT when a new context would pass cfg.max_contexts. */
int        kvr_store_ctx_limit(const kvr_store *s, const char *id, kvr_error *err);
/* A new pending context in the map (NULL: ENOMEM). */
kvr_ctx   *kvr_store_ctx_new(kvr_store *s, kvr_model *m, const char *id);
/* A new pending context that is in no map (a replace-put's new context, made
 * while the one it replaces keeps the id); kvr_store_ctx_replace puts it in,
 * kvr_ctx_free frees it (NULL: ENOMEM). */
kvr_ctx   *kvr_store_ctx_spare(kvr_store *s, kvr_model *m, const char *id);
/* Makes a pending context live: LRU list, model count. */
void       kvr_store_ctx_commit(kvr_store *s, kvr_ctx *c);
/* The spare c (same id) takes old's place at once: old leaves the store as
 * a delete would (map, LRU, the tier's DELETE, its extents' references:
 * readers keep their leased blocks), then c enters the map and is committed. */
void       kvr_store_ctx_replace(kvr_store *s, kvr_ctx *old, kvr_ctx *c);
/* Unlinks c from the map and the LRU list, tells the tier, frees it. */
void       kvr_store_ctx_destroy(kvr_store *s, kvr_ctx *c);
void       kvr_store_touch(kvr_store *s, kvr_ctx *c);
kvr_model *kvr_store_model(const kvr_store *s, const char *name);
void       kvr_model_fill_info(const kvr_model *m, kvr_model_info *out);
/* Parses a codec spec for a context of m (quant.h's kvr_qspec_parse). */
int        kvr_model_codec(const kvr_model *m, const char *spec, kvr_qspec *out,
                           kvr_error *err);
/* A fresh block of c's plain (window) dtype or of its quantized codec.
 * fill (quantized): slots [0, fill) the caller writes whole before the
 * block is read or spilled (kvr_block_geom.fill); 0 for plain blocks. */
kvr_block *kvr_store_block_new(kvr_store *s, const kvr_ctx *c, bool quant, uint32_t fill);
/* The same sized for `want` tokens (a context's last block): plain, the
 * cap kvr_block_fit_cap gives; quantized, want rounded up to the K tile.
 * want >= the full cap: a full block. */
kvr_block *kvr_store_block_new_for(kvr_store *s, const kvr_ctx *c, bool quant, uint32_t fill,
                                   uint32_t want);
/* Image bytes of a full block (K/V, header, metadata). */
size_t     kvr_store_block_bytes(const kvr_store *s, const kvr_ctx *c, bool quant);
/* What the allocator holds for a block sized for `want` tokens (its size
 * classes: K/V, metadata, struct): a request's reservation. */
size_t     kvr_store_block_alloc(const kvr_store *s, const kvr_ctx *c, bool quant,
                                 uint32_t want);
/* The cap a plain block of c for `want` tokens gets (kvr_block_fit_cap). */
uint32_t   kvr_store_block_fit(const kvr_store *s, const kvr_ctx *c, uint32_t want);

/* ---- memory ------------------------------------------------------------- */
/* Makes room for `need` more bytes under the cap (evicting), or KVR_ENOMEM. */
int        kvr_store_reserve(kvr_store *s, size_t need, kvr_error *err);
size_t     kvr_store_request_max(const kvr_store *s);
/* kvr_store_reserve for one request's `need` bytes; KVR_ETOOLARGE (naming
 * `what`, evicting nothing) over kvr_store_request_max, so a single request
 * cannot evict the whole cache before it sends a byte. */
int        kvr_store_reserve_request(kvr_store *s, size_t need, const char *what,
                                     kvr_error *err);
/* A read's layer selection: all of m's layers (layers NULL) or the n_sel
 * listed, at least one, every id below m->n_layers and none twice (a read
 * cannot ask for 64x the context's bytes of staging). *nl: how many layers
 * the read has. 0, KVR_ERANGE, KVR_EINVAL or KVR_ENOMEM. */
int        kvr_layers_check(const kvr_model *m, const uint32_t *layers, size_t n_sel,
                            size_t *nl, kvr_error *err);

/* ---- disk tier hooks ---------------------------------------------------- */
/* A transaction's reload of spilled blocks, off the loop thread:
 *  begin (loop): for the spilled blocks among bs[0..n) (held by the
 *    caller), reserves memory (evicts/spills others; ENOMEM if impossible),
 *    allocates their buffers and takes a reference; adds the other spilled
 *    blocks of `pf` (may be NULL; made busy meanwhile) as a prefetch while
 *    they fit under the cap without evicting. *out = NULL when nothing is
 *    spilled (always without a tier).
 *  view (loop, at begin): what to read b through: b itself if resident,
 *    else a copy of its fields whose data is the buffer (filled by work;
 *    valid until end). Iovecs may point into it (zero-copy).
 *  pending: work has not run yet.
 *  work (any thread, idempotent): one batched load; KVR_EIO with a message
 *    if a block of the request failed; prefetch failures are ignored.
 *  end (loop; NULL ok): installs loaded buffers into blocks still spilled
 *    and still referenced elsewhere; frees the others; drops the refs. */
static inline int kvr_store_reload_begin(kvr_store *s, kvr_block *const *bs, size_t n,
                                         kvr_ctx *pf, kvr_reload **out, kvr_error *err)
{
    *out = NULL;
    return s->hooks ? s->hooks->reload_begin(s, bs, n, pf, out, err) : 0;
}
static inline const kvr_block *kvr_store_reload_view(const kvr_store *s, const kvr_reload *r,
                                                     const kvr_block *b)
{
    return r ? s->hooks->reload_view(r, b) : b;
}
static inline bool kvr_store_reload_pending(const kvr_store *s, const kvr_reload *r)
{
    return r && s->hooks->reload_pending(r);
}
static inline int kvr_store_reload_work(const kvr_store *s, kvr_reload *r, kvr_error *err)
{
    return r ? s->hooks->reload_work(r, err) : 0;
}
static inline void kvr_store_reload_end(kvr_store *s, kvr_reload *r)
{
    if (r)
        s->hooks->reload_end(s, r);
}
/* Makes blocks bs[0..n) resident now, on the calling thread (begin + work
 * + end); the blocks must be held. */
int        kvr_store_fault_in(kvr_store *s, kvr_block *const *bs, size_t n, kvr_error *err);

#pragma GCC visibility pop

#endif /* KVR_CACHE_STORE_H */
