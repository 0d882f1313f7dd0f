/* main.c — kvroped's entry point; everything lives in the daemon/ library
 * (kvr_daemon_main) so tests can drive the same code. */
#include "daemon/daemon.h"

#ifdef KVR_JEMALLOC
/* jemalloc's options for kvroped. Pages freed by a delete or an eviction
 * are kept for the next put instead of being handed back on jemalloc's
 * decay clock: a put into freshly mapped pages faults them in 4 KiB at a
 * time, which cost ~8x the copy itself (1 MiB-64 MiB puts).
 * lg_extent_max_active_fit: freed blocks next to each other coalesce into
 * large free extents, and by default jemalloc will not split a free extent
 * over 64x a request's size for it: it maps fresh pages instead, so with
 * several clients putting and deleting 64 MiB contexts the retained pages
 * went unused while the resident size grew to the whole cap (4 GiB for
 * 1 GiB live) and ~15% of every put faulted (bench_shm, 4 clients: 0.16x
 * memcpy, 0.6x with this). With it the retained pages are reused, so the
 * memory held stays near the peak of live allocations, which the cap
 * bounds; server.c's sweep gives them back to the kernel once the daemon
 * has been idle for a while. */
const char *malloc_conf = "dirty_decay_ms:-1,muzzy_decay_ms:-1,lg_extent_max_active_fit:30";
#endif

int main(int argc, char **argv)
{
    return kvr_daemon_main(argc, argv);
}
