/* int4 weight-only matmul for CPUs, torchao's "tinygemm" int4: w[o, d] = (q[o, d] - 8) * s[o, g] + z[o, g] for
 * d in group g (group_size input features), q in 0..15.  y[n, o] = sum_d x[n, d] * w[o, d], computed as
 *     sum_g s[o, g] * sum_{d in g} x[n, d] * q[o, d]  +  sum_g (z[o, g] - 8 s[o, g]) * sum_{d in g} x[n, d]
 * (the same sum reassociated; its reference twin in int4.py dequantizes w and calls F.linear).
 *
 * Packing (int4.py pack_int4): per output row, units of 32 input features in 16 bytes read as 8 little-endian
 * uint16 lanes; lane i holds q[32u + 8k + i] in bits 4k..4k+3, k = 0..3. So one load and one widening of 16-bit
 * lanes to 32 bits gives 8 lanes of 4 nibbles, and nibble k is `lane & (0xF << 4k)`: q * 16^k exactly, which
 * meets x[d] * 16^-k (exact: a power of two), prepared once per call in xk. Per 8 weights: AND, convert, FMA.
 * x fp32 [N, D], packed uint8 [O, D / 2], s and z fp32 [O, G], y fp32 [N, O]; group_size a multiple of 32.
 * Built by speedllm/native.py for one path: SPEEDLLM_ISA_AVX512 | _AVX2 | _NEON | _GENERIC. The AVX-512 path reads
 * the same layout a unit at a time: its 8 lanes twice in one 16-lane register, masked for nibbles 0 and 1 (then 2
 * and 3), meet 16 consecutive xk: two FMAs per 32 weights where AVX2 needs four.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define UNIT 32 /* input features per 16 packed bytes */
#define ROWS 4  /* activation rows sharing one widened weight unit */
#define AHEAD 4 /* weight rows prefetched ahead */

#if defined(SPEEDLLM_ISA_AVX512)
#if !defined(__AVX512F__)
#error "SPEEDLLM_ISA_AVX512 needs a compiler target with AVX-512F"
#endif
#include <immintrin.h>
#define PATH "avx512"

/* a unit's 8 lanes, twice: 16 x 32 bits */
static inline __m512i lanes2(const uint8_t *unit) {
    return _mm512_broadcast_i64x4(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)unit)));
}

/* nibbles k and k + 1 of the 8 lanes (mask: 0xF << 4k in lanes 0..7, 0xF << 4(k + 1) in lanes 8..15), scaled
 * by 16^k and 16^(k + 1) as xk expects */
static inline __m512 nibbles2(__m512i v, __m512i mask) { return _mm512_cvtepi32_ps(_mm512_and_si512(v, mask)); }

static void dots(const float *xk, const uint8_t *row, const float *s, long rows, long D, long group, float *out) {
    const __m512i m01 = _mm512_set_epi32(0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF0, 0xF, 0xF, 0xF, 0xF, 0xF,
                                         0xF, 0xF, 0xF);
    const __m512i m23 = _mm512_slli_epi32(m01, 8);
    __m512 tot[ROWS];
    for (long n = 0; n < rows; n++) tot[n] = _mm512_setzero_ps();
    for (long g0 = 0; g0 < D; g0 += group) {
        __m512 a0[ROWS], a1[ROWS];
        for (long n = 0; n < rows; n++) a0[n] = a1[n] = _mm512_setzero_ps();
        for (long d = g0; d < g0 + group; d += UNIT) {
            __m512i v = lanes2(row + d / 2);
            __m512 c01 = nibbles2(v, m01), c23 = nibbles2(v, m23);
            for (long n = 0; n < rows; n++) {
                const float *x = xk + n * D + d;
                a0[n] = _mm512_fmadd_ps(c01, _mm512_loadu_ps(x), a0[n]);
                a1[n] = _mm512_fmadd_ps(c23, _mm512_loadu_ps(x + 16), a1[n]);
            }
        }
        __m512 scale = _mm512_set1_ps(s[g0 / group]);
        for (long n = 0; n < rows; n++) tot[n] = _mm512_fmadd_ps(_mm512_add_ps(a0[n], a1[n]), scale, tot[n]);
    }
    for (long n = 0; n < rows; n++) out[n] = _mm512_reduce_add_ps(tot[n]);
}

/* the decode case (one activation row) */
static float dot1(const float *xk, const uint8_t *row, const float *s, long D, long group) {
    float out;
    dots(xk, row, s, 1, D, group, &out);
    return out;
}

#elif defined(SPEEDLLM_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "SPEEDLLM_ISA_AVX2 needs a compiler target with AVX2 and FMA"
#endif
#include <immintrin.h>
#define PATH "avx2"

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256i lanes(const uint8_t *unit) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)unit));
}

static inline __m256 nibbles(__m256i v, int k) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * k))));
}

/* one activation row against one packed weight row: sum_g s[g] * sum x q; four accumulators per group */
static float dot1(const float *xk, const uint8_t *row, const float *s, long D, long group) {
    __m256 tot = _mm256_setzero_ps();
    for (long g0 = 0; g0 < D; g0 += group) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long d = g0; d < g0 + group; d += UNIT) {
            __m256i v = lanes(row + d / 2);
            a0 = _mm256_fmadd_ps(nibbles(v, 0), _mm256_loadu_ps(xk + d), a0);
            a1 = _mm256_fmadd_ps(nibbles(v, 1), _mm256_loadu_ps(xk + d + 8), a1);
            a2 = _mm256_fmadd_ps(nibbles(v, 2), _mm256_loadu_ps(xk + d + 16), a2);
            a3 = _mm256_fmadd_ps(nibbles(v, 3), _mm256_loadu_ps(xk + d + 24), a3);
        }
        tot = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                              _mm256_set1_ps(s[g0 / group]), tot);
    }
    return sum8(tot);
}

/* rows activation rows (xk, row stride D) against one packed weight row: out[n] = sum_g s[g] * sum x q */
static void dots(const float *xk, const uint8_t *row, const float *s, long rows, long D, long group, float *out) {
    __m256 tot[ROWS];
    for (long n = 0; n < rows; n++) tot[n] = _mm256_setzero_ps();
    for (long g0 = 0; g0 < D; g0 += group) {
        __m256 a0[ROWS], a1[ROWS];
        for (long n = 0; n < rows; n++) a0[n] = a1[n] = _mm256_setzero_ps();
        for (long d = g0; d < g0 + group; d += UNIT) {
            __m256i v = lanes(row + d / 2);
            __m256 c0 = nibbles(v, 0), c1 = nibbles(v, 1), c2 = nibbles(v, 2), c3 = nibbles(v, 3);
            for (long n = 0; n < rows; n++) {
                const float *x = xk + n * D + d;
                a0[n] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(x), a0[n]);
                a1[n] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(x + 8), a1[n]);
                a0[n] = _mm256_fmadd_ps(c2, _mm256_loadu_ps(x + 16), a0[n]);
                a1[n] = _mm256_fmadd_ps(c3, _mm256_loadu_ps(x + 24), a1[n]);
            }
        }
        __m256 scale = _mm256_set1_ps(s[g0 / group]);
        for (long n = 0; n < rows; n++) tot[n] = _mm256_fmadd_ps(_mm256_add_ps(a0[n], a1[n]), scale, tot[n]);
    }
    for (long n = 0; n < rows; n++) out[n] = sum8(tot[n]);
}

#elif defined(SPEEDLLM_ISA_NEON)
#if !defined(__aarch64__)
#error "SPEEDLLM_ISA_NEON needs an aarch64 compiler target"
#endif
#include <arm_neon.h>
#define PATH "neon"

static void dots(const float *xk, const uint8_t *row, const float *s, long rows, long D, long group, float *out) {
    const uint32x4_t mask[4] = {vdupq_n_u32(0xF), vdupq_n_u32(0xF0), vdupq_n_u32(0xF00), vdupq_n_u32(0xF000)};
    float32x4_t tot[ROWS];
    for (long n = 0; n < rows; n++) tot[n] = vdupq_n_f32(0);
    for (long g0 = 0; g0 < D; g0 += group) {
        float32x4_t a0[ROWS], a1[ROWS];
        for (long n = 0; n < rows; n++) a0[n] = a1[n] = vdupq_n_f32(0);
        for (long d = g0; d < g0 + group; d += UNIT) {
            uint16x8_t v = vld1q_u16((const uint16_t *)(row + d / 2));
            uint32x4_t lo = vmovl_u16(vget_low_u16(v)), hi = vmovl_high_u16(v); /* lanes 0..3, 4..7 */
            for (int k = 0; k < 4; k++) {
                float32x4_t clo = vcvtq_f32_u32(vandq_u32(lo, mask[k])), chi = vcvtq_f32_u32(vandq_u32(hi, mask[k]));
                for (long n = 0; n < rows; n++) {
                    const float *x = xk + n * D + d + 8 * k;
                    a0[n] = vfmaq_f32(a0[n], clo, vld1q_f32(x));
                    a1[n] = vfmaq_f32(a1[n], chi, vld1q_f32(x + 4));
                }
            }
        }
        for (long n = 0; n < rows; n++) tot[n] = vfmaq_n_f32(tot[n], vaddq_f32(a0[n], a1[n]), s[g0 / group]);
    }
    for (long n = 0; n < rows; n++) out[n] = vaddvq_f32(tot[n]);
}

/* the decode case (one activation row) */
static float dot1(const float *xk, const uint8_t *row, const float *s, long D, long group) {
    float out;
    dots(xk, row, s, 1, D, group, &out);
    return out;
}

#else /* generic: plain C in 8 lanes per nibble, which the compiler maps onto the host's vectors */
#define PATH "generic"

static void dots(const float *xk, const uint8_t *row, const float *s, long rows, long D, long group, float *out) {
    for (long n = 0; n < rows; n++) {
        float tot[8] = {0};
        for (long g0 = 0; g0 < D; g0 += group) {
            float acc[8] = {0};
            for (long d = g0; d < g0 + group; d += UNIT) {
                uint16_t lane[8];
                memcpy(lane, row + d / 2, sizeof lane);
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < 8; i++)
                        acc[i] += (float)(lane[i] & (0xFu << (4 * k))) * xk[n * D + d + 8 * k + i];
            }
            for (int i = 0; i < 8; i++) tot[i] += acc[i] * s[g0 / group];
        }
        float sum = 0.0f;
        for (int i = 0; i < 8; i++) sum += tot[i];
        out[n] = sum;
    }
}

/* the decode case (one activation row) */
static float dot1(const float *xk, const uint8_t *row, const float *s, long D, long group) {
    float out;
    dots(xk, row, s, 1, D, group, &out);
    return out;
}
#endif

void int4_wo_mm(const float *x, const uint8_t *packed, const float *s, const float *z, float *y, long N, long D,
                long O, long group, int threads) {
    long G = D / group;
    float *xk = malloc(sizeof(float) * N * D), *xsum = malloc(sizeof(float) * N * G);
    for (long n = 0; n < N; n++) {
        for (long d = 0; d < D; d++) xk[n * D + d] = x[n * D + d] * (float)(1.0 / (1 << (4 * ((d % UNIT) / 8))));
        for (long g = 0; g < G; g++) {
            float t = 0.0f;
            for (long d = g * group; d < (g + 1) * group; d++) t += x[n * D + d];
            xsum[n * G + g] = t;
        }
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < O; o++) {
        const uint8_t *row = packed + o * (D / 2);
        if (o + AHEAD < O)
            for (long d = 0; d < D / 2; d += 64) __builtin_prefetch(row + AHEAD * (D / 2) + d, 0, 3);
        const float *so = s + o * G, *zo = z + o * G;
        for (long n0 = 0; n0 < N; n0 += ROWS) {
            long rows = N - n0 < ROWS ? N - n0 : ROWS;
            float out[ROWS];
            if (rows == 1)
                out[0] = dot1(xk + n0 * D, row, so, D, group);
            else
                dots(xk + n0 * D, row, so, rows, D, group, out);
            for (long n = 0; n < rows; n++) {
                float offset = 0.0f;
                for (long g = 0; g < G; g++) offset += (zo[g] - 8.0f * so[g]) * xsum[(n0 + n) * G + g];
                y[(n0 + n) * O + o] = out[n] + offset;
            }
        }
    }
    free(xk);
    free(xsum);
}

const char *speedllm_path(void) { return PATH; } /* for task=doctor */
