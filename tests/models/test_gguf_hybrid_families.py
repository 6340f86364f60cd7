"""GGUF files of Falcon-H1 and Jamba, written as llama.cpp's converter writes them
(tests/helpers/gguf_from_hf_hybrid.py), converted and served: greedy tokens equal HF's on the
model the file was written from.

The tiny models are tests/helpers/hf_tiny_mamba.py's, made GGUF-expressible where llama.cpp
fixes what HF leaves open: Falcon-H1's gated norm gates before it norms (llama.cpp's only
order), and runs once without the gated norm; its RoPE base is away from llama.cpp's default
so a lost key would show. Every Falcon-H1 multiplier stays away from 1: the file holds them
folded into the weights only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.config import load_model_config  # noqa: E402
from hybridserve.models.loaders.gguf_jamba import period_and_offset  # noqa: E402
from hybridserve.models.loaders.gguf_loader import convert_gguf  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny, hf_tiny_mamba  # noqa: E402
from tests.helpers.gguf_from_hf_hybrid import CONTENT, GGUFContent, read_checkpoint, write_gguf  # noqa: E402
from tests.helpers.torch_engine import NEW_TOKENS, make_engine_for, run  # noqa: E402

PROMPTS = hf_tiny.random_prompts(2, 40, 90, vocab=512, seed=11)
FALCON_ROPE = {"rope_parameters": {"rope_theta": 1_000_000.0, "rope_type": "default"}}
CASES = {
    "falcon_h1": ("falcon_h1", {"mamba_norm_before_gate": False, **FALCON_ROPE}),
    "falcon_h1-gate-only": ("falcon_h1", {"mamba_rms_norm": False, **FALCON_ROPE}),
    "jamba": ("jamba", {}),
}


def _content(case: str, folder: Path) -> GGUFContent:
    kind, changes = CASES[case]
    hf_tiny_mamba.build_tiny(kind, folder / "hf", **changes)
    return CONTENT[kind](*read_checkpoint(folder / "hf"))


def _convert(content: GGUFContent, folder: Path) -> Path:
    write_gguf(content, folder / "model.gguf")
    return convert_gguf(folder / "model.gguf", cache_dir=folder / "cache", progress=False)


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_greedy_tokens_equal_hf(case: str, tmp_path: Path) -> None:
    converted = _convert(_content(case, tmp_path), tmp_path)
    cfg, hf_cfg = load_model_config(converted), load_model_config(tmp_path / "hf")
    assert (cfg.family, cfg.layer_types) == (hf_cfg.family, hf_cfg.layer_types)
    got = run(make_engine_for(load_model(converted), async_scheduling=False), PROMPTS)
    reference = hf_tiny.load_hf(tmp_path / "hf")
    with hf_tiny_mamba.one_thread():
        for i, prompt in enumerate(PROMPTS):
            want, _ = hf_tiny.hf_greedy(reference, prompt, NEW_TOKENS)
            assert got[f"r{i}"][0] == want, f"{case} prompt {i}"


def test_config_facts_read_from_each_file(tmp_path: Path) -> None:
    """The keys and tensors each converter writes land in the HF config as they say."""
    facts = {}
    for case in ("falcon_h1", "falcon_h1-gate-only", "jamba"):
        facts[case] = json.loads((_convert(_content(case, tmp_path / case), tmp_path / case) / "config.json")
                                 .read_text())
    falcon = facts["falcon_h1"]
    # 8 heads (time_step_rank) over a width of 128: 16 channels each; 2 groups of state 16.
    assert (falcon["mamba_n_heads"], falcon["mamba_d_head"], falcon["mamba_d_ssm"]) == (8, 16, 128)
    assert (falcon["mamba_n_groups"], falcon["mamba_d_state"], falcon["mamba_d_conv"]) == (2, 16, 4)
    assert (falcon["mamba_rms_norm"], falcon["mamba_norm_before_gate"], falcon["rope_theta"]) == (True, False, 1e6)
    assert (falcon["head_dim"], falcon["num_key_value_heads"], falcon["tie_word_embeddings"]) == (16, 2, False)
    # Folded into the weights: every multiplier is 1 in the config.
    assert falcon["ssm_multipliers"] == [1.0] * 5 and falcon["mlp_multipliers"] == [1.0, 1.0]
    assert falcon["embedding_multiplier"] == falcon["lm_head_multiplier"] == falcon["key_multiplier"] == 1.0
    assert facts["falcon_h1-gate-only"]["mamba_rms_norm"] is False
    jamba = facts["jamba"]
    # KV heads [0, 2, 0, 0] per layer: attention at layer 1 only; router tensors on layers 1 and 3.
    assert (jamba["attn_layer_period"], jamba["attn_layer_offset"]) == (4, 1)
    assert (jamba["expert_layer_period"], jamba["expert_layer_offset"]) == (2, 1)
    assert (jamba["num_key_value_heads"], jamba["num_experts"], jamba["num_experts_per_tok"]) == (2, 4, 2)
    assert (jamba["mamba_expand"], jamba["mamba_dt_rank"], jamba["mamba_conv_bias"]) == (2, 8, True)


@pytest.mark.parametrize("layers, num_layers, want", [
    ({4, 12, 20, 28}, 32, (8, 4)),  # Jamba v0.1's attention layers
    (set(range(1, 32, 2)), 32, (2, 1)),  # its expert layers
    ({1}, 4, (4, 1)),
    (set(range(6)), 6, (1, 0)),
    (set(), 4, (5, 4)),  # none: an offset no layer reaches
])
def test_period_and_offset_by_hand(layers: set[int], num_layers: int, want: tuple[int, int]) -> None:
    assert period_and_offset(layers, num_layers, "attention") == want


def test_irregular_attention_layers_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"attention layers \[1, 2\]"):
        period_and_offset({1, 2}, 8, "attention")


@pytest.mark.parametrize("case, change, needle", [
    ("falcon_h1", ("drop_key", "ssm_group_count"), "falcon-h1.ssm.group_count"),
    ("falcon_h1", ("add_tensor", "blk.0.ssm_x.weight"), "blk.0.ssm_x.weight"),
    ("falcon_h1", ("add_key", "falcon-h1.ssm.has_mup"), "falcon-h1.ssm.has_mup"),  # Falcon-H1's own converter
    ("jamba", ("drop_key", "expert_count"), "jamba.expert_count"),
    ("jamba", ("add_tensor", "blk.1.ssm_norm.weight"), "blk.1.ssm_norm.weight"),
])
def test_missing_key_or_unknown_tensor_is_named(case: str, change: tuple[str, str], needle: str,
                                               tmp_path: Path) -> None:
    content = _content(case, tmp_path)
    what, name = change
    if what == "drop_key":
        del content.metadata[name]
    elif what == "add_key":
        content.metadata[name] = ("add_bool", name, True)
    else:
        content.tensors[name] = torch.zeros(4).numpy()
    with pytest.raises(ConfigError, match=needle) as error:
        _convert(content, tmp_path)
    assert "\n" not in str(error.value)



@pytest.mark.parametrize("tp_size", [1, 2])
def test_stacked_jamba_experts_load_as_per_expert_ones(tp_size: int, tmp_path: Path) -> None:
    """jamba_loader's two expert layouts (the Hub's per-expert tensors, and transformers' own
    stacked ones a converted GGUF holds) fill the same weights, whole and as each
    tensor-parallel rank's share."""
    import shutil

    from safetensors.torch import save_file

    from hybridserve.models.parallel import TPGroup

    per_expert = hf_tiny_mamba.tiny_model_dir("jamba")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(per_expert / "config.json", stacked / "config.json")
    state = hf_tiny_mamba.load_hf("jamba").state_dict()
    assert state["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (4, 192, 64)  # [E, 2F, D]
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(stacked / "model.safetensors"))
    for rank in range(tp_size):
        want = load_model(per_expert, tp=TPGroup(rank, tp_size)).state_dict()
        got = load_model(stacked, tp=TPGroup(rank, tp_size)).state_dict()
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), (rank, name)
