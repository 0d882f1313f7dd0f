/*
 * kvr_opsd.h — helpers for the operations tests (kvr_opsd.c) (metrics,
 * systemd, logs, signals): start kvroped with any argv, environment, passed
 * fds and uid; wait for a line in its log; a minimal HTTP/1.1 GET client
 * for /metrics; reading a sample's value out of the exposition text; and
 * running promtool on it. Every wait is bounded; the daemon dies with the
 * test (PR_SET_PDEATHSIG).
 */
#ifndef KVR_OPSD_H
#define KVR_OPSD_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "tests/common/kvr_testd.h"

typedef struct opsd_spawn {
    const char *const *argv;     /* after the program name, NULL-ended */
    const char *const *env;      /* "NAME=value" to set, NULL-ended (may be NULL) */
    const char *const *unset;    /* names to unset, NULL-ended (may be NULL) */
    const int  *fds;             /* passed as 3, 4, ... with LISTEN_PID/LISTEN_FDS */
    int         n_fds;
    const char *fd_names;        /* LISTEN_FDNAMES, or NULL */
    const char *log;             /* stdout+stderr go here */
    uid_t       uid;             /* run as this uid/gid when as_user */
    bool        as_user;
} opsd_spawn;

pid_t opsd_start(const opsd_spawn *s);

char *opsd_slurp(const char *path, size_t *len);

/* Waits up to ms for `needle` in the file; returns 1 if it appeared. */
int opsd_wait_log(const char *path, const char *needle, int ms);

/* Waits up to ms for pid; its exit code, 128+signal, or -1 (still running). */
int opsd_wait_exit(pid_t pid, int ms);

int opsd_stop(pid_t pid);

/* The port in "metrics on http://127.0.0.1:PORT/metrics" from the log. */
int opsd_metrics_port(const char *log);

/* GET path from 127.0.0.1:port with an optional extra header line (no
 * CRLF). Returns the HTTP status (or -1) and the body in *body (malloc). */
int opsd_http(int port, const char *method, const char *path, const char *hdr,
              char **body);

/* The value of the sample whose name+labels are exactly `series`, or -1. */
double opsd_sample(const char *text, const char *series);

/* promtool check metrics on text; 0 if it passed (its output is printed
 * otherwise). */
int opsd_promtool(const char *text);

int opsd_write_file(const char *path, const char *text, mode_t mode);

/* Pings over a Unix socket path or "tcp:H:P"; 0 on success. */
int opsd_ping(const char *addr);

int opsd_wait_ping(const char *addr, int ms);

#endif /* KVR_OPSD_H */
