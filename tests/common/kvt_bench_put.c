/*
 * kvt_bench_put.c — tests/common/kvt_bench_put.h: an f16 put's payload.
 */
#include "tests/common/kvt_bench_put.h"

#include <stdint.h>

void kvt_put_fill_f16(kvr_put *x)
{
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(x, &iov, &niov);
    for (size_t i = 0; i < niov; i++) {
        uint16_t *h = iov[i].iov_base;
        for (size_t j = 0; j < iov[i].iov_len / 2; j++)
            h[j] = (uint16_t)(0x3000 + ((i * 131 + j * 7) & 0x0fff));
    }
}
