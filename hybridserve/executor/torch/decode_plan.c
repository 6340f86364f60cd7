/* A decode step's attention plan in one native call (executor/torch/attention.py,
 * StepAttention._plan_decode, calls it; its docstring says when a step is planned so).
 *
 * Why here: a decode step is most steps, and its plan runs right after the head's and the
 * layers' weights have streamed through the caches, where each of the dozen numpy and
 * torch calls the plan took in Python cost several times its warm time. The rule is the
 * general path's (StepAttention.__init__), which a hypothesis test holds this to:
 *
 *   token i of request rows[i] sits at position starts[i]: block column c = starts[i] / bs
 *   (the step fails where c is past the row's blocks in any group); its slot in group g is
 *   table[g][rows[i]][c] * bs + starts[i] % bs;
 *   a plan p (the groups of one window / chunk) reads keys lo .. starts[i] of each request,
 *   lo = max(0, starts[i] + 1 - window), or starts[i] rounded down to the chunk, or 0;
 *   its gathered blocks start at column first_blk = lo / bs, num_blocks = the largest
 *   c - first_blk + 1 of the step, each column clamped to the table's width (the general
 *   path's gather: the kernel reads only the key run, which lies within the row's blocks);
 *   first key = lo - first_blk * bs, key count = starts[i] + 1 - lo.
 *
 * Where the step is not one this plans (a null block, window-tail allocation's, or no
 * request with a key cached outside a batch-invariant model's steps) nothing is written and
 * the general path plans it. */

#include <stdint.h>

/* The first key position a query at s reads: s + 1 - window (not below 0), s rounded down
 * to its chunk, or 0 (window and chunk 0: a full-attention group). */
static int64_t run_start(int64_t s, int64_t window, int64_t chunk) {
    if (window > 0) return s + 1 - window > 0 ? s + 1 - window : 0;
    if (chunk > 0) return s / chunk * chunk;
    return 0;
}

/* The plan into `out` (int64 words), laid out as:
 *   slots [groups][n];
 *   per plan p: first key [n], key count [n], first gathered block column [n];
 *   per group g: block ids [n][num_blocks[plan_of[g]]].
 * table: [groups][table_rows][width] block ids (strides in elements); lengths: [groups]
 * [table_rows] blocks in each row; window / chunk: per plan, 0 for none.
 * Returns the words the plan takes (num_blocks[] set; nothing written past `capacity`: the
 * caller grows `out` and calls again when the return is larger), 0 where the general path
 * plans the step, -1 where a token's block column is past its row's blocks. */
int64_t decode_plan(const int64_t *table, int64_t table_group_stride, int64_t table_row_stride, int64_t width,
                    const int64_t *lengths, int64_t lengths_group_stride, const int64_t *rows,
                    const int64_t *starts, int64_t n, int64_t bs, int64_t groups, const int64_t *plan_of,
                    const int64_t *window, const int64_t *chunk, int64_t plans, int32_t per_token, int64_t *out,
                    int64_t capacity, int64_t *num_blocks) {
    int any_cached = per_token;
    for (int64_t i = 0; i < n; i++) {
        const int64_t c = starts[i] / bs;
        any_cached |= starts[i] != 0;
        for (int64_t g = 0; g < groups; g++)
            if (c >= lengths[g * lengths_group_stride + rows[i]]) return -1;
    }
    for (int64_t g = 0; g < groups; g++)
        for (int64_t i = 0; i < n; i++)
            if (table[g * table_group_stride + rows[i] * table_row_stride + starts[i] / bs] == 0) return 0;
    if (!any_cached) return 0;
    int64_t words = groups * n + plans * 3 * n;
    for (int64_t p = 0; p < plans; p++) {
        int64_t widest = 0;
        for (int64_t i = 0; i < n; i++) {
            const int64_t s = starts[i];
            const int64_t lo = run_start(s, window[p], chunk[p]);
            const int64_t span = s / bs - lo / bs + 1;
            widest = span > widest ? span : widest;
        }
        num_blocks[p] = widest;
    }
    for (int64_t g = 0; g < groups; g++) words += n * num_blocks[plan_of[g]];
    if (words > capacity) return words;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t i = 0; i < n; i++)
            out[g * n + i] = table[g * table_group_stride + rows[i] * table_row_stride + starts[i] / bs] * bs +
                             starts[i] % bs;
    int64_t *runs = out + groups * n;
    for (int64_t p = 0; p < plans; p++) {
        int64_t *first = runs + p * 3 * n, *count = first + n, *first_blk = count + n;
        for (int64_t i = 0; i < n; i++) {
            const int64_t s = starts[i];
            const int64_t lo = run_start(s, window[p], chunk[p]);
            first_blk[i] = lo / bs;
            first[i] = lo - first_blk[i] * bs;
            count[i] = s + 1 - lo;
        }
    }
    int64_t *ids = runs + plans * 3 * n;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t p = plan_of[g], nb = num_blocks[p];
        const int64_t *first_blk = runs + p * 3 * n + 2 * n;
        for (int64_t i = 0; i < n; i++) {
            const int64_t *row = table + g * table_group_stride + rows[i] * table_row_stride;
            for (int64_t j = 0; j < nb; j++) {
                const int64_t c = first_blk[i] + j;
                ids[i * nb + j] = row[c < width ? c : width - 1];
            }
        }
        ids += n * nb;
    }
    return words;
}
