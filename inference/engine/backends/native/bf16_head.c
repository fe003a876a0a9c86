/*
 * The LM head of a bf16 model with fp32 logits, on CPU: y = x W^T (+ bias).
 *
 *   bf16_weight_matmul_f32(w, x, bias, y, rows, out_features, in_features)
 *     w    [out_features, in_features] bf16 (uint16_t storage, the upper half of an IEEE fp32)
 *     x    [rows, in_features] fp32
 *     bias [out_features] fp32, or NULL
 *     y    [rows, out_features] fp32
 *
 * Each weight row is widened to fp32 exactly (a 16-bit shift) into a per-thread buffer and
 * multiplied with every row of x in fp32, so y equals an fp32 matmul over the widened weight
 * (up to the order of the additions) while reading half its bytes: with few rows of x the head
 * is bound by memory bandwidth (49,152 x 576 weights: 57 MB instead of 113 MB per pass).
 * OpenMP over blocks of weight rows.
 *
 * On a CPU with AVX512-BF16 (compiled with -march=native there) and in_features a multiple of 32,
 * the products run on VDPBF16PS instead: x is split into two bf16 parts, hi = bf16(x) and
 * lo = bf16(x - hi), and y = W.hi + W.lo, each bf16 x bf16 product exact in fp32 and accumulated
 * in fp32. hi + lo carries 16 significant bits of x (relative error at most 2^-17), so y stays
 * within fp32 summation noise of the fp32 matmul, at the speed of a bf16 matmul.
 *
 * Return codes: 0 done; 1 a size below 1 (rows may be 0); 2 out of memory.
 */
#include <stdint.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define WEIGHT_ROWS_PER_BLOCK 16

static inline float widen_one(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#ifdef __AVX512BF16__
static inline uint16_t round_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* y[r, v] for one weight row v and one row r of x (the edges of the blocked loop). */
static inline float dot_one(const uint16_t *wv, const uint16_t *xr, int64_t in_features)
{
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < in_features; k += 32) {
        const __m512bh wk = (__m512bh)_mm512_loadu_si512(wv + k);
        acc = _mm512_dpbf16_ps(acc, wk, (__m512bh)_mm512_loadu_si512(xr + k));
        acc = _mm512_dpbf16_ps(acc, wk, (__m512bh)_mm512_loadu_si512(xr + in_features + k));
    }
    return _mm512_reduce_add_ps(acc);
}

/* xs: [rows][2][in_features] bf16, hi then lo of each row of x. Blocks of 4 weight rows by 4
 * rows of x: 16 accumulators, and per 32 inputs 4 weight loads and 8 x loads for 32 products,
 * the 4 weight rows staying in L1 while x streams past them. */
static void dot_bf16_pairs(const uint16_t *w, const uint16_t *xs, const float *bias, float *y,
                           int64_t rows, int64_t out_features, int64_t in_features)
{
    const int64_t K = in_features, X = 2 * in_features, V = out_features;
#pragma omp parallel for schedule(static)
    for (int64_t v0 = 0; v0 < V; v0 += 4) {
        const uint16_t *wv = w + v0 * K;
        int64_t r0 = 0;
        if (v0 + 4 <= V) {
            for (; r0 + 4 <= rows; r0 += 4) {
                __m512 acc[4][4];
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
                const uint16_t *xr = xs + r0 * X;
                for (int64_t k = 0; k < K; k += 32) {
                    __m512bh wk[4];
                    for (int i = 0; i < 4; i++)
                        wk[i] = (__m512bh)_mm512_loadu_si512(wv + i * K + k);
                    for (int j = 0; j < 4; j++) {
                        const __m512bh hi = (__m512bh)_mm512_loadu_si512(xr + j * X + k);
                        const __m512bh lo = (__m512bh)_mm512_loadu_si512(xr + j * X + K + k);
                        for (int i = 0; i < 4; i++) {
                            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wk[i], hi);
                            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wk[i], lo);
                        }
                    }
                }
                for (int i = 0; i < 4; i++) {
                    const float b = bias != NULL ? bias[v0 + i] : 0.0f;
                    for (int j = 0; j < 4; j++)
                        y[(r0 + j) * V + v0 + i] = _mm512_reduce_add_ps(acc[i][j]) + b;
                }
            }
        }
        /* the rows of x left over, and the last block of fewer than 4 weight rows */
        for (int64_t v = v0; v < v0 + 4 && v < V; v++)
            for (int64_t r = r0; r < rows; r++)
                y[r * V + v] = dot_one(w + v * K, xs + r * X, K) + (bias != NULL ? bias[v] : 0.0f);
    }
}
#endif

int bf16_weight_matmul_f32(const uint16_t *w, const float *x, const float *bias, float *y,
                           int64_t rows, int64_t out_features, int64_t in_features)
{
    if (rows == 0) return 0;
    if (rows < 0 || out_features < 1 || in_features < 1) return 1;
    if ((size_t)in_features > SIZE_MAX / sizeof(float) / WEIGHT_ROWS_PER_BLOCK) return 2;
#ifdef __AVX512BF16__
    if (in_features % 32 == 0 && (size_t)rows <= SIZE_MAX / 4 / (size_t)in_features) {
        uint16_t *xs = (uint16_t *)malloc(sizeof(uint16_t) * 2 * (size_t)rows * (size_t)in_features);
        if (xs == NULL) return 2;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < in_features; k++) {
                const float f = x[r * in_features + k];
                const uint16_t hi = round_to_bf16(f);
                xs[r * 2 * in_features + k] = hi;
                xs[r * 2 * in_features + in_features + k] = round_to_bf16(f - widen_one(hi));
            }
        dot_bf16_pairs(w, xs, bias, y, rows, out_features, in_features);
        free(xs);
        return 0;
    }
#endif
    int failed = 0;
#pragma omp parallel
    {
        float *wbuf = (float *)malloc(sizeof(float) * (size_t)in_features * WEIGHT_ROWS_PER_BLOCK);
        if (wbuf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t v0 = 0; v0 < out_features; v0 += WEIGHT_ROWS_PER_BLOCK) {
            if (wbuf == NULL) continue;
            const int64_t n = out_features - v0 < WEIGHT_ROWS_PER_BLOCK
                                  ? out_features - v0 : WEIGHT_ROWS_PER_BLOCK;
            const uint16_t *src = w + v0 * in_features;
            for (int64_t i = 0; i < n * in_features; i++) wbuf[i] = widen_one(src[i]);
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = x + r * in_features;
                float *yr = y + r * out_features + v0;
                for (int64_t j = 0; j < n; j++) {
                    const float *wj = wbuf + j * in_features;
                    float acc = 0.0f;
                    for (int64_t k = 0; k < in_features; k++) acc += wj[k] * xr[k];
                    yr[j] = bias != NULL ? acc + bias[v0 + j] : acc;
                }
            }
        }
        free(wbuf);
    }
    return failed ? 2 : 0;
}

/* 1 where the products run on VDPBF16PS (this build's CPU has AVX512-BF16), else 0. */
int bf16_weight_matmul_uses_dpbf16(void)
{
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}
