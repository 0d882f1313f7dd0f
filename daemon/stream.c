/*
 * stream.c — streamed replies: a get (or match+get) that needs work and
 * whose payload is over KVR_STREAM_MIN_BYTES sends its header and message
 * at once, then works and writes its layers in chunks of about
 * KVR_STREAM_CHUNK_BYTES (whole layers, at least one), so rotation overlaps
 * sending. dispatch.c starts it; conn.c only writes the buffers.
 *
 * Chunk k (layers [k*per, (k+1)*per) of the payload) is worked in job slot
 * k % KVR_STREAM_WINDOW and written as soon as it and every chunk before it
 * are: writes go out in order. A slot is free again once its chunk's write
 * is queued. New work is queued only while fewer than KVR_STREAM_WINDOW
 * chunk writes wait on the socket, so a slow reader holds back the work (and
 * the --io-timeout write clock sees it as a stalled reply); chunk 0 runs
 * alone (kvr_get_work_layers' first call does the one-time preparation).
 * The stream ends when nothing is queued any more: after the last write
 * (then the request ends OK), or after a failure or a close once the work
 * and the writes in flight have come back. Each queued job and write holds
 * a reference on the connection, so it outlives the stream.
 *
 * Staging, reserved by kvr__stream_stage before anything is
 * sent, never the whole payload's:
 *  - In pieces (kvr_get_stage_pieces), where a ring of whole-layer chunks
 *    would stage more than KVR_STREAM_PIECES_FROM and the get's staged
 *    rows have the same bits however they are split (plain blocks: keys moved by one
 *    delta or converted, values converted: an edited or shifted f16
 *    context): chunk k is piece k, about KVR_STREAM_PIECE_BYTES of one
 *    layer's staged side (a side straight from block memory is one piece,
 *    one large write), staged in slot k % RING_SLOTS. A layer at 8k tokens
 *    of Llama-3-8B is 32 MiB (its keys 16 MiB): in whole layers the ring
 *    would be 48 MiB, past the last-level cache, so rotated keys went out
 *    to memory and came back for the send copy; pieces keep the ring at 6
 *    MiB, in cache between the rotation and the write.
 *  - Else, a stream of more than RING_SLOTS chunks (whole layers of about
 *    KVR_STREAM_CHUNK_BYTES) stages them in a ring of RING_SLOTS chunk
 *    slots (kvr_get_stage_ring); fewer chunks: the whole staging.
 * Either way memory is bounded by the chunk, not the context, and every
 * slot after the first round lands in pages already faulted in (the ring
 * itself is kept for the next request, mem.c). Chunk k is worked in slot
 * k % RING_SLOTS, so it is queued only once chunk k - RING_SLOTS's write
 * has completed (writes complete in order: wdone). With the job window and
 * the write window of KVR_STREAM_WINDOW each, at most KVR_STREAM_WINDOW + 1
 * chunks are ever between their work and the end of their write, so the
 * ring never holds the pipeline back.
 */
#include "daemon/daemon_internal.h"

#include <assert.h>
#include <string.h>

enum { SLOT_FREE = 0, SLOT_QUEUED, SLOT_READY };

#define RING_SLOTS (KVR_STREAM_WINDOW + 1)

typedef struct kvr_stream kvr_stream;

static void stream_pump(kvr_stream *s);

typedef struct stream_job {
    uv_work_t    w;
    kvr_stream *s;
    size_t       chunk;
    int          state;       /* SLOT_* */
    int          rc;
    kvr_error    err;
} stream_job;

struct kvr_stream {
    kvr_request *r;
    kvr_conn  *c;
    kvr_get   *get;
    size_t     n_layers, per, n_chunks, layer_bytes;
    bool       pieces;                   /* chunk k = piece k (kvr_get_stage_pieces) */
    size_t     next_queue, next_write;   /* chunks queued for work / written */
    size_t     wdone;                    /* chunk writes completed */
    size_t     ring;                     /* staging ring slots; 0: whole staging */
    int        jobs, writes;             /* in flight */
    bool       first_done;               /* chunk 0's work came back */
    bool       failed;
    stream_job job[KVR_STREAM_WINDOW];
};

static void stream_range(const kvr_stream *s, size_t chunk, size_t *l0, size_t *l1)
{
    *l0 = chunk * s->per;
    *l1 = *l0 + s->per < s->n_layers ? *l0 + s->per : s->n_layers;
}

static void stream_work_cb(uv_work_t *w)
{
    stream_job *j = w->data;
    memset(&j->err, 0, sizeof j->err);
    if (j->s->pieces) {
        j->rc = kvr_get_work_piece(j->s->get, j->chunk, &j->err);
        return;
    }
    size_t l0, l1;
    stream_range(j->s, j->chunk, &l0, &l1);
    j->rc = kvr_get_work_layers(j->s->get, l0, l1, &j->err);
}

static void stream_fail(kvr_stream *s, const char *why)
{
    kvr_conn *c = s->c;
    if (!s->failed)
        kvr_log(KVR_LOG_ERROR, "streamed reply failed after its header was sent: %s "
                "(closing the connection)", why);
    s->failed = true;
    if (!c->closing)
        kvr__conn_close(c);
}

static void stream_after_work_cb(uv_work_t *w, int status)
{
    stream_job *j = w->data;
    kvr_stream *s = j->s;
    kvr_conn *c = s->c;
    assert(s->jobs > 0 && j->state == SLOT_QUEUED);
    s->jobs--;
    if (status < 0 && j->rc == 0) {
        j->rc = KVR_EINTERNAL;
        kvr_error_set(&j->err, KVR_EINTERNAL, "work cancelled");
    }
    j->state = SLOT_READY;
    if (j->chunk == 0)
        s->first_done = true;
    if (j->rc != 0)
        stream_fail(s, j->err.msg[0] ? j->err.msg : kvr_strerror(j->rc));
    stream_pump(s);
    kvr__conn_unref(c);
}

static void stream_finish(kvr_stream *s)
{
    kvr_conn *c = s->c;
    kvr_request *r = s->r;
    bool ok = !s->failed && !c->closing && s->next_write == s->n_chunks;
    if (!ok)
        c->d->n_stream_aborted++;
    kvr_get_end(s->get);
    kvr_mem_free(s);
    kvr__request_end(r, ok ? 0 : KVR_EIO);
}

static void stream_write_cb(void *arg, int status)
{
    kvr_stream *s = arg;
    (void)status;     /* a failed write closed the connection */
    assert(s->writes > 0);
    s->writes--;
    s->wdone++;       /* in order: this chunk's slot of the ring is free */
    stream_pump(s);
}

/* Writes what is ready, in order; queues work while the window allows;
 * ends the stream when nothing is left in flight. May free s. */
static void stream_pump(kvr_stream *s)
{
    kvr_conn *c = s->c;
    while (!c->closing && !s->failed && s->next_write < s->n_chunks) {
        stream_job *j = &s->job[s->next_write % KVR_STREAM_WINDOW];
        if (j->state != SLOT_READY || j->chunk != s->next_write)
            break;
        const struct iovec *iov;
        size_t niov, bytes;
        if (s->pieces) {
            kvr_get_payload_iov_piece(s->get, s->next_write, &iov, &niov, &bytes);
        } else {
            size_t l0, l1;
            stream_range(s, s->next_write, &l0, &l1);
            kvr_get_payload_iov_layers(s->get, l0, l1, &iov, &niov);
            bytes = (l1 - l0) * s->layer_bytes;
        }
        j->state = SLOT_FREE;
        s->next_write++;
        if (kvr__conn_write(c, NULL, 0, iov, niov, bytes, stream_write_cb, s) != 0) {
            stream_fail(s, "the payload write could not be queued");
            break;
        }
        s->writes++;
    }
    while (!c->closing && !s->failed && s->next_queue < s->n_chunks &&
           s->writes < KVR_STREAM_WINDOW && (s->next_queue == 0 || s->first_done) &&
           (s->ring == 0 || s->next_queue < s->wdone + s->ring)) {
        stream_job *j = &s->job[s->next_queue % KVR_STREAM_WINDOW];
        if (j->state != SLOT_FREE)
            break;
        j->s = s;
        j->chunk = s->next_queue;
        j->rc = 0;
        j->w.data = j;
        if (uv_queue_work(&c->d->loop, &j->w, stream_work_cb, stream_after_work_cb) < 0) {
            stream_fail(s, "the work could not be queued");
            break;
        }
        j->state = SLOT_QUEUED;
        kvr__conn_ref(c);
        s->jobs++;
        s->next_queue++;
    }
    if (s->jobs > 0 || s->writes > 0)
        return;
    if (!c->closing && !s->failed && s->next_write < s->n_chunks)
        stream_fail(s, "the stream stalled");   /* cannot happen; never hang */
    stream_finish(s);
}

/* Layers per chunk of a stream of nl layers, payload bytes. */
static size_t stream_per(size_t nl, size_t payload_len)
{
    size_t layer_bytes = payload_len / nl;
    size_t per = layer_bytes ? KVR_STREAM_CHUNK_BYTES / layer_bytes : nl;
    return per ? per : 1;
}

int kvr__stream_stage(kvr_get *get, kvr_error *err)
{
    size_t nl = kvr_get_get_info(get)->n_layers;
    if (nl == 0)
        return kvr_get_stage(get, err);
    size_t per = stream_per(nl, kvr_get_payload_size(get));
    if (RING_SLOTS * per * kvr_get_staged_layer_bytes(get) > KVR_STREAM_PIECES_FROM) {
        size_t np = 0;
        int rc = kvr_get_stage_pieces(get, KVR_STREAM_PIECE_BYTES, RING_SLOTS, &np, err);
        if (rc != 0 || np > 0)
            return rc;
    }
    return kvr_get_stage_ring(get, per, RING_SLOTS, err);
}

int kvr__stream_start(kvr_request *r, kvr_conn *c, kvr_get *get, uint8_t *buf, size_t len,
                      size_t payload_len)
{
    if (c->closing) {
        kvr_mem_free(buf);
        kvr_get_end(get);
        kvr__request_end(r, KVR_EIO);
        return 0;
    }
    size_t nl = kvr_get_get_info(get)->n_layers;
    kvr_stream *s = nl ? kvr_mem_calloc(1, sizeof *s) : NULL;
    if (!s)
        return KVR_ENOMEM;
    s->r = r;
    s->c = c;
    s->get = get;
    s->n_layers = nl;
    s->layer_bytes = payload_len / nl;
    s->per = stream_per(nl, payload_len);
    s->n_chunks = (nl + s->per - 1) / s->per;
    size_t np = kvr_get_n_pieces(get);
    if (np) {   /* in pieces: chunk k is piece k, in slot k % RING_SLOTS */
        s->pieces = true;
        s->n_chunks = np;
    }
    /* Staged by kvr__stream_stage: pieces, a ring when there are more
     * chunks than its slots (kvr_read_stage_ring's rule), else the whole
     * staging. */
    if (s->n_chunks > RING_SLOTS)
        s->ring = RING_SLOTS;
    c->d->n_streamed++;
    if (kvr__conn_write(c, buf, len, NULL, 0, 0, NULL, NULL) != 0) {
        stream_fail(s, "the header write could not be queued");
        stream_finish(s);
        return 0;
    }
    stream_pump(s);
    return 0;
}
