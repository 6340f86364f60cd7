"""Per-architecture knowledge for turning a GGUF into a Hugging Face checkpoint.

For each supported `general.architecture` this module states: how GGUF tensor names map to HF
parameter names, which tensors need a numeric fix-up, and how the HF `config.json` is built from
the metadata. Facts a GGUF does not store come from one place per family (`GEMMA3_DEFAULTS`).
Gemma 3 and Llama are here; the sliding-window families are in gguf_sliding.py (Cohere2,
OLMo 3, EXAONE 4) and gguf_gpt_oss.py, on the shared machinery of gguf_spec.py.

Fix-ups, matching what llama.cpp's converter did to the HF weights and what transformers' own
GGUF loader undoes:
- Gemma: RMSNorm computes x * (1 + w) in HF, and llama.cpp folds the +1 into the stored weight,
  so every Gemma norm weight (input, post-attention, pre/post-feedforward, q_norm, k_norm and the
  final norm) is `gguf - 1`. Gemma Q/K are *not* permuted (llama.cpp runs Gemma with NeoX RoPE).
- Llama: llama.cpp interleaves each head's Q and K rows for its GPT-J style RoPE; the rows are
  put back into HF's half-split order here. Llama 3.x files store their RoPE scaling as a
  `rope_freqs` tensor, which is turned back into HF's `rope_scaling` (transformers ignores it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_falcon_h1 import FALCON_H1_SPEC
from hybridserve.models.loaders.gguf_gpt_oss import GPT_OSS_SPEC
from hybridserve.models.loaders.gguf_jamba import JAMBA_SPEC
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_mamba2_family import MAMBA2_FAMILY_SPECS
from hybridserve.models.loaders.gguf_lfm2 import LFM2_SPEC
from hybridserve.models.loaders.gguf_qwen3next import QWEN3NEXT_SPEC
from hybridserve.models.loaders.gguf_rope_freqs import ROPE_FREQS_TENSOR, rope_freqs_scaling
from hybridserve.models.loaders.gguf_sliding import COHERE2_SPEC, EXAONE4_SPEC, OLMO2_SPEC
from hybridserve.models.loaders.gguf_spec import COMMON_BLOCK_NAMES, POST_NORM_BLOCK_NAMES, ArchSpec, common_config


@dataclass(frozen=True)
class Gemma3ArchitectureDefaults:
    """Gemma 3 facts that a GGUF file does not record (all sizes, 270M to 27B).

    `sliding_window_pattern` = 6 means five sliding-window layers, then one global layer: for 18
    layers the global ones are 5, 11 and 17. The global RoPE base is in the metadata
    (`rope.freq_base`, 1,000,000); the local one is not.
    """

    sliding_window_pattern: int = 6
    rope_local_base_freq: float = 10_000.0
    rope_global_base_freq: float = 1_000_000.0  # used only when the metadata lacks rope.freq_base
    sliding_window: int = 512  # used only when the metadata lacks attention.sliding_window
    head_dim: int = 256  # used only when the metadata lacks attention.key_length
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_weight_offset: float = 1.0  # GGUF weight = HF weight + 1
    # llama.cpp's rule: 1/sqrt(head_dim), except the 27B (62 layers) which scales by hidden/heads.
    block_counts_scaling_by_hidden_over_heads: tuple[int, ...] = (62,)

    def query_pre_attn_scalar(self, hidden_size: int, num_heads: int, head_dim: int, block_count: int) -> int:
        """The value HF Gemma 3 divides queries by the square root of (256 for the 270M)."""
        if block_count in self.block_counts_scaling_by_hidden_over_heads:
            return hidden_size // num_heads
        return head_dim


GEMMA3_DEFAULTS = Gemma3ArchitectureDefaults()

def _gemma3_config(header: GGUFHeader) -> dict[str, Any]:
    d = GEMMA3_DEFAULTS
    config = common_config(header)
    head_dim = int(header.arch_value("attention.key_length", d.head_dim))
    layers = config["num_hidden_layers"]
    pattern = int(header.arch_value("attention.sliding_window_pattern", d.sliding_window_pattern))
    config.update(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        head_dim=head_dim,
        hidden_activation=d.hidden_activation,
        query_pre_attn_scalar=d.query_pre_attn_scalar(
            config["hidden_size"], config["num_attention_heads"], head_dim, layers
        ),
        sliding_window=int(header.arch_value("attention.sliding_window", d.sliding_window)),
        _sliding_window_pattern=pattern,
        layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        rope_theta=float(header.arch_value("rope.freq_base", d.rope_global_base_freq)),
        rope_local_base_freq=d.rope_local_base_freq,
        rope_scaling=config.get("rope_scaling"),
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        use_bidirectional_attention=False,
    )
    return config


def _llama_config(header: GGUFHeader) -> dict[str, Any]:
    config = common_config(header)
    head_dim = header.arch_value("attention.key_length") or header.arch_value("rope.dimension_count")
    config.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        head_dim=int(head_dim or config["hidden_size"] // config["num_attention_heads"]),
        hidden_act="silu",
        mlp_bias=False,
        rope_theta=float(header.arch_value("rope.freq_base", 10_000.0)),
    )
    from_tensor = rope_freqs_scaling(header, config["rope_theta"], config["head_dim"])
    config["rope_scaling"] = from_tensor or config.get("rope_scaling")
    return config


ARCH_SPECS: dict[str, ArchSpec] = {
    "gemma3": ArchSpec(
        gguf_arch="gemma3",
        family="gemma3",
        block_names={**COMMON_BLOCK_NAMES, **POST_NORM_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm"},
        norm_modules=frozenset({
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm", "q_norm", "k_norm", "model.norm",
        }),
        norm_weight_offset=GEMMA3_DEFAULTS.rms_norm_weight_offset,
        unpermute_qk=False,
        build_config=_gemma3_config,
    ),
    "llama": ArchSpec(
        gguf_arch="llama",
        family="llama",
        block_names={**COMMON_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"},
        norm_modules=frozenset(),  # Llama's RMSNorm multiplies by w itself: nothing folded in
        norm_weight_offset=0.0,
        unpermute_qk=True,
        build_config=_llama_config,
        consumed_tensors=frozenset({ROPE_FREQS_TENSOR}),
    ),
    **{spec.gguf_arch: spec for spec in (GPT_OSS_SPEC, COHERE2_SPEC, OLMO2_SPEC, EXAONE4_SPEC)},
    **{spec.gguf_arch: spec for spec in (FALCON_H1_SPEC, JAMBA_SPEC)},
    **{spec.gguf_arch: spec for spec in MAMBA2_FAMILY_SPECS},
    **{spec.gguf_arch: spec for spec in (QWEN3NEXT_SPEC, LFM2_SPEC)},
}


def arch_spec_for(header: GGUFHeader) -> ArchSpec:
    """The spec for this file's architecture; ConfigError naming the supported ones otherwise."""
    spec = ARCH_SPECS.get(header.architecture)
    if spec is None:
        supported = ", ".join(sorted(ARCH_SPECS))
        raise ConfigError(f"{header.path}: GGUF architecture {header.architecture!r} is not supported ({supported})")
    return spec
