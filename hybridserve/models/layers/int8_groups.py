"""Linears whose weight is int8 values times a float32 scale (plus an offset) per group of
`group_size` consecutive weights of a row: the form of a GGUF's Q8_0, Q5_0, Q6_K and Q4_K
blocks (models/loaders/gguf_groups.py), so the file's values are multiplied exactly.

`GroupWeights` holds one weight so; `make_group_linear` binds it to a (linear,
residual_linear) pair with make_int8_linear's contract. `group_linear_general` is the
general path: each block of rows expanded to float32 (the weight ggml's dequantizer gives)
and multiplied by the input's values in float32, the output rounded once to its dtype.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hybridserve.core.errors import ConfigError

Linear = Callable[[torch.Tensor], torch.Tensor]
ResidualLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Rows of the weight the general path expands at a time: a few MB of float32 at the
# decoder's widths, never a whole second copy of the weight.
_EXPAND_ROWS = 512


class GroupWeights(NamedTuple):
    """A weight [out, in] as int8 `values` times float32 `scale` [out, in / group_size] per
    group, plus float32 `offset` (scale's shape) where the format has one, else None."""

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int

    @classmethod
    def from_numpy(cls, values: np.ndarray, scale: np.ndarray, offset: np.ndarray | None,
                   group_size: int) -> GroupWeights:
        """From numpy arrays (gguf_groups.Int8Groups' fields), checked."""
        groups = cls(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int8)),
                     torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
                     None if offset is None else torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32)),
                     group_size)
        groups.check()
        return groups

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def check(self) -> None:
        """ConfigError unless the fields fit together."""
        if self.values.dtype != torch.int8 or self.values.dim() != 2:
            raise ConfigError(f"group values must be 2-D int8, got {self.values.dtype} {tuple(self.values.shape)}")
        rows, cols = self.values.shape
        if self.group_size <= 0 or cols % self.group_size:
            raise ConfigError(f"rows of {cols} weights are not whole groups of {self.group_size}")
        expected = (rows, cols // self.group_size)
        for name, part in (("scale", self.scale), ("offset", self.offset)):
            if part is not None and (part.dtype != torch.float32 or tuple(part.shape) != expected):
                raise ConfigError(f"group {name} must be float32 {expected}, got {part.dtype} {tuple(part.shape)}")

    def weight(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight of `rows` (each value times its scale, plus the offset)."""
        values = self.values[rows]
        grouped = values.float().view(values.shape[0], -1, self.group_size) * self.scale[rows, :, None]
        if self.offset is not None:
            grouped += self.offset[rows, :, None]
        return grouped.view(values.shape)

    def regrouped(self, group_size: int) -> GroupWeights:
        """The same weight in groups of `group_size`, which divides this one's: each group's
        scale (and offset) repeated over its parts."""
        if group_size == self.group_size:
            return self
        if group_size <= 0 or self.group_size % group_size:
            raise ConfigError(f"groups of {self.group_size} cannot be split into groups of {group_size}")
        times = self.group_size // group_size
        offset = None if self.offset is None else self.offset.repeat_interleave(times, dim=1)
        return GroupWeights(self.values, self.scale.repeat_interleave(times, dim=1), offset, group_size)


def concat_rows(parts: Sequence[GroupWeights]) -> GroupWeights:
    """The parts' rows stacked (q, k, v into one qkv): groups of the smallest size, offsets
    zero where a part has none."""
    if not parts:
        raise ConfigError("no group weights to stack")
    size = min(p.group_size for p in parts)
    parts = [p.regrouped(size) for p in parts]
    if len({p.values.shape[1] for p in parts}) != 1:
        raise ConfigError(f"stacked group weights differ in width: {[p.values.shape[1] for p in parts]}")
    offset = None
    if any(p.offset is not None for p in parts):
        offset = torch.cat([torch.zeros_like(p.scale) if p.offset is None else p.offset for p in parts])
    return GroupWeights(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), offset, size)


def group_linear_general(x: torch.Tensor, groups: GroupWeights, bias: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] times the groups' weight, + bias, + residual [rows, out], in float32,
    rounded once to x's dtype."""
    x32 = x.float()
    out = torch.empty(x.shape[0], groups.values.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, groups.values.shape[0], _EXPAND_ROWS):
        rows = slice(start, start + _EXPAND_ROWS)
        out[:, rows] = F.linear(x32, groups.weight(rows))
    if bias is not None:
        out += bias.float()
    if residual is not None:
        out += residual.float()
    return out.to(x.dtype)


def make_group_linear(groups: GroupWeights, bias: torch.Tensor | None) -> tuple[Linear, ResidualLinear]:
    """(linear, residual_linear) for a group weight: inputs and outputs in the activations'
    dtype (bf16 or float32), products and sums in float32."""
    groups.check()
    bias32 = None if bias is None else bias.detach().float()

    def linear(x: torch.Tensor) -> torch.Tensor:
        return group_linear_general(x, groups, bias32)

    def residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return group_linear_general(x, groups, bias32, h)

    return linear, residual
