/*
 * fuzz_cli_ops.c — libFuzzer target for the CLI's edit-ops JSON
 * (`kvrope edit --ops FILE`: [{"start", "end", "tokens"}, ...]) through
 * kvr__cli_edit_ops_parse. Checks what it promises: on success every op's tokens
 * lie inside the token buffer and their count adds up.
 */
#include <stdint.h>
#include <stdlib.h>

#include "client/cli/cli_parse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvr_edit_range *ops;
    uint32_t *tb;
    size_t n, n_new;
    char err[400];
    if (kvr__cli_edit_ops_parse((const char *)data, size, &ops, &n, &tb, &n_new, err,
                           sizeof err) == 0) {
        size_t sum = 0;
        for (size_t i = 0; i < n; i++) {
            if (ops[i].n_tokens && (ops[i].tokens < tb || ops[i].tokens + ops[i].n_tokens >
                                                              tb + n_new))
                abort();
            sum += ops[i].n_tokens;
        }
        if (sum != n_new)
            abort();
        free(ops);
        free(tb);
    }
    return 0;
}
