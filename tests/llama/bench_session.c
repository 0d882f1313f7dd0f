/*
 * bench_session.c — the editor's loop on the 0.7 B benchmark model: 50
 * consecutive real edits of a C file of this repository (cache/put.c's git
 * history, hunk by hunk, each version's first 3 KB: scripts/edit-history.py
 * --window 3072), replayed through the session engine by `kvrope-llama
 * replay` in one worker process, against a full re-encode of the same
 * version in the same process.
 *
 * Per edit: tokens computed as a share of the file (new tokens, the 8
 * refreshed after each edit point, tokens the age policy picks, the last
 * token for its logits), and time to the next token. The full re-encode is
 * timed at three versions (the first, middle and last edit); its per-token
 * cost (the median of the three) times each version's tokens is that edit's
 * baseline. Goals: median share <= 15%, median speedup >= 10x, 0 failures.
 * Also printed: whether the next token agrees with the full re-encode at the
 * three checked versions, and the KL between them.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/common/kvr_llama_bench.h"
#include "tests/common/kvr_llama_run.h"
#include "tests/common/kvr_testd.h"
#include "tests/common/kvt_bench.h"

static kvr_testd D;

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double q)
{
    if (n == 0)
        return NAN;
    qsort(v, n, sizeof *v, cmp_d);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i];
}

int main(void)
{
    char model[1024];
    if (llb_begin(model, sizeof model, &D) < 0)
        return 1;
    int rc = 1;
    char hist[400], lines[420], cmd[4096];
    snprintf(hist, sizeof hist, "%s/hist", D.dir);
    snprintf(lines, sizeof lines, "%s/lines.json", D.dir);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/edit-history.py --repo %s "
             "--path cache/put.c --window 3072 --max 51 %s", kvr_repo_root(), kvr_repo_root(), hist);
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_session: %s failed\n", cmd);
        goto out;
    }
    const char *a[] = { "replay", "--history", hist, "--session", "bench:put.c", "--refresh",
                        "8", "--check-at", "1,25,50", "--lines", lines, NULL };
    printf("kvrope-llama replay: 50 consecutive edits of cache/put.c (first 3 KB, real "
           "history, hunk by hunk) on the 0.7 B model, %s threads ...\n", LLB_THREADS);
    double t0 = llb_now_ms();
    cJSON *rep = llb_worker(D.sock, model, a);
    if (!rep)
        goto out;
    printf("  done in %.0f s\n\n", (llb_now_ms() - t0) / 1e3);
    FILE *f = fopen(lines, "r");
    if (!f)
        goto out_j;
    double share[64], first[64], toks[64], rate[8], kl[8];
    int agree[8];
    size_t n = 0, nr = 0, fails = 0;
    char line[8192];
    while (fgets(line, sizeof line, f)) {
        cJSON *j = cJSON_Parse(line);
        if (!j)
            continue;
        double v = llb_jnum(j, NULL, "version");
        if (cJSON_GetObjectItemCaseSensitive(j, "error")) {
            if (v > 0)
                fails++;
        } else if (v > 0 && n < 64) {
            share[n] = llb_jnum(j, NULL, "share");
            first[n] = llb_jnum(j, NULL, "first_token_ms");
            toks[n] = llb_jnum(j, NULL, "tokens");
            n++;
        }
        double fm = llb_jnum(j, NULL, "full_ms");
        if (isfinite(fm) && nr < 8) {
            rate[nr] = fm / llb_jnum(j, NULL, "tokens");
            kl[nr] = llb_jnum(j, NULL, "kl");
            agree[nr] = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "agrees"));
            printf("  version %2.0f: full re-encode of %.0f tokens %.0f ms, cached next token "
                   "%.1f ms; next token %s, KL %.2g\n", v, llb_jnum(j, NULL, "tokens"), fm,
                   llb_jnum(j, NULL, "first_token_ms"), agree[nr] ? "agrees" : "differs",
                   kl[nr]);
            nr++;
        }
        cJSON_Delete(j);
    }
    fclose(f);
    double r_full = pct(rate, nr, 0.5);
    double speed[64];
    for (size_t i = 0; i < n; i++)
        speed[i] = r_full * toks[i] / first[i];
    double sh_med = pct(share, n, 0.5), sh_p90 = pct(share, n, 0.9);
    double fi_med = pct(first, n, 0.5), sp_med = pct(speed, n, 0.5), sp_min = pct(speed, n, 0);
    printf("\n| 50 consecutive real edits, 0.7 B model | median | p90 / worst |\n"
           "| --- | --- | --- |\n"
           "| tokens computed, share of the file | %.1f%% | %.1f%% |\n"
           "| time to the next token | %.0f ms | |\n"
           "| speedup vs a full re-encode (%.2f ms per token) | %.1fx | worst %.1fx |\n"
           "| failures | %zu of %zu | |\n\n",
           100 * sh_med, 100 * sh_p90, fi_med, r_full, sp_med, sp_min, fails, n + fails);
    kvt_goal(sh_med <= 0.15, "median share of tokens computed per edit <= 15%%: %.1f%%",
             100 * sh_med);
    kvt_goal(sp_med >= 10, "median speedup to the next token vs a full re-encode >= 10x: %.1fx",
             sp_med);
    kvt_goal(fails == 0 && n == 50, "failures in 50 consecutive edits == 0: %zu", fails);
    rc = 0;
out_j:
    cJSON_Delete(rep);
out:
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", hist, lines);
    if (system(cmd)) {
    }
    testd_stop(&D);
    return rc;
}
