// SwiGLU experts over bf16 weights at memory bandwidth, fp32 accumulation, OpenMP threads.
//
// One call computes one MoE layer step for the experts routed to the CPU:
//   for expert e, its entries n in [offsets[e], offsets[e+1]) (a token row and a routing weight):
//     a[n, i] = w[n] * silu(gate_e[i] . x[tok[n]]) * (up_e[i] . x[tok[n]])        i < I
//     out[tok[n], h] += down_e[h] . a[n]                                          h < H
// Phase 1 splits (expert, row) pairs over threads; phase 2 splits output rows h, so no two threads
// write the same element. Each weight row is read once per call whatever the number of entries.
#include <math.h>
#include <omp.h>
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
// How phase 2 splits the rows of `down`:
//   0: work items of DOWN_BLOCK rows, dealt out statically (H / DOWN_BLOCK items: 16 for H = 2048, so 14
//      threads leave 2 of them a second item and the rest idle, a third of the bytes at half speed);
//   1: each thread one contiguous run of H / threads rows (±1), of every expert: balanced at any count;
//   2: blocks of 32 rows (every expert's) taken dynamically, and phase 1's rows too in runs of 32: a
//      thread the host delays holds up the barrier by one block, not by its whole share.
#ifndef DOWN_SPLIT
#define DOWN_SPLIT 1
#endif
#if DOWN_SPLIT == 2
#define PHASE1_SCHEDULE schedule(dynamic, 32)
#else
#define PHASE1_SCHEDULE schedule(static)
#endif
#ifndef DOWN_BLOCK
#define DOWN_BLOCK 128  // rows of `down` per work item when DOWN_SPLIT is 0
#endif
// Software prefetch distance in bf16 elements (0: none). A thread's rows are contiguous, but the
// hardware streamer stops at every 4 KiB page, which is one row of `gate_up` here; prefetching past
// the row's end keeps the stream going into the next one. Prefetches never fault, so running past
// the end of a thread's range is harmless.
#ifndef PREFETCH
#define PREFETCH 2048
#endif
// Defaults from benchmarks/cpu_kernel_sweep.py on a 16-core host (14 threads, 3 passes): rows in memory
// order, 128 rows of `down` per item and prefetch 2048 elements ahead gave 90-96 GB/s in every pass; the
// old default (gate then up, 32 rows, no prefetch) 77-90.
// How phase 1 walks an expert's gate_up rows:
//   0: row i of gate, then row i of up (two streams 2I·H apart, taken in turn);
//   1: the same pairs, both rows in one loop (two streams at once, x loaded once);
//   2: the rows in memory order, each thread one contiguous run (one stream, as a plain read), and the
//      activation computed after a barrier.
#ifndef ROW_ORDER
#define ROW_ORDER 2
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

// out[tok[n], h] += down_e[h] . a[n] for rows h in [h0, h1) of every expert; a[n] is scratch row n.
static inline void down_rows(const uint16_t *const *down, int n_experts, int hidden, int inter, int h0, int h1,
                             const int32_t *tok, const int32_t *offsets, const float *scratch, float *out) {
    const long two_i = 2L * inter;
    for (int e = 0; e < n_experts; e++) {
        for (int h = h0; h < h1; h++) {
            const uint16_t *d = down[e] + (long)h * inter;
            for (int n = offsets[e]; n < offsets[e + 1]; n++)
                out[(long)tok[n] * hidden + h] += dot_bf16(d, scratch + n * two_i, inter);
        }
    }
}

// gate_up[e]: [2I, H] (gate rows, then up rows); down[e]: [H, I]; x: [T, H] fp32; out: [T, H] fp32
// (accumulated into); scratch: [entries, 2I] fp32, whose row n holds entry n's activation in its first I.
void ft_experts_bf16(const uint16_t *const *gate_up, const uint16_t *const *down, int n_experts, int hidden,
                     int inter, const float *x, const int32_t *tok, const float *weight,
                     const int32_t *offsets, float *scratch, float *out, int threads) {
    const long two_i = 2L * inter;
#pragma omp parallel num_threads(threads)
    {
#if ROW_ORDER == 2
#pragma omp for PHASE1_SCHEDULE
        for (long p = 0; p < n_experts * two_i; p++) {
            const int e = (int)(p / two_i), r = (int)(p % two_i);
            const uint16_t *row = gate_up[e] + (long)r * hidden;
            for (int n = offsets[e]; n < offsets[e + 1]; n++)
                scratch[n * two_i + r] = dot_bf16(row, x + (long)tok[n] * hidden, hidden);
        }
        const long entries = offsets[n_experts];
#pragma omp for schedule(static)
        for (long q = 0; q < entries * inter; q++) {
            const long n = q / inter, i = q % inter;
            const float gv = scratch[n * two_i + i], uv = scratch[n * two_i + inter + i];
            scratch[n * two_i + i] = weight[n] * (gv / (1.0f + expf(-gv))) * uv;
        }
#else
#pragma omp for schedule(static)
        for (long p = 0; p < (long)n_experts * inter; p++) {
            const int e = (int)(p / inter), i = (int)(p % inter);
            const uint16_t *g = gate_up[e] + (long)i * hidden;
            const uint16_t *u = gate_up[e] + (long)(i + inter) * hidden;
            for (int n = offsets[e]; n < offsets[e + 1]; n++) {
                const float *xn = x + (long)tok[n] * hidden;
#if ROW_ORDER == 1
                float gv, uv;
                dot2_bf16(g, u, xn, hidden, &gv, &uv);
#else
                const float gv = dot_bf16(g, xn, hidden), uv = dot_bf16(u, xn, hidden);
#endif
                scratch[n * two_i + i] = weight[n] * (gv / (1.0f + expf(-gv))) * uv;
            }
        }
#endif
        // the implicit barrier of the loop above: every activation is ready. Each thread streams a
        // contiguous run of rows of one expert before moving to the next.
#if DOWN_SPLIT == 1
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        down_rows(down, n_experts, hidden, inter, (int)((long)hidden * t / nt),
                  (int)((long)hidden * (t + 1) / nt), tok, offsets, scratch, out);
#elif DOWN_SPLIT == 2
#pragma omp for schedule(dynamic, 1)
        for (int h0 = 0; h0 < hidden; h0 += 32)
            down_rows(down, n_experts, hidden, inter, h0, h0 + 32 < hidden ? h0 + 32 : hidden, tok, offsets,
                      scratch, out);
#else
#pragma omp for schedule(static)
        for (int h0 = 0; h0 < hidden; h0 += DOWN_BLOCK) {
            const int h1 = h0 + DOWN_BLOCK < hidden ? h0 + DOWN_BLOCK : hidden;
            down_rows(down, n_experts, hidden, inter, h0, h1, tok, offsets, scratch, out);
        }
#endif
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
