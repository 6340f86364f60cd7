/* int8 x int8 products on AMX's integer tiles (models/layers/int8_amx.py packs the weight
 * and calls this), for weights quantized per output row and activations per input row:
 *   out[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n] * row_scale[m]   (x, w: int8; sums in int32)
 * The int32 sums are exact, each is converted to float32 once, multiplied by its weight
 * row's scale, then (where given) by its input row's: torch._int_mm(x, w^T) * scale *
 * row_scale with the same two roundings in the same order, bit for bit
 * (int8.plain_matmul), whatever the order of the sums. The input row's scale is applied
 * here because a pass of its own over the output cost more than the products at 64 rows.
 * int8_amx_argmax_chunks gives each row's largest output and the first column holding it
 * without writing the outputs (greedy decoding's output head: at 64 rows the logits it would
 * write and read back are 64 MB a step). int8_amx_span_logits writes the outputs and
 * summarises each span of SPAN of them while they are in L1 (sampling's output head,
 * models/layers/span_logits.py), instead of a second pass reading them back.
 *
 * Why a kernel of its own: a decode step multiplies a few rows by a large weight (the
 * output head: 168 MB of int8 for Gemma 3's vocabulary), so its time is the weight's bytes.
 * Here a step streams each weight byte once, in the order it is stored, while AMX's tile
 * products (16 x 16 sums of 64 products each per instruction) keep up with 64 rows.
 *
 * Layout: the weight in tiles of TILE output rows, each [KB][16][64] for KB = K / 64
 * blocks of k: in a block, row r holds for each of the TILE columns c the four weights
 * k = 64 kb + 4 r .. + 3 (AMX's B operand, which pairs four consecutive k per column).
 * K and N are padded to 64 and TILE with zero weights (int8_amx.py).
 * OpenMP spreads the tiles over torch's threads; each thread configures its tiles once
 * per call and gives them back at the end. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16    /* output columns per weight tile; also AMX's rows per tile */
#define K_BLOCK 64 /* int8 k per tile row (64 bytes) */
#define ROW_TILES 4 /* input row tiles (64 rows) sharing each loaded weight tile */
/* From this many rows the outputs bypass the caches (streaming stores): a head chunk's
 * logits are then larger than L2 and would only evict the weight stream, and writing them
 * without reading their lines first saves a third of the traffic (the sampled head at 64
 * rows: 27 -> 23 ms a step, benchmarks/results/int8_kernels.md). */
#define STREAM_MIN_ROWS 32
/* The same for span logits from this many rows: their [rows, vocabulary] float32 (16 MB at
 * 16 rows of Gemma 3's) are far larger than L2, and the sampler reads only a few spans of
 * each row back, so stores through the caches only evict the weight stream (the sampled
 * head at 8 and 16 rows: benchmarks/results/int8_kernels.md). A matmul's output
 * (STREAM_MIN_ROWS) is read whole by the next op, which finds it in the caches below 32 rows. */
#define SPAN_STREAM_MIN_ROWS 16
/* From this many rows the reductions of a weight tile's outputs (the argmax; a span's
 * summaries, 64 rows x SPAN exponentials) take long enough to hide the next tile (span)
 * coming into L2, prefetched meanwhile; with fewer rows the hardware prefetchers keep up
 * and the extra instructions only cost (benchmarks/results/int8_kernels.md). */
#define PREFETCH_MIN_ROWS 32

#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11) && defined(__AVX512F__)
#define HAVE_AMX_INT8 1
#include <immintrin.h>
#include "amx_tiles.h"
#include "span_summary.h"

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))
/* 1 where Linux lets this process use AMX's tile data (asked for once), else 0. */
int int8_amx_ready(void) { return amx_request_tiles(); }

/* Tiles 0-3: four row tiles' int32 sums (16 x 16); 4, 6, 7: inputs (16 rows x 64 int8);
 * 5: one block of the weight tile (16 rows of 64 bytes). */
AMX_TARGET static void configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = TILE;
        cfg.colsb[t] = K_BLOCK;
    }
    amx_load_config(&cfg);
}

/* One weight tile against rows m0 .. m0 + 16 * row_tiles of the padded input: the sums. */
AMX_TARGET static void tile_sums(const int8_t *xpad, int64_t K, int64_t m0, int row_tiles, const int8_t *wt,
                                 int32_t sums[ROW_TILES][TILE * TILE]) {
    const int8_t *x0 = xpad + m0 * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += K_BLOCK) {
        _tile_loadd(5, wt + k * TILE, K_BLOCK);
        _tile_loadd(4, x0 + k, K);
        _tile_dpbssd(0, 4, 5);
        if (row_tiles > 1) {
            _tile_loadd(6, x0 + 16 * K + k, K);
            _tile_dpbssd(1, 6, 5);
        }
        if (row_tiles > 2) {
            _tile_loadd(7, x0 + 32 * K + k, K);
            _tile_dpbssd(2, 7, 5);
        }
        if (row_tiles > 3) {
            _tile_loadd(4, x0 + 48 * K + k, K);
            _tile_dpbssd(3, 4, 5);
        }
    }
    _tile_stored(0, sums[0], TILE * 4);
    if (row_tiles > 1) _tile_stored(1, sums[1], TILE * 4);
    if (row_tiles > 2) _tile_stored(2, sums[2], TILE * 4);
    if (row_tiles > 3) _tile_stored(3, sums[3], TILE * 4);
}

AMX_TARGET static void release_tiles(void) { _tile_release(); }

/* Ask for `bytes` from p in L2 (the next weight tile, while this one's outputs are reduced). */
static inline void prefetch_l2(const int8_t *p, int64_t bytes) {
    for (int64_t q = 0; q < bytes; q += 64) _mm_prefetch((const char *)p + q, _MM_HINT_T1);
}

/* out[m, t * TILE + c] = sums * scale (* row_scale[m]) for the rows of this block and the
 * columns < N. */
AMX_TARGET static void store_tile(int32_t sums[ROW_TILES][TILE * TILE], int64_t rows, int64_t m0, int64_t t,
                                  const float *scale, const float *row_scale, int64_t N, float *out, int64_t ldo,
                                  int stream) {
    const int64_t n0 = t * TILE, cols = N - n0 < TILE ? N - n0 : TILE;
    const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
    const __m512 s = _mm512_maskz_loadu_ps(keep, scale + n0);
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[r / TILE] + (r % TILE) * TILE)), s);
        if (row_scale) v = _mm512_mul_ps(v, _mm512_set1_ps(row_scale[m0 + r]));
        float *dst = out + (m0 + r) * ldo + n0;
        if (stream && cols == TILE && !((uintptr_t)dst & 63))
            _mm512_stream_ps(dst, v);
        else
            _mm512_mask_storeu_ps(dst, keep, v);
    }
}

/* For the rows of this block: each lane's largest output so far (lane_max[m][c], over the
 * columns n = c mod TILE seen) and its column (lane_at: `column` + n, the column in the
 * whole product of a weight that is one chunk of it). A later column replaces the kept
 * one only when larger, so among equal values each lane keeps its first. */
AMX_TARGET static void argmax_tile(int32_t sums[ROW_TILES][TILE * TILE], int64_t rows, int64_t m0, int64_t t,
                                   int64_t column, const float *scale, const float *row_scale, int64_t N,
                                   float *lane_max, int32_t *lane_at) {
    const int64_t n0 = t * TILE, cols = N - n0 < TILE ? N - n0 : TILE;
    const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
    const __m512 s = _mm512_maskz_loadu_ps(keep, scale + n0);
    const __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(column + n0)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[r / TILE] + (r % TILE) * TILE)), s);
        if (row_scale) v = _mm512_mul_ps(v, _mm512_set1_ps(row_scale[m0 + r]));
        float *best = lane_max + (m0 + r) * TILE;
        int32_t *where = lane_at + (m0 + r) * TILE;
        const __mmask16 larger = _mm512_mask_cmp_ps_mask(keep, v, _mm512_load_ps(best), _CMP_GT_OQ);
        _mm512_mask_store_ps(best, larger, v);
        _mm512_mask_store_epi32(where, larger, at);
    }
}

/* One thread's lanes -> per row (largest, first column holding it), merged into best/index:
 * a larger value wins, an equal one the smaller column. */
static void merge_lanes(const float *lane_max, const int32_t *lane_at, int64_t M, float *best, int64_t *index) {
    for (int64_t m = 0; m < M; m++)
        for (int c = 0; c < TILE; c++) {
            const float v = lane_max[m * TILE + c];
            const int64_t n = lane_at[m * TILE + c];
            if (n < 0) continue; /* a lane that saw no column */
            if (index[m] < 0 || v > best[m] || (v == best[m] && n < index[m])) {
                best[m] = v;
                index[m] = n;
            }
        }
}

/* x's M rows copied K apart and followed by zero rows up to `padded` (whole row tiles, which
 * the tile loads read), 64-byte aligned; NULL where it cannot be allocated. */
static int8_t *padded_rows(const int8_t *x, int64_t ldx, int64_t M, int64_t K, int64_t padded) {
    int8_t *xpad = aligned_alloc(64, (size_t)(padded * K));
    if (!xpad) return NULL;
    for (int64_t m = 0; m < M; m++) memcpy(xpad + m * K, x + m * ldx, (size_t)K);
    memset(xpad + M * K, 0, (size_t)((padded - M) * K));
    return xpad;
}

/* x: [M, K] int8, rows ldx apart; w: the tiled layout above ([N padded / TILE] tiles, K a
 * multiple of K_BLOCK); scale: float32 [N padded]; row_scale: float32 [M] or NULL; out:
 * float32 [M, N], rows ldo apart.
 * Returns 0, -1 where its scratch cannot be allocated, -2 for a K that is not whole blocks. */
int int8_amx_matmul(const int8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const float *scale,
                    const float *row_scale, int64_t N, float *out, int64_t ldo, int32_t num_threads) {
    if (K % K_BLOCK) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int64_t padded = (M + TILE - 1) / TILE * TILE, tiles = (N + TILE - 1) / TILE;
    int8_t *xpad = padded_rows(x, ldx, M, K, padded);
    if (!xpad) return -1;
#pragma omp parallel num_threads(num_threads) if (tiles > 1)
    {
        int32_t sums[ROW_TILES][TILE * TILE] __attribute__((aligned(64)));
        configure();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int8_t *wt = w + t * K * TILE;
            for (int64_t m0 = 0; m0 < M; m0 += ROW_TILES * TILE) {
                const int64_t rows = M - m0 < ROW_TILES * TILE ? M - m0 : ROW_TILES * TILE;
                tile_sums(xpad, K, m0, (int)((rows + TILE - 1) / TILE), wt, sums);
                if (M >= PREFETCH_MIN_ROWS && t + 1 < tiles) prefetch_l2(wt + K * TILE, K * TILE);
                store_tile(sums, rows, m0, t, scale, row_scale, N, out, ldo, M >= STREAM_MIN_ROWS);
            }
        }
        _mm_sfence();
        release_tiles();
    }
    free(xpad);
    return 0;
}

/* The weight tile holding global tile t of int8_amx_argmax_chunks' chunks (first_tile[c]:
 * chunk c's first tile; chunk c's columns start at first_column[c]): its tiles, its scale,
 * its column count and where its columns start. */
typedef struct {
    const int8_t *w;
    const float *scale;
    int64_t n, local, column;
} chunk_tile;

static inline chunk_tile tile_of(int64_t t, int64_t chunks, const int64_t *first_tile, const int8_t *const *w,
                                 const float *const *scale, const int64_t *N, const int64_t *first_column, int64_t K) {
    int64_t c = 0;
    while (c + 1 < chunks && first_tile[c + 1] <= t) c++;
    const int64_t local = t - first_tile[c];
    return (chunk_tile){w[c] + local * K * TILE, scale[c], N[c], local, first_column[c]};
}

/* As int8_amx_matmul over `chunks` weights side by side (chunk c: w[c], scale[c], N[c]
 * columns, which are columns first_column[c] .. of the whole product), but instead of
 * out: best[m] = the largest output of row m and index[m] = the first whole-product
 * column holding it (float32 [M], int64 [M]); the chunks' columns must be in increasing
 * order. One call for the whole of a head split into chunks: its tiles are shared out
 * among the threads as one sequence (no thread waits at the end of each chunk), and the
 * input is copied once. Returns as int8_amx_matmul (-2 also for columns past int32). */
int int8_amx_argmax_chunks(const int8_t *x, int64_t ldx, int64_t M, int64_t K, int64_t chunks,
                           const int8_t *const *w, const float *const *scale, const int64_t *N,
                           const int64_t *first_column, const float *row_scale, float *best, int64_t *index,
                           int32_t num_threads) {
    if (K % K_BLOCK) return -2;
    if (M <= 0) return 0;
    for (int64_t m = 0; m < M; m++) index[m] = -1;
    int64_t first_tile[chunks + 1];
    first_tile[0] = 0;
    for (int64_t c = 0; c < chunks; c++) first_tile[c + 1] = first_tile[c] + (N[c] + TILE - 1) / TILE;
    const int64_t tiles = first_tile[chunks];
    if (tiles <= 0) return 0;
    if (first_column[chunks - 1] + N[chunks - 1] > INT32_MAX) return -2; /* lane_at's columns are int32 */
    const int64_t padded = (M + TILE - 1) / TILE * TILE;
    int8_t *xpad = padded_rows(x, ldx, M, K, padded);
    if (!xpad) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (tiles > 1)
    {
        int32_t sums[ROW_TILES][TILE * TILE] __attribute__((aligned(64)));
        float *lane_max = aligned_alloc(64, (size_t)(M * TILE) * sizeof(float));
        int32_t *lane_at = aligned_alloc(64, (size_t)(M * TILE) * sizeof(int32_t));
        if (!lane_max || !lane_at) {
#pragma omp atomic write
            failed = 1;
        } else {
            for (int64_t i = 0; i < M * TILE; i++) {
                lane_max[i] = -__builtin_inff();
                lane_at[i] = -1;
            }
            configure();
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!lane_max || !lane_at) continue;
            const chunk_tile at = tile_of(t, chunks, first_tile, w, scale, N, first_column, K);
            const int8_t *next = M >= PREFETCH_MIN_ROWS && t + 1 < tiles
                                     ? tile_of(t + 1, chunks, first_tile, w, scale, N, first_column, K).w
                                     : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += ROW_TILES * TILE) {
                const int64_t rows = M - m0 < ROW_TILES * TILE ? M - m0 : ROW_TILES * TILE;
                tile_sums(xpad, K, m0, (int)((rows + TILE - 1) / TILE), at.w, sums);
                if (next) prefetch_l2(next, K * TILE);
                argmax_tile(sums, rows, m0, at.local, at.column, at.scale, row_scale, at.n, lane_max, lane_at);
            }
        }
        if (lane_max && lane_at) {
            release_tiles();
#pragma omp critical
            merge_lanes(lane_max, lane_at, M, best, index);
        }
        free(lane_max);
        free(lane_at);
    }
    free(xpad);
    return failed ? -1 : 0;
}

/* As int8_amx_matmul for N whole spans (N % SPAN == 0), and besides, each span's summary
 * of the stored outputs at its row's inverse temperature inv_t[m] (span_summary.h's
 * summarise_spans, as span_summaries.c computes it): peak and mass [M, N / SPAN],
 * contiguous. With out NULL only the summaries are made (a sampler that reads a span or
 * two of each row computes them again with int8_amx_fill_span). Returns as
 * int8_amx_matmul (-2 also for N not whole spans). */
int int8_amx_span_logits(const int8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const float *scale,
                         const float *row_scale, int64_t N, float *out, int64_t ldo, const float *inv_t,
                         float exp_floor, float *peak, float *mass, int32_t num_threads) {
    if (K % K_BLOCK || N % SPAN) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int64_t padded = (M + TILE - 1) / TILE * TILE, spans = N / SPAN;
    int8_t *xpad = padded_rows(x, ldx, M, K, padded);
    if (!xpad) return -1;
    const int stream = M >= SPAN_STREAM_MIN_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (spans > 1)
    {
        int32_t sums[ROW_TILES][TILE * TILE] __attribute__((aligned(64)));
        /* a row block's outputs of one span: 64 rows x SPAN float32, 32 KB, in L1 */
        float *block = aligned_alloc(64, (size_t)(ROW_TILES * TILE * SPAN) * sizeof(float));
        if (!block) {
#pragma omp atomic write
            failed = 1;
        } else {
            configure();
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < spans; j++) {
            if (!block) continue;
            for (int64_t m0 = 0; m0 < M; m0 += ROW_TILES * TILE) {
                const int64_t rows = M - m0 < ROW_TILES * TILE ? M - m0 : ROW_TILES * TILE;
                for (int64_t i = 0; i < SPAN / TILE; i++) {
                    const int64_t t = j * (SPAN / TILE) + i;
                    tile_sums(xpad, K, m0, (int)((rows + TILE - 1) / TILE), w + t * K * TILE, sums);
                    const __m512 s = _mm512_loadu_ps(scale + t * TILE);
                    for (int64_t r = 0; r < rows; r++) {
                        __m512 v = _mm512_mul_ps(
                            _mm512_cvtepi32_ps(_mm512_load_si512(sums[r / TILE] + (r % TILE) * TILE)), s);
                        if (row_scale) v = _mm512_mul_ps(v, _mm512_set1_ps(row_scale[m0 + r]));
                        _mm512_store_ps(block + r * SPAN + i * TILE, v);
                    }
                }
                /* the next span's weights, a share of them before each row's summary */
                const int64_t span_bytes = (SPAN / TILE) * K * TILE;
                const int ahead = j + 1 < spans && M >= PREFETCH_MIN_ROWS;
                const int8_t *next = ahead ? w + (j + 1) * span_bytes : w;
                const int64_t share = (span_bytes / rows + 63) / 64 * 64;
                for (int64_t r0 = 0; r0 < rows; r0 += GROUP) {
                    const int64_t count = rows - r0 < GROUP ? rows - r0 : GROUP;
                    for (int64_t r = r0; r < r0 + count; r++)
                        if (ahead && r * share < span_bytes)
                            prefetch_l2(next + r * share, span_bytes - r * share < share ? span_bytes - r * share : share);
                    /* GROUP rows' spans side by side (their exponentials interleaved); a
                     * constant count lets the whole group's loops unroll */
                    float *first = block + r0 * SPAN, *pk = peak + (m0 + r0) * spans + j, *ms = mass + (m0 + r0) * spans + j;
                    if (count == GROUP)
                        summarise_spans(first, GROUP, 0, 1.0f, inv_t + m0 + r0, 1, exp_floor, pk, ms, spans);
                    else
                        summarise_spans(first, (int)count, 0, 1.0f, inv_t + m0 + r0, 1, exp_floor, pk, ms, spans);
                    if (!out) continue; /* summaries only: int8_amx_fill_span gives a span again */
                    for (int64_t r = r0; r < r0 + count; r++) {
                        float *dst = out + (m0 + r) * ldo + j * SPAN;
                        const int aligned = !((uintptr_t)dst & 63);
                        for (int i = 0; i < SPAN; i += TILE) {
                            const __m512 v = _mm512_load_ps(block + r * SPAN + i);
                            if (stream && aligned)
                                _mm512_stream_ps(dst + i, v);
                            else
                                _mm512_storeu_ps(dst + i, v);
                        }
                    }
                }
            }
        }
        _mm_sfence();
        if (block) release_tiles();
        free(block);
    }
    free(xpad);
    return failed ? -1 : 0;
}

/* Where a sampler finds a head's logits that were summarised but not stored: the
 * activations as the kernel took them (x: rows ldx apart, K of them, padded to whole
 * blocks; row_scale [M] or NULL) and the head's chunks, chunk c holding spans
 * first_span[c] .. first_span[c + 1] - 1 in its tiles w[c] with their scales scale[c]. */
typedef struct {
    const int8_t *x;
    int64_t ldx, K;
    const float *row_scale;
    int64_t chunks;
    const int8_t *const *w;
    const float *const *scale;
    const int64_t *first_span;
} SpanSource;

/* out[0 .. SPAN - 1] = span `span` of row `row` of the product int8_amx_span_logits stores
 * there, bit for bit: the same exact int32 sums (here AVX512-VNNI's u8 x s8 dot products
 * of x + 128, less 128 times each column's weight sum), converted and scaled in the same
 * two roundings. One row's span reads its 128 weight rows (80 KB at Gemma 3's width). */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void int8_amx_fill_span(const void *source, int64_t row, int64_t span, float *out) {
    const SpanSource *src = source;
    int64_t c = 0;
    while (span >= src->first_span[c + 1]) c++;
    const int64_t K = src->K, blocks = K / K_BLOCK;
    const int8_t *x = src->x + row * src->ldx;
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    for (int64_t i = 0; i < SPAN / TILE; i++) {
        const int64_t t = (span - src->first_span[c]) * (SPAN / TILE) + i;
        const int8_t *wt = src->w[c] + t * K * TILE;
        __m512i shifted = _mm512_setzero_si512(), column_sum = _mm512_setzero_si512();
        for (int64_t kb = 0; kb < blocks; kb++)
            for (int r = 0; r < K_BLOCK / 4; r++) {
                /* tile row r of block kb: for each of the TILE columns, the weights of
                 * k = 64 kb + 4 r .. + 3 (int8_amx.py's layout) */
                const __m512i w4 = _mm512_loadu_si512(wt + (kb * (K_BLOCK / 4) + r) * 64);
                int32_t quad;
                memcpy(&quad, x + kb * K_BLOCK + 4 * r, sizeof quad);
                const __m512i x4 = _mm512_xor_si512(_mm512_set1_epi32(quad), flip); /* x + 128 as u8 */
                shifted = _mm512_dpbusd_epi32(shifted, x4, w4);
                column_sum = _mm512_dpbusd_epi32(column_sum, ones, w4);
            }
        const __m512i sums = _mm512_sub_epi32(shifted, _mm512_slli_epi32(column_sum, 7));
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_loadu_ps(src->scale[c] + t * TILE));
        if (src->row_scale) v = _mm512_mul_ps(v, _mm512_set1_ps(src->row_scale[row]));
        _mm512_storeu_ps(out + i * TILE, v);
    }
}

int int8_amx_built(void) { return 1; }
#else
int int8_amx_ready(void) { return 0; }

int int8_amx_matmul(const int8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const float *scale,
                    const float *row_scale, int64_t N, float *out, int64_t ldo, int32_t num_threads) {
    (void)x, (void)ldx, (void)M, (void)K, (void)w, (void)scale, (void)row_scale, (void)N, (void)out, (void)ldo;
    (void)num_threads;
    return -3; /* not built here: int8_amx.py never calls it then */
}

int int8_amx_argmax_chunks(const int8_t *x, int64_t ldx, int64_t M, int64_t K, int64_t chunks,
                           const int8_t *const *w, const float *const *scale, const int64_t *N,
                           const int64_t *first_column, const float *row_scale, float *best, int64_t *index,
                           int32_t num_threads) {
    (void)x, (void)ldx, (void)M, (void)K, (void)chunks, (void)w, (void)scale, (void)N, (void)first_column;
    (void)row_scale, (void)best, (void)index, (void)num_threads;
    return -3;
}

int int8_amx_span_logits(const int8_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *w, const float *scale,
                         const float *row_scale, int64_t N, float *out, int64_t ldo, const float *inv_t,
                         float exp_floor, float *peak, float *mass, int32_t num_threads) {
    (void)x, (void)ldx, (void)M, (void)K, (void)w, (void)scale, (void)row_scale, (void)N, (void)out, (void)ldo;
    (void)inv_t, (void)exp_floor, (void)peak, (void)mass, (void)num_threads;
    return -3;
}

void int8_amx_fill_span(const void *source, int64_t row, int64_t span, float *out) {
    (void)source, (void)row, (void)span, (void)out; /* never called: int8_amx_built() is 0 */
}

int int8_amx_built(void) { return 0; }
#endif
