"""Which half-precision dtypes CPU attention computes in as they are: bfloat16 where the CPU
has AMX's bfloat16 tiles, float32 copies otherwise (executor/torch/attention.py), and the
two give the same attention to bfloat16 rounding."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.executor.torch import attention  # noqa: E402


@pytest.mark.parametrize("flags, native", [({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, {torch.bfloat16}),
                                           ({"avx512f", "avx512_bf16", "avx512_vnni"}, set()),
                                           ({"avx2"}, set())])
def test_bfloat16_is_native_only_with_amx_bf16(monkeypatch, flags: set[str], native: set) -> None:
    monkeypatch.setattr(attention, "read_cpu_flags", lambda: frozenset(flags))
    attention.native_half_dtypes.cache_clear()
    try:
        assert attention.native_half_dtypes() == native
    finally:
        attention.native_half_dtypes.cache_clear()


def test_native_and_float32_copies_agree_to_bfloat16_rounding(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 20, 16, generator=g).bfloat16()
    k, v = (torch.randn(3, 1, 20, 16, generator=g).bfloat16() for _ in range(2))
    step = attention.StepAttention.__new__(attention.StepAttention)
    step.scale, step.softcap = 0.25, None
    outs = []
    for native in (frozenset({torch.bfloat16}), frozenset()):
        monkeypatch.setattr(attention, "native_half_dtypes", lambda native=native: native)
        outs.append(step._sdpa(q, k, v, None).float())
    assert outs[0].dtype == outs[1].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=2 ** -6, atol=2 ** -7)
