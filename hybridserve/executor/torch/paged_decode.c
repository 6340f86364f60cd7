/* Decode attention read from the paged KV cache in place (executor/torch/attention.py says
 * what the cache holds; paged_decode.py calls this).
 *
 * One query token per request attends to the contiguous key positions first .. first +
 * count - 1 of its gathered blocks (a window's or a chunk's lower bound, up to itself).
 * The general path copies those blocks into a contiguous tensor per layer (index_select),
 * then calls SDPA on the copy with a mask: the keys cross memory three times. Here each
 * (request, kv head) reads its keys and values once, straight from their blocks, with an
 * online softmax (flash attention's running maximum and sum), so nothing is copied and
 * masked positions are never read.
 *
 * Arithmetic: float32 throughout (bf16 keys and values widened exactly), the scale folded
 * into the query, optional soft-capping tanh(s / cap) * cap of the scores, the softmax's
 * exponentials a vector at a time (span_summary.h's exp, below float32 rounding; each
 * score's exponent floored at -87, where a term is ~1e-38 of the sum's first), and optional
 * per-head sinks (a learned logit that joins the softmax's denominator only: the running
 * maximum starts at it, with a sum of one). The output is rounded once to the query's
 * dtype (round to nearest even, as torch converts); a float32 query may read a bf16 cache
 * (a float32 model whose K/V are kept in bf16).
 *
 * Memory: a layer's keys are not in cache when its step reads them, and a request's blocks
 * lie anywhere in the pool, so each key's rows are asked for into L2 well ahead of its
 * scoring and its key row into L1 shortly before (a run's first rows as it starts). bf16 rows are read as pairs of elements
 * (attend_pairs: one shift and one mask widen them) where the head size allows.
 *
 * Written with GCC / Clang vector extensions, as span_summaries.c: the compiler flags pick
 * the instructions. OpenMP spreads the (request, kv head) pairs over torch's threads. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "native_vectors.h"
#include "span_summary.h"

/* Keys scored before each update of the running maximum: enough to amortise the rescale
 * of the accumulators, few enough for their scores to stay in L1. */
#define KEY_TILE 32
/* How many tokens ahead of the one scored its rows are asked for: its key and value rows
 * into L2 well ahead (a request's blocks lie anywhere, so the hardware's stream prefetchers
 * lose the thread at each block and each 4 KB page), then its key row alone into L1 just
 * before it is scored. Asking for the value rows into L1 as well, or for either row into
 * L1 from further ahead, evicts the tile's value rows before the value pass reads them:
 * benchmarks/results/paged_decode.md has the variants' times. */
#define PREFETCH_AHEAD 2
#define PREFETCH_L2_AHEAD 16
/* Query heads of one kv head accumulated at once (a larger group is taken in parts). */
#define HEADS 4

/* x in every lane, as one broadcast (splat's x + 0 keeps an add: it turns -0 into +0). */
static inline __attribute__((always_inline)) vf broadcast(const float *x) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(*x);
#else
    return splat(*x);
#endif
}

/* Element i of a row of keys, values or queries, bf16 or float32. */
static inline __attribute__((always_inline)) vf load_row(const void *base, int64_t i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)base + i) : load_f32((const float *)base + i);
}

static inline __attribute__((always_inline)) float load_one(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Where one request's keys lie: token `pos` of its run is slot pos % block_size of block
 * ids[pos / block_size]. Walked one token at a time as a (block, slot) cursor, so no key
 * costs a division. */
typedef struct {
    const char *cache;
    const int64_t *ids;
    int64_t block_bytes, token_bytes, value_bytes, row_bytes, block_size;
} key_rows;

typedef struct {
    int64_t block, slot;
} cursor;

static inline __attribute__((always_inline)) cursor cursor_at(const key_rows *kr, int64_t pos) {
    return (cursor){pos / kr->block_size, pos % kr->block_size};
}

/* The key row under the cursor; the cursor then moves to the next token. */
static inline __attribute__((always_inline)) const char *next_row(const key_rows *kr, cursor *c) {
    const char *row = kr->cache + kr->ids[c->block] * kr->block_bytes + c->slot * kr->token_bytes;
    if (++c->slot == kr->block_size) c->slot = 0, c->block++;
    return row;
}

/* The key and value rows of the token under the cursor asked for (locality 3: L1, 2: L2). */
static inline __attribute__((always_inline)) void prefetch_token(const key_rows *kr, cursor *c, int l2) {
    const char *row = next_row(kr, c);
    for (int64_t b = 0; b < kr->row_bytes; b += 64) {
        if (l2) {
            __builtin_prefetch(row + b, 0, 2);
            __builtin_prefetch(row + kr->value_bytes + b, 0, 2);
        } else {
            __builtin_prefetch(row + b, 0, 3);
            __builtin_prefetch(row + kr->value_bytes + b, 0, 3);
        }
    }
}

/* A run's keys in order, with the cursors of the tokens PREFETCH_AHEAD and
 * PREFETCH_L2_AHEAD further on. */
typedef struct {
    cursor at, near, far;
} key_walk;

static inline __attribute__((always_inline)) key_walk walk_from(const key_rows *kr, int64_t first) {
    return (key_walk){cursor_at(kr, first), cursor_at(kr, first + PREFETCH_AHEAD),
                      cursor_at(kr, first + PREFETCH_L2_AHEAD)};
}

/* The rows of a run's first tokens, which key_row's look-ahead never asks for, asked for
 * as the run starts (before its queries are read), so the first keys do not wait for
 * memory one after another: all of each into L2, the first PREFETCH_AHEAD keys into L1. */
static inline __attribute__((always_inline)) void prefetch_start(const key_rows *kr, int64_t first, int64_t count) {
    cursor c = cursor_at(kr, first);
    const int64_t n = count < PREFETCH_L2_AHEAD ? count : PREFETCH_L2_AHEAD;
    for (int64_t t = 0; t < n; t++) prefetch_token(kr, &c, t >= PREFETCH_AHEAD);
}

/* The row of key t of a run of `count` (the one under walk->at), asking for the rows
 * further on: called as each key is scored, so the requests spread over the scoring
 * instead of queueing up at once. */
static inline __attribute__((always_inline)) const char *key_row(const key_rows *kr, key_walk *walk, int64_t t,
                                                                 int64_t count) {
    if (t + PREFETCH_L2_AHEAD < count) prefetch_token(kr, &walk->far, 1);
    if (t + PREFETCH_AHEAD < count) {
        const char *row = next_row(kr, &walk->near);
        for (int64_t b = 0; b < kr->row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
    }
    return next_row(kr, &walk->at);
}

/* Every head's running state empty: no keys yet. */
static inline __attribute__((always_inline)) void start_heads(int nh, int64_t d, float m[HEADS], float l[HEADS],
                                                              float acc[HEADS][d]) {
    for (int h = 0; h < nh; h++) {
        memset(acc[h], 0, sizeof(float) * d);
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
}

/* One tile's scores s[h][0 .. n) into the online softmax of heads 0 .. nh: the running
 * maximum m and sum l updated, the accumulators (acc[h], d values) rescaled where the
 * maximum grew, and s[h][j] replaced by exp(s - maximum), the weights of the value pass. */
static inline __attribute__((always_inline)) void softmax_tile(int nh, int n, int64_t d, float s[HEADS][KEY_TILE],
                                                               float m[HEADS], float l[HEADS], float acc[HEADS][d]) {
    for (int h = 0; h < nh; h++) {
        float top = m[h];
        for (int j = 0; j < n; j++) top = s[h][j] > top ? s[h][j] : top;
        /* top is finite: a tile holds at least one key */
        const float keep = m[h] == -INFINITY ? 0.0f : expf(m[h] - top);
        float sum = 0.0f;
        int j = 0;
        /* a vector of exponentials at a time: one libm expf per score was a third of a key's time */
        for (; j + LANES <= n; j += LANES) {
            vf e = exp_nonpositive(vmax(load_f32(&s[h][j]) - splat(top), splat(-87.0f)));
            store_f32(&s[h][j], e);
        }
        for (; j < n; j++) s[h][j] = expf(s[h][j] - top);
        for (j = 0; j < n; j++) sum += s[h][j];
        l[h] = l[h] * keep + sum;
        m[h] = top;
        if (keep != 1.0f)
            for (int64_t i = 0; i < d; i++) acc[h][i] *= keep;
    }
}

/* bf16 rows as pairs of elements: a 32-bit lane's low half is element 2i and its high half
 * element 2i + 1, so one shift and one mask widen 2 x LANES values to the even and the odd
 * ones (exactly), where load_bf16 takes a widening conversion per LANES values. */
#define PAIR_SPAN (2 * LANES)

static inline __attribute__((always_inline)) vu load_pairs(const void *p) {
    vu w;
    memcpy(&w, p, sizeof w);
    return w;
}

static inline __attribute__((always_inline)) vf even_of(vu w) { return (vf)(w << 16); }

static inline __attribute__((always_inline)) vf odd_of(vu w) { return (vf)(w & 0xffff0000u); }

/* Values c .. c + 2 * LANES of the tile's keys' value rows, weighted by s[h][j], added to
 * acc[h] (two accumulators per head: each a chain of n dependent adds, and 2 x nh chains
 * keep the FMA units busier than nh). pairs: bf16 rows read as pairs, acc kept split (the
 * even elements, then the odd ones); else elements c .. c + LANES and the next LANES. */
static inline __attribute__((always_inline)) void add_weighted_values(int nh, int n, int64_t d,
                                                                      const char *const *key, int64_t value_bytes,
                                                                      float s[HEADS][KEY_TILE], int64_t c,
                                                                      float acc[HEADS][d], int bf16, int pairs) {
    vf a[HEADS], b[HEADS];
    for (int h = 0; h < nh; h++) {
        a[h] = load_f32(&acc[h][c]);
        b[h] = load_f32(&acc[h][c + LANES]);
    }
    for (int j = 0; j < n; j++) {
        vf v, w;
        if (pairs) {
            const vu both = load_pairs(key[j] + value_bytes + c * 2);
            v = even_of(both);
            w = odd_of(both);
        } else {
            v = load_row(key[j] + value_bytes, c, bf16);
            w = load_row(key[j] + value_bytes, c + LANES, bf16);
        }
        for (int h = 0; h < nh; h++) {
            const vf p = broadcast(&s[h][j]);
            a[h] += p * v;
            b[h] += p * w;
        }
    }
    for (int h = 0; h < nh; h++) {
        store_f32(&acc[h][c], a[h]);
        store_f32(&acc[h][c + LANES], b[h]);
    }
}

static inline __attribute__((always_inline)) float capped(float score, float softcap) {
    return softcap > 0.0f ? tanhf(score / softcap) * softcap : score;
}

/* Heads h0 .. h0 + nh - 1 (nh <= HEADS) of one request, all reading one kv head, over its
 * keys first .. first + count - 1 (count may be 0): each head's running state, stored at
 * state + h * (d + 2) as the unnormalised output (d values), the maximum score and the sum
 * of exp(score - maximum). Any head size; keys and values float32 or bf16 (bf16 != 0,
 * widened one vector at a time), the query float32 or bf16 (q_bf16 != 0). */
static inline __attribute__((always_inline)) void attend(const char *q, int64_t q_head_stride, const key_rows kr,
                                                         int64_t first, int64_t count, int64_t d, float scale,
                                                         float softcap, int64_t h0, int nh, float *state, int bf16,
                                                         int q_bf16) {
    const int64_t full = d - d % LANES;
    float qf[HEADS][d], acc[HEADS][d];
    float m[HEADS], l[HEADS], s[HEADS][KEY_TILE];
    const char *key[KEY_TILE];
    prefetch_start(&kr, first, count);
    for (int h = 0; h < nh; h++) {
        const char *row = q + (h0 + h) * q_head_stride * (q_bf16 ? 2 : 4);
        for (int64_t i = 0; i < d; i++) qf[h][i] = load_one(row, i, q_bf16) * scale;
    }
    start_heads(nh, d, m, l, acc);
    key_walk walk = walk_from(&kr, first);
    for (int64_t t0 = 0; t0 < count; t0 += KEY_TILE) {
        const int n = count - t0 < KEY_TILE ? (int)(count - t0) : KEY_TILE;
        for (int j = 0; j < n; j++) {
            key[j] = key_row(&kr, &walk, t0 + j, count);
            vf dot[HEADS];
            for (int h = 0; h < nh; h++) dot[h] = splat(0.0f);
            for (int64_t i = 0; i < full; i += LANES) {
                const vf k = load_row(key[j], i, bf16);
                for (int h = 0; h < nh; h++) dot[h] += load_f32(&qf[h][i]) * k;
            }
            for (int h = 0; h < nh; h++) {
                float sc = lanes_sum(dot[h]);
                for (int64_t i = full; i < d; i++) sc += qf[h][i] * load_one(key[j], i, bf16);
                s[h][j] = capped(sc, softcap);
            }
        }
        softmax_tile(nh, n, d, s, m, l, acc);
        int64_t i = 0;
        for (; i + LANES < full; i += 2 * LANES) add_weighted_values(nh, n, d, key, kr.value_bytes, s, i, acc, bf16, 0);
        for (; i < full; i += LANES) {
            vf a[HEADS];
            for (int h = 0; h < nh; h++) a[h] = load_f32(&acc[h][i]);
            for (int j = 0; j < n; j++) {
                const vf v = load_row(key[j] + kr.value_bytes, i, bf16);
                for (int h = 0; h < nh; h++) a[h] += broadcast(&s[h][j]) * v;
            }
            for (int h = 0; h < nh; h++) store_f32(&acc[h][i], a[h]);
        }
        for (int64_t i = full; i < d; i++)
            for (int j = 0; j < n; j++) {
                const float v = load_one(key[j] + kr.value_bytes, i, bf16);
                for (int h = 0; h < nh; h++) acc[h][i] += s[h][j] * v;
            }
    }
    for (int h = 0; h < nh; h++) {
        memcpy(state + h * (d + 2), acc[h], sizeof(float) * d);
        state[h * (d + 2) + d] = m[h];
        state[h * (d + 2) + d + 1] = l[h];
    }
}

/* The lane sums of four vectors (out[h] = the sum of d[h]'s lanes). */
static inline __attribute__((always_inline)) void sums_of_four(const vf d[4], float out[4]) {
#if LANES == 16
#if defined(__clang__)
#define SHUFFLE2(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
#else
#define SHUFFLE2(a, b, ...) __builtin_shuffle((a), (b), (vu){__VA_ARGS__})
#endif
    /* halves of two vectors added side by side, then quarters, then within each quarter:
     * 16 operations where four lanes_sum take 32 */
    const vf t01 = SHUFFLE2(d[0], d[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   SHUFFLE2(d[0], d[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf t23 = SHUFFLE2(d[2], d[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   SHUFFLE2(d[2], d[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf u = SHUFFLE2(t01, t23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE2(t01, t23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    u += SHUFFLE(u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    u += SHUFFLE(u, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    for (int h = 0; h < 4; h++) out[h] = u[4 * h];
#undef SHUFFLE2
#else
    for (int h = 0; h < 4; h++) out[h] = lanes_sum(d[h]);
#endif
}

/* attend for bf16 keys and values with d a multiple of PAIR_SPAN, their rows read as pairs:
 * the queries (bf16, or float32 where q_bf16 is 0) split into even / odd once, the value
 * sums kept split and put back in order as the state is written (attend's products, summed
 * in another order). */
static inline __attribute__((always_inline)) void attend_pairs(const char *q, int64_t q_head_stride,
                                                               const key_rows kr, int64_t first, int64_t count,
                                                               int64_t d, float scale, float softcap, int64_t h0,
                                                               int nh, float *state, int q_bf16) {
    float qs[HEADS][d], acc[HEADS][d];
    float m[HEADS], l[HEADS], s[HEADS][KEY_TILE];
    const char *key[KEY_TILE];
    prefetch_start(&kr, first, count);
    for (int h = 0; h < nh; h++) {
        const char *row = q + (h0 + h) * q_head_stride * (q_bf16 ? 2 : 4);
        for (int64_t c = 0; c < d; c += PAIR_SPAN) {
            if (q_bf16) {
                const vu w = load_pairs(row + c * 2);
                store_f32(&qs[h][c], even_of(w) * splat(scale));
                store_f32(&qs[h][c + LANES], odd_of(w) * splat(scale));
            } else {
                const float *x = (const float *)row + c;
                for (int i = 0; i < LANES; i++) {
                    qs[h][c + i] = x[2 * i] * scale;
                    qs[h][c + LANES + i] = x[2 * i + 1] * scale;
                }
            }
        }
    }
    start_heads(nh, d, m, l, acc);
    key_walk walk = walk_from(&kr, first);
    for (int64_t t0 = 0; t0 < count; t0 += KEY_TILE) {
        const int n = count - t0 < KEY_TILE ? (int)(count - t0) : KEY_TILE;
        for (int j = 0; j < n; j++) {
            key[j] = key_row(&kr, &walk, t0 + j, count);
            /* two chains per head (even, odd), each d / PAIR_SPAN dependent FMAs long */
            vf dot[HEADS], dot_odd[HEADS];
            for (int h = 0; h < nh; h++) dot[h] = dot_odd[h] = splat(0.0f);
            for (int64_t c = 0; c < d; c += PAIR_SPAN) {
                const vu w = load_pairs(key[j] + c * 2);
                const vf ke = even_of(w), ko = odd_of(w);
                for (int h = 0; h < nh; h++) {
                    dot[h] += load_f32(&qs[h][c]) * ke;
                    dot_odd[h] += load_f32(&qs[h][c + LANES]) * ko;
                }
            }
            float sc[HEADS];
            for (int h = 0; h < nh; h++) dot[h] += dot_odd[h];
            if (nh == HEADS)
                sums_of_four(dot, sc);
            else
                for (int h = 0; h < nh; h++) sc[h] = lanes_sum(dot[h]);
            for (int h = 0; h < nh; h++) s[h][j] = capped(sc[h], softcap);
        }
        softmax_tile(nh, n, d, s, m, l, acc);
        for (int64_t c = 0; c < d; c += PAIR_SPAN) add_weighted_values(nh, n, d, key, kr.value_bytes, s, c, acc, 1, 1);
    }
    for (int h = 0; h < nh; h++) {
        float *out = state + h * (d + 2);
        for (int64_t c = 0; c < d; c += PAIR_SPAN)
            for (int i = 0; i < LANES; i++) {
                out[c + 2 * i] = acc[h][c + i];
                out[c + 2 * i + 1] = acc[h][c + LANES + i];
            }
        out[d] = m[h];
        out[d + 1] = l[h];
    }
}

/* The output of heads h0 .. h0 + nh - 1 from the states of `splits` consecutive key ranges
 * (each HEADS * (d + 2) floats, as attend leaves them): rescaled to the largest maximum,
 * with the sink (a score with a zero value) in the denominator where given; out in bf16
 * where out_bf16, else float32. */
static void finish(const float *states, int64_t splits, int nh, int64_t d, const float *sinks, int64_t h0, void *out,
                   int out_bf16) {
    const int64_t stride = HEADS * (d + 2);
    for (int h = 0; h < nh; h++) {
        float top = sinks ? sinks[h0 + h] : -INFINITY, weight[splits];
        for (int64_t j = 0; j < splits; j++) {
            const float m = states[j * stride + h * (d + 2) + d];
            top = m > top ? m : top;
        }
        float sum = sinks ? expf(sinks[h0 + h] - top) : 0.0f; /* top is finite: some range has keys */
        for (int64_t j = 0; j < splits; j++) {
            const float *st = states + j * stride + h * (d + 2);
            weight[j] = st[d] == -INFINITY ? 0.0f : expf(st[d] - top);
            sum += st[d + 1] * weight[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < d; i++) {
            float o = 0.0f;
            for (int64_t j = 0; j < splits; j++) o += states[j * stride + h * (d + 2) + i] * weight[j];
            o *= inv;
            if (out_bf16)
                ((uint16_t *)out)[(h0 + h) * d + i] = f32_to_bf16(o);
            else
                ((float *)out)[(h0 + h) * d + i] = o;
        }
    }
}

/* q: [batch, heads, d] with `q_row_stride` elements between requests (heads contiguous);
 * cache: blocks of [block_size, 2, kv_heads, d] (keys, then values, per token),
 * `block_stride` elements apart; ids: [batch, blocks_per_row] block ids; first / count:
 * [batch] the first key position (counted from the first gathered block's start) and the
 * number of keys; sinks: [heads] or NULL; softcap <= 0: none; out: [batch, heads, d]
 * contiguous. Dtypes: the cache's bfloat16 where bf16 != 0, else float32; the query's and
 * the output's bfloat16 where q_bf16 != 0, else float32 (a float32 model may keep its
 * cache in bf16). */
void paged_decode_attention(const void *q, int64_t q_row_stride, const void *cache, int64_t block_stride,
                            int64_t block_size, int64_t kv_heads, int64_t d, const int64_t *ids,
                            int64_t blocks_per_row, const int64_t *first, const int64_t *count, int64_t batch,
                            int64_t heads, float scale, float softcap, const float *sinks, void *out, int32_t bf16,
                            int32_t q_bf16, int32_t num_threads) {
    const int64_t elem = bf16 ? 2 : 4, q_elem = q_bf16 ? 2 : 4, group = heads / kv_heads;
    const int64_t parts = (group + HEADS - 1) / HEADS;
    const int64_t block_bytes = block_stride * elem, token_bytes = 2 * kv_heads * d * elem;
    const int64_t value_bytes = kv_heads * d * elem;
    const int64_t items = batch * kv_heads * parts, stride = HEADS * (d + 2);
    /* Fewer (request, kv head) pairs than threads (one stream): each pair's keys are split
     * into ranges on several threads, then their states combined. */
    int64_t splits = items < num_threads ? num_threads / items : 1;
    float *states = splits > 1 ? malloc(sizeof(float) * items * splits * stride) : NULL;
    if (!states) splits = 1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < items * splits; k++) {
            const int64_t item = k / splits, j = k % splits;
            const int64_t b = item / (kv_heads * parts), kv = item / parts % kv_heads, part = item % parts;
            const int64_t h0 = kv * group + part * HEADS;
            const int nh = group - part * HEADS < HEADS ? (int)(group - part * HEADS) : HEADS;
            const char *q_row = (const char *)q + b * q_row_stride * q_elem;
            const key_rows kr = {(const char *)cache + kv * d * elem, ids + b * blocks_per_row, block_bytes,
                                 token_bytes, value_bytes, d * elem, block_size};
            char *out_row = (char *)out + b * heads * d * q_elem;
            const int64_t lo = count[b] * j / splits, hi = count[b] * (j + 1) / splits;
            float own[splits > 1 ? 1 : stride];
            float *state = splits > 1 ? states + k * stride : own;
            /* Constant head counts and dtypes: each call below is its own unrolled loop. */
#define ATTEND(heads_now, is_bf16, q_is_bf16) \
    attend(q_row, d, kr, first[b] + lo, hi - lo, d, scale, softcap, h0, heads_now, state, is_bf16, q_is_bf16)
#define ATTEND_PAIRS(heads_now, q_is_bf16) \
    attend_pairs(q_row, d, kr, first[b] + lo, hi - lo, d, scale, softcap, h0, heads_now, state, q_is_bf16)
            if (bf16 && d % PAIR_SPAN == 0 && q_bf16) {
                if (nh == HEADS) ATTEND_PAIRS(HEADS, 1); else ATTEND_PAIRS(nh, 1);
            } else if (bf16 && d % PAIR_SPAN == 0) {
                if (nh == HEADS) ATTEND_PAIRS(HEADS, 0); else ATTEND_PAIRS(nh, 0);
            } else if (bf16) {
                if (nh == HEADS) ATTEND(HEADS, 1, q_bf16); else ATTEND(nh, 1, q_bf16);
            } else {
                if (nh == HEADS) ATTEND(HEADS, 0, 0); else ATTEND(nh, 0, 0);
            }
#undef ATTEND
#undef ATTEND_PAIRS
            if (splits == 1) finish(state, 1, nh, d, sinks, h0, out_row, q_bf16);
        }
        if (splits > 1) {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; item++) {
                const int64_t b = item / (kv_heads * parts), kv = item / parts % kv_heads, part = item % parts;
                const int nh = group - part * HEADS < HEADS ? (int)(group - part * HEADS) : HEADS;
                finish(states + item * splits * stride, splits, nh, d, sinks, kv * group + part * HEADS,
                       (char *)out + b * heads * d * q_elem, q_bf16);
            }
        }
    }
    free(states);
}

