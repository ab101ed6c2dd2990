// Dots of rows stored in a block codec, against fp32 activations (weight-only: exact up to the summation
// order) or, for the *_ACT8 ids, against activations quantized to int8 blocks as llama.cpp does: per
// block of 32, the weights' int8 values times the activation's, summed in int32, scaled by the two
// blocks' scales (fewer instructions per weight: the faster path where a core, not memory, is the
// limit). The codec ids are cpu_experts.py's CODEC_IDS.
//
// Q8_0 row: blocks of 34 bytes, an fp16 scale d then 32 int8 q; weight = d * q.
// An activation vector of n elements (n a multiple of 32) is int8 q [n] beside fp32 scales [n / 32].
#ifndef FT_QUANT_DOT_H
#define FT_QUANT_DOT_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "bf16_dot.h"  // PREFETCH: bf16 elements ahead, so 2 · PREFETCH bytes of a block row

// Q8_PREFETCH: bytes ahead the Q8_0 dots prefetch (0: none), Q8_PREFETCH_HINT its locality; by default the
// bf16 dots' (2 · PREFETCH bytes, PREFETCH_HINT). Builds for more than a few cores drop the bf16 prefetch
// but keep this one into L2 (loader.py, prefetch_defines): Q8_0 × int8 at 16 threads on a 16-core Xeon,
// one sweep, 116 GB/s without it, 118 non-temporal, 142 into L2 (2 threads on a 2-core EPYC: 1.05 × the
// read without, 0.88-0.91 × into L2).
#ifndef Q8_PREFETCH
#define Q8_PREFETCH (2 * PREFETCH)
#endif
#ifndef Q8_PREFETCH_HINT
#define Q8_PREFETCH_HINT PREFETCH_HINT
#endif
#if Q8_PREFETCH > 0
#define PREFETCH_ROW(p) __builtin_prefetch((const uint8_t *)(p) + Q8_PREFETCH, 0, Q8_PREFETCH_HINT)
#else
#define PREFETCH_ROW(p) ((void)0)
#endif

enum {
    FT_CODEC_BF16 = 0,
    FT_CODEC_Q8_0 = 1,
    FT_CODEC_Q8_0_ACT8 = 2,
    FT_CODEC_Q4_K = 3,
    FT_CODEC_Q6_K = 4,
    FT_CODEC_Q4_K_ACT8 = 5,
    FT_CODEC_Q6_K_ACT8 = 6,
    FT_CODEC_F32 = 7,
    FT_CODEC_Q5_K = 8,
    FT_CODEC_Q5_K_ACT8 = 9,
    FT_CODEC_IQ4_XS = 10,
    FT_CODEC_IQ4_XS_ACT8 = 11,
    FT_CODEC_MXFP4 = 12,
    FT_CODEC_MXFP4_ACT8 = 13,
    FT_CODEC_FP8 = 14,
    FT_CODEC_NVFP4 = 15,
    FT_CODEC_BF16_ACT16 = 16,  // bf16 rows against bf16 activations (bf16 dot instructions)
    // lowbit_dot.h's, against fp32 activations (decoded a chunk at a time); lowbit_codec() is this range
    FT_CODEC_Q4_0 = 17,
    FT_CODEC_Q5_0 = 18,
    FT_CODEC_Q2_K = 19,
    FT_CODEC_Q3_K = 20,
    FT_CODEC_IQ2_XXS = 21,
    FT_CODEC_IQ2_XS = 22,
    FT_CODEC_IQ3_XXS = 23,
    FT_CODEC_IQ3_S = 24,
    FT_CODEC_IQ4_NL = 25,
    FT_CODEC_Q4_1 = 26,
    FT_CODEC_Q5_1 = 27,
    // lowbit_dot_int8.h's: each lowbit codec against int8 activation blocks, at this id + its offset from
    // FT_CODEC_Q4_0 (40 Q4_0 ... 50 Q5_1)
    FT_CODEC_LOWBIT_ACT8 = 40
};
#define FT_CODEC_LOWBIT_ACT8_LAST (FT_CODEC_LOWBIT_ACT8 + FT_CODEC_Q5_1 - FT_CODEC_Q4_0)

static inline int lowbit_act8(int codec) { return codec >= FT_CODEC_LOWBIT_ACT8 && codec <= FT_CODEC_LOWBIT_ACT8_LAST; }
static inline int lowbit_of_act8(int codec) { return codec - FT_CODEC_LOWBIT_ACT8 + FT_CODEC_Q4_0; }
#define Q8_BLOCK 32
#define Q8_0_BYTES 34

// (elements, bytes) of one block of `codec`; (0, 0) for an id this build does not know.
static inline void codec_block(int codec, int *elements, int *bytes) {
    if (lowbit_act8(codec)) codec = lowbit_of_act8(codec);
    switch (codec) {
        case FT_CODEC_BF16:
        case FT_CODEC_BF16_ACT16: *elements = 1, *bytes = 2; return;
        case FT_CODEC_F32: *elements = 1, *bytes = 4; return;
        case FT_CODEC_Q8_0:
        case FT_CODEC_Q8_0_ACT8: *elements = Q8_BLOCK, *bytes = Q8_0_BYTES; return;
        case FT_CODEC_Q4_K:
        case FT_CODEC_Q4_K_ACT8: *elements = 256, *bytes = 144; return;
        case FT_CODEC_Q6_K:
        case FT_CODEC_Q6_K_ACT8: *elements = 256, *bytes = 210; return;
        case FT_CODEC_Q5_K:
        case FT_CODEC_Q5_K_ACT8: *elements = 256, *bytes = 176; return;
        case FT_CODEC_IQ4_XS:
        case FT_CODEC_IQ4_XS_ACT8: *elements = 256, *bytes = 136; return;
        case FT_CODEC_MXFP4:
        case FT_CODEC_MXFP4_ACT8: *elements = 32, *bytes = 17; return;
        case FT_CODEC_FP8: *elements = 128, *bytes = 132; return;
        case FT_CODEC_NVFP4: *elements = 128, *bytes = 76; return;
        case FT_CODEC_Q4_0:
        case FT_CODEC_IQ4_NL: *elements = 32, *bytes = 18; return;
        case FT_CODEC_Q5_0: *elements = 32, *bytes = 22; return;
        case FT_CODEC_Q4_1: *elements = 32, *bytes = 20; return;
        case FT_CODEC_Q5_1: *elements = 32, *bytes = 24; return;
        case FT_CODEC_Q2_K: *elements = 256, *bytes = 84; return;
        case FT_CODEC_Q3_K:
        case FT_CODEC_IQ3_S: *elements = 256, *bytes = 110; return;
        case FT_CODEC_IQ2_XXS: *elements = 256, *bytes = 66; return;
        case FT_CODEC_IQ2_XS: *elements = 256, *bytes = 74; return;
        case FT_CODEC_IQ3_XXS: *elements = 256, *bytes = 98; return;
        default: *elements = 0, *bytes = 0;
    }
}

// Whether `codec` is one of the ids taken against int8 activation blocks.
static inline int codec_act8(int codec) {
    return codec == FT_CODEC_Q8_0_ACT8 || codec == FT_CODEC_Q4_K_ACT8 || codec == FT_CODEC_Q6_K_ACT8 ||
           codec == FT_CODEC_Q5_K_ACT8 || codec == FT_CODEC_IQ4_XS_ACT8 || codec == FT_CODEC_MXFP4_ACT8 ||
           lowbit_act8(codec);
}

// Bytes of a row of n elements in `codec` (n a whole number of blocks; checked by the caller).
static inline long codec_row_bytes(int codec, long n) {
    int elements, bytes;
    codec_block(codec, &elements, &bytes);
    return elements ? n / elements * bytes : 0;
}

static inline float fp16_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const float sign = (h & 0x8000) ? -1.0f : 1.0f;
    const int exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 0) return sign * ldexpf((float)mant, -24);
    if (exp == 31) return mant ? NAN : sign * INFINITY;
    return sign * ldexpf((float)(mant | 0x400), exp - 25);
#endif
}

// The fp16 value at p (any alignment).
static inline float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return fp16_f32(h);
}

#define SUM_BLOCK 16  // activation sums are kept per 16 values (Q6_K's sub-blocks; Q4_K's are two of them)

// The activation block a codec's int8 dots take: 256 for the K-quants (one scale per super-block, so a
// super-block's integer sums need no rescaling inside it, as llama.cpp's Q8_K), 32 otherwise.
static inline int act8_block(int codec) {
    if (lowbit_act8(codec)) {  // the super-block types' (256 weights) like the K-quants', others' 32
        int elements, bytes;
        codec_block(codec, &elements, &bytes);
        return elements == 256 ? 256 : Q8_BLOCK;
    }
    return codec == FT_CODEC_Q4_K_ACT8 || codec == FT_CODEC_Q5_K_ACT8 || codec == FT_CODEC_Q6_K_ACT8 ||
                   codec == FT_CODEC_IQ4_XS_ACT8
               ? 256
               : Q8_BLOCK;
}

// x [n] fp32 -> q [n] int8, d [n / block] fp32, sums [n / 16] int16 (|sum| <= 16 · 127): per block of `block` d = max|x| / 127,
// q = x / d rounded half to even (numpy's rounding, which the tests' reference uses); the sum of every 16
// consecutive q (what Q4_K's mins and Q6_K's offset of 32 multiply).
static inline void quantize_q8(const float *restrict x, int8_t *restrict q, float *restrict d,
                               int16_t *restrict sums, int n, int block) {
#if defined(__AVX512F__)
    // sixteen at a time: the same max, the same scale and inverse, the conversion rounding half to even
    // (the default rounding mode, as nearbyintf), each 16's sum from the same lanes
    for (int b = 0; b < n / block; b++) {
        const float *xb = x + (long)b * block;
        __m512 amax = _mm512_setzero_ps();
        for (int j = 0; j < block; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + j)));
        const float m = _mm512_reduce_max_ps(amax), inv = m > 0.0f ? 127.0f / m : 0.0f;
        d[b] = m / 127.0f;
        for (int j = 0; j < block; j += 16) {
            const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + j), _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(q + (long)b * block + j), _mm512_cvtepi32_epi8(v));
            sums[((long)b * block + j) / SUM_BLOCK] = (int16_t)_mm512_reduce_add_epi32(v);
        }
    }
#else
    for (int b = 0; b < n / block; b++) {
        const float *xb = x + (long)b * block;
        float amax = 0.0f;
        for (int j = 0; j < block; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = scale;
        for (int j = 0; j < block; j++) q[(long)b * block + j] = (int8_t)nearbyintf(xb[j] * inv);
    }
    for (int s = 0; s < n / SUM_BLOCK; s++) {
        int32_t sum = 0;
        for (int j = 0; j < SUM_BLOCK; j++) sum += q[(long)s * SUM_BLOCK + j];
        sums[s] = (int16_t)sum;
    }
#endif
}

#if defined(__AVX2__)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The 8 int32 partial sums of 32 int8 weights times 32 int8 activations: |w| as unsigned times x with
// w's sign, in 16-bit pairs (at most 2 · 128 · 127, no saturation), then pairs of those in 32 bits.
static inline __m256i q8_block_sums(__m256i w, __m256i x) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
static inline int u16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return h;
}

// Two blocks' 32 quants each in one register (block b below, b + 1 above).
static inline __m512i q8_pair(const uint8_t *w0) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w0 + 2))),
                              _mm256_loadu_si256((const __m256i *)(w0 + Q8_0_BYTES + 2)), 1);
}

// Σ of four products per 32-bit lane: |w| (unsigned) times x with w's sign (x in -127..127, so no
// negation overflows), one VNNI instruction.
static inline __m512i q8_pair_sums(__m512i w, __m512i x) {
    const __mmask64 negative = _mm512_movepi8_mask(w);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w),
                               _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x));
}
#endif

// w: a Q8_0 row of n elements; xq, xd: the activation's int8 values and block scales.
static inline float dot_q8_0(const uint8_t *restrict w, const int8_t *restrict xq, const float *restrict xd,
                             int n) {
    const int nb = n / Q8_BLOCK;
    int b = 0;
    float s = 0.0f;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    // Four blocks an iteration: two registers of two blocks; their four scales d_w · d_x as one vector,
    // spread over each block's eight lanes by a permute.
    const __m512i lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i hi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *w0 = w + (long)b * Q8_0_BYTES;
        const int8_t *x0 = xq + (long)b * Q8_BLOCK;
        PREFETCH_ROW(w0);
        PREFETCH_ROW(w0 + 2 * Q8_0_BYTES);
        __m128i dw = _mm_cvtsi32_si128(u16_at(w0));
        dw = _mm_insert_epi16(dw, u16_at(w0 + Q8_0_BYTES), 1);
        dw = _mm_insert_epi16(dw, u16_at(w0 + 2 * Q8_0_BYTES), 2);
        dw = _mm_insert_epi16(dw, u16_at(w0 + 3 * Q8_0_BYTES), 3);
        const __m512 scales = _mm512_broadcast_f32x4(_mm_mul_ps(_mm_cvtph_ps(dw), _mm_loadu_ps(xd + b)));
        const __m512i p0 = q8_pair_sums(q8_pair(w0), _mm512_loadu_si512((const void *)x0));
        const __m512i p1 = q8_pair_sums(q8_pair(w0 + 2 * Q8_0_BYTES), _mm512_loadu_si512((const void *)(x0 + 64)));
        acc0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(lo, scales), _mm512_cvtepi32_ps(p0), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(hi, scales), _mm512_cvtepi32_ps(p1), acc1);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(__AVX2__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *w0 = w + (long)b * Q8_0_BYTES, *w1 = w0 + Q8_0_BYTES;
        PREFETCH_ROW(w0);
        const __m256i p0 = q8_block_sums(_mm256_loadu_si256((const __m256i *)(w0 + 2)),
                                         _mm256_loadu_si256((const __m256i *)(xq + (long)b * Q8_BLOCK)));
        const __m256i p1 = q8_block_sums(_mm256_loadu_si256((const __m256i *)(w1 + 2)),
                                         _mm256_loadu_si256((const __m256i *)(xq + (long)(b + 1) * Q8_BLOCK)));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_at(w0) * xd[b]), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_at(w1) * xd[b + 1]), _mm256_cvtepi32_ps(p1), acc1);
    }
    s = hsum256(_mm256_add_ps(acc0, acc1));
#endif
    for (; b < nb; b++) {
        const uint8_t *wb = w + (long)b * Q8_0_BYTES;
        const int8_t *q = (const int8_t *)(wb + 2), *x = xq + (long)b * Q8_BLOCK;
        int32_t sum = 0;
        for (int j = 0; j < Q8_BLOCK; j++) sum += (int32_t)q[j] * x[j];
        s += fp16_at(wb) * xd[b] * (float)sum;
    }
    return s;
}

// Weight-only: a Q8_0 row of n elements against fp32 activations (exact up to the summation order). Per
// block, four fp32 products of eight widened quants, summed, then scaled by d into the accumulator.
static inline float dot_q8_0_f32(const uint8_t *restrict w, const float *restrict x, int n) {
    const int nb = n / Q8_BLOCK;
    int b = 0;
    float s = 0.0f;
#if defined(__AVX512F__)  // two halves of 16 widened quants a block: half the instructions of eight-wide
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; b < nb; b++) {
        const uint8_t *wb = w + (long)b * Q8_0_BYTES;
        const float *xb = x + (long)b * Q8_BLOCK;
        PREFETCH_ROW(wb);
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + 2))));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + 18))));
        const __m512 sum = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb)));
        if (b & 1)
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(fp16_at(wb)), sum, acc1);
        else
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(fp16_at(wb)), sum, acc0);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(__AVX2__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; b < nb; b++) {
        const uint8_t *wb = w + (long)b * Q8_0_BYTES;
        const float *xb = x + (long)b * Q8_BLOCK;
        PREFETCH_ROW(wb);
        __m256 part[4];
        for (int j = 0; j < 4; j++) {
            long long eight;
            memcpy(&eight, wb + 2 + 8 * j, 8);
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(eight)));
            part[j] = _mm256_mul_ps(q, _mm256_loadu_ps(xb + 8 * j));
        }
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3]));
        if (b & 1)
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_at(wb)), sum, acc1);
        else
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16_at(wb)), sum, acc0);
    }
    s = hsum256(_mm256_add_ps(acc0, acc1));
#endif
    for (; b < nb; b++) {
        const uint8_t *wb = w + (long)b * Q8_0_BYTES;
        const int8_t *q = (const int8_t *)(wb + 2);
        const float *xb = x + (long)b * Q8_BLOCK;
        float sum = 0.0f;
        for (int j = 0; j < Q8_BLOCK; j++) sum += (float)q[j] * xb[j];
        s += fp16_at(wb) * sum;
    }
    return s;
}

// A Q8_0 row of n elements widened to fp32 (for several dots with the same row).
static inline void dequant_q8_0(const uint8_t *restrict w, float *restrict out, int n) {
    for (int b = 0; b < n / Q8_BLOCK; b++) {
        const uint8_t *wb = w + (long)b * Q8_0_BYTES;
        const float d = fp16_at(wb);
        const int8_t *q = (const int8_t *)(wb + 2);
        for (int j = 0; j < Q8_BLOCK; j++) out[(long)b * Q8_BLOCK + j] = d * (float)q[j];
    }
}

// out[j] = w . v[j] for `count` quantized activations (the row stays in L1 after the first).
static inline void dots_q8_0(const uint8_t *restrict w, const int8_t *const *vq, const float *const *vd,
                             int count, int n, float *out) {
    for (int j = 0; j < count; j++) out[j] = dot_q8_0(w, vq[j], vd[j], n);
}

#endif
