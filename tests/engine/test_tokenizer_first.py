"""A server with engine core processes loads its tokenizer before the cores load the model
where the tokenizer's folder is at hand (models/loaders/default_model.tokenizer_dir_at_hand):
parsing a large tokenizer briefly takes several times the memory it then holds, and paid
beside the cores' loaded models that transient was the server's peak."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from hybridserve.engine import async_llm
from hybridserve.models.loaders import default_model
from hybridserve.models.loaders.gguf_loader import CACHE_DIR_ENV_VAR, CONVERSION_MARKER, converted_dir

_FAKE_SHA = "ab" * 32


def _fake_package() -> types.SimpleNamespace:
    return types.SimpleNamespace(MODEL_NAME="fake-model.gguf", EXPECTED_SHA256=_FAKE_SHA)


def test_tokenizer_dir_at_hand_only_without_converting(tmp_path: Path, monkeypatch) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert default_model.tokenizer_dir_at_hand(str(hf_dir)) == hf_dir
    assert default_model.tokenizer_dir_at_hand(str(tmp_path)) is None  # no config.json: a GGUF folder, to convert
    assert default_model.tokenizer_dir_at_hand("org/not-downloaded") is None
    monkeypatch.setenv(CACHE_DIR_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "_model_package", _fake_package)
    assert default_model.tokenizer_dir_at_hand(None) is None  # not converted yet
    key = default_model.default_cache_key(_fake_package())
    bf16 = converted_dir("fake-model", key, "bfloat16")
    bf16.mkdir(parents=True)
    (bf16 / CONVERSION_MARKER).write_text("{}")
    # The bfloat16 conversion serves a float32 run's tokenizer too: the files do not depend on the dtype.
    assert default_model.tokenizer_dir_at_hand(None) == default_model.tokenizer_dir_at_hand("gemma3-270m") == bf16

    def missing() -> None:
        raise default_model.MissingExtraError("no extra")

    monkeypatch.setattr(default_model, "_model_package", missing)
    assert default_model.tokenizer_dir_at_hand(None) is None


@pytest.mark.parametrize("at_hand", [True, False])
def test_core_server_loads_the_tokenizer_first_where_at_hand(tmp_path: Path, monkeypatch, at_hand: bool) -> None:
    events: list[str] = []
    model_dir = tmp_path / "model"
    info = types.SimpleNamespace(model_path=model_dir, model_config=None, max_model_len=64, eos_token_id=None,
                                 model_stop_ids=(), num_blocks=8)
    replica = types.SimpleNamespace(info=info, start=lambda: None, close=lambda: None)

    def start_cores(*args: object) -> list[types.SimpleNamespace]:
        events.append("cores loaded")
        return [replica]

    def load_tokenizer(config: object, path: Path) -> None:
        events.append(f"tokenizer from {path.name}")

    monkeypatch.setattr(async_llm, "_start_core_replicas", start_cores)
    monkeypatch.setattr(async_llm, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(async_llm, "tokenizer_dir_at_hand", lambda model: model_dir if at_hand else None)
    async_llm.AsyncLLM(str(model_dir), core_process=True, progress=False)
    assert events == (["tokenizer from model", "cores loaded"] if at_hand else
                      ["cores loaded", "tokenizer from model"])
