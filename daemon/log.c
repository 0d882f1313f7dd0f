/*
 * log.c — kvroped's logger: one line per event on stderr,
 * "2025-01-31T12:00:00.123Z kvroped[pid] level: message". Thread-safe (one
 * fprintf per line); the level is a process-wide setting.
 */
#include "daemon/daemon.h"

#include <stdarg.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile int g_level = KVR_LOG_INFO;

void kvr_log_set_level(kvr_log_level l) { g_level = (int)l; }
kvr_log_level kvr_log_get_level(void) { return (kvr_log_level)g_level; }

int kvr_log_level_parse(const char *s, kvr_log_level *out)
{
    static const char *names[] = { "debug", "info", "warn", "error" };
    for (int i = 0; i < 4; i++) {
        if (!strcmp(s, names[i])) {
            *out = (kvr_log_level)i;
            return 0;
        }
    }
    if (!strcmp(s, "warning")) {
        *out = KVR_LOG_WARN;
        return 0;
    }
    return KVR_EINVAL;
}

void kvr_log(kvr_log_level l, const char *fmt, ...)
{
    static const char *names[] = { "debug", "info", "warn", "error" };
    if ((int)l < g_level)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ kvroped[%ld] %s: %s\n",
            tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
            tm.tm_sec, ts.tv_nsec / 1000000L, (long)getpid(), names[l & 3], msg);
}
