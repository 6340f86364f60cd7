"""The shadow-KV detector catches both bugs of the optimistic basis, and nothing in safe mode."""

from __future__ import annotations

import pytest

from hybridserve.core.kv.single_type_managers import (
    InPlaceMambaManager, SingleTypeKVCacheManager, SlidingWindowManager,
)
from hybridserve.core.kv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from hybridserve.executor.sim.shadow_kv import (
    FREED, NULL_READ, OVERWRITTEN, SHARED_WRITE, UNOWNED, WRONG, RaceViolation,
)
from tests.helpers.sim_helpers import make_request, reference_output, run_sim

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


def _free_one_block_early(monkeypatch):
    """Inject a fault: each time pruning runs, it also frees the first block still in the
    window (the one the rule frees a block's worth of tokens later) and keeps its table
    entry as the executor sees it: the null mark does not move, so no delta tells the
    executor, which goes on reading the block. The manager's own entry becomes a hole so
    that the block is not freed twice."""
    prune = SlidingWindowManager.remove_skipped_blocks
    freed_early = []

    def prune_one_block_early(self, request_id, processed_computed_tokens):
        prune(self, request_id, processed_computed_tokens)
        blocks = self.req_to_blocks.get(request_id)
        i = self.num_null_blocks.get(request_id, 0)
        next_boundary = self.get_num_skipped_tokens(processed_computed_tokens + self.block_size) // self.block_size
        if blocks and i < len(blocks) and i < next_boundary and not blocks[i].is_null:
            freed_early.append(blocks[i].block_id)
            self.pool.free_blocks([blocks[i]])
            blocks[i] = self.pool.null_block
            self.num_real_blocks[request_id] -= 1

    monkeypatch.setattr(SlidingWindowManager, "remove_skipped_blocks", prune_one_block_early)
    return freed_early


def test_read_of_a_block_freed_one_block_early_is_reported(monkeypatch):
    """Sync mode, prefix caching on, a roomy pool: the early-freed block is never handed
    out again, so its slots keep the right content and every output is still right; only
    the ownership check sees that requests read blocks they no longer hold."""
    freed_early = _free_one_block_early(monkeypatch)
    reqs = long_prompts(n=2, length=300, max_tokens=40)
    run = run_sim([FULL, SW], reqs, 4000, max_model_len=MML, max_num_batched_tokens=256,
                  async_scheduling=False, enable_prefix_caching=True, strict=False)
    assert freed_early
    check_reference(run, reqs)  # the content alone looks right
    kinds = {v.kind for v in run.violations}
    assert kinds == {UNOWNED}
    assert all(v.group == 1 and v.block in freed_early for v in run.violations)


def test_a_running_mamba_state_published_early_is_caught_at_the_write(monkeypatch):
    """Inject a bug: in-place Mamba groups publish up to the scheduled count, so a running
    state whose block just filled is cached while it still runs. b hits it, and a's next
    step moves its state on in that same block: reported as the write, before b reads."""

    def publish_early(self, request, num_tokens, num_processed_tokens):
        SingleTypeKVCacheManager.cache_blocks(self, request, num_tokens, num_processed_tokens)

    monkeypatch.setattr(InPlaceMambaManager, "cache_blocks", publish_early)
    specs = [FullAttentionSpec(4, 1, 8), MambaSpec(4, shapes=((4, 4),))]
    prompt = list(range(10, 18))

    def reqs():
        return [(0, make_request("a", prompt, 6)), (3, make_request("b", prompt + [5, 6], 4))]

    run = run_sim(specs, reqs(), 64, async_scheduling=False, strict=False, max_model_len=64)
    assert [(v.kind, v.request_id, v.group) for v in run.violations][:2] == [(SHARED_WRITE, "a", 1), (WRONG, "b", 1)]
    monkeypatch.undo()
    assert run_sim(specs, reqs(), 64, async_scheduling=False, max_model_len=64).violations == []
