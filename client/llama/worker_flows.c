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

typedef struct stored {
    char   ctx[KVR_ID_MAX + 1];
    size_t n_new;            /* tokens sent */
    size_t n_reused;         /* tokens already there */
    const char *how;         /* "cached", "appended", "forked+appended", "created" */
} stored;

/* Makes kvrope hold S[0..ns) (the tokens whose cells seq 0 holds at 0..ns-1):
 * only what is not cached yet is sent. exact: the result context holds S and
 * nothing more. kind names a created context. */
static int store_seq(kvr__wk_env *e, const int32_t *S, size_t ns, const char *kind, bool exact,
                     stored *out)
{
    memset(out, 0, sizeof *out);
    kvr_match_res m;
    kvr_match_args ma = { .model = e->model, .tokens = (const uint32_t *)S, .n_tokens = ns };
    int r = kvr_client_match(e->kc, &ma, &m);
    if (r < 0)
        return kvr__wk_kv_fail(e, r, "match", NULL);
    size_t L = (size_t)m.length;
    kvr_context info = { 0 };
    if (L > 0 && (r = kvr__wk_ctx_len(e, m.ctx_id, &info)) < 0)
        return r;
    char mine[KVR_ID_MAX + 1];
    kvr__wk_ctx_name(e, mine, sizeof mine, kind, S, ns, NULL, 0);
    out->n_reused = L;
    if (L >= ns) {
        if (!exact || info.n_tokens == ns) {
            snprintf(out->ctx, sizeof out->ctx, "%s", m.ctx_id);
            out->how = "cached";
            return 0;
        }
        if ((r = kvr__wk_fork_prefix(e, m.ctx_id, mine, ns, (size_t)info.n_tokens)) < 0)
            return r;
        snprintf(out->ctx, sizeof out->ctx, "%s", mine);
        out->how = "forked";
        return 0;
    }
    kvr__wk_seqstate s;
    if ((r = kvr__wk_seqstate_get(e, &s, ns)) < 0)
        return r;
    /* Cells in position order (the usual case: loaded, then decoded at the
     * end) go through the bridge's import straight from the state bytes;
     * others are gathered by position here. */
    bool in_order = s.st.n_cells == ns;
    for (size_t p = L; in_order && p < ns; p++)
        in_order = s.cell[p] == (long)p;
    void *pl = NULL;
    if (!in_order && !(pl = kvr__wk_seqstate_payload(e, &s, NULL, ns - L, L))) {
        kvr__wk_seqstate_free(&s);
        return KVR_EINVAL;
    }
    kvr_put_mode mode = KVR_PUT_APPEND;
    if (L > 0 && info.n_tokens == L && info.pos_max == (int64_t)L - 1 &&
        strncmp(m.ctx_id, "kvl-c-", 6) == 0) {
        snprintf(out->ctx, sizeof out->ctx, "%s", m.ctx_id);
        out->how = "appended";
    } else if (L > 0) {
        if ((r = kvr__wk_fork_prefix(e, m.ctx_id, mine, L, (size_t)info.n_tokens)) < 0) {
            free(pl);
            kvr__wk_seqstate_free(&s);
            return r;
        }
        snprintf(out->ctx, sizeof out->ctx, "%s", mine);
        out->how = "forked+appended";
    } else {
        if ((r = kvr__wk_del_quiet(e, mine)) < 0) {
            free(pl);
            kvr__wk_seqstate_free(&s);
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
        kvr__wk_seqstate_free(&s);
        if (r < 0) {
            e->kv_code = r;
            return kvr__wk_fail(e, r, "storing %zu tokens into %s: %s", ns - L, out->ctx, err);
        }
        out->n_new = ns - L;
        return 0;
    }
    kvr__wk_seqstate_free(&s);
    kvr_put_args p = { .ctx_id = out->ctx, .model = e->model, .mode = mode,
                       .fingerprint = e->fingerprint, .dtype = F16,
                       .tokens = (const uint32_t *)S + L, .n_tokens = ns - L,
                       .has_pos_start = true, .pos_start = (int64_t)L, .payload = pl,
                       .payload_len = kvr__wk_payload_bytes(e, ns - L),
                       .v_trans = kvr__wk_lm_v_trans(e->lm) };
    r = kvr_client_put(e->kc, &p, NULL);
    free(pl);
    if (r < 0)
        return kvr__wk_kv_fail(e, r, "put", out->ctx);
    out->n_new = ns - L;
    return 0;
}

/* kvrope holds exactly toks[0..n) somewhere (computing what is missing);
 * seq 0 is left holding them when anything had to be computed. */
static int ensure_cached(kvr__wk_env *e, const int32_t *toks, size_t n, const char *kind,
                         stored *st, size_t *computed, double *t_compute)
{
    kvr_match_res m;
    kvr_match_args ma = { .model = e->model, .tokens = (const uint32_t *)toks, .n_tokens = n };
    int r = kvr_client_match(e->kc, &ma, &m);
    if (r < 0)
        return kvr__wk_kv_fail(e, r, "match", NULL);
    *computed = 0;
    if (m.length < n) {
        double t0 = kvr__wk_now_ms(), tf = 0, tl = 0;
        size_t reuse = (size_t)m.length;
        kvr__wk_lm_clear(e->lm);
        if (reuse > 0 && (r = kvr__wk_load_prefix(e, m.ctx_id, reuse, &tf, &tl)) < 0)
            return r;
        r = kvr__wk_lm_decode(e->lm, toks + reuse, n - reuse, (int32_t)reuse, 0,
                             KVR_WK_LOGITS_NONE, NULL, NULL, e->err, sizeof e->err);
        if (r < 0)
            return r;
        *computed = n - reuse;
        *t_compute = kvr__wk_now_ms() - t0;
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
    cmp c = { kvr__wk_argmax(got, n) == kvr__wk_argmax(ref, n), 0, 0, 0 };
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

static void text_of(kvr__wk_env *e, const int32_t *t, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    char buf[4 * 1024];
    for (size_t i = 0; i < n && o + 64 < sizeof buf; i++)
        o += kvr__wk_lm_piece(e->lm, t[i], buf + o, sizeof buf - o);
    kvr__wk_quote(buf, o, out, cap);
}

/* Greedy: gen[0] is already chosen from the logits; decodes gen[i-1] at
 * pos0 + i - 1 for i in 1..n. */
static int generate(kvr__wk_env *e, int32_t *gen, size_t n, int32_t pos0)
{
    size_t nv = kvr__wk_lm_info_get(e->lm)->n_vocab;
    for (size_t i = 1; i < n; i++) {
        int r = kvr__wk_lm_decode(e->lm, &gen[i - 1], 1, pos0 + (int32_t)i - 1, 0,
                                 KVR_WK_LOGITS_LAST, NULL, NULL, e->err, sizeof e->err);
        if (r < 0)
            return r;
        gen[i] = kvr__wk_argmax(kvr__wk_lm_logits(e->lm), nv);
    }
    return 0;
}

static float *copy_logits(kvr__wk_env *e)
{
    size_t nv = kvr__wk_lm_info_get(e->lm)->n_vocab;
    const float *l = kvr__wk_lm_logits(e->lm);
    float *c = l ? malloc(nv * sizeof *c) : NULL;
    if (c)
        memcpy(c, l, nv * sizeof *c);
    return c;
}

/* Full re-encode of toks from an empty cache: reference logits of the last
 * token, then n greedy tokens. */
static int reference(kvr__wk_env *e, const int32_t *toks, size_t n, float **logits,
                     int32_t *gen, size_t n_gen, double *t_ms)
{
    double t0 = kvr__wk_now_ms();
    kvr__wk_lm_clear(e->lm);
    int r = kvr__wk_lm_decode(e->lm, toks, n, 0, 0, KVR_WK_LOGITS_LAST, NULL, NULL, e->err,
                             sizeof e->err);
    if (r < 0)
        return r;
    *t_ms = kvr__wk_now_ms() - t0;
    if (!(*logits = copy_logits(e)))
        return kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
    if (n_gen) {
        gen[0] = kvr__wk_argmax(*logits, kvr__wk_lm_info_get(e->lm)->n_vocab);
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

static void report_check(kvr__wk_env *e, const cmp *c, const int32_t *gen,
                         const int32_t *ref_gen, size_t n_gen, double t_full, double t_path,
                         const char *path)
{
    kvr__wk_report *R = e->rep;
    size_t agree_gen = same_prefix(gen, ref_gen, n_gen);
    kvr__wk_rep_bool(R, "check", "next_token_agrees", c->agree);
    kvr__wk_rep_num(R, "check", "logit_max_abs_err", c->max_abs);
    kvr__wk_rep_num(R, "check", "logit_rms_err", c->rms);
    kvr__wk_rep_num(R, "check", "logit_rms", c->ref_rms);
    kvr__wk_rep_num(R, "check", "generated_agree", (double)agree_gen);
    kvr__wk_rep_num(R, "check", "full_ms", t_full);
    kvr__wk_rep_num(R, "check", "speedup", t_path > 0 ? t_full / t_path : (double)NAN);
    kvr__wk_rep_line(R, "check: full re-encode %.1f ms (%s %.1fx faster); next token %s; "
                    "logit error max %.4g, rms %.4g (logit rms %.4g); %zu of %zu generated "
                    "tokens agree", t_full, path, t_path > 0 ? t_full / t_path : 0,
                    c->agree ? "agrees" : "DIFFERS", c->max_abs, c->rms, c->ref_rms, agree_gen,
                    n_gen);
}

/* --check: the full re-encode of toks (its logits into *ref, its greedy
 * continuation into ref_gen) against what the cached path gave (logits,
 * gen, in t_path ms), reported as `path`. */
static int check_reference(kvr__wk_env *e, const int32_t *toks, size_t n, float **ref,
                           const float *logits, size_t nv, const int32_t *gen, int32_t *ref_gen,
                           size_t n_gen, double t_path, const char *path)
{
    double t_full = 0;
    int r = reference(e, toks, n, ref, ref_gen, n_gen, &t_full);
    if (r < 0)
        return r;
    cmp c = compare(logits, *ref, nv);
    report_check(e, &c, gen, ref_gen, n_gen, t_full, t_path, path);
    return 0;
}

/* ---- complete ----------------------------------------------------------- */
int kvr__wk_complete(kvr__wk_env *e, const int32_t *toks, size_t n, bool use_cache)
{
    kvr__wk_report *R = e->rep;
    if (n == 0)
        return kvr__wk_fail(e, KVR_EINVAL, "the prompt is empty");
    size_t n_gen = e->n_gen > 0 ? (size_t)e->n_gen : 1;
    int r = kvr__wk_lm_context(e->lm, (uint32_t)(n + n_gen + 16), e->err, sizeof e->err);
    if (r < 0)
        return r;
    double tp0 = kvr__wk_now_ms();
    if (use_cache && n > 1)
        kvr__wk_prefault_bufs(e, n - 1);
    double t_prefault = kvr__wk_now_ms() - tp0;
    double t0 = kvr__wk_now_ms(), t_match = 0, t_fetch = 0, t_load = 0, t_prefill, t_gen,
           t_store = 0;
    kvr_match_res m = { 0 };
    if (use_cache) {
        kvr_match_args ma = { .model = e->model, .tokens = (const uint32_t *)toks,
                              .n_tokens = n };
        if ((r = kvr_client_match(e->kc, &ma, &m)) < 0)
            return kvr__wk_kv_fail(e, r, "match", NULL);
        t_match = kvr__wk_now_ms() - t0;
    }
    size_t cached = (size_t)m.length, reuse = cached < n ? cached : n - 1;
    if (reuse > 0 && (r = kvr__wk_load_prefix(e, m.ctx_id, reuse, &t_fetch, &t_load)) < 0)
        return r;
    double t1 = kvr__wk_now_ms();
    r = kvr__wk_lm_decode(e->lm, toks + reuse, n - reuse, (int32_t)reuse, 0, KVR_WK_LOGITS_LAST,
                         NULL, NULL, e->err, sizeof e->err);
    if (r < 0)
        return r;
    int32_t *S = malloc((n + n_gen) * sizeof *S);
    if (!S)
        return kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
    memcpy(S, toks, n * sizeof *S);
    int32_t *gen = S + n;
    gen[0] = kvr__wk_argmax(kvr__wk_lm_logits(e->lm), kvr__wk_lm_info_get(e->lm)->n_vocab);
    double t2 = kvr__wk_now_ms();
    t_prefill = t2 - t1;
    double t_first = t2 - t0;
    if ((r = generate(e, gen, n_gen, (int32_t)n)) < 0) {
        free(S);
        return r;
    }
    t_gen = kvr__wk_now_ms() - t2;
    stored st = { .how = "not stored (--no-cache)" };
    size_t ns = n + n_gen - 1;     /* the last token generated was not decoded */
    if (use_cache) {
        double t3 = kvr__wk_now_ms();
        if ((r = store_seq(e, S, ns, "c", false, &st)) < 0) {
            free(S);
            return r;
        }
        t_store = kvr__wk_now_ms() - t3;
    }
    double total = kvr__wk_now_ms() - t0;
    char text[2048];
    text_of(e, gen, n_gen, text, sizeof text);

    kvr__wk_rep_num(R, NULL, "prompt_tokens", (double)n);
    kvr__wk_rep_num(R, NULL, "cached_tokens", (double)cached);
    kvr__wk_rep_num(R, NULL, "reused_tokens", (double)reuse);
    kvr__wk_rep_num(R, NULL, "computed_tokens", (double)(n - reuse));
    kvr__wk_rep_num(R, NULL, "generated_tokens", (double)n_gen);
    kvr__wk_rep_str(R, NULL, "reused_from", reuse ? m.ctx_id : "");
    kvr__wk_rep_str(R, NULL, "stored_in", st.ctx);
    kvr__wk_rep_str(R, NULL, "store", st.how);
    kvr__wk_rep_num(R, NULL, "stored_tokens", (double)st.n_new);
    kvr__wk_rep_tokens(R, "tokens", gen, n_gen);
    const kvr__wk_rep_kv tm[] = {
        { "prefault", t_prefault }, { "match", t_match }, { "fetch", t_fetch },
        { "load", t_load }, { "prefill", t_prefill }, { "first_token", t_first },
        { "generate", t_gen }, { "store", t_store }, { "total", total },
    };
    kvr__wk_rep_nums(R, "timings_ms", tm, sizeof tm / sizeof tm[0]);
    if (reuse)
        kvr__wk_rep_line(R, "reused: %zu of %zu prompt tokens from kvrope context %s "
                        "(%zu cached)", reuse, n, m.ctx_id, cached);
    else
        kvr__wk_rep_line(R, "reused: nothing (%s)", use_cache ? "no cached prefix" : "--no-cache");
    kvr__wk_rep_line(R, "computed: %zu prompt tokens, then %zu generated", n - reuse, n_gen);
    if (use_cache)
        kvr__wk_rep_line(R, "stored: %zu new tokens, %s %s", st.n_new, st.how, st.ctx);
    kvr__wk_rep_line(R, "timings: match %.2f ms, fetch %.2f ms, load %.2f ms, prefill %.2f ms, "
                    "first token %.2f ms, generate %.2f ms, store %.2f ms, total %.2f ms",
                    t_match, t_fetch, t_load, t_prefill, t_first, t_gen, t_store, total);
    kvr__wk_rep_line(R, "output: %s", text);
    free(S);
    return 0;
}


/* ---- edit --------------------------------------------------------------- */
static const char *commit_how(const kvr__wk_sync_res *r, const char *session)
{
    if (!r->source[0])
        return "created";
    return strcmp(r->source, session) ? "forked" : "edited";
}

int kvr__wk_edit(kvr__wk_env *e, const int32_t *a, size_t na, const int32_t *b, size_t nb,
                const kvr__wk_edit_opts *o)
{
    kvr__wk_report *R = e->rep;
    if ((a && na == 0) || nb == 0)
        return kvr__wk_fail(e, KVR_EINVAL, "the %s file is empty", nb == 0 ? "new" : "old");
    if (!o->session || !o->session[0])
        return kvr__wk_fail(e, KVR_EINVAL, "edit needs a session id");
    size_t n_gen = e->n_gen > 0 ? (size_t)e->n_gen : 1;
    size_t nv = kvr__wk_lm_info_get(e->lm)->n_vocab;
    int r = kvr__wk_lm_context(e->lm, (uint32_t)((na > nb ? na : nb) + n_gen + 16), e->err,
                              sizeof e->err);
    if (r < 0)
        return r;
    int32_t *gen = NULL, *ref_gen = NULL;
    float *logits = NULL, *ref = NULL;
    kvr__wk_step *st = NULL;
    kvr__wk_sync_opts so = { .session = o->session, .refresh = o->refresh,
                            .max_age = o->max_age, .max_d = o->max_d, .min_gap = o->min_gap };

    /* The session: the file's context, moved forward by every edit. When
     * kvrope has none yet, the old file starts it (encoded once, or from
     * any cached prefix). */
    double t0 = kvr__wk_now_ms(), t_prep_compute = 0;
    kvr_context info = { 0 };
    const char *old_how = "cached";
    size_t old_computed = 0;
    r = kvr_client_stat(e->kc, o->session, &info);
    if (r == KVR_ENOCTX) {
        if (!a) {
            r = kvr__wk_fail(e, KVR_ENOCTX, "no session %s in kvrope yet: give the file's "
                            "previous version with --old to start it", o->session);
            e->kv_code = KVR_ENOCTX;
            goto out;
        }
        kvr__wk_sync_res pr;
        if ((r = kvr__wk_sync(e, a, na, &so, &st, &pr)) < 0 || (r = kvr__wk_commit(e, st)) < 0)
            goto out;
        kvr__wk_step_free(st);
        st = NULL;
        old_computed = pr.n_computed;
        t_prep_compute = pr.t_decode_ms;
        old_how = commit_how(&pr, o->session);
        if (!strcmp(old_how, "edited"))
            old_how = "cached";
    } else if (r < 0) {
        r = kvr__wk_kv_fail(e, r, "stat", o->session);
        goto out;
    }
    double t_prepare = kvr__wk_now_ms() - t0;
    /* The buffers a keystroke fills (the fetched KV, the state handed to
     * llama.cpp), allocated and faulted in now, as a worker that has served
     * an edit before holds them (reported as "prefault", not hidden). */
    double tp0 = kvr__wk_now_ms();
    kvr__wk_prefault_bufs(e, na > nb ? na : nb);
    double t_prefault = kvr__wk_now_ms() - tp0;

    /* From here on: what an editor's worker does on a keystroke. */
    kvr__wk_sync_res sr;
    double te0 = kvr__wk_now_ms();
    if ((r = kvr__wk_sync(e, b, nb, &so, &st, &sr)) < 0)
        goto out;
    logits = malloc(nv * sizeof *logits);
    gen = calloc(n_gen, sizeof *gen);
    if (!logits || !gen) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    memcpy(logits, kvr__wk_lm_logits(e->lm), nv * sizeof *logits);
    gen[0] = kvr__wk_argmax(logits, nv);
    double t_predict = kvr__wk_now_ms() - te0;
    double ts0 = kvr__wk_now_ms();
    if ((r = kvr__wk_commit(e, st)) < 0)
        goto out;
    double t_store = kvr__wk_now_ms() - ts0;
    size_t n_bg = 0;
    double t_bg = 0;
    if (o->refresh_all) {
        /* What a server does when idle: everything approximate, re-encoded. */
        double tb0 = kvr__wk_now_ms();
        if ((r = kvr__wk_refresh_idle(e, o->session, SIZE_MAX, SIZE_MAX, &n_bg)) < 0)
            goto out;
        t_bg = kvr__wk_now_ms() - tb0;
        /* Seq 0 holds the refreshed file: the next token from it. */
        kvr__wk_lm_seq_rm(e->lm, 0, (int32_t)nb - 1, -1);
        if ((r = kvr__wk_lm_decode(e->lm, b + nb - 1, 1, (int32_t)nb - 1, 0, KVR_WK_LOGITS_LAST,
                                  NULL, NULL, e->err, sizeof e->err)) < 0)
            goto out;
        memcpy(logits, kvr__wk_lm_logits(e->lm), nv * sizeof *logits);
        gen[0] = kvr__wk_argmax(logits, nv);
    }
    double t_total = kvr__wk_now_ms() - te0;
    double tg0 = kvr__wk_now_ms();
    if ((r = generate(e, gen, n_gen, (int32_t)nb)) < 0)
        goto out;
    double t_gen = kvr__wk_now_ms() - tg0;
    if ((r = kvr__wk_ctx_len(e, o->session, &info)) < 0)
        goto out;

    size_t n_new = 0, n_removed = 0;
    if (st) {
        n_new = kvr__wk_step_new_tokens(st);
        n_removed = kvr__wk_step_removed_tokens(st);
    }
    char text[2048];
    text_of(e, gen, n_gen, text, sizeof text);
    kvr__wk_rep_num(R, NULL, "old_tokens", (double)na);
    kvr__wk_rep_num(R, NULL, "new_tokens", (double)nb);
    kvr__wk_rep_num(R, NULL, "edit_ops", (double)sr.n_ops);
    kvr__wk_rep_num(R, NULL, "inserted_tokens", (double)n_new);
    kvr__wk_rep_num(R, NULL, "removed_tokens", (double)n_removed);
    kvr__wk_rep_num(R, NULL, "reused_tokens", (double)sr.n_reused);
    kvr__wk_rep_num(R, NULL, "computed_tokens", (double)sr.n_computed);
    kvr__wk_rep_num(R, NULL, "refreshed_tokens", (double)sr.n_refreshed);
    kvr__wk_rep_num(R, NULL, "background_refreshed_tokens", (double)n_bg);
    kvr__wk_rep_num(R, NULL, "approximate_tokens", (double)info.n_approximate);
    kvr__wk_rep_num(R, NULL, "pending_tokens", (double)info.n_pending);
    kvr__wk_rep_str(R, NULL, "session", o->session);
    kvr__wk_rep_str(R, NULL, "source", sr.source);
    kvr__wk_rep_str(R, NULL, "old_store", old_how);
    kvr__wk_rep_num(R, NULL, "old_computed_tokens", (double)old_computed);
    kvr__wk_rep_str(R, NULL, "context", o->session);
    kvr__wk_rep_str(R, NULL, "store", commit_how(&sr, o->session));
    kvr__wk_rep_tokens(R, "tokens", gen, n_gen);
    const kvr__wk_rep_kv tm[] = {
        { "prepare", t_prepare }, { "prefault", t_prefault }, { "match", sr.t_match_ms },
        { "fetch", sr.t_fetch_ms }, { "load", sr.t_load_ms }, { "decode", sr.t_decode_ms },
        { "first_token", t_predict }, { "store", t_store }, { "background_refresh", t_bg },
        { "edit_total", t_total }, { "generate", t_gen },
    };
    kvr__wk_rep_nums(R, "timings_ms", tm, sizeof tm / sizeof tm[0]);
    if (a)
        kvr__wk_rep_line(R, "old file: %zu tokens; session %s (%s%s)", na, o->session, old_how,
                        old_computed ? ", encoded now" : "");
    if (old_computed)
        kvr__wk_rep_line(R, "  encoded %zu tokens of the old file in %.1f ms", old_computed,
                        t_prep_compute);
    kvr__wk_rep_line(R, "edit: %zu op%s, %zu tokens removed, %zu inserted -> %zu tokens in %s",
                    sr.n_ops, sr.n_ops == 1 ? "" : "s", n_removed, n_new, nb, o->session);
    kvr__wk_rep_line(R, "reused: %zu tokens from kvrope (keys re-rotated to their new "
                    "positions)", sr.n_reused);
    kvr__wk_rep_line(R, "computed: %zu tokens (%zu new, %zu refreshed: after the edit points, "
                    "by age, and the last token)", sr.n_computed, n_new, sr.n_refreshed);
    if (o->refresh_all)
        kvr__wk_rep_line(R, "background refresh: %zu tokens in %.2f ms", n_bg, t_bg);
    kvr__wk_rep_line(R, "kvrope: %llu tokens approximate, %llu pending",
                    (unsigned long long)info.n_approximate, (unsigned long long)info.n_pending);
    kvr__wk_rep_line(R, "timings: fetch %.2f ms, load %.2f ms, decode %.2f ms, first token "
                    "%.2f ms, store %.2f ms, edit total %.2f ms, generate %.2f ms",
                    sr.t_fetch_ms, sr.t_load_ms, sr.t_decode_ms, t_predict, t_store, t_total,
                    t_gen);
    kvr__wk_rep_line(R, "next: %s", text);
    if (o->check) {
        ref_gen = calloc(n_gen, sizeof *ref_gen);
        if (!ref_gen) {
            r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
            goto out;
        }
        if ((r = check_reference(e, b, nb, &ref, logits, nv, gen, ref_gen, n_gen, t_predict,
                                 "edit")) < 0)
            goto out;
    }
    r = 0;
out:
    kvr__wk_step_free(st);
    free(gen);
    free(ref_gen);
    free(logits);
    free(ref);
    return r;
}

/* ---- refresh (the CLI's background refresh of a session) ---------------- */
int kvr__wk_refresh_cmd(kvr__wk_env *e, const char *session, size_t budget, size_t cursor)
{
    kvr_context info;
    int r = kvr_client_stat(e->kc, session, &info);
    if (r < 0)
        return kvr__wk_kv_fail(e, r, "stat", session);
    if ((r = kvr__wk_lm_context(e->lm, (uint32_t)info.n_tokens + 16, e->err,
                               sizeof e->err)) < 0)
        return r;
    size_t before = (size_t)info.n_approximate, done = 0;
    double t0 = kvr__wk_now_ms();
    if ((r = kvr__wk_refresh_idle(e, session, budget, cursor, &done)) < 0)
        return r;
    double t = kvr__wk_now_ms() - t0;
    if ((r = kvr__wk_ctx_len(e, session, &info)) < 0)
        return r;
    kvr__wk_rep_str(e->rep, NULL, "session", session);
    kvr__wk_rep_num(e->rep, NULL, "tokens", (double)info.n_tokens);
    kvr__wk_rep_num(e->rep, NULL, "approximate_before", (double)before);
    kvr__wk_rep_num(e->rep, NULL, "refreshed_tokens", (double)done);
    kvr__wk_rep_num(e->rep, NULL, "approximate_tokens", (double)info.n_approximate);
    kvr__wk_rep_num(e->rep, "timings_ms", "refresh", t);
    kvr__wk_rep_line(e->rep, "session %s: %zu of %zu approximate tokens re-encoded in %.1f ms, "
                    "%llu left", session, done, before, t,
                    (unsigned long long)info.n_approximate);
    return 0;
}

/* ---- rag ---------------------------------------------------------------- */
int kvr__wk_rag(kvr__wk_env *e, const int32_t *P, size_t np, const int32_t *const *docs,
               const size_t *nd, size_t n_docs, const int32_t *Q, size_t nq, bool parallel,
               bool check)
{
    kvr__wk_report *R = e->rep;
    if (np == 0 || nq == 0)
        return kvr__wk_fail(e, KVR_EINVAL, "the %s is empty", np == 0 ? "prefix" : "query");
    if (n_docs == 0)
        return kvr__wk_fail(e, KVR_EINVAL, "no documents");
    size_t n_gen = e->n_gen > 0 ? (size_t)e->n_gen : 1;
    size_t nv = kvr__wk_lm_info_get(e->lm)->n_vocab, total = np + nq;
    for (size_t i = 0; i < n_docs; i++) {
        if (nd[i] == 0)
            return kvr__wk_fail(e, KVR_EINVAL, "document %zu is empty", i + 1);
        total += nd[i];
    }
    int r = kvr__wk_lm_context(e->lm, (uint32_t)(total + n_gen + 16), e->err, sizeof e->err);
    if (r < 0)
        return r;
    char (*ids)[KVR_ID_MAX + 1] = calloc(n_docs, sizeof *ids);
    const char **idp = calloc(n_docs, sizeof *idp);
    int32_t *full = malloc(total * sizeof *full), *gen = calloc(n_gen, sizeof *gen);
    int32_t *ref_gen = calloc(n_gen, sizeof *ref_gen);
    float *logits = NULL, *ref = NULL;
    kvr_assemble_res ar;
    memset(&ar, 0, sizeof ar);
    kvr__wk_sbuild sb = { 0 };
    if (!ids || !idp || !full || !gen || !ref_gen) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    double t0 = kvr__wk_now_ms(), t_prefix = 0, t_docs = 0, tf = 0, tl = 0;
    /* The prefix, in a context of its own (documents record it). */
    char pctx[KVR_ID_MAX + 1];
    kvr__wk_ctx_name(e, pctx, sizeof pctx, "p", P, np, NULL, 0);
    kvr_context info;
    bool prefix_cached = kvr_client_stat(e->kc, pctx, &info) == 0 && info.n_tokens == np &&
                         info.n_approximate == 0;
    bool prefix_in_seq = false;
    size_t computed = 0, docs_cached = 0;
    kvr__wk_lm_clear(e->lm);
    if (!prefix_cached) {
        double tp0 = kvr__wk_now_ms();
        stored st;
        size_t c = 0;
        double tc = 0;
        if ((r = ensure_cached(e, P, np, "p", &st, &c, &tc)) < 0)
            goto out;
        if (strcmp(st.ctx, pctx) != 0) {       /* cached elsewhere: give it its own id */
            kvr_context si;
            if ((r = kvr__wk_ctx_len(e, st.ctx, &si)) < 0 ||
                (r = kvr__wk_fork_prefix(e, st.ctx, pctx, np, (size_t)si.n_tokens)) < 0)
                goto out;
        }
        computed += c;
        prefix_in_seq = c > 0;
        t_prefix = kvr__wk_now_ms() - tp0;
    }
    /* Each document once, against the prefix. */
    double td0 = kvr__wk_now_ms();
    for (size_t i = 0; i < n_docs; i++) {
        kvr__wk_ctx_name(e, ids[i], sizeof ids[i], "d", P, np, docs[i], nd[i]);
        idp[i] = ids[i];
        if (kvr_client_stat(e->kc, ids[i], &info) == 0 && info.n_tokens == nd[i]) {
            docs_cached++;
            continue;
        }
        if (!prefix_in_seq) {
            kvr__wk_lm_clear(e->lm);
            if ((r = kvr__wk_load_prefix(e, pctx, np, &tf, &tl)) < 0)
                goto out;
            prefix_in_seq = true;
        }
        kvr__wk_lm_seq_rm(e->lm, 0, (int32_t)np, -1);
        r = kvr__wk_lm_decode(e->lm, docs[i], nd[i], (int32_t)np, 0, KVR_WK_LOGITS_NONE, NULL,
                             NULL, e->err, sizeof e->err);
        if (r < 0)
            goto out;
        computed += nd[i];
        kvr__wk_seqstate s;
        if ((r = kvr__wk_seqstate_get(e, &s, np + nd[i])) < 0)
            goto out;
        void *pl = kvr__wk_seqstate_payload(e, &s, NULL, nd[i], np);
        kvr__wk_seqstate_free(&s);
        if (!pl) {
            r = KVR_EINVAL;
            goto out;
        }
        if ((r = kvr__wk_del_quiet(e, ids[i])) < 0) {
            free(pl);
            goto out;
        }
        kvr_put_args pa = { .ctx_id = ids[i], .model = e->model, .mode = KVR_PUT_CREATE,
                            .fingerprint = e->fingerprint, .dtype = F16,
                            .tokens = (const uint32_t *)docs[i], .n_tokens = nd[i],
                            .has_pos_start = true, .pos_start = (int64_t)np, .payload = pl,
                            .payload_len = kvr__wk_payload_bytes(e, nd[i]), .prefix_ctx = pctx,
                            .v_trans = kvr__wk_lm_v_trans(e->lm) };
        r = kvr_client_put(e->kc, &pa, NULL);
        free(pl);
        if (r < 0) {
            r = kvr__wk_kv_fail(e, r, "put", ids[i]);
            goto out;
        }
    }
    t_docs = kvr__wk_now_ms() - td0;
    /* Assemble, load, decode the query on top. */
    double ta0 = kvr__wk_now_ms();
    kvr_assemble_args aa = { .prefix = pctx, .docs = idp, .n_docs = n_docs,
                             .layout = parallel ? KVR_LAYOUT_PARALLEL
                                                : KVR_LAYOUT_SEQUENTIAL,
                             .dtype = F16 };
    if ((r = kvr_client_assemble(e->kc, &aa, &ar)) < 0) {
        r = kvr__wk_kv_fail(e, r, "assemble", pctx);
        goto out;
    }
    if ((r = kvr__wk_check_kv_shape(e, &ar.kv, pctx)) < 0)
        goto out;
    double ta1 = kvr__wk_now_ms();
    size_t ns = (size_t)ar.kv.n_tokens;
    r = kvr__wk_sbuild_init(&sb, (uint32_t)ns, kvr__wk_n_layer(e), kvr__wk_lm_cache_type(e->lm),
                           (uint32_t)kvr__wk_n_embd(e), kvr__wk_lm_v_trans(e->lm));
    if (r == 0)
        r = kvr__wk_sbuild_add(&sb, ar.kv.payload, ns, 0, ns, ar.kv.positions);
    if (r < 0) {
        r = kvr__wk_fail(e, r, "cannot build the assembled state");
        goto out;
    }
    kvr__wk_lm_clear(e->lm);
    if ((r = kvr__wk_lm_state_set(e->lm, sb.buf, sb.len, e->err, sizeof e->err)) < 0)
        goto out;
    kvr__wk_sbuild_free(&sb);
    double ta2 = kvr__wk_now_ms();
    int64_t qpos = ar.query_pos;
    r = kvr__wk_lm_decode(e->lm, Q, nq, (int32_t)qpos, 0, KVR_WK_LOGITS_LAST, NULL, NULL, e->err,
                         sizeof e->err);
    if (r < 0)
        goto out;
    computed += nq;
    if (!(logits = copy_logits(e))) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    gen[0] = kvr__wk_argmax(logits, nv);
    double ta3 = kvr__wk_now_ms();
    double t_first = ta3 - t0, t_query_path = ta3 - ta0;
    if ((r = generate(e, gen, n_gen, (int32_t)(qpos + (int64_t)nq))) < 0)
        goto out;
    double t_gen = kvr__wk_now_ms() - ta3;

    size_t doc_tokens = 0;
    for (size_t i = 0; i < n_docs; i++)
        doc_tokens += nd[i];
    char text[2048];
    text_of(e, gen, n_gen, text, sizeof text);
    kvr__wk_rep_str(R, NULL, "layout", parallel ? "parallel" : "sequential");
    kvr__wk_rep_num(R, NULL, "prefix_tokens", (double)np);
    kvr__wk_rep_num(R, NULL, "documents", (double)n_docs);
    kvr__wk_rep_num(R, NULL, "document_tokens", (double)doc_tokens);
    kvr__wk_rep_num(R, NULL, "query_tokens", (double)nq);
    kvr__wk_rep_bool(R, NULL, "prefix_cached", prefix_cached);
    kvr__wk_rep_num(R, NULL, "documents_cached", (double)docs_cached);
    kvr__wk_rep_num(R, NULL, "reused_tokens", (double)(np + doc_tokens + nq - computed));
    kvr__wk_rep_num(R, NULL, "computed_tokens", (double)computed);
    kvr__wk_rep_num(R, NULL, "stream_tokens", (double)ns);
    kvr__wk_rep_num(R, NULL, "query_pos", (double)qpos);
    kvr__wk_rep_str(R, NULL, "prefix_context", pctx);
    kvr__wk_rep_tokens(R, "tokens", gen, n_gen);
    const kvr__wk_rep_kv tm[] = {
        { "prefix", t_prefix }, { "documents", t_docs }, { "assemble", ta1 - ta0 },
        { "load", ta2 - ta1 }, { "query", ta3 - ta2 }, { "first_token", t_first },
        { "assemble_to_token", t_query_path }, { "generate", t_gen },
    };
    kvr__wk_rep_nums(R, "timings_ms", tm, sizeof tm / sizeof tm[0]);
    kvr__wk_rep_line(R, "prefix: %zu tokens in %s (%s)", np, pctx,
                    prefix_cached ? "cached" : "encoded now");
    kvr__wk_rep_line(R, "documents: %zu (%zu tokens), %zu cached, %zu encoded against the "
                    "prefix now", n_docs, doc_tokens, docs_cached, n_docs - docs_cached);
    kvr__wk_rep_line(R, "assembled: %zu tokens, %s layout, query at position %lld "
                    "(llama.cpp attends plainly: APE's temperature %.2f and scale %.2f are "
                    "not applied)", ns, parallel ? "parallel" : "sequential", (long long)qpos,
                    ar.temperature, ar.scale);
    kvr__wk_rep_line(R, "reused: %zu tokens; computed: %zu (query %zu)",
                    np + doc_tokens + nq - computed, computed, nq);
    kvr__wk_rep_line(R, "timings: prefix %.2f ms, documents %.2f ms, assemble %.2f ms, load "
                    "%.2f ms, query %.2f ms, first token %.2f ms, generate %.2f ms",
                    t_prefix, t_docs, ta1 - ta0, ta2 - ta1, ta3 - ta2, t_first, t_gen);
    kvr__wk_rep_line(R, "next: %s", text);
    if (check) {
        size_t o = 0;
        memcpy(full, P, np * sizeof *full);
        o = np;
        for (size_t i = 0; i < n_docs; i++) {
            memcpy(full + o, docs[i], nd[i] * sizeof *full);
            o += nd[i];
        }
        memcpy(full + o, Q, nq * sizeof *full);
        if ((r = check_reference(e, full, total, &ref, logits, nv, gen, ref_gen, n_gen,
                                 t_query_path, "assemble + query")) < 0)
            goto out;
    }
    r = 0;
out:
    kvr_assemble_release(&ar);
    kvr__wk_sbuild_free(&sb);
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
        a->nll += kvr__wk_nll(rows[j], a->nv, a->toks[t + 1]);
        a->count++;
    }
}

int kvr__wk_ppl(kvr__wk_env *e, const int32_t *toks, size_t n, size_t n_bytes, bool bos)
{
    (void)bos;
    kvr__wk_report *R = e->rep;
    if (n < 2)
        return kvr__wk_fail(e, KVR_EINVAL, "the file is too short to score (%zu tokens)", n);
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e->lm);
    size_t W = in->n_ctx_train && in->n_ctx_train < 1024 ? in->n_ctx_train : 1024;
    if (W < 16)
        W = 16;
    int r = kvr__wk_lm_context(e->lm, (uint32_t)W, e->err, sizeof e->err);
    if (r < 0)
        return r;
    double t0 = kvr__wk_now_ms();
    ppl_acc acc = { .toks = toks, .nv = in->n_vocab };
    size_t windows = 0;
    for (size_t s = 0; s + 1 < n;) {
        size_t end = s + W < n ? s + W : n;
        acc.start = s;
        acc.end = end;
        kvr__wk_lm_clear(e->lm);
        r = kvr__wk_lm_decode(e->lm, toks + s, end - s, 0, 0, KVR_WK_LOGITS_ALL, ppl_rows, &acc,
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
        bytes += kvr__wk_lm_piece(e->lm, toks[i], piece, sizeof piece);
    if (bytes == 0)
        return kvr__wk_fail(e, KVR_EINVAL, "the predicted tokens have no bytes");
    double t = kvr__wk_now_ms() - t0;
    double bpb = acc.nll / log(2.0) / (double)bytes;
    double ppl = exp(acc.nll / (double)(acc.count ? acc.count : 1));
    kvr__wk_rep_num(R, NULL, "tokens", (double)n);
    kvr__wk_rep_num(R, NULL, "predicted_tokens", (double)acc.count);
    kvr__wk_rep_num(R, NULL, "bytes", (double)bytes);
    kvr__wk_rep_num(R, NULL, "file_bytes", (double)n_bytes);
    kvr__wk_rep_num(R, NULL, "windows", (double)windows);
    kvr__wk_rep_num(R, NULL, "window_tokens", (double)W);
    kvr__wk_rep_num(R, NULL, "bits_per_byte", bpb);
    kvr__wk_rep_num(R, NULL, "perplexity", ppl);
    kvr__wk_rep_num(R, "timings_ms", "total", t);
    kvr__wk_rep_line(R, "scored: %zu tokens (%zu bytes) in %zu window%s of %zu, %.1f ms",
                    acc.count, bytes, windows, windows == 1 ? "" : "s", W, t);
    kvr__wk_rep_line(R, "perplexity: %.3f per token", ppl);
    kvr__wk_rep_line(R, "bits/byte: %.3f", bpb);
    return 0;
}
