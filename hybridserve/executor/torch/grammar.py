"""Grammar masks in the runner: one llguidance matcher per constrained request.

Invariant: between steps a request's matcher has consumed exactly the request's output
tokens the runner has accepted. The runner executes steps in dispatch order, so under
async scheduling a step's masks are built from the state after the previous step's
sampled token, which is the state the step really continues from (never a placeholder).

A verify step samples at the known token's row and at each draft's row. The mask of row
j is the state after drafts[:j]: the drafts are consumed tentatively while the masks are
built (stopping at the first draft the grammar refuses: no row past it can be
accepted), then rolled back, and only the accepted tokens are consumed for good.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Sequence

import numpy as np
import torch


class RequestGrammar:
    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_tentative = 0

    def masks(self, drafts: Sequence[int], width: int) -> torch.Tensor:
        """[width, words] int32 bitmasks of the rows of one request's step."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        out = allocate_token_bitmask(width, self.vocab_size)
        for j in range(width):
            fill_next_token_bitmask(self.matcher, out, j)
            if j < width - 1 and self.num_tentative == j:
                self.num_tentative += self.matcher.try_consume_tokens([drafts[j]])
        return out

    def advance(self, accepted: Sequence[int]) -> str | None:
        """Undo the tentative drafts, consume the accepted tokens; a one-line reason if
        the grammar refuses them (the engine then fails this request alone)."""
        if self.num_tentative:
            self.matcher.rollback(self.num_tentative)
            self.num_tentative = 0
        for token in accepted:
            if self.matcher.is_stopped():
                # The output is complete; its mask allowed only EOS, which ends the request.
                break
            if not self.matcher.consume_token(token):
                detail = (self.matcher.get_error() or "no detail").splitlines()[0]
                return f"the grammar refused sampled token {token}: {detail}"
        return None


# The integer type whose bit patterns a float dtype of that size is built from.
_BITS_OF = {4: torch.int32, 2: torch.int16}


@cache
def _neg_inf_bits(dtype: torch.dtype) -> int:
    """-inf of `dtype` as its integer bit pattern (made once per dtype, not per masked row)."""
    return torch.tensor(float("-inf"), dtype=dtype).view(_BITS_OF[dtype.itemsize]).item()


def bitmask_penalty(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[vocab_size] of `dtype` (float32, bfloat16 or float16) from an llguidance bitmask
    [words] int32: 0 for an allowed token, -inf for a forbidden one. Token t is allowed when
    bit t % 32 of word t // 32 is set; tokens past the mask's 32 * words are forbidden.

    Not llguidance.torch's apply_token_bitmask_inplace: that kernel is torch.compile'd, so
    it needs a C++ compiler at run time and compiles on first use, and with torch 2.13's
    AVX2 code generation (a CPU without AVX-512, or ATEN_CPU_CAPABILITY=avx2) it left about
    a quarter of a random mask's tokens wrong: grammars then sampled forbidden tokens."""
    # The words' little-endian bytes, each unpacked least significant bit first: token order.
    words = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)
    bits = torch.from_numpy(np.unpackbits(words, bitorder="little")[:vocab_size])
    int_type = _BITS_OF[dtype.itemsize]
    neg_inf = _neg_inf_bits(dtype)
    penalty = torch.empty(vocab_size, dtype=int_type)
    penalty[bits.shape[0]:] = neg_inf
    # bit - 1 is 0 (allowed) or all ones (forbidden); AND -inf's bit pattern makes that 0.0
    # or -inf. Three plain integer kernels: cheaper than masked_fill_ with a bool mask or a
    # float route with mixed dtypes over a large vocabulary (benchmarks/structured_output_bench.py).
    torch.bitwise_and(bits.to(int_type).sub_(1), neg_inf, out=penalty[: bits.shape[0]])
    return penalty.view(dtype)


def apply_bitmask(logits_row: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of tokens the mask forbids to -inf, in place ([V] and [words])."""
    penalty = bitmask_penalty(bitmask, logits_row.shape[0], logits_row.dtype)
    logits_row.add_(penalty.to(logits_row.device, non_blocking=True))
