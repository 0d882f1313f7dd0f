/*
 * test_int_ops.c — kvroped as operators run it: /metrics scraped during
 * traffic (promtool check metrics, counters that move exactly as the
 * traffic says, one consistent snapshot per scrape), the bearer token on
 * scrapes, json logs, SIGHUP (log reopen, reload, what needs a restart, a
 * bad file changes nothing, token rotation), --check-config, sd_notify
 * messages on NOTIFY_SOCKET, socket activation with passed listening fds,
 * and issue 12 items 4 (a stopping daemon leaves its successor's socket)
 * and 5 (the default socket directory must be private; token file mode).
 */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>
#include <pthread.h>
#include <sys/stat.h>

#include "daemon/daemon.h"
#include "tests/common/kvr_opsd.h"

static char g_dir[256];

static void mkdir_tmp(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/kvr-ops-XXXXXX");
    cr_assert(mkdtemp(g_dir));
}

static void rm_tmp(void)
{
    if (g_dir[0]) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
        if (system(cmd) != 0)
            fprintf(stderr, "cannot remove %s\n", g_dir);
        g_dir[0] = 0;
    }
}

TestSuite(ops, .init = mkdir_tmp, .fini = rm_tmp, .timeout = 240);

static void path(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", g_dir, name);
}

/* The usual daemon socket (s.sock) and log (d.log) paths, 320 bytes each. */
static void sock_and_log(char *sock, char *log)
{
    path(sock, 320, "s.sock");
    path(log, 320, "d.log");
}

static void dump_log(const char *log)
{
    char *t = opsd_slurp(log, NULL);
    fprintf(stderr, "---- %s ----\n%s\n", log, t ? t : "(none)");
    free(t);
}

/* ---- /metrics ------------------------------------------------------------ */

/* Starts kvroped with argv (its stderr into out_log) and waits for the
 * metrics port it writes to log (*port; the log is dumped if none comes),
 * then, if sock is not NULL, for it to answer a ping there. The pid. */
static pid_t start_metrics(const char *const *argv, const char *out_log, const char *log,
                           const char *sock, int *port)
{
    opsd_spawn sp = { .argv = argv, .log = out_log };
    pid_t pid = opsd_start(&sp);
    cr_assert(pid > 0);
    *port = opsd_metrics_port(log);
    if (*port <= 0)
        dump_log(out_log);
    cr_assert(*port > 0);
    if (sock)
        cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
    return pid;
}

/* A client of sock with the test model (f16) registered as m1 and, if m2
 * is not NULL, as m2. */
static kvr_client *connect_with_models(const char *sock, const char *m1, const char *m2)
{
    kvr_client *c = NULL;
    cr_assert_eq(kvr_client_connect(&c, sock, NULL), 0);
    cr_assert_eq(testd_register(c, m1, KVR_DTYPE_F16, NULL), 0);
    if (m2)
        cr_assert_eq(testd_register(c, m2, KVR_DTYPE_F16, NULL), 0);
    return c;
}

static char *scrape(int port)
{
    char *body = NULL;
    int st = opsd_http(port, "GET", "/metrics", NULL, &body);
    cr_assert_eq(st, 200, "GET /metrics: HTTP %d", st);
    return body;
}

static double sample(const char *text, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static double sample(const char *text, const char *fmt, ...)
{
    char series[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(series, sizeof series, fmt, ap);
    va_end(ap);
    return opsd_sample(text, series);
}

/* Every verb's histogram count equals the sum of its requests_total over
 * statuses: one snapshot per scrape. */
static void check_consistent(const char *text)
{
    static const char *verbs[] = { "ping", "put", "get", "register_model", "delete", "stats" };
    for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++) {
        double sum = 0;
        char prefix[128];
        int pl = snprintf(prefix, sizeof prefix, "kvrope_requests_total{verb=\"%s\",", verbs[i]);
        for (const char *p = text; p && *p;) {
            if (!strncmp(p, prefix, (size_t)pl)) {
                const char *sp = strchr(p, ' ');
                sum += strtod(sp + 1, NULL);
            }
            p = strchr(p, '\n');
            if (p)
                p++;
        }
        double cnt = sample(text, "kvrope_request_duration_seconds_count{verb=\"%s\"}", verbs[i]);
        double inf = sample(text, "kvrope_request_duration_seconds_bucket{verb=\"%s\",le=\"+Inf\"}",
                            verbs[i]);
        cr_assert_eq(cnt, sum, "%s: histogram count %.0f != requests %.0f", verbs[i], cnt, sum);
        cr_assert_eq(inf, cnt, "%s: +Inf bucket %.0f != count %.0f", verbs[i], inf, cnt);
    }
}

typedef struct traffic {
    const char *sock;
    int         n;
    int         rc;
} traffic;

static void *ping_traffic(void *arg)
{
    traffic *t = arg;
    kvr_client *c;
    t->rc = kvr_client_connect(&c, t->sock, NULL);
    if (t->rc < 0)
        return NULL;
    for (int i = 0; i < t->n && t->rc == 0; i++)
        t->rc = kvr_client_ping(c, NULL);
    kvr_client_close(c);
    return NULL;
}

Test(ops, metrics_follow_traffic_and_pass_promtool)
{
    char sock[320], log[320], disk[320];
    sock_and_log(sock, log);
    path(disk, sizeof disk, "disk");
    cr_assert_eq(mkdir(disk, 0700), 0);
    const char *argv[] = { "--socket", sock, "--metrics-listen", "127.0.0.1:0", "--disk-dir", disk,
                           "--max-memory", "64M", NULL };
    int port;
    pid_t pid = start_metrics(argv, log, log, sock, &port);

    char *m0 = scrape(port);
    cr_assert_eq(opsd_promtool(m0), 0);
    double ping0 = sample(m0, "kvrope_requests_total{verb=\"ping\",status=\"OK\"}");
    cr_assert(ping0 >= 1, "the start-up ping is counted (%g)", ping0);
    cr_assert_eq(sample(m0, "kvrope_disk_enabled"), 1);
    cr_assert_eq(sample(m0, "kvrope_memory_cap_bytes"), 64.0 * 1024 * 1024);
    cr_assert(sample(m0, "kvrope_build_info{version=\"" KVR_DAEMON_VERSION "\",protocol=\"1\"}") == 1);
    free(m0);

    /* Known traffic: N puts of T tokens, M gets, one unknown-context get. */
    kvr_client *c = connect_with_models(sock, "m", NULL);
    enum { N = 5, T = 40, M = 3 };
    size_t plen = kvr_payload_size(T_LAYERS, T, T_HEADS, T_DIM, KVR_DTYPE_F16);
    for (int i = 0; i < N; i++) {
        char id[16];
        snprintf(id, sizeof id, "c%d", i);
        cr_assert_eq(testd_put(c, id, "m", KVR_DTYPE_F16, (uint32_t)i, 100, 0, T), 0);
    }
    for (int i = 0; i < M; i++) {
        kvr_kv kv;
        kvr_get_args ga = { .ctx_id = "c1", .dtype = KVR_DTYPE_F16 };
        cr_assert_eq(kvr_client_get(c, &ga, &kv), 0);
        kvr_kv_release(&kv);
    }
    kvr_kv kv;
    kvr_get_args bad = { .ctx_id = "nope", .dtype = KVR_DTYPE_F16 };
    cr_assert_neq(kvr_client_get(c, &bad, &kv), 0);

    /* Scrapes while another connection pings: each passes promtool, is one
     * consistent snapshot, and the ping counter never goes back. */
    enum { P = 400 };
    traffic tr = { .sock = sock, .n = P };
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, ping_traffic, &tr), 0);
    double last = -1;
    for (int i = 0; i < 8; i++) {
        char *m = scrape(port);
        cr_assert_eq(opsd_promtool(m), 0);
        check_consistent(m);
        double p = sample(m, "kvrope_requests_total{verb=\"ping\",status=\"OK\"}");
        cr_assert(p >= last, "ping counter went back: %g after %g", p, last);
        last = p;
        free(m);
    }
    pthread_join(th, NULL);
    cr_assert_eq(tr.rc, 0);

    char *m = scrape(port);
    cr_assert_eq(opsd_promtool(m), 0);
    check_consistent(m);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"ping\",status=\"OK\"}"), ping0 + P);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"put\",status=\"OK\"}"), N);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"get\",status=\"OK\"}"), M);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"get\",status=\"E_UNKNOWN_CONTEXT\"}"), 1);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"register_model\",status=\"OK\"}"), 1);
    cr_assert_eq(sample(m, "kvrope_request_payload_received_bytes_total{verb=\"put\"}"),
                 (double)(N * plen));
    cr_assert(sample(m, "kvrope_request_sent_bytes_total{verb=\"get\"}") >= (double)(M * plen));
    cr_assert_eq(sample(m, "kvrope_request_duration_seconds_count{verb=\"put\"}"), N);
    cr_assert_eq(sample(m, "kvrope_contexts"), N);
    cr_assert_eq(sample(m, "kvrope_tokens"), N * T);
    cr_assert_eq(sample(m, "kvrope_models"), 1);
    cr_assert(sample(m, "kvrope_blocks") >= N);
    cr_assert(sample(m, "kvrope_memory_allocated_bytes") > 0);
    cr_assert(sample(m, "kvrope_memory_peak_bytes") >= sample(m, "kvrope_memory_allocated_bytes"));
    cr_assert_eq(sample(m, "kvrope_store_puts_total"), N);
    cr_assert(sample(m, "kvrope_tier_hits_total{tier=\"memory\"}") >= M);
    cr_assert(sample(m, "kvrope_tier_misses_total{tier=\"disk\"}") >= 0);
    cr_assert(sample(m, "kvrope_tier_bytes{tier=\"disk\"}") >= 0);
    cr_assert(sample(m, "kvrope_last_recovery_timestamp_seconds") > 0);
    cr_assert(sample(m, "kvrope_error_replies_total") >= 1);
    cr_assert(sample(m, "kvrope_connections") >= 1);
    cr_assert(sample(m, "kvrope_connections_accepted_total") >= 3);
    cr_assert_eq(sample(m, "kvrope_shm_regions"), 0);
    cr_assert(sample(m, "kvrope_shm_regions_limit") > 0);
    cr_assert(sample(m, "kvrope_network_received_bytes_total") >= (double)(N * plen));

    /* Deletes move contexts down and count as delete requests. */
    cr_assert_eq(kvr_client_delete(c, "c0"), 0);
    free(m);
    m = scrape(port);
    cr_assert_eq(sample(m, "kvrope_contexts"), N - 1);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"delete\",status=\"OK\"}"), 1);
    free(m);

    /* Every verb is named (issue 31: layout verbs counted under "none"),
     * and /metrics names exactly the verbs stats counts, from one list. */
    kvr_layout_res lr;
    cr_assert_eq(kvr_client_set_retention(c, "c1", 2, 8, false, &lr), 0, "%s",
                 kvr_client_last_error(c));
    cr_assert_eq(kvr_client_layout_stat(c, "c1", &lr), 0, "%s", kvr_client_last_error(c));
    cr_assert_neq(kvr_client_layout_stat(c, "nope", &lr), 0);
    kvr_metric *st = NULL;
    size_t nst = 0;
    cr_assert_eq(kvr_client_stats(c, &st, &nst), 0);
    m = scrape(port);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"set_retention\",status=\"OK\"}"), 1, "%s",
                 m);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"layout_stat\",status=\"OK\"}"), 1);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"layout_stat\",status=\"E_UNKNOWN_CONTEXT\"}"),
                 1);
    cr_assert_eq(sample(m, "kvrope_requests_total{verb=\"none\",status=\"OK\"}"), 0);
    cr_assert_null(strstr(m, "verb=\"none\",status=\"E_"), "a request counted under none");
    size_t nverbs = 0;
    for (size_t i = 0; i < nst; i++) {
        if (strncmp(st[i].name, "requests_", 9) != 0 || !strcmp(st[i].name, "requests_total"))
            continue;
        nverbs++;
        double ok = sample(m, "kvrope_requests_total{verb=\"%s\",status=\"OK\"}", st[i].name + 9);
        cr_assert(ok >= 0, "stats counts %s, /metrics has no verb=\"%s\"", st[i].name,
                  st[i].name + 9);
        cr_assert(sample(m, "kvrope_request_duration_seconds_count{verb=\"%s\"}",
                         st[i].name + 9) >= 0);
    }
    cr_assert_geq(nverbs, 26, "stats lists %zu verbs", nverbs);
    size_t series = 0;
    for (const char *p = m; (p = strstr(p, "kvrope_requests_total{verb=\"")); p++)
        if (strstr(p, "status=\"OK\"") < strchr(p, '\n') && strncmp(p + 28, "none\"", 5))
            series++;
    cr_assert_eq(series, nverbs, "/metrics names %zu verbs, stats %zu", series, nverbs);
    kvr_client_free(st);
    free(m);
    kvr_client_close(c);

    /* Only GET /metrics. */
    char *body;
    cr_assert_eq(opsd_http(port, "GET", "/other", NULL, &body), 404);
    free(body);
    cr_assert_eq(opsd_http(port, "POST", "/metrics", NULL, &body), 405);
    free(body);
    cr_assert_eq(opsd_stop(pid), 0);
}

/* A slowloris scrape connection from source address src (127.0.0.x):
 * connected, a request line sent, headers to follow a line at a time. -1
 * if the connect failed. */
static int dribbler(const char *src, int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in me = { .sin_family = AF_INET };
    cr_assert_eq(inet_pton(AF_INET, src, &me.sin_addr), 1);
    cr_assert_eq(bind(fd, (struct sockaddr *)&me, sizeof me), 0, "bind %s: %s", src,
                 strerror(errno));
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        close(fd);
        return -1;
    }
    const char *line = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    if (send(fd, line, strlen(line), MSG_NOSIGNAL) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Has the daemon closed fd (EOF or reset)? */
static bool dropped(int fd)
{
    char b[256];
    ssize_t r = recv(fd, b, sizeof b, MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* One more header line on every dribbler still open; closes (-1) those the
 * daemon dropped. Returns how many are still open. */
static int drip(int *fds, int n)
{
    int open = 0;
    for (int i = 0; i < n; i++) {
        if (fds[i] < 0)
            continue;
        if (dropped(fds[i]) || send(fds[i], "X-Drip: 1\r\n", 11, MSG_NOSIGNAL) < 0) {
            close(fds[i]);
            fds[i] = -1;
            continue;
        }
        open++;
    }
    return open;
}

/* Issue 29 item 8: 16 connections each dribbling a header line (every 3 s
 * then, every second here: both beat the 10 s idle timeout) held every
 * scrape slot forever, before the token is checked. Now one peer address
 * gets at most 4 connections, and a request must be in and answered within
 * 10 s of its connection's start: a scrape succeeds at once against one
 * peer's dribblers, within the deadline (generously bounded: 40 s) against
 * dribblers from four addresses filling every slot, and every dribbler is
 * dropped. */
Test(ops, metrics_slowloris_cannot_hold_the_scrape_slots)
{
    char sock[320], log[320];
    sock_and_log(sock, log);
    const char *argv[] = { "--socket", sock, "--metrics-listen", "127.0.0.1:0", NULL };
    int port;
    pid_t pid = start_metrics(argv, log, log, sock, &port);
    enum { N = 16 };
    int one[N], many[N];
    /* One peer: 16 dribblers, of which at most 4 keep a slot. */
    for (int i = 0; i < N; i++)
        one[i] = dribbler("127.0.0.2", port);
    kvt_sleep_ms(300);
    int open = drip(one, N);
    cr_assert_leq(open, 4, "one peer holds %d scrape connections", open);
    char *body = NULL;
    cr_assert_eq(opsd_http(port, "GET", "/metrics", NULL, &body), 200,
                 "a scrape while one peer dribbles");
    free(body);
    /* Four more peers fill every slot; a scrape gets one once the
     * dribblers' deadline passes. */
    for (int i = 0; i < N; i++) {
        char src[32];
        snprintf(src, sizeof src, "127.0.0.%d", 3 + i / 4);
        many[i] = dribbler(src, port);
    }
    int st = -1;
    uint64_t t0 = mono_ms();
    while (st != 200 && mono_ms() - t0 < 40000) {
        drip(one, N);
        drip(many, N);
        body = NULL;
        st = opsd_http(port, "GET", "/metrics", NULL, &body);
        free(body);
        if (st != 200)
            kvt_sleep_ms(1000);
    }
    cr_assert_eq(st, 200, "no scrape got through within 40 s");
    /* Every dribbler is dropped, though each keeps dripping. */
    int left = N;
    while (left > 0 && mono_ms() - t0 < 40000) {
        kvt_sleep_ms(1000);
        left = drip(one, N) + drip(many, N);
    }
    cr_assert_eq(left, 0, "%d dribblers still hold a connection after 40 s", left);
    cr_assert(opsd_wait_log(log, "whose request was not in and answered within 10 s", 1000));
    cr_assert_eq(opsd_stop(pid), 0);
}

Test(ops, metrics_need_the_bearer_token_when_there_is_one)
{
    char sock[320], log[320], tok[320];
    sock_and_log(sock, log);
    path(tok, sizeof tok, "token");
    cr_assert_eq(opsd_write_file(tok, "s3cret\n", 0600), 0);
    const char *argv[] = { "--socket", sock, "--metrics-listen", "127.0.0.1:0",
                           "--auth-token-file", tok, NULL };
    int port;
    pid_t pid = start_metrics(argv, log, log, NULL, &port);
    char *body;
    cr_assert_eq(opsd_http(port, "GET", "/metrics", NULL, &body), 401);
    cr_assert(strstr(body, "Bearer"), "%s", body);
    free(body);
    cr_assert_eq(opsd_http(port, "GET", "/metrics", "Authorization: Bearer wrong", &body), 401);
    free(body);
    cr_assert_eq(opsd_http(port, "GET", "/metrics", "Authorization: Bearer s3cre", &body), 401);
    free(body);
    cr_assert_eq(opsd_http(port, "GET", "/metrics", "Authorization: Basic czNjcmV0", &body), 401);
    free(body);
    cr_assert_eq(opsd_http(port, "GET", "/metrics", "Authorization: Bearer s3cret", &body), 200);
    cr_assert_eq(opsd_promtool(body), 0);
    free(body);
    cr_assert_eq(opsd_stop(pid), 0);
}

Test(ops, a_non_loopback_metrics_address_needs_a_token)
{
    char log[320], sock[320];
    sock_and_log(sock, log);
    const char *argv[] = { "--socket", sock, "--metrics-listen", "0.0.0.0:0", NULL };
    opsd_spawn sp = { .argv = argv, .log = log };
    pid_t pid = opsd_start(&sp);
    cr_assert_eq(opsd_wait_exit(pid, 30000), 2);
    cr_assert(opsd_wait_log(log, "--metrics-listen 0.0.0.0:0 is not a loopback address", 1000));
}

/* ---- logs ------------------------------------------------------------------ */

Test(ops, json_logs_are_one_object_per_line)
{
    char sock[320], log[320];
    sock_and_log(sock, log);
    const char *argv[] = { "--socket", sock, "--log-format", "json", "--log-level", "debug", NULL };
    opsd_spawn sp = { .argv = argv, .log = log };
    pid_t pid = opsd_start(&sp);
    cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
    kvr_client *c;
    cr_assert_eq(kvr_client_connect(&c, sock, NULL), 0);
    /* Names with quotes, a backslash, a tab, UTF-8 and a byte that is not
     * UTF-8 end up in log messages. */
    const char *names[] = { "q\"uo\\te", "t\tab", "caf\xc3\xa9", "bad\377byte",
                            /* overlong, surrogate, past U+10FFFF, cut short, 4-byte ok */
                            "o\xc0\xaf", "s\xed\xa0\x80", "p\xf4\x90\x80\x80", "c\xe2\x82",
                            "e\xf0\x9f\x98\x80" };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        testd_register(c, names[i], KVR_DTYPE_F16, NULL);
    kvr_client_close(c);
    cr_assert_eq(opsd_stop(pid), 0);
    size_t len;
    char *t = opsd_slurp(log, &len);
    cr_assert(t && len > 0);
    int lines = 0, registered = 0;
    for (char *line = strtok(t, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        cr_assert(j, "not JSON: %s", line);
        cr_assert(cJSON_IsObject(j));
        cJSON *ts = cJSON_GetObjectItem(j, "ts"), *lv = cJSON_GetObjectItem(j, "level"),
              *pd = cJSON_GetObjectItem(j, "pid"), *msg = cJSON_GetObjectItem(j, "msg");
        cr_assert(cJSON_IsString(ts) && strlen(ts->valuestring) == 24, "%s", line);
        cr_assert(cJSON_IsString(lv), "%s", line);
        cr_assert(cJSON_IsNumber(pd) && (pid_t)pd->valuedouble == pid, "%s", line);
        cr_assert(cJSON_IsString(msg), "%s", line);
        if (strstr(msg->valuestring, "model q\"uo\\te registered") ||
            strstr(msg->valuestring, "model t\tab registered") ||
            strstr(msg->valuestring, "model caf\xc3\xa9 registered") ||
            strstr(msg->valuestring, "model bad\xef\xbf\xbd" "byte registered"))
            registered++;
        cJSON_Delete(j);
        lines++;
    }
    free(t);
    cr_assert(lines >= 5, "%d lines", lines);
    cr_assert_eq(registered, 4, "each name logged, escaped (%d)", registered);
    /* Strict UTF-8 and JSON for every line (cJSON does not check UTF-8). */
    char cmd[700];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 -c \"import json,sys\n"
             "for l in open(sys.argv[1], 'rb').read().decode('utf-8').splitlines():\n"
             "    o = json.loads(l); assert set(o) == {'ts', 'level', 'pid', 'msg'}, o\" '%s'", log);
    cr_assert_eq(system(cmd), 0, "a log line is not strict UTF-8 JSON");
}

/* ---- SIGHUP ------------------------------------------------------------------ */

Test(ops, sighup_reopens_the_log_and_reloads_what_can_change)
{
    char sock[320], log[320], out[320], cfg[320], tok[320], rotated[340];
    path(sock, sizeof sock, "s.sock");
    path(log, sizeof log, "kvroped.log");
    path(out, sizeof out, "stderr.log");
    path(cfg, sizeof cfg, "kvroped.conf");
    path(tok, sizeof tok, "token");
    snprintf(rotated, sizeof rotated, "%s.1", log);
    cr_assert_eq(opsd_write_file(tok, "first\n", 0600), 0);
    char text[2048];
    snprintf(text, sizeof text, "socket = %s\nlog-file = %s\nlog-level = info\n"
             "auth-token-file = %s\nmetrics-listen = 127.0.0.1:0\nmax-memory = 64M\n",
             sock, log, tok);
    cr_assert_eq(opsd_write_file(cfg, text, 0600), 0);
    const char *argv[] = { "--config", cfg, NULL };
    int port;
    pid_t pid = start_metrics(argv, out, log, sock, &port);
    char *body;
    cr_assert_eq(opsd_http(port, "GET", "/metrics", "Authorization: Bearer first", &body), 200);
    free(body);

    /* Rotate the log, change the level (debug), a reloadable limit, the
     * token, and two options that need a restart. */
    cr_assert_eq(rename(log, rotated), 0);
    cr_assert_eq(opsd_write_file(tok, "second\n", 0600), 0);
    snprintf(text, sizeof text, "socket = %s\nlog-file = %s\nlog-level = debug\n"
             "auth-token-file = %s\nmetrics-listen = 127.0.0.1:0\nmax-memory = 128M\n"
             "io-timeout = 7\nblock-tokens = 32\n", sock, log, tok);
    cr_assert_eq(opsd_write_file(cfg, text, 0600), 0);
    kill(pid, SIGHUP);
    cr_assert(opsd_wait_log(log, "reloaded: log-level 0", 30000), "the new log file gets lines");
    cr_assert(opsd_wait_log(log, "max-memory changed but needs a restart", 1000));
    cr_assert(opsd_wait_log(log, "block-tokens changed but needs a restart", 1000));
    cr_assert(opsd_wait_log(log, "io-timeout 7 s", 1000));
    cr_assert(opsd_wait_log(rotated, "SIGHUP received", 1000), "the old file got the last lines");
    /* Debug level now: requests are logged. */
    cr_assert_eq(opsd_ping(sock), 0);
    cr_assert(opsd_wait_log(log, "request id", 10000));
    /* The token was re-read. */
    cr_assert_eq(opsd_http(port, "GET", "/metrics", "Authorization: Bearer first", &body), 401);
    free(body);
    cr_assert_eq(opsd_http(port, "GET", "/metrics", "Authorization: Bearer second", &body), 200);
    double refused0 = opsd_sample(body, "kvrope_connections_refused_total");
    free(body);

    /* A connection limit lowered by a reload holds for new connections. */
    snprintf(text, sizeof text, "socket = %s\nlog-file = %s\nlog-level = debug\n"
             "auth-token-file = %s\nmetrics-listen = 127.0.0.1:0\nmax-memory = 64M\n"
             "max-connections = 1\n", sock, log, tok);
    cr_assert_eq(opsd_write_file(cfg, text, 0600), 0);
    kill(pid, SIGHUP);
    cr_assert(opsd_wait_log(log, "max-connections 1,", 30000));
    kvr_client *first;
    cr_assert_eq(kvr_client_connect(&first, sock, NULL), 0);
    cr_assert_eq(kvr_client_ping(first, NULL), 0);
    cr_assert_neq(opsd_ping(sock), 0, "a second connection is refused after the reload");
    kvr_client_close(first);
    cr_assert_eq(opsd_http(port, "GET", "/metrics", "Authorization: Bearer second", &body), 200);
    cr_assert_eq(opsd_sample(body, "kvrope_connections_refused_total"), refused0 + 1);
    free(body);
    /* The first one is gone once its close is seen: wait until a ping goes through. */
    cr_assert_eq(opsd_wait_ping(sock, 30000), 0);

    /* A file that does not parse changes nothing; the daemon keeps serving. */
    cr_assert_eq(opsd_write_file(cfg, "log-level = loud\n", 0600), 0);
    kill(pid, SIGHUP);
    cr_assert(opsd_wait_log(log, "the configuration does not parse, nothing changed", 30000));
    cr_assert_eq(opsd_ping(sock), 0);
    cr_assert_eq(opsd_http(port, "GET", "/metrics", "Authorization: Bearer second", &body), 200);
    free(body);
    cr_assert_eq(opsd_stop(pid), 0);
}

/* ---- --check-config ------------------------------------------------------------ */

static int check_config(const char *file, char *out, size_t cap)
{
    char bin[512];
    snprintf(bin, sizeof bin, "%s/kvroped", testd_build_dir());
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "'%s' --check-config '%s' 2>&1", bin, file);
    FILE *p = popen(cmd, "r");
    cr_assert(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(ops, check_config_accepts_good_files_and_explains_bad_ones)
{
    char f[320], tok[320], out[2048], text[1024];
    path(f, sizeof f, "k.conf");
    path(tok, sizeof tok, "token");
    cr_assert_eq(opsd_write_file(tok, "t0ken\n", 0600), 0);
    snprintf(text, sizeof text, "# a comment\nsocket = /run/x.sock\nmax-memory = 1G\n"
             "listen = 0.0.0.0:7420\nauth-token-file = %s\nmetrics-listen = [::1]:7421\n"
             "log-format = json\n", tok);
    cr_assert_eq(opsd_write_file(f, text, 0600), 0);
    cr_assert_eq(check_config(f, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, ": ok"), "%s", out);

    /* The example config installed with the unit passes as shipped. */
    cr_assert_eq(check_config("dist/kvroped.conf", out, sizeof out), 0, "%s", out);

    struct { const char *text; const char *why; } bad[] = {
        { "max-memory = lots\n", "invalid value for --max-memory" },
        { "no-such-option = 1\n", "unknown option 'no-such-option'" },
        { "listen 127.0.0.1:1\n", "expected 'key = value'" },
        { "listen = 10.0.0.1:7420\n", "is not a loopback address" },
        { "metrics-listen = 0.0.0.0:9\n", "is not a loopback address" },
        { "listen = 127.0.0.1:port\n", "expected HOST:PORT" },
        { "metrics-listen = localhost\n", "expected HOST:PORT" },
        { "log-format = xml\n", "invalid value for --log-format" },
        { "persist-all = true\n", "--persist-all needs --disk-dir" },
        { "auth-token-file = /nonexistent/token\nlisten = 0.0.0.0:1\n", "No such file" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(opsd_write_file(f, bad[i].text, 0600), 0);
        int rc = check_config(f, out, sizeof out);
        cr_assert_eq(rc, 1, "%s: rc %d: %s", bad[i].text, rc, out);
        cr_assert(strstr(out, bad[i].why), "%s: wanted '%s' in: %s", bad[i].text, bad[i].why, out);
    }
    snprintf(text, sizeof text, "auth-token-file = %s\nmetrics-listen = example.com:9\n", tok);
    cr_assert_eq(opsd_write_file(f, text, 0600), 0);
    cr_assert_eq(check_config(f, out, sizeof out), 1, "%s", out);
    cr_assert(strstr(out, "'example.com' is not a numeric IP address"), "%s", out);
    cr_assert_eq(check_config("/nonexistent/kvroped.conf", out, sizeof out), 1);
    cr_assert(strstr(out, "cannot open config file"), "%s", out);
}

/* ---- systemd: sd_notify, socket activation -------------------------------------- */

static int recv_notify(int fd, char *buf, size_t cap, int ms)
{
    struct pollfd p = { .fd = fd, .events = POLLIN };
    if (poll(&p, 1, ms) <= 0)
        return -1;
    ssize_t n = recv(fd, buf, cap - 1, 0);
    if (n < 0)
        return -1;
    buf[n] = 0;
    return (int)n;
}

/* Reads datagrams until one contains `needle` (up to ms). */
static int wait_notify(int fd, const char *needle, char *last, size_t cap, int ms)
{
    for (int i = 0; i < 50; i++) {
        if (recv_notify(fd, last, cap, ms) < 0)
            return 0;
        if (strstr(last, needle))
            return 1;
    }
    return 0;
}

Test(ops, sd_notify_ready_reloading_stopping)
{
    char sock[320], log[320], ns[320];
    sock_and_log(sock, log);
    path(ns, sizeof ns, "notify.sock");
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    cr_assert(fd >= 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    if (strlen(ns) >= sizeof sa.sun_path)
        cr_assert_fail("path too long");
    memcpy(sa.sun_path, ns, strlen(ns) + 1);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    char env[400];
    snprintf(env, sizeof env, "NOTIFY_SOCKET=%s", ns);
    const char *envs[] = { env, NULL };
    const char *argv[] = { "--socket", sock, NULL };
    opsd_spawn sp = { .argv = argv, .env = envs, .log = log };
    pid_t pid = opsd_start(&sp);
    char msg[1024];
    cr_assert(wait_notify(fd, "READY=1", msg, sizeof msg, 30000), "no READY=1");
    cr_assert(strstr(msg, "STATUS=serving"), "%s", msg);
    cr_assert(strstr(msg, sock), "the status names the socket: %s", msg);
    cr_assert_eq(opsd_ping(sock), 0, "ready means it answers");
    kill(pid, SIGHUP);
    cr_assert(wait_notify(fd, "RELOADING=1", msg, sizeof msg, 30000), "no RELOADING=1");
    cr_assert(wait_notify(fd, "READY=1", msg, sizeof msg, 30000), "no READY=1 after reload");
    kill(pid, SIGTERM);
    cr_assert(wait_notify(fd, "STOPPING=1", msg, sizeof msg, 30000), "no STOPPING=1");
    cr_assert_eq(opsd_wait_exit(pid, 30000), 0);
    close(fd);
}

static int listen_unix_at(const char *p)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    if (strlen(p) >= sizeof sa.sun_path)
        return -1;
    memcpy(sa.sun_path, p, strlen(p) + 1);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 16) < 0)
        return -1;
    return fd;
}

static int listen_tcp_any_port(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = { .sin_family = AF_INET };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof sa;
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 16) < 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &sl) < 0)
        return -1;
    *port = ntohs(sa.sin_port);
    return fd;
}

Test(ops, socket_activation_serves_the_passed_fds)
{
    char usock[320], log[320], other[320];
    path(usock, sizeof usock, "activated.sock");
    path(log, sizeof log, "d.log");
    path(other, sizeof other, "unused.sock");
    int ufd = listen_unix_at(usock);
    int tport, mport;
    int tfd = listen_tcp_any_port(&tport);
    int mfd = listen_tcp_any_port(&mport);
    cr_assert(ufd >= 0 && tfd >= 0 && mfd >= 0);
    int fds[] = { ufd, tfd, mfd };
    /* The configured socket and listen address are replaced by the fds. */
    const char *argv[] = { "--socket", other, "--listen", "127.0.0.1:1", NULL };
    opsd_spawn sp = { .argv = argv, .log = log, .fds = fds, .n_fds = 3,
                      .fd_names = "kvroped.socket:kvroped.socket:metrics" };
    pid_t pid = opsd_start(&sp);
    close(ufd);
    close(tfd);
    close(mfd);
    if (opsd_wait_ping(usock, 30000) != 0)
        dump_log(log);
    cr_assert_eq(opsd_ping(usock), 0, "the passed Unix socket");
    char tcp[64];
    snprintf(tcp, sizeof tcp, "tcp:127.0.0.1:%d", tport);
    cr_assert_eq(opsd_ping(tcp), 0, "the passed TCP socket");
    char *body;
    cr_assert_eq(opsd_http(mport, "GET", "/metrics", NULL, &body), 200, "the passed metrics socket");
    cr_assert_eq(opsd_promtool(body), 0);
    cr_assert(opsd_sample(body, "kvrope_requests_total{verb=\"ping\",status=\"OK\"}") >= 2);
    free(body);
    struct stat st;
    cr_assert_neq(stat(other, &st), 0, "the configured socket was not bound");
    cr_assert(opsd_wait_log(log, "(socket activation)", 1000));
    cr_assert_eq(opsd_stop(pid), 0);
    cr_assert_eq(stat(usock, &st), 0, "systemd's socket file is left alone");
}

Test(ops, an_activated_non_unix_non_tcp_fd_is_refused)
{
    char log[320], sock[320];
    sock_and_log(sock, log);
    int p[2];
    cr_assert_eq(pipe(p), 0);
    const char *argv[] = { "--socket", sock, NULL };
    opsd_spawn sp = { .argv = argv, .log = log, .fds = p, .n_fds = 1 };
    pid_t pid = opsd_start(&sp);
    close(p[0]);
    close(p[1]);
    cr_assert_eq(opsd_wait_exit(pid, 30000), 1);
    cr_assert(opsd_wait_log(log, "is not a listening stream socket", 1000));
}

/* ---- issue 12 item 4: only our own socket is unlinked --------------------------- */

Test(ops, a_stopping_daemon_leaves_its_successors_socket)
{
    char sock[320], la[320], lb[320];
    path(sock, sizeof sock, "shared.sock");
    path(la, sizeof la, "a.log");
    path(lb, sizeof lb, "b.log");
    const char *argv[] = { "--socket", sock, "--log-level", "info", NULL };
    opsd_spawn a = { .argv = argv, .log = la }, b = { .argv = argv, .log = lb };
    pid_t pa = opsd_start(&a);
    cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
    cr_assert_eq(unlink(sock), 0);
    pid_t pb = opsd_start(&b);
    cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
    cr_assert(opsd_wait_log(lb, "listening on unix socket", 1000));
    cr_assert_eq(opsd_stop(pa), 0);
    cr_assert(opsd_wait_log(la, "is no longer our socket", 1000));
    cr_assert_eq(opsd_ping(sock), 0, "B is still reachable after A stopped");
    cr_assert_eq(opsd_stop(pb), 0);
    struct stat st;
    cr_assert_neq(lstat(sock, &st), 0, "B removed its own socket");
}

/* ---- issue 12 item 5: the default socket directory must be private --------------- */

static pid_t start_default(const char *xdg, const char *log)
{
    static char env[400];
    snprintf(env, sizeof env, "XDG_RUNTIME_DIR=%s", xdg);
    static const char *envs[2];
    envs[0] = env;
    envs[1] = NULL;
    static const char *argv[] = { "--log-level", "info", NULL };
    opsd_spawn sp = { .argv = argv, .env = envs, .log = log };
    return opsd_start(&sp);
}

Test(ops, the_default_socket_directory_must_be_ours_and_private)
{
    char xdg[320], dir[340], log[320], sock[360], target[320];
    path(xdg, sizeof xdg, "xdg");
    path(log, sizeof log, "d.log");
    path(target, sizeof target, "elsewhere");
    snprintf(dir, sizeof dir, "%s/kvrope", xdg);
    snprintf(sock, sizeof sock, "%s/kvroped.sock", dir);
    cr_assert_eq(mkdir(xdg, 0700), 0);

    /* Writable by others. */
    cr_assert_eq(mkdir(dir, 0777), 0);
    cr_assert_eq(chmod(dir, 0777), 0);
    pid_t pid = start_default(xdg, log);
    cr_assert_eq(opsd_wait_exit(pid, 30000), 1);
    cr_assert(opsd_wait_log(log, "is writable by others (mode 0777): refusing", 1000));
    /* Writable by its group. */
    cr_assert_eq(chmod(dir, 0770), 0);
    pid = start_default(xdg, log);
    cr_assert_eq(opsd_wait_exit(pid, 30000), 1);
    cr_assert(opsd_wait_log(log, "is writable by its group", 1000));
    /* Another user's (needs root to make one). */
    if (geteuid() == 0) {
        cr_assert_eq(chmod(dir, 0700), 0);
        cr_assert_eq(chown(dir, 4242, 4242), 0);
        pid = start_default(xdg, log);
        cr_assert_eq(opsd_wait_exit(pid, 30000), 1);
        cr_assert(opsd_wait_log(log, "belongs to uid 4242", 1000));
    }
    /* A symlink to a directory that is fine in itself. */
    cr_assert_eq(rmdir(dir), 0);
    cr_assert_eq(mkdir(target, 0700), 0);
    cr_assert_eq(symlink(target, dir), 0);
    pid = start_default(xdg, log);
    cr_assert_eq(opsd_wait_exit(pid, 30000), 1);
    cr_assert(opsd_wait_log(log, "is not a directory (a symlink?)", 1000));
    /* Missing: created 0700, and used. */
    cr_assert_eq(unlink(dir), 0);
    pid = start_default(xdg, log);
    cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
    struct stat st;
    cr_assert_eq(lstat(dir, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0700);
    cr_assert_eq(opsd_stop(pid), 0);
    /* Private and ours: used. */
    pid = start_default(xdg, log);
    cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
    cr_assert_eq(opsd_stop(pid), 0);
}

/* The exact case of the issue: a non-root user, no XDG_RUNTIME_DIR, and
 * /tmp/kvrope-$UID made by someone else. Needs root to switch users. */
Test(ops, another_users_tmp_kvrope_dir_is_refused)
{
    if (geteuid() != 0) {
        cr_skip_test("needs root to run kvroped as another user (covered by the XDG test)");
        return;
    }
    const uid_t uid = 4243;
    char dir[64], log[320];
    snprintf(dir, sizeof dir, "/tmp/kvrope-%u", (unsigned)uid);
    path(log, sizeof log, "d.log");
    rmdir(dir);
    cr_assert_eq(mkdir(dir, 0755), 0, "%s: %s", dir, strerror(errno));   /* root's */
    const char *unset[] = { "XDG_RUNTIME_DIR", NULL };
    const char *argv[] = { NULL };
    opsd_spawn sp = { .argv = argv, .unset = unset, .log = log, .uid = uid, .as_user = true };
    pid_t pid = opsd_start(&sp);
    int rc = opsd_wait_exit(pid, 30000);
    rmdir(dir);
    if (rc == 127 || rc == 126 || rc == 125) {
        /* The build tree is not readable by that user (a private checkout). */
        cr_skip_test("cannot run %s/kvroped as uid %u (exit %d); the XDG test covers the rule",
                     testd_build_dir(), (unsigned)uid, rc);
        return;
    }
    if (rc != 1)
        dump_log(log);
    cr_assert_eq(rc, 1);
    cr_assert(opsd_wait_log(log, "belongs to uid 0, not to us (uid 4243): refusing", 1000));
}

/* Issue 29 item 9: refused, as sshd refuses a private key others can read
 * (it was only a warning), with the mode to use; --check-config too. */
Test(ops, a_token_file_others_can_read_is_refused)
{
    char sock[320], log[320], tok[320], conf[320];
    sock_and_log(sock, log);
    path(tok, sizeof tok, "token");
    path(conf, sizeof conf, "c.conf");
    cr_assert_eq(opsd_write_file(tok, "t\n", 0644), 0);
    const char *argv[] = { "--socket", sock, "--listen", "127.0.0.1:0", "--auth-token-file", tok,
                           NULL };
    opsd_spawn sp = { .argv = argv, .log = log };
    pid_t pid = opsd_start(&sp);
    cr_assert_eq(opsd_wait_exit(pid, 30000), 1);
    cr_assert(opsd_wait_log(log, "can be read or written by other users (mode 0644): refusing",
                            1000));
    cr_assert(opsd_wait_log(log, "chmod 600 it", 1000));
    /* Its group only: refused too. */
    cr_assert_eq(chmod(tok, 0640), 0);
    pid = opsd_start(&sp);
    cr_assert_eq(opsd_wait_exit(pid, 30000), 1);
    cr_assert(opsd_wait_log(log, "by its group (mode 0640): refusing", 1000));
    char text[700];
    snprintf(text, sizeof text, "listen = 127.0.0.1:0\nauth-token-file = %s\n", tok);
    cr_assert_eq(opsd_write_file(conf, text, 0600), 0);
    char out[2048];
    cr_assert_eq(check_config(conf, out, sizeof out), 1);
    cr_assert(strstr(out, "refusing") && strstr(out, "chmod 600"), "%s", out);
    /* 0600 and 0400: used. */
    const mode_t ok[] = { 0600, 0400 };
    for (size_t i = 0; i < 2; i++) {
        cr_assert_eq(chmod(tok, ok[i]), 0);
        pid = opsd_start(&sp);
        cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
        cr_assert_eq(opsd_stop(pid), 0);
    }
}

/* Issue 29 item 9: a --socket in a directory every user can write to
 * (sticky, like /tmp) starts with a warning that says why. */
Test(ops, a_socket_in_a_world_writable_directory_is_warned_about)
{
    char shared[320], sock[360], log[320];
    path(shared, sizeof shared, "shared");
    path(log, sizeof log, "d.log");
    snprintf(sock, sizeof sock, "%s/kv.sock", shared);
    cr_assert_eq(mkdir(shared, 0700), 0);
    cr_assert_eq(chmod(shared, 01777), 0);
    const char *argv[] = { "--socket", sock, NULL };
    opsd_spawn sp = { .argv = argv, .log = log };
    pid_t pid = opsd_start(&sp);
    cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
    cr_assert(opsd_wait_log(log, "a directory every user can write to (mode 1777): another "
                            "user can create this path before us", 1000));
    cr_assert_eq(opsd_stop(pid), 0);
    /* A private directory: no warning. */
    cr_assert_eq(chmod(shared, 0700), 0);
    pid = opsd_start(&sp);
    cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
    cr_assert_eq(opsd_stop(pid), 0);
    char *t = opsd_slurp(log, NULL);
    cr_assert(t && !strstr(t, "every user can write"), "%s", t);
    free(t);
}

/* ---- tenants and --prefault in the figures ---------------------------------- */

/* Two models on one daemon with --max-memory-per-model: one floods with
 * puts, the other keeps its hot contexts. /metrics carries both as
 * tenants (bytes, evictions, matches, refusals by model label) from the
 * same snapshot the stats verb lists, and promtool accepts it. */
Test(ops, tenants_are_figures_in_metrics_and_stats)
{
    char sock[320], log[320];
    path(sock, sizeof sock, "t.sock");
    path(log, sizeof log, "t.log");
    const char *argv[] = { "--socket", sock, "--metrics-listen", "127.0.0.1:0", "--max-memory", "16M",
                           "--max-memory-per-model", "1M", NULL };
    int port;
    pid_t pid = start_metrics(argv, log, log, sock, &port);

    kvr_client *c = connect_with_models(sock, "hot", "flood");
    enum { T = 256, HOT = 4, FLOOD = 40 };
    size_t ctx_bytes = kvr_payload_size(T_LAYERS, T, T_HEADS, T_DIM, KVR_DTYPE_F16);
    for (int i = 0; i < HOT; i++) {
        char id[16];
        snprintf(id, sizeof id, "h%d", i);
        cr_assert_eq(testd_put(c, id, "hot", KVR_DTYPE_F16, (uint32_t)i, 1000u * (uint32_t)i, 0, T), 0);
    }
    for (int i = 0; i < FLOOD; i++) {
        char id[16];
        snprintf(id, sizeof id, "f%d", i);
        cr_assert_eq(testd_put(c, id, "flood", KVR_DTYPE_F16, 100u + (uint32_t)i,
                               100000u + 1000u * (uint32_t)i, 0, T), 0, "%s", kvr_client_last_error(c));
    }
    /* The hot set: every context still whole, and a match of each hits. */
    for (int i = 0; i < HOT; i++) {
        char id[16];
        snprintf(id, sizeof id, "h%d", i);
        kvr_kv kv;
        kvr_get_args ga = { .ctx_id = id, .dtype = KVR_DTYPE_F16 };
        cr_assert_eq(kvr_client_get(c, &ga, &kv), 0, "%s: %s", id, kvr_client_last_error(c));
        cr_assert_eq(kv.n_tokens, T);
        kvr_kv_release(&kv);
        uint32_t *tok = testd_tokens(1000u * (uint32_t)i, T);
        kvr_match_args ma = { .model = "hot", .tokens = tok, .n_tokens = T };
        kvr_match_res mr;
        cr_assert_eq(kvr_client_match(c, &ma, &mr), 0, "%s", kvr_client_last_error(c));
        cr_assert_eq(mr.length, T);
        free(tok);
    }

    char *m = scrape(port);
    cr_assert_eq(opsd_promtool(m), 0);
    double flood_bytes = sample(m, "kvrope_model_bytes{model=\"flood\"}");
    double hot_bytes = sample(m, "kvrope_model_bytes{model=\"hot\"}");
    cr_assert(flood_bytes > 0 && flood_bytes <= 1024.0 * 1024, "flood holds %g bytes", flood_bytes);
    cr_assert(hot_bytes >= (double)(HOT * ctx_bytes), "hot holds %g bytes", hot_bytes);
    cr_assert(sample(m, "kvrope_model_evicted_blocks_total{model=\"flood\"}") > 0);
    cr_assert(sample(m, "kvrope_model_evicted_bytes_total{model=\"flood\"}") > 0);
    cr_assert_eq(sample(m, "kvrope_model_evicted_blocks_total{model=\"hot\"}"), 0);
    cr_assert_eq(sample(m, "kvrope_model_prefix_matches_total{model=\"hot\"}"), HOT);
    cr_assert_eq(sample(m, "kvrope_model_prefix_match_hits_total{model=\"hot\"}"), HOT);
    cr_assert_eq(sample(m, "kvrope_model_prefix_matches_total{model=\"flood\"}"), 0);
    cr_assert_eq(sample(m, "kvrope_model_refused_writes_total{model=\"hot\"}"), 0);
    /* The stats verb lists the same figures (no traffic in between). */
    cr_assert_eq(testd_metric(c, "model_flood_bytes"), flood_bytes);
    cr_assert_eq(testd_metric(c, "model_hot_bytes"), hot_bytes);
    cr_assert_eq(testd_metric(c, "model_hot_match_hits"), HOT);
    cr_assert(testd_metric(c, "model_flood_evicted_blocks") > 0);
    free(m);
    kvr_client_close(c);
    cr_assert_eq(opsd_stop(pid), 0);
}

#ifdef KVR_JEMALLOC   /* only the prefault test reads it, in jemalloc builds */
static long rss_kib(pid_t pid)
{
    char p[64], line[256];
    snprintf(p, sizeof p, "/proc/%ld/status", (long)pid);
    FILE *f = fopen(p, "r");
    long v = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &v) == 1)
            break;
    if (f)
        fclose(f);
    return v;
}
#endif

/* --prefault faults memory in at start, in the background, and leaves it
 * mapped: its figures say how much and how long, the daemon's RSS holds
 * it, puts and gets work during and after it, and `cap` stops at the cap.
 * Without jemalloc (sanitizer builds) it says so and does nothing. */
Test(ops, prefault_warms_memory_and_reports_it)
{
    char sock[320], log[320];
    path(sock, sizeof sock, "p.sock");
    path(log, sizeof log, "p.log");
    const char *argv[] = { "--socket", sock, "--max-memory", "48M", "--prefault", "cap", NULL };
    opsd_spawn sp = { .argv = argv, .log = log };
    pid_t pid = opsd_start(&sp);
    cr_assert(pid > 0);
    cr_assert_eq(opsd_wait_ping(sock, 30000), 0);
    kvr_client *c = connect_with_models(sock, "m", NULL);
    cr_assert_eq(testd_put(c, "a", "m", KVR_DTYPE_F16, 1, 0, 0, 300), 0);
#ifdef KVR_JEMALLOC
    double bytes = 0;
    for (int i = 0; i < 600 && (bytes = testd_metric(c, "prefault_bytes")) <= 0; i++)
        usleep(50 * 1000);
    /* Up to the cap, less what the store held when it began. */
    cr_assert(bytes >= 40.0 * 1024 * 1024 && bytes <= 48.0 * 1024 * 1024,
              "prefaulted %g bytes", bytes);
    cr_assert(testd_metric(c, "prefault_seconds") > 0);
    cr_assert(rss_kib(pid) >= 40 * 1024, "RSS %ld KiB after a 48 MiB prefault", rss_kib(pid));
    cr_assert(opsd_wait_log(log, "prefault: ", 1000));
#else
    cr_assert(opsd_wait_log(log, "prefault: not in this build", 10000));
    cr_assert_eq(testd_metric(c, "prefault_bytes"), 0);
#endif
    /* The store is unharmed: the context reads back, more puts land. */
    cr_assert_eq(testd_put(c, "b", "m", KVR_DTYPE_F16, 2, 0, 0, 300), 0);
    kvr_kv kv;
    kvr_get_args ga = { .ctx_id = "a", .dtype = KVR_DTYPE_F16 };
    cr_assert_eq(kvr_client_get(c, &ga, &kv), 0, "%s", kvr_client_last_error(c));
    cr_assert_eq(kv.n_tokens, 300);
    kvr_kv_release(&kv);
    kvr_client_close(c);
    cr_assert_eq(opsd_stop(pid), 0);
}
