"""benchmarks/attention_kernel.py: the invariant attention kernel timed alone, beside another checkout's."""

from __future__ import annotations

import functools
import json

from script_support import ROOT, run_benchmark

run_script = functools.partial(run_benchmark, "attention_kernel.py")


def test_times_each_shape_and_context_beside_another_tree(tmp_path):
    out = tmp_path / "attention.json"
    shapes = {"even": [2, 2], "uneven": [1, 6]}
    proc = run_script("--requests", "2", "--shapes", json.dumps(shapes), "--contexts", "30,600", "--rounds", "2",
                      "--calls", "2", "--compare_tree", str(ROOT), "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert [(r["context"], r["shape"]) for r in saved["results"]] == [(30, "even"), (30, "uneven"), (600, "even"), (600, "uneven")]
    for row in saved["results"]:
        assert row["this_us"] > 0 and row["compared_us"] > 0 and row["this_vs_compared"] > 0
        assert row["max_abs_diff"] == 0.0  # this checkout against itself: the same bits
    assert saved["meta"]["compare_tree"] == str(ROOT) and saved["meta"]["requests"] == 2


def test_shapes_that_do_not_fit_the_requests_are_refused():
    proc = run_script("--requests", "2", "--shapes", json.dumps({"a": [1, 1, 1]}))
    assert proc.returncode == 2 and "--shapes ['a']: each needs 2 positive row counts" in proc.stderr
