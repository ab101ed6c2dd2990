// SwiGLU experts over weights as the pool stores them (bf16, or Q8_0 blocks against int8-quantized
// activations: quant_dot.h) at memory bandwidth, fp32 accumulation, OpenMP threads.
//
// One call computes one MoE layer step for the (token, expert) pairs routed to the CPU:
//   a[n, i] = w[n] * silu(gate_e[i] . x[t]) * (up_e[i] . x[t])       i < I, pair n = (token t, expert e)
//     (or another experts' function, with gate/up biases: expert_fn.h)
//   out[t, h] = sum over the pairs n of token t of down_e[h] . a[n]  h < H
// The weights are cut into units of contiguous rows (call_unit_bytes), which the threads take one
// at a time from a shared counter, in a fixed order:
//   G(e, c): rows [c·g, (c+1)·g) of gate_e, then the same rows of up_e, and their activations;
//   D(e, c): rows [c·d, (c+1)·d) of down_e, into y[n, h] for each pair n of expert e.
//   order: G(0) | G(1) D(0) | G(2) D(1) | ... | G(E-1) D(E-2) | D(E-1)
// A thread the host slows down takes fewer units instead of holding up a barrier. A D unit waits for
// the G units of its expert; those were all taken before it by threads that never wait, so a wait is
// short and cannot deadlock. The D unit that ends a row chunk's last expert writes that chunk of
// out[t] = sum of y[n] over t's pairs (SUM_AFTER_BARRIER: all of it after a barrier instead), so the
// call's only join is its threads'. Each weight row is read once per call whatever the number of pairs.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_dot.h"
#include "expert_fn.h"
#include "row_dots.h"
#include "spin_team.h"
#include "widen_row.h"

// Bytes of weights per unit of work: small enough that the threads finish within a unit of each other,
// large enough that the counter is touched rarely and the hardware prefetcher stays on its stream. A
// call's unit is its weight bytes over UNITS_PER_THREAD units a thread, within [UNIT_MIN, UNIT_MAX]
// (a Q4_K layer of Qwen3-30B-A3B at batch 1: 21 MB, 64 KiB units at 16 threads, 530 KiB at 2; bf16:
// 75 MB, 240 KiB at 16), unless the build fixes UNIT_BYTES (benchmarks/cpu_kernel_sweep.py).
#ifndef UNITS_PER_THREAD
#define UNITS_PER_THREAD 20
#endif
#define UNIT_MIN (64L << 10)
#define UNIT_MAX (1L << 20)

// SUM_AFTER_BARRIER 1: the sum over pairs after a barrier, split over the threads by rows of 256 (the
// earlier kernel, kept for A/B in benchmarks/cpu_kernel_sweep.py); 0: per row chunk, by the down unit that
// ends the chunk's last expert. The same additions in the same order either way.
#ifndef SUM_AFTER_BARRIER
#define SUM_AFTER_BARRIER 0
#endif

static long call_unit_bytes(long weight_bytes, int threads) {
#ifdef UNIT_BYTES
    (void)weight_bytes, (void)threads;
    return UNIT_BYTES;
#else
    const long unit = weight_bytes / ((long)(threads > 0 ? threads : 1) * UNITS_PER_THREAD);
    return unit < UNIT_MIN ? UNIT_MIN : unit > UNIT_MAX ? UNIT_MAX : unit;
#endif
}

// Pairs grouped by expert, experts ascending (a counting sort over the bank's experts).
typedef struct {
    int n_experts;      // experts with at least one pair
    int32_t *expert;    // [n_experts]
    int32_t *offsets;   // [n_experts + 1]: pairs of expert[e] are offsets[e] .. offsets[e+1]
    int32_t *tok;       // [pairs] token row of each pair
    float *weight;      // [pairs] routing weight of each pair
} plan_t;

static int make_plan(const int64_t *ids, const float *weights, int pairs_in, int top_k, int bank_experts,
                     plan_t *p, int32_t *buf) {
    int32_t *count = buf;  // [bank_experts + 1]
    memset(count, 0, sizeof(int32_t) * (bank_experts + 1));
    for (int j = 0; j < pairs_in; j++)
        if (ids[j] >= 0 && ids[j] < bank_experts) count[ids[j] + 1]++;
    p->expert = count + bank_experts + 1;
    p->n_experts = 0;
    for (int e = 0; e < bank_experts; e++)
        if (count[e + 1]) p->expert[p->n_experts++] = e;
    for (int e = 0; e < bank_experts; e++) count[e + 1] += count[e];  // count[e]: first pair of e
    p->offsets = p->expert + p->n_experts;
    for (int k = 0; k < p->n_experts; k++) p->offsets[k] = count[p->expert[k]];
    p->offsets[p->n_experts] = count[bank_experts];
    p->tok = p->offsets + p->n_experts + 1;
    p->weight = (float *)(p->tok + pairs_in);
    for (int j = 0; j < pairs_in; j++) {  // stable: pairs of an expert keep token order
        if (ids[j] < 0 || ids[j] >= bank_experts) continue;
        const int slot = count[ids[j]]++;
        p->tok[slot] = j / top_k;
        p->weight[slot] = weights[j];
    }
    return p->offsets[p->n_experts];
}

typedef struct {
    int g_rows, d_rows, g_units, d_units;
} units_t;

// Unit u of the fixed order -> expert k and chunk c; returns 1 for a D unit, 0 for a G unit.
static inline int unit_at(const units_t *s, int n_experts, long u, int *k, int *c) {
    if (u < s->g_units) {
        *k = 0, *c = (int)u;
        return 0;
    }
    const long block = s->g_units + s->d_units, v = u - s->g_units;
    const int b = (int)(v / block) + 1, r = (int)(v % block);
    if (b < n_experts && r < s->g_units) {
        *k = b, *c = r;
        return 0;
    }
    *k = b - 1, *c = b < n_experts ? r - s->g_units : r;
    return 1;
}

// The row widening of the prompt path, for tests: `rows` rows of `codec` (n weights each) as bf16 into out,
// straight (plain 0) or dequantised then rounded (plain 1). Returns 1 if the straight way ran, 0 if the
// plain one did, -1 where this build has no bf16 widening (no AVX512-BF16) or the codec is not widened.
int ft_widen_rows_bf16(int codec, const uint8_t *rows, uint16_t *out, int n_rows, int n, int plain) {
#if HAVE_KQUANT_BF16
    if (!widened_codec(codec)) return -1;
    float *buf = malloc(sizeof(float) * (size_t)n);
    if (!buf) return -1;
    const long bytes = codec_row_bytes(codec, n);
    int straight = 0;
    for (int r = 0; r < n_rows; r++) straight = widen_bf16(codec, rows + r * bytes, buf, out + (long)r * n, n, plain);
    free(buf);
    return straight;
#else
    (void)codec, (void)rows, (void)out, (void)n_rows, (void)n, (void)plain;
    return -1;
#endif
}

// out[t, h0:h1] = Σ over the pairs n of token t, in order, of y[n, h0:h1] (0 for a token with none); tok: [pairs]
static void sum_pairs(float *out, const float *y, const int32_t *tok, int pairs, int tokens, long hidden, int h0,
                      int h1) {
    for (int t = 0; t < tokens; t++) memset(out + t * hidden + h0, 0, sizeof(float) * (h1 - h0));
    for (int n = 0; n < pairs; n++) {
        float *o = out + tok[n] * hidden;
        const float *yn = y + n * hidden;
        for (int h = h0; h < h1; h++) o[h] += yn[h];
    }
}

// What the threads of one ft_moe call share (moe_units' arguments).
typedef struct {
    const void *gate_up, *down;
    int gu_codec, dn_codec, hidden, inter, tokens, pairs, ne, dq8, db, dq, gfs, dfs, dkb;
    long gu_row, dn_row, total, act_q_bytes, widest, rowbuf_floats;
    double t0;
    plan_t p;
    units_t s;
    long *next;
    int *done, *chunk_done;
    float *act, *y, *xs;
    int8_t *xq;
    uint16_t *xb;
    float *xd;
    int16_t *xsum;
    float *xfs;
    uint16_t *xkb;
    int *xkb_ok;
    uint8_t *act_q;
    float *rowbufs, *act_fs;
    uint16_t *act_b;
    float *out;
    double *trace;
    const ft_expert_fn *fn;
} moe_call;

// One thread's share of an ft_moe call (tid 0 .. threads - 1): units from the shared counter until none is left.
static void moe_units(void *arg, int tid) {
    const moe_call *call = arg;
    const void *const gate_up = call->gate_up, *const down = call->down;
    const int gu_codec = call->gu_codec, dn_codec = call->dn_codec, hidden = call->hidden,
        inter = call->inter, tokens = call->tokens, pairs = call->pairs, ne = call->ne, dq8 = call->dq8,
        db = call->db, dq = call->dq, gfs = call->gfs, dfs = call->dfs, dkb = call->dkb;
    const long gu_row = call->gu_row, dn_row = call->dn_row, total = call->total,
        act_q_bytes = call->act_q_bytes, widest = call->widest, rowbuf_floats = call->rowbuf_floats;
    const double t0 = call->t0;
    const plan_t p = call->p;
    const units_t s = call->s;
    long *const next = call->next;
    int *const done = call->done, *const chunk_done = call->chunk_done;
    float *const act = call->act, *const y = call->y, *const xs = call->xs;
    int8_t *const xq = call->xq;
    uint16_t *const xb = call->xb;
    float *const xd = call->xd;
    int16_t *const xsum = call->xsum;
    float *const xfs = call->xfs;
    uint16_t *const xkb = call->xkb;
    int *const xkb_ok = call->xkb_ok;
    uint8_t *const act_q = call->act_q;
    float *const rowbufs = call->rowbufs, *const act_fs = call->act_fs;
    uint16_t *const act_b = call->act_b;
    float *const out = call->out;
    double *const trace = call->trace;
    const ft_expert_fn *const fn = call->fn;
    double first = -1.0, waited = 0.0;
    long mine = 0;
    int8_t *aq = dq8 ? (int8_t *)(act_q + tid * act_q_bytes) : NULL;  // [GROUP, I]
    float *rowbuf = rowbufs ? rowbufs + tid * rowbuf_floats : NULL;  // [max(H, I)]
    uint16_t *rowbuf16 = rowbuf ? (uint16_t *)(rowbuf + widest) : NULL;
    float *ad = dq8 ? (float *)(aq + GROUP * (long)inter) : NULL;                      // [GROUP, I / 32]
    int16_t *as = dq8 ? (int16_t *)(ad + GROUP * (long)(inter / Q8_BLOCK)) : NULL;     // [GROUP, I / 16]
    float *afs = dfs ? act_fs + (long)tid * GROUP * (inter / 32) : NULL;  // [GROUP, I / 32]
    uint16_t *ab = act_b ? act_b + (long)tid * GROUP * inter : NULL;   // [GROUP, I]
    vecs_t v;
    for (;;) {
        const long u = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (u >= total) break;
        if (trace && first < 0) first = omp_get_wtime() - t0;
        mine++;
        int k, c;
        const int is_down = unit_at(&s, ne, u, &k, &c);
        const int n0 = p.offsets[k], n1 = p.offsets[k + 1];
        if (!is_down) {  // G(k, c)
            const uint8_t *gu = (const uint8_t *)gate_up + (long)p.expert[k] * 2 * inter * gu_row;
            const int i0 = c * s.g_rows, i1 = i0 + s.g_rows < inter ? i0 + s.g_rows : inter;
            for (int n = n0; n < n1; n += GROUP) {  // a group of pairs, rows from L1 after the first
                const int cnt = n1 - n < GROUP ? n1 - n : GROUP;
                float d[GROUP];
                for (int j = 0; j < cnt; j++) {
                    const long t = p.tok[n + j];
                    v.f[j] = xs + t * hidden;
                    v.b[j] = xb + t * hidden;
                    v.q[j] = xq + t * hidden;
                    v.d[j] = xd + t * (hidden / Q8_BLOCK);
                    v.s[j] = xsum + t * (hidden / SUM_BLOCK);
                    v.fs[j] = gfs ? xfs + t * (hidden / 32) : NULL;
                    v.kb[j] = xkb && xkb_ok[t] ? xkb + t * hidden : NULL;
                }
                const int paired = paired_rows(gu_codec, cnt);  // gate row i beside up row i
                if (!paired)  // the gate rows first, then the up rows
                    for (int i = i0; i < i1; i++) {
                        dots(gu_codec, gu + i * gu_row, &v, cnt, hidden, d, rowbuf, rowbuf16);
                        const long at = dq ? i : split_at(i, inter);
                        for (int j = 0; j < cnt; j++) act[(n + j) * (long)inter + at] = d[j];
                    }
                for (int i = i0; i < i1; i++) {
                    float up[GROUP];
                    const long at = dq ? i : split_at(i, inter);
                    if (paired) {
                        dots2(gu_codec, gu + i * gu_row, gu + (inter + i) * gu_row, &v, cnt, hidden, d, up,
                              rowbuf, rowbuf16);
                        for (int j = 0; j < cnt; j++) act[(n + j) * (long)inter + at] = d[j];
                    } else
                        dots(gu_codec, gu + (inter + i) * gu_row, &v, cnt, hidden, up, rowbuf, rowbuf16);
                    for (int j = 0; j < cnt; j++) {
                        float *a = act + (n + j) * (long)inter + at;
                        *a = p.weight[n + j] * expert_glu(fn, p.expert[k], inter, i, *a, up[j]);
                        if (dkb && v.kb[j]) *a = round_elem(*a, 2);  // a bf16 model's: see act_b
                    }
                }
            }
            __atomic_fetch_add(&done[16 * k], 1, __ATOMIC_RELEASE);
        } else {  // D(k, c)
            if (__atomic_load_n(&done[16 * k], __ATOMIC_ACQUIRE) < s.g_units) {
                const double w0 = trace ? omp_get_wtime() : 0.0;
                while (__atomic_load_n(&done[16 * k], __ATOMIC_ACQUIRE) < s.g_units) ft_relax();
                if (trace) waited += omp_get_wtime() - w0;
            }
            const uint8_t *dn = (const uint8_t *)down + (long)p.expert[k] * hidden * dn_row;
            const int h0 = c * s.d_rows, h1 = h0 + s.d_rows < hidden ? h0 + s.d_rows : hidden;
            for (int n = n0; n < n1; n += GROUP) {
                const int cnt = n1 - n < GROUP ? n1 - n : GROUP;
                float d[GROUP];
                for (int j = 0; j < cnt; j++) {
                    v.f[j] = act + (long)(n + j) * inter;
                    v.kb[j] = NULL;  // the activations between the projections stay fp32, unless rounded
                    if (db || (dkb && xkb_ok[p.tok[n + j]])) {
                        uint16_t *b16 = ab + (long)j * inter;
                        round_row_bf16(v.f[j], b16, inter);  // exact where G rounded them (dkb)
                        v.b[j] = b16, v.kb[j] = db ? NULL : b16;
                    }
                    if (dfs) {
                        v.fs[j] = afs + (long)j * (inter / 32);
                        sums32(v.f[j], (float *)v.fs[j], inter);
                    }
                    if (dq8) {
                        const long blocks = inter / Q8_BLOCK, sums = inter / SUM_BLOCK;
                        v.q[j] = aq + (long)j * inter, v.d[j] = ad + j * blocks, v.s[j] = as + j * sums;
                        quantize_q8(v.f[j], (int8_t *)v.q[j], (float *)v.d[j], (int16_t *)v.s[j], inter,
                                    act8_block(dn_codec));
                    }
                }
                int h = h0;
                for (; h + 1 < h1 && paired_rows(dn_codec, cnt); h += 2) {
                    float d1[GROUP];
                    dots2(dn_codec, dn + h * dn_row, dn + (h + 1) * dn_row, &v, cnt, inter, d, d1, rowbuf,
                          rowbuf16);
                    for (int j = 0; j < cnt; j++) {
                        y[(long)(n + j) * hidden + h] = d[j];
                        y[(long)(n + j) * hidden + h + 1] = d1[j];
                    }
                }
                for (; h < h1; h++) {
                    dots(dn_codec, dn + h * dn_row, &v, cnt, inter, d, rowbuf, rowbuf16);
                    for (int j = 0; j < cnt; j++) y[(long)(n + j) * hidden + h] = d[j];
                }
            }
            // the release of every expert's rows of this chunk meets the acquire of the last one's
            if (!SUM_AFTER_BARRIER && __atomic_add_fetch(&chunk_done[16 * c], 1, __ATOMIC_ACQ_REL) == ne)
                sum_pairs(out, y, p.tok, pairs, tokens, hidden, h0, h1);
        }
    }
    if (trace) {
        double *row = trace + 4L * tid;
        row[0] = first, row[1] = omp_get_wtime() - t0, row[2] = waited, row[3] = (double)mine;
    }
}

// gate_up: [bank_experts, 2I, H] in gu_codec (gate rows, then up rows); down: [bank_experts, H, I] in
// dn_codec (rows as the codec stores them: codec_row_bytes apart); x: [T, H] fp32; ids, weights:
// [T, top_k] (ids -1 for pairs another branch computes); out: [T, H] fp32, written; scratch: at least
// T·top_k·(I + H) + T·H fp32; unit_bytes: the size of a unit (0: call_unit_bytes); trace: NULL, or
// [threads + 1, 4] doubles: per thread, seconds from the call's start to its first unit and after its last,
// seconds spent waiting, units done; then seconds from the call's start to the threads joined and to its
// end, and two zeros; fn: the experts' function and gate/up biases (NULL: SiLU, none).
// Returns the number of pairs computed; -1 out of memory, -2 a codec
// this build does not know or a row that is not whole blocks.
// team: the threads to run on (spin_team.h), or NULL for an OpenMP team of the calling thread.
static int moe_run(ft_team *team, const void *gate_up, int gu_codec, const void *down, int dn_codec,
                   int bank_experts, int hidden, int inter, const float *restrict x, const int64_t *ids,
                   const float *weights, int tokens, int top_k, float *scratch, float *out, int threads,
                   long unit_bytes, double *trace, const ft_expert_fn *fn) {
    const double t0 = trace ? omp_get_wtime() : 0.0;  // the call's start: the trace's times count from it
    if (trace) memset(trace, 0, sizeof(double) * 4 * (size_t)threads);  // a tid no thread took stays zero
    const int gq8 = codec_act8(gu_codec), dq8 = codec_act8(dn_codec);  // against int8 activation blocks
    const int gb = gu_codec == FT_CODEC_BF16_ACT16, db = dn_codec == FT_CODEC_BF16_ACT16;  // against bf16
    const int gq = gu_codec != FT_CODEC_BF16, dq = dn_codec != FT_CODEC_BF16;  // activations in natural order
    // weight-only Q4_K/Q5_K take the activations' sums per 32 for their mins
    const int gfs = gu_codec == FT_CODEC_Q4_K || gu_codec == FT_CODEC_Q5_K;
    const int dfs = dn_codec == FT_CODEC_Q4_K || dn_codec == FT_CODEC_Q5_K;
    int g_block, d_block, unused;
    codec_block(gu_codec, &g_block, &unused);
    codec_block(dn_codec, &d_block, &unused);
    if (!g_block || !d_block || hidden % g_block || inter % d_block) return -2;
    const int pairs_in = tokens * top_k;
    int32_t *buf = malloc(sizeof(int32_t) * (3L * bank_experts + 3 + 2L * pairs_in));  // make_plan's arrays
    if (!buf) return -1;
    plan_t p;
    const int pairs = make_plan(ids, weights, pairs_in, top_k, bank_experts, &p, buf);
    const int ne = p.n_experts;
    const long gu_row = codec_row_bytes(gu_codec, hidden), dn_row = codec_row_bytes(dn_codec, inter);
    float *act = scratch;                         // [pairs, I]: gate values, then activations (split for bf16)
    float *y = act + (long)pairs * inter;          // [pairs, H]: each pair's down projection
    float *xs = y + (long)pairs * hidden;  // [T, H]: x split (bf16); int8 [T, H], scales [T, H/32], sums [T, H/16]
    int8_t *xq = (int8_t *)xs;
    uint16_t *xb = (uint16_t *)xs;  // [T, H] bf16 (BF16_ACT16)
    float *xd = (float *)(xq + (long)tokens * hidden);
    int16_t *xsum = (int16_t *)(xd + (long)tokens * (hidden / Q8_BLOCK));  // [T, H / 16]
    float *xfs = gfs ? malloc(sizeof(float) * (size_t)tokens * (hidden / 32)) : NULL;  // [T, H / 32]
    // [T, H] bf16 and [T] flags: the rows of x that are bf16 values, for the bf16 pair-dot paths
    const int gkb = HAVE_KQUANT_BF16 && widened_codec(gu_codec);
    uint16_t *xkb = gkb ? malloc(sizeof(uint16_t) * (size_t)tokens * hidden) : NULL;
    int *xkb_ok = xkb ? malloc(sizeof(int) * (size_t)tokens) : NULL;
    if ((gfs && !xfs) || (gkb && (!xkb || !xkb_ok))) {
        free(xfs), free(xkb), free(xkb_ok), free(buf);
        return -1;
    }
#pragma omp parallel for num_threads(threads) if (tokens > 16)
    for (int t = 0; t < tokens; t++) {
        if (gb)
            round_row_bf16(x + (long)t * hidden, xb + (long)t * hidden, hidden);
        else if (gq8)
            quantize_q8(x + (long)t * hidden, xq + (long)t * hidden, xd + (long)t * (hidden / Q8_BLOCK),
                        xsum + (long)t * (hidden / SUM_BLOCK), hidden, act8_block(gu_codec));
        else if (gq)
            memcpy(xs + (long)t * hidden, x + (long)t * hidden, sizeof(float) * hidden);
        else
            split_row(x + (long)t * hidden, xs + (long)t * hidden, hidden);
        if (gfs) sums32(x + (long)t * hidden, xfs + (long)t * (hidden / 32), hidden);
        if (xkb) xkb_ok[t] = exact_bf16_row(x + (long)t * hidden, xkb + (long)t * hidden, hidden);
    }
    units_t s;
    if (unit_bytes <= 0)
        unit_bytes = call_unit_bytes((long)ne * (2L * inter * gu_row + hidden * dn_row), threads);
    s.g_rows = unit_bytes / (2L * gu_row) > 0 ? (int)(unit_bytes / (2L * gu_row)) : 1;
    s.d_rows = unit_bytes / dn_row > 0 ? (int)(unit_bytes / dn_row) : 1;
    s.g_units = (inter + s.g_rows - 1) / s.g_rows;
    s.d_units = (hidden + s.d_rows - 1) / s.d_rows;
    const long total = (long)ne * (s.g_units + s.d_units);
    long next = 0;                                // the shared counter
    int *done = calloc((size_t)(ne > 0 ? ne : 1) * 16, sizeof(int));  // G units finished, a line each
    // per row chunk of down (D units' rows): D units finished, a line each; the one that finishes the chunk's
    // last sums the chunk's rows over pairs into out, so no barrier sits between the units and the sum
    int *chunk_done = calloc((size_t)s.d_units * 16, sizeof(int));
    // per thread: a group of pairs' activations quantized for a Q8_0 down bank
    const long act_q_bytes = dq8 ? GROUP * (inter + inter / Q8_BLOCK * 4L + inter / SUM_BLOCK * 4L) : 0;
    uint8_t *act_q = dq8 ? malloc((size_t)threads * act_q_bytes) : NULL;
    const long widest = hidden > inter ? hidden : inter;  // per thread: a quantized row widened to fp32
    const long rowbuf_floats = widest + (widest + 1) / 2;  // per thread: a row in fp32, then in bf16
    float *rowbufs = gq || dq ? malloc(sizeof(float) * threads * rowbuf_floats) : NULL;
    float *act_fs = dfs ? malloc(sizeof(float) * threads * GROUP * (inter / 32)) : NULL;  // per thread
    // a bf16 model's weighted activations (a pair whose x is a bf16 row) rounded to bf16 where both codecs
    // widen, as its own experts and bf16 banks (db) round them: its down rows then take the bf16 pair-dot
    // paths (cpu_experts.bf16_act_reference states it)
    const int dkb = gkb && widened_codec(dn_codec);
    uint16_t *act_b = db || dkb ? malloc(sizeof(uint16_t) * threads * GROUP * (long)inter) : NULL;  // per thread
    if (!done || !chunk_done || (dq8 && !act_q) || ((gq || dq) && !rowbufs) || (dfs && !act_fs) || ((db || dkb) && !act_b)) {
        free(done), free(chunk_done), free(act_q), free(rowbufs), free(act_fs), free(act_b), free(xfs), free(xkb), free(xkb_ok);
        free(buf);
        return -1;
    }
    moe_call call = { .gate_up = gate_up, .down = down, .gu_codec = gu_codec, .dn_codec = dn_codec,
        .hidden = hidden, .inter = inter, .tokens = tokens, .pairs = pairs, .ne = ne, .dq8 = dq8, .db = db,
        .dq = dq, .gfs = gfs, .dfs = dfs, .dkb = dkb, .gu_row = gu_row, .dn_row = dn_row, .total = total,
        .act_q_bytes = act_q_bytes, .widest = widest, .rowbuf_floats = rowbuf_floats, .t0 = t0, .p = p,
        .s = s, .next = &next, .done = done, .chunk_done = chunk_done, .act = act, .y = y, .xs = xs,
        .xq = xq, .xb = xb, .xd = xd, .xsum = xsum, .xfs = xfs, .xkb = xkb, .xkb_ok = xkb_ok, .act_q = act_q,
        .rowbufs = rowbufs, .act_fs = act_fs, .act_b = act_b, .out = out, .trace = trace, .fn = fn};
    if (team && !SUM_AFTER_BARRIER)
        ft_team_run(team, threads, moe_units, &call);
    else
#pragma omp parallel num_threads(threads)
    {
        moe_units(&call, omp_get_thread_num());
#if SUM_AFTER_BARRIER
#pragma omp barrier
#pragma omp for schedule(static)
        for (int h0 = 0; h0 < hidden; h0 += 256)
            if (ne) sum_pairs(out, y, p.tok, pairs, tokens, hidden, h0, h0 + 256 < hidden ? h0 + 256 : hidden);
#endif
    }
    if (!ne) memset(out, 0, sizeof(float) * (size_t)tokens * hidden);  // no pair: no D unit summed a row
    if (trace) trace[4L * threads] = omp_get_wtime() - t0;
    free(done);
    free(chunk_done);
    free(act_q);
    free(rowbufs);
    free(act_fs);
    free(act_b);
    free(xfs);
    free(xkb);
    free(xkb_ok);
    free(buf);
    if (trace) trace[4L * threads + 1] = omp_get_wtime() - t0, trace[4L * threads + 2] = 0.0,
               trace[4L * threads + 3] = 0.0;
    return pairs;
}

int ft_moe(const void *gate_up, int gu_codec, const void *down, int dn_codec, int bank_experts, int hidden,
           int inter, const float *restrict x, const int64_t *ids, const float *weights, int tokens, int top_k,
           float *scratch, float *out, int threads, long unit_bytes, double *trace,
           const ft_expert_fn *fn) {
    return moe_run(NULL, gate_up, gu_codec, down, dn_codec, bank_experts, hidden, inter, x, ids, weights, tokens,
                   top_k, scratch, out, threads, unit_bytes, trace, fn);
}

// ft_moe on `team`'s threads (threads: at most its size), unless the build sums after a barrier.
int ft_moe_on_team(ft_team *team, const void *gate_up, int gu_codec, const void *down, int dn_codec,
                   int bank_experts, int hidden, int inter, const float *restrict x, const int64_t *ids,
                   const float *weights, int tokens, int top_k, float *scratch, float *out, int threads,
                   long unit_bytes, double *trace, const ft_expert_fn *fn) {
    return moe_run(team, gate_up, gu_codec, down, dn_codec, bank_experts, hidden, inter, x, ids, weights, tokens,
                   top_k, scratch, out, threads, unit_bytes, trace, fn);
}

// ft_moe over bf16 banks (the CPU branch's worker calls it).
int ft_moe_bf16(const uint16_t *gate_up, const uint16_t *down, int bank_experts, int hidden, int inter,
                const float *restrict x, const int64_t *ids, const float *weights, int tokens, int top_k,
                float *scratch, float *out, int threads, long unit_bytes, double *trace) {
    return ft_moe(gate_up, FT_CODEC_BF16, down, FT_CODEC_BF16, bank_experts, hidden, inter, x, ids, weights,
                  tokens, top_k, scratch, out, threads, unit_bytes, trace, NULL);
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
