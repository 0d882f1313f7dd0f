/*
 * kvt.c — tests/common/kvt.h: temporary directories, deterministic bytes,
 * whole files. Every failure is a Criterion assertion in the calling test.
 */
#include "tests/common/kvt.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/uio.h>

void kvt_tmpdir(char *buf, size_t cap, const char *name)
{
    const char *t = getenv("TMPDIR");
    int n = snprintf(buf, cap, "%s/%s-XXXXXX", t && *t ? t : "/tmp", name);
    cr_assert(n > 0 && (size_t)n < cap, "temporary directory name too long: %s", buf);
    cr_assert_not_null(mkdtemp(buf), "mkdtemp %s", buf);
}

void kvt_fill(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x2545F4914F6CDD1Dull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        p[i] = (uint8_t)s;
    }
}

void kvt_iota(uint32_t *t, size_t n, uint32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (uint32_t)i;
}

void kvt_write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n, "short write to %s", path);
    cr_assert_eq(fclose(f), 0, "%s", path);
}

void *kvt_read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    cr_assert_geq(len, 0, "%s", path);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)len + 1);
    cr_assert_not_null(b);
    cr_assert_eq(fread(b, 1, (size_t)len, f), (size_t)len, "short read of %s", path);
    fclose(f);
    b[len] = 0;
    *n = (size_t)len;
    return b;
}

int kvt_free_tcp_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(s, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    cr_assert_eq(bind(s, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t l = sizeof a;
    getsockname(s, (struct sockaddr *)&a, &l);
    close(s);
    return ntohs(a.sin_port);
}

char *kvt_slurp(const char *path, size_t *len)
{
    if (access(path, R_OK) != 0)
        return NULL;
    size_t n;
    char *b = kvt_read_file(path, &n);
    if (len)
        *len = n;
    return b;
}

const char *kvt_vectors_dir(void)
{
    const char *v = getenv("KVR_VECTORS");
    return v && *v ? v : "../shared/vectors";
}

bool kvt_same_f32(float a, float b)
{
    return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0;
}

bool kvt_same_f16(uint16_t a, uint16_t b)
{
    bool na = (a & 0x7c00) == 0x7c00 && (a & 0x3ff), nb = (b & 0x7c00) == 0x7c00 && (b & 0x3ff);
    return (na && nb) || a == b;
}

uint64_t kvt_fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 1099511628211ull;
    }
    return h;
}

size_t kvt_gather(void *dst, const struct iovec *iov, size_t niov)
{
    size_t off = 0;
    for (size_t i = 0; i < niov; i++) {
        memcpy((uint8_t *)dst + off, iov[i].iov_base, iov[i].iov_len);
        off += iov[i].iov_len;
    }
    return off;
}

int kvt_count_fds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    cr_assert_not_null(d, "%s", path);
    int n = 0;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

int kvt_unix_connect(const char *path, int rcv_timeout_s)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    size_t sl = strlen(path);
    cr_assert_lt(sl, sizeof sa.sun_path, "socket path too long: %s", path);
    memcpy(sa.sun_path, path, sl + 1);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0, "connect %s", path);
    if (rcv_timeout_s > 0) {
        struct timeval tv = { rcv_timeout_s, 0 };
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    }
    return fd;
}

ssize_t kvt_send_fds(int fd, const void *buf, size_t len, int pass, int copies)
{
    struct iovec iov = { (void *)(uintptr_t)buf, len };
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(253 * sizeof(int))];
    } cm;
    memset(&cm, 0, sizeof cm);
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
    if (copies > 0) {
        cr_assert_leq(copies, 253);
        mh.msg_control = cm.b;
        mh.msg_controllen = CMSG_SPACE((size_t)copies * sizeof(int));
        struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
        h->cmsg_level = SOL_SOCKET;
        h->cmsg_type = SCM_RIGHTS;
        h->cmsg_len = CMSG_LEN((size_t)copies * sizeof(int));
        for (int i = 0; i < copies; i++)
            memcpy(CMSG_DATA(h) + (size_t)i * sizeof(int), &pass, sizeof(int));
    }
    return sendmsg(fd, &mh, MSG_NOSIGNAL);
}
