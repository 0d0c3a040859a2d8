/* Batch-invariant CPU kernels (hardware.batch_invariant): a matmul and an attention whose every output element is
 * summed in one fixed order, whatever the number of rows, the rows beside it, the key length or the thread count.
 *
 *   mm:        y[m, n] = sum_k x[m, k] w[n, k]; x [M, K], w [N, K] (a linear layer's weight), y [M, N]; batched
 *              (bmm: `batch` such products back to back, one call)
 *   attention: o[b, h, i] = sum_j softmax_j(scale q_i . k_j) v_j over the keys j query i may attend to (the causal
 *              ones, the queries being the last S of the T keys, or those a [B, S, T] mask allows), GQA
 *
 * A dot product over K keeps 16 partial sums, lane l taking the k = l (mod 16) terms in order, then adds the lanes
 * in a fixed tree; a softmax runs over the allowed keys in key order. So a token's values are the same bits in a
 * decode step (1 row, a cache of its past keys) as in a training forward (every row, every key), which is what
 * makes the rollout's log-probabilities equal the trainer's. Library GEMMs pick their blocking from the shape (on
 * a Zen 4, oneDNN's fp32 rows differ for M < 12 not a multiple of 4) and SDPA splits the keys by length.
 *
 * bf16 operands are widened to fp32 (exact), products and sums are fp32, a bf16 result is rounded to nearest
 * even. Plain C for the compiler to vectorize (the 16 lanes are independent, so vectorizing keeps the order); built
 * by speedllm/native.py for this CPU (-march=native: FMA where the CPU has it, on every call alike). All arrays are
 * contiguous, row-major.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;
#define LANES 16
#define RB 4 /* rows of x per block */
#define CB 4 /* rows of w per block */

static inline float bf16_load(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float lanes_sum(const float *a) { /* the fixed tree: 16 -> 8 -> 4 -> 2 -> 1 */
    float t[8];
    for (int l = 0; l < 8; l++) t[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) t[l] = t[l] + t[l + 4];
    for (int l = 0; l < 2; l++) t[l] = t[l] + t[l + 2];
    return t[0] + t[1];
}

/* out[r][c] = the fixed-order dot of rows r of a and c of b (length K), for r < ra, c < cb; rows past ra (cb) repeat
 * the last one and are not written */
#define DOTS(NAME, T, LOAD)                                                                                            \
    static void NAME(const T *a, const T *b, long ra, long cb, long K, float out[RB][CB]) {                         \
        const T *ar[RB], *bc[CB];                                                                                    \
        for (int r = 0; r < RB; r++) ar[r] = a + (r < ra ? r : ra - 1) * K;                                          \
        for (int c = 0; c < CB; c++) bc[c] = b + (c < cb ? c : cb - 1) * K;                                          \
        float acc[RB][CB][LANES];                                                                                    \
        memset(acc, 0, sizeof acc);                                                                                  \
        long k = 0;                                                                                                  \
        for (; k + LANES <= K; k += LANES)                                                                           \
            for (int r = 0; r < RB; r++)                                                                             \
                for (int c = 0; c < CB; c++)                                                                         \
                    for (int l = 0; l < LANES; l++) acc[r][c][l] += LOAD(ar[r][k + l]) * LOAD(bc[c][k + l]);         \
        for (int r = 0; r < RB; r++)                                                                                 \
            for (int c = 0; c < CB; c++)                                                                             \
                for (int l = 0; l < K - k; l++) acc[r][c][l] += LOAD(ar[r][k + l]) * LOAD(bc[c][k + l]);            \
        for (int r = 0; r < ra; r++)                                                                                 \
            for (int c = 0; c < cb; c++) out[r][c] = lanes_sum(acc[r][c]);                                           \
    }

static inline float f32_load(float f) { return f; }
static inline float f32_store(float f) { return f; }

#if defined(__AVX512F__)
#include <immintrin.h>
/* The same lanes as DOTS: 16 fp32 lanes per output, FMA, lane l taking k = l (mod 16), the fixed tree at the end */
#define BLOCK_SETUP(T)                                                                                                 \
    const T *ar[RB], *bc[CB];                                                                                        \
    for (int r = 0; r < RB; r++) ar[r] = a + (r < ra ? r : ra - 1) * K;                                              \
    for (int c = 0; c < CB; c++) bc[c] = b + (c < cb ? c : cb - 1) * K;                                              \
    __m512 acc[RB][CB];                                                                                              \
    for (int r = 0; r < RB; r++)                                                                                     \
        for (int c = 0; c < CB; c++) acc[r][c] = _mm512_setzero_ps();

#define BLOCK_OUT                                                                                                      \
    for (int r = 0; r < ra; r++)                                                                                     \
        for (int c = 0; c < cb; c++) {                                                                               \
            float lanes[LANES];                                                                                      \
            _mm512_storeu_ps(lanes, acc[r][c]);                                                                      \
            out[r][c] = lanes_sum(lanes);                                                                            \
        }

static void dots_f32(const float *a, const float *b, long ra, long cb, long K, float out[RB][CB]) {
    BLOCK_SETUP(float)
    long k = 0;
    for (; k + LANES <= K; k += LANES) {
        __m512 av[RB], bv[CB];
        for (int r = 0; r < RB; r++) av[r] = _mm512_loadu_ps(ar[r] + k);
        for (int c = 0; c < CB; c++) bv[c] = _mm512_loadu_ps(bc[c] + k);
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) acc[r][c] = _mm512_fmadd_ps(av[r], bv[c], acc[r][c]);
    }
    if (k < K) {
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        __m512 av[RB], bv[CB];
        for (int r = 0; r < RB; r++) av[r] = _mm512_maskz_loadu_ps(m, ar[r] + k);
        for (int c = 0; c < CB; c++) bv[c] = _mm512_maskz_loadu_ps(m, bc[c] + k);
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) acc[r][c] = _mm512_fmadd_ps(av[r], bv[c], acc[r][c]);
    }
    BLOCK_OUT
}

#if defined(__AVX512BF16__)
/* AVX512-BF16: vdpbf16ps adds a pair of bf16 products into each fp32 lane (lane l: k = 2l, 2l + 1 mod 32), one
 * fixed order of its own */
static void dots_bf16(const bf16 *a, const bf16 *b, long ra, long cb, long K, float out[RB][CB]) {
    BLOCK_SETUP(bf16)
    long k = 0;
    for (; k + 2 * LANES <= K; k += 2 * LANES) {
        __m512bh av[RB], bv[CB];
        for (int r = 0; r < RB; r++) av[r] = (__m512bh)_mm512_loadu_si512(ar[r] + k);
        for (int c = 0; c < CB; c++) bv[c] = (__m512bh)_mm512_loadu_si512(bc[c] + k);
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], av[r], bv[c]);
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh av[RB], bv[CB];
        for (int r = 0; r < RB; r++) av[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, ar[r] + k);
        for (int c = 0; c < CB; c++) bv[c] = (__m512bh)_mm512_maskz_loadu_epi16(m, bc[c] + k);
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], av[r], bv[c]);
    }
    BLOCK_OUT
}
#else
static inline __m512 widen16(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static void dots_bf16(const bf16 *a, const bf16 *b, long ra, long cb, long K, float out[RB][CB]) {
    BLOCK_SETUP(bf16)
    for (long k = 0; k < K; k += LANES) {
        __mmask16 m = K - k >= LANES ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        __m512 av[RB], bv[CB];
        for (int r = 0; r < RB; r++) av[r] = widen16(ar[r] + k, m);
        for (int c = 0; c < CB; c++) bv[c] = widen16(bc[c] + k, m);
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) acc[r][c] = _mm512_fmadd_ps(av[r], bv[c], acc[r][c]);
    }
    BLOCK_OUT
}
#endif
#else
DOTS(dots_f32, float, f32_load)
DOTS(dots_bf16, bf16, bf16_load)
#endif

/* Tiles of RB x CB outputs; w's rows go in chunks of about CHUNK_BYTES (kept in L2 while every row block of x
 * passes over them). The tiling decides only where a sum is computed, never its order. */
#define CHUNK_BYTES (192 * 1024)
#define MM(NAME, T, DOTS, STORE)                                                                                       \
    void NAME(const T *x, const T *w, T *y, long batch, long M, long N, long K, int threads) {                       \
        long mb = (M + RB - 1) / RB, nc = CHUNK_BYTES / (K * (long)sizeof(T)) / CB * CB;                             \
        nc = nc < CB ? CB : nc;                                                                                      \
        long chunks = (N + nc - 1) / nc, tiles = chunks * mb;                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads)") for (long t = 0; t < batch * tiles; t++) { \
            long i = t / tiles, m0 = (t % tiles % mb) * RB, ra = M - m0 < RB ? M - m0 : RB;                          \
            long first = (t % tiles / mb) * nc, last = first + nc < N ? first + nc : N;                              \
            const T *xi = x + i * M * K, *wi = w + i * N * K;                                                        \
            T *yi = y + i * M * N;                                                                                   \
            for (long n0 = first; n0 < last; n0 += CB) {                                                             \
                long cb = last - n0 < CB ? last - n0 : CB;                                                           \
                float out[RB][CB];                                                                                   \
                DOTS(xi + m0 * K, wi + n0 * K, ra, cb, K, out);                                                      \
                for (long r = 0; r < ra; r++)                                                                        \
                    for (long c = 0; c < cb; c++) yi[(m0 + r) * N + n0 + c] = STORE(out[r][c]);                      \
            }                                                                                                        \
        }                                                                                                            \
    }

MM(bi_mm, float, dots_f32, f32_store)
MM(bi_mm_bf16, bf16, dots_bf16, bf16_store)

/* mask: NULL (causal: query i sees keys j <= T - S + i) or uint8 [B, S, T] (nonzero: may attend). A query that may
 * attend to no key gets zeros. */
#define ATTENTION(NAME, T, LOAD, STORE)                                                                                \
    void NAME(const T *q, const T *k, const T *v, const uint8_t *mask, T *o, long B, long H, long KV, long S,         \
              long Tk, long D, float scale, int threads) {                                                           \
        long Dp = (D + LANES - 1) / LANES * LANES, group = H / KV;                                                   \
        _Pragma("omp parallel num_threads(threads)") {                                                               \
            float *qf = calloc(Dp, sizeof(float)), *kf = calloc(Dp, sizeof(float)), *s = malloc(Tk * sizeof(float)); \
            float *acc = malloc(D * sizeof(float));                                                                  \
            _Pragma("omp for schedule(static)") for (long row = 0; row < B * H * S; row++) {                         \
                long b = row / (H * S), h = row / S % H, i = row % S, kh = h / group;                                \
                const T *qi = q + row * D;                                                                           \
                const T *kb = k + (b * KV + kh) * Tk * D, *vb = v + (b * KV + kh) * Tk * D;                          \
                const uint8_t *allowed = mask ? mask + (b * S + i) * Tk : NULL;                                      \
                long end = mask ? Tk : Tk - S + i + 1;                                                               \
                for (long d = 0; d < D; d++) qf[d] = LOAD(qi[d]);                                                    \
                float top = -INFINITY;                                                                               \
                for (long j = 0; j < end; j++) {                                                                     \
                    if (allowed && !allowed[j]) continue;                                                            \
                    float lanes[LANES] = {0};                                                                        \
                    for (long d = 0; d < D; d++) kf[d] = LOAD(kb[j * D + d]);                                        \
                    for (long d0 = 0; d0 < Dp; d0 += LANES)                                                          \
                        for (int l = 0; l < LANES; l++) lanes[l] += qf[d0 + l] * kf[d0 + l];                         \
                    s[j] = lanes_sum(lanes) * scale;                                                                 \
                    top = s[j] > top ? s[j] : top;                                                                   \
                }                                                                                                    \
                float total = 0.0f;                                                                                  \
                for (long d = 0; d < D; d++) acc[d] = 0.0f;                                                          \
                for (long j = 0; j < end; j++) {                                                                     \
                    if (allowed && !allowed[j]) continue;                                                            \
                    float p = expf(s[j] - top);                                                                      \
                    total += p;                                                                                      \
                    for (long d = 0; d < D; d++) acc[d] += p * LOAD(vb[j * D + d]);                                  \
                }                                                                                                    \
                for (long d = 0; d < D; d++) o[row * D + d] = STORE(total > 0.0f ? acc[d] / total : 0.0f);           \
            }                                                                                                        \
            free(qf);                                                                                                \
            free(kf);                                                                                                \
            free(s);                                                                                                 \
            free(acc);                                                                                               \
        }                                                                                                            \
    }

ATTENTION(bi_attention, float, f32_load, f32_store)
ATTENTION(bi_attention_bf16, bf16, bf16_load, bf16_store)
