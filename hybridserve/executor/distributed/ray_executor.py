"""RayExecutor: the same workers as Ray actors, which Ray may place on several machines.

Ray decides where each worker runs (one placement group, a bundle per worker); the
workers still talk to each other with torch.distributed, rendezvousing at the node of
rank 0. Per step the driver puts the SchedulerOutput in Ray's object store once and
calls every actor's `step` with it; an actor runs its calls one at a time in the order
they were made, which keeps each stage in dispatch order. `wait` gets the step's
results from all actors (the output rank's is the step's output), so a failure on any
worker surfaces at the step it broke.

Multi-node: start Ray on each machine (`ray start --head` / `ray start --address=...`)
and set RAY_ADDRESS=auto (or the head's address) before starting hybridserve. Without
it, a local Ray instance is started for this process and stopped with the executor.
"""

from __future__ import annotations

import os
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.sched.output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from hybridserve.executor.distributed.driver import DistributedDriver, ExecutorFailedError
from hybridserve.executor.distributed.worker import StepTrace, Worker, WorkerSpec


class MissingRayError(ConfigError):
    """The ray backend was asked for without the optional `ray` extra installed."""


class RayWorker:
    """The actor: a Worker built once the rendezvous address is known."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def rendezvous(self) -> str:
        """A torch.distributed init address on this actor's node (asked of rank 0)."""
        import ray

        from hybridserve.executor.distributed.mp_executor import free_port

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, spec: WorkerSpec, rank: int) -> None:
        self.worker = Worker(spec, rank)

    def init_cache(self, kv_cache_config: KVCacheConfig, offload: tuple[int, int] | None) -> int:
        assert self.worker is not None
        return self.worker.init_cache(kv_cache_config, offload)

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput | KVConnectorOutput | None:
        assert self.worker is not None
        return self.worker.step(so)

    def take_traces(self) -> list[StepTrace]:
        assert self.worker is not None
        return self.worker.take_traces()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class RayExecutor(DistributedDriver):
    def __init__(self, spec_args: dict[str, Any]) -> None:
        super().__init__(spec_args)
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise MissingRayError(
                "distributed_executor_backend='ray' needs Ray: pip install 'hybridserve[ray]'") from None
        self._ray = ray
        self._remove_pg = remove_placement_group
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        layout = self.layout
        threads = int(spec_args.get("num_threads", 1))
        device = spec_args.get("device", "cpu") or "cpu"
        bundle = {"GPU": 1} if str(device).startswith("cuda") else {"CPU": threads}
        self.pg = placement_group([dict(bundle) for _ in range(layout.world_size)], strategy="PACK")
        ray.get(self.pg.ready())
        actor_cls = ray.remote(num_cpus=0)(RayWorker)
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=rank)).remote()
            for rank in range(layout.world_size)
        ]
        try:
            init_method = ray.get(self.actors[0].rendezvous.remote())
            self.spec = WorkerSpec(init_method=init_method, **spec_args)
            self._get([a.start.remote(self.spec, r) for r, a in enumerate(self.actors)])
        except BaseException:
            self.shutdown()
            raise
        self.failure: str | None = None

    def _get(self, refs: list[Any]) -> list[Any]:
        ray = self._ray
        try:
            return ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            text = str(exc).strip().splitlines()
            self.failure = f"a Ray worker failed: {text[-1] if text else type(exc).__name__}"
            raise ExecutorFailedError(self.failure) from None

    def initialize(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_bytes_per_worker = self._get([a.init_cache.remote(kv_cache_config, self.offload_args)
                                              for a in self.actors])

    def execute(self, scheduler_output: SchedulerOutput) -> Any:
        if self.failure is not None:
            raise ExecutorFailedError(self.failure)
        ref = self._ray.put(scheduler_output)
        return [a.step.remote(ref) for a in self.actors]

    def wait(self, handle: Any) -> ModelRunnerOutput:
        results = self._get(handle)
        out = results[self.layout.output_rank]
        if self.offload_args is not None:  # every worker's share of the step's transfers
            reports = [out.kv_connector_output] + [r for i, r in enumerate(results) if i != self.layout.output_rank]
            out.kv_connector_output = self.connector_reports.merge(reports)
        return out

    def traces(self) -> list[StepTrace]:
        return [t for per_rank in self._get([a.take_traces.remote() for a in self.actors]) for t in per_rank]

    def shutdown(self) -> None:
        ray = self._ray
        actors = getattr(self, "actors", [])
        if actors:
            try:
                ray.get([a.close.remote() for a in actors], timeout=10)
            except Exception:
                pass  # a dead or stuck worker is killed below
            for a in actors:
                ray.kill(a)
            self.actors = []
        if getattr(self, "pg", None) is not None:
            self._remove_pg(self.pg)
            self.pg = None
        if self._own_ray and ray.is_initialized():
            ray.shutdown()
