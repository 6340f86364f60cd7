"""KV bytes per token of one max-length request for hybrids with per-request states: the
need, this engine (sync and async) and the mainstream engine's rule without and with
prefix caching. Arithmetic only (no timing); definitions in hybridserve/sim/state_kv_bytes.py.

    python benchmarks/state_kv_bytes.py [--max-model-len 8192 131072] [--batched-tokens 8192]

MODELS holds the fields of each real config.json that decide the KV cache. A model whose
architecture the engine parses gets its layer specs from the engine itself
(`parse_model_config`, `model_kv_layer_specs`); until a family is parsed, a builder below
(keyed by model_type) reads its config with HF's key names, and goes once the engine
parses it. To add a model, add its config here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from hybridserve.core.kv.spec import DEFAULT_BLOCK_SIZE, FullAttentionSpec, KVCacheSpec, MambaSpec
from hybridserve.models.config import SUPPORTED_ARCHITECTURES, parse_model_config
from hybridserve.models.kv_specs import model_kv_layer_specs
from hybridserve.sim.state_kv_bytes import engine_bytes, mainstream_bytes, need_bytes

DTYPE = "bfloat16"

# (label, state kind, config.json fields): ibm-ai-platform/Bamba-9B, ibm-granite/granite-4.0-h-tiny,
# nvidia/Nemotron-H-8B-Base-8K, Qwen/Qwen3-Next-80B-A3B-Instruct, LiquidAI/LFM2-1.2B, ai21labs/Jamba-v0.1.
MODELS: list[tuple[str, str, dict[str, Any]]] = [
    ("Bamba-9B", "Mamba-2 (conv, SSM)", {
        "architectures": ["BambaForCausalLM"], "model_type": "bamba", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128,
        "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0}),
    ("Granite-4.0-H-Tiny", "Mamba-2 (conv, SSM)", {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "vocab_size": 100352,
        "hidden_size": 1536, "intermediate_size": 512, "shared_intermediate_size": 1024, "num_hidden_layers": 40,
        "num_attention_heads": 12, "num_key_value_heads": 4,
        "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
        "num_local_experts": 64, "num_experts_per_tok": 6, "position_embedding_type": "nope",
        "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 256, "rms_norm_eps": 1e-5}),
    ("Nemotron-H-8B", "Mamba-2 (conv, SSM); MLP-only layers", {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072,
        "hidden_size": 4096, "intermediate_size": 21504,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128, "mamba_num_heads": 128,
        "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
        "layer_norm_epsilon": 1e-5}),
    ("Qwen3-Next-80B-A3B", "Gated DeltaNet (conv, recurrent)", {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48, "full_attention_interval": 4,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4}),
    ("LFM2-1.2B", "short convolution (conv)", {
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14]}),
    ("Jamba-v0.1", "Mamba-1 (conv, SSM)", {
        "architectures": ["JambaForCausalLM"], "model_type": "jamba", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4,
        "mamba_expand": 2, "mamba_d_conv": 4, "mamba_d_state": 16}),
]


# -- families the engine does not parse yet: (attention layers, (kv heads, head dim), state shapes) --
def _short_conv(raw: dict[str, Any]) -> tuple[set[int], tuple[int, int], tuple[tuple[int, ...], ...]]:
    """Layers in full_attn_idxs attend; the others keep the last L_cache - 1 inputs of
    hidden_size channels (a conv state only)."""
    hidden = raw["hidden_size"]
    return (set(raw["full_attn_idxs"]), (raw["num_key_value_heads"], hidden // raw["num_attention_heads"]),
            ((hidden, raw["conv_L_cache"] - 1),))


def _mamba1(raw: dict[str, Any]) -> tuple[set[int], tuple[int, int], tuple[tuple[int, ...], ...]]:
    """Layer i attends when i % period == offset; a Mamba-1 layer keeps a conv state of
    d_inner = expand * hidden channels (d_conv - 1 inputs) and an SSM state d_inner x d_state."""
    hidden, period, offset = raw["hidden_size"], raw["attn_layer_period"], raw["attn_layer_offset"]
    d_inner = raw["mamba_expand"] * hidden
    return ({i for i in range(raw["num_hidden_layers"]) if i % period == offset},
            (raw["num_key_value_heads"], hidden // raw["num_attention_heads"]),
            ((d_inner, raw["mamba_d_conv"] - 1), (d_inner, raw["mamba_d_state"])))


UNPARSED: dict[str, Callable[[dict[str, Any]], tuple[set[int], tuple[int, int], tuple[tuple[int, ...], ...]]]] = {
    "lfm2": _short_conv, "jamba": _mamba1}


def layer_specs(raw: dict[str, Any], block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, KVCacheSpec]:
    if any(a in SUPPORTED_ARCHITECTURES for a in raw["architectures"]):
        return model_kv_layer_specs(parse_model_config(raw), block_size, DTYPE)
    attention, (kv_heads, head_dim), shapes = UNPARSED[raw["model_type"]](raw)
    attn = FullAttentionSpec(block_size, kv_heads, head_dim, DTYPE)
    state = MambaSpec(block_size, shapes=shapes, dtype=DTYPE)
    return {f"layers.{i}": attn if i in attention else state for i in range(raw["num_hidden_layers"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-model-len", type=int, nargs="+", default=[8192, 131072])
    p.add_argument("--batched-tokens", type=int, default=8192)
    a = p.parse_args()
    print("| model | state kind | L | mode | need B/tok | hybridserve B/tok (x) | mainstream B/tok (x) [bs] | "
          "mainstream + prefix caching B/tok (x) [bs] |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for label, kind, raw in MODELS:
        specs = layer_specs(raw)
        for length in a.max_model_len:
            for mode, steps in (("sync", 1), ("async", 2)):
                need = need_bytes(specs, length, steps * a.batched_tokens)
                cells = []
                for got in (engine_bytes(specs, length, steps, a.batched_tokens),
                            mainstream_bytes(specs, length, prefix_caching=False),
                            mainstream_bytes(specs, length, prefix_caching=True)):
                    cells.append(f"{got.per_token(length):,.0f} ({got.total / need:.3f})"
                                 + (f" [{got.block_size}]" if cells else ""))
                print(f"| {label} | {kind} | {length:,} | {mode} | {need / length:,.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
