"""GGUF files of gpt-oss, Cohere2, OLMo 3 and EXAONE 4, written as llama.cpp's converter writes
them (tests/helpers/gguf_from_hf.py), converted and served: greedy tokens equal HF's on the
model the file was written from.

Each tiny model is GGUF-expressible: gpt-oss with llama.cpp's fixed SwiGLU clamp (7); OLMo 3
with one RoPE base and YaRN on its full layers (as the published configs); EXAONE 4 with Llama 3
scaling over an 8192-token original context (the curve llama.cpp's rope_freqs reader assumes).
gpt-oss also runs with MXFP4 expert matrices (its real files' type, kept packed in the cache),
whose values the HF model is given exactly; ggml's MXFP4 block layout is checked against values
worked out by hand, and its repacking into HF's layout against the HF-layout packer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.config import FULL, SLIDING, load_model_config  # noqa: E402
from hybridserve.models.loaders.gguf_rope_freqs import llama3_factors  # noqa: E402
from hybridserve.models.loaders.gguf_gpt_oss import hf_mxfp4  # noqa: E402
from hybridserve.models.loaders.gguf_header import dequantize_tensor, read_gguf_header  # noqa: E402
from hybridserve.models.loaders.gguf_loader import convert_gguf  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny, mxfp4_pack  # noqa: E402
from tests.helpers.gguf_from_hf import make_experts_mxfp4_exact, write_gguf  # noqa: E402
from tests.helpers.torch_engine import NEW_TOKENS, make_engine_for, run  # noqa: E402

PROMPTS = hf_tiny.random_prompts(2, 40, 90, seed=11)
EXAONE4_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
OLMO3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
              "attention_factor": 1.25, "rope_theta": 500000.0}
CONFIG_CHANGES = {
    "gpt_oss": {"swiglu_limit": 7.0},
    "cohere2": {},
    "olmo3": {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                  "full_attention": OLMO3_YARN}},
    "exaone4": {"rope_parameters": EXAONE4_SCALING},
}
MXFP4 = gguf.GGMLQuantizationType.MXFP4
CASES = [("gpt_oss", False), ("gpt_oss", True), ("cohere2", False), ("olmo3", False), ("exaone4", False)]


def _write(kind: str, mxfp4: bool, folder: Path) -> tuple[Path, object]:
    """The tiny HF model (its folder) and its GGUF, written the converter's way."""
    model = hf_tiny.tiny_model(kind, **CONFIG_CHANGES[kind])
    if mxfp4:
        make_experts_mxfp4_exact(model)
    model.save_pretrained(folder / "hf")
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    rope_freqs = None
    if kind == "exaone4":
        rope_freqs = llama3_factors(10000.0, 16, EXAONE4_SCALING).astype(np.float32)
    write_gguf(kind, model.config, state, str(folder / f"{kind}.gguf"), mxfp4_experts=mxfp4, rope_freqs=rope_freqs)
    return folder / f"{kind}.gguf", model


@pytest.mark.parametrize("kind, mxfp4", CASES, ids=[f"{k}{'-mxfp4' if m else ''}" for k, m in CASES])
def test_gguf_greedy_tokens_equal_hf(kind: str, mxfp4: bool, tmp_path: Path) -> None:
    gguf_path, hf_model = _write(kind, mxfp4, tmp_path)
    if mxfp4:  # the experts are stored as real gpt-oss files store them
        types = {info.name: info.ggml_type for info in read_gguf_header(gguf_path).tensors}
        assert types["blk.1.ffn_up_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == MXFP4
    converted = convert_gguf(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    cfg = load_model_config(converted)
    assert cfg.family == kind and cfg.layer_types == load_model_config(tmp_path / "hf").layer_types
    assert cfg.rope == load_model_config(tmp_path / "hf").rope
    if mxfp4:  # kept packed in the cache, as a HF MXFP4 checkpoint holds them
        from safetensors import safe_open

        with safe_open(str(converted / "model.safetensors"), "pt") as weights:
            names = set(weights.keys())
            assert weights.get_tensor("model.layers.1.mlp.experts.down_proj_blocks").dtype == torch.uint8
        assert "model.layers.0.mlp.experts.gate_up_proj_scales" in names
        assert "model.layers.0.mlp.experts.gate_up_proj" not in names and cfg.gpt_oss.mxfp4
    got = run(make_engine_for(load_model(converted), async_scheduling=False), PROMPTS)
    reference = hf_tiny.load_hf(tmp_path / "hf")
    for i, prompt in enumerate(PROMPTS):
        want, _ = hf_tiny.hf_greedy(reference, prompt, NEW_TOKENS)
        assert got[f"r{i}"][0] == want, f"{kind} prompt {i}"


def test_config_facts_read_from_each_file(tmp_path: Path) -> None:
    """The keys each converter writes land in the HF config as their numbers say."""
    facts = {}
    for kind in ("gpt_oss", "cohere2", "olmo3", "exaone4"):
        gguf_path, _ = _write(kind, False, tmp_path / kind)
        converted = convert_gguf(gguf_path, cache_dir=tmp_path / "cache", progress=False)
        facts[kind] = json.loads((converted / "config.json").read_text())
    gpt = facts["gpt_oss"]
    assert gpt["layer_types"] == ["sliding_attention", "full_attention"] * 2  # llama.cpp's fixed pattern 2
    assert (gpt["num_local_experts"], gpt["num_experts_per_tok"], gpt["swiglu_limit"]) == (4, 2, 7.0)
    assert gpt["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    cohere = facts["cohere2"]
    assert cohere["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]  # no key: llama.cpp's 3:1
    assert (cohere["logit_scale"], cohere["layer_norm_eps"], cohere["tie_word_embeddings"]) == (0.25, 1e-5, True)
    olmo = facts["olmo3"]
    assert olmo["architectures"] == ["Olmo3ForCausalLM"] and olmo["rope_theta"] == 500000.0
    assert olmo["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                    "attention_factor": 1.25}
    exaone = facts["exaone4"]
    assert exaone["layer_types"] == (["sliding_attention"] * 3 + ["full_attention"]) * 2
    assert exaone["rope_scaling"] == {key: value for key, value in EXAONE4_SCALING.items() if key != "rope_theta"}
    olmo_cfg = load_model_config(next((tmp_path / "cache" / "converted").glob("olmo3-*")))
    assert olmo_cfg.rope[SLIDING].rope_type == "default" and olmo_cfg.rope[FULL].rope_type == "yarn"


def test_mxfp4_gguf_blocks_unpack_to_hand_computed_values(tmp_path: Path) -> None:
    """ggml's MXFP4 block: the e8m0 scale byte first, then 16 bytes where byte j holds value j
    in its low nibble and value j + 16 in its high one (HF's checkpoints pair 2k and 2k + 1)."""
    generator = torch.Generator().manual_seed(3)
    codes, exps = mxfp4_pack.random_codes((2, 3, 64), generator)  # [2, 3, 2 blocks, 32]
    expected = mxfp4_pack.values(codes, exps).numpy()  # from the format's definition
    nibbles = codes.numpy().astype(np.uint8)
    packed = np.concatenate([(exps.numpy() + 127).astype(np.uint8)[..., None],
                             nibbles[..., :16] | (nibbles[..., 16:] << 4)], axis=-1)  # [2, 3, 2, 17]
    header = _mxfp4_file(tmp_path / "mx.gguf", packed.reshape(2, 3, 34))
    assert header.tensors[0].shape == (2, 3, 64)
    np.testing.assert_array_equal(dequantize_tensor(header, header.tensors[0]), expected)
    # Kept packed, the same codes in HF's layout (byte k: values 2k and 2k + 1) and the same scales.
    hf_blocks, hf_scales = mxfp4_pack.pack(codes, exps)
    blocks, scales = hf_mxfp4(packed.reshape(2, 3, 34))
    np.testing.assert_array_equal(blocks, hf_blocks.numpy())
    np.testing.assert_array_equal(scales, hf_scales.numpy())
    # One value by hand: code 0b1101 (-3) in a block with exponent -1 is -1.5.
    byte = np.array([[127 - 1] + [0x0D] + [0] * 15], np.uint8)
    assert mxfp4_pack.values(torch.tensor([[[13] + [0] * 31]]), torch.tensor([[-1]]))[0, 0].item() == -1.5
    one = _mxfp4_file(tmp_path / "one.gguf", byte)
    assert dequantize_tensor(one, one.tensors[0])[0, :2].tolist() == [-1.5, 0.0]


def _mxfp4_file(path: Path, packed: np.ndarray):
    """The header of a GGUF holding one MXFP4 tensor of these raw bytes (17 per block)."""
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_tensor("blk.0.ffn_down_exps.weight", packed, raw_dtype=MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf_header(path)


def test_olmo2_file_without_window_is_refused_by_name(tmp_path: Path) -> None:
    gguf_path, _ = _write("olmo3", False, tmp_path)
    header_keys = read_gguf_header(gguf_path).metadata
    assert header_keys["olmo2.attention.sliding_window"] == hf_tiny.WINDOW
    writer = gguf.GGUFWriter(str(tmp_path / "olmo2.gguf"), "olmo2")
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_feed_forward_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="OLMo 2") as error:
        convert_gguf(tmp_path / "olmo2.gguf", cache_dir=tmp_path / "cache", progress=False)
    assert "\n" not in str(error.value)


def test_olmo3_with_yarn_from_its_hf_directory_equals_hf(tmp_path: Path) -> None:
    """OLMo 3's published configs scale the full layers' RoPE with YaRN; the HF directory path
    (not only the GGUF one) must run it as HF does."""
    folder = hf_tiny.build_tiny("olmo3", tmp_path / "hf", **CONFIG_CHANGES["olmo3"])
    cfg = load_model_config(folder)
    assert (cfg.rope[FULL].rope_type, cfg.rope[FULL].attention_factor, cfg.rope[SLIDING].rope_type) == (
        "yarn", 1.25, "default")
    got = run(make_engine_for(load_model(folder), async_scheduling=False), PROMPTS)
    reference = hf_tiny.load_hf(folder)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"][0] == hf_tiny.hf_greedy(reference, prompt, NEW_TOKENS)[0], f"prompt {i}"
