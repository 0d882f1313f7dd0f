/*
 * test_cache_lazy_stage.c — staging is reserved only once the caller has
 * said how the payload goes out (issue 15): a get's begin reserves none; a
 * streamed get near the memory cap reserves only its ring (no eviction of
 * cold contexts, no refusal for memory it never uses); kvr_get_copy_into
 * and a kvr_put_work_from put (work_from) reserve and allocate no staging
 * at all; the bytes are the same whichever way.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt_store.h"

#define L 16
#define H 2
#define D 64
#define B 64
#define ROWB ((size_t)H * D * 2)          /* one token's K (or V) of a layer, f16 */

static kvr_store *mk(size_t cap_above)
{
    kvr_store_config c = { .block_tokens = B,
                           .max_memory = cap_above ? kvr_mem_allocated() + cap_above : 0 };
    return kvt_store_with_model(&c, L, H, D, KVR_DTYPE_F16, NULL);
}

static void fill(uint8_t *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)   /* f16 bit patterns, finite: high byte < 0x7c */
        p[i] = (uint8_t)((i & 1) ? (seed + i / 2 * 13u) % 0x70 : seed * 31u + i * 7u);
}

/* Fills iov[0..niov): each with the byte `byte`, or (byte < 0) iov[i]
 * with fill(seed + i). */
static void fill_iovs(const struct iovec *iov, size_t niov, int byte, uint32_t seed)
{
    for (size_t i = 0; i < niov; i++) {
        if (byte >= 0)
            memset(iov[i].iov_base, byte, iov[i].iov_len);
        else
            fill(iov[i].iov_base, iov[i].iov_len, seed + (uint32_t)i);
    }
}

/* n tokens, appended 128 at a time (each put under a quarter of the cap) */
static void put(kvr_store *s, const char *id, uint32_t seed, size_t n)
{
    for (size_t t0 = 0; t0 < n; t0 += 128) {
        size_t k = n - t0 < 128 ? n - t0 : 128;
        uint32_t tok[128];
        for (size_t i = 0; i < k; i++)
            tok[i] = seed * 100000u + (uint32_t)(t0 + i);
        kvr_put_params p = { .ctx_id = id, .model = "m", .mode = KVR_PUT_UPSERT,
                             .n_layers = L, .n_kv_heads = H, .head_dim = D,
                             .dtype = KVR_DTYPE_F16, .n_tokens = k, .tokens = tok };
        kvr_put *t;
        kvr_error e = { 0 };
        cr_assert_eq(kvr_store_put_begin(s, &p, &t, &e), 0, "%s", e.msg);
        const struct iovec *iov;
        size_t niov;
        kvr_put_payload_iov(t, &iov, &niov);
        fill_iovs(iov, niov, -1, seed + (uint32_t)t0);
        cr_assert_eq(kvr_put_commit(t, NULL, &e), 0, "%s", e.msg);
    }
}

/* A PIE-style edit: one token replaced near the start (the suffix moves by
 * +1), so every later key is re-rotated on read. */
static void edit(kvr_store *s, const char *id)
{
    uint32_t tk[2] = { 7, 8 };
    kvr_edit_op op = { .start = 2, .end = 3, .n_tokens = 2, .tokens = tk };
    kvr_edit_params ep = { .ctx_id = id, .ops = &op, .n_ops = 1, .with_kv = true,
                           .n_layers = L, .n_kv_heads = H, .head_dim = D,
                           .dtype = KVR_DTYPE_F16, .payload_bytes = 2 * 2 * L * ROWB };
    kvr_edit *t = NULL;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_edit_begin(s, &ep, &t, &e), 0, "%s", e.msg);
    const struct iovec *iov;
    size_t niov;
    kvr_edit_payload_iov(t, &iov, &niov);
    fill_iovs(iov, niov, 0x21, 0);
    if (kvr_edit_needs_work(t))
        cr_assert_eq(kvr_edit_work(t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_edit_commit(t, NULL, NULL, &e), 0, "%s", e.msg);
}

static uint64_t evicted(kvr_store *s)
{
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    return st.n_evicted_blocks;
}

static bool has(kvr_store *s, const char *id)
{
    kvr_ctx_info ci;
    return kvr_store_stat(s, id, &ci, NULL) == 0;
}

/* A get of the whole of "big" in f16, begun (asserted). */
static kvr_get *begin_big(kvr_store *s)
{
    kvr_get_params p = { .ctx_id = "big", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    kvr_get *g;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0, "%s", e.msg);
    return g;
}

/* The whole edited context into a buffer, the reference (no cap). */
static uint8_t *reference(size_t ntok, size_t *len)
{
    kvr_store *s = mk(0);
    put(s, "big", 1, ntok);
    edit(s, "big");
    kvr_get *g = begin_big(s);
    kvr_error e = { 0 };
    *len = kvr_get_payload_size(g);
    uint8_t *ref = malloc(*len);
    cr_assert_eq(kvr_get_copy_into(g, ref, *len, &e), 0, "%s", e.msg);
    kvr_get_end(g);
    kvr_store_destroy(s);
    return ref;
}

/* 512 tokens x 16 layers: 4 MiB of f16 K/V, all of it staged after the
 * edit. Cap: the context, cold ones (1 MiB each) and ~2 MiB of headroom. A
 * ring of 2 chunks of 2 layers (1 MiB) fits the headroom; the whole staging
 * (4 MiB, over a quarter of the cap) does not. */
#define NTOK 512
#define COLD 4

static kvr_store *near_cap(void)
{
    size_t ctx = (size_t)NTOK * ROWB * 2 * L;
    size_t cold = (size_t)128 * ROWB * 2 * L;   /* 1 MiB each */
    /* blocks carry metadata and size-class slack: measure instead */
    kvr_store *probe = mk(0);
    size_t a0 = kvr_mem_allocated();
    put(probe, "big", 1, NTOK);
    edit(probe, "big");
    char id[16];
    for (int i = 0; i < COLD; i++) {
        snprintf(id, sizeof id, "cold%d", i);
        put(probe, id, 10 + (uint32_t)i, 128);
    }
    size_t used = kvr_mem_allocated() - a0;
    kvr_store_destroy(probe);
    cr_assert_geq(used, ctx + COLD * cold);
    kvr_store *s = mk(used + (2u << 20));
    put(s, "big", 1, NTOK);
    edit(s, "big");
    for (int i = 0; i < COLD; i++) {
        snprintf(id, sizeof id, "cold%d", i);
        put(s, id, 10 + (uint32_t)i, 128);
    }
    return s;
}

static void all_cold_there(kvr_store *s)
{
    char id[16];
    for (int i = 0; i < COLD; i++) {
        snprintf(id, sizeof id, "cold%d", i);
        cr_assert(has(s, id), "%s was evicted", id);
    }
}

Test(lazy_stage, begin_reserves_no_staging)
{
    kvr_store *s = near_cap();
    uint64_t ev0 = evicted(s);
    size_t a0 = kvr_mem_allocated();
    kvr_get *g = begin_big(s);
    size_t payload = kvr_get_payload_size(g);
    cr_assert(kvr_get_needs_work(g));
    cr_assert_lt(kvr_mem_allocated() - a0, payload / 8, "begin allocated %zu bytes",
                 kvr_mem_allocated() - a0);
    cr_assert_eq(evicted(s), ev0);
    /* the iovecs wait for the staging */
    const struct iovec *iov;
    size_t niov;
    kvr_get_payload_iov(g, &iov, &niov);
    cr_assert_eq(niov, 0);
    kvr_get_end(g);
    all_cold_there(s);
    kvr_store_destroy(s);
}

Test(lazy_stage, streamed_get_near_the_cap_reserves_only_its_ring)
{
    size_t len;
    uint8_t *ref = reference(NTOK, &len);
    kvr_store *s = near_cap();
    uint64_t ev0 = evicted(s);
    kvr_error e = { 0 };
    /* Streamed, 2 layers a chunk, 2 slots: only the ring. */
    kvr_get *g = begin_big(s);
    cr_assert_eq(kvr_get_payload_size(g), len);
    size_t a0 = kvr_mem_allocated();
    cr_assert_eq(kvr_get_stage_ring(g, 2, 2, &e), 0, "%s", e.msg);
    size_t ring = kvr_mem_allocated() - a0;
    cr_assert_lt(ring, len / 2, "the ring took %zu bytes of a %zu-byte payload", ring, len);
    cr_assert_eq(evicted(s), ev0, "the ring evicted blocks");
    uint8_t *got = malloc(len);
    size_t off = 0;
    for (size_t l0 = 0; l0 < L; l0 += 2) {
        cr_assert_eq(kvr_get_work_layers(g, l0, l0 + 2, &e), 0, "%s", e.msg);
        const struct iovec *iov;
        size_t niov;
        kvr_get_payload_iov_layers(g, l0, l0 + 2, &iov, &niov);
        for (size_t i = 0; i < niov; i++) {
            memcpy(got + off, iov[i].iov_base, iov[i].iov_len);
            off += iov[i].iov_len;
        }
    }
    cr_assert_eq(off, len);
    cr_assert_eq(memcmp(ref, got, len), 0, "streamed bytes differ");
    kvr_get_end(g);
    cr_assert_eq(evicted(s), ev0);
    all_cold_there(s);
    /* What reserving the whole staging at begin did: refused, or room made
     * by evicting cold contexts. */
    kvr_get *w = begin_big(s);
    int rc = kvr_get_stage(w, &e);
    cr_assert(rc != 0 || evicted(s) > ev0, "the whole staging fit: the test proves nothing");
    kvr_get_end(w);
    free(got);
    free(ref);
    kvr_store_destroy(s);
}

Test(lazy_stage, copy_into_near_the_cap_stages_nothing)
{
    size_t len;
    uint8_t *ref = reference(NTOK, &len);
    uint8_t *got = malloc(len);   /* the caller's, before the store is near its cap */
    memset(got, 0xEE, len);
    kvr_store *s = near_cap();
    uint64_t ev0 = evicted(s);
    kvr_error e = { 0 };
    size_t a0 = kvr_mem_allocated();
    kvr_get *g = begin_big(s);
    cr_assert_eq(kvr_get_copy_into(g, got, len, &e), 0, "%s", e.msg);
    cr_assert_lt(kvr_mem_allocated() - a0, len / 8);
    cr_assert_eq(memcmp(ref, got, len), 0);
    kvr_get_end(g);
    cr_assert_eq(evicted(s), ev0);
    all_cold_there(s);
    free(got);
    free(ref);
    kvr_store_destroy(s);
}

/* A converting put (f32 payload into an f16 context) begun with
 * work_from: no staging reserved or allocated, the iovecs empty; the same
 * context as the iovec path. Without the payload, the commit fails and
 * nothing is stored. */
Test(lazy_stage, work_from_put_allocates_no_staging)
{
    kvr_store *s = mk(0);
    size_t n = 300, vals = (size_t)L * 2 * n * H * D;
    float *pl = malloc(vals * sizeof *pl);
    for (size_t i = 0; i < vals; i++)
        pl[i] = (float)((int)(i % 977) - 488) / 64.0f;
    uint32_t *tok = malloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = (uint32_t)i;
    kvr_error e = { 0 };
    size_t grew[2];
    for (int from = 0; from < 2; from++) {
        kvr_put_params p = { .ctx_id = from ? "b" : "a", .model = "m",
                             .mode = KVR_PUT_CREATE, .n_layers = L, .n_kv_heads = H,
                             .head_dim = D, .dtype = KVR_DTYPE_F32, .n_tokens = n,
                             .tokens = tok, .work_from = from };
        kvr_put *t;
        size_t a0 = kvr_mem_allocated();
        cr_assert_eq(kvr_store_put_begin(s, &p, &t, &e), 0, "%s", e.msg);
        grew[from] = kvr_mem_allocated() - a0;
        cr_assert(kvr_put_needs_work(t));
        const struct iovec *iov;
        size_t niov;
        kvr_put_payload_iov(t, &iov, &niov);
        if (from) {
            cr_assert_eq(niov, 0);
            cr_assert_eq(kvr_put_work_from(t, pl, vals * sizeof *pl, &e), 0, "%s", e.msg);
        } else {
            cr_assert_eq(niov, 1);
            memcpy(iov[0].iov_base, pl, vals * sizeof *pl);
            cr_assert_eq(kvr_put_work(t, &e), 0, "%s", e.msg);
        }
        cr_assert_not(kvr_put_needs_work(t));
        cr_assert_eq(kvr_put_commit(t, NULL, &e), 0, "%s", e.msg);
    }
    /* the f32 staging (vals * 4 bytes) is what the iovec put adds */
    cr_assert_lt(grew[1] + vals * sizeof *pl / 2, grew[0] + 1,
                 "work_from put grew %zu, the iovec put %zu", grew[1], grew[0]);
    cr_assert_lt(grew[1], vals * sizeof *pl * 3 / 4);
    kvr_get_params gp = { .ctx_id = "a", .end = SIZE_MAX, .dtype = KVR_DTYPE_F16 };
    size_t len = 0;
    uint8_t *out[2];
    for (int k = 0; k < 2; k++) {
        gp.ctx_id = k ? "b" : "a";
        kvr_get *g;
        cr_assert_eq(kvr_store_get_begin(s, &gp, &g, &e), 0, "%s", e.msg);
        len = kvr_get_payload_size(g);
        out[k] = malloc(len);
        cr_assert_eq(kvr_get_copy_into(g, out[k], len, &e), 0, "%s", e.msg);
        kvr_get_end(g);
    }
    cr_assert_eq(memcmp(out[0], out[1], len), 0);
    free(out[0]);
    free(out[1]);
    /* work_from promised, never given: the commit refuses, nothing stored */
    kvr_put_params p = { .ctx_id = "c", .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32,
                         .n_tokens = n, .tokens = tok, .work_from = true };
    kvr_put *t;
    cr_assert_eq(kvr_store_put_begin(s, &p, &t, &e), 0, "%s", e.msg);
    int rc = kvr_put_commit(t, NULL, &e);
    cr_assert_eq(rc, KVR_EINVAL, "rc %d: %s", rc, e.msg);
    cr_assert(strstr(e.msg, "kvr_put_work_from") != NULL, "%s", e.msg);
    cr_assert_not(has(s, "c"));
    free(tok);
    free(pl);
    kvr_store_destroy(s);
}
