"""CPU KV offload for Mamba2 and Bamba, against HF transformers greedy.

With prefix caching a Mamba group keeps a state checkpoint per block, and a finished
request still holds its last whole-block checkpoint, so the offload connector stores it
with the attention blocks. Wave 1 runs two conversations, a filler wave evicts them from
a small device pool, and wave 2 continues them: their Mamba states (and Bamba's
attention blocks) come back from host memory, and every token must be HF's. An injected
load failure must fall back to recomputing. Nothing may leak.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import hf_tiny, hf_tiny_mamba as tiny  # noqa: E402
from tests.models.test_mamba import BS, NEW_TOKENS, check, model, run  # noqa: E402
from tests.executor.test_offload import assert_nothing_leaks  # noqa: E402

from hybridserve.core.connector.offload import HostOffloadConnector  # noqa: E402
from hybridserve.core.errors import ConfigError  # noqa: E402
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


# Pools small enough that the filler evicts wave 1 from the device; Bamba's with room for
# the best-effort checkpoints (a column costs 9 blocks: 3 layers of 3 pages), so wave 1's
# last whole checkpoint is kept and stored.
POOL = {"mamba2": {False: 8, True: 10}, "bamba": {False: 64, True: 64}}  # Bamba: a state is 3 pages


@pytest.mark.parametrize("kind", tiny.KINDS)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_next_turn_loads_the_mamba_state_from_host(kind: str, async_scheduling: bool) -> None:
    eng, conn = make_engine(kind, async_scheduling=async_scheduling, num_blocks=POOL[kind][async_scheduling])
    try:
        device_hits = run_waves(kind, eng)
        stats = eng.scheduler.make_stats()
        assert_nothing_leaks(eng, conn)
    finally:
        eng.shutdown()
    # Wave 1 processed its prompt and all outputs but the last: the turn resumes from the
    # checkpoint at the last whole block of that, loaded from host memory.
    ends = [(len(p) + NEW_TOKENS - 1) // BS * BS for p in WAVE1]
    assert all(h < e for h, e in zip(device_hits, ends))
    assert stats.num_offload_hit_tokens == sum(e - h for h, e in zip(device_hits, ends))
    assert stats.num_offloaded_blocks > 0 and stats.num_failed_loads == 0


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


def test_a_failed_state_load_recomputes() -> None:
    stats = bamba_waves(async_scheduling=True, num_blocks=POOL["bamba"][True], fail_loads=1)
    assert stats.num_failed_loads >= 1


def test_offload_of_a_mamba_model_needs_prefix_caching() -> None:
    with pytest.raises(ConfigError, match="needs prefix caching"):
        make_engine("mamba2", async_scheduling=False, num_blocks=20, prefix_caching=False)
