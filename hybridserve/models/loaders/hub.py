"""`--model ORG/NAME`: Hugging Face Hub ids, resolved through huggingface_hub's own cache.

Online, the files a model needs (configs, weights, tokenizer) are downloaded into the
Hub cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub) or found
there. With `HF_HUB_OFFLINE=1` only the cache is read. The environment is read at each
call, not at import, so a process can switch it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hybridserve.core.errors import ConfigError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "tokenizer*"]


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.startswith((".", "/", "~"))


def resolve_hub_model(repo_id: str) -> Path:
    """The local snapshot directory of a Hub model (ConfigError if it cannot be had)."""
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise ConfigError(f"--model {repo_id}: Hub ids need huggingface_hub (pip install 'hybridserve[torch]')") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    cache = os.environ.get("HF_HUB_CACHE") or (
        str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None)
    try:
        path = huggingface_hub.snapshot_download(repo_id, allow_patterns=_PATTERNS, cache_dir=cache,
                                                 local_files_only=offline)
    except LocalEntryNotFoundError:
        where = "the Hugging Face cache" + (f" ({cache})" if cache else "")
        hint = "; unset HF_HUB_OFFLINE to download it" if offline else " and it could not be downloaded"
        raise ConfigError(f"model {repo_id!r} is not a local path, not in {where}{hint}") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"model {repo_id!r}: no such Hugging Face repository (or it needs a token)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(f"model {repo_id!r}: download failed ({type(exc).__name__})") from None
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model {repo_id!r}: the repository has no config.json")
    return Path(path)
