"""What every GGUF architecture spec is made of: the name map, the fix-ups, the tensor plan,
and the config fields llama.cpp's converter writes the same way for every decoder.

The specs themselves (one per `general.architecture`) are in gguf_arch.py and the modules
it names; models/loaders/gguf_loader.py writes the HF checkpoint a spec's `plan` describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_header import GGUFHeader, GGUFTensorInfo

# GGUF block tensor stem (inside blk.N.) -> HF name inside model.layers.N.
COMMON_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
# The names llama.cpp gives the norms after attention and after the MLP (Gemma 3, OLMo, EXAONE 4).
POST_NORM_BLOCK_NAMES = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class BlockMerge:
    """One HF tensor of layer N built from GGUF tensors of blk.N (gpt-oss's experts, which
    llama.cpp splits, transposes or fuses differently from HF).

    `sources` are names inside blk.N. ("ffn_gate_exps.weight"). Unpacked (`packed_parts`
    empty): `build` takes their float32 values in that order and returns an array of
    `shape(*their shapes)`. Packed: every source must be stored as ggml type `packed_type`;
    `build` takes their stored bytes (gguf_header.tensor_bytes) and returns one uint8 array
    per part, written as `<hf_name>_<part>` with the shapes `shape` returns, bytes unchanged.
    """

    hf_name: str  # inside model.layers.N.
    sources: tuple[str, ...]
    shape: Callable[..., Any]
    build: Callable[..., Any]
    packed_type: int | None = None
    packed_parts: tuple[str, ...] = ()

    def applies(self, sources: tuple[GGUFTensorInfo, ...]) -> bool:
        return self.packed_type is None or all(info.ggml_type == self.packed_type for info in sources)


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the HF checkpoint: its name and shape, the GGUF tensors it is read from,
    and the merge that builds it (None: the one source, with ArchSpec.fix_tensor applied);
    `part` indexes a packed merge's outputs, stored as uint8 whatever the checkpoint's dtype."""

    hf_name: str
    shape: tuple[int, ...]
    sources: tuple[GGUFTensorInfo, ...]
    merge: BlockMerge | None = None
    part: int | None = None


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture becomes an HF checkpoint.

    Invariants: every HF module named in `norm_modules` is an RMSNorm whose GGUF weight carries
    `norm_weight_offset` on top of the HF weight; `family` is the hybridserve family
    (models/config.py SUPPORTED_ARCHITECTURES) of the config `build_config` writes.
    """

    gguf_arch: str
    family: str
    block_names: dict[str, str]
    norm_modules: frozenset[str]
    norm_weight_offset: float
    unpermute_qk: bool
    build_config: Callable[[GGUFHeader], dict[str, Any]]
    consumed_tensors: frozenset[str] = field(default_factory=frozenset)  # read into the config instead
    block_merges: tuple[BlockMerge, ...] = ()  # see plan: per HF name, the first that applies

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
            hf = self.block_names[parts[2]]
            if hf in _BARE_PARAMETERS and suffix == "weight":  # gpt-oss's sinks: a parameter, not a module
                return f"model.layers.{parts[1]}.{hf}"
            return f"model.layers.{parts[1]}.{hf}.{suffix}"
        raise ConfigError(f"GGUF tensor {gguf_name} is unknown for architecture {self.gguf_arch}")

    def plan(self, header: GGUFHeader) -> list[PlannedTensor]:
        """Every tensor of the HF checkpoint, in the GGUF's order (a merge's where its first
        source is). Per layer the first applicable merge of each HF name wins and claims its
        sources. ConfigError for a GGUF tensor no name or merge accounts for."""
        present = {info.name: info for info in header.tensors}
        at_first_source: dict[str, list[PlannedTensor]] = {}
        claimed: set[str] = set()
        layers = {int(n.split(".")[1]) for n in present if n.startswith("blk.") and n.split(".")[1].isdigit()}
        for layer in sorted(layers):
            built: set[str] = set()
            for merge in self.block_merges:
                names = [f"blk.{layer}.{source}" for source in merge.sources]
                if merge.hf_name in built or not all(n in present for n in names):
                    continue
                sources = tuple(present[n] for n in names)
                if not merge.applies(sources):
                    continue
                built.add(merge.hf_name)
                claimed.update(names)
                name, shape = f"model.layers.{layer}.{merge.hf_name}", merge.shape(*(i.shape for i in sources))
                at_first_source.setdefault(names[0], []).extend(
                    [PlannedTensor(f"{name}_{part}", shape[k], sources, merge, k)
                     for k, part in enumerate(merge.packed_parts)]
                    or [PlannedTensor(name, shape, sources, merge)])
        planned: list[PlannedTensor] = []
        for info in header.tensors:
            if info.name in at_first_source:
                planned.extend(at_first_source[info.name])
            elif info.name not in claimed and (name := self.hf_name(info.name)) is not None:
                planned.append(PlannedTensor(name, info.shape, (info,)))
        return planned

    def fix_tensor(self, hf_name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
        """Undo llama.cpp's conversion changes on one float32 tensor (see gguf_arch.py)."""
        module = hf_name.rpartition(".")[0]
        if module.rpartition(".")[2] in self.norm_modules or module in self.norm_modules:
            return values - np.float32(self.norm_weight_offset)
        if self.unpermute_qk and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            is_q = module.endswith("q_proj")
            heads = config["num_attention_heads"] if is_q else config["num_key_value_heads"]
            return unpermute_rope_rows(values, heads)
        return values


# HF parameters that are not a module's weight or bias (named without a suffix).
_BARE_PARAMETERS = frozenset({"self_attn.sinks"})


Shape = tuple[int, ...]


def reshaped(hf_name: str, source: str, hf_shape: Callable[[Shape], Shape],
             values: Callable[[np.ndarray], np.ndarray] = lambda v: v) -> BlockMerge:
    """HF `hf_name` (inside model.layers.N.) from the one GGUF tensor `source` (inside blk.N.):
    `values` applied, then reshaped to `hf_shape(source shape)`."""
    return BlockMerge(hf_name, (source,), shape=hf_shape,
                      build=lambda v: np.ascontiguousarray(values(v)).reshape(hf_shape(v.shape)))


def renamed(hf_name: str, source: str) -> BlockMerge:
    """A tensor stored as HF stores it, under a name the block map cannot place (a bare one, or
    one of more than three parts)."""
    return reshaped(hf_name, source, hf_shape=lambda s: s)


def unsqueezed_conv(hf_name: str, source: str) -> BlockMerge:
    """A depthwise conv weight: llama.cpp squeezes HF's [C, 1, K] to [C, K]."""
    return reshaped(hf_name, source, hf_shape=lambda s: (s[0], 1, s[1]))


def a_log_from_a(a: np.ndarray) -> np.ndarray:
    """HF's A_log from llama.cpp's A = -exp(A_log) (computed in float64: A is tiny or huge at
    the ends); ConfigError for a value that cannot be -exp of anything."""
    if np.any(a >= 0):
        raise ConfigError("ssm_a holds a non-negative value: it must be -exp(A_log)")
    return np.log(-a.astype(np.float64)).astype(np.float32)


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


def float32_value(value: float) -> float:
    """Metadata floats are float32; write their shortest round-trip form (1e-06, not 9.9999e-07)."""
    return float(str(np.float32(value)))


def tensor_rows(header: GGUFHeader, name: str) -> int | None:
    return next((t.shape[0] for t in header.tensors if t.name == name), None)


def required(header: GGUFHeader, key: str) -> Any:
    """The metadata value `<architecture>.<key>`; ConfigError naming the key when it is absent."""
    value = header.arch_value(key)
    if value is None:
        raise ConfigError(f"{header.path} lacks the metadata key {header.architecture}.{key}")
    return value


def common_config(header: GGUFHeader) -> dict[str, Any]:
    """Config fields every llama.cpp decoder architecture stores the same way."""
    heads = int(required(header, "attention.head_count"))
    meta = header.metadata
    vocab = tensor_rows(header, "token_embd.weight") or header.string_array_lengths.get("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "hidden_size": int(required(header, "embedding_length")),
        "intermediate_size": int(required(header, "feed_forward_length")),
        "num_hidden_layers": int(required(header, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.arch_value("attention.head_count_kv", heads)),
        "max_position_embeddings": int(header.arch_value("context_length", 4096)),
        "rms_norm_eps": float32_value(header.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab) if vocab else None,
        "tie_word_embeddings": tensor_rows(header, "output.weight") is None,
        "attention_bias": tensor_rows(header, "blk.0.attn_q.bias") is not None,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "unk_token_id": meta.get("tokenizer.ggml.unknown_token_id"),
    }
    if config["vocab_size"] is None:
        raise ConfigError(f"{header.path} has neither token_embd.weight nor a vocabulary")
    scaling = rope_scaling(header)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def rope_scaling(header: GGUFHeader) -> dict[str, Any] | None:
    """HF `rope_scaling` from the `rope.scaling.*` keys: linear, or YaRN with the keys
    llama.cpp's converter copies from HF (`attention_factor` under either of its two names)."""
    scaling_type = header.arch_value("rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(header.arch_value("rope.scaling.factor"))}
    if scaling_type != "yarn":
        raise ConfigError(f"{header.path} uses RoPE scaling {scaling_type!r}, which is not supported")
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float32_value(required(header, "rope.scaling.factor")),
        "original_max_position_embeddings": int(required(header, "rope.scaling.original_context_length")),
    }
    for key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow"),
                        ("rope.scaling.yarn_attn_factor", "attention_factor"),
                        ("rope.scaling.attn_factor", "attention_factor")):
        value = header.arch_value(key)
        if value is not None:
            scaling[hf_key] = float32_value(value)
    if header.arch_value("rope.scaling.yarn_ext_factor") not in (None, 1.0):
        raise ConfigError(f"{header.path}: YaRN extrapolation factor "
                          f"{header.arch_value('rope.scaling.yarn_ext_factor')} is not supported")
    return scaling


def sliding_layer_flags(header: GGUFHeader, default_pattern: int) -> list[bool]:
    """Which layers slide: `attention.sliding_window_pattern` as llama.cpp stores it (one flag
    per layer, or N: every Nth layer full), else `default_pattern` (llama.cpp's fixed one for
    the architecture)."""
    layers = int(required(header, "block_count"))
    pattern = header.arch_value("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, np.ndarray):
        if len(pattern) != layers:
            raise ConfigError(f"{header.path}: sliding_window_pattern has {len(pattern)} flags for {layers} layers")
        return [bool(flag) for flag in pattern]
    pattern = int(pattern)
    if pattern < 1:
        raise ConfigError(f"{header.path}: sliding_window_pattern {pattern} is not positive")
    return [(i + 1) % pattern != 0 for i in range(layers)]


def layer_types(flags: list[bool]) -> list[str]:
    return ["sliding_attention" if slides else "full_attention" for slides in flags]
