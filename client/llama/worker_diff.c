/*
 * worker_diff.c — the edit script between two token sequences, as PIE edit
 * hunks for kvr_client_edit (the code-editor flow of kvrope-llama).
 *
 * Myers' O(ND) algorithm on the part left after trimming the common prefix
 * and suffix, keeping each step's furthest-reaching diagonals for the
 * backtrack ((D+1)^2 ints). The matched token pairs of the backtrack are the
 * equal tokens; every gap between two consecutive matches is one hunk, so
 * hunks are sorted, disjoint and separated by at least one equal token (no
 * two share a start, as the edit verb requires). Past max_d the middle is
 * one hunk: a correct, if less economical, edit.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "client/llama/worker.h"

static int push(kvr__wk_hunk **h, size_t *n, size_t *cap, size_t a0, size_t a1, size_t b0,
                size_t b1)
{
    if (a0 == a1 && b0 == b1)
        return 0;
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 8;
        kvr__wk_hunk *p = realloc(*h, nc * sizeof *p);
        if (!p)
            return KVR_ENOMEM;
        *h = p;
        *cap = nc;
    }
    (*h)[(*n)++] = (kvr__wk_hunk){ a0, a1, b0, b1 };
    return 0;
}

/* Myers on a[0..N) vs b[0..M) (both non-empty). Writes the matched pairs
 * (forward order) into ma/mb (capacity min(N, M)) and their count into *nm.
 * Returns 1 if the distance exceeds max_d, 0 on success, KVR_ENOMEM. */
static int myers(const int32_t *a, long N, const int32_t *b, long M, long max_d, long *ma,
                 long *mb, long *nm)
{
    long maxd = N + M < max_d ? N + M : max_d;
    long off = maxd + 1;
    long *v = calloc((size_t)(2 * off + 1), sizeof *v);
    /* trace[d] holds V[k] for k in [-d, d] as it was after step d. */
    long *trace = malloc((size_t)(maxd + 1) * (size_t)(maxd + 1) * sizeof *trace);
    if (!v || !trace) {
        free(v);
        free(trace);
        return KVR_ENOMEM;
    }
    long D = -1;
    for (long d = 0; d <= maxd && D < 0; d++) {
        for (long k = -d; k <= d; k += 2) {
            long x;
            if (k == -d || (k != d && v[off + k - 1] < v[off + k + 1]))
                x = v[off + k + 1];
            else
                x = v[off + k - 1] + 1;
            long y = x - k;
            while (x < N && y < M && a[x] == b[y]) {
                x++;
                y++;
            }
            v[off + k] = x;
            if (x >= N && y >= M) {
                D = d;
                break;
            }
        }
        long *t = trace + d * d;   /* sum_{i<d} (2i+1) = d^2 */
        for (long k = -d; k <= d; k++)
            t[k + d] = v[off + k];
    }
    free(v);
    if (D < 0) {
        free(trace);
        return 1;
    }
    /* Backtrack from (N, M), collecting matches in reverse. */
    long x = N, y = M, n = 0;
    for (long d = D; d > 0; d--) {
        const long *t = trace + (d - 1) * (d - 1);   /* after step d-1, k in [-(d-1), d-1] */
        long k = x - y, pk;
        if (k == -d || (k != d && t[k - 1 + (d - 1)] < t[k + 1 + (d - 1)]))
            pk = k + 1;
        else
            pk = k - 1;
        long px = t[pk + (d - 1)], py = px - pk;
        /* The move lands at (sx, sy), then a snake to (x, y). */
        long sx = pk == k + 1 ? px : px + 1;
        long sy = sx - k;
        while (x > sx && y > sy) {
            x--;
            y--;
            ma[n] = x;
            mb[n] = y;
            n++;
        }
        x = px;
        y = py;
    }
    while (x > 0 && y > 0) {
        x--;
        y--;
        ma[n] = x;
        mb[n] = y;
        n++;
    }
    free(trace);
    for (long i = 0; i < n / 2; i++) {
        long t = ma[i];
        ma[i] = ma[n - 1 - i];
        ma[n - 1 - i] = t;
        t = mb[i];
        mb[i] = mb[n - 1 - i];
        mb[n - 1 - i] = t;
    }
    *nm = n;
    return 0;
}

int kvr__wk_diff(const int32_t *a, size_t na, const int32_t *b, size_t nb, size_t max_d,
                kvr__wk_hunk **out, size_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    size_t p = 0;
    while (p < na && p < nb && a[p] == b[p])
        p++;
    size_t s = 0;
    while (s < na - p && s < nb - p && a[na - 1 - s] == b[nb - 1 - s])
        s++;
    size_t N = na - p - s, M = nb - p - s;
    kvr__wk_hunk *h = NULL;
    size_t n = 0, cap = 0;
    if (N == 0 || M == 0) {
        if (push(&h, &n, &cap, p, p + N, p, p + M) < 0)
            return KVR_ENOMEM;
        *out = h;
        *n_out = n;
        return 0;
    }
    size_t mn = N < M ? N : M;
    long *ma = malloc(mn * sizeof *ma), *mb = malloc(mn * sizeof *mb), nm = 0;
    int r = ma && mb ? myers(a + p, (long)N, b + p, (long)M, (long)max_d, ma, mb, &nm) : KVR_ENOMEM;
    if (r < 0) {
        free(ma);
        free(mb);
        return r;
    }
    if (r == 1) {           /* too far apart: one hunk */
        nm = 0;
    }
    long pa = -1, pb = -1;
    for (long i = 0; i <= nm && r >= 0; i++) {
        long ca = i < nm ? ma[i] : (long)N, cb = i < nm ? mb[i] : (long)M;
        r = push(&h, &n, &cap, p + (size_t)(pa + 1), p + (size_t)ca, p + (size_t)(pb + 1),
                 p + (size_t)cb);
        pa = ca;
        pb = cb;
    }
    free(ma);
    free(mb);
    if (r < 0) {
        free(h);
        return r;
    }
    *out = h;
    *n_out = n;
    return 0;
}

void kvr__wk_hunks_merge(kvr__wk_hunk *h, size_t *n, size_t min_gap)
{
    size_t o = 0;
    for (size_t i = 0; i < *n; i++) {
        if (o > 0 && h[i].a0 - h[o - 1].a1 < min_gap) {
            h[o - 1].a1 = h[i].a1;       /* the equal tokens between become part of it */
            h[o - 1].b1 = h[i].b1;
        } else {
            h[o++] = h[i];
        }
    }
    *n = o;
}
