"""penalties: the native logit bias and penalties change the logits and span summaries
exactly as the general path (logits_controls + refresh_spans) does, by hand and on random
batches, dense or in pieces; batches they cannot take are left unchanged for it."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.executor.torch import sampler  # noqa: E402
from hybridserve.executor.torch.logits_controls import TokenHistory, apply_logits_controls  # noqa: E402
from hybridserve.executor.torch.sampler import SampleRow, inv_temperatures, sample  # noqa: E402
from hybridserve.models.layers.span_kernel import KERNEL  # noqa: E402
from hybridserve.models.layers.span_logits import SPAN, SpanLogits, span_logits_from  # noqa: E402

native = sampler._native_penalties()
needs_native = pytest.mark.skipif(native is None, reason="the native penalties are not built here (no C compiler)")
VOCAB = 20 * SPAN


def _pieces(sl: SpanLogits, spans_per_piece: int) -> SpanLogits:
    pieces = [p.clone() for p in sl.padded.split(spans_per_piece * SPAN, dim=1)]
    return SpanLogits(vocab_size=sl.vocab_size, inv_temperature=sl.inv_temperature, span_max=sl.span_max.clone(),
                      span_sum=sl.span_sum.clone(), buffer=sl._buffer, pieces=pieces)


def _general(sl: SpanLogits, requests: list) -> None:
    controls, failed = apply_logits_controls(sl, requests)
    assert not failed
    sl.refresh_spans(controls.rows, controls.ids, KERNEL.summarise)


def _batch(seed: int, rows: int) -> tuple[torch.Tensor, list]:
    rng = random.Random(seed)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    requests = []
    for row in range(rows):
        if rng.random() < 0.2:
            continue  # a row without controls
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 40))]
        outputs = [rng.choice(prompt) if prompt and rng.random() < 0.3 else rng.randrange(VOCAB)
                   for _ in range(rng.randint(0, 30))]
        kinds = rng.choice(["rep", "counts", "bias", "all"])
        params = SamplingParams(
            repetition_penalty=rng.choice([1.1, 0.7, 2.0]) if kinds in ("rep", "all") else 1.0,
            frequency_penalty=rng.choice([0.0, 0.3, -0.5]) if kinds in ("counts", "all") else 0.0,
            presence_penalty=rng.choice([0.2, 1.5]) if kinds in ("counts", "all") else 0.0,
            logit_bias={t: rng.uniform(-5, 5) for t in rng.sample(prompt + outputs + [7, 2000], k=3)}
            if kinds in ("bias", "all") and prompt + outputs else None)
        requests.append((row, params, TokenHistory(prompt + outputs, len(prompt))))
    return logits, requests


@needs_native
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pieced", [False, True])
def test_native_penalties_are_the_general_paths_bit_for_bit(seed: int, pieced: bool) -> None:
    logits, requests = _batch(seed, rows=12)
    inv_t = torch.linspace(0.3, 2.0, 12)
    fast, general = span_logits_from(logits, inv_t), span_logits_from(logits, inv_t)
    if pieced:
        fast = _pieces(fast, spans_per_piece=7)
    assert native is not None and native(fast, requests)
    _general(general, requests)
    assert torch.equal(fast.whole_rows(torch.arange(12)), general.padded)
    assert torch.equal(fast.span_max, general.span_max) and torch.equal(fast.span_sum, general.span_sum)


@needs_native
def test_penalties_by_hand() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8], logits[0, 9], logits[0, 40] = 2.0, -1.0, 0.5, 1.0
    # prompt 7, 8, 8; outputs 7, 9, 9: token 7 (positive, once out) 2 / 1.25 - (0.5 + 0.25);
    # 8 (negative, prompt only) -1 * 1.25; 9 (twice out) plus its bias 1 first: 1.5 / 1.25 -
    # (0.5 * 2 + 0.25); 40 (bias only) 1 - 2
    params = SamplingParams(repetition_penalty=1.25, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={9: 1.0, 40: -2.0})
    sl = span_logits_from(logits, torch.ones(1))
    assert native is not None and native(sl, [(0, params, TokenHistory([7, 8, 8, 7, 9, 9], num_prompt=3))])
    f32 = torch.tensor
    assert sl.padded[0, 7].item() == (f32(2.0) / 1.25 - f32(0.75)).item()
    assert sl.padded[0, 8].item() == -1.25
    assert sl.padded[0, 9].item() == (f32(1.5) / 1.25 - f32(1.25)).item()
    assert sl.padded[0, 40].item() == -1.0
    assert sl.padded[0, 10:40].abs().sum().item() == 0.0
    # span 0's maximum is now token 7's 0.85
    assert sl.span_max[0, 0].item() == sl.padded[0, 7].item()


@needs_native
def test_what_the_native_path_declines_stays_unchanged() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    good = (0, SamplingParams(repetition_penalty=1.2), TokenHistory([1, 2, 3], 1))
    bad = (1, SamplingParams(logit_bias={VOCAB + 5: 1.0}), TokenHistory([1], 1))  # outside the vocabulary
    sl = span_logits_from(logits, torch.ones(2))
    before = sl.padded.clone(), sl.span_sum.clone()
    assert native is not None and not native(sl, [good, bad])
    assert torch.equal(sl.padded, before[0]) and torch.equal(sl.span_sum, before[1])
    bf16 = SpanLogits(vocab_size=VOCAB, inv_temperature=torch.ones(2), span_max=sl.span_max, span_sum=sl.span_sum,
                      buffer=sl._buffer, pieces=[sl.padded.bfloat16()])
    assert not native(bf16, [good])
    # through sample(): the general path names the bad row, the good one is sampled
    rows = [SampleRow(good[1], seed=1, position=3, history=good[2]), SampleRow(bad[1], seed=2, position=1, history=bad[2])]
    _, _, failed = sample(span_logits_from(logits, inv_temperatures(rows)), rows)
    assert list(failed) == [1] and "outside the vocabulary" in failed[1]


@needs_native
def test_sampled_tokens_are_the_same_with_or_without_the_native_path(monkeypatch) -> None:
    logits, requests = _batch(7, rows=16)
    rows = []
    for i in range(16):
        match = [r for r in requests if r[0] == i]
        p, h = (match[0][1], match[0][2]) if match else (SamplingParams(), None)
        rows.append(SampleRow(SamplingParams(**{**p.__dict__, "temperature": 0.8, "top_p": 0.9}), seed=i,
                              position=5, history=h))
    with_native = sample(span_logits_from(logits, inv_temperatures(rows)), rows)[0]
    monkeypatch.setattr(sampler, "_native_penalties", lambda: None)
    assert sample(span_logits_from(logits, inv_temperatures(rows)), rows)[0] == with_native
