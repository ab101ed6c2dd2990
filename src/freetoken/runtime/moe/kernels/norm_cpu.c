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
