/*
 * bridge_state.c — llama.cpp sequence states in memory: parse (either form),
 * decode cells into kvrope's layer-major payload, encode a payload back into
 * a state; the ggml element codecs (blocks: base/ggml_quants.c, shared with
 * the store) and the Walsh-Hadamard transform they need.
 *
 * The format (llama.cpp v0.5.0, llama-context.cpp / llama-kv-cache.cpp), LE:
 *   raw:     u32 0xaf143cd8, i32 seq_id, MEM
 *   session: u32 'ggsq', u32 3, u32 n, i32 tokens[n], MEM
 *   MEM:     u32 n_stream, per stream: u32 cell_count; if > 0:
 *            cell_count x { i32 pos, u32 n_seq_id, [12 bytes ext: M-RoPE],
 *                           i32 seq_id[n_seq_id] }
 *            u32 v_trans, u32 n_layer,
 *            n_layer x { i32 type_k, u64 row bytes, cell_count rows }
 *            v_trans 0: n_layer x { i32 type_v, u64 row bytes, cell_count rows }
 *            v_trans 1: n_layer x { i32 type_v, u32 element bytes, u32 n_embd_v,
 *                                   n_embd_v runs of cell_count elements }
 *
 * Invariants: the parser reads nothing beyond len and allocates nothing in
 * proportion to a declared size before checking that the bytes are present;
 * every refusal names the field and the cell/layer. Parsed K/V pointers
 * borrow the caller's bytes. Decoding a float row into the same type copies
 * bytes; all arithmetic on quantized rows is float, in ggml's order.
 */
#include "client/llama/bridge_int.h"
#include "base/ggml_quants.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

int kvr__br_fail(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* ---- types ---------------------------------------------------------------- */

static const struct {
    kvr_llama_type t;
    int            ggml;
    const char    *name;
    uint32_t       blck, bytes;
} TYPES[] = {
    { KVR_LLAMA_F32,  0,  "f32",  1,  4 },
    { KVR_LLAMA_F16,  1,  "f16",  1,  2 },
    { KVR_LLAMA_BF16, 30, "bf16", 1,  2 },
    { KVR_LLAMA_Q8_0, 8,  "q8_0", 32, 34 },
    { KVR_LLAMA_Q4_0, 2,  "q4_0", 32, 18 },
    { KVR_LLAMA_Q4_1, 3,  "q4_1", 32, 20 },
    { KVR_LLAMA_Q5_0, 6,  "q5_0", 32, 22 },
};
#define N_TYPES (sizeof TYPES / sizeof TYPES[0])

static kvr_llama_type norm_type(kvr_llama_type t)
{
    return t == KVR_LLAMA_TYPE_DEFAULT ? KVR_LLAMA_F16 : t;
}

kvr_llama_type kvr_llama_type_from_ggml(int g)
{
    for (size_t i = 0; i < N_TYPES; i++)
        if (TYPES[i].ggml == g) return TYPES[i].t;
    return KVR_LLAMA_TYPE_DEFAULT;
}

int kvr_llama_type_to_ggml(kvr_llama_type t)
{
    t = norm_type(t);
    for (size_t i = 0; i < N_TYPES; i++)
        if (TYPES[i].t == t) return TYPES[i].ggml;
    return -1;
}

const char *kvr_llama_type_name(kvr_llama_type t)
{
    t = norm_type(t);
    for (size_t i = 0; i < N_TYPES; i++)
        if (TYPES[i].t == t) return TYPES[i].name;
    return "?";
}

int kvr_llama_type_parse(const char *s, kvr_llama_type *out)
{
    if (!s) return KVR_EINVAL;
    for (size_t i = 0; i < N_TYPES; i++)
        if (strcmp(s, TYPES[i].name) == 0) {
            *out = TYPES[i].t;
            return 0;
        }
    return KVR_EINVAL;
}

bool kvr_llama_type_is_quantized(kvr_llama_type t)
{
    t = norm_type(t);
    return t == KVR_LLAMA_Q8_0 || t == KVR_LLAMA_Q4_0 || t == KVR_LLAMA_Q4_1 ||
           t == KVR_LLAMA_Q5_0;
}

void kvr__br_type_geom(kvr_llama_type t, uint32_t *blck, uint32_t *bytes)
{
    t = norm_type(t);
    *blck = 0;
    *bytes = 0;
    for (size_t i = 0; i < N_TYPES; i++)
        if (TYPES[i].t == t) {
            *blck = TYPES[i].blck;
            *bytes = TYPES[i].bytes;
        }
}

uint64_t kvr__br_row_bytes(kvr_llama_type t, uint64_t n)
{
    uint32_t b, s;
    kvr__br_type_geom(t, &b, &s);
    if (!b || n % b) return 0;
    return n / b * s;
}

static kvr_dtype plain_dtype(kvr_llama_type t)
{
    switch (norm_type(t)) {
    case KVR_LLAMA_F32:  return KVR_DTYPE_F32;
    case KVR_LLAMA_BF16: return KVR_DTYPE_BF16;
    default:             return KVR_DTYPE_F16;
    }
}

static bool is_plain(kvr_llama_type t) { return !kvr_llama_type_is_quantized(t); }

/* ---- ggml blocks (base/ggml_quants.c: ggml's reference quantizers) ------- */

#define QK KVR_GGML_QK

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

void kvr__br_row_to_f32(kvr_llama_type t, float *dst, const uint8_t *src, size_t n)
{
    t = norm_type(t);
    if (is_plain(t)) {
        kvr_convert(dst, KVR_DTYPE_F32, src, plain_dtype(t), n);
        return;
    }
    uint32_t b, s;
    kvr__br_type_geom(t, &b, &s);
    kvr_ggml_qtype q = (kvr_ggml_qtype)kvr_llama_type_to_ggml(t);
    for (size_t i = 0; i < n / QK; i++) kvr_ggml_block_dec(q, dst + i * QK, src + i * s);
}

void kvr__br_row_from_f32(kvr_llama_type t, uint8_t *dst, const float *src, size_t n)
{
    t = norm_type(t);
    if (is_plain(t)) {
        kvr_convert(dst, plain_dtype(t), src, KVR_DTYPE_F32, n);
        return;
    }
    uint32_t b, s;
    kvr__br_type_geom(t, &b, &s);
    kvr_ggml_qtype q = (kvr_ggml_qtype)kvr_llama_type_to_ggml(t);
    /* an f16 scale overflow is written as ggml writes it (inf) */
    for (size_t i = 0; i < n / QK; i++) (void)kvr_ggml_block_enc(q, dst + i * s, src + i * QK);
}

/* ---- Walsh-Hadamard ------------------------------------------------------- */

uint32_t kvr__br_rot_k(kvr_llama_type t, uint32_t head_dim, bool no_attn_rot)
{
    if (no_attn_rot || !kvr_llama_type_is_quantized(t) || head_dim == 0 || head_dim % 64)
        return 0;
    uint32_t n = 64;
    while (head_dim % (n * 2) == 0) n *= 2;
    return n;
}

uint32_t kvr__br_rot_v(kvr_llama_type t, uint32_t head_dim, bool no_attn_rot)
{
    if (no_attn_rot || !kvr_llama_type_is_quantized(t) || head_dim == 0 || head_dim % 64)
        return 0;
    return 64;
}

/* One butterfly pass of length len >= 4 over a block: contiguous halves, so
 * the compiler vectorises it; each output is one IEEE add or subtract, as in
 * ggml's scalar and SIMD passes, so the result is the same bit for bit. */
static void fwht_pass(float *restrict a, float *restrict b, uint32_t len)
{
    for (uint32_t j = 0; j < len; j++) {
        float u = a[j], v = b[j];
        a[j] = u + v;
        b[j] = u - v;
    }
}

void kvr__br_fwht(float *x, size_t n, uint32_t nrot)
{
    if (!nrot) return;
    const float scale = 1.0f / sqrtf((float)nrot);
    for (size_t r = 0; r + nrot <= n; r += nrot) {
        float *row = x + r;
        for (uint32_t j = 0; j < nrot; j++) row[j] = row[j] * scale;
        for (uint32_t i = 0; i < nrot; i += 2) {
            float u = row[i], v = row[i + 1];
            row[i] = u + v;
            row[i + 1] = u - v;
        }
        for (uint32_t i = 0; i < nrot; i += 4) {
            float u0 = row[i], u1 = row[i + 1], v0 = row[i + 2], v1 = row[i + 3];
            row[i] = u0 + v0;
            row[i + 1] = u1 + v1;
            row[i + 2] = u0 - v0;
            row[i + 3] = u1 - v1;
        }
        for (uint32_t len = 4; len < nrot; len <<= 1)
            for (uint32_t i = 0; i < nrot; i += 2 * len) fwht_pass(row + i, row + i + len, len);
    }
}

/* ---- parse ---------------------------------------------------------------- */

typedef struct cur {
    const uint8_t *p;
    size_t         len, off;
} cur;

static bool have(const cur *c, uint64_t n) { return n <= c->len - c->off; }

void kvr_llama_state_free(kvr_llama_state *st)
{
    if (!st) return;
    free(st->tokens);
    free(st->pos);
    free(st->k);
    free(st->v);
    free(st);
}

static const char *form_name(kvr_llama_form f)
{
    return f == KVR_LLAMA_FORM_SESSION ? "session file" : "sequence state";
}

/* Does a memory state's data section plausibly start at off? (used to tell
 * per-cell extra data from garbage) */
static bool data_starts_at(const cur *c, uint64_t off, uint32_t n_cells)
{
    if (off > c->len || c->len - off < 20) return false;
    const uint8_t *q = c->p + off;
    uint32_t vt = kvr__br_rd32(q), nl = kvr__br_rd32(q + 4);
    int32_t ty;
    memcpy(&ty, q + 8, 4);
    uint64_t row = kvr__br_rd64(q + 12);
    if (vt > 1 || nl == 0 || nl > 65536) return false;
    kvr_llama_type t = kvr_llama_type_from_ggml(ty);
    if (t == KVR_LLAMA_TYPE_DEFAULT) return false;
    uint32_t b, s;
    kvr__br_type_geom(t, &b, &s);
    if (row == 0 || row % s) return false;
    return row <= (c->len - off) / (n_cells ? n_cells : 1);
}

static int parse_mem(cur *c, kvr_llama_state *st, bool seq_known, char *err, size_t errlen)
{
    const char *fn = form_name(st->form);
    if (!have(c, 4)) return kvr__br_fail(err, errlen, KVR_EINVAL, "truncated %s: no stream count", fn);
    uint32_t n_stream = kvr__br_rd32(c->p + c->off);
    c->off += 4;
    if (n_stream != 1)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "the %s has %u streams: only one-stream states are supported "
                           "(a context with kv_unified = true, or n_seq_max = 1)", fn, n_stream);
    if (!have(c, 4)) return kvr__br_fail(err, errlen, KVR_EINVAL, "truncated %s: no cell count", fn);
    uint32_t n_cells = kvr__br_rd32(c->p + c->off);
    c->off += 4;
    st->n_cells = n_cells;
    if (n_cells == 0) {
        if (c->off != c->len)
            return kvr__br_fail(err, errlen, KVR_EINVAL,
                               "%zu bytes after the end of an empty %s", c->len - c->off, fn);
        return 0;
    }
    /* Cells: 12 bytes each without extra per-cell data. */
    if (!have(c, (uint64_t)n_cells * 12))
        return kvr__br_fail(err, errlen, KVR_EINVAL,
                           "truncated %s: %u cells declared, %zu bytes left", fn, n_cells,
                           c->len - c->off);
    if (!data_starts_at(c, c->off + (uint64_t)n_cells * 12, n_cells)) {
        if (have(c, (uint64_t)n_cells * 24) &&
            data_starts_at(c, c->off + (uint64_t)n_cells * 24, n_cells) &&
            kvr__br_rd32(c->p + c->off + 4) == 1)
            return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                               "the %s's cells carry 12 bytes of extra per-cell data (M-RoPE "
                               "positions / token ids): models with per-cell data are not "
                               "supported", fn);
    }
    st->pos = malloc((size_t)n_cells * sizeof *st->pos);
    if (!st->pos) return kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < n_cells; i++) {
        const uint8_t *q = c->p + c->off + (size_t)i * 12;
        int32_t pos, sq;
        memcpy(&pos, q, 4);
        uint32_t ns = kvr__br_rd32(q + 4);
        if (ns != 1)
            return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                               "cell %u (position %d) belongs to %u sequences: only states of "
                               "one sequence are supported (llama_state_seq_get_data with a "
                               "seq_id >= 0)", i, pos, ns);
        memcpy(&sq, q + 8, 4);
        if (!seq_known && i == 0) st->seq_id = sq;
        if (sq != st->seq_id)
            return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                               "cell %u (position %d) belongs to sequence %d, the %s's is %d", i,
                               pos, sq, fn, st->seq_id);
        if (pos < 0)
            return kvr__br_fail(err, errlen, KVR_EINVAL, "cell %u has a negative position %d",
                               i, pos);
        st->pos[i] = pos;
    }
    c->off += (size_t)n_cells * 12;

    if (!have(c, 8)) return kvr__br_fail(err, errlen, KVR_EINVAL, "truncated %s: no v_trans / layer count", fn);
    uint32_t vt = kvr__br_rd32(c->p + c->off), nl = kvr__br_rd32(c->p + c->off + 4);
    c->off += 8;
    if (vt > 1) return kvr__br_fail(err, errlen, KVR_EINVAL, "v_trans is %u (0 or 1 expected)", vt);
    if (nl == 0) return kvr__br_fail(err, errlen, KVR_EINVAL, "the %s has 0 layers", fn);
    /* each layer needs at least 12 + 12 header bytes: bounds nl by the input */
    if (!have(c, (uint64_t)nl * 24))
        return kvr__br_fail(err, errlen, KVR_EINVAL,
                           "truncated %s: %u layers declared, %zu bytes left", fn, nl,
                           c->len - c->off);
    st->v_trans = vt == 1;
    st->n_layers = nl;
    st->k = calloc(nl, sizeof *st->k);
    st->v = calloc(nl, sizeof *st->v);
    if (!st->k || !st->v) return kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory");

    for (int side = 0; side < 2; side++) {
        const char *sn = side ? "V" : "K";
        for (uint32_t l = 0; l < nl; l++) {
            if (!have(c, 4))
                return kvr__br_fail(err, errlen, KVR_EINVAL, "truncated %s at layer %u's %s type", fn, l, sn);
            int32_t gt;
            memcpy(&gt, c->p + c->off, 4);
            c->off += 4;
            kvr_llama_type t = kvr_llama_type_from_ggml(gt);
            if (t == KVR_LLAMA_TYPE_DEFAULT)
                return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                                   "layer %u: %s has ggml type %d, which the bridge does not know "
                                   "(f32, f16, bf16, q8_0, q4_0, q4_1, q5_0 are supported)", l, sn, gt);
            kvr_llama_type *tp = side ? &st->type_v : &st->type_k;
            if (l == 0) *tp = t;
            else if (*tp != t)
                return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                                   "layer %u: %s type %s differs from layer 0's %s (mixed cache "
                                   "types are not supported)", l, sn, kvr_llama_type_name(t),
                                   kvr_llama_type_name(*tp));
            uint32_t b, s;
            kvr__br_type_geom(t, &b, &s);
            if (side == 1 && st->v_trans) {
                if (!is_plain(t))
                    return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                                       "layer %u: quantized V (%s) with v_trans 1", l,
                                       kvr_llama_type_name(t));
                if (!have(c, 8))
                    return kvr__br_fail(err, errlen, KVR_EINVAL, "truncated %s at layer %u's V header", fn, l);
                uint32_t el = kvr__br_rd32(c->p + c->off), ne = kvr__br_rd32(c->p + c->off + 4);
                c->off += 8;
                if (el != s)
                    return kvr__br_fail(err, errlen, KVR_EINVAL,
                                       "layer %u: V element size %u, type %s has %u", l, el,
                                       kvr_llama_type_name(t), s);
                if (ne == 0 || ne > (1u << 24))
                    return kvr__br_fail(err, errlen, KVR_EINVAL, "layer %u: V has %u values per cell",
                                       l, ne);
                if (l == 0) { st->n_embd_v = ne; st->row_v = el; }
                else if (ne != st->n_embd_v)
                    return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                                       "layer %u: %u V values per cell, layer 0 has %u", l, ne, st->n_embd_v);
                if ((uint64_t)ne > (c->len - c->off) / n_cells / el)
                    return kvr__br_fail(err, errlen, KVR_EINVAL,
                                       "truncated %s: layer %u's V needs %u x %u elements of %u "
                                       "bytes, %zu bytes left", fn, l, ne, n_cells, el,
                                       c->len - c->off);
                uint64_t need = (uint64_t)ne * n_cells * el;
                if (!have(c, need))
                    return kvr__br_fail(err, errlen, KVR_EINVAL,
                                       "truncated %s: layer %u's V needs %llu bytes, %zu left", fn, l,
                                       (unsigned long long)need, c->len - c->off);
                st->v[l] = c->p + c->off;
                c->off += need;
                continue;
            }
            if (!have(c, 8))
                return kvr__br_fail(err, errlen, KVR_EINVAL, "truncated %s at layer %u's %s row size", fn, l, sn);
            uint64_t row = kvr__br_rd64(c->p + c->off);
            c->off += 8;
            if (row == 0 || row % s || row / s * b > (1u << 24))
                return kvr__br_fail(err, errlen, KVR_EINVAL,
                                   "layer %u: %s row of %llu bytes is not a whole number of %s "
                                   "blocks (or is 0 or huge)", l, sn, (unsigned long long)row,
                                   kvr_llama_type_name(t));
            uint32_t ne = (uint32_t)(row / s * b);
            uint32_t *np = side ? &st->n_embd_v : &st->n_embd_k;
            uint64_t *rp = side ? &st->row_v : &st->row_k;
            if (l == 0) { *np = ne; *rp = row; }
            else if (ne != *np)
                return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                                   "layer %u: %u %s values per cell, layer 0 has %u", l, ne, sn, *np);
            if (row > (c->len - c->off) / n_cells)
                return kvr__br_fail(err, errlen, KVR_EINVAL,
                                   "truncated %s: layer %u's %s needs %u rows of %llu bytes, %zu left",
                                   fn, l, sn, n_cells, (unsigned long long)row, c->len - c->off);
            (side ? st->v : st->k)[l] = c->p + c->off;
            c->off += (size_t)row * n_cells;
        }
    }
    if (c->off != c->len)
        return kvr__br_fail(err, errlen, KVR_EINVAL,
                           "%zu bytes after the end of the %s (oversized, or not one sequence)",
                           c->len - c->off, fn);
    return 0;
}

int kvr_llama_state_parse(const void *buf, size_t len, const kvr_llama_model *m,
                          kvr_llama_state **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!buf && len) return kvr__br_fail(err, errlen, KVR_EINVAL, "no state bytes");
    cur c = { buf, len, 0 };
    if (len < 8)
        return kvr__br_fail(err, errlen, KVR_EINVAL,
                           "not a llama.cpp sequence state: %zu bytes", len);
    kvr_llama_state *st = calloc(1, sizeof *st);
    if (!st) return kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory");
    uint32_t magic = kvr__br_rd32(c.p);
    int rc;
    bool seq_known = false;
    if (magic == KVR_LLAMA_STATE_MAGIC) {
        st->form = KVR_LLAMA_FORM_RAW;
        memcpy(&st->seq_id, c.p + 4, 4);
        seq_known = true;
        c.off = 8;
    } else if (magic == KVR_LLAMA_SESSION_MAGIC) {
        st->form = KVR_LLAMA_FORM_SESSION;
        uint32_t ver = kvr__br_rd32(c.p + 4);
        if (ver != KVR_LLAMA_SESSION_VERSION) {
            rc = kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                             "sequence state file version %u (llama.cpp v0.5.0 writes %u)", ver,
                             KVR_LLAMA_SESSION_VERSION);
            goto fail;
        }
        c.off = 8;
        if (!have(&c, 4)) {
            rc = kvr__br_fail(err, errlen, KVR_EINVAL, "truncated session file: no token count");
            goto fail;
        }
        uint32_t nt = kvr__br_rd32(c.p + 8);
        c.off = 12;
        if (!have(&c, (uint64_t)nt * 4)) {
            rc = kvr__br_fail(err, errlen, KVR_EINVAL,
                             "truncated session file: %u tokens declared, %zu bytes left", nt,
                             len - c.off);
            goto fail;
        }
        st->n_tokens = nt;
        if (nt) {
            st->tokens = malloc((size_t)nt * 4);
            if (!st->tokens) { rc = kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory"); goto fail; }
            memcpy(st->tokens, c.p + 12, (size_t)nt * 4);
            for (uint32_t i = 0; i < nt; i++)
                if (st->tokens[i] < 0) {
                    rc = kvr__br_fail(err, errlen, KVR_EINVAL, "session token %u is %d (negative)",
                                     i, st->tokens[i]);
                    goto fail;
                }
        }
        c.off += (size_t)nt * 4;
    } else {
        rc = kvr__br_fail(err, errlen, KVR_EINVAL,
                         "not a llama.cpp sequence state: magic 0x%08x (expected 0x%08x from "
                         "llama_state_seq_get_data or 'ggsq' from llama_state_seq_save_file)",
                         magic, KVR_LLAMA_STATE_MAGIC);
        goto fail;
    }
    if ((rc = parse_mem(&c, st, seq_known, err, errlen)) != 0) goto fail;
    if (st->n_cells && st->type_k == KVR_LLAMA_TYPE_DEFAULT) {
        rc = kvr__br_fail(err, errlen, KVR_EINVAL, "the state has no K data");
        goto fail;
    }
    if (m && st->n_cells) {
        uint32_t want = m->n_kv_heads * m->head_dim;
        if (st->n_layers != m->n_layers || st->n_embd_k != want || st->n_embd_v != want) {
            rc = kvr__br_fail(err, errlen, KVR_ESHAPE,
                             "the state was made by another model: %u layers x %u K / %u V values "
                             "per cell; model '%s' (%s) has %u layers x %u (%u KV heads x %u)",
                             st->n_layers, st->n_embd_k, st->n_embd_v,
                             m->name[0] ? m->name : m->arch, m->arch, m->n_layers, want,
                             m->n_kv_heads, m->head_dim);
            goto fail;
        }
    }
    st->bytes = c.off;
    *out = st;
    return 0;
fail:
    kvr_llama_state_free(st);
    return rc;
}

/* ---- decode ----------------------------------------------------------------- */

size_t kvr_llama_payload_size(const kvr_llama_model *m, size_t n_cells, kvr_dtype dtype)
{
    return kvr_payload_size(m->n_layers, n_cells, m->n_kv_heads, m->head_dim, dtype);
}

/* rows [c0, c1) of one side of one layer into dst (dtype), n values a row */
static void decode_rows(kvr_llama_type t, const uint8_t *src, uint64_t row, uint32_t c0,
                        uint32_t c1, uint32_t n, uint32_t nrot, kvr_dtype dtype, uint8_t *dst,
                        float *tmp)
{
    size_t ds = kvr_dtype_size(dtype);
    size_t nc = c1 - c0;
    src += (size_t)c0 * row;
    if (is_plain(t) && nrot == 0) {
        kvr_dtype st = plain_dtype(t);
        if (st == dtype) memcpy(dst, src, nc * row);
        else kvr_convert(dst, dtype, src, st, nc * n);
        return;
    }
    for (size_t i = 0; i < nc; i++) {
        kvr__br_row_to_f32(t, tmp, src + i * row, n);
        kvr__br_fwht(tmp, n, nrot);
        kvr_convert(dst + i * n * ds, dtype, tmp, KVR_DTYPE_F32, n);
    }
}

/* cells per transposed chunk: few enough that the rows written at power-of-two
 * strides stay in cache together */
#define TW 32

/* dst[c][r] = src[r][c] for 16-bit elements: rows x cols of src (row stride
 * ss elements) into cols x rows of dst (row stride ds elements); 8x8 tiles
 * with SSE2 where available. */
static void transpose16(uint8_t *dst, size_t ds, const uint8_t *src, size_t ss, size_t rows,
                        size_t cols)
{
    /* element (r, c) of src at src + 2 (r ss + c); of dst at dst + 2 (c ds + r).
     * Byte pointers and unaligned loads: the state's bytes need not be aligned. */
    size_t r0 = 0;
#if defined(__SSE2__)
    for (; r0 + 8 <= rows; r0 += 8) {
        size_t c0 = 0;
        for (; c0 + 8 <= cols; c0 += 8) {
            __m128i a[8], b[8];
            for (int i = 0; i < 8; i++)
                a[i] = _mm_loadu_si128((const __m128i *)(const void *)(src + 2 * ((r0 + i) * ss + c0)));
            for (int i = 0; i < 4; i++) {
                b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
                b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
            }
            /* b0 = r0r1 lo (c0..3), b1 = r0r1 hi (c4..7), b2 = r2r3 lo, ... */
            __m128i c[8];
            c[0] = _mm_unpacklo_epi32(b[0], b[2]);  /* c0,c1 of r0..r3 */
            c[1] = _mm_unpackhi_epi32(b[0], b[2]);  /* c2,c3 */
            c[2] = _mm_unpacklo_epi32(b[1], b[3]);  /* c4,c5 */
            c[3] = _mm_unpackhi_epi32(b[1], b[3]);  /* c6,c7 */
            c[4] = _mm_unpacklo_epi32(b[4], b[6]);  /* c0,c1 of r4..r7 */
            c[5] = _mm_unpackhi_epi32(b[4], b[6]);
            c[6] = _mm_unpacklo_epi32(b[5], b[7]);
            c[7] = _mm_unpackhi_epi32(b[5], b[7]);
            for (int i = 0; i < 4; i++) {
                __m128i lo = _mm_unpacklo_epi64(c[i], c[i + 4]);  /* column 2i */
                __m128i hi = _mm_unpackhi_epi64(c[i], c[i + 4]);  /* column 2i+1 */
                _mm_storeu_si128((__m128i *)(void *)(dst + 2 * ((c0 + 2 * i) * ds + r0)), lo);
                _mm_storeu_si128((__m128i *)(void *)(dst + 2 * ((c0 + 2 * i + 1) * ds + r0)), hi);
            }
        }
        for (; c0 < cols; c0++)
            for (size_t i = 0; i < 8; i++)
                memcpy(dst + 2 * (c0 * ds + r0 + i), src + 2 * ((r0 + i) * ss + c0), 2);
    }
#endif
    for (; r0 < rows; r0++)
        for (size_t c0 = 0; c0 < cols; c0++)
            memcpy(dst + 2 * (c0 * ds + r0), src + 2 * (r0 * ss + c0), 2);
}

/* v_trans: src is [n][n_cells] elements of t (plain); dst [nc][n] of dtype */
static void decode_trans(kvr_llama_type t, const uint8_t *src, uint32_t n_cells, uint32_t c0,
                         uint32_t c1, uint32_t n, kvr_dtype dtype, uint8_t *dst, float *tmp)
{
    kvr_dtype st = plain_dtype(t);
    size_t es = kvr_dtype_size(st), ds = kvr_dtype_size(dtype);
    size_t nc = c1 - c0;
    if (st == dtype && es == 2) {
        /* src rows j (n of them, n_cells elements each, from cell c0) -> dst rows i */
        for (size_t i0 = 0; i0 < nc; i0 += TW) {
            size_t w = nc - i0 < TW ? nc - i0 : TW;
            transpose16(dst + i0 * n * 2, n, src + (c0 + i0) * 2, n_cells, n, w);
        }
        return;
    }
    for (size_t i = 0; i < nc; i++) {
        for (size_t j = 0; j < n; j++) {
            const uint8_t *s = src + (j * n_cells + c0 + i) * es;
            if (st == KVR_DTYPE_F32) memcpy(&tmp[j], s, 4);
            else if (st == KVR_DTYPE_F16) tmp[j] = kvr_f16_to_f32(rd16(s));
            else tmp[j] = kvr_bf16_to_f32(rd16(s));
        }
        kvr_convert(dst + i * n * ds, dtype, tmp, KVR_DTYPE_F32, n);
    }
}

int kvr_llama_state_decode(const kvr_llama_state *st, const kvr_llama_model *m, uint32_t c0,
                           uint32_t c1, bool no_attn_rot, kvr_dtype dtype, void *dst,
                           size_t cap, char *err, size_t errlen)
{
    if (!st || !m) return kvr__br_fail(err, errlen, KVR_EINVAL, "no state or model");
    if (c0 > c1 || c1 > st->n_cells)
        return kvr__br_fail(err, errlen, KVR_ERANGE, "cells [%u, %u) outside the state's %u",
                           c0, c1, st->n_cells);
    if (kvr_dtype_size(dtype) == 0) return kvr__br_fail(err, errlen, KVR_EINVAL, "bad dtype");
    if (c0 == c1) return 0;
    if ((uint64_t)m->n_kv_heads * m->head_dim > (1u << 24))
        return kvr__br_fail(err, errlen, KVR_ESHAPE, "model '%s' has a huge shape", m->name);
    uint32_t n = m->n_kv_heads * m->head_dim;
    if (st->n_layers != m->n_layers || st->n_embd_k != n || st->n_embd_v != n)
        return kvr__br_fail(err, errlen, KVR_ESHAPE, "state and model '%s' differ in shape",
                           m->name);
    size_t need = kvr_llama_payload_size(m, c1 - c0, dtype);
    if (need == 0) return kvr__br_fail(err, errlen, KVR_ETOOLARGE, "payload size overflows");
    if (!dst || cap < need)
        return kvr__br_fail(err, errlen, KVR_EBUFFER, "payload needs %zu bytes, %zu given",
                           need, cap);
    float *tmp = malloc((size_t)n * sizeof *tmp);
    if (!tmp) return kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory");
    uint32_t rk = kvr__br_rot_k(st->type_k, m->head_dim, no_attn_rot);
    uint32_t rv = kvr__br_rot_v(st->type_v, m->head_dim, no_attn_rot);
    size_t side = (size_t)(c1 - c0) * n * kvr_dtype_size(dtype);
    uint8_t *d = dst;
    for (uint32_t l = 0; l < st->n_layers; l++) {
        decode_rows(st->type_k, st->k[l], st->row_k, c0, c1, n, rk, dtype, d, tmp);
        d += side;
        if (st->v_trans) decode_trans(st->type_v, st->v[l], st->n_cells, c0, c1, n, dtype, d, tmp);
        else decode_rows(st->type_v, st->v[l], st->row_v, c0, c1, n, rv, dtype, d, tmp);
        d += side;
    }
    free(tmp);
    return 0;
}

/* ---- encode ------------------------------------------------------------------ */

static size_t state_size(const kvr_llama_model *m, const kvr_llama_encode_args *a, bool *ok)
{
    *ok = false;
    uint64_t n = (uint64_t)m->n_kv_heads * m->head_dim;
    if (n == 0 || n > (1u << 24)) return 0;
    uint64_t rk = kvr__br_row_bytes(a->type_k, n), rv = kvr__br_row_bytes(a->type_v, n);
    if (!rk || !rv) return 0;
    uint64_t s = a->form == KVR_LLAMA_FORM_SESSION ? 12 + (uint64_t)(a->tokens ? a->n_cells : 0) * 4 : 8;
    s += 8;                                   /* n_stream, cell_count */
    if (a->n_cells) {
        uint64_t per_layer, all;
        /* rows are < 2^27 bytes and cells < 2^32: the product fits; layers may not */
        per_layer = 24 + (rk + rv) * a->n_cells;
        if (__builtin_mul_overflow(per_layer, (uint64_t)m->n_layers, &all)) return 0;
        if (__builtin_add_overflow(s, all + (uint64_t)a->n_cells * 12 + 8, &s)) return 0;
    }
    *ok = s <= SIZE_MAX;
    return (size_t)s;
}

size_t kvr_llama_state_size(const kvr_llama_model *m, const kvr_llama_encode_args *a)
{
    bool ok;
    size_t s = state_size(m, a, &ok);
    return ok ? s : 0;
}

static void encode_rows(kvr_llama_type t, uint8_t *dst, uint64_t row, const uint8_t *src,
                        kvr_dtype dtype, uint32_t nc, uint32_t n, uint32_t nrot, float *tmp)
{
    size_t ds = kvr_dtype_size(dtype);
    if (is_plain(t) && nrot == 0) {
        kvr_dtype dt = plain_dtype(t);
        if (dt == dtype) memcpy(dst, src, (size_t)nc * row);
        else kvr_convert(dst, dt, src, dtype, (size_t)nc * n);
        return;
    }
    for (size_t i = 0; i < nc; i++) {
        kvr_convert(tmp, KVR_DTYPE_F32, src + i * n * ds, dtype, n);
        kvr__br_fwht(tmp, n, nrot);
        kvr__br_row_from_f32(t, dst + i * row, tmp, n);
    }
}

static void encode_trans(kvr_llama_type t, uint8_t *dst, const uint8_t *src, kvr_dtype dtype,
                         uint32_t nc, uint32_t n)
{
    kvr_dtype dt = plain_dtype(t);
    size_t es = kvr_dtype_size(dt), ds = kvr_dtype_size(dtype);
    if (dt == dtype && es == 2) {
        /* src [nc][n] -> dst [n][nc] */
        for (size_t i0 = 0; i0 < nc; i0 += TW) {
            size_t w = nc - i0 < TW ? nc - i0 : TW;
            transpose16(dst + i0 * 2, nc, src + i0 * n * 2, n, w, n);
        }
        return;
    }
    for (size_t j = 0; j < n; j++)
        for (size_t i = 0; i < nc; i++)
            kvr_convert(dst + (j * nc + i) * es, dt, src + (i * n + j) * ds, dtype, 1);
}

static int encode(const kvr_llama_model *m, const kvr_llama_encode_args *a, void **out,
                  uint8_t *dst, size_t cap, size_t *len, char *err, size_t errlen);

int kvr_llama_state_encode(const kvr_llama_model *m, const kvr_llama_encode_args *a,
                           void **out, size_t *len, char *err, size_t errlen)
{
    *out = NULL;
    *len = 0;
    return encode(m, a, out, NULL, 0, len, err, errlen);
}

int kvr_llama_state_encode_to(const kvr_llama_model *m, const kvr_llama_encode_args *a,
                              void *dst, size_t cap, size_t *len, char *err, size_t errlen)
{
    *len = 0;
    if (!dst && cap) return kvr__br_fail(err, errlen, KVR_EINVAL, "no destination buffer");
    return encode(m, a, NULL, dst, cap, len, err, errlen);
}

static int encode(const kvr_llama_model *m, const kvr_llama_encode_args *a, void **out,
                  uint8_t *dst, size_t cap, size_t *len, char *err, size_t errlen)
{
    if (!m || !a) return kvr__br_fail(err, errlen, KVR_EINVAL, "no model or arguments");
    if (a->n_cells && (!a->pos || !a->payload))
        return kvr__br_fail(err, errlen, KVR_EINVAL, "cells without positions or payload");
    if (kvr_dtype_size(a->dtype) == 0)
        return kvr__br_fail(err, errlen, KVR_EINVAL, "bad payload dtype %d", (int)a->dtype);
    kvr_llama_type tk = norm_type(a->type_k), tv = norm_type(a->type_v);
    if (kvr_llama_type_to_ggml(tk) < 0 || kvr_llama_type_to_ggml(tv) < 0)
        return kvr__br_fail(err, errlen, KVR_EINVAL, "unknown destination type");
    if (a->v_trans && !is_plain(tv))
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "quantized V (%s) needs v_trans 0 (flash attention)", kvr_llama_type_name(tv));
    if ((uint64_t)m->n_kv_heads * m->head_dim > (1u << 24) || !m->n_layers)
        return kvr__br_fail(err, errlen, KVR_EINVAL, "model without a shape (or a huge one)");
    uint32_t n = m->n_kv_heads * m->head_dim;
    if (!n) return kvr__br_fail(err, errlen, KVR_EINVAL, "model without shape");
    uint64_t rk = kvr__br_row_bytes(tk, n), rv = kvr__br_row_bytes(tv, n);
    if (!rk || !rv)
        return kvr__br_fail(err, errlen, KVR_EUNSUPPORTED,
                           "%u values per cell is not a multiple of %s/%s's block of 32", n,
                           kvr_llama_type_name(tk), kvr_llama_type_name(tv));
    for (uint32_t i = 0; i < a->n_cells; i++)
        if (a->pos[i] < 0)
            return kvr__br_fail(err, errlen, KVR_ERANGE, "cell %u at negative position %d", i,
                               a->pos[i]);
    kvr_llama_encode_args aa = *a;
    aa.type_k = tk;
    aa.type_v = tv;
    bool ok;
    size_t total = state_size(m, &aa, &ok);
    if (!ok) return kvr__br_fail(err, errlen, KVR_ETOOLARGE, "state too large");
    if (!out && cap < total)
        return kvr__br_fail(err, errlen, KVR_EBUFFER, "the state needs %zu bytes, %zu given",
                           total, cap);
    uint8_t *b = out ? malloc(total ? total : 1) : dst;
    float *tmp = malloc((size_t)n * sizeof *tmp);
    if (!b || !tmp) {
        if (out) free(b);
        free(tmp);
        return kvr__br_fail(err, errlen, KVR_ENOMEM, "out of memory (%zu bytes)", total);
    }
    uint8_t *p = b;
    if (a->form == KVR_LLAMA_FORM_SESSION) {
        uint32_t nt = a->tokens ? a->n_cells : 0;
        kvr__br_wr32(p, KVR_LLAMA_SESSION_MAGIC);
        kvr__br_wr32(p + 4, KVR_LLAMA_SESSION_VERSION);
        kvr__br_wr32(p + 8, nt);
        p += 12;
        if (nt) memcpy(p, a->tokens, (size_t)nt * 4);
        p += (size_t)nt * 4;
    } else {
        kvr__br_wr32(p, KVR_LLAMA_STATE_MAGIC);
        memcpy(p + 4, &a->seq_id, 4);
        p += 8;
    }
    kvr__br_wr32(p, 1);
    kvr__br_wr32(p + 4, a->n_cells);
    p += 8;
    if (a->n_cells) {
        for (uint32_t i = 0; i < a->n_cells; i++) {
            memcpy(p, &a->pos[i], 4);
            kvr__br_wr32(p + 4, 1);
            memcpy(p + 8, &a->seq_id, 4);
            p += 12;
        }
        kvr__br_wr32(p, a->v_trans ? 1 : 0);
        kvr__br_wr32(p + 4, m->n_layers);
        p += 8;
        size_t side = (size_t)a->n_cells * n * kvr_dtype_size(a->dtype);
        const uint8_t *src = a->payload;
        uint32_t hk = kvr__br_rot_k(tk, m->head_dim, a->no_attn_rot);
        uint32_t hv = kvr__br_rot_v(tv, m->head_dim, a->no_attn_rot);
        int32_t gk = kvr_llama_type_to_ggml(tk), gv = kvr_llama_type_to_ggml(tv);
        for (uint32_t l = 0; l < m->n_layers; l++) {
            memcpy(p, &gk, 4);
            kvr__br_wr64(p + 4, rk);
            p += 12;
            encode_rows(tk, p, rk, src + (size_t)l * 2 * side, a->dtype, a->n_cells, n, hk, tmp);
            p += (size_t)rk * a->n_cells;
        }
        for (uint32_t l = 0; l < m->n_layers; l++) {
            const uint8_t *vs = src + (size_t)l * 2 * side + side;
            memcpy(p, &gv, 4);
            if (a->v_trans) {
                kvr__br_wr32(p + 4, (uint32_t)rv / n);
                kvr__br_wr32(p + 8, n);
                p += 12;
                encode_trans(tv, p, vs, a->dtype, a->n_cells, n);
            } else {
                kvr__br_wr64(p + 4, rv);
                p += 12;
                encode_rows(tv, p, rv, vs, a->dtype, a->n_cells, n, hv, tmp);
            }
            p += (size_t)rv * a->n_cells;
        }
    }
    free(tmp);
    if ((size_t)(p - b) != total) {
        if (out) free(b);
        return kvr__br_fail(err, errlen, KVR_EINTERNAL, "state size mismatch");
    }
    if (out) *out = b;
    *len = total;
    return 0;
}

void kvr_llama_free(void *p) { free(p); }
