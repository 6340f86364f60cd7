/* Logits held in pieces (models/layers/span_logits.SpanLogits: the head's chunk outputs
 * side by side, or one dense buffer), as the native sampling kernels read and write them
 * (executor/torch/span_draw.c, penalties.c): piece k holds spans first[k] ..
 * first[k + 1] - 1 of every row, at base[k] with row stride ld[k] (floats). */

#ifndef HYBRIDSERVE_LOGIT_PIECES_H
#define HYBRIDSERVE_LOGIT_PIECES_H

#include <stdint.h>

#include "span_summary.h"

typedef struct {
    float *const *base;   /* each piece's logits [rows, its spans * SPAN] */
    const int64_t *ld;    /* each piece's row stride */
    const int64_t *first; /* each piece's first span; one more entry: the row's spans */
} Logits;

/* Span j of a row (SPAN consecutive floats). */
static inline float *span_at(const Logits *l, int64_t row, int64_t j) {
    int64_t k = 0;
    while (j >= l->first[k + 1]) k++;
    return l->base[k] + row * l->ld[k] + (j - l->first[k]) * SPAN;
}

#endif
