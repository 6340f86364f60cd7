"""CPU KV offload on the tiny Mamba2 and Bamba models: two conversations, a filler wave that
evicts them from a small device pool, and their next turns, whose Mamba states (and
Bamba's attention blocks) come back from host memory; every token is HF's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import hf_tiny, hf_tiny_mamba as tiny  # noqa: E402
from tests.helpers.mamba_engine import BS, NEW_TOKENS, check, model, run  # noqa: E402
from tests.helpers.offload_waves import assert_nothing_leaks  # noqa: E402

from hybridserve.core.connector.offload import HostOffloadConnector  # noqa: E402
from hybridserve.core.sched.config import SchedulerConfig  # noqa: E402
from hybridserve.engine.loop import EngineCore, build_engine  # noqa: E402
from hybridserve.executor.torch.executor import TorchExecutor  # noqa: E402
from hybridserve.executor.torch.offload import attach_host_offload  # noqa: E402

WAVE1 = hf_tiny.random_prompts(2, 70, 90, vocab=512, seed=21)
FILLER = hf_tiny.random_prompts(3, 100, 120, vocab=512, seed=22)  # only evicts; its tokens are not checked


def wave2(kind: str) -> list[list[int]]:
    """Each wave-1 conversation's next turn: prompt + its output + more."""
    return [p + tiny.oracle(kind, p, NEW_TOKENS)[0] + [5, 6, 7] for p in WAVE1]


def make_engine(kind: str, *, async_scheduling: bool, num_blocks: int, fail_loads: int = 0,
                prefix_caching: bool = True) -> tuple[EngineCore, HostOffloadConnector]:
    ex = TorchExecutor(model(kind), use_worker_thread=async_scheduling)
    kvc = ex.kv_cache_config(BS, num_blocks=num_blocks)
    conn = attach_host_offload(ex, kvc, 400, fail_loads=fail_loads)
    sc = SchedulerConfig(max_model_len=160, async_scheduling=async_scheduling, max_num_batched_tokens=32,
                         max_num_seqs=2, enable_prefix_caching=prefix_caching)
    return build_engine(sc, kvc, ex, conn), conn


def run_waves(kind: str, eng: EngineCore) -> list[int]:
    first = run(eng, WAVE1, tag="a", shutdown=False)
    run(eng, FILLER, tag="f", shutdown=False)
    second = run(eng, wave2(kind), tag="b", shutdown=False)
    check(kind, WAVE1, first, tag="a")
    check(kind, wave2(kind), second, tag="b")
    return [second[f"b{i}"][2] for i in range(2)]  # device prefix-cache hits of wave 2


def bamba_waves(async_scheduling: bool, num_blocks: int, fail_loads: int = 0):  # type: ignore[no-untyped-def]
    """Bamba through the three waves (every token checked against HF, nothing leaked);
    the scheduler's stats."""
    eng, conn = make_engine("bamba", async_scheduling=async_scheduling, num_blocks=num_blocks, fail_loads=fail_loads)
    try:
        run_waves("bamba", eng)
        stats = eng.scheduler.make_stats()
        assert_nothing_leaks(eng, conn)
    finally:
        eng.shutdown()
    return stats
