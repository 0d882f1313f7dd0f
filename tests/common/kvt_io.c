/*
 * kvt_io.c — tests/common/kvt_io.h: whole writes.
 */
#include "tests/common/kvt_io.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

int kvt_write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    bool sock = true;
    while (n > 0) {
        ssize_t k = sock ? send(fd, b, n, MSG_NOSIGNAL) : write(fd, b, n);
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
