/* One core's rate through the CPU share's 8-bit dot product (engine/kernels/host_experts.c's row_dot8: vpdpbusd where
   built) over Q4_0 rows in the split layout, with no pool around it: GB/s of blocks, best of the repeats, for a
   matrix that sits in a core's L2 (gate-like 512 x 2048 and down-like 2048 x 512, 590 KB each), one the size of
   a pair's three matrices (1.77 MB) and one far over the caches (151 MB, read once a repeat).

       cc -O3 -march=native -pthread bench/host_dot_rate.c -o /tmp/host_dot_rate -lm && /tmp/host_dot_rate [quick]

   "quick": the two L2-sized matrices only, three repeats (for the tests). */
#include "../engine/kernels/host_experts.c"
#include <stdio.h>

static double rate(int rows, int cols, int reps) {
    const int nb = cols / 32;
    const int64_t rb = (int64_t)nb * 18;
    uint8_t *w = (uint8_t *)aligned_alloc(64, (size_t)(rows * rb + 63) / 64 * 64);
    float *x = (float *)malloc((size_t)cols * sizeof(float)), *d = (float *)malloc((size_t)nb * sizeof(float));
    float *c = (float *)malloc((size_t)nb * sizeof(float));
    int8_t *q = (int8_t *)aligned_alloc(64, (size_t)cols);
    if (!w || !x || !d || !c || !q) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (int64_t i = 0; i < rows * rb; i++) w[i] = (uint8_t)((uint64_t)i * 2654435761u >> 13);
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) { uint16_t h = 0x2000; memcpy(w + r * rb + (int64_t)nb * 16 + 2 * b, &h, 2); }
    matrix_t m = {w, rows * rb, rb, rows, cols, QT_Q4_0, 1, 1};
    for (int i = 0; i < cols; i++) x[i] = sinf((float)i);
    quantize_row8(x, cols, q, d, c);
    volatile float sink = 0.0f;
    int64_t best = INT64_MAX;
    for (int k = 0; k < reps; k++) {
        const int64_t t0 = now_ns();
        float s = 0.0f;
        for (int r = 0; r < rows; r++) s += row_dot8(&m, w + r * rb, q, d, c);
        const int64_t t = now_ns() - t0;
        sink += s;
        if (t < best) best = t;
    }
    free(w); free(x); free(d); free(c); free(q);
    return (double)(rows * rb) / (double)best;
}

int main(int argc, char **argv) {
    const int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    printf("row_dot8 (simd %d, vnni %d), one core, GB/s of Q4_0 blocks:\n", lt_simd(), lt_vnni());
    printf("  512 x 2048 (590 KB):   %6.2f\n", rate(512, 2048, quick ? 3 : 200));
    printf("  2048 x 512 (590 KB):   %6.2f\n", rate(2048, 512, quick ? 3 : 200));
    if (quick) return 0;
    printf("  1536 x 2048 (1.77 MB): %6.2f\n", rate(1536, 2048, 100));
    printf("  131072 x 2048 (151 MB): %6.2f\n", rate(131072, 2048, 5));
    return 0;
}
