/*
 * cache_stream.c — tests/common/cache_stream.h: the store-level K/V stream, its puts and whole gets.
 * Compiled once into libtestcommon.a.
 */
#include "tests/common/cache_stream.h"
#include "tests/common/kvt_store.h"

float kvt_val(uint32_t seed, int l, int kv, size_t t, size_t j)
{
    uint32_t h = seed * 2654435761u ^ (uint32_t)(l * 7919 + kv * 104729) ^
                 (uint32_t)(t * 40503u) ^ (uint32_t)(j * 97u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    return (float)(h % 20001u) / 10000.0f - 1.0f;
}

/* (kvt_store.h; here, without Criterion, so benchmarks link it too) */
int kvt_put_try(kvr_store *s, const kvr_put_params *p, kvt_fill_fn fill, void *arg,
                kvr_put_result *res, kvr_error *e)
{
    kvr_put *t = NULL;
    int rc = kvr_store_put_begin(s, p, &t, e);
    if (rc)
        return rc;
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(t, &iov, &niov);
    for (size_t i = 0; i < niov; i++)
        fill(arg, iov[i].iov_base, iov[i].iov_len);
    if (kvr_put_needs_work(t) && (rc = kvr_put_work(t, e)) != 0) {
        kvr_put_abort(t);
        return rc;
    }
    return kvr_put_commit(t, res, e);
}

/* kvt_put_try's fill: the next bytes from *(const uint8_t **)arg. */
static void copy_on(void *arg, void *p, size_t n)
{
    const uint8_t **src = arg;
    memcpy(p, *src, n);
    *src += n;
}

int kvt_stream_put(kvr_store *s, const kvt_range *a, kvr_error *e)
{
    size_t row = (size_t)a->n_heads * a->head_dim, n = a->n;
    float *p = malloc((size_t)a->n_layers * 2 * n * row * sizeof *p);
    uint32_t *tok = malloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = a->seed * 1000 + (uint32_t)(a->first + i);
    size_t k = 0;
    for (int l = 0; l < (int)a->n_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (size_t t = 0; t < n; t++)
                for (size_t j = 0; j < row; j++)
                    p[k++] = kvt_val(a->seed, l, kv, a->first + t, j);
    kvr_put_params pp = { .ctx_id = a->id, .model = "m", .mode = a->mode,
                          .n_layers = a->n_layers, .n_kv_heads = a->n_heads,
                          .head_dim = a->head_dim,
                          .dtype = KVR_DTYPE_F32, .n_tokens = n, .tokens = tok,
                          .codec = a->codec, .prefix_ctx = a->prefix, .persist = a->persist };
    const uint8_t *src = (const uint8_t *)p;
    int rc = kvt_put_try(s, &pp, copy_on, &src, NULL, e);
    free(p);
    free(tok);
    return rc;
}

/* A whole get of id in dtype dt, worked, then its payload and (meta) its
 * tokens, positions and flags into one malloc'd buffer. */
static uint8_t *get_whole(kvr_store *s, const char *id, kvr_dtype dt, bool meta, size_t *len,
                          kvr_error *e)
{
    kvr_get_params gp = { .ctx_id = id, .start = 0, .end = SIZE_MAX, .dtype = dt };
    kvr_get *g;
    if (kvr_store_get_begin(s, &gp, &g, e) != 0)
        return NULL;
    if (kvr_get_needs_work(g) && kvr_get_work(g, e) != 0) {
        kvr_get_end(g);
        return NULL;
    }
    const kvr_get_info *gi = kvr_get_get_info(g);
    *len = kvr_get_payload_size(g) + (meta ? gi->n_tokens * (4 + 8 + 4) : 0);
    uint8_t *out = malloc(*len ? *len : 1), *w = out;
    const struct iovec *iov;
    size_t ni;
    kvr_get_payload_iov(g, &iov, &ni);
    for (size_t i = 0; i < ni; i++) {
        memcpy(w, iov[i].iov_base, iov[i].iov_len);
        w += iov[i].iov_len;
    }
    if (meta) {
        memcpy(w, gi->tokens, gi->n_tokens * 4);
        w += gi->n_tokens * 4;
        memcpy(w, gi->positions, gi->n_tokens * 8);
        w += gi->n_tokens * 8;
        memcpy(w, gi->flags, gi->n_tokens * 4);
    }
    kvr_get_end(g);
    return out;
}

uint8_t *kvt_get_all(kvr_store *s, const char *id, size_t *len, kvr_error *e)
{
    return get_whole(s, id, KVR_DTYPE_F32, true, len, e);
}

uint8_t *kvt_get_kv(kvr_store *s, const char *id, kvr_dtype dt, size_t *len, kvr_error *e)
{
    return get_whole(s, id, dt, false, len, e);
}
