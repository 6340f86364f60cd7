"""int8 groups: a weight held as int8 values times a scale (plus an offset) per group, the
GGUF's blocks (models/layers/int8_groups.py). Products worked out by hand; the general path
and every kernel path against float64 products of the groups' values, for all shapes,
group sizes and row counts (hypothesis), each within what its arithmetic allows: the exact
paths (vector loop, AMX per group) to float32 sums and one rounding of the output, the
paths over bf16-rounded weights (folded AMX, expand) to bf16's rounding of each weight;
the i16 and vnni paths (inputs rounded to int16 / int8 per group) to that rounding's own
bound, worked out here, and exactly where the inputs are whole multiples of their step; q, k, v stacked with
different group sizes; which layout each weight is packed in and which path each row
count takes; bad input refused; a kernel that disagrees is not used."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.layers import int8_groups  # noqa: E402
from hybridserve.models.layers.int8_groups import (  # noqa: E402
    AMX_MIN_ROWS,
    DPBF16_MIN_ROWS,
    VNNI_MIN_ROWS,
    EXPAND_MIN_ROWS,
    EXPAND_MIN_ROWS_NO_AMX,
    EXPAND_MIN_ROWS_VNNI,
    FOLDED_MIN_ROWS,
    GroupKernel,
    GroupWeights,
    fill_pairs,
    unpack_pairs,
    zero_pairs,
    NARROW_VALUES,
    PackedLinear,
    concat_rows,
    group_kernel,
    group_linear_general,
    make_group_linear,
)
from tests.helpers.native_kernels import check_refused  # noqa: E402

KERNEL = group_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is not built")
# The paths this CPU runs: the AMX ones where the kernel found AMX.
PATHS = (["vector", "expand"] + (["exact", "folded"] if KERNEL is not None and KERNEL.amx else [])
         + (["dpbf16"] if KERNEL is not None and KERNEL.dpbf16 else [])
         + (["i16"] if KERNEL is not None and KERNEL.i16 else [])
         + (["vnni"] if KERNEL is not None and KERNEL.vnni else []))
ROUNDING_PATHS = {"i16", "vnni"}  # the inputs rounded per group, each multiplied exactly
EXACT_PATHS = {"vector", "exact", "dpbf16"}
BF16_EPS = 2.0 ** -8  # bf16's relative rounding bound (8 significant bits)


def test_the_kernel_is_built_where_a_compiler_is() -> None:
    """A kernel refused by its own check would leave every test below skipped: here it fails."""
    import shutil

    from hybridserve.models.platform.native_build import CC_ENV
    import os

    if shutil.which(os.environ.get(CC_ENV, "cc")) is not None:
        assert KERNEL is not None


def hand_groups() -> GroupWeights:
    """16 output rows of 4 weights in groups of 2; row 0 by hand, the others zero:
    values [1, -2 | 3, 4], scales [0.5 | 0.25], offsets [1 | -1], so the weights are
    [1.5, 0 | -0.25, 0]."""
    values = torch.zeros(16, 4, dtype=torch.int8)
    values[0] = torch.tensor([1, -2, 3, 4], dtype=torch.int8)
    scale = torch.zeros(16, 2)
    scale[0] = torch.tensor([0.5, 0.25])
    offset = torch.zeros(16, 2)
    offset[0] = torch.tensor([1.0, -1.0])
    return GroupWeights(values, scale, offset, 2)


def test_weights_and_products_by_hand() -> None:
    """x = [1, 2, 3, 4]: 1.5*1 + 0*2 - 0.25*3 + 0*4 = 0.75; plus bias 2 and residual -1:
    1.75 (every value exact in bf16 and float32)."""
    groups = hand_groups()
    assert groups.weight()[0].tolist() == [1.5, 0.0, -0.25, 0.0]
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    bias, residual = torch.full((16,), 2.0), torch.full((1, 16), -1.0)
    for dtype in (torch.float32, torch.bfloat16):
        out = group_linear_general(x.to(dtype), groups, bias, residual.to(dtype))
        assert out.dtype == dtype and out[0, 0].item() == 1.75 and out[0, 1:].tolist() == [1.0] * 15


@needs_kernel
@pytest.mark.parametrize("path", [p for p in PATHS if p not in ("folded", "i16", "vnni")])  # whole 32s; rounded
def test_kernel_paths_by_hand(path: str) -> None:
    groups = hand_groups()
    packed = KERNEL.pack(groups, "tiles")
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 3)
    dtype = torch.float32 if path == "vector" else torch.bfloat16
    out = KERNEL(x.to(dtype), packed, torch.full((16,), 2.0), torch.full((3, 16), -1.0).to(dtype), path=path)
    assert out.dtype == dtype and out[:, 0].tolist() == [1.75] * 3 and out[:, 1:].eq(1.0).all()


def _random_groups(rng: np.random.Generator, out: int, width: int, size: int, offsets: bool,
                   narrow: bool = False, coarse: bool = False) -> GroupWeights:
    """Values over all of int8, or narrow ones (NARROW_VALUES: [-64, 63], every block type but Q8_0's),
    or coarse ones ([-16, 15]: Q5_0's, the default model's qkv and gate|up)."""
    scale = rng.uniform(0.001, 0.02, (out, width // size)).astype(np.float32)
    offset = rng.uniform(-0.05, 0.05, (out, width // size)).astype(np.float32) if offsets else None
    low, high = (-16, 16) if coarse else (NARROW_VALUES[0], NARROW_VALUES[1] + 1) if narrow else (-128, 128)
    return GroupWeights.from_numpy(rng.integers(low, high, (out, width), dtype=np.int8), scale, offset, size)


def _reference(x: torch.Tensor, groups: GroupWeights) -> np.ndarray:
    """float64 products of the groups' values (each weight q * s + o in float64)."""
    v = groups.values.numpy().astype(np.float64)
    rows, width = v.shape
    w = v.reshape(rows, -1, groups.group_size) * groups.scale.numpy().astype(np.float64)[..., None]
    if groups.offset is not None:
        w += groups.offset.numpy().astype(np.float64)[..., None]
    return x.double().numpy() @ w.reshape(rows, width).T


def _bound(x: torch.Tensor, groups: GroupWeights, exact: bool, dtype: torch.dtype, biased: bool = False
           ) -> np.ndarray:
    """How far an output may be from the float64 product: float32 sums (a few units of 2^-24
    of sum |w x| for these widths; where narrow values were summed as q + 192, of the sum of
    |(|q| + 192) s x| + |o x|), bf16-rounded weights (2^-8 of it) where the path rounds them,
    and one rounding of the output to `dtype`."""
    magnitude = np.abs(x.double().numpy()) @ np.abs(groups.weight().double().numpy()).T
    summed = magnitude
    if biased:
        v = np.abs(groups.values.numpy().astype(np.float64)) + 192.0
        rows, width = v.shape
        w = v.reshape(rows, -1, groups.group_size) * groups.scale.numpy().astype(np.float64)[..., None]
        if groups.offset is not None:
            w += np.abs(groups.offset.numpy().astype(np.float64))[..., None]
        summed = np.abs(x.double().numpy()) @ w.reshape(rows, width).T
    product_error = magnitude * BF16_EPS if not exact else summed * 64 * 2.0 ** -24
    return product_error + magnitude * (BF16_EPS if dtype == torch.bfloat16 else 2.0 ** -24) + 1e-30


def _rounding(x: torch.Tensor, groups: GroupWeights, path: str = "i16") -> np.ndarray:
    """What rounding the inputs per group may move an output by on a path that rounds them:
    each input is within half its group's step (max |x| / 32767 on i16, max |x| / 127 on
    vnni) of what the path multiplies, so at most sum_k |w_k| * step_k / 2, with 1% for the
    float32 arithmetic of the step itself; zero on the other paths."""
    if path not in ROUNDING_PATHS:
        return np.zeros((x.shape[0], groups.values.shape[0]))
    levels = 32767.0 if path == "i16" else 127.0
    xs = np.abs(x.double().numpy()).reshape(x.shape[0], -1, groups.group_size)
    half_step = np.repeat(xs.max(axis=-1) / (2 * levels), groups.group_size, axis=1)
    return half_step @ np.abs(groups.weight().double().numpy()).T * 1.01


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(tiles=st.integers(1, 3), width_32s=st.integers(1, 4), size=st.sampled_from([16, 32]), offsets=st.booleans(),
       rows=st.integers(1, 40), seed=st.integers(0, 2 ** 16), path=st.sampled_from(PATHS + ["auto"]),
       values=st.sampled_from(["int8", "narrow", "coarse"]), int8_inputs=st.booleans())
def test_every_path_is_the_groups_product(tiles: int, width_32s: int, size: int, offsets: bool, rows: int,
                                          seed: int, path: str, values: str, int8_inputs: bool) -> None:
    """Every path, on values of all of int8, narrow or 5-bit ones (the exact AMX and DPBF16
    paths sum narrow ones as q + 192 and take the bias back out), at rows of one and of two
    AMX row blocks; `auto` on weights whose inputs may be rounded to int8 or not."""
    rng = np.random.default_rng(seed)
    groups = _random_groups(rng, 16 * tiles, 32 * width_32s, size, offsets, values == "narrow", values == "coarse")
    dtype = torch.float32 if path in ("vector", "i16", "vnni") and seed % 2 else torch.bfloat16
    x = torch.from_numpy(rng.standard_normal((rows, 32 * width_32s)).astype(np.float32)).to(dtype)
    packed = KERNEL.pack(groups, {"auto": None, "i16": "pairs"}.get(path, "tiles"), int8_inputs)
    taken = path if path != "auto" else KERNEL.path(rows, dtype, packed)
    got = KERNEL(x, packed, path=None if path == "auto" else path)
    assert got.dtype == dtype and got.shape == (rows, 16 * tiles)
    error = np.abs(got.double().numpy() - _reference(x, groups))
    biased = packed.narrow and taken in ("exact", "dpbf16")
    bound = _bound(x, groups, taken in EXACT_PATHS | ROUNDING_PATHS, dtype, biased)
    assert (error <= bound + _rounding(x, groups, taken)).all()


@needs_kernel
@pytest.mark.skipif(KERNEL is None or not KERNEL.i16, reason="no AVX2: no i16 path")
def test_i16_products_by_hand() -> None:
    """Inputs that are whole multiples of their group's step (max |x| / 32767) lose nothing
    to i16's rounding, and int8's ends (Q8_0's values) sum without overflow. Groups of 8:
    x = 2^-8 [32767, -32767, 1, 2, 0, 0, 0, 0] (sum 3 / 256) and 2^-4 [32767, 5, -3, 0, 0,
    0, 0, -32767] (sum 2 / 16); output 0's values all 127, then all -128, scales 0.25 and
    0.5, offsets 1 and -2: (0.25 * 127 + 1) * 3 / 256 + (0.5 * -128 - 2) * 2 / 16
    = 98.25 / 256 - 8.25 = -7.8662109375; output 1's values zero with the same offsets:
    3 / 256 - 4 / 16 = -0.23828125; the others zero."""
    values = torch.zeros(16, 16, dtype=torch.int8)
    values[0, :8], values[0, 8:] = 127, -128
    scale, offset = torch.zeros(16, 2), torch.zeros(16, 2)
    scale[0] = torch.tensor([0.25, 0.5])
    offset[:2] = torch.tensor([1.0, -2.0])
    packed = KERNEL.pack(GroupWeights(values, scale, offset, 8), "pairs")
    assert packed.layout == "pairs" and packed.values.shape == (1, 16, 16)
    assert packed.values.flatten()[:4].tolist() == [127, 127, 0, 0]  # column 0's first two k, then column 1's
    first = [v * 2.0 ** -8 for v in (32767, -32767, 1, 2, 0, 0, 0, 0)]
    second = [v * 2.0 ** -4 for v in (32767, 5, -3, 0, 0, 0, 0, -32767)]
    out = KERNEL(torch.tensor([first + second] * 5), packed, path="i16")
    assert out[:, 0].tolist() == [-7.8662109375] * 5 and out[:, 1].tolist() == [-0.23828125] * 5
    assert out[:, 2:].eq(0).all()


@needs_kernel
@pytest.mark.skipif(KERNEL is None or not KERNEL.i16, reason="no AVX2: no i16 path")
def test_i16_products_are_the_same_sums_with_or_without_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    """vpdpwssd (AVX-VNNI, AVX512-VNNI) is vpmaddwd and vpaddd in one, on exact int32 sums:
    every form this CPU has gives the AVX2 pair's outputs bit for bit, at rows of every row
    block's remainder."""
    from hybridserve.models.platform.cpu_features import read_cpu_flags

    flags = read_cpu_flags()
    forms = [""] + (["avx_vnni"] if "avx_vnni" in flags else []) \
        + (["avx512_vnni"] if {"avx512_vnni", "avx512vl"} <= flags else [])
    rng = np.random.default_rng(11)
    groups = _random_groups(rng, 48, 96, 32, True)
    packed = KERNEL.pack(groups, "pairs")
    x = torch.from_numpy(rng.standard_normal((9, 96)).astype(np.float32))
    outputs = []
    for form in forms:
        monkeypatch.setattr(KERNEL, "i16_dot", form)
        outputs.append([KERNEL(x[:rows], packed, path="i16") for rows in (1, 2, 3, 4, 9)])
    for other in outputs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outputs[0], other))


@needs_kernel
@pytest.mark.skipif(KERNEL is None or not KERNEL.i16, reason="no AVX2: no i16 path")
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_i16_carries_a_non_finite_input_to_its_row(bad: float) -> None:
    """A row with an infinite or NaN input comes out NaN (as the float32 loop's would not be
    finite either), groups of 8 and of 6, float32 and bf16; the other rows are untouched."""
    rng = np.random.default_rng(12)
    for size in (8, 6):
        groups = _random_groups(rng, 16, 4 * size, size, False)  # no offsets: the inputs' sums are not read
        packed = KERNEL.pack(groups, "pairs")
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.from_numpy(rng.standard_normal((3, 4 * size)).astype(np.float32))
            clean = KERNEL(x.to(dtype), packed)
            x[1, size + 1] = bad
            out = KERNEL(x.to(dtype), packed)
            assert out[1].isnan().all()
            assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])


@needs_kernel
@pytest.mark.skipif(KERNEL is None or not KERNEL.i16, reason="no AVX2: no i16 path")
@pytest.mark.parametrize("size", [2, 6, 10])
def test_i16_groups_of_odd_eights(size: int) -> None:
    """Groups that are not whole vectors of 8 (quantized one input at a time) within the
    bound of i16's rounding, float32 and bf16 inputs."""
    rng = np.random.default_rng(size)
    groups = _random_groups(rng, 32, 6 * size, size, True)
    packed = KERNEL.pack(groups, "pairs")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(rng.standard_normal((7, 6 * size)).astype(np.float32)).to(dtype)
        error = np.abs(KERNEL(x, packed).double().numpy() - _reference(x, groups))
        assert (error <= _bound(x, groups, True, dtype) + _rounding(x, groups)).all()


needs_vnni = pytest.mark.skipif(KERNEL is None or not KERNEL.vnni, reason="no AVX512-VNNI: no vnni path")


@needs_kernel
@needs_vnni
@pytest.mark.parametrize("size", [8, 16])
def test_vnni_products_by_hand(size: int) -> None:
    """Inputs that are whole multiples of their group's step (max |x| / 127) lose nothing to
    vnni's rounding, and int8's ends (127 and -128, Q8_0's values: 255 and 0 once the path
    adds 128) sum without overflow; groups of 8 are quantized one input at a time, of 16 a
    vector at a time. Group 0's inputs 2^-7 [127, -127, 1, 2] (step 2^-7, sum 3 / 128),
    group 1's 2^-3 [127, 5, -3, -127] (step 2^-3, sum 2 / 8), the rest zero; output 0's
    values all 127, then all -128, scales 0.25 and 0.5, offsets 1 and -2:
    (0.25 * 127 + 1) * 3 / 128 + (0.5 * -128 - 2) * 2 / 8 = 98.25 / 128 - 16.5
    = -15.732421875; output 1's values zero with the same offsets: 3 / 128 - 2 / 4
    = -0.4765625; the others zero (output 0 rounded to bf16's 8 bits: -15.75). Nine rows:
    a whole block of eight and one more."""
    values = torch.zeros(16, 2 * size, dtype=torch.int8)
    values[0, :size], values[0, size:] = 127, -128
    scale, offset = torch.zeros(16, 2), torch.zeros(16, 2)
    scale[0] = torch.tensor([0.25, 0.5])
    offset[:2] = torch.tensor([1.0, -2.0])
    packed = KERNEL.pack(GroupWeights(values, scale, offset, size), "tiles")
    first, second = [0.0] * size, [0.0] * size
    first[:4] = [v * 2.0 ** -7 for v in (127, -127, 1, 2)]
    second[:3], second[-1] = [v * 2.0 ** -3 for v in (127, 5, -3)], -127 * 2.0 ** -3
    for dtype, top in ((torch.float32, -15.732421875), (torch.bfloat16, -15.75)):  # inputs exact in bf16
        out = KERNEL(torch.tensor([first + second] * 9).to(dtype), packed, path="vnni").float()
        assert out[:, 0].tolist() == [top] * 9 and out[:, 1].tolist() == [-0.4765625] * 9
        assert out[:, 2:].eq(0).all()


@needs_kernel
@needs_vnni
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_vnni_carries_a_non_finite_input_to_its_row(bad: float) -> None:
    """As on i16: a row with an infinite or NaN input comes out NaN, groups of 8 and of 16,
    float32 and bf16; the other rows are untouched."""
    rng = np.random.default_rng(13)
    for size in (8, 16):
        groups = _random_groups(rng, 16, 4 * size, size, False)
        packed = KERNEL.pack(groups, "tiles")
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.from_numpy(rng.standard_normal((5, 4 * size)).astype(np.float32))
            clean = KERNEL(x.to(dtype), packed, path="vnni")
            x[1, size + 1] = bad
            out = KERNEL(x.to(dtype), packed, path="vnni")
            assert out[1].isnan().all()
            assert torch.equal(out[0], clean[0]) and torch.equal(out[2:], clean[2:])


@needs_kernel
@needs_vnni
def test_vnni_rows_are_computed_alone() -> None:
    """Each row is quantized and multiplied by itself: a row's outputs are the same bits
    alone, in a block of eight and after one (the blocks' remainders)."""
    rng = np.random.default_rng(14)
    packed = KERNEL.pack(_random_groups(rng, 32, 96, 32, True), "tiles")
    x = torch.from_numpy(rng.standard_normal((17, 96)).astype(np.float32)).bfloat16()
    together = KERNEL(x, packed, path="vnni")
    for row in (0, 7, 8, 16):
        assert torch.equal(KERNEL(x[row:row + 1], packed, path="vnni")[0], together[row])


@needs_kernel
@needs_vnni
def test_vnni_quads_are_the_same_with_or_without_vbmi(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiles' values become quads by one vpermb where the CPU has AVX512-VBMI, by
    unpacks elsewhere (a VNNI CPU without it): a kernel built as for such a CPU gives this
    one's outputs bit for bit, at rows of every row block's remainder."""
    from hybridserve.models.platform.cpu_features import CPU_FLAGS_ENV, read_cpu_flags

    flags = read_cpu_flags()
    if "avx512vbmi" not in flags:
        pytest.skip("this CPU builds the unpacks already")
    monkeypatch.setenv(CPU_FLAGS_ENV, " ".join(sorted(flags - {"avx512vbmi"})))
    without = GroupKernel()
    assert without.vnni
    rng = np.random.default_rng(15)
    groups = _random_groups(rng, 48, 96, 32, True, coarse=True)
    x = torch.from_numpy(rng.standard_normal((17, 96)).astype(np.float32)).bfloat16()
    for rows in (1, 7, 8, 9, 17):
        assert torch.equal(KERNEL(x[:rows], KERNEL.pack(groups, "tiles"), path="vnni"),
                           without(x[:rows], without.pack(groups, "tiles"), path="vnni"))


@needs_kernel
def test_narrow_values_are_told_apart() -> None:
    """NARROW_VALUES' ends are narrow, one step past either is not."""
    rng = np.random.default_rng(3)
    for low, high, narrow in ((-64, 63, True), (-65, 63, False), (-64, 64, False), (0, 15, True), (-127, 127, False)):
        groups = _random_groups(rng, 16, 32, 32, False)
        values = groups.values.clone()
        values[0, 0], values[0, 1] = low, high
        values.clamp_(low, high)
        assert KERNEL.pack(GroupWeights(values, groups.scale, None, 32)).narrow is narrow, (low, high)


@needs_kernel
@pytest.mark.parametrize("path", [p for p in ("exact", "dpbf16") if p in PATHS])
def test_narrow_products_by_hand(path: str) -> None:
    """Narrow values [1, -2 | 3, 4] in groups of 2 (hand_groups) and the same with one value
    of 100 (not narrow): the first row's outputs are exact either way (1.75 + 100 * 0.25 * 3
    for the wide one, as every value here is exact in bf16 and float32)."""
    narrow = hand_groups()
    assert KERNEL.pack(narrow).narrow
    values = narrow.values.clone()
    values[1, 2] = 100
    wide = GroupWeights(values, narrow.scale.clone(), narrow.offset, 2)
    wide.scale[1, 1] = 0.25
    assert not KERNEL.pack(wide).narrow
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 5).bfloat16()
    for groups, second in ((narrow, 0.0), (wide, 75.0)):
        out = KERNEL(x, KERNEL.pack(groups, "tiles"), torch.full((16,), 2.0), torch.full((5, 16), -1.0).bfloat16(),
                     path=path)
        assert out[:, 0].tolist() == [1.75] * 5 and out[:, 1].tolist() == [1.0 + second] * 5


@settings(max_examples=20, deadline=None)
@given(width_16s=st.integers(1, 6), rows=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_the_general_path_is_the_groups_product(width_16s: int, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups = _random_groups(rng, 24, 16 * width_16s, 16, seed % 2 == 0)
    x = torch.from_numpy(rng.standard_normal((rows, 16 * width_16s)).astype(np.float32))
    error = np.abs(group_linear_general(x, groups).double().numpy() - _reference(x, groups))
    assert (error <= _bound(x, groups, True, torch.float32)).all()


def test_stacked_rows_keep_each_part_s_weights() -> None:
    """q in groups of 32 with offsets, k in groups of 16 without: stacked in groups of 16,
    each part's weight unchanged (offsets zero where a part had none)."""
    rng = np.random.default_rng(0)
    q, k = _random_groups(rng, 32, 64, 32, True), _random_groups(rng, 16, 64, 16, False)
    qk = concat_rows([q, k])
    assert qk.group_size == 16 and qk.values.shape == (48, 64) and qk.offset is not None
    assert torch.equal(qk.weight(), torch.cat([q.weight(), k.weight()]))
    assert qk.offset[32:].eq(0).all()


@needs_kernel
def test_each_row_count_takes_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = KERNEL.pack(hand_groups(), "tiles")
    wide = KERNEL.pack(_random_groups(np.random.default_rng(1), 16, 64, 32, False), "tiles")
    monkeypatch.setattr(KERNEL, "amx", True)
    assert [KERNEL.path(r, torch.bfloat16, wide) for r in (1, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, FOLDED_MIN_ROWS - 1,
                                                              FOLDED_MIN_ROWS, EXPAND_MIN_ROWS - 1, EXPAND_MIN_ROWS)] \
        == ["vector", "vector", "exact", "exact", "folded", "folded", "expand"]
    assert KERNEL.path(FOLDED_MIN_ROWS, torch.bfloat16, packed) == "exact"  # width 4: not whole 32s
    assert KERNEL.path(EXPAND_MIN_ROWS, torch.float32, wide) == "vector"  # float32: the exact loop always
    monkeypatch.setattr(KERNEL, "amx", False)
    monkeypatch.setattr(KERNEL, "native_bf16", True)
    monkeypatch.setattr(KERNEL, "dpbf16", True)
    monkeypatch.setattr(KERNEL, "vnni", False)
    assert [KERNEL.path(r, torch.bfloat16, wide) for r in (1, DPBF16_MIN_ROWS - 1, DPBF16_MIN_ROWS,
                                                              EXPAND_MIN_ROWS_NO_AMX - 1, EXPAND_MIN_ROWS_NO_AMX)] \
        == ["vector", "vector", "dpbf16", "dpbf16", "expand"]
    monkeypatch.setattr(KERNEL, "vnni", True)  # AVX512-VNNI besides: vnni for weights whose inputs may be int8
    groups = _random_groups(np.random.default_rng(5), 16, 64, 32, False)
    rounded = KERNEL.pack(groups, "tiles", int8_inputs=True)
    assert [KERNEL.path(r, torch.bfloat16, rounded) for r in (1, DPBF16_MIN_ROWS, VNNI_MIN_ROWS - 1, VNNI_MIN_ROWS,
                                                                 EXPAND_MIN_ROWS_NO_AMX, EXPAND_MIN_ROWS_VNNI - 1,
                                                                 EXPAND_MIN_ROWS_VNNI)] \
        == ["vector", "dpbf16", "dpbf16", "vnni", "vnni", "vnni", "expand"]
    assert KERNEL.path(VNNI_MIN_ROWS, torch.bfloat16, wide) == "dpbf16"  # its inputs kept: the exact products
    small = KERNEL.pack(hand_groups(), "tiles", int8_inputs=True)
    assert KERNEL.path(VNNI_MIN_ROWS, torch.bfloat16, small) == "dpbf16"  # groups of 2, not whole 4s
    assert KERNEL.path(VNNI_MIN_ROWS, torch.float32, rounded) == "vector"  # float32 asks for the exact loop
    assert KERNEL.invariant_path(torch.bfloat16, rounded) == "dpbf16"  # the file's values exactly
    monkeypatch.setattr(KERNEL, "vnni", False)
    monkeypatch.setattr(KERNEL, "native_bf16", False)  # torch's bf16 GEMM in software: never expand
    monkeypatch.setattr(KERNEL, "dpbf16", False)
    assert KERNEL.path(4 * EXPAND_MIN_ROWS, torch.bfloat16, wide) == "vector"
    if KERNEL.i16:  # every weight packed as pairs there, which i16 takes at every row count
        for groups in (hand_groups(), _random_groups(np.random.default_rng(4), 16, 64, 16, False, True)):
            pairs = KERNEL.pack(groups)
            assert pairs.layout == "pairs"
            assert {KERNEL.path(r, d, pairs) for r in (1, 2, 64, 4 * EXPAND_MIN_ROWS)
                    for d in (torch.float32, torch.bfloat16)} == {"i16"}
            assert KERNEL.invariant_path(torch.float32, pairs) == "i16"
    monkeypatch.setattr(KERNEL, "i16", False)  # an x86 CPU without AVX2, or another CPU: tiles, the loop
    assert KERNEL.pack(hand_groups()).layout == "tiles"


@needs_kernel
def test_make_group_linear_keeps_only_the_packed_tiles() -> None:
    groups = _random_groups(np.random.default_rng(2), 32, 64, 32, True)
    linear, residual = make_group_linear(groups, torch.ones(32))
    x = torch.randn(2, 64)
    h = torch.randn(2, 32)
    assert torch.allclose(residual(h, x), linear(x) + h, atol=1e-5)
    assert isinstance(linear, PackedLinear)
    held = [getattr(linear, name) for name in PackedLinear.__slots__]
    assert not any(isinstance(c, GroupWeights) for c in held)  # the row-major copy is not held


def test_groups_wider_than_a_tile_row_take_the_general_path() -> None:
    """A group of 64 weights (no GGUF block is, but a GroupWeights may be) is past what the
    exact AMX path's tile row holds: not packed, so the general path multiplies it, as the
    groups say (hand-checked: every value 1, scale 0.5, inputs 1: 64 x 0.5 = 32 per output)."""
    groups = GroupWeights(torch.ones(16, 128, dtype=torch.int8), torch.full((16, 2), 0.5), None, 64)
    assert not GroupKernel.packable(groups)
    assert GroupKernel.packable(groups.regrouped(32))
    linear, _ = make_group_linear(groups, None)
    out = linear(torch.ones(3, 128, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), torch.full((3, 16), 64.0))


def test_bad_weights_are_refused() -> None:
    good = hand_groups()
    with pytest.raises(ConfigError, match="whole groups"):
        GroupWeights(good.values, good.scale, None, 3).check()
    with pytest.raises(ConfigError, match="scale must be float32"):
        GroupWeights(good.values, good.scale.double(), None, 2).check()
    with pytest.raises(ConfigError, match="int8"):
        GroupWeights(good.values.int(), good.scale, None, 2).check()
    with pytest.raises(ConfigError, match="cannot be split"):
        good.regrouped(3)


@needs_kernel
def test_a_mismatched_input_or_path_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = KERNEL.pack(hand_groups(), "tiles")
    with pytest.raises(ValueError, match="width 5"):
        KERNEL(torch.zeros(1, 5), packed)
    with pytest.raises(ValueError, match="no int8-group path 'fast'"):
        KERNEL(torch.zeros(1, 4), packed, path="fast")
    with pytest.raises(ValueError, match="needs AMX and bf16"):  # float32 rows never reach AMX code
        KERNEL(torch.zeros(1, 4), packed, path="exact")
    monkeypatch.setattr(KERNEL, "amx", False)  # nor does a CPU without it
    with pytest.raises(ValueError, match="needs AMX and bf16"):
        KERNEL(torch.zeros(1, 4, dtype=torch.bfloat16), packed, path="folded")
    monkeypatch.setattr(KERNEL, "amx", True)
    with pytest.raises(ValueError, match="32 at a time, not 4"):
        KERNEL(torch.zeros(1, 4, dtype=torch.bfloat16), packed, path="folded")
    with pytest.raises(ValueError, match="no packed layout 'rows'"):
        KERNEL.pack(hand_groups(), "rows")
    with pytest.raises(ValueError, match="the i16 path on a weight packed as tiles"):
        KERNEL(torch.zeros(1, 4), KERNEL.pack(hand_groups(), "tiles"), path="i16")
    with pytest.raises(ValueError, match="vnni path needs AVX512-VNNI and groups of a multiple of 4"):
        KERNEL(torch.zeros(1, 4), packed, path="vnni")  # groups of 2
    monkeypatch.setattr(KERNEL, "vnni", False)  # nor does a CPU without VNNI reach its code
    wide = KERNEL.pack(_random_groups(np.random.default_rng(1), 16, 64, 32, False), "tiles")
    with pytest.raises(ValueError, match="vnni path needs AVX512-VNNI"):
        KERNEL(torch.zeros(1, 64), wide, path="vnni")
    pairs = KERNEL.pack(hand_groups(), "pairs")
    for path in ("vector", "expand"):
        with pytest.raises(ValueError, match=f"the {path} path on a weight packed as pairs"):
            KERNEL(torch.zeros(1, 4), pairs, path=path)
    monkeypatch.setattr(KERNEL, "i16", False)  # nor does a CPU without AVX2 reach its code
    with pytest.raises(ValueError, match="the i16 path on a weight packed as pairs"):
        KERNEL(torch.zeros(1, 4), pairs, path="i16")


@needs_kernel
def test_a_kernel_that_disagrees_is_not_used(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    check_refused(monkeypatch, caplog, GroupKernel, int8_groups.group_kernel,
                  lambda real, self, *args, **kw: real(self, *args, **kw) * 1.5, "general path")


def test_pairs_filled_in_parts_give_back_each_part() -> None:
    # A 48 x 64 weight in groups of 32 made in two parts (16 rows, then 32), packed into
    # zero pairs: each part's values and scales come back exactly, the pairs are the layout
    # pack makes, and a group kernel reads them as it reads pack's (where built)
    g = torch.Generator().manual_seed(3)
    values = torch.randint(-128, 128, (48, 64), dtype=torch.int8, generator=g)
    scale = torch.rand(48, 2, generator=g)
    packed = zero_pairs(48, 64, 32)
    assert packed.shape == (48, 64) and not packed.values.any()
    fill_pairs(packed, 16, GroupWeights(values[16:], scale[16:], None, 32))
    fill_pairs(packed, 0, GroupWeights(values[:16], scale[:16], None, 32))
    for start, stop in ((0, 16), (16, 48), (0, 48)):
        got_values, got_scale = unpack_pairs(packed, start, stop)
        assert torch.equal(got_values, values[start:stop]) and torch.equal(got_scale, scale[start:stop])
    # in memory, as the i16 path reads them: k 0 and 1 of output row 0, then of row 1, ...;
    # after the tile's 16 rows, k 2 and 3 of row 0
    memory = packed.values[0].flatten()
    assert memory[:4].tolist() == [values[0, 0], values[0, 1], values[1, 0], values[1, 1]]
    assert memory[32:34].tolist() == [values[0, 2], values[0, 3]]
    kernel = group_kernel()
    if kernel is not None and kernel.i16:
        reference = kernel.pack(GroupWeights(values, scale, None, 32), "pairs")
        assert torch.equal(packed.values, reference.values) and torch.equal(packed.scale, reference.scale)


def test_pairs_refuse_parts_that_do_not_fit() -> None:
    with pytest.raises(ValueError):
        zero_pairs(40, 64, 32)  # rows not whole tiles
    packed = zero_pairs(32, 64, 32)
    part = GroupWeights(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2), None, 32)
    for first in (8, 32):  # not a tile boundary; past the end
        with pytest.raises(ValueError):
            fill_pairs(packed, first, part)
    with pytest.raises(ValueError):
        fill_pairs(packed, 0, GroupWeights(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 4), None, 16))
    with pytest.raises(ValueError):
        unpack_pairs(packed, 0, 40)
