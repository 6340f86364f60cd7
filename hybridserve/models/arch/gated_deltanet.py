"""The Gated DeltaNet mixer (Qwen3-Next's linear attention) in plain PyTorch, over a flat
batch of requests' chunks, with the state interface of the Mamba2 mixer (mamba2.py):
request r's chunk is rows offsets[r] .. offsets[r]+counts[r]-1, its (conv, recurrent) state
is as after its previous chunk, and both advance in place past the chunk.

Per token t of one request (Hk key heads of dk, Hv value heads of dv, each key head read
by Hv/Hk value heads, kernel K)::

    q, k, v, z, b, a = in_proj(h_t)
    q, k, v = silu(conv1d over the last K q|k|v inputs)      conv state: the last K-1 inputs
    q = l2norm(q) / sqrt(dk),  k = l2norm(k)                  per head
    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)        [Hv]
    S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T      recurrent state S: [Hv, dk, dv]
    o = S^T q
    out = out_proj(rmsnorm_per_head(o) * norm_w * silu(z))

Decodes (one token per request) run that step batched over requests, and so do verify
chunks (a decode with drafts), token by token, keeping the state after each. Longer chunks
run the chunked form from the request's saved state (delta_rule_scan).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.arch.mamba2 import BoundaryStates, TokenStates
from hybridserve.models.arch.qwen3_next_config import GatedDeltaNetConfig
from hybridserve.models.arch.scan_chunks import chunk_layout
from hybridserve.models.arch.verify_steps import verify_token_by_token

_L2_EPS = 1e-6  # l2norm of q and k: x * rsqrt(sum(x^2) + eps), as the reference kernels do


class GatedDeltaNetWeights(nn.Module):
    """One layer's parameters (our layout; models/loaders/qwen3_next_loader.py maps HF's
    per-key-head interleaved in_proj_qkvz / in_proj_ba onto in_proj's [q|k|v|z|b|a] rows).
    Under tensor parallelism `cfg` is the rank's local mixer (its key and value heads)."""

    def __init__(self, cfg: GatedDeltaNetConfig, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.in_proj = p(cfg.in_proj_size, hidden_size)
        self.conv_w = p(cfg.conv_dim, cfg.conv_kernel)
        self.dt_bias = p(cfg.num_v_heads)
        # -exp(A_log) in float32, as HF computes it each call (A rounded to bf16 would change every decay).
        self.A = nn.Parameter(torch.zeros(cfg.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.norm = p(cfg.head_v_dim)
        self.out_proj = p(hidden_size, cfg.value_dim)


def gated_deltanet_mixer(w: GatedDeltaNetWeights, cfg: GatedDeltaNetConfig, h: torch.Tensor,
                         conv_state: torch.Tensor, state: torch.Tensor, counts: list[int],
                         verify: Sequence[int] = (), checkpoints: dict[int, list[int]] | None = None
                         ) -> tuple[torch.Tensor, TokenStates | None, BoundaryStates]:
    """h [T, hidden] (normed) -> ([T, hidden] (a partial sum under tensor parallelism),
    the verify requests' TokenStates or None, the states at `checkpoints` of longer chunks);
    conv_state [R, conv_dim, K-1] and state [R, Hv, dk, dv] advance in place."""
    Hv = cfg.num_v_heads
    proj = F.linear(h, w.in_proj)
    qkv, z, b, a = proj.split([cfg.conv_dim, cfg.value_dim, Hv, Hv], dim=-1)
    beta = torch.sigmoid(b.float())
    g = w.A * F.softplus(a.float() + w.dt_bias.float())  # [T, Hv], <= 0
    T, R = h.shape[0], len(counts)
    token_states = None
    boundary_states: BoundaryStates = {}
    if T == R:  # a pure decode step: one recurrence step for every request at once
        y = _decode(w, cfg, qkv, g, beta, conv_state, state)
    else:
        y = h.new_empty(T, Hv, cfg.head_v_dim, dtype=torch.float32)
        verify_set = set(verify)
        decodes: list[int] = []
        decode_rows: list[int] = []
        verify_rows: list[int] = []
        start = 0
        for r, c in enumerate(counts):
            if r in verify_set:
                verify_rows.append(start)
            elif c == 1:
                decodes.append(r)
                decode_rows.append(start)
            else:
                rows = slice(start, start + c)
                y[rows], saved = _prefill(w, cfg, qkv[rows], g[rows], beta[rows], conv_state[r], state[r],
                                          (checkpoints or {}).get(r, []))
                if saved is not None:
                    boundary_states[r] = saved
            start += c
        if decodes:
            rows_t = torch.tensor(decode_rows, device=h.device)
            sel = torch.tensor(decodes, device=h.device)
            conv, st = conv_state[sel], state[sel]
            y[rows_t] = _decode(w, cfg, qkv[rows_t], g[rows_t], beta[rows_t], conv, st)
            conv_state[sel] = conv
            state[sel] = st
        if verify:
            def step(tok: torch.Tensor, conv: torch.Tensor, st: torch.Tensor) -> torch.Tensor:
                return _decode(w, cfg, qkv[tok], g[tok], beta[tok], conv, st)

            reqs = list(verify)
            token_states = TokenStates(reqs, *verify_token_by_token(step, conv_state, state, y, reqs, verify_rows,
                                                                    [counts[r] for r in reqs]))
    out = _gated_norm(y, z, w.norm, cfg.norm_eps).reshape(T, cfg.value_dim).to(h.dtype)
    return F.linear(out, w.out_proj), token_states, boundary_states


def _gated_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y [T, Hv, dv] float32, z [T, Hv*dv]: RMSNorm over each head, times weight, times silu(z)
    (norm before gate, as HF's Qwen3NextRMSNormGated)."""
    normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(weight.dtype)) * F.silu(z.float()).view(y.shape)


def _heads(x: torch.Tensor, cfg: GatedDeltaNetConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv outputs [..., conv_dim] -> q, k [..., Hv, dk] (l2-normalised, q / sqrt(dk), each key
    head repeated for its value heads) and v [..., Hv, dv], float32."""
    lead = x.shape[:-1]
    q, k, v = x.float().split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
    rep = cfg.num_v_heads // cfg.num_k_heads
    q = q.reshape(*lead, cfg.num_k_heads, cfg.head_k_dim).repeat_interleave(rep, dim=-2)
    k = k.reshape(*lead, cfg.num_k_heads, cfg.head_k_dim).repeat_interleave(rep, dim=-2)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + _L2_EPS) * cfg.head_k_dim**-0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + _L2_EPS)
    return q, k, v.reshape(*lead, cfg.num_v_heads, cfg.head_v_dim)


def _decode(w: GatedDeltaNetWeights, cfg: GatedDeltaNetConfig, qkv: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token per request: qkv [R, conv_dim], g / beta [R, Hv] -> o [R, Hv, dv] float32;
    conv_state [R, conv_dim, K-1] and state [R, Hv, dk, dv] advance one token in place."""
    window = torch.cat((conv_state, qkv[:, :, None].to(conv_state.dtype)), dim=2)  # oldest first
    conv_state.copy_(window[:, :, 1:])
    q, k, v = _heads(F.silu((window * w.conv_w).sum(-1)), cfg)
    s = state.float() * torch.exp(g)[:, :, None, None]
    delta = (v - torch.einsum("rhkv,rhk->rhv", s, k)) * beta[:, :, None]
    s = s + k[:, :, :, None] * delta[:, :, None, :]
    state.copy_(s)
    return torch.einsum("rhkv,rhk->rhv", s, q)


def _prefill(w: GatedDeltaNetWeights, cfg: GatedDeltaNetConfig, qkv: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, save_at: Sequence[int] = ()
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """One request's chunk of L tokens -> (o [L, Hv, dv] float32, its (conv, recurrent) states
    after each token count in save_at, or None if none asked); states advance in place."""
    L = qkv.shape[0]
    K1 = conv_state.shape[1]
    seq = torch.cat((conv_state, qkv.t().to(conv_state.dtype)), dim=1)  # [conv_dim, K-1+L]
    conv_state.copy_(seq[:, L:])
    # Cross-correlation over K-1+L inputs with no padding: output t sees inputs t..t+K-1.
    out = F.conv1d(seq[None], w.conv_w[:, None, :], groups=cfg.conv_dim)[0].t()
    q, k, v = _heads(F.silu(out), cfg)
    y, saved = delta_rule_scan(q, k, v, g, beta, state, cfg.chunk_size, save_at)
    if not save_at:
        return y, None
    # The conv state after j tokens is the K-1 inputs before input j: seq columns j .. j+K-2.
    conv_saved = torch.stack([seq[:, j : j + K1] for j in save_at])
    return y, (conv_saved, saved.to(state.dtype))


def delta_rule_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, chunk_size: int, save_at: Sequence[int] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence in chunks of Q tokens (float32).

    q, k [L, H, dk], v [L, H, dv], g / beta [L, H], state [H, dk, dv] (before the sequence;
    overwritten with the state after it) -> (o [L, H, dv], the states after each token count
    in save_at [J, H, dk, dv]).

    Within a chunk entering with state S0, with G_t = g_1 + ... + g_t (chunk-local), the
    token-by-token rule unrolls to S_t = exp(G_t) S0 + sum_{j<=t} exp(G_t - G_j) k_j u_j^T,
    whose updates u solve a unit lower-triangular system::

        u_t + sum_{j<t} beta_t exp(G_t - G_j) (k_t . k_j) u_j = beta_t v_t - beta_t exp(G_t) S0^T k_t
        o_t = exp(G_t) S0^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t . k_j) u_j
        S_Q = exp(G_Q) S0 + sum_j exp(G_Q - G_j) k_j u_j^T

    The triangular solve and the in-chunk products do not depend on S0, so they run for all
    chunks at once; only the S0 terms go chunk by chunk. Pad tokens (g = 0, beta = 0, k = 0)
    leave the state unchanged; with save_at, chunk_layout (scan_chunks.py) shrinks Q and
    pads the front until every count is a chunk start.
    """
    L, H, dk = k.shape
    layout = chunk_layout(L, chunk_size, save_at)
    Q, nc = layout.size, layout.count

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [nc, H, Q, ...], zero-padded
        padded = F.pad(t.movedim(0, -1), (layout.front, layout.back)).movedim(-1, 0)
        return padded.view(nc, Q, *t.shape[1:]).transpose(1, 2)

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(dim=-1)  # [nc, H, Q]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [nc, H, Q(t), Q(j)]
    m = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat((beta[..., None] * v, (beta * G.exp())[..., None] * k), dim=-1)
    solved = torch.linalg.solve_triangular(m, rhs, upper=False, unitriangular=True)
    u_local, w_state = solved.split([v.shape[-1], dk], dim=-1)  # u = u_local - w_state @ S0
    qk = (q @ k.transpose(-1, -2)) * decay
    q_in = q * G.exp()[..., None]
    k_out = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()  # [nc, H]
    y = torch.empty_like(v)
    entering = q.new_empty(nc, H, dk, v.shape[-1])
    s = state.float()
    for c in range(nc):
        entering[c] = s
        u = u_local[c] - w_state[c] @ s
        y[c] = q_in[c] @ s + qk[c] @ u
        s = s * chunk_decay[c][:, None, None] + k_out[c].transpose(-1, -2) @ u
    state.copy_(s)
    saved = entering[[layout.chunk_of(j) for j in save_at]] if save_at else entering[:0]
    return y.transpose(1, 2).reshape(nc * Q, H, -1)[layout.front : layout.front + L], saved
