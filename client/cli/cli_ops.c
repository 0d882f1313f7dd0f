/*
 * cli_ops.c — the `kvrope edit --ops` JSON parser (cli_parse.h), on a
 * buffer. Invariants: every op's start/end is a non-negative integer below
 * 2^64 and every token id fits in 32 bits, or the input is refused whole;
 * nothing is allocated before the array's shape is known.
 */
#include "client/cli/cli_parse.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

/* A JSON number that is an integer in [0, max]. */
static bool whole(const cJSON *x, double max)
{
    return cJSON_IsNumber(x) && x->valuedouble >= 0 && x->valuedouble <= max &&
           x->valuedouble == (double)(uint64_t)x->valuedouble;
}

int kvr__cli_edit_ops_parse(const char *json, size_t len, kvr_edit_range **out, size_t *n,
                       uint32_t **tokbuf, size_t *n_new, char *err, size_t errlen)
{
    *out = NULL;
    *tokbuf = NULL;
    *n = *n_new = 0;
    cJSON *j = cJSON_ParseWithLength(json ? json : "", json ? len : 0);
    if (!j || !cJSON_IsArray(j) || cJSON_GetArraySize(j) == 0) {
        cJSON_Delete(j);
        return kvr__cli_errf(err, errlen, "want a non-empty JSON array of {\"start\", \"end\", "
                             "\"tokens\"}");
    }
    size_t k = (size_t)cJSON_GetArraySize(j), total = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, j) {
        const cJSON *t = cJSON_IsObject(it) ? cJSON_GetObjectItemCaseSensitive(it, "tokens")
                                            : NULL;
        if (t && !cJSON_IsArray(t)) {
            cJSON_Delete(j);
            return kvr__cli_errf(err, errlen, "\"tokens\" must be an array of token ids");
        }
        total += t ? (size_t)cJSON_GetArraySize(t) : 0;
    }
    kvr_edit_range *ops = calloc(k, sizeof *ops);
    uint32_t *tb = malloc((total ? total : 1) * sizeof *tb);
    if (!ops || !tb) {
        free(ops);
        free(tb);
        cJSON_Delete(j);
        return -2;
    }
    size_t i = 0, off = 0;
    int rc = 0;
    /* 2^64 is exactly representable; the largest double below it is the
     * largest start/end a JSON number can carry here. */
    const double u64_max = 18446744073709549568.0;
    cJSON_ArrayForEach(it, j) {
        const cJSON *s = cJSON_IsObject(it) ? cJSON_GetObjectItemCaseSensitive(it, "start")
                                            : NULL;
        const cJSON *e = s ? cJSON_GetObjectItemCaseSensitive(it, "end") : NULL;
        const cJSON *t = s ? cJSON_GetObjectItemCaseSensitive(it, "tokens") : NULL;
        if (!s || !whole(s, u64_max) || (e && !whole(e, u64_max))) {
            rc = kvr__cli_errf(err, errlen, "op %zu needs \"start\" (and optionally \"end\") as "
                               "non-negative integers", i);
            break;
        }
        ops[i].start = (uint64_t)s->valuedouble;
        ops[i].end = e ? (uint64_t)e->valuedouble : ops[i].start;
        ops[i].tokens = tb + off;
        const cJSON *x;
        cJSON_ArrayForEach(x, t) {
            if (!whole(x, 4294967295.0)) {
                rc = kvr__cli_errf(err, errlen, "op %zu: token ids are unsigned 32-bit integers",
                                   i);
                break;
            }
            tb[off++] = (uint32_t)x->valuedouble;
            ops[i].n_tokens++;
        }
        if (rc)
            break;
        i++;
    }
    cJSON_Delete(j);
    if (rc) {
        free(ops);
        free(tb);
        return rc;
    }
    *out = ops;
    *n = k;
    *tokbuf = tb;
    *n_new = total;
    return 0;
}
