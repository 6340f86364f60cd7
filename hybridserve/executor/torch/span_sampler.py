"""Drawing tokens from SpanLogits: a general path over whole rows and a fast path over spans.

What both compute, for a row with temperature T > 0, top_k, top_p, min_p and draw u:

- kept: the logits l >= theta, theta the largest of three thresholds (each -inf when its
  filter is off): the k-th largest logit (ties with it stay); the nucleus cut, the
  smallest logit of the shortest prefix of the top-k survivors (sorted, renormalised)
  whose mass reaches top_p (ties with it stay); and max + T * ln(min_p). All three keep
  a prefix of the sorted logits, so applying them in turn (temperature -> top-k -> top-p
  -> min-p) is their intersection.
- the token: inverse CDF of u over the kept tokens in id order, with weights
  exp((l - max) / T): the smallest id t with (kept mass up to t) > u * (kept mass).
  u ~ U[0, 1) makes that an exact draw from the filtered, tempered distribution.
Greedy rows take the first id of the row's maximum, as argmax does.

The general path (`draw_general`) does this on one whole row in float64, with a full
sort for top-p: the reference. The fast path (`draw_fast`) reads the span summaries
(models/span_logits.py) and, mostly, the logits of a few spans only:

- no filter: a span by inverse CDF over the span masses, then a token inside it;
- filters: the CANDIDATE_SPANS spans with the largest maxima (at least top_k of them)
  hold every logit above `bound`, the largest maximum of the spans left out, in the
  row's sorted order. A threshold that lies above `bound` is decided on them (the k-th
  largest, the nucleus cut; min-p's needs only the row's maximum). Where it cannot be (a
  nucleus reaching below `bound`, ties of the k-th value with `bound`) it is decided on
  the whole row (partial sorts of growing length). The draw is over the candidates
  when theta > bound, else over whole rows: span masses above theta, then a span, then
  a token (one pass over the row, no sort).
The two paths agree up to float rounding (tests/test_span_sampler.py).
"""

from __future__ import annotations

import torch

from hybridserve.models.span_logits import SpanLogits

# Spans gathered for a filtered row (and at least its top_k): 32 x 128 = 4096 candidate logits.
CANDIDATE_SPANS = 32
# Sorted prefixes of the candidates tried in turn for the nucleus cut: a full sort of
# 4096 logits per row costs several times a partial one, and nuclei are mostly short.
NUCLEUS_PREFIXES = (64, 512)
# The same over a whole row, for a nucleus wider than the candidates.
WHOLE_ROW_PREFIXES = (4096, 32768)
NEG_INF = float("-inf")


def draw_fast(sl: SpanLogits, greedy: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row. A row whose logits are all -inf gets token 0 (the caller
    reports it)."""
    rows = sl.num_rows
    peak, peak_span = sl.span_max.max(dim=1)  # the first span holding the row's maximum
    alive = peak > NEG_INF
    greedy = greedy & alive
    base = torch.arange(rows) * sl.padded.shape[1]
    flat = sl.padded.view(-1)
    tokens = torch.zeros(rows, dtype=torch.long)
    g = greedy.nonzero().squeeze(1)
    if g.numel():
        values = _span_values(flat, base[g], peak_span[g], sl.span)
        tokens[g] = peak_span[g] * sl.span + values.max(dim=1).indices
    filtered = alive & ~greedy & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
    r = (alive & ~greedy & ~filtered).nonzero().squeeze(1)
    if r.numel():
        tokens[r] = _draw_unfiltered(sl, flat, r, base[r], peak[r], u[r])
    r = filtered.nonzero().squeeze(1)
    if r.numel():
        tokens[r] = _draw_filtered(sl, flat, r, base[r], peak[r], top_k[r], top_p[r], min_p[r], u[r])
    return tokens


def _span_values(flat: torch.Tensor, base: torch.Tensor, spans: torch.Tensor, span: int) -> torch.Tensor:
    """[r, span] logits of span spans[i] of row i (base: each row's offset in flat)."""
    return flat[(base + spans * span)[:, None] + torch.arange(span)]


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first column where the non-decreasing cdf [r, n] exceeds target [r]; a
    target that rounding lifted to the row's total takes the first column reaching it,
    which has weight (never a zero-weight column after the last real one)."""
    at = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    over = at >= cdf.shape[1]
    if over.any():
        at[over] = torch.searchsorted(cdf[over], cdf[over, -1:], right=False).squeeze(1)
    return at


def _draw_unfiltered(sl: SpanLogits, flat: torch.Tensor, r: torch.Tensor, base: torch.Tensor, peak: torch.Tensor,
                     u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over the span masses, then over the chosen span's logits."""
    inv_t = sl.inv_temperature[r]
    mass = (torch.exp((sl.span_max[r] - peak[:, None]) * inv_t[:, None]) * sl.span_sum[r]).double()
    cdf = mass.cumsum(dim=1)
    target = u * cdf[:, -1]
    j = _search(cdf, target)
    before = torch.where(j > 0, cdf.gather(1, (j - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    # Where the target falls inside span j, as a fraction of the span's own mass: the
    # span's logits are weighed again below, so their sum need not equal span_sum exactly.
    frac = ((target - before) / mass.gather(1, j[:, None]).squeeze(1)).clamp(0.0, 1.0)
    values = _span_values(flat, base, j, sl.span)
    w = torch.exp((values - sl.span_max[r, j][:, None]) * inv_t[:, None]).double().cumsum(dim=1)
    return j * sl.span + _search(w, frac * w[:, -1])


def _candidates(sl: SpanLogits, flat: torch.Tensor, r: torch.Tensor, base: torch.Tensor, num_spans: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids [r, n] in id order, their logits, bound [r]: the largest logit outside them)."""
    span_max = sl.span_max[r]
    total = span_max.shape[1]
    if num_spans >= total:
        spans = torch.arange(total).expand(len(r), total)
        bound = torch.full((len(r),), NEG_INF)
    else:
        top = span_max.topk(num_spans + 1, dim=1)
        spans = top.indices[:, :num_spans].sort(dim=1).values
        bound = top.values[:, num_spans]
    ids = (spans[:, :, None] * sl.span + torch.arange(sl.span)).view(len(r), -1)
    return ids, flat[base[:, None] + ids], bound


def _draw_filtered(sl: SpanLogits, flat: torch.Tensor, r: torch.Tensor, base: torch.Tensor, peak: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor
                   ) -> torch.Tensor:
    """The threshold theta of each row from its candidates where they decide it (whole rows
    where they cannot), then the draw over the candidates, or over whole rows where the
    kept set is wider than them."""
    inv_t = sl.inv_temperature[r]
    ids, cand, bound = _candidates(sl, flat, r, base, max(CANDIDATE_SPANS, int(top_k.max())))
    n = cand.shape[1]
    theta = torch.full((len(r),), NEG_INF)
    has_k = top_k > 0
    if has_k.any():
        kth = cand.topk(min(int(top_k.max()), n), dim=1).values
        theta = torch.where(has_k, kth.gather(1, (top_k.clamp(1, n) - 1)[:, None]).squeeze(1), theta)
        tied = (has_k & (theta <= bound)).nonzero().squeeze(1)  # ties with a logit outside the candidates
        if tied.numel():
            whole = sl.padded[r[tied]].topk(int(top_k[tied].max()), dim=1).values
            theta[tied] = whole.gather(1, (top_k[tied] - 1)[:, None]).squeeze(1)
    p = (top_p < 1.0).nonzero().squeeze(1)
    if p.numel():
        theta[p] = torch.maximum(theta[p], _top_p_cut(sl, r[p], cand[p], bound[p], theta[p], has_k[p] & (theta[p] > bound[p]),
                                                      peak[p], inv_t[p], top_p[p]))
    theta = torch.maximum(theta, peak + torch.log(min_p) / inv_t)
    tokens = torch.empty(len(r), dtype=torch.long)
    inside = theta > bound  # every kept logit is a candidate
    i = inside.nonzero().squeeze(1)
    if i.numel():
        weight = torch.exp((cand[i] - peak[i, None]) * inv_t[i, None]).masked_fill_(cand[i] < theta[i, None], 0.0)
        cdf = weight.double().cumsum(dim=1)
        tokens[i] = ids[i].gather(1, _search(cdf, u[i] * cdf[:, -1])[:, None]).squeeze(1)
    o = (~inside).nonzero().squeeze(1)
    if o.numel():
        tokens[o] = _draw_above(sl, r[o], peak[o], theta[o], u[o])
    return tokens


def _top_p_cut(sl: SpanLogits, r: torch.Tensor, cand: torch.Tensor, bound: torch.Tensor, floor: torch.Tensor,
               floor_inside: torch.Tensor, peak: torch.Tensor, inv_t: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus cut of rows r (their top-k floor applied first: -inf without top-k). From
    the candidates where the cut lies above `bound` (their sorted order is the row's there),
    else from the whole row."""
    # The mass the nucleus is a share of: the top-k survivors' (a sum over candidates when
    # they hold them all), else the whole row's, from the span masses.
    row_mass = (torch.exp((sl.span_max[r] - peak[:, None]) * inv_t[:, None]) * sl.span_sum[r]).double().sum(dim=1)
    weight = torch.exp((cand - peak[:, None]) * inv_t[:, None]).masked_fill_(cand < floor[:, None], 0.0)
    mass = torch.where(floor_inside, weight.double().sum(dim=1), row_mass)
    whole_k = (floor > NEG_INF) & ~floor_inside
    if whole_k.any():
        w = sl.padded[r[whole_k]]
        mass[whole_k] = torch.exp((w - peak[whole_k, None]) * inv_t[whole_k, None]).masked_fill_(
            w < floor[whole_k, None], 0.0).double().sum(dim=1)
    needed = top_p.double() * mass
    cut, found = _nucleus_cut(cand, floor, peak, inv_t, needed, NUCLEUS_PREFIXES)
    redo = (~found | (cut <= bound)).nonzero().squeeze(1)
    if redo.numel():
        cut[redo], _ = _nucleus_cut(sl.padded[r[redo]], floor[redo], peak[redo], inv_t[redo], needed[redo],
                                    WHOLE_ROW_PREFIXES)
    return cut


def _draw_above(sl: SpanLogits, r: torch.Tensor, peak: torch.Tensor, theta: torch.Tensor, u: torch.Tensor
                ) -> torch.Tensor:
    """Inverse CDF over the logits >= theta of whole rows r: span masses under the threshold,
    a span, then a token inside it."""
    inv_t = sl.inv_temperature[r]
    spans = sl.padded[r].view(len(r), -1, sl.span)
    w = torch.sub(spans, peak[:, None, None]).mul_(inv_t[:, None, None]).exp_()
    w.masked_fill_(spans < theta[:, None, None], 0.0)
    mass = w.sum(dim=-1).double()
    cdf = mass.cumsum(dim=1)
    target = u * cdf[:, -1]
    j = _search(cdf, target)
    before = torch.where(j > 0, cdf.gather(1, (j - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    frac = ((target - before) / mass.gather(1, j[:, None]).squeeze(1)).clamp(0.0, 1.0)
    within = w[torch.arange(len(r)), j].double().cumsum(dim=1)
    return j * sl.span + _search(within, frac * within[:, -1])


def _nucleus_cut(cand: torch.Tensor, floor: torch.Tensor, peak: torch.Tensor, inv_t: torch.Tensor,
                 needed: torch.Tensor, prefixes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cut, found) per row: the smallest logit of the shortest sorted prefix of the
    candidates >= floor whose mass reaches `needed` (the first token whose preceding mass
    reaches it is dropped, so the top token always stays); found is False where no
    prefix of the candidates reaches it. Sorted prefixes of the given lengths are tried
    in turn, then the whole sort."""
    rows = cand.shape[0]
    cut = torch.full((rows,), NEG_INF)
    found = torch.zeros(rows, dtype=torch.bool)
    todo = torch.arange(rows)
    for q in (*(q for q in prefixes if q < cand.shape[1]), cand.shape[1]):
        values = cand[todo].topk(q, dim=1).values  # descending
        w = torch.exp((values - peak[todo, None]) * inv_t[todo, None]).masked_fill_(values < floor[todo, None], 0.0)
        w = w.double()
        drop = (w.cumsum(dim=1) - w) >= needed[todo, None]
        hit = drop.any(dim=1)
        first = drop.to(torch.uint8).argmax(dim=1)  # the first dropped position (>= 1)
        done = todo[hit]
        cut[done] = values[hit].gather(1, (first[hit] - 1).clamp(min=0)[:, None]).squeeze(1)
        found[done] = True
        todo = todo[~hit]
        if not todo.numel():
            break
    return cut, found


def draw_general(logits: torch.Tensor, inv_t: float, greedy: bool, top_k: int, top_p: float, min_p: float,
                 u: float) -> int:
    """One row [V], whole, in float64: what draw_fast computes from span summaries."""
    if greedy:
        return int(logits.max(dim=0).indices)
    x = logits.double()
    peak = x.max()
    weight = torch.exp((x - peak) * inv_t)
    theta = torch.tensor(NEG_INF, dtype=torch.float64)
    if top_k > 0:
        theta = x.topk(min(top_k, x.shape[0])).values[-1]
    if top_p < 1.0:
        values = x.sort(descending=True).values
        w = torch.exp((values - peak) * inv_t).masked_fill_(values < theta, 0.0)
        drop = (w.cumsum(dim=0) - w) >= top_p * weight.masked_fill(x < theta, 0.0).sum()
        if drop.any():
            theta = torch.maximum(theta, values[int(drop.to(torch.uint8).argmax()) - 1])
    if min_p > 0.0:
        theta = torch.maximum(theta, peak + torch.log(torch.tensor(min_p, dtype=torch.float64)) / inv_t)
    cdf = weight.masked_fill_(x < theta, 0.0).cumsum(dim=0)
    return int(_search(cdf[None], torch.tensor([u * float(cdf[-1])], dtype=torch.float64))[0])
