"""benchmarks/step_intervals.py: real step intervals in serving beside the table's prices."""

from __future__ import annotations

import json

import pytest
from script_support import ROOT, load_script, run_benchmark, write_prompts

TABLE = ROOT / "benchmarks" / "results" / "avx2" / "bench-mtbench-auto" / "cost-table.json"


def test_only_intervals_with_the_bucket_full_on_both_sides_count():
    steady_intervals = load_script("step_intervals").steady_intervals
    stamps = [(0.0, 2, 2, True), (0.1, 2, 2, True), (0.25, 2, 4, False),  # two steady intervals
              (0.5, 1, 1, True),  # a request finished: neither interval around this step counts
              (0.6, 2, 2, True), (0.9, 2, 6, False)]  # a new one was admitted before 0.6: only 0.6 -> 0.9
    out = steady_intervals(stamps, 2)
    assert out.keys() == {"off", "G4", "G6"}
    assert out["off"] == pytest.approx([100.0])
    assert out["G4"] == pytest.approx([150.0]) and out["G6"] == pytest.approx([300.0])


@pytest.mark.slow
def test_each_policy_reports_its_own_kinds_of_step_beside_their_prices(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["The capital of France is", "Water boils at", "One, two,"])
    out = tmp_path / "intervals.json"
    proc = run_benchmark("step_intervals.py", "--table", str(TABLE), "--prompts", str(prompts), "--limit", "3",
                         "--concurrency", "2", "--max_tokens", "8", "--rounds", "1", "--policies", "none,fixed-k1",
                         "--threads", "1", "--max_model_len", "128", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(out.read_text())
    rows = {row["policy"]: row for row in saved["results"]}
    assert list(rows) == ["none", "fixed-k1"] and saved["meta"]["concurrency"] == 2
    assert list(rows["none"]["steps"]) == ["off"]  # target-only never drafts
    assert rows["fixed-k1"]["steps"] and "off" not in rows["fixed-k1"]["steps"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0
        for step in row["steps"].values():
            assert step["steps"] > 0 and step["median_ms"] > 0 and step["table_ms"] > 0
            assert step["over_table"] == pytest.approx(step["median_ms"] / step["table_ms"], abs=1e-3)


def test_an_unknown_policy_is_refused_by_name():
    proc = run_benchmark("step_intervals.py", "--table", str(TABLE), "--policies", "none,fixed-k9")
    assert proc.returncode != 0 and "fixed-k9" in proc.stderr
