/*
 * mem.c — the accounted allocator every allocation of the daemon goes
 * through. It counts what the allocator really holds for each pointer
 * (malloc_usable_size: jemalloc's size class in release builds, libc's chunk
 * under sanitizers), so the store's cap is checked against real memory.
 *
 * jemalloc's large allocations (16 KiB and up with 4 KiB pages): being
 * cache-oblivious (a build option, on in Debian's 5.3), jemalloc maps one
 * page more than the usable size of each and, unless the allocation asks
 * for page alignment, starts it at a random cache line of its first page,
 * so that extra page is resident once the allocation is written to its
 * end. A store of 16 KiB blocks (a small model's) held 25% more than it
 * counted (bench_scale: RSS 1.29-1.37x accounted), and a cap compared with
 * that count is overrun by as much. So kvr_mem_aligned asks for page
 * alignment for large sizes (the extra page then trails the allocation and
 * is never touched: address space, not memory), and kvr_mem_held counts
 * the page for a large pointer that is not page-aligned (a large
 * kvr_mem_malloc: its start was moved into the extra page).
 *
 * Invariants: `allocated` equals the sum of kvr_mem_held over live pointers
 * handed out here (the same for a pointer at its allocation and at its
 * free); `peak` is its running maximum. Both are atomics, so any
 * thread may allocate and free. A pointer from kvr_mem_* must be freed with
 * kvr_mem_free (and nothing else).
 *
 * Allocation-failure injection (SQLite's test mode): kvr_mem_fault_set(n,
 * sticky) makes the n-th allocation from now fail (and with sticky, every
 * one after it), so a test can walk a request through each of its
 * allocations failing in turn. Off (n = 0) it costs one relaxed atomic load
 * per allocation; -DKVR_NO_FAULT_INJECT compiles it out.
 */
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#ifdef KVR_JEMALLOC
#include <jemalloc/jemalloc.h>   /* nallocx: the size class of a request */
#endif
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cache/cache.h"

static _Atomic size_t allocated;
static _Atomic size_t peak;

#ifndef KVR_NO_FAULT_INJECT
static _Atomic uint64_t fault_nth;      /* 0 = off */
static _Atomic uint64_t fault_seen, fault_failed;
static _Atomic bool     fault_sticky;

static bool fault_hit(void)
{
    uint64_t n = atomic_load_explicit(&fault_nth, memory_order_relaxed);
    if (n == 0)
        return false;
    uint64_t k = atomic_fetch_add_explicit(&fault_seen, 1, memory_order_relaxed) + 1;
    if (k == n || (k > n && atomic_load_explicit(&fault_sticky, memory_order_relaxed))) {
        atomic_fetch_add_explicit(&fault_failed, 1, memory_order_relaxed);
        return true;
    }
    return false;
}
#else
static bool fault_hit(void) { return false; }
#endif

bool kvr_mem_fault_set(uint64_t nth, bool sticky)
{
#ifndef KVR_NO_FAULT_INJECT
    atomic_store(&fault_nth, 0);
    atomic_store(&fault_seen, 0);
    atomic_store(&fault_failed, 0);
    atomic_store(&fault_sticky, sticky);
    atomic_store(&fault_nth, nth);
    return true;
#else
    (void)nth;
    (void)sticky;
    return false;
#endif
}

uint64_t kvr_mem_fault_failed(void)
{
#ifndef KVR_NO_FAULT_INJECT
    return atomic_load(&fault_failed);
#else
    return 0;
#endif
}

/* jemalloc's smallest large size class, and the page it adds to each
 * large allocation when cache-oblivious (0 otherwise), read once. */
#ifdef KVR_JEMALLOC
static pthread_once_t large_once = PTHREAD_ONCE_INIT;
static size_t large_min = SIZE_MAX, large_pad, page_size = 4096;

static void large_init(void)
{
    bool co = true;
    size_t lmin = 16384, sz = sizeof co;
    if (mallctl("config.cache_oblivious", &co, &sz, NULL, 0) != 0)
        co = true;
    sz = sizeof page_size;
    (void)mallctl("arenas.page", &page_size, &sz, NULL, 0);
    sz = sizeof lmin;
    (void)mallctl("arenas.lextent.0.size", &lmin, &sz, NULL, 0);
    large_pad = co ? page_size : 0;
    large_min = lmin;
}

/* The alignment that keeps jemalloc's extra page of an allocation of n
 * bytes untouched (page alignment for a large one), at least align. */
static size_t align_for(size_t align, size_t n)
{
    pthread_once(&large_once, large_init);
    return large_pad && align < page_size && kvr_mem_size_class(n) >= large_min ? page_size
                                                                                 : align;
}
#else
static size_t align_for(size_t align, size_t n)
{
    (void)n;
    return align;
}
#endif

size_t kvr_mem_held(const void *p)
{
    if (!p)
        return 0;
    size_t n = malloc_usable_size((void *)(uintptr_t)p);
#ifdef KVR_JEMALLOC
    pthread_once(&large_once, large_init);
    if (n >= large_min && ((uintptr_t)p & (page_size - 1)) != 0)
        n += large_pad;
#endif
    return n;
}

static void account_add(void *p)
{
    size_t n = kvr_mem_held(p);
    size_t now = atomic_fetch_add_explicit(&allocated, n, memory_order_relaxed) + n;
    size_t pk = atomic_load_explicit(&peak, memory_order_relaxed);
    while (now > pk &&
           !atomic_compare_exchange_weak_explicit(&peak, &pk, now,
                                                  memory_order_relaxed,
                                                  memory_order_relaxed))
        ;
}

static void account_sub(void *p)
{
    atomic_fetch_sub_explicit(&allocated, kvr_mem_held(p), memory_order_relaxed);
}

void *kvr_mem_malloc(size_t n)
{
    if (fault_hit())
        return NULL;
    void *p = malloc(n ? n : 1);
    if (p)
        account_add(p);
    return p;
}

void *kvr_mem_calloc(size_t count, size_t size)
{
    if (count == 0 || size == 0)
        count = size = 1;
    if (fault_hit())
        return NULL;
    void *p = calloc(count, size);
    if (p)
        account_add(p);
    return p;
}

/* A reallocation that held `old` bytes now lives at q. */
static void account_moved(size_t old, void *q)
{
    atomic_fetch_sub_explicit(&allocated, old, memory_order_relaxed);
    account_add(q);
}

void *kvr_mem_realloc(void *p, size_t n)
{
    if (!p)
        return kvr_mem_malloc(n);
    if (fault_hit())
        return NULL;    /* p is untouched, as for a real failure */
    size_t old = kvr_mem_held(p);
    void *q = realloc(p, n ? n : 1);
    if (!q)
        return NULL;    /* p is untouched and still accounted */
    account_moved(old, q);
    return q;
}

/* Large buffers (blocks of a big model, get/assemble staging) are touched
 * once, end to end, right after they are allocated: with 4 KiB pages that is
 * one page fault per 4 KiB, which cost more than re-rotating the keys in them
 * (bench_edit_wire). They are aligned to 2 MiB and offered to transparent huge
 * pages, so the kernel faults them in 2 MiB at a time where THP is enabled in
 * "madvise" mode (Debian's default); elsewhere the hint is a no-op. */
#define HUGE_MIN   ((size_t)4 << 20)
#define HUGE_ALIGN ((size_t)2 << 20)

void *kvr_mem_aligned(size_t align, size_t n)
{
    void *p = NULL;
    if (align < sizeof(void *))
        align = sizeof(void *);
    bool huge = n >= HUGE_MIN && align <= HUGE_ALIGN;
    if (huge)
        align = HUGE_ALIGN;
    align = align_for(align, n);
    if (fault_hit() || posix_memalign(&p, align, n ? n : 1) != 0)
        return NULL;
    if (huge)
        (void)madvise(p, n & ~(HUGE_ALIGN - 1), MADV_HUGEPAGE);
    account_add(p);
    return p;
}

/* Staging buffers: one large buffer kept between requests. A request's
 * staging (a converted or quantized put's payload) is filled once and
 * dropped; allocating it afresh every time costs the kernel's zeroing of
 * each new page, 20-25% of a quantized put, more than any work done in it.
 * The kept buffer leaves the accounting while unused, as the allocator's
 * own retained pages do (the cap counts live allocations), and goes back to
 * the kernel with kvr_mem_trim (the daemon's idle purge, a store's
 * destroy, and the store's kvr_store_reserve once the cap is reached, so
 * it never stands in the way of live data). It is reused only by a request
 * of about its size (within a quarter), so a small request never holds a
 * large buffer, and one over STASH_MAX is not kept at all: what is held
 * between requests is at most STASH_MAX. Users: converted / quantized
 * puts, and the daemon's streamed gets, whose staging ring (a few chunks
 * of at most a layer each) is reused by the next such get. */
#define STASH_MAX ((size_t)256 << 20)
static pthread_mutex_t stash_lock = PTHREAD_MUTEX_INITIALIZER;
static void  *stash;
static size_t stash_n;    /* its usable size */

void *kvr_mem_staging(size_t n)
{
    if (n < HUGE_MIN)
        return kvr_mem_aligned(KVR_STAGING_ALIGN, n);
    if (fault_hit())
        return NULL;
    void *p = NULL, *drop = NULL;
    pthread_mutex_lock(&stash_lock);
    if (stash && stash_n >= n && stash_n - n <= n / 4) {
        p = stash;
        stash = NULL;
    } else if (stash && stash_n < n) {
        drop = stash;    /* too small for this size: make room for this one */
        stash = NULL;
    }
    pthread_mutex_unlock(&stash_lock);
    free(drop);
    if (p) {
        account_add(p);
        return p;
    }
    if (posix_memalign(&p, HUGE_ALIGN, n) != 0)
        return NULL;
    (void)madvise(p, n & ~(HUGE_ALIGN - 1), MADV_HUGEPAGE);
    account_add(p);
    return p;
}

void kvr_mem_staging_free(void *p)
{
    if (!p)
        return;
    size_t n = malloc_usable_size(p);
    if (n < HUGE_MIN) {
        kvr_mem_free(p);
        return;
    }
    account_sub(p);
    if (n > STASH_MAX) {
        free(p);
        return;
    }
    pthread_mutex_lock(&stash_lock);
    void *drop = p;
    if (!stash || stash_n < n) {
        drop = stash;
        stash = p;
        stash_n = n;
    }
    pthread_mutex_unlock(&stash_lock);
    free(drop);
}

void kvr_mem_trim(void)
{
    pthread_mutex_lock(&stash_lock);
    void *p = stash;
    stash = NULL;
    stash_n = 0;
    pthread_mutex_unlock(&stash_lock);
    free(p);
}

/* A put's copy out of a shared-memory region writes 64 MiB of block memory
 * that is not read again soon. memcpy's temporal stores first read each
 * destination line into the cache (three memory transfers per byte);
 * streaming stores write it straight out (two): bench_shm's 64 MiB put
 * copies 1.15-1.25x faster per thread. */
#define STREAM_MIN ((size_t)256)   /* below it, the alignment head would dominate */

#if defined(__x86_64__)
__attribute__((target("avx2")))
static void copy_stream_avx2(uint8_t *d, const uint8_t *s, size_t n)
{
    for (; n >= 128; n -= 128, d += 128, s += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)(s + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)(s + 96));
        _mm256_stream_si256((__m256i *)(void *)d, a);
        _mm256_stream_si256((__m256i *)(void *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(void *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(void *)(d + 96), e);
    }
    if (n)
        memcpy(d, s, n);
}

static void copy_stream_sse2(uint8_t *d, const uint8_t *s, size_t n)
{
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
        _mm_stream_si128((__m128i *)(void *)d, a);
        _mm_stream_si128((__m128i *)(void *)(d + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d + 48), e);
    }
    if (n)
        memcpy(d, s, n);
}
#endif

void kvr_mem_copy_stream(void *dst, const void *src, size_t n)
{
#if defined(__x86_64__)
    static int avx2 = -1;   /* a benign race: every thread computes the same */
    if (n >= STREAM_MIN) {
        uint8_t *d = dst;
        const uint8_t *s = src;
        size_t head = (32 - ((uintptr_t)d & 31)) & 31;   /* stores need an aligned d */
        memcpy(d, s, head);
        if (avx2 < 0)
            avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
        if (avx2)
            copy_stream_avx2(d + head, s + head, n - head);
        else
            copy_stream_sse2(d + head, s + head, n - head);
        _mm_sfence();   /* ordered before whatever publishes the bytes */
        return;
    }
#endif
    memcpy(dst, src, n);
}

void kvr_mem_free(void *p)
{
    if (!p)
        return;
    account_sub(p);
    free(p);
}

size_t kvr_mem_size_class(size_t n)
{
    if (n == 0)
        n = 1;
#ifdef KVR_JEMALLOC
    size_t r = nallocx(n, 0);
    return r ? r : n;
#else
    /* glibc: chunks are 16-byte multiples with an 8-byte header; large
     * requests are mmapped whole pages. An upper bound is what matters. */
    if (n >= 128 * 1024)
        return (n + 8 + 4095) & ~(size_t)4095;
    return ((n + 8 + 15) & ~(size_t)15);
#endif
}

size_t kvr_mem_allocated(void)
{
    return atomic_load_explicit(&allocated, memory_order_relaxed);
}

size_t kvr_mem_peak(void)
{
    return atomic_load_explicit(&peak, memory_order_relaxed);
}

/* ---- the prefix index's own arena, on huge pages --------------------------
 * A match reads a node, its children's keys and a label of ~1 KiB; in a
 * store of 10^7 tokens those sit among gigabytes of K/V blocks, one 4 KiB
 * page each, and the TLB misses were most of a warm match's p99
 * (bench_scale: 1.51-1.74 us at 10^7 tokens against 1.00-1.14 us with the
 * index here). Under jemalloc the index allocates from an arena of its own
 * whose extents are madvise(MADV_HUGEPAGE)d (transparent huge pages in
 * "madvise" mode, Debian's default, honour it; "never" leaves 4 KiB pages).
 * Frees go through kvr_mem_free: jemalloc returns a pointer to the arena
 * that owns it. Without jemalloc, or if the arena cannot be made, these are
 * kvr_mem_malloc / calloc / realloc. Accounted as those are. */
#ifdef KVR_JEMALLOC
static extent_hooks_t *idx_def, idx_hooks;
static int idx_flags;   /* MALLOCX_ARENA of the index's arena; 0 until it exists */
static pthread_once_t idx_once = PTHREAD_ONCE_INIT;

static void *idx_alloc(extent_hooks_t *h, void *addr, size_t size, size_t align, bool *zero,
                       bool *commit, unsigned ind)
{
    (void)h;
    void *p = idx_def->alloc(idx_def, addr, size, align, zero, commit, ind);
    if (p)
        (void)madvise(p, size, MADV_HUGEPAGE);
    return p;
}

static void idx_init(void)
{
    size_t sz = sizeof idx_def;
    if (mallctl("arena.0.extent_hooks", &idx_def, &sz, NULL, 0) != 0)
        return;
    idx_hooks = *idx_def;
    idx_hooks.alloc = idx_alloc;
    extent_hooks_t *hp = &idx_hooks;
    unsigned ind;
    size_t usz = sizeof ind;
    if (mallctl("arenas.create", &ind, &usz, &hp, sizeof hp) != 0)
        return;
    idx_flags = MALLOCX_ARENA(ind) | MALLOCX_TCACHE_NONE;
}

void *kvr_mem_index_malloc(size_t n)
{
    pthread_once(&idx_once, idx_init);
    if (!idx_flags)
        return kvr_mem_malloc(n);
    if (fault_hit())
        return NULL;
    void *p = mallocx(n ? n : 1, idx_flags);
    if (p)
        account_add(p);
    return p;
}

void *kvr_mem_index_calloc(size_t count, size_t size)
{
    pthread_once(&idx_once, idx_init);
    if (!idx_flags)
        return kvr_mem_calloc(count, size);
    if (count == 0 || size == 0)
        count = size = 1;
    if (size > SIZE_MAX / count || fault_hit())
        return NULL;
    void *p = mallocx(count * size, idx_flags | MALLOCX_ZERO);
    if (p)
        account_add(p);
    return p;
}

void *kvr_mem_index_realloc(void *p, size_t n)
{
    if (!p)
        return kvr_mem_index_malloc(n);
    pthread_once(&idx_once, idx_init);
    if (!idx_flags)
        return kvr_mem_realloc(p, n);
    if (fault_hit())
        return NULL;
    size_t old = kvr_mem_held(p);
    void *q = rallocx(p, n ? n : 1, idx_flags);
    if (!q)
        return NULL;    /* p is untouched and still accounted */
    account_moved(old, q);
    return q;
}
#else
void *kvr_mem_index_malloc(size_t n) { return kvr_mem_malloc(n); }
void *kvr_mem_index_calloc(size_t c, size_t s) { return kvr_mem_calloc(c, s); }
void *kvr_mem_index_realloc(void *p, size_t n) { return kvr_mem_realloc(p, n); }
#endif
