"""The runner's side of Mamba layers: each request's states in its Mamba group's blocks.

A Mamba layer reads and writes its state through MambaPages (PagedKVCache.state_pages):
one block of each of its page groups, at the same table column; where a request's
state lives depends on the layout (MambaSpec):

    one state block (no prefix caching): column 0, read and written in place
    block checkpoints (prefix caching):  positional, the state after n tokens in block (n-1)//bs
    running state in place (prefix caching, the engine's layout): the table's last entry R
      is read and written by every step (a first step after a hit or a load reads block
      (s-1)//bs); checkpoints at boundaries b in [s, e] go to block b/bs - 1 where that is
      a checkpoint block (best-effort: may be null), b == s the state read, b == e the final

    step: request r computes tokens s..e-1 (bs 16, s 40, e 72)
      read   block (s-1)//bs = 2            -> the state's parts (Mamba2: conv [conv_dim, K-1],
                                                SSM [H, P, N]; a short conv: conv only), zeros if s == 0
      mixer  advances both past the chunk, keeping the states at boundaries 48 and 64
      write  S48 -> block 2, S64 -> block 3, S72 -> block (e-1)//bs = 4
             (sparse checkpoints: block 3 may be the null block; S64 is then not kept)

Why the states are always right:
- steps run in dispatch order, one at a time, so a request's chunk s.. reads exactly
  what its chunk ending at s wrote, with async scheduling too;
- a request that starts at s == 0 (new, or recomputing after a preemption) starts from
  zeros, never from what an earlier owner of the block left there;
- with checkpoints a block is published under its prefix hash only once the request's
  known tokens fill it (KV core), and nothing writes it after the boundary is passed:
  a later request that hits it starts from exactly the state after that prefix;
- without checkpoints the KV core serves a Mamba model no prefix hit, and a request
  that would start mid-sequence is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridserve.core.errors import RequestError
from hybridserve.core.kv.spec import AttentionSpec, KVCacheConfig, MambaSpec
from hybridserve.executor.torch.attention import StepAttention
from hybridserve.executor.torch.kv_cache import MambaPages, PagedKVCache
from hybridserve.executor.torch.requests import BlockTables
from hybridserve.models.kv_specs import layer_index
from hybridserve.models.arch.mamba2 import BoundaryStates, TokenStates


class GroupSubset:
    """The attention groups' rows of BlockTables, renumbered 0..n-1, for StepAttention
    (which looks every group up at once and must not see the Mamba groups' one-block
    tables). A step-time snapshot: the copies cost groups x rows x cols int64."""

    def __init__(self, tables: BlockTables, groups: np.ndarray) -> None:
        self.table = tables.table[groups]
        self.lengths = tables.lengths[groups]

    gather = BlockTables.gather


class MambaLayout:
    """Built once per runner: which layers are Mamba, their page groups and pages, and
    the attention layers renumbered onto the attention-only groups."""

    def __init__(self, config: KVCacheConfig, kv: PagedKVCache, num_layers: int) -> None:
        specs = [g.spec for g in config.groups]
        self.mamba_groups = [g for g, s in enumerate(specs) if isinstance(s, MambaSpec)]
        self.attn_groups = np.array([g for g, s in enumerate(specs) if isinstance(s, AttentionSpec)], dtype=np.int64)
        local = {int(g): k for k, g in enumerate(self.attn_groups)}
        layouts = {specs[g].block_checkpoints for g in self.mamba_groups}  # type: ignore[attr-defined]
        if len(layouts) != 1:
            raise ValueError("Mamba groups of one model must share one state layout")
        self.checkpoints: bool = layouts.pop()
        # Running state in place (InPlaceMambaManager): the table's last entry holds it.
        self.in_place = self.checkpoints and all(specs[g].running_in_place  # type: ignore[attr-defined]
                                                 for g in self.mamba_groups)
        self.in_place_groups = frozenset(self.mamba_groups) if self.in_place else frozenset()
        self.block_size = config.block_size
        # Per model layer: the MambaPages of a Mamba layer, None otherwise.
        self.states: list[MambaPages | None] = [None] * num_layers
        # StepAttention's layer list over the attention-only group numbering.
        self.attn_layers: list[tuple[int, torch.Tensor]] = [(-1, torch.empty(0))] * num_layers
        for name, g in kv.layer_group.items():
            i = layer_index(name)
            if name in kv.state_pages:
                self.states[i] = kv.state_pages[name]
            else:
                self.attn_layers[i] = (local[g], kv.layer_view[name])

    def check_start(self, req_id: str, num_computed: int) -> None:
        if num_computed and not self.checkpoints:
            raise RequestError(f"request {req_id} starts at token {num_computed}, but a Mamba model without "
                               "prefix caching keeps no state mid-sequence")


def _page_ids(per_group: dict[int, torch.Tensor], groups: tuple[int, ...]) -> torch.Tensor:
    """[N, num_pages]: each row's block in every page group of a layer."""
    return torch.stack([per_group[g] for g in groups], dim=1)


def _boundary_copies(layout: MambaLayout, tables: BlockTables, rows: np.ndarray, at: np.ndarray,
                     eligible: np.ndarray, device: torch.device) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """In place: the requests whose position `at` is a boundary (eligible ones) with a
    checkpoint block there (block at/bs - 1, real: best-effort ones may be null), and
    that block in every Mamba group (the groups null alike); None when there are none."""
    bs = layout.block_size
    sel = np.flatnonzero(eligible & (at > 0) & (at % bs == 0))
    if not len(sel):
        return None
    cols = at[sel] // bs - 1
    g0 = layout.mamba_groups[0]
    real = tables.table[g0, rows[sel], cols] != 0
    sel, cols = sel[real], cols[real]
    if not len(sel):
        return None
    ids = {g: torch.from_numpy(tables.table[g, rows[sel], cols]).to(device) for g in layout.mamba_groups}
    return torch.from_numpy(sel).to(device), ids


def _write_copies(pages: MambaPages, copies: tuple[torch.Tensor, dict[int, torch.Tensor]],
                  states: Sequence[torch.Tensor]) -> None:
    sel, ids = copies
    pages.write(_page_ids(ids, pages.page_groups), *(part[sel] for part in states))


@dataclass
class StepMambaStates:
    """One step's MambaStateIO: where every request's state is read from and written to."""

    layout: MambaLayout
    counts: list[int]
    read_ids: dict[int, torch.Tensor]  # Mamba group -> [R] block each request starts from
    write_ids: dict[int, torch.Tensor]  # Mamba group -> [R] block its state after the chunk goes to
    fresh: torch.Tensor | None  # [R] bool, requests starting at token 0 (None: none do)
    # Speculative decoding: requests whose chunk is a decode plus drafts, and per layer
    # their states after every token (see commit).
    verify: list[int] = field(default_factory=list)
    token_states: dict[int, TokenStates] = field(default_factory=dict)
    # Block checkpoints: the token counts after which each crossing chunk keeps its state,
    # and per group the blocks those states go to, in (request, count) order; `kept`
    # selects the states whose block is real (sparse checkpoints null the others).
    checkpoints: dict[int, list[int]] = field(default_factory=dict)
    checkpoint_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    kept: torch.Tensor | None = None
    # Per group, the block the state after each token of a verify chunk belongs in.
    verify_dest: dict[int, list[np.ndarray]] = field(default_factory=dict)
    starts: list[int] = field(default_factory=list)
    # In place: the requests whose start is a boundary they read from their running block
    # (`at_start`), and those whose (non-verify) chunk ends on a boundary past which R has
    # moved (`at_end`): the checkpoint blocks the state read, or the final state, also
    # goes to (rows of the step, per group their blocks).
    at_start: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None
    at_end: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None

    @classmethod
    def build(cls, layout: MambaLayout, tables: BlockTables, rows: np.ndarray, starts: np.ndarray,
              counts: list[int], device: torch.device, verify: list[int] | None = None,
              from_source: np.ndarray | None = None) -> StepMambaStates:
        """from_source: per request, its first step after it was added (in place, a request
        starting mid-sequence then reads block (s-1)//bs: a prefix hit or a connector load)."""
        verify = list(verify or ())
        ends = starts + np.asarray(counts, dtype=np.int64)
        bs = layout.block_size
        in_place = layout.in_place
        if in_place:
            g0 = layout.mamba_groups[0]
            last = tables.lengths[g0, rows] - 1
            source = (starts > 0) & (from_source if from_source is not None else False)
            read_col, write_col = np.where(source, np.maximum(starts - 1, 0) // bs, last), last
        elif layout.checkpoints:
            read_col, write_col = np.maximum(starts - 1, 0) // bs, (ends - 1) // bs
        else:
            read_col = write_col = np.zeros_like(starts)
        verify_set = set(verify)
        checkpoints = {}
        for r, (s, c) in enumerate(zip(starts.tolist(), counts)):
            if layout.checkpoints and c > 1 and r not in verify_set:
                js = list(range((s // bs + 1) * bs - s, c, bs))  # boundaries strictly inside the chunk
                if js:
                    checkpoints[r] = js
        read_ids, write_ids, checkpoint_ids, verify_dest = {}, {}, {}, {}
        kept = None
        at_start = at_end = None
        if in_place:
            # The checkpoint of a boundary b = s (the state read from R) or b = e (the final
            # state, R having moved on); b/bs - 1 is never R's column then.
            is_verify = np.zeros(len(starts), dtype=bool)
            is_verify[verify] = True
            at_start = _boundary_copies(layout, tables, rows, starts, (starts > 0) & ~source, device)
            at_end = _boundary_copies(layout, tables, rows, ends, (last >= ends // bs) & ~is_verify, device)
        for g in layout.mamba_groups:
            if np.any(tables.lengths[g, rows] <= write_col) or (in_place and np.any(last < (ends - 1) // bs)):
                raise RuntimeError("a scheduled request lacks a Mamba state block (scheduler and runner out of sync)")
            table = tables.table[g]
            read, write = table[rows, read_col], table[rows, write_col]
            if not write.all() or not read[starts > 0].all():
                raise RuntimeError("a Mamba state block is the null block")
            read_ids[g], write_ids[g] = torch.from_numpy(read).to(device), torch.from_numpy(write).to(device)
            if checkpoints:
                cols = [(rows[r], (starts[r] + j) // bs - 1) for r, js in checkpoints.items() for j in js]
                ids = np.array([table[row, col] for row, col in cols], dtype=np.int64)
                if kept is None:  # every page group nulls the same blocks
                    kept = torch.from_numpy(ids != 0).to(device)
                checkpoint_ids[g] = torch.from_numpy(ids).to(device)[kept]
            if verify and layout.checkpoints:
                verify_dest[g] = [table[rows[r], (starts[r] + np.arange(counts[r])) // bs] for r in verify]
        fresh = starts == 0
        return cls(layout, counts, read_ids, write_ids, torch.from_numpy(fresh).to(device) if fresh.any() else None,
                   verify, checkpoints=checkpoints, checkpoint_ids=checkpoint_ids, kept=kept,
                   verify_dest=verify_dest, starts=starts.tolist(), at_start=at_start, at_end=at_end)

    def _pages(self, layer_idx: int) -> MambaPages:
        pages = self.layout.states[layer_idx]
        assert pages is not None, f"layer {layer_idx} is not a Mamba layer"
        return pages

    def read(self, layer_idx: int) -> list[torch.Tensor]:
        pages = self._pages(layer_idx)
        states = pages.read(_page_ids(self.read_ids, pages.page_groups))
        if self.fresh is not None:
            for part in states:
                part[self.fresh] = 0
        if self.at_start is not None:
            # No state of this step is read from these checkpoint blocks.
            _write_copies(pages, self.at_start, states)
        return states

    def write(self, layer_idx: int, states: Sequence[torch.Tensor], token_states: TokenStates | None = None,
              boundary_states: BoundaryStates | None = None) -> None:
        pages = self._pages(layer_idx)
        pages.write(_page_ids(self.write_ids, pages.page_groups), *states)
        if self.at_end is not None:
            _write_copies(pages, self.at_end, states)
        if token_states is not None:
            self.token_states[layer_idx] = token_states
        if self.checkpoints:
            assert boundary_states is not None and boundary_states.keys() == self.checkpoints.keys()
            assert self.kept is not None
            if not bool(self.kept.any()):
                return
            parts = zip(*(boundary_states[r] for r in self.checkpoints))  # per part, each request's [J, ...]
            pages.write(_page_ids(self.checkpoint_ids, pages.page_groups),
                        *(torch.cat(part)[self.kept] for part in parts))

    def commit(self, num_valid: list[int]) -> None:
        """After verification: verify request `self.verify[v]` keeps its first
        num_valid[v] tokens (the decode token + accepted drafts), so its state becomes
        the one after token num_valid[v] - 1. Without a commit a verify request keeps the
        state after its whole chunk (every draft accepted). With block checkpoints the
        states at the boundaries the valid tokens cross are stored too."""
        if len(num_valid) != len(self.verify):
            raise ValueError(f"{len(num_valid)} accepted lengths for {len(self.verify)} verify requests")
        for v, r in enumerate(self.verify):
            if not 1 <= num_valid[v] <= self.counts[r]:
                raise ValueError(f"request {r}: {num_valid[v]} valid tokens of a chunk of {self.counts[r]}")
        bs = self.layout.block_size
        for layer_idx, ts in self.token_states.items():
            pages = self._pages(layer_idx)
            picks: list[tuple[int, int, list[int]]] = []  # (verify index, token index j, block per page group)
            for v, r in enumerate(ts.reqs):
                n = num_valid[v]
                if self.layout.in_place:
                    # The accepted state to the running block; boundary states where a
                    # checkpoint block is (best-effort: some are null), never the running one.
                    s, head = self.starts[r], self.verify_dest[pages.page_groups[0]][v]
                    running = int(self.write_ids[pages.page_groups[0]][r])
                    picks += [(v, j, [int(self.verify_dest[g][v][j]) for g in pages.page_groups])
                              for j in range(n) if (s + j + 1) % bs == 0 and head[j] and head[j] != running]
                    picks.append((v, n - 1, [int(self.write_ids[g][r]) for g in pages.page_groups]))
                elif self.layout.checkpoints:
                    s, head = self.starts[r], self.verify_dest[pages.page_groups[0]][v]
                    # Boundary states go where the block is real (sparse checkpoints null some).
                    picks += [(v, j, [int(self.verify_dest[g][v][j]) for g in pages.page_groups])
                              for j in range(n) if j == n - 1 or ((s + j + 1) % bs == 0 and head[j])]
                elif n < self.counts[r]:
                    picks.append((v, n - 1, [int(self.write_ids[g][r]) for g in pages.page_groups]))
            if not picks:
                continue
            dev = ts.states[0].device
            v_idx = torch.tensor([p[0] for p in picks], device=dev)
            j_idx = torch.tensor([p[1] for p in picks], device=dev)
            pages.write(torch.tensor([p[2] for p in picks], device=dev), *(part[v_idx, j_idx] for part in ts.states))


@dataclass
class StepBackend:
    """The backend of a step of a model with Mamba layers: paged attention (None for a
    model without attention layers) plus the requests' Mamba states."""

    attn: StepAttention | None
    mamba: StepMambaStates

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        assert self.attn is not None
        return self.attn.attention(layer_idx, q, kv)
