// The residual add and RMS norm of a decode step on the CPU, rounding as the torch reference does:
//   s = x + residual, rounded to the dtype (bf16: to nearest even; fp32: as is)
//   h = weight · round(s · 1/sqrt(mean(s²) + eps))   (the norm in fp32, the product rounded too)
// x, residual (NULL: none), weight, out_h, out_sum: [rows, hidden] / [hidden] in bf16 (elem 2) or fp32
// (elem 4). out_sum may be x itself when there is no residual.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_dot.h"

void ft_add_rms_norm(const void *x, const void *residual, const void *weight, float eps, int rows, int hidden,
                     int elem, void *out_h, void *out_sum, float *scratch) {
    for (int r = 0; r < rows; r++) {
        const long base = (long)r * hidden;
        float ss = 0.0f;
        for (int i = 0; i < hidden; i++) {
            float s = load_elem(x, base + i, elem);
            if (residual) s = round_elem(s + load_elem(residual, base + i, elem), elem);
            scratch[i] = s;
            ss += s * s;
        }
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int i = 0; i < hidden; i++) {
            store_elem(out_sum, base + i, scratch[i], elem);
            const float h = round_elem(scratch[i] * inv, elem);
            store_elem(out_h, base + i, round_elem(load_elem(weight, i, elem) * h, elem), elem);
        }
    }
}

// The greedy draw of each row of logits [rows, vocab] (bf16 or fp32, by elem), as torch.argmax and
// torch.isfinite(...).all() give it: out[2r] = the index of the first maximum (of the first NaN, which
// argmax ranks above every number), out[2r + 1] = 1 when every logit of the row is finite.
void ft_greedy_rows(const void *logits, int elem, int rows, long vocab, int64_t *out) {
    for (int r = 0; r < rows; r++) {
        const long base = (long)r * vocab;
        long best = 0, nan_at = -1;
        float top = load_elem(logits, base, elem);
        int finite = 1;
        for (long i = 0; i < vocab; i++) {
            const float v = load_elem(logits, base + i, elem);
            if (!isfinite(v)) {
                finite = 0;
                if (v != v && nan_at < 0) nan_at = i;
            }
            if (v > top) top = v, best = i;
        }
        out[2L * r] = nan_at >= 0 ? nan_at : best;
        out[2L * r + 1] = finite;
    }
}
