/*
 * bench_shm.c — shared memory against the Unix socket, Redis and memcpy
 * (issue 14), all measured in the same run (never asserted; ratios matter,
 * absolute figures on a shared machine do not).
 *
 *  - get and put of 1 MiB and 64 MiB payloads, 1 and 4 client threads:
 *    kvrope through a registered memfd region (the daemon's workers write
 *    the get into it / copy the put out of it), kvrope over the Unix socket
 *    (into a caller buffer), Redis GET/SET of the same bytes, and memcpy of
 *    the same bytes between two buffers of this process (one memcpy per
 *    client thread), which is the ceiling a local copy can reach.
 *  - the shared-memory get again with every key re-rotated (positions moved
 *    by 1000), 1 client, 64 MiB.
 *  Puts create a context and delete an older one (a cache's steady state);
 *  Redis SET overwrites.
 *
 * Goals (issue 14), one line each: shm get >= 0.8x memcpy (1 client,
 * 64 MiB, stored positions); re-rotated shm get >= 0.7x memcpy; shm put >=
 * 0.7x memcpy (1 client, 64 MiB).
 *
 * Binaries: $KVR_BUILD/kvroped (default ./build); redis-server from PATH.
 * Duration per cell: $KVR_BENCH_SECONDS (default 1.0).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/kvrope.h"

#include "tests/common/kvr_bench_redis.h"

/* ---- the runs ----------------------------------------------------------- */

/* Model: 4 layers x 8 kv heads x 128 dims, f16: 16 KiB per token. */
#define B_LAYERS 4
#define B_HEADS  8
#define B_DIM    128
#define TOKEN_BYTES ((size_t)B_LAYERS * 2 * B_HEADS * B_DIM * 2)

typedef enum { OP_PUT, OP_GET } op_kind;
typedef enum { M_MEMCPY, M_SHM, M_UNIX, M_REDIS, M_SHM_ROT } mode_kind;

typedef struct job {
    int         id;
    op_kind     op;
    mode_kind   mode;
    size_t      bytes;
    double      seconds;
    const char *kvr_addr, *redis_sock;
    long        ops;
    int         err;
    pthread_barrier_t *bar;
} job;

static void *run_job(void *arg)
{
    job *j = arg;
    size_t n_tokens = j->bytes / TOKEN_BYTES;
    uint8_t *buf = malloc(j->bytes), *dst = NULL;
    memset(buf, 0x3c, j->bytes);   /* finite f16 values */
    uint32_t *tok = malloc(n_tokens * sizeof *tok);
    int64_t *pos = malloc(n_tokens * sizeof *pos);
    for (size_t i = 0; i < n_tokens; i++) {
        tok[i] = (uint32_t)(j->id * 1000003 + i);
        pos[i] = (int64_t)i + 1000;
    }
    kvr_client *c = NULL;
    resp r = { .fd = -1 };
    char key[64];
    snprintf(key, sizeof key, "fixed-%d-%zu", j->id, j->bytes);
    uint32_t region = 0;
    uint8_t *rbase = NULL;
    /* Contexts a put keeps alive: the memory cap holds 4 clients' worth. */
    long keep = j->bytes >= (16u << 20) ? 1 : 16;
    if (j->mode == M_MEMCPY) {
        dst = malloc(j->bytes);
        memset(dst, 0, j->bytes);
    } else if (j->mode == M_REDIS) {
        if (resp_connect(&r, j->redis_sock) < 0)
            j->err = 1;
        else if (j->op == OP_GET && resp_set(&r, key, buf, j->bytes) < 0)
            j->err = 1;
    } else {
        if (kvr_client_connect(&c, j->kvr_addr, NULL) < 0) {
            j->err = 1;
        } else {
            if (j->mode != M_UNIX) {
                void *b;
                if (kvr_client_region_create(c, j->bytes, &region, &b) < 0) {
                    fprintf(stderr, "bench: region: %s\n", kvr_client_last_error(c));
                    j->err = 1;
                } else {
                    rbase = b;
                    memcpy(rbase, buf, j->bytes);   /* faulted in, finite values */
                }
            }
            if (!j->err && j->op == OP_GET) {
                kvr_put_args p = { .ctx_id = key, .model = "bench", .dtype = KVR_DTYPE_F16,
                                   .tokens = tok, .n_tokens = n_tokens, .payload = buf,
                                   .payload_len = j->bytes };
                (void)kvr_client_delete(c, key);
                if (kvr_client_put(c, &p, NULL) < 0)
                    j->err = 1;
            }
        }
    }
    pthread_barrier_wait(j->bar);
    double t0 = now_s(), end = t0 + j->seconds;
    long ops = 0;
    char id[64], old[64];
    while (!j->err && now_s() < end) {
        int rc = 0;
        if (j->mode == M_MEMCPY) {
            if (j->op == OP_GET)
                memcpy(dst, buf, j->bytes);
            else
                memcpy(buf, dst, j->bytes);
            __asm__ volatile("" : : "r"(dst), "r"(buf) : "memory");
        } else if (j->mode == M_REDIS) {
            rc = j->op == OP_PUT ? resp_set(&r, key, buf, j->bytes)
                                 : resp_get(&r, key, buf, j->bytes);
        } else if (j->op == OP_PUT) {
            snprintf(id, sizeof id, "p%d-%ld", j->id, ops);
            kvr_put_args p = { .ctx_id = id, .model = "bench", .dtype = KVR_DTYPE_F16,
                               .mode = KVR_PUT_CREATE, .tokens = tok,
                               .n_tokens = n_tokens };
            if (j->mode == M_UNIX) {
                p.payload = buf;
                p.payload_len = j->bytes;
                rc = kvr_client_put(c, &p, NULL);
            } else {
                kvr_shm at = { region, 0, j->bytes };
                rc = kvr_client_put_shm(c, &p, &at, NULL);
            }
            if (rc == 0 && ops >= keep) {
                snprintf(old, sizeof old, "p%d-%ld", j->id, ops - keep);
                rc = kvr_client_delete(c, old);
            }
        } else {
            kvr_kv kv;
            kvr_get_args g = { .ctx_id = key, .dtype = KVR_DTYPE_F16, .dst = buf,
                               .dst_cap = j->bytes };
            if (j->mode == M_SHM_ROT) {
                g.positions = pos;
                g.n_positions = n_tokens;
            }
            if (j->mode == M_UNIX) {
                rc = kvr_client_get(c, &g, &kv);
            } else {
                kvr_shm at = { region, 0, j->bytes };
                rc = kvr_client_get_shm(c, &g, &at, &kv);
            }
            if (rc == 0 && kv.payload_len != j->bytes)
                rc = -1;
            kvr_kv_release(&kv);
        }
        if (rc < 0) {
            if (!j->err)
                fprintf(stderr, "bench: mode %d %s failed: %d %s\n", (int)j->mode,
                        j->op == OP_PUT ? "put" : "get", rc, c ? kvr_client_last_error(c) : "");
            j->err = 1;
            break;
        }
        ops++;
    }
    j->seconds = now_s() - t0;
    j->ops = ops;
    if (c) {
        for (long k = ops - keep; k < ops && j->op == OP_PUT; k++) {
            if (k < 0)
                continue;
            snprintf(old, sizeof old, "p%d-%ld", j->id, k);
            (void)kvr_client_delete(c, old);
        }
        if (j->op == OP_GET)
            (void)kvr_client_delete(c, key);
        kvr_client_close(c);
    }
    if (r.fd >= 0)
        close(r.fd);
    free(buf);
    free(dst);
    free(tok);
    free(pos);
    return NULL;
}

/* Returns MiB/s of payload over all threads, or -1 on error. */
static double run(op_kind op, mode_kind mode, size_t bytes, int threads, const char *kvr_addr,
                  const char *redis_sock, double seconds)
{
    pthread_t th[16];
    job jobs[16];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++) {
        jobs[i] = (job){ .id = i, .op = op, .mode = mode, .bytes = bytes, .seconds = seconds,
                         .kvr_addr = kvr_addr, .redis_sock = redis_sock, .bar = &bar };
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    }
    double mbs = 0;
    int err = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        err |= jobs[i].err;
        if (jobs[i].ops == 0)
            err = 1;
        mbs += (double)jobs[i].ops * (double)bytes / jobs[i].seconds / (1024.0 * 1024.0);
    }
    pthread_barrier_destroy(&bar);
    return err ? -1 : mbs;
}

static void goal_line(const char *what, double v, double base, double want)
{
    if (v > 0 && base > 0)
        printf("goal: %s >= %.1fx memcpy: %.2fx (%s)\n", what, want, v / base,
               v / base >= want ? "met" : "not met");
    else
        printf("goal: %s >= %.1fx memcpy: no figure (not met)\n", what, want);
}

int main(void)
{
    const char *b = getenv("KVR_BUILD");
    const char *secs = getenv("KVR_BENCH_SECONDS");
    double seconds = secs ? atof(secs) : 1.0;
    if (seconds <= 0)
        seconds = 1.0;
    char dir[] = "/tmp/kvr-bshm-XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    char kvsock[128], rsock[128], kvlog[128], rlog[128], bin[512], addr[160];
    snprintf(kvsock, sizeof kvsock, "%s/kvroped.sock", dir);
    snprintf(rsock, sizeof rsock, "%s/redis.sock", dir);
    snprintf(kvlog, sizeof kvlog, "%s/kvroped.log", dir);
    snprintf(rlog, sizeof rlog, "%s/redis.log", dir);
    snprintf(bin, sizeof bin, "%s/kvroped", b && *b ? b : "./build");
    snprintf(addr, sizeof addr, "unix:%s", kvsock);

    const char *kv_argv[] = { bin, "--socket", kvsock, "--max-memory", "4G", "--log-level",
                              "warn", NULL };
    pid_t kvpid = spawn(kv_argv, kvlog);
    const char *r_argv[] = { "redis-server", "--port", "0", "--unixsocket", rsock,
                             "--save", "", "--appendonly", "no", "--dir", dir, NULL };
    pid_t rpid = spawn(r_argv, rlog);

    kvr_client *c = NULL;
    for (int i = 0; i < 500 && !c; i++) {
        if (kvr_client_connect(&c, addr, NULL) < 0) {
            c = NULL;
            sleep_ms(10);
        }
    }
    int have_redis = 0;
    for (int i = 0; i < 500 && !have_redis; i++) {
        resp r;
        if (resp_connect(&r, rsock) == 0) {
            have_redis = 1;
            close(r.fd);
        } else {
            sleep_ms(10);
        }
    }
    if (!c) {
        fprintf(stderr, "bench_shm: kvroped (%s) did not start; see %s\n", bin, kvlog);
        stop(kvpid);
        stop(rpid);
        return 1;
    }
    if (!have_redis)
        fprintf(stderr, "bench_shm: redis-server did not start; Redis columns absent\n");
    kvr_rope_config rc;
    kvr_rope_config_init(&rc);
    kvr_model_params mp = { .name = "bench", .n_layers = B_LAYERS, .n_kv_heads = B_HEADS,
                            .head_dim = B_DIM, .dtype = KVR_DTYPE_F16, .rope = &rc };
    if (kvr_client_model_register(c, &mp, NULL) < 0) {
        fprintf(stderr, "bench_shm: register: %s\n", kvr_client_last_error(c));
        stop(kvpid);
        stop(rpid);
        return 1;
    }
    kvr_client_close(c);

    printf("shared memory vs Unix socket vs redis-server vs memcpy, %.1f s per cell "
           "(MiB/s of payload over all clients, higher is better)\n\n", seconds);
    printf("| op | size | clients | memcpy | kvrope shm | kvrope unix | redis | shm/memcpy "
           "| unix/redis |\n");
    printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    const size_t sizes[] = { 1u << 20, 64u << 20 };
    const int clients[] = { 1, 4 };
    double g_get = -1, g_get_base = -1, g_put = -1, g_put_base = -1;
    for (int op = 0; op < 2; op++)
        for (int s = 0; s < 2; s++)
            for (int k = 0; k < 2; k++) {
                op_kind o = op == 0 ? OP_GET : OP_PUT;
                double mc = run(o, M_MEMCPY, sizes[s], clients[k], addr, rsock, seconds);
                double sh = run(o, M_SHM, sizes[s], clients[k], addr, rsock, seconds);
                double ux = run(o, M_UNIX, sizes[s], clients[k], addr, rsock, seconds);
                double rd = have_redis ? run(o, M_REDIS, sizes[s], clients[k], addr, rsock,
                                             seconds) : -1;
                char r1[32] = "n/a", r2[32] = "n/a";
                if (sh > 0 && mc > 0)
                    snprintf(r1, sizeof r1, "%.2fx", sh / mc);
                if (ux > 0 && rd > 0)
                    snprintf(r2, sizeof r2, "%.2fx", ux / rd);
                if (s == 1 && k == 0) {
                    if (o == OP_GET) {
                        g_get = sh;
                        g_get_base = mc;
                    } else {
                        g_put = sh;
                        g_put_base = mc;
                    }
                }
                printf("| %s | %s | %d | %.0f | %.0f | %.0f | %.0f | %s | %s |\n",
                       o == OP_GET ? "get" : "put", s ? "64 MiB" : "1 MiB", clients[k], mc, sh,
                       ux, rd, r1, r2);
                fflush(stdout);
            }
    double rot = run(OP_GET, M_SHM_ROT, 64u << 20, 1, addr, rsock, seconds);
    printf("\nre-rotated shm get (every key moved by 1000 positions), 64 MiB, 1 client: "
           "%.0f MiB/s (memcpy %.0f)\n\n", rot, g_get_base);
    goal_line("shm get, 1 client, 64 MiB, stored positions", g_get, g_get_base, 0.8);
    goal_line("re-rotated shm get, 1 client, 64 MiB", rot, g_get_base, 0.7);
    goal_line("shm put, 1 client, 64 MiB", g_put, g_put_base, 0.7);

    stop(kvpid);
    stop(rpid);
    unlink(kvsock);
    unlink(rsock);
    unlink(kvlog);
    unlink(rlog);
    char dump[200];
    snprintf(dump, sizeof dump, "%s/dump.rdb", dir);
    unlink(dump);
    rmdir(dir);
    return 0;
}
