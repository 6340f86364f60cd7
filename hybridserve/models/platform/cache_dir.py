"""Where hybridserve keeps what it builds once per machine: converted checkpoints
(models/loaders/gguf_loader.py) and native kernels (models/platform/native_build.py)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV_VAR = "HYBRIDSERVE_CACHE_DIR"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache folder: `cache_dir`, else $HYBRIDSERVE_CACHE_DIR, else ~/.cache/hybridserve."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from_env = os.environ.get(CACHE_DIR_ENV_VAR)
    return Path(from_env).expanduser() if from_env else Path.home() / ".cache" / "hybridserve"
