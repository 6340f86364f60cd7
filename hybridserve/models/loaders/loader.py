"""Load an HF model directory (config.json + safetensors, possibly sharded) into a DecoderLM.

HF parameter names (`model.layers.{i}.self_attn.q_proj.weight`, ...) are mapped onto the
fused layout of `DecoderLM`. Every tensor the architecture needs must be present and have
the expected shape; unknown tensors are an error too (a checkpoint carrying weights we
would ignore is a checkpoint we would run wrong).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from hybridserve.models.loaders.file_rows import file_rows_available
from hybridserve.models.loaders.safetensors_map import MappedCheckpoint
from hybridserve.models.loaders.checkpoint import (Weights, fill_ends, open_checkpoint, place_weights, take_gate_up,
                                                  take_qkv, take_row_bias)
from hybridserve.models.arch.cohere2 import Cohere2LM
from hybridserve.models.config import ModelConfig, load_model_config
from hybridserve.models.arch.decoder import DecoderLM
from hybridserve.models.arch.gemma3_multimodal import ARCHITECTURE as GEMMA3_MULTIMODAL
from hybridserve.models.platform.heap import release_free_heap
from hybridserve.models.arch.gpt_oss import GptOssLM
from hybridserve.models.loaders.gemma3_multimodal_checkpoint import TextCheckpoint
from hybridserve.models.loaders.gpt_oss_loader import fill_gpt_oss
from hybridserve.models.layers.int8 import BlockDone, int8_gemm_available
from hybridserve.models.arch.llama4 import Llama4LM
from hybridserve.models.loaders.llama4_loader import fill_llama4, interleaved_to_half_split
from hybridserve.models.parallel import PipelineStage, TPGroup, group_rows
from hybridserve.models.layers.head import GROUP_LAYERS, head_quantization
from hybridserve.models.loaders.layer_groups import (check_groups_load, check_holds_groups, fill_layer_groups,
                                                     move_layer_groups)
from hybridserve.models.layers.smoothing import Encode, Smoothing, calibration_sequences, file_encoder, smooth

if TYPE_CHECKING:
    from hybridserve.models.arch.mamba_lm import MambaLM

_EMBED_NAME = "model.embed_tokens.weight"


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, quantization: str = "none", stage: PipelineStage | None = None,
               tp: TPGroup | None = None, encode: Encode | None = None, compile: bool = True) -> DecoderLM | MambaLM:
    """Build a DecoderLM (a MambaLM for Mamba2 / Bamba, its subclasses Lfm2LM for LFM2, JambaLM for Jamba
    and Qwen3NextLM for Qwen3-Next) from an HF directory, weights on `device` in `dtype`, the output head
    quantized as `quantization` says (none, int8, int4: see models/layers/head.py); under
    GROUP_LAYERS the decoder's linears are the int8 groups a GGUF's conversion kept
    (layer_groups.py; ConfigError for a checkpoint without them or a model they cannot serve).
    With `stage` and `tp` (models/parallel.py) only that pipeline stage's layers are read, cut
    to that tensor-parallel rank's heads and columns (ConfigError where the sizes do not divide).
    `encode` (the engine's tokenizer) tokenizes the int8 calibration texts (models/layers/smoothing.py);
    `compile`: int8 layers' element-wise chains compiled for large steps (models/arch/compiled_chains.py)."""
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    if stage is not None:
        stage.layers(cfg.num_layers)  # ConfigError now, before any weight is read
    groups = quantization == GROUP_LAYERS
    if groups:
        check_groups_load(cfg, tp)
    if cfg.family == "falcon_h1":  # a mixer beside attention in every layer: two cache layers each
        from hybridserve.models.loaders.falcon_h1_loader import load_falcon_h1_model

        return load_falcon_h1_model(model_dir, cfg, device, dtype, stage, tp)
    if cfg.gated_deltanet is not None:
        from hybridserve.models.loaders.qwen3_next_loader import load_qwen3_next_model

        return load_qwen3_next_model(model_dir, cfg, device, dtype, stage, tp)
    if cfg.mamba is not None:
        from hybridserve.models.loaders.mamba_loader import load_mamba_model

        return load_mamba_model(model_dir, cfg, device, dtype, stage, tp)
    if cfg.short_conv is not None:
        from hybridserve.models.loaders.lfm2_loader import load_lfm2_model

        return load_lfm2_model(model_dir, cfg, device, dtype, stage, tp)
    if cfg.jamba is not None:
        from hybridserve.models.loaders.jamba_loader import load_jamba_model

        return load_jamba_model(model_dir, cfg, device, dtype, stage, tp)
    checkpoint = open_checkpoint(model_dir)
    check_holds_groups(checkpoint.names(), model_dir, groups)
    if cfg.architecture == GEMMA3_MULTIMODAL:
        checkpoint = TextCheckpoint(checkpoint)  # its language model, under the causal-LM names
    w = Weights(checkpoint, dtype)
    if cfg.family == "llama4":  # its own layer layout (MoE, per-layer MLP sizes, RoPE order)
        llama4 = Llama4LM(cfg, dtype, stage, tp)
        fill_llama4(llama4, cfg, w)
        model: DecoderLM = llama4
    elif cfg.family == "gpt_oss":  # sinks and a mixture of experts in every layer
        gpt_oss = GptOssLM(cfg, dtype, stage, tp)
        fill_gpt_oss(gpt_oss, cfg, w)
        model = gpt_oss
    else:  # Cohere2: its own block (parallel attention + MLP, LayerNorm) on the same weights
        model = (Cohere2LM if cfg.family == "cohere2" else DecoderLM)(cfg, dtype, stage, tp)
        _fill(model, cfg, w, groups)
    place_weights(model, cfg, w, device)
    if groups:
        move_layer_groups(list(model.layers), torch.device(device))
    model.setup_rope(torch.device(device), cfg.max_position_embeddings)
    head_name = _EMBED_NAME if cfg.tie_word_embeddings else "lm_head.weight"
    # The head's smoothing reads every row of a mapped head once more: its pages go back as read.
    smoothing = _int8_smoothing(model, model_dir, quantization, encode,
                                head_rows_read=partial(_release_rows, w, head_name))
    model.build_linears(quantization=quantization, release_head_rows=_head_release(w, head_name),
                        smoothing=smoothing.layers, head_factors=smoothing.head, compile=compile)
    w.release_all()
    _read_embedding_from_file(model, checkpoint)
    release_free_heap()  # the fused layers' source copies and packing temporaries (models/platform/heap.py)
    return model.eval()


def _read_embedding_from_file(model: DecoderLM, checkpoint: MappedCheckpoint | TextCheckpoint) -> None:
    """Where the embedding is a view of the mapped checkpoint (stored in the model dtype, on
    CPU), look its rows up with pread instead (models/loaders/file_rows.py)."""
    if model.embed is None or _EMBED_NAME not in checkpoint.names() or not file_rows_available():
        return
    stored = checkpoint.tensor(_EMBED_NAME)
    if model.embed.data_ptr() == stored.data_ptr() and model.embed.dtype == stored.dtype:
        model.embed_rows = checkpoint.row_reader(_EMBED_NAME)


def _release_rows(w: Weights, name: str, start: int, stop: int) -> None:
    w.checkpoint.release(name, (start, stop))


def _int8_smoothing(model: DecoderLM, model_dir: Path, quantization: str, encode: Encode | None,
                    head_rows_read: BlockDone | None = None) -> Smoothing:
    """The smoothing of the int8 x int8 matmuls (models/layers/smoothing.py): the decoder's
    linears under --quantization int8, the output head under every mode that makes it int8
    (models/layers/head.head_quantization). Neither (both None) where nothing is int8 x int8
    (no int8 GEMM here: models/layers/int8.int8_gemm_available; the head is weight-only int8
    then), the model is not a plain pre-norm decoder (Llama 4's MoE layers; OLMo's
    post-norms leave no norm before qkv to carry the factors), is split over processes
    (the calibration forward needs every layer on one rank), or there is no tokenizer to
    calibrate with (`encode`, else the directory's tokenizer.json). Without smoothing the
    decoder's linears stay in the model dtype; the head is quantized as it is."""
    layers, head = quantization == "int8", head_quantization(quantization) == "int8"
    if (not (layers or head) or type(model) is not DecoderLM or model.cfg.post_norm or model.tp is not None
            or not (model.stage.is_first and model.stage.is_last)
            or model.final_norm is None or model.final_norm.device.type != "cpu" or not int8_gemm_available()):
        return Smoothing(layers=None, head=None)
    encode = encode or file_encoder(model_dir)
    if encode is None:
        return Smoothing(layers=None, head=None)
    return smooth(model, calibration_sequences(encode, model.cfg.sliding_window), layers=layers, head=head,
                  head_rows_read=head_rows_read)


def _head_release(w: Weights, head_name: str) -> Callable[[int, int], None]:
    """What the head gives its rows back through (models/layers/head.py): each chunk's file pages
    once the chunk has its own packed or quantized copy (harmless where the head was
    converted or moved anyway). The first call also gives back every other page read so
    far: the layers are packed before the head, and packing read the weights kept as file
    views again (o and down: ~70 MB for Gemma 3 270M), pages that would otherwise stay
    resident through the head's quantization, the load's peak. Releasing is always safe:
    a page touched again is read again from the file."""
    first = True

    def release(start: int, stop: int) -> None:
        nonlocal first
        if first:
            w.release_all()
            first = False
        _release_rows(w, head_name, start, stop)

    return release


def _fill(model: DecoderLM, cfg: ModelConfig, w: Weights, groups: bool = False) -> None:
    """HF tensors into `model` (its stage's layers, its rank's share); `cfg` the global config;
    `groups`: the linears' weights as int8 groups (layer_groups.py)."""
    H, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq = cfg.num_heads
    gemma = cfg.gemma_norm
    tp = model.tp or TPGroup()
    local = model.cfg

    def norm(name: str, size: int) -> torch.Tensor:
        t = w.take(name, (size,))
        return 1.0 + t if gemma else t  # Gemma's RMSNorm scales by (1 + w)

    def final_norm(t: torch.Tensor) -> torch.Tensor:
        t = 1.0 + t if gemma else t
        # Cohere2's logit scale is folded into the final norm's weight: logits = (norm(h) * s) W^T.
        return t * cfg.logit_scale if cfg.logit_scale != 1.0 else t

    fill_ends(model, cfg, w, _EMBED_NAME, "model.norm.weight", final_norm)
    w.keep_layers("model.layers.", model.layer_ids)
    with torch.no_grad():
        for i, layer in zip(model.layer_ids, model.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            if layer.input_norm is not None:
                layer.input_norm.copy_(norm(p + "input_layernorm.weight", H))
            qk = _same_rows
            if cfg.family == "cohere2" and cfg.layer_types[i] in cfg.rope:
                qk = partial(interleaved_to_half_split, head_dim=hd)  # Cohere rotates pairs (2i, 2i+1): see cohere2.py
            if groups:
                fill_layer_groups(layer, cfg, w, p, qk)
            else:  # assigned, not copied: a tensor in the model dtype stays a view of the mapped file
                layer.qkv.data = take_qkv(w, cfg, tp, a, qk=qk)
                layer.o.data = tp.shard(w.take(a + "o_proj.weight", (H, nq * hd)), 1)
                layer.gate_up.data = take_gate_up(w, tp, p + "mlp.", (I, H))
                layer.down.data = tp.shard(w.take(p + "mlp.down_proj.weight", (H, I)), 1)
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(take_qkv(w, cfg, tp, a, "bias", qk=qk))
            if cfg.o_bias:
                take_row_bias(w, layer.o_bias, a + "o_proj.bias", H)
            if layer.qk_norm is not None and cfg.qk_norm_over_projection:
                # One weight per element of the whole projection: this rank's heads' rows of it.
                qn = tp.shard(norm(a + "q_norm.weight", nq * hd).view(nq, hd))
                kn = group_rows(tp, cfg.num_kv_heads, norm(a + "k_norm.weight", cfg.num_kv_heads * hd).view(-1, hd))
                layer.qk_norm.copy_(torch.cat([qn, kn]))
            elif layer.qk_norm is not None:
                qn = norm(a + "q_norm.weight", hd)
                kn = norm(a + "k_norm.weight", hd)
                layer.qk_norm.copy_(torch.cat([qn.expand(local.num_heads, hd), kn.expand(local.num_kv_heads, hd)]))
            if layer.post_attn_norm is not None:
                layer.post_attn_norm.copy_(norm(p + "post_attention_layernorm.weight", H))
            if layer.pre_ffn_norm is not None:
                layer.pre_ffn_norm.copy_(norm(p + "pre_feedforward_layernorm.weight", H))
            if layer.post_ffn_norm is not None:
                layer.post_ffn_norm.copy_(norm(p + "post_feedforward_layernorm.weight", H))
            m = p + "mlp."
            if layer.gate_up_bias is not None:
                layer.gate_up_bias.copy_(take_gate_up(w, tp, m, (I,), "bias"))
                take_row_bias(w, layer.down_bias, m + "down_proj.bias", H)
            w.release_taken()


def _same_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows as stored (RoPE in the half-split order the decoder applies)."""
    return t
