/*
 * txn.c — the write transactions' payload (txn.h): zero-copy iovecs into
 * destination blocks, or a staging buffer (none for a payload the caller
 * hands to work itself: kvr_put_work_from).
 */
#include "cache/txn.h"

int kvr_wpay_init(kvr_wpay *w, const kvr_brun *runs, size_t n, uint32_t n_layers,
                  size_t payload, bool zero_copy, bool stage)
{
    kvr_payload *p = &w->p;
    p->bytes = payload;
    p->iov = kvr_mem_malloc((zero_copy ? 2u * n_layers * (n ? n : 1) : 1) * sizeof *p->iov);
    if (!p->iov)
        return KVR_ENOMEM;
    if (zero_copy) {
        p->n_iov = kvr_brun_iov(runs, n, n_layers, p->iov);
        return 0;
    }
    w->work = true;
    if (!stage)
        return 0;
    w->staging = kvr_mem_staging(payload);   /* large ones reused: no page faults */
    if (!w->staging)
        return KVR_ENOMEM;
    p->iov[0] = (struct iovec){ w->staging, payload };
    p->n_iov = 1;
    return 0;
}

void kvr_wpay_free(kvr_wpay *w)
{
    kvr_mem_staging_free(w->staging);
    kvr_mem_free(w->p.iov);
    w->staging = NULL;
    w->p.iov = NULL;
}
