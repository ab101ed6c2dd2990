// Weight-only Q6_K rows against activations that are bf16 values (a bf16 model's), with the bf16 pair-dot
// instruction, as dot_q45_k_bf16 does for Q4_K / Q5_K: a 6-bit quant less 32 (-32..31, exact in bf16)
// becomes bf16 by a two-register table lookup, 32 at a time, and meets 32 activations in one
// instruction; each pair's lanes are scaled by their sub-block's d · scale. The products are exact, as
// in dot_q6_k; only the order of the fp32 sums differs. Layout: kquant_dot.h.
#ifndef FT_KQUANT_BF16_DOT_H
#define FT_KQUANT_BF16_DOT_H
#include "kquant_dot.h"

#if HAVE_KQUANT_BF16
// The bf16 bits of q − 32 for q in 0..63: [q] of Q6_K_BF16_LOW for q < 32, [q − 32] of Q6_K_BF16_HIGH.
static const uint16_t Q6_K_BF16_LOW[32] = {
    0xc200, 0xc1f8, 0xc1f0, 0xc1e8, 0xc1e0, 0xc1d8, 0xc1d0, 0xc1c8, 0xc1c0, 0xc1b8, 0xc1b0,
    0xc1a8, 0xc1a0, 0xc198, 0xc190, 0xc188, 0xc180, 0xc170, 0xc160, 0xc150, 0xc140, 0xc130,
    0xc120, 0xc110, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
};
static const uint16_t Q6_K_BF16_HIGH[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4188, 0x4190, 0x4198, 0x41a0, 0x41a8,
    0x41b0, 0x41b8, 0x41c0, 0x41c8, 0x41d0, 0x41d8, 0x41e0, 0x41e8, 0x41f0, 0x41f8,
};

static inline float dot_q6_k_bf16(const uint8_t *restrict w, const uint16_t *restrict xb, int n) {
    const __m512i low = _mm512_loadu_si512((const void *)Q6_K_BF16_LOW);
    const __m512i high = _mm512_loadu_si512((const void *)Q6_K_BF16_HIGH);
    const __m512i m4 = _mm512_set1_epi16(15), m2 = _mm512_set1_epi16(3);
    __m512i pick[8];  // quant group g (32 weights, sub-blocks 2g and 2g + 1): its two scales over the lanes
    for (int g = 0; g < 8; g++)
        pick[g] = _mm512_set_epi32(2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                   2 * g + 1, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q6_K_BYTES;
        const __m512 ds = _mm512_mul_ps(  // d · scale of the 16 sub-blocks of 16
            _mm512_set1_ps(fp16_at(blk + 208)),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
        for (int half = 0; half < 2; half++) {  // 128 weights: ql 64 bytes, qh 32 bytes
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const uint16_t *xk = xb + (long)b * QK_K + 128 * half;
            const __m512i lo = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)ql));
            const __m512i hi = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 32)));
            const __m512i top = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)qh));
            const __m512i q[4] = {  // weights 0-31, 32-63, 64-95, 96-127 of the half
                _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_slli_epi16(_mm512_and_si512(top, m2), 4)),
                _mm512_or_si512(_mm512_and_si512(hi, m4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 2), m2), 4)),
                _mm512_or_si512(_mm512_srli_epi16(lo, 4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 4), m2), 4)),
                _mm512_or_si512(_mm512_srli_epi16(hi, 4), _mm512_slli_epi16(_mm512_srli_epi16(top, 6), 4)),
            };
            for (int j = 0; j < 4; j++) {
                const __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(),
                                                  (__m512bh)_mm512_permutex2var_epi16(low, q[j], high), load_bh(xk + 32 * j));
                const __m512 scale = _mm512_permutexvar_ps(pick[4 * half + j], ds);
                if (j & 1)
                    acc1 = _mm512_fmadd_ps(scale, p, acc1);
                else
                    acc0 = _mm512_fmadd_ps(scale, p, acc0);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif
#endif
