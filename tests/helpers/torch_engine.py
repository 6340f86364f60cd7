"""EngineCore + Scheduler + TorchExecutor on the tiny decoder models (hf_tiny), and their
tokens checked against HF transformers' greedy ones."""

from __future__ import annotations

from tests.helpers import hf_tiny

from hybridserve.core.request import Request, SamplingParams
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.engine.loop import EngineCore, build_engine
from hybridserve.executor.torch.executor import TorchExecutor
from hybridserve.models.arch.decoder import DecoderLM
from hybridserve.models.loaders.loader import load_model

NEW_TOKENS = 16
PROMPTS = hf_tiny.random_prompts(4, 40, 120, seed=7)
_MODELS: dict[str, DecoderLM] = {}


def model(kind: str) -> DecoderLM:
    if kind not in _MODELS:
        _MODELS[kind] = load_model(hf_tiny.tiny_model_dir(kind))
    return _MODELS[kind]


class RecordingExecutor(TorchExecutor):
    """Counts the null block ids the scheduler hands out (window-tail allocation)."""

    null_block_ids = 0

    def execute(self, scheduler_output):  # type: ignore[no-untyped-def]
        for sr in scheduler_output.requests:
            self.null_block_ids += sum(ids.count(0) for ids in sr.new_block_ids)
        return super().execute(scheduler_output)


def make_engine(kind: str, **options: object) -> EngineCore:
    """make_engine_for the shared tiny `kind` model."""
    return make_engine_for(model(kind), **options)  # type: ignore[arg-type]


def make_engine_for(lm: DecoderLM, *, async_scheduling: bool, num_blocks: int = 400,
                    max_num_batched_tokens: int = 2048, max_model_len: int = 160, prefix_caching: bool = True,
                    **cfg: object) -> EngineCore:
    """Engine built like the frontend builds it: window-tail allocation follows the executor
    (on for TorchExecutor) unless `window_tail_allocation` says otherwise."""
    ex = RecordingExecutor(lm, use_worker_thread=async_scheduling)
    sc = SchedulerConfig(max_model_len=max_model_len, async_scheduling=async_scheduling,
                         max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=prefix_caching,
                         **cfg)  # type: ignore[arg-type]
    return build_engine(sc, ex.kv_cache_config(16, num_blocks=num_blocks), ex)


def run(engine: EngineCore, prompts: list[list[int]], tag: str = "r", **sampling: object) -> dict[str, list]:
    """Run prompts to completion; returns {request id: [tokens, logprobs, num_cached]}."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"{tag}{i}", p, SamplingParams(max_tokens=NEW_TOKENS, **sampling)))  # type: ignore[arg-type]
    return step_until_done(engine)


def step_until_done(engine: EngineCore) -> dict[str, list]:
    """Steps the engine until no request is left; {request id: [tokens, logprobs, num_cached]}."""
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        _, outs = engine.step()
        for o in outs:
            entry = got.setdefault(o.request_id, [[], [], 0])
            entry[0].extend(o.new_token_ids)
            if o.logprobs is not None:
                entry[1].extend(o.logprobs.token_logprobs)
            entry[2] = max(entry[2], o.num_cached_tokens)
    return got


def check_tokens(kind: str, prompts: list[list[int]], got: dict[str, list], tag: str = "r") -> None:
    for i, p in enumerate(prompts):
        want, _ = hf_tiny.oracle(kind, p, NEW_TOKENS)
        assert got[f"{tag}{i}"][0] == want, f"{kind} prompt {i} (len {len(p)})"
