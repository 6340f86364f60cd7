"""Ordered point-to-point messages between pipeline workers, over torch.distributed.

Sends are posted with `isend` and never waited on at once: a stage that blocks only on
receives cannot deadlock with its neighbours (stage s sends step N's hidden state
forward while the last stage sends step N-1's tokens back). Their buffers are kept until
the send completes. Each kind of message has its own tag, and messages of one tag
between two ranks arrive in the order they were sent, so a receiver reads them in step
order without step ids on the wire.

Tensors travel as raw bytes (a uint8 view), so any dtype crosses, bfloat16 included,
whatever the backend supports for arithmetic.
"""

from __future__ import annotations

import pickle
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

TAG_PLAN = 10  # a step's plan (request starts, counts, drafts): pickled, size then bytes
TAG_HIDDEN = 20  # a step's hidden state, forward
TAG_RESULT = 30  # a step's sampled tokens, from the last stage back to earlier ones


class PeerLink:
    def __init__(self, device: torch.device) -> None:
        # Object buffers live where the backend sends from (CPU for gloo, the GPU for nccl).
        self.device = device
        self._pending: deque[tuple[Any, tuple[torch.Tensor, ...]]] = deque()

    def send_object(self, obj: Any, dst: int, tag: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        size, data = size.to(self.device), data.to(self.device)
        self._post(dist.isend(size, dst, tag=tag), size)
        self._post(dist.isend(data, dst, tag=tag + 1), data)

    def recv_object(self, src: int, tag: int) -> Any:
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(size, src, tag=tag)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.recv(data, src, tag=tag + 1)
        return pickle.loads(data.cpu().numpy().tobytes())

    def send_tensor(self, t: torch.Tensor, dst: int, tag: int) -> None:
        raw = t.contiguous().view(torch.uint8)
        self._post(dist.isend(raw, dst, tag=tag), raw)

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        elem = torch.tensor([], dtype=dtype).element_size()
        raw = torch.empty((*shape[:-1], shape[-1] * elem), dtype=torch.uint8, device=self.device)
        dist.recv(raw, src, tag=tag)
        return raw.view(dtype)

    def _post(self, work: Any, keep: torch.Tensor) -> None:
        self._pending.append((work, (keep,)))
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()

    def flush(self) -> None:
        """Wait for every posted send (before the process group goes away)."""
        while self._pending:
            work, _ = self._pending.popleft()
            work.wait()
