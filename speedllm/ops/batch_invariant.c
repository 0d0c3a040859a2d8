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
 * contiguous, row-major. The avx512 path (SPEEDLLM_ISA_AVX512) writes the same lanes in intrinsics, and adds the
 * packed matmuls at the end of this file (fp32 FMA; bf16 AMX, AVX512-BF16), which have orders of their own.
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

#if defined(SPEEDLLM_ISA_AVX512) && defined(__AVX512F__)
#include <immintrin.h>
/* bf16 in the same lanes as DOTS: 16 fp32 lanes per output, FMA, lane l taking k = l (mod 16), the fixed tree at
 * the end (the bf16 matmul of an avx512 CPU without AVX512-BF16) */
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
#else
DOTS(dots_bf16, bf16, bf16_load)
#endif
DOTS(dots_f32, float, f32_load) /* on the avx512 path fp32 matmuls run packed (bi_fma_mm) */

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

/* Packed matmuls (the avx512 path): fp32 on FMA lanes; bf16 on AMX tiles (tdpbf16ps) where the CPU has AMX, else on
 * vdpbf16ps lanes where it has AVX512-BF16. One packing and one blocking for the three.
 *
 *   bi_fma_mm (fp32), bi_dp_mm, bi_amx_mm (bf16): z[r, c] = sum_k P[r, k] Q[c, k], written y[r * ysr + c * ysc],
 *              for P [R, K], Q [C, K] and y of the kernel's dtype, given by pointer and strides; batched
 *
 * The caller lets P be either operand of a matmul (y = a b: P = a, Q = b^T, or P = b^T, Q = a with y transposed):
 * a product is the same bits either way round, so z[r, c] is too. A P whose rows are K-contiguous, K a multiple of
 * 32, is read in place (a linear layer's weight, a row-major activation); anything else is copied into a
 * zero-padded [16-row blocks, K32] buffer, and Q always into tiles of 16 columns x 32 k: bf16 pair-interleaved
 * (VNNI), the layout both bf16 instructions take, fp32 by k then column. Every z[r, c] sums over k in k's order:
 * an FMA lane adds P[r, k] Q[c, k] one k at a time, a vdpbf16ps lane the pairs (k, k + 1), a tdpbf16ps its 32
 * products in the hardware's one order. The K range may be cut into chunks with the accumulators kept in fp32
 * memory between them, which adds nothing. Rows and columns past R and C are zeros in a tile of their own rows:
 * so a row's result depends on nothing but its row, the other operand and K, whatever R, C, the chunking or the
 * thread count. */
#if defined(SPEEDLLM_ISA_AVX512) && defined(__AVX512BW__)
#include <immintrin.h>

#define KC 512            /* the K of one pass over the accumulators */
#define QCOLS 1024        /* the columns of Q one pass keeps in L2 (QCOLS x KC: 1 MiB in bf16, 2 in fp32) */

#define COPY_RAGGED(T, S, CVT)                                                                                         \
    for (long k = 0; k < K; k++)                                                                                     \
        for (long r = 0; r < rows; r++) ((T *)block)[r * K32 + k] = CVT(((const S *)p)[(b + r) * sr + k * sk]);

static inline bf16 bf16_keep(bf16 h) { return h; }
static inline float f32_keep(float f) { return f; }

/* rows [r0, r1) of P (elements of EP bytes) as rows of K32 elements of E bytes (zeros past R and K), 16 rows at a
 * time, fp32 rounded to bf16 where E is 2 and EP 4 (the cast fused into the packing); a P stored by columns (sr 1,
 * the transpose of a row-major matrix) is read a row of its storage at a time */
static void pack_rows(const void *p, long sr, long sk, long EP, long E, long R, long K, long K32, long r0, long r1,
                      char *dst, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads)") for (long b = r0; b < r1; b += 16) {
        char *block = dst + (b - r0) * K32 * E;
        long rows = R - b < 16 ? (R - b > 0 ? R - b : 0) : 16;
        memset(block, 0, 16 * K32 * E);
        if (sk == 1 && EP == E)
            for (long r = 0; r < rows; r++) memcpy(block + r * K32 * E, (const char *)p + (b + r) * sr * E, K * E);
        else if (EP != E)
            COPY_RAGGED(bf16, float, bf16_store)
        else if (E == 2)
            COPY_RAGGED(bf16, bf16, bf16_keep)
        else
            COPY_RAGGED(float, float, f32_keep)
    }
}

/* Q [C, K] (bf16, or fp32 rounded to bf16 as it is packed) into tiles [column block of 16][k block of 32][pair kp]
 * [column c][2]: element (c, 2 kp + j) at kp * 32 + 2 c + j, the layout tdpbf16ps and vdpbf16ps take for their
 * second source */
#define PACK_PAIRS(NAME, S, CVT)                                                                                       \
    static void NAME(const S *q, long sc, long sk, long C, long K, long KB, bf16 *dst, int threads) {                \
        long blocks = (C + 15) / 16;                                                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads)") for (long t = 0; t < blocks * KB; t++) {   \
            long cb = t / KB, kb = t % KB, c0 = cb * 16, k0 = kb * 32;                                               \
            bf16 *tile = dst + t * 512;                                                                              \
            if (c0 + 16 <= C && k0 + 32 <= K) { /* a whole tile: the layout's two cases */                          \
                const S *src = q + c0 * sc + k0 * sk;                                                                \
                if (sk == 1) /* rows of K: a 16 x 16 transpose of pairs */                                          \
                    for (long c = 0; c < 16; c++)                                                                    \
                        for (long kp = 0; kp < 16; kp++) {                                                           \
                            tile[kp * 32 + 2 * c] = CVT(src[c * sc + 2 * kp]);                                       \
                            tile[kp * 32 + 2 * c + 1] = CVT(src[c * sc + 2 * kp + 1]);                               \
                        }                                                                                            \
                else /* columns in rows of C (sc == 1 the common case): interleave two rows of k */                 \
                    for (long kp = 0; kp < 16; kp++)                                                                 \
                        for (long c = 0; c < 16; c++) {                                                              \
                            tile[kp * 32 + 2 * c] = CVT(src[2 * kp * sk + c * sc]);                                  \
                            tile[kp * 32 + 2 * c + 1] = CVT(src[(2 * kp + 1) * sk + c * sc]);                        \
                        }                                                                                            \
                continue;                                                                                            \
            }                                                                                                        \
            for (long kp = 0; kp < 16; kp++)                                                                         \
                for (long c = 0; c < 16; c++)                                                                        \
                    for (long j = 0; j < 2; j++) {                                                                   \
                        long col = c0 + c, k = k0 + 2 * kp + j;                                                      \
                        tile[kp * 32 + 2 * c + j] = col < C && k < K ? CVT(q[col * sc + k * sk]) : 0;                \
                    }                                                                                                \
        }                                                                                                            \
    }
PACK_PAIRS(pack_pairs, bf16, bf16_keep)
PACK_PAIRS(pack_pairs_f32, float, bf16_store)

/* fp32 Q [C, K] into tiles [column block of 16][k block of 32][k][column c]: a k's 16 columns are one vector */
static void pack_cols(const float *q, long sc, long sk, long C, long K, long KB, float *dst, int threads) {
    long blocks = (C + 15) / 16;
    _Pragma("omp parallel for schedule(static) num_threads(threads)") for (long t = 0; t < blocks * KB; t++) {
        long c0 = t / KB * 16, k0 = t % KB * 32;
        float *tile = dst + t * 512;
        if (sk == 1) /* rows of K: read each column's k run */
            for (long c = 0; c < 16; c++)
                for (long kk = 0; kk < 32; kk++)
                    tile[kk * 16 + c] = c0 + c < C && k0 + kk < K ? q[(c0 + c) * sc + k0 + kk] : 0.0f;
        else
            for (long kk = 0; kk < 32; kk++)
                for (long c = 0; c < 16; c++)
                    tile[kk * 16 + c] = c0 + c < C && k0 + kk < K ? q[(c0 + c) * sc + (k0 + kk) * sk] : 0.0f;
    }
}

/* n <= 16 fp32 results to y[at + c * step], rounded to bf16 (nearest even, as bf16_store) unless y is fp32 */
static inline void write_row(const float *o, void *y, long at, long step, long n, int f32) {
    __mmask16 m = (__mmask16)((1u << n) - 1);
    __m512 v = _mm512_load_ps(o);
    if (f32 && step == 1) {
        _mm512_mask_storeu_ps((float *)y + at, m, v);
    } else if (f32) {
        for (long c = 0; c < n; c++) ((float *)y)[at + c * step] = o[c];
    } else {
        __m512i u = _mm512_castps_si512(v), lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
        __m256i h = _mm512_cvtepi32_epi16(r);
        if (step == 1) {
            _mm256_mask_storeu_epi16((bf16 *)y + at, m, h);
        } else {
            bf16 tmp[16];
            _mm256_storeu_si256((__m256i *)tmp, h);
            for (long c = 0; c < n; c++) ((bf16 *)y)[at + c * step] = tmp[c];
        }
    }
}

/* One block of 2 x 2 tiles of 16 x 16 outputs (P's 16-row blocks pa[i], i < na, row stride ps[i] elements; Q's
 * column tiles q[j], j < nb) over k in [k0, k1): the sums start at zero (first) or from acc (row stride as
 * floats), and end in acc, or in out[2 i + j] on the K range's last pass */
typedef void block_fn(const void *const pa[2], const long ps[2], long na, const void *const q[2], long nb, long k0,
                      long k1, int first, int last, float *acc, long as, float out[4][256]);

/* 8 rows x 16 nb columns at a time (8 nb accumulators): per STEP of k, Q's vector of each column tile and a row's
 * STEP elements broadcast to 16 lanes (BROADCAST), MADD'ed in */
#define ROWS(NAME, T, V, STEP, LOAD, BROADCAST, MADD)                                                                  \
    static inline __attribute__((always_inline)) void NAME(const T *const row[8], const T *const q[2], int nb,        \
                                                           long k0, long k1, int first, int last, float *acc,        \
                                                           long as, float *out0, float *out1) {                      \
        __m512 s[8][2];                                                                                              \
        for (int r = 0; r < 8; r++)                                                                                  \
            for (int j = 0; j < nb; j++)                                                                             \
                s[r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * as + j * 16);                       \
        for (long k = k0; k < k1; k += STEP) {                                                                       \
            long t = k / 32 * 512 + k % 32 * 16; /* k's vector (pair) in tile k / 32 */                             \
            V b[2];                                                                                                  \
            for (int j = 0; j < nb; j++) b[j] = LOAD(q[j] + t);                                                      \
            for (int r = 0; r < 8; r++) {                                                                            \
                V a = BROADCAST(row[r] + k);                                                                         \
                for (int j = 0; j < nb; j++) s[r][j] = MADD(s[r][j], a, b[j]);                                       \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < 8; r++)                                                                                  \
            for (int j = 0; j < nb; j++)                                                                             \
                _mm512_store_ps(last ? (j ? out1 : out0) + r * 16 : acc + r * as + j * 16, s[r][j]);                 \
    }                                                                                                                \
    static void block_##NAME(const void *const pa[2], const long ps[2], long na, const void *const qv[2], long nb,  \
                             long k0, long k1, int first, int last, float *acc, long as, float out[4][256]) {        \
        const T *q[2] = {qv[0], qv[1]};                                                                              \
        for (long i = 0; i < na; i++)                                                                                \
            for (long h = 0; h < 16; h += 8) {                                                                       \
                const T *row[8];                                                                                     \
                for (int r = 0; r < 8; r++) row[r] = (const T *)pa[i] + (h + r) * ps[i];                             \
                float *a = acc ? acc + (i * 16 + h) * as : NULL, *o0 = out[i * 2] + h * 16;                          \
                if (nb == 2)                                                                                         \
                    NAME(row, q, 2, k0, k1, first, last, a, as, o0, o0 + 256);                                       \
                else                                                                                                 \
                    NAME(row, q, 1, k0, k1, first, last, a, as, o0, o0 + 256);                                       \
            }                                                                                                        \
    }

static inline __m512 broadcast_f32(const float *x) { return _mm512_set1_ps(*x); }
static inline __m512 madd_f32(__m512 s, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, s); }
ROWS(fma_rows, float, __m512, 1, _mm512_load_ps, broadcast_f32, madd_f32)

#if defined(__AVX512BF16__)
static inline __m512bh load_pairs(const bf16 *x) { return (__m512bh)_mm512_load_si512(x); }
static inline __m512bh broadcast_pair(const bf16 *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}
ROWS(dp_rows, bf16, __m512bh, 2, load_pairs, broadcast_pair, _mm512_dpbf16_ps)
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

/* Linux lends the tile registers to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
 * 1 granted, 0 not (an older kernel, or a sandbox that refuses it) */
int bi_amx_ready(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void tiles_configure(void) { /* 0-3: accumulators, 4-5: P, 6-7: Q; every one 16 rows x 64 bytes */
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* AMX: tiles 0-3 the 2 x 2 accumulators, 4-5 P's rows, 6-7 Q's columns, one tdpbf16ps per 32 k */
static void block_amx(const void *const p[2], const long ps[2], long na, const void *const qv[2], long nb, long k0,
                      long k1, int first, int last, float *acc, long as, float out[4][256]) {
    const bf16 *pa[2] = {p[0], p[1]}, *q[2] = {qv[0], qv[1]};
    long ab = as * (long)sizeof(float);
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, acc, ab);
        if (nb == 2) _tile_loadd(1, acc + 16, ab);
        if (na == 2) _tile_loadd(2, acc + 16 * as, ab);
        if (na == 2 && nb == 2) _tile_loadd(3, acc + 16 * as + 16, ab);
    }
    for (long k = k0; k < k1; k += 32) {
        long t = k / 32 * 512;
        _tile_loadd(4, pa[0] + k, ps[0] * (long)sizeof(bf16));
        _tile_loadd(6, q[0] + t, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nb == 2) {
            _tile_loadd(7, q[1] + t, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (na == 2) {
            _tile_loadd(5, pa[1] + k, ps[1] * (long)sizeof(bf16));
            _tile_dpbf16ps(2, 5, 6);
            if (nb == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (!last) {
        _tile_stored(0, acc, ab);
        if (nb == 2) _tile_stored(1, acc + 16, ab);
        if (na == 2) _tile_stored(2, acc + 16 * as, ab);
        if (na == 2 && nb == 2) _tile_stored(3, acc + 16 * as + 16, ab);
        return;
    }
    _tile_stored(0, out[0], 64);
    _tile_stored(1, out[1], 64);
    _tile_stored(2, out[2], 64);
    _tile_stored(3, out[3], 64);
}
#endif

/* E: the element bytes the products take (4 fp32, 2 bf16); EP, EQ, EY those of P, Q and y: E, or 4 with E 2 (fp32
 * operands rounded to bf16 as they are packed; fp32 results, not rounded) */
static void packed_mm(block_fn *block, int amx, long E, const void *p, long EP, long spr, long spk, const void *q,
                      long EQ, long sqc, long sqk, void *y, long EY, long ysr, long ysc, long R, long C, long K,
                      int threads) {
    long KB = (K + 31) / 32, K32 = KB * 32, NRB = (R + 15) / 16, NCB = (C + 15) / 16;
    long R16 = NRB * 16, C16 = NCB * 16;
    char *qp = aligned_alloc(64, NCB * KB * 512 * E);
    if (E == 4)
        pack_cols(q, sqc, sqk, C, K, KB, (float *)qp, threads);
    else if (EQ == 4)
        pack_pairs_f32(q, sqc, sqk, C, K, KB, (bf16 *)qp, threads);
    else
        pack_pairs(q, sqc, sqk, C, K, KB, (bf16 *)qp, threads);
    /* P in place where it can be; else (or for the last partial block of 16 rows) packed */
    long packed_from = spk == 1 && K % 32 == 0 && EP == E ? R / 16 * 16 : 0;
    char *pp = NULL;
    if (packed_from < R16) {
        pp = aligned_alloc(64, (R16 - packed_from) * K32 * E);
        pack_rows(p, spr, spk, EP, E, R, K, K32, packed_from, R16, pp, threads);
    }
    float *acc = KB * 32 > KC ? aligned_alloc(64, R16 * C16 * sizeof(float)) : NULL; /* between K chunks */
    long RP = (NRB + 1) / 2;
    _Pragma("omp parallel num_threads(threads)") {
#ifdef HAVE_AMX
        if (amx) tiles_configure();
#endif
        float out[4][256] __attribute__((aligned(64)));
        for (long k0 = 0; k0 < K32; k0 += KC) {
            long k1 = k0 + KC < K32 ? k0 + KC : K32, first = k0 == 0, last = k1 == K32;
            for (long c0 = 0; c0 < NCB; c0 += QCOLS / 16) {
                long c1 = c0 + QCOLS / 16 < NCB ? c0 + QCOLS / 16 : NCB;
                _Pragma("omp for schedule(static)") for (long rp = 0; rp < RP; rp++) {
                    long rb = rp * 2, na = rb + 1 < NRB ? 2 : 1;
                    const void *pa[2];
                    long ps[2];
                    for (long i = 0; i < na; i++) {
                        long r = (rb + i) * 16;
                        int in_place = r < packed_from;
                        pa[i] = in_place ? (const char *)p + r * spr * E : pp + (r - packed_from) * K32 * E;
                        ps[i] = in_place ? spr : K32;
                    }
                    for (long cb = c0; cb < c1; cb += 2) {
                        long nb = cb + 1 < c1 ? 2 : 1;
                        const void *qt[2] = {qp + cb * KB * 512 * E, qp + (cb + nb - 1) * KB * 512 * E};
                        block(pa, ps, na, qt, nb, k0, k1, first, last, acc ? acc + rb * 16 * C16 + cb * 16 : NULL,
                              C16, out);
                        if (!last) continue;
                        for (long i = 0; i < na; i++)
                            for (long j = 0; j < nb; j++) {
                                const float *o = out[i * 2 + j];
                                long r0 = (rb + i) * 16, cc0 = (cb + j) * 16;
                                long rn = R - r0 < 16 ? R - r0 : 16, cn = C - cc0 < 16 ? C - cc0 : 16;
                                if (ysr == 1 && ysc != 1) { /* y holds z transposed: write its rows, z's columns */
                                    float col[16] __attribute__((aligned(64)));
                                    for (long c = 0; c < cn; c++) {
                                        for (long r = 0; r < 16; r++) col[r] = o[r * 16 + c];
                                        write_row(col, y, r0 + (cc0 + c) * ysc, 1, rn, EY == 4);
                                    }
                                } else {
                                    for (long r = 0; r < rn; r++)
                                        write_row(o + r * 16, y, (r0 + r) * ysr + cc0 * ysc, ysc, cn, EY == 4);
                                }
                            }
                    }
                }
            }
        }
#ifdef HAVE_AMX
        if (amx) _tile_release();
#endif
    }
    free(qp);
    free(pp);
    free(acc);
}

/* `batch` products back to back, P, Q and y of product i at i * (their batch stride) elements on; ep, eq, ey their
 * element bytes (packed_mm's EP, EQ, EY) */
#define PACKED_MM(NAME, BLOCK, AMX, E)                                                                                 \
    void NAME(const char *p, long spb, long spr, long spk, const char *q, long sqb, long sqc, long sqk, char *y,     \
              long syb, long ysr, long ysc, long batch, long R, long C, long K, int threads, long ep, long eq,       \
              long ey) {                                                                                             \
        for (long i = 0; i < batch; i++)                                                                             \
            packed_mm(BLOCK, AMX, E, p + i * spb * ep, ep, spr, spk, q + i * sqb * eq, eq, sqc, sqk,                 \
                      y + i * syb * ey, ey, ysr, ysc, R, C, K, threads);                                             \
    }

PACKED_MM(bi_fma_mm, block_fma_rows, 0, 4)
#if defined(__AVX512BF16__)
PACKED_MM(bi_dp_mm, block_dp_rows, 0, 2)
#endif
#ifdef HAVE_AMX
PACKED_MM(bi_amx_mm, block_amx, 1, 2)
#endif
#endif
