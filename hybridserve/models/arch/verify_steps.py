"""A recurrent mixer's verify chunks (a decode plus drafts), token by token: what both the
Mamba2 mixer and the Gated DeltaNet run for speculative decoding.

Each verify request's chunk is its rows rows[v] .. rows[v]+counts[v]-1 of the step. Step j
advances every request with more than j tokens by one token, batched over them, and keeps
the states after it (S[j] after token j, S[count-1] the final state: mamba2.TokenStates).
"""

from __future__ import annotations

from typing import Callable

import torch

# step(token_rows, conv, state) -> the outputs of those rows; conv [A, ...] and state [A, ...]
# (the requests advancing) move one token in place.
OneToken = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def verify_token_by_token(step: OneToken, conv_state: torch.Tensor, state: torch.Tensor, y: torch.Tensor,
                          reqs: list[int], rows: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes y's rows of the verify chunks and returns each request's states after each of its
    tokens (conv [V, n, ...], state [V, n, ...]); conv_state / state [R, ...] end after each
    whole chunk."""
    n = max(counts)
    device = y.device
    sel = torch.tensor(reqs, device=device)
    conv, st = conv_state[sel], state[sel]
    conv_steps = conv.new_empty(len(reqs), n, *conv.shape[1:])
    steps = st.new_empty(len(reqs), n, *st.shape[1:])
    for j in range(n):
        act = [v for v, c in enumerate(counts) if c > j]
        tok = torch.tensor([rows[v] + j for v in act], device=device)
        if len(act) == len(reqs):
            y[tok] = step(tok, conv, st)
            conv_steps[:, j], steps[:, j] = conv, st
        else:  # shorter chunks are done: advance only the others
            a = torch.tensor(act, device=device)
            c_a, s_a = conv[a], st[a]
            y[tok] = step(tok, c_a, s_a)
            conv[a], st[a] = c_a, s_a
            conv_steps[a, j], steps[a, j] = c_a, s_a
    conv_state[sel] = conv
    state[sel] = st
    return conv_steps, steps
