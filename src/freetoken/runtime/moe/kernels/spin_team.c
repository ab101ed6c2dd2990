// The spinning team of spin_team.h. A call is published as fields written relaxed, then the generation
// raised with release; a worker that sees a new generation reads the fields and checks the generation
// again (a newer call may have been published meanwhile: it then reads that one). It then asks to enter
// the call by one compare-and-swap on `entry` (the call's generation, a closed bit, the count of workers
// in): it enters only while the call is open and has room, and takes the next tid. The caller closes the
// call once its own share returns (fn hands out its work from a shared counter, so by then none is left to
// take) and waits only for the workers that entered: one the host has descheduled, or that naps, is not
// waited for. `done` counts the entered workers that returned; the next call is published only after all
// of them have, so no increment lands in a later call.
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "spin_team.h"

#define TEAM_NAP_NS 20000L
#define TEAM_DOZE_NS 100000000L  // idle this long (an idle engine): longer naps
#define TEAM_DOZE_NAP_NS 1000000L
#define ENTRY_CLOSED (1ULL << 31)
#define ENTRY_COUNT 0x7fffffffULL

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
    int held;            // tests: workers 1 .. held never enter a call (as if descheduled)
    unsigned long long entry;  // gen << 32 | closed << 31 | workers entered
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

// A tid (1 .. threads - 1) in call `gen`, or 0 when it is closed, full or already past.
static int enter(ft_team *t, unsigned gen, int threads) {
    unsigned long long e = __atomic_load_n(&t->entry, __ATOMIC_ACQUIRE);
    for (;;) {
        const unsigned long long count = e & ENTRY_COUNT;
        if ((unsigned)(e >> 32) != gen || (e & ENTRY_CLOSED) || count + 1 >= (unsigned long long)threads)
            return 0;
        if (__atomic_compare_exchange_n(&t->entry, &e, e + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return (int)count + 1;
    }
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
        if (w->tid > __atomic_load_n(&t->held, __ATOMIC_RELAXED)) {
            const int tid = enter(t, gen, threads);
            if (tid > 0) {
                fn(arg, tid);
                __atomic_add_fetch(&t->done, 1, __ATOMIC_RELEASE);
            }
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
    const unsigned gen = __atomic_load_n(&t->gen, __ATOMIC_RELAXED) + 1;  // the caller alone writes it
    __atomic_store_n(&t->entry, (unsigned long long)gen << 32, __ATOMIC_RELAXED);
    __atomic_store_n(&t->gen, gen, __ATOMIC_RELEASE);
    fn(arg, 0);
    const int entered = (int)(__atomic_fetch_or(&t->entry, ENTRY_CLOSED, __ATOMIC_ACQ_REL) & ENTRY_COUNT);
    while (__atomic_load_n(&t->done, __ATOMIC_ACQUIRE) < entered) ft_relax();
}

void ft_team_free(ft_team *t) {
    if (!t) return;
    __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
    for (int i = 0; i + 1 < t->size; i++) pthread_join(t->workers[i], NULL);
    free(t->workers);
    free(t->args);
    free(t);
}

// Tests: `calls` calls of random thread counts (1 .. size + 1, seeded) on a fresh team of `size` whose
// workers 1 .. `held` never enter, each thread counting itself in; returns 0 when in every call the caller
// ran tid 0, no tid ran twice, the tids that ran were 0 .. k - 1 for some k within the call's threads and
// the workers free to enter, else the first failing call + 1 (-1 when the team cannot start). A call that
// waited for a held worker would never return.
struct check_call {
    int hits[64];
};

static void check_fn(void *arg, int tid) {
    struct check_call *c = arg;
    __atomic_add_fetch(&c->hits[tid < 64 ? tid : 63], 1, __ATOMIC_RELAXED);
}

int ft_team_check(int size, int calls, unsigned seed, long spin_ns, int held) {
    if (size < 1 || size > 63 || held < 0 || held >= size) return -1;
    ft_team *t = ft_team_new(size, spin_ns);
    if (!t) return -1;
    __atomic_store_n(&t->held, held, __ATOMIC_RELAXED);
    int failed = 0;
    for (int i = 0; i < calls && !failed; i++) {
        seed = seed * 1103515245u + 12345u;
        const int threads = 1 + (int)((seed >> 16) % (unsigned)(size + 1));
        struct check_call c = {{0}};
        ft_team_run(t, threads, check_fn, &c);
        const int most = threads < size - held ? threads : size - held;  // the caller and free workers
        int ran = 0;
        while (ran < 64 && __atomic_load_n(&c.hits[ran], __ATOMIC_RELAXED) == 1) ran++;
        for (int tid = ran; tid < 64; tid++)
            if (__atomic_load_n(&c.hits[tid], __ATOMIC_RELAXED) != 0) failed = i + 1;
        if (ran < 1 || ran > most) failed = i + 1;
    }
    ft_team_free(t);
    return failed;
}
