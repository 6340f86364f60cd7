"""Pipeline stages and tensor-parallel shards of the tiny models equal the whole model.

Pipeline: P processes (2 and 4) each load one stage (models/parallel.py), chain the residual stream
with dist.send / recv, and the last stage's logits must equal the unsplit model's on the
same flat batch (two prompts, across sliding windows and Llama 4 attention chunks), each
stage having seen only its own global layer indices. Tensor parallel: 2 ranks load their
shards and must both produce the unsharded logits (within float32 summation order). The
unsplit reference itself is checked against HF transformers' logits first.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import AttentionSpec, MambaSpec
from hybridserve.models.config import load_model_config
from hybridserve.models.kv_specs import cached_layers, model_kv_layer_specs
from hybridserve.models.loaders.loader import load_model
from hybridserve.models.parallel import (PipelineStage, TPGroup, check_tp, init_model_parallel, stage_layer_ranges,
                                         tp_sizes_that_work)
from tests.helpers import hf_tiny_mamba
from tests.helpers.dist_ranks import run_ranks
from tests.helpers.flat_backend import FlatBackend, recurrent_state_shapes
from tests.helpers.tiny_models import model_dir

COUNTS = [23, 41]  # two requests' tokens: past the 16-token windows, across a 32-token Llama 4 chunk
# Tensor parallel shards change the summation order of row-parallel products (float32); the
# tiny models' logits reach about 10, so this is 1e-5 of their range, and what float32
# rounding alone gives (the unsplit Bamba's logits differ from HF's by 6e-5; float64 weights
# take the attention models' difference to 0). Pipeline stages run the same operations as
# the whole model: their logits are equal bit for bit.
TP_LOGITS_ATOL = 1e-4


def _ids(counts: list[int] = COUNTS, vocab: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab, (sum(counts),), generator=g)


def run_steps(model: torch.nn.Module, steps: list[list[int]], receive: Callable[[int], torch.Tensor] | None = None,
              send: Callable[[torch.Tensor], None] | None = None) -> dict:
    """Feed the requests' tokens (_ids, request after request) through `model` in `steps`
    (tokens per request per step), with a FlatBackend keeping K/V and Mamba states between
    steps. A stage other than the first gets its hidden_in from `receive(T)`, one other
    than the last passes its output to `send`. The last stage's logits and greedy tokens
    are returned in token order (request after request), as one forward of all would give."""
    backend = FlatBackend(model.cfg, len(COUNTS))
    per_request = _ids().split(COUNTS)
    done = [0] * len(COUNTS)
    logits: list[list[torch.Tensor]] = [[] for _ in COUNTS]
    greedy: list[list[int]] = [[] for _ in COUNTS]
    for counts in steps:
        pos = backend.step(counts)
        ids = torch.cat([per_request[r][done[r] : done[r] + c] for r, c in enumerate(counts)])
        hidden_in = None
        if not model.stage.is_first:
            assert receive is not None
            hidden_in = receive(len(ids))
        with torch.inference_mode():
            h = model(ids if model.stage.is_first else None, pos, int(pos.max()), backend, hidden_in=hidden_in)
            if model.stage.is_last:
                tokens = model.greedy_tokens(h)
                for r, rows in enumerate(model.logits(h).split(counts)):
                    logits[r].append(rows)
                    greedy[r] += tokens[sum(counts[:r]) : sum(counts[: r + 1])]
            else:
                assert send is not None
                send(h.contiguous())
        done = [d + c for d, c in zip(done, counts)]
    out = {"attention_calls": backend.layers_called,
           "mamba_writes": backend.mamba.layers_written if backend.mamba else []}
    if model.stage.is_last:
        out.update(logits=torch.cat([torch.cat(rows) for rows in logits]), greedy=sum(greedy, []))
    return out


# Each request: a prefill chunk, then two decodes (Mamba layers take their one-token path).
STEPS = [[c - 2 for c in COUNTS], [1] * len(COUNTS), [1] * len(COUNTS)]
_REFERENCE: dict[tuple[str, int], dict] = {}
_LAUNCHES: dict[str, list[dict]] = {}


def _launch(target: Callable[..., dict], world: int, *kind_lists: list[str]) -> list[dict]:
    """run_ranks(target, world, [kinds, dirs] per list) once per test session: several
    tests read one launch (starting processes that import torch is most of their time)."""
    if target.__name__ not in _LAUNCHES:
        _LAUNCHES[target.__name__] = run_ranks(target, world, *[[kinds, [str(model_dir(k)) for k in kinds]]
                                                                for kinds in kind_lists])
    return _LAUNCHES[target.__name__]


def reference(kind: str, stepped: bool = True) -> dict:
    """The unsplit model's run_steps result (one thread, as the ranks), in STEPS or in one step."""
    key = (kind, stepped)
    if key not in _REFERENCE:
        with hf_tiny_mamba.one_thread():
            _REFERENCE[key] = run_steps(load_model(model_dir(kind)), STEPS if stepped else [COUNTS])
    return _REFERENCE[key]


# Tiny Qwen3-Next's float32 logits (ours and HF's alike) stray more than 1e-4 from its
# float64 ones: the delta rule's sums over a prefill, through 4 layers of 0.3-scaled weights.
FLOAT32_NOISE = {"qwen3_next": 5e-4, "qwen3_next_stacked": 5e-4, "qwen3_5": 5e-4}


@pytest.mark.parametrize("kind", ["mistral", "gemma3", "llama4", "bamba", "gemma3_mm", "olmo3", "cohere2", "exaone4",
                                  "olmo3_1kv", "gpt_oss", "granite", "granite_rope_dense", "nemotron_h",
                                  "falcon_h1", "falcon_h1_gate_only", "qwen3_next", "lfm2_bias", "jamba"])
def test_flat_reference_matches_hf(kind: str) -> None:
    """The test backend is right: the unsplit model's logits are HF's, per prompt, in one
    step and over a prefill and decodes."""
    from transformers import AutoModelForCausalLM

    with hf_tiny_mamba.one_thread():
        hf = AutoModelForCausalLM.from_pretrained(model_dir(kind), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        with torch.no_grad():
            expected = torch.cat([hf(input_ids=part[None]).logits[0] for part in _ids().split(COUNTS)])
    atol = FLOAT32_NOISE.get(kind, 1e-4)
    torch.testing.assert_close(reference(kind, stepped=False)["logits"], expected, atol=atol, rtol=1e-4)
    torch.testing.assert_close(reference(kind)["logits"], expected, atol=atol, rtol=1e-4)


# ---------------------------------------------------------------- pipeline stages

def pp_rank(rank: int, world: int, kinds: list[str], dirs: list[str], tp_size: int = 1) -> dict[str, dict]:
    import torch.distributed as dist

    stage, tp = init_model_parallel(rank, world // tp_size, tp_size)
    out: dict[str, dict] = {}
    for kind, path in zip(kinds, dirs):
        model = load_model(path, stage=stage, tp=tp)

        def receive(num_tokens: int, hidden: int = model.cfg.hidden_size) -> torch.Tensor:
            t = torch.empty(num_tokens, hidden)
            dist.recv(t, src=rank - tp_size)
            return t

        res = run_steps(model, STEPS, receive, lambda h: dist.send(h, dst=rank + tp_size))
        res.update(layer_ids=list(model.layer_ids), numel=sum(p.numel() for p in model.parameters()),
                   has_embed=model.embed is not None, has_head=model.lm_head is not None)
        out[kind] = res
    return out


def _check_pipeline(kinds: list[str], world: int, results: list[dict[str, dict]]) -> None:
    for kind in kinds:
        cfg = load_model_config(model_dir(kind))
        stages = [r[kind] for r in results]
        ranges = stage_layer_ranges(cfg.num_layers, world)
        assert len(stages) == world
        for s, (res, layers) in enumerate(zip(stages, ranges)):
            assert res["layer_ids"] == list(layers)
            # Global layer indices reach the backend: attention and recurrent layers of this stage
            # only (Nemotron-H's MLP layers, without a cache spec, call neither).
            recurrent = recurrent_state_shapes(cfg)  # every layer with a state per request
            attention = sorted(i for i in cached_layers(cfg, layers) if i not in recurrent)
            assert res["attention_calls"] == attention * len(STEPS)
            assert res["mamba_writes"] == [i for i in layers if i in recurrent] * len(STEPS)
            assert res["has_embed"] == (s == 0) and res["has_head"] == (s == world - 1)
        ref = reference(kind)
        assert torch.equal(stages[-1]["logits"], ref["logits"]), kind
        assert stages[-1]["greedy"] == ref["greedy"]
        # The weights are split, not copied: only a tied head is held twice (first stage's
        # embedding, last stage's head).
        whole = sum(p.numel() for p in load_model(model_dir(kind)).parameters())
        tied_extra = cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0
        assert sum(r["numel"] for r in stages) == whole + tied_extra


PP2_KINDS = ["llama", "qwen2", "gemma3", "llama4", "bamba", "mamba2", "granite", "nemotron_h", "falcon_h1",
             "gemma3_mm", "olmo3", "cohere2", "exaone4", "gpt_oss", "qwen3_next", "lfm2", "jamba"]


def test_pipeline_two_stages_equal_whole_model() -> None:
    _check_pipeline(PP2_KINDS, 2, [r["pp"] for r in two_rank_results()])


PP4_KINDS = ["llama", "gemma3", "bamba"]  # 4, 6, 4 layers: stages of 1, 1, 1, 1 and 2, 2, 1, 1
PP2_TP2_KINDS = ["llama4", "bamba_1group"]


def four_rank(rank: int, world: int, pp4: list[list[str]], pp2_tp2: list[list[str]]) -> dict[str, dict]:
    """Both 4-process checks in one launch: 4 stages, and 2 stages of 2 TP ranks each."""
    return {"pp4": pp_rank(rank, world, *pp4), "pp2_tp2": pp_rank(rank, world, *pp2_tp2, 2)}


def four_rank_results() -> list[dict]:
    return _launch(four_rank, 4, PP4_KINDS, PP2_TP2_KINDS)


def test_pipeline_four_stages_equal_whole_model() -> None:
    """Middle stages (neither embedding nor head) and uneven splits."""
    _check_pipeline(PP4_KINDS, 4, [r["pp4"] for r in four_rank_results()])


def test_pipeline_stages_of_tensor_parallel_ranks() -> None:
    """2 stages x 2 ranks: each stage's TP group its own, the boundary between equal TP ranks."""
    results = [r["pp2_tp2"] for r in four_rank_results()]
    for kind in PP2_TP2_KINDS:
        ranges = stage_layer_ranges(load_model_config(model_dir(kind)).num_layers, 2)
        assert [r[kind]["layer_ids"] for r in results] == [list(ranges[0])] * 2 + [list(ranges[1])] * 2
        last = [r[kind] for r in results[2:]]
        assert torch.equal(last[0]["logits"], last[1]["logits"]) and last[0]["greedy"] == last[1]["greedy"]
        ref = reference(kind)
        torch.testing.assert_close(last[0]["logits"], ref["logits"], atol=TP_LOGITS_ATOL, rtol=0)
        assert last[0]["greedy"] == ref["greedy"]


def test_stage_without_hidden_in_is_refused() -> None:
    model = load_model(model_dir("llama"), stage=PipelineStage(1, 2))
    backend = FlatBackend(model.cfg, 1)
    pos = backend.step([3])
    with pytest.raises(ValueError, match="pipeline stage 1 needs hidden_in from the previous stage"):
        model(pos, pos, 2, backend)  # token ids are not what a later stage starts from


@given(st.integers(1, 200), st.integers(1, 16))
def test_stage_ranges_split_layers_evenly(num_layers: int, stages: int) -> None:
    if num_layers < stages:
        with pytest.raises(ConfigError, match=f"{num_layers} layers, too few for pipeline_parallel_size {stages}; "
                                              f"sizes that work: 1..{num_layers}"):
            stage_layer_ranges(num_layers, stages)
        return
    ranges = stage_layer_ranges(num_layers, stages)
    assert len(ranges) == stages and ranges[0].start == 0 and ranges[-1].stop == num_layers
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))  # contiguous, in order
    sizes = [len(r) for r in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_too_many_stages_is_a_config_error_before_loading() -> None:
    with pytest.raises(ConfigError, match="4 layers, too few for pipeline_parallel_size 5; sizes that work: 1..4"):
        load_model(model_dir("llama"), stage=PipelineStage(0, 5))


# ---------------------------------------------------------------- tensor parallelism

TP_KINDS = ["llama_bias", "mistral", "qwen2", "gemma2", "gemma3", "gemma3_1kv", "llama4", "bamba", "bamba_1group",
            "mamba2", "mamba2_1group_bias", "gemma3_mm", "olmo3", "cohere2", "exaone4", "olmo3_1kv", "cohere2_bias",
            "gpt_oss", "granite", "granite_rope_dense", "nemotron_h", "falcon_h1", "falcon_h1_gate_only",
            "qwen3_next", "qwen3_next_stacked", "qwen3_5", "lfm2_bias", "jamba"]


def tp_rank(rank: int, world: int, kinds: list[str], dirs: list[str]) -> dict[str, dict]:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))  # a group of its own, as beside pipeline stages
    out: dict[str, dict] = {}
    for kind, path in zip(kinds, dirs):
        model = load_model(path, tp=TPGroup(rank, world, group))
        specs = model_kv_layer_specs(model.cfg, 16).values()
        out[kind] = dict(run_steps(model, STEPS),
                         kv_heads=sorted({s.num_kv_heads for s in specs if isinstance(s, AttentionSpec)}),
                         mamba_shapes=sorted({s.shapes for s in specs if isinstance(s, MambaSpec)}))
    return out


def two_rank(rank: int, world: int, pp: list[list[str]], tp: list[list[str]]) -> dict[str, dict]:
    """Both 2-process checks in one launch."""
    return {"pp": pp_rank(rank, world, *pp), "tp": tp_rank(rank, world, *tp)}


def two_rank_results() -> list[dict]:
    return _launch(two_rank, 2, PP2_KINDS, TP_KINDS)


def test_tensor_parallel_two_ranks_equal_whole_model() -> None:
    results = [r["tp"] for r in two_rank_results()]
    for kind in TP_KINDS:
        a, b = results[0][kind], results[1][kind]
        assert torch.equal(a["logits"], b["logits"]) and a["greedy"] == b["greedy"]  # ranks sample alike
        ref = reference(kind)
        torch.testing.assert_close(a["logits"], ref["logits"], atol=FLOAT32_NOISE.get(kind, TP_LOGITS_ATOL), rtol=0)
        assert a["greedy"] == ref["greedy"]
        cfg = load_model_config(model_dir(kind))
        # Each rank's KV cache holds its half of the KV heads (one KV head: all of it) / Mamba heads.
        assert a["kv_heads"] == ([max(cfg.num_kv_heads // 2, 1)] if cfg.num_kv_heads else [])
        if cfg.mamba is not None:
            m = cfg.mamba
            groups = max(m.n_groups // 2, 1)  # one group is kept whole by both ranks
            conv = (m.intermediate_size // 2 + 2 * groups * m.state_size, m.conv_kernel - 1)
            assert a["mamba_shapes"] == [(conv, (m.num_heads // 2, m.head_dim, m.state_size))]
        if cfg.gated_deltanet is not None:  # a rank: 1 of the 2 key heads (16 dims), its 2 value heads of 16
            assert a["mamba_shapes"] == [((2 * 16 + 2 * 16, 3), (2, 16, 16))]
        if cfg.short_conv is not None:  # each rank convolves half the channels
            assert a["mamba_shapes"] == [((cfg.hidden_size // 2, cfg.short_conv.kernel - 1),)]
        if cfg.jamba is not None:  # each rank holds half the Mamba1 channels, each its own N-vector
            mc = cfg.jamba.mixer
            assert a["mamba_shapes"] == [((mc.intermediate_size // 2, mc.conv_kernel - 1),
                                          (mc.intermediate_size // 2, mc.state_size))]


def test_local_config_halves_heads_and_columns() -> None:
    cfg = load_model_config(model_dir("llama4"))
    model = load_model(model_dir("llama4"))  # one rank: nothing changes
    assert model.cfg == cfg
    from hybridserve.models.parallel import local_config

    local = local_config(cfg, TPGroup(1, 2))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 32)
    assert local.llama4 is not None and local.llama4.intermediate_size_mlp == 64
    assert (local.hidden_size, local.head_dim, local.vocab_size) == (64, 16, 512)


def test_tp_sizes_that_do_not_divide_are_config_errors() -> None:
    # tiny Llama: 4 heads, 2 KV heads (4 ranks: two share each), intermediate 128 -> 1, 2, 4.
    llama = load_model_config(model_dir("llama"))
    assert tp_sizes_that_work(llama) == [1, 2, 4]
    for size in (3, 8):
        with pytest.raises(ConfigError, match=f"tensor_parallel_size {size} does not divide the model's attention "
                                              r"heads 4, KV heads 2 \(split or shared\).*sizes that work: 1, 2, 4$"):
            check_tp(llama, size)
    with pytest.raises(ConfigError, match="sizes that work: 1, 2, 4$"):
        load_model(model_dir("llama"), tp=TPGroup(0, 3))
    # tiny Gemma 3 with one KV head: shared by any number of ranks dividing the 4 query heads.
    assert tp_sizes_that_work(load_model_config(model_dir("gemma3_1kv"))) == [1, 2, 4]
    # tiny Mamba2: 8 heads in 2 groups, no attention, no MLP -> 1, 2, 4 (4: each group over 2
    # ranks), 8; Bamba adds 4 heads / 2 KV heads -> 1, 2, 4.
    assert tp_sizes_that_work(load_model_config(model_dir("mamba2"))) == [1, 2, 4, 8]
    assert tp_sizes_that_work(load_model_config(model_dir("bamba"))) == [1, 2, 4]
    # tiny Qwen3-Next: 2 Gated DeltaNet key heads (and 4 attention heads, 2 KV heads, expert
    # columns 32, dense 64) -> 1, 2.
    qwen3_next = load_model_config(model_dir("qwen3_next"))
    assert tp_sizes_that_work(qwen3_next) == [1, 2]
    with pytest.raises(ConfigError, match=r"Gated DeltaNet key heads 2, expert and shared-expert intermediate sizes "
                                          r"32 and 32; sizes that work: 1, 2$"):
        check_tp(qwen3_next, 4)
