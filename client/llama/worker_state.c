/*
 * worker_state.c — cell-level access to llama.cpp sequence states for the
 * worker (float caches only; the bridge owns the parser and the general codec).
 *
 * Layout (llama_state_seq_get_data, little endian; bridge_state.c has the
 * full format, the session form too):
 *   u32 magic 0xaf143cd8 · i32 seq_id · u32 n_stream (1 here)
 *   u32 cell_count; when > 0:
 *     cell_count x { i32 pos, u32 n_seq_id = 1, i32 seq_id }
 *     u32 v_trans · u32 n_layer
 *     n_layer x { i32 type, u64 row bytes, cell_count rows }              K
 *     v_trans 0: n_layer x { i32 type, u64 row bytes, cell_count rows }   V
 *     v_trans 1: n_layer x { i32 type, u32 el bytes, u32 n_embd,
 *                            n_embd runs of cell_count elements }        V^T
 * Cells come in KV-cache slot order, which need not be position order: every
 * consumer here goes through positions. Parsing is the bridge's
 * (kvr_llama_state_parse: every length checked against the buffer before it
 * is read, trailing bytes refused); this file keeps a float-only view of the
 * result and builds states.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/llama/worker.h"

/* The bridge's parser (kvr_llama_state_parse, bridge_state.c) reads the
 * state; the worker keeps a float-only view of it. */
/* Bytes of an element of a float cache type (ggml's numbering), 0 else. */
static uint32_t type_size(int32_t t)
{
    return t == KVR_WK_GGML_F32 ? 4 : (t == KVR_WK_GGML_F16 || t == KVR_WK_GGML_BF16) ? 2 : 0;
}

int kvr__wk_state_parse(kvr__wk_state *st, const uint8_t *buf, size_t len, char *err,
                       size_t errlen)
{
    memset(st, 0, sizeof *st);
    kvr_llama_state *ls = NULL;
    int r = kvr_llama_state_parse(buf, len, NULL, &ls, err, errlen);
    if (r < 0)
        return r;
    if (ls->form != KVR_LLAMA_FORM_RAW) {
        kvr_llama_state_free(ls);
        if (err && errlen)
            snprintf(err, errlen, "a session file, not a sequence state (llama_state_seq_get_data)");
        return KVR_EINVAL;
    }
    st->ls = ls;
    st->n_cells = ls->n_cells;
    if (ls->n_cells == 0)
        return 0;
    uint32_t el = type_size(kvr_llama_type_to_ggml(ls->type_k));
    if (!el || ls->type_v != ls->type_k || ls->n_embd_k != ls->n_embd_v) {
        if (err && errlen)
            snprintf(err, errlen,
                     "K %s x %u and V %s x %u: the worker needs one float cache type "
                     "(it uses f16) and equal K and V rows",
                     kvr_llama_type_name(ls->type_k), ls->n_embd_k,
                     kvr_llama_type_name(ls->type_v), ls->n_embd_v);
        kvr__wk_state_free(st);
        return KVR_EINVAL;
    }
    st->n_layer = ls->n_layers;
    st->v_trans = ls->v_trans;
    st->type = kvr_llama_type_to_ggml(ls->type_k);
    st->el = el;
    st->n_embd = ls->n_embd_k;
    st->pos = ls->pos;
    st->k = ls->k;
    st->v = ls->v;
    return 0;
}

void kvr__wk_state_free(kvr__wk_state *st)
{
    if (!st)
        return;
    kvr_llama_state_free(st->ls);
    memset(st, 0, sizeof *st);
}

long kvr__wk_state_find(const kvr__wk_state *st, int32_t p)
{
    for (uint32_t i = 0; i < st->n_cells; i++)
        if (st->pos[i] == p)
            return (long)i;
    return -1;
}

void kvr__wk_state_gather(const kvr__wk_state *st, const uint32_t *cells, size_t n, void *dst)
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

int kvr__wk_sbuild_init(kvr__wk_sbuild *b, uint32_t n_cells, uint32_t n_layer, int32_t type,
                       uint32_t n_embd, bool v_trans)
{
    return kvr__wk_sbuild_init_in(b, NULL, 0, n_cells, n_layer, type, n_embd, v_trans);
}

int kvr__wk_sbuild_init_in(kvr__wk_sbuild *b, void *mem, size_t cap, uint32_t n_cells,
                          uint32_t n_layer, int32_t type, uint32_t n_embd, bool v_trans)
{
    memset(b, 0, sizeof *b);
    uint32_t el = type_size(type);
    if (!el || !n_layer || !n_embd)
        return KVR_EINVAL;
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
        return KVR_ENOMEM;
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

int kvr__wk_sbuild_add(kvr__wk_sbuild *b, const void *payload, size_t n_tok, size_t t0,
                      size_t t1, const int64_t *pos)
{
    size_t n = t1 - t0;
    if (t1 < t0 || t1 > n_tok || n > (size_t)(b->n_cells - b->filled))
        return KVR_EINVAL;
    size_t row = (size_t)b->n_embd * b->el, stride = 12 + row * b->n_cells;
    uint8_t *cells = b->buf + 16 + (size_t)b->filled * 12;
    for (size_t i = 0; i < n; i++) {
        if (pos[i] < 0 || pos[i] > INT32_MAX)
            return KVR_EINVAL;
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

void kvr__wk_sbuild_free(kvr__wk_sbuild *b)
{
    if (!b)
        return;
    if (!b->borrowed)
        free(b->buf);
    memset(b, 0, sizeof *b);
}
