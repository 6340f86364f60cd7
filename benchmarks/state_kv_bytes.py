"""KV bytes per token of one max-length request for hybrids with per-request states: the
need, this engine (sync and async) and the mainstream engine's rule without and with
prefix caching. Arithmetic only (no timing); definitions in hybridserve/sim/state_kv_bytes.py.

    python benchmarks/state_kv_bytes.py [--max-model-len 8192 131072] [--batched-tokens 8192]

MODELS holds the fields of each real config.json that shape the model; the engine itself
parses each (`parse_model_config`) into its layer specs (`model_kv_layer_specs`). To add a
model, add its config here.
"""

from __future__ import annotations

import argparse
from typing import Any

from hybridserve.core.kv.spec import DEFAULT_BLOCK_SIZE, KVCacheSpec
from hybridserve.models.config import parse_model_config
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
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "decoder_sparse_step": 1,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512,
        "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
        "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
        "rope_theta": 10000000, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "vocab_size": 151936}),
    ("LFM2-1.2B", "short convolution (conv)", {
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 2048,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "block_ff_dim": 12288,
        "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
        "conv_L_cache": 3, "conv_bias": False, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "norm_eps": 1e-5,
        "rope_theta": 1000000.0, "tie_embedding": True, "max_position_embeddings": 128000}),
    ("Jamba-v0.1", "Mamba-1 (conv, SSM)", {
        "architectures": ["JambaForCausalLM"], "model_type": "jamba", "vocab_size": 65536, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 16, "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_dt_rank": 256, "mamba_conv_bias": True, "mamba_proj_bias": False, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}),
]


def layer_specs(raw: dict[str, Any], block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, KVCacheSpec]:
    return model_kv_layer_specs(parse_model_config(raw), block_size, DTYPE)


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
