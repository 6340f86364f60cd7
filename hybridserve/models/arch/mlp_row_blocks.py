"""An int8 layer's gate|up product and activation in row blocks, for steps of many rows.

gate|up is a layer's widest product: [rows, 2 x intermediate] float32, 64 MiB for a
4096-token prefill of Gemma 3 270M. glibc serves an allocation past its largest mmap
threshold (32 MiB on 64-bit) with fresh pages every time, and the GEMM then pays a page
fault per 4 KiB of its output on every call; a product of at most BLOCK_BYTES is carved
from the heap the previous block gave back. Rows are independent through the product and
the activation chain (per-row activation scales, element-wise work, per-row quantization),
so blocks give the same levels and scales bit for bit as one call
(tests/models/test_mlp_row_blocks.py). The model-dtype decoder's large steps (decoder.py)
cut their gate|up product, in the model's dtype, by the same bytes.
"""

from __future__ import annotations

import torch

from hybridserve.models.arch.int8_chains import Int8Chains, Int8Layer, Quantized

# The most bytes of one block's float32 gate|up product: half glibc's largest mmap threshold.
BLOCK_BYTES = 16 << 20


def block_rows(intermediate_size: int, value_bytes: int = 4) -> int:
    """The most rows of one block for a layer of this intermediate size whose product holds
    `value_bytes` a value (float32 for the int8 layers; the model's dtype for its own), at
    least 1."""
    return max(1, BLOCK_BYTES // (2 * intermediate_size * value_bytes))


def row_blocks(rows: int, max_rows: int) -> list[tuple[int, int]]:
    """[start, stop) of each block of a step of `rows` rows: one block up to max_rows, else
    blocks of equal size (within one row), each more than half of max_rows."""
    blocks = -(-rows // max_rows)
    bounds = [rows * k // blocks for k in range(blocks + 1)]
    return list(zip(bounds, bounds[1:]))


def gate_up_act(chains: Int8Chains, path: str, layer: Int8Layer, x: torch.Tensor, x_scale: torch.Tensor,
                max_rows: int) -> Quantized:
    """act(gate) * up of `layer` for quantized input (x, x_scale), quantized for `path`, in
    blocks of at most `max_rows` rows. A larger step is cut into blocks of equal size (within
    one row), each more than half of max_rows: with block_rows' sizes, far above the row
    count from which the compiled chains (chosen for the whole step) serve."""
    if x.shape[0] <= max_rows:
        return chains.act_mul(path, layer.gate_up.product(path, x), x_scale, layer.gate_up_bias)
    parts = [chains.act_mul(path, layer.gate_up.product(path, x[a:b]), x_scale[a:b], layer.gate_up_bias)
             for a, b in row_blocks(x.shape[0], max_rows)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
