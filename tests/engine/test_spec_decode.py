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
from hybridserve.core.request import Request, SamplingParams  # noqa: E402
from hybridserve.core.sched.config import SchedulerConfig  # noqa: E402
from hybridserve.engine.loop import EngineCore, build_engine  # noqa: E402
from hybridserve.entrypoints import bench  # noqa: E402
from hybridserve.executor.torch.executor import TorchExecutor  # noqa: E402
from tests.helpers.ngram_reference import propose_ngram_drafts  # noqa: E402
from hybridserve.executor.torch.spec_decode import NgramDrafter, lookup, num_accepted  # noqa: E402
from hybridserve.models.arch.decoder import DecoderLM  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402

NEW_TOKENS = 24
_MODELS: dict[str, DecoderLM] = {}


def pattern_prompts(n: int, seed: int) -> list[list[int]]:
    """Random head, then a 6-9 token pattern p (with p[2] == p[1]) repeated 3-5 times,
    ending after p[0] p[1]: a model that repeats its last token (the tiny Gemma 3 does)
    makes "p0 p1 p1", whose lookup proposes p[3].. (rejected), then runs of p1 (accepted)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        head = [rng.randint(3, 255) for _ in range(rng.randint(3, 20))]
        pattern = [rng.randint(3, 255) for _ in range(rng.randint(6, 9))]
        pattern[2] = pattern[1]
        prompts.append(head + pattern * rng.randint(3, 5) + pattern[:2])
    return prompts


def self_copy_prompt(kind: str, seed: int) -> list[int]:
    """S + G + junk + S + G[:4], where G is the model's own greedy continuation (15 tokens)
    of a random S of 70 tokens. Under sliding windows of 16 (4 layers: 60 tokens of reach)
    the second copy continues like the first, so the drafter's lookups into G are accepted
    until G runs out, then its proposal (the junk) is rejected. Steps of k drafts emit
    k + 1 tokens; 11 tokens follow G[:4] in G, and no k + 1 in 3..5 divides 11, so no step
    ends exactly at G's end (after which the lookup would find nothing to propose)."""
    rng = random.Random(seed)
    s = [rng.randint(3, 255) for _ in range(70)]
    g, _ = hf_tiny.oracle(kind, s, 15)
    junk = [rng.randint(3, 255) for _ in range(5)]
    return s + g + junk + s + g[:4]


_PROMPTS: dict[str, list[list[int]]] = {}


def prompts_for(kind: str) -> list[list[int]]:
    if kind not in _PROMPTS:
        _PROMPTS[kind] = [self_copy_prompt(kind, 1)] + pattern_prompts(2, seed=11)
    return _PROMPTS[kind]


def model(kind: str) -> DecoderLM:
    if kind not in _MODELS:
        _MODELS[kind] = load_model(hf_tiny.tiny_model_dir(kind))
    return _MODELS[kind]


class CountingExecutor(TorchExecutor):
    """Records, per step, the draft slots scheduled and the drafts the runner proposed."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.slots = 0
        self.proposed = 0

    def execute(self, scheduler_output):  # type: ignore[no-untyped-def]
        self.slots += sum(sr.num_draft_tokens for sr in scheduler_output.requests)
        return super().execute(scheduler_output)

    def wait(self, handle):  # type: ignore[no-untyped-def]
        out = super().wait(handle)
        self.proposed += sum(out.num_draft_tokens.values())
        return out


def make_engine(kind: str, *, async_scheduling: bool, spec: int, budget: int = 2048,
                drafter: NgramDrafter | None = None, num_blocks: int = 400) -> EngineCore:
    ex = CountingExecutor(model(kind), use_worker_thread=async_scheduling, drafter=drafter)
    sc = SchedulerConfig(max_model_len=256, async_scheduling=async_scheduling, max_num_batched_tokens=budget,
                         num_speculative_tokens=spec)
    return build_engine(sc, ex.kv_cache_config(16, num_blocks=num_blocks), ex)


def run(engine: EngineCore, prompts: list[list[int]], **sampling: object) -> dict[str, tuple[list[int], list[float]]]:
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=NEW_TOKENS, **sampling)))  # type: ignore[arg-type]
    got: dict[str, tuple[list[int], list[float]]] = {}
    try:
        while engine.has_unfinished_requests():
            _, outs = engine.step()
            for o in outs:
                toks, lps = got.setdefault(o.request_id, ([], []))
                toks.extend(o.new_token_ids)
                if o.logprobs is not None:
                    lps.extend(o.logprobs.token_logprobs)
    finally:
        engine.shutdown()
    return got


def check_hf(kind: str, got: dict[str, tuple[list[int], list[float]]], logprobs: bool = False) -> None:
    for i, p in enumerate(prompts_for(kind)):
        want, want_lp = hf_tiny.oracle(kind, p, NEW_TOKENS)
        assert got[f"r{i}"][0] == want, f"{kind} prompt {i}"
        if logprobs:
            assert len(got[f"r{i}"][1]) == NEW_TOKENS
            assert max(abs(a - b) for a, b in zip(got[f"r{i}"][1], want_lp)) < 1e-3


def check_stats(eng: EngineCore) -> None:
    st = eng.scheduler.stats
    ex = eng.executor
    assert isinstance(ex, CountingExecutor)
    # Stats count what the runner proposed (never more than the slots it was given).
    assert st.num_draft_tokens == ex.proposed and 0 < ex.proposed <= ex.slots
    # Drafts were both accepted and rejected.
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert 0.0 < st.acceptance_rate < 1.0
    assert st.mean_accepted_length == pytest.approx(1 + st.num_accepted_tokens / st.num_spec_steps)


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
