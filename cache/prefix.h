/*
 * prefix.h — the prefix index (private to cache/): a compressed radix tree
 * over token ids (prefix.c). A model has two, one over each context's
 * exact prefix and one over full sequences. The tree knows contexts only
 * as entries: an entry (one per context and tree, embedded in the context)
 * records where its sequence ends and whom a match returns.
 */
#ifndef KVR_CACHE_PREFIX_H
#define KVR_CACHE_PREFIX_H

#include <stddef.h>
#include <stdint.h>

#include "cache/cache.h"

#pragma GCC visibility push(hidden)

typedef struct kvr_ctx kvr_ctx;
typedef struct kvr_pnode kvr_pnode;

/* One context's place in one tree: node NULL and len 0 when absent. */
typedef struct kvr_pentry {
    kvr_pnode *node;
    size_t     len;
    kvr_ctx   *owner;        /* what a match returns */
} kvr_pentry;

struct kvr_pnode {
    uint32_t    *label;      /* edge label (empty for the root) */
    size_t       len;
    size_t       depth;      /* tokens from the root to the end of the label */
    size_t       n_pass;     /* entries whose sequence covers the whole label */
    kvr_pnode   *parent;
    kvr_pnode  **children;   /* sorted by label[0]; one allocation with the keys */
    uint32_t     n_children, cap_children;
    kvr_pentry **ends;       /* entries whose sequence ends exactly here */
    uint32_t     n_ends, cap_ends;
};

typedef struct kvr_ptree {
    kvr_pnode root;
    size_t    n_nodes;
} kvr_ptree;

void   kvr_ptree_init(kvr_ptree *t);
void   kvr_ptree_free(kvr_ptree *t);
/* e has length e->len in the tree; makes it `n` tokens long where seq[0..n)
 * is the full new sequence and its first `keep` tokens equal the old
 * sequence's (keep <= both lengths). */
int    kvr_ptree_set(kvr_ptree *t, kvr_pentry *e, const uint32_t *seq, size_t n, size_t keep);
/* Appends suffix[0..n) to e's sequence. On failure the tree is unchanged. */
int    kvr_ptree_append(kvr_ptree *t, kvr_pentry *e, const uint32_t *suffix, size_t n);
/* Truncates e's sequence to n tokens (n <= current). Never fails (on an
 * allocation failure e may end up shorter, never longer). */
void   kvr_ptree_truncate(kvr_ptree *t, kvr_pentry *e, size_t n);
/* Adds `dst` at the same place as `src` (fork). */
int    kvr_ptree_clone(kvr_ptree *t, kvr_pentry *src, kvr_pentry *dst);
/* Longest prefix of q[0..n) in the tree; *rep: an entry's owner there. */
size_t kvr_ptree_match(const kvr_ptree *t, const uint32_t *q, size_t n, kvr_ctx **rep);

#pragma GCC visibility pop

#endif /* KVR_CACHE_PREFIX_H */
