"""The Mamba2 mixer in plain PyTorch, over a flat batch of requests' chunks.

A step hands the mixer T tokens: request r's chunk is rows offsets[r] .. offsets[r]+counts[r]-1,
and its state (conv + SSM) as it was after the request's previous chunk (zeros for a
request that starts now). The mixer updates the states in place; the runner stores them.

Per token t of one request (H heads of P channels, N state size, G groups, K kernel)::

    z, xBC, dt_raw = in_proj(h_t)
    xBC_t  = silu(conv1d over the last K xBC inputs)     conv state: the last K-1 inputs
    x, B, C = split(xBC_t)                               B, C: [G, N], head h uses group h // (H/G)
    dt     = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)        [H]
    S      = exp(dt * A) * S + dt * x (outer) B          SSM state S: [H, P, N], A = -exp(A_log)
    y      = S @ C + D * x
    out    = out_proj(rmsnorm_per_group(y * silu(z)) * norm_w)

Decodes (one token per request) run that recurrence batched over requests. Longer
chunks run the SSD chunked scan from the request's saved state: within chunks of
`chunk_size` the recurrence is a masked matrix product, across chunks a short loop
carries the state. Both compute the same function (to float rounding), so where a
prefill is cut into chunks does not change the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.arch.mamba_config import GATE_ONLY, GATE_THEN_NORM, MambaMixerConfig
from hybridserve.models.arch.scan_chunks import chunk_layout
from hybridserve.models.arch.verify_steps import verify_token_by_token
from hybridserve.models.parallel import SharedNormGroups


class MambaStateIO(Protocol):
    """The runner's per-step access to each request's recurrent states (see mamba_states.py).

    A layer's state is a tuple of parts, in its MambaSpec's `shapes` order: (conv, SSM) for
    a Mamba2 or Mamba1 mixer, (conv, recurrent) for a Gated DeltaNet, (conv,) for a short
    convolution; every part is [R, *shape]."""

    counts: list[int]  # tokens of each request in the flat batch, in batch order
    # Requests whose chunk is a decode plus draft tokens: their state after every token
    # is kept (TokenStates), so the runner can commit the one at the accepted length.
    verify: list[int]

    # Prefill chunks that cross block boundaries with prefix caching on: request index ->
    # the token counts j (0 < j < its count) after which its state is kept (BoundaryStates).
    checkpoints: dict[int, list[int]]

    def read(self, layer_idx: int) -> list[torch.Tensor]:
        """Each state part of every request (Mamba2: conv [R, conv_dim, K-1], ssm [R, H, P, N]):
        fresh copies, zeros for requests that start this step."""
        ...

    def write(self, layer_idx: int, states: Sequence[torch.Tensor], token_states: TokenStates | None = None,
              boundary_states: BoundaryStates | None = None) -> None:
        """Store the state parts after this step (and the verify requests' per-token states,
        and the prefill chunks' states at the requested boundaries)."""
        ...


@dataclass
class TokenStates:
    """The states of verify requests after each token of their chunk::

        chunk   t0 (decode)  d1  d2  d3          (count 4: one token + 3 drafts)
        states  S[0]         S[1] S[2] S[3]      S[j]: after token j; S[count-1] = final

    If the first a drafts are accepted, the request continues from S[a].
    """

    reqs: list[int]  # request indices (into the step's requests)
    # Per state part [V, n, *shape], n = the longest verify chunk (Mamba2: conv, then SSM).
    states: tuple[torch.Tensor, ...]


# Request index -> its state parts after each of the J token counts MambaStateIO.checkpoints
# asked for, in that order, each [J, *shape] (Mamba2: conv, then SSM).
BoundaryStates = dict[int, tuple[torch.Tensor, ...]]


class Mamba2MixerWeights(nn.Module):
    """One mixer's parameters (our names; models/loaders/mamba_loader.py maps HF names onto them).

    Under tensor parallelism `cfg` is the rank's local mixer (its heads, its groups);
    row_bias=False leaves out out_proj's bias (rank 0 adds it for all), and `norm_share`
    completes the gated norm of groups that span ranks (models/parallel.py)."""

    def __init__(self, cfg: MambaMixerConfig, hidden_size: int, dtype: torch.dtype, row_bias: bool = True,
                 norm_share: SharedNormGroups | None = None) -> None:
        super().__init__()
        self.norm_share = norm_share

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.in_proj = p(cfg.in_proj_size, hidden_size)
        self.in_proj_bias = p(cfg.in_proj_size) if cfg.proj_bias else None
        self.conv_w = p(cfg.conv_dim, cfg.conv_kernel)
        self.conv_b = p(cfg.conv_dim) if cfg.conv_bias else None
        self.dt_bias = p(cfg.num_heads)
        # -exp(A_log), precomputed by the loader in float32 (as HF computes it each call):
        # rounding A to bf16 would change every decay.
        self.A = nn.Parameter(torch.zeros(cfg.num_heads, dtype=torch.float32), requires_grad=False)
        self.D = p(cfg.num_heads)
        self.norm = p(cfg.intermediate_size)
        self.out_proj = p(hidden_size, cfg.intermediate_size)
        self.out_proj_bias = p(hidden_size) if cfg.proj_bias and row_bias else None


def mamba2_mixer(w: Mamba2MixerWeights, cfg: MambaMixerConfig, h: torch.Tensor, conv_state: torch.Tensor,
                 ssm_state: torch.Tensor, counts: list[int], verify: Sequence[int] = (),
                 checkpoints: dict[int, list[int]] | None = None
                 ) -> tuple[torch.Tensor, TokenStates | None, BoundaryStates]:
    """h [T, hidden] (normed) -> ([T, hidden] (a partial sum under tensor parallelism, summed
    over ranks by the caller), the verify requests' TokenStates or None,
    the states at `checkpoints` of longer chunks); conv_state [R, conv_dim, K-1] and
    ssm_state [R, H, P, N] are advanced past each request's whole chunk, in place."""
    I, H, P = cfg.intermediate_size, cfg.num_heads, cfg.head_dim
    proj = F.linear(h, w.in_proj, w.in_proj_bias)
    z, xbc, dt = proj.split([I, cfg.conv_dim, H], dim=-1)
    T, R = h.shape[0], len(counts)
    token_states = None
    boundary_states: BoundaryStates = {}
    if T == R:  # a pure decode step: one recurrence step for every request at once
        y = _decode(w, cfg, xbc, dt, conv_state, ssm_state)
    else:
        y = h.new_empty(T, H, P, dtype=torch.float32)
        # Longer chunks one by one (each a scan of its own length); the one-token
        # requests of the step together, as a batched recurrence step.
        decodes: list[int] = []
        decode_rows: list[int] = []
        verify_set = set(verify)
        verify_rows: list[int] = []
        start = 0
        for r, c in enumerate(counts):
            if r in verify_set:
                verify_rows.append(start)
            elif c > 1:
                save_at = checkpoints.get(r, ()) if checkpoints else ()
                y[start : start + c], saved = _prefill(w, cfg, xbc[start : start + c], dt[start : start + c],
                                                       conv_state[r], ssm_state[r], save_at)
                if saved is not None:
                    boundary_states[r] = saved
            else:
                decodes.append(r)
                decode_rows.append(start)
            start += c
        if decodes:
            rows = torch.tensor(decode_rows, device=h.device)
            sel = torch.tensor(decodes, device=h.device)
            conv, ssm = conv_state[sel], ssm_state[sel]
            y[rows] = _decode(w, cfg, xbc[rows], dt[rows], conv, ssm)
            conv_state[sel] = conv
            ssm_state[sel] = ssm
        if verify:
            token_states = _verify(w, cfg, xbc, dt, conv_state, ssm_state, y, list(verify), verify_rows,
                                   [counts[r] for r in verify])
    out = F.linear(_gated_norm(y.reshape(T, I), z, w.norm, cfg, w.norm_share).to(h.dtype), w.out_proj,
                   w.out_proj_bias)
    return out, token_states, boundary_states


def _verify(w: Mamba2MixerWeights, cfg: MambaMixerConfig, xbc: torch.Tensor, dt: torch.Tensor,
            conv_state: torch.Tensor, ssm_state: torch.Tensor, y: torch.Tensor, reqs: list[int],
            rows: list[int], counts: list[int]) -> TokenStates:
    """Decode + drafts: the recurrence token by token (batched over the verify requests),
    writing y and keeping the state after every token; states end after the whole chunk."""
    def step(tok: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        return _decode(w, cfg, xbc[tok], dt[tok], conv, ssm)

    return TokenStates(reqs, verify_token_by_token(step, conv_state, ssm_state, y, reqs, rows, counts))


def _gated_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, cfg: MambaMixerConfig,
                share: SharedNormGroups | None = None) -> torch.Tensor:
    """The mixer's output before out_proj, as cfg.gate says: RMSNorm of y * silu(z) within each
    of the n_groups channel groups, times weight (HF's Mamba2: norm_before_gate=False); or
    the norm of y first, then the gate (Falcon-H1); or the gate alone (no norm).
    With `share`, this rank holds part of one group and the mean square is the group's."""
    gate = F.silu(z.float())
    if cfg.gate == GATE_ONLY:
        return (y * gate).to(weight.dtype)
    g = (y * gate if cfg.gate == GATE_THEN_NORM else y).view(y.shape[0], cfg.n_groups, -1)
    square = g.pow(2)
    mean_square = square.mean(-1, keepdim=True) if share is None else share.mean_square(square.sum(-1, keepdim=True))
    g = g * torch.rsqrt(mean_square + cfg.norm_eps)
    if cfg.gate == GATE_THEN_NORM:
        return weight * g.view(y.shape).to(weight.dtype)
    return ((weight * g.view(y.shape)) * gate).to(weight.dtype)


def _dt(dt: torch.Tensor, w: Mamba2MixerWeights, cfg: MambaMixerConfig) -> torch.Tensor:
    out = F.softplus(dt.float() + w.dt_bias.float())
    if cfg.dt_min > 0.0 or cfg.dt_max != float("inf"):
        out = out.clamp(cfg.dt_min, cfg.dt_max)
    return out


def _decode(w: Mamba2MixerWeights, cfg: MambaMixerConfig, xbc: torch.Tensor, dt: torch.Tensor,
            conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """One token per request: xbc [R, conv_dim], dt [R, H] -> y [R, H, P] (float32);
    conv_state [R, conv_dim, K-1] and ssm_state [R, H, P, N] advance one token in place."""
    R = xbc.shape[0]
    H, P, N, G = cfg.num_heads, cfg.head_dim, cfg.state_size, cfg.n_groups
    window = torch.cat((conv_state, xbc[:, :, None].to(conv_state.dtype)), dim=2)  # [R, conv_dim, K], oldest first
    conv_state.copy_(window[:, :, 1:])
    out = (window * w.conv_w).sum(-1)
    if w.conv_b is not None:
        out = out + w.conv_b
    x, B, C = F.silu(out).float().split([cfg.intermediate_size, G * N, G * N], dim=-1)
    x = x.view(R, H, P)
    B = B.view(R, G, 1, N).expand(R, G, H // G, N).reshape(R, H, N)
    C = C.view(R, G, 1, N).expand(R, G, H // G, N).reshape(R, H, N)
    dt = _dt(dt, w, cfg)  # [R, H]
    decay = torch.exp(dt * w.A.float())  # [R, H]
    dtx = (dt[:, :, None] * x)[..., None]  # [R, H, P, 1]
    if ssm_state.dtype == torch.float32:  # update in place: no temporary state, no copy back
        state = ssm_state.mul_(decay[:, :, None, None]).addcmul_(dtx, B[:, :, None, :])
    else:
        state = torch.addcmul(ssm_state.float() * decay[:, :, None, None], dtx, B[:, :, None, :])
        ssm_state.copy_(state)
    return torch.matmul(state, C[..., None]).squeeze(-1) + w.D.float()[:, None] * x


def _prefill(w: Mamba2MixerWeights, cfg: MambaMixerConfig, xbc: torch.Tensor, dt: torch.Tensor,
             conv_state: torch.Tensor, ssm_state: torch.Tensor, save_at: Sequence[int] = ()
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """One request's chunk of L tokens: xbc [L, conv_dim], dt [L, H] -> (y [L, H, P] float32,
    its (conv, SSM) states after each token count in save_at, or None if none asked);
    conv_state [conv_dim, K-1] and ssm_state [H, P, N] advance past the chunk in place."""
    L = xbc.shape[0]
    H, P, N, G = cfg.num_heads, cfg.head_dim, cfg.state_size, cfg.n_groups
    K1 = conv_state.shape[1]
    seq = torch.cat((conv_state, xbc.t().to(conv_state.dtype)), dim=1)  # [conv_dim, K-1+L]
    conv_state.copy_(seq[:, L:])  # the last K-1 inputs
    # Cross-correlation over K-1+L inputs with no padding: output t sees inputs t..t+K-1.
    out = F.conv1d(seq[None], w.conv_w[:, None, :], w.conv_b, groups=cfg.conv_dim)[0].t()  # [L, conv_dim]
    x, B, C = F.silu(out).float().split([cfg.intermediate_size, G * N, G * N], dim=-1)
    y, ssm_saved = ssd_scan(x.view(L, H, P), _dt(dt, w, cfg), w.A.float(), B.view(L, G, N), C.view(L, G, N),
                            ssm_state, cfg.chunk_size, save_at)
    y = y + w.D.float()[:, None] * x.view(L, H, P)
    if not save_at:
        return y, None
    # The conv state after j tokens is the K-1 inputs before input j: seq columns j .. j+K-2.
    conv_saved = torch.stack([seq[:, j : j + K1] for j in save_at])
    return y, (conv_saved, ssm_saved.to(ssm_state.dtype))


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., Q] -> [..., Q, Q]: out[l, s] = a[s+1] + ... + a[l] for s <= l, -inf for s > l.

    Summed as a cumulative sum of a masked copy, not as a difference of two prefix
    sums, which would cancel catastrophically for long chunks.
    """
    Q = a.shape[-1]
    ones = torch.ones(Q, Q, dtype=torch.bool, device=a.device)
    m = a[..., :, None].expand(*a.shape, Q).masked_fill(~ones.tril(-1), 0.0)  # [k, s] = a[k] if k > s
    return m.cumsum(dim=-2).masked_fill(~ones.tril(0), float("-inf"))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor, chunk_size: int, save_at: Sequence[int] = ()
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD chunked scan of one sequence, without the D skip term.

    x [L, H, P], dt [L, H], A [H], B/C [L, G, N], state [H, P, N] (the state before the
    sequence; overwritten with the state after it) -> (y [L, H, P], the states after
    each token count in save_at [J, H, P, N]). Float32 throughout.

    The sequence is padded with dt = 0 (no decay, no input) to whole chunks of Q::

        chunk c:   y_l = sum_{s<=l} (C_l . B_s) exp(a_{s+1..l}) dt_s x_s     (within the chunk)
                       + exp(a_{first..l}) C_l . S_c                         (state entering it)
                   S_{c+1} = exp(a_{whole chunk}) S_c + sum_s exp(a_{s+1..last}) dt_s x_s (outer) B_s

    States are only known between chunks: with save_at, chunk_layout (scan_chunks.py)
    shrinks Q and pads the front (dt = 0 there too) until every count is a chunk start.
    """
    L, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    layout = chunk_layout(L, chunk_size, save_at)
    Q, front, pad, nc = layout.size, layout.front, layout.back, layout.count
    rep = H // G
    Bh = B.repeat_interleave(rep, dim=1)  # [L, H, N]
    Ch = C.repeat_interleave(rep, dim=1)
    xdt = x * dt[..., None]
    a = dt * A  # [L, H], <= 0

    def chunks(t: torch.Tensor) -> torch.Tensor:
        if pad or front:
            t = torch.cat((t.new_zeros(front, *t.shape[1:]), t, t.new_zeros(pad, *t.shape[1:])))
        return t.view(nc, Q, *t.shape[1:])

    xdt, a, Bh, Ch = chunks(xdt), chunks(a), chunks(Bh), chunks(Ch)
    a_h = a.transpose(1, 2)  # [nc, H, Q]
    a_cum = a_h.cumsum(dim=-1)  # [nc, H, Q]
    decay_in = torch.exp(segment_sums(a_h))  # [nc, H, Q(l), Q(s)]
    scores = torch.einsum("clhn,cshn->chls", Ch, Bh) * decay_in
    y = torch.einsum("chls,cshp->clhp", scores, xdt)
    # Each chunk's own contribution to the state at its end, and its total decay.
    to_end = torch.exp(a_cum[:, :, -1:] - a_cum)  # [nc, H, Q]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", Bh, to_end, xdt)
    chunk_decay = torch.exp(a_cum[:, :, -1])  # [nc, H]
    entering = torch.empty(nc, H, P, N, dtype=torch.float32, device=x.device)
    s = state.float()
    for c in range(nc):  # a handful of chunks per prefill: a loop is cheaper than a matrix
        entering[c] = s
        s = s * chunk_decay[c][:, None, None] + chunk_states[c]
    state.copy_(s)
    y = y + torch.einsum("clhn,chpn->clhp", Ch, entering) * torch.exp(a_cum).transpose(1, 2)[..., None]
    saved = entering[[layout.chunk_of(j) for j in save_at]] if save_at else entering[:0]
    return y.reshape(nc * Q, H, P)[front : front + L], saved
