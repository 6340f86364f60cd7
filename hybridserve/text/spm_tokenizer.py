"""A converted GGUF's Gemma-style tokenizer.json encoded by sentencepiece: the Rust
tokenizer's ids in well under half its memory.

Why: the server's HTTP process holds its tokenizer for the whole run. The Rust `tokenizers`
BPE of Gemma 3's 262k vocabulary holds ~96 MB (its vocabulary in both directions and 515k
merges); sentencepiece holds the same pieces in ~39 MB and encodes faster
(benchmarks/results/memory_peak.md). Decoding goes through text/decode_table.py either way.

When it is exact. `compatible` admits only the shape converted GGUF tokenizers of the
SentencePiece family have: a byte-fallback BPE with every byte token, over text whose
spaces become "▁" (no other normalization, no pre-split), added tokens matched as written
(not normalized, not stripped, without spaces or "▁"), and at most a BOS prefix added.
Then the two libraries do the same steps:

- added tokens: the Rust library cuts them out of the raw text leftmost-longest; here they
  are sentencepiece's user-defined pieces, which its encoder also takes longest-first where
  they start, in the text whose spaces alone it has escaped (they hold none);
- the rest is one BPE run: the Rust library merges, among adjacent pairs in its merge list,
  the lowest-ranked one; sentencepiece merges, among adjacent pairs whose join is a piece,
  the highest-scoring one. Each piece scores minus the rank of the first merge that makes
  it, so the orders agree wherever the merge list holds every split of a piece into two
  pieces, as the SentencePiece converters write it;
- characters without a piece become their UTF-8 byte tokens in both.

The last point's condition is not checked field by field: `build` encodes a check corpus
with both libraries and writes the model only when every text agrees
(tests/models/test_spm_tokenizer.py compares random texts too).

Files, beside tokenizer.json: SPM_FILE (the sentencepiece model) and SPM_INFO (the ids
sentencepiece does not keep: which added tokens are special, the BOS prefix). `build` needs
sentencepiece and protobuf; reading needs sentencepiece alone.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any

from hybridserve.text.decode_table import SUPPORTED_DECODER, DecodeTable

log = logging.getLogger(__name__)

SPM_FILE = "tokenizer.spm"
SPM_INFO = "tokenizer.spm.json"
INFO_FORMAT = 1
_SPACE = "\u2581"
_NORMALIZER = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
# A no-op after _NORMALIZER (no spaces are left to split on); Gemma's tokenizer.json has it.
_PRE_TOKENIZERS = (None, {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                          "invert": False})
_CHECK_TEXTS = 3000  # random texts in the check corpus, besides the fixed ones
_BYTE_PIECES = frozenset(f"<0x{b:02X}>" for b in range(256))


def available() -> bool:
    """Whether sentencepiece can be imported (reading SPM_FILE needs it)."""
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        return False
    return True


def compatible(spec: dict[str, Any]) -> str | None:
    """None where tokenizer.json's `spec` has the shape the module docstring names, else
    what does not fit."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        return "not a byte-fallback BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key) is not None:
            return f"BPE {key} is set"
    if model.get("ignore_merges"):
        return "BPE ignores merges"
    if spec.get("normalizer") != _NORMALIZER:
        return "a normalizer other than spaces to \u2581"
    if spec.get("pre_tokenizer") not in _PRE_TOKENIZERS:
        return "a pre-tokenizer that splits the text"
    if spec.get("decoder") != SUPPORTED_DECODER:
        return "a decoder other than SentencePiece's"
    vocab = model.get("vocab") or {}
    if any(piece not in vocab for piece in _BYTE_PIECES):
        return "not every byte has a token"
    for added in spec.get("added_tokens") or []:
        if added.get("normalized") or added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            return f"added token {added.get('content')!r} is normalized or stripped"
        content = added.get("content", "")
        if not content or " " in content or _SPACE in content or vocab.get(content) != added.get("id"):
            return f"added token {content!r} is empty, holds a space or is not in the vocabulary"
    if _bos_prefix(spec) is None:
        return "a post-processor other than a BOS prefix"
    return None


def _bos_prefix(spec: dict[str, Any]) -> list[int] | None:
    """The ids encode(add_special_tokens=True) puts before the text: [] without a
    post-processor, the BOS of a TemplateProcessing whose single form is [BOS, A]; None for
    anything else."""
    post = spec.get("post_processor")
    if post is None:
        return []
    if post.get("type") != "TemplateProcessing":
        return None
    single = post.get("single") or []
    if len(single) != 2 or "SpecialToken" not in single[0] or single[1].get("Sequence", {}).get("id") != "A":
        return None
    ids = (post.get("special_tokens") or {}).get(single[0]["SpecialToken"]["id"], {}).get("ids")
    return list(ids) if isinstance(ids, list) and len(ids) == 1 else None


def _model_proto(spec: dict[str, Any]) -> bytes:
    """sentencepiece's BPE model of tokenizer.json's `spec` (compatible): every id's piece,
    added tokens user-defined, byte tokens bytes, the pieces merges make scored by merge
    rank, characters as they are, and any other piece unused (never encoded to)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = spec["model"]
    first_rank: dict[str, int] = {}
    for rank, merge in enumerate(model.get("merges") or []):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        first_rank.setdefault(left + right, rank)
    added = {a["id"] for a in spec.get("added_tokens") or []}
    proto = pb.ModelProto()
    kind = pb.ModelProto.SentencePiece
    by_id = sorted(model["vocab"].items(), key=lambda item: item[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise ValueError("the vocabulary's ids are not 0..n-1")
    for piece, token_id in by_id:
        entry = proto.pieces.add()
        entry.piece = piece
        if token_id in added:
            entry.type = kind.USER_DEFINED
        elif piece in _BYTE_PIECES:
            entry.type = kind.BYTE
        elif piece in first_rank:
            entry.type = kind.NORMAL
            entry.score = -float(first_rank[piece])
        elif len(piece) == 1:  # a character: where the BPE starts from
            entry.type = kind.NORMAL
        else:  # a piece no merge makes: the Rust BPE never gives it, nor may sentencepiece
            entry.type = kind.UNUSED
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    # No id of sentencepiece's own: the unknown, BOS, EOS and pad tokens are added tokens here.
    proto.trainer_spec.unk_id = proto.trainer_spec.bos_id = proto.trainer_spec.eos_id = -1
    proto.trainer_spec.pad_id = -1
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = False
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return proto.SerializeToString()


def check_corpus(spec: dict[str, Any], count: int = _CHECK_TEXTS) -> list[str]:
    """Texts both libraries must encode alike: fixed ones (every added token inside text,
    whitespace runs, every byte's character) and `count` random ones drawn from the
    vocabulary's pieces (spaces for "▁"), mixed scripts, digits and added tokens, the
    same on every run."""
    rng = random.Random(0)
    pieces = sorted(spec["model"]["vocab"])
    added = [a["content"] for a in spec.get("added_tokens") or []]
    chars = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n\t\r.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"
             "\u00e9\u00fc\u00df\u00e7\u00f1\u00f8\u4e2d\u6587\u65e5\u672c\ud55c\uad6d\u03a9\u2248\u2211\u20ac"
             "\U0001f600\U0001f44d\U0001f3fd\u200b\u00a0\u3000\ufeff")
    fixed = ["", " ", "  ", "   x", "x   ", "\n\n\n", " \n \t ", "".join(chr(b) for b in range(1, 128)),
             "The capital of France is Paris.", "1234567890 3.14159 1e-9", _SPACE + "x" + _SPACE]
    fixed += [f"a{token}b {token} {token}{token}" for token in added]

    def piece_text() -> str:
        return rng.choice(pieces).replace(_SPACE, " ")

    randoms = []
    for _ in range(count):
        kind = rng.random()
        n = rng.randrange(1, 16)
        if kind < 0.4:
            randoms.append("".join(piece_text() for _ in range(n)))
        elif kind < 0.7:
            randoms.append("".join(rng.choice(chars) for _ in range(4 * n)))
        else:
            options = [piece_text, lambda: rng.choice(chars), lambda: rng.choice(added) if added else " "]
            randoms.append("".join(rng.choice(options)() for _ in range(n)))
    return fixed + randoms


def build(path: Path) -> str | None:
    """Write SPM_FILE and SPM_INFO beside `path`/tokenizer.json where the checks pass (None),
    else say why not (nothing written). Needs sentencepiece, protobuf and tokenizers."""
    if (path / SPM_FILE).is_file() and (path / SPM_INFO).is_file():
        return None
    try:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2  # noqa: F401 - needs protobuf
        from tokenizers import Tokenizer as RustTokenizer
    except ImportError as exc:
        return f"cannot build it here ({exc})"
    try:
        spec = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError) as exc:
        return f"cannot read tokenizer.json ({exc})"
    reason = compatible(spec)
    if reason is not None:
        return reason
    try:
        data = _model_proto(spec)
    except (ValueError, KeyError, TypeError) as exc:
        return f"cannot make its model ({exc})"
    encoder = sentencepiece.SentencePieceProcessor(model_proto=data)
    rust = RustTokenizer.from_file(str(path / "tokenizer.json"))
    for text in check_corpus(spec):
        if encoder.encode(text) != rust.encode(text, add_special_tokens=False).ids:
            return f"it encodes {text[:40]!r} otherwise"
    info = {"format": INFO_FORMAT, "bos_prefix": _bos_prefix(spec),
            "added": {a["content"]: a["id"] for a in spec.get("added_tokens") or []},
            "special": sorted(a["id"] for a in spec.get("added_tokens") or [] if a.get("special"))}
    try:
        _write(path / SPM_INFO, json.dumps(info).encode())
        _write(path / SPM_FILE, data)  # last: its presence says both are there
    except OSError as exc:
        return f"cannot write it ({exc})"
    return None


def _write(target: Path, data: bytes) -> None:
    """Write through a temporary file and a rename, so that a reader never sees half a file."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)


class SpmTokenizer:
    """sentencepiece's encoder of a folder's SPM_FILE with SPM_INFO's ids. Invariant:
    encode gives what tokenizer.json's Rust tokenizer gives (module docstring)."""

    def __init__(self, path: Path) -> None:
        import sentencepiece

        info = json.loads((path / SPM_INFO).read_text())
        if info.get("format") != INFO_FORMAT:
            raise ValueError(f"{path / SPM_INFO}: format {info.get('format')!r}, not {INFO_FORMAT}")
        self._encoder = sentencepiece.SentencePieceProcessor(model_file=str(path / SPM_FILE))
        self.bos_prefix: list[int] = list(info["bos_prefix"])
        self.added: dict[str, int] = dict(info["added"])
        self.special_ids: list[int] = list(info["special"])

    @classmethod
    def load(cls, path: Path) -> SpmTokenizer | None:
        """The folder's SpmTokenizer, or None where it has none or sentencepiece is missing."""
        if not ((path / SPM_FILE).is_file() and (path / SPM_INFO).is_file()) or not available():
            return None
        try:
            return cls(path)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:  # sentencepiece raises RuntimeError
            log.warning("%s: not read (%s); the Rust tokenizer serves", path / SPM_FILE, exc)
            return None

    def __len__(self) -> int:
        return int(self._encoder.get_piece_size())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UnicodeError for text that is not Unicode (lone surrogates), as the Rust library's
        binding raises for it (sentencepiece's raises a RuntimeError)."""
        try:
            ids = self._encoder.encode(text)
        except RuntimeError:
            text.encode()  # raises UnicodeEncodeError where that was the cause
            raise
        return self.bos_prefix + ids if add_special_tokens else ids

    def token_to_id(self, token: str) -> int | None:
        if token in self.added:
            return self.added[token]
        token_id = int(self._encoder.piece_to_id(token))
        # sentencepiece answers the unknown id (-1 here: none) for a piece it does not have
        return token_id if 0 <= token_id < len(self) and self._encoder.id_to_piece(token_id) == token else None

    def decode_table(self) -> DecodeTable:
        pieces = {self._encoder.id_to_piece(i): i for i in range(len(self))}
        return DecodeTable(pieces, self.special_ids)
