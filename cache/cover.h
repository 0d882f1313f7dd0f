/*
 * cover.h — the placed read under a cover's get (private to cache/): an
 * assemble transaction (assemble.c) whose stream is pieces of contexts,
 * each at explicit consecutive positions, instead of a prefix and whole
 * documents. cover.c computes the pieces; everything after begin (stage,
 * work, iovecs, copy_into, end) is the assemble's.
 */
#ifndef KVR_CACHE_COVER_H
#define KVR_CACHE_COVER_H

#include "cache/store.h"

#pragma GCC visibility push(hidden)

typedef struct kvr_place {
    kvr_ctx *c;
    size_t   from, n;          /* the context's tokens [from, from + n), n > 0 */
    int64_t  pos;              /* target position of the first */
    bool     approx;           /* every token of it KVR_TOKEN_APPROX */
} kvr_place;

typedef struct kvr_place_opts {
    const uint32_t *layers;    /* NULL: all */
    size_t          n_layers_sel;
    kvr_dtype       dtype;
    bool            meta_only;
    void           *dst;
    size_t          dst_cap;
    int64_t         query_pos; /* the QUERY segment's position */
} kvr_place_opts;

/* Loop thread: leases the pieces' blocks, copies their metadata, reserves
 * as assemble does. KVR_EPENDING for a token without KV, KVR_EUNSUPPORTED
 * for RoPE that does not compose, KVR_ENOMEM. */
int kvr_assemble_place_begin(kvr_store *s, kvr_model *m, const kvr_place *pc, size_t n_pc,
                             const kvr_place_opts *o, kvr_assemble **out, kvr_error *err);

#pragma GCC visibility pop

#endif /* KVR_CACHE_COVER_H */
