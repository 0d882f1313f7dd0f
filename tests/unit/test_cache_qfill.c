/*
 * test_cache_qfill.c — a fresh quantized block zeroes only what its creator
 * will not write (kvr_block_geom.fill), which is safe because the row and
 * tile encoders write every byte they encode: checked here for every codec,
 * group, ISA and a range of lengths, by encoding into a zeroed and a
 * poisoned buffer and comparing. Then the block's own bytes: header, the
 * K/V bytes past the filled slots zeroed, whatever memory it was given.
 * The same for f16 input (a put's values encoded where they lie), and end
 * to end: the quantized blocks of contexts built by creates and appends
 * (window flushes, KIVI tiles, per-token rows, ggml blocks) on memory that
 * jemalloc fills with 0xa5 when it hands it out (this binary's
 * malloc_conf): zeros past each block's used slots, no run of the fill
 * byte inside them.
 */
#include <criterion/criterion.h>

#include <string.h>
#include <math.h>

#include "cache/cache.h"
#include "cache/ctx.h"
#include "cache/quant.h"
#include "cache/store.h"
#include "tests/common/kvt_store.h"

#ifdef KVR_JEMALLOC
/* Fresh allocations filled with 0xa5 (jemalloc reads this at start-up). */
const char *malloc_conf = "junk:alloc";
#endif

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

/* Encodes a row of n values (sdt) into a zeroed and a 0xa5-poisoned buffer
 * of rb bytes: the same bytes, or the encoder left some unwritten. */
static void row_writes_all(const kvr_codec *c, const void *x, kvr_dtype sdt, size_t n,
                           size_t rb, const char *name)
{
    size_t bad;
    uint8_t *d0 = malloc(rb), *d1 = malloc(rb);
    cr_assert(d0 && d1);
    memset(d0, 0, rb);
    memset(d1, 0xa5, rb);
    cr_assert_eq(kvr_codec_encode(c, d0, x, sdt, n, &bad), 0);
    cr_assert_eq(kvr_codec_encode(c, d1, x, sdt, n, &bad), 0);
    cr_assert_eq(memcmp(d0, d1, rb), 0, "%s isa %d: a %s row of %zu leaves bytes", name,
                 (int)c->isa, sdt == KVR_DTYPE_F16 ? "f16" : "f32", n);
    free(d0);
    free(d1);
}

/* codecs[a] at ISA isa. */
static void codec_at(kvr_codec *c, size_t a, int isa)
{
    cr_assert_eq(kvr_codec_parse(codecs[a], c), 0);
    c->isa = (kvr_isa)isa;
}

/* row_writes_all for every codec, ISA and a range of lengths, the input
 * in sdt (f32, or f16 converted from the same values). The rows compared. */
static size_t rows_write_all(kvr_dtype sdt)
{
    static const size_t lens[] = { 1, 7, 32, 33, 64, 96, 128, 1000, 1024 };
    size_t compared = 0;
    for (size_t a = 0; a < N_CODECS; a++)
        for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
            kvr_codec c;
            codec_at(&c, a, isa);
            for (size_t z = 0; z < sizeof lens / sizeof lens[0]; z++) {
                size_t n = lens[z], rb = kvr_codec_row_bytes(&c, n);
                if (rb == 0)
                    continue;   /* ggml blocks: n % 32 != 0 */
                float *x = values(n, 0.37);
                if (sdt == KVR_DTYPE_F16) {
                    uint16_t *xh = malloc(n * sizeof *xh);
                    cr_assert_not_null(xh);
                    kvr_convert(xh, KVR_DTYPE_F16, x, KVR_DTYPE_F32, n);
                    row_writes_all(&c, xh, KVR_DTYPE_F16, n, rb, codecs[a]);
                    free(xh);
                } else {
                    row_writes_all(&c, x, KVR_DTYPE_F32, n, rb, codecs[a]);
                }
                compared++;
                free(x);
            }
        }
    return compared;
}

Test(qfill, row_and_tile_encoders_write_every_byte)
{
    size_t compared = rows_write_all(KVR_DTYPE_F32);
    for (size_t a = 0; a < N_CODECS; a++)
        for (int isa = KVR_ISA_SCALAR; isa <= KVR_ISA_AVX512; isa++) {
            kvr_codec c;
            codec_at(&c, a, isa);
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
            kvr_block *b = kvr_block_create(&pool, &g, NULL, 0, NULL, 0);
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

Test(qfill, f16_rows_write_every_byte)
{
    cr_assert_gt(rows_write_all(KVR_DTYPE_F16), 200);
}

enum { SL = 4, SH = 2, SD = 64 };

static void sput(kvr_store *s, const char *codec, size_t n, kvr_put_mode mode, uint32_t seed)
{
    kvt_put_f16(s, "j", codec, mode, seed, SL, SH, SD, n);
}

/* Quantized blocks of context "j": zeros past the used slots; no run of
 * 24 fill bytes (0xa5) inside them. Returns the blocks checked. */
static size_t check_blocks(kvr_store *s, const char *codec)
{
    kvr_ctx *c = kvr_store_ctx_find(s, "j");
    cr_assert_not_null(c);
    size_t nq = 0;
    for (size_t i = 0; i < c->n_ext; i++) {
        const kvr_block *b = c->ext[i].block;
        if (!b->quant)
            continue;
        nq++;
        const kvr_qhdr *h = KVR_QH(b);
        size_t kw = h->ktile > 1 ? (size_t)((b->used + h->ktile - 1) / h->ktile) * h->krow
                                 : (size_t)b->used * h->krow;
        size_t vw = (size_t)b->used * h->vrow;
        for (uint32_t l = 0; l < SL; l++)
            for (int kv = 0; kv < 2; kv++) {
                const uint8_t *p = kvr_block_kv(b, l, kv, 0);
                size_t w = kv ? vw : kw, sl = kv ? h->vslab : h->kslab, run = 0;
                for (size_t k = w; k < sl; k++)
                    cr_assert_eq(p[k], 0, "%s: extent %zu layer %u %s: byte %zu past the "
                                 "%zu used bytes", codec, i, l, kv ? "V" : "K", k, w);
                for (size_t k = 0; k < w; k++) {
                    run = p[k] == 0xa5 ? run + 1 : 0;
                    cr_assert_lt(run, 24, "%s: extent %zu layer %u %s: fill bytes at %zu "
                                 "(%u slots used)", codec, i, l, kv ? "V" : "K", k, b->used);
                }
            }
    }
    return nq;
}

Test(qfill, put_blocks_written_or_zero)
{
    kvr_store *s = kvt_store_with_model(NULL, SL, SH, SD, KVR_DTYPE_F16, NULL);
    kvr_error e = { 0 };
    static const char *const cs[] = { "k=int4/g64/c,v=int2,r=16", "k=int4/g32/c,v=q4_0,r=5",
                                      "k=int8/g32/c,v=int8/g32,r=0", "int4", "int2/g128",
                                      "q8_0" };
    static const size_t adds[] = { 1, 7, 31, 33, 64, 130, 5, 300 };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        sput(s, cs[ci], 200, KVR_PUT_CREATE, 0);
        for (size_t a = 0; a < sizeof adds / sizeof adds[0]; a++)
            sput(s, NULL, adds[a], KVR_PUT_APPEND, (uint32_t)a + 1);
        cr_assert_gt(check_blocks(s, cs[ci]), 1);
        cr_assert_eq(kvr_store_delete(s, "j", &e), 0, "%s", e.msg);
    }
    kvr_store_destroy(s);
}
