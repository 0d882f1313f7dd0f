/*
 * test_cache_layout.c — GPE groups and StreamingLLM sinks + window at the
 * store level: positions per group under interleaved appends, offsets,
 * keys equal to a fresh rope of the pre-RoPE keys at every token's
 * position, the window's contiguity and memory, and every refusal leaving
 * the context as it was.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_store.h"

#define L 2
#define H 2
#define D 16

/* Pre-RoPE key / value of token `uid`, exactly representable in f32. */
static float xval(uint32_t uid, uint32_t l, int kv, uint32_t h, uint32_t d)
{
    uint64_t x = (uid + 1) * 0x9E3779B97F4A7C15ull ^ (l * 1315423911ull) ^
                 ((uint64_t)kv << 40) ^ (h * 97531ull) ^ (d * 1009ull);
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return (float)((int)(x % 255) - 127) / 16.0f;
}

static kvr_store *S_;
static kvr_model_info MI;

static void setup(uint32_t B)
{
    kvr_store_config c = { .block_tokens = B };
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_create(&S_, &c, &e), 0, "%s", e.msg);
    kvr_model_desc d = { .name = "m", .n_layers = L, .n_kv_heads = H, .head_dim = D,
                         .dtype = KVR_DTYPE_F32 };
    kvr_rope_config_init(&d.rope);
    cr_assert_eq(kvr_store_model_register(S_, &d, &MI, &e), 0, "%s", e.msg);
}

/* Expected key of uid at pos, layer l: rope(x, pos). */
static void key_at(uint32_t uid, uint32_t l, int64_t pos, float *out)
{
    float x[H * D];
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t d = 0; d < D; d++)
            x[h * D + d] = xval(uid, l, 0, h, d);
    cr_assert_eq(kvr_rope_apply(MI.engine, out, KVR_DTYPE_F32, x, KVR_DTYPE_F32, 1, H,
                                &pos, NULL), 0);
}

/* n token ids id0.. in u, at positions pos0.. in p. */
static void ids_at(uint32_t *u, int64_t *p, size_t n, uint32_t id0, int64_t pos0)
{
    for (size_t i = 0; i < n; i++) {
        u[i] = id0 + (uint32_t)i;
        p[i] = pos0 + (int64_t)i;
    }
}

/* Puts tokens uids[0..n) (token id = uid) whose keys are rotated at pos. */
static int put(const char *id, kvr_put_params p, const uint32_t *uids, const int64_t *pos,
               size_t n, kvr_put_result *res, kvr_error *e)
{
    kvt_put_shape(&p, id, L, H, D, KVR_DTYPE_F32, uids, n);
    size_t row = H * D;
    float *pl = malloc(L * 2 * n * row * sizeof *pl);
    for (uint32_t l = 0; l < L; l++) {
        float *k = pl + (size_t)l * 2 * n * row, *v = k + n * row;
        for (size_t i = 0; i < n; i++) {
            key_at(uids[i], l, pos[i], k + i * row);
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++)
                    v[i * row + h * D + d] = xval(uids[i], l, 1, h, d);
        }
    }
    kvt_src src = { pl, L * 2 * n * row * sizeof *pl, 0 };
    int rc = kvt_put_try(S_, &p, kvt_fill_src, &src, res, e);
    if (rc == 0)
        cr_assert_eq(src.off, src.len);
    free(pl);
    return rc;
}

/* Gets the whole context (f32, logical positions) and checks every token's
 * id, position and group against the model, and its K/V against rope. */
static void check_ctx(const char *id, const uint32_t *uids, const int64_t *pos,
                      const int32_t *groups, size_t n)
{
    kvr_get_params gp = { .ctx_id = id, .end = SIZE_MAX, .dtype = KVR_DTYPE_F32 };
    kvr_get *g = NULL;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_get_begin(S_, &gp, &g, &e), 0, "%s", e.msg);
    const kvr_get_info *in = kvr_get_get_info(g);
    cr_assert_eq(in->n_tokens, n);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(in->tokens[i], uids[i], "token %zu", i);
        cr_assert_eq(in->positions[i], pos[i], "token %zu: position %lld, want %lld", i,
                     (long long)in->positions[i], (long long)pos[i]);
        if (groups)
            cr_assert_eq(in->groups[i], groups[i], "token %zu group", i);
    }
    if (kvr_get_needs_work(g))
        cr_assert_eq(kvr_get_work(g, &e), 0, "%s", e.msg);
    size_t row = H * D, bytes = kvr_get_payload_size(g);
    float *pl = malloc(bytes ? bytes : 1);
    const struct iovec *iov;
    size_t niov;
    kvr_get_payload_iov(g, &iov, &niov);
    cr_assert_eq(kvt_gather(pl, iov, niov), bytes);
    for (uint32_t l = 0; l < L; l++) {
        const float *k = pl + (size_t)l * 2 * n * row, *v = k + n * row;
        for (size_t i = 0; i < n; i++) {
            float want[H * D];
            key_at(uids[i], l, pos[i], want);
            for (size_t j = 0; j < row; j++)
                cr_assert_float_eq(k[i * row + j], want[j], 2e-4,
                                   "layer %u token %zu dim %zu: %g vs %g", l, i, j,
                                   (double)k[i * row + j], (double)want[j]);
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++)
                    cr_assert_eq(v[i * row + h * D + d], xval(uids[i], l, 1, h, d));
        }
    }
    free(pl);
    kvr_get_end(g);
}

static void teardown(void)
{
    kvr_store_destroy(S_);
    S_ = NULL;
}

/* ---- groups ------------------------------------------------------------- */

#define MAXT 512
typedef struct gmodel {
    uint32_t uid[MAXT];
    int64_t  pos[MAXT];
    int32_t  grp[MAXT];
    size_t   n;
    int64_t  phi[2];
    uint64_t cur[2];
} gmodel;

static const char *const GN[2] = { "source", "target" };

static void gappend(gmodel *M, const char *id, int g, size_t k, bool create)
{
    uint32_t u[64];
    int64_t p[64];
    for (size_t i = 0; i < k; i++) {
        u[i] = (uint32_t)(M->n + i);
        p[i] = M->phi[g] + (int64_t)(M->cur[g] + i);
    }
    kvr_put_params pp = { .mode = create ? KVR_PUT_CREATE : KVR_PUT_APPEND,
                          .group = GN[g] };
    int64_t offs[2] = { M->phi[0], M->phi[1] };
    if (create) {
        pp.groups = GN;
        pp.n_groups = 2;
        pp.group_offsets = offs;
    }
    kvr_put_result r;
    kvr_error e = { 0 };
    cr_assert_eq(put(id, pp, u, p, k, &r, &e), 0, "%s", e.msg);
    cr_assert_eq(r.first_pos, p[0]);
    cr_assert_eq(r.last_pos, p[k - 1]);
    for (size_t i = 0; i < k; i++) {
        M->uid[M->n] = u[i];
        M->pos[M->n] = p[i];
        M->grp[M->n] = g;
        M->n++;
    }
    M->cur[g] += k;
}

Test(layout_groups, interleaved_appends_keep_each_group_exact, .fini = teardown)
{
    setup(8);
    gmodel M = { .phi = { 0, 1000 } };
    gappend(&M, "s", 0, 5, true);
    unsigned seed = 7;
    for (int step = 0; step < 60; step++) {
        seed = seed * 1103515245u + 12345u;
        int g = (int)((seed >> 16) & 1);
        size_t k = 1 + ((seed >> 8) % 6);
        gappend(&M, "s", g, k, false);
        if (step % 15 == 14)
            check_ctx("s", M.uid, M.pos, M.grp, M.n);
    }
    check_ctx("s", M.uid, M.pos, M.grp, M.n);

    kvr_layout_info li;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_layout_stat(S_, "s", &li, &e), 0);
    cr_assert_eq(li.n_groups, 2);
    cr_assert_str_eq(li.groups[0].name, "source");
    cr_assert_str_eq(li.groups[1].name, "target");
    cr_assert_eq(li.groups[1].offset, 1000);
    cr_assert_eq(li.groups[0].cursor, M.cur[0]);
    cr_assert_eq(li.groups[1].cursor, M.cur[1]);
    cr_assert_eq(li.groups[0].n_tokens + li.groups[1].n_tokens, M.n);
}

/* Appending to one group leaves the other's keys bit for bit. */
Test(layout_groups, append_never_touches_other_group, .fini = teardown)
{
    setup(4);
    gmodel M = { .phi = { 0, 50 } };
    gappend(&M, "s", 0, 6, true);
    gappend(&M, "s", 1, 3, false);
    gappend(&M, "s", 0, 2, false);
    kvr_get_params gp = { .ctx_id = "s", .end = SIZE_MAX, .dtype = KVR_DTYPE_F32 };
    kvr_error e = { 0 };
    kvr_get *g = NULL;
    cr_assert_eq(kvr_store_get_begin(S_, &gp, &g, &e), 0);
    kvr_get_work(g, &e);
    size_t bytes = kvr_get_payload_size(g), niov;
    char *before = malloc(bytes);
    const struct iovec *iov;
    kvr_get_payload_iov(g, &iov, &niov);
    kvt_gather(before, iov, niov);
    size_t n0 = M.n;
    kvr_get_end(g);
    for (int i = 0; i < 10; i++)
        gappend(&M, "s", 1, 1 + (size_t)i % 3, false);
    /* The first n0 tokens: same positions, same key bytes, per layer. */
    gp.end = n0;
    cr_assert_eq(kvr_store_get_begin(S_, &gp, &g, &e), 0);
    kvr_get_work(g, &e);
    const kvr_get_info *in = kvr_get_get_info(g);
    for (size_t i = 0; i < n0; i++)
        cr_assert_eq(in->positions[i], M.pos[i]);
    char *after = malloc(bytes);
    kvr_get_payload_iov(g, &iov, &niov);
    cr_assert_eq(kvt_gather(after, iov, niov), bytes);
    cr_assert_eq(memcmp(before, after, bytes), 0);
    kvr_get_end(g);
    free(before);
    free(after);
    check_ctx("s", M.uid, M.pos, M.grp, M.n);
}

Test(layout_groups, offset_change_moves_only_that_group, .fini = teardown)
{
    setup(8);
    gmodel M = { .phi = { 0, 0 } };
    gappend(&M, "s", 0, 7, true);
    for (int i = 0; i < 12; i++)
        gappend(&M, "s", i & 1, 1 + (size_t)i % 4, false);
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_set_group_offset(S_, "s", "target", 300, &e), 0, "%s", e.msg);
    for (size_t i = 0; i < M.n; i++)
        if (M.grp[i] == 1)
            M.pos[i] += 300;
    M.phi[1] = 300;
    check_ctx("s", M.uid, M.pos, M.grp, M.n);
    /* New target tokens continue at phi + cursor; source is unaffected. */
    gappend(&M, "s", 1, 3, false);
    gappend(&M, "s", 0, 2, false);
    check_ctx("s", M.uid, M.pos, M.grp, M.n);
    /* Back down, below the original. */
    cr_assert_eq(kvr_store_set_group_offset(S_, "s", "source", -40, &e), 0, "%s", e.msg);
    for (size_t i = 0; i < M.n; i++)
        if (M.grp[i] == 0)
            M.pos[i] -= 40;
    M.phi[0] = -40;
    gappend(&M, "s", 0, 4, false);
    check_ctx("s", M.uid, M.pos, M.grp, M.n);
    kvr_layout_info li;
    cr_assert_eq(kvr_store_layout_stat(S_, "s", &li, &e), 0);
    cr_assert_eq(li.groups[0].offset, -40);
    cr_assert_eq(li.groups[1].offset, 300);
}

static void same_ctx(const char *id, const kvr_ctx_info *a)
{
    kvr_ctx_info b;
    cr_assert_eq(kvr_store_stat(S_, id, &b, NULL), 0);
    cr_assert_eq(a->n_tokens, b.n_tokens);
    cr_assert_eq(a->pos_min, b.pos_min);
    cr_assert_eq(a->pos_max, b.pos_max);
    cr_assert_eq(a->n_blocks, b.n_blocks);
}

Test(layout_groups, refusals_change_nothing, .fini = teardown)
{
    setup(8);
    gmodel M = { .phi = { 0, 100 } };
    gappend(&M, "s", 0, 4, true);
    gappend(&M, "s", 1, 2, false);
    kvr_ctx_info before;
    cr_assert_eq(kvr_store_stat(S_, "s", &before, NULL), 0);
    kvr_error e = { 0 };
    uint32_t u[2] = { 900, 901 };
    int64_t p[2] = { 0, 1 };

    kvr_put_params pp = { .mode = KVR_PUT_APPEND, .group = "nope" };
    cr_assert_eq(put("s", pp, u, p, 2, NULL, &e), KVR_EINVAL);
    cr_assert(strstr(e.msg, "nope"), "%s", e.msg);
    pp.group = NULL;
    cr_assert_eq(put("s", pp, u, p, 2, NULL, &e), KVR_EBADREQUEST, "%s", e.msg);
    pp.group = "source";
    pp.has_pos_start = true;
    cr_assert_eq(put("s", pp, u, p, 2, NULL, &e), KVR_EBADREQUEST, "%s", e.msg);
    pp = (kvr_put_params){ .mode = KVR_PUT_APPEND, .group = "source", .groups = GN,
                           .n_groups = 2 };
    cr_assert_eq(put("s", pp, u, p, 2, NULL, &e), KVR_EBADREQUEST, "%s", e.msg);
    same_ctx("s", &before);

    cr_assert_eq(kvr_store_set_group_offset(S_, "s", "nope", 5, &e), KVR_EINVAL);
    cr_assert_eq(kvr_store_set_group_offset(S_, "s", "target", INT64_MAX, &e), KVR_EINVAL,
                 "%s", e.msg);
    cr_assert_eq(kvr_store_set_group_offset(S_, "s", "target", INT64_MAX - 1, &e), KVR_EINVAL,
                 "%s", e.msg);
    cr_assert_eq(kvr_store_set_group_offset(S_, "nope", "source", 1, &e), KVR_ENOCTX);
    kvr_retention r = { .sinks = 2, .window = 4 };
    cr_assert_eq(kvr_store_set_retention(S_, "s", &r, &e), KVR_EUNSUPPORTED, "%s", e.msg);
    same_ctx("s", &before);
    check_ctx("s", M.uid, M.pos, M.grp, M.n);

    /* Creation refusals: duplicates, too many, bad names, unknown group,
     * offsets whose positions overflow. No context appears. */
    const char *dup[2] = { "a", "a" };
    pp = (kvr_put_params){ .mode = KVR_PUT_CREATE, .group = "a", .groups = dup,
                           .n_groups = 2 };
    cr_assert_eq(put("t", pp, u, p, 2, NULL, &e), KVR_EINVAL, "%s", e.msg);
    cr_assert(strstr(e.msg, "duplicate"), "%s", e.msg);
    const char *many[KVR_MAX_GROUPS + 1];
    char names[KVR_MAX_GROUPS + 1][16];
    for (int i = 0; i <= KVR_MAX_GROUPS; i++) {
        snprintf(names[i], sizeof names[i], "g%d", i);
        many[i] = names[i];
    }
    pp = (kvr_put_params){ .mode = KVR_PUT_CREATE, .group = "g0", .groups = many,
                           .n_groups = KVR_MAX_GROUPS + 1 };
    cr_assert_eq(put("t", pp, u, p, 2, NULL, &e), KVR_ELIMIT, "%s", e.msg);
    const char *empty[1] = { "" };
    pp = (kvr_put_params){ .mode = KVR_PUT_CREATE, .group = "", .groups = empty,
                           .n_groups = 1 };
    cr_assert_eq(put("t", pp, u, p, 2, NULL, &e), KVR_EINVAL, "%s", e.msg);
    pp = (kvr_put_params){ .mode = KVR_PUT_CREATE, .group = "zzz", .groups = GN,
                           .n_groups = 2 };
    cr_assert_eq(put("t", pp, u, p, 2, NULL, &e), KVR_EINVAL, "%s", e.msg);
    int64_t big[2] = { INT64_MAX, 0 };
    pp = (kvr_put_params){ .mode = KVR_PUT_CREATE, .group = "source", .groups = GN,
                           .n_groups = 2, .group_offsets = big };
    cr_assert_eq(put("t", pp, u, p, 2, NULL, &e), KVR_EINVAL, "%s", e.msg);
    kvr_ctx_info ti;
    cr_assert_eq(kvr_store_stat(S_, "t", &ti, NULL), KVR_ENOCTX);
}

Test(layout_groups, fork_keeps_groups, .fini = teardown)
{
    setup(8);
    gmodel M = { .phi = { 0, 10 } };
    gappend(&M, "s", 0, 3, true);
    gappend(&M, "s", 1, 3, false);
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_fork(S_, "s", "f", &e), 0, "%s", e.msg);
    gmodel F = M;
    gappend(&F, "f", 1, 2, false);
    check_ctx("f", F.uid, F.pos, F.grp, F.n);
    check_ctx("s", M.uid, M.pos, M.grp, M.n);
}

/* ---- sinks + window ----------------------------------------------------- */

Test(layout_retention, window_keeps_the_right_tokens_exactly, .fini = teardown)
{
    setup(8);
    const size_t SK = 4, W = 16;
    uint32_t all[1024];
    size_t total = 0;
    kvr_error e = { 0 };
    /* Sinks first, then the policy, then a stream of appends. */
    uint32_t u[16];
    int64_t p[16];
    for (size_t i = 0; i < SK; i++) {
        u[i] = (uint32_t)i;
        p[i] = (int64_t)i;
        all[total++] = (uint32_t)i;
    }
    cr_assert_eq(put("r", (kvr_put_params){ .mode = KVR_PUT_CREATE }, u, p, SK, NULL, &e),
                 0, "%s", e.msg);
    kvr_retention r = { .sinks = SK, .window = W };
    cr_assert_eq(kvr_store_set_retention(S_, "r", &r, &e), 0, "%s", e.msg);
    unsigned seed = 1;
    size_t max_blocks = 0;
    while (total < 600) {
        seed = seed * 1103515245u + 12345u;
        size_t k = 1 + (seed >> 16) % 9;
        kvr_ctx_info ci;
        cr_assert_eq(kvr_store_stat(S_, "r", &ci, NULL), 0);
        int64_t next = ci.pos_max + 1;
        for (size_t i = 0; i < k; i++) {
            u[i] = (uint32_t)(total + i);
            p[i] = next + (int64_t)i;        /* the worker rotates at the next positions */
        }
        kvr_put_result res;
        cr_assert_eq(put("r", (kvr_put_params){ .mode = KVR_PUT_APPEND }, u, p, k, &res, &e),
                     0, "%s", e.msg);
        for (size_t i = 0; i < k; i++)
            all[total++] = u[i];
        size_t n = total < SK + W ? total : SK + W;
        cr_assert_eq(res.n_tokens, n);
        cr_assert_eq(res.last_pos, (int64_t)n - 1, "last_pos %lld, n %zu",
                     (long long)res.last_pos, n);
        /* Model: the first SK tokens, then the last W, at 0..n-1. */
        uint32_t want[64];
        int64_t wpos[64];
        for (size_t i = 0; i < n; i++) {
            want[i] = i < SK ? all[i] : all[total - (n - i)];
            wpos[i] = (int64_t)i;
        }
        if (total % 5 == 0 || total > 590)
            check_ctx("r", want, wpos, NULL, n);
        kvr_store_stats st;
        kvr_store_get_stats(S_, &st);
        if (st.n_blocks > max_blocks)
            max_blocks = st.n_blocks;
        kvr_match_result mr;
        cr_assert_eq(kvr_store_match(S_, "m", want, n, false, &mr, &e), 0);
        cr_assert_eq(mr.length, n);
    }
    /* Memory stays bounded: sinks' block + the window's blocks + one partial. */
    cr_assert_leq(max_blocks, 1 + (W + 7) / 8 + 2, "up to %zu blocks", max_blocks);
    kvr_layout_info li;
    cr_assert_eq(kvr_store_layout_stat(S_, "r", &li, &e), 0);
    cr_assert_eq(li.n_dropped, total - SK - W);
    cr_assert_eq(kvr_store_delete(S_, "r", &e), 0);
    kvr_store_stats st;
    kvr_store_get_stats(S_, &st);
    cr_assert_eq(st.n_blocks, 0);
    cr_assert_eq(st.block_bytes, 0);
}

Test(layout_retention, policy_on_long_context_drops_now_and_no_sinks, .fini = teardown)
{
    setup(8);
    uint32_t u[40];
    int64_t p[40];
    ids_at(u, p, 40, 0, 100);
    kvr_error e = { 0 };
    cr_assert_eq(put("r", (kvr_put_params){ .mode = KVR_PUT_CREATE, .positions = p }, u, p,
                     40, NULL, &e), 0, "%s", e.msg);
    kvr_retention r = { .sinks = 0, .window = 10 };
    cr_assert_eq(kvr_store_set_retention(S_, "r", &r, &e), 0, "%s", e.msg);
    /* Without sinks the window starts where the oldest token was. */
    uint32_t want[10];
    int64_t wpos[10];
    ids_at(want, wpos, 10, 30, 100);
    check_ctx("r", want, wpos, NULL, 10);
    r.off = true;
    cr_assert_eq(kvr_store_set_retention(S_, "r", &r, &e), 0);
    ids_at(u, p, 5, 40, 110);
    cr_assert_eq(put("r", (kvr_put_params){ .mode = KVR_PUT_APPEND }, u, p, 5, NULL, &e), 0);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(S_, "r", &ci, NULL), 0);
    cr_assert_eq(ci.n_tokens, 15);
}

Test(layout_retention, refusals, .fini = teardown)
{
    setup(8);
    uint32_t u[4] = { 1, 2, 3, 4 };
    int64_t p[4] = { 0, 1, 2, 3 };
    kvr_error e = { 0 };
    cr_assert_eq(put("r", (kvr_put_params){ .mode = KVR_PUT_CREATE }, u, p, 4, NULL, &e), 0);
    kvr_retention r = { .sinks = 4, .window = 0 };
    cr_assert_eq(kvr_store_set_retention(S_, "r", &r, &e), KVR_EINVAL, "%s", e.msg);
    r = (kvr_retention){ .sinks = SIZE_MAX, .window = 2 };
    cr_assert_eq(kvr_store_set_retention(S_, "r", &r, &e), KVR_EINVAL, "%s", e.msg);
    r = (kvr_retention){ .sinks = KVR_RETENTION_MAX, .window = 1 };
    cr_assert_eq(kvr_store_set_retention(S_, "r", &r, &e), KVR_EINVAL, "%s", e.msg);
    cr_assert_eq(kvr_store_set_retention(S_, "r", NULL, &e), KVR_EBADREQUEST);
    r = (kvr_retention){ .sinks = 1, .window = 1 };
    cr_assert_eq(kvr_store_set_retention(S_, "zz", &r, &e), KVR_ENOCTX);
    kvr_layout_info li;
    cr_assert_eq(kvr_store_layout_stat(S_, "r", &li, &e), 0);
    cr_assert(!li.has_retention);
    check_ctx("r", u, p, NULL, 4);
}

/* protect_first is part of the put: checked at begin (nothing stored when
 * it is out of range), applied at commit after retention, so a committed
 * put never fails on it even when retention leaves fewer tokens. */
Test(layout_retention, protect_first_applies_after_retention, .fini = teardown)
{
    setup(8);
    kvr_error e = { 0 };
    uint32_t u[8];
    int64_t p[8];
    ids_at(u, p, 8, 0, 0);
    cr_assert_eq(put("r", (kvr_put_params){ .mode = KVR_PUT_CREATE }, u, p, 6, NULL, &e), 0);
    kvr_retention r = { .sinks = 2, .window = 4 };
    cr_assert_eq(kvr_store_set_retention(S_, "r", &r, &e), 0, "%s", e.msg);
    /* 6 + 2 = 8 before retention, 6 after: protect_first 8 is valid at
     * begin and clamps to the 6 tokens left. */
    kvr_put_result res;
    int rc = put("r", (kvr_put_params){ .mode = KVR_PUT_APPEND, .has_protect_first = true,
                                       .protect_first = 8 }, u + 6, p + 6, 2, &res, &e);
    cr_assert_eq(rc, 0, "%s", e.msg);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(S_, "r", &ci, NULL), 0);
    cr_assert_eq(ci.n_tokens, 6);
    cr_assert_eq(ci.n_protected, 6);
    /* Beyond what the context will hold: refused at begin, nothing stored. */
    rc = put("r", (kvr_put_params){ .mode = KVR_PUT_APPEND, .has_protect_first = true,
                                   .protect_first = 9 }, u + 6, p + 6, 2, NULL, &e);
    cr_assert_eq(rc, KVR_ERANGE, "%s", e.msg);
    cr_assert(strstr(e.msg, "protect_first") != NULL, "%s", e.msg);
    cr_assert_eq(kvr_store_stat(S_, "r", &ci, NULL), 0);
    cr_assert_eq(ci.n_tokens, 6);
    cr_assert_eq(ci.n_protected, 6);
    /* 0 removes the protection. */
    cr_assert_eq(put("r", (kvr_put_params){ .mode = KVR_PUT_APPEND, .has_protect_first = true,
                                           .protect_first = 0 }, u + 6, p + 6, 1, NULL, &e),
                 0, "%s", e.msg);
    cr_assert_eq(kvr_store_stat(S_, "r", &ci, NULL), 0);
    cr_assert_eq(ci.n_protected, 0);
}
