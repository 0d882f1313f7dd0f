/*
 * layout.c — per-context position layouts: the APE record of the prefix a
 * document was encoded against, GPE groups (named position cursors with an
 * offset each) and the StreamingLLM retention policy (sinks + window).
 *
 * The state lives in ctx->layout (NULL for a plain context), one flat
 * allocation of struct kvr_layout that only this file allocates and copies
 * (layout_new, kvr_layout_copy: always sizeof, never a size kept beside
 * it); the context frees it (ctx.c). It is only touched on the loop
 * thread. Everything here changes metadata: extents'
 * pos_delta and the extent array. No K/V byte is copied or rotated; get and
 * assemble rotate each key once from its stored form.
 *
 * Besides positions it keeps one fact about how the KV arrived: v_trans,
 * the context was created from an engine whose V cache is transposed
 * (llama.cpp with flash attention off; the daemon stores V per token
 * either way), so an export can default to that layout. Set by the put
 * that creates the context, kept by fork, persistence and the shared tier.
 *
 * Invariants:
 *  - A grouped context's tokens all carry a group id in 0..n_groups-1 (the
 *    block's per-slot groups[]); group g's k-th token ever appended was
 *    stored at phi_g(then) + k, and its logical position is phi_g(now) + k
 *    unless an edit/shift moved it since.
 *  - With a retention policy, after every put (and when the policy is set)
 *    n_tokens <= sinks + window, or the context could not grow its extent
 *    array (out of memory), in which case the next put retries.
 *  - Every refusal leaves the context exactly as it was.
 *  - Whatever sets a field checks it with the same function, whether the
 *    value comes from a local verb or from outside (a shared-tier
 *    manifest, a disk record): check_group_names, check_retention and
 *    kvr_layout_info_check, which calls them.
 */
#include <stddef.h>
#include <string.h>

#include "cache/layout.h"

struct kvr_layout {
    /* APE: the prefix this context's KV was computed after. */
    bool     has_prefix;
    char     prefix[KVR_ID_MAX + 1];
    uint64_t prefix_fp;
    size_t   prefix_len;
    uint64_t prefix_hash;
    /* GPE groups. */
    size_t   n_groups;
    struct {
        char     name[KVR_GROUP_NAME_MAX + 1];
        int64_t  phi;
        uint64_t cursor;
    } g[KVR_MAX_GROUPS];
    /* StreamingLLM retention. */
    bool     has_ret;
    size_t   sinks, window, n_dropped;
    /* Created from a transposed V cache (put's v_trans). Last: a disk
     * record written before it has a shorter blob, zero-extended. */
    bool     v_trans;
};

int kvr_layout_ctx_hash(const kvr_ctx *c, uint64_t *out, kvr_error *err)
{
    uint32_t *t = kvr_ctx_gather_tokens(c, err);
    if (!t)
        return KVR_ENOMEM;
    /* FNV-1a over the ids' bytes: a prefix whose tokens change gets
     * another hash. */
    *out = kvr_fnv1a(t, c->n_tokens * sizeof *t, KVR_FNV_INIT);
    kvr_mem_free(t);
    return 0;
}

static int find_group(const kvr_layout *L, const char *name)
{
    if (!L || !name)
        return -1;
    for (size_t i = 0; i < L->n_groups; i++)
        if (strcmp(L->g[i].name, name) == 0)
            return (int)i;
    return -1;
}

/* The one allocator of a layout (zeroed): its size is sizeof, always. */
static kvr_layout *layout_new(void)
{
    return kvr_mem_calloc(1, sizeof(kvr_layout));
}

int kvr_layout_copy(kvr_ctx *dst, const kvr_ctx *src)
{
    if (!src->layout)
        return 0;
    kvr_layout *l = layout_new();
    if (!l)
        return KVR_ENOMEM;
    *l = *src->layout;
    kvr_mem_free(dst->layout);
    dst->layout = l;
    return 0;
}

/* ---- validation (the verbs and every restore) --------------------------- */

/* Group names as a create names them: 1..KVR_GROUP_NAME_MAX bytes each,
 * no two equal; at most KVR_MAX_GROUPS. */
static int check_group_names(const char *const *names, size_t n, kvr_error *err)
{
    if (n > KVR_MAX_GROUPS)
        return kvr_error_set(err, KVR_ELIMIT, "%zu groups (at most %d)", n, KVR_MAX_GROUPS);
    if (n && !names)
        return kvr_error_set(err, KVR_EBADREQUEST, "group names missing");
    for (size_t i = 0; i < n; i++) {
        const char *g = names[i];
        size_t len = g ? strnlen(g, KVR_GROUP_NAME_MAX + 1) : 0;
        if (len == 0 || len > KVR_GROUP_NAME_MAX)
            return kvr_error_set(err, KVR_EINVAL, "group name %zu must be 1..%d bytes", i,
                                 KVR_GROUP_NAME_MAX);
        for (size_t j = 0; j < i; j++)
            if (strcmp(names[j], g) == 0)
                return kvr_error_set(err, KVR_EINVAL, "duplicate group name '%s'", g);
    }
    return 0;
}

/* A sink + window policy as set_retention accepts it (on a context with
 * n_groups groups). */
static int check_retention(const char *ctx_id, size_t sinks, size_t window, size_t n_groups,
                           kvr_error *err)
{
    size_t total;
    if (window == 0)
        return kvr_error_set(err, KVR_EINVAL, "retention window must be at least 1 token");
    if (__builtin_add_overflow(sinks, window, &total) || total > KVR_RETENTION_MAX)
        return kvr_error_set(err, KVR_EINVAL,
                             "retention sinks %zu + window %zu exceeds the limit of %u tokens",
                             sinks, window, KVR_RETENTION_MAX);
    if (n_groups)
        return kvr_error_set(err, KVR_EUNSUPPORTED,
                             "context '%s' has position groups: a sink + window policy "
                             "would have to renumber each group separately, which is "
                             "not supported", ctx_id);
    return 0;
}

/* A group's offset and cursor as a put and set_group_offset keep them: the
 * cursor a count that fits a position, offset + cursor no overflow. */
static int check_group_cursor(const char *name, int64_t phi, uint64_t cursor, kvr_error *err)
{
    int64_t next;
    if (cursor > (uint64_t)INT64_MAX || __builtin_add_overflow(phi, (int64_t)cursor, &next))
        return kvr_error_set(err, KVR_EINVAL,
                             "group '%s': positions from offset %lld + %llu overflow", name,
                             (long long)phi, (unsigned long long)cursor);
    return 0;
}

int kvr_layout_info_check(const kvr_layout_info *li, const char *ctx_id, uint64_t fingerprint,
                          const int32_t *groups, const uint32_t *flags, size_t n,
                          kvr_error *err)
{
    const char *names[KVR_MAX_GROUPS];
    if (li->n_groups > KVR_MAX_GROUPS)
        return kvr_error_set(err, KVR_ELIMIT, "%zu groups (at most %d)", li->n_groups,
                             KVR_MAX_GROUPS);
    for (size_t i = 0; i < li->n_groups; i++) {
        if (!memchr(li->groups[i].name, 0, sizeof li->groups[i].name))
            return kvr_error_set(err, KVR_EINVAL, "group name %zu unterminated", i);
        names[i] = li->groups[i].name;
    }
    int rc = check_group_names(names, li->n_groups, err);
    for (size_t i = 0; rc == 0 && i < li->n_groups; i++)
        rc = check_group_cursor(names[i], li->groups[i].offset, li->groups[i].cursor, err);
    if (rc != 0)
        return rc;
    /* The APE record as a put with prefix_ctx writes it: a valid id, the
     * context's own model, a length that is a position. */
    if (li->has_prefix) {
        if (!memchr(li->prefix_ctx, 0, sizeof li->prefix_ctx))
            return kvr_error_set(err, KVR_EINVAL, "prefix id unterminated");
        if ((rc = kvr_ctx_id_check(li->prefix_ctx, err)) != 0)
            return rc;
        if (li->prefix_fingerprint != fingerprint)
            return kvr_error_set(err, KVR_EFINGERPRINT,
                                 "prefix record of '%s': fingerprint %016llx, the context's "
                                 "model has %016llx", ctx_id,
                                 (unsigned long long)li->prefix_fingerprint,
                                 (unsigned long long)fingerprint);
        if (li->prefix_len > (size_t)INT64_MAX)
            return kvr_error_set(err, KVR_EINVAL, "prefix record of '%s': length %zu",
                                 ctx_id, li->prefix_len);
    } else if (li->prefix_ctx[0] || li->prefix_fingerprint || li->prefix_len ||
               li->prefix_hash) {
        return kvr_error_set(err, KVR_EINVAL, "prefix record of '%s' without a prefix",
                             ctx_id);
    }
    if (li->has_retention) {
        if ((rc = check_retention(ctx_id, li->sinks, li->window, li->n_groups, err)) != 0)
            return rc;
        if (n > li->sinks + li->window)
            return kvr_error_set(err, KVR_EINVAL, "'%s': %zu tokens, more than sinks %zu + "
                                 "window %zu", ctx_id, n, li->sinks, li->window);
    }
    if (li->n_dropped > (size_t)INT64_MAX)
        return kvr_error_set(err, KVR_EINVAL, "'%s': %zu tokens dropped", ctx_id,
                             li->n_dropped);
    /* Every token's group id names a group (0 without groups, as a put
     * writes it); its only flag STALE. */
    for (size_t k = 0; k < n; k++) {
        int32_t g = groups ? groups[k] : 0;
        if (g < 0 || (size_t)g >= (li->n_groups ? li->n_groups : 1))
            return kvr_error_set(err, KVR_EINVAL, "token %zu: group %d of %zu", k, (int)g,
                                 li->n_groups);
        if (flags && (flags[k] & ~KVR_TOKEN_STALE))
            return kvr_error_set(err, KVR_EINVAL, "token %zu: flags 0x%x", k,
                                 (unsigned)flags[k]);
    }
    return 0;
}

/* The layout's state as stat reports it, and back. */
static void layout_to_info(const kvr_layout *L, kvr_layout_info *out)
{
    memset(out, 0, sizeof *out);
    out->has_prefix = L->has_prefix;
    memcpy(out->prefix_ctx, L->prefix, sizeof out->prefix_ctx);
    out->prefix_fingerprint = L->prefix_fp;
    out->prefix_len = L->prefix_len;
    out->prefix_hash = L->prefix_hash;
    out->n_groups = L->n_groups <= KVR_MAX_GROUPS ? L->n_groups : KVR_MAX_GROUPS + 1;
    for (size_t i = 0; i < L->n_groups && i < KVR_MAX_GROUPS; i++) {
        memcpy(out->groups[i].name, L->g[i].name, sizeof out->groups[i].name);
        out->groups[i].id = (int32_t)i;
        out->groups[i].offset = L->g[i].phi;
        out->groups[i].cursor = L->g[i].cursor;
    }
    out->has_retention = L->has_ret;
    out->sinks = L->sinks;
    out->window = L->window;
    out->n_dropped = L->n_dropped;
    out->v_trans = L->v_trans;
}

static void layout_from_info(kvr_layout *L, const kvr_layout_info *li)
{
    memset(L, 0, sizeof *L);
    L->has_prefix = li->has_prefix;
    memcpy(L->prefix, li->prefix_ctx, sizeof L->prefix);
    L->prefix_fp = li->prefix_fingerprint;
    L->prefix_len = li->prefix_len;
    L->prefix_hash = li->prefix_hash;
    L->n_groups = li->n_groups;
    for (size_t i = 0; i < li->n_groups; i++) {
        memcpy(L->g[i].name, li->groups[i].name, sizeof L->g[i].name);
        L->g[i].phi = li->groups[i].offset;
        L->g[i].cursor = li->groups[i].cursor;
    }
    L->has_ret = li->has_retention;
    L->sinks = li->sinks;
    L->window = li->window;
    L->n_dropped = li->n_dropped;
    L->v_trans = li->v_trans;
}

/* ---- retention ---------------------------------------------------------- */

/* Drops tokens [sinks, n - window) and moves the window right after the
 * last sink (or to where the oldest token was, without sinks). Returns the
 * position change of the window's tokens. */
static int64_t retention_apply(kvr_store *s, kvr_ctx *c)
{
    kvr_layout *L = c->layout;
    size_t n = c->n_tokens, S = L->sinks, W = L->window;
    if (!L->has_ret || n <= S + W)
        return 0;
    if (kvr_ctx_ext_reserve(c, 2) != 0)
        return 0;                       /* retried by the next put */
    size_t i0 = kvr_ctx_split_at(c, S);
    size_t i1 = kvr_ctx_split_at(c, n - W);
    int64_t base;
    if (i0 > 0) {
        const kvr_extent *e = &c->ext[i0 - 1];
        if (__builtin_add_overflow(kvr_ext_pos(e, e->count - 1), 1, &base))
            base = kvr_ext_pos(&c->ext[i1], 0);
    } else {
        base = kvr_ext_pos(&c->ext[0], 0);
    }
    int64_t delta;
    if (__builtin_sub_overflow(base, kvr_ext_pos(&c->ext[i1], 0), &delta))
        delta = 0;
    for (size_t i = i1; i < c->n_ext && delta != 0; i++) {
        const kvr_extent *e = &c->ext[i];
        int64_t q;
        if (__builtin_add_overflow(e->pos_delta, delta, &q))
            delta = 0;
        for (uint32_t j = 0; j < e->count && delta != 0; j++)
            if (__builtin_add_overflow(kvr_ext_pos(e, j), delta, &q))
                delta = 0;
    }
    kvr_ctx_drop_extents(&s->pool, c, i0, i1);
    kvr_ctx_add_delta(c, i0, c->n_ext, delta);
    kvr_ctx_merge_extents(&s->pool, c);
    assert(c->n_tokens == S + W);
    L->n_dropped += n - S - W;
    kvr_ctx_index_rebuild(c, S);
    kvr_ctx_check(c);
    return delta;
}

/* ---- put hooks ---------------------------------------------------------- */

void kvr_layout_put_free(kvr_layout_put *lp)
{
    kvr_mem_free(lp->created);
    lp->created = NULL;
}

int kvr_layout_put_begin(kvr_store *s, const kvr_ctx *c, const kvr_model *m,
                         const kvr_put_params *p, kvr_layout_put *lp, kvr_error *err)
{
    memset(lp, 0, sizeof *lp);
    bool creating = c == NULL;
    if (!creating && (p->prefix_ctx || p->n_groups))
        return kvr_error_set(err, KVR_EBADREQUEST,
                             "context '%s' exists: a prefix or groups can only be given "
                             "when it is created", p->ctx_id);
    int crc = check_group_names(p->groups, p->n_groups, err);
    if (crc != 0)
        return crc;

    const kvr_layout *L = creating ? NULL : c->layout;
    size_t n_groups = creating ? p->n_groups : (L ? L->n_groups : 0);
    int gid = -1;
    int64_t phi = 0;
    uint64_t cursor = 0;
    if (p->group) {
        if (creating) {
            for (size_t i = 0; i < p->n_groups; i++)
                if (strcmp(p->groups[i], p->group) == 0)
                    gid = (int)i;
            if (gid >= 0 && p->group_offsets)
                phi = p->group_offsets[gid];
        } else if ((gid = find_group(L, p->group)) >= 0) {
            phi = L->g[gid].phi;
            cursor = L->g[gid].cursor;
        }
        if (gid < 0)
            return kvr_error_set(err, KVR_EINVAL, "context '%s' has no group '%s'",
                                 p->ctx_id, p->group);
        if (p->positions || p->has_pos_start)
            return kvr_error_set(err, KVR_EBADREQUEST,
                                 "a put to group '%s' takes the group's positions; "
                                 "explicit positions are not allowed", p->group);
        int64_t first, last;
        if ((crc = check_group_cursor(p->group, phi, cursor, err)) != 0)
            return crc;
        first = phi + (int64_t)cursor;
        if (__builtin_add_overflow(first, (int64_t)(p->n_tokens - 1), &last))
            return kvr_error_set(err, KVR_EINVAL,
                                 "group '%s': positions from offset %lld + %llu overflow",
                                 p->group, (long long)phi, (unsigned long long)cursor);
        lp->group = gid;
        lp->has_first = true;
        lp->first = first;
    } else if (n_groups) {
        return kvr_error_set(err, KVR_EBADREQUEST,
                             "context '%s' has groups: a put must name one", p->ctx_id);
    }

    kvr_layout tmp;   /* ~1.6 KiB: cleared only for a put that records a layout */
    bool record = p->prefix_ctx || (creating && (p->n_groups || p->v_trans));
    if (record)
        memset(&tmp, 0, sizeof tmp);
    if (p->prefix_ctx) {
        kvr_ctx *pc = NULL;
        int rc = kvr_store_ctx_live(s, p->prefix_ctx, &pc, err);
        if (rc != 0)
            return kvr_error_set(err, rc, "prefix context '%s' not found", p->prefix_ctx);
        if (pc->model != m)
            return kvr_error_set(err, KVR_EFINGERPRINT,
                                 "prefix context '%s' belongs to model '%s', not '%s'",
                                 p->prefix_ctx, pc->model->name, m->name);
        if ((rc = kvr_layout_ctx_hash(pc, &tmp.prefix_hash, err)) != 0)
            return rc;
        tmp.has_prefix = true;
        memcpy(tmp.prefix, pc->id, pc->id_len + 1);
        tmp.prefix_fp = m->fingerprint;
        tmp.prefix_len = pc->n_tokens;
        if (!lp->has_first && !p->positions && !p->has_pos_start) {
            lp->has_first = true;
            lp->first = (int64_t)pc->n_tokens;
        }
    }
    if (creating && record) {
        tmp.v_trans = p->v_trans;
        tmp.n_groups = p->n_groups;
        for (size_t i = 0; i < p->n_groups; i++) {
            memcpy(tmp.g[i].name, p->groups[i], strlen(p->groups[i]) + 1);
            tmp.g[i].phi = p->group_offsets ? p->group_offsets[i] : 0;
        }
        lp->created = layout_new();
        if (!lp->created)
            return kvr_error_set(err, KVR_ENOMEM, "out of memory creating '%s'", p->ctx_id);
        *lp->created = tmp;
    }
    return 0;
}

int64_t kvr_layout_put_commit(kvr_store *s, kvr_ctx *c, kvr_layout_put *lp, size_t n)
{
    if (lp->created) {
        c->layout = lp->created;
        lp->created = NULL;
    }
    kvr_layout *L = c->layout;
    if (!L)
        return 0;
    if (L->n_groups)
        L->g[lp->group].cursor += n;
    return retention_apply(s, c);
}

size_t kvr_layout_blob_size(void)
{
    return sizeof(kvr_layout);
}

bool kvr_layout_blob_get(const kvr_ctx *c, void *out)
{
    if (!c->layout)
        return false;
    memcpy(out, c->layout, sizeof *c->layout);
    return true;
}

int kvr_layout_blob_set(kvr_ctx *c, const void *in, size_t len, kvr_error *err)
{
    if (len > sizeof(kvr_layout) || len < offsetof(kvr_layout, v_trans))
        return kvr_error_set(err, KVR_EINVAL, "layout blob of %zu bytes (%zu..%zu)", len,
                             offsetof(kvr_layout, v_trans), sizeof(kvr_layout));
    kvr_layout *L = layout_new();
    if (!L)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory");
    memcpy(L, in, len);     /* an older record's blob ends before v_trans: 0 */
    /* A record is checksummed, but what it restores passes the same
     * checks as what a verb sets (the tokens were checked by the caller). */
    kvr_layout_info li;
    layout_to_info(L, &li);
    int rc = kvr_layout_info_check(&li, c->id, c->model->fingerprint, NULL, NULL, 0, err);
    if (rc != 0) {
        kvr_mem_free(L);
        return rc;
    }
    kvr_mem_free(c->layout);
    c->layout = L;
    return 0;
}

bool kvr_layout_v_trans(const kvr_ctx *c)
{
    return c->layout && c->layout->v_trans;
}

/* The APE record of c, for assemble.c: false if c has none. */
bool kvr_layout_ape_record(const kvr_ctx *c, const char **prefix, uint64_t *fp,
                           size_t *len, uint64_t *hash)
{
    const kvr_layout *L = c->layout;
    if (!L || !L->has_prefix)
        return false;
    *prefix = L->prefix;
    *fp = L->prefix_fp;
    *len = L->prefix_len;
    *hash = L->prefix_hash;
    return true;
}

/* ---- verbs -------------------------------------------------------------- */

int kvr_store_layout_stat(kvr_store *s, const char *ctx_id, kvr_layout_info *out,
                          kvr_error *err)
{
    kvr_ctx *c = NULL;
    int rc = kvr_store_ctx_live(s, ctx_id, &c, err);
    if (rc != 0)
        return rc;
    memset(out, 0, sizeof *out);
    const kvr_layout *L = c->layout;
    if (!L)
        return 0;
    layout_to_info(L, out);
    for (size_t i = 0; i < c->n_ext && L->n_groups; i++) {
        const kvr_extent *e = &c->ext[i];
        for (uint32_t j = 0; j < e->count; j++) {
            int32_t g = e->block->groups[e->first + j];
            if (g >= 0 && (size_t)g < L->n_groups)
                out->groups[g].n_tokens++;
        }
    }
    return 0;
}

int kvr_store_set_group_offset(kvr_store *s, const char *ctx_id, const char *name,
                               int64_t phi, kvr_error *err)
{
    kvr_ctx *c = NULL;
    int rc = kvr_store_ctx_writable(s, ctx_id, &c, err);
    if (rc != 0)
        return rc;
    kvr_layout *L = c->layout;
    int g = find_group(L, name);
    if (g < 0)
        return kvr_error_set(err, KVR_EINVAL, "context '%s' has no group '%s'", ctx_id,
                             name ? name : "");
    int64_t delta, next;
    if (__builtin_sub_overflow(phi, L->g[g].phi, &delta) ||
        L->g[g].cursor > (uint64_t)INT64_MAX ||
        __builtin_add_overflow(phi, (int64_t)L->g[g].cursor, &next))
        return kvr_error_set(err, KVR_EINVAL,
                             "group '%s': offset %lld overflows its positions", name,
                             (long long)phi);
    if (delta == 0)
        return 0;
    /* Check every token of the group and count the pieces first. */
    size_t pieces = 0;
    for (size_t i = 0; i < c->n_ext; i++) {
        const kvr_extent *e = &c->ext[i];
        int64_t q;
        bool prev = false;
        for (uint32_t j = 0; j < e->count; j++) {
            bool in = e->block->groups[e->first + j] == g;
            if (j == 0 || in != prev)
                pieces++;
            prev = in;
            if (in && (__builtin_add_overflow(kvr_ext_pos(e, j), delta, &q) ||
                       __builtin_add_overflow(e->pos_delta, delta, &q)))
                return kvr_error_set(err, KVR_EINVAL,
                                     "group '%s': offset %lld overflows the position of "
                                     "one of its tokens", name, (long long)phi);
        }
    }
    kvr_extent *ne = kvr_mem_malloc((pieces ? pieces : 1) * sizeof *ne);
    if (!ne)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory moving group '%s'", name);
    size_t k = 0;
    for (size_t i = 0; i < c->n_ext; i++) {
        const kvr_extent *e = &c->ext[i];
        uint32_t j = 0;
        while (j < e->count) {
            bool in = e->block->groups[e->first + j] == g;
            uint32_t z = j + 1;
            while (z < e->count && (e->block->groups[e->first + z] == g) == in)
                z++;
            ne[k] = *e;
            ne[k].first = e->first + j;
            ne[k].count = z - j;
            if (in)
                ne[k].pos_delta += delta;
            kvr_block_ref(e->block);            /* each piece holds one */
            k++;
            j = z;
        }
    }
    kvr_ctx_replace_extents(&s->pool, c, ne, k, pieces ? pieces : 1);
    kvr_ctx_merge_extents(&s->pool, c);
    kvr_ctx_check(c);
    L->g[g].phi = phi;
    kvr_store_touch(s, c);
    return 0;
}

int kvr_store_set_retention(kvr_store *s, const char *ctx_id, const kvr_retention *r,
                            kvr_error *err)
{
    kvr_ctx *c = NULL;
    int rc = kvr_store_ctx_writable(s, ctx_id, &c, err);
    if (rc != 0)
        return rc;
    if (!r)
        return kvr_error_set(err, KVR_EBADREQUEST, "retention: missing parameters");
    if (r->off) {
        if (c->layout)
            c->layout->has_ret = false;
        return 0;
    }
    if ((rc = check_retention(ctx_id, r->sinks, r->window, c->layout ? c->layout->n_groups : 0,
                              err)) != 0)
        return rc;
    if (!c->layout) {
        c->layout = layout_new();
        if (!c->layout)
            return kvr_error_set(err, KVR_ENOMEM, "out of memory setting a retention policy");
    }
    c->layout->has_ret = true;
    c->layout->sinks = r->sinks;
    c->layout->window = r->window;
    retention_apply(s, c);
    kvr_store_touch(s, c);
    return 0;
}

int kvr_store_layout_restore(kvr_store *s, const char *ctx_id, const kvr_layout_info *li,
                             const int32_t *groups, const uint32_t *flags, size_t n,
                             kvr_error *err)
{
    kvr_ctx *c = NULL;
    int rc = kvr_store_ctx_writable(s, ctx_id, &c, err);
    if (rc != 0)
        return rc;
    if (c->n_tokens != n)
        return kvr_error_set(err, KVR_EINVAL, "layout of '%s': %zu tokens, the context has %zu",
                             ctx_id, n, c->n_tokens);
    if (c->layout)
        return kvr_error_set(err, KVR_EBUSY, "'%s' has a layout already", ctx_id);
    if ((rc = kvr_layout_info_check(li, ctx_id, c->model->fingerprint, groups, flags, n,
                                    err)) != 0)
        return rc;
    /* Every token's block is the context's alone (its slots are written
     * below). */
    for (size_t i = 0; i < c->n_ext; i++) {
        const kvr_extent *e = &c->ext[i];
        if (!kvr_block_exclusive(e->block) || e->block->spilled || e->block->disk)
            return kvr_error_set(err, KVR_EBUSY, "'%s' shares blocks or has them on disk",
                                 ctx_id);
    }
    bool any = li->has_prefix || li->n_groups || li->has_retention || li->v_trans;
    kvr_layout *L = NULL;
    if (any) {
        L = layout_new();
        if (!L)
            return kvr_error_set(err, KVR_ENOMEM, "out of memory");
        layout_from_info(L, li);
    }
    /* Flags: split extents where STALE starts or stops (needs room first). */
    size_t cuts = 0;
    for (size_t k = 1; flags && k < n; k++)
        cuts += (flags[k] != flags[k - 1]);
    if (cuts && kvr_ctx_ext_reserve(c, cuts) != 0) {
        kvr_mem_free(L);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory");
    }
    for (size_t k = 1; flags && k < n; k++)
        if (flags[k] != flags[k - 1])
            kvr_ctx_split_at(c, k);
    for (size_t i = 0, k = 0; i < c->n_ext; i++) {
        kvr_extent *e = &c->ext[i];
        if (flags)
            e->flags = (e->flags & ~KVR_TOKEN_STALE) | (flags[k] & KVR_TOKEN_STALE);
        for (uint32_t j = 0; j < e->count; j++, k++)
            e->block->groups[e->first + j] = groups && li->n_groups ? groups[k] : 0;
    }
    if (L)
        c->layout = L;
    kvr_ctx_check(c);
    return 0;
}
