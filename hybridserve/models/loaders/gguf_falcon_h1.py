"""GGUF spec of Falcon-H1 (`falcon-h1`), as llama.cpp's converter writes it.

Every decoder layer holds attention and a Mamba2 mixer side by side, then an MLP. Tensors of
layer N (numpy shapes; I = mixer width, H = mixer heads, G = groups, N = state size):
- attention as Llama's, Q/K not permuted (llama.cpp rotates Falcon-H1 in HF's half-split
  layout); `attn_norm` is the one norm before both attention and mixer (HF input_layernorm);
- `ffn_norm` under a bare name (no `.weight`: the converter's name map matches HF's full
  `pre_ff_layernorm.weight`, and llama.cpp's runtime reads it so), HF pre_ff_layernorm;
- mixer: `ssm_in` (rows z | x | B | C | dt as HF's in_proj), `ssm_conv1d` weight [I + 2GN, K]
  and bias, `ssm_dt.bias` (HF dt_bias), bare `ssm_a` [H, 1] = -exp(A_log), bare `ssm_d`
  [H, 1], `ssm_norm.weight` [G, I / G] when the model has the gated norm, `ssm_out`.

Multipliers: the converter folds every one of HF's into the weights (embedding, lm_head,
attention in / key / out, the five per-segment in_proj factors times ssm_in, ssm_out, and
the MLP's gate and down), and writes none as metadata. The config written here therefore sets
each to 1 (`FOLDED_MULTIPLIERS`), which with the folded weights gives HF's outputs. Files of
Falcon-H1's own converter (before llama.cpp's) carry multiplier keys and are refused.

Config facts: the mixer's sizes from the `ssm.*` keys (time_step_rank is the head count);
the gated norm's order is llama.cpp's, y * silu(z) normed per group (HF
mamba_norm_before_gate = false), present when `ssm_norm` is; without `ssm_norm` the mixer
only gates (mamba_rms_norm = false). A tied file (no `output`) runs as llama.cpp runs it: the
stored embedding, which carries embedding_multiplier, as the head.
"""

from __future__ import annotations

from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_hybrid_spec import FEED_FORWARD_BLOCK_NAMES, HybridArchSpec, flat, mixer_merges
from hybridserve.models.loaders.gguf_spec import common_config, float32_value, renamed, required, reshaped, tensor_rows

FOLDED_MULTIPLIERS: dict[str, Any] = {
    "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "attention_in_multiplier": 1.0,
    "key_multiplier": 1.0, "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
    "ssm_multipliers": [1.0] * 5, "mlp_multipliers": [1.0, 1.0],
}
ROPE_THETA_WITHOUT_KEY = 10_000.0  # llama.cpp's RoPE base for a file without rope.freq_base


def _refuse_unfolded(header: GGUFHeader) -> None:
    """Files from Falcon-H1's own converter, before llama.cpp's, carry the multipliers as
    metadata (`mlp_gate_multiplier`, `ssm.has_mup`, ...): their weights are not known to hold
    them folded, so they are refused rather than run with the multipliers possibly lost."""
    prefix = f"{header.architecture}."
    # (rope.scaling.yarn_log_multiplier is llama.cpp's own key, not one of them)
    unfolded = sorted(key for key in header.metadata if key.startswith(prefix) and not key.startswith(f"{prefix}rope.")
                      and key.endswith(("multiplier", "has_mup")))
    if unfolded:
        raise ConfigError(f"{header.path} carries {unfolded[0]}, a key of Falcon-H1's converter before "
                          f"llama.cpp's; reconvert the model with llama.cpp's convert_hf_to_gguf.py")


def _falcon_h1_config(header: GGUFHeader) -> dict[str, Any]:
    _refuse_unfolded(header)
    config = common_config(header)
    width = int(required(header, "ssm.inner_size"))
    heads = int(required(header, "ssm.time_step_rank"))
    if heads < 1 or width % heads:
        raise ConfigError(f"{header.path}: mixer width {width} (ssm.inner_size) does not split into "
                          f"{heads} heads (ssm.time_step_rank)")
    gated_norm = tensor_rows(header, "blk.0.ssm_norm.weight") is not None
    config.update(
        architectures=["FalconH1ForCausalLM"], model_type="falcon_h1", hidden_act="silu",
        head_dim=int(header.arch_value("attention.key_length")
                     or config["hidden_size"] // config["num_attention_heads"]),
        # float32 in the file: the shortest form gives back the published 1e11, not 99999997952
        rope_theta=float32_value(header.arch_value("rope.freq_base", ROPE_THETA_WITHOUT_KEY)),
        rope_scaling=config.get("rope_scaling"),
        mamba_d_ssm=width, mamba_n_heads=heads, mamba_d_head=width // heads,
        mamba_d_state=int(required(header, "ssm.state_size")), mamba_n_groups=int(required(header, "ssm.group_count")),
        mamba_d_conv=int(required(header, "ssm.conv_kernel")),
        mamba_conv_bias=tensor_rows(header, "blk.0.ssm_conv1d.bias") is not None,
        mamba_proj_bias=tensor_rows(header, "blk.0.ssm_in.bias") is not None,
        mamba_rms_norm=gated_norm, mamba_norm_before_gate=False,
        rms_norm_eps=float32_value(required(header, "attention.layer_norm_rms_epsilon")),
        **FOLDED_MULTIPLIERS,
    )
    return config


_MIXER = "mamba."
FALCON_H1_SPEC = HybridArchSpec(
    gguf_arch="falcon-h1", family="falcon_h1",
    block_names={
        **FEED_FORWARD_BLOCK_NAMES,
        "ffn_norm": "pre_ff_layernorm", "ssm_in": f"{_MIXER}in_proj", "ssm_conv1d": f"{_MIXER}conv1d",
        "ssm_out": f"{_MIXER}out_proj",
    },
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=False, build_config=_falcon_h1_config,
    block_merges=(
        *mixer_merges(_MIXER, state_shape=flat),
        renamed(f"{_MIXER}dt_bias", "ssm_dt.bias"),
        reshaped(f"{_MIXER}norm.weight", "ssm_norm.weight", hf_shape=flat),
        renamed("pre_ff_layernorm.weight", "ffn_norm"),
    ),
)
