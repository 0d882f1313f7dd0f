/*
 * fuzz_remote.c — libFuzzer target for the values the shared tier reads
 * back from Redis (daemon/remote_wire.c): a manifest (versions 1 and 2, layout
 * and quantized sections), a block value and a prefix entry, all of them
 * bytes anybody with access to the cluster can write. The first input byte
 * picks the parser. Whatever decodes is re-encoded and must decode to the
 * same thing (manifests).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/remote.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    uint8_t pick = data[0] % 3;
    const uint8_t *v = data + 1;
    size_t n = size - 1;
    kvr_error err;
    if (pick == 0) {
        kvr_rt_manifest m;
        if (kvr__rt_manifest_decode(v, n, NULL, &m, &err) == 0) {
            size_t len;
            uint8_t *e = kvr__rt_manifest_encode(&m, &len);
            if (e) {
                kvr_rt_manifest m2;
                if (kvr__rt_manifest_decode(e, len, m.ctx_id, &m2, &err) != 0 ||
                    m2.n_tokens != m.n_tokens || m2.n_blocks != m.n_blocks ||
                    m2.quant != m.quant ||
                    memcmp(m2.tokens, m.tokens, m.n_tokens * 4) != 0)
                    abort();
                kvr__rt_manifest_free(&m2);
                kvr_mem_free(e);
            }
            kvr__rt_manifest_free(&m);
        }
    } else if (pick == 1) {
        /* A block of up to 64 tokens of a small model; the expected chain,
         * tokens and positions are taken from the value itself where it
         * has them, so a well-formed one gets as far as the copy. */
        kvr_rt_desc d = { 0x1234, 2, 1, 4, KVR_DTYPE_F16 };
        uint32_t tok[64] = { 0 };
        int64_t pos[64] = { 0 };
        size_t nt = 1;
        uint64_t chain = 0;
        if (n >= 56) {
            uint32_t c;
            memcpy(&c, v + 36, 4);
            nt = c >= 1 && c <= 64 ? c : 1;
            memcpy(&chain, v + 40, 8);
            if (n >= 56 + nt * 12) {
                memcpy(tok, v + 56, nt * 4);
                memcpy(pos, v + 56 + nt * 4, nt * 8);
            }
        }
        static uint8_t dst[2 * 2 * 64 * 4 * 2];
        (void)kvr__rt_block_decode(v, n, &d, chain, 0, tok, pos, nt, dst, nt, &err);
    } else {
        kvr_rt_desc d = { 0x1234, 2, 1, 4, KVR_DTYPE_F16 };
        uint64_t chain;
        uint32_t bn;
        (void)kvr__rt_sub_decode(v, n, &d, 16, &chain, &bn, &err);
    }
    return 0;
}
