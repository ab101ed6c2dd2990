// A gated DeltaNet layer's decode step on the CPU, two native calls over the per-slot state blocks
// (models/kernels/delta_step.py has the Triton kernels and the torch references these agree with):
//
// ft_conv_step: each live row's new input x [C] against the last W-1 inputs its slot keeps,
//   out = round(silu(round(Σ_w window[c, w] · weight[c, w]))), the slot's window shifted by one; x, the
//   state and out in `elem` bytes (bf16 2, fp32 4), the weight in `welem`; rounding to the weight's type
//   as the reference's convolution does, then to out's.
// ft_delta_step: per live row and value head h (key head h / (Hv / Hk)), in fp32:
//   q, k = l2norm(mixed's q, k of the key head) (eps 1e-6), q · Dk^-1/2; v = mixed's v of h
//   β = sigmoid(b[h]); decay = exp(−exp(a_log[h]) · softplus(a[h] + dt_bias[h]))
//   S ← decay · S;  S ← S + k ⊗ β·(v − Sᵀk);  o = Sᵀq        S = state[slot, h] [Dk, Dv] fp32
//   out[row, h] = round(o) in `elem` bytes.
//   With `log_decay` [B, Hv, Dk] fp32 (Kimi Delta Attention: Hk = Hv), key channel i decays by
//   exp(log_decay[row, h, i]) instead, and a, a_log, dt_bias go unread.
// Padding rows (slot < 0) read and write no state; their outputs are left as they were.
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16_dot.h"

#define MAX_DK 512
#define MAX_DV 512

int ft_conv_step(const void *x, long x_stride, int elem, void *state, const void *weight, int welem, int channels,
                 int width, const int32_t *slots, int rows, void *out, int threads) {
    if (width < 1 || channels < 1) return -1;
    const int keep = width - 1;
    for (int r = 0; r < rows; r++) {
        if (slots[r] < 0) continue;
        const long base = (long)slots[r] * channels * keep;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int c = 0; c < channels; c++) {
            const long s = base + (long)c * keep;
            const float now = load_elem(x, (long)r * x_stride + c, elem);
            float acc = 0.0f;
            for (int w = 0; w < keep; w++)
                acc += round_elem(load_elem(state, s + w, elem), welem) * load_elem(weight, (long)c * width + w, welem);
            acc += round_elem(now, welem) * load_elem(weight, (long)c * width + keep, welem);
            const float conv = round_elem(acc, welem);
            store_elem(out, (long)r * channels + c, conv / (1.0f + expf(-conv)), elem);
            for (int w = 0; w + 1 < keep; w++) store_elem(state, s + w, load_elem(state, s + w + 1, elem), elem);
            if (keep) store_elem(state, s + keep - 1, now, elem);
        }
    }
    return 0;
}

static void l2normed(const void *src, long at, int elem, int n, float scale, float *dst) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += (dst[i] = load_elem(src, at + i, elem)) * dst[i];
    const float inv = scale / sqrtf(ss + 1e-6f);
    for (int i = 0; i < n; i++) dst[i] *= inv;
}

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

int ft_delta_step(const void *mixed, long m_stride, int elem, const void *b, long b_stride, const void *a, long a_stride,
                  int ab_elem, const float *a_log, const float *dt_bias, float *state, const int32_t *slots, int rows,
                  int hk, int hv, int dk, int dv, const float *log_decay, void *out, int threads) {
    if (dk > MAX_DK || dv > MAX_DV || hv % hk) return -1;
    const int group = hv / hk;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < hv; h++) {
            if (slots[r] < 0) continue;
            const int kh = h / group;
            const long row = (long)r * m_stride;
            float q[MAX_DK], k[MAX_DK];
            l2normed(mixed, row + (long)kh * dk, elem, dk, 1.0f / sqrtf((float)dk), q);
            l2normed(mixed, row + (long)(hk + kh) * dk, elem, dk, 1.0f, k);
            const float beta = 1.0f / (1.0f + expf(-load_elem(b, (long)r * b_stride + h, ab_elem)));
            const float *channel = log_decay ? log_decay + ((long)r * hv + h) * dk : NULL;
            const float decay =
                channel ? 1.0f : expf(-expf(a_log[h]) * softplus(load_elem(a, (long)r * a_stride + h, ab_elem) + dt_bias[h]));
            float *s = state + (((long)slots[r] * hv + h) * dk) * dv;  // [Dk, Dv], rows of Dv contiguous
            const long v_at = row + 2L * hk * dk + (long)h * dv;
            float predicted[MAX_DV] = {0}, delta[MAX_DV], o[MAX_DV] = {0};
            for (int i = 0; i < dk; i++) {  // decay, then Sᵀk: one pass, the value dims vectorised
                float *si = s + (long)i * dv;
                const float di = channel ? expf(channel[i]) : decay;
                for (int j = 0; j < dv; j++) predicted[j] += (si[j] *= di) * k[i];
            }
            for (int j = 0; j < dv; j++) delta[j] = beta * (load_elem(mixed, v_at + j, elem) - predicted[j]);
            for (int i = 0; i < dk; i++) {  // the write k ⊗ δ, then Sᵀq: a second pass
                float *si = s + (long)i * dv;
                for (int j = 0; j < dv; j++) o[j] += (si[j] += k[i] * delta[j]) * q[i];
            }
            for (int j = 0; j < dv; j++) store_elem(out, ((long)r * hv + h) * dv + j, o[j], elem);
        }
    return 0;
}
