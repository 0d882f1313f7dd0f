/*
 * codec_ggml_avx512.c — the AVX-512 (F/BW/VL/DQ) encoder and decoder of
 * ggml's legacy blocks (Q8_0, Q4_0, Q4_1, Q5_0) for f32 or f16 data: one
 * block is two 16-float vectors. Called only after the CPU was checked; a
 * row's last blocks short of a batch of eight are encoded by
 * codec_ggml_avx2.c.
 *
 * Same rules as codec_ggml_avx2.c (which see): the scalar reference's
 * operations lane by lane, -ffp-contract=off for this file, the first
 * element of largest magnitude for Q4_0/Q5_0's max, Q4_1 blocks with a zero
 * min or max left to the scalar block encoder, round half away from zero for
 * Q8_0 (see round_away_epi32), truncating casts elsewhere. A bad value makes it return -1 (the
 * caller reruns the scalar path, which names it).
 */
#include "cache/codec.h"
#include "cache/codec_inl.h"

#include <float.h>
#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
#include "cache/codec_avx512_inl.h"
#define QK 32

AI int acc_bad(__m512i acc, int h)
{
    if (h) return _mm512_cmpgt_epu16_mask(acc, _mm512_set1_epi16(0x7bff)) != 0;
    return _mm512_cmpgt_epu32_mask(acc, _mm512_set1_epi32(0x7f7fffff)) != 0;
}

/* roundf (half away from zero) as trunc(v + copysign(0x1.fffffep-2f, v)): the
 * same for every float |v| < 129 (checked exhaustively), and Q8_0's
 * |v| <= 127 (1 + 3 eps). */
AI __m512i round_away_epi32(__m512 v)
{
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 h = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(_mm512_set1_ps(0x1.fffffep-2f)),
        _mm512_and_si512(sign, _mm512_castps_si512(v))));
    return _mm512_cvttps_epi32(_mm512_add_ps(v, h));
}

AI void quant_block(kvr_codec_type t, uint8_t *y, __m512 x0, __m512 x1, float id, float min)
{
    const __m512 vid = _mm512_set1_ps(id);
    if (t == KVR_CODEC_Q8_0) {
        __m128i b0 = _mm512_cvtsepi32_epi8(round_away_epi32(_mm512_mul_ps(x0, vid)));
        __m128i b1 = _mm512_cvtsepi32_epi8(round_away_epi32(_mm512_mul_ps(x1, vid)));
        _mm_storeu_si128((__m128i *)(y + 2), b0);
        _mm_storeu_si128((__m128i *)(y + 18), b1);
        return;
    }
    const int q5 = t == KVR_CODEC_Q5_0, q41 = t == KVR_CODEC_Q4_1;
    const __m512 off = _mm512_set1_ps(q5 ? 16.5f : q41 ? 0.5f : 8.5f);
    const __m512i top = _mm512_set1_epi32(q5 ? 31 : 15);
    const __m512 vm = _mm512_set1_ps(min);
#define Q(v) _mm512_min_epi32(_mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps( \
                 q41 ? _mm512_sub_ps((v), vm) : (v), vid), off)), top)
    __m512i lo = Q(x0), hi = Q(x1);
#undef Q
    if (q5) {
        const __m512i b4 = _mm512_set1_epi32(0x10), m4 = _mm512_set1_epi32(0x0F);
        uint32_t qh = (uint32_t)_mm512_test_epi32_mask(lo, b4) |
                      (uint32_t)_mm512_test_epi32_mask(hi, b4) << 16;
        memcpy(y + 2, &qh, 4);   /* little-endian, as kvr_le32_put */
        /* bits 0-3 from lo, the rest from hi << 4 (bit select, 0xE4:
         * m4 ? lo : hi << 4); vpmovdb keeps bits 0-7 */
        __m512i nb = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi32(hi, 4), m4, 0xE4);
        _mm_storeu_si128((__m128i *)(y + 6), _mm512_cvtepi32_epi8(nb));
    } else {
        __m512i nb = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
        _mm_storeu_si128((__m128i *)(y + (q41 ? 4 : 2)), _mm512_cvtepi32_epi8(nb));
    }
}

/* r[b] = max (or min) of the 16 lanes of v[b], b < 8: a transposed
 * reduction (exact: max and min of non-NaN values do not depend on order). */
AI __m256 reduce8(const __m512 *v, int is_max)
{
#define OP(a, b) (is_max ? _mm512_max_ps((a), (b)) : _mm512_min_ps((a), (b)))
    __m512 w[4], x[2];
    /* unrolled, so that v, w and x stay in registers (loops over them kept
     * the arrays on the stack) */
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
        w[k] = OP(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                  _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)
        x[k] = OP(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                  _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
    /* quad k of x[0] holds block k's 4 partials, of x[1] block k + 4's */
    __m512 y = OP(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
    __m512 z = OP(y, _mm512_permute_ps(y, 0xB1));
    /* quad k: lane 0 block k, lane 2 block k + 4 */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, z));
#undef OP
}

/* One batch's parameters (scales8), used by quant8. */
typedef struct {
    float    ids[8], p0[8];
    uint16_t dhs[8], mhs[8];
    unsigned fb;
} sc8;

/* Eight blocks at i: each block's max and min (two transposed reductions),
 * then d / id / f16 forms eight at a time. The extremes give every
 * parameter:
 *   Q8_0 amax = max(max, -min) (a zero made +0, as fabsf's);
 *   Q4_0 / Q5_0 "max" (the first element of largest magnitude) = max when
 *   max > -min, min when -min > max; a tie (max == -min != 0) needs the
 *   first index: that block goes to the scalar block encoder, as do Q4_1
 *   blocks whose min or max is a zero (the sign the reference keeps). */
AI int scales8(kvr_codec_type t, const void *src, size_t i, int h, sc8 *s)
{
    __m512i acc = _mm512_setzero_si512();
    __m256i acch = _mm256_setzero_si256();   /* f16: the magnitudes' max on 256 bits */
    __m512 mx[8], mn[8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; b++) {
        size_t o = i + 32 * (size_t)b;
        __m512 x0, x1;
        if (h) {
            const uint16_t *p = (const uint16_t *)src + o;
            __m256i r0 = _mm256_loadu_si256((const __m256i *)p);
            __m256i r1 = _mm256_loadu_si256((const __m256i *)(p + 16));
            const __m256i m = _mm256_set1_epi16(0x7fff);
            acch = _mm256_max_epu16(acch, _mm256_max_epu16(_mm256_and_si256(r0, m),
                                                           _mm256_and_si256(r1, m)));
            x0 = _mm512_cvtph_ps(r0);
            x1 = _mm512_cvtph_ps(r1);
        } else {
            x0 = ld16(src, o, 0, &acc);
            x1 = ld16(src, o + 16, 0, &acc);
        }
        mx[b] = _mm512_max_ps(x0, x1);
        mn[b] = _mm512_min_ps(x0, x1);
    }
    if (h ? _mm256_cmpgt_epu16_mask(acch, _mm256_set1_epi16(0x7bff)) != 0 : acc_bad(acc, 0))
        return -1;
    const __m256 zero = _mm256_setzero_ps();
    __m256 vmax = reduce8(mx, 1), vmin = reduce8(mn, 0);
    __m256 nmin = _mm256_sub_ps(zero, vmin);
    unsigned fb = 0;
    __m256 v0, d;
    switch (t) {
    case KVR_CODEC_Q8_0: {
        __m256 amax = _mm256_max_ps(vmax, nmin);
        amax = _mm256_and_ps(amax, _mm256_cmp_ps(amax, zero, _CMP_NEQ_OQ));   /* +0 */
        v0 = amax;
        d = _mm256_div_ps(amax, _mm256_set1_ps((float)((1 << 7) - 1)));
        break;
    }
    case KVR_CODEC_Q4_0:
    case KVR_CODEC_Q5_0: {
        __m256 gt = _mm256_cmp_ps(vmax, nmin, _CMP_GT_OQ);
        __m256 tie = _mm256_and_ps(_mm256_cmp_ps(vmax, nmin, _CMP_EQ_OQ),
                                   _mm256_cmp_ps(vmax, zero, _CMP_NEQ_OQ));
        fb = (unsigned)_mm256_movemask_ps(tie);
        v0 = _mm256_blendv_ps(vmin, vmax, gt);
        /* max == -min == 0: the reference's max stays +0 */
        v0 = _mm256_and_ps(v0, _mm256_cmp_ps(v0, zero, _CMP_NEQ_OQ));
        /* max / -16 (or -8) as a multiply by -1/16 (-1/8): the exact
         * quotient either way, rounded once (a power of two), so the
         * reference's bits, subnormals included, for a divide's cost less */
        d = _mm256_mul_ps(v0, _mm256_set1_ps(t == KVR_CODEC_Q5_0 ? -0.0625f : -0.125f));
        break;
    }
    default:
        fb = (unsigned)_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(vmin, zero, _CMP_EQ_OQ),
                                                       _mm256_cmp_ps(vmax, zero, _CMP_EQ_OQ)));
        v0 = vmin;
        d = _mm256_div_ps(_mm256_sub_ps(vmax, vmin), _mm256_set1_ps((float)((1 << 4) - 1)));
        break;
    }
    __m256 id = _mm256_and_ps(_mm256_cmp_ps(d, zero, _CMP_NEQ_OQ),
                              _mm256_div_ps(_mm256_set1_ps(1.0f), d));
#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)   /* clang wants a constant expression */
    __m128i dh = _mm256_cvtps_ph(d, RNE), mh = _mm256_cvtps_ph(v0, RNE);
    const __m128i em = _mm_set1_epi16(0x7C00);
    __m128i inf = _mm_cmpeq_epi16(_mm_and_si128(dh, em), em);
    if (t == KVR_CODEC_Q4_1) inf = _mm_or_si128(inf, _mm_cmpeq_epi16(_mm_and_si128(mh, em), em));
    unsigned bad = (unsigned)_mm_movemask_epi8(_mm_packs_epi16(inf, inf)) & 0xffu & ~fb;
    if (bad) return -1;
    s->fb = fb;
    _mm256_storeu_ps(s->ids, id);
    _mm256_storeu_ps(s->p0, v0);
    _mm_storeu_si128((__m128i *)s->dhs, dh);
    _mm_storeu_si128((__m128i *)s->mhs, mh);
    return 0;
}

/* The quants of the eight blocks at i with scales8's parameters. */
AI int quant8(kvr_codec_type t, uint8_t *dst, const void *src, size_t i, int h, const sc8 *s)
{
    const size_t bb = ggml_block_bytes(t);   /* a constant: t is */
#pragma GCC unroll 8
    for (int b = 0; b < 8; b++) {
        size_t o = i + 32 * (size_t)b;
        uint8_t *y = dst + o / QK * bb;
        /* loaded again (from L1): kept in registers beside the 16
         * extremes they spilled to the stack, a third of the time */
        __m512 x0 = ld16q(src, o, h), x1 = ld16q(src, o + 16, h);
        if (s->fb & (1u << b)) {
            float xs[QK];
            _mm512_storeu_ps(xs, x0);
            _mm512_storeu_ps(xs + 16, x1);
            if (kvr_codec_ggml_block_enc(t, y, xs) != 0) return -1;
            continue;
        }
        kvr_le16_put(y, s->dhs[b]);
        if (t == KVR_CODEC_Q4_1) kvr_le16_put(y + 2, s->mhs[b]);
        quant_block(t, y, x0, x1, s->ids[b], s->p0[b]);
    }
    return 0;
}

/* Software-pipelined: batch k + 1's parameters are computed before batch
 * k's quants, so the divide / f16 chain of one batch runs under the other's
 * quants instead of stalling them (a bad value anywhere returns -1 and the
 * caller redoes the whole call with the scalar path, so stopping one batch
 * early writes nothing that is kept). */
AI int enc_run(kvr_codec_type t, uint8_t *dst, const void *src, size_t *pi,
               size_t n, int h)
{
    size_t i = *pi;
    if (i + 256 > n) return 0;
    sc8 s0, s1;   /* unrolled by two: each batch's parameters in a fixed place */
    s1.fb = 0;    /* (set before use; gcc cannot see it) */
    if (scales8(t, src, i, h, &s0) != 0) return -1;
    for (;;) {
        int more = i + 512 <= n;
        if (more && scales8(t, src, i + 256, h, &s1) != 0) return -1;
        if (quant8(t, dst, src, i, h, &s0) != 0) return -1;
        i += 256;
        if (!more) break;
        more = i + 512 <= n;
        if (more && scales8(t, src, i + 256, h, &s0) != 0) return -1;
        if (quant8(t, dst, src, i, h, &s1) != 0) return -1;
        i += 256;
        if (!more) break;
    }
    *pi = i;
    return 0;
}

#define ENC_CASE(T)                                                                  \
    case T:                                                                          \
        if ((h ? enc_run(T, dst, src, &i, n, 1) : enc_run(T, dst, src, &i, n, 0)) != 0) \
            return -1;                                                               \
        break;

int kvr_codec_ggml_enc_avx512(kvr_codec_type t, uint8_t *dst, const void *src, kvr_dtype st,
                              size_t n)
{
    const int h = st == KVR_DTYPE_F16;
    const size_t bb = ggml_block_bytes(t);
    size_t i = 0;
    switch (t) {
    ENC_CASE(KVR_CODEC_Q8_0)
    ENC_CASE(KVR_CODEC_Q4_0)
    ENC_CASE(KVR_CODEC_Q4_1)
    ENC_CASE(KVR_CODEC_Q5_0)
    default: return -1;
    }
    if (i == n) return 0;
    /* the last blocks short of a batch: the AVX2 kernel (same bytes) */
    return kvr_codec_ggml_enc_avx2(t, dst + i / QK * bb,
                                   (const char *)src + i * (h ? 2 : 4), st, n - i);
}

/* ---- decode -------------------------------------------------------------
 * One block as two 16-lane vectors: the quants widened to int32 (Q8_0 signed
 * bytes; Q4_x low nibbles are elements 0-15, high nibbles 16-31; Q5_0's
 * fifth bit from qh, bit j for element j), then y = (float)q * d, + m for
 * Q4_1: the scalar reference's multiply and add, lane by lane (no FMA:
 * -ffp-contract=off). f16 output is clamped to +-KVR_CODEC_F16_LIMIT, a NaN
 * left a NaN (the scalar clamp's comparisons are false for it), and
 * converted with round-to-nearest-even: the scalar decoder's bytes. */
AI void dec_block_v(kvr_codec_type t, const uint8_t *x, __m512 *py0, __m512 *py1)
{
    /* F16C's conversion is exact, as kvr_f16_to_f32 */
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(kvr_le16_get(x)));
    __m512i q0, q1;
    switch (t) {
    case KVR_CODEC_Q8_0:
        q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + 2)));
        q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + 18)));
        break;
    case KVR_CODEC_Q4_0:
    case KVR_CODEC_Q4_1: {
        __m512i p = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(x + (t == KVR_CODEC_Q4_1 ? 4 : 2))));
        const __m512i lo4 = _mm512_set1_epi32(0x0F);
        q0 = _mm512_and_si512(p, lo4);
        q1 = _mm512_srli_epi32(p, 4);
        if (t == KVR_CODEC_Q4_0) {
            q0 = _mm512_sub_epi32(q0, _mm512_set1_epi32(8));
            q1 = _mm512_sub_epi32(q1, _mm512_set1_epi32(8));
        }
        break;
    }
    default: { /* Q5_0 */
        uint32_t qh;
        memcpy(&qh, x + 2, 4);
        __m512i p = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(x + 6)));
        const __m512i lo4 = _mm512_set1_epi32(0x0F), b4 = _mm512_set1_epi32(0x10);
        q0 = _mm512_mask_or_epi32(_mm512_and_si512(p, lo4), (__mmask16)(qh & 0xffffu),
                                  _mm512_and_si512(p, lo4), b4);
        q1 = _mm512_mask_or_epi32(_mm512_srli_epi32(p, 4), (__mmask16)(qh >> 16),
                                  _mm512_srli_epi32(p, 4), b4);
        q0 = _mm512_sub_epi32(q0, b4);
        q1 = _mm512_sub_epi32(q1, b4);
        break;
    }
    }
    __m512 y0 = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d);
    __m512 y1 = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d);
    if (t == KVR_CODEC_Q4_1) {
        const __m512 m = _mm512_set1_ps(_cvtsh_ss(kvr_le16_get(x + 2)));
        y0 = _mm512_add_ps(y0, m);
        y1 = _mm512_add_ps(y1, m);
    }
    *py0 = y0;
    *py1 = y1;
}

AI void dec_block16(kvr_codec_type t, void *dst, size_t i, const uint8_t *x, int h, int nt)
{
    __m512 y0, y1;
    dec_block_v(t, x, &y0, &y1);
    if (nt) {
        st32_nt(dst, i, y0, y1, h);
    } else {
        st16(dst, i, y0, h);
        st16(dst, i + 16, y1, h);
    }
}

/* One loop per (type, output, stores): the block's switch folds away. */
#define DEC_LOOP(T, H, NT)                                                               \
    for (size_t i = 0; i < n; i += QK) dec_block16(T, dst, i, src + i / QK * bb, H, NT); \
    return;
#define DEC_SWITCH(NT)                                                                   \
    switch (t) {                                                                         \
    case KVR_CODEC_Q8_0: if (h) { DEC_LOOP(KVR_CODEC_Q8_0, 1, NT) } DEC_LOOP(KVR_CODEC_Q8_0, 0, NT) \
    case KVR_CODEC_Q4_0: if (h) { DEC_LOOP(KVR_CODEC_Q4_0, 1, NT) } DEC_LOOP(KVR_CODEC_Q4_0, 0, NT) \
    case KVR_CODEC_Q4_1: if (h) { DEC_LOOP(KVR_CODEC_Q4_1, 1, NT) } DEC_LOOP(KVR_CODEC_Q4_1, 0, NT) \
    default:             if (h) { DEC_LOOP(KVR_CODEC_Q5_0, 1, NT) } DEC_LOOP(KVR_CODEC_Q5_0, 0, NT) \
    }

void kvr_codec_ggml_dec_avx512(kvr_codec_type t, void *dst, kvr_dtype dt, const uint8_t *src,
                               size_t n)
{
    const size_t bb = ggml_block_bytes(t);
    int h = dt == KVR_DTYPE_F16;
    DEC_SWITCH(0)
}

static void dec_nt(kvr_codec_type t, void *dst, kvr_dtype dt, const uint8_t *src, size_t n)
{
    const size_t bb = ggml_block_bytes(t);
    int h = dt == KVR_DTYPE_F16;
    DEC_SWITCH(1)
}
#undef DEC_SWITCH
#undef DEC_LOOP

/* The decoder with non-temporal stores (codec.h: ggml_dec_nt): dst on 64
 * bytes, f32 or f16 output; fenced before it returns. */
bool kvr_codec_ggml_dec_nt_avx512(kvr_codec_type t, void *dst, kvr_dtype dt, const uint8_t *src,
                                  size_t n)
{
    if ((uintptr_t)dst % 64 || (dt != KVR_DTYPE_F16 && dt != KVR_DTYPE_F32))
        return false;
    dec_nt(t, dst, dt, src, n);
    _mm_sfence();
    return true;
}

/* ---- encode and measure (kvr_codec_encode_measured) ----------------------
 * A row is encoded as kvr_codec_ggml_enc_avx512 encodes it, then measured
 * while it is in L1: each block decoded in registers (dec_block_v, the
 * decoder's values) against the row's values, into the lanes (a block's 32
 * values are lanes (k mod 64) .. + 31; a block of the measure, 1024, ends on
 * a ggml block's end). */
AI void err_row_blocks(kvr_codec_type t, const uint8_t *codes, const void *ref, size_t len,
                       int h, double *pe, double *pq, bool *wide)
{
    const size_t bb = ggml_block_bytes(t);
    __m512d E[8], Q[8];   /* set by the first flush */
    mlanes L = MLANES_ZERO;
    int first_ = 1;
    /* two blocks a step (lanes 0-31, then 32-63), a last one alone */
    for (size_t k = 0; k < len; k += 2 * QK, codes += 2 * bb) {
        __m512 y0, y1;
        dec_block_v(t, codes, &y0, &y1);
        ERR_ACC(err_ref16(ref, k, h), y0, L.e0, L.q0);
        ERR_ACC(err_ref16(ref, k + 16, h), y1, L.e1, L.q1);
        if (k + QK < len) {
            dec_block_v(t, codes + bb, &y0, &y1);
            ERR_ACC(err_ref16(ref, k + 32, h), y0, L.e2, L.q2);
            ERR_ACC(err_ref16(ref, k + 48, h), y1, L.e3, L.q3);
        }
        if (((k + 2 * QK) & (KVR_ERR_BLOCK - 1)) == 0 || k + 2 * QK >= len) {
            ERR_FLUSH_ALL(L);
            L = MLANES_ZERO;
            first_ = 0;
        }
    }
    *wide = !err_finish16(E, Q, pe, pq);
}

#define ERR_CASE(T)                                                                      \
    case T:                                                                              \
        for (size_t r = 0; r < n_rows; r++) {                                            \
            uint8_t *d = dst + r * rb;                                                   \
            const char *x = (const char *)src + r * len * es;                            \
            if (kvr_codec_ggml_enc_avx512(T, d, x, st, len) != 0)                        \
                return -1;                                                               \
            if (h) err_row_blocks(T, d, x, len, 1, &e[r], &q[r], &wide[r]);              \
            else   err_row_blocks(T, d, x, len, 0, &e[r], &q[r], &wide[r]);              \
        }                                                                                \
        return 0;

int kvr_codec_ggml_enc_err_avx512(kvr_codec_type t, uint8_t *dst, const void *src, kvr_dtype st,
                                  size_t n_rows, size_t len, double *e, double *q, bool *wide)
{
    const int h = st == KVR_DTYPE_F16;
    const size_t rb = len / QK * ggml_block_bytes(t), es = h ? 2 : 4;
    switch (t) {
    ERR_CASE(KVR_CODEC_Q8_0)
    ERR_CASE(KVR_CODEC_Q4_0)
    ERR_CASE(KVR_CODEC_Q4_1)
    ERR_CASE(KVR_CODEC_Q5_0)
    default: return 1;   /* not one of these types: not handled */
    }
}
#undef ERR_CASE
