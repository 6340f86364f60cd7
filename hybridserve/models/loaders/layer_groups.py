"""A decoder layer's linears read as int8 groups (--quantization gguf-groups).

The checkpoint is a GGUF's conversion that kept each decoder linear's groups
(gguf_loader.convert_gguf with groups=True): `<weight name>_values` (int8 [out, in]),
`_scale` (float32 [out, in / group size]) and, where the format has one, `_offset`
(models/loaders/gguf_groups.py). They are fused as the dense path fuses its weights
(take_qkv, take_gate_up): q | k | v rows, gate | up rows, with the same per-head row
reordering of q and k, which moves whole rows and so their groups with them. The values
of o and down stay views of the mapped file, as dense weights in the model dtype do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.arch.decoder import DecoderLayerWeights, LayerGroups
from hybridserve.models.config import ModelConfig
from hybridserve.models.layers.int8_groups import GroupWeights, concat_rows
from hybridserve.models.loaders.checkpoint import Weights
from hybridserve.models.loaders.gguf_groups import GROUP_PARTS, check_group_family
from hybridserve.models.parallel import TPGroup

RowOrder = Callable[[torch.Tensor, int], torch.Tensor]  # (q or k rows, heads) -> rows reordered
_VALUES, _SCALE, _OFFSET = (f"_{part}" for part in GROUP_PARTS)


def check_groups_load(cfg: ModelConfig, tp: TPGroup | None) -> None:
    """ConfigError where --quantization gguf-groups cannot serve this model: a family whose
    layers are not the plain decoder's, or a split over tensor-parallel ranks (o's and
    down's columns would be cut across groups)."""
    check_group_family(cfg.family, cfg.family)
    if tp is not None and tp.size > 1:
        raise ConfigError("--quantization gguf-groups runs on one tensor-parallel rank")


def check_holds_groups(names: list[str], model_dir: Path, wanted: bool) -> None:
    """ConfigError unless the checkpoint's tensor `names` include int8 groups exactly where
    they are `wanted` (--quantization gguf-groups)."""
    held = any(name.endswith(".weight" + _VALUES) for name in names)
    if wanted and not held:
        raise ConfigError(f"--quantization gguf-groups needs a GGUF model: {model_dir} holds no int8 groups "
                          "(a Hugging Face checkpoint, or a conversion for another mode)")
    if held and not wanted:
        raise ConfigError(f"{model_dir} holds int8 groups (a GGUF converted for --quantization gguf-groups): "
                          "load it with that mode, or the GGUF itself with this one")


def take_groups(w: Weights, name: str, shape: tuple[int, int]) -> GroupWeights:
    """The groups stored for weight `name` [out, in] = `shape`; ConfigError where they are
    missing or do not fit it."""
    rows, cols = shape
    if not (w.has(name + _VALUES) and w.has(name + _SCALE)):
        raise ConfigError(f"checkpoint is missing the int8 groups of {name}")
    stored = tuple(w.checkpoint.tensor(name + _SCALE).shape)
    groups = stored[1] if len(stored) == 2 else 0
    if not groups or cols % groups:
        raise ConfigError(f"tensor {name + _SCALE} has shape {stored}: not groups of {cols} columns")
    values = w.take(name + _VALUES, shape, torch.int8)
    scale = w.take(name + _SCALE, (rows, groups), torch.float32)
    offset = w.take(name + _OFFSET, (rows, groups), torch.float32) if w.has(name + _OFFSET) else None
    weights = GroupWeights(values, scale, offset, cols // groups)
    weights.check()
    return weights


def _reordered(groups: GroupWeights, order: RowOrder, heads: int) -> GroupWeights:
    """`groups` with `order` applied to the rows of each part."""
    offset = None if groups.offset is None else order(groups.offset, heads)
    return GroupWeights(order(groups.values, heads), order(groups.scale, heads), offset, groups.group_size)


def fill_layer_groups(layer: DecoderLayerWeights, cfg: ModelConfig, w: Weights, prefix: str, qk: RowOrder) -> None:
    """Layer `prefix`'s (model.layers.N.) linears as LayerGroups on `layer`, whose dense
    parameters are left empty; `qk` reorders q and k rows per head, as for the dense path."""
    H, hd, nq, nkv, I = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    a, m = prefix + "self_attn.", prefix + "mlp."
    q = _reordered(take_groups(w, a + "q_proj.weight", (nq * hd, H)), qk, nq)
    k = _reordered(take_groups(w, a + "k_proj.weight", (nkv * hd, H)), qk, nkv)
    v = take_groups(w, a + "v_proj.weight", (nkv * hd, H))
    gate, up = (take_groups(w, m + name, (I, H)) for name in ("gate_proj.weight", "up_proj.weight"))
    layer.groups = LayerGroups(qkv=concat_rows([q, k, v]), o=take_groups(w, a + "o_proj.weight", (H, nq * hd)),
                               gate_up=concat_rows([gate, up]), down=take_groups(w, m + "down_proj.weight", (H, I)))
    for name in ("qkv", "o", "gate_up", "down"):
        param = getattr(layer, name)
        param.data = torch.empty(0, dtype=param.dtype)  # never read: the groups are the weights


def move_layer_groups(layers: list[DecoderLayerWeights], device: torch.device) -> None:
    """Each layer's groups onto `device` (the model's parameters move with model.to)."""
    for layer in layers:
        if layer.groups is not None:
            layer.groups = LayerGroups(*(GroupWeights(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in g))
                                         for g in layer.groups))
