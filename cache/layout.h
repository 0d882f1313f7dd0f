/*
 * layout.h — per-context position layouts (private to cache/; layout.c):
 * the APE record, GPE groups and StreamingLLM retention. Above the store:
 * put calls the put hooks, assemble reads the APE record, the disk tier
 * stores the layout as an opaque blob. The state itself is one flat
 * allocation hanging off the context (ctx.h): the context frees it; only
 * layout.c allocates and copies it (its size is sizeof, never a field).
 */
#ifndef KVR_CACHE_LAYOUT_H
#define KVR_CACHE_LAYOUT_H

#include "cache/store.h"

#pragma GCC visibility push(hidden)

typedef struct kvr_layout kvr_layout;

/* A put carries a kvr_layout_put from begin to commit: begin validates
 * (group names, prefix) and computes the group's positions, commit
 * installs a created context's layout, advances the group cursor and
 * applies the retention policy. */
typedef struct kvr_layout_put {
    kvr_layout *created;     /* create: the new context's layout (owned until commit) */
    int32_t     group;           /* group id of the new tokens */
    bool        has_first;       /* positions come from the layout (group cursor, APE P) */
    int64_t     first;
} kvr_layout_put;

int     kvr_layout_put_begin(kvr_store *s, const kvr_ctx *c, const kvr_model *m,
                             const kvr_put_params *p, kvr_layout_put *lp, kvr_error *err);
/* Returns how far the new tokens' positions moved (retention), 0 usually. */
int64_t kvr_layout_put_commit(kvr_store *s, kvr_ctx *c, kvr_layout_put *lp, size_t n);
void    kvr_layout_put_free(kvr_layout_put *lp);
/* Hash of c's token ids (the APE record's prefix hash). */
int     kvr_layout_ctx_hash(const kvr_ctx *c, uint64_t *out, kvr_error *err);
/* c's APE record (borrowed strings): false if c was not created with one. */
bool    kvr_layout_ape_record(const kvr_ctx *c, const char **prefix, uint64_t *fp,
                              size_t *len, uint64_t *hash);
/* Copies src's layout into dst (fork): 0 or KVR_ENOMEM. */
int     kvr_layout_copy(kvr_ctx *dst, const kvr_ctx *src);
/* The layout as an opaque blob of kvr_layout_blob_size() bytes (tier.c's
 * records). blob_set takes len bytes, at most blob_size (a blob written
 * before the last fields were added is shorter: they read as zero), checks
 * what it restores as kvr_layout_info_check does (KVR_EINVAL etc.: c
 * unchanged) or fails with KVR_ENOMEM. */
size_t  kvr_layout_blob_size(void);
bool    kvr_layout_blob_get(const kvr_ctx *c, void *out);   /* false: no layout */
int     kvr_layout_blob_set(kvr_ctx *c, const void *in, size_t len, kvr_error *err);
/* c was created from a transposed V cache (kvr_put_params.v_trans). */
bool    kvr_layout_v_trans(const kvr_ctx *c);

#pragma GCC visibility pop

#endif /* KVR_CACHE_LAYOUT_H */
