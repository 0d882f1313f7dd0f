/*
 * cli_files.c — the files `kvrope put/get` read and write: raw layer-major
 * payloads, token lists, safetensors and NumPy .npy (field by field in
 * docs/formats.md).
 *
 * safetensors (https://github.com/huggingface/safetensors): u64 LE header
 * length N, N bytes of JSON {name: {dtype, shape, data_offsets}}, then the
 * data; offsets are relative to the end of the header and tensors tile the
 * data without holes. kvrope writes
 *   k, v       [layers][tokens][kv_heads][head_dim]  F32 | F16 | BF16
 *   tokens     [tokens]  I32 (U32 if an id needs 32 bits)
 *   positions  [tokens]  I64
 *   flags      [tokens]  I32,  groups [tokens] I32
 * and __metadata__ {format: "kvrope", model, context_id, start}; an assemble
 * adds its segment table (metadata and tensors, see cli_layout.c). The wire's
 * layer-major K|V interleave is undone with iovecs, never a copy: k is the
 * K slab of every layer in turn, then v the V slabs.
 */
#include "client/cli/cli.h"
#include "client/cli/cli_parse.h"
#include "base/iov.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int kvr__cli_errf(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

bool kvr__cli_in_list(const char *const *v, const char *s)
{
    for (size_t i = 0; v[i]; i++)
        if (!strcmp(v[i], s))
            return true;
    return false;
}

const char *kvr__cli_enum_name(const char *const *names, size_t n, int v)
{
    return v >= 0 && (size_t)v < n && names[v] ? names[v] : "?";
}

int kvr__cli_enum_parse(const char *const *names, size_t n, const char *s)
{
    for (size_t i = 0; i < n; i++)
        if (names[i] && !strcmp(names[i], s))
            return (int)i;
    return -1;
}

bool kvr__cli_has_suffix(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcasecmp(s + a - b, suffix) == 0;
}

int kvr__cli_map_file(const char *path, cli_mapped *m, char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    if (strcmp(path, "-") == 0) {   /* stdin: read it all */
        size_t cap = 1 << 16, len = 0;
        uint8_t *buf = malloc(cap);
        for (;;) {
            if (!buf)
                return kvr__cli_errf(err, errlen, "out of memory reading stdin");
            ssize_t r = read(0, buf + len, cap - len);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0) {
                snprintf(err, errlen, "stdin: %s", strerror(errno));
                free(buf);
                return -1;
            }
            if (r == 0)
                break;
            len += (size_t)r;
            if (len == cap) {
                uint8_t *nb = realloc(buf, cap * 2);
                if (!nb)
                    free(buf);
                buf = nb;
                cap *= 2;
            }
        }
        m->base = buf;
        m->len = len;
        return 0;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvr__cli_errf(err, errlen, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: not a regular file", path);
        close(fd);
        return -1;
    }
    m->len = (size_t)st.st_size;
    if (m->len == 0) {
        m->base = NULL;
        close(fd);
        return 0;
    }
    void *p = mmap(NULL, m->len, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return kvr__cli_errf(err, errlen, "%s: mmap: %s", path, strerror(errno));
    (void)madvise(p, m->len, MADV_SEQUENTIAL);
    m->base = p;
    m->mapped = true;
    return 0;
}

void kvr__cli_unmap(cli_mapped *m)
{
    if (m->mapped && m->base)
        munmap(m->base, m->len);
    else
        free(m->base);
    memset(m, 0, sizeof *m);
}

/* ---- number lists ------------------------------------------------------- */

static long parse_list(const char *s, void **out, bool is_i64)
{
    size_t cap = 16, n = 0, es = is_i64 ? sizeof(int64_t) : sizeof(uint32_t);
    uint8_t *arr = malloc(cap * es);
    if (!arr)
        return -1;
    const char *p = s;
    for (;;) {
        while (*p && (*p == ',' || *p == ' ' || *p == '\n' || *p == '\t' || *p == '\r' ||
                      *p == '[' || *p == ']'))
            p++;
        if (!*p)
            break;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || (!is_i64 && (v < 0 || v > (long long)UINT32_MAX))) {
            free(arr);
            return -1;
        }
        if (n == cap) {
            uint8_t *na = realloc(arr, cap * 2 * es);
            if (!na) {
                free(arr);
                return -1;
            }
            arr = na;
            cap *= 2;
        }
        if (is_i64) {
            int64_t x = v;
            memcpy(arr + n * es, &x, es);
        } else {
            uint32_t x = (uint32_t)v;
            memcpy(arr + n * es, &x, es);
        }
        n++;
        p = end;
    }
    *out = arr;
    return (long)n;
}

long kvr__cli_parse_u32_list(const char *s, uint32_t **out)
{
    void *p = NULL;
    long n = parse_list(s, &p, false);
    *out = p;
    return n;
}

/* Here, beside the parsers that use it, so that the fuzzers (which link
 * only the parsing files) have it. */
int kvr__cli_usage_err(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvrope: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(see kvrope --help)\n");
    va_end(ap);
    return CLI_USAGE;
}

int kvr__cli_opt_layers(const char *ls, uint32_t **layers, size_t *n)
{
    if (!ls)
        return CLI_OK;
    long k = kvr__cli_parse_u32_list(ls, layers);
    if (k < 0)
        return kvr__cli_usage_err("--layers: want comma-separated layer indexes");
    *n = (size_t)k;
    return CLI_OK;
}

long kvr__cli_parse_i64_list(const char *s, int64_t **out)
{
    void *p = NULL;
    long n = parse_list(s, &p, true);
    *out = p;
    return n;
}

long kvr__cli_read_tokens_file(const char *path, uint32_t **out, char *err, size_t errlen)
{
    cli_mapped m;
    if (kvr__cli_map_file(path, &m, err, errlen) < 0)
        return -1;
    long n;
    if (kvr__cli_has_suffix(path, ".npy")) {
        cli_npy a;
        char why[300];
        n = -1;
        if (kvr__cli_npy_parse(m.base, m.len, &a, why, sizeof why) < 0) {
            snprintf(err, errlen, "%s: %s", path, why);
        } else if (a.ndim != 1 || a.descr[1] == 'f' || a.elem == 1) {
            snprintf(err, errlen, "%s: token ids must be a 1-D integer array (int32, uint32 or "
                     "int64), not '%s' with %d dimensions", path, a.descr, a.ndim);
        } else if ((*out = malloc(a.count ? a.count * sizeof **out : 1)) != NULL) {
            n = (long)a.count;
            for (size_t i = 0; i < a.count; i++) {
                int64_t v = 0;
                if (a.elem == 4 && a.descr[1] == 'i') {
                    int32_t x;
                    memcpy(&x, a.data + 4 * i, 4);
                    v = x;
                } else if (a.elem == 4) {
                    uint32_t x;
                    memcpy(&x, a.data + 4 * i, 4);
                    v = x;
                } else {
                    memcpy(&v, a.data + 8 * i, 8);
                }
                if (v < 0 || v > (int64_t)UINT32_MAX) {
                    snprintf(err, errlen, "%s: token id %lld out of range", path, (long long)v);
                    free(*out);
                    *out = NULL;
                    n = -1;
                    break;
                }
                (*out)[i] = (uint32_t)v;
            }
        }
    } else if (kvr__cli_has_suffix(path, ".bin")) {
        if (m.len % 4) {
            snprintf(err, errlen, "%s: size is not a multiple of 4", path);
            kvr__cli_unmap(&m);
            return -1;
        }
        n = (long)(m.len / 4);
        *out = malloc(m.len ? m.len : 1);
        if (*out && m.len)
            memcpy(*out, m.base, m.len);
    } else {
        char *txt = malloc(m.len + 1);
        if (txt) {
            if (m.len)
                memcpy(txt, m.base, m.len);
            txt[m.len] = 0;
        }
        n = txt ? kvr__cli_parse_u32_list(txt, out) : -1;
        free(txt);
        if (n < 0)
            snprintf(err, errlen, "%s: expected token ids (unsigned integers)", path);
    }
    kvr__cli_unmap(&m);
    return n;
}

/* ---- .npy --------------------------------------------------------------- */
/* NumPy's format (numpy.lib.format): "\x93NUMPY", major, minor, a header
 * length (u16 LE in version 1, u32 LE in 2 and 3), then that many bytes of a
 * Python dict literal {'descr': '<f2', 'fortran_order': False, 'shape': (..)}
 * padded with spaces to a multiple of 64 and ended by '\n'; the data follow,
 * C order. Only little-endian (or byte-sized) descr and C order are taken. */

static const struct { const char *descr; size_t size; } npy_types[] = {
    { "<f4", 4 }, { "<f2", 2 }, { "<i4", 4 }, { "<u4", 4 }, { "<i8", 8 }, { "<u8", 8 },
    { "|u1", 1 }, { "|i1", 1 },
};

int kvr__cli_npy_parse(const void *buf, size_t len, cli_npy *n, char *err, size_t errlen)
{
    const uint8_t *b = buf;
    memset(n, 0, sizeof *n);
    if (len < 10 || memcmp(b, "\x93NUMPY", 6) != 0)
        return kvr__cli_errf(err, errlen, "not a .npy file (no \\x93NUMPY magic)");
    size_t hlen, hoff;
    if (b[6] == 1) {
        hlen = (size_t)b[8] | (size_t)b[9] << 8;
        hoff = 10;
    } else if (b[6] == 2 || b[6] == 3) {
        if (len < 12)
            return kvr__cli_errf(err, errlen, "truncated .npy header");
        hlen = (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24;
        hoff = 12;
    } else {
        return kvr__cli_errf(err, errlen, ".npy version %u.%u is not supported (1, 2 or 3)", b[6],
                             b[7]);
    }
    if (hlen > len - hoff || hlen > 65536)
        return kvr__cli_errf(err, errlen, "truncated .npy header");
    char h[65537];
    memcpy(h, b + hoff, hlen);
    h[hlen] = 0;
    const char *d = strstr(h, "'descr'"), *f = strstr(h, "'fortran_order'"),
               *sh = strstr(h, "'shape'");
    if (!d || !f || !sh)
        return kvr__cli_errf(err, errlen, ".npy header lacks descr, fortran_order or shape");
    d = strchr(d + 7, '\'');
    if (!d)
        return kvr__cli_errf(err, errlen, ".npy header: bad descr");
    d++;
    const char *de = strchr(d, '\'');
    if (!de || de - d >= (ptrdiff_t)sizeof n->descr)
        return kvr__cli_errf(err, errlen, ".npy header: bad descr");
    memcpy(n->descr, d, (size_t)(de - d));
    n->descr[de - d] = 0;
    if (n->descr[0] == '=')   /* native order: little-endian on every host we build for */
        n->descr[0] = '<';
    for (size_t i = 0; i < sizeof npy_types / sizeof npy_types[0]; i++)
        if (!strcmp(n->descr, npy_types[i].descr))
            n->elem = npy_types[i].size;
    if (!n->elem)
        return kvr__cli_errf(err, errlen, ".npy dtype '%s' is not supported (float32 '<f4', "
                             "float16 '<f2', int32/uint32/int64 for ids)", n->descr);
    f += 15;
    while (*f == ' ' || *f == ':')
        f++;
    if (strncmp(f, "False", 5) != 0)
        return kvr__cli_errf(err, errlen,
                             ".npy in Fortran order: save it C-contiguous (np.ascontiguousarray)");
    sh = strchr(sh + 7, '(');
    if (!sh)
        return kvr__cli_errf(err, errlen, ".npy header: bad shape");
    sh++;
    size_t count = 1;
    for (;;) {
        while (*sh == ' ' || *sh == ',')
            sh++;
        if (*sh == ')')
            break;
        char *end;
        errno = 0;
        unsigned long long v = strtoull(sh, &end, 10);
        if (end == sh || errno || n->ndim == CLI_NPY_MAX_DIMS || v > (1ull << 40) ||
            (v && count > SIZE_MAX / v))
            return kvr__cli_errf(err, errlen, ".npy header: bad shape (at most %d dimensions)",
                                 CLI_NPY_MAX_DIMS);
        n->shape[n->ndim++] = (size_t)v;
        count *= (size_t)v;
        sh = end;
    }
    size_t off = hoff + hlen;
    if (count > SIZE_MAX / n->elem || len - off != count * n->elem)
        return kvr__cli_errf(err, errlen,
                             ".npy data: %zu bytes after the header, the shape needs %zu",
                             len - off, count > SIZE_MAX / n->elem ? SIZE_MAX : count * n->elem);
    n->data = b + off;
    n->data_len = len - off;
    n->count = count;
    return 0;
}

int kvr__cli_npy_read(const char *path, cli_npy *n, char *err, size_t errlen)
{
    cli_mapped m;
    if (kvr__cli_map_file(path, &m, err, errlen) < 0)
        return -1;
    char why[300];
    if (kvr__cli_npy_parse(m.base, m.len, n, why, sizeof why) < 0) {
        snprintf(err, errlen, "%s: %s", path, why);
        kvr__cli_unmap(&m);
        return -1;
    }
    n->file = m;
    return 0;
}

int kvr__cli_npy_kv_shape(const cli_npy *n, const char *path, kvr_dtype *dt, uint32_t *layers,
                     size_t *tokens, uint32_t *heads, uint32_t *dim, char *err, size_t errlen)
{
    if (!strcmp(n->descr, "<f4"))
        *dt = KVR_DTYPE_F32;
    else if (!strcmp(n->descr, "<f2"))
        *dt = KVR_DTYPE_F16;
    else
        return kvr__cli_errf(err, errlen, "%s: KV must be float32 or float16, not '%s'", path,
                             n->descr);
    if (n->ndim != 5 || n->shape[1] != 2 || n->shape[0] > UINT32_MAX ||
        n->shape[3] > UINT32_MAX || n->shape[4] > UINT32_MAX)
        return kvr__cli_errf(err, errlen, "%s: KV must have shape [layers, 2, tokens, kv_heads, "
                             "head_dim] (K then V per layer, docs/formats.md)", path);
    *layers = (uint32_t)n->shape[0];
    *tokens = n->shape[2];
    *heads = (uint32_t)n->shape[3];
    *dim = (uint32_t)n->shape[4];
    return 0;
}

void kvr__cli_npy_free(cli_npy *n)
{
    kvr__cli_unmap(&n->file);
    memset(n, 0, sizeof *n);
}

int kvr__cli_npy_write(const char *path, const char *descr, const size_t *shape, int ndim,
                  struct iovec *iov, size_t n_iov, char *err, size_t errlen)
{
    char dims[200] = "";
    size_t o = 0;
    for (int i = 0; i < ndim && o < sizeof dims; i++)
        o += (size_t)snprintf(dims + o, sizeof dims - o, "%zu%s", shape[i],
                              ndim == 1 ? "," : i + 1 < ndim ? ", " : "");
    char h[320];
    int hl = snprintf(h, sizeof h, "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }",
                      descr, dims);
    if (hl < 0 || (size_t)hl + 10 + 64 > sizeof h)
        return kvr__cli_errf(err, errlen, "%s: .npy header too long", path);
    size_t total = 10 + (size_t)hl + 1;
    size_t pad = (64 - total % 64) % 64;
    memset(h + hl, ' ', pad);
    h[(size_t)hl + pad] = '\n';
    size_t hlen = (size_t)hl + pad + 1;
    uint8_t pre[10] = { 0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (uint8_t)(hlen & 0xff),
                        (uint8_t)(hlen >> 8) };
    struct iovec *all = malloc((n_iov + 2) * sizeof *all);
    if (!all)
        return kvr__cli_errf(err, errlen, "out of memory");
    all[0] = (struct iovec){ pre, sizeof pre };
    all[1] = (struct iovec){ h, hlen };
    if (n_iov)
        memcpy(all + 2, iov, n_iov * sizeof *all);
    int rc = kvr__cli_write_iov(path, all, n_iov + 2, err, errlen);
    free(all);
    return rc;
}

/* ---- writing ------------------------------------------------------------ */

int kvr__cli_write_iov(const char *path, struct iovec *iov, size_t n, char *err, size_t errlen)
{
    int fd = strcmp(path, "-") == 0 ? 1 : open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return kvr__cli_errf(err, errlen, "%s: %s", path, strerror(errno));
    size_t i = 0;
    int rc = 0;
    while (i < n) {
        if (iov[i].iov_len == 0) {
            i++;
            continue;
        }
        ssize_t w = writev(fd, iov + i, (int)(n - i > IOV_MAX ? IOV_MAX : n - i));
        if (w < 0) {
            if (errno == EINTR)
                continue;
            snprintf(err, errlen, "%s: %s", path, strerror(errno));
            rc = -1;
            break;
        }
        kvr_iov_advance(iov, n, &i, (size_t)w);
    }
    if (fd != 1 && close(fd) < 0 && rc == 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        rc = -1;
    }
    return rc;
}

/* safetensors' names of the K/V dtypes (kvr_dtype_name's, in capitals):
 * written by st_dtype_name, read back by st_dtype_parse. */
static const char *const ST_DTYPES[] = {
    [KVR_DTYPE_F32] = "F32", [KVR_DTYPE_F16] = "F16", [KVR_DTYPE_BF16] = "BF16",
};

static const char *st_dtype_name(kvr_dtype t)
{
    return kvr__cli_enum_name(ST_DTYPES, CLI_COUNT(ST_DTYPES), (int)t);
}

static void add_tensor(cJSON *root, const char *name, const char *dtype, const size_t *shape,
                       int ndim, size_t *off, size_t bytes)
{
    cJSON *t = cJSON_AddObjectToObject(root, name);
    cJSON_AddStringToObject(t, "dtype", dtype);
    cJSON *sh = cJSON_AddArrayToObject(t, "shape");
    for (int i = 0; i < ndim; i++)
        cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)shape[i]));
    cJSON *o = cJSON_AddArrayToObject(t, "data_offsets");
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)*off));
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(*off + bytes)));
    *off += bytes;
}

int kvr__cli_st_write(const char *path, const kvr_kv *kv, char *err, size_t errlen)
{
    return kvr__cli_st_write_ex(path, kv, NULL, 0, NULL, 0, err, errlen);
}

int kvr__cli_st_write_ex(const char *path, const kvr_kv *kv, const char *const *extra_meta,
                    size_t n_meta, const cli_st_extra *extra, size_t n_extra, char *err,
                    size_t errlen)
{
    size_t n = kv->n_tokens, L = kv->n_layers;
    size_t slab = kvr_payload_size(1, n, kv->n_kv_heads, kv->head_dim, kv->dtype) / 2;
    bool need_u32 = false;
    for (size_t i = 0; i < n; i++)
        if (kv->tokens[i] > INT32_MAX)
            need_u32 = true;
    cJSON *root = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
    char buf[64];
    cJSON_AddStringToObject(meta, "format", "kvrope");
    cJSON_AddStringToObject(meta, "model", kv->model);
    cJSON_AddStringToObject(meta, "context_id", kv->ctx_id);
    snprintf(buf, sizeof buf, "%llu", (unsigned long long)kv->start);
    cJSON_AddStringToObject(meta, "start", buf);
    for (size_t i = 0; i < n_meta; i++)
        cJSON_AddStringToObject(meta, extra_meta[2 * i], extra_meta[2 * i + 1]);
    size_t off = 0;
    size_t shape[4] = { L, n, kv->n_kv_heads, kv->head_dim };
    add_tensor(root, "k", st_dtype_name(kv->dtype), shape, 4, &off, L * slab);
    add_tensor(root, "v", st_dtype_name(kv->dtype), shape, 4, &off, L * slab);
    add_tensor(root, "tokens", need_u32 ? "U32" : "I32", &n, 1, &off, n * 4);
    add_tensor(root, "positions", "I64", &n, 1, &off, n * 8);
    add_tensor(root, "flags", "I32", &n, 1, &off, n * 4);
    add_tensor(root, "groups", "I32", &n, 1, &off, n * 4);
    for (size_t i = 0; i < n_extra; i++)
        add_tensor(root, extra[i].name, extra[i].dtype, extra[i].shape, extra[i].ndim, &off,
                   extra[i].bytes);
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!json)
        return kvr__cli_errf(err, errlen, "out of memory");
    size_t jl = strlen(json), padded = (jl + 7) & ~(size_t)7;
    char *hdr = malloc(8 + padded);
    struct iovec *iov = malloc((2 * L + 6 + n_extra) * sizeof *iov);
    if (!hdr || !iov) {
        free(json);
        free(hdr);
        free(iov);
        return kvr__cli_errf(err, errlen, "out of memory");
    }
    uint64_t hl = padded;
    for (int i = 0; i < 8; i++)
        hdr[i] = (char)(hl >> (8 * i));
    memcpy(hdr + 8, json, jl);
    memset(hdr + 8 + jl, ' ', padded - jl);
    free(json);
    size_t k = 0;
    iov[k++] = (struct iovec){ hdr, 8 + padded };
    for (size_t l = 0; l < L; l++)
        iov[k++] = (struct iovec){ (void *)(uintptr_t)kvr_kv_k(kv, l), slab };
    for (size_t l = 0; l < L; l++)
        iov[k++] = (struct iovec){ (void *)(uintptr_t)kvr_kv_v(kv, l), slab };
    iov[k++] = (struct iovec){ kv->tokens, n * 4 };
    iov[k++] = (struct iovec){ kv->positions, n * 8 };
    iov[k++] = (struct iovec){ kv->flags, n * 4 };
    iov[k++] = (struct iovec){ kv->groups, n * 4 };
    for (size_t i = 0; i < n_extra; i++)
        iov[k++] = (struct iovec){ (void *)(uintptr_t)extra[i].data, extra[i].bytes };
    int rc = kvr__cli_write_iov(path, iov, k, err, errlen);
    free(hdr);
    free(iov);
    return rc;
}

/* ---- reading ------------------------------------------------------------ */

typedef struct st_tensor {
    const char    *dtype;
    size_t         shape[8];
    int            ndim;
    const uint8_t *data;
    size_t         bytes;
} st_tensor;

static int st_find(const cJSON *root, const char *name, const uint8_t *data, size_t data_len,
                   st_tensor *t, char *err, size_t errlen)
{
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!o)
        return 1;
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(o, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(o, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(o, "data_offsets");
    if (!cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(off) ||
        cJSON_GetArraySize(off) != 2 || cJSON_GetArraySize(sh) > 8)
        return kvr__cli_errf(err, errlen, "tensor '%s': malformed entry", name);
    t->dtype = dt->valuestring;
    t->ndim = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, sh) {
        if (!cJSON_IsNumber(d) || d->valuedouble < 0)
            return kvr__cli_errf(err, errlen, "tensor '%s': bad shape", name);
        t->shape[t->ndim++] = (size_t)d->valuedouble;
    }
    double a = cJSON_GetArrayItem(off, 0)->valuedouble, b = cJSON_GetArrayItem(off, 1)->valuedouble;
    if (!(a >= 0 && b >= a && b <= (double)data_len))
        return kvr__cli_errf(err, errlen, "tensor '%s': data offsets out of the file", name);
    t->data = data + (size_t)a;
    t->bytes = (size_t)b - (size_t)a;
    return 0;
}

static int st_dtype_parse(const char *s, kvr_dtype *out)
{
    int v = kvr__cli_enum_parse(ST_DTYPES, CLI_COUNT(ST_DTYPES), s);
    if (v < 0)
        return -1;
    *out = (kvr_dtype)v;
    return 0;
}

/* Integer vector of n entries of I32/U32/I64/U64 into int64. */
static int st_ints(const st_tensor *t, size_t n, int64_t *out, const char *name, char *err,
                   size_t errlen)
{
    size_t es = (!strcmp(t->dtype, "I32") || !strcmp(t->dtype, "U32")) ? 4
              : (!strcmp(t->dtype, "I64") || !strcmp(t->dtype, "U64")) ? 8 : 0;
    if (!es || t->ndim != 1 || t->shape[0] != n || t->bytes != n * es)
        return kvr__cli_errf(err, errlen, "tensor '%s': want [%zu] of I32/U32/I64/U64", name, n);
    for (size_t i = 0; i < n; i++) {
        if (es == 4) {
            uint32_t u;
            memcpy(&u, t->data + 4 * i, 4);
            out[i] = t->dtype[0] == 'I' ? (int64_t)(int32_t)u : (int64_t)u;
        } else {
            memcpy(&out[i], t->data + 8 * i, 8);
        }
    }
    return 0;
}

void kvr__cli_st_free(cli_st_kv *st)
{
    kvr__cli_unmap(&st->file);
    free(st->tokens);
    free(st->positions);
    memset(st, 0, sizeof *st);
}

/* The optional integer tensor `name` (n entries) into out: 0, 1 when the file
 * has none, -1 with err set (naming path). */
static int st_opt_ints(const cJSON *root, const char *name, const uint8_t *data, size_t data_len,
                       size_t n, int64_t *out, const char *path, char *err, size_t errlen)
{
    st_tensor t;
    char e2[200] = "";
    int r = st_find(root, name, data, data_len, &t, e2, sizeof e2);
    if (r < 0 || (r == 0 && st_ints(&t, n, out, name, e2, sizeof e2) < 0))
        return kvr__cli_errf(err, errlen, "%s: %s", path, e2);
    return r;
}

/* The parse of a safetensors image base[0..len) (borrowed: st->k/v point
 * into it); path names it in messages. On failure st is freed. */
static int st_parse(cli_st_kv *st, const uint8_t *base, size_t len, const char *path,
                    char *err, size_t errlen)
{
    uint64_t hl = 0;
    if (len < 8) {
        snprintf(err, errlen, "%s: too short for safetensors", path);
        goto fail;
    }
    for (int i = 0; i < 8; i++)
        hl |= (uint64_t)base[i] << (8 * i);
    if (hl > len - 8 || hl > (100u << 20)) {
        snprintf(err, errlen, "%s: bad safetensors header length", path);
        goto fail;
    }
    cJSON *root = cJSON_ParseWithLength((const char *)base + 8, (size_t)hl);
    if (!root) {
        snprintf(err, errlen, "%s: header is not JSON", path);
        goto fail;
    }
    const uint8_t *data = base + 8 + hl;
    size_t data_len = len - 8 - (size_t)hl;
    st_tensor k, v;
    char e2[200] = "";
    int rk = st_find(root, "k", data, data_len, &k, e2, sizeof e2);
    int rv = rk == 0 ? st_find(root, "v", data, data_len, &v, e2, sizeof e2) : rk;
    if (rk || rv) {
        snprintf(err, errlen, "%s: %s", path, e2[0] ? e2 : "needs tensors 'k' and 'v'");
        goto fail_json;
    }
    if (st_dtype_parse(k.dtype, &st->dtype) < 0 || strcmp(k.dtype, v.dtype) != 0 ||
        k.ndim != 4 || v.ndim != 4 || memcmp(k.shape, v.shape, 4 * sizeof k.shape[0]) != 0) {
        snprintf(err, errlen, "%s: 'k' and 'v' must be F32/F16/BF16 of the same shape "
                 "[layers][tokens][heads][head_dim]", path);
        goto fail_json;
    }
    if (k.shape[0] > UINT32_MAX || k.shape[2] > UINT32_MAX || k.shape[3] > UINT32_MAX) {
        snprintf(err, errlen, "%s: shape too large", path);
        goto fail_json;
    }
    st->n_layers = (uint32_t)k.shape[0];
    st->n_tokens = k.shape[1];
    st->n_heads = (uint32_t)k.shape[2];
    st->head_dim = (uint32_t)k.shape[3];
    size_t want = kvr_payload_size(st->n_layers, st->n_tokens, st->n_heads, st->head_dim,
                                   st->dtype) / 2;
    if (k.bytes != want || v.bytes != want) {
        snprintf(err, errlen, "%s: 'k'/'v' byte size does not match the shape", path);
        goto fail_json;
    }
    st->k = k.data;
    st->v = v.data;
    size_t n = st->n_tokens;
    int64_t *tmp = malloc((n ? n : 1) * sizeof *tmp);
    if (!tmp) {
        snprintf(err, errlen, "out of memory");
        goto fail_json;
    }
    int rt = st_opt_ints(root, "tokens", data, data_len, n, tmp, path, err, errlen);
    if (rt < 0) {
        free(tmp);
        goto fail_json;
    }
    if (rt == 0) {
        st->tokens = malloc((n ? n : 1) * sizeof *st->tokens);
        for (size_t i = 0; st->tokens && i < n; i++) {
            if (tmp[i] < 0 || tmp[i] > (int64_t)UINT32_MAX) {
                snprintf(err, errlen, "%s: token id out of range at %zu", path, i);
                free(tmp);
                goto fail_json;
            }
            st->tokens[i] = (uint32_t)tmp[i];
        }
    }
    int rp = st_opt_ints(root, "positions", data, data_len, n, tmp, path, err, errlen);
    if (rp < 0) {
        free(tmp);
        goto fail_json;
    }
    if (rp == 0) {
        st->positions = tmp;
        tmp = NULL;
    }
    free(tmp);
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
    const cJSON *mm = meta ? cJSON_GetObjectItemCaseSensitive(meta, "model") : NULL;
    if (cJSON_IsString(mm))
        snprintf(st->model, sizeof st->model, "%s", mm->valuestring);
    cJSON_Delete(root);
    return 0;
fail_json:
    cJSON_Delete(root);
fail:
    kvr__cli_st_free(st);
    return -1;
}

int kvr__cli_st_read(const char *path, cli_st_kv *st, char *err, size_t errlen)
{
    memset(st, 0, sizeof *st);
    if (kvr__cli_map_file(path, &st->file, err, errlen) < 0)
        return -1;
    return st_parse(st, st->file.base, st->file.len, path, err, errlen);
}

int kvr__cli_st_parse(const void *buf, size_t len, cli_st_kv *st, char *err, size_t errlen)
{
    memset(st, 0, sizeof *st);
    return st_parse(st, buf, len, "safetensors", err, errlen);
}
