"""Text <-> token ids: the model's Hugging Face tokenizer, chat prompts, incremental detokenizing.

Chat prompts use the tokenizer's chat template when it has one. Otherwise the plain
template below applies (documented in docs/usage.md), and chat requests also stop at
PLAIN_CHAT_STOPS so a base model writes neither the user's next turn nor a second
reply of its own::

    System: {content}
    User: {content}
    Assistant: {content}
    ...
    Assistant:

Streaming text: `IncrementalDetokenizer` turns tokens into text deltas whose
concatenation is the completion's text. It decodes a short window that starts a few
tokens back (prompt tokens at first), so word-initial spaces survive, and it holds a
delta back while it ends in U+FFFD (a multi-byte character split across tokens).
"""

from __future__ import annotations

import copy
import logging
import threading
from pathlib import Path
from typing import Any, Sequence

from hybridserve.core.errors import ConfigError, RequestError
from hybridserve.models.platform.heap import release_free_heap
from hybridserve.text import spm_tokenizer
from hybridserve.text.file_tokenizer import FileTokenizer, serves_without_transformers

log = logging.getLogger(__name__)

PLAIN_CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
PLAIN_CHAT_STOPS = ("\nUser:", "\nAssistant:")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# What transformers' fast tokenizers keep of the vocabulary they built the backend from.
_CONSTRUCTION_COPIES = ("_vocab", "_merges")
_CONTEXT_TOKENS = 5  # prompt tokens the detokenizer starts from
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """One model's tokenizer. Invariant: `encode` of a prompt adds the model's special
    prefix (BOS) exactly as Hugging Face does; chat prompts carry it through the template."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.chat_template: str | None = getattr(hf_tokenizer, "chat_template", None) or None
        self._token_text: dict[int, str] = {}
        # The engine thread decodes every step while a server worker thread may spend
        # seconds encoding a huge prompt: the two must not wait on each other. Each
        # direction has its own lock. A fast tokenizer's Rust backend decodes through a
        # shared (read-only) borrow, safe beside an encode, once truncation and padding are
        # settled here so that encode never reconfigures the backend; a slow tokenizer gets
        # a copy for decoding (a second 262k vocabulary would cost hundreds of MB, so the
        # fast path matters).
        self._encode_lock = threading.Lock()
        self._decode_lock = threading.Lock()
        # (a FileTokenizer's backend is read only when asked for: not here)
        backend = None if isinstance(hf_tokenizer, FileTokenizer) else getattr(hf_tokenizer, "backend_tokenizer", None)
        if isinstance(hf_tokenizer, FileTokenizer):
            # Through the FileTokenizer, not its backend: it may drop the backend (release)
            # and decode from its table (text/decode_table.py).
            self._decode_ids = lambda ids, skip: hf_tokenizer.decode(ids, skip_special_tokens=skip)
        elif backend is not None:
            backend.no_truncation()
            backend.no_padding()
            self._decode_ids = lambda ids, skip: hf_tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=skip)
        else:
            decoder = copy.deepcopy(hf_tokenizer)
            self._decode_ids = lambda ids, skip: decoder.decode(ids, skip_special_tokens=skip,
                                                                clean_up_tokenization_spaces=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer stored in a model directory, or None when it has none."""
        path = Path(path)
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            return None
        if serves_without_transformers(path):  # a converted GGUF's: no transformers, no torch
            if spm_tokenizer.available():  # its sentencepiece model, once (text/spm_tokenizer.py)
                why_not = spm_tokenizer.build(path)
                if why_not is not None:
                    log.info("%s: the Rust tokenizer serves, no sentencepiece model: %s", path, why_not)
            tokenizer = cls(FileTokenizer(path))
            release_free_heap()  # the parse of tokenizer.json leaves hundreds of MB of freed heap
            return tokenizer
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("text prompts need transformers: pip install 'hybridserve[torch]'") from None
        try:
            hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot load the tokenizer in {path}: {exc}") from None
        drop_construction_copies(hf)
        release_free_heap()  # the parse of tokenizer.json leaves tens of MB of freed heap
        return cls(hf)

    def use_chat_template(self, source: str) -> None:
        """Use a chat template from a file (or given inline: text holding Jinja tags)."""
        path = Path(source)
        if path.is_file():
            try:
                self.chat_template = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"chat_template: cannot read {source}: {exc}") from None
        elif "{{" in source or "{%" in source:
            self.chat_template = source
        else:
            raise ConfigError(f"chat_template: no such file {source!r} (give a Jinja template file)")

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True, param: str | None = None) -> list[int]:
        """Token ids of `text`; RequestError naming `param` (the request field the text came
        from) if it is not encodable Unicode."""
        with self._encode_lock:
            try:
                return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
            except (TypeError, UnicodeError):  # the Rust tokenizers raise the first, slow ones the second
                # Checked only on failure: a second pass over every prompt would cost each
                # request what only broken ones need.
                require_unicode(text, param)
                raise

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids, as transformers decodes them without its space clean-up."""
        with self._decode_lock:
            return self._decode_ids(list(token_ids), skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (logprob listings), special tokens included."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def special_token_id(self, text: str) -> int | None:
        """The id of the added (special) token spelled `text`; None when there is no such token."""
        return self.hf.get_added_vocab().get(text)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a request's tools (it reads a `tools` variable)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def chat_prompt(self, messages: Sequence[dict[str, Any]], tools: list[Any] | None = None,
                    template_vars: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """(prompt text, token ids) for a conversation, ready for the assistant's reply;
        `template_vars`: further variables the chat template may read (reasoning_effort)."""
        if not messages:
            raise RequestError("messages must not be empty")
        if self.chat_template is not None:
            try:
                with self._encode_lock:
                    text = self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                       chat_template=self.chat_template, tools=tools or None,
                                                       **(template_vars or {}))
            except Exception as exc:  # jinja raises its own errors (TemplateError, raise_exception)
                raise RequestError(f"the model's chat template rejected the messages: {exc}") from None
            return text, self.encode(text, add_special_tokens=False, param="messages")
        text = plain_chat_text(messages)
        return text, self.encode(text, add_special_tokens=True, param="messages")

    def detokenizer(self, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)


def require_unicode(text: str, param: str | None) -> None:
    """RequestError unless `text` encodes as UTF-8. JSON may spell a lone UTF-16 surrogate
    ("\\ud800"), and Python turns bytes that are not UTF-8 in argv or stdin into such
    surrogates; no tokenizer takes them (the Rust one raises a TypeError), so they are named
    here as the client's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"{param} is" if param else "the text is"
        code = ord(text[exc.start])
        # U+DC80..U+DCFF is how Python keeps a byte that was not UTF-8 (command lines, stdin).
        byte = f" (the byte 0x{code - 0xDC00:02X}, which is not UTF-8)" if 0xDC80 <= code <= 0xDCFF else ""
        raise RequestError(f"{where} not valid Unicode: a lone surrogate U+{code:04X}{byte} at character "
                           f"{exc.start}", param) from None


def drop_construction_copies(hf_tokenizer: Any) -> list[str]:
    """Drop the Python vocabulary and merges a fast tokenizer was built from; returns the
    attribute names dropped.

    transformers 5's model-specific fast tokenizers (GemmaTokenizer, LlamaTokenizer, ...)
    parse tokenizer.json into a Python dict and list, build the Rust backend from them, and
    keep both as `_vocab` / `_merges`. Only their constructor reads them: encoding, decoding,
    `get_vocab` and llguidance all go through the backend, which holds its own copy. For
    Gemma 3 (262k tokens, 515k merges) they are ~150 MB of RSS, an eighth of what
    `hybridserve generate` peaked at. The engine never saves a tokenizer (the one place
    that reads them). A slow tokenizer (no backend) keeps everything."""
    if getattr(hf_tokenizer, "backend_tokenizer", None) is None:
        return []
    dropped = [name for name in _CONSTRUCTION_COPIES if isinstance(getattr(hf_tokenizer, name, None), (dict, list))]
    for name in dropped:
        setattr(hf_tokenizer, name, None)
    return dropped


def plain_chat_text(messages: Sequence[dict[str, str]]) -> str:
    """The plain template (module docstring); unknown roles are title-cased."""
    lines = []
    for m in messages:
        role = m.get("role", "")
        name = PLAIN_CHAT_ROLES.get(role, role.title() or "User")
        lines.append(f"{name}: {m.get('content', '')}")
    lines.append("Assistant:")
    return "\n".join(lines)


class IncrementalDetokenizer:
    """Text deltas of a growing token list.

    Invariant: the concatenation of all deltas (including `finish()`) equals the text of
    the output tokens as decoded after the prompt's last tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # ids[prefix_offset:read_offset] decodes to text already emitted (context for the next).
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special_tokens)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (may be "" while a character is split)."""
        if not new_token_ids:
            return ""
        self.ids.extend(new_token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def finish(self) -> str:
        """Flush what `push` held back (an incomplete character decodes to U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]


def release_tokenizer(tokenizer: Any, keep_decoding: bool = False, texts: Sequence[str] = ()) -> None:
    """Drop a tokenizer where it can be read again (file_tokenizer.FileTokenizer.release:
    `texts` encoded first, decoding kept from a table with `keep_decoding`). An engine core's:
    its server detokenizes, and the core has read what it needed before the weights load
    (the int8 calibration texts, EOS: engine/frontend.build_engine_parts with
    keep_tokenizer=False); llguidance's tokenizer, built at the first constrained request,
    reads it again then. `hybridserve generate`'s: its prompts, encoded before the load."""
    release = getattr(getattr(tokenizer, "hf", None), "release", None)
    if release is not None:
        release(keep_decoding, texts)
        release_free_heap()
