/*
 * fuzz_hf_config.c — libFuzzer target for the Hugging Face config.json
 * reader (kvr_rope_config_from_json: shape, rope_theta, rope_scaling of
 * every type, partial rotary factors, longrope factor lists), with each
 * style override, then validation and, when valid, building the RoPE
 * engine (its tables) from it, as register_model.config_json does.
 */
#include <stdint.h>
#include <stdlib.h>

#include "rope/rope.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char *const styles[] = { NULL, "neox", "gptj" };
    for (int i = 0; i < 3; i++) {
        kvr_rope_config cfg;
        kvr_error err;
        if (kvr_rope_config_from_json(&cfg, (const char *)data, size, styles[i], &err) != 0)
            continue;
        if (cfg.head_dim > 512)
            continue;    /* tables grow with head_dim x positions: keep runs fast */
        if (kvr_rope_config_validate(&cfg, &err) != 0)
            continue;
        kvr_rope *r = NULL;
        if (kvr_rope_create(&r, &cfg, &err) == 0)
            kvr_rope_destroy(r);
    }
    return 0;
}
