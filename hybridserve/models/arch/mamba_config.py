"""Configs of the state-space models: Mamba2 (every layer a Mamba2 mixer) and Bamba
(Mamba2 mixers with a few attention layers, a SwiGLU MLP after every mixer).

Pure Python (no torch): `kv_specs` derives each Mamba layer's state shapes from here
before any weights are loaded. This module parses the mixer; `models/config.py` builds the
`ModelConfig` around it (imports run config.py -> here, never back). Fields that change the
numbers and that we do not implement raise ConfigError naming the field, as in `models/config.py`.

Per Mamba2 mixer, with H heads of P channels, G groups, N state size, kernel K::

    in_proj -> [ z (H*P) | xBC (H*P + 2*G*N) | dt (H) ]
    conv state   [conv_dim, K-1]   the last K-1 xBC inputs (conv_dim = H*P + 2*G*N)
    SSM state    [H, P, N]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hybridserve.core.errors import ConfigError

MAMBA = "mamba"  # layer type of a Mamba2 mixer layer (HF calls it "linear_attention")
# Where the gate silu(z) meets the mixer's output y (per channel group, with the norm weight):
GATE_THEN_NORM = "gate_then_norm"  # rmsnorm(y * silu(z)) * w: Mamba2, Bamba, Granite 4.0-H, Nemotron-H
NORM_THEN_GATE = "norm_then_gate"  # rmsnorm(y) * w * silu(z): Falcon-H1 with mamba_norm_before_gate
GATE_ONLY = "gate_only"  # y * silu(z), no norm: Falcon-H1 without mamba_rms_norm


@dataclass(frozen=True)
class MambaMixerConfig:
    """One Mamba2 mixer's shape and numerics (identical across a model's Mamba layers)."""

    num_heads: int  # H
    head_dim: int  # P
    state_size: int  # N
    n_groups: int  # G: B and C are shared by H // G heads each
    conv_kernel: int  # K
    chunk_size: int  # SSD chunk length of the prefill scan
    norm_eps: float  # gated RMSNorm epsilon
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj / out_proj
    dt_min: float = 0.0  # time_step_limit: dt is clamped to [dt_min, dt_max] after softplus
    dt_max: float = math.inf
    gate: str = GATE_THEN_NORM

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, SSM state) of one request in one layer: what a MambaSpec stores."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size)


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _float(value: Any) -> float:
    # transformers 5 writes non-finite floats as {"__float__": "Infinity"}; older
    # versions as a bare Infinity (which json reads as inf).
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def _time_step_limit(raw: dict[str, Any]) -> tuple[float, float]:
    limit = raw.get("time_step_limit") or (0.0, math.inf)
    try:
        lo, hi = (_float(v) for v in limit)
    except (TypeError, ValueError):
        raise ConfigError(f"time_step_limit must be [min, max], got {limit!r}") from None
    if not lo <= hi:
        raise ConfigError(f"time_step_limit must be [min, max], got {limit!r}")
    return lo, hi


def _check_common(raw: dict[str, Any], mixer: MambaMixerConfig, hidden: int, expand: int) -> None:
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"unsupported hidden_act {act!r} for a Mamba2 mixer (silu only)")
    if mixer.num_heads % mixer.n_groups:
        raise ConfigError(f"mamba heads {mixer.num_heads} are not a multiple of n_groups {mixer.n_groups}")
    if hidden * expand != mixer.intermediate_size:
        raise ConfigError(f"hidden_size * expand = {hidden * expand} differs from heads * head_dim = "
                          f"{mixer.intermediate_size}")
    if mixer.conv_kernel < 2:
        raise ConfigError(f"conv kernel must be >= 2, got {mixer.conv_kernel}")


def parse_mamba2_mixer(raw: dict[str, Any]) -> MambaMixerConfig:
    """The mixer of a Mamba2ForCausalLM config.json (every layer is one)."""
    lo, hi = _time_step_limit(raw)
    mixer = MambaMixerConfig(
        num_heads=_int(raw, "num_heads"), head_dim=_int(raw, "head_dim"), state_size=_int(raw, "state_size"),
        n_groups=_int(raw, "n_groups", 1), conv_kernel=_int(raw, "conv_kernel", 4),
        chunk_size=_int(raw, "chunk_size", 256), norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        conv_bias=bool(raw.get("use_conv_bias", True)), proj_bias=bool(raw.get("use_bias", False)),
        dt_min=lo, dt_max=hi,
    )
    _check_common(raw, mixer, _int(raw, "hidden_size"), _int(raw, "expand", 2))
    return mixer


def parse_bamba_mixer(raw: dict[str, Any]) -> MambaMixerConfig:
    """The mixer of a BambaForCausalLM config.json (its `mamba_*` fields; norm_eps is the model's)."""
    hidden = _int(raw, "hidden_size")
    n_heads = _int(raw, "mamba_n_heads", 128)
    expand = _int(raw, "mamba_expand", 2)
    d_head = raw.get("mamba_d_head", "auto")
    lo, hi = _time_step_limit(raw)
    mixer = MambaMixerConfig(
        num_heads=n_heads, head_dim=expand * hidden // n_heads if d_head in (None, "auto") else _int(raw, "mamba_d_head"),
        state_size=_int(raw, "mamba_d_state", 256), n_groups=_int(raw, "mamba_n_groups", 1),
        conv_kernel=_int(raw, "mamba_d_conv", 4), chunk_size=_int(raw, "mamba_chunk_size", 256),
        norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        conv_bias=bool(raw.get("mamba_conv_bias", True)), proj_bias=bool(raw.get("mamba_proj_bias", False)),
        dt_min=lo, dt_max=hi,
    )
    _check_common(raw, mixer, hidden, expand)
    return mixer


def parse_nemotron_h_mixer(raw: dict[str, Any]) -> MambaMixerConfig:
    """The mixer of a NemotronHForCausalLM config.json: its own field names, the gated norm's
    epsilon the model's layer_norm_epsilon, and H * P free of hidden_size * expand (HF sizes
    the mixer by heads alone)."""
    act = raw.get("mamba_hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"unsupported mamba_hidden_act {act!r} for a Mamba2 mixer (silu only)")
    lo, hi = _time_step_limit(raw)
    mixer = MambaMixerConfig(
        num_heads=_int(raw, "mamba_num_heads", 128), head_dim=_int(raw, "mamba_head_dim", 64),
        state_size=_int(raw, "ssm_state_size", 128), n_groups=_int(raw, "n_groups", 8),
        conv_kernel=_int(raw, "conv_kernel", 4), chunk_size=_int(raw, "chunk_size", 128),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)), conv_bias=bool(raw.get("use_conv_bias", True)),
        proj_bias=bool(raw.get("use_bias", False)), dt_min=lo, dt_max=hi,
    )
    if mixer.num_heads % mixer.n_groups:
        raise ConfigError(f"mamba heads {mixer.num_heads} are not a multiple of n_groups {mixer.n_groups}")
    if mixer.conv_kernel < 2:
        raise ConfigError(f"conv kernel must be >= 2, got {mixer.conv_kernel}")
    return mixer


def parse_falcon_h1_mixer(raw: dict[str, Any]) -> MambaMixerConfig:
    """The mixer of a FalconH1ForCausalLM config.json: Bamba's fields, its width mamba_d_ssm
    (else hidden_size * mamba_expand), and its gate / norm choice."""
    hidden = _int(raw, "hidden_size")
    n_heads = _int(raw, "mamba_n_heads", 128)
    width = raw.get("mamba_d_ssm") or hidden * _int(raw, "mamba_expand", 2)
    d_head = raw.get("mamba_d_head", "auto")
    if raw.get("mamba_proj_bias"):
        raise ConfigError("mamba_proj_bias=true is not supported for FalconH1")
    gate = GATE_ONLY
    if raw.get("mamba_rms_norm", False):
        gate = NORM_THEN_GATE if raw.get("mamba_norm_before_gate", True) else GATE_THEN_NORM
    lo, hi = _time_step_limit(raw)
    mixer = MambaMixerConfig(
        num_heads=n_heads, head_dim=width // n_heads if d_head in (None, "auto") else _int(raw, "mamba_d_head"),
        state_size=_int(raw, "mamba_d_state", 256), n_groups=_int(raw, "mamba_n_groups", 1),
        conv_kernel=_int(raw, "mamba_d_conv", 4), chunk_size=_int(raw, "mamba_chunk_size", 256),
        norm_eps=float(raw.get("rms_norm_eps", 1e-5)), conv_bias=bool(raw.get("mamba_conv_bias", True)),
        dt_min=lo, dt_max=hi, gate=gate,
    )
    if mixer.intermediate_size != width:
        raise ConfigError(f"mamba_n_heads * mamba_d_head = {mixer.intermediate_size} differs from the mixer "
                          f"width {width} (mamba_d_ssm)")
    _check_common(raw, mixer, mixer.intermediate_size, 1)
    return mixer


def bamba_attention_layers(raw: dict[str, Any], num_layers: int) -> frozenset[int]:
    """Indices of Bamba's attention layers (every other layer is a mixer); ConfigError if out of range."""
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ConfigError(f"{key}=true is not supported for Bamba")
    attn_layers = frozenset(raw.get("attn_layer_indices") or ())
    if any(not isinstance(i, int) or not 0 <= i < num_layers for i in attn_layers):
        raise ConfigError(f"attn_layer_indices {sorted(attn_layers)} out of range for {num_layers} layers")
    return attn_layers
