"""Workload flags, generation, JSONL traces and request materialisation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.sim.workload import (
    LengthDistribution,
    WorkloadError,
    WorkloadSpec,
    generate,
    load_trace,
    to_requests,
)


def test_parse_distributions() -> None:
    assert LengthDistribution.parse("fixed:512") == LengthDistribution("fixed", 512)
    assert LengthDistribution.parse("uniform:10:20") == LengthDistribution("uniform", 10, 20)
    assert LengthDistribution.parse("lognormal:300:0.8") == LengthDistribution("lognormal", 300, 0.8)
    assert str(LengthDistribution.parse("uniform:10:20")) == "uniform:10:20"
    assert LengthDistribution.parse(" 64 ") == LengthDistribution("fixed", 64)  # a bare length is fixed


@pytest.mark.parametrize(
    "text, message",
    [
        ("gauss:3", "unknown distribution"),
        ("fixed", "fixed takes 1 number"),
        ("uniform:5", "uniform takes 2 number"),
        ("fixed:abc", "not a number"),
        ("fixed:0", "whole numbers >= 1"),
        ("0", "whole numbers >= 1"),
        ("-3", "unknown distribution"),
        ("fixed:2.5", "whole numbers >= 1"),
        ("uniform:9:3", "LO > HI"),
        ("lognormal:-1:0.5", "MEAN > 0"),
        ("lognormal:nan:0.5", "non-finite"),
    ],
)
def test_bad_distributions_name_the_flag(text: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message) as info:
        LengthDistribution.parse(text, "--prompt-len")
    assert str(info.value).startswith("--prompt-len: ")
    assert isinstance(info.value, ConfigError)


def test_samples_respect_bounds_and_mean() -> None:
    rng = np.random.default_rng(0)
    u = LengthDistribution.parse("uniform:3:5").sample(rng, 3000)
    assert set(u.tolist()) == {3, 4, 5}
    ln = LengthDistribution.parse("lognormal:200:0.5").sample(rng, 40000)
    assert ln.min() >= 1
    assert abs(ln.mean() - 200) < 4
    tiny = LengthDistribution.parse("lognormal:0.2:1.0").sample(rng, 1000)
    assert tiny.min() == 1  # clipped, never 0


def test_generate_is_deterministic_and_poisson() -> None:
    spec = WorkloadSpec.from_flags(4000, "uniform:10:100", "fixed:7", arrival_rate=50.0)
    a, b = generate(spec, seed=3), generate(spec, seed=3)
    assert a == b
    assert generate(spec, seed=4) != a
    arrivals = [it.arrival_time for it in a]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert abs(arrivals[-1] / len(a) - 1 / 50.0) < 0.002
    assert all(it.output_len == 7 for it in a)
    burst = generate(WorkloadSpec.from_flags(5, "fixed:9", "fixed:2"), seed=0)
    assert [it.arrival_time for it in burst] == [0.0] * 5


def test_bad_spec_values() -> None:
    with pytest.raises(WorkloadError, match="--num-requests"):
        WorkloadSpec.from_flags(0, "fixed:9", "fixed:2")
    with pytest.raises(WorkloadError, match="--arrival-rate"):
        WorkloadSpec.from_flags(3, "fixed:9", "fixed:2", arrival_rate=0.0)
    with pytest.raises(WorkloadError, match="--prefix-len"):
        WorkloadSpec.from_flags(3, "fixed:9", "fixed:2", prefix_groups=2)


def test_shared_prefix_groups_share_exact_tokens() -> None:
    spec = WorkloadSpec.from_flags(6, "fixed:40", "fixed:3", prefix_groups=2, prefix_len=16)
    reqs = to_requests(generate(spec, 0), seed=5, vocab_size=50000)
    assert [r.request_id for r in reqs] == [f"req-{i}" for i in range(6)]
    p = [r.prompt_token_ids for r in reqs]
    assert p[0][:16] == p[2][:16] == p[4][:16]
    assert p[1][:16] == p[3][:16] == p[5][:16]
    assert p[0][:16] != p[1][:16]
    assert p[0][16:] != p[2][16:]  # only the prefix is shared
    assert all(len(x) == 40 for x in p)
    assert all(r.sampling_params.max_tokens == 3 and r.sampling_params.ignore_eos for r in reqs)
    again = to_requests(generate(spec, 0), seed=5, vocab_size=50000)
    assert [r.prompt_token_ids for r in again] == p
    assert all(1 <= t < 50000 for x in p for t in x)


def test_prefix_longer_than_prompt_is_clipped() -> None:
    spec = WorkloadSpec.from_flags(2, "fixed:8", "fixed:1", prefix_groups=1, prefix_len=20)
    items = generate(spec, 0)
    assert [it.prefix_len for it in items] == [8, 8]
    a, b = to_requests(items, seed=0)
    assert a.prompt_token_ids == b.prompt_token_ids


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    return path


def test_load_trace(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"prompt_len": 30, "output_len": 5, "arrival_time": 1.5, "prefix_id": "a"}\n'
        "\n"
        '{"prompt_len": 20, "output_len": 4, "arrival_time": 0.5, "prefix_id": "a", "extra": 1}\n'
        '{"prompt_len": 12, "output_len": 2, "arrival_time": 0, "prefix_id": 7, "prefix_len": 4}\n',
    )
    items = load_trace(path)
    assert [(it.index, it.arrival_time) for it in items] == [(2, 0.0), (1, 0.5), (0, 1.5)]
    assert [(it.prefix_id, it.prefix_len) for it in items] == [("7", 4), ("a", 20), ("a", 20)]
    reqs = {r.request_id: r for r in to_requests(items, seed=1)}
    assert reqs["req-0"].prompt_token_ids[:20] == reqs["req-1"].prompt_token_ids
    assert [it.prefix_len for it in load_trace(path, default_prefix_len=10)] == [4, 10, 10]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"output_len": 5, "arrival_time": 0}', "missing 'prompt_len'"),
        ('{"prompt_len": 0, "output_len": 5, "arrival_time": 0}', "'prompt_len' must be >= 1"),
        ('{"prompt_len": 3.5, "output_len": 5, "arrival_time": 0}', "'prompt_len' must be a whole number"),
        ('{"prompt_len": 3, "output_len": true, "arrival_time": 0}', "'output_len' must be a whole number"),
        ('{"prompt_len": 3, "output_len": 5}', "'arrival_time' must be a number"),
        ('{"prompt_len": 3, "output_len": 5, "arrival_time": -1}', "'arrival_time' must be finite and >= 0"),
        ('{"prompt_len": 3, "output_len": 5, "arrival_time": 0, "prefix_id": [1]}', "'prefix_id' must be"),
        ('{"prompt_len": 3, "output_len": 5, "arrival_time": 0, "prefix_len": 2}', "without 'prefix_id'"),
    ],
)
def test_malformed_trace_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    good = '{"prompt_len": 3, "output_len": 5, "arrival_time": 0}\n'
    path = write(tmp_path, good + good + line + "\n")
    with pytest.raises(WorkloadError, match=message) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert "\n" not in str(info.value)


def test_empty_or_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no requests"):
        load_trace(write(tmp_path, "\n\n"))
    with pytest.raises(WorkloadError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")
