/*
 * block.h — the block layer of cache/ (private): fixed-size, reference
 * counted slabs holding `cap` token slots for every layer of a model, and
 * the pool that accounts them. This is the bottom of the store; it calls
 * nothing but the allocator, and learns that a block goes through the
 * pool's release hook (the disk tier's, which owns `disk`).
 *
 * A block is two allocations, so that what the allocator holds is what the
 * K/V needs (a 64-token f16 block of Llama-3-8B is 8 MiB; with its 1 KiB of
 * metadata in the same allocation jemalloc made it a 10 MiB size class):
 *
 *   data (kvr_mem_aligned, 64-byte aligned, head_len bytes): layers [0, split)
 *     plain:  layer 0: K [cap][row] V [cap][row] | layer 1: ...
 *     quant:  kvr_qhdr (KVR_QHDR_BYTES) | layer 0: K slab, V slab | ...
 *   tail (kvr_mem_aligned): layers [split, n_layers) as above, then the
 *     metadata: stored_pos int64[cap] | tokens uint32[cap] | groups int32[cap]
 *
 * Every layer is layer_bytes (64-byte multiples). split is n_layers unless
 * cutting the layers in two lands both allocations closer to jemalloc's
 * size classes (kvr_block_split: 36 layers of 64 KiB are 2 MiB + 256 KiB
 * and the metadata, not a 2.5 MiB class). The block's image on disk (a
 * spill extent, kvr_disk_buf's two parts) is data then tail: every layer's
 * K/V in order, then the metadata, as when it was one buffer. A spilled
 * block keeps its metadata (tail then holds only it) and, quantized, its
 * header (data then holds only the header; plain: data is NULL);
 * kvr_block_set_data swaps both either way.
 * `cap` is any slot count (a context's last block is sized to its tokens,
 * kvr_block_fit_cap), so a block's slabs stay 64-byte aligned for the SIMD
 * kernels by kvr_block_cap_gran.
 *
 * Invariants (checked with assert):
 *  - refcount >= holds >= leases. refcount counts extents, holds and the
 *    owners of fresh blocks; holds are the references that keep the block's
 *    data in memory (open puts, persist batches, leases); leases are
 *    readers' (get / assemble) holds, counted in the pool.
 *  - Slots below `used` never change; metadata is written only into slots
 *    at or above `used` of a block nobody else reads (kvr_block_set_meta),
 *    and kvr_block_commit only moves `used` forward.
 *  - Fields are written only here (and `disk` by the release hook's owner,
 *    `mark`/`mcount` by whole-store scans); the layers above read them.
 */
#ifndef KVR_CACHE_BLOCK_H
#define KVR_CACHE_BLOCK_H

#include <assert.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "cache/cache.h"
#include "cache/codec.h"

#pragma GCC visibility push(hidden)

#define KVR_BLOCK_ALIGN 64u
#define KVR_QHDR_BYTES 128u
/* Bytes of per-slot metadata: stored_pos, token id, group id. */
#define KVR_BLOCK_META_SLOT 16u

typedef struct kvr_block kvr_block;

/* Header of a quantized block, in the first KVR_QHDR_BYTES of its data (so
 * plain blocks keep their small struct). */
typedef struct kvr_qhdr {
    kvr_codec kc, vc;
    uint32_t  ktile;        /* 1 = K rows; else K tile tokens (cap % ktile == 0) */
    size_t    krow, vrow, kslab, vslab;
} kvr_qhdr;
#define KVR_QH(b) ((const kvr_qhdr *)(const void *)(b)->data)

struct kvr_block {
    uint32_t  refcount;
    uint32_t  holds;        /* part of refcount */
    uint32_t  leases;       /* part of holds */
    uint32_t  mark, mcount; /* scratch for whole-store scans (epoch, count) */
    uint32_t  used;         /* committed slots (a prefix of the block) */
    uint32_t  cap;          /* slots */
    uint32_t  row;          /* values per K or V row (kv_heads * head_dim) */
    uint32_t  n_layers;
    uint16_t  tenant;       /* whose bytes (kvr_block_pool.tenant_bytes) */
    kvr_dtype dtype;        /* plain blocks: storage dtype; quant: window dtype */
    /* Quantized: the header at the start of data; keys are stored
     * UN-ROTATED (pre-RoPE), so stored_pos is metadata only. */
    bool      quant;
    bool      spilled;      /* data holds only the header and metadata */
    size_t    bytes;        /* accounted bytes (data + tail + struct) */
    size_t    kv_len;       /* bytes of the K/V image (header included) */
    size_t    head_len;     /* of which in data: header + split layers */
    size_t    layer_bytes;  /* K/V bytes of one layer */
    uint32_t  split;        /* layers in data; the others lead tail */
    uint8_t  *data;
    uint8_t  *tail;         /* later layers (not while spilled), metadata */
    int64_t  *stored_pos;   /* [cap], inside tail */
    uint32_t *tokens;       /* [cap], inside tail */
    int32_t  *groups;       /* [cap], inside tail */
    /* Bounds of stored_pos over slots [0, bounds_used), kept lazily. */
    int64_t   pos_lo, pos_hi;
    uint32_t  bounds_used;
    /* The disk tier's copy (NULL: none); the release hook frees it. */
    struct kvr_block_disk *disk;
};

/* Geometry of a block: kvr_block_geom_plain, or quant.c for a codec. */
typedef struct kvr_block_geom {
    uint32_t  cap, row, n_layers;
    kvr_dtype dtype;
    bool      quant;
    kvr_qhdr  qh;           /* quant only */
    /* Quantized, fresh (data NULL): slots [0, fill) are written whole by
     * the creator before anything reads or spills the block (a put's new
     * blocks: every K tile / row and V row of those slots, all layers);
     * kvr_block_create zeroes only the other K/V bytes (later slots, partial
     * tiles' remainder, slab padding). 0: every K/V byte is zeroed. */
    uint32_t  fill;
    uint16_t  tenant;       /* < KVR_BLOCK_TENANTS; 0: nobody's in particular */
} kvr_block_geom;

/* Tenants a pool counts bytes for (the store's models, kvr_model.tenant). */
#define KVR_BLOCK_TENANTS 64

/* Freed blocks a pool keeps for reuse at most (kvr_block_pool.cached). */
#define KVR_BLOCK_CACHE_N 8

/* Accounting of every live block of a store, and the release hook.
 *
 * The block cache: a freed in-memory block (its data and its struct) is
 * kept in `cached` instead of going back to the allocator while fewer than
 * KVR_BLOCK_CACHE_N are kept and their bytes stay within cache_max (0: no
 * cache, the default). kvr_block_create takes one of the same data length
 * (the same geometry) first: a put that replaces a context gets the block
 * the previous replacement freed, warm in the CPU's cache and already
 * faulted in, without an allocation and a free. A cached block is no
 * longer a block: it is out of n_blocks and bytes (the live blocks, what
 * the metrics report as block bytes) and in cache_n / cache_bytes; its
 * memory stays in kvr_mem_allocated() (it is allocated), so the memory cap
 * counts it, and the store drops the cache before anything else once at
 * the cap (kvr_store_reserve), at the daemon's idle purge and at destroy
 * (kvr_block_pool_trim). Only the store's thread touches a pool. */
typedef struct kvr_block_pool {
    size_t n_blocks, bytes, n_leased;
    /* bytes of live blocks by tenant (the sum over tenants is bytes) */
    size_t tenant_bytes[KVR_BLOCK_TENANTS];
    /* Called once per block, on its last reference, before it is freed. */
    void (*on_release)(void *arg, kvr_block *b);
    void  *release_arg;
    size_t cache_max, cache_n, cache_bytes;
    kvr_block *cached[KVR_BLOCK_CACHE_N];
} kvr_block_pool;

/* Frees every cached block (above); returns the bytes given back. */
size_t kvr_block_pool_trim(kvr_block_pool *p);

void   kvr_block_geom_plain(kvr_block_geom *g, uint32_t cap, uint32_t n_layers,
                            uint32_t row, kvr_dtype dt);
/* Bytes of a block's image (K/V, header, metadata: a disk extent). */
size_t kvr_block_geom_bytes(const kvr_block_geom *g);
/* Bytes of its K/V allocation (with a quantized block's header). */
size_t kvr_block_geom_kv_bytes(const kvr_block_geom *g);
/* What the allocator really holds for such a block: the size classes of
 * its K/V, its metadata and its struct (a request's reservation). */
size_t kvr_block_geom_alloc(const kvr_block_geom *g);
/* Plain blocks: cap granularity that keeps every slab 64-byte aligned. */
uint32_t kvr_block_cap_gran(uint32_t row, kvr_dtype dt);
/* Plain geometry g (its cap the most, B): the cap of a block for `want`
 * tokens (1 <= want <= g->cap): want rounded up to the granularity, then
 * as many more slots as the K/V allocation's size class holds anyway
 * (never over g->cap). */
uint32_t kvr_block_fit_cap(const kvr_block_geom *g, uint32_t want);

/* Where an image of kv_len bytes of K/V (a quantized one with its header)
 * for n_layers layers is cut between data and tail: the bytes in data. */
size_t kvr_block_split(bool quant, size_t kv_len, uint32_t n_layers, uint32_t cap);

/* The one constructor. data NULL: a fresh, empty block (used 0). Else the
 * block adopts `data` and `tail` (kvr_mem_aligned, an image of `len` bytes
 * of K/V cut where kvr_block_split says, then the metadata; a quantized
 * block's header already in it) with `used` committed slots (disk
 * recovery). Returns the block with one reference (the caller's), or NULL
 * (ENOMEM; adopted buffers are not freed then). */
kvr_block *kvr_block_create(kvr_block_pool *p, const kvr_block_geom *g, uint8_t *data,
                            size_t len, uint8_t *tail, uint32_t used);
/* Gives an exclusively owned (refcount 1, unheld) plain block in memory
 * with no disk copy `cap` slots (>= used, a multiple of
 * kvr_block_cap_gran), keeping its committed slots: the growth of a
 * context's last block as tokens arrive. 0, KVR_EINVAL (not such a block)
 * or KVR_ENOMEM; the block is unchanged on error. */
int kvr_block_resize(kvr_block_pool *p, kvr_block *b, uint32_t n_layers, uint32_t cap);

static inline void kvr_block_check(const kvr_block *b)
{
    assert(b->refcount >= b->holds && b->holds >= b->leases);
    assert(b->used <= b->cap);
    (void)b;
}

void kvr_block_ref(kvr_block *b);
/* Drops one reference; the last one runs the release hook and frees. NULL ok. */
void kvr_block_unref(kvr_block_pool *p, kvr_block *b);
/* A reference that keeps the data in memory (open puts, persist batches). */
void kvr_block_hold(kvr_block *b);
void kvr_block_unhold(kvr_block_pool *p, kvr_block *b);
/* Turns a hold back into a plain reference (a put's commit hands it to an
 * extent). */
void kvr_block_hold_to_ref(kvr_block *b);
/* A reader's hold (get / assemble), counted in the pool's n_leased. */
void kvr_block_lease(kvr_block_pool *p, kvr_block *b);
void kvr_block_unlease(kvr_block_pool *p, kvr_block *b);
/* Only the caller's reference: nobody else can see the block. */
static inline bool kvr_block_exclusive(const kvr_block *b)
{
    return b->refcount == 1;
}

/* The K/V of one layer (in data or in tail). */
static inline uint8_t *kvr_block_layer(const kvr_block *b, uint32_t layer)
{
    if (layer < b->split)
        return b->data + (b->quant ? KVR_QHDR_BYTES : 0) + (size_t)layer * b->layer_bytes;
    return b->tail + (size_t)(layer - b->split) * b->layer_bytes;
}

/* K (kv 0) or V (kv 1) of `layer` at `slot` (for K tiles: of its tile). */
static inline uint8_t *kvr_block_kv(const kvr_block *b, uint32_t layer, int kv, uint32_t slot)
{
    uint8_t *base = kvr_block_layer(b, layer);
    if (b->quant) {
        const kvr_qhdr *h = KVR_QH(b);
        if (kv)
            return base + h->kslab + h->vrow * slot;
        return base + h->krow * (slot / h->ktile);
    }
    size_t rowb = (size_t)b->row * kvr_dtype_size(b->dtype);
    return base + rowb * b->cap * (unsigned)kv + rowb * slot;
}

/* Metadata of a not yet committed slot (slot >= used). */
static inline void kvr_block_set_meta(kvr_block *b, uint32_t slot, uint32_t token,
                                      int64_t pos, int32_t group)
{
    assert(slot >= b->used && slot < b->cap);
    b->tokens[slot] = token;
    b->stored_pos[slot] = pos;
    b->groups[slot] = group;
}

/* Makes slots [0, used) visible (used only grows). */
static inline void kvr_block_commit(kvr_block *b, uint32_t used)
{
    assert(used >= b->used && used <= b->cap);
    b->used = used;
}

/* A run of consecutive slots of one block (a write's destination). */
typedef struct kvr_brun {
    kvr_block *b;
    uint32_t   first, count;
} kvr_brun;

/* Zero-copy iovecs for a payload [layer][K, V][the runs' tokens back to
 * back] written straight into the runs' slots (in their storage dtype);
 * iov holds 2 * n_layers * n. Returns the count. */
size_t kvr_brun_iov(const kvr_brun *runs, size_t n, uint32_t n_layers, struct iovec *iov);
/* Converts one layer side of such a payload from src (dtype sdt) into the
 * runs' slots; returns src advanced past it. */
const uint8_t *kvr_brun_fill(const kvr_brun *runs, size_t n, uint32_t layer, int kv,
                             const uint8_t *src, kvr_dtype sdt);

/* Bytes of the metadata; of the whole image (K/V, then metadata). */
size_t kvr_block_meta_len(const kvr_block *b);
size_t kvr_block_data_len(const kvr_block *b);
/* Bytes a spilled block keeps in memory (header + metadata). */
size_t kvr_block_spilled_bytes(const kvr_block *b);
/* K/V bytes the block's committed tokens need: what a cap "holds". */
size_t kvr_block_held_bytes(const kvr_block *b);

/* Bytes of tail when in memory (later layers and metadata). */
size_t kvr_block_tail_len(const kvr_block *b);
/* Replaces b's data and tail (the old buffers are freed) and re-accounts
 * them. In memory: data of head_len bytes, tail of kvr_block_tail_len.
 * Spilled: data holds only the quantized header (plain: NULL), tail only
 * the metadata. */
void kvr_block_set_data(kvr_block_pool *p, kvr_block *b, uint8_t *data, uint8_t *tail,
                        bool spilled);
/* A read-only copy of b's fields reading from `buf` (head_len bytes) and
 * `tail` (kvr_block_tail_len bytes, its metadata filled by the caller): the
 * disk tier's reload view. */
void kvr_block_view(const kvr_block *b, kvr_block *view, uint8_t *buf, uint8_t *tail);

/* Bounds of stored_pos over the committed slots (cached; slots below used
 * never change). */
void kvr_block_pos_bounds(kvr_block *b, int64_t *lo, int64_t *hi);

#pragma GCC visibility pop

#endif /* KVR_CACHE_BLOCK_H */
