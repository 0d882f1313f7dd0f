/*
 * error.h — kvrope's one error space, shared by every module and by
 * libkvrope's public API (rope/rope.h and client/kvrope.h include it).
 *
 * Every function of the project returns 0 on success or a negative KVR_E*
 * code. The codes are defined once, in the X-macro lists below; the enum,
 * the name and message tables (rope/error.c) and the static assertions that
 * tie them to the wire's Status enum (proto/status.c) are all generated from
 * them, so adding a code is one line here (plus the proto value if the daemon
 * sends it).
 *
 * Values. A code is -(KVR_E_BASE + n). Codes the daemon sends have n equal to
 * their wire Status number (1..999, E_UNKNOWN_CONTEXT = 7 -> KVR_ENOCTX =
 * -10007); codes that never travel (the client library's own) have n >=
 * 1000. KVR_E_BASE is far outside errno's range (Linux keeps -errno above
 * -4096), so a KVR_E* code is never mistaken for a -errno and vice versa:
 * system errors are converted at the call that saw them (kvr_error_sys), never
 * passed on as -errno.
 *
 * Messages. A function that can explain a failure takes a `kvr_error *`
 * (may be NULL) and fills it with the code and a message naming what is
 * wrong; kvr_strerror gives the static description of a bare code.
 */
#ifndef KVR_ERROR_H
#define KVR_ERROR_H

#include <stdarg.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVR_E_BASE 10000

/* X(NAME, n, WIRE, text): the codes the daemon sends; WIRE is the Status
 * enum value's name in proto/kvrope.proto (KVROPE__STATUS__##WIRE). */
#define KVR_ERRORS_WIRE(X)                                                              \
    X(INTERNAL,     1, E_INTERNAL,        "internal error")                             \
    X(BADREQUEST,   2, E_BAD_REQUEST,     "malformed request")                          \
    X(BADFRAME,     3, E_BAD_FRAME,       "malformed frame")                            \
    X(TOOLARGE,     4, E_TOO_LARGE,       "request too large")                          \
    X(UNAUTH,       5, E_UNAUTHENTICATED, "authentication required or failed")          \
    X(NOMODEL,      6, E_UNKNOWN_MODEL,   "unknown model")                              \
    X(NOCTX,        7, E_UNKNOWN_CONTEXT, "unknown context")                            \
    X(EXIST,        8, E_EXISTS,          "already exists")                             \
    X(SHAPE,        9, E_SHAPE,           "shape or dtype does not match the model")    \
    X(PAYLOAD,     10, E_PAYLOAD_LENGTH,  "payload length does not match the shapes")   \
    X(RANGE,       11, E_RANGE,           "token range or layer out of bounds")         \
    X(FINGERPRINT, 12, E_FINGERPRINT,     "model fingerprint mismatch")                 \
    X(NOMEM,       13, E_NO_MEMORY,       "out of memory (or the memory cap cannot be met)") \
    X(BUSY,        14, E_BUSY,            "context is busy")                            \
    X(INVAL,       15, E_INVALID,         "invalid argument")                           \
    X(UNSUPPORTED, 16, E_UNSUPPORTED,     "not supported")                              \
    X(LIMIT,       17, E_LIMIT,           "limit reached")                              \
    X(PROTECTED,   18, E_PROTECTED,       "edit touches protected tokens")              \
    X(IO,          19, E_IO,              "I/O error")                                  \
    X(PINNED,      20, E_PINNED,          "context is pinned")                          \
    X(CONFIG,      21, E_CONFIG,          "bad model configuration")                    \
    X(PENDING,     22, E_PENDING,         "KV of the range is pending (edited without KV, not refreshed yet)") \
    X(PREFIX,      23, E_PREFIX,          "document encoded against another prefix")

/* X(NAME, n, text): codes that never travel on the wire (libkvrope's own,
 * and FETCH, which the store returns to the daemon only: cache.h's
 * kvr_store_miss_hooks). */
#define KVR_ERRORS_LOCAL(X)                                                             \
    X(SYS,       1000, "system call failed")                                            \
    X(CLOSED,    1001, "connection closed")                                             \
    X(PROTO,     1002, "protocol error (undecodable response)")                         \
    X(BUFFER,    1003, "destination buffer too small")                                 \
    X(FETCH,     1004, "not in the store: the tier above it was asked for it")

/* The wire Status of a code and back (OK <-> 0). */
#define KVR_E_FROM_STATUS(s) ((s) == 0 ? 0 : -(KVR_E_BASE + (int)(s)))

enum {
    KVR_OK = 0,
#define KVR_X_WIRE_(name, n, wire, text)  KVR_E##name = -(KVR_E_BASE + (n)),
#define KVR_X_LOCAL_(name, n, text)       KVR_E##name = -(KVR_E_BASE + (n)),
    KVR_ERRORS_WIRE(KVR_X_WIRE_)
    KVR_ERRORS_LOCAL(KVR_X_LOCAL_)
#undef KVR_X_WIRE_
#undef KVR_X_LOCAL_
};

/* Static description ("unknown context"); "unknown error" for anything else. */
const char *kvr_strerror(int code);
/* "KVR_ENOCTX", "KVR_OK"; "KVR_EUNKNOWN" for anything else. */
const char *kvr_error_name(int code);
/* The wire Status number to send for code: 0 for KVR_OK, n for a wire
 * code, E_INTERNAL (1) for a local or unknown code. */
int kvr_error_status(int code);
/* The Status's name in the protocol ("E_UNKNOWN_CONTEXT", "OK"), NULL for a
 * local or unknown code. */
const char *kvr_error_status_name(int code);
/* The code of a wire Status received (0 for OK); KVR_EPROTO if unknown. */
int kvr_error_from_status(int status);
/* Every code of the space, KVR_OK first, for bindings that derive their own
 * tables from the library (the Python one): *n entries, static. */
const int *kvr_error_codes(size_t *n);

/* A code and the message that explains it. Fill with kvr_error_set. */
typedef struct kvr_error {
    int  code;
    char msg[256];
} kvr_error;

/* Sets err (if non-NULL) and returns code:
 *   return kvr_error_set(err, KVR_ENOCTX, "unknown context '%s'", id);   */
int kvr_error_set(kvr_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* kvr_error_set with a va_list (for the project's own printf-like fillers). */
int kvr_error_vset(kvr_error *err, int code, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));

/* A system call failed with errno value errnum: ENOMEM becomes KVR_ENOMEM,
 * anything else `code` (KVR_EIO, KVR_ESYS, ...); the message is the
 * formatted text, ": ", strerror(errnum). Returns the code. */
int kvr_error_sys(kvr_error *err, int code, int errnum, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#ifdef __cplusplus
}
#endif
#endif /* KVR_ERROR_H */
