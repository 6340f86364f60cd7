"""MultiprocExecutor: pipeline x tensor parallel workers as processes on this machine.

The driver (this object, in the engine's process) starts P x T worker processes with
torch.multiprocessing (from a fork server) and talks to them through queues: per step it puts the
SchedulerOutput in every worker's inbox and returns at once, so the engine loop can
schedule and dispatch the next step while this one runs; `wait` reads outputs from the
one outbox, where the output rank (tp rank 0 of the last stage) puts each step's
result in order and any worker puts its error. Workers talk to each other only through
torch.distributed.

A worker that dies or fails ends the executor: `wait` raises ExecutorFailedError naming
the worker, and `shutdown` stops every process (terminate, then kill) so none outlives
the engine.
"""

from __future__ import annotations

import queue
import socket
import time
from collections import deque
from typing import Any

import torch.multiprocessing as mp

from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from hybridserve.executor.distributed.driver import DistributedDriver, ExecutorFailedError
from hybridserve.core.errors import one_line
from hybridserve.executor.distributed.worker import StepTrace, Worker, WorkerSpec, describe_exit


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_context() -> Any:
    """Workers fork from a fork server that imported torch and the worker code once and
    never ran a parallel region: a fresh interpreter per worker would pay torch's import
    (seconds) each time, and forking the engine's process would copy its OpenMP and
    thread state, which is not fork-safe."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hybridserve.executor.distributed.worker"])
    return ctx


def _worker_main(spec: WorkerSpec, rank: int, inbox: Any, outbox: Any) -> None:
    """A worker process: build, then execute messages until told to stop."""
    worker = None
    try:
        worker = Worker(spec, rank)
        outbox.put(("ready", rank, None))
        # The driver's process: a worker whose driver died (killed, so no "stop" came)
        # exits instead of waiting on its inbox for ever.
        driver = mp.parent_process()
        while True:
            try:
                kind, payload = inbox.get(timeout=1.0)
            except queue.Empty:
                if driver is not None and not driver.is_alive():
                    break
                continue
            if kind == "stop":
                break
            if kind == "init":
                outbox.put(("initialized", rank, worker.init_cache(*payload)))
            elif kind == "step":
                out = worker.step(payload)
                if rank == spec.layout.output_rank:
                    outbox.put(("output", rank, out))
                elif worker.offload is not None:
                    outbox.put(("kv", rank, out))
            elif kind == "traces":
                outbox.put(("traces", rank, worker.take_traces()))
    except KeyboardInterrupt:
        pass
    except BaseException as exc:  # reported to the driver, which fails the engine's step
        outbox.put(("error", rank, one_line(exc)))
    finally:
        if worker is not None:
            try:
                worker.close()
            except Exception:
                pass


class MultiprocExecutor(DistributedDriver):
    def __init__(self, spec_args: dict[str, Any], *, start_timeout: float = 300.0) -> None:
        super().__init__(spec_args)
        spec = WorkerSpec(init_method=f"tcp://127.0.0.1:{free_port()}", **spec_args)
        self.spec = spec
        ctx = _worker_context()
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(spec.layout.world_size)]
        self.procs = [
            ctx.Process(target=_worker_main, args=(spec, rank, self.inboxes[rank], self.outbox), daemon=True,
                        name=f"hybridserve-worker-{rank}")
            for rank in range(spec.layout.world_size)
        ]
        self.failure: str | None = None
        self.dispatched: deque[SchedulerOutput] = deque()
        # With KV offload: per rank, the outputs (output rank) or transfer reports (the
        # others) not yet claimed by a step, oldest first.
        self._report_ranks = [r for r in range(spec.layout.world_size) if r != spec.layout.output_rank]
        self._reports: dict[int, deque[Any]] = {r: deque() for r in range(spec.layout.world_size)}
        for p in self.procs:
            p.start()
        try:
            self._gather("ready", start_timeout)
        except BaseException:
            self.shutdown()
            raise

    # -- Executor -----------------------------------------------------------------
    def initialize(self, kv_cache_config: KVCacheConfig) -> None:
        for box in self.inboxes:
            box.put(("init", (kv_cache_config, self.offload_args)))
        self.kv_bytes_per_worker = self._gather("initialized", 600.0)

    def execute(self, scheduler_output: SchedulerOutput) -> Any:
        self._check()
        for box in self.inboxes:
            box.put(("step", scheduler_output))
        self.dispatched.append(scheduler_output)
        return scheduler_output.step_id

    def wait(self, handle: Any) -> ModelRunnerOutput:
        so = self.dispatched.popleft()
        assert so.step_id == handle, "steps are waited for in dispatch order"
        if self.offload_args is None:
            return self._next("output", None)[2]
        # With offload every worker reports its share's transfers for the step as well.
        # Each rank's messages arrive in step order, so the oldest unclaimed output and
        # report of each rank belong to this step (later steps' may already be queued).
        while not self._reports[self.layout.output_rank] or any(not self._reports[r] for r in self._report_ranks):
            kind, rank, payload = self._receive(None)
            if kind not in ("output", "kv"):
                self._fail(f"expected a step's output from the workers, got {kind!r} from rank {rank}")
            self._reports[rank].append(payload)
        out = self._reports[self.layout.output_rank].popleft()
        reports = [out.kv_connector_output] + [self._reports[r].popleft() for r in self._report_ranks]
        out.kv_connector_output = self.connector_reports.merge(reports)
        return out

    def in_flight_steps(self) -> list[SchedulerOutput]:
        """Steps dispatched whose output has not been waited for, oldest first."""
        return list(self.dispatched)

    def traces(self) -> list[StepTrace]:
        """Every worker's step timings so far (spec trace=True)."""
        for box in self.inboxes:
            box.put(("traces", None))
        return [t for per_rank in self._gather("traces", 60.0) for t in per_rank]

    def shutdown(self) -> None:
        for box, p in zip(self.inboxes, self.procs):
            if p.is_alive():
                try:
                    box.put(("stop", None))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 10.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for q in (*self.inboxes, self.outbox):
            q.close()
            q.cancel_join_thread()

    # -- messages -----------------------------------------------------------------
    def _check(self) -> None:
        if self.failure is not None:
            raise ExecutorFailedError(self.failure)

    def _next(self, kind: str, timeout: float | None) -> tuple[str, int, Any]:
        """The next message, which must be of `kind`."""
        msg = self._receive(timeout, kind)
        if msg[0] != kind:
            self._fail(f"expected {kind!r} from the workers, got {msg[0]!r} from rank {msg[1]}")
        return msg

    def _fail(self, failure: str) -> None:
        self.failure = failure
        raise ExecutorFailedError(failure)

    def _receive(self, timeout: float | None, kind: str = "output") -> tuple[str, int, Any]:
        """The next message from the outbox; an error or a dead worker raises."""
        self._check()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                msg = self.outbox.get(timeout=0.5)
            except queue.Empty:
                dead = self._dead_worker()
                if dead is not None:
                    self.failure = dead
                    raise ExecutorFailedError(self.failure) from None
                if deadline is not None and time.monotonic() > deadline:
                    self.failure = f"no {kind!r} from the workers within {timeout:.0f} s"
                    raise ExecutorFailedError(self.failure) from None
                continue
            if msg[0] == "error":
                # A peer's death shows up first as its neighbours' connection errors: name
                # the dead worker, the cause, where there is one.
                time.sleep(0.2)
                crashed = next((describe_exit(r, p.exitcode) for r, p in enumerate(self.procs)
                                if p.exitcode not in (None, 0)), None)
                self.failure = crashed or f"worker rank {msg[1]} failed: {msg[2]}"
                raise ExecutorFailedError(self.failure)
            return msg

    def _dead_worker(self) -> str | None:
        """How the first worker that is no longer running ended (None: all run)."""
        return next((describe_exit(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()), None)

    def _gather(self, kind: str, timeout: float) -> list[Any]:
        """One `kind` message from every worker, by rank."""
        got: dict[int, Any] = {}
        while len(got) < len(self.procs):
            _, rank, payload = self._next(kind, timeout)
            got[rank] = payload
        return [got[r] for r in range(len(self.procs))]
