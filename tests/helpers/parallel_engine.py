"""An EngineCore over P x T worker processes (multiprocessing or Ray) on a tiny model."""

from __future__ import annotations

from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.engine.loop import EngineCore, build_engine
from hybridserve.executor.distributed.backends import make_distributed_executor
from hybridserve.executor.distributed.layout import ParallelLayout
from tests.helpers.tiny_models import model_dir

NEW_TOKENS = 20


def make_engine(kind: str, pp: int, tp: int = 1, *, async_scheduling: bool = False, spec: int = 0,
                num_blocks: int = 200, drafter: object = None, trace: bool = False, unsafe: bool = False,
                backend: str = "mp", max_num_batched_tokens: int = 40, max_model_len: int = 256) -> EngineCore:
    ex = make_distributed_executor(backend, layout=ParallelLayout(pp, tp), model_path=str(model_dir(kind)),
                                   num_threads=1, drafter=drafter, trace=trace)
    try:
        sc = SchedulerConfig(max_model_len=max_model_len, async_scheduling=async_scheduling, pipeline_parallel_size=pp,
                             max_num_batched_tokens=max_num_batched_tokens, num_speculative_tokens=spec)
        return build_engine(sc, ex.kv_cache_config(16, num_blocks=num_blocks), ex, unsafe_optimistic_free=unsafe)
    except BaseException:
        ex.shutdown()
        raise
