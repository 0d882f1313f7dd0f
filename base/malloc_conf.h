/*
 * malloc_conf.h — kvroped's jemalloc options, as one string: daemon/main.c
 * installs it for the daemon, tests/common/kvt_bench.c for the benchmarks
 * that run the store in-process (they measure the store as kvroped runs it).
 *
 * dirty_decay_ms / muzzy_decay_ms -1: pages freed by a delete, an eviction
 * or a request's staging are kept for the next request instead of going
 * back on jemalloc's decay clock (and, for allocations over its 8 MiB
 * oversize threshold, at once): a put into freshly mapped pages faults
 * them in 4 KiB at a time, which cost ~8x the copy itself (1 MiB-64 MiB
 * puts), and on VMs that report free pages to their host first touch is
 * 10-70x a warm write. lg_extent_max_active_fit 30: freed blocks next to
 * each other coalesce into large free extents, and by default jemalloc will
 * not split a free extent over 64x a request's size for it: it maps fresh
 * pages instead, so with several clients putting and deleting 64 MiB
 * contexts the retained pages went unused while the resident size grew to
 * the whole cap (4 GiB for 1 GiB live) and ~15% of every put faulted
 * (bench_shm, 4 clients: 0.16x memcpy, 0.6x with this). With it retained
 * pages are reused, so the memory held stays near the peak of live
 * allocations, which the cap bounds; the daemon's --idle-purge gives them
 * back once it has been idle for a while.
 */
#ifndef KVR_BASE_MALLOC_CONF_H
#define KVR_BASE_MALLOC_CONF_H

#define KVR_MALLOC_CONF "dirty_decay_ms:-1,muzzy_decay_ms:-1,lg_extent_max_active_fit:30"

#endif
