"""models/layers/rms_norm.rms_norm scales in place only tensors it made itself: the input is
never changed, and the result is the allocating formula's bit for bit (x * rsqrt(||x||^2 / d
+ eps) * weight, in float32 for half-precision inputs, rounded once at the end)."""

from __future__ import annotations

import pytest
import torch

from hybridserve.models.layers.rms_norm import rms_norm


def _reference(x: torch.Tensor, weight: torch.Tensor | None, eps: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    n = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
    out = x32 * torch.addcmul(eps.float(), n, n, value=1.0 / x.shape[-1]).rsqrt_()
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_leaves_its_input_and_matches_the_allocating_formula(dtype: torch.dtype, with_weight: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 3, 64, generator=gen) * 3).to(dtype)
    weight = (1 + torch.randn(64, generator=gen)).to(dtype) if with_weight else None
    eps = torch.tensor(1e-6, dtype=dtype)
    before = x.clone()
    out = rms_norm(x, weight, eps, 1.0 / 64)
    assert torch.equal(x, before)  # the input was not scaled in place
    assert out.dtype == dtype and torch.equal(out, _reference(x, weight, eps))
