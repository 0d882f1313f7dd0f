/*
 * codec_ggml_avx2.c — AVX2/FMA/F16C kernels for ggml's legacy blocks (Q8_0,
 * Q4_0, Q4_1, Q5_0), f32 or f16 in and out; called only after the CPU was
 * checked (codec.c's dispatch; the AVX-512 kernel set uses these too).
 *
 * They must write exactly the bytes of the scalar reference in codec.c
 * (ggml's quantize_row_*_ref / dequantize_row_*), so each block runs the
 * reference's float operations in the same order, lane by lane:
 *   - amax, min, max are exact whatever the order (the inputs are finite);
 *     Q4_0/Q5_0's "max" is the FIRST element of largest magnitude (a mask of
 *     |x| == amax, lowest set bit), +0 when amax is 0, as the reference's
 *     strict comparison leaves it;
 *   - d, id and the f16 conversion of d (and m) are the scalar expressions;
 *   - Q8_0's roundf (half away from zero) is trunc(v + copysign(0x1.fffffep-2f,
 *     v)), equal to roundf for every float |v| < 129 (checked exhaustively;
 *     here |v| <= 127 (1 + 3 eps));
 *   - the (int8_t) casts of v + 8.5f etc. are truncations (cvttps) of values
 *     in [0, 33);
 *   - Q4_1 blocks whose min or max is a zero go to the scalar block encoder
 *     (the reference keeps the FIRST zero's sign, which min/max do not
 *     promise);
 *   - decode: q*d, then + m for Q4_1, as a separate multiply and add (this
 *     file is built with -ffp-contract=off: never an FMA); f16 output is
 *     clamped to +-65504 and rounded to nearest even, as store_elem does.
 * A non-finite input, or a d or m that overflows f16, makes the encoder
 * return -1: the caller reruns the scalar path, which names the element.
 */
#include "cache/codec.h"
#include "cache/codec_inl.h"

#include <float.h>
#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))
#include "cache/codec_avx2_inl.h"
#define QK 32

/* 4 x 8 int32 (each in int8 range) -> 32 bytes in element order. */
AI __m256i narrow32(__m256i q0, __m256i q1, __m256i q2, __m256i q3)
{
    __m256i a = _mm256_packs_epi32(q0, q1), b = _mm256_packs_epi32(q2, q3);
    __m256i c = _mm256_packs_epi16(a, b);
    return _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static bool f16_finite(uint16_t h) { return (h & 0x7C00) != 0x7C00; }

/* byte j = q[j] | q[j+16] << 4, for 32 quants below 16 in element order */
AI __m128i nibbles(__m256i b)
{
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    return _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
}

/* roundf (half away from zero) as trunc(v + copysign(0x1.fffffep-2f, v)): the
 * same for every float |v| < 129 (checked exhaustively), and Q8_0's
 * |v| <= 127 (1 + 3 eps). */
AI __m256i round_away_epi32(__m256 v)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 h = _mm256_or_ps(_mm256_set1_ps(0x1.fffffep-2f), _mm256_and_ps(sign, v));
    return _mm256_cvttps_epi32(_mm256_add_ps(v, h));
}

/* One block; returns 0, -1 bad input (non-finite / f16 overflow), 1 "use the
 * scalar encoder for this block". */
AI int enc_block(kvr_codec_type t, uint8_t *y, const void *src, size_t i, int h)
{
    __m256 x[4];
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    __m256 ax = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        x[k] = ld8(src, i + 8 * (size_t)k, h);
        __m256 a = _mm256_andnot_ps(sign, x[k]);
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, _mm256_set1_ps(FLT_MAX), _CMP_LE_OQ));
        ax = _mm256_max_ps(ax, a);
    }
    if (_mm256_movemask_ps(ok) != 0xff) return -1;
    switch (t) {
    case KVR_CODEC_Q8_0: {
        const float amax = hmax8(ax);
        const float d = amax / ((1 << 7) - 1);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = kvr_f32_to_f16(d);
        if (!f16_finite(dh)) return -1;
        kvr_le16_put(y, dh);
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = round_away_epi32(_mm256_mul_ps(x[k], vid));
        _mm256_storeu_si256((__m256i *)(y + 2), narrow32(q[0], q[1], q[2], q[3]));
        return 0;
    }
    case KVR_CODEC_Q4_0:
    case KVR_CODEC_Q5_0: {
        const int q5 = t == KVR_CODEC_Q5_0;
        const float amax = hmax8(ax);
        float max = 0.0f;
        if (amax != 0.0f) {
            const __m256 va = _mm256_set1_ps(amax);
            uint32_t m = 0;
            for (int k = 0; k < 4; k++)
                m |= (uint32_t)_mm256_movemask_ps(
                         _mm256_cmp_ps(_mm256_andnot_ps(sign, x[k]), va, _CMP_EQ_OQ)) << (8 * k);
            float xs[QK];
            for (int k = 0; k < 4; k++) _mm256_storeu_ps(xs + 8 * k, x[k]);
            max = m ? xs[__builtin_ctz(m)] : 0.0f;   /* m == 0: a NaN, refused above */
        }
        const float d = q5 ? max / -16 : max / -8;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = kvr_f32_to_f16(d);
        if (!f16_finite(dh)) return -1;
        kvr_le16_put(y, dh);
        const __m256 vid = _mm256_set1_ps(id), off = _mm256_set1_ps(q5 ? 16.5f : 8.5f);
        const __m256i top = _mm256_set1_epi32(q5 ? 31 : 15);
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_min_epi32(_mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(x[k], vid), off)),
                                    top);
        __m256i b = narrow32(q[0], q[1], q[2], q[3]);
        if (!q5) {
            _mm_storeu_si128((__m128i *)(y + 2), nibbles(b));
        } else {
            uint32_t qh = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(b, 3));
            memcpy(y + 2, &qh, 4);   /* little-endian, as kvr_le32_put */
            _mm_storeu_si128((__m128i *)(y + 6), nibbles(_mm256_and_si256(b, _mm256_set1_epi8(0x0F))));
        }
        return 0;
    }
    case KVR_CODEC_Q4_1: {
        __m256 mn = _mm256_min_ps(_mm256_min_ps(x[0], x[1]), _mm256_min_ps(x[2], x[3]));
        __m256 mx = _mm256_max_ps(_mm256_max_ps(x[0], x[1]), _mm256_max_ps(x[2], x[3]));
        const float min = hmin8(mn), max = hmax8(mx);
        if (min == 0.0f || max == 0.0f) return 1;
        const float d = (max - min) / ((1 << 4) - 1);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = kvr_f32_to_f16(d), mh = kvr_f32_to_f16(min);
        if (!f16_finite(dh) || !f16_finite(mh)) return -1;
        kvr_le16_put(y, dh);
        kvr_le16_put(y + 2, mh);
        const __m256 vid = _mm256_set1_ps(id), vm = _mm256_set1_ps(min), half = _mm256_set1_ps(0.5f);
        const __m256i top = _mm256_set1_epi32(15);
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_min_epi32(_mm256_cvttps_epi32(_mm256_add_ps(
                       _mm256_mul_ps(_mm256_sub_ps(x[k], vm), vid), half)), top);
        _mm_storeu_si128((__m128i *)(y + 4), nibbles(narrow32(q[0], q[1], q[2], q[3])));
        return 0;
    }
    default:
        return -1;
    }
}

AI float h2f1(uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }

/* The quants of one block from its values, id (and min for Q4_1). */
AI void quant_block(kvr_codec_type t, uint8_t *y, const __m256 *x, float id, float min)
{
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q0, q1, q2, q3;
    if (t == KVR_CODEC_Q8_0) {
        q0 = round_away_epi32(_mm256_mul_ps(x[0], vid));
        q1 = round_away_epi32(_mm256_mul_ps(x[1], vid));
        q2 = round_away_epi32(_mm256_mul_ps(x[2], vid));
        q3 = round_away_epi32(_mm256_mul_ps(x[3], vid));
        _mm256_storeu_si256((__m256i *)(y + 2), narrow32(q0, q1, q2, q3));
        return;
    }
    const int q5 = t == KVR_CODEC_Q5_0, q41 = t == KVR_CODEC_Q4_1;
    const __m256 off = _mm256_set1_ps(q5 ? 16.5f : q41 ? 0.5f : 8.5f);
    const __m256i top = _mm256_set1_epi32(q5 ? 31 : 15);
    const __m256 vm = _mm256_set1_ps(min);
#define Q(v) _mm256_min_epi32(_mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps( \
                 q41 ? _mm256_sub_ps((v), vm) : (v), vid), off)), top)
    q0 = Q(x[0]); q1 = Q(x[1]); q2 = Q(x[2]); q3 = Q(x[3]);
#undef Q
    __m256i b = narrow32(q0, q1, q2, q3);
    if (q5) {
        uint32_t qh = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(b, 3));
        memcpy(y + 2, &qh, 4);   /* little-endian, as kvr_le32_put */
        _mm_storeu_si128((__m128i *)(y + 6), nibbles(_mm256_and_si256(b, _mm256_set1_epi8(0x0F))));
    } else {
        _mm_storeu_si128((__m128i *)(y + (q41 ? 4 : 2)), nibbles(b));
    }
}

/* Eight blocks (256 values) at i: a first pass finds each block's extremes,
 * d, id and their f16 forms are computed eight at a time, a second pass
 * (the data still in L1) writes the quants. Same bytes as enc_block. */
AI int enc8(kvr_codec_type t, uint8_t *dst, size_t bb, const void *src, size_t i, int h)
{
    float p0[8], p1[8];
    unsigned fb = 0;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int b = 0; b < 8; b++) {
        size_t o = i + 32 * (size_t)b;
        __m256 x0 = ld8(src, o, h), x1 = ld8(src, o + 8, h), x2 = ld8(src, o + 16, h),
               x3 = ld8(src, o + 24, h);
        __m256 a0 = _mm256_andnot_ps(sign, x0), a1 = _mm256_andnot_ps(sign, x1),
               a2 = _mm256_andnot_ps(sign, x2), a3 = _mm256_andnot_ps(sign, x3);
        __m256 ax = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
        /* each vector checked on its own: max drops a NaN in its first operand */
        const __m256 lim = _mm256_set1_ps(FLT_MAX);
        ok = _mm256_and_ps(ok, _mm256_and_ps(
                 _mm256_and_ps(_mm256_cmp_ps(a0, lim, _CMP_LE_OQ), _mm256_cmp_ps(a1, lim, _CMP_LE_OQ)),
                 _mm256_and_ps(_mm256_cmp_ps(a2, lim, _CMP_LE_OQ), _mm256_cmp_ps(a3, lim, _CMP_LE_OQ))));
        if (t == KVR_CODEC_Q8_0) {
            p0[b] = hmax8(ax);
        } else if (t == KVR_CODEC_Q4_1) {
            __m256 mn = _mm256_min_ps(_mm256_min_ps(x0, x1), _mm256_min_ps(x2, x3));
            __m256 mx = _mm256_max_ps(_mm256_max_ps(x0, x1), _mm256_max_ps(x2, x3));
            p0[b] = hmin8(mn);
            p1[b] = hmax8(mx);
            if (p0[b] == 0.0f || p1[b] == 0.0f) fb |= 1u << b;
        } else {
            float amax = hmax8(ax);
            p0[b] = 0.0f;
            if (amax != 0.0f) {
                const __m256 va = _mm256_set1_ps(amax);
                uint32_t m = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a0, va, _CMP_EQ_OQ)) |
                             (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a1, va, _CMP_EQ_OQ)) << 8 |
                             (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a2, va, _CMP_EQ_OQ)) << 16 |
                             (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a3, va, _CMP_EQ_OQ)) << 24;
                /* m == 0 only with a NaN in the block, which is refused below */
                if (m) {
                    size_t k = o + (size_t)__builtin_ctz(m);
                    p0[b] = h ? h2f1(((const uint16_t *)src)[k]) : ((const float *)src)[k];
                }
            }
        }
    }
    if (_mm256_movemask_ps(ok) != 0xff) return -1;
    __m256 v0 = _mm256_loadu_ps(p0), d;
    switch (t) {
    case KVR_CODEC_Q8_0: d = _mm256_div_ps(v0, _mm256_set1_ps((float)((1 << 7) - 1))); break;
    case KVR_CODEC_Q4_0: d = _mm256_div_ps(v0, _mm256_set1_ps(-8.0f)); break;
    case KVR_CODEC_Q5_0: d = _mm256_div_ps(v0, _mm256_set1_ps(-16.0f)); break;
    default:
        d = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(p1), v0),
                          _mm256_set1_ps((float)((1 << 4) - 1)));
        break;
    }
    __m256 id = _mm256_and_ps(_mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_NEQ_OQ),
                              _mm256_div_ps(_mm256_set1_ps(1.0f), d));
#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)   /* clang wants a constant expression */
    __m128i dh = _mm256_cvtps_ph(d, RNE), mh = _mm256_cvtps_ph(v0, RNE);
    const __m128i em = _mm_set1_epi16(0x7C00);
    __m128i inf = _mm_cmpeq_epi16(_mm_and_si128(dh, em), em);
    if (t == KVR_CODEC_Q4_1) inf = _mm_or_si128(inf, _mm_cmpeq_epi16(_mm_and_si128(mh, em), em));
    /* a block left to the scalar encoder answers for its own parameters */
    unsigned bad = (unsigned)_mm_movemask_epi8(_mm_packs_epi16(inf, inf)) & 0xffu & ~fb;
    if (bad) return -1;
    float ids[8];
    uint16_t dhs[8], mhs[8];
    _mm256_storeu_ps(ids, id);
    _mm_storeu_si128((__m128i *)dhs, dh);
    _mm_storeu_si128((__m128i *)mhs, mh);
    for (int b = 0; b < 8; b++) {
        size_t o = i + 32 * (size_t)b;
        uint8_t *y = dst + o / QK * bb;
        __m256 x[4] = { ld8(src, o, h), ld8(src, o + 8, h), ld8(src, o + 16, h), ld8(src, o + 24, h) };
        if (fb & (1u << b)) {
            float xs[QK];
            for (int k = 0; k < 4; k++) _mm256_storeu_ps(xs + 8 * k, x[k]);
            if (kvr_codec_ggml_block_enc(t, y, xs) != 0) return -1;
            continue;
        }
        kvr_le16_put(y, dhs[b]);
        if (t == KVR_CODEC_Q4_1) kvr_le16_put(y + 2, mhs[b]);
        quant_block(t, y, x, ids[b], p0[b]);
    }
    return 0;
}

#define ENC_CASE(T)                                                                  \
    case T:                                                                          \
        for (; i + 256 <= n; i += 256)                                               \
            if ((h ? enc8(T, dst, bb, src, i, 1) : enc8(T, dst, bb, src, i, 0)) != 0) \
                return -1;                                                           \
        break;

int kvr_codec_ggml_enc_avx2(kvr_codec_type t, uint8_t *dst, const void *src, kvr_dtype st,
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
    for (; i < n; i += QK) {
        uint8_t *y = dst + i / QK * bb;
        int rc = h ? enc_block(t, y, src, i, 1) : enc_block(t, y, src, i, 0);
        if (rc < 0) return -1;
        if (rc > 0) {
            float xs[QK];
            for (int k = 0; k < 4; k++) _mm256_storeu_ps(xs + 8 * k, ld8(src, i + 8 * (size_t)k, h));
            if (kvr_codec_ggml_block_enc(t, y, xs) != 0) return -1;
        }
    }
    return 0;
}

/* 32 bytes of bit j of qh at byte j (0xFF / 0x00). */
AI __m256i bits_to_bytes(uint32_t qh)
{
    __m256i v = _mm256_set1_epi32((int)qh);
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000ll, 0x0101010101010101ll,
                                            0x0202020202020202ll, 0x0303030303030303ll);
    v = _mm256_shuffle_epi8(v, shuf);
    const __m256i bit = _mm256_set1_epi64x((long long)0x7fbfdfeff7fbfdfeull);
    v = _mm256_or_si256(v, bit);
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

AI void dec_block(kvr_codec_type t, void *dst, size_t i, const uint8_t *x, int h)
{
    /* F16C's conversion is exact, as kvr_f16_to_f32 (NaN payloads quieted
     * either way once multiplied) */
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(kvr_le16_get(x)));
    __m256i b;   /* the 32 quants as signed bytes, element order */
    __m256 m = _mm256_setzero_ps();
    int add_m = 0;
    switch (t) {
    case KVR_CODEC_Q8_0:
        b = _mm256_loadu_si256((const __m256i *)(x + 2));
        break;
    case KVR_CODEC_Q4_1:
        m = _mm256_set1_ps(_cvtsh_ss(kvr_le16_get(x + 2)));
        add_m = 1;
        /* fall through */
    case KVR_CODEC_Q4_0: {
        __m128i p = _mm_loadu_si128((const __m128i *)(x + (add_m ? 4 : 2)));
        const __m128i lo4 = _mm_set1_epi8(0x0F);
        b = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), lo4), _mm_and_si128(p, lo4));
        if (!add_m) b = _mm256_sub_epi8(b, _mm256_set1_epi8(8));
        break;
    }
    default: { /* Q5_0 */
        uint32_t qh;
        memcpy(&qh, x + 2, 4);
        __m128i p = _mm_loadu_si128((const __m128i *)(x + 6));
        const __m128i lo4 = _mm_set1_epi8(0x0F);
        b = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), lo4), _mm_and_si128(p, lo4));
        b = _mm256_or_si256(b, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
        b = _mm256_sub_epi8(b, _mm256_set1_epi8(16));
        break;
    }
    }
    __m128i b0 = _mm256_castsi256_si128(b), b1 = _mm256_extracti128_si256(b, 1);
    __m256i q[4] = {
        _mm256_cvtepi8_epi32(b0), _mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)),
        _mm256_cvtepi8_epi32(b1), _mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)),
    };
    for (int k = 0; k < 4; k++) {
        __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(q[k]), d);
        if (add_m) y = _mm256_add_ps(y, m);
        st8(dst, i + 8 * (size_t)k, y, h);
    }
}

void kvr_codec_ggml_dec_avx2(kvr_codec_type t, void *dst, kvr_dtype dt, const uint8_t *src,
                             size_t n)
{
    /* One loop per (type, output): the block's switch folds away. */
#define DEC_LOOP(T, H)                                                              \
    for (size_t i = 0; i < n; i += QK) dec_block(T, dst, i, src + i / QK * bb, H);  \
    return;
    const size_t bb = ggml_block_bytes(t);
    int h = dt == KVR_DTYPE_F16;
    switch (t) {
    case KVR_CODEC_Q8_0: if (h) { DEC_LOOP(KVR_CODEC_Q8_0, 1) } DEC_LOOP(KVR_CODEC_Q8_0, 0)
    case KVR_CODEC_Q4_0: if (h) { DEC_LOOP(KVR_CODEC_Q4_0, 1) } DEC_LOOP(KVR_CODEC_Q4_0, 0)
    case KVR_CODEC_Q4_1: if (h) { DEC_LOOP(KVR_CODEC_Q4_1, 1) } DEC_LOOP(KVR_CODEC_Q4_1, 0)
    default:             if (h) { DEC_LOOP(KVR_CODEC_Q5_0, 1) } DEC_LOOP(KVR_CODEC_Q5_0, 0)
    }
#undef DEC_LOOP
}
