// A team of threads kept spinning between calls, for the CPU branch's coordinator (branch_coordinator.c):
// a call raises a generation number the workers poll, so the team starts and joins in about a
// microsecond, where OpenMP's team of a thread parks its threads after 100 pauses once the process's
// OpenMP threads outnumber its CPUs (libgomp's throttled spin) — and a second team, the prompt path's from
// the main thread, is enough for that at 9 or more threads a team on 16 cores.
#ifndef FT_SPIN_TEAM_H
#define FT_SPIN_TEAM_H

typedef struct ft_team ft_team;
typedef void (*ft_team_fn)(void *arg, int tid);

// A team of `size` threads, the caller of ft_team_run included (size - 1 workers) that spin `spin_ns`
// after a call, then nap (20 µs, 1 ms once idle for 100 ms); NULL on failure.
ft_team *ft_team_new(int size, long spin_ns);
int ft_team_size(const ft_team *t);
// fn(arg, tid) for tid 0 on the calling thread and tids 1 .. k - 1 on the workers that arrive while the
// call is open (k <= threads, at most the team's size); the caller's fn(arg, 0) closes it, so fn must hand
// out the call's work from a shared counter (tid 0 may end up doing all of it). Returns when every
// entered worker has returned. One caller at a time.
void ft_team_run(ft_team *t, int threads, ft_team_fn fn, void *arg);
// Ends and joins the workers (no call in flight).
void ft_team_free(ft_team *t);

// Tests: `calls` calls of seeded random thread counts on a fresh team with `held` workers that never enter;
// 0 when each call ran tid 0 and distinct tids 0 .. k - 1 within its threads.
int ft_team_check(int size, int calls, unsigned seed, long spin_ns, int held);

// The pause hint of a spin-wait loop (x86 pause, ARM yield): the spinning threads', the coordinator's and
// the expert kernel's own waits.
static inline void ft_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

// CLOCK_MONOTONIC in nanoseconds; a sleep of `ns` (under a second): the spinning threads' clock and nap.
long ft_now_ns(void);
void ft_nap(long ns);

#endif
