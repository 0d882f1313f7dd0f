/*
 * list.h — the project's one intrusive list (libuv's queue.h, Linux's
 * list.h): a circular doubly linked list through a kvr_list node embedded in
 * each element, with the head a node of its own. Insertion and removal are
 * O(1) and allocate nothing, so they cannot fail; kvr_list_entry goes from
 * a node back to its element.
 *
 * Invariants (asserted): a head is initialised before use; a node is on at
 * most one list, and is removed only while it is on one (removal leaves it
 * pointing at itself, so a removed node reads as an empty list). Locking is
 * the owner's.
 *
 * Header only (inline).
 */
#ifndef KVR_BASE_LIST_H
#define KVR_BASE_LIST_H

#include <assert.h>
#include <stdbool.h>
#include <stddef.h>

typedef struct kvr_list {
    struct kvr_list *next, *prev;
} kvr_list;

/* The element that holds node `ptr` as its `member`. */
#define kvr_list_entry(ptr, type, member) \
    ((type *)(void *)((char *)(ptr) - offsetof(type, member)))

/* for (kvr_list *n = first; n != head; n = n->next): no removal inside. */
#define kvr_list_foreach(n, head) for ((n) = (head)->next; (n) != (head); (n) = (n)->next)

static inline void kvr_list_init(kvr_list *h) { h->next = h->prev = h; }

static inline bool kvr_list_empty(const kvr_list *h) { return h->next == h; }

static inline void kvr_list__link(kvr_list *prev, kvr_list *n, kvr_list *next)
{
    assert(prev->next == next && next->prev == prev);
    n->prev = prev;
    n->next = next;
    prev->next = n;
    next->prev = n;
}

/* n first / last on h. */
static inline void kvr_list_insert_head(kvr_list *h, kvr_list *n) { kvr_list__link(h, n, h->next); }
static inline void kvr_list_insert_tail(kvr_list *h, kvr_list *n) { kvr_list__link(h->prev, n, h); }

/* n just before node at (at may be the head: then n goes last). */
static inline void kvr_list_insert_before(kvr_list *at, kvr_list *n) { kvr_list__link(at->prev, n, at); }

/* Takes n off its list. */
static inline void kvr_list_remove(kvr_list *n)
{
    assert(n->next->prev == n && n->prev->next == n);
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->next = n->prev = n;
}

/* The first node of h, or NULL when h is empty. */
static inline kvr_list *kvr_list_first(const kvr_list *h)
{
    return h->next == h ? NULL : h->next;
}

/* The last node of h, or NULL when h is empty. */
static inline kvr_list *kvr_list_last(const kvr_list *h)
{
    return h->prev == h ? NULL : h->prev;
}

/* The node after / before n on the list headed by h, or NULL at its end. */
static inline kvr_list *kvr_list_next(const kvr_list *h, const kvr_list *n)
{
    return n->next == h ? NULL : n->next;
}
static inline kvr_list *kvr_list_prev(const kvr_list *h, const kvr_list *n)
{
    return n->prev == h ? NULL : n->prev;
}

/* Moves every node of from, in order, to the end of to; from is empty after. */
static inline void kvr_list_move_tail(kvr_list *to, kvr_list *from)
{
    if (kvr_list_empty(from))
        return;
    kvr_list *first = from->next, *last = from->prev;
    first->prev = to->prev;
    to->prev->next = first;
    last->next = to;
    to->prev = last;
    kvr_list_init(from);
}

#endif /* KVR_BASE_LIST_H */
