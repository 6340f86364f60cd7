"""Simulated workloads: length distributions, arrivals, shared prefixes, JSONL traces.

A workload is a list of `WorkloadItem`s (lengths and arrival time only); `to_requests`
turns them into `Request`s with concrete token ids. Both steps are pure functions of
their seed, so two configurations compared with `--compare` see identical requests.
Items that share a `prefix_id` share the exact first `prefix_len` prompt tokens, so
prefix caching can hit on them; all other tokens are random over a large vocabulary,
which makes accidental prefix matches between unrelated requests vanishingly rare.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.core.request import Request, SamplingParams


class WorkloadError(ConfigError):
    """A workload flag or trace line is malformed."""


@dataclass(frozen=True)
class LengthDistribution:
    """`fixed:N` (or just `N`), `uniform:LO:HI` (inclusive) or `lognormal:MEAN:SIGMA`.

    For lognormal, MEAN is the mean length in tokens and SIGMA the standard deviation of
    the underlying normal (mu = ln(MEAN) - SIGMA^2 / 2); samples are rounded and clipped
    to >= 1.
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, flag: str = "length") -> "LengthDistribution":
        parts = text.strip().split(":")
        if len(parts) == 1 and parts[0].isdigit():  # a bare length, as users type it
            parts = ["fixed", parts[0]]
        kind = parts[0].lower()
        expected = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if kind not in expected:
            raise WorkloadError(f"{flag}: unknown distribution {text!r}; use N, fixed:N, uniform:LO:HI or lognormal:MEAN:SIGMA")
        if len(parts) - 1 != expected[kind]:
            raise WorkloadError(f"{flag}: {kind} takes {expected[kind]} number(s), got {text!r}")
        try:
            nums = [float(p) for p in parts[1:]]
        except ValueError:
            raise WorkloadError(f"{flag}: {text!r} has a value that is not a number") from None
        if not all(math.isfinite(x) for x in nums):
            raise WorkloadError(f"{flag}: {text!r} has a non-finite value")
        if kind in ("fixed", "uniform") and any(x != int(x) or x < 1 for x in nums):
            raise WorkloadError(f"{flag}: {text!r} needs whole numbers >= 1")
        if kind == "uniform" and nums[0] > nums[1]:
            raise WorkloadError(f"{flag}: {text!r} has LO > HI")
        if kind == "lognormal" and (nums[0] <= 0 or nums[1] < 0):
            raise WorkloadError(f"{flag}: {text!r} needs MEAN > 0 and SIGMA >= 0")
        return cls(kind, nums[0], nums[1] if len(nums) > 1 else 0.0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b) + 1, size=n, dtype=np.int64)
        mu = math.log(self.a) - self.b * self.b / 2
        return np.maximum(1, np.rint(rng.lognormal(mu, self.b, size=n))).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class WorkloadSpec:
    """A generated workload. arrival_rate None (or inf) means every request arrives at t=0."""

    num_requests: int = 200
    prompt_len: LengthDistribution = LengthDistribution("uniform", 512, 4096)
    output_len: LengthDistribution = LengthDistribution("uniform", 32, 256)
    arrival_rate: float | None = None
    num_prefix_groups: int = 0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.arrival_rate is not None and not self.arrival_rate > 0:
            raise WorkloadError(f"--arrival-rate must be > 0 requests/s, got {self.arrival_rate}")
        if self.num_prefix_groups < 0:
            raise WorkloadError(f"--prefix-groups must be >= 0, got {self.num_prefix_groups}")
        if self.prefix_len < 0:
            raise WorkloadError(f"--prefix-len must be >= 0, got {self.prefix_len}")
        if self.num_prefix_groups > 0 and self.prefix_len == 0:
            raise WorkloadError("--prefix-groups needs --prefix-len > 0")

    @classmethod
    def from_flags(
        cls,
        num_requests: int,
        prompt_len: str,
        output_len: str,
        arrival_rate: float | None = None,
        prefix_groups: int = 0,
        prefix_len: int = 0,
    ) -> "WorkloadSpec":
        return cls(
            num_requests=num_requests,
            prompt_len=LengthDistribution.parse(prompt_len, "--prompt-len"),
            output_len=LengthDistribution.parse(output_len, "--output-len"),
            arrival_rate=arrival_rate,
            num_prefix_groups=prefix_groups,
            prefix_len=prefix_len,
        )


@dataclass(frozen=True)
class WorkloadItem:
    """One request's shape. Items with the same prefix_id share their first prefix_len tokens."""

    index: int
    prompt_len: int
    output_len: int
    arrival_time: float
    prefix_id: str | None = None
    prefix_len: int = 0
    # Where the item came from ("trace.jsonl:3"), for error messages; "" when generated.
    origin: str = ""

    def describe(self) -> str:
        return f"request {self.index}" + (f" ({self.origin})" if self.origin else "")


def generate(spec: WorkloadSpec, seed: int = 0) -> list[WorkloadItem]:
    """Items in arrival order; request i of a prefix-group workload joins group i % groups."""
    rng = np.random.default_rng([seed, 0])
    n = spec.num_requests
    prompts = spec.prompt_len.sample(rng, n).tolist()
    outputs = spec.output_len.sample(rng, n).tolist()
    if spec.arrival_rate is None or math.isinf(spec.arrival_rate):
        arrivals = [0.0] * n
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / spec.arrival_rate, size=n)).tolist()
    items = []
    for i in range(n):
        pid = str(i % spec.num_prefix_groups) if spec.num_prefix_groups else None
        plen = min(spec.prefix_len, prompts[i]) if pid is not None else 0
        items.append(WorkloadItem(i, prompts[i], outputs[i], arrivals[i], pid, plen))
    return items


def _int_field(obj: dict, key: str, where: str, minimum: int, required: bool = True) -> int | None:
    if key not in obj:
        if required:
            raise WorkloadError(f"{where}: missing {key!r}")
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise WorkloadError(f"{where}: {key!r} must be a whole number, got {v!r}")
    if v < minimum:
        raise WorkloadError(f"{where}: {key!r} must be >= {minimum}, got {v!r}")
    return int(v)


def _parse_trace_line(text: str, where: str, index: int) -> tuple[WorkloadItem, int | None]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    prompt_len = _int_field(obj, "prompt_len", where, 1)
    output_len = _int_field(obj, "output_len", where, 1)
    arrival = obj.get("arrival_time")
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
        raise WorkloadError(f"{where}: 'arrival_time' must be a number of seconds, got {arrival!r}")
    if not math.isfinite(arrival) or arrival < 0:
        raise WorkloadError(f"{where}: 'arrival_time' must be finite and >= 0, got {arrival!r}")
    pid = obj.get("prefix_id")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))):
        raise WorkloadError(f"{where}: 'prefix_id' must be a string or an integer, got {pid!r}")
    plen = _int_field(obj, "prefix_len", where, 0, required=False)
    if plen is not None and pid is None:
        raise WorkloadError(f"{where}: 'prefix_len' given without 'prefix_id'")
    assert prompt_len is not None and output_len is not None  # required fields
    item = WorkloadItem(index, prompt_len, output_len, float(arrival), None if pid is None else str(pid), 0, where)
    return item, plen


def load_trace(path: str | Path, default_prefix_len: int | None = None) -> list[WorkloadItem]:
    """Read a JSONL trace: {prompt_len, output_len, arrival_time[, prefix_id[, prefix_len]]}.

    Blank lines are skipped; unknown keys are ignored. A prefix group's shared length is
    the line's prefix_len, else `default_prefix_len`, else the group's shortest prompt;
    it is clipped to each prompt. Items come back sorted by arrival time (stable).
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"--trace {path}: cannot read ({e.__class__.__name__}: {e})") from None
    parsed: list[tuple[WorkloadItem, int | None]] = []
    for lineno, text in enumerate(lines, start=1):
        if text.strip():
            parsed.append(_parse_trace_line(text, f"{path}:{lineno}", len(parsed)))
    if not parsed:
        raise WorkloadError(f"{path}: the trace has no requests")
    shortest: dict[str, int] = {}
    for item, _ in parsed:
        if item.prefix_id is not None:
            shortest[item.prefix_id] = min(shortest.get(item.prefix_id, item.prompt_len), item.prompt_len)
    items = []
    for item, plen in parsed:
        if item.prefix_id is not None:
            if plen is None:
                plen = default_prefix_len if default_prefix_len is not None else shortest[item.prefix_id]
            item = replace(item, prefix_len=min(plen, item.prompt_len))
        items.append(item)
    items.sort(key=lambda it: it.arrival_time)
    return items


def to_requests(items: list[WorkloadItem], seed: int = 0, vocab_size: int = 32000) -> list[Request]:
    """Requests with concrete token ids in [1, vocab_size), deterministic from `seed`.

    Items with the same prefix_id get the exact same first prefix_len tokens (one token
    line per group, as long as the group's longest shared prefix). Every request has
    max_tokens = output_len and ignore_eos, so it produces exactly output_len tokens.
    """
    if vocab_size < 2:
        raise WorkloadError(f"vocab_size must be >= 2, got {vocab_size}")
    prefix_need: dict[str, int] = {}
    for it in items:
        if it.prefix_id is not None:
            prefix_need[it.prefix_id] = max(prefix_need.get(it.prefix_id, 0), it.prefix_len)
    # Group prefixes come from their own stream, so adding requests never changes them.
    prefixes = {
        pid: np.random.default_rng([seed, 2, k]).integers(1, vocab_size, size=n).tolist()
        for k, (pid, n) in enumerate(sorted(prefix_need.items()))
    }
    rng = np.random.default_rng([seed, 1])
    reqs = []
    for it in items:
        shared = prefixes[it.prefix_id][: it.prefix_len] if it.prefix_id is not None else []
        own = rng.integers(1, vocab_size, size=it.prompt_len - len(shared)).tolist()
        reqs.append(
            Request(
                request_id=f"req-{it.index}",
                prompt_token_ids=shared + own,
                sampling_params=SamplingParams(max_tokens=it.output_len, ignore_eos=True),
                arrival_time=it.arrival_time,
            )
        )
    return reqs
