/*
 * kvt_store.c — tests/common/kvt_store.h: stores, models and puts for the
 * cache/ tests.
 */
#include "tests/common/kvt_store.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kvr_store *kvt_store_new(const kvr_store_config *cfg)
{
    kvr_store_config none = { 0 };
    kvr_store *s = NULL;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_create(&s, cfg ? cfg : &none, &e), 0, "%s", e.msg);
    return s;
}

kvr_model_desc kvt_model_desc(const char *name, uint32_t n_layers, uint32_t n_kv_heads,
                              uint32_t head_dim, kvr_dtype dtype)
{
    kvr_model_desc d = { .name = name, .n_layers = n_layers, .n_kv_heads = n_kv_heads,
                         .head_dim = head_dim, .dtype = dtype };
    kvr_rope_config_init(&d.rope);
    d.rope.head_dim = (int)head_dim;
    d.rope.rotary_dim = (int)head_dim;
    return d;
}

void kvt_model_add(kvr_store *s, const kvr_model_desc *d, kvr_model_info *out)
{
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_model_register(s, d, out, &e), 0, "model %s: %s", d->name, e.msg);
}

void kvt_put_shape(kvr_put_params *p, const char *id, uint32_t n_layers, uint32_t n_kv_heads,
                   uint32_t head_dim, kvr_dtype dtype, const uint32_t *tokens, size_t n)
{
    p->ctx_id = id, p->model = "m";
    p->n_layers = n_layers, p->n_kv_heads = n_kv_heads, p->head_dim = head_dim;
    p->dtype = dtype, p->tokens = tokens, p->n_tokens = n;
}

kvr_store *kvt_store_with_model(const kvr_store_config *cfg, uint32_t n_layers,
                                uint32_t n_kv_heads, uint32_t head_dim, kvr_dtype dtype,
                                kvr_model_info *out)
{
    kvr_store *s = kvt_store_new(cfg);
    kvr_model_desc d = kvt_model_desc("m", n_layers, n_kv_heads, head_dim, dtype);
    kvt_model_add(s, &d, out);
    return s;
}

void kvt_tier_log(void *arg, int level, const char *msg)
{
    (void)arg;
    (void)level;
    fprintf(stderr, "tier: %s\n", msg);
}

kvr_store *kvt_store_open(const kvr_store_config *cfg, const kvr_tier_config *tc, bool log,
                          kvr_tier_recovery *rec, uint32_t n_layers, uint32_t n_kv_heads,
                          uint32_t head_dim, kvr_dtype dtype)
{
    kvr_store *s = kvt_store_new(cfg);
    kvr_error e = { 0 };
    if (tc)
        cr_assert_eq(kvr_store_tier_open(s, tc, log ? kvt_tier_log : NULL, NULL, rec, &e), 0,
                     "tier %s: %s", tc->dir, e.msg);
    if (kvr_store_model_find(s, "m", NULL) != 0) {
        kvr_model_desc d = kvt_model_desc("m", n_layers, n_kv_heads, head_dim, dtype);
        kvt_model_add(s, &d, NULL);
    }
    return s;
}

void kvt_put(kvr_store *s, const kvr_put_params *p, kvt_fill_fn fill, void *arg)
{
    kvr_error e = { 0 };
    cr_assert_eq(kvt_put_try(s, p, fill, arg, NULL, &e), 0, "put %s: %s", p->ctx_id, e.msg);
}

void kvt_edit(kvr_store *s, const kvr_edit_params *p, kvt_fill_fn fill, void *arg)
{
    kvr_error e = { 0 };
    kvr_edit *t = NULL;
    cr_assert_eq(kvr_store_edit_begin(s, p, &t, &e), 0, "edit %s: %s", p->ctx_id, e.msg);
    const struct iovec *iov;
    size_t niov;
    kvr_edit_payload_iov(t, &iov, &niov);
    for (size_t i = 0; i < niov; i++)
        fill(arg, iov[i].iov_base, iov[i].iov_len);
    if (kvr_edit_needs_work(t))
        cr_assert_eq(kvr_edit_work(t, &e), 0, "edit %s: %s", p->ctx_id, e.msg);
    cr_assert_eq(kvr_edit_commit(t, NULL, NULL, &e), 0, "edit %s: %s", p->ctx_id, e.msg);
}

void kvt_fill_src(void *arg, void *p, size_t bytes)
{
    kvt_src *src = arg;
    cr_assert_leq(bytes, src->len - src->off, "the payload is longer than the %zu bytes made",
                  src->len);
    memcpy(p, (const uint8_t *)src->p + src->off, bytes);
    src->off += bytes;
}

float kvt_kv_value(uint32_t seed, uint32_t l, int kv, uint64_t t, uint32_t h, uint32_t d)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (l * 1315423911ull) ^ ((uint64_t)kv << 40) ^
                 (t * 2654435761ull) ^ (h * 97531ull) ^ (d * 1009ull);
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return (float)((int)(x % 255) - 127) / 16.0f;
}

void *kvt_kv_payload(uint32_t seed, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim,
                     uint64_t t0, size_t n, kvr_dtype dt, size_t *bytes)
{
    size_t es = kvr_dtype_size(dt), cnt = (size_t)n_layers * 2 * n * n_kv_heads * head_dim;
    float *f = malloc(cnt * sizeof *f);
    cr_assert_not_null(f);
    size_t k = 0;
    for (uint32_t l = 0; l < n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t t = 0; t < n; t++)
                for (uint32_t h = 0; h < n_kv_heads; h++)
                    for (uint32_t d = 0; d < head_dim; d++)
                        f[k++] = kvt_kv_value(seed, l, kv, t0 + t, h, d);
    void *out = malloc(cnt * es);
    cr_assert_not_null(out);
    kvr_convert(out, dt, f, KVR_DTYPE_F32, cnt);
    free(f);
    *bytes = cnt * es;
    return out;
}

uint8_t *kvt_get_payload_try(kvr_store *s, const kvr_get_params *p, size_t *n,
                             kvr_get **keep_open, int *rc, kvr_error *e)
{
    kvr_get *g = NULL;
    kvr_error e0 = { 0 };
    kvr_error *err = e ? e : &e0;
    int r = kvr_store_get_begin(s, p, &g, err);
    if (rc)
        *rc = r;
    if (r)
        return NULL;
    if (kvr_get_needs_work(g))
        cr_assert_eq(kvr_get_work(g, err), 0, "get %s: %s", p->ctx_id, err->msg);
    size_t len = kvr_get_payload_size(g), off = 0, niov;
    const struct iovec *iov;
    kvr_get_payload_iov(g, &iov, &niov);
    uint8_t *out = malloc(len ? len : 1);
    cr_assert_not_null(out);
    for (size_t i = 0; i < niov; i++) {
        memcpy(out + off, iov[i].iov_base, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    cr_assert_eq(off, len);
    *n = len;
    if (keep_open)
        *keep_open = g;
    else
        kvr_get_end(g);
    return out;
}

uint8_t *kvt_get_payload(kvr_store *s, const kvr_get_params *p, size_t *n, kvr_get **keep_open)
{
    int rc = 0;
    kvr_error e = { 0 };
    uint8_t *out = kvt_get_payload_try(s, p, n, keep_open, &rc, &e);
    cr_assert_eq(rc, 0, "get %s: %s", p->ctx_id, e.msg);
    return out;
}

void kvt_fill_memset(void *arg, void *p, size_t bytes)
{
    memset(p, *(const uint8_t *)arg, bytes);
}

void kvt_edit_replace(kvr_store *s, const char *id, uint32_t n_layers, uint32_t n_kv_heads,
                      uint32_t head_dim, size_t start, size_t end, const uint32_t *tokens,
                      size_t n, uint8_t byte)
{
    kvr_edit_op op = { start, end, n, tokens, false };
    kvr_edit_params p = { .ctx_id = id, .ops = &op, .n_ops = 1, .with_kv = true,
                          .n_layers = n_layers, .n_kv_heads = n_kv_heads,
                          .head_dim = head_dim, .dtype = KVR_DTYPE_F16,
                          .payload_bytes = n * 2 * n_layers * n_kv_heads * head_dim * 2 };
    kvt_edit(s, &p, kvt_fill_memset, &byte);
}

/* f16 values of an LCG stream in [-1.5, 1.5); arg: its uint32_t state. */
static void fill_lcg_f16(void *arg, void *p, size_t bytes)
{
    uint32_t *x = arg;
    uint16_t *h = p;
    for (size_t k = 0; k < bytes / 2; k++) {
        *x = *x * 1664525u + 1013904223u;
        h[k] = kvr_f32_to_f16(((float)(*x >> 8) / 16777216.0f - 0.5f) * 3.0f);
    }
}

void kvt_put_f16(kvr_store *s, const char *id, const char *codec, kvr_put_mode mode,
                 uint32_t seed, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim,
                 size_t n)
{
    uint32_t *tok = malloc(n * sizeof *tok);
    cr_assert_not_null(tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = (uint32_t)(i * 7 + 1 + seed);
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = mode,
                         .n_layers = n_layers, .n_kv_heads = n_kv_heads, .head_dim = head_dim,
                         .dtype = KVR_DTYPE_F16, .n_tokens = n, .tokens = tok, .codec = codec };
    uint32_t x = 99 + seed;
    kvt_put(s, &p, fill_lcg_f16, &x);
    free(tok);
}

kvr_store *kvt_index_store(void)
{
    kvr_store_config c = { .block_tokens = 4 };
    return kvt_store_with_model(&c, 1, 1, 2, KVR_DTYPE_F16, NULL);
}

int kvt_index_put(kvr_store *s, const char *id, kvr_put_mode mode, const uint32_t *tok,
                  size_t n)
{
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = mode, .n_layers = 1,
                         .n_kv_heads = 1, .head_dim = 2, .dtype = KVR_DTYPE_F16,
                         .n_tokens = n, .tokens = tok };
    uint8_t zero = 0;
    return kvt_put_try(s, &p, kvt_fill_memset, &zero, NULL, NULL);
}
