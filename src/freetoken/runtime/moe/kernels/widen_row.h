// Rows of a weight-only codec widened for several dots with the same row (the CPU expert kernel's prompt
// path, experts_cpu.c): to fp32 (dequant_row), or, where the CPU has AVX512-BF16, to bf16 — straight for
// Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, IQ4_XS and the low-bit types (tables of a block's possible values gathered
// by permutes, or sixteen weights at a time), bit for bit what dequantising to fp32 and rounding gives (widen_bf16;
// tests/runtime/moe/test_cpu_widening.py checks it).
#ifndef FT_WIDEN_ROW_H
#define FT_WIDEN_ROW_H
#include <stdint.h>

#include "bf16_dot.h"
#include "kquant_dot.h"
#include "lowbit_dot.h"
#include "quant_dot.h"
#include "table_dot.h"

// A weight-only row widened to fp32 (for several dots with the same row).
static inline void dequant_row(int codec, const uint8_t *row, float *out, int n) {
    switch (codec) {
        case FT_CODEC_Q8_0: dequant_q8_0(row, out, n); return;
        case FT_CODEC_Q4_K: dequant_q4_k(row, out, n); return;
        case FT_CODEC_Q5_K: dequant_q5_k(row, out, n); return;
        case FT_CODEC_Q6_K: dequant_q6_k(row, out, n); return;
        case FT_CODEC_IQ4_XS: dequant_iq4_xs(row, out, n); return;
        case FT_CODEC_FP8: dequant_fp8(row, out, n); return;
        case FT_CODEC_NVFP4: dequant_nvfp4(row, out, n); return;
        case FT_CODEC_MXFP4: dequant_mxfp4(row, out, n); return;
        default: dequant_lowbit(codec, row, out, n); return;
    }
}

static inline int widened_codec(int codec) {
    return codec == FT_CODEC_Q8_0 || codec == FT_CODEC_Q4_K || codec == FT_CODEC_Q6_K || codec == FT_CODEC_Q5_K ||
           codec == FT_CODEC_IQ4_XS || codec == FT_CODEC_MXFP4 || codec == FT_CODEC_FP8 || codec == FT_CODEC_NVFP4 ||
           lowbit_codec(codec);
}

#if HAVE_KQUANT_BF16
// A Q4_K row rounded to bf16 (what dequant_q4_k then round_row_bf16 give, bit for bit), for a row dotted
// with several bf16 vectors: a sub-block's sixteen possible values computed once as a table, its quants'
// values gathered from it 32 at a time (one permute).
static inline void dequant_q4_k_bf16(const uint8_t *restrict w, uint16_t *restrict out, int n) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i low4 = _mm512_set1_epi16(15), upper = _mm512_set1_epi16(16);
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *qs = w + (long)b * Q4_K_BYTES + 16;
        uint16_t *y = out + (long)b * QK_K;
        float a[8], m[8];
        q4_k_affine(w + (long)b * Q4_K_BYTES, a, m);
        for (int j = 0; j < 4; j++) {  // table words 0-15: sub-block 2j's values, 16-31: 2j + 1's
            const __m512 lo = _mm512_fmsub_ps(_mm512_set1_ps(a[2 * j]), values, _mm512_set1_ps(m[2 * j]));
            const __m512 hi = _mm512_fmsub_ps(_mm512_set1_ps(a[2 * j + 1]), values, _mm512_set1_ps(m[2 * j + 1]));
            const __m512i table = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(lo)),
                                                     (__m256i)_mm512_cvtneps_pbh(hi), 1);
            const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
            _mm512_storeu_si512(y + 64 * j, _mm512_permutexvar_epi16(_mm512_and_si512(q, low4), table));
            _mm512_storeu_si512(y + 64 * j + 32,
                                _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(q, 4), upper), table));
        }
    }
}

// A Q8_0 row rounded to bf16 (what dequant_q8_0 then round_row_bf16 give, bit for bit), 16 at a time.
static inline void dequant_q8_0_bf16(const uint8_t *restrict w, uint16_t *restrict out, int n) {
    for (int b = 0; b < n / Q8_BLOCK; b++) {
        const uint8_t *wb = w + (long)b * Q8_0_BYTES;
        const __m512 d = _mm512_set1_ps(fp16_at(wb));
        for (int h = 0; h < 2; h++) {
            const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + 2 + 16 * h)));
            _mm256_storeu_si256((__m256i *)(out + 32L * b + 16 * h),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q))));
        }
    }
}

// A Q5_K row rounded to bf16 (as dequant_q5_k then round_row_bf16, bit for bit): a sub-block's 32
// possible values as a table, its quants (four bits and the fifth from qh) gathered by one permute.
static inline __m512i q5_k_table(float a, float m) {
    const __m512 k0 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 k1 = _mm512_add_ps(k0, _mm512_set1_ps(16.0f));
    const __m512 va = _mm512_set1_ps(a), vm = _mm512_set1_ps(m);
    return _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmsub_ps(va, k0, vm))),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_fmsub_ps(va, k1, vm)), 1);
}

static inline void dequant_q5_k_bf16(const uint8_t *restrict w, uint16_t *restrict out, int n) {
    const __m512i low4 = _mm512_set1_epi16(15), one = _mm512_set1_epi16(1);
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q5_K_BYTES, *qs = blk + 48;
        uint16_t *y = out + (long)b * QK_K;
        float a[8], m[8];
        q4_k_affine(blk, a, m);
        const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        for (int j = 0; j < 4; j++) {
            const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
            const __m512i lo = _mm512_or_si512(_mm512_and_si512(q, low4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * j), one), 4));
            const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(q, 4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * j + 1), one), 4));
            _mm512_storeu_si512(y + 64 * j, _mm512_permutexvar_epi16(lo, q5_k_table(a[2 * j], m[2 * j])));
            _mm512_storeu_si512(y + 64 * j + 32, _mm512_permutexvar_epi16(hi, q5_k_table(a[2 * j + 1], m[2 * j + 1])));
        }
    }
}

// A Q6_K row rounded to bf16 (what dequant_q6_k then round_row_bf16 give, bit for bit): sixteen weights of
// one scale at a time, their six bits assembled in 32-bit lanes.
static inline void dequant_q6_k_bf16(const uint8_t *restrict w, uint16_t *restrict out, int n) {
    const __m512i low4 = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3), offset = _mm512_set1_epi32(32);
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q6_K_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_at(blk + 208);
        for (int half = 0; half < 2; half++)
            for (int l0 = 0; l0 < 32; l0 += 16) {
                const uint8_t *ql = blk + 64 * half + l0, *qh = blk + 128 + 32 * half + l0;
                const int8_t *s = sc + 8 * half + l0 / 16;
                uint16_t *y = out + (long)b * QK_K + 128 * half + l0;
                const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ql));
                const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 32)));
                const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
                const __m512i q[4] = {
                    _mm512_or_si512(_mm512_and_si512(a, low4), _mm512_slli_epi32(_mm512_and_si512(h, two), 4)),
                    _mm512_or_si512(_mm512_and_si512(c, low4),
                                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2), two), 4)),
                    _mm512_or_si512(_mm512_srli_epi32(a, 4),
                                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 4), two), 4)),
                    _mm512_or_si512(_mm512_srli_epi32(c, 4), _mm512_slli_epi32(_mm512_srli_epi32(h, 6), 4)),
                };
                for (int g = 0; g < 4; g++) {
                    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(q[g], offset));
                    _mm256_storeu_si256((__m256i *)(y + 32 * g),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_set1_ps(d * s[2 * g]), v)));
                }
            }
    }
}

// An MXFP4 row rounded to bf16 (what dequant_mxfp4 then round_row_bf16 give, bit for bit): a block's
// sixteen values (its scale times the codebook) computed once, its 32 quants gathered by two permutes. A
// block whose scale is below 2^-126 (e8m0 0 or 1) has subnormal values, which the conversion instruction
// flushes to zero: those go one at a time.
static inline void dequant_mxfp4_bf16(const uint8_t *restrict w, uint16_t *restrict out, int n) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i low4 = _mm256_set1_epi16(15);
    for (int b = 0; b < n / 32; b++) {
        const uint8_t *blk = w + (long)b * MXFP4_BYTES;
        if (blk[0] < 2) {
            float block[32];
            dequant_mxfp4(blk, block, 32);
            round_row_bf16(block, out + 32L * b, 32);
            continue;
        }
        const __m256i table = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_set1_ps(e8m0_half(blk[0])), values));
        const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 1)));
        _mm256_storeu_si256((__m256i *)(out + 32L * b), _mm256_permutexvar_epi16(_mm256_and_si256(q, low4), table));
        _mm256_storeu_si256((__m256i *)(out + 32L * b + 16), _mm256_permutexvar_epi16(_mm256_srli_epi16(q, 4), table));
    }
}

// An IQ4_XS row rounded to bf16 (what dequant_iq4_xs then round_row_bf16 give, bit for bit): a sub-block's
// sixteen values (d · scale times the codebook) computed once, its 32 quants gathered by two permutes.
static inline void dequant_iq4_xs_bf16(const uint8_t *restrict w, uint16_t *restrict out, int n) {
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES)));
    const __m256i low4 = _mm256_set1_epi16(15);
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * IQ4_XS_BYTES, *qs = blk + 8;
        const float d = fp16_at(blk);
        for (int s = 0; s < 8; s++) {
            const float dl = d * (float)iq4_xs_scale(blk, s);
            const __m256i table = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_set1_ps(dl), values));
            const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16 * s)));
            uint16_t *y = out + (long)b * QK_K + 32 * s;
            _mm256_storeu_si256((__m256i *)y, _mm256_permutexvar_epi16(_mm256_and_si256(q, low4), table));
            _mm256_storeu_si256((__m256i *)(y + 16), _mm256_permutexvar_epi16(_mm256_srli_epi16(q, 4), table));
        }
    }
}

#if LOWBIT_SIMD
// A low-bit row (lowbit_codec) rounded to bf16, bit for bit: each 32 weights' int8 decoding scaled per 16
// (sc · q − mn in one rounding, as decode_lowbit_of's) and converted sixteen at a time.
static inline __attribute__((always_inline)) void dequant_lowbit_bf16_of(int codec, const uint8_t *restrict row,
                                                                         uint16_t *restrict out, int n) {
    int elements, bytes;
    codec_block(codec, &elements, &bytes);
    float sc[16], mn[16];
    for (int k = 0; k < n; k += elements, row += bytes) {
        lowbit_scales(codec, row, sc, mn);
        for (int c = 0; c < elements / 32; c++) {
            const __m256i q = elements == 32 ? legacy32(codec, row) : super32(codec, row, c);
            for (int h = 0; h < 2; h++) {
                const __m128i half = h ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
                const __m512 w = _mm512_fmsub_ps(_mm512_set1_ps(sc[2 * c + h]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half)),
                                                 _mm512_set1_ps(mn[2 * c + h]));
                _mm256_storeu_si256((__m256i *)(out + k + 32 * c + 16 * h), (__m256i)_mm512_cvtneps_pbh(w));
            }
        }
    }
}

static inline void dequant_lowbit_bf16(int codec, const uint8_t *restrict row, uint16_t *restrict out, int n) {
#define FT_WIDEN(C) dequant_lowbit_bf16_of(C, row, out, n)
    FT_LOWBIT_SWITCH(codec, FT_WIDEN)
#undef FT_WIDEN
}
#endif

// A widened codec's row rounded to bf16 into rowbuf16: straight where the codec has its own widening (bit
// for bit the plain way), else dequantised into rowbuf and rounded. Returns 1 for the straight way.
static inline int widen_bf16(int codec, const uint8_t *row, float *rowbuf, uint16_t *rowbuf16, int n, int plain) {
    if (!plain && codec == FT_CODEC_Q4_K) dequant_q4_k_bf16(row, rowbuf16, n);
    else if (!plain && codec == FT_CODEC_Q5_K) dequant_q5_k_bf16(row, rowbuf16, n);
    else if (!plain && codec == FT_CODEC_Q6_K) dequant_q6_k_bf16(row, rowbuf16, n);
    else if (!plain && codec == FT_CODEC_Q8_0) dequant_q8_0_bf16(row, rowbuf16, n);
    else if (!plain && codec == FT_CODEC_MXFP4) dequant_mxfp4_bf16(row, rowbuf16, n);
    else if (!plain && codec == FT_CODEC_IQ4_XS) dequant_iq4_xs_bf16(row, rowbuf16, n);
#if LOWBIT_SIMD
    else if (!plain && lowbit_codec(codec)) dequant_lowbit_bf16(codec, row, rowbuf16, n);
#endif
    else {
        dequant_row(codec, row, rowbuf, n);
        round_row_bf16(rowbuf, rowbuf16, n);
        return 0;
    }
    return 1;
}
#endif

#endif
