/*
 * ggml_quants.c — the scalar reference of ggml's legacy blocks
 * (base/ggml_quants.h): every product, sum and rounding as ggml-quants.c's
 * *_ref functions evaluate them, so the bytes are ggml's. The store's SIMD
 * kernels (cache/codec_ggml_*.c) are tested against this code, bit for bit.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "base/ggml_quants.h"
#include "base/half.h"
#include "base/le.h"

#define QK KVR_GGML_QK

static inline int f16_finite(uint16_t h) { return (h & 0x7C00) != 0x7C00; }

size_t kvr_ggml_block_bytes(kvr_ggml_qtype t)
{
    switch (t) {
    case KVR_GGML_Q8_0: return 34;
    case KVR_GGML_Q4_0: return 18;
    case KVR_GGML_Q4_1: return 20;
    case KVR_GGML_Q5_0: return 22;
    }
    return 0;
}

int kvr_ggml_block_enc(kvr_ggml_qtype t, uint8_t *y, const float *x)
{
    switch (t) {
    case KVR_GGML_Q8_0: {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(x[j]);
            amax = a > amax ? a : amax;     /* fmaxf, without the libm call */
        }
        const float d = amax / ((1 << 7) - 1);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = kvr__f2h(d);
        kvr_le16_put(y, dh);
        for (int j = 0; j < QK; ++j)
            y[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
        return f16_finite(dh) ? 0 : -1;
    }
    case KVR_GGML_Q4_0:
    case KVR_GGML_Q5_0: {
        const int q5 = t == KVR_GGML_Q5_0;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; j++)
            if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
        const float d = q5 ? max / -16 : max / -8;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = kvr__f2h(d);
        kvr_le16_put(y, dh);
        if (!q5) {
            for (int j = 0; j < QK / 2; ++j) {
                int a = (int8_t)(x[j] * id + 8.5f), b = (int8_t)(x[QK / 2 + j] * id + 8.5f);
                y[2 + j] = (uint8_t)((a < 15 ? a : 15) | (b < 15 ? b : 15) << 4);
            }
        } else {
            uint32_t qh = 0;
            for (int j = 0; j < QK / 2; ++j) {
                int a = (int8_t)(x[j] * id + 16.5f), b = (int8_t)(x[QK / 2 + j] * id + 16.5f);
                const uint8_t x0 = (uint8_t)(a < 31 ? a : 31), x1 = (uint8_t)(b < 31 ? b : 31);
                y[6 + j] = (uint8_t)((x0 & 0x0F) | ((x1 & 0x0F) << 4));
                qh |= ((x0 & 0x10u) >> 4) << (j + 0);
                qh |= ((x1 & 0x10u) >> 4) << (j + QK / 2);
            }
            kvr_le32_put(y + 2, qh);
        }
        return f16_finite(dh) ? 0 : -1;
    }
    case KVR_GGML_Q4_1: {
        float min = FLT_MAX, max = -FLT_MAX;
        for (int j = 0; j < QK; j++) {
            if (x[j] < min) min = x[j];
            if (x[j] > max) max = x[j];
        }
        const float d = (max - min) / ((1 << 4) - 1);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = kvr__f2h(d), mh = kvr__f2h(min);
        kvr_le16_put(y, dh);
        kvr_le16_put(y + 2, mh);
        for (int j = 0; j < QK / 2; ++j) {
            int a = (int8_t)((x[j] - min) * id + 0.5f);
            int b = (int8_t)((x[QK / 2 + j] - min) * id + 0.5f);
            y[4 + j] = (uint8_t)((a < 15 ? a : 15) | (b < 15 ? b : 15) << 4);
        }
        return f16_finite(dh) && f16_finite(mh) ? 0 : -1;
    }
    }
    return -1;
}

void kvr_ggml_block_dec(kvr_ggml_qtype t, float *y, const uint8_t *x)
{
    const float d = kvr__h2f(kvr_le16_get(x));
    switch (t) {
    case KVR_GGML_Q8_0:
        for (int j = 0; j < QK; ++j) y[j] = (float)(int8_t)x[2 + j] * d;
        break;
    case KVR_GGML_Q4_0:
        for (int j = 0; j < QK / 2; ++j) {
            y[j] = (float)((x[2 + j] & 0x0F) - 8) * d;
            y[j + QK / 2] = (float)((x[2 + j] >> 4) - 8) * d;
        }
        break;
    case KVR_GGML_Q4_1: {
        const float m = kvr__h2f(kvr_le16_get(x + 2));
        for (int j = 0; j < QK / 2; ++j) {
            float p0 = (float)(x[4 + j] & 0x0F) * d, p1 = (float)(x[4 + j] >> 4) * d;
            y[j] = p0 + m;
            y[j + QK / 2] = p1 + m;
        }
        break;
    }
    case KVR_GGML_Q5_0: {
        const uint32_t qh = kvr_le32_get(x + 2);
        for (int j = 0; j < QK / 2; ++j) {
            const uint8_t h0 = (uint8_t)(((qh >> (j + 0)) << 4) & 0x10);
            const uint8_t h1 = (uint8_t)(((qh >> (j + 12))) & 0x10);
            y[j] = (float)(((x[6 + j] & 0x0F) | h0) - 16) * d;
            y[j + QK / 2] = (float)(((x[6 + j] >> 4) | h1) - 16) * d;
        }
        break;
    }
    }
}
