"""The recorder's KV usage samples: the per-table count shortcut equals the deduplicated set."""

from __future__ import annotations

import pytest

from hybridserve.sim import recorder
from hybridserve.sim.simulation import SimConfig, run_simulation
from hybridserve.sim.workload import WorkloadSpec, generate


def held_by_set(scheduler) -> list[float]:  # type: ignore[no-untyped-def]
    """Distinct non-null blocks in each group's tables, by brute force."""
    kv = scheduler.kv
    usage = []
    for m in kv.coordinator.managers:
        held = {b for blocks in m.req_to_blocks.values() for b in blocks if not b.is_null}
        usage.append(len(held) / (kv.pool.num_blocks - 1))
    return usage


@pytest.mark.parametrize(
    ("layout", "gpu", "pp", "prefix_groups"),
    # Mamba states are not prefix-cached, so jamba-like shares no block.
    [("llama3-8b-like", "H100", 1, 0), ("gemma3-27b-like", "H100", 1, 2), ("jamba-like", "H200", 2, 0)],
)
def test_group_usage_equals_the_deduplicated_count(
    monkeypatch: pytest.MonkeyPatch, layout: str, gpu: str, pp: int, prefix_groups: int
) -> None:
    shared = {True: 0, False: 0}
    fast = recorder.group_usage

    def checked(scheduler):  # type: ignore[no-untyped-def]
        usage = fast(scheduler)
        assert usage == held_by_set(scheduler)
        shared[scheduler.kv.pool.num_shared_blocks > 0] += 1
        return usage

    monkeypatch.setattr(recorder, "group_usage", checked)
    items = generate(WorkloadSpec.from_flags(24, "uniform:20:300", "uniform:1:60", 40.0, prefix_groups, 64), seed=3)
    cfg = SimConfig(gpu=gpu, model_layout=layout, pipeline_parallel_size=pp, max_num_seqs=8, num_blocks=600,
                    max_model_len=512, detector=False)
    report = run_simulation(cfg, items, progress=False)
    assert report.num_finished == 24
    assert shared[False] > 0  # the shortcut ran
    if prefix_groups:
        assert shared[True] > 0  # and so did the set, while prefix hits shared blocks
