/*
 * kvt_bench.c — tests/common/kvt_bench.h: the clock and the environment.
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

size_t kvt_env_size(const char *name, size_t dflt)
{
    const char *v = getenv(name);
    return v && *v ? (size_t)strtoull(v, NULL, 10) : dflt;
}
