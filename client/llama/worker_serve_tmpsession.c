/*
 * worker_serve_tmpsession.c — TEMPORARY stand-in for the session engine
 * (worker_session.c, issue 25), so that kvrope serve can be built and tested
 * before the engine lands on main. Delete this file when merging main: the
 * real engine defines the same symbols.
 *
 * It implements the interface in worker.h with longest-prefix reuse only:
 *  kvr_wk_sync    exact cached prefix of any context of the model (match),
 *                 loaded into seq 0, the rest decoded; no PIE ops.
 *  kvr_wk_commit  the synced prompt's cells stored as the session's context
 *                 in one put REPLACE (readers see the old context until the
 *                 new one is whole).
 *  kvr_wk_refresh_idle  nothing to do (nothing here is ever approximate).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/llama/kvrope_llama.h"
#include "client/llama/worker.h"

struct kvr_wk_step {
    char     session[KVR_ID_MAX + 1];
    int32_t *toks;
    size_t   n;
};

void kvr_wk_step_free(kvr_wk_step *s)
{
    if (!s)
        return;
    free(s->toks);
    free(s);
}

static int sfail(kvr_wk_env *e, int r, const char *what)
{
    e->kv_code = r;
    snprintf(e->err, sizeof e->err, "kvrope %s: %s", what, kvr_client_last_error(e->kc));
    return r;
}

int kvr_wk_sync(kvr_wk_env *e, const int32_t *toks, size_t n, const kvr_wk_sync_opts *o,
                kvr_wk_step **step, kvr_wk_sync_res *res)
{
    *step = NULL;
    memset(res, 0, sizeof *res);
    res->n_prompt = n;
    if (n == 0) {
        snprintf(e->err, sizeof e->err, "the prompt is empty");
        return -EINVAL;
    }
    double t0 = kvr_wk_now_ms();
    kvr_wk_lm_clear(e->lm);
    size_t reuse = 0;
    if (!o->no_cache) {
        kvr_match_res m;
        kvr_match_args ma = { .model = e->model, .tokens = (const uint32_t *)toks,
                              .n_tokens = n };
        int r = kvr_client_match(e->kc, &ma, &m);
        if (r < 0)
            return sfail(e, r, "match");
        res->t_match_ms = kvr_wk_now_ms() - t0;
        reuse = m.length < n ? (size_t)m.length : n - 1;
        if (reuse > 0) {
            double t1 = kvr_wk_now_ms();
            kvr_llama_export_opts xo = { .model = e->model, .start = 0, .end = reuse,
                                         .has_pos_start = true, .pos_start = 0,
                                         .type_k = KVR_LLAMA_F16, .type_v = KVR_LLAMA_F16,
                                         .v_trans = kvr_wk_lm_v_trans(e->lm),
                                         .form = KVR_LLAMA_FORM_RAW };
            void *st = NULL;
            size_t len = 0;
            char err[512] = "";
            r = kvr_llama_state_export(e->kc, m.ctx_id, e->profile, &xo, &st, &len, NULL, err,
                                       sizeof err);
            if (r < 0) {
                e->kv_code = r;
                snprintf(e->err, sizeof e->err, "loading %zu tokens of %s: %s", reuse, m.ctx_id,
                         err);
                return r;
            }
            double t2 = kvr_wk_now_ms();
            res->t_fetch_ms = t2 - t1;
            r = kvr_wk_lm_state_set(e->lm, st, len, e->err, sizeof e->err);
            kvr_llama_free(st);
            if (r < 0)
                return r;
            res->t_load_ms = kvr_wk_now_ms() - t2;
            snprintf(res->source, sizeof res->source, "%s", m.ctx_id);
        }
    }
    double t3 = kvr_wk_now_ms();
    int r = kvr_wk_lm_decode(e->lm, toks + reuse, n - reuse, (int32_t)reuse, 0,
                             KVR_WK_LOGITS_LAST, NULL, NULL, e->err, sizeof e->err);
    if (r < 0)
        return r;
    res->t_decode_ms = kvr_wk_now_ms() - t3;
    res->n_reused = reuse;
    res->n_computed = n - reuse;
    res->t_total_ms = kvr_wk_now_ms() - t0;
    if (o->no_cache || !o->session)
        return 0;
    kvr_wk_step *s = calloc(1, sizeof *s);
    if (!s || !(s->toks = malloc(n * sizeof *s->toks))) {
        free(s);
        snprintf(e->err, sizeof e->err, "out of memory");
        return -ENOMEM;
    }
    snprintf(s->session, sizeof s->session, "%s", o->session);
    memcpy(s->toks, toks, n * sizeof *toks);
    s->n = n;
    *step = s;
    return 0;
}

int kvr_wk_commit(kvr_wk_env *e, kvr_wk_step *s)
{
    if (!s)
        return 0;
    uint8_t *buf = NULL;
    size_t len = 0;
    int r = kvr_wk_lm_state_get(e->lm, &buf, &len, e->err, sizeof e->err);
    if (r < 0)
        return r;
    kvr_llama_import_opts io = { .model = e->model, .mode = KVR_LLAMA_IMPORT_REPLACE,
                                 .cell_start = 0, .cell_end = (uint32_t)s->n,
                                 .tokens = (const uint32_t *)s->toks, .n_tokens = s->n };
    char err[512] = "";
    r = kvr_llama_state_import(e->kc, s->session, buf, len, e->profile, &io, NULL, err,
                               sizeof err);
    free(buf);
    if (r < 0) {
        e->kv_code = r;
        snprintf(e->err, sizeof e->err, "storing %zu tokens into %s: %s", s->n, s->session, err);
        return r;
    }
    return 0;
}

int kvr_wk_refresh_idle(kvr_wk_env *e, const char *session, size_t budget, size_t cursor,
                        size_t *n_done)
{
    (void)e;
    (void)session;
    (void)budget;
    (void)cursor;
    *n_done = 0;
    return 0;
}
