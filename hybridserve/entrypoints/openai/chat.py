"""POST /v1/chat/completions: the conversation rendered by the model's chat template,
one engine request with the request's n choices.

Invariants:
- A stream opens with one role chunk per choice; a choice's first chunk with content
  carries `prompt_logprobs` when asked for.
- With tools, a call is only known whole: a choice's reply is held back and sent parsed,
  as content and tool_calls, when the choice finishes (streamed or not). A harmony
  model's reply (gpt-oss) is read from its tokens instead, and streams as it comes
  (harmony_chat.py).
- The request is admitted (or refused with 429) before its conversation is rendered and
  tokenized; whatever fails after admission releases its room.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hybridserve.engine.frontend import prepare_chat
from hybridserve.engine.outputs import GenerationOutput, SamplingParams
from hybridserve.entrypoints.openai import protocol as P
from hybridserve.entrypoints.openai.context import ServerContext
from hybridserve.entrypoints.openai.errors import shutdown_error
from hybridserve.entrypoints.openai.harmony_chat import HarmonyStream, check_harmony_request, harmony_choice
from hybridserve.entrypoints.openai.harmony_history import harmony_messages
from hybridserve.entrypoints.openai.messages import content_chars, template_message
from hybridserve.entrypoints.openai.prepare import sampling_params, stop_strings, tokenized, warm_grammar
from hybridserve.entrypoints.openai.sse_chunks import ChunkTemplate
from hybridserve.entrypoints.openai.streams import SSEResponse, collect, merge, sse_events, until_disconnect
from hybridserve.entrypoints.openai.tool_calls import parse_tool_calls
from hybridserve.entrypoints.openai.tool_plans import ToolPlan, tool_plan


async def create_chat_completion(ctx: ServerContext, request: Request, req: P.ChatRequest) -> Response:
    P.check_unsupported(req)
    ctx.check_ready(req.model)
    P.check_logprob_count(req.top_logprobs, "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise P.ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
    P.check_logprob_count(req.prompt_logprobs, "prompt_logprobs")
    if ctx.harmony is not None:
        check_harmony_request(req)
    messages = [template_message(m, model=ctx.model_name) for m in req.messages]
    if ctx.harmony is not None:
        messages = harmony_messages(messages, sources=req.messages)
    template_vars = None if req.reasoning_effort is None else {"reasoning_effort": req.reasoning_effort}
    stop = stop_strings(limits=ctx.limits, stop=req.stop)
    tools = tool_plan(req, tok=ctx.engine.tokenizer)
    release = ctx.admit(req.n)
    try:
        base = SamplingParams(stop=stop)  # the chat helper may add the plain template's stop
        offered = req.tools if tools is not None else None
        text, ids, base = await tokenized(
            lambda: prepare_chat(ctx.engine.parts, messages, base, offered, template_vars),
            num_chars=content_chars(messages))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top_n = req.top_logprobs or 0
        forced = tools.forced if tools is not None else None
        await warm_grammar(ctx.engine, req, forced=forced)
        sp = sampling_params(ctx.engine, req, prompt_len=len(ids), max_tokens=max_tokens, default_max=None,
                             logprobs=top_n if req.logprobs else None, stop=tuple(base.stop), forced=forced,
                             prompt_logprobs=req.prompt_logprobs)
        ctx.check_ready(req.model)  # the engine may have failed while we tokenized
    except BaseException:
        release()
        raise
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    done = ctx.track([rid], release)
    gen = ctx.engine.generate_tokens(ids, sp, rid, text)
    head = {"id": rid, "created": int(time.time()), "model": ctx.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _chunks(ctx, gen, head=head, req=req, prompt_tokens=len(ids), top_n=top_n,
                         include_usage=include_usage, tools=tools)
        return SSEResponse(sse_events(chunks), on_close=done)
    try:
        whole = _whole(ctx, gen, head=head, prompt_tokens=len(ids), top_n=top_n, tools=tools)
        return await until_disconnect(request, whole)
    finally:
        done()


def _logprobs(ctx: ServerContext, entries: Any, top_n: int) -> dict[str, Any] | None:
    if entries is None or ctx.engine.tokenizer is None:
        return None
    return P.chat_logprobs(ctx.engine.tokenizer, entries, top_n)


def _with_prompt_logprobs(ctx: ServerContext, choice: dict[str, Any], prompt: GenerationOutput) -> dict[str, Any]:
    """A chat choice (or a choice's first chunk) with `prompt_logprobs`, when asked for."""
    if prompt.prompt_logprobs is not None:
        choice["prompt_logprobs"] = P.prompt_logprobs_field(P.token_text_of(ctx.engine.tokenizer),
                                                            prompt.prompt_logprobs)
    return choice


async def _whole(ctx: ServerContext, gen: Any, head: dict, prompt_tokens: int, top_n: int,
                 tools: ToolPlan | None) -> Response:
    prompts: dict[int, GenerationOutput] = {}
    finals = await collect(ctx, [gen], [head["id"]], prompts=prompts)
    choices = []
    for (_, ci), out in sorted(finals.items()):
        logprobs = _logprobs(ctx, out.logprobs, top_n=top_n)
        if ctx.harmony is not None:
            choice = harmony_choice(ctx.engine.tokenizer, ctx.harmony, out, index=ci, logprobs=logprobs,
                                    prompt_token_ids=prompts[0].prompt_token_ids)
        else:
            calls = parse_tool_calls(out.text, tools.names) if tools is not None else None
            choice = P.chat_choice(out, ci, logprobs, calls)
        choices.append(_with_prompt_logprobs(ctx, choice, prompt=prompts[0]))
    completion_tokens = sum(len(out.token_ids) for out in finals.values())
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": P.usage(prompt_tokens, completion_tokens)})


async def _chunks(ctx: ServerContext, gen: Any, head: dict, req: P.ChatRequest, prompt_tokens: int, top_n: int,
                  include_usage: bool, tools: ToolPlan | None) -> AsyncIterator[dict[str, Any] | str]:
    """The stream's chunks: dicts, or event lines of the common chunk (sse_chunks.py)."""
    head = {**head, "object": "chat.completion.chunk"}
    template = ChunkTemplate(head)
    completion_tokens = 0
    started: set[int] = set()
    harmony = None if ctx.harmony is None else HarmonyStream(ctx.engine.tokenizer, ctx.harmony)
    for i in range(req.n):
        delta = {"role": "assistant", "content": ""}
        yield {**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
    async with contextlib.aclosing(merge([gen])) as merged:
        async for out in merged:
            for c in out.outputs:
                if ctx.ended_by_shutdown(c):
                    raise shutdown_error()
                completion_tokens += len(c.delta_token_ids)
                if harmony is not None:
                    delta, reason = harmony.delta(c, prompt_token_ids=out.prompt_token_ids)
                elif tools is not None:
                    # Held back until the choice finishes: a call is only known whole.
                    if c.finished:
                        choice = P.chat_tool_delta(c, parse_tool_calls(c.text, tools.names))
                        yield {**head, "choices": [_with_prompt_logprobs(ctx, choice, prompt=out)]}
                    continue
                else:
                    if c.index in started and c.delta_logprobs is None:  # the common chunk
                        if c.delta_text or c.finished:
                            yield template.chat_content(c.index, c.delta_text, P.finish_reason(c.finish_reason))
                        continue
                    delta = {"content": c.delta_text} if c.delta_text else {}
                    reason = P.finish_reason(c.finish_reason)
                if not delta and not c.finished:
                    continue
                choice = {"index": c.index, "delta": delta, "logprobs": _logprobs(ctx, c.delta_logprobs, top_n=top_n),
                          "finish_reason": reason}
                if c.index not in started:  # the choice's first chunk with content
                    started.add(c.index)
                    choice = _with_prompt_logprobs(ctx, choice, prompt=out)
                yield {**head, "choices": [choice]}
    if include_usage:
        yield {**head, "choices": [], "usage": P.usage(prompt_tokens, completion_tokens)}
