"""plain_sampling: sample_plain (the native keyed draw) gives sampler.sample's tokens and
failed rows for every mix of plain rows (greedy, temperature, top-k, top-p, min-p, any
seed and position, masked tokens, rows every token of which is masked, rows the native
draw leaves to draw_fast); the runner takes it for plain batches, with the tokens the
general path gives them; a batch's parameters are reused only for the same requests."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.executor.torch import span_sampler  # noqa: E402
from hybridserve.executor.torch.plain_sampling import DrawParams, DrawParamsCache, sample_plain  # noqa: E402
from hybridserve.executor.torch.requests import RequestState  # noqa: E402
from hybridserve.executor.torch.sampler import ALL_MASKED, SampleRow, inv_temperatures, sample  # noqa: E402
from hybridserve.executor.torch.span_draw import MASKED, UNDECIDED  # noqa: E402
from hybridserve.models.layers.span_logits import SPAN, SpanLogits, span_logits_from  # noqa: E402

needs_native = pytest.mark.skipif(span_sampler.native_draw() is None,
                                  reason="the native draw is not built here (no C compiler)")

VOCAB = 24 * SPAN + 5  # the last span padded with -inf


def _both(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int],
          pieces: int = 0) -> tuple[tuple, tuple]:
    """(sample_plain's (tokens, failed), sample's) for the same rows; `pieces` spans per
    piece where the logits are held in pieces."""
    rows = [SampleRow(p, seed=s, position=q) for p, s, q in zip(params, seeds, positions)]
    dp = DrawParams(params, seeds, logits.shape[1])
    assert torch.equal(dp.inv_t, inv_temperatures(rows))

    def held() -> SpanLogits:
        sl = span_logits_from(logits.clone(), dp.inv_t)
        if not pieces:
            return sl
        split = [p.clone() for p in sl.padded.split(pieces * SPAN, dim=1)]
        return SpanLogits(vocab_size=sl.vocab_size, inv_temperature=sl.inv_temperature, span_max=sl.span_max,
                          span_sum=sl.span_sum, buffer=sl._buffer, pieces=split)

    fast = sample_plain(held(), dp, positions)
    assert fast is not None
    tokens, _, failed = sample(held(), rows)
    return fast, (tokens, failed)


ROW_PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.05, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 0, 1, 3, 40, 300, VOCAB + 10]),
    top_p=st.sampled_from([1.0, 1.0, 0.05, 0.5, 0.9, 0.99]),
    min_p=st.sampled_from([0.0, 0.0, 0.02, 0.3]),
)


@needs_native
@settings(max_examples=60, deadline=None)
@given(params=st.lists(ROW_PARAMS, min_size=1, max_size=9), data=st.data())
def test_plain_rows_get_samples_tokens(params: list[SamplingParams], data) -> None:
    n = len(params)
    seeds = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))
    positions = data.draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n))
    scale = data.draw(st.sampled_from([0.5, 3.0, 10.0]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = torch.randn(n, VOCAB, generator=g) * scale
    masked = data.draw(st.lists(st.integers(0, n * VOCAB - 1), max_size=40))
    logits.view(-1)[masked] = float("-inf")
    if data.draw(st.booleans()):
        logits[data.draw(st.integers(0, n - 1))] = float("-inf")  # a row with every token masked
    pieces = data.draw(st.sampled_from([0, 5]))
    fast, general = _both(logits, params, seeds, positions, pieces)
    assert fast == general


@needs_native
def test_rows_left_to_draw_fast_and_a_masked_row() -> None:
    # One token far above a flat rest of 64 spans: top_k 20 cuts inside ties outside the
    # candidate spans (the native draw leaves it undecided: draw_fast draws it); beside it a
    # row with every token masked (failed, token 0 as sample gives) and a greedy row
    logits = torch.zeros(3, 64 * SPAN)
    logits[:, 77] = 12.0
    logits[1] = float("-inf")
    params = [SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0)]
    (tokens, failed), general = _both(logits, params, [1, 2, 3], [0, 9, 4])
    assert (tokens, failed) == general
    assert failed == {1: ALL_MASKED} and tokens[1:] == [0, 77]
    native = span_sampler.native_draw()
    assert native is not None
    dp = DrawParams(params, [1, 2, 3], logits.shape[1])
    keyed = native.keyed(span_logits_from(logits, dp.inv_t), dp.addresses, [0, 9, 4], span_sampler.ATTEMPTS,
                         span_sampler.CANDIDATE_SPANS)
    assert keyed == [UNDECIDED, MASKED, 77]


@needs_native
def test_one_rows_tokens_do_not_depend_on_its_batch() -> None:
    # the key is (seed, position): alone or beside others, in any order, the same token
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=g) * 2
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 4
    seeds, positions = [5, 2**64 - 1, 77, 2**63], [0, 1, 2**33, 40]
    together = _both(logits, params, seeds, positions)[0][0]
    alone = [_both(logits[i : i + 1], params[:1], seeds[i : i + 1], positions[i : i + 1])[0][0][0] for i in range(4)]
    reversed_ = _both(logits.flip(0), params, seeds[::-1], positions[::-1])[0][0]
    assert together == alone == reversed_[::-1]


def _state(req_id: str, params: SamplingParams, seed: int) -> RequestState:
    return RequestState(req_id=req_id, token_ids=[1, 2], num_computed=2, params=params, row=0, seed=seed,
                        plain=True)


def test_a_batchs_parameters_are_reused_only_for_the_same_requests_in_order() -> None:
    cache = DrawParamsCache(vocab_size=1000)
    a = _state("a", SamplingParams(temperature=0.5, top_k=2000, top_p=0.8), 7)
    b = _state("b", SamplingParams(temperature=0.0), 2**64 - 1)
    first = cache.of([a, b])
    assert first.greedy.tolist() == [0, 1] and first.top_k.tolist() == [0, 0]  # 2000 >= vocab: no top-k
    assert first.inv_t.tolist() == [2.0, 1.0] and first.seeds.tolist() == [7, 2**64 - 1]
    assert first.stored  # top_p reads more than one span
    assert cache.of([a, b]) is first
    assert cache.of([b, a]) is not first  # another order
    again = _state("a", SamplingParams(temperature=1.0), 7)  # the same id, another request
    params = cache.of([again, b])
    assert params.inv_t.tolist() == [1.0, 1.0] and not params.stored


def test_the_runner_samples_plain_batches_by_the_fast_path_with_the_general_paths_tokens(monkeypatch) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    if span_sampler.native_draw() is None:
        pytest.skip("the native draw is not built here (no C compiler)")
    from hybridserve.core.request import Request
    from hybridserve.executor.torch.model_runner import ModelRunner
    from tests.helpers.torch_engine import NEW_TOKENS, PROMPTS, make_engine, step_until_done

    mixes = [dict(temperature=1.0, seed=11), dict(temperature=0.7, top_p=0.9, seed=12),
             dict(temperature=1.2, top_k=5, min_p=0.05), dict(temperature=0.0)]
    real = ModelRunner._sample_plain
    taken = []

    def counted(self, states, hidden):  # type: ignore[no-untyped-def]
        out = real(self, states, hidden)
        taken.append(out is not None)
        return out

    runs = []
    for fast in (True, False):
        monkeypatch.setattr(ModelRunner, "_sample_plain", counted if fast else lambda *a: None)
        eng = make_engine("mistral", async_scheduling=False)
        try:
            for i, (p, mix) in enumerate(zip(PROMPTS, mixes)):
                eng.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=NEW_TOKENS, **mix)))
            runs.append({k: v[0] for k, v in step_until_done(eng).items()})
        finally:
            eng.shutdown()
    assert taken and all(taken)
    assert runs[0] == runs[1]
    assert all(len(t) == NEW_TOKENS for t in runs[0].values())
