/*
 * grain.c — the content index of grains (grain.h has the layout and the
 * invariants): the hash, the per-model table, and keeping each context's
 * mirror and entries in step with its tokens.
 *
 * The hash of a grain t[0..G) is a polynomial over mixed token ids,
 *   H = sum_j mix(t[j]) * B^(G-1-j)  (mod 2^64),
 * finished with murmur3's fmix64. mix is a bijective 64-bit mixer
 * (splitmix64's), so no two token ids mix alike and the polynomial rolls:
 * moving one token right is one multiply-subtract and one multiply-add,
 * which is how cover.c hashes every offset of a prompt in O(prompt). The
 * hash only finds candidates; cover.c verifies every one token by token.
 */
#include <string.h>

#include "cache/store.h"

#define G KVR_GRAIN

/* The polynomial's base and B^(G-1), as integer constant expressions. */
#define ROLL_B1  0xA0761D6478BD642Full
#define ROLL_B2  (ROLL_B1 * ROLL_B1)
#define ROLL_B4  (ROLL_B2 * ROLL_B2)
#define ROLL_B8  (ROLL_B4 * ROLL_B4)
#define ROLL_B15 (ROLL_B8 * ROLL_B4 * ROLL_B2 * ROLL_B1)
#define ROLL_SEED 0x2545F4914F6CDD1Dull
_Static_assert(KVR_GRAIN == 16, "ROLL_B15 is B^(G-1) for G = 16");

uint64_t kvr_grain_test_mask = ~0ull;

static inline uint64_t mix_tok(uint32_t t)
{
    uint64_t z = (uint64_t)t * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t kvr_grain_roll_init(const uint32_t *t)
{
    uint64_t h = 0;
    for (unsigned j = 0; j < G; j++)
        h = h * ROLL_B1 + mix_tok(t[j]);
    return h;
}

uint64_t kvr_grain_roll_next(uint64_t h, uint32_t out, uint32_t in)
{
    return (h - mix_tok(out) * ROLL_B15) * ROLL_B1 + mix_tok(in);
}

uint64_t kvr_grain_roll_key(uint64_t h)
{
    h ^= ROLL_SEED;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    return h & kvr_grain_test_mask;
}

uint64_t kvr_grain_hash(const uint32_t *t)
{
    return kvr_grain_roll_key(kvr_grain_roll_init(t));
}

/* ---- the table ---------------------------------------------------------- */

void kvr_grain_index_init(kvr_grain_index *x)
{
    memset(x, 0, sizeof *x);
    x->free_head = KVR_GRAIN_NONE;
}

void kvr_grain_index_free(kvr_grain_index *x)
{
    assert(x->n_live == 0 && x->n_dirty == 0);
    kvr_mem_free(x->heads);
    kvr_mem_free(x->ents);
    kvr_grain_index_init(x);
}

static void link_head(kvr_grain_index *x, uint32_t i)
{
    kvr_grain_ent *e = &x->ents[i];
    uint32_t *h = &x->heads[e->hash & (x->n_heads - 1)];
    e->prev = KVR_GRAIN_NONE;
    e->next = *h;
    if (*h != KVR_GRAIN_NONE)
        x->ents[*h].prev = i;
    *h = i;
}

/* Doubles the heads (load <= 1); on failure the chains just get longer. */
static void heads_grow(kvr_grain_index *x)
{
    size_t nh = x->n_heads ? x->n_heads * 2 : 8;
    uint32_t *h = kvr_mem_malloc(nh * sizeof *h);
    if (!h)
        return;
    for (size_t i = 0; i < nh; i++)
        h[i] = KVR_GRAIN_NONE;
    kvr_mem_free(x->heads);
    x->bytes += (nh - x->n_heads) * sizeof *h;
    x->heads = h;
    x->n_heads = nh;
    for (size_t i = 0; i < x->n_ents; i++)
        if (x->ents[i].ctx)
            link_head(x, (uint32_t)i);
}

/* A new entry at the head of its chain, or KVR_GRAIN_NONE (ENOMEM). */
static uint32_t ent_insert(kvr_grain_index *x, uint64_t key, kvr_ctx *c, uint32_t grain)
{
    if (x->n_live >= x->n_heads)
        heads_grow(x);
    if (!x->heads)
        return KVR_GRAIN_NONE;
    uint32_t i = x->free_head;
    if (i != KVR_GRAIN_NONE) {
        x->free_head = x->ents[i].next;
    } else {
        if (x->n_ents == x->cap_ents) {
            size_t cap = x->cap_ents ? x->cap_ents * 2 : 8;
            if (cap > KVR_GRAIN_NONE)
                return KVR_GRAIN_NONE;
            kvr_grain_ent *a = kvr_mem_realloc(x->ents, cap * sizeof *a);
            if (!a)
                return KVR_GRAIN_NONE;
            x->bytes += (cap - x->cap_ents) * sizeof *a;
            x->ents = a;
            x->cap_ents = cap;
        }
        i = (uint32_t)x->n_ents++;
    }
    x->ents[i] = (kvr_grain_ent){ .hash = key, .ctx = c, .grain = grain };
    link_head(x, i);
    x->n_live++;
    return i;
}

static void ent_remove(kvr_grain_index *x, uint32_t i)
{
    kvr_grain_ent *e = &x->ents[i];
    assert(e->ctx);
    if (e->prev != KVR_GRAIN_NONE)
        x->ents[e->prev].next = e->next;
    else
        x->heads[e->hash & (x->n_heads - 1)] = e->next;
    if (e->next != KVR_GRAIN_NONE)
        x->ents[e->next].prev = e->prev;
    e->ctx = NULL;
    e->next = x->free_head;
    x->free_head = i;
    x->n_live--;
}

size_t kvr_grain_lookup(const kvr_model *m, uint64_t key, size_t max_hits, size_t max_steps,
                        bool (*fn)(void *ud, kvr_ctx *c, uint32_t grain), void *ud)
{
    const kvr_grain_index *x = &m->grains;
    if (!x->n_heads)
        return 0;
    size_t hits = 0, steps = 0;
    for (uint32_t i = x->heads[key & (x->n_heads - 1)];
         i != KVR_GRAIN_NONE && hits < max_hits && steps < max_steps; i = x->ents[i].next) {
        const kvr_grain_ent *e = &x->ents[i];
        steps++;
        if (e->hash != key || e->grain >= e->ctx->grain.valid || e->ctx->pending)
            continue;
        hits++;
        if (!fn(ud, e->ctx, e->grain))
            break;
    }
    return hits;
}

/* ---- one context -------------------------------------------------------- */

static void dirty_link(kvr_ctx *c)
{
    kvr_grain_ctx *g = &c->grain;
    kvr_grain_index *x = &c->model->grains;
    if (g->dirty)
        return;
    g->dirty = true;
    g->dprev = NULL;
    g->dnext = x->dirty;
    if (x->dirty)
        x->dirty->grain.dprev = c;
    x->dirty = c;
    x->n_dirty++;
}

static void dirty_unlink(kvr_ctx *c)
{
    kvr_grain_ctx *g = &c->grain;
    kvr_grain_index *x = &c->model->grains;
    if (!g->dirty)
        return;
    if (g->dprev)
        g->dprev->grain.dnext = g->dnext;
    else
        x->dirty = g->dnext;
    if (g->dnext)
        g->dnext->grain.dprev = g->dprev;
    g->dirty = false;
    g->dprev = g->dnext = NULL;
    assert(x->n_dirty > 0);
    x->n_dirty--;
}

/* The capacity arr_fit gives an array holding `cap` for `need`: exact the
 * first time (most contexts are one put), half again more when it grows. */
static size_t fit_cap(size_t cap, size_t need)
{
    return need <= cap ? cap : cap ? need + need / 2 : need;
}

/* Resizes one of c's arrays to hold `need` elements of `size` bytes: grows
 * by half again, shrinks when it is over twice what is needed. */
static int arr_fit(kvr_grain_index *x, uint32_t **a, size_t *cap, size_t need)
{
    size_t want = fit_cap(*cap, need);
    if (need <= *cap && *cap > 2 * need + 64)
        want = need;
    if (want == *cap)
        return 0;
    if (want == 0) {
        kvr_mem_free(*a);
        x->bytes -= *cap * sizeof **a;
        *a = NULL;
        *cap = 0;
        return 0;
    }
    uint32_t *p = kvr_mem_realloc(*a, want * sizeof *p);
    if (!p)
        return need > *cap ? KVR_ENOMEM : 0;    /* a failed shrink keeps the old one */
    x->bytes = x->bytes - *cap * sizeof *p + want * sizeof *p;
    *a = p;
    *cap = want;
    return 0;
}

size_t kvr_grain_need(const kvr_ctx *c, size_t n)
{
    const kvr_grain_ctx *g = &c->grain;
    const kvr_grain_index *x = &c->model->grains;
    size_t tok = c->n_tokens + n, ng = tok / G, bytes = 0;
    size_t cap = fit_cap(g->cap_tok, tok);
    if (cap != g->cap_tok)
        bytes += kvr_mem_size_class(cap * sizeof(uint32_t));
    cap = fit_cap(g->cap_grain, ng);
    if (cap != g->cap_grain)
        bytes += kvr_mem_size_class(cap * sizeof(uint32_t));
    size_t live = x->n_live + (ng > g->n_grain ? ng - g->n_grain : 0);
    for (size_t ce = x->cap_ents; live > ce;) {
        ce = ce ? ce * 2 : 8;
        bytes += kvr_mem_size_class(ce * sizeof(kvr_grain_ent));
    }
    for (size_t nh = x->n_heads; live > nh;) {
        nh = nh ? nh * 2 : 8;
        bytes += kvr_mem_size_class(nh * sizeof(uint32_t));
    }
    return bytes;
}

void kvr_grain_note(kvr_ctx *c, size_t common)
{
    kvr_grain_ctx *g = &c->grain;
    if (common < g->ok_tok)
        g->ok_tok = common;
    if (g->n_tok > g->ok_tok)
        g->n_tok = g->ok_tok;
    if (g->ok_tok / G < g->valid)
        g->valid = g->ok_tok / G;
    if (g->ok_tok != c->n_tokens || g->valid != g->n_grain || g->n_grain != c->n_tokens / G)
        dirty_link(c);
}

/* Indexes grains [valid, n_tok / G) of c from its mirror. */
static void index_grains(kvr_ctx *c)
{
    kvr_grain_ctx *g = &c->grain;
    kvr_grain_index *x = &c->model->grains;
    size_t ng = g->n_tok / G;
    assert(g->valid == g->n_grain && ng <= g->cap_grain);
    for (size_t i = g->valid; i < ng; i++) {
        uint32_t e = ent_insert(x, kvr_grain_hash(g->tok + i * G), c, (uint32_t)i);
        if (e == KVR_GRAIN_NONE)
            break;
        g->slot[i] = e;
        g->valid = g->n_grain = i + 1;
    }
}

/* Clean when the mirror holds every token and every grain is indexed. */
static void settle(kvr_ctx *c)
{
    kvr_grain_ctx *g = &c->grain;
    if (g->ok_tok == c->n_tokens && g->valid == g->n_grain && g->n_grain == c->n_tokens / G)
        dirty_unlink(c);
    else
        dirty_link(c);
}

size_t kvr_grain_sync(kvr_ctx *c)
{
    kvr_grain_ctx *g = &c->grain;
    kvr_grain_index *x = &c->model->grains;
    size_t n = c->n_tokens, gathered = 0;
    for (size_t i = g->valid; i < g->n_grain; i++)
        ent_remove(x, g->slot[i]);
    g->n_grain = g->valid;
    if (g->ok_tok > n)
        g->ok_tok = n;
    g->n_tok = g->ok_tok;
    if (arr_fit(x, &g->tok, &g->cap_tok, n) == 0 &&
        arr_fit(x, &g->slot, &g->cap_grain, n / G) == 0) {
        gathered = n - g->ok_tok;
        kvr_ctx_tokens(c, g->ok_tok, n, g->tok + g->ok_tok);
        g->n_tok = g->ok_tok = n;
        index_grains(c);
    }
    settle(c);
    return gathered;
}

void kvr_grain_append(kvr_ctx *c, size_t first_index, const uint32_t *tokens, size_t n)
{
    kvr_grain_ctx *g = &c->grain;
    kvr_grain_index *x = &c->model->grains;
    size_t end = first_index + n;
    if (g->dirty || g->ok_tok != first_index || g->n_tok != first_index ||
        c->n_tokens != end || arr_fit(x, &g->tok, &g->cap_tok, end) != 0 ||
        arr_fit(x, &g->slot, &g->cap_grain, end / G) != 0) {
        kvr_grain_note(c, first_index);
        kvr_grain_sync(c);
        return;
    }
    memcpy(g->tok + first_index, tokens, n * sizeof *tokens);
    g->n_tok = g->ok_tok = end;
    index_grains(c);
    settle(c);
}

void kvr_grain_sync_dirty(kvr_model *m, size_t budget)
{
    kvr_grain_index *x = &m->grains;
    size_t done = 0;
    while (x->dirty && done < budget) {
        kvr_ctx *c = x->dirty;
        done += kvr_grain_sync(c) + 1;
        if (c->grain.dirty)
            break;      /* out of memory: the next cover tries again */
    }
}

void kvr_grain_forget(kvr_ctx *c)
{
    kvr_grain_ctx *g = &c->grain;
    kvr_grain_index *x = &c->model->grains;
    for (size_t i = 0; i < g->n_grain; i++)
        ent_remove(x, g->slot[i]);
    dirty_unlink(c);
    x->bytes -= (g->cap_tok + g->cap_grain) * sizeof(uint32_t);
    kvr_mem_free(g->tok);
    kvr_mem_free(g->slot);
    memset(g, 0, sizeof *g);
}

/* ---- checking ----------------------------------------------------------- */

static int check_ctx(kvr_ctx *c, size_t *n_ents, kvr_error *err)
{
    const kvr_grain_ctx *g = &c->grain;
    const kvr_grain_index *x = &c->model->grains;
    if (g->ok_tok > g->n_tok || g->n_tok > g->cap_tok || g->valid > g->n_grain ||
        g->n_grain > g->cap_grain || g->valid * G > g->ok_tok || g->ok_tok > c->n_tokens)
        return kvr_error_set(err, KVR_EINTERNAL, "'%s': grain counts out of order (ok %zu "
                             "of %zu mirrored, %zu tokens; %zu of %zu grains valid)", c->id,
                             g->ok_tok, g->n_tok, c->n_tokens, g->valid, g->n_grain);
    if (!g->dirty && (g->ok_tok != c->n_tokens || g->valid != g->n_grain ||
                      g->n_grain != c->n_tokens / G))
        return kvr_error_set(err, KVR_EINTERNAL, "'%s' is not on the dirty list but its "
                             "index lags (%zu of %zu tokens, %zu grains)", c->id, g->ok_tok,
                             c->n_tokens, g->valid);
    uint32_t *t = kvr_ctx_gather_tokens(c, err);
    if (!t)
        return KVR_ENOMEM;
    int rc = 0;
    for (size_t i = 0; i < g->ok_tok && rc == 0; i++)
        if (g->tok[i] != t[i])
            rc = kvr_error_set(err, KVR_EINTERNAL, "'%s': mirror token %zu is %u, the "
                               "context holds %u", c->id, i, g->tok[i], t[i]);
    for (size_t i = 0; i < g->n_grain && rc == 0; i++) {
        const kvr_grain_ent *e = &x->ents[g->slot[i]];
        if (e->ctx != c || e->grain != i)
            rc = kvr_error_set(err, KVR_EINTERNAL, "'%s': grain %zu's entry belongs to "
                               "another grain", c->id, i);
        else if (i < g->valid && e->hash != kvr_grain_hash(t + i * G))
            rc = kvr_error_set(err, KVR_EINTERNAL, "'%s': grain %zu is indexed under a "
                               "stale hash", c->id, i);
    }
    kvr_mem_free(t);
    *n_ents += g->n_grain;
    return rc;
}

int kvr_grain_check(kvr_store *s, kvr_error *err)
{
    for (size_t mi = 0; mi < s->n_models; mi++) {
        kvr_model *m = s->models[mi];
        size_t n_ents = 0, n_dirty = 0;
        for (size_t b = 0; b < s->n_buckets; b++)
            for (kvr_ctx *c = s->buckets[b]; c; c = c->hnext) {
                if (c->model != m)
                    continue;
                int rc = check_ctx(c, &n_ents, err);
                if (rc != 0)
                    return rc;
                n_dirty += c->grain.dirty;
            }
        if (n_ents != m->grains.n_live || n_dirty != m->grains.n_dirty)
            return kvr_error_set(err, KVR_EINTERNAL, "model '%s': %zu live entries, its "
                                 "contexts own %zu; %zu dirty, %zu on the list", m->name,
                                 m->grains.n_live, n_ents, n_dirty, m->grains.n_dirty);
    }
    return 0;
}
