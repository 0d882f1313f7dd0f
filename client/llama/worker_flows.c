/*
 * worker_flows.c — the four commands of kvrope-llama on one model.
 *
 *  complete  longest cached prefix (match) -> fetch -> set_data -> decode the
 *            rest -> greedy tokens -> the new cells back into kvrope.
 *  edit      old file cached (or encoded once), token diff -> PIE ops; the old
 *            context's kept tokens fetched with keys re-rotated to their new
 *            positions, loaded, and only the new tokens (plus K refreshed
 *            ones per edit point) decoded; their KV goes back with the edit
 *            (and refresh), the context forked so the old file stays cached.
 *  rag       prefix and documents each encoded once (documents against the
 *            prefix, APE), assembled by kvrope in parallel or sequential
 *            layout, the query decoded on top.
 *  ppl       bits per byte, no cache.
 *
 * Invariants:
 *  - Every context this worker writes holds its tokens at positions 0..n-1
 *    (APE documents: P..P+L-1); exact-prefix reuse asks for those positions.
 *  - A context is only appended to in place when it is one of the worker's
 *    completion contexts ("kvl-c-"); anything else is forked first, so an
 *    APE prefix or an editor's file never changes under its users.
 *  - Contexts are named by a hash of the model fingerprint and their tokens,
 *    so the same text always lands in the same place.
 *  - Timings are wall clock (monotonic); "first token" spans everything from
 *    the first kvrope request to the predicted token.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "client/llama/kvrope_llama.h"
#include "client/llama/worker.h"

#define F16 KVR_DTYPE_F16

static int fail(kvr_wk_env *e, int r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(kvr_wk_env *e, int r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->err, sizeof e->err, fmt, ap);
    va_end(ap);
    return r < 0 ? r : -EINVAL;
}

/* A kvrope call failed: remember its code and say what was being done. */
static int kv_fail(kvr_wk_env *e, int r, const char *what, const char *ctx)
{
    e->kv_code = r;
    snprintf(e->err, sizeof e->err, "kvrope %s%s%s: %s", what, ctx ? " " : "", ctx ? ctx : "",
             kvr_client_last_error(e->kc));
    return r;
}

static uint64_t hash_toks(uint64_t h, const int32_t *t, size_t n)
{
    const unsigned char *p = (const unsigned char *)t;
    for (size_t i = 0; i < n * sizeof *t; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return (h ^ n) * 1099511628211ull;
}

static void ctx_name(const kvr_wk_env *e, char *out, size_t cap, const char *kind,
                     const int32_t *t, size_t n, const int32_t *t2, size_t n2)
{
    uint64_t h = hash_toks(1469598103934665603ull ^ e->fingerprint, t, n);
    if (t2)
        h = hash_toks(h, t2, n2);
    snprintf(out, cap, "kvl-%s-%016llx", kind, (unsigned long long)h);
}

static size_t n_embd(const kvr_wk_env *e)
{
    const kvr_wk_lm_info *in = kvr_wk_lm_info_get(e->lm);
    return (size_t)in->n_head_kv * in->head_dim;
}

static uint32_t n_layer(const kvr_wk_env *e) { return kvr_wk_lm_info_get(e->lm)->n_layer; }

static size_t payload_bytes(const kvr_wk_env *e, size_t n_tok)
{
    return (size_t)n_layer(e) * 2 * n_tok * n_embd(e) * 2;
}

static int check_kv_shape(kvr_wk_env *e, const kvr_kv *kv, const char *ctx)
{
    if (kv->n_layers != n_layer(e) || (size_t)kv->n_kv_heads * kv->head_dim != n_embd(e) ||
        kv->dtype != F16)
        return fail(e, -EINVAL, "context %s: KV of %zu layers x %u x %u does not fit the model",
                    ctx, kv->n_layers, kv->n_kv_heads, kv->head_dim);
    return 0;
}

/* ---- loading and storing ------------------------------------------------ */

/* Writes every page of a fresh buffer once (its bytes unchanged), so that
 * the kernel's first-touch faults happen here rather than in a timed step. */
static void prefault(void *buf, size_t len)
{
    volatile uint8_t *p = buf;
    for (size_t i = 0; i < len; i += 4096)
        p[i] = p[i];
    if (len)
        p[len - 1] = p[len - 1];
}

/* The state bytes of n f16 (or the cache type's) cells, as kvr_wk_sbuild
 * and the bridge's raw export lay them out. */
static size_t state_bytes(const kvr_wk_env *e, size_t n)
{
    return 16 + n * 12 + 8 + (size_t)n_layer(e) * (24 + 2 * n * n_embd(e) * 2);
}

void kvr_wk_env_bufs_free(kvr_wk_env *e)
{
    free(e->pf_fetch);
    free(e->pf_state);
    e->pf_fetch = e->pf_state = NULL;
    e->pf_fetch_cap = e->pf_state_cap = 0;
}

/* Buffers for loading up to n cells, faulted in now (a fresh process's first
 * touch of them costs 50 ms to 0.9 s on this machine: kernel page faults);
 * without memory, loads allocate their own as before. */
static void prefault_bufs(kvr_wk_env *e, size_t n)
{
    size_t fc = payload_bytes(e, n), sc = state_bytes(e, n);
    if (e->pf_fetch_cap >= fc && e->pf_state_cap >= sc)
        return;
    kvr_wk_env_bufs_free(e);
    e->pf_fetch = malloc(fc);
    e->pf_state = malloc(sc);
    if (!e->pf_fetch || !e->pf_state) {
        kvr_wk_env_bufs_free(e);
        return;
    }
    e->pf_fetch_cap = fc;
    e->pf_state_cap = sc;
    prefault(e->pf_fetch, fc);
    prefault(e->pf_state, sc);
}

/* Loads tokens [0, n) of ctx into seq 0 at positions 0..n-1: the bridge's
 * export (keys re-rotated by the daemon where they are stored elsewhere),
 * then llama_state_seq_set_data. */
static int load_prefix(kvr_wk_env *e, const char *ctx, size_t n, double *t_fetch,
                       double *t_load)
{
    if (n == 0)
        return 0;
    double t0 = kvr_wk_now_ms();
    kvr_llama_export_opts xo = { .model = e->model, .start = 0, .end = n,
                                 .has_pos_start = true, .pos_start = 0,
                                 .type_k = KVR_LLAMA_F16, .type_v = KVR_LLAMA_F16,
                                 .v_trans = kvr_wk_lm_v_trans(e->lm),
                                 .form = KVR_LLAMA_FORM_RAW,
                                 .dst = e->pf_state, .dst_cap = e->pf_state_cap,
                                 .scratch = e->pf_fetch, .scratch_cap = e->pf_fetch_cap };
    if (e->pf_state_cap < state_bytes(e, n))
        xo.dst = NULL, xo.dst_cap = 0;
    void *st = NULL;
    size_t len = 0;
    char err[512] = "";
    int r = kvr_llama_state_export(e->kc, ctx, e->profile, &xo, &st, &len, NULL, err,
                                   sizeof err);
    if (r < 0) {
        e->kv_code = r;
        return fail(e, r, "loading %zu tokens of %s: %s", n, ctx, err);
    }
    double t1 = kvr_wk_now_ms();
    r = kvr_wk_lm_state_set(e->lm, st, len, e->err, sizeof e->err);
    if (st != e->pf_state)
        kvr_llama_free(st);
    *t_fetch += t1 - t0;
    *t_load += kvr_wk_now_ms() - t1;
    return r;
}

/* The llama.cpp state of seq 0, parsed; cell index per position [0, np). */
typedef struct seqstate {
    uint8_t     *buf;
    size_t       len;
    kvr_wk_state st;
    long        *cell;    /* np entries, -1 = absent */
    size_t       np;
} seqstate;

static void seqstate_free(seqstate *s)
{
    kvr_wk_state_free(&s->st);
    free(s->buf);
    free(s->cell);
    memset(s, 0, sizeof *s);
}

static int seqstate_get(kvr_wk_env *e, seqstate *s, size_t np)
{
    memset(s, 0, sizeof *s);
    int r = kvr_wk_lm_state_get(e->lm, &s->buf, &s->len, e->err, sizeof e->err);
    if (r < 0)
        return r;
    char why[256];
    if ((r = kvr_wk_state_parse(&s->st, s->buf, s->len, why, sizeof why)) < 0) {
        seqstate_free(s);
        return fail(e, r, "llama.cpp's own state: %s", why);
    }
    if (s->st.n_cells && (s->st.n_layer != n_layer(e) || s->st.n_embd != n_embd(e))) {
        seqstate_free(s);
        return fail(e, -EINVAL, "llama.cpp's state has %u layers x %u, the model %u x %zu",
                    s->st.n_layer, s->st.n_embd, n_layer(e), n_embd(e));
    }
    s->np = np;
    s->cell = malloc((np ? np : 1) * sizeof *s->cell);
    if (!s->cell) {
        seqstate_free(s);
        return fail(e, -ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < np; i++)
        s->cell[i] = -1;
    for (uint32_t c = 0; c < s->st.n_cells; c++) {
        int32_t p = s->st.pos[c];
        if (p < 0 || (size_t)p >= np)
            continue;
        if (s->cell[p] >= 0) {
            seqstate_free(s);
            return fail(e, -EINVAL, "llama.cpp's state holds position %d twice", p);
        }
        s->cell[p] = c;
    }
    return 0;
}

/* Payload of the cells at positions pos[0..n) (layer-major, the caller's). */
static void *seqstate_payload(kvr_wk_env *e, const seqstate *s, const int64_t *pos, size_t n,
                              size_t p0)
{
    uint32_t *cells = malloc((n ? n : 1) * sizeof *cells);
    void *out = malloc(payload_bytes(e, n) ? payload_bytes(e, n) : 1);
    if (!cells || !out) {
        free(cells);
        free(out);
        fail(e, -ENOMEM, "out of memory");
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        int64_t p = pos ? pos[i] : (int64_t)(p0 + i);
        if (p < 0 || (size_t)p >= s->np || s->cell[p] < 0) {
            free(cells);
            free(out);
            fail(e, -EINVAL, "llama.cpp's state has no cell at position %lld", (long long)p);
            return NULL;
        }
        cells[i] = (uint32_t)s->cell[p];
    }
    kvr_wk_state_gather(&s->st, cells, n, out);
    free(cells);
    return out;
}

static int ctx_len(kvr_wk_env *e, const char *ctx, kvr_context *info)
{
    int r = kvr_client_stat(e->kc, ctx, info);
    return r < 0 ? kv_fail(e, r, "stat", ctx) : 0;
}

static int del_quiet(kvr_wk_env *e, const char *ctx)
{
    int r = kvr_client_delete(e->kc, ctx);
    return r < 0 && r != KVR_ENOCTX ? kv_fail(e, r, "delete", ctx) : 0;
}

/* A fresh context `dst` holding tokens [0, n) of `src` (copy-on-write). */
static int fork_prefix(kvr_wk_env *e, const char *src, const char *dst, size_t n, size_t len)
{
    int r;
    if ((r = del_quiet(e, dst)) < 0)
        return r;
    if ((r = kvr_client_fork(e->kc, src, dst)) < 0)
        return kv_fail(e, r, "fork", src);
    if (n < len && (r = kvr_client_keep(e->kc, dst, 0, n)) < 0)
        return kv_fail(e, r, "keep", dst);
    return 0;
}

typedef struct stored {
    char   ctx[KVR_ID_MAX + 1];
    size_t n_new;            /* tokens sent */
    size_t n_reused;         /* tokens already there */
    const char *how;         /* "cached", "appended", "forked+appended", "created" */
} stored;

/* Makes kvrope hold S[0..ns) (the tokens whose cells seq 0 holds at 0..ns-1):
 * only what is not cached yet is sent. exact: the result context holds S and
 * nothing more. kind names a created context. */
static int store_seq(kvr_wk_env *e, const int32_t *S, size_t ns, const char *kind, bool exact,
                     stored *out)
{
    memset(out, 0, sizeof *out);
    kvr_match_res m;
    kvr_match_args ma = { .model = e->model, .tokens = (const uint32_t *)S, .n_tokens = ns };
    int r = kvr_client_match(e->kc, &ma, &m);
    if (r < 0)
        return kv_fail(e, r, "match", NULL);
    size_t L = (size_t)m.length;
    kvr_context info = { 0 };
    if (L > 0 && (r = ctx_len(e, m.ctx_id, &info)) < 0)
        return r;
    char mine[KVR_ID_MAX + 1];
    ctx_name(e, mine, sizeof mine, kind, S, ns, NULL, 0);
    out->n_reused = L;
    if (L >= ns) {
        if (!exact || info.n_tokens == ns) {
            snprintf(out->ctx, sizeof out->ctx, "%s", m.ctx_id);
            out->how = "cached";
            return 0;
        }
        if ((r = fork_prefix(e, m.ctx_id, mine, ns, (size_t)info.n_tokens)) < 0)
            return r;
        snprintf(out->ctx, sizeof out->ctx, "%s", mine);
        out->how = "forked";
        return 0;
    }
    seqstate s;
    if ((r = seqstate_get(e, &s, ns)) < 0)
        return r;
    /* Cells in position order (the usual case: loaded, then decoded at the
     * end) go through the bridge's import straight from the state bytes;
     * others are gathered by position here. */
    bool in_order = s.st.n_cells == ns;
    for (size_t p = L; in_order && p < ns; p++)
        in_order = s.cell[p] == (long)p;
    void *pl = NULL;
    if (!in_order && !(pl = seqstate_payload(e, &s, NULL, ns - L, L))) {
        seqstate_free(&s);
        return -EINVAL;
    }
    kvr_put_mode mode = KVR_PUT_APPEND;
    if (L > 0 && info.n_tokens == L && info.pos_max == (int64_t)L - 1 &&
        strncmp(m.ctx_id, "kvl-c-", 6) == 0) {
        snprintf(out->ctx, sizeof out->ctx, "%s", m.ctx_id);
        out->how = "appended";
    } else if (L > 0) {
        if ((r = fork_prefix(e, m.ctx_id, mine, L, (size_t)info.n_tokens)) < 0) {
            free(pl);
            seqstate_free(&s);
            return r;
        }
        snprintf(out->ctx, sizeof out->ctx, "%s", mine);
        out->how = "forked+appended";
    } else {
        if ((r = del_quiet(e, mine)) < 0) {
            free(pl);
            seqstate_free(&s);
            return r;
        }
        snprintf(out->ctx, sizeof out->ctx, "%s", mine);
        out->how = "created";
        mode = KVR_PUT_CREATE;
    }
    if (in_order) {
        kvr_llama_import_opts io = { .model = e->model,
                                     .mode = mode == KVR_PUT_CREATE ? KVR_LLAMA_IMPORT_CREATE
                                                                      : KVR_LLAMA_IMPORT_APPEND,
                                     .cell_start = (uint32_t)L, .cell_end = (uint32_t)ns,
                                     .tokens = (const uint32_t *)S + L, .n_tokens = ns - L };
        char err[512] = "";
        r = kvr_llama_state_import(e->kc, out->ctx, s.buf, s.len, e->profile, &io, NULL, err,
                                   sizeof err);
        seqstate_free(&s);
        if (r < 0) {
            e->kv_code = r;
            return fail(e, r, "storing %zu tokens into %s: %s", ns - L, out->ctx, err);
        }
        out->n_new = ns - L;
        return 0;
    }
    seqstate_free(&s);
    kvr_put_args p = { .ctx_id = out->ctx, .model = e->model, .mode = mode,
                       .fingerprint = e->fingerprint, .dtype = F16,
                       .tokens = (const uint32_t *)S + L, .n_tokens = ns - L,
                       .has_pos_start = true, .pos_start = (int64_t)L, .payload = pl,
                       .payload_len = payload_bytes(e, ns - L) };
    r = kvr_client_put(e->kc, &p, NULL);
    free(pl);
    if (r < 0)
        return kv_fail(e, r, "put", out->ctx);
    out->n_new = ns - L;
    return 0;
}

/* kvrope holds exactly toks[0..n) somewhere (computing what is missing);
 * seq 0 is left holding them when anything had to be computed. */
static int ensure_cached(kvr_wk_env *e, const int32_t *toks, size_t n, const char *kind,
                         stored *st, size_t *computed, double *t_compute)
{
    kvr_match_res m;
    kvr_match_args ma = { .model = e->model, .tokens = (const uint32_t *)toks, .n_tokens = n };
    int r = kvr_client_match(e->kc, &ma, &m);
    if (r < 0)
        return kv_fail(e, r, "match", NULL);
    *computed = 0;
    if (m.length < n) {
        double t0 = kvr_wk_now_ms(), tf = 0, tl = 0;
        size_t reuse = (size_t)m.length;
        kvr_wk_lm_clear(e->lm);
        if (reuse > 0 && (r = load_prefix(e, m.ctx_id, reuse, &tf, &tl)) < 0)
            return r;
        r = kvr_wk_lm_decode(e->lm, toks + reuse, n - reuse, (int32_t)reuse, 0,
                             KVR_WK_LOGITS_NONE, NULL, NULL, e->err, sizeof e->err);
        if (r < 0)
            return r;
        *computed = n - reuse;
        *t_compute = kvr_wk_now_ms() - t0;
    }
    return store_seq(e, toks, n, kind, true, st);
}

/* ---- logits comparison -------------------------------------------------- */
typedef struct cmp {
    bool   agree;
    double max_abs, rms, ref_rms;
} cmp;

static cmp compare(const float *got, const float *ref, size_t n)
{
    cmp c = { kvr_wk_argmax(got, n) == kvr_wk_argmax(ref, n), 0, 0, 0 };
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] - (double)ref[i];
        if (fabs(d) > c.max_abs)
            c.max_abs = fabs(d);
        c.rms += d * d;
        c.ref_rms += (double)ref[i] * (double)ref[i];
    }
    c.rms = sqrt(c.rms / (double)(n ? n : 1));
    c.ref_rms = sqrt(c.ref_rms / (double)(n ? n : 1));
    return c;
}

static void text_of(kvr_wk_env *e, const int32_t *t, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    char buf[4 * 1024];
    for (size_t i = 0; i < n && o + 64 < sizeof buf; i++)
        o += kvr_wk_lm_piece(e->lm, t[i], buf + o, sizeof buf - o);
    kvr_wk_quote(buf, o, out, cap);
}

/* Greedy: gen[0] is already chosen from the logits; decodes gen[i-1] at
 * pos0 + i - 1 for i in 1..n. */
static int generate(kvr_wk_env *e, int32_t *gen, size_t n, int32_t pos0)
{
    size_t nv = kvr_wk_lm_info_get(e->lm)->n_vocab;
    for (size_t i = 1; i < n; i++) {
        int r = kvr_wk_lm_decode(e->lm, &gen[i - 1], 1, pos0 + (int32_t)i - 1, 0,
                                 KVR_WK_LOGITS_LAST, NULL, NULL, e->err, sizeof e->err);
        if (r < 0)
            return r;
        gen[i] = kvr_wk_argmax(kvr_wk_lm_logits(e->lm), nv);
    }
    return 0;
}

static float *copy_logits(kvr_wk_env *e)
{
    size_t nv = kvr_wk_lm_info_get(e->lm)->n_vocab;
    const float *l = kvr_wk_lm_logits(e->lm);
    float *c = l ? malloc(nv * sizeof *c) : NULL;
    if (c)
        memcpy(c, l, nv * sizeof *c);
    return c;
}

/* Full re-encode of toks from an empty cache: reference logits of the last
 * token, then n greedy tokens. */
static int reference(kvr_wk_env *e, const int32_t *toks, size_t n, float **logits,
                     int32_t *gen, size_t n_gen, double *t_ms)
{
    double t0 = kvr_wk_now_ms();
    kvr_wk_lm_clear(e->lm);
    int r = kvr_wk_lm_decode(e->lm, toks, n, 0, 0, KVR_WK_LOGITS_LAST, NULL, NULL, e->err,
                             sizeof e->err);
    if (r < 0)
        return r;
    *t_ms = kvr_wk_now_ms() - t0;
    if (!(*logits = copy_logits(e)))
        return fail(e, -ENOMEM, "out of memory");
    if (n_gen) {
        gen[0] = kvr_wk_argmax(*logits, kvr_wk_lm_info_get(e->lm)->n_vocab);
        if ((r = generate(e, gen, n_gen, (int32_t)n)) < 0)
            return r;
    }
    return 0;
}

static size_t same_prefix(const int32_t *a, const int32_t *b, size_t n)
{
    size_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

static void report_check(kvr_wk_env *e, const cmp *c, const int32_t *gen,
                         const int32_t *ref_gen, size_t n_gen, double t_full, double t_path,
                         const char *path)
{
    kvr_wk_report *R = e->rep;
    size_t agree_gen = same_prefix(gen, ref_gen, n_gen);
    kvr_wk_rep_bool(R, "check", "next_token_agrees", c->agree);
    kvr_wk_rep_num(R, "check", "logit_max_abs_err", c->max_abs);
    kvr_wk_rep_num(R, "check", "logit_rms_err", c->rms);
    kvr_wk_rep_num(R, "check", "logit_rms", c->ref_rms);
    kvr_wk_rep_num(R, "check", "generated_agree", (double)agree_gen);
    kvr_wk_rep_num(R, "check", "full_ms", t_full);
    kvr_wk_rep_num(R, "check", "speedup", t_path > 0 ? t_full / t_path : (double)NAN);
    kvr_wk_rep_line(R, "check: full re-encode %.1f ms (%s %.1fx faster); next token %s; "
                    "logit error max %.4g, rms %.4g (logit rms %.4g); %zu of %zu generated "
                    "tokens agree", t_full, path, t_path > 0 ? t_full / t_path : 0,
                    c->agree ? "agrees" : "DIFFERS", c->max_abs, c->rms, c->ref_rms, agree_gen,
                    n_gen);
}

/* ---- complete ----------------------------------------------------------- */
int kvr_wk_complete(kvr_wk_env *e, const int32_t *toks, size_t n, bool use_cache)
{
    kvr_wk_report *R = e->rep;
    if (n == 0)
        return fail(e, -EINVAL, "the prompt is empty");
    size_t n_gen = e->n_gen > 0 ? (size_t)e->n_gen : 1;
    int r = kvr_wk_lm_context(e->lm, (uint32_t)(n + n_gen + 16), e->err, sizeof e->err);
    if (r < 0)
        return r;
    double tp0 = kvr_wk_now_ms();
    if (use_cache && n > 1)
        prefault_bufs(e, n - 1);
    double t_prefault = kvr_wk_now_ms() - tp0;
    double t0 = kvr_wk_now_ms(), t_match = 0, t_fetch = 0, t_load = 0, t_prefill, t_gen,
           t_store = 0;
    kvr_match_res m = { 0 };
    if (use_cache) {
        kvr_match_args ma = { .model = e->model, .tokens = (const uint32_t *)toks,
                              .n_tokens = n };
        if ((r = kvr_client_match(e->kc, &ma, &m)) < 0)
            return kv_fail(e, r, "match", NULL);
        t_match = kvr_wk_now_ms() - t0;
    }
    size_t cached = (size_t)m.length, reuse = cached < n ? cached : n - 1;
    if (reuse > 0 && (r = load_prefix(e, m.ctx_id, reuse, &t_fetch, &t_load)) < 0)
        return r;
    double t1 = kvr_wk_now_ms();
    r = kvr_wk_lm_decode(e->lm, toks + reuse, n - reuse, (int32_t)reuse, 0, KVR_WK_LOGITS_LAST,
                         NULL, NULL, e->err, sizeof e->err);
    if (r < 0)
        return r;
    int32_t *S = malloc((n + n_gen) * sizeof *S);
    if (!S)
        return fail(e, -ENOMEM, "out of memory");
    memcpy(S, toks, n * sizeof *S);
    int32_t *gen = S + n;
    gen[0] = kvr_wk_argmax(kvr_wk_lm_logits(e->lm), kvr_wk_lm_info_get(e->lm)->n_vocab);
    double t2 = kvr_wk_now_ms();
    t_prefill = t2 - t1;
    double t_first = t2 - t0;
    if ((r = generate(e, gen, n_gen, (int32_t)n)) < 0) {
        free(S);
        return r;
    }
    t_gen = kvr_wk_now_ms() - t2;
    stored st = { .how = "not stored (--no-cache)" };
    size_t ns = n + n_gen - 1;     /* the last token generated was not decoded */
    if (use_cache) {
        double t3 = kvr_wk_now_ms();
        if ((r = store_seq(e, S, ns, "c", false, &st)) < 0) {
            free(S);
            return r;
        }
        t_store = kvr_wk_now_ms() - t3;
    }
    double total = kvr_wk_now_ms() - t0;
    char text[2048];
    text_of(e, gen, n_gen, text, sizeof text);

    kvr_wk_rep_num(R, NULL, "prompt_tokens", (double)n);
    kvr_wk_rep_num(R, NULL, "cached_tokens", (double)cached);
    kvr_wk_rep_num(R, NULL, "reused_tokens", (double)reuse);
    kvr_wk_rep_num(R, NULL, "computed_tokens", (double)(n - reuse));
    kvr_wk_rep_num(R, NULL, "generated_tokens", (double)n_gen);
    kvr_wk_rep_str(R, NULL, "reused_from", reuse ? m.ctx_id : "");
    kvr_wk_rep_str(R, NULL, "stored_in", st.ctx);
    kvr_wk_rep_str(R, NULL, "store", st.how);
    kvr_wk_rep_num(R, NULL, "stored_tokens", (double)st.n_new);
    kvr_wk_rep_tokens(R, "tokens", gen, n_gen);
    kvr_wk_rep_num(R, "timings_ms", "prefault", t_prefault);
    kvr_wk_rep_num(R, "timings_ms", "match", t_match);
    kvr_wk_rep_num(R, "timings_ms", "fetch", t_fetch);
    kvr_wk_rep_num(R, "timings_ms", "load", t_load);
    kvr_wk_rep_num(R, "timings_ms", "prefill", t_prefill);
    kvr_wk_rep_num(R, "timings_ms", "first_token", t_first);
    kvr_wk_rep_num(R, "timings_ms", "generate", t_gen);
    kvr_wk_rep_num(R, "timings_ms", "store", t_store);
    kvr_wk_rep_num(R, "timings_ms", "total", total);
    if (reuse)
        kvr_wk_rep_line(R, "reused: %zu of %zu prompt tokens from kvrope context %s "
                        "(%zu cached)", reuse, n, m.ctx_id, cached);
    else
        kvr_wk_rep_line(R, "reused: nothing (%s)", use_cache ? "no cached prefix" : "--no-cache");
    kvr_wk_rep_line(R, "computed: %zu prompt tokens, then %zu generated", n - reuse, n_gen);
    if (use_cache)
        kvr_wk_rep_line(R, "stored: %zu new tokens, %s %s", st.n_new, st.how, st.ctx);
    kvr_wk_rep_line(R, "timings: match %.2f ms, fetch %.2f ms, load %.2f ms, prefill %.2f ms, "
                    "first token %.2f ms, generate %.2f ms, store %.2f ms, total %.2f ms",
                    t_match, t_fetch, t_load, t_prefill, t_first, t_gen, t_store, total);
    kvr_wk_rep_line(R, "output: %s", text);
    free(S);
    return 0;
}

/* KVR_WK_PHASES=1: each phase's wall/cpu/faults on stderr (diagnostics). */
static void phase(const char *name)
{
    static int on = -1;
    static double w0;
    static struct rusage r0;
    if (on < 0)
        on = getenv("KVR_WK_PHASES") != NULL;
    if (!on)
        return;
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    double w = kvr_wk_now_ms();
    if (name)
        fprintf(stderr, "phase %-10s wall %7.1f ms user %6.1f sys %6.1f minflt %6ld vcsw %5ld ivcsw %5ld\n",
                name, w - w0,
                (double)(r.ru_utime.tv_sec - r0.ru_utime.tv_sec) * 1e3 + (double)(r.ru_utime.tv_usec - r0.ru_utime.tv_usec) / 1e3,
                (double)(r.ru_stime.tv_sec - r0.ru_stime.tv_sec) * 1e3 + (double)(r.ru_stime.tv_usec - r0.ru_stime.tv_usec) / 1e3,
                r.ru_minflt - r0.ru_minflt, r.ru_nvcsw - r0.ru_nvcsw, r.ru_nivcsw - r0.ru_nivcsw);
    w0 = w;
    r0 = r;
}

/* ---- edit --------------------------------------------------------------- */
int kvr_wk_edit(kvr_wk_env *e, const int32_t *a, size_t na, const int32_t *b, size_t nb,
                const kvr_wk_edit_opts *o)
{
    kvr_wk_report *R = e->rep;
    if (na == 0 || nb == 0)
        return fail(e, -EINVAL, "the %s file is empty", na == 0 ? "old" : "new");
    size_t n_gen = e->n_gen > 0 ? (size_t)e->n_gen : 1;
    size_t nv = kvr_wk_lm_info_get(e->lm)->n_vocab;
    int r = kvr_wk_lm_context(e->lm, (uint32_t)((na > nb ? na : nb) + n_gen + 16), e->err,
                              sizeof e->err);
    if (r < 0)
        return r;
    kvr_wk_hunk *hk = NULL;
    kvr_edit_range *ops = NULL;
    int64_t *newpos = NULL, *pos_new = NULL;
    int32_t *gen = NULL, *ref_gen = NULL;
    float *logits = NULL, *ref = NULL;
    void *pl = NULL;
    kvr_kv kv = { 0 };
    kvr_wk_sbuild sb = { 0 };
    seqstate ss = { 0 };
    kvr_edit_res er = { 0 };
    size_t nh = 0;
    void *fbuf = NULL;
    size_t fbuf_cap = 0;

    /* The old file, as an editor's cache would hold it. */
    double t0 = kvr_wk_now_ms(), t_prep_compute = 0;
    stored old;
    size_t old_computed = 0;
    if ((r = ensure_cached(e, a, na, "e", &old, &old_computed, &t_prep_compute)) < 0)
        goto out;
    double t_prepare = kvr_wk_now_ms() - t0;

    double td0 = kvr_wk_now_ms();
    if ((r = kvr_wk_diff(a, na, b, nb, o->max_d ? o->max_d : 2048, &hk, &nh)) < 0) {
        r = fail(e, r, "out of memory in the diff");
        goto out;
    }
    kvr_wk_hunks_merge(hk, &nh, o->min_gap ? o->min_gap : 8);
    double t_diff = kvr_wk_now_ms() - td0;
    size_t n_new = 0, n_removed = 0;
    ops = calloc(nh ? nh : 1, sizeof *ops);
    uint32_t *kref = calloc(nh ? nh : 1, sizeof *kref);
    if (!ops || !kref) {
        free(kref);
        r = fail(e, -ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < nh; i++) {
        ops[i] = (kvr_edit_range){ .start = hk[i].a0, .end = hk[i].a1,
                                   .tokens = (const uint32_t *)b + hk[i].b0,
                                   .n_tokens = hk[i].b1 - hk[i].b0 };
        n_new += hk[i].b1 - hk[i].b0;
        n_removed += hk[i].a1 - hk[i].a0;
        size_t room = (i + 1 < nh ? hk[i + 1].a0 : na) - hk[i].a1;   /* kept old tokens after */
        kref[i] = (uint32_t)(o->refresh < room ? o->refresh : room);
    }

    /* The two buffers a keystroke fills (the fetched KV, received straight
     * into the first; the state handed to llama.cpp), allocated and their
     * pages faulted in now, as a worker that has served an edit before has
     * them: a fresh process's first touch of 128 MiB costs 50 ms to 0.9 s
     * (kernel page faults, slowest on a VM whose freed memory went back to
     * the host). Reported as "prefault", not hidden. */
    double tp0 = kvr_wk_now_ms();
    if (nh > 0) {
        fbuf_cap = payload_bytes(e, na);
        fbuf = malloc(fbuf_cap ? fbuf_cap : 1);
        r = fbuf ? kvr_wk_sbuild_init(&sb, (uint32_t)(nb - n_new), n_layer(e),
                                      kvr_wk_lm_cache_type(e->lm), (uint32_t)n_embd(e),
                                      kvr_wk_lm_v_trans(e->lm)) : -ENOMEM;
        if (r < 0) {
            r = fail(e, r, "out of memory");
            goto out_k;
        }
        prefault(fbuf, fbuf_cap);
        prefault(sb.buf, sb.len);
    }
    double t_prefault = kvr_wk_now_ms() - tp0;

    /* From here on: what an editor's worker does on a keystroke. It holds
     * nothing of its own: everything comes from kvrope. */
    kvr_wk_lm_clear(e->lm);
    phase(NULL);
    double te0 = kvr_wk_now_ms(), t_fetch = 0, t_load = 0, t_decode = 0, t_last = 0,
           t_store = 0, t_kv = 0;
    char ctx[KVR_ID_MAX + 1];
    size_t n_refreshed = 0, n_decoded = 0;
    if (nh == 0) {
        snprintf(ctx, sizeof ctx, "%s", old.ctx);
        if (nb > 1 && (r = load_prefix(e, ctx, nb - 1, &t_fetch, &t_load)) < 0)
            goto out_k;
    } else {
        ctx_name(e, ctx, sizeof ctx, "e", b, nb, NULL, 0);
        if ((r = fork_prefix(e, old.ctx, ctx, na, na)) < 0)
            goto out_k;
        kvr_edit_args ea = { .ctx_id = ctx, .ops = ops, .n_ops = nh, .model = e->model,
                             .fingerprint = e->fingerprint };
        if ((r = kvr_client_edit_plan(e->kc, &ea, &er)) < 0) {
            r = kv_fail(e, r, "edit_plan", ctx);
            goto out_k;
        }
        for (size_t i = 0; i < nh; i++)
            if (er.n_spans != nh || er.spans[i].index != hk[i].b0 ||
                er.spans[i].first_pos != (int64_t)hk[i].b0) {
                r = fail(e, -EINVAL, "context %s does not hold its tokens at positions "
                         "0..%zu", old.ctx, na - 1);
                goto out_k;
            }
        kvr_client_free(er.spans);
        er.spans = NULL;
        /* Where each old token lands (removed ones: anywhere, unused). */
        newpos = malloc(na * sizeof *newpos);
        if (!newpos) {
            r = fail(e, -ENOMEM, "out of memory");
            goto out_k;
        }
        int64_t delta = 0;
        size_t j = 0;
        for (size_t i = 0; i <= nh; i++) {
            size_t end = i < nh ? hk[i].a0 : na;
            for (; j < end; j++)
                newpos[j] = (int64_t)j + delta;
            if (i < nh) {
                for (; j < hk[i].a1; j++)
                    newpos[j] = (int64_t)j;
                delta += (int64_t)(hk[i].b1 - hk[i].b0) - (int64_t)(hk[i].a1 - hk[i].a0);
            }
        }
        phase("plan");
        double tf0 = kvr_wk_now_ms();
        kvr_get_args g = { .ctx_id = old.ctx, .start = 0, .end = na, .dtype = F16,
                           .positions = newpos, .n_positions = na, .dst = fbuf,
                           .dst_cap = fbuf_cap };
        if ((r = kvr_client_get(e->kc, &g, &kv)) < 0) {
            r = kv_fail(e, r, "get", old.ctx);
            goto out_k;
        }
        if ((r = check_kv_shape(e, &kv, old.ctx)) < 0)
            goto out_k;
        phase("fetch");
        double tf1 = kvr_wk_now_ms();
        t_fetch = tf1 - tf0;
        size_t s0 = 0;
        for (size_t i = 0; r == 0 && i <= nh; i++) {
            size_t end = i < nh ? hk[i].a0 : na;
            if (end > s0)
                r = kvr_wk_sbuild_add(&sb, kv.payload, na, s0, end, newpos + s0);
            if (i < nh)
                s0 = hk[i].a1;
        }
        phase("sbuild");
        kvr_kv_release(&kv);
        free(fbuf);
        fbuf = NULL;
        phase("release");
        if (r < 0) {
            r = fail(e, r, "cannot build the edited state");
            goto out_k;
        }
        if ((r = kvr_wk_lm_state_set(e->lm, sb.buf, sb.len, e->err, sizeof e->err)) < 0)
            goto out_k;
        phase("set_data");
        /* Freed now, not after the answer: the store-back's sequence state
         * (seqstate_get, as large) then reuses this memory, already faulted
         * in, instead of touching fresh pages. */
        kvr_wk_sbuild_free(&sb);
        phase("free");
        t_load = kvr_wk_now_ms() - tf1;
        /* Only the new tokens, and K old ones after each edit point. */
        double tc0 = kvr_wk_now_ms();
        for (size_t i = 0; i < nh; i++) {
            size_t cnt = hk[i].b1 - hk[i].b0 + kref[i];
            if (!cnt)
                continue;
            r = kvr_wk_lm_decode_middle(e->lm, b + hk[i].b0, cnt, (int32_t)hk[i].b0, e->err,
                                        sizeof e->err);
            if (r < 0)
                goto out_k;
            n_decoded += cnt;
            n_refreshed += kref[i];
        }
        t_decode = kvr_wk_now_ms() - tc0;
        phase("decode");
    }
    /* The next token needs the last token's logits. */
    bool have = nh > 0 && hk[nh - 1].b1 + kref[nh - 1] == nb &&
                hk[nh - 1].b1 - hk[nh - 1].b0 + kref[nh - 1] > 0;
    if (!have) {
        double tl0 = kvr_wk_now_ms();
        kvr_wk_lm_seq_rm(e->lm, 0, (int32_t)nb - 1, -1);
        r = kvr_wk_lm_decode(e->lm, b + nb - 1, 1, (int32_t)nb - 1, 0, KVR_WK_LOGITS_LAST, NULL,
                             NULL, e->err, sizeof e->err);
        if (r < 0)
            goto out_k;
        t_last = kvr_wk_now_ms() - tl0;
        n_decoded++;
    }
    logits = copy_logits(e);
    gen = calloc(n_gen, sizeof *gen);
    if (!logits || !gen) {
        r = fail(e, -ENOMEM, "out of memory");
        goto out_k;
    }
    gen[0] = kvr_wk_argmax(logits, nv);
    double t_predict = kvr_wk_now_ms() - te0;

    /* The new tokens' KV goes back with the edit, the refreshed ones after. */
    if (nh > 0) {
        double ts0 = kvr_wk_now_ms();
        if ((r = seqstate_get(e, &ss, nb)) < 0)
            goto out_k;
        pos_new = malloc((n_new ? n_new : 1) * sizeof *pos_new);
        if (!pos_new) {
            r = fail(e, -ENOMEM, "out of memory");
            goto out_k;
        }
        size_t k = 0;
        for (size_t i = 0; i < nh; i++)
            for (size_t p = hk[i].b0; p < hk[i].b1; p++)
                pos_new[k++] = (int64_t)p;
        pl = seqstate_payload(e, &ss, pos_new, n_new, 0);
        if (!pl) {
            r = -EINVAL;
            goto out_k;
        }
        t_kv = kvr_wk_now_ms() - ts0;
        kvr_edit_args ea = { .ctx_id = ctx, .ops = ops, .n_ops = nh, .model = e->model,
                             .fingerprint = e->fingerprint, .with_kv = true, .dtype = F16,
                             .payload = pl, .payload_len = payload_bytes(e, n_new) };
        if ((r = kvr_client_edit(e->kc, &ea, &er)) < 0) {
            r = kv_fail(e, r, "edit", ctx);
            goto out_k;
        }
        kvr_client_free(er.spans);
        er.spans = NULL;
        free(pl);
        pl = NULL;
        for (size_t i = 0; i < nh; i++) {
            if (!kref[i])
                continue;
            pl = seqstate_payload(e, &ss, NULL, kref[i], hk[i].b1);
            if (!pl) {
                r = -EINVAL;
                goto out_k;
            }
            kvr_refresh_args ra = { .ctx_id = ctx, .start = hk[i].b1, .end = hk[i].b1 + kref[i],
                                    .model = e->model, .fingerprint = e->fingerprint,
                                    .dtype = F16, .payload = pl,
                                    .payload_len = payload_bytes(e, kref[i]) };
            if ((r = kvr_client_refresh(e->kc, &ra, &er)) < 0) {
                r = kv_fail(e, r, "refresh", ctx);
                goto out_k;
            }
            kvr_client_free(er.spans);
            er.spans = NULL;
            free(pl);
            pl = NULL;
        }
        seqstate_free(&ss);
        t_store = kvr_wk_now_ms() - ts0;
    }
    double t_total = kvr_wk_now_ms() - te0;
    double tg0 = kvr_wk_now_ms();
    if ((r = generate(e, gen, n_gen, (int32_t)nb)) < 0)
        goto out_k;
    double t_gen = kvr_wk_now_ms() - tg0;
    kvr_context info = { 0 };
    if ((r = ctx_len(e, ctx, &info)) < 0)
        goto out_k;

    char text[2048];
    text_of(e, gen, n_gen, text, sizeof text);
    kvr_wk_rep_num(R, NULL, "old_tokens", (double)na);
    kvr_wk_rep_num(R, NULL, "new_tokens", (double)nb);
    kvr_wk_rep_num(R, NULL, "edit_ops", (double)nh);
    kvr_wk_rep_num(R, NULL, "inserted_tokens", (double)n_new);
    kvr_wk_rep_num(R, NULL, "removed_tokens", (double)n_removed);
    kvr_wk_rep_num(R, NULL, "reused_tokens", (double)(nb - n_new - n_refreshed -
                                                      (have || nb == 0 ? 0 : 1)));
    kvr_wk_rep_num(R, NULL, "computed_tokens", (double)n_decoded);
    kvr_wk_rep_num(R, NULL, "refreshed_tokens", (double)n_refreshed);
    kvr_wk_rep_num(R, NULL, "approximate_tokens", (double)info.n_approximate);
    kvr_wk_rep_num(R, NULL, "pending_tokens", (double)info.n_pending);
    kvr_wk_rep_str(R, NULL, "old_context", old.ctx);
    kvr_wk_rep_str(R, NULL, "old_store", old.how);
    kvr_wk_rep_num(R, NULL, "old_computed_tokens", (double)old_computed);
    kvr_wk_rep_str(R, NULL, "context", ctx);
    kvr_wk_rep_tokens(R, "tokens", gen, n_gen);
    kvr_wk_rep_num(R, "timings_ms", "prepare", t_prepare);
    kvr_wk_rep_num(R, "timings_ms", "diff", t_diff);
    kvr_wk_rep_num(R, "timings_ms", "prefault", t_prefault);
    kvr_wk_rep_num(R, "timings_ms", "fetch", t_fetch);
    kvr_wk_rep_num(R, "timings_ms", "load", t_load);
    kvr_wk_rep_num(R, "timings_ms", "decode", t_decode);
    kvr_wk_rep_num(R, "timings_ms", "last_token", t_last);
    kvr_wk_rep_num(R, "timings_ms", "first_token", t_predict);
    kvr_wk_rep_num(R, "timings_ms", "store_kv", t_kv);
    kvr_wk_rep_num(R, "timings_ms", "store", t_store);
    kvr_wk_rep_num(R, "timings_ms", "edit_total", t_total);
    kvr_wk_rep_num(R, "timings_ms", "generate", t_gen);
    kvr_wk_rep_line(R, "old file: %zu tokens in kvrope context %s (%s%s)", na, old.ctx,
                    old.how, old_computed ? ", encoded now" : "");
    if (old_computed)
        kvr_wk_rep_line(R, "  encoded %zu tokens of the old file in %.1f ms", old_computed,
                        t_prep_compute);
    kvr_wk_rep_line(R, "edit: %zu op%s, %zu tokens removed, %zu inserted -> %zu tokens in %s",
                    nh, nh == 1 ? "" : "s", n_removed, n_new, nb, ctx);
    kvr_wk_rep_line(R, "reused: %zu tokens from kvrope (keys re-rotated to their new "
                    "positions)", nb - n_new - n_refreshed - (have ? 0 : 1));
    kvr_wk_rep_line(R, "computed: %zu tokens (%zu new, %zu refreshed after the edit points%s)",
                    n_decoded, n_new, n_refreshed, have ? "" : ", the last one for its logits");
    kvr_wk_rep_line(R, "kvrope: %llu tokens approximate, %llu pending",
                    (unsigned long long)info.n_approximate, (unsigned long long)info.n_pending);
    kvr_wk_rep_line(R, "timings: diff %.2f ms, fetch %.2f ms, load %.2f ms, decode %.2f ms, "
                    "last token %.2f ms, first token %.2f ms, store %.2f ms, edit total %.2f ms, "
                    "generate %.2f ms", t_diff, t_fetch, t_load, t_decode, t_last, t_predict,
                    t_store, t_total, t_gen);
    kvr_wk_rep_line(R, "next: %s", text);
    if (o->check) {
        ref_gen = calloc(n_gen, sizeof *ref_gen);
        double t_full = 0;
        if (!ref_gen) {
            r = fail(e, -ENOMEM, "out of memory");
            goto out_k;
        }
        if ((r = reference(e, b, nb, &ref, ref_gen, n_gen, &t_full)) < 0)
            goto out_k;
        cmp c = compare(logits, ref, nv);
        report_check(e, &c, gen, ref_gen, n_gen, t_full, t_predict, "edit");
    }
    r = 0;
out_k:
    free(kref);
out:
    kvr_kv_release(&kv);
    kvr_wk_sbuild_free(&sb);
    seqstate_free(&ss);
    kvr_client_free(er.spans);
    free(hk);
    free(ops);
    free(newpos);
    free(pos_new);
    free(gen);
    free(ref_gen);
    free(logits);
    free(ref);
    free(pl);
    free(fbuf);
    return r;
}

/* ---- rag ---------------------------------------------------------------- */
int kvr_wk_rag(kvr_wk_env *e, const int32_t *P, size_t np, const int32_t *const *docs,
               const size_t *nd, size_t n_docs, const int32_t *Q, size_t nq, bool parallel,
               bool check)
{
    kvr_wk_report *R = e->rep;
    if (np == 0 || nq == 0)
        return fail(e, -EINVAL, "the %s is empty", np == 0 ? "prefix" : "query");
    if (n_docs == 0)
        return fail(e, -EINVAL, "no documents");
    size_t n_gen = e->n_gen > 0 ? (size_t)e->n_gen : 1;
    size_t nv = kvr_wk_lm_info_get(e->lm)->n_vocab, total = np + nq;
    for (size_t i = 0; i < n_docs; i++) {
        if (nd[i] == 0)
            return fail(e, -EINVAL, "document %zu is empty", i + 1);
        total += nd[i];
    }
    int r = kvr_wk_lm_context(e->lm, (uint32_t)(total + n_gen + 16), e->err, sizeof e->err);
    if (r < 0)
        return r;
    char (*ids)[KVR_ID_MAX + 1] = calloc(n_docs, sizeof *ids);
    const char **idp = calloc(n_docs, sizeof *idp);
    int32_t *full = malloc(total * sizeof *full), *gen = calloc(n_gen, sizeof *gen);
    int32_t *ref_gen = calloc(n_gen, sizeof *ref_gen);
    float *logits = NULL, *ref = NULL;
    kvr_assemble_res ar;
    memset(&ar, 0, sizeof ar);
    kvr_wk_sbuild sb = { 0 };
    if (!ids || !idp || !full || !gen || !ref_gen) {
        r = fail(e, -ENOMEM, "out of memory");
        goto out;
    }
    double t0 = kvr_wk_now_ms(), t_prefix = 0, t_docs = 0, tf = 0, tl = 0;
    /* The prefix, in a context of its own (documents record it). */
    char pctx[KVR_ID_MAX + 1];
    ctx_name(e, pctx, sizeof pctx, "p", P, np, NULL, 0);
    kvr_context info;
    bool prefix_cached = kvr_client_stat(e->kc, pctx, &info) == 0 && info.n_tokens == np &&
                         info.n_approximate == 0;
    bool prefix_in_seq = false;
    size_t computed = 0, docs_cached = 0;
    kvr_wk_lm_clear(e->lm);
    if (!prefix_cached) {
        double tp0 = kvr_wk_now_ms();
        stored st;
        size_t c = 0;
        double tc = 0;
        if ((r = ensure_cached(e, P, np, "p", &st, &c, &tc)) < 0)
            goto out;
        if (strcmp(st.ctx, pctx) != 0) {       /* cached elsewhere: give it its own id */
            kvr_context si;
            if ((r = ctx_len(e, st.ctx, &si)) < 0 ||
                (r = fork_prefix(e, st.ctx, pctx, np, (size_t)si.n_tokens)) < 0)
                goto out;
        }
        computed += c;
        prefix_in_seq = c > 0;
        t_prefix = kvr_wk_now_ms() - tp0;
    }
    /* Each document once, against the prefix. */
    double td0 = kvr_wk_now_ms();
    for (size_t i = 0; i < n_docs; i++) {
        ctx_name(e, ids[i], sizeof ids[i], "d", P, np, docs[i], nd[i]);
        idp[i] = ids[i];
        if (kvr_client_stat(e->kc, ids[i], &info) == 0 && info.n_tokens == nd[i]) {
            docs_cached++;
            continue;
        }
        if (!prefix_in_seq) {
            kvr_wk_lm_clear(e->lm);
            if ((r = load_prefix(e, pctx, np, &tf, &tl)) < 0)
                goto out;
            prefix_in_seq = true;
        }
        kvr_wk_lm_seq_rm(e->lm, 0, (int32_t)np, -1);
        r = kvr_wk_lm_decode(e->lm, docs[i], nd[i], (int32_t)np, 0, KVR_WK_LOGITS_NONE, NULL,
                             NULL, e->err, sizeof e->err);
        if (r < 0)
            goto out;
        computed += nd[i];
        seqstate s;
        if ((r = seqstate_get(e, &s, np + nd[i])) < 0)
            goto out;
        void *pl = seqstate_payload(e, &s, NULL, nd[i], np);
        seqstate_free(&s);
        if (!pl) {
            r = -EINVAL;
            goto out;
        }
        if ((r = del_quiet(e, ids[i])) < 0) {
            free(pl);
            goto out;
        }
        kvr_put_args pa = { .ctx_id = ids[i], .model = e->model, .mode = KVR_PUT_CREATE,
                            .fingerprint = e->fingerprint, .dtype = F16,
                            .tokens = (const uint32_t *)docs[i], .n_tokens = nd[i],
                            .has_pos_start = true, .pos_start = (int64_t)np, .payload = pl,
                            .payload_len = payload_bytes(e, nd[i]), .prefix_ctx = pctx };
        r = kvr_client_put(e->kc, &pa, NULL);
        free(pl);
        if (r < 0) {
            r = kv_fail(e, r, "put", ids[i]);
            goto out;
        }
    }
    t_docs = kvr_wk_now_ms() - td0;
    /* Assemble, load, decode the query on top. */
    double ta0 = kvr_wk_now_ms();
    kvr_assemble_args aa = { .prefix = pctx, .docs = idp, .n_docs = n_docs,
                             .layout = parallel ? KVR_LAYOUT_PARALLEL
                                                : KVR_LAYOUT_SEQUENTIAL,
                             .dtype = F16 };
    if ((r = kvr_client_assemble(e->kc, &aa, &ar)) < 0) {
        r = kv_fail(e, r, "assemble", pctx);
        goto out;
    }
    if ((r = check_kv_shape(e, &ar.kv, pctx)) < 0)
        goto out;
    double ta1 = kvr_wk_now_ms();
    size_t ns = (size_t)ar.kv.n_tokens;
    r = kvr_wk_sbuild_init(&sb, (uint32_t)ns, n_layer(e), kvr_wk_lm_cache_type(e->lm),
                           (uint32_t)n_embd(e), kvr_wk_lm_v_trans(e->lm));
    if (r == 0)
        r = kvr_wk_sbuild_add(&sb, ar.kv.payload, ns, 0, ns, ar.kv.positions);
    if (r < 0) {
        r = fail(e, r, "cannot build the assembled state");
        goto out;
    }
    kvr_wk_lm_clear(e->lm);
    if ((r = kvr_wk_lm_state_set(e->lm, sb.buf, sb.len, e->err, sizeof e->err)) < 0)
        goto out;
    kvr_wk_sbuild_free(&sb);
    double ta2 = kvr_wk_now_ms();
    int64_t qpos = ar.query_pos;
    r = kvr_wk_lm_decode(e->lm, Q, nq, (int32_t)qpos, 0, KVR_WK_LOGITS_LAST, NULL, NULL, e->err,
                         sizeof e->err);
    if (r < 0)
        goto out;
    computed += nq;
    if (!(logits = copy_logits(e))) {
        r = fail(e, -ENOMEM, "out of memory");
        goto out;
    }
    gen[0] = kvr_wk_argmax(logits, nv);
    double ta3 = kvr_wk_now_ms();
    double t_first = ta3 - t0, t_query_path = ta3 - ta0;
    if ((r = generate(e, gen, n_gen, (int32_t)(qpos + (int64_t)nq))) < 0)
        goto out;
    double t_gen = kvr_wk_now_ms() - ta3;

    size_t doc_tokens = 0;
    for (size_t i = 0; i < n_docs; i++)
        doc_tokens += nd[i];
    char text[2048];
    text_of(e, gen, n_gen, text, sizeof text);
    kvr_wk_rep_str(R, NULL, "layout", parallel ? "parallel" : "sequential");
    kvr_wk_rep_num(R, NULL, "prefix_tokens", (double)np);
    kvr_wk_rep_num(R, NULL, "documents", (double)n_docs);
    kvr_wk_rep_num(R, NULL, "document_tokens", (double)doc_tokens);
    kvr_wk_rep_num(R, NULL, "query_tokens", (double)nq);
    kvr_wk_rep_bool(R, NULL, "prefix_cached", prefix_cached);
    kvr_wk_rep_num(R, NULL, "documents_cached", (double)docs_cached);
    kvr_wk_rep_num(R, NULL, "reused_tokens", (double)(np + doc_tokens + nq - computed));
    kvr_wk_rep_num(R, NULL, "computed_tokens", (double)computed);
    kvr_wk_rep_num(R, NULL, "stream_tokens", (double)ns);
    kvr_wk_rep_num(R, NULL, "query_pos", (double)qpos);
    kvr_wk_rep_str(R, NULL, "prefix_context", pctx);
    kvr_wk_rep_tokens(R, "tokens", gen, n_gen);
    kvr_wk_rep_num(R, "timings_ms", "prefix", t_prefix);
    kvr_wk_rep_num(R, "timings_ms", "documents", t_docs);
    kvr_wk_rep_num(R, "timings_ms", "assemble", ta1 - ta0);
    kvr_wk_rep_num(R, "timings_ms", "load", ta2 - ta1);
    kvr_wk_rep_num(R, "timings_ms", "query", ta3 - ta2);
    kvr_wk_rep_num(R, "timings_ms", "first_token", t_first);
    kvr_wk_rep_num(R, "timings_ms", "assemble_to_token", t_query_path);
    kvr_wk_rep_num(R, "timings_ms", "generate", t_gen);
    kvr_wk_rep_line(R, "prefix: %zu tokens in %s (%s)", np, pctx,
                    prefix_cached ? "cached" : "encoded now");
    kvr_wk_rep_line(R, "documents: %zu (%zu tokens), %zu cached, %zu encoded against the "
                    "prefix now", n_docs, doc_tokens, docs_cached, n_docs - docs_cached);
    kvr_wk_rep_line(R, "assembled: %zu tokens, %s layout, query at position %lld "
                    "(llama.cpp attends plainly: APE's temperature %.2f and scale %.2f are "
                    "not applied)", ns, parallel ? "parallel" : "sequential", (long long)qpos,
                    ar.temperature, ar.scale);
    kvr_wk_rep_line(R, "reused: %zu tokens; computed: %zu (query %zu)",
                    np + doc_tokens + nq - computed, computed, nq);
    kvr_wk_rep_line(R, "timings: prefix %.2f ms, documents %.2f ms, assemble %.2f ms, load "
                    "%.2f ms, query %.2f ms, first token %.2f ms, generate %.2f ms",
                    t_prefix, t_docs, ta1 - ta0, ta2 - ta1, ta3 - ta2, t_first, t_gen);
    kvr_wk_rep_line(R, "next: %s", text);
    if (check) {
        size_t o = 0;
        memcpy(full, P, np * sizeof *full);
        o = np;
        for (size_t i = 0; i < n_docs; i++) {
            memcpy(full + o, docs[i], nd[i] * sizeof *full);
            o += nd[i];
        }
        memcpy(full + o, Q, nq * sizeof *full);
        double t_full = 0;
        if ((r = reference(e, full, total, &ref, ref_gen, n_gen, &t_full)) < 0)
            goto out;
        cmp c = compare(logits, ref, nv);
        report_check(e, &c, gen, ref_gen, n_gen, t_full, t_query_path, "assemble + query");
    }
    r = 0;
out:
    kvr_assemble_release(&ar);
    kvr_wk_sbuild_free(&sb);
    free(ids);
    free(idp);
    free(full);
    free(gen);
    free(ref_gen);
    free(logits);
    free(ref);
    return r;
}

/* ---- ppl ---------------------------------------------------------------- */
typedef struct ppl_acc {
    const int32_t *toks;
    size_t         start, end, nv;
    double         nll;
    size_t         count;
} ppl_acc;

static void ppl_rows(void *ud, size_t first, size_t n, const float *const *rows)
{
    ppl_acc *a = ud;
    for (size_t j = 0; j < n; j++) {
        size_t t = a->start + first + j;
        if (t + 1 >= a->end)
            continue;
        const float *x = rows[j];
        double mx = (double)x[0];
        for (size_t i = 1; i < a->nv; i++)
            if ((double)x[i] > mx)
                mx = (double)x[i];
        double s = 0;
        for (size_t i = 0; i < a->nv; i++)
            s += exp((double)x[i] - mx);
        a->nll += mx + log(s) - (double)x[a->toks[t + 1]];
        a->count++;
    }
}

int kvr_wk_ppl(kvr_wk_env *e, const int32_t *toks, size_t n, size_t n_bytes, bool bos)
{
    (void)bos;
    kvr_wk_report *R = e->rep;
    if (n < 2)
        return fail(e, -EINVAL, "the file is too short to score (%zu tokens)", n);
    const kvr_wk_lm_info *in = kvr_wk_lm_info_get(e->lm);
    size_t W = in->n_ctx_train && in->n_ctx_train < 1024 ? in->n_ctx_train : 1024;
    if (W < 16)
        W = 16;
    int r = kvr_wk_lm_context(e->lm, (uint32_t)W, e->err, sizeof e->err);
    if (r < 0)
        return r;
    double t0 = kvr_wk_now_ms();
    ppl_acc acc = { .toks = toks, .nv = in->n_vocab };
    size_t windows = 0;
    for (size_t s = 0; s + 1 < n;) {
        size_t end = s + W < n ? s + W : n;
        acc.start = s;
        acc.end = end;
        kvr_wk_lm_clear(e->lm);
        r = kvr_wk_lm_decode(e->lm, toks + s, end - s, 0, 0, KVR_WK_LOGITS_ALL, ppl_rows, &acc,
                             e->err, sizeof e->err);
        if (r < 0)
            return r;
        windows++;
        s = end - 1;
    }
    /* Bytes scored: those of every predicted token. */
    size_t bytes = 0;
    char piece[256];
    for (size_t i = 1; i < n; i++)
        bytes += kvr_wk_lm_piece(e->lm, toks[i], piece, sizeof piece);
    if (bytes == 0)
        return fail(e, -EINVAL, "the predicted tokens have no bytes");
    double t = kvr_wk_now_ms() - t0;
    double bpb = acc.nll / log(2.0) / (double)bytes;
    double ppl = exp(acc.nll / (double)(acc.count ? acc.count : 1));
    kvr_wk_rep_num(R, NULL, "tokens", (double)n);
    kvr_wk_rep_num(R, NULL, "predicted_tokens", (double)acc.count);
    kvr_wk_rep_num(R, NULL, "bytes", (double)bytes);
    kvr_wk_rep_num(R, NULL, "file_bytes", (double)n_bytes);
    kvr_wk_rep_num(R, NULL, "windows", (double)windows);
    kvr_wk_rep_num(R, NULL, "window_tokens", (double)W);
    kvr_wk_rep_num(R, NULL, "bits_per_byte", bpb);
    kvr_wk_rep_num(R, NULL, "perplexity", ppl);
    kvr_wk_rep_num(R, "timings_ms", "total", t);
    kvr_wk_rep_line(R, "scored: %zu tokens (%zu bytes) in %zu window%s of %zu, %.1f ms",
                    acc.count, bytes, windows, windows == 1 ? "" : "s", W, t);
    kvr_wk_rep_line(R, "perplexity: %.3f per token", ppl);
    kvr_wk_rep_line(R, "bits/byte: %.3f", bpb);
    return 0;
}
