/*
 * block.c — the block layer: the one constructor, reference / hold / lease
 * counting, the release hook, data swaps for the disk tier (block.h has
 * the layout and the invariants).
 *
 * Each K/V slab of a plain block is cap*row*dsize bytes; with cap a multiple
 * of 16 and dsize >= 2 every slab stays 64-byte aligned for the SIMD
 * kernels. A block is freed when its last reference goes, never earlier
 * (into the pool's bounded cache of freed blocks when it has one: block.h;
 * a reused block is initialised exactly as a fresh one, its data as
 * uninitialised as kvr_mem_aligned's, a quantized block's unwritten bytes
 * zeroed again for the new fill).
 */
#include <malloc.h>
#include <string.h>

#include "cache/block.h"

static size_t align64(size_t n)
{
    return (n + KVR_BLOCK_ALIGN - 1) & ~(size_t)(KVR_BLOCK_ALIGN - 1);
}

void kvr_block_geom_plain(kvr_block_geom *g, uint32_t cap, uint32_t n_layers, uint32_t row,
                          kvr_dtype dt)
{
    *g = (kvr_block_geom){ .cap = cap, .n_layers = n_layers, .row = row, .dtype = dt };
}

/* Bytes before the metadata: K/V slabs (plus the quantized header). */
static size_t geom_kv_bytes(const kvr_block_geom *g)
{
    if (g->quant)
        return KVR_QHDR_BYTES + (g->qh.kslab + g->qh.vslab) * g->n_layers;
    size_t slab = (size_t)g->cap * g->row * kvr_dtype_size(g->dtype);
    return align64(slab * 2u * g->n_layers);
}

size_t kvr_block_geom_bytes(const kvr_block_geom *g)
{
    return geom_kv_bytes(g) + (size_t)g->cap * KVR_BLOCK_META_SLOT;
}

/* A fresh quantized block's header, and zeros in every K/V byte its
 * creator will not write (g->fill): padding and unused tails are never
 * read, but they are spilled, so they stay defined. Zeroing only those
 * (not the whole block, serially, before the put's parallel encode) is
 * what keeps a quantized put's serial part small (bench_quant_store). The
 * row and tile encoders write every byte of what they encode
 * (test_cache_qfill). */
static void qzero_unwritten(uint8_t *data, const kvr_block_geom *g)
{
    const kvr_qhdr *h = &g->qh;
    assert(g->fill <= g->cap);
    memset(data, 0, KVR_QHDR_BYTES);
    memcpy(data, h, sizeof *h);
    size_t kw = h->ktile > 1 ? (size_t)((g->fill + h->ktile - 1) / h->ktile) * h->krow
                             : (size_t)g->fill * h->krow;
    size_t vw = (size_t)g->fill * h->vrow;
    assert(kw <= h->kslab && vw <= h->vslab);
    uint8_t *p = data + KVR_QHDR_BYTES;
    for (uint32_t l = 0; l < g->n_layers; l++) {
        memset(p + kw, 0, h->kslab - kw);
        p += h->kslab;
        memset(p + vw, 0, h->vslab - vw);
        p += h->vslab;
    }
}

static void set_ptrs(kvr_block *b, uint8_t *base, size_t off)
{
    b->stored_pos = (int64_t *)(void *)(base + off);
    b->tokens = (uint32_t *)(void *)(base + off + (size_t)b->cap * sizeof(int64_t));
    b->groups = (int32_t *)(void *)(base + off + (size_t)b->cap * 12u);
}

static void account(kvr_block_pool *p, kvr_block *b)
{
    p->bytes -= b->bytes;
    b->bytes = malloc_usable_size(b->data) + malloc_usable_size(b);
    p->bytes += b->bytes;
}

/* A cached block whose data is `len` bytes (taken out of the cache), or NULL. */
static kvr_block *cache_take(kvr_block_pool *p, size_t len)
{
    for (size_t i = p->cache_n; i-- > 0;) {
        kvr_block *b = p->cached[i];
        if (kvr_block_data_len(b) != len)
            continue;
        p->cached[i] = p->cached[--p->cache_n];
        p->cached[p->cache_n] = NULL;
        assert(p->cache_bytes >= b->bytes);
        p->cache_bytes -= b->bytes;
        return b;
    }
    return NULL;
}

/* Keeps a block whose last reference went (release hook run), if the cache
 * has room; false: the caller frees it. */
static bool cache_put(kvr_block_pool *p, kvr_block *b)
{
    if (b->spilled || !b->data || b->disk || p->cache_n >= KVR_BLOCK_CACHE_N ||
        p->cache_bytes + b->bytes > p->cache_max)
        return false;
    p->cached[p->cache_n++] = b;
    p->cache_bytes += b->bytes;
    return true;
}

size_t kvr_block_pool_trim(kvr_block_pool *p)
{
    size_t freed = p->cache_bytes;
    while (p->cache_n > 0) {
        kvr_block *b = p->cached[--p->cache_n];
        p->cached[p->cache_n] = NULL;
        kvr_mem_free(b->data);
        kvr_mem_free(b);
    }
    p->cache_bytes = 0;
    return freed;
}

kvr_block *kvr_block_create(kvr_block_pool *p, const kvr_block_geom *g, uint8_t *data,
                            size_t len, uint32_t used)
{
    assert(g->cap > 0 && used <= g->cap);
    if (!data && p->cache_n > 0) {
        kvr_block *b = cache_take(p, kvr_block_geom_bytes(g));
        if (b) {
            size_t bytes = b->bytes;
            data = b->data;
            if (g->quant)
                qzero_unwritten(data, g);
            *b = (kvr_block){ .refcount = 1, .used = used, .cap = g->cap, .row = g->row,
                              .dtype = g->dtype, .quant = g->quant, .data = data,
                              .pos_lo = 0, .pos_hi = -1, .bytes = bytes };
            set_ptrs(b, data, geom_kv_bytes(g));
            p->n_blocks++;
            p->bytes += bytes;
            return b;
        }
    }
    kvr_block *b = kvr_mem_calloc(1, sizeof *b);
    if (!b)
        return NULL;
    size_t meta;
    if (data) {
        assert(len >= (size_t)g->cap * KVR_BLOCK_META_SLOT);
        meta = len - (size_t)g->cap * KVR_BLOCK_META_SLOT;
    } else {
        meta = geom_kv_bytes(g);
        data = kvr_mem_aligned(KVR_BLOCK_ALIGN, kvr_block_geom_bytes(g));
        if (!data) {
            kvr_mem_free(b);
            return NULL;
        }
        if (g->quant)
            qzero_unwritten(data, g);
    }
    *b = (kvr_block){ .refcount = 1, .used = used, .cap = g->cap, .row = g->row,
                      .dtype = g->dtype, .quant = g->quant, .data = data, .pos_lo = 0,
                      .pos_hi = -1 };
    set_ptrs(b, data, meta);
    b->bytes = malloc_usable_size(b->data) + malloc_usable_size(b);
    p->n_blocks++;
    p->bytes += b->bytes;
    return b;
}

void kvr_block_ref(kvr_block *b)
{
    kvr_block_check(b);
    b->refcount++;
}

void kvr_block_unref(kvr_block_pool *p, kvr_block *b)
{
    if (!b)
        return;
    kvr_block_check(b);
    assert(b->refcount > b->holds);   /* a hold is dropped with unhold */
    if (--b->refcount > 0)
        return;
    if (p->on_release)
        p->on_release(p->release_arg, b);
    assert(p->n_blocks > 0 && p->bytes >= b->bytes);
    p->n_blocks--;
    p->bytes -= b->bytes;
    if (p->cache_max && cache_put(p, b))
        return;
    kvr_mem_free(b->data);
    kvr_mem_free(b);
}

void kvr_block_hold(kvr_block *b)
{
    kvr_block_check(b);
    b->refcount++;
    b->holds++;
}

void kvr_block_hold_to_ref(kvr_block *b)
{
    assert(b->holds > b->leases);
    b->holds--;
    kvr_block_check(b);
}

void kvr_block_unhold(kvr_block_pool *p, kvr_block *b)
{
    kvr_block_hold_to_ref(b);
    kvr_block_unref(p, b);
}

void kvr_block_lease(kvr_block_pool *p, kvr_block *b)
{
    kvr_block_hold(b);
    if (b->leases++ == 0)
        p->n_leased++;
}

void kvr_block_unlease(kvr_block_pool *p, kvr_block *b)
{
    assert(b->leases > 0 && p->n_leased > 0);
    if (--b->leases == 0)
        p->n_leased--;
    kvr_block_unhold(p, b);
}

/* Runs a put's or get's iovecs are built from without a kvr_block_kv per
 * iovec (plain blocks, the common few runs): each run's first slot and
 * stride between slabs once, then one add per iovec. */
#define BRUN_FAST_MAX 8

size_t kvr_brun_iov(const kvr_brun *runs, size_t n, uint32_t n_layers, struct iovec *iov)
{
    size_t k = 0;
    if (n <= BRUN_FAST_MAX) {
        uint8_t *at[BRUN_FAST_MAX];
        size_t slab[BRUN_FAST_MAX], len[BRUN_FAST_MAX];
        bool plain = true;
        for (size_t r = 0; r < n && plain; r++) {
            const kvr_block *b = runs[r].b;
            plain = !b->quant;
            size_t rowb = (size_t)b->row * kvr_dtype_size(b->dtype);
            at[r] = b->data + rowb * runs[r].first;   /* layer 0, K */
            slab[r] = rowb * b->cap;
            len[r] = runs[r].count * rowb;
        }
        if (plain) {
            for (uint32_t l = 0; l < n_layers; l++)
                for (int kv = 0; kv < 2; kv++)
                    for (size_t r = 0; r < n; r++) {
                        iov[k++] = (struct iovec){ at[r], len[r] };
                        at[r] += slab[r];
                    }
            return k;
        }
    }
    for (uint32_t l = 0; l < n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t r = 0; r < n; r++) {
                const kvr_block *b = runs[r].b;
                size_t rowb = (size_t)b->row * kvr_dtype_size(b->dtype);
                iov[k++] = (struct iovec){ kvr_block_kv(b, l, kv, runs[r].first),
                                           runs[r].count * rowb };
            }
    return k;
}

const uint8_t *kvr_brun_fill(const kvr_brun *runs, size_t n, uint32_t layer, int kv,
                             const uint8_t *src, kvr_dtype sdt)
{
    for (size_t r = 0; r < n; r++) {
        const kvr_block *b = runs[r].b;
        assert(!b->quant && runs[r].first >= b->used);
        size_t ne = (size_t)runs[r].count * b->row;
        kvr_convert(kvr_block_kv(b, layer, kv, runs[r].first), b->dtype, src, sdt, ne);
        src += ne * kvr_dtype_size(sdt);
    }
    return src;
}

size_t kvr_block_meta_off(const kvr_block *b)
{
    return (size_t)((const uint8_t *)(const void *)b->stored_pos - b->data);
}

size_t kvr_block_data_len(const kvr_block *b)
{
    return kvr_block_meta_off(b) + (size_t)b->cap * KVR_BLOCK_META_SLOT;
}

size_t kvr_block_spilled_bytes(const kvr_block *b)
{
    return (b->quant ? KVR_QHDR_BYTES : 0) + (size_t)b->cap * KVR_BLOCK_META_SLOT;
}

void kvr_block_set_data(kvr_block_pool *p, kvr_block *b, uint8_t *data, size_t meta_off,
                        bool spilled)
{
    kvr_mem_free(b->data);
    b->data = data;
    set_ptrs(b, data, meta_off);
    b->spilled = spilled;
    account(p, b);
}

void kvr_block_view(const kvr_block *b, kvr_block *view, uint8_t *buf, size_t meta_off)
{
    *view = *b;
    view->data = buf;
    view->spilled = false;
    view->disk = NULL;
    set_ptrs(view, buf, meta_off);
}

void kvr_block_pos_bounds(kvr_block *b, int64_t *lo, int64_t *hi)
{
    for (uint32_t j = b->bounds_used; j < b->used; j++) {
        int64_t q = b->stored_pos[j];
        if (j == 0 || q < b->pos_lo)
            b->pos_lo = q;
        if (j == 0 || q > b->pos_hi)
            b->pos_hi = q;
    }
    if (b->used > b->bounds_used)
        b->bounds_used = b->used;
    *lo = b->pos_lo;
    *hi = b->pos_hi;
}
