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
