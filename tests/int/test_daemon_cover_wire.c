/*
 * test_daemon_cover_wire.c — the Cover verb in raw frames (no client
 * library, so what libkvrope never sends can be sent): an explicit
 * min_run 0, an unknown dtype, a get whose payload goes out with the reply,
 * and a Cover frame cut short (E_BAD_FRAME, that connection closed). After
 * each, the daemon answers on a new connection and the stored context is
 * unchanged.
 */
#include <criterion/criterion.h>

#include "kvrope.pb-c.h"
#include "proto/frame.h"

#include "tests/common/kvr_rawd.h"

TestSuite(daemon_cover_wire, .init = setup, .fini = teardown, .timeout = 120);

static uint32_t TOK[64];

static void put_ctx(int fd)
{
    for (uint32_t i = 0; i < 64; i++)
        TOK[i] = 500 + i * 3;
    size_t pb;
    uint16_t *pay = new_payload(64, 2, &pb);
    put_ok(fd, "doc", TOK, 64, KVROPE__PUT_MODE__CREATE, pay, pb);
    free(pay);
}

static void cover_req(Kvrope__Request *q, Kvrope__Cover *c, uint32_t *tok, size_t n)
{
    kvrope__request__init(q);
    kvrope__cover__init(c);
    c->model = "tiny";
    c->tokens = tok;
    c->n_tokens = n;
    q->id = 42;
    q->body_case = KVROPE__REQUEST__BODY_COVER;
    q->cover = c;
}

static void doc_intact(void)
{
    int fd = connect_unix(D.sock);
    cr_assert_eq(ping(fd, 9), KVROPE__STATUS__OK);
    Kvrope__Request q;
    Kvrope__Cover c;
    cover_req(&q, &c, TOK, 64);
    send_req(fd, &q, NULL, 0);
    Kvrope__Response *r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "%s", r->message);
    cr_assert_eq(r->body_case, KVROPE__RESPONSE__BODY_COVER);
    cr_assert_eq(r->cover->covered, 64);
    cr_assert_eq(r->cover->n_runs, 1);
    cr_assert(r->cover->runs[0]->exact);
    kvrope__response__free_unpacked(r, NULL);
    close(fd);
}

Test(daemon_cover_wire, refusals_and_a_placed_payload)
{
    start_daemon(NULL);
    int fd = connect_unix(D.sock);
    register_model(fd);
    put_ctx(fd);
    uint32_t prompt[40];
    for (uint32_t i = 0; i < 8; i++)
        prompt[i] = 90000 + i;
    memcpy(prompt + 8, TOK + 20, 32 * 4);

    Kvrope__Request q;
    Kvrope__Cover c;
    cover_req(&q, &c, prompt, 40);
    c.has_min_run = 1;
    c.min_run = 0;
    send_req(fd, &q, NULL, 0);
    Kvrope__Response *r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__E_INVALID);
    cr_assert(strstr(r->message, "min_run 0"), "%s", r->message);
    kvrope__response__free_unpacked(r, NULL);

    cover_req(&q, &c, prompt, 40);
    c.has_dtype = 1;
    c.dtype = (Kvrope__DType)7;
    send_req(fd, &q, NULL, 0);
    r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__E_BAD_REQUEST, "%s", r->message);
    kvrope__response__free_unpacked(r, NULL);

    /* get: the runs' K/V follow the reply, as KVResult says */
    cover_req(&q, &c, prompt, 40);
    c.has_get = c.get = 1;
    c.has_dtype = 1;
    c.dtype = KVROPE__DTYPE__F16;
    uint8_t *pl;
    uint64_t plen;
    send_req(fd, &q, NULL, 0);
    r = recv_resp(fd, &pl, &plen);
    cr_assert_eq(r->status, KVROPE__STATUS__OK, "%s", r->message);
    cr_assert_eq(r->cover->n_runs, 1);
    cr_assert_eq(r->cover->runs[0]->prompt_offset, 8);
    cr_assert_eq(r->cover->runs[0]->context_offset, 20);
    cr_assert_not(r->cover->runs[0]->exact);
    cr_assert_not_null(r->cover->kv);
    cr_assert_eq(r->cover->kv->token_count, 32);
    cr_assert_eq(plen, payload_bytes(32));
    for (size_t i = 0; i < 32; i++) {
        cr_assert_eq(r->cover->kv->positions[i], 8 + (int64_t)i);
        cr_assert_eq(r->cover->kv->flags[i] & 1u, 1u);
    }
    free(pl);
    kvrope__response__free_unpacked(r, NULL);

    /* A Cover frame whose message is cut short: refused, connection closed. */
    cover_req(&q, &c, prompt, 40);
    size_t n = kvrope__request__get_packed_size(&q);
    uint8_t *buf = malloc(KVR_FRAME_HEADER_SIZE + n);
    kvrope__request__pack(&q, buf + KVR_FRAME_HEADER_SIZE);
    kvr_frame_header_encode(buf, (uint32_t)(n - 30), 0);
    cr_assert_eq(kvt_write_all(fd, buf, KVR_FRAME_HEADER_SIZE + n - 30), 0);
    r = recv_resp(fd, NULL, NULL);
    cr_assert_eq(r->status, KVROPE__STATUS__E_BAD_FRAME, "%s", r->message);
    kvrope__response__free_unpacked(r, NULL);
    expect_eof(fd);
    close(fd);
    free(buf);
    doc_intact();
    stop_daemon_clean();
}
