// Weight-only dots of K-quant rows (GGUF's Q4_K and Q6_K) against fp32 activations: each super-block of
// 256 weights is widened eight at a time (vector extensions: AVX registers on x86, NEON pairs on ARM) and
// its sub-block scales folded in as scalars, so the sum runs in vector accumulators, never horizontally
// inside a row. Layouts (ggml's block_q4_K / block_q6_K, what gguf.quants.dequantize reads):
//   Q4_K, 144 bytes: d fp16, dmin fp16, scales[12] (eight 6-bit scale/min pairs), qs[128] (4-bit):
//        per 64 weights j, 32 bytes: low nibbles are weights [64j, 64j+32), high ones [64j+32, 64j+64);
//        w = d·sc[s]·q − dmin·m[s] for sub-block s of 32.
//   Q6_K, 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d fp16;
//        w = d·scales[s]·(q − 32) for sub-block s of 16.
#ifndef FT_KQUANT_DOT_H
#define FT_KQUANT_DOT_H
#include <stdint.h>
#include <string.h>

#include "bf16_dot.h"
#include "quant_dot.h"

#define QK_K 256
#define Q4_K_BYTES 144
#define Q6_K_BYTES 210

typedef int32_t v8i __attribute__((vector_size(32)));

// Eight bytes zero-extended to 32-bit lanes, where the nibble and bit arithmetic then runs (x86 has no
// byte-lane shifts: on bytes, compilers fall back to one element at a time).
static inline v8i bytes8(const uint8_t *p) {
#if defined(__AVX2__)
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    v8i out;
    memcpy(&out, &wide, sizeof out);
    return out;
#else
    v8i out;
    for (int j = 0; j < 8; j++) out[j] = p[j];
    return out;
#endif
}

static inline v8f to_f32(v8i v) { return __builtin_convertvector(v, v8f); }

// Scale and min of Q4_K sub-block j (0..7) from the 12 packed bytes.
static inline void q4_k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline float dot_q4_k(const uint8_t *restrict w, const float *restrict x, int n) {
    v8f acc0 = {0}, acc1 = {0};
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q4_K_BYTES, *qs = blk + 16;
        const float *xb = x + (long)b * QK_K;
        PREFETCH_ROW(blk);
        uint16_t h[2];
        memcpy(h, blk, 4);
        const float d = fp16_f32(h[0]), dmin = fp16_f32(h[1]);
        for (int j = 0; j < 4; j++) {  // 64 weights: sub-blocks 2j (low nibbles) and 2j + 1 (high)
            int s0, m0, s1, m1;
            q4_k_scale_min(2 * j, blk + 4, &s0, &m0);
            q4_k_scale_min(2 * j + 1, blk + 4, &s1, &m1);
            const float a0 = d * s0, b0 = dmin * m0, a1 = d * s1, b1 = dmin * m1;
            for (int l = 0; l < 32; l += 8) {
                const v8i q = bytes8(qs + 32 * j + l);
                const v8f x0 = load8f(xb + 64 * j + l), x1 = load8f(xb + 64 * j + 32 + l);
                acc0 += a0 * (to_f32(q & 15) * x0) - b0 * x0;
                acc1 += a1 * (to_f32(q >> 4) * x1) - b1 * x1;
            }
        }
    }
    return sum8(acc0 + acc1);
}

static inline float dot_q6_k(const uint8_t *restrict w, const float *restrict x, int n) {
    v8f acc0 = {0}, acc1 = {0};
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q6_K_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        uint16_t h;
        memcpy(&h, blk + 208, 2);
        const float d = fp16_f32(h);
        PREFETCH_ROW(blk);
        for (int half = 0; half < 2; half++) {  // 128 weights: ql 64 bytes, qh 32 bytes, 8 scales
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const int8_t *s = sc + 8 * half;
            const float *xb = x + (long)b * QK_K + 128 * half;
            for (int l = 0; l < 32; l += 8) {
                const int is = l / 16;
                const v8i lo = bytes8(ql + l), hi = bytes8(ql + l + 32), top = bytes8(qh + l);
                const v8f q1 = to_f32(((lo & 15) | ((top & 3) << 4)) - 32);
                const v8f q2 = to_f32(((hi & 15) | (((top >> 2) & 3) << 4)) - 32);
                const v8f q3 = to_f32(((lo >> 4) | (((top >> 4) & 3) << 4)) - 32);
                const v8f q4 = to_f32(((hi >> 4) | (((top >> 6) & 3) << 4)) - 32);
                acc0 += (d * s[is]) * (q1 * load8f(xb + l)) + (d * s[is + 2]) * (q2 * load8f(xb + 32 + l));
                acc1 += (d * s[is + 4]) * (q3 * load8f(xb + 64 + l)) + (d * s[is + 6]) * (q4 * load8f(xb + 96 + l));
            }
        }
    }
    return sum8(acc0 + acc1);
}

// Rows widened to fp32 (for several dots with the same row): the values gguf.quants.dequantize gives.
static inline void dequant_q4_k(const uint8_t *restrict w, float *restrict out, int n) {
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q4_K_BYTES, *qs = blk + 16;
        float *y = out + (long)b * QK_K;
        uint16_t h[2];
        memcpy(h, blk, 4);
        const float d = fp16_f32(h[0]), dmin = fp16_f32(h[1]);
        for (int j = 0; j < 4; j++) {
            int s0, m0, s1, m1;
            q4_k_scale_min(2 * j, blk + 4, &s0, &m0);
            q4_k_scale_min(2 * j + 1, blk + 4, &s1, &m1);
            const float a0 = d * s0, b0 = dmin * m0, a1 = d * s1, b1 = dmin * m1;
            for (int l = 0; l < 32; l++) {
                y[64 * j + l] = a0 * (float)(qs[32 * j + l] & 15) - b0;
                y[64 * j + 32 + l] = a1 * (float)(qs[32 * j + l] >> 4) - b1;
            }
        }
    }
}

static inline void dequant_q6_k(const uint8_t *restrict w, float *restrict out, int n) {
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q6_K_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        uint16_t h;
        memcpy(&h, blk + 208, 2);
        const float d = fp16_f32(h);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const int8_t *s = sc + 8 * half;
            float *y = out + (long)b * QK_K + 128 * half;
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                y[l] = d * s[is] * (float)(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
                y[l + 32] = d * s[is + 2] * (float)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = d * s[is + 4] * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = d * s[is + 6] * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

#endif
