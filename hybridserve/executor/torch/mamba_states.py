"""The runner's side of Mamba layers: each request's states in its Mamba group's state block.

A Mamba group's block table holds `num_state_blocks` ids per request, whatever its
length; column 0 carries the state (MambaManager). A layer of the group reads and
writes its views of that block (PagedKVCache.state_views)::

    step: request r computes tokens s..s+c-1
      read   state block -> conv [conv_dim, K-1], SSM [H, P, N]    (zeros if s == 0)
      mixer  advances both past the chunk
      write  back to the same block

Why the states are always right:
- steps run in dispatch order, one at a time, so a request's chunk s.. reads exactly
  what its chunk ending at s wrote, with async scheduling too;
- a request that starts at s == 0 (new, or recomputing after a preemption) starts from
  zeros, never from what an earlier owner of the block left there;
- the KV core never serves a prefix hit to a model with a Mamba group
  (MambaManager.find_longest_cache_hit is empty, so the hybrid hit is 0 tokens); a
  request that would start mid-sequence has no state to start from and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hybridserve.core.errors import RequestError
from hybridserve.core.kv.spec import AttentionSpec, KVCacheConfig, MambaSpec
from hybridserve.executor.torch.attention import StepAttention
from hybridserve.executor.torch.kv_cache import PagedKVCache
from hybridserve.executor.torch.requests import BlockTables
from hybridserve.models.kv_specs import layer_index
from hybridserve.models.mamba2 import TokenStates


class GroupSubset:
    """The attention groups' rows of BlockTables, renumbered 0..n-1, for StepAttention
    (which looks every group up at once and must not see the Mamba groups' one-block
    tables). A step-time snapshot: the copies cost groups x rows x cols int64."""

    def __init__(self, tables: BlockTables, groups: np.ndarray) -> None:
        self.table = tables.table[groups]
        self.lengths = tables.lengths[groups]

    gather = BlockTables.gather


class MambaLayout:
    """Built once per runner: which layers are Mamba, their group and state views, and
    the attention layers renumbered onto the attention-only groups."""

    def __init__(self, config: KVCacheConfig, kv: PagedKVCache, num_layers: int) -> None:
        specs = [g.spec for g in config.groups]
        self.mamba_groups = [g for g, s in enumerate(specs) if isinstance(s, MambaSpec)]
        self.attn_groups = np.array([g for g, s in enumerate(specs) if isinstance(s, AttentionSpec)], dtype=np.int64)
        local = {int(g): k for k, g in enumerate(self.attn_groups)}
        # Per model layer: (group, views) for Mamba layers, None otherwise.
        self.states: list[tuple[int, tuple[torch.Tensor, ...]] | None] = [None] * num_layers
        # StepAttention's layer list over the attention-only group numbering.
        self.attn_layers: list[tuple[int, torch.Tensor]] = [(-1, torch.empty(0))] * num_layers
        for name, g in kv.layer_group.items():
            i = layer_index(name)
            if name in kv.state_views:
                self.states[i] = (g, kv.state_views[name])
            else:
                self.attn_layers[i] = (local[g], kv.layer_view[name])

    def check_start(self, req_id: str, num_computed: int) -> None:
        if num_computed:
            raise RequestError(f"request {req_id} starts at token {num_computed}, but a Mamba model has no "
                               "saved state mid-sequence (prefix hits are impossible for Mamba groups)")


@dataclass
class StepMambaStates:
    """One step's MambaStateIO: the state block of every request in every Mamba group."""

    layout: MambaLayout
    counts: list[int]
    block_ids: dict[int, torch.Tensor]  # Mamba group -> [R] state block ids
    fresh: torch.Tensor | None  # [R] bool, requests starting at token 0 (None: none do)
    # Speculative decoding: requests whose chunk is a decode plus drafts, and per layer
    # their states after every token (see commit).
    verify: list[int] = field(default_factory=list)
    token_states: dict[int, TokenStates] = field(default_factory=dict)

    @classmethod
    def build(cls, layout: MambaLayout, tables: BlockTables, rows: np.ndarray, starts: np.ndarray,
              counts: list[int], device: torch.device, verify: list[int] | None = None) -> StepMambaStates:
        block_ids = {}
        for g in layout.mamba_groups:
            if np.any(tables.lengths[g, rows] < 1):
                raise RuntimeError("a scheduled request has no Mamba state block (scheduler and runner out of sync)")
            ids = tables.table[g, rows, 0]
            if not ids.all():
                raise RuntimeError("a Mamba state block is the null block")
            block_ids[g] = torch.from_numpy(ids).to(device)
        fresh = starts == 0
        return cls(layout, counts, block_ids, torch.from_numpy(fresh).to(device) if fresh.any() else None,
                   list(verify or ()))

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.layout.states[layer_idx]
        assert entry is not None, f"layer {layer_idx} is not a Mamba layer"
        g, (conv_view, ssm_view) = entry
        ids = self.block_ids[g]
        conv, ssm = conv_view.index_select(0, ids), ssm_view.index_select(0, ids)
        if self.fresh is not None:
            conv[self.fresh] = 0
            ssm[self.fresh] = 0
        return conv, ssm

    def write(self, layer_idx: int, conv: torch.Tensor, ssm: torch.Tensor,
              token_states: TokenStates | None = None) -> None:
        entry = self.layout.states[layer_idx]
        assert entry is not None
        g, (conv_view, ssm_view) = entry
        ids = self.block_ids[g]
        conv_view.index_copy_(0, ids, conv)
        ssm_view.index_copy_(0, ids, ssm)
        if token_states is not None:
            self.token_states[layer_idx] = token_states

    def commit(self, num_valid: list[int]) -> None:
        """After verification: verify request `self.verify[v]` keeps its first
        num_valid[v] tokens (the decode token + accepted drafts), so its state becomes
        the one after token num_valid[v] - 1. Without a commit a verify request keeps the
        state after its whole chunk (every draft accepted)."""
        if len(num_valid) != len(self.verify):
            raise ValueError(f"{len(num_valid)} accepted lengths for {len(self.verify)} verify requests")
        for v, r in enumerate(self.verify):
            if not 1 <= num_valid[v] <= self.counts[r]:
                raise ValueError(f"request {r}: {num_valid[v]} valid tokens of a chunk of {self.counts[r]}")
        for layer_idx, ts in self.token_states.items():
            entry = self.layout.states[layer_idx]
            assert entry is not None
            g, (conv_view, ssm_view) = entry
            pick = [(v, num_valid[v] - 1) for v, r in enumerate(ts.reqs) if num_valid[v] < self.counts[r]]
            if not pick:
                continue
            v_idx = torch.tensor([v for v, _ in pick], device=ts.conv.device)
            j_idx = torch.tensor([j for _, j in pick], device=ts.conv.device)
            ids = self.block_ids[g][torch.tensor([ts.reqs[v] for v, _ in pick], device=ts.conv.device)]
            conv_view.index_copy_(0, ids, ts.conv[v_idx, j_idx])
            ssm_view.index_copy_(0, ids, ts.ssm[v_idx, j_idx])


@dataclass
class StepBackend:
    """The backend of a step of a model with Mamba layers: paged attention (None for a
    model without attention layers) plus the requests' Mamba states."""

    attn: StepAttention | None
    mamba: StepMambaStates

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        assert self.attn is not None
        return self.attn.attention(layer_idx, q, kv)
