/*
 * ctx.c — contexts as extent lists: creation and release, the extent array
 * operations every verb builds on (split, merge, append, replace, drop,
 * shift), reading tokens and positions through extents, and keeping the
 * context's entries in its model's prefix trees in sync (ctx.h has the
 * invariants). Calls the block layer and the prefix tree only.
 */
#include <string.h>

#include "cache/ctx.h"

kvr_ctx *kvr_ctx_create(kvr_model *m, const char *id, uint64_t hash, uint64_t now)
{
    kvr_ctx *c = kvr_mem_calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->id_len = strlen(id);
    assert(c->id_len <= KVR_ID_MAX);
    memcpy(c->id, id, c->id_len + 1);
    c->hash = hash;
    c->model = m;
    c->codec = m->codec;
    c->dtype = m->codec.dtype;
    c->pending = true;
    kvr_list_init(&c->lru);
    c->created_ms = c->accessed_ms = now;
    c->idx[0].owner = c->idx[1].owner = c;
    return c;
}

void kvr_ctx_free(kvr_block_pool *p, kvr_ctx *c)
{
    kvr_grain_forget(c);
    kvr_ctx_stale_clear(c);
    kvr_ctx_index_truncate(c, 0, 0);
    kvr_ctx_index_truncate(c, 1, 0);
    for (size_t i = 0; i < c->n_ext; i++)
        kvr_block_unref(p, c->ext[i].block);
    kvr_mem_free(c->layout);
    kvr_mem_free(c->ext);
    kvr_mem_free(c);
}

void kvr_ctx_check(const kvr_ctx *c)
{
#ifndef NDEBUG
    size_t n = 0;
    for (size_t i = 0; i < c->n_ext; i++) {
        const kvr_extent *e = &c->ext[i];
        assert(e->count > 0);
        assert(e->block && e->first + e->count <= e->block->used);
        assert(e->block->refcount > 0);
        n += e->count;
    }
    assert(n == c->n_tokens);
    assert(c->n_ext <= c->cap_ext);
    assert(c->n_exact <= c->n_tokens);
    assert(c->idx[0].len <= c->n_exact);
    assert(c->idx[1].len <= c->n_tokens);
#else
    (void)c;
#endif
}

/* ---- extents ------------------------------------------------------------ */

int kvr_ctx_ext_reserve(kvr_ctx *c, size_t n)
{
    if (c->n_ext + n <= c->cap_ext)
        return 0;
    size_t cap = c->cap_ext ? c->cap_ext : 4;
    while (cap < c->n_ext + n)
        cap *= 2;
    kvr_extent *e = kvr_mem_realloc(c->ext, cap * sizeof *e);
    if (!e)
        return KVR_ENOMEM;
    c->ext = e;
    c->cap_ext = cap;
    return 0;
}

size_t kvr_ctx_split_at(kvr_ctx *c, size_t idx)
{
    assert(idx <= c->n_tokens);
    size_t k = 0, i = 0;
    for (; i < c->n_ext; i++) {
        if (k == idx)
            return i;
        if (idx < k + c->ext[i].count)
            break;
        k += c->ext[i].count;
    }
    if (i == c->n_ext)
        return i;
    assert(c->n_ext < c->cap_ext);
    uint32_t off = (uint32_t)(idx - k);
    memmove(c->ext + i + 1, c->ext + i, (c->n_ext - i) * sizeof *c->ext);
    c->n_ext++;
    c->ext[i].count = off;
    c->ext[i + 1].first += off;
    c->ext[i + 1].count -= off;
    kvr_block_ref(c->ext[i].block);
    return i + 1;
}

void kvr_ctx_merge_extents(kvr_block_pool *p, kvr_ctx *c)
{
    if (c->n_ext < 2)
        return;
    size_t w = 0;
    for (size_t i = 1; i < c->n_ext; i++) {
        kvr_extent *last = &c->ext[w], *e = &c->ext[i];
        if (kvr_ext_joins(last, e)) {
            last->count += e->count;
            kvr_block_unref(p, e->block);
        } else {
            c->ext[++w] = *e;
        }
    }
    c->n_ext = w + 1;
}

bool kvr_ext_append(kvr_extent *a, size_t *n, kvr_extent e)
{
    assert(e.count > 0);
    if (*n && kvr_ext_joins(&a[*n - 1], &e)) {
        a[*n - 1].count += e.count;
        return true;
    }
    a[(*n)++] = e;
    return false;
}

void kvr_ctx_push(kvr_block_pool *p, kvr_ctx *c, kvr_extent e)
{
    assert(c->n_ext < c->cap_ext || (c->n_ext && kvr_ext_joins(&c->ext[c->n_ext - 1], &e)));
    if (kvr_ext_append(c->ext, &c->n_ext, e))
        kvr_block_unref(p, e.block);     /* the extent already holds one */
    c->n_tokens += e.count;
}

static size_t compute_exact(const kvr_ctx *c)
{
    size_t k = 0;
    for (size_t i = 0; i < c->n_ext; i++) {
        if (c->ext[i].flags & (KVR_TOKEN_APPROX | KVR_TOKEN_PENDING))
            break;
        k += c->ext[i].count;
    }
    return k;
}

void kvr_ctx_replace_extents(kvr_block_pool *p, kvr_ctx *c, kvr_extent *a, size_t n,
                             size_t cap)
{
    kvr_extent *old = c->ext;
    size_t n_old = c->n_ext;
    c->ext = a;
    c->n_ext = n;
    c->cap_ext = cap;
    c->n_tokens = 0;
    for (size_t i = 0; i < n; i++)
        c->n_tokens += a[i].count;
    c->n_exact = compute_exact(c);
    for (size_t i = 0; i < n_old; i++)
        kvr_block_unref(p, old[i].block);
    kvr_mem_free(old);
}

void kvr_ctx_drop_extents(kvr_block_pool *p, kvr_ctx *c, size_t i0, size_t i1)
{
    assert(i0 <= i1 && i1 <= c->n_ext);
    for (size_t i = i0; i < i1; i++) {
        c->n_tokens -= c->ext[i].count;
        kvr_block_unref(p, c->ext[i].block);
    }
    memmove(c->ext + i0, c->ext + i1, (c->n_ext - i1) * sizeof *c->ext);
    c->n_ext -= i1 - i0;
    if (c->n_exact > c->n_tokens)
        c->n_exact = c->n_tokens;
}

void kvr_ctx_add_delta(kvr_ctx *c, size_t i0, size_t i1, int64_t delta)
{
    assert(i0 <= i1 && i1 <= c->n_ext);
    for (size_t i = i0; i < i1; i++)
        c->ext[i].pos_delta += delta;
}

void kvr_ctx_share_extents(kvr_ctx *dst, const kvr_ctx *src)
{
    assert(dst->n_ext == 0 && dst->cap_ext >= src->n_ext);
    memcpy(dst->ext, src->ext, src->n_ext * sizeof *src->ext);
    dst->n_ext = src->n_ext;
    for (size_t i = 0; i < dst->n_ext; i++)
        kvr_block_ref(dst->ext[i].block);
    dst->n_tokens = src->n_tokens;
    dst->n_exact = src->n_exact;
}

/* ---- reading ------------------------------------------------------------ */

void kvr_ctx_seek(const kvr_ctx *c, size_t *i, size_t *k, size_t idx)
{
    while (*i < c->n_ext && *k + c->ext[*i].count <= idx) {
        *k += c->ext[*i].count;
        (*i)++;
    }
}

int64_t kvr_ctx_pos_at(const kvr_ctx *c, size_t *i, size_t *k, size_t idx)
{
    kvr_ctx_seek(c, i, k, idx);
    assert(*i < c->n_ext);
    return kvr_ext_pos(&c->ext[*i], (uint32_t)(idx - *k));
}

int64_t kvr_ctx_last_pos(const kvr_ctx *c)
{
    if (c->n_ext == 0)
        return -1;
    const kvr_extent *e = &c->ext[c->n_ext - 1];
    return kvr_ext_pos(e, e->count - 1);
}

size_t kvr_ctx_count_flag(const kvr_ctx *c, size_t from, size_t to, uint32_t flags)
{
    size_t n = 0, k = 0;
    for (size_t i = 0; i < c->n_ext && k < to; k += c->ext[i].count, i++) {
        size_t lo = k > from ? k : from, hi = k + c->ext[i].count < to ?
                                              k + c->ext[i].count : to;
        if (hi > lo && (c->ext[i].flags & flags))
            n += hi - lo;
    }
    return n;
}

void kvr_ctx_tokens(const kvr_ctx *c, size_t from, size_t to, uint32_t *dst)
{
    size_t k = 0;
    for (size_t i = 0; i < c->n_ext && k < to; k += c->ext[i].count, i++) {
        const kvr_extent *e = &c->ext[i];
        size_t lo = k > from ? k : from, hi = k + e->count < to ? k + e->count : to;
        if (hi > lo)
            memcpy(dst + (lo - from), e->block->tokens + e->first + (lo - k),
                   (hi - lo) * sizeof *dst);
    }
}

uint32_t *kvr_ctx_gather_tokens(const kvr_ctx *c, kvr_error *err)
{
    uint32_t *t = kvr_mem_malloc((c->n_tokens ? c->n_tokens : 1) * sizeof *t);
    if (!t) {
        kvr_error_set(err, KVR_ENOMEM, "out of memory gathering %zu tokens",
                      c->n_tokens);
        return NULL;
    }
    kvr_ctx_tokens(c, 0, c->n_tokens, t);
    return t;
}

/* ---- prefix index ------------------------------------------------------- */

void kvr_ctx_index_truncate(kvr_ctx *c, int w, size_t n)
{
    kvr_ptree_truncate(&c->model->tree[w], &c->idx[w], n);
}

int kvr_ctx_index_append(kvr_ctx *c, int w, const uint32_t *seq, size_t n)
{
    return kvr_ptree_append(&c->model->tree[w], &c->idx[w], seq, n);
}

bool kvr_ctx_index_extend(kvr_ctx *c, int w, size_t len)
{
    size_t from = c->idx[w].len;
    if (len <= from)
        return true;
    uint32_t *seq = kvr_mem_malloc((len - from) * sizeof *seq);
    if (!seq)
        return false;
    kvr_ctx_tokens(c, from, len, seq);
    int rc = kvr_ctx_index_append(c, w, seq, len - from);
    kvr_mem_free(seq);
    return rc == 0;
}

void kvr_ctx_index_rebuild(kvr_ctx *c, size_t common)
{
    kvr_ctx_stale_clear(c);
    c->n_exact = compute_exact(c);
    size_t len[2] = { c->n_exact, c->n_tokens };
    uint32_t *seq = NULL;
    for (int w = 0; w < 2; w++) {
        size_t keep = common < len[w] ? common : len[w];
        kvr_ctx_index_truncate(c, w, keep);
        if (len[w] > c->idx[w].len && !seq) {
            seq = kvr_ctx_gather_tokens(c, NULL);
            if (!seq) {
                kvr_ctx_index_truncate(c, w, 0);
                continue;
            }
        }
        if (len[w] > c->idx[w].len &&
            kvr_ctx_index_append(c, w, seq + c->idx[w].len, len[w] - c->idx[w].len) != 0)
            kvr_ctx_index_truncate(c, w, 0);
    }
    kvr_mem_free(seq);
    kvr_grain_note(c, common);
    kvr_grain_sync(c);
}

void kvr_ctx_stale_set(kvr_ctx *c)
{
    if (!c->idx_stale) {
        c->idx_stale = true;
        c->model->n_stale++;
    }
}

void kvr_ctx_stale_clear(kvr_ctx *c)
{
    if (c->idx_stale) {
        assert(c->model->n_stale > 0);
        c->idx_stale = false;
        c->model->n_stale--;
    }
}
