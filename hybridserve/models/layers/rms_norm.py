"""RMSNorm as the decoders compute it (in float32 for half-precision inputs, as HF does)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: torch.Tensor, inv_dim: float, *,
             exact_sums: bool = False) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in 4 kernels.

    F.rms_norm is a 9-kernel composite on CPU; at decode sizes kernels are the cost.
    mean(x^2) is taken as ||x||^2 / d, which differs from HF's pow-mean by float rounding
    (about 1e-7 relative). The scaling and the weight are applied in place on tensors made
    here (a half-precision input's float32 copy, or the scaled product), never on `x`: a
    1024-token prefill's RMSNorms then allocate one float32 [T, hidden] each instead of
    three, which the heap keeps resident (benchmarks/results/memory_peak.md).

    With `exact_sums` the squares are summed in float64, where each square of a float32 is
    exact, so the sum rounds to the same float32 in whatever order it is taken (but for a
    difference of 2^-29 of a unit): a compiled graph (models/arch/decoder_chains.py) then
    normalises exactly as this eager code does, where float32 sums in its own order
    differed in a last bit once in 10^6 values, enough to change greedy tokens. It costs
    decode-sized steps a few microseconds a norm, so only the steps that may run compiled
    ask for it.
    """
    if x.dtype != torch.float32:  # half-precision models normalise in float32, as HF does
        x32 = x.float()
        scaled = x32.mul_(_inverse_rms(x32, eps.float(), inv_dim, exact_sums))  # x32 is our own copy
        return (scaled if weight is None else scaled.mul_(weight.float())).to(x.dtype)
    out = x * _inverse_rms(x, eps, inv_dim, exact_sums)
    return out if weight is None else out.mul_(weight)


def _inverse_rms(x: torch.Tensor, eps: torch.Tensor, inv_dim: float, exact_sums: bool) -> torch.Tensor:
    if exact_sums:
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float64)
        return torch.addcmul(eps.double(), n, n, value=inv_dim).float().rsqrt_()
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return torch.addcmul(eps, n, n, value=inv_dim).rsqrt_()
