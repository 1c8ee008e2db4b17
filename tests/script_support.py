"""Scripts of ``benchmarks/`` in tests: imported as a module, or run in their own process, the way they run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module; its own imports of sibling scripts (``common``) resolve."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_benchmark(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> args...`` with ``benchmarks/`` as working directory (output captured)."""
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=BENCHMARKS)


def write_prompts(path: Path, prompts: list[str]) -> Path:
    """A prompts JSONL file (one ``{"prompt": ...}`` per line) at ``path``."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path
