/*
 * kvt_io.h — whole reads and writes on a descriptor and a sleep, for the tests and benches that
 * speak raw bytes to a daemon. Compiled into libtestcommon.a
 * (tests/common/kvt_io.c), which needs no Criterion: benches may link it.
 */
#ifndef KVR_TESTS_KVT_IO_H
#define KVR_TESTS_KVT_IO_H

#include <stddef.h>

/* Writes all n bytes of p to fd, retrying short writes and EINTR; 0, or
 * -1 (errno set) if fd failed or closed first. A socket is written with
 * MSG_NOSIGNAL, so a peer that has gone is an error here, never SIGPIPE. */
int kvt_write_all(int fd, const void *p, size_t n);

/* Reads exactly n bytes from fd into dst (retrying short reads and EINTR);
 * 0, or -1 if fd failed or reached its end first. */
int kvt_read_full(int fd, void *dst, size_t n);

/* Sleeps ms milliseconds (the whole of them, through EINTR). */
void kvt_sleep_ms(int ms);

#endif
