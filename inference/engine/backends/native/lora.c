/*
 * LoRA deltas, token by token (inference/engine/lora.py): for each token t of a pass whose row
 * runs under an adapter, y[t] += B_j^T (A_j x[t]) for each module j of the fused projection,
 * into the projection's output y in place (Hu et al., 2021; rows of several adapters and bare
 * rows in one pass as S-LoRA and Punica batch them).
 *
 *     adapters  [tokens] pointers: each token's adapter, an array lora_proj_t[layers * 4] (its
 *               part of each layer's qkv, o, gate_up, down projections), or NULL (the bare
 *               model: nothing added)
 *     layer, proj  which entry of that array (proj: 0 qkv, 1 o, 2 gate_up, 3 down)
 *     x [tokens][in], y [tokens][out]  the projection's input and output, bf16 (lora_add_bf16;
 *               A and B bf16) or fp32 (lora_add_f32; A and B fp32)
 *
 * A [m * r][in] holds the m modules' A stacked; B [r][ldb] their B transposed and scaled, side by
 * side: module j reads B's columns [col[j], col[j] + width[j]) and adds to y's columns
 * [off[j], off[j] + width[j]). The sums are fp32; a bf16 y is rounded once (to nearest even)
 * after its delta is added. Returns 0, or 4 for a rank or width the kernel does not take.
 */
#include <stdint.h>
#include <string.h>

typedef struct lora_proj {
    const void *a, *b;
    int64_t r, m, ldb;
    int64_t off[3], width[3], col[3];
} lora_proj_t;

#define LORA_MAX_R 4096      /* m * r */
#define LORA_MAX_WIDTH 65536 /* a module's output width, and in */

static inline float bf(uint16_t b)
{
    union { uint32_t u; float f; } v = { (uint32_t)b << 16 };
    return v.f;
}

static inline uint16_t to_bf(float f)
{
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static int check(const lora_proj_t *P, int64_t in, int64_t out)
{
    if (P->m < 1 || P->m > 3 || P->r < 1 || P->m * P->r > LORA_MAX_R || in > LORA_MAX_WIDTH)
        return 4;
    for (int64_t j = 0; j < P->m; j++)
        if (P->width[j] > LORA_MAX_WIDTH || P->off[j] + P->width[j] > out
            || P->col[j] + P->width[j] > P->ldb)
            return 4;
    return 0;
}

#define LORA_KERNEL(NAME, T, LOAD, STORE)                                                      \
int NAME(const lora_proj_t *const *adapters, int64_t layer, int64_t proj, const T *x,          \
         int64_t in, T *y, int64_t out, int64_t tokens, int64_t threads)                        \
{                                                                                               \
    int rc = 0;                                                                                 \
    for (int64_t t = 0; t < tokens; t++)                                                        \
        if (adapters[t] && adapters[t][layer * 4 + proj].a                                      \
            && check(&adapters[t][layer * 4 + proj], in, out))                                  \
            return 4;                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads((int)threads)")                  \
    for (int64_t t = 0; t < tokens; t++) {                                                      \
        if (!adapters[t]) continue;                                                             \
        const lora_proj_t *P = &adapters[t][layer * 4 + proj];                                  \
        if (!P->a) continue;                                                                    \
        const T *A = (const T *)P->a, *B = (const T *)P->b;                                     \
        const int64_t R = P->r * P->m;                                                          \
        float xf[in], tk[R];                                                                    \
        for (int64_t i = 0; i < in; i++) xf[i] = LOAD(x[t * in + i]);                           \
        for (int64_t k = 0; k < R; k++) {                                                       \
            float s = 0.0f;                                                                     \
            const T *row = A + k * in;                                                          \
            for (int64_t i = 0; i < in; i++) s += LOAD(row[i]) * xf[i];                         \
            tk[k] = s;                                                                          \
        }                                                                                       \
        for (int64_t j = 0; j < P->m; j++) {                                                    \
            const int64_t w = P->width[j];                                                      \
            T *yt = y + t * out + P->off[j];                                                    \
            float acc[w];                                                                       \
            for (int64_t c = 0; c < w; c++) acc[c] = LOAD(yt[c]);                               \
            for (int64_t k = 0; k < P->r; k++) {                                                \
                const float s = tk[j * P->r + k];                                               \
                const T *brow = B + k * P->ldb + P->col[j];                                     \
                for (int64_t c = 0; c < w; c++) acc[c] += s * LOAD(brow[c]);                    \
            }                                                                                   \
            for (int64_t c = 0; c < w; c++) yt[c] = STORE(acc[c]);                              \
        }                                                                                       \
    }                                                                                           \
    return rc;                                                                                  \
}

#define LOAD_F32(v) (v)
#define STORE_F32(v) (v)
LORA_KERNEL(lora_add_bf16, uint16_t, bf, to_bf)
LORA_KERNEL(lora_add_f32, float, LOAD_F32, STORE_F32)
