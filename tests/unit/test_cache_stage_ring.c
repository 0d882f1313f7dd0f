/*
 * test_cache_stage_ring.c — a get whose staging is a ring of chunk slots
 * (kvr_get_stage_ring, the daemon's streamed gets, issue 15) gives the same
 * bytes, chunk after chunk, as the whole get (kvr_get_copy_into): slots are
 * reused for later chunks and each chunk's iovecs are read before the chunk
 * that reuses its slot is worked, as stream.c does. Covered: re-rotated
 * keys, an edit, quantized contexts, other output dtypes, a layer subset,
 * every chunking (per, slots) including rings that would not be smaller
 * (no-op); the ring is smaller than the whole staging; a range larger than
 * the ring is refused; gets with nothing staged are unchanged. In pieces
 * (kvr_get_stage_pieces: a layer's side split at token boundaries) the same
 * bytes, pieces worked up to `slots` ahead of the one read, for every piece
 * size and ring; reads that cannot be split that way are left alone. And
 * kvr_mem_copy_stream (the shm put's streaming copy) equals memcpy.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt_store.h"

#define NL 12
#define NH 2
#define HD 64

/* An edit replaces tokens [10, 12) by these, K/V bytes all 0x21. */
static const uint32_t NEW3[3] = { 5, 6, 7 };




/* The get p through a ring of `slots` chunks of `per` layers, chunk by
 * chunk, against the whole get into a buffer. halves: the ring is at most
 * half the layers, so it must hold fewer bytes than the whole staging
 * whatever the allocator's size classes (else: no more). */
static void ring_same(kvr_store *s, kvr_get_params p, size_t per, size_t slots, bool halves)
{
    kvr_error e = { 0 };
    kvr_get *a = NULL, *b = NULL;
    cr_assert_eq(kvr_store_get_begin(s, &p, &a, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_get_begin(s, &p, &b, &e), 0, "%s", e.msg);
    size_t n = kvr_get_payload_size(a), nl = kvr_get_get_info(a)->n_layers;
    uint8_t *ref = malloc(n + 1), *got = malloc(n + 1);
    cr_assert_eq(kvr_get_copy_into(b, ref, n, &e), 0, "%s", e.msg);
    bool work = kvr_get_needs_work(a);
    /* Begin reserves no staging (issue 15): the whole staging is what
     * kvr_get_stage adds to a third get, the ring what the ring adds. */
    kvr_get *w = NULL;
    cr_assert_eq(kvr_store_get_begin(s, &p, &w, &e), 0, "%s", e.msg);
    size_t before = kvr_mem_allocated();
    cr_assert_eq(kvr_get_stage(w, &e), 0, "%s", e.msg);
    size_t whole = kvr_mem_allocated() - before;
    before = kvr_mem_allocated();
    cr_assert_eq(kvr_get_stage_ring(a, per, slots, &e), 0, "%s", e.msg);
    size_t ring = kvr_mem_allocated() - before;
    kvr_get_end(w);
    size_t chunks = (nl + per - 1) / per;
    if (work && chunks > slots && halves)   /* the ring instead of the whole staging */
        cr_assert_lt(ring, whole, "%s per %zu slots %zu: no smaller", p.ctx_id, per, slots);
    else if (work && chunks > slots)
        cr_assert_leq(ring, whole, "%s per %zu slots %zu: larger", p.ctx_id, per, slots);
    else
        cr_assert_eq(ring, whole, "%s: a no-op ring is not the whole staging", p.ctx_id);
    cr_assert_eq(work, whole > 0, "%s: staged %zu bytes, needs work %d", p.ctx_id, whole,
                 (int)work);
    memset(got, 0xEE, n + 1);
    size_t off = 0;
    for (size_t l0 = 0; l0 < nl; l0 += per) {
        size_t l1 = l0 + per < nl ? l0 + per : nl;
        if (work)
            cr_assert_eq(kvr_get_work_layers(a, l0, l1, &e), 0, "%s", e.msg);
        const struct iovec *iov;
        size_t niov;
        kvr_get_payload_iov_layers(a, l0, l1, &iov, &niov);
        for (size_t i = 0; i < niov; i++) {
            memcpy(got + off, iov[i].iov_base, iov[i].iov_len);
            off += iov[i].iov_len;
        }
    }
    cr_assert_eq(off, n);
    cr_assert_eq(memcmp(ref, got, n), 0, "%s dtype %d per %zu slots %zu: bytes differ",
                 p.ctx_id, (int)p.dtype, per, slots);
    cr_assert_eq(got[n], 0xEE);
    kvr_get_end(a);
    kvr_get_end(b);
    free(ref);
    free(got);
}

static void every_ring(kvr_store *s, const char *id, size_t n)
{
    int64_t *pos = malloc(n * sizeof *pos);
    for (size_t i = 0; i < n; i++)
        pos[i] = (int64_t)(i * 3 + 1000);
    uint32_t layers[5] = { 7, 1, 0, 11, 4 };
    kvr_dtype dts[] = { KVR_DTYPE_F16, KVR_DTYPE_F32 };
    static const size_t rings[][2] = { { 1, 1 }, { 1, 3 }, { 2, 2 }, { 3, 3 }, { 5, 2 },
                                       { 4, 3 }, { 12, 1 } };
    for (size_t k = 0; k < sizeof rings / sizeof *rings; k++)
        for (int d = 0; d < 2; d++) {
            size_t per = rings[k][0], slots = rings[k][1];
            bool halves = per * slots * 2 <= NL;
            ring_same(s, (kvr_get_params){ .ctx_id = id, .end = SIZE_MAX, .dtype = dts[d] },
                      per, slots, halves);
            ring_same(s, (kvr_get_params){ .ctx_id = id, .end = SIZE_MAX, .dtype = dts[d],
                                           .positions = pos, .n_positions = n }, per, slots,
                      halves);
            ring_same(s, (kvr_get_params){ .ctx_id = id, .start = 3, .end = n - 2,
                                           .dtype = dts[d], .layers = layers,
                                           .n_layers_sel = 5 }, per, slots, false);
        }
    free(pos);
}

Test(stage_ring, plain_edited_and_quantized)
{
    kvr_store *s = kvt_store_with_model(NULL, NL, NH, HD, KVR_DTYPE_F16, NULL);
    const char *codecs[] = { "f16", "int4", "k=int4/g64/c,v=int2,r=16" };
    for (int c = 0; c < 3; c++) {
        char id[16];
        snprintf(id, sizeof id, "c%d", c);
        kvt_put_f16(s, id, codecs[c], KVR_PUT_CREATE, 0, NL, NH, HD, 150);
        every_ring(s, id, 150);
        kvt_edit_replace(s, id, NL, NH, HD, 10, 12, NEW3, 3, 0x21);
        every_ring(s, id, 151);
    }
    kvr_store_destroy(s);
}

Test(stage_ring, large_threaded_chunks)
{
    /* 12 layers x 2 x 3000 tokens x 128 x 2 B = 18 MiB: threaded chunks,
     * and rings of 4 MiB or more come from (and go back to) the kept
     * staging buffer */
    kvr_store *s = kvt_store_with_model(NULL, NL, NH, HD, KVR_DTYPE_F16, NULL);
    kvt_put_f16(s, "big", "f16", KVR_PUT_CREATE, 0, NL, NH, HD, 3000);
    kvt_edit_replace(s, "big", NL, NH, HD, 10, 12, NEW3, 3, 0x21);
    for (int rep = 0; rep < 2; rep++) {
        ring_same(s, (kvr_get_params){ .ctx_id = "big", .end = SIZE_MAX,
                                       .dtype = KVR_DTYPE_F16 }, 2, 3, true);
        ring_same(s, (kvr_get_params){ .ctx_id = "big", .end = SIZE_MAX,
                                       .dtype = KVR_DTYPE_F32 }, 3, 2, true);
    }
    kvr_store_destroy(s);
}

Test(stage_ring, a_range_past_the_ring_is_refused)
{
    kvr_store *s = kvt_store_with_model(NULL, NL, NH, HD, KVR_DTYPE_F16, NULL);
    kvt_put_f16(s, "x", "f16", KVR_PUT_CREATE, 0, NL, NH, HD, 100);
    kvt_edit_replace(s, "x", NL, NH, HD, 10, 12, NEW3, 3, 0x21);
    kvr_error e = { 0 };
    kvr_get *g = NULL;
    kvr_get_params p = { .ctx_id = "x", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0, "%s", e.msg);
    cr_assert(kvr_get_needs_work(g));
    cr_assert_eq(kvr_get_stage_ring(g, 2, 2, NULL), 0);
    cr_assert_eq(kvr_get_work_layers(g, 0, 5, &e), KVR_EINTERNAL);
    cr_assert(strstr(e.msg, "ring") != NULL, "%s", e.msg);
    cr_assert_eq(kvr_get_work_layers(g, 0, 4, &e), 0, "%s", e.msg);
    kvr_get_end(g);
    /* nothing staged (an unedited get in the stored dtype): no ring */
    kvr_store *s2 = kvt_store_with_model(NULL, NL, NH, HD, KVR_DTYPE_F16, NULL);
    kvt_put_f16(s2, "y", "f16", KVR_PUT_CREATE, 0, NL, NH, HD, 100);
    kvr_get_params q = { .ctx_id = "y", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_store_get_begin(s2, &q, &g, &e), 0, "%s", e.msg);
    cr_assert_not(kvr_get_needs_work(g));
    cr_assert_eq(kvr_get_stage_ring(g, 1, 1, NULL), 0);
    cr_assert_not(kvr_get_needs_work(g));
    kvr_get_end(g);
    kvr_store_destroy(s2);
    kvr_store_destroy(s);
}

Test(stage_ring, copy_stream_equals_memcpy)
{
    size_t cap = (1u << 20) + 4096;
    uint8_t *src = malloc(cap), *a = malloc(cap), *b = malloc(cap);
    for (size_t i = 0; i < cap; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 13);
    static const size_t lens[] = { 0, 1, 31, 255, 256, 257, 4095, 65536 + 17, 1u << 20 };
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++)
        for (size_t so = 0; so < 3; so++)
            for (size_t dof = 0; dof < 40; dof += 13) {
                size_t n = lens[li];
                memset(a, 0x5a, cap);
                memset(b, 0x5a, cap);
                memcpy(a + dof, src + so, n);
                kvr_mem_copy_stream(b + dof, src + so, n);
                cr_assert_eq(memcmp(a, b, cap), 0, "len %zu src+%zu dst+%zu", n, so, dof);
            }
    free(src);
    free(a);
    free(b);
}

/* ---- in pieces ------------------------------------------------------------ */

/* The get p in pieces of about piece_bytes, `slots` staged at once, worked
 * as far ahead as the ring allows (as stream.c does), against copy_into.
 * split: whether the read can go in pieces. */
static void pieces_same(kvr_store *s, kvr_get_params p, size_t piece_bytes, size_t slots,
                        bool split)
{
    kvr_error e = { 0 };
    kvr_get *a = NULL, *b = NULL;
    cr_assert_eq(kvr_store_get_begin(s, &p, &a, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_get_begin(s, &p, &b, &e), 0, "%s", e.msg);
    size_t len = kvr_get_payload_size(a);
    uint8_t *ref = malloc(len + 1), *got = malloc(len + 1);
    cr_assert_eq(kvr_get_copy_into(b, ref, len, &e), 0, "%s", e.msg);
    kvr_get_end(b);
    size_t np = 99;
    cr_assert_eq(kvr_get_stage_pieces(a, piece_bytes, slots, &np, &e), 0, "%s", e.msg);
    if (!split) {
        cr_assert_eq(np, 0, "%s: %zu pieces", p.ctx_id, np);
        cr_assert_eq(kvr_get_n_pieces(a), 0);
        kvr_get_end(a);
        free(ref);
        free(got);
        return;
    }
    cr_assert_gt(np, 0, "%s piece %zu slots %zu: not in pieces", p.ctx_id, piece_bytes, slots);
    cr_assert_eq(kvr_get_n_pieces(a), np);
    /* the whole-payload paths are not for a get in pieces */
    cr_assert_eq(kvr_get_work(a, &e), KVR_EINTERNAL);
    memset(got, 0xEE, len + 1);
    size_t off = 0, worked = 0;
    for (size_t k = 0; k < np; k++) {
        while (worked < np && worked < k + slots) {
            cr_assert_eq(kvr_get_work_piece(a, worked, &e), 0, "%s", e.msg);
            worked++;
        }
        const struct iovec *iov;
        size_t niov, bytes, sum = 0;
        kvr_get_payload_iov_piece(a, k, &iov, &niov, &bytes);
        for (size_t i = 0; i < niov; i++) {
            cr_assert_leq(off + iov[i].iov_len, len);
            memcpy(got + off, iov[i].iov_base, iov[i].iov_len);
            off += iov[i].iov_len;
            sum += iov[i].iov_len;
        }
        cr_assert_eq(sum, bytes);
    }
    cr_assert_eq(off, len);
    cr_assert_eq(got[len], 0xEE);
    cr_assert_eq(memcmp(ref, got, len), 0, "%s dtype %d piece %zu slots %zu: bytes differ",
                 p.ctx_id, (int)p.dtype, piece_bytes, slots);
    cr_assert_eq(kvr_get_work_piece(a, np, &e), KVR_EINVAL);
    kvr_get_end(a);
    free(ref);
    free(got);
}

static void every_piece(kvr_store *s, const char *id, size_t n, bool split)
{
    uint32_t layers[5] = { 7, 1, 0, 11, 4 };
    kvr_dtype dts[] = { KVR_DTYPE_F16, KVR_DTYPE_F32, KVR_DTYPE_BF16 };
    static const size_t sizes[] = { 1, 700, 4096, 1u << 20 };
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++)
        for (size_t slots = 1; slots <= 3; slots++)
            for (int d = 0; d < 3; d++) {
                pieces_same(s, (kvr_get_params){ .ctx_id = id, .end = SIZE_MAX,
                                                 .dtype = dts[d] }, sizes[k], slots, split);
                pieces_same(s, (kvr_get_params){ .ctx_id = id, .start = 3, .end = n - 2,
                                                 .dtype = dts[d], .layers = layers,
                                                 .n_layers_sel = 5 }, sizes[k], slots, split);
            }
}

Test(stage_ring, pieces_edited_plain_and_left_alone)
{
    kvr_store *s = kvt_store_with_model(NULL, NL, NH, HD, KVR_DTYPE_F16, NULL);
    kvt_put_f16(s, "p", "f16", KVR_PUT_CREATE, 0, NL, NH, HD, 150);
    kvt_edit_replace(s, "p", NL, NH, HD, 10, 12, NEW3, 3, 0x21);                 /* zero-copy prefix, new tokens, a suffix moved by one delta */
    every_piece(s, "p", 151, true);
    kvt_put_f16(s, "q", "int4", KVR_PUT_CREATE, 0, NL, NH, HD, 150);     /* quantized: not in pieces */
    kvt_edit_replace(s, "q", NL, NH, HD, 10, 12, NEW3, 3, 0x21);
    every_piece(s, "q", 151, false);
    /* keys moved by deltas that differ: the general path, not in pieces */
    int64_t *pos = malloc(151 * sizeof *pos);
    for (size_t i = 0; i < 151; i++)
        pos[i] = (int64_t)(i * 3 + 1000);
    pieces_same(s, (kvr_get_params){ .ctx_id = "p", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16,
                                     .positions = pos, .n_positions = 151 }, 4096, 3, false);
    free(pos);
    /* nothing staged (unedited, stored dtype): nothing to split */
    kvt_put_f16(s, "u", "f16", KVR_PUT_CREATE, 0, NL, NH, HD, 150);
    pieces_same(s, (kvr_get_params){ .ctx_id = "u", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 },
                4096, 3, false);
    kvr_store_destroy(s);
}

Test(stage_ring, pieces_large)
{
    kvr_store *s = kvt_store_with_model(NULL, NL, NH, HD, KVR_DTYPE_F16, NULL);
    kvt_put_f16(s, "big", "f16", KVR_PUT_CREATE, 0, NL, NH, HD, 3000);
    kvt_edit_replace(s, "big", NL, NH, HD, 10, 12, NEW3, 3, 0x21);
    pieces_same(s, (kvr_get_params){ .ctx_id = "big", .end = SIZE_MAX,
                                     .dtype = KVR_DTYPE_F16 }, 2u << 20, 3, true);
    pieces_same(s, (kvr_get_params){ .ctx_id = "big", .end = SIZE_MAX,
                                     .dtype = KVR_DTYPE_F16 }, 64u << 10, 3, true);
    kvr_store_destroy(s);
}
