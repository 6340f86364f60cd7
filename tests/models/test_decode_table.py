"""Decoding from text/decode_table.DecodeTable against the Rust tokenizer it replaces, and
a converted tokenizer released before the weights load (`hybridserve generate`'s prompts
encoded first): the same ids and text, with the Rust tokenizer no longer held."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from hybridserve.core.request import SamplingParams
from hybridserve.models.loaders.gguf_loader import CONVERSION_MARKER
from hybridserve.text.decode_table import DecodeTable
from hybridserve.text.tokenizer import Tokenizer as OurTokenizer
from tests.helpers.serving_models import VOCAB_SIZE, tiny_model_dir_without_tokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
# Bytes with tokens of their own: ASCII letters' neighbours, UTF-8 lead and continuation
# bytes (so runs of byte tokens are valid UTF-8 or not), and a lower-case spelling.
BYTES = list(range(0x80, 0xC0)) + [0xC3, 0xC5, 0xE2, 0xE6, 0xF0, 0x0A, 0x21]
ADDED = [("<start_of_turn>", True), ("<end_of_turn>", True), ("\n\n", False), ("▁▁", False)]


def _sentencepiece_bpe() -> Tokenizer:
    """A byte-fallback BPE with Gemma's normalizer, pre-tokenizer and decoder chain, over
    VOCAB_SIZE ids (the tiny model's vocabulary)."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in BYTES:
        vocab[f"<0x{b:02X}>" if b != 0x21 else "<0x21>"] = len(vocab)
    for c in "▁abcdefghijklmnopqrstuvwxyzé.,'":
        vocab[c] = len(vocab)
    merges = []
    pieces = ["▁t", "he", "▁the", "▁a", "at", "▁c", "▁cat", "▁s", "▁sat", "in", "on", "▁on", "er", "▁m", "▁mat"]
    for piece in pieces:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab and (left, right) not in merges:
                merges.append((left, right))
                break
        vocab[piece] = len(vocab)
    while len(vocab) < VOCAB_SIZE - len(ADDED):
        vocab[f"▁w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in ADDED])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return tok


def test_table_decodes_as_the_rust_tokenizer() -> None:
    tok = _sentencepiece_bpe()
    table = DecodeTable.from_backend(tok)
    assert table is not None
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in BYTES]
    special_ids = [tok.token_to_id(t) for t in SPECIALS + [t for t, _ in ADDED]]
    rng = random.Random(0)
    for _ in range(2000):
        ids = []
        for _ in range(rng.randrange(0, 24)):
            r = rng.random()
            ids.append(rng.choice(byte_ids) if r < 0.45 else rng.choice(special_ids) if r < 0.6
                       else rng.randrange(0, VOCAB_SIZE + 8))  # ids past the vocabulary are dropped
        for skip in (False, True):
            assert table.decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    # Invalid UTF-8 runs become one U+FFFD per byte token; valid ones their character.
    e_acute = [tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>")]
    assert table.decode(e_acute) == "é" and table.decode(e_acute[::-1]) == "\ufffd\ufffd"


def test_no_table_for_another_decoder() -> None:
    tok = _sentencepiece_bpe()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])  # no byte fallback
    assert DecodeTable.from_backend(tok) is None
    tok.decoder = decoders.Metaspace()
    assert DecodeTable.from_backend(tok) is None


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with the tokenizer above, as this project's GGUF conversion leaves it
    (the marker, tokenizer.json, bos/eos in tokenizer_config.json, no chat template)."""
    out = tmp_path_factory.mktemp("converted") / "model"
    shutil.copytree(tiny_model_dir_without_tokenizer(), out)
    _sentencepiece_bpe().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    (out / CONVERSION_MARKER).write_text("{}")
    return out


def test_released_tokenizer_answers_its_texts_and_decodes_without_the_backend(converted_dir: Path) -> None:
    ours = OurTokenizer.from_dir(converted_dir)
    assert ours is not None
    rust = Tokenizer.from_file(str(converted_dir / "tokenizer.json"))
    texts = ["the cat sat on the mat", "é! <start_of_turn>x\n\n"]
    expected = {t: rust.encode(t).ids for t in texts}
    ours.hf.release(keep_decoding=True, texts=texts)
    assert ours.hf._backend is None
    for text in texts:
        assert ours.encode(text) == expected[text]
        for skip in (False, True):
            assert ours.decode(expected[text], skip_special_tokens=skip) == rust.decode(expected[text],
                                                                                      skip_special_tokens=skip)
    assert ours.hf._backend is None  # nothing above read the tokenizer again
    assert ours.encode("a cat") == rust.encode("a cat").ids  # another text reads it again


def test_llm_with_prompts_encoded_first_holds_no_tokenizer_and_gives_the_same_text(converted_dir: Path) -> None:
    from hybridserve.engine.llm import LLM

    prompts = ["the cat sat on the mat", "on the mat, a cat"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(converted_dir), progress=False, dtype="float32", quantization="none") as llm:
        whole = llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(converted_dir), progress=False, dtype="float32", quantization="none", encode_first=prompts) as llm:
        assert llm.tokenizer is not None and llm.tokenizer.hf._backend is None  # released before the weights
        first = llm.generate(prompts, params, use_tqdm=False)
        assert llm.tokenizer.hf._backend is None  # the run read it no more
    for a, b in zip(whole, first):
        assert (a.prompt_token_ids, a.outputs[0].token_ids, a.outputs[0].text) == \
               (b.prompt_token_ids, b.outputs[0].token_ids, b.outputs[0].text)
