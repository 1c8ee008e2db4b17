"""Startup calibration: effective configuration, every rule, probing, audit, save and reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog
import torch

from dspark_core.audit import STARTUP_AUDIT_EVENT
from dspark_core.calibration.install import bring_up
from dspark_core.calibration.plan import read_calibration_file, resolve_plan
from dspark_core.config import parse_serve_args
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError, StartupAborted, TableError
from dspark_core.geometry import Geometry
from dspark_core.models import attention, greedy_head, layers
from dspark_core.plugins import default_hooks
from dspark_core.startup import build_engine, resolve_launch
from dspark_core.table import load_table
from checkpoint_support import write_tiny_pair

GEOMETRY = Geometry.all_tiers(7, (1, 2, 4, 8, 16))


def grid_check(name):
    return getattr(default_hooks().cost_model(name), "check_grid", None)


def plan_from(tmp_path, data, *, width=7, geometry=GEOMETRY, kv_limit=8192):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    return resolve_plan(width, geometry, kv_limit, read_calibration_file(str(path)), grid_check)


# -- effective configuration ---------------------------------------------------------

def test_built_in_defaults():
    plan = resolve_plan(7, GEOMETRY, 8192, None, grid_check)
    s = plan.settings
    assert plan.source == "defaults"
    assert (s.model, s.draft_width, s.request_buckets) == ("additive", 7, (1, 2, 4, 8, 16))
    assert [(c.prefill_tokens, c.min_kv_length, c.max_kv_length) for c in s.contexts] == [(2048, 1, 4096)]
    assert (s.warmup_steps, s.window_steps, s.windows_per_point, s.token_seed) == (8, 32, 3, 1)
    # every legal captured tier of every bucket, full width included ...
    drafting = [p for p in plan.points if not p.draft_off]
    assert len(drafting) == sum(b * 7 + 1 for b in (1, 2, 4, 8, 16))
    assert {(p.request_bucket, p.target_rows) for p in drafting} >= {(16, 128), (1, 8), (1, 1)}
    # ... plus one draft-off point per bucket, at one row per request, probed just before and
    # just after the bucket's drafting points (bracketing them in time)
    assert s.draft_off is True
    assert [(p.request_bucket, p.target_rows) for p in plan.points if p.draft_off] == \
        [(b, b) for b in (1, 2, 4, 8, 16) for _ in range(2)]
    for b in (1, 2, 4, 8, 16):
        of_bucket = [p for p in plan.points if p.request_bucket == b]
        assert of_bucket[0].draft_off and of_bucket[-1].draft_off
        assert not any(p.draft_off for p in of_bucket[1:-1])


def test_draft_off_probing_can_be_turned_off_in_the_file(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text('{"draft_off": false}')
    plan = resolve_plan(7, GEOMETRY, 8192, read_calibration_file(str(path)), grid_check)
    assert plan.settings.draft_off is False and not any(p.draft_off for p in plan.points)
    path.write_text('{"draft_off": "no"}')
    with pytest.raises(ConfigError, match=r"draft_off"):
        read_calibration_file(str(path))


def test_default_kv_bound_is_capped_by_the_context_limit():
    s = resolve_plan(7, GEOMETRY, 3000, None, grid_check).settings
    assert s.contexts[0].max_kv_length == 3000 and s.contexts[0].prefill_tokens == 2048


def test_short_context_shrinks_the_prefill_to_reserve_progress():
    s = resolve_plan(7, GEOMETRY, 1200, None, grid_check).settings
    ctx = s.contexts[0]
    progress = (8 + 32 * 3 + 2) * 8 + 1  # worst case: every step commits K+1, plus two steps in flight
    assert ctx.max_kv_length == 1200 and ctx.prefill_tokens == 1200 - progress


def test_default_that_cannot_fit_asks_for_a_smaller_configuration():
    with pytest.raises(ConfigError, match=r"advances up to 849 KV positions.*context limit is 600.*"
                                          r"--adaptive_dspark_calibration"):
        resolve_plan(7, GEOMETRY, 600, None, grid_check)


def test_file_overrides_and_keeps_omitted_defaults(tmp_path):
    plan = plan_from(tmp_path, {"model": "additive", "request_buckets": [1, 2, 4, 8, 16],
                                "contexts": [{"prefill_tokens": 1868, "min_kv_length": 1800, "max_kv_length": 4096}],
                                "window_steps": 16})
    s = plan.settings
    assert plan.source == "file" and s.window_steps == 16 and s.token_seed == 1 and s.warmup_steps == 8
    assert s.draft_width == 7  # inferred from the launch


# -- rules ---------------------------------------------------------------------------

@pytest.mark.parametrize("data,match", [
    ({"draft_width": 5}, "calibration draft_width 5 does not match num_speculative_tokens=7"),
    ({"request_buckets": [1, 3]}, r"request_buckets \[3\] are not captured request buckets"),
    ({"request_buckets": [1], "target_graph_rows": {"1": [1, 8, 9]}}, r"8\), 8 rows|outside its legal range|not captured tiers"),
    ({"request_buckets": [1, 2], "target_graph_rows": {"1": [1, 4], "2": [2, 4, 16]}}, "lacks full-width coverage; add bucket 1 at 8 rows"),
    ({"request_buckets": [1, 2], "target_graph_rows": {"1": [1, 8], "2": [2, 16]}}, "not connected through shared target-row values"),
    # a bucket left out of a per-bucket mapping would go unprobed (and fall back to full width)
    ({"request_buckets": [1, 2], "target_graph_rows": {"1": [1, 8]}},
     r"no rows for request buckets 2 \(full width 16\)"),
    # a shared row list's value that no bucket runs would be dropped for every bucket
    ({"request_buckets": [1, 2], "target_graph_rows": [1, 2, 8, 16, 500]},
     r"target_graph_rows \[500\] fit no request bucket's tiers at K=7 \(bucket b runs b..\(K\+1\)\*b rows: 1..8, 2..16\)"),
    ({"token_seed": -1}, "token_seed must be >= 0, got -1"),  # (before any warmup, not at numpy's seeding)
    ({"contexts": [{"prefill_tokens": 100, "min_kv_length": 1, "max_kv_length": 2000},
                   {"prefill_tokens": 1900, "min_kv_length": 1500, "max_kv_length": 4000}]}, "context intervals overlap"),
    ({"contexts": [{"prefill_tokens": 100, "min_kv_length": 1, "max_kv_length": 9000}]}, "exceeds the context limit 8192"),
    ({"contexts": [{"prefill_tokens": 1000, "min_kv_length": 1, "max_kv_length": 1500}]}, r"worst-case sampling progress 849 exceeds max_kv_length 1500"),
    ({"contexts": [{"prefill_tokens": 10, "min_kv_length": 500, "max_kv_length": 4000}]}, "must reach min_kv_length"),
    ({"model": "flat"}, r"no cost model named 'flat'"),
])
def test_each_rule_is_enforced_with_its_message(tmp_path, data, match):
    with pytest.raises(Exception, match=match):
        plan_from(tmp_path, data)


def test_sps_accepts_a_grid_the_additive_model_refuses(tmp_path):
    plan = plan_from(tmp_path, {"model": "sps", "request_buckets": [1, 2],
                                "target_graph_rows": {"1": [1, 8], "2": [2, 16]}})
    assert len(plan.points) == 4 + 2 * 2  # plus a draft-off point per bucket, probed twice


@pytest.mark.parametrize("data,path", [
    ({"windows": 3}, "unknown key(s) (windows) @ $"),
    ({"warmup_steps": "8"}, "$.warmup_steps"),
    ({"contexts": [{"prefill_tokens": 1, "min_kv_length": 1, "max_kv_length": 9, "extra": 0}]}, "$.contexts[0]"),
])
def test_file_errors_name_the_json_path(tmp_path, data, path):
    with pytest.raises(ConfigError) as info:
        plan_from(tmp_path, data)
    assert path in str(info.value) and "--adaptive_dspark_calibration" in str(info.value)


# -- end to end on a tiny checkpoint -------------------------------------------------

CAL = {"request_buckets": [1, 2], "contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 100}],
       "warmup_steps": 1, "window_steps": 2, "windows_per_point": 2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("ckpt"))


def serve_flags(target: Path, draft: Path, *extra: str) -> list[str]:
    return [f"--model={target}", f"--draft_model={draft}", "--num_speculative_tokens=5", "--max_seqs_per_batch=2",
            "--max_model_len=128", *extra]


def calibrated_launch(tmp_path: Path, target: Path, draft: Path, *extra: str):
    """The launch of a tiny pair calibrated with ``CAL`` (written under ``tmp_path``)."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    return resolve_launch(parse_serve_args([*serve_flags(target, draft, f"--adaptive_dspark_calibration={cal}"), *extra]))


def start(argv, *, capture=True):
    config = parse_serve_args(argv)
    launch = resolve_launch(config)
    engine = build_engine(launch)
    with structlog.testing.capture_logs() as logs:
        table = bring_up(engine, launch, progress=False)
    audits = [e for e in logs if e["event"] == STARTUP_AUDIT_EVENT]
    return engine, table, audits


def test_calibrate_save_and_reuse(tmp_path, checkpoints):
    target, draft = checkpoints
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    out = tmp_path / "out" / "costs.json"
    out.parent.mkdir()
    engine, table, audits = start(serve_flags(target, draft, f"--adaptive_dspark_calibration={cal}",
                                              f"--adaptive_dspark_cost_table_output={out}"))
    work = engine.work_counters()
    # 6 + 11 tiers, plus a draft-off point per bucket probed twice (on the already captured Bcap
    # tier); warmup prepares 17 verify keys, the own tier's context-writing key and one proposal key
    # per bucket
    assert work["fits"] == 1 and work["profiling_runs"] == 17 + 2 * 2 and work["warmups"] == 17 + 2 + 2
    assert engine.ready and engine.table is table and out.is_file()
    assert load_table(out) == table
    (audit,) = audits
    assert audit["source"] == "file"
    assert audit["settings"]["token_seed"] == 1 and audit["settings"]["window_steps"] == 2  # omitted default + file value
    assert audit["settings"]["draft_width"] == 5
    assert audit["geometry"]["request_buckets"] == [1, 2]
    assert audit["max_model_len"] == 128
    assert audit["kv_spans"] == []  # the static CPU backend runs eagerly: no spans by default
    assert audit["copy_orders"] == []  # the tiny draft's config asks for no copies
    assert audit["batch_invariant"] is True  # float32 on the CPU: verify rows match target-only rows bit for bit
    assert audit["greedy_head"] is greedy_head.enabled()  # the bfloat16 head where this CPU's self-check passed
    assert audit["attention_key_tails"] == list(attention.invariant_key_tails())  # what this CPU's check allows
    assert audit["cpu_threads"] == torch.get_num_threads()  # auto keeps the process's count (1 in the tests)
    engine.close()

    # reuse: warmup again, but no probing and no fit; with copy proposals turned on, each bucket
    # also prepares its propose+copy key and its copy key (copy steps)
    engine2, table2, audits2 = start(serve_flags(target, draft, f"--adaptive_dspark_cost_table={out}",
                                                 "--copy_proposals=on"))
    work2 = engine2.work_counters()
    assert work2["profiling_runs"] == 0 and work2["fits"] == 0 and work2["warmups"] == 17 + 2 + 2 + 2 + 2
    assert audits2[0]["copy_orders"] == [6, 5, 4, 3, 2]
    assert table2 == table and engine2.table == table
    assert audits2[0]["source"] == "saved table" and audits2[0]["saved_settings"]["window_steps"] == 2
    assert audits2[0]["coverage"]
    assert audits2[0]["coverage"][0]["coverage"]["draft_off_buckets"] == [1, 2]
    engine2.close()

    # an incompatible launch (different captured geometry and width) is refused field by field
    with pytest.raises(TableError) as info:
        start(serve_flags(target, draft, f"--adaptive_dspark_cost_table={out}", "--max_seqs_per_batch=1"))
    assert "execution.geometry" in str(info.value)
    with pytest.raises(TableError, match="draft_width"):
        start([*serve_flags(target, draft, f"--adaptive_dspark_cost_table={out}"), "--num_speculative_tokens=7"])


def test_batch_invariant_flag_reaches_the_target_the_audit_and_the_saved_table(tmp_path, checkpoints):
    target, draft = checkpoints
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    out = tmp_path / "costs.json"
    engine, _, audits = start(serve_flags(target, draft, f"--adaptive_dspark_calibration={cal}", "--batch_invariant=off",
                                          f"--adaptive_dspark_cost_table_output={out}"))
    assert engine.runner.target.batch_invariant is False and audits[0]["batch_invariant"] is False
    engine.close()
    assert json.loads(out.read_text())["fingerprint"]["execution"]["batch_invariant"] == "off"
    # the kernels change step costs: the table is reused only with the same setting, and `auto` says so by name
    with pytest.raises(TableError, match="execution.batch_invariant"):
        start(serve_flags(target, draft, f"--adaptive_dspark_cost_table={out}"))
    engine, table, _ = start(serve_flags(target, draft, f"--adaptive_dspark_cost_table={out}", "--batch_invariant=off"))
    assert engine.table is table
    engine.close()
    with pytest.raises(ConfigError, match="--batch_invariant"):
        parse_serve_args(serve_flags(target, draft, "--batch_invariant=maybe"))


def test_a_saved_table_is_reused_only_at_the_thread_count_it_was_priced_at(tmp_path, checkpoints):
    target, draft = checkpoints
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    out = tmp_path / "costs.json"
    threads = torch.get_num_threads()
    try:
        engine, _, audits = start(serve_flags(target, draft, f"--adaptive_dspark_calibration={cal}", "--cpu_threads=1",
                                              f"--adaptive_dspark_cost_table_output={out}"))
        engine.close()
        assert audits[0]["cpu_threads"] == 1
        assert json.loads(out.read_text())["fingerprint"]["execution"]["cpu_threads"] == 1
        # two threads price every step differently: refused by name, before anything is probed
        with pytest.raises(TableError, match="execution.cpu_threads"):
            start(serve_flags(target, draft, f"--adaptive_dspark_cost_table={out}", "--cpu_threads=2"))
        # a table saved before the count was recorded lacks the key and loads at any count
        legacy = json.loads(out.read_text())
        del legacy["fingerprint"]["execution"]["cpu_threads"]
        old_table = tmp_path / "legacy.json"
        old_table.write_text(json.dumps(legacy))
        engine, table, audits = start(serve_flags(target, draft, f"--adaptive_dspark_cost_table={old_table}",
                                                  "--cpu_threads=2"))
        assert engine.table is table and audits[0]["cpu_threads"] == 2 and torch.get_num_threads() == 2
        engine.close()
    finally:
        torch.set_num_threads(threads)


def test_probing_a_bucket_whose_prompts_are_admitted_over_several_steps(tmp_path, checkpoints):
    # a prefill budget below the bucket's prompts (on the H200: 64 x 256 tokens against 8 192) admits
    # them over two steps, and the step in between runs in a smaller bucket than the point probes
    target, draft = checkpoints
    launch = calibrated_launch(tmp_path, target, draft)
    engine = build_engine(launch)
    engine.scheduler.max_prefill_tokens = CAL["contexts"][0]["prefill_tokens"]  # one prompt per step
    buckets = []
    engine.add_observer(lambda report: buckets.append(report.live_requests))
    table = bring_up(engine, launch, progress=False)
    assert engine.ready and engine.table is table
    assert 1 in buckets and 2 in buckets  # the in-between steps did run, in bucket 1
    engine.close()


def test_a_max_model_len_beyond_the_model_context_is_capped_and_said(tmp_path, checkpoints):
    target, draft = checkpoints  # the tiny target's context is 512 positions
    launch = calibrated_launch(tmp_path, target, draft, "--max_model_len=100000")
    with structlog.testing.capture_logs() as logs:
        engine = build_engine(launch)
        bring_up(engine, launch, progress=False)
    assert engine.max_model_len == 512
    (warning,) = [e for e in logs if e["event"].startswith("max_model_len capped")]
    assert warning["log_level"] == "warning"
    assert (warning["requested"], warning["model_context"], warning["max_model_len"]) == (100000, 512, 512)
    (audit,) = [e for e in logs if e["event"] == STARTUP_AUDIT_EVENT]
    assert audit["max_model_len"] == 512
    engine.close()
    with structlog.testing.capture_logs() as logs:  # within the limit: nothing to say
        build_engine(calibrated_launch(tmp_path, target, draft)).close()
    assert not [e for e in logs if e["event"].startswith("max_model_len capped")]


def test_a_startup_abort_stops_calibration_at_its_next_step_and_leaves_the_engine_clean(tmp_path, checkpoints):
    target, draft = checkpoints
    launch = calibrated_launch(tmp_path, target, draft)
    engine = build_engine(launch)
    steps = []

    def abort_after_three(report) -> None:  # as a server's shutdown would, from its own thread
        steps.append(report)
        if len(steps) == 3:
            engine.startup_abort.set()

    engine.add_observer(abort_after_three)
    with pytest.raises(StartupAborted, match="the server is shutting down"):
        bring_up(engine, launch, progress=False)
    assert len(steps) <= 4  # the step in flight when the flag was seen may still be processed
    assert not engine.ready and engine.table is None and engine.work.fits == 0
    assert not engine.queue.in_flight and not engine.scheduler.running and not engine.scheduler.waiting
    engine.close()


def test_serving_after_ready_never_profiles_fits_or_captures(tmp_path, checkpoints):
    target, draft = checkpoints
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({**CAL, "contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 60}]}))
    engine, _, _ = start(serve_flags(target, draft, f"--adaptive_dspark_calibration={cal}"))
    before = engine.work_counters()
    prompts = [[5, 6, 7], list(range(10, 50)), [9], list(range(3, 30))]
    for batch in ([0], [0, 1], [1, 2, 3], [3]):
        engine.generate([prompts[i] for i in batch], SamplingParams(max_tokens=30, ignore_eos=True))
    assert engine.work_counters() == before
    # long contexts left the calibrated KV interval: those steps took the full-width path
    assert engine.counters.fallback_steps > 0
    engine.close()


def test_output_path_and_directory_are_checked_before_any_work(tmp_path, checkpoints):
    target, draft = checkpoints
    existing = tmp_path / "exists.json"
    existing.write_text("{}")
    with pytest.raises(TableError, match="already exists"):
        resolve_launch(parse_serve_args(serve_flags(target, draft, f"--adaptive_dspark_cost_table_output={existing}")))
    with pytest.raises(TableError, match="does not exist; create it before launch"):
        resolve_launch(parse_serve_args(serve_flags(target, draft, f"--adaptive_dspark_cost_table_output={tmp_path}/no/x.json")))


def test_adaptive_needs_a_confidence_head(tmp_path, checkpoints):
    from dspark_core.models.random_models import random_draft
    from dspark_core.models.speculators_io import load_draft, save_draft

    target, draft_dir = checkpoints
    shape = load_draft(draft_dir).config
    target_config = tiny_config(shape.target_vocab_size)
    plain = random_draft(target_config, block_size=7, enable_confidence_head=False, markov_rank=0)
    save_draft(plain, tmp_path / "plain")
    with pytest.raises(ConfigError, match="needs a draft with a confidence head"):
        build_engine(resolve_launch(parse_serve_args(serve_flags(target, tmp_path / "plain"))))
    # fixed-width DSpark keeps its own contract and accepts it
    engine = build_engine(resolve_launch(parse_serve_args(
        serve_flags(target, tmp_path / "plain", "--enable_adaptive_speculative_decode=false"))))
    engine.close()


def tiny_config(vocab: int):
    from dspark_core.models.random_models import tiny_target_config

    return tiny_target_config(vocab_size=vocab, num_layers=2, max_position=512)


@pytest.mark.parametrize("path,width", [("configs/demo-calibration.json", 7), ("configs/demo-calibration-k5.json", 5),
                                        ("configs/demo-calibration-bfloat16.json", 7),
                                        ("configs/demo-calibration-k5-bfloat16.json", 5)])
def test_shipped_demo_files_are_valid_for_their_width(path, width):
    root = Path(__file__).resolve().parents[1]
    geometry = Geometry.bucket_multiples(width, (1, 2, 4, 8, 16))
    plan = resolve_plan(width, geometry, 2048, read_calibration_file(str(root / path)), grid_check)
    stairs = "bfloat16" in path
    # float32: 4 points each in buckets 8 and 16; bfloat16: K=7 bucket 8 at 8, 16, 32, 40, 64 (K=5: every
    # multiple of 8) and every multiple of 16 in bucket 16
    large_buckets = ({7: 5, 5: 6}[width] + width + 1) if stairs else 4 + 4
    drafting = (width + 1) * 3 + large_buckets
    assert len(plan.points) == drafting + 2 * 5 and plan.settings.draft_width == width
    # every captured tier of buckets 1, 2 and 4 is measured, not priced through other buckets'
    # differences: those are the tiers between which the policy chooses on a CPU
    for bucket in (1, 2, 4):
        assert sorted(p.target_rows for p in plan.points if p.request_bucket == bucket and not p.draft_off) == \
            list(range(bucket, bucket * (width + 1) + 1, bucket))
    assert sorted({p.request_bucket for p in plan.points if p.draft_off}) == [1, 2, 4, 8, 16]
    if stairs:  # a bfloat16 target's cost climbs in stairs of 32 rows, which interpolation between
        # sparse probes would price as a ramp: bucket 16 every tier, bucket 8 also 40 (past 32)
        assert sorted(p.target_rows for p in plan.points if p.request_bucket == 16 and not p.draft_off) == \
            list(range(16, 16 * (width + 1) + 1, 16))
        assert 40 in {p.target_rows for p in plan.points if p.request_bucket == 8}


@pytest.mark.parametrize("width", [5, 7])
def test_the_demo_alias_probes_only_the_buckets_a_launch_captures(width):
    """`--adaptive_dspark_calibration=demo` with fewer than 16 requests per batch keeps the demo's
    points of the captured buckets; the same file given by path is refused, as any file would be."""
    from dspark_core.configs import demo_calibration_path

    flags = ["--model=/nonexistent", "--draft_model=/nonexistent", f"--num_speculative_tokens={width}",
             "--max_seqs_per_batch=4", "--captured_target_rows=bucket_multiples"]
    launch = resolve_launch(parse_serve_args([*flags, "--adaptive_dspark_calibration=demo"]))
    assert launch.geometry.request_buckets == (1, 2, 4)
    plan = resolve_plan(width, launch.geometry, 2048, launch.calibration_file, grid_check)
    assert plan.settings.request_buckets == (1, 2, 4)
    demo = read_calibration_file(str(demo_calibration_path(width)))
    for bucket in (1, 2, 4):  # the demo's own rows, untouched
        assert sorted(p.target_rows for p in plan.points if p.request_bucket == bucket and not p.draft_off) == \
            list(dict(demo.target_graph_rows)[bucket])
    as_file = resolve_launch(parse_serve_args([*flags, f"--adaptive_dspark_calibration={demo_calibration_path(width)}"]))
    with pytest.raises(ConfigError, match=r"request_buckets \[8, 16\] are not captured"):
        resolve_plan(width, as_file.geometry, 2048, as_file.calibration_file, grid_check)
