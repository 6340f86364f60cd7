"""text/spm_tokenizer: a Gemma-style tokenizer.json's sentencepiece model encodes every text
as the Rust tokenizer does (random texts by hypothesis, added tokens inside words, bytes
without pieces), is written only for the shape it is exact for and only when its check
corpus agrees, and serves a converted folder's FileTokenizer without the Rust tokenizer
being read (the Gemma 3 tokenizer itself: tests/models/test_gguf_loader.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors  # noqa: E402

from hybridserve.core.errors import RequestError  # noqa: E402
from hybridserve.models.loaders.gguf_loader import CONVERSION_MARKER  # noqa: E402
from hybridserve.text import spm_tokenizer  # noqa: E402
from hybridserve.text.spm_tokenizer import SPM_FILE, SPM_INFO, SpmTokenizer, build, compatible  # noqa: E402
from hybridserve.text.tokenizer import Tokenizer as OurTokenizer  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = "\u2581abcdehilmnorst.,"
# Pieces several merges make, in score order (the first merge that makes a piece ranks it).
PIECES = ["\u2581t", "he", "\u2581the", "at", "\u2581c", "\u2581cat", "\u2581s", "\u2581sat", "on", "\u2581on",
          "\u2581a", "er", "\u2581m", "\u2581mat", "ll", "\u2581he", "\u2581hell", "\u2581hello", "lo", "hell",
          "\u2581\u2581", "\u2581\u2581\u2581"]
ADDED = [("<start_of_turn>", True), ("<end_of_turn>", True), ("\n", False), ("\n\n", False), ("<t>", False)]
ALPHABET = "abcdehilmnorst.,xyz \n\t\u00e9\u00fc\u4e2d\U0001f600\u2581<>_"


def _gemma_style() -> Tokenizer:
    """A byte-fallback BPE with Gemma 3's normalizer, pre-tokenizer, decoder and BOS
    template, every byte a token, its merges every split of each piece into two (as the
    SentencePiece converters write them), added tokens as written."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in CHARS:
        vocab[c] = len(vocab)
    merges = []
    for piece in PIECES:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
        vocab[piece] = len(vocab)
    vocab["sat"] = len(vocab)  # a piece no merge makes: never encoded to
    for text, _ in ADDED:
        vocab[text] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in ADDED])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tok


def _folder(tmp_path: Path, tok: Tokenizer | None = None) -> Path:
    """A converted folder's tokenizer files: the marker, tokenizer.json, bos / eos."""
    folder = tmp_path / "converted"
    folder.mkdir()
    (tok or _gemma_style()).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    (folder / CONVERSION_MARKER).write_text("{}")
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[SpmTokenizer, Tokenizer]:
    folder = _folder(tmp_path_factory.mktemp("spm"))
    assert build(folder) is None
    return SpmTokenizer(folder), Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_by_hand(built: tuple[SpmTokenizer, Tokenizer]) -> None:
    ours, rust = built
    ids = {t: rust.token_to_id(t) for t in ["<bos>", "\u2581the", "\u2581cat", "\u2581sat", "<start_of_turn>", "\n\n"]}
    # merges make the words; added tokens are cut out as written, the longest first
    assert ours.encode(" the cat\n\n<start_of_turn> sat") == [ids["<bos>"], ids["\u2581the"], ids["\u2581cat"],
                                                              ids["\n\n"], ids["<start_of_turn>"], ids["\u2581sat"]]
    # "sat" is a piece, but no merge makes it: "s" and "at", as the Rust BPE gives them
    assert ours.encode("sat", add_special_tokens=False) == [rust.token_to_id("s"), rust.token_to_id("at")]
    # "q" has no piece: its UTF-8 byte, as the Rust byte fallback gives it
    assert ours.encode("q", add_special_tokens=False) == [rust.token_to_id("<0x71>")]
    assert ours.token_to_id("<eos>") == 1 and ours.token_to_id("\u2581hello") == rust.token_to_id("\u2581hello")
    assert ours.token_to_id("no such piece") is None and len(ours) == rust.get_vocab_size(with_added_tokens=True)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40) | st.lists(
    st.sampled_from(PIECES + [t for t, _ in ADDED] + SPECIALS + list(ALPHABET)), max_size=12).map("".join),
       st.booleans())
def test_any_text_encodes_as_the_rust_tokenizer(built: tuple[SpmTokenizer, Tokenizer], text: str,
                                                 special: bool) -> None:
    ours, rust = built
    assert ours.encode(text, add_special_tokens=special) == rust.encode(text, add_special_tokens=special).ids


def test_the_decode_table_decodes_as_the_rust_tokenizer(built: tuple[SpmTokenizer, Tokenizer]) -> None:
    ours, rust = built
    table = ours.decode_table()
    for text in [" the cat\n\n<start_of_turn> sat", "\u00e9\U0001f600 q<unk>", ""]:
        ids = rust.encode(text).ids
        for skip in (False, True):
            assert table.decode(ids, skip) == rust.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("change, reason", [
    (lambda s: s.__setitem__("pre_tokenizer", {"type": "Metaspace", "replacement": "\u2581",
                                               "prepend_scheme": "first", "split": False}),
     "a pre-tokenizer that splits the text"),
    (lambda s: s.__setitem__("normalizer", None), "a normalizer other than spaces to \u2581"),
    (lambda s: s["model"]["vocab"].pop("<0x41>"), "not every byte has a token"),
    (lambda s: s["model"].__setitem__("byte_fallback", False), "not a byte-fallback BPE"),
    (lambda s: s["added_tokens"][-1].__setitem__("normalized", True), "added token '<t>' is normalized or stripped"),
    (lambda s: s["added_tokens"][-1].__setitem__("content", "<t t>"),
     "added token '<t t>' is empty, holds a space or is not in the vocabulary"),
    (lambda s: s.__setitem__("post_processor", {"type": "ByteLevel"}), "a post-processor other than a BOS prefix"),
    (lambda s: s.__setitem__("decoder", {"type": "Metaspace"}), "a decoder other than SentencePiece's"),
])
def test_other_shapes_are_refused(change, reason: str) -> None:  # type: ignore[no-untyped-def]
    spec = json.loads(_gemma_style().to_str())
    assert compatible(spec) is None
    changed = copy.deepcopy(spec)
    change(changed)
    assert compatible(changed) == reason


def test_a_model_that_encodes_otherwise_is_not_written(tmp_path: Path, monkeypatch) -> None:
    """Scores that disagree with the merge ranks (every piece scored alike: sentencepiece then
    merges left to right) fail the check corpus: nothing is written and the Rust tokenizer
    serves the folder."""
    real = spm_tokenizer._model_proto

    def flat_scores(spec):  # type: ignore[no-untyped-def]
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto.FromString(real(spec))
        for piece in proto.pieces:
            piece.score = 0.0
        return proto.SerializeToString()

    monkeypatch.setattr(spm_tokenizer, "_model_proto", flat_scores)
    folder = _folder(tmp_path)
    assert build(folder).startswith("it encodes ")
    assert not (folder / SPM_FILE).exists() and not (folder / SPM_INFO).exists()
    ours = OurTokenizer.from_dir(folder)
    assert ours is not None and not ours.hf._has_spm
    assert ours.encode(" the cat") == Tokenizer.from_file(str(folder / "tokenizer.json")).encode(" the cat").ids


def test_a_converted_folder_is_served_without_the_rust_tokenizer(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    rust = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ours = OurTokenizer.from_dir(folder)  # writes the model on first use
    assert ours is not None and (folder / SPM_FILE).is_file() and ours.hf._has_spm
    text = " the cat\n\n<end_of_turn> sat \u00e9"
    ids = rust.encode(text).ids
    assert ours.encode(text) == ids and ours.decode(ids, skip_special_tokens=True) == rust.decode(ids)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (1, 2, rust.get_vocab_size(with_added_tokens=True))
    assert ours.hf.get_added_vocab() == {t: rust.token_to_id(t) for t in SPECIALS + [t for t, _ in ADDED]}
    assert ours.special_token_id("<start_of_turn>") == rust.token_to_id("<start_of_turn>")
    assert ours.hf._backend is None  # none of the above read tokenizer.json's Rust tokenizer
    with pytest.raises(RequestError, match="prompt"):  # a lone surrogate: a request's error, as with the Rust one
        ours.encode("a\ud800b", param="prompt")
    assert ours.encode("a\x00b") == rust.encode("a\x00b").ids
    ours.hf.release()  # the core process's release drops the sentencepiece model too
    assert ours.hf._spm is None and ours.encode(text) == ids and ours.hf._backend is None
    mtime = (folder / SPM_FILE).stat().st_mtime_ns
    assert OurTokenizer.from_dir(folder) is not None and (folder / SPM_FILE).stat().st_mtime_ns == mtime  # kept
