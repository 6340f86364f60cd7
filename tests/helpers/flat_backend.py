"""A plain step backend for model-level tests: a few requests in one flat batch per step,
continued over steps (a prefill chunk, then decodes). Each request's K/V of every attention
layer and its Mamba states are kept whole, per request, between steps; attention is a
dense masked softmax (causal, plus the layer's sliding window or attention chunk). It
records which layer indices the model asked for, so tests can check they are global.
"""

from __future__ import annotations

import torch

from hybridserve.models.config import CHUNKED, SLIDING, ModelConfig


class FlatMambaStates:
    """MambaStateIO over the kept states (zeros for a request's first chunk)."""

    def __init__(self, cfg: ModelConfig, num_requests: int) -> None:
        mixer = cfg.mamba or cfg.gated_deltanet  # Mamba2, or Qwen3-Next's Gated DeltaNet
        assert mixer is not None
        self.conv_shape, self.ssm_shape = mixer.state_shapes
        self.num_requests = num_requests
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.counts: list[int] = []
        self.verify: list[int] = []
        self.checkpoints: dict[int, list[int]] = {}
        self.layers_written: list[int] = []

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        R = self.num_requests
        conv, ssm = self.kept.get(layer_idx, (torch.zeros(R, *self.conv_shape), torch.zeros(R, *self.ssm_shape)))
        return conv.clone(), ssm.clone()

    def write(self, layer_idx: int, conv: torch.Tensor, ssm: torch.Tensor, token_states: object = None,
              boundary_states: object = None) -> None:
        self.kept[layer_idx] = (conv.clone(), ssm.clone())
        self.layers_written.append(layer_idx)


class FlatBackend:
    """AttentionBackend (and, for Mamba models, `.mamba`) of `num_requests` requests; call
    `step(counts)` before each forward (the requests' next `counts` tokens)."""

    def __init__(self, cfg: ModelConfig, num_requests: int) -> None:
        self.cfg = cfg
        self.num_requests = num_requests
        self.lengths = [0] * num_requests  # tokens each request has had before this step
        self.kv: dict[int, list[torch.Tensor | None]] = {}
        recurrent = cfg.mamba is not None or cfg.gated_deltanet is not None
        self.mamba = FlatMambaStates(cfg, num_requests) if recurrent else None
        self.layers_called: list[int] = []
        self.counts: list[int] = []

    def step(self, counts: list[int]) -> torch.Tensor:
        """Start a step; returns the positions [T] of its tokens."""
        self.lengths = [n + c for n, c in zip(self.lengths, self.counts)] if self.counts else self.lengths
        self.counts = counts
        if self.mamba is not None:
            self.mamba.counts = counts
        return torch.cat([torch.arange(n, n + c) for n, c in zip(self.lengths, counts)])

    def _allowed(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q, k = q[:, None], k[None, :]
        allowed = k <= q
        if self.cfg.layer_types[layer_idx] == SLIDING:
            allowed &= q - k < self.cfg.sliding_window
        if self.cfg.layer_types[layer_idx] == CHUNKED:
            size = self.cfg.attention_chunk_size
            assert size is not None
            allowed &= q // size == k // size
        return allowed

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor | None = None
                  ) -> torch.Tensor:
        self.layers_called.append(layer_idx)
        T, H, D = q.shape
        group = H // kv.shape[2]  # query head h reads kv head h // group
        kept = self.kv.setdefault(layer_idx, [None] * self.num_requests)
        out = q.new_empty(T, H * D)
        start = 0
        for r, (n, c) in enumerate(zip(self.lengths, self.counts)):
            past = kept[r]
            keys = kv[start : start + c].clone() if past is None else torch.cat([past, kv[start : start + c]])
            kept[r] = keys
            k = keys[:, 0].repeat_interleave(group, dim=1)
            v = keys[:, 1].repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q[start : start + c], k) * self.cfg.attn_scale
            if self.cfg.attn_softcap:
                scores = torch.tanh(scores / self.cfg.attn_softcap) * self.cfg.attn_softcap
            allowed = self._allowed(layer_idx, torch.arange(n, n + c), torch.arange(n + c))
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:  # gpt-oss: one more logit per head in the denominator, its value 0
                scores = torch.cat((scores, sinks[:, None, None].expand(H, c, 1)), dim=-1)
            probs = scores.softmax(-1)[..., : n + c]
            out[start : start + c] = torch.einsum("hts,shd->thd", probs, v).reshape(c, H * D)
            start += c
        return out
