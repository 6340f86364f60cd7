"""--model ORG/NAME through the Hugging Face Hub cache, offline (no network in tests)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

from tests.helpers.serving_models import tiny_serving_dir  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.loaders.default_model import resolve_model_path  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str) -> Path:
    """A cache laid out as huggingface_hub lays it out: refs/main names the snapshot."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny_serving_dir(), repo / "snapshots" / COMMIT)
    return repo / "snapshots" / COMMIT


def test_a_cached_hub_model_runs_offline(tmp_path: Path, monkeypatch) -> None:
    snapshot = hub_cache(tmp_path, "acme/tiny-gemma3")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("acme/tiny-gemma3") == snapshot
    params = SamplingParams(max_tokens=6)
    by_id = LLM("acme/tiny-gemma3", max_model_len=128, progress=False)
    by_path = LLM(str(tiny_serving_dir()), max_model_len=128, progress=False)
    try:
        assert by_id.generate(["hello world"], params)[0].token_ids == by_path.generate(["hello world"], params)[0].token_ids
    finally:
        by_id.shutdown()
        by_path.shutdown()


def test_an_uncached_hub_model_offline_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="'acme/missing' is not a local path, not in the Hugging Face cache"):
        resolve_model_path("acme/missing")
    with pytest.raises(ConfigError, match="model path does not exist"):
        resolve_model_path("./acme/missing")
