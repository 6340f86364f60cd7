"""Public helpers to build schedulers, requests and fake runner outputs.

Tests use them, and so can anyone writing an executor. Kept stable::

    sched = make_scheduler(kv_specs=[SlidingWindowSpec(16, 1, 8, sliding_window=16)], async_scheduling=True)
    for r in make_requests(2, num_tokens=100):
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, fake_runner_output(out))
"""

from __future__ import annotations

from typing import Callable, Sequence

from hybridserve.core.connector.base import KVConnectorBase
from hybridserve.core.kv.spec import DEFAULT_BLOCK_SIZE, FullAttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheSpec
from hybridserve.core.request import Request, SamplingParams
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from hybridserve.core.sched.scheduler import Scheduler

DEFAULT_SAMPLED_TOKEN = 1000


class NullConnector(KVConnectorBase):
    """A KV connector that finds nothing and moves nothing: subclass it to fake one
    part of the protocol (hits, a finish) and keep the rest inert."""

    def get_num_new_matched_tokens(self, request: Request, num_local_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: object) -> None:
        return None

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        return False, None


def make_kv_cache_config(
    num_blocks: int, kv_specs: Sequence[KVCacheSpec] | None = None, block_size: int = DEFAULT_BLOCK_SIZE
) -> KVCacheConfig:
    """One group per spec (a single full-attention group by default)."""
    specs = list(kv_specs) if kv_specs else [FullAttentionSpec(block_size, 1, 8)]
    groups = tuple(KVCacheGroup(s, (f"layer.{i}",)) for i, s in enumerate(specs))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def make_scheduler(
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_blocks: int = 10_000,
    kv_specs: Sequence[KVCacheSpec] | None = None,
    async_scheduling: bool = False,
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
    max_num_seqs: int = SchedulerConfig.max_num_seqs,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    connector: KVConnectorBase | None = None,
    num_speculative_tokens: int = 0,
    pipeline_parallel_size: int = 1,
    unsafe_optimistic_free: bool = False,
    **config_overrides: object,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
        pipeline_parallel_size=pipeline_parallel_size,
        num_speculative_tokens=num_speculative_tokens,
        enable_prefix_caching=enable_prefix_caching,
        **config_overrides,  # type: ignore[arg-type]
    )
    kv_config = make_kv_cache_config(num_blocks, kv_specs, block_size)
    # No executor here: the config's window_tail_allocation is taken as the decision.
    return Scheduler(config, kv_config, connector=connector, unsafe_optimistic_free=unsafe_optimistic_free,
                     window_tail=bool(config.window_tail_allocation))


def make_requests(
    num_requests: int,
    num_tokens: int,
    max_tokens: int = 16,
    prefix: Sequence[int] = (),
    start_id: int = 0,
    eos_token_id: int | None = None,
    **sampling: object,
) -> list[Request]:
    """Requests with distinct prompts of num_tokens tokens (after an optional shared prefix)."""
    out = []
    for i in range(start_id, start_id + num_requests):
        body = [(i * 7919 + j) % 50_000 + 2 for j in range(num_tokens - len(prefix))]
        out.append(
            Request(
                request_id=str(i),
                prompt_token_ids=list(prefix) + body,
                sampling_params=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
                eos_token_id=eos_token_id,
                arrival_time=float(i),
            )
        )
    return out


Sampled = dict[str, list[int]] | Callable[[str], list[int]] | int | None


def fake_runner_output(scheduler_output: SchedulerOutput, sampled: Sampled = None) -> ModelRunnerOutput:
    """A runner output for every scheduled request.

    sampled: None -> one DEFAULT_SAMPLED_TOKEN per sampling request; an int -> that token;
    a dict or callable -> the token list for each request id (accepted drafts + bonus).
    Requests in a non-final prefill chunk get [] unless the dict names them.
    """
    ids, tokens = [], []
    for sr in scheduler_output.requests:
        ids.append(sr.request_id)
        if isinstance(sampled, dict) and sr.request_id in sampled:
            tokens.append(list(sampled[sr.request_id]))
        elif callable(sampled):
            tokens.append(list(sampled(sr.request_id)) if sr.samples else [])
        elif sr.samples:
            tokens.append([DEFAULT_SAMPLED_TOKEN if sampled is None or isinstance(sampled, dict) else int(sampled)])
        else:
            tokens.append([])
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=tokens)
