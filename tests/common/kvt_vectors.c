/*
 * kvt_vectors.c — tests/common/kvt_vectors.h: the RoPE vectors' manifest
 * and its cases' configs.
 */
#include "tests/common/kvt_vectors.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/common/kvt.h"

cJSON *kvt_rope_manifest(void)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/rope/manifest.json", kvt_vectors_dir());
    size_t len;
    char *txt = kvt_slurp(path, &len);
    cr_assert(txt != NULL, "cannot read %s (set KVR_VECTORS)", path);
    cJSON *m = cJSON_ParseWithLength(txt, len);
    cr_assert(m != NULL, "%s is not JSON", path);
    free(txt);
    return m;
}

void kvt_rope_case_config(const cJSON *c, double n_heads, kvr_rope_config *out)
{
    const char *name = cJSON_GetObjectItem(c, "name")->valuestring;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "head_dim", cJSON_GetObjectItem(c, "head_dim")->valuedouble);
    cJSON_AddNumberToObject(j, "rotary_dim", cJSON_GetObjectItem(c, "rotary_dim")->valuedouble);
    cJSON_AddNumberToObject(j, "rope_theta", cJSON_GetObjectItem(c, "theta_base")->valuedouble);
    cJSON_AddNumberToObject(j, "num_attention_heads", n_heads);
    const cJSON *rs = cJSON_GetObjectItem(c, "rope_scaling");
    if (rs && !cJSON_IsNull(rs))
        cJSON_AddItemToObject(j, "rope_scaling", cJSON_Duplicate(rs, 1));
    char *ct = cJSON_PrintUnformatted(j);
    kvr_error err = { 0 };
    int rc = kvr_rope_config_from_json(out, ct, strlen(ct),
                                       cJSON_GetObjectItem(c, "style")->valuestring, &err);
    cr_assert_eq(rc, 0, "%s: config refused: %s", name, err.msg);
    free(ct);
    cJSON_Delete(j);
}

kvr_rope *kvt_rope_new(const kvr_rope_config *c)
{
    kvr_rope *r = NULL;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_rope_create(&r, c, &err), 0, "%s", err.msg);
    return r;
}
