"""What the native kernels' start-up checks (native_build.checked) accept from a float32 form
that equals its eager chain to a float32 rounding, not bit for bit."""

from __future__ import annotations

import torch

# A few float32 roundings of the largest value: a wrong index, lane or formula is far off.
FLOAT32_CLOSE = 2.0**-20


def float32_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether got and want have one shape and differ nowhere by more than FLOAT32_CLOSE of
    want's largest magnitude (NaN where either is NaN)."""
    if got.shape != want.shape or not torch.equal(got.isnan(), want.isnan()):
        return False
    ok = ~want.isnan()
    scale = want[ok].abs().max() if ok.any() else torch.tensor(0.0)
    return bool(((got[ok] - want[ok]).abs() <= FLOAT32_CLOSE * scale).all())
