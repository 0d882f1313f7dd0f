/*
 * test_cache_edit.c — PIE edits in the store: exact edit-trace replay for
 * every RoPE family of shared/vectors/rope and f32/f16/bf16 storage, no
 * error accumulation, approximate/pending flags against a model, refresh,
 * copy-on-write, the prefix index after edits, protected sinks, and every
 * refusal leaving the context byte-identical.
 *
 * Every token id t has a deterministic pre-RoPE key E[l][t] and value
 * V[l][t]; the cache must always hold K = rope(E[t], i) for the token at
 * index i, within one rounding of the storage dtype.
 */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "tests/common/kvt.h"
#include "tests/common/kvt_vectors.h"

#define L 2
#define H 2

/* ---- vectors: the RoPE configurations of the manifest ------------------- */

typedef struct fam {
    char name[64];
    kvr_rope_config cfg;
} fam;

static int load_families(fam *out, int cap)
{
    cJSON *m = kvt_rope_manifest();
    const cJSON *c;
    int n = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(m, "cases")) {
        if (n == cap)
            break;
        fam *f = &out[n++];
        snprintf(f->name, sizeof f->name, "%s", cJSON_GetObjectItem(c, "name")->valuestring);
        kvt_rope_case_config(c, H, &f->cfg);
    }
    cJSON_Delete(m);
    cr_assert(n >= 6, "manifest has %d cases", n);
    return n;
}

/* ---- the world: a store, one model, the expected sequence --------------- */

typedef struct world {
    kvr_store *s;
    kvr_rope  *rope;          /* reference engine, same config */
    uint32_t   D;
    kvr_dtype  dt;            /* storage dtype */
    uint64_t   fp;
    uint32_t  *seq;           /* expected token ids */
    uint8_t   *approx;        /* expected APPROX flag per token */
    size_t     n, cap;
} world;

static uint64_t mix(uint64_t x)
{
    x ^= x >> 31; x *= 0x9E3779B97F4A7C15ull; x ^= x >> 29; x *= 0xBF58476D1CE4E5B9ull;
    return x ^ (x >> 32);
}

static float e_val(uint32_t l, uint32_t tok, uint32_t h, uint32_t d)
{
    uint64_t x = mix(((uint64_t)tok << 24) ^ ((uint64_t)l << 16) ^ (h << 12) ^ d ^ 0x5EED);
    return (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Exactly representable in f32, f16 and bf16. */
static float v_val(uint32_t l, uint32_t tok, uint32_t h, uint32_t d)
{
    uint64_t x = mix(((uint64_t)tok << 24) ^ ((uint64_t)l << 16) ^ (h << 12) ^ d ^ 0xA11);
    return (float)((int)(x % 255) - 127) / 16.0f;
}

static void world_init(world *w, const kvr_rope_config *cfg, kvr_dtype dt, uint32_t B,
                       size_t cap_mem)
{
    memset(w, 0, sizeof *w);
    kvr_store_config sc = { .max_memory = cap_mem, .block_tokens = B };
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_create(&w->s, &sc, &e), 0, "%s", e.msg);
    w->D = (uint32_t)cfg->head_dim;
    w->dt = dt;
    kvr_model_desc d = { .name = "m", .n_layers = L, .n_kv_heads = H, .head_dim = w->D,
                         .dtype = dt, .rope = *cfg };
    kvr_model_info mi;
    cr_assert_eq(kvr_store_model_register(w->s, &d, &mi, &e), 0, "%s", e.msg);
    w->fp = mi.fingerprint;
    cr_assert_eq(kvr_rope_create(&w->rope, cfg, NULL), 0);
    w->cap = 1024;
    w->seq = malloc(w->cap * sizeof *w->seq);
    w->approx = malloc(w->cap);
}

static void world_free(world *w)
{
    kvr_store_destroy(w->s);
    kvr_rope_destroy(w->rope);
    free(w->seq);
    free(w->approx);
}

/* Payload (f32, wire order) of tokens tok[0..n) at positions pos[0..n). */
static float *kv_payload(const world *w, const uint32_t *tok, const int64_t *pos, size_t n)
{
    size_t row = (size_t)H * w->D, part = n * row;
    float *out = malloc((2 * L * part + 1) * sizeof *out);
    float *x = malloc((part + 1) * sizeof *x);
    for (uint32_t l = 0; l < L; l++) {
        for (size_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < w->D; d++) {
                    x[t * row + h * w->D + d] = e_val(l, tok[t], h, d);
                    out[(2 * l + 1) * part + t * row + h * w->D + d] = v_val(l, tok[t], h, d);
                }
        if (n)
            cr_assert_eq(kvr_rope_apply(w->rope, out + 2 * l * part, KVR_DTYPE_F32, x,
                                        KVR_DTYPE_F32, n, H, pos, NULL), 0);
    }
    free(x);
    return out;
}

static void fill_iov(const struct iovec *iov, size_t niov, const void *src, size_t bytes)
{
    size_t off = 0;
    for (size_t i = 0; i < niov; i++) {
        memcpy(iov[i].iov_base, (const uint8_t *)src + off, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    cr_assert_eq(off, bytes);
}

/* Payload bytes of n tokens in dtype dt; the f32 payload converted. */
static void *as_dtype(const float *f, size_t cnt, kvr_dtype dt)
{
    void *b = malloc(cnt * kvr_dtype_size(dt) + 1);
    kvr_convert(b, dt, f, KVR_DTYPE_F32, cnt);
    return b;
}

static void world_put(world *w, const char *id, const uint32_t *tok, size_t n)
{
    int64_t *pos = malloc(n * sizeof *pos);
    for (size_t i = 0; i < n; i++)
        pos[i] = (int64_t)i;
    float *pl = kv_payload(w, tok, pos, n);
    kvr_put_params p = { .ctx_id = id, .model = "m", .mode = KVR_PUT_CREATE, .n_layers = L,
                         .n_kv_heads = H, .head_dim = w->D, .dtype = KVR_DTYPE_F32,
                         .n_tokens = n, .tokens = tok };
    kvr_put *t;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_put_begin(w->s, &p, &t, &e), 0, "%s", e.msg);
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(t, &iov, &niov);
    fill_iov(iov, niov, pl, kvr_put_payload_size(t));
    cr_assert_eq(kvr_put_commit(t, NULL, &e), 0, "%s", e.msg);
    free(pl);
    free(pos);
    memcpy(w->seq, tok, n * sizeof *tok);
    memset(w->approx, 0, n);
    w->n = n;
}

/* A world of the manifest's case fam_i (storage dt, blocks of 16 tokens,
 * memory cap cap_mem) holding context id: tokens mul * i + add for i < n,
 * left in init[0..n) unless init is NULL. */
static void world_start(world *w, int fam_i, kvr_dtype dt, size_t cap_mem, const char *id,
                        uint32_t *init, size_t n, uint32_t mul, uint32_t add)
{
    fam fams[32];
    load_families(fams, 32);
    world_init(w, &fams[fam_i].cfg, dt, 16, cap_mem);
    uint32_t *tok = init ? init : malloc(n * sizeof *tok);
    for (uint32_t i = 0; i < n; i++)
        tok[i] = mul * i + add;
    world_put(w, id, tok, n);
    if (!init)
        free(tok);
}

static double dt_eps(kvr_dtype dt)
{
    return dt == KVR_DTYPE_F32 ? 0x1p-22 : dt == KVR_DTYPE_F16 ? 0x1p-10 : 0x1p-7;
}

/* Full get against rope(E[seq[i]], i), V exact, flags against the model. */
static void world_check(const world *w, const char *id, const char *what)
{
    kvr_get_params p = { .ctx_id = id, .start = 0, .end = SIZE_MAX, .dtype = KVR_DTYPE_F32 };
    kvr_get *g;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_get_begin(w->s, &p, &g, &e), 0, "%s: %s", what, e.msg);
    if (kvr_get_needs_work(g))
        cr_assert_eq(kvr_get_work(g, &e), 0, "%s", e.msg);
    const kvr_get_info *in = kvr_get_get_info(g);
    cr_assert_eq(in->n_tokens, w->n, "%s: %zu tokens, expected %zu", what, in->n_tokens, w->n);
    size_t n = w->n, row = (size_t)H * w->D, part = n * row;
    int64_t *pos = malloc((n + 1) * sizeof *pos);
    for (size_t i = 0; i < n; i++) {
        pos[i] = (int64_t)i;
        cr_assert_eq(in->tokens[i], w->seq[i], "%s: token %zu", what, i);
        cr_assert_eq(in->positions[i], (int64_t)i, "%s: position of %zu is %lld", what, i,
                     (long long)in->positions[i]);
        cr_assert_eq(in->flags[i] & ~KVR_TOKEN_AGE_MASK, w->approx[i] ? KVR_TOKEN_APPROX : 0u,
                     "%s: flags of token %zu: %u, expected %u", what, i, in->flags[i],
                     (unsigned)w->approx[i]);
    }
    float *got = malloc((2 * L * part + 1) * sizeof *got);
    const struct iovec *iov;
    size_t niov;
    kvr_get_payload_iov(g, &iov, &niov);
    cr_assert_eq(kvt_gather(got, iov, niov), 2 * L * part * sizeof(float));
    float *ref = kv_payload(w, w->seq, pos, n);
    double eps = dt_eps(w->dt) + 4e-6;
    for (uint32_t l = 0; l < L; l++)
        for (size_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < H; h++) {
                size_t o = 2 * l * part + t * row + h * w->D;
                double mx = 0;
                for (uint32_t d = 0; d < w->D; d++)
                    mx = fmax(mx, fabs((double)ref[o + d]));
                for (uint32_t d = 0; d < w->D; d++) {
                    double err = fabs((double)got[o + d] - (double)ref[o + d]);
                    cr_assert(err <= eps * mx, "%s: K l%u t%zu h%u d%u: %g vs %g (err %g, "
                              "tol %g)", what, l, t, h, d, (double)got[o + d],
                              (double)ref[o + d], err, eps * mx);
                }
                size_t ov = o + part;
                cr_assert(memcmp(got + ov, ref + ov, w->D * sizeof(float)) == 0,
                          "%s: V l%u t%zu h%u differs", what, l, t, h);
            }
    kvr_get_end(g);
    free(got);
    free(ref);
    free(pos);
    /* Stats and index follow the model. */
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(w->s, id, &ci, &e), 0);
    size_t na = 0, first_approx = n;
    for (size_t i = 0; i < n; i++) {
        na += w->approx[i];
        if (w->approx[i] && first_approx == n)
            first_approx = i;
    }
    cr_assert_eq(ci.n_approx, na, "%s: n_approx %zu vs %zu", what, ci.n_approx, na);
    kvr_match_result mr;
    cr_assert_eq(kvr_store_match(w->s, "m", w->seq, n, false, &mr, &e), 0);
    cr_assert_eq(mr.length, first_approx, "%s: exact match %zu, expected %zu", what,
                 mr.length, first_approx);
    cr_assert_eq(kvr_store_match(w->s, "m", w->seq, n, true, &mr, &e), 0);
    cr_assert_eq(mr.length, n, "%s: include_approx match %zu, expected %zu", what,
                 mr.length, n);
}

/* One edit with KV: plan, build the payload at the planned positions,
 * begin/fill/work/commit; applies it to the model. */
static int world_edit(world *w, const char *id, const kvr_edit_op *ops, size_t n_ops,
                      kvr_dtype pdt, kvr_error *e)
{
    kvr_edit_params p = { .ctx_id = id, .model = "m", .fingerprint = w->fp, .ops = ops,
                          .n_ops = n_ops, .with_kv = true, .n_layers = L, .n_kv_heads = H,
                          .head_dim = w->D, .dtype = pdt };
    kvr_edit_span spans[8], spans2[8];
    kvr_edit_result pr, cr;
    size_t n_new = 0;
    for (size_t j = 0; j < n_ops; j++)
        n_new += ops[j].n_tokens;
    p.payload_bytes = 2 * L * n_new * H * w->D * kvr_dtype_size(pdt);
    int rc = kvr_store_edit_plan(w->s, &p, spans, &pr, e);
    if (rc)
        return rc;
    uint32_t *tok = malloc((n_new + 1) * sizeof *tok);
    int64_t *pos = malloc((n_new + 1) * sizeof *pos);
    size_t k = 0;
    for (size_t j = 0; j < n_ops; j++)
        for (size_t q = 0; q < ops[j].n_tokens; q++, k++) {
            tok[k] = ops[j].tokens[q];
            pos[k] = spans[j].first_pos + (int64_t)q;
        }
    float *pl = kv_payload(w, tok, pos, n_new);
    void *bytes = as_dtype(pl, 2 * L * n_new * H * w->D, pdt);
    kvr_edit *t;
    rc = kvr_store_edit_begin(w->s, &p, &t, e);
    cr_assert_eq(rc, 0, "plan accepted, begin refused: %s", e->msg);
    cr_assert_eq(kvr_edit_payload_size(t), p.payload_bytes);
    const struct iovec *iov;
    size_t niov;
    kvr_edit_payload_iov(t, &iov, &niov);
    fill_iov(iov, niov, bytes, p.payload_bytes);
    if (kvr_edit_needs_work(t))
        cr_assert_eq(kvr_edit_work(t, e), 0);
    cr_assert_eq(kvr_edit_commit(t, spans2, &cr, e), 0, "%s", e->msg);
    for (size_t j = 0; j < n_ops; j++) {
        cr_assert_eq(spans2[j].first_pos, spans[j].first_pos, "plan vs commit positions");
        cr_assert_eq(spans2[j].index, spans[j].index);
        cr_assert_eq(spans2[j].first_pos, (int64_t)spans[j].index, "contiguous positions");
    }
    cr_assert_eq(cr.n_tokens, pr.n_tokens);
    cr_assert_eq(cr.n_approx, pr.n_approx);
    cr_assert_eq(cr.n_pending, pr.n_pending);
    free(pl);
    free(bytes);
    free(tok);
    free(pos);

    /* The model: apply in descending order of start. */
    size_t ord[8];
    for (size_t j = 0; j < n_ops; j++)
        ord[j] = j;
    for (size_t a = 0; a < n_ops; a++)
        for (size_t b = a + 1; b < n_ops; b++)
            if (ops[ord[b]].start > ops[ord[a]].start) {
                size_t x = ord[a]; ord[a] = ord[b]; ord[b] = x;
            }
    size_t first = ops[ord[n_ops - 1]].start;
    for (size_t i = first; i < w->n; i++)
        w->approx[i] = 1;     /* old tokens at/after the first edit point */
    for (size_t a = 0; a < n_ops; a++) {
        const kvr_edit_op *o = &ops[ord[a]];
        size_t rem = o->end - o->start, tail = w->n - o->end;
        if (w->n - rem + o->n_tokens > w->cap) {
            w->cap = 2 * (w->n + o->n_tokens);
            w->seq = realloc(w->seq, w->cap * sizeof *w->seq);
            w->approx = realloc(w->approx, w->cap);
        }
        memmove(w->seq + o->start + o->n_tokens, w->seq + o->end, tail * sizeof *w->seq);
        memmove(w->approx + o->start + o->n_tokens, w->approx + o->end, tail);
        if (o->n_tokens)
            memcpy(w->seq + o->start, o->tokens, o->n_tokens * sizeof *w->seq);
        memset(w->approx + o->start, 0, o->n_tokens);
        w->n = w->n - rem + o->n_tokens;
    }
    return 0;
}

static int world_refresh(world *w, const char *id, size_t start, size_t end, kvr_error *e)
{
    size_t n = end - start;
    int64_t *pos = malloc(n * sizeof *pos);
    for (size_t i = 0; i < n; i++)
        pos[i] = (int64_t)(start + i);
    float *pl = kv_payload(w, w->seq + start, pos, n);
    kvr_refresh_params p = { .ctx_id = id, .start = start, .end = end, .n_layers = L,
                             .n_kv_heads = H, .head_dim = w->D, .dtype = KVR_DTYPE_F32,
                             .payload_bytes = 2 * L * n * H * w->D * 4 };
    kvr_edit *t;
    int rc = kvr_store_refresh_begin(w->s, &p, &t, e);
    if (rc == 0) {
        const struct iovec *iov;
        size_t niov;
        kvr_edit_payload_iov(t, &iov, &niov);
        fill_iov(iov, niov, pl, p.payload_bytes);
        rc = kvr_edit_commit(t, NULL, NULL, e);
        if (rc == 0)
            memset(w->approx + start, 0, n);
    }
    free(pl);
    free(pos);
    return rc;
}

static uint32_t rng_next(uint64_t *st)
{
    *st = *st * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(*st >> 33);
}

/* A random set of 1..3 non-overlapping ops on a sequence of length n. */
static size_t random_ops(uint64_t *st, size_t n, kvr_edit_op *ops, uint32_t (*buf)[8])
{
    size_t want = 1 + rng_next(st) % 3, k = 0;
    size_t lo = 0;
    for (size_t j = 0; j < want && lo <= n; j++) {
        size_t room = n - lo;
        size_t start = lo + (room ? rng_next(st) % (room + 1) : 0);
        uint32_t r = rng_next(st) % 10;
        if (j == 0 && r == 0)
            start = 0;                 /* at position 0 */
        if (r == 1)
            start = n;                 /* at the end */
        if (start < lo)
            start = lo;
        size_t maxrem = n - start < 6 ? n - start : 6;
        size_t rem = maxrem ? rng_next(st) % (maxrem + 1) : 0;
        size_t add = rng_next(st) % 6;
        if (rem == 0 && add == 0)
            add = 1;
        if (n < 24 && add == 0)
            add = 3;                   /* keep the context from vanishing */
        for (size_t q = 0; q < add; q++)
            buf[k][q] = rng_next(st) % 5000;
        ops[k] = (kvr_edit_op){ start, start + rem, add, buf[k], false };
        k++;
        lo = start + rem + 1;          /* strictly after: no shared start */
        if (start == n)
            break;
    }
    /* shuffle: ops may come in any order */
    if (k > 1 && rng_next(st) % 2) {
        kvr_edit_op x = ops[0]; ops[0] = ops[k - 1]; ops[k - 1] = x;
    }
    return k;
}

static void replay(kvr_dtype dt, int steps)
{
    fam fams[32];
    int nf = load_families(fams, 32);
    for (int f = 0; f < nf; f++) {
        world w;
        world_init(&w, &fams[f].cfg, dt, 16, 0);
        uint64_t st = 0x1234 + (uint64_t)f * 77 + dt;
        uint32_t init[96];
        for (size_t i = 0; i < 96; i++)
            init[i] = rng_next(&st) % 5000;
        world_put(&w, "c", init, 96);
        world_check(&w, "c", "initial");
        for (int s = 0; s < steps; s++) {
            char what[160];
            kvr_error e = { 0 };
            if (rng_next(&st) % 8 == 0 && w.n > 0) {
                size_t a = rng_next(&st) % w.n, b = a + 1 + rng_next(&st) % (w.n - a);
                cr_assert_eq(world_refresh(&w, "c", a, b, &e), 0, "%s", e.msg);
                snprintf(what, sizeof what, "%s %s step %d refresh [%zu,%zu)", fams[f].name,
                         kvr_dtype_name(dt), s, a, b);
            } else {
                kvr_edit_op ops[4];
                uint32_t buf[4][8];
                size_t k = random_ops(&st, w.n, ops, buf);
                kvr_dtype pdt = (s % 3 == 0) ? dt : KVR_DTYPE_F32;
                int rc = world_edit(&w, "c", ops, k, pdt, &e);
                cr_assert_eq(rc, 0, "%s step %d: %s", fams[f].name, s, e.msg);
                snprintf(what, sizeof what, "%s %s step %d (%zu ops, first [%zu,%zu)+%zu)",
                         fams[f].name, kvr_dtype_name(dt), s, k, ops[0].start, ops[0].end,
                         ops[0].n_tokens);
            }
            world_check(&w, "c", what);
        }
        world_free(&w);
    }
}

/* f32 replays the long trace (every op kind, many times over, on every
 * family); the 16-bit dtypes add only their rounding of stored keys and of
 * f16 / bf16 payloads, met from the first steps on, so a shorter trace of
 * the same generator (every third step a payload of the dtype) covers it. */
Test(cache_edit, replay_f32, .timeout = 600) { replay(KVR_DTYPE_F32, 200); }
Test(cache_edit, replay_f16, .timeout = 600) { replay(KVR_DTYPE_F16, 60); }
Test(cache_edit, replay_bf16, .timeout = 600) { replay(KVR_DTYPE_BF16, 60); }

/* ---- no accumulation -------------------------------------------------------- */

static uint8_t *raw_get(kvr_store *s, const char *id, size_t *bytes, kvr_dtype dt)
{
    kvr_get_params p = { .ctx_id = id, .start = 0, .end = SIZE_MAX, .dtype = dt };
    kvr_get *g;
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_get_begin(s, &p, &g, &e), 0, "%s", e.msg);
    if (kvr_get_needs_work(g))
        cr_assert_eq(kvr_get_work(g, &e), 0);
    size_t n = kvr_get_payload_size(g), niov;
    const struct iovec *iov;
    kvr_get_payload_iov(g, &iov, &niov);
    uint8_t *out = malloc(n + 1);
    kvt_gather(out, iov, niov);
    kvr_get_end(g);
    *bytes = n;
    return out;
}

Test(cache_edit, no_accumulation)
{
    world w;
    world_start(&w, 0, KVR_DTYPE_F16, 0, "c", NULL, 64, 1, 100);
    size_t b0, b1;
    uint8_t *before = raw_get(w.s, "c", &b0, KVR_DTYPE_F32);
    uint32_t ins[3] = { 7, 8, 9 };
    kvr_error e = { 0 };
    for (int i = 0; i < 500; i++) {
        kvr_edit_op a = { 5, 5, 3, ins, false };
        cr_assert_eq(world_edit(&w, "c", &a, 1, KVR_DTYPE_F16, &e), 0, "%s", e.msg);
        kvr_edit_op d = { 5, 8, 0, NULL, false };
        cr_assert_eq(world_edit(&w, "c", &d, 1, KVR_DTYPE_F16, &e), 0, "%s", e.msg);
    }
    world_check(&w, "c", "after 1000 edits");
    /* Same tokens at the same positions: bit for bit what a fresh get gave. */
    uint8_t *after = raw_get(w.s, "c", &b1, KVR_DTYPE_F32);
    cr_assert_eq(b0, b1);
    cr_assert(memcmp(before, after, b0) == 0, "1000 edits changed the keys' bits");
    free(before);
    free(after);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(w.s, "c", &ci, &e), 0);
    cr_assert(ci.n_blocks <= 8, "blocks leak across edits: %zu", ci.n_blocks);
    world_free(&w);
}

/* ---- refusals leave the context byte-identical -------------------------------- */

typedef struct snap {
    uint8_t *kv;
    size_t   bytes, n;
    uint32_t *tok, *flags;
    int64_t *pos;
    kvr_ctx_info ci;
    size_t   m_exact, m_all;
    kvr_store_stats st;
} snap;

static void snap_free(snap *s)
{
    free(s->kv);
    free(s->tok);
    free(s->flags);
    free(s->pos);
}

static void take(world *w, const char *id, snap *s)
{
    kvr_error e = { 0 };
    memset(s, 0, sizeof *s);
    kvr_get_params p = { .ctx_id = id, .start = 0, .end = SIZE_MAX, .meta_only = true };
    kvr_get *g;
    cr_assert_eq(kvr_store_get_begin(w->s, &p, &g, &e), 0, "%s", e.msg);
    const kvr_get_info *in = kvr_get_get_info(g);
    s->n = in->n_tokens;
    s->tok = malloc((s->n + 1) * 4);
    s->flags = malloc((s->n + 1) * 4);
    s->pos = malloc((s->n + 1) * 8);
    memcpy(s->tok, in->tokens, s->n * 4);
    memcpy(s->flags, in->flags, s->n * 4);
    memcpy(s->pos, in->positions, s->n * 8);
    kvr_get_end(g);
    bool pending = false;
    for (size_t i = 0; i < s->n; i++)
        pending = pending || (s->flags[i] & KVR_TOKEN_PENDING);
    if (!pending)
        s->kv = raw_get(w->s, id, &s->bytes, w->dt);
    cr_assert_eq(kvr_store_stat(w->s, id, &s->ci, &e), 0);
    kvr_match_result mr;
    kvr_store_match(w->s, "m", s->tok, s->n, false, &mr, &e);
    s->m_exact = mr.length;
    kvr_store_match(w->s, "m", s->tok, s->n, true, &mr, &e);
    s->m_all = mr.length;
    kvr_store_get_stats(w->s, &s->st);
}

/* store_wide: also the match answers and block counts of the whole store
 * (false when another context legitimately changed meanwhile). */
static void same_ex(world *w, const char *id, const snap *a, const char *what,
                    bool store_wide)
{
    snap b;
    take(w, id, &b);
    cr_assert_eq(a->n, b.n, "%s: length changed", what);
    cr_assert(memcmp(a->tok, b.tok, a->n * 4) == 0, "%s: tokens changed", what);
    cr_assert(memcmp(a->flags, b.flags, a->n * 4) == 0, "%s: flags changed", what);
    cr_assert(memcmp(a->pos, b.pos, a->n * 8) == 0, "%s: positions changed", what);
    cr_assert_eq(a->bytes, b.bytes, "%s", what);
    if (a->kv)
        cr_assert(memcmp(a->kv, b.kv, a->bytes) == 0, "%s: KV bytes changed", what);
    cr_assert_eq(a->ci.n_tokens, b.ci.n_tokens);
    cr_assert_eq(a->ci.n_approx, b.ci.n_approx, "%s", what);
    cr_assert_eq(a->ci.n_pending, b.ci.n_pending, "%s", what);
    cr_assert_eq(a->ci.n_blocks, b.ci.n_blocks, "%s", what);
    cr_assert_eq(a->ci.pos_min, b.ci.pos_min);
    cr_assert_eq(a->ci.pos_max, b.ci.pos_max);
    cr_assert_eq(a->ci.busy, b.ci.busy, "%s: busy changed", what);
    if (store_wide) {
        cr_assert_eq(a->m_exact, b.m_exact, "%s: exact match changed", what);
        cr_assert_eq(a->m_all, b.m_all, "%s: match changed", what);
        cr_assert_eq(a->st.n_blocks, b.st.n_blocks, "%s: blocks leaked", what);
        cr_assert_eq(a->st.block_bytes, b.st.block_bytes, "%s", what);
    }
    snap_free(&b);
}

static void same(world *w, const char *id, const snap *a, const char *what)
{
    same_ex(w, id, a, what, true);
}

static int try_edit(world *w, kvr_edit_params p, const char *what, int want)
{
    kvr_error e = { 0 };
    kvr_edit_span sp[8];
    int rc1 = kvr_store_edit_plan(w->s, &p, sp, NULL, &e);
    kvr_edit *t = NULL;
    int rc2 = kvr_store_edit_begin(w->s, &p, &t, &e);
    cr_assert_eq(rc2, want, "%s: got %s (%s), want %s", what, kvr_error_name(rc2), e.msg,
                 kvr_error_name(want));
    if (want != KVR_ENOMEM)
        cr_assert_eq(rc1, want, "%s: plan got %s", what, kvr_error_name(rc1));
    cr_assert(e.msg[0] != '\0', "%s: no message", what);
    return rc2;
}

Test(cache_edit, refusals_leave_context_identical)
{
    world w;
    world_start(&w, 0, KVR_DTYPE_F16, 0, "c", NULL, 100, 1, 1000);
    kvr_error e = { 0 };
    uint32_t nt[4] = { 1, 2, 3, 4 };
    kvr_edit_op first = { 40, 42, 3, nt, false };
    cr_assert_eq(world_edit(&w, "c", &first, 1, KVR_DTYPE_F32, &e), 0);   /* some approx */
    cr_assert_eq(kvr_store_protect(w.s, "c", 4, &e), 0);
    snap a;
    take(&w, "c", &a);
    size_t rowb = (size_t)H * w.D * 2;
    kvr_edit_op ok = { 10, 12, 2, nt, false };
    kvr_edit_params base = { .ctx_id = "c", .model = "m", .ops = &ok, .n_ops = 1,
                             .with_kv = true, .n_layers = L, .n_kv_heads = H, .head_dim = w.D,
                             .dtype = KVR_DTYPE_F16, .payload_bytes = 2 * L * 2 * rowb };
    kvr_edit_params p;
    kvr_edit_op ops[3];

    p = base; ops[0] = (kvr_edit_op){ 10, 500, 0, NULL, false }; p.ops = ops;
    try_edit(&w, p, "end out of bounds", KVR_ERANGE); same(&w, "c", &a, "erange");
    p = base; ops[0] = (kvr_edit_op){ 12, 10, 0, NULL, false }; p.ops = ops;
    try_edit(&w, p, "start > end", KVR_ERANGE); same(&w, "c", &a, "erange2");
    p = base; ops[0] = (kvr_edit_op){ 102, 102, 1, nt, false }; p.ops = ops; p.payload_bytes = 2 * L * rowb;
    try_edit(&w, p, "insert past the end", KVR_ERANGE); same(&w, "c", &a, "erange3");
    p = base; ops[0] = (kvr_edit_op){ 10, 20, 0, NULL, false }; ops[1] = (kvr_edit_op){ 15, 25, 0, NULL, false };
    p.ops = ops; p.n_ops = 2; p.payload_bytes = 0;
    try_edit(&w, p, "overlap", KVR_EINVAL); same(&w, "c", &a, "overlap");
    p = base; ops[0] = (kvr_edit_op){ 30, 30, 1, nt, false }; ops[1] = (kvr_edit_op){ 30, 30, 1, nt, false };
    p.ops = ops; p.n_ops = 2; p.payload_bytes = 2 * L * 2 * rowb;
    try_edit(&w, p, "two inserts at one point", KVR_EINVAL); same(&w, "c", &a, "2 inserts");
    p = base; ops[0] = (kvr_edit_op){ 30, 30, 1, nt, false }; ops[1] = (kvr_edit_op){ 30, 32, 1, nt, false };
    p.ops = ops; p.n_ops = 2;
    try_edit(&w, p, "insert + replace at one start", KVR_EINVAL); same(&w, "c", &a, "ins+rep");
    p = base; ops[0] = (kvr_edit_op){ 30, 30, 0, NULL, false }; p.ops = ops; p.payload_bytes = 0;
    try_edit(&w, p, "empty op", KVR_EINVAL); same(&w, "c", &a, "empty");
    p = base; p.payload_bytes += 2;
    try_edit(&w, p, "payload length", KVR_EPAYLOAD); same(&w, "c", &a, "payload");
    p = base; p.n_kv_heads = H + 1;
    try_edit(&w, p, "shape", KVR_ESHAPE); same(&w, "c", &a, "shape");
    p = base; p.dtype = (kvr_dtype)9;
    try_edit(&w, p, "dtype", KVR_ESHAPE); same(&w, "c", &a, "dtype");
    p = base; ops[0] = (kvr_edit_op){ 2, 3, 0, NULL, false }; p.ops = ops; p.payload_bytes = 0;
    try_edit(&w, p, "protected", KVR_EPROTECTED); same(&w, "c", &a, "protected");
    p = base; ops[0] = (kvr_edit_op){ 0, 0, 1, nt, false }; p.ops = ops; p.payload_bytes = 2 * L * rowb;
    try_edit(&w, p, "insert at 0 with sinks", KVR_EPROTECTED); same(&w, "c", &a, "protected0");
    p = base; p.ctx_id = "nope";
    try_edit(&w, p, "unknown context", KVR_ENOCTX); same(&w, "c", &a, "noctx");
    p = base; p.model = "other";
    try_edit(&w, p, "model", KVR_EFINGERPRINT); same(&w, "c", &a, "model");
    p = base; p.fingerprint = w.fp ^ 1;
    try_edit(&w, p, "fingerprint", KVR_EFINGERPRINT); same(&w, "c", &a, "fp");
    p = base; p.n_ops = 0;
    try_edit(&w, p, "no ops", KVR_EBADREQUEST); same(&w, "c", &a, "noops");

    /* Busy: an open put, then an open edit, on the same context. */
    {
        kvr_put_params pp = { .ctx_id = "c", .model = "m", .mode = KVR_PUT_APPEND,
                              .n_layers = L, .n_kv_heads = H, .head_dim = w.D,
                              .dtype = KVR_DTYPE_F16, .n_tokens = 1, .tokens = nt };
        kvr_put *pt;
        cr_assert_eq(kvr_store_put_begin(w.s, &pp, &pt, &e), 0, "%s", e.msg);
        try_edit(&w, base, "busy (put)", KVR_EBUSY);
        kvr_put_abort(pt);
        same(&w, "c", &a, "busy put");
        kvr_edit *et;
        cr_assert_eq(kvr_store_edit_begin(w.s, &base, &et, &e), 0, "%s", e.msg);
        try_edit(&w, base, "busy (edit)", KVR_EBUSY);
        kvr_refresh_params rp = { .ctx_id = "c", .start = 0, .end = 1, .n_layers = L,
                                  .n_kv_heads = H, .head_dim = w.D, .dtype = KVR_DTYPE_F16,
                                  .payload_bytes = 2 * L * rowb };
        kvr_edit *rt;
        cr_assert_eq(kvr_store_refresh_begin(w.s, &rp, &rt, &e), KVR_EBUSY);
        kvr_edit_abort(et);       /* an aborted edit changes nothing either */
        same(&w, "c", &a, "abort");
    }
    /* Overflow: a context whose positions sit near INT64_MAX. */
    {
        kvr_put_params pp = { .ctx_id = "big", .model = "m", .mode = KVR_PUT_CREATE,
                              .n_layers = L, .n_kv_heads = H, .head_dim = w.D,
                              .dtype = KVR_DTYPE_F16, .n_tokens = 4, .tokens = nt,
                              .has_pos_start = true, .pos_start = INT64_MAX - 5 };
        kvr_put *pt;
        cr_assert_eq(kvr_store_put_begin(w.s, &pp, &pt, &e), 0, "%s", e.msg);
        const struct iovec *iov;
        size_t niov;
        kvr_put_payload_iov(pt, &iov, &niov);
        for (size_t i = 0; i < niov; i++)
            memset(iov[i].iov_base, 0, iov[i].iov_len);
        cr_assert_eq(kvr_put_commit(pt, NULL, &e), 0);
        snap b;
        take(&w, "big", &b);
        uint32_t many[4] = { 5, 6, 7, 8 };
        p = base; p.ctx_id = "big"; ops[0] = (kvr_edit_op){ 1, 1, 4, many, false }; p.ops = ops;
        p.payload_bytes = 2 * L * 4 * rowb;
        try_edit(&w, p, "overflow", KVR_EINVAL);
        same(&w, "big", &b, "overflow");
        p = base; p.ctx_id = "big"; ops[0] = (kvr_edit_op){ 4, 4, 3, many, false }; p.ops = ops;
        p.payload_bytes = 2 * L * 3 * rowb;
        try_edit(&w, p, "overflow at the end", KVR_EINVAL);
        same(&w, "big", &b, "overflow end");
        snap_free(&b);
        cr_assert_eq(kvr_store_delete(w.s, "big", &e), 0);
    }
    same(&w, "c", &a, "end");
    snap_free(&a);
    world_free(&w);
}

Test(cache_edit, enomem_is_harmless)
{
    world w;
    /* Cap: what the process holds now + 40 MiB, filled with pinned
     * contexts; the edit wants ~8 MiB of new blocks (under the quarter of
     * the cap one request may use) and nothing can be evicted. */
    world_start(&w, 0, KVR_DTYPE_F16, kvr_mem_allocated() + (40u << 20), "c", NULL, 64, 1, 0);
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_pin(w.s, "c", true, &e), 0);
    uint32_t *fill_tok = calloc(1024, 4);
    int frc = 0;
    for (int i = 0; i < 64 && frc == 0; i++) {
        char id[16];
        snprintf(id, sizeof id, "fill%d", i);
        kvr_put_params fp = { .ctx_id = id, .model = "m", .mode = KVR_PUT_CREATE,
                              .n_layers = L, .n_kv_heads = H, .head_dim = w.D,
                              .dtype = KVR_DTYPE_F16, .n_tokens = 1024, .tokens = fill_tok,
                              .pin = true };
        kvr_put *ft;
        frc = kvr_store_put_begin(w.s, &fp, &ft, &e);
        if (frc == 0) {
            const struct iovec *fiov;
            size_t fn;
            kvr_put_payload_iov(ft, &fiov, &fn);
            for (size_t k = 0; k < fn; k++)
                memset(fiov[k].iov_base, 0, fiov[k].iov_len);
            cr_assert_eq(kvr_put_commit(ft, NULL, &e), 0, "%s", e.msg);
        }
    }
    cr_assert_eq(frc, KVR_ENOMEM, "filling the cap: %s", e.msg);
    free(fill_tok);
    snap a;
    take(&w, "c", &a);
    size_t rowb = (size_t)H * w.D * 2;
    uint32_t *many = calloc(4096, 4);
    kvr_edit_op op = { 10, 10, 4096, many, false };
    kvr_edit_params p = { .ctx_id = "c", .ops = &op, .n_ops = 1, .with_kv = true,
                          .n_layers = L, .n_kv_heads = H, .head_dim = w.D,
                          .dtype = KVR_DTYPE_F16, .payload_bytes = 2 * L * 4096 * rowb };
    try_edit(&w, p, "cap", KVR_ENOMEM);
    same(&w, "c", &a, "enomem");
    snap_free(&a);
    free(many);
    world_free(&w);
}

/* ---- plan, pending tokens, refresh, forks --------------------------------------- */

Test(cache_edit, plan_pending_refresh)
{
    world w;
    uint32_t init[50];
    world_start(&w, 0, KVR_DTYPE_F32, 0, "c", init, 50, 1, 10);
    kvr_error e = { 0 };
    uint32_t nt[3] = { 900, 901, 902 };
    kvr_edit_op ops[2] = { { 20, 20, 3, nt, false }, { 5, 7, 1, nt, false } };
    kvr_edit_params p = { .ctx_id = "c", .ops = ops, .n_ops = 2 };
    kvr_edit_span sp[2];
    kvr_edit_result r;
    cr_assert_eq(kvr_store_edit_plan(w.s, &p, sp, &r, &e), 0, "%s", e.msg);
    /* op 1 (sorted first) replaces [5,7) by 1 token at position 5: shift -1. */
    cr_assert_eq(sp[1].first_pos, 5);
    cr_assert_eq(sp[1].index, 5);
    cr_assert_eq(sp[1].shift, -1);
    cr_assert_eq(sp[0].first_pos, 19);
    cr_assert_eq(sp[0].index, 19);
    cr_assert_eq(sp[0].shift, 2);
    cr_assert_eq(r.n_tokens, 52);
    cr_assert_eq(r.n_pending, 4);
    cr_assert_eq(r.payload_bytes, 0);
    /* Without KV: pending. */
    kvr_edit *t;
    cr_assert_eq(kvr_store_edit_begin(w.s, &p, &t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_edit_payload_size(t), 0);
    cr_assert_eq(kvr_edit_commit(t, NULL, &r, &e), 0);
    cr_assert_eq(r.n_pending, 4);
    kvr_get_params gp = { .ctx_id = "c", .start = 0, .end = SIZE_MAX, .dtype = KVR_DTYPE_F32 };
    kvr_get *g;
    cr_assert_eq(kvr_store_get_begin(w.s, &gp, &g, &e), KVR_EPENDING);
    cr_assert(strstr(e.msg, "no KV") != NULL, "%s", e.msg);
    gp.start = 0; gp.end = 5;
    cr_assert_eq(kvr_store_get_begin(w.s, &gp, &g, &e), 0, "prefix before pending");
    kvr_get_end(g);
    gp.end = SIZE_MAX; gp.meta_only = true;
    cr_assert_eq(kvr_store_get_begin(w.s, &gp, &g, &e), 0, "%s", e.msg);
    const kvr_get_info *in = kvr_get_get_info(g);
    cr_assert_eq(in->n_tokens, 52);
    cr_assert_eq(in->flags[5], KVR_TOKEN_PENDING);
    cr_assert_eq(in->flags[19], KVR_TOKEN_PENDING | 0u);
    cr_assert_eq(in->flags[6] & ~KVR_TOKEN_AGE_MASK, KVR_TOKEN_APPROX);
    cr_assert_eq(KVR_TOKEN_AGE(in->flags[6]), 1, "one edit old");
    cr_assert_eq(in->flags[4], 0u);
    for (size_t i = 0; i < 52; i++)
        cr_assert_eq(in->positions[i], (int64_t)i);
    kvr_get_end(g);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(w.s, "c", &ci, &e), 0);
    cr_assert_eq(ci.n_pending, 4);
    kvr_match_result mr;
    /* The model: apply the same edit. */
    uint32_t seq[52];
    memcpy(seq, init, 5 * 4);
    seq[5] = 900;
    memcpy(seq + 6, init + 7, 13 * 4);
    memcpy(seq + 19, nt, 12);
    memcpy(seq + 22, init + 20, 30 * 4);
    cr_assert_eq(kvr_store_match(w.s, "m", seq, 52, false, &mr, &e), 0);
    cr_assert_eq(mr.length, 5, "exact index stops at the first pending token");
    /* Refresh the whole context: everything exact again. */
    memcpy(w.seq, seq, sizeof seq);
    w.n = 52;
    memset(w.approx, 0, 52);
    cr_assert_eq(world_refresh(&w, "c", 0, 52, &e), 0, "%s", e.msg);
    world_check(&w, "c", "after refresh");
    cr_assert_eq(kvr_store_stat(w.s, "c", &ci, &e), 0);
    cr_assert_eq(ci.n_pending, 0);
    cr_assert_eq(ci.n_approx, 0);
    world_free(&w);
}

Test(cache_edit, forks_are_copy_on_write)
{
    world w;
    world_start(&w, 1, KVR_DTYPE_BF16, 0, "a", NULL, 80, 3, 1);
    kvr_error e = { 0 };
    uint32_t nt[2] = { 77, 78 };
    kvr_edit_op op = { 30, 31, 2, nt, false };
    cr_assert_eq(world_edit(&w, "a", &op, 1, KVR_DTYPE_F32, &e), 0);
    cr_assert_eq(kvr_store_fork(w.s, "a", "b", &e), 0, "%s", e.msg);
    snap sa;
    take(&w, "a", &sa);
    world wb = w;          /* same store; b's expected state tracked separately */
    wb.seq = malloc(w.cap * 4);
    wb.approx = malloc(w.cap);
    memcpy(wb.seq, w.seq, w.n * 4);
    memcpy(wb.approx, w.approx, w.n);
    /* Refresh and edit b: a must not change. */
    cr_assert_eq(world_refresh(&wb, "b", 10, 60, &e), 0, "%s", e.msg);
    same_ex(&w, "a", &sa, "refresh of the fork", false);
    kvr_edit_op op2 = { 5, 8, 1, nt, false };
    cr_assert_eq(world_edit(&wb, "b", &op2, 1, KVR_DTYPE_F32, &e), 0);
    same_ex(&w, "a", &sa, "edit of the fork", false);
    /* Check b's own contents (the index check in world_check sees both
     * contexts: include_approx finds b's full sequence). */
    world_check(&wb, "b", "fork after refresh+edit");
    free(wb.seq);
    free(wb.approx);
    snap_free(&sa);
    world_free(&w);
}

/* ---- prefix index ---------------------------------------------------------------- */

Test(cache_edit, match_after_edits)
{
    world w;
    uint32_t *init = malloc(600 * 4);
    world_start(&w, 0, KVR_DTYPE_F16, 0, "c", init, 600, 1, 20000);
    kvr_error e = { 0 };
    uint32_t nt[2] = { 5, 6 };
    /* Edit near the start: the full-sequence entry goes stale (suffix of
     * ~500 tokens) and is rebuilt by the include_approx match. */
    kvr_edit_op op = { 100, 105, 2, nt, false };
    cr_assert_eq(world_edit(&w, "c", &op, 1, KVR_DTYPE_F16, &e), 0);
    kvr_match_result mr;
    cr_assert_eq(kvr_store_match(w.s, "m", w.seq, w.n, false, &mr, &e), 0);
    cr_assert_eq(mr.length, 102, "exact: prefix + new tokens");
    cr_assert_str_eq(mr.ctx_id, "c");
    /* The old text is gone from both trees. */
    cr_assert_eq(kvr_store_match(w.s, "m", init, 600, true, &mr, &e), 0);
    cr_assert_eq(mr.length, 100);
    /* A fork of the stale context, then an append to the original. */
    cr_assert_eq(kvr_store_fork(w.s, "c", "f", &e), 0);
    cr_assert_eq(kvr_store_match(w.s, "m", w.seq, w.n, true, &mr, &e), 0);
    cr_assert_eq(mr.length, w.n);
    world_check(&w, "c", "after fork");
    /* Edit at the end stays eager; refresh of the approx range restores
     * the exact prefix. */
    kvr_edit_op op2 = { w.n, w.n, 2, nt, false };
    cr_assert_eq(world_edit(&w, "c", &op2, 1, KVR_DTYPE_F16, &e), 0);
    world_check(&w, "c", "end insert");
    cr_assert_eq(world_refresh(&w, "c", 102, w.n - 2, &e), 0, "%s", e.msg);
    world_check(&w, "c", "refreshed");
    cr_assert_eq(kvr_store_match(w.s, "m", w.seq, w.n, false, &mr, &e), 0);
    cr_assert_eq(mr.length, w.n);
    /* The fork kept the old edited state. */
    cr_assert_eq(kvr_store_delete(w.s, "c", &e), 0);
    cr_assert_eq(kvr_store_match(w.s, "m", w.seq, w.n - 2, true, &mr, &e), 0);
    cr_assert_eq(mr.length, w.n - 2);
    cr_assert_str_eq(mr.ctx_id, "f");
    cr_assert_eq(kvr_store_match(w.s, "m", w.seq, w.n, false, &mr, &e), 0);
    cr_assert_eq(mr.length, 102);
    free(init);
    world_free(&w);
}

Test(cache_edit, protected_sinks)
{
    world w;
    world_start(&w, 0, KVR_DTYPE_F32, 0, "c", NULL, 40, 1, 0);
    kvr_error e = { 0 };
    cr_assert_eq(kvr_store_protect(w.s, "c", 41, &e), KVR_ERANGE);
    cr_assert_eq(kvr_store_protect(w.s, "c", 4, &e), 0);
    kvr_ctx_info ci;
    cr_assert_eq(kvr_store_stat(w.s, "c", &ci, &e), 0);
    cr_assert_eq(ci.n_protected, 4);
    uint32_t nt[2] = { 99, 98 };
    kvr_edit_op op = { 4, 4, 2, nt, false };       /* right after the sinks: allowed */
    cr_assert_eq(world_edit(&w, "c", &op, 1, KVR_DTYPE_F32, &e), 0, "%s", e.msg);
    kvr_edit_op bad = { 3, 5, 0, NULL, false };
    kvr_edit_params p = { .ctx_id = "c", .ops = &bad, .n_ops = 1 };
    kvr_edit *t;
    cr_assert_eq(kvr_store_edit_begin(w.s, &p, &t, &e), KVR_EPROTECTED);
    cr_assert(strstr(e.msg, "protected") != NULL);
    /* Forks inherit the protection. */
    cr_assert_eq(kvr_store_fork(w.s, "c", "d", &e), 0);
    p.ctx_id = "d";
    cr_assert_eq(kvr_store_edit_begin(w.s, &p, &t, &e), KVR_EPROTECTED);
    cr_assert_eq(kvr_store_protect(w.s, "d", 0, &e), 0);
    cr_assert_eq(kvr_store_edit_begin(w.s, &p, &t, &e), 0, "%s", e.msg);
    kvr_edit_abort(t);
    world_check(&w, "c", "sinks");
    world_free(&w);
}

/* ---- approximation age and compare-and-swap ---------------------------------- */

/* Flags of the whole context, meta only. */
static void flags_of(world *w, const char *id, uint32_t *out, size_t n)
{
    kvr_error e = { 0 };
    kvr_get_params p = { .ctx_id = id, .start = 0, .end = SIZE_MAX, .meta_only = true };
    kvr_get *g;
    cr_assert_eq(kvr_store_get_begin(w->s, &p, &g, &e), 0, "%s", e.msg);
    const kvr_get_info *in = kvr_get_get_info(g);
    cr_assert_eq(in->n_tokens, n);
    memcpy(out, in->flags, n * sizeof *out);
    kvr_get_end(g);
}

Test(cache_edit, approximation_age)
{
    world w;
    uint32_t fl[400];
    memset(fl, 0, sizeof fl);
    world_start(&w, 0, KVR_DTYPE_F16, 0, "c", NULL, 100, 1, 1000);
    kvr_error e = { 0 };
    uint32_t ins[3] = { 7, 8, 9 };
    /* Edit 1 at 50: tokens 53.. (old 50..) age 1; before: exact; new: exact. */
    kvr_edit_op op1 = { .start = 50, .end = 50, .n_tokens = 3, .tokens = ins };
    cr_assert_eq(world_edit(&w, "c", &op1, 1, KVR_DTYPE_F32, &e), 0, "%s", e.msg);
    flags_of(&w, "c", fl, 103);
    for (size_t i = 0; i < 103; i++) {
        uint32_t want_age = i < 53 ? 0 : 1;
        cr_assert_eq(KVR_TOKEN_AGE(fl[i]), want_age, "edit 1: token %zu age %u", i,
                     KVR_TOKEN_AGE(fl[i]));
        cr_assert_eq(!!(fl[i] & KVR_TOKEN_APPROX), i >= 53, "token %zu", i);
    }
    /* Edit 2 at 80: the suffix after 80 ages to 2, 53..79 stay 1; edit 3 at
     * 20: 23.. everything after ages by one more (new tokens of edit 2: 1). */
    kvr_edit_op op2 = { .start = 80, .end = 81, .n_tokens = 1, .tokens = ins };
    cr_assert_eq(world_edit(&w, "c", &op2, 1, KVR_DTYPE_F32, &e), 0, "%s", e.msg);
    kvr_edit_op op3 = { .start = 20, .end = 20, .n_tokens = 2, .tokens = ins };
    cr_assert_eq(world_edit(&w, "c", &op3, 1, KVR_DTYPE_F32, &e), 0, "%s", e.msg);
    flags_of(&w, "c", fl, 105);
    for (size_t i = 0; i < 105; i++) {
        uint32_t want = i < 22 ? 0 : i < 25 ? 1 : i < 55 ? 1 : i < 82 ? 2 : i == 82 ? 1 : 3;
        if (i < 20)
            want = 0;
        else if (i < 22)
            want = 0;                    /* edit 3's new tokens */
        cr_assert_eq(KVR_TOKEN_AGE(fl[i]), want, "after 3 edits: token %zu age %u, want %u",
                     i, KVR_TOKEN_AGE(fl[i]), want);
    }
    /* Refresh clears flag and age; world_check still holds. */
    cr_assert_eq(world_refresh(&w, "c", 60, 90, &e), 0, "%s", e.msg);
    flags_of(&w, "c", fl, 105);
    for (size_t i = 60; i < 90; i++)
        cr_assert_eq(fl[i], 0, "refreshed token %zu flags %#x", i, fl[i]);
    cr_assert_neq(fl[59], 0);
    world_check(&w, "c", "after ageing edits and a refresh");
    /* New tokens whose KV saw approximate ones, and a range refreshed the
     * same way, are stored APPROX with age 0; the exact prefix shrinks. */
    uint32_t before[105];
    memcpy(before, fl, sizeof before);
    kvr_edit_op opa = { .start = 95, .end = 95, .n_tokens = 2, .tokens = ins, .approx = true };
    cr_assert_eq(world_edit(&w, "c", &opa, 1, KVR_DTYPE_F32, &e), 0, "%s", e.msg);
    flags_of(&w, "c", fl, 107);
    cr_assert_eq(fl[95], KVR_TOKEN_APPROX, "approx new token: flags %#x", fl[95]);
    cr_assert_eq(fl[96], KVR_TOKEN_APPROX);
    cr_assert_eq(KVR_TOKEN_AGE(fl[97]), KVR_TOKEN_AGE(before[95]) + 1, "the suffix ages");
    kvr_refresh_params rq = { .ctx_id = "c", .start = 0, .end = 4, .n_layers = L,
                              .n_kv_heads = H, .head_dim = w.D, .dtype = KVR_DTYPE_F32,
                              .payload_bytes = 2 * L * 4 * H * w.D * 4, .approx = true };
    int64_t rpos[4] = { 0, 1, 2, 3 };
    float *rpl = kv_payload(&w, w.seq, rpos, 4);
    kvr_edit *rt;
    cr_assert_eq(kvr_store_refresh_begin(w.s, &rq, &rt, &e), 0, "%s", e.msg);
    const struct iovec *riov;
    size_t rniov;
    kvr_edit_payload_iov(rt, &riov, &rniov);
    fill_iov(riov, rniov, rpl, rq.payload_bytes);
    cr_assert_eq(kvr_edit_commit(rt, NULL, NULL, &e), 0, "%s", e.msg);
    free(rpl);
    flags_of(&w, "c", fl, 107);
    for (size_t i = 0; i < 4; i++)
        cr_assert_eq(fl[i], KVR_TOKEN_APPROX, "refreshed as approximate: %#x", fl[i]);
    kvr_match_result mr;
    cr_assert_eq(kvr_store_match(w.s, "m", w.seq, 107, false, &mr, &e), 0);
    cr_assert_eq(mr.length, 0, "the exact prefix is empty now");
    for (size_t i = 0; i < 4; i++)
        w.approx[i] = 1;
    w.approx[95] = w.approx[96] = 1;
    world_check(&w, "c", "approximate new tokens and refresh");
    /* Ages saturate at 255. */
    for (int k = 0; k < 300; k++) {
        kvr_edit_op op = { .start = 0, .end = 1, .n_tokens = 1, .tokens = &ins[k % 3] };
        cr_assert_eq(world_edit(&w, "c", &op, 1, KVR_DTYPE_F32, &e), 0, "%s", e.msg);
    }
    flags_of(&w, "c", fl, 107);
    cr_assert_eq(KVR_TOKEN_AGE(fl[106]), 255);
    cr_assert(fl[106] & KVR_TOKEN_APPROX);
    world_free(&w);
}

Test(cache_edit, compare_and_swap)
{
    world w;
    uint32_t init[40], ins[2] = { 5, 6 };
    world_start(&w, 0, KVR_DTYPE_F16, 0, "c", init, 40, 1, 2000);
    kvr_edit_op op = { .start = 10, .end = 12, .n_tokens = 2, .tokens = ins };
    uint64_t h = kvr_tokens_hash(KVR_TOKENS_HASH_INIT, init, 40);
    kvr_edit_params p = { .ctx_id = "c", .model = "m", .ops = &op, .n_ops = 1 };
    snap s0;
    take(&w, "c", &s0);
    /* A wrong length, a wrong hash (one token differs): BUSY, nothing changed. */
    p.expect = (kvr_expect){ true, 39, h };
    try_edit(&w, p, "expect: wrong length", KVR_EBUSY);
    same(&w, "c", &s0, "expect: wrong length");
    uint32_t other[40];
    memcpy(other, init, sizeof other);
    other[39]++;
    p.expect = (kvr_expect){ true, 40, kvr_tokens_hash(KVR_TOKENS_HASH_INIT, other, 40) };
    try_edit(&w, p, "expect: another sequence", KVR_EBUSY);
    same(&w, "c", &s0, "expect: another sequence");
    kvr_error e = { 0 };
    kvr_refresh_params rp = { .ctx_id = "c", .start = 0, .end = 4, .n_layers = L,
                              .n_kv_heads = H, .head_dim = w.D, .dtype = KVR_DTYPE_F32,
                              .payload_bytes = 2 * L * 4 * H * w.D * 4,
                              .expect = { true, 40, h ^ 1 } };
    kvr_edit *t = NULL;
    cr_assert_eq(kvr_store_refresh_begin(w.s, &rp, &t, &e), KVR_EBUSY, "%s", e.msg);
    same(&w, "c", &s0, "refresh expect");
    /* The right sequence: the edit lands; the same expect again is now stale. */
    p.expect = (kvr_expect){ true, 40, h };
    p.with_kv = false;
    cr_assert_eq(kvr_store_edit_begin(w.s, &p, &t, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_edit_commit(t, NULL, NULL, &e), 0, "%s", e.msg);
    cr_assert_eq(kvr_store_edit_begin(w.s, &p, &t, &e), KVR_EBUSY, "a second writer planned "
                 "against the old sequence is refused");
    snap_free(&s0);
    world_free(&w);
}
