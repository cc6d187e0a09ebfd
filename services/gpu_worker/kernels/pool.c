/* The CPU kernels' thread pool (pool.h): persistent workers that spin briefly after each job
 * (the gaps between a decode step's GEMMs are ~5-30 us of Python), then sleep on a futex.
 *
 * One job at a time. The caller writes the job (fn, ctx, ntasks, threads), opens its task
 * slots (slot[s] = generation << 1: tasks in up to SLOTS runs), then publishes `seq` = the
 * generation (the workers' futex word, woken only when one sleeps). Everyone, the caller
 * included, claims a slot by a CAS from "open in generation g" to "claimed": a worker that
 * read an older job's descriptor expects its own generation, which no slot holds any more,
 * so it can never run a newer job's task with an old job's pointers. Each thread starts at
 * its own share of the slots (the caller at the first, worker i at the (i + 1)-th of
 * `threads`) and goes on round the rest, so on an idle machine each thread gets the same
 * columns call after call (they stay in its L2), and a late thread's share is taken by the
 * others. Finished slots are counted in `done`; the caller waits until the workers have
 * finished every slot they claimed (spinning, then on a futex), never for a worker that has
 * not claimed one: with the other cores busy it runs every task itself.
 *
 * A worker that finds it was descheduled while spinning (a jump of the clock) sleeps at once,
 * and a spinning worker yields every few microseconds: spinning on a core another thread
 * wants only slows both. fork() leaves the child with no workers; its first job starts them.
 *
 * Tunables (environment, read at the first job): MSTAR_POOL_SPIN_US, how long an idle worker
 * spins before it sleeps (default 100); MSTAR_POOL_YIELD_US, how often a working worker yields
 * between tasks (default 10).
 */
#define _GNU_SOURCE
#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 64
#define SLOTS 1024 /* a job's tasks are claimed in at most this many runs */
#define PREEMPTED_NS 40000 /* a clock jump this long while spinning: the worker was descheduled */
#define YIELD_NS 8000      /* a spinning worker yields this often (lets a thread sharing its core run) */
#define WORK_YIELD_NS 10000 /* and a working one between tasks: descheduled then, it holds none */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t value) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word, int n) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static struct {
    _Alignas(64) _Atomic uint32_t slot[SLOTS]; /* generation << 1 | claimed */
    _Alignas(64) _Atomic uint32_t done;        /* slots the workers finished in this job */
    _Atomic uint32_t caller_waiting;           /* the caller sleeps on `done` */
    _Alignas(64) _Atomic uint32_t seq;         /* generation of the latest job: the workers' futex word */
    _Atomic uint32_t sleepers;
    _Atomic(mstar_task_fn) fn;                /* the job, written before `seq` is published */
    _Atomic(void *) ctx;
    _Atomic int ntasks, per, nslots, nthreads;
    _Alignas(64) _Atomic int busy;             /* a job is being run (another one runs inline) */
    _Atomic int keep;                          /* workers with an index below this stay */
    _Atomic int64_t spin_ns;
    int started;                               /* workers running (indexes 0 .. started - 1) */
    int threads;                               /* the default thread count */
    uint32_t gen;                              /* the latest generation (31 bits, never 0) */
    pthread_t tids[MAX_THREADS];
    uint32_t born[MAX_THREADS];                /* the generation each worker was started at */
    _Atomic int64_t stats[4];                  /* jobs, tasks, tasks run by workers, wakes */
} P = {.threads = 1, .spin_ns = 100000};

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int64_t work_yield_ns = WORK_YIELD_NS;

static uint32_t next_gen(void) {
    P.gen = (P.gen + 1) & 0x7FFFFFFF;
    if (!P.gen) P.gen = 1;
    return P.gen;
}

/* claim and run open slots of generation g, from slot `home` round; returns how many */
static uint32_t claim(uint32_t g, int home, int nslots, int per, int ntasks, mstar_task_fn fn, void *ctx,
                      int worker) {
    const uint32_t open = g << 1;
    uint32_t ran = 0;
    int64_t since = worker ? now_ns() : 0;
    for (int i = 0; i < nslots; i++) {
        const int s = home + i < nslots ? home + i : home + i - nslots;
        uint32_t v = atomic_load_explicit(&P.slot[s], memory_order_relaxed);
        if (v != open || !atomic_compare_exchange_strong(&P.slot[s], &v, open | 1)) continue;
        const int t1 = (s + 1) * per < ntasks ? (s + 1) * per : ntasks;
        for (int t = s * per; t < t1; t++) fn(ctx, t);
        ran++;
        if (worker) {
            atomic_fetch_add(&P.done, 1);
            if (atomic_load(&P.caller_waiting)) futex_wake(&P.done, 1);
            const int64_t t = now_ns();
            if (t - since > work_yield_ns) { /* holding no task: let a thread waiting for this core run now */
                sched_yield();
                since = t;
            }
        }
    }
    return ran;
}

/* a worker's part of job g (nothing if that job is over: no slot is open in g any more) */
static void help(int index, uint32_t g) {
    mstar_task_fn fn = atomic_load_explicit(&P.fn, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&P.ctx, memory_order_relaxed);
    const int ntasks = atomic_load_explicit(&P.ntasks, memory_order_relaxed);
    const int per = atomic_load_explicit(&P.per, memory_order_relaxed);
    const int nslots = atomic_load_explicit(&P.nslots, memory_order_relaxed);
    const int nthreads = atomic_load_explicit(&P.nthreads, memory_order_relaxed);
    if (index + 1 >= nthreads || nslots <= 0 || nslots > SLOTS) return;
    const int home = (int)((int64_t)(index + 1) * nslots / nthreads);
    claim(g, home, nslots, per, ntasks, fn, ctx, 1);
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = P.born[index]; /* a thread first run late still sees what came since */
    for (;;) {
        uint32_t s = atomic_load_explicit(&P.seq, memory_order_acquire);
        if (s == seen) {
            const int64_t spin = atomic_load_explicit(&P.spin_ns, memory_order_relaxed);
            const int64_t t0 = now_ns();
            int64_t last = t0, yielded = t0;
            for (unsigned i = 1; (s = atomic_load_explicit(&P.seq, memory_order_acquire)) == seen; i++) {
                cpu_relax();
                if (i % 32) continue;
                int64_t t = now_ns();
                if (t - t0 > spin || t - last > PREEMPTED_NS) break;
                if (t - yielded > YIELD_NS) {
                    sched_yield();
                    yielded = t = now_ns();
                    if (t - last > PREEMPTED_NS) break; /* something else ran on this core */
                }
                last = t;
            }
            if (s == seen) {
                atomic_fetch_add(&P.sleepers, 1);
                while ((s = atomic_load(&P.seq)) == seen) futex_wait(&P.seq, seen);
                atomic_fetch_sub(&P.sleepers, 1);
            }
        }
        seen = s;
        if (index >= atomic_load(&P.keep)) return NULL;
        help(index, s);
    }
}

static void after_fork_child(void) {
    P.started = 0;
    atomic_store(&P.keep, 0);
    atomic_store(&P.busy, 0);
    atomic_store(&P.sleepers, 0);
    atomic_store(&P.caller_waiting, 0);
}

static void init(void) {
    const char *env = getenv("MSTAR_POOL_SPIN_US");
    if (env && *env) atomic_store(&P.spin_ns, (int64_t)(atof(env) * 1000));
    env = getenv("MSTAR_POOL_YIELD_US");
    if (env && *env) work_yield_ns = (int64_t)(atof(env) * 1000);
    pthread_atfork(NULL, NULL, after_fork_child);
}

/* a new generation with no tasks (wakes every worker: those past `keep` exit) */
static void publish_empty(void) {
    atomic_store_explicit(&P.nslots, 0, memory_order_relaxed);
    atomic_store(&P.seq, next_gen());
    futex_wake(&P.seq, INT_MAX);
}

/* workers 0 .. want - 1 running (called holding `busy`) */
static void resize(int want) {
    if (want > MAX_THREADS - 1) want = MAX_THREADS - 1;
    if (want < 0) want = 0;
    if (want < P.started) {
        atomic_store(&P.keep, want);
        publish_empty();
        for (int i = want; i < P.started; i++) pthread_join(P.tids[i], NULL);
        P.started = want;
        return;
    }
    atomic_store(&P.keep, want);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* workers take no signals */
    while (P.started < want) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        P.born[P.started] = P.gen;
        int rc = pthread_create(&P.tids[P.started], &attr, worker_main, (void *)(intptr_t)P.started);
        pthread_attr_destroy(&attr);
        if (rc) break; /* fewer workers: the caller does their part */
        P.started++;
    }
    atomic_store(&P.keep, P.started);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static int acquire(void) {
    int expected = 0;
    return atomic_compare_exchange_strong(&P.busy, &expected, 1);
}

int mstar_pool_threads(void) { return P.threads; }

void mstar_pool_set_threads(int threads) {
    pthread_once(&once, init);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    while (!acquire()) sched_yield();
    P.threads = threads;
    resize(threads - 1);
    atomic_store(&P.busy, 0);
}

void mstar_pool_stats(int64_t *out) {
    for (int i = 0; i < 4; i++) out[i] = atomic_load_explicit(&P.stats[i], memory_order_relaxed);
}

void mstar_parallel_for(int ntasks, mstar_task_fn fn, void *ctx) { mstar_parallel_for_n(ntasks, 0, fn, ctx); }

void mstar_parallel_for_n(int ntasks, int threads, mstar_task_fn fn, void *ctx) {
    if (ntasks <= 0) return;
    if (threads <= 0) threads = P.threads;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 2 || ntasks < 2 || !acquire()) {
        for (int i = 0; i < ntasks; i++) fn(ctx, i);
        return;
    }
    pthread_once(&once, init);
    if (P.started < threads - 1) resize(threads - 1);
    const uint32_t g = next_gen();
    const int per = (ntasks + SLOTS - 1) / SLOTS, nslots = (ntasks + per - 1) / per;
    atomic_store_explicit(&P.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&P.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&P.ntasks, ntasks, memory_order_relaxed);
    atomic_store_explicit(&P.per, per, memory_order_relaxed);
    atomic_store_explicit(&P.nslots, nslots, memory_order_relaxed);
    atomic_store_explicit(&P.nthreads, threads, memory_order_relaxed);
    for (int s = 0; s < nslots; s++) atomic_store_explicit(&P.slot[s], g << 1, memory_order_relaxed);
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    atomic_store(&P.seq, g); /* releases all of the above */
    if (atomic_load(&P.sleepers)) {
        futex_wake(&P.seq, threads - 1);
        atomic_fetch_add_explicit(&P.stats[3], 1, memory_order_relaxed);
    }
    const uint32_t theirs = (uint32_t)nslots - claim(g, 0, nslots, per, ntasks, fn, ctx, 0);
    if (atomic_load(&P.done) != theirs) {
        const int64_t t0 = now_ns();
        for (unsigned i = 1; atomic_load(&P.done) != theirs; i++) {
            cpu_relax();
            if (i % 32 == 0 && now_ns() - t0 > 20000) { /* a worker holds a slot: sleep until it ends */
                atomic_store(&P.caller_waiting, 1);
                uint32_t d;
                while ((d = atomic_load(&P.done)) != theirs) futex_wait(&P.done, d);
                atomic_store(&P.caller_waiting, 0);
                break;
            }
        }
    }
    atomic_fetch_add_explicit(&P.stats[0], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&P.stats[1], ntasks, memory_order_relaxed);
    atomic_fetch_add_explicit(&P.stats[2], (int64_t)theirs * per, memory_order_relaxed);
    atomic_store(&P.busy, 0);
}

/* Self-check for tests: `jobs` jobs of `ntasks` tasks on `threads` threads, each task adding
 * one to its own slot (and a little work, varied); returns how many slots were not exactly 1. */
struct check_ctx {
    _Atomic int *hits;
    int job;
};

static void check_task(void *p, int task) {
    struct check_ctx *c = (struct check_ctx *)p;
    volatile double x = 0;
    for (int i = 0; i < (task * 7 + c->job) % 50; i++) x += i;
    atomic_fetch_add(&c->hits[task], 1);
}

int64_t mstar_pool_check(int jobs, int ntasks, int threads) {
    _Atomic int *hits = calloc((size_t)ntasks, sizeof *hits);
    if (!hits) return -1;
    int64_t bad = 0;
    for (int j = 0; j < jobs; j++) {
        for (int t = 0; t < ntasks; t++) atomic_store(&hits[t], 0);
        struct check_ctx c = {hits, j};
        mstar_parallel_for_n(ntasks - j % 3, threads, check_task, &c);
        for (int t = 0; t < ntasks - j % 3; t++) bad += atomic_load(&hits[t]) != 1;
        for (int t = ntasks - j % 3; t < ntasks; t++) bad += atomic_load(&hits[t]) != 0;
    }
    free(hits);
    return bad;
}
