"""GGUF files written from the tiny HF Mamba2, Granite 4.0-H, Bamba and Nemotron-H models
(hf_tiny_mamba kinds "mamba2", "granite", "bamba", "nemotron_h") the way llama.cpp's converter
(convert_hf_to_gguf.py: Mamba2Model, GraniteHybridModel, NemotronHModel) writes them. Names
come from gguf-py's own HF -> GGUF map (`gguf.get_tensor_name_map`, the converter's
`map_tensor_name`); layouts, values and keys are stated here from the converter, never taken
from hybridserve's reader, which these files test.

What the converter does, per tensor:
- `dt_bias` is renamed `dt_proj.bias` before mapping (-> `ssm_dt.bias`);
- `conv1d.weight` [C, 1, K] is squeezed to [C, K];
- `A_log` [H] becomes -exp(A_log), unsqueezed to [H, 1] (`ssm_a`, no suffix); `D` [H] is
  unsqueezed to [H, 1] (`ssm_d`);
- the mixer's norm weight [D] is reshaped to [n_groups, D / n_groups];
- Granite and Nemotron-H attention goes through the Llama converter, which interleaves each
  head's Q and K rows (`permute`: per head, row pairs (r_i, r_{i + d/2}));
- Granite's `block_sparse_moe.input_linear` [E, 2I, H] and `shared_mlp.input_linear`
  [2S, H] are split in two along their rows, gate first, into `ffn_gate_exps` / `ffn_up_exps`
  and `ffn_gate_shexp` / `ffn_up_shexp`; without experts the shared MLP is written as the
  dense one: `ffn_gate` / `ffn_up` / `ffn_down`.

Keys: Mamba2: context 2**20, feed_forward_length 0, head_count 0, ssm.{conv_kernel,
inner_size, state_size, group_count}, ssm.time_step_rank = the number of heads. Granite and
Nemotron-H: the Llama converter's keys (head counts, rope base and dimension count,
feed_forward_length = HF's intermediate_size), `attention.head_count_kv` as a per-layer
array (0 off attention layers), `rope.scaling.finetuned` false and context 2**20 (no RoPE:
the converter writes it so for every hybrid Granite, keeping RoPE for Bamba; a Granite model
with RoPE is written here with the switch on, as llama.cpp's runtime reads it), the same
ssm.* keys; Bamba (granitehybrid too) with the switch on, `rope.dimension_count` its
`attn_rotary_emb` (half of each head; HF 5 configs hold it as partial_rotary_factor 0.5),
its context, no multipliers and no expert keys; Granite's multipliers as attention.scale,
embedding_scale, residual_scale, logit_scale, expert_count / expert_used_count /
expert_shared_feed_forward_length; Nemotron-H's key/value length and `feed_forward_length` per layer (0 off MLP layers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.gguf_from_hf import _byte_vocabulary

GGUF_ARCH = {"mamba2": "mamba2", "granite": "granitehybrid", "bamba": "granitehybrid", "nemotron_h": "nemotron_h"}
NO_ROPE_CONTEXT = 2**20  # what the converter writes as the context of a model without RoPE


def llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, rows [a_0..a_{d/2-1} | b_0..] become (a_0, b_0, a_1, b_1, ...)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _gguf_tensors(kind: str, config: Any, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import gguf

    arch = gguf.MODEL_ARCH.GRANITE_HYBRID if kind in ("granite", "bamba") else \
        gguf.MODEL_ARCH.NEMOTRON_H if kind == "nemotron_h" else gguf.MODEL_ARCH.MAMBA2
    layers = len(config.layers_block_type) if kind == "nemotron_h" else config.num_hidden_layers
    names = gguf.get_tensor_name_map(arch, layers)
    groups = config.mamba_n_groups if kind in ("granite", "bamba") else config.n_groups
    shared = "ffn_{}_shexp" if getattr(config, "num_local_experts", 0) else "ffn_{}"  # Granite's shared MLP
    out: dict[str, np.ndarray] = {}
    for name, values in state.items():
        if name.endswith(".dt_bias"):
            name = name[: -len("dt_bias")] + "dt_proj.bias"
        layer = name.split(".")[2] if ".layers." in name else ""
        if name.endswith("input_linear.weight"):  # Granite's fused gate / up
            gate, up = np.split(values, 2, axis=-2)
            base = "ffn_{}_exps" if "block_sparse_moe" in name else shared
            out[f"blk.{layer}.{base.format('gate')}.weight"] = gate
            out[f"blk.{layer}.{base.format('up')}.weight"] = up
            continue
        if name.endswith("shared_mlp.output_linear.weight"):
            out[f"blk.{layer}.{shared.format('down')}.weight"] = values
            continue
        if name.endswith("conv1d.weight"):
            values = values[:, 0, :]
        elif name.endswith(".A_log"):
            values = -np.exp(values).reshape(-1, 1)
        elif name.endswith(".D"):
            values = values.reshape(-1, 1)
        elif name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
            values = values.reshape(groups, -1)
        elif name.endswith("q_proj.weight"):
            values = llama_permute(values, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            values = llama_permute(values, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name] = values
    return out


def _layer_kinds(kind: str, config: Any) -> list[str]:
    if kind == "nemotron_h":
        return list(config.layers_block_type)
    if kind == "granite":
        return list(config.layer_types)
    if kind == "bamba":
        return ["attention" if i in config.attn_layer_indices else "mamba" for i in range(config.num_hidden_layers)]
    return ["mamba"] * config.num_hidden_layers


def _ssm_keys(kind: str, config: Any) -> dict[str, Any]:
    """ssm.* and the norm epsilon, from each HF config's own field names."""
    if kind == "mamba2":
        inner, heads, groups, state, kernel, eps = (config.expand * config.hidden_size, config.num_heads,
                                                    config.n_groups, config.state_size, config.conv_kernel,
                                                    config.layer_norm_epsilon)
    elif kind in ("granite", "bamba"):
        inner, heads, groups, state, kernel, eps = (config.mamba_expand * config.hidden_size, config.mamba_n_heads,
                                                    config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
                                                    config.rms_norm_eps)
    else:
        inner, heads, groups, state, kernel, eps = (config.mamba_num_heads * config.mamba_head_dim,
                                                    config.mamba_num_heads, config.n_groups, config.ssm_state_size,
                                                    config.conv_kernel, config.layer_norm_epsilon)
    return {"ssm.conv_kernel": kernel, "ssm.inner_size": inner, "ssm.state_size": state,
            "ssm.time_step_rank": heads, "ssm.group_count": groups, "attention.layer_norm_rms_epsilon": eps}


def _model_keys(kind: str, config: Any, kinds: list[str]) -> dict[str, Any]:
    """Head counts, widths and scales (see the module docstring)."""
    if kind == "mamba2":
        return {"feed_forward_length": 0, "attention.head_count": 0}
    rotates = kind == "bamba" or getattr(config, "position_embedding_type", None) == "rope"
    head_dim = config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    rotated = int(head_dim * rope.get("partial_rotary_factor", 1.0))  # Bamba's attn_rotary_emb
    keys = {"feed_forward_length": config.intermediate_size, "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": [config.num_key_value_heads if k in ("attention", "full_attention") else 0
                                        for k in kinds],
            "rope.freq_base": 10000.0, "rope.dimension_count": rotated,
            "rope.scaling.finetuned": rotates}
    if rotates:
        keys["context_length"] = config.max_position_embeddings
    if kind == "granite":
        keys.update({"attention.scale": config.attention_multiplier, "embedding_scale": config.embedding_multiplier,
                     "residual_scale": config.residual_multiplier, "logit_scale": config.logits_scaling,
                     "expert_count": config.num_local_experts, "expert_used_count": config.num_experts_per_tok,
                     "expert_shared_feed_forward_length": config.shared_intermediate_size})
    elif kind == "nemotron_h":
        keys.update({"attention.key_length": config.head_dim, "attention.value_length": config.head_dim,
                     "feed_forward_length": [config.intermediate_size if k == "mlp" else 0 for k in kinds]})
    return keys


def write_gguf(kind: str, config: Any, state: dict[str, np.ndarray], path: Path,
               key_changes: dict[str, Any] | None = None, extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """Write `state` (HF names, float32) of the tiny `kind` model with HF `config` to `path`;
    `key_changes` (names after the architecture; None drops the key) and `extra_tensors`
    make broken files."""
    import gguf

    arch = GGUF_ARCH[kind]
    w = gguf.GGUFWriter(str(path), arch)
    kinds = _layer_kinds(kind, config)
    keys = {"context_length": NO_ROPE_CONTEXT, "embedding_length": config.hidden_size, "block_count": len(kinds),
            **_ssm_keys(kind, config), **_model_keys(kind, config, kinds), **(key_changes or {})}
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        elif isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(_byte_vocabulary(config.vocab_size))
    w.add_token_types([1] * config.vocab_size)
    w.add_token_scores([0.0] * config.vocab_size)
    w.add_bos_token_id(config.bos_token_id)
    for name, values in {**_gguf_tensors(kind, config, state), **(extra_tensors or {})}.items():
        w.add_tensor(name, np.ascontiguousarray(values, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
