/*
 * remote_wire.c — the shared tier's value formats and keys (remote.h,
 * docs/cluster.md): pure functions of their arguments, no I/O and no
 * store, so they are tested on their own (test_daemon_remote*, the fuzz
 * target) and used by the publisher and the fetch jobs alike.
 *
 * Keys. A block of KVR_RT_BLOCK tokens is stored under
 * "kvr1:b:{<chain>}", chain = hash(seed(model fingerprint, shape, dtype,
 * block size), then per block the token ids and the stored-at positions of
 * its tokens): the key of a block names everything before it, so equal
 * prefixes on any node give equal keys, and a reader computes the keys of
 * a prompt without asking anyone. A context's manifest (tokens, positions,
 * flags, the chain of each block) is stored under "kvr1:m:{<hash of id>}".
 * The hash tag is the whole hash: slots are spread evenly over the masters
 * and each value lives in exactly one slot.
 *
 * Values are little-endian (x86-64, as the project), checked by CRC32C and
 * by their own description; see kvr__rt_block_decode for the checks. With a
 * cluster key each value is followed by its MAC (kvr__rt_mac), written by
 * the publisher's seal() and checked before anything else by the fetch
 * jobs: unseal() for values read whole, the sinks' mac state for values
 * streamed into a put's memory (which is only committed once every value
 * checked).
 *
 * Invariants: every length read from a value is checked against the
 * value's size before it is used; a decoder writes only inside the
 * destination its caller sized from what it expects, never from what the
 * value declares.
 */
#include "daemon/remote_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/stat.h>

#include "base/crc32c.h"

/* ---- hashing ----------------------------------------------------------- */

static inline uint64_t rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t mix(uint64_t h, uint64_t w)
{
    h ^= w * 0x9E3779B97F4A7C15ull;
    return rotl(h, 29) * 0xBF58476D1CE4E5B9ull;
}

static inline uint64_t fin(uint64_t h)
{
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
    return h;
}

uint64_t kvr__rt_chain_seed(const kvr_rt_desc *d)
{
    uint64_t h = 0x6b7672315f726f70ull;     /* "kvr1_rop" */
    h = mix(h, d->fingerprint);
    h = mix(h, ((uint64_t)d->n_layers << 32) | d->n_kv_heads);
    h = mix(h, ((uint64_t)d->head_dim << 32) | (uint32_t)d->dtype);
    h = mix(h, KVR_RT_BLOCK);
    return fin(h);
}

uint64_t kvr__rt_chain_next(uint64_t prev, const uint32_t *tokens, const int64_t *pos, size_t n)
{
    uint64_t h = mix(prev, n);
    for (size_t i = 0; i < n; i++) {
        h = mix(h, tokens[i]);
        h = mix(h, (uint64_t)pos[i]);
    }
    return fin(h);
}

size_t kvr__rt_block_key(uint64_t chain, char out[KVR_RT_KEY_MAX])
{
    return (size_t)snprintf(out, KVR_RT_KEY_MAX, "kvr1:b:{%016" PRIx64 "}", chain);
}

size_t kvr__rt_manifest_key(const char *ctx_id, char out[KVR_RT_KEY_MAX])
{
    uint64_t h = 0x6b7672315f6d616eull;
    size_t n = strlen(ctx_id);
    h = mix(h, n);
    for (size_t i = 0; i < n; i++)
        h = mix(h, (uint8_t)ctx_id[i]);
    return (size_t)snprintf(out, KVR_RT_KEY_MAX, "kvr1:m:{%016" PRIx64 "}", fin(h));
}

size_t kvr__rt_sub_key(uint64_t sub_chain, char out[KVR_RT_KEY_MAX])
{
    return (size_t)snprintf(out, KVR_RT_KEY_MAX, "kvr1:p:{%016" PRIx64 "}", sub_chain);
}

/* ---- value encoding ---------------------------------------------------- */


/* ---- MACs --------------------------------------------------------------- */

void kvr__rt_mac_begin(crypto_generichash_state *st, const uint8_t *key, const char *rkey,
                      size_t rklen)
{
    uint8_t n[8];
    put64(n, rklen);
    crypto_generichash_init(st, key, KVR_RT_KEY_BYTES, KVR_RT_MAC_LEN);
    crypto_generichash_update(st, n, sizeof n);
    crypto_generichash_update(st, (const uint8_t *)rkey, rklen);
}

/* Finishes st and compares with tag in constant time. */
bool kvr__rt_mac_end_ok(crypto_generichash_state *st, const uint8_t *tag)
{
    uint8_t m[KVR_RT_MAC_LEN];
    crypto_generichash_final(st, m, sizeof m);
    return sodium_memcmp(m, tag, sizeof m) == 0;
}

void kvr__rt_mac(const uint8_t key[KVR_RT_KEY_BYTES], const char *rkey, size_t rklen,
                const uint8_t *v, size_t len, uint8_t out[KVR_RT_MAC_LEN])
{
    crypto_generichash_state st;
    kvr__rt_mac_begin(&st, key, rkey, rklen);
    crypto_generichash_update(&st, v, len);
    crypto_generichash_final(&st, out, KVR_RT_MAC_LEN);
}

int kvr__rt_key_read(const char *path, uint8_t key[KVR_RT_KEY_BYTES], kvr_error *err)
{
    if (sodium_init() < 0)
        return kvr_error_set(err, KVR_EINTERNAL, "--remote-key-file: libsodium did not start");
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvr_error_set(err, KVR_EIO, "--remote-key-file %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || (st.st_mode & (S_IRWXG | S_IRWXO))) {
        fclose(f);
        return kvr_error_set(err, KVR_EINVAL, "--remote-key-file %s can be read or written by "
                             "others (mode %04o): anyone who reads it can forge the shared "
                             "tier; chmod 600 it", path, (unsigned)(st.st_mode & 07777));
    }
    uint8_t buf[4097];
    size_t n = fread(buf, 1, sizeof buf, f);
    bool bad = ferror(f) != 0;
    fclose(f);
    int rc = 0;
    if (bad)
        rc = kvr_error_set(err, KVR_EIO, "--remote-key-file %s: read error", path);
    else if (n == sizeof buf)
        rc = kvr_error_set(err, KVR_EINVAL, "--remote-key-file %s: longer than 4096 bytes", path);
    if (rc == 0) {
        if (n > 0 && buf[n - 1] == '\n')
            n--;
        if (n > 0 && buf[n - 1] == '\r')
            n--;
        if (n < 32)
            rc = kvr_error_set(err, KVR_EINVAL, "--remote-key-file %s: %zu bytes, at least 32 "
                               "wanted (e.g. head -c 32 /dev/urandom | base64)", path, n);
    }
    if (rc == 0)
        crypto_generichash(key, KVR_RT_KEY_BYTES, buf, n, NULL, 0);
    sodium_memzero(buf, sizeof buf);
    return rc;
}



/* The checks of a block or chunk value (`kind`) up to its model's
 * fingerprint, in this order: magic (and at least hdr + 4 bytes), version,
 * length (want), checksum (crc_ok), fingerprint. */
static int check_head(const uint8_t *v, size_t len, size_t hdr, size_t want, bool crc_ok,
                      const char *magic, const kvr_rt_desc *d, const char *kind, kvr_error *err)
{
    if (len < hdr + 4 || memcmp(v, magic, 4) != 0)
        return kvr_error_set(err, KVR_EIO, "%s value: not a kvrope %s (%zu bytes)", kind, kind,
                             len);
    if (get32(v + 4) != RT_VERSION)
        return kvr_error_set(err, KVR_EIO, "%s value: version %u", kind, get32(v + 4));
    if (len != want)
        return kvr_error_set(err, KVR_EIO, "%s value: %zu bytes, expected %zu", kind, len, want);
    if (!crc_ok)
        return kvr_error_set(err, KVR_EIO, "%s value: checksum mismatch", kind);
    if (get64(v + 8) != d->fingerprint)
        return kvr_error_set(err, KVR_EFINGERPRINT, "%s value: fingerprint %016" PRIx64
                             ", expected %016" PRIx64, kind, get64(v + 8), d->fingerprint);
    return 0;
}

/* The head every value starts with: magic, version, then the model's shape
 * (fingerprint, n_layers, n_kv_heads, head_dim), bytes [0, 28). */
static void put_head(uint8_t *v, const char *magic, uint32_t version, const kvr_rt_desc *d)
{
    memcpy(v, magic, 4);
    put32(v + 4, version);
    put64(v + 8, d->fingerprint);
    put32(v + 16, d->n_layers);
    put32(v + 20, d->n_kv_heads);
    put32(v + 24, d->head_dim);
}

/* Copies len bytes between d's payload at offset off and mem: into d
 * (to_d), or out of it. */
static void rt_copy(const rt_dst *d, size_t off, uint8_t *mem, size_t len, bool to_d)
{
    if (d->flat) {
        if (to_d)
            memcpy(d->flat + off, mem, len);
        else
            memcpy(mem, d->flat + off, len);
        return;
    }
    size_t lo = 0, hi = d->niov;
    while (hi - lo > 1) {            /* the last iov starting at or before off */
        size_t mid = (lo + hi) / 2;
        if (d->starts[mid] <= off)
            lo = mid;
        else
            hi = mid;
    }
    for (size_t i = lo; len && i < d->niov; i++) {
        size_t in = off - d->starts[i], take = d->iov[i].iov_len - in;
        if (take > len)
            take = len;
        uint8_t *p = (uint8_t *)d->iov[i].iov_base + in;
        if (to_d)
            memcpy(p, mem, take);
        else
            memcpy(mem, p, take);
        mem += take;
        off += take;
        len -= take;
    }
}

static void dst_write(const rt_dst *d, size_t off, const uint8_t *src, size_t len)
{
    rt_copy(d, off, (uint8_t *)(uintptr_t)src, len, true);
}

static void src_read(const rt_src *d, size_t off, uint8_t *out, size_t len)
{
    rt_copy(d, off, out, len, false);
}

uint8_t *kvr__rt_block_encode(const kvr_rt_desc *d, uint64_t chain, uint64_t start,
                             const uint32_t *tokens, const int64_t *pos, size_t n,
                             const uint8_t *ctx_payload, size_t n_ctx, size_t *len)
{
    rt_src flat = { .flat = (uint8_t *)(uintptr_t)ctx_payload };
    return kvr__rt_encode_from(d, chain, start, tokens, pos, n, &flat, n_ctx, len);
}

uint8_t *kvr__rt_encode_from(const kvr_rt_desc *d, uint64_t chain, uint64_t start,
                            const uint32_t *tokens, const int64_t *pos, size_t n,
                            const rt_src *src, size_t n_ctx, size_t *len)
{
    size_t kv = kv_bytes(d, n), row = row_bytes(d);
    size_t total = BLOCK_HDR + n * 12 + kv + 4;
    uint8_t *v = kvr_mem_malloc(total);
    if (!v)
        return NULL;
    put_head(v, BLOCK_MAGIC, RT_VERSION, d);
    put32(v + 28, (uint32_t)d->dtype);
    put32(v + 32, KVR_RT_BLOCK);
    put32(v + 36, (uint32_t)n);
    put64(v + 40, chain);
    put64(v + 48, start);
    uint8_t *p = v + BLOCK_HDR;
    memcpy(p, tokens, n * 4);
    p += n * 4;
    memcpy(p, pos, n * 8);
    p += n * 8;
    for (size_t l = 0; l < 2 * (size_t)d->n_layers; l++) {
        src_read(src, (l * n_ctx + start) * row, p, n * row);
        p += n * row;
    }
    put32(p, kvr_crc32c(0, v, (size_t)(p - v)));
    *len = total;
    return v;
}

static int decode_to(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint64_t chain,
                     uint64_t start, const uint32_t *tokens, const int64_t *pos, size_t n,
                     const rt_dst *dst, size_t n_ctx, kvr_error *err);

int kvr__rt_block_decode(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint64_t chain,
                        uint64_t start, const uint32_t *tokens, const int64_t *pos, size_t n,
                        uint8_t *dst, size_t n_ctx, kvr_error *err)
{
    rt_dst flat = { .flat = dst };
    return decode_to(v, len, d, chain, start, tokens, pos, n, &flat, n_ctx, err);
}

/* The checks of a block value that need only its first BLOCK_HDR + n * 12
 * bytes (header, tokens, positions) and its length; crc_ok says whether its
 * CRC32C matched (checked in between, as the value's own errors come first). */
static int block_check_n(const uint8_t *v, size_t len, bool crc_ok, const kvr_rt_desc *d,
                         uint64_t chain, uint64_t start, const uint32_t *tokens,
                         const int64_t *pos, size_t n, size_t n_cmp, kvr_error *err)
{
    size_t kv = kv_bytes(d, n);
    int rc = check_head(v, len, BLOCK_HDR, BLOCK_HDR + n * 12 + kv + 4, crc_ok, BLOCK_MAGIC, d,
                        "block", err);
    if (rc < 0)
        return rc;
    if (get32(v + 16) != d->n_layers || get32(v + 20) != d->n_kv_heads ||
        get32(v + 24) != d->head_dim || get32(v + 28) != (uint32_t)d->dtype ||
        get32(v + 32) != KVR_RT_BLOCK || get32(v + 36) != n)
        return kvr_error_set(err, KVR_ESHAPE, "block value: shape/dtype/length differ");
    if (get64(v + 40) != chain || get64(v + 48) != start)
        return kvr_error_set(err, KVR_EIO, "block value: chain or start differ from its key");
    const uint8_t *p = v + BLOCK_HDR;
    if (memcmp(p, tokens, n_cmp * 4) != 0 || memcmp(p + n * 4, pos, n_cmp * 8) != 0)
        return kvr_error_set(err, KVR_EIO, "block value: tokens or positions differ");
    return 0;
}

int kvr__rt_block_check(const uint8_t *v, size_t len, bool crc_ok, const kvr_rt_desc *d,
                       uint64_t chain, uint64_t start, const uint32_t *tokens,
                       const int64_t *pos, size_t n, kvr_error *err)
{
    return block_check_n(v, len, crc_ok, d, chain, start, tokens, pos, n, n, err);
}

/* The first e tokens of a whole block value of n tokens (found through a
 * sub-block prefix key): the value checked as a block whose chain is
 * `chain` and whose chain continues `prev`, its first e tokens and
 * positions those expected; their K/V copied into the flat payload dst
 * (n_ctx tokens) at start. */
int kvr__rt_decode_head(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint64_t prev,
                       uint64_t chain, uint64_t start, size_t n, const uint32_t *tokens,
                       const int64_t *pos, size_t e, uint8_t *dst, size_t n_ctx,
                       kvr_error *err)
{
    size_t row = row_bytes(d);
    bool sized = len >= BLOCK_HDR + 4 && len == BLOCK_HDR + n * 12 + kv_bytes(d, n) + 4;
    bool crc_ok = sized && kvr_crc32c(0, v, len - 4) == get32(v + len - 4);
    int rc = block_check_n(v, len, crc_ok, d, chain, start, tokens, pos, n, e, err);
    if (rc < 0)
        return rc;
    uint32_t *bt = kvr_mem_malloc(n * 4);
    int64_t *bp = kvr_mem_malloc(n * 8);
    if (!bt || !bp) {
        kvr_mem_free(bt);
        kvr_mem_free(bp);
        return kvr_error_set(err, KVR_ENOMEM, "out of memory");
    }
    memcpy(bt, v + BLOCK_HDR, n * 4);
    memcpy(bp, v + BLOCK_HDR + n * 4, n * 8);
    bool cont = kvr__rt_chain_next(prev, bt, bp, n) == chain;
    kvr_mem_free(bt);
    kvr_mem_free(bp);
    if (!cont)
        return kvr_error_set(err, KVR_EIO, "block value: does not continue the prefix");
    const uint8_t *p = v + BLOCK_HDR + n * 12;
    for (size_t l = 0; l < 2 * (size_t)d->n_layers; l++)
        memcpy(dst + (l * n_ctx + start) * row, p + l * n * row, e * row);
    return 0;
}

static int decode_to(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint64_t chain,
                     uint64_t start, const uint32_t *tokens, const int64_t *pos, size_t n,
                     const rt_dst *dst, size_t n_ctx, kvr_error *err)
{
    size_t row = row_bytes(d);
    bool sized = len >= BLOCK_HDR + 4 && len == BLOCK_HDR + n * 12 + kv_bytes(d, n) + 4;
    bool crc_ok = sized && kvr_crc32c(0, v, len - 4) == get32(v + len - 4);
    int rc = kvr__rt_block_check(v, len, crc_ok, d, chain, start, tokens, pos, n, err);
    if (rc < 0)
        return rc;
    const uint8_t *p = v + BLOCK_HDR + n * 12;
    for (size_t l = 0; l < 2 * (size_t)d->n_layers; l++) {
        dst_write(dst, (l * n_ctx + start) * row, p, n * row);
        p += n * row;
    }
    return 0;
}

static size_t layout_bytes(const kvr_rt_manifest *m)
{
    return LAYOUT_FIXED + m->layout.n_groups * GROUP_REC + (m->quant ? QUANT_SEC : 0);
}

/* ---- the values of a manifest -------------------------------------------- */

size_t kvr__rt_manifest_blocks(const kvr_rt_manifest *m)
{
    if (!m->quant)
        return (m->n_tokens + KVR_RT_BLOCK - 1) / KVR_RT_BLOCK;
    return (m->n_raw + m->chunk - 1) / m->chunk +
           (m->n_tokens - m->n_raw + KVR_RT_BLOCK - 1) / KVR_RT_BLOCK;
}

void kvr__rt_manifest_block(const kvr_rt_manifest *m, size_t b, size_t *start, size_t *n,
                           bool *chunk)
{
    size_t nch = m->quant ? (m->n_raw + m->chunk - 1) / m->chunk : 0;
    if (b < nch) {
        *start = b * m->chunk;
        *n = m->n_raw - *start < m->chunk ? m->n_raw - *start : m->chunk;
        *chunk = true;
        return;
    }
    size_t base = m->quant ? m->n_raw : 0;
    *start = base + (b - nch) * KVR_RT_BLOCK;
    *n = m->n_tokens - *start < KVR_RT_BLOCK ? m->n_tokens - *start : KVR_RT_BLOCK;
    *chunk = false;
}

/* A quantized context's chains start from its codec as well: its values
 * are never taken for a plain context's (nor found by match). */
static uint64_t manifest_seed(const kvr_rt_manifest *m)
{
    uint64_t h = kvr__rt_chain_seed(&m->desc);
    if (!m->quant)
        return h;
    h = mix(h, 0x7175616e74ull);      /* "quant" */
    for (const char *c = m->codec; *c; c++)
        h = mix(h, (uint8_t)*c);
    h = mix(h, m->chunk);
    return fin(h);
}

/* The chain after block b of m, from h, the one before it. */
static uint64_t manifest_chain_next(const kvr_rt_manifest *m, size_t b, uint64_t h)
{
    size_t s, n;
    bool ch;
    kvr__rt_manifest_block(m, b, &s, &n, &ch);
    return kvr__rt_chain_next(h, m->tokens + s, m->positions + s, n);
}

void kvr__rt_manifest_chains(const kvr_rt_manifest *m, uint64_t *out)
{
    uint64_t h = manifest_seed(m);
    size_t nb = kvr__rt_manifest_blocks(m);
    for (size_t b = 0; b < nb; b++)
        out[b] = h = manifest_chain_next(m, b, h);
}

/* ---- encoded chunks of a quantized context ------------------------------ */



uint8_t *kvr__rt_chunk_encode(const kvr_rt_manifest *m, size_t b, uint64_t chain,
                             const rt_src *raw, size_t *len)
{
    size_t s, n;
    bool ch;
    kvr__rt_manifest_block(m, b, &s, &n, &ch);
    size_t total = chunk_len(m, n), kb = chunk_kb(m, n), vb = chunk_vb(m, n);
    uint8_t *v = kvr_mem_calloc(1, total);
    if (!v)
        return NULL;
    put_head(v, CHUNK_MAGIC, RT_VERSION, &m->desc);
    put32(v + 28, m->chunk);
    put32(v + 32, (uint32_t)n);
    put32(v + 36, m->ktile);
    put64(v + 40, chain);
    put64(v + 48, s);
    snprintf((char *)v + 56, KVR_CODEC_NAME_MAX, "%s", m->codec);
    uint8_t *p = v + CHUNK_HDR;
    memcpy(p, m->tokens + s, n * 4);
    memcpy(p + n * 4, m->positions + s, n * 8);
    p += n * 12;
    for (size_t l = 0; l < m->desc.n_layers; l++) {
        src_read(raw, raw_off(m, l, 0, s), p, kb);
        p += kb;
        src_read(raw, raw_off(m, l, 1, s), p, vb);
        p += vb;
    }
    put32(p, kvr_crc32c(0, v, (size_t)(p - v)));
    *len = total;
    return v;
}

/* The checks of a chunk value against the manifest (header, tokens and
 * positions in v's first CHUNK_HDR + n * 12 bytes). */
int kvr__rt_chunk_check(const uint8_t *v, size_t len, bool crc_ok, const kvr_rt_manifest *m,
                       size_t b, uint64_t chain, kvr_error *err)
{
    size_t s, n;
    bool ch;
    kvr__rt_manifest_block(m, b, &s, &n, &ch);
    int rc = check_head(v, len, CHUNK_HDR, chunk_len(m, n), crc_ok, CHUNK_MAGIC, &m->desc,
                        "chunk", err);
    if (rc < 0)
        return rc;
    if (get32(v + 16) != m->desc.n_layers || get32(v + 20) != m->desc.n_kv_heads ||
        get32(v + 24) != m->desc.head_dim || get32(v + 28) != m->chunk ||
        get32(v + 32) != n || get32(v + 36) != m->ktile)
        return kvr_error_set(err, KVR_ESHAPE, "chunk value: shape/tile/length differ");
    if (memchr(v + 56, 0, KVR_CODEC_NAME_MAX) == NULL || strcmp((const char *)v + 56, m->codec))
        return kvr_error_set(err, KVR_ESHAPE, "chunk value: codec '%.64s', expected '%s'",
                             (const char *)v + 56, m->codec);
    if (get64(v + 40) != chain || get64(v + 48) != s)
        return kvr_error_set(err, KVR_EIO, "chunk value: chain or start differ from its key");
    const uint8_t *p = v + CHUNK_HDR;
    if (memcmp(p, m->tokens + s, n * 4) != 0 || memcmp(p + n * 4, m->positions + s, n * 8) != 0)
        return kvr_error_set(err, KVR_EIO, "chunk value: tokens or positions differ");
    return 0;
}

size_t kvr__rt_chunk_key(uint64_t chain, char out[KVR_RT_KEY_MAX])
{
    return (size_t)snprintf(out, KVR_RT_KEY_MAX, "kvr1:q:{%016" PRIx64 "}", chain);
}

#define SUB_MAGIC "KVRP"

void kvr__rt_sub_encode(const kvr_rt_desc *d, uint64_t block_chain, uint32_t block_n,
                       uint32_t e, uint8_t out[KVR_RT_SUB_LEN])
{
    memcpy(out, SUB_MAGIC, 4);
    put32(out + 4, RT_VERSION);
    put64(out + 8, d->fingerprint);
    put64(out + 16, block_chain);
    put32(out + 24, block_n);
    put32(out + 28, e);
    put32(out + 32, kvr_crc32c(0, out, 32));
}

int kvr__rt_sub_decode(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint32_t e,
                      uint64_t *block_chain, uint32_t *block_n, kvr_error *err)
{
    if (len != KVR_RT_SUB_LEN || memcmp(v, SUB_MAGIC, 4) != 0 || get32(v + 4) != RT_VERSION)
        return kvr_error_set(err, KVR_EIO, "prefix key: not a kvrope prefix entry (%zu bytes)",
                             len);
    if (kvr_crc32c(0, v, 32) != get32(v + 32))
        return kvr_error_set(err, KVR_EIO, "prefix key: checksum mismatch");
    uint32_t n = get32(v + 24);
    if (get64(v + 8) != d->fingerprint || get32(v + 28) != e || n <= e || n > KVR_RT_BLOCK)
        return kvr_error_set(err, KVR_EIO, "prefix key: for another model or length");
    *block_chain = get64(v + 16);
    *block_n = n;
    return 0;
}

uint8_t *kvr__rt_manifest_encode(const kvr_rt_manifest *m, size_t *len)
{
    if (m->layout.n_groups > KVR_MAX_GROUPS)
        return NULL;
    size_t total = MANIFEST_HDR + m->n_blocks * 8 + m->n_tokens * 20 + layout_bytes(m) + 4;
    uint8_t *v = kvr_mem_calloc(1, total);
    if (!v)
        return NULL;
    put_head(v, MANIFEST_MAGIC, MANIFEST_VERSION, &m->desc);
    put32(v + 28, (uint32_t)m->desc.dtype);
    put32(v + 32, KVR_RT_BLOCK);
    put64(v + 40, m->n_tokens);
    put64(v + 48, m->n_blocks);
    snprintf((char *)v + 56, 256, "%s", m->ctx_id);
    snprintf((char *)v + 312, 256, "%s", m->model);
    uint8_t *p = v + MANIFEST_HDR;
    memcpy(p, m->chains, m->n_blocks * 8);
    p += m->n_blocks * 8;
    memcpy(p, m->tokens, m->n_tokens * 4);
    p += m->n_tokens * 4;
    memcpy(p, m->positions, m->n_tokens * 8);
    p += m->n_tokens * 8;
    memcpy(p, m->flags, m->n_tokens * 4);
    p += m->n_tokens * 4;
    if (m->groups)
        memcpy(p, m->groups, m->n_tokens * 4);
    p += m->n_tokens * 4;
    const kvr_layout_info *L = &m->layout;
    put32(p, (L->has_prefix ? 1u : 0u) | (L->has_retention ? 2u : 0u) | (m->quant ? 4u : 0u) |
                 (L->v_trans ? 8u : 0u));
    snprintf((char *)p + 4, 256, "%s", L->has_prefix ? L->prefix_ctx : "");
    put64(p + 260, L->prefix_fingerprint);
    put64(p + 268, L->prefix_len);
    put64(p + 276, L->prefix_hash);
    put32(p + 284, (uint32_t)L->n_groups);
    put64(p + 288, L->sinks);
    put64(p + 296, L->window);
    put64(p + 304, L->n_dropped);
    put64(p + 312, m->n_protected);
    p += LAYOUT_FIXED;
    for (size_t g = 0; g < L->n_groups; g++) {
        snprintf((char *)p, KVR_GROUP_NAME_MAX + 1, "%s", L->groups[g].name);
        put64(p + KVR_GROUP_NAME_MAX + 1, (uint64_t)L->groups[g].offset);
        put64(p + KVR_GROUP_NAME_MAX + 9, L->groups[g].cursor);
        p += GROUP_REC;
    }
    if (m->quant) {
        snprintf((char *)p, KVR_CODEC_NAME_MAX, "%s", m->codec);
        put64(p + KVR_CODEC_NAME_MAX, m->n_raw);
        put64(p + KVR_CODEC_NAME_MAX + 8, m->raw_kb);
        put64(p + KVR_CODEC_NAME_MAX + 16, m->raw_vb);
        put32(p + KVR_CODEC_NAME_MAX + 24, m->chunk);
        put32(p + KVR_CODEC_NAME_MAX + 28, m->ktile);
        p += QUANT_SEC;
    }
    put32(p, kvr_crc32c(0, v, (size_t)(p - v)));
    *len = total;
    return v;
}

void kvr__rt_manifest_free(kvr_rt_manifest *m)
{
    kvr_mem_free(m->chains);
    kvr_mem_free(m->tokens);
    kvr_mem_free(m->positions);
    kvr_mem_free(m->flags);
    kvr_mem_free(m->groups);
    m->chains = NULL;
    m->tokens = NULL;
    m->positions = NULL;
    m->flags = NULL;
    m->groups = NULL;
}

int kvr__rt_manifest_decode(const uint8_t *v, size_t len, const char *want_id,
                           kvr_rt_manifest *m, kvr_error *err)
{
    memset(m, 0, sizeof *m);
    if (len < MANIFEST_HDR + 4 || memcmp(v, MANIFEST_MAGIC, 4) != 0)
        return kvr_error_set(err, KVR_EIO, "manifest: not a kvrope manifest (%zu bytes)", len);
    uint32_t ver = get32(v + 4);
    if ((ver != 1 && ver != MANIFEST_VERSION) || get32(v + 32) != KVR_RT_BLOCK)
        return kvr_error_set(err, KVR_EIO, "manifest: version %u / block %u", ver,
                             get32(v + 32));
    uint64_t nt = get64(v + 40), nb = get64(v + 48);
    if (nt > MAX_TOKENS || nb > nt)
        return kvr_error_set(err, KVR_EIO, "manifest: inconsistent lengths");
    size_t body = MANIFEST_HDR + nb * 8 + nt * 16;      /* version 1's */
    size_t ng = 0;
    bool quant = false;
    if (ver >= 2) {
        if (len < body + nt * 4 + LAYOUT_FIXED + 4)
            return kvr_error_set(err, KVR_EIO, "manifest: inconsistent lengths");
        ng = get32(v + body + nt * 4 + 284);
        quant = (get32(v + body + nt * 4) & 4u) != 0;
        if (ng > KVR_MAX_GROUPS)
            return kvr_error_set(err, KVR_EIO, "manifest: %zu groups", ng);
        body += nt * 4 + LAYOUT_FIXED + ng * GROUP_REC + (quant ? QUANT_SEC : 0);
    }
    if (!quant && nb != (nt + KVR_RT_BLOCK - 1) / KVR_RT_BLOCK)
        return kvr_error_set(err, KVR_EIO, "manifest: inconsistent lengths");
    if (len != body + 4)
        return kvr_error_set(err, KVR_EIO, "manifest: inconsistent lengths");
    if (kvr_crc32c(0, v, len - 4) != get32(v + len - 4))
        return kvr_error_set(err, KVR_EIO, "manifest: checksum mismatch");
    if (memchr(v + 56, 0, 256) == NULL || memchr(v + 312, 0, 256) == NULL)
        return kvr_error_set(err, KVR_EIO, "manifest: unterminated id");
    if (want_id && strcmp((const char *)v + 56, want_id) != 0)
        return kvr_error_set(err, KVR_EIO, "manifest: for '%s', not '%s' (hash collision)",
                             (const char *)v + 56, want_id);
    m->desc.fingerprint = get64(v + 8);
    m->desc.n_layers = get32(v + 16);
    m->desc.n_kv_heads = get32(v + 20);
    m->desc.head_dim = get32(v + 24);
    m->desc.dtype = (kvr_dtype)get32(v + 28);
    if (kvr_dtype_size(m->desc.dtype) == 0 || m->desc.n_layers == 0 ||
        m->desc.n_kv_heads == 0 || m->desc.head_dim == 0)
        return kvr_error_set(err, KVR_EIO, "manifest: bad shape");
    snprintf(m->ctx_id, sizeof m->ctx_id, "%s", (const char *)v + 56);
    snprintf(m->model, sizeof m->model, "%s", (const char *)v + 312);
    m->n_tokens = (size_t)nt;
    m->n_blocks = (size_t)nb;
    m->chains = kvr_mem_malloc(nb * 8 + 1);
    m->tokens = kvr_mem_malloc(nt * 4 + 1);
    m->positions = kvr_mem_malloc(nt * 8 + 1);
    m->flags = kvr_mem_malloc(nt * 4 + 1);
    m->groups = kvr_mem_malloc(nt * 4 + 1);
    if (!m->chains || !m->tokens || !m->positions || !m->flags || !m->groups) {
        kvr__rt_manifest_free(m);
        return kvr_error_set(err, KVR_ENOMEM, "manifest: out of memory");
    }
    const uint8_t *p = v + MANIFEST_HDR;
    memcpy(m->chains, p, nb * 8);
    p += nb * 8;
    memcpy(m->tokens, p, nt * 4);
    p += nt * 4;
    memcpy(m->positions, p, nt * 8);
    p += nt * 8;
    memcpy(m->flags, p, nt * 4);
    p += nt * 4;
    if (ver < 2) {
        memset(m->groups, 0, nt * 4);
    } else {
        memcpy(m->groups, p, nt * 4);
        p += nt * 4;
        kvr_layout_info *L = &m->layout;
        uint32_t lf = get32(p);
        if ((lf & ~15u) || memchr(p + 4, 0, 256) == NULL) {
            kvr__rt_manifest_free(m);
            return kvr_error_set(err, KVR_EIO, "manifest: bad layout record");
        }
        L->has_prefix = lf & 1u;
        L->has_retention = (lf & 2u) != 0;
        L->v_trans = (lf & 8u) != 0;    /* Put.v_trans: a record only */
        snprintf(L->prefix_ctx, sizeof L->prefix_ctx, "%s", (const char *)p + 4);
        L->prefix_fingerprint = get64(p + 260);
        L->prefix_len = (size_t)get64(p + 268);
        L->prefix_hash = get64(p + 276);
        L->n_groups = ng;
        L->sinks = (size_t)get64(p + 288);
        L->window = (size_t)get64(p + 296);
        L->n_dropped = (size_t)get64(p + 304);
        m->n_protected = (size_t)get64(p + 312);
        p += LAYOUT_FIXED;
        for (size_t g = 0; g < ng; g++, p += GROUP_REC) {
            if (memchr(p, 0, KVR_GROUP_NAME_MAX + 1) == NULL || !p[0]) {
                kvr__rt_manifest_free(m);
                return kvr_error_set(err, KVR_EIO, "manifest: bad group name");
            }
            snprintf(L->groups[g].name, sizeof L->groups[g].name, "%s", (const char *)p);
            L->groups[g].id = (int32_t)g;
            L->groups[g].offset = (int64_t)get64(p + KVR_GROUP_NAME_MAX + 1);
            L->groups[g].cursor = get64(p + KVR_GROUP_NAME_MAX + 9);
        }
        if (quant) {
            m->quant = true;
            bool ok = memchr(p, 0, KVR_CODEC_NAME_MAX) != NULL && p[0];
            if (ok)
                snprintf(m->codec, sizeof m->codec, "%s", (const char *)p);
            m->n_raw = (size_t)get64(p + KVR_CODEC_NAME_MAX);
            m->raw_kb = (size_t)get64(p + KVR_CODEC_NAME_MAX + 8);
            m->raw_vb = (size_t)get64(p + KVR_CODEC_NAME_MAX + 16);
            m->chunk = get32(p + KVR_CODEC_NAME_MAX + 24);
            m->ktile = get32(p + KVR_CODEC_NAME_MAX + 28);
            ok = ok && m->n_raw <= nt && m->ktile >= 1 && m->ktile <= 256 && m->chunk >= 1 &&
                 m->chunk <= 1024 && m->chunk % m->ktile == 0 && m->n_raw % m->ktile == 0 &&
                 (m->n_raw == 0 || (m->raw_kb % (m->n_raw / m->ktile) == 0 &&
                                    m->raw_vb % m->n_raw == 0)) &&
                 m->raw_kb <= ((size_t)1 << 40) && m->raw_vb <= ((size_t)1 << 40) &&
                 nb == kvr__rt_manifest_blocks(m);
            if (!ok) {
                kvr__rt_manifest_free(m);
                return kvr_error_set(err, KVR_EIO, "manifest: bad quantized section");
            }
        }
        if (m->n_protected > nt) {
            kvr__rt_manifest_free(m);
            return kvr_error_set(err, KVR_EIO, "manifest: %zu protected of %zu tokens",
                                 m->n_protected, (size_t)nt);
        }
    }
    /* The chains must be the ones these tokens and positions give. */
    uint64_t h = manifest_seed(m);
    for (size_t b = 0; b < nb; b++) {
        h = manifest_chain_next(m, b, h);
        if (h != m->chains[b]) {
            kvr__rt_manifest_free(m);
            return kvr_error_set(err, KVR_EIO, "manifest: chain of block %zu is wrong", b);
        }
    }
    return 0;
}

