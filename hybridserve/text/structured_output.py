"""Structured outputs: StructuredOutput constraints compiled by llguidance.

One `GrammarBackend` per engine holds llguidance's view of the tokenizer (built on the
first constrained request: for a 262k vocabulary it takes a moment) and turns a
StructuredOutput into a grammar: checked when the request arrives (a bad schema is a
RequestError naming `structured_output`), matched token by token in the runner
(executor/torch/grammar.py), which owns each request's matcher.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Any

from hybridserve.core.errors import ConfigError, RequestError
from hybridserve.core.request import StructuredOutput


@functools.lru_cache(maxsize=256)
def grammar_text(so: StructuredOutput) -> str:
    """llguidance's grammar for a constraint (raises RequestError on a malformed spec).
    Cached: the front end checks a constraint and the runner builds its matcher from the
    same text, and clients tend to send the same few schemas again and again."""
    from llguidance import LLMatcher

    try:
        if so.kind == "json":
            # Compact JSON: with flexible whitespace a weak model can pad an object for ever.
            return LLMatcher.grammar_from_json_schema(json.loads(so.spec), defaults={"whitespace_flexible": False})
        if so.kind == "regex":
            return LLMatcher.grammar_from_regex(so.spec)
        if so.kind == "choice":
            choices = json.loads(so.spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise RequestError("a choice constraint is a non-empty list of non-empty strings", "structured_output")
            return LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in choices))
        return LLMatcher.grammar_from_lark(so.spec)
    except (ValueError, TypeError) as exc:
        raise RequestError(f"structured output: cannot compile the {so.kind} constraint: {exc}",
                           "structured_output") from None


# llguidance's tokenizers by (tokenizer source, size, model vocabulary): building one for a
# 262k vocabulary takes seconds, and an engine rebuilt after a failure (or a second engine
# in the process) needs the same one.
_LL_TOKENIZERS: dict[tuple[str, int, int], Any] = {}
_LL_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's tokenizer: text/file_tokenizer.FileTokenizer builds its own (it is no
    transformers tokenizer, and llguidance.hf imports transformers); others through llguidance.hf."""
    own = getattr(tokenizer, "llguidance_tokenizer", None)
    if own is not None:
        return own(vocab_size)
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


class GrammarBackend:
    """llguidance bound to one model's tokenizer and vocabulary size."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._key = (str(getattr(hf_tokenizer, "name_or_path", id(hf_tokenizer))), len(hf_tokenizer), vocab_size)

    @property
    def ready(self) -> bool:
        """True once llguidance's tokenizer exists (the first constrained request builds it)."""
        return self._key in _LL_TOKENIZERS

    @property
    def ll_tokenizer(self) -> Any:
        with _LL_LOCK:
            if self._key not in _LL_TOKENIZERS:
                try:
                    import llguidance  # noqa: F401  (installed?)
                except ImportError:
                    raise ConfigError("structured outputs need llguidance: pip install 'hybridserve[serve]'") from None
                try:
                    _LL_TOKENIZERS[self._key] = _ll_tokenizer(self.hf_tokenizer, self.vocab_size)
                except (ValueError, TypeError, AttributeError) as exc:
                    raise RequestError(f"structured outputs: the grammar engine cannot read this model's tokenizer "
                                       f"({exc})", "structured_output") from None
            return _LL_TOKENIZERS[self._key]

    def check(self, so: StructuredOutput) -> str:
        """The grammar text, after llguidance has accepted it for this tokenizer."""
        from llguidance import LLMatcher

        text = grammar_text(so)
        ok, message = _validate(LLMatcher, text, self.ll_tokenizer)
        if not ok:
            raise RequestError(f"structured output: invalid {so.kind} constraint: {message}", "structured_output")
        return text

    def matcher(self, so: StructuredOutput) -> Any:
        """A fresh matcher at the start of the output."""
        from llguidance import LLMatcher

        return LLMatcher(self.ll_tokenizer, grammar_text(so))


def _validate(matcher_cls: Any, text: str, tokenizer: Any) -> tuple[bool, str]:
    is_error, messages = matcher_cls.validate_grammar_with_warnings(text, tokenizer)
    return not is_error, "; ".join(m for m in messages if m)
