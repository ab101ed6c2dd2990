// SwiGLU experts over bf16 weights at memory bandwidth, fp32 accumulation, OpenMP threads.
//
// One call computes one MoE layer step for the experts routed to the CPU:
//   for expert e, its entries n in [offsets[e], offsets[e+1]) (a token row and a routing weight):
//     a[n, i] = w[n] * silu(gate_e[i] . x[tok[n]]) * (up_e[i] . x[tok[n]])        i < I
//     out[tok[n], h] += down_e[h] . a[n]                                          h < H
// Phase 1 splits (expert, row) pairs over threads; phase 2 splits output rows h, so no two threads
// write the same element. Each weight row is read once per call whatever the number of entries.
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &u, sizeof f);  // vectorises to a widen and a shift
    return f;
}

// Independent accumulators: 4 vectors of 8 hide the FMA latency; more spill registers (measured: 16
// lanes 24 GB/s, 32 lanes 29 GB/s, 64 lanes 17 GB/s on one core).
#ifndef LANES
#define LANES 32
#endif
#ifndef DOWN_BLOCK
#define DOWN_BLOCK 32  // rows of `down` per work item
#endif
// Software prefetch distance in bf16 elements (0: none). A thread's rows are contiguous, but the
// hardware streamer stops at every 4 KiB page, which is one row of `gate_up` here; prefetching past
// the row's end keeps the stream going into the next one. Prefetches never fault, so running past
// the end of a thread's range is harmless.
#ifndef PREFETCH
#define PREFETCH 0
#endif
// 1: the gate and up rows of one output are read in one loop (two streams, x loaded once).
#ifndef FUSE_GATE_UP
#define FUSE_GATE_UP 0
#endif

static inline float dot_bf16(const uint16_t *restrict w, const float *restrict x, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
#if PREFETCH > 0
        __builtin_prefetch(w + i + PREFETCH, 0, 0);
#endif
        for (int j = 0; j < LANES; j++) acc[j] += bf16_to_f32(w[i + j]) * x[i + j];
    }
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < n; i++) s += bf16_to_f32(w[i]) * x[i];
    return s;
}

static inline void dot2_bf16(const uint16_t *restrict g, const uint16_t *restrict u, const float *restrict x,
                             int n, float *gv, float *uv) {
    float ag[LANES] = {0}, au[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
#if PREFETCH > 0
        __builtin_prefetch(g + i + PREFETCH, 0, 0);
        __builtin_prefetch(u + i + PREFETCH, 0, 0);
#endif
        for (int j = 0; j < LANES; j++) {
            ag[j] += bf16_to_f32(g[i + j]) * x[i + j];
            au[j] += bf16_to_f32(u[i + j]) * x[i + j];
        }
    }
    float sg = 0.0f, su = 0.0f;
    for (int j = 0; j < LANES; j++) sg += ag[j], su += au[j];
    for (; i < n; i++) sg += bf16_to_f32(g[i]) * x[i], su += bf16_to_f32(u[i]) * x[i];
    *gv = sg;
    *uv = su;
}

// gate_up[e]: [2I, H] (gate rows, then up rows); down[e]: [H, I]; x: [T, H] fp32; out: [T, H] fp32
// (accumulated into); act: scratch [entries, I] fp32.
void ft_experts_bf16(const uint16_t *const *gate_up, const uint16_t *const *down, int n_experts, int hidden,
                     int inter, const float *x, const int32_t *tok, const float *weight,
                     const int32_t *offsets, float *act, float *out, int threads) {
    const long rows1 = (long)n_experts * inter;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long p = 0; p < rows1; p++) {
            const int e = (int)(p / inter), i = (int)(p % inter);
            const uint16_t *g = gate_up[e] + (long)i * hidden;
            const uint16_t *u = gate_up[e] + (long)(i + inter) * hidden;
            for (int n = offsets[e]; n < offsets[e + 1]; n++) {
                const float *xn = x + (long)tok[n] * hidden;
#if FUSE_GATE_UP
                float gv, uv;
                dot2_bf16(g, u, xn, hidden, &gv, &uv);
#else
                const float gv = dot_bf16(g, xn, hidden), uv = dot_bf16(u, xn, hidden);
#endif
                act[(long)n * inter + i] = weight[n] * (gv / (1.0f + expf(-gv))) * uv;
            }
        }
        // the implicit barrier of the loop above: every activation is ready. Rows of `down` go in blocks
        // so each thread streams a contiguous run of one expert before moving to the next.
#pragma omp for schedule(static)
        for (int h0 = 0; h0 < hidden; h0 += DOWN_BLOCK) {
            const int h1 = h0 + DOWN_BLOCK < hidden ? h0 + DOWN_BLOCK : hidden;
            for (int e = 0; e < n_experts; e++) {
                for (int h = h0; h < h1; h++) {
                    const uint16_t *d = down[e] + (long)h * inter;
                    for (int n = offsets[e]; n < offsets[e + 1]; n++) {
                        out[(long)tok[n] * hidden + h] += dot_bf16(d, act + (long)n * inter, inter);
                    }
                }
            }
        }
    }
}

// STREAM-like read of `n` floats over `threads` threads; returns the sum so nothing is optimised away.
double ft_read_f32(const float *buf, long n, int threads) {
    double total = 0.0;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
    for (long c = 0; c < n / 4096; c++) {
        float acc[LANES] = {0};
        const float *p = buf + c * 4096;
        for (int i = 0; i < 4096; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += p[i + j];
        float s = 0.0f;
        for (int j = 0; j < LANES; j++) s += acc[j];
        total += s;
    }
    return total;
}
