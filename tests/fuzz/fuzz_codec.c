/*
 * fuzz_codec.c — libFuzzer target for codec specs at rest (docs/quantized.md
 * grammar: "k4v2", "kivi:k2v2:g64:r32", "k=int4/g64/c,v=q4_0,r=128", ...),
 * as register_model.codec and put.codec reach them: kvr_codec_parse of one
 * side, then the store's full check (kvr_store_codec_check) against a model
 * of each native dtype. The input is the spec's bytes (cut at 200, then
 * NUL-terminated, as a protobuf string would be).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "cache/codec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static kvr_store *S;

static void init_store(void)
{
    kvr_store_config sc = { .max_memory = 16u << 20 };
    if (kvr_store_create(&S, &sc, NULL) != 0)
        abort();
    static const char *const names[] = { "f32", "f16", "bf16" };
    static const kvr_dtype dts[] = { KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16 };
    for (int i = 0; i < 3; i++) {
        kvr_model_desc d = { .name = names[i], .n_layers = 2, .n_kv_heads = 2,
                             .head_dim = 64, .dtype = dts[i] };
        kvr_rope_config_init(&d.rope);
        d.rope.head_dim = 64;
        d.rope.rotary_dim = 64;
        if (kvr_store_model_register(S, &d, NULL, NULL) != 0)
            abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!S)
        init_store();
    char spec[201];
    size_t n = size < 200 ? size : 200;
    memcpy(spec, data, n);
    spec[n] = '\0';
    kvr_codec c;
    (void)kvr_codec_parse(spec, &c);
    static const char *const models[] = { "f32", "f16", "bf16" };
    for (int i = 0; i < 3; i++) {
        char canon[KVR_CODEC_NAME_MAX];
        kvr_error e;
        if (kvr_store_codec_check(S, models[i], spec, canon, &e) == 0) {
            /* The canonical form is a fixed point. */
            char again[KVR_CODEC_NAME_MAX];
            if (kvr_store_codec_check(S, models[i], canon, again, &e) != 0 ||
                strcmp(canon, again) != 0)
                abort();
        }
    }
    return 0;
}
