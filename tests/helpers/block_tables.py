"""Block tables for attention tests: every request's blocks consecutive, none shared."""

from __future__ import annotations

import numpy as np

from hybridserve.executor.torch.requests import BlockTables


def consecutive_tables(groups: int, requests: int, blocks: int) -> BlockTables:
    """Group g's request r owns blocks 1 + (g * requests + r) * blocks onwards, `blocks` of
    them (block 0 stays the null block)."""
    tables = BlockTables(groups)
    for g in range(groups):
        for r in range(requests):
            base = 1 + (g * requests + r) * blocks
            tables.table[g, r, :blocks] = np.arange(base, base + blocks)
            tables.lengths[g, r] = blocks
    return tables
