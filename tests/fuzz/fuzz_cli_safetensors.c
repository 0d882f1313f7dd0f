/*
 * fuzz_cli_safetensors.c — libFuzzer target for the CLI's safetensors
 * reader (`kvrope put CTX FILE.safetensors`, `kvrope edit --kv`): the
 * 8-byte header length, the JSON header, tensor dtypes/shapes/offsets and
 * the optional tokens/positions tensors, through kvr__cli_st_parse. On success
 * the K and V tensors must lie inside the input.
 */
#include <stdint.h>
#include <stdlib.h>

#include "client/cli/cli_parse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    cli_st_kv st;
    char err[400];
    if (kvr__cli_st_parse(data, size, &st, err, sizeof err) == 0) {
        size_t half = kvr_payload_size(st.n_layers, st.n_tokens, st.n_heads, st.head_dim,
                                       st.dtype) / 2;
        if (st.k < data || st.k + half > data + size || st.v < data ||
            st.v + half > data + size)
            abort();
        kvr__cli_st_free(&st);
    }
    return 0;
}
