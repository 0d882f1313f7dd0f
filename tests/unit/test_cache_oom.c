/*
 * test_cache_oom.c — allocation-failure injection in SQLite's style over
 * the store API (cache/mem.c kvr_mem_fault_set). For each verb's whole
 * request path (begin, payload, work, commit / end), and for n = 1, 2, ...:
 * a fresh store is set up with faults off, its state is fingerprinted, the
 * n-th allocation of the request is made to fail (once, and in a second
 * pass from the n-th on), and then:
 *  - the request either succeeds (it needed no allocation that failed, or
 *    recovered), or fails cleanly with a KVR_E* code and a message;
 *  - if it failed, the state is exactly the state before (every context's
 *    tokens, positions, flags, KV and layout; the model list) and the
 *    accounted memory is back where it was (nothing leaked; ASan's leak
 *    check in `make check` sees libc's side);
 *  - the loop ends at the first n that the request never reached.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_store.h"

#define L 2
#define H 2
#define D 8

static float val(uint32_t seed, size_t i)
{
    uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (i * 2654435761ull);
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return (float)((int)(x % 255) - 127) / 16.0f;
}

static void *payload(uint32_t seed, size_t n_tok, size_t *bytes)
{
    size_t cnt = (size_t)L * 2 * n_tok * H * D;
    float *f = malloc(cnt * sizeof *f + 1);
    for (size_t i = 0; i < cnt; i++)
        f[i] = val(seed, i);
    *bytes = cnt * sizeof *f;
    return f;
}

static void fill_iov(const struct iovec *iov, size_t niov, const uint8_t *src, size_t bytes)
{
    size_t off = 0;
    for (size_t i = 0; i < niov; i++) {
        memcpy(iov[i].iov_base, src + off, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    cr_assert_eq(off, bytes);
}

/* ---- requests (each the whole path, as the daemon runs it) -------------------- */

static int put(kvr_store *s, const char *id, kvr_put_mode mode, uint32_t seed, size_t n,
               const char *codec, const char *group, kvr_error *e)
{
    uint32_t tok[256];
    for (size_t i = 0; i < n; i++)
        tok[i] = seed * 1000 + (uint32_t)i;
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = mode, .n_layers = L,
                         .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32,
                         .n_tokens = n, .tokens = tok, .codec = codec, .group = group };
    kvr_put *t = NULL;
    int rc = kvr_store_put_begin(s, &p, &t, e);
    if (rc)
        return rc;
    size_t bytes;
    void *pl = payload(seed, n, &bytes);
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(t, &iov, &niov);
    fill_iov(iov, niov, pl, bytes);
    free(pl);
    if (kvr_put_needs_work(t) && (rc = kvr_put_work(t, e)) != 0) {
        kvr_put_abort(t);
        return rc;
    }
    return kvr_put_commit(t, NULL, e);
}

/* A put of p with seed's payload: every step asserted. */
static void put_ok(kvr_store *s, const kvr_put_params *p, uint32_t seed)
{
    kvr_error e = { 0 };
    kvr_put *t = NULL;
    cr_assert_eq(kvr_store_put_begin(s, p, &t, &e), 0, "%s", e.msg);
    size_t bytes;
    void *pl = payload(seed, p->n_tokens, &bytes);
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(t, &iov, &niov);
    fill_iov(iov, niov, pl, bytes);
    free(pl);
    if (kvr_put_needs_work(t))
        cr_assert_eq(kvr_put_work(t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_put_commit(t, NULL, &e), 0, "%s", e.msg);
}

static uint32_t last_tokens[512];
static size_t last_n;

static int get(kvr_store *s, const char *id, bool reposition, kvr_error *e, uint64_t *hash)
{
    int64_t pos[256];
    for (int i = 0; i < 256; i++)
        pos[i] = 5000 + 3 * i;
    kvr_ctx_info ci;
    int rc = kvr_store_stat(s, id, &ci, e);
    if (rc)
        return rc;
    kvr_get_params p = { .ctx_id = id, .end = SIZE_MAX, .dtype = KVR_DTYPE_F16,
                         .positions = reposition ? pos : NULL,
                         .n_positions = reposition ? ci.n_tokens : 0 };
    if (ci.n_tokens > 256)
        p.positions = NULL, p.n_positions = 0;
    kvr_get *g = NULL;
    if ((rc = kvr_store_get_begin(s, &p, &g, e)) != 0)
        return rc;
    if (kvr_get_needs_work(g) && (rc = kvr_get_work(g, e)) != 0) {
        kvr_get_end(g);
        return rc;
    }
    const kvr_get_info *gi = kvr_get_get_info(g);
    uint64_t h = 14695981039346656037ull;
    h = kvt_fnv(h, gi->tokens, gi->n_tokens * 4);
    h = kvt_fnv(h, gi->positions, gi->n_tokens * 8);
    h = kvt_fnv(h, gi->flags, gi->n_tokens * 4);
    last_n = gi->n_tokens < 512 ? gi->n_tokens : 512;
    memcpy(last_tokens, gi->tokens, last_n * 4);
    const struct iovec *iov;
    size_t niov;
    kvr_get_payload_iov(g, &iov, &niov);
    for (size_t i = 0; i < niov; i++)
        h = kvt_fnv(h, iov[i].iov_base, iov[i].iov_len);
    kvr_get_end(g);
    if (hash)
        *hash = h;
    return 0;
}

/* Fingerprint of everything stored (faults off). */
static uint64_t state(kvr_store *s)
{
    kvr_ctx_info *ci = NULL;
    size_t n = 0;
    kvr_error e;
    cr_assert_eq(kvr_store_list(s, NULL, &ci, &n, &e), 0, "%s", e.msg);
    uint64_t h = kvt_fnv(14695981039346656037ull, &n, sizeof n);
    for (size_t i = 0; i < n; i++) {
        h = kvt_fnv(h, ci[i].id, strlen(ci[i].id) + 1);
        h = kvt_fnv(h, &ci[i].n_tokens, sizeof ci[i].n_tokens);
        h = kvt_fnv(h, &ci[i].pinned, sizeof ci[i].pinned);
        h = kvt_fnv(h, &ci[i].n_protected, sizeof ci[i].n_protected);
        h = kvt_fnv(h, ci[i].codec, strlen(ci[i].codec));
        uint64_t g = 0;
        cr_assert_eq(get(s, ci[i].id, false, &e, &g), 0, "%s", e.msg);
        h = kvt_fnv(h, &g, sizeof g);
        /* What the prefix index answers for its sequence (and one more
         * token), exact and approximate. */
        if (last_n) {
            uint32_t q[513];
            memcpy(q, last_tokens, last_n * 4);
            q[last_n] = 999999;
            for (int ap = 0; ap < 2; ap++) {
                kvr_match_result mr;
                cr_assert_eq(kvr_store_match(s, ci[i].model, q, last_n + 1, ap, &mr, &e), 0);
                h = kvt_fnv(h, &mr.length, sizeof mr.length);
            }
        }
        kvr_layout_info li;
        memset(&li, 0, sizeof li);
        cr_assert_eq(kvr_store_layout_stat(s, ci[i].id, &li, &e), 0, "%s", e.msg);
        h = kvt_fnv(h, &li.n_groups, sizeof li.n_groups);
        for (size_t k = 0; k < li.n_groups; k++) {
            h = kvt_fnv(h, &li.groups[k].offset, sizeof li.groups[k].offset);
            h = kvt_fnv(h, &li.groups[k].n_tokens, sizeof li.groups[k].n_tokens);
        }
        h = kvt_fnv(h, &li.has_retention, sizeof li.has_retention);
        h = kvt_fnv(h, &li.sinks, sizeof li.sinks);
    }
    kvr_mem_free(ci);
    kvr_model_info mi[8];
    size_t nm = kvr_store_model_list(s, mi, 8);
    h = kvt_fnv(h, &nm, sizeof nm);
    for (size_t i = 0; i < nm && i < 8; i++)
        h = kvt_fnv(h, &mi[i].fingerprint, sizeof mi[i].fingerprint);
    return h;
}

static void model(kvr_store *s, const char *name, const char *codec)
{
    kvr_model_desc d = { .name = name, .n_layers = L, .n_kv_heads = H, .head_dim = D,
                         .dtype = KVR_DTYPE_F16, .codec = codec };
    kvr_rope_config_init(&d.rope);
    d.rope.head_dim = D;
    d.rope.rotary_dim = D;
    kvr_error e;
    cr_assert_eq(kvr_store_model_register(s, &d, NULL, &e), 0, "%s", e.msg);
}

/* The common starting state: plain, quantized, grouped, APE prefix and
 * document contexts, a fork. */
static kvr_store *setup(void)
{
    kvr_store *s = NULL;
    kvr_store_config c = { .max_memory = 64u << 20, .block_tokens = 16 };
    kvr_error e;
    cr_assert_eq(kvr_store_create(&s, &c, &e), 0, "%s", e.msg);
    model(s, "m", NULL);
    cr_assert_eq(put(s, "a", KVR_PUT_CREATE, 1, 40, NULL, NULL, &e), 0, "%s", e.msg);
    cr_assert_eq(put(s, "q", KVR_PUT_CREATE, 2, 40, "int8", NULL, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_fork(s, "a", "f", &e), 0, "%s", e.msg);
    static const char *const groups[] = { "src", "tgt" };
    kvr_put_params gp = { .ctx_id = "g", .model = "m", .mode = KVR_PUT_CREATE,
                          .n_layers = L, .n_kv_heads = H, .head_dim = D,
                          .dtype = KVR_DTYPE_F32, .n_tokens = 0, .groups = groups,
                          .n_groups = 2, .group = "src" };
    uint32_t tk[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
    gp.n_tokens = 8;
    gp.tokens = tk;
    put_ok(s, &gp, 9);
    cr_assert_eq(put(s, "pre", KVR_PUT_CREATE, 3, 10, NULL, NULL, &e), 0, "%s", e.msg);
    kvr_put_params dp = { .ctx_id = "doc", .model = "m", .mode = KVR_PUT_CREATE,
                          .n_layers = L, .n_kv_heads = H, .head_dim = D,
                          .dtype = KVR_DTYPE_F32, .n_tokens = 8, .tokens = tk,
                          .prefix_ctx = "pre" };
    put_ok(s, &dp, 10);
    return s;
}

typedef int (*req_fn)(kvr_store *s, kvr_error *e);

static int r_put_create(kvr_store *s, kvr_error *e)
{
    return put(s, "new", KVR_PUT_CREATE, 7, 50, NULL, NULL, e);
}
static int r_put_append(kvr_store *s, kvr_error *e)
{
    return put(s, "a", KVR_PUT_APPEND, 8, 30, NULL, NULL, e);
}
static int r_put_quant(kvr_store *s, kvr_error *e)
{
    return put(s, "q", KVR_PUT_APPEND, 9, 150, NULL, NULL, e);
}
static int r_put_fork_cow(kvr_store *s, kvr_error *e)
{
    return put(s, "f", KVR_PUT_APPEND, 11, 5, NULL, NULL, e);   /* shared last block */
}
static int r_group_append(kvr_store *s, kvr_error *e)
{
    return put(s, "g", KVR_PUT_APPEND, 12, 6, NULL, "tgt", e);
}
static int r_get(kvr_store *s, kvr_error *e) { return get(s, "a", true, e, NULL); }
static int r_get_quant(kvr_store *s, kvr_error *e) { return get(s, "q", true, e, NULL); }
static int r_match(kvr_store *s, kvr_error *e)
{
    uint32_t tok[45];
    for (int i = 0; i < 45; i++)
        tok[i] = 1000 + (uint32_t)i;
    kvr_match_result mr;
    return kvr_store_match(s, "m", tok, 45, false, &mr, e);
}
static int r_fork(kvr_store *s, kvr_error *e) { return kvr_store_fork(s, "a", "a2", e); }
static int r_delete(kvr_store *s, kvr_error *e) { return kvr_store_delete(s, "a", e); }
static int r_shift(kvr_store *s, kvr_error *e) { return kvr_store_shift(s, "a", 7, 23, 100, e); }
static int r_keep(kvr_store *s, kvr_error *e) { return kvr_store_keep(s, "a", 5, 29, e); }
static int r_pin(kvr_store *s, kvr_error *e) { return kvr_store_pin(s, "a", true, e); }
static int r_protect(kvr_store *s, kvr_error *e) { return kvr_store_protect(s, "a", 4, e); }
static int r_list(kvr_store *s, kvr_error *e)
{
    kvr_ctx_info *ci = NULL;
    size_t n;
    int rc = kvr_store_list(s, NULL, &ci, &n, e);
    kvr_mem_free(ci);
    return rc;
}

/* The rest of an edit or refresh that began with rc (t open if 0): its
 * payload pl (bytes; NULL: none) in and freed, the work done, committed
 * (spans into sp, which may be NULL). Aborted on a failed work. */
static int edit_finish(kvr_edit *t, int rc, void *pl, size_t bytes, kvr_edit_span *sp,
                       kvr_error *e)
{
    if (rc == 0 && pl) {
        const struct iovec *iov;
        size_t niov;
        kvr_edit_payload_iov(t, &iov, &niov);
        fill_iov(iov, niov, pl, bytes);
    }
    free(pl);
    if (rc)
        return rc;
    if (kvr_edit_needs_work(t) && (rc = kvr_edit_work(t, e)) != 0) {
        kvr_edit_abort(t);
        return rc;
    }
    return kvr_edit_commit(t, sp, NULL, e);
}

static int edit(kvr_store *s, bool with_kv, kvr_error *e)
{
    uint32_t nt[3] = { 77, 78, 79 };
    kvr_edit_op ops[2] = { { .start = 3, .end = 6, .n_tokens = 3, .tokens = nt },
                           { .start = 20, .end = 20, .n_tokens = 2, .tokens = nt } };
    kvr_edit_params p = { .ctx_id = "a", .ops = ops, .n_ops = 2, .with_kv = with_kv,
                          .n_layers = L, .n_kv_heads = H, .head_dim = D,
                          .dtype = KVR_DTYPE_F32 };
    size_t bytes = 0;
    void *pl = with_kv ? payload(13, 5, &bytes) : NULL;
    p.payload_bytes = bytes;
    kvr_edit *t = NULL;
    int rc = kvr_store_edit_begin(s, &p, &t, e);
    kvr_edit_span sp[2];
    return edit_finish(t, rc, pl, bytes, sp, e);
}
static int r_edit_kv(kvr_store *s, kvr_error *e) { return edit(s, true, e); }
static int r_edit_pending(kvr_store *s, kvr_error *e) { return edit(s, false, e); }
static int r_edit_plan(kvr_store *s, kvr_error *e)
{
    uint32_t nt[1] = { 5 };
    kvr_edit_op op = { .start = 2, .end = 4, .n_tokens = 1, .tokens = nt };
    kvr_edit_params p = { .ctx_id = "a", .ops = &op, .n_ops = 1 };
    kvr_edit_span sp;
    return kvr_store_edit_plan(s, &p, &sp, NULL, e);
}
static int r_refresh(kvr_store *s, kvr_error *e)
{
    size_t bytes;
    void *pl = payload(14, 10, &bytes);
    kvr_refresh_params p = { .ctx_id = "f", .start = 10, .end = 20, .n_layers = L,
                             .n_kv_heads = H, .head_dim = D, .dtype = KVR_DTYPE_F32,
                             .payload_bytes = bytes };
    kvr_edit *t = NULL;
    int rc = kvr_store_refresh_begin(s, &p, &t, e);
    return edit_finish(t, rc, pl, bytes, NULL, e);
}
static int r_assemble(kvr_store *s, kvr_error *e)
{
    static const char *const docs[] = { "doc" };
    kvr_assemble_params p = { .prefix = "pre", .docs = docs, .n_docs = 1,
                              .layout = KVR_LAYOUT_SEQUENTIAL, .dtype = KVR_DTYPE_F16 };
    kvr_assemble *t = NULL;
    int rc = kvr_store_assemble_begin(s, &p, &t, e);
    if (rc)
        return rc;
    if (kvr_assemble_needs_work(t))
        rc = kvr_assemble_work(t, e);
    kvr_assemble_end(t);
    return rc;
}
static int r_group_offset(kvr_store *s, kvr_error *e)
{
    return kvr_store_set_group_offset(s, "g", "src", 40, e);
}
static int r_retention(kvr_store *s, kvr_error *e)
{
    kvr_retention r = { .sinks = 4, .window = 16 };
    return kvr_store_set_retention(s, "a", &r, e);
}
static int r_model(kvr_store *s, kvr_error *e)
{
    kvr_model_desc d = { .name = "m2", .n_layers = L, .n_kv_heads = H, .head_dim = D,
                         .dtype = KVR_DTYPE_BF16, .codec = "k4v2" };
    kvr_rope_config_init(&d.rope);
    d.rope.head_dim = D;
    d.rope.rotary_dim = D;
    return kvr_store_model_register(s, &d, NULL, e);
}

static void run(const char *name, req_fn fn, bool mutates)
{
    int steps = 0, failed_clean = 0;
    for (int pass = 0; pass < 2; pass++) {
        bool sticky = pass == 1;
        for (uint64_t n = 1;; n++) {
            cr_assert_lt(n, 5000, "%s: the request never finished", name);
            size_t mem_base = kvr_mem_allocated();
            kvr_store *s = setup();
            uint64_t before = state(s);
            size_t mem0 = kvr_mem_allocated();
            kvr_error e;
            memset(&e, 0, sizeof e);
            kvr_mem_fault_set(n, sticky);
            int rc = fn(s, &e);
            uint64_t failed = kvr_mem_fault_failed();
            kvr_mem_fault_set(0, false);
            steps++;
            if (rc != 0) {
                cr_assert_lt(rc, 0, "%s: n=%llu: rc %d", name, (unsigned long long)n, rc);
                cr_assert_gt(failed, 0, "%s: n=%llu failed (%d: %s) without an injected "
                             "failure", name, (unsigned long long)n, rc, e.msg);
                cr_assert(e.msg[0], "%s: n=%llu: an error without a message", name,
                          (unsigned long long)n);
                /* A failed request may leave index structure it grew (a split
                 * radix node, a larger array), owned by the store and freed
                 * with it: bounded, and never a leak (checked below). */
                cr_assert_lt((ssize_t)(kvr_mem_allocated() - mem0), 4096,
                             "%s: n=%llu%s: %zd bytes left by the failed request (%s)", name,
                             (unsigned long long)n, sticky ? " sticky" : "",
                             (ssize_t)(kvr_mem_allocated() - mem0), e.msg);
                cr_assert_eq(state(s), before, "%s: n=%llu%s: the failed request (%d: %s) "
                             "changed what is stored", name, (unsigned long long)n,
                             sticky ? " sticky" : "", rc, e.msg);
                failed_clean++;
            } else if (!mutates) {
                cr_assert_eq(state(s), before, "%s: a read changed the store", name);
            }
            kvr_store_destroy(s);
            cr_assert_eq(kvr_mem_allocated(), mem_base, "%s: n=%llu%s: %zd bytes leaked", name,
                         (unsigned long long)n, sticky ? " sticky" : "",
                         (ssize_t)(kvr_mem_allocated() - mem_base));
            if (failed == 0) {
                cr_assert_eq(rc, 0, "%s: failed without an injected failure: %s", name,
                             e.msg);
                break;
            }
        }
    }
    cr_log_info("%s: %d runs, %d clean failures", name, steps, failed_clean);
    (void)failed_clean;
}

Test(cache_oom, put_create) { run("put create", r_put_create, true); }
Test(cache_oom, put_append) { run("put append", r_put_append, true); }
Test(cache_oom, put_quantized) { run("put quantized", r_put_quant, true); }
Test(cache_oom, put_cow_fork) { run("put into a fork", r_put_fork_cow, true); }
Test(cache_oom, group_append) { run("group append", r_group_append, true); }
Test(cache_oom, get_reposition) { run("get", r_get, false); }
Test(cache_oom, get_quantized) { run("get quantized", r_get_quant, false); }
Test(cache_oom, match) { run("match", r_match, false); }
Test(cache_oom, fork) { run("fork", r_fork, true); }
Test(cache_oom, delete) { run("delete", r_delete, true); }
Test(cache_oom, shift) { run("shift", r_shift, true); }
Test(cache_oom, keep) { run("keep", r_keep, true); }
Test(cache_oom, pin) { run("pin", r_pin, true); }
Test(cache_oom, protect) { run("protect", r_protect, true); }
Test(cache_oom, list) { run("list", r_list, false); }
Test(cache_oom, edit_with_kv) { run("edit with kv", r_edit_kv, true); }
Test(cache_oom, edit_pending) { run("edit pending", r_edit_pending, true); }
Test(cache_oom, edit_plan) { run("edit plan", r_edit_plan, false); }
Test(cache_oom, refresh) { run("refresh", r_refresh, true); }
Test(cache_oom, assemble) { run("assemble", r_assemble, false); }
Test(cache_oom, set_group_offset) { run("set group offset", r_group_offset, true); }
Test(cache_oom, set_retention) { run("set retention", r_retention, true); }
Test(cache_oom, model_register) { run("model register", r_model, true); }
