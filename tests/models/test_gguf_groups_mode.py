"""--quantization gguf-groups: a GGUF's decoder linears served as the file's own int8 groups.

Tiny Llama and Gemma 3 GGUFs (tests/helpers/tiny_gguf.py) with hidden size 256, so every
linear can be Q8_0, Q5_0, Q6_K or Q4_K: each layer mixes all four, q and k among them (in
the Llama their rows reordered per head by the conversion, which the groups must follow;
the Gemma adds sandwich and q/k norms), so the fused qkv and
gate|up stack parts of different group sizes, with and without offsets. In float32 the
groups' weights are exactly the dequantized ones, so the decoder computes what
`--quantization none` computes up to float summation order. The whole model is compared
with `int8-head`, whose head is gguf-groups' own: against `none` the int8 head's rounding
alone moves one greedy token of eight on this random model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("numpy")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.entrypoints import cli  # noqa: E402
from hybridserve.models.layers.head import GROUP_LAYERS  # noqa: E402
from hybridserve.models.layers.int8_groups import GroupWeights, PackedGroups, PackedLinear  # noqa: E402
from hybridserve.models.arch.compiled_chains import DEFAULT_MIN_ROWS  # noqa: E402
from hybridserve.models.loaders.default_model import groups_servable  # noqa: E402
from hybridserve.models.loaders.gguf_loader import convert_gguf, groups_refusal  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402

from tests.helpers.int8_gemma3 import LENGTHS, prefill  # noqa: E402
from tests.helpers.tiny_gguf import mixed_linear_types, write_tiny_gemma3, write_tiny_llama  # noqa: E402

HIDDEN, INTERMEDIATE = 256, 512
PROMPT_IDS = [1, 268, 274, 270, 262, 5, 9, 40, 77, 120]


WRITERS = {"llama": write_tiny_llama, "gemma3": write_tiny_gemma3}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def mixed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("groups") / f"mixed-{request.param}.gguf"
    WRITERS[request.param](path, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, linear_types=mixed_linear_types())
    return path


def _model(path: Path, cache: Path, quantization: str, dtype: str = "float32",  # type: ignore[no-untyped-def]
           compile: bool = True):
    converted = convert_gguf(path, cache_dir=cache, dtype=dtype, progress=False, groups=quantization == GROUP_LAYERS)
    return load_model(converted, "cpu", getattr(torch, dtype), quantization, compile=compile)


def test_the_decoder_computes_what_the_dequantized_weights_compute(mixed: Path, tmp_path: Path) -> None:
    # int8-head: the same head as gguf-groups, whose smoothing divides the final norm
    # (models/layers/smoothing.py), over the dequantized decoder.
    groups, dense = _model(mixed, tmp_path, GROUP_LAYERS), _model(mixed, tmp_path, "int8-head")
    ours, reference = prefill(groups, [12]), prefill(dense, [12])
    # Same float32 weights, other summation orders: a few float32 ulps of the values' size;
    # where the kernel's i16 path runs (packed as pairs: CPUs without native bf16), each
    # linear's inputs rounded to 16 bits of their group's largest (2^-16) besides, which the
    # layers compound: within 2^-12 of the values' size.
    pairs = any(getattr(_held_groups(lin.qkv), "layout", "") == "pairs" for lin in groups._linears)
    size = reference.abs().max().item()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=(2.0 ** -12 if pairs else 1e-5) * size)
    # Both through one head. Each model's int8 head is smoothed by the maxima of its own
    # calibration forward, whose float32 last bits have differed between processes (torch's
    # first cos of a RoPE table among them), and an ulp there can move one int8 activation
    # by a level: a few hundredths of a logit here. Rows whose top two are further apart
    # than that keep their greedy token.
    logits, reference_logits = dense.logits(ours), dense.logits(reference)
    apart = (logits - reference_logits).abs().max()
    assert apart <= 0.01 * reference_logits.abs().max()
    top = reference_logits.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > 2 * apart
    assert clear.sum() >= len(clear) // 2
    assert torch.equal(logits.argmax(dim=-1)[clear], reference_logits.argmax(dim=-1)[clear])
    for layer, (lin_groups, lin_dense) in enumerate(zip(groups._linears, dense._linears)):
        # Inputs on the int16 grid of every group of 16 (each group's largest 32767 steps of
        # 2^-15), which the kernel's i16 path (CPUs without native bf16) then rounds not at all.
        g = torch.Generator().manual_seed(layer)
        x = torch.randint(-32767, 32768, (3, HIDDEN), generator=g).float()
        x[:, ::16] = 32767.0
        x *= 2.0 ** -15
        torch.testing.assert_close(lin_groups.qkv(x), lin_dense.qkv(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lin_groups.gate_up(x), lin_dense.gate_up(x), rtol=1e-5, atol=1e-6)


def test_a_large_bf16_step_gives_the_eager_hidden_states(mixed: Path, tmp_path: Path) -> None:
    """bf16 activations in and out of the groups' matmuls; a step of DEFAULT_MIN_ROWS rows or
    more takes the large-step chains (native kernels where built, else compiled), which
    call the same LayerLinears as the eager loop."""
    model = _model(mixed, tmp_path, GROUP_LAYERS, "bfloat16")
    assert sum(LENGTHS) >= DEFAULT_MIN_ROWS and model._dtype_chains is not None
    large = prefill(model, LENGTHS)
    assert large.dtype == torch.bfloat16 and model._dtype_chains._compiled is not None
    assert torch.equal(large, prefill(_model(mixed, tmp_path, GROUP_LAYERS, "bfloat16", compile=False), LENGTHS))


def _held_groups(linear: object) -> object:
    """The int8 groups a layer's linear reads: the kernel's packed tiles or, on the general
    path, the groups themselves (what its closure holds)."""
    if isinstance(linear, PackedLinear):
        return linear.packed
    cells = [c.cell_contents for c in getattr(linear, "__closure__", None) or ()]
    held = [c for c in cells if isinstance(c, (PackedGroups, GroupWeights))]
    assert len(held) == 1
    return held[0]


def test_the_layers_hold_int8_groups_and_no_float_weight(mixed: Path, tmp_path: Path) -> None:
    """After the load the linears hold the only copy of the groups (the layers let go of the
    row-major ones once packed) and the layers no float weight but their norms."""
    model = _model(mixed, tmp_path, GROUP_LAYERS)
    for w, linears in zip(model.layers, model._linears):
        assert w.groups is None
        for name in ("qkv", "o", "gate_up", "down"):
            assert getattr(w, name).numel() == 0  # the dense parameter is empty
            assert _held_groups(getattr(linears, name)).values.dtype == torch.int8
        held = {name for name, p in w.named_parameters() if p.is_floating_point() and p.numel()}
        assert held and held <= set(model._NORMS)  # the norms alone
        assert _held_groups(linears.qkv).group_size == _held_groups(linears.gate_up).group_size == 16  # a Q6_K part each
    first, second = model._linears
    assert _held_groups(first.gate_up).offset is not None and _held_groups(second.qkv).offset is not None  # Q4_K parts
    assert _held_groups(first.qkv).offset is None and _held_groups(second.gate_up).offset is None


def _greedy(model: str | Path, quantization: str) -> list[int]:
    llm = LLM(str(model), quantization=quantization, dtype="float32", max_model_len=128, progress=False)
    try:
        out = llm.generate([PROMPT_IDS], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        return list(out[0].token_ids)
    finally:
        llm.shutdown()


def test_the_cache_keeps_each_mode_apart(mixed: Path, tmp_path: Path, monkeypatch) -> None:
    """none, then gguf-groups, then none again from one cache folder: each start finds its
    own conversion; the head is int8 in both, so the greedy tokens agree."""
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(tmp_path))
    first = _greedy(mixed, "int8-head")
    groups = _greedy(mixed, GROUP_LAYERS)
    again = _greedy(mixed, "int8-head")
    assert first == again == groups
    folders = sorted(p.name for p in (tmp_path / "converted").iterdir())
    assert len(folders) == 2 and sum("-groups-" in f for f in folders) == 1, folders
    for folder in folders:
        names = json.loads(_safetensors_header(tmp_path / "converted" / folder / "model.safetensors"))
        grouped = "-groups-" in folder
        assert ("model.layers.0.self_attn.q_proj.weight_values" in names) is grouped
        assert ("model.layers.0.self_attn.q_proj.weight" in names) is not grouped
        if grouped:  # the groups' folder named as a model, in another mode
            with pytest.raises(ConfigError, match="holds int8 groups .* load it with that mode"):
                load_model(tmp_path / "converted" / folder, "cpu", torch.float32, "int8-head")


def _safetensors_header(path: Path) -> str:
    with path.open("rb") as file:
        return file.read(int.from_bytes(file.read(8), "little")).decode()


def test_non_gguf_checkpoints_and_other_tensor_types_are_one_line_errors(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "plain.gguf")
    dense = convert_gguf(tmp_path / "plain.gguf", cache_dir=tmp_path, dtype="float32", progress=False)  # HF
    with pytest.raises(ConfigError, match="needs a GGUF model: .* holds no int8 groups") as error:
        LLM(str(dense), quantization=GROUP_LAYERS, dtype="float32", progress=False)
    assert "\n" not in str(error.value)
    for stem, qtype in (("attn_v", Q.Q4_0), ("ffn_down", Q.F16)):
        path = tmp_path / f"{qtype.name}.gguf"
        write_tiny_llama(path, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         linear_types=mixed_linear_types({f"blk.1.{stem}.weight": qtype}))
        with pytest.raises(ConfigError, match=f"blk.1.{stem}.weight is {qtype.name}") as error:
            LLM(str(path), quantization=GROUP_LAYERS, dtype="float32", progress=False)
        assert "\n" not in str(error.value)
    assert not list((tmp_path / "converted").glob("*-groups-*"))  # nothing half-converted is left


def test_the_cli_exits_2_with_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(tmp_path))
    path = tmp_path / "f32-qk.gguf"
    write_tiny_llama(path)  # q and k stored as F32
    rc = cli.main(["generate", "--model", str(path), "--quantization", GROUP_LAYERS, "--quiet", "hello"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "blk.0.attn_q.weight is F32" in err


def test_groups_servable_reads_the_header(tmp_path: Path) -> None:
    """The header alone says whether gguf-groups serves a file: every decoder linear of a
    type it reads and a family it serves; a folder holding one GGUF is that GGUF; a Hugging
    Face folder or a missing path is not servable."""
    good = tmp_path / "good" / "model.gguf"
    good.parent.mkdir()
    write_tiny_llama(good, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, linear_types=mixed_linear_types())
    bad = tmp_path / "bad.gguf"
    write_tiny_llama(bad, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                     linear_types=mixed_linear_types({"blk.1.ffn_down.weight": Q.Q4_0}))
    assert groups_refusal(good) == "" and groups_servable(str(good)) and groups_servable(str(good.parent))
    assert "blk.1.ffn_down.weight is Q4_0" in groups_refusal(bad) and not groups_servable(str(bad))
    dense = convert_gguf(good, cache_dir=tmp_path, dtype="float32", progress=False)  # an HF folder
    assert not groups_servable(str(dense)) and not groups_servable(str(tmp_path / "missing.gguf"))


def _chosen(model: Path, flags: set[str], monkeypatch: pytest.MonkeyPatch, **kwargs) -> str:
    """The quantization `auto` picks for `model` on a CPU with `flags` (the start-up line)."""
    from hybridserve.models.platform import cpu_features

    seen: list[str] = []
    real = cpu_features.describe
    with monkeypatch.context() as patch:
        patch.setenv(cpu_features.CPU_FLAGS_ENV, " ".join(sorted(flags)))
        patch.setattr(cpu_features, "describe", lambda d, q, f: seen.append(q) or real(d, q, f))
        LLM(str(model), max_model_len=128, progress=False, **kwargs).shutdown()
    return seen[0]


def test_auto_takes_the_groups_of_a_servable_gguf_on_every_cpu_with_an_int8_gemm(
        mixed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto serves a servable GGUF's groups on a CPU with native bf16 (AMX, or AVX512-BF16
    alone) and on one without (AVX-VNNI, AVX2 alone); for a model that holds none the decoder
    stays bf16 with the int8 head where bf16 is native and every linear is int8 elsewhere;
    a float32 model named is the exact reference."""
    amx = {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"}
    no_amx = amx - {"amx_bf16", "amx_int8", "amx_tile"}
    avx2 = {"avx2", "fma"}
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(tmp_path))
    assert _chosen(mixed, amx, monkeypatch) == GROUP_LAYERS
    assert _chosen(mixed, no_amx, monkeypatch) == GROUP_LAYERS
    assert _chosen(mixed, avx2 | {"avx_vnni"}, monkeypatch) == GROUP_LAYERS
    assert _chosen(mixed, avx2, monkeypatch) == GROUP_LAYERS
    assert _chosen(mixed, amx, monkeypatch, dtype="float32") == "none"  # float32 named: the exact reference
    dense = convert_gguf(mixed, cache_dir=tmp_path, dtype="bfloat16", progress=False)
    assert _chosen(dense, amx, monkeypatch) == "int8-head"
    assert _chosen(dense, avx2, monkeypatch) == "int8"


@pytest.mark.gemma
def test_the_default_model_s_gguf_is_servable() -> None:
    """DEFAULT_MODEL_GROUPS_SERVABLE stands for this: the default model's file read."""
    from hybridserve.models.loaders import default_model

    try:
        package = default_model._model_package()
    except default_model.MissingExtraError:
        pytest.skip("the gemma extra is not installed")
    path = default_model._assemble(package, progress=False)
    try:
        assert default_model.DEFAULT_MODEL_GROUPS_SERVABLE and groups_refusal(path) == ""
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
