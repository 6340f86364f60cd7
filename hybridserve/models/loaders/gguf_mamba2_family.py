"""GGUF specs of the models llama.cpp converts through its Mamba2 converter: pure Mamba2
(`mamba2`, HF Mamba2ForCausalLM) and Nemotron-H (`nemotron_h`, HF NemotronHForCausalLM)
here, `granitehybrid` (Granite 4.0-H and Bamba) in gguf_granite_hybrid.py. Their mixers are
gguf_mamba2.py's; this module adds each model's other tensors and its config.

Facts from llama.cpp's converter and runtime:
- Pure Mamba2 files write 0 heads and an MLP width of 0: every layer a mixer.
- Nemotron-H: `attention.head_count_kv` is one count per layer, 0 off the attention layers,
  and `feed_forward_length` one width per layer, 0 off its MLP layers; a layer with neither
  is a Mamba2 mixer (llama.cpp's rule). Head dim `attention.key_length`; no RoPE; a
  squared-ReLU MLP of up / down; its mixer is sized by heads alone (the inner size need not
  be a multiple of the hidden size, as Mamba2's `expand` requires). Its attention goes
  through llama.cpp's Llama converter, which interleaves Q/K rows per head even where no
  RoPE is applied; they are restored.
- Not in any file: the SSD chunk length (a kernel choice that does not change the model's
  function; each HF config's default is used) and dt's clamp (HF's default, none).
"""

from __future__ import annotations

from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_granite_hybrid import ATTENTION_NAMES, GRANITE_HYBRID_SPEC
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_layer_arrays import block_stems, largest_per_layer, per_layer
from hybridserve.models.loaders.gguf_mamba2 import mamba2_block_names, mamba2_expand, mamba2_merges, mamba2_sizes
from hybridserve.models.loaders.gguf_renamed import BACKBONE_RENAMES, RenamedArchSpec
from hybridserve.models.loaders.gguf_spec import common_config, float32_value, required


def _mamba2_config(header: GGUFHeader) -> dict[str, Any]:
    s = mamba2_sizes(header)
    config = common_config(largest_per_layer(header))
    config = {key: config[key] for key in ("hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings",
                                            "bos_token_id", "eos_token_id", "pad_token_id")}
    config.update(
        architectures=["Mamba2ForCausalLM"], model_type="mamba2", num_heads=s.num_heads, head_dim=s.head_dim,
        state_size=s.state_size, n_groups=s.n_groups, conv_kernel=s.conv_kernel,
        expand=mamba2_expand(header, s, config["hidden_size"]), use_conv_bias=s.conv_bias, use_bias=s.proj_bias,
        layer_norm_epsilon=float32_value(required(header, "attention.layer_norm_rms_epsilon")),
        hidden_act="silu", rms_norm=True,
    )
    return config


# Nemotron-H's pattern characters, as its config.json files write them.
_MAMBA, _ATTENTION, _MLP = "M", "*", "-"


def _nemotron_h_config(header: GGUFHeader) -> dict[str, Any]:
    s = mamba2_sizes(header)
    config = common_config(largest_per_layer(header))
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


MAMBA2_SPEC = RenamedArchSpec(
    gguf_arch="mamba2", family="mamba2", block_names={"attn_norm": "norm", **mamba2_block_names("mixer")},
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=False, build_config=_mamba2_config,
    block_merges=mamba2_merges("mixer"), renames=BACKBONE_RENAMES,
)
NEMOTRON_H_SPEC = RenamedArchSpec(
    gguf_arch="nemotron_h", family="nemotron_h",
    block_names={
        "attn_norm": "norm", **{stem: f"mixer.{hf}" for stem, hf in ATTENTION_NAMES.items()},
        "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj", **mamba2_block_names("mixer"),
    },
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=True, build_config=_nemotron_h_config,
    block_merges=mamba2_merges("mixer"), renames=BACKBONE_RENAMES,
)
MAMBA2_FAMILY_SPECS = (MAMBA2_SPEC, GRANITE_HYBRID_SPEC, NEMOTRON_H_SPEC)
