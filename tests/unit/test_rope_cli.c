/*
 * test_rope_cli.c — `kvrope rope apply|remove|reposition` on raw files, driven
 * through kvr_cli_rope_main. test_rope_* binaries link rope/ and base/ only;
 * this one links the CLI's rope file too (the Makefile's rule for it).
 */
#include "client/cli/cli_rope.h"
#include "rope/rope.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tests/common/kvt.h"

#include <criterion/criterion.h>
#include <math.h>
#include <unistd.h>

static char dir[64];
static char path_cfg[128], path_x[128], path_po[128], path_pn[128], path_out[128],
            path_po64[128], path_pn64[128], path_kold[128], path_knew[128];
static const char *vec = NULL;

/* neox_insert_shift from the ggml vectors: 32 tokens, 2 heads, head_dim 128 */
static void setup(void)
{
    vec = kvt_vectors_dir();
    snprintf(dir, sizeof dir, "/tmp/kvr_cli_rope_XXXXXX");
    cr_assert(mkdtemp(dir));
    snprintf(path_cfg, sizeof path_cfg, "%s/config.json", dir);
    snprintf(path_out, sizeof path_out, "%s/out.bin", dir);
    snprintf(path_po64, sizeof path_po64, "%s/po64.bin", dir);
    snprintf(path_pn64, sizeof path_pn64, "%s/pn64.bin", dir);
    snprintf(path_x, sizeof path_x, "%s/rope/neox_insert_shift.x.f32", vec);
    snprintf(path_po, sizeof path_po, "%s/rope/neox_insert_shift.pos_old.i32", vec);
    snprintf(path_pn, sizeof path_pn, "%s/rope/neox_insert_shift.pos_new.i32", vec);
    snprintf(path_kold, sizeof path_kold, "%s/rope/neox_insert_shift.k_old.f32", vec);
    snprintf(path_knew, sizeof path_knew, "%s/rope/neox_insert_shift.k_new.f32", vec);
    const char *cfg = "{\"model_type\":\"llama\",\"hidden_size\":4096,\"num_attention_heads\":32,"
                      "\"num_key_value_heads\":2,\"rope_theta\":10000.0}";
    kvt_write_file(path_cfg, cfg, strlen(cfg));
    size_t n;
    int32_t *p = kvt_read_file(path_po, &n);
    int64_t q[32];
    for (int i = 0; i < 32; i++) q[i] = p[i];
    kvt_write_file(path_po64, q, sizeof q);
    free(p);
    p = kvt_read_file(path_pn, &n);
    for (int i = 0; i < 32; i++) q[i] = p[i];
    kvt_write_file(path_pn64, q, sizeof q);
    free(p);
}

static void teardown(void)
{
    unlink(path_cfg); unlink(path_out); unlink(path_po64); unlink(path_pn64);
    rmdir(dir);
}

static int run(const char *const *args)
{
    char *argv[40];
    int argc = 0;
    argv[argc++] = strdup("rope");
    for (; *args; args++) argv[argc++] = strdup(*args);
    argv[argc] = NULL;
    int rc = kvr_cli_rope_main(argc, argv);
    for (int i = 0; i < argc; i++) free(argv[i]);
    return rc;
}

static void expect_out(const char *ref_path, kvr_dtype dt, double tol)
{
    size_t n, nr;
    void *o = kvt_read_file(path_out, &n);
    float *ref = kvt_read_file(ref_path, &nr);
    size_t nel = nr / 4;
    cr_assert_eq(n, nel * kvr_dtype_size(dt));
    float *f = malloc(nel * 4);
    kvr_convert(f, KVR_DTYPE_F32, o, dt, nel);
    for (size_t i = 0; i < nel; i++)
        cr_assert_leq(fabs((double)f[i] - (double)ref[i]), tol + fabs((double)ref[i]) * 0x1p-10,
                      "element %zu: %g vs %g", i, (double)f[i], (double)ref[i]);
    free(o); free(ref); free(f);
}

TestSuite(rope_cli, .init = setup, .fini = teardown);

Test(rope_cli, apply_remove_reposition_f32)
{
    const char *a[] = { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2",
                        "--in", path_x, "--pos", path_po, "--out", path_out, NULL };
    cr_assert_eq(run(a), 0);
    expect_out(path_kold, KVR_DTYPE_F32, 0.000238);
    const char *b[] = { "reposition", "--config", path_cfg, "--tokens", "32", "--heads", "2",
                        "--dtype", "f32", "--in", path_kold, "--from-pos", path_po,
                        "--pos", path_pn, "--out", path_out, NULL };
    cr_assert_eq(run(b), 0);
    expect_out(path_knew, KVR_DTYPE_F32, 0.000238);
    const char *c[] = { "remove", "--config", path_cfg, "--tokens", "32", "--heads", "2",
                        "--in", path_knew, "--pos", path_pn, "--out", path_out, NULL };
    cr_assert_eq(run(c), 0);
    expect_out(path_x, KVR_DTYPE_F32, 0.000238);
}

Test(rope_cli, i64_positions_f16_out_and_style)
{
    const char *a[] = { "reposition", "--config", path_cfg, "--style", "neox", "--tokens", "32",
                        "--heads", "2", "--dtype", "f32", "--out-dtype", "f16", "--in", path_kold,
                        "--pos-dtype", "i64", "--from-pos", path_po64, "--pos", path_pn64,
                        "--out", path_out, NULL };
    cr_assert_eq(run(a), 0);
    expect_out(path_knew, KVR_DTYPE_F16, 0.000238);
    /* gptj pairing gives a different (wrong for this data) answer: it is honoured */
    const char *b[] = { "apply", "--config", path_cfg, "--style", "gptj", "--tokens", "32",
                        "--heads", "2", "--in", path_x, "--pos", path_po, "--out", path_out, NULL };
    cr_assert_eq(run(b), 0);
    size_t n, nr;
    float *o = kvt_read_file(path_out, &n), *ref = kvt_read_file(path_kold, &nr);
    double worst = 0;
    for (size_t i = 0; i < nr / 4; i++) worst = fmax(worst, fabs((double)o[i] - (double)ref[i]));
    cr_assert_gt(worst, 0.1);
    free(o); free(ref);
}

Test(rope_cli, bad_arguments_exit_2)
{
    const char *cases[][20] = {
        { NULL },
        { "spin", NULL },
        { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--in", path_x,
          "--out", path_out, NULL }, /* no --pos */
        { "apply", "--config", path_cfg, "--tokens", "zero", "--heads", "2", "--in", path_x,
          "--pos", path_po, "--out", path_out, NULL },
        { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--dtype", "f64",
          "--in", path_x, "--pos", path_po, "--out", path_out, NULL },
        { "reposition", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--in", path_x,
          "--pos", path_po, "--out", path_out, NULL }, /* no --from-pos */
        { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--in", path_x,
          "--pos", path_po, "--out", path_out, "--bogus", "1", NULL },
        { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--in", path_x,
          "--pos", path_po, "--out", NULL }, /* missing value */
        { "apply", "--config", path_cfg, "--style", "diagonal", "--tokens", "32", "--heads", "2",
          "--in", path_x, "--pos", path_po, "--out", path_out, NULL },
        { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--pos-dtype", "i16",
          "--in", path_x, "--pos", path_po, "--out", path_out, NULL },
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        cr_assert_eq(run(cases[i]), 2, "case %zu", i);
}

Test(rope_cli, io_and_size_errors_exit_1)
{
    /* a config the engine refuses (the last case) */
    char bad[160];
    snprintf(bad, sizeof bad, "%s/bad.json", dir);
    const char *bj = "{\"head_dim\":128,\"rope_scaling\":{\"rope_type\":\"linear\"}}";
    kvt_write_file(bad, bj, strlen(bj));
    const char *cases[][20] = {
        /* tokens * heads * head_dim does not match the file */
        { "apply", "--config", path_cfg, "--tokens", "31", "--heads", "2", "--in", path_x,
          "--pos", path_po, "--out", path_out, NULL },
        { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--dtype", "f16",
          "--in", path_x, "--pos", path_po, "--out", path_out, NULL },
        /* i64 positions claimed on an i32 file */
        { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--pos-dtype", "i64",
          "--in", path_x, "--pos", path_po, "--out", path_out, NULL },
        { "apply", "--config", "/nonexistent/config.json", "--tokens", "32", "--heads", "2",
          "--in", path_x, "--pos", path_po, "--out", path_out, NULL },
        { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--in",
          "/nonexistent/x", "--pos", path_po, "--out", path_out, NULL },
        { "apply", "--config", path_cfg, "--tokens", "32", "--heads", "2", "--in", path_x,
          "--pos", path_po, "--out", "/nonexistent/dir/out", NULL },
        { "apply", "--config", bad, "--tokens", "32", "--heads", "2", "--in", path_x, "--pos",
          path_po, "--out", path_out, NULL },
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        cr_assert_eq(run(cases[i]), 1, "case %zu", i);
    unlink(bad);
}
