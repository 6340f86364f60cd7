"""The decoder-only transformer shared by Llama, Mistral, Qwen2, Gemma2, Gemma3 text, OLMo 3
and EXAONE 4 (pre-norm, Gemma's sandwich norms, or OLMo's post-norms: see ModelConfig).

The model computes a flat batch: T tokens of any number of requests, with their
positions. Attention itself is delegated to an `AttentionBackend` (the runner's paged
attention), so the model knows nothing about blocks, windows or requests.

Weights are stored fused for speed at small sizes (per-op overhead dominates there):
q/k/v as one matrix, gate/up as one matrix, Gemma's (1 + w) norm weights precomputed.
Numerics follow HF's float32 path op for op where it matters (RMSNorm in float32,
RoPE angles in float32, soft-capping as tanh(x / cap) * cap).

A model may be one pipeline stage and one tensor-parallel rank (models/parallel.py): it
then holds its stage's layers only (still numbered globally), and its heads / MLP columns.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.config import ModelConfig
from hybridserve.core.errors import ConfigError
from hybridserve.models.layers.head import GROUP_LAYERS, INT4_LAYERS, OutputHead, ReleaseRows, head_quantization
from hybridserve.models.layers.int4 import make_int4_linear
from hybridserve.models.arch.decode_stack import DecodeStack
from hybridserve.models.layers.int8_groups import GroupWeights, PackedLinear, make_group_linear
from hybridserve.models.platform.heap import release_free_heap
from hybridserve.models.arch.compiled_chains import ChainsByRows, int8_chains_by_rows
from hybridserve.models.arch.int8_chains import Int8Chains, Int8Layer
from hybridserve.models.arch import decoder_chains
from hybridserve.models.arch.decoder_chains import DecoderChains, LayerNorms
from hybridserve.models.arch.mlp_row_blocks import block_rows, gate_up_act, row_blocks
from hybridserve.models.layers.int8 import W8A8Linear, quantize_gemm_weight
from hybridserve.models.layers.linear import LayerLinears, Linear, ResidualLinear, make_linear
from hybridserve.models.parallel import PipelineStage, TPGroup, local_config
from hybridserve.models.layers.projection_norm import ProjectionNorm
from hybridserve.models.layers.act_mul import act_mul_eager, act_mul_kernel, gate_half
from hybridserve.models.layers.qk_norm_rope import QKNormRope, qk_norm_rope_kernel
from hybridserve.models.layers.residual_norms import ResidualNorms, residual_norms_kernel
from hybridserve.models.layers.rms_norm import rms_norm
from hybridserve.models.layers.rope import RopeTable, apply_rope_
from hybridserve.models.layers.span_logits import SpanLogits

# The linears whose inputs a GGUF-groups decoder never rounds to int8 (the vnni path of
# models/layers/int8_groups.py): the MLP's down projection, whose inputs (the activation
# times up) carry the outliers that set each group's int8 step: rounding them cost the
# default model as much KL divergence from float32 as the other three roles together, and
# took it past llama.cpp's on the same GGUF (benchmarks/results/group_int8_kernels.md, "VNNI").
EXACT_INPUT_ROLES = frozenset({"down"})


class AttentionBackend(Protocol):
    """Computes one attention layer for the step's flat batch and stores its K/V."""

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] and kv [T, 2, KVH, D] (RoPE applied; may be strided views)
        -> attention output [T, H * D]."""
        ...


class DecoderLayerWeights(nn.Module):
    """One layer's parameters, fused. Names are ours; the loader maps HF names onto them.
    `cfg` is the rank's local config; row_bias=False (tensor-parallel ranks but the first)
    leaves out the biases of the row-parallel o and down, which rank 0 adds for all."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, row_bias: bool = True) -> None:
        super().__init__()
        hd = cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd

        def p(*shape: int) -> nn.Parameter:
            # Uninitialised (untouched pages cost no memory): the loader assigns or fills each.
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = None if cfg.post_norm else p(cfg.hidden_size)
        self.qkv = p(qkv_out, cfg.hidden_size)
        self.qkv_bias = p(qkv_out) if cfg.qkv_bias else None
        self.o = p(cfg.hidden_size, cfg.num_heads * hd)
        self.o_bias = p(cfg.hidden_size) if cfg.o_bias and row_bias else None
        # q_norm weight repeated per query head, then k_norm per kv head: [H + KVH, D].
        self.qk_norm = p(cfg.num_heads + cfg.num_kv_heads, hd) if cfg.qk_norm else None
        self.post_attn_norm = None if cfg.parallel_block else p(cfg.hidden_size)
        self.pre_ffn_norm = p(cfg.hidden_size) if cfg.sandwich_norm else None
        self.post_ffn_norm = p(cfg.hidden_size) if cfg.sandwich_norm or cfg.post_norm else None
        self.gate_up = p(2 * cfg.intermediate_size, cfg.hidden_size)
        self.gate_up_bias = p(2 * cfg.intermediate_size) if cfg.mlp_bias else None
        self.down = p(cfg.hidden_size, cfg.intermediate_size)
        self.down_bias = p(cfg.hidden_size) if cfg.mlp_bias and row_bias else None
        # Under --quantization gguf-groups the loader sets the four linears' int8 groups here
        # and leaves their parameters above empty (models/loaders/loader.py).
        self.groups: LayerGroups | None = None


class LayerGroups(NamedTuple):
    """One layer's linears as int8 groups (models/layers/int8_groups.py), fused as the
    parameters are: q | k | v rows, gate | up rows."""

    qkv: GroupWeights
    o: GroupWeights
    gate_up: GroupWeights
    down: GroupWeights


class LayerSmoothing(NamedTuple):
    """One layer's smoothing for int8 activations (models/layers/smoothing.py): column factors s
    that multiply the weight's columns, while the producers of the inputs (the norms, up's
    rows) divide by them."""

    qkv: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _release(weight: nn.Parameter) -> None:
    weight.data = torch.empty(0, dtype=weight.dtype)  # only the packed / quantized copy is read now


def _layer_linears(w: DecoderLayerWeights, release: bool) -> LayerLinears:
    made = {}
    for name in ("qkv", "o", "gate_up", "down"):
        weight: nn.Parameter = getattr(w, name)
        linear, residual, packed = make_linear(weight, getattr(w, name + "_bias"))
        if packed and release:
            _release(weight)
        made[name], made[name + "_residual"] = linear, residual
    return LayerLinears(**{f: made[f] for f in LayerLinears._fields})


def _int4_layer_linears(w: DecoderLayerWeights, release: bool) -> LayerLinears:
    """The layer's matmuls on int4 groups (models/layers/int4.py), in and out in the model dtype."""
    made = {}
    for name in ("qkv", "o", "gate_up", "down"):
        made[name], made[name + "_residual"] = make_int4_linear(getattr(w, name), getattr(w, name + "_bias"))
        if release:
            _release(getattr(w, name))
    return LayerLinears(**{f: made[f] for f in LayerLinears._fields})


def _group_layer_linears(w: DecoderLayerWeights, release: bool) -> LayerLinears:
    """The layer's matmuls on its int8 groups (make_group_linear), in and out in the model
    dtype; ConfigError where the loader set none (the weights came from no GGUF's groups).
    With `release`, the layer lets go of its groups: the linears hold what they read (the
    kernel's packed copy, or the groups themselves on the general path)."""
    if w.groups is None:
        raise ConfigError("--quantization gguf-groups needs the layers' int8 groups: load the model from a GGUF "
                          "with that mode")
    made = {}
    for name in ("qkv", "o", "gate_up", "down"):
        made[name], made[name + "_residual"] = make_group_linear(getattr(w.groups, name), getattr(w, name + "_bias"),
                                                                 int8_inputs=name not in EXACT_INPUT_ROLES)
    if release:
        w.groups = None
    return LayerLinears(**{f: made[f] for f in LayerLinears._fields})


def _smoothed_gate_up(w: DecoderLayerWeights, s: LayerSmoothing) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gate|up in float32 with its columns times s.gate_up and up's rows (and bias) divided
    by s.down: act(gate) * up is linear in up, so down's input comes out divided by s.down."""
    inter = w.down.shape[1]
    weight = w.gate_up.detach().float() * s.gate_up
    weight[inter:] /= s.down[:, None]
    if w.gate_up_bias is None:
        return weight, None
    bias = w.gate_up_bias.detach().float()
    bias[inter:] /= s.down
    return weight, bias


WeightSource = Callable[[], "tuple[torch.Tensor, torch.Tensor | None]"]


def smoothed_weights(w: DecoderLayerWeights, s: LayerSmoothing) -> dict[str, WeightSource]:
    """Per matmul, what makes its smoothed float32 (weight, bias): the columns times the
    layer's factors, up's rows (and bias) divided by down's factors, whose inputs they
    produce (models/layers/smoothing.py). With the norms already divided, these weights compute
    the same function as the originals. Made on demand, one at a time, so the load's peak
    grows by one float32 weight, not a float32 model."""
    return {
        "qkv": lambda: (w.qkv.detach().float() * s.qkv, w.qkv_bias),
        "o": lambda: (w.o.detach().float(), w.o_bias),
        "gate_up": lambda: _smoothed_gate_up(w, s),
        "down": lambda: (w.down.detach().float() * s.down, w.down_bias),
    }


def _int8_layer(w: DecoderLayerWeights, s: LayerSmoothing, sandwich: bool, release: bool) -> Int8Layer:
    made: dict[str, W8A8Linear | torch.Tensor | None] = {}
    for name, source in smoothed_weights(w, s).items():
        weight, bias = source()
        made[name] = W8A8Linear(*quantize_gemm_weight(weight))
        made[name + "_bias"] = None if bias is None else bias.detach().float()
        del weight  # before the next weight's float32 copy
        if release:
            _release(getattr(w, name))
    # Sandwich: h + norm(o), then the pre-FFN norm; pre-norm: h + o, then the post-attention norm.
    o_norm, ffn_norm = (w.post_attn_norm, w.pre_ffn_norm) if sandwich else (None, w.post_attn_norm)
    return Int8Layer(**made, input_norm=w.input_norm, qk_norm=w.qk_norm, o_norm=o_norm,  # type: ignore[arg-type]
                     ffn_norm=ffn_norm, down_norm=w.post_ffn_norm)


def _residual_covered(kernel: ResidualNorms, h: torch.Tensor, norms: LayerNorms) -> bool:
    """Whether the native kernel takes a layer's residual adds and norms (h: a made-up row of
    the model's width): both sandwich norms' adds, or a pre-norm layer's norms alone."""
    if norms.out is None and norms.down is None:
        return kernel.supports_norm(h, norms.ffn)
    return (norms.out is not None and norms.down is not None and kernel.supports(h, h, norms.out, norms.ffn)
            and kernel.supports(h, h, norms.down, norms.ffn))


class StagedModel(nn.Module):
    """What every model shares as one pipeline stage and tensor-parallel rank: its local
    config, which layers it holds, the stage's ends (embedding / final norm and head) and
    the sum of row-parallel outputs over ranks (see models/parallel.py)."""

    cfg: ModelConfig
    _eps: torch.Tensor
    _embed_scale: torch.Tensor
    # every row computed alike whatever the step's other rows (DecoderLM.make_batch_invariant)
    batch_invariant = False

    def init_stage(self, cfg: ModelConfig, dtype: torch.dtype, stage: PipelineStage | None,
                   tp: TPGroup | None) -> ModelConfig:
        """Set the stage's attributes from the global `cfg`; returns the local config."""
        self.stage = stage or PipelineStage()
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.cfg = cfg = local_config(cfg, self.tp)
        self.dtype = dtype
        self.layer_ids = self.stage.layers(cfg.num_layers)
        # Parts of other stages are not built at all (their memory is the point of the split).
        self.embed = (nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
                      if self.stage.is_first else None)
        self.final_norm = (nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype), requires_grad=False)
                           if self.stage.is_last else None)
        self.lm_head: torch.Tensor | None = None  # set by the loader on the last stage (tied: the embedding)
        # Set by the loader where `embed` is a view of the checkpoint file: the same rows read
        # from the file (models/loaders/file_rows.py), so that lookups map no file pages.
        self.embed_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
        return cfg

    @property
    def row_bias(self) -> bool:
        """Whether this rank holds the biases of row-parallel layers (see DecoderLayerWeights)."""
        return self.tp is None or self.tp.keeps_row_bias

    def stage_input(self, input_ids: torch.Tensor | None, hidden_in: torch.Tensor | None) -> torch.Tensor:
        """The residual stream entering this stage: the (scaled) embedding on the first
        stage, the previous stage's output `hidden_in` [T, hidden] on the others."""
        if self.embed is None:
            if hidden_in is None:
                raise ValueError(f"pipeline stage {self.stage.rank} needs hidden_in from the previous stage")
            return hidden_in
        assert input_ids is not None
        h = self.embed_rows(input_ids) if self.embed_rows is not None else F.embedding(input_ids, self.embed)
        return h * self._embed_scale if self.cfg.embed_scale != 1.0 else h

    def stage_output(self, h: torch.Tensor) -> torch.Tensor:
        """What leaves this stage: the final-normed hidden on the last stage (for logits /
        greedy_tokens), the residual stream to send to the next stage on the others."""
        if self.final_norm is None:
            return h
        # bf16 by the native kernel where it is built, as the layers' norms (exact sums, one
        # call where the eager norm is nine ops)
        norms = residual_norms_kernel() if h.dtype == torch.bfloat16 and h.device.type == "cpu" else None
        if norms is not None and norms.supports_norm(h, self.final_norm):
            return norms.norm(h, self.final_norm, self._eps)
        return rms_norm(h, self.final_norm, self._eps, 1.0 / self.cfg.hidden_size, exact_sums=self.batch_invariant)

    def add_row_parallel(self, h: torch.Tensor, x: torch.Tensor, linear: Linear, residual: ResidualLinear
                         ) -> torch.Tensor:
        """h + x W^T (+ b) for a row-parallel W: fused on one rank; with tensor parallelism each
        rank's partial product is summed over ranks first (the bias is on rank 0 only)."""
        if self.tp is None:
            return residual(h, x)
        return h + self.tp.all_reduce(linear(x))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over the tensor-parallel ranks (itself on one rank)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)


class DecoderLM(StagedModel):
    """forward(ids, positions, backend) -> final hidden states; logits(h) -> vocab logits.

    Built from the model's global config: `self.cfg` is this rank's local view of it
    (parallel.local_config); `layer_ids` the global indices of `layers` (this stage's)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, stage: PipelineStage | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        global_cfg = cfg
        cfg = self.init_stage(cfg, dtype, stage, tp)
        # Sizes of the whole projection, which this rank's heads are a part of.
        self._projection_norm = ProjectionNorm(global_cfg, self.tp) if cfg.qk_norm_over_projection else None
        self.layers = nn.ModuleList(self._layer_weights(i, dtype) for i in self.layer_ids)
        self._rope: dict[str, RopeTable] = {}
        self._linears: list[LayerLinears] = []
        self._head: OutputHead | None = None
        self.int8_layers = False  # whether the decoder layers' matmuls are int8 x int8 (build_linears)
        self._int8: list[Int8Layer] = []  # their matmuls and norms, then
        self._chains: ChainsByRows | None = None  # and what lies between the matmuls (int8_chains.py)
        # The model-dtype layers' element-wise work compiled for large steps (decoder_chains.py);
        # eager is forward's own loop (None).
        self._dtype_chains: ChainsByRows[DecoderChains | None] | None = None
        # gate|up's rows per call in large steps (mlp_row_blocks.py): the int8 layers' product
        # is float32, the model-dtype layers' is in the model's dtype (twice the rows in bf16)
        self.mlp_block_rows = block_rows(cfg.intermediate_size)
        self.dtype_mlp_block_rows = block_rows(cfg.intermediate_size, torch.empty((), dtype=dtype).element_size())
        self._act = {"silu": F.silu, "gelu": F.gelu,
                     "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[cfg.activation]
        # Steps the compiled chains may take (compiled or not) use theirs, as exact_sums.
        self._large_act = decoder_chains.large_step_act(cfg.activation, self._act)
        # act_mul.c's tables, by activation and width
        self._act_tables: dict[tuple[Callable[[torch.Tensor], torch.Tensor], int], torch.Tensor] = {}
        # forward's fast path for decode steps (build_linears); None (tests, benchmarks): the loop alone
        self.decode_stack: DecodeStack | None = None
        # The chains whose work the native kernels' float32 forms take in a float32 model's
        # large steps (_native_chains): set where its decode steps take those kernels already
        self._float32_native: frozenset[str] = frozenset()

    def _layer_weights(self, layer_idx: int, dtype: torch.dtype) -> DecoderLayerWeights:
        """Layer `layer_idx`'s parameters (a hook: Llama 4 sizes its dense MLPs per layer)."""
        return DecoderLayerWeights(self.cfg, dtype, self.row_bias)

    def setup_rope(self, device: torch.device, max_positions: int) -> None:
        """Build cos/sin tables per layer type (call after moving the weights)."""
        # Start small (grown on demand): a 128k-position table would cost hundreds of MB.
        self._rope = {t: RopeTable(r, self.cfg.head_dim, min(max_positions, 4096), device, self.dtype)
                      for t, r in self.cfg.rope.items() if t in self.cfg.layer_types}
        self._embed_scale = torch.tensor(self.cfg.embed_scale, dtype=self.dtype, device=device)
        self._eps = torch.tensor(self.cfg.rms_norm_eps, dtype=self.dtype, device=device)

    def build_linears(self, release_weights: bool = True, quantization: str = "none",
                      release_head_rows: ReleaseRows | None = None,
                      smoothing: list[LayerSmoothing] | None = None, head_factors: torch.Tensor | None = None,
                      compile: bool = True) -> None:
        """Bind each matmul to its fastest kernel (call once the weights are final and on
        their device). With release_weights, weights that were packed free their plain
        copy: the model is then for inference only; reload it to change weights. The head
        is packed or quantized as `quantization` says (see models/layers/head.py); a tied head's
        plain weight stays, as the embedding lookup reads it. With `smoothing` (from
        models/layers/smoothing.smooth, which has already divided the norms) the layers' matmuls
        are int8 x int8, the element-wise chains between them compiled for large steps unless
        `compile` is False (compiled_chains.py); without, the model-dtype layers' element-wise
        work is compiled for large steps likewise where decoder_chains.py covers the layers.
        With quantization INT4_LAYERS, int4 groups (models/layers/int4.py); with GROUP_LAYERS,
        the int8 groups the loader set on each layer (LayerGroups). `head_factors`: the int8
        x int8 head's smoothing (the final norm already divided by them)."""
        self.int8_layers = smoothing is not None
        if quantization == INT4_LAYERS:
            self._linears = [_int4_layer_linears(w, release_weights) for w in self.layers]
        elif quantization == GROUP_LAYERS:
            self._linears = [_group_layer_linears(w, release_weights) for w in self.layers]
        elif smoothing is None:
            self._linears = [_layer_linears(w, release_weights) for w in self.layers]
        else:
            self._float32_elementwise()
            # The heap's free pages go back before each layer (models/platform/heap.py): first
            # the calibration forward's temporaries, then each layer's float32 copies, which
            # would otherwise stay resident while the next layers and the head are built.
            self._int8 = []
            for w, s in zip(self.layers, smoothing):
                release_free_heap()
                self._int8.append(_int8_layer(w, s, self.cfg.sandwich_norm, release_weights))
            release_free_heap()
            self._chains = int8_chains_by_rows(Int8Chains(self.cfg, self._eps, self._act, self.dtype), self._int8[0],
                                               compile)
        if smoothing is None and self._chains_cover_layers():
            sample = self._layer_norms(self.layers[0])

            def build() -> DecoderChains | None:
                return decoder_chains.build(self.cfg, self._eps, self._large_act, self.dtype, sample,
                                            native=self._native_chains())

            self._dtype_chains = ChainsByRows(None, build if compile else None, "decoder chains",
                                              check=lambda chains: decoder_chains.agreeing(chains, sample))
        self.decode_stack = DecodeStack.build(self) if quantization == GROUP_LAYERS else None
        self._float32_native = self._native_chains() if self.dtype == torch.float32 else frozenset()
        if self.stage.is_last:
            assert self.lm_head is not None, "weights not loaded"
            self._head = OutputHead(self.lm_head, head_quantization(quantization), release_head_rows,
                                    column_factors=head_factors)

    def make_batch_invariant(self) -> None:
        """Compute each row of a step as it would be computed in any other step: a request's
        logits then depend on its own tokens alone, not on what it is batched with or how its
        prompt is chunked (EngineConfig.batch_invariant; the attention's side is the
        runner's, executor/torch/attention.py). Every step takes forward's loop (no decode
        stack, no large-step chains) with one activation and exact norm sums (the native
        kernels' per-row arithmetic, or float64 sums whose order cannot matter), and every
        linear one group-kernel path at every row count (GroupKernel.invariant_path), whose
        rows never share sums; the output head's int8 x int8 products are exact int32 sums at
        every row count. ConfigError for linears without that path: torch's GEMMs pick
        their blocking by the row count. Call after build_linears."""
        kernels = [f for lin in self._linears for f in lin if isinstance(f, PackedLinear)]
        if self.int8_layers or not kernels or len(kernels) != 4 * len(self._linears):
            raise ConfigError("batch_invariant needs the decoder's linears as a GGUF's int8 groups on the CPU "
                              "(--quantization gguf-groups): other linears' GEMMs depend on the step's row count")
        for linear in kernels:
            linear.path = linear.kernel.invariant_path(self.dtype, linear.packed)
        self.decode_stack = None
        self._dtype_chains = None
        self._float32_native = frozenset()
        self.batch_invariant = True

    @property
    def compiles_large_steps(self) -> bool:
        """Whether large steps take (or will build) compiled chains: not under --no-compile."""
        return any(by_rows is not None and by_rows.compiles for by_rows in (self._chains, self._dtype_chains))

    def prepare_large_steps(self) -> None:
        """Build the compiled chains now (a server's start-up) instead of in the first step
        of at least their min_rows rows (its first burst of prompts); once built, prepare
        them for the calling thread's count (ChainsByRows.prepare)."""
        for by_rows in (self._chains, self._dtype_chains):
            if by_rows is not None:
                by_rows.prepare()

    def _chains_cover_layers(self) -> bool:
        """Whether decoder_chains' functions cover this model's layers (forward's general
        loop serves the rest): this class's forward (not a subclass's own), one rank, an
        input norm on every layer (pre-norm or sandwich norms), no projection-wide q/k norm,
        attention and MLP in sequence."""
        cfg = self.cfg
        return (type(self).forward is DecoderLM.forward and self.tp is None and self._projection_norm is None
                and not cfg.post_norm and not cfg.parallel_block and bool(self.layers)
                and all(w.input_norm is not None for w in self.layers))

    def _native_chains(self) -> frozenset[str]:
        """The chains (decoder_chains' names) whose work native kernels take on every layer of
        this model, so that large steps never compile them: q/k norm and / or RoPE, the
        residual adds and norms (sandwich or pre-norm layers), act * up; none whose kernel
        cannot be built or does not take the model's sizes. On the CPU alone: bf16 (the
        kernels give the eager chains' values bit for bit), and float32 where the decode
        stack serves the model's decode steps: its kernels' float32 forms, equal to the
        eager chains to a float32 rounding, then compute every step but the general loop's
        few-row mixed ones (the compiled chains' would be the eager bits, but their compiler
        is most of a server's memory over its budget: benchmarks/results/memory_peak.md)."""
        if self._eps.device.type != "cpu" or not (
                self.dtype == torch.bfloat16 or (self.dtype == torch.float32 and self.decode_stack is not None)):
            return frozenset()
        cfg, chains = self.cfg, set()
        norms = [self._layer_norms(w) for w in self.layers]
        qk_kernel, residual_kernel, act_kernel = qk_norm_rope_kernel(), residual_norms_kernel(), act_mul_kernel()
        heads = cfg.num_heads + cfg.num_kv_heads
        qk = torch.zeros(1, heads, cfg.head_dim, dtype=self.dtype)
        cos = torch.zeros(1, 1, cfg.head_dim, dtype=self.dtype)
        ropes = [cfg.layer_types[i] in self._rope for i in self.layer_ids]
        if qk_kernel is not None and all((n.qk is None and not rope) or qk_kernel.supports(qk, n.qk, cos if rope else None)
                                         for n, rope in zip(norms, ropes)):
            chains.add("qk_out")
        h = torch.zeros(1, cfg.hidden_size, dtype=self.dtype)
        if residual_kernel is not None and all(_residual_covered(residual_kernel, h, n) for n in norms):
            chains.add("residual")
        gate_up = torch.zeros(1, 2 * cfg.intermediate_size, dtype=self.dtype)
        if act_kernel is not None and (act_kernel.supports(gate_up) if self.dtype == torch.bfloat16
                                       else act_kernel.supports_computed(gate_up, cfg.activation)):
            chains.add("act_mul")
        return frozenset(chains)

    def _act_mul(self, gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                 general: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 out: torch.Tensor | None = None, computed: bool = False) -> torch.Tensor:
        """act(gate) * up of gate_up [rows, 2 x intermediate]: the native kernel where it takes
        these rows (bit for bit act's values, from its table), else `general` (None: eager);
        written into `out` where given (contiguous, [rows, intermediate]), which it returns.
        `computed`: float32 rows of a large step in _float32_native's models, whose activation
        the kernel's float32 form computes; `out` may then also be gate_up's own gate half
        (act_mul.gate_half: in place)."""
        if computed:
            kernel = act_mul_kernel()
            assert kernel is not None and kernel.supports_computed(gate_up, self.cfg.activation)
            return kernel.computed(gate_up, self.cfg.activation, out=out)
        kernel = act_mul_kernel() if self.dtype == torch.bfloat16 and gate_up.device.type == "cpu" else None
        if kernel is None or not kernel.supports(gate_up):
            y = act_mul_eager(gate_up, act) if general is None else general(gate_up)
            return y if out is None else out.copy_(y)
        table = self._act_table(act, gate_up.shape[1] // 2)
        assert table is not None
        return kernel(gate_up, table, out=out)

    def _act_table(self, act: Callable[[torch.Tensor], torch.Tensor], width: int) -> torch.Tensor | None:
        """act_mul.c's table of `act` for gates `width` wide (made once; the table is made in
        the layout act is called in); None where the kernel is not built."""
        key = (act, width)
        table = self._act_tables.get(key)
        if table is None:
            kernel = act_mul_kernel()
            if kernel is None:
                return None
            table = self._act_tables[key] = kernel.table(*key)
        return table

    def _layer_norms(self, w: DecoderLayerWeights) -> LayerNorms:
        if self.cfg.sandwich_norm:
            return LayerNorms(qk=w.qk_norm, out=w.post_attn_norm, ffn=w.pre_ffn_norm, down=w.post_ffn_norm)
        return LayerNorms(qk=w.qk_norm, out=None, ffn=w.post_attn_norm, down=None)

    _NORMS = ("input_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm", "qk_norm")

    def _float32_elementwise(self) -> None:
        """With int8 layers the activations are float32 (see forward), so what they meet
        element-wise (norm weights, eps, RoPE tables) becomes float32 too: a CPU kernel
        casts a mixed-dtype operand to a temporary on every call (about 200 casts per
        decode step). Norm weights and eps keep their values (a bfloat16 is a float32);
        the RoPE tables are recomputed unrounded."""
        for w in self.layers:
            for name in self._NORMS:
                weight = getattr(w, name)
                if weight is not None:
                    weight.data = weight.data.float()
        if self.final_norm is not None:
            self.final_norm.data = self.final_norm.data.float()
        self._eps = self._eps.float()
        for table in self._rope.values():
            table.set_dtype(torch.float32)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, max_position: int,
                backend: AttentionBackend, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (first stage; None elsewhere), positions: [T] long on the model's device;
        hidden_in [T, hidden]: the previous stage's output (other stages). Returns
        stage_output: the final hidden [T, hidden] on the last stage, else the residual stream."""
        cfg = self.cfg
        h = self.stage_input(input_ids, hidden_in).to(self.dtype)
        if self.int8_layers:
            rope = {t: table.lookup(positions, max_position) for t, table in self._rope.items()}
            return self.stage_output(self._int8_layers(h, rope, backend))
        nq, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self._eps
        inv_hd = 1.0 / hd
        T = positions.shape[0]
        if not self._linears:
            self.build_linears(release_weights=False)
        chains = None if self._dtype_chains is None else self._dtype_chains.for_rows(T)
        # A step the compiled chains may take normalises as they do, eager or not (rms_norm);
        # a batch-invariant model every step.
        exact = self.batch_invariant or (self._dtype_chains is not None and T >= self._dtype_chains.min_rows)
        # bf16 norms by the native kernels where they are built (their chains with exact sums);
        # a float32 model's large steps by their float32 forms where _native_chains says
        native = self.dtype == torch.bfloat16 and h.device.type == "cpu"
        float32_native = self._float32_native if exact else frozenset()
        qk_kernel = qk_norm_rope_kernel() if native or "qk_out" in float32_native else None
        norms = residual_norms_kernel() if native or "residual" in float32_native else None
        if self.decode_stack is not None and chains is None and not exact:
            # The loop below in one native call, for the decode steps it takes (decode_stack.py).
            # bf16 takes the activation from act_mul's table; float32 computes it
            table = self._act_table(self._act, cfg.intermediate_size) if self.dtype == torch.bfloat16 else None
            final = self.decode_stack(h, positions, max_position, self._rope, backend, table)
            if final is not None:
                return final if self.decode_stack.final_normed else self.stage_output(final)
        rope = {t: table.lookup(positions, max_position) for t, table in self._rope.items()}
        if chains is not None:
            assert self._dtype_chains is not None
            try:
                return self.stage_output(self._compiled_layer_stack(h, rope, backend, chains, qk_kernel, norms))
            except Exception as exc:  # noqa: BLE001 - the general loop below computes the step again
                # Its K/V writes are rewritten with the same slots.
                self._dtype_chains.drop_compiled(exc)
        x_next: torch.Tensor | None = None  # the next layer's input norm, where the last add made it
        for k, (i, w, lin) in enumerate(zip(self.layer_ids, self.layers, self._linears)):
            if x_next is not None:
                x = x_next
            else:
                x = h if w.input_norm is None else self._norm(h, w.input_norm, norms, exact)
            qkv = lin.qkv(x)
            # q | k | v per token: after RoPE in place, k and v are adjacent, which is
            # exactly one KV cache slot ([2, KVH, D]).
            qk = qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd)
            cos, sin = rope.get(cfg.layer_types[i], (None, None))  # EXAONE 4's full layers have no RoPE
            if self._projection_norm is None and qk_kernel is not None and qk_kernel.supports(qk, w.qk_norm, cos):
                qk_kernel(qk, w.qk_norm, eps, cos, sin)  # the chain below with exact sums, in one pass
            else:
                if self._projection_norm is not None:
                    self._projection_norm.apply_(qk, w.qk_norm, nq, eps)
                elif w.qk_norm is not None:
                    torch.mul(rms_norm(qk, None, eps, inv_hd, exact_sums=exact), w.qk_norm, out=qk)
                if cos is not None:
                    apply_rope_(qk, cos, sin)  # q and k share positions: one rotation covers both
            # the model dtype (a no-op unless int8 layers); attention stores K/V in the cache's
            qkv = qkv.to(self.dtype)
            attn = backend.attention(i, qkv[:, : nq * hd].view(T, nq, hd), qkv[:, nq * hd :].view(T, 2, nkv, hd))
            if cfg.sandwich_norm:
                h, x = self._add_norm(h, self.reduce(lin.o(attn)), w.post_attn_norm, w.pre_ffn_norm, norms, exact)
            elif cfg.post_norm:  # OLMo: the MLP reads the residual stream itself
                h, _ = self._add_norm(h, self.reduce(lin.o(attn)), w.post_attn_norm, None, norms, exact)
                x = h
            else:
                h = self.add_row_parallel(h, attn, lin.o, lin.o_residual)
                x = self._norm(h, w.post_attn_norm, norms, exact)
            gate_up = lin.gate_up(x)
            computed = "act_mul" in float32_native  # then in place, as _gate_up_act's
            y = self._act_mul(gate_up, self._large_act if exact else self._act,
                              out=gate_half(gate_up) if computed else None, computed=computed)
            del gate_up
            if w.post_ffn_norm is not None:
                following = self.layers[k + 1].input_norm if k + 1 < len(self.layers) else None
                h, x_next = self._add_norm(h, self.reduce(lin.down(y)), w.post_ffn_norm, following, norms, exact)
            else:
                h = self.add_row_parallel(h, y, lin.down, lin.down_residual)
        return self.stage_output(h)

    def _norm(self, h: torch.Tensor, w: torch.Tensor, kernel: ResidualNorms | None, exact: bool) -> torch.Tensor:
        """rms_norm(h) * w: the native kernel where it takes these (exact sums), else eager."""
        if kernel is not None and kernel.supports_norm(h, w):
            return kernel.norm(h, w, self._eps)
        return rms_norm(h, w, self._eps, 1.0 / self.cfg.hidden_size, exact_sums=exact)

    def _add_norm(self, h: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | None,
                  kernel: ResidualNorms | None, exact: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(h + rms_norm(y) * w1, rms_norm of that * w2 or None): the native kernel where it
        takes these (exact sums, as residual_norms_eager), else the eager chain."""
        if kernel is not None and kernel.supports(h, y, w1, w2):
            return kernel(h, y, w1, w2, self._eps)
        inv_h = 1.0 / self.cfg.hidden_size
        h = h + rms_norm(y, w1, self._eps, inv_h, exact_sums=exact)
        return h, None if w2 is None else rms_norm(h, w2, self._eps, inv_h, exact_sums=exact)

    def _compiled_layer_stack(self, h: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                              backend: AttentionBackend, chains: DecoderChains, qk_kernel: QKNormRope | None,
                              norms_kernel: ResidualNorms | None) -> torch.Tensor:
        """forward's loop for a large step, its element-wise work in decoder_chains' compiled
        functions (only for layers _chains_cover_layers says they cover); gate|up and its
        activation in row blocks (_gate_up_act). The q/k
        norm + RoPE, the sandwich norms' adds and act * up go to the native kernels where
        they are built: the same values (each chain's, bit for bit) in half the time or less."""
        cfg = self.cfg
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = h.shape[0]
        layers = list(zip(self.layer_ids, self.layers, self._linears))
        x: torch.Tensor | None = self._norm(h, layers[0][1].input_norm, norms_kernel, True)
        for k, (i, w, lin) in enumerate(layers):
            norms = self._layer_norms(w)
            cos, sin = rope.get(cfg.layer_types[i], (None, None))
            qkv = lin.qkv(x)
            qk = qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd)
            if norms.qk is None and cos is None:
                pass  # a layer without a q/k norm or RoPE: nothing to do (qk_out would copy qkv)
            elif qk_kernel is not None and qk_kernel.supports(qk, norms.qk, cos):
                qk_kernel(qk, norms.qk, self._eps, cos, sin)
            else:
                qkv = chains.qk_out(qkv, norms.qk, cos, sin)
            attn = backend.attention(i, qkv[:, : nq * hd].view(T, nq, hd), qkv[:, nq * hd :].view(T, 2, nkv, hd))
            # Each product is dropped once read: a step's largest temporaries are its own
            # layer's, never the last layer's too (the heap keeps its high-water: heap.py).
            del qkv, qk
            if norms.out is None:  # pre-norm: the residual add fused into the matmul, as forward's
                h, x = self._chain_residual(chains, norms_kernel, lin.o_residual(h, attn), None, None, norms.ffn)
            else:
                h, x = self._chain_residual(chains, norms_kernel, h, lin.o(attn), norms.out, norms.ffn)
            del attn
            assert x is not None
            y = self._gate_up_act(lin, x, chains.act_mul)
            next_norm = layers[k + 1][1].input_norm if k + 1 < len(layers) else None
            if norms.down is None:
                h, x = self._chain_residual(chains, norms_kernel, lin.down_residual(h, y), None, None, next_norm)
            else:
                h, x = self._chain_residual(chains, norms_kernel, h, lin.down(y), norms.down, next_norm)
            del y
        return h

    def _gate_up_act(self, lin: LayerLinears, x: torch.Tensor,
                     general: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """act(gate) * up of a large step's rows x: gate|up in row blocks of at most
        dtype_mlp_block_rows (mlp_row_blocks.py), each block's act * up written into its rows
        of one result (rows are independent: the same values as one call). A float32 step of
        one block takes its result in place, in the product's gate half (a view with the
        product's row stride, which the down projection reads as it is): no second buffer."""
        blocks = row_blocks(x.shape[0], self.dtype_mlp_block_rows)
        computed = "act_mul" in self._float32_native
        first = lin.gate_up(x[: blocks[0][1]])
        if len(blocks) == 1:
            return self._act_mul(first, self._large_act, general, out=gate_half(first) if computed else None,
                                 computed=computed)
        y = first.new_empty(x.shape[0], first.shape[1] // 2)
        self._act_mul(first, self._large_act, general, out=y[: blocks[0][1]], computed=computed)
        del first  # one block's product at a time
        for a, b in blocks[1:]:
            self._act_mul(lin.gate_up(x[a:b]), self._large_act, general, out=y[a:b], computed=computed)
        return y

    def _chain_residual(self, chains: DecoderChains, kernel: ResidualNorms | None, h: torch.Tensor,
                        out: torch.Tensor | None, out_norm: torch.Tensor | None, next_norm: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """chains.residual(h, out, out_norm, next_norm), by the native kernel where it takes
        them (out None: a pre-norm layer, whose matmul made the add: the norm alone)."""
        if out is None:
            if next_norm is None:
                return h, None
            if kernel is not None and kernel.supports_norm(h, next_norm):
                return h, kernel.norm(h, next_norm, self._eps)
        elif out_norm is not None and kernel is not None and kernel.supports(h, out, out_norm, next_norm):
            return kernel(h, out, out_norm, next_norm, self._eps)
        return chains.residual(h, out, out_norm, next_norm)

    def _int8_layers(self, h: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     backend: AttentionBackend) -> torch.Tensor:
        """The layers with int8 x int8 matmuls: each matmul's input quantized in the chain that
        produces it (int8_chains.py). The activations stay float32 between matmuls: the
        GEMMs return float32 and quantize their inputs from float32, so rounding to the
        model dtype in between would only add work and error. K/V are still stored, and
        attention computed, in the model dtype. Only plain pre-norm and sandwich-norm
        decoders on one rank get int8 layers (models/loaders/loader._int8_smoothing).
        A step of many rows runs the compiled chains (compiled_chains.py); should they fail,
        the step is computed again eager (its K/V writes are rewritten with the same slots)."""
        assert self._chains is not None
        chains = self._chains.for_rows(h.shape[0])
        try:
            return self._int8_layer_stack(h, rope, backend, chains)
        except Exception as exc:
            if chains is self._chains.eager:
                raise
            self._chains.drop_compiled(exc)
            return self._int8_layer_stack(h, rope, backend, self._chains.eager)

    def _int8_layer_stack(self, h: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                          backend: AttentionBackend, chains: Int8Chains) -> torch.Tensor:
        layer_types, layers = self.cfg.layer_types, self._int8
        path = layers[0].qkv.path  # every matmul's
        h, x, x_scale = chains.residual(path, None, None, None, h, None, layers[0].input_norm)
        for k, (i, m) in enumerate(zip(self.layer_ids, layers)):
            cos, sin = rope.get(layer_types[i], (None, None))
            q, kv = chains.qkv_out(m.qkv.product(path, x), x_scale, m.qkv_bias, m.qk_norm, cos, sin)
            x, x_scale = chains.quant(path, backend.attention(i, q, kv))
            h, x, x_scale = chains.residual(path, m.o.product(path, x), x_scale, m.o_bias, h, m.o_norm, m.ffn_norm)
            x, x_scale = gate_up_act(chains, path, m, x, x_scale, self.mlp_block_rows)
            next_norm = layers[k + 1].input_norm if k + 1 < len(layers) else None
            h, x, x_scale = chains.residual(path, m.down.product(path, x), x_scale, m.down_bias, h, m.down_norm,
                                            next_norm)
        return h

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """The argmax token of each row's logits, without materialising the logits."""
        if self._head is None:
            self.build_linears(release_weights=False)
        assert self._head is not None
        return self._head.greedy(hidden, self.cfg.final_softcap)

    def span_logits(self, hidden: torch.Tensor, inv_temperature: torch.Tensor, stored: bool = True) -> SpanLogits:
        """The logits of the rows that sample, with the span summaries sampling reads; with
        `stored` False the head may keep only the summaries (its logits are then computed
        again where they are read: OutputHead.span_logits)."""
        if self._head is None:
            self.build_linears(release_weights=False)
        assert self._head is not None
        return self._head.span_logits(hidden, inv_temperature, self.cfg.final_softcap, stored=stored)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocab logits for the rows that sample only (the head dominates large vocabularies)."""
        if self._head is None:
            self.build_linears(release_weights=False)
        assert self._head is not None
        out = self._head(hidden)
        cap = self.cfg.final_softcap
        if cap:
            out = torch.tanh(out / cap) * cap
        return out
