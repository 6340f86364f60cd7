"""OpenAI request bodies (pydantic, strict types) and the JSON the server sends back.

Bodies are validated in strict mode: "16" is not an integer, true is not a number, and
NaN or Infinity is no number at all, as with OpenAI. Unknown fields are ignored, except
features this server does not implement (suffix, best_of other than n, ...), which are a
400 rather than a silently different result (check_unsupported).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Literal, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from hybridserve.core.request import StructuredOutput
from hybridserve.engine.outputs import CompletionOutput, TokenLogprob
from hybridserve.entrypoints.openai.tool_calls import ToolCall
from hybridserve.text.tokenizer import Tokenizer

MAX_N = 128
MAX_LOGPROBS = 20


class ApiError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type_
        self.headers = headers

    def body(self) -> dict[str, Any]:
        # Messages may quote the request (a model name); a lone surrogate from its JSON would
        # make the response unencodable, so such characters are spelled out as escapes.
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions many OpenAI-compatible servers accept.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Structured outputs: OpenAI's response_format, or one of the mainstream server's
    # guided_* extras (or their newer form, structured_outputs={"json"|"regex"|...: ...}).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # Each choice also carries its generated token ids (always so for a model without a
    # tokenizer, whose text is empty).
    return_token_ids: bool = False
    # The mainstream server's extension: each choice also carries `prompt_logprobs`, the
    # logprob of every prompt token given those before it, with this many alternatives.
    prompt_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    # An assistant turn that called tools, and a tool turn answering one call.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # An earlier reply's reasoning, as the server returned it (harmony models read it back).
    reasoning_content: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    # Passed to the chat template (gpt-oss's writes it into its system message).
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class TokenizeRequest(_Body):
    """/tokenize: a prompt (special tokens added as a completion adds them, unless told not
    to), or a conversation rendered as chat renders it."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


Body = TypeVar("Body", bound=_Body)


def parse_body(cls: type[Body], raw: bytes) -> Body:
    try:
        return cls.model_validate_json(raw or b"")
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def validation_error(errors: Sequence[Any]) -> ApiError:
    """The first validation error as a 400 naming the parameter (the route's `body` prefix dropped)."""
    err = errors[0]
    if err["type"] in ("json_invalid", "json_type"):
        detail = (err.get("ctx") or {}).get("error", err["msg"])
        return ApiError(f"malformed JSON body: {detail}")
    loc = [str(x) for x in err["loc"] if isinstance(x, (str, int))]
    if loc and loc[0] == "body":
        loc = loc[1:]
    if err["type"] == "missing" and not loc:
        return ApiError("the request needs a JSON body")
    param = loc[0] if loc else None
    where = ".".join(loc[:1] + [x for x in loc[1:] if x.isdigit()]) if loc else "body"
    return ApiError(f"{where}: {err['msg']}", param=param)


def check_logprob_count(value: int | None, param: str) -> None:
    """400 unless a count of alternatives (logprobs, top_logprobs, prompt_logprobs) is
    unset or within 0..MAX_LOGPROBS."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(f"{param} must be between 0 and {MAX_LOGPROBS}", param=param)


def check_unsupported(req: _Sampling) -> None:
    """400 for options that would change results if silently ignored."""
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise ApiError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError("best_of must equal n (no server-side ranking)", param="best_of")
    if isinstance(req, ChatRequest):
        if req.functions:
            raise ApiError("functions is deprecated and not supported; use tools", param="functions")
    if not 1 <= req.n <= MAX_N:
        raise ApiError(f"n must be between 1 and {MAX_N}, got {req.n}", param="n")


def structured_output(req: _Sampling) -> StructuredOutput | None:
    """The request's one output constraint, from whichever field carries it."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", StructuredOutput("json", '{"type": "object"}')))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError("response_format.json_schema.schema must be a JSON schema object",
                               param="response_format")
            found.append(("response_format", StructuredOutput("json", json.dumps(schema))))
        elif kind not in (None, "text"):
            raise ApiError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                           param="response_format")
    extras = dict(req.structured_outputs or {})
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            extras[key] = getattr(req, name)
    for key, value in extras.items():
        if key not in ("json", "regex", "choice", "grammar"):
            raise ApiError(f"unknown structured output kind {key!r}", param="structured_outputs")
        spec = value if isinstance(value, str) and key in ("regex", "grammar") else None
        if key == "json":
            spec = value if isinstance(value, str) else json.dumps(value)
        elif key == "choice":
            spec = json.dumps(value)
        if not isinstance(spec, str) or not spec:
            raise ApiError(f"structured output {key!r} needs a non-empty value", param="structured_outputs")
        found.append(("structured_outputs", StructuredOutput(key, spec)))
    if len(found) > 1:
        raise ApiError("give one output constraint (response_format or one guided_* field)", param=found[1][0])
    return found[0][1] if found else None


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias has token ids as JSON object keys (strings)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.strip().lstrip("-").isdigit():
            raise ApiError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    items = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in items):
        raise ApiError("stop strings must be non-empty", param="stop")
    return items


def finish_reason(reason: str | None) -> str | None:
    return reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_text_of(tok: Tokenizer | None) -> Callable[[int], str]:
    """How a token is shown in logprobs: its text, or "token_id:N" for a model without a tokenizer."""
    if tok is not None:
        return tok.token_text
    return lambda token_id: f"token_id:{token_id}"


def completion_logprobs(token_text: Callable[[int], str], entries: list[TokenLogprob], offset: int,
                        unscored_first: int | None = None) -> dict[str, Any]:
    """The legacy completions format; offsets count characters from `offset`.
    unscored_first: a token before the entries that has no logprob (an echoed prompt's
    first), listed with null logprobs as the legacy API lists it."""
    tokens: list[str] = []
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if unscored_first is not None:
        tokens.append(token_text(unscored_first))
        offsets.append(offset)
        offset += len(tokens[0])
        token_logprobs.append(None)
        tops.append(None)
    for e in entries:
        text = token_text(e.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(e.logprob)
        top = {token_text(t): lp for t, lp in (e.top or [])}
        top.setdefault(text, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs objects as one (an echoed prompt's, then the completion's)."""
    if first is None or second is None:
        return first if second is None else second
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs_field(token_text: Callable[[int], str], entries: list[TokenLogprob | None]
                          ) -> list[dict[str, dict[str, Any]] | None]:
    """The mainstream server's `prompt_logprobs`: per prompt token, None for the first,
    else {token id: {"logprob", "decoded_token"}} for the prompt token and its alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        field = {str(t): {"logprob": lp, "decoded_token": token_text(t)} for t, lp in (e.top or [])}
        field[str(e.token_id)] = {"logprob": e.logprob, "decoded_token": token_text(e.token_id)}
        out.append(field)
    return out


def chat_logprobs(tok: Tokenizer, entries: list[TokenLogprob], top_n: int) -> dict[str, Any]:
    def item(token_id: int, lp: float) -> dict[str, Any]:
        text = tok.token_text(token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in (e.top or [])[:top_n]]}
        for e in entries
    ]}


def completion_choice(index: int, text: str, out: CompletionOutput, logprobs: dict[str, Any] | None,
                      token_ids: list[int] | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(out.finish_reason)}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(out: CompletionOutput, index: int, logprobs: dict[str, Any] | None,
                parsed: tuple[str, list[ToolCall]] | None = None) -> dict:
    """A whole chat choice; `parsed`: (content, tool calls) when the request offered tools."""
    message: dict[str, Any] = {"role": "assistant", "content": out.text}
    reason = finish_reason(out.finish_reason)
    if parsed is not None and parsed[1]:
        content, calls = parsed
        message = {"role": "assistant", "content": content or None, "tool_calls": [c.as_openai() for c in calls]}
        reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def chat_tool_delta(out: CompletionOutput, parsed: tuple[str, list[ToolCall]]) -> dict:
    """The one streamed delta of a finished choice whose request offered tools."""
    content, calls = parsed
    delta: dict[str, Any] = {"role": "assistant"}
    if calls:
        if content:
            delta["content"] = content
        delta["tool_calls"] = [{"index": k, **c.as_openai()} for k, c in enumerate(calls)]
        reason = "tool_calls"
    else:
        delta["content"] = out.text
        reason = finish_reason(out.finish_reason)
    return {"index": out.index, "delta": delta, "logprobs": None, "finish_reason": reason}
