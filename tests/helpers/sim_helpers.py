"""Shared helpers for simulator tests: build an engine, run a workload, compute references."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.core.kv.single_type_managers import InPlaceMambaManager
from hybridserve.core.kv.spec import KVCacheSpec
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.loop import EngineCore
from hybridserve.executor.sim.connector import SimOffloadConnector
from hybridserve.executor.sim.executor import ROOT_FP, SimExecutor, extend_fp
from hybridserve.testing import make_kv_cache_config, make_scheduler

VOCAB = 32_000


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """What a request produces alone, synchronously: the fingerprint chain's tokens."""
    fp = ROOT_FP
    for t in prompt:
        fp = extend_fp(fp, t)
    out = []
    while len(out) < max_tokens and len(prompt) + len(out) < max_model_len:
        t = fp % VOCAB
        out.append(t)
        fp = extend_fp(fp, t)
    return out


@dataclass
class SimRun:
    outputs: dict[str, list[int]]
    violations: list
    num_free_blocks: int
    num_blocks: int
    scheduler: object
    connector: object = None
    finish_reasons: dict[str, str] = field(default_factory=dict)


def run_sim(
    specs: list[KVCacheSpec],
    requests: list[tuple[int, Request]],
    num_blocks: int,
    aborts: dict[int, list[str]] | None = None,
    async_scheduling: bool = True,
    concurrent_batches: int | None = None,
    num_speculative_tokens: int = 0,
    acceptance_rate: float = 0.7,
    connector: bool = False,
    failure_rate: float = 0.0,
    unsafe: bool = False,
    strict: bool = True,
    seed: int = 0,
    **sched_kw: object,
) -> SimRun:
    """Run (arrival_step, request) pairs through scheduler + SimExecutor with the detector on."""
    kw = dict(sched_kw)
    block_size = specs[0].block_size
    if concurrent_batches is not None:
        kw["max_concurrent_batches"] = concurrent_batches
    conn = (
        SimOffloadConnector(make_kv_cache_config(num_blocks, specs, block_size), failure_rate=failure_rate, seed=seed)
        if connector
        else None
    )
    sched = make_scheduler(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_specs=specs,
        async_scheduling=async_scheduling,
        num_speculative_tokens=num_speculative_tokens,
        connector=conn,
        unsafe_optimistic_free=unsafe,
        **kw,
    )
    ex = SimExecutor(
        vocab_size=VOCAB,
        num_speculative_tokens=num_speculative_tokens,
        acceptance_rate=acceptance_rate,
        seed=seed,
        strict=strict,
        connector=conn,
    )
    engine = EngineCore(sched, ex)
    kv = sched.kv
    caps = [
        m.spec.max_admission_blocks_per_request(sched.config.max_in_flight_tokens, sched.config.max_model_len, kv.window_tail)
        for m in kv.coordinator.managers
    ]
    pending = sorted(requests, key=lambda x: x[0])
    aborts = aborts or {}
    outputs: dict[str, list[int]] = {r.request_id: [] for _, r in requests}
    reasons: dict[str, str] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, req = pending.pop(0)
            done = engine.add_request(req)
            if done is not None:
                reasons[req.request_id] = done.finish_reason or ""
        if step in aborts:
            engine.abort_requests(aborts[step])
        _, outs = engine.step()
        for o in outs:
            outputs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason or ""
        for m, cap in zip(kv.coordinator.managers, caps):
            for rid, blocks in m.req_to_blocks.items():
                real = sum(1 for b in blocks if not b.is_null)
                if isinstance(m, InPlaceMambaManager) and rid in m.running:
                    check_in_place_table(m, blocks, sched.requests.get(rid), sched.config.max_in_flight_tokens)
                    continue
                assert real <= cap, f"request {rid} holds {real} real blocks of {type(m.spec).__name__}, cap {cap}"
        # The running sum best-effort checkpoints leave free equals the recount.
        holders = [r for rid, r in sched.requests.items() if kv.holds_blocks(rid)]
        assert kv.total_outstanding == kv.outstanding_blocks(holders)
        check_block_accounting(kv)
        step += 1
        if step > 50_000:
            raise RuntimeError(
                f"simulation did not finish: {num_blocks} blocks ({sched.kv.pool.num_free_blocks} free), specs "
                f"{[type(s).__name__ for s in specs]} bs {block_size}, {kw}, running "
                f"{[(r.request_id, r.num_computed_tokens, r.num_tokens) for r in sched.running]}, waiting "
                f"{[(r.request_id, r.status.name, r.num_computed_tokens, kv.holds_blocks(r.request_id)) for r in sched.waiting]}"
                f" tables {[(rid, [b.block_id for b in bl]) for m in kv.coordinator.managers for rid, bl in m.req_to_blocks.items()]}"
                f" fenced {len(kv.fenced)} inflight {[(r.request_id, r.num_in_flight_tokens) for r in sched.running]}"
                f" queue {len(engine.queue)}")
    return SimRun(outputs, ex.violations, sched.kv.pool.num_free_blocks, num_blocks, sched, conn, reasons)


def check_block_accounting(kv) -> None:  # type: ignore[no-untyped-def]
    """No block leaks mid-run: every reference a block carries is a table entry or a fenced
    free (a finished request's blocks awaiting the step in flight), and the pool's free
    count is exactly the blocks nobody references."""
    pool = kv.pool
    refs = in_use = 0
    for b in pool.blocks[1:]:
        refs += b.ref_cnt
        in_use += b.ref_cnt > 0
    held = sum(1 for m in kv.coordinator.managers for table in m.req_to_blocks.values() for b in table if not b.is_null)
    fenced = sum(1 for _, _, blocks in kv.fenced for b in blocks if not b.is_null)
    assert refs == held + fenced, f"{refs} block references, {held} table entries + {fenced} fenced"
    assert pool.num_free_blocks == pool.num_blocks - 1 - in_use


def check_in_place_table(m: InPlaceMambaManager, blocks: list, req: Request | None, max_in_flight: int) -> None:
    """An in-place Mamba table holds its running state (the cap's one block) last, and
    besides it only blocks of recent steps: checkpoints and a first step's source, pruned
    at the next allocation on the processed basis of then, which lags the processed count
    by at most the tokens in flight then and since (2 * max_in_flight); a connector also
    keeps the last whole checkpoint. A leaked checkpoint would fall below that."""
    assert not blocks[-1].is_null, "the running state's block is the null block"
    if req is None:
        return  # finished: its blocks are fenced behind its last step
    bs = m.block_size
    basis = req.num_computed_tokens - req.num_in_flight_tokens - 2 * max_in_flight
    keep = 1 if m.spec.keep_last_checkpoint else 0
    lowest = max(0, (basis - 1) // bs - keep)
    extra = [i for i, b in enumerate(blocks[:-1]) if not b.is_null and i < lowest]
    assert not extra, f"blocks {extra} held below column {lowest} (basis {basis})"


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def check_preset_detector(unsafe: bool, items: list, **sim_config: object) -> None:
    """A preset run of `items` (run_simulation with SimConfig(**sim_config)) finishes every
    request; the race detector reports 0 violations under the rule, > 0 with the unsafe
    optimistic free."""
    from hybridserve.sim.simulation import SimConfig, run_simulation

    config = SimConfig(unsafe_optimistic_free=unsafe, **sim_config)  # type: ignore[arg-type]
    result = run_simulation(config, items, progress=False)
    assert result.num_finished == len(items)
    if unsafe:
        assert result.violations > 0
    else:
        assert result.violations == 0
