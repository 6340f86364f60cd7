"""mlp_row_blocks: an int8 layer's gate|up product and activation in row blocks gives the
levels and scales of one call bit for bit, and the model's hidden states with them
(models/arch/mlp_row_blocks.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.arch.mlp_row_blocks import block_rows, gate_up_act  # noqa: E402
from hybridserve.models.layers.int8 import int8_gemm_available  # noqa: E402
from tests.helpers.int8_gemma3 import LENGTHS, int8_model, prefill  # noqa: E402


def test_block_rows_keep_the_product_within_the_block_bytes() -> None:
    # 16 MiB / (2 x 2048 columns x 4 bytes) = 1024 rows, Gemma 3 270M's intermediate size.
    assert block_rows(2048) == 1024
    assert block_rows(1 << 30) == 1


class _Linear:
    def product(self, path: str, values: torch.Tensor) -> torch.Tensor:
        return values.clone()


class _Layer:
    gate_up = _Linear()
    gate_up_bias = None


class _Chains:
    """Records the rows of each call; returns its input and a per-row sum."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def act_mul(self, path: str, gate_up: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        self.rows.append(gate_up.shape[0])
        return gate_up * scale, (gate_up * scale).sum(dim=1, keepdim=True)


@pytest.mark.parametrize("rows, max_rows, want", [(150, 16, [15] * 10), (17, 16, [8, 9]), (16, 16, [16])])
def test_blocks_are_equal_within_a_row_and_cover_the_step(rows: int, max_rows: int, want: list[int]) -> None:
    x = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
    scale = torch.full((rows, 1), 0.5)
    chains = _Chains()
    levels, row_scale = gate_up_act(chains, "packed", _Layer(), x, scale, max_rows)  # type: ignore[arg-type]
    assert chains.rows == want
    assert torch.equal(levels, x * 0.5) and torch.equal(row_scale, (x * 0.5).sum(dim=1, keepdim=True))


@pytest.mark.skipif(not int8_gemm_available(), reason="no int8 GEMM here (x86 with AVX2 or VNNI)")
def test_a_prefill_in_row_blocks_gives_the_same_hidden_states() -> None:
    model = int8_model(compile=False)
    whole = prefill(model, LENGTHS)
    model.mlp_block_rows = 16  # 150 rows in 10 blocks
    assert torch.equal(prefill(model, LENGTHS), whole)


def test_the_model_dtype_product_takes_twice_the_rows_in_bf16() -> None:
    # 16 MiB / (2 x 2048 columns x 2 bytes) = 2048 rows: a default 2048-token step in one block.
    assert block_rows(2048, 2) == 2048
    assert block_rows(2048, 4) == block_rows(2048) == 1024


@pytest.mark.parametrize("native", [True, False])
def test_a_bf16_large_step_in_row_blocks_gives_the_same_hidden_states(native: bool, monkeypatch) -> None:
    """The model-dtype decoder's large step writes each block's act * up into its rows of
    one result (the native kernel's `out`, or a copy on the general path): the hidden states
    of one block, bit for bit."""
    from hybridserve.models.arch import decoder as decoder_module
    from hybridserve.models.layers.act_mul import act_mul_kernel
    from hybridserve.models.loaders.loader import load_model
    from tests.helpers import hf_tiny

    if native and act_mul_kernel() is None:
        pytest.skip("no C compiler: the act * up kernel is not built")
    if not native:  # the general act * up: eager, as the chains' fallback
        monkeypatch.setattr(decoder_module, "act_mul_kernel", lambda: None)
    model = load_model(hf_tiny.tiny_model_dir("gemma3"), "cpu", torch.bfloat16, "none", compile=True)
    assert model.dtype_mlp_block_rows >= sum(LENGTHS)
    whole = prefill(model, LENGTHS)
    written: list[int] = []
    real = model._act_mul

    def act_mul(gate_up, act, general=None, out=None, computed=False):  # type: ignore[no-untyped-def]
        written.append(-1 if out is None else out.shape[0])
        return real(gate_up, act, general, out=out, computed=computed)

    monkeypatch.setattr(model, "_act_mul", act_mul)
    model.dtype_mlp_block_rows = 16  # 150 rows in 10 blocks of 15
    assert torch.equal(prefill(model, LENGTHS), whole)
    assert written == [15] * 10 * model.cfg.num_layers
