/*
 * kvr_opsd.c — tests/common/kvr_opsd.h: spawning and probing daemons from the operations tests.
 * Compiled once into libtestcommon.a.
 */
#include "tests/common/kvr_opsd.h"

pid_t opsd_start(const opsd_spawn *s)
{
    char bin[512];
    snprintf(bin, sizeof bin, "%s/kvroped", testd_build_dir());
    const char *argv[64];
    int n = 0;
    argv[n++] = bin;
    for (int i = 0; s->argv && s->argv[i] && n < 63; i++)
        argv[n++] = s->argv[i];
    argv[n] = NULL;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent)
        _exit(127);
    int fd = open(s->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        if (s->as_user && fchown(fd, s->uid, s->uid) < 0)
            _exit(126);
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
    }
    for (int i = 0; s->env && s->env[i]; i++)
        putenv((char *)(uintptr_t)s->env[i]);
    for (int i = 0; s->unset && s->unset[i]; i++)
        unsetenv(s->unset[i]);
    if (s->n_fds > 0) {
        /* Move them out of the way first, then to 3.. (no clobbering). */
        int tmp[16];
        for (int i = 0; i < s->n_fds && i < 16; i++)
            tmp[i] = fcntl(s->fds[i], F_DUPFD, 100);
        for (int i = 0; i < s->n_fds && i < 16; i++) {
            dup2(tmp[i], 3 + i);
            close(tmp[i]);
        }
        char v[32];
        snprintf(v, sizeof v, "%ld", (long)getpid());
        setenv("LISTEN_PID", v, 1);
        snprintf(v, sizeof v, "%d", s->n_fds);
        setenv("LISTEN_FDS", v, 1);
        if (s->fd_names)
            setenv("LISTEN_FDNAMES", s->fd_names, 1);
    }
    if (s->as_user && (setgid(s->uid) < 0 || setuid(s->uid) < 0))
        _exit(125);
    execv(bin, (char *const *)(uintptr_t)argv);
    _exit(127);
}

char *opsd_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    for (;;) {
        if (n + 1 >= cap)
            b = realloc(b, cap *= 2);
        size_t r = fread(b + n, 1, cap - n - 1, f);
        if (r == 0)
            break;
        n += r;
    }
    fclose(f);
    b[n] = 0;
    if (len)
        *len = n;
    return b;
}

int opsd_wait_log(const char *path, const char *needle, int ms)
{
    for (int i = 0; i <= ms / 10; i++) {
        char *t = opsd_slurp(path, NULL);
        int ok = t && strstr(t, needle);
        free(t);
        if (ok)
            return 1;
        kvt_sleep_ms(10);
    }
    return 0;
}

int opsd_wait_exit(pid_t pid, int ms)
{
    for (int i = 0; i <= ms / 10; i++) {
        int st;
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (w < 0)
            return -1;
        kvt_sleep_ms(10);
    }
    return -1;
}

int opsd_stop(pid_t pid)
{
    if (pid <= 0)
        return -1;
    kill(pid, SIGTERM);
    int rc = opsd_wait_exit(pid, 20000);
    if (rc == -1) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    return rc;
}

int opsd_metrics_port(const char *log)
{
    if (!opsd_wait_log(log, "metrics on http://", 30000))
        return -1;
    char *t = opsd_slurp(log, NULL);
    char *p = t ? strstr(t, "metrics on http://") : NULL;
    int port = -1;
    if (p) {
        p = strchr(p + 18, ':');
        while (p && p[1] && p[1] != '/' && !(p[1] >= '0' && p[1] <= '9'))
            p = strchr(p + 1, ':');
        if (p)
            port = atoi(p + 1);
    }
    free(t);
    return port;
}

int opsd_http(int port, const char *method, const char *path, const char *hdr,
              char **body)
{
    if (body)
        *body = NULL;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = { 30, 0 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        close(fd);
        return -1;
    }
    char req[1024];
    int n = snprintf(req, sizeof req, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s%s\r\n",
                     method, path, hdr ? hdr : "", hdr ? "\r\n" : "");
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 1 >= cap)
            buf = realloc(buf, cap *= 2);
        ssize_t r = read(fd, buf + len, cap - len - 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    close(fd);
    buf[len] = 0;
    int status = -1;
    if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1)
        status = -1;
    char *b = strstr(buf, "\r\n\r\n");
    if (body)
        *body = strdup(b ? b + 4 : "");
    free(buf);
    return status;
}

double opsd_sample(const char *text, const char *series)
{
    size_t sl = strlen(series);
    for (const char *p = text; p && *p;) {
        if (!strncmp(p, series, sl) && p[sl] == ' ')
            return strtod(p + sl + 1, NULL);
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    return -1;
}

int opsd_promtool(const char *text)
{
    char path[] = "/tmp/kvr-prom-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0)
        return -1;
    size_t n = strlen(text);
    if (write(fd, text, n) != (ssize_t)n) {
        close(fd);
        unlink(path);
        return -1;
    }
    close(fd);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "timeout 60 promtool check metrics < %s > %s.out 2>&1", path, path);
    int rc = system(cmd);
    char out[640];
    snprintf(out, sizeof out, "%s.out", path);
    if (rc != 0) {
        char *t = opsd_slurp(out, NULL);
        fprintf(stderr, "promtool check metrics failed (%d):\n%s\n", rc, t ? t : "");
        free(t);
    }
    unlink(out);
    unlink(path);
    return rc == 0 ? 0 : 1;
}

int opsd_write_file(const char *path, const char *text, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
    if (fd < 0)
        return -1;
    size_t n = strlen(text);
    int ok = write(fd, text, n) == (ssize_t)n;
    close(fd);
    chmod(path, mode);
    return ok ? 0 : -1;
}

int opsd_ping(const char *addr)
{
    kvr_client *c;
    if (kvr_client_connect(&c, addr, NULL) < 0)
        return -1;
    int r = kvr_client_ping(c, NULL);
    kvr_client_close(c);
    return r;
}

int opsd_wait_ping(const char *addr, int ms)
{
    for (int i = 0; i <= ms / 10; i++) {
        if (opsd_ping(addr) == 0)
            return 0;
        kvt_sleep_ms(10);
    }
    return -1;
}
