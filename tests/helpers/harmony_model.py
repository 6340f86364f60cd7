"""A tiny gpt-oss with a harmony tokenizer and chat template, and replies scripted token by
token, for the harmony chat tests.

The model is hf_tiny's gpt_oss (vocab 256). The tokenizer is a WordLevel one over exactly
256 ids whose first ids are harmony's control tokens as special tokens; it decodes words
joined by single spaces. generation_config.json lists `<|return|>` and `<|call|>` as EOS,
as gpt-oss's does, so the engine stops at either.

CHAT_TEMPLATE is written here in harmony's shape, a small stand-in for the checkpoint's
that reads what gpt-oss's reads: reasoning effort in the system message, the system
message as the developer message, an earlier turn's `thinking` and its one call (the
first; arguments an object, written with tojson; content and thinking together refused),
tool results (tojson) from `functions.NAME` of the latest call, and `<|start|>assistant`
to reply.

`script_replies(engine, replies)` makes the executor's sampled tokens those of the given
replies, one reply per engine request in the order the requests first sample: the model
still runs every step; only what it sampled is replaced.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.helpers import hf_tiny

VOCAB_SIZE = 256
SPECIALS = ["<|pad|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
            "<|return|>", "<|call|>"]
WORDS = ["system", "developer", "user", "assistant", "analysis", "final", "commentary", "json", "Reasoning:",
         "low", "medium", "high", "Tools:", "to=functions.get_weather", "to=assistant", "functions.get_weather",
         "get_weather", "think", "about", "it", "hello", "world", "need", "weather", "sunny", "be", "brief",
         "in", "oslo?", '{"city":', '"oslo"}', '"sunny"', "It", "is", '"ok"', "Checking."]
CHAT_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}"
    "{% if tools %} Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %}<|end|>"
    "{% set ns = namespace(call='') %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}"
    "{% if m.content and m.thinking %}{{ raise_exception('a call turn takes content or thinking') }}{% endif %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{% set c = m.tool_calls[0].function %}{% set ns.call = c.name %}"
    "<|start|>assistant to=functions.{{ c.name }}<|channel|>commentary json<|message|>{{ c.arguments | tojson }}"
    "<|call|>"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ ns.call }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

_DIRS: list[Path] = []


def vocabulary() -> list[str]:
    """256 distinct tokens: the specials, the words above, then filler words."""
    words = SPECIALS + WORDS
    words += [f"w{i}" for i in range(VOCAB_SIZE - len(words))]
    return words


def token_id(word: str) -> int:
    return vocabulary().index(word)


def reply_ids(reply: str) -> list[int]:
    """The ids of a reply spelled as space-separated tokens."""
    return [token_id(w) for w in reply.split()]


def harmony_model_dir() -> Path:
    """hf_tiny's gpt_oss with the harmony tokenizer (built once per test process)."""
    if not _DIRS:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        base = hf_tiny.tiny_model_dir("gpt_oss")
        out = base.parent / "gpt_oss_harmony"
        shutil.copytree(base, out)
        tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(vocabulary())}, unk_token="<|pad|>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.add_special_tokens(SPECIALS)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|pad|>")
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(str(out))
        gen = {"eos_token_id": [token_id("<|return|>"), token_id("<|call|>"), token_id("<|endoftext|>")]}
        (out / "generation_config.json").write_text(json.dumps(gen))
        _DIRS.append(out)
    return _DIRS[0]


def script_replies(engine: Any, replies: list[list[int]]) -> None:
    """Each new engine request samples the next reply's tokens, one a step (module docstring)."""
    executor = engine.parts.engine.executor
    real_wait = executor.wait
    queue = list(replies)
    assigned: dict[str, tuple[list[int], list[int]]] = {}  # request id -> (reply, sampled so far)

    def scripted(handle: Any) -> Any:
        out = real_wait(handle)
        for i, (rid, sampled) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            if not sampled:
                continue
            if rid not in assigned:
                assigned[rid] = (queue.pop(0), [])
            reply, done = assigned[rid]
            # A step already in flight when the reply stopped samples once more; the engine
            # drops that token, so it repeats the reply's last (a stop token).
            token = reply[min(len(done), len(reply) - 1)]
            done.append(token)
            out.sampled_token_ids[i] = [token]
        return out

    executor.wait = scripted
