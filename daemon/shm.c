/*
 * shm.c — shared-memory regions of a Unix-socket connection (docs/protocol.md "Shared memory"): a client hands the daemon a memfd once
 * (RegisterRegion + SCM_RIGHTS), then names (region, offset, length) in
 * Request.shm instead of sending or receiving a socket payload.
 *
 * The daemon trusts nothing about a region:
 *  - it must be a memfd (shmem: F_GET_SEALS works and the file lives on
 *    tmpfs, not hugetlbfs) sealed against shrinking (F_SEAL_SHRINK), so the
 *    mapping can never be cut under a worker thread (SIGBUS), and at least
 *    the size registered; anything else is refused with a clear error;
 *  - every slice is checked against the region's size without overflow;
 *  - the client may change the bytes at any time: puts copy out of the
 *    region first and validate the daemon's copy (dispatch.c).
 * Regions count against --max-regions / --max-region-bytes per connection,
 * and against one cap over all connections (d->region_cap,
 * --max-regions-total): each region is a mapping, and the kernel's
 * vm.max_map_count (65,530 by default) is the whole process's, so 1,024
 * connections x 64 regions would leave the allocator no mappings and
 * unrelated clients' puts would fail with E_NO_MEMORY. The
 * default cap is max_map_count less headroom for the daemon's own maps
 * (KVR_MAP_HEADROOM, or a quarter when that is more); a register past it
 * gets E_LIMIT, and only the client that asked sees it.
 *
 * Lifetime: a region is reference counted on the loop thread only. The
 * connection holds one reference from registration until ReleaseRegion or
 * the connection closes; a request naming it holds another until it ends,
 * so the mapping outlives any work in flight on it (worker threads only
 * read the base pointer). The last reference unmaps it.
 *
 * File descriptors: the pipe is in libuv's ipc mode, so fds sent with a
 * frame's bytes are queued on the handle. Each frame's fds are taken when
 * it is dispatched (kvr__shm_take_fd): the first is kept for a
 * RegisterRegion, every other one is closed; fds on a frame that takes
 * none, or more than KVR_MAX_PENDING_FDS waiting for one frame, close
 * the connection (conn.c), so none accumulate.
 */
#include "daemon/daemon_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#ifndef F_GET_SEALS
#define F_ADD_SEALS 1033
#define F_GET_SEALS 1034
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#define F_SEAL_WRITE 0x0008
#endif
#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

/* Mappings kept for the daemon itself (libraries, thread stacks, the
 * allocator's extents, io_uring rings) when the region cap is derived. */
#define KVR_MAP_HEADROOM 16384u

void kvr__shm_init(kvr_daemon *d)
{
    uint64_t maps = 65530;     /* the kernel's default */
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    if (f) {
        unsigned long long v;
        if (fscanf(f, "%llu", &v) == 1 && v > 0)
            maps = v;
        fclose(f);
    }
    uint64_t room = maps / 4 > KVR_MAP_HEADROOM ? maps / 4 : KVR_MAP_HEADROOM;
    uint64_t cap = maps > 2 * room ? maps - room : maps / 2;
    if (cap > (1u << 30))
        cap = 1u << 30;
    if (d->cfg.max_regions_total) {
        if (d->cfg.max_regions_total > cap)
            kvr_log(KVR_LOG_WARN, "--max-regions-total %u leaves fewer than %llu of "
                    "vm.max_map_count (%llu) for the daemon's own mappings: when regions use "
                    "them up, allocations fail for every client", d->cfg.max_regions_total,
                    (unsigned long long)room, (unsigned long long)maps);
        cap = d->cfg.max_regions_total;
    }
    d->region_cap = (uint32_t)cap;
    if (d->cfg.max_regions)
        kvr_log(KVR_LOG_INFO, "shared-memory regions: at most %u over all connections "
                "(vm.max_map_count %llu)", d->region_cap, (unsigned long long)maps);
}

static void region_free(kvr_region *g)
{
    if (g->base)
        munmap(g->base, g->size);
    kvr_mem_free(g);
}

void kvr__region_ref(kvr_region *g)
{
    kvr_ref_get(&g->refs);
}

void kvr__region_unref(kvr_region *g)
{
    if (g && kvr_ref_put(&g->refs))
        region_free(g);
}

static void close_tmp(uv_handle_t *h)
{
    kvr_mem_free(h);
}

/* Takes every fd queued on c's handle: the first is kept (a dup, returned)
 * when keep_first, every other one closed. -1: none kept. */
static int take_pending(kvr_conn *c, bool keep_first)
{
    if (c->is_tcp || c->closing || uv_pipe_pending_count(&c->h.pipe) == 0)
        return -1;
    int keep = keep_first ? -1 : -2;
    while (uv_pipe_pending_count(&c->h.pipe) > 0) {
        uv_pipe_t *tmp = kvr_mem_malloc(sizeof *tmp);
        if (!tmp || uv_pipe_init(&c->d->loop, tmp, 0) < 0) {
            kvr_mem_free(tmp);
            break;
        }
        if (uv_accept(&c->h.stream, (uv_stream_t *)tmp) == 0) {
            uv_os_fd_t fd;
            if (keep == -1 && uv_fileno((uv_handle_t *)tmp, &fd) == 0)
                keep = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        }
        uv_close((uv_handle_t *)tmp, close_tmp);   /* closes its fd */
    }
    /* uv_accept re-arms the read watcher once the queue is empty; a
     * connection that is not reading must not be woken by its bytes. */
    if (!c->reading && !c->closing)
        kvr__conn_quiet(c);
    return keep < 0 ? -1 : keep;
}

int kvr__shm_take_fd(kvr_conn *c)
{
    return take_pending(c, true);
}

void kvr__shm_drop_fds(kvr_conn *c)
{
    take_pending(c, false);
}

int kvr__shm_register(kvr_conn *c, int fd, uint64_t size, kvr_region **out, kvr_error *e)
{
    *out = NULL;
    const kvr_daemon_config *cfg = &c->d->cfg;
    if (c->is_tcp)
        return kvr_error_set(e, KVR_EUNSUPPORTED, "register_region: shared memory needs the "
                             "Unix socket (a memfd cannot cross TCP); send the payload instead");
    if (fd < 0)
        return kvr_error_set(e, KVR_EBADREQUEST, "register_region: no file descriptor came "
                             "with the frame (send the memfd with SCM_RIGHTS on its bytes)");
    if (size == 0 || size > (uint64_t)SIZE_MAX / 2)
        return kvr_error_set(e, KVR_EINVAL, "register_region: size %llu is not a region size",
                             (unsigned long long)size);
    int seals = fcntl(fd, F_GET_SEALS);
    struct statfs sf;
    struct stat st;
    if (seals < 0 || fstatfs(fd, &sf) < 0 || sf.f_type != TMPFS_MAGIC || fstat(fd, &st) < 0 ||
        !S_ISREG(st.st_mode))
        return kvr_error_set(e, KVR_EINVAL, "register_region: the file descriptor is not a "
                             "memfd (memfd_create(..., MFD_ALLOW_SEALING), not hugetlb)");
    if (!(seals & F_SEAL_SHRINK))
        return kvr_error_set(e, KVR_EINVAL, "register_region: the memfd is not sealed against "
                             "shrinking (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)): a truncated "
                             "region would crash the daemon");
    if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE))
        return kvr_error_set(e, KVR_EINVAL, "register_region: the memfd is sealed against "
                             "writes; the daemon writes gets into it");
    if ((uint64_t)st.st_size < size)
        return kvr_error_set(e, KVR_ERANGE, "register_region: the memfd holds %llu bytes, "
                             "fewer than the %llu registered (ftruncate it first)",
                             (unsigned long long)st.st_size, (unsigned long long)size);
    if (c->n_regions >= cfg->max_regions)
        return kvr_error_set(e, KVR_ELIMIT, "register_region: this connection has %u regions, "
                             "the limit (--max-regions %u)", c->n_regions, cfg->max_regions);
    if (size > cfg->max_region_bytes || c->region_bytes > cfg->max_region_bytes - size)
        return kvr_error_set(e, KVR_ELIMIT, "register_region: %llu more bytes would pass this "
                             "connection's limit (--max-region-bytes %llu, %llu registered)",
                             (unsigned long long)size,
                             (unsigned long long)cfg->max_region_bytes,
                             (unsigned long long)c->region_bytes);
    kvr_daemon *d = c->d;
    if (d->n_regions_all >= d->region_cap)
        return kvr_error_set(e, KVR_ELIMIT, "register_region: the daemon holds %u regions over "
                             "all connections, its limit (--max-regions-total %u%s): release "
                             "regions, or send the payload on the socket", d->n_regions_all,
                             d->region_cap, cfg->max_regions_total ? ""
                             : ", from vm.max_map_count");
    kvr_region *g = kvr_mem_calloc(1, sizeof *g);
    if (!g)
        return kvr_error_set(e, KVR_ENOMEM, "register_region: out of memory");
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int er = errno;
        kvr_mem_free(g);
        /* ENOMEM here is the address space or the map count, not the
         * store's memory: E_LIMIT, for this client only. */
        return kvr_error_set(e, er == ENOMEM ? KVR_ELIMIT : KVR_EINVAL,
                             "register_region: cannot map the memfd read-write: %s%s",
                             strerror(er), er == ENOMEM ? " (vm.max_map_count reached?)" : "");
    }
    g->base = p;
    g->size = (size_t)size;
    kvr_ref_init(&g->refs, 1);    /* the connection's */
    g->id = ++c->region_seq;
    if (g->id == 0)
        g->id = ++c->region_seq;
    kvr_list_insert_head(&c->regions, &g->link);
    c->n_regions++;
    d->n_regions_all++;
    c->region_bytes += size;
    *out = g;
    return 0;
}

kvr_region *kvr__shm_find(kvr_conn *c, uint32_t id)
{
    kvr_list *n;
    kvr_list_foreach(n, &c->regions) {
        kvr_region *g = kvr_list_entry(n, kvr_region, link);
        if (g->id == id)
            return g;
    }
    return NULL;
}

int kvr__shm_release(kvr_conn *c, uint32_t id, kvr_error *e)
{
    kvr_region *g = kvr__shm_find(c, id);
    if (!g)
        return kvr_error_set(e, KVR_EINVAL, "release_region: no region %u on this connection",
                             id);
    kvr_list_remove(&g->link);
    c->n_regions--;
    c->d->n_regions_all--;
    c->region_bytes -= g->size;
    kvr__region_unref(g);
    return 0;
}

void kvr__shm_conn_closed(kvr_conn *c)
{
    c->d->n_regions_all -= c->n_regions;
    c->n_regions = 0;
    c->region_bytes = 0;
    for (kvr_list *n; (n = kvr_list_first(&c->regions));) {
        kvr_list_remove(n);
        /* A request using the region keeps its own reference. */
        kvr__region_unref(kvr_list_entry(n, kvr_region, link));
    }
}

int kvr__shm_slice(kvr_conn *c, uint32_t region, uint64_t offset, uint64_t length,
                   kvr_region **out, uint8_t **p, kvr_error *e)
{
    *out = NULL;
    *p = NULL;
    if (c->is_tcp)
        return kvr_error_set(e, KVR_EUNSUPPORTED, "shm: shared memory needs the Unix socket; "
                             "over TCP the payload travels on the connection");
    kvr_region *g = kvr__shm_find(c, region);
    if (!g)
        return kvr_error_set(e, KVR_EINVAL, "shm: no region %u on this connection "
                             "(register it first; regions are per connection)", region);
    if (offset > g->size || length > g->size - offset)
        return kvr_error_set(e, KVR_ERANGE, "shm: [%llu, +%llu) is outside region %u's %zu "
                             "bytes", (unsigned long long)offset, (unsigned long long)length,
                             region, g->size);
    kvr__region_ref(g);
    *out = g;
    *p = g->base + offset;
    return 0;
}
