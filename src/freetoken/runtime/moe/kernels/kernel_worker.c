// A native thread that runs ft_moe calls over bf16 banks handed to it, so the CPU branch starts the moment it is
// submitted: a Python worker thread would first need the interpreter lock, which the thread driving
// the GPU holds while it issues fills and kernels. The worker is the OpenMP master of its own team,
// kept across calls. One call in flight at a time; submit then wait, from one thread.
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct ft_expert_fn ft_expert_fn;
int ft_moe(const void *gate_up, int gu_codec, const void *down, int dn_codec, int bank_experts, int hidden,
           int inter, const float *restrict x, const int64_t *ids, const float *weights, int tokens, int top_k,
           float *scratch, float *out, int threads, long unit_bytes, double *trace, const ft_expert_fn *fn);

enum { IDLE, PENDING, RUNNING, DONE, QUIT };

typedef struct {
    const uint16_t *gate_up, *down;
    int bank_experts, hidden, inter;
    const float *x;
    const int64_t *ids;
    const float *weights;
    int tokens, top_k;
    float *scratch, *out;
    int threads;
    long unit_bytes;
    int codec;  // both banks': FT_CODEC_BF16, or FT_CODEC_BF16_ACT16 (bf16 activations)
} job_t;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;  // every change of state is broadcast on it
    int state;
    int result;
    job_t job;
    pthread_t thread;
} ft_worker;

static void *worker_loop(void *arg) {
    ft_worker *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->state != PENDING && w->state != QUIT) pthread_cond_wait(&w->cv, &w->mu);
        if (w->state == QUIT) break;
        w->state = RUNNING;
        const job_t j = w->job;
        pthread_mutex_unlock(&w->mu);
        const int result = ft_moe(j.gate_up, j.codec, j.down, j.codec, j.bank_experts, j.hidden, j.inter, j.x,
                                  j.ids, j.weights, j.tokens, j.top_k, j.scratch, j.out, j.threads, j.unit_bytes,
                                  NULL, NULL);
        pthread_mutex_lock(&w->mu);
        w->result = result;
        w->state = DONE;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

ft_worker *ft_worker_new(void) {
    ft_worker *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->state = IDLE;
    if (pthread_create(&w->thread, NULL, worker_loop, w) != 0) {
        free(w);
        return NULL;
    }
    return w;
}

// Arguments as ft_moe_bf16's (no trace), then the banks' codec id; they must stay valid until
// ft_worker_wait returns.
// Returns 0, or -1 when a call is already in flight.
int ft_worker_submit(ft_worker *w, const uint16_t *gate_up, const uint16_t *down, int bank_experts, int hidden,
                     int inter, const float *x, const int64_t *ids, const float *weights, int tokens, int top_k,
                     float *scratch, float *out, int threads, long unit_bytes, int codec) {
    pthread_mutex_lock(&w->mu);
    if (w->state != IDLE) {
        pthread_mutex_unlock(&w->mu);
        return -1;
    }
    w->job = (job_t){gate_up, down, bank_experts, hidden, inter, x, ids, weights, tokens, top_k, scratch, out,
                     threads, unit_bytes, codec};
    w->state = PENDING;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

// Blocks until the call in flight is done; returns its result (pairs computed, -1 on failure), or -2
// when nothing was submitted.
int ft_worker_wait(ft_worker *w) {
    pthread_mutex_lock(&w->mu);
    if (w->state == IDLE) {
        pthread_mutex_unlock(&w->mu);
        return -2;
    }
    while (w->state != DONE) pthread_cond_wait(&w->cv, &w->mu);
    const int result = w->result;
    w->state = IDLE;
    pthread_mutex_unlock(&w->mu);
    return result;
}

// Waits for a call in flight, stops the thread and frees the worker.
void ft_worker_free(ft_worker *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    while (w->state == PENDING || w->state == RUNNING) pthread_cond_wait(&w->cv, &w->mu);
    w->state = QUIT;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}
