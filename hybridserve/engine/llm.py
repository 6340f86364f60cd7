"""LLM: the blocking Python API. `LLM(model).generate(prompts, SamplingParams(...))`.

    from hybridserve import LLM, SamplingParams
    llm = LLM("path/to/hf_dir", max_model_len=2048)          # model=None: the default model
    outs = llm.generate(["Hello", [2, 17, 5]], SamplingParams(max_tokens=32, temperature=0))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

Outputs come back in input order, one GenerationOutput per prompt (n choices in
`.outputs`). The engine steps in the calling thread (the executor's worker thread runs
the model); an exception or Ctrl-C aborts the batch and leaves the engine reusable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

from hybridserve.config import EngineConfig
from hybridserve.core.errors import ConfigError, RequestError
from hybridserve.core.request import SamplingParams
from hybridserve.engine.frontend import (
    EngineParts,
    Prompt,
    build_engine_parts,
    new_request_id,
    prepare_chat,
    prepare_params,
    prepare_prompt,
)
from hybridserve.engine.loop import EngineStuckError
from hybridserve.engine.outputs import GenerationOutput, GenerationTracker, as_sampling_params
from hybridserve.text.tokenizer import Tokenizer

ParamsArg = SamplingParams | Sequence[SamplingParams] | None
_MAX_IDLE_STEPS = 100_000


def normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A string or a list of ints is one prompt; any other iterable is a list of prompts.
    A numpy array or torch tensor counts as its `tolist()` (1-D: one prompt of ids)."""
    if hasattr(prompts, "tolist"):
        prompts = prompts.tolist()
    if isinstance(prompts, str):
        return [prompts]
    # bytes and dicts iterate too, into ints and keys that would pass for prompts.
    if isinstance(prompts, (bytes, bytearray, dict)) or not isinstance(prompts, Iterable):
        raise RequestError("prompts are a string, a list of token ids, or a list of those; got "
                           f"{type(prompts).__name__}", "prompt")
    items = list(prompts)
    if items and all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


class LLM:
    """A model plus an engine, driven synchronously."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, progress: bool = True,
                 encode_first: Sequence[str] = (), **engine_args: Any) -> None:
        """`encode_first`: text prompts known before the load, encoded then; the tokenizer
        is then held only for decoding (a converted GGUF's: engine/frontend.build_engine_parts),
        and encoding any other text reads it again (a transient of a few hundred MB)."""
        if config is not None and (engine_args or model is not None):
            raise RequestError("pass either config=EngineConfig(...) or model/engine arguments, not both")
        self.config = config or EngineConfig.from_kwargs(model=model, **engine_args)
        if self.config.data_parallel_size > 1:
            raise ConfigError(f"data_parallel_size={self.config.data_parallel_size}: replicas run behind a server "
                              "(AsyncLLM(core_process=True), `hybridserve serve`); LLM runs one engine in this process")
        self.parts: EngineParts = build_engine_parts(self.config, progress=progress, encode_first=encode_first)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.parts.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.parts.max_model_len

    # -- public API ------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: ParamsArg = None, *,
                 use_tqdm: bool = True) -> list[GenerationOutput]:
        """Run every prompt to completion; one output per prompt, in input order."""
        trackers = self._trackers(normalize_prompts(prompts), sampling_params)
        self._run(trackers, None, self._progress_bar(trackers, use_tqdm))
        return [t.final_output() for t in trackers]

    def chat(self, conversations: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
             sampling_params: ParamsArg = None, *, use_tqdm: bool = True) -> list[GenerationOutput]:
        """Like generate, for conversations (a list of {"role", "content"} dicts, or a list of them)."""
        if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Sequence):
            raise RequestError("chat takes a conversation (a list of {'role', 'content'} dicts) or a list of them, "
                               f"got {type(conversations).__name__}", "messages")
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else list(conversations)
        trackers = self._chat_trackers(convs, sampling_params)  # type: ignore[arg-type]
        self._run(trackers, None, self._progress_bar(trackers, use_tqdm))
        return [t.final_output() for t in trackers]

    def stream(self, prompts: Prompt | Sequence[Prompt], sampling_params: ParamsArg = None, *, chat: bool = False
               ) -> Iterator[tuple[int, GenerationOutput]]:
        """Yield (prompt index, incremental output) as text is generated, all prompts batched.
        With chat=True each text prompt is one user message (through the chat template)."""
        if chat:
            convs = [[{"role": "user", "content": p}] for p in normalize_prompts(prompts)]
            trackers = self._chat_trackers(convs, sampling_params)  # type: ignore[arg-type]
        else:
            trackers = self._trackers(normalize_prompts(prompts), sampling_params)
        pending: list[tuple[int, GenerationOutput]] = []
        index = {id(t): i for i, t in enumerate(trackers)}
        gen = self._steps(trackers, lambda t, out: pending.append((index[id(t)], out)))
        for _ in gen:
            yield from pending
            pending.clear()

    def shutdown(self) -> None:
        self.parts.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals -------------------------------------------------------------------
    def _params_list(self, sampling_params: ParamsArg, n: int) -> list[Any]:
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise RequestError(f"got {len(sampling_params)} sampling params for {n} prompts")
            params = [as_sampling_params(p) for p in sampling_params]
        else:
            params = [as_sampling_params(sampling_params)] * n  # type: ignore[arg-type]
        return [prepare_params(self.parts, p) for p in params]

    def _trackers(self, prompts: list[Prompt], sampling_params: ParamsArg) -> list[GenerationTracker]:
        params = self._params_list(sampling_params, len(prompts))
        trackers = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                text, ids = prepare_prompt(self.parts, prompt)
            except RequestError as exc:
                raise RequestError(f"prompt {i}: {exc}") from None
            trackers.append(GenerationTracker(new_request_id("gen"), text, ids, p, self.parts.tokenizer))
        return trackers

    def _chat_trackers(self, convs: list[Sequence[dict[str, str]]], sampling_params: ParamsArg
                       ) -> list[GenerationTracker]:
        params = self._params_list(sampling_params, len(convs))
        trackers = []
        for i, (conv, p) in enumerate(zip(convs, params)):
            try:
                text, ids, p = prepare_chat(self.parts, conv, p)
            except RequestError as exc:
                raise RequestError(f"conversation {i}: {exc}") from None
            trackers.append(GenerationTracker(new_request_id("chat"), text, ids, p, self.parts.tokenizer))
        return trackers

    def _progress_bar(self, trackers: list[GenerationTracker], use_tqdm: bool) -> Any:
        if not use_tqdm or len(trackers) < 2:
            return None
        from tqdm import tqdm

        return tqdm(total=len(trackers), desc="generating", unit="prompt", file=sys.stderr, dynamic_ncols=True)

    def _run(self, trackers: list[GenerationTracker], on_output: Callable[[GenerationTracker, GenerationOutput], None]
             | None, bar: Any) -> None:
        try:
            for _ in self._steps(trackers, on_output, bar):
                pass
        finally:
            if bar is not None:
                bar.close()

    def _steps(self, trackers: list[GenerationTracker],
               on_output: Callable[[GenerationTracker, GenerationOutput], None] | None, bar: Any = None
               ) -> Iterator[None]:
        """Add the trackers' requests, step until all finish; yields after every step."""
        parts = self.parts
        engine = parts.engine
        by_core: dict[str, GenerationTracker] = {}
        start, generated, idle = time.monotonic(), 0, 0
        try:
            for t in trackers:
                for req in t.core_requests(parts.eos_token_id, parts.model_stop_ids):
                    if req.request_id in by_core:
                        raise RequestError(f"duplicate request id {req.request_id!r}")
                    by_core[req.request_id] = t
                    done = engine.add_request(req)
                    if done is not None:
                        t.process(done, time.monotonic())
            unfinished = {id(t) for t in trackers if not t.finished}
            while engine.has_unfinished_requests():
                out, outs = engine.step()
                idle = idle + 1 if out is None or out.is_empty() else 0
                if idle > _MAX_IDLE_STEPS:
                    raise EngineStuckError(f"no request could be scheduled for {_MAX_IDLE_STEPS} steps")
                now = time.monotonic()
                touched: dict[int, GenerationTracker] = {}
                stops = []
                for o in outs:
                    t = by_core.get(o.request_id)
                    if t is None:
                        continue
                    generated += len(o.new_token_ids)
                    if t.process(o, now):
                        stops.append(o.request_id)
                    touched[id(t)] = t
                if stops:
                    engine.abort_requests(stops)
                for key, t in touched.items():
                    if on_output is not None:
                        delta = t.take_output()
                        if delta is not None:
                            on_output(t, delta)
                    if key in unfinished and t.finished:
                        unfinished.discard(key)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"{generated / max(now - start, 1e-9):.1f} tok/s", refresh=False)
                yield
        except BaseException:
            # Leave the engine clean for the next call: abort this batch and drain its steps.
            try:
                engine.abort_requests(list(by_core))
                while engine.has_unfinished_requests():
                    engine.step()
            except Exception:  # noqa: BLE001 - the engine itself failed; the original error says why
                pass
            raise
