/* The q/k heads' RMSNorm and rotary embedding of a bf16 decoder layer, in place, in one pass
 * (models/layers/qk_norm_rope.py calls it; models/arch/decoder.py says where).
 *
 * Eagerly this is a dozen ATen kernels on a strided view of the qkv projection (a float32
 * copy, the norm, the scaling, the weight, a roll, a multiply and an addcmul), each its own
 * pass and parallel region whose fixed cost outweighs its arithmetic at decode sizes
 * (benchmarks/results/native_step.md measures what the kernel buys). Here each
 * (row, head) is read once, kept in registers and L1, and written once.
 *
 * The result equals the eager chain with exact sums bit for bit (rms_norm(exact_sums=True),
 * times the weight, then apply_rope_): every rounding of the eager chain happens here in
 * the same order, to the same type:
 *   n = sqrt(sum of x^2 in double); v = eps + inv_dim * n * n (double)
 *   inv = 1 / sqrt((float) v)                                   (float32, as rsqrt_)
 *   t = bf16(x * inv) ; u = bf16(t * weight)                    (each product in float32)
 *   out = bf16(bf16(u * cos) + roll(u) * sin)                   (the sum in float32)
 * The sum of squares in double is exact per square, so its order does not change the
 * float32 it rounds to (but for a difference of 2^-29): the order ATen's vectorised norm
 * takes need not be copied. Products of two bf16 values are exact in float32, so whether
 * the compiler fuses a product with the following add changes nothing.
 *
 * qk_norm_rope_f32 (a float32 decoder's decode stack, models/arch/decode_stack.c) takes the
 * same steps on float32 heads without the roundings to bf16; it equals the eager float32
 * chain with exact sums to a float32 rounding (a compiler may contract u * cos with the add
 * after it, where ATen's addcmul need not).
 *
 * Written with GCC / Clang vector extensions (the compiler flags pick the instructions);
 * OpenMP spreads the (row, head) pairs over torch's threads for steps of several rows. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_vectors.h"
#include "exact_rms.h"

#define MAX_HEAD_DIM 1024
/* (row, head) pairs below which one thread does them all: a parallel region costs more. */
#define PARALLEL_PAIRS 32

/* One head of `hd` values at x (hd a multiple of LANES, at most MAX_HEAD_DIM). */
static void norm_rope_head(uint16_t *x, int64_t hd, const uint16_t *weight, double eps, double inv_dim,
                           const uint16_t *cos, const uint16_t *sin) {
    float xf[MAX_HEAD_DIM] __attribute__((aligned(64)));
    float uf[MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int64_t i = 0; i < hd; i += LANES) {
        const vf v = load_bf16(x + i);
        memcpy(xf + i, &v, sizeof v);
    }
    if (weight) {
        const vf by = splat(exact_inverse_rms(xf, hd, eps, inv_dim));
        for (int64_t i = 0; i < hd; i += LANES) {
            vf v;
            memcpy(&v, xf + i, sizeof v);
            const vf u = round_bf16(round_bf16(v * by) * load_bf16(weight + i));
            memcpy(uf + i, &u, sizeof u);
        }
    } else {
        memcpy(uf, xf, sizeof(float) * hd);  /* RoPE alone: layers without a q/k norm */
    }
    float rf[MAX_HEAD_DIM] __attribute__((aligned(64))); /* u rolled by half: [u2, u1] */
    const int64_t half = hd / 2;
    if (cos) {
        memcpy(rf, uf + half, sizeof(float) * half);
        memcpy(rf + half, uf, sizeof(float) * half);
    }
    for (int64_t i = 0; i < hd; i += LANES) {
        vf u, r;
        memcpy(&u, uf + i, sizeof u);
        if (!cos) {
            store_bf16(x + i, u);
            continue;
        }
        memcpy(&r, rf + i, sizeof r);
        const vf a = round_bf16(u * load_bf16(cos + i));
        store_bf16(x + i, round_bf16(a + r * load_bf16(sin + i)));
    }
}

/* The widest head dim the kernel takes, and the multiple it must be of (the caller checks). */
int64_t qk_norm_rope_max_head_dim(void) { return MAX_HEAD_DIM; }
int64_t qk_norm_rope_lanes(void) { return LANES; }

/* x: bf16 rows `row_stride` elements apart, each starting with `heads` heads of hd values,
 * normalised where weight ([heads, hd] bf16) is not NULL and, where cos is not NULL,
 * rotated in place with cos / signed sin rows of hd bf16 values per row (contiguous,
 * [rows, hd]). */
void qk_norm_rope(uint16_t *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t hd, const uint16_t *weight,
                  double eps, double inv_dim, const uint16_t *cos, const uint16_t *sin, int32_t num_threads) {
    const int64_t pairs = rows * heads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (pairs >= PARALLEL_PAIRS)
    for (int64_t k = 0; k < pairs; k++) {
        const int64_t r = k / heads, h = k % heads;
        norm_rope_head(x + r * row_stride + h * hd, hd, weight ? weight + h * hd : NULL, eps, inv_dim,
                       cos ? cos + r * hd : NULL, sin ? sin + r * hd : NULL);
    }
}

/* norm_rope_head of a float32 head. */
static void norm_rope_head_f32(float *x, int64_t hd, const float *weight, double eps, double inv_dim, const float *cos,
                               const float *sin) {
    float uf[MAX_HEAD_DIM] __attribute__((aligned(64)));
    if (weight) {
        const vf by = splat(exact_inverse_rms(x, hd, eps, inv_dim));
        for (int64_t i = 0; i < hd; i += LANES) store_f32(uf + i, (load_f32(x + i) * by) * load_f32(weight + i));
    } else {
        memcpy(uf, x, sizeof(float) * hd);
    }
    if (!cos) {
        memcpy(x, uf, sizeof(float) * hd);
        return;
    }
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < hd; i += LANES) {
        const vf rolled = load_f32(uf + (i < half ? i + half : i - half));
        store_f32(x + i, load_f32(uf + i) * load_f32(cos + i) + rolled * load_f32(sin + i));
    }
}

/* qk_norm_rope of float32 rows, weight and tables; hd / 2 is a multiple of LANES too. */
void qk_norm_rope_f32(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t hd, const float *weight,
                      double eps, double inv_dim, const float *cos, const float *sin, int32_t num_threads) {
    const int64_t pairs = rows * heads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (pairs >= PARALLEL_PAIRS)
    for (int64_t k = 0; k < pairs; k++) {
        const int64_t r = k / heads, h = k % heads;
        norm_rope_head_f32(x + r * row_stride + h * hd, hd, weight ? weight + h * hd : NULL, eps, inv_dim,
                           cos ? cos + r * hd : NULL, sin ? sin + r * hd : NULL);
    }
}
