/*
 * test_cache_raw_put.c — the two store hooks of the shared tier
 * (docs/cluster.md): a raw put (kvr_put_params.raw: a quantized context
 * created from the codes a raw get gave, plus its window in floats), which
 * must reproduce the source bit for bit without re-quantizing, and
 * kvr_store_layout_restore (group ids, flags, layout record on a context
 * just landed). Both refuse bad input and leave nothing behind.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt_store.h"

#define L 2
#define H 2
#define D 64
#define ROW (H * D)

static kvr_store *S;

static void setup(void)
{
    S = kvt_store_with_model(NULL, L, H, D, KVR_DTYPE_F32, NULL);
}

static void teardown(void)
{
    kvr_store_destroy(S);
}

TestSuite(raw_put, .init = setup, .fini = teardown);

/* A put whose payload is given (bytes); 0 or the error. FROM: read from
 * the caller's memory (kvr_put_work_from) instead of the iovecs. */
static bool FROM;
static int put_bytes(const kvr_put_params *p0, const void *pl, size_t len, kvr_error *e)
{
    kvr_put *t;
    kvr_put_params pp = *p0;
    pp.work_from = FROM;   /* no staging for a payload handed to work */
    int rc = kvr_store_put_begin(S, &pp, &t, e);
    if (rc)
        return rc;
    if (kvr_put_payload_size(t) != len) {
        kvr_put_abort(t);
        return -1000;
    }
    if (FROM) {
        if ((rc = kvr_put_work_from(t, pl, len, e)) != 0) {
            kvr_put_abort(t);
            return rc;
        }
        kvr_put_result res;
        return kvr_put_commit(t, &res, e);
    }
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(t, &iov, &niov);
    kvt_src src = { pl, len, 0 };
    for (size_t i = 0; i < niov; i++)
        kvt_fill_src(&src, iov[i].iov_base, iov[i].iov_len);
    if (kvr_put_needs_work(t) && (rc = kvr_put_work(t, e)) != 0) {
        kvr_put_abort(t);
        return rc;
    }
    kvr_put_result res;
    return kvr_put_commit(t, &res, e);
}

static uint32_t TOK[400];
static int64_t POS[400];

static int put_floats(const char *id, const char *codec, size_t n)
{
    float *pl = malloc((size_t)L * 2 * n * ROW * sizeof *pl);
    for (size_t i = 0; i < (size_t)L * 2 * n * ROW; i++)
        pl[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32, .n_tokens = n,
                         .tokens = TOK, .positions = POS, .codec = codec };
    kvr_error e = { 0 };
    int rc = put_bytes(&p, pl, (size_t)L * 2 * n * ROW * sizeof *pl, &e);
    free(pl);
    return rc;
}

/* A get's payload (copied), or NULL. */
static uint8_t *get_bytes(const char *id, size_t start, size_t end, bool raw, size_t *len,
                          const int64_t *pos)
{
    kvr_get_params p = { .ctx_id = id, .start = start, .end = end, .dtype = KVR_DTYPE_F32,
                         .raw = raw, .positions = pos, .n_positions = pos ? end - start : 0 };
    return kvt_get_payload_try(S, &p, len, NULL, NULL, NULL);
}

static void copy_of(const char *src, const char *dst, const char *codec, size_t n, size_t nq)
{
    size_t rl = 0, wl = 0;
    uint8_t *raw = nq ? get_bytes(src, 0, nq, true, &rl, NULL) : NULL;
    uint8_t *win = nq < n ? get_bytes(src, nq, n, false, &wl, NULL) : NULL;
    cr_assert(!nq || raw);
    cr_assert(nq == n || win);
    uint8_t *pl = malloc(rl + wl + 1);
    if (rl)
        memcpy(pl, raw, rl);
    if (wl)
        memcpy(pl + rl, win, wl);
    kvr_put_params p = { .ctx_id = dst, .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32, .n_tokens = n,
                         .tokens = TOK, .positions = POS, .codec = codec, .raw = true,
                         .raw_tokens = nq, .has_payload_bytes = true,
                         .payload_bytes = rl + wl };
    kvr_error e = { 0 };
    cr_assert_eq(put_bytes(&p, pl, rl + wl, &e), 0, "%s", e.msg);
    free(raw);
    free(win);
    free(pl);
}

static void assert_same_gets(const char *a, const char *b, size_t n)
{
    int64_t other[400];
    for (size_t i = 0; i < n; i++)
        other[i] = 5000 + 3 * (int64_t)i;
    for (int k = 0; k < 2; k++) {
        size_t la, lb;
        uint8_t *x = get_bytes(a, 0, n, false, &la, k ? other : NULL);
        uint8_t *y = get_bytes(b, 0, n, false, &lb, k ? other : NULL);
        cr_assert(x && y);
        cr_assert_eq(la, lb);
        cr_assert_eq(memcmp(x, y, la), 0, "%s and %s differ (%s positions)", a, b,
                     k ? "other" : "their own");
        free(x);
        free(y);
    }
    kvr_ctx_info ia, ib;
    cr_assert_eq(kvr_store_stat(S, a, &ia, NULL), 0);
    cr_assert_eq(kvr_store_stat(S, b, &ib, NULL), 0);
    cr_assert_str_eq(ia.codec, ib.codec);
    cr_assert_eq(ia.n_window, ib.n_window);
    cr_assert_eq(ia.kv_bytes, ib.kv_bytes);
}

static void reproduce(void);
Test(raw_put, reproduces_the_codes)
{
    reproduce();
}

/* The same, every put's payload read from the caller's memory. */
Test(raw_put, reproduces_the_codes_from_caller_memory)
{
    FROM = true;
    reproduce();
    FROM = false;
}

static void reproduce(void)
{
    for (size_t i = 0; i < 400; i++) {
        TOK[i] = 100 + (uint32_t)i;
        POS[i] = 7 + (int64_t)i;
    }
    static const struct { const char *codec; size_t n; } c[] = {
        { "int8", 100 }, { "kivi:k4v2:g32:r32", 100 }, { "q4_0", 70 }, { "k4v2", 400 },
    };
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        char a[16], b[16];
        snprintf(a, sizeof a, "a%zu", i);
        snprintf(b, sizeof b, "b%zu", i);
        cr_assert_eq(put_floats(a, c[i].codec, c[i].n), 0, "%s", c[i].codec);
        kvr_ctx_info ia;
        cr_assert_eq(kvr_store_stat(S, a, &ia, NULL), 0);
        copy_of(a, b, ia.codec, c[i].n, c[i].n - ia.n_window);
        assert_same_gets(a, b, c[i].n);
    }
}

Test(raw_put, refuses_and_leaves_nothing)
{
    for (size_t i = 0; i < 400; i++) {
        TOK[i] = (uint32_t)i;
        POS[i] = (int64_t)i;
    }
    uint8_t pl[1] = { 0 };
    kvr_error e = { 0 };
    kvr_put_params p = { .ctx_id = "x", .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32, .n_tokens = 100,
                         .tokens = TOK, .positions = POS, .codec = "kivi:k4v2:g32:r32",
                         .raw = true, .raw_tokens = 10 };
    cr_assert_eq(put_bytes(&p, pl, 0, &e), KVR_EINVAL, "not whole tiles: %s", e.msg);
    p.raw_tokens = 200;
    cr_assert_eq(put_bytes(&p, pl, 0, &e), KVR_EINVAL, "more than the put");
    p.raw_tokens = 64;
    p.codec = "f32";
    cr_assert_eq(put_bytes(&p, pl, 0, &e), KVR_EINVAL, "not quantized: %s", e.msg);
    p.codec = "int8";
    p.mode = KVR_PUT_UPSERT;
    cr_assert_eq(put_bytes(&p, pl, 0, &e), KVR_EBADREQUEST);
    p.mode = KVR_PUT_CREATE;
    p.positions = NULL;
    cr_assert_eq(put_bytes(&p, pl, 0, &e), KVR_EBADREQUEST);
    p.positions = POS;
    p.has_payload_bytes = true;
    p.payload_bytes = 12345;
    cr_assert_eq(put_bytes(&p, pl, 0, &e), KVR_EPAYLOAD, "%s", e.msg);
    cr_assert_eq(kvr_store_stat(S, "x", &(kvr_ctx_info){ 0 }, NULL), KVR_ENOCTX);
}

Test(raw_put, layout_restore_checks)
{
    for (size_t i = 0; i < 400; i++) {
        TOK[i] = (uint32_t)i;
        POS[i] = (int64_t)i;
    }
    cr_assert_eq(put_floats("p", "f32", 50), 0);
    kvr_layout_info li = { .n_groups = 2 };
    snprintf(li.groups[0].name, sizeof li.groups[0].name, "a");
    snprintf(li.groups[1].name, sizeof li.groups[1].name, "b");
    li.groups[1].offset = 1000;
    li.groups[1].cursor = 20;
    int32_t g[50];
    uint32_t f[50] = { 0 };
    for (int i = 0; i < 50; i++)
        g[i] = i < 30 ? 0 : 2;                 /* 2: no such group */
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_layout_restore(S, "p", &li, g, f, 50, &e), KVR_EINVAL);
    for (int i = 30; i < 50; i++)
        g[i] = 1;
    f[3] = KVR_TOKEN_APPROX;
    cr_assert_eq(kvr_store_layout_restore(S, "p", &li, g, f, 50, &e), KVR_EINVAL);
    f[3] = 0;
    cr_assert_eq(kvr_store_layout_restore(S, "p", &li, g, f, 49, &e), KVR_EINVAL);
    kvr_layout_info got;
    cr_assert_eq(kvr_store_layout_stat(S, "p", &got, NULL), 0);
    cr_assert_eq(got.n_groups, 0, "a refusal changes nothing");
    f[10] = f[11] = KVR_TOKEN_STALE;
    cr_assert_eq(kvr_store_layout_restore(S, "p", &li, g, f, 50, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_layout_stat(S, "p", &got, NULL), 0);
    cr_assert_eq(got.n_groups, 2);
    cr_assert_eq(got.groups[1].offset, 1000);
    cr_assert_eq(got.groups[1].cursor, 20);
    cr_assert_eq(got.groups[1].n_tokens, 20);
    kvr_get *gt;
    kvr_get_params gp = { .ctx_id = "p", .start = 0, .end = SIZE_MAX, .dtype = KVR_DTYPE_F32,
                          .meta_only = true };
    cr_assert_eq(kvr_store_get_begin(S, &gp, &gt, &e), 0);
    const kvr_get_info *gi = kvr_get_get_info(gt);
    cr_assert_eq(gi->flags[10], KVR_TOKEN_STALE);
    cr_assert_eq(gi->flags[12], 0);
    cr_assert_eq(gi->groups[40], 1);
    kvr_get_end(gt);
    cr_assert_eq(kvr_store_layout_restore(S, "p", &li, g, f, 50, &e), KVR_EBUSY,
                 "a layout already there");
}
