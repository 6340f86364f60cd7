"""The Mamba2 mixer as llama.cpp's converter writes it, for any GGUF spec whose layers hold one
(pure `mamba2`, `granitehybrid`, `nemotron_h`; Falcon-H1's mixer is the same tensors).

Tensors of a mixer layer (H heads, G groups, D = H * head_dim, C = D + 2 * G * state; numpy
order), against HF's `<mixer>.*` inside model.layers.N.:
- `ssm_in.weight` [2D + 2GN + H, hidden], `ssm_out.weight` [hidden, D] (and their biases when
  the model has them): HF's in_proj / out_proj as they are;
- `ssm_conv1d.weight` [C, K]: HF's conv1d.weight [C, 1, K] with its middle axis squeezed out;
  `ssm_conv1d.bias` [C] as it is;
- `ssm_dt.bias` [H]: HF's `dt_bias` (the converter renames it `dt_proj.bias` first);
- `ssm_a` [H, 1] (no `.weight` suffix): -exp(A_log), so A_log = log(-a);
- `ssm_d` [H, 1] (no suffix): HF's D, unsqueezed;
- `ssm_norm.weight` [G, D / G]: the gated RMSNorm's weight, one row per group.

Sizes come from the `ssm.*` keys llama.cpp's runtime reads: conv_kernel, inner_size (D),
state_size, time_step_rank (which for Mamba2 holds H, not a rank) and group_count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_layer_arrays import block_stems
from hybridserve.models.loaders.gguf_spec import BlockMerge, a_log_from_a, renamed, required, reshaped, unsqueezed_conv


def mamba2_block_names(mixer: str) -> dict[str, str]:
    """GGUF stems copied unchanged into the mixer `mixer` (HF's module name inside a layer)."""
    return {"ssm_in": f"{mixer}.in_proj", "ssm_out": f"{mixer}.out_proj", "ssm_conv1d": f"{mixer}.conv1d"}


def mamba2_merges(mixer: str) -> tuple[BlockMerge, ...]:
    """The mixer tensors whose layout or value llama.cpp changed, rebuilt as HF's."""
    return (
        unsqueezed_conv(f"{mixer}.conv1d.weight", "ssm_conv1d.weight"),
        renamed(f"{mixer}.dt_bias", "ssm_dt.bias"),
        reshaped(f"{mixer}.A_log", "ssm_a", hf_shape=lambda a: (a[0],), values=a_log_from_a),
        reshaped(f"{mixer}.D", "ssm_d", hf_shape=lambda d: (d[0],)),
        reshaped(f"{mixer}.norm.weight", "ssm_norm.weight", hf_shape=lambda n: (int(np.prod(n)),)),
    )


@dataclass(frozen=True)
class Mamba2Sizes:
    """One file's mixer sizes; `conv_bias` and `proj_bias` say whether its layers carry those biases."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim


def mamba2_sizes(header: GGUFHeader) -> Mamba2Sizes:
    """The mixer sizes from the `ssm.*` keys; ConfigError naming a missing key or sizes that
    do not split into whole heads and groups."""
    inner = int(required(header, "ssm.inner_size"))
    heads = int(required(header, "ssm.time_step_rank"))
    groups = int(required(header, "ssm.group_count"))
    if heads < 1 or inner % heads:
        raise ConfigError(f"{header.path}: ssm.inner_size {inner} does not split into {heads} heads "
                          f"(ssm.time_step_rank)")
    if groups < 1 or heads % groups:
        raise ConfigError(f"{header.path}: {heads} SSM heads do not split into {groups} groups (ssm.group_count)")
    names = block_stems(header)
    return Mamba2Sizes(
        num_heads=heads, head_dim=inner // heads, state_size=int(required(header, "ssm.state_size")),
        n_groups=groups, conv_kernel=int(required(header, "ssm.conv_kernel")),
        conv_bias="ssm_conv1d.bias" in names, proj_bias="ssm_in.bias" in names,
    )


def mamba2_expand(header: GGUFHeader, sizes: Mamba2Sizes, hidden: int) -> int:
    """HF's `expand` (inner size / hidden size), for the configs that size the mixer by it."""
    if sizes.inner_size % hidden:
        raise ConfigError(f"{header.path}: SSM inner size {sizes.inner_size} is not a multiple of the "
                          f"hidden size {hidden}")
    return sizes.inner_size // hidden
