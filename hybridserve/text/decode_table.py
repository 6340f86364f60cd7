"""Token ids -> text from a flat table, for a process that only detokenizes.

Why: the Rust tokenizer of a 262k vocabulary holds about 100 MB (its vocabulary twice,
both directions, and 515k merges) and reading it again costs a transient of about
350 MB. Decoding needs neither the merges nor the text -> id map: each id's text, whether
it is a byte token and whether it is special. Held as one bytes blob with offsets, that is
a few MB (Gemma 3: ~4 MB), so `hybridserve generate`, which encodes all its prompts before
the weights load, keeps this table instead of the tokenizer through the run
(benchmarks/results/memory_peak.md).

When it is exact: the tokenizer's decoder is the SentencePiece-style chain that
converted GGUF tokenizers carry, Sequence[Replace("▁" -> " "), ByteFallback, Fuse]
(SUPPORTED_DECODER). What the Rust library does with it, and this table does the same
(tests/models/test_decode_table.py compares the two on random and special ids):

- each id becomes its token (added tokens included); ids it does not know are dropped,
  and with skip_special_tokens so are special added tokens;
- Replace turns every "▁" into a space, in every token;
- ByteFallback: a token spelled exactly <0xNN> is the byte NN; each run of consecutive
  byte tokens becomes its UTF-8 text, or one U+FFFD per byte when the run is not valid
  UTF-8;
- Fuse joins everything.

Any other decoder (or none) gives no table (`from_backend` returns None): the caller keeps
the tokenizer.
"""

from __future__ import annotations

import json
from array import array
from typing import Any, Iterable

SUPPORTED_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ],
}
_REPLACEMENT = "\ufffd".encode()
_BYTE_TOKEN_LEN = len("<0x00>")
_NOT_A_BYTE = 256  # `byte` of a token that is not <0xNN>
_MISSING = 257  # `byte` of an id no token has


def _byte_value(token: str) -> int:
    """NN of a token spelled exactly <0xNN> (hex digits, either case), else _NOT_A_BYTE."""
    if len(token) != _BYTE_TOKEN_LEN or not token.startswith("<0x") or not token.endswith(">"):
        return _NOT_A_BYTE
    try:
        return int(token[3:5], 16)
    except ValueError:
        return _NOT_A_BYTE


def _decoder_spec(backend: Any) -> Any:
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    try:
        return json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None


class DecodeTable:
    """Every id's text (after Replace) in one UTF-8 blob; `byte` says which ids are byte
    tokens (0..255), plain tokens (_NOT_A_BYTE) or unknown (_MISSING)."""

    def __init__(self, tokens: dict[str, int], special_ids: Iterable[int]) -> None:
        """`tokens`: {token: id}, added tokens included; `special_ids`: the special added tokens'."""
        size = max(tokens.values(), default=-1) + 1
        texts: list[bytes] = [b""] * size
        self.byte = array("H", [_MISSING]) * size
        for token, token_id in tokens.items():
            self.byte[token_id] = _byte_value(token)
            texts[token_id] = token.replace("\u2581", " ").encode()
        self.ends = array("Q", [0]) * (size + 1)
        for i, text in enumerate(texts):
            self.ends[i + 1] = self.ends[i] + len(text)
        self.blob = b"".join(texts)
        self.special = bytearray(size)
        for token_id in special_ids:
            if 0 <= token_id < size:
                self.special[token_id] = 1

    @classmethod
    def from_backend(cls, backend: Any) -> DecodeTable | None:
        """The table of a `tokenizers.Tokenizer`, or None when its decoder is not
        SUPPORTED_DECODER (the table would not decode as it does)."""
        if _decoder_spec(backend) != SUPPORTED_DECODER:
            return None
        added = backend.get_added_tokens_decoder()
        return cls(backend.get_vocab(with_added_tokens=True),
                   [token_id for token_id, token in added.items() if token.special])

    def __len__(self) -> int:
        return len(self.special)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        out = bytearray()
        run = bytearray()  # consecutive byte tokens, not yet known to be valid UTF-8
        size = len(self.special)
        for token_id in ids:
            if not 0 <= token_id < size:
                continue
            kind = self.byte[token_id]
            if kind == _MISSING or (skip_special_tokens and self.special[token_id]):
                continue
            if kind < _NOT_A_BYTE:
                run.append(kind)
                continue
            if run:
                self._flush(run, out)
            out += self.blob[self.ends[token_id] : self.ends[token_id + 1]]
        if run:
            self._flush(run, out)
        return out.decode()

    @staticmethod
    def _flush(run: bytearray, out: bytearray) -> None:
        """A run of byte tokens onto `out`: as it is when valid UTF-8, else U+FFFD per byte."""
        try:
            run.decode()
            out += run
        except UnicodeDecodeError:
            out += _REPLACEMENT * len(run)
        run.clear()
