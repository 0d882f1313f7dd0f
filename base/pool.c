/*
 * pool.c — the process's persistent worker pool (kvr_pool_*, base/pool.h):
 * threads created once, then lent to every parallel loop of the project
 * (RoPE rotation in rope.c, the store's per-layer get/assemble/codec work
 * through cache/parallel.c) instead of a pthread_create per call.
 *
 * A loop (kvr_pool_for) is a job on the caller's stack: an index counter that
 * every participant advances with fetch-add, so each index is claimed by
 * exactly one thread. The job is put on the pool's list and up to
 * max_threads - 1 idle workers join it; the caller works on it too and, once
 * no index is left, takes the job off the list and waits only for the
 * helpers still inside an item. Invariants:
 *  - every index in [0, n) runs exactly once, unless an item failed (then
 *    no further index is handed out);
 *  - the caller never waits for an unclaimed index (it runs them itself),
 *    only for threads executing an item, and a waiting thread runs nothing;
 *    so nested loops (an item that calls kvr_pool_for) and loops started
 *    from many threads at once cannot deadlock, and a pool with no idle
 *    worker (or none at all) degrades to the caller doing all the work;
 *  - a job leaves the list before kvr_pool_for returns, and a helper joins a
 *    job only while it is listed, so no thread touches a job after return.
 * Results never depend on which thread ran an index (callers split work
 * into the same pieces whatever the thread count).
 */
#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#include "base/pool.h"
#include "base/list.h"
#include "base/error.h"

typedef struct pool_job {
    kvr_list         node;          /* on the pool's list (newest first), under p->lock */
    size_t           n;
    atomic_size_t    claim;         /* next index to hand out */
    atomic_int       rc;            /* first failure, 0 if none */
    int            (*fn)(void *ud, size_t i);
    void            *ud;
    unsigned         wanted;        /* helpers it may still take (under lock) */
    unsigned         running;       /* helpers inside it (under lock) */
} pool_job;

struct kvr_pool {
    pthread_mutex_t lock;
    pthread_cond_t  work_cv;        /* a job was listed, or stop */
    pthread_cond_t  done_cv;        /* a helper left a job */
    kvr_list        jobs;           /* listed jobs, newest first */
    bool            stop;
    unsigned        n_workers;      /* threads started */
    unsigned        active;         /* at most this many help at once */
    unsigned        helping;        /* workers inside a job now */
    pthread_t      *threads;
};

/* Claims and runs indexes of j until none is left or one failed. */
static void job_run(pool_job *j)
{
    for (;;) {
        if (atomic_load_explicit(&j->rc, memory_order_relaxed) != 0)
            return;
        size_t i = atomic_fetch_add_explicit(&j->claim, 1, memory_order_relaxed);
        if (i >= j->n)
            return;
        int rc = j->fn(j->ud, i);
        if (rc != 0) {
            int zero = 0;
            atomic_compare_exchange_strong(&j->rc, &zero, rc);
        }
    }
}

static pool_job *job_to_help(kvr_pool *p)
{
    kvr_list *n;
    kvr_list_foreach(n, &p->jobs) {
        pool_job *j = kvr_list_entry(n, pool_job, node);
        if (j->wanted > 0 && atomic_load_explicit(&j->claim, memory_order_relaxed) < j->n)
            return j;
    }
    return NULL;
}

static void *worker_main(void *arg)
{
    kvr_pool *p = arg;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        pool_job *j = NULL;
        while (!p->stop && (p->helping >= p->active || !(j = job_to_help(p))))
            pthread_cond_wait(&p->work_cv, &p->lock);
        if (p->stop || !j)
            break;
        j->wanted--;
        j->running++;
        p->helping++;
        pthread_mutex_unlock(&p->lock);
        job_run(j);
        pthread_mutex_lock(&p->lock);
        assert(j->running > 0 && p->helping > 0);
        p->helping--;
        if (--j->running == 0)
            pthread_cond_broadcast(&p->done_cv);
        /* a worker held back by the cap may take a job now */
        if (!kvr_list_empty(&p->jobs) && p->helping + 1 == p->active)
            pthread_cond_signal(&p->work_cv);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

int kvr_pool_create(kvr_pool **out, unsigned n_workers)
{
    *out = NULL;
    if (n_workers > KVR_POOL_MAX_WORKERS)
        n_workers = KVR_POOL_MAX_WORKERS;
    kvr_pool *p = calloc(1, sizeof *p);
    if (!p)
        return KVR_ENOMEM;
    p->threads = calloc(n_workers ? n_workers : 1, sizeof *p->threads);
    if (!p->threads) {
        free(p);
        return KVR_ENOMEM;
    }
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    kvr_list_init(&p->jobs);
    /* Fewer threads than asked is still a working pool (the callers do
     * the rest): a failed pthread_create only costs speed. */
    for (unsigned i = 0; i < n_workers; i++) {
        if (pthread_create(&p->threads[p->n_workers], NULL, worker_main, p) != 0)
            break;
        p->n_workers++;
    }
    p->active = p->n_workers;
    *out = p;
    return 0;
}

/* Stops and joins the workers; p stays usable (callers run alone). */
static void pool_stop(kvr_pool *p)
{
    pthread_mutex_lock(&p->lock);
    p->stop = true;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->lock);
    for (unsigned i = 0; i < p->n_workers; i++)
        pthread_join(p->threads[i], NULL);
    p->n_workers = 0;
}

void kvr_pool_destroy(kvr_pool *p)
{
    if (!p)
        return;
    pool_stop(p);
    assert(kvr_list_empty(&p->jobs));   /* destroying a pool in use is a caller bug */
    pthread_cond_destroy(&p->done_cv);
    pthread_cond_destroy(&p->work_cv);
    pthread_mutex_destroy(&p->lock);
    free(p->threads);
    free(p);
}

unsigned kvr_pool_threads(const kvr_pool *p)
{
    if (!p)
        return 1;
    /* active may change under the lock meanwhile: an atomic read */
    unsigned a = __atomic_load_n(&p->active, __ATOMIC_RELAXED);
    return (a < p->n_workers ? a : p->n_workers) + 1;
}

void kvr_pool_set_active(kvr_pool *p, unsigned n_workers)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->lock);
    __atomic_store_n(&p->active, n_workers, __ATOMIC_RELAXED);
    /* raised: idle workers may now join listed jobs */
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->lock);
}

int kvr_pool_for(kvr_pool *p, size_t n, unsigned max_threads,
                 int (*fn)(void *ud, size_t i), void *ud)
{
    pool_job j = { .n = n, .fn = fn, .ud = ud };
    atomic_init(&j.claim, 0);
    atomic_init(&j.rc, 0);
    if (n == 0)
        return 0;
    unsigned helpers = max_threads > 1 ? max_threads - 1 : 0;
    if ((size_t)helpers > n - 1)
        helpers = (unsigned)(n - 1);
    if (helpers > 0 && !p)
        p = kvr_pool_default();
    if (p && helpers > 0) {
        pthread_mutex_lock(&p->lock);
        if (p->stop || p->n_workers == 0) {
            helpers = 0;
        } else {
            j.wanted = helpers;
            kvr_list_insert_head(&p->jobs, &j.node);
            if (helpers == 1)
                pthread_cond_signal(&p->work_cv);
            else
                pthread_cond_broadcast(&p->work_cv);
        }
        pthread_mutex_unlock(&p->lock);
    } else {
        helpers = 0;
    }
    job_run(&j);
    if (helpers > 0) {
        pthread_mutex_lock(&p->lock);
        kvr_list_remove(&j.node);
        while (j.running > 0)
            pthread_cond_wait(&p->done_cv, &p->lock);
        pthread_mutex_unlock(&p->lock);
    }
    assert(atomic_load(&j.rc) != 0 || atomic_load(&j.claim) >= n);
    return atomic_load(&j.rc);
}

/* ---- the process's pool --------------------------------------------------- */

/* Created on first use, one worker per online CPU besides the caller; its
 * workers are joined at exit (the struct stays, so a straggling caller after
 * that runs alone). A forked child starts over with a pool of its own: the
 * parent's threads do not exist there. */
static kvr_pool *default_pool;
static kvr_pool *orphan_pool;       /* a parent's, in a forked child: kept reachable */
static pthread_mutex_t default_lock = PTHREAD_MUTEX_INITIALIZER;
static bool default_hooks;

static void default_at_exit(void)
{
    pthread_mutex_lock(&default_lock);
    kvr_pool *p = default_pool;
    pthread_mutex_unlock(&default_lock);
    if (p)
        pool_stop(p);
}

static void fork_prepare(void) { pthread_mutex_lock(&default_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&default_lock); }
static void fork_child(void)
{
    if (default_pool)
        orphan_pool = default_pool;   /* its workers are not here; never used again */
    default_pool = NULL;
    pthread_mutex_unlock(&default_lock);
}

kvr_pool *kvr_pool_default(void)
{
    pthread_mutex_lock(&default_lock);
    if (!default_pool) {
        if (!default_hooks) {
            default_hooks = true;
            atexit(default_at_exit);
            pthread_atfork(fork_prepare, fork_parent, fork_child);
        }
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        unsigned n = cpus > 1 ? (unsigned)(cpus - 1) : 0;
        kvr_pool *p;
        if (kvr_pool_create(&p, n) == 0)
            default_pool = p;
    }
    kvr_pool *p = default_pool;
    pthread_mutex_unlock(&default_lock);
    return p;
}
