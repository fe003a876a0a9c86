/*
 * Projections over weights as llama.cpp's GGUF files store them (ggml's Q4_1, and Q8_0 for the
 * tied embedding and LM head), read as they are: y = x W^T (+ bias), W dequantized a block at a
 * time inside the kernel.
 *
 *   q4_1_matmul(w, x, bias, y, rows, out_features, in_features, threads)
 *     w     [out_features][in_features / 32] blocks of ggml's block_q4_1, 20 bytes each: an
 *           fp16 scale d, an fp16 minimum m, then 16 bytes of 4-bit codes q; weight j of the
 *           block (0..15) is the low nibble of byte j, weight j + 16 its high nibble, and its
 *           value is d * q + m (ggml-quants.c, dequantize_row_q4_1)
 *     x     [rows][in_features] fp32
 *     bias  [out_features] fp32, or NULL
 *     y     [rows][out_features] fp32
 *     threads  OpenMP threads (the caller passes torch's count)
 *
 *   q4_1_dequantize(w, out, out_features, in_features, threads)
 *     the same weight as [out_features][in_features] fp32 (for many rows, where a dense matmul
 *     over the dequantized weight beats the fused product)
 *
 *   q8_0_matmul(w, x, bias, y, rows, out_features, in_features, threads)
 *   q8_0_dequantize(w, out, out_features, in_features, threads)
 *     the same over ggml's block_q8_0, 34 bytes for 32 weights: an fp16 scale d, then 32 int8
 *     codes q; a weight's value is d * q (ggml-quants.c, dequantize_row_q8_0)
 *
 * The fused product dequantizes each block once per tile of up to 4 rows (4 vectors of 8 fp32
 * lanes: the codes widened to fp32, then d * q + m in one FMA each) and accumulates the tile's
 * rows with 16 FMAs; each output feature is one thread's, so no sums cross threads. A decode
 * step reads each weight byte once: 0.625 bytes a weight against 2 for bf16 and 4 for fp32. The
 * AVX2 + F16C + FMA path is compiled where the CPU has them (-march=native); elsewhere a plain C
 * loop computes the same sums.
 *
 * The Q8_0 product has the same structure: each block's 32 codes widened to fp32 and scaled in
 * 4 vectors, then 16 FMAs per 4 rows.
 *
 * Return codes: 0 done; 1 a size below 1 or in_features not a multiple of 32.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define Q4_SIMD 1
#endif

#define QK 32          /* weights per block */
#define BLOCK_BYTES 20 /* Q4_1: 2 + 2 + 16 */
#define Q8_BYTES 34    /* Q8_0: 2 + 32 */
#define ROW_TILE 4

static float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void block_values(const uint8_t *b, float *v) {
    uint16_t hd, hm;
    memcpy(&hd, b, 2);
    memcpy(&hm, b + 2, 2);
    const float d = fp16_to_fp32(hd), m = fp16_to_fp32(hm);
    for (int j = 0; j < 16; j++) {
        v[j] = d * (float)(b[4 + j] & 0x0f) + m;
        v[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}


typedef void (*tile_fn)(const uint8_t *, int64_t, const float *, int64_t, int64_t, int,
                        float *);
typedef void (*values_fn)(const uint8_t *, float *);

/* y = x W^T (+ bias) over blocks of block_bytes, each output feature's row tiles by tile. */
static int matmul(tile_fn tile, int64_t block_bytes, const uint8_t *w, const float *x,
                  const float *bias, float *y, int64_t rows, int64_t out_features,
                  int64_t in_features, int threads) {
    if (rows < 1 || out_features < 1 || in_features < 1 || in_features % QK) return 1;
    const int64_t nb = in_features / QK;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t n = 0; n < out_features; n++) {
        const uint8_t *wn = w + n * nb * block_bytes;
        const float add = bias ? bias[n] : 0.0f;
        float sums[ROW_TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int nr = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            tile(wn, nb, x, in_features, r0, nr, sums);
            for (int r = 0; r < nr; r++) y[(r0 + r) * out_features + n] = sums[r] + add;
        }
    }
    return 0;
}

static int dequantize(values_fn values, int64_t block_bytes, const uint8_t *w, float *out,
                      int64_t out_features, int64_t in_features, int threads) {
    if (out_features < 1 || in_features < 1 || in_features % QK) return 1;
    const int64_t nb = in_features / QK;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t n = 0; n < out_features; n++)
        for (int64_t b = 0; b < nb; b++)
            values(w + (n * nb + b) * block_bytes, out + n * in_features + b * QK);
    return 0;
}

#ifdef Q4_SIMD
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Output feature n for rows r0 .. r0 + nr - 1 (nr <= ROW_TILE). */
static void feature_tile(const uint8_t *wn, int64_t nb, const float *x, int64_t in_features,
                         int64_t r0, int nr, float *sums) {
#ifdef Q4_SIMD
    __m256 acc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wn + b * BLOCK_BYTES;
        uint16_t hd, hm;
        memcpy(&hd, blk, 2);
        memcpy(&hm, blk + 2, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd)), m = _mm256_set1_ps(_cvtsh_ss(hm));
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
        const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
        const __m256 w1 = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
        const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
        const __m256 w3 = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + (r0 + r) * in_features + b * QK;
            __m256 a = acc[r];
            a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a);
            a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a);
            a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a);
            a = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a);
            acc[r] = a;
        }
    }
    for (int r = 0; r < nr; r++) sums[r] = hsum(acc[r]);
#else
    float v[QK];
    for (int r = 0; r < nr; r++) sums[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        block_values(wn + b * BLOCK_BYTES, v);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + (r0 + r) * in_features + b * QK;
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += v[j] * xr[j];
            sums[r] += s;
        }
    }
#endif
}

int q4_1_matmul(const uint8_t *w, const float *x, const float *bias, float *y, int64_t rows,
                int64_t out_features, int64_t in_features, int threads) {
    return matmul(feature_tile, BLOCK_BYTES, w, x, bias, y, rows, out_features, in_features,
                  threads);
}

int q4_1_dequantize(const uint8_t *w, float *out, int64_t out_features, int64_t in_features,
                    int threads) {
    return dequantize(block_values, BLOCK_BYTES, w, out, out_features, in_features, threads);
}

static void block_values_q8_0(const uint8_t *b, float *v) {
    uint16_t hd;
    memcpy(&hd, b, 2);
    const float d = fp16_to_fp32(hd);
    for (int j = 0; j < QK; j++) v[j] = d * (float)(int8_t)b[2 + j];
}


/* Output feature n of a Q8_0 weight for rows r0 .. r0 + nr - 1 (nr <= ROW_TILE). */
static void feature_tile_q8_0(const uint8_t *wn, int64_t nb, const float *x, int64_t in_features,
                              int64_t r0, int nr, float *sums) {
#ifdef Q4_SIMD
    __m256 acc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wn + b * Q8_BYTES;
        uint16_t hd;
        memcpy(&hd, blk, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd));
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), d);
        const __m256 w1 = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), d);
        const __m256 w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), d);
        const __m256 w3 = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), d);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + (r0 + r) * in_features + b * QK;
            __m256 a = acc[r];
            a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a);
            a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a);
            a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a);
            a = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a);
            acc[r] = a;
        }
    }
    for (int r = 0; r < nr; r++) sums[r] = hsum(acc[r]);
#else
    float v[QK];
    for (int r = 0; r < nr; r++) sums[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        block_values_q8_0(wn + b * Q8_BYTES, v);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + (r0 + r) * in_features + b * QK;
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += v[j] * xr[j];
            sums[r] += s;
        }
    }
#endif
}

int q8_0_matmul(const uint8_t *w, const float *x, const float *bias, float *y, int64_t rows,
                int64_t out_features, int64_t in_features, int threads) {
    return matmul(feature_tile_q8_0, Q8_BYTES, w, x, bias, y, rows, out_features, in_features,
                  threads);
}

int q8_0_dequantize(const uint8_t *w, float *out, int64_t out_features, int64_t in_features,
                    int threads) {
    return dequantize(block_values_q8_0, Q8_BYTES, w, out, out_features, in_features, threads);
}

/* 1 where the AVX2 path was compiled in, 0 where the plain loop computes. */
int q4_1_simd(void) {
#ifdef Q4_SIMD
    return 1;
#else
    return 0;
#endif
}
