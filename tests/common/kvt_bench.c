/*
 * kvt_bench.c — tests/common/kvt_bench.h: the clock, the environment and
 * xorshift64.
 */
#include "tests/common/kvt_bench.h"

#include <stdlib.h>
#include <time.h>

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
