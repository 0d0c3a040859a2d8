/* int8 weight-only matmul for CPUs: y[n, o] = s[o] * sum_d x[n, d] * w[o, d].
 *
 * x fp32 [N, D], w int8 [O, D] (row-major), s fp32 [O], y fp32 [N, O]. Built by speedllm/quant/int8.py with the
 * host's compiler (-march=native); its reference twin there is F.linear(x, w.float()) * s.
 * Decode reads every weight once per token, so the point is to read 1 byte per weight and widen it in registers
 * (torch's CPU paths write a full-precision copy of the weight, or widen slowly).
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define ROWS 8 /* activation rows sharing one widened weight vector */
#define AHEAD 4 /* weight rows prefetched ahead */

static inline __m512 widen16(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}

/* one output feature, one activation row: four independent accumulators hide the FMA latency */
static void dot1(const float *x, const int8_t *w, const float *s, float *y, long D, long o) {
    const int8_t *row = w + o * D;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long d = 0;
    for (; d + 64 <= D; d += 64) {
        a0 = _mm512_fmadd_ps(widen16(row + d), _mm512_loadu_ps(x + d), a0);
        a1 = _mm512_fmadd_ps(widen16(row + d + 16), _mm512_loadu_ps(x + d + 16), a1);
        a2 = _mm512_fmadd_ps(widen16(row + d + 32), _mm512_loadu_ps(x + d + 32), a2);
        a3 = _mm512_fmadd_ps(widen16(row + d + 48), _mm512_loadu_ps(x + d + 48), a3);
    }
    for (; d < D; d += 16)
        a0 = _mm512_fmadd_ps(widen16(row + d), _mm512_loadu_ps(x + d), a0);
    y[o] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) * s[o];
}

/* one output feature, up to ROWS activation rows: each weight vector is widened once */
static void dots(const float *x, const int8_t *w, const float *s, float *y, long rows, long D, long O, long o) {
    const int8_t *row = w + o * D;
    __m512 acc[ROWS];
    for (long n = 0; n < rows; n++) acc[n] = _mm512_setzero_ps();
    for (long d = 0; d < D; d += 16) {
        __m512 wf = widen16(row + d);
        for (long n = 0; n < rows; n++) acc[n] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(x + n * D + d), acc[n]);
    }
    for (long n = 0; n < rows; n++) y[n * O + o] = _mm512_reduce_add_ps(acc[n]) * s[o];
}

/* D must be a multiple of 16 (int8.py checks) */
void int8_wo_mm(const float *x, const int8_t *w, const float *s, float *y, long N, long D, long O, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < O; o++) {
        /* ask for the row AHEAD rows on now: the hardware prefetcher alone left this ~1.4x short of the
           memory bandwidth fp32 reaches (measured, 1 thread) */
        if (o + AHEAD < O)
            for (long d = 0; d < D; d += 64) _mm_prefetch((const char *)(w + (o + AHEAD) * D + d), _MM_HINT_T0);
        if (N == 1) {
            dot1(x, w, s, y, D, o);
            continue;
        }
        for (long n0 = 0; n0 < N; n0 += ROWS)
            dots(x + n0 * D, w, s, y + n0 * O, N - n0 < ROWS ? N - n0 : ROWS, D, O, o);
    }
}

int int8_wo_mm_fast(void) { return 1; }
#else
int int8_wo_mm_fast(void) { return 0; } /* no AVX-512 here: int8.py uses the reference twin */
#endif
