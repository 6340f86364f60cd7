"""One tiny model directory per kind, whichever builder makes it, and its HF greedy tokens.

`model_dir(kind)`: the decoder kinds of hf_tiny (llama4 included), the recurrent kinds
of hf_tiny_mamba, and a few variants with some HF config fields changed (biases, group
and KV-head counts) or saved another way (stacked experts) for the tensor-parallel tests. Each is built once per test process.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import hf_tiny, hf_tiny_mamba

_VARIANTS: dict[str, Path] = {}


def _variant(name: str, base: object, random_biases: bool = False, **changes: object) -> Path:
    """A tiny model built from an HF config with some fields changed (biases, group counts);
    random_biases draws the biases HF's init leaves at zero."""
    if name not in _VARIANTS:
        import torch
        from transformers import AutoModelForCausalLM

        for key, value in changes.items():
            setattr(base, key, value)
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(base, dtype=torch.float32)
        hf_tiny.randomize_norms(model, getattr(base, "model_type", ""))
        if random_biases:
            with torch.no_grad():
                for param_name, param in model.named_parameters():
                    if param_name.endswith("bias"):
                        param.uniform_(-0.5, 0.5)
        root = hf_tiny.tiny_model_dir("llama").parent  # the shared temporary folder
        _VARIANTS[name] = root / name
        model.save_pretrained(_VARIANTS[name])
    return _VARIANTS[name]


def _saved_as_held(name: str, kind: str) -> Path:
    """The tiny recurrent `kind` model saved under its parameters' in-memory names and shapes
    (transformers saves stacked experts per expert; a converted GGUF keeps them stacked)."""
    if name not in _VARIANTS:
        from safetensors.torch import save_file

        model = hf_tiny_mamba.load_hf(kind)
        _VARIANTS[name] = hf_tiny.tiny_model_dir("llama").parent / name  # the shared temporary folder
        model.config.save_pretrained(_VARIANTS[name])
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  str(_VARIANTS[name] / "model.safetensors"), metadata={"format": "pt"})
    return _VARIANTS[name]


def model_dir(kind: str) -> Path:
    if kind in hf_tiny_mamba.KINDS + hf_tiny_mamba.EXTRA_KINDS:
        return hf_tiny_mamba.tiny_model_dir(kind)
    if kind == "llama_bias":  # biases of the row-parallel o and down: added once, by rank 0
        return _variant(kind, hf_tiny.hf_config("llama"), attention_bias=True, mlp_bias=True)
    if kind == "bamba_1group":  # one Mamba group over 2 ranks: the gated norm sums across ranks
        return _variant(kind, hf_tiny_mamba.hf_config("bamba"), mamba_n_groups=1)
    if kind == "granite_rope_dense":  # Granite 4.0-H without experts, its attention rotated (all of each head)
        return _variant(kind, hf_tiny_mamba.hf_config("granite"), num_local_experts=0, position_embedding_type="rope",
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "falcon_h1_gate_only":  # Falcon-H1 without the mixer's RMSNorm: y * silu(z) alone
        return _variant(kind, hf_tiny_mamba.hf_config("falcon_h1"), mamba_rms_norm=False)
    if kind == "gemma3_1kv":  # one KV head over 2 ranks: both keep (and cache) it
        return _variant(kind, hf_tiny.hf_config("gemma3"), num_key_value_heads=1)
    if kind == "olmo3_1kv":  # one KV head over 2 ranks: both hold all of k, whose norm spans the projection
        return _variant(kind, hf_tiny.hf_config("olmo3"), num_key_value_heads=1)
    if kind == "cohere2_bias":  # attention biases: the o bias added once inside the parallel block's sum
        return _variant(kind, hf_tiny.hf_config("cohere2"), attention_bias=True)
    if kind == "lfm2_bias":  # convolution biases: in_proj and conv cut by channel, out_proj's added once
        return _variant(kind, hf_tiny_mamba.hf_config("lfm2"), random_biases=True, conv_bias=True)
    if kind == "qwen3_next_stacked":  # experts as mlp.experts.gate_up_proj / down_proj, cut per rank
        return _saved_as_held(kind, "qwen3_next")
    if kind == "mamba2_1group_bias":
        return _variant(kind, hf_tiny_mamba.hf_config("mamba2"), n_groups=1, use_bias=True)
    return hf_tiny.tiny_model_dir(kind)


def greedy_tokens(kind: str, prompt: list[int], n: int) -> list[int]:
    """HF's greedy continuation of `prompt` on the tiny `kind` model (memoised)."""
    if kind in hf_tiny_mamba.KINDS + hf_tiny_mamba.EXTRA_KINDS:
        return hf_tiny_mamba.oracle(kind, prompt, n)[0]
    return hf_tiny.oracle(kind, prompt, n)[0]
