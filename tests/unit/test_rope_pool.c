/*
 * test_rope_pool.c — the persistent worker pool (base/pool.c): every index
 * of a loop runs exactly once whatever the pool and thread count, the first
 * failure stops the loop, loops started from several threads at once and
 * loops nested inside items neither deadlock nor lose or repeat work, and a
 * rotation split across the pool is bit-identical to the single-threaded one.
 */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rope/rope.h"

#define N 1000
static atomic_int hits[N];

static void clear_hits(void)
{
    for (size_t i = 0; i < N; i++)
        atomic_store(&hits[i], 0);
}

static int mark(void *ud, size_t i)
{
    (void)ud;
    atomic_fetch_add(&hits[i], 1);
    return 0;
}

static void assert_once(size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(atomic_load(&hits[i]), 1, "%s: index %zu ran %d times", what, i,
                     atomic_load(&hits[i]));
}

Test(pool, every_index_exactly_once)
{
    const unsigned workers[] = { 0, 1, 3, 8 };
    for (size_t w = 0; w < sizeof workers / sizeof *workers; w++) {
        kvr_pool *p;
        cr_assert_eq(kvr_pool_create(&p, workers[w]), 0);
        cr_assert_eq(kvr_pool_threads(p), workers[w] + 1);
        for (unsigned th = 1; th <= 10; th++) {
            for (size_t n = 0; n <= N; n += (n < 20 ? 1 : 327)) {
                clear_hits();
                cr_assert_eq(kvr_pool_for(p, n, th, mark, NULL), 0);
                assert_once(n, "pool");
            }
        }
        kvr_pool_destroy(p);
    }
    kvr_pool_destroy(NULL);
}

static int fail_at_7(void *ud, size_t i)
{
    atomic_int *ran = ud;
    atomic_fetch_add(ran, 1);
    return i == 7 ? -42 : 0;
}

Test(pool, first_failure_is_returned_and_stops_the_loop)
{
    /* Alone, the caller runs items in order: the failure at 7 is the last. */
    kvr_pool *p;
    cr_assert_eq(kvr_pool_create(&p, 0), 0);
    atomic_int ran = 0;
    cr_assert_eq(kvr_pool_for(p, 100000, 4, fail_at_7, &ran), -42);
    cr_assert_eq(atomic_load(&ran), 8);
    kvr_pool_destroy(p);

    /* With helpers, items already claimed finish. A thread preempted between
     * claiming 7 and running it can see every other item done first (CI's
     * make check once did), so only "stops early" in some round is asserted. */
    cr_assert_eq(kvr_pool_create(&p, 3), 0);
    int early = 0;
    for (int k = 0; k < 50; k++) {
        atomic_store(&ran, 0);
        cr_assert_eq(kvr_pool_for(p, 100000, 4, fail_at_7, &ran), -42);
        early += atomic_load(&ran) < 100000;
    }
    cr_assert_gt(early, 0);
    kvr_pool_destroy(p);
}

/* ---- concurrent and nested loops -------------------------------------------- */

#define CALLERS 6
#define ROUNDS 200
#define OUTER 8
#define INNER 50

typedef struct caller {
    kvr_pool  *p;
    atomic_int seen[OUTER * INNER];
    int        rc;
} caller;

typedef struct inner_ud {
    caller *c;
    size_t  outer;
} inner_ud;

static int inner_item(void *ud, size_t i)
{
    inner_ud *u = ud;
    atomic_fetch_add(&u->c->seen[u->outer * INNER + i], 1);
    return 0;
}

/* An item that runs a loop of its own on the same pool. */
static int outer_item(void *ud, size_t i)
{
    caller *c = ud;
    inner_ud u = { c, i };
    return kvr_pool_for(c->p, INNER, 4, inner_item, &u);
}

static void *caller_main(void *arg)
{
    caller *c = arg;
    for (int r = 0; r < ROUNDS && c->rc == 0; r++)
        c->rc = kvr_pool_for(c->p, OUTER, 3, outer_item, c);
    return NULL;
}

static void concurrent_nested(kvr_pool *p)
{
    static caller cs[CALLERS];
    pthread_t th[CALLERS];
    for (int k = 0; k < CALLERS; k++) {
        cs[k].p = p;
        cs[k].rc = 0;
        for (size_t i = 0; i < OUTER * INNER; i++)
            atomic_store(&cs[k].seen[i], 0);
        cr_assert_eq(pthread_create(&th[k], NULL, caller_main, &cs[k]), 0);
    }
    for (int k = 0; k < CALLERS; k++)
        pthread_join(th[k], NULL);
    for (int k = 0; k < CALLERS; k++) {
        cr_assert_eq(cs[k].rc, 0);
        for (size_t i = 0; i < OUTER * INNER; i++)
            cr_assert_eq(atomic_load(&cs[k].seen[i]), ROUNDS, "caller %d item %zu: %d", k,
                         i, atomic_load(&cs[k].seen[i]));
    }
}

Test(pool, concurrent_nested_loops_do_not_deadlock, .timeout = 300)
{
    const unsigned workers[] = { 0, 1, 3 };
    for (size_t w = 0; w < sizeof workers / sizeof *workers; w++) {
        kvr_pool *p;
        cr_assert_eq(kvr_pool_create(&p, workers[w]), 0);
        concurrent_nested(p);
        kvr_pool_destroy(p);
    }
    concurrent_nested(NULL);   /* the process's pool */
}

Test(pool, default_pool_is_shared_and_sized_to_the_machine)
{
    kvr_pool *p = kvr_pool_default();
    cr_assert_not_null(p);
    cr_assert_eq(kvr_pool_default(), p);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned want = cpus > 1 ? (unsigned)cpus : 1u;
    if (want > KVR_POOL_MAX_WORKERS + 1)
        want = KVR_POOL_MAX_WORKERS + 1;
    cr_assert_eq(kvr_pool_threads(p), want);
    clear_hits();
    cr_assert_eq(kvr_pool_for(NULL, N, 64, mark, NULL), 0);
    assert_once(N, "default pool");
}

/* ---- rotation on the pool: bit-identical to one thread ---------------------- */

Test(pool, threaded_rotation_is_bit_identical)
{
    kvr_rope_config c;
    kvr_rope_config_init(&c);
    c.head_dim = 128;
    c.rotary_dim = 128;
    c.scaling = KVR_ROPE_SCALING_YARN;
    c.factor = 4.0;
    c.original_max_position_embeddings = 4096;
    kvr_rope *r;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_rope_create(&r, &c, &err), 0, "%s", err.msg);
    const size_t T = 1500, H = 8, n = T * H * 128;
    float *x = malloc(n * sizeof *x), *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    int64_t *from = malloc(T * sizeof *from), *to = malloc(T * sizeof *to);
    srand(11);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(rand() % 20001 - 10000) / 1000.0f;
    for (size_t t = 0; t < T; t++) {
        from[t] = (int64_t)t * 3 + (t % 7 == 0 ? 11 : 0);   /* runs and breaks */
        to[t] = from[t] + (t < 700 ? 5 : 100000);
    }
    kvr_rope_opts one = { .n_threads = 1 };
    for (int th = 2; th <= 13; th += 11) {
        kvr_rope_opts many = { .n_threads = th };
        cr_assert_eq(kvr_rope_apply(r, a, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, from, &one), 0);
        cr_assert_eq(kvr_rope_apply(r, b, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, from, &many), 0);
        cr_assert_eq(memcmp(a, b, n * sizeof *a), 0, "apply with %d threads", th);
        cr_assert_eq(kvr_rope_reposition(r, a, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, from, to,
                                         &one), 0);
        cr_assert_eq(kvr_rope_reposition(r, b, KVR_DTYPE_F32, x, KVR_DTYPE_F32, T, H, from, to,
                                         &many), 0);
        cr_assert_eq(memcmp(a, b, n * sizeof *a), 0, "reposition with %d threads", th);
    }
    free(x); free(a); free(b); free(from); free(to);
    kvr_rope_destroy(r);
}

/* Records which threads ran items: at most `cap` distinct pool workers plus
 * the caller(s), whatever the loops ask for. */
#define MAXT 16
static pthread_t seen[MAXT];
static atomic_int n_seen;
static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int inside, most_inside;

static int note_thread(void *ud, size_t i)
{
    (void)ud;
    atomic_fetch_add(&hits[i], 1);
    int now = atomic_fetch_add(&inside, 1) + 1;
    int m = atomic_load(&most_inside);
    while (now > m && !atomic_compare_exchange_weak(&most_inside, &m, now)) {}
    pthread_mutex_lock(&seen_lock);
    bool known = false;
    for (int k = 0; k < atomic_load(&n_seen); k++)
        known |= pthread_equal(seen[k], pthread_self()) != 0;
    if (!known && atomic_load(&n_seen) < MAXT)
        seen[atomic_fetch_add(&n_seen, 1)] = pthread_self();
    pthread_mutex_unlock(&seen_lock);
    usleep(200);   /* long enough for idle workers to join if they may */
    atomic_fetch_sub(&inside, 1);
    return 0;
}

typedef struct capped { kvr_pool *p; } capped;

static void *capped_loop(void *arg)
{
    capped *c = arg;
    cr_assert_eq(kvr_pool_for(c->p, 200, 8, note_thread, NULL), 0);
    return NULL;
}

Test(pool, set_active_caps_the_helping_workers)
{
    kvr_pool *p;
    cr_assert_eq(kvr_pool_create(&p, 4), 0);
    cr_assert_eq(kvr_pool_threads(p), 5);
    const unsigned caps[] = { 0, 1, 2, 4 };
    for (size_t k = 0; k < sizeof caps / sizeof *caps; k++) {
        kvr_pool_set_active(p, caps[k]);
        cr_assert_eq(kvr_pool_threads(p), caps[k] + 1);
        /* one loop: the caller and at most caps[k] workers */
        clear_hits();
        atomic_store(&n_seen, 0);
        atomic_store(&most_inside, 0);
        cr_assert_eq(kvr_pool_for(p, 200, 8, note_thread, NULL), 0);
        assert_once(200, "capped");
        cr_assert_leq(atomic_load(&n_seen), (int)caps[k] + 1, "cap %u: %d threads", caps[k],
                      atomic_load(&n_seen));
        /* two loops at once: their two callers and at most caps[k] workers
         * inside items at any moment */
        clear_hits();
        atomic_store(&most_inside, 0);
        capped c = { p };
        pthread_t th;
        pthread_create(&th, NULL, capped_loop, &c);
        capped_loop(&c);
        pthread_join(th, NULL);
        for (size_t i = 0; i < 200; i++)
            cr_assert_eq(atomic_load(&hits[i]), 2);
        cr_assert_leq(atomic_load(&most_inside), (int)caps[k] + 2);
    }
    /* raised again: the workers come back */
    kvr_pool_set_active(p, 4);
    cr_assert_eq(kvr_pool_threads(p), 5);
    clear_hits();
    cr_assert_eq(kvr_pool_for(p, N, 5, mark, NULL), 0);
    assert_once(N, "uncapped");
    kvr_pool_set_active(NULL, 1);   /* no-op */
    kvr_pool_destroy(p);
}
