"""Sampler: greedy, filters (top-k, top-p, min-p), controls, keyed draws, distribution, logprobs, bans.

The distribution tests draw many tokens, each with its own seed, and compare the counts
with probabilities worked out by hand (in the comments) by a chi-square test. The draws
are a pure function of (seed, position), so each test gives the same counts on every run;
the critical values are those of alpha = 1e-4."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.executor.torch.logits_controls import TokenHistory  # noqa: E402
from hybridserve.executor.torch.sampler import SampleRow, logprob_info, reads_one_span_per_row, sample  # noqa: E402
from hybridserve.executor.torch.sampling_keys import uniforms  # noqa: E402

# probabilities 0.5, 0.3, 0.15, 0.05 over 4 tokens
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()
# Chi-square critical values at alpha = 1e-4 by degrees of freedom (categories - 1).
CHI2_CRITICAL = {1: 15.14, 2: 18.42, 3: 21.11}


def draw(params: SamplingParams, n: int = 400, logits: torch.Tensor = LOGITS, history: TokenHistory | None = None,
         batch: int = 1000) -> list[int]:
    """n draws, draw i with seed i at position 5, in batches of `batch` rows."""
    tokens: list[int] = []
    for lo in range(0, n, batch):
        rows = [SampleRow(params, seed=i, position=5, history=history) for i in range(lo, min(lo + batch, n))]
        out, _, failed = sample(logits.expand(len(rows), -1).clone(), rows)
        assert not failed
        tokens += out
    return tokens


def chi_square(tokens: list[int], expected: dict[int | str, float]) -> float:
    """Pearson's statistic of the draws against `expected` (category -> probability; the
    category "rest" collects every token not named)."""
    n = len(tokens)
    named = {k for k in expected if k != "rest"}
    counts = {k: sum(t == k for t in tokens) for k in named}
    if "rest" in expected:
        counts["rest"] = sum(t not in named for t in tokens)
    assert sum(counts.values()) == n, "a token outside the expected support was drawn"
    return sum((counts[k] - n * p) ** 2 / (n * p) for k, p in expected.items())


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9]])
    tokens, lps, failed = sample(logits, [SampleRow(SamplingParams())] * 2)
    assert tokens == [1, 0] and lps == [None, None] and failed == {}
    assert set(draw(SamplingParams(temperature=2.0, top_k=1), n=50)) == {0}


def test_greedy_takes_the_first_of_equal_maxima_across_spans() -> None:
    logits = torch.zeros(2, 600)
    logits[0, [300, 450]] = 1.0  # spans 2 and 3 of 128
    logits[1, [129, 130]] = 1.0  # both in span 1
    assert sample(logits, [SampleRow(SamplingParams())] * 2)[0] == [300, 129]


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
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0)]
    n = 300
    rows = [SampleRow(p, seed=i) for p in params for i in range(n)]
    tokens, _, _ = sample(LOGITS.expand(len(rows), -1).clone(), rows)
    supports = [set(tokens[i * n:(i + 1) * n]) for i in range(len(params))]
    assert supports == [{0}, {0}, {0, 1}, {0, 1, 2, 3}]


def test_a_top_k_of_the_vocabulary_or_more_is_no_top_k() -> None:
    """top_k >= the vocabulary keeps every token: the same draws as top_k 0, even past
    int64 (a request may send any integer)."""
    unfiltered = draw(SamplingParams(temperature=1.0), n=200)
    for top_k in (4, 5, 2**63):
        assert draw(SamplingParams(temperature=1.0, top_k=top_k), n=200) == unfiltered


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, -5.0])
    assert set(draw(SamplingParams(temperature=1.0, top_k=2), n=600, logits=logits)) == {0, 1, 2}


# Expected distributions over LOGITS (p = 0.5, 0.3, 0.15, 0.05), by hand:
DISTRIBUTIONS = {
    "temperature 1": (SamplingParams(temperature=1.0), {0: 0.5, 1: 0.3, 2: 0.15, 3: 0.05}),
    # p^(1/2) = 0.7071, 0.5477, 0.3873, 0.2236; sum 1.8657
    "temperature 2": (SamplingParams(temperature=2.0), {0: 0.3790, 1: 0.2936, 2: 0.2076, 3: 0.1198}),
    "top_k 2": (SamplingParams(temperature=1.0, top_k=2), {0: 0.625, 1: 0.375}),
    "top_p 0.7": (SamplingParams(temperature=1.0, top_p=0.7), {0: 0.625, 1: 0.375}),
    # keep p >= 0.1: 0.5, 0.3, 0.15 over 0.95
    "min_p 0.2": (SamplingParams(temperature=1.0, min_p=0.2), {0: 0.5263, 1: 0.3158, 2: 0.1579}),
    # top-3 renormalised 0.5263, 0.3158, 0.1579: the mass before token 2 (0.8421) < 0.9 keeps it
    "top_k 3, top_p 0.9": (SamplingParams(temperature=1.0, top_k=3, top_p=0.9),
                           {0: 0.5263, 1: 0.3158, 2: 0.1579}),
    # p^2 = 0.25, 0.09, 0.0225, 0.0025 over 0.365 = 0.6849, 0.2466, ...: the mass before
    # token 2 (0.9315) reaches 0.8, so 0.25 and 0.09 over 0.34 remain
    "temperature 0.5, top_p 0.8": (SamplingParams(temperature=0.5, top_p=0.8), {0: 0.7353, 1: 0.2647}),
    # + ln 2 on token 3: 0.5, 0.3, 0.15, 0.1 over 1.05
    "logit_bias": (SamplingParams(temperature=1.0, logit_bias={3: math.log(2.0)}),
                   {0: 0.4762, 1: 0.2857, 2: 0.1429, 3: 0.0952}),
    # tokens 2 (prompt) and 0 (output) are in the history: their logits (< 0) are doubled,
    # p 0.15^2 = 0.0225 and 0.5^2 = 0.25; 0.25, 0.3, 0.0225, 0.05 over 0.6225
    "repetition_penalty": (SamplingParams(temperature=1.0, repetition_penalty=2.0),
                           {0: 0.4016, 1: 0.4819, 2: 0.0361, 3: 0.0803}),
    # token 0 was output once: - ln 2.5 makes p 0.2; 0.2, 0.3, 0.15, 0.05 over 0.7
    "presence_penalty": (SamplingParams(temperature=1.0, presence_penalty=math.log(2.5)),
                         {0: 0.2857, 1: 0.4286, 2: 0.2143, 3: 0.0714}),
}


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_draws_follow_the_distribution_the_parameters_define(name: str) -> None:
    params, expected = DISTRIBUTIONS[name]
    history = TokenHistory([2, 0], num_prompt=1) if params.has_logits_controls else None  # output: token 0
    tokens = draw(params, n=4000, history=history)
    assert chi_square(tokens, expected) < CHI2_CRITICAL[len(expected) - 1], name


# A vocabulary of 8192 (64 spans of 128): token 5 weight 3000, token 7000 weight 2000, the
# other 8190 tokens weight 1 (logit 0); Z = 13190.
WIDE = torch.zeros(8192)
WIDE[5], WIDE[7000] = math.log(3000.0), math.log(2000.0)


@pytest.mark.parametrize("params,expected", [
    # 3000 / 13190, 2000 / 13190, 8190 / 13190: the spans' masses, then inside a span
    (SamplingParams(temperature=1.0), {5: 0.2274, 7000: 0.1516, "rest": 0.6209}),
    # top-2 and a nucleus of 0.3 (0.2274 < 0.3 <= 0.3790) both keep tokens 5 and 7000: 0.6, 0.4
    (SamplingParams(temperature=1.0, top_k=2), {5: 0.6, 7000: 0.4}),
    (SamplingParams(temperature=1.0, top_p=0.3), {5: 0.6, 7000: 0.4}),
    # min_p 0.5 keeps p >= 0.1137: the same two
    (SamplingParams(temperature=1.0, min_p=0.5), {5: 0.6, 7000: 0.4}),
    # a nucleus of 0.9 reaches into the 8190 tokens of logit 0: ties with the cut stay, so
    # every token is kept (wider than the candidate spans: the general path decides)
    (SamplingParams(temperature=1.0, top_p=0.9), {5: 0.2274, 7000: 0.1516, "rest": 0.6209}),
])
def test_draws_over_many_spans_follow_the_distribution(params: SamplingParams, expected: dict) -> None:
    tokens = draw(params, n=3000, logits=WIDE, batch=250)
    assert chi_square(tokens, expected) < CHI2_CRITICAL[len(expected) - 1]


def test_a_rows_draw_depends_only_on_its_seed_and_position() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95)
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    rows = [SampleRow(params, seed=100 + i, position=20 + i) for i in range(8)]
    together, _, _ = sample(logits.clone(), rows)
    alone = [sample(logits[i : i + 1].clone(), [rows[i]])[0][0] for i in range(8)]
    reordered, _, _ = sample(logits.flip(0).clone(), rows[::-1])
    assert together == alone == reordered[::-1]
    # Another position or another seed is another draw: over 40 positions the tokens vary.
    stream = [sample(logits[:1].clone(), [SampleRow(params, seed=7, position=p)])[0][0] for p in range(40)]
    assert len(set(stream)) > 5
    assert stream != [sample(logits[:1].clone(), [SampleRow(params, seed=8, position=p)])[0][0] for p in range(40)]


def test_uniforms_are_splitmix64_outputs() -> None:
    """SplitMix64 seeded with 0 starts 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4 (the
    reference sequence); keyed draws are its outputs from the mixed seed, 8 per position."""
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)

    gamma = 0x9E3779B97F4A7C15
    assert mix(gamma) == 0xE220A8397B1DCDAF and mix(2 * gamma % 2**64) == 0x6E789E6AA1B965F4
    start = mix(12345)
    # draw k of position p is output 8p + k + 1
    want = [[(mix((start + (8 * p + k + 1) * gamma) % 2**64) >> 11) * 2.0**-53 for k in range(3)] for p in (0, 1, 77)]
    assert uniforms([12345] * 3, [0, 1, 77], 3).tolist() == want


def test_logprobs_of_sampled_token_and_top_n_are_raw() -> None:
    rows = [SampleRow(SamplingParams(logprobs=2)), SampleRow(SamplingParams(logprobs=0))]
    tokens, lps, _ = sample(LOGITS.expand(2, -1).clone(), rows)
    assert tokens == [0, 0]
    lp0, top0 = lps[0]
    assert lp0 == pytest.approx(math.log(0.5), abs=1e-6)
    assert [t for t, _ in top0] == [0, 1] and top0[1][1] == pytest.approx(math.log(0.3), abs=1e-6)
    assert lps[1][1] is None
    info = logprob_info([lps[0], lps[0]])
    assert info.token_logprobs == [lp0, lp0] and info.top_logprobs == [top0, top0]


def test_banned_tokens_are_never_sampled_but_logprobs_stay_raw() -> None:
    rows = [SampleRow(SamplingParams(logprobs=1), banned=(0,))]
    tokens, lps, _ = sample(LOGITS[None].clone(), rows)
    assert tokens == [1]
    assert lps[0][0] == pytest.approx(math.log(0.3), abs=1e-6)
    assert lps[0][1][0][0] == 0  # the top-1 alternative is still the banned token


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    rows = [SampleRow(SamplingParams(temperature=1.0), seed=1, banned=(0, 1, 2, 3)),
            SampleRow(SamplingParams(temperature=1.0, logit_bias={9: 1.0}), seed=2, history=TokenHistory([1], 1)),
            SampleRow(SamplingParams(temperature=1.0, top_k=1), seed=3)]
    tokens, _, failed = sample(LOGITS.expand(3, -1).clone(), rows)
    assert sorted(failed) == [0, 1]
    assert "masked" in failed[0] and "token 9" in failed[1]
    assert tokens[2] == 0 and all(0 <= t < 4 for t in tokens)


def test_which_batches_read_one_span_per_row() -> None:
    # The head keeps only span summaries for these (OutputHead.span_logits, stored=False).
    vocab = 1000

    def one(**params: float) -> list[SampleRow]:
        return [SampleRow(SamplingParams(**params))]

    assert reads_one_span_per_row(one(temperature=0.0), vocab)
    assert reads_one_span_per_row(one(temperature=1.0), vocab)
    assert reads_one_span_per_row(one(temperature=0.7, top_k=1), vocab)  # top-k 1 is greedy
    assert reads_one_span_per_row(one(temperature=0.7, top_k=vocab), vocab)  # keeps every token
    assert reads_one_span_per_row(one(temperature=0.0, top_p=0.5), vocab)  # greedy: filters unread
    assert not reads_one_span_per_row(one(temperature=0.7, top_k=40), vocab)
    assert not reads_one_span_per_row(one(temperature=0.7, top_p=0.9), vocab)
    assert not reads_one_span_per_row(one(temperature=1.0, min_p=0.05), vocab)
    assert not reads_one_span_per_row(one(temperature=1.0, logprobs=0), vocab)
    assert not reads_one_span_per_row([SampleRow(SamplingParams(temperature=1.0), banned=(1,))], vocab)
    assert not reads_one_span_per_row(
        [SampleRow(SamplingParams(temperature=1.0, presence_penalty=0.5), history=TokenHistory([3, 4], 1))], vocab)
    assert not reads_one_span_per_row(
        [SampleRow(SamplingParams(temperature=1.0), bitmask=torch.zeros(32, dtype=torch.int32))], vocab)
    # one filtered row makes the whole batch store its logits
    mixed = one(temperature=0.0) + one(temperature=1.0)
    assert reads_one_span_per_row(mixed, vocab)
    assert not reads_one_span_per_row(mixed + one(temperature=0.7, top_p=0.95), vocab)
