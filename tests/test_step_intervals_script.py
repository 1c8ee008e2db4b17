"""benchmarks/step_intervals.py: real step intervals in serving beside the table's prices."""

from __future__ import annotations

import json

import pytest
from script_support import ROOT, load_script, run_benchmark, write_prompts

TABLE = ROOT / "benchmarks" / "results" / "avx2" / "bench-mtbench-auto" / "cost-table.json"


def test_only_intervals_with_the_bucket_full_on_both_sides_and_no_prefill_between_count():
    steady_intervals = load_script("step_intervals").steady_intervals
    stamps = [(0.0, 2, 2, True, 1), (0.1, 2, 2, True, 1), (0.25, 2, 4, False, 1),  # two steady intervals
              (0.5, 1, 1, True, 1),  # a request finished: neither interval around this step counts
              (0.6, 2, 2, True, 2), (0.9, 2, 6, False, 2),  # a new one was admitted before 0.6: only 0.6 -> 0.9
              (1.3, 2, 4, False, 3)]  # a slot refilled with the batch still full: the prefill is in this interval
    out = steady_intervals(stamps, 2)
    assert out.keys() == {"off", "G4", "G6"}
    assert out["off"] == pytest.approx([100.0])
    assert out["G4"] == pytest.approx([150.0]) and out["G6"] == pytest.approx([300.0])


def test_prefills_are_counted_as_they_finish(tmp_path):
    count_prefills = load_script("step_intervals").count_prefills

    class Engine:
        def prefill_on_device(self, prompts, slots):
            return [len(p) for p in prompts]

    engine = Engine()
    done = count_prefills(engine)
    assert done == [0]
    assert engine.prefill_on_device([[1, 2], [3]], [0, 1]) == [2, 1] and done == [1]


@pytest.mark.slow
def test_each_policy_reports_its_own_kinds_of_step_beside_their_prices(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["The capital of France is", "Water boils at", "One, two,"])
    out = tmp_path / "intervals.json"
    proc = run_benchmark("step_intervals.py", "--table", str(TABLE), "--prompts", str(prompts), "--limit", "3",
                         "--concurrency", "2", "--max_tokens", "8", "--rounds", "1", "--policies", "none,fixed-k1",
                         "--threads", "1", "--max_model_len", "128", "--overlap", "both", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(out.read_text())
    assert [(row["policy"], row["overlap"]) for row in saved["results"]] == [
        ("none", "on"), ("fixed-k1", "on"), ("none", "off"), ("fixed-k1", "off")]  # an engine of each, cell by cell
    assert saved["meta"]["concurrency"] == 2 and saved["meta"]["overlap"] == "both"
    for mode in ("on", "off"):
        rows = {row["policy"]: row for row in saved["results"] if row["overlap"] == mode}
        assert list(rows["none"]["steps"]) == ["off"]  # target-only never drafts
        assert rows["fixed-k1"]["steps"] and "off" not in rows["fixed-k1"]["steps"]
        for step in rows["fixed-k1"]["steps"].values():  # set against the same engine's target-only steps
            assert step["over_target_only"] == pytest.approx(
                step["median_ms"] / rows["none"]["steps"]["off"]["median_ms"], abs=1e-3)
        for row in rows.values():
            assert row["tokens_per_s"] > 0
            for step in row["steps"].values():
                assert step["steps"] > 0 and step["median_ms"] > 0 and step["table_ms"] > 0
                assert step["over_table"] == pytest.approx(step["median_ms"] / step["table_ms"], abs=1e-3)


def test_an_unknown_policy_is_refused_by_name():
    proc = run_benchmark("step_intervals.py", "--table", str(TABLE), "--policies", "none,fixed-k9")
    assert proc.returncode != 0 and "fixed-k9" in proc.stderr


def test_drafted_steps_are_set_against_their_own_runs_draft_off_steps_and_the_rounds_target_only():
    paired_ratios = load_script("step_intervals").paired_ratios

    def step(median, price):
        return {"steps": 5, "median_ms": median, "table_ms": price}

    rows = [{"policy": "none", "round": 0, "steps": {"off": step(100.0, 90.0)}},
            {"policy": "fixed-k1", "round": 0, "steps": {"G32": step(160.0, 144.0)}},
            {"policy": "adaptive", "round": 0, "steps": {"off": step(110.0, 90.0), "G32": step(165.0, 144.0)}},
            {"policy": "adaptive", "round": 1, "steps": {"G48": step(200.0, 180.0)}}]  # no off steps, no target-only
    paired_ratios(rows)
    k1, adaptive, alone = rows[1]["steps"]["G32"], rows[2]["steps"]["G32"], rows[3]["steps"]["G48"]
    assert "over_own_off" not in k1 and k1["over_target_only"] == pytest.approx(1.6) and k1["table_over_off"] == 1.6
    assert adaptive["over_own_off"] == pytest.approx(1.5) and adaptive["over_target_only"] == pytest.approx(1.65)
    assert adaptive["table_over_off"] == pytest.approx(1.6)
    assert alone.keys() == {"steps", "median_ms", "table_ms"}  # nothing to pair it with
    assert "over_own_off" not in rows[2]["steps"]["off"]  # draft-off steps are the reference, not paired
