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

// The codes of a 16-weight group's sign byte pair as int8 multipliers: bit j of `signs` set -> −1.
static inline void signed_grid8(uint64_t grid, uint8_t signs, int8_t *restrict q) {
    for (int j = 0; j < 8; j++) {
        const int v = (int)((grid >> (8 * j)) & 255);
        q[j] = (int8_t)((signs >> j) & 1 ? -v : v);
    }
}

// One block of `codec` (a lowbit_codec) as int8 q [block elements], scales sc and mins mn per 16: the
// plain statement (and the build's way without AVX2).
static inline void int8_block_plain(int codec, const uint8_t *restrict b, int8_t *restrict q, float *restrict sc,
                              float *restrict mn) {
    switch (codec) {
        case FT_CODEC_Q4_0:
        case FT_CODEC_IQ4_NL:
        case FT_CODEC_Q4_1: {
            const int affine = codec == FT_CODEC_Q4_1;
            const uint8_t *qs = b + (affine ? 4 : 2);
            for (int j = 0; j < 16; j++) {
                const int lo = qs[j] & 15, hi = qs[j] >> 4;
                q[j] = (int8_t)(codec == FT_CODEC_IQ4_NL ? IQ4_NL_KVALUES[lo] : affine ? lo : lo - 8);
                q[j + 16] = (int8_t)(codec == FT_CODEC_IQ4_NL ? IQ4_NL_KVALUES[hi] : affine ? hi : hi - 8);
            }
            sc[0] = sc[1] = fp16_at(b);
            mn[0] = mn[1] = affine ? -fp16_at(b + 2) : 0.0f;
            return;
        }
        case FT_CODEC_Q5_0:
        case FT_CODEC_Q5_1: {
            const int affine = codec == FT_CODEC_Q5_1;
            const uint32_t qh = u32_at(b + (affine ? 4 : 2));
            const uint8_t *qs = b + (affine ? 8 : 6);
            for (int j = 0; j < 16; j++) {
                q[j] = (int8_t)((int)((qs[j] & 15) | (((qh >> j) & 1) << 4)) - (affine ? 0 : 16));
                q[j + 16] = (int8_t)((int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - (affine ? 0 : 16));
            }
            sc[0] = sc[1] = fp16_at(b);
            mn[0] = mn[1] = affine ? -fp16_at(b + 2) : 0.0f;
            return;
        }
        case FT_CODEC_Q2_K: {
            const float d = fp16_at(b + 80), dmin = fp16_at(b + 82);
            for (int sub = 0; sub < 16; sub++) {
                const int g = sub / 8, s = (sub / 2) % 4, half = sub % 2;
                const uint8_t *qs = b + 16 + 32 * g + 16 * half;
                for (int l = 0; l < 16; l++) q[16 * sub + l] = (int8_t)((qs[l] >> (2 * s)) & 3);
                sc[sub] = d * (float)(b[sub] & 15), mn[sub] = dmin * (float)(b[sub] >> 4);
            }
            return;
        }
        case FT_CODEC_Q3_K: {
            const uint8_t *hmask = b, *qs = b + 32, *scales = b + 96;
            const float d = fp16_at(b + 108);
            for (int sub = 0; sub < 16; sub++) {
                const int low = (scales[sub % 8] >> (4 * (sub / 8))) & 15;
                const int high = (scales[8 + sub % 4] >> (2 * (sub / 4))) & 3;
                const int e0 = 16 * sub, g = e0 / 128, s = (e0 % 128) / 32, l0 = e0 % 32;
                for (int l = 0; l < 16; l++) {
                    const int v = (qs[32 * g + l0 + l] >> (2 * s)) & 3, h = (hmask[l0 + l] >> (e0 / 32)) & 1;
                    q[e0 + l] = (int8_t)(v - (h ? 0 : 4));
                }
                sc[sub] = d * (float)((low | (high << 4)) - 32), mn[sub] = 0.0f;
            }
            return;
        }
        case FT_CODEC_IQ2_XXS: {
            const float d = fp16_at(b);
            for (int ib = 0; ib < 8; ib++) {
                const uint32_t idx = u32_at(b + 2 + 8 * ib), aux = u32_at(b + 6 + 8 * ib);
                for (int l = 0; l < 4; l++)
                    signed_grid8(IQ2XXS_GRID[(idx >> (8 * l)) & 255], KSIGNS[(aux >> (7 * l)) & 127], q + 32 * ib + 8 * l);
                sc[2 * ib] = sc[2 * ib + 1] = d * (0.5f + (float)(aux >> 28)) * 0.25f;
                mn[2 * ib] = mn[2 * ib + 1] = 0.0f;
            }
            return;
        }
        case FT_CODEC_IQ2_XS: {
            const float d = fp16_at(b);
            for (int i = 0; i < 32; i++) {
                const int v = b[2 + 2 * i] | (b[3 + 2 * i] << 8);
                signed_grid8(IQ2XS_GRID[v & 511], KSIGNS[v >> 9], q + 8 * i);
            }
            for (int s = 0; s < 16; s++) {
                sc[s] = d * (0.5f + (float)((b[66 + s / 2] >> (4 * (s % 2))) & 15)) * 0.25f;
                mn[s] = 0.0f;
            }
            return;
        }
        case FT_CODEC_IQ3_XXS: {
            const float d = fp16_at(b);
            for (int ib = 0; ib < 8; ib++) {
                const uint32_t aux = u32_at(b + 66 + 4 * ib);
                for (int l = 0; l < 4; l++) {
                    const uint8_t *g = b + 2 + 8 * ib + 2 * l;
                    const uint64_t grid = IQ3XXS_GRID[g[0]] | ((uint64_t)IQ3XXS_GRID[g[1]] << 32);
                    signed_grid8(grid, KSIGNS[(aux >> (7 * l)) & 127], q + 32 * ib + 8 * l);
                }
                sc[2 * ib] = sc[2 * ib + 1] = d * (0.5f + (float)(aux >> 28)) * 0.5f;
                mn[2 * ib] = mn[2 * ib + 1] = 0.0f;
            }
            return;
        }
        default: {  // IQ3_S
            const float d = fp16_at(b);
            const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
            for (int g = 0; g < 32; g++) {
                const int i0 = 2 * g, i1 = 2 * g + 1;
                const uint64_t grid = IQ3S_GRID[qs[i0] | (((qh[i0 / 8] >> (i0 % 8)) & 1) << 8)] |
                                      ((uint64_t)IQ3S_GRID[qs[i1] | (((qh[i1 / 8] >> (i1 % 8)) & 1) << 8)] << 32);
                signed_grid8(grid, signs[g], q + 8 * g);
            }
            for (int s = 0; s < 16; s++) {
                sc[s] = d * (float)(1 + 2 * ((scales[s / 4] >> (4 * ((s / 2) % 2))) & 15));
                mn[s] = 0.0f;
            }
            return;
        }
    }
}

#if defined(__AVX2__)
// Two 8-weight codebook groups as sixteen int8: grid bytes, negated where the sign bytes have a bit.
static inline __m128i signed_grid16(uint64_t g0, uint64_t g1, uint8_t s0, uint8_t s1) {
    const uint8_t signs[2] = {s0, s1};
    const __m128i neg = _mm_sub_epi8(_mm_setzero_si128(), bits16(signs));  // 0xFF where negated
    return _mm_sub_epi8(_mm_xor_si128(_mm_set_epi64x((long long)g1, (long long)g0), neg), neg);
}

// A super-block's scales and mins per 16 weights (w = sc·q − mn), as int8_block_plain sets them.
static inline __attribute__((always_inline)) void super_scales(int codec, const uint8_t *restrict b, float *restrict sc, float *restrict mn) {
    const float d = fp16_at(b);
    for (int s = 0; s < 16; s++) {
        mn[s] = 0.0f;
        switch (codec) {
            case FT_CODEC_Q2_K:
                sc[s] = fp16_at(b + 80) * (float)(b[s] & 15), mn[s] = fp16_at(b + 82) * (float)(b[s] >> 4);
                break;
            case FT_CODEC_Q3_K: {
                const int low = (b[96 + s % 8] >> (4 * (s / 8))) & 15, high = (b[104 + s % 4] >> (2 * (s / 4))) & 3;
                sc[s] = fp16_at(b + 108) * (float)((low | (high << 4)) - 32);
                break;
            }
            case FT_CODEC_IQ2_XXS: sc[s] = d * (0.5f + (float)(u32_at(b + 6 + 8 * (s / 2)) >> 28)) * 0.25f; break;
            case FT_CODEC_IQ2_XS: sc[s] = d * (0.5f + (float)((b[66 + s / 2] >> (4 * (s % 2))) & 15)) * 0.25f; break;
            case FT_CODEC_IQ3_XXS: sc[s] = d * (0.5f + (float)(u32_at(b + 66 + 4 * (s / 2)) >> 28)) * 0.5f; break;
            default: sc[s] = d * (float)(1 + 2 * ((b[106 + s / 4] >> (4 * ((s / 2) % 2))) & 15)); break;
        }
    }
}

// Weights 32c .. 32c + 31 of a super-block (Q2_K, Q3_K, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S) as int8, in order.
static inline __attribute__((always_inline)) __m256i super32(int codec, const uint8_t *restrict b, int c) {
    const __m256i three = _mm256_set1_epi8(3);
    switch (codec) {
        case FT_CODEC_Q2_K: {  // weight 128g + 32s + l: byte 32g + l, bits 2s
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (c / 4)));
            return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (c % 4))), three);
        }
        case FT_CODEC_Q3_K: {  // the same two bits, minus 4 where hmask[l] bit c is clear
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (c / 4)));
            const __m256i q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (c % 4))), three);
            const __m256i h = _mm256_and_si256(
                _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)b), _mm_cvtsi32_si128(c)), _mm256_set1_epi8(1));
            return _mm256_sub_epi8(q, _mm256_sub_epi8(_mm256_set1_epi8(4), _mm256_slli_epi16(h, 2)));
        }
        case FT_CODEC_IQ2_XXS: {
            const uint32_t idx = u32_at(b + 2 + 8 * c), aux = u32_at(b + 6 + 8 * c);
            __m128i half[2];
            for (int l = 0; l < 4; l += 2)
                half[l / 2] = signed_grid16(IQ2XXS_GRID[(idx >> (8 * l)) & 255], IQ2XXS_GRID[(idx >> (8 * l + 8)) & 255],
                                            KSIGNS[(aux >> (7 * l)) & 127], KSIGNS[(aux >> (7 * l + 7)) & 127]);
            return _mm256_set_m128i(half[1], half[0]);
        }
        case FT_CODEC_IQ2_XS: {
            __m128i half[2];
            for (int k = 0; k < 2; k++) {
                const int i = 4 * c + 2 * k;
                const int v0 = b[2 + 2 * i] | (b[3 + 2 * i] << 8), v1 = b[4 + 2 * i] | (b[5 + 2 * i] << 8);
                half[k] = signed_grid16(IQ2XS_GRID[v0 & 511], IQ2XS_GRID[v1 & 511], KSIGNS[v0 >> 9], KSIGNS[v1 >> 9]);
            }
            return _mm256_set_m128i(half[1], half[0]);
        }
        case FT_CODEC_IQ3_XXS: {
            const uint32_t aux = u32_at(b + 66 + 4 * c);
            const uint8_t *g = b + 2 + 8 * c;
            __m128i half[2];
            for (int l = 0; l < 4; l += 2)
                half[l / 2] = signed_grid16(IQ3XXS_GRID[g[2 * l]] | ((uint64_t)IQ3XXS_GRID[g[2 * l + 1]] << 32),
                                            IQ3XXS_GRID[g[2 * l + 2]] | ((uint64_t)IQ3XXS_GRID[g[2 * l + 3]] << 32),
                                            KSIGNS[(aux >> (7 * l)) & 127], KSIGNS[(aux >> (7 * l + 7)) & 127]);
            return _mm256_set_m128i(half[1], half[0]);
        }
        default: {  // IQ3_S: groups 4c .. 4c + 3 of 8, each two 4-weight grid entries with a ninth index bit
            const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74;
            uint64_t grids[4];
            for (int k = 0; k < 4; k++) {
                const int i0 = 2 * (4 * c + k), i1 = i0 + 1;
                grids[k] = IQ3S_GRID[qs[i0] | (((qh[i0 / 8] >> (i0 % 8)) & 1) << 8)] |
                           ((uint64_t)IQ3S_GRID[qs[i1] | (((qh[i1 / 8] >> (i1 % 8)) & 1) << 8)] << 32);
            }
            return _mm256_set_m128i(signed_grid16(grids[2], grids[3], signs[4 * c + 2], signs[4 * c + 3]),
                                    signed_grid16(grids[0], grids[1], signs[4 * c], signs[4 * c + 1]));
        }
    }
}

// Σ_16 q·x8 of each half of 32 int8 weights against 32 int8 activations: 8 int32 lanes, the first
// four the first sixteen's partial sums, the last four the second's.
static inline __m256i pair_sums(__m256i q, __m256i v) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(v, q));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// A super-block row against one int8 activation vector (a scale per 256): per super-block its scales
// per 16, then 32 weights at a time decoded in registers and dotted at once.
static inline __attribute__((always_inline)) float dot_super_q8_of(int codec, const uint8_t *restrict row,
                                                                   const int8_t *restrict x, const float *restrict xd,
                                                                   const int16_t *restrict xs, int n, int bytes) {
    const int has_min = codec == FT_CODEC_Q2_K;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int b = 0; b < n / 256; b++, row += bytes) {
        float sc[16], mn[16];
        super_scales(codec, row, sc, mn);
        const float dx = xd[b];
        for (int c = 0; c < 8; c++) {
            const __m256 sums = _mm256_cvtepi32_ps(
                pair_sums(super32(codec, row, c), _mm256_loadu_si256((const __m256i *)(x + 256 * b + 32 * c))));
            const __m256 scale = _mm256_set_m128(_mm_set1_ps(sc[2 * c + 1] * dx), _mm_set1_ps(sc[2 * c] * dx));
            acc = _mm256_fmadd_ps(scale, sums, acc);
        }
        if (has_min)
            for (int g = 0; g < 16; g++) mins += mn[g] * dx * (float)xs[16 * b + g];
    }
    return hsum256(acc) - mins;
}

// dot_super_q8_of with the codec a constant in each branch (its decoding specialised, no switch a step).
static inline float dot_super_q8(int codec, const uint8_t *restrict row, const int8_t *restrict x,
                                 const float *restrict xd, const int16_t *restrict xs, int n, int bytes) {
    switch (codec) {
        case FT_CODEC_Q2_K: return dot_super_q8_of(FT_CODEC_Q2_K, row, x, xd, xs, n, bytes);
        case FT_CODEC_Q3_K: return dot_super_q8_of(FT_CODEC_Q3_K, row, x, xd, xs, n, bytes);
        case FT_CODEC_IQ2_XXS: return dot_super_q8_of(FT_CODEC_IQ2_XXS, row, x, xd, xs, n, bytes);
        case FT_CODEC_IQ2_XS: return dot_super_q8_of(FT_CODEC_IQ2_XS, row, x, xd, xs, n, bytes);
        case FT_CODEC_IQ3_XXS: return dot_super_q8_of(FT_CODEC_IQ3_XXS, row, x, xd, xs, n, bytes);
        default: return dot_super_q8_of(FT_CODEC_IQ3_S, row, x, xd, xs, n, bytes);
    }
}

// The 32 weights of a legacy block (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) as int8 in one vector, weights in order.
static inline __attribute__((always_inline)) __m256i legacy32(int codec, const uint8_t *restrict b) {
    const int affine = codec == FT_CODEC_Q4_1 || codec == FT_CODEC_Q5_1;
    const int five = codec == FT_CODEC_Q5_0 || codec == FT_CODEC_Q5_1;
    const uint8_t *qh = b + (affine ? 4 : 2), *qs = qh + (five ? 4 : 0);
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    if (five) {
        lo = _mm_or_si128(lo, _mm_slli_epi16(bits16(qh), 4));
        hi = _mm_or_si128(hi, _mm_slli_epi16(bits16(qh + 2), 4));
    }
    if (codec == FT_CODEC_IQ4_NL) {
        const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_NL_KVALUES);
        lo = _mm_shuffle_epi8(table, lo), hi = _mm_shuffle_epi8(table, hi);
    } else if (!affine) {
        const __m128i off = _mm_set1_epi8(five ? 16 : 8);
        lo = _mm_sub_epi8(lo, off), hi = _mm_sub_epi8(hi, off);
    }
    return _mm256_set_m128i(hi, lo);
}

// A legacy row against one int8 activation vector (blocks of 32, one activation scale each), each block
// decoded in registers and dotted at once: Σ_b d_b · dx_b · Σ q·x8 (+ m_b · dx_b · Σ x8 for Q4_1, Q5_1).
static inline __attribute__((always_inline)) float dot_legacy_q8_of(int codec, const uint8_t *restrict row,
                                                                    const int8_t *restrict x, const float *restrict xd,
                                                                    const int16_t *restrict xs, int n, int bytes) {
    const int affine = codec == FT_CODEC_Q4_1 || codec == FT_CODEC_Q5_1;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int b = 0; b < n / 32; b++, row += bytes) {
        const __m256i q = legacy32(codec, row), v = _mm256_loadu_si256((const __m256i *)(x + 32 * b));
        const __m256 sums = _mm256_cvtepi32_ps(pair_sums(q, v));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_at(row) * xd[b]), sums, acc);
        if (affine) mins += fp16_at(row + 2) * xd[b] * (float)(xs[2 * b] + xs[2 * b + 1]);
    }
    return hsum256(acc) + mins;
}

// dot_legacy_q8_of with the codec a constant in each branch.
static inline float dot_legacy_q8(int codec, const uint8_t *restrict row, const int8_t *restrict x,
                                  const float *restrict xd, const int16_t *restrict xs, int n, int bytes) {
    switch (codec) {
        case FT_CODEC_Q4_0: return dot_legacy_q8_of(FT_CODEC_Q4_0, row, x, xd, xs, n, bytes);
        case FT_CODEC_Q4_1: return dot_legacy_q8_of(FT_CODEC_Q4_1, row, x, xd, xs, n, bytes);
        case FT_CODEC_Q5_0: return dot_legacy_q8_of(FT_CODEC_Q5_0, row, x, xd, xs, n, bytes);
        case FT_CODEC_Q5_1: return dot_legacy_q8_of(FT_CODEC_Q5_1, row, x, xd, xs, n, bytes);
        default: return dot_legacy_q8_of(FT_CODEC_IQ4_NL, row, x, xd, xs, n, bytes);
    }
}
#endif

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

// out[j] = row · vector j for `count` int8 activation vectors (q, d, 16-sums) of `act8` (a lowbit act8
// id): with AVX2 each block decoded in registers and dotted at once; otherwise the plain statement, up to
// 256 weights decoded at a time into L1 for all the vectors.
static inline void dots_lowbit_q8(int act8, const uint8_t *restrict row, const int8_t *const *vq,
                                  const float *const *vd, const int16_t *const *vs, int count, int n, float *out) {
    const int codec = lowbit_of_act8(act8);
    int elements, bytes;
    codec_block(codec, &elements, &bytes);
#if defined(__AVX2__)
    for (int j = 0; j < count; j++)
        out[j] = elements == 32 ? dot_legacy_q8(codec, row, vq[j], vd[j], vs[j], n, bytes)
                                : dot_super_q8(codec, row, vq[j], vd[j], vs[j], n, bytes);
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
