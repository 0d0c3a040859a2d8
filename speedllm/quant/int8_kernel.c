/* int8 weight-only matmul for CPUs: y[n, o] = s[o] * sum_d x[n, d] * w[o, d].
 *
 * x fp32 [N, D], w int8 [O, D] (row-major), s fp32 [O], y fp32 [N, O]; D a multiple of 16 (int8.py checks).
 * Built by speedllm/native.py with the host's compiler (-march=native) for one kernel path, SPEEDLLM_ISA_AVX512 |
 * _AVX2 | _NEON | _GENERIC; its reference twin (int8.py) is F.linear(x, w.float()) * s: same numbers up to the
 * order of the fp32 additions.
 * Decode reads every weight once per token, so the point is to read 1 byte per weight and widen it in registers
 * (torch's CPU paths write a full-precision copy of the weight, or widen slowly). Each path has
 *   dot1: one output feature, one activation row, several independent accumulators to hide the FMA latency;
 *   dots: one output feature, up to ROWS activation rows, each widened weight vector used ROWS times.
 */
#include <stdint.h>

#define ROWS 8 /* activation rows sharing one widened weight vector */
#define AHEAD 4 /* weight rows prefetched ahead */

#if defined(SPEEDLLM_ISA_AVX512)
#if !defined(__AVX512F__)
#error "SPEEDLLM_ISA_AVX512 needs a compiler target with AVX-512F"
#endif
#include <immintrin.h>
#define PATH "avx512"

static inline __m512 widen16(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}

/* 32 weights an iteration into two accumulators: unrolled to 64 into four, this ran 1.6x slower on Zen 4 (310 vs
 * 190 us for a [3072 x 1024] weight, 1 thread: the AVX2 path's pace), and two are enough to keep up with memory */
static float dot1(const float *x, const int8_t *row, long D) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    long d = 0;
    for (; d + 32 <= D; d += 32) {
        a0 = _mm512_fmadd_ps(widen16(row + d), _mm512_loadu_ps(x + d), a0);
        a1 = _mm512_fmadd_ps(widen16(row + d + 16), _mm512_loadu_ps(x + d + 16), a1);
    }
    if (d < D) a0 = _mm512_fmadd_ps(widen16(row + d), _mm512_loadu_ps(x + d), a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

static void dots(const float *x, const int8_t *row, long rows, long D, float *out) {
    __m512 acc[ROWS];
    for (long n = 0; n < rows; n++) acc[n] = _mm512_setzero_ps();
    for (long d = 0; d < D; d += 16) {
        __m512 wf = widen16(row + d);
        for (long n = 0; n < rows; n++) acc[n] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(x + n * D + d), acc[n]);
    }
    for (long n = 0; n < rows; n++) out[n] = _mm512_reduce_add_ps(acc[n]);
}

#elif defined(SPEEDLLM_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "SPEEDLLM_ISA_AVX2 needs a compiler target with AVX2 and FMA"
#endif
#include <immintrin.h>
#define PATH "avx2"

static inline __m256 widen8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static float dot1(const float *x, const int8_t *row, long D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long d = 0;
    for (; d + 32 <= D; d += 32) {
        a0 = _mm256_fmadd_ps(widen8(row + d), _mm256_loadu_ps(x + d), a0);
        a1 = _mm256_fmadd_ps(widen8(row + d + 8), _mm256_loadu_ps(x + d + 8), a1);
        a2 = _mm256_fmadd_ps(widen8(row + d + 16), _mm256_loadu_ps(x + d + 16), a2);
        a3 = _mm256_fmadd_ps(widen8(row + d + 24), _mm256_loadu_ps(x + d + 24), a3);
    }
    for (; d < D; d += 16) {
        a0 = _mm256_fmadd_ps(widen8(row + d), _mm256_loadu_ps(x + d), a0);
        a1 = _mm256_fmadd_ps(widen8(row + d + 8), _mm256_loadu_ps(x + d + 8), a1);
    }
    return sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

static void dots(const float *x, const int8_t *row, long rows, long D, float *out) {
    __m256 acc[ROWS];
    for (long n = 0; n < rows; n++) acc[n] = _mm256_setzero_ps();
    for (long d = 0; d < D; d += 8) {
        __m256 wf = widen8(row + d);
        for (long n = 0; n < rows; n++) acc[n] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(x + n * D + d), acc[n]);
    }
    for (long n = 0; n < rows; n++) out[n] = sum8(acc[n]);
}

#elif defined(SPEEDLLM_ISA_NEON)
#if !defined(__aarch64__)
#error "SPEEDLLM_ISA_NEON needs an aarch64 compiler target"
#endif
#include <arm_neon.h>
#define PATH "neon"

/* 16 int8 weights as four float32x4 */
static inline void widen16(const int8_t *w, float32x4_t f[4]) {
    int8x16_t v = vld1q_s8(w);
    int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
    f[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    f[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    f[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    f[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}

static float dot1(const float *x, const int8_t *row, long D) {
    float32x4_t a[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)}, f[4];
    for (long d = 0; d < D; d += 16) {
        widen16(row + d, f);
        for (int j = 0; j < 4; j++) a[j] = vfmaq_f32(a[j], f[j], vld1q_f32(x + d + 4 * j));
    }
    return vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3])));
}

static void dots(const float *x, const int8_t *row, long rows, long D, float *out) {
    float32x4_t acc[ROWS], f[4];
    for (long n = 0; n < rows; n++) acc[n] = vdupq_n_f32(0);
    for (long d = 0; d < D; d += 16) {
        widen16(row + d, f);
        for (long n = 0; n < rows; n++)
            for (int j = 0; j < 4; j++) acc[n] = vfmaq_f32(acc[n], f[j], vld1q_f32(x + n * D + d + 4 * j));
    }
    for (long n = 0; n < rows; n++) out[n] = vaddvq_f32(acc[n]);
}

#else /* generic: plain C in 16 lanes, which the compiler maps onto the host's vectors */
#define PATH "generic"
#define LANES 16

static float dot1(const float *x, const int8_t *row, long D) {
    float acc[LANES] = {0}, s = 0.0f;
    for (long d = 0; d < D; d += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += (float)row[d + j] * x[d + j];
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

static void dots(const float *x, const int8_t *row, long rows, long D, float *out) {
    float acc[ROWS][LANES] = {{0}};
    for (long d = 0; d < D; d += LANES) {
        float wf[LANES];
        for (int j = 0; j < LANES; j++) wf[j] = (float)row[d + j];
        for (long n = 0; n < rows; n++)
            for (int j = 0; j < LANES; j++) acc[n][j] += wf[j] * x[n * D + d + j];
    }
    for (long n = 0; n < rows; n++) {
        float s = 0.0f;
        for (int j = 0; j < LANES; j++) s += acc[n][j];
        out[n] = s;
    }
}
#endif

void int8_wo_mm(const float *x, const int8_t *w, const float *s, float *y, long N, long D, long O, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < O; o++) {
        const int8_t *row = w + o * D;
        /* ask for the row AHEAD rows on now: the hardware prefetcher alone left this ~1.4x short of the
           memory bandwidth fp32 reaches (measured, AVX-512, 1 thread) */
        if (o + AHEAD < O)
            for (long d = 0; d < D; d += 64) __builtin_prefetch(row + AHEAD * D + d, 0, 3);
        if (N == 1) {
            y[o] = dot1(x, row, D) * s[o];
            continue;
        }
        for (long n0 = 0; n0 < N; n0 += ROWS) {
            long rows = N - n0 < ROWS ? N - n0 : ROWS;
            float out[ROWS];
            dots(x + n0 * D, row, rows, D, out);
            for (long n = 0; n < rows; n++) y[(n0 + n) * O + o] = out[n] * s[o];
        }
    }
}

/* int8 weights x dynamically quantized int8 activations: y[n, o] = (acc[n, o] * xs[n]) * s[o] with
 * acc = sum_d xq[n, d] * w[o, d] in int32 (exact), xs[n] = max_d |x[n, d]| / 127, xq = round(x / xs) in -127..127
 * (to nearest even; a zero row stays zero). Its reference twin (int8.py int8_dq_mm_reference) computes the same
 * integers, so every variant below equals it to the bit. The dot products, one per instruction set, chosen by
 * int8.py (int8_dot_variant: the CPU's features within the kernel path) and built here whatever the build's target
 * (each with its own target attribute), so a build on any x86-64 host carries them all:
 *   generic      plain C;
 *   avx2         vpmaddubsw + vpmaddwd: u8 x s8 pairs summed to 16 bits, which would saturate for u8 = x + 128;
 *                instead |w| (u8, at most 128) times x carrying w's sign (s8, |x| <= 127): 2 x 128 x 127 < 2^15;
 *   avxvnni      vpdpbusd (VEX): the same operands, four products straight into 32 bits;
 *   avx512vnni   vpdpbusd on 64 bytes: u8 = x + 128 (AVX-512 has no byte sign), minus 128 x sum(w) (a second
 *                vpdpbusd against ones). */
#include <math.h>
#include <stdlib.h>

typedef int32_t (*dot_i8)(const int8_t *x, const int8_t *w, long D);

static int32_t dot_i8_generic(const int8_t *x, const int8_t *w, long D) {
    int32_t acc = 0;
    for (long d = 0; d < D; d++) acc += (int32_t)x[d] * w[d];
    return acc;
}

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2"))) static inline int32_t sum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

__attribute__((target("avx2"))) static int32_t dot_i8_avx2(const int8_t *x, const int8_t *w, long D) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, ones = _mm256_set1_epi16(1);
    long d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + d)), x0 = _mm256_loadu_si256((const __m256i *)(x + d));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + d + 32));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + d + 32));
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0),
                                                                         _mm256_sign_epi8(x0, w0)), ones));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1),
                                                                         _mm256_sign_epi8(x1, w1)), ones));
    }
    int32_t acc = sum8_epi32(_mm256_add_epi32(a0, a1));
    return acc + dot_i8_generic(x + d, w + d, D - d);
}

__attribute__((target("avx2,avxvnni"))) static int32_t dot_i8_avxvnni(const int8_t *x, const int8_t *w, long D) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    long d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + d)), x0 = _mm256_loadu_si256((const __m256i *)(x + d));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + d + 32));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + d + 32));
        a0 = _mm256_dpbusd_avx_epi32(a0, _mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
        a1 = _mm256_dpbusd_avx_epi32(a1, _mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));
    }
    int32_t acc = sum8_epi32(_mm256_add_epi32(a0, a1));
    return acc + dot_i8_generic(x + d, w + d, D - d);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static int32_t dot_i8_avx512vnni(const int8_t *x,
                                                                                         const int8_t *w, long D) {
    __m512i acc = _mm512_setzero_si512(), wsum = acc, ones = _mm512_set1_epi8(1), offset = _mm512_set1_epi8(-128);
    long d = 0;
    for (; d + 64 <= D; d += 64) {
        __m512i wv = _mm512_loadu_si512(w + d);
        acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(x + d), offset), wv); /* x + 128 */
        wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
    }
    int32_t total = _mm512_reduce_add_epi32(acc) - 128 * _mm512_reduce_add_epi32(wsum);
    return total + dot_i8_generic(x + d, w + d, D - d);
}
#endif

/* variant: 0 generic, 1 avx2, 2 avxvnni, 3 avx512vnni (int8.py INT8_DOTS; x86 ones only on x86-64) */
void int8_dq_mm(const float *x, const int8_t *w, const float *s, float *y, long N, long D, long O, int variant,
                int threads) {
    dot_i8 dot = dot_i8_generic;
#if defined(__x86_64__)
    const dot_i8 x86[] = {dot_i8_generic, dot_i8_avx2, dot_i8_avxvnni, dot_i8_avx512vnni};
    dot = x86[variant];
#endif
    int8_t *xq = malloc(N * D);
    float *xs = malloc(sizeof(float) * N);
    for (long n = 0; n < N; n++) {
        const float *xr = x + n * D;
        float amax = 0.0f;
        for (long d = 0; d < D; d++) amax = fmaxf(amax, fabsf(xr[d]));
        xs[n] = amax / 127.0f;
        for (long d = 0; d < D; d++) xq[n * D + d] = amax > 0.0f ? (int8_t)nearbyintf(xr[d] / xs[n]) : 0;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < O; o++) {
        const int8_t *row = w + o * D;
        if (o + AHEAD < O)
            for (long d = 0; d < D; d += 64) __builtin_prefetch(row + AHEAD * D + d, 0, 3);
        for (long n = 0; n < N; n++) y[n * O + o] = (float)dot(xq + n * D, row, D) * xs[n] * s[o];
    }
    free(xq);
    free(xs);
}

const char *speedllm_path(void) { return PATH; } /* for task=doctor */
