/* A gated MLP's act(gate) * up for bf16 rows, by table (models/layers/act_mul.py calls it;
 * models/arch/decoder.py says where):
 *   out = bf16(table[gate] * up)
 * A bf16 activation has 65536 possible inputs, so act(gate) is one lookup in a table that
 * holds the activation's eager result for every bf16 value (the caller makes it with the
 * activation itself): the GELU's or SiLU's exp, division and roundings are paid once at
 * start-up instead of per element, and the values are the eager op's bit for bit on any
 * CPU. The product rounds as torch's bf16 multiply does: the float32 product of two bf16
 * values, rounded to the nearest bf16 (ties to even).
 *
 * The lookups are vector gathers where the target has them (AVX-512, AVX2): each gathers
 * 32 bits at 2 bytes per index, so the table carries one padding entry, and the wanted
 * entry is the low half (little endian). OpenMP spreads the rows over torch's threads.
 *
 * float32 rows (act_mul_f32: a float32 decoder's decode stack, models/arch/decode_stack.c)
 * have 2^32 gate values, too many for a table: there the activation is computed, as
 * gate * sigmoid(z) = gate / (1 + exp(-z)) with z = gate (SiLU) or
 * z = 2 sqrt(2 / pi) (gate + 0.044715 gate^3) (the tanh GELU: 0.5 (1 + tanh(y)) is
 * sigmoid(2y)), a form exact in both tails where 1 + tanh(y) would cancel. exp is a
 * range reduction to |r| <= ln 2 / 2 and a degree-7 polynomial (its truncation under 2^-26
 * relative there), so each value is within a few float32 roundings of torch's. */

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "native_vectors.h"

typedef int32_t vi __attribute__((vector_size(LANES * 4)));

/* Rows below which one thread does them all: a parallel region costs more. */
#define PARALLEL_ROWS 8

/* table[g[0..LANES)] as float32 lanes (bf16 values in the upper halves). */
static inline vf lookup(const uint16_t *table, const uint16_t *g) {
    vu wide;
#if defined(__AVX512F__) && LANES == 16
    __m256i index;
    memcpy(&index, g, sizeof index);
    const __m512i got = _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(index), (const void *)table, 2);
    memcpy(&wide, &got, sizeof wide);
#elif defined(__AVX2__) && LANES == 8
    __m128i index;
    memcpy(&index, g, sizeof index);
    const __m256i got = _mm256_i32gather_epi32((const int *)table, _mm256_cvtepu16_epi32(index), 2);
    memcpy(&wide, &got, sizeof wide);
#else
    for (int k = 0; k < LANES; k++) wide[k] = table[g[k]];
#endif
    return (vf)(wide << 16);
}

static void row(const uint16_t *gate, const uint16_t *up, int64_t width, const uint16_t *table, uint16_t *out) {
    int64_t j = 0;
    for (; j + LANES <= width; j += LANES) store_bf16(out + j, round_bf16(lookup(table, gate + j) * load_bf16(up + j)));
    for (; j < width; j++) out[j] = f32_to_bf16(bf16_to_f32(table[gate[j]]) * bf16_to_f32(up[j]));
}

/* gate_up: rows of 2 * width bf16 values (gate, then up), `stride` elements apart; table:
 * 65537 bf16 (the last one padding); out: [rows, width] contiguous bf16. */
void act_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t width, const uint16_t *table,
             uint16_t *out, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        row(gate_up + r * stride, gate_up + r * stride + width, width, table, out + r * width);
}

enum { SILU, GELU_TANH };

/* The lanes of x below lo set to lo, above hi to hi (NaN stays NaN). */
static inline vf clamp(vf x, float lo, float hi) {
    const vi low = x < splat(lo), high = x > splat(hi);
    const vi kept = (vi)x & ~(low | high);
    return (vf)(kept | ((vi)splat(lo) & low) | ((vi)splat(hi) & high));
}

/* exp of each lane, for x within [-87, 88] (clamped there: its results stay normal). */
static inline vf vexp(vf x) {
    x = clamp(x, -87.0f, 88.0f);
    const vf shifter = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vf t = x * splat(1.44269504088896341f) + shifter;
    const vf n = t - shifter;
    const vf r = (x - n * splat(0.693145751953125f)) - n * splat(1.42860682030941723e-6f);
    vf p = splat(1.0f / 5040.0f);
    p = p * r + splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    const vi exponent = ((vi)t - (vi)shifter + 127) << 23; /* t's low bits hold n */
    return p * (vf)exponent;
}

static inline vf activation(vf gate, int32_t act) {
    vf z = gate;
    if (act == GELU_TANH) z = splat(1.5957691216057308f) * (gate + splat(0.044715f) * gate * gate * gate);
    return gate / (splat(1.0f) + vexp(-z));
}

static void row_f32(const float *gate, const float *up, int64_t width, int32_t act, float *out) {
    int64_t j = 0;
    for (; j + LANES <= width; j += LANES) store_f32(out + j, activation(load_f32(gate + j), act) * load_f32(up + j));
    for (; j < width; j++) {
        vf g = splat(gate[j]);
        out[j] = activation(g, act)[0] * up[j];
    }
}

/* act_mul of float32 rows with act SILU (0) or GELU_TANH (1) computed; out: [rows, width]
 * float32, out_stride apart. out may be the gate half itself (out == gate_up, out_stride ==
 * stride): each value is read before its own place is written, and no other value reads it. */
void act_mul_f32(const float *gate_up, int64_t stride, int64_t rows, int64_t width, int32_t act, float *out,
                 int64_t out_stride, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        row_f32(gate_up + r * stride, gate_up + r * stride + width, width, act, out + r * out_stride);
}
