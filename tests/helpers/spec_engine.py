"""Engines with n-gram drafts on the tiny decoder models, prompts whose drafts are both
accepted and rejected, and the checks against HF's greedy tokens and the draft counts."""

from __future__ import annotations

import random

import pytest

from hybridserve.core.request import Request, SamplingParams
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.engine.loop import EngineCore, build_engine
from hybridserve.executor.torch.executor import TorchExecutor
from hybridserve.executor.torch.spec_decode import NgramDrafter
from hybridserve.models.arch.decoder import DecoderLM
from hybridserve.models.loaders.loader import load_model
from tests.helpers import hf_tiny

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
