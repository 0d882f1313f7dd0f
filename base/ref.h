/*
 * ref.h — the project's one reference count (Linux's kref): an atomic count
 * embedded in the object, set when it is made, taken by every holder and
 * dropped by each; whoever drops the last reference frees the object. Taking
 * a reference needs one already held (the count never rises from 0).
 *
 * Invariants (asserted): get and put only on a live count (> 0). The
 * release pairs with every earlier put (acquire-release), so the last
 * holder sees every other holder's writes before it frees.
 *
 * Header only (inline).
 */
#ifndef KVR_BASE_REF_H
#define KVR_BASE_REF_H

#include <assert.h>
#include <stdatomic.h>
#include <stdbool.h>

typedef struct kvr_ref {
    atomic_uint n;
} kvr_ref;

/* A new object's count: its maker's references (usually 1). */
static inline void kvr_ref_init(kvr_ref *r, unsigned n) { atomic_init(&r->n, n); }

static inline void kvr_ref_get(kvr_ref *r)
{
    unsigned old = atomic_fetch_add_explicit(&r->n, 1, memory_order_relaxed);
    assert(old > 0);
    (void)old;
}

/* Drops one reference; true when it was the last (the caller frees). */
static inline bool kvr_ref_put(kvr_ref *r)
{
    unsigned old = atomic_fetch_sub_explicit(&r->n, 1, memory_order_acq_rel);
    assert(old > 0);
    return old == 1;
}

#endif /* KVR_BASE_REF_H */
