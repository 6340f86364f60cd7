"""Scheduler statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_generated_tokens: int = 0
    num_failed_loads: int = 0
    # Waiting requests that gave back their loaded blocks so that others could make
    # progress, where no step would free blocks (Admission.release_last_holder).
    num_released_loads: int = 0
    kv_usage: float = 0.0
    group_kv_usage: list[float] = field(default_factory=list)
    prefix_cache_hit_rate: float = 0.0
    # Speculative decoding: drafts scheduled, drafts accepted, verification steps.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    # KV offload to host memory (filled by the connector's record_stats): blocks copied
    # device -> host and host -> device, and prompt tokens served from host memory.
    num_offloaded_blocks: int = 0
    num_offload_loaded_blocks: int = 0
    num_offload_hit_tokens: int = 0

    def record_spec(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self.num_spec_steps += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += min(num_accepted, num_drafts)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verification step (accepted drafts + the bonus token)."""
        return 1 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0
