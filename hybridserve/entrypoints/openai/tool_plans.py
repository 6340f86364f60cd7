"""What a chat request's tools mean for its reply: which functions a reply's calls may
name, and, for tool_choice "required" or a named function, the structured output that
forces a call. Offering tools to a model whose chat template has no tool format is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hybridserve.core.request import StructuredOutput
from hybridserve.entrypoints.openai import protocol as P
from hybridserve.entrypoints.openai.tool_calls import ToolError, forced_call_schema, functions
from hybridserve.text.tokenizer import Tokenizer


@dataclass
class ToolPlan:
    names: set[str]  # the functions offered: only calls of these are parsed
    forced: StructuredOutput | None  # tool_choice "required" or named: the reply's constraint


def tool_plan(req: P.ChatRequest, tok: Tokenizer | None) -> ToolPlan | None:
    """The tools a chat request offers and, for "required" or a named function, the
    constraint that forces a call; None without tools (or with tool_choice "none")."""
    if not req.tools or req.tool_choice == "none":
        if req.tool_choice not in (None, "none", "auto"):
            raise P.ApiError("tool_choice needs tools", param="tool_choice")
        return None
    if tok is None or not tok.supports_tools:
        raise P.ApiError("this model's chat template has no tool format, so it cannot call tools", param="tools")
    try:
        funcs = functions(req.tools)
    except ToolError as exc:
        raise P.ApiError(str(exc), param="tools") from None
    try:
        schema = forced_call_schema(funcs, req.tool_choice)
    except ToolError as exc:
        raise P.ApiError(str(exc), param="tool_choice") from None
    return ToolPlan(names=set(funcs), forced=None if schema is None else StructuredOutput("json", json.dumps(schema)))
