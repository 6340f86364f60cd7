"""act_mul: a gated MLP's act(gate) * up read from a table of the activation's values gives
products worked out by hand (the bf16 rounding of a tie included), the eager activation and
multiply bit for bit for every bf16 gate under each activation the decoders use, and tiny
decoders' steps the eager loop's hidden states bit for bit; its float32 form computes SiLU and
the tanh GELU to a few float32 roundings of values worked out by hand, in place over the gate
half or into strided rows alike; a model whose chains the native
kernels all take compiles nothing for its large steps; the kernel refuses what it does not
read, and one that disagrees is not used (models/layers/act_mul.py)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hybridserve.models.arch import decoder_chains  # noqa: E402
from hybridserve.models.layers.act_mul import (  # noqa: E402
    COMPUTED,
    ActMul,
    act_mul_eager,
    act_mul_kernel,
    every_bf16,
    gate_half,
    same_values,
)
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.int8_gemma3 import LENGTHS, prefill  # noqa: E402
from tests.helpers.native_kernels import check_refused, step_with_and_without  # noqa: E402

KERNEL = act_mul_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is not built")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@needs_kernel
def test_products_by_hand() -> None:
    """With the identity as the activation, out = bf16(gate * up), worked out by hand:
    1.0078125 * 1.5 = 1.51171875 lies halfway between the bf16 neighbours 1.5078125 (odd last
    bit) and 1.515625 (even): ties go to even; 1.0078125^2 = 1.01568603515625 rounds down to
    1.015625 (130 units of 2^-7); the sign and exact products pass through."""
    gate = torch.zeros(1, 32)
    up = torch.zeros(1, 32)
    gate[0, :5] = torch.tensor([1.0078125, 1.0078125, -3.0, 2.0, 0.0])
    up[0, :5] = torch.tensor([1.5, 1.0078125, 0.5, -0.25, 7.0])
    gate_up = torch.cat((gate, up), dim=1).bfloat16()
    out = KERNEL(gate_up, KERNEL.table(_identity, 32))
    assert out.shape == (1, 32) and out.dtype == torch.bfloat16
    assert out[0, :5].float().tolist() == [1.515625, 1.015625, -1.5, -0.5, 0.0]
    assert out[0, 5:].float().abs().sum() == 0
    # written into the rows of a larger result where `out` is given, its other rows untouched
    whole = torch.full((3, 32), 9.0, dtype=torch.bfloat16)
    assert KERNEL(gate_up, KERNEL.table(_identity, 32), out=whole[1:2]).data_ptr() == whole[1].data_ptr()
    assert torch.equal(whole[1], out[0]) and bool((whole[[0, 2]] == 9.0).all())
    with pytest.raises(ValueError, match="not an output for 1 x 32 bf16 values"):
        KERNEL(gate_up, KERNEL.table(_identity, 32), out=whole[:2])


@needs_kernel
def test_the_table_holds_the_activation_of_each_bit_pattern() -> None:
    table = KERNEL.table(lambda x: x * 2, 64)
    assert table.shape == (65537,) and table.dtype == torch.bfloat16
    one, minus_three = 0x3F80, 0xC040  # bf16 bit patterns of 1.0 and -3.0
    assert table[one].item() == 2.0 and table[minus_three].item() == -6.0
    assert table[0x7F80].item() == float("inf") and table[0xFF80].item() == float("-inf")
    assert torch.equal(table[-1:].view(torch.int16), table[:1].view(torch.int16))  # the gathers' padding
    with pytest.raises(ValueError, match="float32"):
        KERNEL.table(lambda x: x.float(), 64)


@needs_kernel
@pytest.mark.parametrize("act", [F.silu, F.gelu, lambda x: F.gelu(x, approximate="tanh"),
                                 decoder_chains.gelu_tanh_by_sigmoid], ids=["silu", "gelu", "gelu_tanh", "by_sigmoid"])
@pytest.mark.parametrize("rows, width, pad", [(16, 4096, 0), (512, 128, 64), (2048, 32, 0)])
def test_every_bf16_gate_equals_the_eager_chain(act, rows: int, width: int, pad: int) -> None:
    """Every bf16 value as a gate (NaNs, infinities, subnormals), up made up: rows over and
    under the parallel threshold, widths of one or many vectors, rows further apart than
    gate|up (a view of a wider product)."""
    g = torch.Generator().manual_seed(rows)
    gate = every_bf16().view(rows, width)
    up = (torch.randn(rows, width, generator=g) * 3).bfloat16()
    wide = torch.cat((gate, up, torch.zeros(rows, pad, dtype=torch.bfloat16)), dim=1)
    gate_up = wide[:, : 2 * width]
    got = KERNEL(gate_up, KERNEL.table(act, width))
    assert same_values(got, act_mul_eager(gate_up, act))
    assert got.isnan().sum() == act_mul_eager(gate_up, act).isnan().sum() > 0


@needs_kernel
def test_float32_activations_by_hand() -> None:
    """SiLU = g * sigmoid(g): sigmoid(+-ln 3) = 3/4 and 1/4, sigmoid(0) = 1/2, so
    silu(ln 3) = 0.75 ln 3, silu(-ln 3) = -0.25 ln 3; the tanh GELU is
    0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), here from math.tanh in double, over
    gates from -6 to 6 (its negative tail, where 1 + tanh cancels, is where torch's float32
    form loses its digits). Each within 8 float32 roundings of the value; up multiplies;
    the rows' tails past whole vectors too; NaN stays NaN."""
    ln3 = math.log(3.0)
    gates = [ln3, -ln3, 0.0, 2.0, -2.0] + [x / 8 for x in range(-48, 49)] + [float("nan")]
    width = len(gates)
    gate = torch.tensor(gates, dtype=torch.float64)
    up = torch.full((width,), 2.0, dtype=torch.float64)
    gate_up = torch.cat((gate, up)).float().view(1, -1)
    g32 = gate_up[0, :width].double()  # the gates as float32 holds them
    silu = [g / (1 + math.exp(-g)) if g == g else g for g in g32.tolist()]
    assert silu[:2] == pytest.approx([0.75 * ln3, -0.25 * ln3], rel=1e-7)
    k = math.sqrt(2 / math.pi)
    gelu = [0.5 * g * (1 + math.tanh(k * (g + 0.044715 * g**3))) if g == g else g for g in g32.tolist()]
    for name, want in (("silu", silu), ("gelu_tanh", gelu)):
        got = KERNEL.computed(gate_up, name).view(-1).double()
        want_t = 2 * torch.tensor(want, dtype=torch.float64)
        assert got[-1].isnan()
        ulps = (got[:-1] - want_t[:-1]).abs() / (want_t[:-1].abs() * 2.0**-23).clamp_min(2.0**-149)
        assert float(ulps.max()) <= 8, name
    assert sorted(COMPUTED) == ["gelu_tanh", "silu"]
    with pytest.raises(ValueError, match="act_mul computes"):
        KERNEL.computed(gate_up, "gelu")  # the erf GELU is not computed
    with pytest.raises(ValueError, match="act_mul computes"):
        KERNEL.computed(gate_up.bfloat16(), "silu")


@needs_kernel
def test_float32_products_in_place_or_into_strided_rows() -> None:
    """SiLU's values by hand (silu(ln 3) = 0.75 ln 3, silu(0) = 0, silu(-ln 3) = -0.25 ln 3;
    up = 2): into the gate half itself (rows wider than the vectors, and their tail) and
    into rows of a wider buffer, the values of a fresh output bit for bit; the up half and
    the buffer's other columns untouched. An output that overlaps gate_up elsewhere is
    refused."""
    ln3 = math.log(3.0)
    width = 37  # past whole vectors on every CPU: the scalar tail too
    gates = torch.tensor([ln3, 0.0, -ln3] * 13, dtype=torch.float32)[:width]
    gate_up = torch.cat((gates, torch.full((width,), 2.0))).view(1, -1).repeat(5, 1)
    fresh = KERNEL.computed(gate_up, "silu")
    by_hand = {0: 1.5 * ln3, 1: 0.0, 2: -0.5 * ln3}
    for j in range(width):
        assert float(fresh[0, j]) == pytest.approx(by_hand[j % 3], rel=1e-6, abs=1e-7)
    in_place = gate_up.clone()
    got = KERNEL.computed(in_place, "silu", out=gate_half(in_place))
    assert got.data_ptr() == in_place.data_ptr() and got.stride() == (2 * width, 1)
    assert torch.equal(got, fresh) and bool((in_place[:, width:] == 2.0).all())
    wide = torch.full((5, width + 3), -7.0)
    KERNEL.computed(gate_up, "silu", out=wide[:, :width])
    assert torch.equal(wide[:, :width], fresh) and bool((wide[:, width:] == -7.0).all())
    with pytest.raises(ValueError, match="must be its gate half"):
        KERNEL.computed(in_place, "silu", out=in_place[:, 1 : width + 1])
    with pytest.raises(ValueError, match="not an output"):
        KERNEL.computed(gate_up, "silu", out=torch.empty(5, width, dtype=torch.float64))


def test_same_values_tells_numbers_apart_and_takes_nan_as_nan() -> None:
    a = torch.tensor([1.0, float("nan"), -0.0]).bfloat16()
    nan_other_bits = torch.tensor([0x3F80, 0x7FFF, -0x8000], dtype=torch.int16).view(torch.bfloat16)
    assert same_values(a, nan_other_bits)
    assert not same_values(a, torch.tensor([1.0, float("nan"), 0.0]).bfloat16())  # -0 is not +0
    assert not same_values(a, torch.tensor([1.0, 2.0, -0.0]).bfloat16())


@needs_kernel
def test_supports_only_what_it_reads() -> None:
    rows = torch.zeros(3, 2 * 64, dtype=torch.bfloat16)
    assert KERNEL.supports(rows)
    assert not KERNEL.supports(rows.float())
    assert not KERNEL.supports(torch.zeros(3, 2 * 48, dtype=torch.bfloat16))  # not whole vectors of torch's
    assert not KERNEL.supports(torch.zeros(2 * 64, 3, dtype=torch.bfloat16).t())  # columns strided
    assert not KERNEL.supports(torch.zeros(2 * 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not an activation table"):
        KERNEL(rows, torch.zeros(65536, dtype=torch.bfloat16))


def _tiny(kind: str, compile: bool = True):  # type: ignore[no-untyped-def]
    return load_model(hf_tiny.tiny_model_dir(kind), "cpu", torch.bfloat16, "none", compile=compile)


@needs_kernel
@pytest.mark.parametrize("kind", ["gemma3", "mistral"])  # tanh GELU, sandwich norms; SiLU, pre-norm
@pytest.mark.parametrize("lengths", [[20, 30], LENGTHS])  # forward's eager loop; a large step
def test_a_tiny_decoder_step_equals_the_eager_loop_bit_for_bit(kind: str, lengths: list[int], monkeypatch) -> None:
    model = _tiny(kind)
    calls, with_kernel, general = step_with_and_without(monkeypatch, model, lengths, ActMul, "act_mul_kernel")
    assert calls == model.cfg.num_layers
    assert torch.equal(with_kernel, general)


# Sandwich norms, q/k norms, tanh GELU; pre-norm, RoPE alone, SiLU; pre-norm with q/k/v biases.
@needs_kernel
@pytest.mark.parametrize("kind", ["gemma3", "mistral", "qwen2"])
def test_a_model_the_native_kernels_cover_compiles_nothing(kind: str, monkeypatch, caplog) -> None:
    """Each chain's work (q/k norm and / or RoPE, the residual adds and norms, act * up) goes
    to native kernels: large steps never call the compiler, and give --no-compile's hidden
    states."""
    def no_compiling(fn, options=None):  # type: ignore[no-untyped-def]
        raise AssertionError("compiled a chain")

    monkeypatch.setattr(decoder_chains, "compile_chain", no_compiling)
    model = _tiny(kind)
    if model._native_chains() != {"qk_out", "residual", "act_mul"}:
        pytest.skip("a native kernel is not built here")
    with caplog.at_level("INFO"):
        model.prepare_large_steps()
        hidden = prefill(model, LENGTHS)
    chains = model._dtype_chains._compiled
    assert chains is not None and all(getattr(chains, f"_{n}") is decoder_chains.EAGER[n] for n in decoder_chains.EAGER)
    assert "the decoder's large steps take the native kernels (nothing compiled)" in caplog.text
    assert torch.equal(hidden, prefill(_tiny(kind, compile=False), LENGTHS))


@needs_kernel
def test_a_chain_no_kernel_takes_is_compiled_alone(monkeypatch) -> None:
    monkeypatch.setattr(ActMul, "supports", staticmethod(lambda gate_up: False))
    model = _tiny("mistral")
    assert model._native_chains() == {"qk_out", "residual"}
    model.prepare_large_steps()
    chains = model._dtype_chains._compiled
    assert chains is not None and chains._act_mul is not decoder_chains.act_mul
    assert chains._residual is decoder_chains.residual and chains._qk_out is decoder_chains.qk_out
    assert torch.equal(prefill(model, LENGTHS), prefill(_tiny("mistral", compile=False), LENGTHS))


@needs_kernel
def test_a_kernel_that_disagrees_is_not_used(monkeypatch, caplog) -> None:
    def off_by_a_bit(real, self, *args):  # type: ignore[no-untyped-def]
        out = real(self, *args)
        out[0, 0] = 1.0  # act(0) * up is 0 for these activations
        return out

    check_refused(monkeypatch, caplog, ActMul, act_mul_kernel, off_by_a_bit, "differs from the eager chain")
