"""GGUF files of pure Mamba2, Granite 4.0-H, Bamba and Nemotron-H, written as llama.cpp's converter
writes them (tests/helpers/gguf_from_hf_recurrent_mamba2.py) from the tiny HF models of
hf_tiny_mamba, converted and served: the converted checkpoint holds HF's own tensors under
HF's own names (so Q/K rows restored even where no RoPE would show a wrong order), and greedy
tokens equal HF's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("transformers")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.request import Request, SamplingParams  # noqa: E402
from hybridserve.core.sched.config import SchedulerConfig  # noqa: E402
from hybridserve.engine.loop import build_engine  # noqa: E402
from hybridserve.executor.torch.executor import TorchExecutor  # noqa: E402
from hybridserve.models.config import load_model_config  # noqa: E402
from hybridserve.models.loaders.gguf_loader import convert_gguf  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny, hf_tiny_mamba as tiny  # noqa: E402
from tests.helpers.gguf_from_hf_recurrent_mamba2 import write_gguf  # noqa: E402
from tests.helpers.mamba_engine import BS, NEW_TOKENS, PROMPTS  # noqa: E402
from tests.helpers.tiny_models import model_dir  # noqa: E402
from tests.helpers.torch_engine import step_until_done  # noqa: E402

# Nemotron-H sizes its mixer by heads alone: 8 heads of 12 (96 wide) beside a hidden size of 64.
NARROW_NEMOTRON = "nemotron_h_heads_of_12"
# (tiny model, the family its file is written as): the three kinds, Granite without experts
# and with RoPE (its dense MLP as ffn_gate / ffn_up / ffn_down, its Q/K order visible in the
# tokens), Bamba (granitehybrid too, half of each head rotated), Mamba2 with projection biases
# and one group, the narrow Nemotron-H mixer.
CASES = [("mamba2", "mamba2"), ("granite", "granite"), ("nemotron_h", "nemotron_h"),
         ("granite_rope_dense", "granite"), ("bamba", "bamba"), ("mamba2_1group_bias", "mamba2"),
         (NARROW_NEMOTRON, "nemotron_h")]
# What each file's keys must become in the HF config (the tiny models' numbers).
CONFIG_FACTS = {
    "granite": {"layer_types": ["mamba", "attention", "mamba", "mamba"], "embedding_multiplier": 4.0,
                "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 2.0,
                "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                "shared_intermediate_size": 64, "position_embedding_type": "nope", "mamba_n_heads": 8,
                "mamba_d_head": 16, "mamba_expand": 2, "mamba_n_groups": 2},
    "granite_rope_dense": {"num_local_experts": 0, "position_embedding_type": "rope", "rope_theta": 10000.0,
                           "shared_intermediate_size": 64},
    "nemotron_h": {"hybrid_override_pattern": "M-*M-", "head_dim": 16, "num_key_value_heads": 2,
                   "intermediate_size": 128, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2, "expand": 2, "use_conv_bias": True,
               "use_bias": False},
    "mamba2_1group_bias": {"n_groups": 1, "use_bias": True},
    "bamba": {"architectures": ["BambaForCausalLM"], "attn_layer_indices": [1], "attn_rotary_emb": 8,
              "intermediate_size": 128, "mamba_n_heads": 8, "max_position_embeddings": 2048},
    NARROW_NEMOTRON: {"mamba_num_heads": 8, "mamba_head_dim": 12},
}
_BUILT: dict[str, Path] = {}


def _model_dir(kind: str) -> Path:
    """tiny_models' folder of `kind`, or the narrow Nemotron-H (built once per process)."""
    if kind != NARROW_NEMOTRON:
        return model_dir(kind)
    if kind not in _BUILT:
        from transformers import AutoModelForCausalLM

        config = tiny.hf_config("nemotron_h")
        config.mamba_head_dim = 12
        torch.manual_seed(0)
        folder = tiny.tiny_model_dir("nemotron_h").parent / kind
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        _BUILT[kind] = folder
    return _BUILT[kind]


def _hf_state(kind: str) -> dict[str, np.ndarray]:
    """The tensors of the HF checkpoint as saved (the names llama.cpp's converter reads)."""
    from safetensors.numpy import load_file

    return load_file(str(_model_dir(kind) / "model.safetensors"))


def _write(kind: str, family: str, folder: Path, **broken: object) -> Path:
    from transformers import AutoConfig

    path = folder / f"{kind}.gguf"
    config = AutoConfig.from_pretrained(_model_dir(kind))
    write_gguf(family, config, _hf_state(kind), path, **broken)  # type: ignore[arg-type]
    return path


def _convert(path: Path, folder: Path) -> Path:
    return convert_gguf(path, cache_dir=folder / "cache", progress=False)


def _hf_greedy(kind: str, prompt: list[int]) -> list[int]:
    if kind in tiny.KINDS:
        return tiny.oracle(kind, prompt, NEW_TOKENS)[0]
    with tiny.one_thread():
        return hf_tiny.hf_greedy(hf_tiny.load_hf(_model_dir(kind)), prompt, NEW_TOKENS)[0]


@pytest.mark.parametrize("kind, family", CASES, ids=[kind for kind, _ in CASES])
def test_gguf_checkpoint_is_hf_and_greedy_tokens_equal_hf(kind: str, family: str, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    converted = _convert(_write(kind, family, tmp_path), tmp_path)
    got, want = load_file(str(converted / "model.safetensors")), _hf_state(kind)
    assert set(got) == set(want)
    for name, values in want.items():
        # A_log is read back as log(-(-exp(A_log))): float32 rounding, nothing more.
        np.testing.assert_allclose(got[name], values, rtol=1e-6, atol=0, err_msg=name)
    raw = json.loads((converted / "config.json").read_text())
    assert {key: raw[key] for key in CONFIG_FACTS[kind]} == CONFIG_FACTS[kind]
    cfg, hf_cfg = load_model_config(converted), load_model_config(_model_dir(kind))
    assert (cfg.family, cfg.layer_types, cfg.hybrid, cfg.embed_scale, cfg.attn_scale, cfg.intermediate_size,
            cfg.rope) == (hf_cfg.family, hf_cfg.layer_types, hf_cfg.hybrid, hf_cfg.embed_scale, hf_cfg.attn_scale,
                          hf_cfg.intermediate_size, hf_cfg.rope)
    assert replace(cfg.mamba, chunk_size=0) == replace(hf_cfg.mamba, chunk_size=0)  # no file holds the chunk
    executor = TorchExecutor(load_model(converted), use_worker_thread=False)
    engine = build_engine(SchedulerConfig(max_model_len=160, async_scheduling=False),
                          executor.kv_cache_config(BS, num_blocks=200), executor)
    prompts = PROMPTS[:2]
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS)))
    try:
        with tiny.one_thread():
            done = step_until_done(engine)
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert done[f"r{i}"][0] == _hf_greedy(kind, prompt), f"{kind} prompt {i}"


@pytest.mark.parametrize("kind, broken, needle", [
    ("mamba2", {"key_changes": {"ssm.group_count": None}}, r"mamba2\.ssm\.group_count"),
    ("mamba2", {"key_changes": {"ssm.group_count": 3}}, "8 SSM heads do not split into 3 groups"),
    ("granite", {"extra_tensors": {"blk.0.ssm_x.weight": np.zeros((4, 4), np.float32)}}, r"blk\.0\.ssm_x\.weight"),
    ("nemotron_h", {"key_changes": {"ssm.inner_size": None}}, r"nemotron_h\.ssm\.inner_size"),
    ("nemotron_h", {"key_changes": {"feed_forward_length": [128] * 5}}, "layer 2 has both KV heads and an MLP"),
    # Bamba rotates half of each head, Granite 4.0-H all of it: a quarter is neither.
    ("bamba", {"key_changes": {"rope.dimension_count": 4}}, "RoPE over 4 of 16 head dims"),
])
def test_a_broken_file_is_refused_by_name(kind: str, broken: dict, needle: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=needle) as error:
        _convert(_write(kind, kind, tmp_path, **broken), tmp_path)
    assert "\n" not in str(error.value)
