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

static int do_register(kvr_client *c, int fd, uint64_t size, uint32_t *id)
{
    Kvrope__RegisterRegion rr = KVROPE__REGISTER_REGION__INIT;
    rr.size = size;
    Kvrope__Request req = KVROPE__REQUEST__INIT;
    req.body_case = KVROPE__REQUEST__BODY_REGISTER_REGION;
    req.register_region = &rr;
    Kvrope__Response *resp;
    c->shm_next = false;
    c->send_fd = fd;
    int r = kvr__call(c, &req, NULL, 0, 0, &resp, NULL);
    c->send_fd = -1;
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
    Kvrope__Request req = KVROPE__REQUEST__INIT;
    req.body_case = KVROPE__REQUEST__BODY_RELEASE_REGION;
    req.release_region = &rr;
    Kvrope__Response *resp;
    c->shm_next = false;
    int r = kvr__call(c, &req, NULL, 0, 0, &resp, NULL);
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

int kvr_client_put_shm(kvr_client *c, const kvr_put_args *a, const kvr_shm *at,
                       kvr_put_res *out)
{
    kvr_client_shm_next(c, at);
    return shm_done(c, kvr_client_put(c, a, out));
}

int kvr_client_get_shm(kvr_client *c, const kvr_get_args *a, const kvr_shm *at, kvr_kv *out)
{
    place_out(c, at);
    return shm_done(c, kvr_client_get(c, a, out));
}

int kvr_client_match_shm(kvr_client *c, const kvr_match_args *a, const kvr_shm *at,
                         kvr_match_res *out)
{
    place_out(c, at);
    return shm_done(c, kvr_client_match(c, a, out));
}

int kvr_client_assemble_shm(kvr_client *c, const kvr_assemble_args *a, const kvr_shm *at,
                            kvr_assemble_res *out)
{
    place_out(c, at);
    return shm_done(c, kvr_client_assemble(c, a, out));
}

int kvr_client_cover_shm(kvr_client *c, const kvr_cover_args *a, const kvr_shm *at,
                         kvr_cover_res *out)
{
    place_out(c, at);
    int r = kvr_client_cover_get(c, a, out);
    c->shm_next = false;
    return r;
}

int kvr_client_edit_shm(kvr_client *c, const kvr_edit_args *a, const kvr_shm *at,
                        kvr_edit_res *out)
{
    kvr_client_shm_next(c, at);
    return shm_done(c, kvr_client_edit(c, a, out));
}

int kvr_client_refresh_shm(kvr_client *c, const kvr_refresh_args *a, const kvr_shm *at,
                           kvr_edit_res *out)
{
    kvr_client_shm_next(c, at);
    return shm_done(c, kvr_client_refresh(c, a, out));
}
