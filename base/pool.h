/*
 * pool.h — the process's persistent worker pool (base/pool.c), lent to every
 * parallel loop of the project: RoPE rotation (rope/), the store's per-layer
 * get / assemble / codec work (cache/parallel.c). Part of the installed API
 * (through rope/rope.h).
 */
#ifndef KVR_BASE_POOL_H
#define KVR_BASE_POOL_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- worker pool --------------------------------------------------------- */
/* One persistent pool of threads for every parallel loop of the project
 * (rotation here, conversion and codecs in the store): threads are created
 * once, not per call. Thread-safe; loops may be started from any number of
 * threads at once and may nest (an item may run a loop of its own) without
 * deadlock: the calling thread always works on its own loop and never waits
 * for an index nobody has claimed. */
typedef struct kvr_pool kvr_pool;

#define KVR_POOL_MAX_WORKERS 64

/* A pool of n_workers threads (0: callers run their loops alone); at most
 * KVR_POOL_MAX_WORKERS. 0 or KVR_ENOMEM; the caller owns *out. */
int  kvr_pool_create(kvr_pool **out, unsigned n_workers);
/* Joins the workers and frees the pool; no loop may be running on it.
 * NULL is a no-op. */
void kvr_pool_destroy(kvr_pool *p);
/* The process's pool, created on first use with one worker per online CPU
 * besides the caller, its workers joined at exit. Borrowed; never NULL
 * unless it could not be allocated (then loops run on the caller). */
kvr_pool *kvr_pool_default(void);
/* Threads a loop on p can use: its workers allowed to help (below) plus
 * the caller. */
unsigned kvr_pool_threads(const kvr_pool *p);
/* At most n_workers of p's workers help loops at any one time, whatever the
 * number of loops running (the callers' threads always work on their own
 * loops); the rest sleep. Starts at all of them. A process that shares its
 * cores with other work caps the pool so; benchmarks measure 1..N threads
 * with it. Results never depend on it. NULL is a no-op. */
void kvr_pool_set_active(kvr_pool *p, unsigned n_workers);

/* Calls fn(ud, i) for every i in [0, n), each exactly once, on at most
 * max_threads threads (the caller's included; p NULL = kvr_pool_default()).
 * After the first non-zero return no further index is handed out, and that
 * value is returned (0 if every call succeeded). Returns once every call
 * has returned. */
int kvr_pool_for(kvr_pool *p, size_t n, unsigned max_threads,
                 int (*fn)(void *ud, size_t i), void *ud);

#ifdef __cplusplus
}
#endif
#endif /* KVR_BASE_POOL_H */
