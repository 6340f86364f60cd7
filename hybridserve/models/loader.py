"""Load an HF model directory (config.json + safetensors, possibly sharded) into a DecoderLM.

HF parameter names (`model.layers.{i}.self_attn.q_proj.weight`, ...) are mapped onto the
fused layout of `DecoderLM`. Every tensor the architecture needs must be present and have
the expected shape; unknown tensors are an error too (a checkpoint carrying weights we
would ignore is a checkpoint we would run wrong).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.config import ModelConfig, load_model_config
from hybridserve.models.decoder import DecoderLM
from hybridserve.models.llama4 import Llama4LM, fill_llama4

if TYPE_CHECKING:
    from hybridserve.models.mamba_lm import MambaLM

# Buffers some checkpoints carry that hold nothing we need (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _open_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no .safetensors weights in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(model_dir / name)))
    return tensors


class _Weights:
    """Pops tensors by HF name, checking shape and converting dtype; tracks leftovers."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.tensors = tensors
        self.dtype = dtype

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.tensors.pop(name, None)
        if t is None:
            raise ConfigError(f"checkpoint is missing tensor {name}")
        if tuple(t.shape) != shape:
            raise ConfigError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(self.dtype)

    def leftovers(self) -> list[str]:
        return sorted(k for k in self.tensors if not k.endswith(_IGNORED_SUFFIXES))


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> DecoderLM | MambaLM:
    """Build a DecoderLM (a MambaLM for Mamba2 / Bamba) from an HF directory, weights on `device` in `dtype`."""
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    if cfg.mamba is not None:
        from hybridserve.models.mamba_loader import load_mamba_model

        return load_mamba_model(model_dir, cfg, device, dtype)
    w = _Weights(_open_tensors(model_dir), dtype)
    if cfg.family == "llama4":  # its own layer layout (MoE, per-layer MLP sizes, RoPE order)
        llama4 = Llama4LM(cfg, dtype)
        fill_llama4(llama4, cfg, w)
        model: DecoderLM = llama4
    else:
        model = DecoderLM(cfg, dtype)
        _fill(model, cfg, w)
    place_weights(model, cfg, w, device)
    model.setup_rope(torch.device(device), cfg.max_position_embeddings)
    model.build_linears()
    return model.eval()


def place_weights(model: torch.nn.Module, cfg: ModelConfig, w: _Weights, device: str | torch.device) -> None:
    """After filling: refuse checkpoint tensors nothing read, move to `device`, tie the head."""
    left = w.leftovers()
    if left:
        raise ConfigError(f"checkpoint has {len(left)} tensor(s) this implementation would ignore, e.g. {left[0]}")
    model.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head = model.embed


def _fill(model: DecoderLM, cfg: ModelConfig, w: _Weights) -> None:
    H, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_heads, cfg.num_kv_heads
    gemma = cfg.gemma_norm

    def norm(name: str, size: int) -> torch.Tensor:
        t = w.take(name, (size,))
        return 1.0 + t if gemma else t  # Gemma's RMSNorm scales by (1 + w)

    with torch.no_grad():
        model.embed.copy_(w.take("model.embed_tokens.weight", (cfg.vocab_size, H)))
        model.final_norm.copy_(norm("model.norm.weight", H))
        if not cfg.tie_word_embeddings:
            model.lm_head = torch.nn.Parameter(w.take("lm_head.weight", (cfg.vocab_size, H)), requires_grad=False)
        else:
            w.tensors.pop("lm_head.weight", None)  # some tied checkpoints still store it
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.input_norm.copy_(norm(p + "input_layernorm.weight", H))
            layer.qkv.copy_(torch.cat([w.take(a + "q_proj.weight", (nq * hd, H)),
                                       w.take(a + "k_proj.weight", (nkv * hd, H)),
                                       w.take(a + "v_proj.weight", (nkv * hd, H))]))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([w.take(a + "q_proj.bias", (nq * hd,)),
                                                w.take(a + "k_proj.bias", (nkv * hd,)),
                                                w.take(a + "v_proj.bias", (nkv * hd,))]))
            layer.o.copy_(w.take(a + "o_proj.weight", (H, nq * hd)))
            if layer.o_bias is not None:
                layer.o_bias.copy_(w.take(a + "o_proj.bias", (H,)))
            if layer.qk_norm is not None:
                qn = norm(a + "q_norm.weight", hd)
                kn = norm(a + "k_norm.weight", hd)
                layer.qk_norm.copy_(torch.cat([qn.expand(nq, hd), kn.expand(nkv, hd)]))
            layer.post_attn_norm.copy_(norm(p + "post_attention_layernorm.weight", H))
            if layer.pre_ffn_norm is not None and layer.post_ffn_norm is not None:
                layer.pre_ffn_norm.copy_(norm(p + "pre_feedforward_layernorm.weight", H))
                layer.post_ffn_norm.copy_(norm(p + "post_feedforward_layernorm.weight", H))
            m = p + "mlp."
            layer.gate_up.copy_(torch.cat([w.take(m + "gate_proj.weight", (I, H)),
                                           w.take(m + "up_proj.weight", (I, H))]))
            if layer.gate_up_bias is not None and layer.down_bias is not None:
                layer.gate_up_bias.copy_(torch.cat([w.take(m + "gate_proj.bias", (I,)),
                                                    w.take(m + "up_proj.bias", (I,))]))
                layer.down_bias.copy_(w.take(m + "down_proj.bias", (H,)))
            layer.down.copy_(w.take(m + "down_proj.weight", (H, I)))
