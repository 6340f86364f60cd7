"""Per-architecture knowledge for turning a GGUF into a Hugging Face checkpoint.

For each supported `general.architecture` this module states: how GGUF tensor names map to HF
parameter names, which tensors need a numeric fix-up, and how the HF `config.json` is built from
the metadata. Facts a GGUF does not store come from one place per family (`GEMMA3_DEFAULTS`).

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

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_header import GGUFHeader, dequantize_tensor


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

# GGUF block tensor stem (inside blk.N.) -> HF name inside model.layers.N.
_COMMON_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture becomes an HF checkpoint.

    Invariant: every HF module named in `norm_modules` is an RMSNorm whose GGUF weight carries
    `norm_weight_offset` on top of the HF weight.
    """

    gguf_arch: str
    block_names: dict[str, str]
    norm_modules: frozenset[str]
    norm_weight_offset: float
    unpermute_qk: bool
    build_config: Callable[[GGUFHeader], dict[str, Any]]
    consumed_tensors: frozenset[str] = field(default_factory=frozenset)  # read into the config instead

    def hf_name(self, gguf_name: str) -> str | None:
        """HF parameter name for a GGUF tensor, None for one folded into the config.

        Raises ConfigError for a tensor this architecture does not know: loading a model with a
        weight silently dropped would produce garbage.
        """
        stem, _, suffix = gguf_name.rpartition(".")
        if gguf_name in self.consumed_tensors:
            return None
        if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[stem]}.{suffix}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in self.block_names:
            return f"model.layers.{parts[1]}.{self.block_names[parts[2]]}.{suffix}"
        raise ConfigError(f"GGUF tensor {gguf_name} is unknown for architecture {self.gguf_arch}")

    def fix_tensor(self, hf_name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
        """Undo llama.cpp's conversion changes on one float32 tensor (see module docstring)."""
        module = hf_name.rpartition(".")[0]
        if module.rpartition(".")[2] in self.norm_modules or module in self.norm_modules:
            return values - np.float32(self.norm_weight_offset)
        if self.unpermute_qk and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            is_q = module.endswith("q_proj")
            heads = config["num_attention_heads"] if is_q else config["num_key_value_heads"]
            return unpermute_rope_rows(values, heads)
        return values


def unpermute_rope_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Reverse llama.cpp's Q/K row interleaving for one projection (weight or bias).

    Per head, llama.cpp reorders HF rows [r0..r(d/2-1) | s0..s(d/2-1)] into pairs
    (r0, s0, r1, s1, ...); this restores the halves.
    """
    rows = values.shape[0]
    if rows % (2 * num_heads):
        raise ConfigError(f"cannot split {rows} Q/K rows into {num_heads} heads of even size")
    pairs = values.reshape(num_heads, rows // num_heads // 2, 2, *values.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2)).reshape(values.shape)


def _float32_value(value: float) -> float:
    """Metadata floats are float32; write their shortest round-trip form (1e-06, not 9.9999e-07)."""
    return float(str(np.float32(value)))


def _tensor_rows(header: GGUFHeader, name: str) -> int | None:
    return next((t.shape[0] for t in header.tensors if t.name == name), None)


def _common_config(header: GGUFHeader) -> dict[str, Any]:
    """Config fields every llama.cpp decoder architecture stores the same way."""
    def required(key: str) -> Any:
        value = header.arch_value(key)
        if value is None:
            raise ConfigError(f"{header.path} lacks the metadata key {header.architecture}.{key}")
        return value

    heads = int(required("attention.head_count"))
    meta = header.metadata
    vocab = _tensor_rows(header, "token_embd.weight") or header.string_array_lengths.get("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "hidden_size": int(required("embedding_length")),
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.arch_value("attention.head_count_kv", heads)),
        "max_position_embeddings": int(header.arch_value("context_length", 4096)),
        "rms_norm_eps": _float32_value(header.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab) if vocab else None,
        "tie_word_embeddings": _tensor_rows(header, "output.weight") is None,
        "attention_bias": _tensor_rows(header, "blk.0.attn_q.bias") is not None,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "unk_token_id": meta.get("tokenizer.ggml.unknown_token_id"),
    }
    if config["vocab_size"] is None:
        raise ConfigError(f"{header.path} has neither token_embd.weight nor a vocabulary")
    scaling_type = header.arch_value("rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(header.arch_value("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ConfigError(f"{header.path} uses RoPE scaling {scaling_type!r}, which is not supported")
    return config


def _gemma3_config(header: GGUFHeader) -> dict[str, Any]:
    d = GEMMA3_DEFAULTS
    config = _common_config(header)
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
    config = _common_config(header)
    head_dim = header.arch_value("attention.key_length") or header.arch_value("rope.dimension_count")
    config.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        head_dim=int(head_dim or config["hidden_size"] // config["num_attention_heads"]),
        hidden_act="silu",
        mlp_bias=False,
        rope_theta=float(header.arch_value("rope.freq_base", 10_000.0)),
    )
    rope_freqs = next((t for t in header.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        factors = dequantize_tensor(header, rope_freqs)
        config["rope_scaling"] = llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"])
    config.setdefault("rope_scaling", None)
    return config


def llama3_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama 3 RoPE scaling, as llama.cpp stores them in rope_freqs."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (original / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium))


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF `rope_scaling` reproducing a GGUF `rope_freqs` tensor, None when it scales nothing.

    Llama 3.1 and 3.2 used low/high frequency factors 1 and 4 over an 8192-token original
    context; only `factor` (the largest divisor) varies, so it is read from the tensor and the
    whole curve is checked before it is trusted.
    """
    if np.allclose(factors, 1.0):
        return None
    scaling = {
        "rope_type": "llama3",
        "factor": _float32_value(float(factors.max())),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = llama3_factors(theta, head_dim, scaling)
    if factors.shape != expected.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise ConfigError("the GGUF's rope_freqs tensor matches no known Llama 3 RoPE scaling")
    return scaling


ARCH_SPECS: dict[str, ArchSpec] = {
    "gemma3": ArchSpec(
        gguf_arch="gemma3",
        block_names={
            **_COMMON_BLOCK_NAMES,
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
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
        block_names={**_COMMON_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"},
        norm_modules=frozenset(),  # Llama's RMSNorm multiplies by w itself: nothing folded in
        norm_weight_offset=0.0,
        unpermute_qk=True,
        build_config=_llama_config,
        consumed_tensors=frozenset({"rope_freqs.weight"}),
    ),
}


def arch_spec_for(header: GGUFHeader) -> ArchSpec:
    """The spec for this file's architecture; ConfigError naming the supported ones otherwise."""
    spec = ARCH_SPECS.get(header.architecture)
    if spec is None:
        supported = ", ".join(sorted(ARCH_SPECS))
        raise ConfigError(f"{header.path}: GGUF architecture {header.architecture!r} is not supported ({supported})")
    return spec
