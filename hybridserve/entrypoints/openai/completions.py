"""POST /v1/completions: one engine request per prompt, each with the request's n choices.

Invariants:
- Choice index = prompt index x n + the choice's index within its prompt, as OpenAI
  numbers them; each choice's first piece carries the echoed prompt (and its logprobs,
  and `prompt_logprobs` when asked for), later pieces only what was generated.
- The request is admitted (or refused with 429) before its prompts are tokenized, the
  costly part; whatever fails after admission releases its room.
- max_tokens 0 (with echo) scores the prompt alone: the engine still samples one token
  after the prompt, and that token is dropped from the reply.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hybridserve.engine.frontend import prepare_prompt
from hybridserve.engine.outputs import CompletionOutput, GenerationOutput
from hybridserve.entrypoints.openai import protocol as P
from hybridserve.entrypoints.openai.context import ServerContext
from hybridserve.entrypoints.openai.errors import shutdown_error
from hybridserve.entrypoints.openai.prepare import sampling_params, stop_strings, tokenized
from hybridserve.entrypoints.openai.sse_chunks import ChunkTemplate
from hybridserve.entrypoints.openai.streams import SSEResponse, collect, merge, sse_events, until_disconnect

# max_tokens when the request names none (OpenAI's default for completions).
DEFAULT_MAX_TOKENS = 16


async def create_completion(ctx: ServerContext, request: Request, req: P.CompletionRequest) -> Response:
    P.check_unsupported(req)
    ctx.check_ready(req.model)
    P.check_logprob_count(req.logprobs, "logprobs")
    P.check_logprob_count(req.prompt_logprobs, "prompt_logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise P.ApiError("max_tokens 0 needs echo: true (the prompt scored alone)", param="max_tokens")
    # An echoed prompt with logprobs is scored too, with the completion's alternatives.
    scored_echo = req.logprobs if req.echo else None
    prompt_top = max((n for n in (scored_echo, req.prompt_logprobs) if n is not None), default=None)
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
    prompts: list[Any]
    if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)):
        prompts = [req.prompt]
    else:
        prompts = list(req.prompt)
    if not prompts:
        raise P.ApiError("prompt must not be empty", param="prompt")
    stop = stop_strings(limits=ctx.limits, stop=req.stop)
    release = ctx.admit(len(prompts) * req.n)  # refuse before the costly part: tokenizing
    try:
        prepared = []
        for p in prompts:
            text, ids = await tokenized(lambda p=p: prepare_prompt(ctx.engine.parts, p),
                                        num_chars=len(p) if isinstance(p, str) else 0)
            params = sampling_params(ctx.engine, req, prompt_len=len(ids), max_tokens=max_tokens,
                                     default_max=DEFAULT_MAX_TOKENS, logprobs=req.logprobs, stop=stop,
                                     prompt_logprobs=prompt_top)
            prepared.append((text, ids, params))
        ctx.check_ready(req.model)  # the engine may have failed while we tokenized
    except BaseException:
        release()
        raise
    rid = f"cmpl-{uuid.uuid4().hex}"
    rids = [f"{rid}-{i}" for i in range(len(prepared))]
    done = ctx.track(rids, release)
    gens = [ctx.engine.generate_tokens(ids, sp, r, text) for r, (text, ids, sp) in zip(rids, prepared)]
    echo = [(text if text is not None else _decode(ctx, ids)) if req.echo else "" for text, ids, _ in prepared]
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name}
    prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _chunks(ctx, gens, rids, head=head, req=req, echo=echo, prompt_tokens=prompt_tokens,
                         include_usage=include_usage)
        return SSEResponse(sse_events(chunks), on_close=done)
    try:
        whole = _whole(ctx, gens, rids, head=head, req=req, echo=echo, prompt_tokens=prompt_tokens)
        return await until_disconnect(request, whole)
    finally:
        done()


def _prompt_only(out: CompletionOutput) -> CompletionOutput:
    """A choice of a max_tokens 0 completion: the one token generated is dropped."""
    no_logprobs = None if out.logprobs is None else []
    reason = "length" if out.finish_reason in ("stop", "length") else out.finish_reason  # abort stays abort
    return replace(out, text="", token_ids=[], logprobs=no_logprobs, delta_text="", delta_token_ids=[],
                   delta_logprobs=no_logprobs, finish_reason=reason, stop_reason=None)


def _decode(ctx: ServerContext, ids: list[int]) -> str:
    tok = ctx.engine.tokenizer
    return tok.decode(ids) if tok is not None else ""


def _token_ids_shown(ctx: ServerContext, req: P.CompletionRequest) -> bool:
    # A model without a tokenizer has empty texts: its token ids are all a client gets.
    return req.return_token_ids or ctx.engine.tokenizer is None


def _logprobs(ctx: ServerContext, entries: Any, offset: int) -> dict[str, Any] | None:
    if entries is None:
        return None
    return P.completion_logprobs(P.token_text_of(ctx.engine.tokenizer), entries, offset)


def _first_choice(ctx: ServerContext, req: P.CompletionRequest, index: int, text: str, out: CompletionOutput,
                  prompt: GenerationOutput) -> dict[str, Any]:
    """A choice's first piece (the whole choice when not streamed): `text` is the echoed
    prompt, if any, then out.delta_text. An echoed prompt's logprobs lead the choice's
    logprobs, and `prompt_logprobs` rides along when asked for."""
    token_text = P.token_text_of(ctx.engine.tokenizer)
    lp = _logprobs(ctx, out.delta_logprobs, offset=len(text) - len(out.delta_text))
    scored = prompt.prompt_logprobs
    if scored is not None and req.echo and req.logprobs is not None:
        echoed = P.completion_logprobs(token_text, scored[1:], 0, prompt.prompt_token_ids[0])  # type: ignore[arg-type]
        lp = P.joined_logprobs(echoed, lp)
    ids = out.delta_token_ids if _token_ids_shown(ctx, req) else None
    choice = P.completion_choice(index, text, out, lp, ids)
    if scored is not None and req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = P.prompt_logprobs_field(token_text, scored)
    return choice


async def _whole(ctx: ServerContext, gens: list, rids: list[str], head: dict, req: P.CompletionRequest,
                 echo: list[str], prompt_tokens: int) -> Response:
    prompts: dict[int, GenerationOutput] = {}
    finals = await collect(ctx, gens, rids, prompts=prompts)
    choices, completion_tokens = [], 0
    for (pi, ci), out in sorted(finals.items()):
        if req.max_tokens == 0:
            out = _prompt_only(out)
        out = replace(out, delta_text=out.text, delta_token_ids=out.token_ids, delta_logprobs=out.logprobs)
        completion_tokens += len(out.token_ids)
        choices.append(_first_choice(ctx, req, index=pi * req.n + ci, text=echo[pi] + out.text, out=out,
                                     prompt=prompts[pi]))
    return JSONResponse({**head, "choices": choices, "usage": P.usage(prompt_tokens, completion_tokens)})


async def _chunks(ctx: ServerContext, gens: list, rids: list[str], head: dict, req: P.CompletionRequest,
                  echo: list[str], prompt_tokens: int, include_usage: bool) -> AsyncIterator[dict[str, Any] | str]:
    """The stream's chunks: dicts, or event lines of the common chunk (sse_chunks.py)."""
    offsets: dict[tuple[int, int], int] = {}
    completion_tokens = 0
    show_ids = _token_ids_shown(ctx, req)
    template = ChunkTemplate(head)
    prompt_index = {rid: i for i, rid in enumerate(rids)}
    async with contextlib.aclosing(merge(gens)) as merged:
        async for out in merged:
            pi = prompt_index[out.request_id]
            for c in out.outputs:
                if ctx.ended_by_shutdown(c):
                    raise shutdown_error()
                if req.max_tokens == 0:
                    c = _prompt_only(c)
                key = (pi, c.index)
                first = key not in offsets  # no chunk of this choice sent yet
                text = (echo[pi] if first else "") + c.delta_text
                completion_tokens += len(c.delta_token_ids)
                if not text and not c.finished and not (show_ids and c.delta_token_ids):
                    continue
                offset = offsets.get(key, 0)
                offsets[key] = offset + len(text)
                if first:
                    choice = _first_choice(ctx, req, index=pi * req.n + c.index, text=text, out=c, prompt=out)
                elif c.delta_logprobs is None and not show_ids:  # the common chunk
                    yield template.completion_text(pi * req.n + c.index, text, c.finish_reason)
                    continue
                else:
                    lp = _logprobs(ctx, c.delta_logprobs, offset=offset)
                    choice = P.completion_choice(pi * req.n + c.index, text, c, lp,
                                                 c.delta_token_ids if show_ids else None)
                yield {**head, "choices": [choice]}
    if include_usage:
        yield {**head, "choices": [], "usage": P.usage(prompt_tokens, completion_tokens)}
