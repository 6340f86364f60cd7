/* A sandwich-norm decoder's residual add and the RMSNorm after it, in one native pass over
 * each row (models/layers/residual_norms.py calls it; models/arch/decoder.py says where):
 *   h' = h + rms_norm(y) * w1          (the sublayer's output normalised, added)
 *   x  = rms_norm(h') * w2             (the next sublayer's input; skipped without w2)
 * and, for pre-norm layers, whose residual add the matmul makes, the second norm alone
 * (rms_norms).
 * Eagerly that is about a dozen ATen kernels, each a pass and a parallel region over a
 * [rows, hidden] tensor; at decode sizes their fixed costs were most of the time.
 *
 * Bit for bit the eager chain with exact sums (rms_norm(exact_sums=True) in bf16, which
 * normalises a float32 copy, multiplies by the float32 weight, then rounds to bf16; the
 * add rounds once more): each rounding here happens in the same order, to the same type
 *   t = bf16((y * inv) * w1)   (two float32 products)
 *   h' = bf16(h + t)           (a float32 sum)
 *   x = bf16((h' * inv') * w2)
 * with inv the exact inverse RMS of exact_rms.h. No product feeds an add in float32 here,
 * so no compiler contraction can change a rounding.
 *
 * The float32 forms (residual_norms_f32, rms_norms_f32: a float32 decoder's decode stack,
 * models/arch/decode_stack.c) take the same steps without the roundings to bf16; they equal
 * the eager float32 chain with exact sums to a float32 rounding (a compiler may contract a
 * product with the add after it, which eager ATen need not do).
 *
 * Written with GCC / Clang vector extensions (the compiler flags pick the instructions);
 * OpenMP spreads the rows over torch's threads for steps of several rows. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_vectors.h"
#include "exact_rms.h"

/* Rows below which one thread does them all: a parallel region costs more. */
#define PARALLEL_ROWS 8

/* x = bf16((h * inv) * w) of one row, h given as float32 (bf16 values). */
static void norm_row(const float *h, int64_t dim, const uint16_t *w, double eps, double inv_dim, uint16_t *x_out) {
    const vf by = splat(exact_inverse_rms(h, dim, eps, inv_dim));
    for (int64_t i = 0; i < dim; i += LANES) store_bf16(x_out + i, round_bf16((load_f32(h + i) * by) * load_bf16(w + i)));
}

static void row(const uint16_t *h, const uint16_t *y, int64_t dim, const uint16_t *w1, const uint16_t *w2,
                double eps, double inv_dim, uint16_t *h_out, uint16_t *x_out) {
    float buffer[dim] __attribute__((aligned(64)));
    for (int64_t i = 0; i < dim; i += LANES) store_f32(buffer + i, load_bf16(y + i));
    const vf by = splat(exact_inverse_rms(buffer, dim, eps, inv_dim));
    for (int64_t i = 0; i < dim; i += LANES) {
        const vf t = round_bf16((load_f32(buffer + i) * by) * load_bf16(w1 + i));
        const vf sum = round_bf16(load_bf16(h + i) + t);
        store_bf16(h_out + i, sum);
        store_f32(buffer + i, sum);
    }
    if (w2) norm_row(buffer, dim, w2, eps, inv_dim, x_out);
}

/* The widths the kernel takes are multiples of this (the caller checks). */
int64_t residual_norms_lanes(void) { return LANES; }

/* h, y: bf16 rows of `dim` values, h_stride / y_stride elements apart; w1, w2: [dim] bf16
 * (w2 may be NULL); h_out, x_out: [rows, dim] contiguous bf16 (x_out unused without w2). */
void residual_norms(const uint16_t *h, int64_t h_stride, const uint16_t *y, int64_t y_stride, int64_t rows,
                    int64_t dim, const uint16_t *w1, const uint16_t *w2, double eps, double inv_dim, uint16_t *h_out,
                    uint16_t *x_out, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        row(h + r * h_stride, y + r * y_stride, dim, w1, w2, eps, inv_dim, h_out + r * dim,
            w2 ? x_out + r * dim : NULL);
}

/* The norm alone, for pre-norm layers (the residual add is the matmul's): x = rms_norm(h) * w
 * of each row, as the second norm above. h: bf16 rows h_stride elements apart; w: [dim]
 * bf16; x_out: [rows, dim] contiguous bf16. */
void rms_norms(const uint16_t *h, int64_t h_stride, int64_t rows, int64_t dim, const uint16_t *w, double eps,
               double inv_dim, uint16_t *x_out, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float buffer[dim] __attribute__((aligned(64)));
        for (int64_t i = 0; i < dim; i += LANES) store_f32(buffer + i, load_bf16(h + r * h_stride + i));
        norm_row(buffer, dim, w, eps, inv_dim, x_out + r * dim);
    }
}

/* x = (h * inv) * w of one float32 row. */
static void norm_row_f32(const float *h, int64_t dim, const float *w, double eps, double inv_dim, float *x_out) {
    const vf by = splat(exact_inverse_rms(h, dim, eps, inv_dim));
    for (int64_t i = 0; i < dim; i += LANES) store_f32(x_out + i, (load_f32(h + i) * by) * load_f32(w + i));
}

static void row_f32(const float *h, const float *y, int64_t dim, const float *w1, const float *w2, double eps,
                    double inv_dim, float *h_out, float *x_out) {
    const vf by = splat(exact_inverse_rms(y, dim, eps, inv_dim));
    for (int64_t i = 0; i < dim; i += LANES)
        store_f32(h_out + i, load_f32(h + i) + (load_f32(y + i) * by) * load_f32(w1 + i));
    if (w2) norm_row_f32(h_out, dim, w2, eps, inv_dim, x_out);
}

/* residual_norms of float32 rows and weights (h_out may not alias y). */
void residual_norms_f32(const float *h, int64_t h_stride, const float *y, int64_t y_stride, int64_t rows, int64_t dim,
                        const float *w1, const float *w2, double eps, double inv_dim, float *h_out, float *x_out,
                        int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        row_f32(h + r * h_stride, y + r * y_stride, dim, w1, w2, eps, inv_dim, h_out + r * dim,
                w2 ? x_out + r * dim : NULL);
}

/* rms_norms of float32 rows and weight. */
void rms_norms_f32(const float *h, int64_t h_stride, int64_t rows, int64_t dim, const float *w, double eps,
                   double inv_dim, float *x_out, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) norm_row_f32(h + r * h_stride, dim, w, eps, inv_dim, x_out + r * dim);
}
