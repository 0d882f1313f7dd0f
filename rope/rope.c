/*
 * rope.c — the RoPE engine: frequency tables for every HF rope type (after
 * transformers' modeling_rope_utils.py), per-token cos/sin tables, threading
 * and the choice of kernel.
 *
 * Every operation is one rotation per token and pair, of angle
 *     phi_t[i] = a_t * f1[i] + b_t * f2[i]          (double precision)
 * apply:       a = pos,  f1 = inv_freq(seq_len_to),   b = 0, scaled by mscale
 * remove:      a = pos,  f1 = -inv_freq(seq_len_from), b = 0, scaled by 1/mscale
 * reposition:  a = to - from, f1 = inv_freq, b = 0  (one table; pure rotation)
 *              a = to, f1 = inv_freq(to table), b = from, f2 = -inv_freq(from
 *              table) when the tables differ (remove-then-apply in one pass;
 *              the magnitude factors cancel, so none is applied).
 *
 * sin/cos must not dominate a memory-bound kernel, so the per-token table is
 * (1) shared by all heads of the token, (2) reused as is when (a, b) repeats
 * (an edit shifts a whole suffix by one delta), (3) advanced by an exact
 * double-precision angle-addition step when (a, b) moves by the same step as
 * before (contiguous positions), and (4) recomputed with sincos() at every
 * token index that is a multiple of RESEED, so recurrence error is bounded and
 * results do not depend on how tokens are split across threads. Where (a, b)
 * changes token after token (no repeat, no step), AVX-512 takes the float
 * table from kvr__rope_table_fast_avx512, which vouches for the reference's
 * floats or declines (then the reference table is made); the reference
 * doubles are made later only if a step needs them.
 */
#include <assert.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <math.h>

#include "rope/rope_internal.h"

#define RESEED 32

/* ---- frequency tables ------------------------------------------------------ */

static double yarn_get_mscale(double scale, double m)
{
    if (scale <= 1.0) return 1.0;
    return 0.1 * m * log(scale) + 1.0;
}

/* HF find_correction_dim: the dimension whose wavelength makes num_rot turns
 * over max_pos positions. */
static double yarn_corr_dim(double num_rot, int dim, double base, double max_pos)
{
    return ((double)dim * log(max_pos / (num_rot * 2.0 * M_PI))) / (2.0 * log(base));
}

void kvr__rope_inv_freq(const kvr_rope *r, int64_t seq_len, double *out)
{
    const kvr_rope_config *c = &r->cfg;
    int n = r->npairs, dim = r->rot;
    double base = c->theta;
    if (c->scaling == KVR_ROPE_SCALING_DYNAMIC) {
        double L = (double)(seq_len > r->orig_max ? seq_len : r->orig_max);
        double om = (double)r->orig_max;
        base = base * pow((c->factor * L / om) - (c->factor - 1.0),
                          (double)dim / (double)(dim - 2));
    }
    for (int i = 0; i < n; i++)
        out[i] = 1.0 / pow(base, (double)(2 * i) / (double)dim);

    switch (c->scaling) {
    case KVR_ROPE_SCALING_LINEAR:
        for (int i = 0; i < n; i++) out[i] /= c->factor;
        break;
    case KVR_ROPE_SCALING_YARN: {
        double lo = yarn_corr_dim(c->beta_fast, dim, base, (double)r->orig_max);
        double hi = yarn_corr_dim(c->beta_slow, dim, base, (double)r->orig_max);
        if (c->yarn_truncate) {
            lo = floor(lo);
            hi = ceil(hi);
        }
        if (lo < 0.0) lo = 0.0;
        if (hi > (double)(dim - 1)) hi = (double)(dim - 1);
        if (lo == hi) hi += 0.001;
        for (int i = 0; i < n; i++) {
            double ramp = ((double)i - lo) / (hi - lo);
            if (ramp < 0.0) ramp = 0.0;
            if (ramp > 1.0) ramp = 1.0;
            double extrap = 1.0 - ramp;            /* inv_freq_extrapolation_factor */
            double f_ex = out[i], f_in = out[i] / c->factor;
            out[i] = f_in * (1.0 - extrap) + f_ex * extrap;
        }
        break;
    }
    case KVR_ROPE_SCALING_LLAMA3: {
        double old = (double)c->original_max_position_embeddings;
        double low_wl = old / c->low_freq_factor, high_wl = old / c->high_freq_factor;
        for (int i = 0; i < n; i++) {
            double f = out[i], wl = 2.0 * M_PI / f;
            if (wl < high_wl) continue;
            if (wl > low_wl) { out[i] = f / c->factor; continue; }
            double sm = (old / wl - c->low_freq_factor) /
                        (c->high_freq_factor - c->low_freq_factor);
            out[i] = (1.0 - sm) * f / c->factor + sm * f;
        }
        break;
    }
    case KVR_ROPE_SCALING_LONGROPE: {
        const double *ext = (seq_len > r->orig_max) ? c->long_factor : c->short_factor;
        for (int i = 0; i < n; i++) out[i] /= ext[i];
        break;
    }
    default:
        break;
    }
}

/* Builds one engine from a validated config (or a NONE layer's, rot 0). */
static kvr_rope *rope_build(const kvr_rope_config *cfg)
{
    kvr_rope *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->cfg = *cfg;
    r->head_dim = cfg->head_dim;
    r->rot = cfg->rotary_dim;
    r->npairs = cfg->rotary_dim / 2;
    r->orig_max = cfg->original_max_position_embeddings ? cfg->original_max_position_embeddings
                                                        : cfg->max_position_embeddings;
    r->factor_eff = cfg->factor;
    r->mscale = 1.0;
    switch (cfg->scaling) {
    case KVR_ROPE_SCALING_YARN:
        if (!isnan(cfg->attention_factor))
            r->mscale = cfg->attention_factor;
        else if (!isnan(cfg->mscale) && !isnan(cfg->mscale_all_dim) &&
                 cfg->mscale != 0.0 && cfg->mscale_all_dim != 0.0)
            r->mscale = yarn_get_mscale(cfg->factor, cfg->mscale) /
                        yarn_get_mscale(cfg->factor, cfg->mscale_all_dim);
        else
            r->mscale = yarn_get_mscale(cfg->factor, 1.0);
        break;
    case KVR_ROPE_SCALING_LONGROPE:
        /* HF: with an original_max_position_embeddings, factor is the ratio
         * max/orig; otherwise the stated factor and orig = max. */
        if (cfg->original_max_position_embeddings > 0 && cfg->max_position_embeddings > 0)
            r->factor_eff = (double)cfg->max_position_embeddings /
                            (double)cfg->original_max_position_embeddings;
        else if (isnan(cfg->factor))
            r->factor_eff = 1.0;
        if (!isnan(cfg->attention_factor))
            r->mscale = cfg->attention_factor;
        else if (r->factor_eff <= 1.0)
            r->mscale = 1.0;
        else
            r->mscale = sqrt(1.0 + log(r->factor_eff) / log((double)r->orig_max));
        break;
    default:
        break;
    }
    if (r->npairs > 0)
        kvr__rope_inv_freq(r, 0, r->inv_freq);
    return r;
}

int kvr_rope_create(kvr_rope **out, const kvr_rope_config *cfg, kvr_error *err)
{
    if (!out || !cfg) return kvr_error_set(err, KVR_EINVAL, "rope: NULL argument");
    *out = NULL;
    int rc = kvr_rope_config_validate(cfg, err);
    if (rc) return rc;
    kvr_rope *r = rope_build(cfg);
    if (!r) return kvr_error_set(err, KVR_ENOMEM, "rope: out of memory");
    bool want_local = false, want_none = false;
    for (int32_t l = 0; l < cfg->n_layer_kinds; l++) {
        want_local |= cfg->layer_kind[l] == KVR_ROPE_LAYER_LOCAL;
        want_none |= cfg->layer_kind[l] == KVR_ROPE_LAYER_NONE;
    }
    /* The per-layer engines: the same shape and pairing, their own
     * frequencies, no map of their own. */
    kvr_rope_config sub = *cfg;
    sub.n_layer_kinds = 0;
    sub.scaling = KVR_ROPE_SCALING_DEFAULT;
    sub.factor = 1.0;
    sub.attention_factor = (double)NAN;
    sub.n_short_factor = sub.n_long_factor = 0;
    if (want_local) {
        sub.theta = cfg->local_theta;
        if ((rc = kvr_rope_config_validate(&sub, err)) != 0) {
            kvr_rope_destroy(r);
            return rc;
        }
        if (!(r->local = rope_build(&sub))) {
            kvr_rope_destroy(r);
            return kvr_error_set(err, KVR_ENOMEM, "rope: out of memory");
        }
    }
    if (want_none) {
        sub.theta = cfg->theta;
        sub.rotary_dim = 0;
        if (!(r->none = rope_build(&sub))) {
            kvr_rope_destroy(r);
            return kvr_error_set(err, KVR_ENOMEM, "rope: out of memory");
        }
    }
    *out = r;
    return 0;
}

void kvr_rope_destroy(kvr_rope *r)
{
    if (!r) return;
    free(r->local);
    free(r->none);
    free(r);
}

const kvr_rope_config *kvr_rope_get_config(const kvr_rope *r) { return r ? &r->cfg : NULL; }

const kvr_rope *kvr_rope_layer(const kvr_rope *r, uint32_t layer)
{
    if (!r) return NULL;
    switch (kvr_rope_config_layer_kind(&r->cfg, layer)) {
    case KVR_ROPE_LAYER_LOCAL: return r->local ? r->local : r;
    case KVR_ROPE_LAYER_NONE:  return r->none ? r->none : r;
    default:                   return r;
    }
}

double kvr_rope_factor(const kvr_rope *r) { return r ? r->factor_eff : (double)NAN; }
double kvr_rope_attention_scale(const kvr_rope *r) { return r ? r->mscale : (double)NAN; }

bool kvr_rope_same_table(const kvr_rope *r, int64_t a, int64_t b)
{
    if (!r || kvr_rope_config_composes(&r->cfg) || r->npairs == 0) return true;
    if (a <= r->orig_max && b <= r->orig_max) return true;
    if (r->cfg.scaling == KVR_ROPE_SCALING_LONGROPE) return (a > r->orig_max) == (b > r->orig_max);
    return a == b;
}

int64_t kvr_rope_default_seq_len(const int64_t *pos, size_t n)
{
    int64_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (pos[i] > m) m = pos[i];
    return m < INT64_MAX ? m + 1 : m;
}

/* ---- sin/cos ----------------------------------------------------------------
 * sincos() from libm costs more than rotating a token's keys, so tokens whose
 * angles are all below 2^20 * pi/2 use this one: Cody-Waite reduction by pi/2
 * in three 33-bit pieces (exact products for quotients below 2^20, as in
 * fdlibm's medium case) and fdlibm's kernel polynomials on [-pi/4, pi/4]
 * (constants in rope_internal.h). Absolute error is about 1e-16, far below
 * the float tables it feeds. Larger angles go to libm. The AVX2 / AVX-512
 * versions (sincos_avx2.c, sincos_avx512.c) do the same operations lane by
 * lane, without fused multiply-adds (this file and those are built with
 * -ffp-contract=off), so every ISA gets the same table. */
static inline void sincos_small(double x, double *sp, double *cp)
{
    const double shift = 0x1.8p52;
    double kk = x * M_2_PI + shift;
    double k = kk - shift;
    uint64_t kb;
    memcpy(&kb, &kk, 8);
    double r = ((x - k * ROPE_PIO2_1) - k * ROPE_PIO2_2) - k * ROPE_PIO2_3;
    double z = r * r;
    double sr = r + r * z * (ROPE_S1 + z * (ROPE_S2 + z * (ROPE_S3 + z * (ROPE_S4 +
                z * (ROPE_S5 + z * ROPE_S6)))));
    double cr = 1.0 - 0.5 * z + z * z * (ROPE_C1 + z * (ROPE_C2 + z * (ROPE_C3 +
                z * (ROPE_C4 + z * (ROPE_C5 + z * ROPE_C6)))));
    unsigned q = (unsigned)(kb & 3u);
    double s = (q & 1u) ? cr : sr, c = (q & 1u) ? sr : cr;
    if (q == 1u || q == 2u) c = -c;
    if (q & 2u) s = -s;
    *sp = s;
    *cp = c;
}

/* s[i], c[i] = sin, cos(a * f1[i] + b * f2[i]) (f2 may be NULL): the scalar
 * reference of kvr__rope_sincos_avx2 / kvr__rope_sincos_avx512, which compute the same
 * bits. */
void kvr__rope_sincos_scalar(double a, const double *f1, double b, const double *f2, int n,
                        double *s, double *c)
{
    double ang[KVR_ROPE_MAX_HEAD_DIM / 2];
    bool small = true;
    for (int i = 0; i < n; i++) {
        ang[i] = f2 ? a * f1[i] + b * f2[i] : a * f1[i];
        small &= fabs(ang[i]) < ROPE_FAST_MAX;
    }
    if (small) for (int i = 0; i < n; i++) sincos_small(ang[i], &s[i], &c[i]);
    else       for (int i = 0; i < n; i++) sincos(ang[i], &s[i], &c[i]);
}

void kvr__rope_step_scalar(const double *stc, const double *sts, int n, double *c, double *s)
{
    for (int i = 0; i < n; i++) {
        double c0 = c[i], s0 = s[i];
        c[i] = c0 * stc[i] - s0 * sts[i];
        s[i] = s0 * stc[i] + c0 * sts[i];
    }
}

void kvr__rope_tofloat_scalar(const double *c, const double *s, int n, double m, int gptj,
                         float *fc, float *fs)
{
    if (gptj) {
        for (int i = 0; i < n; i++) {
            float cv = (float)(c[i] * m), sv = (float)(s[i] * m);
            fc[2 * i] = cv; fc[2 * i + 1] = cv;
            fs[2 * i] = -sv; fs[2 * i + 1] = sv;
        }
    } else {
        for (int i = 0; i < n; i++) {
            fc[i] = (float)(c[i] * m);
            fs[i] = (float)(s[i] * m);
        }
    }
}

/* ---- the driver ------------------------------------------------------------ */

typedef struct job {
    const kvr_rope *r;
    void *dst; kvr_dtype dt;
    const void *src; kvr_dtype st;
    size_t n_heads;
    const int64_t *a, *b;      /* per token; b may be NULL */
    int64_t a_off;             /* reposition one table: a_t = to_t - from_t */
    const int64_t *a_sub;      /* non-NULL: a_t = a[t] - a_sub[t] */
    const double *f1, *f2;     /* f2 NULL when b is */
    double mag;                /* multiplies cos and sin */
    rope_rows_fn rows;
    rope_sincos_fn sincos;
    rope_tofloat_fn tofloat;
    rope_table_fn table;       /* NULL: sincos then tofloat */
    rope_table_fast_fn table_fast;   /* floats only, unit magnitude; NULL: none */
    rope_step_fn step;
    kvr_rope_src_fn src_fn;    /* non-NULL: source rows on demand (f32) */
    void *src_ud;
    size_t t0, t1;
    /* kvr_rope_reposition_delta: one angle a = delta for every token (a, b
     * NULL), each result times scale when scaled */
    bool fixed, scaled;
    int64_t delta;
    float scale;
    rope_rows_scaled_fn rows_s;   /* NULL: through an f32 row per head */
    bool stream;                  /* kvr__rope_rows_stream_avx512 where it can */
} job;

/* a_t for token t, or false when it overflows int64 (the caller then falls
 * back to the two-table form of the angle). */
static inline bool token_a(const job *j, size_t t, int64_t *out)
{
    if (!j->a_sub) { *out = j->a[t]; return true; }
    return !__builtin_sub_overflow(j->a[t], j->a_sub[t], out);
}

/* The fixed-angle range: the table of the one delta, made as run_range's
 * mode 0 makes it for every reseed (the same bits), then every token's rows
 * in one call of the rows kernel. */
static void run_fixed(const job *j)
{
    const kvr_rope *r = j->r;
    int n = r->npairs, rot = r->rot, gptj = r->cfg.style == KVR_ROPE_GPTJ, hd = r->head_dim;
    size_t row_elems = j->n_heads * (size_t)hd;
    size_t ssz = kvr_dtype_size(j->st), dsz = kvr_dtype_size(j->dt);
    double cc[KVR_ROPE_MAX_HEAD_DIM / 2], ss[KVR_ROPE_MAX_HEAD_DIM / 2];
    float fc[KVR_ROPE_MAX_HEAD_DIM], fs[KVR_ROPE_MAX_HEAD_DIM];
    float row[KVR_ROPE_MAX_HEAD_DIM];
    if (j->t0 >= j->t1)
        return;
    if (j->table) {
        j->table((double)j->delta, j->f1, 0.0, NULL, n, j->mag, gptj, ss, cc, fs, fc);
    } else {
        j->sincos((double)j->delta, j->f1, 0.0, NULL, n, ss, cc);
        j->tofloat(cc, ss, n, j->mag, gptj, fc, fs);
    }
    /* One table for every token: the range's rows are one run of
     * (t1 - t0) * n_heads head rows, rotated in one call. */
    size_t nrows = (j->t1 - j->t0) * j->n_heads;
    char *d = (char *)j->dst + j->t0 * row_elems * dsz;
    const char *s = (const char *)j->src + j->t0 * row_elems * ssz;
    if (j->stream && kvr__rope_rows_stream_avx512(d, j->dt, s, j->st, nrows, hd, rot, gptj, fc, fs,
                                             j->scaled, j->scale)) {
        /* non-temporal stores are weakly ordered: visible before the return */
        kvr__rope_stream_fence_avx512();
    } else if (!j->scaled) {
        j->rows(d, j->dt, s, j->st, nrows, hd, rot, gptj, fc, fs);
    } else if (j->rows_s) {
        j->rows_s(d, j->dt, s, j->st, nrows, hd, rot, gptj, fc, fs, j->scale);
    } else {
        /* each head rotated into f32 (in L1), scaled and converted */
        for (size_t h = 0; h < nrows; h++) {
            j->rows(row, KVR_DTYPE_F32, s + h * (size_t)hd * ssz, j->st, 1, hd, rot, gptj, fc, fs);
            for (int q = 0; q < hd; q++)
                row[q] *= j->scale;
            kvr_convert(d + h * (size_t)hd * dsz, j->dt, row, KVR_DTYPE_F32, (size_t)hd);
        }
    }
}

static void run_range(const job *j)
{
    if (j->fixed) {
        run_fixed(j);
        return;
    }
    const kvr_rope *r = j->r;
    int n = r->npairs, rot = r->rot, gptj = r->cfg.style == KVR_ROPE_GPTJ;
    size_t row_elems = j->n_heads * (size_t)r->head_dim;
    size_t ssz = kvr_dtype_size(j->st), dsz = kvr_dtype_size(j->dt);
    double cc[KVR_ROPE_MAX_HEAD_DIM / 2], ss[KVR_ROPE_MAX_HEAD_DIM / 2];
    double stc[KVR_ROPE_MAX_HEAD_DIM / 2], sts[KVR_ROPE_MAX_HEAD_DIM / 2];
    float fc[KVR_ROPE_MAX_HEAD_DIM], fs[KVR_ROPE_MAX_HEAD_DIM];
    int64_t pa = 0, pb = 0, sa = 0, sb = 0;  /* previous (a, b), current step */
    bool have_prev = false, have_step = false, step_ready = false;
    /* Tokens in a row made afresh: from the third on (deltas that differ
     * token by token) the floats come from the fast table when it can vouch
     * for them, and cc / ss then lag (stale) until a step needs them. */
    int fresh_run = 0;
    bool stale = false;
    /* A chunk of a threaded run (t0 > 0, a multiple of RESEED): start from
     * what one pass would know at t0, the previous token's (a, b), so the
     * step is learnt at t0 as it would be there and token t0 + 1 takes the
     * same route (the bits do not depend on the thread count). */
    if (j->t0 > 0 && token_a(j, j->t0 - 1, &pa)) {
        pb = j->b ? j->b[j->t0 - 1] : 0;
        have_prev = true;
    }

    for (size_t t = j->t0; t < j->t1; t++) {
        int64_t a, b = j->b ? j->b[t] : 0;
        const double *f1 = j->f1, *f2 = j->f2;
        bool wide = false;
        if (!token_a(j, t, &a)) {
            /* to - from overflowed: angle = to*f - from*f, via the b term */
            wide = true;
        }
        int mode; /* 0 exact, 1 same as previous, 2 step */
        bool fresh = false;   /* fc / fs already made with the table */
        int64_t da = 0, db = 0;
        if (wide || !have_prev || t % RESEED == 0) {
            mode = 0;
        } else if (a == pa && b == pb) {
            mode = 1;
        } else if (!__builtin_sub_overflow(a, pa, &da) && !__builtin_sub_overflow(b, pb, &db) &&
                   have_step && da == sa && db == sb) {
            mode = 2;
        } else {
            mode = 0;
        }
        fresh_run = mode == 0 ? fresh_run + 1 : 0;
        if (mode == 0) {
            if (wide) {
                j->sincos((double)j->a[t], f1, -(double)j->a_sub[t], f1, n, ss, cc);
                stale = false;
                have_prev = false;
                have_step = false;
            } else {
                if (j->table_fast && fresh_run >= 3 &&
                    j->table_fast((double)a, f1, (double)b, f2, n, gptj, fs, fc)) {
                    fresh = true;
                    stale = true;
                } else if (j->table) {
                    j->table((double)a, f1, (double)b, f2, n, j->mag, gptj, ss, cc, fs, fc);
                    fresh = true;
                    stale = false;
                } else {
                    j->sincos((double)a, f1, (double)b, f2, n, ss, cc);
                }
                /* remember the step from the previous token for next time
                 * (the fused table's doubles are the same bits, so the
                 * recurrence and repeats below work from them alike) */
                if (have_prev && !__builtin_sub_overflow(a, pa, &da) &&
                    !__builtin_sub_overflow(b, pb, &db)) {
                    if (!have_step || da != sa || db != sb) {
                        sa = da; sb = db; have_step = true; step_ready = false;
                    }
                } else {
                    have_step = false;
                }
                have_prev = true;
            }
        } else if (mode == 2) {
            /* the previous token's doubles, which the step advances */
            if (stale) {
                j->sincos((double)pa, f1, (double)pb, f2, n, ss, cc);
                stale = false;
            }
            if (!step_ready) {
                j->sincos((double)sa, f1, (double)sb, f2, n, sts, stc);
                step_ready = true;
            }
            j->step(stc, sts, n, cc, ss);
        }
        if ((mode != 1 || t == j->t0) && !fresh)
            j->tofloat(cc, ss, n, j->mag, gptj, fc, fs);
        if (mode != 0 || !wide) { pa = a; pb = b; }
        const void *srow = j->src_fn ? (const void *)j->src_fn(j->src_ud, t)
                                     : (const void *)((const char *)j->src + t * row_elems * ssz);
        char *drow = (char *)j->dst + t * row_elems * dsz;
        if (!j->stream || !kvr__rope_rows_stream_avx512(drow, j->dt, srow, j->st, j->n_heads,
                                                   r->head_dim, rot, gptj, fc, fs, false, 1.0f))
            j->rows(drow, j->dt, srow, j->st, j->n_heads, r->head_dim, rot, gptj, fc, fs);
    }
    /* non-temporal stores are weakly ordered: visible before the return */
    if (j->stream)
        kvr__rope_stream_fence_avx512();
}

static int online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > 64 ? 64 : (int)n);
}

/* One chunk of a threaded run: tokens [blocks*i/nt, blocks*(i+1)/nt) * RESEED. */
typedef struct chunked {
    const job *base;
    size_t     n_tokens, blocks;
    unsigned   nt;
} chunked;

static int run_chunk(void *ud, size_t i)
{
    const chunked *c = ud;
    job j = *c->base;
    /* chunk boundaries on multiples of RESEED keep results independent of
     * the thread count (and of which thread runs which chunk) */
    j.t0 = c->blocks * i / c->nt * RESEED;
    j.t1 = c->blocks * (i + 1) / c->nt * RESEED;
    if (j.t1 > c->n_tokens) j.t1 = c->n_tokens;
    if (j.t0 > c->n_tokens) j.t0 = c->n_tokens;
    assert(j.t0 <= j.t1 && j.t0 % RESEED == 0);
    run_range(&j);
    return 0;
}

static int run(job *base, size_t n_tokens, const kvr_rope_opts *opts)
{
    size_t bytes = n_tokens * base->n_heads * (size_t)base->r->head_dim *
                   (kvr_dtype_size(base->st) + kvr_dtype_size(base->dt));
    int nt = opts ? opts->n_threads : 0;
    if (nt <= 0) {
        /* Threads pay off once a buffer is well past the cost of waking the
         * pool's workers: 4 MiB and up. */
        nt = bytes >= ((size_t)4 << 20) ? online_cpus() : 1;
        if (nt > 8) nt = 8;
    }
    if (nt > 64) nt = 64;
    size_t blocks = (n_tokens + RESEED - 1) / RESEED;
    if ((size_t)nt > blocks) nt = (int)(blocks ? blocks : 1);
    if (nt <= 1) {
        base->t0 = 0;
        base->t1 = n_tokens;
        run_range(base);
        return 0;
    }
    /* nt chunks on the process's pool: at most nt threads, the caller's
     * included; chunks no worker takes run here. */
    chunked c = { .base = base, .n_tokens = n_tokens, .blocks = blocks, .nt = (unsigned)nt };
    return kvr_pool_for(NULL, (size_t)nt, (unsigned)nt, run_chunk, &c);
}

static rope_rows_fn pick_rows(const kvr_rope_opts *opts)
{
    switch (kvr__isa_resolve(opts ? opts->isa : KVR_ISA_AUTO)) {
    case KVR_ISA_AVX512: return kvr__rope_rows_avx512;
    case KVR_ISA_AVX2:   return kvr__rope_rows_avx2;
    default:             return kvr__rope_rows_scalar;
    }
}

static void pick_tables(job *j, const kvr_rope_opts *opts)
{
    switch (kvr__isa_resolve(opts ? opts->isa : KVR_ISA_AUTO)) {
    case KVR_ISA_AVX512:
        j->sincos = kvr__rope_sincos_avx512; j->tofloat = kvr__rope_tofloat_avx512;
        j->table = kvr__rope_table_avx512; j->step = kvr__rope_step_avx512;
        /* floats only, for the unit magnitude (reposition) */
        j->table_fast = j->mag == 1.0 ? kvr__rope_table_fast_avx512 : NULL;
        break;
    case KVR_ISA_AVX2:
        j->sincos = kvr__rope_sincos_avx2; j->tofloat = kvr__rope_tofloat_avx2; j->step = kvr__rope_step_avx2;
        break;
    default:
        j->sincos = kvr__rope_sincos_scalar; j->tofloat = kvr__rope_tofloat_scalar;
        j->step = kvr__rope_step_scalar;
        break;
    }
}

static int check_args(const kvr_rope *r, const void *dst, kvr_dtype dt, const void *src,
                      kvr_dtype st, size_t n_tokens, size_t n_heads, const void *p1,
                      const void *p2)
{
    if (!r) return KVR_EINVAL;
    if (kvr_dtype_size(dt) == 0 || kvr_dtype_size(st) == 0) return KVR_EINVAL;
    if (n_tokens == 0 || n_heads == 0) return 0;
    if (!dst || !src || !p1 || !p2) return KVR_EINVAL;
    /* overflow-safe size: tokens * heads * head_dim * 4 must fit */
    size_t e;
    if (__builtin_mul_overflow(n_tokens, n_heads, &e) ||
        __builtin_mul_overflow(e, (size_t)r->head_dim * 4, &e))
        return KVR_EINVAL;
    /* In place only with identical element types. */
    if (dst == src && dt != st) return KVR_EINVAL;
    if (r->npairs == 0) {
        /* A layer without RoPE: keys pass through, converted. */
        if (dst != src) kvr_convert((void *)(uintptr_t)dst, dt, src, st, e / 4);
        return 0;
    }
    return 1;
}

static int one_table(const kvr_rope *r, kvr_dtype dt, void *dst, const void *src, kvr_dtype st,
                     size_t n_tokens, size_t n_heads, const int64_t *pos, int64_t seq_len,
                     int sign, const kvr_rope_opts *opts)
{
    double f[KVR_ROPE_MAX_HEAD_DIM / 2];
    if (kvr_rope_config_composes(&r->cfg)) memcpy(f, r->inv_freq, sizeof(double) * (size_t)r->npairs);
    else kvr__rope_inv_freq(r, seq_len, f);
    if (sign < 0) for (int i = 0; i < r->npairs; i++) f[i] = -f[i];
    job j = {
        .r = r, .dst = dst, .dt = dt, .src = src, .st = st, .n_heads = n_heads,
        .a = pos, .f1 = f, .mag = sign < 0 ? 1.0 / r->mscale : r->mscale,
        .rows = pick_rows(opts),
        .stream = kvr__isa_resolve(opts ? opts->isa : KVR_ISA_AUTO) == KVR_ISA_AVX512 &&
                  opts && opts->stream,
    };
    pick_tables(&j, opts);
    return run(&j, n_tokens, opts);
}

/* kvr_rope_apply (sign +1) and kvr_rope_remove (-1): one position each. */
static int one_pos(const kvr_rope *r, void *dst, kvr_dtype dst_type, const void *src,
                   kvr_dtype src_type, size_t n_tokens, size_t n_heads, const int64_t *pos,
                   const kvr_rope_opts *opts, int sign)
{
    int rc = check_args(r, dst, dst_type, src, src_type, n_tokens, n_heads, pos, pos);
    if (rc <= 0) return rc;
    int64_t seq_len = opts ? (sign > 0 ? opts->seq_len_to : opts->seq_len_from) : 0;
    return one_table(r, dst_type, dst, src, src_type, n_tokens, n_heads, pos, seq_len, sign,
                     opts);
}

int kvr_rope_apply(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                   const void *src, kvr_dtype src_type,
                   size_t n_tokens, size_t n_heads, const int64_t *pos,
                   const kvr_rope_opts *opts)
{
    return one_pos(r, dst, dst_type, src, src_type, n_tokens, n_heads, pos, opts, +1);
}

int kvr_rope_apply_src(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                       kvr_rope_src_fn src, void *ud, size_t n_tokens, size_t n_heads,
                       const int64_t *pos, const kvr_rope_opts *opts)
{
    if (!r || !src || kvr_dtype_size(dst_type) == 0) return KVR_EINVAL;
    if (n_tokens == 0 || n_heads == 0) return 0;
    if (!dst || !pos) return KVR_EINVAL;
    size_t e;
    if (__builtin_mul_overflow(n_tokens, n_heads, &e) ||
        __builtin_mul_overflow(e, (size_t)r->head_dim * 4, &e))
        return KVR_EINVAL;
    size_t row = n_heads * (size_t)r->head_dim, dsz = kvr_dtype_size(dst_type);
    if (r->npairs == 0) {
        /* A layer without RoPE: the rows pass through, converted. */
        for (size_t t = 0; t < n_tokens; t++)
            kvr_convert((char *)dst + t * row * dsz, dst_type, src(ud, t), KVR_DTYPE_F32, row);
        return 0;
    }
    double f[KVR_ROPE_MAX_HEAD_DIM / 2];
    if (kvr_rope_config_composes(&r->cfg)) memcpy(f, r->inv_freq, sizeof(double) * (size_t)r->npairs);
    else kvr__rope_inv_freq(r, opts ? opts->seq_len_to : 0, f);
    job j = {
        .r = r, .dst = dst, .dt = dst_type, .src = NULL, .st = KVR_DTYPE_F32,
        .n_heads = n_heads, .a = pos, .f1 = f, .mag = r->mscale, .rows = pick_rows(opts),
        .src_fn = src, .src_ud = ud, .t0 = 0, .t1 = n_tokens,
        .stream = kvr__isa_resolve(opts ? opts->isa : KVR_ISA_AUTO) == KVR_ISA_AVX512 &&
                  opts && opts->stream,
    };
    pick_tables(&j, opts);
    run_range(&j);
    return 0;
}

int kvr_rope_remove(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                    const void *src, kvr_dtype src_type,
                    size_t n_tokens, size_t n_heads, const int64_t *pos,
                    const kvr_rope_opts *opts)
{
    return one_pos(r, dst, dst_type, src, src_type, n_tokens, n_heads, pos, opts, -1);
}

int kvr_rope_reposition(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                        const void *src, kvr_dtype src_type,
                        size_t n_tokens, size_t n_heads,
                        const int64_t *from, const int64_t *to,
                        const kvr_rope_opts *opts)
{
    int rc = check_args(r, dst, dst_type, src, src_type, n_tokens, n_heads, from, to);
    if (rc <= 0) return rc;
    double f_to[KVR_ROPE_MAX_HEAD_DIM / 2], f_from[KVR_ROPE_MAX_HEAD_DIM / 2];
    size_t fb = sizeof(double) * (size_t)r->npairs;
    if (kvr_rope_config_composes(&r->cfg)) {
        memcpy(f_to, r->inv_freq, fb);
        memcpy(f_from, r->inv_freq, fb);
    } else {
        kvr__rope_inv_freq(r, opts ? opts->seq_len_to : 0, f_to);
        kvr__rope_inv_freq(r, opts ? opts->seq_len_from : 0, f_from);
    }
    job j = {
        .r = r, .dst = dst, .dt = dst_type, .src = src, .st = src_type, .n_heads = n_heads,
        .mag = 1.0, .rows = pick_rows(opts),
    };
    if (!memcmp(f_to, f_from, fb)) {
        /* Same table: a pure rotation by the delta. */
        j.a = to;
        j.a_sub = from;
        j.f1 = f_to;
    } else {
        /* Different tables: R(to * f_new) R(-from * f_old), one rotation of
         * angle to*f_new - from*f_old per pair. */
        for (int i = 0; i < r->npairs; i++) f_from[i] = -f_from[i];
        j.a = to;
        j.b = from;
        j.f1 = f_to;
        j.f2 = f_from;
    }
    pick_tables(&j, opts);
    return run(&j, n_tokens, opts);
}

int kvr_rope_reposition_delta(const kvr_rope *r, void *dst, kvr_dtype dst_type,
                              const void *src, kvr_dtype src_type,
                              size_t n_tokens, size_t n_heads, int64_t delta, float scale,
                              const kvr_rope_opts *opts)
{
    bool scaled = isless(scale, 1.0f) || isgreater(scale, 1.0f) || isnan(scale);
    if (scaled && dst == src && dst_type != src_type) return KVR_EINVAL;
    if (scaled && r && r->npairs == 0) {
        /* A layer without RoPE: keys pass through, scaled. */
        size_t e;
        if (kvr_dtype_size(dst_type) == 0 || kvr_dtype_size(src_type) == 0) return KVR_EINVAL;
        if (n_tokens == 0 || n_heads == 0) return 0;
        if (!dst || !src) return KVR_EINVAL;
        if (__builtin_mul_overflow(n_tokens, n_heads, &e) ||
            __builtin_mul_overflow(e, (size_t)r->head_dim * 4, &e))
            return KVR_EINVAL;
        kvr_convert_scaled(dst, dst_type, src, src_type, e / 4, scale);
        return 0;
    }
    int rc = check_args(r, dst, dst_type, src, src_type, n_tokens, n_heads, &delta, &delta);
    if (rc <= 0) return rc;
    double f_to[KVR_ROPE_MAX_HEAD_DIM / 2], f_from[KVR_ROPE_MAX_HEAD_DIM / 2];
    size_t fb = sizeof(double) * (size_t)r->npairs;
    if (kvr_rope_config_composes(&r->cfg)) {
        memcpy(f_to, r->inv_freq, fb);
    } else {
        kvr__rope_inv_freq(r, opts ? opts->seq_len_to : 0, f_to);
        kvr__rope_inv_freq(r, opts ? opts->seq_len_from : 0, f_from);
        if (memcmp(f_to, f_from, fb))
            return KVR_EINVAL;   /* not a rotation by the delta */
    }
    kvr_isa isa = kvr__isa_resolve(opts ? opts->isa : KVR_ISA_AUTO);
    job j = {
        .r = r, .dst = dst, .dt = dst_type, .src = src, .st = src_type, .n_heads = n_heads,
        .f1 = f_to, .mag = 1.0, .rows = pick_rows(opts), .fixed = true, .scaled = scaled,
        .delta = delta, .scale = scale,
        .rows_s = isa == KVR_ISA_AVX512 ? kvr__rope_rows_scaled_avx512 : NULL,
        .stream = isa == KVR_ISA_AVX512 && opts && opts->stream,
    };
    pick_tables(&j, opts);
    return run(&j, n_tokens, opts);
}
