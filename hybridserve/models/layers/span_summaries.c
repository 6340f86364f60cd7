/* A chunk's span summaries (models/layers/span_logits.py says what they are): for each span
 * of SPAN logits of a row, its maximum m and its mass, the sum of
 * exp(max((x - m) * inv_t, exp_floor)) (0 for a span that is all -inf). Given row scales,
 * the logits are first multiplied by their row's scale in place (what an int8 GEMM's
 * output needs, models/layers/int8.py), in the same pass: each product is stored, then
 * summarised as stored, so the logits and their summaries are those of the eager
 * multiply followed by the summary.
 *
 * Why by hand, beside inductor's compiled loop (models/layers/span_kernel.py): a span is a
 * chain of dependent steps (the max, then the exponentials summed into one accumulator,
 * then two reductions across lanes), and a loop over one span at a time waits on those
 * chains; this one summarises GROUP spans side by side, so their chains overlap (the
 * arithmetic of one span, and the exponential, are span_summary.h's).
 *
 * Written with GCC / Clang vector extensions, so the compiler flags pick the instructions
 * (AVX-512, AVX2 + FMA, or the target's baseline); OpenMP spreads the spans over the
 * threads of the runtime torch has loaded (the same libgomp: one pool). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_vectors.h"
#include "span_summary.h"

/* The span width this library sums (the caller checks it against its own). */
int32_t span_summaries_span(void) { return SPAN; }

/* x: rows of `spans` * SPAN float32 logits, `row_stride` floats apart (written only where
 * row_scale is given: one scale per row, or NULL); peak and mass: [rows, spans], contiguous. */
void span_summaries(float *x, int64_t rows, int64_t spans, int64_t row_stride, const float *row_scale,
                    const float *inv_t, float exp_floor, float *peak, float *mass, int32_t num_threads) {
    const int64_t groups = (spans + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t k = 0; k < rows * groups; k++) {
        const int64_t r = k / groups, j0 = (k % groups) * GROUP;
        float *row = x + r * row_stride;
        float *pk = peak + r * spans, *ms = mass + r * spans;
        /* Constant counts and flags: each call below is its own unrolled loop. */
        if (spans - j0 >= GROUP) {
            if (row_scale)
                summarise_group(row, j0, GROUP, 1, row_scale[r], inv_t[r], exp_floor, pk, ms);
            else
                summarise_group(row, j0, GROUP, 0, 1.0f, inv_t[r], exp_floor, pk, ms);
        } else {
            summarise_group(row, j0, (int)(spans - j0), row_scale != NULL, row_scale ? row_scale[r] : 1.0f,
                            inv_t[r], exp_floor, pk, ms);
        }
    }
}
