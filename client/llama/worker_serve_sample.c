/*
 * worker_serve_sample.c — the sampler chain of `kvrope-llama serve`.
 *
 * llama-server's samplers, by its names and in the order a request gives
 * (default: penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc,
 * temperature), then a draw from the softmax of the logits that are left.
 * The semantics follow llama.cpp v0.5.0's samplers (src/llama-sampler.cpp):
 *
 *   penalties    tokens seen in the last repeat_last_n of prompt + output:
 *                logit / repeat_penalty (x when <= 0), minus count x
 *                frequency_penalty and presence_penalty;
 *   dry          a token that would extend a repetition of the context
 *                longer than dry_allowed_length (within dry_penalty_last_n,
 *                not across a sequence breaker) loses dry_multiplier x
 *                dry_base ^ (length - allowed);
 *   top_n_sigma  logits below max - n x their standard deviation are -inf;
 *   top_k, top_p, min_p, typ_p   the usual cuts (min_keep honoured);
 *   xtc          with probability xtc_probability, the tokens at or above
 *                xtc_threshold except the least likely of them are removed;
 *   infill       llama.cpp's infill sampler (end-of-generation when text is
 *                unlikely; tokens that are prefixes of others merged, among
 *                the 256 likeliest; cut below 0.2, then below 1 / (kept + 1));
 *   temperature  logits / t; t <= 0 keeps only the largest (greedy).
 *
 * The draw is from the softmax of the logits left (as llama.cpp's dist:
 * probabilities the filters computed only decide what is kept). Greedy
 * requests whose chain cannot drop the best token skip the sort (argmax).
 *
 * DRY's sequence breakers are the breaker strings' own tokenisations and
 * every token whose text contains a breaker; llama.cpp also treats a token
 * that ends with the start of a breaker as the head of a multi-token one.
 * adaptive_p and mirostat are not implemented (a request naming adaptive_p
 * gets the plain draw).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

#include "client/llama/worker_serve.h"

typedef struct cand {
    float   logit, p, score;
    int32_t id;
} cand;

struct srv_sampler {
    const srv_params        *p;
    const struct llama_vocab *vocab;
    size_t    nv;
    cand     *c;             /* n_vocab candidates; c[0..n) the current set */
    size_t    n;
    bool      sorted;        /* c[0..n) by logit, descending */
    uint64_t  rng;
    int32_t  *cnt;           /* n_vocab counts (penalties), zero between calls */
    int32_t  *dry_max;       /* n_vocab longest repeat a token extends, -1 none */
    uint8_t  *brk1;          /* n_vocab: a single-token DRY breaker */
    int32_t **brk_seq;       /* DRY breakers as token sequences (head first) */
    int32_t  *brk_len;
    int       n_brk;
    int32_t  *z;             /* DRY scratch: window + 1 */
    int32_t  *win;
    size_t    win_cap;
    char      piece[256];
    char      pieces[256][64];  /* infill: the texts of its candidates (cut at 64 bytes) */
    uint16_t  plen[256];
};

static int cand_desc(const void *a, const void *b)
{
    float x = ((const cand *)a)->logit, y = ((const cand *)b)->logit;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void sort_set(srv_sampler *s)
{
    if (!s->sorted)
        qsort(s->c, s->n, sizeof *s->c, cand_desc);
    s->sorted = true;
}

/* p of c[0..n) from the logits. */
static void softmax(srv_sampler *s)
{
    float mx = -INFINITY;
    for (size_t i = 0; i < s->n; i++)
        if (s->c[i].logit > mx)
            mx = s->c[i].logit;
    float sum = 0;
    for (size_t i = 0; i < s->n; i++) {
        s->c[i].p = expf(s->c[i].logit - mx);
        sum += s->c[i].p;
    }
    for (size_t i = 0; i < s->n; i++)
        s->c[i].p /= sum;
}

static uint64_t rng_next(uint64_t *st)
{
    uint64_t z = (*st += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_unit(uint64_t *st) { return (double)(rng_next(st) >> 11) / 9007199254740992.0; }

/* The history the penalties see: the prompt, then the output. */
typedef struct hist {
    const int32_t *a, *b;
    size_t na, nb;
} hist;

static int32_t hist_at(const hist *h, size_t i) { return i < h->na ? h->a[i] : h->b[i - h->na]; }

/* ---- penalties ---------------------------------------------------------- */

static bool penalties_on(const srv_params *p)
{
    return p->repeat_last_n != 0 && (p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f ||
                                     p->presence_penalty != 0.0f);
}

static void penalties(srv_sampler *s, const hist *h)
{
    const srv_params *p = s->p;
    if (!penalties_on(p))
        return;
    size_t len = h->na + h->nb, w = (size_t)p->repeat_last_n < len ? (size_t)p->repeat_last_n : len;
    for (size_t i = len - w; i < len; i++) {
        int32_t t = hist_at(h, i);
        if (t >= 0 && (size_t)t < s->nv)
            s->cnt[t]++;
    }
    for (size_t i = 0; i < s->n; i++) {
        int32_t k = s->cnt[s->c[i].id];
        if (!k)
            continue;
        float *l = &s->c[i].logit;
        *l = *l <= 0 ? *l * p->repeat_penalty : *l / p->repeat_penalty;
        *l -= (float)k * p->frequency_penalty + p->presence_penalty;
    }
    for (size_t i = len - w; i < len; i++) {
        int32_t t = hist_at(h, i);
        if (t >= 0 && (size_t)t < s->nv)
            s->cnt[t] = 0;
    }
    s->sorted = false;
}

/* ---- DRY ---------------------------------------------------------------- */

static int dry_setup(srv_sampler *s)
{
    const srv_params *p = s->p;
    s->brk1 = calloc(s->nv, 1);
    s->dry_max = malloc(s->nv * sizeof *s->dry_max);
    s->brk_seq = calloc((size_t)p->n_dry_breakers + 1, sizeof *s->brk_seq);
    s->brk_len = calloc((size_t)p->n_dry_breakers + 1, sizeof *s->brk_len);
    if (!s->brk1 || !s->dry_max || !s->brk_seq || !s->brk_len)
        return KVR_ENOMEM;
    for (size_t i = 0; i < s->nv; i++)
        s->dry_max[i] = -1;
    for (int b = 0; b < p->n_dry_breakers; b++) {
        const char *w = p->dry_breakers[b];
        size_t wl = strlen(w);
        if (!wl)
            continue;
        int32_t tmp[64];
        int32_t n = llama_tokenize(s->vocab, w, (int32_t)wl, tmp, 64, false, false);
        if (n > 0) {
            if (n == 1) {
                s->brk1[tmp[0]] = 1;
            } else {
                s->brk_seq[s->n_brk] = malloc((size_t)n * sizeof(int32_t));
                if (!s->brk_seq[s->n_brk])
                    return KVR_ENOMEM;
                memcpy(s->brk_seq[s->n_brk], tmp, (size_t)n * sizeof(int32_t));
                s->brk_len[s->n_brk++] = n;
            }
        }
    }
    /* every token whose text holds a breaker breaks a sequence by itself */
    for (size_t t = 0; t < s->nv; t++) {
        int32_t pl = llama_token_to_piece(s->vocab, (int32_t)t, s->piece, sizeof s->piece - 1,
                                          0, true);
        if (pl <= 0)
            continue;
        s->piece[pl] = 0;
        for (int b = 0; b < p->n_dry_breakers && !s->brk1[t]; b++)
            if (*p->dry_breakers[b] && memmem(s->piece, (size_t)pl, p->dry_breakers[b],
                                              strlen(p->dry_breakers[b])))
                s->brk1[t] = 1;
    }
    return 0;
}

/* Z-array of r[0..n) (r read backwards from the end of the window):
 * z[k] = the longest common prefix of r and r[k..]. */
static void z_array(const int32_t *r, size_t n, int32_t *z)
{
    size_t l = 0, rr = 0;
    z[0] = (int32_t)n;
    for (size_t k = 1; k < n; k++) {
        size_t m = 0;
        if (k < rr)
            m = (size_t)z[k - l] < rr - k ? (size_t)z[k - l] : rr - k;
        while (k + m < n && r[m] == r[k + m])
            m++;
        z[k] = (int32_t)m;
        if (k + m > rr) {
            l = k;
            rr = k + m;
        }
    }
}

static bool dry_on(const srv_params *p)
{
    return p->dry_multiplier != 0.0f && p->dry_base >= 1.0f && p->dry_penalty_last_n != 0;
}

static int dry(srv_sampler *s, const hist *h)
{
    const srv_params *p = s->p;
    if (!dry_on(p))
        return 0;
    size_t len = h->na + h->nb;
    size_t w = (size_t)p->dry_penalty_last_n < len ? (size_t)p->dry_penalty_last_n : len;
    if (w <= (size_t)p->dry_allowed_length)
        return 0;
    if (!s->brk1 && dry_setup(s) < 0)
        return KVR_ENOMEM;
    if (w > s->win_cap) {
        int32_t *a = realloc(s->win, w * sizeof *a), *b = realloc(s->z, w * sizeof *b);
        if (a)
            s->win = a;
        if (b)
            s->z = b;
        if (!a || !b)
            return KVR_ENOMEM;
        s->win_cap = w;
    }
    int32_t *r = s->win;                 /* r[i]: the token i places from the end */
    for (size_t i = 0; i < w; i++)
        r[i] = hist_at(h, len - 1 - i);
    /* the repetition may not reach back across a breaker */
    size_t rep_limit = w;
    for (size_t i = 0; i < w; i++) {
        int longest = -1;
        if (r[i] >= 0 && (size_t)r[i] < s->nv && s->brk1[r[i]])
            longest = 0;
        for (int b = 0; b < s->n_brk; b++) {
            int tl = s->brk_len[b] - 1;
            if (s->brk_seq[b][0] != r[i] || tl <= longest || (size_t)tl > i)
                continue;
            int k = 0;
            while (k < tl && s->brk_seq[b][k + 1] == r[i - 1 - (size_t)k])
                k++;
            if (k == tl)
                longest = tl;
        }
        if (longest >= 0) {
            rep_limit = i - (size_t)longest;
            break;
        }
    }
    if (rep_limit < (size_t)p->dry_allowed_length)
        return 0;
    z_array(r, w, s->z);
    /* r[k] ends a copy of the window's last z[k] tokens: r[k - 1], the token
     * after it, would extend that repetition */
    for (size_t k = 1; k < w; k++) {
        int32_t m = s->z[k] < (int32_t)rep_limit ? s->z[k] : (int32_t)rep_limit;
        int32_t t = r[k - 1];
        if (m >= p->dry_allowed_length && t >= 0 && (size_t)t < s->nv && m > s->dry_max[t])
            s->dry_max[t] = m;
    }
    int max_exp = p->dry_base > 1.000001f ? (int)(88.7228391f / logf(p->dry_base)) : 0;
    for (size_t i = 0; i < s->n; i++) {
        int32_t t = s->c[i].id, m = s->dry_max[t];
        if (m < 0 || s->brk1[t])
            continue;
        int e = m - p->dry_allowed_length;
        if (max_exp > 0 && e > max_exp)
            e = max_exp;
        s->c[i].logit -= p->dry_multiplier * powf(p->dry_base, (float)e);
    }
    for (size_t k = 1; k < w; k++) {
        int32_t t = r[k - 1];
        if (t >= 0 && (size_t)t < s->nv)
            s->dry_max[t] = -1;
    }
    s->sorted = false;
    return 0;
}

/* ---- filters ------------------------------------------------------------ */

static void top_n_sigma(srv_sampler *s, float nsig)
{
    if (nsig <= 0.0f || s->n <= 1)
        return;
    float mx = -INFINITY;
    double sum = 0;
    size_t k = 0;
    for (size_t i = 0; i < s->n; i++)
        if (s->c[i].logit != -INFINITY) {
            if (s->c[i].logit > mx)
                mx = s->c[i].logit;
            sum += (double)s->c[i].logit;
            k++;
        }
    double mean = k ? sum / (double)k : 0, acc = 0;
    for (size_t i = 0; i < s->n; i++)
        if (s->c[i].logit != -INFINITY)
            acc += ((double)s->c[i].logit - mean) * ((double)s->c[i].logit - mean);
    float sd = k ? (float)sqrt(acc / (double)k) : 0.0f;
    for (size_t i = 0; i < s->n; i++)
        if (s->c[i].logit < mx - nsig * sd)
            s->c[i].logit = -INFINITY;
}

static void top_p(srv_sampler *s, float pp, size_t min_keep)
{
    if (pp >= 1.0f)
        return;
    sort_set(s);
    softmax(s);
    float cum = 0;
    for (size_t i = 0; i < s->n; i++) {
        cum += s->c[i].p;
        if (cum >= pp && i + 1 >= min_keep) {
            s->n = i + 1;
            return;
        }
    }
}

static void min_p(srv_sampler *s, float mp, size_t min_keep)
{
    if (mp <= 0.0f || !s->n)
        return;
    sort_set(s);
    float lim = s->c[0].logit + logf(mp);
    size_t i = 1;
    while (i < s->n && !(s->c[i].logit < lim && i >= min_keep))
        i++;
    s->n = i;
}

static int score_asc(const void *a, const void *b)
{
    float x = ((const cand *)a)->score, y = ((const cand *)b)->score;
    return x < y ? -1 : x > y ? 1 : 0;
}

static void typical(srv_sampler *s, float tp, size_t min_keep)
{
    if (tp >= 1.0f || !s->n)
        return;
    sort_set(s);
    softmax(s);
    double ent = 0;
    for (size_t i = 0; i < s->n; i++)
        if (s->c[i].p > 0)
            ent -= (double)s->c[i].p * log((double)s->c[i].p);
    for (size_t i = 0; i < s->n; i++)
        s->c[i].score = fabsf(-logf(s->c[i].p) - (float)ent);
    qsort(s->c, s->n, sizeof *s->c, score_asc);
    float cum = 0;
    for (size_t i = 0; i < s->n; i++) {
        cum += s->c[i].p;
        if (cum > tp && (min_keep == 0 || i + 1 >= min_keep)) {
            s->n = i + 1;
            break;
        }
    }
    s->sorted = false;
}

static void xtc(srv_sampler *s, float prob, float thold, size_t min_keep)
{
    if (prob <= 0.0f || thold > 0.5f || s->n < 2)
        return;
    if ((float)rng_unit(&s->rng) > prob)
        return;
    sort_set(s);
    softmax(s);
    size_t last = 0;
    for (size_t i = 0; i < s->n && s->c[i].p >= thold; i++)
        last = i;
    if (last > 0 && s->n - last >= min_keep) {
        memmove(s->c, s->c + last, (s->n - last) * sizeof *s->c);
        s->n -= last;
    }
}

/* Keeps the end-of-generation tokens and the survivors above thold (p
 * renormalised); returns how many kept tokens are text. */
static size_t infill_cut(srv_sampler *s, float thold)
{
    size_t keep = 0, text = 0;
    float sum = 0;
    for (size_t i = 0; i < s->n; i++) {
        bool eog = llama_vocab_is_eog(s->vocab, s->c[i].id);
        if (s->c[i].p < thold && !eog)
            continue;
        text += !eog;
        sum += s->c[i].p;
        s->c[keep++] = s->c[i];
    }
    s->n = keep;
    for (size_t i = 0; i < s->n && sum > 0; i++)
        s->c[i].p /= sum;
    return text;
}

#define INFILL_MERGE_MAX 256    /* the prefix merge is quadratic: the likeliest candidates
                                   only (llama.vim puts top_k 40 before it) */

static void infill(srv_sampler *s)
{
    if (!s->n)
        return;
    sort_set(s);
    softmax(s);
    float txt = 0, eog = 0;
    for (size_t i = 0; i < s->n; i++)
        *(llama_vocab_is_eog(s->vocab, s->c[i].id) ? &eog : &txt) += s->c[i].p;
    if (3 * eog * (float)s->n > txt) {       /* text is unlikely: end here */
        size_t keep = 0;
        for (size_t i = 0; i < s->n; i++)
            if (llama_vocab_is_eog(s->vocab, s->c[i].id))
                s->c[keep++] = s->c[i];
        s->n = keep;
        for (size_t i = 0; i < s->n; i++)
            s->c[i].p /= eog;
        s->sorted = false;
        return;
    }
    /* a token that is a prefix of another: the two merged into the likelier */
    size_t m = s->n < INFILL_MERGE_MAX ? s->n : INFILL_MERGE_MAX;
    for (size_t i = 0; i < m; i++) {
        int32_t pl = llama_token_to_piece(s->vocab, s->c[i].id, s->pieces[i],
                                          sizeof s->pieces[i], 0, false);
        s->plen[i] = pl > 0 ? (uint16_t)pl : 0;
    }
    for (size_t i0 = 0; i0 < m; i0++) {
        for (size_t i1 = 0; i1 < m; i1++) {
            if (s->c[i0].logit == -INFINITY)
                break;
            if (i0 == i1 || s->c[i1].logit == -INFINITY)
                continue;
            size_t l0 = s->plen[i0], l1 = s->plen[i1];
            if (l0 > 0 && l0 <= l1 && !memcmp(s->pieces[i0], s->pieces[i1], l0)) {
                size_t dst = i0, src = i1;
                if (s->c[i1].p > s->c[i0].p)
                    dst = i1, src = i0;
                s->c[dst].p += s->c[src].p;
                s->c[src].logit = -INFINITY;
                s->c[src].p = 0.0f;
            }
        }
    }
    s->sorted = false;
    size_t text = infill_cut(s, 0.2f);
    if (!text) {            /* nothing likely enough: end the middle */
        int32_t eot = llama_vocab_eot(s->vocab);
        if (eot == LLAMA_TOKEN_NULL)
            eot = llama_vocab_eos(s->vocab);
        if (eot == LLAMA_TOKEN_NULL || eot < 0 || (size_t)eot >= s->nv) {
            s->n = s->n ? 1 : 0;    /* no end token: the likeliest left */
            return;
        }
        s->c[0] = (cand){ .logit = 1.0f, .p = 1.0f, .id = eot };
        s->n = 1;
        return;
    }
    infill_cut(s, 1.0f / (float)(text + 1));
}

static void temperature(srv_sampler *s, float t)
{
    if (!s->n)
        return;
    if (t <= 0.0f) {        /* greedy: the largest logit alone */
        size_t best = 0;
        for (size_t i = 1; i < s->n; i++)
            if (s->c[i].logit > s->c[best].logit)
                best = i;
        s->c[0] = s->c[best];
        s->n = 1;
        s->sorted = true;
        return;
    }
    for (size_t i = 0; i < s->n; i++)
        s->c[i].logit /= t;
}

/* ---- the chain ---------------------------------------------------------- */

/* Whether the chain can drop the most likely token, or penalise after the
 * greedy cut (else a greedy request is an argmax after the logit penalties). */
static bool may_drop_best(const srv_params *p)
{
    bool temp = false;
    for (int k = 0; k < p->n_samplers; k++)
        switch (p->samplers[k]) {
        case SRV_SAMP_PENALTIES:
        case SRV_SAMP_DRY:
            if (temp)       /* after greedy's cut: they change nothing, the fast path would */
                return true;
            break;
        case SRV_SAMP_TYP_P:
            if (p->typical_p < 1.0f)
                return true;
            break;
        case SRV_SAMP_XTC:
            if (p->xtc_probability > 0.0f && p->xtc_threshold <= 0.5f)
                return true;
            break;
        case SRV_SAMP_INFILL:
            return true;
        case SRV_SAMP_TEMP:
            temp = true;
            break;
        default:
            break;
        }
    return !temp;
}

int kvr__srv_sampler_new(srv_sampler **out, const srv_params *p, const struct llama_vocab *vocab,
                         size_t n_vocab, uint64_t seed)
{
    srv_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return KVR_ENOMEM;
    s->p = p;
    s->vocab = vocab;
    s->nv = n_vocab;
    s->rng = seed;
    s->c = malloc(n_vocab * sizeof *s->c);
    s->cnt = calloc(n_vocab, sizeof *s->cnt);
    if (!s->c || !s->cnt) {
        kvr__srv_sampler_free(s);
        return KVR_ENOMEM;
    }
    *out = s;
    return 0;
}

void kvr__srv_sampler_free(srv_sampler *s)
{
    if (!s)
        return;
    for (int b = 0; b < s->n_brk; b++)
        free(s->brk_seq[b]);
    free(s->brk_seq);
    free(s->brk_len);
    free(s->brk1);
    free(s->dry_max);
    free(s->z);
    free(s->win);
    free(s->cnt);
    free(s->c);
    free(s);
}

int32_t kvr__srv_sample(srv_sampler *s, const float *logits, const int32_t *prompt, size_t n_prompt,
                        const int32_t *gen, size_t n_gen)
{
    const srv_params *p = s->p;
    hist h = { prompt, gen, n_prompt, n_gen };
    bool fast = p->temperature <= 0.0f && !may_drop_best(p);
    if (fast && !penalties_on(p) && !dry_on(p))
        return kvr__wk_argmax(logits, s->nv);       /* greedy, nothing to change: no copy */
    for (size_t i = 0; i < s->nv; i++)
        s->c[i] = (cand){ .logit = logits[i], .id = (int32_t)i };
    s->n = s->nv;
    s->sorted = false;
    for (int k = 0; k < p->n_samplers; k++) {
        switch (p->samplers[k]) {
        case SRV_SAMP_PENALTIES:
            penalties(s, &h);
            break;
        case SRV_SAMP_DRY:
            if (dry(s, &h) < 0)
                return KVR_ENOMEM;
            break;
        default:
            break;
        }
        if (fast)
            continue;
        switch (p->samplers[k]) {
        case SRV_SAMP_TOP_N_SIGMA:
            top_n_sigma(s, p->top_n_sigma);
            break;
        case SRV_SAMP_TOP_K:
            if (p->top_k > 0 && (size_t)p->top_k < s->n) {
                sort_set(s);
                s->n = (size_t)p->top_k;
            }
            break;
        case SRV_SAMP_TYP_P:
            typical(s, p->typical_p, (size_t)p->min_keep);
            break;
        case SRV_SAMP_TOP_P:
            top_p(s, p->top_p, (size_t)p->min_keep);
            break;
        case SRV_SAMP_MIN_P:
            min_p(s, p->min_p, (size_t)p->min_keep);
            break;
        case SRV_SAMP_XTC:
            xtc(s, p->xtc_probability, p->xtc_threshold, (size_t)p->min_keep);
            break;
        case SRV_SAMP_INFILL:
            infill(s);
            break;
        case SRV_SAMP_TEMP:
            temperature(s, p->temperature);
            break;
        default:
            break;
        }
    }
    if (fast || s->n == 0) {
        size_t best = 0;
        for (size_t i = 1; i < s->n; i++)
            if (s->c[i].logit > s->c[best].logit)
                best = i;
        return s->n ? s->c[best].id : kvr__wk_argmax(logits, s->nv);
    }
    softmax(s);
    double r = rng_unit(&s->rng), acc = 0;
    for (size_t i = 0; i < s->n; i++) {
        acc += (double)s->c[i].p;
        if (r < acc)
            return s->c[i].id;
    }
    return s->c[s->n - 1].id;
}
