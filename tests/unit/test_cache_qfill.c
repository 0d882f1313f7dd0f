/*
 * test_cache_qfill.c — a fresh quantized block zeroes only what its creator
 * will not write (kvr_block_geom.fill), which is safe because the row and
 * tile encoders write every byte they encode: checked here for every codec,
 * group, ISA and a range of lengths, by encoding into a zeroed and a
 * poisoned buffer and comparing. Then the block's own bytes: header, the
 * K/V bytes past the filled slots zeroed, whatever memory it was given.
 */
#include <criterion/criterion.h>

#include <string.h>
#include <math.h>

#include "cache/quant.h"

static const char *const codecs[] = { "int8", "int4", "int2", "int8/g32", "int4/g128",
                                      "int2/g256", "q8_0", "q4_0", "q4_1", "q5_0" };
#define N_CODECS (sizeof codecs / sizeof codecs[0])

static float *values(size_t n, double step)
{
    float *x = malloc(n * sizeof *x);
    cr_assert_not_null(x);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(sin((double)i * step) * 3.0 + (double)(i % 7) * 0.01);
    return x;
}

Test(qfill, row_and_tile_encoders_write_every_byte)
{
    static const size_t lens[] = { 1, 7, 32, 33, 64, 96, 128, 1000, 1024 };
    size_t compared = 0;
    for (size_t a = 0; a < N_CODECS; a++)
        for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
            kvr_codec c;
            cr_assert_eq(kvr_codec_parse(codecs[a], &c), 0);
            c.isa = (kvr_isa)isa;
            for (size_t z = 0; z < sizeof lens / sizeof lens[0]; z++) {
                size_t n = lens[z], rb = kvr_codec_row_bytes(&c, n), bad;
                if (rb == 0)
                    continue;   /* ggml blocks: n % 32 != 0 */
                float *x = values(n, 0.37);
                uint8_t *d0 = malloc(rb), *d1 = malloc(rb);
                memset(d0, 0, rb);
                memset(d1, 0xa5, rb);
                cr_assert_eq(kvr_codec_encode(&c, d0, x, KVR_DTYPE_F32, n, &bad), 0);
                cr_assert_eq(kvr_codec_encode(&c, d1, x, KVR_DTYPE_F32, n, &bad), 0);
                cr_assert_eq(memcmp(d0, d1, rb), 0, "%s isa %d: a row of %zu leaves bytes",
                             codecs[a], isa, n);
                compared++;
                free(x); free(d0); free(d1);
            }
            if (!kvr_codec_is_uniform(c.type))
                continue;
            for (size_t ch = 1; ch <= 130; ch += 43) {
                size_t tb = kvr_codec_tile_bytes(&c, ch), G = kvr_codec_group(&c), bad;
                float *t = values(G * ch, 0.11);
                uint8_t *e0 = malloc(tb), *e1 = malloc(tb);
                memset(e0, 0, tb);
                memset(e1, 0xa5, tb);
                cr_assert_eq(kvr_codec_encode_tile(&c, e0, t, KVR_DTYPE_F32, ch, ch, &bad), 0);
                cr_assert_eq(kvr_codec_encode_tile(&c, e1, t, KVR_DTYPE_F32, ch, ch, &bad), 0);
                cr_assert_eq(memcmp(e0, e1, tb), 0, "%s isa %d: a tile of %zu channels",
                             codecs[a], isa, ch);
                compared++;
                free(t); free(e0); free(e1);
            }
        }
    cr_assert_gt(compared, 200);
}

static bool all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return false;
    return true;
}

/* Blocks of K rows (int8 per token) and of K tiles (KIVI int4 per channel),
 * with fill 0, a partial fill and a full one. Each block is created right
 * after a poisoned buffer of its size is freed, so (allocator permitting)
 * it gets dirty memory: what it must zero is zero either way. */
Test(qfill, fresh_block_zeroes_what_is_not_filled)
{
    kvr_codec_pair pairs[2];
    cr_assert_eq(kvr_codec_parse("int8", &pairs[0].k), 0);
    cr_assert_eq(kvr_codec_parse("int8", &pairs[0].v), 0);
    pairs[0].window = 0;
    pairs[1] = kvr_codec_pair_default();   /* K int4 per channel (tiles), V int2 */
    const uint32_t row = 256, layers = 3, B = 64;
    for (int pi = 0; pi < 2; pi++) {
        kvr_qspec q = { .quant = true, .dtype = KVR_DTYPE_F16, .pair = pairs[pi] };
        uint32_t G = kvr_qspec_ktile(&q);
        cr_assert_eq(pi == 0 ? G == 1 : G > 1, true);
        kvr_block_geom g;
        kvr_qspec_geom(&q, B, layers, row, &g);
        uint32_t fills[] = { 0, G > 1 ? G : 5, g.cap };
        for (size_t fi = 0; fi < 3; fi++) {
            g.fill = fills[fi];
            size_t bytes = kvr_block_geom_bytes(&g);
            uint8_t *dirty = kvr_mem_aligned(KVR_BLOCK_ALIGN, bytes);
            cr_assert_not_null(dirty);
            memset(dirty, 0xa5, bytes);
            kvr_mem_free(dirty);
            kvr_block_pool pool = { 0 };
            kvr_block *b = kvr_block_create(&pool, &g, NULL, 0, 0);
            cr_assert_not_null(b);
            const kvr_qhdr *h = KVR_QH(b);
            cr_assert_eq(memcmp(h, &g.qh, sizeof *h), 0, "the header is the geometry's");
            cr_assert(all_zero(b->data + sizeof *h, KVR_QHDR_BYTES - sizeof *h));
            size_t kw = (size_t)(g.fill + h->ktile - 1) / h->ktile * h->krow;
            size_t vw = (size_t)g.fill * h->vrow;
            for (uint32_t l = 0; l < layers; l++) {
                const uint8_t *k = kvr_block_kv(b, l, 0, 0), *v = kvr_block_kv(b, l, 1, 0);
                cr_assert(all_zero(k + kw, h->kslab - kw), "pair %d fill %u layer %u: K tail",
                          pi, g.fill, l);
                cr_assert(all_zero(v + vw, h->vslab - vw), "pair %d fill %u layer %u: V tail",
                          pi, g.fill, l);
            }
            /* The slots the creator writes, it can write whole. */
            for (uint32_t l = 0; l < layers; l++) {
                memset(kvr_block_kv(b, l, 0, 0), 0x11, kw);
                memset(kvr_block_kv(b, l, 1, 0), 0x22, vw);
            }
            cr_assert_eq(pool.n_blocks, 1);
            kvr_block_unref(&pool, b);
            cr_assert_eq(pool.n_blocks, 0);
        }
    }
}
