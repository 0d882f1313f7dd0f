/*
 * worker_main.c — build/kvrope-llama: a llama.cpp worker whose KV cache is
 * kvroped. Arguments, input files, the connection and the model; the flows
 * are in worker_flows.c.
 *
 *   kvrope-llama --model M.gguf [--socket S] [--threads N] [--json] COMMAND
 *     complete --prompt-file F [--n N] [--no-cache]
 *     edit --new F2 [--old F1] [--session ID] [--refresh K] [--max-age A]
 *          [--refresh-all] [--check] [--n N]
 *     refresh --session ID [--budget N] [--cursor I]
 *     replay --history DIR [--session ID] [--refresh K] [--max-age A] [--background]
 *            [--check | --check-at I,I...] [--max-versions N] [--lines FILE]
 *     rag --prefix F --doc F [F...] [--doc F...] --query F
 *         [--layout sequential|parallel] [--check] [--n N]
 *     ppl FILE
 *     score --tokens T.bin [--kv KV.bin] [--from F] [--next-pos P]
 *           [--logits-out L.bin] [--kv-out KV.bin] [--generate I:N[,I:N...]]
 *           [--stop-token ID] [--exact]
 *     repair --tokens T.bin --prompt-len N [--kv KV.bin] [--runs S,S...] [--policy P]
 *            [--logits-out L.bin]                                   (worker_repair.c)
 *     serve [--listen HOST:PORT] [--parallel N] [--ctx-size N] ...  (worker_serve.c)
 *
 * Exit status: 0 done, 1 refused or failed (the reason on stderr, and as
 * {"error": ...} with --json), 2 usage, 3 a file (or the model) not found,
 * 4 the daemon cannot be reached — the kvrope CLI's convention. ppl and score
 * need no daemon.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "client/llama/worker.h"
#include "client/llama/worker_serve.h"

enum { EX_OK = 0, EX_FAIL = 1, EX_USAGE = 2, EX_NOTFOUND = 3, EX_CONNECT = 4 };

static const char usage[] =
"usage: kvrope-llama --model M.gguf [--socket S] [--threads N] [--json] COMMAND\n"
"  complete --prompt-file F [--n N] [--no-cache]\n"
"        longest cached prefix from kvrope, decode the rest, N greedy tokens\n"
"        (default 16), the new KV stored back; --no-cache: neither\n"
"  edit --new F2 [--old F1] [--session ID] [--refresh K] [--max-age A] [--refresh-all]\n"
"       [--check] [--n N]\n"
"        the file's session (its context in kvrope, started from F1 when missing)\n"
"        moved to F2: the token diff applied as PIE edits, only new tokens, K after\n"
"        each edit point (default 8) and tokens approximate for more than A edits\n"
"        (default 16) decoded; --refresh-all: then every approximate token, as a\n"
"        server does when idle; --check: against a full re-encode of F2.\n"
"        --session defaults to one per path of F2 (\"kvl-f-<hash>\")\n"
"  refresh --session ID [--budget N] [--cursor I]\n"
"        re-encodes up to N (default all) approximate tokens of the session,\n"
"        oldest first, then nearest token index I\n"
"  replay --history DIR [--session ID] [--refresh K] [--max-age A] [--background]\n"
"         [--check | --check-at I,I...] [--max-versions N] [--lines FILE]\n"
"        the versions DIR/v0000.txt, v0001.txt, ... (scripts/edit-history.py) as\n"
"        consecutive edits of one session (default kvl-replay, started afresh from\n"
"        v0000); --background: everything approximate\n"
"        re-encoded after each edit; --check: a full re-encode after each version\n"
"        (KL, logit error, time); --lines: one JSON object per version (- = stdout)\n"
"  rag --prefix F --doc F [F...] --query F [--layout sequential|parallel] [--check]\n"
"        documents encoded once against the prefix, assembled by kvrope, the\n"
"        query decoded on top; --check: against a full sequential encode.\n"
"        Layout: sequential (default: documents re-rotated one after another)\n"
"        or parallel (APE's shared positions; llama.cpp cannot apply its\n"
"        temperature and scale, so it agrees with a full encode less)\n"
"  ppl FILE\n"
"        bits per byte of FILE under the model (no cache)\n"
"  score --tokens T.bin [--kv KV.bin] [--from F] [--next-pos P] [--logits-out L.bin]\n"
"        [--kv-out KV.bin] [--generate I:N[,I:N...]] [--stop-token ID] [--exact]\n"
"        logits of T (int32 ids) over the cache in KV.bin (docs/llama.md), rows\n"
"        F..N-2 (default F = cached tokens), greedy tokens from the points I (no daemon);\n"
"        --exact: in-cache rows one per decode, bit-identical to a full forward;\n"
"        --kv-out: the KV llama.cpp computed for T[m..N), as a KV.bin\n"
"  repair --tokens T.bin --prompt-len N [--kv KV.bin] [--runs S,S...] [--policy P]\n"
"         [--logits-out L.bin]\n"
"        a prompt (T's first N tokens) whose KV is placed where KV.bin has cells and\n"
"        gaps elsewhere (runs of placed tokens begin at S..., default after each gap):\n"
"        gaps and the repair set computed (P: none, all, epic:K, blend:SHARE[@L],\n"
"        joined by '+'; default none), then the rest of T decoded; logits of the\n"
"        prompt's last token and of each later token but the last (no daemon)\n"
"  serve [--listen HOST:PORT] [--parallel N] [--ctx-size N] [--api-key-file F]\n"
"        llama-server's HTTP API on the model, kvroped as its cache (serve --help)\n"
"--socket: unix:PATH, a path, or HOST:PORT (default $KVROPE_SOCKET, else as kvrope's CLI);\n"
"exit 0 ok, 1 refused/failed, 2 usage, 3 file not found, 4 daemon unreachable\n";

typedef struct args {
    const char *model, *socket, *command;
    long        threads, n_gen;
    bool        json, check, no_cache, parallel, refresh_all, has_refresh;
    long        refresh, max_age, budget, cursor;
    const char *session, *history, *lines_f;
    bool        background, check_all;
    long        max_versions;
    size_t      check_at[64], n_check_at;
    const char *prompt, *old_f, *new_f, *prefix, *query, *ppl_file;
    const char *docs[256];
    size_t      n_docs;
    const char *tokens_f, *kv_f, *logits_f, *kv_out_f;
    bool        has_from, has_next_pos, has_stop, exact;
    long        prompt_len;
    const char *policy;
    size_t      runs[8192], n_runs;
    long        from, next_pos, stop;
    kvr__wk_gen_req gen[1024];
    size_t      n_points;
    int         serve_argc;      /* the words after "serve" */
    char      **serve_argv;
} args;

static bool g_json;
static const char *g_command = "";

static int die(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int die(int code, const char *fmt, ...)
{
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "kvrope-llama: %s\n", msg);
    if (g_json && code != EX_USAGE) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "command", g_command);
        cJSON_AddStringToObject(j, "error", msg);
        cJSON_AddNumberToObject(j, "exit", code);
        char *s = cJSON_PrintUnformatted(j);
        printf("%s\n", s ? s : "{}");
        free(s);
        cJSON_Delete(j);
    }
    return code;
}

static int usage_err(const char *what)
{
    fprintf(stderr, "kvrope-llama: %s\n%s", what, usage);
    return EX_USAGE;
}

static bool parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

/* "N,N,..." into out (appended after *n, at most cap in all); false on a bad
 * number, an empty item or too many. */
static bool parse_list(const char *v, size_t *out, size_t cap, size_t *n)
{
    for (const char *q = v; *q;) {
        char *end;
        errno = 0;
        unsigned long x = strtoul(q, &end, 10);
        if (errno || end == q || (*end && *end != ',') || *n == cap)
            return false;
        out[(*n)++] = (size_t)x;
        q = *end ? end + 1 : end;
    }
    return true;
}

/* The options whose value is more than a string or a number check. Each
 * gets the value v at argv[*i] and returns 0 or the exit code. */
typedef int opt_fn(args *a, const char *v, int argc, char **argv, int *i);

static int opt_session(args *a, const char *v, int argc, char **argv, int *i)
{
    (void)argc, (void)argv, (void)i;
    if (!*v || strlen(v) > KVR_ID_MAX)
        return usage_err("--session takes a context id of 1..255 bytes");
    a->session = v;
    return 0;
}

/* --doc F [F...]: the files up to the next option. */
static int opt_doc(args *a, const char *v, int argc, char **argv, int *i)
{
    (void)v;
    do {
        if (a->n_docs == sizeof a->docs / sizeof a->docs[0])
            return usage_err("too many documents (256 at most)");
        a->docs[a->n_docs++] = argv[*i];
    } while (*i + 1 < argc && argv[*i + 1][0] != '-' && ++*i);
    return 0;
}

static int opt_layout(args *a, const char *v, int argc, char **argv, int *i)
{
    (void)argc, (void)argv, (void)i;
    if (!strcmp(v, "parallel"))
        a->parallel = true;
    else if (!strcmp(v, "sequential"))
        a->parallel = false;
    else
        return usage_err("--layout is sequential or parallel");
    return 0;
}

/* --generate I:N[,I:N...]: greedy continuations of N tokens from points I. */
static int opt_generate(args *a, const char *v, int argc, char **argv, int *i)
{
    (void)argc, (void)argv, (void)i;
    for (const char *q = v; *q;) {
        char item[64];
        size_t l = strcspn(q, ",");
        long at, cnt;
        char *colon;
        if (l == 0 || l >= sizeof item)
            return usage_err("--generate takes I:N[,I:N...]");
        memcpy(item, q, l);
        item[l] = 0;
        if (!(colon = strchr(item, ':')))
            return usage_err("--generate takes I:N[,I:N...]");
        *colon = 0;
        if (!parse_int(item, 0, INT32_MAX, &at) || !parse_int(colon + 1, 1, 100000, &cnt))
            return usage_err("--generate takes I:N with I a token index and N of 1..100000");
        if (a->n_points == sizeof a->gen / sizeof a->gen[0])
            return usage_err("too many --generate points (1024 at most)");
        a->gen[a->n_points++] = (kvr__wk_gen_req){ .at = at, .n = cnt };
        q += l;
        if (*q == ',' && *++q == 0)
            return usage_err("--generate takes I:N[,I:N...]");
    }
    return 0;
}

/* One option of the table: a flag, a string kept as given, a number in
 * [lo, hi], a list of numbers (at most cap, appended at list[*n]), or a value
 * fn reads. `given`, when set, records that the option was on the command
 * line; `bad` is the usage error for a malformed or out-of-range value. */
typedef enum { OPT_FLAG, OPT_STR, OPT_NUM, OPT_LIST, OPT_FN } opt_kind;
typedef struct opt {
    const char  *name;
    opt_kind     kind;
    bool        *flag, *given;
    const char **str;
    long        *num, lo, hi;
    size_t      *list, cap, *n;
    opt_fn      *fn;
    const char  *bad;
} opt;

static int parse(int argc, char **argv, args *a)
{
    memset(a, 0, sizeof *a);
    a->n_gen = 16;
    a->parallel = false;   /* sequential keeps what a full encode gives (docs/reuse.md) */
    a->refresh = 8;
    a->budget = -1;
    a->cursor = -1;
    /* The table's entries point into *a. */
#define FLAG(nm, f)  { .name = nm, .kind = OPT_FLAG, .flag = &a->f }
#define STR(nm, f)   { .name = nm, .kind = OPT_STR, .str = &a->f }
#define NUM(nm, f, l, h, b)                                                     \
    { .name = nm, .kind = OPT_NUM, .num = &a->f, .lo = l, .hi = h, .bad = b }
#define NUM_HAS(nm, f, l, h, b, g)                                              \
    { .name = nm, .kind = OPT_NUM, .num = &a->f, .lo = l, .hi = h, .bad = b, .given = &a->g }
#define LIST(nm, f, b)                                                          \
    { .name = nm, .kind = OPT_LIST, .list = a->f, .cap = sizeof a->f / sizeof a->f[0], \
      .n = &a->n_##f, .bad = b }
#define FN(nm, f)    { .name = nm, .kind = OPT_FN, .fn = f }
    const opt opts[] = {
        STR("--model", model),
        STR("--socket", socket),
        NUM("--threads", threads, 1, 256, "--threads takes a count of 1..256"),
        FLAG("--json", json),
        STR("--prompt-file", prompt),
        NUM("--n", n_gen, 1, 100000, "--n takes a count of 1..100000"),
        FLAG("--no-cache", no_cache),
        STR("--old", old_f),
        STR("--new", new_f),
        NUM_HAS("--refresh", refresh, 0, 1 << 20, "--refresh takes a token count", has_refresh),
        FN("--session", opt_session),
        NUM("--max-age", max_age, 1, 255, "--max-age takes a count of edits, 1..255"),
        FLAG("--refresh-all", refresh_all),
        STR("--history", history),
        STR("--lines", lines_f),
        FLAG("--background", background),
        NUM("--max-versions", max_versions, 2, INT32_MAX,
            "--max-versions takes a count of 2 or more"),
        LIST("--check-at", check_at, "--check-at takes up to 64 version numbers I,I,..."),
        NUM("--budget", budget, 0, INT32_MAX, "--budget takes a token count"),
        NUM("--cursor", cursor, 0, INT32_MAX, "--cursor takes a token index"),
        FLAG("--check", check),
        STR("--prefix", prefix),
        STR("--query", query),
        FN("--doc", opt_doc),
        FN("--layout", opt_layout),
        NUM("--prompt-len", prompt_len, 1, INT32_MAX,
            "--prompt-len takes a token count of 1 or more"),
        STR("--policy", policy),
        LIST("--runs", runs, "--runs takes up to 8192 token indexes S,S,..."),
        FLAG("--exact", exact),
        STR("--tokens", tokens_f),
        STR("--kv", kv_f),
        STR("--logits-out", logits_f),
        STR("--kv-out", kv_out_f),
        NUM_HAS("--from", from, 0, INT32_MAX, "--from takes a token index", has_from),
        NUM_HAS("--next-pos", next_pos, 0, INT32_MAX,
                "--next-pos takes a position of 0..2147483647", has_next_pos),
        NUM_HAS("--stop-token", stop, 0, INT32_MAX, "--stop-token takes a token id", has_stop),
        FN("--generate", opt_generate),
    };
#undef FLAG
#undef STR
#undef NUM
#undef NUM_HAS
#undef LIST
#undef FN
    char msg[256];
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        const opt *o = NULL;
        for (size_t k = 0; k < sizeof opts / sizeof opts[0] && !o; k++)
            if (!strcmp(s, opts[k].name))
                o = &opts[k];
        if (o) {
            if (o->kind == OPT_FLAG) {
                *o->flag = true;
                continue;
            }
            if (!v) {
                snprintf(msg, sizeof msg, "%s needs a value", s);
                return usage_err(msg);
            }
            i++;
            int rc = 0;
            if (o->kind == OPT_STR)
                *o->str = v;
            else if (o->kind == OPT_NUM && !parse_int(v, o->lo, o->hi, o->num))
                return usage_err(o->bad);
            else if (o->kind == OPT_LIST && !parse_list(v, o->list, o->cap, o->n))
                return usage_err(o->bad);
            else if (o->kind == OPT_FN && (rc = o->fn(a, v, argc, argv, &i)))
                return rc;
            if (o->given)
                *o->given = true;
        } else if (!strcmp(s, "--help") || !strcmp(s, "-h")) {
            fputs(usage, stdout);
            exit(0);
        } else if (s[0] == '-' && s[1]) {
            snprintf(msg, sizeof msg, "unknown option %s", s);
            return usage_err(msg);
        } else if (!a->command) {
            a->command = s;
            if (!strcmp(s, "serve")) {     /* the rest is the server's */
                a->serve_argc = argc - i - 1;
                a->serve_argv = argv + i + 1;
                for (int k = 0; k < a->serve_argc; k++)   /* help needs no model */
                    if (!strcmp(a->serve_argv[k], "--help") || !strcmp(a->serve_argv[k], "-h"))
                        exit(kvr__wk_serve_main(NULL, NULL, NULL, 0, 1, a->serve_argv + k));
                break;
            }
        } else if (!strcmp(a->command, "ppl") && !a->ppl_file) {
            a->ppl_file = s;
        } else {
            snprintf(msg, sizeof msg, "unexpected argument %s", s);
            return usage_err(msg);
        }
    }
    if (!a->command)
        return usage_err("no command");
    /* Each command and what it cannot do without. */
    const struct { const char *name; bool ready; const char *needs; } cmds[] = {
        { "complete", a->prompt != NULL, "complete needs --prompt-file F" },
        { "edit", a->new_f != NULL, "edit needs --new F2 (and --old F1 the first time)" },
        { "rag", a->prefix && a->query && a->n_docs,
          "rag needs --prefix F, at least one --doc F and --query F" },
        { "ppl", a->ppl_file != NULL, "ppl needs a FILE" },
        { "score", a->tokens_f != NULL, "score needs --tokens T.bin" },
        { "repair", a->tokens_f && a->prompt_len,
          "repair needs --tokens T.bin and --prompt-len N" },
        { "refresh", a->session != NULL, "refresh needs --session ID" },
        { "replay", a->history != NULL, "replay needs --history DIR" },
        { "serve", true, NULL },
    };
    size_t k = 0;
    while (k < sizeof cmds / sizeof cmds[0] && strcmp(a->command, cmds[k].name))
        k++;
    if (k == sizeof cmds / sizeof cmds[0]) {
        snprintf(msg, sizeof msg, "unknown command %s", a->command);
        return usage_err(msg);
    }
    if (!a->model)
        return usage_err("--model M.gguf is required");
    if (!cmds[k].ready)
        return usage_err(cmds[k].needs);
    return 0;
}

/* The daemon's address: --socket as given, else $KVROPE_SOCKET, else where
 * kvrope's CLI looks. */
static void socket_path(const char *given, char *buf, size_t cap)
{
    const char *env = getenv("KVROPE_SOCKET"), *xdg = getenv("XDG_RUNTIME_DIR");
    if (given)
        snprintf(buf, cap, "%s", given);
    else if (env && *env)
        snprintf(buf, cap, "%s", env);
    else if (xdg && *xdg)
        snprintf(buf, cap, "%s/kvrope/kvroped.sock", xdg);
    else if (geteuid() == 0)
        snprintf(buf, cap, "/run/kvrope/kvroped.sock");
    else
        snprintf(buf, cap, "/tmp/kvrope-%u/kvroped.sock", (unsigned)getuid());
}

typedef struct text {
    char  *data;
    size_t len;
} text;

/* Reads a whole file; exit code on failure (message printed). */
static int read_file(const char *what, const char *path, text *t)
{
    t->data = NULL;
    t->len = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return die(errno == ENOENT ? EX_NOTFOUND : EX_FAIL, "%s %s: %s", what, path,
                   strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) < 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return die(EX_FAIL, "%s %s: not a regular file", what, path);
    }
    size_t cap = (size_t)sb.st_size + 1, n = 0;
    char *d = malloc(cap);
    if (!d) {
        fclose(f);
        return die(EX_FAIL, "%s %s: out of memory", what, path);
    }
    for (;;) {
        size_t r = fread(d + n, 1, cap - n, f);
        n += r;
        if (n < cap)
            break;
        char *nd = realloc(d, cap * 2);
        if (!nd) {
            free(d);
            fclose(f);
            return die(EX_FAIL, "%s %s: out of memory", what, path);
        }
        d = nd;
        cap *= 2;
    }
    int e = ferror(f);
    fclose(f);
    if (e) {
        free(d);
        return die(EX_FAIL, "%s %s: read error", what, path);
    }
    t->data = d;
    t->len = n;
    return 0;
}

static int tokenize(kvr__wk_env *e, const text *t, bool bos, const char *what, const char *path,
                    int32_t **out, size_t *n)
{
    if (kvr__wk_lm_tokenize(e->lm, t->data, t->len, bos, out, n, e->err, sizeof e->err) < 0)
        return die(EX_FAIL, "%s %s: %s", what, path, e->err);
    return 0;
}

/* One session per file: "kvl-f-<hash of the model and the file's real path>". */
static void file_session(const kvr__wk_env *e, const char *path, char *out, size_t cap)
{
    char *rp = realpath(path, NULL);
    const char *p = rp ? rp : path;
    uint64_t h = 1469598103934665603ull ^ e->fingerprint;
    for (const unsigned char *q = (const unsigned char *)p; *q; q++)
        h = (h ^ *q) * 1099511628211ull;
    snprintf(out, cap, "kvl-f-%016llx", (unsigned long long)h);
    free(rp);
}

static int exit_of(const kvr__wk_env *e)
{
    if (e->kv_code == KVR_ESYS || e->kv_code == KVR_ECLOSED)
        return EX_CONNECT;
    if (e->kv_code == KVR_ENOCTX || e->kv_code == KVR_ENOMODEL)
        return EX_NOTFOUND;
    return EX_FAIL;
}

/* What a command's environment holds: the model, its buffers, the profile
 * and the connection. */
static void env_release(kvr__wk_env *e)
{
    kvr__wk_lm_destroy(e->lm);
    kvr__wk_env_bufs_free(e);
    free(e->profile);
    kvr_client_close(e->kc);
}

int main(int argc, char **argv)
{
    args a;
    int rc = parse(argc, argv, &a);
    if (rc)
        return rc;
    g_json = a.json;
    g_command = a.command;
    if (!strcmp(a.command, "serve")) {
        char ssock[512];
        socket_path(a.socket, ssock, sizeof ssock);
        kvr__wk_env se;
        memset(&se, 0, sizeof se);
        rc = kvr__wk_serve_main(&se, a.model, ssock, (int)a.threads, a.serve_argc, a.serve_argv);
        env_release(&se);
        return rc;
    }
    bool is_ppl = !strcmp(a.command, "ppl"), is_score = !strcmp(a.command, "score");
    bool is_repair = !strcmp(a.command, "repair");
    bool offline = is_ppl || is_score || is_repair;      /* no daemon */

    /* Everything released at `done`, whatever the way out. */
    text files[260];
    memset(files, 0, sizeof files);
    int32_t *tk[260] = { 0 };
    size_t ntk[260] = { 0 };
    kvr__wk_env e;
    memset(&e, 0, sizeof e);
    e.n_gen = (int)a.n_gen;
    kvr__wk_report rep;
    kvr__wk_rep_init(&rep, a.command);
    e.rep = &rep;

    /* Inputs first: a missing file is reported before anything is loaded. */
    const char *names[260], *what[260];
    size_t nf = 0;
#define ADD(w, p)            \
    do {                     \
        what[nf] = (w);      \
        names[nf++] = (p);   \
    } while (0)
    if (!strcmp(a.command, "complete"))
        ADD("prompt file", a.prompt);
    if (!strcmp(a.command, "edit")) {
        ADD("new file", a.new_f);
        if (a.old_f)
            ADD("old file", a.old_f);
    }
    if (!strcmp(a.command, "rag")) {
        ADD("prefix file", a.prefix);
        ADD("query file", a.query);
        for (size_t i = 0; i < a.n_docs; i++)
            ADD("document", a.docs[i]);
    }
    if (is_ppl)
        ADD("file", a.ppl_file);
    if (is_score || is_repair) {
        ADD("token file", a.tokens_f);
        if (a.kv_f)
            ADD("KV file", a.kv_f);
    }
#undef ADD
    for (size_t i = 0; i < nf; i++)
        if ((rc = read_file(what[i], names[i], &files[i])) != 0)
            goto done;
    struct stat sb;
    if (stat(a.model, &sb) < 0) {
        rc = die(errno == ENOENT ? EX_NOTFOUND : EX_FAIL, "model %s: %s", a.model,
                 strerror(errno));
        goto done;
    }

    char sock[512];
    if (!offline) {
        socket_path(a.socket, sock, sizeof sock);
        if (kvr_client_connect(&e.kc, sock, NULL) < 0) {
            rc = die(EX_CONNECT, "cannot connect to kvroped at %s: %s", sock,
                     kvr_client_last_error(NULL));
            goto done;
        }
        int r = kvr_client_ping(e.kc, NULL);
        if (r < 0) {
            rc = die(EX_CONNECT, "kvroped at %s does not answer: %s", sock,
                     kvr_client_last_error(e.kc));
            goto done;
        }
    }
    double t_load0 = kvr__wk_now_ms();
    if (kvr__wk_lm_load(&e.lm, a.model, (int)a.threads, e.err, sizeof e.err) < 0) {
        rc = die(EX_FAIL, "%s", e.err);
        goto done;
    }
    double t_model = kvr__wk_now_ms() - t_load0;
    /* ppl and score run without the profile if the bridge does not know the model. */
    if (kvr__wk_profile(&e, a.model) < 0 && !offline) {
        rc = die(EX_FAIL, "%s", e.err);
        goto done;
    }
    if (!offline && kvr__wk_register(&e, a.model) < 0) {
        rc = die(exit_of(&e) == EX_CONNECT ? EX_CONNECT : EX_FAIL, "%s", e.err);
        goto done;
    }
    const kvr__wk_lm_info *in = kvr__wk_lm_info_get(e.lm);
    kvr__wk_rep_str(&rep, NULL, "model", a.model);
    if (!offline)
        kvr__wk_rep_str(&rep, NULL, "kvrope_model", e.model);
    kvr__wk_rep_num(&rep, "timings_ms", "model_load", t_model);
    kvr__wk_rep_line(&rep, "model: %s (%s, %u layers, %u KV heads x %u, vocab %u)%s%s", a.model,
                    in->arch, in->n_layer, in->n_head_kv, in->head_dim, in->n_vocab,
                    offline ? "" : " as kvrope model ", offline ? "" : e.model);

    int r = 0;
    if (!strcmp(a.command, "complete")) {
        if ((rc = tokenize(&e, &files[0], in->add_bos, "prompt file", a.prompt, &tk[0], &ntk[0])))
            goto done;
        r = kvr__wk_complete(&e, tk[0], ntk[0], !a.no_cache);
    } else if (!strcmp(a.command, "edit")) {
        if ((rc = tokenize(&e, &files[0], in->add_bos, "new file", a.new_f, &tk[0], &ntk[0])) ||
            (a.old_f &&
             (rc = tokenize(&e, &files[1], in->add_bos, "old file", a.old_f, &tk[1], &ntk[1]))))
            goto done;
        char sid[KVR_ID_MAX + 1];
        if (a.session)
            snprintf(sid, sizeof sid, "%s", a.session);
        else
            file_session(&e, a.new_f, sid, sizeof sid);
        kvr__wk_edit_opts eo = { .session = sid, .refresh = (uint32_t)a.refresh,
                                .max_age = (uint32_t)a.max_age, .refresh_all = a.refresh_all,
                                .check = a.check };
        r = kvr__wk_edit(&e, a.old_f ? tk[1] : NULL, ntk[1], tk[0], ntk[0], &eo);
    } else if (!strcmp(a.command, "replay")) {
        FILE *lf = NULL;
        if (a.lines_f && !(lf = strcmp(a.lines_f, "-") ? fopen(a.lines_f, "w") : stdout)) {
            rc = die(EX_FAIL, "--lines %s: %s", a.lines_f, strerror(errno));
            goto done;
        }
        kvr__wk_replay_opts ro = {
            .dir = a.history, .max_versions = (size_t)a.max_versions,
            .sync = { .session = a.session ? a.session : "kvl-replay",
                      .refresh = (uint32_t)a.refresh, .max_age = (uint32_t)a.max_age },
            .background = a.background, .check_all = a.check, .check_at = a.check_at,
            .n_check_at = a.n_check_at, .lines = lf };
        r = kvr__wk_replay(&e, &ro);
        if (lf && lf != stdout)
            fclose(lf);
    } else if (!strcmp(a.command, "refresh")) {
        r = kvr__wk_refresh_cmd(&e, a.session, a.budget < 0 ? SIZE_MAX : (size_t)a.budget,
                               a.cursor < 0 ? SIZE_MAX : (size_t)a.cursor);
    } else if (!strcmp(a.command, "rag")) {
        if ((rc = tokenize(&e, &files[0], in->add_bos, "prefix file", a.prefix, &tk[0], &ntk[0])) ||
            (rc = tokenize(&e, &files[1], false, "query file", a.query, &tk[1], &ntk[1])))
            goto done;
        for (size_t i = 0; i < a.n_docs; i++)
            if ((rc = tokenize(&e, &files[2 + i], false, "document", a.docs[i], &tk[2 + i],
                               &ntk[2 + i])))
                goto done;
        r = kvr__wk_rag(&e, tk[0], ntk[0], (const int32_t *const *)(tk + 2), ntk + 2, a.n_docs,
                       tk[1], ntk[1], a.parallel, a.check);
    } else if (is_score) {
        kvr__wk_score_opts so = {
            .tokens = (const uint8_t *)files[0].data, .tokens_len = files[0].len,
            .kv = a.kv_f ? (const uint8_t *)files[1].data : NULL,
            .kv_len = a.kv_f ? files[1].len : 0,
            .has_from = a.has_from, .from = a.from,
            .has_next_pos = a.has_next_pos, .next_pos = a.next_pos,
            .has_stop = a.has_stop, .stop = (int32_t)a.stop, .exact = a.exact,
            .logits_out = a.logits_f, .kv_out = a.kv_out_f, .gen = a.gen, .n_gen = a.n_points };
        r = kvr__wk_score(&e, &so);
    } else if (is_repair) {
        kvr__wk_repair_cmd_opts ro = {
            .tokens = (const uint8_t *)files[0].data, .tokens_len = files[0].len,
            .kv = a.kv_f ? (const uint8_t *)files[1].data : NULL,
            .kv_len = a.kv_f ? files[1].len : 0, .n_prompt = (size_t)a.prompt_len,
            .run_starts = a.runs, .n_run_starts = a.n_runs, .policy = a.policy,
            .logits_out = a.logits_f };
        r = kvr__wk_repair_cmd(&e, &ro);
    } else {
        if ((rc = tokenize(&e, &files[0], in->add_bos, "file", a.ppl_file, &tk[0], &ntk[0])))
            goto done;
        r = kvr__wk_ppl(&e, tk[0], ntk[0], files[0].len, in->add_bos);
    }
    kvr__wk_rep_num(&rep, "timings_ms", "warmup", kvr__wk_lm_warmup_ms(e.lm));
    if (r < 0)
        rc = die(exit_of(&e), "%s: %s", a.command, e.err);
    else
        kvr__wk_rep_print(&rep, a.json, stdout);
done:
    for (size_t i = 0; i < 260; i++) {
        free(tk[i]);
        free(files[i].data);
    }
    kvr__wk_rep_free(&rep);
    env_release(&e);
    return rc;
}
