"""The benchmark on a tiny checkpoint: every policy runs, outputs are identical, files are written."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark_core.bench.exactness import TIE_MARGIN, classify, compare, hold_top_two, next_logits, tie_margin_for
from dspark_core.bench.report import add_ratios, exactness, markdown, summarize
from dspark_core.bench.run import CellRecord, RequestRecord, pool, round_order, turn_order
from dspark_core.cli import main
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from dspark_core.models.reference import greedy_generate
from dspark_core.table import load_table
from checkpoint_support import write_tiny_pair
from engine_support import tiny_pair


def test_bench_in_process_end_to_end(tmp_path, capsys):
    target, draft = write_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the", "he the", "t", "the the he", "hhh"]))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"request_buckets": [1, 2, 4], "contexts": [
        {"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 120}],
        "warmup_steps": 1, "window_steps": 2, "windows_per_point": 1}))
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    code = main(["bench", f"--model={target}", f"--draft_model={draft}", "--num_speculative_tokens=5", "--cpu_threads=3",
                 f"--prompts={prompts}", "--concurrency=1,4", "--prompts_per_concurrency=1,4", "--max_tokens=6",
                 "--rounds=3", f"--calibration={cal}", f"--output_dir={out}", "--json", "--device=cpu",
                 '--policy_variants={"adaptive-m0": ["adaptive", {"draft_off_margin": 0}]}'])
    assert code == 0
    assert torch.get_num_threads() == 3  # --cpu_threads reached the CPU device's launch
    torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out)
    assert result["exactness"]["identical"] and result["exactness"]["checked_prompts"] == 5
    rows = result["results"]
    policies = {r["policy"] for r in rows}
    assert policies == {"adaptive", "adaptive-m0", "none", "threshold", "argmax-notier", "stale-argmax",
                        "min-gain"} | {f"fixed-k{k}" for k in range(1, 6)}
    for row in rows:
        # drafting policies report how often they left the draft off; target-only has no such figure
        if row["policy"] == "none":
            assert math.isnan(row["draft_off_rate"])
        else:
            assert 0.0 <= row["copy_step_rate"] <= row["draft_off_rate"] <= 1.0
        # three real rounds: each ran every prompt of its concurrency, and every ratio has a spread
        assert row["rounds"] == 3 and row["requests"] == 3 * row["concurrency"]
        assert len(row["per_round"]["output_tokens_per_second"]) == 3
        for ratio in ("vs_fixed_full_width", "vs_best_fixed"):
            s = row["spread"][ratio]
            assert 0 < s["min"] <= s["median"] <= s["max"]
            assert sorted(row["per_round"][ratio])[1] == pytest.approx(s["median"])
    for c in (1, 4):
        same = {r["policy"]: r for r in rows if r["concurrency"] == c}
        best = same["adaptive"]["best_fixed"]
        assert best == max((p for p in same if p.startswith("fixed-k")),
                           key=lambda p: same[p]["output_tokens_per_second"])
        # each round's ratio divides by the baseline's run of that same round
        for name, row in same.items():
            mine, theirs = row["per_round"]["output_tokens_per_second"], same[best]["per_round"]["output_tokens_per_second"]
            assert row["per_round"]["vs_best_fixed"] == pytest.approx([a / b for a, b in zip(mine, theirs)])
        assert same["fixed-k5"]["oracle_model_tokens_per_second"] > 0 and same["fixed-k5"]["model_tokens_per_second"] > 0
        assert math.isnan(same["fixed-k4"]["oracle_model_tokens_per_second"])  # only full width knows the oracle
        # adaptive forecasts every step; fixed widths forecast none
        assert same["adaptive"]["forecast_steps"] > 0 and same["adaptive"]["predicted_over_realized"] > 0
        assert same["fixed-k2"]["forecast_steps"] == 0 and math.isnan(same["fixed-k2"]["predicted_over_realized"])
        # every decode step was timed: full width only drafts, target-only never does
        assert same["fixed-k5"]["drafted_step_ms"] > 0 and same["none"]["draft_off_step_ms"] > 0
        assert math.isnan(same["none"]["drafted_step_ms"])
    none = next(r for r in rows if r["policy"] == "none")
    assert none["mean_verify_width"] == 0 and none["accepted_length"] == pytest.approx(1.0)
    # the cost table prices a draft `none` never runs: no model or oracle figures for it
    assert math.isnan(none["model_tokens_per_second"]) and math.isnan(none["model_vs_oracle"])
    table = (out / "results.md").read_text()
    assert table.count("| adaptive |") == 2 and "pred/real" in table and "vs best min/med/max" in table
    assert (out / "throughput_tpot.png").stat().st_size > 1000
    # the calibrated table the run priced its steps with is kept next to the results
    saved = load_table(out / "cost-table.json")
    assert saved.draft_width == 5 and saved.fits[0].coverage.draft_off_buckets == (1, 2, 4)


def test_a_cell_leaves_nothing_in_flight_for_the_next_one():
    """With schedule overlap a step is launched for requests that then finish; the engine drains it
    once no request runs, inside the cell that launched it (its policy observes it), so the next
    cell's clock starts with nothing in flight."""
    from dspark_core.bench.run import run_cell
    from dspark_core.engine.engine import Engine, EngineConfig

    target, draft = tiny_pair()
    engine = Engine(target, draft, EngineConfig(draft_width=5, request_buckets=(1, 2, 4), max_model_len=160,
                                                policy="fixed", schedule_overlap=True))
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    cell = CellRecord("fixed", 2)
    run_cell(engine, engine.policy, prompts, [0, 1, 2], 2, 6, cell)
    assert not engine.has_work and not engine.queue.in_flight
    assert cell.steps == engine.counters.steps  # every launched step was observed by this cell
    engine.close()


def test_each_concurrency_warms_up_untimed_before_its_first_round():
    """The warm-up pass runs the concurrency's prompts with the given policy and is in no cell."""
    from dspark_core.bench.run import WARMUP_TOKENS, run_benchmark
    from dspark_core.engine.engine import Engine, EngineConfig

    target, draft = tiny_pair()
    engine = Engine(target, draft, EngineConfig(draft_width=5, request_buckets=(1, 2, 4), max_model_len=160,
                                                policy="fixed"))
    warmup, measured = engine.hooks.budget_policy("none", {}), engine.hooks.budget_policy("fixed", {"k": 2})
    seen = []
    engine.add_observer(lambda report: seen.append(engine.policy))
    cells = run_benchmark(engine, {"fixed-k2": measured}, [[3, 4, 5], [6, 7]], [1, 2], [2, 2], 6, 1, warmup=warmup)
    engine.close()
    assert [c.policy for c in cells] == ["fixed-k2", "fixed-k2"]
    assert sum(c.steps for c in cells) == sum(p is measured for p in seen)
    assert sum(p is warmup for p in seen) >= 2 * (WARMUP_TOKENS - 1)  # two prompts, one at a time, then two at once
    assert seen[0] is warmup  # before anything is measured


def _cell(policy, walls, tokens=5, *, uses_draft=True, model=0.5, oracle=0.25, predicted=0.0, committed=0):
    """A pooled cell of len(walls) rounds; each round decodes one request of ``tokens`` tokens."""
    rounds = []
    for wall in walls:
        part = CellRecord(policy, 2, wall_seconds=wall, steps=4, model_seconds=model, oracle_seconds=oracle,
                          model_steps_covered=4, uses_draft=uses_draft, predicted_tokens=predicted,
                          forecast_committed=committed, forecast_steps=4 if committed else 0)
        part.requests = [RequestRecord(0, 0.0, 0.5, 1.5, tuple(range(tokens)), verified=4, accepted=2, steps=2,
                                       verify_widths=[2, 2])]
        rounds.append(part)
    return pool(policy, 2, rounds)


def test_summary_definitions_on_a_hand_made_cell():
    cell = CellRecord("fixed-k2", 2, wall_seconds=2.0, steps=4, fallback_steps=1, draft_off_steps=2, copy_steps=1,
                      model_seconds=0.5, oracle_seconds=0.25, model_steps_covered=4)
    cell.requests = [RequestRecord(0, 0.0, 0.5, 1.5, (1, 2, 3, 4, 5), verified=4, accepted=2, steps=2,
                                   verify_widths=[2, 2]),
                     RequestRecord(1, 0.0, 1.0, 2.0, (1, 2, 3), verified=4, accepted=0, steps=2, verify_widths=[2, 2])]
    row = summarize(cell, "fixed-k2")
    assert row["output_tokens_per_second"] == pytest.approx(8 / 2.0)
    assert row["acceptance_rate"] == pytest.approx(2 / 8)
    assert row["accepted_length"] == pytest.approx((2 + 4) / 4)
    assert row["tpot_ms_mean"] == pytest.approx(1e3 * (0.25 + 0.5) / 2)
    assert row["fallback_rate"] == pytest.approx(0.25)
    assert row["draft_off_rate"] == pytest.approx(0.5) and row["copy_step_rate"] == pytest.approx(0.25)
    # target-only decoding never drafts: its share of draft-off steps is not a figure
    plain = summarize(CellRecord("none", 2, wall_seconds=1.0, steps=4, draft_off_steps=4, uses_draft=False))
    assert math.isnan(plain["draft_off_rate"]) and math.isnan(plain["copy_step_rate"])
    pooled = pool("adaptive", 2, [CellRecord("adaptive", 2, steps=4, draft_off_steps=1, copy_steps=1),
                                  CellRecord("adaptive", 2, steps=4, draft_off_steps=3)])
    assert (pooled.steps, pooled.draft_off_steps, pooled.copy_steps) == (8, 4, 1)
    assert row["model_tokens_per_second"] == pytest.approx(6 / 0.5)
    assert row["oracle_model_tokens_per_second"] == pytest.approx(6 / 0.25)
    assert row["rounds"] == 1 and math.isnan(row["predicted_over_realized"])
    assert "| fixed-k2 | 2 |" in markdown([row])
    # measured step times: medians per kind, pooled over rounds (NaN where a cell ran no such step)
    timed = pool("adaptive", 2, [CellRecord("adaptive", 2, drafted_step_seconds=[0.2, 0.4], off_step_seconds=[0.1]),
                                 CellRecord("adaptive", 2, drafted_step_seconds=[0.3])])
    figures = summarize(timed)
    assert figures["drafted_step_ms"] == pytest.approx(300.0) and figures["draft_off_step_ms"] == pytest.approx(100.0)
    assert math.isnan(summarize(CellRecord("none", 2, wall_seconds=1.0))["drafted_step_ms"])
    assert "| 300.0 | 100.0 |" in markdown([figures])


def test_ratios_and_their_spread_over_rounds():
    # three rounds; the wall seconds are chosen so every ratio is known by hand
    cells = [_cell("fixed-k1", [1.0, 1.0, 1.0]),  # 5 tok/s each round
             _cell("fixed-k2", [0.5, 1.0, 0.25]),  # full width (K=2): 10, 5, 20 tok/s; the best fixed pooled
             _cell("adaptive", [0.5, 0.5, 0.5], predicted=12.0, committed=8),  # 10 tok/s each round
             _cell("none", [0.25, 0.5, 1.0], uses_draft=False)]  # 20, 10, 5 tok/s
    rows = [summarize(c, "fixed-k2") for c in cells]
    add_ratios(rows, 2)
    k1, k2, adaptive, none = rows
    assert k2["output_tokens_per_second"] == pytest.approx(15 / 1.75)
    assert adaptive["best_fixed"] == "fixed-k2"
    assert adaptive["vs_fixed_full_width"] == pytest.approx(10 / (15 / 1.75))
    assert adaptive["per_round"]["vs_best_fixed"] == pytest.approx([1.0, 2.0, 0.5])
    assert adaptive["spread"]["vs_best_fixed"] == pytest.approx({"min": 0.5, "median": 1.0, "max": 2.0})
    assert k1["spread"]["vs_fixed_full_width"] == pytest.approx({"min": 0.25, "median": 0.5, "max": 1.0})
    assert none["spread"]["vs_best_fixed"] == pytest.approx({"min": 0.25, "median": 2.0, "max": 2.0})
    # against target-only (20, 10, 5 tok/s): adaptive 10 each round, pooled 30 tokens / 1.75 s
    assert adaptive["vs_target_only"] == pytest.approx(10 / (15 / 1.75))
    assert adaptive["per_round"]["vs_target_only"] == pytest.approx([0.5, 1.0, 2.0])
    assert none["spread"]["vs_target_only"] == pytest.approx({"min": 1.0, "median": 1.0, "max": 1.0})
    # model figures: 4 decode tokens per round at 0.5 s modelled; the oracle (read off full width) at 0.25 s
    assert adaptive["model_vs_oracle"] == pytest.approx(0.5)
    assert adaptive["spread"]["model_vs_oracle"]["median"] == pytest.approx(0.5)
    assert adaptive["predicted_over_realized"] == pytest.approx(1.5)
    assert adaptive["spread"]["predicted_over_realized"]["max"] == pytest.approx(1.5)
    for key in ("model_tokens_per_second", "oracle_model_tokens_per_second", "model_vs_oracle"):
        assert math.isnan(none[key])
    assert math.isnan(none["spread"]["model_vs_oracle"]["median"])
    table = markdown(rows)
    assert "| adaptive | 2 |" in table and "| 0.50/1.00/2.00 |" in table and "| 1.50 |" in table


def test_round_order_rotates_every_policy_through_different_places():
    names = ["adaptive", "none"] + [f"fixed-k{k}" for k in range(1, 8)] + ["threshold", "min-gain"]
    orders = [round_order(names, r, 3) for r in range(3)]
    assert all(sorted(o) == sorted(names) for o in orders)
    for name in names:
        assert len({o.index(name) for o in orders}) == 3  # a different place each round
    assert [o[0] for o in orders] == ["adaptive", "fixed-k2", "fixed-k6"]


def test_turn_order_changes_every_engines_neighbours_and_is_reproducible():
    """A rotation by one keeps each engine behind the same neighbour; the shuffled turn order must not."""
    names = ["none@padded", "none@live", "adaptive@padded", "adaptive@live"]
    orders = [turn_order(names, turn, "c16r0") for turn in range(200)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders == [turn_order(names, turn, "c16r0") for turn in range(200)]  # seeded by the run and turn
    assert orders != [turn_order(names, turn, "c16r1") for turn in range(200)]  # another round, other orders
    for name in names:
        first = sum(o[0] == name for o in orders)
        assert 25 <= first <= 75  # each goes first about a quarter of the turns
        behind = [o[o.index(name) - 1] for o in orders if o.index(name) > 0]
        for other in set(names) - {name}:  # and follows each other engine about a third of its turns
            assert 0.2 < behind.count(other) / len(behind) < 0.47


def test_exactness_reports_mismatches():
    a, b = CellRecord("a", 1), CellRecord("b", 1)
    a.requests = [RequestRecord(0, 0, token_ids=(1, 2))]
    b.requests = [RequestRecord(0, 0, token_ids=(1, 3))]
    result = exactness([a, b])
    assert not result["identical"] and result["mismatches"][0]["policies"] == ["a", "b"]
    # one policy disagreeing with itself across rounds is a mismatch too
    c = CellRecord("a", 1)
    c.requests = [RequestRecord(0, 0, token_ids=(1, 2))]
    result = exactness([pool("a", 1, [a, c]), pool("b", 1, [b, c])])
    assert not result["identical"]
    assert exactness([pool("a", 1, [a, c]), pool("b", 1, [c, a])])["identical"]


def test_bench_against_a_server_over_http():
    from dspark_core.bench.client import run_against_server
    from dspark_core.server.app import build_app
    from dspark_core.server.http import BackgroundServer
    from dspark_core.server.service import AsyncEngineService
    from dspark_core.server.testing import tiny_engine

    engine = tiny_engine(3, policy="fixed", options={"k": 3}, eos=False)
    reference = tiny_engine(3, policy="none", options={}, eos=False)
    service = AsyncEngineService(engine)
    service.mark_ready()
    prompts = ["hello", "abc", "the cat"]
    with BackgroundServer(build_app(service, model_name="tiny")) as server:
        cells = run_against_server(server.url + "/", prompts, [1, 2], [2, 3], 6, rounds=2)
    assert [len(cell.per_round()) for cell in cells] == [2, 2]
    assert [len(cell.requests) for cell in cells] == [4, 6]
    expected = reference.generate([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=6))
    for cell in cells:
        assert cell.wall_seconds > 0
        for record in cell.requests:
            assert record.token_ids == expected[record.prompt_index].token_ids[:6]
            assert record.steps >= 1 and record.first_token >= record.submitted
    row = summarize(cells[1])
    assert row["requests"] == 6 and row["mean_verify_width"] > 0  # two rounds of three


def test_bench_against_a_server_says_what_is_wrong_with_it():
    from dspark_core.bench.client import ServerError, run_against_server
    from dspark_core.server.app import build_app
    from dspark_core.server.http import BackgroundServer
    from dspark_core.server.service import AsyncEngineService
    from dspark_core.server.testing import tiny_engine

    with pytest.raises(ServerError, match=r"cannot reach http://127.0.0.1:9 .*is the server running"):
        run_against_server("http://127.0.0.1:9", ["hi"], [1], [1], 4)
    service = AsyncEngineService(tiny_engine(3, policy="none", options={}, eos=False))
    with BackgroundServer(build_app(service, model_name="tiny")) as server:
        with pytest.raises(ServerError, match="/ready answered HTTP 503: the server is not ready yet"):
            run_against_server(server.url, ["hi"], [1], [1], 4)
        service.mark_ready()
        with pytest.raises(ServerError, match=r"answered prompt 0 with HTTP 400: .*max_tokens"):
            run_against_server(server.url, ["hi"], [1], [1], 10**6)


def test_exactness_classifier_tells_near_ties_from_real_differences():
    target, _ = tiny_pair(seed=3)
    prompt = [5, 9, 17, 2]
    reference = greedy_generate(target, prompt, 6, eos_token_ids=())
    assert classify(target, 0, prompt, reference, reference) is None
    values, indices = next_logits(target, prompt + reference[:3]).topk(2)
    (best, second), gap = indices.tolist(), float(values[0] - values[1])
    assert best == reference[3] and gap > 0
    runner_up = reference[:3] + [second, 1, 2]
    found = classify(target, 0, prompt, reference, runner_up)
    assert (found.position, found.expected, found.got, found.top2) == (3, best, second, True)
    assert found.top2_gap == pytest.approx(gap) and found.kind == ("near-tie" if gap <= TIE_MARGIN else "real")
    assert classify(target, 0, prompt, reference, runner_up, tie_margin=gap).kind == "near-tie"
    assert classify(target, 0, prompt, reference, runner_up, tie_margin=gap / 2).kind == "real"
    # a token outside the target's top two is real whatever the margin; so is an output cut short
    third = next(t for t in range(100) if t not in (best, second))
    assert classify(target, 0, prompt, reference, reference[:3] + [third], tie_margin=1e9).kind == "real"
    short = classify(target, 0, prompt, reference, reference[:4], tie_margin=1e9)
    assert (short.position, short.got, short.kind) == (4, None, "real")
    summary = compare(target, [prompt] * 3, [reference] * 3, [reference, runner_up, reference[:4]], tie_margin=gap)
    assert (summary["identical"], summary["near_tie"], summary["real"]) == (1, 1, 1)
    assert summary["matching_prefix_tokens"] == 6 + 3 + 4


def test_exact_ties_count_as_the_two_best_and_margins_follow_the_dtype():
    # bfloat16 logits are coarse: three tokens may share the best value, and any two of them are a tie
    logits = torch.tensor([1.0, 4.0, 4.0, 4.0, 3.5])
    assert hold_top_two(logits, 1, 3) == (True, 0.0) and hold_top_two(logits, 3, 2)[0]
    assert not hold_top_two(logits, 1, 4)[0] and not hold_top_two(logits, 1, 1)[0]  # below the two best; same token
    distinct = torch.tensor([1.0, 4.0, 3.75, 3.5])
    assert hold_top_two(distinct, 2, 1) == (True, 0.25) and not hold_top_two(distinct, 1, 3)[0]
    assert not hold_top_two(distinct, 1, None)[0]  # an output that ended
    assert tie_margin_for("float32") == TIE_MARGIN and tie_margin_for("bfloat16") == 0.25
    assert tie_margin_for("float8") == TIE_MARGIN  # none stated: float32's, the strict one


def test_policy_list_accepts_single_fixed_widths():
    from types import SimpleNamespace

    from dspark_core.commands.bench import _policies
    from dspark_core.plugins import default_hooks

    engine = SimpleNamespace(hooks=default_hooks())
    chosen = _policies(engine.hooks, ["adaptive", "fixed-k1", "fixed-k3"], 5)
    assert list(chosen) == ["adaptive", "fixed-k1", "fixed-k3"]
    assert (chosen["fixed-k1"].k, chosen["fixed-k3"].k) == (1, 3)
    assert len(_policies(engine.hooks, ["fixed"], 5)) == 5
    with pytest.raises(ConfigError, match="fixed-k6 needs 1 <= k <= K=5"):
        _policies(engine.hooks, ["fixed-k6"], 5)


def test_policy_variants_build_labelled_policies_and_name_what_is_wrong():
    from dspark_core.commands.bench import _policies, parse_variants
    from dspark_core.plugins import default_hooks

    hooks = default_hooks()
    variants = parse_variants('{"m0": ["adaptive", {"draft_off_margin": 0}], "k2": ["fixed", {"k": 2}]}')
    chosen = _policies(hooks, ["adaptive"], 5, variants)
    assert list(chosen) == ["adaptive", "m0", "k2"]
    assert chosen["m0"].draft_off_margin == 0 and chosen["adaptive"].draft_off_margin == 1.0 and chosen["k2"].k == 2
    for text, message in [("{bad", "not valid JSON"), ("[1]", "expected a JSON object"),
                          ('{"m0": "adaptive"}', "'m0' must be"), ('{"m0": ["adaptive"]}', "'m0' must be")]:
        with pytest.raises(ConfigError, match=message):
            parse_variants(text)
    with pytest.raises(ConfigError, match="'adaptive' is already a policy"):
        _policies(hooks, ["adaptive"], 5, parse_variants('{"adaptive": ["adaptive", {}]}'))
    with pytest.raises(ConfigError, match="'m1': .*draft_off_margin must be"):
        _policies(hooks, [], 5, parse_variants('{"m1": ["adaptive", {"draft_off_margin": -1}]}'))
    with pytest.raises(ConfigError, match="'x': .*no budget policy named 'nope'"):
        _policies(hooks, [], 5, parse_variants('{"x": ["nope", {}]}'))


def test_bench_refuses_bad_variants_before_loading_anything(tmp_path, capsys):
    # no model at this path: the variants are checked first, so the error is about them
    assert main(["bench", f"--model={tmp_path / 'missing.gguf'}", '--policy_variants={"x": ["nope", {}]}']) == 2
    assert "dspark-core bench: error: --policy_variants: 'x'" in capsys.readouterr().err
    assert main(["bench", "--url=http://127.0.0.1:9", '--policy_variants={"m0": ["adaptive", {}]}']) == 2
    assert "needs the in-process engine" in capsys.readouterr().err
    assert main(["bench", "--url=http://127.0.0.1:9", "--rounds=0"]) == 2
    assert "dspark-core bench: error: --rounds must be at least 1" in capsys.readouterr().err
    assert main(["bench", "--url=http://127.0.0.1:9", "--max_tokens=0"]) == 2
    assert "dspark-core bench: error: --max_tokens must be at least 1, got 0" in capsys.readouterr().err
    assert main(["bench", "--url=http://127.0.0.1:9", "--policies=adaptive"]) == 2
    assert "--policies needs the in-process engine" in capsys.readouterr().err
    assert main(["bench", f"--model={tmp_path / 'missing.gguf'}", "--policies= , "]) == 2
    assert "dspark-core bench: error: --policies: no policy named in ' , '" in capsys.readouterr().err
    # the output directory is checked before any work: a file in its place, or an earlier run's results
    (tmp_path / "a-file").write_text("")
    assert main(["bench", "--url=http://127.0.0.1:9", f"--output_dir={tmp_path / 'a-file'}"]) == 2
    assert "--output_dir: " + str(tmp_path / "a-file") + " exists and is not a directory" in capsys.readouterr().err
    assert main(["bench", "--url=http://127.0.0.1:9", f"--output_dir={tmp_path / 'a-file' / 'sub'}"]) == 2
    assert "a-file is not a directory" in capsys.readouterr().err
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "results.json").write_text("{}")
    assert main(["bench", "--url=http://127.0.0.1:9", f"--output_dir={tmp_path / 'done'}"]) == 2
    assert "already holds a run's results (results.json); choose another directory or pass --overwrite" \
        in capsys.readouterr().err
    assert (tmp_path / "done" / "results.json").read_text() == "{}"
    # with --overwrite the check passes, and the run fails on the server that is not there
    assert main(["bench", "--url=http://127.0.0.1:9", f"--output_dir={tmp_path / 'done'}", "--overwrite"]) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    # fewer prompts than requests in flight would never reach the concurrency the cell is named after
    assert main(["bench", "--url=http://127.0.0.1:9", "--concurrency=1,16", "--prompts_per_concurrency=4,8"]) == 2
    err = capsys.readouterr().err
    assert "--prompts_per_concurrency: 8 prompts never reach concurrency 16; give it at least 16" in err


def test_bench_defaults_run_every_concurrency_in_several_waves():
    from dspark_core.commands.bench import DEFAULT_PROMPTS_PER_CONCURRENCY
    from dspark_core.cli import build_parser

    args = build_parser().parse_args(["bench"])
    assert args.prompts_per_concurrency == list(DEFAULT_PROMPTS_PER_CONCURRENCY)
    # several requests at one request, and three waves wherever requests share a step
    for concurrency, count in zip(args.concurrency, args.prompts_per_concurrency, strict=True):
        assert count >= (3 * concurrency if concurrency > 1 else 4), (concurrency, count)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a host without CUDA")
def test_bench_device_flag_reaches_the_launch_and_fails_clearly_without_cuda(tmp_path, capsys):
    # the device is resolved before the model is read: the error names the device, not the missing file
    code = main(["bench", f"--model={tmp_path / 'missing.gguf'}", "--device=cuda"])
    assert code == 2
    assert "device=cuda: this PyTorch build sees no CUDA device" in capsys.readouterr().err


def test_bench_runs_a_policy_from_a_plugin_module(tmp_path, capsys, monkeypatch):
    """A policy loaded with --plugin (no entry point) can be named in --policies, as serve's flag allows."""
    (tmp_path / "bench_policy_plugin.py").write_text(
        "from dspark_core.hookspecs import hookimpl\n"
        "from dspark_plugins.policies.fixed import FixedPolicy\n\n"
        "@hookimpl\n"
        "def dspark_budget_policy(name, options):\n"
        "    return FixedPolicy(2) if name == 'two-always' else None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    target, draft = write_tiny_pair(tmp_path)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"request_buckets": [1], "contexts": [
        {"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 120}],
        "warmup_steps": 1, "window_steps": 2, "windows_per_point": 1}))
    flags = ["bench", f"--model={target}", f"--draft_model={draft}", "--num_speculative_tokens=5", "--concurrency=1",
             "--prompts_per_concurrency=1", "--max_tokens=6", "--rounds=1", f"--calibration={cal}", "--json",
             "--device=cpu", "--max_seqs_per_batch=1", "--policies=none,two-always", f"--output_dir={tmp_path / 'out'}"]
    assert main(flags) == 2  # without the plugin the name is unknown, before any model is loaded
    assert "no budget policy named 'two-always'" in capsys.readouterr().err
    assert main([*flags, "--plugin=bench_policy_plugin"]) == 0
    rows = {row["policy"]: row for row in json.loads(capsys.readouterr().out)["results"]}
    assert 1 < rows["two-always"]["mean_verify_width"] <= 2  # the last step of an answer may verify less
