/* quantize_rows_uint8's levels and scales (models/layers/int8.py) in one native pass over
 * each row: models/layers/row_levels.py calls it for the int8 head's input.
 *
 * Why by hand: the eager quantizer is nine ATen ops (a float32 copy, abs, amax, clamp, two
 * divisions, round, add, a uint8 copy) and the head's greedy step a finiteness check on
 * top; after the decoder's weights have streamed through the caches they run cold, about
 * a tenth of a millisecond a step, on a one-stream step of about twelve.
 *
 * The same operations in the same float32 roundings, so the same bits: scale = (the row's
 * largest magnitude, at least FLT_MIN) / 127, each level the nearest integer to x / scale
 * (ties to even, as torch's round), stored + 128. Divisions stay divisions (the build has
 * no -ffast-math to turn them into reciprocal products), and subnormals stay subnormal (no
 * flush to zero), as in torch's float32 kernels. A row holding a NaN or an infinity is
 * counted, not quantized: the caller takes the eager quantizer, whose NaN rules the head's
 * general paths follow. */

#include <float.h>
#include <math.h>
#include <stdint.h>

#include "native_vectors.h"

#define LEVELS 127.0f
#define ZERO_POINT 128.0f

static inline float value(const void *x, int32_t x_bf16, int64_t k) {
    return x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
}

/* One row of K values: its levels + 128 into out and its scale; 1 where a value is not
 * finite (out and scale then unwritten), else 0. */
static int row(const void *x, int32_t x_bf16, int64_t K, uint8_t *out, float *scale) {
    float peak = 0.0f;
    int bad = 0;
    for (int64_t k = 0; k < K; k++) {
        const float a = fabsf(value(x, x_bf16, k));
        bad |= !(a <= FLT_MAX); /* NaN or infinity */
        peak = a > peak ? a : peak;
    }
    if (bad) return 1;
    const float s = (peak > FLT_MIN ? peak : FLT_MIN) / LEVELS;
    for (int64_t k = 0; k < K; k++) out[k] = (uint8_t)(nearbyintf(value(x, x_bf16, k) / s) + ZERO_POINT);
    *scale = s;
    return 0;
}

/* x: rows of K bf16 (x_bf16) or float32 values, ldx elements apart; out: uint8 rows ldo
 * apart; scale: float32 [rows]. Returns how many rows hold a value that is not finite. */
int64_t row_levels(const void *x, int32_t x_bf16, int64_t ldx, int64_t rows, int64_t K, uint8_t *out, int64_t ldo,
                   float *scale) {
    int64_t bad = 0;
    const int64_t elem = x_bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) bad += row((const char *)x + r * ldx * elem, x_bf16, K, out + r * ldo, scale + r);
    return bad;
}
