// Rows in the codecs users download below 4 bits and the legacy ones (ggml's layouts, what
// gguf.quants.dequantize reads), kept as stored: each block decoded to fp32 in L1 (one pass of vector
// arithmetic or codebook lookups), then dotted with every vector of the unit, so a row is read once for
// all of them. Layouts (bytes per block of weights; fp16 scales little-endian):
//   Q4_0 18/32: d, qs[16]; w = d·(q − 8), byte j's low nibble weight j, high nibble weight j + 16.
//   Q5_0 22/32: d, qh (32 bits, weight j's fifth bit), qs[16] as Q4_0's; w = d·(q − 16).
//   IQ4_NL 18/32: d, qs[16] as Q4_0's; w = d·IQ4_NL[q].
//   Q4_1 20/32: d, m, qs[16] as Q4_0's; w = d·q + m. Q5_1 24/32: d, m, qh, qs[16]; w = d·q + m.
//   Q2_K 84/256: scales[16] (low nibble scale, high nibble min of 16 weights), qs[64], d, dmin; weight
//        128g + 32s + l has 2 bits at byte 32g + l shift 2s; w = d·sc·q − dmin·m.
//   Q3_K 110/256: hmask[32], qs[64], scales[12] (sixteen 6-bit, minus 32), d; weight e has qs's 2 bits as
//        Q2_K's and hmask[e % 32] bit e / 32 clear subtracting 4; w = d·sc·q.
//   IQ2_XXS 66/256: d, then per 32 weights two words: four grid indices (bytes), and four 7-bit sign
//        indices and a 4-bit scale ls (top); w = d·(0.5 + ls)/4 · grid · sign.
//   IQ2_XS 74/256: d, 32 words (9-bit grid index, 7-bit sign index per 8 weights), scales[8] (a nibble
//        per 16 weights); w = d·(0.5 + ls)/4 · grid · sign.
//   IQ3_XXS 98/256: d, qs[64] (an index of 4 weights each), per 32 weights a word of four 7-bit sign
//        indices and a 4-bit scale; w = d·(0.5 + ls)/2 · grid · sign.
//   IQ3_S 110/256: d, qs[64] (low 8 bits of 9-bit indices of 4 weights), qh[8] (their ninth bits),
//        signs[32] (a bit a weight), scales[4] (a nibble per 32 weights); w = d·(1 + 2·ls) · grid · sign.
#ifndef FT_LOWBIT_DOT_H
#define FT_LOWBIT_DOT_H
#include <stdint.h>
#include <string.h>

#include "iq_grids.h"
#include "quant_dot.h"

#define LOWBIT_CHUNK 256  // weights decoded at a time (a K-quant super-block; eight 32-weight blocks)

static const int8_t IQ4_NL_KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline int lowbit_codec(int codec) { return codec >= FT_CODEC_Q4_0 && codec <= FT_CODEC_Q5_1; }

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX2__) && defined(__FMA__)
// y[0..16) = a·q − m for sixteen int8 q.
static inline void put16(__m128i q, float a, float m, float *restrict y) {
    const __m256 va = _mm256_set1_ps(a), vm = _mm256_set1_ps(m);
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
    _mm256_storeu_ps(y, _mm256_fmsub_ps(va, lo, vm));
    _mm256_storeu_ps(y + 8, _mm256_fmsub_ps(va, hi, vm));
}

// Bits j of the two bytes at p (bit j of byte k for lane 8k + j) as 0/1 bytes: [16] uint8.
static inline __m128i bits16(const uint8_t *p) {
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(p[0] | (p[1] << 8)),
                                            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(1));
}

static inline void block_q4_0(const uint8_t *restrict b, float *restrict y, int iq4_nl) {
    const float d = fp16_at(b);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), low4 = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    if (iq4_nl) {
        const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_NL_KVALUES);
        lo = _mm_shuffle_epi8(table, lo), hi = _mm_shuffle_epi8(table, hi);
    } else {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8(8)), hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    put16(lo, d, 0.0f, y);
    put16(hi, d, 0.0f, y + 16);
}

// Q5_0 (affine 0: w = d·(q − 16)) and Q5_1 (affine 1: w = d·q + m): 32 five-bit quants from qh and qs.
static inline void block_q5(const uint8_t *restrict b, float *restrict y, int affine) {
    const float d = fp16_at(b), m = affine ? fp16_at(b + 2) : 0.0f;
    const uint8_t *qh = b + (affine ? 4 : 2), *qs = qh + 4;
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(15);
    const __m128i off = _mm_set1_epi8(affine ? 0 : 16);
    const __m128i lo = _mm_or_si128(_mm_and_si128(q, low4), _mm_slli_epi16(bits16(qh), 4));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), low4), _mm_slli_epi16(bits16(qh + 2), 4));
    put16(_mm_sub_epi8(lo, off), d, -m, y);
    put16(_mm_sub_epi8(hi, off), d, -m, y + 16);
}

static inline void block_q4_1(const uint8_t *restrict b, float *restrict y) {
    const float d = fp16_at(b), m = fp16_at(b + 2);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4)), low4 = _mm_set1_epi8(15);
    put16(_mm_and_si128(q, low4), d, -m, y);
    put16(_mm_and_si128(_mm_srli_epi16(q, 4), low4), d, -m, y + 16);
}

static inline void block_q2_k(const uint8_t *restrict b, float *restrict y) {
    const float d = fp16_at(b + 80), dmin = fp16_at(b + 82);
    const __m128i three = _mm_set1_epi8(3);
    for (int sub = 0; sub < 16; sub++) {  // 16 weights from 16·sub = 128g + 32s + 16half
        const int g = sub / 8, s = (sub / 2) % 4, half = sub % 2;
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 16 + 32 * g + 16 * half));
        put16(_mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(2 * s)), three), d * (float)(b[sub] & 15),
              dmin * (float)(b[sub] >> 4), y + 16 * sub);
    }
}

static inline void block_q3_k(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    const float d = fp16_at(b + 108);
    const __m128i three = _mm_set1_epi8(3), one = _mm_set1_epi8(1), four = _mm_set1_epi8(4);
    for (int sub = 0; sub < 16; sub++) {
        const int low = (sc[sub % 8] >> (4 * (sub / 8))) & 15, high = (sc[8 + sub % 4] >> (2 * (sub / 4))) & 3;
        const int e0 = 16 * sub, g = e0 / 128, s = (e0 % 128) / 32, l0 = e0 % 32;
        const __m128i q = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * g + l0)),
                                                      _mm_cvtsi32_si128(2 * s)), three);
        const __m128i h = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(hmask + l0)),
                                                      _mm_cvtsi32_si128(e0 / 32)), one);
        put16(_mm_sub_epi8(q, _mm_sub_epi8(four, _mm_slli_epi16(h, 2))), d * (float)((low | (high << 4)) - 32), 0.0f,
              y + e0);
    }
}

// Eight weights of a codebook group: `grid` bytes times `scale`, negated where `signs` has a bit.
static inline void grid8(uint64_t grid, uint8_t signs, float scale, float *restrict y) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)grid)));
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i neg = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(signs), bit), bit);
    _mm256_storeu_ps(y, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(scale), v),
                                      _mm256_castsi256_ps(_mm256_slli_epi32(neg, 31))));
}
#else
static inline void block_q4_0(const uint8_t *restrict b, float *restrict y, int iq4_nl) {
    const float d = fp16_at(b);
    for (int j = 0; j < 16; j++) {
        const int lo = b[2 + j] & 15, hi = b[2 + j] >> 4;
        y[j] = d * (float)(iq4_nl ? IQ4_NL_KVALUES[lo] : lo - 8);
        y[j + 16] = d * (float)(iq4_nl ? IQ4_NL_KVALUES[hi] : hi - 8);
    }
}

static inline void block_q5(const uint8_t *restrict b, float *restrict y, int affine) {
    const float d = fp16_at(b), m = affine ? fp16_at(b + 2) : 0.0f;
    const uint8_t *qs = b + (affine ? 8 : 6);
    const uint32_t qh = u32_at(b + (affine ? 4 : 2));
    const int off = affine ? 0 : 16;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)((qs[j] & 15) | (((qh >> j) & 1) << 4)) - off) + m;
        y[j + 16] = d * (float)((int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off) + m;
    }
}

static inline void block_q4_1(const uint8_t *restrict b, float *restrict y) {
    const float d = fp16_at(b), m = fp16_at(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b[4 + j] & 15) + m;
        y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

static inline void block_q2_k(const uint8_t *restrict b, float *restrict y) {
    const float d = fp16_at(b + 80), dmin = fp16_at(b + 82);
    for (int sub = 0; sub < 16; sub++) {
        const int g = sub / 8, s = (sub / 2) % 4, half = sub % 2;
        const float a = d * (float)(b[sub] & 15), m = dmin * (float)(b[sub] >> 4);
        const uint8_t *q = b + 16 + 32 * g + 16 * half;
        for (int l = 0; l < 16; l++) y[16 * sub + l] = a * (float)((q[l] >> (2 * s)) & 3) - m;
    }
}

static inline void block_q3_k(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    const float d = fp16_at(b + 108);
    for (int sub = 0; sub < 16; sub++) {
        const int low = (sc[sub % 8] >> (4 * (sub / 8))) & 15, high = (sc[8 + sub % 4] >> (2 * (sub / 4))) & 3;
        const float a = d * (float)((low | (high << 4)) - 32);
        const int e0 = 16 * sub, g = e0 / 128, s = (e0 % 128) / 32, l0 = e0 % 32;
        for (int l = 0; l < 16; l++) {
            const int q = (qs[32 * g + l0 + l] >> (2 * s)) & 3;
            const int h = (hmask[l0 + l] >> (e0 / 32)) & 1;
            y[e0 + l] = a * (float)(q - (h ? 0 : 4));
        }
    }
}

static inline void grid8(uint64_t grid, uint8_t signs, float scale, float *restrict y) {
    for (int j = 0; j < 8; j++) {
        const float v = scale * (float)((grid >> (8 * j)) & 255);
        y[j] = (signs >> j) & 1 ? -v : v;
    }
}
#endif

static inline void block_iq2_xxs(const uint8_t *restrict b, float *restrict y) {
    const float d = fp16_at(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t idx = u32_at(b + 2 + 8 * ib), aux = u32_at(b + 6 + 8 * ib);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++)
            grid8(IQ2XXS_GRID[(idx >> (8 * l)) & 255], KSIGNS[(aux >> (7 * l)) & 127], db, y + 32 * ib + 8 * l);
    }
}

static inline void block_iq2_xs(const uint8_t *restrict b, float *restrict y) {
    const float d = fp16_at(b);
    for (int i = 0; i < 32; i++) {
        const int q = b[2 + 2 * i] | (b[3 + 2 * i] << 8);
        const int ls = (b[66 + i / 4] >> (4 * ((i / 2) % 2))) & 15;
        grid8(IQ2XS_GRID[q & 511], KSIGNS[q >> 9], d * (0.5f + (float)ls) * 0.25f, y + 8 * i);
    }
}

static inline void block_iq3_xxs(const uint8_t *restrict b, float *restrict y) {
    const float d = fp16_at(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = u32_at(b + 66 + 4 * ib);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++) {
            const uint8_t *q = b + 2 + 8 * ib + 2 * l;
            const uint64_t grid = IQ3XXS_GRID[q[0]] | ((uint64_t)IQ3XXS_GRID[q[1]] << 32);
            grid8(grid, KSIGNS[(aux >> (7 * l)) & 127], db, y + 32 * ib + 8 * l);
        }
    }
}

static inline void block_iq3_s(const uint8_t *restrict b, float *restrict y) {
    const float d = fp16_at(b);
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
    for (int g = 0; g < 32; g++) {  // eight weights: grid entries 2g and 2g + 1
        const int ls = (scales[g / 8] >> (4 * ((g / 4) % 2))) & 15;
        const int i0 = 2 * g, i1 = 2 * g + 1;
        const uint64_t grid = IQ3S_GRID[qs[i0] | (((qh[i0 / 8] >> (i0 % 8)) & 1) << 8)] |
                              ((uint64_t)IQ3S_GRID[qs[i1] | (((qh[i1 / 8] >> (i1 % 8)) & 1) << 8)] << 32);
        grid8(grid, signs[g], d * (float)(1 + 2 * ls), y + 8 * g);
    }
}

// Weights [k0, k0 + count) of a row (k0 and count whole blocks) decoded to fp32 into y.
static inline void decode_lowbit(int codec, const uint8_t *restrict row, int k0, int count, float *restrict y) {
    int elements, bytes;
    codec_block(codec, &elements, &bytes);
    const uint8_t *b = row + (long)(k0 / elements) * bytes;  // one division a call, none a block
    for (int k = 0; k < count; k += elements, b += bytes) {
        float *out = y + k;
        switch (codec) {
            case FT_CODEC_Q4_0: block_q4_0(b, out, 0); break;
            case FT_CODEC_IQ4_NL: block_q4_0(b, out, 1); break;
            case FT_CODEC_Q5_0: block_q5(b, out, 0); break;
            case FT_CODEC_Q5_1: block_q5(b, out, 1); break;
            case FT_CODEC_Q4_1: block_q4_1(b, out); break;
            case FT_CODEC_Q2_K: block_q2_k(b, out); break;
            case FT_CODEC_Q3_K: block_q3_k(b, out); break;
            case FT_CODEC_IQ2_XXS: block_iq2_xxs(b, out); break;
            case FT_CODEC_IQ2_XS: block_iq2_xs(b, out); break;
            case FT_CODEC_IQ3_XXS: block_iq3_xxs(b, out); break;
            default: block_iq3_s(b, out); break;
        }
    }
}

static inline void dequant_lowbit(int codec, const uint8_t *restrict row, float *restrict out, int n) {
    decode_lowbit(codec, row, 0, n, out);
}

// out[j] = row · v[j] for `count` fp32 vectors: the row decoded a chunk at a time, each chunk dotted with
// every vector while it is in L1.
static inline void dots_lowbit(int codec, const uint8_t *restrict row, const float *const *v, int count, int n,
                               float *out) {
    float chunk[LOWBIT_CHUNK] __attribute__((aligned(64)));
    for (int j = 0; j < count; j++) out[j] = 0.0f;
    for (int k0 = 0; k0 < n; k0 += LOWBIT_CHUNK) {
        const int len = n - k0 < LOWBIT_CHUNK ? n - k0 : LOWBIT_CHUNK;
        decode_lowbit(codec, row, k0, len, chunk);
        for (int j = 0; j < count; j++) {
            const float *x = v[j] + k0;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int k = 0; k < len; k++) s += chunk[k] * x[k];
            out[j] += s;
        }
    }
}

#endif
