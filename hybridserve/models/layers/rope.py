"""Rotary position embeddings: inverse frequencies per RoPE type and a cos/sin table.

Layout is the NeoX half split HF uses (`rotate_half`): for x = [x1, x2] (halves of the
head dim), rope(x) = [x1*cos - x2*sin, x2*cos + x1*sin] with one angle per half-dim pair.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from hybridserve.models.config import RopeConfig
from hybridserve.models.layers.yarn import yarn_attention_factor, yarn_inverse_frequencies


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, scaled as `rope.rope_type` defines."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return yarn_inverse_frequencies(rope, head_dim)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between them
    # interpolated linearly in 1/wavelength (Llama 3.1's published recipe).
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


@cache
def _settle_cos_sin() -> None:
    """Call cos and sin once on one element before any table: the first call of each in a
    process, when it is a large multi-threaded one, has given other last bits than every
    later call in some processes (a RoPE table differing from process to process, and with
    it the int8 head's smoothing and the logits: benchmarks/results/batch_invariant.md).
    A first call too small to run on several threads leaves the later ones alike."""
    one = torch.zeros(1)
    one.cos()
    one.sin()


class RopeTable:
    """cos and signed sin for positions 0..P-1, grown on demand; [P, head_dim] each.

    Angles are computed in float32 exactly as HF does (position * inv_freq, then cos/sin),
    so a position's embedding does not depend on the batch it is computed in. Storing
    sin as [-sin, sin] turns HF's rotate_half into a roll: rope(x) = x*cos + roll(x)*sin'.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim)
        self.scale = yarn_attention_factor(rope) if rope.rope_type == "yarn" else 1.0  # of cos and sin
        self.device = device
        self.dtype = dtype
        self.cos = torch.empty(0, head_dim, device=device, dtype=dtype)
        self.sin = torch.empty(0, head_dim, device=device, dtype=dtype)
        self._grow(max(1, max_positions))

    def _grow(self, size: int) -> None:
        _settle_cos_sin()
        angles = torch.arange(size, dtype=torch.int64).float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        self.cos = torch.cat((cos, cos), dim=-1).to(self.device, self.dtype)
        self.sin = torch.cat((-sin, sin), dim=-1).to(self.device, self.dtype)

    def set_dtype(self, dtype: torch.dtype) -> None:
        """Store the tables in `dtype` from now on (recomputed from the float32 angles)."""
        self.dtype = dtype
        self._grow(self.cos.shape[0])

    def ensure(self, max_position: int) -> None:
        """Grow the tables (doubling) until they hold position `max_position`."""
        if max_position >= self.cos.shape[0]:
            self._grow(max(2 * self.cos.shape[0], max_position + 1))

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for `positions` ([T] long, on the table's device), each [T, 1, head_dim]."""
        self.ensure(max_position)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _halves_swapped(x: torch.Tensor) -> torch.Tensor:
    """x rolled by half its last dim ([x2, x1]), spelled as a concatenation of the two
    halves (the same values): inductor loads each half as contiguous vectors, where a
    roll's wrapped index made it gather element by element."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope_'s rotation out of place (what a traced graph can hold): a new tensor."""
    return x * cos + _halves_swapped(x) * sin


def apply_rope_rounded(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope out of place with apply_rope_'s roundings in a half-precision x: x * cos
    in x's dtype, then addcmul's sum with rolled * sin taken in float32 and rounded once
    (a compiled graph that emulates eager's casts then rounds as apply_rope_ does)."""
    return ((x * cos).float() + _halves_swapped(x).float() * sin.float()).to(x.dtype)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: x [T, heads, head_dim] (may be a strided view); cos/sin from RopeTable.lookup."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1)  # [x2, x1]; times [-sin, sin] = rotate_half(x) * sin
    x.mul_(cos).addcmul_(rolled, sin)
