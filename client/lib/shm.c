/*
 * shm.c — libkvrope's shared-memory regions (docs/protocol.md, Shared
 * memory): memfd creation and sealing, RegisterRegion with the fd passed
 * by SCM_RIGHTS (client.c's send_all attaches c->send_fd to the frame),
 * the per-call placement (Request.shm) and the view of a region a get's
 * result points into.
 *
 * Invariants: the handle's region table holds what the daemon accepted on
 * this connection; a region the library mapped is unmapped (and its fd
 * closed) when released or when the handle closes. A placement is one-shot:
 * kvr__call consumes it, and the *_shm wrappers clear it in every case.
 */
#include "client/lib/client_int.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#define MFD_ALLOW_SEALING 0x0002U
#endif
#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#endif

void *kvr__shm_ptr(kvr_client *c, const kvr_shm *at)
{
    for (size_t i = 0; i < c->n_regions; i++) {
        struct kvr__region *g = &c->regions[i];
        if (g->id != at->region)
            continue;
        if (at->offset > g->size || at->length > g->size - at->offset)
            return NULL;
        return g->base + at->offset;
    }
    return NULL;
}

static void region_drop(struct kvr__region *g)
{
    if (g->owned && g->base)
        munmap(g->base, g->size);
    if (g->fd >= 0)
        close(g->fd);
}

void kvr__shm_free_all(kvr_client *c)
{
    for (size_t i = 0; i < c->n_regions; i++)
        region_drop(&c->regions[i]);
    free(c->regions);
    c->regions = NULL;
    c->n_regions = c->cap_regions = 0;
}

/* A region request: never placed in a region itself; fd (or -1) passed
 * along with the frame. */
static int region_call(kvr_client *c, Kvrope__Request *req, int fd, Kvrope__Response **resp)
{
    c->shm_next = false;
    c->send_fd = fd;
    int r = kvr__call(c, req, NULL, 0, 0, resp, NULL);
    c->send_fd = -1;
    return r;
}

static int do_register(kvr_client *c, int fd, uint64_t size, uint32_t *id)
{
    Kvrope__RegisterRegion rr = KVROPE__REGISTER_REGION__INIT;
    rr.size = size;
    KVR_REQUEST(req, REGISTER_REGION, register_region, &rr);
    Kvrope__Response *resp;
    int r = region_call(c, &req, fd, &resp);
    if (r < 0)
        return r;
    if (resp->body_case != KVROPE__RESPONSE__BODY_REGION) {
        kvrope__response__free_unpacked(resp, NULL);
        return kvr__fail(c, KVR_EPROTO, "register_region: unexpected response body");
    }
    *id = resp->region->region;
    kvrope__response__free_unpacked(resp, NULL);
    return 0;
}

static int table_add(kvr_client *c, const struct kvr__region *g)
{
    if (c->n_regions == c->cap_regions) {
        size_t ncap = c->cap_regions ? 2 * c->cap_regions : 4;
        struct kvr__region *n = realloc(c->regions, ncap * sizeof *n);
        if (!n)
            return kvr__fail(c, KVR_ENOMEM, "out of memory");
        c->regions = n;
        c->cap_regions = ncap;
    }
    assert(c->n_regions < c->cap_regions);   /* the table's bounds */
    c->regions[c->n_regions++] = *g;
    return 0;
}

int kvr_client_region_register(kvr_client *c, int fd, uint64_t size, void *base, uint32_t *id)
{
    c->err[0] = 0;
    if (size == 0 || size > SIZE_MAX)
        return kvr__fail(c, KVR_EINVAL, "region_register: size %llu", (unsigned long long)size);
    struct kvr__region g = { .fd = -1, .size = (size_t)size, .base = base };
    if (!base) {
        void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            return kvr__fail(c, KVR_ESYS, "region_register: mmap: %s", strerror(errno));
        g.base = p;
        g.owned = true;
    }
    int r = do_register(c, fd, size, &g.id);
    if (r == 0)
        r = table_add(c, &g);
    if (r < 0 && g.owned)
        munmap(g.base, g.size);
    if (r == 0 && id)
        *id = g.id;
    return r;
}

int kvr_client_region_create(kvr_client *c, size_t size, uint32_t *id, void **base)
{
    c->err[0] = 0;
    if (base)
        *base = NULL;
    if (size == 0)
        return kvr__fail(c, KVR_EINVAL, "region_create: size 0");
    int fd = memfd_create("kvrope-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return kvr__fail(c, KVR_ESYS, "memfd_create: %s", strerror(errno));
    if (ftruncate(fd, (off_t)size) < 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0) {
        int e = errno;
        close(fd);
        return kvr__fail(c, KVR_ESYS, "region_create: %s", strerror(e));
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        close(fd);
        return kvr__fail(c, KVR_ESYS, "region_create: mmap: %s", strerror(e));
    }
    struct kvr__region g = { .fd = fd, .size = size, .base = p, .owned = true };
    int r = do_register(c, fd, size, &g.id);
    if (r == 0)
        r = table_add(c, &g);
    if (r < 0) {
        munmap(p, size);
        close(fd);
        return r;
    }
    if (id)
        *id = g.id;
    if (base)
        *base = p;
    return 0;
}

int kvr_client_region_release(kvr_client *c, uint32_t id)
{
    c->err[0] = 0;
    size_t i = 0;
    while (i < c->n_regions && c->regions[i].id != id)
        i++;
    if (i == c->n_regions)
        return kvr__fail(c, KVR_EINVAL, "region_release: no region %u", id);
    Kvrope__ReleaseRegion rr = KVROPE__RELEASE_REGION__INIT;
    rr.region = id;
    KVR_REQUEST(req, RELEASE_REGION, release_region, &rr);
    Kvrope__Response *resp;
    int r = region_call(c, &req, -1, &resp);
    if (r == 0)
        kvrope__response__free_unpacked(resp, NULL);
    /* Gone from the table either way: a closed connection has no regions. */
    region_drop(&c->regions[i]);
    c->regions[i] = c->regions[--c->n_regions];
    return r;
}

void *kvr_client_region_base(kvr_client *c, uint32_t id, size_t *size)
{
    for (size_t i = 0; i < c->n_regions; i++)
        if (c->regions[i].id == id) {
            if (size)
                *size = c->regions[i].size;
            return c->regions[i].base;
        }
    return NULL;
}

void kvr_client_shm_next(kvr_client *c, const kvr_shm *at)
{
    c->shm_next = at != NULL;
    if (at)
        c->shm_at = *at;
}

/* The request that used the region has been sent (or failed): the next
 * one does not, unless asked again. Returns r. */
static int shm_done(kvr_client *c, int r)
{
    c->shm_next = false;
    return r;
}

/* A get's room: length 0 = to the end of the region. */
static void place_out(kvr_client *c, const kvr_shm *at)
{
    kvr_shm p = *at;
    size_t sz;
    if (p.length == 0 && kvr_client_region_base(c, p.region, &sz) && p.offset <= sz)
        p.length = sz - p.offset;
    kvr_client_shm_next(c, &p);
}

/* The *_shm verbs: the placement set (a get's room: place_out), the call,
 * the placement cleared whatever the call did. */
#define SHM_VERB(verb, call, args_t, res_t, place)                              \
    int kvr_client_##verb##_shm(kvr_client *c, const args_t *a, const kvr_shm *at, \
                                res_t *out)                                     \
    {                                                                           \
        place(c, at);                                                           \
        return shm_done(c, call(c, a, out));                                    \
    }

SHM_VERB(put, kvr_client_put, kvr_put_args, kvr_put_res, kvr_client_shm_next)
SHM_VERB(edit, kvr_client_edit, kvr_edit_args, kvr_edit_res, kvr_client_shm_next)
SHM_VERB(refresh, kvr_client_refresh, kvr_refresh_args, kvr_edit_res, kvr_client_shm_next)
SHM_VERB(get, kvr_client_get, kvr_get_args, kvr_kv, place_out)
SHM_VERB(match, kvr_client_match, kvr_match_args, kvr_match_res, place_out)
SHM_VERB(assemble, kvr_client_assemble, kvr_assemble_args, kvr_assemble_res, place_out)
SHM_VERB(cover, kvr_client_cover_get, kvr_cover_args, kvr_cover_res, place_out)
