/*
 * warm.c — --prefault: the memory the store will use, faulted in once at
 * start, in the background, so the first puts do not pay the kernel's first
 * touch of fresh pages (on VMs that hand free pages back to their host it
 * runs at ~0.35 GB/s against ~20 GB/s for memory already touched).
 *
 * A thread bound to the loop thread's jemalloc arena (where blocks are
 * allocated: puts and reloads begin on the loop) allocates chunks up to the
 * asked size, writes every page, and frees them all. With main.c's
 * malloc_conf (dirty_decay_ms -1) freed pages stay mapped in the arena, so
 * the store's next allocations reuse them warm; only an idle purge the
 * operator asked for (--idle-purge) gives them back.
 *
 * Invariants: the chunks are plain malloc, never kvr_mem (they are not the
 * store's and are all freed before the thread ends); it stops taking more
 * once the store's own allocations plus what it holds reach the cap, and at
 * once when the daemon stops (kvr__warm_stop joins it). Without jemalloc
 * (sanitizer builds) it does nothing.
 */
#include "base/clock.h"
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef KVR_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#include "daemon/daemon_internal.h"

#define WARM_CHUNK ((size_t)64 << 20)

#ifdef KVR_JEMALLOC

static void *warm_main(void *arg)
{
    kvr_daemon *d = arg;
    unsigned arena = d->warm_arena;
    (void)mallctl("thread.arena", NULL, NULL, &arena, sizeof arena);
    size_t n_max = (size_t)(d->warm_want / WARM_CHUNK) + 1, n = 0, held = 0;
    void **chunks = calloc(n_max, sizeof *chunks);
    double t0 = kvr_clock_mono_msf();
    while (chunks && n < n_max && held < d->warm_want &&
           !atomic_load_explicit(&d->warm_stop, memory_order_relaxed)) {
        size_t k = d->warm_want - held < WARM_CHUNK ? (size_t)(d->warm_want - held) : WARM_CHUNK;
        if (d->cfg.max_memory) {   /* what the cap leaves beside the store's own */
            size_t used = kvr_mem_allocated() + held;
            size_t room = d->cfg.max_memory > used ? (size_t)d->cfg.max_memory - used : 0;
            k = k < room ? k : room;
        }
        if (k < 4096)
            break;
        void *p = malloc(k);
        if (!p)
            break;
        /* Every page written (not memset to 0: a compiler may make
         * malloc + memset a calloc, which fresh pages skip). */
        volatile uint8_t *q = p;
        for (size_t i = 0; i < k; i += 4096)
            q[i] = 1;
        chunks[n++] = p;
        held += k;
    }
    double ms = kvr_clock_mono_msf() - t0;
    for (size_t i = 0; i < n; i++)
        free(chunks[i]);
    free(chunks);
    atomic_store(&d->warm_done_bytes, (uint64_t)held);
    atomic_store(&d->warm_done_us, (uint64_t)(ms * 1e3));
    kvr_log(KVR_LOG_INFO, "prefault: %zu MiB faulted in, %.0f ms (first touch %.2f GB/s); "
            "kept mapped for the store", held >> 20, ms, ms > 0 ? (double)held / ms / 1e6 : 0);
    return NULL;
}
#endif

int kvr__warm_start(kvr_daemon *d, kvr_error *err)
{
    uint64_t want = d->cfg.prefault;
    if (want == 0)
        return 0;
    if (want == UINT64_MAX || (d->cfg.max_memory && want > d->cfg.max_memory))
        want = d->cfg.max_memory;
#ifdef KVR_JEMALLOC
    unsigned arena = 0;
    size_t sz = sizeof arena;
    if (mallctl("thread.arena", &arena, &sz, NULL, 0) != 0)
        arena = 0;
    d->warm_arena = arena;
    d->warm_want = want;
    atomic_store(&d->warm_stop, false);
    int rc = pthread_create(&d->warm_thread, NULL, warm_main, d);
    if (rc != 0)
        return kvr_error_sys(err, KVR_EINTERNAL, rc, "prefault thread");
    d->has_warm = true;
#else
    (void)err;
    kvr_log(KVR_LOG_INFO, "prefault: not in this build (no jemalloc)");
#endif
    return 0;
}

void kvr__warm_stop(kvr_daemon *d)
{
    if (!d->has_warm)
        return;
    atomic_store(&d->warm_stop, true);
    pthread_join(d->warm_thread, NULL);
    d->has_warm = false;
}
