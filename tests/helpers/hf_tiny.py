"""Tiny random HF models of each supported architecture, and HF greedy generation as oracle.

Models: hidden 64, 4 layers (Gemma3: 6), 4 query / 2 KV heads, float32,
initializer_range 0.3 (peaky logits, so greedy choices are not near-ties), windows of
16 so 40-120 token prompts cross them, eos unset so nothing stops early. The families
added with their own norm placements (OLMo 3, Cohere2, EXAONE 4, Gemma 3 multimodal) get
random norm weights too (HF initialises them to ones, which would hide a norm weight read
into the wrong place).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

WINDOW = 16

_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.3, eos_token_id=None,
    bos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6,
)


def hf_config(kind: str, window: int = WINDOW):
    import transformers as tf

    c = dict(_COMMON)
    if kind == "llama":
        return tf.LlamaConfig(tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **c)
    if kind == "mistral":
        return tf.MistralConfig(sliding_window=window, tie_word_embeddings=False, **c)
    if kind == "qwen2":
        return tf.Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=2,
                              tie_word_embeddings=True, **c)
    if kind == "gemma2":
        return tf.Gemma2Config(sliding_window=window, head_dim=16, query_pre_attn_scalar=24,
                               attn_logit_softcapping=5.0, final_logit_softcapping=10.0, **c)
    if kind == "gemma3":
        c["num_hidden_layers"] = 6
        return tf.Gemma3TextConfig(
            sliding_window=window, head_dim=16, query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
            **c,
        )
    if kind == "gemma3_mm":  # the multimodal checkpoint: the gemma3 text model beside a tiny vision tower
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=28, patch_size=14)
        return tf.Gemma3Config(text_config=hf_config("gemma3", window).to_dict(), vision_config=vision.to_dict(),
                               mm_tokens_per_image=4)
    if kind == "olmo3":  # 3 sliding : 1 full, each type its own RoPE
        return tf.Olmo3Config(sliding_window=window, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}}, **c)
    if kind == "cohere2":  # 3 sliding : 1 full (no RoPE); logit scale a power of two, as Command R7B's
        c.pop("rms_norm_eps")
        return tf.Cohere2Config(sliding_window=window, layer_norm_eps=1e-5, logit_scale=0.25,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **c)
    if kind == "exaone4":  # 8 layers "LLLG" twice: full layers without RoPE, Llama 3 RoPE scaling
        c.update(num_hidden_layers=8)
        return tf.Exaone4Config(sliding_window=window, sliding_window_pattern=4, rope_parameters={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}, **c)
    if kind == "llama4":
        # Layers: chunked+dense, chunked+MoE, chunked+dense, NoPE global+MoE. Chunks of 2 * window
        # (two blocks of 16, so chunks are read across blocks and prefix hits land mid-chunk);
        # floor_scale 16 makes the NoPE temperature change inside the test prompts.
        c.update(vocab_size=512, intermediate_size=64)
        return tf.Llama4TextConfig(
            head_dim=16, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=2 * window,
            attn_temperature_tuning=True, floor_scale=16, attn_scale=0.5, use_qk_norm=True,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **c,
        )
    if kind == "gpt_oss":
        # Alternating sliding / full; YaRN over an original context of 64 (most frequencies
        # interpolated, cos/sin scaled by 1 + 0.1 ln 4); a clamp limit of 3 that the random
        # activations cross. Sinks and expert biases are randomised in build_tiny.
        c.update(intermediate_size=64, max_position_embeddings=256)  # 256 = 4 x 64: YaRN's stated factor
        return tf.GptOssConfig(
            head_dim=16, sliding_window=window, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=3.0,
            tie_word_embeddings=False, rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64}, **c,
        )
    raise ValueError(kind)


KINDS = ("llama", "mistral", "qwen2", "gemma2", "gemma3", "gemma3_mm", "olmo3", "cohere2",
         "exaone4", "gpt_oss")  # llama4 has its own test file
_RANDOM_NORMS = ("gemma3_mm", "olmo3", "cohere2", "exaone4")


def randomize_norms(model: torch.nn.Module, kind: str) -> None:
    """Norm weights drawn at random for the kinds in _RANDOM_NORMS (the others keep HF's init)."""
    if kind not in _RANDOM_NORMS:
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "vision" not in name:
                param.uniform_(0.5, 1.5)


def build_tiny(kind: str, out_dir: Path, seed: int = 0, window: int = WINDOW, **config_changes: object) -> Path:
    """Write a tiny random `kind` model to out_dir with save_pretrained; returns out_dir.
    `config_changes` replace fields of hf_config(kind)."""
    model = tiny_model(kind, seed=seed, window=window, **config_changes)
    model.save_pretrained(out_dir)
    return out_dir


def tiny_model(kind: str, seed: int = 0, window: int = WINDOW, **config_changes: object):
    """The random model build_tiny saves (see there)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(kind, window)
    if config_changes:
        config = type(config).from_dict({**config.to_dict(), **config_changes})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms(model, kind)
    model.generation_config.eos_token_id = None
    if kind == "gpt_oss":  # HF starts the expert biases at zero and the sinks small: make them count
        with torch.no_grad():
            for name, prm in model.named_parameters():
                if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias", "sinks")):
                    prm.normal_(0.0, 1.0)
    return model


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    attn = "eager"  # Gemma2 soft-capping needs eager; use it everywhere for one code path
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF greedy continuation of one prompt (batch 1, no padding) and each token's logprob."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
            eos_token_id=None, return_dict_in_generate=True, output_logits=True,
        )
    new = out.sequences[0, len(prompt):]
    logp = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
    return new.tolist(), logp.gather(-1, new[:, None]).squeeze(-1).tolist()


def random_prompts(n: int, lo: int, hi: int, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


_DIRS: dict[tuple[str, int], Path] = {}
_ROOT: list[Path] = []
_ORACLE: dict[tuple[str, tuple[int, ...], int], tuple[list[int], list[float]]] = {}
_HF_MODELS: dict[str, object] = {}


def tiny_model_dir(kind: str, window: int = WINDOW) -> Path:
    """A tiny model of `kind`, built once per test process and shared by every test file."""
    key = (kind, window)
    if key not in _DIRS:
        if not _ROOT:
            import atexit
            import shutil
            import tempfile

            root = Path(tempfile.mkdtemp(prefix="hybridserve_tiny_"))
            atexit.register(shutil.rmtree, root, True)
            _ROOT.append(root)
        _DIRS[key] = build_tiny(kind, _ROOT[0] / f"{kind}_w{window}", window=window)
    return _DIRS[key]


def oracle(kind: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF greedy tokens and logprobs for one prompt of the shared tiny `kind` model (memoised)."""
    key = (kind, tuple(prompt), max_new_tokens)
    if key not in _ORACLE:
        _ORACLE[key] = hf_greedy(hf_model(kind), prompt, max_new_tokens)
    return _ORACLE[key]



def hf_model(kind: str):
    """The HF model of the shared tiny `kind` model (loaded once)."""
    if kind not in _HF_MODELS:
        _HF_MODELS[kind] = load_hf(tiny_model_dir(kind))
    return _HF_MODELS[kind]


def hf_prompt_logprobs(model, prompt: list[int], n_top: int) -> tuple[list[float], list[list[int]]]:
    """HF's logprob of each prompt token after the first, given the tokens before it (one
    forward of the whole prompt, batch 1), and the n_top most likely token ids there."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1]
    logp = logits.float().log_softmax(-1)
    values = logp.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1).tolist()
    return values, logp.topk(n_top, dim=-1).indices.tolist() if n_top else []
