// Dense layers of a decode step over bf16 weights: out[t, n] = W[n] . x[t], fp32 accumulation.
//
// W [N, H] bf16 rows (a Linear's weight), x [T, H] fp32, out [T, N] fp32, T <= 16 tokens. The rows are
// split statically over the threads in blocks of ROWS; each row is read once and dotted with every
// token (four at a time), so a call moves the weight bytes once whatever T is.
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_dot.h"

#define MAX_TOKENS 16
#ifndef ROWS
#define ROWS 16
#endif

// xs: scratch of T·H floats (x in split form). Returns 0, or -1 for more than MAX_TOKENS tokens.
int ft_linear_bf16(const uint16_t *w, const float *x, float *out, int n_rows, int hidden, int tokens,
                   float *xs, int threads) {
    if (tokens < 1 || tokens > MAX_TOKENS) return -1;
    for (int t = 0; t < tokens; t++) split_row(x + (long)t * hidden, xs + (long)t * hidden, hidden);
    const float *v[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) v[t] = xs + (long)t * hidden;
    const long blocks = (n_rows + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        float d[MAX_TOKENS];
        const int r1 = (b + 1) * ROWS < n_rows ? (int)((b + 1) * ROWS) : n_rows;
        for (int r = (int)(b * ROWS); r < r1; r++) {
            dots_bf16(w + (long)r * hidden, v, tokens, hidden, d);
            for (int t = 0; t < tokens; t++) out[(long)t * n_rows + r] = d[t];
        }
    }
    return 0;
}
