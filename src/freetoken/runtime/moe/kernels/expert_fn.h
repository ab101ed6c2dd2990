// What an expert computes between its projections (runtime/moe/expert_fn.py, the same kinds by number):
//   FT_ACT_SILU          a = silu(g) · u
//   FT_ACT_CLAMPED       a = g' · σ(α · g') · (u' + 1)    (gpt-oss)
//   FT_ACT_CLAMPED_SILU  a = silu(g') · u'                (DeepSeek-V4)
// with g, u the gate and up rows' dots plus, where the experts have one, their bias, and in the clamped
// kinds g' = min(g, limit), u' = clamp(u, −limit, limit).
#ifndef FT_EXPERT_FN_H
#define FT_EXPERT_FN_H

#include <math.h>

enum { FT_ACT_SILU = 0, FT_ACT_CLAMPED = 1, FT_ACT_CLAMPED_SILU = 2 };

typedef struct {
    int kind;
    float alpha, limit;
    const float *gate_up_bias;  // [bank experts, 2I] fp32 (gate half first), or NULL
} ft_expert_fn;

// g, u: expert e's gate and up dots of row i; a NULL fn is plain SiLU without biases.
static inline float expert_glu(const ft_expert_fn *fn, long e, int inter, int i, float g, float u) {
    if (!fn) return g / (1.0f + expf(-g)) * u;
    if (fn->gate_up_bias) {
        const float *b = fn->gate_up_bias + e * 2L * inter;
        g += b[i], u += b[inter + i];
    }
    if (fn->kind == FT_ACT_SILU) return g / (1.0f + expf(-g)) * u;
    g = fminf(g, fn->limit);
    u = fminf(fmaxf(u, -fn->limit), fn->limit);
    if (fn->kind == FT_ACT_CLAMPED_SILU) return g / (1.0f + expf(-g)) * u;
    return g / (1.0f + expf(-fn->alpha * g)) * (u + 1.0f);
}

#endif
