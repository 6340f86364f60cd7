"""Tiny 2-layer models written as GGUFs with the `gguf` package, as llama.cpp's converter
writes them: a Llama (Q/K rows interleaved per head, Q8_0 or F32 tensors, or per linear the
ggml type a test names) and a Gemma 3 of random weights; a SentencePiece vocabulary.

gguf's quantizer has no K-quant encoders, so a Q6_K or Q4_K linear is random blocks with
small finite fp16 fields (weights of about a random init's size), not the HF weight: the
file is then a model of its own, which loading it two ways compares against itself.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

LLAMA_HEADS, LLAMA_KV_HEADS, LLAMA_HEAD_DIM = 4, 2, 16
# GGUF stem of each decoder linear (inside blk.N.) -> its HF module (inside model.layers.N.)
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
_PIECES = ["▁", "▁h", "e", "l", "o", "h", "▁he", "ll", "▁hell", "▁hello", "w", "r", "d", "▁w", "▁wo", "▁world"]
TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
# Per layer, the ggml types of q, k, v, o, gate, up, down (LINEARS' order): every linear of a
# hidden size of 256 can be any of them, so each layer mixes all four (group sizes 32 and
# 16, with and without offsets).
MIXED_LAYER_TYPES = [(Q.Q8_0, Q.Q5_0, Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q8_0),
                     (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.Q6_K, Q.Q5_0, Q.Q4_K)]
# K-quant block: (weights, bytes, byte offsets of its fp16 fields, slice of its int8 sub-block scales or None)
_K_BLOCKS = {Q.Q6_K: (256, 210, (208,), slice(192, 208)), Q.Q4_K: (256, 144, (0, 2), None)}



def mixed_linear_types(override: dict[str, Q] | None = None) -> dict[str, Q]:
    """{GGUF name: ggml type} of both layers' linears as MIXED_LAYER_TYPES, then `override`."""
    types = {f"blk.{i}.{stem}.weight": t for i, row in enumerate(MIXED_LAYER_TYPES) for stem, t in zip(LINEARS, row)}
    return {**types, **(override or {})}

def interleave_rope_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF Q/K rows: per head, halves -> interleaved pairs."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random `qtype` blocks for a rows x cols tensor: d (and dmin) about 1e-4, Q6_K's
    sub-block scales within +-8, so the weights stay below about 0.1."""
    weights, block_bytes, fp16_fields, scales = _K_BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows * cols // weights, block_bytes), dtype=np.uint8)
    for start in fp16_fields:
        d = (rng.uniform(0.5, 1.5, len(raw)) * 1e-4).astype(np.float16)
        raw[:, start:start + 2] = d.view(np.uint8).reshape(-1, 2)
    if scales is not None:
        raw[:, scales] = rng.integers(-8, 8, (len(raw), scales.stop - scales.start)).astype(np.int8).view(np.uint8)
    return raw.reshape(rows, -1)


def _writer(path: Path, arch: str, hidden_size: int, intermediate_size: int, head_dim: int) -> gguf.GGUFWriter:
    """A writer with the sizes both tiny models share and the SentencePiece vocabulary."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden_size)
    writer.add_block_count(2)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(LLAMA_HEADS)
    writer.add_head_count_kv(LLAMA_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(_PIECES))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(_PIECES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    return writer


def _add(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: Q, rng: np.random.Generator) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif qtype in _K_BLOCKS:
        writer.add_tensor(name, _k_blocks(qtype, *values.shape, rng), raw_dtype=qtype)
    else:
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)


def _close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_llama(path: Path, rope_freqs: np.ndarray | None = None, hidden_size: int = 64,
                     intermediate_size: int = 128, linear_types: dict[str, Q] | None = None,
                     ) -> dict[str, np.ndarray]:
    """Write the model to `path`; return its HF weights. `linear_types`: per GGUF name
    (blk.N.attn_q.weight, ...) a decoder linear's ggml type (default Q8_0; Q and K are F32,
    so their restored rows compare exactly)."""
    head_dim = hidden_size // LLAMA_HEADS  # LLAMA_HEAD_DIM at the default size
    config = transformers.LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=LLAMA_HEADS, num_key_value_heads=LLAMA_KV_HEADS, head_dim=head_dim,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = {k: v.numpy().copy() for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    rng = np.random.default_rng(0)
    for name in hf:
        if name.endswith("norm.weight"):  # random, so a wrong offset would show
            hf[name] = (1 + 0.1 * rng.standard_normal(hf[name].shape)).astype(np.float32)
    writer = _writer(path, "llama", hidden_size, intermediate_size, head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    _add(writer, "token_embd.weight", hf["model.embed_tokens.weight"], Q.Q8_0, rng)
    _add(writer, "output_norm.weight", hf["model.norm.weight"], Q.F32, rng)
    _add(writer, "output.weight", hf["lm_head.weight"], Q.Q8_0, rng)
    if rope_freqs is not None:
        _add(writer, "rope_freqs.weight", rope_freqs, Q.F32, rng)
    types = {f"blk.{i}.{stem}.weight": Q.F32 if stem in ("attn_q", "attn_k") else Q.Q8_0
             for i in range(2) for stem in LINEARS}
    types.update(linear_types or {})
    for i in range(2):
        layer = f"model.layers.{i}."
        _add(writer, f"blk.{i}.attn_norm.weight", hf[layer + "input_layernorm.weight"], Q.F32, rng)
        _add(writer, f"blk.{i}.ffn_norm.weight", hf[layer + "post_attention_layernorm.weight"], Q.F32, rng)
        for stem, module in LINEARS.items():
            values = hf[f"{layer}{module}.weight"]
            if stem in ("attn_q", "attn_k"):
                values = interleave_rope_rows(values, LLAMA_HEADS if stem == "attn_q" else LLAMA_KV_HEADS)
            _add(writer, f"blk.{i}.{stem}.weight", values, types[f"blk.{i}.{stem}.weight"], rng)
    _close(writer)
    return hf


def write_tiny_gemma3(path: Path, hidden_size: int, intermediate_size: int, linear_types: dict[str, Q]) -> None:
    """A 2-layer Gemma 3 (sandwich norms, q/k norms, layer 0 sliding, layer 1 full) with
    random weights, its linears of `linear_types` (per GGUF name: all fourteen), the head
    tied to the Q8_0 embedding. Norm weights are stored as llama.cpp stores Gemma's: 1 + w."""
    head_dim = hidden_size // LLAMA_HEADS
    rng = np.random.default_rng(1)
    writer = _writer(path, "gemma3", hidden_size, intermediate_size, head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(16)
    writer.add_uint32("gemma3.attention.sliding_window_pattern", 2)

    def norm(size: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    _add(writer, "token_embd.weight", rng.standard_normal((len(TOKENS), hidden_size)).astype(np.float32), Q.Q8_0, rng)
    _add(writer, "output_norm.weight", norm(hidden_size), Q.F32, rng)
    shapes = {"attn_q": (LLAMA_HEADS * head_dim, hidden_size), "attn_k": (LLAMA_KV_HEADS * head_dim, hidden_size),
              "attn_v": (LLAMA_KV_HEADS * head_dim, hidden_size), "attn_output": (hidden_size, LLAMA_HEADS * head_dim),
              "ffn_gate": (intermediate_size, hidden_size), "ffn_up": (intermediate_size, hidden_size),
              "ffn_down": (hidden_size, intermediate_size)}
    for i in range(2):
        for stem in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            _add(writer, f"blk.{i}.{stem}.weight", norm(hidden_size), Q.F32, rng)
        for stem in ("attn_q_norm", "attn_k_norm"):
            _add(writer, f"blk.{i}.{stem}.weight", norm(head_dim), Q.F32, rng)
        for stem, shape in shapes.items():
            name = f"blk.{i}.{stem}.weight"
            _add(writer, name, (0.05 * rng.standard_normal(shape)).astype(np.float32), linear_types[name], rng)
    _close(writer)
