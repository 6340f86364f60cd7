"""Jamba's Mamba1 mixer in plain PyTorch, over a flat batch of requests' chunks.

Per token t of one request (I channels, N state size, K kernel, R dt rank; jamba_config.py)::

    x, gate = in_proj(h_t)                               each [I]
    x_t     = silu(conv1d over the last K inputs x)      conv state: the last K-1 inputs
    dt, B, C = rmsnorm each of x_proj(x_t)               [R], [N], [N] (Jamba's dt / B / C norms)
    dt      = softplus(dt_proj(dt) + dt_bias)            [I]
    S       = exp(dt A) * S + (dt * x_t) (outer) B       SSM state S: [I, N], A = -exp(A_log) [I, N]
    y       = (S @ C + D * x_t) * silu(gate)
    out     = out_proj(y)

Unlike Mamba2 (one decay per head, a scalar A), every channel decays each of its N
state entries at its own rate, so there is no SSD matrix form to chunk; the recurrence
runs token by token, batched over the step's requests. Requests with shorter chunks
are padded with dt = 0, which leaves S exactly as it is (exp(0) = 1, no input), so every
request — decode, prefill chunk or verify chunk — takes the one path.

Under tensor parallelism each rank holds I / T channels; x_proj contracts over channels,
so its output is summed over ranks (`reduce`) before the norms.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.arch.causal_conv import ConvLanes
from hybridserve.models.arch.jamba_config import Mamba1MixerConfig
from hybridserve.models.arch.mamba2 import BoundaryStates, TokenStates


class Mamba1MixerWeights(nn.Module):
    """One mixer's parameters (our names; models/loaders/jamba_loader.py maps HF's onto them).
    `cfg` is the rank's local mixer; row_bias=False leaves out out_proj's bias (rank 0 adds it)."""

    def __init__(self, cfg: Mamba1MixerConfig, hidden_size: int, dtype: torch.dtype, row_bias: bool = True) -> None:
        super().__init__()

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        I, N, R = cfg.intermediate_size, cfg.state_size, cfg.dt_rank
        self.in_proj = p(2 * I, hidden_size)  # rows x | gate
        self.in_proj_bias = p(2 * I) if cfg.proj_bias else None
        self.conv_w = p(I, cfg.conv_kernel)
        self.conv_b = p(I) if cfg.conv_bias else None
        self.x_proj = p(R + 2 * N, I)
        self.dt_norm = p(R)
        self.b_norm = p(N)
        self.c_norm = p(N)
        self.dt_proj = p(I, R)
        self.dt_bias = p(I)
        # -exp(A_log), precomputed by the loader in float32 (as HF computes it each call).
        self.A = nn.Parameter(torch.zeros(I, N, dtype=torch.float32), requires_grad=False)
        self.D = p(I)
        self.out_proj = p(hidden_size, I)
        self.out_proj_bias = p(hidden_size) if cfg.proj_bias and row_bias else None


def mamba1_mixer(w: Mamba1MixerWeights, cfg: Mamba1MixerConfig, h: torch.Tensor, conv_state: torch.Tensor,
                 ssm_state: torch.Tensor, counts: list[int], verify: Sequence[int] = (),
                 checkpoints: dict[int, list[int]] | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                 ) -> tuple[torch.Tensor, TokenStates | None, BoundaryStates]:
    """h [T, hidden] (normed) -> (out [T, hidden] (a partial sum under tensor parallelism),
    the verify requests' TokenStates or None, the states at `checkpoints`); conv_state
    [R, I, K-1] and ssm_state [R, I, N] advance past each request's chunk in place."""
    I, N, R = cfg.intermediate_size, cfg.state_size, cfg.dt_rank
    x, gate = F.linear(h, w.in_proj, w.in_proj_bias).split([I, I], dim=-1)
    lanes = ConvLanes(x.to(conv_state.dtype), conv_state, counts)
    xc = F.silu(lanes.convolve(w.conv_w, w.conv_b)).to(h.dtype)  # [T, I]
    dt, B, C = reduce(F.linear(xc, w.x_proj)).split([R, N, N], dim=-1)
    dt = F.rms_norm(dt, (R,), w.dt_norm, cfg.norm_eps)
    B = F.rms_norm(B, (N,), w.b_norm, cfg.norm_eps)
    C = F.rms_norm(C, (N,), w.c_norm, cfg.norm_eps)
    dt = F.softplus((F.linear(dt, w.dt_proj) + w.dt_bias).float())  # [T, I]
    y, ssm_tokens, ssm_saved = selective_scan(xc.float(), dt, w.A, B.float(), C.float(), ssm_state, counts,
                                              verify, checkpoints or {})
    y = (y + w.D.float() * xc.float()) * F.silu(gate.float())
    out = F.linear(y.to(h.dtype), w.out_proj, w.out_proj_bias)
    token_states = TokenStates(list(verify), (lanes.token_states(verify), ssm_tokens)) if verify else None
    boundary_states: BoundaryStates = {r: (lanes.boundary_states(r, js), ssm_saved[r])
                                       for r, js in (checkpoints or {}).items()}
    conv_state.copy_(lanes.final_states())
    return out, token_states, boundary_states


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor, counts: list[int], verify: Sequence[int], checkpoints: dict[int, list[int]]
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The recurrence over each request's chunk, without the D skip term or the gate.

    x, dt [T, I], B, C [T, N] (float32, request after request), A [I, N], state [R, I, N]
    (each request's state before its chunk; advanced past it in place) -> (y [T, I], the
    verify requests' states after each token [V, n, I, N] (n their longest chunk), each
    checkpointed request's states after its counts {r: [J, I, N]})."""
    dev = x.device
    R, n = len(counts), max(counts)
    counts_t = torch.tensor(counts, device=dev)
    first = torch.cumsum(counts_t, 0) - counts_t
    steps = torch.arange(n, device=dev)
    valid = steps[None, :] < counts_t[:, None]  # [R, n]
    rows = torch.where(valid, first[:, None] + steps, 0)
    dt_p = dt[rows] * valid[..., None]  # padding: dt = 0 keeps S unchanged
    dtx = dt_p * x[rows]  # [R, n, I]
    B_p, C_p = B[rows], C[rows]  # [R, n, N]
    S = state.float()
    y = x.new_empty(R, n, x.shape[1])
    reqs = list(verify)
    token_states = S.new_empty(len(reqs), n, *S.shape[1:])
    saves = {(r, j - 1): k for r, js in checkpoints.items() for k, j in enumerate(js)}  # (request, token) -> slot
    saved = {r: S.new_empty(len(js), *S.shape[1:]) for r, js in checkpoints.items()}
    for j in range(n):
        S = S * torch.exp(dt_p[:, j, :, None] * A) + dtx[:, j, :, None] * B_p[:, j, None, :]
        y[:, j] = torch.matmul(S, C_p[:, j, :, None]).squeeze(-1)
        if reqs:
            token_states[:, j] = S[reqs]
        for r in checkpoints:
            if (r, j) in saves:
                saved[r][saves[r, j]] = S[r]
    state.copy_(S)
    return y[valid], token_states.to(state.dtype), {r: s.to(state.dtype) for r, s in saved.items()}
