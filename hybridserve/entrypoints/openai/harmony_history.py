"""A conversation as a harmony model's chat template (gpt-oss's) reads it.

That template writes harmony itself; what it reads differs from OpenAI's messages:
- an earlier reply's reasoning is an assistant message's `thinking` (the server returns
  it as `reasoning_content`);
- a call's `arguments` is an object, which it writes back with `tojson` (OpenAI's is JSON
  text: parsed here, and text that is not JSON is a 400 naming the message);
- an assistant message holds one call, and a `tool` message answers the latest call
  (harmony has no ids): a turn with several calls becomes one assistant message per
  call, each followed by the tool messages whose `tool_call_id` is that call's id (the
  tool messages that match no call follow the last);
- a turn with calls carries its reasoning or a preamble, not both (the template refuses
  both): the reasoning is kept, since the model's chain of thought continues from it.
"""

from __future__ import annotations

import json
from typing import Any

from hybridserve.entrypoints.openai import protocol as P


def harmony_messages(messages: list[dict[str, Any]], sources: list[P.ChatMessage]) -> list[dict[str, Any]]:
    """Template messages (messages.template_message) as a harmony chat template reads them."""
    converted = [_harmony_message(m, source=src, index=i) for i, (m, src) in enumerate(zip(messages, sources))]
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(converted):
        m = converted[i]
        end = i + 1
        if m["role"] == "assistant" and len(m.get("tool_calls") or ()) > 1:
            while end < len(converted) and converted[end]["role"] == "tool":
                end += 1
            out += _one_call_each(m, results=converted[i + 1:end])
        else:
            out.append(m)
        i = end
    return out


def _harmony_message(message: dict[str, Any], source: P.ChatMessage, index: int) -> dict[str, Any]:
    out = dict(message)
    if source.reasoning_content:
        out["thinking"] = source.reasoning_content
    if source.tool_calls:
        out["tool_calls"] = [_call_with_object_arguments(call, index, k) for k, call in enumerate(source.tool_calls)]
        if source.reasoning_content:
            out["content"] = ""
    return out


def _call_with_object_arguments(call: dict[str, Any], index: int, k: int) -> dict[str, Any]:
    fn = call.get("function")
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if not isinstance(args, str):
        return call
    try:
        value = json.loads(args)
    except ValueError:
        raise P.ApiError(f"messages.{index}.tool_calls.{k}.function.arguments is not JSON text",
                         param="messages") from None
    return {**call, "function": {**fn, "arguments": value}}


def _one_call_each(turn: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A turn of several calls and the tool messages after it, as one call per assistant
    message, each followed by its results (the turn's text goes with the first call)."""
    out: list[dict[str, Any]] = []
    left = list(range(len(results)))
    for k, call in enumerate(turn["tool_calls"]):
        head = turn if k == 0 else {"role": "assistant", "content": ""}
        out.append({**head, "tool_calls": [call]})
        mine = [r for r in left if call.get("id") is not None and results[r].get("tool_call_id") == call["id"]]
        out += [results[r] for r in mine]
        left = [r for r in left if r not in mine]
    return out + [results[r] for r in left]
