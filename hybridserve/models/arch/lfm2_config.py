"""Config of LFM2 (Lfm2ForCausalLM): short gated convolution layers and GQA attention.

Pure Python (no torch): `kv_specs` derives each convolution layer's state shape from here
before any weights are loaded; `models/config.py` builds the `ModelConfig` around it
(imports run config.py -> here, never back).

Per short convolution layer, over D = hidden_size channels and a kernel of L = conv_L_cache::

    in_proj -> [ B (D) | C (D) | x (D) ]
    y = C * causal_conv(B * x)          conv state [D, L-1]: the last L-1 inputs B * x

so a request's state is one part, [D, L-1], whatever its length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.models.arch.layer_types import checked_layer_types

SHORT_CONV = "conv"  # layer type of a short convolution layer (HF's name in layer_types)
_ATTENTION = "full_attention"


@dataclass(frozen=True)
class ShortConvConfig:
    """One short convolution layer's shape (identical across a model's conv layers).
    Under tensor parallelism `channels` is the rank's share (models/parallel.py)."""

    channels: int  # D: hidden_size, cut by channel under tensor parallelism
    kernel: int  # L: conv_L_cache
    bias: bool = False  # in_proj, conv and out_proj biases (conv_bias)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...]]:
        """The conv state of one request in one layer: what a MambaSpec stores."""
        return ((self.channels, self.kernel - 1),)


def _positive_int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def parse_short_conv(raw: dict[str, Any], hidden: int) -> ShortConvConfig:
    kernel = _positive_int(raw, "conv_L_cache", 3)
    if kernel < 2:
        raise ConfigError(f"conv_L_cache must be >= 2 (a kernel of 1 keeps no state), got {kernel}")
    return ShortConvConfig(channels=hidden, kernel=kernel, bias=bool(raw.get("conv_bias", False)))


def lfm2_layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """`layer_types` ("conv" / "full_attention"), or derived from `full_attn_idxs` (HF's default
    when neither is given: every layer attention)."""
    given = raw.get("layer_types")
    if given is not None:
        return checked_layer_types(given, num_layers, (SHORT_CONV, _ATTENTION))
    idxs = raw.get("full_attn_idxs")
    attention = set(range(num_layers) if idxs is None else idxs)
    if any(not isinstance(i, int) or not 0 <= i < num_layers for i in attention):
        raise ConfigError(f"full_attn_idxs {sorted(attention)} out of range for {num_layers} layers")
    return tuple(_ATTENTION if i in attention else SHORT_CONV for i in range(num_layers))


def lfm2_intermediate_size(raw: dict[str, Any]) -> int:
    """The MLP width HF's Lfm2MLP builds: with block_auto_adjust_ff_dim, 2/3 of the given
    size, times block_ffn_dim_multiplier, rounded up to a multiple of block_multiple_of."""
    size = raw.get("intermediate_size", raw.get("block_ff_dim"))
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"config.json: intermediate_size must be a positive integer, got {size!r}")
    if not raw.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = _positive_int(raw, "block_multiple_of", 256)
        size = int(float(multiplier) * size)
        size = multiple * -(-size // multiple)
    if size < 1:
        raise ConfigError(f"the adjusted MLP width is {size}; check intermediate_size and block_ffn_dim_multiplier")
    return size
