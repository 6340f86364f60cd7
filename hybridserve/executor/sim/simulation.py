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

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from tqdm import tqdm

from hybridserve.core.errors import ConfigError, HybridServeError
from hybridserve.core.kv.spec import KVCacheConfig, KVCacheGroup, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from hybridserve.core.sched.scheduler import Scheduler
from hybridserve.engine.executor import Executor
from hybridserve.engine.loop import EngineCore
from hybridserve.executor.sim.cost_model import CostModel
from hybridserve.executor.sim.executor import SimExecutor
from hybridserve.executor.sim.presets import get_gpu, get_layout, load_presets
from hybridserve.executor.sim.report import SimReport, TimeSeries, percentiles
from hybridserve.executor.sim.workload import WorkloadItem, to_requests

# Consecutive engine iterations without a processed step or arrival before giving up.
MAX_IDLE_ITERATIONS = 100_000
# KV usage per group is sampled at most about this many times per run (stride doubles).
MAX_KV_SAMPLES = 4096


class SimulationError(HybridServeError, RuntimeError):
    """The simulation could not make progress."""


@dataclass(frozen=True)
class SimConfig:
    """One configuration to simulate. `max_model_len` None: the longest request, at least 8192."""

    gpu: str = "H100"
    model_layout: str = "gemma3-27b-like"
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_dtype: str = "bfloat16"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    async_scheduling: bool = True
    pipeline_parallel_size: int = 1
    num_speculative_tokens: int = 0
    acceptance_rate: float = 0.7
    enable_prefix_caching: bool = True
    connector: bool = False
    connector_capacity_blocks: int = 4096
    connector_max_delay_steps: int = 3
    connector_failure_rate: float = 0.0
    detector: bool = True
    unsafe_optimistic_free: bool = False
    seed: int = 0
    label: str = "run"

    def resolve_max_model_len(self, items: list[WorkloadItem]) -> int:
        layout = get_layout(self.model_layout)
        longest = max(it.prompt_len + it.output_len for it in items)
        if self.max_model_len is not None:
            if self.max_model_len < 2:
                raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
            for it in items:
                if it.prompt_len + it.output_len > self.max_model_len:
                    raise ConfigError(
                        f"--max-model-len {self.max_model_len} is shorter than request {it.index}: prompt "
                        f"{it.prompt_len} + output {it.output_len} tokens"
                    )
            return self.max_model_len
        if longest > layout.max_position_embeddings:
            raise ConfigError(
                f"a request of {longest} tokens exceeds {layout.name}'s {layout.max_position_embeddings} positions"
            )
        return max(8192, longest)


def group_label(index: int, group: KVCacheGroup) -> str:
    """A short name for a KV cache group, e.g. 'g0 sliding W=1024 (52 layers)'."""
    spec = group.spec
    if isinstance(spec, SlidingWindowSpec):
        kind = f"sliding W={spec.sliding_window}"
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        kind = f"chunked C={spec.attention_chunk_size}"
    elif isinstance(spec, MambaSpec):
        kind = "mamba"
    else:
        kind = "full"
    return f"g{index} {kind} ({len(group.layer_names)} layers)"


def build_kv_cache_config(cfg: SimConfig) -> KVCacheConfig:
    layout = get_layout(cfg.model_layout)
    return layout.kv_cache_config(
        get_gpu(cfg.gpu),
        cfg.block_size,
        cfg.num_blocks,
        cfg.gpu_memory_utilization,
        dtype=cfg.kv_dtype,
        num_speculative_blocks=cfg.num_speculative_tokens,
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
        batch = [(r.num_computed_tokens, r.num_scheduled_tokens) for r in scheduler_output.requests]
        stage_time = self.cost.step_time(batch) / self.pp + self.stage_overhead_s
        t = self.clock.now + self.cpu_overhead_s
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
    """Simulate `items` under `sim_config`; see the module docstring for the clock model."""
    if not items:
        raise ConfigError("the workload has no requests")
    cfg = sim_config
    wall_start = time.perf_counter()
    layout, gpu = get_layout(cfg.model_layout), get_gpu(cfg.gpu)
    if not 0.0 <= cfg.acceptance_rate <= 1.0:
        raise ConfigError(f"--acceptance-rate must be in [0, 1], got {cfg.acceptance_rate}")
    max_model_len = cfg.resolve_max_model_len(items)
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=max_model_len,
        async_scheduling=cfg.async_scheduling,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
        num_speculative_tokens=cfg.num_speculative_tokens,
        enable_prefix_caching=cfg.enable_prefix_caching,
    )
    kv_config = build_kv_cache_config(cfg)
    connector = _make_connector(cfg, kv_config)
    scheduler = Scheduler(sched_cfg, kv_config, connector=connector, unsafe_optimistic_free=cfg.unsafe_optimistic_free)
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
    engine = EngineCore(scheduler, timed)

    requests = sorted(to_requests(items, cfg.seed, layout.vocab_size), key=lambda r: r.arrival_time)
    n = len(requests)
    slot = {r.request_id: k for k, r in enumerate(requests)}
    arrival = [r.arrival_time for r in requests]
    first_token = [-1.0] * n
    finish = [-1.0] * n
    num_out = [0] * n
    rejected = 0
    series = TimeSeries(kv_usage=[[] for _ in kv_config.groups])
    kv_stride, next_kv_sample = 1, 0
    bar = tqdm(total=n, unit="req", disable=not progress, leave=False, desc=cfg.label)
    clock.now = arrival[0]
    start_time = arrival[0]
    i = idle = 0
    try:
        while i < n or engine.has_unfinished_requests():
            while i < n and arrival[i] <= clock.now:
                out = engine.add_request(requests[i])
                if out is not None and out.finished:
                    rejected += 1
                    finish[i] = clock.now
                    bar.update(1)
                i += 1
            if not engine.has_unfinished_requests():
                clock.now = max(clock.now, arrival[i])
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
            now = clock.now
            produced = done = 0
            for o in outs:
                k = slot[o.request_id]
                if o.new_token_ids:
                    produced += len(o.new_token_ids)
                    if first_token[k] < 0:
                        first_token[k] = now
                    num_out[k] += len(o.new_token_ids)
                if o.finished:
                    finish[k] = now
                    done += 1
            if done:
                bar.update(done)
            series.time.append(now)
            series.running.append(len(scheduler.running))
            series.waiting.append(len(scheduler.waiting))
            series.output_tokens.append(produced)
            step_index = len(series.time) - 1
            if step_index >= next_kv_sample:
                _sample_kv(series, scheduler, now)
                if len(series.kv_time) >= MAX_KV_SAMPLES:
                    _halve_kv_samples(series)
                    kv_stride *= 2
                next_kv_sample = step_index + kv_stride
    finally:
        bar.close()
        timed.shutdown()
    _sample_kv(series, scheduler, clock.now)
    violations = list(getattr(sim_exec, "violations", []))
    return _make_report(cfg, max_model_len, kv_config, scheduler, series, arrival, first_token, finish,
                        num_out, requests, rejected, clock.now - start_time, time.perf_counter() - wall_start,
                        violations)


def _sample_kv(series: TimeSeries, scheduler: Scheduler, now: float) -> None:
    series.kv_time.append(now)
    for g, usage in enumerate(scheduler.kv_cache_manager.group_usage()):
        series.kv_usage[g].append(usage)


def _halve_kv_samples(series: TimeSeries) -> None:
    series.kv_time = series.kv_time[::2]
    series.kv_usage = [u[::2] for u in series.kv_usage]


def _time_weighted_mean(times: list[float], values: list[float]) -> float:
    """Mean of a step function that holds values[i] from times[i] to times[i+1]."""
    if not values:
        return 0.0
    if len(values) == 1 or times[-1] <= times[0]:
        return sum(values) / len(values)
    total = sum(v * (t1 - t0) for v, t0, t1 in zip(values, times, times[1:]))
    return total / (times[-1] - times[0])


def _make_report(
    cfg: SimConfig, max_model_len: int, kv_config: KVCacheConfig, scheduler: Scheduler, series: TimeSeries,
    arrival: list[float], first_token: list[float], finish: list[float], num_out: list[int],
    requests: list[Any], rejected: int, sim_time: float, wall_time: float, violations: list[Any],
) -> SimReport:
    ttft, tpot, e2e = [], [], []
    finished = 0
    for k in range(len(arrival)):
        if finish[k] < 0 or num_out[k] == 0:
            continue
        finished += 1
        ttft.append(first_token[k] - arrival[k])
        e2e.append(finish[k] - arrival[k])
        if num_out[k] > 1:
            tpot.append((finish[k] - first_token[k]) / (num_out[k] - 1))
    out_tokens = sum(num_out)
    prompt_tokens = sum(r.num_prompt_tokens for r, o in zip(requests, num_out) if o)
    span = sim_time if sim_time > 0 else float("nan")
    stats = scheduler.stats
    kv = scheduler.kv_cache_manager
    config = asdict(cfg)
    config["max_model_len"] = max_model_len
    config["max_in_flight_tokens"] = scheduler.config.max_in_flight_tokens
    return SimReport(
        label=cfg.label,
        config=config,
        num_requests=len(arrival),
        num_finished=finished,
        num_rejected=rejected,
        sim_time_s=sim_time,
        wall_time_s=wall_time,
        num_steps=len(series.time),
        prompt_tokens=prompt_tokens,
        output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / span,
        total_tokens_per_s=(out_tokens + prompt_tokens) / span,
        ttft_s=percentiles(ttft),
        tpot_s=percentiles(tpot),
        e2e_s=percentiles(e2e),
        mean_running=_time_weighted_mean(series.time, [float(x) for x in series.running]),
        max_running=max(series.running, default=0),
        num_preemptions=stats.num_preemptions,
        num_blocks=kv_config.num_blocks,
        kv_groups=[group_label(g, grp) for g, grp in enumerate(kv_config.groups)],
        kv_peak_usage=[max(u, default=0.0) for u in series.kv_usage],
        kv_mean_usage=[_time_weighted_mean(series.kv_time, u) for u in series.kv_usage],
        pool_peak_usage=max((sum(col) for col in zip(*series.kv_usage)), default=0.0),
        prefix_cache_hit_rate=kv.prefix_cache_stats.hit_rate,
        spec_acceptance_rate=stats.acceptance_rate,
        violations=len(violations),
        violation_examples=[str(v) for v in violations[:20]],
        series=series,
    )


def with_label(cfg: SimConfig, label: str) -> SimConfig:
    return replace(cfg, label=label)
