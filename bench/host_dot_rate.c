/* One core's rate through the CPU share's 8-bit dot product (engine/kernels/host_experts.c's row_dot8: vpdpbusd where
   built) over Q4_0 rows in the split layout, with no pool around it: GB/s of blocks, best of the repeats, for a
   matrix that sits in a core's L2 (gate-like 512 x 2048 and down-like 2048 x 512, 590 KB each), one the size of
   a pair's three matrices (1.77 MB) and one far over the caches (151 MB, read once a repeat).

       cc -O3 -march=native -pthread bench/host_dot_rate.c -o /tmp/host_dot_rate -lm && /tmp/host_dot_rate [quick]

   "quick": the two L2-sized matrices only, three repeats (for the tests).

       /tmp/host_dot_rate threads T [KB] [cols] [MB]

   T threads, each pinned to a CPU of the process's mask and given its own regions of KB kilobytes (default 392: a
   thread's gate/up share of a 5-pair job over 15 threads) of rows of `cols` columns (default 2048), enough regions
   that they far exceed the caches (MB in all, default 600). Each round, all threads at once: a fresh region computed cold; a fresh region
   read a byte a line (the pool's warm-up by loads, -DLT_WARM_LOAD=1), then computed; a fresh region prefetched a
   line at a time (prefetcht1, the default warm-up), then computed. Medians over the rounds of each thread's time
   per phase, mean over the threads and the slowest thread, and GB/s a thread: whether a warmed region is computed
   at the rate of a core's cache when every core works at once, as the pool's threads do. */
#include "../engine/kernels/host_experts.c"
#include <stdio.h>

#define ROUNDS 40  /* the threads mode's rounds */

/* A row of activations in 8 bits and `rows` Q4_0 rows of `cols` columns in the split layout (codes, then scales of
   2^-11), the row's buffers and the blocks allocated here (the blocks first touched by the calling thread). */
typedef struct {
    uint8_t *w;
    int8_t *q;
    float *x, *d, *c;
} rows_t;

static rows_t make_rows(int64_t rows, int cols, int seed) {
    const int nb = cols / 32;
    const int64_t rb = (int64_t)nb * 18;
    rows_t t = {(uint8_t *)aligned_alloc(64, (size_t)(rows * rb + 63) / 64 * 64),
                (int8_t *)aligned_alloc(64, (size_t)cols), (float *)malloc((size_t)cols * sizeof(float)),
                (float *)malloc((size_t)nb * sizeof(float)), (float *)malloc((size_t)nb * sizeof(float))};
    if (!t.w || !t.q || !t.x || !t.d || !t.c) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (int64_t i = 0; i < rows * rb; i++) t.w[i] = (uint8_t)((uint64_t)i * 2654435761u >> 13);
    for (int64_t r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) { uint16_t h = 0x2000; memcpy(t.w + r * rb + (int64_t)nb * 16 + 2 * b, &h, 2); }
    for (int i = 0; i < cols; i++) t.x[i] = sinf((float)(i + seed));
    quantize_row8(t.x, cols, t.q, t.d, t.c);
    return t;
}

static void free_rows(rows_t *t) { free(t->w); free(t->q); free(t->x); free(t->d); free(t->c); }

static double rate(int rows, int cols, int reps) {
    const int64_t rb = (int64_t)(cols / 32) * 18;
    rows_t r8 = make_rows(rows, cols, 0);
    matrix_t m = {r8.w, rows * rb, rb, rows, cols, QT_Q4_0, 1, 1};
    volatile float sink = 0.0f;
    int64_t best = INT64_MAX;
    for (int k = 0; k < reps; k++) {
        const int64_t t0 = now_ns();
        float s = 0.0f;
        for (int r = 0; r < rows; r++) s += row_dot8(&m, r8.w + r * rb, r8.q, r8.d, r8.c);
        const int64_t t = now_ns() - t0;
        sink += s;
        if (t < best) best = t;
    }
    free_rows(&r8);
    return (double)(rows * rb) / (double)best;
}

typedef struct {
    int index, cpu, rows, cols, nreg;
    pthread_barrier_t *bar;
    int64_t *ns;  /* [ROUNDS][5]: cold, warm by loads, computed after it, warm by prefetches, computed after it */
    double sink;
} bench_thread_t;

static void *bench_main(void *arg) {
    bench_thread_t *t = (bench_thread_t *)arg;
    if (t->cpu >= 0) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(t->cpu, &one);
        pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
    }
    const int64_t rb = (int64_t)(t->cols / 32) * 18, bytes = t->rows * rb;
    rows_t r8 = make_rows((int64_t)t->rows * t->nreg, t->cols, t->index);  /* first touched by this thread */
    const uint8_t *w = r8.w;
    matrix_t m = {r8.w, bytes, rb, t->rows, t->cols, QT_Q4_0, 1, t->nreg};
    int reg = 0;
    float s = 0.0f;
    for (int k = 0; k < ROUNDS; k++) {
        for (int phase = 0; phase < 3; phase++) {
            const uint8_t *base = w + (int64_t)(reg++ % t->nreg) * bytes;
            pthread_barrier_wait(t->bar);
            int64_t t0 = now_ns(), t1 = t0;
            if (phase == 1) {
                uint8_t v = 0;
                for (int64_t o = 0; o < bytes; o += 64) v ^= *(const volatile uint8_t *)(base + o);
                __asm__ volatile("" : : "r"(v));
                t1 = now_ns();
            } else if (phase == 2) {
                for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + o, 0, 2);
                t1 = now_ns();
            }
            if (phase) pthread_barrier_wait(t->bar);  /* every thread's region warmed before any computes */
            const int64_t t2 = now_ns();
            for (int r = 0; r < t->rows; r++) s += row_dot8(&m, base + r * rb, r8.q, r8.d, r8.c);
            const int64_t t3 = now_ns();
            int64_t *ns = t->ns + (int64_t)k * 5;
            if (phase == 0) ns[0] = t3 - t2;
            else { ns[2 * phase - 1] = t1 - t0; ns[2 * phase] = t3 - t2; }
        }
    }
    t->sink = s;
    free_rows(&r8);
    return NULL;
}

static int cmp64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int threads_mode(int nthreads, int kb, int cols, int total_mb) {
    if (nthreads < 1 || nthreads > 256 || kb < 1 || cols < 512 || cols % 512 || total_mb < 1) {
        fprintf(stderr, "threads T [KB] [cols] [MB]: T in 1-256, KB and MB positive, cols a multiple of 512\n");
        return 2;
    }
    const int nb = cols / 32, rows = (int)((int64_t)kb * 1024 / ((int64_t)nb * 18));
    if (rows < 1) { fprintf(stderr, "%d KB holds no row of %d columns\n", kb, cols); return 2; }
    const int nreg = (int)((int64_t)total_mb * 1024 * 1024 / nthreads / ((int64_t)rows * nb * 18)) + 3;
    cpu_set_t allowed;
    int cpus[256], ncpu = 0;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0)
        for (int c = 0; c < CPU_SETSIZE && ncpu < 256; c++) if (CPU_ISSET(c, &allowed)) cpus[ncpu++] = c;
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)nthreads);
    bench_thread_t *ts = (bench_thread_t *)calloc((size_t)nthreads, sizeof(bench_thread_t));
    pthread_t *th = (pthread_t *)calloc((size_t)nthreads, sizeof(pthread_t));
    for (int i = 0; i < nthreads; i++) {
        ts[i] = (bench_thread_t){i, ncpu ? cpus[i % ncpu] : -1, rows, cols, nreg, &bar,
                                 (int64_t *)calloc((size_t)ROUNDS * 5, sizeof(int64_t)), 0.0};
        pthread_create(&th[i], NULL, bench_main, &ts[i]);
    }
    for (int i = 0; i < nthreads; i++) pthread_join(th[i], NULL);
    const double mb = (double)rows * nb * 18 / 1e6;
    printf("%d threads on %d CPUs, %.0f KB a thread (%d rows x %d cols), %d regions a thread, medians of %d rounds:\n",
           nthreads, ncpu, mb * 1e3 / 1.024, rows, cols, nreg, ROUNDS);
    static const char *names[5] = {"computed cold", "warm-up by loads", "computed after loads",
                                   "warm-up by prefetches", "computed after prefetches"};
    for (int p = 0; p < 5; p++) {
        double mean = 0.0, slow = 0.0;
        int64_t v[ROUNDS];
        for (int i = 0; i < nthreads; i++) {
            for (int k = 0; k < ROUNDS; k++) v[k] = ts[i].ns[(int64_t)k * 5 + p];
            qsort(v, ROUNDS, sizeof(int64_t), cmp64);
            const double med = (double)v[ROUNDS / 2] / 1e3;
            mean += med / nthreads;
            if (med > slow) slow = med;
        }
        printf("  %-26s %8.1f us (slowest %8.1f) %7.2f GB/s a thread\n", names[p], mean, slow, mb / mean * 1e3);
    }
    for (int i = 0; i < nthreads; i++) free(ts[i].ns);
    free(ts); free(th);
    pthread_barrier_destroy(&bar);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "threads") == 0)
        return threads_mode(atoi(argv[2]), argc > 3 ? atoi(argv[3]) : 392, argc > 4 ? atoi(argv[4]) : 2048,
                            argc > 5 ? atoi(argv[5]) : 600);
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    printf("row_dot8 (simd %d, vnni %d), one core, GB/s of Q4_0 blocks:\n", lt_simd(), lt_vnni());
    printf("  512 x 2048 (590 KB):   %6.2f\n", rate(512, 2048, quick ? 3 : 200));
    printf("  2048 x 512 (590 KB):   %6.2f\n", rate(2048, 512, quick ? 3 : 200));
    if (quick) return 0;
    printf("  1536 x 2048 (1.77 MB): %6.2f\n", rate(1536, 2048, 100));
    printf("  131072 x 2048 (151 MB): %6.2f\n", rate(131072, 2048, 5));
    return 0;
}
