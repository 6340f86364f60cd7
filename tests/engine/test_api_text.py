"""Text handling without a model: incremental detokenizing and stop strings."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from hybridserve.core.errors import RequestError  # noqa: E402
from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.core.sched.output import RequestOutput as CoreOutput  # noqa: E402
from hybridserve.engine.outputs import SequenceState  # noqa: E402
from hybridserve.text.tokenizer import Tokenizer, plain_chat_text  # noqa: E402

CORPUS = ["héllo wörld, the cat sat on the mat", "naïve café déjà vu", "the quick brown fox jumps", "日本語のテキスト"]


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    """Byte-level BPE: characters outside the corpus split into several byte tokens."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    raw.train_from_iterator(CORPUS, trainer)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>"))


TEXT = " the café 😀 sat on 日本 mat 🐈!"


def test_incremental_deltas_concatenate_to_the_text_and_never_split_a_character(byte_bpe: Tokenizer) -> None:
    prompt = byte_bpe.encode("héllo wörld,")
    ids = byte_bpe.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # the emoji and CJK really are split into byte tokens
    detok = byte_bpe.detokenizer(prompt)
    deltas = [detok.push([t]) for t in ids] + [detok.finish()]
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") >= 3  # partial characters were held back


def test_pushing_tokens_in_chunks_gives_the_same_text(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode(TEXT)
    detok = byte_bpe.detokenizer(byte_bpe.encode("the"))
    text = "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detok.finish()
    assert text == TEXT


def test_a_split_character_at_the_end_is_flushed_as_replacement(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode(" 😀")
    detok = byte_bpe.detokenizer(byte_bpe.encode("the"))
    held = detok.push(ids[:-1])  # the emoji's last byte is missing
    flushed = detok.finish()
    assert held == ""
    assert flushed.startswith(" ") and flushed.endswith("\ufffd") and "😀" not in flushed


def _feed(byte_bpe: Tokenizer, params: SamplingParams, ids: list[int], finish_at_end: bool = True
          ) -> tuple[SequenceState, list[str], int]:
    seq = SequenceState(0, byte_bpe.encode("the"), params, byte_bpe)
    deltas, stopped_at = [], -1
    for i, t in enumerate(ids):
        done = finish_at_end and i == len(ids) - 1
        if seq.update(CoreOutput("r", [t], done, "length" if done else None), float(i)):
            stopped_at = i
        d = seq.take_delta()
        if d is not None:
            deltas.append(d.delta_text)
        if seq.finished:
            break
    return seq, deltas, stopped_at


def test_stop_string_cuts_the_text_and_no_delta_leaks_past_it(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode(TEXT)
    seq, deltas, stopped_at = _feed(byte_bpe, SamplingParams(stop=("sat on",)), ids)
    assert seq.finish_reason == "stop" and seq.stop_reason == "sat on"
    assert seq.text == " the café 😀 "
    assert "".join(deltas) == seq.text
    assert 0 <= stopped_at < len(ids) - 1  # found before the tokens ran out


def test_stop_string_kept_when_asked(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode(TEXT)
    seq, deltas, _ = _feed(byte_bpe, SamplingParams(stop=("日本", "sat"), include_stop_str_in_output=True), ids)
    assert seq.text == " the café 😀 sat" and seq.stop_reason == "sat"
    assert "".join(deltas) == seq.text


def test_without_a_match_all_text_arrives_by_the_end(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode(TEXT)
    seq, deltas, _ = _feed(byte_bpe, SamplingParams(stop=("zebra crossing",)), ids)
    assert seq.finish_reason == "length" and seq.text == TEXT
    assert "".join(deltas) == TEXT


def test_sampling_params_checks_text_options() -> None:
    with pytest.raises(RequestError, match="stop strings must be non-empty"):
        SamplingParams(stop=("",))
    with pytest.raises(RequestError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    p = SamplingParams(stop="x", seed=5, n=3)
    assert p.stop == ("x",)
    assert [p.for_choice(i).seed for i in range(3)] == [5, 6, 7]
    assert SamplingParams(n=2).for_choice(1).seed is None


def test_one_sampling_params_from_the_user_to_the_sampler() -> None:
    import hybridserve
    from hybridserve.engine import outputs

    # The public name, the front end's and the core's are one class: one set of defaults.
    assert hybridserve.SamplingParams is SamplingParams is outputs.SamplingParams
    assert outputs.as_sampling_params(None) == SamplingParams()
    with pytest.raises(RequestError, match="must be a SamplingParams, got dict"):
        outputs.as_sampling_params({"max_tokens": 3})  # type: ignore[arg-type]


def test_plain_chat_template() -> None:
    text = plain_chat_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}])
    assert text == "System: be brief\nUser: hi\nAssistant: hello\nUser: bye\nAssistant:"


def test_a_loaded_tokenizer_drops_its_python_vocabulary_and_encodes_as_hf(tmp_path) -> None:
    """Gemma's transformers class keeps the Python vocab and merges it built the Rust
    backend from (transformers 5); from_dir drops them, and still encodes and decodes as
    a fresh AutoTokenizer does (with transformers 4 there is nothing to drop)."""
    from transformers import AutoTokenizer, GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "a": 5, "b": 6, "\u2581": 7, "ab": 8,
             "\u2581ab": 9}
    merges = [("a", "b"), ("\u2581", "ab")]
    try:
        GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True).save_pretrained(str(tmp_path))
    except TypeError:
        pytest.skip("this transformers' GemmaTokenizer is not built from vocab and merges")
    oracle = AutoTokenizer.from_pretrained(str(tmp_path))
    kept = [name for name in ("_vocab", "_merges") if isinstance(getattr(oracle, name, None), (dict, list))]
    tok = Tokenizer.from_dir(tmp_path)
    assert tok is not None
    for name in kept:
        assert getattr(tok.hf, name) is None
    # "ab ab b": BOS, then "ab" (a+b), "\u2581ab" (the space and ab merged), "\u2581", "b"
    assert tok.encode("ab ab b") == [2, 8, 9, 7, 6] == oracle.encode("ab ab b")
    assert tok.decode([8, 9, 7, 6]) == "ab ab b" == oracle.decode([8, 9, 7, 6])
    assert len(tok) == len(oracle) == 10


def test_dropping_construction_copies_keeps_a_slow_tokenizer_whole() -> None:
    from types import SimpleNamespace

    from hybridserve.text.tokenizer import drop_construction_copies

    slow = SimpleNamespace(_vocab={"a": 0}, _merges=[("a", "a")])  # no Rust backend: the copies are the vocabulary
    assert drop_construction_copies(slow) == []
    assert slow._vocab == {"a": 0} and slow._merges == [("a", "a")]
