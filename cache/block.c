/*
 * block.c — the block layer: the one constructor, reference / hold / lease
 * counting, the release hook, data swaps for the disk tier (block.h has
 * the layout and the invariants).
 *
 * Each K/V slab of a plain block is cap*row*dsize bytes; cap a multiple of
 * kvr_block_cap_gran keeps every slab 64-byte aligned for the SIMD kernels
 * (16 slots with dsize >= 2 always do). The metadata is not in the K/V's
 * allocation, and a shape whose layers do not add up to a size class is cut
 * in two (block.h), so a block's K/V is (about) the allocations' size, and
 * what is accounted is what the allocator holds for them
 * (kvr_mem_held: the usable size; kvr_mem_aligned keeps a large block's
 * extra jemalloc page out of memory, mem.c). A block is freed when its last
 * reference goes, never earlier
 * (into the pool's bounded cache of freed blocks when it has one: block.h;
 * a reused block is initialised exactly as a fresh one, its data as
 * uninitialised as kvr_mem_aligned's, a quantized block's unwritten bytes
 * zeroed again for the new fill).
 */
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

/* K/V bytes of one layer (64-byte multiples: slabs of a cap of
 * kvr_block_cap_gran's granularity, quantized slabs padded). */
static size_t geom_layer_bytes(const kvr_block_geom *g)
{
    if (g->quant)
        return g->qh.kslab + g->qh.vslab;
    return align64(2u * (size_t)g->cap * g->row * kvr_dtype_size(g->dtype));
}

/* Bytes of the K/V image: every layer (plus the quantized header). */
static size_t geom_kv_bytes(const kvr_block_geom *g)
{
    return (g->quant ? KVR_QHDR_BYTES : 0) + geom_layer_bytes(g) * g->n_layers;
}

/* Of L layers of `per` bytes after a header of hdr bytes, and `meta`
 * bytes of metadata after them: how many layers go in data (*split) and
 * its bytes. All of them, unless a cut makes the two allocations (data;
 * the later layers with the metadata) at least 1% smaller as size classes:
 * 36 layers of 64 KiB are 2 MiB + (256 KiB + metadata), not a 2.5 MiB
 * class. The same inputs always give the same cut (disk recovery relies
 * on it). */
/* The size classes the cut is chosen by: jemalloc's own, and in a build
 * on libc malloc (make check) the same spacing computed (four classes per
 * doubling: 8 MiB + 1 KiB is a 10 MiB class), so a sanitizer build cuts
 * blocks exactly where a release build does and checks those paths too. */
static size_t cut_class(size_t n)
{
#ifdef KVR_JEMALLOC
    return kvr_mem_size_class(n);
#else
    if (n <= 16)
        return 16;
    unsigned lg = 63u - (unsigned)__builtin_clzll((unsigned long long)(n - 1));
    size_t delta = (size_t)1 << (lg >= 4 ? lg - 2 : 2);
    return (n + delta - 1) & ~(delta - 1);
#endif
}

static size_t split_at(size_t hdr, size_t per, uint32_t L, size_t meta, uint32_t *split)
{
    size_t whole = cut_class(hdr + per * L) + cut_class(meta);
    size_t best = whole;
    uint32_t a = L;
    for (uint32_t k = 1; k < L; k++) {
        size_t c = cut_class(hdr + per * k) + cut_class(per * (L - k) + meta);
        if (c < best) {
            best = c;
            a = k;
        }
    }
    if ((whole - best) * 100 < whole)
        a = L;
    *split = a;
    return hdr + per * a;
}

size_t kvr_block_split(bool quant, size_t kv_len, uint32_t n_layers, uint32_t cap)
{
    size_t hdr = quant ? KVR_QHDR_BYTES : 0;
    uint32_t split;
    assert(kv_len >= hdr && n_layers > 0);
    return split_at(hdr, (kv_len - hdr) / n_layers, n_layers,
                    (size_t)cap * KVR_BLOCK_META_SLOT, &split);
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
    size_t kv = geom_kv_bytes(g), meta = (size_t)g->cap * KVR_BLOCK_META_SLOT;
    uint32_t split;
    size_t head = split_at(g->quant ? KVR_QHDR_BYTES : 0, geom_layer_bytes(g), g->n_layers,
                           meta, &split);
    return kvr_mem_size_class(head) + kvr_mem_size_class(kv - head + meta) +
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
static void qzero_unwritten(kvr_block *b, const kvr_block_geom *g)
{
    const kvr_qhdr *h = &g->qh;
    assert(g->fill <= g->cap);
    memset(b->data, 0, KVR_QHDR_BYTES);
    memcpy(b->data, h, sizeof *h);
    size_t kw = h->ktile > 1 ? (size_t)((g->fill + h->ktile - 1) / h->ktile) * h->krow
                             : (size_t)g->fill * h->krow;
    size_t vw = (size_t)g->fill * h->vrow;
    assert(kw <= h->kslab && vw <= h->vslab);
    for (uint32_t l = 0; l < g->n_layers; l++) {
        uint8_t *p = kvr_block_layer(b, l);
        memset(p + kw, 0, h->kslab - kw);
        memset(p + h->kslab + vw, 0, h->vslab - vw);
    }
}

/* The metadata: after the later layers in tail (only it while spilled). */
static void set_ptrs(kvr_block *b)
{
    uint8_t *meta = b->tail + (b->spilled ? 0 : b->kv_len - b->head_len);
    b->stored_pos = (int64_t *)(void *)meta;
    b->tokens = (uint32_t *)(void *)(meta + (size_t)b->cap * sizeof(int64_t));
    b->groups = (int32_t *)(void *)(meta + (size_t)b->cap * 12u);
}

static size_t held_bytes(const kvr_block *b)
{
    return kvr_mem_held(b->data) + kvr_mem_held(b->tail) + kvr_mem_held(b);
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
    kvr_mem_free(b->tail);
    kvr_mem_free(b);
}

/* A cached block whose two allocations are this block's (taken out of the
 * cache), or NULL: the same K/V length, cut at the same place (head bytes
 * in data; the rest with cap slots of metadata in tail). The K/V length
 * alone is not enough: 18 layers of 256-dim rows and 36 of 128 have the
 * same length but different cuts, and a block laid out by the other cut
 * writes past its data or its tail. */
static kvr_block *cache_take(kvr_block_pool *p, size_t len, size_t head, uint32_t cap)
{
    for (size_t i = p->cache_n; i-- > 0;) {
        kvr_block *b = p->cached[i];
        if (b->kv_len != len || b->head_len != head || b->cap != cap)
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
                            size_t len, uint8_t *tail, uint32_t used)
{
    assert(g->cap > 0 && used <= g->cap && !data == !tail && g->n_layers > 0);
    /* A slab of cap rows is 64-byte aligned when cap is a multiple of
     * kvr_block_cap_gran (partial blocks are: kvr_block_fit_cap); a full
     * block of a store whose block_tokens is not (tiny rows) need not be:
     * no kernel requires aligned slabs, alignment only helps them. */
    assert(g->tenant < KVR_BLOCK_TENANTS);
    bool fresh = !data;
    size_t kv = data ? len : geom_kv_bytes(g), hdr = g->quant ? KVR_QHDR_BYTES : 0;
    size_t meta = (size_t)g->cap * KVR_BLOCK_META_SLOT, per = (kv - hdr) / g->n_layers;
    uint32_t split;
    size_t head = split_at(hdr, per, g->n_layers, meta, &split);
    kvr_block *b = fresh && p->cache_n > 0 ? cache_take(p, kv, head, g->cap) : NULL;
    size_t bytes = 0;
    if (b) {
        bytes = b->bytes;
        data = b->data;
        tail = b->tail;
    } else {
        if (!(b = kvr_mem_calloc(1, sizeof *b)))
            return NULL;
        if (fresh) {
            data = kvr_mem_aligned(KVR_BLOCK_ALIGN, head);
            tail = kvr_mem_aligned(KVR_BLOCK_ALIGN, kv - head + meta);
            if (!data || !tail) {
                kvr_mem_free(data);
                kvr_mem_free(tail);
                kvr_mem_free(b);
                return NULL;
            }
        }
    }
    *b = (kvr_block){ .refcount = 1, .used = used, .cap = g->cap, .row = g->row,
                      .n_layers = g->n_layers, .tenant = g->tenant, .dtype = g->dtype,
                      .quant = g->quant, .data = data, .tail = tail, .kv_len = kv,
                      .head_len = head, .layer_bytes = per, .split = split, .pos_lo = 0,
                      .pos_hi = -1, .bytes = bytes };
    set_ptrs(b);
    if (fresh && g->quant)
        qzero_unwritten(b, g);
    if (!bytes)
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
    size_t meta = (size_t)cap * KVR_BLOCK_META_SLOT;
    kvr_block nb = *b;
    nb.cap = cap;
    nb.kv_len = geom_kv_bytes(&g);
    nb.layer_bytes = geom_layer_bytes(&g);
    nb.head_len = split_at(0, nb.layer_bytes, n_layers, meta, &nb.split);
    nb.data = kvr_mem_aligned(KVR_BLOCK_ALIGN, nb.head_len);
    nb.tail = kvr_mem_aligned(KVR_BLOCK_ALIGN, nb.kv_len - nb.head_len + meta);
    if (!nb.data || !nb.tail) {
        kvr_mem_free(nb.data);
        kvr_mem_free(nb.tail);
        return KVR_ENOMEM;
    }
    set_ptrs(&nb);
    /* Slabs move to the new stride; slots below used keep their bytes. */
    size_t rowb = (size_t)b->row * kvr_dtype_size(b->dtype);
    for (uint32_t l = 0; l < n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            memcpy(kvr_block_kv(&nb, l, kv, 0), kvr_block_kv(b, l, kv, 0), rowb * b->used);
    memcpy(nb.stored_pos, b->stored_pos, (size_t)b->used * sizeof(int64_t));
    memcpy(nb.tokens, b->tokens, (size_t)b->used * sizeof(uint32_t));
    memcpy(nb.groups, b->groups, (size_t)b->used * sizeof(int32_t));
    kvr_mem_free(b->data);
    kvr_mem_free(b->tail);
    *b = nb;
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
            plain = !b->quant && b->split == b->n_layers;   /* one stride throughout */
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

size_t kvr_block_tail_len(const kvr_block *b)
{
    return b->kv_len - b->head_len + kvr_block_meta_len(b);
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

void kvr_block_set_data(kvr_block_pool *p, kvr_block *b, uint8_t *data, uint8_t *tail,
                        bool spilled)
{
    kvr_mem_free(b->data);
    kvr_mem_free(b->tail);
    b->data = data;
    b->tail = tail;
    b->spilled = spilled;
    set_ptrs(b);
    account(p, b);
}

void kvr_block_view(const kvr_block *b, kvr_block *view, uint8_t *buf, uint8_t *tail)
{
    *view = *b;
    view->data = buf;
    view->tail = tail;
    view->spilled = false;
    view->disk = NULL;
    set_ptrs(view);
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
