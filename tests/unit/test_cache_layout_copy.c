/*
 * test_cache_layout_copy.c — every kind of position layout (APE record,
 * groups, retention, retention switched off, and their combinations) copied
 * through fork and through persistence and a store restart, and changed on
 * the copy afterwards (which must not touch the original). Run under the
 * ASan build (make MODE=check): issue 29's heap overflow was a fork copying
 * a 1-byte layout after set_retention created it. Then the restore checks
 * (kvr_layout_info_check): every field of a layout from outside passes the
 * same validation as the verb that sets it, and a refused restore leaves
 * the context as it was.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_store.h"
#include "tests/common/kvt.h"

#define L 2
#define H 2
#define D 16
#define ROW (H * D)

static char DIR_[256];

/* A store (with a disk tier in DIR_ if disk) and model "m". */
static kvr_store *open_store(bool disk)
{
    kvr_store_config cfg = { .block_tokens = 8 };
    kvr_tier_config tc = { .dir = DIR_, .engine = 2 };
    return kvt_store_open(&cfg, disk ? &tc : NULL, false, NULL, L, H, D, KVR_DTYPE_F32);
}

/* Puts n tokens (ids base..) with p's layout fields; persisted if asked. */
static int put(kvr_store *s, const char *id, kvr_put_params p, uint32_t base, size_t n,
               kvr_error *e)
{
    float *pl = calloc((size_t)L * 2 * n * ROW, sizeof *pl);
    uint32_t *tok = malloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = base + (uint32_t)i;
    for (size_t i = 0; i < (size_t)L * 2 * n * ROW; i++)
        pl[i] = (float)(i % 97) / 8.0f;
    kvt_put_shape(&p, id, L, H, D, KVR_DTYPE_F32, tok, n);
    if (!p.mode)
        p.mode = KVR_PUT_UPSERT;
    kvt_src src = { pl, (size_t)L * 2 * n * ROW * sizeof *pl, 0 };
    int rc = kvt_put_try(s, &p, kvt_fill_src, &src, NULL, e);
    free(pl);
    free(tok);
    if (rc == 0 && kvr_store_persist(s, id, NULL, NULL, e) < 0)
        return KVR_EIO;
    return rc;
}

static void same_layout(const kvr_layout_info *a, const kvr_layout_info *b, const char *what)
{
    cr_assert_eq(a->has_prefix, b->has_prefix, "%s: has_prefix", what);
    cr_assert_str_eq(a->prefix_ctx, b->prefix_ctx, "%s: prefix", what);
    cr_assert_eq(a->prefix_fingerprint, b->prefix_fingerprint, "%s", what);
    cr_assert_eq(a->prefix_len, b->prefix_len, "%s: prefix_len", what);
    cr_assert_eq(a->prefix_hash, b->prefix_hash, "%s: prefix_hash", what);
    cr_assert_eq(a->n_groups, b->n_groups, "%s: n_groups", what);
    for (size_t g = 0; g < a->n_groups; g++) {
        cr_assert_str_eq(a->groups[g].name, b->groups[g].name, "%s", what);
        cr_assert_eq(a->groups[g].offset, b->groups[g].offset, "%s", what);
        cr_assert_eq(a->groups[g].cursor, b->groups[g].cursor, "%s", what);
        cr_assert_eq(a->groups[g].n_tokens, b->groups[g].n_tokens, "%s", what);
    }
    cr_assert_eq(a->has_retention, b->has_retention, "%s: has_retention", what);
    cr_assert_eq(a->sinks, b->sinks, "%s: sinks", what);
    cr_assert_eq(a->window, b->window, "%s: window", what);
    cr_assert_eq(a->n_dropped, b->n_dropped, "%s: n_dropped", what);
}

static kvr_layout_info stat_of(kvr_store *s, const char *id)
{
    kvr_layout_info li;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_layout_stat(s, id, &li, &e), 0, "%s: %s", id, e.msg);
    return li;
}

static void retain(kvr_store *s, const char *id, size_t sinks, size_t window, bool off)
{
    kvr_error e = { 0 };
    kvr_retention r = { .sinks = sinks, .window = window, .off = off };
    cr_assert_eq(kvr_store_set_retention(s, id, &r, &e), 0, "%s: %s", id, e.msg);
    cr_assert_geq(kvr_store_persist(s, id, NULL, NULL, &e), 0, "%s", e.msg);
}

static const char *GN[] = { "sys", "user" };
static const int64_t GOFF[] = { 0, 1000 };

/* Kinds of layout: the context ids made by make_kinds. */
static const char *KINDS[] = { "ret", "ret_off", "ape", "ape_ret", "grp", "ape_grp" };
#define N_KINDS (sizeof KINDS / sizeof KINDS[0])

static void make_kinds(kvr_store *s, bool persist)
{
    kvr_error e = { 0 };
    kvr_put_params pp = { .persist = persist };
    cr_assert_eq(put(s, "pre", pp, 1, 10, &e), 0, "%s", e.msg);
    /* Retention on a context that had no layout (the overflow's setup). */
    cr_assert_eq(put(s, "ret", pp, 100, 20, &e), 0, "%s", e.msg);
    retain(s, "ret", 2, 8, false);
    cr_assert_eq(put(s, "ret_off", pp, 200, 12, &e), 0, "%s", e.msg);
    retain(s, "ret_off", 1, 4, false);
    retain(s, "ret_off", 0, 0, true);
    kvr_put_params ap = pp;
    ap.prefix_ctx = "pre";
    ap.mode = KVR_PUT_CREATE;
    cr_assert_eq(put(s, "ape", ap, 300, 9, &e), 0, "%s", e.msg);
    cr_assert_eq(put(s, "ape_ret", ap, 400, 30, &e), 0, "%s", e.msg);
    retain(s, "ape_ret", 3, 5, false);
    kvr_put_params gp = pp;
    gp.mode = KVR_PUT_CREATE;
    gp.groups = GN;
    gp.n_groups = 2;
    gp.group_offsets = GOFF;
    gp.group = "user";
    cr_assert_eq(put(s, "grp", gp, 500, 7, &e), 0, "%s", e.msg);
    gp.prefix_ctx = "pre";
    gp.group = "sys";
    cr_assert_eq(put(s, "ape_grp", gp, 600, 5, &e), 0, "%s", e.msg);
    kvr_put_params more = { .group = "user" };
    cr_assert_eq(put(s, "ape_grp", more, 700, 3, &e), 0, "%s", e.msg);
}

/* Forks every kind to "<kind>.f" and checks the copy; then changes each
 * copy (retention, appends) and checks the original did not move. */
static void fork_kinds(kvr_store *s)
{
    kvr_error e = { 0 };
    for (size_t k = 0; k < N_KINDS; k++) {
        char f[64];
        snprintf(f, sizeof f, "%s.f", KINDS[k]);
        kvr_layout_info a = stat_of(s, KINDS[k]);
        cr_assert_eq(kvr_store_fork(s, KINDS[k], f, &e), 0, "%s", e.msg);
        cr_assert_geq(kvr_store_persist(s, f, NULL, NULL, &e), 0, "%s", e.msg);
        kvr_layout_info b = stat_of(s, f);
        same_layout(&a, &b, f);
        /* Write to the copy's layout: a new policy and appends (grouped
         * contexts take their appends through a group, and no policy). */
        kvr_put_params more = { 0 };
        if (b.n_groups) {
            more.group = "sys";
        } else {
            retain(s, f, 1, 3, false);
            kvr_layout_info c = stat_of(s, f);
            cr_assert(c.has_retention && c.sinks == 1 && c.window == 3);
        }
        cr_assert_eq(put(s, f, more, 900, 4, &e), 0, "%s: %s", f, e.msg);
        kvr_layout_info a2 = stat_of(s, KINDS[k]);
        same_layout(&a, &a2, KINDS[k]);
    }
}

Test(layout_copy, fork_after_retention_on_a_plain_context)
{
    /* The four requests of issue 29: put, set_retention 2/8, fork,
     * layout_stat (and a set_retention on the fork, which wrote past it). */
    kvr_store *s = open_store(false);
    kvr_error e = { 0 };
    cr_assert_eq(put(s, "c", (kvr_put_params){ 0 }, 1, 20, &e), 0, "%s", e.msg);
    retain(s, "c", 2, 8, false);
    cr_assert_eq(kvr_store_fork(s, "c", "f", &e), 0, "%s", e.msg);
    kvr_layout_info a = stat_of(s, "c"), b = stat_of(s, "f");
    same_layout(&a, &b, "fork");
    cr_assert(b.has_retention && b.sinks == 2 && b.window == 8);
    retain(s, "f", 4, 16, false);
    kvr_layout_info a2 = stat_of(s, "c");
    same_layout(&a, &a2, "original");
    kvr_store_destroy(s);
}

Test(layout_copy, every_kind_through_fork)
{
    kvr_store *s = open_store(false);
    make_kinds(s, false);
    fork_kinds(s);
    kvr_store_destroy(s);
}

Test(layout_copy, every_kind_through_persistence_and_restart)
{
    kvt_tmpdir(DIR_, sizeof DIR_, "kvr-lcopy");
    kvr_store *s = open_store(true);
    make_kinds(s, true);
    fork_kinds(s);
    kvr_store_persist_flush(s);
    const char *ids[2 * N_KINDS];
    kvr_layout_info before[2 * N_KINDS];
    char fk[N_KINDS][64];
    for (size_t k = 0; k < N_KINDS; k++) {
        snprintf(fk[k], sizeof fk[k], "%s.f", KINDS[k]);
        ids[2 * k] = KINDS[k];
        ids[2 * k + 1] = fk[k];
    }
    for (size_t i = 0; i < 2 * N_KINDS; i++)
        before[i] = stat_of(s, ids[i]);
    kvr_store_destroy(s);
    /* Twice: from the log, then from what the first recovery wrote. */
    for (int round = 0; round < 2; round++) {
        s = open_store(true);
        for (size_t i = 0; i < 2 * N_KINDS; i++) {
            kvr_layout_info after = stat_of(s, ids[i]);
            same_layout(&before[i], &after, ids[i]);
        }
        /* And the restored layouts take writes (a fork of each, changed). */
        kvr_error e = { 0 };
        cr_assert_eq(kvr_store_fork(s, "ret", "ret.g", &e), 0, "%s", e.msg);
        retain(s, "ret.g", 1, 2, false);
        cr_assert_eq(kvr_store_delete(s, "ret.g", &e), 0, "%s", e.msg);
        kvr_store_persist(s, "ret.g", NULL, NULL, NULL);
        kvr_store_persist_flush(s);
        kvr_store_destroy(s);
    }
    kvt_rmrf(DIR_);
}

/* ---- restore checks ------------------------------------------------------- */

static kvr_store *S;

/* A fresh plain context "p" of 4 tokens, and a valid empty layout. */
static kvr_layout_info restore_setup(void)
{
    S = open_store(false);
    kvr_error e = { 0 };
    cr_assert_eq(put(S, "p", (kvr_put_params){ 0 }, 1, 4, &e), 0, "%s", e.msg);
    kvr_layout_info li;
    memset(&li, 0, sizeof li);
    return li;
}

/* Restoring li (with groups/flags) is refused with rc, and "p" is still a
 * plain context. */
static void refused(const kvr_layout_info *li, const int32_t *groups, const uint32_t *flags,
                    int rc, const char *what)
{
    kvr_error e = { 0 };
    int got = kvr_store_layout_restore(S, "p", li, groups, flags, 4, &e);
    cr_assert_eq(got, rc, "%s: got %d (%s)", what, got, e.msg);
    cr_assert(e.msg[0], "%s: no message", what);
    kvr_layout_info now = stat_of(S, "p");
    cr_assert(!now.has_prefix && !now.n_groups && !now.has_retention, "%s: changed", what);
    uint64_t fp;
    kvr_model_info mi;
    cr_assert_eq(kvr_store_model_find(S, "m", &mi), 0);
    fp = mi.fingerprint;
    /* The same verdict from the check alone (what the shared tier calls). */
    cr_assert_eq(kvr_layout_info_check(li, "p", fp, groups, flags, 4, NULL), rc, "%s", what);
}

Test(layout_restore, retention_fields_checked_as_set_retention_does)
{
    kvr_layout_info li = restore_setup();
    li.has_retention = true;
    const size_t bad[][2] = { { (size_t)1 << 63, (size_t)1 << 63 }, { 0, 0 },
                              { SIZE_MAX, 1 }, { 1, SIZE_MAX }, { 3, 0 },
                              { KVR_RETENTION_MAX, 1 }, { 1, 2 } /* < 4 tokens */ };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        li.sinks = bad[i][0];
        li.window = bad[i][1];
        char what[64];
        snprintf(what, sizeof what, "sinks %zu window %zu", li.sinks, li.window);
        refused(&li, NULL, NULL, KVR_EINVAL, what);
    }
    li.sinks = 1;
    li.window = 3;
    li.n_dropped = SIZE_MAX;
    refused(&li, NULL, NULL, KVR_EINVAL, "n_dropped 2^64-1");
    li.n_dropped = 7;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_layout_restore(S, "p", &li, NULL, NULL, 4, &e), 0, "%s", e.msg);
    kvr_layout_info now = stat_of(S, "p");
    same_layout(&li, &now, "restored");
    kvr_store_destroy(S);
}

Test(layout_restore, group_fields_checked_as_a_create_does)
{
    kvr_layout_info li = restore_setup();
    int32_t ids[4] = { 0, 1, 0, 0 };
    refused(&li, ids, NULL, KVR_EINVAL, "group ids without groups");
    int32_t neg[4] = { 0, -1, 0, 0 };
    li.n_groups = 2;
    snprintf(li.groups[0].name, sizeof li.groups[0].name, "a");
    snprintf(li.groups[1].name, sizeof li.groups[1].name, "b");
    refused(&li, neg, NULL, KVR_EINVAL, "negative group id");
    int32_t big[4] = { 0, 2, 0, 0 };
    refused(&li, big, NULL, KVR_EINVAL, "group id out of range");
    snprintf(li.groups[1].name, sizeof li.groups[1].name, "a");
    refused(&li, ids, NULL, KVR_EINVAL, "duplicate names");
    li.groups[1].name[0] = '\0';
    refused(&li, ids, NULL, KVR_EINVAL, "empty name");
    memset(li.groups[1].name, 'x', sizeof li.groups[1].name);
    refused(&li, ids, NULL, KVR_EINVAL, "unterminated name");
    snprintf(li.groups[1].name, sizeof li.groups[1].name, "b");
    li.groups[1].cursor = (uint64_t)1 << 63;
    refused(&li, ids, NULL, KVR_EINVAL, "cursor 2^63");
    li.groups[1].cursor = 10;
    li.groups[1].offset = INT64_MAX - 5;
    refused(&li, ids, NULL, KVR_EINVAL, "offset + cursor overflows");
    li.groups[1].offset = 100;
    li.has_retention = true;
    li.sinks = 1;
    li.window = 8;
    refused(&li, ids, NULL, KVR_EUNSUPPORTED, "retention with groups");
    li.has_retention = false;
    li.n_groups = KVR_MAX_GROUPS + 1;
    refused(&li, ids, NULL, KVR_ELIMIT, "too many groups");
    li.n_groups = 2;
    uint32_t fl[4] = { 0, 1u << 20, 0, 0 };
    refused(&li, ids, fl, KVR_EINVAL, "unknown flag");
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_layout_restore(S, "p", &li, ids, NULL, 4, &e), 0, "%s", e.msg);
    kvr_layout_info now = stat_of(S, "p");
    cr_assert_eq(now.n_groups, 2);
    cr_assert_eq(now.groups[1].n_tokens, 1);
    kvr_store_destroy(S);
}

Test(layout_restore, ape_record_checked_as_a_prefixed_create_does)
{
    kvr_layout_info li = restore_setup();
    kvr_model_info mi;
    cr_assert_eq(kvr_store_model_find(S, "m", &mi), 0);
    li.has_prefix = true;
    snprintf(li.prefix_ctx, sizeof li.prefix_ctx, "pre");
    li.prefix_fingerprint = mi.fingerprint;
    li.prefix_len = (size_t)1 << 63;
    refused(&li, NULL, NULL, KVR_EINVAL, "prefix length 2^63");
    li.prefix_len = 10;
    li.prefix_fingerprint = mi.fingerprint ^ 1;
    refused(&li, NULL, NULL, KVR_EFINGERPRINT, "another model's prefix");
    li.prefix_fingerprint = mi.fingerprint;
    li.prefix_ctx[0] = '\0';
    refused(&li, NULL, NULL, KVR_EBADREQUEST, "empty prefix id");
    memset(li.prefix_ctx, 'x', sizeof li.prefix_ctx);
    refused(&li, NULL, NULL, KVR_EINVAL, "unterminated prefix id");
    snprintf(li.prefix_ctx, sizeof li.prefix_ctx, "pre");
    li.has_prefix = false;
    refused(&li, NULL, NULL, KVR_EINVAL, "a prefix record without a prefix");
    li.has_prefix = true;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_layout_restore(S, "p", &li, NULL, NULL, 4, &e), 0, "%s", e.msg);
    kvr_layout_info now = stat_of(S, "p");
    same_layout(&li, &now, "restored");
    kvr_store_destroy(S);
}
