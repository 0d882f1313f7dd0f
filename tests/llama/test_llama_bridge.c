/*
 * test_llama_bridge.c — the bridge against the real llama.cpp (v0.5.0 from
 * npm) on models written by scripts/gen-gguf.py, through a real kvroped:
 *  - a state stored in kvrope and restored into a fresh context (same
 *    process; and another process via the CLI) gives bit-identical logits,
 *    for every cache type and both V layouts;
 *  - kvrope's re-rotation of llama.cpp's keys equals llama.cpp's own shift
 *    (llama_memory_seq_add + decode) within one rounding of the cache type,
 *    NORM (llama) and NEOX (qwen2) pairing, f16 and q8_0 (Hadamard) caches,
 *    small, large and negative deltas; next-token logits agree;
 *  - a context imported from a flash-attention-off state is exported, by
 *    default, with V transposed as it came (through a kill -9 restart with
 *    persistence and a fork), and export says which layout it wrote;
 *  - YaRN: kvrope's shift keeps key norms (= a fresh encode's); llama.cpp's
 *    own shift is measured and its figure asserted.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <sys/stat.h>

#include "tests/llama/llama_test.h"   /* llama.h first: kvrope_llama.h's context helper */
#include "client/llama/kvrope_llama.h"
#include "tests/common/kvr_opsd.h"   /* kvr_testd.h, opsd_slurp */
#include "tests/common/kvt_llama.h"

#define N_PROMPT 48

/* llama.cpp v0.5.0's K-shift on a YaRN model (factor 4): the factor its shift
 * multiplies key norms by, as measured by yarn_shift_keeps_norms_and_llama_
 * shift_is_measured (1 would be a pure rotation). Measured: 1.138629 (f32
 * cache), 1.13839..1.13885 (f16) = 0.1 ln 4 + 1, the YaRN magnitude: this
 * release still applies it again on every shift (ggml_rope_ext in
 * build_rope_shift gets the context's yarn_attn_factor). */
#define YARN_SHIFT_RATIO 1.1386294361119891   /* 0.1 * ln(4) + 1 */
#define YARN_SHIFT_TOL   1e-3

static kvr_testd D;
static char TMP[256];

static void setup(void)
{
    lt_engine_init();
    snprintf(TMP, sizeof TMP, "/tmp/kvr-llama-bridge-XXXXXX");
    cr_assert_not_null(mkdtemp(TMP));
    cr_assert_eq(testd_start(&D, NULL), 0);
}

static void teardown(void)
{
    testd_stop(&D);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", TMP);
    if (system(cmd) != 0) cr_log_warn("could not remove %s", TMP);
}

TestSuite(llama_bridge, .init = setup, .fini = teardown, .timeout = 300);

static void model(char *path, size_t cap, const char *name, const char *args, kvr_llama_model *m,
                  kvr_client *c)
{
    cr_assert_eq(lt_gen_model(path, cap, TMP, name, args), 0, "gen-gguf %s", args);
    char err[400];
    cr_assert_eq(kvr_llama_gguf_read(path, m, err, sizeof err), 0, "%s", err);
    if (c) cr_assert_eq(kvr_llama_model_register(c, m, NULL, NULL, err, sizeof err), 0, "%s", err);
}

static void import_state(kvr_client *c, const char *ctx, const kvr_llama_model *m,
                         const unsigned char *st, size_t len, const llama_token *toks, int n)
{
    uint32_t *t = malloc((size_t)n * 4);
    for (int i = 0; i < n; i++) t[i] = (uint32_t)toks[i];
    kvr_llama_import_opts o = { .mode = KVR_LLAMA_IMPORT_CREATE, .tokens = t, .n_tokens = (size_t)n };
    kvr_llama_import_info info;
    char err[400];
    int rc = kvr_llama_state_import(c, ctx, st, len, m, &o, &info, err, sizeof err);
    free(t);
    cr_assert_eq(rc, 0, "import: %s", err);
    cr_assert_eq(info.n_taken, (uint32_t)n);
}

/* ---- round trip -------------------------------------------------------------- */

static const struct rt_case {
    int type_k, type_v, fa;
    kvr_llama_type tk, tv;
} RT[] = {
    { GGML_TYPE_F16, GGML_TYPE_F16, 1, KVR_LLAMA_F16, KVR_LLAMA_F16 },
    { GGML_TYPE_F16, GGML_TYPE_F16, 0, KVR_LLAMA_F16, KVR_LLAMA_F16 },
    { GGML_TYPE_F32, GGML_TYPE_F32, 1, KVR_LLAMA_F32, KVR_LLAMA_F32 },
    { GGML_TYPE_BF16, GGML_TYPE_BF16, 1, KVR_LLAMA_BF16, KVR_LLAMA_BF16 },
    { GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, 1, KVR_LLAMA_Q8_0, KVR_LLAMA_Q8_0 },
    { GGML_TYPE_Q4_0, GGML_TYPE_F16, 1, KVR_LLAMA_Q4_0, KVR_LLAMA_F16 },
    { GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, 1, KVR_LLAMA_Q4_1, KVR_LLAMA_Q5_0 },
};

Test(llama_bridge, round_trip_gives_bit_identical_logits)
{
    kvr_client *c = testd_connect(&D);
    char path[512];
    kvr_llama_model m;
    model(path, sizeof path, "rt", "--layers 2 --width 128 --heads 2 --kv-heads 1 --head-dim 64 --seed 3", &m, c);
    llama_token toks[N_PROMPT + 1];
    lt_tokens(toks, N_PROMPT + 1, 7);
    for (size_t k = 0; k < sizeof RT / sizeof RT[0]; k++) {
        const struct rt_case *r = &RT[k];
        lt_lm a, b;
        cr_assert_eq(lt_open(&a, path, r->type_k, r->type_v, r->fa, 256), 0);
        cr_assert_eq(lt_decode(&a, toks, N_PROMPT, 0, NULL), 0);
        size_t len;
        unsigned char *s0 = lt_state(&a, &len);
        float *la = malloc((size_t)a.n_vocab * 4), *lb = malloc((size_t)a.n_vocab * 4);
        cr_assert_eq(lt_decode(&a, toks + N_PROMPT, 1, N_PROMPT, la), 0);

        char ctx[32];
        snprintf(ctx, sizeof ctx, "rt%zu", k);
        import_state(c, ctx, &m, s0, len, toks, N_PROMPT);
        kvr_llama_export_opts o = { .type_k = r->tk, .type_v = r->tv, .v_trans = !r->fa };
        size_t l1;
        unsigned char *s1 = kvt_llama_export(c, ctx, &m, &o, &l1);
        cr_expect(l1 == len && memcmp(s0, s1, len) == 0,
                  "case %zu: the exported state equals llama.cpp's bytes", k);

        cr_assert_eq(lt_open(&b, path, r->type_k, r->type_v, r->fa, 256), 0);
        cr_assert_eq(llama_state_seq_set_data(b.ctx, s1, l1, 0), l1, "set_data accepts the export");
        cr_assert_eq(lt_decode(&b, toks + N_PROMPT, 1, N_PROMPT, lb), 0);
        cr_assert(memcmp(la, lb, (size_t)a.n_vocab * 4) == 0,
                  "case %zu (K %s, V %s, fa %d): logits bit-identical (max diff %g)", k,
                  kvr_llama_type_name(r->tk), kvr_llama_type_name(r->tv), r->fa,
                  lt_max_diff(la, lb, a.n_vocab));
        free(s0);
        kvr_llama_free(s1);
        free(la);
        free(lb);
        lt_close(&a);
        lt_close(&b);
    }
    kvr_client_close(c);
}

static int run(const char *cmd)
{
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/* N_PROMPT tokens (seed) decoded in *a (f16 cache, flash attention fa),
 * saved as a session file; returns the logits of token N_PROMPT after them
 * (malloc'ed, n_vocab floats). toks gets N_PROMPT + 1 ids. */
static float *prompt_session(lt_lm *a, const char *path, int fa, unsigned seed, llama_token *toks,
                             const char *sess)
{
    lt_tokens(toks, N_PROMPT + 1, seed);
    cr_assert_eq(lt_open(a, path, GGML_TYPE_F16, GGML_TYPE_F16, fa, 256), 0);
    cr_assert_eq(lt_decode(a, toks, N_PROMPT, 0, NULL), 0);
    cr_assert_gt(llama_state_seq_save_file(a->ctx, sess, 0, toks, N_PROMPT), 0);
    float *la = malloc((size_t)a->n_vocab * 4);
    cr_assert_eq(lt_decode(a, toks + N_PROMPT, 1, N_PROMPT, la), 0);
    return la;
}

Test(llama_bridge, round_trip_through_the_cli_in_other_processes)
{
    kvr_client *c = testd_connect(&D);
    char path[512];
    kvr_llama_model m;
    model(path, sizeof path, "cli", "--arch qwen2 --layers 2 --width 128 --heads 2 --kv-heads 2 --qkv-bias --dtype f16", &m, NULL);
    kvr_client_close(c);
    llama_token toks[N_PROMPT + 1];
    lt_lm a, b;
    char sess[400], out[400], out2[400], cmd[2048];
    snprintf(sess, sizeof sess, "%s/a.session", TMP);
    snprintf(out, sizeof out, "%s/b.state", TMP);
    snprintf(out2, sizeof out2, "%s/b.session", TMP);
    float *la = prompt_session(&a, path, 1, 11, toks, sess);
    float *lb = malloc((size_t)a.n_vocab * 4);

    const char *bin = testd_build_dir();
    snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s llama import doc %s --gguf %s --json > %s/imp.json",
             bin, D.sock, sess, path, TMP);
    cr_assert_eq(run(cmd), 0, "%s", cmd);
    snprintf(cmd, sizeof cmd, "grep -q '\"imported\":\\s*%d' %s/imp.json && grep -q '\"form\":\\s*\"session\"' %s/imp.json",
             N_PROMPT, TMP, TMP);
    cr_assert_eq(run(cmd), 0, "the JSON report names the cells and the form");
    snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s llama export doc -o %s --gguf %s -q", bin,
             D.sock, out, path);
    cr_assert_eq(run(cmd), 0, "%s", cmd);
    snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s llama export doc -o %s --gguf %s --session --json > /dev/null",
             bin, D.sock, out2, path);
    cr_assert_eq(run(cmd), 0, "%s", cmd);

    /* raw form into a fresh context */
    FILE *f = fopen(out, "rb");
    cr_assert_not_null(f);
    unsigned char *buf = malloc(1 << 22);
    size_t n = fread(buf, 1, 1 << 22, f);
    fclose(f);
    cr_assert_eq(lt_open(&b, path, GGML_TYPE_F16, GGML_TYPE_F16, 1, 256), 0);
    cr_assert_eq(llama_state_seq_set_data(b.ctx, buf, n, 0), n);
    cr_assert_eq(lt_decode(&b, toks + N_PROMPT, 1, N_PROMPT, lb), 0);
    cr_assert(memcmp(la, lb, (size_t)a.n_vocab * 4) == 0, "raw state: logits bit-identical");
    lt_close(&b);
    /* session form through llama.cpp's own loader */
    cr_assert_eq(lt_open(&b, path, GGML_TYPE_F16, GGML_TYPE_F16, 1, 256), 0);
    llama_token back[N_PROMPT + 8];
    size_t nt = 0;
    cr_assert_gt(llama_state_seq_load_file(b.ctx, out2, 0, back, N_PROMPT + 8, &nt), 0);
    cr_assert_eq(nt, (size_t)N_PROMPT);
    cr_assert(memcmp(back, toks, sizeof(llama_token) * N_PROMPT) == 0, "tokens come back");
    cr_assert_eq(lt_decode(&b, toks + N_PROMPT, 1, N_PROMPT, lb), 0);
    cr_assert(memcmp(la, lb, (size_t)a.n_vocab * 4) == 0, "session file: logits bit-identical");
    free(buf);
    free(la);
    free(lb);
    lt_close(&a);
    lt_close(&b);
}

/* ---- the V layout a context came with ---------------------------------------- */

/* Runs cmd (stdout into TMP/out.txt) and returns its exit status; out gets
 * what it printed. */
static int run_out(const char *cmd, char *out, size_t cap)
{
    char full[2600], path[400];
    snprintf(path, sizeof path, "%s/out.txt", TMP);
    snprintf(full, sizeof full, "%s > %s", cmd, path);
    int rc = run(full);
    size_t n;
    char *text = opsd_slurp(path, &n);
    snprintf(out, cap, "%s", text ? text : "");
    free(text);
    return rc;
}

/* A raw state exported by the CLI into a fresh context (fa as given):
 * whether llama.cpp takes it, and if so the next token's logits. */
static bool load_raw(const char *path, const char *file, int fa, const llama_token *next,
                     float *logits)
{
    size_t n;
    char *buf = opsd_slurp(file, &n);
    cr_assert_not_null(buf, "%s", file);
    lt_lm b;
    cr_assert_eq(lt_open(&b, path, GGML_TYPE_F16, GGML_TYPE_F16, fa, 256), 0);
    bool ok = llama_state_seq_set_data(b.ctx, (const uint8_t *)buf, n, 0) == n;
    if (ok) cr_assert_eq(lt_decode(&b, next, 1, N_PROMPT, logits), 0);
    lt_close(&b);
    free(buf);
    return ok;
}

/* Issue 31: a context imported from a flash-attention-off state (V
 * transposed) is exported, with no option, in that layout, which the same
 * kind of context takes back; the record survives a kill -9 and restart of a
 * daemon with persistence, and a fork; export says which layout it wrote. */
Test(llama_bridge, export_defaults_to_the_v_layout_imported)
{
    testd_stop(&D);
    char disk[400], cmd[2048], out[8192];
    snprintf(disk, sizeof disk, "%s/disk", TMP);
    cr_assert_eq(mkdir(disk, 0700), 0);
    const char *extra[] = { "--disk-dir", disk, NULL };
    cr_assert_eq(testd_start(&D, extra), 0);
    char path[512];
    kvr_llama_model m;
    model(path, sizeof path, "vt", "--layers 2 --width 128 --heads 2 --kv-heads 1 --head-dim 64 --seed 5", &m, NULL);
    llama_token toks[N_PROMPT + 1];
    lt_lm a;
    char sess[400], st1[400], st0[400];
    snprintf(sess, sizeof sess, "%s/off.session", TMP);
    snprintf(st1, sizeof st1, "%s/off.state", TMP);
    snprintf(st0, sizeof st0, "%s/on.state", TMP);
    float *la = prompt_session(&a, path, 0, 13, toks, sess);
    float *lb = malloc((size_t)a.n_vocab * 4);
    const char *bin = testd_build_dir();

    snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s llama import doc %s --gguf %s --persist",
             bin, D.sock, sess, path);
    cr_assert_eq(run_out(cmd, out, sizeof out), 0, "%s", cmd);
    cr_assert(strstr(out, "V transposed") && strstr(out, "recorded"),
              "import says the state had V transposed and that it is recorded: %s", out);
    snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s stat doc --json", bin, D.sock);
    cr_assert_eq(run_out(cmd, out, sizeof out), 0, "%s", cmd);
    cr_assert(strstr(out, "\"v_trans\":\ttrue") || strstr(out, "\"v_trans\": true") ||
              strstr(out, "\"v_trans\":true"), "stat reports the record: %s", out);

    /* No option: the layout it came with, named; llama.cpp with flash
     * attention off takes it, logits bit-identical. */
    snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s llama export doc -o %s --gguf %s", bin,
             D.sock, st1, path);
    cr_assert_eq(run_out(cmd, out, sizeof out), 0, "%s", cmd);
    cr_assert(strstr(out, "V layout written: v_trans 1"), "export names the layout: %s", out);
    cr_assert(load_raw(path, st1, 0, toks + N_PROMPT, lb), "a flash-attention-off context takes "
              "the default export");
    cr_assert(memcmp(la, lb, (size_t)a.n_vocab * 4) == 0, "logits bit-identical");
    /* The other layout on request, said so, and what each kind of context
     * does with it: the reason for the default. */
    snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s llama export doc -o %s --gguf %s --no-v-trans",
             bin, D.sock, st0, path);
    cr_assert_eq(run_out(cmd, out, sizeof out), 0, "%s", cmd);
    cr_assert(strstr(out, "V layout written: v_trans 0"), "%s", out);
    cr_assert_not(load_raw(path, st0, 0, toks + N_PROMPT, lb),
                  "llama.cpp (flash attention off) refuses v_trans 0");
    cr_assert(load_raw(path, st0, 1, toks + N_PROMPT, lb), "flash attention on takes v_trans 0");
    snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s llama export doc -o %s --gguf %s --v-trans "
             "--no-v-trans 2>/dev/null", bin, D.sock, st0, path);
    cr_assert_eq(run_out(cmd, out, sizeof out), 2, "both options: a usage error");

    /* kill -9, restart on the same disk: the record is back; a fork keeps it. */
    kill(D.pid, SIGKILL);
    waitpid(D.pid, NULL, 0);
    D.pid = 0;
    kvr_testd old = D;
    testd_stop(&old);
    cr_assert_eq(testd_start(&D, extra), 0, "kvroped restarts on %s", disk);
    snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s fork doc doc2", bin, D.sock);
    cr_assert_eq(run_out(cmd, out, sizeof out), 0, "%s (the context came back)", cmd);
    const char *ids[] = { "doc", "doc2" };
    for (int i = 0; i < 2; i++) {
        unlink(st1);
        snprintf(cmd, sizeof cmd, "%s/kvrope --socket %s llama export %s -o %s --gguf %s --json",
                 bin, D.sock, ids[i], st1, path);
        cr_assert_eq(run_out(cmd, out, sizeof out), 0, "%s", cmd);
        cr_assert(strstr(out, "\"v_trans\":\ttrue") || strstr(out, "\"v_trans\": true") ||
                  strstr(out, "\"v_trans\":true"), "%s after the restart: %s", ids[i], out);
        memset(lb, 0, (size_t)a.n_vocab * 4);
        cr_assert(load_raw(path, st1, 0, toks + N_PROMPT, lb), "%s after the restart: taken",
                  ids[i]);
        cr_assert(memcmp(la, lb, (size_t)a.n_vocab * 4) == 0, "%s: logits bit-identical", ids[i]);
    }
    free(la);
    free(lb);
    lt_close(&a);
}

/* ---- re-rotation against llama.cpp's K-shift --------------------------------- */

/* How far apart two shifted caches are, and each from the exact rotation.
 * f16: per rotation pair, max |a - b| over the pair in ulps of the pair's
 * magnitude r = |(x, y)| (a rotation spreads one rounding of the result over
 * the pair: each side is within 0.5 ulp(r) of the exact value, so one
 * rounding apart is 1 ulp(r)). q8_0: per element, in quantization steps
 * (the block's scale d), in the stored (Hadamard) domain. */
typedef struct kstat {
    double ab;              /* kvrope vs llama.cpp */
    double a_exact, b_exact;/* f16 only: llama.cpp / kvrope vs the exact rotation */
    bool   v_equal;
} kstat;

static void pair_idx(const kvr_llama_model *m, size_t o, uint32_t i, size_t *i0, size_t *i1)
{
    if (m->rope_type == KVR_LLAMA_ROPE_NORM) { *i0 = o + 2 * i; *i1 = o + 2 * i + 1; }
    else { *i0 = o + i; *i1 = o + i + m->rotary_dim / 2; }
}

static float *decode_all(const kvr_llama_model *m, const unsigned char *s, size_t l, uint32_t n,
                         bool stored_domain, kvr_llama_state **st)
{
    char err[400];
    cr_assert_eq(kvr_llama_state_parse(s, l, m, st, err, sizeof err), 0, "%s", err);
    cr_assert_geq((*st)->n_cells, n);
    size_t all = kvr_llama_payload_size(m, n, KVR_DTYPE_F32);
    float *f = malloc(all);
    cr_assert_eq(kvr_llama_state_decode(*st, m, 0, n, stored_domain, KVR_DTYPE_F32, f, all, err,
                                        sizeof err), 0, "%s", err);
    return f;
}

/* s0: the cache before the shift; sa: llama.cpp's after; sb: kvrope's. */
static kstat compare_k(const kvr_llama_model *m, const unsigned char *s0, size_t l0,
                       const unsigned char *sa, size_t la, const unsigned char *sb, size_t lb,
                       uint32_t n, int delta)
{
    kvr_llama_state *z, *a, *b;
    float *fz = decode_all(m, s0, l0, n, false, &z);
    float *fa = decode_all(m, sa, la, n, true, &a);
    float *fb = decode_all(m, sb, lb, n, true, &b);
    for (uint32_t i = 0; i < n; i++) {
        cr_assert_eq(a->pos[i], z->pos[i] + delta, "cell %u: llama.cpp's position", i);
        cr_assert_eq(b->pos[i], z->pos[i] + delta, "cell %u: kvrope's position", i);
    }
    uint32_t nv = m->n_kv_heads * m->head_dim, hd = m->head_dim;
    size_t side = (size_t)n * nv;
    kstat s = { 0, 0, 0, true };
    bool quant = kvr_llama_type_is_quantized(a->type_k);
    for (uint32_t l = 0; l < m->n_layers; l++) {
        const float *ka = fa + (size_t)l * 2 * side, *kb = fb + (size_t)l * 2 * side;
        const float *k0 = fz + (size_t)l * 2 * side;
        if (quant) {
            for (size_t i = 0; i < side; i++) {
                size_t cell = i / nv, blk = (i % nv) / 32;
                uint16_t ha, hb;
                memcpy(&ha, a->k[l] + cell * a->row_k + blk * 34, 2);
                memcpy(&hb, b->k[l] + cell * b->row_k + blk * 34, 2);
                double da = fabs((double)lt_h2f(ha)), db = fabs((double)lt_h2f(hb));
                double unit = da > db ? da : db, d = fabs((double)ka[i] - (double)kb[i]);
                if (unit > 0 && d / unit > s.ab) s.ab = d / unit;
            }
        } else {
            for (size_t t = 0; t < n; t++)
                for (uint32_t h = 0; h < m->n_kv_heads; h++)
                    for (uint32_t i = 0; i < m->rotary_dim / 2; i++) {
                        size_t i0, i1;
                        pair_idx(m, t * nv + (size_t)h * hd, i, &i0, &i1);
                        double th = (double)delta * pow(m->rope_base, -2.0 * i / m->rotary_dim);
                        double x = (double)k0[i0], y = (double)k0[i1];
                        double ex = x * cos(th) - y * sin(th), ey = x * sin(th) + y * cos(th);
                        double u = lt_ulp16(sqrt(ex * ex + ey * ey));
                        double dab = fmax(fabs((double)ka[i0] - (double)kb[i0]),
                                          fabs((double)ka[i1] - (double)kb[i1])) / u;
                        double dae = fmax(fabs((double)ka[i0] - ex), fabs((double)ka[i1] - ey)) / u;
                        double dbe = fmax(fabs((double)kb[i0] - ex), fabs((double)kb[i1] - ey)) / u;
                        s.ab = fmax(s.ab, dab);
                        s.a_exact = fmax(s.a_exact, dae);
                        s.b_exact = fmax(s.b_exact, dbe);
                    }
        }
        if (memcmp(ka + side, kb + side, side * 4) != 0) s.v_equal = false;
    }
    free(fz);
    free(fa);
    free(fb);
    kvr_llama_state_free(z);
    kvr_llama_state_free(a);
    kvr_llama_state_free(b);
    return s;
}

typedef struct shift_res {
    kstat  k;
    double logit_diff, logit_max;
    double fresh_diff;      /* |llama shift - fresh encode| logits: the scale of one rounding */
} shift_res;

/* Prompt at pos0.., then a shift by delta both ways, then one more token. */
static shift_res shift_case(kvr_client *c, const char *path, const kvr_llama_model *m,
                            int type, kvr_llama_type kt, int pos0, int delta, const char *ctx)
{
    llama_token toks[N_PROMPT + 1];
    lt_tokens(toks, N_PROMPT + 1, 5);
    lt_lm a, b, f;
    cr_assert_eq(lt_open(&a, path, type, GGML_TYPE_F16, 1, 256), 0);
    cr_assert_eq(lt_decode(&a, toks, N_PROMPT, pos0, NULL), 0);
    size_t l0;
    unsigned char *s0 = lt_state(&a, &l0);
    /* llama.cpp's own shift (applied by the next decode) */
    llama_memory_seq_add(llama_get_memory(a.ctx), 0, -1, -1, delta);
    float *la = malloc((size_t)a.n_vocab * 4), *lb = malloc((size_t)a.n_vocab * 4);
    float *lf = malloc((size_t)a.n_vocab * 4);
    cr_assert_eq(lt_decode(&a, toks + N_PROMPT, 1, pos0 + N_PROMPT + delta, la), 0);
    size_t lsa;
    unsigned char *sa = lt_state(&a, &lsa);
    /* kvrope's: import, export at the new positions, decode on top */
    import_state(c, ctx, m, s0, l0, toks, N_PROMPT);
    kvr_llama_export_opts o = { .type_k = kt, .type_v = KVR_LLAMA_F16, .has_pos_start = true,
                                .pos_start = pos0 + delta };
    size_t l1;
    unsigned char *s1 = kvt_llama_export(c, ctx, m, &o, &l1);
    cr_assert_eq(lt_open(&b, path, type, GGML_TYPE_F16, 1, 256), 0);
    cr_assert_eq(llama_state_seq_set_data(b.ctx, s1, l1, 0), l1);
    cr_assert_eq(lt_decode(&b, toks + N_PROMPT, 1, pos0 + N_PROMPT + delta, lb), 0);
    size_t lsb;
    unsigned char *sb = lt_state(&b, &lsb);
    /* a fresh encode at the shifted positions, for the scale of one rounding */
    cr_assert_eq(lt_open(&f, path, type, GGML_TYPE_F16, 1, 256), 0);
    cr_assert_eq(lt_decode(&f, toks, N_PROMPT + 1, pos0 + delta, lf), 0);

    shift_res r;
    r.k = compare_k(m, s0, l0, sa, lsa, sb, lsb, N_PROMPT, delta);
    r.logit_diff = lt_max_diff(la, lb, a.n_vocab);
    r.logit_max = lt_max_abs(la, a.n_vocab);
    r.fresh_diff = lt_max_diff(la, lf, a.n_vocab);
    free(s0);
    free(sa);
    free(sb);
    kvr_llama_free(s1);
    free(la);
    free(lb);
    free(lf);
    lt_close(&a);
    lt_close(&b);
    lt_close(&f);
    return r;
}

static void shift_matrix(const char *arch_args, const char *tag)
{
    kvr_client *c = testd_connect(&D);
    char path[512];
    kvr_llama_model m;
    model(path, sizeof path, tag, arch_args, &m, c);
    /* small, large, negative; and very large, where llama.cpp's float angles
     * (theta = p * base^(-2i/d) accumulated in float) drift past a rounding */
    static const struct { int pos0, delta; } DL[] = { { 0, 3 }, { 0, 1000 }, { 1000, -990 }, { 5, 40000 } };
    static const struct { int type; kvr_llama_type kt; } TY[] = {
        { GGML_TYPE_F16, KVR_LLAMA_F16 }, { GGML_TYPE_Q8_0, KVR_LLAMA_Q8_0 },
    };
    for (size_t t = 0; t < 2; t++)
        for (size_t d = 0; d < sizeof DL / sizeof DL[0]; d++) {
            char ctx[64];
            snprintf(ctx, sizeof ctx, "%s-%zu-%zu", tag, t, d);
            int delta = DL[d].delta;
            bool f16 = TY[t].type == GGML_TYPE_F16, huge = delta > 10000;
            shift_res r = shift_case(c, path, &m, TY[t].type, TY[t].kt, DL[d].pos0, delta, ctx);
            cr_log_info("%s %s delta %+d from %d: kvrope vs llama.cpp %.3f %s; vs exact: llama.cpp "
                        "%.3f, kvrope %.3f; V equal %d; logits diff %.3g (max %.3g; llama.cpp vs "
                        "fresh encode %.3g)", tag, kvr_llama_type_name(TY[t].kt), delta,
                        DL[d].pos0, r.k.ab, f16 ? "ulp(pair)" : "steps", r.k.a_exact,
                        r.k.b_exact, r.k.v_equal, r.logit_diff, r.logit_max, r.fresh_diff);
            if (f16) {
                /* kvrope: correctly rounded (double angles) at every delta */
                cr_expect_leq(r.k.b_exact, 0.5 + 1e-3, "%s delta %d: kvrope's keys are the exact "
                              "rotation rounded once (%.3f ulp)", tag, delta, r.k.b_exact);
                /* llama.cpp: the same, up to its float angles */
                cr_expect_leq(r.k.a_exact, huge ? 2.0 : 0.6, "%s delta %d: llama.cpp's shift vs exact "
                              "(%.3f ulp)", tag, delta, r.k.a_exact);
            }
            /* the two shifted caches: one rounding of the cache type apart (an
             * f16 ulp of the pair, or one quantization step); at 40000 llama.cpp's
             * own angle error (measured above, up to 1.6 ulp) adds to it */
            double tol = huge ? (f16 ? 2.5 : 1.05) : 1.0 + 1e-6;
            cr_expect_leq(r.k.ab, tol, "%s %s delta %d: keys within one rounding of llama.cpp's "
                          "(%.3f)", tag, kvr_llama_type_name(TY[t].kt), delta, r.k.ab);
            cr_expect(r.k.v_equal, "values untouched by both shifts");
            /* next-token logits: no further apart than llama.cpp's shifted cache is
             * from a fresh encode at those positions (which also differs from it by
             * roundings of the cache type) */
            cr_expect_leq(r.logit_diff, r.fresh_diff > 0 ? r.fresh_diff : 1e-6,
                          "%s %s delta %d: logits agree (%.3g vs fresh %.3g)", tag,
                          kvr_llama_type_name(TY[t].kt), delta, r.logit_diff, r.fresh_diff);
        }
    kvr_client_close(c);
}

Test(llama_bridge, reposition_equals_llama_shift_norm)
{
    shift_matrix("--arch llama --layers 2 --width 128 --heads 2 --kv-heads 1 --head-dim 64 --seed 9", "norm");
}

Test(llama_bridge, reposition_equals_llama_shift_neox)
{
    shift_matrix("--arch qwen2 --layers 2 --width 128 --heads 2 --kv-heads 2 --qkv-bias --seed 4", "neox");
}

/* ---- YaRN: norms after a shift ------------------------------------------------ */

/* Per-head key norms of layer 0 for cells [0, n) (layer 0's keys before RoPE
 * do not depend on positions, so every path must give the same norms). */
static double *k0_norms(const kvr_llama_model *m, const unsigned char *s, size_t l, uint32_t n)
{
    kvr_llama_state *st;
    float *f = decode_all(m, s, l, n, false, &st);
    double *out = calloc((size_t)n * m->n_kv_heads, sizeof *out);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < m->n_kv_heads; h++) {
            double q = 0;
            const float *k = f + ((size_t)t * m->n_kv_heads + h) * m->head_dim;
            for (uint32_t d = 0; d < m->rotary_dim; d++) q += (double)k[d] * (double)k[d];
            out[t * m->n_kv_heads + h] = sqrt(q);
        }
    free(f);
    kvr_llama_state_free(st);
    return out;
}

static int open_profile(lt_lm *lm, const char *path, const kvr_llama_model *m, int type)
{
    memset(lm, 0, sizeof *lm);
    lm->model = llama_model_load_from_file(path, llama_model_default_params());
    if (!lm->model) return -1;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.type_k = cp.type_v = (enum ggml_type)type;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    kvr_llama_model_context_params(m, &cp);
    lm->ctx = llama_init_from_model(lm->model, cp);
    lm->vocab = llama_model_get_vocab(lm->model);
    lm->n_vocab = llama_vocab_n_tokens(lm->vocab);
    return lm->ctx ? 0 : -1;
}

Test(llama_bridge, yarn_shift_keeps_norms_and_llama_shift_is_measured)
{
    kvr_client *c = testd_connect(&D);
    char path[512];
    kvr_llama_model m;
    model(path, sizeof path, "yarn", "--arch llama --layers 2 --width 128 --heads 2 --kv-heads 1 "
          "--head-dim 64 --rope-scaling yarn --rope-factor 4 --orig-ctx 512 --ctx 2048 --seed 2", &m, c);
    cr_assert_eq(m.scaling, KVR_ROPE_SCALING_YARN);
    double mscale = 0.1 * log(4.0) + 1.0;
    cr_assert_float_eq(m.mscale, mscale, 1e-12, "YaRN magnitude (0.1 ln 4 + 1) in the profile");
    llama_token toks[N_PROMPT + 1];
    lt_tokens(toks, N_PROMPT + 1, 3);
    const int delta = 700;
    static const struct { int type; kvr_llama_type kt; double tol; } TY[] = {
        { GGML_TYPE_F32, KVR_LLAMA_F32, 1e-6 }, { GGML_TYPE_F16, KVR_LLAMA_F16, 2e-3 },
    };
    for (size_t t = 0; t < 2; t++) {
        lt_lm a, b, f;
        cr_assert_eq(open_profile(&a, path, &m, TY[t].type), 0);
        cr_assert_eq(lt_decode(&a, toks, N_PROMPT, 0, NULL), 0);
        size_t l0;
        unsigned char *s0 = lt_state(&a, &l0);
        /* fresh encode at the shifted positions */
        cr_assert_eq(open_profile(&f, path, &m, TY[t].type), 0);
        cr_assert_eq(lt_decode(&f, toks, N_PROMPT, delta, NULL), 0);
        size_t lf;
        unsigned char *sf = lt_state(&f, &lf);
        /* kvrope's shift */
        char ctx[32];
        snprintf(ctx, sizeof ctx, "yarn%zu", t);
        import_state(c, ctx, &m, s0, l0, toks, N_PROMPT);
        kvr_llama_export_opts o = { .type_k = TY[t].kt, .type_v = TY[t].kt, .has_pos_start = true,
                                    .pos_start = delta };
        size_t l1;
        unsigned char *s1 = kvt_llama_export(c, ctx, &m, &o, &l1);
        /* llama.cpp's own shift, applied by the next decode */
        llama_memory_seq_add(llama_get_memory(a.ctx), 0, -1, -1, delta);
        cr_assert_eq(lt_decode(&a, toks + N_PROMPT, 1, N_PROMPT + delta, NULL), 0);
        size_t la;
        unsigned char *sa = lt_state(&a, &la);
        /* and kvrope's state is usable: a decode on top works */
        cr_assert_eq(open_profile(&b, path, &m, TY[t].type), 0);
        cr_assert_eq(llama_state_seq_set_data(b.ctx, s1, l1, 0), l1);
        cr_assert_eq(lt_decode(&b, toks + N_PROMPT, 1, N_PROMPT + delta, NULL), 0);

        double *n0 = k0_norms(&m, s0, l0, N_PROMPT), *nf = k0_norms(&m, sf, lf, N_PROMPT);
        double *nk = k0_norms(&m, s1, l1, N_PROMPT), *nl = k0_norms(&m, sa, la, N_PROMPT);
        double worst_kv = 0, worst_fresh = 0, ratio_min = 1e9, ratio_max = 0;
        for (size_t i = 0; i < (size_t)N_PROMPT * m.n_kv_heads; i++) {
            worst_kv = fmax(worst_kv, fabs(nk[i] / nf[i] - 1));
            worst_fresh = fmax(worst_fresh, fabs(n0[i] / nf[i] - 1));
            ratio_min = fmin(ratio_min, nl[i] / nf[i]);
            ratio_max = fmax(ratio_max, nl[i] / nf[i]);
        }
        cr_log_info("YaRN %s: kvrope's shifted key norms vs a fresh encode: max rel diff %.2e; "
                    "llama.cpp's shift multiplies the norms by %.6f..%.6f (YaRN magnitude %.6f)",
                    kvr_llama_type_name(TY[t].kt), worst_kv, ratio_min, ratio_max, mscale);
        cr_expect_leq(worst_fresh, TY[t].tol, "a fresh encode's norms do not depend on position");
        cr_expect_leq(worst_kv, TY[t].tol, "kvrope's shift is a pure rotation: norms kept (%.2e)",
                      worst_kv);
        /* What llama.cpp v0.5.0's own K-shift does to them, measured: see
         * YARN_SHIFT_RATIO below. */
        cr_expect(fabs(ratio_min - YARN_SHIFT_RATIO) <= YARN_SHIFT_TOL &&
                  fabs(ratio_max - YARN_SHIFT_RATIO) <= YARN_SHIFT_TOL,
                  "llama.cpp's YaRN shift scales key norms by %.6f..%.6f (recorded: %.6f)",
                  ratio_min, ratio_max, (double)YARN_SHIFT_RATIO);
        free(n0); free(nf); free(nk); free(nl);
        free(s0); free(sf); free(sa);
        kvr_llama_free(s1);
        lt_close(&a); lt_close(&b); lt_close(&f);
    }
    kvr_client_close(c);
}

/* llama.cpp v0.5.0 cannot shift a quantized K cache without the Hadamard
 * transform (head_dim 32: a NULL matrix in its shift graph crashes the next
 * decode). kvrope can: the shifted state loads and decodes, and its logits
 * are as close to a fresh encode at the new positions as one requantization
 * allows. */
Test(llama_bridge, quantized_cache_without_hadamard_shifts_through_kvrope)
{
    kvr_client *c = testd_connect(&D);
    char path[512];
    kvr_llama_model m;
    model(path, sizeof path, "q32", "--layers 2 --width 64 --heads 2 --kv-heads 1 --head-dim 32 --seed 6", &m, c);
    llama_token toks[N_PROMPT + 1];
    lt_tokens(toks, N_PROMPT + 1, 8);
    lt_lm a, b, f;
    cr_assert_eq(lt_open(&a, path, GGML_TYPE_Q8_0, GGML_TYPE_F16, 1, 256), 0);
    cr_assert_eq(lt_decode(&a, toks, N_PROMPT, 0, NULL), 0);
    size_t l0;
    unsigned char *s0 = lt_state(&a, &l0);
    import_state(c, "q32", &m, s0, l0, toks, N_PROMPT);
    kvr_llama_export_opts o = { .type_k = KVR_LLAMA_Q8_0, .type_v = KVR_LLAMA_F16,
                                .has_pos_start = true, .pos_start = 300 };
    size_t l1;
    unsigned char *s1 = kvt_llama_export(c, "q32", &m, &o, &l1);
    float *lb = malloc((size_t)a.n_vocab * 4), *lf = malloc((size_t)a.n_vocab * 4);
    cr_assert_eq(lt_open(&b, path, GGML_TYPE_Q8_0, GGML_TYPE_F16, 1, 256), 0);
    cr_assert_eq(llama_state_seq_set_data(b.ctx, s1, l1, 0), l1);
    cr_assert_eq(lt_decode(&b, toks + N_PROMPT, 1, 300 + N_PROMPT, lb), 0);
    cr_assert_eq(lt_open(&f, path, GGML_TYPE_Q8_0, GGML_TYPE_F16, 1, 256), 0);
    cr_assert_eq(lt_decode(&f, toks, N_PROMPT + 1, 300, lf), 0);
    double diff = lt_max_diff(lb, lf, a.n_vocab), mx = lt_max_abs(lf, a.n_vocab);
    cr_log_info("q8_0, head_dim 32, shifted by 300 through kvrope: logits vs a fresh encode %.3g (max %.3g)",
                diff, mx);
    cr_expect_leq(diff, 0.02 * mx, "logits within q8_0 error of a fresh encode (%.3g)", diff);
    free(s0);
    kvr_llama_free(s1);
    free(lb);
    free(lf);
    lt_close(&a);
    lt_close(&b);
    lt_close(&f);
    kvr_client_close(c);
}
