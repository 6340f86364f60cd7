/* What the hand-written C kernels share: one vector of the target's widest float width and
 * the bf16 <-> float32 conversions, written with GCC / Clang vector extensions so the
 * compiler flags pick the instructions (models/platform/native_build.py compiles every
 * kernel with this folder on its include path). */

#ifndef HYBRIDSERVE_NATIVE_VECTORS_H
#define HYBRIDSERVE_NATIVE_VECTORS_H

#include <stdint.h>
#include <string.h>

/* 16 floats with AVX-512, 8 with AVX, 4 otherwise: a wider vector type would be split into
 * several registers, and its shuffles emulated. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));

#if defined(__clang__)
#define SHUFFLE(a, ...) __builtin_shufflevector((a), (a), __VA_ARGS__)
#else
#define SHUFFLE(a, ...) __builtin_shuffle((a), (vu){__VA_ARGS__})
#endif

static inline vf splat(float x) { return (vf){0} + x; }

static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* bf16 -> float32 is exact: the 16 bits are the float's upper half. */
static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* float32 -> the nearest bf16 (ties to even), as torch converts; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    if ((w & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((w >> 16) | 0x40u);
    w += 0x7fffu + ((w >> 16) & 1u);
    return (uint16_t)(w >> 16);
}

/* f32_to_bf16 on every lane, the result kept as the float32 that holds the bf16 value. */
static inline vf round_bf16_emulated(vf x) {
    const vu w = (vu)x;
    const vu rounded = (w + 0x7fffu + ((w >> 16) & 1u)) & 0xffff0000u;
    const vu nan = (vu)((w & 0x7fffffffu) > 0x7f800000u);
    return (vf)((rounded & ~nan) | ((w | 0x00400000u) & 0xffff0000u & nan));
}

#if defined(__AVX512BF16__) && LANES == 16
#include <immintrin.h>
/* round_bf16_emulated in one instruction where the CPU has AVX512-BF16 (the build passes
 * -mavx512bf16 only then): its conversion rounds to nearest even and quiets a NaN as the
 * emulation does, but flushes subnormal inputs to zero, so lanes holding one (rare: the
 * kernels' values are normalised activations) take the emulation. */
static inline vf round_bf16(vf x) {
    const __m512 v = (__m512)x;
    const __m256i halves = (__m256i)_mm512_cvtneps_pbh(v);
    const vf fast = (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16);
    /* |x| - 1 below 0x7fffff (unsigned): |x| is a nonzero subnormal */
    const __m512i magnitude = _mm512_and_si512((__m512i)v, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 subnormal = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(magnitude, _mm512_set1_epi32(1)),
                                                        _mm512_set1_epi32(0x007fffff));
    if (__builtin_expect(subnormal != 0, 0))
        return (vf)_mm512_mask_blend_ps(subnormal, (__m512)fast, (__m512)round_bf16_emulated(x));
    return fast;
}
#else
static inline vf round_bf16(vf x) { return round_bf16_emulated(x); }
#endif

/* Stores lanes that already hold bf16 values (round_bf16's) as bf16. */
static inline void store_bf16(uint16_t *p, vf x) {
    const vh h = __builtin_convertvector((vu)x >> 16, vh);
    memcpy(p, &h, sizeof h);
}

/* The steps of a reduction across lanes: each combines the vector with its halves
 * swapped, then its quarters, ..., until every lane holds the result. */
#if LANES == 16
#define HALVES(op, a)                                                                     \
    a = op(a, SHUFFLE(a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));          \
    a = op(a, SHUFFLE(a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));          \
    a = op(a, SHUFFLE(a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));          \
    a = op(a, SHUFFLE(a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#elif LANES == 8
#define HALVES(op, a)                                  \
    a = op(a, SHUFFLE(a, 4, 5, 6, 7, 0, 1, 2, 3));     \
    a = op(a, SHUFFLE(a, 2, 3, 0, 1, 6, 7, 4, 5));     \
    a = op(a, SHUFFLE(a, 1, 0, 3, 2, 5, 4, 7, 6));
#else
#define HALVES(op, a)                      \
    a = op(a, SHUFFLE(a, 2, 3, 0, 1));     \
    a = op(a, SHUFFLE(a, 1, 0, 3, 2));
#endif

/* The larger of a and b per lane (b where they compare unordered). */
static inline vf vmax(vf a, vf b) {
    const vu take_a = (vu)(a > b);
    return (vf)(((vu)a & take_a) | ((vu)b & ~take_a));
}

static inline vf vadd(vf a, vf b) { return a + b; }

static inline float lanes_max(vf a) {
    HALVES(vmax, a)
    return a[0];
}

static inline float lanes_sum(vf a) {
    HALVES(vadd, a)
    return a[0];
}

#endif
