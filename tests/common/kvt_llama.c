/*
 * kvt_llama.c — tests/common/kvt_llama.h: the bridge's state export, asserted.
 */
#include "tests/common/kvt_llama.h"

#include <criterion/criterion.h>

unsigned char *kvt_llama_export(kvr_client *c, const char *ctx, const kvr_llama_model *m,
                                const kvr_llama_export_opts *o, size_t *len)
{
    void *st;
    char err[400];
    int rc = kvr_llama_state_export(c, ctx, m, o, &st, len, NULL, err, sizeof err);
    cr_assert_eq(rc, 0, "export: %s", err);
    return st;
}
