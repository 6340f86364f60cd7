/* One span's summary, shared by the kernels that summarise logits
 * (models/layers/span_summaries.c over stored logits; models/layers/int8_amx.c as its
 * products come out): the span's maximum m and its mass, the sum of
 * exp(max((x - m) * inv_t, exp_floor)) (0 for a span that is all -inf); both use
 * summarise_spans (directly or through summarise_group), so the same logits give the same
 * summaries bit for bit.
 * The exponential (exp_nonpositive, also the paged decode kernel's softmax,
 * executor/torch/paged_decode.c) is range reduction to 2^n * e^r (|r| <= ln 2 / 2) with
 * a degree-6 polynomial for e^r, fitted for least maximum relative error on that range
 * (iteratively reweighted least squares at 200 Chebyshev nodes): 1.9e-9 relative with exact
 * coefficients, 1.7e-8 with them rounded to float32, so float32 rounding dominates (1.1e-7
 * evaluated in float32, as Taylor's degree 8 gave with two multiply-adds more per lane). */

#ifndef HYBRIDSERVE_SPAN_SUMMARY_H
#define HYBRIDSERVE_SPAN_SUMMARY_H

#include <math.h>
#include <stdint.h>

#include "native_vectors.h"
#if LANES == 16
#include <immintrin.h>
#endif

#define SPAN 128

/* GROUP spans side by side fill the registers without spilling: AVX-512 has 32 of them,
 * AVX2 and SSE 16. */
#if LANES == 16
#define GROUP 8
#else
#define GROUP 4
#endif

typedef int32_t vi __attribute__((vector_size(LANES * 4)));

/* exp(x) for x in [-87, 0] (the caller's floor keeps it there: 2^n stays a normal float). */
static inline vf exp_nonpositive(vf x) {
    const vf round_shift = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * splat(1.44269504088896341f) + round_shift) - round_shift;
    vf r = x - n * splat(0.693145751953125f); /* ln 2 in two parts: r stays exact */
    r = r - n * splat(1.42860682030941723212e-6f);
    vf p = splat(0.0013836846919730306f);
    p = p * r + splat(0.008374815806746483f);
    p = p * r + splat(0.04166822507977486f);
    p = p * r + splat(0.16666419804096222f);
    p = p * r + splat(0.49999991059303284f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
#if LANES == 16
    /* p * 2^n in one instruction (exact: 2^n is a normal float for x >= -87) */
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
    vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)two_n;
#endif
}

/* count <= GROUP spans of SPAN floats, span g at first + g * SPAN (side by side in a row,
 * or a block's rows), each logit first multiplied by `factor` in place where `scaled`;
 * span g at inverse temperature inv_t[each ? g : 0], its maximum and mass written to
 * peak[g * step] and mass[g * step]. The spans' lanes are worked side by side: one span's
 * exponentials alone leave the vector units waiting on each polynomial's chain. */
/* Always inlined: each call site's constant count and flags then unroll its loops, with
 * the lanes in registers (left to its own judgement GCC calls one generic copy for AVX2). */
static inline __attribute__((always_inline)) void
summarise_spans(float *first, int count, int scaled, float factor, const float *inv_t, int each, float exp_floor,
                float *peak, float *mass, int64_t step) {
    vf lane_max[GROUP], shift[GROUP], acc[GROUP], by_temperature[GROUP];
    float m[GROUP];
    const vf row_factor = splat(factor);
    for (int g = 0; g < count; g++) lane_max[g] = splat(-INFINITY);
    for (int b = 0; b < SPAN; b += LANES)
        for (int g = 0; g < count; g++) {
            float *p = first + g * SPAN + b;
            vf v = load_f32(p);
            if (scaled) {
                v = v * row_factor; /* stored, then used only by the max: never fused into later arithmetic */
                store_f32(p, v);
            }
            lane_max[g] = vmax(lane_max[g], v);
        }
    for (int g = 0; g < count; g++) {
        m[g] = lanes_max(lane_max[g]);
        shift[g] = splat(m[g] == -INFINITY ? 0.0f : m[g]); /* an all -inf span: no -inf - -inf */
        acc[g] = splat(0.0f);
        by_temperature[g] = splat(inv_t[each ? g : 0]);
    }
    const vf lowest = splat(exp_floor);
    for (int b = 0; b < SPAN; b += LANES)
        for (int g = 0; g < count; g++)
            acc[g] += exp_nonpositive(vmax((load_f32(first + g * SPAN + b) - shift[g]) * by_temperature[g], lowest));
    for (int g = 0; g < count; g++) {
        peak[g * step] = m[g];
        mass[g * step] = m[g] == -INFINITY ? 0.0f : lanes_sum(acc[g]);
    }
}

/* Spans j0 .. j0 + count - 1 (count <= GROUP) of one row at one inverse temperature, into
 * peak[j0 ..] and mass[j0 ..]: summarise_spans over a row. */
static inline __attribute__((always_inline)) void
summarise_group(float *row, int64_t j0, int count, int scaled, float factor, float inv_t, float exp_floor,
                float *peak, float *mass) {
    summarise_spans(row + j0 * SPAN, count, scaled, factor, &inv_t, 0, exp_floor, peak + j0, mass + j0, 1);
}

#endif
