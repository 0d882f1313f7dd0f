/*
 * log.c — kvroped's logger: one line per event, on stderr or --log-file.
 *
 *   text: "2025-01-31T12:00:00.123Z kvroped[pid] level: message"
 *   json: {"ts":"2025-01-31T12:00:00.123Z","level":"info","pid":123,"msg":"message"}
 *
 * Invariants: a line is written whole with one fputs under g_lock, so lines
 * from the loop, the threadpool and the metrics thread never interleave; a
 * JSON line is valid JSON whatever bytes the message holds (control
 * characters are escaped, bytes that are not UTF-8 become U+FFFD); the
 * level and format are process-wide settings. kvr_log_open swaps the
 * destination under the lock, so a reopen (SIGHUP, log rotation) loses no
 * line and never writes to a closed FILE.
 */
#include "base/clock.h"
#include "daemon/daemon.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static volatile int g_level = KVR_LOG_INFO;
static volatile int g_format = KVR_LOG_FORMAT_TEXT;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *g_file;              /* NULL = stderr */

static const char *const LEVEL_NAMES[] = { "debug", "info", "warn", "error" };

void kvr_log_set_level(kvr_log_level l) { g_level = (int)l; }
kvr_log_level kvr_log_get_level(void) { return (kvr_log_level)g_level; }
void kvr_log_set_format(kvr_log_format f) { g_format = (int)f; }

int kvr_log_level_parse(const char *s, kvr_log_level *out)
{
    for (int i = 0; i < 4; i++) {
        if (!strcmp(s, LEVEL_NAMES[i])) {
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

int kvr_log_format_parse(const char *s, kvr_log_format *out)
{
    if (!strcmp(s, "text")) {
        *out = KVR_LOG_FORMAT_TEXT;
        return 0;
    }
    if (!strcmp(s, "json")) {
        *out = KVR_LOG_FORMAT_JSON;
        return 0;
    }
    return KVR_EINVAL;
}

int kvr_log_open(const char *path, kvr_error *err)
{
    FILE *nf = NULL;
    if (path && path[0]) {
        int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
        if (fd < 0 || !(nf = fdopen(fd, "a"))) {
            int e = errno;
            if (fd >= 0)
                close(fd);
            return kvr_error_sys(err, KVR_EIO, e, "--log-file %s", path);
        }
        setvbuf(nf, NULL, _IOLBF, 0);
    }
    pthread_mutex_lock(&g_lock);
    FILE *old = g_file;
    g_file = nf;
    pthread_mutex_unlock(&g_lock);
    if (old)
        fclose(old);
    return 0;
}

/* Appends s to out as the inside of a JSON string. */
static size_t json_escape(char *out, size_t cap, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    const unsigned char *p = (const unsigned char *)s;
    while (*p && o + 8 < cap) {
        unsigned char ch = *p;
        if (ch == '"' || ch == '\\') {
            out[o++] = '\\';
            out[o++] = (char)ch;
            p++;
        } else if (ch < 0x20 || ch == 0x7f) {
            const char *short_esc = ch == '\n' ? "\\n" : ch == '\t' ? "\\t" : ch == '\r' ? "\\r" : NULL;
            if (short_esc) {
                out[o++] = short_esc[0];
                out[o++] = short_esc[1];
            } else {
                memcpy(out + o, "\\u00", 4);
                out[o + 4] = hex[ch >> 4];
                out[o + 5] = hex[ch & 15];
                o += 6;
            }
            p++;
        } else if (ch < 0x80) {
            out[o++] = (char)ch;
            p++;
        } else {
            /* A well-formed UTF-8 sequence is copied; anything else is one
             * replacement character per byte. */
            size_t n = ch >= 0xf0 && ch <= 0xf4 ? 4 : ch >= 0xe0 ? 3 : ch >= 0xc2 && ch < 0xe0 ? 2 : 0;
            bool ok = n > 0;
            for (size_t k = 1; ok && k < n; k++)
                ok = (p[k] & 0xc0) == 0x80;
            if (ok && n == 3)   /* no overlongs, no surrogates */
                ok = !(ch == 0xe0 && p[1] < 0xa0) && !(ch == 0xed && p[1] >= 0xa0);
            if (ok && n == 4)
                ok = !(ch == 0xf0 && p[1] < 0x90) && !(ch == 0xf4 && p[1] >= 0x90);
            if (ok) {
                memcpy(out + o, p, n);
                o += n;
                p += n;
            } else {
                memcpy(out + o, "\\ufffd", 6);
                o += 6;
                p++;
            }
        }
    }
    out[o] = '\0';
    return o;
}

void kvr_log(kvr_log_level l, const char *fmt, ...)
{
    if ((int)l < g_level)
        return;
    uint64_t wall = kvr_clock_wall_ms();
    time_t sec = (time_t)(wall / 1000u);
    struct tm tm;
    gmtime_r(&sec, &tm);
    char stamp[96];
    snprintf(stamp, sizeof stamp, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900,
             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
             (long)(wall % 1000u));
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char line[8 * 1024];
    if (g_format == KVR_LOG_FORMAT_JSON) {
        char esc[6 * 1024 + 16];
        json_escape(esc, sizeof esc, msg);
        snprintf(line, sizeof line, "{\"ts\":\"%s\",\"level\":\"%s\",\"pid\":%ld,\"msg\":\"%s\"}\n",
                 stamp, LEVEL_NAMES[l & 3], (long)getpid(), esc);
    } else {
        snprintf(line, sizeof line, "%s kvroped[%ld] %s: %s\n", stamp, (long)getpid(),
                 LEVEL_NAMES[l & 3], msg);
    }
    pthread_mutex_lock(&g_lock);
    FILE *f = g_file ? g_file : stderr;
    fputs(line, f);
    fflush(f);
    pthread_mutex_unlock(&g_lock);
}
