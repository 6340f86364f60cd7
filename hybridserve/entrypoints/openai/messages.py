"""Chat messages as the chat template sees them: a role, the text, and an assistant's
tool calls or a tool's answer kept as given. Only text content parts are supported;
any other part is a 400."""

from __future__ import annotations

from typing import Any

from hybridserve.entrypoints.openai import protocol as P


def template_message(m: P.ChatMessage, model: str) -> dict[str, Any]:
    """A chat message as the chat template sees it (tool calls and tool results kept);
    `model` names the served model in the refusal of a non-text part."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": _content_text(m, model=model)}
    for key in ("tool_calls", "tool_call_id", "name"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    return out


def content_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of a conversation's text: what its tokenizing costs grows with."""
    return sum(len(m["content"] or "") for m in messages)


def _content_text(m: P.ChatMessage, model: str) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            # Multimodal checkpoints (Gemma 3 4B-27B) are served by their language model only.
            raise P.ApiError(f"the model `{model}` takes text content parts only here: {part.type!r} parts "
                             "(images) are not supported yet", param="messages")
        parts.append(part.text)
    return "\n".join(parts)
