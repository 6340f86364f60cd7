"""A depthwise causal convolution with a per-request state, over a flat batch of chunks.

Mamba1's and LFM2's layers both convolve each channel over its last K inputs, keeping the
last K-1 as the request's conv state. Every request of a step takes one path: its K-1
state columns and its chunk's inputs are laid end to end in `lane`, and each token reads
the K rows ending at its own input, so decodes, prefill chunks and verify chunks (decode +
drafts) are computed alike, and the state after any token count j of a chunk is the K-1
rows before input j::

    lane   [a0 a1 | u0 u1 u2 u3] [b0 b1 | v0]     K = 3: request 0's chunk of 4, request 1's of 1
    token u0 reads a0 a1 u0, u2 reads u0 u1 u2;   state after 2 tokens: u0 u1, after 4: u2 u3
"""

from __future__ import annotations

from typing import Sequence

import torch


class ConvLanes:
    """u [T, D] (the step's inputs, request after request) and conv_state [R, D, K-1] (each
    request's state before its chunk) laid end to end; counts: tokens per request."""

    def __init__(self, u: torch.Tensor, conv_state: torch.Tensor, counts: list[int]) -> None:
        dev = u.device
        R, D, K1 = conv_state.shape
        self.k1 = K1
        self.counts = torch.tensor(counts, device=dev)
        # Request r's rows: its K-1 state columns (oldest first), then its chunk's inputs.
        self.start = torch.cumsum(self.counts + K1, 0) - (self.counts + K1)  # [R]
        req_of_token = torch.repeat_interleave(torch.arange(R, device=dev), self.counts)
        first_token = torch.cumsum(self.counts, 0) - self.counts
        offset = torch.arange(u.shape[0], device=dev) - first_token[req_of_token]
        self.token_row = self.start[req_of_token] + K1 + offset  # [T]
        self.taps = torch.arange(K1, device=dev)
        self.lane = u.new_empty(u.shape[0] + R * K1, D)
        self.lane[(self.start[:, None] + self.taps).reshape(-1)] = conv_state.transpose(1, 2).reshape(R * K1, D)
        self.lane[self.token_row] = u

    def convolve(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """weight [D, K] (oldest input first) -> [T, D]: each token's K inputs times the taps."""
        K = weight.shape[1]
        windows = self.lane[self.token_row[:, None] - (K - 1) + torch.arange(K, device=weight.device)]  # [T, K, D]
        out = torch.einsum("tkd,dk->td", windows, weight.to(self.lane.dtype))
        return out if bias is None else out + bias

    def states_after(self, r: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Request r's state after j tokens of its chunk (r, j alike shaped) -> [..., D, K-1]."""
        return self.lane[(self.start[r] + j)[..., None] + self.taps].transpose(-1, -2)

    def final_states(self) -> torch.Tensor:
        """[R, D, K-1]: every request's state after its whole chunk."""
        return self.states_after(torch.arange(len(self.counts), device=self.lane.device), self.counts)

    def token_states(self, verify: Sequence[int]) -> torch.Tensor:
        """[V, n, D, K-1]: each verify request's state after each token (n its longest chunk;
        past a shorter chunk's end, its final state)."""
        dev = self.lane.device
        reqs = torch.tensor(list(verify), device=dev)
        counts = self.counts[reqs]
        after = torch.minimum(torch.arange(1, int(counts.max()) + 1, device=dev)[None, :], counts[:, None])
        return self.states_after(reqs[:, None].expand_as(after), after)

    def boundary_states(self, r: int, counts: list[int]) -> torch.Tensor:
        """[J, D, K-1]: request r's state after each of the token counts."""
        dev = self.lane.device
        return self.states_after(torch.full((len(counts),), r, device=dev), torch.tensor(counts, device=dev))
