"""`hybridserve simulate`: one-line errors with exit code 2, JSON/plot output, the clock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve.entrypoints.cli import main
from hybridserve.sim.cost_model import CostModel
from hybridserve.sim.presets import get_gpu, get_layout, load_presets

SMALL = ["--model-layout", "llama3-8b-like", "--num-requests", "6", "--prompt-len", "fixed:100", "--output-len", "fixed:20"]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(["simulate", *argv])
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, needle: str) -> None:
    assert rc == 2
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("hybridserve simulate: error: ")
    assert needle in err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
        (["--block-size", "abc"], "argument --block-size: invalid int value: 'abc'"),
        (["--gpu", "B200"], "unknown GPU 'B200'"),
        (["--model-layout", "mamba-9000"], "unknown model layout 'mamba-9000'"),
        (["--prompt-len", "gauss:3"], "--prompt-len: unknown distribution"),
        (["--output-len", "uniform:9:3"], "--output-len: 'uniform:9:3' has LO > HI"),
        (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be in (0, 1]"),
        (["--acceptance-rate", "2"], "argument --acceptance-rate: must be in [0, 1]"),
        (["--arrival-rate", "0"], "argument --arrival-rate: must be > 0"),
        (["--num-requests", "-3"], "argument --num-requests: must be >= 1"),
        (["--kv-cache-dtype", "int3"], "argument --kv-cache-dtype: invalid choice: 'int3' (choose from"),
        (["--model-layout", "jamba-like"], "jamba-like weights need 104.0 GB per GPU but H100"),
        (["--num-blocks", "10", *SMALL], "num_blocks=10"),
        (["--max-model-len", "100", *SMALL], "--max-model-len 100 is shorter than request 0"),
        (["--compare=--prompt-len fixed:5"], "--prompt-len would change the workload"),
        (["--compare", "--sync"], "attach flag values with '='"),
        (["--compare=--block-size 0", *SMALL], "argument --block-size: must be >= 1"),
        (["--json", "/nonexistent-dir/x.json", *SMALL], "argument --json: cannot write /nonexistent-dir/x.json"),
        (["--plot", "out.gif", *SMALL], "argument --plot: out.gif must end in one of .png"),
    ],
)
def test_bad_values_give_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(argv, capsys)
    assert_one_line_error(rc, err, needle)


def test_malformed_trace_line_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 5, "output_len": 2, "arrival_time": 0}\n{"prompt_len": 5, "output_len": 2}\n')
    rc, _, err = run_cli(["--trace", str(trace)], capsys)
    assert_one_line_error(rc, err, f"{trace}:2: 'arrival_time' must be a number")


def test_subprocess_errors_have_no_traceback(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"prompt_len": 5, "output_len": 2, "arrival_time": 0}\n\n{"prompt_len": "x"}\n')
    cases = [
        (["--trace", str(trace)], f"{trace}:3: 'prompt_len' must be a whole number, got 'x'"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
    ]
    for argv, message in cases:
        p = subprocess.run(
            [sys.executable, "-m", "hybridserve.entrypoints.cli", "simulate", *argv],
            capture_output=True, text=True, timeout=60,
        )
        assert p.returncode == 2
        assert "Traceback" not in p.stderr
        assert p.stderr.count("\n") == 1, p.stderr
        assert message in p.stderr


def test_json_report_counts_every_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    rc, stdout, _ = run_cli([*SMALL, "--json", str(out), "--plot", str(png)], capsys)
    assert rc == 0
    assert "output tokens/s" in stdout
    r = json.loads(out.read_text())
    assert (r["num_finished"], r["output_tokens"], r["prompt_tokens"]) == (6, 120, 600)
    assert r["violations"] == 0 and r["num_preemptions"] == 0
    assert r["max_running"] == 6
    assert r["kv_groups"] == ["g0 full (32 layers)"]
    assert r["output_tokens_per_s"] == pytest.approx(120 / r["sim_time_s"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mode", ["--sync", "--async"])
def test_clock_of_one_request_is_hand_computable(mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One request, prompt 64, 4 outputs: a prefill and 3 decode steps.

    Sync pays the CPU overhead before every step; async overlaps it with the running
    step (decode steps on llama3-8b/H100 take longer than the overhead), paying it once.
    """
    out = tmp_path / "r.json"
    argv = ["--model-layout", "llama3-8b-like", "--num-requests", "1", "--prompt-len", "fixed:64",
            "--output-len", "fixed:4", mode, "--json", str(out)]
    rc, _, _ = run_cli(argv, capsys)
    assert rc == 0
    r = json.loads(out.read_text())
    cost = CostModel(get_gpu("H100"), get_layout("llama3-8b-like"))
    steps = [cost.step_time([(0, 64)])] + [cost.step_time([(c, 1)]) for c in (64, 65, 66)]
    cpu = load_presets().engine.cpu_step_overhead_s
    assert steps[1] > cpu
    expected = (4 if mode == "--sync" else 1) * cpu + sum(steps)
    assert r["e2e_s"]["p50"] == pytest.approx(expected, rel=1e-9)
    assert r["ttft_s"]["p50"] == pytest.approx(cpu + steps[0], rel=1e-9)


def test_compare_runs_the_same_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.json"
    rc, stdout, _ = run_cli([*SMALL, "--compare=--sync --max-num-seqs 2", "--json", str(out)], capsys)
    assert rc == 0
    assert "ratio" in stdout and "B = A with: --sync --max-num-seqs 2" in stdout
    a, b = json.loads(out.read_text())["runs"]
    assert a["output_tokens"] == b["output_tokens"] == 120
    assert (a["max_running"], b["max_running"]) == (6, 2)
    assert b["config"]["async_scheduling"] is False and a["config"]["async_scheduling"] is True
    assert b["sim_time_s"] > a["sim_time_s"]


RACY = ["--model-layout", "gpt-oss-120b-like", "--num-requests", "4", "--prompt-len", "fixed:1500",
        "--output-len", "fixed:8", "--max-num-batched-tokens", "256", "--num-blocks", "600"]


def test_detector_counts_the_unsafe_race_and_nothing_in_safe_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Long prompts, W=128, chunked prefill with two steps in flight: optimistic frees race."""
    out = tmp_path / "r.json"
    rc, _, err = run_cli([*RACY, "--json", str(out)], capsys)
    assert rc == 0 and "WARNING" not in err
    assert json.loads(out.read_text())["violations"] == 0
    rc, stdout, err = run_cli([*RACY, "--unsafe-optimistic-free", "--json", str(out)], capsys)
    assert rc == 0  # violations are the expected result of the research switch
    assert "WARNING: --unsafe-optimistic-free" in err
    r = json.loads(out.read_text())
    assert r["violations"] > 0
    assert r["violation_examples"][0].startswith("freed-while-in-flight: step ")
    assert "violation (run): freed-while-in-flight" in stdout
    assert r["num_finished"] == 4 and r["output_tokens"] == 32


def test_pipeline_stages_and_late_arrival(tmp_path: Path) -> None:
    """pp=2, sync: each step crosses both stages (T/2 + hand-off each); time starts at arrival."""
    from hybridserve.sim.simulation import SimConfig, run_simulation
    from hybridserve.sim.workload import WorkloadItem

    items = [WorkloadItem(0, 64, 3, arrival_time=5.0)]
    cfg = SimConfig(model_layout="llama3-8b-like", async_scheduling=False, pipeline_parallel_size=2, detector=False)
    r = run_simulation(cfg, items, progress=False)
    cost = CostModel(get_gpu("H100"), get_layout("llama3-8b-like"))
    eng = load_presets().engine
    steps = [cost.step_time([(0, 64)]), cost.step_time([(64, 1)]), cost.step_time([(65, 1)])]
    expected = sum(eng.cpu_step_overhead_s + t + 2 * eng.pp_stage_overhead_s for t in steps)
    assert r.e2e_s["p50"] == pytest.approx(expected, rel=1e-9)
    assert r.sim_time_s == pytest.approx(expected, rel=1e-9)  # measured from the first arrival
    assert r.config["max_in_flight_tokens"] == 2 * 8192


def test_the_pool_row_comes_first_and_group_shares_add_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The pool's own usage is the sum of its groups' (every block belongs to one group);
    each group row is its share of the used blocks, so the shares add up to 100%."""
    from hybridserve.sim.report import summary_rows

    out = tmp_path / "r.json"
    rc, _, err = run_cli(["--num-requests", "40", "--json", str(out)], capsys)
    assert rc == 0, err
    r = json.loads(out.read_text())
    assert r["pool_mean_usage"] == pytest.approx(sum(r["kv_mean_usage"]), rel=1e-9)
    assert r["pool_peak_usage"] >= max(r["kv_peak_usage"]) and r["pool_peak_usage"] > 0.5
    from hybridserve.sim.report import SimReport

    report = SimReport(**{k: v for k, v in r.items() if k != "series"})
    rows = summary_rows(report)
    names = [name for name, _, _ in rows]
    pool = names.index("KV pool used peak / mean")
    shares = [raw for name, _, raw in rows[pool + 1:] if name.endswith("share of used")]
    assert len(shares) == len(r["kv_groups"]) and sum(shares) == pytest.approx(1.0)
