"""Qwen3-Next specifics of a `config.json` (`Qwen3NextForCausalLM`, model_type qwen3_next).

Pure Python (no torch), like mamba_config.py: `kv_specs` derives each linear-attention
layer's state shapes from here before any weights load; `models/config.py` builds the
`ModelConfig` around it. Fields that change the numbers and that we do not implement raise
ConfigError naming the field.

Per Gated DeltaNet layer, with Hk key heads of dk, Hv value heads of dv (Hv a multiple of
Hk: each key head serves Hv / Hk value heads), kernel K::

    in_proj -> [ q (Hk*dk) | k (Hk*dk) | v (Hv*dv) | z (Hv*dv) | b (Hv) | a (Hv) ]
    conv state       [conv_dim, K-1]   the last K-1 q|k|v inputs (conv_dim = 2*Hk*dk + Hv*dv)
    recurrent state  [Hv, dk, dv]

The other layers are gated full attention; every layer's feed-forward is a sparse mixture
of experts with a sigmoid-gated shared expert, or a dense SwiGLU MLP (mlp_only_layers, and
every layer of Qwen3.5's dense `Qwen3_5ForCausalLM`, which shares the rest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.core.errors import ConfigError

LINEAR = "linear_attention"  # layer type of a Gated DeltaNet layer (HF's name)
_FULL = "full_attention"
# Tokens per chunk of the chunked delta-rule prefill (HF's and the reference kernels' choice).
DELTA_RULE_CHUNK = 64


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """One Gated DeltaNet layer's shape (identical across a model's linear-attention layers)."""

    num_k_heads: int  # Hk
    num_v_heads: int  # Hv
    head_k_dim: int  # dk
    head_v_dim: int  # dv
    conv_kernel: int  # K
    norm_eps: float  # the gated RMSNorm's epsilon
    chunk_size: int = DELTA_RULE_CHUNK

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_size(self) -> int:
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state) of one request in one layer: what a MambaSpec stores."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)


@dataclass(frozen=True)
class Qwen3NextMoE:
    """The feed-forward of each layer: a softmax top-k mixture of experts plus a shared expert
    whose output is scaled by sigmoid(shared_expert_gate(x)), except in `dense_layers`."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1
    dense_layers: frozenset[int]  # layers with a dense SwiGLU MLP (cfg.intermediate_size) instead


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def parse_gated_deltanet(raw: dict[str, Any]) -> GatedDeltaNetConfig:
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"unsupported hidden_act {act!r} for Qwen3-Next (silu only)")
    mixer = GatedDeltaNetConfig(
        num_k_heads=_int(raw, "linear_num_key_heads", 16), num_v_heads=_int(raw, "linear_num_value_heads", 32),
        head_k_dim=_int(raw, "linear_key_head_dim", 128), head_v_dim=_int(raw, "linear_value_head_dim", 128),
        conv_kernel=_int(raw, "linear_conv_kernel_dim", 4), norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
    )
    if mixer.num_v_heads % mixer.num_k_heads:
        raise ConfigError(f"linear_num_value_heads {mixer.num_v_heads} is not a multiple of "
                          f"linear_num_key_heads {mixer.num_k_heads}")
    if mixer.conv_kernel < 2:
        raise ConfigError(f"linear_conv_kernel_dim must be >= 2, got {mixer.conv_kernel}")
    return mixer


def qwen3_next_layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """`layer_types`, or (older configs) a full-attention layer every full_attention_interval."""
    given = raw.get("layer_types")
    if given is None:
        interval = _int(raw, "full_attention_interval", 4)
        return tuple(_FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))
    if len(given) != num_layers:
        raise ConfigError(f"layer_types has {len(given)} entries for {num_layers} layers")
    bad = sorted({t for t in given if t not in (_FULL, LINEAR)})
    if bad:
        raise ConfigError(f"unsupported layer type(s) {bad} in layer_types")
    return tuple(given)


def dense_feed_forward(num_layers: int) -> Qwen3NextMoE:
    """Qwen3.5's dense models: a SwiGLU MLP (intermediate_size) in every layer, no experts."""
    return Qwen3NextMoE(num_experts=0, top_k=0, moe_intermediate_size=0, shared_intermediate_size=0,
                        norm_topk_prob=False, dense_layers=frozenset(range(num_layers)))


def parse_qwen3_next_moe(raw: dict[str, Any], num_layers: int) -> Qwen3NextMoE:
    if raw.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for Qwen3-Next")
    num_experts = raw.get("num_experts", 512)
    if not isinstance(num_experts, int) or num_experts < 0:
        raise ConfigError(f"config.json: num_experts must be a non-negative integer, got {num_experts!r}")
    step = _int(raw, "decoder_sparse_step", 1)
    only = raw.get("mlp_only_layers") or []
    if any(not isinstance(i, int) or not 0 <= i < num_layers for i in only):
        raise ConfigError(f"mlp_only_layers {only} out of range for {num_layers} layers")
    dense = frozenset(i for i in range(num_layers) if i in only or num_experts == 0 or (i + 1) % step)
    top_k = _int(raw, "num_experts_per_tok", 10) if num_experts else 1
    if num_experts and top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok {top_k} exceeds num_experts {num_experts}")
    return Qwen3NextMoE(
        num_experts=num_experts, top_k=top_k, moe_intermediate_size=_int(raw, "moe_intermediate_size", 512),
        shared_intermediate_size=_int(raw, "shared_expert_intermediate_size", 512),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)), dense_layers=dense,
    )
