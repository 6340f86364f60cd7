"""Structured outputs (llguidance) under async scheduling and n-gram speculative decoding.

The subject of the project shows up here too: with async scheduling a step is planned
before the previous token is known, and drafts are speculative. Every output must parse
against its schema (hypothesis over a small family of random schemas), and greedy
outputs must be the same token for token with and without drafts and async scheduling:
a mask built from an unaccepted draft, or a grammar state that kept a rejected draft,
would change them.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.helpers.json_schemas import schemas  # noqa: E402
from tests.helpers.structured_models import byte_model_dir  # noqa: E402

from hybridserve import LLM, SamplingParams, StructuredOutput  # noqa: E402
from hybridserve.core.errors import RequestError  # noqa: E402

MAX_LEN = 512
# Prompts holding JSON like the outputs, so the n-gram drafter proposes drafts that the
# grammar sometimes accepts and sometimes refuses.
PROMPTS = ['{"a":true,"b":12,"c":"x"} {"a":false,"b":3,"c":"yy"} {"a":',
           'data: {"name":"abc","n":12} {"name":"ab","n":1}',
           "hello"]


@pytest.fixture(scope="module", params=["sync", "async_spec"])
def llm(request):
    kwargs = dict(async_scheduling=False) if request.param == "sync" else dict(num_speculative_tokens=3)
    # float32: token equality across batch compositions (bf16 rounding depends on the batch).
    engine = LLM(str(byte_model_dir()), max_model_len=MAX_LEN, progress=False, dtype="float32", **kwargs)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference():
    engine = LLM(str(byte_model_dir()), max_model_len=MAX_LEN, progress=False, async_scheduling=False,
                 dtype="float32")
    yield engine
    engine.shutdown()


def constrained(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured_output=StructuredOutput("json", json.dumps(schema)), **kw)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=schemas, seed=st.integers(0, 1000))
def test_every_output_parses_against_its_schema(llm: LLM, schema: dict, seed: int) -> None:
    params = [constrained(schema), constrained(schema, temperature=1.0, seed=seed)]
    outs = llm.generate(PROMPTS * 2, [params[0]] * 3 + [params[1]] * 3, use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_drafts_and_async_change_no_greedy_token(llm: LLM, reference: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0,
              "maximum": 99}, "c": {"enum": ["x", "yy"]}}, "required": ["a", "b", "c"], "additionalProperties": False}
    stats = llm.parts.engine.scheduler.stats
    drafts_before, accepted_before = stats.num_draft_tokens, stats.num_accepted_tokens
    got = llm.generate(PROMPTS, constrained(schema), use_tqdm=False)
    want = reference.generate(PROMPTS, constrained(schema), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if llm.parts.config.num_speculative_tokens:
        proposed = stats.num_draft_tokens - drafts_before
        accepted = stats.num_accepted_tokens - accepted_before
        assert proposed > accepted > 0, (proposed, accepted)  # some drafts accepted, some rejected


@pytest.mark.parametrize("so, check", [
    (StructuredOutput("regex", "[0-9]{3}-[a-c]{2}"), lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
    (StructuredOutput("choice", json.dumps(["apple", "banana", "cherry"])), lambda t: t in ("apple", "banana", "cherry")),
    (StructuredOutput("grammar", 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'),
     lambda t: t.startswith("(") and t.endswith(")") and all(x.isdigit() for x in t[1:-1].split("+"))),
])
def test_regex_choice_and_grammar(llm: LLM, so: StructuredOutput, check) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=100, temperature=0.8, seed=4, structured_output=so),
                        use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop" and check(out.text), out.text


def test_any_json_object_with_a_logit_bias(llm: LLM) -> None:
    """What response_format json_object asks for. A random model left alone writes one
    key for ever; a bias towards '"', '":' and '"}' (ids 37, 260, 262) closes it, and the
    grammar decides where each may go: the two work together."""
    bias = {37: 8.0, 260: 9.0, 262: 10.0}
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=200, logit_bias=bias, structured_output=StructuredOutput(
        "json", '{"type": "object"}')), use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


def test_preempted_requests_resume_their_grammar() -> None:
    """A pool so small that requests are preempted and recomputed: the resumed matcher
    continues from the outputs the request has; greedy outputs equal a roomy pool's."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30, "pattern": "^[a-z]*$"},
              "n": {"type": "integer", "minimum": 0, "maximum": 9999}}, "required": ["name", "n"],
              "additionalProperties": False}
    prompts = [p + str(i) for i in range(6) for p in PROMPTS[:2]]
    tight = LLM(str(byte_model_dir()), max_model_len=128, progress=False, num_blocks=22, block_size=16,
                dtype="float32")
    roomy = LLM(str(byte_model_dir()), max_model_len=128, progress=False, dtype="float32")
    try:
        params = SamplingParams(max_tokens=50, structured_output=StructuredOutput("json", json.dumps(schema)))
        got = tight.generate(prompts, params, use_tqdm=False)
        assert tight.parts.engine.scheduler.stats.num_preemptions > 0
        want = roomy.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    finally:
        tight.shutdown()
        roomy.shutdown()


@pytest.mark.parametrize("so, message", [
    (StructuredOutput("json", '{"type": "bogus"}'), "invalid json constraint"),
    (StructuredOutput("json", "{not json"), "cannot compile the json constraint"),
    (StructuredOutput("grammar", "start: ((("), "invalid grammar constraint"),
    (StructuredOutput("choice", "[]"), "non-empty list"),
])
def test_bad_constraints_are_request_errors(llm: LLM, so: StructuredOutput, message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        llm.generate(["x"], SamplingParams(structured_output=so), use_tqdm=False)
    assert info.value.param == "structured_output"
