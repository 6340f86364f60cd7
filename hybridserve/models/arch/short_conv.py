"""LFM2's short gated convolution in plain PyTorch, over a flat batch of requests' chunks.

Per token t of one request, over D channels with a kernel of L (lfm2_config.py)::

    B, C, x = in_proj(h_t)                       each [D]
    u_t     = B * x
    y_t     = C * (sum_k w[:, k] * u_{t-L+1+k} + b)   (a depthwise causal convolution)
    out     = out_proj(y_t)

The state is the last L-1 inputs u (zeros before a request's first token); decodes,
prefill chunks and verify chunks take one path (causal_conv.ConvLanes).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.arch.causal_conv import ConvLanes
from hybridserve.models.arch.lfm2_config import ShortConvConfig
from hybridserve.models.arch.mamba2 import BoundaryStates, TokenStates


class ShortConvWeights(nn.Module):
    """One layer's parameters (our names; models/loaders/lfm2_loader.py maps HF's onto them).
    Under tensor parallelism `cfg` is the rank's channels; row_bias=False leaves out
    out_proj's bias (rank 0 adds it for all)."""

    def __init__(self, cfg: ShortConvConfig, hidden_size: int, dtype: torch.dtype, row_bias: bool = True) -> None:
        super().__init__()

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        D = cfg.channels
        self.in_proj = p(3 * D, hidden_size)  # rows B | C | x
        self.in_proj_bias = p(3 * D) if cfg.bias else None
        self.conv_w = p(D, cfg.kernel)  # [channel, tap], oldest input first
        self.conv_b = p(D) if cfg.bias else None
        self.out_proj = p(hidden_size, D)
        self.out_proj_bias = p(hidden_size) if cfg.bias and row_bias else None


def short_conv_mixer(w: ShortConvWeights, cfg: ShortConvConfig, h: torch.Tensor, conv_state: torch.Tensor,
                     counts: list[int], verify: Sequence[int] = (), checkpoints: dict[int, list[int]] | None = None
                     ) -> tuple[torch.Tensor, TokenStates | None, BoundaryStates]:
    """h [T, hidden] (normed) -> (out [T, hidden] (a partial sum under tensor parallelism,
    summed over ranks by the caller), the verify requests' TokenStates or None, the states
    at `checkpoints`); conv_state [R, D, L-1] advances past each request's chunk in place."""
    D = cfg.channels
    B, C, x = F.linear(h, w.in_proj, w.in_proj_bias).split([D, D, D], dim=-1)
    lanes = ConvLanes((B * x).to(conv_state.dtype), conv_state, counts)
    out = F.linear(C * lanes.convolve(w.conv_w, w.conv_b).to(C.dtype), w.out_proj, w.out_proj_bias)
    token_states = TokenStates(list(verify), (lanes.token_states(verify),)) if verify else None
    boundary_states: BoundaryStates = {r: (lanes.boundary_states(r, js),) for r, js in (checkpoints or {}).items()}
    conv_state.copy_(lanes.final_states())
    return out, token_states, boundary_states
