/*
 * bench_assemble.c — assemble (APE) of one prefix and 16 documents in the
 * Llama-3-8B KV shape (32 layers, 8 kv heads, head_dim 128, f16), parallel
 * and sequential, against plain gets of the same bytes. Each operation is
 * begin + work + a copy of the payload iovecs into one buffer (what sending
 * it costs at least) + end. Never asserted; prints a markdown table.
 *
 * Every row is timed interleaved with the plain gets (best of each, ratio
 * of bests), so a shared machine swings both alike.
 *
 *   KVR_BENCH_DOCS (16), KVR_BENCH_DOC_TOKENS (2048), KVR_BENCH_PREFIX (512),
 *   KVR_BENCH_REPS (5)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/cache.h"
#include "tests/common/kvt_bench.h"
#include "tests/common/kvt_bench_put.h"

#define NLAY 32
#define NH 8
#define HD 128

static void put(kvr_store *s, const char *id, const char *prefix, size_t n, uint32_t tok0)
{
    uint32_t *t = malloc(n * sizeof *t);
    for (size_t i = 0; i < n; i++)
        t[i] = tok0 + (uint32_t)i;
    kvr_put_params p = { .ctx_id = id, .model = "llama3-8b", .mode = KVR_PUT_CREATE,
                         .n_layers = NLAY, .n_kv_heads = NH, .head_dim = HD,
                         .dtype = KVR_DTYPE_F16, .n_tokens = n, .tokens = t,
                         .prefix_ctx = prefix };
    kvr_put *x = NULL;
    kvr_error e = { 0 };
    if (kvr_store_put_begin(s, &p, &x, &e) != 0) {
        fprintf(stderr, "put %s: %s\n", id, e.msg);
        exit(1);
    }
    kvt_put_fill_f16(x);
    kvr_put_result r;
    if (kvr_put_commit(x, &r, &e) != 0) {
        fprintf(stderr, "commit %s: %s\n", id, e.msg);
        exit(1);
    }
    free(t);
}

static size_t gather(const struct iovec *iov, size_t n, char *dst)
{
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(dst + off, iov[i].iov_base, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    return off;
}

/* Plain gets of prefix + every document into out; seconds. */
static double plain_gets(kvr_store *s, char **ids, size_t ND, char *out)
{
    kvr_error e = { 0 };
    double t0 = kvt_now_s();
    size_t off = 0;
    for (size_t i = 0; i <= ND; i++) {
        kvr_get_params gp = { .ctx_id = i ? ids[i - 1] : "prefix", .end = SIZE_MAX,
                              .dtype = KVR_DTYPE_F16 };
        kvr_get *g = NULL;
        kvr_store_get_begin(s, &gp, &g, &e);
        kvr_get_work(g, &e);
        const struct iovec *iov;
        size_t niov;
        kvr_get_payload_iov(g, &iov, &niov);
        off += gather(iov, niov, out + off);
        kvr_get_end(g);
    }
    return kvt_now_s() - t0;
}

int main(void)
{
    size_t ND = kvt_env_size("KVR_BENCH_DOCS", 16), LD = kvt_env_size("KVR_BENCH_DOC_TOKENS", 2048);
    size_t P = kvt_env_size("KVR_BENCH_PREFIX", 512);
    kvr_store *s = NULL;
    kvr_store_config cfg = { .block_tokens = 64 };
    kvr_error e = { 0 };
    kvr_store_create(&s, &cfg, &e);
    kvr_model_desc d = { .name = "llama3-8b", .n_layers = NLAY, .n_kv_heads = NH,
                         .head_dim = HD, .dtype = KVR_DTYPE_F16 };
    kvr_rope_config_init(&d.rope);
    d.rope.theta = 500000;
    d.rope.scaling = KVR_ROPE_SCALING_LLAMA3;
    d.rope.factor = 8;
    d.rope.low_freq_factor = 1;
    d.rope.high_freq_factor = 4;
    d.rope.original_max_position_embeddings = 8192;
    if (kvr_store_model_register(s, &d, NULL, &e) != 0) {
        fprintf(stderr, "register: %s\n", e.msg);
        return 1;
    }
    put(s, "prefix", NULL, P, 0);
    char **ids = malloc(ND * sizeof *ids);
    for (size_t i = 0; i < ND; i++) {
        ids[i] = malloc(32);
        snprintf(ids[i], 32, "doc%zu", i);
        put(s, ids[i], "prefix", LD, 100000 + (uint32_t)(i * LD));
    }
    size_t N = P + ND * LD, bytes = N * (size_t)NLAY * 2 * NH * HD * 2;
    char *out = malloc(bytes);
    memset(out, 0, bytes);

    /* Plain gets of the same bytes (prefix + every document), measured
     * interleaved with every row below (the machine is shared: a ratio of
     * bests taken in the same minutes). */
    double best_get = 1e30;
    kvr_layout_kind kinds[3] = { KVR_LAYOUT_PARALLEL, KVR_LAYOUT_SEQUENTIAL,
                                 KVR_LAYOUT_SEQUENTIAL };
    const char *names[3] = { "parallel", "sequential", "parallel, T folded" };
    double ratio_into[3] = { 0, 0, 0 }, best_row[6], ratio_row[6];
    int reps = (int)kvt_env_size("KVR_BENCH_REPS", 5);
    for (int k = 0; k < 6; k++) {
        /* rows 3..5: the same layouts written straight into the buffer
         * (kvr_assemble_copy_into, no staging) */
        int into = k >= 3;
        double best = 1e30, best_plain = 1e30;
        for (int rep = 0; rep < reps; rep++) {
            double tp = plain_gets(s, ids, ND, out);
            if (tp < best_plain)
                best_plain = tp;
            if (tp < best_get)
                best_get = tp;
            kvr_assemble_params ap = { .prefix = "prefix", .docs = (const char *const *)ids,
                                       .n_docs = ND, .layout = k % 3 == 2 ? KVR_LAYOUT_PARALLEL
                                                                          : kinds[k % 3],
                                       .dtype = KVR_DTYPE_F16, .fold_temperature = k % 3 == 2 };
            double t0 = kvt_now_s();
            kvr_assemble *a = NULL;
            if (kvr_store_assemble_begin(s, &ap, &a, &e) != 0) {
                fprintf(stderr, "assemble: %s\n", e.msg);
                return 1;
            }
            if (into) {
                if (kvr_assemble_copy_into(a, out, bytes, &e) != 0) {
                    fprintf(stderr, "assemble copy_into: %s\n", e.msg);
                    return 1;
                }
            } else {
                if (kvr_assemble_work(a, &e) != 0) {
                    fprintf(stderr, "assemble work: %s\n", e.msg);
                    return 1;
                }
                const struct iovec *iov;
                size_t niov;
                kvr_assemble_payload_iov(a, &iov, &niov);
                gather(iov, niov, out);
            }
            kvr_assemble_end(a);
            double dt = kvt_now_s() - t0;
            if (dt < best)
                best = dt;
        }
        best_row[k] = best;
        ratio_row[k] = best_plain / best;
        if (into)
            ratio_into[k % 3] = ratio_row[k];
    }
    printf("| layout | tokens | KV bytes | latency (ms) | GB/s | vs plain get | "
           "tokens not re-encoded |\n|---|---|---|---|---|---|---|\n");
    printf("| plain get x%zu | %zu | %.2f GiB | %.1f | %.2f | 1.00 | - |\n", ND + 1, N,
           (double)bytes / (1u << 30), best_get * 1e3, (double)bytes / best_get / 1e9);
    for (int k = 0; k < 6; k++) {
        /* Without kvrope's layouts a worker re-encodes: parallel — every
         * document (prefix caching keeps only the prefix); sequential —
         * everything after the first document (an exact-prefix cache holds
         * prefix + first document only). */
        size_t saved = k % 3 == 1 ? P + LD + (ND - 1) * LD : P + ND * LD;
        printf("| %s%s | %zu | %.2f GiB | %.1f | %.2f | %.2f | %zu (of which %zu would "
               "be re-encoded without re-rotation) |\n",
               names[k % 3], k >= 3 ? ", into the buffer" : "", N, (double)bytes / (1u << 30),
               best_row[k] * 1e3, (double)bytes / best_row[k] / 1e9, ratio_row[k], saved,
               k % 3 == 1 ? (ND - 1) * LD : ND * LD);
    }
    printf("\n");
    kvt_goal(ratio_into[1] >= 0.9,
             "sequential assemble >= 0.9x plain gets (kvr_assemble_copy_into): %.2fx",
             ratio_into[1]);
    kvt_goal(ratio_into[2] >= 0.9,
             "parallel assemble with T folded >= 0.9x plain gets (kvr_assemble_copy_into): "
             "%.2fx", ratio_into[2]);
    free(out);
    for (size_t i = 0; i < ND; i++)
        free(ids[i]);
    free(ids);
    kvr_store_destroy(s);
    return 0;
}
