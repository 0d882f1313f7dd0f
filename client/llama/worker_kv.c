/*
 * worker_kv.c — what every flow of the worker does between kvroped and
 * llama.cpp: errors into the env, context names, payload and state sizes,
 * loading a cached prefix into seq 0 (the bridge's export, then
 * llama_state_seq_set_data), reading seq 0's cells back as kvrope payloads,
 * and the small context operations (stat, delete, fork a prefix).
 *
 * Invariants:
 *  - Payloads are kvrope's layer-major f16 layout for the model's n_layer x
 *    n_embd (kvr__wk_payload_bytes); states are llama.cpp's seq-0 bytes.
 *  - kvr__wk_fork_prefix deletes its destination first: callers never pass
 *    a destination they are reading from (the session engine's rule).
 */
#include <assert.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/llama/kvrope_llama.h"
#include "client/llama/worker.h"

#define F16 KVR_DTYPE_F16

int kvr__wk_fail(kvr__wk_env *e, int r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->err, sizeof e->err, fmt, ap);
    va_end(ap);
    return r < 0 ? r : KVR_EINVAL;
}

/* A kvrope call failed: remember its code and say what was being done. */
int kvr__wk_kv_fail(kvr__wk_env *e, int r, const char *what, const char *ctx)
{
    e->kv_code = r;
    snprintf(e->err, sizeof e->err, "kvrope %s%s%s: %s", what, ctx ? " " : "", ctx ? ctx : "",
             kvr_client_last_error(e->kc));
    return r;
}

static uint64_t hash_toks(uint64_t h, const int32_t *t, size_t n)
{
    const unsigned char *p = (const unsigned char *)t;
    for (size_t i = 0; i < n * sizeof *t; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return (h ^ n) * 1099511628211ull;
}

void kvr__wk_ctx_name(const kvr__wk_env *e, char *out, size_t cap, const char *kind,
                     const int32_t *t, size_t n, const int32_t *t2, size_t n2)
{
    uint64_t h = hash_toks(1469598103934665603ull ^ e->fingerprint, t, n);
    if (t2)
        h = hash_toks(h, t2, n2);
    snprintf(out, cap, "kvl-%s-%016llx", kind, (unsigned long long)h);
}

size_t kvr__wk_n_embd(const kvr__wk_env *e)
{
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e->lm);
    return (size_t)in->n_head_kv * in->head_dim;
}

uint32_t kvr__wk_n_layer(const kvr__wk_env *e) { return kvr__wk_lm_info_get(e->lm)->n_layer; }

size_t kvr__wk_payload_bytes(const kvr__wk_env *e, size_t n_tok)
{
    return (size_t)kvr__wk_n_layer(e) * 2 * n_tok * kvr__wk_n_embd(e) * 2;
}

int kvr__wk_check_kv_shape(kvr__wk_env *e, const kvr_kv *kv, const char *ctx)
{
    if (kv->n_layers != kvr__wk_n_layer(e) || (size_t)kv->n_kv_heads * kv->head_dim != kvr__wk_n_embd(e) ||
        kv->dtype != F16)
        return kvr__wk_fail(e, KVR_EINVAL, "context %s: KV of %zu layers x %u x %u does not fit the model",
                    ctx, kv->n_layers, kv->n_kv_heads, kv->head_dim);
    return 0;
}

/* ---- loading and storing ------------------------------------------------ */

/* Writes every page of a fresh buffer once (its bytes unchanged), so that
 * the kernel's first-touch faults happen here rather than in a timed step. */
void kvr__wk_prefault(void *buf, size_t len)
{
    volatile uint8_t *p = buf;
    for (size_t i = 0; i < len; i += 4096)
        p[i] = p[i];
    if (len)
        p[len - 1] = p[len - 1];
}

/* The state bytes of n f16 (or the cache type's) cells, as kvr__wk_sbuild
 * and the bridge's raw export lay them out. */
size_t kvr__wk_state_bytes(const kvr__wk_env *e, size_t n)
{
    return 16 + n * 12 + 8 + (size_t)kvr__wk_n_layer(e) * (24 + 2 * n * kvr__wk_n_embd(e) * 2);
}

void kvr__wk_env_bufs_free(kvr__wk_env *e)
{
    free(e->pf_fetch);
    free(e->pf_state);
    e->pf_fetch = e->pf_state = NULL;
    e->pf_fetch_cap = e->pf_state_cap = 0;
}

/* Buffers for loading up to n cells, faulted in now (a fresh process's first
 * touch of them costs 50 ms to 0.9 s on this machine: kernel page faults);
 * without memory, loads allocate their own as before. */
void kvr__wk_prefault_bufs(kvr__wk_env *e, size_t n)
{
    size_t fc = kvr__wk_payload_bytes(e, n), sc = kvr__wk_state_bytes(e, n);
    if (e->pf_fetch_cap >= fc && e->pf_state_cap >= sc)
        return;
    kvr__wk_env_bufs_free(e);
    e->pf_fetch = malloc(fc);
    e->pf_state = malloc(sc);
    if (!e->pf_fetch || !e->pf_state) {
        kvr__wk_env_bufs_free(e);
        return;
    }
    e->pf_fetch_cap = fc;
    e->pf_state_cap = sc;
    kvr__wk_prefault(e->pf_fetch, fc);
    kvr__wk_prefault(e->pf_state, sc);
}

/* Loads tokens [0, n) of ctx into seq 0 at positions 0..n-1: the bridge's
 * export (keys re-rotated by the daemon where they are stored elsewhere),
 * then llama_state_seq_set_data. */
int kvr__wk_load_prefix(kvr__wk_env *e, const char *ctx, size_t n, double *t_fetch,
                       double *t_load)
{
    if (n == 0)
        return 0;
    double t0 = kvr__wk_now_ms();
    kvr_llama_export_opts xo = { .model = e->model, .start = 0, .end = n,
                                 .has_pos_start = true, .pos_start = 0,
                                 .type_k = KVR_LLAMA_F16, .type_v = KVR_LLAMA_F16,
                                 .v_trans = kvr__wk_lm_v_trans(e->lm),
                                 .form = KVR_LLAMA_FORM_RAW,
                                 .dst = e->pf_state, .dst_cap = e->pf_state_cap,
                                 .scratch = e->pf_fetch, .scratch_cap = e->pf_fetch_cap };
    if (e->pf_state_cap < kvr__wk_state_bytes(e, n))
        xo.dst = NULL, xo.dst_cap = 0;
    void *st = NULL;
    size_t len = 0;
    char err[512] = "";
    int r = kvr_llama_state_export(e->kc, ctx, e->profile, &xo, &st, &len, NULL, err,
                                   sizeof err);
    if (r < 0) {
        e->kv_code = r;
        return kvr__wk_fail(e, r, "loading %zu tokens of %s: %s", n, ctx, err);
    }
    double t1 = kvr__wk_now_ms();
    r = kvr__wk_lm_state_set(e->lm, st, len, e->err, sizeof e->err);
    if (st != e->pf_state)
        kvr_llama_free(st);
    *t_fetch += t1 - t0;
    *t_load += kvr__wk_now_ms() - t1;
    return r;
}



void kvr__wk_seqstate_free(kvr__wk_seqstate *s)
{
    kvr__wk_state_free(&s->st);
    free(s->buf);
    free(s->cell);
    memset(s, 0, sizeof *s);
}

int kvr__wk_seqstate_get(kvr__wk_env *e, kvr__wk_seqstate *s, size_t np)
{
    memset(s, 0, sizeof *s);
    int r = kvr__wk_lm_state_get(e->lm, &s->buf, &s->len, e->err, sizeof e->err);
    if (r < 0)
        return r;
    char why[256];
    if ((r = kvr__wk_state_parse(&s->st, s->buf, s->len, why, sizeof why)) < 0) {
        kvr__wk_seqstate_free(s);
        return kvr__wk_fail(e, r, "llama.cpp's own state: %s", why);
    }
    if (s->st.n_cells && (s->st.n_layer != kvr__wk_n_layer(e) || s->st.n_embd != kvr__wk_n_embd(e))) {
        kvr__wk_seqstate_free(s);
        return kvr__wk_fail(e, KVR_EINVAL, "llama.cpp's state has %u layers x %u, the model %u x %zu",
                    s->st.n_layer, s->st.n_embd, kvr__wk_n_layer(e), kvr__wk_n_embd(e));
    }
    s->np = np;
    s->cell = malloc((np ? np : 1) * sizeof *s->cell);
    if (!s->cell) {
        kvr__wk_seqstate_free(s);
        return kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < np; i++)
        s->cell[i] = -1;
    for (uint32_t c = 0; c < s->st.n_cells; c++) {
        int32_t p = s->st.pos[c];
        if (p < 0 || (size_t)p >= np)
            continue;
        if (s->cell[p] >= 0) {
            kvr__wk_seqstate_free(s);
            return kvr__wk_fail(e, KVR_EINVAL, "llama.cpp's state holds position %d twice", p);
        }
        s->cell[p] = c;
    }
    return 0;
}

/* Payload of the cells at positions pos[0..n) (layer-major, the caller's). */
void *kvr__wk_seqstate_payload(kvr__wk_env *e, const kvr__wk_seqstate *s, const int64_t *pos,
                              size_t n, size_t p0)
{
    uint32_t *cells = malloc((n ? n : 1) * sizeof *cells);
    void *out = malloc(kvr__wk_payload_bytes(e, n) ? kvr__wk_payload_bytes(e, n) : 1);
    if (!cells || !out) {
        free(cells);
        free(out);
        kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        int64_t p = pos ? pos[i] : (int64_t)(p0 + i);
        if (p < 0 || (size_t)p >= s->np || s->cell[p] < 0) {
            free(cells);
            free(out);
            kvr__wk_fail(e, KVR_EINVAL, "llama.cpp's state has no cell at position %lld", (long long)p);
            return NULL;
        }
        cells[i] = (uint32_t)s->cell[p];
    }
    kvr__wk_state_gather(&s->st, cells, n, out);
    free(cells);
    return out;
}

int kvr__wk_ctx_len(kvr__wk_env *e, const char *ctx, kvr_context *info)
{
    int r = kvr_client_stat(e->kc, ctx, info);
    return r < 0 ? kvr__wk_kv_fail(e, r, "stat", ctx) : 0;
}

int kvr__wk_del_quiet(kvr__wk_env *e, const char *ctx)
{
    int r = kvr_client_delete(e->kc, ctx);
    return r < 0 && r != KVR_ENOCTX ? kvr__wk_kv_fail(e, r, "delete", ctx) : 0;
}

/* A fresh context `dst` holding tokens [0, n) of `src` (copy-on-write). */
int kvr__wk_fork_prefix(kvr__wk_env *e, const char *src, const char *dst, size_t n, size_t len)
{
    int r;
    assert(strcmp(src, dst) != 0);   /* callers never fork over their source */
    if ((r = kvr__wk_del_quiet(e, dst)) < 0)
        return r;
    if ((r = kvr_client_fork(e->kc, src, dst)) < 0)
        return kvr__wk_kv_fail(e, r, "fork", src);
    if (n < len && (r = kvr_client_keep(e->kc, dst, 0, n)) < 0)
        return kvr__wk_kv_fail(e, r, "keep", dst);
    return 0;
}
