/*
 * Prefill attention of a bf16 model on a CPU with AVX512-BF16, read from the paged KV pool: the
 * new tokens of one or more rows (prompt chunks, each at any offset in its row) attend causally
 * to every earlier position of their row and to each other.
 *
 *   prefill_attention_bf16(q, pool, tables, token_start, pos_start, out, rows, kv_heads, group,
 *                          head_dim, num_blocks, block_size, max_blocks, scale, threads)
 *     q            [tokens][kv_heads][group][64] bf16, the rows' new tokens packed row by row
 *     pool         [2 * kv_heads][num_blocks][block_size][64] bf16: K heads, then V heads (the
 *                  new tokens' K/V already written)
 *     tables       [rows][max_blocks] int64 block ids of each row
 *     token_start  [rows + 1] int64: row r's tokens are q[token_start[r] .. token_start[r + 1])
 *     pos_start    [rows] int64: the position of row r's first new token (its keys are
 *                  positions 0 .. pos_start[r] + new tokens - 1)
 *     out          [tokens][kv_heads][group][64] bf16
 *
 * FlashAttention's online softmax (Dao et al., NeurIPS 2022) over chunks of 64 keys, with the
 * products on VDPBF16PS in the broadcast form of bf16_gemm.c (no horizontal sums): each row's K
 * and V of one KV head are first packed into chunk buffers, K as [32 pairs of dims][64 keys][2]
 * (lanes = keys) and V as [32 pairs of keys][64 dims][2] (lanes = dims). Per work item (a row,
 * a KV head, up to 24 query rows = tokens x the group's query heads) and chunk: the scores of 6
 * query rows at a time in 24 fp32 accumulators, scaled and masked (a key after the query's own
 * position gets -1e30), the running max and sum updated, the probabilities rounded to bf16 (as
 * scaled_dot_product_attention's bf16 path does before its product with V), and the output's
 * 6 x 64 fp32 accumulators advanced over the chunk's 32 pairs of keys. The output is divided by
 * the sum and rounded once to bf16 (nearest even).
 *
 * Return codes: 0 done; 1 a size out of range (rows, tokens, a position past the block table);
 * 2 out of memory; 3 unsupported here (built without AVX512-BF16 and AVX512-BW, head_dim not
 * 64, or group above 24); 4 a block id outside the pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* The packing's permutes need AVX512-BW, which every CPU with AVX512-BF16 has. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PREFILL_KERNEL 1
#include <immintrin.h>
#include "simd_exp.h"
#endif

#define HD 64        /* head_dim the kernel takes */
#define KC 64        /* keys per chunk */
#define CHUNK_U32 (KC * HD / 2) /* 32-bit pairs per packed chunk (K or V): 2,048 */
#define QR 6         /* query rows per micro-kernel */
#define MAX_ROWS 24  /* query rows per work item */
#define MASKED (-1e30f) /* a finite "minus infinity": built with -ffinite-math-only */

#ifdef PREFILL_KERNEL
/* r[0..15], 16 rows of 16 uint32, become its columns: r[j] lane i = old r[i] lane j. Unpacks of
 * 32- then 64-bit elements, then two rounds of 128-bit lane shuffles. */
static inline __attribute__((always_inline)) void transpose16(__m512i *r)
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* K and V of row r, KV head h, chunk c into kp and vp (CHUNK_U32 pairs each; 0 past ctx). K:
 * per 16 keys and 16 pairs of dims, a 16 x 16 transpose in registers; V: each pair of keys'
 * rows interleaved word by word with one two-source permute per 16 dims. */
static void pack_chunk(const uint16_t *pool, const int64_t *table, int64_t h, int64_t kv_heads,
                       int64_t num_blocks, int64_t bs, int64_t c, int64_t ctx, uint32_t *kp,
                       uint32_t *vp)
{
    static const uint16_t zero[HD];
    const uint16_t *krow[KC], *vrow[KC];
    for (int k = 0; k < KC; k++) {
        const int64_t pos = c * KC + k;
        if (pos >= ctx) {
            krow[k] = vrow[k] = zero;
            continue;
        }
        const int64_t block = table[pos / bs], slot = pos % bs;
        krow[k] = pool + ((h * num_blocks + block) * bs + slot) * HD;
        vrow[k] = pool + (((kv_heads + h) * num_blocks + block) * bs + slot) * HD;
    }
    for (int g = 0; g < KC; g += 16)
        for (int half = 0; half < 2; half++) {
            __m512i r[16];
            for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_si512(krow[g + k] + 32 * half);
            transpose16(r);
            for (int p = 0; p < 16; p++)
                _mm512_storeu_si512(kp + (16 * half + p) * KC + g, r[p]);
        }
    /* Word 2d of a permute's result: dim d of the first key (index d), word 2d + 1: of the
     * second (index 32 + d); lo covers dims 0-15 of a 32-dim half, hi dims 16-31. */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int i = 0; i < KC / 2; i++)
        for (int half = 0; half < 2; half++) {
            const __m512i a = _mm512_loadu_si512(vrow[2 * i] + 32 * half);
            const __m512i b = _mm512_loadu_si512(vrow[2 * i + 1] + 32 * half);
            _mm512_storeu_si512(vp + i * HD + 32 * half, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vp + i * HD + 32 * half + 16,
                                _mm512_permutex2var_epi16(a, hi, b));
        }
}

/* Scores of nr (<= 6) query rows against one packed K chunk, into s[nr][64] (unscaled). */
static inline __attribute__((always_inline)) void
scores(const uint32_t *kp, const uint32_t *const *qrow, float *s, const int nr)
{
    __m512 acc[QR][4];
    for (int j = 0; j < nr; j++)
        for (int v = 0; v < 4; v++) acc[j][v] = _mm512_setzero_ps();
    for (int p = 0; p < HD / 2; p++) {
        const uint32_t *kk = kp + p * KC;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kk);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kk + 16);
        const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kk + 32);
        const __m512bh k3 = (__m512bh)_mm512_loadu_si512(kk + 48);
        for (int j = 0; j < nr; j++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int32_t)qrow[j][p]);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], k0, qb);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], k1, qb);
            acc[j][2] = _mm512_dpbf16_ps(acc[j][2], k2, qb);
            acc[j][3] = _mm512_dpbf16_ps(acc[j][3], k3, qb);
        }
    }
    for (int j = 0; j < nr; j++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(s + j * KC + 16 * v, acc[j][v]);
}

/* o[nr][64] = o * alpha + P V over one packed V chunk; pb[j] holds row j's 64 bf16 weights. */
static inline __attribute__((always_inline)) void
weighted_values(const uint32_t *vp, const uint32_t (*pb)[KC / 2], const float *alpha, float *o,
                const int nr)
{
    __m512 acc[QR][4];
    for (int j = 0; j < nr; j++) {
        const __m512 a = _mm512_set1_ps(alpha[j]);
        for (int v = 0; v < 4; v++)
            acc[j][v] = _mm512_mul_ps(_mm512_loadu_ps(o + j * HD + 16 * v), a);
    }
    for (int i = 0; i < KC / 2; i++) {
        const uint32_t *vv = vp + i * HD;
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vv);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vv + 16);
        const __m512bh v2 = (__m512bh)_mm512_loadu_si512(vv + 32);
        const __m512bh v3 = (__m512bh)_mm512_loadu_si512(vv + 48);
        for (int j = 0; j < nr; j++) {
            const __m512bh pw = (__m512bh)_mm512_set1_epi32((int32_t)pb[j][i]);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], v0, pw);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], v1, pw);
            acc[j][2] = _mm512_dpbf16_ps(acc[j][2], v2, pw);
            acc[j][3] = _mm512_dpbf16_ps(acc[j][3], v3, pw);
        }
    }
    for (int j = 0; j < nr; j++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(o + j * HD + 16 * v, acc[j][v]);
}

/* Softmax step of nr rows over s[nr][64]: mask keys after each row's position, update the
 * running max m and sum l, write alpha (the old output's factor) and the bf16 weights pb. */
static void softmax_step(float *s, const int64_t *qpos, int64_t key0, float scale, float *m,
                         float *l, float *alpha, uint32_t (*pb)[KC / 2], int nr)
{
    const __m512 vscale = _mm512_set1_ps(scale), masked = _mm512_set1_ps(MASKED);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int j = 0; j < nr; j++) {
        float *sj = s + j * KC;
        int64_t visible = qpos[j] - key0 + 1; /* keys [0, visible) of the chunk */
        visible = visible < 0 ? 0 : visible > KC ? KC : visible;
        const __m512i vis = _mm512_set1_epi32((int)visible);
        __m512 v[4], mx = _mm512_set1_ps(m[j]);
        for (int i = 0; i < 4; i++) {
            const __mmask16 keep = _mm512_cmplt_epi32_mask(
                _mm512_add_epi32(lane, _mm512_set1_epi32(16 * i)), vis);
            v[i] = _mm512_mask_mul_ps(masked, keep, _mm512_loadu_ps(sj + 16 * i), vscale);
            mx = _mm512_max_ps(mx, v[i]);
        }
        const float top = _mm512_reduce_max_ps(mx);
        const __m512 vtop = _mm512_set1_ps(top);
        __m512 sum = _mm512_setzero_ps();
        for (int i = 0; i < 4; i++) {
            const __m512 e = exp16(_mm512_sub_ps(v[i], vtop));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)((uint16_t *)pb[j] + 16 * i),
                                (__m256i)_mm512_cvtneps_pbh(e));
        }
        alpha[j] = _mm512_cvtss_f32(exp16(_mm512_set1_ps(m[j] - top)));
        l[j] = l[j] * alpha[j] + _mm512_reduce_add_ps(sum);
        m[j] = top;
    }
}

/* One work item: row r's tokens [t0, t1) of KV head h, all query heads of its group. */
static void item(const uint16_t *q, uint16_t *out, const uint32_t *kp, const uint32_t *vp,
                 int64_t tok0, int64_t pos0, int64_t t0, int64_t t1, int64_t h,
                 int64_t kv_heads, int64_t group, float scale)
{
    const int nrows = (int)((t1 - t0) * group);
    float o[MAX_ROWS * HD], m[MAX_ROWS], l[MAX_ROWS], alpha[QR], s[QR * KC];
    uint32_t pb[QR][KC / 2];
    const uint32_t *qrow[MAX_ROWS];
    int64_t qpos[MAX_ROWS];
    for (int j = 0; j < nrows; j++) {
        const int64_t t = t0 + j / group, g = j % group;
        qrow[j] = (const uint32_t *)(q + (((tok0 + t) * kv_heads + h) * group + g) * HD);
        qpos[j] = pos0 + t;
        m[j] = MASKED;
        l[j] = 0.0f;
    }
    memset(o, 0, sizeof(float) * (size_t)nrows * HD);
    const int64_t chunks = (pos0 + t1 - 1) / KC + 1;
    for (int64_t c = 0; c < chunks; c++) {
        const uint32_t *kc = kp + c * CHUNK_U32, *vc = vp + c * CHUNK_U32;
        for (int j0 = 0; j0 < nrows; j0 += QR) {
            const int nr = nrows - j0 < QR ? nrows - j0 : QR;
            if (qpos[j0] < c * KC && qpos[j0 + nr - 1] < c * KC) continue; /* all masked */
#define STEP(NR)                                                                         \
    do {                                                                                 \
        scores(kc, qrow + j0, s, NR);                                                    \
        softmax_step(s, qpos + j0, c * KC, scale, m + j0, l + j0, alpha, pb, NR);        \
        weighted_values(vc, (const uint32_t(*)[KC / 2])pb, alpha, o + j0 * HD, NR);     \
    } while (0)
            switch (nr) {
            case 6: STEP(6); break;
            case 5: STEP(5); break;
            case 4: STEP(4); break;
            case 3: STEP(3); break;
            case 2: STEP(2); break;
            default: STEP(1); break;
            }
#undef STEP
        }
    }
    for (int j = 0; j < nrows; j++) {
        const int64_t t = t0 + j / group, g = j % group;
        uint16_t *dst = out + (((tok0 + t) * kv_heads + h) * group + g) * HD;
        const __m512 inv = _mm512_set1_ps(1.0f / l[j]);
        for (int v = 0; v < 4; v++)
            _mm256_storeu_si256((__m256i *)(dst + 16 * v),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_loadu_ps(o + j * HD + 16 * v), inv)));
    }
}
#endif

int prefill_attention_bf16(const uint16_t *q, const uint16_t *pool, const int64_t *tables,
                           const int64_t *token_start, const int64_t *pos_start, uint16_t *out,
                           int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                           int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                           float scale, int64_t threads)
{
#ifndef PREFILL_KERNEL
    (void)q; (void)pool; (void)tables; (void)token_start; (void)pos_start; (void)out;
    (void)rows; (void)kv_heads; (void)group; (void)num_blocks; (void)block_size;
    (void)max_blocks; (void)scale; (void)threads;
    (void)head_dim;
    return 3;
#else
    if (head_dim != HD || group < 1 || group > MAX_ROWS) return 3;
    if (rows < 0 || kv_heads < 1 || num_blocks < 1 || block_size < 1 || max_blocks < 0) return 1;
    if (rows == 0) return 0;
    /* Check every row before touching memory; count the chunk buffers and the work items. */
    const int64_t per_item = MAX_ROWS / group; /* tokens per work item */
    int64_t *chunk_base = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * rows + 2));
    if (chunk_base == NULL) return 2;
    int64_t *item_base = chunk_base + rows + 1;
    chunk_base[0] = item_base[0] = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = token_start[r + 1] - token_start[r], ctx = pos_start[r] + n;
        if (n < 1 || pos_start[r] < 0 || (ctx + block_size - 1) / block_size > max_blocks) {
            free(chunk_base);
            return 1;
        }
        for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++)
            if (tables[r * max_blocks + b] < 0 || tables[r * max_blocks + b] >= num_blocks) {
                free(chunk_base);
                return 4;
            }
        chunk_base[r + 1] = chunk_base[r] + (ctx + KC - 1) / KC;
        item_base[r + 1] = item_base[r] + kv_heads * ((n + per_item - 1) / per_item);
    }
    const size_t buffer = (size_t)chunk_base[rows] * (size_t)kv_heads * CHUNK_U32;
    uint32_t *kp = (uint32_t *)malloc(sizeof(uint32_t) * buffer * 2);
    if (kp == NULL) {
        free(chunk_base);
        return 2;
    }
    uint32_t *vp = kp + buffer;
    const int nthreads = threads < 1 ? 1 : (int)threads;
    /* Pack: buffer of row r, head h, chunk c at ((chunk_base[r] * kv_heads) + h * chunks_r + c). */
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < chunk_base[rows] * kv_heads; u++) {
            int64_t r = 0;
            while (chunk_base[r + 1] * kv_heads <= u) r++;
            const int64_t chunks = chunk_base[r + 1] - chunk_base[r];
            const int64_t local = u - chunk_base[r] * kv_heads;
            const int64_t h = local / chunks, c = local % chunks;
            const int64_t ctx = pos_start[r] + token_start[r + 1] - token_start[r];
            pack_chunk(pool, tables + r * max_blocks, h, kv_heads, num_blocks, block_size, c, ctx,
                       kp + (size_t)u * CHUNK_U32, vp + (size_t)u * CHUNK_U32);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < item_base[rows]; w++) {
            int64_t r = 0;
            while (item_base[r + 1] <= w) r++;
            const int64_t n = token_start[r + 1] - token_start[r];
            const int64_t blocks = (n + per_item - 1) / per_item;
            const int64_t local = w - item_base[r];
            const int64_t h = local / blocks, b = local % blocks;
            const int64_t chunks = chunk_base[r + 1] - chunk_base[r];
            const size_t at = ((size_t)chunk_base[r] * kv_heads + (size_t)(h * chunks)) * CHUNK_U32;
            const int64_t t0 = b * per_item, t1 = t0 + per_item < n ? t0 + per_item : n;
            item(q, out, kp + at, vp + at, token_start[r], pos_start[r], t0, t1, h, kv_heads,
                 group, scale);
        }
    }
    free(kp);
    free(chunk_base);
    return 0;
#endif
}
