"""Tool calls: the parser on hand-written replies, the forced-call schema, and through
the server a named tool_choice whose arguments follow the function's schema."""

from __future__ import annotations

import asyncio
import json

import pytest

from hybridserve.entrypoints.openai.tool_calls import ToolError, forced_call_schema, functions, parse_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8,
                                                                    "pattern": "^[a-z]+$"},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo", "days": 2}}\n</tool_call>', "",
     [("get_weather", {"city": "oslo", "days": 2})]),
    ('Let me check. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
     '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"rome\\", \\"days\\": 1}"}</tool_call>',
     "Let me check.", [("get_time", {}), ("get_weather", {"city": "rome", "days": 1})]),
    ('{"name": "get_weather", "parameters": {"city": "lima", "days": 3}}', "",
     [("get_weather", {"city": "lima", "days": 3})]),
    ('{"name": "send_mail", "arguments": {}}', '{"name": "send_mail", "arguments": {}}', []),  # unknown function
    ("It is sunny.", "It is sunny.", []),
    ('<tool_call>not json</tool_call>', '<tool_call>not json</tool_call>', []),
])
def test_calls_are_parsed_from_both_formats(text: str, content: str, calls: list) -> None:
    got_content, got = parse_tool_calls(text, {"get_weather", "get_time"})
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_forced_call_schemas() -> None:
    funcs = functions([WEATHER, TIME])
    named = forced_call_schema(funcs, {"type": "function", "function": {"name": "get_time"}})
    assert named == {"type": "object", "properties": {"name": {"const": "get_time"},
                                                      "arguments": {"type": "object", "properties": {}}},
                     "required": ["name", "arguments"], "additionalProperties": False}
    assert [o["properties"]["name"]["const"] for o in forced_call_schema(funcs, "required")["anyOf"]] == [
        "get_weather", "get_time"]
    assert forced_call_schema(funcs, "auto") is None
    with pytest.raises(ToolError, match="not among the tools"):
        forced_call_schema(funcs, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ToolError, match=r"tools\[0\].function.name"):
        functions([{"type": "function", "function": {"name": "bad name!"}}])


def test_a_named_tool_choice_through_the_server_gives_a_valid_call() -> None:
    pytest.importorskip("llguidance")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from tests.helpers.structured_models import byte_model_dir

    from hybridserve import AsyncLLM
    from hybridserve.entrypoints.openai.app import build_app

    # float32: the exact path, so the random model's streams (which must close a call within
    # max_tokens) do not move with the CPU's dtype and quantization choice
    engine = AsyncLLM(str(byte_model_dir()), max_model_len=1024, dtype="float32", progress=False)

    async def main() -> list:
        transport = httpx.ASGITransport(app=build_app(engine, "byte"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            base = {"messages": [{"role": "user", "content": "weather in oslo?"}], "max_tokens": 120,
                    "tools": [WEATHER, TIME]}
            return [await client.post("/v1/chat/completions", json={**base, **extra}) for extra in (
                {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                {"tool_choice": "required", "temperature": 0.8, "seed": 3},
                {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                # A seed whose draws close the call within max_tokens: the random model's
                # get_time arguments (any keys) can wander past it.
                {"tool_choice": "required", "stream": True, "seed": 1},
            )]

    try:
        named, required, bad, streamed = asyncio.run(main())
    finally:
        engine.shutdown()
    assert named.status_code == 200, named.text
    choice = named.json()["choices"][0]
    assert named.status_code == 200 and choice["finish_reason"] == "tool_calls", named.text
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7 and args["city"].isalpha()
    assert required.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] in ("get_weather", "get_time")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert calls and events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_model_without_a_tool_format_refuses_tools() -> None:
    pytest.importorskip("transformers")
    httpx = pytest.importorskip("httpx")
    from tests.helpers.serving_models import tiny_serving_dir

    from hybridserve import AsyncLLM
    from hybridserve.entrypoints.openai.app import build_app

    engine = AsyncLLM(str(tiny_serving_dir()), max_model_len=256, progress=False)

    async def main():
        transport = httpx.ASGITransport(app=build_app(engine, "tiny"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            return await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})

    try:
        r = asyncio.run(main())
    finally:
        engine.shutdown()
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "no tool format" in r.json()["error"]["message"]
