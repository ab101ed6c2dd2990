// Dots of rows in codebook codecs, whose 4-bit indices pick int8 values from a 16-entry table (a byte
// shuffle does the lookup, 32 at a time), and the rows widened to fp32. Layouts (ggml's, what
// gguf.quants.dequantize reads):
//   IQ4_XS, 136 bytes per 256: d fp16, scales_h uint16, scales_l[4], qs[128]; sub-block s of 32 has the
//        6-bit scale ls = (scales_l nibble s) | (scales_h bits 2s, 2s+1) << 4 and weights
//        d·(ls − 32)·IQ4_NL[q], its 16 bytes' low nibbles the first 16 weights, high nibbles the next 16.
//   MXFP4, 17 bytes per 32: e (e8m0), qs[16]; w = 2^(e − 128)·MXFP4[q] (the table holds twice the FP4
//        values, the scale half the block's), low nibbles the first 16 weights, high nibbles the next 16.
// And FP8 rows (codecs/fp8.py), 132 bytes per 128: an fp32 scale, then 128 e4m3 values. An e4m3 byte
// moved into fp16's bits (sign to bit 15, the other seven bits to 13..7) is its value / 256, subnormals
// included, so F16C widens eight at a time.
// And NVFP4 rows (codecs/nvfp4.py), 76 bytes per 128: an fp32 multiplier, eight e4m3 block scales, then
// per block of 16 eight bytes (its first eight weights in the low nibbles, the next eight in the high
// ones) indexing the e2m1 values, which MXFP4's table holds doubled.
#ifndef FT_TABLE_DOT_H
#define FT_TABLE_DOT_H
#include <stdint.h>
#include <string.h>

#include "kquant_dot.h"
#include "quant_dot.h"

#define IQ4_XS_BYTES 136
#define MXFP4_BYTES 17

static const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#define FP8_BYTES 132

static inline float e4m3_f32(uint8_t b) {
    const float v = fp16_f32((uint16_t)(((b & 0x80) << 8) | ((b & 0x7F) << 7))) * 256.0f;
    return (b & 0x7F) == 0x7F ? NAN : v;
}

static inline void dequant_fp8(const uint8_t *restrict w, float *restrict out, int n) {
    for (int b = 0; b < n / 128; b++) {
        const uint8_t *blk = w + (long)b * FP8_BYTES;
        float scale;
        memcpy(&scale, blk, sizeof scale);
        for (int j = 0; j < 128; j++) out[128L * b + j] = scale * e4m3_f32(blk[4 + j]);
    }
}

#define NVFP4_BYTES 76

static inline void dequant_nvfp4(const uint8_t *restrict w, float *restrict out, int n) {
    for (int g = 0; g < n / 128; g++) {
        const uint8_t *grp = w + (long)g * NVFP4_BYTES;
        float mult;
        memcpy(&mult, grp, sizeof mult);
        for (int b = 0; b < 8; b++) {
            const float d = 0.5f * mult * e4m3_f32(grp[4 + b]);
            const uint8_t *q = grp + 12 + 8 * b;
            for (int j = 0; j < 8; j++) {
                out[128L * g + 16 * b + j] = d * MXFP4_VALUES[q[j] & 15];
                out[128L * g + 16 * b + 8 + j] = d * MXFP4_VALUES[q[j] >> 4];
            }
        }
    }
}

static inline float dot_nvfp4(const uint8_t *restrict w, const float *restrict x, int n) {
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(15), table = _mm_loadu_si128((const __m128i *)MXFP4_VALUES);
#else
    float s = 0.0f;
#endif
    for (int g = 0; g < n / 128; g++) {
        const uint8_t *grp = w + (long)g * NVFP4_BYTES;
        const float *xg = x + 128L * g;
        float mult;
        memcpy(&mult, grp, sizeof mult);
        for (int b = 0; b < 8; b++) {
            const float d = 0.5f * mult * e4m3_f32(grp[4 + b]);
            const uint8_t *q = grp + 12 + 8 * b;
#if defined(__AVX2__)
            long long eight;
            memcpy(&eight, q, sizeof eight);
            const __m128i v = _mm_cvtsi64_si128(eight);
            const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(v, low4));
            const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low4));
            const __m256 p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(xg + 16 * b + 8),
                                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(xg + 16 * b)));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc);
#else
            float part = 0.0f;
            for (int j = 0; j < 8; j++)
                part += MXFP4_VALUES[q[j] & 15] * xg[16 * b + j] + MXFP4_VALUES[q[j] >> 4] * xg[16 * b + 8 + j];
            s += d * part;
#endif
        }
    }
#if defined(__AVX2__)
    return hsum256(acc);
#else
    return s;
#endif
}

static inline float dot_fp8(const uint8_t *restrict w, const float *restrict x, int n) {
    float s = 0.0f;
#if defined(__AVX2__) && defined(__F16C__)
    __m256 total = _mm256_setzero_ps();  // the blocks' scaled lanes: one horizontal sum per row
#endif
    for (int b = 0; b < n / 128; b++) {
        const uint8_t *blk = w + (long)b * FP8_BYTES;
        const float *xb = x + 128L * b;
        float scale;
        memcpy(&scale, blk, sizeof scale);
#if defined(__AVX2__) && defined(__F16C__)
        const __m128i sign = _mm_set1_epi16((short)0x8000), rest = _mm_set1_epi16(0x7F);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int j = 0; j < 128; j += 16) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4 + j));
            const __m128i lo = _mm_cvtepu8_epi16(v), hi = _mm_cvtepu8_epi16(_mm_srli_si128(v, 8));
            const __m128i hlo = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(lo, 8), sign), _mm_slli_epi16(_mm_and_si128(lo, rest), 7));
            const __m128i hhi = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(hi, 8), sign), _mm_slli_epi16(_mm_and_si128(hi, rest), 7));
            acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(hlo), _mm256_loadu_ps(xb + j), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(hhi), _mm256_loadu_ps(xb + j + 8), acc1);
        }
        total = _mm256_fmadd_ps(_mm256_set1_ps(scale * 256.0f), _mm256_add_ps(acc0, acc1), total);
#else
        float part = 0.0f;
        for (int j = 0; j < 128; j++) part += e4m3_f32(blk[4 + j]) * xb[j];
        s += scale * part;
#endif
    }
#if defined(__AVX2__) && defined(__F16C__)
    s = hsum256(total);
#endif
    return s;
}


// 2^(e - 128): ggml's e8m0 scale, halved (subnormal for e < 2).
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline int iq4_xs_scale(const uint8_t *blk, int s) {
    uint16_t high;
    memcpy(&high, blk + 2, sizeof high);
    return (((blk[4 + s / 2] >> (4 * (s % 2))) & 15) | (((high >> (2 * s)) & 3) << 4)) - 32;
}

static inline void dequant_iq4_xs(const uint8_t *restrict w, float *restrict out, int n) {
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * IQ4_XS_BYTES, *qs = blk + 8;
        const float d = fp16_at(blk);
        for (int s = 0; s < 8; s++) {
            const float dl = d * (float)iq4_xs_scale(blk, s);
            float *y = out + (long)b * QK_K + 32 * s;
            for (int j = 0; j < 16; j++) {
                y[j] = dl * IQ4_NL_VALUES[qs[16 * s + j] & 15];
                y[j + 16] = dl * IQ4_NL_VALUES[qs[16 * s + j] >> 4];
            }
        }
    }
}

static inline void dequant_mxfp4(const uint8_t *restrict w, float *restrict out, int n) {
    for (int b = 0; b < n / 32; b++) {
        const uint8_t *blk = w + (long)b * MXFP4_BYTES;
        const float d = e8m0_half(blk[0]);
        for (int j = 0; j < 16; j++) {
            out[32L * b + j] = d * MXFP4_VALUES[blk[1 + j] & 15];
            out[32L * b + j + 16] = d * MXFP4_VALUES[blk[1 + j] >> 4];
        }
    }
}

// Weight-only: the 32 looked-up int8 values of a sub-block times fp32 activations, as lanes (tvec) that the
// caller scales into its accumulator; one horizontal sum per row, not per block.
#if defined(__AVX512F__)
typedef __m512 tvec;
static inline tvec tzero(void) { return _mm512_setzero_ps(); }
static inline tvec tscaled(float scale, tvec v, tvec acc) { return _mm512_fmadd_ps(_mm512_set1_ps(scale), v, acc); }
static inline float tsum(tvec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__)
typedef __m256 tvec;
static inline tvec tzero(void) { return _mm256_setzero_ps(); }
static inline tvec tscaled(float scale, tvec v, tvec acc) { return _mm256_fmadd_ps(_mm256_set1_ps(scale), v, acc); }
static inline float tsum(tvec v) { return hsum256(v); }
#else
typedef float tvec;
static inline tvec tzero(void) { return 0.0f; }
static inline tvec tscaled(float scale, tvec v, tvec acc) { return acc + scale * v; }
static inline float tsum(tvec v) { return v; }
#endif

static inline tvec table_block_f32(const uint8_t *restrict qs, const int8_t *table, const float *restrict x) {
#if defined(__AVX2__)
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    const __m128i t = _mm_loadu_si128((const __m128i *)table);
    const __m128i lo = _mm_shuffle_epi8(t, _mm_and_si128(q, low4));
    const __m128i hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(q, 4), low4));
#if defined(__AVX512F__)
    const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), _mm512_loadu_ps(x));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), _mm512_loadu_ps(x + 16), s);
#else
    __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), s);
#endif
#else
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += table[qs[j] & 15] * x[j] + table[qs[j] >> 4] * x[j + 16];
    return s;
#endif
}

static inline float dot_iq4_xs(const uint8_t *restrict w, const float *restrict x, int n) {
    tvec acc = tzero();
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * IQ4_XS_BYTES;
        const float d = fp16_at(blk);
        for (int sb = 0; sb < 8; sb++) {
            const tvec v = table_block_f32(blk + 8 + 16 * sb, IQ4_NL_VALUES, x + (long)b * QK_K + 32 * sb);
            acc = tscaled(d * (float)iq4_xs_scale(blk, sb), v, acc);
        }
    }
    return tsum(acc);
}

static inline float dot_mxfp4(const uint8_t *restrict w, const float *restrict x, int n) {
    tvec acc0 = tzero(), acc1 = tzero();
    int b = 0;
    for (; b + 2 <= n / 32; b += 2) {  // two accumulators: the scaled adds do not wait on each other
        const uint8_t *blk = w + (long)b * MXFP4_BYTES;
        acc0 = tscaled(e8m0_half(blk[0]), table_block_f32(blk + 1, MXFP4_VALUES, x + 32L * b), acc0);
        acc1 = tscaled(e8m0_half(blk[MXFP4_BYTES]), table_block_f32(blk + MXFP4_BYTES + 1, MXFP4_VALUES,
                                                                    x + 32L * (b + 1)), acc1);
    }
    for (; b < n / 32; b++) {
        const uint8_t *blk = w + (long)b * MXFP4_BYTES;
        acc0 = tscaled(e8m0_half(blk[0]), table_block_f32(blk + 1, MXFP4_VALUES, x + 32L * b), acc0);
    }
    return tsum(acc0) + tsum(acc1);
}

#if HAVE_KQUANT_BF16
// The codebooks as bf16 bits (every value exact), word i = entry i, for the bf16 pair-dot path.
#define MXFP4_BF16 _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
    (short)0xc140, (short)0xc100, (short)0xc0c0, (short)0xc080, (short)0xc040, (short)0xc000, (short)0xbf80, 0, \
    0x4140, 0x4100, 0x40c0, 0x4080, 0x4040, 0x4000, 0x3f80, 0)
#define IQ4_NL_BF16 _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
    0x42e2, 0x42b2, 0x428a, 0x4254, 0x4218, 0x41c8, 0x4150, 0x3f80, (short)0xc120, (short)0xc1b0, \
    (short)0xc20c, (short)0xc244, (short)0xc282, (short)0xc2a6, (short)0xc2d0, (short)0xc2fe)

// A block of 32 (16 bytes: weights j and j + 16 in byte j's low and high nibble) through a bf16 codebook
// against 32 bf16 activations: the 32 entries in natural order meet x in one pair-dot instruction.
static inline __m512 table_block_bf16(const uint8_t *restrict qs, __m512i table, const uint16_t *restrict xk) {
    const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs)), low4 = _mm256_set1_epi16(15);
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, low4)),
                                           _mm256_srli_epi16(q, 4), 1);
    return _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_permutexvar_epi16(idx, table), load_bh(xk));
}

// dot_iq4_xs / dot_mxfp4 against activations that are bf16 values (xk).
static inline float dot_iq4_xs_bf16(const uint8_t *restrict w, const uint16_t *restrict xk, int n) {
    const __m512i table = IQ4_NL_BF16;
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * IQ4_XS_BYTES;
        const float d = fp16_at(blk);
        for (int sb = 0; sb < 8; sb++) {
            const __m512 v = table_block_bf16(blk + 8 + 16 * sb, table, xk + (long)b * QK_K + 32 * sb);
            acc = _mm512_fmadd_ps(_mm512_set1_ps(d * (float)iq4_xs_scale(blk, sb)), v, acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}

static inline float dot_mxfp4_bf16(const uint8_t *restrict w, const uint16_t *restrict xk, int n) {
    const __m512i table = MXFP4_BF16;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int b = 0;
    for (; b + 2 <= n / 32; b += 2) {
        const uint8_t *blk = w + (long)b * MXFP4_BYTES;
        acc0 = _mm512_fmadd_ps(_mm512_set1_ps(e8m0_half(blk[0])), table_block_bf16(blk + 1, table, xk + 32L * b), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_set1_ps(e8m0_half(blk[MXFP4_BYTES])),
                               table_block_bf16(blk + MXFP4_BYTES + 1, table, xk + 32L * (b + 1)), acc1);
    }
    for (; b < n / 32; b++) {
        const uint8_t *blk = w + (long)b * MXFP4_BYTES;
        acc0 = _mm512_fmadd_ps(_mm512_set1_ps(e8m0_half(blk[0])), table_block_bf16(blk + 1, table, xk + 32L * b), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// The int8 dot of four groups of 32 codebook weights against their activations: group k's 16 index bytes
// in 128-bit lane k of v (low nibbles its first 16 weights, high nibbles its last 16), its 32 activations
// at 32k of x01 (groups 0, 1) and x23 (2, 3). The codebook's magnitudes (mags, broadcast to every lane) by
// one byte shuffle per nibble half; the sign moved onto the activations (negative where the index's bit
// 3 is set, or clear with `negative_below_8`); one dpbusd per half -> int32 sums, four lanes a group.
static inline __m512i codebook_group_sums(__m512i v, __m512i x01, __m512i x23, __m512i mags, int negative_below_8) {
    const __m512i low4 = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8), zero = _mm512_setzero_si512();
    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    __m512i xlo = _mm512_shuffle_i64x2(x01, x23, _MM_SHUFFLE(2, 0, 2, 0));  // each group's first 16
    __m512i xhi = _mm512_shuffle_i64x2(x01, x23, _MM_SHUFFLE(3, 1, 3, 1));  // and last 16
    const __mmask64 neg_lo = negative_below_8 ? _mm512_testn_epi8_mask(lo, eight) : _mm512_test_epi8_mask(lo, eight);
    const __mmask64 neg_hi = negative_below_8 ? _mm512_testn_epi8_mask(hi, eight) : _mm512_test_epi8_mask(hi, eight);
    xlo = _mm512_mask_sub_epi8(xlo, neg_lo, zero, xlo);
    xhi = _mm512_mask_sub_epi8(xhi, neg_hi, zero, xhi);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, _mm512_shuffle_epi8(mags, lo), xlo),
                               _mm512_shuffle_epi8(mags, hi), xhi);
}
#endif

// Against activations quantized to int8 in blocks of 256 with one scale (IQ4_XS: the sub-block scales
// applied as 16-bit integers, one fp32 multiply per super-block) or of 32 (MXFP4: its e8m0 scales span
// too far for integers, so each block is scaled in fp32).
static inline float dot_iq4_xs_q8(const uint8_t *restrict w, const int8_t *restrict xq, const float *restrict xd,
                                  int n) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    // Four sub-blocks a register (codebook_group_sums; the values are negative at indices 0-7), four lanes a
    // sub-block scaled by d · (ls − 32) · d_x.
    static const int8_t magnitudes[16] = {127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89, 113};
    const __m512i mags = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)magnitudes));
    const __m512i spread[2] = {_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                               _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4)};
    const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i nib_shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    const __m256i top_shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * IQ4_XS_BYTES, *qs = blk + 8;
        const int8_t *a = xq + (long)b * QK_K;
        int32_t packed_l;  // iq4_xs_scale for the eight sub-blocks at once: scales_l's nibbles, scales_h's pairs
        uint16_t packed_h;
        memcpy(&packed_l, blk + 4, sizeof packed_l);
        memcpy(&packed_h, blk + 2, sizeof packed_h);
        const __m256i nib = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(packed_l), pairs)), nib_shift),
            _mm256_set1_epi32(15));
        const __m256i top = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(packed_h), top_shift), _mm256_set1_epi32(3));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(nib, _mm256_slli_epi32(top, 4)), _mm256_set1_epi32(32));
        const __m512 scales = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(fp16_at(blk) * xd[b]), _mm256_cvtepi32_ps(ls)));
        for (int h = 0; h < 2; h++) {  // sub-blocks 4h .. 4h + 3
            const __m512i sums = codebook_group_sums(
                _mm512_loadu_si512((const void *)(qs + 64 * h)), _mm512_loadu_si512((const void *)(a + 128 * h)),
                _mm512_loadu_si512((const void *)(a + 128 * h + 64)), mags, 1);
            acc = _mm512_fmadd_ps(_mm512_permutexvar_ps(spread[h], scales), _mm512_cvtepi32_ps(sums), acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * IQ4_XS_BYTES, *qs = blk + 8;
        const int8_t *a = xq + (long)b * QK_K;
        __m256i sumi = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {  // sub-blocks 2p (bytes 0-15) and 2p + 1 (bytes 16-31)
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(q, low4));  // weights 0-15 of each
            const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(q, 4), low4));
            const __m256i a0 = _mm256_loadu_si256((const __m256i *)(a + 64 * p));
            const __m256i a1 = _mm256_loadu_si256((const __m256i *)(a + 64 * p + 32));
            const __m256i alo = _mm256_permute2x128_si256(a0, a1, 0x20), ahi = _mm256_permute2x128_si256(a0, a1, 0x31);
            const __m256i scale = _mm256_set_m128i(_mm_set1_epi16((short)iq4_xs_scale(blk, 2 * p + 1)),
                                                   _mm_set1_epi16((short)iq4_xs_scale(blk, 2 * p)));
            const __m256i plo = _mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(alo, lo));
            const __m256i phi = _mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(ahi, hi));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_madd_epi16(plo, scale), _mm256_madd_epi16(phi, scale)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_at(blk) * xd[b]), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum256(acc);
#else
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * IQ4_XS_BYTES, *qs = blk + 8;
        const int8_t *a = xq + (long)b * QK_K;
        int32_t sumi = 0;
        for (int sb = 0; sb < 8; sb++) {
            int32_t part = 0;
            for (int j = 0; j < 16; j++)
                part += IQ4_NL_VALUES[qs[16 * sb + j] & 15] * a[32 * sb + j] +
                        IQ4_NL_VALUES[qs[16 * sb + j] >> 4] * a[32 * sb + j + 16];
            sumi += iq4_xs_scale(blk, sb) * part;
        }
        s += fp16_at(blk) * xd[b] * (float)sumi;
    }
    return s;
#endif
}

static inline float dot_mxfp4_q8(const uint8_t *restrict w, const int8_t *restrict xq, const float *restrict xd,
                                 int n) {
    int b = 0;
    float s = 0.0f;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    // Four blocks an iteration (codebook_group_sums; the index's bit 3 is the sign), four lanes a block
    // scaled by its 2^(e - 128) · d_x.
    static const int8_t magnitudes[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12};
    const __m512i mags = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)magnitudes));
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    for (; b + 4 <= n / 32; b += 4) {
        const uint8_t *blk = w + (long)b * MXFP4_BYTES;
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk + 1)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + MXFP4_BYTES + 1)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + 2 * MXFP4_BYTES + 1)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + 3 * MXFP4_BYTES + 1)), 3);
        const __m512i sums = codebook_group_sums(v, _mm512_loadu_si512((const void *)(xq + 32L * b)),
                                                 _mm512_loadu_si512((const void *)(xq + 32L * b + 64)), mags, 0);
        const __m128 scales = _mm_mul_ps(_mm_set_ps(e8m0_half(blk[3 * MXFP4_BYTES]), e8m0_half(blk[2 * MXFP4_BYTES]),
                                                    e8m0_half(blk[MXFP4_BYTES]), e8m0_half(blk[0])),
                                         _mm_loadu_ps(xd + b));
        acc = _mm512_fmadd_ps(_mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scales)), _mm512_cvtepi32_ps(sums), acc);
    }
    s = _mm512_reduce_add_ps(acc);
#endif
#if defined(__AVX2__)
    __m256 acc8 = _mm256_setzero_ps();
    const __m128i low4_16 = _mm_set1_epi8(15), table = _mm_loadu_si128((const __m128i *)MXFP4_VALUES);
    for (; b < n / 32; b++) {
        const uint8_t *blk = w + (long)b * MXFP4_BYTES;
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low4_16));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low4_16));
        const __m256i sums = q8_block_sums(_mm256_set_m128i(hi, lo), _mm256_loadu_si256((const __m256i *)(xq + 32L * b)));
        acc8 = _mm256_fmadd_ps(_mm256_set1_ps(e8m0_half(blk[0]) * xd[b]), _mm256_cvtepi32_ps(sums), acc8);
    }
    return s + hsum256(acc8);
#else
    for (; b < n / 32; b++) {
        const uint8_t *blk = w + (long)b * MXFP4_BYTES;
        int32_t sum = 0;
        for (int j = 0; j < 16; j++)
            sum += MXFP4_VALUES[blk[1 + j] & 15] * xq[32L * b + j] + MXFP4_VALUES[blk[1 + j] >> 4] * xq[32L * b + j + 16];
        s += e8m0_half(blk[0]) * xd[b] * (float)sum;
    }
    return s;
#endif
}

#endif
