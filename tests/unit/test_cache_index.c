/*
 * test_cache_index.c — the prefix index after its out-of-memory paths.
 * ctx_index_rebuild (and a failed edit index step) can leave a context
 * indexed shorter than it is — dropped (length 0) or a true prefix — and
 * later writers must not append to such a tree at the wrong node. The state
 * is built directly through the internal header; every match is checked
 * against the tokens the matched context really holds.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt_store.h"
#include "cache/store.h"


static void put(kvr_store *s, const char *id, kvr_put_mode mode, const uint32_t *tok, size_t n)
{
    cr_assert_eq(kvt_index_put(s, id, mode, tok, n), 0, "put %s", id);
}

/* Matches q both ways; a match must name a context whose first `length`
 * tokens are q's. Returns the exact-mode length. */
static size_t match_checked(kvr_store *s, const uint32_t *q, size_t n)
{
    size_t len[2];
    for (int approx = 0; approx < 2; approx++) {
        kvr_match_result r;
        kvr_error e = { 0 };
        cr_assert_eq(kvr_store_match(s, "m", q, n, approx, &r, &e), 0, "%s", e.msg);
        len[approx] = r.length;
        if (r.length == 0)
            continue;
        kvr_get_params gp = { .ctx_id = r.ctx_id, .end = r.length, .meta_only = true,
                              .dtype = KVR_DTYPE_F16 };
        kvr_get *g;
        cr_assert_eq(kvr_store_get_begin(s, &gp, &g, &e), 0, "%s", e.msg);
        const kvr_get_info *gi = kvr_get_get_info(g);
        for (size_t i = 0; i < r.length; i++)
            cr_assert_eq(gi->tokens[i], q[i], "match (approx %d) of %zu tokens returned "
                         "'%s', whose token %zu is %u, not %u", approx, r.length, r.ctx_id,
                         i, gi->tokens[i], q[i]);
        kvr_get_end(g);
    }
    return len[0];
}

/* ctx_index_rebuild's allocation-failure path drops a context from both
 * trees (indexed length 0); an append must not then hang the new tokens
 * off the root, as if they were the context's first. */
Test(cache_index, append_after_dropped_from_index)
{
    kvr_store *s = kvt_index_store();
    uint32_t a[4] = { 1, 2, 3, 4 }, more[2] = { 5, 6 };
    put(s, "a", KVR_PUT_CREATE, a, 4);
    kvr_ctx *c = kvr_store_ctx_find(s, "a");
    cr_assert_not_null(c);
    kvr_ctx_index_truncate(c, 0, 0);
    kvr_ctx_index_truncate(c, 1, 0);
    cr_assert_eq(c->idx[0].len, 0);
    put(s, "a", KVR_PUT_APPEND, more, 2);
    cr_assert_eq(match_checked(s, more, 2), 0);
    uint32_t full[6] = { 1, 2, 3, 4, 5, 6 };
    size_t n = match_checked(s, full, 6);
    cr_assert(n == 0 || n == 6, "%zu", n);
    /* Never longer than the context's true indexed state. */
    cr_assert_leq(c->idx[0].len, c->n_exact);
    cr_assert_leq(c->idx[1].len, c->n_tokens);
    kvr_store_destroy(s);
}

/* A failed edit index step leaves tree 0 holding a true prefix
 * (idx_len[0] = keep0 < n_exact): a later append must not extend it from
 * there. */
Test(cache_index, append_after_truncated_exact_index)
{
    kvr_store *s = kvt_index_store();
    uint32_t a[6] = { 1, 2, 3, 4, 5, 6 }, more[1] = { 7 };
    put(s, "a", KVR_PUT_CREATE, a, 6);
    kvr_ctx *c = kvr_store_ctx_find(s, "a");
    kvr_ctx_index_truncate(c, 0, 2);
    cr_assert_eq(c->idx[0].len, 2);
    cr_assert_eq(c->n_exact, 6);
    put(s, "a", KVR_PUT_APPEND, more, 1);
    uint32_t q[3] = { 1, 2, 7 };
    cr_assert_leq(match_checked(s, q, 3), 2);
    uint32_t full[7] = { 1, 2, 3, 4, 5, 6, 7 };
    size_t n = match_checked(s, full, 7);
    cr_assert(n >= 2, "%zu", n);
    cr_assert_leq(c->idx[0].len, c->n_exact);
    /* The full-sequence tree likewise, truncated and not marked stale. */
    kvr_ctx_index_truncate(c, 1, 3);
    put(s, "a", KVR_PUT_APPEND, more, 1);
    uint32_t q2[4] = { 1, 2, 3, 7 };
    match_checked(s, q2, 4);
    uint32_t full2[8] = { 1, 2, 3, 4, 5, 6, 7, 7 };
    match_checked(s, full2, 8);
    cr_assert_leq(c->idx[1].len, c->n_tokens);
    kvr_store_destroy(s);
}
