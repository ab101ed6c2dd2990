// The spinning team of spin_team.h. A call is published as fields written relaxed, then the generation
// raised with release; a worker that sees a new generation reads the fields and checks the generation
// again (a newer call may have been published meanwhile: it then reads that one). Only threads below the
// call's count take part and count themselves done; the caller publishes the next call only after all of
// them have, so no participant misses its call and `done` is never raised late.
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "spin_team.h"

#define TEAM_NAP_NS 20000L
#define TEAM_DOZE_NS 100000000L  // idle this long (an idle engine): longer naps
#define TEAM_DOZE_NAP_NS 1000000L

struct ft_team {
    int size;
    long spin_ns;
    pthread_t *workers;  // [size - 1]
    struct worker *args;  // [size - 1]
    ft_team_fn fn;       // the call's (relaxed atomics, published by gen)
    void *arg;
    int threads;
    unsigned gen;        // raised once per call (release)
    int stop;
    _Alignas(64) int done;  // workers that finished the call (release); a line of its own: the idle
                            // workers poll gen's while the participants raise this one
};

struct worker {
    ft_team *team;
    int tid;
};

long ft_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

void ft_nap(long ns) {
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

static void *worker_loop(void *p) {
    const struct worker *w = p;
    ft_team *t = w->team;
    unsigned seen = 0;
    long last = ft_now_ns();
    unsigned spins = 0;
    for (;;) {
        const unsigned gen = __atomic_load_n(&t->gen, __ATOMIC_ACQUIRE);
        if (gen == seen) {
            if (__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE)) break;
            if ((++spins & 63) == 0) {
                const long idle = ft_now_ns() - last;
                if (idle > t->spin_ns) ft_nap(idle > TEAM_DOZE_NS ? TEAM_DOZE_NAP_NS : TEAM_NAP_NS);
            } else {
                ft_relax();
            }
            continue;
        }
        const ft_team_fn fn = __atomic_load_n(&t->fn, __ATOMIC_RELAXED);
        void *arg = __atomic_load_n(&t->arg, __ATOMIC_RELAXED);
        const int threads = __atomic_load_n(&t->threads, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&t->gen, __ATOMIC_RELAXED) != gen) continue;  // a newer call: read that one
        seen = gen;
        if (w->tid < threads) {
            fn(arg, w->tid);
            __atomic_add_fetch(&t->done, 1, __ATOMIC_RELEASE);
        }
        last = ft_now_ns();
    }
    return NULL;
}

ft_team *ft_team_new(int size, long spin_ns) {
    if (size < 1) return NULL;
    ft_team *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->size = size;
    t->spin_ns = spin_ns;
    t->workers = calloc((size_t)size, sizeof *t->workers);
    t->args = calloc((size_t)size, sizeof *t->args);
    if (!t->workers || !t->args) goto fail;
    for (int i = 1; i < size; i++) {
        t->args[i - 1] = (struct worker){t, i};
        if (pthread_create(&t->workers[i - 1], NULL, worker_loop, &t->args[i - 1]) != 0) {
            t->size = i;  // the workers started so far are joined
            ft_team_free(t);
            return NULL;
        }
    }
    return t;
fail:
    free(t->workers);
    free(t->args);
    free(t);
    return NULL;
}

int ft_team_size(const ft_team *t) { return t->size; }

void ft_team_run(ft_team *t, int threads, ft_team_fn fn, void *arg) {
    threads = threads < 1 ? 1 : threads > t->size ? t->size : threads;
    if (threads == 1) {
        fn(arg, 0);
        return;
    }
    __atomic_store_n(&t->done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&t->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&t->arg, arg, __ATOMIC_RELAXED);
    __atomic_store_n(&t->threads, threads, __ATOMIC_RELAXED);
    __atomic_add_fetch(&t->gen, 1, __ATOMIC_RELEASE);
    fn(arg, 0);
    while (__atomic_load_n(&t->done, __ATOMIC_ACQUIRE) < threads - 1) ft_relax();
}

void ft_team_free(ft_team *t) {
    if (!t) return;
    __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
    for (int i = 0; i + 1 < t->size; i++) pthread_join(t->workers[i], NULL);
    free(t->workers);
    free(t->args);
    free(t);
}

// Tests: `calls` calls of random thread counts (1 .. size + 1, seeded) on a fresh team of `size`, each
// thread counting itself in; returns 0 when every call ran exactly its threads once each, else the first
// failing call + 1 (-1 when the team cannot start).
struct check_call {
    int threads;
    int hits[64];
};

static void check_fn(void *arg, int tid) {
    struct check_call *c = arg;
    __atomic_add_fetch(&c->hits[tid < 64 ? tid : 63], 1, __ATOMIC_RELAXED);
}

int ft_team_check(int size, int calls, unsigned seed, long spin_ns) {
    if (size < 1 || size > 63) return -1;
    ft_team *t = ft_team_new(size, spin_ns);
    if (!t) return -1;
    int failed = 0;
    for (int i = 0; i < calls && !failed; i++) {
        seed = seed * 1103515245u + 12345u;
        struct check_call c = {.threads = 1 + (int)((seed >> 16) % (unsigned)(size + 1))};
        ft_team_run(t, c.threads, check_fn, &c);
        const int ran = c.threads < size ? c.threads : size;
        for (int tid = 0; tid < 64; tid++)
            if (__atomic_load_n(&c.hits[tid], __ATOMIC_RELAXED) != (tid < ran)) failed = i + 1;
    }
    ft_team_free(t);
    return failed;
}
