/*
 * kvt_wire.c — tests/common/kvt_wire.h: wire requests.
 */
#include "tests/common/kvt_wire.h"

#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "proto/frame.h"

Kvrope__Request kvt_put_request(uint64_t id, Kvrope__Put *p)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    q.id = id;
    q.body_case = KVROPE__REQUEST__BODY_PUT;
    q.put = p;
    return q;
}

int kvt_wire_send_raw(const char *sock, const Kvrope__Request *q, uint64_t payload)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    uint8_t buf[512];
    if (strlen(sock) >= sizeof sa.sun_path ||
        kvrope__request__get_packed_size(q) > sizeof buf - KVR_FRAME_HEADER_SIZE)
        return -1;
    memcpy(sa.sun_path, sock, strlen(sock) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        close(fd);
        return -1;
    }
    size_t n = kvrope__request__pack(q, buf + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(buf, (uint32_t)n, payload);
    if (write(fd, buf, KVR_FRAME_HEADER_SIZE + n) != (ssize_t)(KVR_FRAME_HEADER_SIZE + n)) {
        close(fd);
        return -1;
    }
    return fd;
}

int kvt_wire_open_put(const char *sock, const char *ctx, const char *model,
                      Kvrope__PutMode mode, uint64_t payload)
{
    uint32_t tok[1] = { 5 };
    Kvrope__Put p = KVROPE__PUT__INIT;
    p.context_id = (char *)(uintptr_t)ctx;
    p.model = (char *)(uintptr_t)model;
    p.has_mode = 1;
    p.mode = mode;
    p.n_tokens = 1;
    p.tokens = tok;
    Kvrope__Request q = kvt_put_request(1, &p);
    return kvt_wire_send_raw(sock, &q, payload);
}
