"""The runner's own per-request state: tokens, computed count, block tables, RNG.

The runner's state is authoritative for what it computes. With async scheduling the
scheduler holds placeholders for tokens it has not seen yet; the runner, which executes
steps in order, always knows them by the time a step that needs them runs.

Block tables are rows of one numpy array per KV cache group, grown by doubling, so a
step gathers the block ids of all its requests with one fancy-index per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridserve.core.errors import RequestError
from hybridserve.core.request import SamplingParams


@dataclass
class RequestState:
    """Invariant: token_ids[:num_computed] have their K/V in this request's blocks."""

    req_id: str
    token_ids: list[int]
    num_computed: int
    params: SamplingParams
    row: int  # row of this request in every group's block table
    seed: int = 0  # keys this request's draws (executor/torch/sampling_keys.py)
    num_prompt_tokens: int = 0
    eos_token_id: int | None = None
    # No logprobs, min_tokens, logits controls or grammar: plain_sampling's fast path
    plain: bool = False
    plain_greedy: bool = False  # plain and greedy: the argmax fast path
    extra: dict[str, Any] = field(default_factory=dict)  # room for drafter / Mamba bookkeeping


class BlockTables:
    """All groups' tables in one int64 array [groups, rows, max blocks]; `lengths[g, row]`
    entries of a row are valid. One array lets a step look up every group at once."""

    def __init__(self, num_groups: int, rows: int = 64, cols: int = 64) -> None:
        self.table = np.zeros((num_groups, rows, cols), dtype=np.int64)
        self.lengths = np.zeros((num_groups, rows), dtype=np.int64)
        self.null_lengths = np.zeros((num_groups, rows), dtype=np.int64)  # null prefix written so far
        self._free_rows = list(range(rows - 1, -1, -1))

    def alloc_row(self) -> int:
        if not self._free_rows:
            g, rows, cols = self.table.shape
            self.table = np.concatenate([self.table, np.zeros_like(self.table)], axis=1)
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)], axis=1)
            self.null_lengths = np.concatenate([self.null_lengths, np.zeros_like(self.null_lengths)], axis=1)
            self._free_rows.extend(range(2 * rows - 1, rows - 1, -1))
        row = self._free_rows.pop()
        self.lengths[:, row] = 0
        self.null_lengths[:, row] = 0
        return row

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def append(self, group: int, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        start = int(self.lengths[group, row])
        if start + n > self.table.shape[2]:
            g, rows, cols = self.table.shape
            grown = np.zeros((g, rows, max(2 * cols, start + n)), dtype=self.table.dtype)
            grown[:, :, :cols] = self.table
            self.table = grown
        self.table[group, row, start : start + n] = block_ids
        self.lengths[group, row] = start + n

    def insert_before_last(self, group: int, row: int, block_ids: list[int]) -> None:
        """A Mamba running state kept in place (InPlaceMambaManager): its block, the row's
        last entry, moves behind block_ids."""
        last = int(self.lengths[group, row]) - 1
        running = int(self.table[group, row, last])
        self.lengths[group, row] = last
        self.append(group, row, list(block_ids) + [running])

    def set_null_prefix(self, group: int, row: int, num_null: int) -> None:
        """The first `num_null` blocks were freed (out of window): they read as block 0."""
        done = int(self.null_lengths[group, row])
        if num_null <= done:
            return  # the prefix only grows; nothing new to clear
        if num_null > self.lengths[group, row]:
            raise RequestError(f"null prefix {num_null} longer than the block table ({self.lengths[group, row]})")
        self.table[group, row, done:num_null] = 0
        self.null_lengths[group, row] = num_null

    def gather(self, groups: list[int], rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """[len(groups), B, NB] block ids at (rows[b], cols[b, j]); columns past the width are
        clamped (callers mask those positions)."""
        cols = np.minimum(cols, self.table.shape[2] - 1)
        return self.table[np.asarray(groups)[:, None, None], rows[None, :, None], cols[None]]
