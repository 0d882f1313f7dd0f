/*
 * worker_replay.c — kvrope-llama replay: an edit history (the versions
 * DIR/v0000.txt, v0001.txt, ... that scripts/edit-history.py writes) replayed
 * through the session engine, one version after the other, as an editor's
 * worker sees them: per edit, what was computed and how long the next token
 * took, and, where asked, how far the cached path is from a full re-encode
 * (KL of the next-token distributions, logit RMS, argmax agreement) and how
 * long that re-encode takes. The drift evaluation (eval/drift.py) and the
 * editor benchmark (tests/llama/bench_session.c) read its JSON lines.
 *
 * Invariants:
 *  - Version 0 starts the session afresh (an existing context of that id is
 *    deleted first; its cost is reported, not counted as an edit); versions
 *    1.. are edits.
 *  - A failed step is counted and reported, and the loop goes on with the
 *    next version (the session engine never loses the session on a failure).
 *  - The full re-encode is measured in this process on the same llama.cpp
 *    context, after the cached step's figures are taken.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "client/llama/worker.h"

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, size_t n)
{
    if (n == 0)
        return NAN;
    qsort(v, n, sizeof *v, cmp_dbl);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    struct stat sb;
    char *d = NULL;
    if (fstat(fileno(f), &sb) == 0 && (d = malloc((size_t)sb.st_size + 1))) {
        *len = fread(d, 1, (size_t)sb.st_size, f);
        d[*len] = 0;
    }
    fclose(f);
    return d;
}

/* KL(p_ref || p_got) of the softmaxes, in nats. */
static double kl_of(const float *ref, const float *got, size_t n)
{
    double mr = -INFINITY, mg = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        mr = fmax(mr, (double)ref[i]);
        mg = fmax(mg, (double)got[i]);
    }
    double zr = 0, zg = 0;
    for (size_t i = 0; i < n; i++) {
        zr += exp((double)ref[i] - mr);
        zg += exp((double)got[i] - mg);
    }
    double kl = 0;
    for (size_t i = 0; i < n; i++) {
        double lr = (double)ref[i] - mr - log(zr), lg = (double)got[i] - mg - log(zg);
        kl += exp(lr) * (lr - lg);
    }
    return kl > 0 ? kl : 0;
}

static bool in_list(const size_t *at, size_t n_at, size_t i)
{
    for (size_t k = 0; k < n_at; k++)
        if (at[k] == i)
            return true;
    return false;
}

int kvr__wk_replay(kvr__wk_env *e, const kvr__wk_replay_opts *o)
{
    kvr__wk_report *R = e->rep;
    size_t nv = kvr__wk_lm_info_get(e->lm)->n_vocab;
    bool bos = kvr__wk_lm_info_get(e->lm)->add_bos;
    /* The versions, tokenized; the context sized for the largest. */
    size_t n_ver = 0, cap = 0, max_n = 0;
    int32_t **ver = NULL;
    size_t *nver = NULL;
    int r = 0;
    for (;; n_ver++) {
        char p[4200];
        snprintf(p, sizeof p, "%s/v%04zu.txt", o->dir, n_ver);
        size_t len = 0;
        char *text = read_all(p, &len);
        if (!text)
            break;
        if (o->max_versions && n_ver == o->max_versions) {
            free(text);
            break;
        }
        if (n_ver == cap) {
            cap = cap ? 2 * cap : 64;
            int32_t **nv2 = realloc(ver, cap * sizeof *ver);
            size_t *nn2 = nv2 ? realloc(nver, cap * sizeof *nver) : NULL;
            if (nv2)
                ver = nv2;
            if (!nv2 || !nn2) {
                free(text);
                r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
                goto out;
            }
            nver = nn2;
        }
        ver[n_ver] = NULL;
        r = kvr__wk_lm_tokenize(e->lm, text, len, bos, &ver[n_ver], &nver[n_ver], e->err,
                               sizeof e->err);
        free(text);
        if (r < 0)
            goto out;
        if (nver[n_ver] > max_n)
            max_n = nver[n_ver];
    }
    if (n_ver < 2) {
        r = kvr__wk_fail(e, KVR_EINVAL, "%s holds %zu versions (v0000.txt, v0001.txt, ...): an "
                        "edit history needs two at least (scripts/edit-history.py)", o->dir,
                        n_ver);
        goto out;
    }
    if ((r = kvr__wk_lm_context(e->lm, (uint32_t)max_n + 16, e->err, sizeof e->err)) < 0)
        goto out;
    /* Version 0 starts the session afresh. */
    if ((r = kvr__wk_del_quiet(e, o->sync.session)) < 0)
        goto out;

    size_t n_ed = n_ver - 1, fails = 0, n_chk = 0;
    double *share = calloc(n_ed, sizeof *share), *t_first = calloc(n_ed, sizeof *t_first);
    double *speed = calloc(n_ed, sizeof *speed);
    float *lg = malloc(nv * sizeof *lg);
    if (!share || !t_first || !speed || !lg) {
        free(share);
        free(t_first);
        free(speed);
        free(lg);
        r = kvr__wk_fail(e, KVR_ENOMEM, "out of memory");
        goto out;
    }
    double sum_share = 0, kl_sum = 0;
    size_t n_ok = 0, comp_total = 0, tok_total = 0;
    for (size_t i = 0; i < n_ver; i++) {
        kvr__wk_step *st = NULL;
        kvr__wk_sync_res sr;
        double t0 = kvr__wk_now_ms();
        int q = kvr__wk_sync(e, ver[i], nver[i], &o->sync, &st, &sr);
        double tf = kvr__wk_now_ms() - t0;
        if (q == 0)
            memcpy(lg, kvr__wk_lm_logits(e->lm), nv * sizeof *lg);
        size_t n_new = kvr__wk_step_new_tokens(st);
        double ts0 = kvr__wk_now_ms();
        if (q == 0)
            q = kvr__wk_commit(e, st);
        double t_store = kvr__wk_now_ms() - ts0;
        kvr__wk_step_free(st);
        size_t bg = 0;
        double t_bg = 0;
        if (q == 0 && o->background) {
            double tb0 = kvr__wk_now_ms();
            q = kvr__wk_refresh_idle(e, o->sync.session, SIZE_MAX, SIZE_MAX, &bg);
            t_bg = kvr__wk_now_ms() - tb0;
        }
        if (o->lines) {
            fprintf(o->lines, "{\"version\": %zu, \"tokens\": %zu", i, nver[i]);
            if (q < 0)
                fprintf(o->lines, ", \"error\": \"%s\"", e->err);
        }
        if (q < 0) {
            if (i > 0)
                fails++;
            if (o->lines)
                fprintf(o->lines, "}\n");
            continue;
        }
        double sh = (double)sr.n_computed / (double)nver[i];
        if (o->lines)
            fprintf(o->lines, ", \"new\": %zu, \"ops\": %zu, \"computed\": %zu, \"refreshed\": "
                    "%zu, \"reused\": %zu, \"approximate\": %zu, \"share\": %.6f, "
                    "\"first_token_ms\": %.3f, \"store_ms\": %.3f, \"background_refreshed\": "
                    "%zu, \"background_ms\": %.3f, \"source\": \"%s\"", n_new, sr.n_ops,
                    sr.n_computed, sr.n_refreshed, sr.n_reused, sr.n_approx, sh, tf, t_store,
                    bg, t_bg, sr.source);
        if (i > 0) {
            share[n_ok] = sh;
            t_first[n_ok] = tf;
            sum_share += sh;
            comp_total += sr.n_computed;
            tok_total += nver[i];
            n_ok++;
        }
        if (o->check_all || in_list(o->check_at, o->n_check_at, i)) {
            kvr__wk_sync_opts full = { .no_cache = true };
            kvr__wk_step *fs = NULL;
            kvr__wk_sync_res fr;
            double tc0 = kvr__wk_now_ms();
            q = kvr__wk_sync(e, ver[i], nver[i], &full, &fs, &fr);
            double t_full = kvr__wk_now_ms() - tc0;
            kvr__wk_step_free(fs);
            if (q < 0) {
                r = q;
                if (o->lines)
                    fprintf(o->lines, "}\n");
                goto out_m;
            }
            const float *ref = kvr__wk_lm_logits(e->lm);
            double kl = kl_of(ref, lg, nv), rms = 0;
            for (size_t k = 0; k < nv; k++)
                rms += ((double)lg[k] - (double)ref[k]) * ((double)lg[k] - (double)ref[k]);
            rms = sqrt(rms / (double)nv);
            bool agree = kvr__wk_argmax(lg, nv) == kvr__wk_argmax(ref, nv);
            if (i > 0) {
                speed[n_chk++] = t_full / tf;
                kl_sum += kl;
            }
            if (o->lines)
                fprintf(o->lines, ", \"full_ms\": %.3f, \"kl\": %.8f, \"logit_rms_err\": %.6f, "
                        "\"agrees\": %s", t_full, kl, rms, agree ? "true" : "false");
        }
        if (o->lines) {
            fprintf(o->lines, "}\n");
            fflush(o->lines);
        }
    }
    kvr__wk_rep_str(R, NULL, "session", o->sync.session);
    kvr__wk_rep_num(R, NULL, "versions", (double)n_ver);
    kvr__wk_rep_num(R, NULL, "edits", (double)n_ed);
    kvr__wk_rep_num(R, NULL, "failures", (double)fails);
    kvr__wk_rep_num(R, NULL, "computed_share", tok_total ? (double)comp_total / (double)tok_total
                                                        : (double)NAN);
    kvr__wk_rep_num(R, NULL, "mean_share", n_ok ? sum_share / (double)n_ok : (double)NAN);
    kvr__wk_rep_num(R, NULL, "median_share", median(share, n_ok));
    kvr__wk_rep_num(R, "timings_ms", "median_first_token", median(t_first, n_ok));
    if (n_chk) {
        kvr__wk_rep_num(R, NULL, "median_speedup", median(speed, n_chk));
        kvr__wk_rep_num(R, NULL, "mean_kl", kl_sum / (double)n_chk);
    }
    kvr__wk_rep_line(R, "replayed %zu edits of %s into session %s: %zu failed; tokens computed "
                    "%.1f%% of a re-encode (median per edit %.1f%%), median first token %.2f ms",
                    n_ed, o->dir, o->sync.session, fails,
                    tok_total ? 100.0 * (double)comp_total / (double)tok_total : 0.0,
                    100.0 * median(share, n_ok), median(t_first, n_ok));
    r = 0;
out_m:
    free(share);
    free(t_first);
    free(speed);
    free(lg);
out:
    for (size_t i = 0; i < n_ver; i++)
        free(ver[i]);
    free(ver);
    free(nver);
    return r;
}
