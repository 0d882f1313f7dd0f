/*
 * grain.h — the content index of a model's contexts, independent of
 * position (private to cache/; grain.c). Every context's tokens are cut in
 * grains of KVR_COVER_GRAIN tokens at its offsets 0, 16, 32, ... (a tail
 * shorter than a grain is not indexed); each grain is hashed by its token
 * ids alone, so a run of cached tokens is found at any offset of a prompt
 * (cover.c rolls the same hash over the prompt). A hash is only ever a
 * hint: every hit is verified token by token against the context's mirror
 * before it is used.
 *
 * Layout. Per model, a chained hash table of entries {hash, context, grain}
 * in one pool (32-bit indices, a free list, chains doubly linked so a grain
 * leaves in O(1)). Per context (kvr_grain_ctx, embedded in kvr_ctx): a
 * mirror of its token ids and, for each indexed grain, its entry.
 *
 * Invariants (kvr_grain_check verifies them):
 *  - ok_tok <= n_tok: mirror tokens [0, ok_tok) equal the context's tokens;
 *    valid <= n_grain, valid * G <= ok_tok: grains [0, valid) are in the
 *    table with the hash of those tokens. Entries of grains [valid,
 *    n_grain) are stale: lookups skip them, the next sync removes them.
 *  - A context whose index lags its tokens (ok_tok < n_tokens, or stale
 *    entries) is on its model's dirty list; a clean one has ok_tok ==
 *    n_tokens and valid == n_grain == n_tokens / G. So the index may
 *    under-report (a lagging or, after an allocation failure, shortened
 *    context), never lie.
 *  - Every path that changes a context's token ids calls kvr_grain_note
 *    with the count of leading tokens it left unchanged (put, edit, keep,
 *    retention, eviction, fork, recovery: the prefix index's places), then
 *    kvr_grain_sync now or leaves it to the next cover; a context leaving
 *    the store takes its entries with it (kvr_grain_forget).
 *
 * Memory: the mirror (4 bytes a token), the entries (32 bytes a grain),
 * the slots (4 bytes a grain) and the table's heads, all through kvr_mem_*
 * (accounted against the cap like every allocation) and summed in
 * kvr_grain_index.bytes.
 */
#ifndef KVR_CACHE_GRAIN_H
#define KVR_CACHE_GRAIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cache.h"

#pragma GCC visibility push(hidden)

typedef struct kvr_ctx kvr_ctx;
typedef struct kvr_model kvr_model;

#define KVR_GRAIN KVR_COVER_GRAIN
#define KVR_GRAIN_NONE UINT32_MAX

typedef struct kvr_grain_ent {
    uint64_t hash;
    kvr_ctx *ctx;            /* NULL: on the free list */
    uint32_t grain;          /* index in the context (tokens grain * G ..) */
    uint32_t next, prev;     /* chain (prev NONE: first of its bucket);
                                free list through next */
} kvr_grain_ent;

/* Per model. */
typedef struct kvr_grain_index {
    uint32_t      *heads;    /* n_heads (a power of two) chain heads */
    size_t         n_heads;
    kvr_grain_ent *ents;
    size_t         n_ents, cap_ents;   /* pool slots used (live + free) */
    uint32_t       free_head;
    size_t         n_live;
    kvr_ctx       *dirty;    /* contexts whose index lags (kvr_grain_ctx.dnext) */
    size_t         n_dirty;
    size_t         bytes;    /* heads + pool + every context's mirror and slots */
} kvr_grain_index;

/* Per context. */
typedef struct kvr_grain_ctx {
    uint32_t *tok;           /* mirror of the token ids */
    size_t    n_tok, cap_tok, ok_tok;
    uint32_t *slot;          /* entry of grain g, g < n_grain */
    size_t    n_grain, cap_grain, valid;
    bool      dirty;
    kvr_ctx  *dprev, *dnext;
} kvr_grain_ctx;

/* The content hash of one grain (tokens t[0..G)), as the index keys it.
 * kvr_grain_roll_* compute the same value at every offset of a prompt. */
uint64_t kvr_grain_hash(const uint32_t *t);
/* Rolling form: the state of the grain at t (kvr_grain_roll_init), moved
 * one token right (the token leaving, the one entering); the key of a
 * state is kvr_grain_roll_key. */
uint64_t kvr_grain_roll_init(const uint32_t *t);
uint64_t kvr_grain_roll_next(uint64_t h, uint32_t out, uint32_t in);
uint64_t kvr_grain_roll_key(uint64_t h);

/* Test hook: every hash is ANDed with this mask (all ones by default), so
 * a test can make unrelated grains collide and watch them be refused. Set
 * it before the store holds any context. */
extern uint64_t kvr_grain_test_mask;

void kvr_grain_index_init(kvr_grain_index *x);
/* Frees the table (every context must have left it first). */
void kvr_grain_index_free(kvr_grain_index *x);

/* c's tokens [0, common) are unchanged since its last note; the rest may
 * differ (or be gone). O(1): puts c on the dirty list if needed. */
void kvr_grain_note(kvr_ctx *c, size_t common);
/* Brings c's index up to its tokens now (best effort: on an allocation
 * failure c stays dirty with a true prefix indexed). Returns the tokens
 * gathered and hashed. */
size_t kvr_grain_sync(kvr_ctx *c);
/* A put appended tokens[0..n) at first_index: the cheap path when c was
 * in sync up to there, else note + sync. */
void kvr_grain_append(kvr_ctx *c, size_t first_index, const uint32_t *tokens, size_t n);
/* Bytes the allocator will hold for c's index once n more tokens are
 * appended to it (its arrays and the model's table growing): a put
 * reserves them with its blocks, so the cap covers the index too. */
size_t kvr_grain_need(const kvr_ctx *c, size_t n);
/* Syncs m's dirty contexts until about `budget` tokens were gathered. */
void kvr_grain_sync_dirty(kvr_model *m, size_t budget);
/* c leaves the store: its entries, its place on the dirty list, its arrays. */
void kvr_grain_forget(kvr_ctx *c);

/* Looks up key in m's table: calls fn(ud, ctx, grain) for each live, valid
 * entry of that exact key, at most max_hits of them and max_steps chain
 * steps; stops early when fn returns false. Returns the entries passed. */
size_t kvr_grain_lookup(const kvr_model *m, uint64_t key, size_t max_hits, size_t max_steps,
                        bool (*fn)(void *ud, kvr_ctx *c, uint32_t grain), void *ud);

/* Verifies the invariants above for every context of s (tests; O(tokens)):
 * 0, or -1 with what is wrong in err. */
int kvr_grain_check(kvr_store *s, kvr_error *err);

#pragma GCC visibility pop

#endif /* KVR_CACHE_GRAIN_H */
