"""Long random searches with the suite's property tests: what the derandomized `ci` profile
(tests/conftest.py) cannot find because it draws the same examples on every run.

    python benchmarks/hypothesis_soak.py [--minutes 20] [--scale 5] [PYTEST_ARGS ...]

Runs pytest in rounds until the budget is spent, one process at a time. Each round is
`pytest tests/` (or PYTEST_ARGS) with HYPOTHESIS_PROFILE=soak, a fresh random
`--hypothesis-seed`, only the property tests kept (`@given` tests and rule-based state
machines), and every test's own max_examples multiplied by --scale. Prints each round's
seed, the examples run per test (hypothesis' observability callbacks count them) and
every failure with its falsifying example; exits 1 if any test failed. A failure
reproduces with the round's printed pytest command, or with its `@reproduce_failure` line.

This file is also the pytest plugin the rounds load (`-p hypothesis_soak`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLUGIN = Path(__file__).stem
# A round past the budget gets SIGINT (pytest stops and still writes its report), then this long.
INTERRUPT_GRACE_S = 60


# -- the plugin, in each round's pytest process ------------------------------------------------

_counts: dict[str, Counter] = {}
_failures: list[dict] = []
_minimal: list[str] = []  # the shrunk failing examples of the test running now


def _scale() -> int:
    return int(os.environ["HYPOTHESIS_SOAK_SCALE"])


def _scaled(s, scale: int):  # type: ignore[no-untyped-def]
    from hypothesis import settings

    return settings(s, max_examples=s.max_examples * scale)


def _observe(observation) -> None:  # type: ignore[no-untyped-def]
    if observation.type == "test_case":
        _counts.setdefault(observation.property, Counter())[observation.status] += 1
        if observation.status == "failed" and observation.how_generated == "minimal failing test case":
            args = ", ".join(f"{k}={v!r}" for k, v in observation.arguments.items())
            _minimal.append(f"{observation.property}({args})\n{observation.metadata.reproduction_decorator}")


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    if "HYPOTHESIS_SOAK_REPORT" not in os.environ:
        return
    from hypothesis.internal import observability

    observability.OBSERVABILITY_COLLECT_COVERAGE = False  # else every example runs traced
    observability.add_observability_callback(_observe)


def pytest_collection_modifyitems(session, config, items) -> None:  # type: ignore[no-untyped-def]
    """Keep the property tests and give each `scale` times its own max_examples (a test's
    @settings overrides the profile's max_examples, so the profile alone cannot raise it;
    the settings a @given test runs with are those @settings stored on it)."""
    if "HYPOTHESIS_SOAK_REPORT" not in os.environ:
        return
    from hypothesis import is_hypothesis_test, settings

    kept, dropped, done = [], [], set()
    for item in items:
        fn = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        machine = getattr(item, "cls", None)
        if machine is not None and isinstance(getattr(machine, "settings", None), settings) \
                and hasattr(machine, "runTest"):
            if id(machine) not in done:  # a RuleBasedStateMachine.TestCase reads its class settings
                machine.settings = _scaled(machine.settings, _scale())
                done.add(id(machine))
            kept.append(item)
        elif fn is not None and is_hypothesis_test(fn):
            if id(fn) not in done:  # parametrized copies share the function
                fn._hypothesis_internal_use_settings = _scaled(fn._hypothesis_internal_use_settings, _scale())
                done.add(id(fn))
            kept.append(item)
        else:
            dropped.append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_runtest_logreport(report) -> None:  # type: ignore[no-untyped-def]
    if "HYPOTHESIS_SOAK_REPORT" in os.environ and report.failed:
        errors = [ln for ln in report.longreprtext.splitlines() if ln.startswith("E ")]
        _failures.append({"test": report.nodeid, "when": report.when, "falsifying": "\n".join(_minimal),
                          "error": "\n".join(errors[:40])})
    if report.when == "teardown":
        _minimal.clear()
    _write_report()


def pytest_sessionfinish(session, exitstatus) -> None:  # type: ignore[no-untyped-def]
    _write_report()


def _write_report() -> None:
    path = os.environ.get("HYPOTHESIS_SOAK_REPORT")
    if path:
        tmp = path + ".tmp"
        Path(tmp).write_text(json.dumps({"counts": {k: dict(v) for k, v in _counts.items()}, "failures": _failures}))
        os.replace(tmp, path)


# -- the driver ----------------------------------------------------------------------------------


def run_round(seed: int, scale: int, pytest_args: list[str], deadline: float, report: Path) -> tuple[dict, bool]:
    """One pytest process; (its report, whether it was cut at the deadline)."""
    env = dict(os.environ, HYPOTHESIS_PROFILE="soak", HYPOTHESIS_SOAK_SCALE=str(scale),
               HYPOTHESIS_SOAK_REPORT=str(report),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), str(Path(__file__).parent),
                                                      os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", PLUGIN, "-p", "no:cacheprovider",
           f"--hypothesis-seed={seed}", *pytest_args]
    print(f"round seed {seed}: PYTHONPATH=.:benchmarks HYPOTHESIS_PROFILE=soak HYPOTHESIS_SOAK_SCALE={scale} "
          f"HYPOTHESIS_SOAK_REPORT=/tmp/soak.json python {' '.join(cmd[1:])}", flush=True)
    report.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cut = False
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        cut = True
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    tail = out.strip().splitlines()[-1:] if out.strip() else ["(no output)"]
    print(f"  pytest: {tail[0]}", flush=True)
    if not report.exists():
        return {"counts": {}, "failures": [] if cut else [
            {"test": "(round)", "when": "run", "falsifying": "", "error": out[-4000:]}]}, cut
    result = json.loads(report.read_text())
    if proc.returncode not in (0, 5) and not cut and not result["failures"]:  # 5: nothing collected
        result["failures"].append({"test": "(round)", "when": "run", "falsifying": "", "error": out[-4000:]})
    return result, cut


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget (default 20)")
    parser.add_argument("--scale", type=int, default=5, help="max_examples multiplier per test (default 5)")
    parser.add_argument("pytest_args", nargs="*", default=["tests"], help="what pytest collects (default tests)")
    args = parser.parse_args()
    if args.scale < 1 or args.minutes <= 0:
        parser.error("--scale must be >= 1 and --minutes > 0")

    start = time.monotonic()
    deadline = start + args.minutes * 60
    totals: dict[str, Counter] = {}
    failures: list[tuple[int, dict]] = []
    seeds: list[int] = []
    report = Path(f"/tmp/hypothesis_soak_{os.getpid()}.json")
    while time.monotonic() < deadline:
        seed = random.SystemRandom().getrandbits(64)
        seeds.append(seed)
        result, cut = run_round(seed, args.scale, args.pytest_args, deadline, report)
        for test, by_status in result["counts"].items():
            totals.setdefault(test, Counter()).update(by_status)
        failures += [(seed, f) for f in result["failures"]]
        n = sum(sum(c.values()) for c in result["counts"].values())
        print(f"  {n} examples, {len(result['failures'])} failures{' (cut at the budget)' if cut else ''}",
              flush=True)
    report.unlink(missing_ok=True)

    elapsed = time.monotonic() - start
    print(f"\n{len(seeds)} rounds in {elapsed / 60:.1f} min, --scale {args.scale}; seeds: {seeds}")
    print("(failed counts every failing example, those tried while shrinking too)")
    print(f"{'test':60} {'passed':>8} {'invalid':>8} {'failed':>7}")
    for test in sorted(totals):
        c = totals[test]
        print(f"{test:60} {c['passed']:8} {c['gave_up']:8} {c['failed']:7}")
    all_counts = sum(totals.values(), Counter())
    print(f"{'total':60} {all_counts['passed']:8} {all_counts['gave_up']:8} {all_counts['failed']:7}")
    print(f"examples run: {sum(all_counts.values())}; failing tests: {len(failures)}")
    for seed, f in failures:
        print(f"\nFAILED {f['test']} ({f['when']}), --hypothesis-seed={seed}")
        # the arguments as hypothesis' observations record them (JSON: dict keys become strings)
        print(f"falsifying example: {f['falsifying'] or '(none: not a property failure)'}")
        print(f["error"])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
