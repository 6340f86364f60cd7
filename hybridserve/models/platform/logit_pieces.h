/* Logits held in pieces (models/layers/span_logits.SpanLogits: the head's chunk outputs
 * side by side, or one dense buffer), as the native sampling kernels read and write them
 * (executor/torch/span_draw.c, penalties.c): piece k holds spans first[k] ..
 * first[k + 1] - 1 of every row, at base[k] with row stride ld[k] (floats). Or not held
 * (a SpanLogits with a source): `fill` computes a span when it is read, into a buffer of
 * the reading thread's own, so a span so read stays valid only until its next span_at,
 * and is not to be written (span_draw.c reads one span at a time; penalties.c, which
 * writes, is never given such logits). */

#ifndef HYBRIDSERVE_LOGIT_PIECES_H
#define HYBRIDSERVE_LOGIT_PIECES_H

#include <stdint.h>

#include "span_summary.h"

/* Writes span `span` of row `row` to out[0 .. SPAN - 1] (int8_amx.c's int8_amx_fill_span). */
typedef void (*SpanFill)(const void *source, int64_t row, int64_t span, float *out);

typedef struct {
    float *const *base;   /* each piece's logits [rows, its spans * SPAN] */
    const int64_t *ld;    /* each piece's row stride */
    const int64_t *first; /* each piece's first span; one more entry: the row's spans */
    SpanFill fill;        /* where the logits are not held: what computes a span, else NULL */
    const void *source;   /* fill's first argument */
} Logits;

/* Span j of a row (SPAN consecutive floats). */
static inline float *span_at(const Logits *l, int64_t row, int64_t j) {
    if (l->fill) {
        static __thread float computed[SPAN] __attribute__((aligned(64)));
        l->fill(l->source, row, j, computed);
        return computed;
    }
    int64_t k = 0;
    while (j >= l->first[k + 1]) k++;
    return l->base[k] + row * l->ld[k] + (j - l->first[k]) * SPAN;
}

#endif
