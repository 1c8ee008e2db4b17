"""benchmarks/lockstep.py: policies stepped in turn on one workload, on the real default model."""

from __future__ import annotations

import functools
import json
import re

import pytest
from script_support import ROOT, run_benchmark, write_prompts

TABLE = ROOT / "benchmarks" / "results" / "draft-long" / "k7" / "cost-table.json"  # the shipped draft's K=7 run
run_script = functools.partial(run_benchmark, "lockstep.py")


@pytest.mark.slow
def test_every_policy_serves_the_same_workload_and_matches_target_only(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["The capital of France is", "Water boils at", "One, two, three,"])
    out = tmp_path / "lockstep.json"
    proc = run_script("--prompts", str(prompts), "--concurrency", "2", "--max_tokens", "6", "--widths", "1,3",
                      "--table", str(TABLE), "--variants", '{"adaptive-m0": ["adaptive", {"draft_off_margin": 0}]}',
                      "--other_tables", json.dumps({"adaptive-t2": str(TABLE)}), "--threads", "1", "--output", str(out),
                      "--max_model_len", "96")  # six engines each zero-fill a KV cache per slot: keep them short
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(out.read_text())
    rows = {row["policy"]: row for row in saved["results"]}
    assert list(rows) == ["none", "fixed-k1", "fixed-k3", "adaptive", "adaptive-m0", "adaptive-t2"]
    assert saved["meta"]["count"] == 3 and saved["meta"]["concurrency"] == 2 and saved["meta"]["max_model_len"] == 96
    assert saved["meta"]["other_tables"] == {"adaptive-t2": str(TABLE)}
    for row in rows.values():
        assert row["identical"], row  # greedy speculative output equals target-only, prompt by prompt
        assert row["tokens"] == rows["none"]["tokens"] > 0
        assert row["seconds"] > 0
    assert rows["none"]["vs_target_only"] == 1.0
    assert rows["none"]["rows_per_request"] == pytest.approx(1.0, abs=0.05)
    assert rows["fixed-k3"]["rows_per_request"] > rows["fixed-k1"]["rows_per_request"] > 1.5
    # the per-kind step times: target-only never drafts, a fixed width always does; every decode is counted
    assert all(kind.startswith("draft-off") or kind.startswith("no-decode") for kind in rows["none"]["step_ms"])
    assert not any(kind.startswith("draft-off") for kind in rows["fixed-k1"]["step_ms"])
    assert any(kind.endswith("+prefill") for kind in rows["none"]["step_ms"])
    for row in rows.values():
        decoded = sum(v["steps"] for kind, v in row["step_ms"].items() if not kind.startswith(("no-decode", "several")))
        assert decoded == row["decode_steps"], row
        assert all(v["median"] > 0 for v in row["step_ms"].values())


@pytest.mark.slow
def test_a_second_dtype_steps_in_the_same_turns_and_matches_its_own_target_only(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["The capital of France is", "Water boils at"])
    out = tmp_path / "lockstep.json"
    proc = run_script("--prompts", str(prompts), "--concurrency", "2", "--max_tokens", "5", "--widths", "1",
                      "--also_dtype", "bfloat16", "--threads", "1", "--output", str(out), "--max_model_len", "96",
                      "--by_shape")
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(out.read_text())
    rows = {row["policy"]: row for row in saved["results"]}
    assert list(rows) == ["none", "fixed-k1", "none@bfloat16", "fixed-k1@bfloat16"]
    assert saved["meta"]["also_dtype"] == "bfloat16"
    for row in rows.values():
        assert row["identical"], row  # against target-only decoding in the row's own dtype
    assert rows["none@bfloat16"]["vs_own_target_only"] == 1.0
    # --by_shape: drafted kinds name their rows and split; k1 at two requests verifies 2 + 2 rows, evenly
    drafted = [kind for kind in rows["fixed-k1"]["step_ms"] if kind.startswith("drafted")]
    assert drafted and all(re.fullmatch(r"drafted-(full|partial)-\d+r-(even|uneven)(\+prefill)?", k) for k in drafted), drafted
    assert "drafted-full-4r-even" in drafted
    assert saved["meta"]["by_shape"] is True
    assert rows["none@bfloat16"]["vs_target_only"] == pytest.approx(
        rows["none@bfloat16"]["tokens_per_s"] / rows["none"]["tokens_per_s"], rel=0.01)


@pytest.mark.parametrize("args, message", [
    (["--also_dtype", "float32"], "--also_dtype must differ from --dtype (float32)"),
    (["--also_table", "t.json"], "--also_table goes with --also_dtype and --table"),
    (["--concurrency", "0"], "--concurrency must be at least 1, got 0"),
    (["--max_model_len", "0"], "--max_model_len must be at least 1, got 0"),
    (["--variants", "{not json"], "--variants is not JSON"),
    (["--variants", '{"a": ["adaptive", {}]}'], "--variants need --table"),
    (["--other_tables", "{not json"], "--other_tables is not JSON"),
    (["--other_tables", '{"a": "table.json"}'], "--other_tables needs --table"),
])
def test_bad_arguments_are_refused_before_any_model_loads(args, message):
    proc = run_script(*args)
    assert proc.returncode != 0
    assert message in proc.stderr
