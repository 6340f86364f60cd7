"""MXFP4 (OCP microscaling FP4) weights as gpt-oss checkpoints store them, turned into floats.

Layout of one matrix W [rows, cols] (each `cols` a multiple of 32), per the published
checkpoints (`<name>_blocks` uint8 [..., rows, cols / 32, 16] and `<name>_scales`
uint8 [..., rows, cols / 32]):

- a block is 32 consecutive values of a row, stored in 16 bytes; byte k of a block holds
  value 2k in its low nibble and value 2k + 1 in its high nibble;
- a nibble is an e2m1 number: bit 3 the sign, bits 0-2 index the magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6;
- a block's scale is an e8m0 number: the byte s means 2^(s - 127).

Dequantizing once at load gives the model its float weights (4x to 8x the packed bytes);
the values are exact in any float dtype with 8 exponent bits (float32, bfloat16) for the
exponents real checkpoints use, since each is a 2-bit mantissa times a power of two.
"""

from __future__ import annotations

import torch

from hybridserve.core.errors import ConfigError

# The eight e2m1 magnitudes, indexed by a nibble's low three bits.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 32  # values per scale
E8M0_BIAS = 127


def _e2m1_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 16 nibble values: codes 8-15 are the negated codes 0-7 (sign bit 3)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat((magnitudes, -magnitudes)).to(device=device, dtype=dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> values [..., G * 32] in `dtype`,
    in the stored row order (the caller transposes to the layout its matmuls read)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ConfigError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ConfigError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                          f"(expected blocks [..., G, {BLOCK // 2}] beside scales [..., G])")
    table = _e2m1_table(torch.float32, blocks.device)
    low = table[(blocks & 0x0F).long()]
    high = table[(blocks >> 4).long()]
    # Interleave: byte k -> values 2k (low nibble), 2k + 1 (high nibble).
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    # Scaling by a power of two is exact in float32 (ldexp), whatever the exponent's sign.
    exponents = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)
