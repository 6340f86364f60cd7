"""span_draw: the native draw gives draw_fast's tokens wherever it decides a row, leaves
undecided exactly the rows its candidates cannot decide, and `draw` (native, then
draw_fast for the rest) is draw_fast's tokens everywhere."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.executor.torch import span_sampler  # noqa: E402
from hybridserve.executor.torch.sampler import SampleRow, inv_temperatures  # noqa: E402
from hybridserve.executor.torch.sampling_keys import uniforms  # noqa: E402
from hybridserve.executor.torch.span_draw import UNDECIDED  # noqa: E402
from hybridserve.executor.torch.span_sampler import CANDIDATE_SPANS, draw, draw_fast  # noqa: E402
from hybridserve.models.layers.span_logits import SPAN, SpanLogits, span_logits_from  # noqa: E402

native = span_sampler.native_draw()
needs_native = pytest.mark.skipif(native is None, reason="the native draw is not built here (no C compiler)")

COMBOS = [
    dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_k=40),
    dict(temperature=1.0, min_p=0.1), dict(temperature=1.3, top_k=50, top_p=0.8, min_p=0.05),
    dict(temperature=0.5, top_p=0.5), dict(temperature=2.0, top_p=0.99), dict(temperature=0.05),
    dict(temperature=1.0, top_k=200), dict(temperature=0.9, top_k=1000, min_p=0.02),
    dict(temperature=1.0, top_p=0.05), dict(temperature=1.0, min_p=0.9), dict(temperature=0.0),
    dict(temperature=0.8, top_k=3, top_p=0.6),
]
VOCAB = 5000 + 17  # 40 spans, the last padded with -inf
ROWS = 20


def _tensors(params: list[SamplingParams]) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([p.temperature == 0.0 for p in params]), torch.tensor([p.top_k for p in params]),
            torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]))


def _pieces(sl: SpanLogits, spans_per_piece: int) -> SpanLogits:
    pieces = [p.clone() for p in sl.padded.split(spans_per_piece * SPAN, dim=1)]
    return SpanLogits(vocab_size=sl.vocab_size, inv_temperature=sl.inv_temperature, span_max=sl.span_max.clone(),
                      span_sum=sl.span_sum.clone(), buffer=sl._buffer, pieces=pieces)


def _native(sl: SpanLogits, params: list[SamplingParams], u: torch.Tensor, attempts: int) -> torch.Tensor:
    assert native is not None
    tokens = native(sl, *_tensors(params), u, attempts, CANDIDATE_SPANS)
    assert tokens is not None
    return tokens


@needs_native
@pytest.mark.parametrize("attempts", [span_sampler.ATTEMPTS, 0])  # 0: every row draws from its kept set
@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])  # flat to peaked rows
def test_the_native_draw_gives_draw_fasts_tokens(scale: float, attempts: int, monkeypatch) -> None:
    monkeypatch.setattr(span_sampler, "ATTEMPTS", attempts)
    g = torch.Generator().manual_seed(int(scale) + 10)
    logits = torch.randn(ROWS * len(COMBOS), VOCAB, generator=g) * scale
    params = [SamplingParams(**c) for c in COMBOS for _ in range(ROWS)]
    rows = [SampleRow(p, seed=i, position=5) for i, p in enumerate(params)]
    sl = span_logits_from(logits, inv_temperatures(rows))
    u = torch.from_numpy(uniforms([r.seed for r in rows], [r.position for r in rows], attempts + 1))
    want = draw_fast(sl, *_tensors(params), u)
    for held in (sl, _pieces(sl, 7)):
        got = _native(held, params, u, attempts)
        decided = got != UNDECIDED
        assert torch.equal(got[decided], want[decided])
        # unfiltered, greedy, min-p and top-k rows are always decided
        for i, p in enumerate(params):
            if p.top_p == 1.0 and p.top_k < 1000:
                assert decided[i], (i, p)
        assert torch.equal(draw(held, *_tensors(params), u), want)
    if scale >= 3.0 and attempts:  # peaked rows: every nucleus decided, open ones draw by draw
        assert bool(decided.all())


@needs_native
def test_a_draw_by_hand() -> None:
    # Two live tokens: 5 (logit 0, weight 1/3 of the peak's) and 200 (logit ln 3, weight 1),
    # in spans 0 and 1 of two. Mass 4/3: u < 1/4 draws token 5 (target u * 4/3 < 1/3).
    logits = torch.full((1, 2 * SPAN), float("-inf"))
    logits[0, 5], logits[0, 200] = 0.0, math.log(3.0)
    sl = span_logits_from(logits, torch.ones(1))
    plain = [SamplingParams(temperature=1.0)]
    for u0, token in ((0.2, 5), (0.3, 200), (0.0, 5), (0.999, 200)):
        u = torch.tensor([[u0, 0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
        assert _native(sl, plain, u, 4).tolist() == [token]
    # top_p 0.7 needs 0.7 * 4/3 = 0.93 of the mass: token 200 alone (weight 1) holds it, so
    # token 5 is rejected at every attempt and the kept set (token 200) is drawn from.
    nucleus = [SamplingParams(temperature=1.0, top_p=0.7)]
    u = torch.tensor([[0.2, 0.1, 0.0, 0.24, 0.0]], dtype=torch.float64)
    assert _native(sl, nucleus, u, 4).tolist() == [200]
    # top_k 2 keeps both; min_p 0.5 drops token 5 (1/3 < 0.5); greedy takes 200
    assert _native(sl, [SamplingParams(temperature=1.0, top_k=2)], u, 4).tolist() == [5]
    assert _native(sl, [SamplingParams(temperature=1.0, min_p=0.5)], u, 4).tolist() == [200]
    assert _native(sl, [SamplingParams(temperature=0.0)], u, 4).tolist() == [200]


@needs_native
@pytest.mark.parametrize("attempts", [span_sampler.ATTEMPTS, 0])
def test_rows_the_candidates_cannot_decide_are_left_to_draw_fast(attempts: int, monkeypatch) -> None:
    # 64 spans, one token far above a flat rest. top_p 0.99 needs the flat rest, mostly
    # outside the CANDIDATE_SPANS spans: an open nucleus, its draws decided one at a time
    # (with no attempts, undecided); top_k 20 cuts inside 8191 ties of one value (its k-th
    # largest is not above the left-out spans' maxima: undecided); top_p 0.4 keeps the one
    # token (decided).
    monkeypatch.setattr(span_sampler, "ATTEMPTS", attempts)
    assert 64 > CANDIDATE_SPANS
    logits = torch.zeros(3, 64 * SPAN)
    logits[:, 77] = 12.0
    params = [SamplingParams(temperature=1.0, top_p=0.99), SamplingParams(temperature=1.0, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.4)]
    sl = span_logits_from(logits, torch.ones(3))
    u = torch.from_numpy(uniforms([1, 2, 3], [0, 0, 0], attempts + 1))
    want = draw_fast(sl, *_tensors(params), u)
    got = _native(sl, params, u, attempts).tolist()
    assert got[1:] == [UNDECIDED, 77]
    assert got[0] == (want[0] if attempts else UNDECIDED)
    assert torch.equal(draw(sl, *_tensors(params), u), want)


@needs_native
def test_a_top_k_over_the_candidate_limit_is_left_to_draw_fast() -> None:
    # top_k 70000 would have the native draw sort 600 spans' logits per row: undecided there,
    # drawn by draw_fast; top_k 40 beside it is decided
    logits = torch.randn(2, 600 * SPAN, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(temperature=1.0, top_k=70000), SamplingParams(temperature=1.0, top_k=40)]
    sl = span_logits_from(logits, torch.ones(2))
    u = torch.from_numpy(uniforms([1, 2], [0, 0], span_sampler.ATTEMPTS + 1))
    got = _native(sl, params, u, span_sampler.ATTEMPTS)
    assert got[0] == UNDECIDED and got[1] != UNDECIDED
    assert torch.equal(draw(sl, *_tensors(params), u), draw_fast(sl, *_tensors(params), u))


@needs_native
def test_a_masked_row_and_a_model_dtype_piece() -> None:
    # every token masked: token 0 (the caller fails the row); bf16 pieces: not read (None)
    logits = torch.full((1, 2 * SPAN), float("-inf"))
    sl = span_logits_from(logits, torch.ones(1))
    u = torch.full((1, 5), 0.5, dtype=torch.float64)
    assert _native(sl, [SamplingParams(temperature=1.0, top_p=0.9)], u, 4).tolist() == [0]
    bf16 = SpanLogits(vocab_size=2 * SPAN, inv_temperature=torch.ones(1), span_max=sl.span_max, span_sum=sl.span_sum,
                      buffer=sl._buffer, pieces=[sl.padded.bfloat16()])
    assert native is not None
    assert native(bf16, *_tensors([SamplingParams(temperature=1.0)]), u, 4, CANDIDATE_SPANS) is None


def _amx_head(monkeypatch, g: torch.Generator):
    """An int8 head on AMX's integer tiles (skips where they are not), two chunks of whole
    spans, its weight drawn from g."""
    from hybridserve.models.layers.head import HEAD_CHUNK_ROWS, OutputHead
    from hybridserve.models.layers.int8 import AMX
    from hybridserve.models.layers.int8_amx import amx_kernel
    if amx_kernel() is None:
        pytest.skip("no AMX int8 tiles (or no compiler) here")
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: AMX)
    return OutputHead(torch.randn(HEAD_CHUNK_ROWS + 40 * SPAN, 64, generator=g) * 0.05, "int8")


@needs_native
def test_logits_not_stored_draw_the_stored_logits_tokens(monkeypatch) -> None:
    # An AMX int8 head (two chunks of whole spans) keeping only the span summaries: the draw
    # computes each span it reads again, and every row kind gets the tokens it gets from the
    # stored logits. A batch of greedy and plain temperature rows reads one span per row and
    # leaves the logits unstored; the filtered rows' candidates are computed the same way.
    g = torch.Generator().manual_seed(7)
    head = _amx_head(monkeypatch, g)
    params = [SamplingParams(**c) for c in COMBOS for _ in range(3)]
    rows = [SampleRow(p, seed=i, position=9) for i, p in enumerate(params)]
    x = torch.randn(len(rows), 64, generator=g) * 4
    inv_t = inv_temperatures(rows)
    u = torch.from_numpy(uniforms([r.seed for r in rows], [r.position for r in rows], span_sampler.ATTEMPTS + 1))
    want = draw(head.span_logits(x, inv_t, None), *_tensors(params), u)
    unstored = head.span_logits(x, inv_t, None, stored=False)
    assert torch.equal(draw(unstored, *_tensors(params), u), want)
    plain = [i for i, p in enumerate(params) if p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0]
    assert len(plain) >= 3 * 3  # greedy, 1.0, 0.05
    unstored = head.span_logits(x[plain], inv_t[plain], None, stored=False)
    assert torch.equal(draw(unstored, *_tensors([params[i] for i in plain]), u[plain]), want[plain])
    assert unstored.source is not None  # nothing made them dense


@needs_native
def test_logits_not_stored_are_computed_whole_for_penalties_and_logprobs(monkeypatch) -> None:
    # Rows the runner would not give unstored logits (penalties, a bias, logprobs) still
    # sample as from stored ones when they get them: every use other than the native draw
    # computes the whole logits first (the same values), then changes them.
    from hybridserve.executor.torch.logits_controls import TokenHistory
    from hybridserve.executor.torch.sampler import sample
    g = torch.Generator().manual_seed(11)
    head = _amx_head(monkeypatch, g)
    history = TokenHistory([5, 9, 5, 700, 33000, 9], num_prompt=2)
    params = [SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, seed=1),
              SamplingParams(temperature=1.0, logit_bias={33001: 5.0, 7: -3.0}, seed=2),
              SamplingParams(temperature=0.8, logprobs=3, seed=3), SamplingParams(temperature=0.0)]
    rows = [SampleRow(p, seed=i, position=4, history=history if i < 2 else None) for i, p in enumerate(params)]
    x = torch.randn(len(rows), 64, generator=g) * 4
    inv_t = inv_temperatures(rows)
    stored_tokens, stored_lps, _ = sample(head.span_logits(x, inv_t, None), rows)
    unstored = head.span_logits(x, inv_t, None, stored=False)
    tokens, lps, failed = sample(unstored, rows)
    assert not failed and tokens == stored_tokens and lps == stored_lps
    assert unstored.source is None  # the changes made them dense
