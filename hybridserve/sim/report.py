"""What a simulation run reports: SimReport, its JSON, a rich summary table and a plot.

All times are simulated seconds except `wall_time_s`. KV usage is the fraction of the
pool's allocatable blocks (null block excluded) a group's block tables hold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 and mean of `values`; None for each when there are no values."""
    if not len(values):
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


@dataclass
class TimeSeries:
    """Per-step samples: `time[i]` is the simulated clock when step i was processed.

    `kv_usage[g]` holds a group's usage at the steps listed in `kv_time` (sampled with a
    stride that doubles as the run grows, so recording stays cheap on long runs).
    """

    time: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    kv_time: list[float] = field(default_factory=list)
    kv_usage: list[list[float]] = field(default_factory=list)


@dataclass
class SimReport:
    label: str
    config: dict[str, Any]
    num_requests: int
    num_finished: int
    num_rejected: int
    sim_time_s: float
    wall_time_s: float
    num_steps: int
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    mean_running: float
    max_running: int
    num_preemptions: int
    num_blocks: int
    # KV bytes admission reserves for one max_model_len request, per token of it, and how
    # many such requests the pool admits at once (the admission caps, checkpoints included).
    kv_bytes_per_token: float
    max_len_requests: float
    kv_groups: list[str]
    kv_peak_usage: list[float]
    kv_mean_usage: list[float]
    pool_peak_usage: float
    pool_mean_usage: float
    prefix_cache_hit_rate: float
    spec_acceptance_rate: float
    violations: int
    violation_examples: list[str]
    series: TimeSeries = field(default_factory=TimeSeries, repr=False)

    def to_dict(self, include_series: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not include_series:
            d.pop("series")
        return _finite(d)


def _finite(obj: Any) -> Any:
    """JSON has no NaN/inf: turn them into null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.1f}"


def summary_rows(r: SimReport) -> list[tuple[str, str, float | None]]:
    """(metric, formatted value, raw number for ratios) of the summary table."""
    rows: list[tuple[str, str, float | None]] = [
        ("requests finished", f"{r.num_finished}/{r.num_requests}", float(r.num_finished)),
        ("simulated time (s)", f"{r.sim_time_s:.2f}", r.sim_time_s),
        ("output tokens/s", f"{r.output_tokens_per_s:,.0f}", r.output_tokens_per_s),
        ("total tokens/s", f"{r.total_tokens_per_s:,.0f}", r.total_tokens_per_s),
    ]
    for name, d in (("TTFT", r.ttft_s), ("TPOT", r.tpot_s), ("E2E", r.e2e_s)):
        text = " / ".join(_ms(d[f"p{p}"]) for p in PERCENTILES)
        rows.append((f"{name} p50/p90/p99 (ms)", text, d["p50"]))
    rows += [
        ("running mean / max", f"{r.mean_running:.1f} / {r.max_running}", r.mean_running),
        ("preemptions", f"{r.num_preemptions:,}", float(r.num_preemptions)),
        ("KV pool blocks", f"{r.num_blocks:,}", float(r.num_blocks)),
        ("KV bytes / token (max-length request)", f"{r.kv_bytes_per_token:,.0f}", r.kv_bytes_per_token),
        ("max-length requests that fit", f"{r.max_len_requests:,.1f}", r.max_len_requests),
        ("KV pool used peak / mean", f"{r.pool_peak_usage:.1%} / {r.pool_mean_usage:.1%}", r.pool_peak_usage),
    ]
    # Each group's part of the used blocks (time-weighted means), so the groups add up to
    # 100% of what the pool row shows.
    for name, mean in zip(r.kv_groups, r.kv_mean_usage):
        share = mean / r.pool_mean_usage if r.pool_mean_usage else 0.0
        rows.append((f"  {name}: share of used", f"{share:.1%}", share))
    rows += [
        ("prefix cache hit rate", f"{r.prefix_cache_hit_rate:.1%}", r.prefix_cache_hit_rate),
        ("violations found", str(r.violations), float(r.violations)),
        ("steps / wall time (s)", f"{r.num_steps:,} / {r.wall_time_s:.2f}", float(r.num_steps)),
    ]
    if r.spec_acceptance_rate:
        rows.insert(-2, ("spec acceptance rate", f"{r.spec_acceptance_rate:.1%}", r.spec_acceptance_rate))
    return rows


def print_summary(reports: Sequence[SimReport], console: Any = None) -> None:
    """One table; with two reports, a third column holds the ratio second / first."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        import sys

        # Piped output gets a table wide enough for two runs and their ratio.
        console = Console() if sys.stdout.isatty() else Console(width=130)
    table = Table(title="hybridserve simulate")
    table.add_column("metric")
    for r in reports:
        table.add_column(r.label, justify="right")
    if len(reports) == 2:
        table.add_column("ratio", justify="right")
    per_report = [{metric: (text, raw) for metric, text, raw in summary_rows(r)} for r in reports]
    metrics: list[str] = []
    for rows in per_report:
        metrics += [m for m in rows if m not in metrics]
    for metric in metrics:
        cells = [rows[metric][0] if metric in rows else "-" for rows in per_report]
        if len(reports) == 2:
            a = per_report[0].get(metric, ("", None))[1]
            b = per_report[1].get(metric, ("", None))[1]
            cells.append(f"{b / a:.2f}x" if a and b is not None else "-")
        table.add_row(metric, *cells)
    console.print(table)
    for r in reports:
        for example in r.violation_examples[:5]:
            console.print(f"[red]violation[/red] ({r.label}): {example}", highlight=False)


def plot(report: SimReport | Sequence[SimReport], path: str) -> None:
    """KV usage per group, running requests and output throughput over simulated time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [report] if isinstance(report, SimReport) else list(report)
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, r in enumerate(reports):
        color = colors[k % len(colors)]
        s = r.series
        prefix = f"{r.label}: " if len(reports) > 1 else ""
        for name, usage in zip(r.kv_groups, s.kv_usage):
            axes[0].plot(s.kv_time, [u * 100 for u in usage], label=f"{prefix}{name}")
        axes[1].plot(s.time, s.running, label=f"{prefix}running", color=color)
        axes[1].plot(s.time, s.waiting, label=f"{prefix}waiting", linestyle=":", color=color)
        centers, rate = _binned_rate(s.time, s.output_tokens)
        axes[2].plot(centers, rate, label=f"{prefix}output tokens/s", color=color)
    axes[0].set_ylabel("KV usage (% of pool)")
    axes[1].set_ylabel("requests")
    axes[2].set_ylabel("output tokens/s")
    axes[2].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper right")
    fig.suptitle(" vs ".join(f"{r.label} ({r.config.get('model_layout')} on {r.config.get('gpu')})" for r in reports))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _binned_rate(times: list[float], tokens: list[int], bins: int = 100) -> tuple[list[float], list[float]]:
    if not times:
        return [], []
    end = max(times[-1], 1e-9)
    edges = np.linspace(0.0, end, bins + 1)
    sums, _ = np.histogram(np.asarray(times), bins=edges, weights=np.asarray(tokens, dtype=np.float64))
    width = edges[1] - edges[0]
    return ((edges[:-1] + edges[1:]) / 2).tolist(), (sums / width).tolist()
