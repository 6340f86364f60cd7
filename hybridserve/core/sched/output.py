"""What the scheduler hands an executor each step, and what the executor hands back.

Block tables travel as deltas: per group, the block ids appended this step, plus the
length of the null prefix (blocks below the attention window that were freed and
replaced by the null block 0). A runner keeps its own copy of each table::

    table (group g): [0, 0, 0, 17, 18, 19] + new_block_ids[g]
                      ^^^^^^^ num_null_blocks[g] = 3
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridserve.core.logprobs import LogprobInfo, PromptLogprobChunk
from hybridserve.core.request import SamplingParams

NO_TOKEN = -1  # a placeholder the runner fills from its own last sampled token or draft


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled, and again after a preemption."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # All known tokens (prompt + outputs so far); differs from the prompt after preemption.
    token_ids: list[int]
    eos_token_id: int | None = None


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    # Scheduler's optimistic count before this step. A runner in async mode may know
    # better (rejected drafts of an earlier step it has already verified).
    num_computed_tokens: int
    num_scheduled_tokens: int
    # Draft slots scheduled after the first token; the executor's drafter fills them.
    num_draft_tokens: int
    new_block_ids: tuple[list[int], ...]
    num_null_blocks: tuple[int, ...]
    # True when the last scheduled token is the last known/placeholder token: this
    # step samples (prefill chunks that stop short of the prompt's end do not).
    samples: bool
    new: NewRequestData | None = None


@dataclass
class SchedulerOutput:
    step_id: int
    requests: list[ScheduledRequest]
    total_num_scheduled_tokens: int
    # Requests that ended (finished, aborted) or were preempted since the last step:
    # the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {r.request_id: r.num_scheduled_tokens for r in self.requests}

    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class KVConnectorOutput:
    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    # Blocks whose asynchronous load failed: their requests recompute from the last
    # valid block.
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass
class ModelRunnerOutput:
    """Per request of the step, the tokens it produced: accepted drafts + one bonus token.

    A request in a prefill chunk that does not sample gets an empty list.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobInfo] = field(default_factory=dict)
    # Requests that asked for prompt logprobs and computed prompt positions this step.
    prompt_logprobs: dict[str, PromptLogprobChunk] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    # Drafts the executor actually proposed per request (may be fewer than scheduled).
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # Requests whose own sampling failed (id -> one-line reason). Their sampled tokens are
    # stand-ins that keep the step's counts consistent; the engine fails them right after.
    failed_req_ids: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class RequestOutput:
    """What the scheduler reports for one request after a step is processed."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: LogprobInfo | None = None
    num_cached_tokens: int = 0
    # Prompt logprobs not reported before, from prompt token 1 on, in order (with the
    # request's first token, since prompt chunks that sample nothing report nothing).
    prompt_logprobs: LogprobInfo | None = None
