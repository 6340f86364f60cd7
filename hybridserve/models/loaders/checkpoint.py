"""Reading an HF checkpoint directory into a model: the mapped safetensors files, tensors
taken by name with shape checks and dtype conversion, and the final placement. Shared by
the decoder loader (loader.py) and the recurrent loaders (mamba_loader.py, qwen3_next_loader.py,
lfm2_loader.py, jamba_loader.py); imports none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.config import ModelConfig
from hybridserve.models.parallel import TPGroup, group_rows
from hybridserve.models.loaders.safetensors_map import MappedCheckpoint

if TYPE_CHECKING:
    from hybridserve.models.arch.decoder import StagedModel

# Buffers some checkpoints carry that hold nothing we need (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def open_checkpoint(model_dir: Path) -> MappedCheckpoint:
    """The directory's safetensors files (sharded or not), mapped, not read."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no .safetensors weights in {model_dir}")
    return MappedCheckpoint([model_dir / name for name in files])


class Weights:
    """Takes tensors by HF name, checking shape and converting dtype; tracks leftovers.

    A tensor already in the model dtype is returned as a view of the mapped file (no copy)."""

    def __init__(self, checkpoint: MappedCheckpoint, dtype: torch.dtype) -> None:
        self.checkpoint = checkpoint
        self.dtype = dtype
        self._unread = set(checkpoint.names())
        self._taken: list[str] = []

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name`, checked to have `shape`, in `dtype` (default: the model's; packed
        bytes such as MXFP4 blocks are taken as stored with dtype=torch.uint8)."""
        if name not in self._unread:
            raise ConfigError(f"checkpoint is missing tensor {name}")
        self._unread.discard(name)
        self._taken.append(name)
        t = self.checkpoint.tensor(name)
        if tuple(t.shape) != shape:
            raise ConfigError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(dtype or self.dtype)

    def has(self, name: str) -> bool:
        """Whether `name` is in the checkpoint and not taken yet (a choice between two layouts)."""
        return name in self._unread

    def discard(self, name: str) -> None:
        """A tensor the model does not need (e.g. a tied head stored anyway)."""
        self._unread.discard(name)

    def keep_layers(self, prefix: str, keep: range) -> None:
        """Discard the tensors of layers `{prefix}{i}.` with i outside `keep` (another
        pipeline stage's layers)."""
        for name in list(self._unread):
            if name.startswith(prefix):
                index = name[len(prefix):].split(".", 1)[0]
                if index.isdigit() and int(index) not in keep:
                    self._unread.discard(name)

    def leftovers(self) -> list[str]:
        return sorted(k for k in self._unread if not k.endswith(_IGNORED_SUFFIXES))

    def release_taken(self) -> None:
        """Give back the file pages of the tensors taken so far (called per layer, so the load
        holds one layer's source pages at a time); what the model still reads as a view (the
        embedding, unfused weights) is read again, page by page, as it is used."""
        for name in self._taken:
            self.checkpoint.release(name)
        self._taken.clear()

    def release_all(self) -> None:
        """Give back every file page (after packing, which reads the unfused weights again)."""
        for name in self.checkpoint.names():
            self.checkpoint.release(name)


def fill_ends(model: StagedModel, cfg: ModelConfig, w: Weights, embed_name: str, norm_name: str,
              norm: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
    """The parts outside the layers a stage holds: the embedding (first stage), the final
    norm (`norm` applied to the stored weight) and the head (last stage; a tied head on a
    last stage that is not also the first is the embedding matrix, taken again). What a
    stage does not hold is discarded. Assigned, not copied: a tensor in the model dtype
    stays a view of the mapped file."""
    V, H = cfg.vocab_size, cfg.hidden_size
    first, last = model.stage.is_first, model.stage.is_last
    tied = cfg.tie_word_embeddings
    with torch.no_grad():
        if first:
            model.embed.data = w.take(embed_name, (V, H))
        if last:
            model.final_norm.copy_(norm(w.take(norm_name, (H,))))
            if not tied or not first:  # a single stage ties its head in place_weights
                head = "lm_head.weight" if not tied else embed_name
                model.lm_head = torch.nn.Parameter(w.take(head, (V, H)), requires_grad=False)
        else:
            w.discard(norm_name)
        if not first and not (last and tied):
            w.discard(embed_name)
        if tied or not last:
            w.discard("lm_head.weight")  # some tied checkpoints still store it


def take_qkv(w: Weights, cfg: ModelConfig, tp: TPGroup, prefix: str, suffix: str = "weight",
             qk: Callable[[torch.Tensor, int], torch.Tensor] = lambda t, heads: t) -> torch.Tensor:
    """The fused q | k | v weight (suffix "weight") or bias ("bias") of this rank's query
    heads and the KV heads they read (parallel.group_rows);
    `qk(t, heads)` reorders q and k rows per head first (Llama 4's RoPE layout)."""
    H, hd, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    tail = (H,) if suffix == "weight" else ()
    return torch.cat([tp.shard(qk(w.take(prefix + "q_proj." + suffix, (nq * hd, *tail)), nq)),
                      group_rows(tp, nkv, qk(w.take(prefix + "k_proj." + suffix, (nkv * hd, *tail)), nkv)),
                      group_rows(tp, nkv, w.take(prefix + "v_proj." + suffix, (nkv * hd, *tail)))])


def take_attention(w: Weights, cfg: ModelConfig, tp: TPGroup, prefix: str, o_name: str = "o_proj"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fused q | k | v rows, the o projection's columns) of this rank's heads, no biases."""
    o = w.take(prefix + o_name + ".weight", (cfg.hidden_size, cfg.num_heads * cfg.head_dim))
    return take_qkv(w, cfg, tp, prefix), tp.shard(o, 1)


def take_gate_up(w: Weights, tp: TPGroup, prefix: str, shape: tuple[int, ...], suffix: str = "weight"
                 ) -> torch.Tensor:
    """The fused gate | up rows of this rank's intermediate columns (`shape`: one of them, global)."""
    return torch.cat([tp.shard(w.take(prefix + "gate_proj." + suffix, shape)),
                      tp.shard(w.take(prefix + "up_proj." + suffix, shape))])


def take_row_bias(w: Weights, param: torch.Tensor | None, name: str, size: int) -> None:
    """A row-parallel layer's bias: copied into `param` where this rank holds it (None: a
    tensor-parallel rank other than 0, which reads and drops it; rank 0 adds it once)."""
    t = w.take(name, (size,))
    if param is not None:
        with torch.no_grad():
            param.copy_(t)


def load_staged(model: StagedModel, model_dir: Path, cfg: ModelConfig, device: str | torch.device,
                dtype: torch.dtype, fill: Callable[[Any, ModelConfig, Weights], None]) -> Any:
    """A recurrent model's load: `fill(model, cfg, w)` from the checkpoint, placed on `device`,
    its constants set up (`model.setup`), in eval mode."""
    w = Weights(open_checkpoint(model_dir), dtype)
    fill(model, cfg, w)
    place_weights(model, cfg, w, device)
    model.setup(torch.device(device))  # type: ignore[operator]
    return model.eval()


def place_weights(model: torch.nn.Module, cfg: ModelConfig, w: Weights, device: str | torch.device) -> None:
    """After filling: refuse checkpoint tensors nothing read, move to `device`, tie the head
    (a model holding both the embedding and the head; see fill_ends)."""
    left = w.leftovers()
    if left:
        raise ConfigError(f"checkpoint has {len(left)} tensor(s) this implementation would ignore, e.g. {left[0]}")
    model.to(device)
    if cfg.tie_word_embeddings and model.stage.is_first and model.stage.is_last:
        model.lm_head = model.embed
