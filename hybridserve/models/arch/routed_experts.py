"""Routed SwiGLU experts: top-k of a linear router (Granite 4.0-H, Jamba).

    logits  = x R^T                      R [E, H]; in float32
    k picks = topk(logits), weights = softmax(those k logits)   (Granite 4.0-H: renormalized)
                      or the picks' softmax(logits) over all E  (Jamba: not renormalized)
    out     = sum over picks e of  weight_e * down_e(silu(gate_e x) * up_e x)

Under tensor parallelism each rank holds every expert's share of the intermediate columns
(the router whole), so its `out` is a partial sum the caller adds up over ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RoutedExperts(nn.Module):
    """router [E, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; I local."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.router = p(num_experts, hidden_size)
        self.gate_up = p(num_experts, 2 * intermediate_size, hidden_size)
        self.down = p(num_experts, hidden_size, intermediate_size)


def routed_experts(x: torch.Tensor, w: RoutedExperts, top_k: int, renormalize: bool = True) -> torch.Tensor:
    """x [T, H] -> [T, H]: each token's top_k experts, weighted (see the module docstring for
    `renormalize`); added up in expert order (as HF's loop adds them), so the float sums are
    the same."""
    logits = F.linear(x, w.router).float()
    if renormalize:
        top_logits, top_idx = logits.topk(top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
    else:
        top_probs, top_idx = logits.softmax(dim=-1).topk(top_k, dim=-1)
        weights = top_probs.to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(top_idx).tolist():
        tok, slot = torch.where(top_idx == e)
        gate, up = F.linear(x[tok], w.gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w.down[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out
