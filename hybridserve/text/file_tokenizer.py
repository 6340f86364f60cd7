"""A converted GGUF's tokenizer served by the Rust `tokenizers` library alone, without transformers.

Why: transformers 5 builds a model-specific fast tokenizer by parsing tokenizer.json into
Python dicts and lists and building the Rust tokenizer again from them. For Gemma 3 (262k
tokens, 515k merges) that costs a transient of about half a GB of RSS and, with transformers
imported (which imports torch), 150 MB held; in the HTTP server process, which otherwise
never needs torch, it costs the whole of torch besides. Reading tokenizer.json with
`tokenizers.Tokenizer.from_file` alone holds the Rust tokenizer and nothing else.

When it is exact: a directory that this project's GGUF conversion wrote
(gguf_loader.CONVERSION_MARKER). Its tokenizer.json is what transformers' own tokenizer
class saved from its Rust backend, so the backend read back from it encodes and decodes as
that class does (tests/models/test_gguf_loader.py compares them). Where the directory has a
chat template, transformers renders it, so such directories take the transformers path;
a template given later (--chat-template) loads transformers on first use.

FileTokenizer offers the part of a transformers fast tokenizer's interface the engine
reads (text/tokenizer.Tokenizer, text/structured_output.GrammarBackend). Where the folder
also holds a sentencepiece model of the same tokenizer (text/spm_tokenizer.py, checked
against the Rust one when written), that encodes and a DecodeTable decodes: the Rust
tokenizer is then read only for what they do not answer (llguidance's grammar tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_loader import CONVERSION_MARKER
from hybridserve.text.decode_table import DecodeTable
from hybridserve.text.spm_tokenizer import SpmTokenizer

_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def serves_without_transformers(path: Path) -> bool:
    """Whether `path` holds a tokenizer FileTokenizer reads exactly (module docstring)."""
    if not ((path / CONVERSION_MARKER).is_file() and (path / "tokenizer.json").is_file()):
        return False
    if any((path / name).is_file() for name in _CHAT_TEMPLATE_FILES):
        return False
    return "chat_template" not in _read_config(path)


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / "tokenizer_config.json"
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_path}: {exc}") from None
    return config if isinstance(config, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json states it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class FileTokenizer:
    """tokenizer.json's Rust tokenizer with bos/eos from tokenizer_config.json. Invariant:
    encode and decode are the backend's own, as a transformers fast tokenizer's are."""

    chat_template: str | None = None

    def __init__(self, path: Path) -> None:
        self.name_or_path = str(path)
        self._path = path
        self._backend: Any = None
        self._size: int | None = None
        self._spm = SpmTokenizer.load(path)
        self._has_spm = self._spm is not None  # the folder's, read again after `release`
        # what decodes after release(keep_decoding=True), or always beside a sentencepiece
        # model: made here, so that its construction's transient is behind the loader's trim
        self._table: DecodeTable | None = None if self._spm is None else self._spm.decode_table()
        config = _read_config(path)
        self.bos_token_id = self._token_id(config.get("bos_token"))
        self.eos_token_id = self._token_id(config.get("eos_token"))
        self._full: Any = None
        self._encoded: dict[str, list[int]] = {}  # texts encoded before a release (with the special prefix)

    @property
    def backend_tokenizer(self) -> Any:
        """The Rust tokenizer, read from the file again after `release`."""
        if self._backend is None:
            from tokenizers import Tokenizer as RustTokenizer

            try:
                self._backend = RustTokenizer.from_file(str(self._path / "tokenizer.json"))
            except Exception as exc:  # the Rust library raises its own exception type
                raise ConfigError(f"cannot load the tokenizer in {self._path}: {exc}") from None
            self._backend.no_truncation()  # as text/tokenizer.Tokenizer sets a backend it keeps
            self._backend.no_padding()
        return self._backend

    def release(self, keep_decoding: bool = False, texts: Sequence[str] = ()) -> None:
        """Drop the Rust tokenizer (~100 MB for Gemma 3's) until it is used again: for a
        process that tokenized what it needed at start (the engine core process; `hybridserve
        generate`, whose prompts are known before the load). `texts` are encoded first and
        `encode` answers them (with the special prefix) from memory. With `keep_decoding`,
        `decode` is served from a DecodeTable (a few MB) where the decoder allows one
        (text/decode_table.py), instead of reading the tokenizer again. Anything else
        reads it again: a transient of about 350 MB for Gemma 3's, or, where the folder has
        a sentencepiece model (dropped here too, ~40 MB), that model, in a fraction of a second."""
        for text in texts:
            self._encoded[text] = self.encode(text)
        if keep_decoding and self._table is None:  # (a sentencepiece folder's is made with it)
            self._table = DecodeTable.from_backend(self.backend_tokenizer)
        elif not keep_decoding and self._has_spm:
            self._table = None
        self._backend = None
        self._spm = None

    def _spm_tokenizer(self) -> SpmTokenizer:
        """The folder's sentencepiece tokenizer (only where it has one), read again after `release`."""
        if self._spm is None:
            self._spm = SpmTokenizer.load(self._path)
            if self._spm is None:
                raise ConfigError(f"cannot read the tokenizer in {self._path} again")
        return self._spm

    def _token_id(self, value: Any) -> int | None:
        content = _token_content(value)
        if content is None:
            return None
        if self._has_spm:
            return self._spm_tokenizer().token_to_id(content)
        return self.backend_tokenizer.token_to_id(content)

    def __len__(self) -> int:
        if self._size is None:  # kept: asking a released tokenizer its size would read it again
            self._size = len(self._spm_tokenizer()) if self._has_spm else \
                int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))
        return self._size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens and text in self._encoded:
            return list(self._encoded[text])
        if self._has_spm:
            return self._spm_tokenizer().encode(text, add_special_tokens)
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._table is None and self._has_spm:
            self._table = self._spm_tokenizer().decode_table()
        if (self._backend is None or self._has_spm) and self._table is not None:
            return self._table.decode(ids, skip_special_tokens)
        return str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def get_added_vocab(self) -> dict[str, int]:
        """{added token's text: id}, as a transformers tokenizer's get_added_vocab (the
        special token ids text/tokenizer.Tokenizer.special_token_id looks up)."""
        if self._has_spm:
            return dict(self._spm_tokenizer().added)
        decoder = self.backend_tokenizer.get_added_tokens_decoder()
        return {token.content: token_id for token_id, token in decoder.items()}

    def llguidance_tokenizer(self, n_vocab: int) -> Any:
        """llguidance's tokenizer for this vocabulary: what `llguidance.hf.from_tokenizer`
        builds from a transformers tokenizer (its backend's JSON and EOS)."""
        from llguidance import LLTokenizer

        released = self._backend is None
        built = LLTokenizer(self.backend_tokenizer.to_str(), n_vocab=n_vocab, eos_token=self.eos_token_id)
        if released:  # read again for this alone: llguidance's tokenizer holds its own copy
            self.release()
        return built

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' rendering, loaded on first use (only a --chat-template given for a
        converted GGUF without one reaches here)."""
        if self._full is None:
            from transformers import AutoTokenizer

            self._full = AutoTokenizer.from_pretrained(self.name_or_path)
        return self._full.apply_chat_template(*args, **kwargs)
