// Rows in the codecs users download below 4 bits and the legacy ones (ggml's layouts, what
// gguf.quants.dequantize reads), kept as stored. One decoding per type: a block's weights as int8 q with a
// scale and a min per 16 (w = sc·q − mn); the fp32 dots here scale it into L1 a chunk at a time and dot
// the chunk with every vector of the unit (a row read once for all of them), lowbit_dot_int8.h meets it
// with int8 activations in registers. Layouts (bytes per block of weights; fp16 scales little-endian):
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

// the vector forms: AVX2 with FMA (otherwise the plain statement, int8_block_plain)
#if defined(__AVX2__) && defined(__FMA__)
#define LOWBIT_SIMD 1
#else
#define LOWBIT_SIMD 0
#endif
#define LOWBIT_CHUNK 256  // weights decoded at a time (a K-quant super-block; eight 32-weight blocks)

static const int8_t IQ4_NL_KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline int lowbit_codec(int codec) { return codec >= FT_CODEC_Q4_0 && codec <= FT_CODEC_Q5_1; }

// The low-bit codecs of 32-weight blocks (the rest are super-blocks of 256).
static inline int lowbit_legacy(int codec) {
    return codec == FT_CODEC_Q4_0 || codec == FT_CODEC_IQ4_NL || codec == FT_CODEC_Q4_1 || codec == FT_CODEC_Q5_0 ||
           codec == FT_CODEC_Q5_1;
}

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if LOWBIT_SIMD
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

// 32 int8 weights negated where bit j of `signs` is set (lane j).
static inline __m256i signed32(__m256i q, uint32_t signs) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)signs),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);  // 0xFF where negated
    return _mm256_sub_epi8(_mm256_xor_si256(q, neg), neg);
}

// The four ksigns bytes of a word of four 7-bit sign indices (IQ2_XXS, IQ3_XXS), as one 32-bit mask.
static inline uint32_t ksigns4(uint32_t aux) {
    return KSIGNS[aux & 127] | KSIGNS[(aux >> 7) & 127] << 8 | KSIGNS[(aux >> 14) & 127] << 16 |
           (uint32_t)KSIGNS[(aux >> 21) & 127] << 24;
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
        case FT_CODEC_IQ2_XXS: {  // four 8-byte grid entries, four ksigns bytes
            const uint8_t *g = b + 2 + 8 * c;
            const __m256i grid = _mm256_setr_epi64x((long long)IQ2XXS_GRID[g[0]], (long long)IQ2XXS_GRID[g[1]],
                                                    (long long)IQ2XXS_GRID[g[2]], (long long)IQ2XXS_GRID[g[3]]);
            return signed32(grid, ksigns4(u32_at(b + 6 + 8 * c)));
        }
        case FT_CODEC_IQ2_XS: {  // four 16-bit words: 9-bit grid indices, 7-bit ksigns indices
            uint64_t w;
            memcpy(&w, b + 2 + 8 * c, sizeof w);
            const __m256i grid = _mm256_setr_epi64x(
                (long long)IQ2XS_GRID[w & 511], (long long)IQ2XS_GRID[(w >> 16) & 511],
                (long long)IQ2XS_GRID[(w >> 32) & 511], (long long)IQ2XS_GRID[(w >> 48) & 511]);
            const uint32_t signs = KSIGNS[(w >> 9) & 127] | KSIGNS[(w >> 25) & 127] << 8 |
                                   KSIGNS[(w >> 41) & 127] << 16 | (uint32_t)KSIGNS[w >> 57] << 24;
            return signed32(grid, signs);
        }
        case FT_CODEC_IQ3_XXS: {  // eight 4-byte grid entries
            const uint8_t *g = b + 2 + 8 * c;
            const __m256i grid = _mm256_setr_epi32(
                (int)IQ3XXS_GRID[g[0]], (int)IQ3XXS_GRID[g[1]], (int)IQ3XXS_GRID[g[2]], (int)IQ3XXS_GRID[g[3]],
                (int)IQ3XXS_GRID[g[4]], (int)IQ3XXS_GRID[g[5]], (int)IQ3XXS_GRID[g[6]], (int)IQ3XXS_GRID[g[7]]);
            return signed32(grid, ksigns4(u32_at(b + 66 + 4 * c)));
        }
        default: {  // IQ3_S: eight 9-bit indices (qs bytes 8c.., the ninth bits qh[c]'s), 32 sign bits
            const __m256i ninth = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(b[66 + c]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                _mm256_set1_epi32(1));
            const __m256i index = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * c))),
                                                  _mm256_slli_epi32(ninth, 8));
            return signed32(_mm256_i32gather_epi32((const int *)IQ3S_GRID, index, 4), u32_at(b + 74 + 4 * c));
        }
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

#endif

// The codes of a 16-weight group's sign byte pair as int8 multipliers: bit j of `signs` set -> −1.
static inline void signed_grid8(uint64_t grid, uint8_t signs, int8_t *restrict q) {
    for (int j = 0; j < 8; j++) {
        const int v = (int)((grid >> (8 * j)) & 255);
        q[j] = (int8_t)((signs >> j) & 1 ? -v : v);
    }
}

// A block's scales and mins per 16 weights (w = sc·q − mn), from its header: a legacy block's two
// halves share its d (and −m for Q4_1, Q5_1); a super-block's per type.
static inline __attribute__((always_inline)) void lowbit_scales(int codec, const uint8_t *restrict b, float *restrict sc, float *restrict mn) {
    if (lowbit_legacy(codec)) {
        sc[0] = sc[1] = fp16_at(b);
        mn[0] = mn[1] = codec == FT_CODEC_Q4_1 || codec == FT_CODEC_Q5_1 ? -fp16_at(b + 2) : 0.0f;
        return;
    }
    const float d = fp16_at(b);
    uint64_t nibbles = 0;  // IQ2_XS's sixteen 4-bit scales, scale s at bit 4s (read as one word, not bytewise)
    if (codec == FT_CODEC_IQ2_XS) memcpy(&nibbles, b + 66, sizeof nibbles);
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
            case FT_CODEC_IQ2_XS: sc[s] = d * (0.5f + (float)((nibbles >> (4 * s)) & 15)) * 0.25f; break;
            case FT_CODEC_IQ3_XXS: sc[s] = d * (0.5f + (float)(u32_at(b + 66 + 4 * (s / 2)) >> 28)) * 0.5f; break;
            default: sc[s] = d * (float)(1 + 2 * ((b[106 + s / 4] >> (4 * ((s / 2) % 2))) & 15)); break;
        }
    }
}

// One block of `codec` (a lowbit_codec) as int8 q [block elements] with lowbit_scales' scales and mins:
// the plain statement (and the build's way without AVX2).
static inline void int8_block_plain(int codec, const uint8_t *restrict b, int8_t *restrict q, float *restrict sc,
                                    float *restrict mn) {
    lowbit_scales(codec, b, sc, mn);
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
            return;
        }
        case FT_CODEC_Q2_K:
            for (int sub = 0; sub < 16; sub++) {
                const int g = sub / 8, s = (sub / 2) % 4, half = sub % 2;
                const uint8_t *qs = b + 16 + 32 * g + 16 * half;
                for (int l = 0; l < 16; l++) q[16 * sub + l] = (int8_t)((qs[l] >> (2 * s)) & 3);
            }
            return;
        case FT_CODEC_Q3_K: {
            const uint8_t *hmask = b, *qs = b + 32;
            for (int e = 0; e < 256; e++) {
                const int v = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
                q[e] = (int8_t)(v - ((hmask[e % 32] >> (e / 32)) & 1 ? 0 : 4));
            }
            return;
        }
        case FT_CODEC_IQ2_XXS:
            for (int ib = 0; ib < 8; ib++) {
                const uint32_t idx = u32_at(b + 2 + 8 * ib), aux = u32_at(b + 6 + 8 * ib);
                for (int l = 0; l < 4; l++)
                    signed_grid8(IQ2XXS_GRID[(idx >> (8 * l)) & 255], KSIGNS[(aux >> (7 * l)) & 127], q + 32 * ib + 8 * l);
            }
            return;
        case FT_CODEC_IQ2_XS:
            for (int i = 0; i < 32; i++) {
                const int v = b[2 + 2 * i] | (b[3 + 2 * i] << 8);
                signed_grid8(IQ2XS_GRID[v & 511], KSIGNS[v >> 9], q + 8 * i);
            }
            return;
        case FT_CODEC_IQ3_XXS:
            for (int ib = 0; ib < 8; ib++) {
                const uint32_t aux = u32_at(b + 66 + 4 * ib);
                for (int l = 0; l < 4; l++) {
                    const uint8_t *g = b + 2 + 8 * ib + 2 * l;
                    const uint64_t grid = IQ3XXS_GRID[g[0]] | ((uint64_t)IQ3XXS_GRID[g[1]] << 32);
                    signed_grid8(grid, KSIGNS[(aux >> (7 * l)) & 127], q + 32 * ib + 8 * l);
                }
            }
            return;
        default: {  // IQ3_S
            const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74;
            for (int g = 0; g < 32; g++) {
                const int i0 = 2 * g, i1 = 2 * g + 1;
                const uint64_t grid = IQ3S_GRID[qs[i0] | (((qh[i0 / 8] >> (i0 % 8)) & 1) << 8)] |
                                      ((uint64_t)IQ3S_GRID[qs[i1] | (((qh[i1 / 8] >> (i1 % 8)) & 1) << 8)] << 32);
                signed_grid8(grid, signs[g], q + 8 * g);
            }
            return;
        }
    }
}

// Weights [k0, k0 + count) of a row (k0 and count whole blocks) decoded to fp32 into y: each block's int8
// values scaled per 16.
static inline __attribute__((always_inline)) void decode_lowbit_of(int codec, const uint8_t *restrict row, int k0,
                                                                   int count, float *restrict y) {
    int elements, bytes;
    codec_block(codec, &elements, &bytes);
    const uint8_t *b = row + (long)(k0 / elements) * bytes;  // one division a call, none a block
    float sc[16], mn[16];
    for (int k = 0; k < count; k += elements, b += bytes) {
        float *out = y + k;
#if LOWBIT_SIMD
        if (elements == 32) {
            const __m256i q = legacy32(codec, b);
            lowbit_scales(codec, b, sc, mn);
            put16(_mm256_castsi256_si128(q), sc[0], mn[0], out);
            put16(_mm256_extracti128_si256(q, 1), sc[1], mn[1], out + 16);
            continue;
        }
        lowbit_scales(codec, b, sc, mn);
        for (int c = 0; c < 8; c++) {
            const __m256i q = super32(codec, b, c);
            put16(_mm256_castsi256_si128(q), sc[2 * c], mn[2 * c], out + 32 * c);
            put16(_mm256_extracti128_si256(q, 1), sc[2 * c + 1], mn[2 * c + 1], out + 32 * c + 16);
        }
#else
        int8_t q[256];
        int8_block_plain(codec, b, q, sc, mn);
        for (int e = 0; e < elements; e++) out[e] = sc[e / 16] * (float)q[e] - mn[e / 16];
#endif
    }
}

// A switch over the low-bit codecs (lowbit_codec) that runs CALL(C) with the codec a constant C in each
// branch, so each type's decoding is specialised outside the loops (IQ3_S the default), then returns.
#define FT_LOWBIT_SWITCH(codec, CALL)                  \
    switch (codec) {                                   \
        case FT_CODEC_Q4_0: CALL(FT_CODEC_Q4_0); return;       \
        case FT_CODEC_Q4_1: CALL(FT_CODEC_Q4_1); return;       \
        case FT_CODEC_Q5_0: CALL(FT_CODEC_Q5_0); return;       \
        case FT_CODEC_Q5_1: CALL(FT_CODEC_Q5_1); return;       \
        case FT_CODEC_IQ4_NL: CALL(FT_CODEC_IQ4_NL); return;   \
        case FT_CODEC_Q2_K: CALL(FT_CODEC_Q2_K); return;       \
        case FT_CODEC_Q3_K: CALL(FT_CODEC_Q3_K); return;       \
        case FT_CODEC_IQ2_XXS: CALL(FT_CODEC_IQ2_XXS); return; \
        case FT_CODEC_IQ2_XS: CALL(FT_CODEC_IQ2_XS); return;   \
        case FT_CODEC_IQ3_XXS: CALL(FT_CODEC_IQ3_XXS); return; \
        default: CALL(FT_CODEC_IQ3_S); return;                 \
    }

static inline void decode_lowbit(int codec, const uint8_t *restrict row, int k0, int count, float *restrict y) {
#define FT_DECODE(C) decode_lowbit_of(C, row, k0, count, y)
    FT_LOWBIT_SWITCH(codec, FT_DECODE)
#undef FT_DECODE
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
