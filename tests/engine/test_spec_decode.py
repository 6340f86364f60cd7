"""N-gram speculative decoding on the PyTorch runner, end to end against HF transformers.

Prompts repeat a random pattern, so the n-gram drafter proposes continuations the
tiny random models sometimes follow and sometimes do not: both accepted and rejected
drafts must occur (checked through the scheduler's stats), and greedy output must be
exactly plain decoding and HF greedy, sync and async, with chunked prefills.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import hf_tiny  # noqa: E402

from hybridserve import AsyncLLM  # noqa: E402
from hybridserve.config import EngineConfig  # noqa: E402
from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.entrypoints import bench  # noqa: E402
from tests.helpers.ngram_reference import propose_ngram_drafts  # noqa: E402
from hybridserve.executor.torch.spec_decode import NgramDrafter, lookup, num_accepted  # noqa: E402
from tests.helpers.spec_engine import NEW_TOKENS, check_hf, check_stats, make_engine, prompts_for, run  # noqa: E402

@pytest.mark.parametrize("kind", ["mistral", "gemma3", "gemma3_mm", "olmo3", "cohere2", "exaone4"])
@pytest.mark.parametrize("async_scheduling,spec", [(False, 2), (True, 4)], ids=["sync2", "async4"])
def test_greedy_equals_plain_decoding_and_hf(kind: str, async_scheduling: bool, spec: int) -> None:
    prompts = prompts_for(kind)
    plain = run(make_engine(kind, async_scheduling=async_scheduling, spec=0), prompts)
    eng = make_engine(kind, async_scheduling=async_scheduling, spec=spec)
    got = run(eng, prompts)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in plain.items()}
    check_hf(kind, got)
    check_stats(eng)


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_chunked_prefill_with_drafts(kind: str) -> None:
    # A 19-token budget chunks every prompt and leaves decodes beside prefill chunks;
    # n-grams of 1..3 draft more often (and miss more).
    eng = make_engine(kind, async_scheduling=True, spec=3, budget=19, drafter=NgramDrafter(1, 3))
    got = run(eng, prompts_for(kind))
    assert eng.scheduler.stats.num_steps > sum(len(p) for p in prompts_for(kind)) // 19
    check_hf(kind, got)
    check_stats(eng)


@pytest.mark.parametrize("kind,num_blocks", [("mistral", 7), ("gemma3", 30), ("olmo3", 36), ("cohere2", 36),
                                             ("exaone4", 36)])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_with_drafts_recomputes_exactly(kind: str, num_blocks: int, async_scheduling: bool) -> None:
    # A pool too small for all three requests: some are preempted (drafts in flight under
    # async) and recomputed; the runner rebuilds them from the scheduler's tokens.
    eng = make_engine(kind, async_scheduling=async_scheduling, spec=3, budget=32, num_blocks=num_blocks)
    got = run(eng, prompts_for(kind))
    check_hf(kind, got)
    assert eng.scheduler.stats.num_preemptions > 0
    assert eng.scheduler.stats.num_accepted_tokens > 0


def test_logprobs_through_the_sampler_path_match_hf() -> None:
    # logprobs disable the argmax fast path: drafts are verified through sample().
    eng = make_engine("mistral", async_scheduling=True, spec=3)
    got = run(eng, prompts_for("mistral"), logprobs=0)
    check_hf("mistral", got, logprobs=True)
    check_stats(eng)


def test_seeded_sampling_with_drafts_is_the_stream_without_drafts() -> None:
    # Random rows verify drafts by sampling each position with that position's draw (see
    # spec_decode.py): a seeded request gives the same stream as without drafts, and
    # drafts still get accepted.
    params = dict(temperature=1.5, seed=99)
    first = run(make_engine("gemma3", async_scheduling=False, spec=0), prompts_for("gemma3"), **params)
    eng = make_engine("gemma3", async_scheduling=True, spec=3)
    second = run(eng, prompts_for("gemma3"), **params)
    assert first == second
    assert all(len(v[0]) == NEW_TOKENS for v in second.values())
    assert first != {f"r{i}": (hf_tiny.oracle("gemma3", p, NEW_TOKENS)[0], []) for i, p in enumerate(prompts_for("gemma3"))}
    assert eng.scheduler.stats.num_accepted_tokens > 0


def test_acceptance_rule_and_config() -> None:
    assert num_accepted([5, 6, 7], [5, 6, 9, 1]) == 2
    assert num_accepted([5, 6], [4, 6, 8]) == 0
    assert num_accepted([5, 6], [5, 6, 8]) == 2
    assert NgramDrafter(2, 3).propose([1, 2, 3, 1, 2], 2) == [3, 1]
    assert NgramDrafter(2, 3).propose([1, 2, 3, 4, 2], 2) == []  # only a 1-gram recurs
    # A lookup cut by the end of the tokens continues as an overlapping copy.
    assert NgramDrafter(2, 4).propose([9, 5, 7, 5, 7, 5, 7], 5) == [5, 7, 5, 7, 5]
    assert NgramDrafter(2, 4).propose([4, 4, 4], 3) == [4, 4, 4]
    assert EngineConfig(num_speculative_tokens=3).num_speculative_tokens == 3
    with pytest.raises(ConfigError, match=r"ngram_prompt_lookup_max \(1\) must be >= ngram_prompt_lookup_min \(2\)"):
        EngineConfig(num_speculative_tokens=3, ngram_prompt_lookup_max=1)
    with pytest.raises(ConfigError, match=r"n-gram sizes need 1 <= min <= max"):
        NgramDrafter(0, 2)


def test_list_lookup_equals_the_numpy_drafter() -> None:
    rng = random.Random(3)
    for _ in range(400):
        tokens = [rng.randint(0, rng.choice([2, 4, 9])) for _ in range(rng.randint(1, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        assert lookup(tokens, k, lo, hi) == propose_ngram_drafts(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_engine_config_to_stats_and_metrics() -> None:
    """EngineConfig -> drafter sizes in the runner; acceptance in AsyncLLM stats, /metrics
    and the bench summary line."""
    pytest.importorskip("prometheus_client")
    from hybridserve.entrypoints.openai.metrics import ReplicaSnapshot, ServerMetrics

    prompts = prompts_for("mistral")
    llm = AsyncLLM(config=EngineConfig(model=str(hf_tiny.tiny_model_dir("mistral")), max_model_len=256,
                                       num_speculative_tokens=3, ngram_prompt_lookup_min=1,
                                       ngram_prompt_lookup_max=3, dtype="float32"), progress=False)
    try:
        assert llm.parts.engine.executor.runner.drafter == NgramDrafter(1, 3)  # type: ignore[attr-defined]

        async def main():  # type: ignore[no-untyped-def]
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
            finals = []
            for p in prompts:  # one at a time: the same tokens whatever the batch
                finals.append([o async for o in llm.generate(p, params)][-1])
            return finals, await llm.get_stats()

        finals, stats = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        llm.shutdown()
    for i, (p, out) in enumerate(zip(prompts, finals)):
        assert list(out.outputs[0].token_ids) == hf_tiny.oracle("mistral", p, NEW_TOKENS)[0], i
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.acceptance_rate == stats.num_accepted_tokens / stats.num_draft_tokens
    assert stats.mean_accepted_length == 1 + stats.num_accepted_tokens / stats.num_spec_steps
    text = ServerMetrics().render([ReplicaSnapshot(stats, True)]).decode()
    assert f"hybridserve_spec_decode_num_accepted_tokens_total {float(stats.num_accepted_tokens)}" in text
    assert "hybridserve_spec_decode_acceptance_rate " in text
    row = {"model": "m", "num_prompts": 1, "input_len": 8, "output_len": 8, "elapsed_s": 1.0,
           "output_tokens_per_s": 8.0, "total_tokens_per_s": 16.0, "ttft_ms": {"mean": 1, "median": 1, "p99": 1},
           "tpot_ms": {"mean": 1, "median": 1, "p99": 1}, "num_speculative_tokens": 3,
           "spec_acceptance_rate": 0.625, "spec_mean_accepted_length": 2.5}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bench._print(row)
    assert "3 n-gram drafts/step: acceptance 62.5%, mean accepted length 2.50" in buf.getvalue()
