/* Each row's token from its span summaries and logits: span_sampler.draw_fast's draw, one
 * row per loop iteration instead of ~100 tensor operations over the batch (each a few
 * microseconds of dispatch and an OpenMP region on a few thousand numbers).
 *
 * The same rule as draw_fast (span_sampler.py's docstring defines it): greedy rows take
 * the first maximal id; a row draws x_a by inverse CDF over its span masses, then over the
 * chosen span's weights, for a = 0 .. attempts - 1, and keeps the first x_a whose logit
 * reaches theta; if none does, the inverse CDF of its last draw over the logits >= theta.
 * theta (top-k's k-th largest logit, the nucleus cut, min-p's level) is decided here only
 * where the candidate spans decide it: the candidate_spans (at least top_k) spans with the
 * largest maxima hold every logit above `bound`, the largest maximum left out, so the
 * k-th largest logit and a nucleus cut above `bound` are found among them. A nucleus
 * reaching below `bound` stays open: a draw above bound is kept, one at or below it is kept
 * iff the mass strictly above its logit is short of the nucleus's share. A row they do not
 * decide (a k-th largest at or below `bound`, an open nucleus whose every draw is
 * rejected) is left UNDECIDED: the caller draws it with draw_fast, which handles those
 * exactly. The same
 * arithmetic as draw_fast (float32 weights, float64 sums and searches), so both give the
 * same tokens up to float rounding (tests/executor/test_span_draw.py). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "logit_pieces.h"
#include "span_summary.h"

#define UNDECIDED (-1)
/* span_draw_keyed's mark for a row whose every token is masked (span_draw writes 0). */
#define MASKED (-2)
/* The most draws a row reads (attempts + 1): sampling_keys.DRAWS_PER_POSITION's bound. */
#define MAX_DRAWS 16
/* The span masses' exponent floor (span_summary.h's exp_nonpositive needs x >= -87): a
 * term at exp(-87) ~ 1.6e-38 moves no float64 cumulative mass of at least 1. */
#define EXP_FLOOR_SPANS (-87.0f)
/* A row whose top_k needs more candidate spans than this is left to draw_fast (torch's
 * topk): sorting most of a large vocabulary's logits per row here would cost more. */
#define MAX_CANDIDATE_SPANS 512
/* Candidate sets up to this many spans are kept by insertion (top_k of at most 63). */
#define INSERTION_CANDIDATES 64

/* As span_sampler._search: the first i with cdf[i] > target; where rounding lifted the
 * target to the total, the first i reaching the total (which has weight). */
static int64_t search(const double *cdf, int64_t n, double target) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (cdf[mid] > target) hi = mid; else lo = mid + 1;
    }
    if (lo < n) return lo;
    const double last = cdf[n - 1];
    lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (cdf[mid] >= last) hi = mid; else lo = mid + 1;
    }
    return lo;
}

static inline float weight(float x, float ref, float inv_t) { return expf((x - ref) * inv_t); }

/* The largest of x[0 .. n - 1] (-inf for none), a vector at a time. */
static float row_max(const float *x, int64_t n) {
    vf best = splat(-INFINITY);
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) best = vmax(best, load_f32(x + j));
    float m = lanes_max(best);
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

static inline double clamp01(double x) { return x < 0.0 ? 0.0 : (x > 1.0 ? 1.0 : x); }

/* cum[i] = the float64 running sum of one span's weights exp((v - ref) * inv_t) over its
 * logits v >= theta (ref at least every such v), the others weighing 0: -inf logits (masked
 * tokens) weigh exactly 0 whatever theta is. The exponentials a vector at a time
 * (span_summary.h's, floored at EXP_FLOOR_SPANS). */
static void span_cumulative(const float *v, float ref, float inv_t, float theta, double *cum) {
    const vf by_t = splat(inv_t), lowest = splat(EXP_FLOOR_SPANS), top = splat(ref), level = splat(theta),
             none = splat(-INFINITY);
    double acc = 0.0;
    for (int b = 0; b < SPAN; b += LANES) {
        const vf x = load_f32(v + b);
        const vf e = exp_nonpositive(vmax((x - top) * by_t, lowest));
        const vi keep = (x >= level) & (x > none);
        const vf w = (vf)((vi)e & keep);
        for (int i = 0; i < LANES; i++) {
            acc += (double)w[i];
            cum[b + i] = acc;
        }
    }
}

/* x_a: a span by its mass, then a token by the span's weights relative to its maximum. */
static int64_t draw_whole(const Logits *l, int64_t row, const float *span_max, const double *mass,
                          const double *cdf, int64_t spans, float inv_t, double u, float *logit) {
    const double target = u * cdf[spans - 1];
    const int64_t j = search(cdf, spans, target);
    const double before = j > 0 ? cdf[j - 1] : 0.0;
    const double frac = clamp01((target - before) / mass[j]);
    const float *v = span_at(l, row, j);
    double w[SPAN];
    span_cumulative(v, span_max[j], inv_t, -INFINITY, w);
    const int64_t within = search(w, SPAN, frac * w[SPAN - 1]);
    *logit = v[within];
    return j * SPAN + within;
}

/* The inverse CDF of u over the logits >= theta, in id order (span_sampler._draw_above). */
static int64_t draw_above(const Logits *l, int64_t row, const float *span_max, int64_t spans, float peak,
                          float inv_t, float theta, double u, double *mass, double *cdf) {
    double acc = 0.0, w[SPAN];
    for (int64_t j = 0; j < spans; j++) {
        double m = 0.0;
        if (span_max[j] >= theta) {
            span_cumulative(span_at(l, row, j), peak, inv_t, theta, w);
            m = w[SPAN - 1];
        }
        mass[j] = m;
        acc += m;
        cdf[j] = acc;
    }
    const double target = u * cdf[spans - 1];
    const int64_t j = search(cdf, spans, target);
    const double before = j > 0 ? cdf[j - 1] : 0.0;
    const double frac = clamp01((target - before) / mass[j]);
    span_cumulative(span_at(l, row, j), peak, inv_t, theta, w);
    return j * SPAN + search(w, SPAN, frac * w[SPAN - 1]);
}

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

typedef struct {
    float value;
    int64_t span;
} Ranked;

static int ranked_descending(const void *a, const void *b) {
    const float x = ((const Ranked *)a)->value, y = ((const Ranked *)b)->value;
    return (x < y) - (x > y);
}

/* The `count` spans with the largest maxima (any order) into spans_out; returns the largest
 * maximum left out (-inf where there is none). */
static float candidates(const float *span_max, int64_t spans, int64_t count, int64_t *spans_out) {
    if (count >= spans) {
        for (int64_t j = 0; j < spans; j++) spans_out[j] = j;
        return -INFINITY;
    }
    if (count + 1 <= INSERTION_CANDIDATES) {
        Ranked top[INSERTION_CANDIDATES]; /* descending, count + 1 of them */
        int64_t held = 0;
        for (int64_t j = 0; j < spans; j++) {
            /* once full, a whole vector of maxima none above the last held one is passed over */
            if (held == count + 1 && j % LANES == 0 && j + LANES <= spans &&
                !(lanes_max(load_f32(span_max + j)) > top[held - 1].value)) {
                j += LANES - 1;
                continue;
            }
            const float v = span_max[j];
            if (held == count + 1 && !(v > top[held - 1].value)) continue;
            int64_t at = held < count + 1 ? held++ : held - 1;
            while (at > 0 && top[at - 1].value < v) {
                top[at] = top[at - 1];
                at--;
            }
            top[at] = (Ranked){v, j};
        }
        for (int64_t i = 0; i < count; i++) spans_out[i] = top[i].span;
        return top[count].value;
    }
    Ranked *all = malloc((size_t)spans * sizeof *all);
    if (!all) return NAN;
    for (int64_t j = 0; j < spans; j++) all[j] = (Ranked){span_max[j], j};
    qsort(all, (size_t)spans, sizeof *all, ranked_descending);
    for (int64_t i = 0; i < count; i++) spans_out[i] = all[i].span;
    const float bound = all[count].value;
    free(all);
    return bound;
}

/* The first i with (sum of w[0 .. i-1]) >= needed among w of the sorted values, or n where
 * none: the position after the nucleus's last token (span_sampler._nucleus_cut's drop). */
static int64_t first_dropped(const float *sorted, int64_t n, float peak, float inv_t, double needed) {
    double before = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (before >= needed) return i;
        before += (double)weight(sorted[i], peak, inv_t);
    }
    return n;
}

/* What the candidates say of a filtered row's threshold. */
typedef enum { DECIDED, OPEN, NOT_HERE } Verdict;

typedef struct {
    float theta;   /* the decided threshold (OPEN: min-p's alone) */
    float bound;   /* OPEN: the largest logit outside the candidates */
    double needed; /* OPEN: the mass a kept draw's higher logits stay short of */
} Threshold;

/* A filtered row's threshold from its candidates: DECIDED; OPEN where the nucleus (without
 * top-k) reaches below `bound`, so that draws at or below bound are decided one at a time
 * (kept_in_nucleus); NOT_HERE where a top-k's k-th largest logit is at or below bound, or
 * its candidates would be more than MAX_CANDIDATE_SPANS spans. */
static Verdict threshold(const Logits *l, int64_t row, const float *span_max, const double *mass, int64_t spans,
                         double total, float peak, float inv_t, int64_t top_k, float top_p,
                         int64_t candidate_spans, Threshold *t) {
    const int64_t count = top_k > candidate_spans ? top_k : candidate_spans;
    const int64_t n_spans = count < spans ? count : spans;
    if (n_spans > MAX_CANDIDATE_SPANS) return NOT_HERE;
    int64_t *spans_in = malloc((size_t)n_spans * sizeof *spans_in);
    float *above = malloc((size_t)n_spans * SPAN * sizeof *above);
    Verdict verdict = NOT_HERE;
    if (!spans_in || !above) goto done;
    const float bound = candidates(span_max, spans, count, spans_in);
    if (isnan(bound)) goto done;
    /* the candidates' logits are read below: their lines asked for all at once, not one
     * miss after another (logits not held are computed when read instead) */
    if (!l->fill)
        for (int64_t i = 0; i < n_spans; i++)
            if (span_max[spans_in[i]] > bound) {
                const char *v = (const char *)span_at(l, row, spans_in[i]);
                for (int b = 0; b < SPAN * (int)sizeof(float); b += 64) __builtin_prefetch(v + b);
            }
    const double needed_all = (double)top_p * total;
    t->bound = bound;
    t->needed = needed_all;
    if (top_k == 0) { /* a nucleus wider than the candidates' masses: open */
        double held = 0.0;
        for (int64_t i = 0; i < n_spans; i++) held += mass[spans_in[i]];
        if (held < needed_all) {
            verdict = OPEN;
            goto done;
        }
    }
    int64_t n = 0; /* every logit above bound, all in the candidates */
    for (int64_t i = 0; i < n_spans; i++) {
        if (!(span_max[spans_in[i]] > bound)) continue;
        const float *v = span_at(l, row, spans_in[i]);
        for (int k = 0; k < SPAN; k++) { /* written always, kept if above: no branch to mispredict */
            above[n] = v[k];
            n += v[k] > bound;
        }
    }
    qsort(above, (size_t)n, sizeof *above, descending);
    float floor = -INFINITY;
    if (top_k > 0) {
        if (top_k > n) goto done; /* the k-th largest is at or below bound: ties outside */
        floor = above[top_k - 1];
    }
    t->theta = fmaxf(t->theta, floor);
    verdict = DECIDED;
    if (top_p < 1.0f) {
        if (top_k > 0) { /* the nucleus of the top-k survivors (ties with floor included) */
            int64_t survivors = top_k;
            while (survivors < n && above[survivors] >= floor) survivors++;
            double kept = 0.0;
            for (int64_t i = 0; i < survivors; i++) kept += (double)weight(above[i], peak, inv_t);
            const int64_t f = first_dropped(above, survivors, peak, inv_t, (double)top_p * kept);
            if (f < survivors) t->theta = fmaxf(t->theta, above[f > 0 ? f - 1 : 0]);
        } else if (needed_all <= 1.0 && peak > bound) { /* the top logit alone holds it */
            t->theta = fmaxf(t->theta, peak);
        } else {
            double all = 0.0;
            for (int64_t i = 0; i < n; i++) all += (double)weight(above[i], peak, inv_t);
            if (all < needed_all) { /* the nucleus reaches below bound */
                verdict = OPEN;
            } else {
                const int64_t f = first_dropped(above, n, peak, inv_t, needed_all);
                t->theta = fmaxf(t->theta, above[f > 0 ? f - 1 : 0]);
            }
        }
    }
done:
    free(spans_in);
    free(above);
    return verdict;
}

/* In an open nucleus, is a draw with logit `level` (at most bound) kept: is the mass of the
 * logits strictly above it short of `needed`? As span_sampler._short_of: bounds from the
 * spans whose maximum passes level (at least their maxima's weights, at most their whole
 * masses), the spans read only where those leave it open. */
static int kept_in_nucleus(const Logits *l, int64_t row, const float *span_max, const float *span_sum,
                           int64_t spans, float peak, float inv_t, float level, double needed) {
    double lower = 0.0, upper = 0.0;
    for (int64_t j = 0; j < spans; j++)
        if (span_max[j] > level) {
            const float w = weight(span_max[j], peak, inv_t);
            lower += (double)w;
            upper += (double)(w * span_sum[j]);
        }
    if (upper < needed) return 1;
    if (!(lower < needed)) return 0;
    double exact = 0.0;
    for (int64_t j = 0; j < spans; j++)
        if (span_max[j] > level) {
            const float *v = span_at(l, row, j);
            for (int i = 0; i < SPAN; i++)
                if (v[i] > level) exact += (double)weight(v[i], peak, inv_t);
        }
    return exact < needed;
}

static int64_t draw_row(const Logits *l, int64_t row, const float *span_max, const float *span_sum,
                        int64_t spans, float inv_t, int greedy, int64_t top_k, float top_p, float min_p,
                        const double *u, int attempts, int64_t candidate_spans, double *mass, double *cdf) {
    const float peak = row_max(span_max, spans);
    if (peak == -INFINITY) return MASKED; /* every token masked: the caller reports the row */
    int64_t peak_span = 0;
    while (span_max[peak_span] != peak) peak_span++;
    if (greedy) {
        const float *v = span_at(l, row, peak_span);
        int i = 0;
        while (i < SPAN - 1 && v[i] != peak) i++;
        return peak_span * SPAN + i;
    }
    /* the span masses relative to exp(peak / T), as draw_fast weighs them */
    const vf by_t = splat(inv_t), lowest = splat(EXP_FLOOR_SPANS), top = splat(peak);
    int64_t j = 0;
    for (; j + LANES <= spans; j += LANES) {
        const vf e = exp_nonpositive(vmax((load_f32(span_max + j) - top) * by_t, lowest)) * load_f32(span_sum + j);
        for (int i = 0; i < LANES; i++) mass[j + i] = (double)e[i];
    }
    for (; j < spans; j++) mass[j] = (double)(weight(span_max[j], peak, inv_t) * span_sum[j]);
    double acc = 0.0;
    for (j = 0; j < spans; j++) {
        acc += mass[j];
        cdf[j] = acc;
    }
    float logit;
    if (top_k <= 0 && top_p >= 1.0f && min_p <= 0.0f)
        return draw_whole(l, row, span_max, mass, cdf, spans, inv_t, u[0], &logit);
    Threshold t = {peak + logf(min_p) / inv_t, INFINITY, 0.0};
    Verdict verdict = DECIDED;
    if (top_k > 0 || top_p < 1.0f) {
        verdict = threshold(l, row, span_max, mass, spans, cdf[spans - 1], peak, inv_t, top_k, top_p, candidate_spans,
                            &t);
        if (verdict == NOT_HERE) return UNDECIDED;
    }
    for (int a = 0; a < attempts; a++) {
        const int64_t token = draw_whole(l, row, span_max, mass, cdf, spans, inv_t, u[a], &logit);
        if (!(logit >= t.theta)) continue;
        if (verdict == DECIDED || logit > t.bound ||
            kept_in_nucleus(l, row, span_max, span_sum, spans, peak, inv_t, logit, t.needed))
            return token;
    }
    /* every draw rejected: an open nucleus's cut needs the whole row (draw_fast sorts it) */
    if (verdict == OPEN) return UNDECIDED;
    return draw_above(l, row, span_max, spans, peak, inv_t, t.theta, u[attempts], mass, cdf);
}

/* SplitMix64's finaliser (sampling_keys._mix). */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Draw k of (seed, position) as sampling_keys.uniforms computes it: output
 * per_position * position + k of SplitMix64 from the seed, its top 53 bits in [0, 1). */
static inline double keyed_uniform(uint64_t seed, int64_t position, int64_t per_position, int k) {
    const uint64_t counter = (uint64_t)position * (uint64_t)per_position + (uint64_t)k;
    const uint64_t z = mix64(mix64(seed) + (counter + 1) * 0x9E3779B97F4A7C15ull);
    return (double)(z >> 11) * 0x1p-53;
}

/* Both entries' loop: draws from u [rows, attempts + 1], or where u is NULL keyed by
 * seeds[r] and positions[r]; an all-masked row MASKED where report_masked, else 0. */
static int draw_rows(const Logits *l, int64_t rows, int64_t spans, const float *span_max, const float *span_sum,
                     const float *inv_t, const uint8_t *greedy, const int64_t *top_k, const float *top_p,
                     const float *min_p, const double *u, const uint64_t *seeds, const int64_t *positions,
                     int64_t per_position, int32_t attempts, int64_t candidate_spans, int report_masked,
                     int64_t *tokens, int32_t num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows > 1)
    {
        double *mass = malloc((size_t)spans * sizeof *mass), *cdf = malloc((size_t)spans * sizeof *cdf);
        if (!mass || !cdf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (!mass || !cdf) continue;
            double keyed[MAX_DRAWS];
            const double *draws = u ? u + r * (attempts + 1) : keyed;
            if (!u)
                for (int k = 0; k <= attempts; k++) keyed[k] = keyed_uniform(seeds[r], positions[r], per_position, k);
            const int64_t token = draw_row(l, r, span_max + r * spans, span_sum + r * spans, spans, inv_t[r],
                                           greedy[r], top_k[r], top_p[r], min_p[r], draws, attempts, candidate_spans,
                                           mass, cdf);
            tokens[r] = token == MASKED && !report_masked ? 0 : token;
        }
        free(mass);
        free(cdf);
    }
    return failed ? -1 : 0;
}

int32_t span_draw_span(void) { return SPAN; }

/* tokens[r] for rows 0 .. rows - 1 (UNDECIDED where the candidates do not decide theta);
 * span_max, span_sum [rows, spans]; u [rows, attempts + 1]; the logits in `pieces` pieces,
 * piece k at base[k] with row stride ld[k] holding spans first[k] .. first[k + 1] - 1, or,
 * where fill is not NULL, not held: each span read is fill(source, row, span, out).
 * Returns 0, or -1 where scratch could not be allocated. */
int span_draw(float *const *base, const int64_t *ld, const int64_t *first, int64_t rows, int64_t spans,
              const float *span_max, const float *span_sum, const float *inv_t, const uint8_t *greedy,
              const int64_t *top_k, const float *top_p, const float *min_p, const double *u, int32_t attempts,
              int64_t candidate_spans, int64_t *tokens, int32_t num_threads, SpanFill fill, const void *source) {
    const Logits l = {base, ld, first, fill, source};
    return draw_rows(&l, rows, spans, span_max, span_sum, inv_t, greedy, top_k, top_p, min_p, u, NULL, NULL, 0,
                     attempts, candidate_spans, 0, tokens, num_threads);
}

/* span_draw with each row's draws keyed by (seeds[r], positions[r]) as sampling_keys
 * computes them (per_position: its DRAWS_PER_POSITION; attempts + 1 <= MAX_DRAWS), and a
 * row whose every token is masked marked MASKED. Returns 0, -1 where scratch could not be
 * allocated, -2 where attempts + 1 is more than MAX_DRAWS or per_position. */
int span_draw_keyed(float *const *base, const int64_t *ld, const int64_t *first, int64_t rows, int64_t spans,
                    const float *span_max, const float *span_sum, const float *inv_t, const uint8_t *greedy,
                    const int64_t *top_k, const float *top_p, const float *min_p, const uint64_t *seeds,
                    const int64_t *positions, int64_t per_position, int32_t attempts, int64_t candidate_spans,
                    int64_t *tokens, int32_t num_threads, SpanFill fill, const void *source) {
    if (attempts + 1 > MAX_DRAWS || attempts + 1 > per_position) return -2;
    const Logits l = {base, ld, first, fill, source};
    return draw_rows(&l, rows, spans, span_max, span_sum, inv_t, greedy, top_k, top_p, min_p, NULL, seeds, positions,
                     per_position, attempts, candidate_spans, 1, tokens, num_threads);
}
