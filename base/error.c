/*
 * error.c — the tables of kvrope's error space, generated from the X-macro
 * lists of base/error.h (one entry per code, in list order), and the
 * kvr_error fillers. Lookups scan the table: there are a few dozen codes and
 * they are looked up only when something already failed.
 */
#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <errno.h>

#include "base/error.h"

typedef struct entry {
    int         code;
    int         status;      /* wire Status, 0 for local codes (and OK) */
    const char *name;        /* "KVR_ENOCTX" */
    const char *status_name; /* "E_UNKNOWN_CONTEXT", NULL for local codes */
    const char *text;
} entry;

#define WIRE_ENTRY(name, n, wire, text)  { KVR_E##name, n, "KVR_E" #name, #wire, text },
#define LOCAL_ENTRY(name, n, text)       { KVR_E##name, 0, "KVR_E" #name, NULL, text },
static const entry table[] = {
    { KVR_OK, 0, "KVR_OK", "OK", "success" },
    KVR_ERRORS_WIRE(WIRE_ENTRY)
    KVR_ERRORS_LOCAL(LOCAL_ENTRY)
};
#undef WIRE_ENTRY
#undef LOCAL_ENTRY

#define N_ENTRIES (sizeof table / sizeof *table)

/* Wire numbers and local numbers live in disjoint ranges (error.h). */
#define WIRE_MAX(name, n, wire, text)  _Static_assert((n) > 0 && (n) < 1000, #name);
#define LOCAL_MIN(name, n, text)       _Static_assert((n) >= 1000, #name);
KVR_ERRORS_WIRE(WIRE_MAX)
KVR_ERRORS_LOCAL(LOCAL_MIN)
#undef WIRE_MAX
#undef LOCAL_MIN
/* Far outside errno's range (the kernel's -errno values are > -4096). */
_Static_assert(KVR_EINTERNAL < -4096, "KVR_E* must not collide with -errno");

static const entry *find(int code)
{
    for (size_t i = 0; i < N_ENTRIES; i++)
        if (table[i].code == code)
            return &table[i];
    return NULL;
}

const char *kvr_strerror(int code)
{
    const entry *e = find(code);
    return e ? e->text : "unknown error";
}

const char *kvr_error_name(int code)
{
    const entry *e = find(code);
    return e ? e->name : "KVR_EUNKNOWN";
}

int kvr_error_status(int code)
{
    const entry *e = find(code);
    if (e && (e->status > 0 || code == KVR_OK))
        return e->status;
    return -(KVR_EINTERNAL + KVR_E_BASE);   /* E_INTERNAL */
}

const char *kvr_error_status_name(int code)
{
    const entry *e = find(code);
    return e ? e->status_name : NULL;
}

int kvr_error_from_status(int status)
{
    if (status == 0)
        return KVR_OK;
    for (size_t i = 0; i < N_ENTRIES; i++)
        if (table[i].status == status)
            return table[i].code;
    return KVR_EPROTO;
}

#define WIRE_CODE(name, n, wire, text)  KVR_E##name,
#define LOCAL_CODE(name, n, text)       KVR_E##name,
static const int codes[] = { KVR_OK, KVR_ERRORS_WIRE(WIRE_CODE) KVR_ERRORS_LOCAL(LOCAL_CODE) };
#undef WIRE_CODE
#undef LOCAL_CODE
_Static_assert(sizeof codes / sizeof *codes == N_ENTRIES, "one code per table entry");

const int *kvr_error_codes(size_t *n)
{
    if (n)
        *n = N_ENTRIES;
    return codes;
}

int kvr_error_vset(kvr_error *err, int code, const char *fmt, va_list ap)
{
    if (err) {
        err->code = code;
        if (vsnprintf(err->msg, sizeof err->msg, fmt, ap) < 0)
            err->msg[0] = '\0';
    }
    return code;
}

int kvr_error_set(kvr_error *err, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvr_error_vset(err, code, fmt, ap);
    va_end(ap);
    return code;
}

int kvr_error_sys(kvr_error *err, int code, int errnum, const char *fmt, ...)
{
    if (errnum == ENOMEM)
        code = KVR_ENOMEM;
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        kvr_error_vset(err, code, fmt, ap);
        va_end(ap);
        size_t n = strlen(err->msg);
        assert(n < sizeof err->msg);
        snprintf(err->msg + n, sizeof err->msg - n, ": %s", strerror(errnum));
    }
    return code;
}
