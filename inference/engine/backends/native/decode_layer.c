/*
 * One decoder layer of a decode pass (one new token per row) of a bf16 model on a CPU with
 * AVX512-BF16, in one call: the work that the forward pass otherwise spreads over some thirty
 * PyTorch operations per layer, each with its own dispatch and temporary tensors.
 *
 *   decode_layer_bf16(layer, dims, h, cos, sin, tables, lens, max_blocks, rows, threads, lora,
 *                     layer_index)
 *     layer   the layer's weights (layer_t below): RMSNorm weights, the four projections packed
 *             for bf16_packed_matmul (bf16_gemm.c) with their fp32 biases or NULL, and this
 *             layer's slice of the KV pool [2 * kv_heads][num_blocks][block_size][head_dim]
 *     dims    the model's sizes (dims_t below)
 *     h       [rows][hidden] bf16, the residual stream: read, and overwritten with the layer's
 *             output
 *     cos, sin [max_positions][head_dim] bf16 rotary tables (rotate-half layout)
 *     tables  [rows][max_blocks] int64 block ids; lens [rows] int64 tokens each row attends to,
 *             its new token (at position lens - 1) included
 *     lora    NULL, or [rows] pointers: each row's LoRA adapter (lora.c), its deltas added to
 *             each projection's output (before the residual adds) for layer layer_index
 *
 * The steps and their roundings are those of the PyTorch pass in bf16 (forward.py): RMSNorm
 * computed in fp32, times its weight, rounded once to bf16; the fused q/k/v
 * projection; rotary embedding as x cos + rotate_half(x) sin with each product and the sum
 * rounded; the new token's K and V written to the pool at its slot; decode attention over the
 * pool (paged_decode_attention_bf16); the output projection added to the residual (rounded);
 * RMSNorm; gate/up projection; SiLU(gate) (in fp32, rounded) times up (rounded); the down
 * projection added to the residual. Only the order of the fp32 sums inside a norm may differ from
 * PyTorch's, and SiLU's exp (simd_exp.h's, within 2 ulp of fp32 exp). In bf16 the elementwise
 * steps run on AVX-512, split over the threads where a pass has enough values.
 *
 * Return codes: 0 done; 1 a length below 1 or beyond its block table or the rotary tables; 2 out of memory; 3 a block
 * id outside the pool; 4 a size the kernels do not take (a projection's width not a multiple of
 * 64, an odd input width); 5 built without AVX512-BF16 (nothing computed, nothing written).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *ln1_w, *ln2_w;                      /* [hidden], the activations' dtype */
    const void *w_qkv, *w_o, *w_gate_up, *w_down;   /* bf16 packed (bf16_gemm.c) or Q4_1 blocks */
    const float *b_qkv, *b_o, *b_gate_up, *b_down;  /* fp32, or NULL */
    void *pool;                                     /* this layer's KV pool */
    /* Q4_1 only: the same projections' values packed in bf16 (bf16_gemm.c) for passes of more
     * than dims->dense_above rows, or NULL */
    const uint16_t *p_qkv, *p_o, *p_gate_up, *p_down;
    double eps1, eps2;
} layer_t;

typedef struct {
    int64_t hidden, n_heads, kv_heads, head_dim, intermediate, num_blocks, block_size;
    int64_t max_positions;    /* rows of the rotary tables */
    int64_t int8_activations; /* Q4_1 only: q4_1_q8_matmul (int8 activations), else q4_1_matmul */
    int64_t kv_bf16;          /* Q4_1 only: the pool holds bf16 K/V (else fp32) */
    int64_t dense_above;      /* Q4_1 only: more rows than this take the packed bf16 products */
    int64_t x16;              /* Q4_1 with int8 activations: the blocks are in quant.c's x16
                               * layout (q4_1_x16_q8_matmul) */
    double scale;
} dims_t;

int bf16_packed_matmul(const uint16_t *wp, const uint16_t *x, const float *bias, void *y,
                       int64_t rows, int64_t parts, int64_t out_features, int64_t in_features,
                       int64_t y_f32, int64_t threads);
int bf16_packed_matmul_available(void);
typedef struct lora_proj lora_proj_t;  /* lora.c */
int lora_add_bf16(const lora_proj_t *const *adapters, int64_t layer, int64_t proj,
                  const uint16_t *x, int64_t in, uint16_t *y, int64_t out, int64_t tokens,
                  int64_t threads);
int lora_add_f32(const lora_proj_t *const *adapters, int64_t layer, int64_t proj, const float *x,
                 int64_t in, float *y, int64_t out, int64_t tokens, int64_t threads);
int paged_decode_attention(const float *q, const float *pool, const int64_t *tables,
                           const int64_t *lens, float *out, int64_t rows, int64_t kv_heads,
                           int64_t group, int64_t head_dim, int64_t num_blocks,
                           int64_t block_size, int64_t max_blocks, float scale);
int q4_1_matmul(const uint8_t *w, const float *x, const float *bias, float *y, int64_t rows,
                int64_t out_features, int64_t in_features, int threads);
int q4_1_q8_matmul(const uint8_t *w, const float *x, const float *bias, float *y, int64_t rows,
                   int64_t out_features, int64_t in_features, int threads);
int q4_1_x16_q8_matmul(const uint8_t *w16, const float *x, const float *bias, float *y,
                       int64_t rows, int64_t out_features, int64_t in_features, int threads);
int paged_decode_attention_bf16(const uint16_t *q, const uint16_t *pool, const int64_t *tables,
                                const int64_t *lens, uint16_t *out, int64_t rows,
                                int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                                float scale);
int paged_decode_attention_f32_kv_bf16(const float *q, const uint16_t *pool,
                                       const int64_t *tables, const int64_t *lens, float *out,
                                       int64_t rows, int64_t kv_heads, int64_t group,
                                       int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                       int64_t max_blocks, float scale);

static inline float to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as PyTorch rounds; a NaN stays a quiet NaN. */
static inline uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* x [heads][D] at one position: x cos + rotate_half(x) sin, each product and the sum rounded */
static void rotate(uint16_t *x, int64_t heads, int64_t D, const uint16_t *cos,
                   const uint16_t *sin)
{
    const int64_t half = D / 2;
    float tmp[1024];
    for (int64_t hd = 0; hd < heads; hd++) {
        uint16_t *xh = x + hd * D;
        for (int64_t d = 0; d < D; d++) tmp[d] = to_f32(xh[d]);
        for (int64_t d = 0; d < D; d++) {
            const float rot = d < half ? -tmp[d + half] : tmp[d - half];
            const float a = to_f32(to_bf16(tmp[d] * to_f32(cos[d])));
            const float b = to_f32(to_bf16(rot * to_f32(sin[d])));
            xh[d] = to_bf16(a + b);
        }
    }
}

/* The sizes, and the new tokens' slots: checked before anything is written. */
static int check(const dims_t *M, const int64_t *tables, const int64_t *lens, int64_t max_blocks,
                 int64_t rows)
{
    const int64_t D = M->head_dim, KV = M->kv_heads, bs = M->block_size;
    if (rows < 0 || D < 2 || D % 2 != 0 || D > 1024 || KV < 1 || M->n_heads % KV != 0 || bs < 1
        || M->hidden < 1 || M->intermediate < 1)
        return 4;
    for (int64_t r = 0; r < rows; r++) {
        if (lens[r] < 1 || lens[r] > M->max_positions || (lens[r] - 1) / bs >= max_blocks)
            return 1;
        for (int64_t j = 0; j <= (lens[r] - 1) / bs; j++) {  /* every block attention reads */
            const int64_t block = tables[r * max_blocks + j];
            if (block < 0 || block >= M->num_blocks) return 3;
        }
    }
    return 0;
}

#ifdef __AVX512BF16__
#include "simd_exp.h"

/* Elementwise steps over fewer values than this run on the calling thread alone (a decode pass of
 * a few rows: a parallel region costs more than it saves). */
#define PARALLEL_MIN 16384

static inline __m512 load16(const uint16_t *p)
{
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

static inline void store16(uint16_t *p, __m512 v)
{
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* v rounded to bf16 (nearest even) and widened back */
static inline __m512 round16(__m512 v)
{
    const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
}

/* Row r of [rows][n]: h = bf16(h + d) when d is given; y = bf16(h * rsqrt(mean(h^2) + eps) * w),
 * in fp32 as PyTorch's fused RMSNorm */
static void add_rms_norm_rows(uint16_t *h, const uint16_t *d, const uint16_t *w, uint16_t *y,
                              int64_t rows, int64_t n, double eps, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * n, *yr = y + r * n;
        __m512 acc = _mm512_setzero_ps();
        float sum = 0.0f;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 v = load16(hr + i);
            if (d) {
                v = round16(_mm512_add_ps(v, load16(d + r * n + i)));
                store16(hr + i, v);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        for (; i < n; i++) {
            if (d) hr[i] = to_bf16(to_f32(hr[i]) + to_f32(d[r * n + i]));
            const float v = to_f32(hr[i]);
            sum += v * v;
        }
        sum += _mm512_reduce_add_ps(acc);
        const float inv = (float)(1.0 / sqrt((double)(sum / (float)n) + (double)(float)eps));
        const __m512 vinv = _mm512_set1_ps(inv);
        for (i = 0; i + 16 <= n; i += 16)
            store16(yr + i, _mm512_mul_ps(_mm512_mul_ps(load16(hr + i), vinv), load16(w + i)));
        for (; i < n; i++) yr[i] = to_bf16(to_f32(hr[i]) * inv * to_f32(w[i]));
    }
}

/* act [rows][I] = bf16(bf16(SiLU(gate)) * up), gu [rows][2 I] holding gate then up */
static void silu_mul_rows(const uint16_t *gu, uint16_t *act, int64_t rows, int64_t I, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * I >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * I, *u = g + I;
        uint16_t *a = act + r * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
            const __m512 x = load16(g + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 s = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            store16(a + i, _mm512_mul_ps(s, load16(u + i)));
        }
        for (; i < I; i++) {
            const float x = to_f32(g[i]);
            a[i] = to_bf16(to_f32(to_bf16(x / (1.0f + expf(-x)))) * to_f32(u[i]));
        }
    }
}

/* h = bf16(h + d), [rows][n] */
static void add_rows(uint16_t *h, const uint16_t *d, int64_t rows, int64_t n, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * n;
        const uint16_t *dr = d + r * n;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            store16(hr + i, _mm512_add_ps(load16(hr + i), load16(dr + i)));
        for (; i < n; i++) hr[i] = to_bf16(to_f32(hr[i]) + to_f32(dr[i]));
    }
}

/* rotate() above on AVX-512, for a head size that is a multiple of 32 */
static void rotate16(uint16_t *x, int64_t heads, int64_t D, const uint16_t *cos,
                     const uint16_t *sin)
{
    const int64_t half = D / 2;
    for (int64_t hd = 0; hd < heads; hd++) {
        uint16_t *lo = x + hd * D, *hi = lo + half;
        for (int64_t d = 0; d < half; d += 16) {
            const __m512 a = load16(lo + d), b = load16(hi + d);
            /* lo: a cos - b sin (the sign of b sin is exact); hi: b cos + a sin */
            const __m512 rb = _mm512_add_ps(round16(_mm512_mul_ps(b, load16(cos + half + d))),
                                            round16(_mm512_mul_ps(a, load16(sin + half + d))));
            store16(lo + d, _mm512_sub_ps(round16(_mm512_mul_ps(a, load16(cos + d))),
                                          round16(_mm512_mul_ps(b, load16(sin + d)))));
            store16(hi + d, rb);
        }
    }
}

/* Tokens [0, n) of qkv [n][(NH + 2 KV) D]: q and k heads rotated in place at each token's
 * position, the rotated q heads copied to q [n][NH D], the K and V heads written to slot
 * slots[t] of pool [2 KV][slots][D] (head_stride = slots * D). Positions and slots checked by
 * the caller. */
static void rope_kv_rows(uint16_t *qkv, const int64_t *positions, const int64_t *slots,
                         const uint16_t *cos, const uint16_t *sin, uint16_t *q, uint16_t *pool,
                         int64_t n, int64_t NH, int64_t KV, int64_t D, int64_t head_stride,
                         int threads)
{
    const int64_t width = (NH + 2 * KV) * D, nhd = NH * D;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * width >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        uint16_t *row = qkv + t * width;
        const int64_t pos = positions[t];
        if (D % 32 == 0)
            rotate16(row, NH + KV, D, cos + pos * D, sin + pos * D);
        else
            rotate(row, NH + KV, D, cos + pos * D, sin + pos * D);
        memcpy(q + t * nhd, row, sizeof(uint16_t) * (size_t)nhd);
        for (int64_t j = 0; j < 2 * KV; j++)  /* K heads, then V heads */
            memcpy(pool + j * head_stride + slots[t] * D, row + (NH + j) * D,
                   sizeof(uint16_t) * (size_t)D);
    }
}
#endif

int decode_layer_bf16(const layer_t *L, const dims_t *M, uint16_t *h, const uint16_t *cos,
                      const uint16_t *sin, const int64_t *tables, const int64_t *lens,
                      int64_t max_blocks, int64_t rows, int64_t threads,
                      const lora_proj_t *const *lora, int64_t layer)
{
#ifndef __AVX512BF16__
    (void)L; (void)M; (void)h; (void)cos; (void)sin; (void)tables; (void)lens; (void)max_blocks;
    (void)rows; (void)threads; (void)lora; (void)layer;
    return 5;
#else
    if (rows == 0) return 0;
    if (!bf16_packed_matmul_available()) return 5;
    const int nt = threads < 1 ? 1 : (int)threads;
    const int64_t H = M->hidden, NH = M->n_heads, KV = M->kv_heads, D = M->head_dim;
    const int64_t I = M->intermediate, bs = M->block_size, nb = M->num_blocks;
    const int64_t qkv_w = (NH + 2 * KV) * D;
    if (H % 64 != 0 || qkv_w % 64 != 0 || (NH * D) % 2 != 0 || (2 * I) % 64 != 0
        || I % 2 != 0)
        return 4;
    int rc = check(M, tables, lens, max_blocks, rows);
    if (rc) return rc;
    const size_t n_x = (size_t)(rows * H), n_qkv = (size_t)(rows * qkv_w);
    const size_t n_o = (size_t)(rows * NH * D), n_gu = (size_t)(rows * 2 * I);
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (n_x * 2 + n_qkv + n_o * 2 + n_gu
                                                           + (size_t)(rows * I)));
    if (buf == NULL) return 2;
    uint16_t *x = buf, *d = x + n_x, *qkv = d + n_x, *q = qkv + n_qkv, *o = q + n_o;
    uint16_t *gu = o + n_o, *act = gu + n_gu;

    add_rms_norm_rows(h, NULL, (const uint16_t *)L->ln1_w, x, rows, H, L->eps1, nt);
    rc = bf16_packed_matmul((const uint16_t *)L->w_qkv, x, L->b_qkv, qkv, rows, 1, qkv_w, H, 0, threads);
    if (rc) { rc = rc == 3 ? 5 : 4; goto done; }
    if (lora && (rc = lora_add_bf16(lora, layer, 0, x, H, qkv, qkv_w, rows, threads))) goto done;
    const int64_t head_stride = nb * bs * D;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = lens[r] - 1;
        uint16_t *row = qkv + r * qkv_w;
        if (D % 32 == 0)
            rotate16(row, NH + KV, D, cos + pos * D, sin + pos * D);
        else
            rotate(row, NH + KV, D, cos + pos * D, sin + pos * D);
        memcpy(q + r * NH * D, row, sizeof(uint16_t) * (size_t)(NH * D));
        const int64_t slot = tables[r * max_blocks + pos / bs] * bs + pos % bs;
        for (int64_t j = 0; j < 2 * KV; j++)  /* K heads, then V heads */
            memcpy((uint16_t *)L->pool + j * head_stride + slot * D, row + (NH + j) * D,
                   sizeof(uint16_t) * (size_t)D);
    }
    rc = paged_decode_attention_bf16(q, (const uint16_t *)L->pool, tables, lens, o, rows, KV, NH / KV, D, nb, bs,
                                     max_blocks, (float)M->scale);
    if (rc) goto done;
    rc = bf16_packed_matmul((const uint16_t *)L->w_o, o, L->b_o, d, rows, 1, H, NH * D, 0, threads);
    if (rc) { rc = rc == 3 ? 5 : 4; goto done; }
    if (lora && (rc = lora_add_bf16(lora, layer, 1, o, NH * D, d, H, rows, threads))) goto done;
    add_rms_norm_rows(h, d, (const uint16_t *)L->ln2_w, x, rows, H, L->eps2, nt);
    rc = bf16_packed_matmul((const uint16_t *)L->w_gate_up, x, L->b_gate_up, gu, rows, 1, 2 * I, H, 0, threads);
    if (rc) { rc = rc == 3 ? 5 : 4; goto done; }
    if (lora && (rc = lora_add_bf16(lora, layer, 2, x, H, gu, 2 * I, rows, threads))) goto done;
    silu_mul_rows(gu, act, rows, I, nt);
    rc = bf16_packed_matmul((const uint16_t *)L->w_down, act, L->b_down, d, rows, 1, H, I, 0, threads);
    if (rc) { rc = rc == 3 ? 5 : 4; goto done; }
    if (lora && (rc = lora_add_bf16(lora, layer, 3, act, I, d, H, rows, threads))) goto done;
    add_rows(h, d, rows, H, nt);
done:
    free(buf);
    return rc;
#endif
}

/* y = x * rsqrt(mean(x^2) + eps) * w in fp32, per row of n */
static void rms_norm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n,
                         double eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];
        const float inv = (float)(1.0 / sqrt((double)(sum / (float)n) + (double)(float)eps));
        for (int64_t i = 0; i < n; i++) y[r * n + i] = xr[i] * inv * w[i];
    }
}

/*
 * y [rows][out] fp32 = x [rows][in] fp32 times a Q4_1 projection (plus its bias): over the blocks
 * (q4_1_q8_matmul or q4_1_matmul) for up to dims->dense_above rows; over its values packed in
 * bf16 for more (x rounded once to bf16, to nearest even, fp32 sums: the dense product the
 * PyTorch pass takes then, hf.quantized._dense_product). `xb` holds rows * in bf16 values.
 * Returns 0, 2 (out of memory) or 4 (a size the kernels do not take).
 */
static int q4_1_project(const dims_t *M, const uint8_t *blocks, const uint16_t *packed,
                        const float *x, uint16_t *xb, const float *bias, float *y, int64_t rows,
                        int64_t out, int64_t in, int threads)
{
    int rc;
    if (packed != NULL && rows > M->dense_above) {
        for (int64_t i = 0; i < rows * in; i++) xb[i] = to_bf16(x[i]);
        rc = bf16_packed_matmul(packed, xb, bias, y, rows, 1, out, in, 1, threads);
    } else {
        rc = !M->int8_activations ? q4_1_matmul(blocks, x, bias, y, rows, out, in, threads)
             : M->x16 ? q4_1_x16_q8_matmul(blocks, x, bias, y, rows, out, in, threads)
                      : q4_1_q8_matmul(blocks, x, bias, y, rows, out, in, threads);
    }
    return rc == 0 ? 0 : (rc == 2 ? 2 : 4);
}

/*
 * The same layer in fp32 over Q4_1 projections (QUANTIZATION=q4_1): h, cos, sin and the norms'
 * weights fp32, the projections over the GGUF blocks (quant.c: q4_1_q8_matmul with
 * dims->int8_activations, else q4_1_matmul), the attention paged_decode_attention (fp32). The
 * pool is fp32, or bf16 with dims->kv_bf16 (the new K/V rounded to nearest even as PyTorch's
 * copy into a bf16 pool rounds; the attention paged_decode_attention_f32_kv_bf16). Same
 * arguments and return codes (5 never).
 */
int decode_layer_q4_1(const layer_t *L, const dims_t *M, float *h, const float *cos,
                      const float *sin, const int64_t *tables, const int64_t *lens,
                      int64_t max_blocks, int64_t rows, int64_t threads,
                      const lora_proj_t *const *lora, int64_t layer)
{
    if (rows == 0) return 0;
    const int64_t H = M->hidden, NH = M->n_heads, KV = M->kv_heads, D = M->head_dim;
    const int64_t I = M->intermediate, bs = M->block_size, nb = M->num_blocks;
    const int64_t qkv_w = (NH + 2 * KV) * D;
    if (H % 32 != 0 || (NH * D) % 32 != 0 || I % 32 != 0) return 4;
    int rc = check(M, tables, lens, max_blocks, rows);
    if (rc) return rc;
    const size_t n_x = (size_t)(rows * H), n_qkv = (size_t)(rows * qkv_w);
    const size_t n_o = (size_t)(rows * NH * D), n_gu = (size_t)(rows * 2 * I);
    float *buf = (float *)malloc(sizeof(float) * (n_x * 2 + n_qkv + n_o * 2 + n_gu
                                                  + (size_t)(rows * I)));
    /* the bf16 copy of a product's input, as wide as the widest input */
    const int64_t widest = I > H ? (I > NH * D ? I : NH * D) : (H > NH * D ? H : NH * D);
    uint16_t *xb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(rows * widest));
    if (buf == NULL || xb == NULL) {
        free(buf);
        free(xb);
        return 2;
    }
    float *x = buf, *d = x + n_x, *qkv = d + n_x, *q = qkv + n_qkv, *o = q + n_o;
    float *gu = o + n_o, *act = gu + n_gu;
    const int nt = (int)threads;

    rms_norm_f32(h, (const float *)L->ln1_w, x, rows, H, L->eps1);
    rc = q4_1_project(M, (const uint8_t *)L->w_qkv, L->p_qkv, x, xb, L->b_qkv, qkv, rows, qkv_w,
                      H, nt);
    if (rc) goto done;
    if (lora && (rc = lora_add_f32(lora, layer, 0, x, H, qkv, qkv_w, rows, threads))) goto done;
    const int64_t half = D / 2, head_stride = nb * bs * D;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = lens[r] - 1;
        float *row = qkv + r * qkv_w;
        const float *c = cos + pos * D, *s = sin + pos * D;
        for (int64_t hd = 0; hd < NH + KV; hd++) {
            float *xh = row + hd * D, tmp[1024];
            memcpy(tmp, xh, sizeof(float) * (size_t)D);
            for (int64_t i = 0; i < D; i++)
                xh[i] = tmp[i] * c[i] + (i < half ? -tmp[i + half] : tmp[i - half]) * s[i];
        }
        memcpy(q + r * NH * D, row, sizeof(float) * (size_t)(NH * D));
        const int64_t slot = tables[r * max_blocks + pos / bs] * bs + pos % bs;
        for (int64_t j = 0; j < 2 * KV; j++) {  /* K heads, then V heads */
            const float *src = row + (NH + j) * D;
            if (M->kv_bf16) {
                uint16_t *dst = (uint16_t *)L->pool + j * head_stride + slot * D;
                for (int64_t i = 0; i < D; i++) dst[i] = to_bf16(src[i]);
            } else {
                memcpy((float *)L->pool + j * head_stride + slot * D, src,
                       sizeof(float) * (size_t)D);
            }
        }
    }
    rc = M->kv_bf16
        ? paged_decode_attention_f32_kv_bf16(q, (const uint16_t *)L->pool, tables, lens, o, rows,
                                             KV, NH / KV, D, nb, bs, max_blocks, (float)M->scale)
        : paged_decode_attention(q, (const float *)L->pool, tables, lens, o, rows, KV, NH / KV,
                                 D, nb, bs, max_blocks, (float)M->scale);
    if (rc) goto done;
    rc = q4_1_project(M, (const uint8_t *)L->w_o, L->p_o, o, xb, L->b_o, d, rows, H, NH * D, nt);
    if (rc) goto done;
    if (lora && (rc = lora_add_f32(lora, layer, 1, o, NH * D, d, H, rows, threads))) goto done;
    for (size_t i = 0; i < n_x; i++) h[i] += d[i];

    rms_norm_f32(h, (const float *)L->ln2_w, x, rows, H, L->eps2);
    rc = q4_1_project(M, (const uint8_t *)L->w_gate_up, L->p_gate_up, x, xb, L->b_gate_up, gu,
                      rows, 2 * I, H, nt);
    if (rc) goto done;
    if (lora && (rc = lora_add_f32(lora, layer, 2, x, H, gu, 2 * I, rows, threads))) goto done;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < I; i++) {
            const float g = gu[r * 2 * I + i];
            act[r * I + i] = g / (1.0f + expf(-g)) * gu[r * 2 * I + I + i];
        }
    rc = q4_1_project(M, (const uint8_t *)L->w_down, L->p_down, act, xb, L->b_down, d, rows, H,
                      I, nt);
    if (rc) goto done;
    if (lora && (rc = lora_add_f32(lora, layer, 3, act, I, d, H, rows, threads))) goto done;
    for (size_t i = 0; i < n_x; i++) h[i] += d[i];
done:
    free(buf);
    free(xb);
    return rc;
}

/* ------------------------------------------------------------------ prefill and mixed passes
 *
 *   pass_layer_bf16(layer, dims, h, cos, sin, pass, threads, lora, layer_index)
 *
 * One layer of any pass of a bf16 model, in one call: prompt chunks (their attention by
 * prefill_attention_bf16, prefill_attention.c) followed by decode rows (paged_decode_attention_bf16),
 * pass_t below. The steps and roundings are decode_layer_bf16's; the elementwise steps run on
 * AVX-512 over all the pass's tokens, split over the threads, and SiLU's exp is simd_exp.h's
 * (within 2 ulp of fp32 exp; the bf16 result it rounds to rarely differs). A prompt
 * chunk's some thirty PyTorch operations a layer took about a fifth of its pass in bf16.
 *
 * Return codes: decode_layer_bf16's; 1 also for a position past the rotary tables or a slot
 * outside the pool, checked before anything is written.
 */
typedef struct {
    int64_t tokens;            /* the pass's new tokens: the prefill rows', then one per decode row */
    const int64_t *positions;  /* [tokens] each token's position in its row */
    const int64_t *slots;      /* [tokens] each token's KV slot: block id * block_size + offset */
    int64_t p_rows, p_max_blocks;  /* prefill rows: prefill_attention_bf16's arguments */
    const int64_t *p_tables, *p_token_start, *p_pos_start;
    int64_t d_rows, d_max_blocks;  /* decode rows, the last d_rows tokens */
    const int64_t *d_tables, *d_lens;
    void *work;                /* pass_layer_bf16_work(dims, tokens) bytes of scratch */
} pass_t;

static int64_t pass_widths(const dims_t *M)
{
    const int64_t H = M->hidden, NHD = M->n_heads * M->head_dim, I = M->intermediate;
    return 2 * H + (M->n_heads + 2 * M->kv_heads) * M->head_dim + 2 * NHD + 3 * I;
}

int64_t pass_layer_bf16_work(const dims_t *M, int64_t tokens)
{
    return (int64_t)sizeof(uint16_t) * tokens * pass_widths(M);
}

int prefill_attention_bf16(const uint16_t *q, const uint16_t *pool, const int64_t *tables,
                           const int64_t *token_start, const int64_t *pos_start, uint16_t *out,
                           int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                           int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                           float scale, int64_t threads);


int pass_layer_bf16(const layer_t *L, const dims_t *M, uint16_t *h, const uint16_t *cos,
                    const uint16_t *sin, const pass_t *P, int64_t threads,
                    const lora_proj_t *const *lora, int64_t layer)
{
#ifndef __AVX512BF16__
    (void)L; (void)M; (void)h; (void)cos; (void)sin; (void)P; (void)threads; (void)lora;
    (void)layer;
    return 5;
#else
    const int64_t N = P->tokens;
    if (N == 0) return 0;
    if (!bf16_packed_matmul_available()) return 5;
    const int64_t H = M->hidden, NH = M->n_heads, KV = M->kv_heads, D = M->head_dim;
    const int64_t I = M->intermediate, bs = M->block_size, nb = M->num_blocks;
    const int64_t qkv_w = (NH + 2 * KV) * D, nhd = NH * D;
    if (H % 64 != 0 || qkv_w % 64 != 0 || nhd % 2 != 0 || (2 * I) % 64 != 0 || I % 2 != 0
        || D < 2 || D % 2 != 0 || D > 1024 || KV < 1 || NH % KV != 0 || bs < 1)
        return 4;
    const int64_t p_tokens = P->p_rows ? P->p_token_start[P->p_rows] : 0;
    if (P->p_rows < 0 || P->d_rows < 0 || p_tokens < 0 || p_tokens + P->d_rows != N)
        return 1;
    for (int64_t t = 0; t < N; t++)
        if (P->positions[t] < 0 || P->positions[t] >= M->max_positions || P->slots[t] < 0
            || P->slots[t] >= nb * bs)
            return 1;
    const int nt = threads < 1 ? 1 : (int)threads;
    uint16_t *x = (uint16_t *)P->work, *d = x + N * H, *qkv = d + N * H, *q = qkv + N * qkv_w;
    uint16_t *o = q + N * nhd, *gu = o + N * nhd, *act = gu + N * 2 * I;
    int rc;

    add_rms_norm_rows(h, NULL, (const uint16_t *)L->ln1_w, x, N, H, L->eps1, nt);
    rc = bf16_packed_matmul((const uint16_t *)L->w_qkv, x, L->b_qkv, qkv, N, 1, qkv_w, H, 0, nt);
    if (rc) return rc == 3 ? 5 : 4;
    if (lora && (rc = lora_add_bf16(lora, layer, 0, x, H, qkv, qkv_w, N, nt))) return rc;
    const int64_t head_stride = nb * bs * D;
    uint16_t *pool = (uint16_t *)L->pool;
    rope_kv_rows(qkv, P->positions, P->slots, cos, sin, q, pool, N, NH, KV, D, head_stride, nt);
    if (P->p_rows) {
        rc = prefill_attention_bf16(q, pool, P->p_tables, P->p_token_start, P->p_pos_start, o,
                                    P->p_rows, KV, NH / KV, D, nb, bs, P->p_max_blocks,
                                    (float)M->scale, nt);
        if (rc) return rc == 3 ? 4 : rc == 4 ? 3 : rc;
    }
    if (P->d_rows) {
        rc = paged_decode_attention_bf16(q + p_tokens * nhd, pool, P->d_tables, P->d_lens,
                                         o + p_tokens * nhd, P->d_rows, KV, NH / KV, D, nb, bs,
                                         P->d_max_blocks, (float)M->scale);
        if (rc) return rc;
    }
    rc = bf16_packed_matmul((const uint16_t *)L->w_o, o, L->b_o, d, N, 1, H, nhd, 0, nt);
    if (rc) return rc == 3 ? 5 : 4;
    if (lora && (rc = lora_add_bf16(lora, layer, 1, o, nhd, d, H, N, nt))) return rc;
    add_rms_norm_rows(h, d, (const uint16_t *)L->ln2_w, x, N, H, L->eps2, nt);
    rc = bf16_packed_matmul((const uint16_t *)L->w_gate_up, x, L->b_gate_up, gu, N, 1, 2 * I, H,
                            0, nt);
    if (rc) return rc == 3 ? 5 : 4;
    if (lora && (rc = lora_add_bf16(lora, layer, 2, x, H, gu, 2 * I, N, nt))) return rc;
    silu_mul_rows(gu, act, N, I, nt);
    rc = bf16_packed_matmul((const uint16_t *)L->w_down, act, L->b_down, d, N, 1, H, I, 0, nt);
    if (rc) return rc == 3 ? 5 : 4;
    if (lora && (rc = lora_add_bf16(lora, layer, 3, act, I, d, H, N, nt))) return rc;
    add_rows(h, d, N, H, nt);
    return 0;
#endif
}

/*
 * The elementwise steps of a bf16 pass whose products and attention run elsewhere (forward.py's
 * layer loop on a CPU with AMX, where F.linear and scaled_dot_product_attention run on oneDNN's
 * AMX tiles), one call each instead of several PyTorch operations, with the roundings above.
 * Each returns 5 when built without AVX512-BF16 (nothing written).
 *
 *   bf16_add_rms_norm(h, d, w, y, rows, n, eps, threads)
 *     h [rows][n] bf16; d NULL or [rows][n]: h = bf16(h + d) first; y [rows][n] = RMSNorm(h) w
 *   bf16_silu_mul(gu, act, rows, I, threads)
 *     gu [rows][2 I] (gate, then up); act [rows][I] = bf16(bf16(SiLU(gate)) up)
 *   bf16_rope_kv_write(qkv, positions, slots, cos, sin, q, pool, tokens, n_heads, kv_heads,
 *                      head_dim, slot_count, max_positions, threads)
 *     qkv [tokens][(n_heads + 2 kv_heads) head_dim]: q and k heads rotated in place at each
 *     token's position; q [tokens][n_heads head_dim] gets the rotated q heads; each token's K
 *     and V heads are written to slot slots[t] of pool [2 kv_heads][slot_count][head_dim].
 *     Returns 1 (nothing written) for a position outside [0, max_positions) or a slot outside
 *     [0, slot_count), 4 for an odd head size or one above 1,024.
 */
int bf16_add_rms_norm(uint16_t *h, const uint16_t *d, const uint16_t *w, uint16_t *y,
                      int64_t rows, int64_t n, double eps, int64_t threads)
{
#ifndef __AVX512BF16__
    (void)h; (void)d; (void)w; (void)y; (void)rows; (void)n; (void)eps; (void)threads;
    return 5;
#else
    add_rms_norm_rows(h, d, w, y, rows, n, eps, threads < 1 ? 1 : (int)threads);
    return 0;
#endif
}

int bf16_silu_mul(const uint16_t *gu, uint16_t *act, int64_t rows, int64_t I, int64_t threads)
{
#ifndef __AVX512BF16__
    (void)gu; (void)act; (void)rows; (void)I; (void)threads;
    return 5;
#else
    silu_mul_rows(gu, act, rows, I, threads < 1 ? 1 : (int)threads);
    return 0;
#endif
}

int bf16_rope_kv_write(uint16_t *qkv, const int64_t *positions, const int64_t *slots,
                       const uint16_t *cos, const uint16_t *sin, uint16_t *q, uint16_t *pool,
                       int64_t tokens, int64_t n_heads, int64_t kv_heads, int64_t head_dim,
                       int64_t slot_count, int64_t max_positions, int64_t threads)
{
#ifndef __AVX512BF16__
    (void)qkv; (void)positions; (void)slots; (void)cos; (void)sin; (void)q; (void)pool;
    (void)tokens; (void)n_heads; (void)kv_heads; (void)head_dim; (void)slot_count;
    (void)max_positions; (void)threads;
    return 5;
#else
    const int64_t D = head_dim, NH = n_heads, KV = kv_heads;
    if (D < 2 || D % 2 != 0 || D > 1024 || NH < 1 || KV < 1) return 4;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_positions || slots[t] < 0
            || slots[t] >= slot_count)
            return 1;
    const int64_t head_stride = slot_count * D;
    const int nt = threads < 1 ? 1 : (int)threads;
    rope_kv_rows(qkv, positions, slots, cos, sin, q, pool, tokens, NH, KV, D, head_stride, nt);
    return 0;
#endif
}
