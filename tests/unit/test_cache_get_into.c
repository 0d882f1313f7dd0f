/*
 * test_cache_get_into.c — kvr_get_copy_into writes exactly the bytes that
 * kvr_get_work + the payload iovecs give: unedited (zero-copy), re-rotated
 * to other positions, after an edit, quantized contexts (int4 per token,
 * KIVI key tiles with a window, q4_0), other output dtypes, a layer subset,
 * a sub-range; small (one thread), large (threaded) and streamed (32 MiB
 * and more, non-temporal stores, aligned or not; KIVI tiles too) requests;
 * and the size check.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_store.h"

#define NL 4
#define NH 2
#define HD 64

static kvr_store *mk(void)
{
    return kvt_store_with_model(NULL, NL, NH, HD, KVR_DTYPE_F16, NULL);
}

static void put(kvr_store *s, const char *id, const char *codec, size_t n)
{
    kvt_put_f16(s, id, codec, KVR_PUT_CREATE, 0, NL, NH, HD, n);
}

static void edit(kvr_store *s, const char *id)
{
    static const uint32_t nt[3] = { 5, 6, 7 };
    kvt_edit_replace(s, id, NL, NH, HD, 10, 12, nt, 3, 0x21);
}

/* Both ways for one request, copy_into writing at `off` bytes past a
 * 64-byte boundary; asserts the bytes agree. */
static void same_at(kvr_store *s, kvr_get_params p, size_t at);

static void same(kvr_store *s, kvr_get_params p)
{
    same_at(s, p, 0);
}

static void same_at(kvr_store *s, kvr_get_params p, size_t at)
{
    kvr_error e = { 0 };
    kvr_get *a = NULL, *b = NULL;
    cr_assert_eq(kvr_store_get_begin(s, &p, &a, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_get_begin(s, &p, &b, &e), 0, "%s", e.msg);
    size_t n = kvr_get_payload_size(a);
    cr_assert_eq(n, kvr_get_payload_size(b));
    uint8_t *ref = malloc(n + 1), *buf = aligned_alloc(64, (n + 1 + at + 63) / 64 * 64);
    uint8_t *got = buf + at;
    if (kvr_get_needs_work(a)) cr_assert_eq(kvr_get_work(a, &e), 0, "%s", e.msg);
    const struct iovec *iov;
    size_t niov;
    kvr_get_payload_iov(a, &iov, &niov);
    cr_assert_eq(kvt_gather(ref, iov, niov), n);
    memset(got, 0xEE, n + 1);
    cr_assert_eq(kvr_get_copy_into(b, got, n + 1, &e), KVR_EINVAL);
    cr_assert_eq(kvr_get_copy_into(b, got, n, &e), 0, "%s", e.msg);
    cr_assert_eq(memcmp(ref, got, n), 0, "%s dtype %d: bytes differ", p.ctx_id, (int)p.dtype);
    cr_assert_eq(got[n], 0xEE, "wrote past the payload");
    kvr_get_end(a);
    kvr_get_end(b);
    free(ref);
    free(buf);
}

static void all_ways(kvr_store *s, const char *id, size_t n)
{
    kvr_dtype dts[] = { KVR_DTYPE_F16, KVR_DTYPE_F32, KVR_DTYPE_BF16 };
    int64_t *pos = malloc(n * sizeof *pos);
    for (size_t i = 0; i < n; i++) pos[i] = (int64_t)(i * 3 + 1000);
    uint32_t layers[2] = { 3, 1 };
    for (int d = 0; d < 3; d++) {
        same(s, (kvr_get_params){ .ctx_id = id, .end = SIZE_MAX, .dtype = dts[d] });
        same(s, (kvr_get_params){ .ctx_id = id, .end = SIZE_MAX, .dtype = dts[d],
                                  .positions = pos, .n_positions = n });
        same(s, (kvr_get_params){ .ctx_id = id, .start = 3, .end = n - 2, .dtype = dts[d],
                                  .layers = layers, .n_layers_sel = 2 });
    }
    same(s, (kvr_get_params){ .ctx_id = id, .end = SIZE_MAX, .dtype = KVR_DTYPE_F16,
                              .meta_only = true });
    free(pos);
}

Test(get_into, plain_edited_and_quantized)
{
    kvr_store *s = mk();
    const char *codecs[] = { "f16", "int4", "k=int4/g64/c,v=int2,r=16", "q4_0" };
    for (int c = 0; c < 4; c++) {
        char id[16];
        snprintf(id, sizeof id, "c%d", c);
        put(s, id, codecs[c], 200);
        all_ways(s, id, 200);
        edit(s, id);
        all_ways(s, id, 201);
    }
    kvr_store_destroy(s);
}

Test(get_into, large_threaded)
{
    /* 4 layers x 2 x 4096 tokens x 128 x 2 B = 8 MiB: above the threading
     * threshold */
    kvr_store *s = mk();
    put(s, "big", "f16", 4096);
    edit(s, "big");
    same(s, (kvr_get_params){ .ctx_id = "big", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 });
    put(s, "bq", "int8", 4096);
    same(s, (kvr_get_params){ .ctx_id = "bq", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 });
    kvr_store_destroy(s);
}

/* Payloads of 32 MiB and more go into the buffer with non-temporal stores
 * (rotated keys and copied parts alike): the same bytes, at an aligned and a
 * misaligned destination, on 1 and 2 threads (kvr_pool_set_active),
 * unedited, edited and re-rotated, in every output dtype. */
Test(get_into, large_streamed)
{
    /* 4 layers x 2 x 16384 tokens x 128 x 2 B = 32 MiB in f16 */
    kvr_store *s = mk();
    size_t n = 16384;
    put(s, "plain", "f16", n);
    put(s, "ed", "f16", n);
    edit(s, "ed");
    int64_t *pos = malloc((n + 1) * sizeof *pos);
    for (size_t i = 0; i <= n; i++) pos[i] = (int64_t)(i * 2 + 77);
    kvr_dtype dts[] = { KVR_DTYPE_F16, KVR_DTYPE_F32, KVR_DTYPE_BF16 };
    for (unsigned w = 0; w <= 1; w++) {
        kvr_pool_set_active(kvr_pool_default(), w);
        for (size_t off = 0; off <= 8; off += 8) {
            same_at(s, (kvr_get_params){ .ctx_id = "plain", .end = SIZE_MAX,
                                         .dtype = KVR_DTYPE_F16 }, off);
            for (int d = 0; d < 3; d++)
                same_at(s, (kvr_get_params){ .ctx_id = "ed", .end = SIZE_MAX, .dtype = dts[d] },
                        off);
            same_at(s, (kvr_get_params){ .ctx_id = "plain", .end = SIZE_MAX,
                                         .dtype = KVR_DTYPE_F16, .positions = pos,
                                         .n_positions = n }, off);
        }
    }
    kvr_pool_set_active(kvr_pool_default(), KVR_POOL_MAX_WORKERS);
    free(pos);
    kvr_store_destroy(s);
}

/* Quantized contexts decoded into a buffer of 32 MiB and more: values
 * dequantized and keys rotated with non-temporal stores
 * (kvr_codec_decode_stream, kvr_rope_opts.stream): the bytes of the staged
 * get, at an aligned and a misaligned destination, every output dtype, on 1
 * and 2 threads, edited too (re-rotated keys). */
Test(get_into, large_streamed_quantized)
{
    kvr_store *s = mk();
    size_t n = 16384;
    const char *codecs[] = { "int8", "int2", "q8_0", "q5_0" };
    kvr_dtype dts[] = { KVR_DTYPE_F16, KVR_DTYPE_F32, KVR_DTYPE_BF16 };
    for (int c = 0; c < 4; c++) {
        put(s, "q", codecs[c], n);
        for (unsigned w = 0; w <= 1; w++) {
            kvr_pool_set_active(kvr_pool_default(), w);
            for (size_t off = 0; off <= 8; off += 8)
                for (int d = 0; d < (c == 0 ? 3 : 1); d++)
                    same_at(s, (kvr_get_params){ .ctx_id = "q", .end = SIZE_MAX,
                                                 .dtype = dts[d] }, off);
        }
        if (c == 0) {
            edit(s, "q");
            same_at(s, (kvr_get_params){ .ctx_id = "q", .end = SIZE_MAX,
                                         .dtype = KVR_DTYPE_F16 }, 0);
        }
        kvr_pool_set_active(kvr_pool_default(), KVR_POOL_MAX_WORKERS);
        kvr_error e = { 0 };
        cr_assert_eq(kvr_store_delete(s, "q", &e), 0, "%s", e.msg);
    }
    kvr_store_destroy(s);
}

/* The same for KIVI key tiles with a window (the tile path rotates into the
 * buffer with kvr_rope_apply), int4 rows and ggml values, stored positions
 * and re-rotated ones, at destinations on 64 bytes, 2 bytes off (one f16)
 * and 68 bytes off, on 1 and 2 threads. */
Test(get_into, large_streamed_kivi)
{
    kvr_store *s = mk();
    size_t n = 16384 + 37;
    const char *codecs[] = { "k=int4/g64/c,v=int2,r=16", "int4", "k=int4/g32/c,v=q4_0,r=5" };
    kvr_dtype dts[] = { KVR_DTYPE_F16, KVR_DTYPE_F32, KVR_DTYPE_BF16 };
    int64_t *pos = malloc(n * sizeof *pos);
    for (size_t i = 0; i < n; i++) pos[i] = (int64_t)(i * 3 + 1000);
    static const size_t offs[] = { 0, 2, 68 };
    for (int c = 0; c < 3; c++) {
        put(s, "q", codecs[c], n);
        for (unsigned w = 0; w <= 1; w++) {
            kvr_pool_set_active(kvr_pool_default(), w);
            for (size_t oi = 0; oi < 3; oi++)
                for (int d = 0; d < (c == 0 ? 3 : 1); d++) {
                    same_at(s, (kvr_get_params){ .ctx_id = "q", .end = SIZE_MAX,
                                                 .dtype = dts[d] }, offs[oi]);
                    same_at(s, (kvr_get_params){ .ctx_id = "q", .end = SIZE_MAX,
                                                 .dtype = dts[d], .positions = pos,
                                                 .n_positions = n }, offs[oi]);
                }
        }
        kvr_pool_set_active(kvr_pool_default(), KVR_POOL_MAX_WORKERS);
        kvr_error e = { 0 };
        cr_assert_eq(kvr_store_delete(s, "q", &e), 0, "%s", e.msg);
    }
    free(pos);
    kvr_store_destroy(s);
}

/* put_doc's values: iovec i, element k of a document from token tok0. */
typedef struct doc_fill {
    size_t   i;
    uint32_t tok0;
} doc_fill;

static void fill_doc(void *arg, void *p, size_t bytes)
{
    doc_fill *f = arg;
    uint16_t *h = p;
    for (size_t k = 0; k < bytes / 2; k++)
        h[k] = (uint16_t)(0x3000 + ((f->i * 131 + k * 7 + f->tok0) & 0x0fff));
    f->i++;
}

static void put_doc(kvr_store *s, const char *id, const char *prefix, size_t n, uint32_t tok0)
{
    uint32_t *tok = malloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++) tok[i] = tok0 + (uint32_t)i;
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = KVR_PUT_CREATE, .n_layers = NL,
                         .n_kv_heads = NH, .head_dim = HD, .dtype = KVR_DTYPE_F16,
                         .n_tokens = n, .tokens = tok, .prefix_ctx = prefix };
    doc_fill f = { 0, tok0 };
    kvt_put(s, &p, fill_doc, &f);
    free(tok);
}

Test(get_into, assemble_every_layout)
{
    kvr_store *s = mk();
    put_doc(s, "pre", NULL, 37, 1);
    const char *docs[3] = { "d0", "d1", "d2" };
    size_t len[3] = { 150, 71, 300 };
    for (int i = 0; i < 3; i++) put_doc(s, docs[i], "pre", len[i], 1000 + 1000 * (uint32_t)i);
    kvr_layout_kind kinds[2] = { KVR_LAYOUT_PARALLEL, KVR_LAYOUT_SEQUENTIAL };
    kvr_dtype dts[2] = { KVR_DTYPE_F16, KVR_DTYPE_F32 };
    for (int k = 0; k < 2; k++)
        for (int fold = 0; fold < 2; fold++)
            for (int d = 0; d < 2; d++) {
                kvr_assemble_params ap = { .prefix = "pre", .docs = docs, .n_docs = 3,
                                           .layout = kinds[k], .dtype = dts[d],
                                           .fold_temperature = fold };
                kvr_error e = { 0 };
                kvr_assemble *a = NULL, *b = NULL;
                cr_assert_eq(kvr_store_assemble_begin(s, &ap, &a, &e), 0, "%s", e.msg);
                cr_assert_eq(kvr_store_assemble_begin(s, &ap, &b, &e), 0, "%s", e.msg);
                size_t n = kvr_assemble_payload_size(a);
                uint8_t *ref = malloc(n), *got = malloc(n);
                if (kvr_assemble_needs_work(a))
                    cr_assert_eq(kvr_assemble_work(a, &e), 0, "%s", e.msg);
                const struct iovec *iov;
                size_t niov;
                kvr_assemble_payload_iov(a, &iov, &niov);
                cr_assert_eq(kvt_gather(ref, iov, niov), n);
                cr_assert_eq(kvr_assemble_copy_into(b, got, n - 1, &e), KVR_EINVAL);
                cr_assert_eq(kvr_assemble_copy_into(b, got, n, &e), 0, "%s", e.msg);
                cr_assert_eq(memcmp(ref, got, n), 0, "layout %d fold %d dtype %d", k, fold, d);
                kvr_assemble_end(a);
                kvr_assemble_end(b);
                free(ref);
                free(got);
            }
    kvr_store_destroy(s);
}
