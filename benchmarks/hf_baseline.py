"""HF transformers `generate` as the benchmarks' baseline: greedy, left-padded batches."""

from __future__ import annotations

from typing import Any


def left_padded_generate(model: Any, rows: list[list[int]], max_new_tokens: int, pad_id: int) -> list[list[int]]:
    """New token ids per row: the rows are left-padded to one width (attention mask 0 on
    the padding), so every row's last prompt token sits in the same column."""
    import torch

    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, p in enumerate(rows):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad_id)
    return out[:, width:].tolist()
