// bf16 dot products with fp32 accumulation, shared by the expert and the dense kernels.
#ifndef FT_BF16_DOT_H
#define FT_BF16_DOT_H
#include <stdint.h>
#include <string.h>

// A bf16 row is read as 32-bit words, each two elements: the low one becomes a float by a shift, the
// high one by a mask, so no lane shuffle is needed; the vector it is dotted with is kept "split", its
// even elements first, then its odd ones (then the last one when the length is odd), so both halves
// meet their operands in order. Per 64 bytes of weights: one load, a shift, a mask and two FMAs a vector.
// LANES words per step in independent accumulators hide the FMA latency.
#ifndef LANES
#define LANES 32
#endif
// Software prefetch distance of a single dot, in bf16 elements (0: none); prefetches never fault, so
// running past the end of a row or a unit is harmless. Measured A/B on a 2-core AVX2 host: 2 KiB ahead
// took 0.87-0.95 x the time of a MoE layer step at one token (4 KiB: 1.15 x); on a 16-core host it cost
// more than half the speed, so the loader builds with 0 there (loader.py, machine_defines).
#ifndef PREFETCH
#define PREFETCH 1024
#endif
// PREFETCH_HINT: that prefetch's locality (0: non-temporal, as measured above; 1-3: into L3 / L2 / L1 as
// well — the K-quant dots' own prefetch gained 0.72 -> 0.83 x the read at 16 threads on a 16-core Xeon
// from 2, kquant_dot_int8.h; not yet measured here).
#ifndef PREFETCH_HINT
#define PREFETCH_HINT 0
#endif
static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// One element of a bf16 (elem 2) or fp32 (elem 4) array, as fp32; and a value rounded to that dtype
// (bf16: to nearest even, for finite values) and stored.
static inline float load_elem(const void *base, long i, int elem) {
    if (elem == 4) return ((const float *)base)[i];
    return bits_f32((uint32_t)((const uint16_t *)base)[i] << 16);
}

static inline float round_elem(float f, int elem) {
    if (elem == 4) return f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return bits_f32((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

static inline void store_elem(void *base, long i, float f, int elem) {
    if (elem == 4) {
        ((float *)base)[i] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    ((uint16_t *)base)[i] = (uint16_t)u;
}

// The sum of n partial sums (n a power of two), folded in halves: each fold is one vector add, where a
// running scalar sum would be a chain of n dependent adds (it cost as much as the dot it ends).
static inline float fold_sum(float *a, int n) {
    for (int w = n / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) a[j] += a[j + w];
    return a[0];
}

// Where element i of a length-n vector sits in its split form.
static inline long split_at(long i, long n) {
    const long m = n / 2;
    return i == 2 * m ? 2 * m : (i & 1) ? m + i / 2 : i / 2;
}

static void split_row(const float *restrict x, float *restrict xs, long n) {
    for (long i = 0; i < n; i++) xs[split_at(i, n)] = x[i];
}

// Eight lanes as one value (GCC/Clang vector extensions: AVX registers on x86, pairs of NEON ones on
// ARM), so the accumulators stay in registers; casts between these types keep the bits.
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8f load8f(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8u load8u(const uint16_t *p) {  // eight words: sixteen bf16 elements
    v8u v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(v8f v) {
    float a[8];
    memcpy(a, &v, sizeof a);
    return fold_sum(a, 8);
}

// w: n bf16 elements; xs: the other vector in split form. LANES words a step in LANES / 8 accumulators
// per half.
static inline float dot_bf16(const uint16_t *restrict w, const float *restrict xs, int n) {
    const int m = n / 2;
    const float *restrict xe = xs, *restrict xo = xs + m;
    const v8u high = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                      0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
    v8f ae[LANES / 8] = {0}, ao[LANES / 8] = {0};
    int k = 0;
    for (; k + LANES <= m; k += LANES) {
#if PREFETCH > 0
        __builtin_prefetch(w + 2 * k + PREFETCH, 0, PREFETCH_HINT);
#endif
        for (int j = 0; j < LANES / 8; j++) {
            const v8u u = load8u(w + 2 * (k + 8 * j));
            ae[j] += (v8f)(u << 16) * load8f(xe + k + 8 * j);
            ao[j] += (v8f)(u & high) * load8f(xo + k + 8 * j);
        }
    }
    v8f total = ae[0] + ao[0];
    for (int j = 1; j < LANES / 8; j++) total += ae[j] + ao[j];
    float s = sum8(total);
    for (; k < m; k++) {
        uint32_t v;
        memcpy(&v, w + 2 * k, sizeof v);
        s += bits_f32(v << 16) * xe[k] + bits_f32(v & 0xFFFF0000u) * xo[k];
    }
    if (n & 1) s += bits_f32((uint32_t)w[n - 1] << 16) * xs[2 * m];
    return s;
}

// Four dots of one bf16 row with four split vectors: the row is converted once for all four, which is
// what makes a batch (several pairs of one expert) cheaper than four single dots.
static inline void dot4_bf16(const uint16_t *restrict w, const float *const v[4], int n, float out[4]) {
    const int m = n / 2;
    const v8u high = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                      0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
    const float *restrict v0 = v[0], *restrict v1 = v[1], *restrict v2 = v[2], *restrict v3 = v[3];
    v8f e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0}, o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
    int k = 0;
    for (; k + 8 <= m; k += 8) {
        const v8u u = load8u(w + 2 * k);
        const v8f lo = (v8f)(u << 16), hi = (v8f)(u & high);
        e0 += lo * load8f(v0 + k), o0 += hi * load8f(v0 + m + k);
        e1 += lo * load8f(v1 + k), o1 += hi * load8f(v1 + m + k);
        e2 += lo * load8f(v2 + k), o2 += hi * load8f(v2 + m + k);
        e3 += lo * load8f(v3 + k), o3 += hi * load8f(v3 + m + k);
    }
    float s[4] = {sum8(e0 + o0), sum8(e1 + o1), sum8(e2 + o2), sum8(e3 + o3)};
    for (; k < m; k++) {
        uint32_t u;
        memcpy(&u, w + 2 * k, sizeof u);
        const float lo = bits_f32(u << 16), hi = bits_f32(u & 0xFFFF0000u);
        for (int j = 0; j < 4; j++) s[j] += lo * v[j][k] + hi * v[j][m + k];
    }
    if (n & 1) {
        const float last = bits_f32((uint32_t)w[n - 1] << 16);
        for (int j = 0; j < 4; j++) s[j] += last * v[j][2 * m];
    }
    for (int j = 0; j < 4; j++) out[j] = s[j];
}

// out[j] = w . v[j] for the `count` split vectors v: in fours while they last, then one at a time.
static inline void dots_bf16(const uint16_t *restrict w, const float *const *v, int count, int n, float *out) {
    int j = 0;
    for (; j + 4 <= count; j += 4) dot4_bf16(w, v + j, n, out + j);
    for (; j < count; j++) out[j] = dot_bf16(w, v[j], n);
}

// A bf16 row against bf16 vectors in natural order (a bf16 model's activations), for CPUs with bf16 dot
// instructions (AVX512-BF16): each instruction multiplies 32 pairs of bf16 and adds each pair's two
// products into an fp32 lane, with no widening of the row. Elsewhere both sides are widened to fp32 (the
// same products; the instruction rounds each pair's sum once more). out[j] = w . v[j], four vectors per
// pass over the row while they last.
static inline float bf16_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

static inline float dot_tail_bf16(const uint16_t *w, const uint16_t *v, int k, int n) {
    float s = 0.0f;
    for (; k < n; k++) s += bf16_f32(w[k]) * bf16_f32(v[k]);
    return s;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_PAIR_DOT 1

static inline __m512bh load_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

static inline void dots_bf16_bf16(const uint16_t *restrict w, const uint16_t *const *v, int count, int n,
                                  float *out) {
    const int whole = n & ~31, pairs = n & ~63;
    int j = 0;
    for (; j + 8 <= count; j += 8) {  // a row load serves eight vectors (loads, not the dots, bound this)
        __m512 a[8];
        for (int q = 0; q < 8; q++) a[q] = _mm512_setzero_ps();
        for (int k = 0; k < whole; k += 32) {
            const __m512bh r = load_bh(w + k);
            for (int q = 0; q < 8; q++) a[q] = _mm512_dpbf16_ps(a[q], r, load_bh(v[j + q] + k));
        }
        for (int q = 0; q < 8; q++)
            out[j + q] = _mm512_reduce_add_ps(a[q]) + dot_tail_bf16(w, v[j + q], whole, n);
    }
    for (; j + 4 <= count; j += 4) {
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int k = 0; k < whole; k += 32) {
            const __m512bh r = load_bh(w + k);
            for (int q = 0; q < 4; q++) a[q] = _mm512_dpbf16_ps(a[q], r, load_bh(v[j + q] + k));
        }
        for (int q = 0; q < 4; q++)
            out[j + q] = _mm512_reduce_add_ps(a[q]) + dot_tail_bf16(w, v[j + q], whole, n);
    }
    for (; j < count; j++) {  // two accumulators hide the instruction's latency
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int k = 0;
        for (; k < pairs; k += 64) {
            a0 = _mm512_dpbf16_ps(a0, load_bh(w + k), load_bh(v[j] + k));
            a1 = _mm512_dpbf16_ps(a1, load_bh(w + k + 32), load_bh(v[j] + k + 32));
        }
        for (; k < whole; k += 32) a0 = _mm512_dpbf16_ps(a0, load_bh(w + k), load_bh(v[j] + k));
        out[j] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + dot_tail_bf16(w, v[j], whole, n);
    }
}
#else
#define HAVE_BF16_PAIR_DOT 0
static inline void dots_bf16_bf16(const uint16_t *restrict w, const uint16_t *const *v, int count, int n,
                                  float *out) {
    const v8u high = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                      0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
    for (int j = 0; j < count; j++) {
        v8f a = {0};
        int k = 0;
        for (; k + 16 <= n; k += 16) {
            const v8u r = load8u(w + k), x = load8u(v[j] + k);
            a += (v8f)(r << 16) * (v8f)(x << 16) + (v8f)(r & high) * (v8f)(x & high);
        }
        out[j] = sum8(a) + dot_tail_bf16(w, v[j], k, n);
    }
}
#endif

// fp32 values rounded to bf16 (to nearest even), natural order.
static inline void round_row_bf16(const float *restrict x, uint16_t *restrict out, long n) {
    for (long i = 0; i < n; i++) store_elem(out, i, x[i], 2);
}

// x's row as bf16 into `out` if every value is a bf16 value (the low 16 bits of each fp32 zero: a bf16
// model's activations): returns 1, else 0 (then `out` is partial and unused).
static inline int exact_bf16_row(const float *restrict x, uint16_t *restrict out, long n) {
    uint32_t low = 0;
    for (long i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        low |= bits & 0xffffu;
        out[i] = (uint16_t)(bits >> 16);
    }
    return low == 0;
}

#endif
