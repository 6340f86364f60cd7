"""residual_norms: a sandwich-norm decoder's residual add and next RMSNorm in one native pass
gives rows worked out by hand, the eager chain with exact sums bit for bit on every shape
its loops treat apart, and tiny decoders' steps the eager loop's hidden states bit for bit
(sandwich norms, post-norms); its float32 form (the decode stack's on CPUs without native
bf16) rows by hand and the eager float32 chain to a float32 rounding; it refuses what it
does not read, and a kernel that disagrees is not used (models/layers/residual_norms.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.arch import decoder as decoder_module  # noqa: E402
from hybridserve.models.layers.kernel_checks import float32_close  # noqa: E402
from hybridserve.models.layers.residual_norms import (  # noqa: E402
    ResidualNorms,
    residual_norms_eager,
    residual_norms_kernel,
)
from hybridserve.models.layers.rms_norm import rms_norm  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.int8_gemma3 import LENGTHS, prefill  # noqa: E402
from tests.helpers.native_kernels import check_refused  # noqa: E402

KERNEL = residual_norms_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is not built")
EPS = torch.tensor(1e-6, dtype=torch.bfloat16)


@needs_kernel
def test_a_row_by_hand() -> None:
    """y = +2 on its first half, -2 on its second: rms 2, so y / rms * 1 = +-1 (eps moves it
    by 1e-7, below bf16's rounding). h = 0 | 8 gives h' = 1 | 7, whose mean square is 25:
    h' / 5 * 5 = 1 | 7 again."""
    half = 4 * KERNEL.lanes
    y = torch.cat([torch.full((half,), 2.0), torch.full((half,), -2.0)]).to(torch.bfloat16).view(1, -1)
    h = torch.cat([torch.zeros(half), torch.full((half,), 8.0)]).to(torch.bfloat16).view(1, -1)
    ones, fives = torch.ones(2 * half, dtype=torch.bfloat16), torch.full((2 * half,), 5.0, dtype=torch.bfloat16)
    h_new, x = KERNEL(h, y, ones, fives, EPS)
    assert h_new.view(-1).tolist() == [1.0] * half + [7.0] * half
    assert x.view(-1).tolist() == [1.0] * half + [7.0] * half
    h_only, none = KERNEL(h, y, ones, None, EPS)
    assert none is None and torch.equal(h_only, h_new)
    # the norm alone (pre-norm layers): h' = 1 | 7 again
    assert KERNEL.norm(h_new, fives, EPS).view(-1).tolist() == [1.0] * half + [7.0] * half


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 40])  # 40 rows: the parallel loop
@pytest.mark.parametrize("dim", [16, 640, 1152])
@pytest.mark.parametrize("second", [True, False])
def test_equals_the_eager_chain_bit_for_bit(rows: int, dim: int, second: bool) -> None:
    if dim % KERNEL.lanes:
        pytest.skip(f"width {dim} is not whole vectors of {KERNEL.lanes}")
    g = torch.Generator().manual_seed(rows * 10 + dim)
    scale = 10.0 ** torch.randint(-3, 4, (rows, 1), generator=g).float()  # magnitudes 1e-3 .. 1e3
    h = (torch.randn(rows, dim, generator=g) * scale).to(torch.bfloat16)
    wide = (torch.randn(rows, dim + 8, generator=g) * 40).to(torch.bfloat16)
    y = wide[:, :dim]  # rows further apart than their width, as a slice of a wider output
    w1, w2 = ((1 + torch.randn(dim, generator=g)).to(torch.bfloat16) for _ in range(2))
    w2 = w2 if second else None
    assert KERNEL.supports(h, y, w1, w2)
    want_h, want_x = residual_norms_eager(h, y, w1, w2, EPS)
    got_h, got_x = KERNEL(h, y, w1, w2, EPS)
    assert torch.equal(got_h, want_h)
    assert (got_x is None) == (not second) and (got_x is None or torch.equal(got_x, want_x))
    assert KERNEL.supports_norm(y, w1)
    assert torch.equal(KERNEL.norm(y, w1, EPS), rms_norm(y, w1, EPS, 1.0 / dim, exact_sums=True))


@needs_kernel
def test_a_float32_row_by_hand() -> None:
    """The bf16 row above in float32 with eps 0, every step exact: y / 2 = +-1, h' = 1 | 7,
    mean square 25, h' / 5 * 5 = 1 | 7."""
    half = 4 * KERNEL.lanes
    zero = torch.tensor(0.0)
    y = torch.cat([torch.full((half,), 2.0), torch.full((half,), -2.0)]).view(1, -1)
    h = torch.cat([torch.zeros(half), torch.full((half,), 8.0)]).view(1, -1)
    ones, fives = torch.ones(2 * half), torch.full((2 * half,), 5.0)
    assert KERNEL.supports(h, y, ones, fives)
    h_new, x = KERNEL(h, y, ones, fives, zero)
    assert x is not None and h_new.dtype == x.dtype == torch.float32
    assert h_new.view(-1).tolist() == x.view(-1).tolist() == [1.0] * half + [7.0] * half
    assert KERNEL.norm(h_new, fives, zero).view(-1).tolist() == [1.0] * half + [7.0] * half


@needs_kernel
@pytest.mark.parametrize("rows", [1, 40])  # 40 rows: the parallel loop
@pytest.mark.parametrize("dim", [640, 1152])
def test_float32_equals_the_eager_chain_to_rounding(rows: int, dim: int) -> None:
    if dim % KERNEL.lanes:
        pytest.skip(f"width {dim} is not whole vectors of {KERNEL.lanes}")
    g = torch.Generator().manual_seed(rows * 10 + dim)
    scale = 10.0 ** torch.randint(-3, 4, (rows, 1), generator=g).float()
    h = torch.randn(rows, dim, generator=g) * scale
    y = (torch.randn(rows, dim + 8, generator=g) * 40)[:, :dim]
    w1, w2 = (1 + torch.randn(dim, generator=g) for _ in range(2))
    eps = EPS.float()
    want_h, want_x = residual_norms_eager(h, y, w1, w2, eps)
    got_h, got_x = KERNEL(h, y, w1, w2, eps)
    assert got_x is not None and want_x is not None
    for r in range(rows):  # each row against its own scale
        assert float32_close(got_h[r], want_h[r]) and float32_close(got_x[r], want_x[r])
        assert float32_close(KERNEL.norm(y, w1, eps)[r], rms_norm(y, w1, eps, 1.0 / dim, exact_sums=True)[r])


@needs_kernel
def test_subnormal_values_round_as_the_eager_chain() -> None:
    """Outputs and inputs below float32's smallest normal (2^-126): a weight of 2^-130 makes
    y's normalised values x 2^-130 subnormal, and h holds subnormals too. Where the build
    rounds with AVX512-BF16's conversion, which flushes subnormal inputs to zero, those
    lanes must still round as torch does (native_vectors.h)."""
    dim, rows = 4 * KERNEL.lanes, 8
    g = torch.Generator().manual_seed(5)
    y = (torch.randn(rows, dim, generator=g) * 3).to(torch.bfloat16)
    h = (torch.randn(rows, dim, generator=g) * 2.0**-128).to(torch.bfloat16)  # subnormal and normal values
    h[::2] = (torch.randn(rows // 2, dim, generator=g) * 4).to(torch.bfloat16)  # every other row: normal
    tiny = torch.full((dim,), 2.0**-130, dtype=torch.bfloat16)
    w1 = torch.where(torch.arange(dim) % 3 == 0, tiny, (1 + torch.randn(dim, generator=g)).to(torch.bfloat16))
    w2 = torch.where(torch.arange(dim) % 5 == 0, tiny, torch.ones(dim, dtype=torch.bfloat16))
    want_h, want_x = residual_norms_eager(h, y, w1, w2, EPS)
    assert (want_h.float().abs() < 2.0**-126).logical_and(want_h != 0).sum() > dim  # subnormal results made
    assert (want_x.float().abs() < 2.0**-126).logical_and(want_x != 0).any()
    got_h, got_x = KERNEL(h, y, w1, w2, EPS)
    assert torch.equal(got_h, want_h) and torch.equal(got_x, want_x)


@needs_kernel
def test_supports_only_what_it_reads() -> None:
    dim = 4 * KERNEL.lanes
    h, y = torch.zeros(2, dim, dtype=torch.bfloat16), torch.zeros(2, dim, dtype=torch.bfloat16)
    w = torch.ones(dim, dtype=torch.bfloat16)
    assert KERNEL.supports(h, y, w, None) and KERNEL.supports(h, y, w, w)
    assert not KERNEL.supports(h.float(), y, w, None)
    assert not KERNEL.supports(h, y.float(), w, None)
    assert not KERNEL.supports(h, y, w.float(), None)
    assert KERNEL.supports(h.float(), y.float(), w.float(), w.float())  # all float32
    assert not KERNEL.supports(h, y, w, w[: dim // 2])
    assert not KERNEL.supports(h, torch.zeros(dim, 2, dtype=torch.bfloat16).t(), w, None)  # columns strided
    odd = torch.zeros(2, dim + 2, dtype=torch.bfloat16)
    assert not KERNEL.supports(odd, odd, torch.ones(dim + 2, dtype=torch.bfloat16), None)


@needs_kernel
@pytest.mark.parametrize("kind, calls_per_layer", [("gemma3", 2), ("olmo3", 2)])  # sandwich; post-norms
def test_a_tiny_decoder_step_equals_the_eager_loop_bit_for_bit(kind: str, calls_per_layer: int, monkeypatch) -> None:
    """A step without the kernel, its norms taken with exact sums (as the kernel takes them;
    the eager loop does so itself at 128+ rows where compiled chains may serve), gives the
    kernel's step's hidden states bit for bit."""
    model = load_model(hf_tiny.tiny_model_dir(kind), "cpu", torch.bfloat16, "none", compile=False)
    calls = []
    real = ResidualNorms.__call__
    monkeypatch.setattr(ResidualNorms, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    with_kernel = prefill(model, LENGTHS)
    assert len(calls) == calls_per_layer * model.cfg.num_layers
    monkeypatch.setattr(decoder_module, "residual_norms_kernel", lambda: None)
    exact = decoder_module.rms_norm
    monkeypatch.setattr(decoder_module, "rms_norm", lambda *a, exact_sums=False: exact(*a, exact_sums=True))
    assert torch.equal(with_kernel, prefill(model, LENGTHS))


@needs_kernel
@pytest.mark.parametrize("lengths", [[20, 30], LENGTHS])  # forward's eager loop; a large step
def test_a_pre_norm_step_takes_the_norm_alone_bit_for_bit(lengths: list[int], monkeypatch) -> None:
    """Mistral's layers (pre-norm: the matmuls make the residual adds) take the kernel's norm
    twice a layer, and the final norm once; without it, the eager norms with exact sums give
    the same hidden states."""
    model = load_model(hf_tiny.tiny_model_dir("mistral"), "cpu", torch.bfloat16, "none", compile=False)
    calls = []
    real = ResidualNorms.norm
    monkeypatch.setattr(ResidualNorms, "norm", lambda self, *a: calls.append(1) or real(self, *a))
    with_kernel = prefill(model, lengths)
    assert len(calls) == 2 * model.cfg.num_layers + 1
    monkeypatch.setattr(decoder_module, "residual_norms_kernel", lambda: None)
    exact = decoder_module.rms_norm
    monkeypatch.setattr(decoder_module, "rms_norm", lambda *a, exact_sums=False: exact(*a, exact_sums=True))
    assert torch.equal(with_kernel, prefill(model, lengths))


@needs_kernel
def test_a_kernel_that_disagrees_is_not_used(monkeypatch, caplog) -> None:
    def off_by_a_bit(real, self, *args):  # type: ignore[no-untyped-def]
        h, x = real(self, *args)
        h[0, 0] = h[0, 0] * 2
        return h, x

    check_refused(monkeypatch, caplog, ResidualNorms, residual_norms_kernel, off_by_a_bit,
                  "differs from the eager chain")


@needs_kernel
def test_a_compiled_large_step_equals_its_chains_alone(monkeypatch) -> None:
    """A step the compiled chains take hands q/k norm + RoPE and the sandwich adds to the
    native kernels: the hidden states equal the compiled chains' own bit for bit."""
    model = load_model(hf_tiny.tiny_model_dir("gemma3"), "cpu", torch.bfloat16, "none", compile=True)
    calls = []
    real = ResidualNorms.__call__
    monkeypatch.setattr(ResidualNorms, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    with_kernels = prefill(model, LENGTHS)
    assert model._dtype_chains._compiled is not None  # the step took the compiled chains
    assert len(calls) == 2 * model.cfg.num_layers
    monkeypatch.setattr(decoder_module, "residual_norms_kernel", lambda: None)
    monkeypatch.setattr(decoder_module, "qk_norm_rope_kernel", lambda: None)
    assert torch.equal(with_kernels, prefill(model, LENGTHS))
