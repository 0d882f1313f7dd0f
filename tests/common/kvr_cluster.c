/*
 * kvr_cluster.c — tests/common/kvr_cluster.h: a local Redis Cluster for the tests.
 * Compiled once into libtestcommon.a.
 */
#include "tests/common/kvr_cluster.h"

const char *tcluster_script(char *buf, size_t cap)
{
    const char *s = getenv("KVR_SCRIPTS");
    snprintf(buf, cap, "%s/redis-cluster.sh", s && *s ? s : "scripts");
    return buf;
}

int tcluster_start(kvr_tcluster *t)
{
    memset(t, 0, sizeof *t);
    snprintf(t->dir, sizeof t->dir, "/tmp/kvr-rcl-XXXXXX");
    if (!mkdtemp(t->dir))
        return -1;
    tcluster_script(t->script, sizeof t->script);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s start %s %d >/dev/null", t->script, t->dir, (int)getpid());
    if (system(cmd) != 0) {
        fprintf(stderr, "tcluster: start failed\n");
        return -1;
    }
    char pf[256];
    snprintf(pf, sizeof pf, "%s/ports", t->dir);
    FILE *f = fopen(pf, "r");
    if (!f)
        return -1;
    int n = 0;
    while (n < 6 && fscanf(f, "%d", &t->ports[n]) == 1)
        n++;
    fclose(f);
    if (n != 6)
        return -1;
    snprintf(t->seeds, sizeof t->seeds, "127.0.0.1:%d,127.0.0.1:%d", t->ports[0], t->ports[1]);
    return 0;
}

void tcluster_stop(kvr_tcluster *t)
{
    if (!t->dir[0])
        return;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s stop %s; rm -rf %s", t->script, t->dir, t->dir);
    if (system(cmd) != 0)
        fprintf(stderr, "tcluster: stop failed\n");
    t->dir[0] = '\0';
}

int tcluster_cli_for(const kvr_tcluster *t, int port, const char *args, char *out,
                     size_t cap, int secs)
{
    (void)t;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "timeout %d redis-cli -h 127.0.0.1 -p %d %s 2>&1", secs, port,
             args);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = out ? fread(out, 1, cap ? cap - 1 : 0, p) : 0;
    if (out && cap)
        out[n] = '\0';
    if (!out) {
        char sink[256];
        while (fread(sink, 1, sizeof sink, p) > 0) {
        }
    }
    return pclose(p);
}

int tcluster_cli(const kvr_tcluster *t, int port, const char *args, char *out,
                 size_t cap)
{
    return tcluster_cli_for(t, port, args, out, cap, 20);
}

int tcluster_kill(const kvr_tcluster *t, int port)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s kill %s %d", t->script, t->dir, port);
    return system(cmd);
}

int tcluster_wait_ok(const kvr_tcluster *t, int secs)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s wait %s %d", t->script, t->dir, secs);
    return system(cmd);
}

int tcluster_master_of(const kvr_tcluster *t, unsigned slot)
{
    char out[8192];
    for (int k = 0; k < 6; k++) {
        char ofile[256];
        snprintf(ofile, sizeof ofile, "%s/%d/dead", t->dir, t->ports[k]);
        if (access(ofile, F_OK) == 0)
            continue;
        /* cluster nodes: "<id> ip:port@bus flags master - ... connected 0-5460 ..." */
        if (tcluster_cli(t, t->ports[k], "cluster nodes", out, sizeof out) != 0)
            continue;
        char *line = strtok(out, "\n");
        while (line) {
            if (strstr(line, "master") && !strstr(line, "fail")) {
                char *addr = strchr(line, ' ');
                int port = addr ? atoi(strchr(addr, ':') + 1) : -1;
                /* slot ranges are the 9th field onwards */
                char *p = line;
                for (int f = 0; f < 8 && p; f++) {
                    p = strchr(p, ' ');
                    if (p)
                        p++;
                }
                while (p && *p) {
                    unsigned lo, hi;
                    int used = 0;
                    if (*p == '[') {
                        p = strchr(p, ' ');
                        if (p)
                            p++;
                        continue;
                    }
                    if (sscanf(p, "%u-%u%n", &lo, &hi, &used) == 2) {
                    } else if (sscanf(p, "%u%n", &lo, &used) == 1) {
                        hi = lo;
                    } else {
                        break;
                    }
                    if (slot >= lo && slot <= hi)
                        return port;
                    p += used;
                    while (*p == ' ')
                        p++;
                }
            }
            line = strtok(NULL, "\n");
        }
        return -1;
    }
    return -1;
}
