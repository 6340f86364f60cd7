"""Hypothesis profiles: the suite is derandomized, so one commit gives one result.

`ci` (the default, what the README's command runs): every property test draws the
same examples on every run and machine, and no example database carries failures from
one run into the next. `soak` (benchmarks/hypothesis_soak.py): random seeds, for long
searches. Pick one with HYPOTHESIS_PROFILE. Neither times examples (no deadline, no
too-slow health check): on a loaded 2-core machine the same examples run several times
slower, and a result that depends on the machine's load is not one result per commit.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_UNTIMED = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, **_UNTIMED)
settings.register_profile("soak", derandomize=False, database=None, print_blob=True, **_UNTIMED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
