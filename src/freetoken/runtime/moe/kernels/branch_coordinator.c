// The CPU branch of a decode step that runs on the GPU without the host: the GPU stages the pairs it
// leaves to the CPU in pinned memory and raises a flag (a stream write, which a captured graph replays);
// a native coordinator thread sees the flag, runs ft_moe over the pool's banks on its own team of threads
// (spin_team.h: they spin between layers), writes the result to pinned memory and raises the done flag the
// GPU's stream waits on. One layer is in flight at a time: the GPU hands over layer l+1 only after it has
// waited for layer l.
//
// The branch owns one region (page-aligned, the caller page-locks it for the GPU): flags, then the stage,
// then out, each 64-byte aligned; it outlives a coordinator stuck in a layer (see ft_branch_stop).
// Flags [2] int32 in mapped pinned memory: submit (the GPU sets 1, the coordinator takes it back to 0),
// done (the coordinator sets 1, the GPU's stream sets it back to 0 after its wait).
// Stage (pinned): int64 header [2] (rows, layer row), then x fp32 [rows, H], ids int64 [rows, K] (-1: not
// the CPU's), weights fp32 [rows, K], packed in that order with no gaps (H even keeps ids 8-aligned).
// Out (pinned): fp32 [rows, H], written whole.
//
// The coordinator keeps its own timings (ft_branch_timings): per layer served, its time from the take to
// the answer, the kernel call's, its threads' first unit start and last unit end within the call, and the
// gap since the answer before (the GPU's side of the step and both flags' latency) where under GAP_CAP_NS.
//
// A watchdog thread turns a failed or stuck branch into an error, never a hang: once the coordinator
// fails (the kernel returns an error) or stays in one layer longer than `stall_s`, the branch is dead:
// every submission from then on is acknowledged at once (done = 1, out untouched), so the GPU finishes
// its step, and the host reads `failed` after the step and raises.
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "expert_fn.h"
#include "spin_team.h"

int ft_moe_on_team(ft_team *team, const void *gate_up, int gu_codec, const void *down, int dn_codec,
                   int bank_experts, int hidden, int inter, const float *restrict x, const int64_t *ids,
                   const float *weights, int tokens, int top_k, float *scratch, float *out, int threads,
                   long unit_bytes, double *trace, const ft_expert_fn *fn);

enum { SUBMIT = 0, DONE = 1 };
enum { FAIL_NONE = 0, FAIL_KERNEL = 1, FAIL_STALL = 2, FAIL_STOPPED = 3, FAIL_HEADER = 4 };
#define SPIN_NS 2000000L  // after this long without work the coordinator naps between looks
#define DOZE_NS 100000000L  // after this long it naps longer (an idle engine)
#define DOZE_NAP_NS 1000000L
#define WAIT_SPIN_NS 20000L  // the host's wait (cpu device) spins this long, then naps
#define NAP_NS 20000L
#define WATCH_NS 1000000L  // the watchdog's look interval while the branch is alive
#define GAP_CAP_NS 2000000L  // a longer gap between two layers is the host's (between steps), not counted
#define MAX_TRACE_THREADS 512

// ft_branch_timings' counters, in this order: layers served, nanoseconds take -> answer, in ft_moe, to the
// last thread's first unit (the team's start), to the last thread's last unit, gaps counted, their
// nanoseconds, then nanoseconds from ft_moe's start to its threads joined
enum { T_LAYERS, T_BUSY, T_CALL, T_START, T_WORK, T_GAPS, T_GAP, T_JOINED, T_COUNT };

typedef struct {
    const void *gate_up, *down;
    int gu_codec, dn_codec;
    ft_expert_fn fn;
    int has_fn;
} layer_banks;

typedef struct {
    int32_t *flags;
    const unsigned char *stage;
    float *out;
    unsigned char *region;  // flags, stage and out
    long region_bytes;
    layer_banks *layers;
    int n_layers, bank_experts, hidden, inter, top_k, max_rows;
    int threads;  // read per layer: the host may change it between steps
    double stall_s;
    float *scratch;
    int stop;          // the host asks the threads to end
    int failed;        // FAIL_*: the branch is dead
    int error;         // the kernel's result when FAIL_KERNEL
    long served;       // layers served (computed or acknowledged)
    long busy_since;   // ns, monotonic: when the coordinator took the layer it is computing; 0 when idle
    pthread_t coordinator, watchdog;
    int running;       // threads started
    int joined;        // the coordinator has been joined
    long hold_ns;      // tests: the next layer first sleeps this long (a stuck branch)
    long timings[T_COUNT];  // T_*: written by the coordinator, read and reset by the host (atomics)
    double *trace;     // [MAX_TRACE_THREADS + 1, 4]: ft_moe's trace of the layer being served
    ft_team *team;     // the kernel's threads, the coordinator one of them (spin_team.h)
} ft_branch;

// Takes a pending submission (exactly one thread wins it).
static int take(ft_branch *b) {
    if (__atomic_load_n(&b->flags[SUBMIT], __ATOMIC_ACQUIRE) != 1) return 0;
    return __atomic_exchange_n(&b->flags[SUBMIT], 0, __ATOMIC_ACQ_REL) == 1;
}

static void answer(ft_branch *b) {
    __atomic_store_n(&b->flags[DONE], 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(&b->served, 1, __ATOMIC_ACQ_REL);
}

static void fail(ft_branch *b, int why, int error) {
    int none = FAIL_NONE;
    if (__atomic_compare_exchange_n(&b->failed, &none, why, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        b->error = error;
}

static int serve(ft_branch *b) {
    const int64_t *header = (const int64_t *)b->stage;
    const long rows = header[0], row = header[1];
    if (rows < 0 || rows > b->max_rows || row < 0 || row >= b->n_layers) return -100;
    const long h = b->hidden, k = b->top_k;
    const float *x = (const float *)(b->stage + 16);
    const int64_t *ids = (const int64_t *)(x + rows * h);
    const float *weights = (const float *)(ids + rows * k);
    const layer_banks *l = &b->layers[row];
    const long hold = __atomic_exchange_n(&b->hold_ns, 0L, __ATOMIC_ACQ_REL);
    if (hold > 0) {
        struct timespec ts = {hold / 1000000000L, hold % 1000000000L};
        nanosleep(&ts, NULL);
    }
    int threads = __atomic_load_n(&b->threads, __ATOMIC_RELAXED);
    threads = threads < ft_team_size(b->team) ? threads : ft_team_size(b->team);
    const long t0 = ft_now_ns();
    const int result = ft_moe_on_team(b->team, l->gate_up, l->gu_codec, l->down, l->dn_codec, b->bank_experts,
                                      b->hidden, b->inter, x, ids, weights, (int)rows, b->top_k, b->scratch,
                                      b->out, threads, 0, b->trace, l->has_fn ? &l->fn : NULL);
    double start = 0.0, work = 0.0;  // seconds from the call's start: the last first unit, the last end
    for (int t = 0; t < threads; t++) {
        const double *row = b->trace + 4L * t;
        if (row[0] > start) start = row[0];
        if (row[1] > work) work = row[1];
    }
    __atomic_add_fetch(&b->timings[T_CALL], ft_now_ns() - t0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&b->timings[T_START], (long)(start * 1e9), __ATOMIC_RELAXED);
    __atomic_add_fetch(&b->timings[T_WORK], (long)(work * 1e9), __ATOMIC_RELAXED);
    __atomic_add_fetch(&b->timings[T_JOINED], (long)(b->trace[4L * threads] * 1e9), __ATOMIC_RELAXED);
    return result;
}

static void *coordinator_loop(void *arg) {
    ft_branch *b = arg;
    long last = ft_now_ns();
    unsigned spins = 0;
    while (!__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
        if (__atomic_load_n(&b->failed, __ATOMIC_ACQUIRE)) break;  // the watchdog answers from now on
        if (take(b)) {
            const long taken = ft_now_ns();
            if (taken - last < GAP_CAP_NS) {
                __atomic_add_fetch(&b->timings[T_GAPS], 1L, __ATOMIC_RELAXED);
                __atomic_add_fetch(&b->timings[T_GAP], taken - last, __ATOMIC_RELAXED);
            }
            __atomic_store_n(&b->busy_since, taken, __ATOMIC_RELEASE);
            const int result = serve(b);
            __atomic_store_n(&b->busy_since, 0L, __ATOMIC_RELEASE);
            if (result < 0) fail(b, result == -100 ? FAIL_HEADER : FAIL_KERNEL, result);
            if (__atomic_load_n(&b->failed, __ATOMIC_ACQUIRE) != FAIL_STALL) answer(b);  // else answered
            last = ft_now_ns();
            __atomic_add_fetch(&b->timings[T_LAYERS], 1L, __ATOMIC_RELAXED);
            __atomic_add_fetch(&b->timings[T_BUSY], last - taken, __ATOMIC_RELAXED);
            continue;
        }
        if ((++spins & 63) == 0) {
            const long idle = ft_now_ns() - last;
            if (idle > SPIN_NS) ft_nap(idle > DOZE_NS ? DOZE_NAP_NS : NAP_NS);
        } else {
            ft_relax();
        }
    }
    return NULL;
}

static void *watchdog_loop(void *arg) {
    ft_branch *b = arg;
    while (!__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
        if (__atomic_load_n(&b->failed, __ATOMIC_ACQUIRE)) {
            if (take(b)) answer(b);
            ft_nap(NAP_NS);
            continue;
        }
        const long since = __atomic_load_n(&b->busy_since, __ATOMIC_ACQUIRE);
        if (since && ft_now_ns() - since > (long)(b->stall_s * 1e9)) {
            fail(b, FAIL_STALL, 0);
            answer(b);  // the layer the coordinator is stuck in
        }
        ft_nap(WATCH_NS);
    }
    return NULL;
}

static long align64(long n) { return (n + 63) / 64 * 64; }

// gate_up, down, codecs: [n_layers] banks per layer row and their codec ids (valid while the branch runs);
// fns: [n_layers] the experts' function per layer row (copied; its biases valid while the branch runs), or
// NULL for SiLU without biases. spin_s: how long the kernel's threads spin after a layer before they nap (0
// where the caller's own work between layers needs the cores: the cpu device standing in).
// Returns NULL when out of memory or a thread cannot start.
ft_branch *ft_branch_new(const void **gate_up, const void **down, const int *gu_codecs, const int *dn_codecs,
                         const ft_expert_fn *fns, int n_layers, int bank_experts, int hidden, int inter, int top_k, int max_rows,
                         int threads, double stall_s, double spin_s) {
    ft_branch *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->layers = calloc((size_t)n_layers, sizeof *b->layers);
    // ft_moe's scratch at max_rows (the int8 activation blocks fit in the x part)
    b->scratch = malloc(sizeof(float) * ((size_t)max_rows * top_k * (inter + hidden) + (size_t)max_rows * hidden));
    const long stage_bytes = 16 + (long)max_rows * (4L * hidden + 12L * top_k);
    const long out_bytes = 4L * max_rows * hidden;
    b->region_bytes = (64 + align64(stage_bytes) + align64(out_bytes) + 4095) / 4096 * 4096;
    b->region = aligned_alloc(4096, (size_t)b->region_bytes);
    b->trace = calloc(4L * (MAX_TRACE_THREADS + 1), sizeof(double));
    b->team = ft_team_new(threads < 1 ? 1 : threads < MAX_TRACE_THREADS ? threads : MAX_TRACE_THREADS,
                          (long)(spin_s * 1e9));
    if (!b->layers || !b->scratch || !b->region || !b->trace || !b->team) goto fail;
    memset(b->region, 0, (size_t)b->region_bytes);
    for (int i = 0; i < n_layers; i++)
        b->layers[i] = (layer_banks){gate_up[i], down[i], gu_codecs[i], dn_codecs[i], fns ? fns[i] : (ft_expert_fn){0},
                                     fns != NULL};
    b->flags = (int32_t *)b->region;
    b->stage = b->region + 64;
    b->out = (float *)(b->region + 64 + align64(stage_bytes));
    b->n_layers = n_layers, b->bank_experts = bank_experts, b->hidden = hidden, b->inter = inter;
    b->top_k = top_k, b->max_rows = max_rows, b->threads = threads, b->stall_s = stall_s;
    if (pthread_create(&b->coordinator, NULL, coordinator_loop, b) != 0) goto fail;
    if (pthread_create(&b->watchdog, NULL, watchdog_loop, b) != 0) {
        __atomic_store_n(&b->stop, 1, __ATOMIC_RELEASE);
        pthread_join(b->coordinator, NULL);
        goto fail;
    }
    b->running = 1;
    return b;
fail:
    free(b->layers);
    free(b->scratch);
    free(b->region);
    free(b->trace);
    ft_team_free(b->team);
    free(b);
    return NULL;
}

// The region's address and bytes, and the offsets of the flags, the stage and out in it.
void *ft_branch_region(ft_branch *b, long *bytes, long offsets[3]) {
    *bytes = b->region_bytes;
    offsets[0] = 0;
    offsets[1] = (long)(b->stage - b->region);
    offsets[2] = (long)((unsigned char *)b->out - b->region);
    return b->region;
}

void ft_branch_set_threads(ft_branch *b, int threads) { __atomic_store_n(&b->threads, threads, __ATOMIC_RELAXED); }

// FAIL_* (0 while the branch is alive); *error receives the kernel's result when FAIL_KERNEL.
int ft_branch_failed(ft_branch *b, int *error) {
    const int why = __atomic_load_n(&b->failed, __ATOMIC_ACQUIRE);
    if (error) *error = b->error;
    return why;
}

long ft_branch_served(ft_branch *b) { return __atomic_load_n(&b->served, __ATOMIC_ACQUIRE); }

// The coordinator's timings since the last reset into out[T_COUNT] (the T_* order); reset: zero them after.
void ft_branch_timings(ft_branch *b, long *out, int reset) {
    for (int i = 0; i < T_COUNT; i++)
        out[i] = reset ? __atomic_exchange_n(&b->timings[i], 0L, __ATOMIC_ACQ_REL)
                       : __atomic_load_n(&b->timings[i], __ATOMIC_ACQUIRE);
}

// Stops the coordinator alone (tests: a branch whose thread is gone); the watchdog answers from then on.
void ft_branch_stop_coordinator(ft_branch *b) {
    fail(b, FAIL_STOPPED, 0);
    if (!b->joined) pthread_join(b->coordinator, NULL);
    b->joined = 1;
}

// The host's side of the submit flag where no GPU stream writes it (the cpu device standing in).
void ft_branch_signal(ft_branch *b) { __atomic_store_n(&b->flags[SUBMIT], 1, __ATOMIC_RELEASE); }

// Tests: the next layer served first sleeps `seconds` (a branch stuck in the kernel).
void ft_branch_hold(ft_branch *b, double seconds) {
    __atomic_store_n(&b->hold_ns, (long)(seconds * 1e9), __ATOMIC_RELEASE);
}

// The host's side of the done flag where no GPU stream waits (the cpu device standing in): blocks until
// done is 1 and sets it back to 0. Returns 0, or FAIL_* when the branch died (done is still consumed, as the
// watchdog answers).
int ft_branch_wait_done(ft_branch *b) {
    unsigned spins = 0;
    const long start = ft_now_ns();
    while (__atomic_load_n(&b->flags[DONE], __ATOMIC_ACQUIRE) != 1) {
        if ((++spins & 63) == 0 && ft_now_ns() - start > WAIT_SPIN_NS) ft_nap(NAP_NS); else ft_relax();
    }
    __atomic_store_n(&b->flags[DONE], 0, __ATOMIC_RELEASE);
    return __atomic_load_n(&b->failed, __ATOMIC_ACQUIRE);
}

// Ends both threads (a layer in flight finishes first). Returns 1 when the coordinator is still stuck in a
// layer: it is left to itself, detached, and the branch (its memory) must never be freed; else 0.
int ft_branch_stop(ft_branch *b) {
    __atomic_store_n(&b->stop, 1, __ATOMIC_RELEASE);
    if (!b->running) return 0;
    b->running = 0;
    pthread_join(b->watchdog, NULL);
    if (!b->joined && __atomic_load_n(&b->busy_since, __ATOMIC_ACQUIRE) &&
        __atomic_load_n(&b->failed, __ATOMIC_ACQUIRE) == FAIL_STALL) {
        pthread_detach(b->coordinator);
        b->joined = 1;
        return 1;
    }
    if (!b->joined) pthread_join(b->coordinator, NULL);
    b->joined = 1;
    return 0;
}

// Frees a stopped branch (ft_branch_stop returned 0).
void ft_branch_free(ft_branch *b) {
    if (!b) return;
    free(b->layers);
    free(b->scratch);
    free(b->region);
    free(b->trace);
    ft_team_free(b->team);
    free(b);
}
