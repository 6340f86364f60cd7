"""A tiny model with a byte-level BPE tokenizer, for the structured-output tests.

The serving tests' tokenizer knows only whole words; a grammar needs tokens that can
spell any text. Here: the 256 byte tokens (GPT-2's byte-to-unicode alphabet), a few
merges that make multi-character tokens JSON uses ('{"', '":', '",', 'true', ...), and
<eos>/<bos>/<pad>; vocabulary 300, the tiny Gemma 3 model of hf_tiny with that vocab.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from tests.helpers import hf_tiny

VOCAB_SIZE = 300
MERGE_PAIRS = [("{", '"'), ('"', ":"), ('"', ","), ('"', "}"), ("t", "r"), ("tr", "u"), ("tru", "e"),
               ("f", "a"), ("fa", "l"), ("fal", "s"), ("fals", "e"), ("n", "u"), ("nu", "l"), ("nul", "l"),
               ("1", "2"), ("a", "b"), ("ab", "c")]
_DIR: list[Path] = []


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def save_byte_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for ch in _byte_alphabet():
        vocab[ch] = len(vocab)
    merges = []
    for a, b in MERGE_PAIRS:
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    # A tool-aware template (as Hermes-style ones are): the tools' JSON goes in front.
    fast.chat_template = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
                          "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(str(out_dir))


def byte_model_dir() -> Path:
    """The model directory (built once per test process)."""
    if not _DIR:
        import torch
        from transformers import AutoModelForCausalLM

        root = Path(tempfile.mkdtemp(prefix="hybridserve_structured_"))
        atexit.register(shutil.rmtree, root, True)
        cfg = hf_tiny.hf_config("gemma3")
        cfg.vocab_size = VOCAB_SIZE
        cfg.tie_word_embeddings = False
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.generation_config.eos_token_id = 1
        model.save_pretrained(root)
        save_byte_tokenizer(root)
        _DIR.append(root)
    return _DIR[0]
