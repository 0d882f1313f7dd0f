/*
 * daemon.h — kvroped, the kvrope daemon: configuration (flags, config file),
 * and the server that serves a kvr_store over Unix-socket and TCP frames on
 * one libuv loop. This is the whole public API of daemon/; main.c is a thin
 * wrapper around it and tests drive it through the same calls.
 *
 * Ownership: a kvr_daemon_config is a plain value (no heap pointers), so it
 * can be copied freely. A kvr_daemon owns its loop, store, listeners and
 * connections; kvr_daemon_destroy releases them all.
 */
#ifndef KVR_DAEMON_H
#define KVR_DAEMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdio.h>

#include "rope/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Kept equal to libkvrope's KVR_VERSION_* (client/kvrope.h). */
#define KVR_DAEMON_VERSION "0.3.0"

typedef enum kvr_log_level {
    KVR_LOG_DEBUG = 0,
    KVR_LOG_INFO  = 1,
    KVR_LOG_WARN  = 2,
    KVR_LOG_ERROR = 3,
} kvr_log_level;

typedef enum kvr_log_format {
    KVR_LOG_FORMAT_TEXT = 0,        /* "2025-01-31T12:00:00.123Z kvroped[pid] info: msg" */
    KVR_LOG_FORMAT_JSON = 1,        /* one JSON object per line */
} kvr_log_format;

typedef struct kvr_daemon_config {
    char     socket_path[256];      /* "" = default path; "none" = no Unix socket */
    char     listen[256];           /* "host:port" or "" (no TCP) */
    char     auth_token_file[1024]; /* "" = no auth */
    uint64_t max_memory;            /* store cap, bytes */
    uint64_t max_memory_per_model;  /* one model's block bytes; 0 = no bound */
    uint64_t prefault;              /* bytes faulted in at start; UINT64_MAX = the
                                       cap; 0 = none (daemon/warm.c) */
    uint32_t idle_purge;            /* s idle before retained pages go back; 0 = never */
    uint32_t max_connections;
    uint32_t max_frame;             /* protobuf message bytes per frame */
    uint64_t max_conn_buffer;       /* queued response bytes per connection */
    uint64_t max_drain;             /* payload bytes drained after a refused put */
    uint32_t max_regions;           /* shared-memory regions per connection */
    uint64_t max_region_bytes;      /* their total size per connection */
    uint32_t max_regions_total;     /* regions of all connections together;
                                       0 = from vm.max_map_count (shm.c) */
    uint32_t block_tokens;          /* 0 = the store's default */
    uint32_t threads;               /* libuv threadpool size; 0 = libuv default */
    uint32_t io_timeout;            /* s without progress mid-frame or on a reply; 0 = none */
    uint32_t auth_timeout;          /* s an unauthenticated connection may stay; 0 = none */
    uint32_t max_unauth_connections;/* connections still owing Auth (TCP + token) */
    kvr_log_level log_level;
    /* disk tier (cache/tier.c) */
    char     disk_dir[1024];        /* "" = memory only */
    uint64_t disk_max;              /* live data + log bytes; 0 = unbounded */
    int      disk_engine;           /* 0 auto, 1 uring, 2 posix */
    bool     persist_all;           /* every context is persistent */
    /* shared tier on Redis Cluster (daemon/remote_*.c, docs/cluster.md) */
    char     remote_tier[1024];     /* seed nodes; "" = none */
    char     remote_auth_file[1024];/* "USER PASSWORD"; "" = no AUTH */
    char     remote_key_file[1024]; /* cluster MAC key; "" = values unauthenticated */
    bool     share_all;             /* publish every put */
    /* What a client can make the daemon hold. */
    uint64_t min_rate;              /* bytes/s a frame must arrive at (after an
                                       --io-timeout grace); 0 = no deadline */
    uint64_t max_msg_buffers;       /* unfinished messages of all connections;
                                       0 = max_memory / 8 */
    uint32_t max_models;            /* registered models */
    uint64_t max_contexts;          /* contexts; 0 = max(1024, max_memory / 4 KiB) */
    /* operations (daemon/metrics.c, log.c) */
    char     metrics_listen[256];   /* "host:port" for GET /metrics, or "" */
    char     log_file[1024];        /* "" = stderr; reopened on SIGHUP */
    kvr_log_format log_format;
} kvr_daemon_config;

/* Defaults: see `kvroped --help`. max_memory = min(4 GiB, RAM / 4). */
void kvr_daemon_config_init(kvr_daemon_config *c);

/* Sets one option by its long flag name without dashes ("max-memory").
 * Returns 0 or KVR_EINVAL and fills err (may be NULL). */
int kvr_daemon_config_set(kvr_daemon_config *c, const char *key, const char *value,
                          kvr_error *err);

/* Reads `key = value` lines ('#' starts a comment). 0, KVR_EIO (cannot
 * open; strerror text in err) or KVR_EINVAL. */
int kvr_daemon_config_load_file(kvr_daemon_config *c, const char *path,
                                kvr_error *err);

/* Parses argv (argv[0] is the program). --config FILE is loaded first,
 * flags override it. Returns 0 to run, 1 if --help/--version was printed
 * to `out` (exit 0), or KVR_EINVAL after writing a message to `errout`. */
int kvr_daemon_config_parse_args(kvr_daemon_config *c, int argc, char **argv,
                                 FILE *out, FILE *errout);

/* Checks cross-option rules (non-loopback TCP needs a token file, ...). */
int kvr_daemon_config_check(const kvr_daemon_config *c, kvr_error *err);

/* `kvroped --check-config FILE`: loads FILE alone (no other flags), checks
 * it as a start would (cross-option rules, listen addresses, the token
 * file) without binding anything. Writes "FILE: ok" to out and returns 0,
 * or writes the reason to errout and returns 1 (the exit status). */
int kvr_daemon_check_config_file(const char *path, FILE *out, FILE *errout);

/* Writes the default socket path (see docs/protocol.md) to buf. */
void kvr_daemon_default_socket(char *buf, size_t cap);

/* "4G", "512M", "64k", "1024" (bytes). 0 or KVR_EINVAL. */
int kvr_parse_size(const char *s, uint64_t *out);

void kvr_daemon_print_help(FILE *out);

/* ---- logging (stderr or --log-file, timestamped) ----------------------- */
void kvr_log_set_level(kvr_log_level l);
kvr_log_level kvr_log_get_level(void);
int  kvr_log_level_parse(const char *s, kvr_log_level *out);
void kvr_log_set_format(kvr_log_format f);
int  kvr_log_format_parse(const char *s, kvr_log_format *out);
/* Sends the log to path (appending, created 0640), or to stderr for "".
 * Called again (SIGHUP) it reopens the file, for log rotation. On failure
 * the current destination is kept: KVR_EIO (or KVR_ENOMEM) with err filled. */
int  kvr_log_open(const char *path, kvr_error *err);
void kvr_log(kvr_log_level l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- server ------------------------------------------------------------ */
typedef struct kvr_daemon kvr_daemon;

/* Must be the first libuv-related call of the process: installs kvr_mem_*
 * as libuv's allocator. Idempotent. */
void kvr_daemon_init_allocator(void);

/* Creates the store, the loop and the listeners (not started yet). On
 * failure returns a negative KVR_E* code and fills err (may be NULL). */
int  kvr_daemon_create(kvr_daemon **out, const kvr_daemon_config *c,
                       kvr_error *err);
/* Installs SIGINT/SIGTERM handlers that call kvr_daemon_stop, and SIGHUP:
 * reopen the log and reload what can change safely (kvr_daemon_reload). */
int  kvr_daemon_handle_signals(kvr_daemon *d);
/* Serves until stopped and every handle is closed. Returns 0. */
int  kvr_daemon_run(kvr_daemon *d);
/* Loop thread: stop accepting, finish in-flight requests, close. */
void kvr_daemon_stop(kvr_daemon *d);
/* Loop thread (SIGHUP): reopens the log; re-reads argv (its --config file,
 * then its flags, as at start) and applies what can change while running:
 * log level/format/file, the auth token, timeouts and connection limits.
 * Options that need a restart are reported and left as they are. A config
 * that does not parse changes nothing. argv is borrowed from
 * kvr_daemon_set_args (none set: only the log is reopened). */
void kvr_daemon_reload(kvr_daemon *d);
void kvr_daemon_set_args(kvr_daemon *d, int argc, char **argv);
/* Serves an already-connected stream fd (tests, fuzzing) as a Unix-socket
 * client: no auth. The daemon owns fd afterwards. */
int  kvr_daemon_adopt_fd(kvr_daemon *d, int fd);
/* Runs the loop once without blocking (tests, fuzzing): returns nonzero
 * while handles or requests are still active. */
int  kvr_daemon_run_nowait(kvr_daemon *d);
/* Number of open connections. */
size_t kvr_daemon_connections(const kvr_daemon *d);
/* Removes the socket file, frees everything. NULL is a no-op. */
void kvr_daemon_destroy(kvr_daemon *d);

/* main(): parse, create, run, destroy. Returns the exit code. */
int kvr_daemon_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif
#endif /* KVR_DAEMON_H */
