"""Activation smoothing for the int8 x int8 matmuls: the decoder's linears and the output head (SmoothQuant).

int8 activations are quantized per row (models/layers/int8.py), so one large channel in a row
flattens every small one to a few levels. The decoder's inputs have such channels (at
qkv's input and at down's, the GELU product, hundreds of times the median channel's), and
quantizing them as they are loses most of float32's greedy tokens
(`benchmarks/quant_accuracy.py`; benchmarks/results/quant_accuracy.md).

Smoothing divides input channel j of a linear by s_j and multiplies the weight's column j
by s_j: x W^T is unchanged in exact arithmetic, while part of the activation's range
moves onto the weight, which is quantized per output row and has range to spare:

    s_j = max|x_j| ** ALPHA / max_i |W_ij| ** (1 - ALPHA)

The division costs nothing at run time; it is folded into what produces x:
- qkv and gate_up read a norm's output: 1/s goes into that norm's weight (rounded to the
  model dtype; the weight's columns then take the factor the rounded norm really applies);
- down reads act(gate) * up, which is linear in up: 1/s goes into up's rows (and bias).
o is left as it is (its input, the attention output, comes from V through a softmax
average and has no channel that stands out as far; quantized alone it cost little).
- the output head reads the final norm's output: 1/s goes into the final norm's weight, and
  the head's int8 copy (models/layers/head.py) takes s on its columns. The head's input has
  outlier channels too; smoothed, an int8 x int8 head keeps most of the accuracy of
  weight-only int8 at int8 x int8's speed (benchmarks/kl_accuracy.py). The embedding is not
  touched: a tied head's embedding rows are read from the plain weight, not the int8 copy.

max|x_j| comes from a calibration forward over CALIBRATION_TEXTS, tokenized with the
model's own tokenizer (BOS included, as in serving: the first token's activations are
the largest), in one forward where each text attends causally to itself only. Every text
is shorter than the sliding window, so that attention is exactly the model's. Random token ids
calibrate worse (measured: mean |logprob difference| 0.072 against 0.029 with text).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from hybridserve.models.arch.decoder import DecoderLM, LayerSmoothing
from hybridserve.models.layers.int8 import NARROW_WEIGHT_LEVELS, QUANTIZE_BLOCK_ROWS, BlockDone, gemm_weight_levels
from hybridserve.models.layers.int8_groups import make_group_linear
from hybridserve.models.layers.linear import LayerLinears, Linear

# Share of the activation's range moved onto the weights. Of 0.4, 0.5, 0.6, 0.75 and 0.85, 0.6 kept
# Gemma 3 270M's greedy streams closest to float32 (benchmarks/quant_accuracy.py).
ALPHA = 0.6
# The same share for the output head's input (the final norm's output), chosen the same way
# by the mean next-token KL divergence from float32 (benchmarks/kl_accuracy.py), for the
# head's int8 weights in 127 levels (int8 dot products: VNNI, AMX) ...
HEAD_ALPHA = 0.5
# ... and in 63 (AVX2 alone, int8.gemm_weight_levels), whose coarser weight steps take a
# smaller share best: of 0.1-0.5 under the default gguf-groups decoder there, 0.2
# (benchmarks/results/quant_accuracy.md).
HEAD_ALPHA_NARROW = 0.2
_FLOOR = 1e-5  # below this, a channel max is treated as this (no division by zero)

CALIBRATION_TEXTS = (
    "The printing press reached Venice in 1469, and within thirty years the city's workshops had produced "
    "more books than any other place in Europe.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    mid = len(items) // 2\n"
    "    return merge(merge_sort(items[:mid]), merge_sort(items[mid:]))\n",
    "Photosynthesis turns light into chemical energy stored in glucose; chlorophyll absorbs mostly blue and "
    "red light and reflects green.",
    "Q: What is the capital of Australia?\nA: Canberra.\nQ: How many legs does a spider have?\nA: Eight.",
    "Il pleuvait depuis trois jours quand le train est enfin arrivé à la gare, et personne ne l'attendait plus.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89: each Fibonacci number is the sum of the two before it. "
    "SELECT name, COUNT(*) FROM orders GROUP BY name;",
)


Encode = Callable[[str], list[int]]  # text -> token ids, the model's special tokens included


def file_encoder(model_dir: str | Path) -> Encode | None:
    """The model directory's tokenizer.json as an Encode (None without one): for loads
    that are not given the engine's tokenizer."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: tokenizer.encode(text).ids


def encoded_calibration(encode: Encode) -> Encode:
    """`encode` with CALIBRATION_TEXTS encoded now and looked up later (other texts are
    encoded when asked): for a process that drops its tokenizer before the load's
    calibration forward (engine/frontend.build_engine_parts)."""
    ids = {text: encode(text) for text in CALIBRATION_TEXTS}
    return lambda text: list(ids[text]) if text in ids else encode(text)


def calibration_sequences(encode: Encode, max_len: int | None) -> list[list[int]]:
    """CALIBRATION_TEXTS as token ids, each cut to `max_len` (the sliding window)."""
    return [encode(text)[:max_len] for text in CALIBRATION_TEXTS]


class _SequencesAttention:
    """The AttentionBackend of a calibration forward: several sequences laid end to end,
    each attending causally to its own tokens only (a block-diagonal causal mask)."""

    def __init__(self, lengths: list[int], scale: float, softcap: float | None, device: torch.device) -> None:
        owner = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                        torch.tensor(lengths, device=device))
        causal = torch.ones(len(owner), len(owner), dtype=torch.bool, device=device).tril()
        self.allowed = causal & (owner[:, None] == owner[None, :])
        self.scale, self.softcap = scale, softcap

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], kv [T, 2, KVH, D] -> [T, H*D]."""
        T, H, _ = q.shape
        qh, k, v = q.transpose(0, 1), kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)
        k = k.repeat_interleave(H // k.shape[0], dim=0)  # one query head group per kv head
        v = v.repeat_interleave(H // v.shape[0], dim=0)
        scores = (qh @ k.transpose(-1, -2)).float() * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        probs = scores.masked_fill(~self.allowed, float("-inf")).softmax(dim=-1).to(v.dtype)
        return (probs @ v).transpose(0, 1).reshape(T, -1)


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _recorder(name: str, plain: Linear, maxima: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    def record(x: torch.Tensor) -> None:
        m = x.detach().abs().amax(dim=0).float()
        maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m

    def linear(x: torch.Tensor) -> torch.Tensor:
        record(x)
        return plain(x)

    def residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        record(x)
        return h + plain(x)

    return linear, residual


class Calibration(NamedTuple):
    """max |x_j| over the calibration tokens (float32 [K] each): per layer, of the inputs of
    qkv, o, gate_up and down; and of the head's input, the final norm's output."""

    layers: list[dict[str, torch.Tensor]]
    head: torch.Tensor


def input_maxima(model: DecoderLM, sequences: list[list[int]]) -> Calibration:
    """The Calibration of `model` on `sequences`. Runs the layers as plain matmuls of the
    unquantized weights and their biases (qkv's bias reaches o's input, gate_up's reaches
    down's); a layer holding int8 groups instead (--quantization gguf-groups) multiplies by
    them, its only weights."""
    maxima: list[dict[str, torch.Tensor]] = [{} for _ in model.layers]
    linears = []
    for w, m in zip(model.layers, maxima):
        made = {}
        for name in ("qkv", "o", "gate_up", "down"):
            bias = getattr(w, name + "_bias")
            if w.groups is None:
                plain = partial(_dense, weight=getattr(w, name), bias=bias)
            else:
                plain, _ = make_group_linear(getattr(w.groups, name), bias)
            made[name], made[name + "_residual"] = _recorder(name, plain, m)
        linears.append(LayerLinears(**{f: made[f] for f in LayerLinears._fields}))
    saved, model._linears = model._linears, linears
    device = model.final_norm.device if model.final_norm is not None else torch.device("cpu")
    lengths = [len(ids) for ids in sequences]
    backend = _SequencesAttention(lengths, model.cfg.attn_scale, model.cfg.attn_softcap, device)
    ids = torch.tensor([t for seq in sequences for t in seq], device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    try:
        with torch.inference_mode():  # one forward: every weight is read (and mapped in) once
            final = model.forward(ids, positions, max(lengths), backend)
    finally:
        model._linears = saved
    return Calibration(layers=maxima, head=final.detach().abs().amax(dim=0).float())


def factors(x_max: torch.Tensor, weight: torch.Tensor, alpha: float = ALPHA, block_done: BlockDone | None = None
            ) -> torch.Tensor:
    """s_j = max|x_j| ** alpha / max_i |W_ij| ** (1 - alpha), float32 [K]. The column maxima
    are taken QUANTIZE_BLOCK_ROWS rows at a time (a head is 100k+ rows: one float32 copy of
    it would be the load's peak), and `block_done(start, stop)` is called once rows
    [start, stop) are read, so a mapped weight can give their pages back (the head's
    quantization reads them again, block by block)."""
    w_max = torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], QUANTIZE_BLOCK_ROWS):
        stop = min(start + QUANTIZE_BLOCK_ROWS, weight.shape[0])
        torch.maximum(w_max, weight[start:stop].detach().float().abs().amax(dim=0), out=w_max)
        if block_done is not None:
            block_done(start, stop)
    return x_max.clamp(min=_FLOOR).pow(alpha) / w_max.clamp_(min=_FLOOR).pow(1 - alpha)


def _fold_into_norm(norm: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Divide the norm's weight by s in place (in its dtype); returns the factor the rounded
    weight really divides by (1 where the weight is 0: that channel is 0 whatever s is)."""
    before = norm.detach().float().clone()  # .float() of a float32 norm is the norm itself
    norm.data.copy_(before / s)
    after = norm.detach().float()
    return torch.where(after != 0, before / after, torch.ones_like(after))


class Smoothing(NamedTuple):
    """What smooth() folded into the norms: each layer's column factors (None where the
    layers stay in the model dtype) and the head's (None where the head is not int8 x int8)."""

    layers: list[LayerSmoothing] | None
    head: torch.Tensor | None


def smooth(model: DecoderLM, sequences: list[list[int]], layers: bool = True, head: bool = True,
           head_rows_read: BlockDone | None = None) -> Smoothing:
    """Calibrate on `sequences` and fold 1/s into the norms in place for the decoder's
    linears (`layers`) and the output head (`head`); returns the column factors the int8
    copies multiply their weights by (down's factors also divide up's rows, see
    models/arch/decoder.py). `head_rows_read`: factors()'s `block_done` for the head."""
    maxima = input_maxima(model, sequences)
    head_factors = None
    if head:
        assert model.final_norm is not None and model.lm_head is not None, "the head's smoothing needs both"
        head_factors = _fold_into_norm(model.final_norm,
                                       factors(maxima.head, model.lm_head, head_alpha(), block_done=head_rows_read))
    return Smoothing(layers=_smooth_layers(model, maxima.layers) if layers else None, head=head_factors)


def head_alpha() -> float:
    """The head's share for the weight levels this CPU's int8 GEMM takes."""
    return HEAD_ALPHA_NARROW if gemm_weight_levels() == NARROW_WEIGHT_LEVELS else HEAD_ALPHA


def _smooth_layers(model: DecoderLM, maxima: list[dict[str, torch.Tensor]]) -> list[LayerSmoothing]:
    smoothing = []
    for w, m in zip(model.layers, maxima):
        ffn_norm = w.pre_ffn_norm if w.pre_ffn_norm is not None else w.post_attn_norm
        smoothing.append(LayerSmoothing(
            qkv=_fold_into_norm(w.input_norm, factors(m["qkv"], w.qkv)),
            gate_up=_fold_into_norm(ffn_norm, factors(m["gate_up"], w.gate_up)),
            down=factors(m["down"], w.down),
        ))
    return smoothing
