"""int8 x int8 decoder layers: the linear against a matmul of its dequantized operands, the
smoothing factors and norm folding by hand, smoothed weights computing the same function as
the originals, and which loads get int8 layers (models/layers/int8.py, smoothing.py, decoder.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from hybridserve.models.layers import smoothing  # noqa: E402
from hybridserve.models.arch.decoder import smoothed_weights  # noqa: E402
from hybridserve.models.platform.cpu_features import as_avx2_env, read_cpu_flags  # noqa: E402
from hybridserve.models.layers.int8 import (  # noqa: E402
    FBGEMM,
    PACKED,
    PLAIN,
    W8A8Linear,
    choose_int8_path,
    fbgemm_available,
    gemm_weight_levels,
    int8_gemm_available,
    int8_path,
    quantize_gemm_weight,
    quantize_int8_rows,
    quantize_rows_int8,
    quantize_rows_uint8,
)
from hybridserve.models.layers.linear import LayerLinears, make_int8_linear, make_linear  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.layers.head import OutputHead  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402

needs_int8_gemm = pytest.mark.skipif(not int8_gemm_available(), reason="no int8 GEMM here (x86 with AVX2 or VNNI)")
needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="this torch has no fbgemm (x86 builds do)")


def toy_encode(text: str) -> list[int]:
    """A tokenizer for the tiny models (vocabulary 256): BOS, then one id per byte."""
    return [2] + [b % 256 for b in text.encode()]


@needs_int8_gemm
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_the_product_of_its_dequantized_operands(out_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g)
    x = torch.randn(5, 64, generator=g).to(out_dtype)
    h = torch.randn(5, 96, generator=g).to(out_dtype)
    linear, residual = make_int8_linear(w, b, out_dtype)
    wv, ws = quantize_gemm_weight(w)
    xv, xs = quantize_rows_uint8(x)
    product = ((xv.float() - 128) * xs) @ (wv.float() * ws[:, None]).t() + b
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    assert linear(x).dtype == out_dtype
    torch.testing.assert_close(linear(x).float(), product.to(out_dtype).float(), rtol=tol, atol=tol)
    torch.testing.assert_close(residual(h, x).float(), (h.float() + product).to(out_dtype).float(),
                               rtol=tol, atol=tol)
    # and int8 stays close to the float product itself: 127 levels each side on both
    # operands put the relative error near 1% (measured 0.6%; 63 weight levels: 0.9%)
    exact = F.linear(x.float(), w, b)
    assert float((linear(x).float() - exact).norm() / exact.norm()) < 0.02


@needs_int8_gemm
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.sampled_from([8, 64, 100, 640]), st.sampled_from([7, 96, 1536]), st.integers(0, 2**31))
def test_the_plain_path_agrees_with_the_packed_gemm_bit_for_bit(rows: int, k: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    linear = W8A8Linear(*quantize_gemm_weight(torch.randn(n, k, generator=g)))
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 10
    packed = linear.packed(*quantize_rows_uint8(x))
    assert torch.equal(linear.plain(x), packed)
    assert torch.equal(linear(x), packed)  # whichever path this CPU takes for `rows`


@needs_fbgemm
@settings(max_examples=40, deadline=None)
@example(rows=17, k=640, n=7, seed=0)  # the tie that fbgemm's own rounding got wrong
@given(st.integers(1, 20), st.sampled_from([8, 64, 100, 640]), st.sampled_from([7, 96, 1536]), st.integers(0, 2**31))
def test_the_fbgemm_path_agrees_with_the_packed_gemm_bit_for_bit(rows: int, k: int, n: int, seed: int) -> None:
    # A level at exactly x.5 must round as on the other paths (ties to even): fbgemm's
    # own rounding sent 0.5 to 1 at 17 rows, so it is given whole levels.
    g = torch.Generator().manual_seed(seed)
    linear = W8A8Linear(*quantize_gemm_weight(torch.randn(n, k, generator=g)))
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 10
    x[0, :2] = torch.tensor([2.0, 127.0])  # row scale 1: level 2, and a tie if k > 2 ...
    if k > 2:
        x[0, 2] = 0.5  # ... 0.5 -> 0 (to even), where rounding half up would give 1
    assert torch.equal(linear.fbgemm(x), linear.packed(*quantize_rows_uint8(x)))


def test_one_int8_path_per_cpu_by_its_flags() -> None:
    vnni, amx, avx2 = {"avx2", "avx512f", "avx512_vnni"}, {"avx2", "amx_int8"}, {"avx2", "fma"}
    assert choose_int8_path(vnni, fbgemm=True) == PACKED
    assert choose_int8_path(amx, fbgemm=True) == PACKED
    assert choose_int8_path({"avx2", "avx_vnni"}, fbgemm=False) == PACKED
    assert choose_int8_path(avx2, fbgemm=True) == FBGEMM
    assert choose_int8_path(avx2, fbgemm=False) == PLAIN


@needs_int8_gemm
def test_an_int8_linear_holds_its_weight_once_whatever_the_row_count() -> None:
    # One layout serves 1 and 64 rows; another path's layout is made only when asked for,
    # from the one held, and gives the same product.
    g = torch.Generator().manual_seed(5)
    linear = W8A8Linear(*quantize_gemm_weight(torch.randn(96, 64, generator=g)))
    one, many = torch.randn(1, 64, generator=g), torch.randn(64, 64, generator=g)
    one_out, many_out = linear(one), linear(many)
    assert linear.weight_layouts == 1
    assert torch.equal(linear.plain(one), one_out) and torch.equal(linear.general(many), many_out)
    assert linear.weight_layouts == (2 if int8_path() in (PLAIN, PACKED) else 3)


def test_signed_and_unsigned_activation_levels_are_the_same_levels() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    signed, s1 = quantize_rows_int8(x)
    unsigned, s2 = quantize_rows_uint8(x)
    # row max 2: scale 2/127; 1 -> 63.5 -> 64 (round half to even), -2 -> -127, 0.5 -> 31.75 -> 32;
    # an all-zero row keeps the smallest normal scale and all-zero levels
    assert signed.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0]]
    assert (unsigned.int() - 128).tolist() == signed.tolist()
    assert torch.equal(s1, s2) and s1[0, 0].item() == pytest.approx(2 / 127)


@needs_int8_gemm
def test_the_plain_path_at_the_int8_extremes_is_exact() -> None:
    # Every product 127 x -L over K = 2048 (L = 127 with int8 dot products, 63 on AVX2
    # alone): the int32 sum, -33,032,192 for L = 127, must come out exact (a saturating
    # 16-bit step would not), then times both scales.
    k = 2048
    levels = gemm_weight_levels()
    weight = torch.full((3, k), -1.0)
    weight[1] = 1.0
    linear = W8A8Linear(*quantize_gemm_weight(weight))  # levels -L / L, scale 1/L
    x = torch.full((1, k), 2.0)  # levels 127, scale 2/127
    expected = np.array([-1, 1, -1]) * (127 * levels * k)  # exact in int64
    out = linear(x)
    assert torch.equal(out, linear.packed(*quantize_rows_uint8(x)))
    # 127 L k x (1/L) x (2/127) = 4096 up to float32 rounding of the scales
    np.testing.assert_allclose(out.numpy()[0], expected * (1 / levels) * (2 / 127), rtol=1e-6)
    np.testing.assert_allclose(out.numpy()[0], [-4096, 4096, -4096], rtol=1e-6)


def test_factors_by_hand() -> None:
    assert smoothing.ALPHA == 0.6  # the numbers below are for 0.6
    x_max = torch.tensor([4.0, 1.0, 0.0])
    w = torch.tensor([[1.0, -4.0, 0.0], [0.5, 2.0, 0.0]])  # column maxima 1, 4, 0
    # 4^0.6 / 1^0.4 = e^(0.6 ln 4) = 2.29740; 1^0.6 / 4^0.4 = 1 / e^(0.4 ln 4) = 0.574349;
    # a silent column meets the floor on both sides: (1e-5)^0.6 / (1e-5)^0.4 = (1e-5)^0.2 = 0.1
    assert smoothing.factors(x_max, w).tolist() == pytest.approx([2.29740, 0.574349, 0.1], rel=1e-4)


def test_factors_give_back_each_block_of_rows_once_read() -> None:
    # A mapped head's pages go back block by block as its column maxima are taken (the load's peak).
    rows = 2 * smoothing.QUANTIZE_BLOCK_ROWS + 3
    w = torch.zeros(rows, 4)
    w[rows - 1] = torch.tensor([1.0, -2.0, 0.5, 0.0])  # the maxima sit in the last, partial block
    done: list[tuple[int, int]] = []
    got = smoothing.factors(torch.ones(4), w, 0.5, block_done=lambda a, b: done.append((a, b)))
    block = smoothing.QUANTIZE_BLOCK_ROWS
    assert done == [(0, block), (block, 2 * block), (2 * block, rows)]
    # 1^0.5 / max^0.5 per column; the silent column meets the floor: 1 / (1e-5)^0.5
    assert got.tolist() == pytest.approx([1.0, 2 ** -0.5, 2 ** 0.5, 1e-5 ** -0.5], rel=1e-6)


def test_folding_into_a_bfloat16_norm_returns_the_factor_it_really_applies() -> None:
    norm = torch.tensor([1.0, 3.0, 0.0], dtype=torch.bfloat16)
    applied = smoothing._fold_into_norm(norm, torch.tensor([3.0, 2.0, 5.0]))
    # 1/3 rounds to bf16 1.0101011b x 2^-2 = 0.333984375; 3/2 is exact; 0 stays 0
    assert norm.tolist() == [0.333984375, 1.5, 0.0]
    assert applied.tolist() == pytest.approx([1 / 0.333984375, 2.0, 1.0], rel=1e-7)


def _hidden(model, ids: list[list[int]]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Final hidden states of `ids` (sequences end to end, each attending to itself)."""
    lengths = [len(s) for s in ids]
    backend = smoothing._SequencesAttention(lengths, model.cfg.attn_scale, model.cfg.attn_softcap,
                                            torch.device("cpu"))
    flat = torch.tensor([t for s in ids for t in s])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.inference_mode():
        return model.forward(flat, positions, max(lengths), backend)


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_smoothed_weights_compute_the_same_function(kind: str) -> None:
    model = load_model(hf_tiny.tiny_model_dir(kind), "cpu", torch.float32, "none")
    model.build_linears(release_weights=False)
    prompts = hf_tiny.random_prompts(3, 5, 30, seed=4)
    before = _hidden(model, prompts)
    logits_before = before @ model.lm_head.t()
    smoothed = smoothing.smooth(model, smoothing.calibration_sequences(toy_encode, None))
    layers = smoothed.layers
    spread = max(float(f.max() / f.min()) for s in layers for f in s)
    assert spread > 2  # the factors are far from uniform, so a wrong fold would show
    assert float((smoothed.head - 1).abs().max()) > 0.5  # the head's too: far from 1, a missed fold would show
    linears = []
    for w, s in zip(model.layers, layers):
        made = {}
        for name, source in smoothed_weights(w, s).items():
            made[name], made[name + "_residual"], _ = make_linear(*source())
        linears.append(LayerLinears(**{f: made[f] for f in LayerLinears._fields}))
    model._linears = linears
    after = _hidden(model, prompts)
    # The final norm now divides by the head's factors, which its weight's columns take.
    torch.testing.assert_close(after * smoothed.head, before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after @ (model.lm_head * smoothed.head).t(), logits_before, rtol=1e-4, atol=1e-4)


@needs_int8_gemm
def test_int8_loads_quantize_the_layers_only_when_asked_and_calibratable() -> None:
    folder = hf_tiny.tiny_model_dir("gemma3")

    def layers_int8(quantization: str, encode=toy_encode) -> bool:  # type: ignore[no-untyped-def]
        return load_model(folder, "cpu", torch.float32, quantization, encode=encode).int8_layers

    assert layers_int8("int8")
    assert not layers_int8("int8-head")
    assert not layers_int8("none")
    assert not (folder / "tokenizer.json").exists()
    assert not layers_int8("int8", encode=None)  # nothing to calibrate with: the layers stay float


@needs_int8_gemm
def test_int8_layers_stay_close_to_float32_on_a_tiny_model() -> None:
    folder = hf_tiny.tiny_model_dir("gemma3")
    prompts = hf_tiny.random_prompts(3, 5, 30, seed=5)
    exact = load_model(folder, "cpu", torch.float32, "none")
    quantized = load_model(folder, "cpu", torch.float32, "int8", encode=toy_encode)
    # Logits, not hidden states: the final norm of the int8 model carries its head's smoothing.
    a, b = exact.logits(_hidden(exact, prompts)), quantized.logits(_hidden(quantized, prompts))
    cosine = F.cosine_similarity(a.float(), b.float(), dim=-1)
    assert float(cosine.min()) > 0.99, cosine
    assert not torch.equal(a, b)  # the layers really are quantized
    assert math.isfinite(float(b.abs().max()))


class _DtypeRecorder:
    """Wraps a backend and records the dtypes attention receives (what the KV cache stores)."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.seen: set[torch.dtype] = set()

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        self.seen |= {q.dtype, kv.dtype}
        return self.inner.attention(layer_idx, q, kv)


@needs_int8_gemm
def test_bfloat16_int8_layers_keep_float32_activations_and_bfloat16_kv() -> None:
    folder = hf_tiny.tiny_model_dir("gemma3")
    prompts = hf_tiny.random_prompts(3, 5, 30, seed=6)
    model = load_model(folder, "cpu", torch.bfloat16, "int8", encode=toy_encode)
    assert model.int8_layers
    lengths = [len(s) for s in prompts]
    backend = _DtypeRecorder(smoothing._SequencesAttention(lengths, model.cfg.attn_scale, model.cfg.attn_softcap,
                                                           torch.device("cpu")))
    with torch.inference_mode():
        hidden = model.forward(torch.tensor([t for s in prompts for t in s]),
                               torch.cat([torch.arange(n) for n in lengths]), max(lengths), backend)
    assert hidden.dtype == torch.float32  # never rounded to bfloat16 between the layers
    assert backend.seen == {torch.bfloat16}  # K/V (and q) in the cache's dtype, the model's
    # The element-wise operands went float32 with their values (bf16 values are float32 values).
    assert {w.input_norm.dtype for w in model.layers} == {torch.float32}
    assert all(t.cos.dtype == torch.float32 for t in model._rope.values())
    # and the model stays close to its float32 original (in logits: the final norm carries the head's smoothing)
    exact_model = load_model(folder, "cpu", torch.float32, "none")
    exact = exact_model.logits(_hidden(exact_model, prompts))
    assert float(F.cosine_similarity(model.logits(hidden).float(), exact, dim=-1).min()) > 0.99


_AVX2_SUMS = """
import json, torch
from hybridserve.models.layers.int8 import W8A8Linear, int8_path, quantize_int8_rows
g = torch.Generator().manual_seed(0)
sign = lambda *shape: torch.randint(0, 2, shape, generator=g).float() * 2 - 1
x = 127 * sign(16, 640)  # every activation at an extreme: levels +-127 (uint8 1 and 255), scale 1
exact = {}
for levels in (63, 127):
    w = levels * sign(96, 640)  # every weight at +-levels: scale 1
    linear = W8A8Linear(*quantize_int8_rows(w, levels))
    layouts_at_build = linear.weight_layouts
    product = x.double() @ w.double().t()  # integers below 2^24: exact in float32 too
    exact[levels] = [torch.equal(linear.general(x).double(), product),
                     torch.equal(linear.plain(x).double(), product),
                     torch.equal(linear.fbgemm(x).double(), product)]
print(json.dumps({"exact": exact, "path": int8_path(), "layouts_at_build": layouts_at_build}))
"""


@needs_int8_gemm
def test_narrow_weights_keep_avx2_int8_sums_exact() -> None:
    # oneDNN limited to AVX2 multiplies u8 x s8 with vpmaddubsw (pairs summed into int16,
    # saturating). Activations at 1 / 255 times weights at +-63: every pair within
    # 2 x 255 x 63 = 32,130, so both paths' sums are exact; at +-127 pairs reach 64,770 and
    # saturate, which shows the ISA limit was in force (with VNNI both would be exact).
    # fbgemm (limited by FBGEMM_ENABLE_INSTRUCTIONS) behaves the same. The process runs as
    # an AVX2 CPU would (as_avx2_env), so fbgemm alone serves there and the plain weight
    # rows are not kept: general and plain run on rows unpacked from fbgemm's copy.
    env = {**os.environ, **as_avx2_env(read_cpu_flags())}
    out = subprocess.run([sys.executable, "-c", _AVX2_SUMS], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["exact"]["63"] == [True, True, True]
    # Past the bound the u8 x s8 kernels (oneDNN packed, fbgemm: vpmaddubsw) saturate.
    # torch._int_mm is left out: on a real AVX2-only CPU (AMD Zen 1) oneDNN ran it on a
    # kernel that stayed exact at 127, on the Zen 5 limited to AVX2 one that saturated.
    packed_exact, _, fbgemm_exact = report["exact"]["127"]
    assert not packed_exact and not fbgemm_exact
    assert report["path"] == FBGEMM and report["layouts_at_build"] == 1


@needs_int8_gemm
def test_a_smoothed_int8_head_errs_less_on_an_outlier_channel() -> None:
    # One input channel 100x the others, as the final norm's output has: quantized per row
    # as it is, it flattens the rest to a few levels; divided by the factors (the final norm
    # does so) with the weight's columns multiplied by them, the head's product is the same
    # function with a flatter input.
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(4096, 64, generator=g) * 0.05
    x = torch.randn(16, 64, generator=g)
    x[:, 5] *= 100
    exact = x @ weight.t()
    s = smoothing.factors(x.abs().amax(dim=0), weight, smoothing.head_alpha())
    plain = OutputHead(weight, "int8")(x)
    smoothed = OutputHead(weight, "int8", column_factors=s)(x / s)
    plain_err, smoothed_err = float((plain - exact).abs().mean()), float((smoothed - exact).abs().mean())
    assert smoothed_err < plain_err / 2, (plain_err, smoothed_err)


def test_the_heads_share_follows_the_gemms_weight_levels(monkeypatch) -> None:
    # 127 levels (int8 dot products) keep the share chosen there; 63 (AVX2 alone) take the
    # smaller one measured for them.
    monkeypatch.setattr(smoothing, "gemm_weight_levels", lambda: 127)
    assert smoothing.head_alpha() == 0.5
    monkeypatch.setattr(smoothing, "gemm_weight_levels", lambda: 63)
    assert smoothing.head_alpha() == 0.2


def test_column_factors_are_refused_by_a_head_that_is_not_int8_x_int8() -> None:
    with pytest.raises(ConfigError, match="int8 x int8 head only"):
        OutputHead(torch.randn(64, 16), "none", column_factors=torch.ones(16))
