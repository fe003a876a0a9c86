/*
 * Decode attention read straight from a paged KV block pool (fp32, CPU).
 *
 * The gather path in hf.py copies every row's K/V out of the pool into a padded batch tensor
 * before scaled_dot_product_attention reads it again; at decode that copy costs about twice the
 * attention itself. This kernel reads each row's K/V where it lies, block by block, following the
 * row's block table, in the manner of vLLM's paged-attention decode kernel (Kwon et al.,
 * "Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023),
 * with a plain two-pass softmax per row and KV head.
 *
 * Layouts (all C-contiguous):
 *   q      [rows, kv_heads, group, head_dim]   query heads of one KV head adjacent (GQA)
 *   pool   [2 * kv_heads, num_blocks, block_size, head_dim]   one layer: K heads, then V heads
 *   tables [rows, max_blocks] int64            block ids, the first ceil(len / block_size) used
 *   lens   [rows] int64                        tokens each row attends to (its new token included)
 *   out    [rows, kv_heads, group, head_dim]
 *
 * Work is split over (row, KV head) pairs with OpenMP; loaded into a process that already holds
 * PyTorch, it shares PyTorch's OpenMP runtime and thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int paged_decode_attention(const float *q, const float *pool, const int64_t *tables,
                           const int64_t *lens, float *out, int64_t rows, int64_t kv_heads,
                           int64_t group, int64_t head_dim, int64_t num_blocks,
                           int64_t block_size, int64_t max_blocks, float scale)
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
    const int64_t D = head_dim, G = group, bs = block_size;
    const int64_t block_stride = bs * D;
    const int64_t head_stride = num_blocks * block_stride;
    int failed = 0;

#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * max_len));
        float *inv = (float *)malloc(sizeof(float) * (size_t)G);
        if (scores == NULL || inv == NULL) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scores == NULL || inv == NULL) continue;
                const int64_t L = lens[r];
                const int64_t *table = tables + r * max_blocks;
                const float *qh = q + (r * kv_heads + h) * G * D;
                float *oh = out + (r * kv_heads + h) * G * D;
                const float *k_head = pool + h * head_stride;
                const float *v_head = pool + (kv_heads + h) * head_stride;

                /* scores[g, t] = q[g] . k[t] * scale */
                for (int64_t t0 = 0; t0 < L; t0 += bs) {
                    const int64_t block = table[t0 / bs];
                    const float *kb = k_head + block * block_stride;
                    const int64_t n = (L - t0 < bs) ? L - t0 : bs;
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
                    const int64_t block = table[t0 / bs];
                    const float *vb = v_head + block * block_stride;
                    const int64_t n = (L - t0 < bs) ? L - t0 : bs;
                    for (int64_t i = 0; i < n; i++) {
                        const float *v = vb + i * D;
                        for (int64_t g = 0; g < G; g++) {
                            const float p = scores[g * L + t0 + i];
                            float *og = oh + g * D;
                            for (int64_t d = 0; d < D; d++) og[d] += p * v[d];
                        }
                    }
                }
                for (int64_t g = 0; g < G; g++)
                    for (int64_t d = 0; d < D; d++) oh[g * D + d] *= inv[g];
            }
        }
        free(scores);
        free(inv);
    }
    return failed;
}
