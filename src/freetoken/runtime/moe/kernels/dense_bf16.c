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

// xs: scratch of T·H floats (x in split form, or as bf16). Returns 0, or -1 for more than MAX_TOKENS tokens.
int ft_linear_bf16(const uint16_t *w, const float *x, float *out, int n_rows, int hidden, int tokens,
                   float *xs, int threads) {
    if (tokens < 1 || tokens > MAX_TOKENS) return -1;
    // a bf16 model's rows are bf16 values: from four rows on, where the CPU has bf16 pair-dot instructions,
    // those take them as they are (the same products; only the order of the fp32 sums differs; a weight
    // load serves four rows: 8 rows 128 -> 154 tok/s on a 2-core EPYC), else x goes in split form (one
    // row: 78-82 tok/s split, 73-78 pair-dot)
    uint16_t *xb = (uint16_t *)xs;
    int exact = HAVE_BF16_PAIR_DOT && tokens >= 4;
    for (int t = 0; t < tokens && exact; t++) exact = exact_bf16_row(x + (long)t * hidden, xb + (long)t * hidden, hidden);
    const float *v[MAX_TOKENS];
    const uint16_t *vb[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) {
        if (!exact) split_row(x + (long)t * hidden, xs + (long)t * hidden, hidden);
        v[t] = xs + (long)t * hidden, vb[t] = xb + (long)t * hidden;
    }
    const long blocks = (n_rows + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        float d[MAX_TOKENS];
        const int r1 = (b + 1) * ROWS < n_rows ? (int)((b + 1) * ROWS) : n_rows;
        for (int r = (int)(b * ROWS); r < r1; r++) {
            if (exact)
                dots_bf16_bf16(w + (long)r * hidden, vb, tokens, hidden, d);
            else
                dots_bf16(w + (long)r * hidden, v, tokens, hidden, d);
            for (int t = 0; t < tokens; t++) out[(long)t * n_rows + r] = d[t];
        }
    }
    return 0;
}
