/* A decode step's decoder layers in one native call (models/arch/decode_stack.py calls it):
 * DecoderLM.forward's loop for a sandwich-norm decoder on int8 groups, walked here instead
 * of in Python. Each step calls the same kernels, with the same arguments, in the same order
 * as that loop does through their Python wrappers:
 *   x = rms_norm(h) * input_norm                           (the first layer only)
 *   per layer:
 *     qkv = x W_qkv                                         group_linear
 *     q, k = rms_norm per head * qk_norm, then RoPE         qk_norm_rope
 *     the cache slot of each row <- its k | v               (a row copy, as index_copy_;
 *                                                            rounded to bf16 where a float32
 *                                                            model's cache is bf16)
 *     attn = paged attention of q over the cached keys      paged_decode_attention
 *     h, x = h + rms_norm(attn W_o) * w, rms_norm(..) * w'  residual_norms
 *     act = act(gate) * up of x W_gate_up                   group_linear, act_mul
 *     h, x = h + rms_norm(act W_down) * w, the next layer's input norm (none after the last)
 *   rms_norm(h) * final_norm                               (a last stage: StagedModel.stage_output)
 * so a bf16 model's hidden states are bit for bit the loop's. Why: at decode sizes the loop
 * spent about as long in Python, ctypes and torch's dispatch around ~180 kernel calls a step
 * as the kernels outside the matmuls took.
 *
 * A float32 model (a CPU without native bf16) walks the same steps with the kernels' float32
 * forms (the norms with exact sums, the activation computed rather than looked up), which
 * equal its loop's eager chain to a float32 rounding, not bit for bit: the loop sums squares
 * in ATen's order and takes ATen's activation.
 *
 * The kernels live in their own libraries; their addresses come in `struct kernels`. The
 * caller's buffers hold every intermediate; nothing is allocated here. */

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "native_vectors.h"

typedef int (*group_linear_fn)(const void *x, int32_t x_bf16, int64_t ldx, int64_t rows, int64_t k,
                               const int8_t *values, const float *scale, const float *offset, int64_t n,
                               int64_t group_size, const float *bias, const void *residual, int64_t ldr, void *out,
                               int64_t ldo, int32_t threads, int32_t path, int32_t narrow);
/* Each element-wise kernel's bf16 form, or its float32 one (the same arguments): the
 * element pointers are the model's dtype. */
typedef void (*qk_norm_rope_fn)(void *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t hd,
                                const void *weight, double eps, double inv_dim, const void *cos, const void *sin,
                                int32_t threads);
typedef void (*residual_norms_fn)(const void *h, int64_t h_stride, const void *y, int64_t y_stride, int64_t rows,
                                  int64_t dim, const void *w1, const void *w2, double eps, double inv_dim, void *h_out,
                                  void *x_out, int32_t threads);
typedef void (*rms_norms_fn)(const void *h, int64_t h_stride, int64_t rows, int64_t dim, const void *w, double eps,
                             double inv_dim, void *x_out, int32_t threads);
typedef void (*paged_decode_fn)(const void *q, int64_t q_row_stride, const void *cache, int64_t block_stride,
                                int64_t block_size, int64_t kv_heads, int64_t d, const int64_t *ids,
                                int64_t blocks_per_row, const int64_t *first, const int64_t *count, int64_t batch,
                                int64_t heads, float scale, float softcap, const float *sinks, void *out,
                                int32_t bf16, int32_t q_bf16, int32_t threads);
typedef void (*act_mul_fn)(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t width,
                           const uint16_t *table, uint16_t *out, int32_t threads);
typedef void (*act_mul_f32_fn)(const float *gate_up, int64_t stride, int64_t rows, int64_t width, int32_t act,
                               float *out, int64_t out_stride, int32_t threads);

struct kernels {
    group_linear_fn linear;
    qk_norm_rope_fn qk_norm_rope;
    residual_norms_fn residual_norms;
    rms_norms_fn rms_norms;
    paged_decode_fn attend;
    act_mul_fn act_mul;         /* bf16: the activation from a table */
    act_mul_f32_fn act_mul_f32; /* float32: the activation computed */
};

/* One weight in group_linear's tiles: [n, k] in groups of group_size. */
struct linear {
    const int8_t *values;
    const float *scale, *offset, *bias;
    int64_t n, k, group_size;
    int32_t narrow;
};

enum { QKV, O, GATE_UP, DOWN, LINEARS };

struct layer {
    struct linear linears[LINEARS];
    const void *input_norm, *qk_norm, *post_attn_norm, *pre_ffn_norm, *post_ffn_norm;
    int64_t group; /* its attention group: which slots, blocks and key ranges it reads */
    int64_t rope;  /* its RoPE table (RoPE per layer type) */
};

/* One attention group's decode step: each row's cache slot, its blocks and key range. */
struct group_step {
    const int64_t *slots, *ids, *first, *count;
    int64_t blocks_per_row;
};

struct rope_step {
    const void *cos, *sin; /* a RoPE table's [table_rows, head_dim] (RopeTable); NULL: no RoPE */
};

struct step {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    double eps;
    float scale, softcap;
    int32_t paths[LINEARS]; /* group_linear's path per linear (the same for every layer) */
    int32_t threads;
    int32_t f32;        /* the activations, norm weights and tables: float32 (else bf16) */
    int32_t kv_bf16;    /* the caches: bf16 (always where f32 is 0), else float32 */
    int32_t activation; /* float32: act_mul_f32's activation code */
    const struct group_step *groups;
    const struct rope_step *ropes;
    int64_t num_ropes, table_rows; /* ropes' count; the rows every table has at least */
    const int64_t *positions;      /* [rows]: each row's position, the table row it reads */
    void *rope_rows;               /* [num_ropes][2][rows][head_dim]: each table's rows gathered */
    void *const *caches;       /* per layer: [blocks, block_size, 2, kv_heads, head_dim] */
    const int64_t *block_strides; /* per layer, in elements */
    const uint16_t *act_table; /* bf16 only */
    const void *h;             /* the input [rows, hidden]; read only */
    void *h_out[2];            /* the residual stream, alternately */
    void *x, *qkv, *attn, *sub, *gate_up, *act;
    const void *final_norm; /* the model's final norm weight; NULL: not a last stage */
    void *final_out;        /* the final-normed hidden [rows, hidden] where final_norm is set */
    double *linear_seconds; /* where the linears' wall time is added (benchmarks); NULL: not timed */
};

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int linear(const struct kernels *k, const struct step *s, const struct linear *w, int32_t path,
                  const void *x, int64_t ldx, void *out) {
    const double start = s->linear_seconds ? seconds() : 0.0;
    const int failed = k->linear(x, !s->f32, ldx, s->rows, w->k, w->values, w->scale, w->offset, w->n, w->group_size, w->bias,
                                 NULL, 0, out, w->n, s->threads, path, w->narrow);
    if (s->linear_seconds) *s->linear_seconds += seconds() - start;
    return failed;
}

/* Copies each row's k | v (adjacent in qkv after q) into its cache slot; float32 rows into
 * a bf16 cache rounded to nearest even, as torch's copy_ converts. */
static void write_kv(const struct step *s, const struct group_step *g, void *cache, int64_t qkv_width) {
    const int64_t elem = s->f32 ? 4 : 2, values = 2 * s->kv_heads * s->head_dim;
    const char *qkv = (const char *)s->qkv + s->heads * s->head_dim * elem;
    if (s->f32 && s->kv_bf16) {
        for (int64_t r = 0; r < s->rows; r++) {
            const float *row = (const float *)(qkv + r * qkv_width * elem);
            uint16_t *slot = (uint16_t *)cache + g->slots[r] * values;
            for (int64_t i = 0; i < values; i++) slot[i] = f32_to_bf16(row[i]);
        }
        return;
    }
    for (int64_t r = 0; r < s->rows; r++)
        memcpy((char *)cache + g->slots[r] * values * elem, qkv + r * qkv_width * elem, values * elem);
}

static void act_mul(const struct kernels *k, const struct step *s) {
    if (s->f32)
        k->act_mul_f32(s->gate_up, 2 * s->intermediate, s->rows, s->intermediate, s->activation, s->act,
                       s->intermediate, s->threads);
    else
        k->act_mul(s->gate_up, 2 * s->intermediate, s->rows, s->intermediate, s->act_table, s->act, s->threads);
}

/* Each RoPE table's rows of the step's positions, cos then sin, into rope_rows (as
 * RopeTable.lookup gathers them for the loop); -2 where a position is past the tables. */
static int gather_ropes(const struct step *s) {
    const int64_t rows = s->rows, bytes = s->head_dim * (s->f32 ? 4 : 2);
    for (int64_t r = 0; r < rows; r++)
        if (s->positions[r] < 0 || s->positions[r] >= s->table_rows) return -2;
    char *out = s->rope_rows;
    for (int64_t j = 0; j < s->num_ropes; j++) {
        const struct rope_step *t = &s->ropes[j];
        if (!t->cos) continue;
        for (int64_t r = 0; r < rows; r++) {
            memcpy(out + (2 * j * rows + r) * bytes, (const char *)t->cos + s->positions[r] * bytes, bytes);
            memcpy(out + ((2 * j + 1) * rows + r) * bytes, (const char *)t->sin + s->positions[r] * bytes, bytes);
        }
    }
    return 0;
}

/* Runs the layers, then the final norm into final_out where final_norm is set; returns
 * which h_out holds the final residual stream (0 or 1), -1 where a linear failed
 * (group_linear: no memory for an input copy), or -2 where a position is past the RoPE
 * tables. */
int decode_stack(const struct kernels *k, const struct layer *layers, int64_t num_layers, const struct step *s) {
    const int64_t rows = s->rows, hidden = s->hidden, hd = s->head_dim;
    const int64_t qkv_width = layers[0].linears[QKV].n;
    const double inv_hidden = 1.0 / (double)hidden, inv_hd = 1.0 / (double)hd;
    const int64_t rope_bytes = rows * hd * (s->f32 ? 4 : 2);
    const void *h = s->h;
    int next = 0;
    if (gather_ropes(s)) return -2;
    k->rms_norms(h, hidden, rows, hidden, layers[0].input_norm, s->eps, inv_hidden, s->x, s->threads);
    for (int64_t i = 0; i < num_layers; i++) {
        const struct layer *L = &layers[i];
        const struct group_step *g = &s->groups[L->group];
        const int has_rope = s->ropes[L->rope].cos != NULL;
        const char *cos = (const char *)s->rope_rows + 2 * L->rope * rope_bytes;
        if (linear(k, s, &L->linears[QKV], s->paths[QKV], s->x, hidden, s->qkv)) return -1;
        k->qk_norm_rope(s->qkv, rows, qkv_width, s->heads + s->kv_heads, hd, L->qk_norm, s->eps, inv_hd,
                        has_rope ? cos : NULL, has_rope ? cos + rope_bytes : NULL, s->threads);
        write_kv(s, g, s->caches[i], qkv_width);
        k->attend(s->qkv, qkv_width, s->caches[i], s->block_strides[i], s->block_size, s->kv_heads, hd, g->ids,
                  g->blocks_per_row, g->first, g->count, rows, s->heads, s->scale, s->softcap, NULL, s->attn,
                  s->kv_bf16, !s->f32, s->threads);
        if (linear(k, s, &L->linears[O], s->paths[O], s->attn, s->heads * hd, s->sub)) return -1;
        k->residual_norms(h, hidden, s->sub, hidden, rows, hidden, L->post_attn_norm, L->pre_ffn_norm, s->eps,
                          inv_hidden, s->h_out[next], s->x, s->threads);
        h = s->h_out[next];
        next ^= 1;
        if (linear(k, s, &L->linears[GATE_UP], s->paths[GATE_UP], s->x, hidden, s->gate_up)) return -1;
        act_mul(k, s);
        if (linear(k, s, &L->linears[DOWN], s->paths[DOWN], s->act, s->intermediate, s->sub)) return -1;
        const void *following = i + 1 < num_layers ? layers[i + 1].input_norm : NULL;
        k->residual_norms(h, hidden, s->sub, hidden, rows, hidden, L->post_ffn_norm, following, s->eps, inv_hidden,
                          s->h_out[next], following ? s->x : NULL, s->threads);
        h = s->h_out[next];
        next ^= 1;
    }
    if (s->final_norm) k->rms_norms(h, hidden, rows, hidden, s->final_norm, s->eps, inv_hidden, s->final_out, s->threads);
    return next ^ 1;
}
