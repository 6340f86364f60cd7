/* A linear whose weight is int8 values times a float32 scale (plus an offset) per group of
 * consecutive weights of a row: the GGUF's own blocks (models/layers/int8_groups.py packs
 * them and calls this; models/loaders/gguf_groups.py reads them):
 *   out[m, n] = sum_g scale[n, g] * sum_{k in g} q[n, k] * x[m, k]
 *             + offset[n, g] * sum_{k in g} x[m, k]      (+ bias[n], + residual[m, n])
 * Every product of an int8 value and an input (bf16 or float32) is exact in float32, each
 * group's sum is multiplied once by its scale, and the output is rounded once to the
 * input's dtype: the file's values times the input, float32 rounding aside. That holds on
 * the vector loop (group_linear's amx 0, any CPU), on AMX_EXACT's tile products per group
 * and on DPBF16's pair products (AVX512-BF16 without AMX); for larger steps AMX_FOLDED and group_expand round each weight to bf16 first
 * (the arithmetic of a bf16 model), which lets a tile product run over all of K. I16 (CPUs
 * without native bf16) rounds the inputs instead, each row to int16 per group (2^-16 of
 * the group's largest), for AVX2's integer dot products; VNNI (AVX512-VNNI without AMX)
 * rounds them to int8 per group (1/127 of the group's largest) for vpdpbusd.
 *
 * Layout: the weight in tiles of TILE output columns, values [N / TILE][K][TILE] (the
 * TILE columns' values of one k side by side, so one vector load feeds TILE outputs),
 * scale and offset [N / TILE][K / group][TILE]. A tile's values are read once per block of
 * ROW_BLOCK rows and stay in L1 / L2 between blocks, so one row streams each weight byte
 * once: what makes the kernel fast at decode's row counts is reading 1-1.25 bytes a
 * weight instead of bf16's 2. OpenMP spreads the tiles over torch's threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "native_vectors.h"

#define TILE 16
#define NV (TILE / LANES)
#define ROW_BLOCK 4
#define EXPAND_ROWS 4 /* group_expand's rows of the transposed weight per step: TILE * 4 bytes of values */
#define PREFETCH_BYTES 2048 /* how far ahead of its loads the vector loop asks for weights */

typedef int32_t vi __attribute__((vector_size(LANES * 4)));

/* LANES int8 values as float32 lanes (exact). Spelled with intrinsics where the target has
 * a sign-extending load: GCC converts a vector of int8 to float one lane at a time. */
static inline vf load_i8(const int8_t *p) {
#if defined(__AVX512F__) && LANES == 16
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__) && LANES == 8
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vi i;
    for (int l = 0; l < LANES; l++) i[l] = p[l];
    vf f = __builtin_convertvector(i, vf);
#endif
    vf v;
    memcpy(&v, &f, sizeof v);
    return v;
}

/* One tile's outputs for `mb` (a constant once inlined) rows of xf from row 0, into res.
 * Two sets of accumulators take alternate k: one chain of dependent adds per group would
 * leave the FMA units waiting on each other's latency at one row. */
static inline __attribute__((always_inline)) void tile_rows(const int mb, const float *xf, const float *xsum, int64_t K,
                                                            int64_t groups, int64_t gs, const int8_t *vt,
                                                            const float *st, const float *ot, float *res) {
    vf tot[ROW_BLOCK][NV];
    for (int r = 0; r < mb; r++)
        for (int v = 0; v < NV; v++) tot[r][v] = splat(0.0f);
    for (int64_t g = 0; g < groups; g++) {
        vf acc[2][ROW_BLOCK][NV];
        for (int p = 0; p < 2; p++)
            for (int r = 0; r < mb; r++)
                for (int v = 0; v < NV; v++) acc[p][r][v] = splat(0.0f);
        const int8_t *w = vt + g * gs * TILE;
        const float *xg = xf + g * gs;
        /* The weights PREFETCH_BYTES on (this tile's later groups, then the next tile's, which
         * a static schedule gives the same thread) asked into L2 now: one row read the
         * decoder at 15-17 GB/s without it (benchmarks/results/group_int8_kernels.md). */
        for (int64_t c = 0; c < gs * TILE; c += 64) __builtin_prefetch(w + PREFETCH_BYTES + c, 0, 2);
        for (int64_t k = 0; k < gs; k += 2)
            for (int p = 0; p < 2; p++)
                for (int v = 0; v < NV; v++) {
                    const vf wv = load_i8(w + (k + p) * TILE + v * LANES);
                    for (int r = 0; r < mb; r++) acc[p][r][v] += wv * splat(xg[r * K + k + p]);
                }
        for (int v = 0; v < NV; v++) {
            const vf s = load_f32(st + g * TILE + v * LANES);
            for (int r = 0; r < mb; r++) tot[r][v] += s * (acc[0][r][v] + acc[1][r][v]);
        }
        if (ot)
            for (int v = 0; v < NV; v++) {
                const vf o = load_f32(ot + g * TILE + v * LANES);
                for (int r = 0; r < mb; r++) tot[r][v] += o * splat(xsum[r * groups + g]);
            }
    }
    for (int r = 0; r < mb; r++)
        for (int v = 0; v < NV; v++) store_f32(res + r * TILE + v * LANES, tot[r][v]);
}

/* The sums of one row of bf16 inputs over each of its `groups` groups of gs: a vector at a
 * time where gs is whole vectors (a scalar chain per group took ~4 cycles an input, ~1 ms a
 * 16-row decode step once every narrow weight needed the sums). */
static void group_sums(const uint16_t *row, int64_t groups, int64_t gs, float *out) {
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *in = row + g * gs;
        if (gs % LANES == 0) {
            vf acc = splat(0.0f);
            for (int64_t k = 0; k < gs; k += LANES) acc += load_bf16(in + k);
            out[g] = lanes_sum(acc);
        } else {
            float sum = 0.0f;
            for (int64_t k = 0; k < gs; k++) sum += bf16_to_f32(in[k]);
            out[g] = sum;
        }
    }
}

static inline float load_any(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* AMX: from a few rows on, the products of a row block and a group are one tile product.
 * Per tile of TILE output columns, a chunk of groups at a time, the values are expanded to
 * bf16 (exact for int8) in AMX's pair layout; then for each block of AMX_ROWS input rows
 * (bf16, padded with zero rows) one tdpbf16ps per group gives the group's 16 x 16 float32
 * sums, which are stored and added times the group's scale (and its offset times the rows'
 * sums of the group's inputs) to 16 output registers: the same arithmetic as the vector
 * path, the file's values exactly. Compiled with target attributes, called only where the CPU has
 * amx_bf16 and the kernel obtained the tile state from Linux (group_linear_amx_ready).
 * Without AMX, DPBF16 takes the same expanded pairs through AVX512-BF16's vdpbf16ps
 * (dp_tile), called only where the CPU has avx512_bf16. */
#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11) && defined(__AVX512F__)
#define HAVE_X86_TARGETS 1 /* functions compiled for AMX and AVX512-BF16 by target attributes */
#include "amx_tiles.h"

#define AMX_ROWS 16
#define AMX_EXACT 1  /* group_linear's amx: per-group tile products, the file's values exactly */
#define AMX_FOLDED 2 /* the weights rounded to bf16 per tile, products over all of K (K % 32 == 0) */
#define DPBF16 3     /* no AMX: AVX512-BF16 pair products per group, the file's values exactly */
#define DP_ROWS 8    /* rows per register block of the DPBF16 path */
/* The cases of a switch over a row block's rows mb (1..7, else `full`), each calling
 * ROW_BLOCK_CALL(n) (defined at the switch) with a constant n: the inlined row function
 * then unrolls its loops over rows for each count. */
#define ROW_BLOCK_CASES(full)                                                                                     \
    case 1: ROW_BLOCK_CALL(1); break;                                                                             \
    case 2: ROW_BLOCK_CALL(2); break;                                                                             \
    case 3: ROW_BLOCK_CALL(3); break;                                                                             \
    case 4: ROW_BLOCK_CALL(4); break;                                                                             \
    case 5: ROW_BLOCK_CALL(5); break;                                                                             \
    case 6: ROW_BLOCK_CALL(6); break;                                                                             \
    case 7: ROW_BLOCK_CALL(7); break;                                                                             \
    default: ROW_BLOCK_CALL(full); break;

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
/* 1 where Linux lets this process use AMX's tile data (asked for once), else 0. */
int group_linear_amx_ready(void) { return amx_request_tiles(); }

/* The exact path's tiles: 0 a group's sums (16 rows x 16 float32), 4 a row block's inputs
 * of one group (16 rows x gs bf16), 5 the group's values (gs / 2 pairs of rows, TILE
 * columns of bf16 pairs). The folded path configures gs = 32 and takes 0-3 for four sums
 * and 6 and 7 too (amx_tiles_folded). */
AMX_TARGET static void amx_configure(int64_t gs) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) {
        cfg.rows[t] = AMX_ROWS;
        cfg.colsb[t] = TILE * 4;
    }
    cfg.rows[4] = AMX_ROWS;          /* inputs: 16 rows of gs bf16 */
    cfg.colsb[4] = (uint16_t)(gs * 2);
    cfg.rows[5] = (uint8_t)(gs / 2); /* values: gs / 2 pairs of rows, TILE columns of bf16 pairs */
    cfg.colsb[5] = TILE * 4;
    for (int t = 6; t < 8; t++) {
        cfg.rows[t] = AMX_ROWS;
        cfg.colsb[t] = TILE * 4;
    }
    amx_load_config(&cfg);
}

AMX_TARGET static void amx_release(void) { _tile_release(); }

/* Part `part` of `parts` of the `bytes` at next, fetched into L2: a tile's products run from
 * caches, so the next tile's values stream in meanwhile instead of after them. */
static inline void prefetch_part(const int8_t *next, int64_t bytes, int64_t part, int64_t parts) {
    if (!next) return;
    const int64_t chunk = (bytes + parts - 1) / parts;
    for (int64_t b = part * chunk; b < (part + 1) * chunk && b < bytes; b += 64)
        _mm_prefetch((const char *)(next + b), _MM_HINT_T1);
}

#define DPBF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* What expand_pairs adds to narrow values: 128 + 64, so q + NARROW_BIAS spans [128, 255],
 * one binade, where bf16's 7 fraction bits hold it exactly. */
#define NARROW_BIAS 192.0f

/* The factor of group g's input sum in a tile's outputs: its offset (zero without one),
 * less NARROW_BIAS times its scale where the values were expanded narrow, since then
 * sum_k (q_k + NARROW_BIAS) x_k = sum_k q_k x_k + NARROW_BIAS sum_k x_k. NULL-free only
 * where one of the two applies (callers check ot || narrow). */
DPBF16_TARGET static inline __m512 narrow_offset(const float *st, const float *ot, int64_t g, int narrow) {
    const __m512 offset = ot ? _mm512_loadu_ps(ot + g * TILE) : _mm512_setzero_ps();
    return narrow ? _mm512_fnmadd_ps(_mm512_set1_ps(NARROW_BIAS), _mm512_loadu_ps(st + g * TILE), offset) : offset;
}

/* Values [K][TILE] int8 of one tile -> bf16 pairs [K / 2][TILE][2]. Narrow values (all in
 * [-64, 63]) become q + NARROW_BIAS, whose bf16 is 0x4300 + (q + 64): an add, a
 * zero-extension and an OR per 32 values instead of two widenings to float32 and a
 * rounding (~40% less time); the callers take the bias back out with the groups' input
 * sums (narrow_offset). */
DPBF16_TARGET static void expand_pairs(const int8_t *vt, int64_t K, uint16_t *pairs, int narrow) {
    if (narrow) {
        const __m128i to_unsigned = _mm_set1_epi8(64);
        const __m512i exponent = _mm512_set1_epi16(0x4300); /* bf16 of 128: the bytes are its 7 fraction bits */
        for (int64_t k = 0; k < K; k += 2) {
            const __m128i a = _mm_add_epi8(_mm_loadu_si128((const __m128i *)(vt + k * TILE)), to_unsigned);
            const __m128i b = _mm_add_epi8(_mm_loadu_si128((const __m128i *)(vt + (k + 1) * TILE)), to_unsigned);
            const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, b)),
                                                       _mm_unpackhi_epi8(a, b), 1);
            _mm512_storeu_si512((void *)(pairs + k * TILE), _mm512_or_si512(_mm512_cvtepu8_epi16(ab), exponent));
        }
        return;
    }
    for (int64_t k = 0; k < K; k += 2) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(vt + k * TILE));
        const __m128i b = _mm_loadu_si128((const __m128i *)(vt + (k + 1) * TILE));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a, b)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(a, b)));
        _mm512_storeu_si512((void *)(pairs + k * TILE), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* How many groups' values are expanded at a time: each chunk's pairs are multiplied right
 * after (they stay in L1), and the values stream in as evenly as the products run, with the
 * ones CHUNK_PREFETCH_BYTES further on (one and a half chunks of groups of 32) asked into L1
 * meanwhile. Expanding a whole tile first (its 20-64 KB of pairs through L2) and prefetching
 * the next tile in bursts left the weights' reads and the products one after the other: 4-16
 * rows took ~22% longer (benchmarks/results/group_int8_kernels.md; into L2, or 2-4 KB
 * ahead, 3-10% longer than this). */
#define CHUNK_GROUPS 2
#define CHUNK_PREFETCH_BYTES 1536

/* Chunk g0 .. g0 + n's values, expanded to pairs (the values CHUNK_PREFETCH_BYTES on asked
 * for first). */
DPBF16_TARGET static inline void expand_chunk(const int8_t *vt, int64_t g0, int n, int64_t gs, uint16_t *pairs,
                                              int narrow) {
    const int8_t *chunk = vt + g0 * gs * TILE;
    for (int64_t b = 0; b < n * gs * TILE; b += 64)
        _mm_prefetch((const char *)chunk + CHUNK_PREFETCH_BYTES + b, _MM_HINT_T0);
    expand_pairs(chunk, n * gs, pairs, narrow);
}

/* DPBF16: `mb` (a constant once inlined) rows of bf16 x from row m0 of one tile, from its
 * values in pair layout: per group, one vdpbf16ps per pair of k and row (the two exact
 * products and the accumulator summed in float32), then the group's sum times its scale
 * (and its offset times the rows' input sums), as the other exact paths. */
static inline __attribute__((always_inline)) DPBF16_TARGET void dp_rows(
    const int mb, const uint16_t *x, int64_t ldx, int64_t groups, int64_t gs, int64_t g0, int64_t g1,
    const uint16_t *pairs, const float *st, const float *ot, const float *xsum, float *res, int narrow) {
    __m512 tot[DP_ROWS];
    for (int r = 0; r < mb; r++) tot[r] = g0 ? _mm512_loadu_ps(res + r * TILE) : _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; g++) {
        __m512 acc[DP_ROWS];
        for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t kk = g * gs / 2; kk < (g + 1) * gs / 2; kk++) {
            const __m512bh w = (__m512bh)_mm512_load_si512((const void *)(pairs + (kk - g0 * gs / 2) * 2 * TILE));
            for (int r = 0; r < mb; r++) {
                int32_t pair;
                memcpy(&pair, x + r * ldx + 2 * kk, sizeof pair);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);
            }
        }
        const __m512 scale = _mm512_loadu_ps(st + g * TILE);
        for (int r = 0; r < mb; r++) tot[r] = _mm512_fmadd_ps(scale, acc[r], tot[r]);
        if (ot || narrow) {
            const __m512 offset = narrow_offset(st, ot, g, narrow);
            for (int r = 0; r < mb; r++) tot[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[r * groups + g]), tot[r]);
        }
    }
    for (int r = 0; r < mb; r++) _mm512_storeu_ps(res + r * TILE, tot[r]);
}

DPBF16_TARGET static void dp_tile(const uint16_t *x, int64_t M, int64_t K, int64_t groups, int64_t gs,
                                  const int8_t *vt, const float *st, const float *ot, const float *xsum,
                                  uint16_t *pairs, float *res, int narrow) {
    for (int64_t g0 = 0; g0 < groups; g0 += CHUNK_GROUPS) {
        const int n = groups - g0 < CHUNK_GROUPS ? (int)(groups - g0) : CHUNK_GROUPS;
        const int64_t g1 = g0 + n;
        expand_chunk(vt, g0, n, gs, pairs, narrow);
        for (int64_t m0 = 0; m0 < M; m0 += DP_ROWS) {
            const int mb = M - m0 < DP_ROWS ? (int)(M - m0) : DP_ROWS;
            const uint16_t *xm = x + m0 * K;
            const float *sm = xsum + m0 * groups;
            float *rm = res + m0 * TILE;
#define ROW_BLOCK_CALL(n) dp_rows(n, xm, K, groups, gs, g0, g1, pairs, st, ot, sm, rm, narrow)
            switch (mb) { ROW_BLOCK_CASES(DP_ROWS) }
#undef ROW_BLOCK_CALL
        }
    }
}

/* The same tile's weights (values times scale, plus offset) rounded to bf16 in the pair
 * layout: the large-step path, whose tile products then run over all of K at once. */
AMX_TARGET static void expand_weights(const int8_t *vt, const float *st, const float *ot, int64_t K, int64_t gs,
                                      uint16_t *pairs) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t k = 0; k < K; k += 2) {
        const int64_t g = k / gs;
        const __m512 scale = _mm512_loadu_ps(st + g * TILE);
        const __m512 offset = ot ? _mm512_loadu_ps(ot + g * TILE) : _mm512_setzero_ps();
        const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(vt + k * TILE)))), scale, offset);
        const __m512 b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(vt + (k + 1) * TILE)))), scale, offset);
        /* a0..a15 b0..b15 as bf16, then a0 b0 a1 b1 ...: column c's pair in 32-bit lane c */
        const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512((void *)(pairs + k * TILE), _mm512_permutexvar_epi16(interleave, ab));
    }
}

/* Rows 0 .. M (a multiple of AMX_ROWS) of two adjacent tiles from their bf16 weights
 * (pairs0, pairs1): tile products over K in steps of 32, two row blocks at a time, so each
 * input and weight tile loaded serves two products (tiles 0-3 the four sums, 4 and 5 the
 * row blocks' inputs, 6 and 7 the two tiles' weights). res0 / res1: [M][TILE] each. */
AMX_TARGET static void amx_tiles_folded(const uint16_t *xpad, int64_t M, int64_t K, const uint16_t *pairs0,
                                        const uint16_t *pairs1, float *res0, float *res1, const int8_t *next,
                                        int64_t next_bytes) {
    int64_t m0 = 0;
    for (; m0 + 2 * AMX_ROWS <= M; m0 += 2 * AMX_ROWS) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
            if (m0 == 0) prefetch_part(next, next_bytes, k / 32, K / 32);
            _tile_loadd(4, xpad + m0 * K + k, K * 2);
            _tile_loadd(5, xpad + (m0 + AMX_ROWS) * K + k, K * 2);
            _tile_loadd(6, pairs0 + k * TILE, TILE * 4);
            _tile_loadd(7, pairs1 + k * TILE, TILE * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, res0 + m0 * TILE, TILE * 4);
        _tile_stored(1, res1 + m0 * TILE, TILE * 4);
        _tile_stored(2, res0 + (m0 + AMX_ROWS) * TILE, TILE * 4);
        _tile_stored(3, res1 + (m0 + AMX_ROWS) * TILE, TILE * 4);
    }
    if (m0 < M) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < K; k += 32) {
            if (m0 == 0) prefetch_part(next, next_bytes, k / 32, K / 32);
            _tile_loadd(4, xpad + m0 * K + k, K * 2);
            _tile_loadd(6, pairs0 + k * TILE, TILE * 4);
            _tile_loadd(7, pairs1 + k * TILE, TILE * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, res0 + m0 * TILE, TILE * 4);
        _tile_stored(1, res1 + m0 * TILE, TILE * 4);
    }
}

/* One row block's (xb: 16 rows of K inputs; xs: their groups' sums) products with chunk
 * g0 .. g0 + n's pairs: one tdpbf16ps per group (16 x 16 float32 sums, stored), then the
 * sums times the group's scale, plus its offset times the rows' input sums (narrow's
 * correction included), added to acc. */
static inline __attribute__((always_inline)) AMX_TARGET void chunk_products(
    const uint16_t *xb, const float *xs, int64_t K, int64_t groups, int64_t gs, int64_t g0, int n,
    const uint16_t *pairs, const float *st, const float *ot, int narrow, float *sums, __m512 acc[AMX_ROWS]) {
    for (int j = 0; j < n; j++) {
        _tile_zero(0);
        _tile_loadd(4, xb + (g0 + j) * gs, K * 2);
        _tile_loadd(5, pairs + j * gs * TILE, TILE * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_stored(0, sums + j * AMX_ROWS * TILE, TILE * 4);
    }
    for (int j = 0; j < n; j++) {
        const int64_t g = g0 + j;
        const __m512 scale = _mm512_loadu_ps(st + g * TILE);
        const float *sj = sums + j * AMX_ROWS * TILE;
        for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_fmadd_ps(scale, _mm512_load_ps(sj + r * TILE), acc[r]);
        if (ot || narrow) {
            const __m512 offset = narrow_offset(st, ot, g, narrow);
            for (int r = 0; r < AMX_ROWS; r++)
                acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs[r * groups + g]), acc[r]);
        }
    }
}

/* The exact path's tile: rows 0 .. M (a multiple of AMX_ROWS) of one tile of TILE output
 * columns into res ([M][TILE]), a chunk of groups at a time. One row block (decode's 3-16
 * rows) keeps its outputs in registers throughout; more keep them in res between chunks. */
AMX_TARGET static void amx_tile(const uint16_t *xpad, const float *xsum, int64_t M, int64_t K, int64_t groups,
                                int64_t gs, const int8_t *vt, const float *st, const float *ot, uint16_t *pairs,
                                float *res, int narrow) {
    float sums[CHUNK_GROUPS * AMX_ROWS * TILE] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    if (M == AMX_ROWS) {
        for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t g0 = 0; g0 < groups; g0 += CHUNK_GROUPS) {
            const int n = groups - g0 < CHUNK_GROUPS ? (int)(groups - g0) : CHUNK_GROUPS;
            expand_chunk(vt, g0, n, gs, pairs, narrow);
            chunk_products(xpad, xsum, K, groups, gs, g0, n, pairs, st, ot, narrow, sums, acc);
        }
        for (int r = 0; r < AMX_ROWS; r++) _mm512_store_ps(res + r * TILE, acc[r]);
        return;
    }
    memset(res, 0, sizeof(float) * (size_t)(M * TILE));
    for (int64_t g0 = 0; g0 < groups; g0 += CHUNK_GROUPS) {
        const int n = groups - g0 < CHUNK_GROUPS ? (int)(groups - g0) : CHUNK_GROUPS;
        expand_chunk(vt, g0, n, gs, pairs, narrow);
        for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
            for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_load_ps(res + (m0 + r) * TILE);
            chunk_products(xpad + m0 * K, xsum + m0 * groups, K, groups, gs, g0, n, pairs, st, ot, narrow, sums, acc);
            for (int r = 0; r < AMX_ROWS; r++) _mm512_store_ps(res + (m0 + r) * TILE, acc[r]);
        }
    }
}
#endif

/* Rows m0 .. m0 + rows of tile t's outputs (res[r * TILE + c]) + bias + residual, rounded
 * to out's dtype. */
static void store_rows(const float *res, int64_t rows, int64_t m0, int64_t t, int32_t x_bf16, const float *bias,
                       const void *residual, int64_t ldr, void *out, int64_t ldo) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t m = m0 + r;
        for (int c = 0; c < TILE; c++) {
            const int64_t n = t * TILE + c;
            float y = res[r * TILE + c];
            if (bias) y += bias[n];
            if (residual) y += load_any(residual, x_bf16, m * ldr + n);
            if (x_bf16)
                ((uint16_t *)out)[m * ldo + n] = f32_to_bf16(y);
            else
                ((float *)out)[m * ldo + n] = y;
        }
    }
}

/* I16: AVX2's int16 dot products (vpmaddwd) for CPUs without native bf16, where the vector
 * loop's float32 products cost a batch a third of the int8 GEMM's speed. The weight is
 * packed for it (int8_groups.py's "pairs" layout): column c's two consecutive k side by
 * side, [N / TILE][K / 2][TILE][2] int8. Each row's inputs are quantized per group to int16:
 * d = max |x| / 32767, xi = round(x / d), each within d / 2 of x (2^-16 of the group's
 * largest input: far below the bf16 or float32 rounding of the output). One vpmaddwd
 * multiplies a pair of k of 8 columns (widened to int16) by two inputs and sums them to
 * int32 (exact: |q| <= 128 and |xi| <= 32767 keep a group of 32's sum within 2^28), the
 * same instruction count per product as vpmaddubsw's int8 pairs once those are widened
 * (and half of it where the CPU has vpdpwssd, AVX-VNNI's or AVX512-VNNI's vpmaddwd and
 * vpaddd in one); then each group's sum times its scale and d:
 *   out[m, n] = sum_g scale[n, g] d[m, g] sum_k q[n, k] xi[m, k] + offset[n, g] sum_k x[m, k]
 * The offsets take the inputs' own sums (float32), as the other paths do. */
#if defined(__AVX2__)
#define HAVE_I16 1
#define I16 4             /* group_linear's amx: this path with vpmaddwd + vpaddd */
#define I16_AVX_VNNI 5    /* with AVX-VNNI's vpdpwssd (the CPU's avx_vnni), the same sums */
#define I16_AVX512_VNNI 6 /* with AVX512-VNNI's vpdpwssd on 256-bit registers (avx512_vnni, avx512vl) */
/* The assemblers that know both vpdpwssd forms (binutils 2.36, with GCC 11; Clang 12) */
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : (defined(__GNUC__) && __GNUC__ >= 11))
#define HAVE_I16_VNNI 1
#endif
#define I16_ROWS 4 /* rows per register block */

/* 8 inputs from p (bf16 or float32) as float32. */
static inline __m256 i16_load8(const void *p, int32_t x_bf16, int64_t i) {
    if (x_bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

static inline float i16_lanes_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float i16_lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* How the i16 and VNNI paths round the gs inputs from k0 of a row (bf16 or float32) to
 * integers of at most `levels` in magnitude: the step (*d: the group's largest |x| over
 * levels) and its inverse (the return value, 0 for a group of zeros), and the group's
 * float32 sum where sum is not NULL. Whole 8s a vector at a time. An infinite or NaN input
 * (the group's sum is then not finite) makes the step NaN, so the group's products are
 * NaN as the float32 paths' would be, instead of vanishing with a zero inverse. */
static float group_step(const void *x, int32_t x_bf16, int64_t k0, int64_t gs, float levels, float *d, float *sum) {
    float t = 0.0f, s = 0.0f;
    if (gs % 8 == 0) {
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 amax = _mm256_setzero_ps(), sums = _mm256_setzero_ps();
        for (int64_t k = 0; k < gs; k += 8) {
            const __m256 v = i16_load8(x, x_bf16, k0 + k);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
            sums = _mm256_add_ps(sums, v);
        }
        t = i16_lanes_max(amax);
        s = i16_lanes_sum(sums);
    } else {
        for (int64_t k = 0; k < gs; k++) {
            const float v = load_any(x, x_bf16, k0 + k), a = v < 0.0f ? -v : v;
            t = a > t ? a : t;
            s += v;
        }
    }
    *d = __builtin_isfinite(s) ? t / levels : __builtin_nanf("");
    if (sum) *sum = s;
    return t > 0.0f && __builtin_isfinite(t) ? levels / t : 0.0f;
}

/* One row of K inputs (bf16 or float32) quantized per group of gs: xi (int16) and d, and
 * the group's float32 sums where xsum is not NULL. Groups of whole 8s a vector at a time. */
static void i16_quantize_row(const void *x, int32_t x_bf16, int64_t K, int64_t gs, int16_t *xi, float *d,
                             float *xsum) {
    for (int64_t g = 0; g < K / gs; g++) {
        const int64_t k0 = g * gs;
        const float inv = group_step(x, x_bf16, k0, gs, 32767.0f, d + g, xsum ? xsum + g : NULL);
        int64_t k = 0;
        if (gs % 8 == 0)
            for (; k < gs; k += 8) {
                /* rounded to nearest even (the default rounding mode); packs_epi32 saturates, never needed */
                const __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(i16_load8(x, x_bf16, k0 + k), _mm256_set1_ps(inv)));
                const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
                _mm_storeu_si128((__m128i *)(xi + k0 + k), packed);
            }
        for (; k < gs; k++) xi[k0 + k] = (int16_t)_mm_cvtss_si32(_mm_set_ss(load_any(x, x_bf16, k0 + k) * inv));
    }
}

/* acc + vpmaddwd(w, x) as one asm pair, each product added as soon as it is made: written
 * as two intrinsics, GCC computes a row block's eight products before their adds, needs
 * more than AVX2's 16 registers, and spills an accumulator and copies the others every
 * step (benchmarks/results/group_int8_kernels.md). */
static inline __attribute__((always_inline)) __m256i i16_madd_add(const int dot, __m256i acc, __m256i w,
                                                                    __m256i x) {
#ifdef HAVE_I16_VNNI
    /* one instruction where the CPU has it: vpdpwssd is vpmaddwd and vpaddd in one */
    if (dot == I16_AVX_VNNI) {
        __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
        return acc;
    }
    if (dot == I16_AVX512_VNNI) {
        __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
        return acc;
    }
#endif
    __m256i product;
    __asm__("vpmaddwd %2, %3, %0\n\tvpaddd %0, %1, %1" : "=&x"(product), "+x"(acc) : "x"(w), "x"(x));
    return acc;
}

/* `mb` (a constant once inlined) rows of quantized inputs (xi rows K apart; d and xsum rows
 * `groups` apart) times one tile's pairs (pt) into res [mb][TILE]. */
static inline __attribute__((always_inline)) void i16_rows(const int mb, const int dot, const int16_t *xi,
                                                           const float *d,
                                                           const float *xsum, int64_t K, int64_t groups, int64_t gs,
                                                           const int8_t *pt, const float *st, const float *ot,
                                                           float *res) {
    __m256 tot[I16_ROWS][2];
    for (int r = 0; r < mb; r++) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[I16_ROWS][2];
        for (int r = 0; r < mb; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        const int8_t *w = pt + g * gs * TILE;
        /* the weights PREFETCH_BYTES on, as the vector loop asks for them */
        for (int64_t c = 0; c < gs * TILE; c += 64) __builtin_prefetch(w + PREFETCH_BYTES + c, 0, 2);
        for (int64_t k = 0; k < gs; k += 2) {
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k * TILE)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k * TILE + 16)));
            for (int r = 0; r < mb; r++) {
                int32_t two;
                memcpy(&two, xi + r * K + g * gs + k, sizeof two);
                const __m256i xb = _mm256_set1_epi32(two);
                acc[r][0] = i16_madd_add(dot, acc[r][0], w0, xb);
                acc[r][1] = i16_madd_add(dot, acc[r][1], w1, xb);
            }
        }
        const __m256 s0 = _mm256_loadu_ps(st + g * TILE), s1 = _mm256_loadu_ps(st + g * TILE + 8);
        for (int r = 0; r < mb; r++) {
            const __m256 dr = _mm256_set1_ps(d[r * groups + g]);
            tot[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(s0, dr), tot[r][0]);
            tot[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(s1, dr), tot[r][1]);
        }
        if (ot) {
            const __m256 o0 = _mm256_loadu_ps(ot + g * TILE), o1 = _mm256_loadu_ps(ot + g * TILE + 8);
            for (int r = 0; r < mb; r++) {
                const __m256 sr = _mm256_set1_ps(xsum[r * groups + g]);
                tot[r][0] = _mm256_fmadd_ps(o0, sr, tot[r][0]);
                tot[r][1] = _mm256_fmadd_ps(o1, sr, tot[r][1]);
            }
        }
    }
    for (int r = 0; r < mb; r++) {
        _mm256_storeu_ps(res + r * TILE, tot[r][0]);
        _mm256_storeu_ps(res + r * TILE + 8, tot[r][1]);
    }
}

/* i16_rows for a block of `mb` rows with `dot` (a constant once inlined) as its products. */
static inline __attribute__((always_inline)) void i16_block(const int dot, int mb, const int16_t *xm,
                                                            const float *dm, const float *sm, int64_t K,
                                                            int64_t groups, int64_t gs, const int8_t *pt,
                                                            const float *st, const float *ot, float *res) {
    switch (mb) {
    case 1: i16_rows(1, dot, xm, dm, sm, K, groups, gs, pt, st, ot, res); break;
    case 2: i16_rows(2, dot, xm, dm, sm, K, groups, gs, pt, st, ot, res); break;
    case 3: i16_rows(3, dot, xm, dm, sm, K, groups, gs, pt, st, ot, res); break;
    default: i16_rows(I16_ROWS, dot, xm, dm, sm, K, groups, gs, pt, st, ot, res); break;
    }
}

/* group_linear's I16 paths (pairs: the weight in the layout above; dot: I16 or a VNNI
 * form the caller found on the CPU): the inputs quantized per row (threads take rows), then
 * each tile multiplied by every row block. Returns 0, or -1 where its scratch cannot be
 * allocated. */
static int i16_linear(const void *x, int32_t x_bf16, int64_t ldx, int64_t M, int64_t K, const int8_t *pairs,
                      const float *scale, const float *offset, int64_t N, int64_t gs, const float *bias,
                      const void *residual, int64_t ldr, void *out, int64_t ldo, int32_t num_threads, int dot) {
    const int64_t groups = K / gs, tiles = N / TILE;
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    int16_t *xi = malloc(sizeof(int16_t) * (size_t)(M * K));
    float *d = malloc(sizeof(float) * (size_t)(M * groups * (offset ? 2 : 1)));
    if (!xi || !d) {
        free(xi);
        free(d);
        return -1;
    }
    float *xsum = offset ? d + M * groups : NULL;
#pragma omp parallel num_threads(num_threads) if (tiles > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            i16_quantize_row((const char *)x + (size_t)(m * ldx) * elem, x_bf16, K, gs, xi + m * K, d + m * groups,
                             xsum ? xsum + m * groups : NULL);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            float res[I16_ROWS * TILE];
            const int8_t *pt = pairs + t * K * TILE;
            const float *st = scale + t * groups * TILE, *ot = offset ? offset + t * groups * TILE : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += I16_ROWS) {
                const int mb = M - m0 < I16_ROWS ? (int)(M - m0) : I16_ROWS;
                const int16_t *xm = xi + m0 * K;
                const float *dm = d + m0 * groups, *sm = xsum ? xsum + m0 * groups : NULL;
#ifdef HAVE_I16_VNNI
                if (dot == I16_AVX_VNNI)
                    i16_block(I16_AVX_VNNI, mb, xm, dm, sm, K, groups, gs, pt, st, ot, res);
                else if (dot == I16_AVX512_VNNI)
                    i16_block(I16_AVX512_VNNI, mb, xm, dm, sm, K, groups, gs, pt, st, ot, res);
                else
#endif
                    i16_block(I16, mb, xm, dm, sm, K, groups, gs, pt, st, ot, res);
                store_rows(res, mb, m0, t, x_bf16, bias, residual, ldr, out, ldo);
            }
        }
    }
    free(xi);
    free(d);
    return 0;
}
#endif

/* VNNI: AVX512-VNNI's vpdpbusd for CPUs with it but without AMX (Zen 4 class), where four
 * int8 products a lane per instruction are twice AVX512-BF16's pairs. The inputs are
 * rounded to int8 per row and group (as llama.cpp rounds its activations to Q8, here per
 * group of the weight's gs rather than per 256): d = max |x| / 127, xi = round(x / d), each
 * within d / 2 of x. The weights' values get + 128 (unsigned, vpdpbusd's first operand), so
 * each group's int32 sum starts at -128 x sum_k xi, which takes that back out:
 *   out[m, n] = sum_g scale[n, g] d[m, g] sum_k q[n, k] xi[m, k] + offset[n, g] sum_k x[m, k]
 * (the offsets take the inputs' own float32 sums, as the other paths). A sum of 32 products
 * is at most 32 x 255 x 127 in magnitude: int32 never overflows, and float32 holds it
 * exactly. Each tile's values are transposed once into quads (four k of a column in one
 * 32-bit lane), then every block of VNNI_ROWS rows reads them from L1 / L2. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(HAVE_I16)
#define HAVE_VNNI 1
#define VNNI 7      /* group_linear's amx: this path */
#define VNNI_ROWS 8 /* rows per register block: 8 sums and 8 totals of AVX-512's 32 registers */

/* 16 inputs from p (bf16 or float32) as float32. */
static inline __m512 vnni_load16(const void *p, int32_t x_bf16, int64_t i) {
    if (x_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* One row of K inputs quantized per group of gs: xi (int8), the step d, start (-128 times
 * the group's sum of xi: where its int32 sum begins) and, where xsum is not NULL, the
 * group's float32 sum. Groups of whole 16s rounded a vector at a time. */
static void vnni_quantize_row(const void *x, int32_t x_bf16, int64_t K, int64_t gs, int8_t *xi, float *d,
                              int32_t *start, float *xsum) {
    for (int64_t g = 0; g < K / gs; g++) {
        const int64_t k0 = g * gs;
        const float inv = group_step(x, x_bf16, k0, gs, 127.0f, d + g, xsum ? xsum + g : NULL);
        /* summed modulo 2^32: a non-finite input's lanes convert to INT_MIN, whose sums may
         * wrap (its group's step is NaN whatever they hold); finite ones sum exactly */
        uint32_t total = 0;
        int64_t k = 0;
        if (gs % 16 == 0)
            for (; k < gs; k += 16) {
                /* rounded to nearest even (the default rounding mode); within [-127, 127] */
                const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(vnni_load16(x, x_bf16, k0 + k), _mm512_set1_ps(inv)));
                _mm_storeu_si128((__m128i *)(xi + k0 + k), _mm512_cvtsepi32_epi8(i));
                total += (uint32_t)_mm512_reduce_add_epi32(i);
            }
        for (; k < gs; k++) {
            const int32_t i = _mm_cvtss_si32(_mm_set_ss(load_any(x, x_bf16, k0 + k) * inv));
            xi[k0 + k] = (int8_t)(i < -127 ? -127 : i > 127 ? 127 : i);
            total += (uint32_t)i;
        }
        start[g] = (int32_t)(0u - 128u * total);
    }
}

/* One tile's values [K][TILE] as quads [K / 4][TILE][4] plus 128 (as uint8): four k of a
 * column side by side, one 64-byte line per four k. */
static void vnni_quads(const int8_t *vt, int64_t K, uint8_t *quads) {
#if defined(__AVX512VBMI__)
    /* one vpermb a line where the CPU has AVX512-VBMI: byte 4c + j of the quads is byte
     * 16j + c of the tiles */
    uint8_t order[64];
    for (int c = 0; c < TILE; c++)
        for (int j = 0; j < 4; j++) order[4 * c + j] = (uint8_t)(16 * j + c);
    const __m512i index = _mm512_loadu_si512((const void *)order), flip512 = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < K; k += 4)
        _mm512_store_si512((void *)(quads + k * TILE),
                           _mm512_xor_si512(_mm512_permutexvar_epi8(index, _mm512_loadu_si512((const void *)(vt + k * TILE))),
                                            flip512));
    return;
#endif
    const __m128i flip = _mm_set1_epi8((char)0x80); /* + 128 modulo 256: int8 to its uint8 */
    for (int64_t k = 0; k < K; k += 4) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(vt + k * TILE));
        const __m128i b = _mm_loadu_si128((const __m128i *)(vt + (k + 1) * TILE));
        const __m128i c = _mm_loadu_si128((const __m128i *)(vt + (k + 2) * TILE));
        const __m128i e = _mm_loadu_si128((const __m128i *)(vt + (k + 3) * TILE));
        const __m128i ab_lo = _mm_unpacklo_epi8(a, b), ab_hi = _mm_unpackhi_epi8(a, b);
        const __m128i ce_lo = _mm_unpacklo_epi8(c, e), ce_hi = _mm_unpackhi_epi8(c, e);
        __m128i *out = (__m128i *)(quads + k * TILE);
        _mm_store_si128(out, _mm_xor_si128(_mm_unpacklo_epi16(ab_lo, ce_lo), flip));     /* columns 0-3 */
        _mm_store_si128(out + 1, _mm_xor_si128(_mm_unpackhi_epi16(ab_lo, ce_lo), flip)); /* 4-7 */
        _mm_store_si128(out + 2, _mm_xor_si128(_mm_unpacklo_epi16(ab_hi, ce_hi), flip)); /* 8-11 */
        _mm_store_si128(out + 3, _mm_xor_si128(_mm_unpackhi_epi16(ab_hi, ce_hi), flip)); /* 12-15 */
    }
}

/* `mb` (a constant once inlined) rows of quantized inputs (xi rows K apart; d, start and
 * xsum rows `groups` apart) times one tile's quads into res [mb][TILE]. Where next is not
 * NULL (the first row block of a tile that has a successor), the next tile's values, one
 * line per four k, and its scales and offsets, one line per group, are asked into L2 as the
 * products run: without it a tile's values were read only once its products were done,
 * so the weights' reads and the products took turns (8-16 rows ran ~1.5x longer;
 * benchmarks/results/group_int8_kernels.md, "VNNI prefetch"). */
static inline __attribute__((always_inline)) void vnni_rows(const int mb, const int8_t *xi, const float *d,
                                                            const int32_t *start, const float *xsum, int64_t K,
                                                            int64_t groups, int64_t gs, const uint8_t *quads,
                                                            const float *st, const float *ot, float *res,
                                                            const int8_t *next) {
    __m512 tot[VNNI_ROWS];
    for (int r = 0; r < mb; r++) tot[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[VNNI_ROWS];
        for (int r = 0; r < mb; r++) acc[r] = _mm512_set1_epi32(start[r * groups + g]);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 4) {
            const __m512i w = _mm512_load_si512((const void *)(quads + k * TILE));
            if (next) _mm_prefetch((const char *)(next + k * TILE), _MM_HINT_T1);
            for (int r = 0; r < mb; r++) {
                int32_t four;
                memcpy(&four, xi + r * K + k, sizeof four);
                acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(four));
            }
        }
        const __m512 scale = _mm512_loadu_ps(st + g * TILE);
        if (next) {
            _mm_prefetch((const char *)(st + (groups + g) * TILE), _MM_HINT_T1);
            if (ot) _mm_prefetch((const char *)(ot + (groups + g) * TILE), _MM_HINT_T1);
        }
        for (int r = 0; r < mb; r++)
            tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(scale, _mm512_set1_ps(d[r * groups + g])),
                                     tot[r]);
        if (ot) {
            const __m512 offset = _mm512_loadu_ps(ot + g * TILE);
            for (int r = 0; r < mb; r++) tot[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[r * groups + g]), tot[r]);
        }
    }
    for (int r = 0; r < mb; r++) _mm512_storeu_ps(res + r * TILE, tot[r]);
}

/* group_linear's VNNI path (values in tiles, K and gs multiples of 4): the inputs
 * quantized per row (threads take rows), then each tile's quads multiplied by every row
 * block. Returns 0, or -1 where its scratch cannot be allocated. */
static int vnni_linear(const void *x, int32_t x_bf16, int64_t ldx, int64_t M, int64_t K, const int8_t *values,
                       const float *scale, const float *offset, int64_t N, int64_t gs, const float *bias,
                       const void *residual, int64_t ldr, void *out, int64_t ldo, int32_t num_threads) {
    const int64_t groups = K / gs, tiles = N / TILE;
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    int8_t *xi = malloc((size_t)(M * K));
    float *d = malloc(sizeof(float) * (size_t)(M * groups * (offset ? 2 : 1)));
    int32_t *start = malloc(sizeof(int32_t) * (size_t)(M * groups));
    if (!xi || !d || !start) {
        free(xi);
        free(d);
        free(start);
        return -1;
    }
    float *xsum = offset ? d + M * groups : NULL;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (tiles > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            vnni_quantize_row((const char *)x + (size_t)(m * ldx) * elem, x_bf16, K, gs, xi + m * K, d + m * groups,
                              start + m * groups, xsum ? xsum + m * groups : NULL);
        uint8_t *quads = aligned_alloc(64, (size_t)(K * TILE));
        if (!quads) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!quads) continue;
            float res[VNNI_ROWS * TILE] __attribute__((aligned(64)));
            const float *st = scale + t * groups * TILE, *ot = offset ? offset + t * groups * TILE : NULL;
            vnni_quads(values + t * K * TILE, K, quads);
            for (int64_t m0 = 0; m0 < M; m0 += VNNI_ROWS) {
                const int8_t *next = m0 == 0 && t + 1 < tiles ? values + (t + 1) * K * TILE : NULL;
                const int mb = M - m0 < VNNI_ROWS ? (int)(M - m0) : VNNI_ROWS;
                const int8_t *xm = xi + m0 * K;
                const float *dm = d + m0 * groups, *sm = xsum ? xsum + m0 * groups : NULL;
                const int32_t *bm = start + m0 * groups;
#define ROW_BLOCK_CALL(n) vnni_rows(n, xm, dm, bm, sm, K, groups, gs, quads, st, ot, res, next)
                switch (mb) { ROW_BLOCK_CASES(VNNI_ROWS) }
#undef ROW_BLOCK_CALL
                store_rows(res, mb, m0, t, x_bf16, bias, residual, ldr, out, ldo);
            }
        }
        free(quads);
    }
    free(xi);
    free(d);
    free(start);
    return failed ? -1 : 0;
}
#endif

/* x: [M, K] bf16 (x_bf16) or float32, rows ldx elements apart; values, scale, offset (or
 * NULL): the tiled layout above, N a multiple of TILE, K of gs, gs even; bias: float32 [N]
 * or NULL; residual: [M, N] in x's dtype, rows ldr apart, or NULL; out: [M, N] in x's
 * dtype, rows ldo apart; amx: the path (0 the vector loop, AMX_EXACT, AMX_FOLDED,
 * DPBF16, I16, VNNI; the caller checks the CPU has it, and gives I16 its own layout,
 * the pairs); narrow: every value is in [-64, 63] (the exact AMX and
 * DPBF16 paths then expand them faster, expand_pairs). Returns 0, or -1 where its scratch
 * cannot be allocated. */
int group_linear(const void *x, int32_t x_bf16, int64_t ldx, int64_t M, int64_t K, const int8_t *values,
                 const float *scale, const float *offset, int64_t N, int64_t gs, const float *bias,
                 const void *residual, int64_t ldr, void *out, int64_t ldo, int32_t num_threads, int32_t amx,
                 int32_t narrow) {
    const int64_t groups = K / gs, tiles = N / TILE;
#ifdef HAVE_I16
    if (amx == I16 || amx == I16_AVX_VNNI || amx == I16_AVX512_VNNI)
        return i16_linear(x, x_bf16, ldx, M, K, values, scale, offset, N, gs, bias, residual, ldr, out, ldo,
                          num_threads, amx);
#endif
#ifdef HAVE_VNNI
    if (amx == VNNI)
        return vnni_linear(x, x_bf16, ldx, M, K, values, scale, offset, N, gs, bias, residual, ldr, out, ldo,
                           num_threads);
#endif
#ifdef HAVE_X86_TARGETS
    if (amx && x_bf16) {
        const int64_t padded = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
        uint16_t *xpad = calloc((size_t)(padded * K), sizeof(uint16_t));
        float *xsum = calloc((size_t)(padded * groups), sizeof(float));
        int failed = !xpad || !xsum;
        if (!failed) {
            for (int64_t m = 0; m < M; m++) {
                const uint16_t *row = (const uint16_t *)x + m * ldx;
                memcpy(xpad + m * K, row, (size_t)K * sizeof(uint16_t));
                if ((offset || narrow) && amx != AMX_FOLDED) group_sums(row, groups, gs, xsum + m * groups);
            }
#pragma omp parallel num_threads(num_threads) if (tiles > 1)
            {
                /* the folded path takes two tiles at a time: room for both */
                uint16_t *pairs = aligned_alloc(64, (size_t)(2 * K * TILE) * sizeof(uint16_t));
                float *res = aligned_alloc(64, (size_t)(2 * padded * TILE) * sizeof(float));
                if (!pairs || !res) {
#pragma omp atomic write
                    failed = 1;
                } else if (amx != DPBF16) {
                    amx_configure(amx == AMX_FOLDED ? 32 : gs);
                }
                const int64_t step = amx == AMX_FOLDED ? 2 : 1, units = (tiles + step - 1) / step;
#pragma omp for schedule(static)
                for (int64_t u = 0; u < units; u++) {
                    if (!pairs || !res) continue;
                    const int64_t t = u * step;
                    if (amx == AMX_FOLDED) {
                        /* a last tile without a neighbour is multiplied twice, stored once */
                        const int64_t t1 = t + 1 < tiles ? t + 1 : t;
                        uint16_t *pairs1 = pairs + K * TILE;
                        float *res1 = res + padded * TILE;
                        for (int64_t tt = t, i = 0; i < 2; tt = t1, i++)
                            expand_weights(values + tt * K * TILE, scale + tt * groups * TILE,
                                           offset ? offset + tt * groups * TILE : NULL, K, gs, pairs + i * K * TILE);
                        const int64_t after = t + 2 < tiles ? t + 2 : -1;  /* the next unit of a static schedule */
                        amx_tiles_folded(xpad, padded, K, pairs, pairs1, res, res1,
                                         after < 0 ? NULL : values + after * K * TILE,
                                         (after + 2 <= tiles ? 2 : 1) * K * TILE);
                        store_rows(res, M, 0, t, x_bf16, bias, residual, ldr, out, ldo);
                        if (t1 != t) store_rows(res1, M, 0, t1, x_bf16, bias, residual, ldr, out, ldo);
                    } else if (amx == DPBF16) {
                        dp_tile(xpad, M, K, groups, gs, values + t * K * TILE, scale + t * groups * TILE,
                                offset ? offset + t * groups * TILE : NULL, xsum, pairs, res, narrow);
                        store_rows(res, M, 0, t, x_bf16, bias, residual, ldr, out, ldo);
                    } else {
                        amx_tile(xpad, xsum, padded, K, groups, gs, values + t * K * TILE, scale + t * groups * TILE,
                                 offset ? offset + t * groups * TILE : NULL, pairs, res, narrow);
                        store_rows(res, M, 0, t, x_bf16, bias, residual, ldr, out, ldo);
                    }
                }
                if (pairs && res && amx != DPBF16) amx_release();
                free(pairs);
                free(res);
            }
        }
        free(xpad);
        free(xsum);
        return failed ? -1 : 0;
    }
#endif
    float *xf = malloc(sizeof(float) * (size_t)(M * K + (offset ? M * groups : 0)));
    if (!xf) return -1;
    float *xsum = xf + M * K;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = load_any(x, x_bf16, m * ldx + k);
        if (offset)
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) s += xf[m * K + k];
                xsum[m * groups + g] = s;
            }
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int8_t *vt = values + t * K * TILE;
        const float *st = scale + t * groups * TILE;
        const float *ot = offset ? offset + t * groups * TILE : NULL;
        float res[ROW_BLOCK * TILE];
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int mb = M - m0 < ROW_BLOCK ? (int)(M - m0) : ROW_BLOCK;
            const float *xm = xf + m0 * K, *sm = xsum + m0 * groups;
            switch (mb) {
            case 1: tile_rows(1, xm, sm, K, groups, gs, vt, st, ot, res); break;
            case 2: tile_rows(2, xm, sm, K, groups, gs, vt, st, ot, res); break;
            case 3: tile_rows(3, xm, sm, K, groups, gs, vt, st, ot, res); break;
            default: tile_rows(ROW_BLOCK, xm, sm, K, groups, gs, vt, st, ot, res); break;
            }
            store_rows(res, mb, m0, t, x_bf16, bias, residual, ldr, out, ldo);
        }
    }
    free(xf);
    return 0;
}

/* The weight (values times scale, plus offset) rounded to bf16, transposed: out [K][N]
 * (each tile's TILE values of one k land side by side). For large steps, whose products
 * a GEMM library then takes at its own speed. */
void group_expand(const int8_t *values, const float *scale, const float *offset, int64_t N, int64_t K, int64_t gs,
                  uint16_t *out, int32_t num_threads) {
    const int64_t groups = K / gs, tiles = N / TILE;
    /* Rows of out EXPAND_ROWS at a time, each written front to back: a tile's values for those
     * k are one cache line, and the writes stream instead of filling each line piecewise. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (K > EXPAND_ROWS)
    for (int64_t k0 = 0; k0 < K; k0 += EXPAND_ROWS) {
        const int64_t rows = K - k0 < EXPAND_ROWS ? K - k0 : EXPAND_ROWS;
        for (int64_t t = 0; t < tiles; t++) {
            const int8_t *vt = values + t * K * TILE;
            for (int64_t k = k0; k < k0 + rows; k++) {
                const int64_t g = k / gs;
                for (int v = 0; v < NV; v++) {
                    const vf s = load_f32(scale + (t * groups + g) * TILE + v * LANES);
                    const vf o = offset ? load_f32(offset + (t * groups + g) * TILE + v * LANES) : splat(0.0f);
                    store_bf16(out + k * N + t * TILE + v * LANES, round_bf16(load_i8(vt + k * TILE + v * LANES) * s + o));
                }
            }
        }
    }
}

/* 1 where this build has the DPBF16 path (the CPU's avx512_bf16 then says whether it runs). */
int group_linear_has_dpbf16(void) {
#ifdef HAVE_X86_TARGETS
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build has the AMX path (group_linear_amx_ready then says whether it runs). */
int group_linear_has_amx(void) {
#ifdef HAVE_X86_TARGETS
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build has the I16 path's vpdpwssd forms (the CPU's flags then say which runs). */
int group_linear_has_i16_vnni(void) {
#ifdef HAVE_I16_VNNI
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build has the I16 path (an AVX2 build: every x86-64 CPU it runs on has it). */
int group_linear_has_i16(void) {
#ifdef HAVE_I16
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build has the VNNI path (an AVX512-VNNI build: the CPU has it). */
int group_linear_has_vnni(void) {
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}
