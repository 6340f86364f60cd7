"""Sampler: greedy, filters (top-k, top-p, min-p), seeds, distribution, logprobs, bans."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.executor.torch.sampler import SampleRow, logprob_info, sample  # noqa: E402

# probabilities 0.5, 0.3, 0.15, 0.05 over 4 tokens
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draw(params: SamplingParams, n: int = 400, seed: int = 0, logits: torch.Tensor = LOGITS) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    rows = [SampleRow(params, None)] * n
    tokens, _ = sample(logits.expand(n, -1).clone(), rows, gen)
    return tokens


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9]])
    gen = torch.Generator().manual_seed(0)
    tokens, lps = sample(logits, [SampleRow(SamplingParams(), None)] * 2, gen)
    assert tokens == [1, 0] and lps == [None, None]
    assert set(draw(SamplingParams(temperature=2.0, top_k=1), n=50)) == {0}


@pytest.mark.parametrize("params,support", [
    (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
    (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    (SamplingParams(temperature=1.0, top_p=0.5), {0}),  # the mass before token 1 already reaches 0.5
    # top-p over the top-k survivors renormalised: 0.5 / 0.95 = 0.53 < 0.7 keeps token 1,
    # 0.8 / 0.95 = 0.84 >= 0.7 drops token 2
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.7), {0, 1}),
    (SamplingParams(temperature=1.0, top_k=2, top_p=0.6), {0}),  # 0.5 / 0.8 = 0.625 >= 0.6
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.9), {0, 1, 2}),  # 0.84 < 0.9 keeps token 2
    (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),  # keep p >= 0.25
    (SamplingParams(temperature=1.0, min_p=0.2), {0, 1, 2}),  # keep p >= 0.1
    (SamplingParams(temperature=1.0), {0, 1, 2, 3}),
])
def test_filters_restrict_the_support(params: SamplingParams, support: set[int]) -> None:
    assert set(draw(params, n=2000)) == support


def test_rows_with_different_filters_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0)]
    n = 300
    rows = [SampleRow(p, None) for p in params for _ in range(n)]
    tokens, _ = sample(LOGITS.expand(len(rows), -1).clone(), rows, gen)
    supports = [set(tokens[i * n:(i + 1) * n]) for i in range(len(params))]
    assert supports == [{0}, {0}, {0, 1}, {0, 1, 2, 3}]


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, -5.0])
    assert set(draw(SamplingParams(temperature=1.0, top_k=2), n=600, logits=logits)) == {0, 1, 2}


def test_sampling_follows_the_tempered_distribution() -> None:
    n = 4000
    counts = torch.bincount(torch.tensor(draw(SamplingParams(temperature=2.0), n=n)), minlength=4).float() / n
    want = torch.softmax(LOGITS / 2.0, dim=-1)
    assert torch.allclose(counts, want, atol=0.03), (counts, want)


def test_per_request_generators_make_streams_reproducible() -> None:
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))

    def stream(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(20):
            # The other rows use the shared generator: they must not disturb row 0.
            rows = [SampleRow(params, g), SampleRow(params, None), SampleRow(params, None)]
            out.append(sample(logits, rows, torch.Generator().manual_seed(len(out)))[0][0])
        return out

    assert stream(7) == stream(7)
    assert stream(7) != stream(8)


def test_logprobs_of_sampled_token_and_top_n_are_raw() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [SampleRow(SamplingParams(logprobs=2), None), SampleRow(SamplingParams(logprobs=0), None)]
    tokens, lps = sample(LOGITS.expand(2, -1).clone(), rows, gen)
    assert tokens == [0, 0]
    lp0, top0 = lps[0]
    assert lp0 == pytest.approx(math.log(0.5), abs=1e-6)
    assert [t for t, _ in top0] == [0, 1] and top0[1][1] == pytest.approx(math.log(0.3), abs=1e-6)
    assert lps[1][1] is None
    info = logprob_info([lps[0], lps[0]])
    assert info.token_logprobs == [lp0, lp0] and info.top_logprobs == [top0, top0]


def test_banned_tokens_are_never_sampled_but_logprobs_stay_raw() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [SampleRow(SamplingParams(logprobs=1), None, banned=(0,))]
    tokens, lps = sample(LOGITS[None].clone(), rows, gen)
    assert tokens == [1]
    assert lps[0][0] == pytest.approx(math.log(0.3), abs=1e-6)
    assert lps[0][1][0][0] == 0  # the top-1 alternative is still the banned token
