/* A persistent thread pool for the CPU kernels (pool.c): the calling thread and up to
 * threads - 1 workers take task indexes of one job from a shared counter; the caller
 * returns once every task has been completed, and never waits for a worker that has not
 * started: if the other cores are busy the caller runs every task itself, so a job is never
 * slower than on one thread by more than about one task.
 *
 * Not for nesting: a job published while another is running (a task that calls
 * mstar_parallel_for, or a second thread calling at the same time) runs its tasks in the
 * calling thread, in order. Tasks must not depend on which thread runs them, nor on their
 * order; each task index of a job runs exactly once.
 */
#ifndef MSTAR_POOL_H
#define MSTAR_POOL_H

typedef void (*mstar_task_fn)(void *ctx, int task);

/* Threads a job runs on by default: the caller and mstar_pool_threads() - 1 workers. */
int mstar_pool_threads(void);

/* Set the default thread count (1: no pool); starts or stops workers. Not from a task. */
void mstar_pool_set_threads(int threads);

/* Run fn(ctx, 0 .. ntasks - 1), each exactly once, on the default thread count. */
void mstar_parallel_for(int ntasks, mstar_task_fn fn, void *ctx);

/* The same on up to `threads` threads (<= 0: the default); workers are started if the pool
 * has fewer (they stay). */
void mstar_parallel_for_n(int ntasks, int threads, mstar_task_fn fn, void *ctx);

#endif
