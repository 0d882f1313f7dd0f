/*
 * error.c — kvrope's error codes: names, static descriptions and the
 * kvr_error filler. Codes are the negated wire Status values (cache.h);
 * every table here is indexed by -code and must have KVR_E_COUNT_ entries.
 */
#include <stdarg.h>
#include <stdio.h>

#include "cache/cache.h"

static const char *const names[KVR_E_COUNT_] = {
    "KVR_OK", "KVR_EINTERNAL", "KVR_EBADREQUEST", "KVR_EBADFRAME",
    "KVR_ETOOLARGE", "KVR_EUNAUTH", "KVR_ENOMODEL", "KVR_ENOCTX", "KVR_EEXIST",
    "KVR_ESHAPE", "KVR_EPAYLOAD", "KVR_ERANGE", "KVR_EFINGERPRINT",
    "KVR_ENOMEM", "KVR_EBUSY", "KVR_EINVAL", "KVR_EUNSUPPORTED", "KVR_ELIMIT",
    "KVR_EPROTECTED", "KVR_EIO", "KVR_EPINNED", "KVR_ECONFIG",
    "KVR_EPENDING", "KVR_EPREFIX",
};

static const char *const texts[KVR_E_COUNT_] = {
    "success",
    "internal error",
    "malformed request",
    "malformed frame",
    "request too large",
    "authentication required or failed",
    "unknown model",
    "unknown context",
    "already exists",
    "shape or dtype does not match the model",
    "payload length does not match the shapes",
    "token range or layer out of bounds",
    "model fingerprint mismatch",
    "memory cap cannot be met",
    "context is busy",
    "invalid argument",
    "not supported",
    "limit reached",
    "edit touches protected tokens",
    "I/O error",
    "context is pinned",
    "bad model configuration",
    "KV of the range is pending (edited without KV, not refreshed yet)",
    "document encoded against another prefix",
};

const char *kvr_strerror(int code)
{
    if (code > 0 || code <= -KVR_E_COUNT_)
        return "unknown error";
    return texts[-code];
}

const char *kvr_error_name(int code)
{
    if (code > 0 || code <= -KVR_E_COUNT_)
        return "KVR_EUNKNOWN";
    return names[-code];
}

int kvr_error_set(kvr_error *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        err->code = code;
        va_start(ap, fmt);
        int n = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        if (n < 0)
            err->msg[0] = '\0';
    }
    return code;
}
