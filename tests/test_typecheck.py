"""The package type-checks: mypy, configured in pyproject.toml ([tool.mypy]), reports no error.

mypy keeps its incremental cache in .mypy_cache (git-ignored), so a run after
small edits takes seconds; a cold run takes about 20 s on the project machines.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install -e '.[dev]')")
def test_mypy_passes_on_the_package():
    # the files, settings and cache directory come from pyproject.toml
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mypy reported errors:\n{result.stdout}{result.stderr}"
