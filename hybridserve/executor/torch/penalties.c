/* logit_bias and the repetition / frequency / presence penalties of a batch, applied to its
 * logits in place and the summaries of every span they touch recomputed: what
 * logits_controls.apply_logits_controls and SpanLogits.refresh_spans do for rows with
 * those controls only, one row per loop iteration instead of index lists built in numpy
 * and a dozen tensor operations over them.
 *
 * The same arithmetic, entry by entry, in the same order: x + bias (float32); in the
 * history and a repetition penalty r != 1: x > 0 ? x / r : x * r; among the outputs with a
 * frequency f or presence p: x - float32(f * count + p) (the product and sum in float64, as
 * numpy computes them from the float32 penalties). Each span an entry lies in gets
 * span_summary.h's summary afresh (what the native summary kernel gives). A batch with a
 * row naming a token outside the vocabulary is left unchanged: the caller takes the
 * general path, which names the row. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "logit_pieces.h"
#include "span_summary.h"

/* The logit of token in a row, its whole span asked for too: the span's summary is taken
 * afresh once the row's entries are changed, and its lines then come in together rather
 * than one miss after another (the logits were streamed past the caches). */
static float *logit_at(const Logits *l, int64_t row, int64_t token) {
    float *span = span_at(l, row, token / SPAN);
    for (int b = 0; b < SPAN; b += 64 / (int)sizeof(float)) __builtin_prefetch(span + b, 1);
    return span + token % SPAN;
}

static int ascending(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The index of token among ids (ascending, distinct), or -1. */
static int64_t find(const int64_t *ids, int64_t n, int64_t token) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (ids[mid] < token) lo = mid + 1; else hi = mid;
    }
    return lo < n && ids[lo] == token ? lo : -1;
}

/* Tokens are keyed token * 2 + (1 if an output), sorted: each token's entries side by side.
 * bias_ids ascending (the caller sorts them). */
/* Returns the spans touched (into spans, repeats allowed), keys: scratch of length entries. */
static int64_t apply_row(const Logits *l, int64_t row, int64_t vocab, const int64_t *history, int64_t length,
                         int64_t num_prompt, float repetition, float frequency, float presence,
                         const int64_t *bias_ids, const float *bias, int64_t num_bias, int64_t *keys,
                         int64_t *spans) {
    const int repeats = repetition != 1.0f, counts = frequency != 0.0f || presence != 0.0f;
    int64_t n = 0;
    for (int64_t i = 0; i < length; i++)
        if (repeats || (counts && i >= num_prompt)) keys[n++] = history[i] * 2 + (i >= num_prompt);
    qsort(keys, (size_t)n, sizeof *keys, ascending);
    int64_t touched = 0;
    for (int64_t i = 0; i < n;) {
        const int64_t token = keys[i] / 2;
        int64_t in_history = 0, outputs = 0;
        for (; i < n && keys[i] / 2 == token; i++) {
            in_history++;
            outputs += keys[i] & 1;
        }
        float *x = logit_at(l, row, token);
        float v = *x;
        const int64_t b = find(bias_ids, num_bias, token);
        if (b >= 0) v = v + bias[b];
        if (repeats && in_history) v = v > 0.0f ? v / repetition : v * repetition;
        if (counts && outputs) v = v - (float)((double)frequency * (double)outputs + (double)presence);
        *x = v;
        spans[touched++] = token / SPAN;
    }
    for (int64_t b = 0; b < num_bias; b++) { /* bias on tokens not in the history */
        const int64_t token = bias_ids[b];
        int64_t lo = 0, hi = n;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (keys[mid] / 2 < token) lo = mid + 1; else hi = mid;
        }
        if (lo < n && keys[lo] / 2 == token) continue;
        float *x = logit_at(l, row, token);
        *x = *x + bias[b];
        spans[touched++] = token / SPAN;
    }
    return touched;
}

int32_t penalties_span(void) { return SPAN; }

static int in_vocabulary(const int64_t *ids, int64_t n, int64_t vocab) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) return 0;
    return 1;
}

/* Rows 0 .. rows - 1: history[offset[r] .. offset[r + 1]) with num_prompt[r] prompt tokens
 * first, bias_ids / bias [bias_offset[r] .. bias_offset[r + 1]) (ids ascending within a row);
 * span_max, span_sum
 * [rows, spans] updated for the touched spans at inv_t[r]. Every row is checked first:
 * where any names a token outside [0, vocab), nothing is changed and 1 is returned (the
 * caller's general path names it). Returns 0 when applied, -1 where scratch could not be
 * allocated (rows may then be half done: the caller fails the step). */
int penalties_apply(float *const *base, const int64_t *ld, const int64_t *first, int64_t rows, int64_t spans,
                    int64_t vocab, const int64_t *history, const int64_t *offset, const int64_t *num_prompt,
                    const float *repetition, const float *frequency, const float *presence, const int64_t *bias_ids,
                    const float *bias, const int64_t *bias_offset, const float *inv_t, float exp_floor,
                    float *span_max, float *span_sum, int32_t num_threads) {
    const Logits l = {base, ld, first, NULL, NULL}; /* held: penalties write them */
    for (int64_t r = 0; r < rows; r++)
        if (!in_vocabulary(history + offset[r], offset[r + 1] - offset[r], vocab) ||
            !in_vocabulary(bias_ids + bias_offset[r], bias_offset[r + 1] - bias_offset[r], vocab))
            return 1;
    int out_of_memory = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t length = offset[r + 1] - offset[r], num_bias = bias_offset[r + 1] - bias_offset[r];
        int64_t *keys = malloc((size_t)(length + 1) * sizeof *keys);
        int64_t *touched = malloc((size_t)(length + num_bias + 1) * sizeof *touched);
        if (!keys || !touched) {
#pragma omp atomic write
            out_of_memory = 1;
        } else {
            const int64_t n = apply_row(&l, r, vocab, history + offset[r], length, num_prompt[r], repetition[r],
                                        frequency[r], presence[r], bias_ids + bias_offset[r], bias + bias_offset[r],
                                        num_bias, keys, touched);
            if (n > 0) {
                qsort(touched, (size_t)n, sizeof *touched, ascending);
                for (int64_t i = 0; i < n; i++) {
                    if (i && touched[i] == touched[i - 1]) continue;
                    const int64_t j = touched[i];
                    summarise_group(span_at(&l, r, j), 0, 1, 0, 1.0f, inv_t[r], exp_floor, span_max + r * spans + j,
                                    span_sum + r * spans + j);
                }
            }
        }
        free(keys);
        free(touched);
    }
    return out_of_memory ? -1 : 0;
}
