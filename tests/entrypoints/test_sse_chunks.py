"""The common stream chunk rendered from a template is byte for byte the chunk's dict rendered
by json.dumps, for any text (unicode, quotes, control characters, lone surrogates), index,
finish reason and head."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.entrypoints.openai.sse_chunks import ChunkTemplate, sse_line

REASONS = st.sampled_from([None, "stop", "length", "abort", "tool_calls"])
HEADS = st.fixed_dictionaries({
    "id": st.text(max_size=12), "object": st.sampled_from(["text_completion", "chat.completion.chunk"]),
    "created": st.integers(0, 2**40), "model": st.text(max_size=12)})
TEXTS = st.text(max_size=20) | st.sampled_from(["", " the", 'say "hi"\\n', "\n\t\x00\x1f", "é日本🙂", "\ud800x"])


@settings(max_examples=300, deadline=None)
@given(head=HEADS, index=st.integers(0, 10_000), text=TEXTS, reason=REASONS)
def test_completion_chunk_equals_the_rendered_dict(head, index: int, text: str, reason) -> None:
    want = sse_line({**head, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]})
    assert ChunkTemplate(head).completion_text(index, text, reason) == want


@settings(max_examples=300, deadline=None)
@given(head=HEADS, index=st.integers(0, 10_000), text=TEXTS, reason=REASONS)
def test_chat_chunk_equals_the_rendered_dict(head, index: int, text: str, reason) -> None:
    delta = {"content": text} if text else {}
    want = sse_line({**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]})
    assert ChunkTemplate(head).chat_content(index, text, reason) == want


def test_a_line_is_one_event_of_valid_json_by_hand() -> None:
    line = ChunkTemplate({"id": "c", "object": "text_completion", "created": 7, "model": "m"}).completion_text(
        3, 'a"é\n', "stop")
    assert line == ('data: {"id": "c", "object": "text_completion", "created": 7, "model": "m", "choices": '
                    '[{"index": 3, "text": "a\\"é\\n", "logprobs": null, "finish_reason": "stop"}]}\n\n')
    assert json.loads(line[len("data: "):])["choices"][0]["text"] == 'a"é\n'
