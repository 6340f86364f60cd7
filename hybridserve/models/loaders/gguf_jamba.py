"""GGUF spec of Jamba (`jamba`), as llama.cpp's converter writes it.

Tensors of layer N (numpy shapes; I = mixer channels, R = dt rank, S = state size, E experts,
F = MLP width, D = hidden):
- every layer: `attn_norm` (HF input_layernorm), `ffn_norm.weight` (HF pre_ff_layernorm);
- attention layers: `attn_q/k/v/output`, Q/K not permuted (Jamba has no RoPE);
- Mamba1 layers: `ssm_in` (rows x | gate as HF's in_proj), `ssm_conv1d` weight [I, K] and
  bias, `ssm_x` (HF x_proj), `ssm_dt` weight and bias (HF dt_proj), `ssm_dt_norm`,
  `ssm_b_norm`, `ssm_c_norm` (HF dt / b / c_layernorm), bare `ssm_a` [I, S] = -exp(A_log),
  bare `ssm_d` [I], `ssm_out`;
- expert layers: `ffn_gate_inp` (HF router) and the experts stacked: `ffn_gate_exps`,
  `ffn_up_exps` [E, F, D] (or fused `ffn_gate_up_exps` [E, 2F, D], gate rows first),
  `ffn_down_exps` [E, D, F]. They are written in transformers' own stacked layout,
  `feed_forward.experts.gate_up_proj` [E, 2F, D] (gate rows first) and `.down_proj`
  [E, D, F], which models/loaders/jamba_loader.py reads beside the per-expert one;
- dense layers: `ffn_gate/up/down`.

Config facts: which layers attend is llama.cpp's rule, a nonzero `attention.head_count_kv`
entry (the converter writes one per layer); which layers route over experts, the layers with
`ffn_gate_inp`. HF's JambaConfig states both as a period and an offset, recovered here
(`period_and_offset`); a layout no period and offset describe is refused. The mixer's width
is `ssm.inner_size` (HF mamba_expand = width / hidden).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_hybrid_spec import FEED_FORWARD_BLOCK_NAMES, HybridArchSpec, mixer_merges
from hybridserve.models.loaders.gguf_spec import BlockMerge, common_config, float32_value, renamed, required, tensor_rows

_KV_HEADS = "attention.head_count_kv"


def period_and_offset(layers: set[int], num_layers: int, what: str) -> tuple[int, int]:
    """(period, offset) with `layers` == {i < num_layers : i % period == offset}, the longest
    period that fits (one layer in four: period 4, as HF's configs state it); no layers:
    (num_layers + 1, num_layers). ConfigError naming `what` when no pair describes them."""
    if not layers:
        return num_layers + 1, num_layers
    offset = min(layers)
    for period in range(num_layers, offset, -1):
        if layers == set(range(offset, num_layers, period)):
            return period, offset
    raise ConfigError(f"{what} layers {sorted(layers)} are not every Nth layer from an offset, "
                      f"which JambaConfig cannot express")


def _attention_layers(header: GGUFHeader, num_layers: int) -> tuple[set[int], int]:
    """(attention layers, their KV heads): the nonzero entries of the per-layer KV head counts;
    a single count (not what the converter writes) applies to the layers that hold attn_q."""
    kv = header.arch_value(_KV_HEADS)
    if isinstance(kv, np.ndarray):
        if len(kv) != num_layers:
            raise ConfigError(f"{header.path}: {_KV_HEADS} has {len(kv)} entries for {num_layers} layers")
        layers = {i for i, heads in enumerate(kv.tolist()) if heads}
        counts = {int(kv[i]) for i in layers}
        if len(counts) > 1:
            raise ConfigError(f"{header.path}: attention layers with different KV head counts {sorted(counts)}")
        return layers, counts.pop() if counts else int(required(header, "attention.head_count"))
    layers = {i for i in range(num_layers) if tensor_rows(header, f"blk.{i}.attn_q.weight") is not None}
    return layers, int(kv if kv is not None else required(header, "attention.head_count"))


def _jamba_config(header: GGUFHeader) -> dict[str, Any]:
    num_layers = int(required(header, "block_count"))
    attention, kv_heads = _attention_layers(header, num_layers)
    key = f"{header.architecture}.{_KV_HEADS}"
    config = common_config(dataclasses.replace(header, metadata={**header.metadata, key: kv_heads}))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    key_length = header.arch_value("attention.key_length")
    if key_length is not None and int(key_length) * heads != hidden:
        raise ConfigError(f"{header.path}: attention.key_length {key_length} is not hidden / heads "
                          f"({hidden} / {heads}), which JambaConfig assumes")
    width = int(required(header, "ssm.inner_size"))
    if width % hidden:
        raise ConfigError(f"{header.path}: mixer width {width} (ssm.inner_size) is not a multiple of the hidden "
                          f"size {hidden}")
    experts = {i for i in range(num_layers) if tensor_rows(header, f"blk.{i}.ffn_gate_inp.weight") is not None}
    attn_period, attn_offset = period_and_offset(attention, num_layers, "attention")
    expert_period, expert_offset = period_and_offset(experts, num_layers, "expert")
    mamba_layer = next((i for i in range(num_layers) if i not in attention), 0)
    config.pop("rope_scaling", None)
    config.update(
        architectures=["JambaForCausalLM"], model_type="jamba", hidden_act="silu",
        attn_layer_period=attn_period, attn_layer_offset=attn_offset,
        expert_layer_period=expert_period, expert_layer_offset=expert_offset,
        num_experts=int(required(header, "expert_count")) if experts else 1,
        num_experts_per_tok=int(required(header, "expert_used_count")) if experts else 1,
        mamba_expand=width // hidden, mamba_d_state=int(required(header, "ssm.state_size")),
        mamba_d_conv=int(required(header, "ssm.conv_kernel")),
        mamba_dt_rank=int(required(header, "ssm.time_step_rank")),
        mamba_conv_bias=tensor_rows(header, f"blk.{mamba_layer}.ssm_conv1d.bias") is not None,
        mamba_proj_bias=tensor_rows(header, f"blk.{mamba_layer}.ssm_in.bias") is not None,
        rms_norm_eps=float32_value(required(header, "attention.layer_norm_rms_epsilon")),
    )
    return config


_MIXER = "mamba."
_EXPERTS = "feed_forward.experts."
_EXPERT_MERGES = (
    BlockMerge(f"{_EXPERTS}gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
               shape=lambda g, u: (g[0], g[1] + u[1], g[2]), build=lambda g, u: np.concatenate((g, u), axis=1)),
    renamed(f"{_EXPERTS}gate_up_proj", "ffn_gate_up_exps.weight"),
    renamed(f"{_EXPERTS}down_proj", "ffn_down_exps.weight"),
)
JAMBA_SPEC = HybridArchSpec(
    gguf_arch="jamba", family="jamba",
    block_names={
        **FEED_FORWARD_BLOCK_NAMES,
        "ffn_norm": "pre_ff_layernorm", "ffn_gate_inp": "feed_forward.router",
        **{f"ssm_{stem}": f"{_MIXER}{hf}" for stem, hf in (
            ("in", "in_proj"), ("conv1d", "conv1d"), ("x", "x_proj"), ("dt", "dt_proj"), ("out", "out_proj"),
            ("dt_norm", "dt_layernorm"), ("b_norm", "b_layernorm"), ("c_norm", "c_layernorm"))},
    },
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=False, build_config=_jamba_config,
    block_merges=(*mixer_merges(_MIXER, state_shape=lambda s: s), *_EXPERT_MERGES),
)
