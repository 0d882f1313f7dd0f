/*
 * config.c — kvroped's options: defaults, `--flag value` / `--flag=value`
 * parsing, the `key = value` config file (same names as the long flags), and
 * the --help text. The config is a plain value; nothing here touches libuv,
 * so every rule can be tested without a loop.
 *
 * Precedence: built-in defaults < --config FILE < command-line flags.
 * The file is refused whole, with the line number, for a line holding a
 * NUL byte, a key set twice (both lines named) or any bad value; sizes
 * are at most 1024T (SIZE_OPT_MAX), so nothing computed from them overflows.
 * Every option is one row of OPTS: the file and the command line both set
 * through it, so a name the one takes the other takes too.
 */
#include "daemon/daemon_internal.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#define GIB (1024ull * 1024ull * 1024ull)
#define MIB (1024ull * 1024ull)

/* A refused option: KVR_EINVAL with the message. */
static void seterr(kvr_error *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void seterr(kvr_error *err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvr_error_vset(err, KVR_EINVAL, fmt, ap);
    va_end(ap);
}

void kvr_daemon_default_socket(char *buf, size_t cap)
{
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (xdg && xdg[0])
        snprintf(buf, cap, "%s/kvrope/kvroped.sock", xdg);
    else if (geteuid() == 0)
        snprintf(buf, cap, "/run/kvrope/kvroped.sock");
    else
        snprintf(buf, cap, "/tmp/kvrope-%u/kvroped.sock", (unsigned)getuid());
}

void kvr_daemon_config_init(kvr_daemon_config *c)
{
    memset(c, 0, sizeof *c);
    uint64_t cap = 4 * GIB;
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psz > 0) {
        uint64_t ram = (uint64_t)pages * (uint64_t)psz;
        if (ram / 4 < cap)
            cap = ram / 4;
    }
    c->max_memory = cap;
    c->max_connections = 1024;
    c->max_frame = 1u << 20;
    c->max_conn_buffer = 256 * MIB;
    c->max_drain = 16 * MIB;
    c->max_regions = 64;
    c->max_region_bytes = (uint64_t)64 << 30;
    c->block_tokens = 0;
    c->threads = 0;
    c->io_timeout = 30;
    c->auth_timeout = 5;
    c->max_unauth_connections = 64;
    c->min_rate = 1 * MIB;
    c->max_msg_buffers = 0;
    c->max_models = 1024;
    c->max_contexts = 0;
    c->log_level = KVR_LOG_INFO;
}

int kvr_parse_size(const char *s, uint64_t *out)
{
    if (!s)
        return KVR_EINVAL;
    while (isspace((unsigned char)*s))
        s++;
    if (!isdigit((unsigned char)*s))
        return KVR_EINVAL;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno)
        return KVR_EINVAL;
    uint64_t mul = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K': mul = 1024ull; end++; break;
    case 'M': mul = MIB; end++; break;
    case 'G': mul = GIB; end++; break;
    case 'T': mul = 1024ull * GIB; end++; break;
    default: break;
    }
    if (mul != 1 && (*end == 'i' || *end == 'I'))
        end++;
    if (*end == 'B' || *end == 'b')
        end++;
    while (isspace((unsigned char)*end))
        end++;
    if (*end)
        return KVR_EINVAL;
    if (v > UINT64_MAX / mul)
        return KVR_EINVAL;
    *out = (uint64_t)v * mul;
    return 0;
}

/* The largest size any option takes (1 PiB): no machine has more, and
 * the sums and products the daemon makes of these values cannot
 * overflow below it (max-memory = 2^64-1 was once accepted). */
#define SIZE_OPT_MAX (1024ull * 1024ull * GIB)

/* A size option's value, within [lo, SIZE_OPT_MAX]: KVR_EINVAL otherwise,
 * with the range in err. *out is written only on success (a refused value
 * leaves the option as it was). */
static int parse_size_opt(const char *key, const char *s, uint64_t lo, uint64_t *out,
                          kvr_error *err)
{
    uint64_t v;
    if (kvr_parse_size(s, &v) < 0)
        return KVR_EINVAL;    /* the caller's "invalid value" */
    if (v < lo || v > SIZE_OPT_MAX) {
        seterr(err, "--%s %s is out of range: %llu to %llu bytes (1024T)", key, s,
               (unsigned long long)lo, SIZE_OPT_MAX);
        return KVR_ERANGE;
    }
    *out = v;
    return 0;
}

static int parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
    uint64_t v;
    if (kvr_parse_size(s, &v) < 0 || v < lo || v > hi)
        return KVR_EINVAL;
    *out = (uint32_t)v;
    return 0;
}

/* A switch given a value (the config file's `share-all = yes`): 1, true,
 * yes or on; 0, false, no or off. */
static int parse_bool(const char *v, bool *out)
{
    if (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "yes") || !strcmp(v, "on"))
        *out = true;
    else if (!strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "no") || !strcmp(v, "off"))
        *out = false;
    else
        return KVR_EINVAL;
    return 0;
}

static int copy_str(char *dst, size_t cap, const char *v)
{
    size_t n = strlen(v);
    if (n >= cap)
        return KVR_EINVAL;
    memcpy(dst, v, n + 1);
    return 0;
}

/* The options that do more than store a checked value. Each returns 0,
 * KVR_ERANGE with err saying why, or another negative code for the
 * caller's "invalid value". */
static int set_socket(kvr_daemon_config *c, const char *key, const char *v, kvr_error *err)
{
    (void)key;
    int rc = copy_str(c->socket_path, sizeof c->socket_path, v);
    if (rc == 0 && strcmp(v, "none") && strlen(v) >= 108) {
        seterr(err, "--socket: path longer than 107 bytes: %s", v);
        return KVR_ERANGE;
    }
    return rc;
}

static int set_prefault(kvr_daemon_config *c, const char *key, const char *v, kvr_error *err)
{
    if (!strcmp(v, "cap") || !strcmp(v, "max")) {
        c->prefault = UINT64_MAX;
        return 0;
    }
    return parse_size_opt(key, v, 0, &c->prefault, err);
}

static int set_log_level(kvr_daemon_config *c, const char *key, const char *v, kvr_error *err)
{
    (void)key;
    (void)err;
    return kvr_log_level_parse(v, &c->log_level);
}

static int set_log_format(kvr_daemon_config *c, const char *key, const char *v, kvr_error *err)
{
    (void)key;
    (void)err;
    return kvr_log_format_parse(v, &c->log_format);
}

static int set_disk_engine(kvr_daemon_config *c, const char *key, const char *v, kvr_error *err)
{
    (void)key;
    (void)err;
    if (!strcmp(v, "auto"))
        c->disk_engine = 0;
    else if (!strcmp(v, "uring") || !strcmp(v, "io_uring"))
        c->disk_engine = 1;
    else if (!strcmp(v, "posix"))
        c->disk_engine = 2;
    else
        return KVR_EINVAL;
    return 0;
}

/* 0 (max-memory / 8) or at least 64K. */
static int set_max_msg_buffers(kvr_daemon_config *c, const char *key, const char *v,
                               kvr_error *err)
{
    uint64_t sz;
    int rc = parse_size_opt(key, v, 0, &sz, err);
    if (rc == 0 && sz != 0 && sz < 64 * 1024)
        rc = KVR_EINVAL;
    if (rc == 0)
        c->max_msg_buffers = sz;
    return rc;
}

/* A count like the others, kept in a 64-bit field. */
static int set_max_contexts(kvr_daemon_config *c, const char *key, const char *v,
                            kvr_error *err)
{
    (void)key;
    (void)err;
    uint32_t n32;
    int rc = parse_u32(v, 0, 100000000, &n32);
    if (rc == 0)
        c->max_contexts = n32;
    return rc;
}

/* One option: its long flag's name (the config file's key) and how its
 * value is kept: a string of at most cap - 1 bytes, a size in [lo,
 * SIZE_OPT_MAX], a count in [lo, hi], a switch, or what fn does. The field
 * is at `off` in kvr_daemon_config. */
typedef enum { OPT_STR, OPT_SIZE, OPT_COUNT, OPT_BOOL, OPT_FN } opt_kind;
typedef struct opt {
    const char *name;
    opt_kind    kind;
    size_t      off, cap;
    uint64_t    lo, hi;
    int       (*fn)(kvr_daemon_config *c, const char *key, const char *v, kvr_error *err);
} opt;

/* The offset of field f, which must be of type T: comparing the pointers
 * refuses any other type at compile time, and sizeof evaluates nothing. */
#define AT(f, T) (offsetof(kvr_daemon_config, f) + \
                  0 * sizeof((T *)0 == &((kvr_daemon_config *)0)->f))
#define STR(nm, f)          { nm, OPT_STR, AT(f[0], char), sizeof ((kvr_daemon_config *)0)->f, \
                              0, 0, NULL }
#define SIZE(nm, f, l)      { nm, OPT_SIZE, AT(f, uint64_t), 0, l, SIZE_OPT_MAX, NULL }
#define COUNT(nm, f, l, h)  { nm, OPT_COUNT, AT(f, uint32_t), 0, l, h, NULL }
#define BOOL(nm, f)         { nm, OPT_BOOL, AT(f, bool), 0, 0, 0, NULL }
#define FN(nm, fn)          { nm, OPT_FN, 0, 0, 0, 0, fn }
static const opt OPTS[] = {
    FN("socket", set_socket),
    STR("listen", listen),
    STR("auth-token-file", auth_token_file),
    SIZE("max-memory", max_memory, MIB),
    FN("prefault", set_prefault),
    COUNT("idle-purge", idle_purge, 0, 7u * 86400u),
    SIZE("max-memory-per-model", max_memory_per_model, 0),
    COUNT("max-connections", max_connections, 1, 1000000),
    COUNT("max-frame", max_frame, 64, KVR_MAX_FRAME_CEILING),
    SIZE("max-conn-buffer", max_conn_buffer, 4096),
    SIZE("max-drain", max_drain, 0),
    COUNT("max-regions", max_regions, 0, 1u << 16),
    COUNT("max-regions-total", max_regions_total, 0, 1u << 30),
    SIZE("max-region-bytes", max_region_bytes, 0),
    COUNT("block-tokens", block_tokens, 1, 1u << 20),
    COUNT("threads", threads, 1, 1024),
    COUNT("io-timeout", io_timeout, 0, 86400),
    COUNT("auth-timeout", auth_timeout, 0, 3600),
    COUNT("max-unauth-connections", max_unauth_connections, 1, 1000000),
    FN("log-level", set_log_level),
    FN("log-format", set_log_format),
    STR("log-file", log_file),
    STR("metrics-listen", metrics_listen),
    STR("disk-dir", disk_dir),
    SIZE("disk-max", disk_max, 0),
    FN("disk-engine", set_disk_engine),
    STR("remote-tier", remote_tier),
    STR("remote-auth-file", remote_auth_file),
    STR("remote-key-file", remote_key_file),
    BOOL("share-all", share_all),
    SIZE("min-rate", min_rate, 0),
    FN("max-msg-buffers", set_max_msg_buffers),
    COUNT("max-models", max_models, 1, 1000000),
    FN("max-contexts", set_max_contexts),
    BOOL("persist-all", persist_all),
};
#undef AT
#undef STR
#undef SIZE
#undef COUNT
#undef BOOL
#undef FN

static const opt *find_opt(const char *name)
{
    for (size_t i = 0; i < sizeof OPTS / sizeof OPTS[0]; i++)
        if (!strcmp(name, OPTS[i].name))
            return &OPTS[i];
    return NULL;
}

int kvr_daemon_config_set(kvr_daemon_config *c, const char *key, const char *v,
                          kvr_error *err)
{
    const opt *o = find_opt(key);
    if (!o) {
        seterr(err, "unknown option '%s' (see kvroped --help)", key);
        return KVR_EINVAL;
    }
    char *field = (char *)c + o->off;
    int rc = 0;
    switch (o->kind) {
    case OPT_STR:   rc = copy_str(field, o->cap, v); break;
    case OPT_SIZE:  rc = parse_size_opt(key, v, o->lo, (uint64_t *)(void *)field, err); break;
    case OPT_COUNT: rc = parse_u32(v, (uint32_t)o->lo, (uint32_t)o->hi,
                                   (uint32_t *)(void *)field); break;
    case OPT_BOOL:  rc = parse_bool(v, (bool *)(void *)field); break;
    case OPT_FN:    rc = o->fn(c, key, v, err); break;
    }
    if (rc == KVR_ERANGE)
        return KVR_EINVAL;    /* the option said why */
    if (rc < 0) {
        seterr(err, "invalid value for --%s: '%s' (see kvroped --help)", key, v);
        rc = KVR_EINVAL;
    }
    return rc;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        s[--n] = '\0';
    return s;
}

/* A key the file set, and where (duplicates are refused, naming both). */
typedef struct seen_key {
    char key[40];
    int  line;
} seen_key;

int kvr_daemon_config_load_file(kvr_daemon_config *c, const char *path,
                                kvr_error *err)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return kvr_error_sys(err, KVR_EIO, errno, "cannot open config file %s", path);
    /* Every option at most once: known keys are all shorter than 40 bytes
     * and fewer than 64 (an unknown one is refused before it is kept). */
    seen_key seen[64];
    size_t n_seen = 0;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int lineno = 0, rc = 0;
    while ((len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        /* A NUL would cut the value short where C reads it. */
        if (memchr(line, '\0', (size_t)len)) {
            seterr(err, "%s:%d: the line holds a NUL byte (a binary file?)", path, lineno);
            rc = KVR_EINVAL;
            break;
        }
        if (len > 4096) {
            seterr(err, "%s:%d: line longer than 4096 bytes", path, lineno);
            rc = KVR_EINVAL;
            break;
        }
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *s = trim(line);
        if (!*s)
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            seterr(err, "%s:%d: expected 'key = value'", path, lineno);
            rc = KVR_EINVAL;
            break;
        }
        *eq = '\0';
        char *key = trim(s), *val = trim(eq + 1);
        if (!strcmp(key, "config")) {
            seterr(err, "%s:%d: 'config' cannot be nested", path, lineno);
            rc = KVR_EINVAL;
            break;
        }
        kvr_error e2 = { 0 };
        if (kvr_daemon_config_set(c, key, val, &e2) < 0) {
            seterr(err, "%s:%d: %s", path, lineno, e2.msg);
            rc = KVR_EINVAL;
            break;
        }
        size_t i = 0;
        while (i < n_seen && strcmp(seen[i].key, key))
            i++;
        if (i < n_seen) {
            seterr(err, "%s:%d: '%s' is set again (first on line %d): each option may appear "
                   "once", path, lineno, key, seen[i].line);
            rc = KVR_EINVAL;
            break;
        }
        if (n_seen < sizeof seen / sizeof seen[0] && strlen(key) < sizeof seen[0].key) {
            snprintf(seen[n_seen].key, sizeof seen[n_seen].key, "%s", key);
            seen[n_seen++].line = lineno;
        }
    }
    free(line);
    fclose(f);
    return rc;
}

static const char *HELP =
"Usage: kvroped [OPTIONS]\n"
"\n"
"kvroped is the kvrope daemon: it stores transformer KV caches and serves them\n"
"over a Unix socket (default) or TCP, re-rotating RoPE keys to new positions.\n"
"It runs in the foreground and logs to stderr; stop it with Ctrl-C or SIGTERM\n"
"(in-flight requests finish, the socket file is removed, exit status 0).\n"
"\n"
"Options (every option can also be set in a --config file as `name = value`):\n"
"  --socket PATH          Unix socket to listen on (created mode 0600; a live\n"
"                         socket is never clobbered, a stale one is replaced).\n"
"                         'none' disables it. Default:\n"
"                         $XDG_RUNTIME_DIR/kvrope/kvroped.sock, or as root\n"
"                         /run/kvrope/kvroped.sock, else\n"
"                         /tmp/kvrope-$UID/kvroped.sock (directory created 0700)\n"
"  --listen HOST:PORT     also listen on TCP. Loopback (127.0.0.1, [::1],\n"
"                         localhost) needs nothing more; any other address\n"
"                         requires --auth-token-file.\n"
"  --auth-token-file FILE shared secret: TCP clients must send Auth with the\n"
"                         file's content (trailing newline ignored) first;\n"
"                         refused unless only its owner can read it (0600)\n"
"  --max-memory SIZE      memory cap for the store, e.g. 4G, 512M or bytes\n"
"                         (default: 4G or a quarter of RAM, whichever is less)\n"
"  --max-connections N    simultaneous connections (default 1024); TCP clients\n"
"                         that still owe Auth count against\n"
"                         --max-unauth-connections instead\n"
"  --max-unauth-connections N\n"
"                         TCP connections that have not authenticated yet\n"
"                         (with --auth-token-file; default 64), so clients\n"
"                         without the token cannot lock out local workers\n"
"  --auth-timeout SECONDS close a connection that has not authenticated\n"
"                         within this time (default 5; 0 = never)\n"
"  --io-timeout SECONDS   close a connection that makes no progress for this\n"
"                         long while sending a frame (a put's payload is\n"
"                         then aborted) or while a reply waits to be read\n"
"                         (default 30; 0 = never). Idle connections between\n"
"                         requests are kept.\n"
"  --max-frame BYTES      largest protobuf message in a frame (default 1M,\n"
"                         at most 64M). Decoding one takes up to ~20x its\n"
"                         size, so the daemon lowers the limit to keep that\n"
"                         under a quarter of --max-memory; before Auth a\n"
"                         frame may carry 4 KiB and no payload.\n"
"                         Payloads are bounded by --max-memory\n"
"  --max-conn-buffer SIZE queued response bytes per connection before the\n"
"                         daemon stops reading from it (default 256M)\n"
"  --max-drain SIZE       payload bytes read and discarded after a refused put\n"
"                         so the connection stays usable; larger payloads\n"
"                         close the connection (default 16M)\n"
"  --block-tokens N       tokens per KV block (default: the store's, 64)\n"
"  --threads N            worker threads for conversions/rotations\n"
"                         (default: libuv's, 4)\n"
"  --log-level LEVEL      debug | info | warn | error (default info)\n"
"  --disk-dir DIR         disk tier: evicted blocks spill to DIR instead of\n"
"                         being dropped, and persistent contexts are logged\n"
"                         there and recovered at start (default: none)\n"
"  --disk-max SIZE        bound on the disk tier's data + log (default: none);\n"
"                         when full, eviction drops as without a disk\n"
"  --disk-engine ENGINE   auto | uring | posix (default auto: io_uring, or\n"
"                         pread/pwrite when the kernel refuses it); posix\n"
"                         forces the plain fallback\n"
;

/* Split up: C11 compilers need only take 4095-byte literals. */
static const char *HELP_LIMITS =
"  --persist-all          make every context persistent (else per put:\n"
"                         Put.persist); needs --disk-dir. In a config file:\n"
"                         persist-all = true\n"
"  --min-rate BYTES       a frame must arrive within --io-timeout plus its\n"
"                         size at this rate (default 1M per second; 0 = no\n"
"                         deadline), else the connection is closed and an\n"
"                         open put/edit aborted: a trickling sender cannot\n"
"                         hold a reservation or a context lock for long\n"
"  --max-msg-buffers BYTES\n"
"                         unfinished messages buffered over all connections\n"
"                         (default max-memory / 8); a frame that would pass\n"
"                         it gets E_LIMIT and its connection is closed\n"
"  --max-models N         registered models (default 1024; E_LIMIT past it;\n"
"                         remove_model frees one)\n"
"  --max-contexts N       contexts, forks included (default max-memory / 4K,\n"
"                         at least 1024; E_LIMIT past it)\n"
"  --max-memory-per-model SIZE\n"
"                         bound on one model's blocks (its tenants' share of\n"
"                         the cap): a put over it evicts that model's own\n"
"                         least recently used contexts, never another's\n"
"                         (default 0: no bound; docs/operations.md)\n"
"  --prefault SIZE|cap    fault in SIZE bytes (or the whole cap) at start, in\n"
"                         the background, kept mapped for the store: the\n"
"                         first puts do not pay first touch (default 0)\n"
"  --idle-purge SECONDS   give the allocator's retained pages back to the\n"
"                         kernel after this long without a request (default\n"
"                         0: never; memory once used stays mapped)\n";
/* Split in parts: C11 compilers need only take 4095-byte literals. */
static const char *HELP_OPS =
"  --metrics-listen HOST:PORT\n"
"                         serve GET /metrics (Prometheus text format) on\n"
"                         this address, from its own thread. Like --listen:\n"
"                         a non-loopback address requires --auth-token-file,\n"
"                         and with a token every scrape must send\n"
"                         'Authorization: Bearer TOKEN'\n"
"  --log-format FORMAT    text | json (one JSON object per line; default text)\n"
"  --log-file FILE        log to FILE (appended) instead of stderr; SIGHUP\n"
"                         reopens it (log rotation)\n"
"  --check-config FILE    check FILE as a start would (options, addresses,\n"
"                         the token file), print 'FILE: ok' and exit 0, or\n"
"                         the reason and exit 1\n"
"\n"
"\n"
;

static const char *HELP_TAIL =
"  --remote-tier redis://HOST:PORT[,HOST:PORT...]\n"
"                         shared tier on a Redis Cluster (seed nodes): puts\n"
"                         with Put.share are published there, and a local\n"
"                         miss of get/match asks it (docs/cluster.md)\n"
"  --remote-auth-file FILE  Redis ACL credentials: 'USER PASSWORD' (or just\n"
"                         'PASSWORD') on the first line\n"
"  --remote-key-file FILE   the cluster key (a secret of 32+ bytes, the same on\n"
"                         every node; mode 600): every published value carries\n"
"                         a keyed BLAKE2b MAC, checked before use. Without it\n"
"                         the shared tier trusts everyone who can write to it\n"
"  --share-all            publish every put (else per put: Put.share); needs\n"
"                         --remote-tier. In a config file: share-all = true\n"
"  --max-regions N        shared-memory regions one connection may register\n"
"                         (default 64; 0 = shared memory off)\n"
"  --max-region-bytes SIZE  their total size per connection (default 64G;\n"
"                         mappings only: the client's memfd holds the pages)\n"
"  --max-regions-total N  regions of all connections together (default:\n"
"                         vm.max_map_count less room for the daemon's own\n"
"                         maps); past it register_region gets E_LIMIT\n"
"  --config FILE          read options from FILE first; flags override it\n"
"  -h, --help             show this help and exit\n"
"  -V, --version          show the version and exit\n"
"\n"
"Signals: SIGINT/SIGTERM stop (in-flight requests finish); SIGHUP reopens the\n"
"log and re-reads --config and the flags: log level/format/file, the token\n"
"file, timeouts and connection limits change at once, the others need a\n"
"restart (logged). Under systemd: Type=notify (READY=1, STOPPING=1,\n"
"STATUS=) and socket activation of the Unix socket, TCP and metrics\n"
"(FileDescriptorName=metrics); see docs/operations.md.\n"
"\n"
"Examples:\n"
"  kvroped                                     # default socket, 4G cap\n"
"  kvroped --socket /tmp/kv.sock --max-memory 512M --log-level debug\n"
"  kvroped --listen 127.0.0.1:7420             # Unix socket + loopback TCP\n"
"  kvroped --listen 0.0.0.0:7420 --auth-token-file /etc/kvrope/token\n"
"  kvroped --config /etc/kvrope/kvroped.conf\n"
"\n"
"  A config file:\n"
"      # /etc/kvrope/kvroped.conf\n"
"      socket = /run/kvrope/kvroped.sock\n"
"      max-memory = 8G\n"
"      log-level = warn\n"
"\n"
"Talk to it with the kvrope tool:  kvrope --socket PATH ping\n"
"The wire protocol is described in docs/protocol.md.\n";

void kvr_daemon_print_help(FILE *out)
{
    fputs(HELP, out);
    fputs(HELP_LIMITS, out);
    fputs(HELP_OPS, out);
    fputs(HELP_TAIL, out);
}

/* An option the command line takes with a value: those of the table, and
 * --config (read in the first pass; a config file cannot name it). */
static bool known_option(const char *name)
{
    return !strcmp(name, "config") || find_opt(name);
}

static bool takes_no_value(const char *name)
{
    return !strcmp(name, "help") || !strcmp(name, "version");
}

int kvr_daemon_config_parse_args(kvr_daemon_config *c, int argc, char **argv,
                                 FILE *out, FILE *errout)
{
    kvr_error err = { 0 };
    /* First pass: --help / --version / --config. */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            kvr_daemon_print_help(out);
            return 1;
        }
        if (!strcmp(a, "-V") || !strcmp(a, "--version")) {
            fprintf(out, "kvroped %s (protocol %u)\n", KVR_DAEMON_VERSION, 1u);
            return 1;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        if (!strncmp(a, "--config=", 9))
            v = a + 9;
        else if (!strcmp(a, "--config")) {
            if (i + 1 >= argc) {
                fprintf(errout, "kvroped: --config needs a value (see --help)\n");
                return KVR_EINVAL;
            }
            v = argv[++i];
        }
        if (v && kvr_daemon_config_load_file(c, v, &err) < 0) {
            fprintf(errout, "kvroped: %s\n", err.msg);
            return KVR_EINVAL;
        }
    }
    /* Second pass: everything else overrides the file. */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0 || a[2] == '\0') {
            fprintf(errout, "kvroped: unexpected argument '%s' (see --help)\n", a);
            return KVR_EINVAL;
        }
        char name[64];
        const char *eq = strchr(a + 2, '='), *v;
        size_t nlen = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
        if (nlen >= sizeof name) {
            fprintf(errout, "kvroped: unknown option '%s' (see --help)\n", a);
            return KVR_EINVAL;
        }
        memcpy(name, a + 2, nlen);
        name[nlen] = '\0';
        if (takes_no_value(name))
            continue;
        if (!strcmp(name, "check-config")) {
            fprintf(errout, "kvroped: --check-config FILE takes no other options\n");
            return KVR_EINVAL;
        }
        if (!strcmp(name, "persist-all") && !eq) {
            c->persist_all = true;     /* a plain switch on the command line */
            continue;
        }
        if (!strcmp(name, "share-all") && !eq) {
            c->share_all = true;
            continue;
        }
        if (!known_option(name)) {
            fprintf(errout, "kvroped: unknown option '%s' (see --help)\n", a);
            return KVR_EINVAL;
        }
        if (eq)
            v = eq + 1;
        else if (i + 1 < argc)
            v = argv[++i];
        else {
            fprintf(errout, "kvroped: --%s needs a value (see --help)\n", name);
            return KVR_EINVAL;
        }
        if (!strcmp(name, "config"))
            continue;
        if (kvr_daemon_config_set(c, name, v, &err) < 0) {
            fprintf(errout, "kvroped: %s\n", err.msg);
            return KVR_EINVAL;
        }
    }
    if (kvr_daemon_config_check(c, &err) < 0) {
        fprintf(errout, "kvroped: %s\n", err.msg);
        return KVR_EINVAL;
    }
    return 0;
}

/* Splits "host:port", "[v6]:port". host gets the address without brackets. */
int kvr__daemon_split_listen(const char *s, char *host, size_t hcap, int *port)
{
    const char *colon;
    const char *h = s;
    size_t hl;
    if (s[0] == '[') {
        const char *rb = strchr(s, ']');
        if (!rb || rb[1] != ':')
            return KVR_EINVAL;
        h = s + 1;
        hl = (size_t)(rb - h);
        colon = rb + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon)
            return KVR_EINVAL;
        hl = (size_t)(colon - s);
    }
    if (hl == 0 || hl >= hcap)
        return KVR_EINVAL;
    memcpy(host, h, hl);
    host[hl] = '\0';
    char *end;
    errno = 0;
    long p = strtol(colon + 1, &end, 10);
    if (errno || *end || colon[1] == '\0' || p < 0 || p > 65535)
        return KVR_EINVAL;
    *port = (int)p;
    return 0;
}

bool kvr__daemon_host_is_loopback(const char *host)
{
    return !strcmp(host, "localhost") || !strcmp(host, "::1") ||
           !strncmp(host, "127.", 4);
}

int kvr_daemon_config_check(const kvr_daemon_config *c, kvr_error *err)
{
    if (!strcmp(c->socket_path, "none") && !c->listen[0]) {
        seterr(err, "--socket none needs --listen HOST:PORT");
        return KVR_EINVAL;
    }
    if (c->persist_all && !c->disk_dir[0]) {
        seterr(err, "--persist-all needs --disk-dir DIR");
        return KVR_EINVAL;
    }
    if ((c->share_all || c->remote_auth_file[0]) && !c->remote_tier[0]) {
        seterr(err, "--%s needs --remote-tier redis://HOST:PORT",
               c->share_all ? "share-all" : "remote-auth-file");
        return KVR_EINVAL;
    }
    const struct { const char *flag, *val; } addrs[] = {
        { "listen", c->listen }, { "metrics-listen", c->metrics_listen },
    };
    for (size_t i = 0; i < sizeof addrs / sizeof addrs[0]; i++) {
        if (!addrs[i].val[0])
            continue;
        char host[256];
        int port;
        if (kvr__daemon_split_listen(addrs[i].val, host, sizeof host, &port) < 0) {
            seterr(err, "--%s: expected HOST:PORT, e.g. 127.0.0.1:7420, got '%s'",
                   addrs[i].flag, addrs[i].val);
            return KVR_EINVAL;
        }
        if (!kvr__daemon_host_is_loopback(host) && !c->auth_token_file[0]) {
            seterr(err, "--%s %s is not a loopback address: it requires "
                   "--auth-token-file FILE", addrs[i].flag, addrs[i].val);
            return KVR_EINVAL;
        }
    }
    return 0;
}

/* A numeric address a listener can bind (what server.c and metrics.c take). */
static int check_numeric(const char *flag, const char *val, kvr_error *err)
{
    char host[256];
    int port;
    if (kvr__daemon_split_listen(val, host, sizeof host, &port) < 0)
        return KVR_EINVAL;
    if (!strcmp(host, "localhost"))
        return 0;
    struct in6_addr a6;
    struct in_addr a4;
    if (inet_pton(AF_INET, host, &a4) == 1 || inet_pton(AF_INET6, host, &a6) == 1)
        return 0;
    seterr(err, "--%s: '%s' is not a numeric IP address", flag, host);
    return KVR_EINVAL;
}

int kvr_daemon_check_config_file(const char *path, FILE *out, FILE *errout)
{
    kvr_daemon_config c;
    kvr_daemon_config_init(&c);
    kvr_error err = { 0 };
    if (kvr_daemon_config_load_file(&c, path, &err) < 0 || kvr_daemon_config_check(&c, &err) < 0 ||
        (c.listen[0] && check_numeric("listen", c.listen, &err) < 0) ||
        (c.metrics_listen[0] && check_numeric("metrics-listen", c.metrics_listen, &err) < 0)) {
        fprintf(errout, "kvroped: %s\n", err.msg);
        return 1;
    }
    if (c.auth_token_file[0]) {
        uint8_t *tok = NULL;
        size_t n = 0;
        int rc = kvr__daemon_read_token(c.auth_token_file, &tok, &n, &err);
        kvr_mem_free(tok);
        if (rc < 0) {
            fprintf(errout, "kvroped: %s: %s\n", path, err.msg);
            return 1;
        }
    }
    if (c.disk_dir[0]) {
        struct stat st;
        if (stat(c.disk_dir, &st) == 0 && !S_ISDIR(st.st_mode)) {
            fprintf(errout, "kvroped: %s: disk-dir %s exists and is not a directory\n", path,
                    c.disk_dir);
            return 1;
        }
    }
    fprintf(out, "%s: ok\n", path);
    return 0;
}
