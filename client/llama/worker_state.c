/*
 * worker_state.c — cell-level access to llama.cpp sequence states for the
 * worker (float caches only; the bridge owns the general codec).
 *
 * Layout (llama_state_seq_get_data, little endian; ../shared/notes/llama.cpp.md):
 *   u32 magic 0xaf143cd8 · i32 seq_id · u32 n_stream (1 here)
 *   u32 cell_count; when > 0:
 *     cell_count x { i32 pos, u32 n_seq_id = 1, i32 seq_id }
 *     u32 v_trans · u32 n_layer
 *     n_layer x { i32 type, u64 row bytes, cell_count rows }              K
 *     v_trans 0: n_layer x { i32 type, u64 row bytes, cell_count rows }   V
 *     v_trans 1: n_layer x { i32 type, u32 el bytes, u32 n_embd,
 *                            n_embd runs of cell_count elements }        V^T
 * Cells come in KV-cache slot order, which need not be position order: every
 * consumer here goes through positions. The parser checks every length
 * against the buffer before it reads, and refuses trailing bytes.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/llama/worker.h"

typedef struct rd {
    const uint8_t *p;
    size_t         len, off;
} rd;

static int rd_take(rd *r, void *dst, size_t n)
{
    if (r->len - r->off < n)
        return -1;
    memcpy(dst, r->p + r->off, n);
    r->off += n;
    return 0;
}

static const uint8_t *rd_skip(rd *r, uint64_t n)
{
    if ((uint64_t)(r->len - r->off) < n)
        return NULL;
    const uint8_t *at = r->p + r->off;
    r->off += (size_t)n;
    return at;
}

static uint32_t type_size(int32_t t)
{
    return t == KVR_WK_GGML_F32 ? 4 : (t == KVR_WK_GGML_F16 || t == KVR_WK_GGML_BF16) ? 2 : 0;
}

#define FAIL(...)                                   \
    do {                                            \
        if (err)                                    \
            snprintf(err, errlen, __VA_ARGS__);     \
        kvr_wk_state_free(st);                      \
        return -EINVAL;                             \
    } while (0)

int kvr_wk_state_parse(kvr_wk_state *st, const uint8_t *buf, size_t len, char *err,
                       size_t errlen)
{
    memset(st, 0, sizeof *st);
    rd r = { buf, len, 0 };
    uint32_t magic, n_stream, cells;
    int32_t seq;
    if (rd_take(&r, &magic, 4) || rd_take(&r, &seq, 4) || rd_take(&r, &n_stream, 4))
        FAIL("state truncated in its header (%zu bytes)", len);
    if (magic != KVR_WK_STATE_MAGIC)
        FAIL("not a llama.cpp sequence state (magic 0x%08x)", magic);
    if (n_stream != 1)
        FAIL("state has %u streams (the worker's contexts have one)", n_stream);
    if (rd_take(&r, &cells, 4))
        FAIL("state truncated before its cell count");
    st->n_cells = cells;
    if (cells == 0) {
        if (r.off != len)
            FAIL("%zu bytes after an empty state", len - r.off);
        return 0;
    }
    if ((uint64_t)cells * 12 > len - r.off)
        FAIL("state truncated in its %u cells", cells);
    st->pos = malloc((size_t)cells * sizeof *st->pos);
    if (!st->pos)
        FAIL("out of memory");
    for (uint32_t i = 0; i < cells; i++) {
        uint32_t nseq = 0;
        int32_t s;
        rd_take(&r, &st->pos[i], 4);
        rd_take(&r, &nseq, 4);
        if (nseq != 1)
            FAIL("cell %u belongs to %u sequences", i, nseq);
        rd_take(&r, &s, 4);
    }
    uint32_t vt, nl;
    if (rd_take(&r, &vt, 4) || rd_take(&r, &nl, 4))
        FAIL("state truncated before its layers");
    if (vt > 1 || nl == 0 || nl > 4096)
        FAIL("state header invalid (v_trans %u, %u layers)", vt, nl);
    st->v_trans = vt;
    st->n_layer = nl;
    st->k = calloc(nl, sizeof *st->k);
    st->v = calloc(nl, sizeof *st->v);
    if (!st->k || !st->v)
        FAIL("out of memory");
    st->type = -1;
    for (int side = 0; side < 2; side++) {
        for (uint32_t l = 0; l < nl; l++) {
            int32_t t;
            if (rd_take(&r, &t, 4))
                FAIL("state truncated at layer %u", l);
            uint32_t el = type_size(t);
            if (!el)
                FAIL("layer %u: %s type %d is not a float cache type (the worker uses f16)", l,
                     side ? "V" : "K", t);
            if (st->type == -1) {
                st->type = t;
                st->el = el;
            } else if (t != st->type) {
                FAIL("layer %u: %s type %d differs from %d", l, side ? "V" : "K", t, st->type);
            }
            uint64_t nbytes;
            if (side == 0 || !vt) {
                uint64_t row;
                if (rd_take(&r, &row, 8))
                    FAIL("state truncated at layer %u", l);
                if (row == 0 || row % el)
                    FAIL("layer %u: row of %llu bytes", l, (unsigned long long)row);
                uint64_t ne = row / el;
                if (st->n_embd == 0)
                    st->n_embd = (uint32_t)ne;
                else if (ne != st->n_embd)
                    FAIL("layer %u: rows of %llu elements, expected %u", l,
                         (unsigned long long)ne, st->n_embd);
                nbytes = row * cells;
            } else {
                uint32_t e, ne;
                if (rd_take(&r, &e, 4) || rd_take(&r, &ne, 4))
                    FAIL("state truncated at layer %u", l);
                if (e != el || ne != st->n_embd)
                    FAIL("layer %u: transposed V of %u-byte elements x %u", l, e, ne);
                nbytes = (uint64_t)el * ne * cells;
            }
            const uint8_t *at = rd_skip(&r, nbytes);
            if (!at)
                FAIL("state truncated in layer %u's %s (%llu bytes needed)", l, side ? "V" : "K",
                     (unsigned long long)nbytes);
            (side ? st->v : st->k)[l] = at;
        }
    }
    if (r.off != len)
        FAIL("%zu bytes after the state", len - r.off);
    return 0;
}

void kvr_wk_state_free(kvr_wk_state *st)
{
    if (!st)
        return;
    free(st->pos);
    free(st->k);
    free(st->v);
    memset(st, 0, sizeof *st);
}

long kvr_wk_state_find(const kvr_wk_state *st, int32_t p)
{
    for (uint32_t i = 0; i < st->n_cells; i++)
        if (st->pos[i] == p)
            return (long)i;
    return -1;
}

void kvr_wk_state_gather(const kvr_wk_state *st, const uint32_t *cells, size_t n, void *dst)
{
    size_t row = (size_t)st->n_embd * st->el;
    uint8_t *o = dst;
    for (uint32_t l = 0; l < st->n_layer; l++) {
        for (size_t i = 0; i < n; i++, o += row)
            memcpy(o, st->k[l] + (size_t)cells[i] * row, row);
        if (!st->v_trans) {
            for (size_t i = 0; i < n; i++, o += row)
                memcpy(o, st->v[l] + (size_t)cells[i] * row, row);
        } else {
            /* V^T: element j of cell c at (j * n_cells + c). */
            for (size_t i = 0; i < n; i++, o += row)
                for (uint32_t j = 0; j < st->n_embd; j++)
                    memcpy(o + (size_t)j * st->el,
                           st->v[l] + ((size_t)j * st->n_cells + cells[i]) * st->el, st->el);
        }
    }
}

/* ---- building ------------------------------------------------------------- */
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

int kvr_wk_sbuild_init(kvr_wk_sbuild *b, uint32_t n_cells, uint32_t n_layer, int32_t type,
                       uint32_t n_embd, bool v_trans)
{
    return kvr_wk_sbuild_init_in(b, NULL, 0, n_cells, n_layer, type, n_embd, v_trans);
}

int kvr_wk_sbuild_init_in(kvr_wk_sbuild *b, void *mem, size_t cap, uint32_t n_cells,
                          uint32_t n_layer, int32_t type, uint32_t n_embd, bool v_trans)
{
    memset(b, 0, sizeof *b);
    uint32_t el = type_size(type);
    if (!el || !n_layer || !n_embd)
        return -EINVAL;
    size_t row = (size_t)n_embd * el;
    /* Each layer section: a 12-byte header (type + u64 row, or type + u32
     * element size + u32 n_embd when transposed), then its rows. */
    size_t k_hdr = 12, v_hdr = 12;
    size_t len = 16 + (n_cells ? (size_t)n_cells * 12 + 8 +
                                 (size_t)n_layer * (k_hdr + v_hdr + 2 * row * n_cells)
                               : 0);
    b->borrowed = mem && cap >= len;
    b->buf = b->borrowed ? mem : malloc(len);
    if (!b->buf)
        return -ENOMEM;
    b->len = len;
    b->n_cells = n_cells;
    b->n_layer = n_layer;
    b->n_embd = n_embd;
    b->el = el;
    b->v_trans = v_trans;
    uint8_t *p = b->buf;
    put32(p, KVR_WK_STATE_MAGIC);
    put32(p + 4, 0);
    put32(p + 8, 1);
    put32(p + 12, n_cells);
    if (!n_cells)
        return 0;
    size_t off = 16 + (size_t)n_cells * 12;
    put32(p + off, v_trans);
    put32(p + off + 4, n_layer);
    off += 8;
    b->k_off = off;
    for (uint32_t l = 0; l < n_layer; l++) {
        uint8_t *h = p + off + (size_t)l * (12 + row * n_cells);
        put32(h, (uint32_t)type);
        put64(h + 4, row);
    }
    off += (size_t)n_layer * (12 + row * n_cells);
    b->v_off = off;
    for (uint32_t l = 0; l < n_layer; l++) {
        uint8_t *h = p + off + (size_t)l * (12 + row * n_cells);
        put32(h, (uint32_t)type);
        if (v_trans) {
            put32(h + 4, el);
            put32(h + 8, n_embd);
        } else {
            put64(h + 4, row);
        }
    }
    return 0;
}

int kvr_wk_sbuild_add(kvr_wk_sbuild *b, const void *payload, size_t n_tok, size_t t0,
                      size_t t1, const int64_t *pos)
{
    size_t n = t1 - t0;
    if (t1 < t0 || t1 > n_tok || n > (size_t)(b->n_cells - b->filled))
        return -EINVAL;
    size_t row = (size_t)b->n_embd * b->el, stride = 12 + row * b->n_cells;
    uint8_t *cells = b->buf + 16 + (size_t)b->filled * 12;
    for (size_t i = 0; i < n; i++) {
        if (pos[i] < 0 || pos[i] > INT32_MAX)
            return -EINVAL;
        put32(cells + i * 12, (uint32_t)pos[i]);
        put32(cells + i * 12 + 4, 1);
        put32(cells + i * 12 + 8, 0);
    }
    const uint8_t *src = payload;
    for (uint32_t l = 0; l < b->n_layer; l++) {
        const uint8_t *k = src + (2 * (size_t)l) * n_tok * row + t0 * row;
        const uint8_t *v = src + (2 * (size_t)l + 1) * n_tok * row + t0 * row;
        uint8_t *kd = b->buf + b->k_off + l * stride + 12 + (size_t)b->filled * row;
        memcpy(kd, k, n * row);
        uint8_t *vd = b->buf + b->v_off + l * stride + 12;
        if (!b->v_trans) {
            memcpy(vd + (size_t)b->filled * row, v, n * row);
        } else {
            for (size_t i = 0; i < n; i++)
                for (uint32_t j = 0; j < b->n_embd; j++)
                    memcpy(vd + ((size_t)j * b->n_cells + b->filled + i) * b->el,
                           v + i * row + (size_t)j * b->el, b->el);
        }
    }
    b->filled += (uint32_t)n;
    return 0;
}

void kvr_wk_sbuild_free(kvr_wk_sbuild *b)
{
    if (!b)
        return;
    if (!b->borrowed)
        free(b->buf);
    memset(b, 0, sizeof *b);
}
