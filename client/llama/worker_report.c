/*
 * worker_report.c — what a kvrope-llama command reports: one JSON object
 * (cJSON; nested one level by group, e.g. "timings_ms") for --json, and the
 * same facts as plain lines of text otherwise. The bench reads numbers back
 * with kvr__wk_rep_get.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "client/llama/worker.h"

void kvr__wk_rep_init(kvr__wk_report *r, const char *command)
{
    memset(r, 0, sizeof *r);
    r->json = cJSON_CreateObject();
    if (r->json && command)
        cJSON_AddStringToObject(r->json, "command", command);
}

void kvr__wk_rep_free(kvr__wk_report *r)
{
    if (!r)
        return;
    cJSON_Delete(r->json);
    free(r->text);
    memset(r, 0, sizeof *r);
}

static cJSON *group_of(kvr__wk_report *r, const char *group)
{
    if (!r->json)
        return NULL;
    if (!group)
        return r->json;
    cJSON *g = cJSON_GetObjectItemCaseSensitive(r->json, group);
    if (!g)
        g = cJSON_AddObjectToObject(r->json, group);
    return g;
}

void kvr__wk_rep_num(kvr__wk_report *r, const char *group, const char *key, double v)
{
    cJSON *g = group_of(r, group);
    if (!g)
        return;
    if (!isfinite(v)) {
        cJSON_DeleteItemFromObjectCaseSensitive(g, key);
        cJSON_AddNullToObject(g, key);
        return;
    }
    /* Times and errors to 4 significant places after the point are enough. */
    double rounded = fabs(v) >= 1e15 || v == floor(v) ? v : round(v * 1e4) / 1e4;
    cJSON *old = cJSON_GetObjectItemCaseSensitive(g, key);
    if (old)
        cJSON_SetNumberValue(old, rounded);
    else
        cJSON_AddNumberToObject(g, key, rounded);
}

void kvr__wk_rep_nums(kvr__wk_report *r, const char *group, const kvr__wk_rep_kv *kv, size_t n)
{
    for (size_t i = 0; i < n; i++)
        kvr__wk_rep_num(r, group, kv[i].key, kv[i].v);
}

void kvr__wk_rep_str(kvr__wk_report *r, const char *group, const char *key, const char *s)
{
    cJSON *g = group_of(r, group);
    if (!g)
        return;
    cJSON_DeleteItemFromObjectCaseSensitive(g, key);
    cJSON_AddStringToObject(g, key, s ? s : "");
}

void kvr__wk_rep_bool(kvr__wk_report *r, const char *group, const char *key, bool v)
{
    cJSON *g = group_of(r, group);
    if (!g)
        return;
    cJSON_DeleteItemFromObjectCaseSensitive(g, key);
    cJSON_AddBoolToObject(g, key, v);
}

void kvr__wk_rep_tokens(kvr__wk_report *r, const char *key, const int32_t *t, size_t n)
{
    if (!r->json)
        return;
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(t[i]));
    cJSON_DeleteItemFromObjectCaseSensitive(r->json, key);
    cJSON_AddItemToObject(r->json, key, a);
}

void kvr__wk_rep_line(kvr__wk_report *r, const char *fmt, ...)
{
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    size_t len = strlen(buf);
    if (r->len + len + 2 > r->cap) {
        size_t nc = (r->cap + len + 2) * 2;
        char *p = realloc(r->text, nc);
        if (!p)
            return;
        r->text = p;
        r->cap = nc;
    }
    memcpy(r->text + r->len, buf, len);
    r->len += len;
    r->text[r->len++] = '\n';
    r->text[r->len] = 0;
}

double kvr__wk_rep_get(const kvr__wk_report *r, const char *group, const char *key)
{
    const cJSON *g = group ? cJSON_GetObjectItemCaseSensitive(r->json, group) : r->json;
    const cJSON *v = g ? cJSON_GetObjectItemCaseSensitive(g, key) : NULL;
    if (cJSON_IsNumber(v))
        return v->valuedouble;
    if (cJSON_IsBool(v))
        return cJSON_IsTrue(v) ? 1 : 0;
    return (double)NAN;
}

void kvr__wk_rep_print(const kvr__wk_report *r, bool json, FILE *out)
{
    if (json) {
        char *s = r->json ? cJSON_PrintUnformatted(r->json) : NULL;
        fprintf(out, "%s\n", s ? s : "{}");
        free(s);
    } else if (r->text) {
        fputs(r->text, out);
    }
    fflush(out);
}

/* A token string for the text report: printable ASCII kept, the rest escaped. */
void kvr__wk_quote(const char *s, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    if (cap < 8)
        return;
    out[o++] = '"';
    for (size_t i = 0; i < n && o + 6 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') {
            out[o++] = '\\';
            out[o++] = 'n';
        } else if (c == '"' || c == '\\') {
            out[o++] = '\\';
            out[o++] = (char)c;
        } else if (c < 0x20 || c == 0x7f) {
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
        } else {
            out[o++] = (char)c;
        }
    }
    out[o++] = '"';
    out[o] = 0;
}
