/* A persistent thread pool for the native hot paths (header-only, pthreads).
 *
 *   xt_pool_run(n, fn, ctx)   runs fn(ctx, tid, n) for every tid in 0 .. n-1 and returns when
 *                             all have returned: tid 0 on the calling thread, the others on
 *                             persistent workers.
 *
 * Each shared library that includes this header has its own pool (the state is `static`): one
 * pool per library, created lazily on the first call that needs a worker and grown to the
 * largest n asked for (at most XT_POOL_MAX threads; n is clamped to it). Workers wait for work
 * by spinning for XT_POOL_SPIN_NS (default 50 us; environment variable XT_POOL_SPIN_US
 * overrides it, 0 = sleep at once), then sleep on a condition variable, so an idle engine burns
 * no CPU and a pool used every few hundred microseconds (a decode step's layers) wakes without a
 * syscall.
 *
 * Guarantees:
 * - every tid runs exactly once per call, even when a worker thread cannot be created (its tids
 *   then run on the caller after its own share) or the pool is busy: a call made while another
 *   call is in flight (another Python thread with the GIL released, or fn itself calling
 *   xt_pool_run) runs all its tids on its own thread, one after the other, instead of waiting;
 * - fn(ctx, tid, n) must not assume which OS thread runs a tid, only that distinct tids of one
 *   call may run concurrently;
 * - after fork() the child starts with an empty pool (pthread_atfork), created again on use.
 *
 * Callers reach it through ctypes, which releases the GIL for the whole native call.
 *
 * OpenMP instead of the pool's own workers: after xt_pool_use_omp_(parallel, thread_num,
 * num_threads) is given libgomp's GOMP_parallel, omp_get_thread_num and omp_get_num_threads
 * (those of the OpenMP runtime the process already runs: torch's, so that the kernels run on
 * the same worker threads as torch's products, which are already awake between them, instead
 * of a second set of threads spinning beside them on the same cores), xt_pool_run runs
 * fn(ctx, tid, n) for every tid on an OpenMP team of n threads (the caller is thread 0; a team
 * smaller than n, e.g. a call made inside a parallel region, runs the remaining tids on its
 * threads in turn). The same guarantees hold. xt_pool_use_omp_(NULL, NULL, NULL) goes back to
 * the pool's own workers.
 */
#ifndef XLLM_VMM_THREADPOOL_H
#define XLLM_VMM_THREADPOOL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#ifndef XT_POOL_MAX
#define XT_POOL_MAX 64
#endif
#ifndef XT_POOL_SPIN_NS
#define XT_POOL_SPIN_NS 50000
#endif

typedef void (*xt_fn)(void *ctx, int tid, int n);

typedef struct {
    pthread_mutex_t run_lock;  /* one call in flight */
    pthread_mutex_t mu;        /* with `cv`: sleeping workers */
    pthread_cond_t cv;
    int nworkers;              /* workers started (tids 1 .. nworkers) */
    int spin_init;
    int64_t spin_ns;
    /* the task of the current generation */
    xt_fn fn;
    void *ctx;
    int n;
    unsigned long gen;         /* bumped once per call (atomic) */
    int remaining;             /* workers of this call still running (atomic) */
    int sleepers;              /* workers waiting on cv (atomic) */
    int atfork_done;
    unsigned long born_gen;    /* gen when the workers of the latest grow were created */
} xt_pool_t;

static xt_pool_t xt_pool_ = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
                             PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

static inline int64_t xt_now_ns_(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void xt_pause_(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

typedef void (*xt_gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*xt_omp_int_t)(void);
static xt_gomp_parallel_t xt_gomp_parallel_;
static xt_omp_int_t xt_omp_thread_num_, xt_omp_num_threads_;

static void *xt_worker_(void *arg) {
    xt_pool_t *p = &xt_pool_;
    int tid = (int)(intptr_t)arg;
    /* the generation before the call that created this worker (it may start running after
       that call bumped gen, and must still take that call's task) */
    unsigned long seen = __atomic_load_n(&p->born_gen, __ATOMIC_ACQUIRE);
    for (;;) {
        unsigned long g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
        if (g == seen) {
            int64_t t0 = p->spin_ns > 0 ? xt_now_ns_() : 0;
            int k = 0;
            while (p->spin_ns > 0 && (g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE)) == seen) {
                xt_pause_();
                if ((++k & 63) == 0 && xt_now_ns_() - t0 > p->spin_ns) break;
            }
            if (g == seen) {
                pthread_mutex_lock(&p->mu);
                __atomic_add_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
                while ((g = __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST)) == seen)
                    pthread_cond_wait(&p->cv, &p->mu);
                __atomic_sub_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
                pthread_mutex_unlock(&p->mu);
            }
        }
        seen = g;
        /* fn, ctx and n were published before gen (release); a worker beyond this call's n
           has nothing to do but is still counted in `remaining` (every started worker is) */
        if (tid < p->n) p->fn(p->ctx, tid, p->n);
        __atomic_sub_fetch(&p->remaining, 1, __ATOMIC_ACQ_REL);
    }
    return NULL;
}

static void xt_atfork_child_(void) {
    /* the child has only the forking thread: no workers, every lock free; and an OpenMP
       runtime whose team threads are gone (libgomp would wait for them), so the child goes
       back to the pool's own workers */
    xt_pool_t *p = &xt_pool_;
    __atomic_store_n(&xt_gomp_parallel_, (xt_gomp_parallel_t)NULL, __ATOMIC_RELEASE);
    pthread_mutex_init(&p->run_lock, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->nworkers = 0;
    p->remaining = 0;
    p->sleepers = 0;
}

/* start workers up to tids 1 .. want-1 (run_lock held); returns how many are running */
/* register the fork handler once (run_lock held) */
static void xt_atfork_once_(xt_pool_t *p) {
    if (!p->atfork_done) {
        pthread_atfork(NULL, NULL, xt_atfork_child_);
        p->atfork_done = 1;
    }
}

static int xt_grow_(xt_pool_t *p, int want) {
    xt_atfork_once_(p);
    if (!p->spin_init) {
        const char *s = getenv("XT_POOL_SPIN_US");
        p->spin_ns = s && *s ? (int64_t)atol(s) * 1000 : XT_POOL_SPIN_NS;
        p->spin_init = 1;
    }
    __atomic_store_n(&p->born_gen, __atomic_load_n(&p->gen, __ATOMIC_RELAXED), __ATOMIC_RELEASE);
    while (p->nworkers < want - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, xt_worker_, (void *)(intptr_t)(p->nworkers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        p->nworkers++;
    }
    return p->nworkers;
}

/* Use the OpenMP runtime whose entry points these are (all three, or NULL for none). */
static inline int xt_pool_use_omp_(void *parallel, void *thread_num, void *num_threads) {
    xt_pool_t *p = &xt_pool_;
    pthread_mutex_lock(&p->run_lock);
    xt_atfork_once_(p); /* a forked child must not use the parent's OpenMP team */
    pthread_mutex_unlock(&p->run_lock);
    if (!parallel || !thread_num || !num_threads) {
        __atomic_store_n(&xt_gomp_parallel_, (xt_gomp_parallel_t)NULL, __ATOMIC_RELEASE);
        return 0;
    }
    xt_omp_thread_num_ = (xt_omp_int_t)thread_num;
    xt_omp_num_threads_ = (xt_omp_int_t)num_threads;
    __atomic_store_n(&xt_gomp_parallel_, (xt_gomp_parallel_t)parallel, __ATOMIC_RELEASE);
    return 1;
}

typedef struct {
    xt_fn fn;
    void *ctx;
    int n;
} xt_omp_job_t;

static void xt_omp_body_(void *arg) {
    const xt_omp_job_t *j = (const xt_omp_job_t *)arg;
    int step = xt_omp_num_threads_();
    if (step < 1) step = 1;
    for (int t = xt_omp_thread_num_(); t < j->n; t += step) j->fn(j->ctx, t, j->n);
}

static inline void xt_pool_run(int n, xt_fn fn, void *ctx) {
    xt_pool_t *p = &xt_pool_;
    if (n < 1) n = 1;
    if (n > XT_POOL_MAX) n = XT_POOL_MAX;
    xt_gomp_parallel_t par = __atomic_load_n(&xt_gomp_parallel_, __ATOMIC_ACQUIRE);
    if (n > 1 && par) {
        xt_omp_job_t j = {fn, ctx, n};
        par(xt_omp_body_, &j, (unsigned)n, 0);
        return;
    }
    if (n == 1 || pthread_mutex_trylock(&p->run_lock) != 0) {
        for (int t = 0; t < n; t++) fn(ctx, t, n);
        return;
    }
    int w = xt_grow_(p, n);
    if (w == 0) {
        pthread_mutex_unlock(&p->run_lock);
        for (int t = 0; t < n; t++) fn(ctx, t, n);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    __atomic_store_n(&p->remaining, w, __ATOMIC_RELAXED);
    __atomic_add_fetch(&p->gen, 1, __ATOMIC_SEQ_CST); /* publishes fn/ctx/n */
    if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    fn(ctx, 0, n);
    for (int t = w + 1; t < n; t++) fn(ctx, t, n); /* tids no worker could be started for */
    int k = 0;
    while (__atomic_load_n(&p->remaining, __ATOMIC_ACQUIRE) > 0) {
        xt_pause_();
        if ((++k & 1023) == 0) sched_yield();
    }
    pthread_mutex_unlock(&p->run_lock);
}

#endif /* XLLM_VMM_THREADPOOL_H */
