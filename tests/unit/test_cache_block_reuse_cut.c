/*
 * test_cache_block_reuse_cut.c — the pool's cache of freed blocks
 * (cache/block.h) hands a block back only to a geometry with the same two
 * allocations: the same K/V length is not enough, since a block may be cut
 * in two (data: the first layers; tail: the later ones and the metadata)
 * and two shapes of one length (18 layers of 256-dim rows, 36 of 128) can
 * be cut at different layers. A reused block laid out by the other cut
 * wrote past its data or its tail (heap corruption that jemalloc showed as
 * a crash in posix_memalign much later: test_rope_configs.py's gemma-2b
 * followed by qwen2.5-3b-yarn).
 *
 * Invariant checked: every block kvr_block_create returns, fresh or
 * reused, has data holding its head bytes and tail holding the rest of
 * its K/V plus cap slots of metadata; and writing all of it is clean
 * (the sanitizer build checks the bytes).
 */
#include <criterion/criterion.h>
#include <malloc.h>
#include <string.h>

#include "cache/cache.h"
#include "cache/block.h"

static void check_fits(const kvr_block *b)
{
    size_t meta = (size_t)b->cap * KVR_BLOCK_META_SLOT;
    cr_assert_geq(malloc_usable_size(b->data), b->head_len,
                  "data holds %zu bytes, its layers need %zu (%u layers, split %u)",
                  malloc_usable_size(b->data), b->head_len, b->n_layers, b->split);
    cr_assert_geq(malloc_usable_size(b->tail), b->kv_len - b->head_len + meta,
                  "tail holds %zu bytes, its layers and metadata need %zu (%u layers, "
                  "split %u)", malloc_usable_size(b->tail), b->kv_len - b->head_len + meta,
                  b->n_layers, b->split);
}

/* Every K/V byte and every slot's metadata written. */
static void fill(kvr_block *b)
{
    size_t rowb = (size_t)b->row * kvr_dtype_size(b->dtype);
    for (uint32_t l = 0; l < b->n_layers; l++)
        memset(kvr_block_layer(b, l), 0x5a, 2 * rowb * b->cap);
    for (uint32_t s = 0; s < b->cap; s++)
        kvr_block_set_meta(b, s, s, s, 0);
}

Test(block_reuse_cut, same_length_other_cut_gets_its_own_allocations)
{
    static const uint32_t caps[] = { 16, 32, 64, 128, 256 };
    /* { layers, row } of two shapes of one K/V length */
    static const uint32_t shapes[][4] = { { 18, 256, 36, 128 }, { 36, 128, 18, 256 },
                                          { 12, 512, 48, 128 }, { 24, 256, 32, 192 } };
    size_t cuts_differ = 0;
    for (size_t ci = 0; ci < sizeof caps / sizeof *caps; ci++) {
        for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
            uint32_t la = shapes[si][0], ra = shapes[si][1];
            uint32_t lb = shapes[si][2], rb = shapes[si][3];
            kvr_block_pool p = { .cache_max = (size_t)1 << 30 };
            kvr_block_geom ga, gb;
            kvr_block_geom_plain(&ga, caps[ci], la, ra, KVR_DTYPE_F32);
            kvr_block_geom_plain(&gb, caps[ci], lb, rb, KVR_DTYPE_F32);
            cr_assert_eq(kvr_block_geom_kv_bytes(&ga), kvr_block_geom_kv_bytes(&gb));
            kvr_block *a = kvr_block_create(&p, &ga, NULL, 0, NULL, 0);
            cr_assert_not_null(a);
            check_fits(a);
            fill(a);
            size_t a_head = a->head_len;
            kvr_block_unref(&p, a);
            cr_assert_eq(p.cache_n, 1, "the freed block is kept for reuse");
            kvr_block *b = kvr_block_create(&p, &gb, NULL, 0, NULL, 0);
            cr_assert_not_null(b);
            cuts_differ += b->head_len != a_head;
            check_fits(b);
            fill(b);
            kvr_block_unref(&p, b);
            kvr_block_pool_trim(&p);
            cr_assert_eq(p.n_blocks, 0);
        }
    }
    cr_log_info("%zu of the shape pairs are cut at different layers", cuts_differ);
}
