/*
 * The projections of a bf16 model on a CPU with AVX512-BF16: y = x W^T (+ bias), over a weight
 * packed once at load time into the order the kernel reads it.
 *
 *   bf16_packed_matmul(wp, x, bias, y, rows, parts, out_features, in_features, y_f32, threads)
 *     wp    [out_features / 64][in_features / 2][64][2] bf16: W packed (bf16_pack_weight below,
 *           or the same permutation in torch); tile t holds output features 64 t .. 64 t + 63,
 *           and for each pair of inputs k, k + 1 the 64 features' two weights side by side
 *     x     [rows][parts][in_features] bf16: each row of the product is the sum over its parts
 *           (1 part: a bf16 activation; 2 parts: an fp32 row split into bf16 hi and lo, so that
 *           W (hi + lo) keeps 16 significant bits of it)
 *     bias  [out_features] fp32, or NULL
 *     y     [rows][out_features], bf16 (y_f32 0: each fp32 sum rounded to nearest even) or fp32
 *     threads  OpenMP threads (the caller passes torch's count)
 *
 * The micro-kernel keeps a tile of 6 rows by 64 features in 24 fp32 accumulators: per pair of
 * inputs it loads the tile's 4 weight vectors (256 contiguous bytes) and broadcasts each row's
 * pair of inputs, 24 VDPBF16PS for 4 loads and 6 broadcasts. No horizontal sums: each lane is one
 * output feature. The packed weight streams through memory in the order it lies, which is what
 * keeps a decode step (a few rows) at the memory bandwidth: the same product over the plain
 * [out, in] layout read 4 rows at a time ran at half of it. Every product of two bf16 numbers is
 * exact in fp32 and summed in fp32, as oneDNN's bf16 matmul does; only the order of the sums
 * differs.
 *
 * Work is split over (tile, block of up to 48 rows) pairs, tile-major, so that a thread reuses a
 * tile from its cache for up to 8 micro-kernel calls.
 *
 * Return codes: 0 done; 1 a size below 1 or not a multiple of the tile (out_features % 64,
 * in_features % 2) or parts not 1 or 2; 3 built without AVX512-BF16 (nothing computed).
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define TILE 64          /* output features per tile: 4 vectors of 16 fp32 lanes */
#define ROW_BLOCK 6      /* rows per micro-kernel call: 24 accumulators */
#define ROWS_PER_ITEM 48 /* rows per work item: 8 micro-kernel calls on one tile */

#ifdef __AVX512BF16__
static inline __attribute__((always_inline)) void
micro_kernel(const uint16_t *wt, const uint16_t *x, const float *bias, void *y, int64_t ldy,
             int64_t K, const int rb, const int parts, const int y_f32)
{
    __m512 acc[ROW_BLOCK][4];
    for (int j = 0; j < rb; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_ps();
    const int64_t ldx = parts * K;
    for (int64_t k = 0; k < K; k += 2) {
        const uint16_t *wk = wt + k * TILE;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
        const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
        for (int j = 0; j < rb; j++) {
            for (int p = 0; p < parts; p++) {
                int32_t pair;
                memcpy(&pair, x + j * ldx + p * K + k, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                acc[j][0] = _mm512_dpbf16_ps(acc[j][0], w0, xb);
                acc[j][1] = _mm512_dpbf16_ps(acc[j][1], w1, xb);
                acc[j][2] = _mm512_dpbf16_ps(acc[j][2], w2, xb);
                acc[j][3] = _mm512_dpbf16_ps(acc[j][3], w3, xb);
            }
        }
    }
    for (int j = 0; j < rb; j++)
        for (int i = 0; i < 4; i++) {
            __m512 v = acc[j][i];
            if (bias != NULL) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * i));
            if (y_f32)
                _mm512_storeu_ps((float *)y + j * ldy + 16 * i, v);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + j * ldy + 16 * i),
                                    (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* rows [r0, r1) of tile t, in micro-kernel calls of up to 6 rows */
static void item(const uint16_t *wp, const uint16_t *x, const float *bias, void *y, int64_t r0,
                 int64_t r1, int64_t t, int64_t V, int64_t K, int parts, int y_f32)
{
    const uint16_t *wt = wp + t * TILE * K;
    const float *bt = bias != NULL ? bias + t * TILE : NULL;
    const size_t ysize = y_f32 ? sizeof(float) : sizeof(uint16_t);
    for (int64_t r = r0; r < r1; r += ROW_BLOCK) {
        const int64_t left = r1 - r;
        const uint16_t *xr = x + r * parts * K;
        void *yr = (char *)y + (size_t)(r * V + t * TILE) * ysize;
        /* constant row counts and part counts: each case is its own unrolled kernel */
#define CALL(RB)                                                                  \
    do {                                                                          \
        if (parts == 1 && y_f32) micro_kernel(wt, xr, bt, yr, V, K, RB, 1, 1);    \
        else if (parts == 1) micro_kernel(wt, xr, bt, yr, V, K, RB, 1, 0);        \
        else if (y_f32) micro_kernel(wt, xr, bt, yr, V, K, RB, 2, 1);             \
        else micro_kernel(wt, xr, bt, yr, V, K, RB, 2, 0);                        \
    } while (0)
        switch (left >= ROW_BLOCK ? ROW_BLOCK : left) {
        case 6: CALL(6); break;
        case 5: CALL(5); break;
        case 4: CALL(4); break;
        case 3: CALL(3); break;
        case 2: CALL(2); break;
        default: CALL(1); break;
        }
#undef CALL
    }
}
#endif

int bf16_packed_matmul(const uint16_t *wp, const uint16_t *x, const float *bias, void *y,
                       int64_t rows, int64_t parts, int64_t out_features, int64_t in_features,
                       int64_t y_f32, int64_t threads)
{
    if (rows == 0) return 0;
    if (rows < 0 || out_features < 1 || in_features < 1 || out_features % TILE != 0
        || in_features % 2 != 0 || (parts != 1 && parts != 2))
        return 1;
#ifdef __AVX512BF16__
    const int64_t tiles = out_features / TILE;
    const int64_t row_items = (rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    const int64_t items = tiles * row_items;
    const int nthreads = threads < 1 ? 1 : (int)(threads < items ? threads : items);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < items; n++) {
        const int64_t t = n / row_items, r0 = (n % row_items) * ROWS_PER_ITEM;
        const int64_t r1 = r0 + ROWS_PER_ITEM < rows ? r0 + ROWS_PER_ITEM : rows;
        item(wp, x, bias, y, r0, r1, t, out_features, in_features, (int)parts, (int)y_f32);
    }
    return 0;
#else
    (void)wp; (void)x; (void)bias; (void)y; (void)y_f32; (void)threads;
    return 3;
#endif
}

/* 1 where bf16_packed_matmul computes (this build's CPU has AVX512-BF16), else 0. */
int bf16_packed_matmul_available(void)
{
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}
