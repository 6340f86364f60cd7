"""Chat with a harmony model (gpt-oss): what its requests may ask, and its reply as the
mainstream OpenAI-compatible server returns it (its conversation: harmony_history.py).

- The reply is read from its token ids (text/harmony.py): `content` is the final (and
  preamble) text, `reasoning_content` the analysis text, `tool_calls` the calls, with
  their arguments as the model wrote them (JSON text); a reply that ended in a call has
  finish_reason "tool_calls". A call is taken whatever function it names: the recipient is
  a header field, not text that might only look like a call.
- Streamed, every step's new text goes out at once, as deltas of `reasoning_content`,
  `content` and `tool_calls` (a call's id and name first, then its argument text).
- What would constrain a harmony reply from its first token (a forced tool call, a
  structured output) is refused: the constraint would replace the format itself.
"""

from __future__ import annotations

from typing import Any, Sequence

from hybridserve.engine.outputs import CompletionOutput
from hybridserve.entrypoints.openai import protocol as P
from hybridserve.entrypoints.openai.tool_calls import ToolCall
from hybridserve.text.harmony import HarmonyParser, HarmonyReply, HarmonyTokens, Piece
from hybridserve.text.tokenizer import Tokenizer

_DELTA_KEYS = {"reasoning": "reasoning_content", "content": "content"}


def check_harmony_request(req: P.ChatRequest) -> None:
    """400 for what a harmony reply cannot follow (module docstring)."""
    if req.tools and req.tool_choice not in (None, "auto", "none"):
        raise P.ApiError("this model's chat format (harmony) takes tool_choice 'auto' or 'none' only",
                         param="tool_choice")
    if P.structured_output(req) is not None:
        param = "response_format" if req.response_format is not None else "structured_outputs"
        raise P.ApiError("structured outputs are not supported with this model's chat format (harmony)",
                         param=param)


def harmony_finish_reason(reply_has_calls: bool, reason: str | None) -> str | None:
    """A reply that stopped after a call asks for its result: "tool_calls"."""
    return "tool_calls" if reply_has_calls and reason == "stop" else P.finish_reason(reason)


def harmony_choice(tok: Tokenizer, tokens: HarmonyTokens, out: CompletionOutput, index: int,
                   logprobs: dict[str, Any] | None, prompt_token_ids: Sequence[int]) -> dict[str, Any]:
    """A whole chat choice of a harmony reply."""
    reply: HarmonyReply = HarmonyParser(tok, tokens, prompt_token_ids).parse(out.token_ids)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None,
                               "reasoning_content": reply.reasoning or None}
    if reply.calls:
        message["tool_calls"] = [ToolCall(name, args).as_openai() for name, args in reply.calls]
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": harmony_finish_reason(bool(reply.calls), out.finish_reason)}


class HarmonyStream:
    """The streamed deltas of one request's harmony choices (a parser per choice)."""

    def __init__(self, tok: Tokenizer, tokens: HarmonyTokens) -> None:
        self.tok, self.tokens = tok, tokens
        self.parsers: dict[int, HarmonyParser] = {}
        self.has_calls: set[int] = set()

    def delta(self, out: CompletionOutput, prompt_token_ids: Sequence[int]) -> tuple[dict[str, Any], str | None]:
        """(delta, finish reason) of a choice's new tokens."""
        parser = self.parsers.get(out.index)
        if parser is None:
            parser = self.parsers[out.index] = HarmonyParser(self.tok, self.tokens, prompt_token_ids)
        pieces = parser.push(out.delta_token_ids) + (parser.finish() if out.finished else [])
        if any(p.kind == "tool_call" for p in pieces):
            self.has_calls.add(out.index)
        return delta_of(pieces), harmony_finish_reason(out.index in self.has_calls, out.finish_reason)


def delta_of(pieces: list[Piece]) -> dict[str, Any]:
    """One delta of a step's pieces: each text kind joined, the calls in order (a new call
    with its id and name, later pieces of a call with argument text alone)."""
    delta: dict[str, Any] = {}
    calls: list[dict[str, Any]] = []
    for p in pieces:
        if p.kind != "tool_call":
            key = _DELTA_KEYS[p.kind]
            delta[key] = delta.get(key, "") + p.text
        elif p.name is not None:
            calls.append({"index": p.call_index, **ToolCall(p.name, p.text).as_openai()})
        elif calls and calls[-1]["index"] == p.call_index:
            calls[-1]["function"]["arguments"] += p.text
        else:
            calls.append({"index": p.call_index, "function": {"arguments": p.text}})
    if calls:
        delta["tool_calls"] = calls
    return delta
