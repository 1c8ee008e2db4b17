"""Packaging (issue 20): the library declares ranges while CI pins exact versions, the demo
calibration files and the shipped draft are package data that resolve from any directory, and a
built wheel holds them. (.ci/wheel-check, run by .ci/run after `make test`, installs the wheel
into a fresh venv and generates and serves from outside the repository.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from dspark_core.calibration.plan import read_calibration_file
from dspark_core.config import parse_serve_args
from dspark_core.configs import CONFIGS_DIR, demo_calibration_path
from dspark_core.errors import ConfigError
from dspark_core.startup import resolve_launch

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            pins[requirement.name.lower()] = str(requirement.specifier)
    return pins


def test_torch_is_a_range_in_the_library_and_exact_in_constraints():
    deps = {Requirement(d).name.lower(): Requirement(d).specifier for d in PYPROJECT["project"]["dependencies"]}
    assert not any(spec.operator in ("==", "===") for spec in deps["torch"]), deps["torch"]
    assert "2.13.0" in deps["torch"] and "2.11.0" in deps["torch"]
    pins = constraints()
    assert pins["torch"] == "==2.13.0"
    for name, spec in pins.items():
        assert spec.startswith("==") and "*" not in spec, f"constraints.txt: {name} must be an exact pin, got {spec}"
    dev = {Requirement(d).name.lower() for d in PYPROJECT["project"]["optional-dependencies"]["dev"]}
    unpinned = (set(deps) | dev) - set(pins)
    assert not unpinned, f"constraints.txt has no exact version for {sorted(unpinned)}"


def test_python_311_to_313_are_admitted():
    requires = SpecifierSet(PYPROJECT["project"]["requires-python"])
    for version in ("3.11.7", "3.12.1", "3.13.0"):
        assert version in requires, (version, requires)
    assert "3.10.13" not in requires


def test_make_and_ci_install_with_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    install = next(line for line in makefile.splitlines() if "pip install" in line and "-e" in line)
    assert "-c $(CONSTRAINTS)" in install and "CONSTRAINTS := constraints.txt" in makefile
    run = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
    assert run.index("make test") < run.index("make wheel-check")
    assert "-c \"$ROOT/constraints.txt\"" in (ROOT / ".ci/wheel-check").read_text()


@pytest.mark.parametrize("width,name,dtype", [(7, "demo-calibration.json", "float32"),
                                              (5, "demo-calibration-k5.json", "float32"),
                                              (7, "demo-calibration-bfloat16.json", "bfloat16"),
                                              (5, "demo-calibration-k5-bfloat16.json", "bfloat16")])
def test_demo_calibration_resolves_from_any_directory(tmp_path, monkeypatch, width, name, dtype):
    """The demo alias picks the file for the width and the target dtype (bfloat16: the stair grid)."""
    monkeypatch.chdir(tmp_path)
    assert demo_calibration_path(width, dtype) == CONFIGS_DIR / name
    launch = resolve_launch(parse_serve_args(["--model=smollm2", "--draft_model=default",
                                              f"--num_speculative_tokens={width}", f"--dtype={dtype}",
                                              "--adaptive_dspark_calibration=demo"]))
    assert launch.calibration_file == read_calibration_file(str(CONFIGS_DIR / name))
    # the repository's old paths still lead to the same files
    assert (ROOT / "configs" / name).resolve() == (CONFIGS_DIR / name).resolve()


def test_demo_calibration_for_an_unshipped_width_is_refused():
    # (the serve flags never get here: adaptive DSpark itself accepts only K=5 or 7)
    with pytest.raises(ConfigError, match=r"demo calibration ships for K=5 and K=7 only.*num_speculative_tokens=6"):
        demo_calibration_path(6)


def test_an_explicit_calibration_path_is_used_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    own = json.loads((CONFIGS_DIR / "demo-calibration.json").read_text())
    own["token_seed"] = 7
    (tmp_path / "mine.json").write_text(json.dumps(own))
    launch = resolve_launch(parse_serve_args(["--model=smollm2", "--draft_model=default",
                                              "--adaptive_dspark_calibration=mine.json"]))
    assert launch.calibration_file == read_calibration_file("mine.json")
    assert launch.calibration_file != read_calibration_file(str(CONFIGS_DIR / "demo-calibration.json"))


def test_built_wheel_holds_the_draft_and_the_demo_calibrations(tmp_path):
    """`python -m build --wheel` (isolated, as a release would) on a copy of the tree."""
    pytest.importorskip("build")
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "results"))
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "absent from the `packages` configuration" not in done.stdout + done.stderr
    wheel = next((tmp_path / "dist").glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        for name in ("demo-calibration.json", "demo-calibration-k5.json", "demo-calibration-bfloat16.json",
                     "demo-calibration-k5-bfloat16.json"):
            assert archive.read(f"dspark_core/configs/{name}") == (CONFIGS_DIR / name).read_bytes()
        for name in ("config.json", "model.safetensors"):
            member = f"dspark_core/drafts/smollm2/{name}"
            assert archive.getinfo(member).file_size == (ROOT / member).stat().st_size
    assert "dspark_plugins/policies/adaptive.py" in names and "dspark_kernels/__init__.py" in names
    assert not any(n.startswith(("tests/", "configs/", "benchmarks/")) for n in names)
    assert "Requires-Python: >=3.11" in metadata
    torch = next(line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch"))
    assert "==" not in torch
    assert "adaptive = dspark_plugins.policies.adaptive" in entry_points


@pytest.mark.parametrize("width,name", [(7, "demo-calibration.json"), (5, "demo-calibration-k5.json")])
def test_bench_defaults_to_the_packaged_demo_calibration(tmp_path, monkeypatch, width, name):
    """`dspark-core bench` (in-process) from a directory without configs/: the launch it builds
    reads the packaged file for its width (model loading and bring-up stubbed out)."""
    import argparse

    import dspark_core.calibration.install as install
    import dspark_core.startup as startup
    from dspark_core.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([f"--num_speculative_tokens={width}"])
    launches = []
    monkeypatch.setattr(startup, "build_engine", lambda launch: launches.append(launch) or "engine")
    monkeypatch.setattr(install, "bring_up", lambda engine, launch, progress=True: None)
    monkeypatch.chdir(tmp_path)
    assert bench._engine(args) == "engine"
    assert launches[0].calibration_file == read_calibration_file(str(CONFIGS_DIR / name))
