"""Pick the multi-process executor for a backend name (its own file, so the executors
and the driver they share import one way)."""

from __future__ import annotations

from typing import Any

from hybridserve.config import DISTRIBUTED_BACKENDS as BACKENDS
from hybridserve.core.errors import ConfigError
from hybridserve.executor.distributed.driver import DistributedDriver


def make_distributed_executor(backend: str, **spec_args: Any) -> DistributedDriver:
    """A multi-process executor: `mp` (processes on this machine) or `ray` (Ray actors,
    which may span machines). spec_args are WorkerSpec fields (see worker.py)."""
    if backend not in BACKENDS:
        raise ConfigError(f"distributed_executor_backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "ray":
        from hybridserve.executor.distributed.ray_executor import RayExecutor

        return RayExecutor(spec_args)
    from hybridserve.executor.distributed.mp_executor import MultiprocExecutor

    return MultiprocExecutor(spec_args)
