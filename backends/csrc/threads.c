/* threads.c: how many threads a parallel region takes (part of the unity build cpu_kernels.c,
 * included first: it defines _GNU_SOURCE for sched_getaffinity).
 *
 * Why: every parallel region ends in a barrier that waits for its slowest thread, and libgomp's
 * waiting threads spin. When another process holds one of the cores, one of our threads shares a
 * core with it and each of the ~200 regions of a decode step waits for that thread's turn: on a
 * 2-core machine beside one busy process a 24-token chat took 1.1-3.5 s with two threads against
 * 0.22-0.39 s with one. Passive waits (OMP_WAIT_POLICY=passive, GOMP_SPINCOUNT=10000) only brought
 * two threads to 0.45-1.1 s: the barrier still waits for the thread that is not running.
 *
 * So, in adaptive mode (the default; METATP_ADAPTIVE_THREADS=0 or metatp_thread_governor(0) turns
 * it off), a region takes at most as many threads as there are CPUs that other processes leave
 * free. Every GOVERNOR_INTERVAL_NS the first region due reads the busy time of the CPUs this
 * process may run on (/proc/stat) and this process's own CPU time; what is busy beyond our own
 * use is other processes' load, and the cap is the CPUs left, rounded, at least one. No probing:
 * the other processes' load is seen whatever count we run, so the cap rises as soon as they stop.
 * The count changes who computes a row, never what: the bits never depend on it (the kernels'
 * tests check bit-identity across thread counts). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sched.h>
#endif

/* /proc/stat counts in ticks of 10 ms: a window of 100 ms sees another process's load to
 * about +-0.2 of a CPU; a step of a small model takes a few ms, so the check costs nothing. */
#define GOVERNOR_INTERVAL_NS 100000000LL

typedef struct {
    int64_t wall_ns;        /* CLOCK_MONOTONIC */
    int64_t own_ns;         /* this process's CPU time, all threads */
    int64_t busy_ticks;     /* user + nice + system + irq + softirq of the CPUs we may use */
    int ncpu;               /* how many CPUs we may use */
} LoadSample;

static atomic_int gov_mode;                         /* 0: fixed counts; 1: adaptive */
static atomic_int gov_cap = INT_MAX;                /* the most threads a region takes now */
static atomic_llong gov_next_ns = LLONG_MAX;        /* when the next check is due */
static atomic_int gov_others_milli = -1;            /* other processes' load of the last window, in 1/1000 CPU */
static LoadSample gov_last;                         /* touched only by the thread doing a check */
static int gov_have_last;

static int64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Fill `s` now; 0 where /proc/stat or the affinity cannot be read (nothing is adapted then). */
static int load_sample(LoadSample *s) {
#ifdef __linux__
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed)) return 0;
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return 0;
    char line[512];
    int64_t busy = 0;
    int ncpu = 0;
    while (fgets(line, sizeof line, f) && strncmp(line, "cpu", 3) == 0) {   /* the cpu lines come first */
        int cpu;
        long long user, nice, sys, idle, iowait, irq, softirq;
        if (sscanf(line, "cpu%d %lld %lld %lld %lld %lld %lld %lld", &cpu, &user, &nice, &sys, &idle,
                   &iowait, &irq, &softirq) != 8)
            continue;                                   /* the "cpu " total line */
        if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed)) continue;
        busy += user + nice + sys + irq + softirq;
        ncpu++;
    }
    fclose(f);
    if (ncpu == 0) return 0;
    s->wall_ns = clock_ns(CLOCK_MONOTONIC);
    s->own_ns = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
    s->busy_ticks = busy;
    s->ncpu = ncpu;
    return 1;
#else
    (void)s;
    return 0;
#endif
}

/* The cap for `ncpu` CPUs of which other processes keep `others` busy (in CPUs, averaged over the
 * window): the CPUs they leave, rounded to the nearest, between 1 and ncpu. Beside one spinning
 * process two threads on 2 CPUs see others ~0.67 (three threads share two CPUs): cap 1. */
int metatp_team_cap_for(int64_t ncpu, double others) {
    const double left = (double)ncpu - (others > 0 ? others : 0);     /* CPUs the others leave */
    const int64_t cap = (int64_t)(left + 0.5);                         /* to the nearest */
    return (int)(cap < 1 ? 1 : cap > ncpu ? ncpu : cap);
}

/* Take a sample if one is due and set the cap from the window since the last one. The
 * compare-exchange lets one thread in; it publishes the next due time when done (release), so
 * the next thread in sees gov_last written. */
static void governor_tick(void) {
    long long due = atomic_load_explicit(&gov_next_ns, memory_order_relaxed);
    const int64_t now = clock_ns(CLOCK_MONOTONIC);
    if (now < due || !atomic_compare_exchange_strong_explicit(&gov_next_ns, &due, LLONG_MAX,
                                                              memory_order_acquire, memory_order_relaxed))
        return;
    LoadSample s;
    if (!load_sample(&s)) return;                       /* gov_next_ns stays LLONG_MAX: never again */
    if (gov_have_last && s.wall_ns > gov_last.wall_ns && s.ncpu == gov_last.ncpu) {   /* not across an affinity change */
        const double ticks_ns = 1e9 / (double)sysconf(_SC_CLK_TCK);
        const double busy_ns = (double)(s.busy_ticks - gov_last.busy_ticks) * ticks_ns;
        double others = (busy_ns - (double)(s.own_ns - gov_last.own_ns)) / (double)(s.wall_ns - gov_last.wall_ns);
        others = others > 0 ? others : 0;                               /* tick noise */
        atomic_store_explicit(&gov_cap, metatp_team_cap_for(s.ncpu, others), memory_order_relaxed);
        atomic_store_explicit(&gov_others_milli, (int)(others * 1000), memory_order_relaxed);
    }
    gov_last = s;
    gov_have_last = 1;
    atomic_store_explicit(&gov_next_ns, s.wall_ns + GOVERNOR_INTERVAL_NS, memory_order_release);
}

/* The threads a region that wants `wanted` takes: `wanted`, or fewer in adaptive mode while other
 * processes hold CPUs. */
static int team_size(int64_t wanted) {
    if (wanted <= 1) return 1;
    if (!atomic_load_explicit(&gov_mode, memory_order_relaxed)) return (int)wanted;
    governor_tick();
    const int cap = atomic_load_explicit(&gov_cap, memory_order_relaxed);
    return wanted < cap ? (int)wanted : cap;
}

/* mode 1: adaptive (starts a fresh window: the first check is due GOVERNOR_INTERVAL_NS from
 * now); 0: every region takes the count it asks for; -1: only ask. Returns the mode before. Not
 * meant to race with running kernels (the library sets it once when it loads; tests switch it
 * between calls). */
int metatp_thread_governor(int mode) {
    const int before = atomic_load(&gov_mode);
    if (mode < 0) return before;
    atomic_store(&gov_next_ns, LLONG_MAX);
    atomic_store(&gov_cap, INT_MAX);
    atomic_store(&gov_others_milli, -1);
    gov_have_last = 0;
    if (mode && load_sample(&gov_last)) {
        gov_have_last = 1;
        atomic_store(&gov_next_ns, gov_last.wall_ns + GOVERNOR_INTERVAL_NS);
    }
    atomic_store(&gov_mode, mode ? 1 : 0);
    return before;
}

/* team_size for the tests: what a region asking `wanted` threads takes now. */
int metatp_team_size(int64_t wanted) {
    return team_size(wanted);
}

/* Other processes' load (CPUs, x1000) the last check saw; -1 before any. For reports. */
int metatp_team_others_milli(void) {
    return atomic_load(&gov_others_milli);
}

/* The cap in force (INT_MAX: none yet, or not adaptive), for tests and reports. */
int metatp_team_cap(void) {
    return atomic_load(&gov_mode) ? atomic_load(&gov_cap) : INT_MAX;
}
