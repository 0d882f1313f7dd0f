/*
 * ctx.h — contexts as extent lists over blocks, their models, and their
 * place in the models' prefix index (private to cache/; ctx.c). Above the
 * block layer and the prefix tree, below the store: nothing here knows the
 * context map, the LRU list, memory caps or the disk tier.
 *
 * Invariants (kvr_ctx_check asserts them):
 *  - A context is an ordered array of extents {block, first slot, count,
 *    pos_delta, flags}; token logical position = stored-at + pos_delta.
 *    Extents are never empty, lie in committed slots (first + count <=
 *    block->used) and their counts sum to n_tokens; each holds one block
 *    reference.
 *  - n_exact (tokens before the first approximate or pending one) <=
 *    n_tokens. Tree 0 holds at most the exact prefix, tree 1 at most the
 *    full sequence, each a true prefix: idx[w].len <= n_exact / n_tokens.
 *    idx_stale: tree 1 holds a true prefix after an edit; the rest goes in
 *    on the next include_approx match (kvr_ctx_index_extend).
 *  - The extent array is written only here (the functions below); the
 *    layers above read it.
 */
#ifndef KVR_CACHE_CTX_H
#define KVR_CACHE_CTX_H

#include "base/list.h"
#include "cache/block.h"
#include "cache/grain.h"
#include "cache/prefix.h"
#include "cache/quant.h"

#pragma GCC visibility push(hidden)

typedef struct kvr_model kvr_model;
struct kvr_layout;

typedef struct kvr_extent {
    kvr_block *block;
    uint32_t   first, count;
    int64_t    pos_delta;
    uint32_t   flags;        /* KVR_TOKEN_* for every token of the extent */
} kvr_extent;

struct kvr_model {
    char            name[KVR_ID_MAX + 1];
    kvr_qspec       codec;      /* default codec of new contexts */
    uint32_t        n_layers, n_kv_heads, head_dim;
    kvr_dtype       dtype;
    uint64_t        fingerprint;
    kvr_rope_config rope_cfg;
    kvr_rope       *engine;
    size_t          n_contexts;
    kvr_ptree       tree[2];    /* 0: exact prefixes, 1: full sequences */
    size_t          n_stale;    /* contexts with idx_stale set */
    kvr_grain_index grains;     /* content index for covers (grain.h) */
    /* Its blocks' tenant in the pool (1..63; 0: not counted apart) and
     * what happened to it: the stats verb's per-model lines. */
    uint16_t        tenant;
    uint64_t        n_evicted_blocks, n_evicted_bytes, n_matches, n_match_hits;
    uint64_t        n_refused_bound;
};

struct kvr_ctx {
    char        id[KVR_ID_MAX + 1];
    size_t      id_len;
    /* Beside id_len, which a match reads: what a match hit writes (store.c
     * touch_match), in the same cache line when the context is 64-byte
     * aligned (id_len at offset 256), else the next. */
    uint64_t    accessed_ms;
    bool        matched;        /* hit by a match since it last moved on the LRU list */
    uint64_t    hash;
    kvr_ctx    *hnext;          /* store.c: hash chain */
    kvr_list    lru;            /* store.c: on the store's LRU list once committed */
    kvr_model  *model;
    kvr_dtype   dtype;          /* plain (window) blocks' storage dtype */
    kvr_qspec   codec;
    double      q_sse[2], q_ss[2];  /* K, V: sum sq. error / sum sq. of quantized data */
    kvr_extent *ext;
    size_t      n_ext, cap_ext;
    size_t      n_tokens;
    size_t      n_exact;
    bool        pinned, busy, pending;  /* pending: created by an open put */
    uint64_t    created_ms;
    size_t      n_evicted_tokens;
    kvr_pentry  idx[2];         /* place in model->tree[0] / [1] */
    bool        idx_stale;
    kvr_grain_ctx grain;        /* place in model->grains (grain.h) */
    size_t      n_protected;    /* first tokens edits may not touch */
    /* layout.c's state (APE record, groups, retention): one flat
     * allocation of struct kvr_layout, freed here; allocated and copied
     * only by layout.c, which alone knows its size (a size kept beside it
     * once went stale and a fork copied 1 byte of it). */
    struct kvr_layout *layout;
    bool        persist;        /* tier.c: every change is logged to disk */
};

/* Values per K or V row of a model. */
static inline uint32_t kvr_model_row(const kvr_model *m)
{
    return m->n_kv_heads * m->head_dim;
}

/* A new empty context of m (codec and dtype from m), not in any map. */
kvr_ctx *kvr_ctx_create(kvr_model *m, const char *id, uint64_t hash, uint64_t now);
/* Takes c out of the index, drops its extents' references, frees it. */
void     kvr_ctx_free(kvr_block_pool *p, kvr_ctx *c);
/* Asserts the invariants above (O(extents); nothing under NDEBUG). */
void     kvr_ctx_check(const kvr_ctx *c);

/* ---- extents ------------------------------------------------------------ */
int      kvr_ctx_ext_reserve(kvr_ctx *c, size_t n);
/* Makes token index idx (0 <= idx <= n_tokens) start an extent and returns
 * that extent's index (n_ext for the end); needs one free extent slot
 * (kvr_ctx_ext_reserve). */
size_t   kvr_ctx_split_at(kvr_ctx *c, size_t idx);
/* Merges neighbours contiguous in one block with equal delta and flags. */
void     kvr_ctx_merge_extents(kvr_block_pool *p, kvr_ctx *c);
/* True if e continues `last` (same block, next slot, same delta, flags). */
static inline bool kvr_ext_joins(const kvr_extent *last, const kvr_extent *e)
{
    return last->block == e->block && last->first + last->count == e->first &&
           last->pos_delta == e->pos_delta && last->flags == e->flags;
}
/* Appends e to a[0..*n), merging it into the last extent when it joins;
 * true if merged (the caller's reference of e.block is then not taken). */
bool     kvr_ext_append(kvr_extent *a, size_t *n, kvr_extent e);
/* Appends e (carrying one reference) to c; needs a free slot; merges. */
void     kvr_ctx_push(kvr_block_pool *p, kvr_ctx *c, kvr_extent e);
/* Replaces c's extent array by a[0..n) (capacity cap, references owned);
 * the old extents' references go. n_tokens and n_exact are recomputed. */
void     kvr_ctx_replace_extents(kvr_block_pool *p, kvr_ctx *c, kvr_extent *a, size_t n,
                                 size_t cap);
/* Drops extents [i0, i1) (their tokens leave c). */
void     kvr_ctx_drop_extents(kvr_block_pool *p, kvr_ctx *c, size_t i0, size_t i1);
/* Adds delta to the positions of extents [i0, i1). */
void     kvr_ctx_add_delta(kvr_ctx *c, size_t i0, size_t i1, int64_t delta);
/* Shares every extent of src (one more reference each) into empty dst. */
void     kvr_ctx_share_extents(kvr_ctx *dst, const kvr_ctx *src);

/* ---- reading ------------------------------------------------------------ */
/* Moves a cursor (extent *i starting at token *k) to the extent holding
 * token idx (or n_ext). */
void     kvr_ctx_seek(const kvr_ctx *c, size_t *i, size_t *k, size_t idx);
/* Logical position of token idx (< n_tokens), cursor as kvr_ctx_seek. */
int64_t  kvr_ctx_pos_at(const kvr_ctx *c, size_t *i, size_t *k, size_t idx);
int64_t  kvr_ctx_last_pos(const kvr_ctx *c);
static inline int64_t kvr_ext_pos(const kvr_extent *e, uint32_t j)
{
    return e->block->stored_pos[e->first + j] + e->pos_delta;
}
/* Tokens of [from, to) with any of `flags`. */
size_t   kvr_ctx_count_flag(const kvr_ctx *c, size_t from, size_t to, uint32_t flags);
/* Token ids [from, to) into dst. */
void     kvr_ctx_tokens(const kvr_ctx *c, size_t from, size_t to, uint32_t *dst);
/* All of c's token ids (kvr_mem_malloc'ed, caller frees), or NULL (ENOMEM,
 * with a message when err). */
uint32_t *kvr_ctx_gather_tokens(const kvr_ctx *c, kvr_error *err);

/* ---- prefix index ------------------------------------------------------- */
void     kvr_ctx_index_truncate(kvr_ctx *c, int w, size_t n);
/* Appends tokens [idx[w].len, len) of c to tree w; false on failure. */
bool     kvr_ctx_index_extend(kvr_ctx *c, int w, size_t len);
/* Appends the given suffix to tree w (0 or KVR_ENOMEM; tree unchanged then). */
int      kvr_ctx_index_append(kvr_ctx *c, int w, const uint32_t *seq, size_t n);
/* Recomputes n_exact and resyncs both trees and the grain index; the first
 * `common` tokens are known unchanged. On allocation failure c is left out
 * of the index (which then under-reports, never lies). */
void     kvr_ctx_index_rebuild(kvr_ctx *c, size_t common);
void     kvr_ctx_stale_set(kvr_ctx *c);
void     kvr_ctx_stale_clear(kvr_ctx *c);

#pragma GCC visibility pop

#endif /* KVR_CACHE_CTX_H */
