/*
 * bench_cover.c — the cover lookup (kvr_store_cover: rolling grain hash
 * over the prompt, token-exact verification and extension, the choice of
 * runs) for 4096-token RAG-shaped prompts against a store of about a
 * million cached tokens, in process (the store's loop-thread work, no
 * socket). Also the placed get's metadata (kvr_store_cover_get_begin,
 * meta_only) and the plain prefix match of the same prompt for scale.
 *
 * Store: KVR_BENCH_CHUNKS (2000) contexts of 512 tokens drawn from a
 * Zipf-like vocabulary of 32k ids (repeated words, so grains of common
 * content collide and are refused by the token check), a tiny KV shape
 * (the lookup never reads K/V). Prompt: a new 200-token question, then 7
 * chunks' pieces (random contexts, random offsets, in a new order), then
 * new tokens to 4096. Baseline, timed in the same loop: one FNV-1a pass
 * over the prompt's bytes (what touching the prompt once costs). Times are
 * the thread's CPU time (a shared machine's preemptions are not the
 * lookup's cost); the lookup's wall-clock percentiles are printed beside.
 *
 *   KVR_BENCH_CHUNKS (2000), KVR_BENCH_ITERS (2000)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/cache.h"
#include "tests/common/kvt_bench.h"

#define CHUNK 512
#define PROMPT 4096
#define QUESTION 200
#define PIECES 7

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU time of this thread: what the lookup costs, without the time a
 * shared machine's scheduler gives others meanwhile. */
static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void)
{
    return (uint32_t)(kvt_xorshift(&rng) >> 11);
}

/* A Zipf-like id: small ids much more often. */
static uint32_t word(void)
{
    uint32_t r = rnd() % 32768u;
    return (r * r) / 32768u + (rnd() & 1u);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double p)
{
    qsort(v, n, sizeof *v, cmp_d);
    size_t i = (size_t)(p * (double)(n - 1) + 0.5);
    return v[i];
}

int main(void)
{
    size_t n_chunks = kvt_env_size("KVR_BENCH_CHUNKS", 2000), iters = kvt_env_size("KVR_BENCH_ITERS", 2000);
    kvr_store *s;
    kvr_error e = { 0 };
    if (kvr_store_create(&s, NULL, &e) != 0) {
        fprintf(stderr, "store: %s\n", e.msg);
        return 1;
    }
    kvr_model_desc d = { .name = "m", .n_layers = 1, .n_kv_heads = 1, .head_dim = 8,
                         .dtype = KVR_DTYPE_F16 };
    kvr_rope_config_init(&d.rope);
    if (kvr_store_model_register(s, &d, NULL, &e) != 0) {
        fprintf(stderr, "model: %s\n", e.msg);
        return 1;
    }
    uint32_t *all = malloc(n_chunks * CHUNK * sizeof *all);
    double t0 = now_s();
    for (size_t c = 0; c < n_chunks; c++) {
        uint32_t *t = all + c * CHUNK;
        for (size_t i = 0; i < CHUNK; i++)
            t[i] = word();
        char id[32];
        snprintf(id, sizeof id, "chunk-%zu", c);
        kvr_put_params p = { .ctx_id = id, .model = "m", .mode = KVR_PUT_CREATE,
                             .n_layers = 1, .n_kv_heads = 1, .head_dim = 8,
                             .dtype = KVR_DTYPE_F16, .n_tokens = CHUNK, .tokens = t };
        kvr_put *x;
        if (kvr_store_put_begin(s, &p, &x, &e) != 0) {
            fprintf(stderr, "put: %s\n", e.msg);
            return 1;
        }
        const struct iovec *iov;
        size_t niov;
        kvr_put_payload_iov(x, &iov, &niov);
        for (size_t i = 0; i < niov; i++)
            memset(iov[i].iov_base, 0x11, iov[i].iov_len);
        if (kvr_put_commit(x, NULL, &e) != 0) {
            fprintf(stderr, "commit: %s\n", e.msg);
            return 1;
        }
    }
    double t_fill = now_s() - t0;

    /* A few prompts, used in turn. */
    enum { NP = 16 };
    static uint32_t prompts[NP][PROMPT];
    size_t expect[NP];
    for (int k = 0; k < NP; k++) {
        uint32_t *q = prompts[k];
        size_t n = 0;
        for (; n < QUESTION; n++)
            q[n] = 40000u + rnd() % 20000u;        /* words no chunk holds */
        expect[k] = 0;
        for (int j = 0; j < PIECES; j++) {
            const uint32_t *src = all + (size_t)(rnd() % n_chunks) * CHUNK;
            size_t off = rnd() % 64, len = CHUNK - off - rnd() % 64;
            if (len > PROMPT - n)
                len = PROMPT - n;
            memcpy(q + n, src + off, len * sizeof *q);
            n += len;
            expect[k] += len;
        }
        for (; n < PROMPT; n++)
            q[n] = 40000u + rnd() % 20000u;
    }

    double *tc = malloc(iters * sizeof *tc), *tb = malloc(iters * sizeof *tb);
    double *tg = malloc(iters * sizeof *tg), *tm = malloc(iters * sizeof *tm);
    double *tr = malloc(iters * sizeof *tr);
    size_t covered = 0, pieces = 0, rejected = 0, hits = 0, short_of = 0;
    volatile uint64_t sink = 0;
    for (size_t it = 0; it < iters; it++) {
        const uint32_t *q = prompts[it % NP];
        double a = cpu_s();
        uint64_t h = 14695981039346656037ull;
        const unsigned char *b = (const unsigned char *)q;
        for (size_t i = 0; i < PROMPT * sizeof *q; i++)
            h = (h ^ b[i]) * 1099511628211ull;
        sink += h;
        double z = cpu_s();
        tb[it] = z - a;

        kvr_cover_params p = { .model = "m", .tokens = q, .n_tokens = PROMPT,
                               .min_run = KVR_COVER_MIN_RUN, .dtype = KVR_DTYPE_F16,
                               .meta_only = true };
        kvr_cover_result r;
        double w = now_s();
        a = cpu_s();
        if (kvr_store_cover(s, &p, &r, &e) != 0) {
            fprintf(stderr, "cover: %s\n", e.msg);
            return 1;
        }
        z = cpu_s();
        tr[it] = now_s() - w;
        tc[it] = z - a;
        covered += r.n_covered;
        pieces += r.n_pieces;
        rejected += r.n_rejected;
        hits += r.n_hits;
        if (r.n_covered < expect[it % NP])
            short_of++;

        kvr_assemble *t;
        a = cpu_s();
        if (kvr_store_cover_get_begin(s, &p, &r, &t, &e) != 0) {
            fprintf(stderr, "cover get: %s\n", e.msg);
            return 1;
        }
        kvr_assemble_end(t);
        z = cpu_s();
        tg[it] = z - a;
        kvr_cover_result_free(&r);

        kvr_match_result mr;
        a = cpu_s();
        kvr_store_match(s, "m", q, PROMPT, false, &mr, NULL);
        z = cpu_s();
        tm[it] = z - a;
    }
    /* The bounds: an adversarial prompt (one token 4096 times, against a
     * context holding that token 512 times: every grain of it matches
     * everywhere) and the longest prompt allowed (131072 tokens, mostly
     * uncached, the planted chunks repeated through it). */
    {
        uint32_t rep[CHUNK];
        for (size_t i = 0; i < CHUNK; i++)
            rep[i] = 7;
        kvr_put_params pp = { .ctx_id = "same", .model = "m", .mode = KVR_PUT_CREATE,
                              .n_layers = 1, .n_kv_heads = 1, .head_dim = 8,
                              .dtype = KVR_DTYPE_F16, .n_tokens = CHUNK, .tokens = rep };
        kvr_put *x;
        if (kvr_store_put_begin(s, &pp, &x, &e) != 0 || kvr_put_commit(x, NULL, &e) != 0) {
            fprintf(stderr, "put: %s\n", e.msg);
            return 1;
        }
    }
    static uint32_t adv[PROMPT];
    for (size_t i = 0; i < PROMPT; i++)
        adv[i] = 7;
    uint32_t *longp = malloc((size_t)KVR_COVER_MAX_TOKENS * sizeof *longp);
    for (size_t i = 0; i < KVR_COVER_MAX_TOKENS; i++)
        longp[i] = i % PROMPT < QUESTION ? 40000u + rnd() % 20000u
                                         : prompts[(i / PROMPT) % NP][i % PROMPT];
    enum { NB = 50 };
    double ta[NB], tl[NB];
    size_t adv_cov = 0;
    int adv_trunc = 0;
    for (int it = 0; it < NB; it++) {
        kvr_cover_params p = { .model = "m", .tokens = adv, .n_tokens = PROMPT,
                               .min_run = KVR_COVER_MIN_RUN };
        kvr_cover_result r;
        double a = cpu_s();
        if (kvr_store_cover(s, &p, &r, &e) != 0)
            return 1;
        ta[it] = cpu_s() - a;
        adv_cov = r.n_covered;
        adv_trunc |= r.truncated;
        kvr_cover_result_free(&r);
        p.tokens = longp;
        p.n_tokens = KVR_COVER_MAX_TOKENS;
        a = cpu_s();
        if (kvr_store_cover(s, &p, &r, &e) != 0)
            return 1;
        tl[it] = cpu_s() - a;
        kvr_cover_result_free(&r);
    }
    double a50 = pct(ta, NB, 0.5), a99 = pct(ta, NB, 0.99);
    double l50 = pct(tl, NB, 0.5), l99 = pct(tl, NB, 0.99);
    free(longp);

    kvr_store_stats st;
    kvr_store_get_stats(s, &st);
    double b50 = pct(tb, iters, 0.5), b99 = pct(tb, iters, 0.99);
    double c50 = pct(tc, iters, 0.5), c99 = pct(tc, iters, 0.99);
    double r50 = pct(tr, iters, 0.5), r99 = pct(tr, iters, 0.99);
    double g50 = pct(tg, iters, 0.5), g99 = pct(tg, iters, 0.99);
    double m50 = pct(tm, iters, 0.5), m99 = pct(tm, iters, 0.99);
    printf("store: %zu contexts, %zu cached tokens (filled in %.2f s); prompts of %d tokens "
           "(%d-token question, %d chunk pieces in a new order), %zu iterations\n",
           st.n_contexts, st.n_tokens, t_fill, PROMPT, QUESTION, PIECES, iters);
    printf("per prompt: %.1f pieces, %.1f tokens covered, %.1f grain hits of which %.1f "
           "refused by the token check; %zu of %zu covers short of the planted chunks\n\n",
           (double)pieces / (double)iters, (double)covered / (double)iters,
           (double)hits / (double)iters, (double)rejected / (double)iters, short_of, iters);
    printf("| operation | p50 us | p99 us | p99 / baseline p99 |\n|---|---|---|---|\n");
    printf("| baseline: FNV-1a over the prompt (16 KiB) | %.1f | %.1f | 1.0x |\n", b50 * 1e6,
           b99 * 1e6);
    printf("| cover lookup (kvr_store_cover) | %.1f | %.1f | %.1fx |\n", c50 * 1e6, c99 * 1e6,
           c99 / b99);
    printf("| cover lookup, wall clock (preemptions included) | %.1f | %.1f | %.1fx |\n",
           r50 * 1e6, r99 * 1e6, r99 / b99);
    printf("| placed get, metadata (cover_get_begin meta_only) | %.1f | %.1f | %.1fx |\n",
           g50 * 1e6, g99 * 1e6, g99 / b99);
    printf("| prefix match of the same prompt | %.1f | %.1f | %.1fx |\n", m50 * 1e6, m99 * 1e6,
           m99 / b99);
    printf("| adversarial: one token x4096 vs one x512 cached (%zu covered%s) | %.1f | %.1f | "
           "%.1fx |\n", adv_cov, adv_trunc ? ", budget hit" : "", a50 * 1e6, a99 * 1e6,
           a99 / b99);
    printf("| longest prompt allowed: %u tokens | %.1f | %.1f | %.1fx |\n",
           KVR_COVER_MAX_TOKENS, l50 * 1e6, l99 * 1e6, l99 / b99);
    printf("\n(times are the thread's CPU time, CLOCK_THREAD_CPUTIME_ID, so a shared "
           "machine's preemptions do not make the p99; the wall-clock row includes them)\n");
    kvt_goal(c99 <= 1e-3,
             "cover lookup p99 <= 1 ms for a 4k-token prompt against %zu cached tokens "
             "(issue 27): %.3f ms CPU (wall clock p99 %.3f ms), %.1fx the prompt hash's p99",
             st.n_tokens, c99 * 1e3, r99 * 1e3, c99 / b99);
    kvt_goal(short_of == 0, "every planted chunk found (covers short of them: %zu of %zu)",
             short_of, iters);
    (void)sink;
    free(tc);
    free(tb);
    free(tg);
    free(tm);
    free(tr);
    free(all);
    kvr_store_destroy(s);
    return 0;
}
