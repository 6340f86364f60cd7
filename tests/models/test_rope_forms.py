"""rope: the out-of-place rotation (what the compiled chains trace) equals HF's
rotate_half form and the in-place one (models/layers/rope.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.config import RopeConfig  # noqa: E402
from hybridserve.models.layers.rope import RopeTable, apply_rope, apply_rope_  # noqa: E402


def test_apply_rope_is_the_rotate_half_rotation() -> None:
    dim = 8
    table = RopeTable(RopeConfig(theta=10000.0), dim, 32, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, dim, generator=g)
    cos, sin = table.lookup(torch.tensor([0, 1, 7, 20, 31]), 31)
    got = apply_rope(x, cos, sin)
    # HF: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], with the unsigned sin.
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    unsigned_sin = sin[..., dim // 2 :].repeat(1, 1, 2)
    want = x * cos + torch.cat((-x2, x1), dim=-1) * unsigned_sin
    assert torch.equal(got, want)
    in_place = x.clone()
    apply_rope_(in_place, cos, sin)
    assert torch.allclose(in_place, got, rtol=1e-6, atol=1e-6)
