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

// Where element i of a length-n vector sits in its split form.
static inline long split_at(long i, long n) {
    const long m = n / 2;
    return i == 2 * m ? 2 * m : (i & 1) ? m + i / 2 : i / 2;
}

static void split_row(const float *restrict x, float *restrict xs, long n) {
    for (long i = 0; i < n; i++) xs[split_at(i, n)] = x[i];
}

// w: n bf16 elements; xs: the other vector in split form.
static inline float dot_bf16(const uint16_t *restrict w, const float *restrict xs, int n) {
    const int m = n / 2;
    const float *restrict xe = xs, *restrict xo = xs + m;
    float ae[LANES] = {0}, ao[LANES] = {0};
    int k = 0;
    for (; k + LANES <= m; k += LANES) {
#if PREFETCH > 0
        __builtin_prefetch(w + 2 * k + PREFETCH, 0, 0);
#endif
        for (int j = 0; j < LANES; j++) {
            uint32_t v;
            memcpy(&v, w + 2 * (k + j), sizeof v);
            ae[j] += bits_f32(v << 16) * xe[k + j];
            ao[j] += bits_f32(v & 0xFFFF0000u) * xo[k + j];
        }
    }
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += ae[j] + ao[j];
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
    const float *restrict v0 = v[0], *restrict v1 = v[1], *restrict v2 = v[2], *restrict v3 = v[3];
    float e0[16] = {0}, o0[16] = {0}, e1[16] = {0}, o1[16] = {0};
    float e2[16] = {0}, o2[16] = {0}, e3[16] = {0}, o3[16] = {0};
    int k = 0;
    for (; k + 16 <= m; k += 16)
        for (int j = 0; j < 16; j++) {
            uint32_t u;
            memcpy(&u, w + 2 * (k + j), sizeof u);
            const float lo = bits_f32(u << 16), hi = bits_f32(u & 0xFFFF0000u);
            e0[j] += lo * v0[k + j], o0[j] += hi * v0[m + k + j];
            e1[j] += lo * v1[k + j], o1[j] += hi * v1[m + k + j];
            e2[j] += lo * v2[k + j], o2[j] += hi * v2[m + k + j];
            e3[j] += lo * v3[k + j], o3[j] += hi * v3[m + k + j];
        }
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    for (int j = 0; j < 16; j++) s0 += e0[j] + o0[j], s1 += e1[j] + o1[j], s2 += e2[j] + o2[j], s3 += e3[j] + o3[j];
    for (; k < m; k++) {
        uint32_t u;
        memcpy(&u, w + 2 * k, sizeof u);
        const float lo = bits_f32(u << 16), hi = bits_f32(u & 0xFFFF0000u);
        s0 += lo * v0[k] + hi * v0[m + k], s1 += lo * v1[k] + hi * v1[m + k];
        s2 += lo * v2[k] + hi * v2[m + k], s3 += lo * v3[k] + hi * v3[m + k];
    }
    if (n & 1) {
        const float last = bits_f32((uint32_t)w[n - 1] << 16);
        s0 += last * v0[2 * m], s1 += last * v1[2 * m], s2 += last * v2[2 * m], s3 += last * v3[2 * m];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// out[j] = w . v[j] for the `count` split vectors v: in fours while they last, then one at a time.
static inline void dots_bf16(const uint16_t *restrict w, const float *const *v, int count, int n, float *out) {
    int j = 0;
    for (; j + 4 <= count; j += 4) dot4_bf16(w, v + j, n, out + j);
    for (; j < count; j++) out[j] = dot_bf16(w, v[j], n);
}

#endif
