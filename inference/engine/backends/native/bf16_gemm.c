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
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
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

#ifdef HAVE_AMX
/*
 * The same product on AMX tiles (TDPBF16PS), where the CPU has them: x is read as a matrix of
 * rows * parts rows, in blocks of 32 (two A tiles of 16 rows by 32 inputs, zero-padded past the
 * last row), against two B tiles of 16 features each read straight from the packed weight (a
 * tile row is one pair of inputs for 16 features: 64 bytes, 256 bytes apart), into four C tiles
 * of 16 by 16 fp32 sums; each packed tile of 64 features takes two such passes. The parts of a
 * row (hi, lo) are adjacent rows of the matrix, summed in fp32 with the bias before the one
 * rounding. Every product of two bf16 numbers is exact in fp32 and summed in fp32, as above.
 */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_BLOCK 32 /* matrix rows per work item */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config_t;

static int amx_state = -1;         /* -1 not asked, 0 refused, 1 granted */
static int64_t amx_min_rows = 4;   /* rows * parts from which the AMX path runs; 0: never */

static int amx_ready(void)
{
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state < 0) {
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state;
}

static void amx_item(const uint16_t *wp, const uint16_t *x, const float *bias, void *y,
                     int64_t a0, int64_t a_rows, int64_t t, int64_t V, int64_t K, int parts,
                     int y_f32, uint16_t *pad, float *cbuf)
{
    const int64_t m = a_rows - a0 < AMX_BLOCK ? a_rows - a0 : AMX_BLOCK;
    const uint16_t *a = x + a0 * K;
    if (m < AMX_BLOCK) {  /* the last block: its rows, then zeros */
        memcpy(pad, a, sizeof(uint16_t) * (size_t)(m * K));
        memset(pad + m * K, 0, sizeof(uint16_t) * (size_t)((AMX_BLOCK - m) * K));
        a = pad;
    }
    const uint16_t *wt = wp + t * TILE * K;
    for (int half = 0; half < 2; half++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
            const uint16_t *b = wt + (k / 2) * (TILE * 2) + half * 64;
            _tile_loadd(4, a + k, K * 2);
            _tile_loadd(5, a + 16 * K + k, K * 2);
            _tile_loadd(6, b, TILE * 4);
            _tile_loadd(7, b + 32, TILE * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, cbuf, 32 * 4);
        _tile_stored(1, cbuf + 16, 32 * 4);
        _tile_stored(2, cbuf + 16 * 32, 32 * 4);
        _tile_stored(3, cbuf + 16 * 32 + 16, 32 * 4);
        const int64_t f0 = t * TILE + half * 32;
        for (int64_t j = 0; j < m; j += parts) {
            const int64_t row = (a0 + j) / parts;
            for (int c = 0; c < 32; c += 16) {
                __m512 v = _mm512_loadu_ps(cbuf + j * 32 + c);
                if (parts == 2) v = _mm512_add_ps(v, _mm512_loadu_ps(cbuf + (j + 1) * 32 + c));
                if (bias != NULL) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + f0 + c));
                if (y_f32)
                    _mm512_storeu_ps((float *)y + row * V + f0 + c, v);
                else
                    _mm256_storeu_si256((__m256i *)((uint16_t *)y + row * V + f0 + c),
                                        (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    }
}

/* 0 done, 2 out of memory for the padded rows (nothing written: the caller falls back) */
static int amx_matmul(const uint16_t *wp, const uint16_t *x, const float *bias, void *y,
                      int64_t rows, int parts, int64_t V, int64_t K, int y_f32, int64_t threads)
{
    const int64_t a_rows = rows * parts, tiles = V / TILE;
    const int64_t blocks = (a_rows + AMX_BLOCK - 1) / AMX_BLOCK, items = tiles * blocks;
    const int nthreads = threads < 1 ? 1 : (int)(threads < items ? threads : items);
    uint16_t *pads = NULL;
    if (a_rows % AMX_BLOCK) {  /* a padded last block for each thread */
        pads = malloc(sizeof(uint16_t) * (size_t)(nthreads * AMX_BLOCK * K));
        if (pads == NULL) return 2;
    }
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t *pad = pads ? pads + (int64_t)omp_get_thread_num() * AMX_BLOCK * K : NULL;
        float cbuf[AMX_BLOCK * 32] __attribute__((aligned(64)));
        tile_config_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        for (int i = 0; i < 8; i++) {
            cfg.rows[i] = 16;
            cfg.colsb[i] = 64;
        }
        _tile_loadconfig(&cfg);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < items; n++)
            amx_item(wp, x, bias, y, (n % blocks) * AMX_BLOCK, a_rows, n / blocks, V, K, parts,
                     y_f32, pad, cbuf);
        _tile_release();
    }
    free(pads);
    return 0;
}
#endif

/* Rows * parts from which bf16_packed_matmul runs on AMX tiles (0: never); returns the setting
 * before, or -1 where this build has no AMX path (the CPU lacks it, or the OS refused it). */
int64_t bf16_packed_matmul_amx_min_rows(int64_t min_rows)
{
#ifdef HAVE_AMX
    if (!amx_ready()) return -1;
    const int64_t before = amx_min_rows;
    if (min_rows >= 0) amx_min_rows = min_rows;
    return before;
#else
    (void)min_rows;
    return -1;
#endif
}

int bf16_packed_matmul(const uint16_t *wp, const uint16_t *x, const float *bias, void *y,
                       int64_t rows, int64_t parts, int64_t out_features, int64_t in_features,
                       int64_t y_f32, int64_t threads)
{
    if (rows == 0) return 0;
    if (rows < 0 || out_features < 1 || in_features < 1 || out_features % TILE != 0
        || in_features % 2 != 0 || (parts != 1 && parts != 2))
        return 1;
#ifdef __AVX512BF16__
#ifdef HAVE_AMX
    if (amx_min_rows > 0 && rows * parts >= amx_min_rows && in_features % 32 == 0
        && amx_ready()
        && amx_matmul(wp, x, bias, y, rows, (int)parts, out_features, in_features, (int)y_f32,
                      threads) == 0)
        return 0;
#endif
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
