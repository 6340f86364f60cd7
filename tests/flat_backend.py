"""A plain step backend for model-level tests: whole prompts of a few requests in one flat
batch, nothing cached. Attention is a dense masked softmax (causal within each request,
plus the layer's sliding window or attention chunk); Mamba layers start from zero states.
It records which layer indices the model asked for, so tests can check they are global.
"""

from __future__ import annotations

import torch

from hybridserve.models.config import CHUNKED, ModelConfig


class FlatMambaStates:
    """MambaStateIO of requests that all start now (zero states; writes are only counted)."""

    def __init__(self, cfg: ModelConfig, counts: list[int]) -> None:
        assert cfg.mamba is not None
        self.conv_shape, self.ssm_shape = cfg.mamba.state_shapes
        self.counts = counts
        self.verify: list[int] = []
        self.checkpoints: dict[int, list[int]] = {}
        self.layers_written: list[int] = []

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        R = len(self.counts)
        return torch.zeros(R, *self.conv_shape), torch.zeros(R, *self.ssm_shape)

    def write(self, layer_idx: int, conv: torch.Tensor, ssm: torch.Tensor, token_states: object = None,
              boundary_states: object = None) -> None:
        self.layers_written.append(layer_idx)


class FlatBackend:
    """AttentionBackend (and, for Mamba models, `.mamba`) of one flat prefill batch."""

    def __init__(self, cfg: ModelConfig, counts: list[int]) -> None:
        self.cfg = cfg
        self.layers_called: list[int] = []
        req = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        starts = torch.tensor([0] + counts[:-1]).cumsum(0)
        self.positions = torch.arange(sum(counts)) - starts[req]
        self._same_req = req[:, None] == req[None, :]
        self.mamba = FlatMambaStates(cfg, counts) if cfg.mamba is not None else None

    def _mask(self, layer_idx: int) -> torch.Tensor:
        q, k = self.positions[:, None], self.positions[None, :]
        allowed = self._same_req & (k <= q)
        window = self.cfg.layer_window(layer_idx)
        if window is not None:
            allowed &= q - k < window
        if self.cfg.layer_types[layer_idx] == CHUNKED:
            size = self.cfg.attention_chunk_size
            assert size is not None
            allowed &= q // size == k // size
        return allowed

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        self.layers_called.append(layer_idx)
        T, H, D = q.shape
        group = H // kv.shape[2]
        k = kv[:, 0].repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        v = kv[:, 1].repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * self.cfg.attn_scale
        if self.cfg.attn_softcap:
            scores = torch.tanh(scores / self.cfg.attn_softcap) * self.cfg.attn_softcap
        scores = scores.masked_fill(~self._mask(layer_idx), float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, H * D)
