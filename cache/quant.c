/*
 * quant.c — K/V codecs at rest in the store: codec specs, quantized blocks,
 * encoding a put's data into them and reading them back.
 *
 * A context's codec (kvr_qspec) is plain (its blocks hold K/V in one float
 * dtype, keys rotated at their stored-at positions: the historical format)
 * or quantized. A quantized context has two kinds of blocks:
 *   - quantized blocks (block->quant): per layer, K then V, each an encoded
 *     slab (codec.h rows per token, or KIVI tiles of `ktile` tokens for a
 *     per-channel K codec); keys are stored UN-ROTATED (pre-RoPE, as
 *     KVQuant does), so a token's stored-at position is metadata only and
 *     every position change (edit, shift, assemble, groups, sinks) is exact
 *     and never re-quantizes anything. A read dequantizes and applies RoPE
 *     at the target positions in one pass (kvr_rope_apply).
 *   - window blocks: plain blocks in the model's dtype holding the most
 *     recent tokens appended by put, rotated as a plain context would hold
 *     them. A put moves window tokens older than the window (and, for
 *     tiles, in whole tiles) into quantized blocks in its work function
 *     (off the loop thread), un-rotating their keys in f32 first.
 *
 * Invariants: a quantized block's slots below `used` never change; a K
 * tile is only ever written whole (a partial last tile is padded by
 * repeating its last token, and no later put appends to a block whose
 * `used` is not on a tile boundary). Blocks are never written once shared.
 */
#include <assert.h>
#include <math.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/quant.h"

/* ---- specs --------------------------------------------------------------- */

#define DEFAULT_KTILE  KVR_CODEC_K4V2_KTILE    /* "k4v2": keys per channel, 128 tokens */
#define DEFAULT_VGROUP KVR_CODEC_K4V2_VGROUP   /* "k4v2": values per token, 256 channels */
#define DEFAULT_WINDOW KVR_CODEC_K4V2_WINDOW
#define MAX_WINDOW     (1u << 20)

static int parse_bits(const char *s, kvr_codec_type *t)
{
    if (s[0] == '8') { *t = KVR_CODEC_INT8; return 1; }
    if (s[0] == '4') { *t = KVR_CODEC_INT4; return 1; }
    if (s[0] == '2') { *t = KVR_CODEC_INT2; return 1; }
    return 0;
}

/* "int4/g128/c" etc. */
static int parse_side(const char *s, kvr_codec *c)
{
    char buf[48];
    size_t n = strlen(s);
    if (n == 0 || n >= sizeof buf)
        return KVR_EINVAL;
    memcpy(buf, s, n + 1);
    bool chan = false;
    if (n > 2 && strcmp(buf + n - 2, "/c") == 0) {
        chan = true;
        buf[n - 2] = '\0';
    }
    if (kvr_codec_parse(buf, c) != 0)
        return KVR_EINVAL;
    if (chan)
        c->axis = KVR_CODEC_AXIS_CHANNEL;
    return kvr_codec_validate(c) == 0 ? 0 : KVR_EINVAL;
}

static bool parse_uint(const char *s, const char **end, uint32_t *out)
{
    char *e;
    if (*s < '0' || *s > '9')
        return false;
    unsigned long v = strtoul(s, &e, 10);
    if (v > MAX_WINDOW * 4ul)
        return false;
    *out = (uint32_t)v;
    *end = e;
    return true;
}

static void side_name(char *out, size_t cap, const kvr_codec *c)
{
    if (kvr_codec_is_uniform(c->type))
        snprintf(out, cap, "%s/g%u%s", kvr_codec_type_name(c->type), kvr_codec_group(c),
                 c->axis == KVR_CODEC_AXIS_CHANNEL ? "/c" : "");
    else
        snprintf(out, cap, "%s", kvr_codec_type_name(c->type));
}

static bool is_plain(kvr_codec_type t)
{
    return t == KVR_CODEC_F32 || t == KVR_CODEC_F16 || t == KVR_CODEC_BF16;
}

static kvr_dtype plain_dtype(kvr_codec_type t)
{
    return t == KVR_CODEC_F32 ? KVR_DTYPE_F32 : t == KVR_CODEC_F16 ? KVR_DTYPE_F16
                                                                    : KVR_DTYPE_BF16;
}

int kvr_qspec_parse(const char *spec, const kvr_rope_config *rc, const char *model,
                    uint32_t row, kvr_dtype mdt, kvr_qspec *out, kvr_error *err)
{
    memset(out, 0, sizeof *out);
    out->dtype = mdt;
    if (!spec || !spec[0]) {
        snprintf(out->name, sizeof out->name, "%s", kvr_dtype_name(mdt));
        return 0;
    }
    kvr_codec_pair p;
    memset(&p, 0, sizeof p);
    kvr_dtype dt;
    const char *e;
    if (strlen(spec) >= 128)
        goto bad;
    if (kvr_dtype_parse(spec, &dt) == 0) {
        out->dtype = dt;
        snprintf(out->name, sizeof out->name, "%s", kvr_dtype_name(dt));
        return 0;
    }
    if (strcmp(spec, "quant") == 0 || strcmp(spec, "default") == 0)
        spec = "k4v2";
    if (spec[0] == 'k' && spec[1] && parse_bits(spec + 1, &p.k.type) && spec[2] == 'v' &&
        spec[3] && parse_bits(spec + 3, &p.v.type) && spec[4] == '\0') {
        p.k.group = DEFAULT_KTILE;
        p.k.axis = KVR_CODEC_AXIS_CHANNEL;
        p.v.group = DEFAULT_VGROUP;
        p.window = DEFAULT_WINDOW;
    } else if (strncmp(spec, "kivi:k", 6) == 0) {
        const char *q = spec + 6;
        if (!parse_bits(q, &p.k.type) || q[1] != 'v' || !parse_bits(q + 2, &p.v.type))
            goto bad;
        q += 3;
        uint32_t g = DEFAULT_KTILE, r = DEFAULT_WINDOW;
        while (*q) {
            if (q[0] == ':' && q[1] == 'g' && parse_uint(q + 2, &e, &g))
                q = e;
            else if (q[0] == ':' && q[1] == 'r' && parse_uint(q + 2, &e, &r))
                q = e;
            else
                goto bad;
        }
        p.k.group = p.v.group = g;
        p.k.axis = KVR_CODEC_AXIS_CHANNEL;
        p.window = r;
    } else if (strncmp(spec, "k=", 2) == 0) {
        char buf[128];
        memcpy(buf, spec, strlen(spec) + 1);
        char *vpart = strstr(buf, ",v=");
        if (!vpart)
            goto bad;
        *vpart = '\0';
        vpart += 3;
        char *rpart = strstr(vpart, ",r=");
        if (rpart) {
            *rpart = '\0';
            rpart += 3;
            if (!parse_uint(rpart, &e, &p.window) || *e)
                goto bad;
        }
        if (parse_side(buf + 2, &p.k) != 0 || parse_side(vpart, &p.v) != 0)
            goto bad;
    } else {
        if (parse_side(spec, &p.k) != 0)
            goto bad;
        p.v = p.k;
    }
    if (kvr_codec_validate(&p.k) != 0 || kvr_codec_validate(&p.v) != 0)
        goto bad;
    if (p.v.axis != KVR_CODEC_AXIS_TOKEN)
        return kvr_error_set(err, KVR_EINVAL, "codec '%s': values are grouped per token "
                             "(no /c on v)", spec);
    if (p.window > MAX_WINDOW)
        return kvr_error_set(err, KVR_EINVAL, "codec '%s': window over %u tokens", spec,
                             MAX_WINDOW);
    if (is_plain(p.k.type) && p.k.type == p.v.type && p.window == 0) {
        out->dtype = plain_dtype(p.k.type);
        snprintf(out->name, sizeof out->name, "%s", kvr_dtype_name(out->dtype));
        return 0;
    }
    if (!kvr_rope_config_composes(rc))
        return kvr_error_set(err, KVR_EUNSUPPORTED, "codec '%s': quantized keys are stored "
                             "pre-RoPE, and model '%s' uses length-dependent RoPE scaling",
                             spec, model);
    if (kvr_codec_row_bytes(&p.k, row) == 0 || kvr_codec_row_bytes(&p.v, row) == 0)
        return kvr_error_set(err, KVR_EINVAL, "codec '%s' does not fit rows of %u values "
                             "(ggml blocks need a multiple of 32)", spec, row);
    out->quant = true;
    out->pair = p;
    char ks[20], vs[20];
    side_name(ks, sizeof ks, &p.k);
    side_name(vs, sizeof vs, &p.v);
    snprintf(out->name, sizeof out->name, "k=%s,v=%s,r=%u", ks, vs, p.window);
    return 0;

bad:
    return kvr_error_set(err, KVR_EINVAL,
                         "bad codec spec '%.128s' (expected f32|f16|bf16, int8|int4|int2"
                         "[/gN], q8_0|q4_0|q4_1|q5_0, k4v2-style k<b>v<b>, "
                         "kivi:k<b>v<b>[:gG][:rR], or k=<codec>[/c],v=<codec>[,r=R])",
                         spec);
}

uint32_t kvr_qspec_ktile(const kvr_qspec *q)
{
    if (!q->quant || q->pair.k.axis != KVR_CODEC_AXIS_CHANNEL)
        return 1;
    return kvr_codec_group(&q->pair.k);
}

uint32_t kvr_qspec_block_cap(const kvr_qspec *q, uint32_t B)
{
    uint32_t g = kvr_qspec_ktile(q);
    return (B + g - 1) / g * g;
}

/* ---- blocks -------------------------------------------------------------- */

static size_t align64(size_t n)
{
    return (n + KVR_BLOCK_ALIGN - 1) & ~(size_t)(KVR_BLOCK_ALIGN - 1);
}

void kvr_qspec_geom(const kvr_qspec *q, uint32_t B, uint32_t n_layers, uint32_t row,
                    kvr_block_geom *g)
{
    assert(q->quant);
    memset(g, 0, sizeof *g);
    g->cap = kvr_qspec_block_cap(q, B);
    g->row = row;
    g->n_layers = n_layers;
    g->dtype = q->dtype;
    g->quant = true;
    kvr_qhdr *h = &g->qh;
    h->kc = q->pair.k;
    h->vc = q->pair.v;
    h->ktile = kvr_qspec_ktile(q);
    h->krow = h->ktile > 1 ? kvr_codec_tile_bytes(&q->pair.k, row)
                           : kvr_codec_row_bytes(&q->pair.k, row);
    h->vrow = kvr_codec_row_bytes(&q->pair.v, row);
    h->kslab = align64(h->krow * (g->cap / h->ktile));
    h->vslab = align64(h->vrow * g->cap);
}

/* ---- encode / decode ----------------------------------------------------- */

/* Rows of one side are consecutive slots, and a row of `row` values whose
 * group divides it is exactly its groups back to back, so `count` rows
 * encode/decode as one row of count*row values (codec.h's layout). */
static bool rows_concat(const kvr_codec *c, size_t row)
{
    return kvr_codec_is_uniform(c->type) ? row % kvr_codec_group(c) == 0
                                         : kvr_codec_is_ggml(c->type) && row % 32 == 0;
}

/* The error measure: per row (or per tile), e ~ sum (dec - ref)^2 and q ~
 * sum ref^2 in the fixed order codec.h defines (kvr_codec_err_rows: float
 * lanes flushed into doubles, the same doubles on every ISA), then added to
 * *sse / *ss in row order: the totals do not depend on the ISA or on how
 * the sides were spread over threads. */
static inline void acc_add(kvr_qacc *a, double e, double q)
{
    if (a->rec) {
        assert(a->n < a->cap);
        a->rec[2 * a->n] = e;
        a->rec[2 * a->n + 1] = q;
        a->n++;
        return;
    }
    *a->sse += e;
    *a->ss += q;
}

void kvr_qacc_replay(const kvr_qacc *a, double *sse, double *ss)
{
    for (size_t i = 0; i < a->n; i++) {
        *sse += a->rec[2 * i];
        *ss += a->rec[2 * i + 1];
    }
}

/* The sums of n_rows rows (kvr_codec_err_rows), added to acc in row
 * order. */
#define ACC_ROWS 64u
static void acc_rows(const kvr_codec *c, const void *ref, kvr_dtype rdt, const float *dec,
                     size_t n_rows, size_t len, kvr_qacc *acc)
{
    double e[ACC_ROWS], q[ACC_ROWS];
    for (size_t i0 = 0; i0 < n_rows; i0 += ACC_ROWS) {
        size_t k = n_rows - i0 < ACC_ROWS ? n_rows - i0 : ACC_ROWS;
        if (rdt == KVR_DTYPE_F16)
            kvr_codec_err_rows_f16(c->isa, (const uint16_t *)ref + i0 * len, dec + i0 * len,
                                   k, len, e, q);
        else
            kvr_codec_err_rows(c->isa, (const float *)ref + i0 * len, dec + i0 * len, k, len,
                               e, q);
        for (size_t i = 0; i < k; i++)
            acc_add(acc, e[i], q[i]);
    }
}

/* Makes *buf hold at least n floats (contents not kept). */
static bool grow(float **buf, size_t *cap, size_t n)
{
    if (*cap >= n)
        return true;
    kvr_mem_free(*buf);
    *cap = 0;
    if (!(*buf = kvr_mem_malloc(n * sizeof **buf)))
        return false;
    *cap = n;
    return true;
}

/* Rows per batch of a row-coded side: encoded and measured in one pass
 * (kvr_codec_encode_measured), or else decoded into `big` for the measure
 * (the tile path needs its own buffer anyway). */
#define ACC_BATCH 64u

/* The sums of k rows encoded back to back at dst (codec c, row values
 * each) against src: decoded into *big (grown to k rows) and measured, or
 * one row at a time through scratch where *big cannot grow. */
static void measure_decoded(const kvr_codec *c, const uint8_t *dst, const void *src,
                            kvr_dtype sdt, uint32_t k, size_t row, float **big, size_t *big_n,
                            float *scratch, kvr_qacc *acc)
{
    if (k > 1 && grow(big, big_n, (size_t)k * row)) {
        kvr_codec_decode(c, *big, KVR_DTYPE_F32, dst, (size_t)k * row);
        acc_rows(c, src, sdt, *big, k, row, acc);
        return;
    }
    size_t rb = kvr_codec_row_bytes(c, row), es = kvr_dtype_size(sdt);
    for (uint32_t i = 0; i < k; i++) {
        kvr_codec_decode(c, scratch, KVR_DTYPE_F32, dst + i * rb, row);
        acc_rows(c, (const char *)src + i * row * es, sdt, scratch, 1, row, acc);
    }
}

int kvr_quant_encode_side(const kvr_brun *runs, size_t n_runs, uint32_t layer, int kv,
                          const void *src, kvr_dtype sdt, float *scratch, kvr_qacc *acc)
{
    size_t row = n_runs ? runs[0].b->row : 0, bad = 0;
    /* f16 rows (a payload encoded where it lies) are row-coded sides only */
    const uint16_t *xh = sdt == KVR_DTYPE_F16 ? src : NULL;
    const float *x = sdt == KVR_DTYPE_F16 ? NULL : src;
    float *big = NULL;   /* decode buffer for batched rows / whole tiles */
    size_t big_n = 0;
    int rc = 0;
    for (size_t r = 0; r < n_runs && rc == 0; r++) {
        const kvr_block *b = runs[r].b;
        const kvr_codec *c = kv ? &KVR_QH(b)->vc : &KVR_QH(b)->kc;
        if (kv || KVR_QH(b)->ktile == 1) {
            bool cat = rows_concat(c, row);
            for (uint32_t j = 0; j < runs[r].count && rc == 0;) {
                uint32_t k = cat ? (runs[r].count - j < ACC_BATCH ? runs[r].count - j
                                                                   : ACC_BATCH)
                                 : 1;
                uint8_t *dst = kvr_block_kv(b, layer, kv, runs[r].first + j);
                const void *xs = xh ? (const void *)xh : (const void *)x;
                /* encoded and measured in one pass where a kernel does it
                 * (nothing decoded: no batch buffer); else encoded, decoded
                 * and measured */
                double e[ACC_BATCH], q[ACC_BATCH];
                rc = cat ? kvr_codec_encode_measured(c, dst, xs, sdt, k, row, scratch, e, q,
                                                     &bad)
                         : 1;
                if (rc == 0) {
                    for (uint32_t i = 0; i < k; i++)
                        acc_add(acc, e[i], q[i]);
                } else if (rc == 1 &&
                           (rc = kvr_codec_encode(c, dst, xs, sdt, (size_t)k * row, &bad)) == 0) {
                    measure_decoded(c, dst, xs, sdt, k, row, &big, &big_n, scratch, acc);
                }
                if (xh)
                    xh += (size_t)k * row;
                else
                    x += (size_t)k * row;
                j += k;
            }
            continue;
        }
        /* K tiles: up to 4 whole tiles encoded and decoded, then measured
         * (acc_rows, one row of the measure per tile). */
        assert(x);
        uint32_t G = KVR_QH(b)->ktile;
        size_t tile = (size_t)G * row;
        if (!grow(&big, &big_n, 4 * tile))
            rc = KVR_ENOMEM;
        for (uint32_t j = 0; j < runs[r].count && rc == 0;) {
            uint32_t left = runs[r].count - j, nt = left / G < 4 ? left / G : 4;
            if (nt > 0) {
                for (uint32_t i = 0; i < nt && rc == 0; i++) {
                    uint8_t *dst = kvr_block_kv(b, layer, 0, runs[r].first + j + i * G);
                    rc = kvr_codec_encode_tile(c, dst, x + i * tile, KVR_DTYPE_F32, row, row,
                                               &bad);
                    if (rc == 0)
                        kvr_codec_decode_tile(c, big + i * tile, KVR_DTYPE_F32, row, dst, row);
                }
                if (rc != 0)
                    break;
                acc_rows(c, x, KVR_DTYPE_F32, big, nt, tile, acc);
                x += nt * tile;
                j += nt * G;
                continue;
            }
            /* The run's partial last tile, padded by repeating its last token. */
            uint32_t k = left;
            memcpy(scratch, x, (size_t)k * row * sizeof *scratch);
            for (uint32_t t = k; t < G; t++)
                memcpy(scratch + (size_t)t * row, x + (size_t)(k - 1) * row,
                       row * sizeof *scratch);
            uint8_t *dst = kvr_block_kv(b, layer, 0, runs[r].first + j);
            rc = kvr_codec_encode_tile(c, dst, scratch, KVR_DTYPE_F32, row, row, &bad);
            if (rc != 0)
                break;
            float *dec = scratch + tile;
            kvr_codec_decode_tile(c, dec, KVR_DTYPE_F32, row, dst, row);
            acc_rows(c, x, KVR_DTYPE_F32, dec, 1, (size_t)k * row, acc);
            x += (size_t)k * row;
            j += k;
        }
    }
    kvr_mem_free(big);
    return rc;
}

/* Decodes slots [first, first+count) of a row-coded side (V, or per-token
 * K) into dst (odt): one call when the rows concatenate. */
static void decode_rows(const kvr_block *b, uint32_t layer, int kv, uint32_t first,
                        uint32_t count, void *dst, kvr_dtype odt, bool stream)
{
    size_t row = b->row, osz = kvr_dtype_size(odt);
    const kvr_codec *c = kv ? &KVR_QH(b)->vc : &KVR_QH(b)->kc;
    int (*dec)(const kvr_codec *, void *, kvr_dtype, const void *, size_t) =
        stream ? kvr_codec_decode_stream : kvr_codec_decode;
    if (rows_concat(c, row)) {
        dec(c, dst, odt, kvr_block_kv(b, layer, kv, first), (size_t)count * row);
        return;
    }
    for (uint32_t j = 0; j < count; j++)
        dec(c, (uint8_t *)dst + (size_t)j * row * osz, odt, kvr_block_kv(b, layer, kv, first + j),
            row);
}

/* Rows of per-token keys decoded for kvr_rope_apply_src a few at a time:
 * up to KEY_ROWS_L1 floats (16 KiB, in L1 beside the rotation's tables). */
#define KEY_ROWS_L1 4096u
typedef struct key_rows {
    const kvr_block *b;
    uint32_t layer, first, count;   /* the piece's slots */
    float   *buf;
    size_t   row;
    uint32_t cap, have, at;         /* rows the buffer holds, from piece row `at` */
} key_rows;

static const float *key_rows_src(void *ud, size_t t)
{
    key_rows *k = ud;
    if (t < k->at || t >= (size_t)k->at + k->have) {
        uint32_t n = k->count - (uint32_t)t < k->cap ? k->count - (uint32_t)t : k->cap;
        decode_rows(k->b, k->layer, 0, k->first + (uint32_t)t, n, k->buf, KVR_DTYPE_F32, false);
        k->at = (uint32_t)t;
        k->have = n;
    }
    return k->buf + (t - k->at) * k->row;
}

int kvr_block_read_side(const kvr_rope *engine, uint32_t n_heads, const kvr_block *b,
                        uint32_t layer, int kv, uint32_t first, uint32_t count, void *dst,
                        kvr_dtype odt, const int64_t *from, const int64_t *to,
                        float *scratch, const kvr_rope_opts *ro)
{
    size_t row = b->row;
    if (!b->quant) {
        const uint8_t *src = kvr_block_kv(b, layer, kv, first);
        if (kv || !from || !to) {
            kvr_convert(dst, odt, src, b->dtype, count * row);
            return 0;
        }
        return kvr_rope_reposition(engine, dst, odt, src, b->dtype, count,
                                   n_heads, from, to, ro);
    }
    if (kv) {
        decode_rows(b, layer, 1, first, count, dst, odt, ro && ro->stream);
        return 0;
    }
    /* Keys: dequantize a piece (a tile, or a bounded run of rows) and rotate
     * it to its targets while it is still in cache: a tile into the f32
     * scratch; rows a few at a time, as the rotation asks for them
     * (kvr_rope_apply_src: the same rotation, pieces of 64 tokens as
     * before, so the same tables and bits), into L1-sized scratch. */
    size_t osz = kvr_dtype_size(odt);
    uint32_t G = KVR_QH(b)->ktile, s = first, end = first + count;
    uint32_t piece = G > 1 ? G : 64;
    while (s < end) {
        uint32_t t0 = G > 1 ? s / G * G : s;
        uint32_t e = t0 + piece < end ? t0 + piece : end;
        uint8_t *out = (uint8_t *)dst + (size_t)(s - first) * row * osz;
        int rc;
        if (G > 1) {
            kvr_codec_decode_tile(&KVR_QH(b)->kc, scratch, KVR_DTYPE_F32, row,
                                  kvr_block_kv(b, layer, 0, t0), row);
            rc = kvr_rope_apply(engine, out, odt, scratch + (size_t)(s - t0) * row,
                                KVR_DTYPE_F32, e - s, n_heads, to + (s - first), ro);
        } else {
            key_rows kr = { .b = b, .layer = layer, .first = s, .count = e - s,
                            .buf = scratch, .row = row, .have = 0, .at = 0 };
            kr.cap = row <= KEY_ROWS_L1 ? (uint32_t)(KEY_ROWS_L1 / row) : 1;
            rc = kvr_rope_apply_src(engine, out, odt, key_rows_src, &kr, e - s, n_heads,
                                    to + (s - first), ro);
        }
        if (rc != 0)
            return rc;
        s = e;
    }
    return 0;
}

bool kvr_quant_find_nonfinite(const void *payload, kvr_dtype dt, uint32_t n_layers, size_t n,
                          size_t row, uint32_t *layer, int *kv, size_t *tok)
{
    size_t per = n * row, total = per * 2u * n_layers, i = total;
    /* The common case, no bad value: one vector pass at memory speed. */
    if (kvr_isa_best() != KVR_ISA_SCALAR && !kvr_any_nonfinite_avx2(payload, dt, total))
        return false;
    /* A branch-free pass per block (vectorised by the compiler) finds the
     * block, a scalar pass the first element in it. */
    enum { BLK = 4096 };
    for (size_t b0 = 0; b0 < total && i == total; b0 += BLK) {
        size_t e = total - b0 < BLK ? total - b0 : BLK;
        unsigned any = 0;
        if (dt == KVR_DTYPE_F32) {
            const uint32_t *u = (const uint32_t *)payload + b0;
            for (size_t k = 0; k < e; k++)
                any |= (u[k] & 0x7f800000u) == 0x7f800000u;
            if (!any)
                continue;
            const float *f = (const float *)payload + b0;
            for (size_t k = 0; k < e; k++)
                if (!isfinite(f[k])) {
                    i = b0 + k;
                    break;
                }
        } else {
            const uint16_t *h = (const uint16_t *)payload + b0;
            uint16_t mask = dt == KVR_DTYPE_F16 ? 0x7c00u : 0x7f80u;
            for (size_t k = 0; k < e; k++)
                any |= (h[k] & mask) == mask;
            if (!any)
                continue;
            for (size_t k = 0; k < e; k++)
                if ((h[k] & mask) == mask) {
                    i = b0 + k;
                    break;
                }
        }
    }
    if (i == total)
        return false;
    *layer = (uint32_t)(i / (2 * per));
    *kv = (int)(i / per % 2);
    *tok = i % per / row;
    return true;
}
