"""RMSNorm as the decoders compute it (in float32 for half-precision inputs, as HF does)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: torch.Tensor, inv_dim: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in 4 kernels.

    F.rms_norm is a 9-kernel composite on CPU; at decode sizes kernels are the cost.
    mean(x^2) is taken as ||x||^2 / d, which differs from HF's pow-mean by float rounding
    (about 1e-7 relative).
    """
    if x.dtype != torch.float32:  # half-precision models normalise in float32, as HF does
        w32 = None if weight is None else weight.float()
        return rms_norm(x.float(), w32, eps.float(), inv_dim).to(x.dtype)
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    out = x * torch.addcmul(eps, n, n, value=inv_dim).rsqrt_()
    return out if weight is None else out * weight
