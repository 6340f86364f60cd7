"""The shadow-KV detector catches both bugs of the optimistic basis, and nothing in safe mode."""

from __future__ import annotations

import pytest

from hybridserve.core.kv.spec import FullAttentionSpec, SlidingWindowSpec
from hybridserve.executor.sim.shadow_kv import FREED, NULL_READ, OVERWRITTEN, RaceViolation
from tests.sim_helpers import make_request, reference_output, run_sim

FULL = FullAttentionSpec(16, 1, 8)
SW = SlidingWindowSpec(16, 1, 8, sliding_window=32)
MML = 1024


def long_prompts(n=4, length=300, max_tokens=21, start=0):
    return [
        (0, make_request(str(start + i), [(i * 131 + j) % 30_000 + 2 for j in range(length)], max_tokens))
        for i in range(n)
    ]


def multi_turn(connector_run_outputs, reqs, step):
    """Second turns that extend the first turns' sequences (hits come from host memory)."""
    out = []
    for _, r in reqs:
        prompt = r.prompt_token_ids + connector_run_outputs[r.request_id] + [7] * 40
        out.append((step, make_request("t2-" + r.request_id, prompt, 20)))
    return out


def check_reference(run, reqs):
    for _, r in reqs:
        assert run.outputs[r.request_id] == reference_output(r.prompt_token_ids, r.max_tokens, MML)


def test_unsafe_async_frees_blocks_in_flight_steps_read():
    reqs = long_prompts()
    run = run_sim([FULL, SW], reqs, 400, max_model_len=MML, max_num_batched_tokens=256, unsafe=True, strict=False)
    assert FREED in {v.kind for v in run.violations}
    v = next(v for v in run.violations if v.kind == FREED)
    assert v.group == 1 and v.block > 0 and "freed-while-in-flight: step" in str(v)


def test_unsafe_spec_rejection_reads_the_null_block():
    reqs = long_prompts(max_tokens=40)
    run = run_sim(
        [FULL, SW], reqs, 400, max_model_len=MML, max_num_batched_tokens=256,
        num_speculative_tokens=3, acceptance_rate=0.5, unsafe=True, strict=False,
    )
    assert NULL_READ in {v.kind for v in run.violations}


def _connector_workload(unsafe: bool, strict: bool, failure_rate: float = 0.0):
    base = run_sim([FULL, SW], long_prompts(), 130, max_model_len=MML, max_num_batched_tokens=256)
    first = long_prompts()  # fresh Request objects: a run mutates them
    evict = [(0, make_request(f"e{i}", [(i * 17 + j) % 999 + 3 for j in range(500)], 4)) for i in range(6)]
    reqs = first + [(40 + s, r) for s, r in evict] + multi_turn(base.outputs, first, 200)
    run = run_sim(
        [FULL, SW], reqs, 130, max_model_len=MML, max_num_batched_tokens=256, connector=True,
        failure_rate=failure_rate, unsafe=unsafe, strict=strict,
    )
    return run, reqs


def test_unsafe_connector_load_overwrites_blocks_being_read():
    run, _ = _connector_workload(unsafe=True, strict=False)
    kinds = {v.kind for v in run.violations}
    assert OVERWRITTEN in kinds


def test_strict_mode_raises_a_named_violation():
    with pytest.raises(RaceViolation, match="freed-while-in-flight"):
        run_sim([FULL, SW], long_prompts(), 400, max_model_len=MML, max_num_batched_tokens=256, unsafe=True)


@pytest.mark.parametrize("failure_rate", [0.0, 0.3])
def test_safe_mode_connector_loads_no_violation_and_same_tokens(failure_rate):
    run, reqs = _connector_workload(unsafe=False, strict=True, failure_rate=failure_rate)
    assert run.violations == []
    assert run.connector.num_loaded_blocks > 0
    if failure_rate:
        assert run.connector.num_failed_blocks > 0 and run.scheduler.stats.num_failed_loads > 0
    check_reference(run, reqs)
    assert run.num_free_blocks == run.num_blocks - 1


@pytest.mark.parametrize(
    "mode",
    [
        dict(async_scheduling=False),
        dict(async_scheduling=True),
        dict(async_scheduling=True, concurrent_batches=3),
        dict(async_scheduling=False, pipeline_parallel_size=2),
        dict(async_scheduling=True, num_speculative_tokens=3, acceptance_rate=0.6),
        dict(async_scheduling=False, num_speculative_tokens=2, acceptance_rate=0.9),
        dict(async_scheduling=True, max_num_batched_tokens=48),
        dict(async_scheduling=True, enable_prefix_caching=False),
    ],
    ids=["sync", "async", "async-3", "pp2", "async-spec", "sync-spec", "async-chunked", "no-prefix-cache"],
)
def test_same_tokens_in_every_mode_and_no_violation(mode):
    shared = [5] * 64
    reqs = long_prompts(3, 200, 30) + [
        (3, make_request("p" + str(i), shared + [i + 9] * (20 + i), 25)) for i in range(3)
    ]
    kw = dict(max_model_len=MML, max_num_batched_tokens=256)
    kw.update(mode)
    run = run_sim([FULL, SW], reqs, 120, **kw)
    assert run.violations == []
    check_reference(run, reqs)
    assert run.num_free_blocks == run.num_blocks - 1
