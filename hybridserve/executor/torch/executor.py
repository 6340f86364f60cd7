"""TorchExecutor: the PyTorch backend of the Executor interface, with a worker thread.

`execute` enqueues a step on a single worker thread and returns a Future; `wait` blocks
on it. One worker means steps run strictly in dispatch order, which is what lets step
N+1 read the tokens step N sampled (async scheduling). With `use_worker_thread=False`
steps run inline in `execute` (simplest to debug; sync scheduling loses nothing).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import DEFAULT_BLOCK_SIZE, KVCacheConfig, KVCacheSpec, group_layers
from hybridserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from hybridserve.executor.base import Executor
from hybridserve.executor.torch.kv_cache import TORCH_DTYPES, dtype_name, num_blocks_for_memory
from hybridserve.executor.torch.model_runner import ModelRunner
from hybridserve.executor.torch.offload import OffloadWorker
from hybridserve.executor.torch.paged_decode import paged_decode
from hybridserve.executor.torch.spec_decode import NgramDrafter
from hybridserve.executor.torch.threads import ThreadGovernor
from hybridserve.models.config import ModelConfig
from hybridserve.models.arch.decoder import DecoderLM
from hybridserve.models.platform.heap import IdleHeapRelease
from hybridserve.models.kv_specs import kv_dtype_problem, model_kv_layer_specs
from hybridserve.models.loaders.loader import load_model
from hybridserve.models.arch.mamba_lm import MambaLM
from hybridserve.models.layers.smoothing import Encode
from hybridserve.models.layers.act_mul import act_mul_kernel
from hybridserve.models.layers.qk_norm_rope import qk_norm_rope_kernel
from hybridserve.models.layers.residual_norms import residual_norms_kernel
from hybridserve.models.layers.span_kernel import KERNEL
from hybridserve.text.structured_output import GrammarBackend


def resolve_device(device: str | torch.device | None) -> torch.device:
    """"cpu" by default; "cuda" (or "cuda:N") only when asked for and available; "auto" picks."""
    if device is None or device == "cpu":
        return torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    return dev


def build_kv_cache_config(model_cfg: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE, *,
                          num_blocks: int | None = None, kv_cache_memory: int | str | None = None,
                          kv_dtype: str = "float32") -> KVCacheConfig:
    """KVCacheConfig for a model: groups from its layer types, pool from a budget or a count."""
    if (num_blocks is None) == (kv_cache_memory is None):
        raise ConfigError("give exactly one of num_blocks or kv_cache_memory")
    if kv_dtype not in TORCH_DTYPES:
        raise ConfigError(f"kv cache dtype {kv_dtype!r} not supported; use one of {sorted(TORCH_DTYPES)}")
    groups = group_layers(model_kv_layer_specs(model_cfg, block_size, kv_dtype))
    if num_blocks is None:
        assert kv_cache_memory is not None
        num_blocks = num_blocks_for_memory(groups, kv_cache_memory)
    if num_blocks < 2:
        raise ConfigError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


class TorchExecutor(Executor):
    """Runs a DecoderLM or MambaLM (or an HF model directory) with paged attention."""

    computes_in_chunk_attention_from_batch = True

    @staticmethod
    def attends_in_chunk_from_batch(batch_invariant: bool) -> bool:
        """computes_in_chunk_attention_from_batch for an executor made with `batch_invariant`:
        a batch-invariant one reads every token's keys back from the cache (per-token
        queries), so each token needs its block (no window-tail allocation)."""
        return not batch_invariant

    def __init__(self, model: DecoderLM | MambaLM | str | Path, *, device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None,
                 use_worker_thread: bool = True, seed: int = 0,
                 num_threads: int | None = None, drafter: NgramDrafter | None = None,
                 grammar: GrammarBackend | None = None, quantization: str = "none",
                 encode: Encode | None = None, compile: bool = True, batch_invariant: bool = False) -> None:
        """kv_dtype: the KV cache's (None: the model's; models/kv_specs.kv_dtype_problem says
        which others a model may keep, ConfigError otherwise);
        drafter: fills the draft slots of speculative decoding (default: n-gram sizes 2..4);
        grammar: compiles structured outputs (None: requests with one are refused);
        quantization: of a model loaded from a directory (models/platform/cpu_features.py);
        encode: the tokenizer, for int8's calibration texts (models/layers/smoothing.py);
        compile: the int8 layers' chains compiled for large steps (models/arch/compiled_chains.py);
        batch_invariant: each row computed alike whatever the step holds
        (DecoderLM.make_batch_invariant, the attention's per-token queries), or ConfigError."""
        self.device = resolve_device(device)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        # Without a thread count given, a CPU step runs with the count measured fastest now
        # (executor/torch/threads.py): all cores on a quiet machine, one on a busy one.
        cores = torch.get_num_threads()
        self._threads = ThreadGovernor(cores) if num_threads is None and self.device.type == "cpu" and cores > 1 else None
        self.model = model if isinstance(model, (DecoderLM, MambaLM)) else load_model(
            model, self.device, dtype, quantization, encode=encode, compile=compile)
        if batch_invariant:
            if isinstance(self.model, MambaLM) or self.device.type != "cpu" or paged_decode() is None:
                raise ConfigError("batch_invariant needs an attention-only model on the CPU with the in-place "
                                  "decode kernel built (a C compiler)")
            self.model.make_batch_invariant()
            self.computes_in_chunk_attention_from_batch = self.attends_in_chunk_from_batch(batch_invariant)
        model_dtype = dtype_name(self.model.dtype)
        self._kv_dtype = model_dtype if kv_dtype is None else dtype_name(kv_dtype)
        problem = kv_dtype_problem(self._kv_dtype, model_dtype, self.model.cfg)
        if problem:
            raise ConfigError(problem)
        self.seed = seed
        self.drafter = drafter
        self.grammar = grammar
        self.runner: ModelRunner | None = None
        # KV offload to host memory (enable_kv_offload): (host blocks, injected load failures).
        self._offload_args: tuple[int, int] | None = None
        self.offload: OffloadWorker | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-runner") if use_worker_thread else None
        # Step temporaries left in the C heap go back to the OS once steps pause (models/platform/heap.py).
        self._idle_release = IdleHeapRelease() if self.device.type == "cpu" else None

    @property
    def model_config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def runs_steps_inline(self) -> bool:
        return self._pool is None

    @property
    def kv_dtype(self) -> str:
        """The KV cache dtype: the model's own, or bfloat16 under a float32 model (K/V rounded
        as they are written)."""
        return self._kv_dtype

    def kv_layer_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        return model_kv_layer_specs(self.model.cfg, block_size, self.kv_dtype)

    def kv_cache_config(self, block_size: int = DEFAULT_BLOCK_SIZE, *, num_blocks: int | None = None,
                        kv_cache_memory: int | str | None = None) -> KVCacheConfig:
        """The model's KV cache groups and a pool from `num_blocks` or a `kv_cache_memory` budget."""
        return build_kv_cache_config(self.model.cfg, block_size, num_blocks=num_blocks,
                                     kv_cache_memory=kv_cache_memory, kv_dtype=self.kv_dtype)

    def initialize(self, kv_cache_config: KVCacheConfig) -> None:
        if self.runner is not None:
            raise ConfigError("TorchExecutor.initialize called twice")
        self.runner = ModelRunner(self.model, kv_cache_config, self.device, self.seed, self.drafter, self.grammar)
        if self.device.type == "cpu":  # built (or loaded from the cache) now, not in the first request's step
            paged_decode()
            if self.model.dtype == torch.bfloat16:
                qk_norm_rope_kernel()
                residual_norms_kernel()
                act_mul_kernel()
        if self._offload_args is not None:
            num_host_blocks, fail_loads = self._offload_args
            self.offload = OffloadWorker(self.runner.kv, num_host_blocks, self.device, fail_loads)

    def enable_kv_offload(self, num_host_blocks: int, fail_loads: int = 0) -> None:
        """Run the executor side of host KV offload (see executor/torch/offload.py); call
        before initialize, with the scheduler side built for the same num_host_blocks."""
        if self.runner is not None:
            raise ConfigError("enable_kv_offload must be called before initialize")
        self._offload_args = (num_host_blocks, fail_loads)

    def _step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step on the runner thread, with the thread count the governor picks."""
        try:
            return self._governed_step(so)
        finally:
            if self._idle_release is not None:
                self._idle_release.stepped()

    def _governed_step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        governor = self._threads
        if governor is None or not so.total_num_scheduled_tokens:
            return self._run_step(so)
        holds_prompt = any(r.num_scheduled_tokens - r.num_draft_tokens > 1 for r in so.requests)
        threads = governor.choose(so.total_num_scheduled_tokens, holds_prompt=holds_prompt)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # on the runner thread: OpenMP's count is per calling thread
        start = time.perf_counter()
        out = self._run_step(so)
        governor.observe(so.total_num_scheduled_tokens, threads, time.perf_counter() - start)
        return out

    def _run_step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step; with offload, start this step's copies first (they overlap the model)
        and report the copies finished by the end of the step."""
        assert self.runner is not None
        offload = self.offload
        if offload is None:
            return self.runner.execute(so)
        offload.submit(so.kv_connector_metadata)
        out = self.runner.execute(so)
        out.kv_connector_output = offload.collect(wait_for_one=so.is_empty())
        return out

    def execute(self, scheduler_output: SchedulerOutput) -> Any:
        if self.runner is None:
            raise ConfigError("TorchExecutor.execute before initialize")
        if self._pool is not None:
            return self._pool.submit(self._step, scheduler_output)
        done: Future = Future()
        try:
            done.set_result(self._step(scheduler_output))
        except BaseException as exc:  # re-raised by wait(), in step order like the threaded path
            done.set_exception(exc)
        return done

    def wait(self, handle: Any) -> ModelRunnerOutput:
        return handle.result()

    def prepare_large_steps(self) -> None:
        """The compiled chains and the span summaries' kernel (models/layers/span_kernel.py)
        built now, for each thread count the governor may give a step, under the grad mode
        steps run in: a compiled graph guards on both, and a step that met a new count or
        mode would compile (seconds) in the middle of serving. Only where the model
        compiles (not under --no-compile, which asks for no compiler)."""
        if not (isinstance(self.model, DecoderLM) and self.model.compiles_large_steps):
            return
        counts = self._threads.candidates if self._threads is not None else [torch.get_num_threads()]
        before = torch.get_num_threads()
        try:
            with torch.inference_mode():  # as ModelRunner.execute runs steps
                for threads in counts:
                    torch.set_num_threads(threads)
                    self.model.prepare_large_steps()
                    KERNEL.prepare()
        finally:
            torch.set_num_threads(before)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._idle_release is not None:
            self._idle_release.close()
        if self.offload is not None:
            self.offload.shutdown()
            self.offload = None
        self.runner = None
