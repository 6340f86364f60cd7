"""Config of Jamba (JambaForCausalLM): Mamba1 mixers, attention without RoPE, MoE on some layers.

Pure Python (no torch): `kv_specs` derives each Mamba1 layer's state shapes from here before
any weights are loaded; `models/config.py` builds the `ModelConfig` around it (imports run
config.py -> here, never back).

Per Mamba1 mixer, over I = mamba_expand * hidden channels, N state size, kernel K, dt rank R::

    in_proj -> [ x (I) | gate (I) ]
    x_proj(silu(conv(x))) -> [ dt (R) | B (N) | C (N) ], each RMS-normed (Jamba's own norms)
    conv state  [I, K-1]    the last K-1 inputs x
    SSM state   [I, N]      one N-vector per channel (Mamba2 shares one per head)

Layer i is attention when i % attn_layer_period == attn_layer_offset, a Mamba1 mixer
otherwise; its MLP is a mixture of num_experts (top num_experts_per_tok, the softmax
weights of the chosen ones not renormalised) when i % expert_layer_period ==
expert_layer_offset, a dense SwiGLU otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hybridserve.core.errors import ConfigError

MAMBA1 = "mamba1"  # layer type of a Mamba1 mixer layer
_ATTENTION = "full_attention"


@dataclass(frozen=True)
class Mamba1MixerConfig:
    """One Mamba1 mixer's shape (identical across a model's Mamba1 layers). Under tensor
    parallelism `intermediate_size` is the rank's channels (models/parallel.py)."""

    intermediate_size: int  # I
    state_size: int  # N
    conv_kernel: int  # K
    dt_rank: int  # R
    norm_eps: float  # the dt / B / C RMSNorms' epsilon (the model's rms_norm_eps)
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj / out_proj

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, SSM state) of one request in one layer: what a MambaSpec stores."""
        return (self.intermediate_size, self.conv_kernel - 1), (self.intermediate_size, self.state_size)


@dataclass(frozen=True)
class JambaOptions:
    """What Jamba adds to ModelConfig: its mixer and which layers route over experts."""

    mixer: Mamba1MixerConfig
    expert_layers: frozenset[int]
    num_experts: int
    top_k: int


def _positive_int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _periodic(raw: dict[str, Any], period_key: str, offset_key: str, defaults: tuple[int, int],
              num_layers: int) -> frozenset[int]:
    period = _positive_int(raw, period_key, defaults[0])
    offset = raw.get(offset_key, defaults[1])
    if not isinstance(offset, int) or not 0 <= offset < period:
        raise ConfigError(f"{offset_key} must be in [0, {period_key}={period}), got {offset!r}")
    return frozenset(i for i in range(num_layers) if i % period == offset)


def jamba_layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    attention = _periodic(raw, "attn_layer_period", "attn_layer_offset", (8, 4), num_layers)
    return tuple(_ATTENTION if i in attention else MAMBA1 for i in range(num_layers))


def parse_jamba_options(raw: dict[str, Any], hidden: int, num_layers: int) -> JambaOptions:
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"unsupported hidden_act {act!r} for Jamba (silu only)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError("attention_bias / mlp_bias are not supported for Jamba")
    dt_rank = raw.get("mamba_dt_rank", "auto")
    mixer = Mamba1MixerConfig(
        intermediate_size=_positive_int(raw, "mamba_expand", 2) * hidden,
        state_size=_positive_int(raw, "mamba_d_state", 16), conv_kernel=_positive_int(raw, "mamba_d_conv", 4),
        dt_rank=math.ceil(hidden / 16) if dt_rank == "auto" else _positive_int(raw, "mamba_dt_rank", 1),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)), conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
    )
    if mixer.conv_kernel < 2:
        raise ConfigError(f"mamba_d_conv must be >= 2, got {mixer.conv_kernel}")
    num_experts = _positive_int(raw, "num_experts", raw.get("num_local_experts", 16))
    top_k = _positive_int(raw, "num_experts_per_tok", 2)
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok {top_k} exceeds num_experts {num_experts}")
    experts = _periodic(raw, "expert_layer_period", "expert_layer_offset", (2, 1), num_layers)
    return JambaOptions(mixer=mixer, expert_layers=experts if num_experts > 1 else frozenset(),
                        num_experts=num_experts, top_k=top_k)
