/*
 * kvt_bench.c — tests/common/kvt_bench.h: the goal line, the clock, the
 * environment, xorshift64 and the disk benches' plain-file baseline and goals;
 * and kvroped's allocator options for every benchmark that links it.
 */
#include "tests/common/kvt_bench.h"
#include "base/malloc_conf.h"

#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef KVR_JEMALLOC
/* Benchmarks run the store in-process under kvroped's allocator options
 * (this object is linked by every benchmark, for kvt_goal): without them a
 * staging buffer over jemalloc's 8 MiB oversize threshold goes back to the
 * kernel when freed and is faulted in again by the next request, which
 * kvroped never does. */
const char *malloc_conf = KVR_MALLOC_CONF;
#endif

void kvt_goal(bool met, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("goal: ", stdout);
    vprintf(fmt, ap);
    va_end(ap);
    printf(" (%s)\n", met ? "met" : "not met");
}

double kvt_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t kvt_xorshift(uint64_t *state)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

size_t kvt_env_size(const char *name, size_t dflt)
{
    const char *v = getenv(name);
    return v && *v ? (size_t)strtoull(v, NULL, 10) : dflt;
}

int kvt_env_int(const char *name, int dflt, int lo, int hi)
{
    const char *v = getenv(name);
    int n = v && *v ? atoi(v) : dflt;
    return n < lo ? lo : n > hi ? hi : n;
}

int kvt_plain_open(kvt_plain *p, const char *dir)
{
    snprintf(p->path, sizeof p->path, "%.500s/plain.dat", dir);
    p->chunk = 4u << 20;
    p->buf = aligned_alloc(4096, p->chunk);
    p->fd = open(p->path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0644);
    if (p->fd < 0)
        p->fd = open(p->path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (p->buf)
        memset(p->buf, 0x5A, p->chunk);
    return p->fd >= 0 && p->buf ? 0 : -1;
}

double kvt_plain_pass(kvt_plain *p, size_t total, int write)
{
    double t0 = kvt_now_s();
    for (size_t o = 0; o < total; o += p->chunk)
        if ((write ? pwrite(p->fd, p->buf, p->chunk, (off_t)o)
                   : pread(p->fd, p->buf, p->chunk, (off_t)o)) != (ssize_t)p->chunk)
            break;
    if (write)
        fdatasync(p->fd);
    return (double)total / (kvt_now_s() - t0) / 1e9;
}

void kvt_plain_close(kvt_plain *p)
{
    if (p->fd >= 0)
        close(p->fd);
    free(p->buf);
    p->fd = -1;
    p->buf = NULL;
}

void kvt_plain_goals(const char *spill_what, const char *reload_what, const char *how,
                     double spill, double reload)
{
    kvt_goal(spill >= 0.8, "disk spill (%s) >= 0.8x an O_DIRECT sequential write + fdatasync "
             "of the same bytes%s: %.3fx", spill_what, how, spill);
    kvt_goal(reload >= 0.8, "disk reload (%s) >= 0.8x an O_DIRECT sequential read of the same "
             "bytes%s: %.3fx", reload_what, how, reload);
}

double kvt_kl_logits(const float *a, const float *b, size_t n)
{
    double ma = -INFINITY, mb = -INFINITY, za = 0, zb = 0, kl = 0;
    for (size_t k = 0; k < n; k++) {
        ma = fmax(ma, (double)a[k]);
        mb = fmax(mb, (double)b[k]);
    }
    for (size_t k = 0; k < n; k++) {
        za += exp((double)a[k] - ma);
        zb += exp((double)b[k] - mb);
    }
    for (size_t k = 0; k < n; k++) {
        double la = (double)a[k] - ma - log(za), lb = (double)b[k] - mb - log(zb);
        kl += exp(la) * (la - lb);
    }
    return kl;
}

kvr_rope_config kvt_rope_config(uint32_t dim, uint32_t heads)
{
    kvr_rope_config c;
    kvr_rope_config_init(&c);
    c.head_dim = dim;
    c.rotary_dim = dim;
    if (heads > 0)
        c.num_kv_heads = heads;
    return c;
}
