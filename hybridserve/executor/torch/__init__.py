"""The PyTorch executor: paged hybrid-KV attention, sampling and a worker thread.

Importing this package imports torch; `hybridserve.core` never does.
"""

from hybridserve.executor.torch.executor import TorchExecutor, build_kv_cache_config, resolve_device

__all__ = ["TorchExecutor", "build_kv_cache_config", "resolve_device"]
