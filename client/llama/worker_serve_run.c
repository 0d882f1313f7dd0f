/*
 * worker_serve_run.c — the engine thread of `kvrope-llama serve`.
 *
 * One thread owns llama.cpp's context and the kvrope connection. Slots
 * generate together (continuous batching): each slot has a llama.cpp
 * sequence of its own after the session engine's scratch sequences
 * (kvr__wk_lm_reserve_seqs). The loop takes one queued job that can start,
 * then decodes the next token of every generation in flight in one batch:
 *   admit  a generation, while fewer than n_gen_max generate, on a free slot
 *          (id_slot, waited for while busy; else the free slot whose last
 *          prompt shares the most with it, else the least recently used
 *          free one), or a slot operation on a free slot;
 *   prompt kvr__wk_sync with the slot's session in seq 0 (cached prefix, PIE
 *          edits of the session's context, chunks placed; only new and
 *          refreshed tokens decoded). cache_prompt false, or kvroped
 *          unreachable: the whole prompt decoded here, no store (counted,
 *          logged). The first token is sampled from its logits, then the
 *          cells move to the slot's sequence (metadata only);
 *   tokens one per step and generation, sampled by the chain of
 *          worker_serve_sample.c under llama-server's stop rules (EOG,
 *          n_predict, the context's end, stop words, n_indent,
 *          t_max_predict_ms), published to the job as they come;
 *   commit after the job is marked done (its client gets the answer first):
 *          the prompt's cells copied back to seq 0 for kvr__wk_commit.
 * Idle (no job and no generation for idle_ms): kvr__wk_refresh_idle on slots
 * whose sessions hold approximate tokens, a small budget at a time, so a
 * cache converges to exact without delaying requests by more than one budget.
 *
 * Invariants: a job is marked done exactly once; a slot runs one job at a
 * time (srv_slot.processing); seq 0 and the scratch sequences are empty
 * between jobs; every wait on srv.mu re-checks `stopping`; a failed kvrope
 * step never fails the request when the prompt can be computed without it.
 */
#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

#include "client/llama/worker_serve.h"
#include "base/clock.h"

const double kvr__srv_ttft_le[12] = { 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                 0.1,   0.25,   0.5,   1.0,  2.5,   10.0 };

#define REFRESH_BUDGET 128

void kvr__srv_params_default(srv_params *p)
{
    memset(p, 0, sizeof *p);
    p->n_predict = -1;
    p->temperature = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->min_p = 0.05f;
    p->seed = 0xFFFFFFFFu;
    /* llama.cpp's common_params_sampling defaults */
    static const int order[] = { SRV_SAMP_PENALTIES, SRV_SAMP_DRY, SRV_SAMP_TOP_N_SIGMA,
                                 SRV_SAMP_TOP_K, SRV_SAMP_TYP_P, SRV_SAMP_TOP_P, SRV_SAMP_MIN_P,
                                 SRV_SAMP_XTC, SRV_SAMP_TEMP };
    memcpy(p->samplers, order, sizeof order);
    p->n_samplers = (int)(sizeof order / sizeof order[0]);
    p->typical_p = 1.0f;
    p->top_n_sigma = -1.0f;
    p->xtc_threshold = 0.1f;
    p->repeat_last_n = 64;
    p->repeat_penalty = 1.0f;
    p->dry_base = 1.75f;
    p->dry_allowed_length = 2;
    p->dry_penalty_last_n = 64;
    static char nl[] = "\n", colon[] = ":", quote[] = "\"", star[] = "*";   /* never written */
    char *breakers[] = { nl, colon, quote, star };
    memcpy(p->dry_breakers, breakers, sizeof breakers);   /* not owned: dry_breakers_owned */
    p->n_dry_breakers = 4;
    p->cache_prompt = true;
    p->id_slot = -1;
    p->n_cmpl = 1;
}

void kvr__srv_params_free(srv_params *p)
{
    for (int i = 0; i < p->n_stop; i++)
        free(p->stop[i]);
    p->n_stop = 0;
    for (int i = 0; p->dry_breakers_owned && i < p->n_dry_breakers; i++)
        free(p->dry_breakers[i]);
    p->n_dry_breakers = 0;
}

static void job_free(srv_job *j)
{
    kvr__srv_params_free(&j->p);
    free(j->toks);
    free(j->text);
    free(j->gen);
    free(j);
}

void kvr__srv_job_release(srv *s, srv_job *j)
{
    pthread_mutex_lock(&s->mu);
    bool last = kvr_ref_put(&j->ref);
    if (last && !j->done)
        j->cancelled = true;
    pthread_mutex_unlock(&s->mu);
    if (last)
        job_free(j);
}

int kvr__srv_submit(srv *s, srv_job *j)
{
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return KVR_EBUSY;
    }
    kvr_ref_init(&j->ref, 2);
    kvr_list_insert_tail(&s->queue, &j->node);
    s->q_len++;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* ---- text and stop rules ------------------------------------------------ */

int kvr__srv_buf_add(char **buf, size_t *len, size_t *cap, size_t cap0, const void *p, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : cap0;
        while (c < *len + n + 1)
            c *= 2;
        char *t = realloc(*buf, c);
        if (!t)
            return KVR_ENOMEM;
        *buf = t;
        *cap = c;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    (*buf)[*len] = 0;
    return 0;
}

static int text_add(srv_job *j, const char *p, size_t n)
{
    return kvr__srv_buf_add(&j->text, &j->len, &j->cap, 256, p, n);
}

/* Bytes of the text that hold whole UTF-8 characters. */
static size_t utf8_whole(const char *t, size_t n)
{
    size_t i = n, back = 0;
    while (i > 0 && back < 4 && ((unsigned char)t[i - 1] & 0xC0) == 0x80) {
        i--;
        back++;
    }
    if (i == 0)
        return n;
    unsigned char c = (unsigned char)t[i - 1];
    size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return back + 1 >= need ? n : i - 1;
}

/* Applies stop words to the text (cutting at the first full match) and
 * recomputes how much can be sent. Returns true when a word matched. */
static bool stop_words(srv_job *j, size_t from)
{
    bool hit = false;
    for (int i = 0; i < j->p.n_stop; i++) {
        const char *w = j->p.stop[i];
        size_t wl = strlen(w);
        if (!wl)
            continue;
        size_t st = from > wl ? from - wl : 0;
        char *at = j->len >= st ? strstr(j->text + st, w) : NULL;
        if (at) {
            j->len = (size_t)(at - j->text);
            j->text[j->len] = 0;
            j->stop_type = SRV_STOP_WORD;
            snprintf(j->stopping_word, sizeof j->stopping_word, "%s", w);
            hit = true;
        }
    }
    size_t safe = j->len;
    if (!hit)
        for (int i = 0; i < j->p.n_stop; i++) {
            /* the longest suffix of the text that starts a stop word */
            const char *w = j->p.stop[i];
            size_t wl = strlen(w);
            for (size_t k = wl > j->len ? j->len : wl - 1; k > 0; k--)
                if (!memcmp(j->text + j->len - k, w, k)) {
                    if (j->len - k < safe)
                        safe = j->len - k;
                    break;
                }
        }
    j->safe = utf8_whole(j->text, safe);
    return hit;
}

/* ---- the cache connection ---------------------------------------------- */

static void log_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void log_line(const char *fmt, ...)
{
    char buf[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    fprintf(stderr, "kvrope serve %02d:%02d:%02d %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec, buf);
}

static bool is_conn_err(int code) { return code == KVR_ESYS || code == KVR_ECLOSED; }

/* Reconnects to kvroped at most once a second while it is unreachable. */
static void reconnect(srv *s)
{
    double now = kvr__wk_now_ms();
    if (s->connected || now - s->t_reconnect < 1000)
        return;
    s->t_reconnect = now;
    kvr_client_close(s->e.kc);
    s->e.kc = NULL;
    if (kvr_client_connect(&s->e.kc, s->socket, NULL) < 0 || kvr_client_ping(s->e.kc, NULL) < 0)
        return;
    if (kvr__wk_register(&s->e, s->model_path) < 0) {
        log_line("kvroped at %s is back but registering the model failed: %s", s->socket,
                 s->e.err);
        return;
    }
    s->connected = true;
    log_line("kvroped at %s reachable again: prompts use the cache", s->socket);
}

static void lost(srv *s, const char *what)
{
    pthread_mutex_lock(&s->mu);
    s->m.cache_unavailable++;
    pthread_mutex_unlock(&s->mu);
    if (is_conn_err(s->e.kv_code) && s->connected) {
        s->connected = false;
        s->t_reconnect = kvr__wk_now_ms();
        log_line("kvroped unreachable (%s: %s): answering without the cache", what, s->e.err);
    } else {
        log_line("%s failed, answering without the cache: %s", what, s->e.err);
    }
    s->e.kv_code = 0;
}

/* ---- slots -------------------------------------------------------------- */

static size_t common_prefix(const int32_t *a, size_t na, const int32_t *b, size_t nb)
{
    size_t i = 0;
    while (i < na && i < nb && a[i] == b[i])
        i++;
    return i;
}

/* The slot for a prompt, among the free ones (as llama-server): id_slot
 * (-1 while it is busy: the job waits), else the free slot whose last prompt
 * shares the most with it, counting the common prefix and the common suffix
 * (an edit in the middle of a file keeps both: the file's slot, whose session
 * the engine can edit), when that is at least half the prompt (llama-server's
 * similarity threshold); else the least recently used free slot; -1 when all
 * are busy. A slot that is busy is not waited for: another slot's prompt
 * still comes from kvroped (its longest cached prefix). Called under srv.mu. */
static int pick_slot(srv *s, const srv_job *j)
{
    if (j->p.id_slot >= 0)
        return s->slots[j->p.id_slot].processing ? -1 : j->p.id_slot;
    int best = -1;
    size_t best_n = 0;
    for (int i = 0; i < s->n_slots; i++) {
        const srv_slot *sl = &s->slots[i];
        if (sl->processing)
            continue;
        size_t c = common_prefix(sl->toks, sl->n, j->toks, j->n);
        size_t m = sl->n < j->n ? sl->n : j->n;
        size_t e = 0;
        while (c + e < m && sl->toks[sl->n - 1 - e] == j->toks[j->n - 1 - e])
            e++;
        if (c + e > best_n && (c + e) * 2 >= j->n) {
            best = i;
            best_n = c + e;
        }
    }
    if (best >= 0)
        return best;
    for (int i = 0; i < s->n_slots; i++)
        if (!s->slots[i].processing &&
            (best < 0 || s->slots[i].last_used < s->slots[best].last_used))
            best = i;
    return best;
}

/* ---- a generation job --------------------------------------------------- */

static void finish(srv *s, srv_job *j, int status, const char *type, const char *msg)
{
    pthread_mutex_lock(&s->mu);
    if (status) {
        j->status = status;
        snprintf(j->err_type, sizeof j->err_type, "%s", type);
        snprintf(j->err, sizeof j->err, "%.500s", msg);
        s->m.requests_failed++;
    }
    if (j->cancelled)
        s->m.cancelled++;       /* counted with done, under one lock (st_free) */
    assert(!j->done);           /* a job is marked done exactly once */
    j->done = true;
    pthread_cond_broadcast(&s->progress);
    pthread_mutex_unlock(&s->mu);
}

/* Decodes the prompt into seq 0 without kvrope. */
static int prompt_direct(srv *s, const srv_job *j)
{
    kvr__wk_lm_clear(s->e.lm);
    return kvr__wk_lm_decode(s->e.lm, j->toks, j->n, 0, 0, KVR_WK_LOGITS_LAST, NULL, NULL,
                            s->e.err, sizeof s->e.err);
}

/* A generation in flight: its KV in llama.cpp sequence `seq` (one per slot,
 * after the session engine's scratch sequences) while tokens are decoded
 * together with the other slots' (continuous batching). */
typedef struct gen {
    srv_job         *j;
    srv_slot        *sl;
    int              seq;
    srv_sampler     *sm;
    kvr__wk_step    *step;
    kvr__wk_sync_res res;
    bool             via_cache, first;
    double           t0, t1;
    size_t           limit, i, last_nl;
    int32_t          next;          /* the token to decode next, at j->n + i - 1 */
    int              status;
    char             msg[600];
} gen;

/* One sampled token from lg: stop rules, publication. Returns true when
 * the generation goes on (g->next to decode), false when it ends. */
static bool gen_token(srv *s, gen *g, const float *lg)
{
    srv_job *j = g->j;
    if (g->i >= g->limit)
        return false;
    int32_t tok = !g->sm || !lg ? KVR_ENOMEM : kvr__srv_sample(g->sm, lg, j->toks, j->n, j->gen,
                                                             j->n_gen);
    if (tok < 0) {
        g->status = 500;
        snprintf(g->msg, sizeof g->msg, "%s", lg ? "out of memory" : "llama.cpp returned no logits");
        return false;
    }
    if (g->first) {
        double ttft = (kvr__wk_now_ms() - g->t0) / 1e3;
        pthread_mutex_lock(&s->mu);
        for (int b = 0; b < 12; b++)
            if (ttft <= kvr__srv_ttft_le[b])
                s->m.ttft_bucket[b]++;
        s->m.ttft_sum += ttft;
        s->m.ttft_count++;
        pthread_mutex_unlock(&s->mu);
        g->first = false;
    }
    pthread_mutex_lock(&s->mu);
    bool stop = j->cancelled || s->stopping;
    if (!stop && !j->p.ignore_eos && llama_vocab_is_eog(s->vocab, tok)) {
        j->stop_type = SRV_STOP_EOS;
        stop = true;
    }
    if (!stop) {
        char piece[256];
        int32_t pl = llama_token_to_piece(s->vocab, tok, piece, sizeof piece, 0, false);
        if (pl < 0)
            pl = 0;
        if (j->n_gen == j->gen_cap) {
            size_t gc = j->gen_cap ? j->gen_cap * 2 : 64;
            int32_t *gv = realloc(j->gen, gc * sizeof *gv);
            if (!gv) {
                pthread_mutex_unlock(&s->mu);
                g->status = 500;
                snprintf(g->msg, sizeof g->msg, "out of memory");
                return false;
            }
            j->gen = gv;
            j->gen_cap = gc;
        }
        j->gen[j->n_gen++] = tok;
        size_t before = j->len;
        if (text_add(j, piece, (size_t)pl) < 0) {
            pthread_mutex_unlock(&s->mu);
            g->status = 500;
            snprintf(g->msg, sizeof g->msg, "out of memory");
            return false;
        }
        if (memchr(piece, '\n', (size_t)pl))
            j->has_new_line = true;
        if (stop_words(j, before))
            stop = true;
        /* llama-server's n_indent: once a line is complete, a new line
         * indented less than n_indent ends the completion (cut there) */
        if (!stop && j->p.n_indent > 0) {
            if (g->last_nl > 0) {
                size_t pos = g->last_nl, ind = 0;
                while (pos < j->len && (j->text[pos] == ' ' || j->text[pos] == '\t')) {
                    ind++;
                    pos++;
                }
                if (pos < j->len && ind < (size_t)j->p.n_indent) {
                    j->len = pos;
                    j->text[pos] = 0;
                    j->stop_type = SRV_STOP_LIMIT;
                    stop = true;
                }
            }
            char *nl = memchr(j->text + g->last_nl, '\n', j->len - g->last_nl);
            if (nl)
                g->last_nl = (size_t)(nl - j->text) + 1;
        }
        if (!stop && j->has_new_line && j->p.t_max_predict_ms > 0 &&
            kvr__wk_now_ms() - g->t1 > j->p.t_max_predict_ms) {
            j->stop_type = SRV_STOP_LIMIT;
            stop = true;
        }
        if (stop)
            j->safe = utf8_whole(j->text, j->len);
        pthread_cond_broadcast(&s->progress);
    }
    pthread_mutex_unlock(&s->mu);
    g->i++;
    if (stop || g->i == g->limit)
        return false;
    g->next = tok;
    return true;
}

/* The prompt of job j into slot sl (seq 0 through the session engine, or
 * decoded directly), the first token sampled, the KV moved to the slot's
 * generation sequence. Returns true when tokens are to be decoded. */
static bool gen_start(srv *s, gen *g, srv_job *j, int slot)
{
    srv_slot *sl = &s->slots[slot];
    *g = (gen){ .j = j, .sl = sl, .seq = (int)kvr__wk_lm_n_seq(s->e.lm) + slot, .first = true };
    g->t0 = kvr__wk_now_ms();
    reconnect(s);
    if (j->p.cache_prompt && s->connected) {
        kvr__wk_sync_opts so = { .session = sl->session, .refresh = s->o.refresh,
                                .repair = &s->o.repair };
        int r = kvr__wk_sync(&s->e, j->toks, j->n, &so, &g->step, &g->res);
        if (r == 0)
            g->via_cache = true;
        else
            lost(s, "kvr__wk_sync");
    }
    if (!g->via_cache) {
        kvr__wk_step_free(g->step);
        g->step = NULL;
        g->res = (kvr__wk_sync_res){ 0 };
        if (prompt_direct(s, j) < 0) {
            log_line("decoding a prompt of %zu tokens failed: %s", j->n, s->e.err);
            kvr__wk_lm_clear(s->e.lm);
            pthread_mutex_lock(&s->mu);
            sl->processing = false;
            pthread_mutex_unlock(&s->mu);
            finish(s, j, 500, "server_error", s->e.err);
            kvr__srv_job_release(s, j);
            g->j = NULL;        /* ended here: the slot keeps what it held */
            return false;
        }
    }
    size_t n_eval = g->via_cache ? g->res.n_computed : j->n;
    if (n_eval > j->n)
        n_eval = j->n;
    g->t1 = kvr__wk_now_ms();
    pthread_mutex_lock(&s->mu);
    j->n_eval = n_eval;
    j->n_cache = j->n - n_eval;
    j->sync = g->res;
    j->via_cache = g->via_cache;
    j->t_prompt_ms = g->t1 - g->t0;
    s->m.prompt_tokens += n_eval;
    s->m.prompt_reused += j->n - n_eval;
    s->m.prompt_refreshed += g->via_cache ? g->res.n_refreshed : 0;
    s->m.prompt_placed += g->via_cache ? g->res.n_placed : 0;
    s->m.prompt_repaired += g->via_cache ? g->res.n_repaired : 0;
    s->m.prompt_seconds += (g->t1 - g->t0) / 1e3;
    pthread_mutex_unlock(&s->mu);

    size_t room = s->n_ctx > j->n ? s->n_ctx - j->n : 0;
    g->limit = j->p.n_predict < 0 ? room : (size_t)j->p.n_predict;
    if (g->limit > room)
        g->limit = room;
    uint64_t seed = j->p.seed == 0xFFFFFFFFu ? (uint64_t)time(NULL) ^ (uint64_t)(g->t0 * 1e3)
                                             : j->p.seed;
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(s->e.lm);
    if (kvr__srv_sampler_new(&g->sm, &j->p, s->vocab, in->n_vocab, seed) < 0)
        g->sm = NULL;
    /* the first token from the prompt's logits, before anything else decodes */
    bool more = gen_token(s, g, kvr__wk_lm_logits(s->e.lm));
    /* seq 0 is the session engine's: the prompt's cells move to the slot's
     * sequence (metadata only in the unified cache) */
    kvr__wk_lm_seq_rm(s->e.lm, g->seq, -1, -1);
    kvr__wk_lm_seq_cp(s->e.lm, 0, g->seq, -1, -1);
    kvr__wk_lm_clear(s->e.lm);
    return more;
}

/* The end of a generation: the answer marked done, then the prompt's KV
 * committed to the slot's session (seq 0 borrowed for it), the slot freed. */
static void gen_end(srv *s, gen *g)
{
    srv_job *j = g->j;
    srv_slot *sl = g->sl;
    kvr__srv_sampler_free(g->sm);
    g->sm = NULL;
    double t2 = kvr__wk_now_ms();
    pthread_mutex_lock(&s->mu);
    if (j->stop_type == SRV_STOP_NONE && j->n_gen >= g->limit && !j->cancelled && !g->status)
        j->stop_type = SRV_STOP_LIMIT;
    j->truncated = false;
    j->safe = utf8_whole(j->text ? j->text : "", j->len);
    j->t_gen_ms = t2 - g->t1;
    j->tokens_cached = j->n + (j->n_gen ? j->n_gen - 1 : 0);
    s->m.requests++;
    s->m.tokens_predicted += j->n_gen;
    s->m.predicted_seconds += (t2 - g->t1) / 1e3;
    pthread_mutex_unlock(&s->mu);
    finish(s, j, g->status, "server_error", g->msg);

    /* after the answer: the prompt's KV into the slot's session */
    if (g->step) {
        kvr__wk_lm_clear(s->e.lm);
        kvr__wk_lm_seq_cp(s->e.lm, g->seq, 0, 0, (int32_t)j->n);
        if (kvr__wk_commit(&s->e, g->step) < 0) {
            pthread_mutex_lock(&s->mu);
            s->m.commit_failed++;
            pthread_mutex_unlock(&s->mu);
            lost(s, "kvr__wk_commit");
        }
        kvr__wk_lm_clear(s->e.lm);
        kvr__wk_step_free(g->step);
        g->step = NULL;
    }
    kvr__wk_lm_seq_rm(s->e.lm, g->seq, -1, -1);
    int32_t *keep = realloc(sl->toks, (j->n ? j->n : 1) * sizeof *keep);
    if (keep)
        memcpy(keep, j->toks, j->n * sizeof *keep);
    pthread_mutex_lock(&s->mu);     /* /slots reads n and n_approx */
    if (keep) {
        sl->toks = keep;
        sl->n = j->n;
    }
    sl->n_approx = g->via_cache ? g->res.n_approx : 0;
    sl->last_used = (uint64_t)(t2 * 1e3);
    sl->processing = false;
    pthread_mutex_unlock(&s->mu);
    kvr__srv_job_release(s, j);
    g->j = NULL;
}

/* One decode of the next token of every generation in flight, then a token
 * sampled for each from its row. */
typedef struct step_rows {
    srv  *s;
    gen **g;
    bool *more;
} step_rows;

static void on_row(void *ud, size_t i, const float *row)
{
    step_rows *r = ud;
    r->more[i] = gen_token(r->s, r->g[i], row);
}

static void decode_step(srv *s, gen *gens)
{
    gen *act[SRV_MAX_SLOTS];
    kvr__wk_btok bt[SRV_MAX_SLOTS];
    bool more[SRV_MAX_SLOTS] = { false };
    size_t n = 0;
    for (int k = 0; k < s->n_slots; k++)
        if (gens[k].j) {
            act[n] = &gens[k];
            bt[n] = (kvr__wk_btok){ .tok = gens[k].next,
                                   .pos = (int32_t)(gens[k].j->n + gens[k].i - 1),
                                   .seq = gens[k].seq, .logits = true };
            n++;
        }
    if (!n)
        return;
    step_rows rows = { s, act, more };
    int r = kvr__wk_lm_decode_batch(s->e.lm, bt, n, on_row, &rows, s->e.err, sizeof s->e.err);
    for (size_t i = 0; i < n; i++) {
        if (r < 0 && !act[i]->status) {
            act[i]->status = 500;
            snprintf(act[i]->msg, sizeof act[i]->msg, "%.500s", s->e.err);
        }
        if (r < 0 || !more[i])
            gen_end(s, act[i]);
    }
}

/* ---- slot save / restore / erase: kvrope contexts ---------------------- */

static void saved_name(const srv *s, const char *file, char *out, size_t cap)
{
    uint64_t h = s->model_hash;
    for (const char *p = file; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ull;
    snprintf(out, cap, "kvs-save-%016llx", (unsigned long long)h);
}

static void run_slot_op(srv *s, srv_job *j)
{
    srv_slot *sl = &s->slots[j->p.id_slot];
    double t0 = kvr__wk_now_ms();
    reconnect(s);
    if (!s->connected) {
        finish(s, j, 503, "unavailable_error", "kvroped is unreachable");
        return;
    }
    char saved[KVR_ID_MAX + 1];
    saved_name(s, j->slot_file, saved, sizeof saved);
    kvr_context info = { 0 };
    int r = 0;
    const char *from = j->kind == SRV_JOB_SLOT_SAVE ? sl->session : saved;
    const char *to = j->kind == SRV_JOB_SLOT_SAVE ? saved : sl->session;
    if (j->kind == SRV_JOB_SLOT_ERASE) {
        r = kvr_client_stat(s->e.kc, sl->session, &info);
        if (r == 0)
            r = kvr_client_delete(s->e.kc, sl->session);
        if (r == KVR_ENOCTX)
            r = 0, info.n_tokens = 0;
        if (r == 0) {
            pthread_mutex_lock(&s->mu);
            free(sl->toks);
            sl->toks = NULL;
            sl->n = 0;
            pthread_mutex_unlock(&s->mu);
        }
    } else {
        r = kvr_client_stat(s->e.kc, from, &info);
        if (r == 0) {
            int d = kvr_client_delete(s->e.kc, to);
            if (d < 0 && d != KVR_ENOCTX)
                r = d;
        }
        if (r == 0)
            r = kvr_client_fork(s->e.kc, from, to);
        if (r == 0 && j->kind == SRV_JOB_SLOT_RESTORE) {
            pthread_mutex_lock(&s->mu);
            free(sl->toks);   /* the next request finds the context by its session */
            sl->toks = NULL;
            sl->n = 0;
            pthread_mutex_unlock(&s->mu);
        }
    }
    double t1 = kvr__wk_now_ms();
    if (r == KVR_ENOCTX) {
        char m[400];
        if (j->kind == SRV_JOB_SLOT_SAVE)
            snprintf(m, sizeof m, "slot %d holds no cached prompt", j->p.id_slot);
        else
            snprintf(m, sizeof m, "no slot was saved as %s", j->slot_file);
        finish(s, j, j->kind == SRV_JOB_SLOT_SAVE ? 400 : 404,
               j->kind == SRV_JOB_SLOT_SAVE ? "invalid_request_error" : "not_found_error", m);
        return;
    }
    if (r < 0) {
        s->e.kv_code = r;
        snprintf(s->e.err, sizeof s->e.err, "%s", kvr_client_last_error(s->e.kc));
        char m[1200];
        snprintf(m, sizeof m, "kvrope: %s", s->e.err);
        if (is_conn_err(r))
            lost(s, "slot operation");
        finish(s, j, 500, "server_error", m);
        return;
    }
    pthread_mutex_lock(&s->mu);
    j->n_saved = (size_t)info.n_tokens;
    j->t_op_ms = t1 - t0;
    pthread_mutex_unlock(&s->mu);
    finish(s, j, 0, "", "");
}

/* ---- the thread --------------------------------------------------------- */

static void idle_refresh(srv *s)
{
    if (!s->connected)
        return;
    for (int i = 0; i < s->n_slots; i++) {
        srv_slot *sl = &s->slots[i];
        if (!sl->n_approx)
            continue;
        size_t done = 0;
        int r = kvr__wk_refresh_idle(&s->e, sl->session, REFRESH_BUDGET, SIZE_MAX, &done);
        if (r < 0)
            lost(s, "background refresh");
        pthread_mutex_lock(&s->mu);
        sl->n_approx = r < 0 || done >= sl->n_approx || done == 0 ? 0 : sl->n_approx - done;
        s->m.refreshed_idle += r < 0 ? 0 : done;
        pthread_mutex_unlock(&s->mu);
        return;     /* one budget (or a failure), then look at the queue again */
    }
}

/* The first queued job that can start now, taken off the queue: a
 * cancelled one (*slot -1), a generation when fewer than n_gen_max generate
 * (the KV cache holds that many beside the prompt being prepared) and a slot
 * for it is free, a slot operation on a free slot. NULL: none. Called under
 * srv.mu. */
static srv_job *admit(srv *s, int *slot, int active)
{
    kvr_list *n;
    kvr_list_foreach(n, &s->queue) {
        srv_job *j = kvr_list_entry(n, srv_job, node);
        int k = j->cancelled || s->stopping ? -1
              : j->kind == SRV_JOB_GEN ? (active < s->n_gen_max ? pick_slot(s, j) : -2)
              : s->slots[j->p.id_slot].processing ? -2 : j->p.id_slot;
        if (k == -2 || (k == -1 && !(j->cancelled || s->stopping)))
            continue;
        kvr_list_remove(&j->node);
        s->q_len--;
        *slot = k;
        return j;
    }
    return NULL;
}

static void *engine_main(void *arg)
{
    srv *s = arg;
    gen gens[SRV_MAX_SLOTS];
    memset(gens, 0, sizeof gens);
    pthread_mutex_lock(&s->mu);
    for (;;) {
        int active = 0;
        for (int k = 0; k < s->n_slots; k++)
            active += gens[k].j != NULL;
        int slot = -1;
        srv_job *j = admit(s, &slot, active);
        if (!j && !active) {
            if (s->stopping && kvr_list_empty(&s->queue))
                break;
            /* idle: background refresh of approximate tokens, a budget at a time */
            bool pending = false;
            for (int i = 0; i < s->n_slots; i++)
                pending |= s->slots[i].n_approx > 0;
            if (!pending || !kvr_list_empty(&s->queue)) {
                pthread_cond_wait(&s->wake, &s->mu);
                continue;
            }
            struct timespec ts = kvr_clock_deadline((uint64_t)s->o.idle_ms);
            if (pthread_cond_timedwait(&s->wake, &s->mu, &ts) == ETIMEDOUT &&
                kvr_list_empty(&s->queue) && !s->stopping) {
                pthread_mutex_unlock(&s->mu);
                idle_refresh(s);
                pthread_mutex_lock(&s->mu);
            }
            continue;
        }
        if (j && slot >= 0 && j->kind == SRV_JOB_GEN) {
            srv_slot *sl = &s->slots[slot];
            j->slot = slot;
            j->started = true;
            sl->processing = true;
            sl->id_task = s->next_task++;
        }
        pthread_mutex_unlock(&s->mu);
        if (j && slot < 0) {
            finish(s, j, 503, "unavailable_error", "cancelled");
            kvr__srv_job_release(s, j);
        } else if (j && j->kind == SRV_JOB_GEN) {
            if (!gen_start(s, &gens[slot], j, slot) && gens[slot].j)
                gen_end(s, &gens[slot]);
        } else if (j) {
            run_slot_op(s, j);
            kvr__srv_job_release(s, j);
        }
        /* one token for every generation in flight, then the queue again */
        decode_step(s, gens);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int kvr__srv_engine_start(srv *s)
{
    return pthread_create(&s->engine, NULL, engine_main, s) == 0 ? 0 : KVR_ESYS;
}

void kvr__srv_engine_stop(srv *s)
{
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    kvr_list *n;
    kvr_list_foreach(n, &s->queue)
        kvr_list_entry(n, srv_job, node)->cancelled = true;
    pthread_cond_broadcast(&s->wake);
    pthread_cond_broadcast(&s->progress);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->engine, NULL);
    for (int i = 0; i < s->n_slots; i++)
        free(s->slots[i].toks);
}
