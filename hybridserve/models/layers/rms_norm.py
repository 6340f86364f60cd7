"""RMSNorm as the decoders compute it (in float32 for half-precision inputs, as HF does)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: torch.Tensor, inv_dim: float, *,
             exact_sums: bool = False) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in 4 kernels (float32 x).

    F.rms_norm is a 9-kernel composite on CPU; at decode sizes kernels are the cost.
    mean(x^2) is taken as ||x||^2 / d, which differs from HF's pow-mean by float rounding
    (about 1e-7 relative). A half-precision x is normalised in float32, as HF does, and
    rounded back to its dtype. With `exact_sums` the squares are summed in float64, where
    each square of a float32 is exact, so the sum rounds to the same float32 in whatever
    order it is taken (but for a difference of 2^-29 of a unit): a compiled graph
    (models/arch/decoder_chains.py) then normalises exactly as this eager code does, where
    float32 sums in its own order differed in a last bit once in 10^6 values, enough to
    change greedy tokens. It costs decode-sized steps a few microseconds a norm, so only
    the steps that may run compiled ask for it.
    """
    if x.dtype != torch.float32:  # half precision: normalised in float32, as HF does
        w32 = None if weight is None else weight.float()
        return rms_norm(x.float(), w32, eps.float(), inv_dim, exact_sums=exact_sums).to(x.dtype)
    if exact_sums:
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float64)
        out = x * torch.addcmul(eps.double(), n, n, value=inv_dim).float().rsqrt_()
    else:
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        out = x * torch.addcmul(eps, n, n, value=inv_dim).rsqrt_()
    return out if weight is None else out * weight
