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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

#ifdef Q4_SIMD
/*
 * Output feature n over blocks of a Q4_1 (q8 == 0) or Q8_0 (q8 == 1) weight, for NR rows with
 * NA accumulators each: the four products of a block go round-robin to the row's NA
 * accumulators, so that a row's chain of dependent FMAs is 4 / NA long per block. With one
 * accumulator per row, a single row waits 4 FMA latencies per block (16 cycles, against about 6
 * of instructions); NA = 4 for up to 2 rows and 2 for 3 or 4 keep every accumulator in the 16
 * registers of AVX2. Called with constants, so that each case compiles to its own loop.
 */
static inline __attribute__((always_inline)) void
simd_tile(const uint8_t *wn, int64_t nb, const float *x, int64_t in_features, int64_t r0,
          const int NR, const int NA, const int q8, float *sums) {
    __m256 acc[ROW_TILE][4];
    for (int r = 0; r < NR; r++)
        for (int a = 0; a < NA; a++) acc[r][a] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    const int64_t bytes = q8 ? Q8_BYTES : BLOCK_BYTES;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wn + b * bytes;
        uint16_t hd;
        memcpy(&hd, blk, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd));
        __m256 w[4];
        if (q8) {
            const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
            const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
            w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), d);
            w[1] = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), d);
            w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), d);
            w[3] = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), d);
        } else {
            uint16_t hm;
            memcpy(&hm, blk + 2, 2);
            const __m256 m = _mm256_set1_ps(_cvtsh_ss(hm));
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 4));
            const __m128i lo = _mm_and_si128(q, low);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
            w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
            w[1] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
            w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
            w[3] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
        }
        for (int r = 0; r < NR; r++) {
            const float *xr = x + (r0 + r) * in_features + b * QK;
            for (int j = 0; j < 4; j++)
                acc[r][j % NA] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j),
                                                 acc[r][j % NA]);
        }
    }
    for (int r = 0; r < NR; r++) {
        __m256 total = acc[r][0];
        for (int a = 1; a < NA; a++) total = _mm256_add_ps(total, acc[r][a]);
        sums[r] = hsum(total);
    }
}

static void simd_feature_tile(const uint8_t *wn, int64_t nb, const float *x, int64_t in_features,
                              int64_t r0, int nr, float *sums, int q8) {
    if (q8) {
        switch (nr) {
        case 1: simd_tile(wn, nb, x, in_features, r0, 1, 4, 1, sums); break;
        case 2: simd_tile(wn, nb, x, in_features, r0, 2, 4, 1, sums); break;
        case 3: simd_tile(wn, nb, x, in_features, r0, 3, 2, 1, sums); break;
        default: simd_tile(wn, nb, x, in_features, r0, 4, 2, 1, sums); break;
        }
    } else {
        switch (nr) {
        case 1: simd_tile(wn, nb, x, in_features, r0, 1, 4, 0, sums); break;
        case 2: simd_tile(wn, nb, x, in_features, r0, 2, 4, 0, sums); break;
        case 3: simd_tile(wn, nb, x, in_features, r0, 3, 2, 0, sums); break;
        default: simd_tile(wn, nb, x, in_features, r0, 4, 2, 0, sums); break;
        }
    }
}
#endif

/* Output feature n for rows r0 .. r0 + nr - 1 (nr <= ROW_TILE). */
static void feature_tile(const uint8_t *wn, int64_t nb, const float *x, int64_t in_features,
                         int64_t r0, int nr, float *sums) {
#ifdef Q4_SIMD
    simd_feature_tile(wn, nb, x, in_features, r0, nr, sums, 0);
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
    simd_feature_tile(wn, nb, x, in_features, r0, nr, sums, 1);
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

/*
 * The same products with the activations quantized as llama.cpp quantizes them for these
 * weights (ggml's Q8_1 for Q4_1, Q8_0 for Q8_0: ggml-quants.c, quantize_row_q8_1): each block of
 * 32 inputs of a row as int8 codes qx with a scale dx = max |x| / 127, and sx = dx * sum(qx).
 * A block's product is then an integer dot product:
 *   Q4_1:  sum_j (dw qw_j + mw) dx qx_j = dw dx sum_j qw_j qx_j + mw sx
 *   Q8_0:  dw dx sum_j qw_j qx_j
 * with the 32 byte products summed exactly in int32 (AVX-VNNI or AVX512-VNNI's VPDPBUSD where
 * the CPU has it, else AVX2's VPMADDUBSW and VPMADDWD, which cannot saturate here: 2 x 15 x 127
 * for Q4_1; Q8_0's signed codes go through VPSIGNB as in ggml's mul_sum_i8_pairs). Each x value
 * is off by up to dx / 2 (0.4 % of the block's largest), which is what llama.cpp's own products
 * compute; the instructions per block are about a third of the fp32 path's.
 *
 *   q4_1_q8_matmul(w, x, bias, y, rows, out_features, in_features, threads)
 *   q8_0_q8_matmul(w, x, bias, y, rows, out_features, in_features, threads)
 *     the arguments of q4_1_matmul; return codes 0, 1, or 2 out of memory for the codes.
 */
typedef struct {
    int8_t *q;     /* [rows][in_features] */
    float *d, *s;  /* [rows][in_features / 32] */
} qx_t;

static int quantize_rows(const float *x, int64_t rows, int64_t in_features, qx_t *out) {
    const int64_t nb = in_features / QK;
    out->q = (int8_t *)malloc((size_t)(rows * in_features));
    out->d = (float *)malloc(sizeof(float) * (size_t)(rows * nb) * 2);
    if (out->q == NULL || out->d == NULL) {
        free(out->q);
        free(out->d);
        return 2;
    }
    out->s = out->d + rows * nb;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * in_features + b * QK;
            float amax = 0.0f;
            int nan = 0;
            for (int j = 0; j < QK; j++) {
                uint32_t u;
                memcpy(&u, &xb[j], sizeof u);
                nan |= (u & 0x7fffffffu) > 0x7f800000u; /* bit test: -ffast-math drops isnan */
                amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            }
            /* A NaN input makes its block's scale NaN, so that it reaches the output as the
             * fp32 path's would instead of vanishing in a code of 0. */
            float d = amax / 127.0f;
            if (nan) memcpy(&d, &(uint32_t){0x7fc00000u}, sizeof d);
            const float id = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *qb = out->q + r * in_features + b * QK;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                qb[j] = (int8_t)lrintf(xb[j] * id);
                sum += qb[j];
            }
            out->d[r * nb + b] = d;
            out->s[r * nb + b] = d * (float)sum;
        }
    return 0;
}

#ifdef Q4_SIMD
/* 8 int32 lanes summing to the dot product of 32 unsigned bytes u and 32 signed bytes v. */
static inline __m256i dot_u8_s8(__m256i u, __m256i v) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, v);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

/* One block's codes as 32 unsigned bytes (Q4_1: the 4-bit codes; Q8_0: |q|), with its scale and
 * minimum; the signed codes themselves for Q8_0's sign fix-up of x. */
static inline __attribute__((always_inline)) __m256i
block_codes(const uint8_t *blk, const int q8, float *dw, float *mw, __m256i *signs) {
    uint16_t hd;
    memcpy(&hd, blk, 2);
    *dw = _cvtsh_ss(hd);
    if (q8) {
        const __m256i qw = _mm256_loadu_si256((const __m256i *)(blk + 2));
        *signs = qw;
        *mw = 0.0f;
        return _mm256_sign_epi8(qw, qw);
    }
    uint16_t hm;
    memcpy(&hm, blk + 2, 2);
    *mw = _cvtsh_ss(hm);
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 4));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
}

/* Output feature n over NR rows' quantized blocks (Q4_1 or Q8_0 weights), two blocks an
 * iteration into two accumulators a row (a row's chain of dependent FMAs is then one a block). */
static inline __attribute__((always_inline)) void
q8_tile(const uint8_t *wn, int64_t nb, const qx_t *qx, int64_t in_features, int64_t r0,
        const int NR, const int q8, float *sums) {
    __m256 acc0[ROW_TILE], acc1[ROW_TILE];
    float m0[ROW_TILE], m1[ROW_TILE];
    for (int r = 0; r < NR; r++) {
        acc0[r] = acc1[r] = _mm256_setzero_ps();
        m0[r] = m1[r] = 0.0f;
    }
    const int64_t bytes = q8 ? Q8_BYTES : BLOCK_BYTES;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        float dw0, mw0, dw1, mw1;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        const __m256i u0 = block_codes(wn + b * bytes, q8, &dw0, &mw0, &s0);
        const __m256i u1 = block_codes(wn + (b + 1) * bytes, q8, &dw1, &mw1, &s1);
        for (int r = 0; r < NR; r++) {
            const int64_t rb = (r0 + r) * nb + b;
            const int8_t *xq = qx->q + (r0 + r) * in_features + b * QK;
            __m256i v0 = _mm256_loadu_si256((const __m256i *)xq);
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(xq + QK));
            if (q8) {
                v0 = _mm256_sign_epi8(v0, s0);
                v1 = _mm256_sign_epi8(v1, s1);
            }
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(u0, v0)),
                                      _mm256_set1_ps(dw0 * qx->d[rb]), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(u1, v1)),
                                      _mm256_set1_ps(dw1 * qx->d[rb + 1]), acc1[r]);
            if (!q8) {
                m0[r] += mw0 * qx->s[rb];
                m1[r] += mw1 * qx->s[rb + 1];
            }
        }
    }
    if (b < nb) {
        float dw0, mw0;
        __m256i s0 = _mm256_setzero_si256();
        const __m256i u0 = block_codes(wn + b * bytes, q8, &dw0, &mw0, &s0);
        for (int r = 0; r < NR; r++) {
            const int64_t rb = (r0 + r) * nb + b;
            __m256i v0 = _mm256_loadu_si256(
                (const __m256i *)(qx->q + (r0 + r) * in_features + b * QK));
            if (q8) v0 = _mm256_sign_epi8(v0, s0);
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(u0, v0)),
                                      _mm256_set1_ps(dw0 * qx->d[rb]), acc0[r]);
            if (!q8) m0[r] += mw0 * qx->s[rb];
        }
    }
    for (int r = 0; r < NR; r++) sums[r] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + m0[r] + m1[r];
}
#endif

/* The plain-C form of q8_tile: the same integer sums. */
static void q8_tile_plain(const uint8_t *wn, int64_t nb, const qx_t *qx, int64_t in_features,
                          int64_t r0, int nr, int q8, float *sums) {
    const int64_t bytes = q8 ? Q8_BYTES : BLOCK_BYTES;
    for (int r = 0; r < nr; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wn + b * bytes;
            const int8_t *v = qx->q + (r0 + r) * in_features + b * QK;
            uint16_t hd, hm;
            memcpy(&hd, blk, 2);
            int32_t dot = 0;
            if (q8) {
                for (int j = 0; j < QK; j++) dot += (int32_t)(int8_t)blk[2 + j] * v[j];
            } else {
                for (int j = 0; j < 16; j++)
                    dot += (int32_t)(blk[4 + j] & 0x0f) * v[j] + (int32_t)(blk[4 + j] >> 4) * v[j + 16];
            }
            const int64_t rb = (r0 + r) * nb + b;
            total += fp16_to_fp32(hd) * qx->d[rb] * (float)dot;
            if (!q8) {
                memcpy(&hm, blk + 2, 2);
                total += fp16_to_fp32(hm) * qx->s[rb];
            }
        }
        sums[r] = total;
    }
}

static int q8_matmul(int q8, const uint8_t *w, const float *x, const float *bias, float *y,
                     int64_t rows, int64_t out_features, int64_t in_features, int threads) {
    if (rows < 1 || out_features < 1 || in_features < 1 || in_features % QK) return 1;
    qx_t qx;
    if (quantize_rows(x, rows, in_features, &qx)) return 2;
    const int64_t nb = in_features / QK, bytes = q8 ? Q8_BYTES : BLOCK_BYTES;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t n = 0; n < out_features; n++) {
        const uint8_t *wn = w + n * nb * bytes;
        const float add = bias ? bias[n] : 0.0f;
        float sums[ROW_TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int nr = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
#ifdef Q4_SIMD
#define Q8_CASE(NR) \
    (q8 ? q8_tile(wn, nb, &qx, in_features, r0, NR, 1, sums) \
        : q8_tile(wn, nb, &qx, in_features, r0, NR, 0, sums))
            switch (nr) {
            case 1: Q8_CASE(1); break;
            case 2: Q8_CASE(2); break;
            case 3: Q8_CASE(3); break;
            default: Q8_CASE(4); break;
            }
#undef Q8_CASE
#else
            q8_tile_plain(wn, nb, &qx, in_features, r0, nr, q8, sums);
#endif
            for (int r = 0; r < nr; r++) y[(r0 + r) * out_features + n] = sums[r] + add;
        }
    }
    free(qx.q);
    free(qx.d);
    return 0;
}

int q4_1_q8_matmul(const uint8_t *w, const float *x, const float *bias, float *y, int64_t rows,
                   int64_t out_features, int64_t in_features, int threads) {
    return q8_matmul(0, w, x, bias, y, rows, out_features, in_features, threads);
}

int q8_0_q8_matmul(const uint8_t *w, const float *x, const float *bias, float *y, int64_t rows,
                   int64_t out_features, int64_t in_features, int threads) {
    return q8_matmul(1, w, x, bias, y, rows, out_features, in_features, threads);
}

/* 1 where the AVX2 path was compiled in, 0 where the plain loop computes. */
int q4_1_simd(void) {
#ifdef Q4_SIMD
    return 1;
#else
    return 0;
#endif
}

/*
 * Q4_1 weights interleaved 16 output features at a time ("x16"), for the same integer products
 * over AVX-512 VNNI with the output features in the vector's lanes (the layout of llama.cpp's
 * repacked CPU kernels, ggml-cpu/repack.cpp, here for Q4_1):
 *
 *   q4_1_x16_pack(w, out, out_features, in_features)
 *     out   [out_features / 16][in_features / 32] records of 320 bytes (the same bytes as w's
 *           16 x 20): for chunk c = 0..3, 64 bytes holding bytes 4c..4c+3 of each of the 16
 *           features' blocks' codes (feature i at 4i); then the 16 scales d, then the 16
 *           minimums m (fp16). Returns 1 unless out_features is a multiple of 16 and
 *           in_features of 32.
 *   q4_1_x16_q8_matmul(w16, x, bias, y, rows, out_features, in_features, threads)
 *     q4_1_q8_matmul's product over the packed weights: per block, each lane's int32 sum of its
 *     feature's 32 code-by-input products comes from 8 VPDPBUSD (the low nibbles of chunk c
 *     against inputs 4c..4c+3 broadcast to every lane, the high nibbles against 16+4c..19+4c),
 *     then one conversion and two FMAs for 16 features: about 30 instructions for 512 weights
 *     against some 250 for q4_1_q8_matmul's one feature at a time. The integer sums are the
 *     same; the fp32 sums over the blocks go in another order (not bitwise q4_1_q8_matmul's).
 *     Returns as q4_1_q8_matmul, or 4 where the library was built without AVX-512 VNNI.
 *   q4_1_x16_available()  1 where that path was compiled in.
 */
#define X16 16
#define X16_RECORD (X16 * BLOCK_BYTES)

int q4_1_x16_pack(const uint8_t *w, uint8_t *out, int64_t out_features, int64_t in_features) {
    if (out_features < X16 || out_features % X16 || in_features < QK || in_features % QK) return 1;
    const int64_t nb = in_features / QK;
    for (int64_t g = 0; g < out_features / X16; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *rec = out + (g * nb + b) * X16_RECORD;
            for (int i = 0; i < X16; i++) {
                const uint8_t *blk = w + ((g * X16 + i) * nb + b) * BLOCK_BYTES;
                for (int c = 0; c < 4; c++) memcpy(rec + c * 64 + i * 4, blk + 4 + c * 4, 4);
                memcpy(rec + 256 + i * 2, blk, 2);
                memcpy(rec + 288 + i * 2, blk + 2, 2);
            }
        }
    return 0;
}

/*
 * Q8_0 the same way (the tied LM head):
 *
 *   q8_0_x16_pack(w, out, out_features, in_features)
 *     out   [out_features / 16][in_features / 32] records of 608 bytes: for chunk c = 0..7, 64
 *           bytes holding codes 4c..4c+3 of each of the 16 features' blocks; the 16 scales d
 *           (fp16); then 16 int32, 128 times the sum of each feature's 32 codes.
 *   q8_0_x16_q8_matmul(w16, x, bias, y, rows, out_features, in_features, threads)
 *     q8_0_q8_matmul's product over them. VPDPBUSD multiplies unsigned by signed bytes: the
 *     input codes go in as unsigned (each plus 128, a flip of its sign bit), and the stored
 *     128 x sum of the codes comes off each block's int32 sum, which is then exactly
 *     q8_0_q8_matmul's.
 */
#define X16_Q8_RECORD (X16 * 32 + X16 * 2 + X16 * 4)

int q8_0_x16_pack(const uint8_t *w, uint8_t *out, int64_t out_features, int64_t in_features) {
    if (out_features < X16 || out_features % X16 || in_features < QK || in_features % QK) return 1;
    const int64_t nb = in_features / QK;
    for (int64_t g = 0; g < out_features / X16; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *rec = out + (g * nb + b) * X16_Q8_RECORD;
            for (int i = 0; i < X16; i++) {
                const uint8_t *blk = w + ((g * X16 + i) * nb + b) * Q8_BYTES;
                int32_t sum = 0;
                for (int j = 0; j < QK; j++) sum += (int8_t)blk[2 + j];
                sum *= 128;
                for (int c = 0; c < 8; c++) memcpy(rec + c * 64 + i * 4, blk + 2 + c * 4, 4);
                memcpy(rec + 512 + i * 2, blk, 2);
                memcpy(rec + 544 + i * 4, &sum, 4);
            }
        }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4_X16 1
static inline int32_t x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* 16 features (one group's records) over NR rows: out[r][i] = feature i's product with row r. */
static inline __attribute__((always_inline)) void
x16_tile(const uint8_t *wg, int64_t nb, const qx_t *qx, int64_t in_features, int64_t r0,
         const int NR, float *out) {
    __m512 accf[ROW_TILE], accm[ROW_TILE];
    for (int r = 0; r < NR; r++) accf[r] = accm[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = wg + b * X16_RECORD;
        const __m512i c0 = _mm512_loadu_si512((const void *)rec);
        const __m512i c1 = _mm512_loadu_si512((const void *)(rec + 64));
        const __m512i c2 = _mm512_loadu_si512((const void *)(rec + 128));
        const __m512i c3 = _mm512_loadu_si512((const void *)(rec + 192));
        const __m512i l0 = _mm512_and_si512(c0, low), h0 = _mm512_and_si512(_mm512_srli_epi16(c0, 4), low);
        const __m512i l1 = _mm512_and_si512(c1, low), h1 = _mm512_and_si512(_mm512_srli_epi16(c1, 4), low);
        const __m512i l2 = _mm512_and_si512(c2, low), h2 = _mm512_and_si512(_mm512_srli_epi16(c2, 4), low);
        const __m512i l3 = _mm512_and_si512(c3, low), h3 = _mm512_and_si512(_mm512_srli_epi16(c3, 4), low);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));
        for (int r = 0; r < NR; r++) {
            const int8_t *xq = qx->q + (r0 + r) * in_features + b * QK;
            const int64_t rb = (r0 + r) * nb + b;
            /* two chains of four: the low nibbles' and the high nibbles' */
            __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), l0, _mm512_set1_epi32(x4(xq)));
            __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), h0, _mm512_set1_epi32(x4(xq + 16)));
            lo = _mm512_dpbusd_epi32(lo, l1, _mm512_set1_epi32(x4(xq + 4)));
            hi = _mm512_dpbusd_epi32(hi, h1, _mm512_set1_epi32(x4(xq + 20)));
            lo = _mm512_dpbusd_epi32(lo, l2, _mm512_set1_epi32(x4(xq + 8)));
            hi = _mm512_dpbusd_epi32(hi, h2, _mm512_set1_epi32(x4(xq + 24)));
            lo = _mm512_dpbusd_epi32(lo, l3, _mm512_set1_epi32(x4(xq + 12)));
            hi = _mm512_dpbusd_epi32(hi, h3, _mm512_set1_epi32(x4(xq + 28)));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi));
            accf[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(qx->d[rb])), accf[r]);
            accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(qx->s[rb]), accm[r]);
        }
    }
    for (int r = 0; r < NR; r++) _mm512_storeu_ps(out + r * X16, _mm512_add_ps(accf[r], accm[r]));
}

static inline __attribute__((always_inline)) void
x16_q8_0_tile(const uint8_t *wg, int64_t nb, const qx_t *qx, int64_t in_features, int64_t r0,
              const int NR, float *out) {
    __m512 accf[ROW_TILE];
    for (int r = 0; r < NR; r++) accf[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = wg + b * X16_Q8_RECORD;
        __m512i wc[8];
        for (int c = 0; c < 8; c++) wc[c] = _mm512_loadu_si512((const void *)(rec + c * 64));
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 512)));
        const __m512i corr = _mm512_loadu_si512((const void *)(rec + 544));
        for (int r = 0; r < NR; r++) {
            const int8_t *xq = qx->q + (r0 + r) * in_features + b * QK;
            const int32_t flip = (int32_t)0x80808080u;
            __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
            for (int c = 0; c < 8; c += 2) {
                a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(x4(xq + c * 4) ^ flip), wc[c]);
                a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(x4(xq + c * 4 + 4) ^ flip),
                                         wc[c + 1]);
            }
            const __m512 dot = _mm512_cvtepi32_ps(
                _mm512_sub_epi32(_mm512_add_epi32(a0, a1), corr));
            accf[r] = _mm512_fmadd_ps(
                dot, _mm512_mul_ps(dw, _mm512_set1_ps(qx->d[(r0 + r) * nb + b])), accf[r]);
        }
    }
    for (int r = 0; r < NR; r++) _mm512_storeu_ps(out + r * X16, accf[r]);
}
#endif

int q4_1_x16_available(void) {
#ifdef Q4_X16
    return 1;
#else
    return 0;
#endif
}

static int x16_matmul(int q8, const uint8_t *w16, const float *x, const float *bias, float *y,
                      int64_t rows, int64_t out_features, int64_t in_features, int threads) {
    if (rows < 1 || out_features < X16 || out_features % X16 || in_features < QK
        || in_features % QK)
        return 1;
#ifdef Q4_X16
    qx_t qx;
    if (quantize_rows(x, rows, in_features, &qx)) return 2;
    const int64_t nb = in_features / QK, record = q8 ? X16_Q8_RECORD : X16_RECORD;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t g = 0; g < out_features / X16; g++) {
        const uint8_t *wg = w16 + g * nb * record;
        float out[ROW_TILE * X16];
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int nr = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
#define X16_CASE(NR) \
    (q8 ? x16_q8_0_tile(wg, nb, &qx, in_features, r0, NR, out) \
        : x16_tile(wg, nb, &qx, in_features, r0, NR, out))
            switch (nr) {
            case 1: X16_CASE(1); break;
            case 2: X16_CASE(2); break;
            case 3: X16_CASE(3); break;
            default: X16_CASE(4); break;
            }
#undef X16_CASE
            for (int r = 0; r < nr; r++)
                for (int i = 0; i < X16; i++)
                    y[(r0 + r) * out_features + g * X16 + i] =
                        out[r * X16 + i] + (bias ? bias[g * X16 + i] : 0.0f);
        }
    }
    free(qx.q);
    free(qx.d);
    return 0;
#else
    (void)q8; (void)w16; (void)x; (void)bias; (void)y; (void)threads;
    return 4;
#endif
}

int q4_1_x16_q8_matmul(const uint8_t *w16, const float *x, const float *bias, float *y,
                       int64_t rows, int64_t out_features, int64_t in_features, int threads) {
    return x16_matmul(0, w16, x, bias, y, rows, out_features, in_features, threads);
}

int q8_0_x16_q8_matmul(const uint8_t *w16, const float *x, const float *bias, float *y,
                       int64_t rows, int64_t out_features, int64_t in_features, int threads) {
    return x16_matmul(1, w16, x, bias, y, rows, out_features, in_features, threads);
}
