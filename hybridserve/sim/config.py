"""SimConfig: one configuration to simulate, each setting's default and help in one place.

`hybridserve simulate` makes its flags from these fields (entrypoints/config_flags.py), so
a default stated here is the only copy; scheduler settings take theirs from
SchedulerConfig. Pure Python and light: building the CLI's parser imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import DEFAULT_BLOCK_SIZE, DTYPE_BYTES
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.sim.presets import DEFAULT_GPU_MEMORY_UTILIZATION, get_layout

if TYPE_CHECKING:
    from hybridserve.sim.workload import WorkloadItem

HARDWARE = "hardware and model"
ENGINE = "engine"
WORKLOAD = "workload"


@dataclass(frozen=True)
class SimConfig:
    """One configuration to simulate. `max_model_len` None: the longest request, at least
    SchedulerConfig's default max_model_len."""

    gpu: str = field(default="H100", metadata={"section": HARDWARE, "help": "H100, H200, A100-80GB or L40S"})
    model_layout: str = field(default="gemma3-27b-like", metadata={
        "section": HARDWARE,
        "help": "gemma3-27b-like, gpt-oss-120b-like, command-r7b-like, llama4-scout-like, jamba-like (its "
                "weights need --gpu H200 or --pipeline-parallel-size 2), bamba-9b-like, granite-4.0-h-like, "
                "nemotron-h-like, qwen3-next-80b-like (--pipeline-parallel-size 2 on an H200), llama3-8b-like"})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"section": HARDWARE, "help": "tokens per KV block"})
    num_blocks: int | None = field(default=None, metadata={
        "section": HARDWARE, "help": "override the KV pool size (blocks, null block included)",
        "default_note": "what --gpu-memory-utilization leaves beside the weights"})
    gpu_memory_utilization: float = field(default=DEFAULT_GPU_MEMORY_UTILIZATION, metadata={
        "section": HARDWARE, "help": "share of GPU memory for weights + KV cache, in (0, 1]"})
    kv_dtype: str = field(default="bfloat16", metadata={
        "section": HARDWARE, "help": "KV cache element type", "choices": tuple(sorted(DTYPE_BYTES))})
    # Scheduler settings default to SchedulerConfig's (the one definition).
    max_num_batched_tokens: int = field(default=SchedulerConfig.max_num_batched_tokens, metadata={
        "section": ENGINE, "help": "tokens per step"})
    max_num_seqs: int = field(default=SchedulerConfig.max_num_seqs, metadata={
        "section": ENGINE, "help": "requests per step"})
    max_model_len: int | None = field(default=None, metadata={
        "section": ENGINE, "help": "longest prompt + output",
        "default_note": f"the longest request, at least {SchedulerConfig.max_model_len}"})
    # The CLI spells this one as --async / --sync.
    async_scheduling: bool = field(default=SchedulerConfig.async_scheduling, metadata={
        "section": ENGINE, "help": "schedule one step ahead of the GPU"})
    pipeline_parallel_size: int = field(default=SchedulerConfig.pipeline_parallel_size, metadata={
        "section": HARDWARE,
        "help": "pipeline stages: the layers split over this many GPUs, as many steps in flight"})
    num_speculative_tokens: int = field(default=SchedulerConfig.num_speculative_tokens, metadata={
        "section": ENGINE, "help": "draft tokens per decode step", "default_note": "off"})
    acceptance_rate: float = field(default=0.7, metadata={
        "section": ENGINE, "help": "per-draft acceptance probability"})
    enable_prefix_caching: bool = field(default=SchedulerConfig.enable_prefix_caching, metadata={
        "section": ENGINE, "help": "reuse the KV blocks of prompt prefixes computed before"})
    full_sequence_must_fit: bool = field(default=SchedulerConfig.full_sequence_must_fit, metadata={
        "section": ENGINE, "help": "admit a request only if prompt + max_tokens fit by the admission caps"})
    # None: derived by SchedulerConfig (concurrent batches * max_num_batched_tokens).
    max_in_flight_tokens: int | None = field(default=None, metadata={
        "section": ENGINE, "help": "override the in-flight allowance",
        "default_note": "concurrent batches * max-num-batched-tokens"})
    # None: on (the simulated executor computes in-chunk attention from the batch).
    window_tail_allocation: bool | None = field(default=SchedulerConfig.window_tail_allocation, metadata={
        "section": ENGINE, "help": "sliding-window groups hold only the window and each chunk's tail",
        "default_note": "on"})
    connector: bool = field(default=False, metadata={"section": ENGINE, "help": "simulated CPU KV offload connector"})
    connector_capacity_blocks: int = field(default=4096, metadata={
        "section": ENGINE, "help": "host-memory blocks of the connector"})
    connector_max_delay_steps: int = field(default=3, metadata={
        "section": ENGINE, "help": "a connector load/store finishes 0..N steps after it starts"})
    connector_failure_rate: float = field(default=0.0, metadata={
        "section": ENGINE, "help": "probability a loaded block fails"})
    detector: bool = field(default=True, metadata={"section": ENGINE, "help": "shadow-KV race detector"})
    unsafe_optimistic_free: bool = field(default=False, metadata={
        "section": ENGINE, "help": "RESEARCH ONLY: free on the optimistic count (the race the detector catches)"})
    seed: int = field(default=0, metadata={
        "section": WORKLOAD, "help": "random seed of the workload, the drafts' acceptance and the connector"})
    label: str = "run"

    def resolve_max_model_len(self, items: list[WorkloadItem]) -> int:
        layout = get_layout(self.model_layout)
        longest_item = max(items, key=lambda it: it.prompt_len + it.output_len)
        longest = longest_item.prompt_len + longest_item.output_len
        if self.max_model_len is not None:
            if self.max_model_len < 2:
                raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
            for it in items:
                if it.prompt_len + it.output_len > self.max_model_len:
                    raise ConfigError(
                        f"--max-model-len {self.max_model_len} is shorter than {it.describe()}: prompt "
                        f"{it.prompt_len} + output {it.output_len} tokens"
                    )
            return self.max_model_len
        if longest > layout.max_position_embeddings:
            raise ConfigError(
                f"{longest_item.describe()} has {longest} tokens, more than {layout.name}'s "
                f"{layout.max_position_embeddings} positions"
            )
        return max(SchedulerConfig.max_model_len, longest)
