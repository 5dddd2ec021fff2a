/* The thread pool of the package's C kernels (dykstra_cpu.c, plan_product_cpu.c): a parallel for over contiguous
 * ranges on pthreads. Included by each kernel file (one translation unit each). */
#ifndef S2T2_PARALLEL_H
#define S2T2_PARALLEL_H
#include <pthread.h>
#include <stdint.h>

typedef void (*range_fn)(void *ctx, int64_t lo, int64_t hi, int tid);

typedef struct {
    range_fn fn;
    void *ctx;
    int64_t lo, hi;
    int tid;
} job_t;

static void *run_job(void *a) {
    job_t *j = (job_t *)a;
    j->fn(j->ctx, j->lo, j->hi, j->tid);
    return NULL;
}

/* fn over [0, n) split into nthreads contiguous ranges; the caller runs the first (no OpenMP: torch links its own
 * runtime, and two in one process oversubscribe) */
static void parallel_for(int64_t n, int nthreads, range_fn fn, void *ctx) {
    if (nthreads > n) nthreads = (int)n;
    if (nthreads <= 1) {
        if (n > 0) fn(ctx, 0, n, 0);
        return;
    }
    job_t jobs[64];
    pthread_t th[64];
    int started[64];
    if (nthreads > 64) nthreads = 64;
    for (int k = 0; k < nthreads; k++) {
        jobs[k] = (job_t){fn, ctx, n * k / nthreads, n * (k + 1) / nthreads, k};
        started[k] = 0;
    }
    for (int k = 1; k < nthreads; k++) started[k] = pthread_create(&th[k], NULL, run_job, &jobs[k]) == 0;
    for (int k = 1; k < nthreads; k++)
        if (!started[k]) run_job(&jobs[k]); /* no thread: run it here */
    run_job(&jobs[0]);
    for (int k = 1; k < nthreads; k++)
        if (started[k]) pthread_join(th[k], NULL);
}

#endif
