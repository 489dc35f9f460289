/* How close the Q4_1 VNNI matmul tile comes to what this core can issue:
 *   1. vpdpbusd alone (512-bit, 16 independent accumulators, registers only):
 *      the integer peak, in GOP/s (2 ops per u8 x s8 product);
 *   2. the tile's instruction mix in registers: per 32-input block of 16
 *      weight rows x 8 activation rows, 64 vpdpbusd and the float epilogue
 *      (8 x: int->float, dw*da, two FMAs), no loads: the tile's own bound;
 *   3. pair_tile_vnni itself (8 activation rows, K = 576, data in L1), as the
 *      prefill's 256-row matmuls run it;
 *   4. matmul_tile around it: the same tile and its 8 x 16 outputs stored
 *      (float32 with a residual added, as the o and down projections do).
 * Figures 1 and 2 bound 3; the gap between 2 and 3 is the loads, the weight
 * unpacking and the loop. One thread. A C program that includes the kernels'
 * source (the tile is static):
 *
 *   gcc -O3 -pthread -fopenmp-simd -I. -DKERNELS='"csrc/kvq_kernels.c"' -o /tmp/vnni_peak \
 *       benchmarks/vnni_peak.c -lm && /tmp/vnni_peak [seconds]
 */
#include KERNELS
#include <stdio.h>
#include <time.h>

/* The thread's CPU time: on a shared machine, not the time spent waiting for a core. */
static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

#define VNNI_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"), noinline))

/* 16 chains of vpdpbusd, `iters` rounds; returns a value so nothing is dropped. */
VNNI_FN static int dpbusd_only(int64_t iters, char wb, char ab) {
    __m512i w = _mm512_set1_epi8(wb), a = _mm512_set1_epi8(ab);
    __m512i acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_epi32(i);
    for (int64_t it = 0; it < iters; it++) {
        for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], w, a);
        __asm__ volatile("" : "+v"(w), "+v"(a));
    }
    __m512i s = acc[0];
    for (int i = 1; i < 16; i++) s = _mm512_add_epi32(s, acc[i]);
    return _mm512_reduce_add_epi32(s);
}

/* The tile's mix per block: 64 vpdpbusd into 8 row accumulators, then per row
 * cvt, mul, fma, fma into its float accumulator. */
VNNI_FN static float tile_mix(int64_t blocks, char wb0, char wb1, float dwf, float mwf) {
    __m512i w0 = _mm512_set1_epi8(wb0), w1 = _mm512_set1_epi8(wb1);
    __m512 dw = _mm512_set1_ps(dwf), mw = _mm512_set1_ps(mwf);
    __m512 accf[8];
    for (int r = 0; r < 8; r++) accf[r] = _mm512_setzero_ps();
    static float da[8], sa[8];  /* per row, reloaded every block as the kernel's are */
    for (int r = 0; r < 8; r++) { da[r] = 0.5f + r; sa[r] = 0.25f * r; }
    __m512i a[8];  /* a row's activations (distinct, so no two rows' work is one) */
    for (int r = 0; r < 8; r++) a[r] = _mm512_set1_epi32(0x01020304 + r);
    for (int64_t b = 0; b < blocks; b++) {
        __m512i acc32[8];
        for (int r = 0; r < 8; r++) acc32[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++)
            for (int r = 0; r < 8; r++) {
                acc32[r] = _mm512_dpbusd_epi32(acc32[r], w0, a[r]);
                acc32[r] = _mm512_dpbusd_epi32(acc32[r], w1, a[r]);
            }
        for (int r = 0; r < 8; r++) {
            accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc32[r]), _mm512_mul_ps(dw, _mm512_set1_ps(da[r])), accf[r]);
            accf[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sa[r]), accf[r]);
        }
        __asm__ volatile("" : "+v"(w0), "+v"(w1), "+v"(dw), "+v"(mw) : : "memory");
        __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]));
        __asm__ volatile("" : "+v"(a[4]), "+v"(a[5]), "+v"(a[6]), "+v"(a[7]));
    }
    __m512 s = accf[0];
    for (int r = 1; r < 8; r++) s = _mm512_add_ps(s, accf[r]);
    return _mm512_reduce_add_ps(s);
}

int main(int argc, char** argv) {
    const double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    if (!kvq_has_avx512_vnni()) { printf("no AVX512-VNNI on this CPU\n"); return 0; }
    volatile int sink = 0;
    volatile float fsink = 0.f;
    /* 1. */
    double best1 = 0;
    for (double t_end = now() + seconds; now() < t_end;) {
        const int64_t iters = 1 << 20;
        double t0 = now();
        sink += dpbusd_only(iters, 3, 5);
        double gops = (double)iters * 16 * 64 * 2 / (now() - t0) / 1e9;
        best1 = gops > best1 ? gops : best1;
    }
    /* 2. */
    double best2 = 0;
    for (double t_end = now() + seconds; now() < t_end;) {
        const int64_t blocks = 1 << 18;
        double t0 = now();
        fsink += tile_mix(blocks, 3, 5, 0.1f, 0.2f);
        double gops = (double)blocks * 16 * 8 * 32 * 2 / (now() - t0) / 1e9;
        best2 = gops > best2 ? gops : best2;
    }
    /* 3. 16 weight rows (two groups) x K = 576 of Q4_1, 8 activation rows. */
    const int64_t K = 576, nb = K / QK, bb = kvq_block_bytes(KVQ_Q4_1);
    uint8_t* w = malloc((size_t)(2 * nb * bb));
    int8_t* qa = malloc((size_t)(8 * K));
    float *da = malloc(sizeof(float) * 8 * nb), *sa = malloc(sizeof(float) * 8 * nb);
    for (int64_t i = 0; i < 2 * nb * bb; i++) w[i] = (uint8_t)(i * 37 + 11);
    for (int64_t b = 0; b < 2 * nb; b++) {  /* finite fp16 scales: 0x3c00 = 1.0 */
        uint16_t* h = (uint16_t*)(w + b * bb);
        for (int i = 0; i < 16; i++) h[i] = 0x3c00;
    }
    for (int64_t i = 0; i < 8 * K; i++) qa[i] = (int8_t)(i * 13 - 50);
    for (int64_t i = 0; i < 8 * nb; i++) { da[i] = 0.01f; sa[i] = 0.02f; }
    float out[KVQ_MAX_ROWS][2 * NR];
    double best3 = 0;
    for (double t_end = now() + seconds; now() < t_end;) {
        const int reps = 20000;
        double t0 = now();
        for (int i = 0; i < reps; i++) {
            pair_tile_vnni(KVQ_Q4_1, w, w + nb * bb, nb, qa, da, sa, K, 8, 0, out, NULL, 0, NULL, 0);
            fsink += out[i & 7][i & 15];
        }
        double gops = (double)reps * 16 * 8 * K * 2 / (now() - t0) / 1e9;
        best3 = gops > best3 ? gops : best3;
    }
    /* 4. the same through matmul_tile: the tile, then its 8 x 16 outputs stored
     * (float32, plus a residual row as o and down add it). */
    float* y = calloc(8 * 16, sizeof(float));
    float* add = calloc(8 * 16, sizeof(float));
    double best4 = 0;
    for (double t_end = now() + seconds; now() < t_end;) {
        const int reps = 20000;
        double t0 = now();
        for (int i = 0; i < reps; i++)
            matmul_tile(KVQ_Q4_1, w, nb, bb, 2, K, 0, 16, qa, da, sa, 0, 8, y, KVQ_F32, 16, add, KVQ_F32, 16, 3);
        double gops = (double)reps * 16 * 8 * K * 2 / (now() - t0) / 1e9;
        best4 = gops > best4 ? gops : best4;
    }
    fsink += y[5];
    printf("| measure (1 thread, best of %.1f s) | GOP/s |\n|---|---:|\n", seconds);
    printf("| vpdpbusd alone (zmm, 16 chains) | %.0f |\n", best1);
    printf("| the tile's instruction mix in registers | %.0f |\n", best2);
    printf("| pair_tile_vnni, 8 rows, K=576, L1 | %.0f |\n", best3);
    printf("| matmul_tile (the pair tile + its stores with a residual add) | %.0f |\n", best4);
    (void)sink; (void)fsink;
    return 0;
}
