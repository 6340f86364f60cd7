/* The int8 x int8 product of models/layers/int8_quads.py (its docstring says where it
 * serves and why): uint8 activations (whole levels + 128, quantize_rows_uint8's) times int8
 * weight rows, the exact int32 sums scaled by each weight row's float32 scale.
 *
 * Layout ("quads"): the weight [N, K] as [N / TILE][K / 4][TILE][4] int8, four consecutive k
 * of a column side by side, so one 64-byte line holds four k of a tile's sixteen columns.
 * The activations' +128 adds 128 x (the column's sum of weights) to each sum, taken out by
 * starting the accumulator at -128 x that sum (colsum, made when the weight is packed).
 *
 * Two instruction sets, one layout and one result:
 * - AVX512-VNNI: vpdpbusd multiplies a line by four broadcast activations and adds each
 *   column's four u8 x s8 products straight into its int32 sum, so weights keep all 127
 *   levels (quads_levels). Each sum is at most K x 127 x 127 in magnitude, exact in float32
 *   up to K = 1,040 (2^24 / 16,129).
 * - AVX2: vpmaddubsw multiplies 32 bytes by the broadcast activations and adds each pair
 *   into int16 (exact: a pair is at most 2 x 255 x 63 = 32,130, within int16, which is why
 *   the weights have 63 levels there: int8.gemm_weight_levels); vpmaddwd by ones adds the
 *   two pairs of a column into int32 and vpaddd accumulates. Each sum is at most
 *   K x 127 x 63, exact in float32 up to K = 2,096.
 * Either way the float32 result is float(sum) x scale[n] rounded once, as torch._int_mm's
 * product times the scale gives.
 *
 * Threads take tiles of TILE columns; a tile's weights (K x TILE bytes, 10 KB at K = 640)
 * stay in L1 while every block of ROWS rows reads them, and the first block asks for the
 * next tiles' weights into L2 as it goes (`next`), so the reads overlap the products. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "span_summary.h"

#define TILE 16 /* columns per tile (int8_quads.py's TILE) */

int quads_tile(void) { return TILE; }

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define ROWS 8              /* rows per register block: 16 accumulators of AVX-512's 32 registers */
#define PREFETCH_BYTES 1024 /* how far ahead of the loads the weights are asked for */

int quads_available(void) { return 1; }
int quads_levels(void) { return 127; }

/* `mb` rows (a constant once inlined) of x (rows ldx apart) times `nt` (1 or 2, a constant)
 * consecutive tiles' quads from wt (tiles K x TILE bytes apart) into out (rows ldo apart, the
 * first tile's first column). Two tiles a step use each broadcast activation twice, so a
 * batch's products are not bound by the broadcasts; a lone tile (one row, or an odd tile
 * count's last) splits its quads between two accumulators instead, so a row's sums are not
 * one chain of dependent vpdpbusd. */
static inline __attribute__((always_inline)) void quads_rows(const int mb, const int nt, const uint8_t *x,
                                                             int64_t ldx, int64_t K, const int8_t *wt,
                                                             const int32_t *colsum, const float *scale, float *out,
                                                             int64_t ldo, const int8_t *next) {
    const __m512i minus128 = _mm512_set1_epi32(-128);
    const int8_t *wt1 = wt + K * TILE;
    __m512i acc[ROWS][2];
    for (int r = 0; r < mb; r++) {
        acc[r][0] = _mm512_mullo_epi32(_mm512_loadu_si512(colsum), minus128);
        acc[r][1] = nt == 2 ? _mm512_mullo_epi32(_mm512_loadu_si512(colsum + TILE), minus128) : _mm512_setzero_si512();
    }
    const int64_t quads = K / 4;
    if (nt == 2) {
        for (int64_t q = 0; q < quads; q++) {
            const int8_t *w = wt + q * 4 * TILE, *v = wt1 + q * 4 * TILE;
            __builtin_prefetch(w + PREFETCH_BYTES, 0, 0);
            __builtin_prefetch(v + PREFETCH_BYTES, 0, 0);
            if (next) {
                _mm_prefetch((const char *)(next + q * 4 * TILE), _MM_HINT_T1);
                _mm_prefetch((const char *)(next + (K + q * 4) * TILE), _MM_HINT_T1);
            }
            const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(v);
            for (int r = 0; r < mb; r++) {
                int32_t four;
                memcpy(&four, x + r * ldx + q * 4, sizeof four);
                const __m512i xb = _mm512_set1_epi32(four);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
            }
        }
    } else {
        int64_t q = 0;
        for (; q + 2 <= quads; q += 2) {
            const int8_t *w = wt + q * 4 * TILE;
            __builtin_prefetch(w + PREFETCH_BYTES, 0, 0);
            __builtin_prefetch(w + PREFETCH_BYTES + 64, 0, 0);
            const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 4 * TILE);
            for (int r = 0; r < mb; r++) {
                int32_t four[2];
                memcpy(four, x + r * ldx + q * 4, sizeof four);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], _mm512_set1_epi32(four[0]), w0);
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], _mm512_set1_epi32(four[1]), w1);
            }
        }
        if (q < quads) { /* an odd number of quads: the last one */
            const __m512i w0 = _mm512_loadu_si512(wt + q * 4 * TILE);
            for (int r = 0; r < mb; r++) {
                int32_t four;
                memcpy(&four, x + r * ldx + q * 4, sizeof four);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], _mm512_set1_epi32(four), w0);
            }
        }
        for (int r = 0; r < mb; r++) {
            acc[r][0] = _mm512_add_epi32(acc[r][0], acc[r][1]);
        }
    }
    const __m512 s0 = _mm512_loadu_ps(scale);
    for (int r = 0; r < mb; r++) {
        _mm512_storeu_ps(out + r * ldo, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][0]), s0));
    }
    if (nt == 2) {
        const __m512 s1 = _mm512_loadu_ps(scale + TILE);
        for (int r = 0; r < mb; r++) {
            _mm512_storeu_ps(out + r * ldo + TILE, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][1]), s1));
        }
    }
}

/* From this many rows each step's first row block asks for the next step's tiles into L2
 * as its products run: without it the weights were read only once a step's products were
 * done (benchmarks/results/head_chunks.md, "next tiles prefetched"). */
#define PREFETCH_NEXT_MIN_ROWS 1
#define TILES_A_STEP 2 /* tiles each step of quads_matmul's loop takes (a last odd one alone) */
#define ROW_CASES(nt, xm, om)                                                                                    \
    case 1: quads_rows(1, nt, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                         \
    case 2: quads_rows(2, nt, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                         \
    case 3: quads_rows(3, nt, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                         \
    case 4: quads_rows(4, nt, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                         \
    case 5: quads_rows(5, nt, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                         \
    case 6: quads_rows(6, nt, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                         \
    case 7: quads_rows(7, nt, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                         \
    default: quads_rows(ROWS, nt, xm, ldx, K, wt, ct, st, om, ldo, next); break;

#elif defined(__AVX2__)
#include <immintrin.h>

#define ROWS 4            /* rows per register block: 8 accumulators of AVX2's 16 registers */
#define PREFETCH_BYTES 1024 /* how far ahead of the loads the weights are asked for */

int quads_available(void) { return 1; }
int quads_levels(void) { return 63; }

/* `mb` rows (a constant once inlined) of x (rows ldx apart) times one tile's quads (wt) into
 * out (rows ldo apart, the tile's first column). */
static inline __attribute__((always_inline)) void quads_rows(const int mb, const uint8_t *x, int64_t ldx,
                                                             int64_t K, const int8_t *wt, const int32_t *colsum,
                                                             const float *scale, float *out, int64_t ldo,
                                                             const int8_t *next) {
    const __m256i ones = _mm256_set1_epi16(1), minus128 = _mm256_set1_epi32(-128);
    const __m256i start0 = _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)colsum), minus128);
    const __m256i start1 = _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(colsum + 8)), minus128);
    __m256i acc[ROWS][2];
    for (int r = 0; r < mb; r++) {
        acc[r][0] = start0;
        acc[r][1] = start1;
    }
    for (int64_t q = 0; q < K / 4; q++) {
        const int8_t *w = wt + q * 4 * TILE;
        __builtin_prefetch(w + PREFETCH_BYTES, 0, 0);
        if (next) _mm_prefetch((const char *)(next + q * 4 * TILE), _MM_HINT_T1);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
        for (int r = 0; r < mb; r++) {
            int32_t four;
            memcpy(&four, x + r * ldx + q * 4, sizeof four);
            const __m256i xb = _mm256_set1_epi32(four);
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w0), ones));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w1), ones));
        }
    }
    const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
    for (int r = 0; r < mb; r++) {
        _mm256_storeu_ps(out + r * ldo, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][0]), s0));
        _mm256_storeu_ps(out + r * ldo + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][1]), s1));
    }
}

/* As above; on AVX2 it was measured only in an AVX2 build on a Zen 4 host, where one row
 * gained nothing and batches 5-10%: so batches only. */
#define PREFETCH_NEXT_MIN_ROWS (ROWS + 1)
#define TILES_A_STEP 1
#define ROW_CASES(nt, xm, om)                                                                                    \
    case 1: quads_rows(1, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                             \
    case 2: quads_rows(2, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                             \
    case 3: quads_rows(3, xm, ldx, K, wt, ct, st, om, ldo, next); break;                                             \
    default: quads_rows(ROWS, xm, ldx, K, wt, ct, st, om, ldo, next); break;

#endif

#ifdef ROWS /* one of the kernels above is built */
/* Row block m0 of step t (TILES_A_STEP tiles from tile t, or the last odd tile alone) into
 * om (rows ldo apart, the step's first column); the first block asks for the next step's
 * tiles into L2 meanwhile. */
static inline void step_block(const uint8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w,
                              const int32_t *colsum, const float *scale, int64_t tiles, int64_t t, int64_t m0,
                              float *om, int64_t ldo) {
    const int8_t *wt = w + t * K * TILE;
    const int32_t *ct = colsum + t * TILE;
    const float *st = scale + t * TILE;
    const int whole = t + TILES_A_STEP <= tiles; /* else the last odd tile, alone */
    const int ahead = m0 == 0 && M >= PREFETCH_NEXT_MIN_ROWS && t + TILES_A_STEP < tiles;
    const int8_t *next = ahead ? wt + TILES_A_STEP * K * TILE : NULL;
    const uint8_t *xm = x + m0 * ldx;
    const int64_t mb = M - m0 < ROWS ? M - m0 : ROWS;
    if (whole) {
        switch (mb) { ROW_CASES(TILES_A_STEP, xm, om) }
    } else {
        switch (mb) { ROW_CASES(1, xm, om) }
    }
}

/* x: uint8 [M, K] (levels + 128), rows ldx apart; w: the quads layout above, N a multiple
 * of TILE, K of 4; colsum: int32 [N], each column's sum of weights; scale: float32 [N];
 * out: float32 [M, N], rows ldo apart. */
void quads_matmul(const uint8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const int32_t *colsum,
                  const float *scale, int64_t N, float *out, int64_t ldo, int32_t num_threads) {
    const int64_t tiles = N / TILE, steps = (tiles + TILES_A_STEP - 1) / TILES_A_STEP;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (steps > 1)
    for (int64_t u = 0; u < steps; u++)
        for (int64_t m0 = 0; m0 < M; m0 += ROWS)
            step_block(x, ldx, M, K, w, colsum, scale, tiles, u * TILES_A_STEP, m0,
                       out + m0 * ldo + u * TILES_A_STEP * TILE, ldo);
}

/* Greedy's reduction's lanes: one register of columns side by side (16 with AVX-512, 8 with
 * AVX2: with vectors of two AVX2 registers the reduction cost as much again as the product
 * it reduces, benchmarks/results/head_chunks.md). */
#ifdef __AVX512F__
#define ARGMAX_LANES 16
#else
#define ARGMAX_LANES 8
#endif
typedef float lanes_f __attribute__((vector_size(ARGMAX_LANES * 4)));
typedef int32_t lanes_i __attribute__((vector_size(ARGMAX_LANES * 4)));

/* Greedy's reduction fused into the product (chunk_argmax.c's, without the logits): for
 * each row m, the largest out[m][n] * row_scale[m] over the N columns, out as quads_matmul
 * computes it and the row scale's multiply rounded as chunk_argmax.c's, and the first
 * column holding it, plus `start`, into best and index [M]. Each step's products go to a
 * buffer of one row block that stays in L1, instead of [M, N] logits through memory. Every
 * row_scale must be finite (the caller checks): the products are then finite, with no NaN
 * to order. As chunk_argmax.c, each row keeps lanes of ARGMAX_LANES columns, each lane its
 * maximum and the first column holding it (it moves only on a strictly greater product).
 * Threads take contiguous runs of steps in thread order (a static schedule); at the end
 * each thread's lanes give its run's first maximum (the largest lane, the first column
 * among equals), and the runs are merged in order, the first column among equals winning.
 * Returns 0, or -1 where its scratch cannot be allocated. */
int quads_argmax(const uint8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const int32_t *colsum,
                 const float *scale, int64_t N, const float *row_scale, int64_t start, float *best, int64_t *index,
                 int32_t num_threads) {
    const int64_t tiles = N / TILE, steps = (tiles + TILES_A_STEP - 1) / TILES_A_STEP;
    const int teams = num_threads > 0 ? num_threads : 1;
    float *run_best = malloc(sizeof(float) * (size_t)(teams * M));
    int64_t *run_index = malloc(sizeof(int64_t) * (size_t)(teams * M));
    lanes_f *lane_max = aligned_alloc(64, sizeof(lanes_f) * (size_t)(teams * M));
    lanes_i *lane_at = aligned_alloc(64, sizeof(lanes_i) * (size_t)(teams * M));
    if (!run_best || !run_index || !lane_max || !lane_at) {
        free(run_best);
        free(run_index);
        free(lane_max);
        free(lane_at);
        return -1;
    }
    lanes_i iota;
    for (int k = 0; k < ARGMAX_LANES; k++) iota[k] = k;
    for (int64_t i = 0; i < teams * M; i++) run_best[i] = -INFINITY, run_index[i] = 0; /* threads not started */
#pragma omp parallel num_threads(teams) if (steps > 1)
    {
        const int me = omp_get_thread_num();
        lanes_f *my_max = lane_max + me * M;
        lanes_i *my_at = lane_at + me * M;
        for (int64_t m = 0; m < M; m++) {
            for (int k = 0; k < ARGMAX_LANES; k++) my_max[m][k] = -INFINITY;
            my_at[m] = iota;
        }
        enum { WIDTH = TILES_A_STEP * TILE };
        float buf[ROWS * WIDTH] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t u = 0; u < steps; u++) {
            const int64_t t = u * TILES_A_STEP;
            const int64_t cols = (t + TILES_A_STEP <= tiles ? TILES_A_STEP : tiles - t) * TILE;
            for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
                step_block(x, ldx, M, K, w, colsum, scale, tiles, t, m0, buf, WIDTH);
                const int64_t mb = M - m0 < ROWS ? M - m0 : ROWS;
                for (int64_t r = 0; r < mb; r++) {
                    lanes_f top = my_max[m0 + r];
                    lanes_i at = my_at[m0 + r];
                    const float s = row_scale[m0 + r];
                    for (int64_t c = 0; c < cols; c += ARGMAX_LANES) {
                        lanes_f v;
                        memcpy(&v, buf + r * WIDTH + c, sizeof v);
                        v *= s;
                        const lanes_i greater = v > top;
                        top = (lanes_f)(((lanes_i)v & greater) | ((lanes_i)top & ~greater));
                        at = ((iota + (int32_t)(t * TILE + c)) & greater) | (at & ~greater);
                    }
                    my_max[m0 + r] = top;
                    my_at[m0 + r] = at;
                }
            }
        }
        for (int64_t m = 0; m < M; m++) { /* this thread's run: the largest lane, the first column among equals */
            float peak = my_max[m][0];
            int64_t first = my_at[m][0];
            for (int k = 1; k < ARGMAX_LANES; k++)
                if (my_max[m][k] > peak || (my_max[m][k] == peak && my_at[m][k] < first))
                    peak = my_max[m][k], first = my_at[m][k];
            run_best[me * M + m] = peak;
            run_index[me * M + m] = first;
        }
    }
    for (int64_t m = 0; m < M; m++) {
        float top = -INFINITY;
        int64_t at = 0;
        for (int th = 0; th < teams; th++)
            if (run_best[th * M + m] > top) top = run_best[th * M + m], at = run_index[th * M + m];
        best[m] = top;
        index[m] = start + at;
    }
    free(run_best);
    free(run_index);
    free(lane_max);
    free(lane_at);
    return 0;
}
/* One span's SPAN floats from src (64-byte aligned) to dst: streamed past the caches where
 * dst is aligned too (the logits buffer's rows), so its lines are not first read from
 * memory only to be overwritten (a step's logits are written once, and the draw reads a
 * few spans of them). */
static inline void store_span(float *dst, const float *src) {
    if ((uintptr_t)dst % 64) {
        memcpy(dst, src, SPAN * sizeof *dst);
        return;
    }
#ifdef __AVX512F__
    for (int c = 0; c < SPAN; c += 16) _mm512_stream_ps(dst + c, _mm512_load_ps(src + c));
#else
    for (int c = 0; c < SPAN; c += 8) _mm256_stream_ps(dst + c, _mm256_load_ps(src + c));
#endif
}

/* Each of `count` rows' span of products at `first` (rows ld apart) times its row's scale,
 * as the eager multiply rounds it, side by side into side (count x SPAN), and where out is
 * set into out (rows ldo apart). Not inlined: the products are scaled and stored before the
 * summaries read them, so no multiply is fused into the summaries' arithmetic
 * (span_summaries.c's order). */
static __attribute__((noinline)) void scale_rows(const float *first, int64_t ld, int64_t count,
                                                 const float *row_scale, float *side, float *out, int64_t ldo) {
    for (int64_t r = 0; r < count; r++) {
        const float *p = first + r * ld;
        const float s = row_scale[r];
        for (int c = 0; c < SPAN; c++) side[r * SPAN + c] = p[c] * s;
        if (out) store_span(out + r * ldo, side + r * SPAN);
    }
}

/* Sampling's span logits (models/layers/span_logits.py) from the product: quads_matmul's
 * products of N whole spans (N % SPAN == 0), each multiplied by its row's scale row_scale[m]
 * and stored into out (rows ldo apart), and each span's summary at its row's inverse
 * temperature inv_t[m] (span_summary.h's summarise_spans) into peak and mass [M, N / SPAN],
 * contiguous: span_summaries.c's scale_and_summarise of quads_matmul's output, bit for bit,
 * without reading [M, N] float32 back from memory (64 MB a step at 64 rows of Gemma 3's
 * vocabulary). Threads take spans (contiguous runs, a static schedule); a span's products
 * go to a scratch of the thread's own (M x SPAN floats) a step at a time as quads_matmul
 * writes them, then, still in cache, each GROUP rows' spans are scaled, streamed to out
 * (store_span) and summarised side by side. With out NULL the summaries alone: nothing is
 * written to memory but the summaries; quads_fill_span computes a span again, bit for bit.
 * Returns 0, -1 where the scratch cannot be allocated, or -2 where N is not whole spans. */
int quads_span_logits(const uint8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const int32_t *colsum,
                      const float *scale, int64_t N, const float *row_scale, const float *inv_t, float exp_floor,
                      float *out, int64_t ldo, float *peak, float *mass, int32_t num_threads) {
    if (N % SPAN) return -2;
    const int64_t tiles = N / TILE, spans = N / SPAN;
    enum { STEPS_A_SPAN = SPAN / TILE / TILES_A_STEP };
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (spans > 1)
    {
        float side[GROUP * SPAN] __attribute__((aligned(64)));
        float *scratch = aligned_alloc(64, sizeof(float) * (size_t)(M * SPAN));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < spans; j++) {
            if (!scratch) continue;
            for (int64_t u = 0; u < STEPS_A_SPAN; u++)
                for (int64_t m0 = 0; m0 < M; m0 += ROWS)
                    step_block(x, ldx, M, K, w, colsum, scale, tiles, j * (SPAN / TILE) + u * TILES_A_STEP, m0,
                               scratch + m0 * SPAN + u * TILES_A_STEP * TILE, SPAN);
            for (int64_t r0 = 0; r0 < M; r0 += GROUP) {
                const int64_t count = M - r0 < GROUP ? M - r0 : GROUP;
                scale_rows(scratch + r0 * SPAN, SPAN, count, row_scale + r0, side,
                           out ? out + r0 * ldo + j * SPAN : NULL, ldo);
                float *pk = peak + r0 * spans + j, *ms = mass + r0 * spans + j;
                if (count == GROUP) /* a constant count: the call unrolls (span_summary.h) */
                    summarise_spans(side, GROUP, 0, 1.0f, inv_t + r0, 1, exp_floor, pk, ms, spans);
                else
                    summarise_spans(side, (int)count, 0, 1.0f, inv_t + r0, 1, exp_floor, pk, ms, spans);
            }
        }
        _mm_sfence(); /* the streamed logits are in memory before the caller reads them */
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* What quads_fill_span reads: quads_span_logits' operands (N whole spans). */
typedef struct {
    const uint8_t *x;
    int64_t ldx, K;
    const int8_t *w;
    const int32_t *colsum;
    const float *scale;
    int64_t N;
    const float *row_scale;
} QuadsSpans;

/* Span `span` of row `row` of the logits quads_span_logits computes from `source` (a
 * QuadsSpans), into out[0 .. SPAN - 1]: the same products (exact int32 sums, whichever
 * register block computes them) times the row's scale, rounded as scale_rows rounds
 * them: the values it stores, bit for bit (logit_pieces.h's SpanFill). */
void quads_fill_span(const void *source, int64_t row, int64_t span, float *out) {
    const QuadsSpans *s = source;
    enum { STEPS_A_SPAN = SPAN / TILE / TILES_A_STEP };
    for (int64_t u = 0; u < STEPS_A_SPAN; u++)
        step_block(s->x + row * s->ldx, s->ldx, 1, s->K, s->w, s->colsum, s->scale, s->N / TILE,
                   span * (SPAN / TILE) + u * TILES_A_STEP, 0, out + u * TILES_A_STEP * TILE, SPAN);
    const float r = s->row_scale[row];
    for (int c = 0; c < SPAN; c++) out[c] = out[c] * r;
}
#else
int quads_available(void) { return 0; }
int quads_levels(void) { return 0; }

int quads_span_logits(const uint8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const int32_t *colsum,
                      const float *scale, int64_t N, const float *row_scale, const float *inv_t, float exp_floor,
                      float *out, int64_t ldo, float *peak, float *mass, int32_t num_threads) {
    (void)x, (void)ldx, (void)M, (void)K, (void)w, (void)colsum, (void)scale, (void)N, (void)row_scale;
    (void)inv_t, (void)exp_floor, (void)out, (void)ldo, (void)peak, (void)mass, (void)num_threads;
    abort(); /* as quads_matmul */
}

void quads_fill_span(const void *source, int64_t row, int64_t span, float *out) {
    (void)source, (void)row, (void)span, (void)out;
    abort(); /* as quads_matmul */
}

void quads_matmul(const uint8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const int32_t *colsum,
                  const float *scale, int64_t N, float *out, int64_t ldo, int32_t num_threads) {
    (void)x, (void)ldx, (void)M, (void)K, (void)w, (void)colsum, (void)scale, (void)N, (void)out, (void)ldo;
    (void)num_threads;
    abort(); /* int8_quads.py never calls it where quads_available() is 0 */
}

int quads_argmax(const uint8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const int32_t *colsum,
                 const float *scale, int64_t N, const float *row_scale, int64_t start, float *best, int64_t *index,
                 int32_t num_threads) {
    (void)x, (void)ldx, (void)M, (void)K, (void)w, (void)colsum, (void)scale, (void)N, (void)row_scale;
    (void)start, (void)best, (void)index, (void)num_threads;
    abort(); /* as quads_matmul */
}
#endif
