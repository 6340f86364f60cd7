"""qk_norm_rope: the native q/k RMSNorm + RoPE of bf16 decoders gives a head worked out by
hand, the eager chain with exact sums bit for bit on every shape its loops treat apart, and
a tiny Gemma 3's step the eager loop's hidden states bit for bit; its float32 form (the
decode stack's on CPUs without native bf16) a head by hand and the eager float32 chain to a
float32 rounding; it refuses what it does not read, and a kernel that disagrees is not used
(models/layers/qk_norm_rope.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.layers.kernel_checks import float32_close  # noqa: E402
from hybridserve.models.layers.qk_norm_rope import QKNormRope, qk_norm_rope_eager, qk_norm_rope_kernel  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.int8_gemma3 import LENGTHS  # noqa: E402
from tests.helpers.native_kernels import check_refused, step_with_and_without  # noqa: E402

KERNEL = qk_norm_rope_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is not built")
EPS = torch.tensor(1e-6, dtype=torch.bfloat16)


@needs_kernel
def test_a_head_by_hand() -> None:
    """x = +2 on its first half, -2 on its second: mean square 4, so x / rms = +-1 (eps moves
    it by 1e-7, below bf16's rounding); times the weight 3: +-3. RoPE with cos 0.5 and signed
    sin [-1, +1]: first half 3 * 0.5 + (-3) * (-1) = 4.5, second half -3 * 0.5 + 3 * 1 = 1.5."""
    hd = 4 * KERNEL.lanes
    half = hd // 2
    x = torch.cat([torch.full((half,), 2.0), torch.full((half,), -2.0)]).to(torch.bfloat16).view(1, 1, hd)
    weight = torch.full((1, hd), 3.0, dtype=torch.bfloat16)
    cos = torch.full((1, 1, hd), 0.5, dtype=torch.bfloat16)
    sin = torch.cat([torch.full((half,), -1.0), torch.full((half,), 1.0)]).to(torch.bfloat16).view(1, 1, hd)
    KERNEL(x, weight, EPS, cos, sin)
    assert x.view(-1).tolist() == [4.5] * half + [1.5] * half
    y = torch.cat([torch.full((half,), 2.0), torch.full((half,), -2.0)]).to(torch.bfloat16).view(1, 1, hd)
    KERNEL(y, weight, EPS, None, None)  # no RoPE (EXAONE 4's full layers)
    assert y.view(-1).tolist() == [3.0] * half + [-3.0] * half
    # RoPE alone (layers without a q/k norm): +-2 rotated: 2 * 0.5 + (-2) * (-1) = 3, -2 * 0.5 + 2 * 1 = 1
    z = torch.cat([torch.full((half,), 2.0), torch.full((half,), -2.0)]).to(torch.bfloat16).view(1, 1, hd)
    assert KERNEL.supports(z, None, cos) and not KERNEL.supports(z, None, None)  # nothing to do without either
    KERNEL(z, None, EPS, cos, sin)
    assert z.view(-1).tolist() == [3.0] * half + [1.0] * half


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 40])  # 40 rows x 5 heads: the parallel loop
@pytest.mark.parametrize("heads, hd", [(1, 16), (5, 256), (3, 64), (2, 128)])
@pytest.mark.parametrize("rope, norm", [(True, True), (False, True), (True, False)])
def test_equals_the_eager_chain_bit_for_bit(rows: int, heads: int, hd: int, rope: bool, norm: bool) -> None:
    if hd % KERNEL.lanes:
        pytest.skip(f"head dim {hd} is not whole vectors of {KERNEL.lanes}")
    g = torch.Generator().manual_seed(rows * 100 + heads * 10 + hd)
    # rows of the qkv projection: these heads, then more (v), at magnitudes 1e-3 .. 1e3
    scale = 10.0 ** torch.randint(-3, 4, (rows, 1), generator=g).float()
    qkv = (torch.randn(rows, (heads + 2) * hd, generator=g) * scale).to(torch.bfloat16)
    weight = (1 + torch.randn(heads, hd, generator=g)).to(torch.bfloat16) if norm else None
    angles = torch.randn(rows, 1, hd, generator=g) * 50
    cos, sin = (angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)) if rope else (None, None)
    want = qkv.clone()
    qk_norm_rope_eager(want[:, : heads * hd].view(rows, heads, hd), weight, EPS, cos, sin)
    got = qkv.clone()
    view = got[:, : heads * hd].view(rows, heads, hd)
    assert KERNEL.supports(view, weight, cos)
    KERNEL(view, weight, EPS, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(got[:, heads * hd :], qkv[:, heads * hd :])  # the rest of each row untouched


@needs_kernel
def test_a_float32_head_by_hand() -> None:
    """The bf16 head above in float32 with eps 0, where every step is exact: mean square 4,
    x / 2 * 3 = +-3, rotated 3 * 0.5 + (-3) * (-1) = 4.5 and -3 * 0.5 + 3 * 1 = 1.5; RoPE
    alone 3 and 1; the norm alone +-3."""
    hd = 4 * KERNEL.lanes
    half = hd // 2
    zero = torch.tensor(0.0)

    def head() -> torch.Tensor:
        return torch.cat([torch.full((half,), 2.0), torch.full((half,), -2.0)]).view(1, 1, hd)

    weight = torch.full((1, hd), 3.0)
    cos = torch.full((1, 1, hd), 0.5)
    sin = torch.cat([torch.full((half,), -1.0), torch.full((half,), 1.0)]).view(1, 1, hd)
    for w, (c, s), want in ((weight, (cos, sin), [4.5, 1.5]), (weight, (None, None), [3.0, -3.0]),
                            (None, (cos, sin), [3.0, 1.0])):
        x = head()
        assert KERNEL.supports(x, w, c)
        KERNEL(x, w, zero, c, s)
        assert x.view(-1).tolist() == [want[0]] * half + [want[1]] * half


@needs_kernel
@pytest.mark.parametrize("rows", [1, 40])  # 40 rows x 5 heads: the parallel loop
@pytest.mark.parametrize("heads, hd", [(5, 256), (2, 128)])
@pytest.mark.parametrize("rope, norm", [(True, True), (False, True), (True, False)])
def test_float32_equals_the_eager_chain_to_rounding(rows: int, heads: int, hd: int, rope: bool, norm: bool) -> None:
    if hd % (2 * KERNEL.lanes):
        pytest.skip(f"head dim {hd} is not whole vectors of {KERNEL.lanes} per half")
    g = torch.Generator().manual_seed(rows * 100 + heads * 10 + hd)
    scale = 10.0 ** torch.randint(-3, 4, (rows, 1), generator=g).float()
    qkv = torch.randn(rows, (heads + 2) * hd, generator=g) * scale
    weight = 1 + torch.randn(heads, hd, generator=g) if norm else None
    angles = torch.randn(rows, 1, hd, generator=g) * 50
    cos, sin = (angles.cos(), angles.sin()) if rope else (None, None)
    eps = EPS.float()
    want = qkv.clone()
    qk_norm_rope_eager(want[:, : heads * hd].view(rows, heads, hd), weight, eps, cos, sin)
    got = qkv.clone()
    view = got[:, : heads * hd].view(rows, heads, hd)
    assert KERNEL.supports(view, weight, cos)
    KERNEL(view, weight, eps, cos, sin)
    for r in range(rows):  # each row against its own scale
        assert float32_close(got[r, : heads * hd], want[r, : heads * hd])
    assert torch.equal(got[:, heads * hd :], qkv[:, heads * hd :])


@needs_kernel
def test_subnormal_values_round_as_the_eager_chain() -> None:
    """A q/k weight of 2^-130 on some lanes makes the normalised values there subnormal
    (below 2^-126), and RoPE rounds those again: where the build rounds with AVX512-BF16's
    conversion (which flushes subnormal inputs), they must still round as torch does."""
    rows, heads, hd = 4, 3, 4 * KERNEL.lanes
    g = torch.Generator().manual_seed(9)
    qk = (torch.randn(rows, heads, hd, generator=g) * 5).to(torch.bfloat16)
    lanes = torch.arange(heads * hd).view(heads, hd)
    weight = torch.where(lanes % 3 == 0, torch.tensor(2.0**-130), 1 + torch.randn(heads, hd, generator=g))
    weight = weight.to(torch.bfloat16)
    angles = torch.randn(rows, 1, hd, generator=g) * 50
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    for rope in ((cos, sin), (None, None)):  # with RoPE the subnormals are its inputs, without they are the output
        want = qk.clone()
        qk_norm_rope_eager(want, weight, EPS, *rope)
        assert rope[0] is not None or (want.float().abs() < 2.0**-126).logical_and(want != 0).any()
        got = qk.clone()
        KERNEL(got, weight, EPS, *rope)
        assert torch.equal(got, want)


@needs_kernel
def test_supports_only_what_it_reads() -> None:
    hd = 4 * KERNEL.lanes
    qk = torch.zeros(2, 3, hd, dtype=torch.bfloat16)
    weight = torch.ones(3, hd, dtype=torch.bfloat16)
    assert KERNEL.supports(qk, weight, None)
    assert not KERNEL.supports(qk.float(), weight, None)
    assert not KERNEL.supports(qk, weight.float(), None)
    assert not KERNEL.supports(qk, weight[:2], None)
    assert not KERNEL.supports(qk.transpose(0, 1), weight.view(3, hd)[:, :], None)  # heads not in rows
    assert not KERNEL.supports(torch.zeros(2, 3, hd + 2, dtype=torch.bfloat16),
                               torch.ones(3, hd + 2, dtype=torch.bfloat16), None)
    assert not KERNEL.supports(qk, weight, torch.zeros(2, 1, hd))  # float32 tables
    assert KERNEL.supports(qk.float(), weight.float(), torch.zeros(2, 1, hd))  # all float32
    assert not KERNEL.supports(qk.float(), weight.float(), torch.zeros(2, 1, hd, dtype=torch.bfloat16))
    one = KERNEL.lanes  # a head of one vector: bf16 takes it, float32 reads each half in whole vectors
    assert KERNEL.supports(torch.zeros(2, 3, one, dtype=torch.bfloat16), torch.ones(3, one, dtype=torch.bfloat16), None)
    assert not KERNEL.supports(torch.zeros(2, 3, one), torch.ones(3, one), None)


@needs_kernel
def test_a_tiny_gemma_step_equals_the_eager_loop_bit_for_bit(monkeypatch) -> None:
    """A step of 128+ rows without the compiler: the eager loop normalises with exact sums
    there, so the kernel's step and the eager chain's are the same hidden states."""
    model = load_model(hf_tiny.tiny_model_dir("gemma3"), "cpu", torch.bfloat16, "none", compile=False)
    calls, with_kernel, general = step_with_and_without(monkeypatch, model, LENGTHS, QKNormRope, "qk_norm_rope_kernel")
    assert calls == model.cfg.num_layers
    assert torch.equal(with_kernel, general)


@needs_kernel
def test_a_kernel_that_disagrees_is_not_used(monkeypatch, caplog) -> None:
    def off_by_a_bit(real, self, qk, *args):  # type: ignore[no-untyped-def]
        real(self, qk, *args)
        qk[0, 0, 0] = qk[0, 0, 0] * 2

    check_refused(monkeypatch, caplog, QKNormRope, qk_norm_rope_kernel, off_by_a_bit, "differs from the eager chain")
