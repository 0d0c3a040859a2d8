/* Fused fp32 CPU kernels for the training step's elementwise ops: RMSNorm, SwiGLU, RoPE, forward and backward.
 *
 * Built by speedllm/native.py with the host's compiler (-O3 -march=native -fopenmp, for one kernel path: the avx2
 * path keeps AVX-512 off); the loops are written for the compiler's auto-vectorization (omp simd) and split over
 * rows with OpenMP. Same math as the `reference` op
 * set (speedllm/ops/reference.py, the twin the tests hold these against), accumulated in fp32; only the order of
 * additions differs. All arrays are contiguous, row-major fp32. Reproducible for a given thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* rows [*lo, *hi) of N for thread t of nt: contiguous blocks, so a reduction over rows is fixed per thread count */
static void split(long N, int t, int nt, long *lo, long *hi) {
    long base = N / nt, extra = N % nt;
    *lo = t * base + (t < extra ? t : extra);
    *hi = *lo + base + (t < extra);
}

/* y = x * rstd * w per row of D, rstd[n] = 1 / sqrt(mean(x[n]^2) + eps) (kept for backward) */
void rms_norm_fwd(const float *x, const float *w, float *y, float *rstd, long N, long D, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        const float *xr = x + n * D;
        float *yr = y + n * D;
        float ss = 0.0f;
        #pragma omp simd reduction(+ : ss)
        for (long d = 0; d < D; d++) ss += xr[d] * xr[d];
        float r = 1.0f / sqrtf(ss / (float)D + eps);
        rstd[n] = r;
        #pragma omp simd
        for (long d = 0; d < D; d++) yr[d] = w[d] * (xr[d] * r);
    }
}

/* dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w, xhat = x * rstd; dw = sum over rows of dy * xhat
 * (dw NULL: not wanted). scratch: threads * D floats, one partial dw per thread, summed in thread order. */
void rms_norm_bwd(const float *dy, const float *x, const float *w, const float *rstd, float *dx, float *dw,
                  float *scratch, long N, long D, int threads) {
    if (threads > N) threads = N > 0 ? (int)N : 1;
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long lo, hi;
        split(N, t, nt, &lo, &hi);
        float *part = scratch + t * D;
        if (dw) memset(part, 0, D * sizeof(float));
        for (long n = lo; n < hi; n++) {
            const float *dyr = dy + n * D, *xr = x + n * D;
            float *dxr = dx + n * D;
            float r = rstd[n], dot = 0.0f;
            #pragma omp simd reduction(+ : dot)
            for (long d = 0; d < D; d++) dot += dyr[d] * w[d] * (xr[d] * r);
            float c = dot / (float)D;
            #pragma omp simd
            for (long d = 0; d < D; d++) dxr[d] = r * (dyr[d] * w[d] - (xr[d] * r) * c);
            if (dw) {
                #pragma omp simd
                for (long d = 0; d < D; d++) part[d] += dyr[d] * (xr[d] * r);
            }
        }
        if (dw) {
            #pragma omp barrier
            #pragma omp for schedule(static)
            for (long d = 0; d < D; d++) {
                float s = 0.0f;
                for (int i = 0; i < nt; i++) s += scratch[i * D + d];
                dw[d] = s;
            }
        }
    }
}

/* exp(x) in fp32 (about 2 ulp): x = k ln2 + r, exp(r) by its degree-6 Taylor polynomial, 2^k in the exponent
 * bits. Written so that it vectorizes (no libm call); clamped to the finite fp32 range. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - k * 0.693145752f;
    r = r - k * 1.42860677e-6f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float sigmoid_f32(float g) { return 1.0f / (1.0f + exp_f32(-g)); }

/* y = silu(g) * u over n elements */
void swiglu_fwd(const float *g, const float *u, float *y, long n, int threads) {
    #pragma omp parallel for simd num_threads(threads) schedule(static)
    for (long i = 0; i < n; i++) y[i] = g[i] * sigmoid_f32(g[i]) * u[i];
}

/* du = dy * silu(g), dg = dy * u * s * (1 + g * (1 - s)) with s = sigmoid(g) (recomputed, not saved) */
void swiglu_bwd(const float *dy, const float *g, const float *u, float *dg, float *du, long n, int threads) {
    #pragma omp parallel for simd num_threads(threads) schedule(static)
    for (long i = 0; i < n; i++) {
        float s = sigmoid_f32(g[i]);
        du[i] = dy[i] * (g[i] * s);
        dg[i] = dy[i] * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
    }
}

/* RoPE, rotate-half convention, x [R, H, Dh] with R = B * S positions, cos/sin [R, Dh] shared by the H heads.
 * forward (sign +1): y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) for halves x1, x2.
 * backward (sign -1): dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T(z) = (z2, -z1). */
void rotary(const float *x, const float *cos, const float *sin, float *y, long R, long H, long Dh, int backward,
            int threads) {
    long half = Dh / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < R; r++) {
        const float *c = cos + r * Dh, *s = sin + r * Dh;
        for (long h = 0; h < H; h++) {
            const float *xr = x + (r * H + h) * Dh;
            float *yr = y + (r * H + h) * Dh;
            if (!backward) {
                #pragma omp simd
                for (long d = 0; d < half; d++) {
                    yr[d] = xr[d] * c[d] + (-xr[d + half]) * s[d];
                    yr[d + half] = xr[d + half] * c[d + half] + xr[d] * s[d + half];
                }
            } else {
                #pragma omp simd
                for (long d = 0; d < half; d++) {
                    yr[d] = xr[d] * c[d] + xr[d + half] * s[d + half];
                    yr[d + half] = xr[d + half] * c[d + half] + (-(xr[d] * s[d]));
                }
            }
        }
    }
}

const char *speedllm_path(void) { return "portable C (" SPEEDLLM_ISA " build)"; } /* for task=doctor */
