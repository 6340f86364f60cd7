"""A tiny hybrid model with a tiny tokenizer, for the API, CLI and server tests.

The model is hf_tiny's Gemma3 config (6 layers: sliding window 16 and full attention,
vocab 256) with an untied output head, so greedy text does not just repeat the prompt's
last token. The tokenizer is a WordLevel tokenizer over exactly 256 ids, so every id
the random model can sample decodes to a word:

    0 <pad>  1 <eos>  2 <bos>  3 <unk>  4..6 <system> <user> <assistant>  7.. words

It adds <bos> in front of every encoded text (like Gemma), and carries a small Jinja
chat template. `tiny_serving_dir(chat_template=False)` gives a copy without one (the
plain-template path).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from tests.helpers import hf_tiny

VOCAB_SIZE = 256
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<system>", "<user>", "<assistant>"]
WORDS = ["hello", "world", "the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "one", "two",
         "three", "blue", "red", "sky", "sun", "moon", "is", "and", "of", "to", "in", "it", "what", "who"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROMPTS = ["hello world", "the cat sat on a mat", "one two three", "blue sky and red sun",
           "the dog ran far away", "who is the moon", "a cat and a dog", "what is it"]


def vocabulary() -> list[str]:
    """256 distinct tokens: specials, the common words, then synthetic syllable words."""
    words = list(SPECIALS) + list(WORDS)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    for a in syllables:
        for b in syllables:
            if len(words) == VOCAB_SIZE:
                return words
            if a != b:
                words.append(a + b)
    return words


def save_tokenizer(out_dir: Path, chat_template: bool = True) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_model(out_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_tiny.hf_config("gemma3")
    cfg.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(out_dir)
    return out_dir


_DIRS: dict[bool, Path] = {}
_ROOT: list[Path] = []


def tiny_model_dir_without_tokenizer() -> Path:
    """The tiny model alone: no tokenizer files (built once per test process)."""
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="hybridserve_serving_")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    base = _ROOT[0] / "model"
    if not base.exists():
        build_model(base)
    return base


def tiny_serving_dir(chat_template: bool = True) -> Path:
    """The tiny model directory plus a tokenizer (built once per test process)."""
    if chat_template not in _DIRS:
        base = tiny_model_dir_without_tokenizer()
        out = _ROOT[0] / ("chat" if chat_template else "plain")
        shutil.copytree(base, out)
        save_tokenizer(out, chat_template)
        _DIRS[chat_template] = out
    return _DIRS[chat_template]
