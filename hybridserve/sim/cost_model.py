"""Roofline step-time model for the simulator.

    step_time = fixed overhead + max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth)

FLOPs: 2 * active params per token, plus each layer's attention over its own context:
a query at position p attends to p+1 keys (full), min(p+1, W) (sliding window),
(p mod C)+1 (chunked local); a Mamba layer costs a constant per token.
Bytes: weights once per step (for an MoE, at most active params per token, capped at the
total), each layer's KV reads over the keys the step touches, KV writes of the new tokens,
and a Mamba layer's state read and written once per request.

Every per-request term is a closed-form sum, so the cost of `step_time` is O(requests),
never O(tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import mul
from typing import Iterable

from hybridserve.core.kv.spec import dtype_size
from hybridserve.sim.presets import EngineOverheads, GpuPreset, ModelLayout, load_presets

# One (context tokens before the step, new tokens this step) pair per scheduled request.
BatchEntry = tuple[int, int]


def full_pairs(n: int) -> int:
    """Query/key pairs of positions 0..n-1 under full attention: sum of (p+1)."""
    return n * (n + 1) // 2


def sliding_pairs(n: int, window: int) -> int:
    """Query/key pairs of positions 0..n-1 when each query sees min(p+1, W) keys."""
    if n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def chunked_pairs(n: int, chunk: int) -> int:
    """Query/key pairs of positions 0..n-1 when each query sees (p mod C)+1 keys."""
    whole, rest = divmod(n, chunk)
    return whole * (chunk * (chunk + 1) // 2) + rest * (rest + 1) // 2


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes_moved: float
    seconds: float


class CostModel:
    """Step time of one batch of `layout` on `gpu`.

    Invariants: more tokens never make a step cheaper; a sliding-window or chunked layer
    never costs more than a full-attention layer over the same context.
    """

    def __init__(
        self,
        gpu: GpuPreset,
        layout: ModelLayout,
        kv_dtype: str = "bfloat16",
        overheads: EngineOverheads | None = None,
    ) -> None:
        self.gpu = gpu
        self.layout = layout
        self.overheads = overheads if overheads is not None else load_presets().engine
        counts = layout.layer_counts()
        self.num_full = counts.get("full", 0)
        self.num_sliding = counts.get("sliding", 0)
        self.num_chunked = counts.get("chunked", 0)
        self.num_mamba = counts.get("mamba", 0)
        self.window = layout.sliding_window
        self.chunk = layout.attention_chunk_size
        # QK^T and AV: 2 FLOPs per multiply-add, two matmuls, every query head.
        self.attn_flops_per_pair = 4 * layout.num_q_heads * layout.head_dim
        # K and V of one token in one layer.
        self.kv_bytes_per_token = 2 * layout.num_kv_heads * layout.head_dim * dtype_size(kv_dtype)
        self.weight_bytes_per_param = layout.weight_bytes_per_param
        if layout.mamba is not None and self.num_mamba:
            m = layout.mamba
            # Selective scan: a handful of FLOPs per state element, plus the causal conv.
            self.mamba_flops_per_token = 6 * m.nheads * m.head_dim * m.d_state + 2 * m.d_inner * m.d_conv
            state_elems = m.d_inner * (m.d_conv - 1) + m.nheads * m.head_dim * m.d_state
            self.mamba_state_bytes = state_elems * dtype_size(kv_dtype)
        else:
            self.mamba_flops_per_token = 0
            self.mamba_state_bytes = 0

    def step_cost(self, batch: Iterable[BatchEntry]) -> StepCost:
        """FLOPs, bytes and seconds of one step; an empty batch costs only the overhead."""
        entries = list(batch)
        return self.columns_cost([ctx for ctx, _ in entries], [new for _, new in entries])

    def columns_cost(self, ctxs: list[int], news: list[int]) -> StepCost:
        """`step_cost` of the batch zip(ctxs, news).

        Full-attention sums run in C (sum/map over the columns): a simulated step of
        hundreds of decodes would otherwise spend more Python here than in scheduling.
        """
        num_reqs = len(news)
        if num_reqs == 0:
            return StepCost(0.0, 0.0, self.overheads.fixed_step_overhead_s)
        num_tokens = sum(news)
        full_p = slide_p = chunk_p = 0
        full_r = slide_r = chunk_r = 0
        if self.num_full:
            # sum of new*ctx + new*(new+1)/2; every new*(new+1) is even, so halve the total.
            full_p = sum(map(mul, news, ctxs)) + (sum(map(mul, news, news)) + num_tokens) // 2
            full_r = sum(ctxs) + num_tokens
        if self.num_sliding or self.num_chunked:
            window, chunk = self.window, self.chunk
            has_slide, has_chunk = self.num_sliding > 0, self.num_chunked > 0
            for ctx, new in zip(ctxs, news):
                end = ctx + new
                if has_slide:
                    full_window = ctx >= window  # every query of the step sees exactly W keys
                    slide_p += new * window if full_window else sliding_pairs(end, window) - sliding_pairs(ctx, window)
                    slide_r += min(end, window - 1 + new)
                if has_chunk:
                    chunk_p += chunked_pairs(end, chunk) - chunked_pairs(ctx, chunk)
                    chunk_r += end - (ctx // chunk) * chunk
        lay = self.layout
        pairs = self.num_full * full_p + self.num_sliding * slide_p + self.num_chunked * chunk_p
        flops = 2.0 * lay.active_params * num_tokens + self.attn_flops_per_pair * pairs
        flops += self.num_mamba * self.mamba_flops_per_token * num_tokens
        weight_params = min(lay.total_params, lay.active_params * num_tokens)
        kv_tokens_read = self.num_full * full_r + self.num_sliding * slide_r + self.num_chunked * chunk_r
        kv_tokens_written = (self.num_full + self.num_sliding + self.num_chunked) * num_tokens
        bytes_moved = (
            weight_params * self.weight_bytes_per_param
            + (kv_tokens_read + kv_tokens_written) * self.kv_bytes_per_token
            + self.num_mamba * 2 * self.mamba_state_bytes * num_reqs
        )
        seconds = self.overheads.fixed_step_overhead_s + max(
            flops / self.gpu.peak_flops, bytes_moved / self.gpu.memory_bandwidth_bytes_per_s
        )
        return StepCost(flops, bytes_moved, seconds)

    def step_time(self, batch: Iterable[BatchEntry]) -> float:
        """Seconds one step of `batch` takes on the whole model (all pipeline stages)."""
        return self.step_cost(batch).seconds

    def columns_time(self, ctxs: list[int], news: list[int]) -> float:
        """`step_time` of the batch zip(ctxs, news)."""
        return self.columns_cost(ctxs, news).seconds
