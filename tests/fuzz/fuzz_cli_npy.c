/*
 * fuzz_cli_npy.c — libFuzzer target for the CLI's .npy reader (`kvrope put
 * CTX FILE.npy`, `--tokens-file ids.npy`, `kvrope payload --from`): the
 * magic, the version's header length, the dict literal (descr,
 * fortran_order, shape) and the data size, through kvr__cli_npy_parse. On
 * success the data must lie inside the input and match the shape exactly;
 * the KV shape check must then hold or refuse without reading anything.
 */
#include <stdint.h>
#include <stdlib.h>

#include "client/cli/cli_parse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    cli_npy n;
    char err[400];
    if (kvr__cli_npy_parse(data, size, &n, err, sizeof err) == 0) {
        if (n.data < data || n.data + n.data_len != data + size || n.count * n.elem != n.data_len)
            abort();
        size_t c = 1;
        for (int i = 0; i < n.ndim; i++)
            c *= n.shape[i];
        if (c != n.count)
            abort();
        kvr_dtype dt;
        uint32_t l, h, d;
        size_t t;
        if (kvr__cli_npy_kv_shape(&n, "fuzz", &dt, &l, &t, &h, &d, err, sizeof err) == 0 &&
            kvr_payload_size(l, t, h, d, dt) != n.data_len)
            abort();
    }
    return 0;
}
