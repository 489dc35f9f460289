/* Where the native LoRA update's time goes in a batch-16 step: the default
 * model's shapes (SmolLM2-135M: 30 layers, hidden 576, intermediate 1536, q
 * 576 / k, v 192), 4 slots of rank 16 on all seven projections, 16 rows (4
 * per adapter, interleaved), random weights; the 30 layers' panels are
 * distinct (~39 MB bf16, ~78 MB f32: past the L3), so each step streams them
 * as the real one does. Times each fused linear's update per step (lora_add),
 * and with -DF32_TILES the shrink and expand jobs apart on the float32
 * layout the kernels had before the bf16 panels (csrc/kvq_kernels.c of
 * commit 1c9c4c0). A C program that includes the kernels' source (the
 * functions it times are static):
 *
 *   gcc -O3 -pthread -fopenmp-simd -I. -DKERNELS='"csrc/kvq_kernels.c"' -o /tmp/lora_kernels \
 *       benchmarks/lora_kernels.c -lm && /tmp/lora_kernels [threads] [steps]
 *   git show 1c9c4c0:csrc/kvq_kernels.c > /tmp/old.c && gcc ... -DF32_TILES -DKERNELS='"/tmp/old.c"' ...
 *
 * Prints a table (ms per step, bytes read per step); docs/performance.md
 * quotes it. */
#include KERNELS
#include <stdio.h>
#include <time.h>
#ifndef F32_TILES
#define ESZ 2.0
#else
#define ESZ 4.0
#endif
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define L 30
#define S 4
#define R 16
#define T 16
int main(int argc, char** argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2, steps = argc > 2 ? atoi(argv[2]) : 20;
    int64_t hidden = 576, inter = 1536;
    int64_t ins[4] = {576, 576, 576, 1536}, nt[4] = {3, 1, 2, 1};
    int64_t outs[4][3] = {{576, 192, 192}, {576}, {1536, 1536}, {576}};
    int xops[4] = {KVQ_X_RMS_NORM, KVQ_X_PLAIN, KVQ_X_RMS_NORM, KVQ_X_SWIGLU};
    static kvq_lora_linear lins[L * 4];
    int64_t ranks[4][S * 3];
    for (int g = 0; g < 4; g++) for (int i = 0; i < S * 3; i++) ranks[g][i] = R;
    srand(1);
    for (int l = 0; l < L; l++) for (int g = 0; g < 4; g++) {
        kvq_lora_linear* li = &lins[4 * l + g];
        li->in = ins[g]; li->num_targets = nt[g]; li->max_rank = R; li->width = nt[g] * R;
        li->out_offsets[0] = 0;
        for (int t = 0; t < nt[g]; t++) li->out_offsets[t + 1] = li->out_offsets[t] + outs[g][t];
        li->out = li->out_offsets[nt[g]];
#ifndef F32_TILES
        int64_t na = S * nt[g] * 16 * li->in, nb = 0;
        for (int t = 0; t < nt[g]; t++) nb += S * R * lora_tiles(outs[g][t]) * 16;
        uint16_t* a = aligned_alloc(64, 2 * na + 64);
        uint16_t* b = aligned_alloc(64, 2 * nb + 64);
        for (int64_t i = 0; i < na; i++) a[i] = f32_to_bf16((rand() / (float)RAND_MAX - .5f) * .1f);
        for (int64_t i = 0; i < nb; i++) b[i] = f32_to_bf16((rand() / (float)RAND_MAX - .5f) * .1f);
#else
        float* a = malloc(sizeof(float) * S * li->in * li->width);
        float* b = malloc(sizeof(float) * S * li->width * li->out);
        for (int64_t i = 0; i < S * li->in * li->width; i++) a[i] = (rand() / (float)RAND_MAX - .5f) * .1f;
        for (int64_t i = 0; i < S * li->width * li->out; i++) b[i] = (rand() / (float)RAND_MAX - .5f) * .1f;
#endif
        li->a = a; li->b = b; li->ranks = ranks[g];
    }
    int64_t rows[T], segs[S][3];
    for (int s = 0; s < S; s++) { segs[s][0] = s; segs[s][1] = s * (T / S); segs[s][2] = (s + 1) * (T / S); }
    for (int i = 0; i < T; i++) rows[i] = (i % (T / S)) * S + i / (T / S);  /* slot s: rows s, s + 4, .. */
    kvq_lora_step step = {lins, rows, &segs[0][0], T, S};
    float* x = malloc(sizeof(float) * T * 2 * inter);
    float* y = malloc(sizeof(float) * T * 2 * inter);
    float* w = malloc(sizeof(float) * hidden);
    for (int64_t i = 0; i < T * 2 * inter; i++) { x[i] = rand() / (float)RAND_MAX - .5f; y[i] = 0; }
    for (int i = 0; i < hidden; i++) w[i] = 1.f;
    float* xs = malloc(sizeof(float) * T * (1536 + 48));
    float* shrunk = xs + T * 1536;
    double tsh[4] = {0}, tex[4] = {0}, tall = 0;
    for (int it = 0; it < steps + 2; it++) {
        double t0 = now();
        for (int l = 0; l < L; l++) for (int g = 0; g < 4; g++) {
            const kvq_lora_linear* lin = &lins[4 * l + g];
            int64_t ldx = g == 3 ? 2 * inter : lin->in, ldy = lin->out;
#ifndef F32_TILES
            double a = now();
            lora_add(&step, lin, x, KVQ_F32, ldx, xops[g], w, 1e-5f, y, ldy, xs, shrunk, threads);
            double b = now(), c = b;
#else
            int64_t col_blocks = 0;
            for (int64_t t = 0; t < lin->num_targets; t++)
                col_blocks += (lin->out_offsets[t + 1] - lin->out_offsets[t] + KVQ_LORA_COLS - 1) / KVQ_LORA_COLS;
            lora_job j = {&step, lin, x, KVQ_F32, ldx, xops[g], w, 1e-5f, y, KVQ_F32, ldy, xs, shrunk, col_blocks, 1};
            double a = now();
            parallel_chunks(threads, step.num_segments, lora_shrink_chunk, &j);
            double b = now();
            parallel_chunks(threads, step.num_segments * col_blocks, lora_expand_chunk, &j);
            double c = now();
#endif
            if (it >= 2) { tsh[g] += b - a; tex[g] += c - b; }
        }
        if (it >= 2) tall += now() - t0;
    }
    const char* names[4] = {"qkv", "o", "gate_up", "down"};
    double abytes = 0, bbytes = 0;
#ifdef F32_TILES
    printf("%-8s %9s %9s %10s %10s\n", "linear", "shrink_ms", "expand_ms", "A_MB", "B_MB");
#else
    printf("%-8s %9s %10s %10s\n", "linear", "update_ms", "A_MB", "B_MB");
#endif
    for (int g = 0; g < 4; g++) {
        double ab = ESZ * S * L * ins[g] * nt[g] * R, bb = 0;
        for (int t = 0; t < nt[g]; t++) bb += ESZ * S * L * R * outs[g][t];
        abytes += ab; bbytes += bb;
#ifdef F32_TILES
        printf("%-8s %9.3f %9.3f %10.2f %10.2f\n", names[g], 1e3 * tsh[g] / steps, 1e3 * tex[g] / steps, ab / 1e6, bb / 1e6);
#else
        printf("%-8s %9.3f %10.2f %10.2f\n", names[g], 1e3 * tsh[g] / steps, ab / 1e6, bb / 1e6);
#endif
    }
    printf("all linears %.3f ms per step (threads %d), A %.1f MB B %.1f MB read: %.1f GB/s\n", 1e3 * tall / steps, threads,
           abytes / 1e6, bbytes / 1e6, (abytes + bbytes) / (tall / steps) / 1e9);
    return 0;
}
