/*
 * parallel.h — the store's fork/join over layers for its *_work functions
 * (private to cache/), a thin user of the process's worker pool (base/pool.c).
 * A get or an assemble that re-rotates many keys splits its layers across the
 * pool's threads; small requests stay on the calling thread, where waking
 * workers would cost more than it saves.
 */
#ifndef KVR_CACHE_PARALLEL_H
#define KVR_CACHE_PARALLEL_H

#include <stddef.h>

#pragma GCC visibility push(hidden)

/* Threads worth using for `work_bytes` of output: 1 below 4 MiB, else up to
 * the online CPUs (at most 8). */
unsigned kvr__par_threads_for(size_t work_bytes);

/* Calls fn(ud, i) for every i in [0, n), on up to n_threads threads (the
 * caller's included); items are handed out one at a time. Stops handing out
 * items after the first non-zero return and returns it (0 if all succeeded).
 * Without free workers the caller does the work alone. */
int kvr__par_for(size_t n, unsigned n_threads, int (*fn)(void *ud, size_t i), void *ud);

#pragma GCC visibility pop

#endif
