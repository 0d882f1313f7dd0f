/*
 * store.c — the store: model registry, the context map (chained hash by
 * id), the LRU list, eviction under the memory cap, and the context
 * management verbs (delete, stat, list, pin, fork, shift, keep, match,
 * stats).
 *
 * Invariants:
 *  - Every context (pending ones too) is in the hash map; every non-pending
 *    one is in the LRU list (head = most recently used) and counted in its
 *    model's n_contexts.
 *  - A pending context belongs to an open create-put: readers treat it as
 *    absent; writers get KVR_EBUSY.
 *  - Eviction takes tail blocks of the least recently used context that is
 *    neither pinned nor busy; it first checks that evicting everything
 *    evictable would be enough, so a refused write harms nothing stored.
 *  - Shift and keep change extents only: no K/V byte is copied or rotated.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/layout.h"
#include "cache/store.h"
#include "base/clock.h"

uint64_t kvr_fnv1a(const void *p, size_t n, uint64_t h)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 1099511628211ull;
    }
    return h;
}

uint64_t kvr_store_now_ms(void)
{
    return kvr_clock_wall_ms();
}

/* ---- store -------------------------------------------------------------- */

int kvr_store_create(kvr_store **out, const kvr_store_config *cfg, kvr_error *err)
{
    kvr_store *s = kvr_mem_calloc(1, sizeof *s);
    if (!s)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory creating the store");
    if (cfg)
        s->cfg = *cfg;
    if (s->cfg.block_tokens > (1u << 20)) {
        kvr_mem_free(s);
        return kvr_error_set(err, KVR_EINVAL, "block_tokens %u is too large",
                             s->cfg.block_tokens);
    }
    s->B = s->cfg.block_tokens ? s->cfg.block_tokens : KVR_DEFAULT_BLOCK_TOKENS;
    s->pool.cache_max = s->cfg.block_cache;
    if (s->cfg.max_memory && s->pool.cache_max > s->cfg.max_memory / 16)
        s->pool.cache_max = s->cfg.max_memory / 16;
    s->cfg.block_tokens = s->B;
    kvr_list_init(&s->lru);
    s->n_buckets = 64;
    s->buckets = kvr_mem_calloc(s->n_buckets, sizeof *s->buckets);
    if (!s->buckets) {
        kvr_mem_free(s);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory creating the store");
    }
    *out = s;
    return 0;
}

/* Everything a model owns (destroy, remove_model). */
static void model_free(kvr_model *m)
{
    kvr_ptree_free(&m->tree[0]);
    kvr_ptree_free(&m->tree[1]);
    kvr_grain_index_free(&m->grains);
    kvr_rope_destroy(m->engine);
    kvr_mem_free(m);
}

void kvr_store_destroy(kvr_store *s)
{
    if (!s)
        return;
    if (s->hooks)
        s->hooks->destroy(s);
    for (size_t i = 0; i < s->n_buckets; i++) {
        while (s->buckets[i])
            kvr_store_ctx_destroy(s, s->buckets[i]);
    }
    for (size_t i = 0; i < s->n_models; i++)
        model_free(s->models[i]);
    if (s->hooks)
        s->hooks->close(s);
    kvr_block_pool_trim(&s->pool);
    assert(s->pool.n_blocks == 0 && s->pool.n_leased == 0);
    kvr_mem_free(s->models);
    kvr_mem_free(s->buckets);
    kvr_mem_free(s);
    kvr_mem_trim();   /* the kept staging buffer (mem.c) */
}

size_t kvr_store_trim(kvr_store *s)
{
    size_t freed = kvr_block_pool_trim(&s->pool);
    kvr_mem_trim();   /* the kept staging buffer (mem.c) */
    return freed;
}

/* ---- ids and the context map -------------------------------------------- */

int kvr_ctx_id_check(const char *id, kvr_error *err)
{
    if (!id || !id[0])
        return kvr_error_set(err, KVR_EBADREQUEST, "context id is empty");
    size_t n = strnlen(id, KVR_ID_MAX + 1);
    if (n > KVR_ID_MAX)
        return kvr_error_set(err, KVR_EBADREQUEST,
                             "context id is longer than %d bytes", KVR_ID_MAX);
    return 0;
}

kvr_ctx *kvr_store_ctx_find(const kvr_store *s, const char *id)
{
    if (!id)
        return NULL;
    size_t n = strnlen(id, KVR_ID_MAX + 1);
    if (n == 0 || n > KVR_ID_MAX)
        return NULL;
    uint64_t h = kvr_fnv1a(id, n, KVR_FNV_INIT);
    for (kvr_ctx *c = s->buckets[h & (s->n_buckets - 1)]; c; c = c->hnext)
        if (c->hash == h && c->id_len == n && memcmp(c->id, id, n) == 0)
            return c;
    return NULL;
}

int kvr_store_ctx_live(const kvr_store *s, const char *id, kvr_ctx **out, kvr_error *err)
{
    int rc = kvr_ctx_id_check(id, err);
    if (rc != 0)
        return rc;
    kvr_ctx *c = kvr_store_ctx_find(s, id);
    /* A pending context (an open create-put) is absent to readers: the tier
     * is asked as for one not here at all (the daemon's shared tier then
     * waits for its own fetch that holds that put). */
    if ((!c || c->pending) && s->miss.ctx && s->miss.ctx(s->miss.arg, id))
        return kvr_error_set(err, KVR_EFETCH, "context '%s' is not here: asked the tier "
                             "above the store", id);
    if (!c || c->pending)
        return kvr_error_set(err, KVR_ENOCTX, "no context '%s'", id);
    *out = c;
    return 0;
}

void kvr_store_set_miss_hooks(kvr_store *s, const kvr_store_miss_hooks *h)
{
    s->miss = h ? *h : (kvr_store_miss_hooks){ 0 };
}

int kvr_store_ctx_writable(kvr_store *s, const char *id, kvr_ctx **out, kvr_error *err)
{
    int rc = kvr_store_ctx_live(s, id, out, err);
    if (rc != 0)
        return rc;
    if ((*out)->busy)
        return kvr_error_set(err, KVR_EBUSY, "context '%s' is being written", id);
    return 0;
}

int kvr_store_ctx_range(kvr_store *s, const char *id, size_t start, size_t *end,
                        kvr_ctx **out, kvr_error *err)
{
    int rc = kvr_store_ctx_writable(s, id, out, err);
    if (rc != 0)
        return rc;
    const kvr_ctx *c = *out;
    if (*end == SIZE_MAX)
        *end = c->n_tokens;
    if (start > *end || *end > c->n_tokens)
        return kvr_error_set(err, KVR_ERANGE,
                             "token range [%zu, %zu) is outside context '%s' of %zu tokens",
                             start, *end, c->id, c->n_tokens);
    return 0;
}

static void map_grow(kvr_store *s)
{
    size_t nb = s->n_buckets * 2;
    kvr_ctx **b = kvr_mem_calloc(nb, sizeof *b);
    if (!b)
        return;     /* longer chains, still correct */
    for (size_t i = 0; i < s->n_buckets; i++) {
        kvr_ctx *c = s->buckets[i];
        while (c) {
            kvr_ctx *next = c->hnext;
            c->hnext = b[c->hash & (nb - 1)];
            b[c->hash & (nb - 1)] = c;
            c = next;
        }
    }
    kvr_mem_free(s->buckets);
    s->buckets = b;
    s->n_buckets = nb;
}

void kvr_store_touch(kvr_store *s, kvr_ctx *c)
{
    c->accessed_ms = kvr_store_now_ms();
    if (c->pending)
        return;
    c->matched = false;
    kvr_list_remove(&c->lru);   /* a node on no list points at itself: a no-op */
    kvr_list_insert_head(&s->lru, &c->lru);
}

/* A match hit marks the context instead of moving it: the move writes the
 * list links of the context and of three others (its neighbours, the
 * head), lines no match reads, which on a large store are cold. Whoever
 * walks the list from its cold end for a victim (kvr_lru_victim) gives a
 * marked context a second chance (CLOCK's): it is unmarked and moved to the
 * head then, and the walk goes on. So a matched context is kept over every
 * context not used since the walk began, though not ordered among the
 * contexts used after its match as an immediate move would order it. */
static void touch_match(kvr_ctx *c)
{
    c->accessed_ms = kvr_store_now_ms();
    if (!c->pending)
        c->matched = true;
}

kvr_ctx *kvr_lru_victim(kvr_store *s, kvr_ctx *c)
{
    kvr_ctx *v = c ? kvr_lru_prev(s, c) : kvr_lru_last(s);
    while (v && v->matched) {
        kvr_ctx *p = kvr_lru_prev(s, v);
        v->matched = false;
        if (!p)
            return v;   /* the head: no context was used after it */
        kvr_list_remove(&v->lru);
        kvr_list_insert_head(&s->lru, &v->lru);
        v = p;
    }
    return v;
}

int kvr_store_ctx_limit(const kvr_store *s, const char *id, kvr_error *err)
{
    if (s->cfg.max_contexts && s->n_ctx >= s->cfg.max_contexts)
        return kvr_error_set(err, KVR_ELIMIT, "cannot create '%s': %zu contexts exist, the "
                             "limit (--max-contexts); delete some first", id, s->n_ctx);
    return 0;
}

static void map_insert(kvr_store *s, kvr_ctx *c)
{
    if (s->n_ctx >= s->n_buckets)
        map_grow(s);
    size_t b = c->hash & (s->n_buckets - 1);
    c->hnext = s->buckets[b];
    s->buckets[b] = c;
    s->n_ctx++;
}

kvr_ctx *kvr_store_ctx_spare(kvr_store *s, kvr_model *m, const char *id)
{
    (void)s;
    return kvr_ctx_create(m, id, kvr_fnv1a(id, strlen(id), KVR_FNV_INIT), kvr_store_now_ms());
}

kvr_ctx *kvr_store_ctx_new(kvr_store *s, kvr_model *m, const char *id)
{
    kvr_ctx *c = kvr_store_ctx_spare(s, m, id);
    if (c)
        map_insert(s, c);
    return c;
}

void kvr_store_ctx_commit(kvr_store *s, kvr_ctx *c)
{
    assert(c->pending);
    kvr_ctx_check(c);
    c->pending = false;
    c->model->n_contexts++;
    kvr_store_touch(s, c);
}

void kvr_store_ctx_replace(kvr_store *s, kvr_ctx *old, kvr_ctx *c)
{
    assert(c->pending && !old->pending && c->id_len == old->id_len &&
           memcmp(c->id, old->id, c->id_len) == 0);
    kvr_store_ctx_destroy(s, old);
    map_insert(s, c);
    kvr_store_ctx_commit(s, c);
}

void kvr_store_ctx_destroy(kvr_store *s, kvr_ctx *c)
{
    kvr_ctx **pp = &s->buckets[c->hash & (s->n_buckets - 1)];
    while (*pp && *pp != c)
        pp = &(*pp)->hnext;
    assert(*pp == c);
    if (*pp)
        *pp = c->hnext;
    assert(s->n_ctx > 0);
    s->n_ctx--;
    if (s->hooks && c->persist && !c->pending)
        s->hooks->ctx_gone(s, c);
    if (!c->pending) {
        kvr_list_remove(&c->lru);
        c->model->n_contexts--;
    }
    kvr_ctx_free(&s->pool, c);
}

/* Drops the last extent of c (one block's worth at most) for eviction. */
static void evict_tail(kvr_store *s, kvr_ctx *c)
{
    kvr_block *b = c->ext[c->n_ext - 1].block;
    size_t before = c->n_tokens;
    s->n_evicted_blocks++;
    c->model->n_evicted_blocks++;
    if (kvr_block_exclusive(b)) {
        s->n_evicted_bytes += b->bytes;
        c->model->n_evicted_bytes += b->bytes;
    }
    kvr_ctx_drop_extents(&s->pool, c, c->n_ext - 1, c->n_ext);
    c->n_evicted_tokens += before - c->n_tokens;
    kvr_ctx_index_truncate(c, 0, c->n_exact);
    kvr_ctx_index_truncate(c, 1, c->n_tokens);
    kvr_grain_note(c, c->n_tokens);
    kvr_grain_sync(c);
    kvr_ctx_check(c);
    if (c->n_tokens == 0)
        kvr_store_ctx_destroy(s, c);
}

/* The model's bytes as a tenant (its blocks'). */
static size_t tenant_bytes(const kvr_store *s, const kvr_model *m)
{
    return m->tenant ? s->pool.tenant_bytes[m->tenant] : 0;
}

static bool evictable(const kvr_ctx *c)
{
    return !c->pinned && !c->busy && !c->pending;
}

/* Counts, in each block's mcount, the references c's extents hold (blocks
 * first seen in epoch ep start from 0). */
static void count_refs(const kvr_ctx *c, uint32_t ep)
{
    for (size_t i = 0; i < c->n_ext; i++) {
        kvr_block *b = c->ext[i].block;
        if (b->mark != ep) {
            b->mark = ep;
            b->mcount = 0;
        }
        b->mcount++;
    }
}

/* Bytes that evicting every evictable context would give back. */
static size_t freeable_bytes(kvr_store *s)
{
    uint32_t ep = ++s->epoch;
    for (kvr_ctx *c = kvr_lru_first(s); c; c = kvr_lru_next(s, c))
        if (evictable(c))
            count_refs(c, ep);
    size_t total = 0;
    ep = ++s->epoch;
    for (kvr_ctx *c = kvr_lru_first(s); c; c = kvr_lru_next(s, c)) {
        if (!evictable(c))
            continue;
        for (size_t i = 0; i < c->n_ext; i++) {
            kvr_block *b = c->ext[i].block;
            if (b->mark == ep - 1 && b->mcount == b->refcount)
                total += b->bytes;
            b->mark = ep;   /* count each block once */
        }
    }
    return total;
}

int kvr_store_reserve(kvr_store *s, size_t need, kvr_error *err)
{
    size_t cap = s->cfg.max_memory;
    if (cap == 0 || kvr_mem_allocated() + need <= cap)
        return 0;
    kvr_store_trim(s);   /* at the cap: the block cache and the kept staging buffer go first */
    size_t have = kvr_mem_allocated();
    size_t freeable = freeable_bytes(s) + (s->hooks ? s->hooks->freeable(s) : 0);
    if (need > cap || have - (freeable < have ? freeable : have) + need > cap) {
        s->n_refused_nomem++;
        return kvr_error_set(err, KVR_ENOMEM,
                             "memory cap %zu bytes cannot fit %zu more bytes: %zu in use, "
                             "only %zu evictable (the rest is pinned, busy or leased)",
                             cap, need, have, freeable);
    }
    /* What eviction frees must go back to the allocator, not into the
     * block cache, or it would not lower kvr_mem_allocated(). */
    size_t cache_max = s->pool.cache_max;
    s->pool.cache_max = 0;
    int rc = 0;
    while (rc == 0 && kvr_mem_allocated() + need > cap) {
        /* Disk tier: spill the least recently used block instead; drop
         * only when the disk refuses (full, failed) or nothing is left to
         * spill. Persistent contexts are never dropped. */
        int sp = s->hooks ? s->hooks->evict(s, kvr_mem_allocated() + need - cap) : 0;
        if (sp == 1)
            continue;
        kvr_ctx *v = kvr_lru_victim(s, NULL);
        while (v && (!evictable(v) || (s->tier && v->persist)))
            v = kvr_lru_victim(s, v);
        if (!v) {
            s->n_refused_nomem++;
            rc = kvr_error_set(err, KVR_ENOMEM,
                               "memory cap %zu bytes cannot fit %zu more bytes "
                               "after evicting everything evictable", cap, need);
            break;
        }
        evict_tail(s, v);
    }
    s->pool.cache_max = cache_max;
    return rc;
}

size_t kvr_store_request_max(const kvr_store *s)
{
    size_t cap = s->cfg.max_memory;
    if (cap == 0)
        return SIZE_MAX;
    size_t floor = cap < KVR_REQUEST_FLOOR ? cap : KVR_REQUEST_FLOOR;
    return cap / 4 > floor ? cap / 4 : floor;
}

int kvr_layers_check(const kvr_model *m, const uint32_t *layers, size_t n_sel, size_t *nl,
                     kvr_error *err)
{
    *nl = layers ? n_sel : m->n_layers;
    if (!layers)
        return 0;
    if (n_sel == 0)
        return kvr_error_set(err, KVR_EINVAL, "empty layer selection");
    for (size_t i = 0; i < n_sel; i++)
        if (layers[i] >= m->n_layers)
            return kvr_error_set(err, KVR_ERANGE, "layer %u out of range (model '%s' has %u)",
                                 layers[i], m->name, m->n_layers);
    if (n_sel > m->n_layers)
        return kvr_error_set(err, KVR_EINVAL, "%zu layers selected of %u: a layer is "
                             "listed twice", n_sel, m->n_layers);
    uint64_t *seen = kvr_mem_calloc(((size_t)m->n_layers + 63) / 64, sizeof *seen);
    if (!seen)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory checking the layers");
    int rc = 0;
    for (size_t i = 0; i < n_sel && rc == 0; i++) {
        uint64_t bit = 1ull << (layers[i] % 64);
        if (seen[layers[i] / 64] & bit)
            rc = kvr_error_set(err, KVR_EINVAL, "layer %u is listed twice", layers[i]);
        seen[layers[i] / 64] |= bit;
    }
    kvr_mem_free(seen);
    return rc;
}

int kvr_store_reserve_for(kvr_store *s, kvr_model *m, size_t need, const char *what,
                          kvr_error *err)
{
    size_t bound = s->cfg.max_memory_per_model;
    if (!bound || !m->tenant || tenant_bytes(s, m) + need <= bound)
        return kvr_store_reserve_request(s, need, what, err);
    if (need > bound) {
        m->n_refused_bound++;
        return kvr_error_set(err, KVR_ETOOLARGE, "%s needs %zu bytes, over model '%s''s "
                             "bound of %zu (max-memory-per-model)", what, need, m->name,
                             bound);
    }
    /* Over its bound: this model's own least recently used contexts go
     * (dropped: the bound is on memory, and a spill would make room
     * only to fill the disk with the flood); persistent ones stay. */
    size_t cache_max = s->pool.cache_max;
    s->pool.cache_max = 0;
    int rc = 0;
    while (tenant_bytes(s, m) + need > bound) {
        kvr_ctx *v = kvr_lru_victim(s, NULL);
        while (v && (v->model != m || !evictable(v) || (s->tier && v->persist)))
            v = kvr_lru_victim(s, v);
        if (!v) {
            m->n_refused_bound++;
            rc = kvr_error_set(err, KVR_ENOMEM, "model '%s' holds %zu bytes of its %zu-byte "
                               "bound (max-memory-per-model) and none of it can be evicted "
                               "for %zu more", m->name, tenant_bytes(s, m), bound, need);
            break;
        }
        evict_tail(s, v);
    }
    s->pool.cache_max = cache_max;
    return rc ? rc : kvr_store_reserve_request(s, need, what, err);
}

int kvr_store_reserve_request(kvr_store *s, size_t need, const char *what, kvr_error *err)
{
    size_t max = kvr_store_request_max(s);
    if (need > max)
        return kvr_error_set(err, KVR_ETOOLARGE,
                             "%s needs %zu bytes, over the %zu one request may use (a "
                             "quarter of the %zu-byte memory cap): split it", what, need,
                             max, s->cfg.max_memory);
    return kvr_store_reserve(s, need, err);
}

/* ---- models ------------------------------------------------------------- */

kvr_model *kvr_store_model(const kvr_store *s, const char *name)
{
    if (!name)
        return NULL;
    for (size_t i = 0; i < s->n_models; i++)
        if (strcmp(s->models[i]->name, name) == 0)
            return s->models[i];
    return NULL;
}

void kvr_model_fill_info(const kvr_model *m, kvr_model_info *out)
{
    memset(out, 0, sizeof *out);
    memcpy(out->name, m->name, sizeof out->name);
    out->n_layers = m->n_layers;
    out->n_kv_heads = m->n_kv_heads;
    out->head_dim = m->head_dim;
    out->dtype = m->dtype;
    out->fingerprint = m->fingerprint;
    out->rope = &m->rope_cfg;
    out->engine = m->engine;
    out->n_contexts = m->n_contexts;
    memcpy(out->codec, m->codec.name, sizeof out->codec);
    out->n_evicted_blocks = m->n_evicted_blocks;
    out->n_evicted_bytes = m->n_evicted_bytes;
    out->n_matches = m->n_matches;
    out->n_match_hits = m->n_match_hits;
    out->n_refused_bound = m->n_refused_bound;
}


static uint64_t model_fingerprint(const kvr_model_desc *d, const kvr_rope_config *rc,
                                  int *rc_out)
{
    char head[128];
    int n = snprintf(head, sizeof head, "n_layers=%u;n_kv_heads=%u;head_dim=%u;dtype=%s;rope=",
                     d->n_layers, d->n_kv_heads, d->head_dim, kvr_dtype_name(d->dtype));
    uint64_t h = kvr_fnv1a(head, (size_t)n, KVR_FNV_INIT);
    size_t need = kvr_rope_config_canonical(rc, NULL, 0);
    char *buf = kvr_mem_malloc(need + 1);
    if (!buf) {
        *rc_out = KVR_ENOMEM;
        return 0;
    }
    size_t got = kvr_rope_config_canonical(rc, buf, need + 1);
    h = kvr_fnv1a(buf, got < need ? got : need, h);
    kvr_mem_free(buf);
    *rc_out = 0;
    return h ? h : 1;   /* 0 means "unchecked" on the wire */
}

int kvr_store_model_register(kvr_store *s, const kvr_model_desc *d,
                             kvr_model_info *out, kvr_error *err)
{
    int rc;
    if (!d || !d->name || !d->name[0] || strnlen(d->name, KVR_ID_MAX + 1) > KVR_ID_MAX)
        return kvr_error_set(err, KVR_EBADREQUEST, "model name must be 1..%d bytes",
                             KVR_ID_MAX);
    if (d->n_layers == 0 || d->n_layers > 4096 || d->n_kv_heads == 0 ||
        d->n_kv_heads > 4096 || d->head_dim == 0 || d->head_dim > KVR_ROPE_MAX_HEAD_DIM)
        return kvr_error_set(err, KVR_ESHAPE,
                             "model '%s': bad shape n_layers=%u n_kv_heads=%u head_dim=%u",
                             d->name, d->n_layers, d->n_kv_heads, d->head_dim);
    if (kvr_dtype_size(d->dtype) == 0)
        return kvr_error_set(err, KVR_ESHAPE, "model '%s': unknown dtype %d", d->name,
                             (int)d->dtype);
    /* A config that leaves head_dim (and rotary_dim) unset takes the model's. */
    kvr_rope_config rcfg = d->rope;
    if (rcfg.head_dim == 0)
        rcfg.head_dim = (int32_t)d->head_dim;
    if (rcfg.rotary_dim == 0)
        rcfg.rotary_dim = rcfg.head_dim;
    if (rcfg.head_dim != (int32_t)d->head_dim)
        return kvr_error_set(err, KVR_ESHAPE,
                             "model '%s': head_dim %u does not match the rope config's %d",
                             d->name, d->head_dim, rcfg.head_dim);
    /* A per-layer RoPE map (rope/: Gemma 3, Llama 4, Cohere 2) names every
     * layer: it must be the model's layer count. */
    if (rcfg.n_layer_kinds > 0 && (uint32_t)rcfg.n_layer_kinds != d->n_layers)
        return kvr_error_set(err, KVR_ESHAPE,
                             "model '%s': n_layers %u, but the rope config has a per-layer "
                             "RoPE map of %d layers", d->name, d->n_layers,
                             (int)rcfg.n_layer_kinds);
    uint64_t fp = model_fingerprint(d, &rcfg, &rc);
    if (rc != 0)
        return kvr_error_set(err, rc, "out of memory registering model '%s'", d->name);

    kvr_model *old = kvr_store_model(s, d->name);
    if (old) {
        if (old->fingerprint != fp)
            return kvr_error_set(err, KVR_EEXIST,
                                 "model '%s' is already registered with another "
                                 "fingerprint (%016llx, new %016llx)", d->name,
                                 (unsigned long long)old->fingerprint,
                                 (unsigned long long)fp);
        /* The default codec is not part of the fingerprint (it is storage,
         * not the model), but asking for another one must not be silently
         * ignored: a re-register that names a codec must name the same. */
        if (d->codec && d->codec[0]) {
            kvr_qspec q;
            if ((rc = kvr_qspec_parse(d->codec, &old->rope_cfg, old->name, kvr_model_row(old),
                                      d->dtype, &q, err)) != 0)
                return rc;
            if (strcmp(q.name, old->codec.name) != 0)
                return kvr_error_set(err, KVR_EEXIST,
                                     "model '%s' is already registered with default codec "
                                     "'%s', not '%s'", d->name, old->codec.name, q.name);
        }
        if (out)
            kvr_model_fill_info(old, out);
        return 0;
    }

    if (s->cfg.max_models && s->n_models >= s->cfg.max_models)
        return kvr_error_set(err, KVR_ELIMIT, "model '%s': %zu models are registered, the "
                             "limit (--max-models); remove one first", d->name, s->n_models);
    kvr_model *m = kvr_mem_calloc(1, sizeof *m);
    if (!m) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory registering model '%s'", d->name);
        goto fail;
    }
    kvr_error emsg = { 0 };
    if (kvr_rope_create(&m->engine, &rcfg, &emsg) != 0) {
        rc = kvr_error_set(err, KVR_ECONFIG, "model '%s': rope config refused: %s",
                           d->name, emsg.msg[0] ? emsg.msg : "invalid");
        goto fail_model;
    }
    if (s->n_models == s->cap_models) {
        size_t cap = s->cap_models ? s->cap_models * 2 : 4;
        kvr_model **a = kvr_mem_realloc(s->models, cap * sizeof *a);
        if (!a) {
            rc = kvr_error_set(err, KVR_ENOMEM, "out of memory registering model '%s'",
                               d->name);
            goto fail_engine;
        }
        s->models = a;
        s->cap_models = cap;
    }
    memcpy(m->name, d->name, strlen(d->name) + 1);
    m->n_layers = d->n_layers;
    m->n_kv_heads = d->n_kv_heads;
    m->head_dim = d->head_dim;
    m->dtype = d->dtype;
    m->fingerprint = fp;
    m->rope_cfg = rcfg;
    if ((rc = kvr_qspec_parse(d->codec, &m->rope_cfg, m->name, kvr_model_row(m), d->dtype,
                              &m->codec, err)) != 0)
        goto fail_engine;
    kvr_ptree_init(&m->tree[0]);
    kvr_ptree_init(&m->tree[1]);
    kvr_grain_index_init(&m->grains);
    for (uint16_t t = 1; t < KVR_BLOCK_TENANTS && !m->tenant; t++)
        if (!(s->tenants_used & (1ull << t))) {
            m->tenant = t;
            s->tenants_used |= 1ull << t;
        }
    s->models[s->n_models++] = m;
    if (out)
        kvr_model_fill_info(m, out);
    return 0;

fail_engine:
    kvr_rope_destroy(m->engine);
fail_model:
    kvr_mem_free(m);
fail:
    return rc;
}

int kvr_store_model_remove(kvr_store *s, const char *name, kvr_error *err)
{
    size_t k = 0;
    while (k < s->n_models && (!name || strcmp(s->models[k]->name, name) != 0))
        k++;
    if (k == s->n_models)
        return kvr_error_set(err, KVR_ENOMODEL, "no model '%s'", name ? name : "");
    kvr_model *m = s->models[k];
    /* Every context counts, committed or still being created. */
    size_t users = 0;
    for (size_t i = 0; i < s->n_buckets; i++)
        for (kvr_ctx *c = s->buckets[i]; c; c = c->hnext)
            users += c->model == m;
    if (users)
        return kvr_error_set(err, KVR_EBUSY, "model '%s' is used by %zu context%s: delete "
                             "them first", name, users, users == 1 ? "" : "s");
    if (s->pool.n_leased)
        return kvr_error_set(err, KVR_EBUSY, "model '%s': reads are in flight; retry",
                             name);
    if (s->hooks && s->hooks->model_persisted && s->hooks->model_persisted(s, m))
        return kvr_error_set(err, KVR_EUNSUPPORTED, "model '%s' is persisted on the disk "
                             "tier: removing it is not supported", name);
    assert(tenant_bytes(s, m) == 0);   /* no contexts: no blocks */
    s->tenants_used &= ~(1ull << m->tenant);
    model_free(m);
    memmove(&s->models[k], &s->models[k + 1], (s->n_models - k - 1) * sizeof *s->models);
    s->n_models--;
    return 0;
}

int kvr_store_model_find(const kvr_store *s, const char *name, kvr_model_info *out)
{
    kvr_model *m = kvr_store_model(s, name);
    if (!m)
        return KVR_ENOMODEL;
    if (out) {
        kvr_model_fill_info(m, out);
        out->bytes = tenant_bytes(s, m);
    }
    return 0;
}

int kvr_store_model_shape(const kvr_store *s, const char *name, uint32_t *n_layers,
                          uint32_t *n_kv_heads, uint32_t *head_dim)
{
    const kvr_model *m = kvr_store_model(s, name);
    if (!m)
        return KVR_ENOMODEL;
    *n_layers = m->n_layers;
    *n_kv_heads = m->n_kv_heads;
    *head_dim = m->head_dim;
    return 0;
}

size_t kvr_store_model_list(const kvr_store *s, kvr_model_info *out, size_t cap)
{
    for (size_t i = 0; i < s->n_models && i < cap; i++) {
        kvr_model_fill_info(s->models[i], &out[i]);
        out[i].bytes = tenant_bytes(s, s->models[i]);
    }
    return s->n_models;
}

int kvr_model_codec(const kvr_model *m, const char *spec, kvr_qspec *out, kvr_error *err)
{
    return kvr_qspec_parse(spec, &m->rope_cfg, m->name, kvr_model_row(m), m->dtype, out, err);
}

int kvr_store_codec_check(const kvr_store *s, const char *model, const char *spec,
                          char out[KVR_CODEC_NAME_MAX], kvr_error *err)
{
    kvr_model *m = kvr_store_model(s, model);
    if (!m)
        return kvr_error_set(err, KVR_ENOMODEL, "no model '%s'", model ? model : "");
    kvr_qspec q;
    int rc = kvr_model_codec(m, spec, &q, err);
    if (rc == 0 && out)
        memcpy(out, q.name, KVR_CODEC_NAME_MAX);
    return rc;
}

/* Geometry of c's blocks for `want` tokens (>= s->B: a full block). A
 * context's last block holds what its tokens need, not s->B slots: a
 * 200-token context of 64-token blocks is three full blocks and one of 8
 * (rounded up to a slab alignment and to what its size class holds). */
static void block_geom(const kvr_store *s, const kvr_ctx *c, bool quant, uint32_t want,
                       kvr_block_geom *g)
{
    const kvr_model *m = c->model;
    uint32_t B = want && want < s->B ? want : s->B;
    if (quant) {
        kvr_qspec_geom(&c->codec, B, m->n_layers, kvr_model_row(m), g);
        g->tenant = m->tenant;
        return;
    }
    kvr_block_geom_plain(g, s->B, m->n_layers, kvr_model_row(m), c->dtype);
    if (B < s->B)
        g->cap = kvr_block_fit_cap(g, B);
    g->tenant = m->tenant;
}

kvr_block *kvr_store_block_new_for(kvr_store *s, const kvr_ctx *c, bool quant, uint32_t fill,
                                   uint32_t want)
{
    kvr_block_geom g;
    block_geom(s, c, quant, want, &g);
    g.fill = quant ? fill : 0;
    return kvr_block_create(&s->pool, &g, NULL, 0, NULL, 0);
}

kvr_block *kvr_store_block_new(kvr_store *s, const kvr_ctx *c, bool quant, uint32_t fill)
{
    return kvr_store_block_new_for(s, c, quant, fill, 0);
}

size_t kvr_store_block_bytes(const kvr_store *s, const kvr_ctx *c, bool quant)
{
    kvr_block_geom g;
    block_geom(s, c, quant, 0, &g);
    return kvr_block_geom_bytes(&g);
}

size_t kvr_store_block_alloc(const kvr_store *s, const kvr_ctx *c, bool quant, uint32_t want)
{
    kvr_block_geom g;
    block_geom(s, c, quant, want, &g);
    return kvr_block_geom_alloc(&g);
}

uint32_t kvr_store_block_fit(const kvr_store *s, const kvr_ctx *c, uint32_t want)
{
    kvr_block_geom g;
    block_geom(s, c, false, want, &g);
    return g.cap;
}

int kvr_store_fault_in(kvr_store *s, kvr_block *const *bs, size_t n, kvr_error *err)
{
    kvr_reload *r;
    int rc = kvr_store_reload_begin(s, bs, n, NULL, &r, err);
    if (rc != 0 || !r)
        return rc;
    rc = kvr_store_reload_work(s, r, err);
    kvr_store_reload_end(s, r);
    return rc;
}

/* ---- match -------------------------------------------------------------- */

/* Re-inserts the full sequence of every stale context of m into tree 1
 * (best effort: on allocation failure a context stays stale). */
static void index_fresh(kvr_store *s, kvr_model *m)
{
    for (kvr_ctx *c = kvr_lru_first(s); c && m->n_stale; c = kvr_lru_next(s, c)) {
        if (c->model != m || !c->idx_stale)
            continue;
        if (kvr_ctx_index_extend(c, 1, c->n_tokens))
            kvr_ctx_stale_clear(c);
    }
}

int kvr_store_match(kvr_store *s, const char *model, const uint32_t *tokens,
                    size_t n, bool include_approx, kvr_match_result *res,
                    kvr_error *err)
{
    kvr_model *m = kvr_store_model(s, model);
    if (!m)
        return kvr_error_set(err, KVR_ENOMODEL, "no model '%s'", model ? model : "");
    if (n > 0 && !tokens)
        return kvr_error_set(err, KVR_EBADREQUEST, "match: tokens missing");
    if (include_approx && m->n_stale)
        index_fresh(s, m);
    kvr_ctx *rep = NULL;
    size_t len = n ? kvr_ptree_match(&m->tree[include_approx ? 1 : 0], tokens, n, &rep) : 0;
    res->length = rep ? len : 0;
    res->ctx_id[0] = '\0';
    /* Counted once, when it is answered (not when the tier is asked). */
    if (res->length < n && s->miss.prefix &&
        s->miss.prefix(s->miss.arg, m->name, tokens, n, res->length))
        return kvr_error_set(err, KVR_EFETCH, "match: %zu of %zu tokens here: asked the tier "
                             "above the store", res->length, n);
    s->n_matches++;
    m->n_matches++;
    if (rep && len) {
        memcpy(res->ctx_id, rep->id, rep->id_len + 1);
        s->n_match_hits++;
        m->n_match_hits++;
        touch_match(rep);
    }
    return 0;
}

/* ---- context management ------------------------------------------------- */

int kvr_store_delete(kvr_store *s, const char *ctx_id, kvr_error *err)
{
    kvr_ctx *c = NULL;
    /* The one verb that never asks a tier above: fetching a context only
     * to delete the copy would answer OK for what was never here. */
    if (kvr_ctx_id_check(ctx_id, NULL) == 0 && !kvr_store_ctx_find(s, ctx_id))
        return kvr_error_set(err, KVR_ENOCTX, "no context '%s'", ctx_id);
    int rc = kvr_store_ctx_writable(s, ctx_id, &c, err);
    if (rc != 0)
        return rc;
    kvr_store_ctx_destroy(s, c);
    return 0;
}

static void ctx_fill_info(kvr_store *s, const kvr_ctx *c, kvr_ctx_info *o)
{
    memset(o, 0, sizeof *o);
    memcpy(o->id, c->id, c->id_len + 1);
    memcpy(o->model, c->model->name, sizeof o->model);
    o->n_tokens = c->n_tokens;
    o->pinned = c->pinned;
    o->busy = c->busy;
    o->created_ms = c->created_ms;
    o->accessed_ms = c->accessed_ms;
    o->n_evicted_tokens = c->n_evicted_tokens;
    o->n_protected = c->n_protected < c->n_tokens ? c->n_protected : c->n_tokens;
    o->pos_min = 0;
    o->pos_max = -1;
    /* Own references per block first, then count each block once. */
    memcpy(o->codec, c->codec.name, sizeof o->codec);
    double kvbytes = 0;
    uint32_t ep = ++s->epoch;
    count_refs(c, ep);
    ep = ++s->epoch;
    bool first = true;
    for (size_t i = 0; i < c->n_ext; i++) {
        const kvr_extent *e = &c->ext[i];
        kvr_block *b = e->block;
        if (b->mark == ep - 1) {
            o->n_blocks++;
            o->bytes += b->bytes;
            if (b->refcount - b->holds > b->mcount)
                o->n_shared_blocks++;
            b->mark = ep;
        }
        size_t row = (size_t)c->model->n_kv_heads * c->model->head_dim;
        double per_tok = b->quant ? (double)(KVR_QH(b)->kslab + KVR_QH(b)->vslab) * c->model->n_layers / b->cap
                                  : 2.0 * c->model->n_layers * row * kvr_dtype_size(b->dtype);
        kvbytes += per_tok * e->count;
        if (c->codec.quant && !b->quant)
            o->n_window += e->count;
        if (e->flags & KVR_TOKEN_APPROX)
            o->n_approx += e->count;
        if (e->flags & KVR_TOKEN_PENDING)
            o->n_pending += e->count;
        for (uint32_t k = 0; k < e->count; k++) {
            int64_t p = b->stored_pos[e->first + k] + e->pos_delta;
            if (first || p < o->pos_min)
                o->pos_min = p;
            if (first || p > o->pos_max)
                o->pos_max = p;
            first = false;
        }
    }
    size_t values = c->n_tokens * 2u * c->model->n_layers * c->model->n_kv_heads *
                    c->model->head_dim;
    double plain = (double)values * (double)kvr_dtype_size(c->model->dtype);
    o->kv_bytes = (size_t)(kvbytes + 0.5);
    o->bytes_saved = c->codec.quant && plain > kvbytes ? (size_t)(plain - kvbytes + 0.5) : 0;
    o->bits_per_value = values ? kvbytes * 8.0 / (double)values : 0;
    o->rel_rms_k = c->q_ss[0] > 0 ? sqrt(c->q_sse[0] / c->q_ss[0]) : 0;
    o->rel_rms_v = c->q_ss[1] > 0 ? sqrt(c->q_sse[1] / c->q_ss[1]) : 0;
    o->v_trans = kvr_layout_v_trans(c);
}

int kvr_store_stat(kvr_store *s, const char *ctx_id, kvr_ctx_info *out, kvr_error *err)
{
    kvr_ctx *c = NULL;
    int frc = kvr_store_ctx_live(s, ctx_id, &c, err);
    if (frc != 0)
        return frc;
    ctx_fill_info(s, c, out);
    return 0;
}

static int cmp_info(const void *a, const void *b)
{
    return strcmp(((const kvr_ctx_info *)a)->id, ((const kvr_ctx_info *)b)->id);
}

int kvr_store_list(kvr_store *s, const char *model, kvr_ctx_info **out, size_t *n,
                   kvr_error *err)
{
    kvr_model *m = NULL;
    if (model && !(m = kvr_store_model(s, model)))
        return kvr_error_set(err, KVR_ENOMODEL, "no model '%s'", model);
    size_t k = 0;
    for (kvr_ctx *c = kvr_lru_first(s); c; c = kvr_lru_next(s, c))
        if (!m || c->model == m)
            k++;
    kvr_ctx_info *a = kvr_mem_malloc((k ? k : 1) * sizeof *a);
    if (!a)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory listing %zu contexts", k);
    size_t i = 0;
    for (kvr_ctx *c = kvr_lru_first(s); c; c = kvr_lru_next(s, c))
        if (!m || c->model == m)
            ctx_fill_info(s, c, &a[i++]);
    qsort(a, k, sizeof *a, cmp_info);
    *out = a;
    *n = k;
    return 0;
}

int kvr_store_pin(kvr_store *s, const char *ctx_id, bool pin, kvr_error *err)
{
    kvr_ctx *c = NULL;
    int frc = kvr_store_ctx_live(s, ctx_id, &c, err);
    if (frc != 0)
        return frc;
    c->pinned = pin;
    return 0;
}

int kvr_store_fork(kvr_store *s, const char *src, const char *dst, kvr_error *err)
{
    int rc;
    kvr_ctx *a = NULL;
    int frc = kvr_store_ctx_live(s, src, &a, err);
    if (frc != 0)
        return frc;
    if ((rc = kvr_ctx_id_check(dst, err)) != 0)
        return rc;
    if (kvr_store_ctx_find(s, dst))
        return kvr_error_set(err, KVR_EEXIST, "context '%s' already exists", dst);
    if ((rc = kvr_store_ctx_limit(s, dst, err)) != 0)
        return rc;
    kvr_ctx *b = kvr_store_ctx_new(s, a->model, dst);
    if (!b)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory forking '%s'", src);
    if (kvr_ctx_ext_reserve(b, a->n_ext ? a->n_ext : 1) != 0) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory forking '%s'", src);
        goto fail_ctx;
    }
    if (kvr_ptree_clone(&a->model->tree[0], &a->idx[0], &b->idx[0]) != 0 ||
        kvr_ptree_clone(&a->model->tree[1], &a->idx[1], &b->idx[1]) != 0 ||
        kvr_layout_copy(b, a) != 0) {
        rc = kvr_error_set(err, KVR_ENOMEM, "out of memory forking '%s'", src);
        goto fail_ctx;    /* destroying b takes it out of the trees */
    }
    kvr_ctx_share_extents(b, a);
    kvr_grain_note(b, 0);       /* indexed by the next cover */
    b->dtype = a->dtype;
    b->codec = a->codec;
    memcpy(b->q_sse, a->q_sse, sizeof b->q_sse);
    memcpy(b->q_ss, a->q_ss, sizeof b->q_ss);
    b->n_protected = a->n_protected;
    b->persist = a->persist;
    if (a->idx_stale)
        kvr_ctx_stale_set(b);
    kvr_store_ctx_commit(s, b);
    return 0;

fail_ctx:
    kvr_store_ctx_destroy(s, b);
    return rc;
}

int kvr_store_shift(kvr_store *s, const char *ctx_id, size_t start, size_t end,
                    int64_t delta, kvr_error *err)
{
    kvr_ctx *c = NULL;
    int rc = kvr_store_ctx_range(s, ctx_id, start, &end, &c, err);
    if (rc != 0)
        return rc;
    if (start == end || delta == 0)
        return 0;
    /* Check every position of the range before touching anything. */
    size_t k = 0;
    for (size_t i = 0; i < c->n_ext && k < end; i++) {
        const kvr_extent *e = &c->ext[i];
        for (uint32_t j = 0; j < e->count; j++, k++) {
            if (k < start || k >= end)
                continue;
            int64_t p = e->block->stored_pos[e->first + j], q;
            if (__builtin_add_overflow(p, e->pos_delta, &q) ||
                __builtin_add_overflow(q, delta, &q) ||
                __builtin_add_overflow(e->pos_delta, delta, &q))
                return kvr_error_set(err, KVR_EINVAL,
                                     "shift by %lld overflows the position of token %zu",
                                     (long long)delta, k);
        }
    }
    if (kvr_ctx_ext_reserve(c, 2) != 0)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory shifting '%s'", ctx_id);
    size_t i0 = kvr_ctx_split_at(c, start);
    size_t i1 = kvr_ctx_split_at(c, end);
    kvr_ctx_add_delta(c, i0, i1, delta);
    kvr_ctx_merge_extents(&s->pool, c);
    kvr_ctx_check(c);
    kvr_store_touch(s, c);
    return 0;
}

int kvr_store_keep(kvr_store *s, const char *ctx_id, size_t start, size_t end,
                   kvr_error *err)
{
    kvr_ctx *c = NULL;
    int rc = kvr_store_ctx_range(s, ctx_id, start, &end, &c, err);
    if (rc != 0)
        return rc;
    if (start == 0 && end == c->n_tokens)
        return 0;
    if (kvr_ctx_ext_reserve(c, 2) != 0)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory in keep on '%s'", ctx_id);
    size_t i0 = kvr_ctx_split_at(c, start);
    size_t i1 = kvr_ctx_split_at(c, end);
    kvr_ctx_drop_extents(&s->pool, c, i1, c->n_ext);
    kvr_ctx_drop_extents(&s->pool, c, 0, i0);
    assert(c->n_tokens == end - start);
    kvr_ctx_index_rebuild(c, start == 0 ? end : 0);
    kvr_ctx_check(c);
    kvr_store_touch(s, c);
    return 0;
}

/* ---- statistics --------------------------------------------------------- */

void kvr_store_get_stats(const kvr_store *s, kvr_store_stats *out)
{
    memset(out, 0, sizeof *out);
    out->mem_allocated = kvr_mem_allocated();
    out->mem_peak = kvr_mem_peak();
    out->mem_cap = s->cfg.max_memory;
    out->block_bytes = s->pool.bytes;
    out->block_cache_bytes = s->pool.cache_bytes;
    out->n_block_cache = s->pool.cache_n;
    out->n_models = s->n_models;
    out->n_blocks = s->pool.n_blocks;
    kvr_store *ms = (kvr_store *)(uintptr_t)s;    /* the scan's marks only */
    uint32_t ep = ++ms->epoch;
    for (const kvr_ctx *c = kvr_lru_first(s); c; c = kvr_lru_next(s, c)) {
        out->n_contexts++;
        out->n_tokens += c->n_tokens;
        for (size_t i = 0; i < c->n_ext; i++) {
            kvr_block *b = c->ext[i].block;
            if (b->mark == ep)
                continue;
            b->mark = ep;
            if (!b->spilled)
                out->kv_held_bytes += kvr_block_held_bytes(b);
        }
    }
    out->n_evicted_blocks = s->n_evicted_blocks;
    out->n_evicted_bytes = s->n_evicted_bytes;
    out->n_puts = s->n_puts;
    out->n_gets = s->n_gets;
    out->n_matches = s->n_matches;
    out->n_match_hits = s->n_match_hits;
    out->n_refused_nomem = s->n_refused_nomem;
    out->n_leased_blocks = s->pool.n_leased;
    /* Codec figures: the same sums stat makes, over quantized contexts. */
    double bits = 0, values = 0;
    for (const kvr_ctx *c = kvr_lru_first(s); c; c = kvr_lru_next(s, c)) {
        if (!c->codec.quant || c->pending)
            continue;
        kvr_ctx_info ci;
        ctx_fill_info((kvr_store *)(uintptr_t)s, c, &ci);
        out->n_quant_contexts++;
        out->quant_bytes_saved += ci.bytes_saved;
        double v = (double)c->n_tokens * 2.0 * c->model->n_layers * c->model->n_kv_heads *
                   c->model->head_dim;
        bits += ci.bits_per_value * v;
        values += v;
    }
    out->quant_bits_per_value = values > 0 ? bits / values : 0;
    for (size_t i = 0; i < s->n_models; i++) {
        out->cover_index_bytes += s->models[i]->grains.bytes;
        out->cover_index_lagging += s->models[i]->grains.n_dirty;
    }
}
