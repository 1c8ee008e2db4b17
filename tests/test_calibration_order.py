"""Probe order: a bucket's rows interleaved step by step, so machine drift cannot pass for a slope."""

from __future__ import annotations

import json
import time

import pytest

from dspark_core.calibration.plan import read_calibration_file, resolve_plan
from dspark_core.calibration.probe import Run, TimedStep, cut_windows, plan_runs, run_probes, shuffled_order
from dspark_core.config import parse_serve_args
from dspark_core.costs.base import pool_samples
from dspark_core.errors import ConfigError
from dspark_core.geometry import Geometry
from dspark_core.plugins import default_hooks
from dspark_core.startup import build_engine, resolve_launch
from checkpoint_support import write_tiny_pair

GEOMETRY = Geometry.all_tiers(7, (1, 2, 4))


def plan_for(tmp_path, **data):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"request_buckets": [1, 2], "target_graph_rows": {"1": [1, 4, 8], "2": [2, 8, 16]},
                                "contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 4000}], **data}))
    hooks = default_hooks()
    return resolve_plan(7, GEOMETRY, 8192, read_calibration_file(str(path)),
                        lambda name: getattr(hooks.cost_model(name), "check_grid", None))


def test_interleaved_is_the_default_and_groups_a_bucket_s_rows(tmp_path):
    plan = plan_for(tmp_path)
    assert plan.settings.probe_order == "interleaved"
    runs = [(run.request_bucket, run.rows, run.draft_off, count) for run, count in plan_runs(plan)]
    # draft-off runs bracket the bucket's drafting rows, which share as many runs as they have rows
    assert runs == [(1, (1,), True, 1), (1, (1, 4, 8), False, 3), (1, (1,), True, 1),
                    (2, (2,), True, 1), (2, (2, 8, 16), False, 3), (2, (2,), True, 1)]
    sequential = plan_for(tmp_path, probe_order="sequential")
    assert [(r.rows, n) for r, n in plan_runs(sequential)][:4] == [((1,), 1), ((1,), 1), ((4,), 1), ((8,), 1)]


def test_a_bad_probe_order_is_named(tmp_path):
    with pytest.raises(ConfigError, match="probe_order must be one of interleaved, sequential, got 'random'"):
        plan_for(tmp_path, probe_order="random")


def test_every_round_of_the_order_is_a_permutation_and_the_seed_fixes_it():
    rows = (1, 2, 3, 4, 5)
    order = shuffled_order(rows, 3)
    sequence = [order(k) for k in range(50)]
    for start in range(0, 50, 5):
        assert sorted(sequence[start : start + 5]) == list(rows)
    assert sequence != [order(k) for k in range(5)] * 10  # the rounds differ
    again = shuffled_order(rows, 3)
    assert [again(k) for k in range(50)] == sequence


def test_windows_are_cut_per_point_in_time_order_and_a_short_point_is_refused():
    steps = [TimedStep(0, 1, rows, 0, False, seconds) for rows, seconds in
             [(1, 1.0), (2, 5.0), (1, 2.0), (2, 6.0), (1, 3.0), (2, 7.0), (1, 4.0), (2, 8.0), (1, 9.0)]]
    samples = cut_windows(steps, window_steps=2, windows_per_point=2)
    got = sorted((s.target_rows, s.seconds, s.steps) for s in samples)
    assert got == [(1, 3.0, 2), (1, 7.0, 2), (2, 11.0, 2), (2, 15.0, 2)]  # row 1's fifth interval is left over
    with pytest.raises(ConfigError, match="bucket 1 at 1 rows got 3 timed steps, fewer than 4"):
        cut_windows(steps[:-3], window_steps=2, windows_per_point=2)
    # the two draft-off runs of a bucket give a window set each
    off = [TimedStep(run, 1, 1, 0, True, 1.0) for run in (0, 2) for _ in range(4)]
    assert len(cut_windows(off, 2, 2)) == 4


def test_run_describes_itself_for_the_progress_bar():
    assert Run(1, (1, 2, 8), 0, 8).describe() == "1-8 interleaved"
    assert Run(1, (4,), 0, 8).describe() == "4"
    assert Run(1, (1,), 0, 8, draft_off=True).describe() == "draft-off"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("ckpt"))


def probe_with_drift(tmp_path, checkpoints, order: str) -> dict[int, float]:
    """Per-row seconds measured while every processed step makes the machine 1 ms slower."""
    target, draft = checkpoints
    cal = tmp_path / f"cal-{order}.json"
    cal.write_text(json.dumps({"request_buckets": [1], "contexts": [{"prefill_tokens": 8, "min_kv_length": 1,
                                                                      "max_kv_length": 120}],
                               "warmup_steps": 1, "window_steps": 4, "windows_per_point": 2, "draft_off": False,
                               "probe_order": order}))
    launch = resolve_launch(parse_serve_args([f"--model={target}", f"--draft_model={draft}", "--num_speculative_tokens=5",
                                              "--max_seqs_per_batch=1", "--max_model_len=128",
                                              f"--adaptive_dspark_calibration={cal}"]))
    engine = build_engine(launch)
    engine.warmup()
    processed = 0

    def drift(report) -> None:  # runs before the probe's own stamp, so it lands in the timed interval
        nonlocal processed
        processed += 1
        time.sleep(0.001 * processed)

    engine.add_observer(drift)
    samples = run_probes(engine, launch.plan, progress=False)
    engine.close()
    assert all(s.steps == 4 for s in samples) and len(samples) == 6 * 2  # rows 1..6, two windows each
    return {m.target_rows: m.step_seconds for m in pool_samples(samples)}


def test_interleaving_keeps_drift_out_of_the_row_costs(tmp_path, checkpoints):
    sequential = probe_with_drift(tmp_path, checkpoints, "sequential")
    interleaved = probe_with_drift(tmp_path, checkpoints, "interleaved")
    assert sorted(sequential) == sorted(interleaved) == [1, 2, 3, 4, 5, 6]

    def spread(costs: dict[int, float]) -> float:
        return max(costs.values()) - min(costs.values())

    # one after the other, the last row count probed looks ~45 ms dearer than the first (it is not)
    assert sequential[6] - sequential[1] > 0.03
    # taking turns, every row count sees the same drift
    assert spread(interleaved) < 0.012 and spread(interleaved) < spread(sequential) / 3


def test_the_slope_script_reads_a_table_s_measurements_and_prices(tmp_path):
    from script_support import load_script

    slopes = load_script("table_slopes").slopes
    rows = [1, 2, 3, 4, 5, 6, 7, 8]
    measurements = [{"request_bucket": 1, "target_rows": g, "step_seconds": 0.080 + 0.002 * g, "windows": 2,
                     "draft_off": False} for g in rows]
    measurements.append({"request_bucket": 1, "target_rows": 1, "step_seconds": 0.5, "windows": 2, "draft_off": True})
    table = {"fits": [{"params": {"bias_seconds": 0.08, "request_buckets": [1], "alpha_seconds": [0.0],
                                  "target_rows": rows, "theta_seconds": [0.0, 0.0, 0.001, 0.004, 0.005, 0.006, 0.010, 0.012]},
                       "measurements": measurements}]}
    (tmp_path / "cost-table.json").write_text(json.dumps(table))
    got = slopes(tmp_path)["1"]  # the draft-off point (0.5 s) is left out
    assert got["ms_per_row"] == pytest.approx(2.0)
    assert (got["priced_first_ms"], got["priced_last_ms"]) == (pytest.approx(80.0), pytest.approx(92.0))


def test_rows_that_came_short_get_a_top_up_run_of_their_own(tmp_path):
    from dspark_core.calibration.probe import probe_runs

    plan = plan_for(tmp_path, window_steps=2, windows_per_point=2)
    run = Run(1, (1, 4, 8), 0, 8)
    calls = []

    def timed_run(run: Run, policy, index: int) -> list[TimedStep]:
        calls.append(run.rows)
        # what the policy asks for, except that the first run's first step is lost (as when an
        # admission step of the same bucket takes a turn of the order): one row gets one step less
        rows = [policy.order(policy.cursor + k) for k in range(4)]
        policy.cursor += 4
        if len(calls) == 1:
            rows = rows[1:]
        return [TimedStep(index, 1, g, 0, False, 0.1) for g in rows]

    steps = probe_runs(plan, run, 3, 5, timed_run)
    assert calls[:3] == [(1, 4, 8)] * 3 and len(calls) == 4 and len(calls[3]) == 1  # one top-up, for the short row
    counts = {g: sum(1 for s in steps if s.target_rows == g) for g in (1, 4, 8)}
    assert min(counts.values()) >= 4 and all(s.group == 5 for s in steps)
    assert len(cut_windows(steps, 2, 2)) == 3 * 2
