"""Cohere2 (`Cohere2ForCausalLM`, Command R7B / A): a `DecoderLM` whose block differs in three ways.

- Parallel block: one LayerNorm of the residual stream feeds both attention and the MLP, and
  both outputs are added to the stream together: h + attn(x) + mlp(x), x = LayerNorm(h).
  Under tensor parallelism the two row-parallel partial sums are added first and reduced
  with one all-reduce.
- LayerNorm, not RMSNorm: (x - mean) / sqrt(var + eps) * w, no bias (HF's Cohere2LayerNorm,
  in float32), for the layers and the final norm.
- Sliding layers rotate q/k with RoPE over interleaved pairs (2i, 2i+1); the loader reorders
  their q/k rows to the half split (loaders/llama4_loader.interleaved_to_half_split: q.k
  is unchanged by one permutation of head_dim applied to both). Full layers have no RoPE at all: their
  `rope` entry is absent (config.py), so positions reach them only through the causal mask.

The logit scale (logits * logit_scale) is folded into the final norm's weight by the loader.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.models.arch.decoder import AttentionBackend, DecoderLM
from hybridserve.models.layers.rope import apply_rope_


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's bias-free LayerNorm over the last dim, computed in float32 as HF does."""
    out = F.layer_norm(x.float(), (x.shape[-1],), weight=weight.float(), eps=eps)
    return out.to(x.dtype)


class Cohere2LM(DecoderLM):
    """Cohere2 on the shared decoder weights (no post-attention norm: `parallel_block`)."""

    def stage_output(self, h: torch.Tensor) -> torch.Tensor:
        if self.final_norm is None:
            return h
        return layer_norm(h, self.final_norm, self.cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, max_position: int,
                backend: AttentionBackend, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """As DecoderLM.forward: [T] ids (first stage) or hidden_in (others) -> stage_output."""
        cfg = self.cfg
        nq, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        T = positions.shape[0]
        if not self._linears:
            self.build_linears(release_weights=False)
        h = self.stage_input(input_ids, hidden_in)
        rope = {t: table.lookup(positions, max_position) for t, table in self._rope.items()}
        for i, w, lin in zip(self.layer_ids, self.layers, self._linears):
            assert w.input_norm is not None
            x = layer_norm(h, w.input_norm, eps)
            qkv = lin.qkv(x)
            qk = qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd)
            if cfg.layer_types[i] in rope:
                cos, sin = rope[cfg.layer_types[i]]
                apply_rope_(qk, cos, sin)
            attn = backend.attention(i, qk[:, :nq], qkv[:, nq * hd :].view(T, 2, nkv, hd))
            gate, up = lin.gate_up(x).chunk(2, dim=-1)
            y = self._act(gate) * up
            if self.tp is None:  # HF's order: (h + attn) + mlp
                h = lin.down_residual(lin.o_residual(h, attn), y)
            else:
                h = h + self.tp.all_reduce(lin.o(attn) + lin.down(y))
        return self.stage_output(h)
