"""Where a chunked scan of one sequence cuts it, so that the states it is asked to keep
are states between chunks (mamba2.ssd_scan, gated_deltanet.delta_rule_scan).

A chunked scan knows its state only between chunks. With save_at (evenly spaced token
counts: block boundaries) the chunk length Q shrinks to divide their spacing and pad
tokens go in front until every count is a chunk start::

    save_at 5, 21 (spacing 16), chunk_size 64 -> Q 16:  pad 11 | 5 tokens | 16 tokens | rest
    entering states:                                    S_0      S_5        S_21

The pad tokens must leave the state unchanged (each scan's own neutral input).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd


@dataclass(frozen=True)
class ChunkLayout:
    size: int  # Q, tokens per chunk
    front: int  # pad tokens before the sequence
    back: int  # pad tokens after it, completing the last chunk
    count: int  # chunks

    def chunk_of(self, token_count: int) -> int:
        """The chunk whose entering state is the state after `token_count` tokens (one of save_at)."""
        return (self.front + token_count) // self.size


def chunk_layout(length: int, chunk_size: int, save_at: Sequence[int] = ()) -> ChunkLayout:
    size, front = chunk_size, 0
    if save_at:
        for before, after in zip(save_at, save_at[1:]):
            size = gcd(size, after - before)
        front = -save_at[0] % size
    count = -(-(front + length) // size)
    return ChunkLayout(size=size, front=front, back=count * size - length - front, count=count)
