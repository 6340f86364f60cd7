"""Hypothesis profiles: the suite is derandomized, so one commit gives one result.

`ci` (the default, what the README's command runs): every property test draws the
same examples on every run and machine, and no example database carries failures from
one run into the next. `soak` (benchmarks/hypothesis_soak.py): random seeds, for long
searches. Pick one with HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("soak", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
