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
 * Three entry points, one body:
 *   paged_decode_attention       q, pool and out in fp32;
 *   paged_decode_attention_bf16  q, pool and out in bf16 (uint16_t storage, the upper half of an
 *                                IEEE fp32). Each K or V element is widened to fp32 exactly (a
 *                                16-bit shift) in registers as the products read it (no copy of
 *                                the block), so the dot products, the softmax and the weighted
 *                                sum run and accumulate in fp32 as in the fp32 kernel; the output
 *                                is rounded once to bf16, to nearest even (as PyTorch rounds).
 *   paged_decode_attention_f32_kv_bf16  q and out in fp32, the pool in bf16 (an fp32 model whose
 *                                KV cache is kept in bf16: half the bytes of an fp32 cache); K
 *                                and V widened as above, q and out as in the fp32 kernel.
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
 * Work is split over (row, KV head) pairs with OpenMP, and a row's context over parts of whole
 * blocks when the pairs are fewer than the threads (attend); loaded into a process that already
 * holds PyTorch, it shares PyTorch's OpenMP runtime and thread pool.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
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

/* A row's context is split into parts of at least this many blocks only while the (row, KV head)
 * pairs alone are too few (under four per thread) to keep every thread busy to the end. */
#define MIN_PART_BLOCKS 4

/*
 * The body of the entry points: q and out point to uint16_t (bf16) elements when `flags` holds
 * ACT_BF16, else to float; the pool to uint16_t when it holds KV_BF16, else to float. The flags
 * are tested once per head or block, never per element: the inner loops are the same fp32 loops
 * for all.
 *
 * Work items are (row, KV head, part): a part is a run of whole blocks of the row's context.
 * With four (row, KV head) pairs a thread or more, each row is one part. With fewer (a single
 * stream has kv_heads pairs: 3 on 2 threads leave one thread idle a third of the time), each row's context is
 * split into parts of at least MIN_PART_BLOCKS blocks, about four items per thread, as in
 * flash-decoding (Dao, Haziza, Massa and Sizov, "Flash-Decoding for long-context inference",
 * 2023): each part computes its scores' maximum m, its sum of exp(score - m) l and its
 * unnormalised output sum_t exp(score_t - m) v_t; the parts of a row and head are then merged
 * exactly: M = max m_s, out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s. A row of one
 * part gives out = acc * (1 / l), the one-pass result.
 */
#define ACT_BF16 1
#define KV_BF16 2

static int attend(const void *q, const void *pool, const int64_t *tables, const int64_t *lens,
                  void *out, int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                  int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale,
                  int flags)
{
    const int bf16 = (flags & ACT_BF16) != 0, kv_bf16 = (flags & KV_BF16) != 0;
    int64_t max_len = 0;
    int rc = check_tables(tables, lens, rows, group, head_dim, num_blocks, block_size, max_blocks,
                          &max_len);
    if (rc) return rc;
    const int64_t D = head_dim, G = group, bs = block_size;
    const int64_t block_stride = bs * D;
    const int64_t head_stride = num_blocks * block_stride;
    const int64_t pairs = rows * kv_heads;
    const int64_t threads = omp_get_max_threads();
    const int64_t max_nb = (max_len - 1) / bs + 1;
    int64_t parts = 1;
    if (pairs < 4 * threads) {
        parts = (4 * threads + pairs - 1) / pairs;
        const int64_t most = (max_nb + MIN_PART_BLOCKS - 1) / MIN_PART_BLOCKS;
        if (parts > most) parts = most;
        if (parts < 1) parts = 1;
    }
    /* blocks per part; a row of fewer blocks has fewer parts (the others empty) */
    const int64_t part_nb = (max_nb + parts - 1) / parts;
    const int64_t part_len = part_nb * bs;
    const int64_t items = pairs * parts;
    /* per item: m[G], l[G], acc[G * D] (only when a row has several parts) */
    float *partial = NULL;
    if (parts > 1) {
        partial = (float *)malloc(sizeof(float) * (size_t)(items * G * (D + 2)));
        if (partial == NULL) return 2;
    }
    int failed = 0;

#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * part_len));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(G * D + 2 * G));
        /* bf16 only: the head's queries, widened */
        float *qbuf = bf16 ? (float *)malloc(sizeof(float) * (size_t)(G * D)) : NULL;
        const int ok = scores != NULL && acc != NULL && (!bf16 || qbuf != NULL);
        if (!ok) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!ok) continue;
            const int64_t pair = it / parts, part = it % parts;
            const int64_t r = pair / kv_heads, h = pair % kv_heads;
            const int64_t L = lens[r];
            const int64_t t_begin = part * part_len;
            const int64_t t_end = (t_begin + part_len < L) ? t_begin + part_len : L;
            float *m = acc + G * D, *l = m + G;
            float *dst = parts > 1 ? partial + it * G * (D + 2) : NULL;
            if (t_begin >= t_end) {  /* an empty part of a short row: merged as nothing */
                for (int64_t g = 0; g < G; g++) {
                    dst[g] = -FLT_MAX;
                    dst[G + g] = 0.0f;
                }
                memset(dst + 2 * G, 0, sizeof(float) * (size_t)(G * D));
                continue;
            }
            const int64_t n_t = t_end - t_begin;
            const int64_t *table = tables + r * max_blocks;
            const int64_t qo = (r * kv_heads + h) * G * D; /* element offset of q and out */
            const int64_t ko = h * head_stride, vo = (kv_heads + h) * head_stride;
            const float *qh;
            if (bf16) {
                widen((const uint16_t *)q + qo, qbuf, G * D);
                qh = qbuf;
            } else {
                qh = (const float *)q + qo;
            }

            /* scores[g, t - t_begin] = q[g] . k[t] * scale; bf16 K widened in registers */
            for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
                const int64_t block_off = table[t0 / bs] * block_stride;
                const int64_t n = (t_end - t0 < bs) ? t_end - t0 : bs;
                if (kv_bf16) {
                    const uint16_t *kb = (const uint16_t *)pool + ko + block_off;
                    for (int64_t i = 0; i < n; i++) {
                        const uint16_t *k = kb + i * D;
                        for (int64_t g = 0; g < G; g++) {
                            const float *qg = qh + g * D;
                            float s = 0.0f;
                            for (int64_t d = 0; d < D; d++) s += qg[d] * bf16_to_f32(k[d]);
                            scores[g * n_t + t0 - t_begin + i] = s * scale;
                        }
                    }
                    continue;
                }
                const float *kb = (const float *)pool + ko + block_off;
                for (int64_t i = 0; i < n; i++) {
                    const float *k = kb + i * D;
                    for (int64_t g = 0; g < G; g++) {
                        const float *qg = qh + g * D;
                        float s = 0.0f;
                        for (int64_t d = 0; d < D; d++) s += qg[d] * k[d];
                        scores[g * n_t + t0 - t_begin + i] = s * scale;
                    }
                }
            }
            /* softmax's parts over t, per query head */
            for (int64_t g = 0; g < G; g++) {
                float *sg = scores + g * n_t;
                float mx = sg[0];
                for (int64_t t = 1; t < n_t; t++) mx = sg[t] > mx ? sg[t] : mx;
                float sum = 0.0f;
                for (int64_t t = 0; t < n_t; t++) {
                    sg[t] = expf(sg[t] - mx);
                    sum += sg[t];
                }
                m[g] = mx;
                l[g] = sum;
            }
            /* acc[g] = sum_t p[g, t] v[t] */
            memset(acc, 0, sizeof(float) * (size_t)(G * D));
            for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
                const int64_t block_off = table[t0 / bs] * block_stride;
                const int64_t n = (t_end - t0 < bs) ? t_end - t0 : bs;
                if (kv_bf16) {
                    const uint16_t *vb = (const uint16_t *)pool + vo + block_off;
                    for (int64_t i = 0; i < n; i++) {
                        const uint16_t *v = vb + i * D;
                        for (int64_t g = 0; g < G; g++) {
                            const float p = scores[g * n_t + t0 - t_begin + i];
                            float *og = acc + g * D;
                            for (int64_t d = 0; d < D; d++) og[d] += p * bf16_to_f32(v[d]);
                        }
                    }
                    continue;
                }
                const float *vb = (const float *)pool + vo + block_off;
                for (int64_t i = 0; i < n; i++) {
                    const float *v = vb + i * D;
                    for (int64_t g = 0; g < G; g++) {
                        const float p = scores[g * n_t + t0 - t_begin + i];
                        float *og = acc + g * D;
                        for (int64_t d = 0; d < D; d++) og[d] += p * v[d];
                    }
                }
            }
            if (parts > 1) {
                memcpy(dst, m, sizeof(float) * (size_t)G);
                memcpy(dst + G, l, sizeof(float) * (size_t)G);
                memcpy(dst + 2 * G, acc, sizeof(float) * (size_t)(G * D));
            } else if (bf16) {
                uint16_t *ob = (uint16_t *)out + qo;
                for (int64_t g = 0; g < G; g++) {
                    const float inv = 1.0f / l[g];
                    for (int64_t d = 0; d < D; d++) ob[g * D + d] = f32_to_bf16(acc[g * D + d] * inv);
                }
            } else {
                float *oh = (float *)out + qo;
                for (int64_t g = 0; g < G; g++) {
                    const float inv = 1.0f / l[g];
                    for (int64_t d = 0; d < D; d++) oh[g * D + d] = acc[g * D + d] * inv;
                }
            }
        }
        /* merge each (row, KV head)'s parts (several parts only) */
        if (parts > 1) {
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < pairs; pair++) {
                if (!ok) continue;
                const int64_t qo = pair * G * D;
                const float *first = partial + pair * parts * G * (D + 2);
                for (int64_t g = 0; g < G; g++) {
                    float mx = -FLT_MAX;
                    for (int64_t s = 0; s < parts; s++) {
                        const float ms = first[s * G * (D + 2) + g];
                        mx = ms > mx ? ms : mx;
                    }
                    float denom = 0.0f;
                    float *o = acc;  /* the merged output of query head g */
                    memset(o, 0, sizeof(float) * (size_t)D);
                    for (int64_t s = 0; s < parts; s++) {
                        const float *ps = first + s * G * (D + 2);
                        if (ps[G + g] == 0.0f) continue;  /* an empty part */
                        const float w = expf(ps[g] - mx);
                        denom += w * ps[G + g];
                        const float *as = ps + 2 * G + g * D;
                        for (int64_t d = 0; d < D; d++) o[d] += w * as[d];
                    }
                    const float inv = 1.0f / denom;
                    if (bf16) {
                        uint16_t *ob = (uint16_t *)out + qo + g * D;
                        for (int64_t d = 0; d < D; d++) ob[d] = f32_to_bf16(o[d] * inv);
                    } else {
                        float *oh = (float *)out + qo + g * D;
                        for (int64_t d = 0; d < D; d++) oh[d] = o[d] * inv;
                    }
                }
            }
        }
        free(scores);
        free(acc);
        free(qbuf);
    }
    free(partial);
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
                  block_size, max_blocks, scale, ACT_BF16 | KV_BF16);
}

int paged_decode_attention_f32_kv_bf16(const float *q, const uint16_t *pool,
                                       const int64_t *tables, const int64_t *lens, float *out,
                                       int64_t rows, int64_t kv_heads, int64_t group,
                                       int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                       int64_t max_blocks, float scale)
{
    return attend(q, pool, tables, lens, out, rows, kv_heads, group, head_dim, num_blocks,
                  block_size, max_blocks, scale, KV_BF16);
}
