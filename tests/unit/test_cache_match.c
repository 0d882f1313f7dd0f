/*
 * test_cache_match.c — the prefix index through kvr_store_match: shared
 * prefixes, branching, longest wins, updates on append/delete/keep/fork,
 * and a randomized comparison against a brute-force matcher.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt_store.h"
#include "tests/common/kvt_bench.h"



static size_t match(kvr_store *s, const uint32_t *q, size_t n, char *id)
{
    kvr_match_result r;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_match(s, "m", q, n, false, &r, &e), 0);
    kvr_match_result r2;
    cr_assert_eq(kvr_store_match(s, "m", q, n, true, &r2, &e), 0);
    cr_assert_eq(r.length, r2.length);    /* no approximate tokens yet */
    if (id)
        strcpy(id, r.ctx_id);
    if (r.length == 0)
        cr_assert_str_eq(r.ctx_id, "");
    return r.length;
}

Test(cache_match, overlapping_prompts)
{
    kvr_store *s = kvt_index_store();
    uint32_t sys[] = { 1, 2, 3, 4, 5, 6 };
    uint32_t a[] = { 1, 2, 3, 4, 5, 6, 10, 11, 12 };
    uint32_t b[] = { 1, 2, 3, 4, 5, 6, 10, 20 };
    uint32_t c[] = { 1, 2, 9 };
    cr_assert_eq(kvt_index_put(s, "sys", KVR_PUT_CREATE, sys, 6), 0);
    cr_assert_eq(kvt_index_put(s, "a", KVR_PUT_CREATE, a, 9), 0);
    cr_assert_eq(kvt_index_put(s, "b", KVR_PUT_CREATE, b, 8), 0);
    cr_assert_eq(kvt_index_put(s, "c", KVR_PUT_CREATE, c, 3), 0);
    char id[300];
    uint32_t q1[] = { 1, 2, 3, 4, 5, 6, 10, 11, 12, 13 };
    cr_assert_eq(match(s, q1, 10, id), 9);
    cr_assert_str_eq(id, "a");
    uint32_t q2[] = { 1, 2, 3, 4, 5, 6, 10, 20, 30 };
    cr_assert_eq(match(s, q2, 9, id), 8);
    cr_assert_str_eq(id, "b");
    uint32_t q3[] = { 1, 2, 3, 4, 5, 6, 10, 99 };
    cr_assert_eq(match(s, q3, 8, id), 7);
    cr_assert(strcmp(id, "a") == 0 || strcmp(id, "b") == 0);
    uint32_t q4[] = { 1, 2, 3, 7 };
    cr_assert_eq(match(s, q4, 4, id), 3);
    uint32_t q5[] = { 1, 2, 9, 9 };
    cr_assert_eq(match(s, q5, 4, id), 3);
    cr_assert_str_eq(id, "c");
    uint32_t q6[] = { 7, 1, 2 };
    cr_assert_eq(match(s, q6, 3, id), 0);
    cr_assert_eq(match(s, q6, 0, id), 0);
    cr_assert_eq(match(s, a, 4, id), 4);    /* a query shorter than the contexts */
    /* Append extends the match. */
    uint32_t more[] = { 13, 14 };
    cr_assert_eq(kvt_index_put(s, "a", KVR_PUT_APPEND, more, 2), 0);
    cr_assert_eq(match(s, q1, 10, id), 10);
    cr_assert_str_eq(id, "a");
    /* Delete. */
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_delete(s, "a", &e), 0);
    cr_assert_eq(match(s, q1, 10, id), 7);
    cr_assert_str_eq(id, "b");
    cr_assert_eq(kvr_store_delete(s, "c", &e), 0);
    cr_assert_eq(match(s, q5, 4, id), 2);
    /* Keep: b truncated to 4 tokens, then to its middle. */
    cr_assert_eq(kvr_store_keep(s, "b", 0, 4, &e), 0);
    cr_assert_eq(match(s, q2, 9, id), 6);
    cr_assert_str_eq(id, "sys");
    cr_assert_eq(kvr_store_delete(s, "sys", &e), 0);
    cr_assert_eq(match(s, q2, 9, id), 4);
    cr_assert_str_eq(id, "b");
    cr_assert_eq(kvr_store_keep(s, "b", 2, 4, &e), 0);
    cr_assert_eq(match(s, q2, 9, id), 0);
    uint32_t q7[] = { 3, 4, 5 };
    cr_assert_eq(match(s, q7, 3, id), 2);
    /* Fork. */
    cr_assert_eq(kvr_store_fork(s, "b", "b2", &e), 0);
    cr_assert_eq(kvr_store_delete(s, "b", &e), 0);
    cr_assert_eq(match(s, q7, 3, id), 2);
    cr_assert_str_eq(id, "b2");
    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    cr_assert_gt(st.n_matches, 0);
    cr_assert_gt(st.n_match_hits, 0);
    kvr_store_destroy(s);
}

/* ---- randomized against brute force ------------------------------------- */

#define MAXC 24
#define MAXLEN 60

typedef struct ref_ctx {
    bool     live;
    uint32_t tok[4 * MAXLEN];
    size_t   n;
} ref_ctx;

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(uint32_t n)
{
    return (uint32_t)(kvt_xorshift(&rng) % n);
}

static size_t brute(const ref_ctx *r, const uint32_t *q, size_t n)
{
    size_t best = 0;
    for (int i = 0; i < MAXC; i++) {
        if (!r[i].live)
            continue;
        size_t k = 0;
        while (k < n && k < r[i].n && r[i].tok[k] == q[k])
            k++;
        if (k > best)
            best = k;
    }
    return best;
}

Test(cache_match, randomized_vs_brute_force)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = kvt_index_store();
    static ref_ctx r[MAXC];
    memset(r, 0, sizeof r);
    kvr_error e = { 0 };
    char name[16];
    for (int step = 0; step < 3000; step++) {
        int i = (int)rnd(MAXC);
        snprintf(name, sizeof name, "c%d", i);
        uint32_t op = rnd(10);
        if (!r[i].live) {
            /* Create, often sharing a prefix with another context. */
            size_t n = 1 + rnd(MAXLEN / 2);
            int j = (int)rnd(MAXC);
            size_t share = r[j].live ? rnd((uint32_t)r[j].n + 1) : 0;
            if (share > n)
                share = n;
            memcpy(r[i].tok, r[j].tok, share * sizeof(uint32_t));
            for (size_t k = share; k < n; k++)
                r[i].tok[k] = rnd(3);
            cr_assert_eq(kvt_index_put(s, name, KVR_PUT_CREATE, r[i].tok, n), 0);
            r[i].n = n;
            r[i].live = true;
        } else if (op < 3 && r[i].n < 3 * MAXLEN) {
            size_t n = 1 + rnd(8);
            for (size_t k = 0; k < n; k++)
                r[i].tok[r[i].n + k] = rnd(3);
            cr_assert_eq(kvt_index_put(s, name, KVR_PUT_APPEND, r[i].tok + r[i].n, n), 0);
            r[i].n += n;
        } else if (op < 5) {
            cr_assert_eq(kvr_store_delete(s, name, &e), 0);
            r[i].live = false;
        } else if (op < 7) {
            size_t a = rnd(3) ? 0 : rnd((uint32_t)r[i].n + 1);
            size_t b = a + rnd((uint32_t)(r[i].n - a) + 1);
            cr_assert_eq(kvr_store_keep(s, name, a, b, &e), 0, "%s", e.msg);
            memmove(r[i].tok, r[i].tok + a, (b - a) * sizeof(uint32_t));
            r[i].n = b - a;
        } else if (op < 8) {
            int j = (int)rnd(MAXC);
            if (!r[j].live) {
                char dst[16];
                snprintf(dst, sizeof dst, "c%d", j);
                cr_assert_eq(kvr_store_fork(s, name, dst, &e), 0);
                r[j] = r[i];
            }
        } else {
            cr_assert_eq(kvr_store_shift(s, name, 0, SIZE_MAX, 5, &e), 0);
        }
        /* Queries: prefixes of live contexts with a random tail, and noise. */
        for (int q = 0; q < 4; q++) {
            uint32_t qt[4 * MAXLEN];
            size_t qn;
            int j = (int)rnd(MAXC);
            if (r[j].live && q < 3) {
                size_t keep = rnd((uint32_t)r[j].n + 1);
                memcpy(qt, r[j].tok, keep * sizeof(uint32_t));
                qn = keep + rnd(5);
                for (size_t k = keep; k < qn; k++)
                    qt[k] = rnd(3);
            } else {
                qn = rnd(20);
                for (size_t k = 0; k < qn; k++)
                    qt[k] = rnd(3);
            }
            char id[300];
            size_t got = match(s, qt, qn, id);
            cr_assert_eq(got, brute(r, qt, qn), "step %d: match %zu", step, got);
            if (got) {
                int k = atoi(id + 1);
                cr_assert(r[k].live);
                cr_assert_geq(r[k].n, got);
                cr_assert(memcmp(r[k].tok, qt, got * sizeof(uint32_t)) == 0,
                          "step %d: %s is not a match", step, id);
            }
        }
    }
    kvr_store_destroy(s);
    cr_assert_eq(kvr_mem_allocated(), base);
}

/* The miss hooks (kvr_store_miss_hooks): a lookup by id of a context the
 * store does not hold, or a match shorter than the query, asks the tier
 * above; a taken miss is KVR_EFETCH and changes nothing (counters
 * included), a declined one the plain miss; delete and put never ask. */
typedef struct miss_log {
    bool   take;
    int    n_ctx, n_prefix;
    char   id[64];
    size_t local;
} miss_log;

static bool on_ctx(void *arg, const char *id)
{
    miss_log *l = arg;
    l->n_ctx++;
    snprintf(l->id, sizeof l->id, "%s", id);
    return l->take;
}

static bool on_prefix(void *arg, const char *model, const uint32_t *tok, size_t n, size_t local)
{
    (void)model;
    (void)tok;
    (void)n;
    miss_log *l = arg;
    l->n_prefix++;
    l->local = local;
    return l->take;
}

Test(cache_match, miss_hooks_ask_the_tier_above)
{
    kvr_store *s = kvt_index_store();
    miss_log l = { .take = true };
    kvr_store_set_miss_hooks(s, &(kvr_store_miss_hooks){ on_ctx, on_prefix, &l });
    uint32_t a[] = { 1, 2, 3, 4, 5, 6 };
    cr_assert_eq(kvt_index_put(s, "a", KVR_PUT_CREATE, a, 6), 0);
    cr_assert_eq(l.n_ctx, 0, "a put asked the tier");
    kvr_ctx_info ci;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_stat(s, "a", &ci, &e), 0);
    cr_assert_eq(kvr_store_stat(s, "far", &ci, &e), KVR_EFETCH);
    cr_assert_eq(l.n_ctx, 1);
    cr_assert_str_eq(l.id, "far");
    cr_assert_eq(kvr_store_fork(s, "far", "b", &e), KVR_EFETCH);
    cr_assert_eq(kvr_store_stat(s, "b", &ci, NULL), KVR_EFETCH, "the fork made 'b'");
    cr_assert_eq(kvr_store_delete(s, "far", &e), KVR_ENOCTX);
    cr_assert_eq(l.n_ctx, 3, "delete asked the tier");
    kvr_store_stats st0, st1;
    kvr_store_get_stats(s, &st0);
    uint32_t q[] = { 1, 2, 3, 9 };
    kvr_match_result r;
    cr_assert_eq(kvr_store_match(s, "m", q, 4, false, &r, &e), KVR_EFETCH);
    cr_assert_eq(l.n_prefix, 1);
    cr_assert_eq(l.local, 3);
    kvr_store_get_stats(s, &st1);
    cr_assert_eq(st1.n_matches, st0.n_matches, "a match handed to the tier was counted");
    cr_assert_eq(kvr_store_match(s, "m", a, 6, false, &r, &e), 0, "a whole match asked");
    cr_assert_eq(l.n_prefix, 1);
    /* A context being created (its put open) is not there for readers
     * either: the tier is asked for it too. */
    kvr_put_params pp = { .ctx_id = "open", .model = "m", .mode = KVR_PUT_CREATE,
                          .n_layers = 1, .n_kv_heads = 1, .head_dim = 2,
                          .dtype = KVR_DTYPE_F16, .n_tokens = 6, .tokens = a };
    kvr_put *t;
    cr_assert_eq(kvr_store_put_begin(s, &pp, &t, &e), 0, "%s", e.msg);
    int n_ctx = l.n_ctx;
    cr_assert_eq(kvr_store_stat(s, "open", &ci, &e), KVR_EFETCH);
    cr_assert_eq(l.n_ctx, n_ctx + 1);
    cr_assert_str_eq(l.id, "open");
    kvr_put_abort(t);
    /* Declined: the plain misses. */
    l.take = false;
    cr_assert_eq(kvr_store_stat(s, "far", &ci, &e), KVR_ENOCTX);
    cr_assert_eq(kvr_store_match(s, "m", q, 4, false, &r, &e), 0);
    cr_assert_eq(r.length, 3);
    kvr_store_set_miss_hooks(s, NULL);
    l.take = true;
    cr_assert_eq(kvr_store_stat(s, "far", &ci, &e), KVR_ENOCTX);
    kvr_store_destroy(s);
}

/* Wide nodes (prefix.c keeps each node's children's first tokens in an
 * array beside the pointers, searched alone): 600 contexts, half under
 * the root with first tokens of their own, half under one shared first
 * token with second tokens of their own, created, deleted and created
 * again in random orders (the arrays grow, shift on removal, and move
 * when a node is split or merged with its only child). After each phase
 * every context's tokens, with a tail no context holds, match exactly as
 * far as brute force over the live ones says, and the match names a
 * context that holds them. */
#define WIDE_N 600
#define WIDE_LEN 8

static uint32_t wide_tok[WIDE_N][WIDE_LEN];
static bool wide_live[WIDE_N];

static void wide_check(kvr_store *s, int phase)
{
    for (int i = 0; i < WIDE_N; i++) {
        uint32_t q[WIDE_LEN + 2];
        memcpy(q, wide_tok[i], sizeof wide_tok[i]);
        q[WIDE_LEN] = q[WIDE_LEN + 1] = 999999u;
        size_t best = 0;
        for (int j = 0; j < WIDE_N; j++) {
            size_t k = 0;
            while (wide_live[j] && k < WIDE_LEN && wide_tok[j][k] == q[k])
                k++;
            if (k > best)
                best = k;
        }
        char id[300];
        size_t got = match(s, q, WIDE_LEN + 2, id);
        cr_assert_eq(got, best, "phase %d, context %d: match %zu, brute force %zu", phase, i,
                     got, best);
        if (got) {
            int k = atoi(id + 1);
            cr_assert(wide_live[k], "phase %d: %s is not live", phase, id);
            cr_assert(memcmp(wide_tok[k], q, got * sizeof(uint32_t)) == 0,
                      "phase %d: %s does not hold the %zu tokens matched", phase, id, got);
        }
    }
}

Test(cache_match, wide_nodes_vs_brute_force)
{
    size_t base = kvr_mem_allocated();
    kvr_store *s = kvt_index_store();
    kvr_error e = { 0 };
    int order[WIDE_N];
    for (int i = 0; i < WIDE_N; i++) {
        /* Odd ones under the shared token 7; firsts/seconds distinct. */
        wide_tok[i][0] = i % 2 ? 7u : 1000u + (uint32_t)i * 7919u % 100003u;
        wide_tok[i][1] = i % 2 ? 2000u + (uint32_t)i * 104729u % 100019u : rnd(5);
        for (int k = 2; k < WIDE_LEN; k++)
            wide_tok[i][k] = rnd(5);
        order[i] = i;
    }
    char name[16];
    for (int round = 0; round < 3; round++) {
        for (int i = WIDE_N - 1; i > 0; i--) {
            int j = (int)rnd((uint32_t)i + 1), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (int i = 0; i < WIDE_N; i++) {
            int c = order[i];
            if (wide_live[c])
                continue;
            snprintf(name, sizeof name, "c%d", c);
            cr_assert_eq(kvt_index_put(s, name, KVR_PUT_CREATE, wide_tok[c], WIDE_LEN), 0);
            wide_live[c] = true;
        }
        wide_check(s, round * 2);
        /* Delete all but a few in a new order: nodes shrink to one child
         * and merge with it. */
        for (int i = 0; i < WIDE_N; i++) {
            int c = order[(i * 7 + round) % WIDE_N];
            if (rnd(50) == 0)
                continue;
            snprintf(name, sizeof name, "c%d", c);
            cr_assert_eq(kvr_store_delete(s, name, &e), 0, "%s", e.msg);
            wide_live[c] = false;
        }
        wide_check(s, round * 2 + 1);
    }
    kvr_store_destroy(s);
    memset(wide_live, 0, sizeof wide_live);
    cr_assert_eq(kvr_mem_allocated(), base);
}
