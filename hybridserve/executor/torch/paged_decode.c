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
 * maximum starts at it, with a sum of one). The output is rounded once to the cache's
 * dtype (round to nearest even, as torch converts).
 *
 * Written with GCC / Clang vector extensions, as span_summaries.c: the compiler flags pick
 * the instructions. OpenMP spreads the (request, kv head) pairs over torch's threads. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_vectors.h"
#include "span_summary.h"

/* Keys scored before each update of the running maximum: enough to amortise the rescale
 * of the accumulators, few enough for their scores to stay in L1. */
#define KEY_TILE 32
/* How many tokens ahead of the one scored the key and value rows are prefetched. */
#define PREFETCH_AHEAD 4
/* Query heads of one kv head accumulated at once (a larger group is taken in parts). */
#define HEADS 4

/* Element i of a row of keys, values or queries in the cache's dtype. */
static inline __attribute__((always_inline)) vf load_row(const void *base, int64_t i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)base + i) : load_f32((const float *)base + i);
}

static inline __attribute__((always_inline)) float load_one(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Heads h0 .. h0 + nh - 1 (nh <= HEADS) of one request, all reading kv head `kv`, over its
 * keys first .. first + count - 1 (count may be 0): each head's running state, stored at
 * state + h * (d + 2) as the unnormalised output (d values), the maximum score and the sum
 * of exp(score - maximum). */
static inline __attribute__((always_inline)) void
attend(const void *q, int64_t q_head_stride, const char *cache, int64_t block_bytes, int64_t token_bytes,
       int64_t value_bytes, int64_t block_size, const int64_t *ids, int64_t first, int64_t count, int64_t d,
       float scale, float softcap, int64_t h0, int nh, float *state, int bf16) {
    const int64_t elem = bf16 ? 2 : 4, full = d - d % LANES;
    float qf[HEADS][d], acc[HEADS][d];
    float m[HEADS], l[HEADS], s[HEADS][KEY_TILE];
    const char *key[KEY_TILE];
    for (int h = 0; h < nh; h++) {
        const char *row = (const char *)q + (h0 + h) * q_head_stride * elem;
        for (int64_t i = 0; i < d; i++) qf[h][i] = load_one(row, i, bf16) * scale;
        memset(acc[h], 0, sizeof(float) * d);
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < count; t0 += KEY_TILE) {
        const int n = count - t0 < KEY_TILE ? (int)(count - t0) : KEY_TILE;
        for (int j = 0; j < n; j++) {
            const int64_t pos = first + t0 + j;
            key[j] = cache + ids[pos / block_size] * block_bytes + (pos % block_size) * token_bytes;
            /* The loads wait on memory (a layer's keys are not in cache), so ask for a later
             * token's key and value rows now: the value pass below then finds them too. */
            if (t0 + j + PREFETCH_AHEAD < count) {
                const int64_t ahead = pos + PREFETCH_AHEAD;
                const char *next = cache + ids[ahead / block_size] * block_bytes + (ahead % block_size) * token_bytes;
                for (int64_t c = 0; c < d * elem; c += 64) {
                    __builtin_prefetch(next + c);
                    __builtin_prefetch(next + value_bytes + c);
                }
            }
            vf dot[HEADS];
            for (int h = 0; h < nh; h++) dot[h] = splat(0.0f);
            for (int64_t i = 0; i < full; i += LANES) {
                const vf k = load_row(key[j], i, bf16);
                for (int h = 0; h < nh; h++) dot[h] += load_f32(&qf[h][i]) * k;
            }
            for (int h = 0; h < nh; h++) {
                float sc = lanes_sum(dot[h]);
                for (int64_t i = full; i < d; i++) sc += qf[h][i] * load_one(key[j], i, bf16);
                s[h][j] = softcap > 0.0f ? tanhf(sc / softcap) * softcap : sc;
            }
        }
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
        /* Two column chunks at a time: each accumulator is a chain of n dependent adds, and
         * 2 x nh chains keep the FMA units busier than nh (the same sums, in the same order). */
        int64_t i = 0;
        for (; i + LANES < full; i += 2 * LANES) {
            vf a[HEADS], b[HEADS];
            for (int h = 0; h < nh; h++) {
                a[h] = load_f32(&acc[h][i]);
                b[h] = load_f32(&acc[h][i + LANES]);
            }
            for (int j = 0; j < n; j++) {
                const vf v = load_row(key[j] + value_bytes, i, bf16);
                const vf w = load_row(key[j] + value_bytes, i + LANES, bf16);
                for (int h = 0; h < nh; h++) {
                    const vf p = splat(s[h][j]);
                    a[h] += p * v;
                    b[h] += p * w;
                }
            }
            for (int h = 0; h < nh; h++) {
                store_f32(&acc[h][i], a[h]);
                store_f32(&acc[h][i + LANES], b[h]);
            }
        }
        for (; i < full; i += LANES) {
            vf a[HEADS];
            for (int h = 0; h < nh; h++) a[h] = load_f32(&acc[h][i]);
            for (int j = 0; j < n; j++) {
                const vf v = load_row(key[j] + value_bytes, i, bf16);
                for (int h = 0; h < nh; h++) a[h] += splat(s[h][j]) * v;
            }
            for (int h = 0; h < nh; h++) store_f32(&acc[h][i], a[h]);
        }
        for (int64_t i = full; i < d; i++)
            for (int j = 0; j < n; j++) {
                const float v = load_one(key[j] + value_bytes, i, bf16);
                for (int h = 0; h < nh; h++) acc[h][i] += s[h][j] * v;
            }
    }
    for (int h = 0; h < nh; h++) {
        memcpy(state + h * (d + 2), acc[h], sizeof(float) * d);
        state[h * (d + 2) + d] = m[h];
        state[h * (d + 2) + d + 1] = l[h];
    }
}

/* The output of heads h0 .. h0 + nh - 1 from the states of `splits` consecutive key ranges
 * (each HEADS * (d + 2) floats, as attend leaves them): rescaled to the largest maximum,
 * with the sink (a score with a zero value) in the denominator where given. */
static void finish(const float *states, int64_t splits, int nh, int64_t d, const float *sinks, int64_t h0, void *out,
                   int bf16) {
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
            if (bf16)
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
 * contiguous, in the cache's dtype (bf16 != 0: bfloat16, else float32). */
void paged_decode_attention(const void *q, int64_t q_row_stride, const void *cache, int64_t block_stride,
                            int64_t block_size, int64_t kv_heads, int64_t d, const int64_t *ids,
                            int64_t blocks_per_row, const int64_t *first, const int64_t *count, int64_t batch,
                            int64_t heads, float scale, float softcap, const float *sinks, void *out, int32_t bf16,
                            int32_t num_threads) {
    const int64_t elem = bf16 ? 2 : 4, group = heads / kv_heads;
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
            const char *q_row = (const char *)q + b * q_row_stride * elem;
            const char *kv_base = (const char *)cache + kv * d * elem;
            char *out_row = (char *)out + b * heads * d * elem;
            const int64_t *row_ids = ids + b * blocks_per_row;
            const int64_t lo = count[b] * j / splits, hi = count[b] * (j + 1) / splits;
            float own[splits > 1 ? 1 : stride];
            float *state = splits > 1 ? states + k * stride : own;
            /* Constant head counts and dtypes: each call below is its own unrolled loop. */
#define ATTEND(heads_now, is_bf16)                                                                            \
    attend(q_row, d, kv_base, block_bytes, token_bytes, value_bytes, block_size, row_ids, first[b] + lo, hi - lo, \
           d, scale, softcap, h0, heads_now, state, is_bf16)
            if (bf16) {
                if (nh == HEADS) ATTEND(HEADS, 1); else ATTEND(nh, 1);
            } else {
                if (nh == HEADS) ATTEND(HEADS, 0); else ATTEND(nh, 0);
            }
#undef ATTEND
            if (splits == 1) finish(state, 1, nh, d, sinks, h0, out_row, bf16);
        }
        if (splits > 1) {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; item++) {
                const int64_t b = item / (kv_heads * parts), kv = item / parts % kv_heads, part = item % parts;
                const int nh = group - part * HEADS < HEADS ? (int)(group - part * HEADS) : HEADS;
                finish(states + item * splits * stride, splits, nh, d, sinks, kv * group + part * HEADS,
                       (char *)out + b * heads * d * elem, bf16);
            }
        }
    }
    free(states);
}
