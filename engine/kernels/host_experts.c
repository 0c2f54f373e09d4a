/* CPU threads computing a share of the cold experts while the GPU computes the rest.

   The GPU publishes a layer's routing into a mailbox in pinned host memory (a sequence number, the
   layer, the pairs' expert ids with -1 for pairs that are not this pool's, their weights and the
   tokens' hidden rows in float32) and goes on with its own experts; these threads, spinning on the
   sequence number, compute SwiGLU(x) for their pairs straight from the host copies of the GGUF blocks,
   write the weighted sum per token into the reply, and set the reply's sequence number, on which
   the GPU waits before adding the sum (engine/kernels/host_experts.py).

   Two phases a job, each cut into chunks that the threads take as they come (work words, below): rows
   of gate and up of one pair (h = silu(g) * u), then rows of the tokens' output, each summed over its
   token's pairs in pair order. A thread that starts late or runs slow takes fewer chunks rather than
   holding the others up; the only wait is for the last chunk of gate/up before down. Weights are
   dequantized in registers and multiplied with float32 rows in float32 (no rounding of x), AVX2 + FMA
   where the compiler targets it; in int8 mode x and h are rounded to 8 bits per 32 values first and
   multiplied in integers (AVX-512 VNNI where built).

   Layout of the mailbox (int32 words): [0] sequence, [16] layer, [17] tokens, [18] pairs per token,
   [20] warm-up sequence, [21] its layer, [22] its expert count, [24 ..) its expert ids [WARM_MAX],
   [32 ..) ids [max_pairs], then weights float32 [max_pairs], then x float32 [max_tokens * hidden].

   Warm-ups: before a layer's router has run, the GPU may name the cold experts it predicts this pool will
   get (engine/kernels/hybrid_split.py). Threads with no job then fetch those experts' blocks into their
   caches, in chunks taken as they come (a third work word), and leave off at once when a job arrives, so
   that the job's rows come from the caches rather than from memory. A warm-up never changes a result.
   With LT_AFFINITY=1 (the default: half-cold decode 3-15% faster on an H100 host, docs/benchmarks.md, twenty-first
   round) a warm-up and a job are cut alike, and a thread computes first the chunks it warmed: in a
   warm-up each thread fetches only the gate/up rows (chunks of LT_CHUNK1 rows of an expert) and down rows (chunks of
   LT_CHUNK2 output rows) that it owns, into its own core's caches; in a job each thread first claims the chunks it
   owns, then any left (a flag a chunk, so that a thread scheduled late has its chunks taken by the others). With
   -DLT_AFFINITY=0 the warm-up's chunks go to whichever thread takes them, and a job's chunk read by another core
   than the one that fetched it comes from that core's cache. The sums are the same bits either way.

   Warm-ups ahead of their warm-up (LT_SPEC=1): between a job's reply and the next warm-up the host's memory is idle
   (the device sums the reply, finishes the layer and predicts the next cold one). The pool remembers, per layer,
   the experts its last warm-up named, and which layer's warm-up came after a job of each layer. Once a job is
   answered, each thread fetches the chunks it owns of the experts last named for the layer that followed last
   time, until a warm-up or a job comes; a warm-up that then names the same layer and experts goes on from where
   this one stopped. It is the layer's routing of the previous token: a guess that costs only memory reads when
   wrong, and changes no result.
   The reply: [0] sequence, [1] status (0 ok; LT_ERR_* otherwise), [16 ..) y float32 [max_tokens * hidden]. */

#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LT_AVX2 1
#else
#define LT_AVX2 0
#endif
#if defined(__AVX512F__) && LT_AVX2
#define LT_AVX512 1
#else
#define LT_AVX512 0
#endif

#if LT_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LT_VNNI 1  /* int8 dot products with vpdpbusd */
#else
#define LT_VNNI 0
#endif

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ volatile("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#ifndef LT_PF
#define LT_PF 2048  /* bytes ahead of the codes and scales being read that each row's loop prefetches (0: none):
                       the pinned copies sit in 4 KiB pages, at whose edges the hardware's prefetchers stop */
#endif

#ifndef LT_PF8
#define LT_PF8 0  /* the same for the 8-bit loop (vpdpbusd), a group of 16 blocks at a time (0: none) */
#endif

#ifndef LT_STATS
#define LT_STATS 0  /* 1: time each job's phases per thread (lt_stats), for the benchmarks */
#endif
#define LT_STAT_THREADS 64
#ifndef LT_CHUNK1
#define LT_CHUNK1 32  /* gate/up rows of one pair a thread takes at a time */
#endif
#ifndef LT_CHUNK2
#define LT_CHUNK2 64  /* output rows a thread takes at a time */
#endif
#ifndef LT_AFFINITY
#define LT_AFFINITY 1  /* warm-ups and jobs cut alike, each thread computing first the chunks it warmed (above) */
#endif
#ifndef LT_SPEC
#define LT_SPEC 0  /* 1 (with LT_AFFINITY): once a job is answered and before the next warm-up, each thread fetches the
                      chunks it owns of the experts the last warm-up of the layer that followed this job's layer named
                      (below, "Warm-ups ahead of their warm-up") */
#endif
#if LT_SPEC && !LT_AFFINITY
#error "LT_SPEC needs LT_AFFINITY=1 (a thread fetches the chunks it owns)"
#endif
#ifndef LT_PIN
#define LT_PIN 0  /* 1: thread i runs on the i-th CPU of the process's affinity mask */
#endif

#define QT_Q4_0 2
#define QT_Q8_0 8
#define LT_ERR_LAYER 1   /* a layer with no registered matrices */
#define LT_ERR_SHAPE 2   /* tokens or pairs over the mailbox's room, or an expert id out of range */
#define HEADER 32
#define PAIRS_MAX 1024  /* pairs a job at most (max_pairs) */
#define WARM_SEQ 20
#define WARM_LAYER 21
#define WARM_N 22
#define WARM_IDS 24
#define WARM_MAX 8
#ifndef LT_WARM_CHUNK
#define LT_WARM_CHUNK 16384  /* bytes of an expert's matrix a thread fetches at a time in a warm-up */
#endif
#define LT_DIAG_THREADS 64  /* threads whose state lt_pool_state reports */
#define DIAG_IDLE 0          /* looking at the mailbox */
#define DIAG_WARM 1          /* in a warm-up */
#define DIAG_GATE_UP 2       /* in a job's gate/up chunks */
#define DIAG_WAIT 3          /* waiting for the other threads' gate/up chunks */
#define DIAG_DOWN 4          /* in a job's down chunks */
#define IDLE_NS 20000000LL     /* spinning this long with no job: sleep 50 us between checks */
#define DEEP_IDLE_NS 1000000000LL  /* and this long: 1 ms (a new generation's first layer waits at most that) */

typedef struct {
    const uint8_t *base;  /* [experts, rows, row_bytes] */
    int64_t expert_bytes, row_bytes;
    int rows, cols, qtype, split, experts;
} matrix_t;

typedef struct {
    int nthreads, max_pairs, max_tokens, hidden, ffn, nlayers;
    volatile int32_t *mailbox, *reply;
    matrix_t *mats;  /* [nlayers * 3]: gate, up, down */
    float *h;        /* [max_pairs * ffn] */
    int int8;        /* activations in 8 bits (x and h quantized per 32-block), or float32 */
    uint64_t work[3];  /* phase 1, phase 2 (W_* below) and warm-ups */
    int64_t jobs, warm_chunks;
    int32_t start_seq;  /* the mailbox's number when the pool started: a thread scheduled late still sees the first job */
    int32_t start_warm;  /* the same for the warm-up number */
    volatile int stop;
    pthread_t *threads;
    int64_t diag[LT_DIAG_THREADS][5];  /* per thread: state (DIAG_*), its job's number, since (ns), the longest
                                          stretch in a state other than idle (ns) and that state: lt_pool_state */
    int32_t *claims[2];  /* LT_AFFINITY: per chunk of phase 1 and 2, the job that took it [W_MAX + 1] */
#if LT_SPEC
    int32_t *memo;       /* per layer: its last warm-up's count then ids [nlayers * (WARM_MAX + 1)] */
    int32_t *follow;     /* per layer: the layer of the warm-up that came after its last job, or -1 [nlayers] */
    int64_t spec_chunks; /* chunks fetched ahead of their warm-up */
#endif
#if LT_STATS
    int64_t job_start, job_ns;             /* a job's first chunk taken to its reply, summed */
    int first_phase;                       /* 1 where a job has no gate/up chunks: its start is phase 2's first */
    int64_t ns[LT_STAT_THREADS][3];        /* per thread: phase 1, the wait after it, phase 2 */
#endif
} pool_t;

typedef struct {
    pool_t *pool;
    int index;
    int8_t *xq;      /* int8 mode: the job's token rows in 8 bits [max_tokens * hidden], made on first use */
    float *xd, *xc;  /* [max_tokens * hidden / 32] */
    int32_t *xtag;   /* [max_tokens]: the job whose row a token's codes hold */
    int8_t *hq;      /* int8 mode: the pairs' h in 8 bits [max_pairs * ffn] (pair order, below), made by each thread for
                        the pairs its down rows need, once phase 1 is done: gate/up's chunks need not hold whole blocks */
    float *hd, *hc;  /* [max_pairs * ffn / 32] */
    int32_t *htag;   /* [max_pairs]: the job whose h a pair's codes hold */
    int job_layer;   /* the layer of this thread's last job (-1: none yet) */
    int spec_layer;  /* LT_SPEC: the layer and experts of this thread's last warm-up ahead, and how far it got */
    int32_t spec_ids[WARM_MAX];
    int spec_n, spec_pos;
} worker_t;

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__) && LT_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {  /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#if LT_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
static inline __m256 bytes8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
#endif

/* One row's dot product with float32 x [cols]. Q4_0: element j of a block is (low nibble of byte j) - 8,
   element j + 16 (high nibble of byte j) - 8; Q8_0: signed bytes. ggml's order is (scale, codes) per
   block; the split layout holds every block's codes, then every block's scale. */
static float row_dot(const matrix_t *m, const uint8_t *row, const float *x) {
    const int nb = m->cols / 32, code = m->qtype == QT_Q4_0 ? 16 : 32, size = code + 2;
    const uint8_t *codes = m->split ? row : row + 2, *scales = m->split ? row + (int64_t)nb * code : row;
    const int code_step = m->split ? code : size, scale_step = m->split ? 2 : size;
#if LT_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = codes + (int64_t)b * code_step;
        uint16_t hs; memcpy(&hs, scales + (int64_t)b * scale_step, 2);
        const float *xb = x + 32 * b;
#if LT_PF
        if ((b & 3) == 0) _mm_prefetch((const char *)q + LT_PF, _MM_HINT_T0);
        if ((b & 31) == 0) _mm_prefetch((const char *)scales + (int64_t)b * scale_step + LT_PF, _MM_HINT_T0);
#endif
        __m128i v0, v1;
        if (m->qtype == QT_Q4_0) {
            __m128i raw = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
            v0 = _mm_sub_epi8(_mm_and_si128(raw, mask), eight);
            v1 = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), eight);
        } else {
            v0 = _mm_loadu_si128((const __m128i *)q);
            v1 = _mm_loadu_si128((const __m128i *)(q + 16));
        }
        __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v0)), _mm512_loadu_ps(xb));
        s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v1)), _mm512_loadu_ps(xb + 16), s);
        acc = _mm512_fmadd_ps(s, _mm512_set1_ps(half_to_float(hs)), acc);
    }
    return _mm512_reduce_add_ps(acc);
#elif LT_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = codes + (int64_t)b * code_step;
        uint16_t hs; memcpy(&hs, scales + (int64_t)b * scale_step, 2);
        const float *xb = x + 32 * b;
#if LT_PF
        if ((b & 3) == 0) _mm_prefetch((const char *)q + LT_PF, _MM_HINT_T0);
        if ((b & 31) == 0) _mm_prefetch((const char *)scales + (int64_t)b * scale_step + LT_PF, _MM_HINT_T0);
#endif
        __m128i v0, v1;
        if (m->qtype == QT_Q4_0) {
            __m128i raw = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
            v0 = _mm_sub_epi8(_mm_and_si128(raw, mask), eight);
            v1 = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), eight);
        } else {
            v0 = _mm_loadu_si128((const __m128i *)q);
            v1 = _mm_loadu_si128((const __m128i *)(q + 16));
        }
        __m256 s = _mm256_mul_ps(bytes8(v0), _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(bytes8(_mm_srli_si128(v0, 8)), _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(bytes8(v1), _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(bytes8(_mm_srli_si128(v1, 8)), _mm256_loadu_ps(xb + 24), s);
        acc = _mm256_fmadd_ps(s, _mm256_set1_ps(half_to_float(hs)), acc);
    }
    return hsum(acc);
#else
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = codes + (int64_t)b * code_step;
        uint16_t hs; memcpy(&hs, scales + (int64_t)b * scale_step, 2);
        const float *xb = x + 32 * b;
        float s = 0.0f;
        if (m->qtype == QT_Q4_0)
            for (int j = 0; j < 16; j++)
                s += (float)((q[j] & 0x0f) - 8) * xb[j] + (float)((q[j] >> 4) - 8) * xb[j + 16];
        else
            for (int j = 0; j < 32; j++) s += (float)(int8_t)q[j] * xb[j];
        acc += s * half_to_float(hs);
    }
    return acc;
#endif
}

static inline const uint8_t *row_of(const matrix_t *m, int expert, int r) {
    return m->base + (int64_t)expert * m->expert_bytes + (int64_t)r * m->row_bytes;
}

/* Activations in 8 bits (int8 mode, as ggml's Q8_0 activations): each 32-block of a float row becomes codes q
   in [-127, 127] with d = max|x| / 127 (x ~ d q) and c = d * sum(q), which carries Q4_0's offset of 8. Codes
   are stored by groups of four blocks, the four blocks' first halves then their second halves
   ([b 0-15 | b+1 0-15 | b+2 0-15 | b+3 0-15 | b 16-31 | ... | b+3 16-31]): the order in which the low and the
   high nibbles of four Q4_0 blocks come out of one 64-byte load. The blocks of a last, partial group stay in
   plain order. */
static inline int perm_index(int b, int j, int nb) {
    if ((b | 3) >= nb) return b * 32 + j;
    return (b & ~3) * 32 + (j < 16 ? 0 : 64) + (b & 3) * 16 + (j & 15);
}

static void quantize_row8(const float *x, int n, int8_t *q, float *d, float *c) {
    const int nb = n / 32;
    for (int b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        int8_t v[32];
        int sum = 0;
#if LT_AVX512
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
        _mm_storeu_si128((__m128i *)v, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(v + 16), _mm512_cvtsepi32_epi8(q1));
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < 32; j++) {
            long r = lrintf(xb[j] * inv);  /* to nearest, ties to even: the vector conversion's rounding */
            v[j] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
            sum += v[j];
        }
#endif
        if ((b | 3) >= nb) {
            memcpy(q + 32 * b, v, 32);
        } else {
            int8_t *pb = q + 32 * (b & ~3) + 16 * (b & 3);
            memcpy(pb, v, 16);
            memcpy(pb + 64, v + 16, 16);
        }
        d[b] = amax / 127.0f;
        c[b] = d[b] * (float)sum;
    }
}

/* One row's dot product with 8-bit activations: sum over blocks of dw * dx * (codes . q), Q4_0's offset taken
   off through c. Integer products are exact; only the float sums round. */
static float row_dot8_plain(const matrix_t *m, const uint8_t *row, const int8_t *xq, const float *xd, const float *xc) {
    const int nb = m->cols / 32, q4 = m->qtype == QT_Q4_0, code = q4 ? 16 : 32, size = code + 2;
    const uint8_t *codes = m->split ? row : row + 2, *scales = m->split ? row + (int64_t)nb * code : row;
    const int code_step = m->split ? code : size, scale_step = m->split ? 2 : size;
    float acc = 0.0f, corr = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = codes + (int64_t)b * code_step;
        uint16_t hs; memcpy(&hs, scales + (int64_t)b * scale_step, 2);
        const float dw = half_to_float(hs);
        int s = 0;
        if (q4) {
            for (int j = 0; j < 16; j++)
                s += (q[j] & 0x0f) * xq[perm_index(b, j, nb)] + (q[j] >> 4) * xq[perm_index(b, j + 16, nb)];
            corr += dw * xc[b];
        } else {
            const int8_t *qs = (const int8_t *)q;
            for (int j = 0; j < 32; j++) s += qs[j] * xq[perm_index(b, j, nb)];
        }
        acc += dw * xd[b] * (float)s;
    }
    return q4 ? acc - 8.0f * corr : acc;
}

#if LT_VNNI
/* row_dot8_plain with vpdpbusd, for rows of a multiple of 16 blocks: 16 blocks' scales at a time, four blocks a
   step. Q4_0: one 64-byte load of the four blocks' codes (three 16-byte inserts in the ggml layout) gives their
   low nibbles and their high nibbles, each multiplied with its half of the activations' group (above) into the same
   int32 lanes, four lanes a block; one conversion and one scale a step. Q8_0: the four blocks' 128 bytes are put in
   that order, made unsigned, and their signs moved onto x. Returns the 16 lanes whose sum is the dot product:
   down's rows weight and add a token's pairs' lanes and sum them once (run_job). */
static inline __m512 row_vec8_vnni(const matrix_t *m, const uint8_t *row, const int8_t *xq, const float *xd,
                                   const float *xc) {
    const int nb = m->cols / 32, q4 = m->qtype == QT_Q4_0, code = q4 ? 16 : 32, size = code + 2;
    const uint8_t *codes = m->split ? row : row + 2, *scales = m->split ? row + (int64_t)nb * code : row;
    const int64_t step = m->split ? code : size;  /* bytes from one block's codes to the next's */
    const __m512i zero = _mm512_setzero_si512(), mask = _mm512_set1_epi8(0x0f);
    const __m512i lanes[4] = {_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                              _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4),
                              _mm512_set_epi32(11, 11, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8),
                              _mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12)};
    __m512 acc = _mm512_setzero_ps(), corr = _mm512_setzero_ps();
    for (int g = 0; g < nb; g += 16) {
#if LT_PF8
        {  /* the lines LT_PF8 bytes ahead of this group's codes (16 blocks) and scales */
            const char *ahead = (const char *)codes + (int64_t)g * step + LT_PF8;
            for (int l = 0; l < 16 * step; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
            if (m->split) _mm_prefetch((const char *)scales + 2 * g + LT_PF8, _MM_HINT_T0);
        }
#endif
        uint16_t hb[16];
        if (m->split) memcpy(hb, scales + 2 * g, 32);
        else for (int i = 0; i < 16; i++) memcpy(&hb[i], scales + (int64_t)(g + i) * size, 2);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hb));
        const __m512 sv = _mm512_mul_ps(dw, _mm512_loadu_ps(xd + g));
        if (q4) corr = _mm512_fmadd_ps(dw, _mm512_loadu_ps(xc + g), corr);
        for (int i = 0; i < 4; i++) {
            const int b = g + 4 * i;
            const uint8_t *c0 = codes + (int64_t)b * step;
            const __m512i xlo = _mm512_loadu_si512((const void *)(xq + 32 * b));
            const __m512i xhi = _mm512_loadu_si512((const void *)(xq + 32 * b + 64));
            __m512i dot;
            if (q4) {
                __m512i v;
                if (m->split) {
                    v = _mm512_loadu_si512((const void *)c0);
                } else {
                    v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)c0));
                    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(c0 + size)), 1);
                    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(c0 + 2 * size)), 2);
                    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(c0 + 3 * size)), 3);
                }
                const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                dot = _mm512_dpbusd_epi32(zero, lo, xlo);
                dot = _mm512_dpbusd_epi32(dot, hi, xhi);
            } else {
                __m512i v0, v1;  /* blocks b, b+1 and b+2, b+3: [first half | second half] each */
                if (m->split) {
                    v0 = _mm512_loadu_si512((const void *)c0);
                    v1 = _mm512_loadu_si512((const void *)(c0 + 64));
                } else {
                    v0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)c0)),
                                            _mm256_loadu_si256((const __m256i *)(c0 + size)), 1);
                    v1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(c0 + 2 * size))),
                                            _mm256_loadu_si256((const __m256i *)(c0 + 3 * size)), 1);
                }
                const __m512i wlo = _mm512_shuffle_i64x2(v0, v1, 0x88), whi = _mm512_shuffle_i64x2(v0, v1, 0xdd);
                const __m512i slo = _mm512_mask_sub_epi8(xlo, _mm512_movepi8_mask(wlo), zero, xlo);
                const __m512i shi = _mm512_mask_sub_epi8(xhi, _mm512_movepi8_mask(whi), zero, xhi);
                dot = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wlo), slo);
                dot = _mm512_dpbusd_epi32(dot, _mm512_abs_epi8(whi), shi);
            }
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lanes[i], sv), acc);
        }
    }
    return q4 ? _mm512_fmadd_ps(corr, _mm512_set1_ps(-8.0f), acc) : acc;
}

static float row_dot8_vnni(const matrix_t *m, const uint8_t *row, const int8_t *xq, const float *xd, const float *xc) {
    return _mm512_reduce_add_ps(row_vec8_vnni(m, row, xq, xd, xc));
}
#endif

static inline float row_dot8(const matrix_t *m, const uint8_t *row, const int8_t *xq, const float *xd, const float *xc) {
#if LT_VNNI
    if (m->cols % 512 == 0) return row_dot8_vnni(m, row, xq, xd, xc);
#endif
    return row_dot8_plain(m, row, xq, xd, xc);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Thread i enters `state` for job `seq`: where it stood is kept for an error's message (lt_pool_state), with the
   longest stretch it spent in a state other than idle. A few stores and a clock read a transition. */
static void diag_set(pool_t *p, int i, int state, int32_t seq) {
    if (i >= LT_DIAG_THREADS) return;
    int64_t *d = p->diag[i];
    const int64_t now = now_ns(), was = __atomic_load_n(&d[0], __ATOMIC_RELAXED);
    const int64_t took = now - __atomic_load_n(&d[2], __ATOMIC_RELAXED);
    if (was != DIAG_IDLE && took > __atomic_load_n(&d[3], __ATOMIC_RELAXED)) {
        __atomic_store_n(&d[3], took, __ATOMIC_RELAXED);
        __atomic_store_n(&d[4], was, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&d[1], (int64_t)seq, __ATOMIC_RELAXED);
    __atomic_store_n(&d[2], now, __ATOMIC_RELAXED);
    __atomic_store_n(&d[0], (int64_t)state, __ATOMIC_RELEASE);
}

/* 1 where the layer is in range and its three matrices are registered. */
static int layer_ready(const pool_t *p, int layer) {
    if (layer < 0 || layer >= p->nlayers) return 0;
    for (int j = 0; j < 3; j++) if (p->mats[3 * layer + j].base == NULL) return 0;
    return 1;
}

/* Checks the job's header; returns 0 or an LT_ERR_* code (the same for every thread). */
static int job_status(pool_t *p, int layer, int tokens, int k) {
    if (!layer_ready(p, layer)) return LT_ERR_LAYER;
    if (tokens < 1 || k < 1 || tokens > p->max_tokens || tokens * k > p->max_pairs) return LT_ERR_SHAPE;
    const volatile int32_t *ids = p->mailbox + HEADER;
    for (int i = 0; i < tokens * k; i++)
        if (ids[i] >= p->mats[3 * layer].experts) return LT_ERR_SHAPE;
    return 0;
}

/* A phase's work word: the job's sequence number << 32 | chunks handed out << 16 | chunks done. Whoever
   first touches a phase of a new job swaps in its number (a compare-and-swap from the last job's word),
   threads take chunks by compare-and-swap while the number is theirs, and count them done by adding one.
   No thread waits for another to arrive: one that comes late finds no chunk left, or the job gone. */
#define W_TAG(v) ((uint32_t)((v) >> 32))
#define W_NEXT(v) ((int)(((v) >> 16) & 0xffff))
#define W_DONE(v) ((int)((v) & 0xffff))
#define W_MAX 0xffff

/* The job is still the mailbox's and has no reply yet. */
static int job_live(pool_t *p, int32_t seq) {
    return __atomic_load_n(&p->mailbox[0], __ATOMIC_ACQUIRE) == seq
        && __atomic_load_n(&p->reply[0], __ATOMIC_ACQUIRE) != seq;
}

/* The next chunk of phase `ph` of job `seq` (n chunks), or -1 when none is left or the job is gone. */
static int grab(pool_t *p, int ph, int32_t seq, int n) {
    uint64_t *w = &p->work[ph], v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    if (n < 1) return -1;
    for (;;) {
        if (W_TAG(v) != (uint32_t)seq) {
            if (!job_live(p, seq)) return -1;
            if (__atomic_compare_exchange_n(w, &v, ((uint64_t)(uint32_t)seq << 32) | (1u << 16), 0,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
#if LT_STATS
                if (ph == 0 || p->first_phase == 1) __atomic_store_n(&p->job_start, now_ns(), __ATOMIC_RELAXED);
#endif
                return 0;
            }
            continue;
        }
        if (W_NEXT(v) >= n) return -1;
        if (__atomic_compare_exchange_n(w, &v, v + (1u << 16), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return W_NEXT(v);
    }
}

/* The next chunk of warm-up `ws` (n chunks), or -1 when none is left, the warm-up is gone or a job has come
   since the thread's last one (`job`): jobs come first. */
static int grab_warm(pool_t *p, int32_t ws, int32_t job, int n) {
    uint64_t *w = &p->work[2], v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    for (;;) {
        if (__atomic_load_n(&p->mailbox[0], __ATOMIC_ACQUIRE) != job
            || __atomic_load_n(&p->mailbox[WARM_SEQ], __ATOMIC_ACQUIRE) != ws || p->stop)
            return -1;
        if (W_TAG(v) != (uint32_t)ws) {
            if (__atomic_compare_exchange_n(w, &v, ((uint64_t)(uint32_t)ws << 32) | (1u << 16), 0,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                return 0;
            continue;
        }
        if (W_NEXT(v) >= n) return -1;
        if (__atomic_compare_exchange_n(w, &v, v + (1u << 16), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return W_NEXT(v);
    }
}

#ifndef LT_WARM_LOAD
#define LT_WARM_LOAD 1  /* 1: a warm-up reads a byte of each line (loads that must complete); 0: it prefetches each line
                           into L2. On an H100 host, a 4-pair job after a warm-up by loads ran as fast as the same job
                           run a second time (59.6 against 59.2 us), after one by prefetches 16% slower (70.2 against
                           60.6): prefetched lines are only partly there when the job reads them (docs/benchmarks.md,
                           thirtieth round) */
#endif

/* Fetches len bytes from a into this core's caches, a line at a time (a warm-up). */
static inline void fetch_bytes(const uint8_t *a, int64_t len) {
#if LT_WARM_LOAD
    uint8_t s = 0;
    for (int64_t o = 0; o < len; o += 64) s ^= *(const volatile uint8_t *)(a + o);
    __asm__ volatile("" : : "r"(s));
#else
    for (int64_t o = 0; o < len; o += 64) __builtin_prefetch(a + o, 0, 2);  /* prefetcht1 on x86: into L2 */
#endif
}

#if LT_AFFINITY
/* The thread that owns chunk c of phase ph: for gate/up, by the pair's expert and the chunk's rows within it (as a
   warm-up names them, run_warm); for the output rows, by the chunk. */
static inline int chunk_owner(const pool_t *p, int ph, int c, int per, const int32_t *pairs,
                              const volatile int32_t *ids) {
    return ph == 0 ? (ids[pairs[c / per]] + c % per) % p->nthreads : c % p->nthreads;
}

/* Phase ph's work word set to job seq (done 0) where it is not yet; 0 when the job is gone. */
static int tag_phase(pool_t *p, int ph, int32_t seq) {
    uint64_t *w = &p->work[ph], v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    while (W_TAG(v) != (uint32_t)seq) {
        if (!job_live(p, seq)) return 0;
        if (__atomic_compare_exchange_n(w, &v, (uint64_t)(uint32_t)seq << 32, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
#if LT_STATS
            if (ph == 0 || p->first_phase == 1) __atomic_store_n(&p->job_start, now_ns(), __ATOMIC_RELAXED);
#endif
            break;
        }
    }
    return 1;
}

/* The next chunk of phase ph of job seq (n chunks) for thread `me`, or -1 when none is left or the job is gone:
   *cur runs over 2 n steps, the chunks `me` owns first, then every chunk from a point of its own; a chunk is
   the thread's whose flag it sets to seq. A job ends only when all its chunks are done, so a thread late for a
   job finds them all taken. */
static int take(pool_t *p, int ph, int32_t seq, int n, int me, int *cur, int per, const int32_t *pairs,
                const volatile int32_t *ids) {
    if (n < 1 || !tag_phase(p, ph, seq)) return -1;
    while (*cur < 2 * n) {
        const int i = (*cur)++;
        int c = i;
        if (i < n) {
            if (chunk_owner(p, ph, c, per, pairs, ids) != me) continue;
        } else {
            c = (int)((i - n + (int64_t)me * n / p->nthreads) % n);
        }
        int32_t v = __atomic_load_n(&p->claims[ph][c], __ATOMIC_ACQUIRE);
        while (v != seq)
            if (__atomic_compare_exchange_n(&p->claims[ph][c], &v, seq, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                return c;
    }
    return -1;
}

static inline void fetch_rows(const matrix_t *m, int e, int r0, int r1) {
    fetch_bytes(row_of(m, e, r0), (int64_t)(r1 - r0) * m->row_bytes);
}

/* Fetches the chunks this thread (`me`) owns of experts ids[0..n) of a layer, cut as the job will be (above): the gate/up
   rows and the down rows of each expert in turn, from position `from` of that walk; stops when a job other than
   `job` or a warm-up other than `ws` comes. Returns the position reached (n * (per + n2) when done); `count` gains
   the chunks fetched. */
static int warm_owned(pool_t *p, int me, int layer, int n, const int32_t *ids, int from, int32_t ws, int32_t job,
                      int64_t *count) {
    const matrix_t *m = &p->mats[3 * layer];
    const int ffn = m[0].rows, H = m[2].rows, T = p->nthreads;
    const int per = (ffn + LT_CHUNK1 - 1) / LT_CHUNK1, n2 = (H + LT_CHUNK2 - 1) / LT_CHUNK2;
    for (int pos = from; pos < n * (per + n2); pos++) {
        const int i = pos / (per + n2), j = pos % (per + n2), e = ids[i];
        if (e < 0 || e >= m[0].experts || e >= m[1].experts || e >= m[2].experts) continue;
        if (j < per ? (e + j) % T != me : (j - per) % T != me) continue;
        if (__atomic_load_n(&p->mailbox[0], __ATOMIC_ACQUIRE) != job
            || __atomic_load_n(&p->mailbox[WARM_SEQ], __ATOMIC_ACQUIRE) != ws || p->stop)
            return pos;
        if (j < per) {
            const int r0 = j * LT_CHUNK1, r1 = r0 + LT_CHUNK1 < ffn ? r0 + LT_CHUNK1 : ffn;
            fetch_rows(&m[0], e, r0, r1);
            fetch_rows(&m[1], e, r0, r1);
        } else {
            const int r0 = (j - per) * LT_CHUNK2, r1 = r0 + LT_CHUNK2 < H ? r0 + LT_CHUNK2 : H;
            fetch_rows(&m[2], e, r0, r1);
        }
        __atomic_fetch_add(count, 1, __ATOMIC_RELAXED);
    }
    return n * (per + n2);
}

/* Warm-up `ws`: this thread's chunks of the experts it names, until they are done or a job comes. With LT_SPEC it is
   remembered for its layer, the layer is noted as the one after this thread's last job's, and where this thread's
   last warm-up ahead named the same layer and experts, the walk goes on from where that one stopped. */
static void run_warm(pool_t *p, worker_t *wk, int32_t ws, int32_t job) {
    const int layer = p->mailbox[WARM_LAYER], n = p->mailbox[WARM_N];
    if (n < 1 || n > WARM_MAX || !layer_ready(p, layer)) return;
    int32_t ids[WARM_MAX];
    for (int i = 0; i < n; i++) ids[i] = p->mailbox[WARM_IDS + i];
    int from = 0;
#if LT_SPEC
    int32_t *memo = p->memo + (int64_t)layer * (WARM_MAX + 1);
    for (int i = 0; i < n; i++) __atomic_store_n(&memo[1 + i], ids[i], __ATOMIC_RELAXED);
    __atomic_store_n(&memo[0], n, __ATOMIC_RELAXED);
    if (wk->job_layer >= 0) __atomic_store_n(&p->follow[wk->job_layer], layer, __ATOMIC_RELAXED);
    if (wk->spec_layer == layer && wk->spec_n == n && memcmp(wk->spec_ids, ids, (size_t)n * sizeof(int32_t)) == 0)
        from = wk->spec_pos;
    wk->spec_layer = -1;
#endif
    warm_owned(p, wk->index, layer, n, ids, from, ws, job, &p->warm_chunks);
}

#if LT_SPEC
/* After the reply to job `job` (layer wk->job_layer), before warm-up `ws` is followed by another: this thread's chunks
   of the experts last named for the layer whose warm-up came after this layer's job last time. */
static void run_spec(pool_t *p, worker_t *wk, int32_t ws, int32_t job) {
    if (wk->job_layer < 0) return;
    const int layer = __atomic_load_n(&p->follow[wk->job_layer], __ATOMIC_RELAXED);
    if (!layer_ready(p, layer)) return;
    const int32_t *memo = p->memo + (int64_t)layer * (WARM_MAX + 1);
    const int n = __atomic_load_n(&memo[0], __ATOMIC_RELAXED);
    if (n < 1 || n > WARM_MAX) return;
    wk->spec_layer = layer;
    wk->spec_n = n;
    for (int i = 0; i < n; i++) wk->spec_ids[i] = __atomic_load_n(&memo[1 + i], __ATOMIC_RELAXED);
    wk->spec_pos = warm_owned(p, wk->index, layer, n, wk->spec_ids, 0, ws, job, &p->spec_chunks);
}
#endif
#else
/* Fetches the blocks of the experts warm-up `ws` names (gate, up and down of each) into this core's caches,
   chunk by chunk, until they are all taken or a job comes. Bad headers are ignored: a warm-up is a hint. */
static void run_warm(pool_t *p, worker_t *wk, int32_t ws, int32_t job) {
    (void)wk;
    const int layer = p->mailbox[WARM_LAYER], n = p->mailbox[WARM_N];
    if (n < 1 || n > WARM_MAX || !layer_ready(p, layer)) return;
    const matrix_t *m = &p->mats[3 * layer];
    int per[3], all = 0, c;
    for (int j = 0; j < 3; j++) {
        per[j] = (int)((m[j].expert_bytes + LT_WARM_CHUNK - 1) / LT_WARM_CHUNK);
        all += per[j];
    }
    if ((int64_t)n * all > W_MAX) return;  /* more chunks than a work word counts: no warm-up */
    while ((c = grab_warm(p, ws, job, n * all)) >= 0) {
        int i = c / all, r = c % all, j = 0;
        while (r >= per[j]) r -= per[j++];
        const int e = p->mailbox[WARM_IDS + i];
        if (e < 0 || e >= m[j].experts) continue;
        const uint8_t *a = m[j].base + (int64_t)e * m[j].expert_bytes + (int64_t)r * LT_WARM_CHUNK;
        int64_t len = m[j].expert_bytes - (int64_t)r * LT_WARM_CHUNK;
        len = len < LT_WARM_CHUNK ? len : LT_WARM_CHUNK;
        fetch_bytes(a, len);
        __atomic_fetch_add(&p->warm_chunks, 1, __ATOMIC_RELAXED);
    }
}
#endif

/* Waits until all n chunks of phase `ph` of job `seq` are done; 0 when the job is gone instead. */
static int phase_done(pool_t *p, int ph, int32_t seq, int n) {
    for (;;) {
        uint64_t v = __atomic_load_n(&p->work[ph], __ATOMIC_ACQUIRE);
        if (W_TAG(v) != (uint32_t)seq) return 0;
        if (W_DONE(v) >= n) return 1;
        if (p->stop) return 0;
        CPU_RELAX();
    }
}

/* Rows a chunk of `rows` covers so that `units * ceil(rows / chunk)` chunks fit a work word. */
static int chunk_rows(int64_t units, int rows, int chunk) {
    while (units * ((rows + chunk - 1) / chunk) > W_MAX) chunk *= 2;
    return chunk;
}

static void run_job(pool_t *p, worker_t *wk, int32_t seq) {
    const int index = wk->index;  /* the stats' row, and with LT_AFFINITY the chunks owned */
    (void)index;
#if LT_STATS
    int64_t t0 = now_ns(), t1, t2, t3;
#endif
    const int layer = p->mailbox[16], tokens = p->mailbox[17], k = p->mailbox[18];
    const int status = job_status(p, layer, tokens, k);
    /* the header read before this check is the job's: the next job's is written only after this one's reply */
    if (__atomic_load_n(&p->reply[0], __ATOMIC_ACQUIRE) == seq) return;
    const int H = p->hidden;
    const volatile int32_t *ids = p->mailbox + HEADER;
    const float *w = (const float *)(p->mailbox + HEADER + p->max_pairs);
    const float *x = (const float *)(p->mailbox + HEADER + 2 * p->max_pairs);
    float *y = (float *)(p->reply + 16);
    int np = 0, ffn = 0, c1 = 1, n1 = 0, c2 = 1, n2 = 1, c;
    int32_t pairs[PAIRS_MAX];
    const matrix_t *gate = NULL, *up = NULL, *down = NULL;
    if (status == 0) {
        gate = &p->mats[3 * layer]; up = gate + 1; down = gate + 2;
        ffn = gate->rows;
        for (int i = 0; i < tokens * k; i++) if (ids[i] >= 0) pairs[np++] = i;
        c1 = chunk_rows(np, ffn, LT_CHUNK1);
        n1 = np * ((ffn + c1 - 1) / c1);
        c2 = chunk_rows(1, tokens * H, LT_CHUNK2);
        n2 = (tokens * H + c2 - 1) / c2;
    }
#if LT_STATS
    if (index == 0) p->first_phase = n1 > 0 ? 0 : 1;
#endif
#if LT_AFFINITY
    int cur1 = 0, cur2 = 0;
    const int per1 = (ffn + c1 - 1) / c1;
#define NEXT1() take(p, 0, seq, n1, index, &cur1, per1, pairs, ids)
#define NEXT2() take(p, 1, seq, n2, index, &cur2, 1, pairs, ids)
#else
#define NEXT1() grab(p, 0, seq, n1)
#define NEXT2() grab(p, 1, seq, n2)
#endif
    /* phase 1: chunks of c1 rows of gate and up of one pair (h = silu(g) * u) */
    while ((c = NEXT1()) >= 0) {
        const int per = (ffn + c1 - 1) / c1, pair = pairs[c / per], e = ids[pair];
        const int r0 = (c % per) * c1, r1 = r0 + c1 < ffn ? r0 + c1 : ffn;
        const int tok = pair / k;
        const float *xt = x + (int64_t)tok * H;
        float *h = p->h + (int64_t)pair * ffn;
        if (p->int8) {
            const int8_t *xq = wk->xq + (int64_t)tok * H;
            const float *xd = wk->xd + (int64_t)tok * (H / 32), *xc = wk->xc + (int64_t)tok * (H / 32);
            if (wk->xtag[tok] != seq) {
                quantize_row8(xt, H, wk->xq + (int64_t)tok * H, wk->xd + (int64_t)tok * (H / 32),
                              wk->xc + (int64_t)tok * (H / 32));
                wk->xtag[tok] = seq;
            }
            for (int r = r0; r < r1; r++) {
                float g = row_dot8(gate, row_of(gate, e, r), xq, xd, xc), u = row_dot8(up, row_of(up, e, r), xq, xd, xc);
                h[r] = g / (1.0f + expf(-g)) * u;
            }
        } else {
            for (int r = r0; r < r1; r++) {
                float g = row_dot(gate, row_of(gate, e, r), xt), u = row_dot(up, row_of(up, e, r), xt);
                h[r] = g / (1.0f + expf(-g)) * u;
            }
        }
        __atomic_add_fetch(&p->work[0], 1, __ATOMIC_ACQ_REL);
    }
#if LT_STATS
    t1 = now_ns();
#endif
    if (n1 > 0) {
        diag_set(p, index, DIAG_WAIT, seq);
        if (!phase_done(p, 0, seq, n1)) return;
    }
    diag_set(p, index, DIAG_DOWN, seq);
#if LT_STATS
    t2 = now_ns();
#endif
    /* phase 2: chunks of c2 output rows of [tokens * H], each summed over its token's pairs in order */
    while ((c = NEXT2()) >= 0) {
        if (status == 0) {
            const int64_t a = (int64_t)c * c2, b = a + c2 < (int64_t)tokens * H ? a + c2 : (int64_t)tokens * H;
            const int nbf = ffn / 32;
            for (int64_t t0 = a; t0 < b;) {  /* a run of the chunk's rows within one token */
                const int tok = (int)(t0 / H), r0 = (int)(t0 % H);
                const int64_t t1 = t0 + (H - r0) < b ? t0 + (H - r0) : b;
                int live[PAIRS_MAX], lexp[PAIRS_MAX], nl = 0;  /* the token's pairs of this pool and their experts */
                for (int j = 0; j < k; j++) {
                    const int pair = tok * k + j, e = ids[pair];
                    if (e < 0) continue;
                    live[nl] = pair;
                    lexp[nl++] = e;
                    if (p->int8 && wk->htag[pair] != seq) {
                        quantize_row8(p->h + (int64_t)pair * ffn, ffn, wk->hq + (int64_t)pair * ffn,
                                      wk->hd + (int64_t)pair * nbf, wk->hc + (int64_t)pair * nbf);
                        wk->htag[pair] = seq;
                    }
                }
                for (int64_t t = t0; t < t1; t++) {
                    const int r = r0 + (int)(t - t0);
                    float s = 0.0f;
#if LT_VNNI
                    if (p->int8 && ffn % 512 == 0) {  /* the pairs' lanes weighted and added, then one sum */
                        __m512 sv = _mm512_setzero_ps();
                        for (int i = 0; i < nl; i++) {
                            const int pair = live[i];
                            sv = _mm512_fmadd_ps(_mm512_set1_ps(w[pair]),
                                                 row_vec8_vnni(down, row_of(down, lexp[i], r), wk->hq + (int64_t)pair * ffn,
                                                               wk->hd + (int64_t)pair * nbf, wk->hc + (int64_t)pair * nbf),
                                                 sv);
                        }
                        y[t] = _mm512_reduce_add_ps(sv);
                        continue;
                    }
#endif
                    for (int i = 0; i < nl; i++) {
                        const int pair = live[i], e = lexp[i];
                        if (p->int8)
                            s += w[pair] * row_dot8(down, row_of(down, e, r), wk->hq + (int64_t)pair * ffn,
                                                    wk->hd + (int64_t)pair * nbf, wk->hc + (int64_t)pair * nbf);
                        else
                            s += w[pair] * row_dot(down, row_of(down, e, r), p->h + (int64_t)pair * ffn);
                    }
                    y[t] = s;
                }
                t0 = t1;
            }
        } else {
            p->reply[1] = status;
        }
        if (W_DONE(__atomic_add_fetch(&p->work[1], 1, __ATOMIC_ACQ_REL)) == n2) {
#if LT_STATS
            p->job_ns += now_ns() - __atomic_load_n(&p->job_start, __ATOMIC_RELAXED);
#endif
            __atomic_fetch_add(&p->jobs, 1, __ATOMIC_RELAXED);
            __atomic_store_n(&p->reply[0], seq, __ATOMIC_RELEASE);  /* the GPU's wait ends here */
        }
    }
#undef NEXT1
#undef NEXT2
#if LT_STATS
    t3 = now_ns();
    if (index < LT_STAT_THREADS) {
        p->ns[index][0] += t1 - t0; p->ns[index][1] += t2 - t1; p->ns[index][2] += t3 - t2;
    }
#endif
}

static void pin_thread(int index) {
#if LT_PIN
    cpu_set_t allowed, one;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
    int n = CPU_COUNT(&allowed), seen = 0;
    if (n < 1) return;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &allowed)) continue;
        if (seen++ == index % n) {
            CPU_ZERO(&one);
            CPU_SET(c, &one);
            pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
            return;
        }
    }
#else
    (void)index;
#endif
}

static void *worker_main(void *arg) {
    worker_t *wk = (worker_t *)arg;
    pool_t *p = wk->pool;
    pin_thread(wk->index);
    if (p->int8) {
        const size_t n = (size_t)p->max_tokens * p->hidden;
        wk->xq = (int8_t *)malloc(n);
        wk->xd = (float *)malloc(n / 32 * sizeof(float));
        wk->xc = (float *)malloc(n / 32 * sizeof(float));
        wk->xtag = (int32_t *)malloc((size_t)p->max_tokens * sizeof(int32_t));
        const size_t nh = (size_t)p->max_pairs * p->ffn;
        wk->hq = (int8_t *)malloc(nh);
        wk->hd = (float *)malloc(nh / 32 * sizeof(float));
        wk->hc = (float *)malloc(nh / 32 * sizeof(float));
        wk->htag = (int32_t *)malloc((size_t)p->max_pairs * sizeof(int32_t));
        if (!wk->xq || !wk->xd || !wk->xc || !wk->xtag || !wk->hq || !wk->hd || !wk->hc || !wk->htag)
            goto done;  /* this thread takes no chunks */
        for (int t = 0; t < p->max_tokens; t++) wk->xtag[t] = p->start_seq;
        for (int i = 0; i < p->max_pairs; i++) wk->htag[i] = p->start_seq;
    }
    int32_t last = p->start_seq, last_warm = p->start_warm;
    wk->job_layer = -1;
    wk->spec_layer = -1;
#if LT_SPEC
    int32_t spec_for = p->start_seq;  /* the job after which this thread last warmed ahead, or saw a warm-up */
#endif
    int64_t idle_since = now_ns();
    unsigned spins = 0;
    while (!p->stop) {
        int32_t seq = __atomic_load_n(&p->mailbox[0], __ATOMIC_ACQUIRE);
        if (seq == last) {
            int32_t ws = __atomic_load_n(&p->mailbox[WARM_SEQ], __ATOMIC_ACQUIRE);
            if (ws != last_warm) {
                last_warm = ws;
#if LT_SPEC
                spec_for = last;
#endif
                diag_set(p, wk->index, DIAG_WARM, ws);
                run_warm(p, wk, ws, last);
                diag_set(p, wk->index, DIAG_IDLE, last);
                idle_since = now_ns();
                spins = 0;
                continue;
            }
#if LT_SPEC
            if (spec_for != last && __atomic_load_n(&p->reply[0], __ATOMIC_ACQUIRE) == last) {
                spec_for = last;
                run_spec(p, wk, ws, last);
                continue;
            }
#endif
            CPU_RELAX();
            if (++spins % 4096 == 0) {
                int64_t idle = now_ns() - idle_since;
                if (idle > IDLE_NS) {
                    struct timespec t = {0, idle > DEEP_IDLE_NS ? 1000000 : 50000};
                    nanosleep(&t, NULL);
                    spins = 4095;  /* check the clock again after the next look at the mailbox */
                }
            }
            continue;
        }
        last = seq;
        wk->job_layer = p->mailbox[16] >= 0 && p->mailbox[16] < p->nlayers ? p->mailbox[16] : -1;
        diag_set(p, wk->index, DIAG_GATE_UP, seq);
        run_job(p, wk, seq);
        diag_set(p, wk->index, DIAG_IDLE, seq);
        idle_since = now_ns();
        spins = 0;
    }
done:
    free(wk->xq); free(wk->xd); free(wk->xc); free(wk->xtag);
    free(wk->hq); free(wk->hd); free(wk->hc); free(wk->htag);
    free(wk);
    return NULL;
}

static void free_pool(pool_t *p) {
    free(p->mats); free(p->h); free(p->threads); free(p->claims[0]); free(p->claims[1]);
#if LT_SPEC
    free(p->memo); free(p->follow);
#endif
    free(p);
}

/* Starts the pool; int8: activations in 8 bits (hidden and ffn multiples of 32). NULL for bad arguments. */
void *lt_start(int nthreads, int32_t *mailbox, int32_t *reply, int max_pairs, int max_tokens, int hidden,
               int ffn, int nlayers, int int8) {
    if (nthreads < 1 || max_pairs < 1 || max_pairs > PAIRS_MAX || max_tokens < 1 || hidden < 1 || ffn < 1 || nlayers < 1
        || (int8 && (hidden % 32 || ffn % 32)))
        return NULL;
    pool_t *p = (pool_t *)calloc(1, sizeof(pool_t));
    if (!p) return NULL;
    p->nthreads = nthreads; p->max_pairs = max_pairs; p->max_tokens = max_tokens;
    p->hidden = hidden; p->ffn = ffn; p->nlayers = nlayers;
    p->mailbox = mailbox; p->reply = reply;
    p->start_seq = __atomic_load_n(&mailbox[0], __ATOMIC_ACQUIRE);
    p->start_warm = __atomic_load_n(&mailbox[WARM_SEQ], __ATOMIC_ACQUIRE);
    p->work[0] = p->work[1] = (uint64_t)(uint32_t)p->start_seq << 32;  /* no job's number */
    p->work[2] = (uint64_t)(uint32_t)p->start_warm << 32;
    for (int i = 0; i < LT_DIAG_THREADS; i++) {
        p->diag[i][1] = p->start_seq;
        p->diag[i][2] = now_ns();
    }
    p->mats = (matrix_t *)calloc((size_t)nlayers * 3, sizeof(matrix_t));
    p->h = (float *)calloc((size_t)max_pairs * ffn, sizeof(float));
    p->threads = (pthread_t *)calloc((size_t)nthreads, sizeof(pthread_t));
    p->int8 = int8 != 0;
    if (!p->mats || !p->h || !p->threads) goto fail;
#if LT_AFFINITY
    for (int ph = 0; ph < 2; ph++) {
        p->claims[ph] = (int32_t *)malloc((size_t)(W_MAX + 1) * sizeof(int32_t));
        if (!p->claims[ph]) goto fail;
        for (int c = 0; c <= W_MAX; c++) p->claims[ph][c] = p->start_seq;
    }
#endif
#if LT_SPEC
    p->memo = (int32_t *)calloc((size_t)nlayers * (WARM_MAX + 1), sizeof(int32_t));
    p->follow = (int32_t *)malloc((size_t)nlayers * sizeof(int32_t));
    if (!p->memo || !p->follow) goto fail;
    for (int l = 0; l < nlayers; l++) p->follow[l] = -1;
#endif
    for (int i = 0; i < nthreads; i++) {
        worker_t *wk = (worker_t *)calloc(1, sizeof(worker_t));
        if (!wk) { p->nthreads = i; goto fail; }
        wk->pool = p; wk->index = i;
        if (pthread_create(&p->threads[i], NULL, worker_main, wk) != 0) { free(wk); p->nthreads = i; goto fail; }
    }
    return p;
fail:
    p->stop = 1;
    for (int i = 0; p->threads && i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    free_pool(p);
    return NULL;
}

/* Registers one matrix (0 gate, 1 up, 2 down) of a layer; returns 0, or -1 for a bad argument. */
int lt_matrix(void *pool, int layer, int which, const uint8_t *base, int experts, int rows, int cols,
              int64_t row_bytes, int qtype, int split) {
    pool_t *p = (pool_t *)pool;
    if (!p || layer < 0 || layer >= p->nlayers || which < 0 || which > 2 || !base || experts < 1 || rows < 1
        || cols % 32 != 0 || (qtype != QT_Q4_0 && qtype != QT_Q8_0)
        || row_bytes != (int64_t)(cols / 32) * (qtype == QT_Q4_0 ? 18 : 34)
        || (which < 2 && (rows > p->ffn || cols != p->hidden)) || (which == 2 && (rows != p->hidden || cols > p->ffn)))
        return -1;
    matrix_t *m = &p->mats[3 * layer + which];
    m->base = base; m->experts = experts; m->rows = rows; m->cols = cols; m->row_bytes = row_bytes;
    m->expert_bytes = row_bytes * rows; m->qtype = qtype; m->split = split;
    return 0;
}

int64_t lt_jobs(void *pool) { return __atomic_load_n(&((pool_t *)pool)->jobs, __ATOMIC_ACQUIRE); }

/* Where the first n threads stand (at most LT_DIAG_THREADS), 5 words each into out: state (DIAG_*), the number of
   the job or warm-up it is in or last left, nanoseconds in that state so far, the longest stretch in a state other
   than idle and that state. Returns the threads written. */
int lt_pool_state(void *pool, int64_t *out, int n) {
    pool_t *p = (pool_t *)pool;
    if (!p || !out) return 0;
    if (n > p->nthreads) n = p->nthreads;
    if (n > LT_DIAG_THREADS) n = LT_DIAG_THREADS;
    const int64_t now = now_ns();
    for (int i = 0; i < n; i++) {
        const int64_t *d = p->diag[i];
        out[5 * i] = __atomic_load_n(&d[0], __ATOMIC_ACQUIRE);
        out[5 * i + 1] = __atomic_load_n(&d[1], __ATOMIC_RELAXED);
        out[5 * i + 2] = now - __atomic_load_n(&d[2], __ATOMIC_RELAXED);
        out[5 * i + 3] = __atomic_load_n(&d[3], __ATOMIC_RELAXED);
        out[5 * i + 4] = __atomic_load_n(&d[4], __ATOMIC_RELAXED);
    }
    return n < 0 ? 0 : n;
}

/* The chunks a warm-up counts for one expert of a layer (as run_warm cuts it), or -1 for a layer not registered. */
int lt_warm_per_expert(void *pool, int layer) {
    pool_t *p = (pool_t *)pool;
    if (!layer_ready(p, layer)) return -1;
    const matrix_t *m = &p->mats[3 * layer];
#if LT_AFFINITY
    return (m[0].rows + LT_CHUNK1 - 1) / LT_CHUNK1 + (m[2].rows + LT_CHUNK2 - 1) / LT_CHUNK2;
#else
    int all = 0;
    for (int j = 0; j < 3; j++) all += (int)((m[j].expert_bytes + LT_WARM_CHUNK - 1) / LT_WARM_CHUNK);
    return all;
#endif
}

int64_t lt_warm_chunks(void *pool) { return __atomic_load_n(&((pool_t *)pool)->warm_chunks, __ATOMIC_ACQUIRE); }

/* Chunks fetched ahead of their warm-up (LT_SPEC), or -1 where the pool is built without it. */
int64_t lt_spec_chunks(void *pool) {
#if LT_SPEC
    return __atomic_load_n(&((pool_t *)pool)->spec_chunks, __ATOMIC_ACQUIRE);
#else
    (void)pool;
    return -1;
#endif
}

/* With LT_STATS: out[0] jobs, out[1] mean ns from a job's first look to its reply, then per thread the mean ns
   of phase 1, the wait after it and phase 2 (3 values each); returns 0. Without: -1. */
int lt_stats(void *pool, double *out) {
#if LT_STATS
    pool_t *p = (pool_t *)pool;
    const double jobs = (double)__atomic_load_n(&p->jobs, __ATOMIC_ACQUIRE);
    out[0] = jobs;
    out[1] = jobs > 0 ? (double)p->job_ns / jobs : 0.0;
    for (int i = 0; i < p->nthreads && i < LT_STAT_THREADS; i++)
        for (int j = 0; j < 3; j++) out[2 + 3 * i + j] = jobs > 0 ? (double)p->ns[i][j] / jobs : 0.0;
    return 0;
#else
    (void)pool; (void)out;
    return -1;
#endif
}

int lt_simd(void) { return LT_AVX512 ? 512 : LT_AVX2 ? 256 : 0; }  /* vector bits of the dot products */

int lt_vnni(void) { return LT_VNNI; }

/* For the tests: x [cols] in 8 bits, then its dot product with one row of blocks by the plain loop (out[0]) and,
   where built, by vpdpbusd (out[1], else NaN). Returns -1 for a bad shape or type. */
int lt_dot8(const uint8_t *row, int cols, int qtype, int split, const float *x, float *out) {
    if (cols < 32 || cols % 32 || cols > 65536 || (qtype != QT_Q4_0 && qtype != QT_Q8_0)) return -1;
    int8_t *q = (int8_t *)malloc((size_t)cols);
    float *d = (float *)malloc((size_t)cols / 32 * sizeof(float)), *c = (float *)malloc((size_t)cols / 32 * sizeof(float));
    if (!q || !d || !c) { free(q); free(d); free(c); return -1; }
    matrix_t m = {row, 0, (int64_t)(cols / 32) * (qtype == QT_Q4_0 ? 18 : 34), 1, cols, qtype, split, 1};
    quantize_row8(x, cols, q, d, c);
    out[0] = row_dot8_plain(&m, row, q, d, c);
#if LT_VNNI
    out[1] = cols % 512 == 0 ? row_dot8_vnni(&m, row, q, d, c) : NAN;
#else
    out[1] = NAN;
#endif
    free(q); free(d); free(c);
    return 0;
}  /* 1: int8 mode's dot products use vpdpbusd (rows of 16k blocks) */

void lt_stop(void *pool) {
    pool_t *p = (pool_t *)pool;
    if (!p) return;
    p->stop = 1;
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    free_pool(p);
}

/* The bus's copier: a thread that has the GPU's copy engine fetch cold experts ahead of their layer.

   The device names the experts it predicts a layer will route to (engine/kernels/hybrid_split.py's select launch)
   in a mailbox of its own in pinned host memory: [0] sequence, [1] layer, [2] count, [8 ..) expert ids (-1: none).
   This thread, spinning on the sequence number, queues one host -> device copy a matrix (gate, up, down) of each
   named expert into that expert's stage rows on a stream of its own, then one 4-byte copy of the sequence number
   into a word of device memory. The stream runs its copies in order, so the word holds the number once every
   expert's bytes are there; the device's expert launch that reads the rows first waits for it
   (engine/kernels/host_share_triton.py's bus_wait). The copy engine reads pinned memory at the bus's full rate
   without taking any SM from the kernels beside it. The copy function is the driver's cuMemcpyHtoDAsync_v2 (its
   address handed in, so this library links nothing of CUDA); the tests hand in lt_copy_host, which copies at once.
   Status word [3]: 0, or LT_ERR_* for a job this thread could not run (then it still writes the number, so the
   device never waits past its bound for a job that failed; the host's check raises). */

#define BUS_SEQ 0
#define BUS_LAYER 1
#define BUS_N 2
#define BUS_STATUS 3
#define BUS_IDS 8
#define BUS_MAX 8
#define BUS_RING 16   /* [BUS_RING ..): the numbers the flag copies read, one slot a job in turn */
#define BUS_SLOTS 64

typedef int (*lt_copy_fn)(uint64_t dst, const void *src, size_t n, void *stream);
typedef int (*lt_ctx_fn)(void *ctx);

typedef struct {
    volatile int32_t *mb;
    lt_copy_fn copy;
    lt_ctx_fn set_ctx;
    void *ctx, *stream;
    uint64_t flag;                 /* the device word the last copy of a job writes */
    uint64_t dst[3];               /* the stage rows of fetched expert 0 per matrix */
    int64_t dst_row[3];            /* bytes from one fetched expert's rows to the next's */
    int dst_rows;                  /* fetched experts the stage holds */
    const uint8_t **src;           /* [nlayers * 3] */
    int64_t *slab;                 /* [nlayers * 3]: bytes of one expert's matrix */
    int *experts;                  /* [nlayers] */
    int nlayers, started;
    int32_t start_seq;
    int64_t jobs;
    int64_t seen;        /* the last number the thread took from the mailbox */
    int64_t job_since;   /* ns: when its current job began (0: looking at the mailbox) */
    int64_t idle_since;  /* ns: when its last job ended (or it started) */
    int64_t copy_since;  /* ns: when its current call of the driver's copy began (0: none) */
    int64_t copy_max;    /* ns: the longest such call */
    volatile int stop;
    pthread_t thread;
} bus_t;

/* A synchronous stand-in for cuMemcpyHtoDAsync_v2 where "device" memory is host memory (the CPU tests). */
int lt_copy_host(uint64_t dst, const void *src, size_t n, void *stream) {
    (void)stream;
    memcpy((void *)(uintptr_t)dst, src, n);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    return 0;
}

/* One call of the copy function, its time kept for an error's message (lt_bus_state). */
static int bus_copy(bus_t *b, uint64_t dst, const void *src, size_t n) {
    const int64_t t0 = now_ns();
    __atomic_store_n(&b->copy_since, t0, __ATOMIC_RELEASE);
    const int rc = b->copy(dst, src, n, b->stream);
    const int64_t took = now_ns() - t0;
    __atomic_store_n(&b->copy_since, 0, __ATOMIC_RELEASE);
    if (took > __atomic_load_n(&b->copy_max, __ATOMIC_RELAXED)) __atomic_store_n(&b->copy_max, took, __ATOMIC_RELAXED);
    return rc;
}

static int bus_job(bus_t *b, int32_t seq) {
    const int layer = b->mb[BUS_LAYER], n = b->mb[BUS_N];
    int status = 0;
    if (layer < 0 || layer >= b->nlayers || !b->src[3 * layer]) status = LT_ERR_LAYER;
    else if (n < 0 || n > BUS_MAX || n > b->dst_rows) status = LT_ERR_SHAPE;
    for (int j = 0; !status && j < n; j++) {
        const int e = b->mb[BUS_IDS + j];
        if (e < 0) continue;
        if (e >= b->experts[layer]) { status = LT_ERR_SHAPE; break; }
        for (int i = 0; i < 3; i++) {
            const int64_t slab = b->slab[3 * layer + i];
            if (bus_copy(b, b->dst[i] + (uint64_t)(j * b->dst_row[i]), b->src[3 * layer + i] + (int64_t)e * slab,
                         (size_t)slab) != 0) { status = -2; break; }
        }
    }
    if (status) __atomic_store_n(&b->mb[BUS_STATUS], status, __ATOMIC_RELEASE);
    __atomic_add_fetch(&b->jobs, 1, __ATOMIC_RELEASE);  /* before the number lands: a device that saw it sees this */
    volatile int32_t *slot = &b->mb[BUS_RING + (int)((uint32_t)seq % BUS_SLOTS)];
    *slot = seq;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    if (bus_copy(b, b->flag, (const void *)slot, sizeof(int32_t)) != 0) {
        __atomic_store_n(&b->mb[BUS_STATUS], -2, __ATOMIC_RELEASE);
        return -2;
    }
    return status;
}

static void *bus_main(void *arg) {
    bus_t *b = (bus_t *)arg;
    if (b->set_ctx && b->set_ctx(b->ctx) != 0) {
        __atomic_store_n(&b->mb[BUS_STATUS], -3, __ATOMIC_RELEASE);
        return NULL;
    }
    int32_t last = b->start_seq;
    int64_t idle_since = now_ns();
    __atomic_store_n(&b->idle_since, idle_since, __ATOMIC_RELEASE);
    unsigned spins = 0;
    while (!b->stop) {
        const int32_t seq = __atomic_load_n(&b->mb[BUS_SEQ], __ATOMIC_ACQUIRE);
        if (seq == last) {
            CPU_RELAX();
            if (++spins % 4096 == 0) {
                const int64_t idle = now_ns() - idle_since;
                if (idle > IDLE_NS) {
                    struct timespec t = {0, idle > DEEP_IDLE_NS ? 1000000 : 50000};
                    nanosleep(&t, NULL);
                    spins = 4095;
                }
            }
            continue;
        }
        last = seq;
        __atomic_store_n(&b->seen, (int64_t)seq, __ATOMIC_RELAXED);
        __atomic_store_n(&b->job_since, now_ns(), __ATOMIC_RELEASE);
        bus_job(b, seq);
        idle_since = now_ns();
        __atomic_store_n(&b->idle_since, idle_since, __ATOMIC_RELAXED);
        __atomic_store_n(&b->job_since, 0, __ATOMIC_RELEASE);
        spins = 0;
    }
    return NULL;
}

/* A copier for nlayers layers over the mailbox mb; copy is cuMemcpyHtoDAsync_v2 (or lt_copy_host), set_ctx
   cuCtxSetCurrent with ctx (or NULL), stream the CUstream its copies go on, flag the device word of the numbers.
   Matrices and stage rows are registered next (lt_bus_src, lt_bus_dst), then lt_bus_go starts the thread. */
void *lt_bus_start(int32_t *mb, int nlayers, void *copy, void *set_ctx, void *ctx, void *stream, uint64_t flag) {
    if (!mb || nlayers < 1 || !copy || !flag) return NULL;
    bus_t *b = (bus_t *)calloc(1, sizeof(bus_t));
    if (!b) return NULL;
    b->mb = mb; b->nlayers = nlayers; b->copy = (lt_copy_fn)copy; b->set_ctx = (lt_ctx_fn)set_ctx;
    b->ctx = ctx; b->stream = stream; b->flag = flag;
    b->src = (const uint8_t **)calloc((size_t)nlayers * 3, sizeof(*b->src));
    b->slab = (int64_t *)calloc((size_t)nlayers * 3, sizeof(int64_t));
    b->experts = (int *)calloc((size_t)nlayers, sizeof(int));
    if (!b->src || !b->slab || !b->experts) {
        free(b->src); free(b->slab); free(b->experts); free(b);
        return NULL;
    }
    return b;
}

/* One layer's matrix (0 gate, 1 up, 2 down): experts of slab bytes each from base. 0, or -1 for a bad argument
   (every matrix of a layer must name the same number of experts; none after lt_bus_go). */
int lt_bus_src(void *bus, int layer, int which, const uint8_t *base, int experts, int64_t slab) {
    bus_t *b = (bus_t *)bus;
    if (!b || b->started || layer < 0 || layer >= b->nlayers || which < 0 || which > 2 || !base || experts < 1
        || slab < 1 || (b->experts[layer] && b->experts[layer] != experts))
        return -1;
    b->src[3 * layer + which] = base; b->slab[3 * layer + which] = slab; b->experts[layer] = experts;
    return 0;
}

/* The stage's rows of matrix which: fetched expert j's go to base + j * row_bytes, rows of them. 0 or -1. */
int lt_bus_dst(void *bus, int which, uint64_t base, int64_t row_bytes, int rows) {
    bus_t *b = (bus_t *)bus;
    if (!b || b->started || which < 0 || which > 2 || !base || row_bytes < 1 || rows < 1) return -1;
    b->dst[which] = base; b->dst_row[which] = row_bytes;
    b->dst_rows = which == 0 || rows < b->dst_rows ? rows : b->dst_rows;
    return 0;
}

/* Starts the thread once every layer's three matrices fit the stage's rows: 0, -1 for a matrix missing or too
   large, -2 where the thread could not start. */
int lt_bus_go(void *bus) {
    bus_t *b = (bus_t *)bus;
    if (!b || b->started || !b->dst[0] || !b->dst[1] || !b->dst[2]) return -1;
    for (int l = 0; l < b->nlayers; l++) {
        if (!b->src[3 * l] && !b->src[3 * l + 1] && !b->src[3 * l + 2]) continue;  /* a layer never fetched */
        for (int i = 0; i < 3; i++)
            if (!b->src[3 * l + i] || b->slab[3 * l + i] > b->dst_row[i]) return -1;
    }
    b->start_seq = __atomic_load_n(&b->mb[BUS_SEQ], __ATOMIC_ACQUIRE);
    b->seen = b->start_seq;
    b->idle_since = now_ns();
    if (pthread_create(&b->thread, NULL, bus_main, b) != 0) return -2;
    b->started = 1;
    return 0;
}

int64_t lt_bus_jobs(void *bus) { return __atomic_load_n(&((bus_t *)bus)->jobs, __ATOMIC_ACQUIRE); }

/* Where the copier stands, 5 words into out: the last number it took, nanoseconds in its current job (-1: it is
   looking at the mailbox), nanoseconds since its last job ended, nanoseconds in its current call of the driver's
   copy (-1: none), the longest such call. 0, or -1 for no copier. */
int lt_bus_state(void *bus, int64_t *out) {
    bus_t *b = (bus_t *)bus;
    if (!b || !out) return -1;
    const int64_t now = now_ns(), job = __atomic_load_n(&b->job_since, __ATOMIC_ACQUIRE);
    const int64_t copy = __atomic_load_n(&b->copy_since, __ATOMIC_ACQUIRE);
    out[0] = __atomic_load_n(&b->seen, __ATOMIC_RELAXED);
    out[1] = job ? now - job : -1;
    out[2] = now - __atomic_load_n(&b->idle_since, __ATOMIC_RELAXED);
    out[3] = copy ? now - copy : -1;
    out[4] = __atomic_load_n(&b->copy_max, __ATOMIC_RELAXED);
    return 0;
}

void lt_bus_stop(void *bus) {
    bus_t *b = (bus_t *)bus;
    if (!b) return;
    b->stop = 1;
    if (b->started) pthread_join(b->thread, NULL);
    free(b->src); free(b->slab); free(b->experts); free(b);
}
