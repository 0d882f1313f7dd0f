/*
 * parallel.c — fork/join over an index range for the store's work functions.
 * Invariant: every index in [0, n) is run at most once, and exactly once
 * unless an earlier call failed; the caller's thread always takes part, so a
 * failure to create threads only costs speed.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "cache/parallel.h"

#define PAR_MIN_BYTES ((size_t)4 << 20)
#define PAR_MAX_THREADS 8u

typedef struct par_job {
    size_t n;
    atomic_size_t next;
    atomic_int rc;
    int (*fn)(void *ud, size_t i);
    void *ud;
} par_job;

unsigned par_threads_for(size_t work_bytes)
{
    if (work_bytes < PAR_MIN_BYTES)
        return 1;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned t = cpus > 0 ? (unsigned)cpus : 1u;
    return t > PAR_MAX_THREADS ? PAR_MAX_THREADS : t;
}

static void *par_run(void *arg)
{
    par_job *j = arg;
    for (;;) {
        if (atomic_load_explicit(&j->rc, memory_order_relaxed) != 0)
            break;
        size_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n)
            break;
        int rc = j->fn(j->ud, i);
        if (rc != 0) {
            int zero = 0;
            atomic_compare_exchange_strong(&j->rc, &zero, rc);
        }
    }
    return NULL;
}

int par_for(size_t n, unsigned n_threads, int (*fn)(void *ud, size_t i), void *ud)
{
    par_job j = { .n = n, .fn = fn, .ud = ud };
    atomic_init(&j.next, 0);
    atomic_init(&j.rc, 0);
    if (n_threads > n)
        n_threads = (unsigned)n;
    if (n_threads > PAR_MAX_THREADS)
        n_threads = PAR_MAX_THREADS;
    pthread_t tid[PAR_MAX_THREADS];
    unsigned started = 0;
    for (unsigned k = 1; k < n_threads; k++) {
        if (pthread_create(&tid[started], NULL, par_run, &j) != 0)
            break;
        started++;
    }
    par_run(&j);
    for (unsigned k = 0; k < started; k++)
        pthread_join(tid[k], NULL);
    return atomic_load(&j.rc);
}
