/*
 * crc32c.c — CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the
 * checksum of every disk-tier record and extent. Two implementations with
 * identical results: slicing-by-8 tables (any CPU) and the SSE4.2 crc32
 * instruction, picked once at run time; the shipped build needs no -msse4.2.
 * kvr_crc32c(0, "123456789", 9) == 0xE3069283.
 */
#include <stdatomic.h>
#include <string.h>

#include "base/crc32c.h"

static uint32_t table[8][256];
static atomic_int table_ready;

/* Runs init the first time only; every caller returns after it has run
 * (the tables are read only once their ready flag is set, with release
 * order). Racing initialisers would write identical tables: harmless, but
 * one runs while the others wait. */
static inline void init_once(atomic_int *ready, void (*init)(void))
{
    if (atomic_load_explicit(ready, memory_order_acquire))
        return;
    static atomic_flag busy = ATOMIC_FLAG_INIT;
    while (atomic_flag_test_and_set_explicit(&busy, memory_order_acquire))
        ;
    if (!atomic_load_explicit(ready, memory_order_relaxed)) {
        init();
        atomic_store_explicit(ready, 1, memory_order_release);
    }
    atomic_flag_clear_explicit(&busy, memory_order_release);
}

static void table_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xFFu];
}

static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7u)) {
        crc = table[0][(crc ^ *p++) & 0xFFu] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xFF] ^ table[6][(w >> 8) & 0xFF] ^
              table[5][(w >> 16) & 0xFF] ^ table[4][(w >> 24) & 0xFF] ^
              table[3][(w >> 32) & 0xFF] ^ table[2][(w >> 40) & 0xFF] ^
              table[1][(w >> 48) & 0xFF] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = table[0][(crc ^ *p++) & 0xFFu] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2")))
static uint32_t crc_hw1(uint32_t crc, const uint8_t *p, size_t n)
{
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7u)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    while (n--)
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return (uint32_t)c;
}

/* Large buffers: three independent lanes of LANE bytes in flight at once
 * (the crc32 instruction's latency is three times its issue rate), joined
 * with the "append LANE zero bytes" operator. Without the pre/post
 * inversion the raw update is linear: raw(c, A||B) = zeros(raw(c, A)) ^
 * raw(0, B), zeros(c) = raw(c, LANE zero bytes), a linear map of c kept as
 * four byte tables. Bit-identical to crc_hw1 (tests compare both with the
 * portable tables). */
#define LANE 8192u
static uint32_t zeros_tab[4][256];
static atomic_int zeros_ready;

static uint32_t zeros_apply(uint32_t c)
{
    return zeros_tab[0][c & 0xFFu] ^ zeros_tab[1][(c >> 8) & 0xFFu] ^
           zeros_tab[2][(c >> 16) & 0xFFu] ^ zeros_tab[3][c >> 24];
}

static void zeros_init(void)
{
    static const uint8_t z[LANE];
    uint32_t basis[32];
    for (int i = 0; i < 32; i++)
        basis[i] = crc_hw1(1u << i, z, LANE);
    for (int k = 0; k < 4; k++)
        for (uint32_t v = 0; v < 256; v++) {
            uint32_t r = 0;
            for (int b = 0; b < 8; b++)
                if (v & (1u << b))
                    r ^= basis[8 * k + b];
            zeros_tab[k][v] = r;
        }
}

__attribute__((target("sse4.2")))
static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n)
{
    if (n < 3 * LANE)
        return crc_hw1(crc, p, n);
    init_once(&zeros_ready, zeros_init);
    uint64_t a = crc;
    while (n >= 3 * LANE) {
        uint64_t b = 0, c = 0;
        for (size_t i = 0; i < LANE; i += 8) {
            uint64_t x, y, w;
            memcpy(&x, p + i, 8);
            memcpy(&y, p + LANE + i, 8);
            memcpy(&w, p + 2 * LANE + i, 8);
            a = __builtin_ia32_crc32di(a, x);
            b = __builtin_ia32_crc32di(b, y);
            c = __builtin_ia32_crc32di(c, w);
        }
        a = zeros_apply(zeros_apply((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
        p += 3 * LANE;
        n -= 3 * LANE;
    }
    return crc_hw1((uint32_t)a, p, n);
}
#endif

static atomic_int use_hw = -1;

uint32_t kvr_crc32c_portable(uint32_t crc, const void *p, size_t n)
{
    init_once(&table_ready, table_init);
    return ~crc_sw(~crc, p, n);
}

uint32_t kvr_crc32c(uint32_t crc, const void *p, size_t n)
{
#if defined(__x86_64__)
    int hw = atomic_load_explicit(&use_hw, memory_order_relaxed);
    if (hw < 0) {
        __builtin_cpu_init();
        hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
        atomic_store_explicit(&use_hw, hw, memory_order_relaxed);
    }
    if (hw)
        return ~crc_hw(~crc, p, n);
#endif
    return kvr_crc32c_portable(crc, p, n);
}
