/*
 * worker_session.c — the session engine: one kvrope context follows one
 * buffer (a file, an editor buffer, a server slot) edit after edit. The
 * CLI's edit / refresh commands and kvrope serve go through it.
 *
 * A step is sync then commit:
 *  sync    chooses the source of the prompt's KV: the session's own context
 *          (diffed against the prompt into PIE ops: kept tokens, approximate
 *          ones too, come back with their keys re-rotated to their new
 *          places) or, when the session is missing or shares less, the
 *          longest exact cached prefix of any context of the model. It loads
 *          that into seq 0 and decodes the rest: new tokens, the `refresh`
 *          tokens after each edit point, every kept token the policy says
 *          is too old (age > max_age edits), and the last token (for its
 *          logits). Runs are decoded in increasing position, so a run sees
 *          the runs before it already recomputed. When both leave at least
 *          KVR_COVER_MIN_RUN tokens to compute and the env has the cover
 *          verb, the daemon's cover of the prompt (cached runs anywhere,
 *          keys re-rotated to their place) is the third candidate: its runs
 *          are loaded, the gaps and the repair set decoded (reuse anywhere,
 *          worker_repair.c).
 *  commit  moves the session's context to the prompt:
 *            EDIT    (the source was the session) one atomic edit with the
 *                    new tokens' KV, then a refresh per recomputed run; both
 *                    compare-and-swap on the token sequence they were planned
 *                    against (KVR_EBUSY if another writer got there first);
 *            FORK    (the source was another context) the session is
 *                    replaced by a fork of the source's prefix, then the
 *                    rest appended;
 *            CREATE  (no source) put REPLACE of the whole prompt;
 *            COVER   (the daemon's cover placed cached runs anywhere in the
 *                    prompt, seams repaired: kvr__wk_repair) put REPLACE of
 *                    the exact part, then the rest as one insert flagged
 *                    approximate, so the stored context says what it is.
 *
 * Invariants:
 *  - A step never deletes, forks over or edits a context it read from,
 *    except the session itself, which it edits in place (atomically, CAS).
 *  - Session contexts hold their tokens at positions 0..n-1 (edits keep
 *    that: new tokens land at their index, the suffix shifts with them); a
 *    session that does not (written by someone else), or has tokens without
 *    KV, is not read: the step replaces it.
 *  - Without a session id, the target is named by the prompt's content
 *    ("kvl-s-<hash>"), so the same prompt lands in the same place.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/llama/kvrope_llama.h"
#include "client/llama/worker.h"

#define F16 KVR_DTYPE_F16

typedef enum { COMMIT_EDIT, COMMIT_FORK, COMMIT_CREATE, COMMIT_COVER } commit_kind;

typedef struct run {
    size_t s, e;            /* [s, e) in prompt coordinates */
} run;

struct kvr__wk_step {
    commit_kind  kind;
    char         target[KVR_ID_MAX + 1];
    char         source[KVR_ID_MAX + 1];
    int32_t     *b;         /* the prompt (owned) */
    size_t       nb;
    /* EDIT: the session's sequence planned against, the hunks (a: session
     * coordinates, b: prompt), and the recomputed runs of old tokens. */
    size_t       na;
    uint64_t     a_hash;
    kvr__wk_hunk *hk;
    size_t       nh;
    run         *rf;
    size_t       nrf;
    uint8_t     *rx;        /* per prompt token: 0 loaded, 1 computed exact,
                               2 computed against approximate tokens */
    /* FORK: tokens [0, L) of the source (of length src_len) are reused. */
    size_t       L, src_len;
    /* COVER: seq 0's KV is exact before apx_from, approximate from there
     * (placed tokens not repaired, and everything computed after them). */
    size_t       apx_from;
};

void kvr__wk_step_free(kvr__wk_step *st)
{
    if (!st)
        return;
    free(st->b);
    free(st->hk);
    free(st->rf);
    free(st->rx);
    free(st);
}

size_t kvr__wk_step_new_tokens(const kvr__wk_step *st)
{
    size_t n = 0;
    if (st && st->kind == COMMIT_EDIT)
        for (size_t i = 0; i < st->nh; i++)
            n += st->hk[i].b1 - st->hk[i].b0;
    else if (st)
        n = st->nb - (st->kind == COMMIT_FORK ? st->L : 0);
    return n;
}

size_t kvr__wk_step_removed_tokens(const kvr__wk_step *st)
{
    size_t n = 0;
    if (st && st->kind == COMMIT_EDIT)
        for (size_t i = 0; i < st->nh; i++)
            n += st->hk[i].a1 - st->hk[i].a0;
    return n;
}

static uint64_t seq_hash(const int32_t *t, size_t n)
{
    return kvr_tokens_hash(KVR_TOKENS_HASH_INIT, (const uint32_t *)t, n);
}

/* The session's current sequence (meta only). ok false: missing, or not a
 * session this engine can read (another model, positions not 0..n-1, tokens
 * without KV). */
typedef struct sess {
    bool      ok, exists;
    kvr_kv    meta;
} sess;

static int sess_read(kvr__wk_env *e, const char *id, sess *s)
{
    memset(s, 0, sizeof *s);
    kvr_get_args g = { .ctx_id = id, .start = 0, .end = 0, .dtype = F16, .meta_only = true };
    int r = kvr_client_get(e->kc, &g, &s->meta);
    if (r == KVR_ENOCTX)
        return 0;
    if (r == KVR_EPENDING) {      /* a token without KV: not readable, replaced */
        s->exists = true;
        return 0;
    }
    if (r < 0)
        return kvr__wk_kv_fail(e, r, "get (meta)", id);
    s->exists = true;
    s->ok = strcmp(s->meta.model, e->model) == 0 && s->meta.n_tokens > 0;
    for (size_t i = 0; s->ok && i < s->meta.n_tokens; i++)
        s->ok = s->meta.positions[i] == (int64_t)i &&
                !(s->meta.flags[i] & KVR_TOKEN_PENDING);
    return 0;
}

/* Marks [s, e) of a bitmap of n entries. */
static void mark(uint8_t *m, size_t n, size_t s, size_t e)
{
    for (size_t i = s; i < e && i < n; i++)
        m[i] = 1;
}

/* Runs of marked entries, in increasing order (*out the caller's). */
static int runs_of(const uint8_t *m, size_t n, run **out, size_t *nr)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (m[i] && (i == 0 || !m[i - 1]))
            k++;
    run *r = malloc((k ? k : 1) * sizeof *r);
    if (!r)
        return KVR_ENOMEM;
    k = 0;
    for (size_t i = 0; i < n;) {
        if (!m[i]) {
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && m[j])
            j++;
        r[k++] = (run){ i, j };
        i = j;
    }
    *out = r;
    *nr = k;
    return 0;
}

/* Decodes the runs into seq 0, in increasing order, and says which came out
 * exact: apx[i] (n entries) is 1 where seq 0's KV at i is approximate or not
 * there yet (tokens still to be decoded). A run is exact when everything
 * before it is (the frontier f, the first approximate index, is at or after
 * its start); then the frontier moves past it. rx[i] of each decoded token:
 * 1 exact, 2 computed against approximate tokens. */
static int decode_runs(kvr__wk_env *e, const int32_t *b, const run *rs, size_t nr,
                       uint8_t *apx, uint8_t *rx, size_t n, size_t *n_dec)
{
    size_t f = 0;
    while (f < n && !apx[f])
        f++;
    for (size_t i = 0; i < nr; i++) {
        int r = kvr__wk_lm_decode_middle(e->lm, b + rs[i].s, rs[i].e - rs[i].s,
                                        (int32_t)rs[i].s, e->err, sizeof e->err);
        if (r < 0)
            return r;
        bool exact = rs[i].s <= f;
        for (size_t k = rs[i].s; k < rs[i].e; k++) {
            apx[k] = !exact;
            rx[k] = exact ? 1 : 2;
        }
        while (f < n && !apx[f])
            f++;
        *n_dec += rs[i].e - rs[i].s;
    }
    return 0;
}

static int lm_fits(kvr__wk_env *e, size_t n)
{
    uint32_t cap = kvr__wk_lm_n_ctx(e->lm);
    if (n >= cap)
        return kvr__wk_fail(e, -E2BIG, "a prompt of %zu tokens does not fit the context "
                           "of %u cells", n, cap);
    return 0;
}

/* The prompt computed whole (no usable cache). */
static int sync_full(kvr__wk_env *e, const int32_t *b, size_t nb, kvr__wk_sync_res *res)
{
    kvr__wk_lm_clear(e->lm);
    double t0 = kvr__wk_now_ms();
    int r = kvr__wk_lm_decode(e->lm, b, nb, 0, 0, KVR_WK_LOGITS_LAST, NULL, NULL, e->err,
                             sizeof e->err);
    res->t_decode_ms += kvr__wk_now_ms() - t0;
    res->n_computed = nb;
    return r;
}

/* Source = the session (edit path). hunks: session -> prompt. */
static int sync_edit(kvr__wk_env *e, const sess *ss, const int32_t *b, size_t nb,
                     kvr__wk_hunk *hk, size_t nh, const kvr__wk_sync_opts *o,
                     kvr__wk_step *st, kvr__wk_sync_res *res)
{
    const kvr_kv *A = &ss->meta;
    size_t na = (size_t)A->n_tokens;
    uint32_t max_age = o->max_age ? o->max_age : KVR_WK_MAX_AGE;
    int r;
    uint8_t *comp = calloc(nb, 1);          /* tokens decoded in this step */
    uint8_t *isnew = calloc(nb, 1);
    int64_t *newpos = malloc(na * sizeof *newpos);
    uint8_t *kept = calloc(na, 1);
    uint8_t *apx = calloc(nb, 1);           /* seq 0's KV approximate (or absent) */
    uint8_t *rx = calloc(nb, 1);
    void *fbuf = NULL;
    kvr_kv kv = { 0 };
    kvr__wk_sbuild sb = { 0 };
    run *rs = NULL;
    size_t nr = 0;
    if (!comp || !isnew || !newpos || !kept || !apx || !rx) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    /* Where each old token lands (kept: not inside a hunk); what is new;
     * what the policy recomputes. */
    size_t n_new = 0, first_b = nh ? hk[0].b0 : nb;
    int64_t delta = 0;
    size_t j = 0;
    for (size_t i = 0; i <= nh; i++) {
        size_t end = i < nh ? hk[i].a0 : na;
        for (; j < end; j++) {
            size_t at = (size_t)((int64_t)j + delta);
            newpos[j] = (int64_t)at;
            kept[j] = 1;
            uint32_t f = A->flags[j];
            uint32_t age = KVR_TOKEN_AGE(f) + (at >= first_b ? 1u : 0u);
            bool approx = (f & KVR_TOKEN_APPROX) || at >= first_b;
            apx[at] = approx;
            if (approx && age > max_age)
                comp[at] = 1;
        }
        if (i < nh) {
            for (; j < hk[i].a1; j++)
                newpos[j] = (int64_t)j;      /* removed: fetched, unused */
            mark(comp, nb, hk[i].b0, hk[i].b1);
            mark(isnew, nb, hk[i].b0, hk[i].b1);
            mark(apx, nb, hk[i].b0, hk[i].b1);       /* not there yet */
            size_t room = (i + 1 < nh ? hk[i + 1].b0 : nb) - hk[i].b1;
            mark(comp, nb, hk[i].b1, hk[i].b1 + (o->refresh < room ? o->refresh : room));
            n_new += hk[i].b1 - hk[i].b0;
            delta += (int64_t)(hk[i].b1 - hk[i].b0) - (int64_t)(hk[i].a1 - hk[i].a0);
        }
    }
    bool last_extra = !comp[nb - 1];
    comp[nb - 1] = 1;                           /* the last token's logits */
    if ((r = runs_of(comp, nb, &rs, &nr)) < 0) {
        r = kvr__wk_fail(e, r, "out of memory");
        goto out;
    }

    /* Kept tokens: fetched re-rotated to their new positions, loaded. The
     * fetch and the state go through the env's warm buffers (allocated and
     * faulted in once, reused by every step of a long-lived worker). */
    size_t n_keep = nb - n_new;
    kvr__wk_lm_clear(e->lm);
    if (n_keep > 0) {
        double t0 = kvr__wk_now_ms();
        size_t cap = kvr__wk_payload_bytes(e, na);
        kvr__wk_prefault_bufs(e, na > n_keep ? na : n_keep);
        void *dst = e->pf_fetch_cap >= cap ? e->pf_fetch : (fbuf = malloc(cap ? cap : 1));
        if (!dst) {
            r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
            goto out;
        }
        kvr_get_args g = { .ctx_id = st->target, .start = 0, .end = na, .dtype = F16,
                           .positions = newpos, .n_positions = na, .dst = dst,
                           .dst_cap = cap };
        if ((r = kvr_client_get(e->kc, &g, &kv)) < 0) {
            r = kvr__wk_kv_fail(e, r, "get", st->target);
            goto out;
        }
        if ((r = kvr__wk_check_kv_shape(e, &kv, st->target)) < 0)
            goto out;
        double t1 = kvr__wk_now_ms();
        res->t_fetch_ms += t1 - t0;
        r = kvr__wk_sbuild_init_in(&sb, e->pf_state, e->pf_state_cap, (uint32_t)n_keep,
                                  kvr__wk_n_layer(e), kvr__wk_lm_cache_type(e->lm),
                                  (uint32_t)kvr__wk_n_embd(e), kvr__wk_lm_v_trans(e->lm));
        if (r < 0) {
            r = kvr__wk_fail(e, r, "out of memory");
            goto out;
        }
        size_t s0 = 0;
        for (size_t i = 0; r == 0 && i <= nh; i++) {
            size_t end = i < nh ? hk[i].a0 : na;
            if (end > s0)
                r = kvr__wk_sbuild_add(&sb, kv.payload, na, s0, end, newpos + s0);
            if (i < nh)
                s0 = hk[i].a1;
        }
        if (r < 0) {
            r = kvr__wk_fail(e, r, "cannot build the state of %zu kept tokens", n_keep);
            goto out;
        }
        kvr_kv_release(&kv);
        if ((r = kvr__wk_lm_state_set(e->lm, sb.buf, sb.len, e->err, sizeof e->err)) < 0)
            goto out;
        res->t_load_ms += kvr__wk_now_ms() - t1;
    }
    double td = kvr__wk_now_ms();
    size_t n_dec = 0;
    if ((r = decode_runs(e, b, rs, nr, apx, rx, nb, &n_dec)) < 0)
        goto out;
    res->t_decode_ms += kvr__wk_now_ms() - td;

    /* Counts; what commit refreshes: recomputed old tokens, but not exact
     * ones before the first edit point (their KV did not change). */
    size_t n_approx = 0;
    for (size_t i = 0; i < nb; i++) {
        n_approx += apx[i];
        if (isnew[i])
            comp[i] = 0;
    }
    for (size_t jj = 0; jj < na; jj++) {
        if (!kept[jj])
            continue;
        size_t at = (size_t)newpos[jj];
        bool approx = (A->flags[jj] & KVR_TOKEN_APPROX) || at >= first_b;
        if (comp[at] && !approx && rx[at] == 1)
            comp[at] = 0;                      /* recomputed, unchanged: not stored */
    }
    free(rs);
    rs = NULL;
    if ((r = runs_of(comp, nb, &rs, &nr)) < 0) {
        r = kvr__wk_fail(e, r, "out of memory");
        goto out;
    }
    st->rx = rx;
    rx = NULL;
    st->rf = rs;
    st->nrf = nr;
    rs = NULL;
    st->hk = hk;
    st->nh = nh;
    st->na = na;
    st->a_hash = seq_hash((const int32_t *)A->tokens, na);
    res->n_ops = nh;
    res->n_reused = n_keep - (n_dec - n_new);
    res->n_computed = n_dec;
    res->n_refreshed = n_dec - n_new - (last_extra ? 1 : 0);
    res->n_approx = n_approx;
    r = 0;
out:
    free(comp);
    free(isnew);
    free(newpos);
    free(kept);
    free(apx);
    free(rx);
    free(fbuf);
    free(rs);
    kvr_kv_release(&kv);
    kvr__wk_sbuild_free(&sb);
    return r;
}

/* Source = the daemon's cover (runs anywhere, re-rotated), when it places
 * at least KVR_COVER_MIN_RUN tokens more than `best` (what the other paths
 * reuse). Returns 1 when taken (seq 0 holds the prompt, st set up for
 * COMMIT_COVER), 0 when not (nothing changed; a daemon without the verb
 * answers so), or an error. */
static int sync_cover(kvr__wk_env *e, const int32_t *toks, size_t n, size_t best,
                      const kvr__wk_sync_opts *o, kvr__wk_step *st, kvr__wk_sync_res *res)
{
    double t0 = kvr__wk_now_ms();
    kvr_cover_args ca = { .model = e->model, .tokens = (const uint32_t *)toks, .n_tokens = n,
                          .dtype = F16 };
    kvr_cover_res cr;
    memset(&cr, 0, sizeof cr);
    if (e->cover.cover(e->kc, &ca, &cr) < 0)
        return 0;
    size_t covered = (size_t)cr.n_covered;
    e->cover.release(&cr);
    memset(&cr, 0, sizeof cr);
    if (covered < best + KVR_COVER_MIN_RUN || covered > n)
        return 0;
    kvr__wk_prefault_bufs(e, n);
    if (e->pf_fetch_cap >= kvr__wk_payload_bytes(e, n)) {
        ca.dst = e->pf_fetch;
        ca.dst_cap = e->pf_fetch_cap;
    }
    int r = e->cover.cover_get(e->kc, &ca, &cr);
    if (r < 0)
        return kvr__wk_kv_fail(e, r, "cover get", NULL);
    res->t_fetch_ms += kvr__wk_now_ms() - t0;
    kvr__wk_repair_opts ro_ = o->repair ? *o->repair
                                       : (kvr__wk_repair_opts){ .first_k = KVR_WK_REPAIR_DEFAULT_K };
    /* blend's selection pass holds the prompt twice in the cache: without
     * the room (or a probing context) the seams get EPIC's part alone */
    if (ro_.blend_share > 0 && (!kvr__wk_lm_probe_on(e->lm) || 2 * n + 1 > kvr__wk_lm_n_ctx(e->lm)))
        ro_.blend_share = 0;
    const kvr__wk_repair_opts *ro = &ro_;
    uint8_t *placed = calloc(n, 1), *starts = calloc(n, 1), *cmp = calloc(n, 1);
    kvr__wk_sbuild sb = { 0 };
    covered = (size_t)cr.n_covered;
    if (!placed || !starts || !cmp) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    if (!cr.has_kv || cr.kv.n_tokens != covered || covered == 0 || covered > n) {
        r = kvr__wk_fail(e, KVR_EINVAL, "the daemon's cover holds %llu tokens of K/V for %zu "
                        "covered", (unsigned long long)(cr.has_kv ? cr.kv.n_tokens : 0), covered);
        goto out;
    }
    if ((r = kvr__wk_check_kv_shape(e, &cr.kv, "(cover)")) < 0)
        goto out;
    for (size_t i = 0; i < cr.n_runs; i++) {
        const kvr_cover_run *u = &cr.runs[i];
        if (u->prompt_off + u->n_tokens > n || u->stream_off + u->n_tokens > covered) {
            r = kvr__wk_fail(e, KVR_EINVAL, "the daemon's cover run %zu lies outside the prompt", i);
            goto out;
        }
        for (size_t t = 0; t < u->n_tokens; t++) {
            size_t at = (size_t)u->prompt_off + t, so = (size_t)u->stream_off + t;
            if (placed[at] || cr.kv.tokens[so] != (uint32_t)toks[at] ||
                cr.kv.positions[so] != (int64_t)at) {
                r = kvr__wk_fail(e, KVR_EINVAL, "the daemon's cover does not match the prompt at "
                                "token %zu", at);
                goto out;
            }
            placed[at] = u->exact && !(cr.kv.flags[so] & KVR_TOKEN_APPROX) ? KVR_WK_PLACED_EXACT
                                                                           : KVR_WK_PLACED;
        }
        starts[u->prompt_off] = 1;
    }
    double t1 = kvr__wk_now_ms();
    r = kvr__wk_sbuild_init_in(&sb, e->pf_state, e->pf_state_cap, (uint32_t)covered,
                              kvr__wk_n_layer(e), kvr__wk_lm_cache_type(e->lm),
                              (uint32_t)kvr__wk_n_embd(e), kvr__wk_lm_v_trans(e->lm));
    if (r == 0)
        r = kvr__wk_sbuild_add(&sb, cr.kv.payload, covered, 0, covered, cr.kv.positions);
    if (r < 0) {
        r = kvr__wk_fail(e, r, "cannot build the state of %zu placed tokens", covered);
        goto out;
    }
    kvr__wk_lm_clear(e->lm);
    if ((r = kvr__wk_lm_state_set(e->lm, sb.buf, sb.len, e->err, sizeof e->err)) < 0)
        goto out;
    res->t_load_ms += kvr__wk_now_ms() - t1;
    kvr__wk_repair_res rr;
    if ((r = kvr__wk_repair(e->lm, toks, n, placed, starts, ro, cmp, &rr, e->err,
                           sizeof e->err)) < 0)
        goto out;
    res->t_decode_ms += rr.t_probe_ms + rr.t_decode_ms;
    size_t f = 0;
    while (f < n && !(placed[f] == KVR_WK_PLACED && !cmp[f]))
        f++;
    st->kind = COMMIT_COVER;
    st->apx_from = f;
    snprintf(st->source, sizeof st->source, "cover");
    snprintf(res->source, sizeof res->source, "cover");
    res->n_computed = rr.n_computed;
    res->n_reused = n - rr.n_computed;
    res->n_placed = covered;
    res->n_repaired = rr.n_repaired;
    res->n_runs = cr.n_runs;
    res->n_approx = n - f;
    r = 1;
out:
    e->cover.release(&cr);
    kvr__wk_sbuild_free(&sb);
    free(placed);
    free(starts);
    free(cmp);
    return r;
}

int kvr__wk_sync(kvr__wk_env *e, const int32_t *toks, size_t n, const kvr__wk_sync_opts *o,
                kvr__wk_step **step, kvr__wk_sync_res *res)
{
    static const kvr__wk_sync_opts none = { 0 };
    if (!o)
        o = &none;
    *step = NULL;
    memset(res, 0, sizeof *res);
    res->n_prompt = n;
    if (n == 0)
        return kvr__wk_fail(e, KVR_EINVAL, "an empty prompt");
    int r = lm_fits(e, n);
    if (r < 0)
        return r;
    double t0 = kvr__wk_now_ms();
    if (o->no_cache || !e->kc) {
        r = sync_full(e, toks, n, res);
        res->t_total_ms = kvr__wk_now_ms() - t0;
        return r;
    }
    kvr__wk_step *st = calloc(1, sizeof *st);
    if (!st || !(st->b = malloc(n * sizeof *st->b))) {
        kvr__wk_step_free(st);
        return kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
    }
    memcpy(st->b, toks, n * sizeof *toks);
    st->nb = n;
    if (o->session) {
        if (strlen(o->session) > KVR_ID_MAX) {
            kvr__wk_step_free(st);
            return kvr__wk_fail(e, KVR_EINVAL, "session id longer than %d bytes", KVR_ID_MAX);
        }
        snprintf(st->target, sizeof st->target, "%s", o->session);
    } else {
        kvr__wk_ctx_name(e, st->target, sizeof st->target, "s", toks, n, NULL, 0);
    }

    /* The two candidates: the session, and the longest exact prefix. */
    sess ss;
    if ((r = sess_read(e, st->target, &ss)) < 0)
        goto fail;
    kvr_match_res m;
    kvr_match_args ma = { .model = e->model, .tokens = (const uint32_t *)toks, .n_tokens = n };
    if ((r = kvr_client_match(e->kc, &ma, &m)) < 0) {
        r = kvr__wk_kv_fail(e, r, "match", NULL);
        goto fail;
    }
    res->t_match_ms = kvr__wk_now_ms() - t0;
    size_t L = (size_t)m.length;

    kvr__wk_hunk *hk = NULL;
    size_t nh = 0, keep = 0;
    if (ss.ok) {
        const int32_t *A = (const int32_t *)ss.meta.tokens;
        size_t na = (size_t)ss.meta.n_tokens;
        if (o->exact_only) {
            /* One op: everything after the session's exact common prefix. */
            size_t p = 0;
            while (p < na && p < n && A[p] == toks[p] && !(ss.meta.flags[p] & KVR_TOKEN_APPROX))
                p++;
            if (p == n && n == na && p > 0)
                p--;                         /* still one op: the last token */
            if (!(hk = malloc(sizeof *hk))) {
                r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
                goto fail;
            }
            hk[0] = (kvr__wk_hunk){ p, na, p, n };
            nh = 1;
            keep = p;
        } else {
            if ((r = kvr__wk_diff(A, na, toks, n, o->max_d ? o->max_d : 2048, &hk, &nh)) < 0) {
                r = kvr__wk_fail(e, r, "out of memory in the diff");
                goto fail;
            }
            kvr__wk_hunks_merge(hk, &nh, o->min_gap ? o->min_gap : 8);
            keep = n;
            for (size_t i = 0; i < nh; i++)
                keep -= hk[i].b1 - hk[i].b0;
        }
    }
    size_t best = ss.ok && keep >= L ? keep : L;
    if (!o->no_cover && e->cover.cover && e->cover.cover_get && e->cover.release &&
        n >= best + KVR_COVER_MIN_RUN) {
        if ((r = sync_cover(e, toks, n, best, o, st, res)) < 0) {
            free(hk);
            goto fail;
        }
        if (r == 1) {
            free(hk);
            goto done;
        }
    }
    if (ss.ok && keep >= L && keep > 0) {
        snprintf(res->source, sizeof res->source, "%s", st->target);
        snprintf(st->source, sizeof st->source, "%s", st->target);
        st->kind = COMMIT_EDIT;
        r = sync_edit(e, &ss, toks, n, hk, nh, o, st, res);
        if (r < 0) {
            if (st->hk != hk)
                free(hk);
            goto fail;
        }
    } else {
        free(hk);
        if (L > 0 && strcmp(m.ctx_id, st->target) != 0) {
            /* Another context's exact prefix. */
            kvr_context info;
            if ((r = kvr__wk_ctx_len(e, m.ctx_id, &info)) < 0)
                goto fail;
            snprintf(res->source, sizeof res->source, "%s", m.ctx_id);
            snprintf(st->source, sizeof st->source, "%s", m.ctx_id);
            st->kind = COMMIT_FORK;
            st->src_len = (size_t)info.n_tokens;
            st->L = L < n ? L : n - 1;        /* the last token is decoded */
            kvr__wk_lm_clear(e->lm);
            if (st->L > 0 && (r = kvr__wk_load_prefix(e, m.ctx_id, st->L, &res->t_fetch_ms,
                                                     &res->t_load_ms)) < 0)
                goto fail;
            double td = kvr__wk_now_ms();
            r = kvr__wk_lm_decode(e->lm, toks + st->L, n - st->L, (int32_t)st->L, 0,
                                 KVR_WK_LOGITS_LAST, NULL, NULL, e->err, sizeof e->err);
            res->t_decode_ms += kvr__wk_now_ms() - td;
            if (r < 0)
                goto fail;
            res->n_reused = st->L;
            res->n_computed = n - st->L;
            if (L >= n && st->src_len == n && !o->session) {
                /* The prompt is that context: nothing to store. */
                kvr__wk_step_free(st);
                st = NULL;
            }
        } else {
            st->kind = COMMIT_CREATE;
            if ((r = sync_full(e, toks, n, res)) < 0)
                goto fail;
        }
    }
done:
    kvr_kv_release(&ss.meta);
    res->t_total_ms = kvr__wk_now_ms() - t0;
    *step = st;
    return 0;
fail:
    kvr_kv_release(&ss.meta);
    kvr__wk_step_free(st);
    return r;
}

/* The cells of seq 0 at [s, e) as a payload, sent as a refresh with CAS. */
static int refresh_run(kvr__wk_env *e, const kvr__wk_seqstate *q, const char *ctx, size_t s,
                       size_t en, size_t n, uint64_t h, bool approx)
{
    void *pl = kvr__wk_seqstate_payload(e, q, NULL, en - s, s);
    if (!pl)
        return KVR_EINVAL;
    kvr_refresh_args ra = { .ctx_id = ctx, .start = s, .end = en, .model = e->model,
                            .fingerprint = e->fingerprint, .dtype = F16, .payload = pl,
                            .payload_len = kvr__wk_payload_bytes(e, en - s), .expect = true,
                            .expect_n_tokens = n, .expect_hash = h, .approx = approx };
    int r = kvr_client_refresh(e->kc, &ra, NULL);
    free(pl);
    return r < 0 ? kvr__wk_kv_fail(e, r, "refresh", ctx) : 0;
}

/* [s, en) in pieces of one exactness (rx: 1 exact, 2 approximate). */
static int refresh_runs(kvr__wk_env *e, const kvr__wk_seqstate *q, const char *ctx, size_t s,
                        size_t en, const uint8_t *rx, size_t n, uint64_t h)
{
    while (s < en) {
        size_t k = s + 1;
        while (k < en && rx[k] == rx[s])
            k++;
        int r = refresh_run(e, q, ctx, s, k, n, h, rx[s] == 2);
        if (r < 0)
            return r;
        s = k;
    }
    return 0;
}

static int commit_edit(kvr__wk_env *e, kvr__wk_step *st, const kvr__wk_seqstate *q)
{
    size_t n_new = 0;
    for (size_t i = 0; i < st->nh; i++)
        n_new += st->hk[i].b1 - st->hk[i].b0;
    int r = 0;
    if (st->nh > 0) {
        kvr_edit_range *ops = calloc(st->nh, sizeof *ops);
        int64_t *pos = malloc((n_new ? n_new : 1) * sizeof *pos);
        void *pl = NULL;
        if (!ops || !pos) {
            free(ops);
            free(pos);
            return kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        }
        size_t k = 0;
        for (size_t i = 0; i < st->nh; i++) {
            const kvr__wk_hunk *h = &st->hk[i];
            ops[i] = (kvr_edit_range){ .start = h->a0, .end = h->a1,
                                       .tokens = (const uint32_t *)st->b + h->b0,
                                       .n_tokens = h->b1 - h->b0,
                                       .approx = h->b1 > h->b0 && st->rx[h->b0] == 2 };
            for (size_t p = h->b0; p < h->b1; p++)
                pos[k++] = (int64_t)p;
        }
        if (n_new && !(pl = kvr__wk_seqstate_payload(e, q, pos, n_new, 0)))
            r = KVR_EINVAL;
        if (r == 0) {
            kvr_edit_args ea = { .ctx_id = st->target, .ops = ops, .n_ops = st->nh,
                                 .model = e->model, .fingerprint = e->fingerprint,
                                 .with_kv = n_new > 0, .dtype = F16, .payload = pl,
                                 .payload_len = n_new ? kvr__wk_payload_bytes(e, n_new) : 0,
                                 .expect = true, .expect_n_tokens = st->na,
                                 .expect_hash = st->a_hash };
            kvr_edit_res er = { 0 };
            if ((r = kvr_client_edit(e->kc, &ea, &er)) < 0)
                r = kvr__wk_kv_fail(e, r, "edit", st->target);
            else if (er.n_tokens != st->nb)
                r = kvr__wk_fail(e, KVR_EINVAL, "session %s holds %llu tokens after the edit, "
                                "not %zu", st->target, (unsigned long long)er.n_tokens,
                                st->nb);
            for (size_t i = 0; r == 0 && i < er.n_spans; i++)
                if (er.spans[i].first_pos != (int64_t)er.spans[i].index)
                    r = kvr__wk_fail(e, KVR_EINVAL, "session %s: new tokens at position %lld, "
                                    "index %llu", st->target,
                                    (long long)er.spans[i].first_pos,
                                    (unsigned long long)er.spans[i].index);
            kvr_client_free(er.spans);
        }
        free(pl);
        free(ops);
        free(pos);
        if (r < 0)
            return r;
    }
    uint64_t h = seq_hash(st->b, st->nb);
    for (size_t i = 0; i < st->nrf; i++)
        if ((r = refresh_runs(e, q, st->target, st->rf[i].s, st->rf[i].e, st->rx, st->nb,
                              h)) < 0)
            return r;
    return 0;
}

/* The prompt's tokens [from, to) from seq 0 into ctx (append or create). */
static int put_range(kvr__wk_env *e, const kvr__wk_step *st, const kvr__wk_seqstate *q,
                     size_t from, size_t to, kvr_put_mode mode)
{
    void *pl = kvr__wk_seqstate_payload(e, q, NULL, to - from, from);
    if (!pl)
        return KVR_EINVAL;
    kvr_put_args p = { .ctx_id = st->target, .model = e->model, .mode = mode,
                       .fingerprint = e->fingerprint, .dtype = F16,
                       .tokens = (const uint32_t *)st->b + from, .n_tokens = to - from,
                       .has_pos_start = true, .pos_start = (int64_t)from, .payload = pl,
                       .payload_len = kvr__wk_payload_bytes(e, to - from),
                       .v_trans = kvr__wk_lm_v_trans(e->lm), .persist = e->persist };
    int r = kvr_client_put(e->kc, &p, NULL);
    if (r == KVR_EUNSUPPORTED && p.persist) {
        /* no disk tier: sessions are kept as they were, in memory */
        fprintf(stderr, "kvrope-llama: kvroped has no disk tier (--disk-dir): sessions are "
                "not persistent\n");
        e->persist = p.persist = false;
        r = kvr_client_put(e->kc, &p, NULL);
    }
    free(pl);
    return r < 0 ? kvr__wk_kv_fail(e, r, "put", st->target) : 0;
}

static int put_rest(kvr__wk_env *e, const kvr__wk_step *st, const kvr__wk_seqstate *q,
                    size_t from, kvr_put_mode mode)
{
    return put_range(e, st, q, from, st->nb, mode);
}

/* COVER: the exact part put, the approximate rest inserted flagged so (one
 * edit, CAS on what the put left); everything approximate: put, then a
 * refresh that flags it all. */
static int commit_cover(kvr__wk_env *e, kvr__wk_step *st, const kvr__wk_seqstate *q)
{
    size_t f = st->apx_from < st->nb ? st->apx_from : st->nb;
    if (f == 0) {
        int r = put_rest(e, st, q, 0, KVR_PUT_REPLACE);
        return r < 0 ? r : refresh_run(e, q, st->target, 0, st->nb, st->nb,
                                       seq_hash(st->b, st->nb), true);
    }
    int r = put_range(e, st, q, 0, f, KVR_PUT_REPLACE);
    if (r < 0 || f == st->nb)
        return r;
    size_t m = st->nb - f;
    void *pl = kvr__wk_seqstate_payload(e, q, NULL, m, f);
    if (!pl)
        return KVR_EINVAL;
    kvr_edit_range op = { .start = f, .end = f, .tokens = (const uint32_t *)st->b + f,
                          .n_tokens = m, .approx = true };
    kvr_edit_args ea = { .ctx_id = st->target, .ops = &op, .n_ops = 1, .model = e->model,
                         .fingerprint = e->fingerprint, .with_kv = true, .dtype = F16,
                         .payload = pl, .payload_len = kvr__wk_payload_bytes(e, m),
                         .expect = true, .expect_n_tokens = f,
                         .expect_hash = seq_hash(st->b, f) };
    kvr_edit_res er = { 0 };
    if ((r = kvr_client_edit(e->kc, &ea, &er)) < 0)
        r = kvr__wk_kv_fail(e, r, "edit", st->target);
    else if (er.n_tokens != st->nb || (er.n_spans == 1 && er.spans[0].first_pos != (int64_t)f))
        r = kvr__wk_fail(e, KVR_EINVAL, "context %s after the cover's insert: %llu tokens, not %zu",
                        st->target, (unsigned long long)er.n_tokens, st->nb);
    kvr_client_free(er.spans);
    free(pl);
    return r;
}

int kvr__wk_commit(kvr__wk_env *e, kvr__wk_step *st)
{
    if (!st)
        return 0;
    /* the session already holds the prompt (no op, nothing refreshed): no
     * export of llama.cpp's state (185 ms for 1,781 tokens of the 0.7 B
     * benchmark model, which delayed a client's next request) */
    if (st->kind == COMMIT_EDIT && st->nh == 0 && st->nrf == 0)
        return 0;
    kvr__wk_seqstate q;
    int r = kvr__wk_seqstate_get(e, &q, st->nb);
    if (r < 0)
        return r;
    switch (st->kind) {
    case COMMIT_EDIT:
        r = commit_edit(e, st, &q);
        break;
    case COMMIT_FORK: {
        if (strcmp(st->source, st->target) == 0) {
            r = kvr__wk_fail(e, KVR_EINVAL, "internal: a fork onto its own source %s", st->source);
            break;
        }
        /* A fork is persistent only if its source is: a persistent session
         * appends at least its last token (a put with persist marks it),
         * computed in this step like every prompt's last token. */
        size_t keep = e->persist && st->L == st->nb && st->L > 0 ? st->L - 1 : st->L;
        if ((r = kvr__wk_fork_prefix(e, st->source, st->target, keep, st->src_len)) == 0 &&
            keep < st->nb)
            r = put_rest(e, st, &q, keep, KVR_PUT_APPEND);
        break;
    }
    case COMMIT_CREATE:
        r = put_rest(e, st, &q, 0, KVR_PUT_REPLACE);
        break;
    case COMMIT_COVER:
        r = commit_cover(e, st, &q);
        break;
    }
    kvr__wk_seqstate_free(&q);
    return r;
}

/* ---- idle refresh ---------------------------------------------------------- */
typedef struct cand {
    size_t   i;
    uint32_t age;
    size_t   dist;
} cand;

static int cand_cmp(const void *x, const void *y)
{
    const cand *a = x, *b = y;
    if (a->age != b->age)
        return a->age > b->age ? -1 : 1;
    if (a->dist != b->dist)
        return a->dist < b->dist ? -1 : 1;
    return a->i < b->i ? -1 : a->i > b->i;
}

int kvr__wk_refresh_idle(kvr__wk_env *e, const char *session, size_t budget, size_t cursor,
                        size_t *n_done)
{
    *n_done = 0;
    sess ss;
    int r = sess_read(e, session, &ss);
    if (r < 0)
        return r;
    if (!ss.ok) {
        kvr_kv_release(&ss.meta);
        return ss.exists ? kvr__wk_fail(e, KVR_EINVAL, "context %s is not a session this "
                                       "engine can refresh (positions or KV missing)", session)
                         : kvr__wk_fail(e, KVR_ENOCTX, "no session %s", session);
    }
    size_t n = (size_t)ss.meta.n_tokens, nc = 0;
    cand *c = malloc(n * sizeof *c);
    uint8_t *m = calloc(n, 1);
    run *rs = NULL;
    size_t nr = 0;
    uint8_t *apx = NULL, *rx = NULL;
    kvr__wk_seqstate q = { 0 };
    if (!c || !m) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        if (ss.meta.flags[i] & KVR_TOKEN_APPROX)
            c[nc++] = (cand){ i, KVR_TOKEN_AGE(ss.meta.flags[i]),
                              cursor == SIZE_MAX ? 0 : (i > cursor ? i - cursor : cursor - i) };
    if (nc == 0 || budget == 0) {
        r = 0;
        goto out;
    }
    if ((r = lm_fits(e, n)) < 0)
        goto out;
    qsort(c, nc, sizeof *c, cand_cmp);
    if (budget > nc)
        budget = nc;
    for (size_t i = 0; i < budget; i++)
        m[c[i].i] = 1;
    if ((r = runs_of(m, n, &rs, &nr)) < 0) {
        r = kvr__wk_fail(e, r, "out of memory");
        goto out;
    }
    double tf = 0, tl = 0;
    kvr__wk_lm_clear(e->lm);
    if ((r = kvr__wk_load_prefix(e, session, n, &tf, &tl)) < 0)
        goto out;
    size_t n_dec = 0;
    const int32_t *toks = (const int32_t *)ss.meta.tokens;
    if (!(apx = malloc(n)) || !(rx = calloc(n, 1))) {
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        apx[i] = !!(ss.meta.flags[i] & KVR_TOKEN_APPROX);
    if ((r = decode_runs(e, toks, rs, nr, apx, rx, n, &n_dec)) < 0)
        goto out;
    if ((r = kvr__wk_seqstate_get(e, &q, n)) < 0)
        goto out;
    uint64_t h = seq_hash(toks, n);
    for (size_t i = 0; i < nr; i++) {
        if ((r = refresh_runs(e, &q, session, rs[i].s, rs[i].e, rx, n, h)) < 0)
            goto out;
        *n_done += rs[i].e - rs[i].s;
    }
    r = 0;
out:
    kvr__wk_seqstate_free(&q);
    kvr_kv_release(&ss.meta);
    free(c);
    free(m);
    free(rs);
    free(apx);
    free(rx);
    return r;
}
