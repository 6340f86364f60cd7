"""A small MXFP4 packer for tests: random e2m1 codes and e8m0 exponents packed into the
checkpoint layout (blocks [..., G, 16], scales [..., G]), and the float values they stand
for, computed from the format's definition here rather than by the loader's unpacking.
"""

from __future__ import annotations

import torch

# e2m1: sign bit 3; bits 0-2 index these magnitudes.
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def random_codes(shape: tuple[int, ...], generator: torch.Generator, exponents: tuple[int, int] = (-3, 1)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., G, 32] in 0..15, exponents [..., G]) for a matrix of `shape` [..., cols]."""
    *lead, cols = shape
    groups = cols // 32
    codes = torch.randint(0, 16, (*lead, groups, 32), generator=generator)
    exps = torch.randint(exponents[0], exponents[1] + 1, (*lead, groups), generator=generator)
    return codes, exps


def pack(codes: torch.Tensor, exps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte k of a block: value 2k in the low nibble, 2k + 1 in the high; scale byte e + 127."""
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exps + 127).to(torch.uint8)


def values(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """The floats [..., G * 32]: (-1)^sign * magnitude * 2^exponent, element by element."""
    flat = [(-1.0 if c & 8 else 1.0) * MAGNITUDES[c & 7] for c in codes.reshape(-1).tolist()]
    mags = torch.tensor(flat, dtype=torch.float64).reshape(codes.shape)
    scaled = mags * torch.pow(2.0, exps.to(torch.float64)).unsqueeze(-1)
    return scaled.flatten(-2).to(torch.float32)
