"""span_sampler: the fast path over span summaries draws what the general path draws from
the whole row, for every filter and combination, with its fallback taken exactly where the
candidates cannot decide."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.executor.torch.sampler import SampleRow, inv_temperatures  # noqa: E402
from hybridserve.executor.torch.sampling_keys import uniforms  # noqa: E402
from hybridserve.executor.torch import span_sampler  # noqa: E402
from hybridserve.executor.torch.span_sampler import CANDIDATE_SPANS, draw_fast, draw_general  # noqa: E402
from hybridserve.models.layers.span_logits import SPAN, SpanLogits, span_logits_from, span_stats  # noqa: E402

COMBOS = [
    dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_k=40),
    dict(temperature=1.0, min_p=0.1), dict(temperature=1.3, top_k=50, top_p=0.8, min_p=0.05),
    dict(temperature=0.5, top_p=0.5), dict(temperature=2.0, top_p=0.99), dict(temperature=0.05),
    dict(temperature=1.0, top_k=200), dict(temperature=0.9, top_k=1000, min_p=0.02),
    dict(temperature=1.0, top_p=0.05), dict(temperature=1.0, min_p=0.9),  # most draws of the whole rejected
]
VOCAB = 5000 + 17  # 40 spans, the last padded with -inf
ROWS = 30


def in_pieces(sl: SpanLogits, spans_per_piece: int) -> SpanLogits:
    """The same logits and summaries held as pieces of spans_per_piece spans (the last
    shorter), as a chunked head holds them."""
    pieces = [p.clone() for p in sl.padded.split(spans_per_piece * SPAN, dim=1)]
    return SpanLogits(vocab_size=sl.vocab_size, inv_temperature=sl.inv_temperature, span_max=sl.span_max.clone(),
                      span_sum=sl.span_sum.clone(), buffer=sl._buffer, pieces=pieces)


def _fast(sl: SpanLogits, params: list[SamplingParams], u: torch.Tensor) -> list[int]:
    greedy = torch.tensor([p.temperature == 0.0 for p in params])
    return draw_fast(sl, greedy, torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]),
                     torch.tensor([p.min_p for p in params]), u).tolist()


def _draw_both(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[list[int], list[int]]:
    """(the fast path's tokens, the general path's); the fast path's are the same whether
    the logits are dense or in pieces (asserted here, for every caller)."""
    rows = [SampleRow(p, seed=i, position=3) for i, p in enumerate(params)]
    sl = span_logits_from(logits, inv_temperatures(rows))
    u = torch.from_numpy(uniforms([r.seed for r in rows], [r.position for r in rows], span_sampler.ATTEMPTS + 1))
    pieced = in_pieces(sl, spans_per_piece=7)
    fast = _fast(pieced, params, u)
    assert not pieced.is_dense  # every draw above read spans only, never whole rows
    assert _fast(sl, params, u) == fast
    greedy = torch.tensor([p.temperature == 0.0 for p in params])
    inv_t = sl.inv_temperature.tolist()
    general = [draw_general(logits[i], inv_t[i], bool(greedy[i]), p.top_k, p.top_p, p.min_p, u[i].tolist())
               for i, p in enumerate(params)]
    return fast, general


@pytest.mark.parametrize("attempts", [span_sampler.ATTEMPTS, 0])  # 0: every row draws from its kept set
@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])  # flat to peaked rows
def test_fast_path_draws_what_the_general_path_draws(scale: float, attempts: int, monkeypatch) -> None:
    monkeypatch.setattr(span_sampler, "ATTEMPTS", attempts)
    g = torch.Generator().manual_seed(int(scale))
    logits = torch.randn(ROWS * len(COMBOS), VOCAB, generator=g) * scale
    params = [SamplingParams(**c) for c in COMBOS for _ in range(ROWS)]
    fast, general = _draw_both(logits, params)
    # Both are exact draws of the same u; they can differ only where float rounding of
    # the two summations falls on the other side of a boundary (never seen: allow 1 in 1000).
    assert sum(f != r for f, r in zip(fast, general)) <= len(params) // 1000


@pytest.mark.parametrize("attempts", [span_sampler.ATTEMPTS, 0])
def test_kept_sets_wider_than_the_candidates_are_drawn_over_whole_rows(attempts: int, monkeypatch) -> None:
    """64 spans: one token far above a flat rest, and ties of the k-th value outside the
    candidates. top_p 0.4 keeps the one token (decided on the candidates); top_p 0.99 and
    min_p 1e-6 keep the flat rest too, mostly outside the CANDIDATE_SPANS spans; top_k 100
    cuts inside 8191 ties. Each row is drawn many times: the fast path equals the
    general path on every draw."""
    assert 64 > CANDIDATE_SPANS
    logits = torch.zeros(1, 64 * SPAN)
    logits[0, 300] = 9.0  # e^9 = 8103 against 8191: 49.7% of the mass
    monkeypatch.setattr(span_sampler, "ATTEMPTS", attempts)
    cases = [SamplingParams(temperature=1.0, top_p=0.4), SamplingParams(temperature=1.0, top_p=0.99),
             SamplingParams(temperature=1.0, min_p=1e-6), SamplingParams(temperature=1.0, top_k=100),
             SamplingParams(temperature=1.0, top_k=100, top_p=0.99)]
    params = [c for c in cases for _ in range(40)]
    fast, general = _draw_both(logits.expand(len(params), -1).clone(), params)
    assert fast == general
    assert set(fast[:40]) == {300} and len(set(fast[40:80])) > 10


@pytest.mark.parametrize("top_p, support", [(0.99, {7, 20, 21, 22, 23, 24}), (0.5, {7, 20, 21, 22, 23, 24}),
                                             (0.3, {7})])
def test_a_nucleus_over_top_k_survivors_with_ties_past_the_kth(top_p: float, support: set[int]) -> None:
    """top_k 2 over one logit 3 and five ties at 2 (the rest -10): the survivors are all
    six, four of them past the two sorted top values. By hand, weights e^3 = 20.1 and
    5 e^2 = 36.9: top_p 0.99 and 0.5 (28.5 of 57 needed, the first token holds 20.1) keep
    all six; top_p 0.3 (17.1 needed) keeps token 7 alone. The fast path equals the
    general path on every draw."""
    logits = torch.full((1, 8 * SPAN), -10.0)
    logits[0, 7] = 3.0
    logits[0, 20:25] = 2.0
    params = [SamplingParams(temperature=1.0, top_k=2, top_p=top_p)] * 150
    fast, general = _draw_both(logits.expand(len(params), -1).clone(), params)
    assert fast == general
    assert set(fast) == support


def test_a_nucleus_longer_than_the_first_sorted_prefix_is_cut_within_the_candidates() -> None:
    """100 tied logits 5.0 in 20 spans (five each), every other logit -10: the candidate
    spans hold them all above `bound` (-10). By hand, the weights are 1 each and
    8092 e^-15 = 0.0025 for the rest: top_p 0.9 needs 90.002, so the 91st sorted value is
    the first dropped (past the first sorted prefix of 64), the cut is 5.0 and all 100
    ties stay. The fast path equals the general path on every draw."""
    logits = torch.full((1, 64 * SPAN), -10.0)
    high = [(2 * s + 1) * SPAN + 7 * k for s in range(20) for k in range(5)]
    logits[0, high] = 5.0
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 150
    fast, general = _draw_both(logits.expand(len(params), -1).clone(), params)
    assert fast == general
    assert set(fast) <= set(high) and len(set(fast)) > 50


def test_greedy_rows_beside_sampled_rows() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=1.0,
                                                                                                   top_k=3)]
    fast, general = _draw_both(logits, params)
    assert fast == general
    assert fast[0] == int(logits[0].argmax()) and fast[2] == int(logits[2].argmax())


def test_logits_in_pieces_read_as_the_dense_logits() -> None:
    """Spans, single logits and whole rows read from pieces equal the dense buffer's, and
    the first dense use copies the pieces into it once."""
    g = torch.Generator().manual_seed(9)
    dense = span_logits_from(torch.randn(6, VOCAB, generator=g), torch.ones(6))
    pieced = in_pieces(dense, spans_per_piece=7)
    rows = torch.tensor([0, 5, 3, 3, 1])
    js = torch.tensor([0, 39, 7, 13, 20])  # first span, the padded last one, piece edges (7 | 14)
    assert torch.equal(pieced.take_spans(rows, js), dense.take_spans(rows, js))
    assert torch.equal(pieced.take_spans(rows[:, None], js[None, :]), dense.take_spans(rows[:, None], js[None, :]))
    ids = torch.tensor([0, VOCAB - 1, 7 * SPAN, 7 * SPAN - 1, 2500])
    assert torch.equal(pieced.at(rows, ids), dense.padded[rows, ids])
    assert torch.equal(pieced.whole_rows(rows), dense.padded[rows])
    assert not pieced.is_dense
    assert torch.equal(pieced.logits, dense.logits) and pieced.is_dense
    assert bool((pieced.padded[:, VOCAB:] == float("-inf")).all())


@pytest.mark.parametrize("attempts", [span_sampler.ATTEMPTS, 0])
def test_min_p_alone_reads_only_the_spans_reaching_its_threshold(attempts: int, monkeypatch) -> None:
    """min-p's threshold is the row's maximum + T ln(min_p): such rows gather no candidates,
    and their draws from the kept set (every draw, with 0 attempts) read the spans whose
    maximum reaches it, never whole rows; the tokens are the general path's."""
    monkeypatch.setattr(span_sampler, "ATTEMPTS", attempts)

    def refuse(*_args, **_kwargs):
        raise AssertionError("a whole-row or candidate read for min-p alone")

    monkeypatch.setattr(span_sampler, "_candidate_spans", refuse)
    monkeypatch.setattr(SpanLogits, "whole_rows", refuse)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(120, VOCAB, generator=g) * 2.0
    params = [SamplingParams(temperature=t, min_p=m) for t in (0.7, 1.0, 1.5) for m in (0.02, 0.3, 0.9)
              for _ in range(10)]
    fast, general = _draw_both(logits[: len(params)], params)
    assert sum(f != r for f, r in zip(fast, general)) <= len(params) // 1000


def test_a_nucleus_wider_than_its_candidate_spans_gathers_no_candidates(monkeypatch) -> None:
    """Flat rows over 40 spans: the CANDIDATE_SPANS (at most 32) candidate spans hold about
    32/40 = 0.8 of the mass or less, short of top_p 0.9's, so the rows gather no
    candidates; their draws are decided as an open nucleus's and are the general path's."""
    assert CANDIDATE_SPANS <= 32
    assert VOCAB // SPAN > CANDIDATE_SPANS

    def refuse(*_args, **_kwargs):
        raise AssertionError("candidates gathered for a nucleus they cannot hold")

    monkeypatch.setattr(span_sampler, "_thresholds_from_candidates", refuse)
    logits = torch.randn(60, VOCAB, generator=torch.Generator().manual_seed(12)) * 0.5
    params = [SamplingParams(temperature=t, top_p=p) for t in (0.7, 1.0, 1.5) for p in (0.9, 0.97) for _ in range(10)]
    fast, general = _draw_both(logits, params)
    assert sum(f != r for f, r in zip(fast, general)) <= len(params) // 1000


def test_logits_controls_and_bans_change_pieces_in_place_as_they_change_dense_logits() -> None:
    """Penalties, logit_bias, bad words and min_tokens bans write single entries where the
    logits are held: pieces (one of them bfloat16, as a model-dtype head gives) end equal
    to the dense logits changed the same way, summaries included, and stay pieces; the
    tokens drawn from both are the same, and the refreshed summaries are span_stats of the
    changed logits."""
    from hybridserve.executor.torch.logits_controls import TokenHistory
    from hybridserve.executor.torch.sampler import sample

    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(5, VOCAB, generator=g) * 3).to(torch.bfloat16).float()
    logits[0, 7] = 2.0  # a positive logit the repetition penalty divides
    history = TokenHistory([7, 7, 900, 2000, 4999, 7, 900], num_prompt=3)  # outputs: 2000, 4999, 7, 900
    controls = dict(temperature=0.8, repetition_penalty=1.25, frequency_penalty=0.5, presence_penalty=0.25,
                    logit_bias={3: 1.5, 4999: -2.0}, bad_words_token_ids=[[900, 11], [2000]])
    rows = [SampleRow(SamplingParams(**controls), seed=i, position=7, history=history) for i in range(4)]
    rows.append(SampleRow(SamplingParams(temperature=1.0, top_k=20), seed=9, position=7, banned=(1, 6000 % VOCAB, 1)))
    dense = span_logits_from(logits, inv_temperatures(rows))
    pieced = in_pieces(dense, spans_per_piece=7)
    pieced._pieces[2] = pieced._pieces[2].to(torch.bfloat16)  # exact: the logits are bfloat16 values
    want_tokens = sample(dense, rows)[0]
    assert sample(pieced, rows)[0] == want_tokens
    assert not pieced.is_dense
    for name in ("span_max", "span_sum"):
        assert torch.equal(getattr(pieced, name), getattr(dense, name)), name
    assert torch.equal(pieced.whole_rows(torch.arange(5)), dense.padded)
    want_max, want_sum = span_stats(dense.padded, dense.inv_temperature)
    assert torch.equal(dense.span_max, want_max)
    # refreshed by the summary kernel in use (its exponential within float32 rounding of torch's)
    torch.testing.assert_close(dense.span_sum, want_sum, rtol=1e-6, atol=0.0)
    # By hand, row 0: token 7 (positive, in the history, one output of it) is
    # 2 / 1.25 - (0.5 * 1 + 0.25) in float32; token 3 gained its bias; 11 (after 900) and 2000 are banned.
    assert float(dense.padded[0, 7]) == float(torch.tensor(2.0) / 1.25 - 0.75)
    assert float(dense.padded[0, 3]) == float(logits[0, 3] + 1.5)
    assert float(dense.padded[0, 11]) == float(dense.padded[0, 2000]) == float("-inf")
    assert float(dense.padded[4, 1]) == float(dense.padded[4, 6000 % VOCAB]) == float("-inf")
