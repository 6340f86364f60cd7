"""Model configs, loading, and the runner driven by hand-built SchedulerOutputs vs HF.

The runner tests feed ModelRunner directly: prefill chunks that end mid-block and
mid-window, sliding-window slots before each chunk's tail handed the null block
(window-tail allocation), then batched decodes; logits must match HF's greedy run.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.kv.spec import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput  # noqa: E402
from hybridserve.executor.torch.executor import build_kv_cache_config  # noqa: E402
from hybridserve.executor.torch.model_runner import ModelRunner  # noqa: E402
from hybridserve.models.config import FULL, SLIDING, load_model_config, parse_model_config  # noqa: E402
from hybridserve.models.kv_specs import model_kv_layer_specs  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402

BS = 16


def _raw(kind: str) -> dict:
    return json.loads((hf_tiny.tiny_model_dir(kind) / "config.json").read_text())


# -- configs -------------------------------------------------------------------------
def test_layer_types_from_saved_configs() -> None:
    assert load_model_config(hf_tiny.tiny_model_dir("mistral")).layer_types == (SLIDING,) * 4
    assert load_model_config(hf_tiny.tiny_model_dir("qwen2")).layer_types == (FULL, FULL, SLIDING, SLIDING)
    assert load_model_config(hf_tiny.tiny_model_dir("gemma2")).layer_types == (SLIDING, FULL) * 2
    g3 = load_model_config(hf_tiny.tiny_model_dir("gemma3"))
    assert g3.layer_types == (SLIDING, SLIDING, FULL) * 2
    assert g3.rope[SLIDING].theta == 10_000.0 and g3.rope[FULL].theta == 1e6
    assert g3.rope[FULL].rope_type == "linear" and g3.rope[FULL].factor == 2.0
    assert g3.attn_scale == pytest.approx(16**-0.5) and g3.embed_scale == pytest.approx(8.0)


def test_old_config_spellings_derive_the_same_layers() -> None:
    raw = _raw("gemma3")
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        raw.pop(key, None)
    raw.update(sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=10_000.0,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    old = parse_model_config(raw)
    assert old == load_model_config(hf_tiny.tiny_model_dir("gemma3"))
    q = _raw("qwen2")
    q.pop("layer_types")
    assert parse_model_config(q).layer_types == (FULL, FULL, SLIDING, SLIDING)
    q["use_sliding_window"] = False
    assert parse_model_config(q).layer_types == (FULL,) * 4
    g2 = _raw("gemma2")
    g2.pop("layer_types")
    assert parse_model_config(g2).layer_types == (SLIDING, FULL) * 2
    llama = _raw("llama")
    rope = llama.pop("rope_parameters")
    llama.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    assert parse_model_config(llama).rope[FULL] == load_model_config(hf_tiny.tiny_model_dir("llama")).rope[FULL]


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
    ({"hidden_act": "relu2"}, "relu2"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"sliding_window": 0}, "sliding_window"),
])
def test_unsupported_fields_raise_config_error(change: dict, needle: str) -> None:
    raw = _raw("mistral")
    raw.update(change)
    with pytest.raises(ConfigError, match=needle):
        parse_model_config(raw)


def test_bidirectional_gemma3_is_refused() -> None:
    raw = _raw("gemma3")
    raw["use_bidirectional_attention"] = True
    with pytest.raises(ConfigError, match="bidirectional"):
        parse_model_config(raw)


def test_loader_rejects_missing_and_unknown_tensors(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    src = hf_tiny.tiny_model_dir("mistral")
    tensors = load_file(str(src / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    extra = dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="ignore"):
        load_model(tmp_path)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)


def test_kv_specs_and_groups() -> None:
    cfg = load_model_config(hf_tiny.tiny_model_dir("gemma3"))
    specs = model_kv_layer_specs(cfg, BS)
    assert specs["layers.0"] == SlidingWindowSpec(BS, 2, 16, "float32", sliding_window=16)
    assert specs["layers.2"] == FullAttentionSpec(BS, 2, 16, "float32")
    kvc = build_kv_cache_config(cfg, BS, kv_cache_memory="1MiB")
    # 4 sliding + 2 full layers -> groups of 2 layers; a block costs 2 pages of 2*16*2*16*4 = 4096 bytes.
    assert [len(g.layer_names) for g in kvc.groups] == [2, 2, 2]
    assert kvc.bytes_per_block == 2 * 4096 and kvc.num_blocks == (1 << 20) // 8192
    with pytest.raises(ConfigError, match="kv_cache_memory: cannot parse size 'lots'"):
        build_kv_cache_config(cfg, BS, kv_cache_memory="lots")


# -- the runner by hand ----------------------------------------------------------------
class HandScheduler:
    """Hands out block ids per group; sliding groups may give null blocks before the tail."""

    def __init__(self, kvc, window_tail: bool) -> None:
        self.kvc = kvc
        self.window_tail = window_tail
        self.next_id = 1
        self.blocks: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.nulls_given = 0

    def schedule(self, rid: str, n: int, samples: bool, new: NewRequestData | None = None) -> ScheduledRequest:
        start = self.computed.get(rid, 0)
        have = self.blocks.get(rid, 0)
        need = -(-(start + n) // BS) - have
        ids = []
        for group in self.kvc.groups:
            window = getattr(group.spec, "sliding_window", None)
            tail_start = start + n - (window - 1) if window else 0
            g_ids = []
            for j in range(need):
                if self.window_tail and window and (have + j + 1) * BS <= tail_start:
                    g_ids.append(0)  # no later step reads this block
                    self.nulls_given += 1
                else:
                    g_ids.append(self.next_id)
                    self.next_id += 1
            ids.append(g_ids)
        self.blocks[rid] = have + need
        self.computed[rid] = start + n
        return ScheduledRequest(rid, start, n, 0, tuple(ids), (0,) * len(ids), samples, new)


@pytest.mark.parametrize("kind", hf_tiny.KINDS)
@pytest.mark.parametrize("window_tail", [False, True], ids=["plain", "window_tail"])
def test_runner_chunked_prefill_and_decode_match_hf(kind: str, window_tail: bool) -> None:
    prompts = hf_tiny.random_prompts(3, 40, 90, seed=1)
    model = load_model(hf_tiny.tiny_model_dir(kind))
    kvc = build_kv_cache_config(model.cfg, BS, num_blocks=200)
    runner = ModelRunner(model, kvc, torch.device("cpu"))
    hs = HandScheduler(kvc, window_tail)
    params = SamplingParams(max_tokens=8, logprobs=0)
    got: dict[str, list[int]] = {str(i): [] for i in range(3)}
    lps: dict[str, list[float]] = {str(i): [] for i in range(3)}

    def collect(out) -> None:
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            got[rid] += toks
            if toks:
                lps[rid] += out.logprobs[rid].token_logprobs

    new = [NewRequestData(str(i), p, params, list(p)) for i, p in enumerate(prompts)]
    # Step 0: request 0's first 37 tokens (ends mid-block, past a window), request 1's first 20.
    collect(runner.execute(SchedulerOutput(0, [hs.schedule("0", 37, False, new[0]),
                                               hs.schedule("1", 20, False, new[1])], 57)))
    # Step 1: both finish their prompts; request 2 prefills in one go.
    collect(runner.execute(SchedulerOutput(1, [hs.schedule("0", len(prompts[0]) - 37, True),
                                               hs.schedule("1", len(prompts[1]) - 20, True),
                                               hs.schedule("2", len(prompts[2]), True, new[2])], 0)))
    for step in range(2, 9):
        collect(runner.execute(SchedulerOutput(step, [hs.schedule(str(i), 1, True) for i in range(3)], 3)))
    if window_tail and kind != "llama":
        assert hs.nulls_given > 0
    for i, p in enumerate(prompts):
        want, want_lp = hf_tiny.oracle(kind, p, 8)
        assert got[str(i)] == want
        assert max(abs(a - b) for a, b in zip(lps[str(i)], want_lp)) < 1e-3


def test_runner_drops_finished_and_rejects_unknown_requests() -> None:
    model = load_model(hf_tiny.tiny_model_dir("mistral"))
    kvc = build_kv_cache_config(model.cfg, BS, num_blocks=50)
    runner = ModelRunner(model, kvc, torch.device("cpu"))
    hs = HandScheduler(kvc, False)
    p = hf_tiny.random_prompts(1, 20, 20)[0]
    runner.execute(SchedulerOutput(0, [hs.schedule("a", 20, True, NewRequestData("a", p, SamplingParams(), p))], 20))
    assert "a" in runner.states
    runner.execute(SchedulerOutput(1, [], 0, finished_req_ids={"a"}))
    assert runner.states == {}
    from hybridserve.core.errors import RequestError

    with pytest.raises(RequestError, match="unknown"):
        runner.execute(SchedulerOutput(2, [hs.schedule("a", 1, True)], 1))
