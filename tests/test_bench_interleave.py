"""``dspark-core bench --interleave``: one engine per policy, stepping in turns, each on its own clock."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dspark_core.bench.interleave import run_interleaved
from dspark_core.cli import main
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from checkpoint_support import write_tiny_pair
from engine_support import random_prompts, tiny_pair

DELAY = 0.02  # seconds every proposal of the slow draft sleeps: far longer than a tiny step


def slow_copy(draft):
    """The same draft, whose every proposal also sleeps DELAY (a draft too slow for its device)."""
    import copy

    slow = copy.deepcopy(draft)

    class Slow(type(draft)):
        def propose(self, *args, **kwargs):
            time.sleep(DELAY)
            return super().propose(*args, **kwargs)

    slow.__class__ = Slow
    return slow


def engine_for(target, draft, policy: str, options: dict, overlap: bool = False) -> Engine:
    return Engine(target, draft, EngineConfig(draft_width=5, request_buckets=(1, 2, 4), max_model_len=160,
                                              policy=policy, policy_options=options, schedule_overlap=overlap))


def test_each_policy_is_charged_only_its_own_steps():
    target, draft = tiny_pair()
    engines = {"slow-k2": engine_for(target, slow_copy(draft), "fixed", {"k": 2}),
               "none": engine_for(target, None, "none", {})}
    policies = {label: engine.policy for label, engine in engines.items()}
    prompts = random_prompts(5, seed=3)
    ended: list[int] = []
    cells = run_interleaved(engines, policies, prompts, [2], [5], 8, 2, finished=ended.append)
    assert sum(ended) == 2 * 2 * 5  # every measured request of both policies and both rounds, once
    by_name = {c.policy: c for c in cells}
    slow, plain = by_name["slow-k2"], by_name["none"]
    # both ran at the same time, but each clock only ran during its own engine's steps
    assert slow.wall_seconds >= DELAY * slow.steps
    assert plain.wall_seconds < 0.5 * slow.wall_seconds
    for cell in (slow, plain):
        assert len(cell.rounds) == 2 and len(cell.requests) == 10
        for part in cell.rounds:
            for record in part.requests:  # every stamp is a reading of the policy's own clock
                assert 0 <= record.submitted <= record.first_token <= record.finished <= part.wall_seconds
    # speculation stays exact: every request decoded the same tokens under both policies
    outputs = {name: {(r.prompt_index, r.token_ids) for r in cell.requests} for name, cell in by_name.items()}
    assert outputs["slow-k2"] == outputs["none"]
    reference = engine_for(target, None, "none", {})
    expected = reference.generate(prompts, SamplingParams(max_tokens=8))
    assert {(i, o.token_ids) for i, o in enumerate(expected)} == outputs["none"]
    for engine in [*engines.values(), reference]:
        assert not engine.has_work
        engine.close()


def test_engines_step_in_the_shuffled_turn_order_of_their_round():
    """Every turn of a round steps the engines in ``turn_order`` for that round, not a fixed rotation."""
    from dspark_core.bench.run import turn_order

    target, _ = tiny_pair()
    names = ["a", "b", "c", "d"]
    engines = {name: engine_for(target, None, "none", {}) for name in names}  # same work: all end together
    stepped: list[str] = []
    for name, engine in engines.items():
        def step(engine=engine, name=name, plain=engine.step):
            stepped.append(name)
            return plain()
        engine.step = step
    policies = {name: engine.policy for name, engine in engines.items()}
    run_interleaved(engines, policies, random_prompts(2, seed=5), [2], [2], 6, 2)
    turns = [stepped[i : i + 4] for i in range(0, len(stepped), 4)]
    per_round = len(turns) // 2
    assert len(turns) == 2 * per_round > 4
    for r in range(2):
        want = [turn_order(names, t, f"c2r{r}") for t in range(per_round)]
        assert turns[r * per_round : (r + 1) * per_round] == want
    assert len({tuple(t) for t in turns}) > 2  # the order changes from turn to turn
    for engine in engines.values():
        engine.close()


def test_interleaving_refuses_overlapped_engines_and_mismatched_labels():
    target, draft = tiny_pair()
    overlapped = engine_for(target, draft, "fixed", {"k": 2}, overlap=True)
    with pytest.raises(ValueError, match="without schedule overlap: \\['k2'\\]"):
        run_interleaved({"k2": overlapped}, {"k2": overlapped.policy}, [[3, 4]], [1], [1], 4, 1)
    overlapped.close()
    plain = engine_for(target, None, "none", {})
    with pytest.raises(ValueError, match="one engine per policy"):
        run_interleaved({"none": plain}, {"none": plain.policy, "k2": plain.policy}, [[3, 4]], [1], [1], 4, 1)


CALIBRATION = {"request_buckets": [1, 2, 4], "contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 120}],
               "warmup_steps": 1, "window_steps": 2, "windows_per_point": 1}


def test_a_sibling_engine_shares_weights_and_table_but_not_its_cache_or_draft(tmp_path):
    from dspark_core.calibration.install import bring_up
    from dspark_core.config import parse_serve_args
    from dspark_core.startup import build_engine, resolve_launch, sibling_engine

    target, draft = write_tiny_pair(tmp_path)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CALIBRATION))
    launch = resolve_launch(parse_serve_args([f"--model={target}", f"--draft_model={draft}", "--device=cpu",
                                              "--num_speculative_tokens=5", "--max_seqs_per_batch=4",
                                              "--acl_graph_decode_batch_size_limit=4",
                                              f"--adaptive_dspark_calibration={cal}"]))
    engine = build_engine(launch)
    bring_up(engine, launch, progress=False)
    twin = sibling_engine(engine, launch, with_draft=True, overlap=False)
    plain = sibling_engine(engine, launch, with_draft=False, overlap=False)
    assert twin.ready and plain.ready and twin.queue.depth == plain.queue.depth == 1
    assert twin.runner.target is engine.runner.target and plain.runner.target is engine.runner.target
    assert twin.table is engine.table and plain.table is engine.table
    assert twin.runner.draft is not None and twin.runner.draft is not engine.runner.draft
    assert plain.runner.draft is None and plain.policy.name == "none"
    assert twin.runner.target_cache.keys.data_ptr() != engine.runner.target_cache.keys.data_ptr()
    assert twin.runner.graphs is not engine.runner.graphs and twin.runner.graphs.sealed
    # all three decode the same tokens, one after another and while the others hold requests
    prompts = [engine.encode(p) for p in ("the", "he the", "t the he")]
    params = SamplingParams(max_tokens=6)
    held = [engine.add_request(p, params) for p in prompts]
    engine.step()
    outputs = [[o.token_ids for o in e.generate(prompts, params)] for e in (twin, plain)]
    while engine.has_work:
        engine.step()
    assert outputs[0] == outputs[1] == [tuple(r.output) for r in held]
    for e in (engine, twin, plain):
        e.close()


def test_bench_interleave_end_to_end(tmp_path, capsys):
    target, draft = write_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the", "he the", "t", "the the he", "hhh"]))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CALIBRATION))
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    code = main(["bench", f"--model={target}", f"--draft_model={draft}", "--num_speculative_tokens=5", "--device=cpu",
                 f"--prompts={prompts}", "--concurrency=1,4", "--prompts_per_concurrency=2,5", "--max_tokens=6",
                 "--rounds=2", f"--calibration={cal}", f"--output_dir={out}", "--json", "--interleave",
                 "--policies=none,adaptive,fixed-k2", "--max_seqs_per_batch=4"])
    torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["settings"]["interleave"] is True
    assert result["exactness"]["identical"] and result["exactness"]["checked_prompts"] == 7  # 2 at one request, 5 at four
    rows = result["results"]
    assert {(r["policy"], r["concurrency"]) for r in rows} == {(p, c) for p in ("none", "adaptive", "fixed-k2")
                                                               for c in (1, 4)}
    for row in rows:
        assert row["rounds"] == 2 and row["requests"] == 2 * (2 if row["concurrency"] == 1 else 5)
        assert row["wall_seconds"] > 0 and row["tpot_ms_mean"] > 0 and row["vs_target_only"] > 0
    assert "Interleaved" in (out / "results.md").read_text()


def test_interleave_needs_the_in_process_engine(capsys):
    assert main(["bench", "--url=http://127.0.0.1:9", "--interleave"]) == 2
    assert "--interleave needs the in-process engine" in capsys.readouterr().err


def test_interleave_refuses_engines_that_would_not_fit(monkeypatch):
    from dspark_core.commands import bench
    from dspark_core.errors import ConfigError

    target, draft = tiny_pair()
    engine = engine_for(target, draft, "fixed", {"k": 2})
    each = bench.cache_bytes(engine)
    assert each == 2 * engine.runner.target_cache.keys.nbytes > 0
    monkeypatch.setattr(bench, "free_bytes", lambda device: int(3.5 * each))
    bench.check_room_for_engines(engine, 3)  # 3 caches in 3.5 caches' room: fits
    with pytest.raises(ConfigError, match=r"--interleave: 4 more engines need .* GiB of KV cache"):
        bench.check_room_for_engines(engine, 4)
    monkeypatch.setattr(bench, "free_bytes", lambda device: None)  # unknown: no check
    bench.check_room_for_engines(engine, 100)
    engine.close()


def test_bench_interleave_refuses_before_calibrating_when_engines_would_not_fit(tmp_path, capsys, monkeypatch):
    import dspark_core.calibration.install as install
    from dspark_core.commands import bench

    target, draft = write_tiny_pair(tmp_path)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CALIBRATION))
    monkeypatch.setattr(bench, "free_bytes", lambda device: 1)
    calibrated = []
    monkeypatch.setattr(install, "bring_up", lambda *args, **kwargs: calibrated.append(args))
    code = main(["bench", f"--model={target}", f"--draft_model={draft}", "--num_speculative_tokens=5", "--device=cpu",
                 "--interleave", "--policies=none,adaptive,fixed-k2", "--copy_proposals=both",
                 "--max_seqs_per_batch=4", f"--calibration={cal}", f"--output_dir={tmp_path / 'out'}"])
    assert code == 2 and not calibrated and not (tmp_path / "out").exists()
    # target-only, then adaptive and fixed-k2 with and without copies: four engines past the first
    assert "dspark-core bench: error: --interleave: 4 more engines need" in capsys.readouterr().err
