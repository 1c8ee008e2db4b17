"""``dspark-core table show|validate|plot`` through the real CLI entry point."""

from __future__ import annotations

import json

import pytest

from dspark_core.cli import main
from dspark_core.costs.fingerprint import launch_fingerprint
from dspark_core.config import parse_serve_args
from dspark_core.plugins import default_hooks
from dspark_core.resolve import pick_device
from dspark_core.geometry import Geometry
from dspark_core.table import fit_table, save_table
from test_costs_support import LOOKUP, grid_samples, settings, simple_cost

LEGACY = {"sample_batch_tokens": [1, 8, 16], "sample_steps_per_sec": [90.0, 80.0, 60.0], "max_batch_tokens": 16}


@pytest.fixture
def launch(tmp_path):
    """A small CPU launch (K=3, buckets 1 and 2) and a bundle fitted for exactly it."""
    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF" + bytes(100))
    flags = [f"--model={target}", "--num_speculative_tokens=3", "--max_seqs_per_batch=2",
             "--acl_graph_decode_batch_size_limit=2", "--device=cpu", "--speculative_algorithm=none"]
    config = parse_serve_args(flags)
    dtype = pick_device(default_hooks(), "cpu").default_dtype  # what --dtype=auto resolves to on this CPU
    fp = launch_fingerprint(config, Geometry.all_tiers(3, (1, 2)), graph_backend="static", dtype=dtype)
    table = fit_table(settings(buckets=(1, 2)), grid_samples(simple_cost, (1, 2), 3), LOOKUP, fp)
    return flags, save_table(table, tmp_path / "costs.json")


def test_show_prints_width_model_fingerprint_and_cost_grid(launch, capsys):
    _, path = launch
    assert main(["table", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model       additive" in out and "draft_width 3" in out
    assert 'execution.device: "cpu"' in out
    assert "interval 0: KV 1-256 (prefill 64); 11 measured point(s)" in out
    assert f"bucket 2   G=2: {simple_cost(2, 2) * 1000:.3f}" in out


def test_validate_accepts_the_matching_launch(launch, capsys):
    flags, path = launch
    assert main(["table", "validate", str(path), "--against", *flags]) == 0
    assert capsys.readouterr().out.startswith(f"compatible: {path}")


def test_validate_reports_every_mismatch_and_fails(launch, capsys):
    flags, path = launch
    other = [f for f in flags if not f.startswith("--num_speculative")] + ["--num_speculative_tokens=5", "--nnodes=2"]
    assert main(["table", "validate", str(path), "--against", *other]) == 1
    err = capsys.readouterr().err
    assert "draft_width: saved 3, launch 5" in err
    assert "parallelism.nnodes: saved 1, launch 2" in err
    assert "execution.geometry.draft_width: saved 3, launch 5" in err


def test_validate_without_against_checks_the_file_only(launch, capsys, tmp_path):
    _, path = launch
    assert main(["table", "validate", str(path)]) == 0
    broken = tmp_path / "broken.json"
    broken.write_text(path.read_text()[:200])
    assert main(["table", "validate", str(broken)]) == 1
    assert "truncated or corrupt" in capsys.readouterr().err


def test_validate_legacy_table_says_only_the_width_was_checked(launch, tmp_path, capsys):
    flags, _ = launch
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps(LEGACY))
    k7 = [f for f in flags if not f.startswith("--num_speculative")] + ["--num_speculative_tokens=7"]
    assert main(["table", "validate", str(legacy), "--against", *k7]) == 0
    assert "only its draft width could be checked" in capsys.readouterr().out
    assert main(["table", "validate", str(legacy), "--against", *flags]) == 1
    assert "draft_width: saved 7, launch 3" in capsys.readouterr().err


def test_validate_with_bad_serve_flags_is_a_usage_error(launch, capsys):
    _, path = launch
    assert main(["table", "validate", str(path), "--against", "--num_speculative_tokens=many"]) == 2
    assert "--against" in capsys.readouterr().err


def test_plot_writes_a_png(launch, tmp_path):
    _, path = launch
    out = tmp_path / "costs.png"
    assert main(["table", "plot", str(path), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_names_an_output_it_cannot_write(launch, tmp_path, capsys):
    _, path = launch
    assert main(["table", "plot", str(path), "-o", str(tmp_path)]) == 2
    assert "is a directory; name the image file" in capsys.readouterr().err
    assert main(["table", "plot", str(path), "-o", str(tmp_path / "costs.txt")]) == 2
    err = capsys.readouterr().err
    assert "must end in an image type" in err and ".png" in err
    assert not (tmp_path / "costs.txt").exists()


def test_plot_needs_measured_points(tmp_path, capsys):
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps(LEGACY))
    assert main(["table", "plot", str(legacy), "-o", str(tmp_path / "x.png")]) == 2
    assert "has no measured points" in capsys.readouterr().err


def test_validate_against_honours_captured_target_rows(launch, capsys):
    """The table was fitted for every tier; a launch capturing only bucket multiples is another geometry."""
    flags, path = launch
    assert main(["table", "validate", str(path), "--against", *flags, "--captured_target_rows=all"]) == 0
    capsys.readouterr()
    assert main(["table", "validate", str(path), "--against", *flags, "--captured_target_rows=bucket_multiples"]) == 1
    assert "execution.geometry.tiers" in capsys.readouterr().err
