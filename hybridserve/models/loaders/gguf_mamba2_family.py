"""GGUF specs of the models llama.cpp converts through its Mamba2 converter: pure Mamba2
(`mamba2`, HF Mamba2ForCausalLM), Granite 4.0-H (`granitehybrid`, HF
GraniteMoeHybridForCausalLM) and Nemotron-H (`nemotron_h`, HF NemotronHForCausalLM). Their
mixers are gguf_mamba2.py's; this module adds each model's other tensors and its config.

Facts from llama.cpp's converter and runtime:
- Which layer is which: `attention.head_count_kv` is one count per layer, 0 off the attention
  layers; Nemotron-H's `feed_forward_length` is one width per layer, 0 off its MLP layers. A
  layer with neither is a Mamba2 mixer (llama.cpp's rule for both). Pure Mamba2 files write 0
  heads and width 0: every layer a mixer.
- Granite 4.0-H: its multipliers are `embedding_scale`, `residual_scale`, `attention.scale`
  and `logit_scale` (the logits are divided by it); absent, llama.cpp scales the attention
  by 1/sqrt(head_dim) and leaves the rest unscaled. `rope.scaling.finetuned` is its switch
  for RoPE (absent: on); published Granite 4.0-H files say false. Experts: `ffn_gate_exps` and
  `ffn_up_exps` [E, I, H] are the halves of HF's `block_sparse_moe.input_linear` [E, 2I, H]
  (gate first), `ffn_down_exps` its output_linear; the shared MLP is `ffn_{gate,up,down}_shexp`
  (`expert_shared_feed_forward_length` wide), or `ffn_{gate,up,down}` in a model without
  experts, whose shared MLP is its only one. Head dim is hidden / heads (HF's rule; the
  converter drops any other).
- Nemotron-H: head dim `attention.key_length`; no RoPE; a squared-ReLU MLP of up / down; its
  mixer is sized by heads alone (the inner size need not be a multiple of the hidden size, as
  Mamba2's and Granite's `expand` requires).
- Granite and Nemotron-H files are written through llama.cpp's Llama converter, which
  interleaves Q/K rows per head for its RoPE even where no RoPE is applied; they are restored.
- Not in any file: the SSD chunk length (a kernel choice that does not change the model's
  function; each HF config's default is used) and dt's clamp (HF's default, none).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_backbone import BackboneArchSpec
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_mamba2 import (Mamba2Sizes, block_stems, mamba2_block_names, mamba2_merges,
                                                    mamba2_sizes)
from hybridserve.models.loaders.gguf_spec import ArchSpec, BlockMerge, common_config, float32_value, required

# Keys llama.cpp lets a converter write as one number per layer.
_PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")


def per_layer(header: GGUFHeader, key: str, default: int = 0) -> list[int]:
    """`<architecture>.<key>` as one int per layer (a scalar applies to every layer)."""
    layers = int(required(header, "block_count"))
    value = header.arch_value(key, default)
    if isinstance(value, np.ndarray):
        if len(value) != layers:
            raise ConfigError(f"{header.path}: {header.architecture}.{key} has {len(value)} entries "
                              f"for {layers} layers")
        return [int(v) for v in value]
    return [int(value)] * layers


def _largest_per_layer(header: GGUFHeader) -> GGUFHeader:
    """The header with each per-layer array replaced by its largest entry (the model-wide
    number HF configs hold), so common_config reads it as a scalar."""
    keys = {f"{header.architecture}.{key}" for key in _PER_LAYER_KEYS}
    metadata = {k: int(v.max(initial=0)) if k in keys and isinstance(v, np.ndarray) else v
                for k, v in header.metadata.items()}
    return replace(header, metadata=metadata)


def _expand(header: GGUFHeader, sizes: Mamba2Sizes, hidden: int) -> int:
    """HF's `expand` (inner size / hidden size), for the configs that size the mixer by it."""
    if sizes.inner_size % hidden:
        raise ConfigError(f"{header.path}: SSM inner size {sizes.inner_size} is not a multiple of the "
                          f"hidden size {hidden}")
    return sizes.inner_size // hidden


def _mamba2_config(header: GGUFHeader) -> dict[str, Any]:
    s = mamba2_sizes(header)
    config = common_config(_largest_per_layer(header))
    config = {key: config[key] for key in ("hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings",
                                            "bos_token_id", "eos_token_id", "pad_token_id")}
    config.update(
        architectures=["Mamba2ForCausalLM"], model_type="mamba2", num_heads=s.num_heads, head_dim=s.head_dim,
        state_size=s.state_size, n_groups=s.n_groups, conv_kernel=s.conv_kernel,
        expand=_expand(header, s, config["hidden_size"]), use_conv_bias=s.conv_bias, use_bias=s.proj_bias,
        layer_norm_epsilon=float32_value(required(header, "attention.layer_norm_rms_epsilon")),
        hidden_act="silu", rms_norm=True,
    )
    return config


def _granite_hybrid_config(header: GGUFHeader) -> dict[str, Any]:
    s = mamba2_sizes(header)
    config = common_config(_largest_per_layer(header))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = hidden // heads if heads else 0
    if header.arch_value("attention.key_length") not in (None, head_dim):
        raise ConfigError(f"{header.path}: attention.key_length {header.arch_value('attention.key_length')} is not "
                          f"hidden / heads = {head_dim}, which GraniteMoeHybrid requires")
    uses_rope = bool(header.arch_value("rope.scaling.finetuned", True))
    rotated = header.arch_value("rope.dimension_count")
    if uses_rope and rotated is not None and int(rotated) != head_dim:
        raise ConfigError(f"{header.path}: RoPE over {rotated} of {head_dim} head dims (partial rotary, as "
                          f"Bamba's) is not supported for granitehybrid")
    stems = block_stems(header)
    experts = int(header.arch_value("expert_count", 0))
    shared_rows = next((info.shape[0] for info in header.tensors
                        if info.name.endswith(("ffn_up_shexp.weight", ".ffn_up.weight"))), None)
    shared = header.arch_value("expert_shared_feed_forward_length") or shared_rows
    if not shared:
        raise ConfigError(f"{header.path} has no shared MLP (ffn_up_shexp or ffn_up) and no "
                          f"{header.architecture}.expert_shared_feed_forward_length")
    config.update(
        architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid",
        layer_types=["attention" if kv else "mamba" for kv in per_layer(header, "attention.head_count_kv")],
        shared_intermediate_size=int(shared), num_local_experts=experts,
        num_experts_per_tok=int(required(header, "expert_used_count")) if experts else 0,
        position_embedding_type="rope" if uses_rope else "nope",
        rope_theta=float(header.arch_value("rope.freq_base", 10_000.0)),
        embedding_multiplier=float32_value(header.arch_value("embedding_scale", 1.0)),
        residual_multiplier=float32_value(header.arch_value("residual_scale", 1.0)),
        attention_multiplier=float32_value(header.arch_value("attention.scale", head_dim**-0.5 if head_dim else 1.0)),
        logits_scaling=float32_value(header.arch_value("logit_scale", 1.0)),
        attention_bias="attn_q.bias" in stems, hidden_act="silu",
        mamba_n_heads=s.num_heads, mamba_d_head=s.head_dim, mamba_d_state=s.state_size, mamba_n_groups=s.n_groups,
        mamba_d_conv=s.conv_kernel, mamba_expand=_expand(header, s, hidden), mamba_conv_bias=s.conv_bias,
        mamba_proj_bias=s.proj_bias,
    )
    return config


# Nemotron-H's pattern characters, as its config.json files write them.
_MAMBA, _ATTENTION, _MLP = "M", "*", "-"


def _nemotron_h_config(header: GGUFHeader) -> dict[str, Any]:
    s = mamba2_sizes(header)
    config = common_config(_largest_per_layer(header))
    pattern = []
    for layer, (kv, width) in enumerate(zip(per_layer(header, "attention.head_count_kv"),
                                            per_layer(header, "feed_forward_length"))):
        if kv and width:
            raise ConfigError(f"{header.path}: layer {layer} has both KV heads and an MLP width; a Nemotron-H "
                              f"layer is one block")
        pattern.append(_ATTENTION if kv else _MLP if width else _MAMBA)
    stems = block_stems(header)
    config.pop("rms_norm_eps")
    config.update(
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hybrid_override_pattern="".join(pattern),
        head_dim=int(header.arch_value("attention.key_length")
                     or config["hidden_size"] // max(config["num_attention_heads"], 1)),
        layer_norm_epsilon=float32_value(required(header, "attention.layer_norm_rms_epsilon")),
        attention_bias="attn_q.bias" in stems, mlp_bias="ffn_up.bias" in stems, mlp_hidden_act="relu2",
        mamba_hidden_act="silu", mamba_num_heads=s.num_heads, mamba_head_dim=s.head_dim, ssm_state_size=s.state_size,
        n_groups=s.n_groups, conv_kernel=s.conv_kernel, use_conv_bias=s.conv_bias, use_bias=s.proj_bias,
    )
    return config


_ATTENTION_NAMES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}


def _concat_rows(axis: int):
    """[gate; up] stacked along `axis`: HF's fused input_linear from llama.cpp's halves."""
    def shape(gate: tuple[int, ...], up: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(g + u if i == axis else g for i, (g, u) in enumerate(zip(gate, up)))

    return dict(shape=shape, build=lambda gate, up: np.concatenate((gate, up), axis=axis))


MAMBA2_SPEC = BackboneArchSpec(
    gguf_arch="mamba2", family="mamba2", block_names={"attn_norm": "norm", **mamba2_block_names("mixer")},
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=False, build_config=_mamba2_config,
    block_merges=mamba2_merges("mixer"),
)
GRANITE_HYBRID_SPEC = ArchSpec(
    gguf_arch="granitehybrid", family="granite_hybrid",
    block_names={
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        **{stem: f"self_attn.{hf}" for stem, hf in _ATTENTION_NAMES.items()},
        "ffn_gate_inp": "block_sparse_moe.router.layer", "ffn_down_exps": "block_sparse_moe.output_linear",
        "ffn_down_shexp": "shared_mlp.output_linear", "ffn_down": "shared_mlp.output_linear",
        **mamba2_block_names("mamba"),
    },
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=True, build_config=_granite_hybrid_config,
    block_merges=(
        *mamba2_merges("mamba"),
        BlockMerge("block_sparse_moe.input_linear.weight", ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                   **_concat_rows(axis=1)),
        BlockMerge("shared_mlp.input_linear.weight", ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
                   **_concat_rows(axis=0)),
        BlockMerge("shared_mlp.input_linear.weight", ("ffn_gate.weight", "ffn_up.weight"), **_concat_rows(axis=0)),
    ),
)
NEMOTRON_H_SPEC = BackboneArchSpec(
    gguf_arch="nemotron_h", family="nemotron_h",
    block_names={
        "attn_norm": "norm", **{stem: f"mixer.{hf}" for stem, hf in _ATTENTION_NAMES.items()},
        "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj", **mamba2_block_names("mixer"),
    },
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=True, build_config=_nemotron_h_config,
    block_merges=mamba2_merges("mixer"),
)
MAMBA2_FAMILY_SPECS = (MAMBA2_SPEC, GRANITE_HYBRID_SPEC, NEMOTRON_H_SPEC)
