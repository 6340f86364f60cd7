"""Tool calls for chat: which tools a request offers, the constraint that forces a call,
and the parser that finds calls in a reply.

- tool_choice "none": the tools are not shown to the model; plain chat.
- "auto" (the default with tools): the model's chat template renders the tools, the
  model answers freely, and calls are parsed out of its reply in the two formats open
  models use: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (Hermes, Qwen) or a reply that is one JSON object with "name" and "arguments" or
  "parameters" (Llama 3.x).
- "required" or one named function: the reply is constrained (a structured output) to
  a JSON object {"name": ..., "arguments": {...}} whose arguments follow that
  function's parameter schema, so the call always parses.
A model whose chat template has no tool format gets a 400 when a request offers tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolError(ValueError):
    """The request's tools or tool_choice are unusable; the message names what is wrong."""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> function spec of the request's tools (each {"type": "function", "function": {...}})."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = {**fn, "parameters": params}
    return out


def forced_call_schema(funcs: dict[str, dict[str, Any]], tool_choice: Any) -> dict[str, Any] | None:
    """The JSON schema a reply must follow for tool_choice "required" or a named function
    (None for "auto")."""
    if tool_choice in (None, "auto"):
        return None
    if tool_choice == "required":
        names = list(funcs)
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in funcs:
            raise ToolError(f"tool_choice names function {name!r}, which is not among the tools")
        names = [name]
    else:
        raise ToolError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                        "{'name': ...}}")
    options = [{"type": "object", "properties": {"name": {"const": n}, "arguments": funcs[n]["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    return options[0] if len(options) == 1 else {"anyOf": options}


def parse_tool_calls(text: str, known: set[str]) -> tuple[str, list[ToolCall]]:
    """(content left over, calls) of a reply; only calls of known functions count."""
    calls: list[ToolCall] = []
    for block in _HERMES.findall(text):
        call = _call_from_json(block, known)
        if call is not None:
            calls.append(call)
    if calls:
        return _HERMES.sub("", text).strip(), calls
    call = _call_from_json(text.strip(), known)
    if call is not None:
        return "", [call]
    return text, []


def _call_from_json(text: str, known: set[str]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))
