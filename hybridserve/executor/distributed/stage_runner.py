"""StageRunner: the ModelRunner of one pipeline stage (and one tensor-parallel rank).

Every stage applies every step's SchedulerOutput (new requests, block-table deltas,
finished and preempted ids) to its own copy of the runner state, so block tables agree
across stages without being sent. What differs per stage:

- the first stage knows the tokens: it builds the step (positions, the drafts it
  proposes), embeds, runs its layers and sends the step's plan and hidden state on;
- a middle stage receives the plan and hidden state, runs its layers, sends them on;
- the last stage runs its layers and the head, samples, and sends each step's sampled
  tokens back to the earlier stages, which need them to fill the next step's tokens
  (first stage) and to advance their computed counts and roll back Mamba states
  (every stage).

Steps overlap: while the last stage computes step N, the first computes step N+1. A
stage waits for step N's sampled tokens only before a step that schedules one of step
N's requests again (async scheduling, which makes the pipeline drain), and otherwise lets
at most as many steps' results trail as there are stages after it.

Invariant: each stage executes steps in dispatch order; a stage never computes a request
whose earlier step's tokens it has not applied.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import torch

from hybridserve.core.kv.spec import AttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheSpec, MambaSpec
from hybridserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from hybridserve.executor.distributed.layout import WorkerPlace
from hybridserve.executor.distributed.peer_link import TAG_HIDDEN, TAG_PLAN, TAG_RESULT, PeerLink
from hybridserve.executor.torch.mamba_states import StepMambaStates
from hybridserve.executor.torch.model_runner import ModelRunner
from hybridserve.executor.torch.requests import RequestState
from hybridserve.models.kv_specs import layer_index, model_kv_layer_specs


@dataclass
class StepPlan:
    """What the first stage decided for a step: later stages compute the same rows."""

    starts: list[int]  # position of each request's first computed token
    counts: list[int]  # tokens each request computes, proposed drafts included
    drafts: list[list[int]]  # the drafts each request verifies (the last stage checks them)


@dataclass
class PendingStep:
    """A step this stage ran whose sampled tokens have not come back yet."""

    states: list[RequestState]
    counts: list[int]
    drafts: list[list[int]]
    mamba_states: StepMambaStates | None


def stage_kv_config(config: KVCacheConfig, layers: range, local_specs: dict[str, KVCacheSpec]) -> KVCacheConfig:
    """The pool as one worker holds it: every group (block ids and tables are shared
    across workers), only this stage's layers in each, and each page sized for this
    tensor-parallel rank's heads (`local_specs`: the specs of the rank's local model). A
    Mamba state cut into pages keeps the driver's page count and index, so its slices stay
    the same groups; each slice is 1/num_pages of the rank's smaller state."""
    groups = []
    for g in config.groups:
        spec = g.spec
        local = local_specs[g.layer_names[0]]
        if isinstance(spec, AttentionSpec):
            assert isinstance(local, AttentionSpec)
            spec = replace(spec, num_kv_heads=local.num_kv_heads)
        elif isinstance(spec, MambaSpec):
            assert isinstance(local, MambaSpec)
            spec = replace(spec, shapes=local.shapes)
        groups.append(KVCacheGroup(spec, tuple(n for n in g.layer_names if layer_index(n) in layers)))
    return KVCacheConfig(num_blocks=config.num_blocks, groups=tuple(groups))


class StageRunner(ModelRunner):
    def __init__(self, model, kv_cache_config: KVCacheConfig, device: torch.device, place: WorkerPlace,
                 link: PeerLink, layers: range, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.place = place
        self.samples = place.is_last_stage
        local_specs = model_kv_layer_specs(model.cfg, kv_cache_config.block_size,
                                           next(iter(kv_cache_config.groups)).spec.dtype)  # type: ignore[attr-defined]
        super().__init__(model, stage_kv_config(kv_cache_config, layers, local_specs), device, layers=layers,
                         **kwargs)
        self.link = link
        self.pending: deque[PendingStep] = deque()
        # Results that may trail without stalling: the stages after this one each hold a step.
        self.max_trailing = place.layout.pipeline_parallel_size - 1 - place.stage

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        place, link = self.place, self.link
        self._drop_ended(so)
        if not so.requests:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if not place.is_last_stage:
            self._catch_up(so)
        hidden_in = None
        ids_t = None
        if place.is_first_stage:
            states, starts, counts, ids, drafts = self._prepare(so)
            ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
            plan = StepPlan(starts, counts, drafts)
        else:
            assert place.prev_rank is not None
            plan = link.recv_object(place.prev_rank, TAG_PLAN)
            states = [self._apply_scheduled(sr) for sr in so.requests]
            starts, counts, drafts = plan.starts, plan.counts, plan.drafts
            hidden_in = link.recv_tensor((sum(counts), self.model.cfg.hidden_size), self.model.dtype,
                                         place.prev_rank, TAG_HIDDEN)
        if place.next_rank is not None:
            link.send_object(plan, place.next_rank, TAG_PLAN)
        batch = self._batch(states, starts, counts, drafts)
        hidden = self.model(ids_t, batch.positions_t, batch.max_position, batch.backend, hidden_in=hidden_in)
        if place.next_rank is not None:
            link.send_tensor(hidden, place.next_rank, TAG_HIDDEN)
            self.pending.append(PendingStep(states, counts, drafts, batch.mamba_states))
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        out = self._sample_and_advance(so, states, counts, drafts, hidden, batch)
        for rank in place.earlier_stage_ranks:
            link.send_object(out.sampled_token_ids, rank, TAG_RESULT)
        return out

    def _catch_up(self, so: SchedulerOutput) -> None:
        """Apply the sampled tokens of earlier steps this step depends on (and of any
        step older than the pipeline behind this stage can still hold)."""
        needed = {id(self.states.get(sr.request_id)) for sr in so.requests}
        last_needed = -1
        for i, step in enumerate(self.pending):
            if any(id(s) in needed for s in step.states):
                last_needed = i
        while self.pending and (last_needed >= 0 or len(self.pending) > self.max_trailing):
            step = self.pending.popleft()
            last_needed -= 1
            sampled = self.link.recv_object(self.place.last_stage_rank, TAG_RESULT)
            for state, out in zip(step.states, sampled):
                state.token_ids += out
            self._advance_all(step.states, step.counts, step.drafts, sampled, step.mamba_states)
