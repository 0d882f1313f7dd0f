/*
 * test_int_layout.c — position layouts end to end through kvroped and
 * libkvrope: APE assemble (parallel, sequential) with its segment table,
 * GPE group appends and offsets, sinks + window retention. Keys are checked
 * against a fresh rope(E[token], position) computed here (E seeded by the
 * token id), within one f16 rounding; values bit for bit.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "tests/common/kvt.h"
#include "tests/common/kvt_daemon.h"

/* The suite's daemon, client and tiny model (kvt_daemon.h). */
#define D kvt_suite_d
#define C kvt_suite_c
#define R kvt_suite_r
static const kvr_dtype DT = KVR_DTYPE_F16;

TestSuite(int_layout, .init = kvt_tiny_suite_init, .fini = kvt_tiny_suite_fini, .timeout = 180);

static float h2f(const uint8_t *p)
{
    uint16_t u;
    memcpy(&u, p, 2);
    return kvr_f16_to_f32(u);
}

/* kv's keys equal rope(E[tok], kv positions) and its values V[tok]. */
static void check_kv(const kvr_kv *kv, const uint32_t *tok, const int64_t *pos, size_t n)
{
    cr_assert_eq(kv->n_tokens, n);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(kv->tokens[i], tok[i], "token %zu", i);
        cr_assert_eq(kv->positions[i], pos[i], "position %zu: %lld != %lld", i,
                     (long long)kv->positions[i], (long long)pos[i]);
    }
    size_t len;
    uint8_t *want = kvt_tiny_kv(R, tok, pos, n, DT, &len);
    cr_assert_eq(kv->payload_len, len);
    const uint8_t *got = kv->payload;
    size_t half = n * T_HEADS * T_DIM * 2;
    for (uint32_t l = 0; l < T_LAYERS; l++) {
        const uint8_t *gk = got + (size_t)l * 2 * half, *wk = want + (size_t)l * 2 * half;
        for (size_t i = 0; i < half / 2; i++) {
            float a = h2f(gk + 2 * i), b = h2f(wk + 2 * i);
            cr_assert(fabsf(a - b) <= 1.0f / 1024.0f + 1e-6f, "layer %u key %zu: %g vs %g", l,
                      i, (double)a, (double)b);
        }
        cr_assert(memcmp(gk + half, wk + half, half) == 0, "layer %u values differ", l);
    }
    free(want);
}

/* pos[i] = p0 + i for i < n. */
static void seq_pos(int64_t *pos, size_t n, int64_t p0)
{
    for (size_t i = 0; i < n; i++)
        pos[i] = p0 + (int64_t)i;
}

/* An upsert of ctx (model "tiny", DT) of tokens tok[0..n) whose KV is
 * computed at pos, with o's layout fields (o may be NULL); the payload is
 * malloc'd (the caller frees a.payload). */
static kvr_put_args tiny_put(const char *ctx, const uint32_t *tok, const int64_t *pos, size_t n,
                             const kvr_put_args *o)
{
    size_t len;
    void *pl = kvt_tiny_kv(R, tok, pos, n, DT, &len);
    kvr_put_args a = o ? *o : (kvr_put_args){ 0 };
    a.ctx_id = ctx, a.model = "tiny", a.dtype = DT, a.tokens = tok, a.n_tokens = n;
    a.payload = pl, a.payload_len = len, a.mode = KVR_PUT_UPSERT;
    return a;
}

/* o: the layout fields of the put (prefix_ctx, groups, ...), or NULL. */
static void put_at(const char *ctx, const uint32_t *tok, size_t n, int64_t p0,
                   const kvr_put_args *o)
{
    int64_t pos[256];
    cr_assert_leq(n, 256);
    seq_pos(pos, n, p0);
    kvr_put_args a = tiny_put(ctx, tok, pos, n, o);
    a.has_pos_start = o == NULL || o->prefix_ctx == NULL, a.pos_start = p0;
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
    free((void *)(uintptr_t)a.payload);
}

/* Context ctx of the n tokens first.. at positions 0.., then retention of
 * 2 sinks and a window of 4 set on it (asserted): its layout. */
static kvr_layout_res put_run_retained(const char *ctx, uint32_t first, size_t n)
{
    uint32_t tok[16];
    cr_assert_leq(n, 16);
    for (uint32_t i = 0; i < n; i++)
        tok[i] = first + i;
    put_at(ctx, tok, n, 0, NULL);
    kvr_layout_res lr;
    cr_assert_eq(kvr_client_set_retention(C, ctx, 2, 4, false, &lr), 0, "%s",
                 kvr_client_last_error(C));
    return lr;
}

Test(int_layout, assemble_parallel_and_sequential)
{
    uint32_t pre[8], d1[6], d2[4];
    kvt_iota(pre, 8, 10);
    kvt_iota(d1, 6, 100);
    kvt_iota(d2, 4, 200);
    put_at("pre", pre, 8, 0, NULL);
    kvr_put_args o = { .prefix_ctx = "pre" };
    put_at("d1", d1, 6, 8, &o);
    put_at("d2", d2, 4, 8, &o);
    kvr_layout_res lr;
    cr_assert_eq(kvr_client_layout_stat(C, "d1", &lr), 0, "%s", kvr_client_last_error(C));
    cr_assert(lr.has_prefix);
    cr_assert_str_eq(lr.prefix_ctx, "pre");
    cr_assert_eq(lr.prefix_len, 8);

    const char *docs[] = { "d1", "d2" };
    uint32_t tok[18];
    memcpy(tok, pre, sizeof pre);
    memcpy(tok + 8, d1, sizeof d1);
    memcpy(tok + 14, d2, sizeof d2);
    int64_t pos[18];
    seq_pos(pos, 8, 0);        /* the prefix, then both documents after it */
    seq_pos(pos + 8, 6, 8);
    seq_pos(pos + 14, 4, 8);

    kvr_assemble_args a = { .prefix = "pre", .docs = docs, .n_docs = 2,
                            .layout = KVR_LAYOUT_PARALLEL, .dtype = DT };
    kvr_assemble_res r;
    cr_assert_eq(kvr_client_assemble(C, &a, &r), 0, "%s", kvr_client_last_error(C));
    check_kv(&r.kv, tok, pos, 18);
    cr_assert_eq(r.query_pos, 14);
    cr_assert_eq(r.prefix_len, 8);
    cr_assert_eq(r.n_segments, 4);
    cr_assert_eq(r.segments[0].kind, KVR_SEGMENT_PREFIX);
    cr_assert_eq(r.segments[0].n_tokens, 8);
    cr_assert_float_eq(r.segments[0].temperature, 1.0, 1e-12);
    cr_assert_eq(r.segments[1].kind, KVR_SEGMENT_DOCUMENT);
    cr_assert_str_eq(r.segments[1].ctx_id, "d1");
    cr_assert_eq(r.segments[1].start, 8);
    cr_assert_eq(r.segments[1].pos_first, 8);
    cr_assert_eq(r.segments[1].pos_last, 13);
    cr_assert_float_eq(r.segments[1].temperature, 0.9, 1e-12);
    cr_assert_float_eq(r.segments[1].scale, 0.9, 1e-12);
    cr_assert_eq(r.segments[2].doc_index, 1);
    cr_assert_eq(r.segments[2].start, 14);
    cr_assert_eq(r.segments[2].pos_first, 8);
    cr_assert_eq(r.segments[3].kind, KVR_SEGMENT_QUERY);
    cr_assert_eq(r.segments[3].pos_first, 14);
    kvr_assemble_release(&r);

    a.layout = KVR_LAYOUT_SEQUENTIAL;
    a.temperature = 0.5;
    cr_assert_eq(kvr_client_assemble(C, &a, &r), 0, "%s", kvr_client_last_error(C));
    for (int i = 0; i < 4; i++)
        pos[14 + i] = 14 + i;
    check_kv(&r.kv, tok, pos, 18);
    cr_assert_eq(r.query_pos, 18);
    cr_assert_float_eq(r.segments[1].temperature, 0.5, 1e-12);
    for (int i = 14; i < 18; i++)
        cr_assert(r.kv.flags[i] & KVR_TOKEN_APPROX, "moved document token %d approximate", i);
    for (int i = 0; i < 8; i++)
        cr_assert_eq(r.kv.flags[i] & KVR_TOKEN_APPROX, 0u);
    kvr_assemble_release(&r);

    /* A document of another prefix is refused; the connection is fine. */
    put_at("pre2", pre, 8, 0, NULL);
    kvr_put_args o2 = { .prefix_ctx = "pre2" };
    put_at("d3", d2, 4, 8, &o2);
    const char *bad[] = { "d1", "d3" };
    a.docs = bad;
    cr_assert_eq(kvr_client_assemble(C, &a, &r), KVR_EPREFIX, "%s", kvr_client_last_error(C));
    a.docs = docs;
    a.prefix = "nope";
    cr_assert_eq(kvr_client_assemble(C, &a, &r), KVR_ENOCTX);
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
}

static void group_put(const char *ctx, const char *group, const uint32_t *tok, size_t n,
                      int64_t expect_first, const kvr_put_args *o)
{
    /* The KV is computed at the positions the group will give. */
    int64_t pos[64];
    cr_assert_leq(n, 64);
    seq_pos(pos, n, expect_first);
    kvr_put_args a = tiny_put(ctx, tok, pos, n, o);
    kvr_put_res res;
    cr_assert_eq(kvr_client_group_append(C, &a, group, &res), 0, "%s",
                 kvr_client_last_error(C));
    cr_assert_eq(res.first_pos, expect_first);
    cr_assert_eq(res.last_pos, expect_first + (int64_t)n - 1);
    free((void *)(uintptr_t)a.payload);
}

Test(int_layout, groups)
{
    const char *names[] = { "src", "tgt" };
    kvr_put_args o = { .groups = names, .n_groups = 2 };
    uint32_t s1[] = { 1, 2, 3 }, t1[] = { 50, 51 }, s2[] = { 4, 5 };
    group_put("g", "src", s1, 3, 0, &o);
    group_put("g", "tgt", t1, 2, 0, NULL);
    group_put("g", "src", s2, 2, 3, NULL);

    kvr_get_args g = { .ctx_id = "g", .dtype = DT };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    uint32_t tok[] = { 1, 2, 3, 50, 51, 4, 5 };
    int64_t pos[] = { 0, 1, 2, 0, 1, 3, 4 };
    int32_t grp[] = { 0, 0, 0, 1, 1, 0, 0 };
    check_kv(&kv, tok, pos, 7);
    for (int i = 0; i < 7; i++)
        cr_assert_eq(kv.groups[i], grp[i], "group of token %d", i);
    kvr_kv_release(&kv);

    kvr_layout_res lr;
    cr_assert_eq(kvr_client_set_group_offset(C, "g", "tgt", 100, &lr), 0, "%s",
                 kvr_client_last_error(C));
    cr_assert_eq(lr.n_groups, 2);
    cr_assert_str_eq(lr.groups[1].name, "tgt");
    cr_assert_eq(lr.groups[1].offset, 100);
    cr_assert_eq(lr.groups[0].cursor, 5);
    cr_assert_eq(lr.groups[1].n_tokens, 2);
    uint32_t t2[] = { 52 };
    group_put("g", "tgt", t2, 1, 102, NULL);
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    uint32_t tok2[] = { 1, 2, 3, 50, 51, 4, 5, 52 };
    int64_t pos2[] = { 0, 1, 2, 100, 101, 3, 4, 102 };
    check_kv(&kv, tok2, pos2, 8);
    kvr_kv_release(&kv);

    cr_assert_eq(kvr_client_set_group_offset(C, "g", "nope", 1, NULL), KVR_EINVAL);
    cr_assert_eq(kvr_client_ping(C, NULL), 0);
}

Test(int_layout, sinks_and_window)
{
    kvr_layout_res lr = put_run_retained("w", 700, 10);
    cr_assert(lr.retention);
    cr_assert_eq(lr.sinks, 2);
    cr_assert_eq(lr.window, 4);
    cr_assert_eq(lr.n_dropped, 4);
    kvr_get_args g = { .ctx_id = "w", .dtype = DT };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    uint32_t kept[] = { 700, 701, 706, 707, 708, 709 };
    int64_t pos[] = { 0, 1, 2, 3, 4, 5 };
    check_kv(&kv, kept, pos, 6);
    kvr_kv_release(&kv);

    /* A later append slides the window again. */
    uint32_t more[] = { 800, 801 };
    size_t len;
    int64_t mp[] = { 6, 7 };
    void *pl = kvt_tiny_kv(R, more, mp, 2, DT, &len);
    kvr_put_args a = { .mode = KVR_PUT_UPSERT, .ctx_id = "w", .model = "tiny", .dtype = DT, .tokens = more,
                       .n_tokens = 2, .payload = pl, .payload_len = len };
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
    free(pl);
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    uint32_t kept2[] = { 700, 701, 708, 709, 800, 801 };
    check_kv(&kv, kept2, pos, 6);
    kvr_kv_release(&kv);
    cr_assert_eq(kvr_client_set_retention(C, "w", 0, 0, true, &lr), 0);
    cr_assert(!lr.retention);
}

/* protect_first beyond what retention leaves: the put is stored and
 * answered OK (it used to be stored, then answered E_RANGE), with every
 * remaining token protected. */
Test(int_layout, protect_first_with_retention)
{
    put_run_retained("pw", 900, 6);
    uint32_t more[] = { 950, 951 };
    int64_t mp[] = { 6, 7 };
    size_t len;
    void *pl = kvt_tiny_kv(R, more, mp, 2, DT, &len);
    kvr_put_args a = { .ctx_id = "pw", .model = "tiny", .dtype = DT, .tokens = more,
                       .n_tokens = 2, .payload = pl, .payload_len = len, .mode = KVR_PUT_UPSERT,
                       .protect_first = 8, .has_protect = true };
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
    kvr_context ci;
    cr_assert_eq(kvr_client_stat(C, "pw", &ci), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(ci.n_tokens, 6);
    cr_assert_eq(ci.n_protected, 6);
    /* Out of range at begin: refused, nothing stored. */
    a.protect_first = 9;
    cr_assert_eq(kvr_client_put(C, &a, NULL), KVR_ERANGE);
    cr_assert_eq(kvr_client_stat(C, "pw", &ci), 0);
    cr_assert_eq(ci.n_tokens, 6);
    free(pl);
}
