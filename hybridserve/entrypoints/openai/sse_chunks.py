"""Server-sent event lines of stream chunks, with the common chunk rendered from a template.

A stream sends one chunk per step and choice, and nearly all have one shape: the
response's head (id, object, created, model) and one choice holding its index, the new
text (a chat delta's content), no logprobs and a finish reason or null. `ChunkTemplate`
renders the head once per response and fills in only the index, the text's JSON string
and the finish reason, instead of building and dumping a dict for every token.

Invariant: every line is byte for byte `sse_line` of the chunk's dict (json.dumps with
ensure_ascii=False and the default separators), so the wire format has one definition;
tests check the template against it.
"""

from __future__ import annotations

import json
from typing import Any

# What json.dumps(..., ensure_ascii=False) writes for a str (the C encoder where built).
_json_string = json.encoder.encode_basestring


def sse_line(data: dict[str, Any]) -> str:
    """One server-sent event holding `data` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _json_reason(reason: str | None) -> str:
    return "null" if reason is None else _json_string(reason)


class ChunkTemplate:
    """The lines of one response's common chunks; `head` is the dict every chunk starts with."""

    __slots__ = ("_start",)

    def __init__(self, head: dict[str, Any]) -> None:
        # The head's JSON without its closing brace, then the choices list's opening.
        self._start = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": [{"index": '

    def completion_text(self, index: int, text: str, finish_reason: str | None) -> str:
        """sse_line({**head, "choices": [{"index", "text", "logprobs": None, "finish_reason"}]})."""
        return (f'{self._start}{index:d}, "text": {_json_string(text)}, "logprobs": null, '
                f'"finish_reason": {_json_reason(finish_reason)}}}]}}\n\n')

    def chat_content(self, index: int, content: str, finish_reason: str | None) -> str:
        """sse_line({**head, "choices": [{"index", "delta": {"content"} or {} when content
        is empty, "logprobs": None, "finish_reason"}]})."""
        delta = f'{{"content": {_json_string(content)}}}' if content else "{}"
        return (f'{self._start}{index:d}, "delta": {delta}, "logprobs": null, '
                f'"finish_reason": {_json_reason(finish_reason)}}}]}}\n\n')
