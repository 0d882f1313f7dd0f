/*
 * fuzz_llama_state.c — libFuzzer target for the llama.cpp bridge's parsers
 * (client/llama/kvrope_llama.h), everything untrusted bytes reach without a
 * daemon:
 *   first byte even: kvr_llama_gguf_parse of the rest (a GGUF file);
 *   first byte odd:  kvr_llama_state_parse of the rest (either state form),
 *                    without a model and against a fixed one; a state that
 *                    parses is decoded (every cell, f32 and f16) and encoded
 *                    back, and must give the same parse again.
 * Invariants checked: no crash / sanitizer report, a refusal returns a
 * negative code with a non-empty message, and nothing is returned on failure.
 *
 * Build and run: `make fuzz` (clang, libFuzzer + ASan + UBSan).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/llama/kvrope_llama.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_refusal(int rc, const char *err)
{
    if (rc >= 0 || err[0] == '\0') abort();
}

static void exercise(const kvr_llama_state *st)
{
    if (st->n_cells == 0 || st->n_embd_k != st->n_embd_v || st->n_embd_k % 2) return;
    kvr_llama_model m;
    memset(&m, 0, sizeof m);
    m.n_layers = st->n_layers;
    m.n_kv_heads = 1;
    m.head_dim = st->n_embd_k;
    m.rotary_dim = m.head_dim;
    size_t cap = kvr_llama_payload_size(&m, st->n_cells, KVR_DTYPE_F32);
    if (cap == 0 || cap > (64u << 20)) return;
    float *f = malloc(cap);
    char err[300] = "";
    if (!f) return;
    if (kvr_llama_state_decode(st, &m, 0, st->n_cells, false, KVR_DTYPE_F32, f, cap, err, sizeof err) != 0)
        abort();
    void *h = malloc(cap / 2 + 1);
    if (h && kvr_llama_state_decode(st, &m, st->n_cells / 2, st->n_cells, true, KVR_DTYPE_F16, h,
                                    cap / 2 + 1, err, sizeof err) != 0)
        abort();
    free(h);
    kvr_llama_encode_args a;
    memset(&a, 0, sizeof a);
    a.n_cells = st->n_cells;
    a.pos = st->pos;
    a.payload = f;
    a.dtype = KVR_DTYPE_F32;
    a.type_k = st->type_k;
    a.type_v = st->type_v;
    a.v_trans = st->v_trans;
    a.form = st->form;
    a.tokens = st->form == KVR_LLAMA_FORM_SESSION && st->n_tokens == st->n_cells ? st->tokens : NULL;
    a.seq_id = st->seq_id;
    void *out;
    size_t len;
    if (kvr_llama_state_encode(&m, &a, &out, &len, err, sizeof err) == 0) {
        kvr_llama_state *st2;
        if (kvr_llama_state_parse(out, len, &m, &st2, err, sizeof err) != 0) abort();
        if (st2->n_cells != st->n_cells || memcmp(st2->pos, st->pos, st->n_cells * 4) != 0) abort();
        kvr_llama_state_free(st2);
        kvr_llama_free(out);
    }
    free(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    char err[400] = "";
    if ((data[0] & 1) == 0) {
        kvr_llama_model m;
        int rc = kvr_llama_gguf_parse(data + 1, size - 1, &m, err, sizeof err);
        if (rc != 0) check_refusal(rc, err);
        return 0;
    }
    kvr_llama_state *st = NULL;
    int rc = kvr_llama_state_parse(data + 1, size - 1, NULL, &st, err, sizeof err);
    if (rc != 0) {
        check_refusal(rc, err);
        if (st) abort();
    } else {
        exercise(st);
        kvr_llama_state_free(st);
    }
    /* against a fixed model: 2 layers x 1 KV head x 32 */
    kvr_llama_model fm;
    memset(&fm, 0, sizeof fm);
    snprintf(fm.arch, sizeof fm.arch, "llama");
    fm.n_layers = 2;
    fm.n_kv_heads = 1;
    fm.head_dim = 32;
    fm.rotary_dim = 32;
    err[0] = 0;
    rc = kvr_llama_state_parse(data + 1, size - 1, &fm, &st, err, sizeof err);
    if (rc != 0) check_refusal(rc, err);
    else kvr_llama_state_free(st);
    return 0;
}
