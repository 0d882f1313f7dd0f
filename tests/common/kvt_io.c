/*
 * kvt_io.c — tests/common/kvt_io.h: whole reads and writes, a sleep; and kvt.h's kvt_rmrf, here
 * because this file needs no Criterion (benches link it too).
 */
#include "tests/common/kvt_io.h"
#include "tests/common/kvt.h"

#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* Moves all n bytes between fd and b: a socket with send (MSG_NOSIGNAL) or
 * recv (MSG_WAITALL), anything else with write or read. */
static int io_full(int fd, uint8_t *b, size_t n, bool wr)
{
    bool sock = true;
    while (n > 0) {
        ssize_t k;
        if (sock)
            k = wr ? send(fd, b, n, MSG_NOSIGNAL) : recv(fd, b, n, MSG_WAITALL);
        else
            k = wr ? write(fd, b, n) : read(fd, b, n);
        if (k < 0 && sock && errno == ENOTSOCK) {
            sock = false;
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

int kvt_read_full(int fd, void *dst, size_t n)
{
    return io_full(fd, dst, n, false);
}

int kvt_write_all(int fd, const void *p, size_t n)
{
    return io_full(fd, (uint8_t *)(uintptr_t)p, n, true);
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *f)
{
    (void)sb; (void)flag; (void)f;
    return remove(p);
}

void kvt_rmrf(const char *dir)
{
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

void kvt_sleep_ms(int ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}
