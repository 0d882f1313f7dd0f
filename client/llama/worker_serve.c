/*
 * worker_serve.c — `kvrope-llama serve`: llama-server's HTTP API (its routes,
 * field names, response and SSE shapes, error JSON) on one resident model,
 * every prompt through kvroped (worker_serve_run.c runs them).
 *
 * HTTP is libmicrohttpd with a thread per connection: a connection thread
 * reads the body (at most SRV_MAX_BODY bytes, else 413), parses and checks
 * the request, tokenizes, queues one job and waits for it; streamed answers
 * come out of MHD's content-reader callback as the engine publishes text.
 * While it waits, the thread watches its socket: a client that went away
 * cancels its job (llama.vim drops a stale request on every keystroke).
 *
 * Invariants: every answer to a bad request is a 4xx with llama-server's
 * error shape {"error": {"code", "message", "type"}}; nothing a request
 * says reaches kvrope except through the engine's checked paths; the HTTP
 * server is up before the model is loaded (/health answers 503 until then).
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <microhttpd.h>

#include "llama.h"

#include "client/llama/kvrope_llama.h"
#include "client/llama/worker_serve.h"
#include "base/clock.h"

enum route { R_COMPLETION, R_INFILL, R_OAI_CMPL, R_OAI_CHAT };

typedef struct conn {
    srv   *s;
    char  *body;
    size_t len, cap;
    bool   too_big;
} conn;

/* ---- small helpers ------------------------------------------------------- */

static const char *stop_name(srv_stop t)
{
    return t == SRV_STOP_EOS ? "eos" : t == SRV_STOP_LIMIT ? "limit" : t == SRV_STOP_WORD ? "word"
                                                                                         : "none";
}

static int send_text(struct MHD_Connection *c, unsigned status, char *owned, size_t len,
                     const char *type)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, owned, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(owned);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Access-Control-Allow-Origin", "*");
    MHD_add_response_header(r, "Server", "kvrope-serve");
    int ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

/* Sends j (deleted here) as the JSON answer. */
static int send_json(struct MHD_Connection *c, unsigned status, cJSON *j)
{
    char *out = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!out)
        return MHD_NO;
    return send_text(c, status, out, strlen(out), "application/json; charset=utf-8");
}

static cJSON *error_obj(unsigned code, const char *type, const char *msg)
{
    cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddNumberToObject(e, "code", code);
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", type);
    return o;
}

static int send_error(struct MHD_Connection *c, unsigned code, const char *type,
                      const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int send_error(struct MHD_Connection *c, unsigned code, const char *type,
                      const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return send_json(c, code, error_obj(code, type, msg));
}

static int bad(struct MHD_Connection *c, const char *msg)
{
    return send_error(c, 400, "invalid_request_error", "%s", msg);
}

/* The request's body parsed as JSON (the caller's: cJSON_Delete); NULL when
 * it is not JSON, which every cJSON_Is* check then refuses. */
static cJSON *body_json(const conn *cn)
{
    return cJSON_ParseWithLength(cn->body ? cn->body : "", cn->len);
}

/* The body as a JSON object (the caller's: cJSON_Delete); NULL when it is
 * not one, the 400 then answered and its result in *ret. */
static cJSON *body_object(const conn *cn, struct MHD_Connection *c, int *ret)
{
    cJSON *b = body_json(cn);
    if (cJSON_IsObject(b))
        return b;
    cJSON_Delete(b);
    *ret = bad(c, "the request body is not a JSON object");
    return NULL;
}

/* A zeroed job (the caller's until submitted); NULL when out of memory, the
 * request's body b then released, the 500 answered and its result in *ret. */
static srv_job *job_new(struct MHD_Connection *c, cJSON *b, int *ret)
{
    srv_job *j = calloc(1, sizeof *j);
    if (!j) {
        cJSON_Delete(b);
        *ret = send_error(c, 500, "server_error", "out of memory");
    }
    return j;
}

/* Whether the client closed its end (or the socket failed). */
static bool peer_gone(int fd)
{
    if (fd < 0)
        return false;
    struct pollfd p = { .fd = fd, .events = POLLIN | POLLRDHUP };
    if (poll(&p, 1, 0) <= 0)
        return false;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))
        return true;
    if (p.revents & POLLIN) {
        char b;
        ssize_t r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    }
    return false;
}

static int conn_fd(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

/* Waits until the job has more than `seen` sendable bytes or is done.
 * Returns false when the client went away or the server stops (the job is
 * then cancelled). */
static bool wait_job(srv *s, srv_job *j, size_t seen, int fd)
{
    pthread_mutex_lock(&s->mu);
    while (!j->done && j->safe <= seen) {
        if (s->stopping) {
            j->cancelled = true;
            pthread_mutex_unlock(&s->mu);
            return false;
        }
        struct timespec ts = kvr_clock_deadline(50);
        pthread_cond_timedwait(&s->progress, &s->mu, &ts);
        if (!j->done && j->safe <= seen) {
            pthread_mutex_unlock(&s->mu);
            bool gone = peer_gone(fd);
            pthread_mutex_lock(&s->mu);
            if (gone) {
                j->cancelled = true;
                pthread_cond_broadcast(&s->wake);
                pthread_mutex_unlock(&s->mu);
                return false;
            }
        }
    }
    pthread_mutex_unlock(&s->mu);
    return true;
}

/* ---- tokens ------------------------------------------------------------- */

/* Tokenizes text; *out is the caller's. Returns 0 or -1 (message in err). */
static int tok(srv *s, const char *text, size_t len, bool add_special, bool parse_special,
               int32_t **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    if (len > (size_t)INT32_MAX / 2)
        return -1;
    size_t cap = len + 8;
    int32_t *t = malloc(cap * sizeof *t);
    if (!t)
        return -1;
    int32_t r = llama_tokenize(s->vocab, text, (int32_t)len, t, (int32_t)cap, add_special,
                               parse_special);
    if (r < 0) {
        cap = (size_t)-r;
        int32_t *nt = realloc(t, cap * sizeof *t);
        if (!nt) {
            free(t);
            return -1;
        }
        t = nt;
        r = llama_tokenize(s->vocab, text, (int32_t)len, t, (int32_t)cap, add_special,
                           parse_special);
    }
    if (r < 0) {
        free(t);
        return -1;
    }
    *out = t;
    *n = (size_t)r;
    return 0;
}

typedef struct tokv {
    int32_t *v;
    size_t   n, cap;
    bool     oom;
} tokv;

static void tv_add(tokv *t, const int32_t *x, size_t n)
{
    if (t->oom || n == 0)
        return;
    if (t->n + n > t->cap) {
        size_t c = t->cap ? t->cap : 256;
        while (c < t->n + n)
            c *= 2;
        int32_t *v = realloc(t->v, c * sizeof *v);
        if (!v) {
            t->oom = true;
            return;
        }
        t->v = v;
        t->cap = c;
    }
    memcpy(t->v + t->n, x, n * sizeof *x);
    t->n += n;
}

static void tv_one(tokv *t, int32_t x) { tv_add(t, &x, 1); }

/* The last n tokens of src. */
static void tv_tail(tokv *t, const tokv *src, size_t n)
{
    if (n)
        tv_add(t, src->v + src->n - n, n);
}

static bool tv_text(srv *s, tokv *t, const char *text, bool add_special, bool parse_special)
{
    int32_t *v;
    size_t n;
    if (tok(s, text, strlen(text), add_special, parse_special, &v, &n) < 0) {
        t->oom = true;
        return false;
    }
    tv_add(t, v, n);
    free(v);
    return true;
}

/* llama-server's prompt forms: a string, an array of token ids, or an array
 * mixing strings and ids (one prompt). Several prompts are refused here.
 * Returns NULL (tokens in t) or the reason. */
static const char *prompt_tokens(srv *s, const cJSON *p, bool add_special, bool parse_special,
                                 tokv *t)
{
    uint32_t nv = (uint32_t)llama_vocab_n_tokens(s->vocab);
    if (cJSON_IsString(p)) {
        tv_text(s, t, p->valuestring, add_special, parse_special);
        return t->oom ? "cannot tokenize the prompt" : NULL;
    }
    if (!cJSON_IsArray(p))
        return "\"prompt\" must be a string, an array of token ids, or an array of strings "
               "and token ids";
    int n_str = 0, n_num = 0, n_other = 0;
    const cJSON *x;
    cJSON_ArrayForEach(x, p) {
        if (cJSON_IsString(x))
            n_str++;
        else if (cJSON_IsNumber(x))
            n_num++;
        else
            n_other++;
    }
    if (n_other)
        return "\"prompt\" must be a string, an array of token ids, or an array of strings "
               "and token ids";
    if (n_str > 1 && n_num == 0)
        return "several prompts in one request are not supported: send one request per "
               "prompt";
    bool first = true;
    cJSON_ArrayForEach(x, p) {
        if (cJSON_IsString(x)) {
            tv_text(s, t, x->valuestring, first && add_special, parse_special);
        } else {
            double d = x->valuedouble;
            if (d < 0 || d >= nv || d != (double)(int32_t)d)
                return "invalid token id in \"prompt\" (out of the vocabulary)";
            tv_one(t, (int32_t)d);
        }
        first = false;
    }
    return t->oom ? "cannot tokenize the prompt" : NULL;
}

static char *detok(srv *s, const int32_t *t, size_t n, size_t *len)
{
    size_t cap = 64 + n * 8, o = 0;
    char *out = malloc(cap);
    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        char piece[256];
        int32_t r = llama_token_to_piece(s->vocab, t[i], piece, sizeof piece, 0, false);
        if (r < 0)
            r = 0;
        if (o + (size_t)r + 1 > cap) {
            cap = (o + (size_t)r + 1) * 2;
            char *no = realloc(out, cap);
            if (!no) {
                free(out);
                return NULL;
            }
            out = no;
        }
        memcpy(out + o, piece, (size_t)r);
        o += (size_t)r;
    }
    out[o] = 0;
    *len = o;
    return out;
}

static bool utf8_valid(const char *p, size_t n)
{
    const unsigned char *u = (const unsigned char *)p;
    for (size_t i = 0; i < n;) {
        size_t k = u[i] < 0x80 ? 1 : (u[i] >> 5) == 6 ? 2 : (u[i] >> 4) == 14 ? 3
                 : (u[i] >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n)
            return false;
        for (size_t j = 1; j < k; j++)
            if ((u[i + j] & 0xC0) != 0x80)
                return false;
        i += k;
    }
    return true;
}

/* cJSON's string must be valid UTF-8 for JSON: invalid bytes become U+FFFD. */
static cJSON *str_json(const char *p, size_t n)
{
    if (utf8_valid(p, n)) {
        char *c = strndup(p, n);
        cJSON *r = cJSON_CreateString(c ? c : "");
        free(c);
        return r;
    }
    char *o = malloc(n * 3 + 1);
    size_t k = 0;
    if (!o)
        return cJSON_CreateString("");
    for (size_t i = 0; i < n; i++) {
        if (utf8_valid(p + i, 1)) {
            o[k++] = p[i];
        } else {
            size_t m = 2;
            while (m <= 4 && i + m <= n && !utf8_valid(p + i, m))
                m++;
            if (m <= 4 && i + m <= n) {
                memcpy(o + k, p + i, m);
                k += m;
                i += m - 1;
            } else {
                memcpy(o + k, "\xEF\xBF\xBD", 3);
                k += 3;
            }
        }
    }
    o[k] = 0;
    cJSON *r = cJSON_CreateString(o);
    free(o);
    return r;
}

/* ---- request fields ---------------------------------------------------- */

static const char *const samp_names[SRV_SAMP_COUNT] = {
    [SRV_SAMP_PENALTIES] = "penalties", [SRV_SAMP_DRY] = "dry",
    [SRV_SAMP_TOP_N_SIGMA] = "top_n_sigma", [SRV_SAMP_TOP_K] = "top_k",
    [SRV_SAMP_TYP_P] = "typ_p", [SRV_SAMP_TOP_P] = "top_p", [SRV_SAMP_MIN_P] = "min_p",
    [SRV_SAMP_XTC] = "xtc", [SRV_SAMP_TEMP] = "temperature", [SRV_SAMP_INFILL] = "infill",
    [SRV_SAMP_ADAPTIVE_P] = "adaptive_p",
};

/* A sampler by llama.cpp's names: canonical, kebab-case, without the
 * underscore, any case, and nucleus / temp / typ. -1: unknown (ignored,
 * as llama-server does). */
static int samp_by_name(const char *name)
{
    char low[32], bare[32];
    size_t n = strlen(name);
    if (n >= sizeof low)
        return -1;
    size_t b = 0;
    for (size_t i = 0; i <= n; i++) {
        char ch = (char)tolower((unsigned char)name[i]);
        low[i] = ch == '-' ? '_' : ch;
        if (ch != '_' && ch != '-')
            bare[b++] = ch;
    }
    static const struct { const char *n; int s; } alias[] = {
        { "nucleus", SRV_SAMP_TOP_P }, { "temp", SRV_SAMP_TEMP }, { "typ", SRV_SAMP_TYP_P } };
    for (size_t i = 0; i < sizeof alias / sizeof alias[0]; i++)
        if (!strcmp(low, alias[i].n))
            return alias[i].s;
    for (int k = 0; k < SRV_SAMP_COUNT; k++) {
        char kb[32];
        size_t m = 0;
        for (const char *q = samp_names[k]; *q; q++)
            if (*q != '_')
                kb[m++] = *q;
        kb[m] = 0;
        if (!strcmp(low, samp_names[k]) || (strchr(samp_names[k], '_') && !strcmp(bare, kb)))
            return k;
    }
    return -1;
}

static int samp_by_char(char ch)
{
    static const struct { char c; int s; } map[] = {
        { 'e', SRV_SAMP_PENALTIES }, { 'd', SRV_SAMP_DRY }, { 's', SRV_SAMP_TOP_N_SIGMA },
        { 'k', SRV_SAMP_TOP_K }, { 'y', SRV_SAMP_TYP_P }, { 'p', SRV_SAMP_TOP_P },
        { 'm', SRV_SAMP_MIN_P }, { 'x', SRV_SAMP_XTC }, { 't', SRV_SAMP_TEMP },
        { 'i', SRV_SAMP_INFILL }, { 'a', SRV_SAMP_ADAPTIVE_P } };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (map[i].c == ch)
            return map[i].s;
    return -1;
}

/* Reads the generation fields llama-server honours (unknown fields ignored).
 * Returns NULL or the reason the request is refused. */
/* A request's defaults: llama-server's, with the server's -n. */
static void params_default(const srv *s, srv_params *p)
{
    kvr__srv_params_default(p);
    p->n_predict = s->o.n_predict;
}

static const char *parse_params(srv *s, const cJSON *b, enum route rt, srv_params *p)
{
    params_default(s, p);
    const cJSON *x;
#define NUM(name) ((x = cJSON_GetObjectItemCaseSensitive(b, name)) && !cJSON_IsNull(x))
#define WANT_NUM(name)                                                          \
    do {                                                                        \
        if (!cJSON_IsNumber(x))                                                 \
            return "\"" name "\" must be a number";                             \
    } while (0)
    const char *np = rt == R_OAI_CMPL || rt == R_OAI_CHAT ? "max_tokens" : "n_predict";
    for (int k = 0; k < 2; k++) {
        const char *name = k == 0 ? "n_predict" : np;
        if ((x = cJSON_GetObjectItemCaseSensitive(b, name)) && !cJSON_IsNull(x)) {
            if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble))
                return k == 0 ? "\"n_predict\" must be an integer"
                              : "\"max_tokens\" must be an integer";
            if (x->valuedouble < -1)
                return "the number of tokens to predict must be -1 (no limit) or >= 0";
            p->n_predict = x->valuedouble > 1e9 ? 1000000000 : (int)x->valuedouble;
        }
    }
    if ((x = cJSON_GetObjectItemCaseSensitive(b, "max_completion_tokens")) && cJSON_IsNumber(x) &&
        x->valuedouble >= -1)
        p->n_predict = x->valuedouble > 1e9 ? 1000000000 : (int)x->valuedouble;
    /* The sampling numbers, in the order they are checked: floats that take
     * any number (temperature, top_p, min_p, as llama-server reads them) or
     * only a finite one, and top_k, an int capped at 1e9. */
    enum { ANY_FLOAT, FINITE_FLOAT, CAPPED_INT };
#define F(name, kind, what)                                                     \
    { #name, offsetof(srv_params, name), kind, "\"" #name "\" must be " what }
#define ANY(name)    F(name, ANY_FLOAT, "a number")
#define FINITE(name) F(name, FINITE_FLOAT, "a finite number")
    static const struct { const char *name; size_t off; int kind; const char *err; } nums[] = {
        ANY(temperature), F(top_k, CAPPED_INT, "a number"), ANY(top_p), ANY(min_p),
        FINITE(typical_p), FINITE(top_n_sigma), FINITE(xtc_probability), FINITE(xtc_threshold),
        FINITE(repeat_penalty), FINITE(frequency_penalty), FINITE(presence_penalty),
        FINITE(dry_multiplier), FINITE(dry_base),
    };
#undef FINITE
#undef ANY
#undef F
    for (size_t k = 0; k < sizeof nums / sizeof nums[0]; k++)
        if (NUM(nums[k].name)) {
            if (!cJSON_IsNumber(x) ||
                (nums[k].kind == FINITE_FLOAT && !isfinite((float)x->valuedouble)))
                return nums[k].err;
            char *dst = (char *)p + nums[k].off;
            if (nums[k].kind == CAPPED_INT)
                *(int *)dst = x->valuedouble > 1e9 ? 1000000000 : (int)x->valuedouble;
            else
                *(float *)dst = (float)x->valuedouble;
        }
    if (!(p->repeat_penalty > 0.0f))    /* llama.cpp refuses it too */
        return "\"repeat_penalty\" must be > 0 (1 = off)";
    if (p->dry_base < 1.0f)     /* llama-server: below 1, the default */
        p->dry_base = 1.75f;
    if (p->xtc_probability < 0.0f)
        p->xtc_probability = 0.0f;
    if (p->xtc_probability > 1.0f)
        p->xtc_probability = 1.0f;
    static const struct { const char *name; size_t off; const char *err; } ints[] = {
        { "repeat_last_n", offsetof(srv_params, repeat_last_n),
          "\"repeat_last_n\" must be an integer >= 0" },
        { "dry_allowed_length", offsetof(srv_params, dry_allowed_length),
          "\"dry_allowed_length\" must be an integer >= 0" },
        { "dry_penalty_last_n", offsetof(srv_params, dry_penalty_last_n),
          "\"dry_penalty_last_n\" must be an integer >= 0" },
        { "min_keep", offsetof(srv_params, min_keep), "\"min_keep\" must be an integer >= 0" },
    };
    for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
        if (NUM(ints[k].name)) {
            if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble != floor(x->valuedouble))
                return ints[k].err;
            *(int *)((char *)p + ints[k].off) =
                x->valuedouble > 2147483647.0 ? 2147483647 : (int)x->valuedouble;
        }
    if ((x = cJSON_GetObjectItemCaseSensitive(b, "dry_sequence_breakers")) && !cJSON_IsNull(x)) {
        static const char *const bad = "\"dry_sequence_breakers\" must be a non-empty array of strings";
        if (!cJSON_IsArray(x) || !cJSON_GetArraySize(x))
            return bad;
        const cJSON *w;
        p->n_dry_breakers = 0;
        p->dry_breakers_owned = true;
        cJSON_ArrayForEach(w, x) {
            if (!cJSON_IsString(w))
                return bad;
            if (p->n_dry_breakers == SRV_MAX_BREAKERS)
                return "\"dry_sequence_breakers\" takes at most 16 strings";
            if (strlen(w->valuestring) > 64)
                return "a DRY sequence breaker is at most 64 bytes";
            if (!(p->dry_breakers[p->n_dry_breakers++] = strdup(w->valuestring)))
                return "out of memory";
        }
    }
    if (NUM("seed")) {
        WANT_NUM("seed");
        p->seed = x->valuedouble < 0 || x->valuedouble >= 4294967295.0
                      ? 0xFFFFFFFFu : (uint32_t)x->valuedouble;
    }
    if (NUM("n_indent")) {
        WANT_NUM("n_indent");
        p->n_indent = x->valuedouble < 0 ? 0 : x->valuedouble > 1e6 ? 1000000
                                                                   : (int)x->valuedouble;
    }
    if (NUM("t_max_predict_ms")) {
        WANT_NUM("t_max_predict_ms");
        p->t_max_predict_ms = x->valuedouble < 0 ? 0 : x->valuedouble;
    }
    if (NUM("id_slot")) {
        WANT_NUM("id_slot");
        if (x->valuedouble < -1 || x->valuedouble >= s->n_slots ||
            x->valuedouble != (double)(int)x->valuedouble)
            return "invalid \"id_slot\": no such slot";
        p->id_slot = (int)x->valuedouble;
    }
    for (int k = 0; k < 2; k++) {       /* "n" is OpenAI's name of n_cmpl */
        if (NUM(k ? "n" : "n_cmpl")) {
            if (!cJSON_IsNumber(x) || x->valuedouble < 1 || x->valuedouble > s->n_slots ||
                x->valuedouble != (double)(int)x->valuedouble)
                return "\"n_cmpl\" (\"n\") must be an integer from 1 to the number of slots";
            p->n_cmpl = (int)x->valuedouble;
            break;
        }
    }
    static const char *const bools[] = { "stream", "cache_prompt", "return_tokens",
                                         "ignore_eos" };
    static const char *const bool_err[] = {
        "\"stream\" must be a boolean", "\"cache_prompt\" must be a boolean",
        "\"return_tokens\" must be a boolean", "\"ignore_eos\" must be a boolean" };
    bool *dst[] = { &p->stream, &p->cache_prompt, &p->return_tokens, &p->ignore_eos };
    for (int k = 0; k < 4; k++)
        if ((x = cJSON_GetObjectItemCaseSensitive(b, bools[k])) && !cJSON_IsNull(x)) {
            if (!cJSON_IsBool(x))
                return bool_err[k];
            *dst[k] = cJSON_IsTrue(x);
        }
    if ((x = cJSON_GetObjectItemCaseSensitive(b, "stop")) && !cJSON_IsNull(x)) {
        if (cJSON_IsString(x)) {
            if (*x->valuestring && !(p->stop[p->n_stop++] = strdup(x->valuestring)))
                return "out of memory";
        } else if (cJSON_IsArray(x)) {
            const cJSON *w;
            cJSON_ArrayForEach(w, x) {
                if (!cJSON_IsString(w))
                    return "\"stop\" must be a string or an array of strings";
                if (p->n_stop == SRV_MAX_STOP)
                    return "\"stop\" takes at most 16 strings";
                if (*w->valuestring && !(p->stop[p->n_stop++] = strdup(w->valuestring)))
                    return "out of memory";
            }
        } else {
            return "\"stop\" must be a string or an array of strings";
        }
    }
    if ((x = cJSON_GetObjectItemCaseSensitive(b, "samplers")) && !cJSON_IsNull(x)) {
        /* an array of names, or a string of llama.cpp's one-letter names;
         * unknown names are skipped, as llama-server does */
        static const char *const bad = "\"samplers\" must be an array of sampler names or a "
                                       "string of sampler letters";
        p->n_samplers = 0;
        if (cJSON_IsString(x)) {
            for (const char *q = x->valuestring; *q && p->n_samplers < SRV_MAX_SAMPLERS; q++) {
                int k = samp_by_char(*q);
                if (k >= 0)
                    p->samplers[p->n_samplers++] = k;
            }
        } else if (cJSON_IsArray(x)) {
            const cJSON *w;
            cJSON_ArrayForEach(w, x) {
                if (!cJSON_IsString(w))
                    return bad;
                int k = samp_by_name(w->valuestring);
                if (k >= 0 && p->n_samplers < SRV_MAX_SAMPLERS)
                    p->samplers[p->n_samplers++] = k;
            }
        } else {
            return bad;
        }
    }
#undef NUM
#undef WANT_NUM
    return NULL;
}

static cJSON *params_json(const srv *s, const srv_params *p)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "n_predict", p->n_predict);
    cJSON_AddNumberToObject(o, "seed", p->seed);
    cJSON_AddNumberToObject(o, "temperature", p->temperature);
    cJSON_AddNumberToObject(o, "top_k", p->top_k);
    cJSON_AddNumberToObject(o, "top_p", p->top_p);
    cJSON_AddNumberToObject(o, "min_p", p->min_p);
    cJSON_AddNumberToObject(o, "top_n_sigma", p->top_n_sigma);
    cJSON_AddNumberToObject(o, "xtc_probability", p->xtc_probability);
    cJSON_AddNumberToObject(o, "xtc_threshold", p->xtc_threshold);
    cJSON_AddNumberToObject(o, "typical_p", p->typical_p);
    cJSON_AddNumberToObject(o, "repeat_last_n", p->repeat_last_n);
    cJSON_AddNumberToObject(o, "repeat_penalty", p->repeat_penalty);
    cJSON_AddNumberToObject(o, "presence_penalty", p->presence_penalty);
    cJSON_AddNumberToObject(o, "frequency_penalty", p->frequency_penalty);
    cJSON_AddNumberToObject(o, "dry_multiplier", p->dry_multiplier);
    cJSON_AddNumberToObject(o, "dry_base", p->dry_base);
    cJSON_AddNumberToObject(o, "dry_allowed_length", p->dry_allowed_length);
    cJSON_AddNumberToObject(o, "dry_penalty_last_n", p->dry_penalty_last_n);
    cJSON *db = cJSON_AddArrayToObject(o, "dry_sequence_breakers");
    for (int i = 0; i < p->n_dry_breakers; i++)
        cJSON_AddItemToArray(db, cJSON_CreateString(p->dry_breakers[i]));
    cJSON_AddNumberToObject(o, "min_keep", p->min_keep);
    cJSON_AddNumberToObject(o, "n_indent", p->n_indent);
    cJSON_AddNumberToObject(o, "t_max_predict_ms", p->t_max_predict_ms);
    cJSON *st = cJSON_AddArrayToObject(o, "stop");
    for (int i = 0; i < p->n_stop; i++)
        cJSON_AddItemToArray(st, cJSON_CreateString(p->stop[i]));
    cJSON *sa = cJSON_AddArrayToObject(o, "samplers");
    for (int i = 0; i < p->n_samplers; i++)
        cJSON_AddItemToArray(sa, cJSON_CreateString(samp_names[p->samplers[i]]));
    cJSON_AddBoolToObject(o, "stream", p->stream);
    cJSON_AddBoolToObject(o, "cache_prompt", p->cache_prompt);
    cJSON_AddNumberToObject(o, "n_ctx", s->n_ctx);
    return o;
}

/* ---- results ----------------------------------------------------------- */

/* A snapshot of a job's results, taken under srv.mu. */
typedef struct result {
    char    *text;           /* owned */
    size_t   len;
    int32_t *gen;            /* owned */
    size_t   n_gen;
    size_t   n_prompt, n_cache, n_eval, tokens_cached;
    double   t_prompt_ms, t_gen_ms;
    srv_stop stop_type;
    char     stopping_word[128];
    bool     truncated, has_new_line;
    int      slot, status;
    char     err_type[40], err[512];
    kvr__wk_sync_res sync;
    bool     via_cache;
} result;

static void snapshot(srv *s, srv_job *j, result *r)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_lock(&s->mu);
    r->len = j->len;
    r->text = malloc(j->len + 1);
    if (r->text) {
        memcpy(r->text, j->text ? j->text : "", j->len);
        r->text[j->len] = 0;
    }
    r->gen = malloc((j->n_gen ? j->n_gen : 1) * sizeof *r->gen);
    if (r->gen && j->n_gen)
        memcpy(r->gen, j->gen, j->n_gen * sizeof *r->gen);
    r->n_gen = j->n_gen;
    r->n_prompt = j->n;
    r->n_cache = j->n_cache;
    r->n_eval = j->n_eval;
    r->tokens_cached = j->tokens_cached;
    r->t_prompt_ms = j->t_prompt_ms;
    r->t_gen_ms = j->t_gen_ms;
    r->stop_type = j->stop_type;
    memcpy(r->stopping_word, j->stopping_word, sizeof r->stopping_word);
    r->truncated = j->truncated;
    r->has_new_line = j->has_new_line;
    r->slot = j->slot;
    r->status = j->status;
    r->sync = j->sync;
    r->via_cache = j->via_cache;
    memcpy(r->err_type, j->err_type, sizeof r->err_type);
    memcpy(r->err, j->err, sizeof r->err);
    pthread_mutex_unlock(&s->mu);
}

static void result_free(result *r)
{
    free(r->text);
    free(r->gen);
}

static cJSON *timings_json(const result *r)
{
    cJSON *t = cJSON_CreateObject();
    cJSON_AddNumberToObject(t, "cache_n", (double)r->n_cache);
    cJSON_AddNumberToObject(t, "prompt_n", (double)r->n_eval);
    cJSON_AddNumberToObject(t, "prompt_ms", r->t_prompt_ms);
    cJSON_AddNumberToObject(t, "prompt_per_token_ms",
                            r->n_eval ? r->t_prompt_ms / (double)r->n_eval : 0);
    cJSON_AddNumberToObject(t, "prompt_per_second",
                            r->t_prompt_ms > 0 ? 1e3 * (double)r->n_eval / r->t_prompt_ms : 0);
    cJSON_AddNumberToObject(t, "predicted_n", (double)r->n_gen);
    cJSON_AddNumberToObject(t, "predicted_ms", r->t_gen_ms);
    cJSON_AddNumberToObject(t, "predicted_per_token_ms",
                            r->n_gen ? r->t_gen_ms / (double)r->n_gen : 0);
    cJSON_AddNumberToObject(t, "predicted_per_second",
                            r->t_gen_ms > 0 ? 1e3 * (double)r->n_gen / r->t_gen_ms : 0);
    return t;
}

static cJSON *usage_json(const result *r)
{
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "completion_tokens", (double)r->n_gen);
    cJSON_AddNumberToObject(u, "prompt_tokens", (double)r->n_prompt);
    cJSON_AddNumberToObject(u, "total_tokens", (double)(r->n_prompt + r->n_gen));
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", (double)r->n_cache);
    return u;
}

/* What kvrope did for the prompt (an extra key; llama-server clients ignore
 * it): where the KV came from, the PIE ops, refreshes, and the steps' times. */
static cJSON *kvrope_json(const result *r)
{
    const kvr__wk_sync_res *y = &r->sync;
    cJSON *k = cJSON_CreateObject();
    cJSON_AddBoolToObject(k, "cache", r->via_cache);
    cJSON_AddStringToObject(k, "source", y->source);
    cJSON_AddNumberToObject(k, "n_reused", (double)y->n_reused);
    cJSON_AddNumberToObject(k, "n_computed", (double)y->n_computed);
    cJSON_AddNumberToObject(k, "n_refreshed", (double)y->n_refreshed);
    cJSON_AddNumberToObject(k, "n_ops", (double)y->n_ops);
    cJSON_AddNumberToObject(k, "n_approx", (double)y->n_approx);
    cJSON_AddNumberToObject(k, "n_placed", (double)y->n_placed);
    cJSON_AddNumberToObject(k, "n_repaired", (double)y->n_repaired);
    cJSON_AddNumberToObject(k, "n_runs", (double)y->n_runs);
    cJSON_AddNumberToObject(k, "match_ms", y->t_match_ms);
    cJSON_AddNumberToObject(k, "fetch_ms", y->t_fetch_ms);
    cJSON_AddNumberToObject(k, "load_ms", y->t_load_ms);
    cJSON_AddNumberToObject(k, "decode_ms", y->t_decode_ms);
    cJSON_AddNumberToObject(k, "sync_ms", y->t_total_ms);
    return k;
}

static void add_tokens(cJSON *o, const char *key, const int32_t *t, size_t n)
{
    cJSON *a = cJSON_AddArrayToObject(o, key);
    for (size_t i = 0; i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(t[i]));
}

/* /completion and /infill: the final object (content: the whole text, or
 * for a stream's last event what was not sent yet). */
static cJSON *completion_json(srv *s, const srv_params *p, const result *r, const char *content,
                              size_t clen, bool stream)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", 0);
    cJSON_AddItemToObject(o, "content", str_json(content, clen));
    if (p->return_tokens || !stream)
        add_tokens(o, "tokens", p->return_tokens ? r->gen : NULL, p->return_tokens ? r->n_gen : 0);
    cJSON_AddNumberToObject(o, "id_slot", r->slot);
    cJSON_AddBoolToObject(o, "stop", true);
    cJSON_AddStringToObject(o, "model", s->model_name);
    cJSON_AddNumberToObject(o, "tokens_predicted", (double)r->n_gen);
    cJSON_AddNumberToObject(o, "tokens_evaluated", (double)r->n_prompt);
    cJSON_AddItemToObject(o, "generation_settings", params_json(s, p));
    cJSON_AddStringToObject(o, "prompt", "");
    cJSON_AddBoolToObject(o, "has_new_line", r->has_new_line);
    cJSON_AddBoolToObject(o, "truncated", r->truncated);
    cJSON_AddStringToObject(o, "stop_type", stop_name(r->stop_type));
    cJSON_AddStringToObject(o, "stopping_word", r->stopping_word);
    cJSON_AddNumberToObject(o, "tokens_cached", (double)r->tokens_cached);
    cJSON_AddItemToObject(o, "timings", timings_json(r));
    cJSON_AddItemToObject(o, "kvrope", kvrope_json(r));
    return o;
}

/* response_fields: only those keys; "a/b" names a nested key and comes back
 * as the literal key "a/b" at the top. */
static cJSON *select_fields(cJSON *o, const cJSON *fields)
{
    if (!cJSON_IsArray(fields))
        return o;
    cJSON *out = cJSON_CreateObject();
    const cJSON *f;
    cJSON_ArrayForEach(f, fields) {
        if (!cJSON_IsString(f))
            continue;
        char path[256];
        snprintf(path, sizeof path, "%s", f->valuestring);
        cJSON *cur = o;
        for (char *save = NULL, *k = strtok_r(path, "/", &save); k && cur;
             k = strtok_r(NULL, "/", &save))
            cur = cJSON_IsObject(cur) ? cJSON_GetObjectItemCaseSensitive(cur, k) : NULL;
        if (cur && cur != o)
            cJSON_AddItemToObject(out, f->valuestring, cJSON_Duplicate(cur, true));
    }
    cJSON_Delete(o);
    return out;
}

/* llama-server's rule: "stop" for an end-of-generation token or a stop word,
 * else "length" */
static const char *finish_reason(srv_stop t)
{
    return t == SRV_STOP_EOS || t == SRV_STOP_WORD ? "stop" : "length";
}

static void oai_head(srv *s, cJSON *o, const char *id, time_t created, const char *object)
{
    cJSON_AddNumberToObject(o, "created", (double)created);
    cJSON_AddStringToObject(o, "model", s->model_name);
    cJSON_AddStringToObject(o, "system_fingerprint", "kvrope-serve");
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddStringToObject(o, "id", id);
}

/* ---- streaming ---------------------------------------------------------- */

typedef struct stream {
    srv         *s;
    srv_job     *jobs[SRV_MAX_SLOTS];   /* n_cmpl completions, streamed one after another */
    int          nj, cur;        /* jobs[cur]: the completion being streamed */
    size_t       gen_total;      /* completion tokens of the finished ones (usage) */
    enum route   rt;
    int          fd;
    size_t       sent;           /* text bytes turned into events */
    char        *buf;            /* events not yet handed to MHD */
    size_t       blen, boff, bcap;
    bool         head_sent, end;
    bool         delivered;      /* the end of the stream went to MHD */
    bool         include_usage;
    char         id[64];
    time_t       created;
    cJSON       *fields;         /* response_fields (owned) */
} stream;

static void st_emit(stream *st, cJSON *o, bool done_marker)
{
    char *js = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    size_t need = (js ? strlen(js) : 2) + 32;
    if (st->blen + need > st->bcap) {
        size_t c = (st->blen + need) * 2;
        char *nb = realloc(st->buf, c);
        if (!nb) {
            free(js);
            return;
        }
        st->buf = nb;
        st->bcap = c;
    }
    st->blen += (size_t)sprintf(st->buf + st->blen, "data: %s\n\n", js ? js : "{}");
    if (done_marker)
        st->blen += (size_t)sprintf(st->buf + st->blen, "data: [DONE]\n\n");
    free(js);
}

static cJSON *oai_chunk(stream *st, const char *text, size_t tlen, const char *finish)
{
    cJSON *o = cJSON_CreateObject(), *ch = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToArray(ch, c);
    if (finish)
        cJSON_AddStringToObject(c, "finish_reason", finish);
    else
        cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddNumberToObject(c, "index", st->cur);
    if (st->rt == R_OAI_CHAT) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        if (!st->head_sent) {
            cJSON_AddStringToObject(d, "role", "assistant");
            cJSON_AddNullToObject(d, "content");
        } else if (text) {
            cJSON_AddItemToObject(d, "content", str_json(text, tlen));
        }
    } else {
        cJSON_AddItemToObject(c, "text", str_json(text ? text : "", text ? tlen : 0));
        cJSON_AddNullToObject(c, "logprobs");
    }
    oai_head(st->s, o, st->id, st->created,
             st->rt == R_OAI_CHAT ? "chat.completion.chunk" : "text_completion");
    return o;
}

/* Turns the job's progress into events; false when the stream should end
 * with an error (client gone). */
static bool st_produce(stream *st)
{
    srv *s = st->s;
    srv_job *j = st->jobs[st->cur];
    if (!wait_job(s, j, st->sent, st->fd))
        return false;
    pthread_mutex_lock(&s->mu);
    bool done = j->done;
    size_t upto = done ? j->len : j->safe;
    char *delta = NULL;
    size_t dlen = upto > st->sent ? upto - st->sent : 0;
    if (dlen && (delta = malloc(dlen)))
        memcpy(delta, j->text + st->sent, dlen);
    size_t n_gen = j->n_gen, n_prompt = j->n;
    int slot = j->slot, status = j->status;
    pthread_mutex_unlock(&s->mu);
    if (dlen && !delta)
        return false;
    if (status) {
        free(delta);
        result r;
        snapshot(s, j, &r);
        cJSON *e = error_obj((unsigned)r.status, r.err_type, r.err);
        st_emit(st, e, false);
        result_free(&r);
        st->end = true;
        return true;
    }
    if ((st->rt == R_OAI_CHAT) && !st->head_sent) {
        st_emit(st, oai_chunk(st, NULL, 0, NULL), false);
        st->head_sent = true;
    }
    if (dlen && !(done && st->rt != R_OAI_CHAT && st->rt != R_OAI_CMPL)) {
        if (st->rt == R_COMPLETION || st->rt == R_INFILL) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "index", st->cur);
            cJSON_AddItemToObject(o, "content", str_json(delta, dlen));
            cJSON_AddArrayToObject(o, "tokens");
            cJSON_AddBoolToObject(o, "stop", false);
            cJSON_AddNumberToObject(o, "id_slot", slot);
            cJSON_AddNumberToObject(o, "tokens_predicted", (double)n_gen);
            cJSON_AddNumberToObject(o, "tokens_evaluated", (double)n_prompt);
            st_emit(st, o, false);
        } else {
            st_emit(st, oai_chunk(st, delta, dlen, NULL), false);
        }
        st->sent = upto;
        dlen = 0;
    }
    if (done) {
        result r;
        snapshot(s, j, &r);
        bool last = st->cur + 1 >= st->nj;
        if (st->rt == R_COMPLETION || st->rt == R_INFILL) {
            cJSON *o = completion_json(s, &j->p, &r, delta ? delta : "", dlen, true);
            cJSON_ReplaceItemInObject(o, "prompt", cJSON_CreateString(""));
            cJSON_ReplaceItemInObject(o, "index", cJSON_CreateNumber(st->cur));
            st_emit(st, st->fields ? select_fields(o, st->fields) : o, false);
        } else {
            cJSON *o = oai_chunk(st, NULL, 0, finish_reason(r.stop_type));
            cJSON_AddItemToObject(o, "timings", timings_json(&r));
            if (!st->include_usage)
                cJSON_AddItemToObject(o, "usage", usage_json(&r));
            st_emit(st, o, last && !st->include_usage);
            if (last && st->include_usage) {
                /* OpenAI's: the prompt once, the completions' tokens summed */
                r.n_gen += st->gen_total;
                cJSON *u = cJSON_CreateObject();
                cJSON_AddArrayToObject(u, "choices");
                oai_head(s, u, st->id, st->created,
                         st->rt == R_OAI_CHAT ? "chat.completion.chunk" : "text_completion");
                cJSON_AddItemToObject(u, "usage", usage_json(&r));
                st_emit(st, u, true);
            }
        }
        st->gen_total += r.n_gen;
        result_free(&r);
        if (last) {
            st->end = true;
        } else {            /* the next completion of n_cmpl */
            st->cur++;
            st->sent = 0;
            st->head_sent = false;
        }
    }
    free(delta);
    return true;
}

static ssize_t st_read(void *cls, uint64_t pos, char *out, size_t max)
{
    (void)pos;
    stream *st = cls;
    for (;;) {
        if (st->boff < st->blen) {
            size_t n = st->blen - st->boff < max ? st->blen - st->boff : max;
            memcpy(out, st->buf + st->boff, n);
            st->boff += n;
            if (st->boff == st->blen)
                st->boff = st->blen = 0;
            return (ssize_t)n;
        }
        if (st->end) {
            st->delivered = true;
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        if (!st_produce(st))
            return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

static void st_free(void *cls)
{
    stream *st = cls;
    srv *s = st->s;
    /* A stream dropped before its end: the client went away (MHD failed a
     * write, or the connection closed). Cancel the jobs that still run (the
     * engine counts them when they stop: also the completions after one that
     * failed); count the ones that had finished before the answer reached the
     * client. */
    for (int k = 0; k < st->nj; k++) {
        srv_job *j = st->jobs[k];
        pthread_mutex_lock(&s->mu);
        if (!j->done) {         /* also after an error that ended the stream early */
            j->cancelled = true;
            pthread_cond_broadcast(&s->wake);
        } else if (!st->delivered && !j->cancelled) {
            s->m.cancelled++;
        }
        pthread_mutex_unlock(&s->mu);
        kvr__srv_job_release(s, j);
    }
    cJSON_Delete(st->fields);
    free(st->buf);
    free(st);
}

/* ---- generation routes ------------------------------------------------- */

static int fim_layout(srv *s, const cJSON *b, tokv *out, const char **why)
{
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(b, "input_prefix");
    const cJSON *suf = cJSON_GetObjectItemCaseSensitive(b, "input_suffix");
    const cJSON *ext = cJSON_GetObjectItemCaseSensitive(b, "input_extra");
    const cJSON *prm = cJSON_GetObjectItemCaseSensitive(b, "prompt");
    if ((pre && !cJSON_IsString(pre) && !cJSON_IsNull(pre)) ||
        (suf && !cJSON_IsString(suf) && !cJSON_IsNull(suf))) {
        *why = "\"input_prefix\" and \"input_suffix\" must be strings";
        return -1;
    }
    if (ext && !cJSON_IsNull(ext)) {
        const cJSON *c;
        bool ok = cJSON_IsArray(ext);
        cJSON_ArrayForEach(c, (ok ? ext : NULL)) {
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(c, "filename");
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(c, "text");
            if (!cJSON_IsObject(c) || (f && !cJSON_IsString(f)) || (t && !cJSON_IsString(t)))
                ok = false;
        }
        if (!ok) {
            *why = "\"input_extra\" must be an array of {\"filename\": string, \"text\": string}";
            return -1;
        }
    }
    tokv tp = { 0 }, tpre = { 0 }, tsuf = { 0 }, extra = { 0 };
    if (prm && !cJSON_IsNull(prm)) {
        if ((*why = prompt_tokens(s, prm, false, true, &tp)))
            goto fail;
    }
    tv_text(s, &tpre, cJSON_IsString(pre) ? pre->valuestring : "", false, false);
    tv_text(s, &tsuf, cJSON_IsString(suf) ? suf->valuestring : "", false, false);
    int32_t fpre = llama_vocab_fim_pre(s->vocab), fsuf = llama_vocab_fim_suf(s->vocab),
            fmid = llama_vocab_fim_mid(s->vocab), frep = llama_vocab_fim_rep(s->vocab),
            fsep = llama_vocab_fim_sep(s->vocab);
    bool fim = fpre != LLAMA_TOKEN_NULL && fsuf != LLAMA_TOKEN_NULL && fmid != LLAMA_TOKEN_NULL;
    /* llama-server's repo-level layout (arXiv 2409.12186):
     *   [FIM_REP]myproject\n [FIM_SEP]file\n chunk ... [FIM_SEP]filename\n
     *   [FIM_PRE]prefix[FIM_SUF]suffix[FIM_MID]prompt-continuation
     * (--spm-infill: [FIM_SUF]suffix[FIM_PRE]prefix[FIM_MID]); without FIM_SEP each chunk follows "\n\n--- snippet ---\n\n". */
    if (fim && frep != LLAMA_TOKEN_NULL) {
        tv_one(&extra, frep);
        tv_text(s, &extra, "myproject\n", false, false);
    }
    const cJSON *c;
    cJSON_ArrayForEach(c, (cJSON_IsArray(ext) ? ext : NULL)) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(c, "filename");
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(c, "text");
        if (fim && fsep != LLAMA_TOKEN_NULL) {
            char name[1200];
            snprintf(name, sizeof name, "%s\n", cJSON_IsString(f) ? f->valuestring : "tmp");
            tv_one(&extra, fsep);
            tv_text(s, &extra, name, false, false);
        } else {
            tv_text(s, &extra, "\n\n--- snippet ---\n\n", false, false);
        }
        tv_text(s, &extra, cJSON_IsString(t) ? t->valuestring : "", false, false);
    }
    if (fim && fsep != LLAMA_TOKEN_NULL) {
        tv_one(&extra, fsep);
        tv_text(s, &extra, "filename\n", false, false);
    }
    if (tp.oom || tpre.oom || tsuf.oom || extra.oom) {
        *why = "cannot tokenize the request";
        goto fail;
    }
    int nb = (int)s->n_batch, nctx = (int)s->n_ctx;
    size_t n_pre = tpre.n < (size_t)(3 * (nb / 4)) ? tpre.n : (size_t)(3 * (nb / 4));
    long sb = (long)(nb / 4) - (long)(2 + tp.n);
    size_t n_suf = sb < 0 ? 0 : tsuf.n < (size_t)sb ? tsuf.n : (size_t)sb;
    /* llama-server budgets the chunks with its own n_predict (params.n_predict:
     * -1 unless started with -n), not the request's */
    long eb = (long)nctx - nb - 2L * s->o.n_predict;
    size_t n_ext = eb < 0 ? 0 : extra.n < (size_t)eb ? extra.n : (size_t)eb;
    bool bos = llama_vocab_get_add_bos(s->vocab);
    if (fim) {
        tv_tail(out, &extra, n_ext);
        if (bos)
            tv_one(out, llama_vocab_bos(s->vocab));
        if (s->o.spm_infill) {   /* --spm-infill: FIM_SUF suffix FIM_PRE prefix prompt */
            tv_one(out, fsuf);
            tv_add(out, tsuf.v, n_suf);
        }
        tv_one(out, fpre);
        tv_tail(out, &tpre, n_pre);
        tv_add(out, tp.v, tp.n);
        if (!s->o.spm_infill) {
            tv_one(out, fsuf);
            tv_add(out, tsuf.v, n_suf);
        }
        tv_one(out, fmid);
    } else {
        /* No FIM tokens (a plain code model): the model continues the text
         * before the cursor, with the chunks before it; the suffix cannot
         * be given to such a model and is left out. */
        if (bos)
            tv_one(out, llama_vocab_bos(s->vocab));
        tv_tail(out, &extra, n_ext);
        tv_tail(out, &tpre, n_pre);
        tv_add(out, tp.v, tp.n);
    }
    free(tp.v);
    free(tpre.v);
    free(tsuf.v);
    free(extra.v);
    return out->oom ? (*why = "out of memory", -1) : 0;
fail:
    free(tp.v);
    free(tpre.v);
    free(tsuf.v);
    free(extra.v);
    return -1;
}

/* The chat messages through the model's template (chatml when it has none). */
static char *chat_prompt(srv *s, const cJSON *msgs, const char **why)
{
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0) {
        *why = "\"messages\" must be a non-empty array of {\"role\", \"content\"}";
        return NULL;
    }
    size_t n = (size_t)cJSON_GetArraySize(msgs), total = 0;
    llama_chat_message *m = calloc(n, sizeof *m);
    char **owned = calloc(n, sizeof *owned);
    char *out = NULL;
    if (!m || !owned) {
        *why = "out of memory";
        goto done;
    }
    size_t i = 0;
    const cJSON *x;
    cJSON_ArrayForEach(x, msgs) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(x, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(x, "content");
        if (!cJSON_IsString(role)) {
            *why = "every message needs a \"role\" string";
            goto done;
        }
        if (cJSON_IsString(content)) {
            owned[i] = strdup(content->valuestring);
        } else if (cJSON_IsArray(content)) {
            size_t cap = 1, len = 0;
            const cJSON *part;
            cJSON_ArrayForEach(part, content) {
                const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "text");
                const cJSON *ty = cJSON_GetObjectItemCaseSensitive(part, "type");
                if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "text") || !cJSON_IsString(t)) {
                    *why = "only text content parts ({\"type\": \"text\", \"text\": ...}) are "
                           "supported";
                    goto done;
                }
                cap += strlen(t->valuestring);
            }
            owned[i] = malloc(cap);
            if (owned[i]) {
                cJSON_ArrayForEach(part, content) {
                    const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
                    memcpy(owned[i] + len, t, strlen(t));
                    len += strlen(t);
                }
                owned[i][len] = 0;
            }
        } else if (!content || cJSON_IsNull(content)) {
            owned[i] = strdup("");
        } else {
            *why = "a message's \"content\" must be a string or an array of text parts";
            goto done;
        }
        if (!owned[i]) {
            *why = "out of memory";
            goto done;
        }
        m[i].role = role->valuestring;
        m[i].content = owned[i];
        total += strlen(owned[i]) + strlen(role->valuestring) + 64;
        i++;
    }
    const char *tmpl = llama_model_chat_template(kvr__wk_lm_model(s->e.lm), NULL);
    if (!tmpl)
        tmpl = "chatml";
    size_t cap = total * 2 + 256;
    out = malloc(cap);
    int32_t r = out ? llama_chat_apply_template(tmpl, m, n, true, out, (int32_t)cap) : -1;
    if (r > (int32_t)cap - 1) {
        char *no = realloc(out, (size_t)r + 1);
        if (no) {
            out = no;
            r = llama_chat_apply_template(tmpl, m, n, true, out, r + 1);
        } else {
            r = -1;
        }
    }
    if (r < 0) {
        free(out);
        out = NULL;
        *why = "the model's chat template is not supported by llama_chat_apply_template";
        goto done;
    }
    out[r] = 0;
done:
    for (size_t k = 0; owned && k < n; k++)
        free(owned[k]);
    free(owned);
    free(m);
    return out;
}

/* The non-streamed answer of one completion (index: its place among n_cmpl). */
static cJSON *result_json(srv *s, enum route rt, const srv_params *p, const result *r,
                          const char *id, int index)
{
    if (rt == R_COMPLETION || rt == R_INFILL) {
        cJSON *o = completion_json(s, p, r, r->text ? r->text : "", r->len, false);
        cJSON_ReplaceItemInObject(o, "index", cJSON_CreateNumber(index));
        return o;
    }
    cJSON *o = cJSON_CreateObject(), *ch = cJSON_AddArrayToObject(o, "choices");
    cJSON *cc = cJSON_CreateObject();
    cJSON_AddItemToArray(ch, cc);
    cJSON_AddStringToObject(cc, "finish_reason", finish_reason(r->stop_type));
    cJSON_AddNumberToObject(cc, "index", index);
    if (rt == R_OAI_CHAT) {
        cJSON *m = cJSON_AddObjectToObject(cc, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        cJSON_AddItemToObject(m, "content", str_json(r->text ? r->text : "", r->len));
    } else {
        cJSON_AddItemToObject(cc, "text", str_json(r->text ? r->text : "", r->len));
        cJSON_AddNullToObject(cc, "logprobs");
    }
    oai_head(s, o, id, time(NULL), rt == R_OAI_CHAT ? "chat.completion" : "text_completion");
    cJSON_AddItemToObject(o, "usage", usage_json(r));
    cJSON_AddItemToObject(o, "timings", timings_json(r));
    return o;
}

/* Another job for the same prompt and parameters (NULL without memory). */
static srv_job *job_clone(const srv_job *j)
{
    srv_job *c = calloc(1, sizeof *c);
    if (!c || !(c->toks = malloc(j->n * sizeof *c->toks))) {
        free(c);
        return NULL;
    }
    memcpy(c->toks, j->toks, j->n * sizeof *c->toks);
    c->n = j->n;
    c->kind = j->kind;
    c->p = j->p;
    c->p.n_stop = c->p.n_dry_breakers = 0;    /* the copies are its own */
    bool ok = true;
    for (int i = 0; ok && i < j->p.n_stop; i++)
        if ((ok = (c->p.stop[i] = strdup(j->p.stop[i])) != NULL))
            c->p.n_stop++;
    for (int i = 0; ok && i < j->p.n_dry_breakers; i++) {
        if (!j->p.dry_breakers_owned)
            c->p.dry_breakers[i] = j->p.dry_breakers[i];
        else
            ok = (c->p.dry_breakers[i] = strdup(j->p.dry_breakers[i])) != NULL;
        c->p.n_dry_breakers += ok;
    }
    if (!ok) {
        kvr__srv_params_free(&c->p);
        free(c->toks);
        free(c);
        return NULL;
    }
    return c;
}

static int handle_generate(conn *cn, struct MHD_Connection *c, enum route rt)
{
    srv *s = cn->s;
    int ret;
    cJSON *b = body_object(cn, c, &ret);
    if (!b)
        return ret;
    srv_job *j = job_new(c, b, &ret);
    if (!j)
        return ret;
    const char *why = parse_params(s, b, rt, &j->p);
    tokv t = { 0 };
    if (!why) {
        if (rt == R_INFILL) {
            fim_layout(s, b, &t, &why);
        } else if (rt == R_OAI_CHAT) {
            char *text = chat_prompt(s, cJSON_GetObjectItemCaseSensitive(b, "messages"), &why);
            if (text) {
                tv_text(s, &t, text, true, true);
                free(text);
            }
        } else {
            const cJSON *pr = cJSON_GetObjectItemCaseSensitive(b, "prompt");
            why = pr ? prompt_tokens(s, pr, true, true, &t) : "\"prompt\" is required";
        }
    }
    if (!why && t.oom)
        why = "cannot tokenize the request";
    if (!why && t.n == 0)
        why = "the prompt is empty";
    if (why) {
        free(t.v);
        kvr__srv_params_free(&j->p);
        free(j);
        cJSON_Delete(b);
        return bad(c, why);
    }
    if (t.n >= s->n_ctx) {
        cJSON *e = error_obj(400, "exceed_context_size_error",
                             "the request exceeds the available context size, try increasing it");
        cJSON *eo = cJSON_GetObjectItem(e, "error");
        cJSON_AddNumberToObject(eo, "n_prompt_tokens", (double)t.n);
        cJSON_AddNumberToObject(eo, "n_ctx", s->n_ctx);
        free(t.v);
        kvr__srv_params_free(&j->p);
        free(j);
        cJSON_Delete(b);
        return send_json(c, 400, e);
    }
    j->kind = SRV_JOB_GEN;
    j->toks = t.v;
    j->n = t.n;
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(b, "stream_options");
    bool include_usage = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(so, "include_usage"));
    /* an empty list selects nothing out, as llama-server (the whole answer) */
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(b, "response_fields");
    cJSON *fields = cJSON_GetArraySize(rf) > 0 ? cJSON_Duplicate(rf, true) : NULL;
    cJSON_Delete(b);
    if (kvr__srv_submit(s, j) < 0) {
        cJSON_Delete(fields);
        kvr__srv_params_free(&j->p);
        free(j->toks);
        free(j);
        return send_error(c, 503, "unavailable_error", "the server is stopping");
    }
    char id[64];
    snprintf(id, sizeof id, "%s%08x%08x", rt == R_OAI_CHAT ? "chatcmpl-" : "cmpl-",
             (unsigned)time(NULL), (unsigned)rand());
    /* n_cmpl > 1: the other completions are jobs of their own, queued now */
    srv_job *jobs[SRV_MAX_SLOTS] = { j };
    int nj = 1;
    for (; nj < j->p.n_cmpl; nj++)
        if (!(jobs[nj] = job_clone(j)) || kvr__srv_submit(s, jobs[nj]) < 0) {
            if (jobs[nj]) {
                kvr__srv_params_free(&jobs[nj]->p);
                free(jobs[nj]->toks);
                free(jobs[nj]);
            }
            break;
        }
    if (j->p.stream) {
        stream *st = calloc(1, sizeof *st);
        struct MHD_Response *r = NULL;
        if (st) {
            *st = (stream){ .s = s, .nj = nj, .rt = rt, .fd = conn_fd(c),
                            .include_usage = include_usage, .created = time(NULL),
                            .fields = fields };
            memcpy(st->jobs, jobs, sizeof jobs);
            snprintf(st->id, sizeof st->id, "%s", id);
            r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, st_read, st,
                                                  st_free);
        }
        if (!r) {
            free(st);
            cJSON_Delete(fields);
            for (int k = 0; k < nj; k++)
                kvr__srv_job_release(s, jobs[k]);
            return send_error(c, 500, "server_error", "out of memory");
        }
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "Access-Control-Allow-Origin", "*");
        ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    bool gone = false;
    for (int k = 0; k < nj && !gone; k++)
        gone = !wait_job(s, jobs[k], SIZE_MAX, conn_fd(c));
    if (gone) {
        cJSON_Delete(fields);
        pthread_mutex_lock(&s->mu);
        for (int k = 0; k < nj; k++)
            if (!jobs[k]->done)
                jobs[k]->cancelled = true;
        pthread_cond_broadcast(&s->wake);
        pthread_mutex_unlock(&s->mu);
        for (int k = 0; k < nj; k++)
            kvr__srv_job_release(s, jobs[k]);
        return MHD_NO;      /* the client is gone: close */
    }
    cJSON *arr = cJSON_CreateArray(), *err = NULL;
    unsigned err_code = 0;
    for (int k = 0; k < nj; k++) {
        result r;
        snapshot(s, jobs[k], &r);
        if (r.status && !err) {
            err_code = (unsigned)r.status;
            err = error_obj(err_code, r.err_type, r.err);
        } else if (!r.status) {
            cJSON *o = result_json(s, rt, &jobs[k]->p, &r, id, k);
            cJSON_AddItemToArray(arr, fields && (rt == R_COMPLETION || rt == R_INFILL)
                                          ? select_fields(o, fields) : o);
        }
        result_free(&r);
    }
    if (err) {
        cJSON_Delete(arr);
        ret = send_json(c, err_code, err);
    } else if (nj == 1) {
        cJSON *one = cJSON_DetachItemFromArray(arr, 0);
        cJSON_Delete(arr);
        ret = send_json(c, 200, one);
    } else if (rt == R_OAI_CHAT || rt == R_OAI_CMPL) {
        /* llama-server's merge: the first answer with every choice */
        cJSON *one = cJSON_DetachItemFromArray(arr, 0);
        cJSON *ch = cJSON_GetObjectItem(one, "choices"), *o;
        while ((o = cJSON_DetachItemFromArray(arr, 0))) {
            cJSON_AddItemToArray(ch, cJSON_DetachItemFromArray(cJSON_GetObjectItem(o, "choices"),
                                                               0));
            cJSON_Delete(o);
        }
        cJSON_Delete(arr);
        ret = send_json(c, 200, one);
    } else {
        ret = send_json(c, 200, arr);
    }
    cJSON_Delete(fields);
    for (int k = 0; k < nj; k++)
        kvr__srv_job_release(s, jobs[k]);
    return ret;
}

/* ---- other routes ------------------------------------------------------ */

static int handle_tokenize(conn *cn, struct MHD_Connection *c)
{
    srv *s = cn->s;
    cJSON *b = body_json(cn);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(b, "content");
    const cJSON *as = cJSON_GetObjectItemCaseSensitive(b, "add_special");
    const cJSON *ps = cJSON_GetObjectItemCaseSensitive(b, "parse_special");
    const cJSON *wp = cJSON_GetObjectItemCaseSensitive(b, "with_pieces");
    if (!cJSON_IsObject(b) || !cJSON_IsString(content) || (as && !cJSON_IsBool(as)) ||
        (ps && !cJSON_IsBool(ps)) || (wp && !cJSON_IsBool(wp))) {
        cJSON_Delete(b);
        return bad(c, "/tokenize takes {\"content\": string, \"add_special\": bool, "
                      "\"parse_special\": bool, \"with_pieces\": bool}");
    }
    int32_t *t;
    size_t n;
    if (tok(s, content->valuestring, strlen(content->valuestring), cJSON_IsTrue(as),
            ps ? cJSON_IsTrue(ps) : true, &t, &n) < 0) {
        cJSON_Delete(b);
        return send_error(c, 500, "server_error", "tokenization failed");
    }
    cJSON *o = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(o, "tokens");
    for (size_t i = 0; i < n; i++) {
        if (!cJSON_IsTrue(wp)) {
            cJSON_AddItemToArray(a, cJSON_CreateNumber(t[i]));
            continue;
        }
        char piece[256];
        int32_t r = llama_token_to_piece(s->vocab, t[i], piece, sizeof piece, 0, true);
        if (r < 0)
            r = 0;
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "id", t[i]);
        if (utf8_valid(piece, (size_t)r)) {
            piece[r] = 0;
            cJSON_AddStringToObject(x, "piece", piece);
        } else {
            cJSON *bytes = cJSON_AddArrayToObject(x, "piece");
            for (int32_t k = 0; k < r; k++)
                cJSON_AddItemToArray(bytes, cJSON_CreateNumber((unsigned char)piece[k]));
        }
        cJSON_AddItemToArray(a, x);
    }
    free(t);
    cJSON_Delete(b);
    return send_json(c, 200, o);
}

static int handle_detokenize(conn *cn, struct MHD_Connection *c)
{
    srv *s = cn->s;
    cJSON *b = body_json(cn);
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(b, "tokens"), *x;
    uint32_t nv = (uint32_t)llama_vocab_n_tokens(s->vocab);
    bool ok = cJSON_IsObject(b) && cJSON_IsArray(a);
    size_t n = ok ? (size_t)cJSON_GetArraySize(a) : 0;
    int32_t *t = malloc((n ? n : 1) * sizeof *t);
    size_t i = 0;
    cJSON_ArrayForEach(x, (ok ? a : NULL)) {
        if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble >= nv ||
            x->valuedouble != (double)(int32_t)x->valuedouble) {
            ok = false;
            break;
        }
        if (t)
            t[i++] = (int32_t)x->valuedouble;
    }
    cJSON_Delete(b);
    if (!ok) {
        free(t);
        return bad(c, "/detokenize takes {\"tokens\": [token ids of the vocabulary]}");
    }
    size_t len = 0;
    char *text = t ? detok(s, t, i, &len) : NULL;
    free(t);
    if (!text)
        return send_error(c, 500, "server_error", "out of memory");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddItemToObject(o, "content", str_json(text, len));
    free(text);
    return send_json(c, 200, o);
}

static int handle_apply_template(conn *cn, struct MHD_Connection *c)
{
    int ret;
    cJSON *b = body_object(cn, c, &ret);
    if (!b)
        return ret;
    const char *why = NULL;
    char *p = chat_prompt(cn->s, cJSON_GetObjectItemCaseSensitive(b, "messages"), &why);
    cJSON_Delete(b);
    if (!p)
        return bad(c, why);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "prompt", p);
    free(p);
    return send_json(c, 200, o);
}

static cJSON *model_meta(srv *s)
{
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(s->e.lm);
    const struct llama_model *m = kvr__wk_lm_model(s->e.lm);
    cJSON *meta = cJSON_CreateObject();
    cJSON_AddNumberToObject(meta, "vocab_type", llama_vocab_type(s->vocab));
    cJSON_AddNumberToObject(meta, "n_vocab", in->n_vocab);
    cJSON_AddNumberToObject(meta, "n_ctx_train", in->n_ctx_train);
    cJSON_AddNumberToObject(meta, "n_embd", in->n_embd);
    cJSON_AddNumberToObject(meta, "n_params", (double)llama_model_n_params(m));
    cJSON_AddNumberToObject(meta, "size", (double)llama_model_size(m));
    return meta;
}

static int handle_models(srv *s, struct MHD_Connection *c)
{
    cJSON *o = cJSON_CreateObject();
    cJSON *ms = cJSON_AddArrayToObject(o, "models"), *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "name", s->model_name);
    cJSON_AddStringToObject(m, "model", s->model_name);
    cJSON_AddStringToObject(m, "type", "model");
    cJSON_AddItemToArray(ms, m);
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data"), *d = cJSON_CreateObject();
    cJSON_AddStringToObject(d, "id", s->model_name);
    cJSON_AddStringToObject(d, "object", "model");
    cJSON_AddNumberToObject(d, "created", (double)time(NULL));
    cJSON_AddStringToObject(d, "owned_by", "llamacpp");
    cJSON_AddItemToObject(d, "meta", model_meta(s));
    cJSON_AddItemToArray(data, d);
    return send_json(c, 200, o);
}

static int handle_props(srv *s, struct MHD_Connection *c)
{
    srv_params p;
    params_default(s, &p);
    cJSON *o = cJSON_CreateObject(), *d = cJSON_AddObjectToObject(o, "default_generation_settings");
    cJSON_AddNumberToObject(d, "id", 0);
    cJSON_AddNumberToObject(d, "id_task", -1);
    cJSON_AddNumberToObject(d, "n_ctx", s->n_ctx);
    cJSON_AddBoolToObject(d, "speculative", false);
    cJSON_AddBoolToObject(d, "is_processing", false);
    cJSON_AddItemToObject(d, "params", params_json(s, &p));
    cJSON_AddNumberToObject(o, "total_slots", s->n_slots);
    cJSON_AddStringToObject(o, "model_alias", s->model_name);
    cJSON_AddStringToObject(o, "model_path", s->model_path);
    cJSON *mod = cJSON_AddObjectToObject(o, "modalities");
    cJSON_AddBoolToObject(mod, "vision", false);
    cJSON_AddBoolToObject(mod, "audio", false);
    const char *tmpl = llama_model_chat_template(kvr__wk_lm_model(s->e.lm), NULL);
    cJSON_AddStringToObject(o, "chat_template", tmpl ? tmpl : "chatml");
    char piece[64];
    int32_t r = llama_token_to_piece(s->vocab, llama_vocab_bos(s->vocab), piece, 63, 0, true);
    piece[r > 0 ? r : 0] = 0;
    cJSON_AddItemToObject(o, "bos_token", str_json(piece, strlen(piece)));
    r = llama_token_to_piece(s->vocab, llama_vocab_eos(s->vocab), piece, 63, 0, true);
    piece[r > 0 ? r : 0] = 0;
    cJSON_AddItemToObject(o, "eos_token", str_json(piece, strlen(piece)));
    cJSON_AddStringToObject(o, "build_info", "kvrope serve (llama.cpp v0.5.0)");
    cJSON_AddBoolToObject(o, "is_sleeping", false);
    cJSON *kv = cJSON_AddObjectToObject(o, "kvrope");
    cJSON_AddStringToObject(kv, "model", s->e.model);
    cJSON_AddStringToObject(kv, "socket", s->socket);
    return send_json(c, 200, o);
}

static int handle_slots_get(srv *s, struct MHD_Connection *c)
{
    srv_params p;
    params_default(s, &p);
    cJSON *a = cJSON_CreateArray();
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->n_slots; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "id", i);
        cJSON_AddNumberToObject(o, "id_task", s->slots[i].processing ? s->slots[i].id_task : -1);
        cJSON_AddNumberToObject(o, "n_ctx", s->n_ctx);
        cJSON_AddBoolToObject(o, "speculative", false);
        cJSON_AddBoolToObject(o, "is_processing", s->slots[i].processing);
        cJSON_AddItemToObject(o, "params", params_json(s, &p));
        cJSON *kv = cJSON_AddObjectToObject(o, "kvrope");
        cJSON_AddStringToObject(kv, "session", s->slots[i].session);
        cJSON_AddNumberToObject(kv, "n_prompt_tokens", (double)s->slots[i].n);
        cJSON_AddNumberToObject(kv, "n_approximate", (double)s->slots[i].n_approx);
        cJSON_AddItemToArray(a, o);
    }
    pthread_mutex_unlock(&s->mu);
    return send_json(c, 200, a);
}

static int handle_slots_post(conn *cn, struct MHD_Connection *c, const char *url)
{
    srv *s = cn->s;
    const char *action = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "action");
    char *end;
    long id = strtol(url + 7, &end, 10);
    if (end == url + 7 || *end || id < 0 || id >= s->n_slots)
        return bad(c, "invalid slot id");
    srv_job_kind k;
    if (action && !strcmp(action, "save"))
        k = SRV_JOB_SLOT_SAVE;
    else if (action && !strcmp(action, "restore"))
        k = SRV_JOB_SLOT_RESTORE;
    else if (action && !strcmp(action, "erase"))
        k = SRV_JOB_SLOT_ERASE;
    else
        return bad(c, "?action= must be save, restore or erase");
    cJSON *b = NULL;
    const cJSON *fn = NULL;
    if (k != SRV_JOB_SLOT_ERASE) {
        b = body_json(cn);
        fn = cJSON_GetObjectItemCaseSensitive(b, "filename");
        if (!cJSON_IsString(fn) || !*fn->valuestring || strlen(fn->valuestring) > 200 ||
            strstr(fn->valuestring, "..") || strchr(fn->valuestring, '/')) {
            cJSON_Delete(b);
            return bad(c, "Invalid filename");
        }
    }
    int ret;
    srv_job *j = job_new(c, b, &ret);
    if (!j)
        return ret;
    kvr__srv_params_default(&j->p);
    j->kind = k;
    j->p.id_slot = (int)id;
    if (fn)
        snprintf(j->slot_file, sizeof j->slot_file, "%s", fn->valuestring);
    cJSON_Delete(b);
    if (kvr__srv_submit(s, j) < 0) {
        free(j);
        return send_error(c, 503, "unavailable_error", "the server is stopping");
    }
    if (!wait_job(s, j, SIZE_MAX, conn_fd(c))) {
        kvr__srv_job_release(s, j);
        return MHD_NO;
    }
    pthread_mutex_lock(&s->mu);
    int status = j->status;
    char type[40], err[512];
    snprintf(type, sizeof type, "%s", j->err_type);
    snprintf(err, sizeof err, "%s", j->err);
    size_t n = j->n_saved;
    double ms = j->t_op_ms;
    char file[sizeof j->slot_file];
    memcpy(file, j->slot_file, sizeof file);
    pthread_mutex_unlock(&s->mu);
    kvr__srv_job_release(s, j);
    if (status)
        return send_error(c, (unsigned)status, type, "%s", err);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "id_slot", (double)id);
    if (k == SRV_JOB_SLOT_ERASE) {
        cJSON_AddNumberToObject(o, "n_erased", (double)n);
    } else {
        cJSON_AddStringToObject(o, "filename", file);
        cJSON_AddNumberToObject(o, k == SRV_JOB_SLOT_SAVE ? "n_saved" : "n_restored", (double)n);
        cJSON_AddNumberToObject(o, k == SRV_JOB_SLOT_SAVE ? "n_written" : "n_read", 0);
        cJSON *t = cJSON_AddObjectToObject(o, "timings");
        cJSON_AddNumberToObject(t, k == SRV_JOB_SLOT_SAVE ? "save_ms" : "restore_ms", ms);
    }
    return send_json(c, 200, o);
}

static int handle_metrics(srv *s, struct MHD_Connection *c)
{
    srv_metrics m;
    size_t q;
    int busy = 0;
    pthread_mutex_lock(&s->mu);
    m = s->m;
    q = s->q_len;
    for (int i = 0; i < s->n_slots; i++)
        busy += s->slots[i].processing;
    pthread_mutex_unlock(&s->mu);
    size_t cap = 8192, o = 0;
    char *out = malloc(cap);
    if (!out)
        return MHD_NO;
#define P(...) o += (size_t)snprintf(out + o, o < cap ? cap - o : 0, __VA_ARGS__)
#define CTR(name, help, v)                                                                  \
    P("# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name,                 \
      (unsigned long long)(v))
#define GAUGE(name, help, v)                                                                \
    P("# HELP %s %s\n# TYPE %s gauge\n%s %g\n", name, help, name, name, (double)(v))
    CTR("llamacpp:prompt_tokens_total",
        "Number of prompt tokens processed, excluding cached tokens", m.prompt_tokens);
    CTR("llamacpp:prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
        m.prompt_reused);
    GAUGE("llamacpp:prompt_seconds_total", "Prompt process time", m.prompt_seconds);
    CTR("llamacpp:tokens_predicted_total", "Number of generation tokens processed.",
        m.tokens_predicted);
    GAUGE("llamacpp:tokens_predicted_seconds_total", "Predict process time",
          m.predicted_seconds);
    GAUGE("llamacpp:requests_processing", "Number of requests processing.", busy);
    GAUGE("llamacpp:requests_deferred", "Number of requests deferred.", q);
    CTR("kvrope:requests_total", "Generation requests answered.", m.requests);
    CTR("kvrope:requests_failed_total", "Generation requests that failed.", m.requests_failed);
    CTR("kvrope:requests_cancelled_total", "Requests whose client went away.", m.cancelled);
    CTR("kvrope:prompt_tokens_computed_total", "Prompt tokens decoded.", m.prompt_tokens);
    CTR("kvrope:prompt_tokens_reused_total", "Prompt tokens taken from kvroped.",
        m.prompt_reused);
    CTR("kvrope:prompt_tokens_refreshed_total",
        "Approximate prompt tokens re-encoded during requests.", m.prompt_refreshed);
    CTR("kvrope:prompt_tokens_placed_total",
        "Prompt tokens placed from cached runs anywhere in the prompt (cover).", m.prompt_placed);
    CTR("kvrope:prompt_tokens_repaired_total",
        "Placed prompt tokens recomputed at the seams of their runs.", m.prompt_repaired);
    CTR("kvrope:tokens_refreshed_idle_total", "Approximate tokens re-encoded when idle.",
        m.refreshed_idle);
    CTR("kvrope:cache_unavailable_total", "Requests answered without kvroped.",
        m.cache_unavailable);
    CTR("kvrope:commit_failed_total", "Stores into kvroped that failed.", m.commit_failed);
    GAUGE("kvrope:queue_depth", "Requests waiting for the engine.", q);
    P("# HELP kvrope:ttft_seconds Time to first token.\n# TYPE kvrope:ttft_seconds histogram\n");
    for (int b = 0; b < 12; b++)
        P("kvrope:ttft_seconds_bucket{le=\"%g\"} %llu\n", kvr__srv_ttft_le[b],
          (unsigned long long)m.ttft_bucket[b]);
    P("kvrope:ttft_seconds_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)m.ttft_count);
    P("kvrope:ttft_seconds_sum %g\nkvrope:ttft_seconds_count %llu\n", m.ttft_sum,
      (unsigned long long)m.ttft_count);
#undef P
#undef CTR
#undef GAUGE
    if (o >= cap)
        o = cap - 1;
    return send_text(c, 200, out, o, "text/plain; version=0.0.4");
}

/* ---- dispatch ---------------------------------------------------------- */

static bool authorized(srv *s, struct MHD_Connection *c)
{
    if (!s->n_keys)
        return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    const char *x = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Api-Key");
    const char *key = x;
    if (h && !strncmp(h, "Bearer ", 7))
        key = h + 7;
    for (size_t i = 0; key && i < s->n_keys; i++)
        if (!strcmp(key, s->keys[i]))
            return true;
    return false;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload, size_t *upload_size, void **con_cls)
{
    (void)version;
    srv *s = cls;
    conn *cn = *con_cls;
    if (!cn) {
        if (!(cn = calloc(1, sizeof *cn)))
            return MHD_NO;
        cn->s = s;
        *con_cls = cn;
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (cn->too_big || cn->len + n > SRV_MAX_BODY) {
            cn->too_big = true;     /* read and dropped, answered at the end */
            return MHD_YES;
        }
        if (kvr__srv_buf_add(&cn->body, &cn->len, &cn->cap, 4096, upload, n) != 0)
            cn->too_big = true;
        return MHD_YES;
    }
    bool get = !strcmp(method, "GET"), post = !strcmp(method, "POST");
    if (!strcmp(method, "OPTIONS")) {
        struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"",
                                                                 MHD_RESPMEM_PERSISTENT);
        MHD_add_response_header(r, "Access-Control-Allow-Origin", "*");
        MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        MHD_add_response_header(r, "Access-Control-Allow-Headers", "*");
        int ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    if (cn->too_big)
        return send_error(c, 413, "invalid_request_error",
                          "the request body is larger than %u bytes", SRV_MAX_BODY);
    bool is_health = !strcmp(url, "/health") || !strcmp(url, "/v1/health");
    pthread_mutex_lock(&s->mu);
    bool ready = s->ready;
    pthread_mutex_unlock(&s->mu);
    if (!ready)
        return send_error(c, 503, "unavailable_error", "Loading model");
    if (get && is_health) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", "ok");
        return send_json(c, 200, o);
    }
    bool is_public = !strcmp(url, "/models") || !strcmp(url, "/v1/models");
    if (!is_public && !is_health && !authorized(s, c))
        return send_error(c, 401, "authentication_error", "Invalid API Key");
    if (get && is_public)
        return handle_models(s, c);
    if (get && !strcmp(url, "/props"))
        return handle_props(s, c);
    if (get && !strcmp(url, "/metrics"))
        return handle_metrics(s, c);
    if (get && !strcmp(url, "/slots"))
        return handle_slots_get(s, c);
    if (post && !strncmp(url, "/slots/", 7))
        return handle_slots_post(cn, c, url);
    if (post && !strcmp(url, "/tokenize"))
        return handle_tokenize(cn, c);
    if (post && !strcmp(url, "/detokenize"))
        return handle_detokenize(cn, c);
    if (post && !strcmp(url, "/apply-template"))
        return handle_apply_template(cn, c);
    if (post && (!strcmp(url, "/completion") || !strcmp(url, "/completions")))
        return handle_generate(cn, c, R_COMPLETION);
    if (post && !strcmp(url, "/infill"))
        return handle_generate(cn, c, R_INFILL);
    if (post && !strcmp(url, "/v1/completions"))
        return handle_generate(cn, c, R_OAI_CMPL);
    if (post && (!strcmp(url, "/v1/chat/completions") || !strcmp(url, "/chat/completions")))
        return handle_generate(cn, c, R_OAI_CHAT);
    return send_error(c, 404, "not_found_error", "File Not Found");
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode code)
{
    (void)cls;
    (void)c;
    (void)code;
    conn *cn = *con_cls;
    if (cn) {
        free(cn->body);
        free(cn);
        *con_cls = NULL;
    }
}

/* ---- the command ------------------------------------------------------- */

static const char serve_usage[] =
"usage: kvrope-llama --model M.gguf [--socket S] [--threads N] serve [--listen HOST:PORT]\n"
"        [--parallel N] [--ctx-size N] [--kv-size N] [--batch-size N] [--n-predict N]\n"
"        [--api-key-file F] [--refresh K] [--alias NAME] [--repair P]\n"
"        [--spm-infill | --no-spm-infill] [--persist]\n"
"  llama-server's HTTP API (/completion, /infill, /v1/completions, /v1/chat/completions,\n"
"  /tokenize, /detokenize, /apply-template, /health, /props, /v1/models, /metrics,\n"
"  /slots) on the model, kvroped as its cache. --listen defaults to 127.0.0.1:8080;\n"
"  --threads to the cores not busy now. --repair: how the seams of cached runs\n"
"  placed anywhere in a prompt are repaired (none, epic:K, blend:SHARE[@L], all,\n"
"  joined by '+'; default epic:16, docs/eval.md). --spm-infill: /infill puts the\n"
"  suffix first (FIM_SUF suffix FIM_PRE prefix FIM_MID), as llama-server's flag of\n"
"  that name; the default when the model's GGUF has kvrope.infill.spm = true\n"
"  (scripts/gen-gguf.py --spm-infill), which --no-spm-infill overrides.\n"
"  --n-predict (-n): a request's default n_predict (-1: to the end of the\n"
"  context), which /infill's budget for input_extra also uses, as llama-server's -n.\n"
"  --persist: the slots' sessions are persistent, so a kvroped with --disk-dir keeps\n"
"  them across its restart (ignored with a warning when it has no disk tier).\n"
"  --ctx-size: a request's context (default the model's); --kv-size:\n"
"  the KV cache's cells for all slots (default ctx x (parallel + 1), at most\n"
"  max(2 ctx, 131072)): kv-size / ctx - 1 slots generate at once. SIGINT /\n"
"  SIGTERM stop it.\n";

static int parse_listen(const char *l, struct sockaddr_storage *ss, socklen_t *len, char *err,
                        size_t errlen)
{
    char host[256];
    const char *colon = strrchr(l, ':');
    if (!colon || colon == l || (size_t)(colon - l) >= sizeof host || !colon[1]) {
        snprintf(err, errlen, "--listen takes HOST:PORT, not %s", l);
        return -1;
    }
    memcpy(host, l, (size_t)(colon - l));
    host[colon - l] = 0;
    if (host[0] == '[' && host[strlen(host) - 1] == ']') {
        memmove(host, host + 1, strlen(host));
        host[strlen(host) - 1] = 0;
    }
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_NUMERICSERV }, *ai = NULL;
    int r = getaddrinfo(host, colon + 1, &hints, &ai);
    if (r || !ai) {
        snprintf(err, errlen, "--listen %s: %s", l, gai_strerror(r));
        return -1;
    }
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    *len = ai->ai_addrlen;
    freeaddrinfo(ai);
    return 0;
}

static int read_keys(srv *s, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "--api-key-file %s: %s", path, strerror(errno));
        return -1;
    }
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        size_t n = strcspn(line, "\r\n");
        line[n] = 0;
        if (!n)
            continue;
        char **k = realloc(s->keys, (s->n_keys + 1) * sizeof *k);
        if (!k || !(k[s->n_keys] = strdup(line))) {
            if (k)
                s->keys = k;
            fclose(f);
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        s->keys = k;
        s->n_keys++;
    }
    fclose(f);
    if (!s->n_keys) {
        snprintf(err, errlen, "--api-key-file %s holds no key", path);
        return -1;
    }
    return 0;
}

static int free_cores(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    double la[1];
    if (n < 1)
        n = 1;
    int busy = getloadavg(la, 1) == 1 ? (int)(la[0] + 0.5) : 0;
    int f = (int)n - busy;
    return f < 1 ? 1 : f > 8 ? 8 : f;
}

static bool arg_num(const char *v, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || errno || end == v || *end || x < lo || x > hi)
        return false;
    *out = x;
    return true;
}

int kvr__wk_serve_main(kvr__wk_env *e, const char *model_path, const char *socket, int threads,
                      int argc, char **argv)
{
    static srv S;
    srv *s = &S;
    memset(s, 0, sizeof *s);
    /* refresh 16: docs/eval.md's PIE table (llama.cpp), 98.4% argmax agreement
     * with a full re-encode for 20% of its tokens, against 97.6% for 13.5% */
    s->o = (srv_opts){ .listen = "127.0.0.1:8080", .parallel = 4, .idle_ms = 300,
                       .refresh = 16, .n_predict = -1,
                       .repair = { .first_k = KVR_WK_REPAIR_DEFAULT_K } };
    s->model_path = model_path;
    s->socket = socket;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(serve_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--listen") && v) {
            s->o.listen = v, i++;
        } else if (!strcmp(a, "--parallel") && arg_num(v, 1, SRV_MAX_SLOTS, &n)) {
            s->o.parallel = (int)n, i++;
        } else if (!strcmp(a, "--ctx-size") && arg_num(v, 0, 1 << 24, &n)) {
            s->o.n_ctx = (uint32_t)n, i++;
        } else if (!strcmp(a, "--kv-size") && arg_num(v, 512, 1 << 26, &n)) {
            s->o.kv_size = (uint32_t)n, i++;
        } else if ((!strcmp(a, "--n-predict") || !strcmp(a, "-n")) && arg_num(v, -1, 1 << 30, &n)) {
            s->o.n_predict = (int)n, i++;
        } else if (!strcmp(a, "--batch-size") && arg_num(v, 32, 1 << 20, &n)) {
            s->o.n_batch = (uint32_t)n, i++;
        } else if (!strcmp(a, "--refresh") && arg_num(v, 0, 1 << 20, &n)) {
            s->o.refresh = (uint32_t)n, i++;
        } else if (!strcmp(a, "--api-key-file") && v) {
            s->o.api_key_file = v, i++;
        } else if (!strcmp(a, "--persist")) {
            s->o.persist = true;
        } else if (!strcmp(a, "--spm-infill") || !strcmp(a, "--no-spm-infill")) {
            s->o.spm_infill = a[2] == 's';
            s->o.spm_infill_set = true;
        } else if (!strcmp(a, "--alias") && v) {
            s->o.alias = v, i++;
        } else if (!strcmp(a, "--repair") && v) {
            char why[256];
            if (kvr__wk_repair_parse(v, &s->o.repair, why, sizeof why) < 0) {
                fprintf(stderr, "kvrope-llama serve: %s\n", why);
                return 2;
            }
            i++;
        } else {
            fprintf(stderr, "kvrope-llama serve: bad or incomplete option %s\n%s", a,
                    serve_usage);
            return 2;
        }
    }
    char err[1024];
    struct sockaddr_storage ss;
    socklen_t sl;
    if (parse_listen(s->o.listen, &ss, &sl, err, sizeof err) < 0 ||
        (s->o.api_key_file && read_keys(s, s->o.api_key_file, err, sizeof err) < 0)) {
        fprintf(stderr, "kvrope-llama serve: %s\n", err);
        return 2;
    }
    const char *base = strrchr(model_path, '/');
    snprintf(s->model_name, sizeof s->model_name, "%s", s->o.alias ? s->o.alias
                                                                   : base ? base + 1 : model_path);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->wake, NULL);
    kvr_list_init(&s->queue);
    pthread_cond_init(&s->progress, NULL);

    /* Signals: blocked everywhere, taken by sigwait in this thread. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
            MHD_USE_ERROR_LOG | (ss.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0),
        0, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)600, MHD_OPTION_CONNECTION_LIMIT, (unsigned)256,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(256 * 1024), MHD_OPTION_END);
    if (!d) {
        fprintf(stderr, "kvrope-llama serve: cannot listen on %s: %s\n", s->o.listen,
                strerror(errno));
        return 1;
    }
    fprintf(stderr, "kvrope serve: listening on http://%s (loading %s)\n", s->o.listen,
            model_path);

    int rc = 1;
    if (kvr__wk_lm_load(&e->lm, model_path, threads ? threads : free_cores(), e->err,
                       sizeof e->err) < 0 ||
        kvr__wk_profile(e, model_path) < 0) {
        fprintf(stderr, "kvrope-llama serve: %s\n", e->err);
        goto stop_http;
    }
    /* kvroped may be down at start too: answer without the cache, and the
     * engine registers the model when it connects */
    bool up = kvr_client_connect(&e->kc, socket, NULL) == 0 && kvr_client_ping(e->kc, NULL) == 0;
    if (up && kvr__wk_register(e, model_path) < 0) {
        fprintf(stderr, "kvrope-llama serve: registering the model in kvroped: %s\n", e->err);
        up = false;
    }
    if (!up) {
        fprintf(stderr, "kvrope serve: kvroped at %s cannot be reached (%s): answering without "
                "the cache until it can\n", socket, e->kc ? kvr_client_last_error(e->kc) : "");
        kvr_llama_model_default_name(e->profile, e->model, sizeof e->model);
        e->kv_code = 0;
    }
    if (kvr__wk_lm_threads_sleep(e->lm, err, sizeof err) < 0)
        fprintf(stderr, "kvrope serve: compute threads will spin: %s\n", err);
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e->lm);
    s->n_ctx = s->o.n_ctx ? s->o.n_ctx : in->n_ctx_train ? in->n_ctx_train : 4096;
    /* blend repair's selection pass runs the prompt through layer 1 */
    kvr__wk_lm_set_probe(e->lm, s->o.repair.blend_share > 0 && !s->o.repair.all);
    /* continuous batching: each slot generates in a sequence of its own
     * (after the session engine's scratch ones), and the cache holds the
     * generating slots' contexts beside the one being prepared: kv_size /
     * n_ctx - 1 of them at once (the default holds every slot, unless that
     * is more than max(2 n_ctx, 131072) cells: long-context models) */
    uint64_t kv = s->o.kv_size;
    if (!kv) {
        uint64_t cap = 2ull * s->n_ctx > 131072 ? 2ull * s->n_ctx : 131072;
        kv = (uint64_t)s->n_ctx * (uint64_t)(s->o.parallel + 1);
        if (kv > cap)
            kv = cap;
    }
    if (kv < 2ull * s->n_ctx || kv > UINT32_MAX) {
        fprintf(stderr, "kvrope-llama serve: --kv-size %llu cannot hold two contexts of %u "
                "tokens (one being prepared, one generating)\n", (unsigned long long)kv,
                s->n_ctx);
        goto stop_http;
    }
    s->n_gen_max = (int)(kv / s->n_ctx - 1) < s->o.parallel ? (int)(kv / s->n_ctx - 1)
                                                            : s->o.parallel;
    kvr__wk_lm_reserve_seqs(e->lm, (uint32_t)s->o.parallel);
    if (kvr__wk_lm_context(e->lm, (uint32_t)kv, e->err, sizeof e->err) < 0) {
        fprintf(stderr, "kvrope-llama serve: %s\n", e->err);
        goto stop_http;
    }
    s->n_batch = s->o.n_batch ? s->o.n_batch : s->n_ctx / 2 < 2048 ? s->n_ctx / 2 : 2048;
    s->vocab = llama_model_get_vocab(kvr__wk_lm_model(e->lm));
    /* A model trained on the suffix-first layout says so (scripts/gen-gguf.py
     * --spm-infill, or an --hf config with fim_order "spm", writes kvrope.infill.spm):
     * /infill then lays it out that way without --spm-infill. llama-server has
     * no such key: started on that model it needs the flag. */
    char spm[8];
    if (!s->o.spm_infill_set &&
        llama_model_meta_val_str(kvr__wk_lm_model(e->lm), "kvrope.infill.spm", spm, sizeof spm) > 0 &&
        !strcmp(spm, "true")) {
        s->o.spm_infill = true;
        fprintf(stderr, "kvrope serve: the model was trained suffix first (kvrope.infill.spm): "
                "/infill lays its prompt out as --spm-infill\n");
    }
    /* reuse anywhere: the daemon's cover verb (a daemon without it refuses
     * the call, and the engine goes on with prefix and PIE reuse) */
    e->cover = (kvr__wk_cover_api){ kvr_client_cover, kvr_client_cover_get, kvr_cover_release };
    /* A fresh process's first touch of its load buffers cost 0.5-0.8 s of
     * the first cached request's 56 MiB fetch here (tests/bench/bench_serve.py,
     * after a restart): fault them in before /health says ok, for a whole
     * context or 512 MiB, whichever is less (they grow on demand beyond). */
    size_t pn = s->n_ctx;
    while (pn > 1 && kvr__wk_payload_bytes(e, pn) + kvr__wk_state_bytes(e, pn) > ((size_t)512 << 20))
        pn /= 2;
    double tpf = kvr__wk_now_ms();
    kvr__wk_prefault_bufs(e, pn);
    fprintf(stderr, "kvrope serve: load buffers for %zu tokens faulted in (%.0f ms)\n", pn,
            kvr__wk_now_ms() - tpf);
    e->persist = s->o.persist;
    s->e = *e;
    s->connected = up;
    s->t_reconnect = kvr__wk_now_ms() - 1000;
    s->model_hash = 1469598103934665603ull;
    for (const char *p = e->model; *p; p++)
        s->model_hash = (s->model_hash ^ (unsigned char)*p) * 1099511628211ull;
    s->n_slots = s->o.parallel;
    unsigned port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                             : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    for (int i = 0; i < s->n_slots; i++)
        snprintf(s->slots[i].session, sizeof s->slots[i].session, "kvs-%016llx-%u-s%d",
                 (unsigned long long)s->model_hash, port, i);
    if (kvr__srv_engine_start(s) < 0) {
        fprintf(stderr, "kvrope-llama serve: cannot start the engine thread\n");
        *e = s->e;
        goto stop_http;
    }
    pthread_mutex_lock(&s->mu);
    s->ready = true;
    pthread_mutex_unlock(&s->mu);
    fprintf(stderr, "kvrope serve: ready: %s (%s, %u layers), context %u, %d slots, %d threads, "
            "kvrope model %s\n", s->model_name, in->arch, in->n_layer, s->n_ctx, s->n_slots,
            kvr__wk_lm_n_threads(e->lm), s->e.model);

    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "kvrope serve: %s, stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    kvr__srv_engine_stop(s);
    MHD_stop_daemon(d);
    d = NULL;
    *e = s->e;
    rc = 0;
stop_http:
    if (d) {
        pthread_mutex_lock(&s->mu);
        s->stopping = true;
        pthread_mutex_unlock(&s->mu);
        MHD_stop_daemon(d);
    }
    for (size_t i = 0; i < s->n_keys; i++)
        free(s->keys[i]);
    free(s->keys);
    return rc;
}
