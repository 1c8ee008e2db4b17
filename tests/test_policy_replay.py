"""benchmarks/policy_replay.py: policies replayed on recorded draft traces under a cost table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from script_support import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "policy_replay.py"
TABLE = ROOT / "benchmarks" / "results" / "heldout-v5" / "k7" / "cost-table.json"  # K=7, kept measurements
WIDTH = 7


@pytest.fixture(scope="module")
def replay_module():
    return load_script("policy_replay")


def write_traces(path: Path, drafts: dict[str, np.ndarray], answers: int = 6, positions: int = 400) -> Path:
    """Every position of every answer has the same hit pattern; confidence logits say the same."""
    arrays = {}
    for index, pattern in enumerate(drafts.values()):
        hits = np.tile(pattern, (answers * positions, 1))
        arrays[f"d{index}_lengths"] = np.full(answers, positions)
        arrays[f"d{index}_hits"] = hits
        arrays[f"d{index}_logits"] = np.where(hits, 4.0, -4.0).astype(np.float32)
        arrays[f"d{index}_temperatures"] = np.ones(WIDTH)
    np.savez_compressed(path, names=np.array(list(drafts)), **arrays)
    return path


def run_replay(traces: Path, *extra: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "replay", "--traces", str(traces), "--table", str(TABLE),
                           "--json", *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def rate(rows: list[dict], draft: str, concurrency: int, policy: str) -> dict:
    return next(r for r in rows if r["draft"] == draft and r["concurrency"] == concurrency and r["policy"] == policy)


def test_fixed_widths_match_the_table_arithmetic(tmp_path, replay_module):
    traces = write_traces(tmp_path / "t.npz", {"perfect": np.ones(WIDTH, bool), "useless": np.zeros(WIDTH, bool)})
    rows = run_replay(traces, "--concurrency", "1", "--policies", "fixed-k1,fixed-k7,adaptive")
    costs = replay_module.table_costs(replay_module.load_table(TABLE), WIDTH)
    off, drafted = costs.draft_off_for_step(1, 300), costs.for_step(1, 300)
    # the useless draft commits one token per step whatever is verified: k1 runs at off / cost(2 rows)
    assert rate(rows, "useless", 1, "fixed-k1")["vs_target_only"] == pytest.approx(off / drafted[1], rel=1e-9)
    # a perfect draft at full width commits 8 per step (the last step of an answer may overshoot it)
    perfect = rate(rows, "perfect", 1, "fixed-k7")["vs_target_only"]
    assert perfect == pytest.approx(8 * off / drafted[7], rel=0.01)
    # adaptive learns that the useless draft never pays and keeps it off almost always
    useless = rate(rows, "useless", 1, "adaptive")
    assert useless["draft_off_share"] > 0.8 and useless["vs_target_only"] > 0.97
    assert rate(rows, "perfect", 1, "adaptive")["vs_target_only"] >= 0.99 * max(
        rate(rows, "perfect", 1, p)["vs_target_only"] for p in ("fixed-k1", "fixed-k7"))


def test_a_refitted_belief_moves_adaptive_only(tmp_path):
    # half the drafted tokens survive the first position: a draft that pays a little
    traces = write_traces(tmp_path / "t.npz", {"half": np.array([1, 1, 0, 0, 0, 0, 0], bool)}, answers=4, positions=200)
    exact = run_replay(traces, "--concurrency", "4", "--policies", "fixed-k2,adaptive")
    noisy = run_replay(traces, "--concurrency", "4", "--policies", "fixed-k2,adaptive", "--belief", "refit:0.3:5")
    # fixed widths do not read prices, and steps are charged true costs under either belief
    assert rate(noisy, "half", 4, "fixed-k2")["vs_target_only"] == pytest.approx(
        rate(exact, "half", 4, "fixed-k2")["vs_target_only"], rel=1e-12)



def test_refitting_without_noise_gives_the_table_back(replay_module):
    truth = replay_module.table_costs(replay_module.load_table(TABLE), WIDTH)
    same = replay_module.table_costs(replay_module.refitted_table(str(TABLE), 0.0, 1), WIDTH)
    noisy = replay_module.table_costs(replay_module.refitted_table(str(TABLE), 0.2, 1), WIDTH)
    for bucket in (1, 4, 16):
        exact = truth.for_step(bucket, 300)
        covered = np.isfinite(exact)
        assert np.allclose(same.for_step(bucket, 300)[covered], exact[covered], rtol=1e-6)
        assert same.draft_off_for_step(bucket, 300) == pytest.approx(truth.draft_off_for_step(bucket, 300), rel=1e-9)
        assert not np.allclose(noisy.for_step(bucket, 300)[covered], exact[covered], rtol=0.01)


def test_bad_belief_is_refused_by_name(tmp_path):
    traces = write_traces(tmp_path / "t.npz", {"perfect": np.ones(WIDTH, bool)}, answers=1, positions=20)
    proc = subprocess.run([sys.executable, str(SCRIPT), "replay", "--traces", str(traces), "--table", str(TABLE),
                           "--belief", "refit:0.1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "refit:SIGMA:SEED" in proc.stderr and "'refit:0.1'" in proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPT), "replay", "--traces", str(traces), "--table", str(TABLE),
                           "--belief", str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "missing.json" in proc.stderr


def test_a_table_that_underprices_drafting_misleads_the_priced_rule_not_the_timed_one(tmp_path):
    # a draft whose first two tokens always survive pays at the table's prices; charged three times the
    # table's price for every drafted step, it loses to target-only whatever it verifies
    traces = write_traces(tmp_path / "t.npz", {"good": np.array([1, 1, 0, 0, 0, 0, 0], bool)}, answers=4, positions=200)
    timed = '{"timed": ["adaptive", {"draft_off_rule": "timed"}]}'
    exact = run_replay(traces, "--concurrency", "4", "--policies", "fixed-k2,adaptive", "--extra", timed)
    dear = run_replay(traces, "--concurrency", "4", "--policies", "fixed-k2,adaptive", "--extra", timed,
                      "--drafted_scale", "3", "--time_noise", "0.1", "--seed", "2")
    # a fixed width drafts every step, so its rate falls by exactly the scale
    assert rate(dear, "good", 4, "fixed-k2")["vs_target_only"] == pytest.approx(
        rate(exact, "good", 4, "fixed-k2")["vs_target_only"] / 3, rel=1e-9)
    # the realized rule believes the table and keeps drafting; the timed rule measures the loss
    assert rate(dear, "good", 4, "adaptive")["draft_off_share"] < 0.1
    assert rate(dear, "good", 4, "timed")["draft_off_share"] > 0.7
    assert rate(dear, "good", 4, "timed")["vs_target_only"] > rate(dear, "good", 4, "adaptive")["vs_target_only"] + 0.15
    # where the table is right, the timed rule costs little (its references)
    assert rate(exact, "good", 4, "timed")["vs_target_only"] >= 0.97 * rate(exact, "good", 4, "adaptive")["vs_target_only"]
