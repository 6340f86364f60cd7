"""Row chunks of an int8 decoder step (decoder.DecoderLM._int8_layers): a prefill's
temporaries bounded by a chunk's rows instead of the step's tokens.

In an int8 layer everything but attention works row by row: the matmuls (int32 sums of one
row's products, then that row's scales), the norms, the per-row quantizers, the residual
adds. A step of T tokens can therefore run all of it over row chunks and give the same
values, and only attention needs the whole step's q, k and v. What a step holds for the
whole of T is then the residual stream, one q|k|v buffer in the KV cache's dtype that every
layer writes in turn (attention has copied a layer's K/V into the cache before the next
layer's chunks overwrite it) and attention's output; the rest (qkv's float32 product,
gate|up's, the activation product, the quantizers' copies), a chunk's. Without chunks a
1024-token prefill of Gemma 3 270M made tens of MB of such temporaries per layer, which
glibc's heap then kept resident.

A step within one chunk (every decode step) adds no op: `take` hands back its tensors
themselves, `store_qkv` the chain's own views, `join` the one chunk's residual stream.
"""

from __future__ import annotations

from typing import Iterator

import torch

# Rows per chunk, None: no chunks. Off by default: where it was measured, chunks lowered the
# serving run's peak but slowed its prefill (oneDNN's int8 GEMM ran slower per row on
# 256-row chunks than on the whole step with 2 threads), a trade left to a measurement on a
# quiet machine (benchmarks/int8_row_chunks_ab.py, benchmarks/results/memory_peak.md).
PREFILL_CHUNK_ROWS: int | None = None


class RowChunks:
    """The chunks of a step of `total` rows, `chunk_rows` at most each (None: one chunk;
    chunk c covers rows bounds[c]), and, with more than one, the q|k|v buffer [total, (H + 2 KVH) * D] in
    `kv_dtype` they share. Invariant: one chunk makes no buffer and no copy."""

    def __init__(self, total: int, chunk_rows: int | None, nq: int, nkv: int, hd: int, kv_dtype: torch.dtype,
                 device: torch.device) -> None:
        step = chunk_rows or max(total, 1)
        self.bounds = [(a, min(a + step, total)) for a in range(0, total, step)] or [(0, total)]
        self.whole = len(self.bounds) == 1
        self.qkv_buffer: torch.Tensor | None = None
        if not self.whole:
            self.qkv_buffer = torch.empty(total, (nq + 2 * nkv) * hd, dtype=kv_dtype, device=device)
            self._q = self.qkv_buffer[:, : nq * hd].view(total, nq, hd)
            self._kv = self.qkv_buffer[:, nq * hd :].view(total, 2, nkv, hd)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.bounds)))

    def take(self, c: int, rows: torch.Tensor | None) -> torch.Tensor | None:
        """Chunk c's rows of a tensor of the whole step (None stays None)."""
        if rows is None or self.whole:
            return rows
        a, e = self.bounds[c]
        return rows[a:e]

    def store_qkv(self, c: int, q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk c's q [rows, H, D] and kv [rows, 2, KVH, D] placed in the step's buffer;
        returns the whole step's (q, kv), complete once every chunk has been stored."""
        if self.whole:
            return q, kv
        a, e = self.bounds[c]
        self._q[a:e] = q
        self._kv[a:e] = kv
        return self._q, self._kv

    def join(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        """The whole step's rows from its chunks' (in order)."""
        return chunks[0] if self.whole else torch.cat(chunks)
