"""Scheduler settings, validated once, with the in-flight allowance derived in one place.

The defaults here are the only definition of each scheduler setting's default: the engine's
`EngineConfig` and the simulator's `SimConfig` take theirs from these class attributes, and
both build their SchedulerConfig through `from_settings`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import WindowTail


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 8192
    # Prefill chunks of one request are capped at this many tokens (0: no cap).
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # or "priority"
    async_scheduling: bool = True
    pipeline_parallel_size: int = 1
    # None: derived (pipeline size, or 2 for async on one stage, else 1).
    max_concurrent_batches: int | None = None
    # None: derived as max_concurrent_batches * max_num_batched_tokens.
    max_in_flight_tokens_override: int | None = None
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = True
    # The share of the KV pool that finished requests' cached blocks keep before blocks
    # never used are handed out (core/kv/block_pool.FreeBlocks): the pool's resident memory
    # is then what is in use plus this share, not its whole budget.
    prefix_cache_retention: float = 0.25
    # Admit a waiting request only if its whole sequence (prompt + max_tokens) fits now.
    full_sequence_must_fit: bool = False
    # Sliding-window groups hold only the window and each chunk's tail. None: the
    # executor decides (see resolve_window_tail); True/False force it.
    window_tail_allocation: bool | None = None

    @classmethod
    def from_settings(cls, settings: Any, **resolved: Any) -> SchedulerConfig:
        """The scheduler part of a layer's flat settings (EngineConfig, SimConfig): every
        field of this class that `settings` has, by name, so a new scheduler setting needs
        no copying code; `resolved` gives what the layer resolves itself (max_model_len)."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls) if hasattr(settings, f.name)}
        return cls(**{**values, **resolved})

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.num_speculative_tokens < 0:
            raise ConfigError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0")
        if not 0.0 <= self.prefix_cache_retention <= 1.0:
            raise ConfigError(f"prefix_cache_retention must be between 0 and 1, got {self.prefix_cache_retention}")
        if self.max_concurrent_batches is not None and self.max_concurrent_batches < 1:
            raise ConfigError(f"max_concurrent_batches must be >= 1, got {self.max_concurrent_batches}")
        if self.num_speculative_tokens + 1 > self.max_num_batched_tokens:
            raise ConfigError(
                f"max_num_batched_tokens must be >= num_speculative_tokens + 1 = {self.num_speculative_tokens + 1}"
            )

    @property
    def num_concurrent_batches(self) -> int:
        """Steps that may be in flight at once."""
        if self.max_concurrent_batches is not None:
            return self.max_concurrent_batches
        if self.pipeline_parallel_size > 1:
            return self.pipeline_parallel_size
        return 2 if self.async_scheduling else 1

    def resolve_window_tail(self, executor_computes_in_chunk_attention_from_batch: bool) -> bool:
        """Whether window-tail allocation is on for an executor: None follows what the
        executor declares; forcing it on needs an executor that computes in-chunk
        attention from the batch (the null blocks it hands out are never read)."""
        tail = self.window_tail_allocation
        if tail is None:
            return executor_computes_in_chunk_attention_from_batch
        if tail and not executor_computes_in_chunk_attention_from_batch:
            raise ConfigError(
                "window_tail_allocation needs an executor that computes in-chunk attention from the batch"
            )
        return tail

    @property
    def window_tail(self) -> WindowTail:
        """The in-flight shape window-tail admission is computed from."""
        return WindowTail(self.num_concurrent_batches, self.num_speculative_tokens)

    @property
    def max_in_flight_tokens(self) -> int:
        """Most tokens of one request that can be scheduled but not yet processed."""
        if self.max_in_flight_tokens_override is not None:
            return self.max_in_flight_tokens_override
        return self.num_concurrent_batches * self.max_num_batched_tokens
