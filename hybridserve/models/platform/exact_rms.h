/* RMSNorm's inverse root mean square as models/layers/rms_norm.py computes it with exact
 * sums, for the native kernels that must equal it bit for bit (qk_norm_rope.c,
 * residual_norms.c):
 *   n = sqrt(sum of x^2 in double); v = eps + inv_dim * n * n (double); 1 / sqrt((float) v)
 * Each square of a float32 is exact in double, so the order of the sum does not change the
 * float32 it rounds to (but for a difference of 2^-29): ATen's order need not be copied. */

#ifndef HYBRIDSERVE_EXACT_RMS_H
#define HYBRIDSERVE_EXACT_RMS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_vectors.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* x: n float32 values, n a multiple of 8. Two sums of 8 lanes each, so one square's add
 * need not wait for the previous one's (any order gives the same float32 but for a
 * difference of 2^-29, the comment above). */
static inline float exact_inverse_rms(const float *x, int64_t n, double eps, double inv_dim) {
    __m512d even = _mm512_setzero_pd(), odd = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        const __m512d b = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
        even = _mm512_fmadd_pd(a, a, even);
        odd = _mm512_fmadd_pd(b, b, odd);
    }
    if (i < n) {
        const __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        even = _mm512_fmadd_pd(a, a, even);
    }
    double lanes[8];
    _mm512_storeu_pd(lanes, _mm512_add_pd(even, odd));
    double s = 0.0;
    for (int k = 0; k < 8; k++) s += lanes[k];
    const double norm = sqrt(s);
    return 1.0f / sqrtf((float)(eps + inv_dim * norm * norm));
}
#else
typedef float vf_half __attribute__((vector_size(LANES * 2)));
typedef double vd __attribute__((vector_size(LANES * 4)));

/* x: n float32 values, n a multiple of LANES. */
static inline float exact_inverse_rms(const float *x, int64_t n, double eps, double inv_dim) {
    vd acc = (vd){0};
    for (int64_t i = 0; i < n; i += LANES / 2) {
        vf_half h;
        memcpy(&h, x + i, sizeof h);
        const vd d = __builtin_convertvector(h, vd);
        acc += d * d;
    }
    double s = 0.0;
    for (int i = 0; i < LANES / 2; i++) s += acc[i];
    const double norm = sqrt(s);
    return 1.0f / sqrtf((float)(eps + inv_dim * norm * norm));
}
#endif

#endif
