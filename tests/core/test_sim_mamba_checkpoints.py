"""Mamba prefix caching in the simulator: a state checkpoint per block (MambaSpec.block_checkpoints).

The shadow KV checks every state a step starts from (the checkpoint a prefix hit serves
included) holds the fingerprint of exactly the prefix before it.
"""

from __future__ import annotations

import pytest

from hybridserve.core.kv.spec import MambaSpec, SlidingWindowSpec
from hybridserve.executor.sim.shadow_kv import FREED, WRONG
from tests.helpers.mamba_sim import BS, FULL, MAMBA, MML, SW, check, offload_workload
from tests.helpers.sim_helpers import make_request, run_sim

def shared_prefix_requests(prefix_len: int = 100, n: int = 3, gap: int = 60) -> list:
    """n requests sharing a prefix_len-token prefix, arriving `gap` steps apart."""
    prefix = [(j * 7) % 900 + 5 for j in range(prefix_len)]
    return [(i * gap, make_request(f"r{i}", prefix + [1000 + i * 10 + j for j in range(30)], 12)) for i in range(n)]


@pytest.mark.parametrize("specs", [[MAMBA], [FULL, MAMBA], [SW, MAMBA]], ids=["mamba", "full+mamba", "sw+mamba"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_later_requests_start_from_the_shared_prefix_checkpoint(specs, async_scheduling):
    reqs = shared_prefix_requests()
    run = run_sim(specs, reqs, 200, max_model_len=MML, max_num_batched_tokens=40, async_scheduling=async_scheduling)
    check(run, reqs)
    stats = run.scheduler.kv.prefix_cache_stats
    # The 100-token prefix ends mid-block: the last whole-block checkpoint is at 96 tokens.
    assert stats.hits == 2 * 96


def test_without_prefix_caching_mamba_keeps_one_state_block():
    reqs = shared_prefix_requests()
    run = run_sim([FULL, MAMBA], reqs, 200, max_model_len=MML, max_num_batched_tokens=40,
                  enable_prefix_caching=False)
    check(run, reqs)
    assert run.scheduler.kv.prefix_cache_stats.hits == 0
    assert not run.scheduler.kv.coordinator.managers[1].checkpoints


@pytest.mark.parametrize("acceptance_rate", [0.3, 0.9])
def test_spec_decode_rollback_keeps_checkpoints_right(acceptance_rate):
    """Drafts cross block boundaries and get rejected; multi-turn follow-ups hit the
    checkpoints written during decoding."""
    first = [(0, make_request(f"a{i}", [(i * 31 + j) % 800 + 3 for j in range(40)], 60)) for i in range(2)]
    base = run_sim([FULL, MAMBA], first, 300, max_model_len=MML, num_speculative_tokens=3,
                   acceptance_rate=acceptance_rate)
    check(base, first)
    again = [(0, make_request(f"a{i}", [(i * 31 + j) % 800 + 3 for j in range(40)], 60)) for i in range(2)]
    follow = [(120, make_request(f"b{i}", r.prompt_token_ids + base.outputs[r.request_id] + [9] * 5, 10))
              for i, (_, r) in enumerate(again)]
    run = run_sim([FULL, MAMBA], again + follow, 300, max_model_len=MML, num_speculative_tokens=3,
                  acceptance_rate=acceptance_rate, concurrent_batches=3)
    check(run, again + follow)
    assert run.scheduler.kv.prefix_cache_stats.hits >= 2 * 96  # 100 known tokens -> 6 whole blocks each


def three_steps_three_drafts(prefix_caching: bool, unsafe: bool = False):  # type: ignore[no-untyped-def]
    """Six 90-token prompts in a 60-block pool, k = 3 steps and d = 3 drafts in flight; the
    Mamba cap the run was held to (run_sim checks every step that no request holds more
    real Mamba blocks than it; in place: R last, besides it only best-effort checkpoints
    of recent steps)."""
    reqs = [(i * 3, make_request(f"r{i}", [(i * 131 + j) % 30_000 + 2 for j in range(90)], 40)) for i in range(6)]
    run = run_sim([FULL, MAMBA], reqs, 60, max_model_len=256, max_num_batched_tokens=32, concurrent_batches=3,
                  num_speculative_tokens=3, acceptance_rate=0.5, enable_prefix_caching=prefix_caching,
                  unsafe=unsafe, strict=not unsafe)
    sched = run.scheduler
    cap = sched.kv.coordinator.managers[1].spec.max_admission_blocks_per_request(
        sched.config.max_in_flight_tokens, 256, sched.kv.window_tail)
    return run, reqs, cap


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["one-block", "in-place"])
def test_one_state_block_serves_three_steps_and_three_drafts_in_flight(prefix_caching):
    """A request's Mamba cap is 1 block, not 1 + k or 1 + d: steps run in order, so each
    reads the state its predecessor wrote in place, and a verify chunk's per-token states
    stay outside the pool. The detector finds no stale or freed state read."""
    run, reqs, cap = three_steps_three_drafts(prefix_caching)
    assert cap == 1
    check(run, reqs, 256)


def test_one_state_block_in_place_needs_the_processed_basis():
    """The same run with blocks pruned on the scheduled count instead of the processed one
    (the unsafe switch): the detector reports the Mamba group (the one-block layout
    prunes nothing, so the switch cannot matter there)."""
    run, _, cap = three_steps_three_drafts(prefix_caching=True, unsafe=True)
    assert cap == 1 and any(v.group == 1 for v in run.violations)


def test_the_simulator_sizes_states_as_the_engine_with_drafts() -> None:
    """`hybridserve simulate --num-speculative-tokens 3` without prefix caching: a Mamba
    layer keeps one state block a request, as the torch engine's (its verify chunks keep
    per-token states outside the pool); before, the simulator reserved 1 + 3."""
    from hybridserve.sim.simulation import SimConfig, build_kv_cache_config

    cfg = SimConfig(model_layout="jamba-like", gpu="H200", num_speculative_tokens=3, enable_prefix_caching=False)
    states = [g.spec for g in build_kv_cache_config(cfg).groups if isinstance(g.spec, MambaSpec)]
    assert states and all(s.max_admission_blocks_per_request(8192, 8192) == 1 for s in states)


def test_unsafe_basis_frees_the_state_block_an_in_flight_step_writes():
    reqs = [(0, make_request(f"r{i}", [(i * 131 + j) % 30_000 + 2 for j in range(300)], 21)) for i in range(4)]
    run = run_sim([FULL, MAMBA], reqs, 400, max_model_len=MML, max_num_batched_tokens=256, unsafe=True,
                  strict=False)
    kinds = {v.kind for v in run.violations}
    assert FREED in kinds
    assert any(v.group == 1 for v in run.violations if v.kind in (FREED, WRONG))


@pytest.mark.parametrize("specs", [[MAMBA], [FULL, MAMBA], [SW, MAMBA]], ids=["mamba", "full+mamba", "sw+mamba"])
@pytest.mark.parametrize("failure_rate", [0.0, 0.5])
def test_connector_loads_the_last_checkpoint_of_a_finished_turn(specs, failure_rate):
    run, reqs = offload_workload(specs, failure_rate=failure_rate)
    check(run, reqs, 256)
    assert run.connector.num_loaded_blocks + run.connector.num_failed_blocks > 0
    if failure_rate:
        assert run.scheduler.stats.num_failed_loads > 0


def test_unsafe_basis_lets_a_load_overwrite_a_state_being_read():
    run, _ = offload_workload([SW, MAMBA], unsafe=True)
    assert run.violations


@pytest.mark.parametrize("specs", [[MAMBA], [FULL, MAMBA]], ids=["mamba", "full+mamba"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_checkpoint_is_hit_only_once_the_step_writing_it_is_processed(specs, async_scheduling):
    """Requests sharing a prefix arrive together: a later one must not start from a
    checkpoint the same (or an in-flight) step is still writing, since a Mamba layer
    reads every state before writing any (the detector models exactly that)."""
    reqs = shared_prefix_requests(gap=0, n=4)
    run = run_sim(specs, reqs, 300, max_model_len=MML, max_num_batched_tokens=256, async_scheduling=async_scheduling)
    check(run, reqs)


def test_mamba_publishes_checkpoints_of_processed_tokens_only():
    from hybridserve.core.kv.block_pool import BlockPool
    from hybridserve.core.kv.single_type_managers import make_manager

    m = make_manager(MambaSpec(4, shapes=((2,),), block_checkpoints=True), BlockPool(16), 0, enable_caching=True)
    req = make_request("r", list(range(20)), 4)
    req.set_block_hasher(__import__("hybridserve.core.kv.hashing", fromlist=["x"]).make_block_hasher(4))
    m.allocate_new_blocks("r", 20)
    m.cache_blocks(req, 20, 9)  # 20 tokens scheduled, 9 processed: checkpoints S4, S8 only
    assert m.num_cached_blocks["r"] == 2
    m.cache_blocks(req, 20, 20)
    assert m.num_cached_blocks["r"] == 5


@pytest.mark.parametrize("failure_rate", [0.0, 0.5])
def test_a_request_waiting_for_its_load_holds_no_more_than_the_caps(failure_rate):
    """A small token budget makes the windowed caps small; a 200-token host hit must not
    keep real sliding-window (or Mamba) blocks for its whole span while it loads
    (run_sim checks every request against the caps after every step). Failed loads
    start the request over."""
    # W = 33: at finish (207 processed) the window keeps block 10, which the hit at 192 reads.
    specs = [SlidingWindowSpec(BS, 1, 8, sliding_window=33), MAMBA]
    run, reqs = offload_workload(specs, failure_rate=failure_rate, prompt_len=200, max_tokens=8, num_evict=3,
                                  evict_max_tokens=2, evict_at=60, turn2_at=400, turn2_extra=9, turn2_max_tokens=5,
                                  num_blocks=24, budget=16)
    check(run, reqs, 256)
    assert run.connector.num_loaded_blocks + run.connector.num_failed_blocks > 0


# -- a state cut into pages (MambaSpec.num_pages): sparse checkpoints ------------------------
PAGED = [MambaSpec(BS, shapes=((4, 4),), num_pages=3, page_index=k) for k in range(3)]


def _mamba_managers(run) -> list:
    return [m for m in run.scheduler.kv.coordinator.managers if isinstance(m.spec, MambaSpec)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_paged_states_hit_at_the_last_whole_block_of_the_shared_prefix(async_scheduling):
    """Three page groups decide alike and the pool has blocks to spare, so every boundary
    gets a best-effort checkpoint: both later requests sharing the 100-token prefix start
    from S96, which every page group holds (the coordinator demands all of them)."""
    reqs = shared_prefix_requests()
    run = run_sim([FULL] + PAGED, reqs, 400, max_model_len=256, max_num_batched_tokens=40,
                  async_scheduling=async_scheduling)
    check(run, reqs, 256)
    assert all(m.spec.running_in_place for m in _mamba_managers(run))
    assert run.scheduler.kv.prefix_cache_stats.hits == 2 * 96


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_short_pool_skips_checkpoints_and_outputs_stay_right(async_scheduling):
    """A pool of 24 blocks (the floor kept free: 5% of 23 = 1 block): a request holds 16
    attention blocks at 256 tokens plus its running state's 3 pages, so checkpoints (3
    blocks a column) fit only while the attention table is short. Outputs stay right,
    every checkpoint a later request starts from holds its prefix (the detector), and
    the later requests hit less than the ample pool's 2 * 96."""
    reqs = shared_prefix_requests(n=3, gap=0)
    run = run_sim([FULL] + PAGED, reqs, 24, max_model_len=256, max_num_batched_tokens=40,
                  async_scheduling=async_scheduling)
    check(run, reqs, 256)
    assert run.scheduler.kv.prefix_cache_stats.hits < 2 * 96


@pytest.mark.parametrize("acceptance_rate", [0.3, 0.9])
def test_paged_spec_decode_rollback_keeps_outputs_right(acceptance_rate):
    first = [(0, make_request(f"a{i}", [(i * 31 + j) % 800 + 3 for j in range(40)], 60)) for i in range(2)]
    base = run_sim([FULL] + PAGED, first, 600, max_model_len=MML, num_speculative_tokens=3,
                   acceptance_rate=acceptance_rate)
    check(base, first)
    again = [(0, make_request(f"a{i}", [(i * 31 + j) % 800 + 3 for j in range(40)], 60)) for i in range(2)]
    follow = [(120, make_request(f"b{i}", r.prompt_token_ids + base.outputs[r.request_id] + [9] * 5, 10))
              for i, (_, r) in enumerate(again)]
    run = run_sim([FULL] + PAGED, again + follow, 600, max_model_len=MML, num_speculative_tokens=3,
                  acceptance_rate=acceptance_rate, concurrent_batches=3)
    check(run, again + follow)
    # Decoding keeps every boundary (each decode's block is its chunk's tail): the turn
    # hits the last whole block of its first 100 known tokens.
    assert run.scheduler.kv.prefix_cache_stats.hits >= 2 * 96


@pytest.mark.parametrize("failure_rate", [0.0, 0.5])
def test_paged_connector_loads_the_last_checkpoint_of_a_finished_turn(failure_rate):
    run, reqs = offload_workload([FULL] + PAGED, failure_rate=failure_rate, num_blocks=120)
    check(run, reqs, 256)
    assert run.connector.num_loaded_blocks + run.connector.num_failed_blocks > 0


# -- injected faults in the in-place layout: the detector must catch them ------------------------
def test_detector_catches_publishing_the_running_block(monkeypatch):
    """Fault: publish a checkpoint once the processed count reaches its boundary (not
    passes it). Sync, chunks of 32: r0's first chunk ends on boundary 32 with R in
    block 1, so the next allocation publishes R under the 32-token prefix, then moves
    it on and keeps writing it; r1, sharing 40 tokens, hits it and reads a later state."""
    from hybridserve.core.kv.single_type_managers import InPlaceMambaManager, SingleTypeKVCacheManager

    def too_early(self, request, num_tokens, num_processed_tokens):  # type: ignore[no-untyped-def]
        SingleTypeKVCacheManager.cache_blocks(self, request, min(num_tokens, num_processed_tokens),
                                              num_processed_tokens)

    monkeypatch.setattr(InPlaceMambaManager, "cache_blocks", too_early)
    prefix = [(j * 7) % 900 + 5 for j in range(40)]
    reqs = [(i * 40, make_request(f"r{i}", prefix + [1000 + i] * 30, 12)) for i in range(2)]
    run = run_sim([FULL, MAMBA], reqs, 300, max_model_len=MML, max_num_batched_tokens=32, async_scheduling=False,
                  strict=False)
    assert any(v.kind == WRONG and v.group == 1 for v in run.violations)


def test_detector_catches_a_runner_that_appends_past_the_running_block(monkeypatch):
    """Fault: the executor appends an in-place group's deltas instead of inserting them
    before its last entry, so it reads a fresh checkpoint block as the running state."""
    from hybridserve.executor.sim.executor import SimExecutor

    init = SimExecutor.initialize

    def appending(self, kv_cache_config):  # type: ignore[no-untyped-def]
        init(self, kv_cache_config)
        self._in_place = [False] * len(self._in_place)

    monkeypatch.setattr(SimExecutor, "initialize", appending)
    reqs = shared_prefix_requests(n=1)
    run = run_sim([FULL, MAMBA], reqs, 300, max_model_len=MML, max_num_batched_tokens=40, strict=False)
    assert any(v.group == 1 for v in run.violations)


@pytest.mark.parametrize("connector", [False, True])
def test_the_mirror_fast_path_agrees_with_every_group(monkeypatch, connector):
    """KVCacheCoordinator.mirror_fast_path computes a request's limits and block count
    over page 0 of each paged state: the same run (async, drafts, shared prefixes, a pool
    that runs short, a connector) with it off must schedule exactly alike."""
    from hybridserve.core.kv.coordinator import KVCacheCoordinator

    def one(fast: bool):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(KVCacheCoordinator, "mirror_fast_path", fast)
        reqs = shared_prefix_requests(n=4, gap=15)
        run = run_sim([FULL] + PAGED, reqs, 40, max_model_len=256, max_num_batched_tokens=40,
                      num_speculative_tokens=2, connector=connector)
        check(run, reqs, 256)
        s = run.scheduler
        return run.outputs, s.stats.num_steps, s.stats.num_preemptions, s.kv.prefix_cache_stats.hits

    assert one(True) == one(False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_full_sequence_admission_keeps_growth_free_of_checkpoints(async_scheduling):
    """full_sequence_must_fit promises no preemption: best-effort checkpoints leave free
    what admitted requests may still grow by (run_sim checks the running sum against a
    recount after every step), so a short pool never preempts, and outputs stay right."""
    reqs = shared_prefix_requests(n=4, gap=5)
    run = run_sim([FULL] + PAGED, reqs, 60, max_model_len=256, max_num_batched_tokens=40,
                  async_scheduling=async_scheduling, full_sequence_must_fit=True, connector=True)
    check(run, reqs, 256)
    assert run.scheduler.stats.num_preemptions == 0
