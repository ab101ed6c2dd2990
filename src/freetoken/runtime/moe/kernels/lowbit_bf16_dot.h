// lowbit_dot.h's types against activations that are bf16 values (a bf16 model's), with the bf16 pair-dot
// instruction: each 32 weights' int8 decoding (legacy32 / super32, the one decoding per type) becomes 32
// bf16 in registers (int8 values are exact in bf16) and meets 32 activations in one instruction, scaled
// per 16 (Σ (sc·q − mn)·x = sc · Σ q·x − mn · Σ x over each 16, Σ x by the same instruction against
// ones). Where the fp32 path decodes a chunk into L1 and reads it back, this one keeps the weights in
// registers. The products are exact either way; only the order of the fp32 sums differs.
#ifndef FT_LOWBIT_BF16_DOT_H
#define FT_LOWBIT_BF16_DOT_H
#include <stdint.h>

#include "bf16_dot.h"
#include "kquant_dot.h"
#include "lowbit_dot.h"

#if HAVE_KQUANT_BF16 && LOWBIT_SIMD
#define HAVE_LOWBIT_BF16 1
#define LOWBIT_BF16_VECTORS 2  // vectors one call meets (more are dotted as the fp32 path's widened rows)

// 32 int8 weights as 32 bf16, in order.
static inline __m512bh int8_bf16(__m256i q) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline __attribute__((always_inline)) void dots_lowbit_bf16_of(int codec, const uint8_t *restrict row,
                                                                      const uint16_t *const *kb, int cnt, int n,
                                                                      float *out) {
    const int has_min = codec == FT_CODEC_Q2_K || codec == FT_CODEC_Q4_1 || codec == FT_CODEC_Q5_1;
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    int elements, bytes;
    codec_block(codec, &elements, &bytes);
    __m512 acc[LOWBIT_BF16_VECTORS] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    float sc[16], mn[16];
    for (int k = 0; k < n; k += elements, row += bytes) {
        lowbit_scales(codec, row, sc, mn);
        // a legacy block's one scale and min (sc[0] = sc[1]) broadcast; a super-block's sixteen read as one
        // vector (sixteen stores, then a load that waits for them: worth it for 256 weights, not for 32)
        const __m512 scales = elements == 32 ? _mm512_set1_ps(sc[0]) : _mm512_loadu_ps(sc);
        const __m512 mins = !has_min ? _mm512_setzero_ps() : elements == 32 ? _mm512_set1_ps(mn[0]) : _mm512_loadu_ps(mn);
        for (int c = 0; c < elements / 32; c++) {
            const __m512bh q = int8_bf16(elements == 32 ? legacy32(codec, row) : super32(codec, row, c));
            const __m512i pick = _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32(2 * c),
                                                         _mm512_set1_epi32(2 * c + 1));  // scale 2c, then 2c + 1
            const __m512 scale = elements == 32 ? scales : _mm512_permutexvar_ps(pick, scales);
            const __m512 min = elements == 32 ? mins : _mm512_permutexvar_ps(pick, mins);
            for (int j = 0; j < cnt; j++) {
                const __m512bh x = load_bh(kb[j] + k + 32 * c);
                acc[j] = _mm512_fmadd_ps(scale, _mm512_dpbf16_ps(_mm512_setzero_ps(), q, x), acc[j]);
                if (has_min) acc[j] = _mm512_fnmadd_ps(min, _mm512_dpbf16_ps(_mm512_setzero_ps(), ones, x), acc[j]);
            }
        }
    }
    for (int j = 0; j < cnt; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}

// out[j] = row · kb[j] for cnt ≤ LOWBIT_BF16_VECTORS bf16 vectors.
static inline void dots_lowbit_bf16(int codec, const uint8_t *restrict row, const uint16_t *const *kb, int cnt,
                                    int n, float *out) {
#define FT_DOTS_BF16(C) dots_lowbit_bf16_of(C, row, kb, cnt, n, out)
    FT_LOWBIT_SWITCH(codec, FT_DOTS_BF16)
#undef FT_DOTS_BF16
}
#else
#define HAVE_LOWBIT_BF16 0
#endif

#endif
