"""Chat messages as the chat template sees them: a role, the text, and an assistant's
tool calls or a tool's answer kept as given. Only text content parts are supported;
any other part is a 400."""

from __future__ import annotations

from typing import Any

from hybridserve.entrypoints.openai import protocol as P


def template_message(m: P.ChatMessage) -> dict[str, Any]:
    """A chat message as the chat template sees it (tool calls and tool results kept)."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content_text(m)}
    for key in ("tool_calls", "tool_call_id", "name"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    return out


def content_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of a conversation's text: what its tokenizing costs grows with."""
    return sum(len(m["content"] or "") for m in messages)


def _content_text(m: P.ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise P.ApiError(f"only text content parts are supported, got {part.type!r}", param="messages")
        parts.append(part.text)
    return "\n".join(parts)
