"""Drawing tokens from SpanLogits: a general path over whole rows and a fast path over spans.

What both compute, for a row with temperature T > 0, top_k, top_p, min_p and draws
u_0..u_A (A = ATTEMPTS, sampling_keys.py):

- kept: the logits l >= theta, theta the largest of three thresholds (each -inf when its
  filter is off): the k-th largest logit (ties with it stay); the nucleus cut, the
  smallest logit of the shortest prefix of the top-k survivors (sorted, renormalised)
  whose mass reaches top_p (ties with it stay); and max + T * ln(min_p). All three keep
  a prefix of the sorted logits, so applying them in turn (temperature -> top-k -> top-p
  -> min-p) is their intersection.
- the token: for a = 0..A-1, x_a = the inverse CDF of u_a over the whole vocabulary in id
  order (weights exp((l - max) / T)); the first kept x_a is the token (rejection
  sampling: a kept draw is a draw from the kept set). If none is kept, the inverse CDF of
  u_A over the kept tokens. Either way an exact draw from the filtered, tempered
  distribution; an unfiltered row keeps x_0.
Greedy rows take the first id of the row's maximum, as argmax does.

The general path (`draw_general`) does this on one whole row in float64, with a full
sort for top-p: the reference. The fast path (`draw_fast`) reads the span summaries
(models/layers/span_logits.py) and, mostly, the logits of a few spans only:

- x_a: a span by inverse CDF over the span masses, then a token inside it; every
  attempt's x_a of every row at once (a few spans more than needed, far fewer tensor
  operations than an attempt at a time);
- whether x_a is kept: the CANDIDATE_SPANS spans with the largest maxima (at least
  top_k of them) hold every logit above `bound`, the largest maximum of the spans left
  out, in the row's sorted order (a nucleus without top-k wider than the candidates can
  hold, by the span masses, gathers none). A threshold above `bound` is decided on them (the k-th
  largest, the nucleus cut); a row whose top-k survivors all lie above `bound` has its
  nucleus cut from its sorted top-k values, the candidates neither weighed nor sorted again;
  a nucleus the top logit alone holds (its weight, 1, reaches the needed mass) is cut at
  the maximum without a sort; the others sort no more of their candidates than lie above
  `bound`, where any cut they can use lies. min-p's needs only the row's maximum: a row with min-p
  alone gathers no candidates. A nucleus reaching below `bound` keeps every l_x > bound;
  below it, x is kept iff the mass strictly above l_x is short of top_p's share (read
  from the spans whose maximum passes l_x), decided for the first attempt not rejected
  outright, then the next, until one is kept;
- after A rejected draws (rare for a nucleus, whose kept mass is at least top_p; less
  so for a min-p that keeps little mass) theta is decided on the whole row where the candidates
  cannot (partial sorts of growing length), and the draw is over the kept mass of the
  spans whose maximum reaches theta (read from those spans only), then a span, then a
  token.
The two paths agree up to float rounding (tests/executor/test_span_sampler.py).

`draw`, what the sampler calls, runs draw_fast's rule row by row in C (span_draw.c) where
that is built, and draw_fast itself for the rows the C code leaves undecided (a k-th
largest logit among ties outside the candidates, an open nucleus whose every draw is
rejected): the same tokens (tests/executor/test_span_draw.py).
"""

from __future__ import annotations

from functools import cache

import torch

from hybridserve.executor.torch.span_draw import UNDECIDED, NativeDraw
from hybridserve.models.layers.span_logits import SPAN, SpanLogits, span_logits_from
from hybridserve.models.platform.native_build import checked

# Spans gathered for a filtered row (and at least its top_k): 16 x 128 = 2048 candidate
# logits. A cut they cannot decide stays exact (decided draw by draw): fewer candidates
# cost less to gather and to sort than the few more undecided rows they leave.
CANDIDATE_SPANS = 16
# Sorted prefixes of the candidates tried in turn for the nucleus cut: a full sort of
# 2048 logits per row costs several times a partial one, and nuclei are mostly short.
NUCLEUS_PREFIXES = (64, 512)
# The same over a whole row, for a nucleus wider than the candidates.
WHOLE_ROW_PREFIXES = (512, 4096, 32768)
NEG_INF = float("-inf")
# Draws from the whole distribution tried before drawing from the kept set itself.
ATTEMPTS = 4


def draw(sl: SpanLogits, greedy: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
         u: torch.Tensor) -> torch.Tensor:
    """draw_fast's tokens: the native draw's (span_draw.c) where it is built and decides a
    row, draw_fast's for the rows it leaves undecided (the others passed to it as greedy
    rows, which cost it least), or for every row where it cannot run."""
    native = native_draw()
    tokens = native(sl, greedy, top_k, top_p, min_p, u, ATTEMPTS, CANDIDATE_SPANS) if native is not None else None
    if tokens is None:
        return draw_fast(sl, greedy, top_k, top_p, min_p, u)
    undecided = (tokens == UNDECIDED).nonzero().squeeze(1).tolist()
    if undecided:
        tokens[undecided] = torch.tensor(draw_undecided(sl, undecided, top_k, top_p, min_p, u))
    return tokens


def draw_undecided(sl: SpanLogits, rows: list[int], top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, u: torch.Tensor) -> list[int]:
    """draw_fast's tokens of `rows` (rows the native draw left UNDECIDED, never greedy), the
    batch's other rows passed to it as greedy rows, which cost it least."""
    greedy = torch.ones(sl.num_rows, dtype=torch.bool)
    greedy[rows] = False
    return draw_fast(sl, greedy, top_k, top_p, min_p, u)[rows].tolist()


@cache
def native_draw() -> NativeDraw | None:
    return checked(lambda: NativeDraw(SPAN), _draw_mismatch, "sampling draws in draw_fast")


def _draw_mismatch(native: NativeDraw) -> str:
    """'' where the native draw gives draw_fast's tokens on a small batch of every kind of
    row (greedy, temperature, top-k, top-p, min-p, their mix, a masked token)."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 12, 8 * SPAN
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[3, :5] = float("-inf")
    sl = span_logits_from(logits, torch.linspace(0.5, 2.0, rows))
    greedy = torch.arange(rows) % 6 == 0
    top_k = torch.tensor([0, 0, 5, 0, 40, 0, 0, 3, 0, 0, 50, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 1.0, 1.0, 0.7, 1.0, 0.95, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.02, 0.0, 0.3])
    u = torch.rand(rows, ATTEMPTS + 1, generator=g, dtype=torch.float64)
    got = native(sl, greedy, top_k, top_p, min_p, u, ATTEMPTS, CANDIDATE_SPANS)
    if got is None:
        return "it does not read float32 logits"
    want = draw_fast(sl, greedy, top_k, top_p, min_p, u)
    decided = got != UNDECIDED
    if not torch.equal(got[decided], want[decided]):
        return f"tokens {got.tolist()} where draw_fast draws {want.tolist()}"
    return ""


def draw_fast(sl: SpanLogits, greedy: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row; u [S, ATTEMPTS + 1] float64 are each row's draws. A row whose
    logits are all -inf gets token 0 (the caller reports it)."""
    rows = sl.num_rows
    peak, peak_span = sl.span_max.max(dim=1)  # the first span holding the row's maximum
    alive = peak > NEG_INF
    greedy = greedy & alive
    tokens = torch.zeros(rows, dtype=torch.long)
    g = greedy.nonzero().squeeze(1)
    if g.numel():
        values = sl.take_spans(g, peak_span[g])
        tokens[g] = peak_span[g] * sl.span + values.max(dim=1).indices
    filtered = alive & ~greedy & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
    r = (alive & ~greedy & ~filtered).nonzero().squeeze(1)
    if r.numel():
        tokens[r] = _draw_unfiltered(sl, r, peak[r], u[r, 0])
    r = filtered.nonzero().squeeze(1)
    if r.numel():
        tokens[r] = _draw_filtered(sl, r, peak[r], top_k[r], top_p[r], min_p[r], u[r])
    return tokens


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first column where the non-decreasing cdf [r, n] exceeds target [r] (or
    each of target [r, m]: [r, m]); a target that rounding lifted to the row's total takes
    the first column reaching it, which has weight (never a zero-weight column after the
    last real one)."""
    flat = target.dim() == 1
    at = torch.searchsorted(cdf, target[:, None] if flat else target, right=True)
    over = at >= cdf.shape[1]
    if over.any():
        row = over.nonzero()[:, 0]
        at[over] = torch.searchsorted(cdf[row], cdf[row, -1:], right=False).squeeze(1)
    return at.squeeze(1) if flat else at


def _span_masses(sl: SpanLogits, r: torch.Tensor, peak: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass, cumulative mass) of each span of rows r [n, spans] (r ascending, as nonzero
    gives them), float64, relative to exp(max / T)."""
    every = len(r) == sl.num_rows  # then r is every row in order: no copies of the summaries
    span_max, span_sum = (sl.span_max, sl.span_sum) if every else (sl.span_max[r], sl.span_sum[r])
    inv_t = sl.inv_temperature[r]
    mass = torch.sub(span_max, peak[:, None]).mul_(inv_t[:, None]).exp_().mul_(span_sum).double()
    return mass, mass.cumsum(dim=1)


def _draw_unfiltered(sl: SpanLogits, r: torch.Tensor, peak: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over the span masses, then over the chosen span's logits."""
    return _draw_with_logit(sl, r, peak, u[:, None])[0][:, 0]


def _draw_with_logit(sl: SpanLogits, r: torch.Tensor, peak: torch.Tensor, u: torch.Tensor,
                     masses: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, their logits), both [n, m]: _draw_unfiltered's token for each of a row's m
    draws u [n, m], all at once; `masses`: _span_masses(sl, r, peak), when the caller has
    them."""
    rows, draws = u.shape
    inv_t = sl.inv_temperature[r]
    mass, cdf = masses if masses is not None else _span_masses(sl, r, peak)
    target = u * cdf[:, -1:]
    j = _search(cdf, target)
    before = torch.where(j > 0, cdf.gather(1, (j - 1).clamp(min=0)), 0.0)
    # Where the target falls inside span j, as a fraction of the span's own mass: the
    # span's logits are weighed again below, so their sum need not equal span_sum exactly.
    frac = ((target - before) / mass.gather(1, j)).clamp(0.0, 1.0)
    values = sl.take_spans(r[:, None].expand(rows, draws), j)  # [n, m, span]
    top = sl.span_max[r[:, None], j]  # [n, m]: not a copy of the rows' span maxima
    w = torch.exp((values - top[..., None]) * inv_t[:, None, None]).double().cumsum(dim=-1).view(-1, sl.span)
    within = _search(w, frac.reshape(-1) * w[:, -1]).view(rows, draws)
    return j * sl.span + within, values.gather(2, within[..., None]).squeeze(2)


def _weights(x: torch.Tensor, peak: torch.Tensor, inv_t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp((x - peak) * inv_t) where keep, else 0 (peak, inv_t and keep broadcast against
    x), float32: a product with the mask, which vectorises where masked_fill_ of a
    broadcast mask does not; the same numbers (the weights are at most 1, never inf)."""
    return torch.sub(x, peak).mul_(inv_t).exp_().mul_(keep)


def _weights_in_place(x: torch.Tensor, peak: torch.Tensor, inv_t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """_weights, computed in x itself (a copy the caller has no other use for)."""
    return x.sub_(peak).mul_(inv_t).exp_().mul_(keep)


def _candidate_spans(sl: SpanLogits, r: torch.Tensor, num_spans: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(spans [r, n] in id order, bound [r]: the largest logit outside them): the
    num_spans spans with the largest maxima of rows r, all of them where there are no more."""
    span_max = sl.span_max[r]
    total = span_max.shape[1]
    if num_spans >= total:
        return torch.arange(total).expand(len(r), total), torch.full((len(r),), NEG_INF)
    top = span_max.topk(num_spans + 1, dim=1)
    return top.indices[:, :num_spans].sort(dim=1).values, top.values[:, num_spans]


def _draw_filtered(sl: SpanLogits, r: torch.Tensor, peak: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draws from the whole distribution until one is kept, then (rarely) a draw from the
    kept set: the thresholds from the candidates where they decide them. Rows with min-p
    alone know theta without candidates and gather none, nor do rows whose nucleus is
    wider than the candidates can hold."""
    inv_t = sl.inv_temperature[r]
    n_rows = len(r)
    floor = torch.full((n_rows,), NEG_INF)  # the k-th largest logit
    bound = peak.clone()  # the largest logit outside a row's candidates (none: every logit)
    theta = peak + torch.log(min_p) / inv_t  # decided thresholds
    open_p = torch.zeros(n_rows, dtype=torch.bool)
    needed = torch.zeros(n_rows, dtype=torch.float64)
    masses = _span_masses(sl, r, peak)
    c = ((top_k > 0) | (top_p < 1.0)).nonzero().squeeze(1)
    if c.numel():
        spans, bound_c = _candidate_spans(sl, r[c], max(CANDIDATE_SPANS, int(top_k[c].max())))
        # A nucleus without top-k needs top_p of the whole mass (summed as _kept_mass
        # sums it); where the candidate spans' masses fall short of it, the candidates
        # would leave it open anyway: such a row gathers none, and its draws are decided
        # as an open nucleus's.
        whole = masses[0][c]
        total_c = whole.sum(dim=1)
        wide = (top_k[c] == 0) & (top_p[c] < 1.0)
        needed_c = top_p[c].double() * total_c
        wide &= whole.gather(1, spans).sum(dim=1) < needed_c
        w = c[wide]
        needed[w], open_p[w], bound[w] = needed_c[wide], True, bound_c[wide]
        c, spans, bound_c, total_c = c[~wide], spans[~wide], bound_c[~wide], total_c[~wide]
        if c.numel():
            _thresholds_from_candidates(sl, r[c], spans, bound_c, peak[c], inv_t[c], top_k[c], top_p[c], total_c, c,
                                        floor, bound, theta, open_p, needed)
    # Every attempt's draw at once; then per row the first kept one, deciding the draws
    # an open nucleus leaves in doubt (kept only if the mass above them is short of
    # `needed`) one attempt at a time.
    tokens = torch.empty(n_rows, dtype=torch.long)
    todo = torch.arange(n_rows)
    if ATTEMPTS:
        x, lx = _draw_with_logit(sl, r, peak, u[:, :ATTEMPTS], masses)
        kept = lx >= theta[:, None]
        doubt = kept & open_p[:, None] & (lx <= bound[:, None])
        while True:
            first = kept.to(torch.uint8).argmax(dim=1)  # 0 where none is kept
            ask = (doubt[todo, first] & kept[todo, first]).nonzero().squeeze(1)
            if not ask.numel():
                break
            a = first[ask]
            short = _short_of(sl, r[ask], lx[ask, a], floor[ask], peak[ask], inv_t[ask], needed[ask])
            doubt[ask, a] = False
            kept[ask[~short], a[~short]] = False
        done = kept.any(dim=1)
        tokens[done] = x[done, first[done]]
        todo = todo[~done]
    if not todo.numel():
        return tokens
    # Every draw rejected: decide the open cuts on whole rows, then draw from the kept set.
    o = todo[open_p[todo]]
    if o.numel():
        theta[o] = torch.maximum(theta[o], _whole_row_cut(sl, r[o], floor[o], peak[o], inv_t[o], needed[o]))
    tokens[todo] = _draw_above(sl, r[todo], peak[todo], theta[todo], u[todo, ATTEMPTS])
    return tokens


def _thresholds_from_candidates(sl: SpanLogits, r: torch.Tensor, spans: torch.Tensor, bound_c: torch.Tensor,
                                peak: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                                total: torch.Tensor, c: torch.Tensor, floor: torch.Tensor, bound: torch.Tensor,
                                theta: torch.Tensor, open_p: torch.Tensor, needed: torch.Tensor) -> None:
    """For rows r with top-k or top-p (positions c of the caller's tensors), their
    candidate spans (_candidate_spans) and whole-row masses (total): the k-th largest
    logit (floor), the nucleus cut where the candidates decide it (into theta), else
    open_p with the mass a kept draw's higher logits stay short of (needed), and bound;
    written into the caller's tensors at c."""
    cand = sl.take_spans(r[:, None], spans).view(len(r), -1)
    n = cand.shape[1]
    floor_c = torch.full((len(r),), NEG_INF)
    has_k = top_k > 0
    if has_k.any():
        # One more than the largest top_k: where that one falls below a row's floor, no
        # tie with the floor lies past the sorted values (_nucleus_of_top_k).
        kth = cand.topk(min(int(top_k.max()) + 1, n), dim=1).values
        floor_c = torch.where(has_k, kth.gather(1, (top_k.clamp(1, n) - 1)[:, None]).squeeze(1), floor_c)
        tied = (has_k & (floor_c <= bound_c)).nonzero().squeeze(1)  # ties with a logit outside the candidates
        if tied.numel():
            whole = sl.whole_rows(r[tied]).topk(int(top_k[tied].max()), dim=1).values
            floor_c[tied] = whole.gather(1, (top_k[tied] - 1)[:, None]).squeeze(1)
    theta_c = torch.maximum(floor_c, theta[c])
    # Nucleus: the cut where the candidates decide it; elsewhere the mass a kept draw's
    # higher logits stay short of.
    p = (top_p < 1.0).nonzero().squeeze(1)
    if p.numel() and has_k.any():
        # Rows whose top-k survivors all lie in the candidates: their sorted top values
        # decide the nucleus, without weighing or sorting the candidates again.
        inside = has_k[p] & (floor_c[p] > bound_c[p])
        k_in = p[inside]
        if k_in.numel():
            needed[c[k_in]], cut = _nucleus_of_top_k(kth[k_in], cand, k_in, floor_c[k_in], peak[k_in], inv_t[k_in],
                                                     top_p[k_in])
            theta_c[k_in] = torch.maximum(theta_c[k_in], cut)
        p = p[~inside]
    if p.numel():
        cp = cand if len(p) == len(r) else cand[p]  # p is sorted: all rows is every row in order
        needed_p = top_p[p].double() * _kept_mass(sl, r[p], cp, bound_c[p], floor_c[p], peak[p], inv_t[p], total[p])
        needed[c[p]] = needed_p
        open_c = torch.zeros(len(r), dtype=torch.bool)
        # The top logit alone weighs 1 (the weights are relative to it): where that holds
        # the needed mass the first sorted value is the cut, no sort needed.
        alone = (needed_p <= 1.0) & (peak[p] > bound_c[p])
        if bool(alone.any()):
            a = p[alone]
            theta_c[a] = torch.maximum(theta_c[a], peak[a])
            rest = (~alone).nonzero().squeeze(1)
            p, cp, needed_p = p[rest], cp[rest], needed_p[rest]
        open_c[p] = True
        # Only a row whose candidates above `bound` hold the needed mass has its cut there,
        # within its sorted values above bound and the one after them.
        counted = cp > bound_c[p, None]
        if bool((floor_c[p] > NEG_INF).any()):
            counted &= cp >= floor_c[p, None]
        above = _weights(cp, peak[p, None], inv_t[p, None], counted).sum(dim=1, dtype=torch.float64)
        held = above >= needed_p
        q = p[held]
        if q.numel():
            longest = int(counted[held].sum(dim=1).max()) + 1
            cut, found = _nucleus_cut(cand[q], floor_c[q], peak[q], inv_t[q], needed_p[held], NUCLEUS_PREFIXES,
                                      longest)
            decided = found & (cut > bound_c[q])
            theta_c[q] = torch.where(decided, torch.maximum(theta_c[q], cut), theta_c[q])
            open_c[q] = ~decided
        open_p[c] = open_c
    floor[c] = floor_c
    bound[c] = bound_c
    theta[c] = theta_c


def _nucleus_of_top_k(kth: torch.Tensor, cand: torch.Tensor, rows: torch.Tensor, floor: torch.Tensor,
                      peak: torch.Tensor, inv_t: torch.Tensor, top_p: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(needed, cut) per row whose top-k survivors (its candidates >= floor) all lie in
    the candidates, cand[rows], from kth [n, K]: the candidates' K largest, sorted (K
    greater than the row's top_k, or every candidate). The survivors are kth's prefix >=
    floor and any ties with floor past it (only where kth's last value still reaches floor
    can there be any: counted in cand, each weighing what floor weighs); needed is top_p
    of their mass. The cut is _nucleus_cut's over them; where no token of the prefix is
    dropped, every survivor is kept (ties with floor past the prefix included) and the
    cut is -inf: theta stays floor."""
    survives = kth >= floor[:, None]
    w = _weights(kth, peak[:, None], inv_t[:, None], survives).double()
    ties_past = torch.zeros(len(floor), dtype=torch.long)
    if kth.shape[1] < cand.shape[1]:
        scan = (kth[:, -1] >= floor).nonzero().squeeze(1)
        if scan.numel():
            ties_past[scan] = (cand[rows[scan]] >= floor[scan, None]).sum(dim=1) - survives[scan].sum(dim=1)
    mass = w.sum(dim=1) + ties_past * _weights(floor, peak, inv_t, torch.ones(()).bool()).double()
    needed = top_p.double() * mass
    drop = (w.cumsum(dim=1) - w) >= needed[:, None]
    first = drop.to(torch.uint8).argmax(dim=1)  # the first dropped position (>= 1)
    cut = torch.where(drop.any(dim=1), kth.gather(1, (first - 1).clamp(min=0)[:, None]).squeeze(1), NEG_INF)
    return needed, cut


def _kept_mass(sl: SpanLogits, r: torch.Tensor, cand: torch.Tensor, bound: torch.Tensor, floor: torch.Tensor,
               peak: torch.Tensor, inv_t: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The mass (relative to exp(max / T)) the nucleus is a share of: the top-k survivors'
    (a sum over candidates where they hold them all, else over the whole row), or without
    top-k the whole row's, `total` (the sum of the row's span masses, as _draw_filtered
    has it)."""
    mass = total.clone()
    has_k = floor > NEG_INF
    inside = has_k & (floor > bound)
    if inside.any():
        c = cand[inside]
        mass[inside] = _weights(c, peak[inside, None], inv_t[inside, None], c >= floor[inside, None]).sum(
            dim=1, dtype=torch.float64)
    outside = has_k & ~inside
    if outside.any():
        mass[outside] = _mass_above(sl, r[outside], floor[outside], floor[outside], peak[outside], inv_t[outside],
                                    strict=False)
    return mass


def _short_of(sl: SpanLogits, r: torch.Tensor, level: torch.Tensor, floor: torch.Tensor, peak: torch.Tensor,
              inv_t: torch.Tensor, needed: torch.Tensor) -> torch.Tensor:
    """Per row of r: is the mass of its logits above `level` (and >= floor) below `needed`?
    The spans whose maximum passes `level` bound that mass: at least their maxima's
    weights, at most their whole masses; only rows the bounds leave open are summed."""
    span_max = sl.span_max[r]
    reach = span_max > level[:, None]
    w_max = _weights(span_max, peak[:, None], inv_t[:, None], reach)
    lower = w_max.double().sum(dim=1)
    upper = (w_max * sl.span_sum[r]).double().sum(dim=1)  # a span's mass is relative to its maximum
    short = upper < needed
    open_rows = ((lower < needed) & ~short).nonzero().squeeze(1)
    if open_rows.numel():
        o = open_rows
        short[o] = _mass_above(sl, r[o], level[o], floor[o], peak[o], inv_t[o]) < needed[o]
    return short


def _mass_above(sl: SpanLogits, r: torch.Tensor, level: torch.Tensor, floor: torch.Tensor, peak: torch.Tensor,
                inv_t: torch.Tensor, strict: bool = True) -> torch.Tensor:
    """Per row of r, the mass of its logits above `level` (>= with strict=False) and >=
    floor, read from the spans whose maximum reaches that far only."""
    # One threshold for both conditions: x > level is x >= the next float32 above it.
    edge = torch.maximum(torch.nextafter(level, torch.tensor(float("inf"))) if strict else level, floor)
    row, j = (sl.span_max[r] >= edge[:, None]).nonzero(as_tuple=True)
    mass = torch.zeros(len(r), dtype=torch.float64)
    for at, x in sl.span_blocks(r[row], j):  # in whatever order the pieces give them
        of = row if at is None else row[at]
        x = x.float()  # a model-dtype piece's copy widened (float32 ones stay the copy)
        w = _weights_in_place(x, peak[of, None], inv_t[of, None], x >= edge[of, None])
        mass.index_add_(0, of, w.sum(dim=1, dtype=torch.float64))
    return mass


def _whole_row_cut(sl: SpanLogits, r: torch.Tensor, floor: torch.Tensor, peak: torch.Tensor, inv_t: torch.Tensor,
                   needed: torch.Tensor) -> torch.Tensor:
    cut, _ = _nucleus_cut(sl.whole_rows(r), floor, peak, inv_t, needed, WHOLE_ROW_PREFIXES)
    return cut


def _draw_above(sl: SpanLogits, r: torch.Tensor, peak: torch.Tensor, theta: torch.Tensor, u: torch.Tensor
                ) -> torch.Tensor:
    """Inverse CDF over the logits >= theta of rows r: the kept mass of each span whose
    maximum reaches theta (read from those spans only; the others keep nothing), a span,
    then a token inside it."""
    inv_t = sl.inv_temperature[r]
    spans = sl.span_max.shape[1]
    row, j = (sl.span_max[r] >= theta[:, None]).nonzero(as_tuple=True)
    x = sl.take_spans(r[row], j)
    w = _weights(x, peak[row, None], inv_t[row, None], x >= theta[row, None])
    mass = torch.zeros(len(r), spans, dtype=torch.float64)
    mass[row, j] = w.sum(dim=-1).double()
    cdf = mass.cumsum(dim=1)
    target = u * cdf[:, -1]
    at = _search(cdf, target)
    before = torch.where(at > 0, cdf.gather(1, (at - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    frac = ((target - before) / mass.gather(1, at[:, None]).squeeze(1)).clamp(0.0, 1.0)
    slot = torch.full((len(r), spans), -1, dtype=torch.long)
    slot[row, j] = torch.arange(len(row))
    within = w[slot[torch.arange(len(r)), at]].double().cumsum(dim=1)
    return at * sl.span + _search(within, frac * within[:, -1])


def _nucleus_cut(cand: torch.Tensor, floor: torch.Tensor, peak: torch.Tensor, inv_t: torch.Tensor,
                 needed: torch.Tensor, prefixes: tuple[int, ...], longest: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cut, found) per row: the smallest logit of the shortest sorted prefix of the
    candidates >= floor whose mass reaches `needed` (the first token whose preceding mass
    reaches it is dropped, so the top token always stays); found is False where no
    prefix of the candidates reaches it. Sorted prefixes of the given lengths are tried
    in turn, then the whole sort, or a sorted prefix of `longest` (the caller knows no cut
    it would use lies past it)."""
    rows = cand.shape[0]
    cut = torch.full((rows,), NEG_INF)
    found = torch.zeros(rows, dtype=torch.bool)
    todo = torch.arange(rows)
    last = cand.shape[1] if longest is None else min(longest, cand.shape[1])
    for q in (*(q for q in prefixes if q < last), last):
        values = cand[todo].topk(q, dim=1).values  # descending
        w = _weights(values, peak[todo, None], inv_t[todo, None], values >= floor[todo, None]).double()
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
                 u: list[float]) -> int:
    """One row [V], whole, in float64: what draw_fast computes from span summaries (u: the
    row's ATTEMPTS + 1 draws)."""
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
    cdf = weight.cumsum(dim=0)
    for a in range(ATTEMPTS):
        token = int(_search(cdf[None], torch.tensor([u[a] * float(cdf[-1])], dtype=torch.float64))[0])
        if x[token] >= theta:
            return token
    kept = weight.masked_fill(x < theta, 0.0).cumsum(dim=0)
    return int(_search(kept[None], torch.tensor([u[ATTEMPTS] * float(kept[-1])], dtype=torch.float64))[0])
