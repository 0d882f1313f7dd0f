/*
 * cover.c — covers: which cached runs make up a prompt, wherever they sit
 * (cache.h has the contract, grain.h the index it reads).
 *
 * The search rolls the grain hash over every prompt offset p and looks the
 * key up; every entry whose key matches is checked token by token against
 * its context's mirror (a hash is never trusted) and extended left and
 * right as far as the tokens agree: a maximal run, prompt [a, b) = context
 * [ca, ca + b - a). A run found at p starts at or before p, so once some
 * run reaches past p + G the grains at p..reach - G are inside it and the
 * scan jumps to reach - G + 1 (a run there can only be found again or end
 * within a grain of the known one). Bounds per call, whatever the prompt:
 * at most KVR_COVER_MAX_TOKENS tokens, COVER_HITS candidates and
 * COVER_STEPS chain steps per lookup, and a budget of token comparisons
 * (COVER_WORK_PER_TOKEN per prompt token); past it the search stops and
 * the cover is built from what was found (res->truncated).
 *
 * Choosing: the longest exact run (prompt offset 0 = context offset 0, so
 * its KV is a full encode's, when the context's own KV was computed from its
 * first token at consecutive positions: exact_in_context) goes first; then a sweep takes, at each
 * uncovered offset, the run reaching furthest (exact ones first on a tie)
 * and places the rest of it there: the fewest pieces that cover what the
 * runs cover. A piece shorter than min_run is left as a gap. Tokens without
 * KV (KVR_TOKEN_PENDING) are never in a piece.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/cover.h"
#include "cache/layout.h"

#define G KVR_GRAIN
#define COVER_HITS 8                 /* candidates taken per grain lookup */
#define COVER_STEPS 64               /* chain entries looked at per lookup */
#define COVER_WORK_PER_TOKEN 64      /* token comparisons per prompt token... */
#define COVER_WORK_FLOOR 65536       /* ...plus these */
#define COVER_SYNC_BUDGET ((size_t)1 << 18)  /* lagging contexts' tokens indexed per call */

typedef struct run {
    size_t   a, b;                   /* prompt [a, b) */
    size_t   ca;                     /* = context [ca, ca + b - a) */
    kvr_ctx *c;
    bool     exact;
} run;

typedef struct search {
    const uint32_t *t;
    size_t          n, p, reach;
    run            *runs;
    size_t          n_runs, cap_runs;
    size_t          work, work_max;
    size_t          n_hits, n_rejected;
    int             rc;
} search;

static bool push_run(search *S, run r)
{
    if (S->n_runs == S->cap_runs) {
        size_t cap = S->cap_runs ? S->cap_runs * 2 : 64;
        run *a = kvr_mem_realloc(S->runs, cap * sizeof *a);
        if (!a) {
            S->rc = KVR_ENOMEM;
            return false;
        }
        S->runs = a;
        S->cap_runs = cap;
    }
    S->runs[S->n_runs++] = r;
    return true;
}

/* One candidate: grain `grain` of c for prompt offset S->p. */
static bool on_hit(void *ud, kvr_ctx *c, uint32_t grain)
{
    search *S = ud;
    const kvr_grain_ctx *g = &c->grain;
    const uint32_t *t = S->t;
    size_t p = S->p, co = (size_t)grain * G;
    S->n_hits++;
    S->work += G;
    if (memcmp(g->tok + co, t + p, G * sizeof *t) != 0) {
        S->n_rejected++;
        return S->work < S->work_max;
    }
    size_t a = p, ca = co;
    while (a > 0 && ca > 0 && t[a - 1] == g->tok[ca - 1]) {
        a--;
        ca--;
    }
    size_t b = p + G, cb = co + G;
    while (b < S->n && cb < g->ok_tok && t[b] == g->tok[cb]) {
        b++;
        cb++;
    }
    S->work += b - a - G;
    if (!push_run(S, (run){ .a = a, .b = b, .ca = ca, .c = c, .exact = a == 0 && ca == 0 }))
        return false;
    if (b > S->reach)
        S->reach = b;
    return S->work < S->work_max;
}

/* Every maximal run the index knows of, within the bounds. */
static int find_runs(const kvr_model *m, search *S, kvr_cover_result *res)
{
    if (S->n < G)
        return 0;
    uint64_t h = 0;
    bool rolled = false;
    for (size_t p = 0; p + G <= S->n;) {
        if (S->reach >= p + G) {             /* inside a known run: jump */
            p = S->reach - G + 1;
            rolled = false;
            continue;
        }
        h = rolled ? kvr_grain_roll_next(h, S->t[p - 1], S->t[p + G - 1])
                   : kvr_grain_roll_init(S->t + p);
        rolled = true;
        S->p = p;
        res->n_lookups++;
        kvr_grain_lookup(m, kvr_grain_roll_key(h), COVER_HITS, COVER_STEPS, on_hit, S);
        if (S->rc)
            return S->rc;
        if (S->work >= S->work_max) {
            res->truncated = true;
            break;
        }
        p++;
    }
    return 0;
}

/* Runs of contexts with tokens without KV are cut around them. */
static int cut_pending(search *S)
{
    size_t n0 = S->n_runs;
    for (size_t i = 0; i < n0; i++) {
        run *r = &S->runs[i];
        kvr_ctx *c = r->c;
        size_t from = r->ca, to = r->ca + (r->b - r->a);
        if (c->n_exact >= to || kvr_ctx_count_flag(c, from, to, KVR_TOKEN_PENDING) == 0)
            continue;
        run whole = *r;
        r->b = r->a;                         /* emptied; the pieces are appended */
        size_t k = 0, lo = SIZE_MAX;
        for (size_t e = 0; e < c->n_ext && k < to; k += c->ext[e].count, e++) {
            size_t x0 = k > from ? k : from;
            size_t x1 = k + c->ext[e].count < to ? k + c->ext[e].count : to;
            if (x1 <= x0)
                continue;
            bool pend = c->ext[e].flags & KVR_TOKEN_PENDING;
            if (!pend && lo == SIZE_MAX)
                lo = x0;
            if ((pend || x1 == to) && lo != SIZE_MAX) {
                size_t hi = pend ? x0 : x1;
                run p = whole;
                p.a = whole.a + (lo - whole.ca);
                p.b = whole.a + (hi - whole.ca);
                p.ca = lo;
                p.exact = whole.exact && lo == whole.ca;
                if (p.b > p.a && !push_run(S, p))
                    return S->rc;
                lo = SIZE_MAX;
            }
        }
    }
    return 0;
}

static int cmp_run(const void *x, const void *y)
{
    const run *a = x, *b = y;
    if (a->a != b->a)
        return a->a < b->a ? -1 : 1;
    if (a->b != b->b)
        return a->b > b->b ? -1 : 1;
    return (int)b->exact - (int)a->exact;
}

static bool better(const run *x, const run *best)
{
    return !best || x->b > best->b || (x->b == best->b && x->exact && !best->exact);
}

/* An exact run's KV is a full encode's only if the context's own KV was
 * computed from its first token on, at consecutive positions: not an APE
 * document (encoded after a prefix the context does not hold), and tokens
 * [0, end) at positions p0, p0 + 1, ... (a uniform shift changes nothing
 * under RoPE; a gap, a group layout or a moved range does). */
static bool exact_in_context(const kvr_ctx *c, size_t end)
{
    const char *pid;
    uint64_t fp, hash;
    size_t len;
    if (kvr_layout_ape_record(c, &pid, &fp, &len, &hash) || c->n_ext == 0)
        return false;
    int64_t next = kvr_ext_pos(&c->ext[0], 0);
    size_t k = 0;
    for (size_t i = 0; i < c->n_ext && k < end; i++) {
        const kvr_extent *e = &c->ext[i];
        for (uint32_t j = 0; j < e->count && k < end; j++, k++, next++)
            if (kvr_ext_pos(e, j) != next)
                return false;
    }
    return true;
}

static int add_piece(kvr_cover_result *res, size_t *cap, const run *r, size_t pos, size_t end)
{
    if (res->n_pieces == *cap) {
        size_t nc = *cap ? *cap * 2 : 16;
        kvr_cover_piece *a = kvr_mem_realloc(res->pieces, nc * sizeof *a);
        if (!a)
            return KVR_ENOMEM;
        res->pieces = a;
        *cap = nc;
    }
    kvr_cover_piece *pc = &res->pieces[res->n_pieces++];
    const kvr_ctx *c = r->c;
    size_t co = r->ca + (pos - r->a), n = end - pos;
    *pc = (kvr_cover_piece){ .prompt_off = pos, .ctx_off = co, .n_tokens = n,
                             .stream_off = res->n_covered,
                             .exact = r->exact && exact_in_context(c, co + n) };
    pc->n_approx = c->n_exact >= co + n ? 0 :
                   kvr_ctx_count_flag(c, co, co + n, KVR_TOKEN_APPROX);
    memcpy(pc->ctx_id, c->id, c->id_len + 1);
    res->n_covered += n;
    return 0;
}

/* The pieces (see the top of the file). */
static int choose(search *S, size_t min_run, kvr_cover_result *res)
{
    run *rs = S->runs;
    size_t nr = 0, cap = 0;
    for (size_t i = 0; i < S->n_runs; i++)      /* drop the emptied ones */
        if (rs[i].b > rs[i].a)
            rs[nr++] = rs[i];
    if (nr > 1)
        qsort(rs, nr, sizeof *rs, cmp_run);
    size_t pos = 0;
    const run *ex = NULL;
    for (size_t i = 0; i < nr && rs[i].a == 0; i++)
        if (rs[i].exact && (!ex || rs[i].b > ex->b))
            ex = &rs[i];
    if (ex && ex->b - ex->a >= min_run) {
        if (add_piece(res, &cap, ex, 0, ex->b) != 0)
            return KVR_ENOMEM;
        pos = ex->b;
    }
    const run *best = NULL;
    size_t i = 0;
    while (pos < S->n) {
        for (; i < nr && rs[i].a <= pos; i++)
            if (better(&rs[i], best))
                best = &rs[i];
        if (!best || best->b <= pos || best->b - pos < min_run) {
            if (i == nr)
                break;
            pos = rs[i].a;                    /* a gap up to the next run */
            continue;
        }
        if (add_piece(res, &cap, best, pos, best->b) != 0)
            return KVR_ENOMEM;
        pos = best->b;
    }
    return 0;
}

static int cover_check(const kvr_store *s, const kvr_cover_params *p, kvr_model **m,
                       kvr_error *err)
{
    if (!p)
        return kvr_error_set(err, KVR_EBADREQUEST, "cover: missing parameters");
    if (!(*m = kvr_store_model(s, p->model)))
        return kvr_error_set(err, KVR_ENOMODEL, "no model '%s'", p->model ? p->model : "");
    if (p->n_tokens == 0)
        return kvr_error_set(err, KVR_EINVAL, "cover: the prompt is empty");
    if (!p->tokens)
        return kvr_error_set(err, KVR_EBADREQUEST, "cover: tokens missing");
    if (p->n_tokens > KVR_COVER_MAX_TOKENS)
        return kvr_error_set(err, KVR_ETOOLARGE, "cover: a prompt of %zu tokens is over the "
                             "limit of %u (split it)", p->n_tokens, KVR_COVER_MAX_TOKENS);
    if (p->min_run == 0 || p->min_run > KVR_COVER_MAX_TOKENS)
        return kvr_error_set(err, KVR_EINVAL, "cover: min_run %zu is outside 1..%u",
                             p->min_run, KVR_COVER_MAX_TOKENS);
    return 0;
}

int kvr_store_cover(kvr_store *s, const kvr_cover_params *p, kvr_cover_result *res,
                    kvr_error *err)
{
    memset(res, 0, sizeof *res);
    kvr_model *m;
    int rc = cover_check(s, p, &m, err);
    if (rc != 0)
        return rc;
    kvr_grain_sync_dirty(m, COVER_SYNC_BUDGET);
    search S = { .t = p->tokens, .n = p->n_tokens,
                 .work_max = COVER_WORK_PER_TOKEN * p->n_tokens + COVER_WORK_FLOOR };
    res->n_prompt = p->n_tokens;
    if ((rc = find_runs(m, &S, res)) != 0 || (rc = cut_pending(&S)) != 0 ||
        (rc = choose(&S, p->min_run, res)) != 0) {
        kvr_mem_free(S.runs);
        kvr_cover_result_free(res);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory covering %zu tokens",
                             p->n_tokens);
    }
    res->n_hits = S.n_hits;
    res->n_rejected = S.n_rejected;
    res->n_runs = S.n_runs;
    for (size_t i = 0; i < res->n_pieces; i++)
        kvr_store_touch(s, kvr_store_ctx_find(s, res->pieces[i].ctx_id));
    kvr_mem_free(S.runs);
    return 0;
}

void kvr_cover_result_free(kvr_cover_result *res)
{
    if (!res)
        return;
    kvr_mem_free(res->pieces);
    memset(res, 0, sizeof *res);
}

int kvr_store_cover_get_begin(kvr_store *s, const kvr_cover_params *p,
                              const kvr_cover_result *res, kvr_assemble **out,
                              kvr_error *err)
{
    kvr_model *m;
    int rc = cover_check(s, p, &m, err);
    if (rc != 0)
        return rc;
    if (!res || res->n_prompt != p->n_tokens)
        return kvr_error_set(err, KVR_EBADREQUEST, "cover get: the cover is of another "
                             "prompt");
    int64_t qpos;
    if (p->pos_base < 0 || __builtin_add_overflow(p->pos_base, (int64_t)p->n_tokens, &qpos))
        return kvr_error_set(err, KVR_EINVAL, "cover get: pos_base %lld is negative or "
                             "overflows", (long long)p->pos_base);
    kvr_place *pc = kvr_mem_malloc((res->n_pieces ? res->n_pieces : 1) * sizeof *pc);
    if (!pc)
        return kvr_error_set(err, KVR_ENOMEM, "out of memory placing a cover");
    /* The pieces again, against the store as it is now: each context must
     * still hold the prompt's tokens there. */
    for (size_t i = 0; i < res->n_pieces && rc == 0; i++) {
        const kvr_cover_piece *q = &res->pieces[i];
        kvr_ctx *c = NULL;
        if (kvr_store_ctx_live(s, q->ctx_id, &c, NULL) != 0 || c->model != m ||
            q->n_tokens == 0 || q->prompt_off + q->n_tokens > p->n_tokens ||
            q->ctx_off + q->n_tokens > c->n_tokens) {
            rc = kvr_error_set(err, KVR_EBUSY, "cover get: context '%s' changed since the "
                               "cover", q->ctx_id);
            break;
        }
        pc[i] = (kvr_place){ .c = c, .from = q->ctx_off, .n = q->n_tokens,
                             .pos = p->pos_base + (int64_t)q->prompt_off, .approx = !q->exact };
    }
    kvr_place_opts o = { .layers = p->layers, .n_layers_sel = p->n_layers_sel,
                         .dtype = p->dtype, .meta_only = p->meta_only, .dst = p->dst,
                         .dst_cap = p->dst_cap, .query_pos = qpos };
    if (rc == 0)
        rc = kvr_assemble_place_begin(s, m, pc, res->n_pieces, &o, out, err);
    kvr_mem_free(pc);
    if (rc != 0)
        return rc;
    /* Token by token: what the read copied out of the blocks is the prompt. */
    const kvr_assemble_info *ai = kvr_assemble_get_info(*out);
    for (size_t i = 0; i < res->n_pieces; i++) {
        const kvr_cover_piece *q = &res->pieces[i];
        if (memcmp(ai->tokens + q->stream_off, p->tokens + q->prompt_off,
                   q->n_tokens * sizeof *p->tokens) != 0) {
            kvr_assemble_end(*out);
            *out = NULL;
            return kvr_error_set(err, KVR_EBUSY, "cover get: context '%s' no longer holds "
                                 "the prompt's tokens [%zu, %zu)", q->ctx_id, q->prompt_off,
                                 q->prompt_off + q->n_tokens);
        }
    }
    return 0;
}
