/*
 * iov.h — what every partial writev/sendmsg loop does after a short write:
 * steps over the iovecs written whole and trims the one written in part, so
 * that iov + *i is what is left to send.
 *
 * Invariant: w is at most the bytes of iov[*i..n) (what the kernel reported
 * for that array).
 *
 * Header only (inline).
 */
#ifndef KVR_BASE_IOV_H
#define KVR_BASE_IOV_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

static inline void kvr_iov_advance(struct iovec *iov, size_t n, size_t *i, size_t w)
{
    while (*i < n && w >= iov[*i].iov_len) {
        w -= iov[*i].iov_len;
        (*i)++;
    }
    if (*i < n) {
        iov[*i].iov_base = (uint8_t *)iov[*i].iov_base + w;
        iov[*i].iov_len -= w;
    }
}

#endif /* KVR_BASE_IOV_H */
