"""`hybridserve simulate`: capacity planning for a hybrid model on a GPU you may not own.

Error contract: a bad flag value or a malformed trace line prints one line on stderr
naming the flag or file:line, and exits 2, never a traceback. A violation found by the
race detector in the default (safe) mode is an engine bug: the command exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from typing import Any, Sequence

from hybridserve.entrypoints.command import FlagError, one_line_errors, run_guarded
from hybridserve.entrypoints.config_flags import add_field_flag, config_from_args, field_help, flag_fields
from hybridserve.entrypoints.config_flags import sections as make_sections
from hybridserve.sim.config import ENGINE, HARDWARE, WORKLOAD, SimConfig

PROG = "hybridserve simulate"
DESCRIPTION = "Simulate a serving workload for a model layout on a GPU preset (capacity planning)."
WORKLOAD_FLAGS = ("num_requests", "prompt_len", "output_len", "arrival_rate", "prefix_groups", "prefix_len", "trace", "seed")
UNSAFE_WARNING = (
    "WARNING: --unsafe-optimistic-free frees out-of-window KV blocks on the optimistic token count. "
    "Steps still in flight can then read blocks that were freed and reused: this is the race the engine "
    "exists to prevent. Research use only; throughput numbers from this mode are not achievable safely."
)


# SimConfig fields with no flag, and why.
NOT_FLAGS = {"label": "the command names its runs: run, or A and B with --compare"}
# SimConfig fields whose flags `_add_arguments` spells by hand: --async / --sync.
HAND_MADE_FLAGS = ("async_scheduling",)
# SimConfig fields whose flag is spelled otherwise than the field.
FLAG_NAMES = {"kv_dtype": "--kv-cache-dtype", "window_tail_allocation": "--window-tail"}


def _hint(message: str) -> str:
    # argparse reads `--compare --sync` as two flags; the value must be attached.
    if message.startswith("argument --compare") and "expected one argument" in message:
        return message + " (attach flag values with '=': --compare='--sync')"
    return message


def _add_arguments(p: argparse.ArgumentParser) -> None:
    groups = make_sections(p, (HARDWARE, ENGINE, WORKLOAD))
    for field in flag_fields(SimConfig, skip=(*NOT_FLAGS, *HAND_MADE_FLAGS)):
        names = (FLAG_NAMES[field.name],) if field.name in FLAG_NAMES else ()
        add_field_flag(groups[field.metadata["section"]], SimConfig, field, *names)
    mode = groups[ENGINE].add_mutually_exclusive_group()
    is_async = next(f for f in dataclasses.fields(SimConfig) if f.name == "async_scheduling")
    mode.add_argument("--async", dest="async_scheduling", action="store_true", default=is_async.default,
                      help=field_help(is_async))
    mode.add_argument("--sync", dest="async_scheduling", action="store_false",
                      help="schedule a step only after the previous one returned (default: "
                           f"{'--async' if is_async.default else '--sync'})")
    wl = groups[WORKLOAD]
    wl.add_argument("--num-requests", type=int, default=200, help="requests in the workload (default: %(default)s)")
    # Prompts up to 4x the presets' 1,024-token windows, so the window (and --window-tail) matters.
    wl.add_argument("--prompt-len", default="uniform:512:4096",
                    help="N or fixed:N, uniform:LO:HI or lognormal:MEAN:SIGMA (default: %(default)s)")
    wl.add_argument("--output-len", default="uniform:32:256", help="as --prompt-len (default: %(default)s)")
    wl.add_argument("--arrival-rate", type=float, default=None, help="Poisson requests/s (default: all at t=0)")
    wl.add_argument("--prefix-groups", type=int, default=0,
                    help="requests share one of this many prompt prefixes (default: %(default)s, none)")
    wl.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix (default: %(default)s)")
    wl.add_argument("--trace", default=None, metavar="FILE.jsonl",
                    help="JSONL lines {prompt_len, output_len, arrival_time[, prefix_id[, prefix_len]]}")
    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="OUT.json", help="also write the report as JSON")
    out.add_argument("--plot", default=None, metavar="OUT.png", help="also plot KV usage and throughput over time")
    out.add_argument("--compare", default=None, metavar="'FLAGS'",
                     help="simulate a second configuration (these flags over the first) on the same workload "
                          "and print both with their ratio, e.g. --compare='--sync'")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bar (default: when stderr is a terminal)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `simulate` on the CLI's subparsers; `run(args)` handles the parsed namespace."""
    p = subparsers.add_parser("simulate", help="simulate a serving workload on a GPU preset",
                              description=DESCRIPTION)
    one_line_errors(p, PROG, hint=_hint)
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def build_parser(prog: str = PROG, add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, add_help=add_help)
    one_line_errors(p, prog, hint=_hint)
    _add_arguments(p)
    return p


def _check(ok: bool, flag: str, value: Any, need: str) -> None:
    if not ok:
        raise FlagError(f"argument {flag}: must be {need}, got {value}")


def _validate(a: argparse.Namespace) -> None:
    for flag, v in (("--block-size", a.block_size), ("--max-num-batched-tokens", a.max_num_batched_tokens),
                    ("--max-num-seqs", a.max_num_seqs), ("--pipeline-parallel-size", a.pipeline_parallel_size),
                    ("--num-requests", a.num_requests)):
        _check(v >= 1, flag, v, ">= 1")
    for flag, v in (("--num-speculative-tokens", a.num_speculative_tokens), ("--prefix-groups", a.prefix_groups),
                    ("--prefix-len", a.prefix_len), ("--seed", a.seed),
                    ("--connector-max-delay-steps", a.connector_max_delay_steps),
                    ("--connector-capacity-blocks", a.connector_capacity_blocks)):
        _check(v >= 0, flag, v, ">= 0")
    _check(a.max_in_flight_tokens is None or a.max_in_flight_tokens >= 1, "--max-in-flight-tokens",
           a.max_in_flight_tokens, ">= 1")
    _check(a.num_blocks is None or a.num_blocks >= 2, "--num-blocks", a.num_blocks, ">= 2")
    _check(a.max_model_len is None or a.max_model_len >= 2, "--max-model-len", a.max_model_len, ">= 2")
    _check(0 < a.gpu_memory_utilization <= 1, "--gpu-memory-utilization", a.gpu_memory_utilization, "in (0, 1]")
    _check(0 <= a.acceptance_rate <= 1, "--acceptance-rate", a.acceptance_rate, "in [0, 1]")
    _check(0 <= a.connector_failure_rate <= 1, "--connector-failure-rate", a.connector_failure_rate, "in [0, 1]")
    _check(a.arrival_rate is None or a.arrival_rate > 0, "--arrival-rate", a.arrival_rate, "> 0 requests/s")
    _check(a.num_speculative_tokens < a.max_num_batched_tokens, "--num-speculative-tokens",
           a.num_speculative_tokens, "< --max-num-batched-tokens")


def sim_config_from_args(a: argparse.Namespace, label: str) -> SimConfig:
    from hybridserve.core.kv.spec import dtype_size
    from hybridserve.sim.presets import get_gpu, get_layout

    _validate(a)
    layout, gpu = get_layout(a.model_layout), get_gpu(a.gpu)
    dtype_size(a.kv_dtype)
    return config_from_args(SimConfig, a, gpu=gpu.name, model_layout=layout.name, label=label)


def workload_from_args(a: argparse.Namespace) -> list[Any]:
    from hybridserve.sim.workload import WorkloadSpec, generate, load_trace

    if a.trace is not None:
        return load_trace(a.trace, default_prefix_len=a.prefix_len or None)
    spec = WorkloadSpec.from_flags(a.num_requests, a.prompt_len, a.output_len, a.arrival_rate,
                                   a.prefix_groups, a.prefix_len)
    return generate(spec, a.seed)


def compare_args(a: argparse.Namespace) -> argparse.Namespace:
    """The second configuration: the first one's flags with `--compare`'s flags on top."""
    try:
        tokens = shlex.split(a.compare)
    except ValueError as e:
        raise FlagError(f"argument --compare: {e}") from None
    p = build_parser(prog=f"{PROG} --compare", add_help=False)
    p.set_defaults(**vars(a))
    b = p.parse_args(tokens)
    changed = [f for f in WORKLOAD_FLAGS if getattr(b, f) != getattr(a, f)]
    if changed:
        flags = ", ".join("--" + f.replace("_", "-") for f in changed)
        raise FlagError(f"argument --compare: {flags} would change the workload; both runs share one workload")
    if b.json != a.json or b.plot != a.plot or b.compare != a.compare:
        raise FlagError("argument --compare: --json, --plot and --compare belong outside the compared flags")
    return b


def run(args: argparse.Namespace) -> int:
    return run_guarded(PROG, lambda: _run(args))


def _run(a: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from hybridserve.sim.report import plot, print_summary
    from hybridserve.sim.simulation import run_simulation

    _check_output_path(a.json, "--json")
    _check_output_path(a.plot, "--plot")
    configs = [sim_config_from_args(a, "A" if a.compare else "run")]
    if a.compare:
        configs.append(sim_config_from_args(compare_args(a), "B"))
    err = Console(stderr=True)
    if any(c.unsafe_optimistic_free for c in configs):
        err.print(f"[bold red]{UNSAFE_WARNING}[/bold red]", highlight=False, soft_wrap=True)
    items = workload_from_args(a)
    progress = a.progress if a.progress is not None else sys.stderr.isatty()
    reports = [run_simulation(c, items, progress=progress) for c in configs]
    print_summary(reports)
    if a.compare:
        Console().print(f"B = A with: {a.compare}", highlight=False)
    if a.json:
        body: Any = reports[0].to_dict() if len(reports) == 1 else {"runs": [r.to_dict() for r in reports]}
        _write(a.json, "--json", lambda f: json.dump(body, f, indent=2))
    if a.plot:
        try:
            plot(reports, a.plot)
        except OSError as e:
            raise FlagError(f"argument --plot: cannot write {a.plot} ({e.strerror or e})") from None
    safe_violations = sum(r.violations for r, c in zip(reports, configs) if not c.unsafe_optimistic_free)
    if safe_violations:
        err.print(f"[bold red]{safe_violations} KV race violation(s) in safe mode: this is an engine bug[/bold red]",
                  soft_wrap=True)
        return 1
    return 0


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _check_output_path(path: str | None, flag: str) -> None:
    """Fail before a long run, not after it, when an output cannot be written."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK) or os.path.isdir(path):
        raise FlagError(f"argument {flag}: cannot write {path} (no writable directory {parent})")
    if flag == "--plot" and not path.lower().endswith(PLOT_SUFFIXES):
        raise FlagError(f"argument --plot: {path} must end in one of {', '.join(PLOT_SUFFIXES)}")


def _write(path: str, flag: str, dump: Any) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            dump(f)
    except OSError as e:
        raise FlagError(f"argument {flag}: cannot write {path} ({e.strerror or e})") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: `python -m hybridserve.entrypoints.simulate [flags]`."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
