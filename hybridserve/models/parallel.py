"""How a model is split over processes: pipeline stages (contiguous layer ranges) and tensor
parallel ranks (heads and MLP columns), and the checks that say which sizes a model allows.

Pipeline parallelism (P stages): stage s holds layers `stage_layer_ranges(num_layers, P)[s]`
(contiguous, sizes differing by at most one, the larger ones first). The first stage holds
the embedding, the last the final norm and the output head (a tied head: the last stage
loads the embedding matrix as its head). Layer indices stay global: stage s calls the
attention backend with the model's own layer numbers, and its KV layer names are the
global `layers.{i}`. Between stages crosses exactly one tensor, the residual stream
h [T, hidden] after the stage's last layer (before the final norm): every supported
family is pre-norm with a single residual stream (Gemma's embedding scale is applied by
the first stage only; Bamba/Mamba2 carry nothing else either).

Tensor parallelism (T ranks), Megatron style, each rank holding 1/T of::

    attention   q heads and kv heads (fused qkv rows cut per head), o_proj columns
    MLP         gate/up rows (column parallel), down columns (row parallel)
    Llama 4     experts and the shared expert along their intermediate dimension (router replicated)
    Mamba2      heads: in_proj rows of z, x, dt (and B, C by group), conv channels, dt_bias/A/D,
                the gated norm's weight, out_proj columns

KV heads are split like query heads where T divides them; with fewer KV heads than ranks
(T a multiple of their count: Gemma 3 270M's one KV head) each rank keeps the KV head its
query heads read, so T / num_kv_heads ranks hold (and cache) the same one.

Every row-parallel output (o_proj, down, a Llama 4 MoE layer's shared + routed sum, a
Mamba mixer's out_proj) is summed over ranks with one all-reduce; its bias is loaded on
rank 0 only, so it is added once. Embedding and output head are replicated: every rank
computes the full logits and samples the same tokens. A rank's `model.cfg` reports its
LOCAL num_heads, num_kv_heads, intermediate_size (and Llama 4 intermediate_size_mlp, Mamba
num_heads / n_groups), so its KV cache specs (models/kv_specs.py) hold its heads only.

Mamba2 groups: B and C are shared by the heads of one of n_groups groups, and the gated
RMSNorm normalises each group's channels together. With n_groups divisible by T each rank
holds whole groups (no communication). With T divisible by n_groups (Bamba 9B: one group)
each rank holds part of one group: it keeps that group's B and C (replicated within the
group), and the norm's sum of squares is completed with one small all-reduce per mixer.
Other combinations are a ConfigError naming the sizes that work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from hybridserve.core.errors import ConfigError
from hybridserve.models.config import ModelConfig

if TYPE_CHECKING:  # torch is imported where a tensor is touched: the checks stay importable without it
    import torch
    from torch.distributed import ProcessGroup


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges of `num_stages` stages, sizes differing by at most one (the
    earlier stages take the extra layers); ConfigError when a stage would get no layer."""
    if num_stages < 1:
        raise ConfigError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ConfigError(f"the model has {num_layers} layers, too few for pipeline_parallel_size "
                          f"{num_stages}; sizes that work: 1..{num_layers}")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        stop = start + base + (1 if s < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges


@dataclass(frozen=True)
class PipelineStage:
    """Stage `rank` of `size` (the default: the whole model in one stage)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"pipeline stage {self.rank} out of range for {self.size} stage(s)")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The global indices of this stage's layers."""
        return stage_layer_ranges(num_layers, self.size)[self.rank]


@dataclass(frozen=True)
class TPGroup:
    """Tensor-parallel rank `rank` of `size`; `group` the torch.distributed process group whose
    all-reduce sums row-parallel outputs (None: the default group)."""

    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor parallel rank {self.rank} out of range for size {self.size}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the group's ranks, in place (returned for chaining)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def shard(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's 1/size of `t` along `dim` (sizes checked by `check_tp`): contiguous,
        a view where it can be (rows; the whole of `t` for one rank)."""
        n = t.shape[dim] // self.size
        return t.narrow(dim, self.rank * n, n).contiguous()

    @property
    def keeps_row_bias(self) -> bool:
        """Whether this rank adds the biases of row-parallel layers (rank 0: once per sum)."""
        return self.rank == 0


def init_model_parallel(rank: int, pp_size: int, tp_size: int) -> tuple[PipelineStage, TPGroup]:
    """The pipeline stage and tensor-parallel group of global `rank` in a world of
    pp_size * tp_size processes (after torch.distributed.init_process_group). Ranks
    s*T .. s*T+T-1 are stage s's T tensor-parallel ranks; the stage boundary runs between
    the same TP rank of neighbouring stages (global rank r sends to r + T), each sending
    its copy of the (replicated) residual stream. Every rank creates every TP group, in the
    same order, as torch.distributed requires."""
    import torch.distributed as dist

    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)] \
        if tp_size > 1 else [None] * pp_size
    stage, tp_rank = divmod(rank, tp_size)
    return PipelineStage(stage, pp_size), TPGroup(tp_rank, tp_size, groups[stage])


def _divisors_of_all(values: Sequence[int], limit: int) -> list[int]:
    return [t for t in range(1, limit + 1) if all(v % t == 0 for v in values)]


def _split_or_shared(count: int, t: int) -> bool:
    """Whether T ranks can hold `count` groups (KV heads, Mamba groups): count / T each, or
    (T a multiple of count) one each, shared by T / count ranks."""
    return count == 0 or count % t == 0 or t % count == 0


def tp_sizes_that_work(cfg: ModelConfig, limit: int = 64) -> list[int]:
    """Tensor parallel sizes up to `limit` that divide every sharded dimension of `cfg`
    and split or share its KV heads and Mamba groups."""
    return [t for t in _divisors_of_all(_sharded_sizes(cfg), limit)
            if _split_or_shared(cfg.num_kv_heads, t) and (cfg.mamba is None or _split_or_shared(cfg.mamba.n_groups, t))]


def _sharded_sizes(cfg: ModelConfig) -> list[int]:
    sizes = [s for s in (cfg.num_heads, cfg.intermediate_size) if s > 0]
    if cfg.llama4 is not None:
        sizes.append(cfg.llama4.intermediate_size_mlp)
    if cfg.mamba is not None:
        sizes.append(cfg.mamba.num_heads)
    if cfg.short_conv is not None:
        sizes.append(cfg.short_conv.channels)
    if cfg.jamba is not None:
        sizes.append(cfg.jamba.mixer.intermediate_size)
    if cfg.hybrid is not None and cfg.hybrid.num_experts:
        sizes.append(cfg.hybrid.expert_intermediate_size)
    if cfg.gated_deltanet is not None and cfg.qwen3_next_moe is not None:
        moe = cfg.qwen3_next_moe
        sizes.append(cfg.gated_deltanet.num_k_heads)
        if moe.num_experts:
            sizes += [moe.moe_intermediate_size, moe.shared_intermediate_size]
    return sizes


def check_tp(cfg: ModelConfig, size: int) -> None:
    """ConfigError naming the sizes that work unless `size` divides the model's heads, MLP
    (and expert) intermediate sizes and Mamba heads, and splits or shares its KV heads and
    Mamba groups."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if size in tp_sizes_that_work(cfg, size):
        return
    what = [f"attention heads {cfg.num_heads}", f"KV heads {cfg.num_kv_heads} (split or shared)",
            f"MLP intermediate size {cfg.intermediate_size}"]
    if cfg.llama4 is not None:
        what.append(f"dense MLP intermediate size {cfg.llama4.intermediate_size_mlp}")
    if cfg.hybrid is not None and cfg.hybrid.num_experts:
        what.append(f"expert intermediate size {cfg.hybrid.expert_intermediate_size}")
    if cfg.mamba is not None:
        what.append(f"Mamba heads {cfg.mamba.num_heads} and groups {cfg.mamba.n_groups} (split or shared)")
    if cfg.short_conv is not None:
        what.append(f"short convolution channels {cfg.short_conv.channels}")
    if cfg.jamba is not None:
        what.append(f"Mamba1 channels {cfg.jamba.mixer.intermediate_size}")
    if cfg.gated_deltanet is not None and cfg.qwen3_next_moe is not None:
        moe = cfg.qwen3_next_moe
        what.append(f"Gated DeltaNet key heads {cfg.gated_deltanet.num_k_heads}" + (
            f", expert and shared-expert intermediate sizes {moe.moe_intermediate_size} and "
            f"{moe.shared_intermediate_size}" if moe.num_experts else ""))
    works = ", ".join(map(str, tp_sizes_that_work(cfg)))
    raise ConfigError(f"tensor_parallel_size {size} does not divide the model's {', '.join(what)}; "
                      f"sizes that work: {works}")


def local_config(cfg: ModelConfig, tp: TPGroup | None) -> ModelConfig:
    """`cfg` as one rank sees it: local head counts and intermediate sizes (checked first)."""
    if tp is None or tp.size == 1:
        return cfg
    check_tp(cfg, tp.size)
    t = tp.size
    changes: dict[str, Any] = dict(num_heads=cfg.num_heads // t, num_kv_heads=_local_groups(cfg.num_kv_heads, t),
                                   intermediate_size=cfg.intermediate_size // t)
    if cfg.llama4 is not None:
        changes["llama4"] = replace(cfg.llama4, intermediate_size_mlp=cfg.llama4.intermediate_size_mlp // t)
    if cfg.mamba is not None:
        m = cfg.mamba
        changes["mamba"] = replace(m, num_heads=m.num_heads // t, n_groups=_local_groups(m.n_groups, t))
    if cfg.short_conv is not None:
        changes["short_conv"] = replace(cfg.short_conv, channels=cfg.short_conv.channels // t)
    if cfg.jamba is not None:
        mixer = cfg.jamba.mixer
        changes["jamba"] = replace(cfg.jamba, mixer=replace(mixer, intermediate_size=mixer.intermediate_size // t))
    if cfg.hybrid is not None:
        changes["hybrid"] = replace(cfg.hybrid, expert_intermediate_size=cfg.hybrid.expert_intermediate_size // t)
    if cfg.gated_deltanet is not None and cfg.qwen3_next_moe is not None:  # a rank: its key heads' value heads
        d, moe = cfg.gated_deltanet, cfg.qwen3_next_moe
        changes["gated_deltanet"] = replace(d, num_k_heads=d.num_k_heads // t, num_v_heads=d.num_v_heads // t)
        changes["qwen3_next_moe"] = replace(moe, moe_intermediate_size=moe.moe_intermediate_size // t,
                                            shared_intermediate_size=moe.shared_intermediate_size // t)
    return replace(cfg, **changes)


def _local_groups(count: int, t: int) -> int:
    return count // t if count % t == 0 else 1


def group_rows(tp: TPGroup, n_groups: int, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This rank's groups of `t` laid out [n_groups * size, ...] along `dim` (KV heads of a
    k or v projection, Mamba groups of B or C): its n_groups / T groups, or (T a multiple
    of n_groups) the one group its query / Mamba heads use, which T / n_groups ranks share."""
    if tp.size == 1:
        return t
    per_group = t.shape[dim] // n_groups
    first = tp.rank * n_groups // tp.size
    return t.narrow(dim, first * per_group, _local_groups(n_groups, tp.size) * per_group).contiguous()


class SharedNormGroups:
    """The gated RMSNorm of a Mamba mixer whose groups span ranks (T a multiple of n_groups):
    completes each rank's sum of squares over its group's channels on every rank."""

    def __init__(self, tp: TPGroup, n_groups: int, group_channels: int) -> None:
        self.tp = tp
        self.n_groups = n_groups
        self.group = tp.rank * n_groups // tp.size  # the global group this rank's heads use
        self.inv_channels = 1.0 / group_channels

    def mean_square(self, local_sum: torch.Tensor) -> torch.Tensor:
        """local_sum [T, 1, 1] (this rank's part of its group) -> the group's mean square [T, 1, 1].
        One all-reduce over the whole TP group: each rank fills its own group's column."""
        full = local_sum.new_zeros(local_sum.shape[0], self.n_groups)
        full[:, self.group] = local_sum[:, 0, 0]
        self.tp.all_reduce(full)
        return (full[:, self.group] * self.inv_channels)[:, None, None]
