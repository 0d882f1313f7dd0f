/*
 * block.c — the block layer: the one constructor, reference / hold / lease
 * counting, the release hook, data swaps for the disk tier (block.h has
 * the layout and the invariants).
 *
 * Each K/V slab of a plain block is cap*row*dsize bytes; cap a multiple of
 * kvr_block_cap_gran keeps every slab 64-byte aligned for the SIMD kernels
 * (16 slots with dsize >= 2 always do). The K/V allocation and the
 * metadata allocation are separate (block.h), so a 2^k-byte K/V slab set
 * is one 2^k-byte allocation, and what is accounted is what the allocator
 * holds for both (malloc_usable_size). A block is freed when its last
 * reference goes, never earlier
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

/* Bytes of the K/V allocation: K/V slabs (plus the quantized header). */
static size_t geom_kv_bytes(const kvr_block_geom *g)
{
    if (g->quant)
        return KVR_QHDR_BYTES + (g->qh.kslab + g->qh.vslab) * g->n_layers;
    size_t slab = (size_t)g->cap * g->row * kvr_dtype_size(g->dtype);
    return align64(slab * 2u * g->n_layers);
}

size_t kvr_block_geom_kv_bytes(const kvr_block_geom *g)
{
    return geom_kv_bytes(g);
}

size_t kvr_block_geom_bytes(const kvr_block_geom *g)
{
    return geom_kv_bytes(g) + (size_t)g->cap * KVR_BLOCK_META_SLOT;
}

size_t kvr_block_geom_alloc(const kvr_block_geom *g)
{
    return kvr_mem_size_class(geom_kv_bytes(g)) +
           kvr_mem_size_class((size_t)g->cap * KVR_BLOCK_META_SLOT) +
           kvr_mem_size_class(sizeof(kvr_block));
}

uint32_t kvr_block_cap_gran(uint32_t row, kvr_dtype dt)
{
    size_t rowb = (size_t)row * kvr_dtype_size(dt);
    uint32_t g = 1;
    while ((rowb * g) % KVR_BLOCK_ALIGN && g < KVR_BLOCK_ALIGN)
        g *= 2;
    return g;
}

uint32_t kvr_block_fit_cap(const kvr_block_geom *g, uint32_t want)
{
    assert(!g->quant && want >= 1);
    uint32_t gran = kvr_block_cap_gran(g->row, g->dtype), B = g->cap;
    if (want >= B)
        return B;
    uint32_t cap = (want + gran - 1) / gran * gran;
    if (cap >= B)
        return B;
    /* The slots the size class holds anyway: per slot, 2 * n_layers rows. */
    size_t per = 2u * (size_t)g->n_layers * g->row * kvr_dtype_size(g->dtype);
    kvr_block_geom t = *g;
    t.cap = cap;
    size_t cls = kvr_mem_size_class(geom_kv_bytes(&t));
    uint32_t more = (uint32_t)((cls / per) / gran * gran);
    if (more > cap) {
        t.cap = more < B ? more : B;
        if (geom_kv_bytes(&t) <= cls)
            cap = t.cap;
    }
    return cap;
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

static void set_ptrs(kvr_block *b, uint8_t *meta)
{
    b->meta = meta;
    b->stored_pos = (int64_t *)(void *)meta;
    b->tokens = (uint32_t *)(void *)(meta + (size_t)b->cap * sizeof(int64_t));
    b->groups = (int32_t *)(void *)(meta + (size_t)b->cap * 12u);
}

static size_t held_bytes(const kvr_block *b)
{
    return (b->data ? malloc_usable_size(b->data) : 0) + malloc_usable_size(b->meta) +
           malloc_usable_size((void *)(uintptr_t)b);
}

/* The pool's totals (and b's tenant's) gain or lose b's bytes. */
static void pool_add(kvr_block_pool *p, const kvr_block *b)
{
    p->bytes += b->bytes;
    p->tenant_bytes[b->tenant] += b->bytes;
}

static void pool_sub(kvr_block_pool *p, const kvr_block *b)
{
    assert(p->bytes >= b->bytes && p->tenant_bytes[b->tenant] >= b->bytes);
    p->bytes -= b->bytes;
    p->tenant_bytes[b->tenant] -= b->bytes;
}

static void account(kvr_block_pool *p, kvr_block *b)
{
    pool_sub(p, b);
    b->bytes = held_bytes(b);
    pool_add(p, b);
}

static void free_block(kvr_block *b)
{
    kvr_mem_free(b->data);
    kvr_mem_free(b->meta);
    kvr_mem_free(b);
}

/* A cached block of this K/V length and cap (taken out of the cache), or NULL. */
static kvr_block *cache_take(kvr_block_pool *p, size_t len, uint32_t cap)
{
    for (size_t i = p->cache_n; i-- > 0;) {
        kvr_block *b = p->cached[i];
        if (b->kv_len != len || b->cap != cap)
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
        free_block(b);
    }
    p->cache_bytes = 0;
    return freed;
}

kvr_block *kvr_block_create(kvr_block_pool *p, const kvr_block_geom *g, uint8_t *data,
                            size_t len, uint8_t *meta, uint32_t used)
{
    assert(g->cap > 0 && used <= g->cap && !data == !meta);
    assert(g->quant || ((size_t)g->cap * g->row * kvr_dtype_size(g->dtype)) %
                       KVR_BLOCK_ALIGN == 0);
    size_t kv = data ? len : geom_kv_bytes(g);
    if (!data && p->cache_n > 0) {
        kvr_block *b = cache_take(p, kv, g->cap);
        if (b) {
            size_t bytes = b->bytes;
            data = b->data;
            meta = b->meta;
            if (g->quant)
                qzero_unwritten(data, g);
            *b = (kvr_block){ .refcount = 1, .used = used, .cap = g->cap, .row = g->row,
                              .n_layers = g->n_layers, .tenant = g->tenant,
                              .dtype = g->dtype, .quant = g->quant, .data = data,
                              .kv_len = kv, .pos_lo = 0, .pos_hi = -1, .bytes = bytes };
            set_ptrs(b, meta);
            p->n_blocks++;
            pool_add(p, b);
            return b;
        }
    }
    kvr_block *b = kvr_mem_calloc(1, sizeof *b);
    if (!b)
        return NULL;
    if (!data) {
        data = kvr_mem_aligned(KVR_BLOCK_ALIGN, kv);
        meta = kvr_mem_malloc((size_t)g->cap * KVR_BLOCK_META_SLOT);
        if (!data || !meta) {
            kvr_mem_free(data);
            kvr_mem_free(meta);
            kvr_mem_free(b);
            return NULL;
        }
        if (g->quant)
            qzero_unwritten(data, g);
    }
    assert(g->tenant < KVR_BLOCK_TENANTS);
    *b = (kvr_block){ .refcount = 1, .used = used, .cap = g->cap, .row = g->row,
                      .n_layers = g->n_layers, .tenant = g->tenant, .dtype = g->dtype,
                      .quant = g->quant, .data = data, .kv_len = kv, .pos_lo = 0,
                      .pos_hi = -1 };
    set_ptrs(b, meta);
    b->bytes = held_bytes(b);
    p->n_blocks++;
    pool_add(p, b);
    return b;
}

int kvr_block_resize(kvr_block_pool *p, kvr_block *b, uint32_t n_layers, uint32_t cap)
{
    assert(b->n_layers == n_layers && cap >= b->used);
    if (cap == b->cap)
        return 0;
    /* Anyone else's view (a reader, a disk image of the old cap) forbids it. */
    if (b->quant || b->spilled || b->disk || b->holds || b->refcount != 1)
        return KVR_EINVAL;
    kvr_block_geom g;
    kvr_block_geom_plain(&g, cap, n_layers, b->row, b->dtype);
    size_t rowb = (size_t)b->row * kvr_dtype_size(b->dtype);
    assert((rowb * cap) % KVR_BLOCK_ALIGN == 0);
    uint8_t *data = kvr_mem_aligned(KVR_BLOCK_ALIGN, geom_kv_bytes(&g));
    uint8_t *meta = kvr_mem_malloc((size_t)cap * KVR_BLOCK_META_SLOT);
    if (!data || !meta) {
        kvr_mem_free(data);
        kvr_mem_free(meta);
        return KVR_ENOMEM;
    }
    /* Slabs move to the new stride; slots below used keep their bytes. */
    for (uint32_t s = 0; s < 2u * n_layers; s++)
        memcpy(data + rowb * cap * s, b->data + rowb * b->cap * s, rowb * b->used);
    memcpy(meta, b->stored_pos, (size_t)b->used * sizeof(int64_t));
    memcpy(meta + (size_t)cap * sizeof(int64_t), b->tokens, (size_t)b->used * sizeof(uint32_t));
    memcpy(meta + (size_t)cap * 12u, b->groups, (size_t)b->used * sizeof(int32_t));
    kvr_mem_free(b->data);
    kvr_mem_free(b->meta);
    b->data = data;
    b->cap = cap;
    b->kv_len = geom_kv_bytes(&g);
    set_ptrs(b, meta);
    account(p, b);
    return 0;
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
    assert(p->n_blocks > 0);
    p->n_blocks--;
    pool_sub(p, b);
    if (p->cache_max && cache_put(p, b))
        return;
    free_block(b);
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

size_t kvr_block_meta_len(const kvr_block *b)
{
    return (size_t)b->cap * KVR_BLOCK_META_SLOT;
}

size_t kvr_block_data_len(const kvr_block *b)
{
    return b->kv_len + kvr_block_meta_len(b);
}

size_t kvr_block_held_bytes(const kvr_block *b)
{
    if (!b->quant)
        return 2u * (size_t)b->n_layers * b->used * b->row * kvr_dtype_size(b->dtype);
    const kvr_qhdr *h = KVR_QH(b);
    /* K tiles: their share of a tile per token. */
    double k = (double)h->krow * b->used / h->ktile;
    return (size_t)((k + (double)h->vrow * b->used) * b->n_layers);
}

size_t kvr_block_spilled_bytes(const kvr_block *b)
{
    return (b->quant ? KVR_QHDR_BYTES : 0) + (size_t)b->cap * KVR_BLOCK_META_SLOT;
}

void kvr_block_set_data(kvr_block_pool *p, kvr_block *b, uint8_t *data, bool spilled)
{
    kvr_mem_free(b->data);
    b->data = data;
    b->spilled = spilled;
    account(p, b);
}

void kvr_block_view(const kvr_block *b, kvr_block *view, uint8_t *buf)
{
    *view = *b;
    view->data = buf;
    view->spilled = false;
    view->disk = NULL;
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
