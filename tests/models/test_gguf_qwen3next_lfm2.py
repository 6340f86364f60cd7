"""GGUF files of Qwen3-Next and LFM2 written as llama.cpp's converter writes them
(tests/helpers/gguf_from_hf_recurrent_{qwen3next,lfm2}.py), converted and served.

The converted directory is an HF checkpoint: transformers loads it with no key missing or
left over, and every tensor equals the tiny model's it was written from (bit for bit, but
for what the converter stores transformed: Qwen3-Next's 1 + w norms and -exp(A_log), back
within a float32 rounding). Greedy tokens equal HF's on the original model. Qwen3-Next is
read both as current converters split its q/k/v/z projection and as older ones stored it
whole. A file missing a key or carrying a tensor the architecture does not have is refused
by name. Headers with the published models' keys and shapes (Qwen3-Next-80B-A3B, LFM2-1.2B)
give their configs and HF tensor shapes, derived by hand.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.arch.lfm2_config import SHORT_CONV  # noqa: E402
from hybridserve.models.config import FULL, LINEAR, load_model_config, parse_model_config  # noqa: E402
from hybridserve.models.loaders.gguf_arch import ARCH_SPECS  # noqa: E402
from hybridserve.models.loaders.gguf_header import GGUFHeader, GGUFTensorInfo  # noqa: E402
from hybridserve.models.loaders.gguf_loader import convert_gguf  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny_mamba as tiny  # noqa: E402
from tests.helpers import mamba_engine  # noqa: E402
from tests.helpers.gguf_from_hf_recurrent_lfm2 import write_lfm2_gguf  # noqa: E402
from tests.helpers.gguf_from_hf_recurrent_qwen3next import write_qwen3next_gguf  # noqa: E402

CASES = [("qwen3_next", False), ("qwen3_next", True), ("lfm2", False)]
IDS = ["qwen3next", "qwen3next-whole-qkvz", "lfm2"]
# Tensors the converter stores transformed (1 + w, -exp(A_log)): equal within a rounding.
TRANSFORMED = ("norm.weight", "A_log")
CONFIG_FIELDS = ("layer_types", "head_dim", "num_heads", "num_kv_heads", "intermediate_size", "rms_norm_eps",
                 "rope", "rotary_dim", "tie_word_embeddings", "max_position_embeddings", "gated_deltanet",
                 "qwen3_next_moe", "short_conv")


def _write(kind: str, path: Path, whole_qkvz: bool = False, extra: dict[str, np.ndarray] | None = None) -> Path:
    if kind == "lfm2":
        write_lfm2_gguf(tiny.tiny_model_dir(kind), path, extra_tensors=extra)
    else:
        write_qwen3next_gguf(tiny.tiny_model_dir(kind), path, legacy_qkvz=whole_qkvz, extra_tensors=extra)
    return path


def _converted(kind: str, whole_qkvz: bool, folder: Path) -> Path:
    gguf_path = _write(kind, folder / f"{kind}.gguf", whole_qkvz)
    return convert_gguf(gguf_path, cache_dir=folder / "cache", progress=False)


@pytest.mark.parametrize("kind, whole_qkvz", CASES, ids=IDS)
def test_converted_checkpoint_is_the_hf_model(kind: str, whole_qkvz: bool, tmp_path: Path) -> None:
    converted = _converted(kind, whole_qkvz, tmp_path)
    got, want = load_model_config(converted), load_model_config(tiny.tiny_model_dir(kind))
    assert got.family == kind
    for field in CONFIG_FIELDS:
        assert getattr(got, field) == getattr(want, field), field
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        converted, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours, theirs = loaded.state_dict(), tiny.load_hf(kind).state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        if name.endswith(TRANSFORMED):
            torch.testing.assert_close(ours[name], value, rtol=2e-7, atol=2e-7, msg=name)
        else:
            assert torch.equal(ours[name], value), name


@pytest.mark.parametrize("kind, whole_qkvz", CASES, ids=IDS)
def test_gguf_greedy_tokens_equal_hf(kind: str, whole_qkvz: bool, tmp_path: Path) -> None:
    key = f"gguf-{kind}-{whole_qkvz}"
    mamba_engine._MODELS[key] = load_model(_converted(kind, whole_qkvz, tmp_path))  # make_engine's model cache
    try:
        prompts = mamba_engine.PROMPTS[:2]
        got = mamba_engine.run(mamba_engine.make_engine(key, async_scheduling=False), prompts)
        mamba_engine.check(kind, prompts, got)
    finally:
        del mamba_engine._MODELS[key]


@pytest.mark.parametrize("arch, kv_heads, missing", [("qwen3next", 2, "ssm.group_count"),
                                                     ("lfm2", [0, 2], "shortconv.l_cache")], ids=["qwen3next", "lfm2"])
def test_file_without_a_required_key_is_refused_by_name(arch: str, kv_heads: object, missing: str,
                                                        tmp_path: Path) -> None:
    """Every key a decoder has, none of the architecture's own."""
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), arch)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(kv_heads)
    writer.add_feed_forward_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                  writer.close):
        write()
    with pytest.raises(ConfigError, match=f"{arch}.{missing}".replace(".", r"\.")) as error:
        convert_gguf(tmp_path / "bare.gguf", cache_dir=tmp_path / "cache", progress=False)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kind, stranger", [("qwen3_next", "blk.0.ssm_x.weight"),
                                             ("lfm2", "blk.2.shortconv.x_proj.weight")], ids=["qwen3next", "lfm2"])
def test_unknown_tensor_is_refused_by_name(kind: str, stranger: str, tmp_path: Path) -> None:
    path = _write(kind, tmp_path / f"{kind}.gguf", extra={stranger: np.zeros((4, 64), np.float32)})
    with pytest.raises(ConfigError, match=stranger.replace(".", r"\.")):
        convert_gguf(path, cache_dir=tmp_path / "cache", progress=False)


def _header(arch: str, keys: dict[str, object], shapes: dict[str, tuple[int, ...]]) -> GGUFHeader:
    """A header as the reader returns it (no tensor data: config and plan read none)."""
    metadata = {"general.architecture": arch, **{f"{arch}.{key}": value for key, value in keys.items()}}
    tensors = tuple(GGUFTensorInfo(name, shape, 0, 0, 0) for name, shape in shapes.items())
    return GGUFHeader(Path(f"{arch}.gguf"), 3, metadata, {}, tensors)


def _planned(header: GGUFHeader, layer: int) -> dict[str, tuple[int, ...]]:
    prefix = f"model.layers.{layer}."
    return {t.hf_name[len(prefix):]: t.shape for t in ARCH_SPECS[header.architecture].plan(header)
            if t.hf_name.startswith(prefix)}


def test_qwen3next_80b_file_plans_the_published_model() -> None:
    """Qwen3-Next-80B-A3B's keys and tensor shapes as the converter writes them: 48 layers,
    a full-attention layer every 4th, 512 experts of 512 (10 used), Hk 16 / Hv 32 heads of 128."""
    keys = {"block_count": 48, "context_length": 262144, "embedding_length": 2048, "feed_forward_length": 5120,
            "attention.head_count": 16, "attention.head_count_kv": 2, "attention.key_length": 256,
            "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e7, "rope.dimension_count": 64,
            "expert_count": 512, "expert_used_count": 10, "expert_feed_forward_length": 512,
            "expert_shared_feed_forward_length": 512, "ssm.conv_kernel": 4, "ssm.state_size": 128,
            "ssm.group_count": 16, "ssm.time_step_rank": 32, "ssm.inner_size": 4096, "full_attention_interval": 4}
    shapes = {"token_embd.weight": (151936, 2048), "output.weight": (151936, 2048),
              "blk.0.attn_qkv.weight": (8192, 2048), "blk.0.attn_gate.weight": (4096, 2048),
              "blk.0.ssm_conv1d.weight": (8192, 4), "blk.0.ssm_a": (32,),
              "blk.0.ssm_ba.weight": (64, 2048), "blk.0.ffn_gate_exps.weight": (512, 512, 2048),
              "blk.0.ffn_up_exps.weight": (512, 512, 2048), "blk.0.ffn_down_exps.weight": (512, 2048, 512),
              "blk.0.ffn_gate_inp_shexp.weight": (2048,),
              **{f"blk.{i}.ffn_gate_inp.weight": (512, 2048) for i in range(48)}}
    header = _header("qwen3next", keys, shapes)
    cfg = parse_model_config(ARCH_SPECS["qwen3next"].build_config(header))
    assert cfg.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 12
    # Newer files may say which layers are recurrent, one flag per layer, instead.
    flags = {**keys, "attention.recurrent_layers": np.array([i % 8 != 7 for i in range(48)])}
    flagged = ARCH_SPECS["qwen3next"].build_config(_header("qwen3next", flags, shapes))["layer_types"]
    assert flagged == ([LINEAR] * 7 + [FULL]) * 6
    assert (cfg.head_dim, cfg.rotary_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (256, 64, 151936, False)
    assert cfg.gated_deltanet.state_shapes == ((2 * 16 * 128 + 32 * 128, 3), (32, 128, 128))
    moe = cfg.qwen3_next_moe
    assert (moe.num_experts, moe.top_k, moe.moe_intermediate_size, moe.shared_intermediate_size,
            moe.norm_topk_prob, moe.dense_layers) == (512, 10, 512, 512, True, frozenset())
    assert _planned(header, 0) == {
        "linear_attn.in_proj_qkvz.weight": (2 * 2048 + 2 * 4096, 2048), "linear_attn.in_proj_ba.weight": (64, 2048),
        "linear_attn.conv1d.weight": (8192, 1, 4), "linear_attn.A_log": (32,),
        "mlp.experts.gate_up_proj": (512, 1024, 2048), "mlp.experts.down_proj": (512, 2048, 512),
        "mlp.shared_expert_gate.weight": (1, 2048), "mlp.gate.weight": (512, 2048)}


def test_lfm2_1_2b_file_plans_the_published_model() -> None:
    """LFM2-1.2B's keys as the converter writes them: 16 layers, attention at 2, 5, 8, 10,
    12, 14 (8 KV heads; 0 for the convolutions), the MLP width already adjusted (8192)."""
    attention = {2, 5, 8, 10, 12, 14}
    keys = {"block_count": 16, "context_length": 128000, "embedding_length": 2048, "feed_forward_length": 8192,
            "attention.head_count": 32, "attention.head_count_kv": np.array([8 if i in attention else 0
                                                                              for i in range(16)], np.uint32),
            "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 1e6, "shortconv.l_cache": 3}
    shapes = {"token_embd.weight": (65536, 2048), "token_embd_norm.weight": (2048,),
              "blk.0.shortconv.conv.weight": (2048, 3), "blk.0.shortconv.in_proj.weight": (6144, 2048),
              "blk.0.attn_norm.weight": (2048,)}
    header = _header("lfm2", keys, shapes)
    cfg = parse_model_config(ARCH_SPECS["lfm2"].build_config(header))
    assert cfg.layer_types == tuple(FULL if i in attention else SHORT_CONV for i in range(16))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (32, 8, 64, 8192)
    assert (cfg.short_conv.channels, cfg.short_conv.kernel, cfg.short_conv.bias) == (2048, 3, False)
    assert _planned(header, 0) == {"conv.conv.weight": (2048, 1, 3), "conv.in_proj.weight": (6144, 2048),
                                   "operator_norm.weight": (2048,)}
    names = [t.hf_name for t in ARCH_SPECS["lfm2"].plan(header)]
    assert "model.embedding_norm.weight" in names
