/* Greedy's reduction of one chunk of an int8 head's logits (models/layers/chunk_argmax.py
 * calls it; models/layers/head.py says where): for each row, the maximum of x * row_scale
 * (the product the int8 GEMM's output needs, computed as the eager multiply rounds it, not
 * stored) and the first column holding it, plus the chunk's first vocabulary index.
 *
 * Why by hand: head.row_max, the general path, takes about ten eager ops per chunk, and
 * after each chunk's product has streamed its weights through the caches those small ops
 * run cold, dozens of chunks a step (benchmarks/results/step_share.md measures what this
 * buys on CPUs without AMX, whose head is many fbgemm chunks).
 *
 * One pass over each row, lanes side by side: each lane keeps its maximum and the first
 * column holding it (it moves only on a strictly greater product), then the largest lane
 * wins, the first column among equal ones; the product at that column is returned (so -0
 * and +0 come back as the first of them holds). A NaN anywhere is noted and makes the result
 * NaN at the first NaN (a second, scalar scan: rare), as torch's max does. Written with GCC / Clang vector extensions; OpenMP
 * spreads the rows over torch's threads for steps of several rows. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_vectors.h"

typedef int32_t vi __attribute__((vector_size(LANES * 4)));

/* Rows below which one thread does them all: a parallel region costs more. */
#define PARALLEL_ROWS 8

static void row(const float *x, int64_t cols, float s, int64_t start, float *best, int64_t *index) {
    vf m = splat(-INFINITY);
    vi at = (vi){0}, lane, nan = (vi){0};
    for (int k = 0; k < LANES; k++) lane[k] = k;
    int64_t j = 0;
    for (; j + LANES <= cols; j += LANES) {
        const vf v = load_f32(x + j) * s;
        const vi greater = v > m; /* strictly: a lane keeps the first column of its maximum */
        m = (vf)(((vi)v & greater) | ((vi)m & ~greater));
        at = (lane & greater) | (at & ~greater);
        lane += LANES;
        nan |= v != v;
    }
    float peak = -INFINITY;
    int64_t first = 0;
    int any_nan = 0;
    for (int k = 0; k < LANES; k++) any_nan |= nan[k] != 0;
    if (j > 0) { /* the lanes' maxima: the largest, at the first column among equals */
        peak = m[0];
        first = at[0];
        for (int k = 1; k < LANES; k++)
            if (m[k] > peak || (m[k] == peak && at[k] < first)) peak = m[k], first = at[k];
    }
    for (; j < cols; j++) {
        const float v = x[j] * s;
        if (v > peak || (j == 0 && !(v < peak))) peak = v, first = j;
        any_nan |= v != v;
    }
    if (any_nan) /* rare: the first NaN, as torch's max gives */
        for (first = 0; first < cols && x[first] * s == x[first] * s; first++) {
        }
    *best = x[first] * s;
    *index = start + first;
}

/* x: rows of `cols` (> 0) float32 values `stride` apart; row_scale: one per row, or NULL (1);
 * best, index: [rows]. */
void chunk_argmax(const float *x, int64_t rows, int64_t cols, int64_t stride, const float *row_scale, int64_t start,
                  float *best, int64_t *index, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        row(x + r * stride, cols, row_scale ? row_scale[r] : 1.0f, start, best + r, index + r);
}
