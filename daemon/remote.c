/*
 * remote.c — the shared tier on Redis Cluster (remote.h, docs/cluster.md).
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
 * by their own description; see kvr_rt_block_decode for the checks. With a
 * cluster key each value is followed by its MAC (kvr_rt_mac), written by
 * seal() and checked before anything else: unseal() for values read whole,
 * the sinks' mac state for values streamed into a put's memory (which is
 * only committed once every value checked).
 *
 * Threads. Publications run on one publisher thread, in order; finished ones
 * come back to the loop through an async handle (a synchronous put's reply
 * is sent from there). Fetches run as the connection's threadpool job.
 */
#include "daemon/remote.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sodium.h>
#include <sys/stat.h>

#include "daemon/daemon_internal.h"
#include "daemon/rcluster.h"
#include "base/crc32c.h"

#define BLOCK_MAGIC "KVRB"
#define MANIFEST_MAGIC "KVRM"
#define RT_VERSION 1u            /* of block values */
#define MANIFEST_VERSION 2u      /* 2: + group ids and the layout */
#define LAYOUT_FIXED (4 + 256 + 24 + 4 + 32)   /* flags, prefix record, n_groups, ret, protected */
#define GROUP_REC (KVR_GROUP_NAME_MAX + 1 + 16)
#define BLOCK_HDR 56u
#define MANIFEST_HDR 568u
#define MAX_TOKENS (1u << 28)
#define SET_GROUP 16            /* blocks encoded and SET per pipeline, at most */
#define SET_GROUP_BYTES (32u << 20)   /* and about this many bytes */
#define REJOIN_MS 1000
/* Deadlines (docs/cluster.md): a fetch (get or match that asks the
 * cluster) ends FETCH_MS after the request asked, whatever the cluster
 * does, plus, once it knows how much K/V it is reading, 1 ms per
 * SLOW_BYTES_PER_MS of it (a large context is not cut off by a cluster
 * that answers at 100 MiB/s or more); a publication PUBLISH_MS (+ the same
 * for its bytes) after it was queued (a share_sync is answered by then);
 * the queue holds at most PUB_QUEUE_MAX publications and snapshots of at
 * most a quarter of --max-memory, beyond which a share is dropped (counted)
 * instead of waiting. */
#define FETCH_MS 3000
#define PUBLISH_MS 5000
#define SLOW_BYTES_PER_MS ((100u << 20) / 1000)
#define PUB_QUEUE_MAX 32

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

uint64_t kvr_rt_chain_seed(const kvr_rt_desc *d)
{
    uint64_t h = 0x6b7672315f726f70ull;     /* "kvr1_rop" */
    h = mix(h, d->fingerprint);
    h = mix(h, ((uint64_t)d->n_layers << 32) | d->n_kv_heads);
    h = mix(h, ((uint64_t)d->head_dim << 32) | (uint32_t)d->dtype);
    h = mix(h, KVR_RT_BLOCK);
    return fin(h);
}

uint64_t kvr_rt_chain_next(uint64_t prev, const uint32_t *tokens, const int64_t *pos, size_t n)
{
    uint64_t h = mix(prev, n);
    for (size_t i = 0; i < n; i++) {
        h = mix(h, tokens[i]);
        h = mix(h, (uint64_t)pos[i]);
    }
    return fin(h);
}

size_t kvr_rt_block_key(uint64_t chain, char out[KVR_RT_KEY_MAX])
{
    return (size_t)snprintf(out, KVR_RT_KEY_MAX, "kvr1:b:{%016" PRIx64 "}", chain);
}

size_t kvr_rt_manifest_key(const char *ctx_id, char out[KVR_RT_KEY_MAX])
{
    uint64_t h = 0x6b7672315f6d616eull;
    size_t n = strlen(ctx_id);
    h = mix(h, n);
    for (size_t i = 0; i < n; i++)
        h = mix(h, (uint8_t)ctx_id[i]);
    return (size_t)snprintf(out, KVR_RT_KEY_MAX, "kvr1:m:{%016" PRIx64 "}", fin(h));
}

size_t kvr_rt_sub_key(uint64_t sub_chain, char out[KVR_RT_KEY_MAX])
{
    return (size_t)snprintf(out, KVR_RT_KEY_MAX, "kvr1:p:{%016" PRIx64 "}", sub_chain);
}

/* ---- value encoding ---------------------------------------------------- */

static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* ---- MACs --------------------------------------------------------------- */

static void mac_begin(crypto_generichash_state *st, const uint8_t *key, const char *rkey,
                      size_t rklen)
{
    uint8_t n[8];
    put64(n, rklen);
    crypto_generichash_init(st, key, KVR_RT_KEY_BYTES, KVR_RT_MAC_LEN);
    crypto_generichash_update(st, n, sizeof n);
    crypto_generichash_update(st, (const uint8_t *)rkey, rklen);
}

/* Finishes st and compares with tag in constant time. */
static bool mac_end_ok(crypto_generichash_state *st, const uint8_t *tag)
{
    uint8_t m[KVR_RT_MAC_LEN];
    crypto_generichash_final(st, m, sizeof m);
    return sodium_memcmp(m, tag, sizeof m) == 0;
}

void kvr_rt_mac(const uint8_t key[KVR_RT_KEY_BYTES], const char *rkey, size_t rklen,
                const uint8_t *v, size_t len, uint8_t out[KVR_RT_MAC_LEN])
{
    crypto_generichash_state st;
    mac_begin(&st, key, rkey, rklen);
    crypto_generichash_update(&st, v, len);
    crypto_generichash_final(&st, out, KVR_RT_MAC_LEN);
}

int kvr_rt_key_read(const char *path, uint8_t key[KVR_RT_KEY_BYTES], kvr_error *err)
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

static size_t row_bytes(const kvr_rt_desc *d)
{
    return (size_t)d->n_kv_heads * d->head_dim * kvr_dtype_size(d->dtype);
}

/* Bytes of n tokens' K/V over all layers, or 0 on overflow. */
static size_t kv_bytes(const kvr_rt_desc *d, size_t n)
{
    size_t row = row_bytes(d);
    if (row == 0 || n > SIZE_MAX / row / 2 / (d->n_layers ? d->n_layers : 1))
        return 0;
    return (size_t)d->n_layers * 2 * n * row;
}

/* Where decoded K/V goes: one flat layer-major payload, or the same bytes
 * spread over iovecs (a put's, straight into block memory); starts[i] is
 * the payload offset of iov[i]. */
typedef struct rt_dst {
    uint8_t            *flat;
    const struct iovec *iov;
    size_t              niov;
    const size_t       *starts;
} rt_dst;

static void dst_write(const rt_dst *d, size_t off, const uint8_t *src, size_t len)
{
    if (d->flat) {
        memcpy(d->flat + off, src, len);
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
        memcpy((uint8_t *)d->iov[i].iov_base + in, src, take);
        src += take;
        off += take;
        len -= take;
    }
}

/* Where a block's K/V is read from when it is encoded: the same two forms
 * (a flat payload, or a get's iovecs: block memory, leased). */
typedef rt_dst rt_src;

static void src_read(const rt_src *d, size_t off, uint8_t *out, size_t len)
{
    if (d->flat) {
        memcpy(out, d->flat + off, len);
        return;
    }
    size_t lo = 0, hi = d->niov;
    while (hi - lo > 1) {
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
        memcpy(out, (const uint8_t *)d->iov[i].iov_base + in, take);
        out += take;
        off += take;
        len -= take;
    }
}

static uint8_t *encode_from(const kvr_rt_desc *d, uint64_t chain, uint64_t start,
                            const uint32_t *tokens, const int64_t *pos, size_t n,
                            const rt_src *src, size_t n_ctx, size_t *len);

uint8_t *kvr_rt_block_encode(const kvr_rt_desc *d, uint64_t chain, uint64_t start,
                             const uint32_t *tokens, const int64_t *pos, size_t n,
                             const uint8_t *ctx_payload, size_t n_ctx, size_t *len)
{
    rt_src flat = { .flat = (uint8_t *)(uintptr_t)ctx_payload };
    return encode_from(d, chain, start, tokens, pos, n, &flat, n_ctx, len);
}

static uint8_t *encode_from(const kvr_rt_desc *d, uint64_t chain, uint64_t start,
                            const uint32_t *tokens, const int64_t *pos, size_t n,
                            const rt_src *src, size_t n_ctx, size_t *len)
{
    size_t kv = kv_bytes(d, n), row = row_bytes(d);
    size_t total = BLOCK_HDR + n * 12 + kv + 4;
    uint8_t *v = kvr_mem_malloc(total);
    if (!v)
        return NULL;
    memcpy(v, BLOCK_MAGIC, 4);
    put32(v + 4, RT_VERSION);
    put64(v + 8, d->fingerprint);
    put32(v + 16, d->n_layers);
    put32(v + 20, d->n_kv_heads);
    put32(v + 24, d->head_dim);
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

int kvr_rt_block_decode(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint64_t chain,
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
    if (len < BLOCK_HDR + 4 || memcmp(v, BLOCK_MAGIC, 4) != 0)
        return kvr_error_set(err, KVR_EIO, "block value: not a kvrope block (%zu bytes)", len);
    if (get32(v + 4) != RT_VERSION)
        return kvr_error_set(err, KVR_EIO, "block value: version %u", get32(v + 4));
    if (len != BLOCK_HDR + n * 12 + kv + 4)
        return kvr_error_set(err, KVR_EIO, "block value: %zu bytes, expected %zu", len,
                             BLOCK_HDR + n * 12 + kv + 4);
    if (!crc_ok)
        return kvr_error_set(err, KVR_EIO, "block value: checksum mismatch");
    if (get64(v + 8) != d->fingerprint)
        return kvr_error_set(err, KVR_EFINGERPRINT, "block value: fingerprint %016" PRIx64
                             ", expected %016" PRIx64, get64(v + 8), d->fingerprint);
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

static int block_check(const uint8_t *v, size_t len, bool crc_ok, const kvr_rt_desc *d,
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
static int decode_head(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint64_t prev,
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
    bool cont = kvr_rt_chain_next(prev, bt, bp, n) == chain;
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
    int rc = block_check(v, len, crc_ok, d, chain, start, tokens, pos, n, err);
    if (rc < 0)
        return rc;
    const uint8_t *p = v + BLOCK_HDR + n * 12;
    for (size_t l = 0; l < 2 * (size_t)d->n_layers; l++) {
        dst_write(dst, (l * n_ctx + start) * row, p, n * row);
        p += n * row;
    }
    return 0;
}

#define QUANT_SEC (KVR_CODEC_NAME_MAX + 32)

static size_t layout_bytes(const kvr_rt_manifest *m)
{
    return LAYOUT_FIXED + m->layout.n_groups * GROUP_REC + (m->quant ? QUANT_SEC : 0);
}

/* ---- the values of a manifest -------------------------------------------- */

size_t kvr_rt_manifest_blocks(const kvr_rt_manifest *m)
{
    if (!m->quant)
        return (m->n_tokens + KVR_RT_BLOCK - 1) / KVR_RT_BLOCK;
    return (m->n_raw + m->chunk - 1) / m->chunk +
           (m->n_tokens - m->n_raw + KVR_RT_BLOCK - 1) / KVR_RT_BLOCK;
}

void kvr_rt_manifest_block(const kvr_rt_manifest *m, size_t b, size_t *start, size_t *n,
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
    uint64_t h = kvr_rt_chain_seed(&m->desc);
    if (!m->quant)
        return h;
    h = mix(h, 0x7175616e74ull);      /* "quant" */
    for (const char *c = m->codec; *c; c++)
        h = mix(h, (uint8_t)*c);
    h = mix(h, m->chunk);
    return fin(h);
}

void kvr_rt_manifest_chains(const kvr_rt_manifest *m, uint64_t *out)
{
    uint64_t h = manifest_seed(m);
    size_t nb = kvr_rt_manifest_blocks(m);
    for (size_t b = 0; b < nb; b++) {
        size_t s, n;
        bool ch;
        kvr_rt_manifest_block(m, b, &s, &n, &ch);
        h = kvr_rt_chain_next(h, m->tokens + s, m->positions + s, n);
        out[b] = h;
    }
}

/* ---- encoded chunks of a quantized context ------------------------------ */

#define CHUNK_MAGIC "KVRQ"
#define CHUNK_HDR 128u

/* Per layer, the K and V bytes of n encoded tokens (n a multiple of the
 * K tile): proportional to the manifest's totals for n_raw tokens. */
static size_t chunk_kb(const kvr_rt_manifest *m, size_t n)
{
    return m->n_raw ? m->raw_kb / (m->n_raw / m->ktile) * (n / m->ktile) : 0;
}

static size_t chunk_vb(const kvr_rt_manifest *m, size_t n)
{
    return m->n_raw ? m->raw_vb / m->n_raw * n : 0;
}

static size_t chunk_len(const kvr_rt_manifest *m, size_t n)
{
    return CHUNK_HDR + n * 12 + m->desc.n_layers * (chunk_kb(m, n) + chunk_vb(m, n)) + 4;
}

/* Offset in the raw payload (a raw get's / a raw put's: per layer K bytes
 * then V bytes of all n_raw tokens) of layer l's K (kv 0) or V of the
 * tokens from s. */
static size_t raw_off(const kvr_rt_manifest *m, size_t l, int kv, size_t s)
{
    return l * (m->raw_kb + m->raw_vb) + (kv ? m->raw_kb + chunk_vb(m, s) : chunk_kb(m, s));
}

static uint8_t *chunk_encode(const kvr_rt_manifest *m, size_t b, uint64_t chain,
                             const rt_src *raw, size_t *len)
{
    size_t s, n;
    bool ch;
    kvr_rt_manifest_block(m, b, &s, &n, &ch);
    size_t total = chunk_len(m, n), kb = chunk_kb(m, n), vb = chunk_vb(m, n);
    uint8_t *v = kvr_mem_calloc(1, total);
    if (!v)
        return NULL;
    memcpy(v, CHUNK_MAGIC, 4);
    put32(v + 4, RT_VERSION);
    put64(v + 8, m->desc.fingerprint);
    put32(v + 16, m->desc.n_layers);
    put32(v + 20, m->desc.n_kv_heads);
    put32(v + 24, m->desc.head_dim);
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
static int chunk_check(const uint8_t *v, size_t len, bool crc_ok, const kvr_rt_manifest *m,
                       size_t b, uint64_t chain, kvr_error *err)
{
    size_t s, n;
    bool ch;
    kvr_rt_manifest_block(m, b, &s, &n, &ch);
    if (len < CHUNK_HDR + 4 || memcmp(v, CHUNK_MAGIC, 4) != 0)
        return kvr_error_set(err, KVR_EIO, "chunk value: not a kvrope chunk (%zu bytes)", len);
    if (get32(v + 4) != RT_VERSION)
        return kvr_error_set(err, KVR_EIO, "chunk value: version %u", get32(v + 4));
    if (len != chunk_len(m, n))
        return kvr_error_set(err, KVR_EIO, "chunk value: %zu bytes, expected %zu", len,
                             chunk_len(m, n));
    if (!crc_ok)
        return kvr_error_set(err, KVR_EIO, "chunk value: checksum mismatch");
    if (get64(v + 8) != m->desc.fingerprint)
        return kvr_error_set(err, KVR_EFINGERPRINT, "chunk value: fingerprint %016" PRIx64
                             ", expected %016" PRIx64, get64(v + 8), m->desc.fingerprint);
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

size_t kvr_rt_chunk_key(uint64_t chain, char out[KVR_RT_KEY_MAX])
{
    return (size_t)snprintf(out, KVR_RT_KEY_MAX, "kvr1:q:{%016" PRIx64 "}", chain);
}

#define SUB_MAGIC "KVRP"

void kvr_rt_sub_encode(const kvr_rt_desc *d, uint64_t block_chain, uint32_t block_n,
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

int kvr_rt_sub_decode(const uint8_t *v, size_t len, const kvr_rt_desc *d, uint32_t e,
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

uint8_t *kvr_rt_manifest_encode(const kvr_rt_manifest *m, size_t *len)
{
    if (m->layout.n_groups > KVR_MAX_GROUPS)
        return NULL;
    size_t total = MANIFEST_HDR + m->n_blocks * 8 + m->n_tokens * 20 + layout_bytes(m) + 4;
    uint8_t *v = kvr_mem_calloc(1, total);
    if (!v)
        return NULL;
    memcpy(v, MANIFEST_MAGIC, 4);
    put32(v + 4, MANIFEST_VERSION);
    put64(v + 8, m->desc.fingerprint);
    put32(v + 16, m->desc.n_layers);
    put32(v + 20, m->desc.n_kv_heads);
    put32(v + 24, m->desc.head_dim);
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
    put32(p, (L->has_prefix ? 1u : 0u) | (L->has_retention ? 2u : 0u) | (m->quant ? 4u : 0u));
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

void kvr_rt_manifest_free(kvr_rt_manifest *m)
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

int kvr_rt_manifest_decode(const uint8_t *v, size_t len, const char *want_id,
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
        kvr_rt_manifest_free(m);
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
        if ((lf & ~7u) || memchr(p + 4, 0, 256) == NULL) {
            kvr_rt_manifest_free(m);
            return kvr_error_set(err, KVR_EIO, "manifest: bad layout record");
        }
        L->has_prefix = lf & 1u;
        L->has_retention = (lf & 2u) != 0;
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
                kvr_rt_manifest_free(m);
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
                 nb == kvr_rt_manifest_blocks(m);
            if (!ok) {
                kvr_rt_manifest_free(m);
                return kvr_error_set(err, KVR_EIO, "manifest: bad quantized section");
            }
        }
        if (m->n_protected > nt) {
            kvr_rt_manifest_free(m);
            return kvr_error_set(err, KVR_EIO, "manifest: %zu protected of %zu tokens",
                                 m->n_protected, (size_t)nt);
        }
    }
    /* The chains must be the ones these tokens and positions give. */
    uint64_t h = manifest_seed(m);
    for (size_t b = 0; b < nb; b++) {
        size_t s, n;
        bool ch;
        kvr_rt_manifest_block(m, b, &s, &n, &ch);
        h = kvr_rt_chain_next(h, m->tokens + s, m->positions + s, n);
        if (h != m->chains[b]) {
            kvr_rt_manifest_free(m);
            return kvr_error_set(err, KVR_EIO, "manifest: chain of block %zu is wrong", b);
        }
    }
    return 0;
}

/* ---- the tier ---------------------------------------------------------- */

typedef struct pub_job {
    struct pub_job *next;
    kvr_rt_manifest m;
    kvr_get  *get;              /* the snapshot: leased blocks (ended on the loop);
                                   quantized: a raw get of the encoded tokens */
    const struct iovec *iov;    /* its payload (after its work, if any) */
    size_t    niov;
    size_t   *starts;           /* payload offset of each iov */
    kvr_get  *get2;             /* quantized: a get of the window (NULL: none) */
    const struct iovec *iov2;
    size_t    niov2;
    size_t   *starts2;
    kvr_remote_done_fn done;    /* loop thread, when finished (may be NULL) */
    void     *done_arg;
    uint64_t  deadline_ms;      /* queued + PUBLISH_MS */
    size_t    bytes;            /* the snapshot's K/V (counted in pending_bytes) */
    int       rc;
    char      msg[512];
} pub_job;

struct kvr_remote {
    kvr_daemon     *d;
    kvr_rc         *rc;
    pthread_t       th;
    bool            th_started;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    bool            stop;
    pub_job        *q_head, *q_tail, *done;
    size_t          q_len;
    size_t          pending_bytes;   /* snapshots queued or being published (mu) */
    uv_async_t      async;
    bool            has_async;
    atomic_bool     joined;
    atomic_uint_fast64_t last_try_ms;
    bool            keyed;      /* values carry a MAC under key */
    uint8_t         key[KVR_RT_KEY_BYTES];
    /* metrics */
    atomic_uint_fast64_t pub_contexts, pub_blocks, pub_skipped, pub_errors, pub_dropped;
    atomic_uint_fast64_t fetch_hits, fetch_misses, fetch_corrupt, fetch_forged, fetch_tokens;
    atomic_uint_fast64_t probes;
    atomic_uint_fast64_t fetch_hist[KVR_METRICS_N_BUCKETS + 1], fetch_ns;
};

struct kvr_rjob {
    kvr_remote *r;
    bool        by_id;
    char        ctx_id[KVR_ID_MAX + 1];
    char        model[KVR_ID_MAX + 1];
    kvr_rt_desc desc;
    const uint32_t *prompt;     /* borrowed from the request */
    size_t      n_prompt, local_len;
    /* result */
    bool        hit;
    kvr_rt_manifest m;          /* by_id: the manifest; prefix: tokens/positions */
    uint8_t    *payload;
    size_t      n_tokens;
    /* by_id runs twice: the manifest (phase 0), then, once the loop opened
     * the local put, the blocks straight into its memory (phase 1). */
    int         phase;
    bool        have_manifest;
    kvr_put    *put;
    const struct iovec *iov;
    size_t      niov;
    size_t     *starts;
    uint64_t    t0_ns;          /* created (loop), for the fetch histogram */
    uint64_t    deadline_ms;    /* created + FETCH_MS (kvr_rc_now_ms's clock) */
    bool        worked;         /* reached the cluster (counted when freed) */
};

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Is the cluster usable? If we have not joined, try (at most every
 * REJOIN_MS; between tries callers get a fast "no"). */
static bool tier_up(kvr_remote *r)
{
    if (atomic_load(&r->joined))
        return true;
    uint64_t now = mono_ms(), last = atomic_load(&r->last_try_ms);
    if (last && now - last < REJOIN_MS)
        return false;
    if (!atomic_compare_exchange_strong(&r->last_try_ms, &last, now))
        return false;
    kvr_error e = { 0 };
    if (kvr_rc_refresh(r->rc, &e) == 0) {
        kvr_rc_stats st;
        kvr_rc_get_stats(r->rc, &st);
        if (!atomic_exchange(&r->joined, true))
            kvr_log(KVR_LOG_WARN, "remote tier: joined the cluster (%u slot ranges)",
                    st.n_masters);
        return true;
    }
    return false;
}

/* With a cluster key: appends the MAC of the value *v (*len bytes, a
 * kvr_mem buffer, reallocated) under Redis key rkey. false: out of memory
 * (*v unchanged). */
static bool seal(const kvr_remote *r, const char *rkey, size_t rklen, uint8_t **v, size_t *len)
{
    if (!r->keyed)
        return true;
    uint8_t *n = kvr_mem_realloc(*v, *len + KVR_RT_MAC_LEN);
    if (!n)
        return false;
    kvr_rt_mac(r->key, rkey, rklen, n, *len, n + *len);
    *v = n;
    *len += KVR_RT_MAC_LEN;
    return true;
}

/* SETs every block's sub-block prefix keys, pipelined. */
static int publish_subs(kvr_remote *r, const kvr_rt_manifest *m)
{
    size_t per = KVR_RT_BLOCK / KVR_RT_GRAIN - 1, cap = m->n_blocks * per + 1;
    char (*keys)[KVR_RT_KEY_MAX] = kvr_mem_malloc(cap * KVR_RT_KEY_MAX);
    uint8_t (*vals)[KVR_RT_SUB_LEN + KVR_RT_MAC_LEN] = kvr_mem_malloc(cap * sizeof *vals);
    kvr_rc_cmd *cmds = kvr_mem_malloc(cap * sizeof *cmds);
    const char **argv = kvr_mem_malloc(cap * 3 * sizeof *argv);
    size_t *argl = kvr_mem_malloc(cap * 3 * sizeof *argl);
    redisReply **rep = kvr_mem_calloc(cap, sizeof *rep);
    int rc = KVR_ENOMEM;
    if (!keys || !vals || !cmds || !argv || !argl || !rep)
        goto out;
    size_t k = 0;
    for (size_t b = 0; b < m->n_blocks; b++) {
        size_t s = b * KVR_RT_BLOCK, n = m->n_tokens - s < KVR_RT_BLOCK ? m->n_tokens - s
                                                                        : KVR_RT_BLOCK;
        uint64_t prev = b ? m->chains[b - 1] : kvr_rt_chain_seed(&m->desc);
        for (uint32_t e = KVR_RT_GRAIN; e < n; e += KVR_RT_GRAIN, k++) {
            uint64_t sub = kvr_rt_chain_next(prev, m->tokens + s, m->positions + s, e);
            argl[3 * k + 1] = kvr_rt_sub_key(sub, keys[k]);
            kvr_rt_sub_encode(&m->desc, m->chains[b], (uint32_t)n, e, vals[k]);
            if (r->keyed)
                kvr_rt_mac(r->key, keys[k], argl[3 * k + 1], vals[k], KVR_RT_SUB_LEN,
                           vals[k] + KVR_RT_SUB_LEN);
            argv[3 * k] = "SET";
            argl[3 * k] = 3;
            argv[3 * k + 1] = keys[k];
            argv[3 * k + 2] = (const char *)vals[k];
            argl[3 * k + 2] = KVR_RT_SUB_LEN + (r->keyed ? KVR_RT_MAC_LEN : 0);
            cmds[k] = (kvr_rc_cmd){ 3, argv + 3 * k, argl + 3 * k };
        }
    }
    size_t ok = kvr_rc_batch(r->rc, k, cmds, rep);
    for (size_t i = 0; i < k; i++)
        if (rep[i])
            freeReplyObject(rep[i]);
    rc = ok == k ? 0 : KVR_EIO;
out:
    kvr_mem_free(keys);
    kvr_mem_free(vals);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(rep);
    return rc;
}

static void publish_one(kvr_remote *r, pub_job *j)
{
    kvr_rt_manifest *m = &j->m;
    if (!tier_up(r)) {
        j->rc = KVR_EIO;
        snprintf(j->msg, sizeof j->msg, "remote tier: the cluster is unreachable");
        return;
    }
    /* The snapshot's conversion/rotation (if any) and its layout, here,
     * off the loop thread; the bytes are read straight from its leased
     * block memory. */
    kvr_get *gs[2] = { j->get, j->get2 };
    for (int k = 0; k < 2; k++) {
        kvr_error ge = { 0 };
        if (gs[k] && kvr_get_needs_work(gs[k]) && kvr_get_work(gs[k], &ge) < 0) {
            j->rc = KVR_EIO;
            snprintf(j->msg, sizeof j->msg, "remote tier: snapshot of '%.200s': %.250s",
                     m->ctx_id, ge.msg);
            return;
        }
    }
    if (j->get)
        kvr_get_payload_iov(j->get, &j->iov, &j->niov);
    if (j->get2)
        kvr_get_payload_iov(j->get2, &j->iov2, &j->niov2);
    j->starts = kvr_mem_malloc((j->niov + 1) * sizeof *j->starts);
    j->starts2 = kvr_mem_malloc((j->niov2 + 1) * sizeof *j->starts2);
    if (!j->starts || !j->starts2) {
        j->rc = KVR_ENOMEM;
        snprintf(j->msg, sizeof j->msg, "remote tier: out of memory publishing");
        return;
    }
    size_t off = 0;
    for (size_t i = 0; i < j->niov; i++) {
        j->starts[i] = off;
        off += j->iov[i].iov_len;
    }
    off = 0;
    for (size_t i = 0; i < j->niov2; i++) {
        j->starts2[i] = off;
        off += j->iov2[i].iov_len;
    }
    /* Plain: one get of everything. Quantized: the raw get's bytes for the
     * chunks, the window's get for the plain blocks after them. */
    rt_src src = { .iov = j->iov, .niov = j->niov, .starts = j->starts };
    rt_src wsrc = { .iov = j->iov2, .niov = j->niov2, .starts = j->starts2 };
    size_t nb = m->n_blocks, wbase = m->quant ? m->n_raw : 0;
    kvr_rt_manifest_chains(m, m->chains);
    /* Which blocks are there already (content-addressed: equal key, equal
     * bytes)? EXISTS is one pipelined round per node. */
    char (*keys)[KVR_RT_KEY_MAX] = kvr_mem_malloc((nb + 1) * KVR_RT_KEY_MAX);
    size_t *klen = kvr_mem_malloc((nb + 1) * sizeof *klen);
    kvr_rc_cmd *cmds = kvr_mem_malloc((nb + 1) * sizeof *cmds);
    const char **argv = kvr_mem_malloc((nb + 1) * 3 * sizeof *argv);
    size_t *argl = kvr_mem_malloc((nb + 1) * 3 * sizeof *argl);
    redisReply **rep = kvr_mem_calloc(nb + 1, sizeof *rep);
    bool *have = kvr_mem_calloc(nb + 1, sizeof *have);
    if (!keys || !klen || !cmds || !argv || !argl || !rep || !have) {
        j->rc = KVR_ENOMEM;
        snprintf(j->msg, sizeof j->msg, "remote tier: out of memory publishing");
        goto out;
    }
    for (size_t b = 0; b < nb; b++) {
        size_t bs, bn;
        bool ch;
        kvr_rt_manifest_block(m, b, &bs, &bn, &ch);
        klen[b] = ch ? kvr_rt_chunk_key(m->chains[b], keys[b])
                     : kvr_rt_block_key(m->chains[b], keys[b]);
        argv[3 * b] = "EXISTS";
        argl[3 * b] = 6;
        argv[3 * b + 1] = keys[b];
        argl[3 * b + 1] = klen[b];
        cmds[b] = (kvr_rc_cmd){ 2, argv + 3 * b, argl + 3 * b };
    }
    kvr_rc_batch(r->rc, nb, cmds, rep);
    for (size_t b = 0; b < nb; b++) {
        have[b] = rep[b] && rep[b]->type == REDIS_REPLY_INTEGER && rep[b]->integer == 1;
        if (rep[b])
            freeReplyObject(rep[b]);
        rep[b] = NULL;
    }
    size_t failed = 0;
    for (size_t b = 0; b < nb;) {
        /* A pipeline of at most SET_GROUP values and about SET_GROUP_BYTES:
         * hiredis holds a copy of what it sends (its output buffer). */
        size_t k = 0, bytes = 0;
        uint8_t *vals[SET_GROUP];
        size_t vlen[SET_GROUP];
        for (; b < nb && k < SET_GROUP && bytes < SET_GROUP_BYTES; b++) {
            if (have[b]) {
                atomic_fetch_add(&r->pub_skipped, 1);
                continue;
            }
            size_t s, n;
            bool ch;
            kvr_rt_manifest_block(m, b, &s, &n, &ch);
            /* A quantized context's window blocks count from the window's
             * start, in the window get's payload. */
            vals[k] = ch ? chunk_encode(m, b, m->chains[b], &src, &vlen[k])
                    : m->quant
                        ? encode_from(&m->desc, m->chains[b], s - wbase, m->tokens + s,
                                      m->positions + s, n, &wsrc, m->n_tokens - wbase, &vlen[k])
                        : encode_from(&m->desc, m->chains[b], s, m->tokens + s,
                                      m->positions + s, n, &src, m->n_tokens, &vlen[k]);
            if (vals[k] && !seal(r, keys[b], klen[b], &vals[k], &vlen[k])) {
                kvr_mem_free(vals[k]);
                vals[k] = NULL;
            }
            if (!vals[k]) {
                failed++;
                continue;
            }
            argv[3 * k] = "SET";
            argl[3 * k] = 3;
            argv[3 * k + 1] = keys[b];
            argl[3 * k + 1] = klen[b];
            argv[3 * k + 2] = (const char *)vals[k];
            argl[3 * k + 2] = vlen[k];
            cmds[k] = (kvr_rc_cmd){ 3, argv + 3 * k, argl + 3 * k };
            bytes += vlen[k];
            k++;
        }
        size_t ok = kvr_rc_batch(r->rc, k, cmds, rep);
        for (size_t i = 0; i < k; i++) {
            if (rep[i])
                freeReplyObject(rep[i]);
            rep[i] = NULL;
            kvr_mem_free(vals[i]);
        }
        failed += k - ok;
        atomic_fetch_add(&r->pub_blocks, ok);
    }
    if (failed) {
        j->rc = KVR_EIO;
        snprintf(j->msg, sizeof j->msg, "remote tier: %zu of %zu blocks of '%.200s' not published",
                 failed, nb, m->ctx_id);
        goto out;
    }
    /* The sub-block prefix keys (tiny, content-addressed: written again
     * whatever is there), so a match finds a shared prefix to 16 tokens. */
    if (!m->quant && publish_subs(r, m) < 0) {
        j->rc = KVR_EIO;
        snprintf(j->msg, sizeof j->msg, "remote tier: the prefix keys of '%.200s' were not "
                 "all published", m->ctx_id);
        goto out;
    }
    /* The manifest last: whoever finds it finds its blocks (unless Redis
     * evicted them since, which is a miss). */
    size_t ml;
    char mk[KVR_RT_KEY_MAX];
    size_t mkl = kvr_rt_manifest_key(m->ctx_id, mk);
    uint8_t *mv = kvr_rt_manifest_encode(m, &ml);
    if (mv && !seal(r, mk, mkl, &mv, &ml)) {
        kvr_mem_free(mv);
        mv = NULL;
    }
    if (!mv) {
        j->rc = KVR_ENOMEM;
        snprintf(j->msg, sizeof j->msg, "remote tier: out of memory publishing");
        goto out;
    }
    const char *sv[] = { "SET", mk, (const char *)mv };
    size_t sl[] = { 3, mkl, ml };
    redisReply *x;
    kvr_error e = { 0 };
    int rc = kvr_rc_command(r->rc, 3, sv, sl, &x, &e);
    kvr_mem_free(mv);
    if (rc < 0) {
        j->rc = rc;
        snprintf(j->msg, sizeof j->msg, "remote tier: manifest of '%.200s': %.250s", m->ctx_id, e.msg);
        goto out;
    }
    freeReplyObject(x);
    atomic_fetch_add(&r->pub_contexts, 1);
    j->rc = 0;
out:
    if (j->rc < 0)
        atomic_fetch_add(&r->pub_errors, 1);
    kvr_mem_free(keys);
    kvr_mem_free(klen);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(rep);
    kvr_mem_free(have);
}

static void *publisher(void *arg)
{
    kvr_remote *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && !r->q_head) {
            if (!atomic_load(&r->joined)) {
                /* Not joined yet: look for the cluster every REJOIN_MS. */
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_sec += 1;
                pthread_cond_timedwait(&r->cv, &r->mu, &ts);
                if (!r->stop && !r->q_head) {
                    pthread_mutex_unlock(&r->mu);
                    kvr_rc_set_deadline(kvr_rc_now_ms() + FETCH_MS);
                    tier_up(r);
                    kvr_rc_set_deadline(0);
                    pthread_mutex_lock(&r->mu);
                }
            } else {
                pthread_cond_wait(&r->cv, &r->mu);
            }
        }
        if (r->stop)
            break;
        pub_job *j = r->q_head;
        r->q_head = j->next;
        if (!r->q_head)
            r->q_tail = NULL;
        r->q_len--;
        pthread_mutex_unlock(&r->mu);
        /* Everything it does ends by its deadline, so whatever waits behind
         * it is answered by its own. */
        if (kvr_rc_now_ms() >= j->deadline_ms) {
            j->rc = KVR_EIO;
            snprintf(j->msg, sizeof j->msg, "remote tier: '%.200s' was not published within "
                     "%d ms of its share (the cluster is slow or hung)", j->m.ctx_id, PUBLISH_MS);
            atomic_fetch_add(&r->pub_errors, 1);
        } else {
            kvr_rc_set_deadline(j->deadline_ms);
            publish_one(r, j);
            kvr_rc_set_deadline(0);
        }
        pthread_mutex_lock(&r->mu);
        j->next = r->done;
        r->done = j;
        pthread_mutex_unlock(&r->mu);
        uv_async_send(&r->async);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static void job_finish(kvr_remote *r, pub_job *j)
{
    pthread_mutex_lock(&r->mu);
    r->pending_bytes -= j->bytes;
    pthread_mutex_unlock(&r->mu);
    if (j->rc < 0)
        kvr_log(KVR_LOG_WARN, "%s", j->msg);
    if (j->done)
        j->done(j->done_arg, j->rc, j->msg);
    kvr_get_end(j->get);     /* loop thread: the leases go */
    kvr_get_end(j->get2);
    kvr_rt_manifest_free(&j->m);
    kvr_mem_free(j->starts);
    kvr_mem_free(j->starts2);
    kvr_mem_free(j);
}

static void on_async(uv_async_t *a)
{
    kvr_remote *r = a->data;
    pthread_mutex_lock(&r->mu);
    pub_job *list = r->done;
    r->done = NULL;
    pthread_mutex_unlock(&r->mu);
    /* Oldest first. */
    pub_job *rev = NULL;
    while (list) {
        pub_job *n = list->next;
        list->next = rev;
        rev = list;
        list = n;
    }
    while (rev) {
        pub_job *n = rev->next;
        job_finish(r, rev);
        rev = n;
    }
}

/* "USER PASSWORD" or "PASSWORD" on the first line. */
static int read_auth(const char *path, char *user, size_t ucap, char *pass, size_t pcap,
                     kvr_error *err)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return kvr_error_set(err, KVR_EIO, "--remote-auth-file %s: %s", path, strerror(errno));
    char line[512] = "";
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    line[strcspn(line, "\r\n")] = '\0';
    char a[256] = "", b[256] = "";
    int n = got ? sscanf(line, "%255s %255s", a, b) : 0;
    if (n < 1)
        return kvr_error_set(err, KVR_EINVAL, "--remote-auth-file %s: empty (want 'USER "
                             "PASSWORD' or 'PASSWORD' on the first line)", path);
    if (n == 1) {
        user[0] = '\0';
        snprintf(pass, pcap, "%s", a);
    } else {
        snprintf(user, ucap, "%s", a);
        snprintf(pass, pcap, "%s", b);
    }
    memset(line, 0, sizeof line);
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    return 0;
}

int kvr_remote_create(kvr_remote **out, kvr_daemon *d, kvr_error *err)
{
    *out = NULL;
    const kvr_daemon_config *cfg = &d->cfg;
    if (!cfg->remote_tier[0])
        return 0;
    char user[256] = "", pass[256] = "";
    int rc;
    if (cfg->remote_auth_file[0] &&
        (rc = read_auth(cfg->remote_auth_file, user, sizeof user, pass, sizeof pass, err)) < 0)
        return rc;
    kvr_remote *r = kvr_mem_calloc(1, sizeof *r);
    if (!r)
        return kvr_error_set(err, KVR_ENOMEM, "remote tier: out of memory");
    r->d = d;
    if (cfg->remote_key_file[0]) {
        if ((rc = kvr_rt_key_read(cfg->remote_key_file, r->key, err)) < 0) {
            kvr_mem_free(r);
            return rc;
        }
        r->keyed = true;
        kvr_log(KVR_LOG_INFO, "remote tier: every value carries a keyed BLAKE2b MAC "
                "(--remote-key-file %s)", cfg->remote_key_file);
    } else {
        kvr_log(KVR_LOG_WARN, "remote tier: no --remote-key-file: values are not "
                "authenticated, so the shared tier trusts everyone who can write to the "
                "cluster (docs/cluster.md)");
    }
    rc = kvr_rc_create(&r->rc, &(kvr_rc_config){ .seeds = cfg->remote_tier, .user = user,
                                                 .password = pass }, err);
    memset(pass, 0, sizeof pass);
    if (rc < 0) {
        sodium_memzero(r->key, sizeof r->key);
        kvr_mem_free(r);
        return rc;
    }
    kvr_error e = { 0 };
    kvr_rc_set_deadline(kvr_rc_now_ms() + FETCH_MS);    /* start-up waits no longer */
    rc = kvr_rc_refresh(r->rc, &e);
    kvr_rc_set_deadline(0);
    if (rc == KVR_EUNAUTH) {
        kvr_error_set(err, KVR_EUNAUTH, "remote tier: %s (check --remote-auth-file)", e.msg);
        kvr_rc_destroy(r->rc);
        sodium_memzero(r->key, sizeof r->key);
        kvr_mem_free(r);
        return KVR_EUNAUTH;
    }
    if (rc == 0) {
        kvr_rc_stats st;
        kvr_rc_get_stats(r->rc, &st);
        atomic_store(&r->joined, true);
        kvr_log(KVR_LOG_INFO, "remote tier: cluster %s, %u slot ranges", cfg->remote_tier,
                st.n_masters);
    } else {
        atomic_store(&r->last_try_ms, mono_ms());
        kvr_log(KVR_LOG_WARN, "remote tier: cluster %s unreachable (%s); serving from memory"
                "%s, joining when it answers", cfg->remote_tier, e.msg,
                cfg->disk_dir[0] ? " and disk" : "");
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    uv_async_init(&d->loop, &r->async, on_async);
    r->async.data = r;
    r->has_async = true;
    uv_unref((uv_handle_t *)&r->async);
    if (pthread_create(&r->th, NULL, publisher, r) != 0) {
        uv_close((uv_handle_t *)&r->async, NULL);
        r->has_async = false;
        kvr_remote_destroy(r);
        return kvr_error_set(err, KVR_EINTERNAL, "remote tier: cannot start its thread");
    }
    r->th_started = true;
    *out = r;
    return 0;
}

void kvr_remote_close(kvr_remote *r)
{
    if (!r)
        return;
    if (r->th_started) {
        pthread_mutex_lock(&r->mu);
        r->stop = true;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->th, NULL);
        r->th_started = false;
    }
    /* What finished, then what never ran (a failure: shutting down). */
    if (r->has_async)
        on_async(&r->async);
    pthread_mutex_lock(&r->mu);
    pub_job *j = r->q_head;
    r->q_head = r->q_tail = NULL;
    pthread_mutex_unlock(&r->mu);
    while (j) {
        pub_job *n = j->next;
        j->rc = KVR_EIO;
        snprintf(j->msg, sizeof j->msg, "remote tier: shutting down before '%.200s' was published",
                 j->m.ctx_id);
        job_finish(r, j);
        j = n;
    }
    if (r->has_async) {
        uv_close((uv_handle_t *)&r->async, NULL);
        r->has_async = false;
    }
}

void kvr_remote_destroy(kvr_remote *r)
{
    if (!r)
        return;
    kvr_rc_destroy(r->rc);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    sodium_memzero(r->key, sizeof r->key);
    kvr_mem_free(r);
}

/* The codec of ctx as a plain dtype, or KVR_EUNSUPPORTED. */
static int plain_dtype(const char *codec, kvr_dtype *out)
{
    return kvr_dtype_parse(codec, out) == 0 ? 0 : KVR_EUNSUPPORTED;
}

/* The K tile of a canonical codec spec ("k=int4/g128/c,v=...": per channel
 * over 128 tokens; a per-token K: 1), docs/quantized.md. */
static uint32_t ktile_of(const char *canon)
{
    if (strncmp(canon, "k=", 2) != 0)
        return 1;
    size_t n = strcspn(canon, ",");
    char side[KVR_CODEC_NAME_MAX];
    snprintf(side, sizeof side, "%.*s", (int)n, canon);
    if (n < 2 || strcmp(side + strlen(side) - 2, "/c") != 0)
        return 1;
    const char *g = strstr(side, "/g");
    long v = g ? strtol(g + 2, NULL, 10) : 64;
    return v >= 1 && v <= 256 ? (uint32_t)v : 1;
}

int kvr_remote_publish(kvr_remote *r, const char *ctx_id, kvr_remote_done_fn done, void *arg,
                       kvr_error *err)
{
    kvr_store *s = r->d->store;
    kvr_ctx_info ci;
    int rc = kvr_store_stat(s, ctx_id, &ci, err);
    if (rc < 0)
        return rc;
    kvr_model_info mi;
    if (kvr_store_model_find(s, ci.model, &mi) < 0)
        return kvr_error_set(err, KVR_ENOMODEL, "share: model '%s' is gone", ci.model);
    kvr_dtype dt;
    bool quant = plain_dtype(ci.codec, &dt) < 0;
    if (quant)
        dt = mi.dtype;               /* the window's */
    if (ci.n_tokens == 0)
        return kvr_error_set(err, KVR_EINVAL, "share: '%s' is empty", ctx_id);
    /* A bounded queue: a share that would wait behind too many (or hold
     * too much memory leased while it waits) is dropped, counted. */
    uint64_t cap = r->d->cfg.max_memory;
    pthread_mutex_lock(&r->mu);
    size_t ql = r->q_len, qb = r->pending_bytes;
    pthread_mutex_unlock(&r->mu);
    if (ql >= PUB_QUEUE_MAX || (cap && qb + ci.kv_bytes > cap / 4)) {
        atomic_fetch_add(&r->pub_dropped, 1);
        return kvr_error_set(err, KVR_EBUSY, "share: the publish queue is full (%zu "
                             "publications, %zu bytes waiting: the cluster is slow or hung); "
                             "'%s' is not published", ql, qb, ctx_id);
    }
    if (ci.n_pending)
        return kvr_error_set(err, KVR_EPENDING, "share: '%s' has %zu tokens without KV "
                             "(refresh them first)", ctx_id, ci.n_pending);
    /* A reader lands what it fetches as exact KV: approximate tokens (an
     * edit's suffix, a parallel encoding) are not published. */
    if (ci.n_approx)
        return kvr_error_set(err, KVR_EUNSUPPORTED, "share: '%s' has %zu approximate tokens "
                             "(refresh them first)", ctx_id, ci.n_approx);
    /* The snapshot is a get of the whole context: its blocks are leased
     * (whatever happens to the context meanwhile) until the publication is
     * done and job_finish ends it on the loop. Nothing is copied here. A
     * quantized context: a raw get of its encoded tokens (which must be one
     * tile-aligned run before its window, as puts leave it) and a get of
     * its window in the model's dtype. */
    size_t n = ci.n_tokens, nq = quant ? n - ci.n_window : 0;
    uint32_t G = quant ? ktile_of(ci.codec) : 1;
    if (quant && nq % G)
        return kvr_error_set(err, KVR_EUNSUPPORTED, "share: '%s' (%s) has %zu quantized "
                             "tokens, not whole %u-token key tiles", ctx_id, ci.codec, nq, G);
    kvr_get *g = NULL, *g2 = NULL;
    if (!quant || nq) {
        kvr_get_params gp = { .ctx_id = ctx_id, .start = 0, .end = quant ? nq : SIZE_MAX,
                              .dtype = dt, .raw = quant };
        kvr_error ge = { 0 };
        if ((rc = kvr_store_get_begin(s, &gp, &g, &ge)) < 0) {
            if (!quant) {
                if (err)
                    *err = ge;
                return rc;
            }
            return kvr_error_set(err, KVR_EUNSUPPORTED, "share: '%s' (%s): its encoded tokens "
                                 "are not one run before its window (edited?): %.300s", ctx_id,
                                 ci.codec, ge.msg);
        }
    }
    if (quant && nq < n) {
        kvr_get_params gp = { .ctx_id = ctx_id, .start = nq, .end = n, .dtype = dt };
        if ((rc = kvr_store_get_begin(s, &gp, &g2, err)) < 0) {
            kvr_get_end(g);
            return rc;
        }
    }
    /* Their staging (if any), here on the loop: the work runs on a worker. */
    if ((g && (rc = kvr_get_stage(g, err)) < 0) || (g2 && (rc = kvr_get_stage(g2, err)) < 0)) {
        kvr_get_end(g);
        kvr_get_end(g2);
        return rc;
    }
    const kvr_get_info *gi = g ? kvr_get_get_info(g) : NULL;
    const kvr_get_info *gw = g2 ? kvr_get_get_info(g2) : NULL;
    if ((gi ? gi->n_tokens : 0) + (gw ? gw->n_tokens : 0) != n || (quant && gi && !gi->raw)) {
        kvr_get_end(g);
        kvr_get_end(g2);
        return kvr_error_set(err, KVR_EINTERNAL, "share: '%s' changed while it was read", ctx_id);
    }
    pub_job *j = kvr_mem_calloc(1, sizeof *j);
    if (j) {
        j->m.quant = quant;
        if (quant) {
            snprintf(j->m.codec, sizeof j->m.codec, "%s", ci.codec);
            j->m.n_raw = nq;
            j->m.raw_kb = gi ? gi->k_bytes : 0;
            j->m.raw_vb = gi ? gi->v_bytes : 0;
            j->m.ktile = G;
            j->m.chunk = G >= 256 ? G : 256 / G * G;
        }
        j->m.n_tokens = n;
    }
    size_t nb = j ? kvr_rt_manifest_blocks(&j->m) : 0;
    if (j) {
        j->m.chains = kvr_mem_malloc(nb * 8 + 1);
        j->m.tokens = kvr_mem_malloc(n * 4 + 1);
        j->m.positions = kvr_mem_malloc(n * 8 + 1);
        j->m.flags = kvr_mem_calloc(n + 1, 4);
        j->m.groups = kvr_mem_calloc(n + 1, 4);
    }
    if (!j || !j->m.chains || !j->m.tokens || !j->m.positions || !j->m.flags || !j->m.groups) {
        if (j) {
            kvr_rt_manifest_free(&j->m);
            kvr_mem_free(j);
        }
        kvr_get_end(g);
        kvr_get_end(g2);
        return kvr_error_set(err, KVR_ENOMEM, "share: out of memory for the snapshot");
    }
    j->get = g;
    j->get2 = g2;
    j->m.desc = (kvr_rt_desc){ mi.fingerprint, mi.n_layers, mi.n_kv_heads, mi.head_dim, dt };
    snprintf(j->m.ctx_id, sizeof j->m.ctx_id, "%s", ctx_id);
    snprintf(j->m.model, sizeof j->m.model, "%s", mi.name);
    j->m.n_blocks = nb;
    const kvr_get_info *parts[2] = { gi, gw };
    for (size_t k = 0, at = 0; k < 2; k++) {
        const kvr_get_info *x = parts[k];
        if (!x)
            continue;
        memcpy(j->m.tokens + at, x->tokens, x->n_tokens * 4);
        memcpy(j->m.positions + at, x->positions, x->n_tokens * 8);
        if (x->flags)
            memcpy(j->m.flags + at, x->flags, x->n_tokens * 4);
        if (x->groups)
            memcpy(j->m.groups + at, x->groups, x->n_tokens * 4);
        at += x->n_tokens;
    }
    /* The layout a reader needs for its get to answer what ours does (the
     * group of every token, the groups' offsets and cursors, the APE
     * record, retention, protection). */
    if (kvr_store_layout_stat(s, ctx_id, &j->m.layout, NULL) < 0)
        memset(&j->m.layout, 0, sizeof j->m.layout);
    j->m.n_protected = ci.n_protected;
    j->done = done;
    j->done_arg = arg;
    j->deadline_ms = kvr_rc_now_ms() + PUBLISH_MS + ci.kv_bytes / SLOW_BYTES_PER_MS;
    j->bytes = ci.kv_bytes;
    pthread_mutex_lock(&r->mu);
    r->pending_bytes += j->bytes;
    if (r->q_tail)
        r->q_tail->next = j;
    else
        r->q_head = j;
    r->q_tail = j;
    r->q_len++;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return 0;
}

/* ---- fetch jobs ---------------------------------------------------------- */

kvr_rjob *kvr_remote_job_get(kvr_remote *r, const char *ctx_id)
{
    if (!r)
        return NULL;
    kvr_rjob *j = kvr_mem_calloc(1, sizeof *j);
    if (j)
        j->t0_ns = kvr_now_ns();
    if (!j)
        return NULL;
    j->r = r;
    j->by_id = true;
    j->deadline_ms = kvr_rc_now_ms() + FETCH_MS;
    snprintf(j->ctx_id, sizeof j->ctx_id, "%s", ctx_id);
    return j;
}

kvr_rjob *kvr_remote_job_prefix(kvr_remote *r, const char *model, const uint32_t *tokens,
                                size_t n, size_t local_len)
{
    if (!r || n < KVR_RT_GRAIN || local_len >= n)
        return NULL;     /* the cluster cannot know more than we do */
    kvr_model_info mi;
    if (kvr_store_model_find(r->d->store, model, &mi) < 0)
        return NULL;
    kvr_rjob *j = kvr_mem_calloc(1, sizeof *j);
    if (j)
        j->t0_ns = kvr_now_ns();
    if (!j)
        return NULL;
    j->r = r;
    j->deadline_ms = kvr_rc_now_ms() + FETCH_MS;
    snprintf(j->model, sizeof j->model, "%s", mi.name);
    /* Contexts of the model's own dtype are the ones we look for. */
    j->desc = (kvr_rt_desc){ mi.fingerprint, mi.n_layers, mi.n_kv_heads, mi.head_dim,
                             mi.dtype };
    j->prompt = tokens;
    j->n_prompt = n;
    j->local_len = local_len;
    return j;
}

void kvr_remote_job_free(kvr_rjob *j)
{
    if (!j)
        return;
    if (j->worked) {
        uint64_t ns = kvr_now_ns() - j->t0_ns;
        kvr_remote *r = j->r;
        atomic_fetch_add(&r->fetch_hist[kvr_metrics_bucket((double)ns / 1e9)], 1);
        atomic_fetch_add(&r->fetch_ns, ns);
    }
    if (j->put)
        kvr_put_abort(j->put);      /* loop thread: nothing was committed */
    kvr_mem_free(j->starts);
    kvr_rt_manifest_free(&j->m);
    kvr_mem_free(j->payload);
    kvr_mem_free(j);
}

static void miss(kvr_rjob *j, bool corrupt, const char *why)
{
    atomic_fetch_add(corrupt ? &j->r->fetch_corrupt : &j->r->fetch_misses, 1);
    if (corrupt)
        kvr_log(KVR_LOG_WARN, "remote tier: %s (treated as a miss)", why);
    else
        kvr_log(KVR_LOG_DEBUG, "remote tier: miss: %s", why);
}

static void forged(kvr_rjob *j, const char *rkey)
{
    atomic_fetch_add(&j->r->fetch_forged, 1);
    kvr_log(KVR_LOG_WARN, "remote tier: %s: its MAC is not this cluster key's (forged, or "
            "written by a node with another key): treated as a miss", rkey);
}

/* The length of reply x's value under Redis key rkey without its MAC: true
 * if the MAC verifies (or no key is configured), false (a forgery, counted)
 * if not. */
static bool unseal(kvr_rjob *j, const char *rkey, size_t rklen, const redisReply *x,
                   size_t *len)
{
    kvr_remote *r = j->r;
    *len = x->len;
    if (!r->keyed)
        return true;
    if (x->len >= KVR_RT_MAC_LEN) {
        uint8_t m[KVR_RT_MAC_LEN];
        *len = x->len - KVR_RT_MAC_LEN;
        kvr_rt_mac(r->key, rkey, rklen, (const uint8_t *)x->str, *len, m);
        if (sodium_memcmp(m, x->str + *len, KVR_RT_MAC_LEN) == 0)
            return true;
    }
    forged(j, rkey);
    return false;
}

/* Every value is read with GETRANGE key 0 max, max the longest a good
 * value can be (known before it is asked for: from the key's kind, the
 * block's length, or a manifest's header), so Redis sends at most max + 1
 * bytes and a huge value under a key is refused without being read
 * (hiredis's buffers hold at most that). GETRANGE of a missing key is an
 * empty string: a miss like nil. */
typedef struct range_arg {
    char end[24];
} range_arg;

static size_t range_set(range_arg *a, size_t max, const char **argv, size_t *argl,
                        const char *key, size_t klen)
{
    argv[0] = "GETRANGE";
    argl[0] = 8;
    argv[1] = key;
    argl[1] = klen;
    argv[2] = "0";
    argl[2] = 1;
    argv[3] = a->end;
    argl[3] = (size_t)snprintf(a->end, sizeof a->end, "%zu", max);
    return 4;
}

/* The value under key if it has 1..max bytes; NULL if it is missing, the
 * command failed, or it is longer (*too_long, when not NULL). */
static redisReply *get_bounded(kvr_rc *rc, const char *key, size_t klen, size_t max,
                               bool *too_long)
{
    const char *argv[4];
    size_t argl[4];
    range_arg ra;
    range_set(&ra, max, argv, argl, key, klen);
    if (too_long)
        *too_long = false;
    redisReply *x;
    if (kvr_rc_command(rc, 4, argv, argl, &x, NULL) < 0)
        return NULL;
    if (x->type != REDIS_REPLY_STRING || x->len == 0 || x->len > max) {
        if (too_long && x->type == REDIS_REPLY_STRING && x->len > max)
            *too_long = true;
        freeReplyObject(x);
        return NULL;
    }
    return x;
}

/* The first n bytes of the value under key (a reply of 1..n bytes: fewer
 * if the value is shorter), or NULL: missing, or the command failed. */
static redisReply *get_head(kvr_rc *rc, const char *key, size_t klen, size_t n)
{
    const char *argv[4];
    size_t argl[4];
    range_arg ra;
    range_set(&ra, n - 1, argv, argl, key, klen);
    redisReply *x;
    if (kvr_rc_command(rc, 4, argv, argl, &x, NULL) < 0)
        return NULL;
    if (x->type != REDIS_REPLY_STRING || x->len == 0 || x->len > n) {
        freeReplyObject(x);
        return NULL;
    }
    return x;
}

/* The longest a manifest whose header is h (MANIFEST_HDR bytes) can be,
 * MAC included; 0 if the header is not a manifest's or names more tokens
 * than fit the bound below. A manifest is 20 bytes a token: the one of a
 * context whose KV could never fit under --max-memory is refused, and no
 * manifest above a sixteenth of the cap is read (docs/cluster.md). */
static size_t manifest_max(const kvr_remote *r, const uint8_t *h)
{
    if (memcmp(h, MANIFEST_MAGIC, 4) != 0)
        return 0;
    uint64_t nt = get64(h + 40), nb = get64(h + 48);
    if (nt > MAX_TOKENS || nb > nt)
        return 0;
    size_t max = MANIFEST_HDR + nb * 8 + nt * 20 + LAYOUT_FIXED + KVR_MAX_GROUPS * GROUP_REC +
                 QUANT_SEC + 4 + (r->keyed ? KVR_RT_MAC_LEN : 0);
    uint64_t cap = r->d->cfg.max_memory;
    if (cap && max > cap / 16)
        return 0;
    return max;
}

/* What fetch_blocks checks each block against, and each block's state
 * while it is read straight into the destination (kvr_rc_batch_sink): the
 * header, tokens and positions into hdr, the K/V into the destination, the
 * CRC32C computed as the bytes arrive (while they are in cache). */
#define HDR_MAX (BLOCK_HDR + KVR_RT_BLOCK * 12)

typedef struct blk_state {
    crypto_generichash_state mac;   /* keyed: over [0, want_len) as it arrives */
    size_t   want_len;          /* the exact length a good value has (its MAC apart) */
    size_t   got_len;           /* the reply's length, its MAC apart */
    size_t   raw_len;           /* the reply's length */
    uint32_t crc;
    bool     sized;             /* got_len == want_len: bytes go to hdr/dst */
    uint8_t  hdr[HDR_MAX];
    uint8_t  tail[4];
    uint8_t  tag[KVR_RT_MAC_LEN];
} blk_state;

typedef struct fetch_ctx {
    kvr_rjob       *j;
    const uint64_t *chains;
    size_t          n_ctx;
    const uint32_t *tokens;
    const int64_t  *pos;
    char          (*keys)[KVR_RT_KEY_MAX];
    bool           *good;
    blk_state      *st;
    size_t          row;
    rt_dst          dst;
} fetch_ctx;

static size_t blk_tokens(const fetch_ctx *f, size_t b)
{
    size_t s = b * KVR_RT_BLOCK;
    return f->n_ctx - s < KVR_RT_BLOCK ? f->n_ctx - s : KVR_RT_BLOCK;
}

static bool blk_begin(void *ud, size_t b, size_t len)
{
    fetch_ctx *f = ud;
    blk_state *st = &f->st[b];
    size_t n = blk_tokens(f, b);
    const kvr_remote *r = f->j->r;
    size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
    st->want_len = BLOCK_HDR + n * 12 + kv_bytes(&f->j->desc, n) + 4;
    st->raw_len = len;
    st->got_len = len >= ml ? len - ml : len;
    st->crc = 0;
    st->sized = len >= ml && st->got_len == st->want_len;
    if (st->sized && ml)
        mac_begin(&st->mac, r->key, f->keys[b], strlen(f->keys[b]));
    memset(st->hdr, 0, BLOCK_HDR);
    return true;     /* a wrong size is still read (up to its GETRANGE bound) and dropped */
}

/* Value offset -> where it goes: hdr, the destination (one layer side's
 * run of n rows, within one iovec), or tail. */
static uint8_t *blk_span(void *ud, size_t b, size_t off, size_t *cap)
{
    fetch_ctx *f = ud;
    blk_state *st = &f->st[b];
    if (!st->sized)
        return NULL;
    size_t n = blk_tokens(f, b), hl = BLOCK_HDR + n * 12, seg = n * f->row;
    size_t kv = st->want_len - hl - 4;
    if (off >= st->want_len) {         /* its MAC */
        *cap = st->want_len + KVR_RT_MAC_LEN - off;
        return st->tag + (off - st->want_len);
    }
    if (off < hl) {
        *cap = hl - off;
        return st->hdr + off;
    }
    if (off >= hl + kv) {
        *cap = st->want_len - off;
        return st->tail + (off - hl - kv);
    }
    size_t in = off - hl, l = in / seg, at = in % seg;
    size_t doff = (l * f->n_ctx + b * KVR_RT_BLOCK) * f->row + at;
    *cap = seg - at;
    if (f->dst.flat)
        return f->dst.flat + doff;
    size_t lo = 0, hi = f->dst.niov;
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (f->dst.starts[mid] <= doff)
            lo = mid;
        else
            hi = mid;
    }
    size_t iin = doff - f->dst.starts[lo], left = f->dst.iov[lo].iov_len - iin;
    if (*cap > left)
        *cap = left;
    return (uint8_t *)f->dst.iov[lo].iov_base + iin;
}

static void blk_got(void *ud, size_t b, size_t off, const uint8_t *p, size_t n)
{
    fetch_ctx *f = ud;
    blk_state *st = &f->st[b];
    if (!st->sized || off >= st->want_len)
        return;
    if (f->j->r->keyed)
        crypto_generichash_update(&st->mac, p, st->want_len - off < n ? st->want_len - off : n);
    if (off >= st->want_len - 4)
        return;
    size_t take = st->want_len - 4 - off < n ? st->want_len - 4 - off : n;
    st->crc = kvr_crc32c(st->crc, p, take);
}

static bool blk_end(void *ud, size_t b, bool is_string)
{
    fetch_ctx *f = ud;
    f->good[b] = false;
    blk_state *st = &f->st[b];
    if (!is_string || st->raw_len == 0)
        return false;            /* missing: counted once by fetch_blocks */
    size_t s = b * KVR_RT_BLOCK, n = blk_tokens(f, b);
    if (f->j->r->keyed && (st->sized ? !mac_end_ok(&st->mac, st->tag)
                                     : st->raw_len == st->want_len)) {
        forged(f->j, f->keys[b]);     /* a wrong MAC, or a good value without one */
        return false;
    }
    kvr_error e = { 0 };
    bool crc_ok = st->sized && st->crc == get32(st->tail);
    uint8_t small[BLOCK_HDR];
    const uint8_t *hv = st->hdr;
    if (!st->sized) {
        /* Only the length is known: report it as the one-shot check would. */
        memcpy(small, BLOCK_MAGIC, 4);
        put32(small + 4, RT_VERSION);
        hv = small;
    }
    if (block_check(hv, st->got_len, crc_ok, &f->j->desc, f->chains[b], s, f->tokens + s,
                    f->pos + s, n, &e) < 0) {
        char why[400];
        snprintf(why, sizeof why, "%s: %s", f->keys[b], e.msg);
        miss(f->j, true, why);
        return false;
    }
    f->good[b] = true;
    return true;
}

static const kvr_rc_sink blk_sink = { blk_begin, blk_span, blk_got, blk_end };

/* GETs blocks [0, nb) straight into the destination (j->payload, or the
 * open put's memory); returns how many leading blocks were good (up to
 * the first missing or bad one). */
static size_t fetch_blocks(kvr_rjob *j, const uint64_t *chains, size_t nb, size_t n_ctx,
                           const uint32_t *tokens, const int64_t *pos)
{
    kvr_remote *r = j->r;
    char (*keys)[KVR_RT_KEY_MAX] = kvr_mem_malloc(nb * KVR_RT_KEY_MAX + 1);
    kvr_rc_cmd *cmds = kvr_mem_malloc(nb * sizeof *cmds + 1);
    const char **argv = kvr_mem_malloc(nb * 4 * sizeof *argv + 1);
    size_t *argl = kvr_mem_malloc(nb * 4 * sizeof *argl + 1);
    range_arg *ra = kvr_mem_malloc(nb * sizeof *ra + 1);
    bool *good = kvr_mem_calloc(nb + 1, sizeof *good);
    blk_state *st = kvr_mem_malloc(nb * sizeof *st + 1);
    size_t n_good = 0;
    if (!keys || !cmds || !argv || !argl || !ra || !good || !st)
        goto out;
    size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
    for (size_t b = 0; b < nb; b++) {
        size_t s = b * KVR_RT_BLOCK, n = n_ctx - s < KVR_RT_BLOCK ? n_ctx - s : KVR_RT_BLOCK;
        size_t kl = kvr_rt_block_key(chains[b], keys[b]);
        range_set(&ra[b], BLOCK_HDR + n * 12 + kv_bytes(&j->desc, n) + 4 + ml, argv + 4 * b,
                  argl + 4 * b, keys[b], kl);
        cmds[b] = (kvr_rc_cmd){ 4, argv + 4 * b, argl + 4 * b };
    }
    fetch_ctx f = { j, chains, n_ctx, tokens, pos, keys, good, st, row_bytes(&j->desc),
                    { .flat = j->put ? NULL : j->payload, .iov = j->iov, .niov = j->niov,
                      .starts = j->starts } };
    kvr_rc_batch_sink(r->rc, nb, cmds, &blk_sink, &f);
    while (n_good < nb && good[n_good])
        n_good++;
    if (n_good < nb)
        miss(j, false, "a block is missing or bad (evicted, never published, or corrupt)");
out:
    kvr_mem_free(keys);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(ra);
    kvr_mem_free(good);
    kvr_mem_free(st);
    return n_good;
}

/* A quantized context's values, read straight into its raw put's payload:
 * the chunks into the encoded part (per layer K bytes then V bytes of all
 * n_raw tokens), the window's plain blocks after it. */
typedef struct qfetch {
    kvr_rjob  *j;
    crypto_generichash_state *mac;   /* keyed: per chunk, as in blk_state */
    uint8_t  (*tag)[KVR_RT_MAC_LEN];
    size_t    *raw_len;
    size_t     nch, hmax;
    uint8_t   *base;             /* the raw put's payload */
    uint8_t   *hdr;              /* nch * hmax: each chunk's header, tokens, positions */
    uint8_t  (*tail)[4];
    uint32_t  *crc;
    size_t    *got_len;
    bool      *sized, *good;
    char     (*keys)[KVR_RT_KEY_MAX];
    fetch_ctx  w;                /* the window's blocks */
} qfetch;

static bool q_begin(void *ud, size_t i, size_t len)
{
    qfetch *q = ud;
    if (i >= q->nch)
        return blk_begin(&q->w, i - q->nch, len);
    size_t s, n;
    bool ch;
    kvr_rt_manifest_block(&q->j->m, i, &s, &n, &ch);
    const kvr_remote *r = q->j->r;
    size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
    q->raw_len[i] = len;
    q->got_len[i] = len >= ml ? len - ml : len;
    q->sized[i] = len >= ml && q->got_len[i] == chunk_len(&q->j->m, n);
    if (q->sized[i] && ml)
        mac_begin(&q->mac[i], r->key, q->keys[i], strlen(q->keys[i]));
    q->crc[i] = 0;
    memset(q->hdr + i * q->hmax, 0, CHUNK_HDR);
    return true;
}

static uint8_t *q_span(void *ud, size_t i, size_t off, size_t *cap)
{
    qfetch *q = ud;
    if (i >= q->nch)
        return blk_span(&q->w, i - q->nch, off, cap);
    if (!q->sized[i])
        return NULL;
    const kvr_rt_manifest *m = &q->j->m;
    size_t s, n;
    bool ch;
    kvr_rt_manifest_block(m, i, &s, &n, &ch);
    size_t hl = CHUNK_HDR + n * 12, kb = chunk_kb(m, n), vb = chunk_vb(m, n);
    size_t body = m->desc.n_layers * (kb + vb);
    if (off >= hl + body + 4) {        /* its MAC */
        *cap = hl + body + 4 + KVR_RT_MAC_LEN - off;
        return q->tag[i] + (off - hl - body - 4);
    }
    if (off < hl) {
        *cap = hl - off;
        return q->hdr + i * q->hmax + off;
    }
    if (off >= hl + body) {
        *cap = hl + body + 4 - off;
        return q->tail[i] + (off - hl - body);
    }
    size_t in = off - hl, l = in / (kb + vb), w = in % (kb + vb);
    if (w < kb) {
        *cap = kb - w;
        return q->base + raw_off(m, l, 0, s) + w;
    }
    *cap = kb + vb - w;
    return q->base + raw_off(m, l, 1, s) + (w - kb);
}

static void q_got(void *ud, size_t i, size_t off, const uint8_t *p, size_t n)
{
    qfetch *q = ud;
    if (i >= q->nch) {
        blk_got(&q->w, i - q->nch, off, p, n);
        return;
    }
    size_t len = q->got_len[i];
    if (!q->sized[i] || off >= len)
        return;
    if (q->j->r->keyed)
        crypto_generichash_update(&q->mac[i], p, len - off < n ? len - off : n);
    if (off >= len - 4)
        return;
    size_t take = len - 4 - off < n ? len - 4 - off : n;
    q->crc[i] = kvr_crc32c(q->crc[i], p, take);
}

static bool q_end(void *ud, size_t i, bool is_string)
{
    qfetch *q = ud;
    if (i >= q->nch)
        return blk_end(&q->w, i - q->nch, is_string);
    q->good[i] = false;
    if (!is_string || q->raw_len[i] == 0)
        return false;
    size_t cs, cn;
    bool cch;
    kvr_rt_manifest_block(&q->j->m, i, &cs, &cn, &cch);
    if (q->j->r->keyed && (q->sized[i] ? !mac_end_ok(&q->mac[i], q->tag[i])
                                       : q->raw_len[i] == chunk_len(&q->j->m, cn))) {
        forged(q->j, q->keys[i]);     /* a wrong MAC, or a good value without one */
        return false;
    }
    kvr_error e = { 0 };
    bool crc_ok = q->sized[i] && q->crc[i] == get32(q->tail[i]);
    uint8_t small[CHUNK_HDR] = { 0 };
    const uint8_t *hv = q->hdr + i * q->hmax;
    if (!q->sized[i]) {
        memcpy(small, CHUNK_MAGIC, 4);
        put32(small + 4, RT_VERSION);
        hv = small;
    }
    if (chunk_check(hv, q->got_len[i], crc_ok, &q->j->m, i, q->j->m.chains[i], &e) < 0) {
        char why[400];
        snprintf(why, sizeof why, "%s: %s", q->keys[i], e.msg);
        miss(q->j, true, why);
        return false;
    }
    q->good[i] = true;
    return true;
}

static const kvr_rc_sink q_sink = { q_begin, q_span, q_got, q_end };

/* All values of a quantized context into base (the raw put's payload);
 * true if every one was good. */
static bool fetch_quant(kvr_rjob *j, uint8_t *base)
{
    kvr_remote *r = j->r;
    const kvr_rt_manifest *m = &j->m;
    size_t nb = m->n_blocks, nch = (m->n_raw + m->chunk - 1) / m->chunk, nwb = nb - nch;
    size_t nw = m->n_tokens - m->n_raw, hmax = CHUNK_HDR + (size_t)m->chunk * 12;
    qfetch q = { .j = j, .nch = nch, .hmax = hmax, .base = base };
    q.hdr = kvr_mem_malloc(nch * hmax + 1);
    q.tail = kvr_mem_malloc(nch * 4 + 1);
    q.crc = kvr_mem_malloc(nch * 4 + 1);
    q.got_len = kvr_mem_malloc(nch * sizeof *q.got_len + 1);
    q.raw_len = kvr_mem_malloc(nch * sizeof *q.raw_len + 1);
    q.mac = kvr_mem_malloc(nch * sizeof *q.mac + 1);
    q.tag = kvr_mem_malloc(nch * sizeof *q.tag + 1);
    q.sized = kvr_mem_calloc(nch + 1, 1);
    q.good = kvr_mem_calloc(nch + 1, 1);
    q.keys = kvr_mem_malloc(nb * KVR_RT_KEY_MAX + 1);
    kvr_rc_cmd *cmds = kvr_mem_malloc(nb * sizeof *cmds + 1);
    const char **argv = kvr_mem_malloc(nb * 4 * sizeof *argv + 1);
    size_t *argl = kvr_mem_malloc(nb * 4 * sizeof *argl + 1);
    range_arg *ra = kvr_mem_malloc(nb * sizeof *ra + 1);
    bool *wgood = kvr_mem_calloc(nwb + 1, 1);
    blk_state *wst = kvr_mem_malloc(nwb * sizeof *wst + 1);
    bool all = false;
    if (!q.hdr || !q.tail || !q.crc || !q.got_len || !q.raw_len || !q.mac || !q.tag ||
        !q.sized || !q.good || !q.keys || !cmds || !argv || !argl || !ra || !wgood || !wst)
        goto out;
    size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
    for (size_t b = 0; b < nb; b++) {
        size_t s, n;
        bool ch;
        kvr_rt_manifest_block(m, b, &s, &n, &ch);
        size_t kl = b < nch ? kvr_rt_chunk_key(m->chains[b], q.keys[b])
                            : kvr_rt_block_key(m->chains[b], q.keys[b]);
        size_t want = b < nch ? chunk_len(m, n) : BLOCK_HDR + n * 12 + kv_bytes(&j->desc, n) + 4;
        range_set(&ra[b], want + ml, argv + 4 * b, argl + 4 * b, q.keys[b], kl);
        cmds[b] = (kvr_rc_cmd){ 4, argv + 4 * b, argl + 4 * b };
    }
    q.w = (fetch_ctx){ j, m->chains + nch, nw, m->tokens + m->n_raw, m->positions + m->n_raw,
                       q.keys + nch, wgood, wst, row_bytes(&j->desc),
                       { .flat = base + m->desc.n_layers * (m->raw_kb + m->raw_vb) } };
    kvr_rc_batch_sink(r->rc, nb, cmds, &q_sink, &q);
    all = true;
    for (size_t b = 0; b < nch; b++)
        all = all && q.good[b];
    for (size_t b = 0; b < nwb; b++)
        all = all && wgood[b];
    if (!all)
        miss(j, false, "a value is missing or bad (evicted, never published, or corrupt)");
out:
    kvr_mem_free(q.hdr);
    kvr_mem_free(q.tail);
    kvr_mem_free(q.crc);
    kvr_mem_free(q.got_len);
    kvr_mem_free(q.raw_len);
    kvr_mem_free(q.mac);
    kvr_mem_free(q.tag);
    kvr_mem_free(q.sized);
    kvr_mem_free(q.good);
    kvr_mem_free(q.keys);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(ra);
    kvr_mem_free(wgood);
    kvr_mem_free(wst);
    return all;
}

static void work_by_id(kvr_rjob *j)
{
    kvr_remote *r = j->r;
    if (j->phase == 1) {
        bool ok = j->m.quant
                      ? fetch_quant(j, (uint8_t *)j->iov[0].iov_base)
                      : fetch_blocks(j, j->m.chains, j->m.n_blocks, j->m.n_tokens, j->m.tokens,
                                     j->m.positions) == j->m.n_blocks;
        if (ok) {
            j->hit = true;
            j->n_tokens = j->m.n_tokens;
        }
        return;
    }
    char mk[KVR_RT_KEY_MAX];
    size_t mkl = kvr_rt_manifest_key(j->ctx_id, mk);
    /* Its header first: what it says bounds what is read of the rest. */
    bool too_long = false;
    redisReply *x = get_head(r->rc, mk, mkl, MANIFEST_HDR);
    size_t mmax = x && x->len == MANIFEST_HDR ? manifest_max(r, (const uint8_t *)x->str) : 0;
    if (x && mmax == 0) {
        freeReplyObject(x);
        char why[200];
        snprintf(why, sizeof why, "%s: not a manifest, or one larger than this node takes "
                 "(docs/cluster.md)", mk);
        miss(j, true, why);
        return;
    }
    if (x) {
        freeReplyObject(x);
        x = get_bounded(r->rc, mk, mkl, mmax, &too_long);
    }
    if (!x) {
        if (too_long) {
            char why[200];
            snprintf(why, sizeof why, "%s: longer than its header says (not read)", mk);
            miss(j, true, why);
        } else {
            miss(j, false, "no manifest");
        }
        return;
    }
    size_t vl;
    if (!unseal(j, mk, mkl, x, &vl)) {
        freeReplyObject(x);
        miss(j, false, "a manifest without this cluster's MAC");
        return;
    }
    kvr_error e = { 0 };
    int rc = kvr_rt_manifest_decode((const uint8_t *)x->str, vl, j->ctx_id, &j->m, &e);
    freeReplyObject(x);
    if (rc < 0) {
        char why[400];
        snprintf(why, sizeof why, "%s: %s", mk, e.msg);
        miss(j, true, why);
        return;
    }
    j->desc = j->m.desc;
    j->have_manifest = true;     /* the loop opens the put, then phase 1 */
}

/* The finer candidates after `run` whole blocks of the prompt (chain
 * `prev` before them): a published context's last, shorter block of 1..63
 * tokens ("kvr1:b:"), and the sub-block prefix keys of 16, 32, 48 tokens
 * ("kvr1:p:"), each as far as the prompt goes. Same hash for a length
 * either way (kvr_rt_chain_next of those tokens). */
#define FINE_MAX (KVR_RT_BLOCK - 1 + KVR_RT_BLOCK / KVR_RT_GRAIN - 1)

typedef struct fine {
    size_t   n;
    char     keys[FINE_MAX][KVR_RT_KEY_MAX];
    uint32_t len[FINE_MAX];
    bool     sub[FINE_MAX];
    uint64_t chain[FINE_MAX];
    const char *argv[FINE_MAX][2];
    size_t   argl[FINE_MAX][2];
} fine;

static void fine_build(fine *f, uint64_t prev, const uint32_t *tok, const int64_t *pos,
                       size_t avail)
{
    f->n = 0;
    if (avail > KVR_RT_BLOCK)
        avail = KVR_RT_BLOCK;
    for (uint32_t e = 1; e <= avail && e < KVR_RT_BLOCK; e++) {
        uint64_t c = kvr_rt_chain_next(prev, tok, pos, e);
        for (int sub = 0; sub < 2; sub++) {
            if (sub && e % KVR_RT_GRAIN)
                continue;
            size_t i = f->n++;
            f->len[i] = e;
            f->sub[i] = sub;
            f->chain[i] = c;
            f->argv[i][0] = "EXISTS";
            f->argl[i][0] = 6;
            f->argl[i][1] = sub ? kvr_rt_sub_key(c, f->keys[i]) : kvr_rt_block_key(c, f->keys[i]);
            f->argv[i][1] = f->keys[i];
        }
    }
}

/* The longest present candidate (a shorter block before a prefix key of
 * the same length): its index, or -1. */
static int fine_best(const fine *f, redisReply *const *rep)
{
    int best = -1;
    for (size_t i = 0; i < f->n; i++)
        if (rep[i] && rep[i]->type == REDIS_REPLY_INTEGER && rep[i]->integer == 1 &&
            (best < 0 || f->len[i] > f->len[best]))
            best = (int)i;
    return best;
}

static void work_prefix(kvr_rjob *j)
{
    kvr_remote *r = j->r;
    size_t np = j->n_prompt, nb = np / KVR_RT_BLOCK;
    uint64_t *chains = kvr_mem_malloc((nb + 1) * 8);
    int64_t *pos = kvr_mem_malloc(np * 8 + 1);
    char (*keys)[KVR_RT_KEY_MAX] = kvr_mem_malloc((nb + 1) * KVR_RT_KEY_MAX);
    kvr_rc_cmd *cmds = kvr_mem_malloc((nb + FINE_MAX) * sizeof *cmds);
    const char **argv = kvr_mem_malloc((nb + 1) * 2 * sizeof *argv);
    size_t *argl = kvr_mem_malloc((nb + 1) * 2 * sizeof *argl);
    redisReply **rep = kvr_mem_calloc(nb + FINE_MAX, sizeof *rep);
    fine *f = kvr_mem_malloc(sizeof *f);
    size_t nrep = 0;
    if (!chains || !pos || !keys || !cmds || !argv || !argl || !rep || !f)
        goto out;
    for (size_t i = 0; i < np; i++)
        pos[i] = (int64_t)i;
    uint64_t seed = kvr_rt_chain_seed(&j->desc), h = seed;
    for (size_t b = 0; b < nb; b++) {
        h = kvr_rt_chain_next(h, j->prompt + b * KVR_RT_BLOCK, pos + b * KVR_RT_BLOCK,
                              KVR_RT_BLOCK);
        chains[b] = h;
        argv[2 * b] = "EXISTS";
        argl[2 * b] = 6;
        argl[2 * b + 1] = kvr_rt_block_key(h, keys[b]);
        argv[2 * b + 1] = keys[b];
        cmds[b] = (kvr_rc_cmd){ 2, argv + 2 * b, argl + 2 * b };
    }
    /* Probe every chain hash at once (one pipelined round per node): the
     * run of present blocks from the start is the cluster's prefix. The
     * finer candidates of the first block go in the same round (a prompt
     * the cluster does not hold costs one round trip). */
    fine_build(f, seed, j->prompt, pos, np);
    for (size_t i = 0; i < f->n; i++)
        cmds[nb + i] = (kvr_rc_cmd){ 2, f->argv[i], f->argl[i] };
    nrep = nb + f->n;
    atomic_fetch_add(&r->probes, 1);
    kvr_rc_batch(r->rc, nrep, cmds, rep);
    size_t run = 0;
    while (run < nb && rep[run] && rep[run]->type == REDIS_REPLY_INTEGER && rep[run]->integer == 1)
        run++;
    int best = -1;
    if (run == 0) {
        best = fine_best(f, rep + nb);
    } else if (run * KVR_RT_BLOCK < np) {
        /* A second round: the finer candidates after the run. */
        size_t s0 = run * KVR_RT_BLOCK;
        for (size_t i = nb; i < nrep; i++) {
            if (rep[i])
                freeReplyObject(rep[i]);
            rep[i] = NULL;
        }
        fine_build(f, chains[run - 1], j->prompt + s0, pos + s0, np - s0);
        nrep = nb + f->n;
        for (size_t i = 0; i < f->n; i++)
            cmds[i] = (kvr_rc_cmd){ 2, f->argv[i], f->argl[i] };
        kvr_rc_batch(r->rc, f->n, cmds, rep + nb);
        best = fine_best(f, rep + nb);
    }
    size_t extra = best >= 0 ? f->len[best] : 0, len = run * KVR_RT_BLOCK + extra;
    if (len == 0 || len <= j->local_len) {
        miss(j, false, "the cluster's prefix is no longer than the local one");
        goto out;
    }
    j->payload = kvr_mem_malloc(kv_bytes(&j->desc, len));
    if (!j->payload)
        goto out;
    kvr_rc_set_deadline(j->deadline_ms + kv_bytes(&j->desc, len) / SLOW_BYTES_PER_MS);
    /* The whole blocks, and a shorter last block, straight into the payload. */
    bool tail_block = best >= 0 && !f->sub[best];
    if (tail_block)
        chains[run] = f->chain[best];
    size_t nfetch = run + (tail_block ? 1 : 0);
    size_t good = nfetch ? fetch_blocks(j, chains, nfetch, len, j->prompt, pos) : 0;
    size_t glen = good == nfetch ? len : good * KVR_RT_BLOCK;
    if (best >= 0 && f->sub[best] && good == nfetch) {
        /* A prefix key: the whole block it names, of which the first
         * `extra` tokens are the prompt's. */
        size_t s0 = run * KVR_RT_BLOCK;
        char vk[KVR_RT_KEY_MAX];
        size_t vkl = kvr_rt_sub_key(f->chain[best], vk);
        size_t ml = r->keyed ? KVR_RT_MAC_LEN : 0;
        redisReply *x = get_bounded(r->rc, vk, vkl, KVR_RT_SUB_LEN + ml, NULL);
        uint64_t bchain = 0;
        uint32_t bn = 0;
        kvr_error e = { 0 };
        size_t vl = 0;
        bool sealed = true;
        int rc = !x ? kvr_error_set(&e, KVR_EIO, "%s: gone", vk)
               : !(sealed = unseal(j, vk, vkl, x, &vl))
                   ? kvr_error_set(&e, KVR_EIO, "%s: MAC mismatch", vk)
                   : kvr_rt_sub_decode((const uint8_t *)x->str, vl, &j->desc, (uint32_t)extra,
                                       &bchain, &bn, &e);
        if (x)
            freeReplyObject(x);
        if (rc == 0) {
            char bk[KVR_RT_KEY_MAX];
            size_t bkl = kvr_rt_block_key(bchain, bk);
            x = bn <= KVR_RT_BLOCK
                    ? get_bounded(r->rc, bk, bkl, BLOCK_HDR + bn * 12 + kv_bytes(&j->desc, bn) +
                                  4 + ml, NULL)
                    : NULL;
            rc = !x ? kvr_error_set(&e, KVR_EIO, "%s: gone", bk)
               : !(sealed = unseal(j, bk, bkl, x, &vl))
                   ? kvr_error_set(&e, KVR_EIO, "%s: MAC mismatch", bk)
                   : decode_head((const uint8_t *)x->str, vl, &j->desc,
                                 run ? chains[run - 1] : seed, bchain, s0, bn, j->prompt + s0,
                                 pos + s0, extra, j->payload, len, &e);
            if (x)
                freeReplyObject(x);
        }
        if (rc < 0) {
            char why[400];
            snprintf(why, sizeof why, "%s: %s", vk, e.msg);
            bool evicted = strstr(e.msg, ": gone") != NULL;
            miss(j, !evicted && sealed, why);    /* a forgery is counted as such */
            glen = s0;
        }
    }
    if (glen == 0 || glen <= j->local_len)
        goto out;
    /* A shorter good run still helps: the payload is laid out for len
     * tokens, so land exactly glen by compacting per layer side. */
    if (glen < len) {
        size_t row = row_bytes(&j->desc);
        for (size_t l = 0; l < 2 * (size_t)j->desc.n_layers; l++)
            memmove(j->payload + l * glen * row, j->payload + l * len * row, glen * row);
    }
    j->m.tokens = kvr_mem_malloc(glen * 4);
    j->m.positions = kvr_mem_malloc(glen * 8);
    if (!j->m.tokens || !j->m.positions)
        goto out;
    memcpy(j->m.tokens, j->prompt, glen * 4);
    memcpy(j->m.positions, pos, glen * 8);
    j->n_tokens = glen;
    /* Named after the chain hash of the prefix's last token (a whole
     * block's, or the finer one's: the same hash names the same tokens). */
    uint64_t last = glen == len && best >= 0 ? f->chain[best] : chains[glen / KVR_RT_BLOCK - 1];
    snprintf(j->ctx_id, sizeof j->ctx_id, "cluster:%016" PRIx64, last);
    j->hit = true;
out:
    for (size_t b = 0; rep && b < nrep; b++)
        if (rep[b])
            freeReplyObject(rep[b]);
    kvr_mem_free(chains);
    kvr_mem_free(pos);
    kvr_mem_free(keys);
    kvr_mem_free(cmds);
    kvr_mem_free(argv);
    kvr_mem_free(argl);
    kvr_mem_free(rep);
    kvr_mem_free(f);
}

void kvr_remote_job_work(kvr_rjob *j)
{
    /* The whole fetch (both phases of a get) ends by its deadline. */
    if (kvr_rc_now_ms() >= j->deadline_ms) {
        miss(j, false, "the fetch deadline passed (the cluster is slow or hung)");
        return;
    }
    kvr_rc_set_deadline(j->deadline_ms);
    if (!tier_up(j->r)) {
        miss(j, false, "the cluster is unreachable");
    } else {
        j->worked = true;
        if (j->by_id)
            work_by_id(j);
        else
            work_prefix(j);
    }
    kvr_rc_set_deadline(0);
}

/* A local model for the fetched data: the named one if its fingerprint
 * agrees, else any with that fingerprint. */
static int find_model(kvr_store *s, const char *name, uint64_t fp, kvr_model_info *out)
{
    if (name[0] && kvr_store_model_find(s, name, out) == 0 && out->fingerprint == fp)
        return 0;
    kvr_model_info all[64];
    size_t n = kvr_store_model_list(s, all, 64);
    for (size_t i = 0; i < n && i < 64; i++)
        if (all[i].fingerprint == fp) {
            *out = all[i];
            return 0;
        }
    return KVR_ENOMODEL;
}

/* Does the manifest carry a layout beyond tokens and positions? */
static bool has_layout(const kvr_rt_manifest *m)
{
    if (m->layout.has_prefix || m->layout.n_groups || m->layout.has_retention)
        return true;
    for (size_t i = 0; i < m->n_tokens; i++)
        if (m->flags[i])
            return true;
    return false;
}

/* Loop thread: the fetched K/V is in t's memory; convert if needed, commit,
 * then give the context the layout it has on the publishing node. */
static int land_commit(kvr_rjob *j, kvr_put *t)
{
    kvr_error e = { 0 };
    int rc;
    if (kvr_put_needs_work(t) && (rc = kvr_put_work(t, &e)) < 0) {
        kvr_put_abort(t);
        kvr_log(KVR_LOG_WARN, "remote tier: fetched '%s' refused: %s", j->ctx_id, e.msg);
        return rc;
    }
    kvr_put_result res;
    rc = kvr_put_commit(t, &res, &e);
    if (rc < 0) {
        kvr_log(KVR_LOG_WARN, "remote tier: cannot keep '%s' locally: %s", j->ctx_id, e.msg);
        return rc;
    }
    if (j->by_id && has_layout(&j->m) &&
        (rc = kvr_store_layout_restore(j->r->d->store, j->ctx_id, &j->m.layout, j->m.groups,
                                       j->m.flags, j->m.n_tokens, &e)) < 0) {
        /* Without its layout it is not what the publisher has: a miss. */
        kvr_store_delete(j->r->d->store, j->ctx_id, NULL);
        char why[600];
        snprintf(why, sizeof why, "the layout of '%.200s' cannot be applied: %.300s",
                 j->ctx_id, e.msg);
        miss(j, true, why);
        return KVR_ENOCTX;
    }
    atomic_fetch_add(&j->r->fetch_hits, 1);
    atomic_fetch_add(&j->r->fetch_tokens, j->n_tokens);
    kvr_log(KVR_LOG_DEBUG, "remote tier: fetched '%s' (%zu tokens)", j->ctx_id, j->n_tokens);
    return 0;
}

int kvr_remote_job_land(kvr_rjob *j)
{
    if (j->by_id && j->phase == 1) {
        kvr_put *t = j->put;
        j->put = NULL;
        if (!j->hit) {
            kvr_put_abort(t);
            return KVR_ENOCTX;
        }
        return land_commit(j, t);
    }
    if (j->by_id ? !j->have_manifest : !j->hit)
        return KVR_ENOCTX;
    kvr_remote *r = j->r;
    kvr_store *s = r->d->store;
    kvr_model_info mi;
    if (find_model(s, j->by_id ? j->m.model : j->model, j->desc.fingerprint, &mi) < 0) {
        miss(j, false, "no local model has the context's fingerprint (register it first)");
        return KVR_ENOCTX;
    }
    if (mi.n_layers != j->desc.n_layers || mi.n_kv_heads != j->desc.n_kv_heads ||
        mi.head_dim != j->desc.head_dim) {
        miss(j, true, "the fetched shape differs from the local model's");
        return KVR_ENOCTX;
    }
    if (j->by_id) {
        j->n_tokens = j->m.n_tokens;
        /* Every field of the manifest's layout passes the checks of the
         * verb that would set it here, before anything is stored. */
        kvr_error le = { 0 };
        if (kvr_layout_info_check(&j->m.layout, j->ctx_id, mi.fingerprint, j->m.groups,
                                  j->m.flags, j->m.n_tokens, &le) < 0) {
            char why[600];
            snprintf(why, sizeof why, "manifest of '%.200s': bad layout: %.300s", j->ctx_id,
                     le.msg);
            miss(j, true, why);
            return KVR_ENOCTX;
        }
    }
    kvr_put_params pp = {
        .ctx_id = j->ctx_id,
        .model = mi.name,
        .mode = KVR_PUT_CREATE,
        .fingerprint = mi.fingerprint,
        .n_layers = mi.n_layers,
        .n_kv_heads = mi.n_kv_heads,
        .head_dim = mi.head_dim,
        .dtype = j->desc.dtype,
        .n_tokens = j->n_tokens,
        .tokens = j->m.tokens,
        .positions = j->m.positions,
        .codec = j->by_id && j->m.quant ? j->m.codec : kvr_dtype_name(j->desc.dtype),
        .has_protect_first = j->by_id && j->m.n_protected > 0,
        .protect_first = j->by_id ? j->m.n_protected : 0,
        .raw = j->by_id && j->m.quant,
        .raw_tokens = j->by_id && j->m.quant ? j->m.n_raw : 0,
    };
    kvr_put *t;
    kvr_error e = { 0 };
    int rc = kvr_store_put_begin(s, &pp, &t, &e);
    if (rc == KVR_EEXIST)
        return 0;
    if (rc < 0) {
        kvr_log(KVR_LOG_WARN, "remote tier: cannot keep '%s' locally: %s", j->ctx_id, e.msg);
        return rc;
    }
    const struct iovec *iov;
    size_t niov;
    kvr_put_payload_iov(t, &iov, &niov);
    bool q = j->by_id && j->m.quant;
    size_t want = q ? j->desc.n_layers * (j->m.raw_kb + j->m.raw_vb) +
                          kv_bytes(&j->desc, j->n_tokens - j->m.n_raw)
                    : kv_bytes(&j->desc, j->n_tokens);
    if (kvr_put_payload_size(t) != want || (q && niov != 1)) {
        kvr_put_abort(t);
        miss(j, true, "the fetched context's size differs from the local put's (another "
             "codec layout?)");
        return KVR_ENOCTX;
    }
    if (j->by_id) {
        /* Phase 1: the blocks are fetched straight into the put's memory. */
        j->starts = kvr_mem_malloc((niov + 1) * sizeof *j->starts);
        if (!j->starts) {
            kvr_put_abort(t);
            return KVR_ENOMEM;
        }
        size_t off = 0;
        for (size_t i = 0; i < niov; i++) {
            j->starts[i] = off;
            off += iov[i].iov_len;
        }
        j->put = t;
        j->iov = iov;
        j->niov = niov;
        j->phase = 1;
        /* The blocks get a deadline of their own, by their size. */
        j->deadline_ms = kvr_rc_now_ms() + FETCH_MS + want / SLOW_BYTES_PER_MS;
        return 1;
    }
    size_t off = 0;
    for (size_t i = 0; i < niov; i++) {
        memcpy(iov[i].iov_base, j->payload + off, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    return land_commit(j, t);
}

void kvr_remote_get_stats(kvr_remote *r, kvr_remote_stats *o)
{
    memset(o, 0, sizeof *o);
    kvr_rc_stats st;
    kvr_rc_get_stats(r->rc, &st);
    o->joined = atomic_load(&r->joined);
    o->pub_contexts = atomic_load(&r->pub_contexts);
    o->pub_blocks = atomic_load(&r->pub_blocks);
    o->pub_skipped = atomic_load(&r->pub_skipped);
    o->pub_errors = atomic_load(&r->pub_errors);
    o->pub_dropped = atomic_load(&r->pub_dropped);
    o->fetch_hits = atomic_load(&r->fetch_hits);
    o->fetch_misses = atomic_load(&r->fetch_misses);
    o->fetch_corrupt = atomic_load(&r->fetch_corrupt);
    o->fetch_forged = atomic_load(&r->fetch_forged);
    o->fetch_tokens = atomic_load(&r->fetch_tokens);
    o->probes = atomic_load(&r->probes);
    o->moved = st.moved;
    o->ask = st.ask;
    o->refreshes = st.refreshes;
    o->conn_errors = st.conn_errors;
    o->fetch_seconds = (double)atomic_load(&r->fetch_ns) / 1e9;
    for (size_t i = 0; i <= KVR_METRICS_N_BUCKETS; i++)
        o->fetch_hist[i] = atomic_load(&r->fetch_hist[i]);
}

size_t kvr_remote_metrics(kvr_remote *r, const char **names, double *values, size_t cap)
{
    kvr_remote_stats s;
    kvr_remote_get_stats(r, &s);
    struct { const char *n; double v; } m[] = {
        { "remote_joined", s.joined ? 1 : 0 },
        { "remote_published_contexts", (double)s.pub_contexts },
        { "remote_published_blocks", (double)s.pub_blocks },
        { "remote_blocks_already_there", (double)s.pub_skipped },
        { "remote_publish_errors", (double)s.pub_errors },
        { "remote_publish_dropped", (double)s.pub_dropped },
        { "remote_fetch_hits", (double)s.fetch_hits },
        { "remote_fetch_misses", (double)s.fetch_misses },
        { "remote_fetch_corrupt", (double)s.fetch_corrupt },
        { "remote_fetch_forged", (double)s.fetch_forged },
        { "remote_fetched_tokens", (double)s.fetch_tokens },
        { "remote_probes", (double)s.probes },
        { "remote_moved", (double)s.moved },
        { "remote_ask", (double)s.ask },
        { "remote_map_refreshes", (double)s.refreshes },
        { "remote_conn_errors", (double)s.conn_errors },
    };
    size_t n = sizeof m / sizeof *m;
    for (size_t i = 0; i < n && i < cap; i++) {
        names[i] = m[i].n;
        values[i] = m[i].v;
    }
    return n < cap ? n : cap;
}
