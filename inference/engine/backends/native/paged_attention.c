/*
 * Decode attention read straight from a paged KV block pool (fp32 or bf16, CPU).
 *
 * The gather path (inference/backends/hf/attention.py) copies every row's K/V out of the pool
 * into a padded batch tensor before scaled_dot_product_attention reads it again; at decode that
 * copy costs about twice the attention itself. This kernel reads each row's K/V where it lies,
 * block by block, following the row's block table, in the manner of vLLM's paged-attention decode
 * kernel (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
 * PagedAttention", SOSP 2023), with a plain two-pass softmax per row and KV head.
 *
 * Two entry points, one body:
 *   paged_decode_attention       q, pool and out in fp32;
 *   paged_decode_attention_bf16  q, pool and out in bf16 (uint16_t storage, the upper half of an
 *                                IEEE fp32). Each block of K or V is widened to fp32 exactly (a
 *                                16-bit shift) into a per-thread buffer of block_size * head_dim
 *                                floats, so the dot products, the softmax and the weighted sum
 *                                run and accumulate in fp32 as in the fp32 kernel; the output is
 *                                rounded once to bf16, to nearest even (as PyTorch rounds).
 *
 * Layouts (all C-contiguous):
 *   q      [rows, kv_heads, group, head_dim]   query heads of one KV head adjacent (GQA)
 *   pool   [2 * kv_heads, num_blocks, block_size, head_dim]   one layer: K heads, then V heads
 *   tables [rows, max_blocks] int64            block ids, the first ceil(len / block_size) used
 *   lens   [rows] int64                        tokens each row attends to (its new token included)
 *   out    [rows, kv_heads, group, head_dim]
 *
 * Return codes: 0 done; 1 a length below 1 or beyond its block table; 2 out of memory (or a
 * score buffer too large for size_t); 3 a block id outside the pool.
 *
 * Work is split over (row, KV head) pairs with OpenMP; loaded into a process that already holds
 * PyTorch, it shares PyTorch's OpenMP runtime and thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; a NaN stays a (quiet) NaN. Bit operations only, so -ffast-math's
 * assumption that no NaN occurs cannot remove the NaN test. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void widen(const uint16_t *src, float *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* The lengths and block ids checked against the pool; 0 or a return code above. */
static int check_tables(const int64_t *tables, const int64_t *lens, int64_t rows,
                        int64_t group, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                        int64_t max_blocks, int64_t *max_len_out)
{
    int64_t max_len = 0;
    for (int64_t r = 0; r < rows; r++) {
        /* (len - 1) / block_size: the last block's index, with no overflow for any int64 */
        if (lens[r] < 1 || (lens[r] - 1) / block_size >= max_blocks) return 1;
        if (lens[r] > max_len) max_len = lens[r];
        for (int64_t j = 0; j <= (lens[r] - 1) / block_size; j++)
            if (tables[r * max_blocks + j] < 0 || tables[r * max_blocks + j] >= num_blocks)
                return 3;
    }
    if (group < 1 || head_dim < 1 || max_len > (int64_t)(SIZE_MAX / sizeof(float)) / group)
        return 2;
    *max_len_out = max_len;
    return 0;
}

/*
 * The body of both entry points: q, pool and out point to float (bf16 == 0) or uint16_t
 * (bf16 == 1) elements. `bf16` is tested once per head or block, never per element: the inner
 * loops are the same fp32 loops for both.
 */
static int attend(const void *q, const void *pool, const int64_t *tables, const int64_t *lens,
                  void *out, int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                  int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale,
                  int bf16)
{
    int64_t max_len = 0;
    int rc = check_tables(tables, lens, rows, group, head_dim, num_blocks, block_size, max_blocks,
                          &max_len);
    if (rc) return rc;
    const int64_t D = head_dim, G = group, bs = block_size;
    const int64_t block_stride = bs * D;
    const int64_t head_stride = num_blocks * block_stride;
    int failed = 0;

#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * max_len));
        float *inv = (float *)malloc(sizeof(float) * (size_t)G);
        /* bf16 only: the head's queries and output accumulator, and one widened K or V block */
        float *qbuf = bf16 ? (float *)malloc(sizeof(float) * (size_t)(2 * G * D)) : NULL;
        float *kvbuf = bf16 ? (float *)malloc(sizeof(float) * (size_t)block_stride) : NULL;
        const int ok = scores != NULL && inv != NULL && (!bf16 || (qbuf != NULL && kvbuf != NULL));
        if (!ok) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                if (!ok) continue;
                const int64_t L = lens[r];
                const int64_t *table = tables + r * max_blocks;
                const int64_t qo = (r * kv_heads + h) * G * D; /* element offset of q and out */
                const int64_t ko = h * head_stride, vo = (kv_heads + h) * head_stride;
                const float *qh;
                float *oh;
                if (bf16) {
                    widen((const uint16_t *)q + qo, qbuf, G * D);
                    qh = qbuf;
                    oh = qbuf + G * D;
                } else {
                    qh = (const float *)q + qo;
                    oh = (float *)out + qo;
                }

                /* scores[g, t] = q[g] . k[t] * scale */
                for (int64_t t0 = 0; t0 < L; t0 += bs) {
                    const int64_t block_off = table[t0 / bs] * block_stride;
                    const int64_t n = (L - t0 < bs) ? L - t0 : bs;
                    const float *kb;
                    if (bf16) {
                        widen((const uint16_t *)pool + ko + block_off, kvbuf, n * D);
                        kb = kvbuf;
                    } else {
                        kb = (const float *)pool + ko + block_off;
                    }
                    for (int64_t i = 0; i < n; i++) {
                        const float *k = kb + i * D;
                        for (int64_t g = 0; g < G; g++) {
                            const float *qg = qh + g * D;
                            float s = 0.0f;
                            for (int64_t d = 0; d < D; d++) s += qg[d] * k[d];
                            scores[g * L + t0 + i] = s * scale;
                        }
                    }
                }
                /* softmax over t, per query head */
                for (int64_t g = 0; g < G; g++) {
                    float *sg = scores + g * L;
                    float m = sg[0];
                    for (int64_t t = 1; t < L; t++) m = sg[t] > m ? sg[t] : m;
                    float sum = 0.0f;
                    for (int64_t t = 0; t < L; t++) {
                        sg[t] = expf(sg[t] - m);
                        sum += sg[t];
                    }
                    inv[g] = 1.0f / sum;
                }
                /* out[g] = sum_t p[g, t] v[t] */
                memset(oh, 0, sizeof(float) * (size_t)(G * D));
                for (int64_t t0 = 0; t0 < L; t0 += bs) {
                    const int64_t block_off = table[t0 / bs] * block_stride;
                    const int64_t n = (L - t0 < bs) ? L - t0 : bs;
                    const float *vb;
                    if (bf16) {
                        widen((const uint16_t *)pool + vo + block_off, kvbuf, n * D);
                        vb = kvbuf;
                    } else {
                        vb = (const float *)pool + vo + block_off;
                    }
                    for (int64_t i = 0; i < n; i++) {
                        const float *v = vb + i * D;
                        for (int64_t g = 0; g < G; g++) {
                            const float p = scores[g * L + t0 + i];
                            float *og = oh + g * D;
                            for (int64_t d = 0; d < D; d++) og[d] += p * v[d];
                        }
                    }
                }
                if (bf16) {
                    uint16_t *ob = (uint16_t *)out + qo;
                    for (int64_t g = 0; g < G; g++)
                        for (int64_t d = 0; d < D; d++)
                            ob[g * D + d] = f32_to_bf16(oh[g * D + d] * inv[g]);
                } else {
                    for (int64_t g = 0; g < G; g++)
                        for (int64_t d = 0; d < D; d++) oh[g * D + d] *= inv[g];
                }
            }
        }
        free(scores);
        free(inv);
        free(qbuf);
        free(kvbuf);
    }
    return failed;
}

int paged_decode_attention(const float *q, const float *pool, const int64_t *tables,
                           const int64_t *lens, float *out, int64_t rows, int64_t kv_heads,
                           int64_t group, int64_t head_dim, int64_t num_blocks,
                           int64_t block_size, int64_t max_blocks, float scale)
{
    return attend(q, pool, tables, lens, out, rows, kv_heads, group, head_dim, num_blocks,
                  block_size, max_blocks, scale, 0);
}

int paged_decode_attention_bf16(const uint16_t *q, const uint16_t *pool, const int64_t *tables,
                                const int64_t *lens, uint16_t *out, int64_t rows,
                                int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                                float scale)
{
    return attend(q, pool, tables, lens, out, rows, kv_heads, group, head_dim, num_blocks,
                  block_size, max_blocks, scale, 1);
}
