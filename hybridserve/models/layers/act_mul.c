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
 * entry is the low half (little endian). OpenMP spreads the rows over torch's threads. */

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "native_vectors.h"

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
