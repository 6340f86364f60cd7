"""hybridserve: an LLM serving engine for hybrid-attention models.

    from hybridserve import LLM, SamplingParams
    outs = LLM("path/to/model").generate(["Hello"], SamplingParams(max_tokens=16))

The names below load lazily, so `import hybridserve` (and the CLI's `simulate`) never
pays for torch or transformers, and changes nothing in the process. The entry points
(these names, the `hybridserve` command) set the OpenMP spin torch's threads use before
they import torch (models/platform/cpu_features.prefer_short_omp_spin).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from hybridserve.models.platform.cpu_features import prefer_short_omp_spin

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "hybridserve.engine.llm",
    "AsyncLLM": "hybridserve.engine.async_llm",
    "EngineDeadError": "hybridserve.engine.async_llm",
    "SamplingParams": "hybridserve.core.request",
    "StructuredOutput": "hybridserve.core.request",
    "RequestFailedError": "hybridserve.engine.async_llm",
    "EngineRestartingError": "hybridserve.engine.async_llm",
    "GenerationOutput": "hybridserve.engine.outputs",
    "CompletionOutput": "hybridserve.engine.outputs",
    "EngineConfig": "hybridserve.config",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from hybridserve.config import EngineConfig
    from hybridserve.core.request import SamplingParams, StructuredOutput
    from hybridserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineRestartingError, RequestFailedError
    from hybridserve.engine.llm import LLM
    from hybridserve.engine.outputs import CompletionOutput, GenerationOutput


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridserve' has no attribute {name!r}")
    prefer_short_omp_spin()  # the engine's modules import torch: the spin setting goes first
    return getattr(import_module(module), name)
