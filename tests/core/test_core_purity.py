"""hybridserve.core is pure Python: importing all of it must not pull in torch.

Runs in a fresh interpreter, because this test process may already have torch loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import importlib, json, pkgutil, sys
import hybridserve.core as core
names = [m.name for m in pkgutil.walk_packages(core.__path__, prefix="hybridserve.core.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
"""


def test_core_never_imports_torch() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # The walk really covered the core (guards against an empty package list passing trivially).
    for name in ("hybridserve.core.kv.cache_manager", "hybridserve.core.kv.block_pool", "hybridserve.core.request"):
        assert name in result["modules"]
    assert result["torch"] == [], f"torch imported by hybridserve.core: {result['torch'][:5]}"
