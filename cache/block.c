/*
 * block.c — K/V blocks: fixed-size, refcounted slabs holding B token slots
 * for all layers of a model.
 *
 * Layout of block->data (one kvr_mem_aligned allocation, 64-byte aligned):
 *
 *   layer 0: K [B][H][D]  V [B][H][D]
 *   layer 1: K [B][H][D]  V [B][H][D]
 *   ...
 *   stored_pos int64[B] | tokens uint32[B] | groups int32[B]
 *
 * Each K/V slab is B*H*D*dsize bytes; with B a multiple of 16 and dsize >= 2
 * every slab stays 64-byte aligned for the SIMD kernels. Quantized blocks
 * (quant.c) hold encoded slabs instead, keys pre-RoPE. A block is freed
 * when its refcount (extents + leases + open puts) drops to zero.
 */
#include <malloc.h>
#include <string.h>

#include "cache/store_internal.h"

static size_t slab_bytes(const kvr_store *s, const kvr_model *m, kvr_dtype dt)
{
    return (size_t)s->B * m->n_kv_heads * m->head_dim * kvr_dtype_size(dt);
}

/* K/V part, rounded up so the metadata arrays stay aligned. */
static size_t kv_bytes(const kvr_store *s, const kvr_model *m, kvr_dtype dt)
{
    size_t kv = slab_bytes(s, m, dt) * 2u * m->n_layers;
    return (kv + KVR_BLOCK_ALIGN - 1) & ~(size_t)(KVR_BLOCK_ALIGN - 1);
}

size_t block_data_bytes(const kvr_store *s, const kvr_model *m, kvr_dtype dt)
{
    size_t kv = kv_bytes(s, m, dt);
    return kv + (size_t)s->B * (sizeof(int64_t) + sizeof(uint32_t) + sizeof(int32_t));
}

kvr_block *block_new(kvr_store *s, const kvr_model *m, kvr_dtype dt)
{
    kvr_block *b = kvr_mem_calloc(1, sizeof *b);
    if (!b)
        goto fail;
    size_t bytes = block_data_bytes(s, m, dt);
    b->data = kvr_mem_aligned(KVR_BLOCK_ALIGN, bytes);
    if (!b->data)
        goto fail_block;
    size_t kv = kv_bytes(s, m, dt);
    b->stored_pos = (int64_t *)(void *)(b->data + kv);
    b->tokens = (uint32_t *)(void *)(b->data + kv + (size_t)s->B * sizeof(int64_t));
    b->groups = (int32_t *)(void *)(b->data + kv + (size_t)s->B * 12u);
    b->refcount = 1;
    b->used = 0;
    b->cap = s->B;
    b->dtype = dt;
    b->bytes = malloc_usable_size(b->data) + malloc_usable_size(b);
    s->n_blocks++;
    s->block_bytes += b->bytes;
    return b;

fail_block:
    kvr_mem_free(b);
fail:
    return NULL;
}

void block_ref(kvr_block *b)
{
    b->refcount++;
}

void block_unref(kvr_store *s, kvr_block *b)
{
    if (!b || --b->refcount > 0)
        return;
    tier_block_gone(s, b);
    s->n_blocks--;
    s->block_bytes -= b->bytes;
    kvr_mem_free(b->data);
    kvr_mem_free(b);
}

uint8_t *block_kv(const kvr_block *b, const kvr_model *m, uint32_t layer, int kv,
                  uint32_t slot)
{
    if (b->quant) {
        /* quant.c: per layer K slab then V slab; K rows or tiles of ktile. */
        uint8_t *base = b->data + KVR_QHDR_BYTES +
                        (size_t)layer * (QH(b)->kslab + QH(b)->vslab);
        if (kv)
            return base + QH(b)->kslab + QH(b)->vrow * slot;
        return base + QH(b)->krow * (slot / QH(b)->ktile);
    }
    size_t row = (size_t)m->n_kv_heads * m->head_dim * kvr_dtype_size(b->dtype);
    size_t slab = row * b->cap;
    return b->data + slab * (2u * layer + (unsigned)kv) + row * slot;
}
