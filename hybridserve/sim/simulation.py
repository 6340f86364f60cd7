"""The simulation driver: the real Scheduler and EngineCore on a simulated clock.

`run_simulation` builds the KV pool from the presets, a Scheduler, the SimExecutor (with
its shadow-KV race detector, non-strict so violations are counted, not raised) and the
EngineCore, then feeds requests in as the clock reaches their arrival times.

Clock model (`TimedExecutor`): a step is dispatched `cpu_step_overhead_s` after the clock
time at which the engine scheduled it, and runs on the GPU as soon as the GPU (each
pipeline stage, in order) is free, for the cost model's step time. Waiting for a step
moves the clock to its completion. With one step in flight (sync) the CPU overhead sits
between GPU steps; with two (async) it overlaps the step already running, so the GPU is
the bottleneck. The clock never goes backwards.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from tqdm import tqdm

from hybridserve.core.errors import ConfigError, HybridServeError
from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from hybridserve.engine.loop import build_engine
from hybridserve.executor.base import Executor
from hybridserve.executor.sim.executor import SimExecutor
from hybridserve.sim.config import SimConfig
from hybridserve.sim.cost_model import CostModel
from hybridserve.sim.presets import get_gpu, get_layout, load_presets
from hybridserve.sim.recorder import RunRecorder, config_dict
from hybridserve.sim.report import SimReport, plot, print_summary
from hybridserve.sim.workload import WorkloadItem, to_requests

__all__ = ["SimConfig", "SimReport", "SimulationError", "TimedExecutor", "build_kv_cache_config", "plot",
           "print_summary", "run_simulation"]

# Consecutive engine iterations without a processed step or arrival before giving up.
MAX_IDLE_ITERATIONS = 100_000


class SimulationError(HybridServeError, RuntimeError):
    """The simulation could not make progress."""


def build_kv_cache_config(cfg: SimConfig) -> KVCacheConfig:
    """The pool the engine would build: one state block a Mamba layer whatever the drafts
    (a verify chunk's per-token states stay outside the pool, as the torch runner's
    TokenStates do), so no `num_speculative_blocks`."""
    layout = get_layout(cfg.model_layout)
    return layout.kv_cache_config(
        get_gpu(cfg.gpu),
        cfg.block_size,
        cfg.num_blocks,
        cfg.gpu_memory_utilization,
        dtype=cfg.kv_dtype,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
    )


class SimClock:
    """Simulated seconds since the run started."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0


class TimedExecutor(Executor):
    """Wraps an executor and charges each step's cost-model time to a simulated clock.

    Invariant: a step's completion time is never before its dispatch time, and stage s
    runs steps in dispatch order (stage_free[s] only grows).
    """

    def __init__(self, inner: Executor, clock: SimClock, cost: CostModel, cpu_overhead_s: float, pp: int) -> None:
        self.inner = inner
        self.clock = clock
        self.cost = cost
        self.cpu_overhead_s = cpu_overhead_s
        self.pp = pp
        self.stage_overhead_s = cost.overheads.pp_stage_overhead_s if pp > 1 else 0.0
        self.stage_free = [0.0] * pp
        self.computes_in_chunk_attention_from_batch = inner.computes_in_chunk_attention_from_batch

    def initialize(self, kv_cache_config: KVCacheConfig) -> None:
        self.inner.initialize(kv_cache_config)

    def observe_block_pool(self, pool: Any) -> None:
        self.inner.observe_block_pool(pool)

    def execute(self, scheduler_output: SchedulerOutput) -> Any:
        handle = self.inner.execute(scheduler_output)
        t = self.clock.now + self.cpu_overhead_s
        if not scheduler_output.requests:
            # An empty step launches no GPU work: it only takes the CPU's time, so idle
            # polling (e.g. for connector loads) lets simulated time pass.
            return (handle, t + self.cost.overheads.fixed_step_overhead_s)
        reqs = scheduler_output.requests
        ctxs, news = [r.num_computed_tokens for r in reqs], [r.num_scheduled_tokens for r in reqs]
        stage_time = self.cost.columns_time(ctxs, news) / self.pp + self.stage_overhead_s
        free = self.stage_free
        for s in range(self.pp):
            t = (t if t > free[s] else free[s]) + stage_time
            free[s] = t
        return (handle, t)

    def wait(self, handle: Any) -> ModelRunnerOutput:
        inner_handle, done_at = handle
        out = self.inner.wait(inner_handle)
        if done_at > self.clock.now:
            self.clock.now = done_at
        return out

    def shutdown(self) -> None:
        self.inner.shutdown()


def _make_connector(cfg: SimConfig, kv_config: KVCacheConfig) -> Any:
    """The simulated CPU-offload connector (one object serves scheduler and executor)."""
    if not cfg.connector:
        return None
    from hybridserve.executor.sim.connector import SimOffloadConnector

    return SimOffloadConnector(
        kv_config,
        capacity_blocks=cfg.connector_capacity_blocks,
        max_delay_steps=cfg.connector_max_delay_steps,
        failure_rate=cfg.connector_failure_rate,
        seed=cfg.seed,
    )


def run_simulation(sim_config: SimConfig, items: list[WorkloadItem], progress: bool = True) -> SimReport:
    """Simulate `items` under `sim_config`; see the module docstring for the clock model.

    The cyclic GC is off for the whole run. A run makes almost no cyclic garbage (a few
    hundred objects in a 1,024-request run) but builds and grows large live structures
    (the block pool's tens of thousands of linked blocks, each request's token and
    fingerprint lists), which every collection re-walked: 10-15% of a detector-off run,
    more the more requests live, so larger runs were slower per request.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(sim_config, items, progress)
    finally:
        if gc_was_enabled:
            gc.enable()


def _simulate(sim_config: SimConfig, items: list[WorkloadItem], progress: bool) -> SimReport:
    if not items:
        raise ConfigError("the workload has no requests")
    cfg = sim_config
    wall_start = time.perf_counter()
    layout, gpu = get_layout(cfg.model_layout), get_gpu(cfg.gpu)
    if not 0.0 <= cfg.acceptance_rate <= 1.0:
        raise ConfigError(f"--acceptance-rate must be in [0, 1], got {cfg.acceptance_rate}")
    max_model_len = cfg.resolve_max_model_len(items)
    sched_cfg = SchedulerConfig.from_settings(cfg, max_model_len=max_model_len,
                                              max_in_flight_tokens_override=cfg.max_in_flight_tokens)
    kv_config = build_kv_cache_config(cfg)
    connector = _make_connector(cfg, kv_config)
    sim_exec = SimExecutor(
        vocab_size=layout.vocab_size,
        num_speculative_tokens=cfg.num_speculative_tokens,
        acceptance_rate=cfg.acceptance_rate,
        seed=cfg.seed,
        detector=cfg.detector,
        strict=False,
        connector=connector,
    )
    clock = SimClock()
    cost = CostModel(gpu, layout, kv_dtype=cfg.kv_dtype)
    timed = TimedExecutor(sim_exec, clock, cost, load_presets().engine.cpu_step_overhead_s, cfg.pipeline_parallel_size)
    engine = build_engine(sched_cfg, kv_config, timed, connector, cfg.unsafe_optimistic_free)
    scheduler = engine.scheduler

    requests = sorted(to_requests(items, cfg.seed, layout.vocab_size), key=lambda r: r.arrival_time)
    arrival = [r.arrival_time for r in requests]
    rec = RunRecorder(requests, len(kv_config.groups))
    n = len(requests)
    bar = tqdm(total=n, unit="req", disable=not progress, leave=False, desc=cfg.label)
    clock.now = start_time = arrival[0]
    i = idle = 0
    try:
        while i < n or engine.has_unfinished_requests():
            while i < n and arrival[i] <= clock.now:
                out = engine.add_request(requests[i])
                if out is not None and out.finished:
                    rec.rejected(i, clock.now)
                    bar.update(1)
                i += 1
            if not engine.has_unfinished_requests():
                clock.now = max(clock.now, arrival[i])  # idle until the next arrival
                continue
            so, outs = engine.step()
            if so is None or (so.is_empty() and not outs):
                # Empty steps (e.g. only connector loads pending) still cost their overhead
                # on the clock, so time passes while nothing is runnable.
                idle += 1
                if idle > MAX_IDLE_ITERATIONS:
                    raise SimulationError(f"no request made progress for {idle} steps at t={clock.now:.3f}s")
                if so is None:
                    clock.now += cost.overheads.fixed_step_overhead_s
                continue
            idle = 0
            done = rec.step(clock.now, outs, scheduler)
            if done:
                bar.update(done)
    finally:
        bar.close()
        timed.shutdown()
    rec.sample_kv(clock.now, scheduler)
    config = config_dict(cfg, max_model_len=max_model_len, max_in_flight_tokens=sched_cfg.max_in_flight_tokens)
    return rec.report(config, cfg.label, kv_config, scheduler, clock.now - start_time,
                      time.perf_counter() - wall_start, list(sim_exec.violations))
