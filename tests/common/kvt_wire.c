/*
 * kvt_wire.c — tests/common/kvt_wire.h: wire requests.
 */
#include "tests/common/kvt_wire.h"

Kvrope__Request kvt_put_request(uint64_t id, Kvrope__Put *p)
{
    Kvrope__Request q = KVROPE__REQUEST__INIT;
    q.id = id;
    q.body_case = KVROPE__REQUEST__BODY_PUT;
    q.put = p;
    return q;
}
