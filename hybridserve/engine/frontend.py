"""Build an engine from an EngineConfig, and turn user prompts into checked token ids.

Shared by `LLM` and `AsyncLLM`. Order of work at start, cheapest checks first: resolve
the model path, read its config.json, size and check the KV pool (no weights yet),
load the tokenizer, then the weights.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from hybridserve.config import EngineConfig, parse_size, resolve_engine_settings
from hybridserve.core.errors import ConfigError, RequestError
from hybridserve.core.kv.spec import group_layers
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.engine.loop import EngineCore
from hybridserve.models.config import ModelConfig
from hybridserve.text.structured_output import GrammarBackend
from hybridserve.text.tokenizer import Tokenizer, release_tokenizer

Prompt = str | Sequence[int]


@dataclass
class FrontEnd:
    """What a front end needs to talk to an engine: the tokenizer and the model's limits.
    A server whose engine runs in core processes holds only this (see core_client.py)."""

    config: EngineConfig
    tokenizer: Tokenizer | None
    model_path: Path
    model_config: ModelConfig
    max_model_len: int
    eos_token_id: int | None
    # Further ids that end generation like EOS (generation_config.json lists), unless ignore_eos.
    model_stop_ids: tuple[int, ...]
    # Checks structured-output constraints against this tokenizer (None without one).
    grammar: GrammarBackend | None = None

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size


@dataclass
class EngineParts(FrontEnd):
    """A running engine plus what the front ends need to talk to it."""

    engine: EngineCore = field(kw_only=True)


def load_tokenizer(config: EngineConfig, model_path: Path) -> Tokenizer | None:
    """The tokenizer (the model's, or config.tokenizer), with config.chat_template applied."""
    tokenizer = Tokenizer.from_dir(config.tokenizer or model_path)
    if tokenizer is None and config.tokenizer is not None:
        raise ConfigError(f"tokenizer: no tokenizer files in {config.tokenizer}")
    if config.chat_template is not None:
        if tokenizer is None:
            raise ConfigError("chat_template needs a tokenizer; this model has none")
        tokenizer.use_chat_template(config.chat_template)
    return tokenizer


def grammar_backend(tokenizer: Tokenizer | None, model_config: ModelConfig) -> GrammarBackend | None:
    return GrammarBackend(tokenizer.hf, model_config.vocab_size) if tokenizer is not None else None


def build_engine_parts(config: EngineConfig, progress: bool = True, keep_tokenizer: bool = True,
                       encode_first: Sequence[str] = ()) -> EngineParts:
    """Resolve, check, load. Raises ConfigError (MissingExtraError for an absent extra).
    keep_tokenizer=False (an engine core process, whose server tokenizes and detokenizes):
    what the load reads of the tokenizer (EOS, the int8 calibration texts' ids) is read
    first, then its parsed vocabulary is dropped (text/tokenizer.release_tokenizer) before
    any weight is, so that it is not resident beside the load's own peak. `encode_first`
    (texts the caller will encode, known before the load: `hybridserve generate`'s prompts):
    encoded first as well, and the tokenizer dropped the same way, keeping only what
    decoding needs (text/decode_table.py); other texts read it again."""
    from hybridserve.engine.loop import build_engine
    from hybridserve.executor.torch.executor import TorchExecutor, resolve_device
    from hybridserve.executor.torch.kv_cache import TORCH_DTYPES
    from hybridserve.executor.torch.spec_decode import NgramDrafter
    from hybridserve.models.config import load_model_config
    from hybridserve.models.platform.cpu_features import choose_dtype, choose_quantization, describe, read_cpu_flags
    from hybridserve.models.loaders.default_model import resolve_model_path
    from hybridserve.models.layers.head import GROUP_LAYERS
    from hybridserve.models.loaders.gguf_loader import say
    from hybridserve.models.kv_specs import model_kv_layer_specs, resolve_kv_dtype

    device = resolve_device(config.device)
    flags = read_cpu_flags()
    dtype = choose_dtype(config.dtype, device.type, flags)
    # auto may take the GGUF's own groups: in one process (a tensor-parallel split would cut
    # them; pipeline stages with groups are not measured), on the CPU, with their native
    # kernel built (the general path expands every weight at every call)
    servable = (config.quantization == "auto" and device.type == "cpu" and not config.is_multiprocess
                and groups_take(config.model))
    quantization = choose_quantization(config.quantization, config.dtype, device.type, flags, servable)
    path = resolve_model_path(config.model, progress=progress, dtype=dtype, groups=quantization == GROUP_LAYERS)
    model_cfg = load_model_config(path)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, quantization, model_cfg)
    groups = group_layers(model_kv_layer_specs(model_cfg, config.block_size, kv_dtype))
    if config.batch_invariant and config.is_multiprocess:
        raise ConfigError("batch_invariant runs the model in one process (no pipeline or tensor parallelism)")
    from_batch = TorchExecutor.attends_in_chunk_from_batch(config.batch_invariant)
    settings = resolve_engine_settings(config, groups, model_cfg.max_position_embeddings,
                                       window_tail=SchedulerConfig(window_tail_allocation=config.window_tail_allocation)
                                       .resolve_window_tail(from_batch))
    tokenizer = load_tokenizer(config, path)
    eos, extra = _stop_token_ids(path, model_cfg, tokenizer)
    # after the checks: an error stays one line
    say(progress, describe(dtype, quantization, flags) + (f"; KV cache {kv_dtype}" if kv_dtype != dtype else ""))
    # Async scheduling overlaps the next step's scheduling with this one's execution. On a
    # GPU a worker thread lets the host run ahead of the kernels; on CPU the model's own
    # threads use every core and a second Python thread only steals them (slower end to end:
    # benchmarks/gemma_bench.py, benchmarks/results/cpu_threads.md), so the step runs inline
    # and the loop waits for each step before planning the next (engine/loop.py).
    grammar = grammar_backend(tokenizer, model_cfg)
    encode = tokenizer.encode if tokenizer is not None else None
    if encode is not None and (not keep_tokenizer or encode_first):
        from hybridserve.models.layers.smoothing import encoded_calibration

        encode = encoded_calibration(encode)
        release_tokenizer(tokenizer, keep_decoding=keep_tokenizer, texts=encode_first)
    executor: Any
    if config.is_multiprocess:
        executor = _distributed_executor(config, path, device.type, dtype, kv_dtype, quantization,
                                         tokenizer is not None)
    else:
        executor = TorchExecutor(path, device=device, dtype=TORCH_DTYPES[dtype], kv_dtype=TORCH_DTYPES[kv_dtype],
                                 quantization=quantization,
                                 use_worker_thread=config.async_scheduling and device.type != "cpu",
                                 seed=config.seed, num_threads=config.num_threads, compile=config.compile,
                                 batch_invariant=config.batch_invariant,
                                 drafter=NgramDrafter(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max),
                                 grammar=grammar, encode=encode)
    try:
        connector = None
        offload_bytes = parse_size("kv_offload_memory", config.kv_offload_memory, allow_zero=True)
        if offload_bytes:
            from hybridserve.executor.torch.offload import attach_host_offload, num_host_blocks_for_memory

            connector = attach_host_offload(executor, settings.kv_cache_config,
                                            num_host_blocks_for_memory(settings.kv_cache_config, offload_bytes))
        engine = build_engine(settings.scheduler_config, settings.kv_cache_config, executor, connector)
    except BaseException:
        executor.shutdown()
        raise
    return EngineParts(config, tokenizer, path, model_cfg, settings.max_model_len, eos, extra, grammar, engine=engine)


def groups_take(model: str | None) -> bool:
    """Whether `auto` may serve `model` as its GGUF's own groups on this CPU: a GGUF whose
    decoder gguf-groups serves, with the groups' native kernel built (the general path
    expands every weight at every call)."""
    from hybridserve.models.layers.int8_groups import group_kernel
    from hybridserve.models.loaders.default_model import groups_servable

    return groups_servable(model) and group_kernel() is not None


def _distributed_executor(config: EngineConfig, path: Path, device: str, dtype: str, kv_dtype: str, quantization: str,
                          has_tokenizer: bool) -> Any:
    """Pipeline x tensor parallel workers; each gets an equal share of the CPU threads
    unless num_threads (per worker) says otherwise."""
    import os

    from hybridserve.executor.distributed.backends import make_distributed_executor
    from hybridserve.executor.distributed.layout import ParallelLayout

    layout = ParallelLayout(config.pipeline_parallel_size, config.tensor_parallel_size)
    threads = config.num_threads or max(1, len(os.sched_getaffinity(0)) // layout.world_size)
    return make_distributed_executor(
        config.distributed_executor_backend, layout=layout, model_path=str(path), dtype=dtype, kv_dtype=kv_dtype,
        quantization=quantization, device=device, seed=config.seed, num_threads=threads,
        ngram_sizes=(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max),
        tokenizer_dir=str(config.tokenizer or path) if has_tokenizer else None,
    )


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]


def _stop_token_ids(path: Path, cfg: ModelConfig, tokenizer: Tokenizer | None) -> tuple[int | None, tuple[int, ...]]:
    """EOS is the tokenizer's (else the model config's first); the other EOS ids that the
    model and generation configs list stop generation too."""
    generation: list[int] = []
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            generation = _ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            generation = []  # an unreadable generation config only loses extra stop ids
    candidates = _ids(cfg.eos_token_id) + generation
    eos = tokenizer.eos_token_id if tokenizer is not None and tokenizer.eos_token_id is not None else None
    if eos is None and candidates:
        eos = candidates[0]
    extra = tuple(dict.fromkeys(t for t in candidates if t != eos))
    return eos, extra


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def prepare_prompt(parts: FrontEnd, prompt: Prompt) -> tuple[str | None, list[int]]:
    """(text or None, token ids) for a text or token-id prompt (a numpy array or torch tensor
    of ids too); RequestError if unusable."""
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, (bytes, bytearray)):  # would iterate into byte values posing as token ids
        raise RequestError("a prompt is a string or a list of token ids, not bytes (decode them first)", "prompt")
    if isinstance(prompt, str):
        if parts.tokenizer is None:
            raise RequestError("text prompts need a tokenizer; this model has none (pass token ids)", "prompt")
        ids = parts.tokenizer.encode(prompt, param="prompt")
        text: str | None = prompt
    else:
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestError("a prompt is a string or a list of token ids", "prompt") from None
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise RequestError("token ids must be integers", "prompt")
        text = None
    check_prompt_ids(ids, parts.max_model_len, parts.vocab_size)
    return text, ids


class ContextLengthError(RequestError):
    """The prompt (or prompt + max_tokens) does not fit in max_model_len."""


def check_prompt_ids(ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    if len(ids) >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens, but max_model_len={max_model_len} allows at most "
            f"{max_model_len - 1} prompt tokens (one must remain for the output)"
        )
    check_in_vocabulary(ids, vocab_size, "prompt")


def check_in_vocabulary(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """RequestError naming `param` unless every id is a token of the vocabulary."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param)


def prepare_params(parts: FrontEnd, params: Any) -> Any:
    """Front-end params ready for the engine: bad words tokenized, then checked."""
    if getattr(params, "bad_words", ()):
        if parts.tokenizer is None:
            raise RequestError("bad_words need a tokenizer; this model has none", "bad_words")
        seqs = dict.fromkeys(params.bad_words_token_ids)
        for word in params.bad_words:
            # A word inside a text usually follows a space, which most tokenizers fold
            # into the word's first token: ban both spellings.
            for variant in (word, " " + word.lstrip()):
                ids = tuple(parts.tokenizer.encode(variant, add_special_tokens=False, param="bad_words"))
                if ids:
                    seqs[ids] = None
        params = replace(params, bad_words=(), bad_words_token_ids=tuple(seqs))
    check_params(parts, params)
    return params


def check_params(parts: FrontEnd, params: Any) -> None:
    """What SamplingParams cannot check alone: token ids against this model's vocabulary
    (an id past it would index the logits out of bounds), and stop strings need a tokenizer."""
    bad = next(((name, t) for name, t in params.token_ids_to_check() if t >= parts.vocab_size), None)
    if bad is not None:
        raise RequestError(f"{bad[0]}: token id {bad[1]} is outside the vocabulary (0..{parts.vocab_size - 1})",
                           bad[0])
    if params.stop and parts.tokenizer is None:
        raise RequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
    if params.structured_output is not None:
        if parts.grammar is None:
            raise RequestError("structured outputs need a tokenizer; this model has none", "structured_output")
        parts.grammar.check(params.structured_output)


def check_messages(messages: Any) -> None:
    """RequestError unless `messages` is a list of dicts with a string "role" (what chat
    templates index; the server's request model checks this before)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError("a conversation is a list of {'role', 'content'} dicts, got "
                           f"{type(messages).__name__}", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"message {i} is not a {{'role', 'content'}} dict with a string role", "messages")


def prepare_chat(parts: FrontEnd, messages: Sequence[dict[str, Any]], params: Any,
                 tools: list[Any] | None = None, template_vars: dict[str, Any] | None = None
                 ) -> tuple[str, list[int], Any]:
    """(prompt text, ids, params) for a conversation (with the tools it offers and the
    further template variables, rendered by the chat template). Without a chat template
    the plain template applies and PLAIN_CHAT_STOPS join the stop strings."""
    from hybridserve.text.tokenizer import PLAIN_CHAT_STOPS

    if parts.tokenizer is None:
        raise RequestError("chat needs a tokenizer; this model has none", "messages")
    check_messages(messages)
    text, ids = parts.tokenizer.chat_prompt(messages, tools, template_vars)
    check_prompt_ids(ids, parts.max_model_len, parts.vocab_size)
    if not parts.tokenizer.has_chat_template:
        extra = tuple(s for s in PLAIN_CHAT_STOPS if s not in params.stop)
        if extra:
            params = replace(params, stop=tuple(params.stop) + extra)
    return text, ids, params
