"""Per-request timings and per-step samples of one simulation run, turned into a SimReport.

Invariants: a request's first-token time is the clock when its first token was processed,
its finish time the clock when its finishing output was processed; every processed step
appends exactly one sample to each per-step series. Token counts come from the scheduler
(its generated-token count per step, each request's outputs at the end): every output it
reports carries at least one token, and its tokens are exactly what it appended. KV usage per group is sampled with a
stride that doubles whenever MAX_KV_SAMPLES is reached and grows with the blocks held,
so long runs and big pools stay cheap; the stride depends only on simulated state, so
identical runs record identical samples.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from hybridserve.core.kv.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
    blocks_per_request,
)
from hybridserve.core.request import Request
from hybridserve.core.sched.output import RequestOutput
from hybridserve.core.sched.scheduler import Scheduler
from hybridserve.sim.report import SimReport, TimeSeries, percentiles

MAX_KV_SAMPLES = 4096
# A sample walks every held block; space samples so that, per step, sampling costs about
# as much as walking this many blocks.
KV_SAMPLE_BLOCKS_PER_STEP = 2048


def group_label(index: int, group: KVCacheGroup) -> str:
    """A short name for a KV cache group, e.g. 'g0 sliding W=1024 (52 layers)'."""
    spec = group.spec
    if isinstance(spec, SlidingWindowSpec):
        kind = f"sliding W={spec.sliding_window}"
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        kind = f"chunked C={spec.attention_chunk_size}"
    elif isinstance(spec, MambaSpec):
        kind = f"mamba, {spec.num_pages} pages a state" if spec.num_pages > 1 else "mamba"
    else:
        kind = "full"
    return f"g{index} {kind} ({len(group.layer_names)} layers)"


def group_usage(scheduler: Scheduler) -> list[float]:
    """Per group, the fraction of allocatable blocks its block tables hold.

    Blocks shared by several requests (prefix-cache hits) count once, so a group never
    exceeds 100%; the null block does not count. While no block is shared at all, the
    managers' per-table real-block counts add up to that (no set of every held block,
    which cost ~10% of a run without prefix hits); otherwise the set is built by
    C-level `set.update` per table.
    """
    kv = scheduler.kv
    total = kv.pool.num_blocks - 1
    if not kv.pool.num_shared_blocks:
        return [sum(m.num_real_blocks.values()) / total for m in kv.coordinator.managers]
    usage = []
    for m in kv.coordinator.managers:
        held: set[Any] = set()
        for blocks in m.req_to_blocks.values():
            held.update(blocks)
        held.discard(kv.pool.null_block)
        usage.append(len(held) / total)
    return usage


def _is_page(group: KVCacheGroup) -> bool:
    """A Mamba state's page 1.. (MambaSpec.num_pages): reported with its page 0."""
    return isinstance(group.spec, MambaSpec) and group.spec.page_index > 0


def merge_state_pages(series: TimeSeries, kv_config: KVCacheConfig) -> TimeSeries:
    """The series with each paged Mamba state's page groups summed into one (they follow
    page 0 in the group list), so a report lists states, not hundreds of pages."""
    if not any(_is_page(g) for g in kv_config.groups):
        return series
    merged: list[list[float]] = []
    for grp, usage in zip(kv_config.groups, series.kv_usage):
        if _is_page(grp):
            merged[-1] = [a + b for a, b in zip(merged[-1], usage)]
        else:
            merged.append(list(usage))
    return replace(series, kv_usage=merged)


def time_weighted_mean(times: list[float], values: list[float]) -> float:
    """Mean of a step function that holds values[i] from times[i] to times[i+1]."""
    if not values:
        return 0.0
    if len(values) == 1 or times[-1] <= times[0]:
        return sum(values) / len(values)
    total = sum(v * (t1 - t0) for v, t0, t1 in zip(values, times, times[1:]))
    return total / (times[-1] - times[0])


class RunRecorder:
    def __init__(self, requests: list[Request], num_groups: int) -> None:
        self.requests = requests
        n = len(requests)
        self.slot = {r.request_id: k for k, r in enumerate(requests)}
        self.awaiting_first = dict(self.slot)  # requests with no token processed yet
        self.arrival = [r.arrival_time for r in requests]
        self.first_token = [-1.0] * n
        self.finish = [-1.0] * n
        self.num_rejected = 0
        self._num_generated = 0  # the scheduler's generated-token count at the last step
        self.series = TimeSeries(kv_usage=[[] for _ in range(num_groups)])
        self._kv_stride = 1
        self._next_kv_sample = 0

    def rejected(self, index: int, now: float) -> None:
        self.num_rejected += 1
        self.finish[index] = now

    def step(self, now: float, outputs: list[RequestOutput], scheduler: Scheduler) -> int:
        """Record one processed step; returns how many requests it finished."""
        done = 0
        slot, awaiting, first, finish = self.slot, self.awaiting_first, self.first_token, self.finish
        for o in outputs:  # each carries new tokens
            k = awaiting.pop(o.request_id, -1)
            if k >= 0:
                first[k] = now  # its first tokens
            if o.finished:
                finish[slot[o.request_id]] = now
                done += 1
        generated = scheduler.stats.num_generated_tokens
        produced, self._num_generated = generated - self._num_generated, generated
        s = self.series
        s.time.append(now)
        s.running.append(len(scheduler.running))
        s.waiting.append(len(scheduler.waiting))
        s.output_tokens.append(produced)
        index = len(s.time) - 1
        if index >= self._next_kv_sample:
            held = self.sample_kv(now, scheduler)
            if len(s.kv_time) >= MAX_KV_SAMPLES:
                s.kv_time = s.kv_time[::2]
                s.kv_usage = [u[::2] for u in s.kv_usage]
                self._kv_stride *= 2
            self._next_kv_sample = index + max(self._kv_stride, 1 + held // KV_SAMPLE_BLOCKS_PER_STEP)
        return done

    def sample_kv(self, now: float, scheduler: Scheduler) -> int:
        """Record every group's usage at `now`; returns the blocks the tables hold."""
        self.series.kv_time.append(now)
        usage = group_usage(scheduler)
        for g, u in enumerate(usage):
            self.series.kv_usage[g].append(u)
        return round(sum(usage) * (scheduler.kv.pool.num_blocks - 1))

    def report(
        self, config: dict[str, Any], label: str, kv_config: KVCacheConfig, scheduler: Scheduler,
        sim_time: float, wall_time: float, violations: list[Any],
    ) -> SimReport:
        ttft, tpot, e2e = [], [], []
        finished = prompt_tokens = 0
        num_out = [len(req.output_token_ids) for req in self.requests]
        for k, req in enumerate(self.requests):
            if self.finish[k] < 0 or num_out[k] == 0:
                continue
            finished += 1
            prompt_tokens += req.num_prompt_tokens
            ttft.append(self.first_token[k] - self.arrival[k])
            e2e.append(self.finish[k] - self.arrival[k])
            if num_out[k] > 1:
                tpot.append((self.finish[k] - self.first_token[k]) / (num_out[k] - 1))
        out_tokens = sum(num_out)
        span = sim_time if sim_time > 0 else float("nan")
        s, stats = merge_state_pages(self.series, kv_config), scheduler.stats
        kv, sc = scheduler.kv, scheduler.config
        # What admission reserves for one max_model_len request (the groups as the KV
        # manager sized them: Mamba checkpoints included), per token of it.
        per_request = blocks_per_request(kv.config.groups, sc.max_in_flight_tokens, sc.max_model_len, kv.window_tail)
        return SimReport(
            label=label,
            config=config,
            num_requests=len(self.requests),
            num_finished=finished,
            num_rejected=self.num_rejected,
            sim_time_s=sim_time,
            wall_time_s=wall_time,
            num_steps=len(s.time),
            prompt_tokens=prompt_tokens,
            output_tokens=out_tokens,
            output_tokens_per_s=out_tokens / span,
            total_tokens_per_s=(out_tokens + prompt_tokens) / span,
            ttft_s=percentiles(ttft),
            tpot_s=percentiles(tpot),
            e2e_s=percentiles(e2e),
            mean_running=time_weighted_mean(s.time, [float(x) for x in s.running]),
            max_running=max(s.running, default=0),
            num_preemptions=stats.num_preemptions,
            num_blocks=kv_config.num_blocks,
            kv_bytes_per_token=kv.config.bytes_per_block * per_request / sc.max_model_len,
            max_len_requests=(kv_config.num_blocks - 1) / per_request,
            kv_groups=[group_label(g, grp) for g, grp in enumerate(kv_config.groups) if not _is_page(grp)],
            kv_peak_usage=[max(u, default=0.0) for u in s.kv_usage],
            kv_mean_usage=[time_weighted_mean(s.kv_time, u) for u in s.kv_usage],
            pool_peak_usage=max((sum(col) for col in zip(*s.kv_usage)), default=0.0),
            pool_mean_usage=time_weighted_mean(s.kv_time, [sum(col) for col in zip(*s.kv_usage)]),
            prefix_cache_hit_rate=scheduler.kv.prefix_cache_stats.hit_rate,
            spec_acceptance_rate=stats.acceptance_rate,
            violations=len(violations),
            violation_examples=[str(v) for v in violations[:20]],
            series=s,
        )


def config_dict(cfg: Any, **resolved: Any) -> dict[str, Any]:
    """The run's configuration as JSON-ready dict, with values resolved at run time."""
    d = asdict(cfg)
    d.update(resolved)
    return d
