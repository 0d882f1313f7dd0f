/*
 * test_cache_read_fused.c — the one-pass read paths give the bytes of the
 * passes they replace, bit for bit:
 *  - kvr_rope_reposition_delta == kvr_rope_reposition (one delta per token)
 *    into f32, times the scale in f32, kvr_convert to the output dtype; with
 *    scale 1 == kvr_rope_reposition itself. Every ISA, dtype pair, NeoX /
 *    GPT-J, partial rotary, a NoPE layer, threads, odd token counts.
 *  - kvr_convert_scaled == kvr_convert to f32, a multiply, kvr_convert back.
 *  - the store: an assemble (sequential, T folded or not; parallel folded)
 *    and a get after an edit equal a reference built from plain gets of the
 *    stored bytes with kvr_rope_reposition, a multiply and kvr_convert.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_store.h"
#include "tests/common/kvt_vectors.h"

static uint32_t rng = 12345;
static float frand(void)
{
    rng = rng * 1664525u + 1013904223u;
    return ((float)(rng >> 8) / 16777216.0f - 0.5f) * 4.0f;
}

static void fill(void *p, kvr_dtype t, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float v = frand();
        if (t == KVR_DTYPE_F32) ((float *)p)[i] = v;
        else if (t == KVR_DTYPE_F16) ((uint16_t *)p)[i] = kvr_f32_to_f16(v);
        else ((uint16_t *)p)[i] = kvr_f32_to_bf16(v);
    }
}

static kvr_rope *engine(int gptj, int hd, int rot, kvr_rope_scaling sc)
{
    kvr_rope_config c;
    kvr_rope_config_init(&c);
    c.head_dim = hd;
    c.rotary_dim = rot;
    c.theta = 500000;
    c.style = gptj ? KVR_ROPE_GPTJ : KVR_ROPE_NEOX;
    if (sc == KVR_ROPE_SCALING_LLAMA3) {
        c.scaling = sc;
        c.factor = 8;
        c.low_freq_factor = 1;
        c.high_freq_factor = 4;
        c.original_max_position_embeddings = 8192;
    }
    kvr_rope *r = kvt_rope_new(&c);
    return r;
}

/* The passes the fused path replaces. */
static void reference(const kvr_rope *r, void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                      size_t n, size_t nh, size_t hd, int64_t from0, int64_t delta, float k,
                      kvr_isa isa)
{
    int64_t *from = malloc(n * sizeof *from), *to = malloc(n * sizeof *to);
    for (size_t i = 0; i < n; i++) {
        from[i] = from0 + (int64_t)i;
        to[i] = from[i] + delta;
    }
    size_t ne = n * nh * hd;
    float *f = malloc(ne * sizeof *f);
    kvr_rope_opts o = { .isa = isa, .n_threads = 1 };
    cr_assert_eq(kvr_rope_reposition(r, f, KVR_DTYPE_F32, src, st, n, nh, from, to, &o), 0);
    for (size_t i = 0; i < ne; i++)
        f[i] *= k;
    kvr_convert(dst, dt, f, KVR_DTYPE_F32, ne);
    free(f);
    free(from);
    free(to);
}

Test(read_fused, reposition_delta_matches_passes)
{
    kvr_dtype dts[3] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
    kvr_isa isas[3] = { KVR_ISA_SCALAR, KVR_ISA_AVX2, KVR_ISA_AVX512 };
    struct { int gptj, hd, rot; } shapes[4] = { { 0, 128, 128 }, { 1, 64, 64 },
                                                { 0, 96, 32 }, { 1, 80, 48 } };
    float scales[3] = { 1.0f, (float)(1.0 / 0.9), 0.37f };
    int64_t deltas[4] = { 2, -7, 0, 100003 };
    size_t nh = 3, n = 75;   /* not a multiple of the reseed interval */
    for (int sh = 0; sh < 4; sh++) {
        kvr_rope *r = engine(shapes[sh].gptj, shapes[sh].hd, shapes[sh].rot,
                             sh == 0 ? KVR_ROPE_SCALING_LLAMA3 : KVR_ROPE_SCALING_DEFAULT);
        size_t hd = (size_t)shapes[sh].hd, ne = n * nh * hd;
        for (int si = 0; si < 3; si++)
            for (int di = 0; di < 3; di++) {
                void *src = malloc(ne * 4), *a = malloc(ne * 4), *b = malloc(ne * 4);
                fill(src, dts[si], ne);
                for (int ii = 0; ii < 3; ii++)
                    for (int ki = 0; ki < 3; ki++)
                        for (int de = 0; de < 4; de++)
                            for (int th = 1; th <= 2; th++) {
                                size_t dsz = kvr_dtype_size(dts[di]);
                                memset(a, 0x55, ne * 4);
                                memset(b, 0xaa, ne * 4);
                                reference(r, a, dts[di], src, dts[si], n, nh, hd, 1000,
                                          deltas[de], scales[ki], isas[ii]);
                                kvr_rope_opts o = { .isa = isas[ii], .n_threads = th };
                                cr_assert_eq(kvr_rope_reposition_delta(r, b, dts[di], src,
                                                                       dts[si], n, nh,
                                                                       deltas[de], scales[ki],
                                                                       &o), 0);
                                cr_assert_eq(memcmp(a, b, ne * dsz), 0,
                                             "shape %d src %d dst %d isa %d scale %d delta %d "
                                             "threads %d", sh, si, di, ii, ki, de, th);
                                if (ki == 0) {
                                    /* scale 1: exactly reposition's own output */
                                    int64_t *fr = malloc(n * 8), *to = malloc(n * 8);
                                    for (size_t t = 0; t < n; t++) {
                                        fr[t] = 1000 + (int64_t)t;
                                        to[t] = fr[t] + deltas[de];
                                    }
                                    cr_assert_eq(kvr_rope_reposition(r, a, dts[di], src,
                                                                     dts[si], n, nh, fr, to,
                                                                     &o), 0);
                                    cr_assert_eq(memcmp(a, b, ne * dsz), 0, "unscaled");
                                    free(fr);
                                    free(to);
                                }
                            }
                free(src);
                free(a);
                free(b);
            }
        kvr_rope_destroy(r);
    }
}

Test(read_fused, nope_layer_and_refusals)
{
    kvr_rope_config c;
    kvr_rope_config_init(&c);
    c.head_dim = 64;
    c.rotary_dim = 64;
    c.num_layers = 2;
    c.n_layer_kinds = 2;
    c.layer_kind[0] = KVR_ROPE_LAYER_GLOBAL;
    c.layer_kind[1] = KVR_ROPE_LAYER_NONE;
    kvr_rope *r = NULL;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_rope_create(&r, &c, &e), 0, "%s", e.msg);
    const kvr_rope *none = kvr_rope_layer(r, 1);
    size_t n = 9, ne = n * 2 * 64;
    uint16_t src[9 * 2 * 64], a[9 * 2 * 64], b[9 * 2 * 64];
    fill(src, KVR_DTYPE_F16, ne);
    kvr_convert_scaled(a, KVR_DTYPE_F16, src, KVR_DTYPE_F16, ne, 0.5f);
    cr_assert_eq(kvr_rope_reposition_delta(none, b, KVR_DTYPE_F16, src, KVR_DTYPE_F16, n, 2, 5,
                                           0.5f, NULL), 0);
    cr_assert_eq(memcmp(a, b, ne * 2), 0);
    cr_assert_eq(kvr_rope_reposition_delta(none, b, KVR_DTYPE_F16, src, KVR_DTYPE_F16, n, 2, 5,
                                           1.0f, NULL), 0);
    cr_assert_eq(memcmp(src, b, ne * 2), 0);
    /* a bad dtype, NULL buffers, in place across dtypes */
    cr_assert_eq(kvr_rope_reposition_delta(r, b, (kvr_dtype)9, src, KVR_DTYPE_F16, n, 2, 1,
                                           1.0f, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_rope_reposition_delta(r, NULL, KVR_DTYPE_F16, src, KVR_DTYPE_F16, n, 2, 1,
                                           0.5f, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_rope_reposition_delta(r, src, KVR_DTYPE_BF16, src, KVR_DTYPE_F16, n, 2, 1,
                                           0.5f, NULL), KVR_EINVAL);
    kvr_rope_destroy(r);

    /* dynamic NTK with two different tables is not a rotation by a delta */
    kvr_rope_config_init(&c);
    c.head_dim = 64;
    c.rotary_dim = 64;
    c.scaling = KVR_ROPE_SCALING_DYNAMIC;
    c.factor = 2;
    c.max_position_embeddings = 128;
    c.original_max_position_embeddings = 128;
    cr_assert_eq(kvr_rope_create(&r, &c, &e), 0, "%s", e.msg);
    kvr_rope_opts o = { .seq_len_from = 100, .seq_len_to = 1000 };
    cr_assert_eq(kvr_rope_reposition_delta(r, b, KVR_DTYPE_F16, src, KVR_DTYPE_F16, n, 2, 1,
                                           1.0f, &o), KVR_EINVAL);
    kvr_rope_destroy(r);
}

Test(read_fused, convert_scaled_matches_passes)
{
    kvr_dtype dts[3] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
    size_t n = 4133;
    float *f = malloc(n * 4);
    void *src = malloc(n * 4), *a = malloc(n * 4), *b = malloc(n * 4);
    for (int si = 0; si < 3; si++)
        for (int di = 0; di < 3; di++) {
            fill(src, dts[si], n);
            kvr_convert(f, KVR_DTYPE_F32, src, dts[si], n);
            for (size_t i = 0; i < n; i++)
                f[i] *= (float)(1.0 / 0.9);
            kvr_convert(a, dts[di], f, KVR_DTYPE_F32, n);
            kvr_convert_scaled(b, dts[di], src, dts[si], n, (float)(1.0 / 0.9));
            cr_assert_eq(memcmp(a, b, n * kvr_dtype_size(dts[di])), 0, "src %d dst %d", si, di);
        }
    free(f);
    free(src);
    free(a);
    free(b);
}

/* ---- the store ---------------------------------------------------------- */

#define NL 3
#define NH 2
#define HD 64
#define ROW (NH * HD)

static kvr_rope_config model_rope(void)
{
    kvr_rope_config c;
    kvr_rope_config_init(&c);
    c.head_dim = HD;
    c.rotary_dim = HD;
    c.theta = 500000;
    c.scaling = KVR_ROPE_SCALING_LLAMA3;
    c.factor = 8;
    c.low_freq_factor = 1;
    c.high_freq_factor = 4;
    c.original_max_position_embeddings = 8192;
    return c;
}

static kvr_store *mk(void)
{
    kvr_store_config cfg = { .block_tokens = 32 };
    kvr_store *s = kvt_store_new(&cfg);
    kvr_model_desc d = { .name = "m", .n_layers = NL, .n_kv_heads = NH, .head_dim = HD,
                         .dtype = KVR_DTYPE_F16, .rope = model_rope() };
    kvt_model_add(s, &d, NULL);
    return s;
}

static void fill_f16(void *arg, void *p, size_t bytes)
{
    (void)arg;
    fill(p, KVR_DTYPE_F16, bytes / 2);
}

static void put(kvr_store *s, const char *id, const char *prefix, size_t n, uint32_t tok0)
{
    uint32_t *tok = malloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++) tok[i] = tok0 + (uint32_t)i;
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = KVR_PUT_CREATE, .n_layers = NL,
                         .n_kv_heads = NH, .head_dim = HD, .dtype = KVR_DTYPE_F16,
                         .n_tokens = n, .tokens = tok, .prefix_ctx = prefix };
    kvt_put(s, &p, fill_f16, NULL);
    free(tok);
}

/* The f16 payload of a whole context as stored (no work) and its positions. */
static uint16_t *stored(kvr_store *s, const char *id, size_t *n, int64_t **pos)
{
    kvr_get_params gp = { .ctx_id = id, .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    kvr_get *g = NULL;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_get_begin(s, &gp, &g, &e), 0, "%s", e.msg);
    size_t bytes = kvr_get_payload_size(g);
    uint16_t *p = malloc(bytes);
    cr_assert_eq(kvr_get_copy_into(g, p, bytes, &e), 0, "%s", e.msg);
    const kvr_get_info *in = kvr_get_get_info(g);
    *n = in->n_tokens;
    *pos = malloc(*n * sizeof **pos);
    memcpy(*pos, in->positions, *n * sizeof **pos);
    kvr_get_end(g);
    return p;
}

/* Tokens [t0, t0+n) of layer l's keys (K) or values of a payload of N tokens. */
static size_t at(size_t N, size_t l, int kv, size_t t0, size_t dsz)
{
    return ((l * 2 + (size_t)kv) * N + t0) * ROW * dsz;
}

/* Reference for `cnt` tokens moved from `from` to `to` positions, folded by k. */
static void ref_keys(const kvr_rope *r, uint8_t *dst, kvr_dtype dt, const uint16_t *src,
                     size_t cnt, const int64_t *from, const int64_t *to, float k)
{
    float *f = malloc(cnt * ROW * sizeof *f);
    cr_assert_eq(kvr_rope_reposition(r, f, KVR_DTYPE_F32, src, KVR_DTYPE_F16, cnt, NH, from,
                                     to, NULL), 0);
    for (size_t i = 0; i < cnt * ROW; i++)
        f[i] *= k;
    kvr_convert(dst, dt, f, KVR_DTYPE_F32, cnt * ROW);
    free(f);
}

Test(read_fused, assemble_equals_reference)
{
    kvr_store *s = mk();
    put(s, "pre", NULL, 21, 1);
    const char *docs[3] = { "d0", "d1", "d2" };
    size_t len[3] = { 70, 33, 100 };
    for (int i = 0; i < 3; i++) put(s, docs[i], "pre", len[i], 1000 + 1000 * (uint32_t)i);
    kvr_rope_config rc = model_rope();
    kvr_rope *r = kvt_rope_new(&rc);
    kvr_dtype dts[3] = { KVR_DTYPE_F16, KVR_DTYPE_F32, KVR_DTYPE_BF16 };
    for (int lay = 0; lay < 2; lay++)
        for (int fold = 0; fold < 2; fold++)
            for (int di = 0; di < 3; di++) {
                kvr_dtype dt = dts[di];
                size_t dsz = kvr_dtype_size(dt);
                kvr_assemble_params ap = { .prefix = "pre", .docs = docs, .n_docs = 3,
                                           .layout = lay ? KVR_LAYOUT_SEQUENTIAL
                                                         : KVR_LAYOUT_PARALLEL,
                                           .dtype = dt, .fold_temperature = fold,
                                           .temperature = 0.8 };
                kvr_error e = { 0 };
                kvr_assemble *a = NULL;
                cr_assert_eq(kvr_store_assemble_begin(s, &ap, &a, &e), 0, "%s", e.msg);
                const kvr_assemble_info *in = kvr_assemble_get_info(a);
                size_t N = in->n_tokens, bytes = kvr_assemble_payload_size(a);
                uint8_t *got = malloc(bytes), *ref = malloc(bytes);
                cr_assert_eq(kvr_assemble_copy_into(a, got, bytes, &e), 0, "%s", e.msg);
                float k = fold ? (float)(1.0 / 0.8) : 1.0f;
                size_t t0 = 0;
                for (int i = -1; i < 3; i++) {
                    size_t n;
                    int64_t *pos;
                    uint16_t *sp = stored(s, i < 0 ? "pre" : docs[i], &n, &pos);
                    size_t skip = 0, cnt = n;   /* a document holds its own tokens */
                    float kk = i < 0 ? 1.0f : k;
                    for (size_t l = 0; l < NL; l++) {
                        const uint16_t *ks = sp + ((l * 2) * n + skip) * ROW;
                        const uint16_t *vs = sp + ((l * 2 + 1) * n + skip) * ROW;
                        ref_keys(r, ref + at(N, l, 0, t0, dsz), dt, ks, cnt, pos + skip,
                                 in->positions + t0, kk);
                        kvr_convert(ref + at(N, l, 1, t0, dsz), dt, vs, KVR_DTYPE_F16,
                                    cnt * ROW);
                    }
                    t0 += cnt;
                    free(sp);
                    free(pos);
                }
                cr_assert_eq(t0, N);
                cr_assert_eq(memcmp(ref, got, bytes), 0, "layout %d fold %d dtype %d", lay,
                             fold, di);
                /* work + iovecs: the same bytes */
                kvr_assemble *b = NULL;
                cr_assert_eq(kvr_store_assemble_begin(s, &ap, &b, &e), 0, "%s", e.msg);
                if (kvr_assemble_needs_work(b))
                    cr_assert_eq(kvr_assemble_work(b, &e), 0, "%s", e.msg);
                const struct iovec *iov;
                size_t niov;
                kvr_assemble_payload_iov(b, &iov, &niov);
                uint8_t *viaiov = malloc(bytes);
                cr_assert_eq(kvt_gather(viaiov, iov, niov), bytes);
                cr_assert_eq(memcmp(ref, viaiov, bytes), 0, "iovecs: layout %d fold %d dtype %d",
                             lay, fold, di);
                free(viaiov);
                kvr_assemble_end(b);
                kvr_assemble_end(a);
                free(got);
                free(ref);
            }
    kvr_rope_destroy(r);
    kvr_store_destroy(s);
}

Test(read_fused, get_after_edit_equals_reference)
{
    kvr_store *s = mk();
    size_t n0 = 150;
    put(s, "c", NULL, n0, 7);
    size_t n;
    int64_t *pos0;
    uint16_t *orig = stored(s, "c", &n, &pos0);
    /* replace [10, 12) with 3 new tokens (KV sent): the suffix moves by +1 */
    uint32_t nt[3] = { 900, 901, 902 };
    kvr_edit_op op = { 10, 12, 3, nt, false };
    kvr_edit_params p = { .ctx_id = "c", .ops = &op, .n_ops = 1, .with_kv = true,
                          .n_layers = NL, .n_kv_heads = NH, .head_dim = HD,
                          .dtype = KVR_DTYPE_F16, .payload_bytes = 3 * NL * 2 * ROW * 2 };
    kvr_error e = { 0 };
    kvr_edit *t = NULL;
    cr_assert_eq(kvr_store_edit_begin(s, &p, &t, &e), 0, "%s", e.msg);
    const struct iovec *iov;
    size_t niov;
    kvr_edit_payload_iov(t, &iov, &niov);
    for (size_t i = 0; i < niov; i++)
        fill(iov[i].iov_base, KVR_DTYPE_F16, iov[i].iov_len / 2);
    if (kvr_edit_needs_work(t))
        cr_assert_eq(kvr_edit_work(t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_edit_commit(t, NULL, NULL, &e), 0, "%s", e.msg);
    kvr_rope_config rc = model_rope();
    kvr_rope *r = kvt_rope_new(&rc);
    kvr_dtype dts[3] = { KVR_DTYPE_F16, KVR_DTYPE_F32, KVR_DTYPE_BF16 };
    for (int di = 0; di < 3; di++) {
        kvr_dtype dt = dts[di];
        size_t dsz = kvr_dtype_size(dt);
        for (int into = 0; into < 2; into++) {
            kvr_get_params gp = { .ctx_id = "c", .end = SIZE_MAX, .dtype = dt };
            kvr_get *g = NULL;
            cr_assert_eq(kvr_store_get_begin(s, &gp, &g, &e), 0, "%s", e.msg);
            const kvr_get_info *in = kvr_get_get_info(g);
            size_t N = in->n_tokens, bytes = kvr_get_payload_size(g);
            cr_assert_eq(N, n0 + 1);
            uint8_t *got = malloc(bytes);
            if (into) {
                cr_assert_eq(kvr_get_copy_into(g, got, bytes, &e), 0, "%s", e.msg);
            } else {
                if (kvr_get_needs_work(g))
                    cr_assert_eq(kvr_get_work(g, &e), 0, "%s", e.msg);
                const struct iovec *gi;
                size_t gn;
                kvr_get_payload_iov(g, &gi, &gn);
                cr_assert_eq(kvt_gather(got, gi, gn), bytes);
            }
            /* the suffix: original tokens [12, n0) now at [13, n0 + 1) */
            size_t cnt = n0 - 12;
            uint8_t *ref = malloc(cnt * ROW * 4);
            for (size_t l = 0; l < NL; l++) {
                const uint16_t *ks = orig + ((l * 2) * n0 + 12) * ROW;
                ref_keys(r, ref, dt, ks, cnt, pos0 + 12, in->positions + 13, 1.0f);
                cr_assert_eq(memcmp(ref, got + at(N, l, 0, 13, dsz), cnt * ROW * dsz), 0,
                             "keys dtype %d layer %zu into %d", di, l, into);
                kvr_convert(ref, dt, orig + ((l * 2 + 1) * n0 + 12) * ROW, KVR_DTYPE_F16,
                            cnt * ROW);
                cr_assert_eq(memcmp(ref, got + at(N, l, 1, 13, dsz), cnt * ROW * dsz), 0,
                             "values");
                kvr_convert(ref, dt, orig + (l * 2) * n0 * ROW, KVR_DTYPE_F16, 10 * ROW);
                cr_assert_eq(memcmp(ref, got + at(N, l, 0, 0, dsz), 10 * ROW * dsz), 0,
                             "prefix keys");
            }
            free(ref);
            free(got);
            kvr_get_end(g);
        }
    }
    kvr_rope_destroy(r);
    free(orig);
    free(pos0);
    kvr_store_destroy(s);
}
