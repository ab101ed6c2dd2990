// lowbit_dot.h's types against int8 activation blocks (their FT_CODEC_LOWBIT_ACT8 ids): each block's
// weights decoded to int8 values with a scale and a min per 16 (w = sc·q − mn), dotted sixteen at a time
// in integers and scaled once per 16: Σ w·x = dx · Σ_16 (sc · Σ q·x8 − mn · Σ x8), dx the activation
// block's scale (per 256 for the super-block types, as the K-quants'; per 32 for Q4_0, Q4_1, Q5_0, Q5_1,
// IQ4_NL, as llama.cpp's Q8_0 activations), Σ x8 the sums quantize_q8 keeps per 16.
#ifndef FT_LOWBIT_DOT_INT8_H
#define FT_LOWBIT_DOT_INT8_H
#include <stdint.h>

#include "lowbit_dot.h"
#include "quant_dot.h"

#if LOWBIT_SIMD
// Σ_16 q·x8 of each half of 32 int8 weights against 32 int8 activations: 8 int32 lanes, the first
// four the first sixteen's partial sums, the last four the second's.
static inline __m256i pair_sums(__m256i q, __m256i v) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// A super-block row against M int8 activation vectors (a scale per 256): per super-block its scales per 16,
// then 32 weights at a time decoded in registers once and dotted with each vector (M constant: 1, or
// LOWBIT_Q8_VECTORS for a prompt's pairs, whose decoding is then shared).
#define LOWBIT_Q8_VECTORS 4
static inline __attribute__((always_inline)) void dots_super_q8_of(int codec, const uint8_t *restrict row,
                                                                   const int8_t *const *x, const float *const *xd,
                                                                   const int16_t *const *xs, int n, int bytes,
                                                                   const int M, float *out) {
    const int has_min = codec == FT_CODEC_Q2_K;
    __m256 acc[LOWBIT_Q8_VECTORS];
    float mins[LOWBIT_Q8_VECTORS];
    for (int j = 0; j < M; j++) acc[j] = _mm256_setzero_ps(), mins[j] = 0.0f;
    for (int b = 0; b < n / 256; b++, row += bytes) {
        float sc[16], mn[16];
        lowbit_scales(codec, row, sc, mn);
        for (int c = 0; c < 8; c++) {
            const __m256i q = super32(codec, row, c);
            for (int j = 0; j < M; j++) {
                const float dx = xd[j][b];
                const __m256 sums = _mm256_cvtepi32_ps(
                    pair_sums(q, _mm256_loadu_si256((const __m256i *)(x[j] + 256 * b + 32 * c))));
                const __m256 scale = _mm256_set_m128(_mm_set1_ps(sc[2 * c + 1] * dx), _mm_set1_ps(sc[2 * c] * dx));
                acc[j] = _mm256_fmadd_ps(scale, sums, acc[j]);
            }
        }
        if (has_min)
            for (int j = 0; j < M; j++)
                for (int g = 0; g < 16; g++) mins[j] += mn[g] * xd[j][b] * (float)xs[j][16 * b + g];
    }
    for (int j = 0; j < M; j++) out[j] = hsum256(acc[j]) - mins[j];
}

// A legacy row against M int8 activation vectors (blocks of 32, one activation scale each), each block
// decoded in registers once and dotted with each vector: Σ_b d_b · dx_b · Σ q·x8 (+ m_b · dx_b · Σ x8 for
// Q4_1, Q5_1).
static inline __attribute__((always_inline)) void dots_legacy_q8_of(int codec, const uint8_t *restrict row,
                                                                    const int8_t *const *x, const float *const *xd,
                                                                    const int16_t *const *xs, int n, int bytes,
                                                                    const int M, float *out) {
    const int affine = codec == FT_CODEC_Q4_1 || codec == FT_CODEC_Q5_1;
    __m256 acc[LOWBIT_Q8_VECTORS];
    float mins[LOWBIT_Q8_VECTORS], sc[2], mn[2];
    for (int j = 0; j < M; j++) acc[j] = _mm256_setzero_ps(), mins[j] = 0.0f;
    for (int b = 0; b < n / 32; b++, row += bytes) {
        const __m256i q = legacy32(codec, row);
        lowbit_scales(codec, row, sc, mn);
        for (int j = 0; j < M; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(x[j] + 32 * b));
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(sc[0] * xd[j][b]), _mm256_cvtepi32_ps(pair_sums(q, v)), acc[j]);
            if (affine) mins[j] += mn[0] * xd[j][b] * (float)(xs[j][2 * b] + xs[j][2 * b + 1]);
        }
    }
    for (int j = 0; j < M; j++) out[j] = hsum256(acc[j]) - mins[j];
}

// A row of any low-bit codec against M int8 vectors (dots_legacy_q8_of or dots_super_q8_of), the codec and
// M constants in each branch (M 1, or LOWBIT_Q8_VECTORS).
static inline void dots_q8(int codec, const uint8_t *restrict row, const int8_t *const *x, const float *const *xd,
                           const int16_t *const *xs, int n, int bytes, int M, float *out) {
#define FT_DOTS_Q8_M(C, m)                                                \
    (lowbit_legacy(C) ? dots_legacy_q8_of(C, row, x, xd, xs, n, bytes, m, out) \
                             : dots_super_q8_of(C, row, x, xd, xs, n, bytes, m, out))
#define FT_DOTS_Q8(C) (M == 1 ? FT_DOTS_Q8_M(C, 1) : FT_DOTS_Q8_M(C, LOWBIT_Q8_VECTORS))
    FT_LOWBIT_SWITCH(codec, FT_DOTS_Q8)
#undef FT_DOTS_Q8
#undef FT_DOTS_Q8_M
}
#else
// The plain statement's dot (builds without AVX2): Σ over groups of 16 of dx · (sc · Σ q·x8 − mn · Σ x8).
static inline float block_dot_q8(const int8_t *restrict q, const float *restrict sc, const float *restrict mn,
                                 int groups, const int8_t *restrict x, const float *restrict xd, int a_shift, int at,
                                 const int16_t *restrict xs) {
    float s = 0.0f;
    for (int g = 0; g < groups; g++) {
        int isum = 0;
        for (int j = 0; j < 16; j++) isum += q[16 * g + j] * x[at + 16 * g + j];
        const float dx = xd[(at + 16 * g) >> a_shift];
        s += dx * (sc[g] * (float)isum - mn[g] * (float)xs[(at + 16 * g) / 16]);
    }
    return s;
}
#endif

// out[j] = row · vector j for `count` int8 activation vectors (q, d, 16-sums) of `act8` (a lowbit act8
// id): with AVX2 each block decoded in registers and dotted at once, with four vectors at a time where
// there are four (a prompt's pairs share the decoding); otherwise the plain statement, up to 256 weights
// decoded at a time into L1 for all the vectors.
static inline void dots_lowbit_q8(int act8, const uint8_t *restrict row, const int8_t *const *vq,
                                  const float *const *vd, const int16_t *const *vs, int count, int n, float *out) {
    const int codec = lowbit_of_act8(act8);
    int elements, bytes;
    codec_block(codec, &elements, &bytes);
#if LOWBIT_SIMD
    for (int j = 0; j < count;) {  // the vectors four at a time (each block decoded once for them), then one
        const int m = count - j >= LOWBIT_Q8_VECTORS ? LOWBIT_Q8_VECTORS : 1;
        dots_q8(codec, row, vq + j, vd + j, vs + j, n, bytes, m, out + j);
        j += m;
    }
#else
    const int a_shift = act8_block(act8) == 256 ? 8 : 5;
    int8_t q[LOWBIT_CHUNK];
    float sc[LOWBIT_CHUNK / 16], mn[LOWBIT_CHUNK / 16];
    for (int j = 0; j < count; j++) out[j] = 0.0f;
    const uint8_t *b = row;
    for (int k0 = 0; k0 < n; k0 += LOWBIT_CHUNK) {
        const int len = n - k0 < LOWBIT_CHUNK ? n - k0 : LOWBIT_CHUNK;
        for (int k = 0; k < len; k += elements, b += bytes) int8_block_plain(codec, b, q + k, sc + k / 16, mn + k / 16);
        for (int j = 0; j < count; j++) out[j] += block_dot_q8(q, sc, mn, len / 16, vq[j], vd[j], a_shift, k0, vs[j]);
    }
#endif
}

#endif
