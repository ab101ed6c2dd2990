// No software prefetch in these dots, the stream being regular enough for the hardware prefetcher (the
// int8-activation ones, kquant_dot_int8.h, prefetch KQ_PREFETCH bytes ahead; the bf16 and Q8_0 dots keep
// bf16_dot.h's PREFETCH).
// Weight-only dots of K-quant rows (GGUF's Q4_K and Q6_K) against fp32 activations: each super-block of
// 256 weights is widened eight at a time (vector extensions: AVX registers on x86, NEON pairs on ARM) and
// its sub-block scales folded in as scalars, so the sum runs in vector accumulators, never horizontally
// inside a row. Layouts (ggml's block_q4_K / block_q6_K, what gguf.quants.dequantize reads):
//   Q4_K, 144 bytes: d fp16, dmin fp16, scales[12] (eight 6-bit scale/min pairs), qs[128] (4-bit):
//        per 64 weights j, 32 bytes: low nibbles are weights [64j, 64j+32), high ones [64j+32, 64j+64);
//        w = d·sc[s]·q − dmin·m[s] for sub-block s of 32.
//   Q6_K, 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d fp16;
//        w = d·scales[s]·(q − 32) for sub-block s of 16.
//   Q5_K, 176 bytes: d, dmin, scales[12] as Q4_K's, qh[32], qs[128]: Q4_K's nibbles with a fifth bit, for
//        the 64 weights j bit 2j of qh[l] (low nibbles) and bit 2j + 1 (high ones).
#ifndef FT_KQUANT_DOT_H
#define FT_KQUANT_DOT_H
#include <stdint.h>
#include <string.h>

#include "bf16_dot.h"
#include "quant_dot.h"

#define QK_K 256
#define Q4_K_BYTES 144
#define Q6_K_BYTES 210
#define Q5_K_BYTES 176

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

// The weight-only dots' lanes: 16 with AVX-512 (half the instructions per weight: those dots are bound by
// the core, not the bytes), 8 elsewhere. kbytes: KW bytes zero-extended to 32-bit lanes.
#if defined(__AVX512F__)
#define KW 16
typedef float kvf __attribute__((vector_size(64)));
typedef int32_t kvi __attribute__((vector_size(64)));
static inline kvi kbytes(const uint8_t *p) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    kvi out;
    memcpy(&out, &wide, sizeof out);
    return out;
}
static inline kvf kload(const float *p) {
    kvf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline float ksum(kvf v) {
    float a[16];
    memcpy(a, &v, sizeof a);
    return fold_sum(a, 16);
}
#else
#define KW 8
typedef v8f kvf;
typedef v8i kvi;
static inline kvi kbytes(const uint8_t *p) { return bytes8(p); }
static inline kvf kload(const float *p) { return load8f(p); }
static inline float ksum(kvf v) { return sum8(v); }
#endif
static inline kvf kto_f32(kvi v) { return __builtin_convertvector(v, kvf); }

// The eight 6-bit scales and mins of a Q4_K super-block from its 12 packed bytes, four at a time as 32-bit
// words: sub-blocks 0-3 keep the low six bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take
// the nibbles of bytes 8-11 and, above them, the top two bits of bytes 0-3 (scales) and 4-7 (mins).
static inline void q4_k_scales(const uint8_t *packed, uint8_t sc[8], uint8_t m[8]) {
    uint32_t u[3];
    memcpy(u, packed, sizeof u);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    const uint32_t scales[2] = {u[0] & six, (u[2] & four) | (((u[0] >> 6) & two) << 4)};
    const uint32_t mins[2] = {u[1] & six, ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4)};
    memcpy(sc, scales, sizeof scales);
    memcpy(m, mins, sizeof mins);
}

// A Q4_K super-block's weights as a[k]·q − m[k] for sub-block k: a = d·scale, m = dmin·min.
static inline void q4_k_affine(const uint8_t *blk, float a[8], float m[8]) {
    const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
    uint8_t sc[8], mn[8];
    q4_k_scales(blk + 4, sc, mn);
    for (int k = 0; k < 8; k++) a[k] = d * sc[k], m[k] = dmin * mn[k];
}

// The sum of every 32 consecutive x (what the mins of Q4_K and Q5_K multiply), n / 32 of them.
static inline void sums32(const float *restrict x, float *restrict out, int n) {
    for (int b = 0; b < n / 32; b++) {
        v8f s = load8f(x + 32L * b) + load8f(x + 32L * b + 8) + load8f(x + 32L * b + 16) + load8f(x + 32L * b + 24);
        out[b] = sum8(s);
    }
}

// A Q4_K / Q5_K super-block's scales: d·sc per sub-block (returned) and, into `mins`, dmin·m times the
// activations' sums per sub-block (xs8: the super-block's eight sums32).
static inline v8f q45_k_scales(const uint8_t *blk, const float *xs8, v8f *mins) {
    const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
    uint8_t sc[8], mn[8];
    q4_k_scales(blk + 4, sc, mn);
    *mins += dmin * (to_f32(bytes8(mn)) * load8f(xs8));
    return d * to_f32(bytes8(sc));
}

// Q4_K (`high` 0) and Q5_K (`high` 1: the fifth bit from qh) against fp32 x; xs: sums32 of x. Per sub-block
// the quants' products are summed, then scaled; the mins come from xs.
static inline float dot_q45_k(const uint8_t *restrict w, int high, const float *restrict x,
                              const float *restrict xs, int n) {
    kvf acc0 = {0}, acc1 = {0};
    v8f mins = {0};  // Σ dmin · m_k · xs_k, lane k: sub-block k
    const long bytes = high ? Q5_K_BYTES : Q4_K_BYTES;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * bytes, *qh = blk + 16, *qs = blk + (high ? 48 : 16);
        const float *xb = x + (long)b * QK_K;
        const v8f dsc = q45_k_scales(blk, xs + 8L * b, &mins);  // each sub-block's scale
        for (int j = 0; j < 4; j++) {  // 64 weights: sub-blocks 2j (low nibbles, bit 2j) and 2j + 1
            kvf p0 = {0}, p1 = {0};
            for (int l = 0; l < 32; l += KW) {
                const kvi q = kbytes(qs + 32 * j + l);
                kvi q0 = q & 15, q1 = q >> 4;
                if (high) {
                    const kvi h = kbytes(qh + l);
                    q0 |= ((h >> (2 * j)) & 1) << 4, q1 |= ((h >> (2 * j + 1)) & 1) << 4;
                }
                p0 += kto_f32(q0) * kload(xb + 64 * j + l);
                p1 += kto_f32(q1) * kload(xb + 64 * j + 32 + l);
            }
            acc0 += dsc[2 * j] * p0;
            acc1 += dsc[2 * j + 1] * p1;
        }
    }
    return ksum(acc0 + acc1) - sum8(mins);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_KQUANT_BF16 1
// dot_q45_k against activations that are bf16 values (xb: the same x as bf16; xs: sums32 of x), with the
// bf16 pair-dot instruction: a sub-block's 32 quants become bf16 by a table (0..31 are exact in bf16)
// and meet 32 activations in one instruction, where the fp32 path widens and converts 16 at a time. The
// products are exact either way; only the order of the fp32 sums differs.
static inline float dot_q45_k_bf16(const uint8_t *restrict w, int high, const uint16_t *restrict xb,
                                   const float *restrict xs, int n) {
    // the bf16 bits of 0..31: word i of the table is bf16(i)
    const __m512i table = _mm512_set_epi16(
        0x41f8, 0x41f0, 0x41e8, 0x41e0, 0x41d8, 0x41d0, 0x41c8, 0x41c0, 0x41b8, 0x41b0, 0x41a8, 0x41a0, 0x4198,
        0x4190, 0x4188, 0x4180, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0,
        0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
    const __m512i nibble = _mm512_set1_epi16(15), one = _mm512_set1_epi16(1);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    v8f mins = {0};
    const long bytes = high ? Q5_K_BYTES : Q4_K_BYTES;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * bytes, *qh = blk + 16, *qs = blk + (high ? 48 : 16);
        const uint16_t *xk = xb + (long)b * QK_K;
        float dsc[8];  // through memory: a broadcast from memory is a load, not a shuffle
        const v8f scales = q45_k_scales(blk, xs + 8L * b, &mins);
        memcpy(dsc, &scales, sizeof dsc);
        __asm__("" : "+m"(dsc));  // read back from memory below (the compiler would shuffle registers)
        const __m512i h = high ? _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)qh)) : _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {  // 64 weights: sub-blocks 2j (low nibbles, bit 2j) and 2j + 1
            const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
            __m512i q0 = _mm512_and_si512(q, nibble), q1 = _mm512_srli_epi16(q, 4);
            if (high) {
                q0 = _mm512_or_si512(q0, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * j), one), 4));
                q1 = _mm512_or_si512(q1, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * j + 1), one), 4));
            }
            const __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_permutexvar_epi16(q0, table),
                                               load_bh(xk + 64 * j));
            const __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_permutexvar_epi16(q1, table),
                                               load_bh(xk + 64 * j + 32));
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(dsc[2 * j]), p0, acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(dsc[2 * j + 1]), p1, acc1);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) - sum8(mins);
}
#else
#define HAVE_KQUANT_BF16 0
#endif

static inline float dot_q6_k(const uint8_t *restrict w, const float *restrict x, int n) {
    kvf acc0 = {0}, acc1 = {0};
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q6_K_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_at(blk + 208);
        for (int half = 0; half < 2; half++) {  // 128 weights: ql 64 bytes, qh 32 bytes, 8 scales
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const v8f ds = d * to_f32(((bytes8((const uint8_t *)sc + 8 * half) ^ 128) - 128));  // signed
            const float *xb = x + (long)b * QK_K + 128 * half;
            for (int l = 0; l < 32; l += KW) {  // a scale covers 16 weights: KW never straddles two
                const int is = l / 16;
                const kvi lo = kbytes(ql + l), hi = kbytes(ql + l + 32), top = kbytes(qh + l);
                const kvf q1 = kto_f32(((lo & 15) | ((top & 3) << 4)) - 32);
                const kvf q2 = kto_f32(((hi & 15) | (((top >> 2) & 3) << 4)) - 32);
                const kvf q3 = kto_f32(((lo >> 4) | (((top >> 4) & 3) << 4)) - 32);
                const kvf q4 = kto_f32(((hi >> 4) | (((top >> 6) & 3) << 4)) - 32);
                acc0 += ds[is] * (q1 * kload(xb + l)) + ds[is + 2] * (q2 * kload(xb + 32 + l));
                acc1 += ds[is + 4] * (q3 * kload(xb + 64 + l)) + ds[is + 6] * (q4 * kload(xb + 96 + l));
            }
        }
    }
    return ksum(acc0 + acc1);
}

// Rows widened to fp32 (for several dots with the same row): the values gguf.quants.dequantize gives.
static inline void dequant_q4_k(const uint8_t *restrict w, float *restrict out, int n) {
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *qs = w + (long)b * Q4_K_BYTES + 16;
        float *y = out + (long)b * QK_K;
        float a[8], m[8];
        q4_k_affine(w + (long)b * Q4_K_BYTES, a, m);
        for (int j = 0; j < 4; j++) {
            const float a0 = a[2 * j], b0 = m[2 * j], a1 = a[2 * j + 1], b1 = m[2 * j + 1];
            for (int l = 0; l < 32; l++) {
                y[64 * j + l] = a0 * (float)(qs[32 * j + l] & 15) - b0;
                y[64 * j + 32 + l] = a1 * (float)(qs[32 * j + l] >> 4) - b1;
            }
        }
    }
}

static inline void dequant_q5_k(const uint8_t *restrict w, float *restrict out, int n) {
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q5_K_BYTES, *qh = blk + 16, *qs = blk + 48;
        float *y = out + (long)b * QK_K;
        const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
        uint8_t sc[8], mn[8];
        q4_k_scales(blk + 4, sc, mn);
        for (int j = 0; j < 4; j++) {
            const float a0 = d * sc[2 * j], b0 = dmin * mn[2 * j], a1 = d * sc[2 * j + 1], b1 = dmin * mn[2 * j + 1];
            for (int l = 0; l < 32; l++) {
                y[64 * j + l] = a0 * (float)((qs[32 * j + l] & 15) | (((qh[l] >> (2 * j)) & 1) << 4)) - b0;
                y[64 * j + 32 + l] = a1 * (float)((qs[32 * j + l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) - b1;
            }
        }
    }
}

static inline void dequant_q6_k(const uint8_t *restrict w, float *restrict out, int n) {
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q6_K_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_at(blk + 208);
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
