/* speedllm/ops/batch_invariant.c's AMX kernel (bi_amx_mm) on any AVX512-BF16 CPU, for
 * tests/test_batch_invariant.py: the tile instructions it uses, in plain C on per-thread tile registers (16 rows of
 * 64 bytes, as its tiles_configure sets them), so the kernel's packing, blocking, K chunks and writes run where
 * there is no AMX. A tdpbf16ps here adds its 32 products in k's order; the hardware's order within one is its own.
 * Built with -DKERNEL_SOURCE='"<path of batch_invariant.c>"' and the avx512 path's flags. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_loadconfig
#undef _tile_release

static __thread unsigned char tile[8][16 * 64];

static void tile_load(int t, const void *base, long stride) {
    for (int r = 0; r < 16; r++) memcpy(tile[t] + r * 64, (const char *)base + r * stride, 64);
}

static void tile_store(int t, void *base, long stride) {
    for (int r = 0; r < 16; r++) memcpy((char *)base + r * stride, tile[t] + r * 64, 64);
}

static float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* c[m][n] += sum over pairs p of a[m][2p + j] b[p][n][j], j = 0, 1 (b: 16 pairs of 16 columns x 2, VNNI) */
static void tile_dpbf16ps(int c, int a, int b) {
    float *acc = (float *)tile[c];
    const uint16_t *x = (const uint16_t *)tile[a], *y = (const uint16_t *)tile[b];
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++)
            for (int p = 0; p < 16; p++)
                for (int j = 0; j < 2; j++)
                    acc[m * 16 + n] += widen(x[m * 32 + 2 * p + j]) * widen(y[p * 32 + 2 * n + j]);
}

#define _tile_loadd(t, base, stride) tile_load(t, base, stride)
#define _tile_stored(t, base, stride) tile_store(t, base, stride)
#define _tile_zero(t) memset(tile[t], 0, sizeof tile[t])
#define _tile_dpbf16ps(c, a, b) tile_dpbf16ps(c, a, b)
#define _tile_loadconfig(config) ((void)(config))
#define _tile_release() ((void)0)
#define __AMX_TILE__ 1
#define __AMX_BF16__ 1
#include KERNEL_SOURCE
