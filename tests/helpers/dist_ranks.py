"""Run a function on N local processes joined in a gloo process group, for the model
parallelism tests: spawned with torch.multiprocessing, rendezvous through a FileStore (no
port to race for), results returned through files. Every child is joined or terminated
before `run_ranks` returns or raises: a failing rank ends the others at once, and a hang
ends at the timeout, so no test leaves processes behind.
"""

from __future__ import annotations

import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

# Long enough for a slow, shared 2-core machine; short enough that a hang fails the test.
RANKS_TIMEOUT_S = 120.0
_POLL_S = 0.05


def _entry(rank: int, world: int, store: str, out_dir: str, target: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share 2 cores
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=RANKS_TIMEOUT_S))
        try:
            result = target(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(target: Callable[..., Any], world: int, *args: Any, timeout: float = RANKS_TIMEOUT_S) -> list[Any]:
    """[target(rank, world, *args) for each rank], each run in its own process after
    `torch.distributed.init_process_group("gloo")`. `target` must be importable (a module-level
    function). AssertionError with the failing rank's traceback if one fails or time runs out."""
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hybridserve_ranks_") as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store, tmp, target, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # one rank failed: the others would wait for it in a collective
                time.sleep(_POLL_S)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
        errors = [(Path(tmp) / f"rank{r}.err") for r in range(world)]
        for r, (p, err) in enumerate(zip(procs, errors)):
            if err.exists():
                raise AssertionError(f"rank {r} failed:\n{err.read_text()}")
        if any(p.exitcode != 0 for p in procs):
            raise AssertionError(f"ranks did not finish in {timeout} s (exit codes {[p.exitcode for p in procs]})")
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
