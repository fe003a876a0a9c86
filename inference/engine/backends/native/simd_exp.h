/*
 * exp on 16 fp32 lanes with AVX-512 (a header of the native kernels: decode_layer.c's SiLU,
 * prefill_attention.c's softmax).
 *
 * Cephes' expf (S. L. Moshier): x = n ln 2 + r with n = round(x / ln 2) and r reduced by ln 2 in
 * two parts, exp(r) by a degree-6 polynomial, then 2^n applied with VSCALEFPS: within 1.25 ulp
 * of exp over [-87, 88] (checked against double-precision exp), subnormal results included where
 * the caller does not flush them. An input below -104 gives 0 (or the smallest subnormal), one
 * above 104 inf, a NaN inf (its callers' own operations on the NaN keep theirs NaN), all with no
 * call into libm: glibc's vector expf hands every lane that underflows (a masked attention
 * score) to its scalar expf, which sets errno.
 */
#ifndef SIMD_EXP_H
#define SIMD_EXP_H
#include <immintrin.h>

static inline __m512 exp16(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif
