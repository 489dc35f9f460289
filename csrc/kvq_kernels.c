/* kvserve's quantized CPU kernels: matmul on GGUF Q8_0 / Q4_0 / Q4_1 weights
 * without dequantizing them, plus the small fused pieces of a decoder step
 * (RMSNorm with the residual add, decode attention over the paged KV cache).
 *
 * Called through ctypes (src/kvserve/model/quantized.py), which releases the
 * GIL for the whole call: the HTTP event loop keeps running while a kernel
 * computes. Threads: the kernels' own small pool (below), not OpenMP, so the
 * caller never waits for a helper that has not started: see "the pool".
 *
 * Weight layout ("8-row interleaved", built by quantized.py from GGUF blocks):
 * rows are taken 8 at a time (a group); for each group and each 32-wide block
 * of the input dimension:
 *   Q8_0: d[8] fp16 | qs[8 steps][8 rows][4] int8               272 bytes
 *   Q4_0: d[8] fp16 | nib[4 chunks][8 rows][4]                   144 bytes
 *   Q4_1: d[8] fp16 | m[8] fp16 | nib[4 chunks][8 rows][4]       160 bytes
 * so a 256-bit register holds 4 consecutive inputs of 8 output rows, and the
 * 8 rows' dot products build up lane by lane with no horizontal sums. For Q4,
 * byte 4r+j of chunk c holds input 4c+j in its low nibble and 16+4c+j in its
 * high nibble (exactly GGUF's qs[4c+j] of row r). Q4_0's value is d*(q-8),
 * Q4_1's d*q+m, Q8_0's d*q.
 *
 * Activations are quantized per row in blocks of 32 (d = max|x|/127, q =
 * round(x/d)) with s = d*sum(q) kept for the Q4 offsets, as llama.cpp's Q8_1.
 *
 * Code paths chosen at run time (kvq_set_isa): portable C; AVX2 (+FMA, F16C);
 * where the CPU has AVX512-VNNI, VNNI matmul tiles and 512-bit RMS-norm,
 * activation quantization and SwiGLU (all bit-identical to AVX2) and 512-bit
 * attention tiles (the same results up to float summation order, as AVX2 is
 * to portable C), with a run of one sequence's rows across vector lanes (see
 * "a run of rows attends across vector lanes"); and, the "best" one where it also has AMX-INT8, the VNNI
 * path with its larger products (16 rows or more for Q8_0, 48 for Q4) on the AMX tiles
 * (bit-identical to the VNNI tiles: see "AMX tiles").
 */
#define _GNU_SOURCE  /* pthread_setname_np */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVQ_X86 1
#endif

enum { KVQ_Q4_0 = 2, KVQ_Q4_1 = 3, KVQ_Q8_0 = 8 };  /* ggml's type ids */
enum { KVQ_F32 = 0, KVQ_BF16 = 1 };
/* The KV cache's element types: KVQ_F32, KVQ_BF16, or KVQ_I8, where each
 * row of D values (one head's K or V of one slot) is its float32 scale, then
 * D int8 values: value i = scale * q[i], scale = max |x| / 127 of the row as
 * written (kvq_rope_write_kv). Half bfloat16's bytes for a decode row's
 * attention to read. */
enum { KVQ_I8 = 2 };
/* An int8 row's scale, before its values (model_facts/memory.KV_ROW_SCALE_BYTES). */
#define KVQ_ROW_SCALE_BYTES 4

/* Bytes of one cache row of D values. */
static inline size_t cache_row_bytes(int cache_dtype, int64_t D) {
    return cache_dtype == KVQ_I8 ? (size_t)D + KVQ_ROW_SCALE_BYTES : (size_t)D * (cache_dtype == KVQ_BF16 ? 2 : 4);
}

/* An int8 cache row's scale (its first KVQ_ROW_SCALE_BYTES, unaligned). */
static inline float cache_row_scale(const char* row) {
    float scale;
    memcpy(&scale, row, sizeof scale);
    return scale;
}
#define QK 32
#define NR 8
#define KVQ_MAX_ROWS 8  /* activation rows per matmul tile, at most (the VNNI path's) */
#define KVQ_AMX_ROWS 16  /* activation rows per AMX tile */
/* Activation rows from which a matmul takes the AMX tiles where it has them
 * (the same numbers either way: the choice is speed alone). Measured on one
 * layer's four matmuls of the default model (2 threads, 2026-12-06 Xeon):
 * Q8_0 1.34x the VNNI tiles at 16 rows, 2.0x at 64; Q4 0.88x at 17-24 rows
 * (the VNNI tiles sum a Q4 block in few ops; the tiles pay an unpack of the
 * nibbles per call), 1.0x at 32-40, 1.07x at 48, 1.1-1.4x from 96. */
#ifndef KVQ_AMX_MIN_ROWS_Q8
#define KVQ_AMX_MIN_ROWS_Q8 16
#endif
#ifndef KVQ_AMX_MIN_ROWS_Q4
#define KVQ_AMX_MIN_ROWS_Q4 48
#endif

static int g_force_scalar = 0;

/* ---- scalar helpers ------------------------------------------------------ */

static float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7f800000 | (mant << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (mant << 13); }
    float f; memcpy(&f, &bits, 4); return f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch */
    uint32_t bits; memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40);  /* NaN */
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline float load_x(const void* x, int xtype, int64_t i) {
    return xtype == KVQ_BF16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
}

static inline void store_y(void* y, int ytype, int64_t i, float v) {
    if (ytype == KVQ_BF16) ((uint16_t*)y)[i] = f32_to_bf16(v); else ((float*)y)[i] = v;
}

int64_t kvq_block_bytes(int wtype) {
    switch (wtype) {
        case KVQ_Q8_0: return 16 + 256;
        case KVQ_Q4_0: return 16 + 128;
        case KVQ_Q4_1: return 32 + 128;
        default: return -1;
    }
}

int kvq_has_avx2(void) {
#ifdef KVQ_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* VNNI's vpdpbusd (u8 x s8, 4 products summed into an int32 lane) on 256-bit
 * registers, EVEX-encoded so the kernels get 32 of them (AVX512VL). */
int kvq_has_avx512_vnni(void) {
#ifdef KVQ_X86
    __builtin_cpu_init();
    return kvq_has_avx2() && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static int g_no_vnni = 0, g_no_amx = 0;

/* The matmul's path: 0 portable C, 2 AVX2, 3 AVX2 with VNNI (and AVX-512
 * beside it; the AMX tiles, where amx_enabled(), are on top of this path). */
static int matmul_isa(void) {
    if (g_force_scalar || !kvq_has_avx2()) return 0;
    return !g_no_vnni && kvq_has_avx512_vnni() ? 3 : 2;
}

static int amx_enabled(void);

/* The exported interface's version. model/quantized.py calls only a build of
 * the version it was written against: a stale build (a kernel's arguments
 * changed since) is refused, not called with arguments in the wrong places.
 * Raise it with any change to an exported signature or struct, or to what
 * an argument's values mean (2: cache_dtype KVQ_I8; 3: run_min_rows of
 * kvq_decode_attention and kvq_decode_layers). */
#define KVQ_ABI_VERSION 3
int kvq_abi_version(void) { return KVQ_ABI_VERSION; }

/* mode 0: the best path the CPU has; 1: pin the portable path; 2: AVX2 without
 * VNNI; 3: VNNI without the AMX tiles (tests compare the paths). Returns the
 * matmul's path: as matmul_isa, or 4 where the AMX tiles take its larger products. */
int kvq_set_isa(int mode) {
    g_force_scalar = mode == 1;
    g_no_vnni = mode == 2;
    g_no_amx = mode == 3;
    return amx_enabled() ? 4 : matmul_isa();
}

/* ---- the pool ------------------------------------------------------------ */

/* A job is `num_chunks` independent chunks of work. The caller publishes it,
 * wakes the helpers and claims chunks itself; each helper claims chunks until
 * none is left. The caller then waits only for chunks a helper has claimed
 * and not finished, never for a helper to show up: on a shared machine a
 * helper whose core is taken wakes late, finds nothing to claim and sleeps
 * again, while an OpenMP team's barrier waits for every member (measured: 2
 * OpenMP threads at 10x the 1-thread step with the machine loaded).
 *
 * A claim is a CAS on `ticket` = generation << 32 | next chunk, so a helper
 * that read an old job can never claim a chunk of a newer one; a job's
 * context stays valid while any of its chunks is unclaimed or unfinished. */
typedef void (*chunk_fn)(const void* ctx, int64_t chunk);

#define KVQ_MAX_HELPERS 63
static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int num_helpers;  /* started so far; they live until the process ends */
    pthread_t threads[KVQ_MAX_HELPERS];
    uint32_t generation;  /* written under mu; helpers also read it without (atomically) while they spin */
    chunk_fn fn;          /* the job: under mu */
    const void* ctx;
    int64_t num_chunks;
    int max_helpers;      /* helpers with an index below this take part */
    _Atomic uint64_t ticket;
    _Atomic int64_t done;
} g_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, {0}, 0, NULL, NULL, 0, 0, 0, 0};

static int64_t claim(uint32_t generation, int64_t num_chunks) {
    uint64_t t = atomic_load(&g_pool.ticket);
    for (;;) {
        if ((uint32_t)(t >> 32) != generation || (int64_t)(t & 0xffffffffu) >= num_chunks) return -1;
        if (atomic_compare_exchange_weak(&g_pool.ticket, &t, t + 1)) return (int64_t)(t & 0xffffffffu);
    }
}

static void run_chunks(chunk_fn fn, const void* ctx, uint32_t generation, int64_t num_chunks) {
    int64_t finished = 0;
    for (int64_t c; (c = claim(generation, num_chunks)) >= 0; finished++) fn(ctx, c);
    if (finished) atomic_fetch_add(&g_pool.done, finished);  /* once: the count's line bounces between cores */
}

/* After a job, a helper watches for the next one for up to KVQ_SPIN_US before
 * it sleeps on the condition variable: a step's layers run back to back, one
 * job microseconds after the last (two per matmul: quantize, then multiply),
 * and a futex wake-up of a sleeping helper costs tens of microseconds on a VM
 * (a 256-row activation quantization ran no faster on 2 threads than on 1).
 * Between steps (milliseconds apart) it sleeps as before, and the caller still
 * never waits for a helper: spinning only lets one join sooner. */
#ifndef KVQ_SPIN_US
#define KVQ_SPIN_US 50
#endif
static void spin_for_next_job(uint32_t seen) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int spins = 1;; spins++) {
        if (__atomic_load_n(&g_pool.generation, __ATOMIC_ACQUIRE) != seen) return;
#ifdef KVQ_X86
        __builtin_ia32_pause();
#endif
        if (spins % 64 == 0) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            if ((now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec) > KVQ_SPIN_US * 1000L) return;
        }
    }
}

static void* helper_main(void* arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = 0;
    pthread_setname_np(pthread_self(), "kvq-pool");  /* named in top -H, ps -L (and counted by the tests) */
    pthread_mutex_lock(&g_pool.mu);
    seen = g_pool.generation;
    for (;;) {
        while (g_pool.generation == seen) pthread_cond_wait(&g_pool.wake, &g_pool.mu);
        seen = g_pool.generation;
        chunk_fn fn = g_pool.fn;
        const void* ctx = g_pool.ctx;
        const int64_t num_chunks = g_pool.num_chunks;
        const int takes_part = index < g_pool.max_helpers;
        pthread_mutex_unlock(&g_pool.mu);
        if (takes_part) run_chunks(fn, ctx, seen, num_chunks);
        spin_for_next_job(seen);
        pthread_mutex_lock(&g_pool.mu);
    }
    return NULL;
}

/* Held by the one caller that is running a job with helpers. */
static pthread_mutex_t g_caller = PTHREAD_MUTEX_INITIALIZER;

static void forget_helpers_after_fork(void) {  /* a forked child has none of the threads */
    pthread_mutex_init(&g_caller, NULL);
    pthread_mutex_init(&g_pool.mu, NULL);
    pthread_cond_init(&g_pool.wake, NULL);
    g_pool.num_helpers = 0;
}

/* Run fn(ctx, c) for c < num_chunks on the caller and up to num_threads - 1
 * helpers; returns when every chunk has finished. One caller at a time (the
 * engine's thread; a second caller would wait on the mutex). */
static void parallel_chunks(int num_threads, int64_t num_chunks, chunk_fn fn, const void* ctx) {
    int helpers = num_threads - 1 < num_chunks - 1 ? num_threads - 1 : (int)num_chunks - 1;
    if (helpers > KVQ_MAX_HELPERS) helpers = KVQ_MAX_HELPERS;
    if (helpers <= 0) {
        for (int64_t c = 0; c < num_chunks; c++) fn(ctx, c);
        return;
    }
    pthread_mutex_lock(&g_caller);
    pthread_mutex_lock(&g_pool.mu);
    static int atfork_set = 0;
    if (!atfork_set) { pthread_atfork(NULL, NULL, forget_helpers_after_fork); atfork_set = 1; }
    while (g_pool.num_helpers < helpers) {
        if (pthread_create(&g_pool.threads[g_pool.num_helpers], NULL, helper_main,
                           (void*)(intptr_t)g_pool.num_helpers) != 0) break;
        /* Named here too: a helper not yet scheduled would still show the caller's name. */
        pthread_setname_np(g_pool.threads[g_pool.num_helpers], "kvq-pool");
        pthread_detach(g_pool.threads[g_pool.num_helpers]);
        g_pool.num_helpers++;
    }
    const uint32_t generation = __atomic_add_fetch(&g_pool.generation, 1, __ATOMIC_RELEASE);
    g_pool.fn = fn; g_pool.ctx = ctx; g_pool.num_chunks = num_chunks; g_pool.max_helpers = helpers;
    atomic_store(&g_pool.done, 0);
    atomic_store(&g_pool.ticket, (uint64_t)generation << 32);
    pthread_cond_broadcast(&g_pool.wake);
    pthread_mutex_unlock(&g_pool.mu);
    run_chunks(fn, ctx, generation, num_chunks);
    /* What is left is chunks helpers hold; yield rather than spin if one was preempted. */
    for (int spins = 0; atomic_load(&g_pool.done) < num_chunks; spins++) {
        if (spins > 2000) sched_yield();
#ifdef KVQ_X86
        else __builtin_ia32_pause();
#endif
    }
    pthread_mutex_unlock(&g_caller);
}

/* A thread's buffer of at least num_bytes (64-byte aligned), grown as needed and kept. */
static void* grown(void** buffer, int64_t* capacity, int64_t num_bytes) {
    if (num_bytes > *capacity) {
        free(*buffer);
        *buffer = aligned_alloc(64, (size_t)((num_bytes + 63) / 64 * 64));
        *capacity = *buffer ? num_bytes : 0;
    }
    return *buffer;
}

/* ---- activation quantization -------------------------------------------- */

static void quantize_row_scalar(const void* x, int xtype, int64_t K, int8_t* q, float* d, float* s) {
    for (int64_t b = 0; b < K / QK; b++) {
        float amax = 0.f, v[QK];
        for (int j = 0; j < QK; j++) { v[j] = load_x(x, xtype, b * QK + j); amax = fmaxf(amax, fabsf(v[j])); }
        float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; j++) { int qi = (int)nearbyintf(v[j] * inv); q[b * QK + j] = (int8_t)qi; sum += qi; }
        d[b] = scale; s[b] = scale * (float)sum;
    }
}

#ifdef KVQ_X86
__attribute__((target("avx2,fma,f16c")))
static inline __m256 load8_avx2(const void* x, int xtype, int64_t i) {
    if (xtype == KVQ_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float*)x + i);
}

__attribute__((target("avx2,fma,f16c")))
static void quantize_row_avx2(const void* x, int xtype, int64_t K, int8_t* q, float* d, float* s) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / QK; b++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = load8_avx2(x, xtype, b * QK + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float am = _mm_cvtss_f32(m4);
        float scale = am / 127.f, inv = am > 0.f ? 127.f / am : 0.f;
        __m256 vinv = _mm256_set1_ps(inv);
        __m256i qi[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            /* round half to even, as nearbyintf in the portable path */
            qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            sum = _mm256_add_epi32(sum, qi[i]);
        }
        /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute undoes it */
        __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(q + b * QK), p);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_hadd_epi32(s4, s4); s4 = _mm_hadd_epi32(s4, s4);
        d[b] = scale; s[b] = scale * (float)_mm_cvtsi128_si32(s4);
    }
}

/* Lane k of the result: v[k]'s 16 lanes folded by OP (add, max), for k < 16.
 * Pairs of vectors fold within 128-bit lanes, then across them: 45 ops for
 * 16 results, where one horizontal fold per vector costs ~8. Every result
 * folds its lanes in the same order, whichever k it is. */
#define KVQ_FOLD16X16(NAME, OP)                                                                             \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline)) static inline        \
    __m512 NAME(const __m512 v[16]) {                                                                        \
        __m512 t[8], u[4];                                                                                   \
        for (int k = 0; k < 8; k++) /* per 128-bit lane: [a0 op a2, b0 op b2, a1 op a3, b1 op b3] */         \
            t[k] = OP(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1])); \
        for (int k = 0; k < 4; k++) { /* per 128-bit lane: the 4 vectors' folds of that lane */             \
            const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);                \
            u[k] = OP(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b))); \
        }                                                                                                    \
        const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);                             \
        const __m512 w0 = OP(_mm512_shuffle_f32x4(u[0], u[1], even), _mm512_shuffle_f32x4(u[0], u[1], odd)); \
        const __m512 w1 = OP(_mm512_shuffle_f32x4(u[2], u[3], even), _mm512_shuffle_f32x4(u[2], u[3], odd)); \
        return OP(_mm512_shuffle_f32x4(w0, w1, even), _mm512_shuffle_f32x4(w0, w1, odd));                   \
    }
KVQ_FOLD16X16(hsum16x16_avx512, _mm512_add_ps)
KVQ_FOLD16X16(hmax16x16_avx512, _mm512_max_ps)

/* 16 values of a float32 or bfloat16 row, as floats. */
__attribute__((target("avx2,fma,f16c,avx512f")))
static inline __m512 load16_avx512(const void* x, int xtype, int64_t i) {
    if (xtype == KVQ_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i))), 16));
    return _mm512_loadu_ps((const float*)x + i);
}

/* bf16 of 16 floats, rounded as f32_to_bf16 (to nearest even; NaN kept quiet). */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline))
static inline __m256i to_bf16x16_avx512(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
}

/* Block b's int8 values (with inverse scale inv) into q; returns their sums, 16 int32 lanes. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline))
static inline __m512i quantize_block_avx512(const void* x, int xtype, int64_t b, float inv, int8_t* q) {
    const __m512 vinv = _mm512_set1_ps(inv);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < 2; i++) {
        const __m512 v = load16_avx512(x, xtype, b * QK + 16 * i);
        const __m512i qi = _mm512_cvtps_epi32(
            _mm512_roundscale_ps(_mm512_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128((__m128i*)(q + b * QK + 16 * i), _mm512_cvtsepi32_epi8(qi));
        sum = _mm512_add_epi32(sum, qi);
    }
    return sum;
}

/* quantize_row_avx2 a block per two 512-bit registers, op for op per lane
 * (the same max, rounding and saturating narrowing): the same bytes and scales.
 * Sixteen blocks at a time: their maxima and sums of q folded into one vector
 * each (max is exact in any order, and the sums are of integers below 2^24,
 * exact in float too), and their scales divided as one vector (IEEE division,
 * as the scalar one), where a block alone waited on its horizontal folds and
 * a scalar division (~0.55 ns a value on this path before). */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
static void quantize_row_avx512(const void* x, int xtype, int64_t K, int8_t* q, float* d, float* s) {
    const int64_t nb = K / QK;
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) {
        __m512 folds[16];
        for (int i = 0; i < 16; i++)
            folds[i] = _mm512_max_ps(_mm512_abs_ps(load16_avx512(x, xtype, (b + i) * QK)),
                                     _mm512_abs_ps(load16_avx512(x, xtype, (b + i) * QK + 16)));
        const __m512 am = hmax16x16_avx512(folds);
        const __m512 scale = _mm512_div_ps(am, _mm512_set1_ps(127.f));
        float inv[16];
        _mm512_storeu_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(am, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                  _mm512_set1_ps(127.f), am));
        for (int i = 0; i < 16; i++) folds[i] = _mm512_cvtepi32_ps(quantize_block_avx512(x, xtype, b + i, inv[i], q));
        _mm512_storeu_ps(d + b, scale);
        _mm512_storeu_ps(s + b, _mm512_mul_ps(scale, hsum16x16_avx512(folds)));
    }
    for (; b < nb; b++) {
        const float am = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(load16_avx512(x, xtype, b * QK)),
                                                            _mm512_abs_ps(load16_avx512(x, xtype, b * QK + 16))));
        const float scale = am / 127.f, inv = am > 0.f ? 127.f / am : 0.f;
        d[b] = scale; s[b] = scale * (float)_mm512_reduce_add_epi32(quantize_block_avx512(x, xtype, b, inv, q));
    }
}

/* RMS-norm of one row (K % 16 == 0): the sum of squares in 16 running lanes,
 * lane i over x[16j + i], folded in one fixed order; the AVX2 copy keeps the
 * 16 lanes in two registers and the AVX-512 one in one, the same fused
 * multiply-adds per lane, so both give the same floats (the matmul's paths
 * stay bit-identical, and a LoRA update's copy of the row, transformed on
 * AVX2, is the row the matmul quantized). out[k] = x[k] * inv * w[k]. */
__attribute__((target("avx2,fma,f16c")))
static float rms_inverse_of_lanes_avx2(__m256 s, int64_t K, float eps) {  /* s: lanes i + lanes i + 8 */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return 1.f / sqrtf(_mm_cvtss_f32(h) / (float)K + eps);
}

__attribute__((target("avx2,fma,f16c")))
static void rms_norm_row_avx2(const void* row, int xtype, int64_t K, const void* norm_w, float eps, float* out) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m256 v0 = load8_avx2(row, xtype, k), v1 = load8_avx2(row, xtype, k + 8);
        s0 = _mm256_fmadd_ps(v0, v0, s0);
        s1 = _mm256_fmadd_ps(v1, v1, s1);
    }
    const __m256 inv = _mm256_set1_ps(rms_inverse_of_lanes_avx2(_mm256_add_ps(s0, s1), K, eps));
    for (int64_t k = 0; k < K; k += 8)
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_mul_ps(load8_avx2(row, xtype, k), inv),
                                                load8_avx2(norm_w, xtype, k)));
}

__attribute__((target("avx2,fma,f16c,avx512f")))
static void rms_norm_row_avx512(const void* row, int xtype, int64_t K, const void* norm_w, float eps, float* out) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = load16_avx512(row, xtype, k);
        s = _mm512_fmadd_ps(v, v, s);
    }
    const __m512 inv = _mm512_set1_ps(rms_inverse_of_lanes_avx2(
        _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1))), K, eps));
    for (int64_t k = 0; k < K; k += 16)
        _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_mul_ps(load16_avx512(row, xtype, k), inv),
                                                load16_avx512(norm_w, xtype, k)));
}
#endif

/* What the matmul applies to each input row before quantizing it. */
enum { KVQ_X_PLAIN = 0, KVQ_X_RMS_NORM = 1, KVQ_X_SWIGLU = 2 };

/* One input row after its transform, in float32:
 *   RMS_NORM: x * rsqrt(mean(x^2) + eps) * weight (weight [K] in x's dtype);
 *   SWIGLU:   silu(x[:K]) * x[K:2K] (the row holds gate then up). */
__attribute__((target_clones("avx2", "default")))
#ifdef KVQ_X86
static void swiglu_avx2(const void* row, int xtype, int64_t K, float* out);  /* below, beside its exp */
static void swiglu_avx512(const void* row, int xtype, int64_t K, float* out);
#endif

/* simd: 0 the portable loops, 3 AVX-512 (matmul_isa's 3), any other AVX2. */
static void transform_row(const void* row, int xtype, int64_t K, int xop, const void* norm_w, float eps,
                          float* out, int simd) {
#ifdef KVQ_X86
    if (xop == KVQ_X_SWIGLU && simd == 3 && K % 16 == 0) { swiglu_avx512(row, xtype, K, out); return; }
    if (xop == KVQ_X_SWIGLU && simd) { swiglu_avx2(row, xtype, K, out); return; }
    if (xop == KVQ_X_RMS_NORM && simd == 3 && K % 16 == 0) { rms_norm_row_avx512(row, xtype, K, norm_w, eps, out); return; }
    if (xop == KVQ_X_RMS_NORM && simd && K % 16 == 0) { rms_norm_row_avx2(row, xtype, K, norm_w, eps, out); return; }
#endif
    (void)simd;
    if (xop == KVQ_X_SWIGLU) {
        for (int64_t k = 0; k < K; k++) {
            float g = load_x(row, xtype, k);
            out[k] = g / (1.f + expf(-g)) * load_x(row, xtype, K + k);
        }
        return;
    }
    for (int64_t k = 0; k < K; k++) out[k] = load_x(row, xtype, k);
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int64_t k = 0; k < K; k++) ss += out[k] * out[k];
    float inv = 1.f / sqrtf(ss / (float)K + eps);
    for (int64_t k = 0; k < K; k++) out[k] = out[k] * inv * load_x(norm_w, xtype, k);
}

/* One activation row transformed (xop) and quantized. */
static void quantize_row(const void* x, int xtype, int64_t K, int64_t ldx, int xop, const void* norm_w, float eps,
                         int64_t m, int8_t* q, float* d, float* s, int simd) {
    const size_t esz = xtype == KVQ_BF16 ? 2 : 4;
    const void* row = (const char*)x + (size_t)m * ldx * esz;
    int rtype = xtype;
    float tmp[xop == KVQ_X_PLAIN ? 1 : K];
    if (xop != KVQ_X_PLAIN) { transform_row(row, xtype, K, xop, norm_w, eps, tmp, simd); row = tmp; rtype = KVQ_F32; }
#ifdef KVQ_X86
    if (simd == 3) { quantize_row_avx512(row, rtype, K, q + m * K, d + m * (K / QK), s + m * (K / QK)); return; }
    if (simd) { quantize_row_avx2(row, rtype, K, q + m * K, d + m * (K / QK), s + m * (K / QK)); return; }
#endif
    (void)simd;
    quantize_row_scalar(row, rtype, K, q + m * K, d + m * (K / QK), s + m * (K / QK));
}

/* ---- the matmul: portable path ------------------------------------------- */

/* out[m, n] for the 8 rows of group g and one activation row. */
static void group_dot_scalar(int wtype, const uint8_t* wg, int64_t nb, const int8_t* qa, const float* da,
                             const float* sa, float acc[NR]) {
    const int64_t bb = kvq_block_bytes(wtype);
    for (int r = 0; r < NR; r++) acc[r] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = wg + b * bb;
        const int8_t* a = qa + b * QK;
        for (int r = 0; r < NR; r++) {
            float dw = fp16_to_f32(((const uint16_t*)blk)[r]);
            int isum = 0;
            if (wtype == KVQ_Q8_0) {
                const int8_t* qs = (const int8_t*)(blk + 16);
                for (int st = 0; st < 8; st++)
                    for (int j = 0; j < 4; j++) isum += qs[st * 32 + 4 * r + j] * a[4 * st + j];
                acc[r] += dw * da[b] * (float)isum;
                continue;
            }
            const uint8_t* nib = blk + (wtype == KVQ_Q4_1 ? 32 : 16);
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < 4; j++) {
                    uint8_t byte = nib[c * 32 + 4 * r + j];
                    isum += (byte & 0xf) * a[4 * c + j] + (byte >> 4) * a[16 + 4 * c + j];
                }
            float mw = wtype == KVQ_Q4_1 ? fp16_to_f32(((const uint16_t*)blk)[8 + r]) : -8.f * dw;
            acc[r] += dw * da[b] * (float)isum + mw * sa[b];
        }
    }
}

/* ---- the matmul: AVX2 ---------------------------------------------------- */
#ifdef KVQ_X86
/* MR activation rows (1..4) against the 8 rows of one group. */
#define KVQ_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline
/* A decode step streams every weight from DRAM once: the software prefetch
 * keeps a few KB of the next blocks in flight ahead of the loads. */
#ifndef KVQ_PREFETCH
#define KVQ_PREFETCH 2048  /* bytes ahead: ~13 Q4_1 blocks; measured 1024 and none slower (the step, 1 thread) */
#endif

KVQ_AVX2 void group_q4_avx2(const uint8_t* wg, int64_t nb, int64_t bb, int has_m, const int8_t* qa,
                            const float* da, const float* sa, int64_t K, const int MR, __m256 accf[4]) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int nib_off = has_m ? 32 : 16;
    for (int r = 0; r < MR; r++) accf[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = wg + b * bb;
        for (int64_t line = 0; line < bb; line += 64) _mm_prefetch((const char*)blk + KVQ_PREFETCH + line, _MM_HINT_T0);
        __m256i acc16[4];
        for (int r = 0; r < MR; r++) acc16[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + nib_off + 32 * c));
            __m256i wlo = _mm256_and_si256(raw, low), whi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            for (int r = 0; r < MR; r++) {
                const int8_t* a = qa + r * K + b * QK;
                __m256i alo = _mm256_set1_epi32(*(const int32_t*)(a + 4 * c));
                __m256i ahi = _mm256_set1_epi32(*(const int32_t*)(a + 16 + 4 * c));
                /* u8 (0..15) x s8 pairs: |sum| <= 8 steps * 2 * 15 * 127 < 2^15, no saturation */
                acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(wlo, alo));
                acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(whi, ahi));
            }
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        __m256 mw = has_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)))
                          : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
        for (int r = 0; r < MR; r++) {
            const int64_t ab = r * (K / QK) + b;
            __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc16[r], ones));
            accf[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(da[ab])), accf[r]);
            accf[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sa[ab]), accf[r]);
        }
    }
}

KVQ_AVX2 void group_q8_avx2(const uint8_t* wg, int64_t nb, const int8_t* qa, const float* da, int64_t K,
                            const int MR, __m256 accf[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < MR; r++) accf[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = wg + b * 272;
        for (int64_t line = 0; line < 272; line += 64) _mm_prefetch((const char*)blk + KVQ_PREFETCH + line, _MM_HINT_T0);
        __m256i acc32[4];
        for (int r = 0; r < MR; r++) acc32[r] = _mm256_setzero_si256();
        for (int st = 0; st < 8; st++) {
            __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * st));
            __m256i wabs = _mm256_sign_epi8(w, w);
            for (int r = 0; r < MR; r++) {
                __m256i a = _mm256_set1_epi32(*(const int32_t*)(qa + r * K + b * QK + 4 * st));
                /* |w| x sign(a, w): pairs <= 2 * 127 * 127 < 2^15 */
                __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(a, w));
                acc32[r] = _mm256_add_epi32(acc32[r], _mm256_madd_epi16(p16, ones));
            }
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        for (int r = 0; r < MR; r++) {
            __m256 dot = _mm256_cvtepi32_ps(acc32[r]);
            accf[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(da[r * (K / QK) + b])), accf[r]);
        }
    }
}

__attribute__((target("avx2,fma,f16c")))
static void tile_avx2(int wtype, const uint8_t* wg, int64_t nb, const int8_t* qa, const float* da,
                      const float* sa, int64_t K, int MR, float out[][2 * NR]) {
    const int64_t bb = kvq_block_bytes(wtype);
    __m256 accf[4];
    if (wtype == KVQ_Q8_0) {
        switch (MR) {
            case 4: group_q8_avx2(wg, nb, qa, da, K, 4, accf); break;
            case 3: group_q8_avx2(wg, nb, qa, da, K, 3, accf); break;
            case 2: group_q8_avx2(wg, nb, qa, da, K, 2, accf); break;
            default: group_q8_avx2(wg, nb, qa, da, K, 1, accf); break;
        }
    } else {
    const int has_m = wtype == KVQ_Q4_1;
    switch (MR) {
        case 4: group_q4_avx2(wg, nb, bb, has_m, qa, da, sa, K, 4, accf); break;
        case 3: group_q4_avx2(wg, nb, bb, has_m, qa, da, sa, K, 3, accf); break;
        case 2: group_q4_avx2(wg, nb, bb, has_m, qa, da, sa, K, 2, accf); break;
        default: group_q4_avx2(wg, nb, bb, has_m, qa, da, sa, K, 1, accf); break;
    }
    }
    for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], accf[r]);
}

/* The same tiles with VNNI, up to 8 activation rows (32 registers hold 8
 * int32 and 8 float accumulators). vpdpbusd sums 4 u8 x s8 products straight
 * into int32 lanes: the same integer dot product per (row, block) as maddubs'
 * int16 pairs (which never saturate here) widened by madd, and the float
 * epilogue is the AVX2 one, op for op, so the outputs are bit-identical. */
#define KVQ_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"), always_inline)) static inline
#define KVQ_VNNI_ROWS KVQ_MAX_ROWS

KVQ_VNNI void group_q4_vnni(const uint8_t* wg, int64_t nb, int64_t bb, int has_m, const int8_t* qa,
                            const float* da, const float* sa, int64_t K, const int MR, __m256 accf[KVQ_VNNI_ROWS]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int nib_off = has_m ? 32 : 16;
    for (int r = 0; r < MR; r++) accf[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = wg + b * bb;
        for (int64_t line = 0; line < bb; line += 64) _mm_prefetch((const char*)blk + KVQ_PREFETCH + line, _MM_HINT_T0);
        __m256i acc32[KVQ_VNNI_ROWS];
        for (int r = 0; r < MR; r++) acc32[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + nib_off + 32 * c));
            __m256i wlo = _mm256_and_si256(raw, low), whi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            for (int r = 0; r < MR; r++) {
                const int8_t* a = qa + r * K + b * QK;
                acc32[r] = _mm256_dpbusd_epi32(acc32[r], wlo, _mm256_set1_epi32(*(const int32_t*)(a + 4 * c)));
                acc32[r] = _mm256_dpbusd_epi32(acc32[r], whi, _mm256_set1_epi32(*(const int32_t*)(a + 16 + 4 * c)));
            }
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        __m256 mw = has_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)))
                          : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
        for (int r = 0; r < MR; r++) {
            const int64_t ab = r * (K / QK) + b;
            __m256 dot = _mm256_cvtepi32_ps(acc32[r]);
            accf[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(da[ab])), accf[r]);
            accf[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sa[ab]), accf[r]);
        }
    }
}

KVQ_VNNI void group_q8_vnni(const uint8_t* wg, int64_t nb, const int8_t* qa, const float* da, int64_t K,
                            const int MR, __m256 accf[KVQ_VNNI_ROWS]) {
    for (int r = 0; r < MR; r++) accf[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = wg + b * 272;
        for (int64_t line = 0; line < 272; line += 64) _mm_prefetch((const char*)blk + KVQ_PREFETCH + line, _MM_HINT_T0);
        __m256i acc32[KVQ_VNNI_ROWS];
        for (int r = 0; r < MR; r++) acc32[r] = _mm256_setzero_si256();
        for (int st = 0; st < 8; st++) {
            __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * st));
            __m256i wabs = _mm256_sign_epi8(w, w);
            for (int r = 0; r < MR; r++) {
                __m256i a = _mm256_set1_epi32(*(const int32_t*)(qa + r * K + b * QK + 4 * st));
                acc32[r] = _mm256_dpbusd_epi32(acc32[r], wabs, _mm256_sign_epi8(a, w));
            }
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        for (int r = 0; r < MR; r++) {
            __m256 dot = _mm256_cvtepi32_ps(acc32[r]);
            accf[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(da[r * (K / QK) + b])), accf[r]);
        }
    }
}

#define KVQ_VNNI_CASE(MR_)                                                                      \
    case MR_:                                                                                   \
        if (wtype == KVQ_Q8_0) group_q8_vnni(wg, nb, qa, da, K, MR_, accf);                    \
        else group_q4_vnni(wg, nb, bb, wtype == KVQ_Q4_1, qa, da, sa, K, MR_, accf);           \
        break;

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
static void tile_vnni(int wtype, const uint8_t* wg, int64_t nb, const int8_t* qa, const float* da,
                      const float* sa, int64_t K, int MR, float out[][2 * NR]) {
    const int64_t bb = kvq_block_bytes(wtype);
    __m256 accf[KVQ_VNNI_ROWS] = {0};  /* MR >= 1 always; the compiler cannot tell */
    switch (MR) {
        KVQ_VNNI_CASE(8) KVQ_VNNI_CASE(7) KVQ_VNNI_CASE(6) KVQ_VNNI_CASE(5)
        KVQ_VNNI_CASE(4) KVQ_VNNI_CASE(3) KVQ_VNNI_CASE(2)
        default: KVQ_VNNI_CASE(1)
    }
    for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], accf[r]);
}

/* Two groups (16 weight rows) per tile in 512-bit registers, where a CPU
 * executes them at the width of two 256-bit ops or better: each lane's integer
 * dot products and float ops are the 256-bit tile's, so the outputs are too.
 *
 * They read the activations interleaved by row tile (quantize_chunk writes
 * this copy beside the row-major one): for tile t (rows 8t .. 8t + 7) and
 * block b, the 8 rows' 32 quantized values side by side at
 * qt + t * 8 * K + b * KVQ_TILE_BLOCK_BYTES + r * 32, and their scales d then
 * s at st + (t * nb + b) * 16 + r and + 8 + r. Every load of a block is then
 * one pointer plus a constant: with a pointer per row (row-major), the 8 rows'
 * addresses spilled the general registers. Measured with both changes below
 * (this layout, and no stack array for the sums) on the 2026-12-07 EPYC, one
 * thread, the default model's shapes: Q4_1 1.04-1.19x at 5-512 rows (gate_up
 * 256 -> 303 GOP/s at 512; ~470 is its dpbusd alone, the float epilogue the
 * rest), bit-identical. */
#define KVQ_TILE_BLOCK_BYTES (KVQ_VNNI_ROWS * QK)
/* A pair tile's sums out of its registers: into out (y NULL), or row r to
 * y + r * ldy, plus add + r * ldadd where add is set. Inlined into each tile
 * with its MR a constant, so the sums never pass through a stack array (one
 * did: zeroed by `rep stos` on every call, ~10% of a tile's time). */
KVQ_VNNI void store_pair_rows(const __m512* accf, const int MR, float out[][2 * NR], float* y, int64_t ldy,
                              const float* add, int64_t ldadd) {
    _Pragma("GCC unroll 8")
    for (int r = 0; r < MR; r++) {
        if (y == NULL) _mm512_storeu_ps(out[r], accf[r]);
        else  /* + 0 without add, as matmul_tile's stores: -0 sums store as +0 on every path */
            _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(accf[r], add ? _mm512_loadu_ps(add + r * ldadd) : _mm512_setzero_ps()));
    }
}

KVQ_VNNI void pair_q4_vnni(const uint8_t* wg0, const uint8_t* wg1, int64_t nb, int64_t bb, int has_m,
                           const int8_t* qt, const float* st, const int MR, int prefetch, float out[][2 * NR],
                           float* y, int64_t ldy, const float* add, int64_t ldadd) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int nib_off = has_m ? 32 : 16;
    __m512 accf[KVQ_VNNI_ROWS];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < MR; r++) accf[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = wg0 + b * bb, *blk1 = wg1 + b * bb;
        for (int64_t line = 0; prefetch && line < bb; line += 64) {
            _mm_prefetch((const char*)blk0 + KVQ_PREFETCH + line, _MM_HINT_T0);
            _mm_prefetch((const char*)blk1 + KVQ_PREFETCH + line, _MM_HINT_T0);
        }
        __m512i acc32[KVQ_VNNI_ROWS];
        _Pragma("GCC unroll 8")
        for (int r = 0; r < MR; r++) acc32[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            __m512i raw = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(blk0 + nib_off + 32 * c))),
                _mm256_loadu_si256((const __m256i*)(blk1 + nib_off + 32 * c)), 1);
            __m512i wlo = _mm512_and_si512(raw, low), whi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < MR; r++) {
                const int8_t* a = qt + b * KVQ_TILE_BLOCK_BYTES + r * QK;
                acc32[r] = _mm512_dpbusd_epi32(acc32[r], wlo, _mm512_set1_epi32(*(const int32_t*)(a + 4 * c)));
                acc32[r] = _mm512_dpbusd_epi32(acc32[r], whi, _mm512_set1_epi32(*(const int32_t*)(a + 16 + 4 * c)));
            }
        }
        __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)blk0)), _mm_loadu_si128((const __m128i*)blk1), 1));
        __m512 mw = has_m ? _mm512_cvtph_ps(_mm256_inserti128_si256(
                                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(blk0 + 16))),
                                _mm_loadu_si128((const __m128i*)(blk1 + 16)), 1))
                          : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
        const float* scales = st + b * 2 * KVQ_VNNI_ROWS;
        _Pragma("GCC unroll 8")
        for (int r = 0; r < MR; r++) {
            __m512 dot = _mm512_cvtepi32_ps(acc32[r]);
            accf[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(scales[r])), accf[r]);
            accf[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(scales[KVQ_VNNI_ROWS + r]), accf[r]);
        }
    }
    store_pair_rows(accf, MR, out, y, ldy, add, ldadd);
}

/* group_q8_vnni over two groups in 512-bit registers, lane for lane, with
 * the same int32 sums and the same float epilogue. vpdpbusd multiplies
 * unsigned by signed bytes; where the 256-bit tiles give it |w| and the
 * activation with w's sign (vpsignb), these give it the activation offset to
 * unsigned (a + 128: quantize_chunk stores the pair tiles' copy of a Q8_0
 * product's activations so, a ^ 0x80) and w as it is, then take 128 x the
 * block's sum of w back out: exactly sum(a w), the same as vpsignb's way for
 * the quantized activations' -127..127 (only -128, which no row quantizes
 * to, wraps there). The sign took a masked negation per row and product
 * before: the offset measured 1.26-1.61x at 5-512 rows (the LM head at 64
 * rows 182 -> 286 GOP/s, one thread, the 2026-12-07 EPYC). */
KVQ_VNNI void pair_q8_vnni(const uint8_t* wg0, const uint8_t* wg1, int64_t nb, const int8_t* qt, const float* st,
                           const int MR, int prefetch, float out[][2 * NR], float* y, int64_t ldy, const float* add,
                           int64_t ldadd) {
    __m512 accf[KVQ_VNNI_ROWS];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < MR; r++) accf[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = wg0 + b * 272, *blk1 = wg1 + b * 272;
        for (int64_t line = 0; prefetch && line < 272; line += 64) {
            _mm_prefetch((const char*)blk0 + KVQ_PREFETCH + line, _MM_HINT_T0);
            _mm_prefetch((const char*)blk1 + KVQ_PREFETCH + line, _MM_HINT_T0);
        }
        __m512i acc32[KVQ_VNNI_ROWS], wsum = _mm512_setzero_si512();
        _Pragma("GCC unroll 8")
        for (int r = 0; r < MR; r++) acc32[r] = _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) {
            const __m512i w = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(blk0 + 16 + 32 * i))),
                _mm256_loadu_si256((const __m256i*)(blk1 + 16 + 32 * i)), 1);
            wsum = _mm512_dpbusd_epi32(wsum, _mm512_set1_epi8(1), w);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < MR; r++) {
                const __m512i a = _mm512_set1_epi32(*(const int32_t*)(qt + b * KVQ_TILE_BLOCK_BYTES + r * QK + 4 * i));
                acc32[r] = _mm512_dpbusd_epi32(acc32[r], a, w);
            }
        }
        const __m512i offset = _mm512_slli_epi32(wsum, 7);  /* 128 x each weight row's block sum */
        _Pragma("GCC unroll 8")
        for (int r = 0; r < MR; r++) acc32[r] = _mm512_sub_epi32(acc32[r], offset);
        const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)blk0)), _mm_loadu_si128((const __m128i*)blk1), 1));
        const float* scales = st + b * 2 * KVQ_VNNI_ROWS;
        _Pragma("GCC unroll 8")
        for (int r = 0; r < MR; r++) {
            const __m512 dot = _mm512_cvtepi32_ps(acc32[r]);
            accf[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(scales[r])), accf[r]);
        }
    }
    store_pair_rows(accf, MR, out, y, ldy, add, ldadd);
}

#define KVQ_PAIR_CASE(MR_)                                                                                   \
    case MR_:                                                                                                \
        if (wtype == KVQ_Q8_0) pair_q8_vnni(wg0, wg1, nb, qt, st, MR_, prefetch, out, y, ldy, add, ldadd);   \
        else pair_q4_vnni(wg0, wg1, nb, bb, wtype == KVQ_Q4_1, qt, st, MR_, prefetch, out, y, ldy, add, ldadd); \
        break;

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
/* prefetch: the tile streams its weights from memory (a chunk's first row
 * tile); later row tiles find them in L1, where the prefetches only cost
 * instructions (~5% of a 256-row matmul's time). */
/* y: where a float32 output's 16 columns go straight from the registers
 * (row r at y + r * ldy, plus add + r * ldadd when add is set, + 0 otherwise,
 * as matmul_tile's stores), or NULL: into out. */
static void pair_tile_vnni(int wtype, const uint8_t* wg0, const uint8_t* wg1, int64_t nb, int64_t bb,
                           const int8_t* qt, const float* st, int MR, int prefetch, float out[][2 * NR],
                           float* y, int64_t ldy, const float* add, int64_t ldadd) {
    switch (MR) {
        KVQ_PAIR_CASE(8) KVQ_PAIR_CASE(7) KVQ_PAIR_CASE(6) KVQ_PAIR_CASE(5)
        KVQ_PAIR_CASE(4) KVQ_PAIR_CASE(3) KVQ_PAIR_CASE(2)
        default: KVQ_PAIR_CASE(1)
    }
}

/* ---- AMX tiles ------------------------------------------------------------ */

/* Where the CPU has AMX-INT8 (and Linux grants the process its tile state), a
 * matmul of enough activation rows (KVQ_AMX_MIN_ROWS_*) multiplies 16 x 16 tiles:
 * per 32-wide block, TDPBSUD (Q4: signed activations x unsigned nibbles) or
 * TDPBSSD (Q8_0) gives the same exact int32 dot products as the VNNI tiles,
 * and the float epilogue is pair_q4_vnni's / group_q8_vnni's op for op, in the
 * same block order. So every output is the float the VNNI path computes, and a
 * row's numbers never depend on how many rows share its step (the path is
 * chosen by the row count). A block at a time because each has its own weight
 * and activation scales; the epilogue, not the tile unit, bounds the speed.
 * Each chunk's weights are unpacked once into the tiles' layout and reused by
 * every 16 activation rows. */
#define KVQ_AMX_PAIR_BYTES 512   /* one block's B tile: 8 rows of 4 inputs x 16 weight rows x 4 */
#define KVQ_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")))

/* AMX-TILE (CPUID 7.0 EDX bit 24) with the AMX feature of EDX bit `bit`
 * (25: INT8, 22: BF16), and the kernel's leave to use them: Linux hands a
 * process the 8 KB of tile data only on request (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XTILEDATA, process-wide, Linux >= 5.16). */
static int amx_granted(int bit) {
    unsigned a, b, c, d;
    int ok = kvq_has_avx512_vnni() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> bit & 1);
    return ok && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

int kvq_has_amx(void) {
    static int cached = -1;
    if (cached < 0) cached = amx_granted(25);
    return cached;
}

static int amx_enabled(void) { return matmul_isa() == 3 && !g_no_amx && kvq_has_amx(); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config;

/* tmm0, tmm1: C, 16 rows x 16 int32; tmm2, tmm3: A, 16 rows x one block (32
 * int8); tmm4, tmm5: B, 8 rows (4 inputs each) x 16 weight rows x 4 bytes.
 * Two of each so one block's product runs while the previous one's epilogue does. */
KVQ_AMX static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) {
        cfg.rows[t] = KVQ_AMX_ROWS; cfg.colsb[t] = 64;
        cfg.rows[2 + t] = KVQ_AMX_ROWS; cfg.colsb[2 + t] = QK;
        cfg.rows[4 + t] = QK / 4; cfg.colsb[4 + t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A pair of groups (wg1 NULL: the second is padding, all zero) unpacked for
 * the tiles: per block, B as tiles[b * 512 + 64 * s + 4 * n + j] = weight row n's
 * input 4s + j (Q4 nibbles widened to bytes), and its scales as floats,
 * dw[16 * b + n] and mw[16 * b + n] (Q4_1's m, Q4_0's -8 d; unused for Q8_0),
 * converted as pair_q4_vnni converts them. */
KVQ_AMX static void amx_pack_pair(int wtype, const uint8_t* wg0, const uint8_t* wg1, int64_t nb, int64_t bb,
                                  uint8_t* tiles, float* dw, float* mw) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int has_m = wtype == KVQ_Q4_1, nib_off = has_m ? 32 : 16;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = wg0 + b * bb, *blk1 = wg1 ? wg1 + b * bb : NULL;
        uint8_t* t = tiles + b * KVQ_AMX_PAIR_BYTES;
        for (int half = 0; half < 2; half++) {
            const uint8_t* blk = half ? blk1 : blk0;
            uint8_t* th = t + 32 * half;
            if (blk == NULL) {
                for (int s = 0; s < 8; s++) _mm256_storeu_si256((__m256i*)(th + 64 * s), _mm256_setzero_si256());
                _mm256_storeu_ps(dw + 16 * b + 8 * half, _mm256_setzero_ps());
                _mm256_storeu_ps(mw + 16 * b + 8 * half, _mm256_setzero_ps());
                continue;
            }
            if (wtype == KVQ_Q8_0) {
                for (int s = 0; s < 8; s++)
                    _mm256_storeu_si256((__m256i*)(th + 64 * s), _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * s)));
            } else {
                for (int c = 0; c < 4; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + nib_off + 32 * c));
                    _mm256_storeu_si256((__m256i*)(th + 64 * c), _mm256_and_si256(raw, low));
                    _mm256_storeu_si256((__m256i*)(th + 64 * (c + 4)), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
                }
            }
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
            _mm256_storeu_ps(dw + 16 * b + 8 * half, d);
            _mm256_storeu_ps(mw + 16 * b + 8 * half, has_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)))
                                                           : _mm256_mul_ps(d, _mm256_set1_ps(-8.f)));
        }
    }
}

/* One block's int32 products (C, [16][16]) into the float accumulators of all
 * 16 rows: pair_q4_vnni's / group_q8_vnni's epilogue, lane for lane. All 16
 * always, so the accumulators stay in registers (rows past M have zero
 * scales: their sums are zeros nobody stores). */
#define KVQ_AMX_EPILOGUE(HAS_OFFSET)                                                                     \
    KVQ_AMX __attribute__((always_inline)) static inline void amx_epilogue_##HAS_OFFSET(                \
        const int32_t (*c)[16], int64_t b, const float* dw, const float* mw, const float* dat,           \
        const float* sat, __m512 acc[KVQ_AMX_ROWS]) {                                                    \
        const __m512 dwb = _mm512_loadu_ps(dw + 16 * b), mwb = _mm512_loadu_ps(mw + 16 * b);             \
        const float *dab = dat + 16 * b, *sab = sat + 16 * b;                                            \
        for (int r = 0; r < KVQ_AMX_ROWS; r++) {                                                         \
            __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(c[r]));                                    \
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dwb, _mm512_set1_ps(dab[r])), acc[r]);           \
            if (HAS_OFFSET) acc[r] = _mm512_fmadd_ps(mwb, _mm512_set1_ps(sab[r]), acc[r]);               \
        }                                                                                                \
    }
KVQ_AMX_EPILOGUE(0)
KVQ_AMX_EPILOGUE(1)

/* One block's product into C: Q4 (unsigned nibbles) or Q8_0 (signed bytes). */
#define KVQ_AMX_PRODUCT(HAS_OFFSET, C, A, B, blk)                                    \
    do {                                                                             \
        _tile_zero(C);                                                               \
        _tile_loadd(A, qa + (blk) * QK, K);                                          \
        _tile_loadd(B, tiles + (blk) * KVQ_AMX_PAIR_BYTES, 64);                       \
        if (HAS_OFFSET) _tile_dpbsud(C, A, B); else _tile_dpbssd(C, A, B);           \
    } while (0)

/* out = the 16 weight rows of a packed pair against activation rows m0 ..
 * m0 + 15 (qa at row m0; dat, sat: the tile's scales, [nb][16]): Q4
 * (HAS_OFFSET) or Q8_0. The accumulators are this function's own: the tile
 * intrinsics are asm that may touch any memory, so accumulators behind a
 * pointer would go to memory at every tile op. */
#define KVQ_AMX_PAIR_TILE(HAS_OFFSET)                                                                      \
    KVQ_AMX static void amx_pair_tile_##HAS_OFFSET(const uint8_t* tiles, const float* dw, const float* mw,   \
                                                    int64_t nb, const int8_t* qa, int64_t K, const float* dat, \
                                                    const float* sat, float out[KVQ_AMX_ROWS][16]) {       \
        __m512 acc[KVQ_AMX_ROWS];                                                                          \
        int32_t c0[KVQ_AMX_ROWS][16] __attribute__((aligned(64)));                                         \
        int32_t c1[KVQ_AMX_ROWS][16] __attribute__((aligned(64)));                                         \
        for (int r = 0; r < KVQ_AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();                               \
        KVQ_AMX_PRODUCT(HAS_OFFSET, 0, 2, 4, 0);                                                           \
        for (int64_t b = 0; b < nb; b += 2) {                                                              \
            _tile_stored(0, c0, 64);                                                                       \
            if (b + 1 < nb) KVQ_AMX_PRODUCT(HAS_OFFSET, 1, 3, 5, b + 1); /* during block b's epilogue */   \
            amx_epilogue_##HAS_OFFSET((const int32_t (*)[16])c0, b, dw, mw, dat, sat, acc);                \
            if (b + 1 >= nb) break;                                                                        \
            _tile_stored(1, c1, 64);                                                                       \
            if (b + 2 < nb) KVQ_AMX_PRODUCT(HAS_OFFSET, 0, 2, 4, b + 2);                                   \
            amx_epilogue_##HAS_OFFSET((const int32_t (*)[16])c1, b + 1, dw, mw, dat, sat, acc);            \
        }                                                                                                  \
        for (int r = 0; r < KVQ_AMX_ROWS; r++) _mm512_store_ps(out[r], acc[r]);                            \
    }
KVQ_AMX_PAIR_TILE(0)
KVQ_AMX_PAIR_TILE(1)
#else
static int amx_enabled(void) { return 0; }
int kvq_has_amx(void) { return 0; }
#endif

/* Activation rows per tile: the most a path's registers hold. */
static int tile_rows(int isa) { return isa == 3 ? KVQ_VNNI_ROWS : 4; }

/* Rows n0.. of one or two groups (at most 8 per group) for activation rows m0..m0+MR-1. */
static void matmul_tile(int wtype, const uint8_t* wg, int64_t nb, int64_t bb, int num_groups, int64_t K,
                        int64_t n0, int64_t N, const int8_t* qa, const float* da, const float* sa,
                        const int8_t* qt, const float* st, int64_t m0, int MR,
                        void* y, int ytype, int64_t ldy, const void* add, int addtype, int64_t ldadd, int isa) {
    const size_t ysz = ytype == KVQ_BF16 ? 2 : 4, asz = addtype == KVQ_BF16 ? 2 : 4;
    const int64_t count = N - n0 < num_groups * NR ? N - n0 : num_groups * NR;
    float acc[KVQ_MAX_ROWS][2 * NR];
#ifdef KVQ_X86
    /* A whole pair tile of float32 outputs: stored from its registers. */
    const int direct = num_groups == 2 && count == 2 * NR && ytype == KVQ_F32 && (add == NULL || addtype == KVQ_F32);
    /* The pair tiles' row tile m0 / 8 (m0 is a multiple of 8 on their path). */
    const int8_t* qtile = num_groups == 2 ? qt + m0 * K : NULL;
    const float* stile = num_groups == 2 ? st + m0 * nb * 2 : NULL;
    if (direct) {
        pair_tile_vnni(wtype, wg, wg + nb * bb, nb, bb, qtile, stile, MR, m0 == 0, acc,
                       (float*)y + m0 * ldy + n0, ldy, add ? (const float*)add + m0 * ldadd + n0 : NULL, ldadd);
        return;
    }
    if (num_groups == 2)
        pair_tile_vnni(wtype, wg, wg + nb * bb, nb, bb, qtile, stile, MR, m0 == 0, acc, NULL, 0, NULL, 0);
    else if (isa == 3) tile_vnni(wtype, wg, nb, qa + m0 * K, da + m0 * nb, sa + m0 * nb, K, MR, acc);
    else if (isa == 2) tile_avx2(wtype, wg, nb, qa + m0 * K, da + m0 * nb, sa + m0 * nb, K, MR, acc);
#endif
    if (isa == 0)
        for (int r = 0; r < MR; r++)
            group_dot_scalar(wtype, wg, nb, qa + (m0 + r) * K, da + (m0 + r) * nb, sa + (m0 + r) * nb, acc[r]);
    for (int r = 0; r < MR; r++) {
        void* yrow = (char*)y + (size_t)(m0 + r) * ldy * ysz;
        const void* arow = add ? (const char*)add + (size_t)(m0 + r) * ldadd * asz : NULL;
        for (int64_t i = 0; i < count; i++)
            store_y(yrow, ytype, n0 + i, acc[r][i] + (arow ? load_x(arow, addtype, n0 + i) : 0.f));
    }
}

/* ---- the public matmul ---------------------------------------------------- */

typedef struct {
    int wtype, xtype, xop, ytype, addtype, isa;
    const uint8_t* w;
    int64_t N, K, nb, bb, groups, ldx, M, ldy, ldadd;
    const void *x, *norm_w, *add;
    float eps;
    void* y;
    int8_t* qa;
    float *da, *sa;
    int64_t chunk_groups;  /* groups per chunk: KVQ_GROUPS, or KVQ_AMX_GROUPS on the tiles */
    int amx;  /* the AMX tiles take the products: qa has M rounded up to 16 rows, and */
    float *dat, *sat;  /* da and sa per 16-row tile as [nb][16] (zero past M) */
    int8_t* qt;  /* the VNNI pair tiles' interleaved copy of qa and its scales (pair_q4_vnni's */
    float* st;   /* comment), or NULL: no pair tiles this call */
} matmul_job;

#define KVQ_QUANT_ROWS 16  /* activation rows per chunk of the quantization job */
#define KVQ_GROUPS 4       /* groups of 8 weight rows per chunk of the matmul job */
#ifndef KVQ_AMX_GROUPS
#define KVQ_AMX_GROUPS 2   /* ... on the AMX tiles: one pair, whose unpacked blocks (9-24 KB) share L1 with the A tiles */
#endif
/* Activation rows x packed weight bytes below which the matmul uses no helper. */
#ifndef KVQ_MIN_PARALLEL_BYTES
#define KVQ_MIN_PARALLEL_BYTES (1 << 20)
#endif

static void quantize_chunk(const void* ctx, int64_t chunk) {
    const matmul_job* j = ctx;
    const int64_t m1 = (chunk + 1) * KVQ_QUANT_ROWS < j->M ? (chunk + 1) * KVQ_QUANT_ROWS : j->M;
    for (int64_t m = chunk * KVQ_QUANT_ROWS; m < m1; m++)
        quantize_row(j->x, j->xtype, j->K, j->ldx, j->xop, j->norm_w, j->eps, m, j->qa, j->da, j->sa, j->isa);
    if (j->qt != NULL)  /* KVQ_QUANT_ROWS is a whole number of row tiles: this chunk's tiles are its own */
        for (int64_t m = chunk * KVQ_QUANT_ROWS; m < m1; m++) {
            const int64_t r = m % KVQ_VNNI_ROWS, tile = m - r;
            for (int64_t b = 0; b < j->nb; b++) {
                int8_t* to = j->qt + tile * j->K + b * KVQ_TILE_BLOCK_BYTES + r * QK;
                const int8_t* from = j->qa + m * j->K + b * QK;
                if (j->wtype == KVQ_Q8_0)  /* offset to unsigned: pair_q8_vnni's operand */
                    for (int i = 0; i < QK; i++) to[i] = (int8_t)(from[i] ^ 0x80);
                else
                    memcpy(to, from, QK);
                j->st[(tile * j->nb + b * KVQ_VNNI_ROWS) * 2 + r] = j->da[m * j->nb + b];
                j->st[(tile * j->nb + b * KVQ_VNNI_ROWS) * 2 + KVQ_VNNI_ROWS + r] = j->sa[m * j->nb + b];
            }
        }
    if (!j->amx) return;
    /* The tiles' scales, each block's 16 rows side by side (one chunk is one tile). */
    float *dat = j->dat + chunk * KVQ_AMX_ROWS * j->nb, *sat = j->sat + chunk * KVQ_AMX_ROWS * j->nb;
    for (int64_t b = 0; b < j->nb; b++)
        for (int r = 0; r < KVQ_AMX_ROWS; r++) {
            const int64_t m = chunk * KVQ_QUANT_ROWS + r;
            dat[b * KVQ_AMX_ROWS + r] = m < m1 ? j->da[m * j->nb + b] : 0.f;
            sat[b * KVQ_AMX_ROWS + r] = m < m1 ? j->sa[m * j->nb + b] : 0.f;
        }
}

/* The lines that rows m0 .. m0 + MR - 1, columns n0 .. n0 + n - 1 of y (and
 * of add) will be stored to / added from, requested ahead: the prompt tiles
 * store each row's 32 columns far from the next row's, and without the
 * request every store waited on its line's miss (~a fifth of their time).
 * Called before the products that fill them. (The AMX-INT8 path's stores,
 * the LM head's at 20-40 decode rows, measured no gain from it.) */
static inline void prefetch_store_rows(const void* y, int ytype, int64_t ldy, const void* add, int addtype,
                                       int64_t ldadd, int64_t m0, int64_t MR, int64_t n0, int64_t n) {
    const size_t ysz = ytype == KVQ_BF16 ? 2 : 4, asz = addtype == KVQ_BF16 ? 2 : 4;
    for (int64_t m = m0; m < m0 + MR; m++) {
        const char* yrow = (const char*)y + ((size_t)m * ldy + n0) * ysz;
        __builtin_prefetch(yrow, 1, 3);
        __builtin_prefetch(yrow + n * ysz - 1, 1, 3);
        if (add != NULL) {
            const char* arow = (const char*)add + ((size_t)m * ldadd + n0) * asz;
            __builtin_prefetch(arow, 0, 3);
            __builtin_prefetch(arow + n * asz - 1, 0, 3);
        }
    }
}

#ifdef KVQ_X86
/* Rows m0 .. m0 + MR - 1, columns n0 .. n0 + 15 (those below N) of y (+ add),
 * from a 16 x 16 tile of float sums (64-byte aligned): matmul_tile's stores,
 * value for value. Both AMX paths store through it. */
__attribute__((target("avx2,fma,f16c,avx512f")))
static void store_tile_sums(void* y, int ytype, int64_t ldy, const void* add, int addtype, int64_t ldadd, int64_t N,
                            int64_t m0, int MR, int64_t n0, const float (*sums)[16]) {
    const int64_t count = N - n0 < 16 ? N - n0 : 16;
    const size_t ysz = ytype == KVQ_BF16 ? 2 : 4, asz = addtype == KVQ_BF16 ? 2 : 4;
    const int direct = count == 16 && ytype == KVQ_F32 && (add == NULL || addtype == KVQ_F32);
    for (int r = 0; r < MR; r++) {
        const int64_t m = m0 + r;
        if (direct) {
            const __m512 a = add ? _mm512_loadu_ps((const float*)add + m * ldadd + n0) : _mm512_setzero_ps();
            _mm512_storeu_ps((float*)y + m * ldy + n0, _mm512_add_ps(_mm512_load_ps(sums[r]), a));
            continue;
        }
        void* yrow = (char*)y + (size_t)m * ldy * ysz;
        const void* arow = add ? (const char*)add + (size_t)m * ldadd * asz : NULL;
        for (int64_t i = 0; i < count; i++)
            store_y(yrow, ytype, n0 + i, sums[r][i] + (arow ? load_x(arow, addtype, n0 + i) : 0.f));
    }
}

/* Scratch for a chunk's unpacked weights: one buffer per thread, grown as needed and kept. */
static uint8_t* amx_scratch_for(int64_t num_bytes) {
    static __thread void* buffer = NULL;
    static __thread int64_t capacity = 0;
    return grown(&buffer, &capacity, num_bytes);
}

/* matmul_chunk on the tiles: its groups unpacked once (pairs of 16 weight
 * rows), then every 16 activation rows against each pair. Returns 0 where the
 * scratch cannot be had (the caller then runs the VNNI tiles: the same numbers). */
KVQ_AMX static int matmul_chunk_amx(const matmul_job* j, int64_t chunk) {
    const int64_t g0 = chunk * j->chunk_groups, g1 = g0 + j->chunk_groups < j->groups ? g0 + j->chunk_groups : j->groups;
    const int64_t num_pairs = (g1 - g0 + 1) / 2, tile_bytes = j->nb * KVQ_AMX_PAIR_BYTES;
    const int64_t pair_bytes = tile_bytes + 2 * 16 * j->nb * (int64_t)sizeof(float);
    uint8_t* scratch = amx_scratch_for(num_pairs * pair_bytes);
    if (scratch == NULL) return 0;
    for (int64_t p = 0; p < num_pairs; p++) {
        const int64_t g = g0 + 2 * p;
        float* dw = (float*)(scratch + p * pair_bytes + tile_bytes);
        amx_pack_pair(j->wtype, j->w + g * j->nb * j->bb, g + 1 < g1 ? j->w + (g + 1) * j->nb * j->bb : NULL, j->nb,
                      j->bb, scratch + p * pair_bytes, dw, dw + 16 * j->nb);
    }
    amx_configure();
    float sums[KVQ_AMX_ROWS][16] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < j->M; m0 += KVQ_AMX_ROWS) {
        const int MR = (int)(j->M - m0 < KVQ_AMX_ROWS ? j->M - m0 : KVQ_AMX_ROWS);
        for (int64_t p = 0; p < num_pairs; p++) {
            const float* dw = (const float*)(scratch + p * pair_bytes + tile_bytes);
            if (j->wtype == KVQ_Q8_0)
                amx_pair_tile_0(scratch + p * pair_bytes, dw, dw + 16 * j->nb, j->nb, j->qa + m0 * j->K, j->K,
                                j->dat + m0 * j->nb, j->sat + m0 * j->nb, sums);
            else
                amx_pair_tile_1(scratch + p * pair_bytes, dw, dw + 16 * j->nb, j->nb, j->qa + m0 * j->K, j->K,
                                j->dat + m0 * j->nb, j->sat + m0 * j->nb, sums);
            store_tile_sums(j->y, j->ytype, j->ldy, j->add, j->addtype, j->ldadd, j->N, m0, MR, (g0 + 2 * p) * NR,
                            (const float (*)[16])sums);
        }
    }
    _tile_release();  /* no tile state left live: a context switch saves 8 KB less */
    return 1;
}
#endif

/* A chunk's weights (KVQ_GROUPS groups, ~12 KB at K=576) stay in L1 while every
 * activation row passes over them, tile_rows() rows per tile. */
static void matmul_chunk(const void* ctx, int64_t chunk) {
    const matmul_job* j = ctx;
#ifdef KVQ_X86
    if (j->amx && matmul_chunk_amx(j, chunk)) return;
#endif
    const int64_t g0 = chunk * j->chunk_groups, g1 = g0 + j->chunk_groups < j->groups ? g0 + j->chunk_groups : j->groups;
    const int rows = tile_rows(j->isa), pairs = j->qt != NULL;
    int num_groups = 1;
    for (int64_t m0 = 0; m0 < j->M; m0 += rows) {
        const int MR = (int)(j->M - m0 < rows ? j->M - m0 : rows);
        for (int64_t g = g0; g < g1; g += num_groups) {
            num_groups = pairs && g + 1 < g1 ? 2 : 1;
            matmul_tile(j->wtype, j->w + g * j->nb * j->bb, j->nb, j->bb, num_groups, j->K, g * NR, j->N, j->qa,
                        j->da, j->sa, j->qt, j->st, m0, MR, j->y, j->ytype, j->ldy, j->add, j->addtype, j->ldadd, j->isa);
        }
    }
}

/* Scratch for the quantized activations: one buffer per calling thread, grown
 * as needed and kept (no allocation per call). */
static uint8_t* scratch_for(int64_t num_bytes) {
    static __thread void* buffer = NULL;
    static __thread int64_t capacity = 0;
    return grown(&buffer, &capacity, num_bytes);
}

/* y[m, n] = sum_k x[m, k] * W[n, k] (+ add[m, n]) for m < M, n < N.
 * w: packed weights of N rows (padded to a multiple of 8), K inputs (K % 32 == 0).
 * x: [M, ldx] f32 or bf16, transformed per row by xop (KVQ_X_*; norm_w: [K] for RMS_NORM;
 * SWIGLU reads 2K columns); y: [M, ldy]; add: [M, ldadd] or NULL; num_threads:
 * the caller and num_threads - 1 helpers of the pool. Returns 0, or -1 when
 * the scratch for the quantized activations cannot be allocated (nothing written). */
int kvq_matmul(int wtype, const uint8_t* w, int64_t N, int64_t K, const void* x, int xtype, int64_t ldx,
               int xop, const void* norm_w, float eps,
               int64_t M, void* y, int ytype, int64_t ldy, const void* add, int addtype, int64_t ldadd,
               int num_threads) {
    const int64_t nb = K / QK;
    const int amx = M >= (wtype == KVQ_Q8_0 ? KVQ_AMX_MIN_ROWS_Q8 : KVQ_AMX_MIN_ROWS_Q4) && amx_enabled();
    /* The tiles take 16 activation rows at a time: rows past M exist, with zero scales. */
    const int64_t rows = amx ? (M + KVQ_AMX_ROWS - 1) / KVQ_AMX_ROWS * KVQ_AMX_ROWS : M;
    const int isa = matmul_isa();
    /* A small product runs on the caller alone: waking a helper (a futex
     * wake-up, an IPI on a VM) cost ~12 us per job, more than the helper
     * saves on a batch-1 decode step's qkv, o and down projections (7-15 us
     * on one thread; 2 threads measured slower), ~90 such jobs a step. */
    const int64_t work_bytes = M * ((N + NR - 1) / NR) * nb * kvq_block_bytes(wtype);
    const int threads = work_bytes < KVQ_MIN_PARALLEL_BYTES ? 1 : num_threads;
    /* Pair tiles only where the weights are reused from L1: a decode step's
     * rows stream them from DRAM, where one group's sequential blocks run
     * faster (the default model's batch-1 decode step: 0.75-0.88x with
     * pairs). A pair tile's activations are padded to KVQ_VNNI_ROWS rows, so
     * 4-7 rows cost what 8 do; one thread streaming all the weights pays for
     * that, two splitting them do not. Measured on the Zen 4 EPYC, the
     * default model's decode-only step (decode_ab.py), pairs from 8 rows
     * against from 4: one thread 1.26x faster at 4 rows, 1.21x at 5, 1.15x
     * at 6, 1.10x at 7, the same at 8; two threads 0.91-0.95x at 6-7 rows,
     * the same at 4-5. kvq_ab.py's cache-hot calls favour pairs from 4 rows
     * on one thread too: it does not see the stream. The AMX tiles take the
     * products without them. */
    const int pairs = isa == 3 && !amx && M >= (threads == 1 ? KVQ_VNNI_ROWS : 4);
    const int64_t tiled = pairs ? (M + KVQ_VNNI_ROWS - 1) / KVQ_VNNI_ROWS * KVQ_VNNI_ROWS : 0;
    uint8_t* scratch = scratch_for(rows * K + 8 * M * nb + (amx ? 8 * rows * nb : 0) + tiled * K + 8 * tiled * nb);
    if (scratch == NULL) return -1;
    matmul_job j = {wtype, xtype, xop, ytype, addtype, isa, w, N, K, nb,
                    kvq_block_bytes(wtype), (N + NR - 1) / NR, ldx, M, ldy, ldadd, x, norm_w, add, eps, y,
                    (int8_t*)scratch, NULL, NULL, amx ? KVQ_AMX_GROUPS : KVQ_GROUPS, amx, NULL, NULL, NULL, NULL};
    j.da = (float*)(scratch + rows * K);
    j.sa = j.da + M * nb;
    j.dat = j.sa + M * nb;
    j.sat = j.dat + rows * nb;
    if (pairs) {  /* after the AMX scales (none here): floats stay 4-byte aligned as K % 32 == 0 */
        j.st = j.da + 2 * M * nb;
        j.qt = (int8_t*)(j.st + 2 * tiled * nb);
    }
    parallel_chunks(num_threads, (M + KVQ_QUANT_ROWS - 1) / KVQ_QUANT_ROWS, quantize_chunk, &j);
    parallel_chunks(threads, (j.groups + j.chunk_groups - 1) / j.chunk_groups, matmul_chunk, &j);
    return 0;
}

/* ---- prompt rows on AMX-BF16 ------------------------------------------------
 *
 * A prompt's positions are many rows against the same weights: there the
 * int8 path's per-block float epilogue (a multiply-add per 16 outputs, row
 * and 32-wide block) binds, not the products. kvq_matmul_bf16 takes such rows
 * on AMX-BF16 tiles over a bfloat16 copy of the weights packed at load
 * (quantized.py: pack_prompt_tiles, from the dequantized Q4/Q8 values): the
 * products accumulate in the tiles' float32 across the whole K, with no
 * epilogue but the store. Each output row is its own row of A against the
 * same B tiles in the same K order, so its numbers do not depend on how many
 * rows come with it. Which rows take this path is the caller's rule
 * (model/llama.py: a request's prompt positions); the rest take kvq_matmul.
 *
 * Packed weights: for each 16 output rows (N padded to 16 with zeros) and
 * each 32-wide input block, one B tile of 16 input pairs x 16 outputs x 2:
 * wp[((c * nb + b) * 16 + p) * 32 + 2 * n + j] = W[16 c + n][32 b + 2 p + j]. */

#ifdef KVQ_X86
#define KVQ_AMX_BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,amx-tile,amx-bf16")))

/* Defined with the attention's AVX-512 helpers below. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline)) static inline __m512
swiglu16_avx512(__m512 g, __m512 u);

int kvq_has_amx_bf16(void) {
    static int cached = -1;
    if (cached < 0) cached = amx_granted(22);
    return cached;
}

typedef struct {
    const uint16_t* wp;
    int64_t N, K, nb, M, Mpad, ldx, ldy, ldadd;
    int xtype, xop, ytype, addtype;
    const void *x, *norm_w, *add;
    float eps;
    void* y;
    uint16_t* xb;  /* the transformed rows in bfloat16 as A tiles, [Mpad / 16][nb][16][32], zero past M */
    int64_t threads;      /* the pool's threads (the read-ahead's guess at a thread's next chunk) */
    uint16_t* swiglu_xb;  /* kvq_prompt_mlp: SwiGLU of the product, as the down projection's A tiles */
} bf16_job;

/* Rows of x transformed (xop) and rounded to bfloat16 as f32_to_bf16 does. */
KVQ_AMX_BF16 static void bf16_rows_chunk(const void* ctx, int64_t chunk) {
    const bf16_job* j = ctx;
    const size_t esz = j->xtype == KVQ_BF16 ? 2 : 4;
    float tmp[j->K];
    for (int64_t m = chunk * KVQ_AMX_ROWS; m < (chunk + 1) * KVQ_AMX_ROWS; m++) {
        uint16_t* out = j->xb + (m / 16) * 16 * j->K + (m % 16) * QK;  /* block b at + 512 b */
        if (m >= j->M) { for (int64_t b = 0; b < j->nb; b++) memset(out + 512 * b, 0, QK * 2); continue; }
        const void* row = (const char*)j->x + (size_t)m * j->ldx * esz;
        if (j->xop == KVQ_X_PLAIN) {  /* K % 32 == 0 */
            for (int64_t k = 0; k < j->K; k += 16)
                _mm256_storeu_si256((__m256i*)(out + 512 * (k / QK) + k % QK),
                                    to_bf16x16_avx512(load16_avx512(row, j->xtype, k)));
            continue;
        }
        transform_row(row, j->xtype, j->K, j->xop, j->norm_w, j->eps, tmp, 3);
        for (int64_t k = 0; k < j->K; k += 16)
            _mm256_storeu_si256((__m256i*)(out + 512 * (k / QK) + k % QK), to_bf16x16_avx512(_mm512_loadu_ps(tmp + k)));
    }
}

/* C tiles 0-3 (rows m0 / m0 + 16 x outputs n0 / n0 + 16), A tiles 4, 5, B tiles 6, 7. */
KVQ_AMX_BF16 static void amx_bf16_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

/* The weight strips a thread most likely multiplies next, read into L2 while
 * it multiplies this one, a few lines per block of products. Chunks are
 * claimed in turn, so a thread's next is about chunk + threads; a wrong guess
 * costs only the reads. A layer's bfloat16 weights are megabytes read once a
 * step, so each strip's first pass over the rows waits on memory: the tiles'
 * products reach ~1.5 TFLOP/s a core on weights from memory against ~2.4 on
 * weights in L2 (M = 256, 3,072 x 576; ~3.4 with no loads at all). The
 * read-ahead took a 256-token prefill ~3% faster. */
typedef struct { const char *at[2], *end[2]; int per_block; } read_ahead;

static void read_ahead_init(read_ahead* ra, const bf16_job* j, int64_t col0, int64_t col1) {
    const int64_t num_c = (j->N + 15) / 16, cols[2] = {col0, col1};
    int64_t lines = 0;
    for (int i = 0; i < 2; i++) {
        ra->at[i] = ra->end[i] = NULL;
        if (cols[i] < 0 || cols[i] >= num_c) continue;
        ra->at[i] = (const char*)(j->wp + cols[i] * j->nb * 512);
        ra->end[i] = ra->at[i] + j->nb * 1024;
        lines += j->nb * 16;
    }
    const int64_t blocks = (j->Mpad + 31) / 32 * j->nb;
    ra->per_block = (int)((lines + blocks - 1) / blocks);
}

static inline void read_ahead_step(read_ahead* ra) {
    for (int l = 0; l < ra->per_block; l++) {
        const int i = ra->at[0] < ra->end[0] ? 0 : 1;
        if (ra->at[i] >= ra->end[i]) return;
        _mm_prefetch(ra->at[i], _MM_HINT_T1);
        ra->at[i] += 64;
    }
}

/* C tiles 0-3 = rows m0 .. (A tile 4) and m0 + 16 .. (5, where rows2) times
 * the B strips b0 (tile 6) and b1 (7, where two) over the whole K. */
KVQ_AMX_BF16 __attribute__((always_inline)) static inline void
tile_products(const bf16_job* j, int64_t m0, const uint16_t* b0, const uint16_t* b1, int two, int rows2,
              read_ahead* ra) {
    const uint16_t *a0 = j->xb + m0 * j->K, *a1 = a0 + 16 * j->K;  /* 16 rows' A tiles, block after block */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t b = 0; b < j->nb; b++) {
        read_ahead_step(ra);
        _tile_loadd(4, a0 + 512 * b, 64);
        _tile_loadd(6, b0 + 512 * b, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) { _tile_loadd(7, b1 + 512 * b, 64); _tile_dpbf16ps(1, 4, 7); }
        if (rows2) {
            _tile_loadd(5, a1 + 512 * b, 64);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* A C tile's sums for rows m0 .. (those below M; a tile starts below M) and outputs n0 ... */
KVQ_AMX_BF16 static void bf16_store(const bf16_job* j, int64_t m0, int64_t n0, const float (*sums)[16]) {
    store_tile_sums(j->y, j->ytype, j->ldy, j->add, j->addtype, j->ldadd, j->N, m0,
                    (int)(j->M - m0 < 16 ? j->M - m0 : 16), n0, sums);
}

/* One chunk: 32 outputs (two B column tiles; one where N ends) against every
 * 32 rows, the whole K in the tiles' accumulators. */
KVQ_AMX_BF16 static void bf16_chunk(const void* ctx, int64_t chunk) {
    const bf16_job* j = ctx;
    const int64_t c0 = 2 * chunk, num_c = (j->N + 15) / 16, two = c0 + 1 < num_c;
    const uint16_t *b0 = j->wp + c0 * j->nb * 512, *b1 = b0 + j->nb * 512;
    float sums[16][16] __attribute__((aligned(64)));
    /* Whole float32 tiles with nothing to add go from the tiles to y: through
     * sums and store_tile_sums a 256-token prefill took ~7% longer. */
    const int direct = j->ytype == KVQ_F32 && j->add == NULL && 16 * (c0 + 1 + two) <= j->N;
    read_ahead ra;
    read_ahead_init(&ra, j, 2 * (chunk + j->threads), 2 * (chunk + j->threads) + 1);
    amx_bf16_configure();
    for (int64_t m0 = 0; m0 < j->Mpad; m0 += 32) {
        const int rows2 = m0 + 16 < j->Mpad;
        prefetch_store_rows(j->y, j->ytype, j->ldy, j->add, j->addtype, j->ldadd, m0,
                            j->M - m0 < 32 ? j->M - m0 : 32, 16 * c0, two ? 32 : 16);
        tile_products(j, m0, b0, b1, (int)two, rows2, &ra);
        if (direct && m0 + 32 <= j->M) {
            float* y0 = (float*)j->y + m0 * j->ldy + 16 * c0;
            const int64_t stride = j->ldy * 4;
            _tile_stored(0, y0, stride);
            _tile_stored(2, y0 + 16 * j->ldy, stride);
            if (two) { _tile_stored(1, y0 + 16, stride); _tile_stored(3, y0 + 16 * j->ldy + 16, stride); }
            continue;
        }
        _tile_stored(0, sums, 64); bf16_store(j, m0, 16 * c0, (const float (*)[16])sums);
        if (two) { _tile_stored(1, sums, 64); bf16_store(j, m0, 16 * c0 + 16, (const float (*)[16])sums); }
        if (rows2) {
            _tile_stored(2, sums, 64); bf16_store(j, m0 + 16, 16 * c0, (const float (*)[16])sums);
            if (two) { _tile_stored(3, sums, 64); bf16_store(j, m0 + 16, 16 * c0 + 16, (const float (*)[16])sums); }
        }
    }
    _tile_release();
}

/* silu(gate) * up of rows mt .. mt + 15 (zero from M on), rounded to bfloat16
 * into their A tile rows at the down projection's column ki: the tiles are
 * [Mpad / 16][inter / 32][16][32]. */
KVQ_AMX_BF16 static void swiglu_tiles(const bf16_job* j, int64_t mt, int64_t ki, const float (*gate)[16],
                                      const float (*up)[16]) {
    uint16_t* out = j->swiglu_xb + mt * (j->N / 2) + 512 * (ki / QK) + ki % QK;
    for (int r = 0; r < 16; r++) {
        const __m256i v = mt + r < j->M ? to_bf16x16_avx512(swiglu16_avx512(_mm512_load_ps(gate[r]), _mm512_load_ps(up[r])))
                                        : _mm256_setzero_si256();
        _mm256_storeu_si256((__m256i*)(out + QK * r), v);
    }
}

/* One chunk of kvq_prompt_mlp's gate_up product: 16 gate outputs (c) and the
 * 16 up outputs beside them (c + inter / 16) against every 32 rows, then
 * silu(gate) * up rounded to bfloat16 straight into the down projection's A
 * tiles (swiglu_xb). The floats are those of the unfused path (the same
 * tile sums through swiglu16_avx512 and to_bf16x16_avx512, as bf16_rows_chunk
 * applies them), so the bits are too; what goes is the float32 gate_up
 * activations' trip through memory (12 KB a row) and a pass over them. */
KVQ_AMX_BF16 static void swiglu_chunk(const void* ctx, int64_t chunk) {
    const bf16_job* j = ctx;
    const int64_t inter = j->N / 2, cu = chunk + inter / 16, ki = 16 * chunk;  /* ki: the output's column in down */
    const uint16_t *bg = j->wp + chunk * j->nb * 512, *bu = j->wp + cu * j->nb * 512;
    float gate[16][16] __attribute__((aligned(64))), up[16][16] __attribute__((aligned(64)));
    read_ahead ra;
    read_ahead_init(&ra, j, chunk + j->threads < inter / 16 ? chunk + j->threads : -1, cu + j->threads);
    amx_bf16_configure();
    for (int64_t m0 = 0; m0 < j->Mpad; m0 += 32) {
        const int rows2 = m0 + 16 < j->Mpad;
        tile_products(j, m0, bg, bu, 1, rows2, &ra);
        _tile_stored(0, gate, 64); _tile_stored(1, up, 64);
        swiglu_tiles(j, m0, ki, gate, up);
        if (rows2) { _tile_stored(2, gate, 64); _tile_stored(3, up, 64); swiglu_tiles(j, m0 + 16, ki, gate, up); }
    }
    _tile_release();
}
#else
int kvq_has_amx_bf16(void) { return 0; }
#endif

/* y[m, n] = sum_k f(x)[m, k] * W[n, k] (+ add[m, n]) on AMX-BF16 for m < M:
 * wp the packed bfloat16 weights above, the rest as kvq_matmul. Returns 0;
 * -1 where the scratch cannot be had; -2 where the CPU (or Linux) gives no
 * AMX-BF16 (nothing written either way). */
int kvq_matmul_bf16(const uint16_t* wp, int64_t N, int64_t K, const void* x, int xtype, int64_t ldx, int xop,
                    const void* norm_w, float eps, int64_t M, void* y, int ytype, int64_t ldy, const void* add,
                    int addtype, int64_t ldadd, int num_threads) {
#ifdef KVQ_X86
    if (!kvq_has_amx_bf16() || g_force_scalar) return -2;
    if (M == 0) return 0;
    const int64_t Mpad = (M + 15) / 16 * 16;
    uint16_t* xb = (uint16_t*)scratch_for(Mpad * K * 2);
    if (xb == NULL) return -1;
    bf16_job j = {wp, N, K, K / QK, M, Mpad, ldx, ldy, ldadd, xtype, xop, ytype, addtype, x, norm_w, add, eps, y, xb,
                  num_threads, NULL};
    parallel_chunks(num_threads, Mpad / 16, bf16_rows_chunk, &j);
    parallel_chunks(num_threads, ((N + 15) / 16 + 1) / 2, bf16_chunk, &j);
    return 0;
#else
    (void)wp; (void)N; (void)K; (void)x; (void)xtype; (void)ldx; (void)xop; (void)norm_w; (void)eps; (void)M;
    (void)y; (void)ytype; (void)ldy; (void)add; (void)addtype; (void)ldadd; (void)num_threads;
    return -2;
#endif
}

#ifdef KVQ_X86
/* Scratch for kvq_prompt_mlp's SwiGLU tiles, beside scratch_for's (both live at once). */
static uint16_t* swiglu_scratch_for(int64_t num_bytes) {
    static __thread void* buffer = NULL;
    static __thread int64_t capacity = 0;
    return (uint16_t*)grown(&buffer, &capacity, num_bytes);
}
#endif

/* A layer's MLP for M prompt rows on AMX-BF16, float32 activations:
 * y[m] = down(swiglu(gate_up(rms_norm(x[m]) * norm_w))) + add[m], the same
 * numbers as kvq_matmul_bf16 on gate_up into a [M, 2 inter] buffer and then
 * on down with KVQ_X_SWIGLU, without that buffer: swiglu_chunk writes the
 * down projection's bfloat16 A tiles itself. gate_up / down: the packed
 * tiles of the [2 inter, K] and [K_out, inter] weights (inter % 32 == 0).
 * Returns as kvq_matmul_bf16. */
int kvq_prompt_mlp(const uint16_t* gate_up, const uint16_t* down, int64_t inter, int64_t K, int64_t N,
                   const float* x, int64_t ldx, const float* norm_w, float eps, int64_t M, float* y, int64_t ldy,
                   const float* add, int64_t ldadd, int num_threads) {
#ifdef KVQ_X86
    if (!kvq_has_amx_bf16() || g_force_scalar) return -2;
    if (inter % 32 != 0 || K % QK != 0) return -3;
    if (M == 0) return 0;
    const int64_t Mpad = (M + 15) / 16 * 16;
    uint16_t *xb = (uint16_t*)scratch_for(Mpad * K * 2), *hb = swiglu_scratch_for(Mpad * inter * 2);
    if (xb == NULL || hb == NULL) return -1;
    bf16_job up = {gate_up, 2 * inter, K, K / QK, M, Mpad, ldx, 0, 0, KVQ_F32, KVQ_X_RMS_NORM, KVQ_F32, KVQ_F32,
                   x, norm_w, NULL, eps, NULL, xb, num_threads, hb};
    parallel_chunks(num_threads, Mpad / 16, bf16_rows_chunk, &up);
    parallel_chunks(num_threads, inter / 16, swiglu_chunk, &up);
    bf16_job dn = {down, N, inter, inter / QK, M, Mpad, 0, ldy, ldadd, KVQ_F32, KVQ_X_PLAIN, KVQ_F32, KVQ_F32,
                   NULL, NULL, add, 0.f, y, hb, num_threads, NULL};
    parallel_chunks(num_threads, ((N + 15) / 16 + 1) / 2, bf16_chunk, &dn);
    return 0;
#else
    (void)gate_up; (void)down; (void)inter; (void)K; (void)N; (void)x; (void)ldx; (void)norm_w; (void)eps; (void)M;
    (void)y; (void)ldy; (void)add; (void)ldadd; (void)num_threads;
    return -2;
#endif
}

typedef struct { int wtype, ytype; const uint8_t* w; int64_t K; const int64_t* rows; void* y; } rows_job;

static void dequantize_row(const void* ctx, int64_t i) {
    const rows_job* j = ctx;
    const int wtype = j->wtype, ytype = j->ytype;
    const int64_t K = j->K, nb = K / QK, bb = kvq_block_bytes(wtype);
    const uint8_t* w = j->w;
    const int64_t* rows = j->rows;
    void* y = j->y;
    const int64_t g = rows[i] / NR, r = rows[i] % NR;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w + (g * nb + b) * bb;
        float dw = fp16_to_f32(((const uint16_t*)blk)[r]);
        for (int j = 0; j < QK; j++) {
            float v;
            if (wtype == KVQ_Q8_0) {
                v = dw * (float)((const int8_t*)(blk + 16))[(j / 4) * 32 + 4 * r + j % 4];
            } else {
                const uint8_t* nib = blk + (wtype == KVQ_Q4_1 ? 32 : 16);
                int jj = j % 16, byte = nib[(jj / 4) * 32 + 4 * r + jj % 4];
                int q = j < 16 ? (byte & 0xf) : (byte >> 4);
                v = wtype == KVQ_Q4_1 ? dw * (float)q + fp16_to_f32(((const uint16_t*)blk)[8 + r])
                                      : dw * (float)(q - 8);
            }
            store_y(y, ytype, i * K + b * QK + j, v);
        }
    }
}

/* Rows `rows[i]` of packed W dequantized into y[i, :K] (an embedding lookup). */
void kvq_dequantize_rows(int wtype, const uint8_t* w, int64_t K, const int64_t* rows, int64_t num_rows,
                         void* y, int ytype, int num_threads) {
    rows_job j = {wtype, ytype, w, K, rows, y};
    parallel_chunks(num_rows < 64 ? 1 : num_threads, num_rows, dequantize_row, &j);
}

/* ---- the rest of a decoder step ------------------------------------------- */

/* RoPE (rotate-half layout) on q and k of every token, in place in qkv, then
 * k and v written to the layer's paged cache at their slots.
 * qkv: [T, (H + 2 Hkv) * D] (row stride ldq); cos/sin: [max_pos, D] of qkv's dtype;
 * cache: [slots, 2, Hkv, D] of cache_dtype (float32 or bfloat16; from float32
 * K/V rounded to nearest even, as torch's cast), or KVQ_I8's rows (each its
 * scale, max |x| / 127, then x / scale rounded to nearest even). */
typedef struct {
    void* qkv; int dtype; int64_t ldq; const int64_t *positions, *slots; const void *cos, *sin; void* cache;
    int cache_dtype; int64_t H, Hkv, D; int isa;  /* matmul_isa()'s */
} rope_job;

#ifdef KVQ_X86
/* One float32 head of D (half % 8 == 0) rotated in place, 8 lanes at a time:
 * the portable loop's products and sum, op for op, so the same bits. Built
 * without "fma": GCC would fuse the multiply and the add into one rounding. */
__attribute__((target("avx2")))
static void rope_head_avx2(float* x, const float* c, const float* s, int64_t half) {
    for (int64_t i = 0; i < half; i += 8) {
        const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)),
                                              _mm256_mul_ps(hi, _mm256_loadu_ps(s + i))));
        _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i)),
                                                     _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + i))));
    }
}

/* Rows of D (a multiple of 16) float32 values as KVQ_I8 cache rows: the
 * portable loop's scale, quotients and rounding, op for op (an IEEE
 * division and round-to-nearest-even either way), so the same bytes. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
static void to_i8_rows_avx512(const float* src, char* dst, int64_t rows, int64_t D, size_t row_bytes) {
    const __m512 lim = _mm512_set1_ps(127.f), neg = _mm512_set1_ps(-127.f);
    for (int64_t r = 0; r < rows; r++) {
        const float* x = src + r * D;
        char* row = dst + r * row_bytes;
        __m512 m = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
        const float scale = _mm512_reduce_max_ps(m) / 127.f;
        memcpy(row, &scale, sizeof scale);
        const __m512 s = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < D; i += 16) {
            __m512 q = scale > 0.f ? _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), s),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                   : _mm512_setzero_ps();
            q = _mm512_min_ps(_mm512_max_ps(q, neg), lim);
            _mm_storeu_si128((__m128i*)(row + KVQ_ROW_SCALE_BYTES + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
        }
    }
}

/* n (a multiple of 16) float32 values rounded to bfloat16 as f32_to_bf16 does. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
static void to_bf16_avx512(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i*)(dst + i), to_bf16x16_avx512(_mm512_loadu_ps(src + i)));
}
#endif

static void rope_token(const void* ctx, int64_t t) {
    const rope_job* j = ctx;
    void* qkv = j->qkv;
    const int dtype = j->dtype;
    const int64_t ldq = j->ldq, H = j->H, Hkv = j->Hkv, D = j->D, half = D / 2;
    const int64_t* slots = j->slots;
    const void *cos = j->cos, *sin = j->sin;
    void* cache = j->cache;
    const int64_t pos = j->positions[t];
    const int isa = j->isa;
    for (int64_t head = 0; head < H + Hkv; head++) {
        const int64_t base = t * ldq + head * D;
#ifdef KVQ_X86
        if (isa >= 2 && dtype == KVQ_F32 && half % 8 == 0) {
            rope_head_avx2((float*)qkv + base, (const float*)cos + pos * D, (const float*)sin + pos * D, half);
            continue;
        }
#endif
        float x[D];
        for (int64_t i = 0; i < D; i++) x[i] = load_x(qkv, dtype, base + i);
        for (int64_t i = 0; i < D; i++) {
            float rot = i < half ? -x[i + half] : x[i - half];
            float c = load_x(cos, dtype, pos * D + i), s = load_x(sin, dtype, pos * D + i);
            store_y(qkv, dtype, base + i, x[i] * c + rot * s);
        }
    }
    const size_t esz = dtype == KVQ_BF16 ? 2 : 4, row_bytes = cache_row_bytes(j->cache_dtype, D);
    char* dst = (char*)cache + (size_t)slots[t] * 2 * Hkv * row_bytes;
    const char* src = (const char*)qkv + (size_t)(t * ldq + H * D) * esz;
    if (j->cache_dtype == KVQ_I8) {  /* each row: its scale, then its values rounded to nearest even */
#ifdef KVQ_X86
        if (isa == 3 && dtype == KVQ_F32 && D % 16 == 0) {
            to_i8_rows_avx512((const float*)src, dst, 2 * Hkv, D, row_bytes);
            return;
        }
#endif
        for (int64_t r = 0; r < 2 * Hkv; r++) {
            float x[D], amax = 0.f;
            for (int64_t i = 0; i < D; i++) {
                x[i] = load_x(src, dtype, r * D + i);
                amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            }
            const float scale = amax / 127.f;
            char* row = dst + r * row_bytes;
            memcpy(row, &scale, sizeof scale);
            for (int64_t i = 0; i < D; i++) {
                const float v = scale > 0.f ? nearbyintf(x[i] / scale) : 0.f;
                row[KVQ_ROW_SCALE_BYTES + i] = (char)(int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
            }
        }
        return;
    }
    if (j->cache_dtype == dtype) {
        memcpy(dst, src, (size_t)2 * Hkv * D * esz);  /* k then v, as the cache's [2, Hkv, D] */
        return;
    }
#ifdef KVQ_X86
    if (isa == 3 && dtype == KVQ_F32 && (2 * Hkv * D) % 16 == 0) {  /* float32 K/V into a bfloat16 cache */
        to_bf16_avx512((const float*)src, (uint16_t*)dst, 2 * Hkv * D);
        return;
    }
#endif
    for (int64_t i = 0; i < 2 * Hkv * D; i++) store_y(dst, j->cache_dtype, i, load_x(src, dtype, i));
}

void kvq_rope_write_kv(void* qkv, int dtype, int64_t T, int64_t ldq, const int64_t* positions,
                       const void* cos, const void* sin, const int64_t* slots, void* cache, int cache_dtype,
                       int64_t H, int64_t Hkv, int64_t D, int num_threads) {
    rope_job j = {qkv, dtype, ldq, positions, slots, cos, sin, cache, cache_dtype, H, Hkv, D, matmul_isa()};
    parallel_chunks(T < 32 ? 1 : num_threads, T, rope_token, &j);  /* a decode step's few tokens: no helpers */
}

/* Attention of B query rows, each over its own cached context: one row per
 * sequence on a decode step; one per token on a prefill or verifying step,
 * where row b's context is its causal prefix (context_lens[b] = its position
 * + 1, block_table row b = its sequence's blocks).
 * q: [B, H * D] (row stride ldq); out: [B, H * D]; the context of row b is
 * its first context_lens[b] positions, position p at slot
 * block_table[b, p / block_size] * block_size + p % block_size. GQA: query head
 * h reads KV head h / (H / Hkv). Reads K/V in place, a tile of positions at a
 * time with an online softmax, so memory does not grow with the context. */
#define KVQ_TILE 32
#define KVQ_MAX_GROUP 16
#define KVQ_MAX_D 256

/* A cache row's D values as float32. */
static inline void cache_row_floats(const char* row, int dtype, int64_t D, float* out) {
    if (dtype == KVQ_I8) {
        const float scale = cache_row_scale(row);
        for (int64_t i = 0; i < D; i++) out[i] = scale * (float)(int8_t)row[KVQ_ROW_SCALE_BYTES + i];
    } else if (dtype == KVQ_BF16) {
        for (int64_t i = 0; i < D; i++) out[i] = bf16_to_f32(((const uint16_t*)row)[i]);
    } else {
        memcpy(out, row, D * sizeof(float));
    }
}
__attribute__((target_clones("avx2", "default")))
static void attend_one(const float* qs, int64_t group, int64_t D, const char* cache, int dtype, int64_t Hkv,
                       int64_t kvh, const int64_t* blocks, int64_t block_size, int64_t L, float* acc) {
    const size_t row_bytes = cache_row_bytes(dtype, D), slot_bytes = 2 * (size_t)Hkv * row_bytes;
    float mx[KVQ_MAX_GROUP], den[KVQ_MAX_GROUP], sc[KVQ_MAX_GROUP][KVQ_TILE], kv[KVQ_TILE][KVQ_MAX_D];
    for (int64_t g = 0; g < group; g++) { mx[g] = -INFINITY; den[g] = 0.f; }
    for (int64_t i = 0; i < group * D; i++) acc[i] = 0.f;
    for (int64_t p0 = 0; p0 < L; p0 += KVQ_TILE) {
        const int64_t n = L - p0 < KVQ_TILE ? L - p0 : KVQ_TILE;
        const char* rows[KVQ_TILE];
        for (int64_t j = 0; j < n; j++) {
            const int64_t p = p0 + j;
            rows[j] = cache + (size_t)(blocks[p / block_size] * block_size + p % block_size) * slot_bytes
                      + (size_t)kvh * row_bytes;
        }
        for (int64_t j = 0; j < n; j++) cache_row_floats(rows[j], dtype, D, kv[j]);  /* keys of the tile */
        for (int64_t g = 0; g < group; g++) {
            const float* qg = qs + g * D;
            float tile_max = mx[g];
            for (int64_t j = 0; j < n; j++) {
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int64_t i = 0; i < D; i++) dot += qg[i] * kv[j][i];
                sc[g][j] = dot;
                tile_max = dot > tile_max ? dot : tile_max;
            }
            const float corr = expf(mx[g] - tile_max);
            den[g] *= corr;
            for (int64_t i = 0; i < D; i++) acc[g * D + i] *= corr;
            mx[g] = tile_max;
            for (int64_t j = 0; j < n; j++) { sc[g][j] = expf(sc[g][j] - tile_max); den[g] += sc[g][j]; }
        }
        for (int64_t j = 0; j < n; j++) cache_row_floats(rows[j] + (size_t)Hkv * row_bytes, dtype, D, kv[j]);  /* values */
        for (int64_t g = 0; g < group; g++)
            for (int64_t j = 0; j < n; j++) {
                const float e = sc[g][j];
                float* ag = acc + g * D;
                for (int64_t i = 0; i < D; i++) ag[i] += e * kv[j][i];
            }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < D; i++) acc[g * D + i] /= den[g];
}

#ifdef KVQ_X86
KVQ_AVX2 float hsum8_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2, degree-5
 * polynomial; ~1e-7 relative error, the portable path's expf within float
 * rounding); below -87 it returns ~1e-38 where expf underflows to 0. */
KVQ_AVX2 __m256 exp_nonpos_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* silu(g) * u for the down projection's input (transform_row's SWIGLU), 8 at
 * a time: libm's expf one element at a time was ~15% of a 256-token prefill
 * (perf) and ~3/4 of the LoRA shrink's time in a 640-token one (C harness).
 * With t = exp(-|g|) <= 1, sigmoid(g) is 1 / (1 + t) for g >= 0 and
 * t / (1 + t) below, so only exp_nonpos_avx2 is needed: within ~3.3e-7
 * relative of the scalar form over g in [-20.5, 20.5]. The SIMD paths all
 * take it (matmul and LoRA alike, so they stay bit-identical to each other);
 * the portable path keeps expf. */
__attribute__((target("avx2,fma,f16c")))
static void swiglu_avx2(const void* row, int xtype, int64_t K, float* out) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 g = load8_avx2(row, xtype, k), u = load8_avx2(row, xtype, K + k);
        const __m256 t = exp_nonpos_avx2(_mm256_or_ps(g, sign));  /* exp(-|g|) */
        const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, t), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, t)), u));
    }
    for (; k < K; k++) {
        const float g = load_x(row, xtype, k);
        out[k] = g / (1.f + expf(-g)) * load_x(row, xtype, K + k);
    }
}

/* 8 floats of a cache row (float32, bfloat16 or scaled int8) at element i. */
KVQ_AVX2 __m256 cache8_avx2(const char* row, int dtype, int64_t i) {
    if (dtype == KVQ_I8)
        return _mm256_mul_ps(_mm256_set1_ps(cache_row_scale(row)),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + KVQ_ROW_SCALE_BYTES + i)))));
    return load8_avx2(row, dtype, i);
}

/* attend_one for D % 32 == 0 with AVX2: the same online softmax, keys and
 * values read in place (no tile copy), four keys' dot products and four
 * output vectors in flight at a time, so the FMAs are not one dependency chain.
 * One query row's state across tiles (its running max, denominator, output). */
typedef struct { float mx[KVQ_MAX_GROUP], den[KVQ_MAX_GROUP]; } softmax_state;

/* Where positions p0..p0+n-1 of a context keep their keys for KV head kvh:
 * krow[j] (its values follow Hkv * D elements on). Two divisions per tile, not
 * two per position (a 64-bit division per key was a good part of a prefill's
 * attention). */
static void tile_key_rows(const char* cache, int dtype, int64_t Hkv, int64_t kvh, int64_t D, const int64_t* blocks,
                          int64_t block_size, int64_t p0, int64_t n, const char** krow) {
    const size_t row_bytes = cache_row_bytes(dtype, D), slot_bytes = 2 * (size_t)Hkv * row_bytes;
    int64_t block = p0 / block_size, offset = p0 % block_size;
    for (int64_t j = 0; j < n; j++) {
        krow[j] = cache + (size_t)(blocks[block] * block_size + offset) * slot_bytes + (size_t)kvh * row_bytes;
        if (++offset == block_size) { offset = 0; block++; }
    }
}

/* Positions p0..p0+n-1 of one query row: the tile's key and value rows. */
typedef void (*attend_tile_fn)(const float* qs, int64_t group, int64_t D, const char* cache, int dtype, int64_t Hkv,
                               int64_t kvh, const int64_t* blocks, int64_t block_size, int64_t p0, int64_t n,
                               softmax_state* st, float* acc);

__attribute__((target("avx2,fma,f16c")))
static void attend_tile_avx2(const float* qs, int64_t group, int64_t D, const char* cache, int dtype,
                               int64_t Hkv, int64_t kvh, const int64_t* blocks, int64_t block_size, int64_t p0,
                               int64_t n, softmax_state* st, float* acc) {
    const size_t row_bytes = cache_row_bytes(dtype, D);
    float *mx = st->mx, *den = st->den, sc[KVQ_MAX_GROUP][KVQ_TILE];
    {
        const char *krow[KVQ_TILE + 3], *vrow[KVQ_TILE];
        tile_key_rows(cache, dtype, Hkv, kvh, D, blocks, block_size, p0, n, krow);
        for (int64_t j = 0; j < n; j++) vrow[j] = krow[j] + (size_t)Hkv * row_bytes;
        for (int64_t j = n; j < n + 3; j++) krow[j] = krow[0];  /* the last group of four reads valid rows */
        for (int64_t g = 0; g < group; g++) {
            const float* qg = qs + g * D;
            float tile_max = mx[g];
            for (int64_t j = 0; j < n; j += 4) {
                __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
                for (int64_t i = 0; i < D; i += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + i);
                    s0 = _mm256_fmadd_ps(qv, cache8_avx2(krow[j], dtype, i), s0);
                    s1 = _mm256_fmadd_ps(qv, cache8_avx2(krow[j + 1], dtype, i), s1);
                    s2 = _mm256_fmadd_ps(qv, cache8_avx2(krow[j + 2], dtype, i), s2);
                    s3 = _mm256_fmadd_ps(qv, cache8_avx2(krow[j + 3], dtype, i), s3);
                }
                float dots[4] = {hsum8_avx2(s0), hsum8_avx2(s1), hsum8_avx2(s2), hsum8_avx2(s3)};
                for (int64_t t = 0; t < 4 && j + t < n; t++) {
                    sc[g][j + t] = dots[t];
                    tile_max = dots[t] > tile_max ? dots[t] : tile_max;
                }
            }
            const float corr = expf(mx[g] - tile_max);
            den[g] *= corr;
            for (int64_t i = 0; i < D; i++) acc[g * D + i] *= corr;
            mx[g] = tile_max;
            int64_t j = 0;
            __m256 dsum = _mm256_setzero_ps();
            for (; j + 8 <= n; j += 8) {
                __m256 e = exp_nonpos_avx2(_mm256_sub_ps(_mm256_loadu_ps(sc[g] + j), _mm256_set1_ps(tile_max)));
                _mm256_storeu_ps(sc[g] + j, e);
                dsum = _mm256_add_ps(dsum, e);
            }
            den[g] += hsum8_avx2(dsum);
            for (; j < n; j++) { sc[g][j] = expf(sc[g][j] - tile_max); den[g] += sc[g][j]; }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < D; i += 32) {
                float* ag = acc + g * D + i;
                __m256 a0 = _mm256_loadu_ps(ag), a1 = _mm256_loadu_ps(ag + 8);
                __m256 a2 = _mm256_loadu_ps(ag + 16), a3 = _mm256_loadu_ps(ag + 24);
                for (int64_t j = 0; j < n; j++) {
                    const __m256 e = _mm256_set1_ps(sc[g][j]);
                    a0 = _mm256_fmadd_ps(e, cache8_avx2(vrow[j], dtype, i), a0);
                    a1 = _mm256_fmadd_ps(e, cache8_avx2(vrow[j], dtype, i + 8), a1);
                    a2 = _mm256_fmadd_ps(e, cache8_avx2(vrow[j], dtype, i + 16), a2);
                    a3 = _mm256_fmadd_ps(e, cache8_avx2(vrow[j], dtype, i + 24), a3);
                }
                _mm256_storeu_ps(ag, a0); _mm256_storeu_ps(ag + 8, a1);
                _mm256_storeu_ps(ag + 16, a2); _mm256_storeu_ps(ag + 24, a3);
            }
    }
}

/* The K and V rows of the tile at p0 (positions below L) requested ahead of
 * it: a decode step's K/V rows are cold (the step streams ~100 MB of weights
 * through the cache), and each tile's loads waited on their misses (the
 * kernel ~18% of a batch-1 step at 300 positions, perf). One tile of work
 * ahead covers a miss; rows of the same sequence after the first find the
 * tile in L1 anyway. */
static inline void prefetch_tile(int64_t D, const char* cache, int dtype, int64_t Hkv, int64_t kvh,
                                 const int64_t* blocks, int64_t block_size, int64_t p0, int64_t L) {
    const size_t row_bytes = cache_row_bytes(dtype, D), slot_bytes = 2 * (size_t)Hkv * row_bytes;
    const int64_t p1 = p0 + KVQ_TILE < L ? p0 + KVQ_TILE : L;
    for (int64_t p = p0; p < p1; p++) {
        const char* krow = cache + (size_t)(blocks[p / block_size] * block_size + p % block_size) * slot_bytes
                           + (size_t)kvh * row_bytes;
        for (size_t line = 0; line < row_bytes; line += 64) {
            _mm_prefetch(krow + line, _MM_HINT_T0);
            _mm_prefetch(krow + (size_t)Hkv * row_bytes + line, _MM_HINT_T0);
        }
    }
}

/* ---- attention with AVX-512 (the "best" path where the CPU has it) -------- */

/* Every AVX-512 path here runs only where matmul_isa() is 3 (AVX512-VNNI with VL and BW). */
#define KVQ_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline)) static inline

/* 16 floats of a cache row (float32, bfloat16 or scaled int8) at element i. */
KVQ_AVX512 __m512 cache16_avx512(const char* row, int dtype, int64_t i) {
    if (dtype == KVQ_I8)
        return _mm512_mul_ps(_mm512_set1_ps(cache_row_scale(row)),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + KVQ_ROW_SCALE_BYTES + i)))));
    if (dtype == KVQ_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float*)row + i);
}

/* exp_nonpos_avx2 on 16 lanes, op for op. */
KVQ_AVX512 __m512 exp_nonpos_avx512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

KVQ_AVX512 __m512 swiglu16_avx512(__m512 g, __m512 u) {
    const __m512 t = exp_nonpos_avx512(_mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u))));  /* exp(-|g|) */
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, _mm512_mul_ps(g, t));
    return _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), t)), u);
}

/* swiglu_avx2 on 16 lanes, op for op (its exp, blend and division): the same
 * floats, twice the inputs per instruction. K % 16 == 0. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
static void swiglu_avx512(const void* row, int xtype, int64_t K, float* out) {
    for (int64_t k = 0; k < K; k += 16)
        _mm512_storeu_ps(out + k, swiglu16_avx512(cache16_avx512(row, xtype, k), cache16_avx512(row, xtype, K + k)));
}

/* Scores of query qg against keys krow[0..15] (D % 64 == 0): a key's four
 * 16-column products at a time, so one row pointer is live, not sixteen.
 *
 * A bfloat16 cache's keys are widened without shuffles: a 64-byte load holds
 * 32 of a key's elements, the even ones as the low halves of its 32-bit
 * lanes and the odd ones as the high halves, so a shift and a mask give both
 * as floats; qg is then the query deinterleaved to match (per 32 elements:
 * the 16 even, then the 16 odd; deinterleave_bf16_query), so each lane sums
 * its own pairs' products and the lanes are folded as for the other caches.
 * Widening with vpmovzxwd took 4 shuffles a key and query: 64 decode rows
 * over 290 positions, 30 layers, one thread on the 2026-12-07 EPYC, 1.06x
 * with the layers' caches cold and 1.15x warm without them. The sums run in
 * another order than the other caches' (within float32 rounding of them);
 * each row's still depend only on its own query, context and cache. The
 * value rows keep vpmovzxwd: widened once for all the heads of a KV head,
 * the same trick there (with the accumulators deinterleaved) measured
 * 0.99-1.03x. */
KVQ_AVX512 __m512 dots16_avx512(const float* qg, const char* const* krow, int dtype, int64_t D) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[16];
    _Pragma("GCC unroll 16")
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 64) {
        const __m512 q0 = _mm512_loadu_ps(qg + i), q1 = _mm512_loadu_ps(qg + i + 16);
        const __m512 q2 = _mm512_loadu_ps(qg + i + 32), q3 = _mm512_loadu_ps(qg + i + 48);
        _Pragma("GCC unroll 16")
        for (int t = 0; t < 16; t++) {
            const char* k = krow[t];
            __m512 k0, k1, k2, k3;
            if (dtype == KVQ_BF16) {  /* even, odd of elements i .. i + 31, then of i + 32 .. i + 63 */
                const __m512i lo = _mm512_loadu_si512((const uint16_t*)k + i);
                const __m512i hi = _mm512_loadu_si512((const uint16_t*)k + i + 32);
                k0 = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16));
                k1 = _mm512_castsi512_ps(_mm512_and_si512(lo, high));
                k2 = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
                k3 = _mm512_castsi512_ps(_mm512_and_si512(hi, high));
            } else {
                k0 = cache16_avx512(k, dtype, i), k1 = cache16_avx512(k, dtype, i + 16);
                k2 = cache16_avx512(k, dtype, i + 32), k3 = cache16_avx512(k, dtype, i + 48);
            }
            acc[t] = _mm512_fmadd_ps(q0, k0, acc[t]);
            acc[t] = _mm512_fmadd_ps(q1, k1, acc[t]);
            acc[t] = _mm512_fmadd_ps(q2, k2, acc[t]);
            acc[t] = _mm512_fmadd_ps(q3, k3, acc[t]);
        }
    }
    return hsum16x16_avx512(acc);
}

/* q (D floats, D % 32 == 0) -> qd, as dots16_avx512 reads a bfloat16 cache's query. */
KVQ_AVX512 void deinterleave_bf16_query(const float* q, int64_t D, float* qd) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t i = 0; i < D; i += 32) {
        const __m512 lo = _mm512_loadu_ps(q + i), hi = _mm512_loadu_ps(q + i + 16);
        _mm512_storeu_ps(qd + i, _mm512_permutex2var_ps(lo, even, hi));
        _mm512_storeu_ps(qd + i + 16, _mm512_permutex2var_ps(lo, odd, hi));
    }
}

/* acc[h] = acc[h] * corr[h] + sum_j e[h][j] v[j] over NH heads and the 64
 * output columns at i: the tile's value rows read once for NH heads. */
KVQ_AVX512 void values_avx512(const float (*sc)[KVQ_TILE], const float* corr, const char* const* vrow, int dtype,
                              int64_t n, int64_t i, int64_t D, float* acc, const int NH) {
    __m512 a[4][4];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < 4; c++) a[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + i + 16 * c), _mm512_set1_ps(corr[h]));
    for (int64_t j = 0; j < n; j++) {
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = cache16_avx512(vrow[j], dtype, i + 16 * c);
        for (int h = 0; h < NH; h++) {
            const __m512 e = _mm512_set1_ps(sc[h][j]);
            for (int c = 0; c < 4; c++) a[h][c] = _mm512_fmadd_ps(e, v[c], a[h][c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + h * D + i + 16 * c, a[h][c]);
}

/* attend_tile_avx2 for D % 64 == 0 in 512-bit registers: sixteen keys'
 * scores at a time (their dot products summed together, hsum16x16), so the
 * softmax runs on whole vectors, and each value row is loaded once for up to
 * four heads. Lanes past the tile's n keys hold a repeated valid key, masked
 * to a zero weight. */
KVQ_AVX512 void attend_tile_avx512_of(const float* qs, int64_t group, int64_t D, const char* cache, const int dtype,
                                      int64_t Hkv, int64_t kvh, const int64_t* blocks, int64_t block_size, int64_t p0,
                                      int64_t n, softmax_state* st, float* acc) {
    const size_t row_bytes = cache_row_bytes(dtype, D);
    const char *krow[KVQ_TILE], *vrow[KVQ_TILE];
    float sc[KVQ_MAX_GROUP][KVQ_TILE], corr[KVQ_MAX_GROUP];
    tile_key_rows(cache, dtype, Hkv, kvh, D, blocks, block_size, p0, n, krow);
    for (int64_t j = n; j < KVQ_TILE; j++) krow[j] = krow[0];
    for (int64_t j = 0; j < KVQ_TILE; j++) vrow[j] = krow[j] + (size_t)Hkv * row_bytes;
    const int64_t halves = (n + 15) / 16;  /* 16-key halves of the tile holding keys */
    float qd[dtype == KVQ_BF16 ? KVQ_MAX_D : 1];
    for (int64_t g = 0; g < group; g++) {
        __m512 s[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)};
        __mmask16 live[2] = {0, 0};
        if (dtype == KVQ_BF16) deinterleave_bf16_query(qs + g * D, D, qd);
        for (int64_t b = 0; b < halves; b++) {
            const int64_t keys = n - 16 * b < 16 ? n - 16 * b : 16;
            live[b] = (__mmask16)((1u << keys) - 1);
            s[b] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live[b],
                                      dots16_avx512(dtype == KVQ_BF16 ? qd : qs + g * D, krow + 16 * b, dtype, D));
        }
        const float tile_max = fmaxf(st->mx[g], _mm512_reduce_max_ps(_mm512_max_ps(s[0], s[1])));
        const __m512 shift = _mm512_set1_ps(tile_max);
        const __m512 e0 = _mm512_maskz_mov_ps(live[0], exp_nonpos_avx512(_mm512_sub_ps(s[0], shift)));
        const __m512 e1 = _mm512_maskz_mov_ps(live[1], exp_nonpos_avx512(_mm512_sub_ps(s[1], shift)));
        _mm512_storeu_ps(sc[g], e0);
        _mm512_storeu_ps(sc[g] + 16, e1);
        corr[g] = expf(st->mx[g] - tile_max);
        st->den[g] = st->den[g] * corr[g] + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        st->mx[g] = tile_max;
    }
    for (int64_t g = 0; g < group; g += 4)
        for (int64_t i = 0; i < D; i += 64)
            switch (group - g < 4 ? group - g : 4) {
                case 4: values_avx512(sc + g, corr + g, vrow, dtype, n, i, D, acc + g * D, 4); break;
                case 3: values_avx512(sc + g, corr + g, vrow, dtype, n, i, D, acc + g * D, 3); break;
                case 2: values_avx512(sc + g, corr + g, vrow, dtype, n, i, D, acc + g * D, 2); break;
                default: values_avx512(sc + g, corr + g, vrow, dtype, n, i, D, acc + g * D, 1); break;
            }
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
static void attend_tile_avx512(const float* qs, int64_t group, int64_t D, const char* cache, int dtype,
                               int64_t Hkv, int64_t kvh, const int64_t* blocks, int64_t block_size, int64_t p0,
                               int64_t n, softmax_state* st, float* acc) {
    if (dtype == KVQ_BF16)  /* the cache's type a constant in each copy: no branch per load */
        attend_tile_avx512_of(qs, group, D, cache, KVQ_BF16, Hkv, kvh, blocks, block_size, p0, n, st, acc);
    else if (dtype == KVQ_I8)
        attend_tile_avx512_of(qs, group, D, cache, KVQ_I8, Hkv, kvh, blocks, block_size, p0, n, st, acc);
    else
        attend_tile_avx512_of(qs, group, D, cache, KVQ_F32, Hkv, kvh, blocks, block_size, p0, n, st, acc);
}

/* Query rows r0..r1-1 (one KV head), tile by tile: each row does exactly the
 * work it would alone (its own block table, context and tiles, so the same
 * results), but the rows of one sequence, a prefill's consecutive tokens,
 * read each tile's keys and values from L1 after the first row instead of
 * each streaming its whole context from L2/L3. */
static void attend_rows(attend_tile_fn attend_tile, const float* qs, int64_t group, int64_t D, const char* cache,
                        int dtype, int64_t Hkv, int64_t kvh, const int64_t* block_table, int64_t max_blocks,
                        int64_t block_size, const int64_t* context_lens, int64_t r0, int64_t r1, softmax_state* st,
                        float* acc) {
    const int64_t width = group * D;
    int64_t longest = 0;
    for (int64_t r = r0; r < r1; r++) {
        softmax_state* s = st + (r - r0);
        for (int64_t g = 0; g < group; g++) { s->mx[g] = -INFINITY; s->den[g] = 0.f; }
        for (int64_t i = 0; i < width; i++) acc[(r - r0) * width + i] = 0.f;
        longest = context_lens[r] > longest ? context_lens[r] : longest;
    }
    for (int64_t p0 = 0; p0 < longest; p0 += KVQ_TILE)
        for (int64_t r = r0; r < r1; r++) {
            const int64_t L = context_lens[r];
            if (p0 >= L) continue;
            if (r == r0) prefetch_tile(D, cache, dtype, Hkv, kvh, block_table + r * max_blocks, block_size,
                                       p0 + KVQ_TILE, L);
            attend_tile(qs + (r - r0) * width, group, D, cache, dtype, Hkv, kvh, block_table + r * max_blocks,
                        block_size, p0, L - p0 < KVQ_TILE ? L - p0 : KVQ_TILE, st + (r - r0), acc + (r - r0) * width);
        }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < D; i++) acc[(r - r0) * width + g * D + i] /= st[r - r0].den[g];
}
#endif

/* Whole slots of positions p0..p1-1 (every KV head's K and V) requested ahead
 * of use: a decode row reads its context once, every head of a slot together.
 * The hint and distance were measured (16 cold rows x 288 positions x 30
 * layers, 1 thread): none 28.6 ms, T0 one tile ahead 27.6, T1 25.2, T2 23.3,
 * T2 two tiles ahead 22.9 (the choice), four tiles ahead ~24. */
#define KVQ_PREFETCH_TILES 2
static inline void prefetch_slots(const char* cache, size_t slot_bytes, const int64_t* blocks, int64_t block_size,
                                  int64_t p0, int64_t p1) {
#ifdef KVQ_X86
    for (int64_t p = p0; p < p1; p++) {
        const char* slot = cache + (size_t)(blocks[p / block_size] * block_size + p % block_size) * slot_bytes;
        for (size_t line = 0; line < slot_bytes; line += 64) _mm_prefetch(slot + line, _MM_HINT_T2);
    }
#else
    (void)cache; (void)slot_bytes; (void)blocks; (void)block_size; (void)p0; (void)p1;
#endif
}

#ifdef KVQ_X86
/* One query row over its context, KV heads kv0..kv1-1 together, tile by tile:
 * each (row, head) runs exactly the tiles attend_rows runs for it, so the same
 * bits; what changes is the order of memory reads. A decode row's K/V are
 * cold, and a head's rows are a third of each slot here (the slot holds every
 * head's K, then V): read a head at a time, the context streamed at ~7 GB/s
 * against ~26 warm (16 rows x 288 positions x 30 layers). Read a tile of
 * whole slots at a time, with the next tile's slots requested ahead, the
 * reads are sequential within a block. */
static void attend_row_heads(attend_tile_fn attend_tile, const float* qs, int64_t group, int64_t D,
                             const char* cache, int dtype, int64_t Hkv, int64_t kv0, int64_t kv1,
                             const int64_t* blocks, int64_t block_size, int64_t L, softmax_state* st, float* acc) {
    const size_t slot_bytes = 2 * (size_t)Hkv * cache_row_bytes(dtype, D);
    const int64_t width = group * D, heads = kv1 - kv0;
    for (int64_t k = 0; k < heads; k++) {
        for (int64_t g = 0; g < group; g++) { st[k].mx[g] = -INFINITY; st[k].den[g] = 0.f; }
        for (int64_t i = 0; i < width; i++) acc[k * width + i] = 0.f;
    }
    const int64_t lead = KVQ_PREFETCH_TILES * KVQ_TILE;  /* positions requested ahead */
    prefetch_slots(cache, slot_bytes, blocks, block_size, 0, L < lead ? L : lead);
    for (int64_t p0 = 0; p0 < L; p0 += KVQ_TILE) {
        const int64_t n = L - p0 < KVQ_TILE ? L - p0 : KVQ_TILE;
        if (p0 + lead < L) prefetch_slots(cache, slot_bytes, blocks, block_size, p0 + lead, p0 + lead + n < L ? p0 + lead + n : L);
        for (int64_t k = 0; k < heads; k++)
            attend_tile(qs + k * width, group, D, cache, dtype, Hkv, kv0 + k, blocks, block_size, p0, n, st + k,
                        acc + k * width);
    }
    for (int64_t k = 0; k < heads; k++)
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < D; i++) acc[k * width + g * D + i] /= st[k].den[g];
}
#endif

/* A work item: query rows r0..r1-1 (of one sequence where there are several)
 * over KV heads kv0..kv1-1. */
typedef struct { int32_t r0, r1, kv0, kv1; } attention_item;

typedef struct {
    const void* q; int dtype; int64_t ldq; const void* cache; int cache_dtype;
    const int64_t *block_table, *context_lens;
    int64_t max_blocks, block_size, H, Hkv, D; float scale; void* out; int isa;  /* matmul_isa()'s */
    int64_t B;
    const attention_item* items;
} attention_job;

/* Query rows per work item, at most (and as many as the buffers of one
 * row of the largest head shape hold): a tile's K/V (2 x 32 x D) is shared by
 * up to this many rows. */
#define KVQ_ATTEND_ROWS 16

static void attend_chunk(const void* ctx, int64_t index) {
    const attention_job* j = ctx;
    const attention_item* item = j->items + index;
    const int64_t group = j->H / j->Hkv, D = j->D, width = group * D;
    const int64_t r0 = item->r0, r1 = item->r1, kv0 = item->kv0, kv1 = item->kv1, heads = kv1 - kv0;
    /* rows x heads of width: at most KVQ_MAX_GROUP * KVQ_MAX_D floats (the partition keeps it so) */
    float qs[KVQ_MAX_GROUP * KVQ_MAX_D], acc[KVQ_MAX_GROUP * KVQ_MAX_D];
    if (group < 1 || D < 1) return;  /* refused by the caller; tells the compiler qs is written */
    for (int64_t r = r0; r < r1; r++) {  /* float32 apart: a loop the compiler vectorizes */
        float* qr = qs + (r - r0) * heads * width;
        if (j->dtype == KVQ_F32) {
            const float* src = (const float*)j->q + r * j->ldq + kv0 * width;
            for (int64_t i = 0; i < heads * width; i++) qr[i] = src[i] * j->scale;
        } else {
            for (int64_t i = 0; i < heads * width; i++)
                qr[i] = load_x(j->q, j->dtype, r * j->ldq + kv0 * width + i) * j->scale;
        }
    }
#ifdef KVQ_X86
    if (j->isa >= 2 && D % 32 == 0) {
        softmax_state st[KVQ_ATTEND_ROWS];
        const attend_tile_fn tile = j->isa == 3 && D % 64 == 0 ? attend_tile_avx512 : attend_tile_avx2;
        if (heads > 1)  /* one row, several heads */
            attend_row_heads(tile, qs, group, D, (const char*)j->cache, j->cache_dtype, j->Hkv, kv0, kv1,
                             j->block_table + r0 * j->max_blocks, j->block_size, j->context_lens[r0], st, acc);
        else
            attend_rows(tile, qs, group, D, (const char*)j->cache, j->cache_dtype, j->Hkv, kv0, j->block_table,
                        j->max_blocks, j->block_size, j->context_lens, r0, r1, st, acc);
    } else
#endif
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k = 0; k < heads; k++)
            attend_one(qs + ((r - r0) * heads + k) * width, group, D, (const char*)j->cache, j->cache_dtype, j->Hkv,
                       kv0 + k, j->block_table + r * j->max_blocks, j->block_size, j->context_lens[r],
                       acc + ((r - r0) * heads + k) * width);
    for (int64_t r = r0; r < r1; r++) {
        const float* ar = acc + (r - r0) * heads * width;
        const int64_t at = r * j->H * D + kv0 * width;
        if (j->dtype == KVQ_F32) memcpy((float*)j->out + at, ar, (size_t)(heads * width) * sizeof(float));
        else for (int64_t i = 0; i < heads * width; i++) store_y(j->out, j->dtype, at + i, ar[i]);
    }
}

/* Whether rows a and b attend over one sequence's blocks (a prefill's or a
 * verification's tokens; also sequences that share a cached prefix, whose
 * common tiles are then read once). */
static int same_sequence(const int64_t* block_table, int64_t max_blocks, int64_t a, int64_t b) {
    return block_table[a * max_blocks] == block_table[b * max_blocks];
}

/* The step's work items, in row order. Rows of one sequence go several to an
 * item, one KV head each: consecutive tokens read each tile's K/V from L1
 * after the first row (rows_per_item of them, as many as leave ~16 items per
 * thread). A row alone (a decode row) goes to an item of every KV head where
 * there are rows enough to keep the threads busy, or one thread takes them
 * all (attend_row_heads: whole slots read in order, 1.2-1.27x on a batch-1
 * decode step at 128-2,000 positions), else to one item per head. Returns the count, or -1 when the scratch cannot be had. */
static int64_t attention_items(const int64_t* block_table, int64_t max_blocks, int64_t B, const uint8_t* skip,
                               int64_t H, int64_t Hkv, int64_t D, int num_threads, attention_item** out) {
    static __thread void* scratch = NULL;
    static __thread int64_t capacity = 0;
    attention_item* buffer = grown(&scratch, &capacity, B * Hkv * (int64_t)sizeof(attention_item));
    if (buffer == NULL && B * Hkv > 0) return -1;
    const int64_t threads = num_threads > 1 ? num_threads : 1, width = H / Hkv * D;
    const int64_t fit = KVQ_MAX_GROUP * KVQ_MAX_D / width;  /* rows (or heads) the buffers hold */
    int64_t alone = 0;
    for (int64_t r = 0; r < B; r++)
        alone += !(skip != NULL && skip[r]) && (r == 0 || !same_sequence(block_table, max_blocks, r - 1, r))
                 && (r + 1 == B || !same_sequence(block_table, max_blocks, r, r + 1));
    const int all_heads = Hkv > 1 && Hkv <= KVQ_ATTEND_ROWS && Hkv <= fit && (threads == 1 || alone >= 2 * threads);
    int64_t rows_per_item = B * Hkv / (16 * threads);
    rows_per_item = rows_per_item > KVQ_ATTEND_ROWS ? KVQ_ATTEND_ROWS : rows_per_item;
    rows_per_item = rows_per_item > fit ? fit : rows_per_item < 1 ? 1 : rows_per_item;
    int64_t count = 0;
    for (int64_t r = 0; r < B;) {
        int64_t end = r + 1;
        while (end < B && same_sequence(block_table, max_blocks, end - 1, end)
               && (skip == NULL || skip[end] == skip[r])) end++;
        if (skip != NULL && skip[r]) {  /* rows another kernel took */
            r = end;
            continue;
        }
        if (end == r + 1 && all_heads) {
            buffer[count++] = (attention_item){(int32_t)r, (int32_t)end, 0, (int32_t)Hkv};
        } else {
            for (int64_t a = r; a < end; a += rows_per_item)
                for (int64_t kvh = 0; kvh < Hkv; kvh++)
                    buffer[count++] = (attention_item){(int32_t)a, (int32_t)(a + rows_per_item < end ? a + rows_per_item : end),
                                                       (int32_t)kvh, (int32_t)kvh + 1};
        }
        r = end;
    }
    *out = buffer;
    return count;
}

/* ---- a prompt's rows attend on AMX-BF16 ------------------------------------
 *
 * A prompt's positions are many query rows over the same keys, where the row
 * kernel above does a dot product and a horizontal sum per (row, key): about
 * a third of a 256-token prefill step on the default model. The rows from the
 * caller's prompt_from on (the rows the bfloat16 prompt tiles take) multiply
 * on AMX-BF16 tiles instead. Per sequence and KV head, its keys are packed
 * once in bfloat16 as the B tiles of Q K^T (16 keys x 32 dims) and its values
 * as those of P V (32 keys x 16 dims); then each 16 query rows of one query
 * head take their scores S = Q K^T (float32 sums), a softmax over each row's
 * own context (the row's maximum first, then exp: no rescaling), P rounded to
 * bfloat16, and O = P V / sum(P) with the sum of the rounded P.
 *
 * Each output row depends only on its own query, its context length and the
 * cache: a tile product's element is its A row against its B column; tiles
 * past a row's context hold P = 0, whose products add exact zeros; the max,
 * the exps and the sum run per row in a fixed order over absolute key
 * positions. So a prompt's tokens come out the same whichever rows share
 * their tile: in one chunk or several, alone or beside other requests.
 * Against the row kernel: Q, K, P and V are bfloat16 in the products (the
 * prompt tiles' activations already are); scores and sums stay float32. */

#ifdef KVQ_X86
/* Rows r0..r1-1 of one sequence; L its longest context; pack: where its
 * heads' packs start (uint16 elements), each head's K tiles then V tiles. */
typedef struct { int64_t r0, r1, L, pack; } prompt_seq;
/* Pack: seq, kvh, a 32-key tile (r0). Attend: seq, kvh, query rows r0..r1-1 (<= 16). */
typedef struct { int32_t seq, kvh, r0, r1; } prompt_item;

typedef struct {
    const void* q; int dtype; int64_t ldq; const char* cache; int cache_dtype;
    const int64_t *block_table, *context_lens;
    int64_t max_blocks, block_size, H, Hkv, D, DP; float scale; void* out;
    const prompt_seq* seqs; const prompt_item* items; uint16_t* packs;
    int* failed;  /* set where a thread's scratch could not be had */
} prompt_job;

/* Elements of one head's packs: K as Lp x DP (dims padded to 32), V as Lp x D. */
static int64_t head_pack_elems(int64_t L, int64_t D, int64_t DP) { return (L + 31) / 32 * 32 * (DP + D); }

/* 16 bfloat16 of a cache row (float32 and scaled int8 rounded as f32_to_bf16) at element i, as 16 dwords'
 * low halves. */
KVQ_AMX_BF16 static inline __m512i cache_bf16x16(const char* row, int cache_dtype, int64_t i) {
    if (cache_dtype == KVQ_BF16) return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i)));
    if (cache_dtype == KVQ_I8) return _mm512_cvtepu16_epi32(to_bf16x16_avx512(cache16_avx512(row, KVQ_I8, i)));
    return _mm512_cvtepu16_epi32(to_bf16x16_avx512(_mm512_loadu_ps((const float*)row + i)));
}

/* One 32-key tile of a sequence's head: its keys into the Q K^T B tiles
 * (tile kt, 32-dim chunk c: element [k2][n][j] = K[16 kt + n][32 c + 2 k2 + j])
 * and its values into the P V B tiles (tile t, 16-dim group g: element
 * [k2][n][j] = V[32 t + 2 k2 + j][16 g + n]); zeros past the context. */
KVQ_AMX_BF16 static void prompt_pack_chunk(const void* ctx, int64_t index) {
    const prompt_job* j = ctx;
    const prompt_item* it = j->items + index;
    const prompt_seq* s = j->seqs + it->seq;
    const int64_t D = j->D, DP = j->DP, Lp = (s->L + 31) / 32 * 32, t = it->r0, kvh = it->kvh;
    const size_t row_bytes = cache_row_bytes(j->cache_dtype, D), slot_bytes = 2 * (size_t)j->Hkv * row_bytes;
    const int64_t* blocks = j->block_table + s->r0 * j->max_blocks;
    uint16_t* kpack = j->packs + s->pack + kvh * head_pack_elems(s->L, D, DP);
    uint16_t* vpack = kpack + Lp * DP;
    const char* rows[32];
    for (int64_t n = 0; n < 32; n++) {
        const int64_t p = 32 * t + n;
        rows[n] = p < s->L ? j->cache + (size_t)(blocks[p / j->block_size] * j->block_size + p % j->block_size) * slot_bytes
                             + (size_t)kvh * row_bytes : NULL;
    }
    for (int64_t n = 0; n < 32; n++) {  /* keys: each key's dword pairs down a column of its tile */
        uint32_t* tile = (uint32_t*)(kpack + (2 * t + n / 16) * (DP / 32) * 512) + n % 16;
        for (int64_t d = 0; d < DP; d += 16) {
            uint32_t pairs[8];
            if (rows[n] != NULL && d < D)
                _mm256_storeu_si256((__m256i*)pairs, _mm512_cvtepi32_epi16(cache_bf16x16(rows[n], j->cache_dtype, d)));
            else
                memset(pairs, 0, sizeof pairs);
            for (int64_t k = 0; k < 8; k++) tile[((d / 32) * 16 + (d % 32) / 2 + k) * 16] = pairs[k];
        }
    }
    for (int64_t k2 = 0; k2 < 16; k2++) {  /* values: two keys interleaved per row of a tile */
        const char *a = rows[2 * k2], *b = rows[2 * k2 + 1];
        for (int64_t g = 0; g < D / 16; g++) {
            const __m512i lo = a ? cache_bf16x16(a + (size_t)j->Hkv * row_bytes, j->cache_dtype, 16 * g) : _mm512_setzero_si512();
            const __m512i hi = b ? cache_bf16x16(b + (size_t)j->Hkv * row_bytes, j->cache_dtype, 16 * g) : _mm512_setzero_si512();
            _mm512_storeu_si512(vpack + ((t * (D / 16) + g) * 16 + k2) * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* C tile c += A tile 4 (P) x B tile 5 or 6 (V's group g of key tile t); tile numbers are immediates. */
#define KVQ_PV(C, B)                                                            \
    do {                                                                        \
        _tile_loadd(B, vpack + (t * (D / 16) + g0 + C) * 512, 64);              \
        _tile_dpbf16ps(C, 4, B);                                                \
    } while (0)

/* Up to 16 query rows of one sequence, one KV head, each of its query heads in turn. */
KVQ_AMX_BF16 static void prompt_attend_chunk(const void* ctx, int64_t index) {
    static __thread void* scratch = NULL;
    static __thread int64_t capacity = 0;
    const prompt_job* j = ctx;
    const prompt_item* it = j->items + index;
    const prompt_seq* s = j->seqs + it->seq;
    const int64_t D = j->D, DP = j->DP, group = j->H / j->Hkv, Lp = (s->L + 31) / 32 * 32;
    const int64_t r0 = it->r0, n = it->r1 - it->r0;
    int64_t Lq = 0;
    for (int64_t i = 0; i < n; i++) Lq = j->context_lens[r0 + i] > Lq ? j->context_lens[r0 + i] : Lq;
    const int64_t nk16 = (Lq + 15) / 16, nk32 = (Lq + 31) / 32, width = nk32 * 32;
    uint16_t* qa = grown(&scratch, &capacity, 16 * DP * 2 + 16 * width * 4 + nk32 * 1024);
    if (qa == NULL) { __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED); return; }
    float* S = (float*)(qa + 16 * DP);
    uint16_t* pa = (uint16_t*)(S + 16 * width);
    const uint16_t* kpack = j->packs + s->pack + it->kvh * head_pack_elems(s->L, D, DP);
    const uint16_t* vpack = kpack + Lp * DP;
    float den[16], o[16][16] __attribute__((aligned(64)));
    const size_t xsz = j->dtype == KVQ_BF16 ? 2 : 4;
    amx_bf16_configure();
    for (int64_t qh = 0; qh < group; qh++) {
        const int64_t h = it->kvh * group + qh;
        for (int64_t i = 0; i < 16; i++) {  /* A tiles of Q: 16 rows x DP, scaled, rounded, zero-padded */
            for (int64_t d = 0; d < DP; d += 16) {
                __m512 v = _mm512_setzero_ps();
                if (i < n && d < D)
                    v = _mm512_mul_ps(load16_avx512((const char*)j->q + (size_t)(r0 + i) * j->ldq * xsz, j->dtype,
                                                    h * D + d), _mm512_set1_ps(j->scale));
                _mm256_storeu_si256((__m256i*)(qa + i * DP + d), to_bf16x16_avx512(v));
            }
        }
        for (int64_t kt = 0; kt < nk16; kt++) {  /* S = Q K^T, 16 keys at a time */
            _tile_zero(0);
            for (int64_t c = 0; c < DP / 32; c++) {
                _tile_loadd(4, qa + 32 * c, DP * 2);
                _tile_loadd(5, kpack + (kt * (DP / 32) + c) * 512, 64);
                _tile_dpbf16ps(0, 4, 5);
            }
            _tile_stored(0, S + 16 * kt, width * 4);
        }
        for (int64_t i = 0; i < 16; i++) {  /* P: each row's softmax numerators over its own context */
            if (i >= n) {
                for (int64_t t = 0; t < nk32; t++) memset(pa + t * 512 + i * 32, 0, 64);
                continue;
            }
            const int64_t L = j->context_lens[r0 + i];
            const float* srow = S + i * width;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t k0 = 0; k0 < L; k0 += 16) {
                const __mmask16 live = L - k0 >= 16 ? 0xffff : (__mmask16)((1u << (L - k0)) - 1);
                mx = _mm512_mask_max_ps(mx, live, mx, _mm512_maskz_loadu_ps(live, srow + k0));
            }
            const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t k0 = 0; k0 < width; k0 += 16) {
                const int64_t left = L - k0;
                const __mmask16 live = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
                const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpos_avx512(
                    _mm512_sub_ps(_mm512_maskz_loadu_ps(live, srow + k0), shift)));
                const __m256i p = to_bf16x16_avx512(e);
                _mm256_storeu_si256((__m256i*)(pa + (k0 / 32) * 512 + i * 32 + k0 % 32), p);
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(p), 16)));
            }
            den[i] = _mm512_reduce_add_ps(sum);
        }
        for (int64_t g0 = 0; g0 < D / 16; g0 += 4) {  /* O = P V, four 16-dim groups at a time */
            const int64_t groups = D / 16 - g0 < 4 ? D / 16 - g0 : 4;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t t = 0; t < nk32; t++) {
                _tile_loadd(4, pa + t * 512, 64);
                KVQ_PV(0, 5);
                if (groups > 1) KVQ_PV(1, 6);
                if (groups > 2) KVQ_PV(2, 5);
                if (groups > 3) KVQ_PV(3, 6);
            }
            for (int64_t c = 0; c < groups; c++) {
                switch (c) {
                    case 0: _tile_stored(0, o, 64); break;
                    case 1: _tile_stored(1, o, 64); break;
                    case 2: _tile_stored(2, o, 64); break;
                    default: _tile_stored(3, o, 64); break;
                }
                for (int64_t i = 0; i < n; i++) {
                    const int64_t at = (r0 + i) * j->H * D + h * D + 16 * (g0 + c);
                    const __m512 v = _mm512_div_ps(_mm512_load_ps(o[i]), _mm512_set1_ps(den[i]));
                    if (j->dtype == KVQ_BF16) _mm256_storeu_si256((__m256i*)((uint16_t*)j->out + at), to_bf16x16_avx512(v));
                    else _mm512_storeu_ps((float*)j->out + at, v);
                }
            }
        }
    }
    _tile_release();
}
#undef KVQ_PV

/* Whether rows a and b are one sequence's (the same blocks: rows of two
 * sequences that share a cached prefix are not). */
static int same_blocks(const int64_t* block_table, int64_t max_blocks, int64_t a, int64_t b) {
    return memcmp(block_table + a * max_blocks, block_table + b * max_blocks, (size_t)max_blocks * 8) == 0;
}

/* Whether prompt_attention runs this head shape here (D <= KVQ_MAX_D: the caller checked). */
static int prompt_attention_takes(int64_t D) {
    return kvq_has_amx_bf16() && !g_force_scalar && D % 16 == 0;
}

/* Rows r0..B-1 of kvq_decode_attention's arguments (the output row r at
 * out + r * H * D); 0, or -1 where scratch could not be had (then some rows
 * may be unwritten). */
static int prompt_attention(const void* q, int dtype, int64_t ldq, const void* cache, int cache_dtype,
                            const int64_t* block_table, int64_t max_blocks, const int64_t* context_lens,
                            int64_t block_size, int64_t r0, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                            float scale, void* out, int num_threads) {
    static __thread void *seq_buf = NULL, *item_buf = NULL, *pack_buf = NULL;
    static __thread int64_t seq_cap = 0, item_cap = 0, pack_cap = 0;
    const int64_t DP = (D + 31) / 32 * 32, rows = B - r0;
    prompt_seq* seqs = grown(&seq_buf, &seq_cap, rows * (int64_t)sizeof(prompt_seq));
    if (seqs == NULL) return -1;
    int64_t num_seqs = 0, pack_elems = 0, num_pack = 0, num_attend = 0;
    for (int64_t r = r0; r < B;) {
        int64_t end = r + 1, L = context_lens[r];
        while (end < B && same_blocks(block_table, max_blocks, end - 1, end)) {
            L = context_lens[end] > L ? context_lens[end] : L;
            end++;
        }
        seqs[num_seqs++] = (prompt_seq){r, end, L, pack_elems};
        pack_elems += Hkv * head_pack_elems(L, D, DP);
        num_pack += Hkv * ((L + 31) / 32);
        num_attend += Hkv * ((end - r + 15) / 16);
        r = end;
    }
    prompt_item* items = grown(&item_buf, &item_cap, (num_pack + num_attend) * (int64_t)sizeof(prompt_item));
    uint16_t* packs = grown(&pack_buf, &pack_cap, pack_elems * 2);
    if (items == NULL || packs == NULL) return -1;
    int64_t count = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t kvh = 0; kvh < Hkv; kvh++)
            for (int64_t t = 0; t < (seqs[s].L + 31) / 32; t++) items[count++] = (prompt_item){(int32_t)s, (int32_t)kvh, (int32_t)t, 0};
    /* Attend items, the last rows (the longest contexts) first: the threads end together. */
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t end = seqs[s].r1; end > seqs[s].r0;) {
            const int64_t start = end - 16 > seqs[s].r0 ? end - 16 : seqs[s].r0;
            for (int64_t kvh = 0; kvh < Hkv; kvh++)
                items[count++] = (prompt_item){(int32_t)s, (int32_t)kvh, (int32_t)start, (int32_t)end};
            end = start;
        }
    int failed = 0;
    prompt_job j = {q, dtype, ldq, (const char*)cache, cache_dtype, block_table, context_lens, max_blocks, block_size,
                    H, Hkv, D, DP, scale, out, seqs, items, packs, &failed};
    parallel_chunks(num_threads, num_pack, prompt_pack_chunk, &j);
    j.items = items + num_pack;
    parallel_chunks(num_threads, num_attend, prompt_attend_chunk, &j);
    return failed ? -1 : 0;
}
#endif

/* ---- a run of rows attends across vector lanes (AVX-512) -------------------
 *
 * The row kernel takes one query row at a time: per (row, key) D/16 FMAs and
 * a horizontal sum, and a prompt is many rows over the same keys (~20% of a
 * 256-token prefill on a CPU without AMX, ~3/5 of a 2,048-token one). Here
 * 16 queries of one KV head sit in the 16 lanes of a vector: a run's rows
 * times that head's query heads, row-major (query i: row i / group, head
 * i % group), so the scores of one key for all 16 are D FMAs, each key
 * element broadcast from memory, and P V is the same with each value element
 * broadcast: no horizontal sums, and every FMA does 16 queries' work.
 *
 * Per run and KV head, the keys and values are first copied to float32, row
 * after row (the pack), so every item of the run reads them in order; then
 * each item of 16 queries runs the softmax online over 32-key tiles at
 * absolute positions (0, 32, ...). Every lane by itself: masked past its own
 * context, left untouched by a tile that holds none of its keys. So a query's
 * result depends only on its own row, its context and the cache, whichever
 * queries share its vector or its run. Float32 throughout, as the row kernel
 * (the same values up to summation order). */

#ifdef KVQ_X86
/* The rows of a 16 x 16 block of floats become its columns: r[c] holds
 * element c of the 16 input rows, in their order. */
KVQ_AVX512 void transpose16_avx512(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* per 128-bit lane L: r[i + c] holds column 4L + c of rows i..i+3 */
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {  /* gather the four 128-bit lanes of each column */
        const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
        t[c] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        t[8 + c] = _mm512_shuffle_f32x4(u0, u2, 0xdd);
        t[12 + c] = _mm512_shuffle_f32x4(u1, u3, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* A run: rows r0..r1-1 of one sequence, L its longest context; pack: where
 * its heads' float32 K and V start (floats), each head's K (Lp x D) then V. */
typedef struct { int64_t r0, r1, L, pack; } lane_run;
/* Pack: run, kvh, a 32-key tile (q0). Attend: run, kvh, queries q0..q0+nq-1 (<= 16). */
typedef struct { int32_t run, kvh, q0, nq; } lane_item;

typedef struct {
    const void* q; int dtype; int64_t ldq; const char* cache; int cache_dtype;
    const int64_t *block_table, *context_lens;
    int64_t max_blocks, block_size, H, Hkv, D; float scale; void* out;
    const lane_run* runs; const lane_item* items; float* packs;
    int* failed;  /* set where a thread's scratch could not be had */
} lane_job;

static int64_t lane_pack_floats(int64_t L, int64_t D) { return (L + KVQ_TILE - 1) / KVQ_TILE * KVQ_TILE * 2 * D; }

/* The float32 copies of a step's runs of rows before prompt_from may take
 * (a thread's scratch, kept): the default model's 3 KV heads of 64 fit
 * ~43,000 positions, 8 KV heads of 128 ~8,000. A run that would pass it
 * stays on the row kernel rather than hold hundreds of MB. */
#ifndef KVQ_LANE_PACK_MAX_BYTES
#define KVQ_LANE_PACK_MAX_BYTES ((int64_t)64 << 20)
#endif

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
static void lane_pack_chunk(const void* ctx, int64_t index) {
    const lane_job* j = ctx;
    const lane_item* it = j->items + index;
    const lane_run* s = j->runs + it->run;
    const int64_t D = j->D, Lp = (s->L + KVQ_TILE - 1) / KVQ_TILE * KVQ_TILE;
    const size_t row_bytes = cache_row_bytes(j->cache_dtype, D), slot_bytes = 2 * (size_t)j->Hkv * row_bytes;
    const int64_t* blocks = j->block_table + s->r0 * j->max_blocks;
    float* kpack = j->packs + s->pack + it->kvh * lane_pack_floats(s->L, D);
    float* vpack = kpack + Lp * D;
    const int64_t p1 = it->q0 + KVQ_TILE < s->L ? it->q0 + KVQ_TILE : s->L;
    for (int64_t p = it->q0; p < p1; p++) {
        const char* krow = j->cache + (size_t)(blocks[p / j->block_size] * j->block_size + p % j->block_size) * slot_bytes
                           + (size_t)it->kvh * row_bytes;
        const char* vrow = krow + (size_t)j->Hkv * row_bytes;
        for (int64_t d = 0; d < D; d += 16) {
            _mm512_storeu_ps(kpack + p * D + d, cache16_avx512(krow, j->cache_dtype, d));
            _mm512_storeu_ps(vpack + p * D + d, cache16_avx512(vrow, j->cache_dtype, d));
        }
    }
}

/* Up to 16 queries of one run and KV head. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
static void lane_attend_chunk(const void* ctx, int64_t index) {
    static __thread void* scratch = NULL;
    static __thread int64_t capacity = 0;
    const lane_job* j = ctx;
    const lane_item* it = j->items + index;
    const lane_run* s = j->runs + it->run;
    const int64_t D = j->D, group = j->H / j->Hkv, nq = it->nq, Lp = (s->L + KVQ_TILE - 1) / KVQ_TILE * KVQ_TILE;
    float* qt = grown(&scratch, &capacity, (2 * D + KVQ_TILE) * 16 * (int64_t)sizeof(float));
    if (qt == NULL) { __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED); return; }
    float *ot = qt + 16 * D, *pt = ot + 16 * D;  /* Q^T and O^T: [D][16 lanes]; scores then P: [tile][16 lanes] */
    const float* kpack = j->packs + s->pack + it->kvh * lane_pack_floats(s->L, D);
    const float* vpack = kpack + Lp * D;
    const size_t xsz = j->dtype == KVQ_BF16 ? 2 : 4;
    int64_t row[16], head[16];
    int32_t lens[16];
    int64_t Lq = 0;
    for (int64_t i = 0; i < 16; i++) {
        const int64_t query = it->q0 + (i < nq ? i : 0);
        row[i] = s->r0 + query / group;
        head[i] = it->kvh * group + query % group;
        lens[i] = i < nq ? (int32_t)j->context_lens[row[i]] : 0;
        Lq = lens[i] > Lq ? lens[i] : Lq;
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {  /* Q^T, scaled */
        __m512 r[16];
        for (int64_t i = 0; i < 16; i++)
            r[i] = _mm512_mul_ps(load16_avx512((const char*)j->q + (size_t)row[i] * j->ldq * xsz, j->dtype,
                                               head[i] * D + d0), _mm512_set1_ps(j->scale));
        transpose16_avx512(r);
        for (int64_t c = 0; c < 16; c++) _mm512_store_ps(qt + (d0 + c) * 16, r[c]);
    }
    for (int64_t i = 0; i < 16 * D; i += 16) _mm512_store_ps(ot + i, _mm512_setzero_ps());
    const __m512i lanes_len = _mm512_loadu_si512(lens);
    __m512 mx = _mm512_set1_ps(-INFINITY), den = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < Lq; p0 += KVQ_TILE) {
        const int64_t n = Lq - p0 < KVQ_TILE ? Lq - p0 : KVQ_TILE;
        __mmask16 live[KVQ_TILE];  /* per key: the lanes whose context holds it */
        for (int64_t t = 0; t < n; t++) live[t] = _mm512_cmplt_epi32_mask(_mm512_set1_epi32((int32_t)(p0 + t)), lanes_len);
        for (int64_t t0 = 0; t0 < n; t0 += 8) {  /* scores, 8 keys at a time (past n: key t0's row again) */
            const float* k[8];
            for (int64_t u = 0; u < 8; u++) k[u] = kpack + (p0 + (t0 + u < n ? t0 + u : t0)) * D;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < D; d++) {
                const __m512 qv = _mm512_load_ps(qt + d * 16);
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(k[0][d]), qv, a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(k[1][d]), qv, a1);
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(k[2][d]), qv, a2);
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(k[3][d]), qv, a3);
                a4 = _mm512_fmadd_ps(_mm512_set1_ps(k[4][d]), qv, a4);
                a5 = _mm512_fmadd_ps(_mm512_set1_ps(k[5][d]), qv, a5);
                a6 = _mm512_fmadd_ps(_mm512_set1_ps(k[6][d]), qv, a6);
                a7 = _mm512_fmadd_ps(_mm512_set1_ps(k[7][d]), qv, a7);
            }
            const __m512 a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
            for (int64_t u = 0; u < 8 && t0 + u < n; u++) _mm512_store_ps(pt + (t0 + u) * 16, a[u]);
        }
        /* The online softmax, lane by lane: only lanes with a key in this tile
         * (live[0]: position p0 is the tile's first) change. */
        __m512 tile_max = mx;
        for (int64_t t = 0; t < n; t++) tile_max = _mm512_mask_max_ps(tile_max, live[t], tile_max, _mm512_load_ps(pt + t * 16));
        const __mmask16 any = live[0];
        const __m512 corr = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), any,
                                               exp_nonpos_avx512(_mm512_maskz_sub_ps(any, mx, tile_max)));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m512 e = _mm512_maskz_mov_ps(live[t], exp_nonpos_avx512(
                _mm512_maskz_sub_ps(live[t], _mm512_load_ps(pt + t * 16), tile_max)));
            _mm512_store_ps(pt + t * 16, e);
            sum = _mm512_add_ps(sum, e);
        }
        den = _mm512_mask_fmadd_ps(den, any, corr, sum);
        mx = _mm512_mask_mov_ps(mx, any, tile_max);
        for (int64_t d0 = 0; d0 < D; d0 += 16) {  /* O^T = O^T corr + V^T P, 16 dims at a time */
            __m512 o[16];
            for (int64_t c = 0; c < 16; c++) o[c] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + c) * 16), corr);
            for (int64_t t = 0; t < n; t++) {
                const __m512 p = _mm512_load_ps(pt + t * 16);
                const float* v = vpack + (p0 + t) * D + d0;
                for (int64_t c = 0; c < 16; c++) o[c] = _mm512_mask3_fmadd_ps(_mm512_set1_ps(v[c]), p, o[c], live[t]);
            }
            for (int64_t c = 0; c < 16; c++) _mm512_store_ps(ot + (d0 + c) * 16, o[c]);
        }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {  /* O = O^T / den, back to rows */
        __m512 r[16];
        for (int64_t c = 0; c < 16; c++) r[c] = _mm512_div_ps(_mm512_load_ps(ot + (d0 + c) * 16), den);
        transpose16_avx512(r);
        for (int64_t i = 0; i < nq; i++) {
            const int64_t at = row[i] * j->H * D + head[i] * D + d0;
            if (j->dtype == KVQ_BF16) _mm256_storeu_si256((__m256i*)((uint16_t*)j->out + at), to_bf16x16_avx512(r[i]));
            else _mm512_storeu_ps((float*)j->out + at, r[i]);
        }
    }
}

/* Whether the lane kernel runs here: AVX-512 (matmul_isa()'s VNNI level) and a head of whole vectors. */
static int lane_attention_takes(int64_t D) { return matmul_isa() == 3 && D % 16 == 0; }

/* The runs across lanes (their float32 copies pack_floats in all); 0, or -1
 * where scratch could not be had. */
static int lane_attention(const void* q, int dtype, int64_t ldq, const void* cache, int cache_dtype,
                          const int64_t* block_table, int64_t max_blocks, const int64_t* context_lens,
                          int64_t block_size, const lane_run* runs, int64_t num_runs, int64_t pack_floats,
                          int64_t H, int64_t Hkv, int64_t D, float scale, void* out, int num_threads) {
    static __thread void *item_buf = NULL, *pack_buf = NULL;
    static __thread int64_t item_cap = 0, pack_cap = 0;
    const int64_t group = H / Hkv;
    int64_t num_pack = 0, num_attend = 0;
    for (int64_t s = 0; s < num_runs; s++) {
        num_pack += Hkv * ((runs[s].L + KVQ_TILE - 1) / KVQ_TILE);
        num_attend += Hkv * (((runs[s].r1 - runs[s].r0) * group + 15) / 16);
    }
    lane_item* items = grown(&item_buf, &item_cap, (num_pack + num_attend) * (int64_t)sizeof(lane_item));
    float* packs = grown(&pack_buf, &pack_cap, pack_floats * (int64_t)sizeof(float));
    if (items == NULL || packs == NULL) return -1;
    int64_t count = 0;
    for (int64_t s = 0; s < num_runs; s++)
        for (int64_t kvh = 0; kvh < Hkv; kvh++)
            for (int64_t p = 0; p < runs[s].L; p += KVQ_TILE) items[count++] = (lane_item){(int32_t)s, (int32_t)kvh, (int32_t)p, 0};
    /* Attend items, the last queries (the longest contexts) first: the threads end together. */
    for (int64_t s = 0; s < num_runs; s++) {
        const int64_t queries = (runs[s].r1 - runs[s].r0) * group;
        for (int64_t q0 = (queries - 1) / 16 * 16; q0 >= 0; q0 -= 16)
            for (int64_t kvh = 0; kvh < Hkv; kvh++)
                items[count++] = (lane_item){(int32_t)s, (int32_t)kvh, (int32_t)q0,
                                             (int32_t)(queries - q0 < 16 ? queries - q0 : 16)};
    }
    int failed = 0;
    lane_job j = {q, dtype, ldq, (const char*)cache, cache_dtype, block_table, context_lens, max_blocks, block_size,
                  H, Hkv, D, scale, out, runs, items, packs, &failed};
    parallel_chunks(num_threads, num_pack, lane_pack_chunk, &j);
    j.items = items + num_pack;
    parallel_chunks(num_threads, num_attend, lane_attend_chunk, &j);
    return failed ? -1 : 0;
}
#endif

/* prompt_from: rows from it on are a prompt's positions (the rows the
 * bfloat16 prompt tiles take; B: none), which attend on AMX-BF16 where the
 * CPU has it (prompt_attention), else across lanes where it has AVX-512
 * (lane_attention). Of the rows before it, a run of one sequence's rows at
 * least run_min_rows long (a prompt's chunk in a step built in chunk order)
 * attends across lanes too where the CPU has AVX-512 (run_min_rows 0: none,
 * so each such row's bits do not depend on the length of its run); the
 * others row by row.
 * 0 when the shapes fit the kernel's fixed buffers, else -1 (nothing written;
 * also where the prompt rows' scratch could not be had). */
int kvq_decode_attention(const void* q, int dtype, int64_t ldq, const void* cache, int cache_dtype,
                         const int64_t* block_table, int64_t max_blocks, const int64_t* context_lens,
                         int64_t block_size, int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale, void* out,
                         int num_threads, int64_t prompt_from, int64_t run_min_rows) {
    if (H / Hkv > KVQ_MAX_GROUP || D > KVQ_MAX_D) return -1;
    const uint8_t* skip = NULL;  /* rows another kernel took */
#ifdef KVQ_X86
    prompt_from = prompt_from < 0 ? 0 : prompt_from > B ? B : prompt_from;
    if (prompt_from < B && prompt_attention_takes(D)) {
        if (prompt_attention(q, dtype, ldq, cache, cache_dtype, block_table, max_blocks, context_lens, block_size,
                             prompt_from, B, H, Hkv, D, scale, out, num_threads)) return -1;
        B = prompt_from;
        if (B == 0) return 0;
    }
    if (lane_attention_takes(D)) {
        static __thread void *take_buf = NULL, *run_buf = NULL;
        static __thread int64_t take_cap = 0, run_cap = 0;
        uint8_t* take = grown(&take_buf, &take_cap, B);
        lane_run* runs = grown(&run_buf, &run_cap, B * (int64_t)sizeof(lane_run));
        if (take == NULL || runs == NULL) return -1;
        int64_t taken = 0, num_runs = 0, pack_floats = 0;
        for (int64_t r = 0; r < B;) {  /* runs on either side of prompt_from, each by itself */
            const int64_t bound = r < prompt_from ? prompt_from : B;
            int64_t end = r + 1, L = context_lens[r];
            while (end < bound && same_blocks(block_table, max_blocks, end - 1, end)) {
                L = context_lens[end] > L ? context_lens[end] : L;
                end++;
            }
            const int64_t floats = Hkv * lane_pack_floats(L, D);
            const uint8_t lanes = r >= prompt_from || (run_min_rows > 0 && end - r >= run_min_rows &&
                                                       (pack_floats + floats) * (int64_t)sizeof(float)
                                                           <= KVQ_LANE_PACK_MAX_BYTES);
            memset(take + r, lanes, (size_t)(end - r));
            if (lanes) {
                runs[num_runs++] = (lane_run){r, end, L, pack_floats};
                pack_floats += floats;
                taken += end - r;
            }
            r = end;
        }
        if (taken > 0) {
            if (lane_attention(q, dtype, ldq, cache, cache_dtype, block_table, max_blocks, context_lens, block_size,
                               runs, num_runs, pack_floats, H, Hkv, D, scale, out, num_threads)) return -1;
            if (taken == B) return 0;
            skip = take;
        }
    }
#else
    (void)prompt_from; (void)run_min_rows;
#endif
    attention_item* items = NULL;
    const int64_t num_items = attention_items(block_table, max_blocks, B, skip, H, Hkv, D, num_threads, &items);
    if (num_items < 0) return -1;
    attention_job j = {q, dtype, ldq, cache, cache_dtype, block_table, context_lens, max_blocks, block_size, H, Hkv,
                       D, scale, out, matmul_isa(), B, items};
    /* Below ~1,000 positions in all, one (sequence, head) takes microseconds: no helpers. */
    int64_t positions = 0;
    for (int64_t b = 0; b < B; b++) positions += skip != NULL && skip[b] ? 0 : context_lens[b];
    parallel_chunks(positions * Hkv < 1024 ? 1 : num_threads, num_items, attend_chunk, &j);
    return 0;
}

/* ---- a decode step's layers in one call ------------------------------------ */

/* One decoder layer's weights (packed, ggml type ids) and its KV cache. */
typedef struct {
    const uint8_t *qkv, *o, *gate_up, *down;
    int qkv_type, o_type, gate_up_type, down_type;
    const void *input_norm, *post_norm;  /* [hidden], the activations' dtype */
    void* kv_cache;                      /* [slots, 2, Hkv, D] */
    /* The same four as kvq_matmul_bf16's packed bfloat16 tiles, for the rows
     * from kvq_decode_layers' tiles_from on (NULL: every row quantized). */
    const uint16_t *qkv_bf16, *o_bf16, *gate_up_bf16, *down_bf16;
} kvq_layer;

/* kvq_matmul over rows 0 .. split - 1 and kvq_matmul_bf16 over split .. M - 1,
 * split = tiles_from where the bfloat16 tiles wp exist, else M. */
static int split_matmul(int wtype, const uint8_t* w, const uint16_t* wp, int64_t tiles_from, int64_t N, int64_t K,
                        const void* x, int xtype, int64_t ldx, int xop, const void* norm_w, float eps, int64_t M,
                        void* y, int ytype, int64_t ldy, const void* add, int addtype, int64_t ldadd,
                        int num_threads) {
    const int64_t split = wp == NULL || tiles_from >= M ? M : tiles_from < 0 ? 0 : tiles_from;
    if (split > 0) {
        int status = kvq_matmul(wtype, w, N, K, x, xtype, ldx, xop, norm_w, eps, split, y, ytype, ldy, add, addtype,
                                ldadd, num_threads);
        if (status != 0 || split == M) return status;
    }
    const size_t xsz = xtype == KVQ_BF16 ? 2 : 4, ysz = ytype == KVQ_BF16 ? 2 : 4, asz = addtype == KVQ_BF16 ? 2 : 4;
    return kvq_matmul_bf16(wp, N, K, (const char*)x + split * ldx * xsz, xtype, ldx, xop, norm_w, eps, M - split,
                           (char*)y + split * ldy * ysz, ytype, ldy,
                           add ? (const char*)add + split * ldadd * asz : NULL, addtype, ldadd, num_threads);
}

/* ---- LoRA adapters in the decode step -------------------------------------- */

/* One fused linear's resident adapters (model/lora._GroupStack's packed
 * panels), bfloat16, laid out so each pass of the update reads its panel
 * front to back (tiles(n) = ceil(n / 16); rank = ranks[s * num_targets + j],
 * 0: not targeted):
 *   A of slot s, target j: tiles(max_rank) tiles of [in][16] at
 *     a + (s * num_targets + j) * tiles(max_rank) * 16 * in; tile q holds
 *     rank columns 16q .. 16q + 15 (zero past the rank);
 *   B of slot s, target j: tiles(out_j) tiles of [rank][16] at
 *     b + max_rank * 16 * (s * sum_u tiles(out_u) + sum_{u < j} tiles(out_u)),
 *     tile q at q * rank * 16 holding the target's output columns 16q ..
 *     16q + 15 (zero past out_j);
 * target j's outputs are columns out_offsets[j] .. out_offsets[j + 1] of the
 * fused linear; scaling is folded into B. width = num_targets * max_rank is
 * the stride of the shrunk rows (x A, target j's at j * max_rank). */
#define KVQ_LORA_MAX_TARGETS 3
typedef struct {
    const uint16_t *a, *b;
    const int64_t* ranks;  /* [slots, num_targets] */
    int64_t in, out, width, max_rank, num_targets;
    int64_t out_offsets[KVQ_LORA_MAX_TARGETS + 1];
} kvq_lora_linear;

/* A step's adapter rows: `segments` of at most KVQ_LORA_SEG_ROWS tokens
 * that share one slot (grouped by slot), as (slot, first, end) into `rows`,
 * the step's token indices; tokens on the base model are in no segment. */
#define KVQ_LORA_SEG_ROWS 8
typedef struct {
    const kvq_lora_linear* linears;  /* [num_layers][4]: qkv, o, gate_up, down */
    const int64_t* rows;             /* [num_rows] */
    const int64_t* segments;         /* [num_segments][3] */
    int64_t num_rows, num_segments;
} kvq_lora_step;

enum { KVQ_LORA_PORTABLE = 0, KVQ_LORA_AVX2 = 2, KVQ_LORA_AVX512 = 4 };

typedef struct {
    const kvq_lora_step* step;
    const kvq_lora_linear* lin;
    const void* x; int xtype; int64_t ldx; int xop; const void* norm_w; float eps;
    void* y; int ytype; int64_t ldy;
    float *xs, *shrunk;  /* [num_rows, in], [num_rows, width]: by position in `rows` */
    int isa;             /* KVQ_LORA_* */
} lora_job;

static inline int64_t lora_tiles(int64_t n) { return (n + 15) / 16; }

static const uint16_t* lora_a_panel(const kvq_lora_linear* L, int64_t slot, int64_t t) {
    return L->a + (slot * L->num_targets + t) * lora_tiles(L->max_rank) * 16 * L->in;
}

static const uint16_t* lora_b_panel(const kvq_lora_linear* L, int64_t slot, int64_t t) {
    int64_t before = 0, all = 0;
    for (int64_t u = 0; u < L->num_targets; u++) {
        const int64_t n = lora_tiles(L->out_offsets[u + 1] - L->out_offsets[u]);
        before += u < t ? n : 0;
        all += n;
    }
    return L->b + (slot * all + before) * L->max_rank * 16;
}

/* Every path sums in the same order: two partial sums, over the even and the
 * odd steps of the reduction (k of the input, c of the rank), ascending, then
 * even + odd (two chains halve the wait on FMA latency with few rows); the
 * SIMD paths fuse each multiply-add, the portable C rounds twice. */

/* shrunk[r, c] = sum_k xs[r, k] A[k, c] for c < rank, m rows (xs stride in, shrunk stride width). */
static void lora_shrink_portable(const uint16_t* a, int64_t in, int64_t rank, const float* xs, int64_t m,
                                 float* shrunk, int64_t width) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < rank; c++) {
            const uint16_t* ac = a + (c / 16) * in * 16 + c % 16;
            float even = 0.f, odd = 0.f;
            int64_t k = 0;
            for (; k + 1 < in; k += 2) {
                even += xs[r * in + k] * bf16_to_f32(ac[16 * k]);
                odd += xs[r * in + k + 1] * bf16_to_f32(ac[16 * (k + 1)]);
            }
            if (k < in) even += xs[r * in + k] * bf16_to_f32(ac[16 * k]);
            shrunk[r * width + c] = even + odd;
        }
}

/* y[rows[r], n0 + n] += sum_c shrunk[r, c] B[c, n] for n < out_cols, m rows. */
static void lora_expand_portable(const uint16_t* b, int64_t rank, const float* shrunk, int64_t width,
                                 int64_t out_cols, const int64_t* rows, int64_t m, void* y, int ytype, int64_t ldy,
                                 int64_t n0) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t n = 0; n < out_cols; n++) {
            const uint16_t* bn = b + (n / 16) * rank * 16 + n % 16;
            float even = 0.f, odd = 0.f;
            int64_t c = 0;
            for (; c + 1 < rank; c += 2) {
                even += shrunk[r * width + c] * bf16_to_f32(bn[16 * c]);
                odd += shrunk[r * width + c + 1] * bf16_to_f32(bn[16 * (c + 1)]);
            }
            if (c < rank) even += shrunk[r * width + c] * bf16_to_f32(bn[16 * c]);
            const int64_t at = rows[r] * ldy + n0 + n;
            store_y(y, ytype, at, load_x(y, ytype, at) + (even + odd));
        }
}

#ifdef KVQ_X86
/* The portable loops ran at ~17 GFLOP/s with the partial sums in memory; the
 * f32 register tiles that followed read [in, width] and [width, out] float32
 * stacks a 64-byte piece per row (A) and 16 short streams (B) at ~14 GB/s,
 * a third of one core's streaming read here (42 GB/s). These tiles read the
 * packed bf16 panels front to back, widened to float32 in registers. */

KVQ_AVX2 __m256 lora_bf16x8_avx2(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* 8 columns of a panel tile (rows of 16 bf16, `depth` of them) times MR <= 4
 * rows of src (row r at src + r * stride): out[r][j] = sum over k of
 * src[r * stride + k] * tile[k][j]. The shrink (x A: depth in, src x) and the
 * expand ((x A) B: depth rank, src the shrunk values) are both this. */
KVQ_AVX2 void lora_panel_tile_avx2(const uint16_t* tile, int64_t depth, const float* src, int64_t stride,
                                   float out[4][8], const int MR) {
    __m256 even[4], odd[4];
    for (int r = 0; r < MR; r++) even[r] = odd[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 1 < depth; k += 2) {
        const __m256 t0 = lora_bf16x8_avx2(tile + 16 * k), t1 = lora_bf16x8_avx2(tile + 16 * (k + 1));
        for (int r = 0; r < MR; r++) {
            even[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(src + r * stride + k), t0, even[r]);
            odd[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(src + r * stride + k + 1), t1, odd[r]);
        }
    }
    if (k < depth) {
        const __m256 t0 = lora_bf16x8_avx2(tile + 16 * k);
        for (int r = 0; r < MR; r++)
            even[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(src + r * stride + k), t0, even[r]);
    }
    for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], _mm256_add_ps(even[r], odd[r]));
}

__attribute__((target("avx2,fma,f16c")))
static void lora_shrink_avx2(const uint16_t* a, int64_t in, int64_t rank, const float* xs, int64_t m, float* shrunk,
                             int64_t width) {
    float out[4][8];
    for (int64_t r = 0; r < m; r += 4)
        for (int64_t c = 0; c < rank; c += 8) {
            const uint16_t* at = a + (c / 16) * in * 16 + c % 16;
            const int mr = m - r < 4 ? (int)(m - r) : 4;
            switch (mr) {
                case 4: lora_panel_tile_avx2(at, in, xs + r * in, in, out, 4); break;
                case 3: lora_panel_tile_avx2(at, in, xs + r * in, in, out, 3); break;
                case 2: lora_panel_tile_avx2(at, in, xs + r * in, in, out, 2); break;
                default: lora_panel_tile_avx2(at, in, xs + r * in, in, out, 1); break;
            }
            for (int i = 0; i < mr; i++)
                for (int64_t n = 0; n < 8 && c + n < rank; n++) shrunk[(r + i) * width + c + n] = out[i][n];
        }
}

__attribute__((target("avx2,fma,f16c")))
static void lora_expand_avx2(const uint16_t* b, int64_t rank, const float* shrunk, int64_t width, int64_t out_cols,
                             const int64_t* rows, int64_t m, void* y, int ytype, int64_t ldy, int64_t n0) {
    float out[4][8];
    for (int64_t r = 0; r < m; r += 4)
        for (int64_t n = 0; n < out_cols; n += 8) {
            const uint16_t* bt = b + (n / 16) * rank * 16 + n % 16;
            const int mr = m - r < 4 ? (int)(m - r) : 4;
            switch (mr) {
                case 4: lora_panel_tile_avx2(bt, rank, shrunk + r * width, width, out, 4); break;
                case 3: lora_panel_tile_avx2(bt, rank, shrunk + r * width, width, out, 3); break;
                case 2: lora_panel_tile_avx2(bt, rank, shrunk + r * width, width, out, 2); break;
                default: lora_panel_tile_avx2(bt, rank, shrunk + r * width, width, out, 1); break;
            }
            for (int i = 0; i < mr; i++) {
                const int64_t at = rows[r + i] * ldy + n0 + n;
                if (ytype == KVQ_F32 && n + 8 <= out_cols) {
                    float* yr = (float*)y + at;
                    _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), _mm256_loadu_ps(out[i])));
                } else {  /* a tail, or bf16 (the scalar rounding, store_y) */
                    for (int64_t j = 0; j < 8 && n + j < out_cols; j++)
                        store_y(y, ytype, at + j, load_x(y, ytype, at + j) + out[i][j]);
                }
            }
        }
}

KVQ_AVX512 __m512 lora_bf16x16_avx512(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline __mmask16 lora_first16(int64_t n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1); }

/* A 16-column panel tile (rows of 16 bf16, `depth` of them) times MR <= 8
 * rows of src (row r at src + r * stride): sums[r][j] = sum over k of
 * src[r * stride + k] * tile[k][j], the shrink's (depth in) and the
 * expand's (depth rank) product alike. */
KVQ_AVX512 void lora_panel_sums_avx512(const uint16_t* tile, int64_t depth, const float* src, int64_t stride,
                                       __m512 sums[KVQ_LORA_SEG_ROWS], const int MR) {
    __m512 even[KVQ_LORA_SEG_ROWS], odd[KVQ_LORA_SEG_ROWS];
    for (int r = 0; r < MR; r++) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 1 < depth; k += 2) {
        const __m512 t0 = lora_bf16x16_avx512(tile + 16 * k), t1 = lora_bf16x16_avx512(tile + 16 * (k + 1));
        for (int r = 0; r < MR; r++) {
            even[r] = _mm512_fmadd_ps(_mm512_set1_ps(src[r * stride + k]), t0, even[r]);
            odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(src[r * stride + k + 1]), t1, odd[r]);
        }
    }
    if (k < depth) {
        const __m512 t0 = lora_bf16x16_avx512(tile + 16 * k);
        for (int r = 0; r < MR; r++) even[r] = _mm512_fmadd_ps(_mm512_set1_ps(src[r * stride + k]), t0, even[r]);
    }
    for (int r = 0; r < MR; r++) sums[r] = _mm512_add_ps(even[r], odd[r]);
}

/* One 16-column tile of MR <= 8 rows' shrunk values (the segment's rows in one pass: A read once). */
KVQ_AVX512 void lora_shrink_tile_avx512(const uint16_t* at, int64_t in, const float* xs, int64_t cols, float* out,
                                        int64_t width, const int MR) {
    __m512 sums[KVQ_LORA_SEG_ROWS];
    lora_panel_sums_avx512(at, in, xs, in, sums, MR);
    const __mmask16 mask = lora_first16(cols);
    for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(out + r * width, mask, sums[r]);
}

/* One 16-column tile of MR <= 8 rows' update, added into y. */
KVQ_AVX512 void lora_expand_tile_avx512(const uint16_t* bt, int64_t rank, const float* shrunk, int64_t width,
                                        int64_t cols, const int64_t* rows, void* y, int ytype, int64_t ldy,
                                        int64_t n, const int MR) {
    __m512 sums[KVQ_LORA_SEG_ROWS];
    lora_panel_sums_avx512(bt, rank, shrunk, width, sums, MR);
    const __mmask16 mask = lora_first16(cols);
    for (int r = 0; r < MR; r++) {
        const __m512 sum = sums[r];
        const int64_t at = rows[r] * ldy + n;
        if (ytype == KVQ_F32) {
            float* yr = (float*)y + at;
            _mm512_mask_storeu_ps(yr, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, yr), sum));
        } else {
            uint16_t* yr = (uint16_t*)y + at;
            const __m512 old = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, yr)), 16));
            _mm256_mask_storeu_epi16(yr, mask, to_bf16x16_avx512(_mm512_add_ps(old, sum)));
        }
    }
}

#define KVQ_LORA_ROWS_CASES(CALL) \
    switch (m) { case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; case 5: CALL(5); break; \
                 case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1); break; }

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
static void lora_shrink_avx512(const uint16_t* a, int64_t in, int64_t rank, const float* xs, int64_t m,
                               float* shrunk, int64_t width) {
    for (int64_t c = 0; c < rank; c += 16) {
#define KVQ_SHRINK(MR) lora_shrink_tile_avx512(a + c * in, in, xs, rank - c, shrunk + c, width, MR)
        KVQ_LORA_ROWS_CASES(KVQ_SHRINK)
#undef KVQ_SHRINK
    }
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
static void lora_expand_avx512(const uint16_t* b, int64_t rank, const float* shrunk, int64_t width,
                               int64_t out_cols, const int64_t* rows, int64_t m, void* y, int ytype, int64_t ldy,
                               int64_t n0) {
    for (int64_t n = 0; n < out_cols; n += 16) {
#define KVQ_EXPAND(MR) lora_expand_tile_avx512(b + n * rank, rank, shrunk, width, out_cols - n, rows, y, ytype, ldy, \
                                                n0 + n, MR)
        KVQ_LORA_ROWS_CASES(KVQ_EXPAND)
#undef KVQ_EXPAND
    }
}
#endif

/* One segment (at most KVQ_LORA_SEG_ROWS rows of one slot): its rows
 * transformed, then per target x A and (x A) B added into y, each panel read
 * once. One chunk does both passes, so a linear's update is one job for the
 * pool (one wake-up; two had been ~240 a step at 30 layers). */
static void lora_segment_chunk(const void* ctx, int64_t seg) {
    const lora_job* j = ctx;
    const kvq_lora_linear* L = j->lin;
    const int64_t* sg = j->step->segments + 3 * seg;
    const int64_t slot = sg[0], first = sg[1], m = sg[2] - sg[1];
    const size_t esz = j->xtype == KVQ_BF16 ? 2 : 4;
    for (int64_t i = first; i < first + m; i++) {
        const void* row = (const char*)j->x + (size_t)j->step->rows[i] * j->ldx * esz;
        float* xs = j->xs + i * L->in;
        if (j->xop == KVQ_X_PLAIN) for (int64_t k = 0; k < L->in; k++) xs[k] = load_x(row, j->xtype, k);
        else transform_row(row, j->xtype, L->in, j->xop, j->norm_w, j->eps, xs, j->isa != KVQ_LORA_PORTABLE);
    }
    const float* xs = j->xs + first * L->in;
    const int64_t* rows = j->step->rows + first;
    for (int64_t t = 0; t < L->num_targets; t++) {
        const int64_t rank = L->ranks[slot * L->num_targets + t];
        if (rank == 0) continue;
        const uint16_t *a = lora_a_panel(L, slot, t), *b = lora_b_panel(L, slot, t);
        const int64_t n0 = L->out_offsets[t], out_cols = L->out_offsets[t + 1] - n0;
        float* shrunk = j->shrunk + first * L->width + t * L->max_rank;
#ifdef KVQ_X86
        if (j->isa == KVQ_LORA_AVX512) {
            lora_shrink_avx512(a, L->in, rank, xs, m, shrunk, L->width);
            lora_expand_avx512(b, rank, shrunk, L->width, out_cols, rows, m, j->y, j->ytype, j->ldy, n0);
            continue;
        }
        if (j->isa == KVQ_LORA_AVX2) {
            lora_shrink_avx2(a, L->in, rank, xs, m, shrunk, L->width);
            lora_expand_avx2(b, rank, shrunk, L->width, out_cols, rows, m, j->y, j->ytype, j->ldy, n0);
            continue;
        }
#endif
        lora_shrink_portable(a, L->in, rank, xs, m, shrunk, L->width);
        lora_expand_portable(b, rank, shrunk, L->width, out_cols, rows, m, j->y, j->ytype, j->ldy, n0);
    }
}

/* The update's path: the portable C, AVX2, or AVX-512 (zmm tiles) where the
 * matmul takes its AVX512-VNNI path (kvq_set_isa's mode 2 pins AVX2 for both). */
static int lora_isa(void) {
    const int isa = matmul_isa();
    return isa == 3 ? KVQ_LORA_AVX512 : isa == 2 ? KVQ_LORA_AVX2 : KVQ_LORA_PORTABLE;
}

/* y[rows] += f(x[rows]) A_slot B_slot for one fused linear of the step's
 * adapter rows (f: the linear's input transform xop). y is written only at
 * the columns of targets a row's adapter has. */
static void lora_add(const kvq_lora_step* step, const kvq_lora_linear* lin, const void* x, int xtype, int64_t ldx,
                     int xop, const void* norm_w, float eps, void* y, int64_t ldy, float* xs, float* shrunk,
                     int num_threads) {
    int targeted = 0;  /* does any of the step's adapters target this linear? */
    for (int64_t s = 0; s < step->num_segments && !targeted; s++)
        for (int64_t t = 0; t < lin->num_targets; t++) targeted |= lin->ranks[step->segments[3 * s] * lin->num_targets + t] > 0;
    if (!targeted) return;
    lora_job j = {step, lin, x, xtype, ldx, xop, norm_w, eps, y, xtype, ldy, xs, shrunk, lora_isa()};
    parallel_chunks(num_threads, step->num_segments, lora_segment_chunk, &j);
}

/* One fused linear's update on its own, as kvq_decode_layers applies it after
 * that linear's matmul: y[rows] += f(x[rows]) A B for the step's segments
 * (kvq_lora_step's rows and segments; x and y share the dtype). Returns 0,
 * or -1 where the scratch could not be allocated (nothing written). */
int kvq_lora_apply(const kvq_lora_linear* lin, const int64_t* rows, const int64_t* segments, int64_t num_rows,
                   int64_t num_segments, const void* x, int xtype, int64_t ldx, int xop, const void* norm_w,
                   float eps, void* y, int64_t ldy, int num_threads) {
    if (num_rows == 0) return 0;
    float* xs = malloc((size_t)(num_rows * (lin->in + lin->width)) * sizeof(float));
    if (xs == NULL) return -1;
    const kvq_lora_step step = {lin, rows, segments, num_rows, num_segments};
    lora_add(&step, lin, x, xtype, ldx, xop, norm_w, eps, y, ldy, xs, xs + num_rows * lin->in, num_threads);
    free(xs);
    return 0;
}

/* Every layer of a step (T query rows: one per sequence on a decode step, one
 * per token where a sequence has several, each with its own context), the
 * same kernels in the same order as the per-op path (model/llama.py's
 * DecoderLayer), so the result is bit for bit the same; what it saves is the
 * Python between ~5 calls per layer. residual: [T, hidden], updated in place
 * (each residual add is the matmul's own add, element by element, so y may
 * be add). Scratch: qkv [T, (H + 2 Hkv) D], attn [T, H D], gate_up [T, 2 inter].
 * lora: the step's adapter rows (NULL: every row on the base model, and no
 * work beyond the base step's), each fused matmul's low-rank update added to
 * its output right after it, as model/lora.LoraStep does on the per-op path.
 * bf16_from: rows from it on (a step's prompt positions, put last by the
 * runner) attend on AMX-BF16 where the CPU has it (T: none). tiles_from:
 * rows from it on take the layers' bfloat16 tiles in the matmuls, where a
 * layer has them (T: none); the caller sets it to T for a step of few
 * prompt rows, which the tiles' bytes would cost more than they save.
 * cache_dtype: the KV caches' element type (KVQ_F32, KVQ_BF16 or KVQ_I8), which
 * may differ from the activations' dtype.
 * Returns 0, or -1 (a kernel refused: allocation or a head shape past the
 * attention kernel's buffers; checked before the first layer where it can be),
 * or -2 (bfloat16 tiles given on a CPU without AMX-BF16). */
int kvq_decode_layers(const kvq_layer* layers, int64_t num_layers, void* residual, int dtype, int64_t T,
                      int64_t hidden, int64_t inter, int64_t H, int64_t Hkv, int64_t D, float eps, float scale,
                      const int64_t* positions, const void* cos, const void* sin, const int64_t* slots,
                      const int64_t* block_table, int64_t max_blocks, const int64_t* context_lens,
                      int64_t block_size, void* qkv, void* attn, void* gate_up, int num_threads,
                      const kvq_lora_step* lora, int64_t bf16_from, int64_t tiles_from, int cache_dtype,
                      int64_t run_min_rows) {
    if (H / Hkv > KVQ_MAX_GROUP || D > KVQ_MAX_D) return -1;
    const int64_t nqkv = (H + 2 * Hkv) * D;
    float *xs = NULL, *shrunk = NULL;  /* the adapter rows' inputs and f(x) A, reused by every linear */
    if (lora != NULL && lora->num_rows > 0) {
        int64_t max_in = 0, max_width = 0;
        for (int64_t i = 0; i < 4 * num_layers; i++) {
            if (lora->linears[i].in > max_in) max_in = lora->linears[i].in;
            if (lora->linears[i].width > max_width) max_width = lora->linears[i].width;
        }
        xs = malloc((size_t)(lora->num_rows * (max_in + max_width)) * sizeof(float));
        if (xs == NULL) return -1;
        shrunk = xs + lora->num_rows * max_in;
    } else {
        lora = NULL;
    }
    int status = 0;
    for (int64_t l = 0; l < num_layers && status == 0; l++) {
        const kvq_layer* ly = &layers[l];
        const kvq_lora_linear* ll = lora ? lora->linears + 4 * l : NULL;
        if ((status = split_matmul(ly->qkv_type, ly->qkv, ly->qkv_bf16, tiles_from, nqkv, hidden, residual, dtype,
                                   hidden, KVQ_X_RMS_NORM, ly->input_norm, eps, T, qkv, dtype, nqkv, NULL, 0, 0,
                                   num_threads))) break;
        if (ll) lora_add(lora, &ll[0], residual, dtype, hidden, KVQ_X_RMS_NORM, ly->input_norm, eps, qkv, nqkv, xs,
                         shrunk, num_threads);
        kvq_rope_write_kv(qkv, dtype, T, nqkv, positions, cos, sin, slots, ly->kv_cache, cache_dtype, H, Hkv, D,
                          num_threads);
        if ((status = kvq_decode_attention(qkv, dtype, nqkv, ly->kv_cache, cache_dtype, block_table, max_blocks,
                                           context_lens, block_size, T, H, Hkv, D, scale, attn, num_threads,
                                           bf16_from, run_min_rows))) break;
        if ((status = split_matmul(ly->o_type, ly->o, ly->o_bf16, tiles_from, hidden, H * D, attn, dtype, H * D,
                                   KVQ_X_PLAIN, NULL, 0.f, T, residual, dtype, hidden, residual, dtype, hidden,
                                   num_threads))) break;
        if (ll) lora_add(lora, &ll[1], attn, dtype, H * D, KVQ_X_PLAIN, NULL, 0.f, residual, hidden, xs, shrunk,
                         num_threads);
        if (ll == NULL && dtype == KVQ_F32 && ly->gate_up_bf16 != NULL && ly->down_bf16 != NULL && tiles_from < T &&
            inter % 32 == 0) {  /* the prompt rows' MLP without its float32 gate_up activations */
            const int64_t split = tiles_from < 0 ? 0 : tiles_from;
            float* rows = (float*)residual + split * hidden;
            if (split > 0 && ((status = kvq_matmul(ly->gate_up_type, ly->gate_up, 2 * inter, hidden, residual, dtype,
                                                   hidden, KVQ_X_RMS_NORM, ly->post_norm, eps, split, gate_up, dtype,
                                                   2 * inter, NULL, 0, 0, num_threads)) ||
                              (status = kvq_matmul(ly->down_type, ly->down, hidden, inter, gate_up, dtype, 2 * inter,
                                                   KVQ_X_SWIGLU, NULL, 0.f, split, residual, dtype, hidden, residual,
                                                   dtype, hidden, num_threads)))) break;
            if ((status = kvq_prompt_mlp(ly->gate_up_bf16, ly->down_bf16, inter, hidden, hidden, rows, hidden,
                                         ly->post_norm, eps, T - split, rows, hidden, rows, hidden, num_threads))) break;
            continue;
        }
        if ((status = split_matmul(ly->gate_up_type, ly->gate_up, ly->gate_up_bf16, tiles_from, 2 * inter, hidden,
                                   residual, dtype, hidden, KVQ_X_RMS_NORM, ly->post_norm, eps, T, gate_up, dtype,
                                   2 * inter, NULL, 0, 0, num_threads))) break;
        if (ll) lora_add(lora, &ll[2], residual, dtype, hidden, KVQ_X_RMS_NORM, ly->post_norm, eps, gate_up,
                         2 * inter, xs, shrunk, num_threads);
        if ((status = split_matmul(ly->down_type, ly->down, ly->down_bf16, tiles_from, hidden, inter, gate_up, dtype,
                                   2 * inter, KVQ_X_SWIGLU, NULL, 0.f, T, residual, dtype, hidden, residual, dtype,
                                   hidden, num_threads))) break;
        if (ll) lora_add(lora, &ll[3], gate_up, dtype, 2 * inter, KVQ_X_SWIGLU, NULL, 0.f, residual, hidden, xs,
                         shrunk, num_threads);
    }
    free(xs);
    return status;
}
