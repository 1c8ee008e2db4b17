"""The benchmark on a tiny checkpoint: every policy runs, outputs are identical, files are written."""

from __future__ import annotations

import json

import pytest

from dspark_core.bench.report import add_ratios, exactness, markdown, summarize
from dspark_core.bench.run import CellRecord, RequestRecord
from dspark_core.cli import main
from dspark_core.engine.request import SamplingParams
from checkpoint_support import write_tiny_pair


def test_bench_in_process_end_to_end(tmp_path, capsys):
    target, draft = write_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the", "he the", "t", "the the he", "hhh"]))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"request_buckets": [1, 2, 4], "contexts": [
        {"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 120}],
        "warmup_steps": 1, "window_steps": 2, "windows_per_point": 1}))
    out = tmp_path / "out"
    code = main(["bench", f"--model={target}", f"--draft_model={draft}", "--num_speculative_tokens=5",
                 f"--prompts={prompts}", "--concurrency=1,4", "--prompts_per_concurrency=2,5", "--max_tokens=8",
                 f"--calibration={cal}", f"--output_dir={out}", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["exactness"]["identical"] and result["exactness"]["checked_prompts"] == 7
    policies = {r["policy"] for r in result["results"]}
    assert policies == {"adaptive", "none", "threshold", "argmax-notier", "stale-argmax", "min-gain"} | {
        f"fixed-k{k}" for k in range(1, 6)}
    full = [r for r in result["results"] if r["policy"] == "fixed-k5"]
    assert all(r["vs_fixed_full_width"] == pytest.approx(1.0) for r in full)
    assert all(r["oracle_model_tokens_per_second"] > 0 for r in full)
    none = next(r for r in result["results"] if r["policy"] == "none")
    assert none["mean_verify_width"] == 0 and none["accepted_length"] == pytest.approx(1.0)
    assert (out / "results.json").is_file() and (out / "results.md").read_text().count("| adaptive |") == 2
    assert (out / "throughput_tpot.png").stat().st_size > 1000


def test_summary_definitions_on_a_hand_made_cell():
    cell = CellRecord("fixed-k2", 2, wall_seconds=2.0, steps=4, fallback_steps=1, model_seconds=0.5,
                      oracle_seconds=0.25, model_steps_covered=4)
    cell.requests = [RequestRecord(0, 0.0, 0.5, 1.5, (1, 2, 3, 4, 5), verified=4, accepted=2, steps=2,
                                   verify_widths=[2, 2]),
                     RequestRecord(1, 0.0, 1.0, 2.0, (1, 2, 3), verified=4, accepted=0, steps=2, verify_widths=[2, 2])]
    row = summarize(cell, "fixed-k2")
    assert row["output_tokens_per_second"] == pytest.approx(8 / 2.0)
    assert row["acceptance_rate"] == pytest.approx(2 / 8)
    assert row["accepted_length"] == pytest.approx((2 + 4) / 4)
    assert row["tpot_ms_mean"] == pytest.approx(1e3 * (0.25 + 0.5) / 2)
    assert row["fallback_rate"] == pytest.approx(0.25)
    assert row["oracle_model_tokens_per_second"] == pytest.approx(6 / 0.25)
    add_ratios([row], 2)
    assert row["vs_best_fixed"] == pytest.approx(1.0) and "| fixed-k2 | 2 |" in markdown([row])


def test_exactness_reports_mismatches():
    a, b = CellRecord("a", 1), CellRecord("b", 1)
    a.requests = [RequestRecord(0, 0, token_ids=(1, 2))]
    b.requests = [RequestRecord(0, 0, token_ids=(1, 3))]
    result = exactness([a, b])
    assert not result["identical"] and result["mismatches"][0]["policies"] == ["a", "b"]


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
        cells = run_against_server(server.url, prompts, [1, 2], [2, 3], 6)
    expected = reference.generate([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=6))
    for cell in cells:
        assert cell.wall_seconds > 0
        for record in cell.requests:
            assert record.token_ids == expected[record.prompt_index].token_ids[:6]
            assert record.steps >= 1 and record.first_token >= record.submitted
    row = summarize(cells[1])
    assert row["requests"] == 3 and row["mean_verify_width"] > 0
