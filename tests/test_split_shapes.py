"""benchmarks/split_shapes.py: host-fixed split shapes on the real model, and its argument checks."""

from __future__ import annotations

import functools
import json

import pytest
from script_support import run_benchmark, write_prompts

run_script = functools.partial(run_benchmark, "split_shapes.py")


@pytest.mark.slow
def test_each_shape_verifies_its_own_rows_and_is_timed_every_round(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["The capital of France is", "Water boils at"])
    out = tmp_path / "shapes.json"
    shapes = {"even": [1, 1], "uneven": [2, 0], "wide": [7, 3]}
    proc = run_script("--prompts", str(prompts), "--shapes", json.dumps(shapes), "--rounds", "2", "--steps", "2",
                      "--max_model_len", "128", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    rows = {row["shape"]: row for row in saved["results"]}
    assert list(rows) == ["even", "uneven", "wide"]
    assert [rows[k]["target_rows"] for k in rows] == [4, 4, 12]
    assert [rows[k]["observed_target_rows"] for k in rows] == [[4], [4], [12]]  # the steps ran those rows
    assert all(len(row["step_ms"]) == 2 and row["step_ms_median"] > 0 for row in rows.values())
    assert saved["meta"]["shapes"] == shapes


@pytest.mark.parametrize("shapes, message", [
    ("{not json", "--shapes is not JSON"),
    ('{"a": [1, 1], "b": [1]}', "one entry per request"),
    ('{"a": [1, 8]}', "'a' needs draft rows in 0..7"),
    (json.dumps({"a": [1] * 17}), "at most 16 requests"),
])
def test_bad_shapes_are_refused_before_any_model_loads(shapes, message):
    proc = run_script("--shapes", shapes)
    assert proc.returncode == 2 and message in proc.stderr
