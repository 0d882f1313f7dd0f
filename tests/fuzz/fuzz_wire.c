/*
 * fuzz_wire.c — libFuzzer target for everything a peer's bytes reach:
 *   1. kvr_frame_header_decode on the first 24 bytes,
 *   2. kvrope.Request unpack of the rest (with the daemon's allocator),
 *   3. the whole input as a byte stream through a real connection of an
 *      in-process daemon (socketpair adopted with kvr_daemon_adopt_fd): the
 *      frame state machine, drains, puts into store memory, gets, closes;
 *      written whole or in small chunks (stream_through_daemon).
 * The daemon (and its store) lives for the whole run; the memory cap keeps
 * it bounded. Its replies are read and discarded.
 *
 * Build and run: `make fuzz` (clang, libFuzzer + ASan + UBSan; FUZZ_SECONDS
 * sets the run time of each target, 60 by default; corpus in build/fuzz/corpus).
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/daemon_internal.h"
#include "tests/common/kvt_inproc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static kvr_daemon *D;

static void init_daemon(void)
{
    signal(SIGPIPE, SIG_IGN);
    kvr_daemon_init_allocator();
    kvr_daemon_config cfg;
    kvt_inproc_config(&cfg);
    cfg.max_frame = 64u << 10;
    cfg.max_drain = 64u << 10;
    cfg.max_conn_buffer = 1u << 20;
    if (kvr_daemon_create(&D, &cfg, NULL) < 0)
        abort();
}

static void stream_through_daemon(const uint8_t *data, size_t size)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
        return;
    fcntl(sv[1], F_SETFL, O_NONBLOCK);
    if (kvr_daemon_adopt_fd(D, sv[0]) < 0) {
        close(sv[0]);
        close(sv[1]);
        return;
    }
    size_t off = 0;
    bool shut = false;
    uint8_t sink[65536];
    /* Half the inputs are written whole, the others in chunks of 1 to 64
     * bytes (picked by the input's last byte) with the loop run between
     * them: headers, messages and payloads split at every boundary reach
     * the read-ahead (conn.c) as the socket delivers them. */
    size_t chunk = size;
    if (size > 1 && (data[size - 1] & 0x80))
        chunk = 1 + (data[size - 1] & 0x3f);
    for (long spins = 0; spins < 2000000; spins++) {
        if (off < size) {
            size_t want = size - off < chunk ? size - off : chunk;
            ssize_t k = write(sv[1], data + off, want);
            if (k > 0)
                off += (size_t)k;
            else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
                off = size;   /* daemon closed its side */
        }
        if (off == size && !shut) {
            shutdown(sv[1], SHUT_WR);
            shut = true;
        }
        while (read(sv[1], sink, sizeof sink) > 0) {
        }
        kvr_daemon_run_nowait(D);
        if (shut && kvr_daemon_connections(D) == 0)
            break;
        if ((spins & 63) == 63)
            sched_yield();   /* let threadpool jobs finish */
    }
    close(sv[1]);
    /* Let the close callbacks run. */
    for (int i = 0; i < 1000 && kvr_daemon_connections(D) > 0; i++)
        kvr_daemon_run_nowait(D);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!D)
        init_daemon();
    if (size >= KVR_FRAME_HEADER_SIZE) {
        kvr_frame_header h;
        kvr_frame_limits lim = { .max_msg_len = 64u << 10, .max_payload_len = 64u << 20 };
        (void)kvr_frame_header_decode(data, &h, &lim);
        Kvrope__Request *r = kvrope__request__unpack(&kvr__pb_allocator,
                                                     size - KVR_FRAME_HEADER_SIZE,
                                                     data + KVR_FRAME_HEADER_SIZE);
        if (r)
            kvrope__request__free_unpacked(r, &kvr__pb_allocator);
    }
    stream_through_daemon(data, size);
    return 0;
}
