// Dots of K-quant rows (GGUF's Q4_K, Q5_K, Q6_K; layouts in kquant_dot.h) against activations quantized
// to int8, the expert kernel's int8-activation path (experts_cpu.c, `--moe-cpu-int8-act`).
#ifndef FT_KQUANT_DOT_INT8_H
#define FT_KQUANT_DOT_INT8_H
#include <stdint.h>

#include "kquant_dot.h"

// KQ_PREFETCH: bytes ahead the int8 K-quant dots prefetch (0: none), KQ_PREFETCH_HINT the prefetch's
// locality (0: non-temporal, 1-3: into L3 / L2 / L1 as well). A core's misses in flight bound these dots
// at batch 1: 2,048 bytes ahead lifted Q4_K from 0.71 to 0.76 x the read at 16 threads on a 16-core Xeon
// and from 0.85 to 0.91 x at 2 threads on a 2-core AMD host; asking for the lines into L2 (hint 2) instead
// of non-temporally, on a 16-core Xeon: 0.72 -> 0.83 x at 16 threads, 0.75 -> 0.94 x at 8 (hint 3: 0.81 /
// 0.99), the 2-core AMD host alike (0.99 / 1.01 x) (benchmarks/cpu_kernel_sweep.py --codec). Asking for
// each line once instead of every 64 bytes from each block's start was slower on both (0.65 / 0.92 x).
#ifndef KQ_PREFETCH
#define KQ_PREFETCH 2048
#endif
#ifndef KQ_PREFETCH_HINT
#define KQ_PREFETCH_HINT 2
#endif
#if KQ_PREFETCH > 0
#define KQ_PREFETCH_BLOCK(p, bytes) \
    for (int line_ = 0; line_ < (bytes); line_ += 64) __builtin_prefetch((const uint8_t *)(p) + KQ_PREFETCH + line_, 0, KQ_PREFETCH_HINT)
#else
#define KQ_PREFETCH_BLOCK(p, bytes) ((void)0)
#endif

// Against activations quantized to int8 in blocks of 256 (quantize_q8 at act8_block: xq values, one scale xd
// per super-block, xs int16 sums per 16), llama.cpp's Q8_K scheme: a super-block's products are summed in
// int32, the sub-block scales applied as 16-bit integers (maddubs of unsigned quants by the signed
// activations, then madd by the scale, spread over the lanes by a byte shuffle), Q4_K's mins and Q6_K's
// offset of 32 taken from the activation sums by one madd, and one fp32 multiply per super-block.
#if defined(__AVX2__)
// A shuffle control giving every 16-bit lane of a 128-bit lane that lane's 16-bit word k (k < 8).
static inline __m256i spread16(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)(((2 * hi + 1) << 8) | (2 * hi))),
                            _mm_set1_epi16((short)(((2 * lo + 1) << 8) | (2 * lo))));
}

// A Q4_K / Q5_K super-block's eight scales and eight mins as 16-bit lanes (returned); adds dmin·dx times
// its mins' products with the activation sums (bs16: the super-block's sixteen sums of 16) to `acc_m`.
static inline __m256i q45_k_q8_scales(const uint8_t *blk, const int16_t *bs16, float dx, __m256 *acc_m) {
    uint8_t scm[16];  // the eight scales, then the eight mins
    q4_k_scales(blk + 4, scm, scm + 8);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)scm);
    const __m256i sm = _mm256_cvtepu8_epi16(bytes);
    const __m256i bs = _mm256_loadu_si256((const __m256i *)bs16);
    const __m256i mins2 = _mm256_cvtepu8_epi16(  // each min twice: m0 m0 m1 m1 ... m7 m7
        _mm_shuffle_epi8(bytes, _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8)));
    *acc_m = _mm256_fmadd_ps(_mm256_set1_ps(fp16_at(blk + 2) * dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(mins2, bs)), *acc_m);
    return sm;
}
#endif

#if defined(__AVX512BW__)
// The constants of q45_k_q8_block: a chunk's scales spread over its lanes, its fifth bits' shifts.
typedef struct {
    __m512i spread[4], bit_shift[4];  // chunk j: scales 2j below, 2j + 1 above
} q45_k_q8_consts;

static inline q45_k_q8_consts q45_k_q8_make_consts(void) {
    q45_k_q8_consts c;
    for (int j = 0; j < 4; j++) {
        c.spread[j] = _mm512_inserti64x4(_mm512_castsi256_si512(spread16(2 * j, 2 * j)), spread16(2 * j + 1, 2 * j + 1), 1);
        c.bit_shift[j] = _mm512_set_epi64(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j, 2 * j, 2 * j, 2 * j);
    }
    return c;
}

// Super-block b of a Q4_K / Q5_K row against the int8 activations: its scaled integer sum into *acc, its
// mins' products into *acc_m (dot_q45_k_q8's loop body; the two-row form runs it on both rows).
static inline void q45_k_q8_block(const uint8_t *restrict w, int high, int b, const int8_t *restrict xq,
                                  const float *restrict xd, const int16_t *restrict xs,
                                  const q45_k_q8_consts *c, __m512 *acc, __m256 *acc_m) {
    const long bytes = high ? Q5_K_BYTES : Q4_K_BYTES;
    const __m512i low4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    const __m512i nibble_shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const uint8_t *blk = w + (long)b * bytes, *qh = blk + 16, *qs = blk + (high ? 48 : 16);
    const int8_t *a = xq + (long)b * QK_K;
    KQ_PREFETCH_BLOCK(blk, bytes);
    const float d = fp16_at(blk), dx = xd[b];
    const __m256i sm = q45_k_q8_scales(blk, xs + (long)b * (QK_K / SUM_BLOCK), dx, acc_m);
    const __m512i scales = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sm));
    const __m512i hbits = high ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh)) : _mm512_setzero_si512();
    __m512i sumi = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
        __m512i q = _mm512_and_si512(_mm512_srlv_epi64(raw, nibble_shift), low4);
        if (high) q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(hbits, c->bit_shift[j]), one), 4));
        const __m512i pairs = _mm512_maddubs_epi16(q, _mm512_loadu_si512((const void *)(a + 64 * j)));
#if defined(__AVX512VNNI__)
        sumi = _mm512_dpwssd_epi32(sumi, pairs, _mm512_shuffle_epi8(scales, c->spread[j]));
#else
        sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(pairs, _mm512_shuffle_epi8(scales, c->spread[j])));
#endif
    }
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(d * dx), _mm512_cvtepi32_ps(sumi), *acc);
}
#endif

// Q4_K (`high` 0) and Q5_K (`high` 1) against int8 activations. With AVX-512BW a chunk's 64 weights are
// one register (its 32 bytes in both halves, the upper half shifted right by four: low nibbles below, high
// above, in the order of the chunk's 64 activations), so one maddubs and one madd take what AVX2 takes in
// two of each; the integer sums are the same.
static inline float dot_q45_k_q8(const uint8_t *restrict w, int high, const int8_t *restrict xq,
                                 const float *restrict xd, const int16_t *restrict xs, int n) {
#if defined(__AVX512BW__)
    const q45_k_q8_consts c = q45_k_q8_make_consts();
    __m512 acc = _mm512_setzero_ps();
    __m256 acc_m = _mm256_setzero_ps();
    for (int b = 0; b < n / QK_K; b++) q45_k_q8_block(w, high, b, xq, xd, xs, &c, &acc, &acc_m);
    return _mm512_reduce_add_ps(acc) - hsum256(acc_m);
#elif defined(__AVX2__)
    const long bytes = high ? Q5_K_BYTES : Q4_K_BYTES;
    __m256 acc = _mm256_setzero_ps();
    __m256 acc_m = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * bytes, *qh = blk + 16, *qs = blk + (high ? 48 : 16);
        const int8_t *a = xq + (long)b * QK_K;
        KQ_PREFETCH_BLOCK(blk, bytes);
        const float d = fp16_at(blk), dx = xd[b];
        const __m256i sm = q45_k_q8_scales(blk, xs + (long)b * (QK_K / SUM_BLOCK), dx, &acc_m);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
        const __m256i hbits = high ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high), 32 weights each
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i q0 = _mm256_and_si256(q, low4), q1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if (high) {
                q0 = _mm256_or_si256(q0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4));
                q1 = _mm256_or_si256(q1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4));
            }
            const __m256i p0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q0, _mm256_loadu_si256((const __m256i *)(a + 64 * j))),
                _mm256_shuffle_epi8(scales, spread16(2 * j, 2 * j)));
            const __m256i p1 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q1, _mm256_loadu_si256((const __m256i *)(a + 64 * j + 32))),
                _mm256_shuffle_epi8(scales, spread16(2 * j + 1, 2 * j + 1)));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum256(acc) - hsum256(acc_m);
#else
    const long bytes = high ? Q5_K_BYTES : Q4_K_BYTES;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * bytes, *qh = blk + 16, *qs = blk + (high ? 48 : 16);
        const int8_t *a = xq + (long)b * QK_K;
        const int16_t *bs = xs + (long)b * (QK_K / SUM_BLOCK);
        const float d = fp16_at(blk), dmin = fp16_at(blk + 2), dx = xd[b];
        uint8_t sc[8], mn[8];
        q4_k_scales(blk + 4, sc, mn);
        int32_t sumi = 0, msum = 0;
        for (int k = 0; k < 8; k++) msum += mn[k] * (bs[2 * k] + bs[2 * k + 1]);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int q0 = qs[32 * j + l] & 15, q1 = qs[32 * j + l] >> 4;
                if (high) q0 |= ((qh[l] >> (2 * j)) & 1) << 4, q1 |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                sumi += sc[2 * j] * q0 * a[64 * j + l] + sc[2 * j + 1] * q1 * a[64 * j + 32 + l];
            }
        s += d * dx * (float)sumi - dmin * dx * (float)msum;
    }
    return s;
#endif
}

// Two rows against one int8 vector: each row's sum exactly as dot_q45_k_q8 gives it (the same super-blocks in
// the same order), the rows' super-blocks interleaved so that a thread keeps two streams and two chains of
// sums in flight (AVX-512; elsewhere two calls).
static inline void dot2_q45_k_q8(const uint8_t *restrict w0, const uint8_t *restrict w1, int high,
                                 const int8_t *restrict xq, const float *restrict xd,
                                 const int16_t *restrict xs, int n, float *out0, float *out1) {
#if defined(__AVX512BW__)
    const q45_k_q8_consts c = q45_k_q8_make_consts();
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m256 acc_m0 = _mm256_setzero_ps(), acc_m1 = _mm256_setzero_ps();
    for (int b = 0; b < n / QK_K; b++) {
        q45_k_q8_block(w0, high, b, xq, xd, xs, &c, &acc0, &acc_m0);
        q45_k_q8_block(w1, high, b, xq, xd, xs, &c, &acc1, &acc_m1);
    }
    *out0 = _mm512_reduce_add_ps(acc0) - hsum256(acc_m0);
    *out1 = _mm512_reduce_add_ps(acc1) - hsum256(acc_m1);
#else
    *out0 = dot_q45_k_q8(w0, high, xq, xd, xs, n);
    *out1 = dot_q45_k_q8(w1, high, xq, xd, xs, n);
#endif
}

static inline float dot_q6_k_q8(const uint8_t *restrict w, const int8_t *restrict xq, const float *restrict xd,
                                const int16_t *restrict xs, int n) {
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps(), acc_b = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3);
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q6_K_BYTES;
        const int8_t *a = xq + (long)b * QK_K;
        KQ_PREFETCH_BLOCK(blk, Q6_K_BYTES);
        const float d = fp16_at(blk + 208), dx = xd[b];
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));  // 16 scales
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(xs + (long)b * (QK_K / SUM_BLOCK)));
        // the quants' offset of 32, times each sub-block's scale and activation sum
        acc_b = _mm256_fmadd_ps(_mm256_set1_ps(32.0f * d * dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(sc, bs)), acc_b);
        __m256i sumi = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {  // 128 weights: four runs of 32, each two sub-blocks of 16
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const int8_t *ah = a + 128 * half;
            const __m256i sh = _mm256_broadcastsi128_si256(half ? _mm256_extracti128_si256(sc, 1)
                                                                : _mm256_castsi256_si128(sc));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
            __m256i q[4];  // unsigned 6-bit quants, 0..63
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(hb, low2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), low2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), low2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), low2), 4));
            for (int g = 0; g < 4; g++) {  // bytes 0-15 (the 128-bit low lane) are sub-block 2g, 16-31 2g + 1
                const __m256i p = _mm256_maddubs_epi16(q[g], _mm256_loadu_si256((const __m256i *)(ah + 32 * g)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_shuffle_epi8(sh, spread16(2 * g, 2 * g + 1))));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum256(_mm256_sub_ps(acc, acc_b));
#else
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = w + (long)b * Q6_K_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192), *a = xq + (long)b * QK_K;
        const int16_t *bs = xs + (long)b * (QK_K / SUM_BLOCK);
        const float d = fp16_at(blk + 208), dx = xd[b];
        int32_t sumi = 0, bias = 0;
        for (int k = 0; k < 16; k++) bias += sc[k] * bs[k];
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const int8_t *sh = sc + 8 * half, *ah = a + 128 * half;
            for (int g = 0; g < 4; g++) {
                const int shift = 2 * g, lo = g & 1 ? 32 : 0, nib = g >= 2 ? 4 : 0;
                for (int l = 0; l < 32; l++) {
                    const int v = ((ql[l + lo] >> nib) & 15) | (((qh[l] >> shift) & 3) << 4);
                    sumi += sh[2 * g + l / 16] * v * ah[32 * g + l];
                }
            }
        }
        s += d * dx * (float)(sumi - 32 * bias);
    }
    return s;
#endif
}

#endif
