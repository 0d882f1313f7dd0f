/*
 * disk_io.c — the disk tier's two I/O engines behind one small interface:
 * io_uring (liburing; a batch of readv/writev requests is one submission)
 * and plain POSIX preadv/pwritev/fdatasync, used when io_uring is refused
 * (ENOSYS on old kernels, EPERM under seccomp) or forced.
 *
 * Invariants: a request's result is 0 only when every byte was transferred;
 * short transfers are finished synchronously (io_uring may return partial
 * counts), and a write that makes no progress is ENOSPC, a read that hits
 * end of file EIO. The fault hook sits in front of both engines, so tests
 * exercise the callers' error paths identically for each. A kvr_dio is not
 * thread-safe: disk.c serialises calls with its mutex.
 *
 * Streams (kvr_dio_push / kvr_dio_reap) let the caller fill the next
 * buffers while the device works on the queued ones, and keep the device's
 * queue fed across the caller's scheduling delays: io_uring submits each
 * request as it is pushed; POSIX queues it to one persistent I/O thread of
 * the engine (created at the first push, joined at destroy), which runs
 * the queue in order exactly as kvr_dio_run would (faults, short
 * transfers, counters; the caller touches that state only through the
 * io_uring path, never while the thread runs). Reaps are oldest first.
 * A push that wakes the sleeping thread (a batch's first request) yields
 * the CPU once: the woken thread otherwise waited behind the caller's
 * checksum work for the rest of its time slice (~0.9 ms per 32 MiB batch
 * on a loaded 2-core VM, the device idle meanwhile), and with the yield it
 * starts the request and sleeps in the kernel at once (interleaved A/B of
 * spills against plain O_DIRECT writes, 8 passes: 0.93-0.96x with, 0.87-
 * 0.88x without; KVR_DISK_POSIX_NO_YIELD=1 turns it off for comparisons).
 * Polling the empty queue 300 us before sleeping, or a second thread (two
 * requests on the device), measured worse there (0.83x / 0.86x against
 * 0.89-0.92x), so neither is done.
 */
#include <errno.h>
#include <liburing.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/disk.h"

struct kvr_dio {
    bool            uring;
    struct io_uring ring;
    uint32_t        depth;
    unsigned        f_ops;
    uint64_t        f_countdown, f_count;
    int             f_err;
    uint64_t        f_fired;
    uint64_t        n_w, n_r, n_f, bw, br;
    unsigned        g_nsub;        /* kvr_dio_run: submitted, not reaped */
    /* the stream (kvr_dio_push / kvr_dio_reap), oldest first */
    kvr_dio_req    *s_q[KVR_DIO_STREAM_MAX];
    size_t          s_head, s_n, s_inring;
    /* the POSIX engine's I/O thread and its queue */
    bool            th_on, th_quit, th_sleep;
    kvr_dio_req    *th_q[KVR_DIO_STREAM_MAX];
    size_t          th_qh, th_qn;
    pthread_t       th;
    pthread_mutex_t th_mu;
    pthread_cond_t  th_cv;
};

static int run_posix(kvr_dio *io, kvr_dio_req *r, size_t n);

int kvr_dio_create(kvr_dio **out, kvr_disk_engine engine, uint32_t depth,
                   char *note, size_t note_cap, kvr_error *err)
{
    kvr_dio *io = kvr_mem_calloc(1, sizeof *io);
    if (!io)
        return kvr_error_set(err, KVR_ENOMEM, "disk: out of memory for the I/O engine");
    io->depth = depth ? depth : 64;
    pthread_mutex_init(&io->th_mu, NULL);
    pthread_cond_init(&io->th_cv, NULL);
    if (note_cap)
        note[0] = '\0';
    if (engine != KVR_DISK_ENGINE_POSIX) {
        int rc = io_uring_queue_init(io->depth, &io->ring, 0);
        if (rc == 0) {
            io->uring = true;
        } else if (engine == KVR_DISK_ENGINE_URING) {
            pthread_cond_destroy(&io->th_cv);
            pthread_mutex_destroy(&io->th_mu);
            kvr_mem_free(io);
            return kvr_error_sys(err, KVR_EUNSUPPORTED, -rc, "disk: io_uring unavailable");
        } else if (note_cap) {
            snprintf(note, note_cap, "io_uring refused (%s), using posix",
                     strerror(-rc));
        }
    } else if (note_cap) {
        snprintf(note, note_cap, "posix forced");
    }
    *out = io;
    return 0;
}

void kvr_dio_destroy(kvr_dio *io)
{
    if (!io)
        return;
    while (io->s_n)
        (void)kvr_dio_reap(io);
    if (io->th_on) {
        pthread_mutex_lock(&io->th_mu);
        io->th_quit = true;
        pthread_cond_broadcast(&io->th_cv);
        pthread_mutex_unlock(&io->th_mu);
        pthread_join(io->th, NULL);
    }
    pthread_cond_destroy(&io->th_cv);
    pthread_mutex_destroy(&io->th_mu);
    if (io->uring)
        io_uring_queue_exit(&io->ring);
    kvr_mem_free(io);
}

const char *kvr_dio_name(const kvr_dio *io)
{
    return io->uring ? "io_uring" : "posix";
}

bool kvr_dio_async(const kvr_dio *io)
{
    return io->uring;
}

void kvr_dio_fault_set(kvr_dio *io, unsigned ops, uint64_t nth, int err_no,
                       uint64_t count)
{
    io->f_ops = ops;
    io->f_countdown = nth ? nth : 1;
    io->f_err = err_no;
    io->f_count = count;
    io->f_fired = 0;
}

uint64_t kvr_dio_fault_fired(const kvr_dio *io)
{
    return io->f_fired;
}

void kvr_dio_counts(const kvr_dio *io, uint64_t *writes, uint64_t *reads,
                    uint64_t *fsyncs, uint64_t *bw, uint64_t *br)
{
    *writes = io->n_w;
    *reads = io->n_r;
    *fsyncs = io->n_f;
    *bw = io->bw;
    *br = io->br;
}

/* Whether this operation is one the test asked to fail. */
static bool fault_take(kvr_dio *io, unsigned op)
{
    if (!(io->f_ops & op) || io->f_count == 0)
        return false;
    if (--io->f_countdown > 0)
        return false;
    io->f_count--;
    io->f_countdown = 1;
    io->f_fired++;
    return true;
}

/* 0, or -errno if this operation is one the test asked to fail. */
static int fault_hit(kvr_dio *io, unsigned op)
{
    return fault_take(io, op) ? -(io->f_err ? io->f_err : EIO) : 0;
}

int kvr_dio_fault(kvr_dio *io, unsigned op)
{
    return fault_hit(io, op);
}

static size_t req_len(const kvr_dio_req *r)
{
    size_t n = 0;
    for (int i = 0; i < r->iovcnt; i++)
        n += r->iov[i].iov_len;
    return n;
}

/* Transfers what is left of r after `done` bytes, synchronously. */
static int finish_posix(kvr_dio_req *r, size_t done)
{
    size_t total = req_len(r);
    while (done < total) {
        struct iovec v[KVR_DIO_IOV_MAX];
        int nv = 0;
        size_t skip = done;
        for (int i = 0; i < r->iovcnt; i++) {
            size_t l = r->iov[i].iov_len;
            if (skip >= l) {
                skip -= l;
                continue;
            }
            v[nv].iov_base = (char *)r->iov[i].iov_base + skip;
            v[nv].iov_len = l - skip;
            skip = 0;
            nv++;
        }
        ssize_t k = r->write ? pwritev(r->fd, v, nv, (off_t)(r->off + done))
                             : preadv(r->fd, v, nv, (off_t)(r->off + done));
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (k == 0) {
            if (!r->write && r->eof_ok)
                break;
            return r->write ? -ENOSPC : -EIO;
        }
        done += (size_t)k;
    }
    r->done = done;
    return 0;
}

/* Records an io_uring completion of res for q: the error, the whole
 * transfer, a zero-byte one (end of file where a read may stop there, else
 * ENOSPC for a write and EIO for a read), or a short one finished
 * synchronously. */
static void complete(kvr_dio_req *q, int res)
{
    if (res < 0) {
        q->res = res;
    } else if ((size_t)res == req_len(q)) {
        q->res = 0;
        q->done = (size_t)res;
    } else if (res == 0 && !(q->eof_ok && !q->write)) {
        q->res = q->write ? -ENOSPC : -EIO;
    } else {
        q->res = finish_posix(q, (size_t)res);
    }
}

/* A short transfer (injected): half the bytes first, then the rest as any
 * partial transfer is finished. */
static int short_posix(kvr_dio_req *r)
{
    kvr_dio_req h = *r;
    size_t half = req_len(r) / 2, left = half;
    for (int i = 0; i < h.iovcnt; i++) {
        if (h.iov[i].iov_len > left)
            h.iov[i].iov_len = left;
        left -= h.iov[i].iov_len;
    }
    int rc = finish_posix(&h, 0);
    if (rc == 0 && h.done < half) {     /* end of file inside the first half */
        r->done = h.done;
        return 0;
    }
    return rc ? rc : finish_posix(r, half);
}

static void account(kvr_dio *io, const kvr_dio_req *r)
{
    if (r->write) {
        io->n_w++;
        io->bw += req_len(r);
    } else {
        io->n_r++;
        io->br += req_len(r);
    }
}

static int run_posix(kvr_dio *io, kvr_dio_req *r, size_t n)
{
    int first = 0;
    for (size_t i = 0; i < n; i++) {
        r[i].done = 0;
        int f = fault_hit(io, r[i].write ? KVR_DISK_FAULT_WRITE : KVR_DISK_FAULT_READ);
        r[i].res = f ? f : fault_take(io, KVR_DISK_FAULT_SHORT) ? short_posix(&r[i])
                                                                : finish_posix(&r[i], 0);
        account(io, &r[i]);
        if (r[i].res && !first)
            first = r[i].res;
    }
    return first;
}

/* Queues r[0..n) (n <= depth) on the ring and submits them without
 * waiting; faults and injected short transfers are settled here. */
static void uring_start(kvr_dio *io, kvr_dio_req *r, size_t n)
{
    unsigned nsub = 0;
    for (size_t j = 0; j < n; j++) {
        account(io, &r[j]);
        r[j].done = 0;
        int f = fault_hit(io, r[j].write ? KVR_DISK_FAULT_WRITE : KVR_DISK_FAULT_READ);
        if (f) {
            r[j].res = f;
            continue;
        }
        if (fault_take(io, KVR_DISK_FAULT_SHORT)) {
            r[j].res = short_posix(&r[j]);
            continue;
        }
        struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
        if (!sqe) {         /* cannot happen with n <= depth */
            r[j].res = finish_posix(&r[j], 0);
            continue;
        }
        if (r[j].write)
            io_uring_prep_writev(sqe, r[j].fd, r[j].iov, (unsigned)r[j].iovcnt, r[j].off);
        else
            io_uring_prep_readv(sqe, r[j].fd, r[j].iov, (unsigned)r[j].iovcnt, r[j].off);
        io_uring_sqe_set_data64(sqe, j);
        r[j].res = 1;       /* in flight */
        nsub++;
    }
    if (nsub) {
        int rc = fault_hit(io, KVR_DISK_FAULT_SUBMIT);
        if (rc == 0) {
            do
                rc = io_uring_submit(&io->ring);
            while (rc == -EINTR);
        }
        if (rc < 0) {
            /* The kernel took nothing: drop the ring (its queued sqes
             * must never be submitted later) and finish on POSIX. */
            io_uring_queue_exit(&io->ring);
            io->uring = false;
            for (size_t j = 0; j < n; j++)
                if (r[j].res == 1)
                    r[j].res = finish_posix(&r[j], 0);
            nsub = 0;
        }
    }
    io->g_nsub = nsub;
}

/* Reaps the group uring_start submitted. */
static int uring_wait(kvr_dio *io, kvr_dio_req *r, size_t n)
{
    while (io->g_nsub) {
        struct io_uring_cqe *cqe;
        int rc = io_uring_wait_cqe(&io->ring, &cqe);
        if (rc == -EINTR)
            continue;
        if (rc < 0) {
            io->g_nsub = 0;
            return rc;      /* ring broken: callers see an I/O error */
        }
        kvr_dio_req *q = &r[io_uring_cqe_get_data64(cqe)];
        int res = cqe->res;
        io_uring_cqe_seen(&io->ring, cqe);
        io->g_nsub--;
        complete(q, res);
    }
    int first = 0;
    for (size_t j = 0; j < n; j++)
        if (r[j].res && !first)
            first = r[j].res;
    return first;
}

static int run_uring(kvr_dio *io, kvr_dio_req *r, size_t n)
{
    int first = 0;
    size_t i = 0;
    while (i < n) {
        if (!io->uring) {       /* the ring was dropped mid-batch */
            int rc = run_posix(io, r + i, n - i);
            return first ? first : rc;
        }
        size_t chunk = n - i < io->depth ? n - i : io->depth;
        uring_start(io, r + i, chunk);
        int rc = uring_wait(io, r + i, chunk);
        if (rc && !first)
            first = rc;
        i += chunk;
    }
    return first;
}

int kvr_dio_run(kvr_dio *io, kvr_dio_req *r, size_t n)
{
    return io->uring ? run_uring(io, r, n) : run_posix(io, r, n);
}

int kvr_dio_fsync(kvr_dio *io, int fd)
{
    io->n_f++;
    int f = fault_hit(io, KVR_DISK_FAULT_FSYNC);
    if (f)
        return f;
    if (io->uring) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
        if (sqe) {
            io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC);
            io_uring_sqe_set_data64(sqe, 0);
            int rc = fault_hit(io, KVR_DISK_FAULT_SUBMIT);
            if (rc == 0) {
                do
                    rc = io_uring_submit_and_wait(&io->ring, 1);
                while (rc == -EINTR);
            }
            if (rc >= 0) {
                struct io_uring_cqe *cqe;
                do
                    rc = io_uring_wait_cqe(&io->ring, &cqe);
                while (rc == -EINTR);
                if (rc < 0)
                    return rc;
                int res = cqe->res;
                io_uring_cqe_seen(&io->ring, cqe);
                return res < 0 ? res : 0;
            }
            /* Submission refused: drop the ring (the queued sqe must
             * never go in later) and use the synchronous call. */
            io_uring_queue_exit(&io->ring);
            io->uring = false;
        }
    }
    return fdatasync(fd) < 0 ? -errno : 0;
}

/* ---- streams --------------------------------------------------------------------- */
uint32_t kvr_dio_depth(const kvr_dio *io)
{
    return io->depth < KVR_DIO_STREAM_MAX ? io->depth : KVR_DIO_STREAM_MAX;
}

/* Whether a push that wakes the I/O thread yields (KVR_DISK_POSIX_NO_YIELD
 * unset or 0). */
static bool posix_yield(void)
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("KVR_DISK_POSIX_NO_YIELD");
        v = !(e && *e && *e != '0');
    }
    return v;
}

/* The POSIX engine's I/O thread: runs queued stream requests in order. */
static void *posix_thread(void *arg)
{
    kvr_dio *io = arg;
    pthread_mutex_lock(&io->th_mu);
    for (;;) {
        while (io->th_qn == 0 && !io->th_quit) {
            io->th_sleep = true;
            pthread_cond_wait(&io->th_cv, &io->th_mu);
        }
        io->th_sleep = false;
        if (io->th_qn == 0)
            break;      /* quit, nothing queued */
        kvr_dio_req *r = io->th_q[io->th_qh];
        kvr_dio_req tmp = *r;
        pthread_mutex_unlock(&io->th_mu);
        (void)run_posix(io, &tmp, 1);
        pthread_mutex_lock(&io->th_mu);
        io->th_qh = (io->th_qh + 1) % KVR_DIO_STREAM_MAX;
        io->th_qn--;
        r->done = tmp.done;
        r->res = tmp.res;
        pthread_cond_broadcast(&io->th_cv);
    }
    pthread_mutex_unlock(&io->th_mu);
    return NULL;
}

/* Completes one CQE of the ring (any stream request). */
static int uring_take_one(kvr_dio *io)
{
    struct io_uring_cqe *cqe;
    int rc;
    do
        rc = io_uring_wait_cqe(&io->ring, &cqe);
    while (rc == -EINTR);
    if (rc < 0)
        return rc;
    kvr_dio_req *q = (kvr_dio_req *)(uintptr_t)io_uring_cqe_get_data64(cqe);
    int res = cqe->res;
    io_uring_cqe_seen(&io->ring, cqe);
    io->s_inring--;
    complete(q, res);
    return 0;
}

/* Waits for every request still in the ring (a broken ring fails them). */
static void uring_drain(kvr_dio *io)
{
    while (io->s_inring) {
        int rc = uring_take_one(io);
        if (rc < 0) {
            for (size_t i = 0; i < io->s_n; i++) {
                kvr_dio_req *q = io->s_q[(io->s_head + i) % KVR_DIO_STREAM_MAX];
                if (q->res == 1 && q->s_uring)
                    q->res = rc;
            }
            io->s_inring = 0;
        }
    }
}

void kvr_dio_push(kvr_dio *io, kvr_dio_req *r)
{
    if (io->s_n == kvr_dio_depth(io))
        (void)kvr_dio_reap(io);     /* callers keep below depth; be safe */
    io->s_q[(io->s_head + io->s_n) % KVR_DIO_STREAM_MAX] = r;
    io->s_n++;
    r->done = 0;
    r->s_uring = false;
    if (io->uring) {
        account(io, r);
        int f = fault_hit(io, r->write ? KVR_DISK_FAULT_WRITE : KVR_DISK_FAULT_READ);
        if (f) {
            r->res = f;
            return;
        }
        if (fault_take(io, KVR_DISK_FAULT_SHORT)) {
            r->res = short_posix(r);
            return;
        }
        struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
        if (!sqe) {                 /* cannot happen below depth */
            r->res = finish_posix(r, 0);
            return;
        }
        if (r->write)
            io_uring_prep_writev(sqe, r->fd, r->iov, (unsigned)r->iovcnt, r->off);
        else
            io_uring_prep_readv(sqe, r->fd, r->iov, (unsigned)r->iovcnt, r->off);
        io_uring_sqe_set_data64(sqe, (uint64_t)(uintptr_t)r);
        r->res = 1;
        r->s_uring = true;
        int rc = fault_hit(io, KVR_DISK_FAULT_SUBMIT);
        if (rc == 0) {
            do
                rc = io_uring_submit(&io->ring);
            while (rc == -EINTR);
        }
        if (rc >= 0) {
            io->s_inring++;
            return;
        }
        /* The kernel took nothing: finish what it has, drop the ring (the
         * queued sqe must never go in later) and finish this on POSIX. */
        uring_drain(io);
        io_uring_queue_exit(&io->ring);
        io->uring = false;
        r->s_uring = false;
        r->res = finish_posix(r, 0);
        return;
    }
    if (!io->th_on && pthread_create(&io->th, NULL, posix_thread, io) == 0)
        io->th_on = true;
    if (!io->th_on) {               /* no thread: run it now */
        (void)run_posix(io, r, 1);
        return;
    }
    pthread_mutex_lock(&io->th_mu);
    r->res = 1;
    io->th_q[(io->th_qh + io->th_qn) % KVR_DIO_STREAM_MAX] = r;
    io->th_qn++;
    bool woke = io->th_sleep;
    pthread_cond_broadcast(&io->th_cv);
    pthread_mutex_unlock(&io->th_mu);
    if (woke && posix_yield())
        sched_yield();      /* let the woken thread start it (top comment) */
}

kvr_dio_req *kvr_dio_reap(kvr_dio *io)
{
    if (io->s_n == 0)
        return NULL;
    kvr_dio_req *r = io->s_q[io->s_head];
    if (r->s_uring) {
        while (r->res == 1) {
            if (uring_take_one(io) < 0)
                uring_drain(io);    /* fails what is left */
        }
    } else if (io->th_on) {
        pthread_mutex_lock(&io->th_mu);
        while (r->res == 1)
            pthread_cond_wait(&io->th_cv, &io->th_mu);
        pthread_mutex_unlock(&io->th_mu);
    }
    io->s_head = (io->s_head + 1) % KVR_DIO_STREAM_MAX;
    io->s_n--;
    return r;
}
