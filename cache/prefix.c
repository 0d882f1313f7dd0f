/*
 * prefix.c — the per-model prefix index: a compressed radix tree over token
 * ids. A model has two: one over each context's exact prefix (tokens before
 * the first approximate one), one over full sequences.
 *
 * Invariants:
 *  - Children of a node are sorted by the first token of their label, and
 *    no two share it; every non-root node has a non-empty label.
 *  - n_pass of a node = number of contexts whose sequence covers the node's
 *    whole label = n_ends + sum of the children's n_pass. Nodes with
 *    n_pass 0 are removed at once, so every leaf has an end, and every
 *    node's subtree holds at least one context (the match representative).
 *  - A context's sequence ends exactly at a node boundary (edges are split
 *    there); the entry's node is that node, NULL for length 0.
 *  - A node's children array has room for cap_children pointers and, right
 *    after them in the same allocation, cap_children keys: keys[i] is
 *    children[i]->label[0] (a label's first token never changes once the
 *    node is a child). The binary search over a node's children reads only
 *    the keys, so a match at a node of k children touches about log2(k)/16
 *    cache lines of keys and then one child, instead of a child node and its
 *    label at each of log2(k) steps (two dependent misses a step when the
 *    index is not in cache: a store of many contexts under one node).
 *  - Costs: match O(query + depth*log(fanout)); removal/truncation walks up
 *    from the context's end node, appends go down from it.
 */
#include <string.h>

#include "cache/prefix.h"

static kvr_pnode *node_new(const uint32_t *label, size_t len)
{
    kvr_pnode *n = kvr_mem_index_calloc(1, sizeof *n);
    if (!n)
        return NULL;
    if (len) {
        n->label = kvr_mem_index_malloc(len * sizeof *label);
        if (!n->label) {
            kvr_mem_free(n);
            return NULL;
        }
        memcpy(n->label, label, len * sizeof *label);
    }
    n->len = len;
    return n;
}

static void node_free_rec(kvr_pnode *n, bool self)
{
    for (uint32_t i = 0; i < n->n_children; i++)
        node_free_rec(n->children[i], true);
    kvr_mem_free(n->children);
    kvr_mem_free(n->ends);
    kvr_mem_free(n->label);
    if (self)
        kvr_mem_free(n);
}

void kvr_ptree_init(kvr_ptree *t)
{
    memset(t, 0, sizeof *t);
}

void kvr_ptree_free(kvr_ptree *t)
{
    node_free_rec(&t->root, false);
    memset(&t->root, 0, sizeof t->root);
}

/* The first tokens of n's children's labels (after the pointers; n has
 * a children array). */
static inline uint32_t *child_keys(const kvr_pnode *n)
{
    return (uint32_t *)(void *)(n->children + n->cap_children);
}

/* A children array (with its keys) of cap entries. */
static kvr_pnode **kids_alloc(uint32_t cap)
{
    return kvr_mem_index_malloc((size_t)cap * (sizeof(kvr_pnode *) + sizeof(uint32_t)));
}

/* Index of the child whose label starts with tok, or the insertion point
 * (negative: -(pos+1)). */
static long child_find(const kvr_pnode *n, uint32_t tok)
{
    if (n->n_children == 0)
        return -1;
    const uint32_t *keys = child_keys(n);
    long lo = 0, hi = (long)n->n_children - 1;
    while (lo <= hi) {
        long mid = (lo + hi) / 2;
        uint32_t v = keys[mid];
        if (v == tok)
            return mid;
        if (v < tok)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -(lo + 1);
}

static int child_insert(kvr_pnode *n, kvr_pnode *c, size_t pos)
{
    if (n->n_children == n->cap_children) {
        uint32_t cap = n->cap_children ? n->cap_children * 2 : 2;
        kvr_pnode **a = kids_alloc(cap);
        if (!a)
            return KVR_ENOMEM;
        if (n->n_children) {
            memcpy(a, n->children, n->n_children * sizeof *a);
            memcpy((uint32_t *)(void *)(a + cap), child_keys(n),
                   n->n_children * sizeof(uint32_t));
        }
        kvr_mem_free(n->children);
        n->children = a;
        n->cap_children = cap;
    }
    uint32_t *keys = child_keys(n);
    memmove(n->children + pos + 1, n->children + pos,
            (n->n_children - pos) * sizeof *n->children);
    memmove(keys + pos + 1, keys + pos, (n->n_children - pos) * sizeof *keys);
    n->children[pos] = c;
    keys[pos] = c->label[0];
    n->n_children++;
    c->parent = n;
    return 0;
}

static void child_remove(kvr_pnode *n, kvr_pnode *c)
{
    long i = child_find(n, c->label[0]);
    if (i < 0)
        return;
    uint32_t *keys = child_keys(n);
    memmove(n->children + i, n->children + i + 1,
            (n->n_children - (size_t)i - 1) * sizeof *n->children);
    memmove(keys + i, keys + i + 1, (n->n_children - (size_t)i - 1) * sizeof *keys);
    n->n_children--;
}

static int ends_add(kvr_pnode *n, kvr_pentry *c)
{
    if (n->n_ends == n->cap_ends) {
        uint32_t cap = n->cap_ends ? n->cap_ends * 2 : 1;
        kvr_pentry **a = kvr_mem_index_realloc(n->ends, cap * sizeof *a);
        if (!a)
            return KVR_ENOMEM;
        n->ends = a;
        n->cap_ends = cap;
    }
    n->ends[n->n_ends++] = c;
    return 0;
}

static void ends_remove(kvr_pnode *n, kvr_pentry *c)
{
    for (uint32_t i = 0; i < n->n_ends; i++) {
        if (n->ends[i] == c) {
            n->ends[i] = n->ends[--n->n_ends];
            return;
        }
    }
}

/* Splits n after k label tokens (0 < k < len): n keeps the upper part and
 * gets one child holding the rest, its children and its ends. */
static int node_split(kvr_ptree *t, kvr_pnode *n, size_t k)
{
    kvr_pnode *low = node_new(n->label + k, n->len - k);
    if (!low)
        return KVR_ENOMEM;
    kvr_pnode **one = kids_alloc(1);
    if (!one) {
        node_free_rec(low, true);
        return KVR_ENOMEM;
    }
    low->children = n->children;
    low->n_children = n->n_children;
    low->cap_children = n->cap_children;
    for (uint32_t i = 0; i < low->n_children; i++)
        low->children[i]->parent = low;
    low->ends = n->ends;
    low->n_ends = n->n_ends;
    low->cap_ends = n->cap_ends;
    for (uint32_t i = 0; i < low->n_ends; i++)
        low->ends[i]->node = low;
    low->n_pass = n->n_pass;
    low->depth = n->depth;
    low->parent = n;
    n->children = one;
    n->n_children = 1;
    n->cap_children = 1;
    n->children[0] = low;
    child_keys(n)[0] = low->label[0];
    n->ends = NULL;
    n->n_ends = n->cap_ends = 0;
    n->depth = n->depth - n->len + k;
    n->len = k;       /* the label buffer keeps its size; only a prefix is used */
    t->n_nodes++;
    return 0;
}

/* Merges n's only child into n when n is a non-root node with no ends. Best
 * effort: on allocation failure the tree just stays less compressed. */
static void node_compact(kvr_ptree *t, kvr_pnode *n)
{
    if (n == &t->root || n->n_ends || n->n_children != 1)
        return;
    kvr_pnode *c = n->children[0];
    uint32_t *lab = kvr_mem_index_realloc(n->label, (n->len + c->len) * sizeof *lab);
    if (!lab)
        return;
    memcpy(lab + n->len, c->label, c->len * sizeof *lab);
    n->label = lab;
    n->len += c->len;
    n->depth = c->depth;
    kvr_mem_free(n->children);
    n->children = c->children;
    n->n_children = c->n_children;
    n->cap_children = c->cap_children;
    for (uint32_t i = 0; i < n->n_children; i++)
        n->children[i]->parent = n;
    kvr_mem_free(n->ends);    /* empty, but may still have room */
    n->ends = c->ends;
    n->n_ends = c->n_ends;
    n->cap_ends = c->cap_ends;
    for (uint32_t i = 0; i < n->n_ends; i++)
        n->ends[i]->node = n;
    kvr_mem_free(c->label);
    kvr_mem_free(c);
    t->n_nodes--;
}

/* Drops n (n_pass reached 0, so it has no children and no ends). */
static void node_drop(kvr_ptree *t, kvr_pnode *n)
{
    child_remove(n->parent, n);
    node_free_rec(n, true);
    t->n_nodes--;
}

void kvr_ptree_truncate(kvr_ptree *t, kvr_pentry *c, size_t n)
{
    kvr_pnode *node = c->node;
    if (!node || n >= c->len)
        return;
    ends_remove(node, c);
    /* Nodes entirely beyond n lose c. */
    while (node != &t->root && node->depth - node->len >= n) {
        kvr_pnode *up = node->parent;
        if (--node->n_pass == 0)
            node_drop(t, node);
        else if (node->n_ends == 0 && node->n_children == 1)
            node_compact(t, node);
        node = up;
    }
    c->len = n;
    if (n == 0) {
        c->node = NULL;
        if (node != &t->root && node->n_ends == 0 && node->n_children == 1)
            node_compact(t, node);
        return;
    }
    /* node->depth - len < n <= node->depth: c now ends inside this node. */
    if (n < node->depth) {
        if (node->n_pass == 1) {
            /* Only c covered the label: shorten it instead of splitting. */
            node->len -= node->depth - n;
            node->depth = n;
        } else if (node_split(t, node, node->len - (node->depth - n)) == 0) {
            kvr_pnode *low = node->children[0];
            low->n_pass--;    /* > 0: others passed through */
        } else {
            /* Cannot split: leave c at its old place, a longer sequence
             * than it has. Matching still only returns true prefixes of
             * some context, except for c's lost tail; accept degraded. */
            node->n_pass--;
            c->node = NULL;
            c->len = 0;
            goto unwind_up;
        }
    }
    if (ends_add(node, c) != 0) {
        node->n_pass--;
        c->node = NULL;
        c->len = 0;
        goto unwind_up;
    }
    c->node = node;
    return;

unwind_up:
    /* c has been removed from node and below; remove it from the rest. */
    for (kvr_pnode *u = node->parent; u && u != &t->root;) {
        kvr_pnode *up = u->parent;
        if (--u->n_pass == 0)
            node_drop(t, u);
        u = up;
    }
    if (node->n_pass == 0 && node != &t->root)
        node_drop(t, node);
}

/* Inserts seq[0..n) below `from` (whose depth is where seq starts); c must
 * already be counted in `from` and above. */
static int insert_below(kvr_ptree *t, kvr_pnode *from, kvr_pentry *c, const uint32_t *seq,
                        size_t n)
{
    kvr_pnode *cur = from;
    size_t i = 0;
    int rc;
    while (i < n) {
        long k = child_find(cur, seq[i]);
        if (k < 0) {
            kvr_pnode *leaf = node_new(seq + i, n - i);
            if (!leaf) {
                rc = KVR_ENOMEM;
                goto fail;
            }
            leaf->depth = cur->depth + (n - i);
            if ((rc = child_insert(cur, leaf, (size_t)(-k - 1))) != 0) {
                node_free_rec(leaf, true);
                goto fail;
            }
            t->n_nodes++;
            leaf->n_pass = 1;
            cur = leaf;
            i = n;
            break;
        }
        kvr_pnode *ch = cur->children[k];
        size_t m = 1, lim = ch->len < n - i ? ch->len : n - i;
        while (m < lim && ch->label[m] == seq[i + m])
            m++;
        if (m < ch->len && (rc = node_split(t, ch, m)) != 0)
            goto fail;
        ch->n_pass++;
        cur = ch;
        i += m;
    }
    if ((rc = ends_add(cur, c)) != 0)
        goto fail;
    c->node = cur;
    return 0;

fail:
    /* Undo the counts below `from`. */
    while (cur != from) {
        kvr_pnode *up = cur->parent;
        if (--cur->n_pass == 0)
            node_drop(t, cur);
        cur = up;
    }
    return rc;
}

int kvr_ptree_append(kvr_ptree *t, kvr_pentry *c, const uint32_t *suffix, size_t n)
{
    if (n == 0)
        return 0;
    kvr_pnode *from = c->node ? c->node : &t->root;
    if (from != &t->root)
        ends_remove(from, c);
    int rc = insert_below(t, from, c, suffix, n);
    if (rc != 0) {
        if (from != &t->root)
            (void)ends_add(from, c);   /* the slot it had is still there */
        c->node = from != &t->root ? from : NULL;
        return rc;
    }
    c->len += n;
    node_compact(t, from);
    return 0;
}

int kvr_ptree_set(kvr_ptree *t, kvr_pentry *c, const uint32_t *seq, size_t n, size_t keep)
{
    if (keep > n)
        keep = n;
    if (keep < c->len)
        kvr_ptree_truncate(t, c, keep);
    keep = c->len;    /* may be less after a degraded truncation */
    return kvr_ptree_append(t, c, seq + keep, n - keep);
}

int kvr_ptree_clone(kvr_ptree *t, kvr_pentry *src, kvr_pentry *dst)
{
    kvr_pnode *n = src->node;
    dst->node = NULL;
    dst->len = 0;
    if (!n)
        return 0;
    int rc = ends_add(n, dst);
    if (rc != 0)
        return rc;
    for (kvr_pnode *u = n; u != &t->root; u = u->parent)
        u->n_pass++;
    dst->node = n;
    dst->len = src->len;
    return 0;
}

/* Prefetches the first n tokens of a label, up to 4 KiB of it (the
 * hardware's stream prefetcher follows on from there). */
static inline void prefetch_label(const uint32_t *label, size_t n)
{
    size_t lines = (n * sizeof *label + 63) / 64;
    if (lines > 64)
        lines = 64;
    for (size_t i = 0; i < lines; i++)
        __builtin_prefetch((const char *)label + 64 * i);
}

size_t kvr_ptree_match(const kvr_ptree *t, const uint32_t *q, size_t n, kvr_ctx **rep)
{
    const kvr_pnode *cur = &t->root;
    size_t matched = 0;
    *rep = NULL;
    while (matched < n) {
        long k = child_find(cur, q[matched]);
        if (k < 0)
            break;
        const kvr_pnode *ch = cur->children[k];
        size_t m = 1, lim = ch->len < n - matched ? ch->len : n - matched;
        /* The label's lines and the ends array are both wanted and neither
         * waits for the other: ask for them together (one memory round trip
         * instead of several in a row when the index is not in cache), and
         * for the entry a match here returns once the ends are in. */
        prefetch_label(ch->label, lim);
        if (ch->n_ends)
            __builtin_prefetch(ch->ends);
        size_t head = lim < 32 ? lim : 32;
        while (m < head && ch->label[m] == q[matched + m])
            m++;
        if (ch->n_ends && m == head)
            __builtin_prefetch(ch->ends[0]);
        while (m < lim && ch->label[m] == q[matched + m])
            m++;
        matched += m;
        cur = ch;
        if (m < ch->len)
            break;
    }
    if (matched == 0)
        return 0;
    while (cur->n_ends == 0 && cur->n_children > 0)
        cur = cur->children[0];
    *rep = cur->n_ends ? cur->ends[0]->owner : NULL;
    return *rep ? matched : 0;
}
