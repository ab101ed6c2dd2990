// A decode step's attention block on the CPU, after the fused q/k/v GEMV, for each row (token):
//   q and k get an RMS norm (fp32, then times qw / kw): per head over the head dim (norm 1), over the
//   whole projection (norm 2: qw [NH·D], kw [KVH·D]) or none (norm 0); then the rotary embedding in
//   rotate-half form (x·cos + rotate_half(x)·sin) on the first `rot` dims of each head; k and v are
//   written into the row's cache slot at its position; then every query head attends over the slot's
//   first position + 1 keys (the last `window` of them where window > 0): scores · scale, softmax with
//   the head's sink logit in its denominator where `sinks` [NH] is given, the weighted sum of the values.
// qkv [B, (NH + 2 KVH)·D] fp32; cos, sin [B, rot] fp32; caches [S, KVH, CAP, D], bf16 (elem 2) or fp32
// (elem 4); slots, positions [B] (slot -1: a padding row, skipped); scores: scratch of B·NH·CAP
// floats; out [B, NH·D] fp32. Heads of a KV group share its keys (NH a multiple of KVH).
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16_dot.h"

// x [n] in place: RMS norm with weight w.
static void rms_norm(float *x, const float *w, float eps, long n) {
    float ss = 0.0f;
    for (long i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (long i = 0; i < n; i++) x[i] = w[i] * (x[i] * inv);
}

// One head x [D] in place: its RMS norm with weight w (none where w is NULL), then the rotary embedding
// at this row's cos/sin on its first `rot` dims.
static void norm_rope(float *x, const float *w, float eps, const float *cos, const float *sin, int d, int rot) {
    if (w != NULL) rms_norm(x, w, eps, d);
    const int half = rot / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

// q . the key at element `at` of the cache, in eight partial sums (so the loop vectorises).
static inline float dot_key(const float *restrict q, const void *cache, long at, int d, int elem) {
    float acc[8] = {0};
    int i = 0;
    if (elem == 2) {
        const uint16_t *restrict key = (const uint16_t *)cache + at;
        for (; i + 8 <= d; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += q[i + j] * bits_f32((uint32_t)key[i + j] << 16);
    } else {
        const float *restrict key = (const float *)cache + at;
        for (; i + 8 <= d; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += q[i + j] * key[i + j];
    }
    float total = 0.0f;
    for (int j = 0; j < 8; j++) total += acc[j];
    for (; i < d; i++) total += q[i] * load_elem(cache, at + i, elem);
    return total;
}

// o += p · the value at element `at` of the cache.
static inline void add_value(float *restrict o, float p, const void *cache, long at, int d, int elem) {
    if (elem == 2) {
        const uint16_t *restrict value = (const uint16_t *)cache + at;
        for (int i = 0; i < d; i++) o[i] += p * bits_f32((uint32_t)value[i] << 16);
    } else {
        const float *restrict value = (const float *)cache + at;
        for (int i = 0; i < d; i++) o[i] += p * value[i];
    }
}

typedef uint16_t v8h __attribute__((vector_size(16)));

static inline v8f widen8(const uint16_t *p) {  // eight bf16 -> eight floats
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

// One query head over `length` bf16 keys and values of head dim D (a multiple of 8, at most 128),
// inlined with D constant: scores into s, the softmax-weighted sum of the values into o. Four keys at a
// time, so four chains of FMAs run side by side; the query and the output stay in vector registers.
static inline __attribute__((always_inline)) void attend_bf16(const float *restrict q, const uint16_t *keys,
                                                              const uint16_t *values, long length, int D,
                                                              float scale, float sink, float *restrict s,
                                                              float *restrict o) {
    v8f qv[16], ov[16];
    for (int c = 0; c < D / 8; c++) qv[c] = load8f(q + 8 * c), ov[c] = (v8f){0};
    float top = sink;
    long j = 0;
    for (; j + 4 <= length; j += 4) {
        const uint16_t *k = keys + j * D;
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int c = 0; c < D / 8; c++) {
            a0 += qv[c] * widen8(k + 8 * c), a1 += qv[c] * widen8(k + D + 8 * c);
            a2 += qv[c] * widen8(k + 2 * D + 8 * c), a3 += qv[c] * widen8(k + 3 * D + 8 * c);
        }
        s[j] = sum8(a0) * scale, s[j + 1] = sum8(a1) * scale, s[j + 2] = sum8(a2) * scale;
        s[j + 3] = sum8(a3) * scale;
        for (int i = 0; i < 4; i++) top = s[j + i] > top ? s[j + i] : top;
    }
    for (; j < length; j++) {
        v8f a = {0};
        for (int c = 0; c < D / 8; c++) a += qv[c] * widen8(keys + j * D + 8 * c);
        s[j] = sum8(a) * scale;
        top = s[j] > top ? s[j] : top;
    }
    float total = expf(sink - top);  // the sink's share of the denominator (none: -inf, 0)
    for (j = 0; j < length; j++) total += (s[j] = expf(s[j] - top));
    for (j = 0; j < length; j++) {
        const float p = s[j] / total;
        const v8f pv = {p, p, p, p, p, p, p, p};
        for (int c = 0; c < D / 8; c++) ov[c] += pv * widen8(values + j * D + 8 * c);
    }
    for (int c = 0; c < D / 8; c++) memcpy(o + 8 * c, &ov[c], sizeof(v8f));
}

// The G query heads of one KV group (G <= 8, their q consecutive: [G, D]) over its `length` bf16 keys
// and values, D constant as above: each key and value is widened once for all G heads, so a group's
// cache is read once instead of G times. Scores of head h into scores + h·cap, its output into o + h·D.
static inline __attribute__((always_inline)) void attend_group_bf16(const float *restrict q, const uint16_t *keys,
                                                                    const uint16_t *values, long length, int D,
                                                                    int G, float scale, const float *sinks,
                                                                    float *scores, long cap, float *restrict o) {
    float top[8], total[8];
    for (int h = 0; h < G; h++) top[h] = sinks ? sinks[h] : -INFINITY, total[h] = 0.0f;
    for (long j = 0; j < length; j++) {
        v8f kv[16];
        for (int c = 0; c < D / 8; c++) kv[c] = widen8(keys + j * D + 8 * c);
        for (int h = 0; h < G; h++) {
            v8f a = {0}, b = {0};
            for (int c = 0; c < D / 8; c += 2) {
                a += load8f(q + h * D + 8 * c) * kv[c];
                b += load8f(q + h * D + 8 * c + 8) * kv[c + 1];
            }
            const float x = sum8(a + b) * scale;
            scores[h * cap + j] = x;
            top[h] = x > top[h] ? x : top[h];
        }
    }
    for (int h = 0; h < G; h++) {
        float *s = scores + h * cap;
        if (sinks) total[h] = expf(sinks[h] - top[h]);
        for (long j = 0; j < length; j++) total[h] += (s[j] = expf(s[j] - top[h]));
    }
    memset(o, 0, sizeof(float) * G * D);
    for (long j = 0; j < length; j++) {
        v8f vv[16];
        for (int c = 0; c < D / 8; c++) vv[c] = widen8(values + j * D + 8 * c);
        for (int h = 0; h < G; h++) {
            const float p = scores[h * cap + j] / total[h];
            const v8f pv = {p, p, p, p, p, p, p, p};
            for (int c = 0; c < D / 8; c++) {
                v8f acc = load8f(o + h * D + 8 * c) + pv * vv[c];
                memcpy(o + h * D + 8 * c, &acc, sizeof acc);
            }
        }
    }
}

// The first key a query at the end of `length` keys sees: the last `window` of them (0: every key).
static inline long first_key(long length, int window) {
    return window > 0 && length > window ? length - window : 0;
}

int ft_attention_decode(const float *qkv, int rows, int nh, int kvh, int d, int norm, int rot, const float *qw,
                        const float *kw, float eps, const float *cos, const float *sin, void *k_cache, void *v_cache,
                        int elem, int cap, const int64_t *slots, const int64_t *positions, float scale,
                        const float *sinks, int window, float *scores, float *q_scratch, float *out,
                        int threads) {
    const long width = (long)(nh + 2 * kvh) * d;
    if ((long)kvh * d > 8192 || rot > d || rot % 2) return -2;
    const float *head_qw = norm == 1 ? qw : NULL, *head_kw = norm == 1 ? kw : NULL;
    for (int r = 0; r < rows; r++) {  // norms, rotary and the cache writes: small, serial
        const long slot = slots[r], pos = positions[r];
        if (slot < 0) continue;
        if (pos >= cap) return -1;
        const float *row = qkv + r * width, *c = cos + (long)r * rot, *sn = sin + (long)r * rot;
        float *q = q_scratch + (long)r * nh * d;
        memcpy(q, row, sizeof(float) * nh * d);
        float k[8192];
        memcpy(k, row + (long)nh * d, sizeof(float) * kvh * d);
        if (norm == 2) rms_norm(q, qw, eps, (long)nh * d), rms_norm(k, kw, eps, (long)kvh * d);
        for (int h = 0; h < nh; h++) norm_rope(q + (long)h * d, head_qw, eps, c, sn, d, rot);
        for (int g = 0; g < kvh; g++) {
            norm_rope(k + (long)g * d, head_kw, eps, c, sn, d, rot);
            const long at = ((slot * kvh + g) * cap + pos) * d;
            const float *v = row + (long)(nh + kvh) * d + (long)g * d;
            for (int i = 0; i < d; i++) {
                store_elem(k_cache, at + i, k[(long)g * d + i], elem);
                store_elem(v_cache, at + i, v[i], elem);
            }
        }
    }
    const int group = nh / kvh;
    if (elem == 2 && (d == 64 || d == 128) && group <= 8 && rows * kvh >= threads) {
        // enough (row, KV group) tasks for the threads: each group's cache read once for its heads
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
        for (int r = 0; r < rows; r++) {
            for (int g = 0; g < kvh; g++) {
                const long slot = slots[r];
                float *o = out + ((long)r * nh + (long)g * group) * d;
                if (slot < 0) {
                    memset(o, 0, sizeof(float) * group * d);
                    continue;
                }
                const long first = first_key(positions[r] + 1, window), length = positions[r] + 1 - first;
                const long base = ((slot * kvh + g) * cap + first) * d;
                const float *q = q_scratch + ((long)r * nh + (long)g * group) * d;
                const float *sk = sinks ? sinks + (long)g * group : NULL;
                float *sc = scores + ((long)r * nh + (long)g * group) * cap;
                const uint16_t *keys = (const uint16_t *)k_cache + base, *values = (const uint16_t *)v_cache + base;
                if (d == 64) attend_group_bf16(q, keys, values, length, 64, group, scale, sk, sc, cap, o);
                else attend_group_bf16(q, keys, values, length, 128, group, scale, sk, sc, cap, o);
            }
        }
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int r = 0; r < rows; r++) {
        for (int h = 0; h < nh; h++) {
            const long slot = slots[r];
            float *o = out + ((long)r * nh + h) * d;
            if (slot < 0) {
                memset(o, 0, sizeof(float) * d);
                continue;
            }
            const long first = first_key(positions[r] + 1, window), length = positions[r] + 1 - first;
            const long base = ((slot * kvh + h / group) * cap + first) * d;
            const float *q = q_scratch + ((long)r * nh + h) * d;
            const float sink = sinks ? sinks[h] : -INFINITY;
            float *s = scores + ((long)r * nh + h) * cap;
            const uint16_t *keys = (const uint16_t *)k_cache + base, *values = (const uint16_t *)v_cache + base;
            if (elem == 2 && d == 64) {
                attend_bf16(q, keys, values, length, 64, scale, sink, s, o);
                continue;
            }
            if (elem == 2 && d == 128) {
                attend_bf16(q, keys, values, length, 128, scale, sink, s, o);
                continue;
            }
            float top = sink;
            for (long j = 0; j < length; j++) {
                s[j] = dot_key(q, k_cache, base + j * d, d, elem) * scale;
                top = s[j] > top ? s[j] : top;
            }
            float total = expf(sink - top);
            for (long j = 0; j < length; j++) total += (s[j] = expf(s[j] - top));
            memset(o, 0, sizeof(float) * d);
            for (long j = 0; j < length; j++) add_value(o, s[j] / total, v_cache, base + j * d, d, elem);
        }
    }
    return 0;
}
