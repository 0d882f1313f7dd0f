/*
 * rope_avx512.c — AVX-512 (F/BW/VL/DQ) rows kernel and conversions. Built
 * with AVX-512 flags for this file only; called only when cpuid says the CPU
 * has them (rope.c).
 *
 * 16 floats per vector. f16 goes through vcvtph2ps/vcvtps2ph (exact and
 * round-to-nearest-even, as the scalar conversion), bf16 through integer
 * shifts with the same round-to-nearest-even rule as the scalar. Tails use
 * masked loads and stores, so there is no scalar remainder loop, and the
 * arithmetic is the scalar reference's (see rope_internal.h):
 *   NEOX rot=8 --> [ccccssss]: o0 = fmsub(x0, c, x1*s), o1 = fmadd(x1, c, x0*s)
 *   GPTJ rot=8 --> [cscscscs]: o = fmadd(x, c', swap_pairs(x) * s'), s' = [-s, s]
 */
#include <immintrin.h>
#include <string.h>

#include "rope/rope_internal.h"

#define AI static inline __attribute__((always_inline))

AI __m512 ld(const void *p, size_t i, kvr_dtype t)
{
    if (t == KVR_DTYPE_F32) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (t == KVR_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI __m512 ldm(const void *p, size_t i, kvr_dtype t, __mmask16 m)
{
    if (t == KVR_DTYPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    if (t == KVR_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI __m256i to_bf16(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, nan, q);
    return _mm512_cvtepi32_epi16(r);
}

AI void st(void *p, size_t i, kvr_dtype t, __m512 v)
{
    if (t == KVR_DTYPE_F32) { _mm512_storeu_ps((float *)p + i, v); return; }
    __m256i h = t == KVR_DTYPE_F16 ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                   : to_bf16(v);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), h);
}

AI void stm(void *p, size_t i, kvr_dtype t, __m512 v, __mmask16 m)
{
    if (t == KVR_DTYPE_F32) { _mm512_mask_storeu_ps((float *)p + i, m, v); return; }
    __m256i h = t == KVR_DTYPE_F16 ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                   : to_bf16(v);
    _mm256_mask_storeu_epi16((uint16_t *)p + i, m, h);
}

/* st() with a non-temporal store (dst aligned to the vector: the caller
 * checks). */
AI void st_nt(void *p, size_t i, kvr_dtype t, __m512 v)
{
    if (t == KVR_DTYPE_F32) { _mm512_stream_ps((float *)p + i, v); return; }
    __m256i h = t == KVR_DTYPE_F16 ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                   : to_bf16(v);
    _mm256_stream_si256((__m256i *)((uint16_t *)p + i), h);
}

/* Two vectors of 16-bit results, elements [i, i + 32), in one
 * non-temporal 64-byte store (p + i aligned to 64 bytes). */
AI void st_line(void *p, size_t i, kvr_dtype t, __m512 v0, __m512 v1)
{
    __m256i h0, h1;
    if (t == KVR_DTYPE_F16) {
        h0 = _mm512_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        h1 = _mm512_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        h0 = to_bf16(v0);
        h1 = to_bf16(v1);
    }
    _mm512_stream_si512((__m512i *)((uint16_t *)p + i),
                        _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1));
}

#define ST(nt, p, i, t, v) do { if (nt) st_nt(p, i, t, v); else st(p, i, t, v); } while (0)

AI __mmask16 tailmask(size_t n) { return (__mmask16)((1u << n) - 1u); }

AI void conv_span(void *dst, kvr_dtype dt, const void *src, kvr_dtype st_, size_t i0, size_t i1)
{
    size_t i = i0;
    for (; i + 16 <= i1; i += 16) st(dst, i, dt, ld(src, i, st_));
    if (i < i1) {
        __mmask16 m = tailmask(i1 - i);
        stm(dst, i, dt, ldm(src, i, st_, m), m);
    }
}

AI void conv_span_scaled(void *dst, kvr_dtype dt, const void *src, kvr_dtype st_, size_t i0,
                         size_t i1, __m512 kv)
{
    size_t i = i0;
    for (; i + 16 <= i1; i += 16) st(dst, i, dt, _mm512_mul_ps(ld(src, i, st_), kv));
    if (i < i1) {
        __mmask16 m = tailmask(i1 - i);
        stm(dst, i, dt, _mm512_mul_ps(ldm(src, i, st_, m), kv), m);
    }
}

/* sc: every result is multiplied by k in f32 before its store (rounded
 * once), the passed-through dims too: the bits of the unscaled kernel into
 * f32, a multiply and a conversion. */
#define SC(v) (sc ? _mm512_mul_ps((v), kv) : (v))

AI void rows_t(void *dst, const kvr_dtype dt, const void *src, const kvr_dtype st_,
               size_t n_heads, int head_dim, int rot, const int gptj,
               const float *c, const float *s, const int sc, float k, const int nt)
{
    size_t hd = (size_t)head_dim, r = (size_t)rot;
    const __m512 kv = _mm512_set1_ps(k);
    for (size_t h = 0; h < n_heads; h++) {
        size_t b = h * hd;
        if (nt) {
            /* streamed rows come from memory, not cache: ask for the rows
             * a few heads ahead (a hint; reads nothing itself) */
            /* (the element size inline: st_ is a constant here, and a
             * call per line cost a third of the streamed rows' time) */
            const size_t ssz = st_ == KVR_DTYPE_F32 ? 4 : 2;
            uintptr_t ahead = (uintptr_t)src + (b + 4 * hd) * ssz;   /* may be past the end */
            for (size_t o = 0; o < hd * ssz; o += 64)
                _mm_prefetch((const char *)(ahead + o), _MM_HINT_T0);
        }
        if (nt && dt != KVR_DTYPE_F32) {
            /* 16-bit results streamed a whole 64-byte line at a time (two
             * vectors' worth; kvr__rope_rows_stream_avx512 checked the spans are
             * multiples of 32 elements): the same values as below */
            if (gptj) {
                for (size_t j = 0; j < r; j += 32) {
                    __m512 x = ld(src, b + j, st_), y = ld(src, b + j + 16, st_);
                    __m512 xs = _mm512_permute_ps(x, 0xB1), ys = _mm512_permute_ps(y, 0xB1);
                    __m512 ox = SC(_mm512_fmadd_ps(x, _mm512_loadu_ps(c + j),
                                                   _mm512_mul_ps(xs, _mm512_loadu_ps(s + j))));
                    __m512 oy = SC(_mm512_fmadd_ps(y, _mm512_loadu_ps(c + j + 16),
                                                   _mm512_mul_ps(ys, _mm512_loadu_ps(s + j + 16))));
                    st_line(dst, b + j, dt, ox, oy);
                }
            } else {
                size_t half = r / 2;
                for (size_t i = 0; i < half; i += 32) {
                    __m512 x0 = ld(src, b + i, st_), x1 = ld(src, b + i + half, st_);
                    __m512 y0 = ld(src, b + i + 16, st_), y1 = ld(src, b + i + 16 + half, st_);
                    __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
                    __m512 cw = _mm512_loadu_ps(c + i + 16), sw = _mm512_loadu_ps(s + i + 16);
                    __m512 a0 = SC(_mm512_fmsub_ps(x0, cv, _mm512_mul_ps(x1, sv)));
                    __m512 a1 = SC(_mm512_fmadd_ps(x1, cv, _mm512_mul_ps(x0, sv)));
                    __m512 b0 = SC(_mm512_fmsub_ps(y0, cw, _mm512_mul_ps(y1, sw)));
                    __m512 b1 = SC(_mm512_fmadd_ps(y1, cw, _mm512_mul_ps(y0, sw)));
                    st_line(dst, b + i, dt, a0, b0);
                    st_line(dst, b + i + half, dt, a1, b1);
                }
            }
        } else if (gptj) {
            size_t j = 0;
            for (; j + 16 <= r; j += 16) {
                __m512 x = ld(src, b + j, st_);
                __m512 sw = _mm512_permute_ps(x, 0xB1);
                __m512 o = _mm512_fmadd_ps(x, _mm512_loadu_ps(c + j),
                                           _mm512_mul_ps(sw, _mm512_loadu_ps(s + j)));
                ST(nt, dst, b + j, dt, SC(o));
            }
            if (j < r) {
                __mmask16 m = tailmask(r - j);
                __m512 x = ldm(src, b + j, st_, m);
                __m512 sw = _mm512_permute_ps(x, 0xB1);
                __m512 o = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, c + j),
                                           _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(m, s + j)));
                stm(dst, b + j, dt, SC(o), m);
            }
        } else {
            size_t half = r / 2, i = 0;
            for (; i + 16 <= half; i += 16) {
                __m512 x0 = ld(src, b + i, st_), x1 = ld(src, b + i + half, st_);
                __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
                __m512 o0 = _mm512_fmsub_ps(x0, cv, _mm512_mul_ps(x1, sv));
                __m512 o1 = _mm512_fmadd_ps(x1, cv, _mm512_mul_ps(x0, sv));
                ST(nt, dst, b + i, dt, SC(o0));
                ST(nt, dst, b + i + half, dt, SC(o1));
            }
            if (i < half) {
                __mmask16 m = tailmask(half - i);
                __m512 x0 = ldm(src, b + i, st_, m), x1 = ldm(src, b + i + half, st_, m);
                __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
                __m512 o0 = _mm512_fmsub_ps(x0, cv, _mm512_mul_ps(x1, sv));
                __m512 o1 = _mm512_fmadd_ps(x1, cv, _mm512_mul_ps(x0, sv));
                stm(dst, b + i, dt, SC(o0), m);
                stm(dst, b + i + half, dt, SC(o1), m);
            }
        }
        if (r < hd && sc) {
            conv_span_scaled(dst, dt, src, st_, b + r, b + hd, kv);
        } else if (r < hd) {
            if (dt == st_) {
                if (dst != src)
                    memcpy((char *)dst + (b + r) * kvr_dtype_size(dt),
                           (const char *)src + (b + r) * kvr_dtype_size(st_),
                           (hd - r) * kvr_dtype_size(dt));
            } else {
                conv_span(dst, dt, src, st_, b + r, b + hd);
            }
        }
    }
}

#define ROWS_CASE(S, D)                                                              \
    if (st == S && dt == D) {                                                        \
        if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s, 0, 1.0f, 0);  \
        else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s, 0, 1.0f, 0);  \
        return;                                                                      \
    }

#define ROWS_SCALED_CASE(S, D)                                                       \
    if (st == S && dt == D) {                                                        \
        if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s, 1, k, 0);     \
        else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s, 1, k, 0);     \
        return;                                                                      \
    }

void kvr__rope_rows_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                      size_t n_heads, int head_dim, int rot, int gptj,
                      const float *c, const float *s)
{
    ROWS_CASE(KVR_DTYPE_F32, KVR_DTYPE_F32)
    ROWS_CASE(KVR_DTYPE_F32, KVR_DTYPE_F16)
    ROWS_CASE(KVR_DTYPE_F32, KVR_DTYPE_BF16)
    ROWS_CASE(KVR_DTYPE_F16, KVR_DTYPE_F32)
    ROWS_CASE(KVR_DTYPE_F16, KVR_DTYPE_F16)
    ROWS_CASE(KVR_DTYPE_F16, KVR_DTYPE_BF16)
    ROWS_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F32)
    ROWS_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F16)
    ROWS_CASE(KVR_DTYPE_BF16, KVR_DTYPE_BF16)
}

void kvr__rope_rows_scaled_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s, float k)
{
    ROWS_SCALED_CASE(KVR_DTYPE_F32, KVR_DTYPE_F32)
    ROWS_SCALED_CASE(KVR_DTYPE_F32, KVR_DTYPE_F16)
    ROWS_SCALED_CASE(KVR_DTYPE_F32, KVR_DTYPE_BF16)
    ROWS_SCALED_CASE(KVR_DTYPE_F16, KVR_DTYPE_F32)
    ROWS_SCALED_CASE(KVR_DTYPE_F16, KVR_DTYPE_F16)
    ROWS_SCALED_CASE(KVR_DTYPE_F16, KVR_DTYPE_BF16)
    ROWS_SCALED_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F32)
    ROWS_SCALED_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F16)
    ROWS_SCALED_CASE(KVR_DTYPE_BF16, KVR_DTYPE_BF16)
}

#define ROWS_STREAM_CASE(S, D)                                                            \
    if (st == S && dt == D) {                                                             \
        if (scaled) {                                                                     \
            if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s, 1, k, 1);   \
            else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s, 1, k, 1);   \
        } else {                                                                          \
            if (gptj) rows_t(dst, D, src, S, n_heads, head_dim, rot, 1, c, s, 0, 1.0f, 1); \
            else      rows_t(dst, D, src, S, n_heads, head_dim, rot, 0, c, s, 0, 1.0f, 1); \
        }                                                                                 \
        return true;                                                                      \
    }

/* kvr__rope_rows_avx512 (scaled: kvr__rope_rows_scaled_avx512) with non-temporal
 * stores of the full vectors: the same values. Only where every full
 * vector's address is aligned (dst on 64 bytes, head rows and rotary
 * halves whole vectors); false, nothing done, otherwise. The caller
 * fences (_mm_sfence via kvr__rope_stream_fence_avx512) before the data is
 * handed on. */
bool kvr__rope_rows_stream_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                             size_t n_heads, int head_dim, int rot, int gptj,
                             const float *c, const float *s, bool scaled, float k)
{
    size_t vb = 64, esz = kvr_dtype_size(dt);   /* 16-bit: two vectors a line */
    size_t part = gptj ? (size_t)rot : (size_t)rot / 2;   /* the full-vector spans */
    if (((uintptr_t)dst % 64) || ((size_t)head_dim * esz) % vb || (part * esz) % vb)
        return false;
    ROWS_STREAM_CASE(KVR_DTYPE_F32, KVR_DTYPE_F32)
    ROWS_STREAM_CASE(KVR_DTYPE_F32, KVR_DTYPE_F16)
    ROWS_STREAM_CASE(KVR_DTYPE_F32, KVR_DTYPE_BF16)
    ROWS_STREAM_CASE(KVR_DTYPE_F16, KVR_DTYPE_F32)
    ROWS_STREAM_CASE(KVR_DTYPE_F16, KVR_DTYPE_F16)
    ROWS_STREAM_CASE(KVR_DTYPE_F16, KVR_DTYPE_BF16)
    ROWS_STREAM_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F32)
    ROWS_STREAM_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F16)
    ROWS_STREAM_CASE(KVR_DTYPE_BF16, KVR_DTYPE_BF16)
    return false;
}

void kvr__rope_stream_fence_avx512(void) { _mm_sfence(); }

void kvr__rope_copy_stream_avx512(void *dst, const void *src, size_t n)
{
    char *d = dst;
    const char *s = src;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
        __m512i c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
        _mm512_stream_si512((__m512i *)(d + i), a);
        _mm512_stream_si512((__m512i *)(d + i + 64), b);
        _mm512_stream_si512((__m512i *)(d + i + 128), c);
        _mm512_stream_si512((__m512i *)(d + i + 192), e);
    }
    for (; i < n; i += 64)
        _mm512_stream_si512((__m512i *)(d + i), _mm512_loadu_si512(s + i));
    _mm_sfence();
}

#define CONV_CASE(S, D) \
    if (st == S && dt == D) { conv_span(dst, D, src, S, 0, n); return; }

void kvr__rope_convert_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st, size_t n)
{
    if (dt == st) {
        if (dst != src) memmove(dst, src, n * kvr_dtype_size(st));
        return;
    }
    CONV_CASE(KVR_DTYPE_F32, KVR_DTYPE_F16)
    CONV_CASE(KVR_DTYPE_F32, KVR_DTYPE_BF16)
    CONV_CASE(KVR_DTYPE_F16, KVR_DTYPE_F32)
    CONV_CASE(KVR_DTYPE_F16, KVR_DTYPE_BF16)
    CONV_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F32)
    CONV_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F16)
}

#define CONV_SCALED_CASE(S, D) \
    if (st == S && dt == D) { conv_span_scaled(dst, D, src, S, 0, n, kv); return; }

void kvr__rope_convert_scaled_avx512(void *dst, kvr_dtype dt, const void *src, kvr_dtype st,
                                size_t n, float k)
{
    const __m512 kv = _mm512_set1_ps(k);
    CONV_SCALED_CASE(KVR_DTYPE_F32, KVR_DTYPE_F32)
    CONV_SCALED_CASE(KVR_DTYPE_F32, KVR_DTYPE_F16)
    CONV_SCALED_CASE(KVR_DTYPE_F32, KVR_DTYPE_BF16)
    CONV_SCALED_CASE(KVR_DTYPE_F16, KVR_DTYPE_F32)
    CONV_SCALED_CASE(KVR_DTYPE_F16, KVR_DTYPE_F16)
    CONV_SCALED_CASE(KVR_DTYPE_F16, KVR_DTYPE_BF16)
    CONV_SCALED_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F32)
    CONV_SCALED_CASE(KVR_DTYPE_BF16, KVR_DTYPE_F16)
    CONV_SCALED_CASE(KVR_DTYPE_BF16, KVR_DTYPE_BF16)
}
