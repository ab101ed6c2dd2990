// One row of any codec against a unit's vectors (experts_cpu.c's G and D units): the dispatch over the
// codecs' dots, and two rows at once where their dots interleave.
#ifndef FT_ROW_DOTS_H
#define FT_ROW_DOTS_H
#include <stdint.h>

#include "bf16_dot.h"
#include "kquant_bf16_dot.h"
#include "kquant_dot.h"
#include "kquant_dot_int8.h"
#include "lowbit_bf16_dot.h"
#include "lowbit_dot.h"
#include "lowbit_dot_int8.h"
#include "quant_dot.h"
#include "table_dot.h"
#include "widen_row.h"

// Pairs of one expert that a unit takes through its rows at a time: each row is read from L1 once per
// four of them, and the unit's rows once per group (from L2 after the first group).
#ifndef GROUP
#define GROUP 16
#endif

// One G or D unit's dots: out[j] = row . vector j for `cnt` vectors, in the row's codec (bf16 against
// split fp32 vectors, f32, Q4_K, Q6_K and Q8_0 against fp32 vectors, Q8_0_ACT8 against int8 blocks).
typedef struct {
    const float *f[GROUP];
    const uint16_t *b[GROUP];  // bf16 vectors in natural order (FT_CODEC_BF16_ACT16)
    const int8_t *q[GROUP];
    const float *d[GROUP];
    const int16_t *s[GROUP];  // int8 values' sums per 16
    const float *fs[GROUP];   // fp32 values' sums per 32 (Q4_K's and Q5_K's mins, weight-only)
    const uint16_t *kb[GROUP];  // x as bf16 where every value is one (the bf16 pair-dot paths), or NULL
} vecs_t;

// Pairs from which a quantized row is widened to fp32 once for all of them rather than per dot.
#ifndef WIDEN_PAIRS
#define WIDEN_PAIRS 3
#endif

// out[j] = w . v[j] for `count` fp32 vectors, four at a time (w read once per four).
static inline void dots_f32(const float *restrict w, const float *const *v, int count, int n, float *out) {
    int j = 0;
    for (; j + 4 <= count; j += 4) {
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int k = 0;
        for (; k + 8 <= n; k += 8) {
            const v8f x = load8f(w + k);
            a0 += x * load8f(v[j] + k), a1 += x * load8f(v[j + 1] + k);
            a2 += x * load8f(v[j + 2] + k), a3 += x * load8f(v[j + 3] + k);
        }
        float s[4] = {sum8(a0), sum8(a1), sum8(a2), sum8(a3)};
        for (; k < n; k++)
            for (int r = 0; r < 4; r++) s[r] += w[k] * v[j + r][k];
        for (int r = 0; r < 4; r++) out[j + r] = s[r];
    }
    for (; j < count; j++) {
        v8f a = {0};
        int k = 0;
        for (; k + 8 <= n; k += 8) a += load8f(w + k) * load8f(v[j] + k);
        float s = sum8(a);
        for (; k < n; k++) s += w[k] * v[j][k];
        out[j] = s;
    }
}

// Whether every one of the cnt vectors has its bf16 form (activations that are bf16 values).
static inline int all_bf16(const vecs_t *v, int cnt) {
    for (int j = 0; j < cnt; j++)
        if (!v->kb[j]) return 0;
    return 1;
}

// out[j] for j < cnt: the bf16 pair-dot expression where vector j has its bf16 form (v->kb[j]) and the
// build has those dots, else the fp32 one (both expressions in j).
#if HAVE_KQUANT_BF16
#define WIDENED_DOTS(bf16_dot, f32_dot) \
    for (int j = 0; j < cnt; j++) out[j] = v->kb[j] ? (bf16_dot) : (f32_dot)
#else
#define WIDENED_DOTS(bf16_dot, f32_dot) for (int j = 0; j < cnt; j++) out[j] = (f32_dot)
#endif

// rowbuf: n floats of the calling thread's, for a widened row; rowbuf16: n bf16 of its own.
static inline void dots(int codec, const uint8_t *row, const vecs_t *v, int cnt, int n, float *out,
                        float *rowbuf, uint16_t *rowbuf16) {
    const int widen = cnt >= WIDEN_PAIRS;
    if (widen && widened_codec(codec)) {
#if HAVE_KQUANT_BF16
        if (all_bf16(v, cnt)) {  // a bf16 model's prompt: the row rounded to bf16, as torch dequantises
            widen_bf16(codec, row, rowbuf, rowbuf16, n, 0);  // into the model's dtype, then pair-dots
            dots_bf16_bf16(rowbuf16, v->kb, cnt, n, out);
            return;
        }
#endif
        dequant_row(codec, row, rowbuf, n);
        (void)rowbuf16;
        dots_f32(rowbuf, v->f, cnt, n, out);
    } else if (codec == FT_CODEC_Q5_K_ACT8)
        for (int j = 0; j < cnt; j++) out[j] = dot_q45_k_q8(row, 1, v->q[j], v->d[j], v->s[j], n);
    else if (codec == FT_CODEC_IQ4_XS_ACT8)
        for (int j = 0; j < cnt; j++) out[j] = dot_iq4_xs_q8(row, v->q[j], v->d[j], n);
    else if (codec == FT_CODEC_MXFP4_ACT8)
        for (int j = 0; j < cnt; j++) out[j] = dot_mxfp4_q8(row, v->q[j], v->d[j], n);
    else if (codec == FT_CODEC_Q8_0_ACT8)
        dots_q8_0(row, v->q, v->d, cnt, n, out);
    else if (codec == FT_CODEC_Q4_K_ACT8)
        for (int j = 0; j < cnt; j++) out[j] = dot_q45_k_q8(row, 0, v->q[j], v->d[j], v->s[j], n);
    else if (codec == FT_CODEC_Q6_K_ACT8)
        for (int j = 0; j < cnt; j++) out[j] = dot_q6_k_q8(row, v->q[j], v->d[j], v->s[j], n);
    else if (codec == FT_CODEC_Q8_0)
        for (int j = 0; j < cnt; j++) out[j] = dot_q8_0_f32(row, v->f[j], n);
    else if (codec == FT_CODEC_Q4_K || codec == FT_CODEC_Q5_K)
        WIDENED_DOTS(dot_q45_k_bf16(row, codec == FT_CODEC_Q5_K, v->kb[j], v->fs[j], n),
                     dot_q45_k(row, codec == FT_CODEC_Q5_K, v->f[j], v->fs[j], n));
    else if (codec == FT_CODEC_Q6_K)
        WIDENED_DOTS(dot_q6_k_bf16(row, v->kb[j], n), dot_q6_k(row, v->f[j], n));
    else if (codec == FT_CODEC_IQ4_XS)
        WIDENED_DOTS(dot_iq4_xs_bf16(row, v->kb[j], n), dot_iq4_xs(row, v->f[j], n));
    else if (codec == FT_CODEC_MXFP4)
        WIDENED_DOTS(dot_mxfp4_bf16(row, v->kb[j], n), dot_mxfp4(row, v->f[j], n));
    else if (codec == FT_CODEC_FP8)
        for (int j = 0; j < cnt; j++) out[j] = dot_fp8(row, v->f[j], n);
    else if (codec == FT_CODEC_NVFP4)
        for (int j = 0; j < cnt; j++) out[j] = dot_nvfp4(row, v->f[j], n);
    else if (lowbit_codec(codec)) {
#if HAVE_LOWBIT_BF16
        if (cnt <= LOWBIT_BF16_VECTORS && all_bf16(v, cnt)) {
            dots_lowbit_bf16(codec, row, v->kb, cnt, n, out);
            return;
        }
#endif
        dots_lowbit(codec, row, v->f, cnt, n, out);
    }
    else if (lowbit_act8(codec))
        dots_lowbit_q8(codec, row, v->q, v->d, v->s, cnt, n, out);
    else if (codec == FT_CODEC_F32)
        dots_f32((const float *)row, v->f, cnt, n, out);
    else if (codec == FT_CODEC_BF16_ACT16)
        dots_bf16_bf16((const uint16_t *)row, v->b, cnt, n, out);
    else
        dots_bf16((const uint16_t *)row, v->f, cnt, n, out);
}

#ifndef PAIRED_ROWS
#define PAIRED_ROWS 1  // 0: Q4_K / Q5_K rows against int8 activations one at a time (for the sweep's A/B)
#endif

// Whether dots2 reads two rows of `codec` together (dot2_q45_k_q8) for cnt vectors.
static inline int paired_rows(int codec, int cnt) {
    const int kq = codec == FT_CODEC_Q4_K_ACT8 || codec == FT_CODEC_Q5_K_ACT8;
    return PAIRED_ROWS && kq && !(cnt >= WIDEN_PAIRS && widened_codec(codec));
}

// Two rows' dots into out0 / out1, the bits two dots() calls give: where paired_rows, the rows' super-blocks
// interleaved (two streams and two chains of sums a thread), else one row after the other.
static inline void dots2(int codec, const uint8_t *row0, const uint8_t *row1, const vecs_t *v, int cnt, int n,
                         float *out0, float *out1, float *rowbuf, uint16_t *rowbuf16) {
    if (paired_rows(codec, cnt)) {
        const int high = codec == FT_CODEC_Q5_K_ACT8;
        for (int j = 0; j < cnt; j++) dot2_q45_k_q8(row0, row1, high, v->q[j], v->d[j], v->s[j], n, out0 + j, out1 + j);
        return;
    }
    dots(codec, row0, v, cnt, n, out0, rowbuf, rowbuf16);
    dots(codec, row1, v, cnt, n, out1, rowbuf, rowbuf16);
}

#endif
