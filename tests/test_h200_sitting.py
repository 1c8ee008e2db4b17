"""The device sitting's scripts (benchmarks/h200/), run here on the CPU with tiny models: they must
fail on nothing but the GPU when a device is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from checkpoint_support import write_tiny_pair

ROOT = Path(__file__).resolve().parents[1]


def test_step_profile_times_every_pair_and_writes_the_profile(tmp_path):
    target, draft = write_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the", "he the", "t"]))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"request_buckets": [1, 2, 4], "contexts": [
        {"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 120}],
        "warmup_steps": 1, "window_steps": 2, "windows_per_point": 1}))
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h200" / "step_profile.py"), "--device", "cpu",
                           f"--model={target}", f"--draft_model={draft}", "--num_speculative_tokens=5",
                           f"--calibration={cal}", "--max_seqs_per_batch=4", f"--prompts_file={prompts}",
                           "--pairs", "fixed-k5:2,none:1,adaptive:4", "--warmup", "2", "--steps", "5",
                           "--attention", "matmul", "--captured_kv_spans", "64", "--output", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    rows = [(r["policy"], r["concurrency"], r["steps"]) for r in saved["results"]]
    assert rows == [("fixed-k5", 2, 5), ("none", 1, 5), ("adaptive", 4, 5)]
    assert all(r["step_ms_median"] > 0 for r in saved["results"]) and saved["meta"]["device"] == "cpu"
    assert saved["meta"]["attention"] == "matmul" and saved["meta"]["captured_kv_spans"] == "64"
    assert saved["meta"]["kv_spans"] == [64] and saved["meta"]["keys"] > 0
    assert saved["meta"]["engine_build_seconds"] > 0 and "cuda_memory_reserved_gib" not in saved["meta"]
    # profiled without overlap, so the step's own operators (the target's linear layers) are in the table:
    # the packed products of batch-invariant forwards, or aten::linear (which a short run can rank below
    # the table's 60 rows when only the draft calls it)
    table = out.with_suffix(".txt").read_text()
    assert "mkldnn::_linear_pointwise" in table or "aten::linear" in table


def test_attention_micro_times_both_kernels_and_they_agree(tmp_path):
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h200" / "attention_micro.py"), "--device", "cpu",
                           "--requests", "1,2", "--rows", "1,3", "--keys", "40", "--dtypes", "float32",
                           "--iterations", "2", "--output", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["requests"], r["rows"]) for r in results] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["us_sdpa"] > 0 and r["us_matmul"] > 0 and r["max_abs_diff"] < 1e-5 for r in results)


def test_step_profile_refuses_pairs_above_the_largest_bucket(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h200" / "step_profile.py"),
                           "--prompts_file", "x.jsonl", "--pairs", "none:32", "--output", str(tmp_path / "o.json")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "above --max_seqs_per_batch=16" in proc.stderr


def test_the_sitting_script_is_valid_bash_and_names_its_parts():
    script = ROOT / "benchmarks" / "h200" / "sitting.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    for part in ("env", "attention-micro", "exactness-float32", "bench-k7", "step-profile", "step-profile-nospans", "step-profile-sdpa",
                 "exactness-bfloat16", "host-overhead"):
        assert f"part {part} " in text and part in text.split("PARTS=${PARTS:-")[1].split("}")[0]


def test_the_device_calibration_file_is_valid_up_to_64_requests():
    from dspark_core.calibration.plan import read_calibration_file, resolve_plan
    from dspark_core.geometry import Geometry
    from dspark_core.plugins import default_hooks

    geometry = Geometry.bucket_multiples(7, (1, 2, 4, 8, 16, 32, 64))
    plan = resolve_plan(7, geometry, 2048, read_calibration_file(str(ROOT / "benchmarks" / "h200" / "calibration-k7.json")),
                        lambda name: getattr(default_hooks().cost_model(name), "check_grid", None))
    assert plan.settings.request_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert {p.request_bucket for p in plan.points if p.draft_off} == set(plan.settings.request_buckets)


def test_host_overhead_times_the_step_outside_the_keys_and_counts_its_launches(tmp_path):
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--policies", "none,adaptive",
                           "--concurrency", "1,2", "--steps", "6", "--warmup", "2", "--output", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["policy"], r["concurrency"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("none", 1), ("none", 2), ("adaptive", 1), ("adaptive", 2)}
    for row in rows.values():
        assert row["steps"] == 6 and 0 < row["outside_ms_median"] < row["step_ms_median"]
    # the draft adds its proposal's staging, the split and the proposal record outside the keys
    assert rows[("none", 1)]["ops_outside_per_step"] < rows[("adaptive", 1)]["ops_outside_per_step"]
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--concurrency", "32",
                          "--output", str(out)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--concurrency: every value must lie in 1..16" in bad.stderr


def test_key_kernels_counts_each_replayed_key_as_cuda_would_launch_it(tmp_path):
    """SmolLM2 target-only at one request: one verify key whose count leaves out views, counts each
    of the 61 RMSNorms (two per layer and the final one) as one fused kernel, and holds SmolLM2's
    121 matrix products (four per layer and the LM head; the attention output and MLP down products
    add into the residual in place, one ``addmm_`` each, as CUDA runs them)."""
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h200" / "key_kernels.py"), "--runs", "none:1",
                           "--steps", "1", "--output", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    (name, key), = result["keys"].items()
    assert name.startswith("verify K=7 bucket=1 rows=1") and key["replays"] >= 1
    top = key["top"]
    assert top["_fused_rms_norm"] == 61 and "pow" not in top and "rsqrt" not in top
    assert not {"view", "slice", "expand", "transpose"} & set(top)
    products = sum(top.get(op, 0) for op in ("_linear_pointwise", "mm", "addmm"))  # oneDNN's packed path or not
    assert products + top.get("addmm_", 0) == 121 and top.get("addmm_", 0) == 60 and 500 < key["kernels"] < 1500
