/*
 * test_int_edit.c — PIE edits end to end through a real kvroped and
 * libkvrope (and the CLI): plan then edit with KV, edits without KV
 * (pending, E_PENDING, refresh), multi-op edits, approximate flags, exact
 * vs approximate match, protected sinks, and refusals that leave the
 * context byte-identical and the connection usable.
 *
 * Reference. Every token id has a deterministic pre-RoPE key E[id] and value
 * V[id] (testd_val seeded by the id). After every step a get of the whole
 * context must equal rope(E[token_i], i) over the current sequence within
 * one f16 rounding (keys) and V bit for bit, computed here with the same
 * kvr_rope_apply the worker would use.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "tests/common/kvt_daemon.h"

/* The suite's daemon, client and tiny model (kvt_daemon.h). */
#define D kvt_suite_d
#define C kvt_suite_c
#define R kvt_suite_r
static const kvr_dtype DT = KVR_DTYPE_F16;

TestSuite(int_edit, .init = kvt_tiny_suite_init, .fini = kvt_tiny_suite_fini, .timeout = 180);

/* ---- the reference ------------------------------------------------------ */

/* E[id] (kv = 0) or V[id] (kv = 1) of one layer: [T_HEADS][T_DIM] floats. */

/* Layer-major KV (f16) of tokens at positions: K = rope(E, pos), V. */
static void *make_kv(const uint32_t *tok, const int64_t *pos, size_t n, size_t *len)
{
    return kvt_tiny_kv(R, tok, pos, n, DT, len);
}

/* The expected sequence of a context, kept alongside the daemon's. */
typedef struct seq {
    uint32_t tok[4096];
    size_t   n;
} seq;

static float h2f(const uint8_t *p)
{
    uint16_t u;
    memcpy(&u, p, 2);
    return kvr_f16_to_f32(u);
}

/* Whole-context get equals rope(E[tok_i], i) within one f16 rounding. */
static void check_ctx(const char *ctx, const seq *s)
{
    kvr_get_args g = { .ctx_id = ctx, .dtype = DT };
    kvr_kv kv;
    int r = kvr_client_get(C, &g, &kv);
    cr_assert_eq(r, 0, "get %s: %s", ctx, kvr_client_last_error(C));
    cr_assert_eq(kv.n_tokens, s->n);
    int64_t *pos = malloc((s->n ? s->n : 1) * sizeof *pos);
    for (size_t i = 0; i < s->n; i++) {
        cr_assert_eq(kv.tokens[i], s->tok[i], "token %zu: %u != %u", i, kv.tokens[i], s->tok[i]);
        cr_assert_eq(kv.positions[i], (int64_t)i, "position %zu: %lld", i,
                     (long long)kv.positions[i]);
        pos[i] = (int64_t)i;
    }
    size_t len;
    uint8_t *want = make_kv(s->tok, pos, s->n, &len);
    cr_assert_eq(kv.payload_len, len);
    const uint8_t *got = kv.payload;
    size_t half = s->n * T_HEADS * T_DIM * 2;
    for (uint32_t l = 0; l < T_LAYERS; l++) {
        const uint8_t *gk = got + (size_t)l * 2 * half, *wk = want + (size_t)l * 2 * half;
        /* One f16 rounding of a value in [-1.5, 1.5] is at most 2^-11 * 2;
         * the reference rounds once too: allow two half-ulps at 1.0. */
        for (size_t i = 0; i < half / 2; i++) {
            float a = h2f(gk + 2 * i), b = h2f(wk + 2 * i);
            cr_assert(fabsf(a - b) <= 1.0f / 1024.0f + 1e-6f,
                      "layer %u key element %zu (token %zu): %g vs %g", l, i,
                      i / (T_HEADS * T_DIM), (double)a, (double)b);
        }
        cr_assert(memcmp(gk + half, wk + half, half) == 0, "layer %u values differ", l);
    }
    free(want);
    free(pos);
    kvr_kv_release(&kv);
}

static void put_seq(const char *ctx, seq *s, uint32_t base, size_t n, uint64_t protect)
{
    s->n = n;
    int64_t pos[4096];
    for (size_t i = 0; i < n; i++) {
        s->tok[i] = base + (uint32_t)i;
        pos[i] = (int64_t)i;
    }
    size_t len;
    void *pl = make_kv(s->tok, pos, n, &len);
    kvr_put_args a = { .ctx_id = ctx, .model = "tiny", .dtype = DT, .tokens = s->tok,
                       .n_tokens = n, .has_pos_start = true, .pos_start = 0,
                       .payload = pl, .payload_len = len, .mode = KVR_PUT_UPSERT,
                       .protect_first = protect, .has_protect = protect > 0 };
    cr_assert_eq(kvr_client_put(C, &a, NULL), 0, "%s", kvr_client_last_error(C));
    free(pl);
}

/* Applies ops (any order, current coordinates) to the expected sequence. */
static void apply_ops(seq *s, const kvr_edit_range *ops, size_t n_ops)
{
    uint32_t out[4096];
    size_t k = 0;
    for (size_t i = 0; i <= s->n; i++) {
        for (size_t j = 0; j < n_ops; j++)
            if (ops[j].start == i)
                for (size_t t = 0; t < ops[j].n_tokens; t++)
                    out[k++] = ops[j].tokens[t];
        if (i == s->n)
            break;
        bool removed = false;
        for (size_t j = 0; j < n_ops; j++)
            if (i >= ops[j].start && i < ops[j].end)
                removed = true;
        if (!removed)
            out[k++] = s->tok[i];
    }
    memcpy(s->tok, out, k * sizeof *out);
    s->n = k;
}

/* Plan, build the new tokens' KV at the planned positions, edit with it. */
static kvr_edit_res plan_and_edit(const char *ctx, seq *s, const kvr_edit_range *ops,
                                  size_t n_ops)
{
    kvr_edit_args e = { .ctx_id = ctx, .ops = ops, .n_ops = n_ops };
    kvr_edit_res plan;
    cr_assert_eq(kvr_client_edit_plan(C, &e, &plan), 0, "plan: %s", kvr_client_last_error(C));
    cr_assert_eq(plan.n_spans, n_ops);
    uint32_t tok[4096];
    int64_t pos[4096];
    size_t k = 0;
    for (size_t j = 0; j < n_ops; j++)
        for (size_t t = 0; t < ops[j].n_tokens; t++) {
            tok[k] = ops[j].tokens[t];
            pos[k++] = plan.spans[j].first_pos + (int64_t)t;
        }
    size_t len;
    void *pl = make_kv(tok, pos, k, &len);
    cr_assert_eq(plan.payload_bytes, len);
    e.with_kv = true;
    e.dtype = DT;
    e.payload = pl;
    e.payload_len = len;
    kvr_edit_res res;
    cr_assert_eq(kvr_client_edit(C, &e, &res), 0, "edit: %s", kvr_client_last_error(C));
    free(pl);
    cr_assert_eq(res.n_spans, n_ops);
    for (size_t j = 0; j < n_ops; j++) {
        cr_assert_eq(res.spans[j].index, plan.spans[j].index);
        cr_assert_eq(res.spans[j].first_pos, plan.spans[j].first_pos);
        cr_assert_eq(res.spans[j].shift, plan.spans[j].shift);
    }
    cr_assert_eq(res.n_new, plan.n_new);
    cr_assert_eq(res.n_removed, plan.n_removed);
    cr_assert_eq(res.n_tokens, plan.n_tokens);
    kvr_client_free(plan.spans);
    apply_ops(s, ops, n_ops);
    cr_assert_eq(res.n_tokens, s->n);
    return res;
}

static uint32_t *flags_of(const char *ctx, size_t *n)
{
    kvr_get_args g = { .ctx_id = ctx, .dtype = DT, .meta_only = true };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    uint32_t *f = malloc((kv.n_tokens ? kv.n_tokens : 1) * sizeof *f);
    memcpy(f, kv.flags, kv.n_tokens * sizeof *f);
    *n = kv.n_tokens;
    kvr_kv_release(&kv);
    return f;
}

/* The edit of ctx by the one op *op. */
static kvr_edit_args one_op(const char *ctx, const kvr_edit_range *op)
{
    return (kvr_edit_args){ .ctx_id = ctx, .ops = op, .n_ops = 1 };
}

/* Span i of an edit's result: at index, its first position first_pos,
 * the tokens after it moved by shift. */
static void span_is(const kvr_edit_res *r, size_t i, uint64_t index, int64_t first_pos,
                    int64_t shift)
{
    cr_assert_eq(r->spans[i].index, index, "span %zu", i);
    cr_assert_eq(r->spans[i].first_pos, first_pos, "span %zu", i);
    cr_assert_eq(r->spans[i].shift, shift, "span %zu", i);
}

/* ---- tests -------------------------------------------------------------- */

Test(int_edit, plan_then_edit_with_kv)
{
    static seq s;
    put_seq("doc", &s, 100, 40, 0);
    check_ctx("doc", &s);
    uint32_t nt[] = { 900, 901, 902, 903 };
    kvr_edit_range op = { .start = 5, .end = 8, .tokens = nt, .n_tokens = 4 };
    kvr_edit_res plan;
    kvr_edit_args e = one_op("doc", &op);
    cr_assert_eq(kvr_client_edit_plan(C, &e, &plan), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(plan.n_spans, 1);
    span_is(&plan, 0, 5, 5, 1);
    cr_assert_eq(plan.n_tokens, 41);
    cr_assert_eq(plan.first_change, 5);
    kvr_client_free(plan.spans);
    check_ctx("doc", &s);   /* a plan changes nothing */

    kvr_edit_res res = plan_and_edit("doc", &s, &op, 1);
    cr_assert_eq(res.n_new, 4);
    cr_assert_eq(res.n_removed, 3);
    cr_assert_eq(res.n_pending, 0);
    cr_assert_eq(res.n_approximate, 41 - 9);
    kvr_client_free(res.spans);
    check_ctx("doc", &s);

    /* Approximate: exactly the old tokens after the first edit point. */
    size_t n;
    uint32_t *f = flags_of("doc", &n);
    cr_assert_eq(n, 41);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(f[i] & KVR_TOKEN_APPROX, i >= 9 ? KVR_TOKEN_APPROX : 0u, "flag %zu", i);
    free(f);
    kvr_context x;
    cr_assert_eq(kvr_client_stat(C, "doc", &x), 0);
    cr_assert_eq(x.n_approximate, 32);
    cr_assert_eq(x.n_pending, 0);

    /* The exact index stops at the first approximate token. */
    kvr_match_args m = { .model = "tiny", .tokens = s.tok, .n_tokens = s.n };
    kvr_match_res mr;
    cr_assert_eq(kvr_client_match(C, &m, &mr), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(mr.length, 9, "exact match %llu", (unsigned long long)mr.length);
    m.include_approximate = true;
    cr_assert_eq(kvr_client_match(C, &m, &mr), 0);
    cr_assert_eq(mr.length, s.n);
    cr_assert_str_eq(mr.ctx_id, "doc");
}

Test(int_edit, pending_then_refresh)
{
    static seq s;
    put_seq("p", &s, 200, 30, 0);
    uint32_t nt[] = { 7000, 7001, 7002 };
    kvr_edit_range op = { .start = 10, .end = 10, .tokens = nt, .n_tokens = 3 };
    kvr_edit_args e = one_op("p", &op);
    kvr_edit_res res;
    cr_assert_eq(kvr_client_edit(C, &e, &res), 0, "%s", kvr_client_last_error(C));
    cr_assert_eq(res.n_pending, 3);
    span_is(&res, 0, 10, 10, 3);
    kvr_client_free(res.spans);
    apply_ops(&s, &op, 1);

    /* KV of pending tokens does not exist: E_PENDING, connection fine. */
    kvr_get_args g = { .ctx_id = "p", .dtype = DT };
    kvr_kv kv;
    cr_assert_eq(kvr_client_get(C, &g, &kv), KVR_EPENDING, "%s", kvr_client_last_error(C));
    g.end = 10;   /* a range without them works */
    cr_assert_eq(kvr_client_get(C, &g, &kv), 0, "%s", kvr_client_last_error(C));
    kvr_kv_release(&kv);
    size_t n;
    uint32_t *f = flags_of("p", &n);
    cr_assert_eq(n, 33);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(f[i] & KVR_TOKEN_PENDING, i >= 10 && i < 13 ? KVR_TOKEN_PENDING : 0u,
                     "pending flag %zu", i);
        cr_assert_eq(f[i] & KVR_TOKEN_APPROX, i >= 13 ? KVR_TOKEN_APPROX : 0u, "approx %zu", i);
    }
    free(f);
    kvr_context xe;
    cr_assert_eq(kvr_client_stat(C, "p", &xe), 0);
    cr_assert_eq(xe.n_pending, 3);

    /* Refresh the pending tokens at their current positions. */
    int64_t pos[3] = { 10, 11, 12 };
    size_t len;
    void *pl = make_kv(nt, pos, 3, &len);
    kvr_refresh_args ra = { .ctx_id = "p", .start = 10, .end = 13, .dtype = DT,
                            .payload = pl, .payload_len = len };
    cr_assert_eq(kvr_client_refresh(C, &ra, &res), 0, "%s", kvr_client_last_error(C));
    free(pl);
    cr_assert_eq(res.n_pending, 0);
    cr_assert_eq(res.n_spans, 1);
    kvr_client_free(res.spans);
    check_ctx("p", &s);

    /* Refreshing the approximate suffix (to the end) clears its flags. */
    size_t m = s.n - 13;
    int64_t *p2 = malloc(m * sizeof *p2);
    for (size_t i = 0; i < m; i++)
        p2[i] = (int64_t)(13 + i);
    pl = make_kv(s.tok + 13, p2, m, &len);
    free(p2);
    kvr_refresh_args rb = { .ctx_id = "p", .start = 13, .dtype = DT, .payload = pl,
                            .payload_len = len };
    cr_assert_eq(kvr_client_refresh(C, &rb, &res), 0, "%s", kvr_client_last_error(C));
    free(pl);
    cr_assert_eq(res.n_approximate, 0);
    kvr_client_free(res.spans);
    check_ctx("p", &s);
    kvr_match_args ma = { .model = "tiny", .tokens = s.tok, .n_tokens = s.n };
    kvr_match_res mr;
    cr_assert_eq(kvr_client_match(C, &ma, &mr), 0);
    cr_assert_eq(mr.length, s.n);
}

Test(int_edit, multi_edit_and_replay)
{
    static seq s;
    put_seq("m", &s, 300, 50, 0);
    /* Three ops in one request, not in order: append, replace, delete at 0. */
    uint32_t a1[] = { 8000, 8001 }, a2[] = { 8100, 8101, 8102, 8103, 8104 };
    kvr_edit_range ops[3] = {
        { .start = 50, .end = 50, .tokens = a1, .n_tokens = 2 },
        { .start = 10, .end = 12, .tokens = a2, .n_tokens = 5 },
        { .start = 0, .end = 2 },
    };
    kvr_edit_res res = plan_and_edit("m", &s, ops, 3);
    cr_assert_eq(res.spans[2].index, 0);
    cr_assert_eq(res.spans[2].shift, -2);
    cr_assert_eq(res.spans[1].index, 8);
    cr_assert_eq(res.spans[1].first_pos, 8);
    cr_assert_eq(res.spans[1].shift, -2 + 3);
    cr_assert_eq(res.spans[0].index, 51 - 0);
    kvr_client_free(res.spans);
    check_ctx("m", &s);

    /* A replay of pseudo-random edits, checked after every step. */
    uint64_t rng = 12345;
    uint32_t next_id = 20000;
    for (int step = 0; step < 40; step++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t n = s.n;
        size_t a = (size_t)(rng >> 33) % (n + 1);
        size_t len = (size_t)(rng >> 20) % 4;
        if (a + len > n)
            len = n - a;
        size_t nn = (size_t)(rng >> 10) % 4;
        if (len == 0 && nn == 0)
            nn = 1;
        uint32_t t[4];
        for (size_t i = 0; i < nn; i++)
            t[i] = next_id++;
        kvr_edit_range op = { .start = a, .end = a + len, .tokens = t, .n_tokens = nn };
        kvr_edit_res r2 = plan_and_edit("m", &s, &op, 1);
        kvr_client_free(r2.spans);
        check_ctx("m", &s);
    }
}

/* Full snapshot of a context: meta + payload. */
typedef struct snap {
    kvr_kv kv;
} snap;

static void take_snap(const char *ctx, snap *sn)
{
    kvr_get_args g = { .ctx_id = ctx, .dtype = DT };
    cr_assert_eq(kvr_client_get(C, &g, &sn->kv), 0, "%s", kvr_client_last_error(C));
}

static void same_snap(const char *ctx, snap *before)
{
    snap after;
    take_snap(ctx, &after);
    kvr_kv *a = &before->kv, *b = &after.kv;
    cr_assert_eq(a->n_tokens, b->n_tokens);
    cr_assert(memcmp(a->tokens, b->tokens, a->n_tokens * 4) == 0);
    cr_assert(memcmp(a->positions, b->positions, a->n_tokens * 8) == 0);
    cr_assert(memcmp(a->flags, b->flags, a->n_tokens * 4) == 0);
    cr_assert_eq(a->payload_len, b->payload_len);
    cr_assert(memcmp(a->payload, b->payload, a->payload_len) == 0, "payload changed");
    kvr_kv_release(&after.kv);
    cr_assert_eq(kvr_client_ping(C, NULL), 0, "connection unusable after a refusal");
}

static void refused(const kvr_edit_args *e, int want, snap *sn)
{
    kvr_edit_res res;
    int r = kvr_client_edit(C, e, &res);
    cr_assert_eq(r, want, "edit: %d (%s), wanted %s", r, kvr_client_last_error(C),
                 kvr_error_name(want));
    cr_assert_str_neq(kvr_client_last_error(C), "");
    same_snap(e->ctx_id, sn);
}

Test(int_edit, refusals_leave_context_identical)
{
    static seq s;
    put_seq("r", &s, 400, 24, 4);
    kvr_context xe;
    cr_assert_eq(kvr_client_stat(C, "r", &xe), 0);
    cr_assert_eq(xe.n_protected, 4);
    /* One earlier edit so approximate flags and shifted positions exist. */
    uint32_t t1[] = { 9000 };
    kvr_edit_range o1 = { .start = 10, .end = 11, .tokens = t1, .n_tokens = 1 };
    kvr_edit_res r0 = plan_and_edit("r", &s, &o1, 1);
    kvr_client_free(r0.spans);
    snap sn;
    take_snap("r", &sn);

    uint32_t t[] = { 1, 2, 3 };
    kvr_edit_range out_of_range = { .start = 20, .end = 30, .tokens = t, .n_tokens = 1 };
    kvr_edit_args e = one_op("r", &out_of_range);
    refused(&e, KVR_ERANGE, &sn);

    kvr_edit_range overlap[2] = { { .start = 5, .end = 9 }, { .start = 8, .end = 12 } };
    e.ops = overlap;
    e.n_ops = 2;
    refused(&e, KVR_EINVAL, &sn);
    kvr_edit_range same_start[2] = { { .start = 6, .end = 6, .tokens = t, .n_tokens = 1 },
                                     { .start = 6, .end = 8 } };
    e.ops = same_start;
    refused(&e, KVR_EINVAL, &sn);
    kvr_edit_range noop = { .start = 7, .end = 7 };
    e.ops = &noop;
    e.n_ops = 1;
    refused(&e, KVR_EINVAL, &sn);

    /* Protected sinks: deleting token 2 is refused (inserting at 4, the
     * boundary, is allowed: the last step below). */
    kvr_edit_range prot = { .start = 2, .end = 3 };
    e.ops = &prot;
    refused(&e, KVR_EPROTECTED, &sn);

    /* Payload that does not match the new tokens' shape. */
    kvr_edit_range rep = { .start = 8, .end = 9, .tokens = t, .n_tokens = 2 };
    int64_t pos[3] = { 8, 9, 10 };
    size_t len;
    void *pl = make_kv(t, pos, 3, &len);
    kvr_edit_args ek = { .ctx_id = "r", .ops = &rep, .n_ops = 1, .with_kv = true, .dtype = DT,
                         .payload = pl, .payload_len = len };
    refused(&ek, KVR_EPAYLOAD, &sn);
    ek.payload_len = len / 3 * 2 - 1;
    refused(&ek, KVR_EPAYLOAD, &sn);

    /* Refresh with a wrong length, and of an out-of-range span. */
    kvr_refresh_args ra = { .ctx_id = "r", .start = 0, .end = 2, .dtype = DT, .payload = pl,
                            .payload_len = len };
    kvr_edit_res res;
    cr_assert_eq(kvr_client_refresh(C, &ra, &res), KVR_EPAYLOAD);
    same_snap("r", &sn);
    ra.end = 1000;
    cr_assert_eq(kvr_client_refresh(C, &ra, &res), KVR_ERANGE);
    same_snap("r", &sn);

    /* Unknown context. */
    e.ctx_id = "nope";
    cr_assert_eq(kvr_client_edit(C, &e, &res), KVR_ENOCTX);
    cr_assert_eq(kvr_client_edit_plan(C, &e, &res), KVR_ENOCTX);
    same_snap("r", &sn);
    kvr_kv_release(&sn.kv);

    /* After all that, a good edit (insert at the protection boundary) works. */
    free(pl);
    kvr_edit_range ins = { .start = 4, .end = 4, .tokens = t, .n_tokens = 2 };
    kvr_edit_res r1 = plan_and_edit("r", &s, &ins, 1);
    kvr_client_free(r1.spans);
    check_ctx("r", &s);
}

/* A minimal safetensors writer: k, v [layers][n][heads][dim] F16. */
static void write_st(const char *path, const void *payload, size_t n)
{
    size_t slab = n * T_HEADS * T_DIM * 2, tot = slab * T_LAYERS;
    char hdr[512];
    int hl = snprintf(hdr, sizeof hdr,
                      "{\"k\":{\"dtype\":\"F16\",\"shape\":[%d,%zu,%d,%d],\"data_offsets\":[0,%zu]},"
                      "\"v\":{\"dtype\":\"F16\",\"shape\":[%d,%zu,%d,%d],\"data_offsets\":[%zu,%zu]}}",
                      T_LAYERS, n, T_HEADS, T_DIM, tot, T_LAYERS, n, T_HEADS, T_DIM, tot, 2 * tot);
    while (hl % 8)
        hdr[hl++] = ' ';
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    uint64_t h = (uint64_t)hl;
    fwrite(&h, 8, 1, f);
    fwrite(hdr, 1, (size_t)hl, f);
    const uint8_t *p = payload;
    for (int l = 0; l < T_LAYERS; l++)
        fwrite(p + (size_t)l * 2 * slab, 1, slab, f);
    for (int l = 0; l < T_LAYERS; l++)
        fwrite(p + (size_t)l * 2 * slab + slab, 1, slab, f);
    fclose(f);
}

Test(int_edit, cli_edit_json_ops_and_safetensors)
{
    static seq s;
    put_seq("cli", &s, 500, 20, 0);
    char ops_path[400], kv_path[400], out[8192];
    snprintf(ops_path, sizeof ops_path, "%s/ops.json", D.dir);
    snprintf(kv_path, sizeof kv_path, "%s/new.safetensors", D.dir);
    FILE *f = fopen(ops_path, "w");
    cr_assert_not_null(f);
    fputs("[{\"start\": 3, \"end\": 5, \"tokens\": [1, 2, 3]},\n"
          " {\"start\": 12, \"tokens\": [4]},\n"
          " {\"start\": 15, \"end\": 17}]\n", f);
    fclose(f);

    const char *plan_args[] = { "edit", "cli", "--ops", ops_path, "--plan", "--json", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, plan_args), 0, "%s", out);
    cr_assert(strstr(out, "\"first_pos\":\t3") || strstr(out, "\"first_pos\": 3"), "%s", out);

    /* New tokens at the planned positions: 3,4,5 and 12+1 = 13. */
    uint32_t nt[] = { 1, 2, 3, 4 };
    int64_t pos[] = { 3, 4, 5, 13 };
    size_t len;
    void *pl = make_kv(nt, pos, 4, &len);
    write_st(kv_path, pl, 4);
    free(pl);
    const char *args[] = { "edit", "cli", "--ops", ops_path, "--kv", kv_path, "--json", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, args), 0, "%s", out);
    cr_assert(strstr(out, "\"n_new\"") != NULL, "%s", out);
    kvr_edit_range ops[3] = {
        { .start = 3, .end = 5, .tokens = nt, .n_tokens = 3 },
        { .start = 12, .end = 12, .tokens = nt + 3, .n_tokens = 1 },
        { .start = 15, .end = 17 },
    };
    apply_ops(&s, ops, 3);
    check_ctx("cli", &s);

    /* Refresh through the CLI, and a refused edit exits non-zero. */
    int64_t p2[] = { 3, 4, 5, 6 };
    uint32_t t2[4];
    memcpy(t2, s.tok + 3, sizeof t2);
    pl = make_kv(t2, p2, 4, &len);
    write_st(kv_path, pl, 4);
    free(pl);
    const char *ref[] = { "refresh", "cli", "3", "7", kv_path, NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, ref), 0, "%s", out);
    check_ctx("cli", &s);
    f = fopen(ops_path, "w");
    fputs("[{\"start\": 100, \"end\": 101}]", f);
    fclose(f);
    const char *bad[] = { "edit", "cli", "--ops", ops_path, NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, bad), 1);
    check_ctx("cli", &s);

    /* put --protect through the CLI. */
    char raw[400];
    snprintf(raw, sizeof raw, "%s/p.safetensors", D.dir);
    uint32_t t3[] = { 50, 51, 52, 53, 54, 55 };
    int64_t p3[] = { 0, 1, 2, 3, 4, 5 };
    pl = make_kv(t3, p3, 6, &len);
    write_st(raw, pl, 6);
    free(pl);
    const char *put[] = { "put", "sinks", raw, "--model", "tiny", "--tokens", "50,51,52,53,54,55",
                          "--protect", "2", "-q", NULL };
    cr_assert_eq(testd_cli(&D, out, sizeof out, put), 0, "%s", out);
    kvr_context xe;
    cr_assert_eq(kvr_client_stat(C, "sinks", &xe), 0);
    cr_assert_eq(xe.n_protected, 2);
}
