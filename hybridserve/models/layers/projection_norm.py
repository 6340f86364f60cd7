"""OLMo 3's q/k norm: one RMSNorm over the whole q projection (all heads together) and one
over the whole k projection, where Gemma 3 and EXAONE 4 normalise each head on its own.

Under tensor parallelism a rank holds some of the heads, so the mean square of a token's q
(of its k) is a sum over ranks: each rank's partial sums of squares are all-reduced (one
[T, 2] tensor per layer) before dividing by the global projection sizes. With fewer KV heads
than ranks, T / num_kv_heads ranks hold the same KV head (parallel.group_rows); its squares
then reach the sum that many times, so the k sum is divided by that count.
"""

from __future__ import annotations

import torch

from hybridserve.models.config import ModelConfig
from hybridserve.models.parallel import TPGroup


class ProjectionNorm:
    """Built from the model's global config and the rank's TP group (None: one rank)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None) -> None:
        self.tp = tp
        size = tp.size if tp is not None else 1
        self.kv_copies = size // cfg.num_kv_heads if cfg.num_kv_heads < size else 1
        self.inv_sizes = (1.0 / (cfg.num_heads * cfg.head_dim), 1.0 / (cfg.num_kv_heads * cfg.head_dim))

    def apply_(self, qk: torch.Tensor, weight: torch.Tensor, num_q_heads: int, eps: torch.Tensor) -> None:
        """In place: qk [T, H + KVH, D] (this rank's heads; may be a strided view) normalised,
        q over its H heads and k over its KVH, then times `weight` [H + KVH, D]."""
        x = qk.float()  # HF normalises in float32
        squares = x.square().sum(dim=-1)  # [T, H + KVH]
        sums = torch.stack((squares[:, :num_q_heads].sum(dim=1), squares[:, num_q_heads:].sum(dim=1)), dim=1)
        if self.tp is not None:
            self.tp.all_reduce(sums)
            if self.kv_copies > 1:
                sums[:, 1] /= self.kv_copies
        mean = sums * torch.tensor(self.inv_sizes, dtype=sums.dtype, device=sums.device)
        inv = torch.rsqrt(mean + eps.float())  # [T, 2]: q's, k's
        x[:, :num_q_heads] *= inv[:, 0, None, None]
        x[:, num_q_heads:] *= inv[:, 1, None, None]
        qk.copy_(x * weight)
