"""Injected engine faults for the failure tests."""

from __future__ import annotations

from typing import Any


def fail_execute_after(engine: Any, num_ok: int, message: str = "device lost at /secret/path") -> None:
    """From the (num_ok + 1)-th step on, this AsyncLLM's current executor raises (a lost
    device); an engine rebuilt after the failure gets a fresh executor without the fault."""
    executor = engine.parts.engine.executor
    real_execute = executor.execute
    calls = {"n": 0}

    def failing(scheduler_output: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > num_ok:
            raise RuntimeError(message)
        return real_execute(scheduler_output)

    executor.execute = failing


# The core_main_failing_once fault's flag file: once it exists, cores start without the fault.
FAULT_FLAG_ENV = "HYBRIDSERVE_TEST_CORE_FAULT_FLAG"


def core_main_failing_once(config: Any, conn: Any, index: int, progress: bool) -> None:
    """core_process.core_main in a core whose executor raises on its 3rd step, unless an
    earlier core already failed so (the flag file): a failure its restart does not repeat."""
    import os
    from pathlib import Path

    from hybridserve.engine import core_process
    from hybridserve.executor.torch.executor import TorchExecutor

    flag = Path(os.environ[FAULT_FLAG_ENV])
    if not flag.exists():
        real_execute = TorchExecutor.execute
        calls = {"n": 0}

        def failing(self: Any, scheduler_output: Any) -> Any:
            calls["n"] += 1
            if calls["n"] > 2:
                flag.touch()
                raise RuntimeError("device lost at /secret/path")
            return real_execute(self, scheduler_output)

        TorchExecutor.execute = failing  # type: ignore[method-assign]
    core_process.core_main(config, conn, index, progress)
