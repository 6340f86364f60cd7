"""Structured outputs through the OpenAI API: response_format and the guided_* extras
(server app over the byte-level tiny model, its engine in this process or in a core
process, where the runner builds its own grammar matchers)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.helpers.structured_models import byte_model_dir  # noqa: E402

from hybridserve import AsyncLLM  # noqa: E402
from hybridserve.entrypoints.openai.app import build_app  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 50}}, "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "core_process"])
def engine(request):
    llm = AsyncLLM(str(byte_model_dir()), max_model_len=256, progress=False, num_speculative_tokens=2,
                   core_process=request.param)
    yield llm
    llm.shutdown()


def post_all(engine: AsyncLLM, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(engine, "byte"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            return [await client.post(path, json=body) for path, body in requests]

    return asyncio.run(main())


def test_response_format_and_guided_extras(engine: AsyncLLM) -> None:
    chat = [{"role": "user", "content": "give json"}]
    r = post_all(engine, [
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 80, "temperature": 0,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": SCHEMA}}}),
        ("/v1/completions", {"prompt": "json:", "max_tokens": 80, "guided_json": SCHEMA, "temperature": 0.7,
                             "seed": 2}),
        ("/v1/completions", {"prompt": "id:", "max_tokens": 20, "guided_regex": "[a-c]{4}"}),
        ("/v1/completions", {"prompt": "pick:", "max_tokens": 20, "guided_choice": ["left", "right"]}),
        ("/v1/completions", {"prompt": "p:", "max_tokens": 20, "structured_outputs": {"regex": "x[0-9]y"}}),
    ])
    assert all(x.status_code == 200 for x in r), [x.text for x in r]
    value = json.loads(r[0].json()["choices"][0]["message"]["content"])
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 50
    value = json.loads(r[1].json()["choices"][0]["text"])
    assert set(value) == {"ok", "n"}
    text = r[2].json()["choices"][0]["text"]
    assert len(text) == 4 and set(text) <= set("abc")
    assert r[3].json()["choices"][0]["text"] in ("left", "right")
    text = r[4].json()["choices"][0]["text"]
    assert text[0] == "x" and text[1].isdigit() and text[2] == "y" and len(text) == 3


def test_bad_constraints_are_400s(engine: AsyncLLM) -> None:
    r = post_all(engine, [
        ("/v1/completions", {"prompt": "x", "guided_json": {"type": "bogus"}}),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}}),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"yaml": "a"}}),
    ])
    assert [x.status_code for x in r] == [400] * 5, [x.text for x in r]
    assert [x.json()["error"]["param"] for x in r] == ["structured_output", "structured_outputs", "response_format",
                                                       "response_format", "structured_outputs"]
