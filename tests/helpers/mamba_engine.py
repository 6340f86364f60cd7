"""EngineCore + Scheduler + TorchExecutor on the tiny recurrent models (hf_tiny_mamba),
their tokens checked against HF transformers' greedy ones."""

from __future__ import annotations

from tests.helpers import hf_tiny, hf_tiny_mamba as tiny
from tests.helpers.torch_engine import step_until_done

from hybridserve.core.request import Request, SamplingParams
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.engine.loop import EngineCore, build_engine
from hybridserve.executor.torch.executor import TorchExecutor
from hybridserve.models.loaders.loader import load_model
from hybridserve.models.arch.mamba_lm import MambaLM

BS = 16
NEW_TOKENS = 12
PROMPTS = hf_tiny.random_prompts(4, 40, 100, vocab=512, seed=11)
_MODELS: dict[str, MambaLM] = {}


def model(kind: str) -> MambaLM:
    if kind not in _MODELS:
        m = load_model(tiny.tiny_model_dir(kind))
        assert isinstance(m, MambaLM)
        _MODELS[kind] = m
    return _MODELS[kind]


def make_engine(kind: str, *, async_scheduling: bool, num_blocks: int = 200, max_num_batched_tokens: int = 2048,
                prefix_caching: bool = True, **cfg: object) -> EngineCore:
    """cfg: further SchedulerConfig fields (max_concurrent_batches, ...)."""
    ex = TorchExecutor(model(kind), use_worker_thread=async_scheduling)
    sc = SchedulerConfig(max_model_len=160, async_scheduling=async_scheduling,
                         max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=prefix_caching,
                         **cfg)  # type: ignore[arg-type]
    return build_engine(sc, ex.kv_cache_config(BS, num_blocks=num_blocks), ex)


def run(engine: EngineCore, prompts: list[list[int]], tag: str = "r", shutdown: bool = True,
        **sampling: object) -> dict[str, list]:
    """{request id: [tokens, logprobs, num_cached]} once every prompt finished."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"{tag}{i}", p, SamplingParams(max_tokens=NEW_TOKENS, **sampling)))  # type: ignore[arg-type]
    try:
        return step_until_done(engine)
    finally:
        if shutdown:
            engine.shutdown()


def check(kind: str, prompts: list[list[int]], got: dict[str, list], tag: str = "r") -> None:
    for i, p in enumerate(prompts):
        want, want_lp = tiny.oracle(kind, p, NEW_TOKENS)
        assert got[f"{tag}{i}"][0] == want, f"{kind} prompt {i} (len {len(p)})"
        if got[f"{tag}{i}"][1]:
            assert max(abs(a - b) for a, b in zip(got[f"{tag}{i}"][1], want_lp)) < 1e-3


def count_skipped_checkpoints(eng: EngineCore) -> list[int]:
    """Null entries a running request's table got when its running block moved on (its
    best-effort checkpoints skipped for want of spare blocks), one count per allocation."""
    skipped: list[int] = []
    for m in eng.scheduler.kv.coordinator.in_place:
        def counting(rid, num_tokens, chunk_start=0, orig=m.allocate_new_blocks, m=m):  # type: ignore[no-untyped-def]
            moving = rid in m.running
            new = orig(rid, num_tokens, chunk_start)
            skipped.append(sum(b.is_null for b in new) if moving else 0)
            return new
        m.allocate_new_blocks = counting  # type: ignore[method-assign]
    return skipped
