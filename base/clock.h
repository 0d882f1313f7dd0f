/*
 * clock.h — the project's one clock: monotonic time for durations, stall
 * limits and rates (never wall time: it jumps), wall time only for what is
 * shown to people or stored as a timestamp, and absolute CLOCK_REALTIME
 * deadlines for pthread_cond_timedwait (which takes only that clock unless
 * the condition variable was made otherwise).
 *
 * Header only (inline), so every room calls it without linking anything;
 * clock_gettime on these clocks does not fail on Linux.
 */
#ifndef KVR_BASE_CLOCK_H
#define KVR_BASE_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Monotonic nanoseconds (CLOCK_MONOTONIC), for differences only. */
static inline uint64_t kvr_clock_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Monotonic whole milliseconds. */
static inline uint64_t kvr_clock_mono_ms(void)
{
    return kvr_clock_mono_ns() / 1000000u;
}

/* Monotonic milliseconds with their fraction (for measured durations). */
static inline double kvr_clock_mono_msf(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Wall-clock milliseconds since the epoch (CLOCK_REALTIME): timestamps. */
static inline uint64_t kvr_clock_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* The CLOCK_REALTIME instant ms milliseconds from now, normalised, for
 * pthread_cond_timedwait. */
static inline struct timespec kvr_clock_deadline(uint64_t ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_nsec + (ms % 1000u) * 1000000u;
    ts.tv_sec += (time_t)(ms / 1000u + ns / 1000000000u);
    ts.tv_nsec = (long)(ns % 1000000000u);
    return ts;
}

#endif /* KVR_BASE_CLOCK_H */
