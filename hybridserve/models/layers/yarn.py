"""YaRN rotary scaling (rope_type "yarn"): inverse frequencies and the cos/sin scale.

Per the YaRN paper, as HF computes it: each of the head_dim / 2 frequencies is a blend of
the original one (kept: high frequencies, many rotations within the original context)
and the one divided by `factor` (interpolated: low frequencies). The blend weight ramps
linearly over the dimension band [low, high] found from beta_fast and beta_slow rotations
within original_max_position_embeddings (floored / ceiled when `truncate`). cos and sin
are then multiplied by the attention factor, 0.1 * ln(factor) + 1 unless given.
"""

from __future__ import annotations

import math

import torch

from hybridserve.models.config import RopeConfig


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The dimension index whose wavelength fits `rotations` times into max_positions."""
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _mscale(rope.factor, rope.mscale) / _mscale(rope.factor, rope.mscale_all_dim)
    return _mscale(rope.factor)


def yarn_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32."""
    original = rope.original_max_position_embeddings
    low = _correction_dim(rope.beta_fast, head_dim, rope.theta, original)
    high = _correction_dim(rope.beta_slow, head_dim, rope.theta, original)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a band of width zero would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelength_base = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated = 1.0 / wavelength_base
    interpolated = 1.0 / (rope.factor * wavelength_base)
    # ramp 0 (high frequencies) keeps the original frequency, ramp 1 takes the divided one.
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep
