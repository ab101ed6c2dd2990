// A whole decode step of a grouped-query MoE model on the CPU in one call (Qwen3-MoE, Mixtral, OLMoE,
// GLM-4.5, MiniMax-M2): every layer, the final norm and the LM head, with no interpreter between the
// kernels. It strings together the kernels the Python step calls one by one (norm_cpu.c, dense_bf16.c,
// attention_decode.c, experts_cpu.c) and rounds to bf16 where that step rounds (each Linear's output,
// the attention output, the routing weights, the experts' sum, the shared experts' sum), so it computes
// what the model's own decode computes with the CPU ops, layer for layer.
//
// For B rows (row b: token tokens[b] at position positions[b] of KV slot slots[b]; slot -1: padding):
//   x = embed[tokens]; cos, sin = round(cos / sin(positions · inv_freq) · scaling)   [B, rot], rotate-half
// then per layer:
//   h, res = add_rms_norm(x, res)              x, res, h: [B, H] bf16
//   qkv = round(h · Wqkv^T + bqkv)             [B, (NH + 2 KVH) D], clamped to ±clip where clip > 0
//   a = round(attention_block(qkv))            q/k norm (none, per head, whole projection), rotary on the
//                                              first rot dims, K/V write, attention (a window, sinks): [B, NH D]
//   x = round(a · Wo^T + bo)
//   h, res = add_rms_norm(x, res)
//   router, by `scoring`:
//     softmax: g = round(h · Wgate^T) [B, E]; softmax in fp32, top-k, renormalised (or not)
//     sigmoid: s = sigmoid(h · Wgate^T) in fp32; chosen by s + correction bias among the best topk_group
//              of n_group groups (a group scored by its two best); weights s, renormalised (or not)
//   w = round(w · scaling); ids [B, K] (-1 on padding rows); their distinct count into
//   distinct_out[the MoE layer's index]
//   x = round(experts(h, ids, w)), then x = round(x + shared(h)) where the layer has shared experts
// or, in a dense layer (no router): x = mlp(h), mlp(h) = round(round(round(silu(round(h · Wg^T))) ·
// round(h · Wu^T)) · Wd^T), as the shared experts are
// then logits = round(add_rms_norm(x, res) · Wlm^T), [B, V] bf16.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_dot.h"
#include "expert_fn.h"

int ft_linear_bf16(const uint16_t *w, const float *x, float *out, int n_rows, int hidden, int tokens, float *xs,
                   int threads);
int ft_attention_decode(const float *qkv, int rows, int nh, int kvh, int d, int norm, int rot, const float *qw,
                        const float *kw, float eps, const float *cos, const float *sin, void *k_cache, void *v_cache,
                        int elem, int cap, const int64_t *slots, const int64_t *positions, float scale,
                        const float *sinks, int window, float *scores, float *q_scratch, float *out,
                        int threads);
void ft_add_rms_norm(const void *x, const void *residual, const void *weight, float eps, int rows, int hidden,
                     int elem, void *out_h, void *out_sum, float *scratch);
int ft_moe(const void *gate_up, int gu_codec, const void *down, int dn_codec, int bank_experts, int hidden,
           int inter, const float *x, const int64_t *ids, const float *weights, int tokens, int top_k,
           float *scratch, float *out, int threads, long unit_bytes, double *trace,
           const ft_expert_fn *fn);

#define MAX_ROWS 16
#define MAX_EXPERTS 4096

typedef struct {
    const uint16_t *input_norm;  // [H]
    const uint16_t *qkv;         // [(NH + 2 KVH) D, H]
    const uint16_t *qkv_bias;    // [(NH + 2 KVH) D] or NULL
    const float *q_norm;         // [D] fp32
    const float *k_norm;         // [D] fp32
    const uint16_t *o;           // [H, NH D]
    const uint16_t *o_bias;      // [H] or NULL
    const uint16_t *post_norm;   // [H]
    const uint16_t *gate;        // [E, H]; NULL in a dense layer
    const void *gate_up;         // [E, 2I, H] in gu_codec
    const void *down;            // [E, H, I] in dn_codec
    const float *gate_bias;      // [E] fp32: the sigmoid router's correction bias, or NULL
    const uint16_t *mlp_gate;    // a dense layer's or the shared experts' [DI, H] (NULL: neither)
    const uint16_t *mlp_up;      // [DI, H]
    const uint16_t *mlp_down;    // [H, DI]
    const float *sinks;          // [NH] fp32 sink logits, or NULL
    void *k_cache, *v_cache;     // [S, KVH, CAP, D] in cache_elem bytes per element
    int gu_codec, dn_codec;      // the expert banks' codecs (quant_dot.h's ids)
    int mlp_inter;               // DI of mlp_gate/up/down (0: no such MLP)
    int window;                  // keys a query sees (0: all)
} ft_decoder_layer;

enum { SCORING_SOFTMAX = 0, SCORING_SIGMOID = 1 };

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, experts, top_k, inter, vocab, capacity, cache_elem;
    int norm_topk_prob, dense_inter;  // dense_inter: the widest layer MLP's DI (dense or shared; 0: none)
    int qk_norm, rot;                 // attention_decode.c's norm (0 none, 1 per head, 2 whole) and rot
    int scoring, n_group, topk_group;
    float rms_eps, qk_eps, clip, routed_scaling;  // clip 0: none
    const ft_decoder_layer *layer;  // [layers]
    const uint16_t *final_norm;     // [H]
    const uint16_t *lm_head;        // [V, H]
    const uint16_t *embed;          // [V, H]
    const float *inv_freq;          // [D / 2]
    float rope_scaling;
} ft_decoder;

// The longest input row of any Linear: the hidden size, the attention output, a dense layer's inner size.
static int widest_input(const ft_decoder *m) {
    const int qd = m->heads * m->head_dim, a = m->hidden > qd ? m->hidden : qd;
    return a > m->dense_inter ? a : m->dense_inter;
}

// fp32 scratch the step needs for `rows` rows (the caller allocates it once and passes it back).
long ft_decode_step_scratch(const ft_decoder *m, int rows) {
    const long h = m->hidden, qd = (long)m->heads * m->head_dim;
    const long width = qd + 2L * m->kv_heads * m->head_dim, k = m->top_k;
    const long widest = widest_input(m);
    long n = 0;
    n += 3 * rows * h / 2 + 3;                          // x, res, h in bf16 (halves of floats)
    n += rows * widest;                                  // the Linear input widened
    n += rows * widest;                                  // its split form
    n += rows * width;                                   // qkv
    n += 2 * rows * qd;                                  // attention output, q scratch
    n += (long)rows * m->heads * m->capacity;            // scores
    n += h;                                              // the norm's scratch
    n += (long)rows * m->experts;                        // router logits
    n += rows * k;                                       // routing weights
    n += rows * (k * (m->inter + h) + h);                // the experts' scratch
    n += rows * h;                                       // the experts' sum
    n += (long)rows * m->vocab;                          // LM head output
    n += 2L * rows * m->dense_inter;                     // a dense layer's gate and up
    n += 2L * rows * m->rot;                             // cos, sin
    n += rows * h / 2 + 1;                               // the shared experts' output (bf16)
    n += 2L * rows * k + 1;                              // the routing ids (int64, 8-byte aligned)
    return n;
}

static void widen(const uint16_t *src, float *dst, long n) {
    for (long i = 0; i < n; i++) dst[i] = load_elem(src, i, 2);
}

static void narrow(const float *src, uint16_t *dst, long n) {
    for (long i = 0; i < n; i++) store_elem(dst, i, src[i], 2);
}

// out [rows, n] fp32 = x [rows, k] bf16 · W^T (+ bias), rounded to bf16 in place.
static void linear(const uint16_t *w, const uint16_t *bias, const uint16_t *x, int rows, int n, int k, float *xf,
                   float *xs, float *out, int threads) {
    widen(x, xf, (long)rows * k);
    ft_linear_bf16(w, xf, out, n, k, rows, xs, threads);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < n; i++) {
            float v = out[(long)r * n + i];
            if (bias) v += load_elem(bias, i, 2);
            out[(long)r * n + i] = round_elem(v, 2);
        }
}

// Softmax over e logits in fp32, the k largest (ties: the lower id), renormalised when asked; weights
// rounded to bf16 as the routing weights are.
static void route(const float *logits, int e, int k, int renorm, int64_t *ids, float *weights) {
    float top = -INFINITY;
    for (int i = 0; i < e; i++) top = logits[i] > top ? logits[i] : top;
    float p[MAX_EXPERTS];
    float total = 0.0f;
    for (int i = 0; i < e; i++) total += (p[i] = expf(logits[i] - top));
    for (int i = 0; i < e; i++) p[i] /= total;
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < e; i++)
            if (p[i] >= 0.0f && (best < 0 || p[i] > p[best])) best = i;
        if (best < 0) {  // NaN logits: no expert (the logits come out NaN and the step is refused)
            ids[j] = -1, weights[j] = 0.0f;
            continue;
        }
        ids[j] = best, weights[j] = p[best], sum += p[best];
        p[best] = -1.0f;
    }
    for (int j = 0; j < k; j++) weights[j] = round_elem(renorm ? weights[j] / sum : weights[j], 2);
}


// Sigmoid scores of e fp32 logits; experts chosen by score + bias among the best `topk_group` of `groups`
// equal groups (a group scored by the sum of its two best; ties: the lower index), k of them (ties: the
// lower id); weights the chosen scores, renormalised when asked (+1e-20, as the torch router).
static void route_sigmoid(const float *logits, const float *bias, int e, int k, int groups, int topk_group,
                          int renorm, int64_t *ids, float *weights) {
    float s[MAX_EXPERTS], c[MAX_EXPERTS];
    for (int i = 0; i < e; i++) {
        s[i] = 1.0f / (1.0f + expf(-logits[i]));
        c[i] = s[i] + (bias ? bias[i] : 0.0f);
    }
    if (groups > 1) {
        const int per = e / groups;
        float score[MAX_EXPERTS];
        for (int g = 0; g < groups; g++) {
            float a = -INFINITY, b = -INFINITY;  // the group's best two
            for (int i = g * per; i < (g + 1) * per; i++)
                if (c[i] > a) b = a, a = c[i];
                else if (c[i] > b) b = c[i];
            score[g] = a + b;
        }
        char keep[MAX_EXPERTS] = {0};
        for (int j = 0; j < topk_group; j++) {
            int best = -1;
            for (int g = 0; g < groups; g++)
                if (!keep[g] && (best < 0 || score[g] > score[best])) best = g;
            keep[best] = 1;
        }
        for (int i = 0; i < e; i++)
            if (!keep[i / per]) c[i] = -INFINITY;
    }
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < e; i++)
            if (c[i] > -INFINITY && (best < 0 || c[i] > c[best])) best = i;
        if (best < 0) {  // NaN logits: no expert (the logits come out NaN and the step is refused)
            ids[j] = -1, weights[j] = 0.0f;
            continue;
        }
        ids[j] = best, weights[j] = s[best], sum += s[best];
        c[best] = -INFINITY;
    }
    for (int j = 0; j < k; j++) weights[j] = renorm ? weights[j] / (sum + 1e-20f) : weights[j];
}

// A SwiGLU MLP (a dense layer's, or the shared experts'): x [rows, H] bf16 = the MLP of h, rounding as
// the torch layer does.
static void dense_mlp(const ft_decoder_layer *L, int di, const uint16_t *hn, int rows, int h, float *xf,
                      float *xs, float *g, float *u, float *y, uint16_t *x, int threads) {
    linear(L->mlp_gate, NULL, hn, rows, di, h, xf, xs, g, threads);
    linear(L->mlp_up, NULL, hn, rows, di, h, xf, xs, u, threads);
    for (long i = 0; i < (long)rows * di; i++)
        g[i] = round_elem(round_elem(g[i] / (1.0f + expf(-g[i])), 2) * u[i], 2);  // silu(g) · u
    ft_linear_bf16(L->mlp_down, g, y, h, di, rows, xs, threads);
    narrow(y, x, (long)rows * h);
}

// The rotary tables of each row ([rows, rot]), as the torch step makes them: fp32 angles, cos and sin
// times the scaling, rounded to bf16.
static void rotary(const ft_decoder *m, int rows, const int64_t *positions, float *cos, float *sin) {
    const int d = m->rot, half = d / 2;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < half; i++) {
            const float angle = (float)positions[r] * m->inv_freq[i];
            const float c = round_elem(cosf(angle) * m->rope_scaling, 2), s = round_elem(sinf(angle) * m->rope_scaling, 2);
            cos[(long)r * d + i] = cos[(long)r * d + half + i] = c;
            sin[(long)r * d + i] = sin[(long)r * d + half + i] = s;
        }
}

// Distinct expert ids >= 0 among n (a bitmap over the bank).
static int distinct(const int64_t *ids, int n, int experts) {
    uint64_t seen[MAX_EXPERTS / 64] = {0};
    int count = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= experts) continue;
        const uint64_t bit = 1ull << (ids[i] & 63);
        count += !(seen[ids[i] >> 6] & bit);
        seen[ids[i] >> 6] |= bit;
    }
    return count;
}

// tokens, slots, positions [rows]; distinct_out [MoE layers]; logits [rows, V] bf16. Returns 0, -1 for
// a bad row count or expert count, -2 for a position past the cache, -3 when the expert kernel could
// not allocate, -4 for a token outside the vocabulary.
int ft_decode_step(const ft_decoder *m, int rows, const int64_t *tokens, const int64_t *slots,
                   const int64_t *positions, int64_t *distinct_out, uint16_t *logits, float *scratch, int threads,
                   int expert_threads) {
    if (rows < 1 || rows > MAX_ROWS || m->experts > MAX_EXPERTS) return -1;
    for (int r = 0; r < rows; r++)
        if (tokens[r] < 0 || tokens[r] >= m->vocab) return -4;
    const int h = m->hidden, d = m->head_dim, qd = m->heads * d, e = m->experts, k = m->top_k;
    const int width = qd + 2 * m->kv_heads * d, widest = widest_input(m);
    uint16_t *x = (uint16_t *)scratch, *res = x + (long)rows * h, *hn = res + (long)rows * h;
    float *f = scratch + (3L * rows * h / 2 + 3);
    float *xf = f;
    float *xs = xf + (long)rows * widest;
    float *qkv = xs + (long)rows * widest;
    float *attn = qkv + (long)rows * width;
    float *q_scratch = attn + (long)rows * qd;
    float *scores = q_scratch + (long)rows * qd;
    float *norm = scores + (long)rows * m->heads * m->capacity;
    float *gl = norm + h;
    float *rw = gl + (long)rows * e;
    float *ex = rw + (long)rows * k;
    float *ey = ex + (long)rows * (k * (m->inter + h) + h);
    float *lm = ey + (long)rows * h;
    float *dense_g = lm + (long)rows * m->vocab, *dense_u = dense_g + (long)rows * m->dense_inter;
    float *cos = dense_u + (long)rows * m->dense_inter, *sin = cos + (long)rows * m->rot;
    uint16_t *shared = (uint16_t *)(sin + (long)rows * m->rot);
    float *after = (float *)shared + ((long)rows * h / 2 + 1);
    int64_t *ids = (int64_t *)(after + ((uintptr_t)after / sizeof(float) & 1));
    for (int r = 0; r < rows; r++) memcpy(x + (long)r * h, m->embed + tokens[r] * h, sizeof(uint16_t) * h);
    rotary(m, rows, positions, cos, sin);
    const float scale = 1.0f / sqrtf((float)d);
    int moe_layer = 0;
    for (int l = 0; l < m->layers; l++) {
        const ft_decoder_layer *L = &m->layer[l];
        ft_add_rms_norm(x, l ? res : NULL, L->input_norm, m->rms_eps, rows, h, 2, hn, res, norm);
        linear(L->qkv, L->qkv_bias, hn, rows, width, h, xf, xs, qkv, threads);
        if (m->clip > 0.0f)
            for (long i = 0; i < (long)rows * width; i++) qkv[i] = fminf(fmaxf(qkv[i], -m->clip), m->clip);
        const int code = ft_attention_decode(qkv, rows, m->heads, m->kv_heads, d, m->qk_norm, m->rot, L->q_norm,
                                             L->k_norm, m->qk_eps, cos, sin, L->k_cache, L->v_cache, m->cache_elem,
                                             m->capacity, slots, positions, scale, L->sinks, L->window, scores,
                                             q_scratch, attn, threads);
        if (code != 0) return -2;
        for (long i = 0; i < (long)rows * qd; i++) attn[i] = round_elem(attn[i], 2);  // o_proj's input
        ft_linear_bf16(L->o, attn, ey, h, qd, rows, xs, threads);
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < h; i++) {
                float v = ey[(long)r * h + i];
                if (L->o_bias) v += load_elem(L->o_bias, i, 2);
                store_elem(x, (long)r * h + i, v, 2);
            }
        ft_add_rms_norm(x, res, L->post_norm, m->rms_eps, rows, h, 2, hn, res, norm);
        if (!L->gate) {
            dense_mlp(L, L->mlp_inter, hn, rows, h, xf, xs, dense_g, dense_u, ey, x, threads);
            continue;
        }
        if (m->scoring == SCORING_SIGMOID) {  // fp32 logits: the torch router widens before its GEMV
            widen(hn, xf, (long)rows * h);
            ft_linear_bf16(L->gate, xf, gl, e, h, rows, xs, threads);
        } else {
            linear(L->gate, NULL, hn, rows, e, h, xf, xs, gl, threads);
        }
        for (int r = 0; r < rows; r++) {
            int64_t *row_ids = ids + (long)r * k;
            float *row_w = rw + (long)r * k;
            if (m->scoring == SCORING_SIGMOID) {
                route_sigmoid(gl + (long)r * e, L->gate_bias, e, k, m->n_group, m->topk_group, m->norm_topk_prob,
                              row_ids, row_w);
                for (int j = 0; j < k; j++) row_w[j] = round_elem(row_w[j] * m->routed_scaling, 2);
            } else {
                route(gl + (long)r * e, e, k, m->norm_topk_prob, row_ids, row_w);
            }
            if (slots[r] < 0)
                for (int j = 0; j < k; j++) row_ids[j] = -1;
        }
        widen(hn, xf, (long)rows * h);
        if (ft_moe(L->gate_up, L->gu_codec, L->down, L->dn_codec, e, h, m->inter, xf, ids, rw, rows, k, ex, ey,
                   expert_threads, 0, NULL, NULL) < 0)
            return -3;
        narrow(ey, x, (long)rows * h);
        if (L->mlp_gate) {  // the shared experts: their own rounded output added to the routed one's
            dense_mlp(L, L->mlp_inter, hn, rows, h, xf, xs, dense_g, dense_u, ey, shared, threads);
            for (long i = 0; i < (long)rows * h; i++)
                store_elem(x, i, load_elem(x, i, 2) + load_elem(shared, i, 2), 2);
        }
        distinct_out[moe_layer++] = distinct(ids, rows * k, e);
    }
    ft_add_rms_norm(x, res, m->final_norm, m->rms_eps, rows, h, 2, hn, res, norm);
    linear(m->lm_head, NULL, hn, rows, m->vocab, h, xf, xs, lm, threads);
    narrow(lm, logits, (long)rows * m->vocab);
    return 0;
}
