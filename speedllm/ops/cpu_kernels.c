#ifndef KERNELS_OF
/* Fused CPU kernels for the training step's elementwise ops: RMSNorm, SwiGLU, RoPE, forward and backward, the
 * cross-entropy's loss and logit gradient in one, and causal attention's softmax, forward and backward, for
 * fp32 tensors and for bf16 ones (suffix _bf16: the activations x, y, dy, dx in bf16; weights, cos/sin, rstd and
 * dw in fp32).
 *
 * Built by speedllm/native.py with the host's compiler (-O3 -march=native -fopenmp, for one kernel path: the avx2
 * path keeps AVX-512 off); the loops are written for the compiler's auto-vectorization (omp simd) and split over
 * rows with OpenMP. Each kernel is written once, as a macro over its activation type and that type's load and
 * store: a bf16 load widens to fp32 exactly (the 16 bits shifted left: one integer shift, on AVX2 too), a store
 * rounds to nearest even; all arithmetic and every accumulation is fp32. Same math as the `reference` op set
 * (speedllm/ops/reference.py, the twin the tests hold these against); only the order of additions differs, and in
 * bf16 the rounding of intermediate products the reference rounds. All arrays are contiguous, row-major.
 * Reproducible for a given thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_load(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 bf16_store(float f) { /* round to nearest even (a quiet NaN stays NaN) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* rows [*lo, *hi) of N for thread t of nt: contiguous blocks, so a reduction over rows is fixed per thread count */
static void split(long N, int t, int nt, long *lo, long *hi) {
    long base = N / nt, extra = N % nt;
    *lo = t * base + (t < extra ? t : extra);
    *hi = *lo + base + (t < extra);
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

/* the kernels, once per activation type: this file includes itself with KERNELS_OF set (T, LD, ST, NAME) */
#define KERNELS_OF float
#define T float
#define LD(v) (v)
#define ST(v) (v)
#define NAME(f) f
#include __FILE__
#undef T
#undef LD
#undef ST
#undef NAME
#define T bf16
#define LD(v) bf16_load(v)
#define ST(v) bf16_store(v)
#define NAME(f) f##_bf16
#include __FILE__

const char *speedllm_path(void) { return "portable C (" SPEEDLLM_ISA " build)"; } /* for task=doctor */

#else /* the kernels over activations of type T */
/* y = x * rstd * w per row of D, rstd[n] = 1 / sqrt(mean(x[n]^2) + eps) (kept for backward) */
void NAME(rms_norm_fwd)(const T *x, const float *w, T *y, float *rstd, long N, long D, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        const T *xr = x + n * D;
        T *yr = y + n * D;
        float ss = 0.0f;
        #pragma omp simd reduction(+ : ss)
        for (long d = 0; d < D; d++) ss += LD(xr[d]) * LD(xr[d]);
        float r = 1.0f / sqrtf(ss / (float)D + eps);
        rstd[n] = r;
        #pragma omp simd
        for (long d = 0; d < D; d++) yr[d] = ST(w[d] * (LD(xr[d]) * r));
    }
}

/* dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w, xhat = x * rstd; dw = sum over rows of dy * xhat
 * (dw NULL: not wanted). scratch: threads * D floats, one partial dw per thread, summed in thread order. */
void NAME(rms_norm_bwd)(const T *dy, const T *x, const float *w, const float *rstd, T *dx, float *dw,
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
            const T *dyr = dy + n * D, *xr = x + n * D;
            T *dxr = dx + n * D;
            float r = rstd[n], dot = 0.0f;
            #pragma omp simd reduction(+ : dot)
            for (long d = 0; d < D; d++) dot += LD(dyr[d]) * w[d] * (LD(xr[d]) * r);
            float c = dot / (float)D;
            #pragma omp simd
            for (long d = 0; d < D; d++) dxr[d] = ST(r * (LD(dyr[d]) * w[d] - (LD(xr[d]) * r) * c));
            if (dw) {
                #pragma omp simd
                for (long d = 0; d < D; d++) part[d] += LD(dyr[d]) * (LD(xr[d]) * r);
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

/* y = silu(g) * u over n elements */
void NAME(swiglu_fwd)(const T *g, const T *u, T *y, long n, int threads) {
    #pragma omp parallel for simd num_threads(threads) schedule(static)
    for (long i = 0; i < n; i++) {
        float gi = LD(g[i]);
        y[i] = ST(gi * sigmoid_f32(gi) * LD(u[i]));
    }
}

/* du = dy * silu(g), dg = dy * u * s * (1 + g * (1 - s)) with s = sigmoid(g) (recomputed, not saved) */
void NAME(swiglu_bwd)(const T *dy, const T *g, const T *u, T *dg, T *du, long n, int threads) {
    #pragma omp parallel for simd num_threads(threads) schedule(static)
    for (long i = 0; i < n; i++) {
        float gi = LD(g[i]), dyi = LD(dy[i]), s = sigmoid_f32(gi);
        du[i] = ST(dyi * (gi * s));
        dg[i] = ST(dyi * LD(u[i]) * (s * (1.0f + gi * (1.0f - s))));
    }
}

/* RoPE, rotate-half convention, x [R, H, Dh] with R = B * S positions, cos/sin [R, Dh] shared by the H heads.
 * forward (sign +1): y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) for halves x1, x2.
 * backward (sign -1): dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T(z) = (z2, -z1). */
void NAME(rotary)(const T *x, const float *cos, const float *sin, T *y, long R, long H, long Dh, int backward,
            int threads) {
    long half = Dh / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < R; r++) {
        const float *c = cos + r * Dh, *s = sin + r * Dh;
        for (long h = 0; h < H; h++) {
            const T *xr = x + (r * H + h) * Dh;
            T *yr = y + (r * H + h) * Dh;
            if (!backward) {
                #pragma omp simd
                for (long d = 0; d < half; d++) {
                    float x1 = LD(xr[d]), x2 = LD(xr[d + half]);
                    yr[d] = ST(x1 * c[d] + (-x2) * s[d]);
                    yr[d + half] = ST(x2 * c[d + half] + x1 * s[d + half]);
                }
            } else {
                #pragma omp simd
                for (long d = 0; d < half; d++) {
                    float x1 = LD(xr[d]), x2 = LD(xr[d + half]);
                    yr[d] = ST(x1 * c[d] + x2 * s[d + half]);
                    yr[d + half] = ST(x2 * c[d + half] + (-(x1 * s[d])));
                }
            }
        }
    }
}

/* Cross-entropy of logits [N, V] against labels (`ignore`: no loss), the logits replaced by the gradient of the
 * summed loss, softmax - one_hot (a zero row where ignored); loss[n] = logsumexp(row) - row[label] (0 where
 * ignored). Per row: its max; exp(x - max) into a per-thread fp32 row and their sum; the gradient. A row stays in
 * cache across the three passes, so memory sees one read and one write of the logits. */
void NAME(cross_entropy_grad)(T *logits, const int64_t *labels, float *loss, long N, long V, long ignore,
                              int threads) {
    #pragma omp parallel num_threads(threads)
    {
        float *e = malloc(V * sizeof(float));
        #pragma omp for schedule(static)
        for (long n = 0; n < N; n++) {
            T *row = logits + n * V;
            long y = labels[n];
            if (y == ignore) {
                memset(row, 0, V * sizeof(T));
                loss[n] = 0.0f;
                continue;
            }
            float m = -INFINITY, s = 0.0f;
            #pragma omp simd reduction(max : m)
            for (long v = 0; v < V; v++) { /* not fmaxf: GCC 12 leaves that loop scalar on bf16 (x4 slower) */
                float x = LD(row[v]);
                m = x > m ? x : m;
            }
            #pragma omp simd reduction(+ : s)
            for (long v = 0; v < V; v++) {
                e[v] = exp_f32(LD(row[v]) - m);
                s += e[v];
            }
            float inv = 1.0f / s;
            loss[n] = m + logf(s) - LD(row[y]);
            #pragma omp simd
            for (long v = 0; v < V; v++) row[v] = ST(e[v] * inv);
            row[y] = ST(e[y] * inv - 1.0f);
        }
        free(e);
    }
}

/* Causal softmax attention over rows of fp32 scores s = q k^T, [R, Tk]: row r is query r % S of its head, the
 * queries being the last S of the Tk keys, so it sees keys [0, Tk - S + r % S]. p = softmax(scale s) over those
 * keys, 0 after them (s is overwritten with exp on the way). */
void NAME(attention_softmax)(float *s, T *p, long R, long Tk, long S, float scale, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < R; r++) {
        float *sr = s + r * Tk;
        T *pr = p + r * Tk;
        long seen = Tk - S + r % S + 1;
        float m = -INFINITY, sum = 0.0f;
        #pragma omp simd reduction(max : m)
        for (long j = 0; j < seen; j++) m = sr[j] > m ? sr[j] : m;
        #pragma omp simd reduction(+ : sum)
        for (long j = 0; j < seen; j++) {
            sr[j] = exp_f32(scale * (sr[j] - m));
            sum += sr[j];
        }
        float inv = 1.0f / sum;
        #pragma omp simd
        for (long j = 0; j < seen; j++) pr[j] = ST(sr[j] * inv);
        memset(pr + seen, 0, (Tk - seen) * sizeof(T));
    }
}

/* Its backward to the scores: ds = scale p (dp - di) on the keys each row sees, 0 after them, from the forward's
 * p, dp = do v^T (fp32) and di, the row's sum of do o. */
void NAME(attention_softmax_grad)(const T *p, const float *dp, const float *di, T *ds, long R, long Tk, long S,
                                  float scale, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < R; r++) {
        const T *pr = p + r * Tk;
        const float *dr = dp + r * Tk;
        T *out = ds + r * Tk;
        long seen = Tk - S + r % S + 1;
        float d = di[r];
        #pragma omp simd
        for (long j = 0; j < seen; j++) out[j] = ST(scale * LD(pr[j]) * (dr[j] - d));
        memset(out + seen, 0, (Tk - seen) * sizeof(T));
    }
}

#endif
