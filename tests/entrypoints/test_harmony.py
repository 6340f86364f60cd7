"""gpt-oss's chat format (harmony): the reply parser on hand-spelled token streams, and
/v1/chat/completions end to end with a tiny gpt-oss whose replies are scripted token by
token (tests/helpers/harmony_model.py), streamed and not, with tools, reasoning_effort and
a multi-turn history. Every expected text is spelled out by hand from the scripts."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridserve.text.harmony import HarmonyParser, HarmonyReply, HarmonyTokens, Piece  # noqa: E402
from hybridserve.text.tokenizer import Tokenizer  # noqa: E402
from tests.helpers.harmony_model import harmony_model_dir, reply_ids, script_replies  # noqa: E402

THOUGHT_AND_ANSWER = "<|channel|> analysis <|message|> think about it <|end|> " \
                     "<|start|> assistant <|channel|> final <|message|> hello world <|return|>"
CALL = "<|channel|> analysis <|message|> need weather <|end|> " \
       "<|start|> assistant to=functions.get_weather <|channel|> commentary <|constrain|> json " \
       '<|message|> {"city": "oslo"} <|call|>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(harmony_model_dir())


def _parser(tok: Tokenizer) -> HarmonyParser:
    return HarmonyParser(tok, HarmonyTokens.of(tok))


# -- the parser ---------------------------------------------------------------------
@pytest.mark.parametrize("reply, reasoning, content, calls", [
    (THOUGHT_AND_ANSWER, "think about it", "hello world", []),
    (CALL, "need weather", "", [("get_weather", '{"city": "oslo"}')]),
    # the recipient after the channel, the content type without <|constrain|>
    ('<|channel|> commentary to=functions.get_weather json <|message|> {"city": "oslo"} <|call|>', "", "",
     [("get_weather", '{"city": "oslo"}')]),
    # a commentary preamble is content; two calls in one reply keep their order
    ("<|channel|> commentary <|message|> Checking. <|end|> <|start|> assistant to=functions.get_weather "
     '<|channel|> commentary json <|message|> {"city": "oslo"} <|end|> <|start|> assistant '
     'to=functions.get_weather <|channel|> commentary json <|message|> "oslo"} <|call|>',
     "", "Checking.", [("get_weather", '{"city": "oslo"}'), ("get_weather", '"oslo"}')]),
    # a reply cut off in its second header keeps what came before; text after <|end|> is dropped
    ("<|channel|> final <|message|> hello <|end|> world <|start|> assistant <|channel|> final", "", "hello", []),
    # cut off in a body: the body so far counts
    ("<|channel|> analysis <|message|> think about", "think about", "", []),
])
def test_whole_replies(tok: Tokenizer, reply: str, reasoning: str, content: str, calls: list) -> None:
    assert _parser(tok).parse(reply_ids(reply)) == HarmonyReply(reasoning, content, calls)


@pytest.mark.parametrize("reply", [THOUGHT_AND_ANSWER, CALL])
def test_token_by_token_pieces_join_to_the_whole_reply(tok: Tokenizer, reply: str) -> None:
    ids = reply_ids(reply)
    parser = _parser(tok)
    pieces = [p for t in ids for p in parser.push([t])] + parser.finish()
    assert HarmonyReply().add(pieces) == _parser(tok).parse(ids)
    if reply == CALL:  # the call's name comes first, before any argument text
        assert pieces[2:] == [Piece("tool_call", "", call_index=0, name="get_weather"),
                              Piece("tool_call", '{"city":', call_index=0),
                              Piece("tool_call", ' "oslo"}', call_index=0)]
        assert pieces[:2] == [Piece("reasoning", "need"), Piece("reasoning", " weather")]


@pytest.mark.parametrize("prompt_end, reply, reasoning, content", [
    ("<|start|> assistant <|channel|> final <|message|>", "hello world <|return|>", "", "hello world"),
    ("<|start|> assistant <|channel|> analysis", "<|message|> think <|end|>", "think", ""),
    # the prompt's last message is closed: the reply's <|channel|> opens a header
    ("user", "<|channel|> final <|message|> hello <|return|>", "", "hello"),
])
def test_a_reply_continues_the_prompts_last_message(tok: Tokenizer, prompt_end: str, reply: str, reasoning: str,
                                                    content: str) -> None:
    prompt = reply_ids("<|start|> user <|message|> hello <|end|> " + prompt_end)
    parser = HarmonyParser(tok, HarmonyTokens.of(tok), prompt_token_ids=prompt)
    assert parser.parse(reply_ids(reply)) == HarmonyReply(reasoning, content, [])


def test_only_a_tokenizer_with_every_control_token_is_harmony(tok: Tokenizer) -> None:
    from tests.helpers.serving_models import tiny_serving_dir

    assert HarmonyTokens.of(tok) == HarmonyTokens(2, 3, 4, 5, 6, 7, 8)
    assert HarmonyTokens.of(Tokenizer.from_dir(tiny_serving_dir())) is None
    assert HarmonyTokens.of(None) is None


def test_one_steps_pieces_make_one_delta() -> None:
    from hybridserve.entrypoints.openai.harmony_chat import delta_of

    delta = delta_of([Piece("reasoning", "a"), Piece("reasoning", " b"), Piece("content", "c"),
                      Piece("tool_call", " x", call_index=0), Piece("tool_call", "", call_index=1, name="f"),
                      Piece("tool_call", "{", call_index=1), Piece("tool_call", "}", call_index=1)])
    [first, second] = delta.pop("tool_calls")
    assert delta == {"reasoning_content": "a b", "content": "c"}
    assert first == {"index": 0, "function": {"arguments": " x"}}
    assert second.pop("id").startswith("call_")
    assert second == {"index": 1, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert delta_of([]) == {}


def _call(call_id: str | None, city: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


# One turn of two calls with a preamble and reasoning; results in the other order.
TWO_CALLS = [{"role": "user", "content": "weather in oslo?"},
             {"role": "assistant", "content": "Checking.", "reasoning_content": "need weather",
              "tool_calls": [_call("a", "oslo"), _call("b", "oslo")]},
             {"role": "tool", "tool_call_id": "b", "content": "ok"},
             {"role": "tool", "tool_call_id": "a", "content": "sunny"}]


def test_a_turn_of_several_calls_becomes_one_call_a_turn() -> None:
    from hybridserve.entrypoints.openai import protocol as P
    from hybridserve.entrypoints.openai.harmony_history import harmony_messages
    from hybridserve.entrypoints.openai.messages import template_message

    history = [*TWO_CALLS[:3], {"role": "tool", "tool_call_id": "zzz", "content": "?"}, TWO_CALLS[3],
               {"role": "user", "content": "and rome?"}]
    history[1] = {**history[1], "tool_calls": [_call("a", "oslo"), _call("b", "rome"), _call(None, "lima")]}
    sources = [P.ChatMessage.model_validate(m) for m in history]
    got = harmony_messages([template_message(m, model="oss") for m in sources], sources=sources)

    def call(call_id: str | None, city: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}

    assert got == [
        {"role": "user", "content": "weather in oslo?"},
        # the reasoning is kept, the preamble dropped (the template takes one of them)
        {"role": "assistant", "content": "", "thinking": "need weather", "tool_calls": [call("a", "oslo")]},
        {"role": "tool", "content": "sunny", "tool_call_id": "a"},
        {"role": "assistant", "content": "", "tool_calls": [call("b", "rome")]},
        {"role": "tool", "content": "ok", "tool_call_id": "b"},
        {"role": "assistant", "content": "", "tool_calls": [call(None, "lima")]},
        {"role": "tool", "content": "?", "tool_call_id": "zzz"},  # answers no call: after the last
        {"role": "user", "content": "and rome?"},
    ]


# -- through the server -------------------------------------------------------------
def _events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _joined(events: list[dict], key: str) -> str:
    return "".join(e["choices"][0]["delta"].get(key) or "" for e in events if e["choices"])


def test_chat_completions_with_a_harmony_model() -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from hybridserve import AsyncLLM
    from hybridserve.entrypoints.openai.app import build_app

    engine = AsyncLLM(str(harmony_model_dir()), max_model_len=256, dtype="float32", progress=False)
    script_replies(engine, [reply_ids(r) for r in (
        THOUGHT_AND_ANSWER, THOUGHT_AND_ANSWER, CALL, CALL, "<|channel|> final <|message|> It is sunny <|return|>")])
    prompts: list[str] = []
    real_generate = engine.generate_tokens

    def recording(ids, params, request_id, text):
        prompts.append(text)
        return real_generate(ids, params, request_id, text)

    engine.generate_tokens = recording
    ask = [{"role": "user", "content": "weather in oslo?"}]
    history = [{"role": "system", "content": "be brief"}, *ask,
               {"role": "assistant", "content": None, "reasoning_content": "need weather", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

    async def main() -> list:
        transport = httpx.ASGITransport(app=build_app(engine, "oss"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            post = lambda body: client.post("/v1/chat/completions", json={"max_tokens": 40, **body})  # noqa: E731
            return [
                await post({"messages": ask, "reasoning_effort": "low"}),
                await post({"messages": ask, "stream": True}),
                await post({"messages": ask, "tools": [WEATHER]}),
                await post({"messages": ask, "tools": [WEATHER], "stream": True}),
                await post({"messages": history, "tools": [WEATHER], "reasoning_effort": "high"}),
                await post({"messages": ask, "reasoning_effort": "extreme"}),
                await post({"messages": ask, "tools": [WEATHER], "tool_choice": "required"}),
                await post({"messages": [*history[:3], {**history[2], "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oslo"}}]}]}),
                await post({"messages": ask, "response_format": {"type": "json_object"}}),
                await client.post("/tokenize", json={"messages": TWO_CALLS}),
            ]

    try:
        (whole, streamed, call, call_streamed, multi_turn, bad_effort, forced, bad_args, structured,
         tokenized) = asyncio.run(main())
    finally:
        engine.shutdown()

    # analysis + final, whole: the prompt carries the effort in the system message
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hello world", "reasoning_content": "think about it"}
    assert choice["finish_reason"] == "stop"
    assert prompts[0] == ("<|start|>system<|message|>Reasoning: low<|end|>"
                          "<|start|>user<|message|>weather in oslo?<|end|><|start|>assistant")
    assert prompts[1].startswith("<|start|>system<|message|>Reasoning: medium<|end|>")  # the template's default

    # streamed: reasoning deltas, then content deltas (a chunk carries what its step added)
    events = _events(streamed)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    keys = [k for d in deltas[1:] for k in d]
    assert keys == sorted(keys, key=["reasoning_content", "content"].index) and len(keys) >= 2
    assert _joined(events[1:], "reasoning_content") == "think about it"
    assert _joined(events[1:], "content") == "hello world"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"

    # a call, whole
    message = call.json()["choices"][0]["message"]
    assert call.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] is None and message["reasoning_content"] == "need weather"
    [tool_call] = message["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "oslo"}'}
    assert prompts[2] == ("<|start|>system<|message|>Reasoning: medium Tools: get_weather<|end|>"
                          "<|start|>user<|message|>weather in oslo?<|end|><|start|>assistant")

    # a call, streamed: id and name first, then the argument text
    events = _events(call_streamed)
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert all(c == {"index": 0, "function": {"arguments": c["function"]["arguments"]}} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "oslo"}'
    assert _joined(events, "reasoning_content") == "need weather" and _joined(events, "content") == ""
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

    # the history: developer instructions, the earlier thinking and call (arguments as an
    # object, written back by tojson), the tool's result from functions.get_weather
    assert multi_turn.json()["choices"][0]["message"]["content"] == "It is sunny"
    assert prompts[4] == (
        "<|start|>system<|message|>Reasoning: high Tools: get_weather<|end|>"
        "<|start|>developer<|message|>be brief<|end|>"
        "<|start|>user<|message|>weather in oslo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>need weather<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "oslo"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant")

    # /tokenize renders a history as chat does: two calls of one turn, each with its result
    tok = Tokenizer.from_dir(harmony_model_dir())
    call = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "oslo"}<|call|>'
    result = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{}<|end|>"
    assert tokenized.json()["tokens"] == tok.encode(
        "<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>weather in oslo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>need weather<|end|>"
        + call + result.format('"sunny"') + call + result.format('"ok"') + "<|start|>assistant",
        add_special_tokens=False)

    # bad input: 400s naming the field, before the engine
    for r, param, words in ((bad_effort, "reasoning_effort", "'low', 'medium' or 'high'"),
                            (forced, "tool_choice", "harmony"), (bad_args, "messages", "not JSON"),
                            (structured, "response_format", "harmony")):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert words in r.json()["error"]["message"]
    assert len(prompts) == 5
