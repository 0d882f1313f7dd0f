/*
 * parallel.c — the store's parallel loop over layers, on the process's
 * worker pool (kvr_pool_*, base/pool.c): this file only decides how many
 * threads a request is worth. Invariant (the pool's): every index in [0, n)
 * runs at most once, and exactly once unless an earlier call failed; the
 * caller's thread always takes part, so a pool without free workers only
 * costs speed.
 */
#include <unistd.h>

#include "cache/parallel.h"
#include "rope/rope.h"

#define PAR_MIN_BYTES ((size_t)4 << 20)
#define PAR_MAX_THREADS 8u

unsigned kvr__par_threads_for(size_t work_bytes)
{
    if (work_bytes < PAR_MIN_BYTES)
        return 1;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned t = cpus > 0 ? (unsigned)cpus : 1u;
    return t > PAR_MAX_THREADS ? PAR_MAX_THREADS : t;
}

int kvr__par_for(size_t n, unsigned n_threads, int (*fn)(void *ud, size_t i), void *ud)
{
    if (n_threads > PAR_MAX_THREADS)
        n_threads = PAR_MAX_THREADS;
    return kvr_pool_for(NULL, n, n_threads, fn, ud);
}
