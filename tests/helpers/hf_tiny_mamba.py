"""Tiny random HF Mamba2ForCausalLM, BambaForCausalLM, GraniteMoeHybridForCausalLM,
NemotronHForCausalLM, FalconH1ForCausalLM, Qwen3NextForCausalLM, Lfm2ForCausalLM and
JambaForCausalLM, and HF greedy as the oracle.

hidden 64, vocab 512, 8 Mamba heads of 16 channels, state 16, 2 groups, kernel 4, SSD
chunks of 16 (so 40-100 token prompts cross several); Mamba2: 3 layers; Bamba: 4
layers, layer 1 attention (4 query / 2 KV heads, half of each head rotated); Granite 4.0-H:
Bamba's layout without RoPE (as its checkpoints), 4 experts of 32 (top 2) beside a shared
MLP of 64, and every multiplier away from 1; Nemotron-H: 5 layers "M-*M-" (Mamba2, MLP of
128, attention without RoPE, Mamba2, MLP); Falcon-H1: 2 layers of attention (RoPE) beside a
mixer with its gated RMSNorm (norm before gate), every multiplier away from 1 (4 cache layers,
so a pipeline of 2 stages holds one whole layer each).
Qwen3-Next: 4 layers, Gated DeltaNet (2 key heads, 4 value heads, dims 16, kernel 4) and
gated attention (4 query / 2 KV heads of 16, a quarter rotated) alternating; 4 experts,
top 2, a shared expert; layer 2 a dense MLP; norms drawn at random. "qwen3_5" (not in
KINDS: tests/models/test_qwen3_next.py runs it) is the same with a dense MLP of 96 in each layer.
LFM2: 4 layers, layer 1 attention (4 query / 2 KV heads, q / k norms), the others short
convolutions of kernel 3, MLP 128 wide, tied head, norms drawn at random. Jamba: 4
layers, layer 1 attention without RoPE, the others Mamba1 (128 channels, state 16, dt
rank 8, kernel 4); layers 1 and 3 route over 4 experts (top 2), MLPs 96 wide.
initializer_range 0.3 gives peaky logits, so greedy choices are not near-ties.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tests.helpers import hf_tiny

KINDS = ("mamba2", "bamba", "granite", "nemotron_h", "falcon_h1", "qwen3_next", "lfm2", "jamba")
EXTRA_KINDS = ("qwen3_5",)  # built and checked like KINDS, outside their shared matrices
# One kind per distinct mixer and state layout, for the hand-run state checks: Granite 4.0-H
# and Nemotron-H run Bamba's mixer, Falcon-H1 its own gate and layer pairs, Qwen3-Next the
# Gated DeltaNet, LFM2 the short convolution (one state part), Jamba Mamba1.
MIXER_KINDS = ("mamba2", "bamba", "falcon_h1", "qwen3_next", "lfm2", "jamba")
CHUNK = 16


def hf_config(kind: str):
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, initializer_range=0.3, eos_token_id=None, pad_token_id=0,
                  bos_token_id=1, tie_word_embeddings=False)
    if kind == "mamba2":
        return tf.Mamba2Config(num_heads=8, head_dim=16, state_size=16, n_groups=2, conv_kernel=4,
                               chunk_size=CHUNK, num_hidden_layers=3, **common)
    if kind == "bamba":
        return tf.BambaConfig(intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16,
                              mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=CHUNK,
                              max_position_embeddings=2048, **common)
    if kind == "granite":
        return tf.GraniteMoeHybridConfig(
            intermediate_size=32, shared_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["mamba", "attention", "mamba", "mamba"], position_embedding_type="nope",
            embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
            mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=CHUNK,
            max_position_embeddings=2048, **common)
    if kind == "nemotron_h":
        return tf.NemotronHConfig(
            hybrid_override_pattern="M-*M-", intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
            chunk_size=CHUNK, max_position_embeddings=2048, **common)
    if kind == "falcon_h1":
        return tf.FalconH1Config(
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            mamba_d_ssm=128, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
            mamba_chunk_size=CHUNK, mamba_rms_norm=True, max_position_embeddings=2048, embedding_multiplier=2.0,
            lm_head_multiplier=0.5, mlp_multipliers=[0.8, 1.2], key_multiplier=0.7, attention_in_multiplier=1.3,
            attention_out_multiplier=0.9, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_in_multiplier=0.75,
            ssm_out_multiplier=1.25, **common)
    if kind == "qwen3_5":  # Qwen3-Next's layers, a dense MLP in each
        return tf.Qwen3_5TextConfig(intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                    linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=2048,
                                    **common)
    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[2],
                                  full_attention_interval=2, max_position_embeddings=2048, **common)
    if kind == "lfm2":
        # intermediate 192 -> 2/3 = 128 (block_auto_adjust_ff_dim), a multiple of 32.
        return tf.Lfm2Config(intermediate_size=192, block_multiple_of=32, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
                             layer_types=["conv", "full_attention", "conv", "conv"], max_position_embeddings=2048,
                             **{**common, "tie_word_embeddings": True})
    if kind == "jamba":
        return tf.JambaConfig(intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                              num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                              mamba_dt_rank=8, max_position_embeddings=2048, **common)
    raise ValueError(kind)


# Where the norms are drawn from instead of HF's constant start: Qwen3-Next's (1 + w) norms
# start at 0 and its gated norm at 1, LFM2's and Jamba's at 1, so a swap of two norms
# would not show.
NORM_DRAWS = {"qwen3_next": (-0.5, 0.5), "qwen3_5": (-0.5, 0.5), "lfm2": (0.5, 1.5), "jamba": (0.5, 1.5)}


def build_tiny(kind: str, out_dir: Path, seed: int = 0, **config_changes: object) -> Path:
    """`config_changes`: HF config fields set over hf_config(kind)'s."""
    from transformers import AutoModelForCausalLM

    config = hf_config(kind)
    for key, value in config_changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    norms = NORM_DRAWS.get(kind)
    if norms is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(*norms)
    model.generation_config.eos_token_id = None
    model.save_pretrained(out_dir)
    return out_dir


_DIRS: dict[str, Path] = {}
_ROOT: list[Path] = []
_HF: dict[str, object] = {}
_ORACLE: dict[tuple[str, tuple[int, ...], int], tuple[list[int], list[float]]] = {}


def tiny_model_dir(kind: str) -> Path:
    """Built once per test process, in a temporary directory removed at exit."""
    if kind not in _DIRS:
        if not _ROOT:
            import atexit
            import shutil
            import tempfile

            _ROOT.append(Path(tempfile.mkdtemp(prefix="hybridserve_tiny_mamba_")))
            atexit.register(shutil.rmtree, _ROOT[0], True)
        _DIRS[kind] = build_tiny(kind, _ROOT[0] / kind)
    return _DIRS[kind]


def load_hf(kind: str):
    from transformers import AutoModelForCausalLM

    if kind not in _HF:
        _HF[kind] = AutoModelForCausalLM.from_pretrained(tiny_model_dir(kind), dtype=torch.float32).eval()
    return _HF[kind]


@contextmanager
def one_thread() -> Iterator[None]:
    """HF's Mamba path runs dozens of tiny ops per token; with 2 intra-op threads on a
    busy 2-core machine each op waits for the slower thread (measured: 5.5 s -> 0.16 s
    for 12 tokens). Only float summation order depends on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def oracle(kind: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF greedy tokens and logprobs (memoised)."""
    key = (kind, tuple(prompt), max_new_tokens)
    if key not in _ORACLE:
        with one_thread():
            _ORACLE[key] = hf_tiny.hf_greedy(load_hf(kind), prompt, max_new_tokens)
    return _ORACLE[key]
