"""Config and checkpoint spellings of the sliding-window families (Gemma 3 multimodal, OLMo 3,
Cohere2, EXAONE 4) that the tiny HF models of hf_tiny do not write themselves."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.config import FULL, SLIDING, parse_model_config  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.flat_backend import FlatBackend  # noqa: E402

# google/gemma-3-4b-it's config.json as published: its text_config states only what differs
# from Gemma3TextConfig's defaults (vision_config left out here: the text model never reads it).
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
    "mm_tokens_per_image": 256, "image_token_index": 262144,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
}


def test_gemma3_multimodal_text_config_takes_gemma3_text_defaults() -> None:
    cfg = parse_model_config(GEMMA3_4B)
    assert (cfg.architecture, cfg.family) == ("Gemma3ForConditionalGeneration", "gemma3")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (262_208, 2560, 34)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 4, 256)
    assert cfg.activation == "gelu_tanh" and cfg.attn_scale == 256**-0.5
    assert cfg.layer_types[:6] == (SLIDING,) * 5 + (FULL,) and cfg.layer_types.count(FULL) == 5
    assert cfg.sliding_window == 1024 and cfg.tie_word_embeddings and cfg.eos_token_id == [1, 106]
    assert (cfg.rope[FULL].rope_type, cfg.rope[FULL].factor, cfg.rope[FULL].theta) == ("linear", 8.0, 1e6)
    assert cfg.rope[SLIDING].theta == 10_000.0 and cfg.rope[SLIDING].factor == 1.0


def test_gemma3_multimodal_without_text_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="Gemma3ForConditionalGeneration: config.json has no text_config"):
        parse_model_config({"architectures": ["Gemma3ForConditionalGeneration"]})


def _logits(model_dir) -> torch.Tensor:
    model = load_model(model_dir)
    backend = FlatBackend(model.cfg, num_requests=1)
    positions = backend.step([20])
    with torch.inference_mode():
        return model.logits(model(torch.arange(3, 23), positions, max_position=19, backend=backend))


def test_gemma3_multimodal_reads_transformers5_names_too(tmp_path) -> None:
    """The same tensors under transformers 5's own prefixes load to the same model; a tensor
    under neither prefix is refused by name."""
    from safetensors.torch import load_file, save_file

    source = hf_tiny.tiny_model_dir("gemma3_mm")
    tensors = load_file(str(source / "model.safetensors"))
    assert any(n.startswith("language_model.model.") for n in tensors)  # the published layout
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        else:
            name = "model." + name  # vision_tower / multi_modal_projector
        renamed[name] = t
    out = tmp_path / "v5"
    out.mkdir()
    (out / "config.json").write_text((source / "config.json").read_text())
    save_file(renamed, str(out / "model.safetensors"))
    assert torch.equal(_logits(out), _logits(source))
    save_file({**renamed, "audio_tower.w": torch.zeros(2)}, str(out / "model.safetensors"))
    with pytest.raises(ConfigError, match="tensor audio_tower.w is neither the language model's nor the vision"):
        load_model(out)


def _raw(kind: str, **changes: object) -> dict:
    raw = hf_tiny.hf_config(kind).to_dict()
    raw.update(architectures=[type(hf_tiny.hf_config(kind)).__name__.replace("Config", "ForCausalLM")], **changes)
    return raw


def test_exaone4_pattern_letters_and_rope_on_full_layers() -> None:
    raw = _raw("exaone4", layer_types=None, sliding_window_pattern="LLLG")
    cfg = parse_model_config(raw)
    assert cfg.layer_types == (SLIDING, SLIDING, SLIDING, FULL) * 2
    assert SLIDING in cfg.rope and FULL not in cfg.rope  # a windowed EXAONE 4 rotates its local layers only
    no_window = parse_model_config(_raw("exaone4", layer_types=None, sliding_window=None))
    assert set(no_window.layer_types) == {FULL} and FULL in no_window.rope
    with pytest.raises(ConfigError, match="sliding_window_pattern 'LLXG'"):
        parse_model_config(_raw("exaone4", layer_types=None, sliding_window_pattern="LLXG"))


def test_olmo3_rope_scaling_of_older_configs_scales_full_layers_only() -> None:
    raw = _raw("olmo3", rope_parameters=None, rope_theta=500000.0,
               rope_scaling={"rope_type": "linear", "factor": 4.0})
    cfg = parse_model_config(raw)
    assert (cfg.rope[FULL].rope_type, cfg.rope[FULL].factor, cfg.rope[FULL].theta) == ("linear", 4.0, 500000.0)
    assert (cfg.rope[SLIDING].rope_type, cfg.rope[SLIDING].theta) == ("default", 500000.0)
    assert cfg.post_norm and cfg.qk_norm and cfg.qk_norm_over_projection


def test_cohere2_config_facts() -> None:
    raw = _raw("cohere2", head_dim=99)
    del raw["tie_word_embeddings"]
    cfg = parse_model_config(raw)
    assert cfg.head_dim == 16  # hidden // heads, as HF sets it
    assert cfg.tie_word_embeddings and cfg.logit_scale == 0.25 and cfg.rms_norm_eps == 1e-5
    assert cfg.parallel_block and not cfg.post_norm and FULL not in cfg.rope
